//! The full loop, producer to the second hop, against the real RabbitMQ
//! (127.0.0.1:5672, guest/guest) and, for sqlx and diesel, the real
//! PostgreSQL (`DATABASE_URL`): parcels created through `POST /parcels` on a
//! listening server, an in-process relay publishing the outbox, the carrier
//! consumer enqueueing `parcel.carrier-assigned` in its inbox transaction,
//! the relay publishing that too, and the third consumer notifying. With a
//! crash in each hop, retried requests, and a copy of every message
//! published again (a relay that died between confirm and mark): every
//! effect exactly once per parcel. Each test has its own queue prefix and
//! schema; an unreachable service fails it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use consumer_app::parcel::downstream::{Downstreams, StubCarrier, StubNotifier};
use consumer_app::parcel::events::{CARRIER_ASSIGNED_TYPE, ParcelCreatedEvent, created_message_id};
use consumer_app::parcel::role::Role;
use consumer_app::parcel::service::{consumers, with_handlers};
use consumer_app::parcel::store::ParcelStore;
use consumer_app::parcel::topology::Topology;
use consumer_app::tools::faults::Faults;
use consumer_app::tools::producer::{Producer, create_parcels, publish_copies};
use inbox_api::{ConsumerName, InboxKey, MessageId};
use inbox_runtime::message::follow_up_id;
use inbox_runtime::tally::Tally;
use inbox_runtime::{ServiceConfig, WorkerConfig};

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Parcels per run: enough for batches and interleavings, small for CI.
const N: u64 = 20;

fn consumer(role: Role) -> ConsumerName {
    ConsumerName::new(role.consumer_name()).expect("name")
}

/// The carrier-assigned event's id for the parcel created under `created`.
fn follow_up(created: &MessageId) -> MessageId {
    follow_up_id(created, &consumer(Role::Carrier), CARRIER_ASSIGNED_TYPE)
}

async fn until(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done().await {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn processed(tally: &Tally, role: Role) -> u64 {
    tally.consumer(role.consumer_name()).processed()
}

async fn the_chain_crosses_two_hops_exactly_once<S: ParcelStore>(
    store: S,
    prefix: &str,
    amqp: &str,
) {
    let topology = Topology::new(prefix);
    let _remove = topology.remove_on_drop(amqp);
    let parcels: Vec<ParcelCreatedEvent> = (0..N)
        .map(|i| ParcelCreatedEvent {
            parcel_id: format!("{prefix}P-{i}"),
            tracking_number: format!("TN{i:04}"),
            destination: ["Lyon", "Gdańsk", "Porto"][usize::try_from(i % 3).expect("small")]
                .to_owned(),
        })
        .collect();
    let created: Vec<MessageId> = parcels
        .iter()
        .map(|p| created_message_id(&p.parcel_id))
        .collect();
    let follow_ups: Vec<MessageId> = created.iter().map(follow_up).collect();

    // A crash in each hop: the carrier consumer dies after its writes and
    // its enqueue, before COMMIT (the follow-up must vanish with them and
    // come back once from the re-run), and so does the third consumer.
    let faults = Arc::new(Faults::default());
    faults.crash_first_attempt(InboxKey::new(created[0], consumer(Role::Carrier)));
    faults.crash_first_attempt(InboxKey::new(
        follow_ups[1],
        consumer(Role::CarrierAssignedNotification),
    ));
    let downstreams = Downstreams {
        carrier: Arc::new(StubCarrier::default()),
        notifier: Arc::new(StubNotifier::default()),
    };
    let service = with_handlers(
        store.clone(),
        ServiceConfig {
            worker: WorkerConfig {
                prefetch: 16,
                concurrency: 4,
                ..WorkerConfig::default()
            },
            connection_name: format!("full loop {prefix}"),
            cleanup: None,
            gauge_interval: None,
            ..ServiceConfig::new(amqp, "")
        },
        &topology,
        consumers(downstreams).expect("consumers").map(&faults),
    )
    .spawn()
    .expect("service starts");
    service
        .wait_consuming(1, Duration::from_secs(20))
        .await
        .expect("RabbitMQ reachable (bash .ci/services.sh)");
    let producer = Producer::start(store.clone(), &topology, amqp, &format!("relay {prefix}"))
        .await
        .expect("producer starts");

    let answers = create_parcels(producer.addr(), &parcels)
        .await
        .expect("POST /parcels");
    assert!(answers.iter().all(|a| a.status == 201), "{answers:?}");
    // Clients retrying (a lost answer): the same parcels again, nothing new.
    let retried = create_parcels(producer.addr(), &parcels[..5])
        .await
        .expect("POST /parcels again");
    assert!(retried.iter().all(|a| a.status == 200), "{retried:?}");

    let tally = Arc::clone(&service.tally);
    until(
        "every parcel through both hops",
        Duration::from_secs(60),
        async || Role::ALL.iter().all(|r| processed(&tally, *r) >= N),
    )
    .await;
    // Every message again, under its id: what a relay that died between
    // the broker's confirm and its mark publishes. Each inbox discards them.
    let mut ids = created.clone();
    ids.extend(&follow_ups);
    let copies = publish_copies(&store, amqp, &ids).await.expect("copies");
    assert_eq!(copies, ids.len(), "every message has its outbox row");
    until(
        "every copy discarded",
        Duration::from_secs(60),
        async || {
            Role::ALL
                .iter()
                .all(|r| tally.consumer(r.consumer_name()).duplicates() >= N)
        },
    )
    .await;
    until(
        "the outbox published",
        Duration::from_secs(30),
        async || store.pending_count().await.expect("pending") == 0,
    )
    .await;

    let stats = store.stats().await.expect("stats");
    assert_eq!(stats.parcels, N, "{stats}");
    for (name, counts) in [
        ("notifications", stats.notifications),
        ("carrier_assignments", stats.carrier_assignments),
        (
            "carrier_assigned_notifications",
            stats.carrier_assigned_notifications,
        ),
    ] {
        assert_eq!(counts.rows, N, "{name}\n{stats}");
        assert_eq!(counts.distinct_parcels, N, "{name}\n{stats}");
        assert_eq!(counts.double_effects(), 0, "{name}\n{stats}");
    }
    for role in Role::ALL {
        assert_eq!(
            stats.inbox_per_consumer.get(role.consumer_name()).copied(),
            Some(N),
            "{role:?}\n{stats}"
        );
        let t = tally.consumer(role.consumer_name());
        assert_eq!(t.processed(), N, "{role:?}");
        assert_eq!(t.dead_lettered_total(), 0, "{role:?}");
    }
    // One carrier-assigned event per parcel, under the derived id, caused
    // by the parcel's created event, published.
    for (created, follow_up) in created.iter().zip(&follow_ups) {
        let record = store
            .lookup_outgoing(follow_up)
            .await
            .expect("lookup")
            .expect("the carrier-assigned event");
        assert!(record.published_at.is_some(), "{follow_up} published");
        assert_eq!(
            record.message.headers().get("causation_id"),
            Some(&created.to_string())
        );
        let key = InboxKey::new(*follow_up, consumer(Role::CarrierAssignedNotification));
        assert!(store.lookup(&key).await.expect("lookup").is_some(), "{key}");
    }
    assert_eq!(faults.crashes(Role::Carrier.consumer_name()), 1);
    assert_eq!(
        faults.crashes(Role::CarrierAssignedNotification.consumer_name()),
        1
    );
    let relayed = producer.relay_tally().published();
    assert!(relayed >= 2 * N, "the relay published {relayed}");

    producer.stop().await.expect("relay stops cleanly");
    service.shutdown();
    service.join().await.expect("clean shutdown");
    store.drop_schema().await.expect("drop schema");
}

fn prefix(kind: &str) -> String {
    format!(
        "test-loop-{kind}-{}.",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

#[cfg(any(feature = "sqlx", feature = "diesel"))]
fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

#[cfg(any(feature = "sqlx", feature = "diesel"))]
fn schema(prefix: &str) -> String {
    prefix.trim_end_matches('.').replace('-', "_")
}

#[cfg(feature = "sqlx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_the_chain_crosses_two_hops_exactly_once() {
    let prefix = prefix("sqlx");
    let store = inbox_backend_sqlx::SqlxStore::connect(&database_url(), &schema(&prefix))
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate_all().await.expect("migrate");
    the_chain_crosses_two_hops_exactly_once(store, &prefix, AMQP_URL).await;
}

#[cfg(feature = "diesel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diesel_the_chain_crosses_two_hops_exactly_once() {
    let prefix = prefix("diesel");
    let store = inbox_backend_diesel::DieselStore::connect(&database_url(), &schema(&prefix), 8)
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate_all().await.expect("migrate");
    the_chain_crosses_two_hops_exactly_once(store, &prefix, AMQP_URL).await;
}

#[cfg(feature = "memory")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_the_chain_crosses_two_hops_exactly_once() {
    let store = inbox_backend_memory::MemoryStore::new();
    the_chain_crosses_two_hops_exactly_once(store, &prefix("memory"), AMQP_URL).await;
}

/// The same loop with every connection over TLS, verified: a RabbitMQ node
/// and a PostgreSQL cluster of the test's own that take TLS only (no plain
/// listener, `hostssl` lines only), so a connection that fell back to
/// plain text would be refused. Both drivers, one pair of servers.
#[cfg(all(feature = "tls", feature = "sqlx", feature = "diesel"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_the_chain_crosses_two_hops_exactly_once_on_both_drivers() {
    use private_servers::pki::Pki;
    use private_servers::{PrivatePostgres, PrivateRabbit};

    let dir = std::env::temp_dir().join(format!("inbox-loop-tls-{}", &prefix("x")[10..18]));
    let pki = Pki::new(&dir);
    let rabbit = PrivateRabbit::start_tls(&pki).await;
    let pg = PrivatePostgres::start_tls(&pki);
    let ca = pki.ca.display();
    let amqp = format!(
        "amqps://guest:guest@127.0.0.1:{}/%2f?cacertfile={ca}",
        rabbit.port()
    );
    let database = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={ca}",
        pg.port()
    );

    let prefix_sqlx = prefix("tls-sqlx");
    let store = inbox_backend_sqlx::SqlxStore::connect(&database, &schema(&prefix_sqlx))
        .await
        .expect("sqlx over verify-full TLS");
    store.migrate_all().await.expect("migrate");
    the_chain_crosses_two_hops_exactly_once(store, &prefix_sqlx, &amqp).await;

    let prefix_diesel = prefix("tls-diesel");
    let store = inbox_backend_diesel::DieselStore::connect(&database, &schema(&prefix_diesel), 8)
        .await
        .expect("diesel over verify-full TLS");
    store.migrate_all().await.expect("migrate");
    the_chain_crosses_two_hops_exactly_once(store, &prefix_diesel, &amqp).await;

    drop((rabbit, pg));
    let _ = std::fs::remove_dir_all(&dir);
}
