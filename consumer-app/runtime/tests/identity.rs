//! Where a consumer reads its message id, against the real RabbitMQ
//! (127.0.0.1:5672), on every store (the in-process one, and sqlx and
//! diesel on the real PostgreSQL at `DATABASE_URL`, each in a schema of
//! its own): each consumer below takes the same kind of order from a
//! producer that puts its id somewhere else, and every copy of an order
//! (republished with a fresh AMQP `message_id`, as a producer that knows
//! nothing of ours would) is processed once. A missing or unusable id is
//! dead-lettered with its reason, never processed under an id of our
//! invention. Each run has its own queue prefix; the topology is removed
//! afterwards.

use std::time::{Duration, Instant};

use inbox_runtime::amqp::{Publisher, close_bounded, connect};
use inbox_runtime::lapin::types::{AMQPValue, FieldTable, LongString};
use inbox_runtime::lapin::{BasicProperties, Connection};
use inbox_runtime::prelude::*;
use serde::{Deserialize, Serialize};

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

#[derive(Clone, Serialize, Deserialize)]
struct OrderPlaced {
    /// Any JSON: the identity decides what it must be.
    order_id: serde_json::Value,
}
impl Event for OrderPlaced {
    const TYPE: &'static str = "order.placed";
}

async fn record(
    mut cx: Context<'_, MemoryTransaction>,
    order: OrderPlaced,
) -> Result<(), AppError> {
    let id = cx.message_id();
    cx.put(format!("orders/{id}"), order.order_id.to_string());
    Ok(())
}

/// The handler on any store: what it processed is the inbox's rows.
async fn accept<Tx>(_cx: Context<'_, Tx>, _order: OrderPlaced) -> Result<(), AppError> {
    Ok(())
}

/// Starts `service`, waits until it consumes, and connects a publisher of
/// the test's own.
async fn start<S: ServiceStore>(
    service: Service<S>,
    publisher: &str,
) -> (ServiceHandle, Connection) {
    let service = service
        .spawn()
        .expect("the service starts (bash .ci/services.sh)");
    service
        .wait_ready(Duration::from_secs(30))
        .await
        .expect("consuming");
    let connection = connect(AMQP_URL, publisher)
        .await
        .expect("RabbitMQ reachable (bash .ci/services.sh)");
    (service, connection)
}

/// One consumer: its identity, the deliveries it gets (AMQP id, headers,
/// body), and what must come of them.
struct Case {
    name: &'static str,
    identity: Identity,
    deliveries: Vec<(Option<String>, Option<FieldTable>, serde_json::Value)>,
    processed: u64,
    duplicates: u64,
    /// Copies under a processed id with another body.
    conflicts: u64,
    dead: &'static [(&'static str, u64)],
}

fn fresh() -> Option<String> {
    Some(MessageId::new_v7().to_string())
}

fn header(value: AMQPValue) -> Option<FieldTable> {
    let mut headers = FieldTable::default();
    headers.insert("x-order-key".into(), value);
    Some(headers)
}

fn cases() -> Vec<Case> {
    let order = |id: serde_json::Value| serde_json::json!({ "order_id": id });
    let text = |s: &str| AMQPValue::LongString(LongString::from(s));
    let uuid = MessageId::new_v7().to_string();
    vec![
        Case {
            name: "by-header",
            identity: Identity::header("x-order-key").accept_keys(),
            deliveries: vec![
                (fresh(), header(text("A-1")), order(1.into())),
                (fresh(), header(text("A-1")), order(1.into())),
                (fresh(), header(text("A-2")), order(2.into())),
                (fresh(), header(AMQPValue::LongLongInt(3)), order(3.into())),
                (fresh(), header(text("3")), order(3.into())),
                (fresh(), None, order(4.into())),
                (fresh(), header(AMQPValue::Boolean(true)), order(5.into())),
            ],
            processed: 3,
            duplicates: 2,
            conflicts: 0,
            dead: &[("invalid_message_id", 1), ("missing_message_id", 1)],
        },
        Case {
            name: "by-field",
            identity: Identity::body_field("order_id").accept_keys(),
            deliveries: vec![
                (fresh(), None, order(10.into())),
                (None, None, order(10.into())),
                // The same key (an integer is its decimal text) with
                // another body: a conflict, acknowledged by default.
                (fresh(), None, order("10".into())),
                (fresh(), None, order(11.into())),
                (fresh(), None, order(1.5.into())),
                (fresh(), None, serde_json::json!({ "other": 1 })),
            ],
            processed: 2,
            duplicates: 1,
            conflicts: 1,
            dead: &[("invalid_message_id", 1), ("missing_message_id", 1)],
        },
        Case {
            name: "by-content",
            identity: Identity::content_hash(),
            deliveries: vec![
                (None, None, order(20.into())),
                (fresh(), None, order(20.into())),
                (None, None, order(21.into())),
            ],
            processed: 2,
            duplicates: 1,
            conflicts: 0,
            dead: &[],
        },
        Case {
            name: "uuids-only",
            identity: Identity::default(),
            deliveries: vec![
                (Some(uuid.clone()), None, order(30.into())),
                (Some(uuid), None, order(30.into())),
                (Some("order-31".to_owned()), None, order(31.into())),
                (None, None, order(32.into())),
            ],
            processed: 1,
            duplicates: 1,
            conflicts: 0,
            dead: &[("invalid_message_id", 1), ("missing_message_id", 1)],
        },
        Case {
            name: "keys",
            identity: Identity::message_id().accept_keys(),
            deliveries: vec![
                (Some("order-40".to_owned()), None, order(40.into())),
                (Some("order-40".to_owned()), None, order(40.into())),
                (Some("order-41".to_owned()), None, order(41.into())),
            ],
            processed: 2,
            duplicates: 1,
            conflicts: 0,
            dead: &[],
        },
    ]
}

async fn each_consumer_reads_its_id_where_its_producer_puts_it<S: ServiceStore>(store: S) {
    let prefix = format!(
        "test-identity-{}.",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let exchange = format!("{prefix}orders");
    let cases = cases();
    let mut topology = Topology::new(&exchange);
    for case in &cases {
        topology = topology.bind(format!("{prefix}{}", case.name), case.name);
    }
    // One delivery at a time, in queue order: which copy of an id comes
    // first (processed) and which later (duplicate or conflict) is then
    // the order of publishing, not a race.
    let mut config = ServiceConfig::new(AMQP_URL, "identity test");
    config.worker.concurrency = 1;
    let mut service = Service::new(store.clone(), config, topology.clone());
    for case in &cases {
        let handler = handler_fn(case.name, accept::<S::Transaction>)
            .expect("valid name")
            .with_identity(case.identity.clone());
        service = service.consume(format!("{prefix}{}", case.name), handler);
    }
    let (service, connection) = start(service, "identity test publisher").await;
    for case in &cases {
        let publisher = Publisher::new(&connection, &exchange, case.name)
            .await
            .expect("publisher");
        for (message_id, headers, body) in &case.deliveries {
            let mut properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_type(OrderPlaced::TYPE.into());
            if let Some(id) = message_id {
                properties = properties.with_message_id(id.as_str().into());
            }
            if let Some(headers) = headers {
                properties = properties.with_headers(headers.clone());
            }
            let body = serde_json::to_vec(body).expect("json");
            Publisher::publish_raw(publisher.channel(), &exchange, case.name, &body, properties)
                .await
                .expect("confirmed");
        }
        publisher.close().await;
    }

    let deadline = Instant::now() + Duration::from_secs(60);
    for case in &cases {
        let tally = service.tally.consumer(case.name);
        while tally.finished() < case.deliveries.len() as u64 {
            assert!(
                Instant::now() < deadline,
                "{}: every delivery finished within 60 s ({} of {})",
                case.name,
                tally.finished(),
                case.deliveries.len()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
    for case in &cases {
        let tally = service.tally.consumer(case.name);
        let dead: Vec<(String, u64)> = case.dead.iter().map(|&(r, n)| (r.to_owned(), n)).collect();
        assert_eq!(
            (
                tally.processed(),
                tally.duplicates(),
                tally.conflicts(),
                tally.dead_lettered().into_iter().collect::<Vec<_>>()
            ),
            (case.processed, case.duplicates, case.conflicts, dead),
            "{}: (processed, duplicates, conflicts, dead letters by reason)",
            case.name
        );
    }
    let rows = store.processed_counts().await.expect("inbox rows");
    for case in &cases {
        assert_eq!(
            rows.get(case.name).copied(),
            Some(case.processed),
            "{}: one inbox row per processed order",
            case.name
        );
    }

    service.shutdown();
    service.join().await.expect("clean shutdown");
    let channel = connection.create_channel().await.expect("channel");
    topology.delete(&channel).await.expect("delete topology");
    close_bounded(&connection, "bye").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_each_consumer_reads_its_id_where_its_producer_puts_it() {
    each_consumer_reads_its_id_where_its_producer_puts_it(MemoryStore::new()).await;
}

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn schema(kind: &str) -> String {
    format!(
        "identity_{kind}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// Drops `schema` (built above from a fixed word and hex digits).
async fn drop_schema(schema: &str) {
    let pool = inbox_runtime::sqlx_store::sqlx::PgPool::connect(&database_url())
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    inbox_runtime::sqlx_store::sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .execute(&pool)
        .await
        .expect("drop schema");
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_each_consumer_reads_its_id_where_its_producer_puts_it() {
    let schema = schema("sqlx");
    let store = SqlxStore::connect(&database_url(), &schema)
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate().await.expect("migrate");
    each_consumer_reads_its_id_where_its_producer_puts_it(store).await;
    drop_schema(&schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diesel_each_consumer_reads_its_id_where_its_producer_puts_it() {
    let schema = schema("diesel");
    let store = DieselStore::connect(&database_url(), &schema, 4)
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate().await.expect("migrate");
    each_consumer_reads_its_id_where_its_producer_puts_it(store).await;
    drop_schema(&schema).await;
}

/// A copy of a processed message with another body is a conflict, not a
/// duplicate: one consumer acknowledges it (the default) and counts it, the
/// other dead-letters it as `conflicting_duplicate`. The copies are sent
/// once the first delivery is processed, so which body is "first" is not a
/// race.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_with_another_body_follows_the_consumers_conflict_policy() {
    let prefix = format!(
        "test-conflict-{}.",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let exchange = format!("{prefix}orders");
    let consumers = [
        ("acknowledge", ConflictPolicy::Acknowledge),
        ("dead-letter", ConflictPolicy::DeadLetter),
    ];
    let mut topology = Topology::new(&exchange);
    for (name, _) in consumers {
        topology = topology.bind(format!("{prefix}{name}"), name);
    }
    let mut service = Service::new(
        MemoryStore::new(),
        ServiceConfig::new(AMQP_URL, "conflict test"),
        topology.clone(),
    );
    for (name, policy) in consumers {
        let handler = handler_fn(name, record)
            .expect("valid name")
            .with_conflict_policy(policy);
        service = service.consume(format!("{prefix}{name}"), handler);
    }
    let (service, connection) = start(service, "conflict test publisher").await;

    let id = MessageId::new_v7().to_string();
    let send = async |routing_key: &str, destination: &str| {
        let publisher = Publisher::new(&connection, &exchange, routing_key)
            .await
            .expect("publisher");
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_type(OrderPlaced::TYPE.into())
            .with_message_id(id.as_str().into());
        let body = serde_json::json!({ "order_id": 7, "destination": destination });
        let body = serde_json::to_vec(&body).expect("json");
        Publisher::publish_raw(
            publisher.channel(),
            &exchange,
            routing_key,
            &body,
            properties,
        )
        .await
        .expect("confirmed");
        publisher.close().await;
    };
    let until = async |name: &str, finished: u64| {
        let deadline = Instant::now() + Duration::from_secs(60);
        let tally = service.tally.consumer(name);
        while tally.finished() < finished {
            assert!(
                Instant::now() < deadline,
                "{name}: {finished} deliveries finished within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    };
    for (name, _) in consumers {
        send(name, "Lyon").await;
        until(name, 1).await;
        send(name, "Lyon").await;
        send(name, "Nantes").await;
        until(name, 3).await;
    }

    let acknowledge = service.tally.consumer("acknowledge");
    assert_eq!(
        (
            acknowledge.processed(),
            acknowledge.duplicates(),
            acknowledge.conflicts()
        ),
        (1, 1, 1),
        "acknowledge: (processed, duplicates, conflicts)"
    );
    assert_eq!(acknowledge.dead_lettered_total(), 0);
    let dead_letter = service.tally.consumer("dead-letter");
    assert_eq!(
        (
            dead_letter.processed(),
            dead_letter.duplicates(),
            dead_letter.conflicts()
        ),
        (1, 1, 0),
        "dead-letter: (processed, duplicates, conflicts acknowledged)"
    );
    assert_eq!(
        dead_letter.dead_lettered().into_iter().collect::<Vec<_>>(),
        vec![("conflicting_duplicate".to_owned(), 1)]
    );

    // The dead letter holds the second body, with its reason.
    let channel = connection.create_channel().await.expect("channel");
    let dlq = Topology::dead_letter_queue(&format!("{prefix}dead-letter"));
    let got = channel
        .basic_get(
            dlq.as_str().into(),
            inbox_runtime::lapin::options::BasicGetOptions::default(),
        )
        .await
        .expect("basic.get")
        .expect("one dead letter");
    let body: serde_json::Value = serde_json::from_slice(&got.delivery.data).expect("json");
    assert_eq!(body["destination"], "Nantes");
    let reason = got
        .delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-dead-letter-reason").cloned());
    assert_eq!(
        reason,
        Some(AMQPValue::LongString(LongString::from(
            "conflicting_duplicate"
        )))
    );

    service.shutdown();
    service.join().await.expect("clean shutdown");
    topology.delete(&channel).await.expect("delete topology");
    close_bounded(&connection, "bye").await;
}
