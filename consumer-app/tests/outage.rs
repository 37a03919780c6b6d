//! Outages of the service's two dependencies, against real servers: the
//! store going away (a PostgreSQL restart, a dropped schema) pauses the
//! consumers instead of charging the messages, and a broker restart is
//! ridden out by reconnecting. Nothing is lost, nothing valid is
//! dead-lettered, every effect happens once.
//!
//! The outages that stop a server stop a *private* one, started for the
//! test in a temporary directory on a free port (PostgreSQL through
//! `initdb`/`pg_ctl`, RabbitMQ as its own node), so the shared servers the
//! other tests use are never touched; a guard stops the private server and
//! removes its directory however the test ends (the crate
//! `private-servers`, shared with the chaos harness). A missing binary or a
//! server that does not come up fails the test: nothing is skipped.

use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use consumer_app::parcel::downstream::{Downstreams, StubCarrier, StubNotifier};
use consumer_app::parcel::role::Role;
use consumer_app::parcel::service::spawn;
use consumer_app::parcel::store::{ParcelStore, Stats};
use consumer_app::parcel::topology::Topology;
use consumer_app::tools::publish::{Plan, publish};
use inbox_runtime::amqp::{close_bounded, connect};
use inbox_runtime::tally::Tally;
use inbox_runtime::{AvailabilityConfig, ServiceConfig, ServiceHandle, WorkerConfig};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use private_servers::{PrivatePostgres, PrivateRabbit, run};

const SHARED_AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

fn shared_database() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// The process's metrics recorder, installed by the first test that asks.
fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().expect("no other metrics recorder");
        snapshotter
    })
}

/// The `inbox_store_available` gauge (process-wide: the tests that read it
/// hold [`GAUGE`] so that no other service sets it meanwhile).
fn store_gauge() -> Option<f64> {
    snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .find_map(|(key, _, _, value)| match value {
            DebugValue::Gauge(v) if key.key().name() == inbox_api::metrics::STORE_AVAILABLE => {
                Some(v.into_inner())
            }
            _ => None,
        })
}

/// Held by every test that runs a service in this process: each sets the
/// process-wide gauge, which some of them read.
static GAUGE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

// --------------------------------------------------------- the service

/// The delivery budget of these tests, short so that an outage outlasts it
/// in seconds: three deliveries of three quick attempts each.
fn worker_config() -> WorkerConfig {
    WorkerConfig {
        prefetch: 8,
        concurrency: 4,
        handle_timeout: Duration::from_secs(10),
        retry_attempts: 3,
        retry_base_delay: Duration::from_millis(5),
        max_deliveries: 3,
        max_body_bytes: 1024,
        batch: None,
        ack_flush: Duration::from_millis(2),
    }
}

/// One test's names (queue prefix, schema, connection) and broker. A test
/// that fails leaves nothing behind on the shared servers: on a panic the
/// drop deletes its queues and exchanges, its schema, and whatever else it
/// registered ([`Scenario::on_failure`]).
struct Scenario {
    prefix: String,
    schema: String,
    connection: String,
    amqp: String,
    /// SQL run on the shared database if the test panics.
    failure_sql: std::sync::Mutex<Vec<String>>,
}

impl Scenario {
    fn new(test: &str, amqp: &str) -> Self {
        let id = id();
        Self {
            prefix: format!("test-{test}-{id}."),
            schema: format!("outage_{id}"),
            connection: format!("parcel-inbox test {test} {id}"),
            amqp: amqp.to_owned(),
            failure_sql: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Runs `sql` on the shared database should the test fail.
    fn on_failure(&self, sql: String) {
        self.failure_sql
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(sql);
    }

    fn topology(&self) -> Topology {
        Topology::new(&self.prefix)
    }

    fn start<S: ParcelStore>(&self, store: &S) -> ServiceHandle {
        snapshotter();
        let config = ServiceConfig {
            worker: worker_config(),
            cleanup: None,
            gauge_interval: None,
            // Probe at least every second, so the tests resume promptly.
            availability: AvailabilityConfig {
                threshold: 3,
                probe_delay: Duration::from_millis(100),
                max_probe_delay: Duration::from_secs(1),
            },
            ..ServiceConfig::new(&self.amqp, &self.connection)
        };
        let downstreams = Downstreams {
            carrier: Arc::new(StubCarrier::default()),
            notifier: Arc::new(StubNotifier::default()),
        };
        spawn(store.clone(), config, &self.topology(), downstreams).expect("service starts")
    }

    /// Starts the service on the migrated `store` and waits until it has
    /// processed `warm` messages: a service known to work before the
    /// outage.
    async fn running<S: ParcelStore>(&self, store: &S, warm: u64) -> ServiceHandle {
        let service = self.start(store);
        service
            .wait_consuming(1, Duration::from_secs(30))
            .await
            .expect("consuming");
        self.publish(usize::try_from(warm).expect("a count"), 1)
            .await;
        processed(&service.tally, warm, Duration::from_secs(30)).await;
        service
    }

    async fn publish(&self, count: usize, seed: u64) {
        let plan = Plan::new(count, 0.0, seed, &format!("P{}-{seed}", self.schema)).expect("plan");
        publish(&self.amqp, &self.topology(), &plan.messages, false)
            .await
            .expect("publish");
    }

    /// Messages ready in each consumer's queue and dead-letter queue.
    async fn depths(&self) -> Vec<(String, u32)> {
        let connection = connect(&self.amqp, "parcel-inbox test depths")
            .await
            .expect("connect");
        let channel = connection.create_channel().await.expect("channel");
        let topology = self.topology();
        let mut depths = Vec::new();
        for role in Role::ALL {
            for queue in [topology.queue(role), topology.dead_letter_queue(role)] {
                let n = topology
                    .ready_messages(&channel, &queue)
                    .await
                    .expect("depth");
                depths.push((queue, n));
            }
        }
        close_bounded(&connection, "bye").await;
        depths
    }

    async fn dead_letter_queues_are_empty(&self) {
        for (queue, n) in self.depths().await {
            if queue.ends_with(".dlq") {
                assert_eq!(n, 0, "{queue} holds {n} dead letters");
            }
        }
    }

    async fn remove_topology(&self) {
        let connection = connect(&self.amqp, "parcel-inbox test cleanup")
            .await
            .expect("connect");
        let channel = connection.create_channel().await.expect("channel");
        self.topology()
            .delete(&channel)
            .await
            .expect("delete topology");
        close_bounded(&connection, "bye").await;
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let mut sql = vec![format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema)];
        sql.extend(
            self.failure_sql
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .drain(..),
        );
        for statement in sql {
            let _ = Command::new("psql")
                .args([&shared_database(), "-qAtc", &statement])
                .output();
        }
        let (amqp, topology) = (self.amqp.clone(), self.topology());
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async move {
                let attempt = async {
                    let connection = connect(&amqp, "parcel-inbox test teardown").await.ok()?;
                    if let Ok(channel) = connection.create_channel().await {
                        let _ = topology.delete(&channel).await;
                    }
                    close_bounded(&connection, "bye").await;
                    Some(())
                };
                let _ = tokio::time::timeout(Duration::from_secs(20), attempt).await;
            });
        });
    }
}

/// Waits until every consumer processed `n` messages, or fails with the
/// counters.
async fn processed(tally: &Tally, n: u64, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let done = Role::PARCEL_CREATED
            .iter()
            .all(|r| tally.consumer(r.consumer_name()).processed() >= n);
        if done {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not every consumer processed {n} within {limit:?}: {tally:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the service's store availability is `up`, or fails.
async fn store_is(service: &ServiceHandle, up: bool, limit: Duration) {
    let mut availability = service.store_availability();
    tokio::time::timeout(limit, availability.wait_for(|a| *a == up))
        .await
        .unwrap_or_else(|_| panic!("store availability not {up} within {limit:?}"))
        .expect("service running");
}

/// The service pauses (availability and gauge 0) and stays paused for a
/// while without dead-lettering anything: paused, not spinning through the
/// messages.
async fn stays_paused(service: &ServiceHandle) {
    store_is(service, false, Duration::from_secs(20)).await;
    assert_eq!(store_gauge(), Some(0.0));
    tokio::time::sleep(Duration::from_secs(2)).await;
    nothing_dead_lettered(&service.tally);
    assert!(!service.store_available(), "still paused");
}

/// The service resumes (availability and gauge 1), every consumer processes
/// `total` messages, and it shuts down cleanly with nothing dead-lettered.
async fn resumes_and_processes(service: ServiceHandle, total: u64) -> Arc<Tally> {
    store_is(&service, true, Duration::from_secs(20)).await;
    assert_eq!(store_gauge(), Some(1.0));
    processed(&service.tally, total, Duration::from_secs(60)).await;
    let tally = Arc::clone(&service.tally);
    service.shutdown();
    service.join().await.expect("clean shutdown");
    nothing_dead_lettered(&tally);
    tally
}

fn nothing_dead_lettered(tally: &Tally) {
    for role in Role::ALL {
        let t = tally.consumer(role.consumer_name());
        assert_eq!(
            t.dead_lettered_total(),
            0,
            "{role:?} dead-lettered {:?}",
            t.dead_lettered()
        );
    }
}

fn once_each(stats: &Stats, n: u64) {
    for (table, counts) in [
        ("notifications", stats.notifications),
        ("carrier_assignments", stats.carrier_assignments),
    ] {
        assert_eq!(counts.rows, n, "{table}\n{stats}");
        assert_eq!(counts.double_effects(), 0, "{table}\n{stats}");
    }
}

// ------------------------------------------------------------ scenarios

/// THE outage: PostgreSQL stopped during a quiet period for longer than a
/// message's whole delivery budget (3 deliveries × 3 attempts, each attempt
/// failing within the pool's 1 s acquire timeout), messages published
/// meanwhile, then started again. Without a pause every one of them would
/// walk through its budget into the dead-letter queue; with it, each is
/// processed once after the restart and nothing is dead-lettered.
async fn postgres_outage_longer_than_the_budget<S: ParcelStore>(
    connect_store: impl AsyncFn(&str, &str) -> S,
) {
    const WARM: u64 = 4;
    const DURING: u64 = 8;
    let _gauge = GAUGE.lock().await;
    let pg = PrivatePostgres::start();
    let scenario = Scenario::new("pg-outage", SHARED_AMQP);
    let store = connect_store(&pg.url(), &scenario.schema).await;
    store.migrate_all().await.expect("migrate");
    let service = scenario.running(&store, WARM).await;
    assert_eq!(store_gauge(), Some(1.0));

    pg.halt();
    let down = Instant::now();
    scenario.publish(DURING as usize, 2).await;
    store_is(&service, false, Duration::from_secs(15)).await;
    assert_eq!(store_gauge(), Some(0.0));
    // Longer than the budget: 3 deliveries × (3 attempts of ≤ 1 s, then a
    // requeue pause of 50 ms, 100 ms, …) is about 10 s.
    let outage = Duration::from_secs(20);
    tokio::time::sleep(outage.saturating_sub(down.elapsed())).await;
    nothing_dead_lettered(&service.tally);
    assert!(!service.store_available(), "paused for the whole outage");
    pg.resume();

    store_is(&service, true, Duration::from_secs(15)).await;
    assert_eq!(store_gauge(), Some(1.0));
    processed(&service.tally, WARM + DURING, Duration::from_secs(60)).await;
    let tally = Arc::clone(&service.tally);
    service.shutdown();
    service.join().await.expect("clean shutdown");
    nothing_dead_lettered(&tally);
    for role in Role::PARCEL_CREATED {
        assert_eq!(
            tally.consumer(role.consumer_name()).processed(),
            WARM + DURING,
            "{role:?}"
        );
    }
    scenario.dead_letter_queues_are_empty().await;
    once_each(&store.stats().await.expect("stats"), WARM + DURING);
    scenario.remove_topology().await;
}

/// The schema dropped under the running service (a botched deploy, a
/// restore into the wrong place): consumption pauses, nothing is
/// dead-lettered; once the schema is migrated again, everything published
/// meanwhile is processed once.
async fn schema_dropped_mid_run_pauses_until_migrated<S: ParcelStore>(
    connect_store: impl AsyncFn(&str, &str) -> S,
) {
    const BEFORE: u64 = 3;
    const AFTER: u64 = 6;
    let _gauge = GAUGE.lock().await;
    let scenario = Scenario::new("schema-drop", SHARED_AMQP);
    let store = connect_store(&shared_database(), &scenario.schema).await;
    store.migrate_all().await.expect("migrate");
    let service = scenario.running(&store, BEFORE).await;

    store.drop_schema().await.expect("drop the schema");
    scenario.publish(AFTER as usize, 2).await;
    stays_paused(&service).await;

    store.migrate_all().await.expect("migrate again");
    let tally = resumes_and_processes(service, BEFORE + AFTER).await;
    let released: u64 = Role::ALL
        .iter()
        .map(|r| tally.consumer(r.consumer_name()).released())
        .sum();
    assert!(released > 0, "deliveries were handed back: {tally:?}");
    scenario.dead_letter_queues_are_empty().await;
    // The effects before the drop went with the schema.
    once_each(&store.stats().await.expect("stats"), AFTER);
    store.drop_schema().await.expect("drop schema");
    scenario.remove_topology().await;
}

/// A privilege revoked under the running service (SQLSTATE 42501 on one
/// consumer's table): it is the deployment's fault, so consumption pauses
/// (the probe checks the handlers' tables too, so it stays paused) and
/// nothing is dead-lettered; once granted again, everything is processed
/// once. The service runs as a role of its own: a superuser has every
/// privilege.
async fn privilege_revoked_mid_run_pauses_until_granted<S: ParcelStore>(
    connect_store: impl AsyncFn(&str, &str) -> S,
) {
    const BEFORE: u64 = 3;
    const AFTER: u64 = 4;
    let _gauge = GAUGE.lock().await;
    let scenario = Scenario::new("revoke", SHARED_AMQP);
    let admin = connect_store(&shared_database(), &scenario.schema).await;
    admin.migrate_all().await.expect("migrate");
    let role = format!("inbox_test_{}", id());
    let schema = &scenario.schema;
    let psql = |sql: &str| {
        run(
            "psql",
            &[&shared_database(), "-v", "ON_ERROR_STOP=1", "-Atc", sql],
        )
    };
    psql(&format!(
        "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA {schema} TO {role}; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}; \
         GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}"
    ));
    scenario.on_failure(format!("DROP OWNED BY {role}; DROP ROLE {role}"));
    let as_role = shared_database().replacen("postgres@", &format!("{role}@"), 1);
    assert_ne!(
        as_role,
        shared_database(),
        "DATABASE_URL names user postgres"
    );
    let store = connect_store(&as_role, schema).await;
    let service = scenario.running(&store, BEFORE).await;

    psql(&format!(
        "REVOKE INSERT ON {schema}.notifications FROM {role}"
    ));
    scenario.publish(AFTER as usize, 2).await;
    // The probe sees the privilege missing, so the pause lasts.
    stays_paused(&service).await;

    psql(&format!("GRANT INSERT ON {schema}.notifications TO {role}"));
    resumes_and_processes(service, BEFORE + AFTER).await;
    scenario.dead_letter_queues_are_empty().await;
    once_each(&admin.stats().await.expect("stats"), BEFORE + AFTER);
    drop(store);
    admin.drop_schema().await.expect("drop schema");
    psql(&format!("DROP OWNED BY {role}; DROP ROLE {role}"));
    scenario.remove_topology().await;
}

/// `consume` on a schema nobody migrated refuses to start, naming the
/// command that fixes it, and leaves the waiting messages alone.
async fn unmigrated_schema_refuses_to_start(store: &str) {
    let scenario = Scenario::new(&format!("unmigrated-{store}"), SHARED_AMQP);
    scenario.publish(3, 1).await;
    let schema = format!("--schema={}", scenario.schema);
    let prefix = format!("--prefix={}", scenario.prefix);
    let (code, text) = parcel_inbox_within(
        &[
            &format!("--store={store}"),
            &format!("--database-url={}", shared_database()),
            &format!("--amqp-url={SHARED_AMQP}"),
            &schema,
            &prefix,
            "consume",
            "--metrics-addr=off",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(1), "consume must refuse to start:\n{text}");
    let fix = format!("parcel-inbox migrate --schema {}", scenario.schema);
    assert!(text.contains(&fix), "the error names `{fix}`:\n{text}");
    // The messages wait in parcel.created's queues; the second hop's and
    // the dead-letter queues stay empty.
    let second_hop = scenario.topology().queue(Role::CarrierAssignedNotification);
    for (queue, n) in scenario.depths().await {
        let expected = if queue.ends_with(".dlq") || queue == second_hop {
            0
        } else {
            3
        };
        assert_eq!(n, expected, "{queue}\n{text}");
    }
    scenario.remove_topology().await;
}

/// RabbitMQ stopped under the running service (`rabbitmqctl stop_app`, as
/// an upgrade does) with messages waiting and in flight, then started
/// again: the service reconnects by itself, and every message is processed
/// once, none dead-lettered. The store is unaffected, so the store circuit
/// stays closed. One backend: the broker's outage touches no store code.
async fn broker_outage_reconnects_and_loses_nothing<S: ParcelStore>(
    connect_store: impl AsyncFn(&str, &str) -> S,
) {
    const BEFORE: u64 = 4;
    const AROUND: u64 = 40;
    // Its service sets the process-wide gauge too.
    let _gauge = GAUGE.lock().await;
    let rabbit = PrivateRabbit::start().await;
    let scenario = Scenario::new("broker-outage", &rabbit.url());
    let store = connect_store(&shared_database(), &scenario.schema).await;
    store.migrate_all().await.expect("migrate");
    let service = scenario.running(&store, BEFORE).await;

    // Some of these are processed, some in flight, some still queued when
    // the broker goes.
    scenario.publish(AROUND as usize, 2).await;
    rabbit.ctl("stop_app");
    tokio::time::sleep(Duration::from_secs(8)).await;
    rabbit.ctl("start_app");
    rabbit.up().await;
    service
        .wait_consuming(2, Duration::from_secs(60))
        .await
        .expect("the service reconnected");

    processed(&service.tally, BEFORE + AROUND, Duration::from_secs(60)).await;
    let tally = Arc::clone(&service.tally);
    assert!(
        service.store_available(),
        "a broker outage is not the store's"
    );
    service.shutdown();
    service.join().await.expect("clean shutdown");
    nothing_dead_lettered(&tally);
    for (queue, n) in scenario.depths().await {
        assert_eq!(n, 0, "{queue} still holds {n}");
    }
    once_each(&store.stats().await.expect("stats"), BEFORE + AROUND);
    store.drop_schema().await.expect("drop schema");
}

/// Runs parcel-inbox, killing it after `limit`: its exit code (`None` when
/// killed) and everything it printed.
fn parcel_inbox_within(args: &[&str], limit: Duration) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run parcel-inbox");
    let started = Instant::now();
    while child.try_wait().expect("poll parcel-inbox").is_none() && started.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(50));
    }
    let killed = child.try_wait().expect("poll parcel-inbox").is_none();
    if killed {
        child.kill().expect("kill parcel-inbox");
    }
    let output = child.wait_with_output().expect("parcel-inbox's output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (if killed { None } else { output.status.code() }, text)
}

// ------------------------------------------------------------ the backends

macro_rules! outage_tests {
    ($connect:path, $kind:literal) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn postgres_outage_longer_than_the_budget() {
            super::postgres_outage_longer_than_the_budget($connect).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn schema_dropped_mid_run_pauses_until_migrated() {
            super::schema_dropped_mid_run_pauses_until_migrated($connect).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn privilege_revoked_mid_run_pauses_until_granted() {
            super::privilege_revoked_mid_run_pauses_until_granted($connect).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn unmigrated_schema_refuses_to_start() {
            super::unmigrated_schema_refuses_to_start($kind).await;
        }
    };
}

#[cfg(feature = "sqlx")]
mod sqlx_store {
    use std::time::Duration;

    use inbox_backend_sqlx::SqlxStore;

    /// A store whose pool gives up on a connection after 1 s, so that an
    /// attempt during an outage fails quickly.
    async fn connect(url: &str, schema: &str) -> SqlxStore {
        let options = SqlxStore::connect_options(url, schema).expect("options");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(1))
            .connect_with(options)
            .await
            .expect("connect to PostgreSQL");
        SqlxStore::new(pool, schema).expect("store")
    }

    outage_tests!(connect, "sqlx");

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn broker_outage_reconnects_and_loses_nothing() {
        super::broker_outage_reconnects_and_loses_nothing(connect).await;
    }
}

#[cfg(feature = "diesel")]
mod diesel_store {
    use std::time::Duration;

    use inbox_backend_diesel::DieselStore;

    /// As the sqlx one: 1 s to get or open a connection.
    async fn connect(url: &str, schema: &str) -> DieselStore {
        DieselStore::builder(url, schema)
            .expect("builder")
            .pool_size(8)
            .wait_timeout(Duration::from_secs(1))
            .connect_timeout(Duration::from_secs(1))
            .connect()
            .await
            .expect("connect to PostgreSQL")
    }

    outage_tests!(connect, "diesel");
}
