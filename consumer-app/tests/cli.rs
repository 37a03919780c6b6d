//! The production binary's command line: fault injection is not on it (the
//! lab's `parcel-lab-consume` has the fault flags), and nothing else of it
//! went away; one-shot commands fail fast on a database that refuses, and
//! every command on a broker that refuses the login. Needs no service but
//! for that last case (the shared broker and database): every other case
//! fails or answers in parsing, or meets a closed port or a silent listener
//! of the test's own.

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

/// A flag given where it has no effect is refused as a usage error naming
/// the flag and why, before anything connects (all of these would
/// otherwise reach closed ports or run); the same value from the
/// environment (a fleet's shared configuration) is not.
#[test]
fn flags_without_effect_are_refused_by_name_and_reason() {
    let nowhere = ["--database-url=postgres://postgres@127.0.0.1:1/none"];
    let mut cases: Vec<(Vec<&str>, &str, &str)> = vec![
        (
            vec!["--pool-size=4", "publish"],
            "--pool-size",
            "uses no database",
        ),
        (
            vec![
                "--layout=partitioned",
                "replay",
                "--consumer=parcel-carrier-assignment",
                "--all",
            ],
            "--layout",
            "uses no database",
        ),
        (vec!["--store=sqlx", "publish"], "--store", "opens no store"),
        (
            vec!["--amqp-url=amqp://127.0.0.1:1", "stats"],
            "--amqp-url",
            "does not connect to RabbitMQ",
        ),
        (
            vec!["--prefix=x.", "dead"],
            "--prefix",
            "names no exchange or queue",
        ),
        (
            vec!["--queue-type=classic", "relay"],
            "--queue-type",
            "declares no queue",
        ),
        (
            vec!["--queue-type=classic", "api"],
            "--queue-type",
            "declares no queue",
        ),
        (
            vec!["--queue-type=classic", "migrate"],
            "--queue-type",
            "declares no queue",
        ),
        (
            vec!["--schema=x", "demo"],
            "--schema",
            "a schema of its own",
        ),
        (
            vec!["--prefix=x.", "demo"],
            "--prefix",
            "names no exchange or queue",
        ),
        (
            vec!["api", "--no-relay", "--lease-secs=60"],
            "--lease-secs",
            "--no-relay runs no relay",
        ),
        (
            vec!["api", "--no-relay", "--purge-batch=5"],
            "--purge-batch",
            "--no-relay runs no relay",
        ),
        (
            vec!["--amqp-url=amqp://127.0.0.1:1", "api", "--no-relay"],
            "--amqp-url",
            "`api --no-relay` does not connect",
        ),
        (
            vec![
                "relay",
                "--purge-interval-secs=0",
                "--published-retention-hours=1",
            ],
            "--published-retention-hours",
            "--purge-interval-secs 0",
        ),
        (
            vec!["api", "--purge-interval-secs=0", "--purge-pause-ms=1"],
            "--purge-pause-ms",
            "--purge-interval-secs 0",
        ),
        (
            vec!["consume", "--cleanup-interval-secs=0", "--retention-days=3"],
            "--retention-days",
            "--cleanup-interval-secs 0",
        ),
        (
            vec!["consume", "--metrics-addr=off", "--gauge-interval-secs=5"],
            "--gauge-interval-secs",
            "--metrics-addr off",
        ),
        (
            vec![
                "consume",
                "--prefetch=1",
                "--batch-size=10",
                "--batch-wait=5",
            ],
            "--batch-size",
            "batched mode needs",
        ),
        (
            vec!["demo", "--batch-size=1", "--batch-wait=5"],
            "--batch-size",
            "batched mode needs",
        ),
        (
            vec!["--amqp-url=amqp://127.0.0.1:1", "demo", "--broker=nats"],
            "--amqp-url",
            "`demo --broker nats` does not connect to RabbitMQ",
        ),
        (
            vec!["demo", "--nats-url=nats://127.0.0.1:1"],
            "--nats-url",
            "unless --broker nats",
        ),
    ];
    if cfg!(feature = "memory") {
        let memory = "the memory store has no database";
        cases.extend([
            (
                vec!["--store=memory", "--pool-size=4", "stats"],
                "--pool-size",
                memory,
            ),
            (
                vec!["--store=memory", "--lock-timeout-ms=5", "consume"],
                "--lock-timeout-ms",
                memory,
            ),
            (
                vec![
                    "--store=memory",
                    "--idle-in-transaction-timeout-secs=90",
                    "api",
                ],
                "--idle-in-transaction-timeout-secs",
                memory,
            ),
            (
                vec!["--store=memory", "--layout=partitioned", "migrate"],
                "--layout",
                memory,
            ),
            (
                vec!["--store=memory", "--schema=x", "cleanup"],
                "--schema",
                memory,
            ),
        ]);
    }
    for (args, flag, why) in cases {
        let (code, text) = parcel_inbox(&args);
        assert_eq!(code, Some(2), "{args:?} must be refused:\n{text}");
        assert!(
            text.contains(&format!("{flag} has no effect")) && text.contains(why),
            "{args:?} must name {flag} and why ({why}):\n{text}"
        );
    }
    // Where they act, the same flags pass parsing: the command runs and
    // meets the closed port.
    for args in [
        &[
            nowhere[0],
            "--pool-size=4",
            "--lock-timeout-ms=5",
            "--layout=partitioned",
            "stats",
        ][..],
        &[
            "--queue-type=classic",
            "--prefix=x.",
            "--amqp-url=amqp://127.0.0.1:1",
            "publish",
            "--quiet",
        ],
    ] {
        let (code, text, _) = parcel_inbox_within(args, Duration::from_secs(15));
        assert_eq!(code, Some(1), "{args:?} must run and fail:\n{text}");
        assert!(!text.contains("has no effect"), "{args:?}:\n{text}");
        assert!(
            text.to_lowercase().contains("connection refused"),
            "{args:?}:\n{text}"
        );
    }
    // From the environment: ignored where it has no subject.
    let output = Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
        .args([nowhere[0], "stats"])
        .env("DATABASE_POOL_SIZE", "4")
        .env("PARCEL_QUEUE_TYPE", "classic")
        .env("AMQP_URL", "amqp://127.0.0.1:1")
        .output()
        .expect("run parcel-inbox");
    let text = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.to_lowercase().contains("connection refused"), "{text}");
}

/// A listener of the test's own that accepts every connection and never
/// says a word: a hung broker, or a load balancer with no backend. Returns
/// its port; the connections stay open until the test process ends.
fn silent_listener() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a silent listener");
    let port = listener.local_addr().expect("its address").port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    port
}

#[test]
fn a_silent_broker_is_named_within_the_timeout_and_sigterm_ends_consume() {
    use std::io::{BufRead, BufReader};

    let port = silent_listener();
    let amqp = format!("--amqp-url=amqp://guest:guest@127.0.0.1:{port}/%2f");
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
        .args([
            "--store=memory",
            &amqp,
            "--amqp-connect-timeout-secs=1",
            "consume",
            "--metrics-addr=off",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run parcel-inbox consume");
    let stderr = child.stderr.take().expect("stderr");
    let (lines_tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let address = format!("127.0.0.1:{port}");
    let mut seen = Vec::new();
    let warned_after = loop {
        let line = lines
            .recv_timeout(Duration::from_secs(10).saturating_sub(started.elapsed()))
            .unwrap_or_else(|_| {
                let _ = child.kill();
                panic!(
                    "no warning naming {address} within 10 s:\n{}",
                    seen.join("\n")
                )
            });
        let names_it = line.contains(&address) && line.contains("no AMQP answer within 1s");
        seen.push(line);
        if names_it {
            break started.elapsed();
        }
    };
    assert!(
        seen.iter().all(|line| !line.contains("guest:guest")),
        "the password is redacted:\n{}",
        seen.join("\n")
    );

    // SIGTERM while it is connecting again: it ends at once, cleanly.
    let term = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("send SIGTERM");
    assert!(term.success());
    let signalled = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll parcel-inbox") {
            break status;
        }
        if signalled.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            panic!("consume still running 5 s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        status.code(),
        Some(0),
        "SIGTERM is a clean stop (warned after {warned_after:?})"
    );
}

#[test]
fn a_one_shot_command_fails_with_the_cause_on_a_silent_broker() {
    let port = silent_listener();
    let amqp = format!("--amqp-url=amqp://guest:guest@127.0.0.1:{port}/%2f");
    let (code, text, took) = parcel_inbox_within(
        &[
            &amqp,
            "--amqp-connect-timeout-secs=1",
            "publish",
            "--count=1",
            "--quiet",
        ],
        Duration::from_secs(15),
    );
    assert!(
        code.is_some(),
        "publish still running after {took:?}:\n{text}"
    );
    assert_ne!(code, Some(0), "publish must fail:\n{text}");
    assert!(
        text.contains(&format!("127.0.0.1:{port}")) && text.contains("no AMQP answer within 1s"),
        "publish must name the address and the cause:\n{text}"
    );
    assert!(took < Duration::from_secs(10), "it took {took:?}:\n{text}");
}

/// A broker that refuses the login is a configuration error at start-up:
/// every command that connects to RabbitMQ exits non-zero at once, saying
/// "credentials refused" with the redacted URL, never the password, and
/// without lapin's own lines beside ours. Uses the shared broker (a wrong
/// password for `guest`) and the shared database (a schema of its own,
/// dropped after).
#[test]
fn a_refused_broker_login_ends_every_command_at_once() {
    const SECRET: &str = "wrong-secret-not-in-logs";
    let schema = format!("cli_refused_{}", std::process::id());
    let schema_flag = format!("--schema={schema}");
    let amqp = format!("--amqp-url=amqp://guest:{SECRET}@127.0.0.1:5672/%2f");
    let (code, text) = parcel_inbox(&[&schema_flag, "migrate"]);
    assert_eq!(code, Some(0), "migrate (PostgreSQL reachable?):\n{text}");
    for (command, uses_database) in [
        (&["consume", "--metrics-addr=off"][..], true),
        (&["relay", "--metrics-addr=off"], true),
        (&["api", "--listen=127.0.0.1:0"], true),
        (&["publish", "--count=1"], false),
    ] {
        let mut args = vec![amqp.as_str()];
        if uses_database {
            args.push(&schema_flag);
        }
        args.extend_from_slice(command);
        let (code, text, took) = parcel_inbox_within(&args, Duration::from_secs(20));
        assert_eq!(
            code,
            Some(1),
            "{command:?} must fail at once ({took:?}):\n{text}"
        );
        assert!(
            text.contains("credentials refused by the broker at amqp://guest:***@127.0.0.1:5672"),
            "{command:?} must say why, with the redacted URL:\n{text}"
        );
        assert!(
            !text.contains(SECRET),
            "{command:?} printed the password:\n{text}"
        );
        assert!(
            !text.contains("attempts exhausted") && !text.contains("unreachable"),
            "{command:?}: lapin's lines or a misleading cause:\n{text}"
        );
    }
    let status = Command::new("psql")
        .args([
            "postgres://postgres@127.0.0.1:5432/test",
            "-qc",
            &format!("DROP SCHEMA {schema} CASCADE"),
        ])
        .status()
        .expect("psql");
    assert!(status.success(), "drop the test's schema");
}
