//! The consume process is killed (SIGKILL) mid-work: its open transactions
//! die with it, the broker redelivers its unacked deliveries to a new
//! instance, and every effect happens exactly once. Per Postgres store (a
//! memory store dies with its process). Here rather than beside the app's
//! end-to-end tests because the child holds each transaction open for a
//! while (`parcel-lab-consume --fault-work-delay-ms`), which the production
//! binary cannot. Needs PostgreSQL and RabbitMQ (`bash .ci/services.sh`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use consumer_app::parcel::downstream::{StubCarrier, StubNotifier};
use consumer_app::parcel::role::Role;
use consumer_app::parcel::service::spawn;
use consumer_app::parcel::store::{ParcelStore, Stats};
use consumer_app::parcel::topology::Topology;
use consumer_app::runtime::amqp::connect;
use consumer_app::runtime::tally::get;
use consumer_app::runtime::{ServiceConfig, WorkerConfig};
use consumer_app::tools::publish::{Plan, publish};

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
    for role in Role::ALL {
        assert_eq!(
            stats.inbox_per_consumer.get(role.consumer_name()).copied(),
            Some(n),
            "inbox rows of {}\n{stats}",
            role.consumer_name()
        );
    }
}

async fn killed_process_redelivers_exactly_once<S: ParcelStore>(store: S, kind: &str, id: &str) {
    let prefix = format!("test-kill-{kind}-{id}.");
    let schema = format!("app_test_{id}");
    let topology = Topology::new(&prefix);
    // `publish` declares the topology itself, so the messages are routed
    // whether or not the child got there first.
    let plan = Plan::new(40, 0.0, 9, &format!("P{schema}")).expect("plan");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_parcel-lab-consume"))
        .args([
            "--store",
            kind,
            "--database-url",
            &database_url(),
            "--amqp-url",
            AMQP_URL,
            "--schema",
            &schema,
            "--prefix",
            &prefix,
            "--metrics-addr",
            "off",
            "--concurrency",
            "4",
            "--cleanup-interval-secs",
            "0",
            "--fault-work-delay-ms",
            "200",
        ])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start parcel-lab-consume");
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
    child.kill().await.expect("SIGKILL the consumer");
    let before = store.stats().await.expect("stats");
    assert!(
        before.carrier_assignments.rows < 40,
        "killed mid-stream: {before}"
    );

    let service = spawn(
        store.clone(),
        ServiceConfig {
            amqp_url: AMQP_URL.to_owned(),
            worker: WorkerConfig {
                prefetch: 16,
                concurrency: 4,
                handle_timeout: Duration::from_secs(10),
                retry_base_delay: Duration::from_millis(5),
                max_deliveries: 5,
                max_body_bytes: 1024,
                ..WorkerConfig::default()
            },
            connection_name: format!("parcel-lab test kill {id}"),
            cleanup: None,
            gauge_interval: None,
            availability: Default::default(),
        },
        &topology,
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
            stats.carrier_assignments.rows >= 40 && stats.notifications.rows >= 40
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
            get(&t.redelivered_processed) + get(&t.duplicates)
        })
        .sum();
    assert!(
        redelivered >= 1,
        "the killed process's unacked deliveries came back"
    );
    let stats = store.stats().await.expect("stats");
    assert_exactly_once(&stats, 40);

    let connection = connect(AMQP_URL, "parcel-lab test cleanup")
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    topology.delete(&channel).await.expect("delete topology");
    consumer_app::runtime::amqp::close_bounded(&connection, "bye").await;
    store.drop_schema().await.expect("drop schema");
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
    let schema = format!("app_test_{id}");
    let store = inbox_backend_sqlx::SqlxStore::connect(
        &with_application_name(&database_url(), &schema),
        &schema,
    )
    .await
    .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate_all().await.expect("migrate");
    killed_process_redelivers_exactly_once(store, "sqlx", &id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_process_redelivers_exactly_once_diesel() {
    let id = unique();
    let schema = format!("app_test_{id}");
    let store = inbox_backend_diesel::DieselStore::connect(
        &with_application_name(&database_url(), &schema),
        &schema,
        8,
    )
    .await
    .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate_all().await.expect("migrate");
    killed_process_redelivers_exactly_once(store, "diesel", &id).await;
}
