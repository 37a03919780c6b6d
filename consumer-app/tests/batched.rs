//! Batched mode end to end, against a real RabbitMQ (127.0.0.1:5672,
//! guest/guest) and a real PostgreSQL (`DATABASE_URL`, default
//! postgres://postgres@127.0.0.1:5432/test): copies reusing message ids, one
//! message whose work always fails, and bad input, through
//! `Inbox::handle_batch`; every effect exactly once. Each test has its own
//! queue prefix and schema, and runs per compiled store.

use std::sync::Arc;
use std::time::{Duration, Instant};

use consumer_app::parcel::downstream::{Downstreams, StubCarrier, StubNotifier};
use consumer_app::parcel::role::Role;
use consumer_app::parcel::service::{consumers, with_handlers};
use consumer_app::parcel::store::ParcelStore;
use consumer_app::parcel::topology::Topology;
use consumer_app::tools::faults::Faults;
use consumer_app::tools::publish::{Plan, publish};
use inbox_api::{ConsumerName, InboxKey};
use inbox_runtime::amqp::{Outgoing, connect};
use inbox_runtime::message::header_text;
use inbox_runtime::{BatchConfig, ServiceConfig, WorkerConfig};
use lapin::options::BasicGetOptions;

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const BATCH: usize = 10;

struct Names {
    prefix: String,
    schema: String,
    connection: String,
}

fn names(test: &str) -> Names {
    let id = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    Names {
        prefix: format!("test-{test}-{id}."),
        schema: format!("app_test_{id}"),
        connection: format!("parcel-inbox test {test} {id}"),
    }
}

fn worker_config() -> WorkerConfig {
    WorkerConfig {
        prefetch: 64,
        concurrency: 3,
        handle_timeout: Duration::from_secs(10),
        retry_attempts: 3,
        retry_base_delay: Duration::from_millis(5),
        max_deliveries: 4,
        max_body_bytes: 1024,
        batch: BatchConfig::effective(BATCH, Duration::from_millis(50), 64),
        ack_flush: Duration::from_millis(2),
    }
}

async fn eventually(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn teardown<S: ParcelStore>(store: &S, names: &Names) {
    if let Ok(connection) = connect(AMQP_URL, "parcel-inbox test teardown").await {
        if let Ok(channel) = connection.create_channel().await {
            let _ = Topology::new(&names.prefix).delete(&channel).await;
        }
        inbox_runtime::amqp::close_bounded(&connection, "bye").await;
    }
    let _ = store.drop_schema().await;
}

/// 80 events plus 40 copies reusing their ids, published before the
/// consumers start (so batches fill, copies of one message land in one
/// batch or in racing batches), one event whose carrier work always fails
/// with a retryable error, and one delivery without a message id.
async fn batched_exactly_once<S: ParcelStore>(store: S, names: Names) {
    const N: u64 = 80;
    if let Err(error) = connect(AMQP_URL, "parcel-inbox test probe").await {
        panic!(
            "RabbitMQ is not reachable at 127.0.0.1:5672 ({}); start it with `bash .ci/services.sh`",
            inbox_runtime::error::chain(&error)
        );
    }
    let topology = Topology::new(&names.prefix);
    {
        let connection = connect(AMQP_URL, "parcel-inbox test declare")
            .await
            .expect("connect");
        let channel = connection.create_channel().await.expect("channel");
        topology.declare(&channel).await.expect("declare");
        inbox_runtime::amqp::close_bounded(&connection, "bye").await;
    }
    let plan = Plan::new(N as usize, 0.5, 21, &format!("P{}", names.schema)).expect("plan");
    let copies = plan.copies as u64;
    let poison = plan.ids[17];
    let mut messages: Vec<Outgoing> = plan.messages.clone();
    messages.insert(
        30,
        Outgoing {
            message_id: None,
            kind: Some(consumer_app::parcel::events::EVENT_TYPE.to_owned()),
            body: br#"{"parcel_id":"P-x","tracking_number":"TNx","destination":"Oslo"}"#.to_vec(),
        },
    );
    publish(AMQP_URL, &topology, &messages, false)
        .await
        .expect("publish");

    let faults = Arc::new(Faults::default());
    faults.fail_always(InboxKey::new(
        poison,
        ConsumerName::new(Role::Carrier.consumer_name()).expect("name"),
    ));
    let carrier = Arc::new(StubCarrier::default());
    let notifier = Arc::new(StubNotifier::default());
    let consumers = consumers(Downstreams {
        carrier: carrier.clone(),
        notifier: notifier.clone(),
    })
    .expect("consumers")
    .map(&faults);
    let service = with_handlers(
        store.clone(),
        ServiceConfig {
            broker_url: AMQP_URL.to_owned(),
            worker: worker_config(),
            connection_name: names.connection.clone(),
            cleanup: None,
            gauge_interval: None,
            availability: Default::default(),
            connection: Default::default(),
        },
        &topology,
        consumers,
    )
    .spawn()
    .expect("service starts");
    let tally = Arc::clone(&service.tally);
    let total = N + copies;
    eventually(
        "every delivery finished by both consumers",
        Duration::from_secs(60),
        || {
            let n = tally.consumer(Role::Notification.consumer_name());
            let c = tally.consumer(Role::Carrier.consumer_name());
            n.finished() > total
                && c.processed() + c.duplicates() >= total - 1 - copies_of(&plan, poison)
                && c.dead_lettered()
                    .get("retries_exhausted")
                    .copied()
                    .unwrap_or(0)
                    > copies_of(&plan, poison)
        },
    )
    .await;
    service.shutdown();
    service.join().await.expect("clean shutdown");

    let notification = tally.consumer(Role::Notification.consumer_name());
    assert_eq!(notification.processed(), N);
    assert_eq!(notification.duplicates(), copies, "every copy discarded");
    assert_eq!(
        notification.dead_lettered().get("missing_message_id"),
        Some(&1),
        "bad input dead-lettered before batching"
    );
    let batches = notification.batches();
    assert!(
        batches > 0 && batches * 2 <= N,
        "batched: {batches} batches for {N} messages"
    );

    let carrier_tally = tally.consumer(Role::Carrier.consumer_name());
    assert_eq!(carrier_tally.processed(), N - 1, "all but the poison");
    assert_eq!(
        carrier_tally.dead_lettered().get("retries_exhausted"),
        Some(&(1 + copies_of(&plan, poison))),
        "the poison (and its copies) dead-lettered at the delivery cap"
    );
    // Batched mode charges the ledger as per-message mode does.
    let poison_key = InboxKey::new(
        poison,
        ConsumerName::new(Role::Carrier.consumer_name()).expect("name"),
    );
    let record = store
        .attempts(&poison_key)
        .await
        .expect("ledger")
        .expect("the poison's ledger row");
    assert_eq!(
        record.dead.map(|d| d.reason),
        Some("retries_exhausted".to_owned()),
        "the poison is marked dead"
    );
    assert!(
        record.last_error.contains("injected transient failure"),
        "{}",
        record.last_error
    );
    let stats = store.stats().await.expect("stats");
    for (table, counts, n) in [
        ("notifications", stats.notifications, N),
        ("carrier_assignments", stats.carrier_assignments, N - 1),
    ] {
        assert_eq!(counts.rows, n, "{table}: one row per message\n{stats}");
        assert_eq!(counts.double_effects(), 0, "{table}\n{stats}");
    }
    assert_eq!(
        stats
            .inbox_per_consumer
            .get(Role::Carrier.consumer_name())
            .copied(),
        Some(N - 1),
        "no inbox row for the failed message\n{stats}"
    );
    assert_eq!(carrier.ledger.calls(), N - 1, "no booking call repeated");
    assert_eq!(notifier.ledger.calls(), N);

    let connection = connect(AMQP_URL, "parcel-inbox test dlq reader")
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    let message = channel
        .basic_get(
            topology.dead_letter_queue(Role::Carrier).as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .expect("basic.get")
        .expect("a dead letter");
    let headers = message
        .delivery
        .properties
        .headers()
        .clone()
        .unwrap_or_default();
    let reason = header_text(&headers, "x-dead-letter-reason");
    assert!(
        matches!(
            reason.as_deref(),
            Some("retries_exhausted" | "missing_message_id")
        ),
        "{reason:?}"
    );
    for role in Role::ALL {
        assert_eq!(
            topology
                .ready_messages(&channel, &topology.queue(role))
                .await
                .expect("depth"),
            0,
            "nothing left in {role:?}'s queue"
        );
    }
    inbox_runtime::amqp::close_bounded(&connection, "bye").await;
    teardown(&store, &names).await;
}

/// How many copies of `id` the plan published besides the first.
fn copies_of(plan: &Plan, id: inbox_api::MessageId) -> u64 {
    let text = id.to_string();
    let n = plan
        .messages
        .iter()
        .filter(|m| m.message_id.as_deref() == Some(text.as_str()))
        .count() as u64;
    n.saturating_sub(1)
}

#[cfg(feature = "sqlx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_exactly_once_sqlx() {
    let names = names("batch-sqlx");
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let store = inbox_backend_sqlx::SqlxStore::connect(&url, &names.schema)
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate_all().await.expect("migrate");
    batched_exactly_once(store, names).await;
}

#[cfg(feature = "diesel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_exactly_once_diesel() {
    let names = names("batch-diesel");
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let store = inbox_backend_diesel::DieselStore::connect(&url, &names.schema, 8)
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate_all().await.expect("migrate");
    batched_exactly_once(store, names).await;
}

#[cfg(feature = "memory")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_exactly_once_memory() {
    batched_exactly_once(inbox_backend_memory::MemoryStore::new(), names("batch-mem")).await;
}
