//! The consume process is killed (SIGKILL) or frozen (SIGSTOP) mid-work:
//! its open transactions die with it or are ended by PostgreSQL, the broker
//! redelivers its unacked deliveries to another instance, and every effect
//! happens exactly once. Per Postgres store (a memory store dies with its
//! process). Here rather than beside the app's end-to-end tests because the
//! child holds each transaction open for a while (`parcel-lab-consume
//! --fault-work-delay-ms`), which the production binary cannot. Needs
//! PostgreSQL and RabbitMQ (`bash .ci/services.sh`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use consumer_app::parcel::downstream::{StubCarrier, StubNotifier};
use consumer_app::parcel::role::Role;
use consumer_app::parcel::service::spawn;
use consumer_app::parcel::store::{ParcelStore, Stats};
use consumer_app::parcel::topology::Topology;
use consumer_app::tools::publish::{Plan, publish};
use inbox_runtime::amqp::connect;
use inbox_runtime::{ServiceConfig, WorkerConfig};

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// Polls `done` every 25 ms until it holds or `timeout` passes.
async fn eventually(what: &str, timeout: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn assert_exactly_once(stats: &Stats, n: u64) {
    for (table, counts) in [
        ("notifications", stats.notifications),
        ("carrier_assignments", stats.carrier_assignments),
    ] {
        assert_eq!(counts.rows, n, "{table}: one row per message\n{stats}");
        assert_eq!(counts.distinct_messages, n, "{table}\n{stats}");
        assert_eq!(counts.double_effects(), 0, "{table}\n{stats}");
    }
    for role in Role::PARCEL_CREATED {
        assert_eq!(
            stats.inbox_per_consumer.get(role.consumer_name()).copied(),
            Some(n),
            "inbox rows of {}\n{stats}",
            role.consumer_name()
        );
    }
}

/// The longest a test with child processes may run: then it fails (and
/// the children are killed, their output printed) instead of hanging CI.
const WALL_CLOCK_LIMIT: Duration = Duration::from_secs(180);

/// The `parcel-lab-consume` processes of one test, each writing its log
/// (warnings and errors) to a file of its own. When the value is dropped
/// (the test ended, failed or ran out of time) every child is killed; when
/// the test failed, their logs are printed, so a failure shows what the
/// children saw.
struct Children {
    id: String,
    running: Mutex<Vec<(String, tokio::process::Child)>>,
    logs: Mutex<Vec<(String, PathBuf)>>,
}

impl Children {
    fn new(id: &str) -> Self {
        Self {
            id: id.to_owned(),
            running: Mutex::default(),
            logs: Mutex::default(),
        }
    }

    /// Starts `parcel-lab-consume` on `kind`'s store in `schema`, its
    /// queues under `prefix`, with `extra` flags after the common ones.
    /// Returns its pid.
    fn spawn(
        &self,
        name: &str,
        kind: &str,
        urls: (&str, &str),
        names: (&str, &str),
        extra: &[&str],
    ) -> u32 {
        let (database_url, amqp_url) = urls;
        let (schema, prefix) = names;
        let log = std::env::temp_dir().join(format!("parcel-lab-{}-{name}.log", self.id));
        let file = std::fs::File::create(&log).expect("a child's log file");
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_parcel-lab-consume"))
            .args([
                "--store",
                kind,
                "--database-url",
                database_url,
                "--amqp-url",
                amqp_url,
                "--schema",
                schema,
                "--prefix",
                prefix,
                "--metrics-addr",
                "off",
                "--concurrency",
                "4",
                "--cleanup-interval-secs",
                "0",
            ])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .expect("start parcel-lab-consume");
        let pid = child.id().expect("a running child has a pid");
        self.logs.lock().expect("logs").push((name.to_owned(), log));
        self.running
            .lock()
            .expect("children")
            .push((name.to_owned(), child));
        pid
    }

    /// Kills child `name` (SIGKILL) and waits until it is gone.
    async fn kill(&self, name: &str) {
        let child = {
            let mut running = self.running.lock().expect("children");
            let index = running
                .iter()
                .position(|(n, _)| n == name)
                .expect("a child of that name");
            running.remove(index).1
        };
        let mut child = child;
        child.kill().await.expect("SIGKILL the consumer");
    }

    /// SIGTERM to child `name`; its exit code once it is gone, and how long
    /// that took. Fails (the child killed, its log printed) when it is
    /// still there after `limit`.
    async fn terminate(&self, name: &str, limit: Duration) -> (Option<i32>, Duration) {
        let mut child = {
            let mut running = self.running.lock().expect("children");
            let index = running
                .iter()
                .position(|(n, _)| n == name)
                .expect("a child of that name");
            running.remove(index).1
        };
        let started = Instant::now();
        Self::signal(child.id().expect("running"), "TERM").await;
        match tokio::time::timeout(limit, child.wait()).await {
            Ok(status) => (status.expect("wait").code(), started.elapsed()),
            Err(_) => {
                let _ = child.start_kill();
                panic!("child {name} still running {limit:?} after SIGTERM");
            }
        }
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`) to process `pid`.
    async fn signal(pid: u32, signal: &str) {
        let status = tokio::process::Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .await
            .expect("run kill");
        assert!(status.success(), "kill -{signal} {pid}: {status}");
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        if let Ok(running) = self.running.get_mut() {
            for (_, child) in running.iter_mut() {
                // A stopped process dies of SIGKILL too.
                let _ = child.start_kill();
            }
        }
        let Ok(logs) = self.logs.get_mut() else {
            return;
        };
        for (name, log) in logs.drain(..) {
            if std::thread::panicking() {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(200).collect();
                eprintln!("---- log of child {name} (last 200 lines) ----");
                for line in tail.into_iter().rev() {
                    eprintln!("{line}");
                }
            }
            let _ = std::fs::remove_file(log);
        }
    }
}

/// Runs a test body under [`WALL_CLOCK_LIMIT`].
async fn within_limit(body: impl Future<Output = ()>) {
    tokio::time::timeout(WALL_CLOCK_LIMIT, body)
        .await
        .unwrap_or_else(|_| panic!("the test ran over {WALL_CLOCK_LIMIT:?}"));
}

/// A child started by [`busy_child`], mid-stream.
struct Busy {
    /// Its queues, under `test-{name}-{kind}-{id}.`.
    topology: Topology,
    /// Its pid.
    pid: u32,
    /// The app schema and the queue prefix, for a second child on the same
    /// stream.
    names: (String, String),
}

/// Starts child `name` on `kind`'s store over `urls` (database, broker)
/// with `extra` flags (a work delay inside each transaction, at least),
/// publishes 40 events to it and returns once it committed a few of them:
/// its workers are now busy mid-stream.
async fn busy_child<S: ParcelStore>(
    children: &Children,
    store: &S,
    name: &str,
    (kind, id): (&str, &str),
    urls: (&str, &str),
    extra: &[&str],
) -> Busy {
    let prefix = format!("test-{name}-{kind}-{id}.");
    let schema = format!("app_test_{id}");
    let topology = Topology::new(&prefix);
    // `publish` declares the topology itself, so the messages are routed
    // whether or not the child got there first.
    let plan = Plan::new(40, 0.0, 9, &format!("P{schema}")).expect("plan");
    let pid = children.spawn(name, kind, urls, (&schema, &prefix), extra);
    publish(AMQP_URL, &topology, &plan.messages, false)
        .await
        .expect("publish");
    eventually(
        "the child did some work",
        Duration::from_secs(30),
        async || {
            let stats = store.stats().await.expect("stats");
            stats.carrier_assignments.rows >= 4 && stats.notifications.rows >= 4
        },
    )
    .await;
    Busy {
        topology,
        pid,
        names: (schema, prefix),
    }
}

async fn killed_process_redelivers_exactly_once<S: ParcelStore>(store: S, kind: &str, id: &str) {
    let children = Children::new(id);
    within_limit(killed_process_redelivers(&children, store, kind, id)).await;
}

async fn killed_process_redelivers<S: ParcelStore>(
    children: &Children,
    store: S,
    kind: &str,
    id: &str,
) {
    let topology = busy_child(
        children,
        &store,
        "killed",
        (kind, id),
        (&database_url(), AMQP_URL),
        &["--fault-work-delay-ms", "200"],
    )
    .await
    .topology;
    children.kill("killed").await;
    let before = store.stats().await.expect("stats");
    assert!(
        before.carrier_assignments.rows < 40,
        "killed mid-stream: {before}"
    );

    let redelivered = drained_exactly_once(&store, &topology, id, 40).await;
    assert!(
        redelivered >= 1,
        "the killed process's unacked deliveries came back"
    );
    clean_up(&store, &topology).await;
}

/// A second consumer (in process) drains what is left; then every one of
/// the `n` messages has its effects exactly once. Returns how many
/// deliveries came back to it already handled or half done (processed on
/// a redelivery, or discarded as duplicates).
async fn drained_exactly_once<S: ParcelStore>(
    store: &S,
    topology: &Topology,
    id: &str,
    n: u64,
) -> u64 {
    let service = spawn(
        store.clone(),
        ServiceConfig {
            worker: WorkerConfig {
                prefetch: 16,
                concurrency: 4,
                handle_timeout: Duration::from_secs(10),
                retry_base_delay: Duration::from_millis(5),
                max_deliveries: 5,
                max_body_bytes: 1024,
                ..WorkerConfig::default()
            },
            cleanup: None,
            gauge_interval: None,
            ..ServiceConfig::new(AMQP_URL, format!("parcel-lab test kill {id}"))
        },
        topology,
        consumer_app::parcel::downstream::Downstreams {
            carrier: Arc::new(StubCarrier::default()),
            notifier: Arc::new(StubNotifier::default()),
        },
    )
    .expect("service starts");
    let tally = Arc::clone(&service.tally);
    eventually(
        "every effect present",
        Duration::from_secs(40),
        async || {
            let stats = store.stats().await.expect("stats");
            stats.carrier_assignments.rows >= n && stats.notifications.rows >= n
        },
    )
    .await;
    // Give redeliveries of committed work time to arrive as duplicates.
    tokio::time::sleep(Duration::from_millis(300)).await;
    service.shutdown();
    service.join().await.expect("clean shutdown");
    let redelivered: u64 = Role::ALL
        .iter()
        .map(|r| {
            let t = tally.consumer(r.consumer_name());
            t.redelivered_processed() + t.duplicates()
        })
        .sum();
    let stats = store.stats().await.expect("stats");
    assert_exactly_once(&stats, n);
    redelivered
}

/// The bound on a graceful stop: an attempt in flight finishes within the
/// handle timeout (30 s by default), and nothing else waits.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(30);

/// SIGTERM to the consume binary while each of its workers is inside a
/// transaction (a 300 ms work delay): the work in flight commits and is
/// acked, or is handed back; the process exits 0 well within
/// [`SHUTDOWN_LIMIT`]; a second consumer then drains the rest and every
/// message has its effects exactly once.
async fn terminated_process_exits_0_and_loses_nothing<S: ParcelStore>(
    children: &Children,
    store: S,
    kind: &str,
    id: &str,
) {
    let topology = busy_child(
        children,
        &store,
        "terminated",
        (kind, id),
        (&database_url(), AMQP_URL),
        &["--fault-work-delay-ms", "300"],
    )
    .await
    .topology;

    let (code, took) = children.terminate("terminated", SHUTDOWN_LIMIT).await;

    assert_eq!(code, Some(0), "a graceful stop exits 0 (after {took:?})");
    eprintln!("graceful stop after SIGTERM: exit 0 in {took:?}");
    let after = store.stats().await.expect("stats");
    assert!(
        after.carrier_assignments.rows < 40,
        "stopped mid-stream: {after}"
    );
    assert_eq!(after.carrier_assignments.double_effects(), 0, "{after}");
    assert_eq!(after.notifications.double_effects(), 0, "{after}");
    drained_exactly_once(&store, &topology, id, 40).await;
    clean_up(&store, &topology).await;
}

/// Deletes the test's queues and exchanges and drops its schema.
async fn clean_up<S: ParcelStore>(store: &S, topology: &Topology) {
    topology.remove(AMQP_URL).await.expect("delete topology");
    store.drop_schema().await.expect("drop schema");
}

/// The frozen process's database bounds. A redelivery of a key the frozen
/// process holds gives up after [`FREEZE_LOCK_TIMEOUT`] and is handed back
/// uncharged; PostgreSQL ends the frozen sessions
/// [`FREEZE_IDLE_IN_TRANSACTION`] after their last statement, releasing
/// their claims; the handle timeout stays below it, as the flags demand.
const FREEZE_LOCK_TIMEOUT: Duration = Duration::from_secs(1);
const FREEZE_IDLE_IN_TRANSACTION: Duration = Duration::from_secs(4);
const FREEZE_HANDLE_TIMEOUT: Duration = Duration::from_secs(2);

/// The bounds above as the consume binary's flags.
fn freeze_bounds() -> Vec<String> {
    vec![
        "--lock-timeout-ms".to_owned(),
        FREEZE_LOCK_TIMEOUT.as_millis().to_string(),
        "--idle-in-transaction-timeout-secs".to_owned(),
        FREEZE_IDLE_IN_TRANSACTION.as_secs().to_string(),
        "--handle-timeout-secs".to_owned(),
        FREEZE_HANDLE_TIMEOUT.as_secs().to_string(),
    ]
}

/// How long after a consumer falls silent RabbitMQ closes its connection
/// and requeues its unacked deliveries, at the runtime's default heartbeat
/// (neither process names one: no `?heartbeat=` in the URL, no
/// `--amqp-heartbeat-secs`). RabbitMQ's heartbeat receiver
/// (`rabbit_heartbeat`, unchanged through 3.10) reads the socket's
/// received-bytes counter once per heartbeat timeout and closes the
/// connection at the second check in a row that finds it unchanged: 2 to 3
/// timeouts after the last byte, 20–30 s at the default 10 s. The frozen
/// process was acking until the SIGSTOP, so its last byte is at the
/// freeze. Measured here (RabbitMQ 3.10.8, two cores, both stores), SIGSTOP
/// to the frozen process's consumers leaving the queues: 29.1–29.3 s in six
/// runs (the freeze falls about 1 s after the connection opened, just after
/// one of the broker's checks, so near the top of the range), 27.0 s with
/// the freeze moved 2.5 s later.
const RABBITMQ_DETECTION: Duration =
    Duration::from_secs(3 * inbox_runtime::amqp::DEFAULT_HEARTBEAT.as_secs());

/// Redeliveries that met a frozen claim before PostgreSQL released it:
/// each gives up after [`FREEZE_LOCK_TIMEOUT`] and comes again.
const FREEZE_LOCK_ROUNDS: u32 = 3;

/// Room for the rest on a loaded two-core machine (other suites running
/// on the same servers): the second process starting, the work itself and
/// this test's polling.
const FREEZE_MARGIN: Duration = Duration::from_secs(20);

/// How long after the SIGSTOP the other process may take to process every
/// message: the broker's detection of the silent peer, then PostgreSQL's
/// idle-in-transaction timeout, then a few lock-timeout rounds, then the
/// margin (57 s). The broker's and the database's clocks both start at the
/// freeze, so the sum is an upper bound, not the expected time (at the
/// default heartbeat the frozen sessions are gone long before the broker
/// lets go of their deliveries). Without the database's bounds the frozen
/// claims would be held until TCP gives up (minutes to hours), and every
/// redelivery of their keys would wait for them.
const FREEZE_PROCESSED_WITHIN: Duration = RABBITMQ_DETECTION
    .saturating_add(FREEZE_IDLE_IN_TRANSACTION)
    .saturating_add(FREEZE_LOCK_TIMEOUT.saturating_mul(FREEZE_LOCK_ROUNDS))
    .saturating_add(FREEZE_MARGIN);

/// A consume process frozen with SIGSTOP while it holds claims (sessions
/// inside a transaction, each held 500 ms by the work delay), both processes
/// at the runtime's default AMQP heartbeat: PostgreSQL ends the frozen
/// sessions (idle_in_transaction_session_timeout), the broker closes the
/// frozen connection once the heartbeat is missed and redelivers its unacked
/// deliveries to another process, whose claims fail fast on any frozen lock
/// still held (lock_timeout, handed back uncharged); every message is
/// processed exactly once within [`FREEZE_PROCESSED_WITHIN`] of the freeze,
/// nothing dead-lettered, all while the frozen process is still stopped.
/// SIGCONT afterwards changes nothing: the resumed process's commits fail
/// (its sessions are gone) and its redeliveries are duplicates.
async fn frozen_process_is_bounded_by_the_database<S: ParcelStore>(store: S, kind: &str, id: &str) {
    let children = Children::new(id);
    within_limit(frozen_process_redeliveries(&children, store, kind, id)).await;
}

async fn frozen_process_redeliveries<S: ParcelStore>(
    children: &Children,
    store: S,
    kind: &str,
    id: &str,
) {
    let frozen_name = format!("frozen_{id}");
    let bounds = freeze_bounds();
    let bounds: Vec<&str> = bounds.iter().map(String::as_str).collect();
    let mut frozen_flags = bounds.clone();
    frozen_flags.extend(["--fault-work-delay-ms", "500"]);
    let Busy {
        topology,
        pid: frozen,
        names: (schema, prefix),
    } = busy_child(
        children,
        &store,
        "frozen",
        (kind, id),
        (
            &with_application_name(&database_url(), &frozen_name),
            AMQP_URL,
        ),
        &frozen_flags,
    )
    .await;

    let observer = sqlx::PgPool::connect(&database_url())
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    let in_transaction = async || -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE application_name = $1 AND xact_start IS NOT NULL",
        )
        .bind(&frozen_name)
        .fetch_one(&observer)
        .await
        .expect("pg_stat_activity")
    };
    // Freeze it at a moment it holds claims (its transactions last 500 ms).
    let mut held = 0;
    let mut frozen_at = Instant::now();
    for _ in 0..100 {
        frozen_at = Instant::now();
        Children::signal(frozen, "STOP").await;
        held = in_transaction().await;
        if held > 0 {
            break;
        }
        Children::signal(frozen, "CONT").await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(held > 0, "froze the process while it held no transaction");
    let before = store.stats().await.expect("stats");
    assert!(
        before.carrier_assignments.rows < 40 && before.notifications.rows < 40,
        "frozen mid-stream: {before}"
    );

    let broker = connect(AMQP_URL, &format!("parcel-lab test frozen {id}"))
        .await
        .expect("connect");
    let channel = broker.create_channel().await.expect("channel");
    let frozen_consumers = consumers(&channel, &topology).await;
    assert!(frozen_consumers > 0, "the frozen process is subscribed");

    children.spawn(
        "other",
        kind,
        (&database_url(), AMQP_URL),
        (&schema, &prefix),
        &bounds,
    );
    // The broker's detection: the queues' consumer count falls (below the
    // frozen process's and the other's together, once the other is there)
    // when RabbitMQ closes the frozen connection, which requeues its unacked
    // deliveries to the other process.
    let mut peak = frozen_consumers;
    eventually(
        "RabbitMQ closed the frozen process's connection",
        FREEZE_PROCESSED_WITHIN,
        async || {
            let now = consumers(&channel, &topology).await;
            peak = peak.max(now);
            now < peak
        },
    )
    .await;
    let detected = frozen_at.elapsed();
    // RabbitMQ lets at least two heartbeat timeouts of silence pass; one
    // is the floor asserted, clear of timing noise, and still far above
    // what a shortened heartbeat (the 2–3 s this test used to name) gives.
    assert!(
        detected >= inbox_runtime::amqp::DEFAULT_HEARTBEAT,
        "the broker let go of the frozen process {detected:?} after the freeze: \
         sooner than the default heartbeat allows"
    );
    eventually(
        "every effect, while the frozen process is still stopped",
        FREEZE_PROCESSED_WITHIN.saturating_sub(frozen_at.elapsed()),
        async || {
            let stats = store.stats().await.expect("stats");
            stats.carrier_assignments.rows >= 40 && stats.notifications.rows >= 40
        },
    )
    .await;
    let processed = frozen_at.elapsed();
    assert!(processed <= FREEZE_PROCESSED_WITHIN, "{processed:?}");
    eprintln!(
        "{kind}: froze a process holding {held} transactions; RabbitMQ redelivered its \
         deliveries {:.1} s later (heartbeat {} s), every message processed {:.1} s after \
         the freeze (bound {} s)",
        detected.as_secs_f64(),
        inbox_runtime::amqp::DEFAULT_HEARTBEAT.as_secs(),
        processed.as_secs_f64(),
        FREEZE_PROCESSED_WITHIN.as_secs()
    );
    // Its sessions all went idle at the freeze, so the server ends them
    // within moments of each other (one still in BEGIN, holding no claim,
    // may outlive the last message by a fraction of a second).
    eventually(
        "PostgreSQL ended the frozen process's transactions",
        Duration::from_secs(10),
        async || in_transaction().await == 0,
    )
    .await;
    assert_exactly_once(&store.stats().await.expect("stats"), 40);

    Children::signal(frozen, "CONT").await;
    // Time for the resumed process to hit its handle timeout (2 s), find
    // its sessions gone, reconnect and see its deliveries again.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_exactly_once(&store.stats().await.expect("stats"), 40);
    for role in Role::ALL {
        let queue = topology.dead_letter_queue(role);
        let dead = topology
            .ready_messages(&channel, &queue)
            .await
            .expect("dead-letter queue");
        assert_eq!(dead, 0, "{queue}: nothing dead-lettered");
    }
    inbox_runtime::amqp::close_bounded(&broker, "bye").await;
    observer.close().await;
    clean_up(&store, &topology).await;
}

/// Consumers subscribed to the test's work queues, by passive declares.
async fn consumers(channel: &lapin::Channel, topology: &Topology) -> u32 {
    let mut total = 0;
    for role in Role::ALL {
        let queue = channel
            .queue_declare(
                topology.queue(role).as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..lapin::options::QueueDeclareOptions::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .expect("inspect a work queue");
        total += queue.consumer_count();
    }
    total
}

fn unique() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

fn with_application_name(url: &str, name: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}application_name={name}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_process_redelivers_exactly_once_sqlx() {
    let id = unique();
    killed_process_redelivers_exactly_once(sqlx_store(&id).await, "sqlx", &id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_process_redelivers_exactly_once_diesel() {
    let id = unique();
    killed_process_redelivers_exactly_once(diesel_store(&id).await, "diesel", &id).await;
}

/// A migrated sqlx store in the test's schema.
async fn sqlx_store(id: &str) -> inbox_backend_sqlx::SqlxStore {
    let schema = format!("app_test_{id}");
    let store = inbox_backend_sqlx::SqlxStore::connect(
        &with_application_name(&database_url(), &schema),
        &schema,
    )
    .await
    .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate_all().await.expect("migrate");
    store
}

/// A migrated diesel store in the test's schema.
async fn diesel_store(id: &str) -> inbox_backend_diesel::DieselStore {
    let schema = format!("app_test_{id}");
    let store = inbox_backend_diesel::DieselStore::connect(
        &with_application_name(&database_url(), &schema),
        &schema,
        8,
    )
    .await
    .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate_all().await.expect("migrate");
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_process_is_bounded_by_the_database_sqlx() {
    let id = unique();
    frozen_process_is_bounded_by_the_database(sqlx_store(&id).await, "sqlx", &id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_process_is_bounded_by_the_database_diesel() {
    let id = unique();
    frozen_process_is_bounded_by_the_database(diesel_store(&id).await, "diesel", &id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_process_exits_0_and_loses_nothing_sqlx() {
    let id = unique();
    let children = Children::new(&id);
    within_limit(terminated_process_exits_0_and_loses_nothing(
        &children,
        sqlx_store(&id).await,
        "sqlx",
        &id,
    ))
    .await;
}
