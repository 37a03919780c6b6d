//! The production binary's command line: fault injection is not on it (the
//! lab's `parcel-lab-consume` has the fault flags), and nothing else of it
//! went away; one-shot commands fail fast on a database that refuses. Needs
//! no service: every case fails or answers in parsing, or meets a closed port.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn parcel_inbox(args: &[&str]) -> (Option<i32>, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
        .args(args)
        .output()
        .expect("run parcel-inbox");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.code(), text)
}

#[test]
fn the_fault_flags_are_not_on_the_production_binary() {
    for flag in [
        "--fault-work-delay-ms=5",
        "--fault-broken-store=check-then-insert",
    ] {
        let (code, text) = parcel_inbox(&["consume", flag]);
        assert_eq!(code, Some(2), "{flag} must be refused:\n{text}");
        assert!(text.contains("unexpected argument"), "{text}");
    }
}

/// A replay names what it moves: some message ids, or everything; a queue
/// type is one RabbitMQ knows.
#[test]
fn replay_and_queue_type_refuse_what_they_cannot_mean() {
    for args in [
        &["replay", "--consumer", "parcel-carrier-assignment"][..],
        &[
            "replay",
            "--consumer",
            "parcel-carrier-assignment",
            "--all",
            "--message-id",
            "x",
        ],
        &["--queue-type", "stream", "dead"],
    ] {
        let (code, text) = parcel_inbox(args);
        assert_eq!(code, Some(2), "{args:?} must be refused:\n{text}");
    }
}

#[test]
fn the_subcommands_and_consume_flags_are_all_there() {
    let (code, text) = parcel_inbox(&["--help"]);
    assert_eq!(code, Some(0), "{text}");
    for command in [
        "migrate", "consume", "relay", "publish", "cleanup", "stats", "dead", "replay", "demo",
    ] {
        assert!(text.contains(command), "{command} missing:\n{text}");
    }
    let (code, text) = parcel_inbox(&["consume", "--help"]);
    assert_eq!(code, Some(0), "{text}");
    for flag in [
        "--prefetch",
        "--concurrency",
        "--handle-timeout-secs",
        "--retry-attempts",
        "--max-deliveries",
        "--max-body-bytes",
        "--batch-size",
        "--batch-wait",
        "--retention-days",
        "--cleanup-batch",
        "--cleanup-interval-secs",
        "--metrics-addr",
        "--gauge-interval-secs",
        "--dispatch-interval-secs",
        "--dispatch-min-age-secs",
        "--store",
        "--database-url",
        "--amqp-url",
        "--schema",
        "--prefix",
        "--pool-size",
        "--queue-type",
        "--log-format",
        "--lock-timeout-ms",
        "--idle-in-transaction-timeout-secs",
    ] {
        assert!(text.contains(flag), "{flag} missing:\n{text}");
    }
    assert!(!text.contains("--fault"), "{text}");
}

#[test]
fn the_relay_flags_are_there_and_a_lease_shorter_than_the_confirms_is_refused() {
    let (code, text) = parcel_inbox(&["relay", "--help"]);
    assert_eq!(code, Some(0), "{text}");
    for flag in [
        "--batch-size",
        "--lease-secs",
        "--poll-interval-ms",
        "--confirm-timeout-secs",
        "--metrics-addr",
    ] {
        assert!(text.contains(flag), "{flag} missing:\n{text}");
    }
    // Refused before connecting anywhere: no service is needed.
    let (code, text) = parcel_inbox(&[
        "--database-url",
        "postgres://nobody@127.0.0.1:1/none",
        "relay",
        "--lease-secs",
        "5",
        "--confirm-timeout-secs",
        "10",
    ]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("lease"), "{text}");
    let (code, text) = parcel_inbox(&["relay", "--batch-size", "0"]);
    assert_eq!(code, Some(2), "{text}");
}

#[test]
fn an_idle_in_transaction_timeout_not_above_the_handle_timeout_is_refused() {
    // PostgreSQL would end transactions that are merely slow. Refused before
    // connecting anywhere: no service is needed.
    let (code, text) = parcel_inbox(&[
        "--database-url",
        "postgres://nobody@127.0.0.1:1/none",
        "consume",
        "--handle-timeout-secs",
        "30",
        "--idle-in-transaction-timeout-secs",
        "30",
    ]);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("--idle-in-transaction-timeout-secs (30) must exceed"),
        "{text}"
    );
}

/// Runs parcel-inbox with `args`, killing it after `limit`; returns its exit
/// code (`None` when killed), its output, and how long it ran.
fn parcel_inbox_within(args: &[&str], limit: Duration) -> (Option<i32>, String, Duration) {
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run parcel-inbox");
    let mut killed = false;
    while child.try_wait().expect("poll parcel-inbox").is_none() {
        if started.elapsed() > limit {
            child.kill().expect("kill parcel-inbox");
            killed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child
        .wait_with_output()
        .expect("collect parcel-inbox's output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let code = if killed { None } else { output.status.code() };
    (code, text, started.elapsed())
}

#[test]
fn one_shot_commands_fail_fast_with_the_cause_on_a_refusing_database() {
    // Port 1 is closed: every connection is refused at once.
    let url = "--database-url=postgres://postgres@127.0.0.1:1/test";
    let mut stores = vec!["--store=sqlx"];
    if cfg!(feature = "diesel") {
        stores.push("--store=diesel");
    }
    for (store, command) in stores
        .iter()
        .flat_map(|store| ["migrate", "stats", "cleanup"].map(|command| (*store, command)))
    {
        let (code, text, took) =
            parcel_inbox_within(&[url, store, command], Duration::from_secs(15));
        assert!(
            code.is_some(),
            "{command} still running after {took:?}:\n{text}"
        );
        assert_ne!(code, Some(0), "{command} must fail:\n{text}");
        assert!(
            text.to_lowercase().contains("connection refused"),
            "{command} must name the cause:\n{text}"
        );
        assert!(!text.contains("pool timed out"), "{command}:\n{text}");
    }
}

#[test]
fn logs_written_to_a_pipe_carry_no_colour_codes() {
    let (code, text, _) = parcel_inbox_within(
        &[
            "--database-url=postgres://postgres@127.0.0.1:1/test",
            "--store=sqlx",
            "stats",
        ],
        Duration::from_secs(15),
    );
    assert!(code.is_some(), "stats did not finish:\n{text}");
    assert!(
        text.contains("parcel-inbox starting"),
        "no log line:\n{text}"
    );
    assert!(
        !text.contains("\x1b["),
        "ANSI escape codes in piped logs:\n{text:?}"
    );
}
