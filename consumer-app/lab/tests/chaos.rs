//! The chaos harness at CI size, per Postgres store (sqlx also in batched
//! mode), and against a deliberately broken store (which it must catch). Needs PostgreSQL and a
//! local RabbitMQ with `rabbitmqctl` (`bash .ci/services.sh`).
//!
//! The runs are serialised: each already loads both cores.

use std::sync::Mutex;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `parcel-chaos` with `args`; returns (exit code, stdout).
fn chaos(args: &[&str]) -> (Option<i32>, String) {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_parcel-chaos"))
        .args(["--consume-binary", env!("CARGO_BIN_EXE_parcel-lab-consume")])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run parcel-chaos");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    (output.status.code(), stdout)
}

/// The CI size: 2,000 events (+15 % copies, +6 % bad), 3 consumers, 6 kill -9,
/// 6 pg_terminate_backend, 6 close_connection.
const CI: &[&str] = &[
    "--consumers",
    "3",
    "--events",
    "2000",
    "--kills",
    "6",
    "--seed",
    "20261202",
];

fn field(stdout: &str, name: &str) -> u64 {
    let result = stdout
        .lines()
        .find(|l| l.starts_with("RESULT:"))
        .unwrap_or_else(|| panic!("no RESULT line in:\n{stdout}"));
    result
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {name}= in {result}"))
}

#[test]
fn chaos_sqlx_exactly_once() {
    let (code, stdout) = chaos(&[&["--store", "sqlx"], CI].concat());
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.contains("RESULT: PASS"), "{stdout}");
}

/// Batched mode under the same faults: a kill -9, a terminated backend or a
/// closed connection lands mid-batch, with optimistic batches rerun after a
/// failure (`Inbox::handle_batch`).
#[test]
fn chaos_sqlx_batched_exactly_once() {
    let (code, stdout) = chaos(&[&["--store", "sqlx", "--batch-size", "50"], CI].concat());
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.contains("RESULT: PASS"), "{stdout}");
}

#[test]
fn chaos_diesel_exactly_once() {
    let (code, stdout) = chaos(&[&["--store", "diesel"], CI].concat());
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.contains("RESULT: PASS"), "{stdout}");
}

/// The harness can fail: with the claim committed in its own transaction, a
/// kill between that commit and the work's loses the effect for good.
///
/// The window is made wide on purpose (50 ms of work per message, publishing
/// slower than the consumers drain, so every fault lands on busy consumers):
/// with the default 5 ms a quiet machine can finish a small run between the
/// faults and the broken store goes unnoticed by luck.
#[test]
fn chaos_catches_a_broken_inbox() {
    let (code, stdout) = chaos(&[
        "--store",
        "sqlx",
        "--broken",
        "claim-in-own-transaction",
        "--consumers",
        "3",
        "--events",
        "600",
        "--kills",
        "6",
        "--work-delay-ms",
        "50",
        "--publish-rate",
        "100",
        "--seed",
        "7",
        "--always-clean",
    ]);
    assert_eq!(code, Some(1), "a violation must exit 1:\n{stdout}");
    assert!(stdout.contains("RESULT: FAIL"), "{stdout}");
    assert!(
        field(&stdout, "lost") + field(&stdout, "doubles") > 0,
        "losses or doubles reported:\n{stdout}"
    );
}
