//! The production binary's command line: fault injection is not on it (the
//! lab's `parcel-lab-consume` has the fault flags), and nothing else of it
//! went away. Needs no service: every case fails or answers in parsing.

use std::process::Command;

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

#[test]
fn the_subcommands_and_consume_flags_are_all_there() {
    let (code, text) = parcel_inbox(&["--help"]);
    assert_eq!(code, Some(0), "{text}");
    for command in [
        "migrate", "consume", "relay", "publish", "cleanup", "stats", "demo",
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
