//! The outbox relay against the real RabbitMQ (127.0.0.1:5672, guest/guest)
//! and, where the store's transactions and `SKIP LOCKED` are the point,
//! PostgreSQL (`DATABASE_URL`); the memory store where the broker is. Each
//! test has its own exchange, queues and schema, removed afterwards.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use inbox_api::{
    InboxStore, InboxTransaction, MessageId, OutboxStore, OutboxTransaction, OutgoingMessage,
};
use inbox_backend_memory::MemoryStore;
use inbox_backend_sqlx::SqlxStore;
use inbox_runtime::amqp::{connect, no_args};
use inbox_runtime::relay::{Relay, RelayConfig, RelayHandle};
use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ExchangeKind};

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// One test's exchange with a queue taking `good` and a queue that refuses
/// every publish (`x-max-length` 0, `reject-publish`: the broker nacks).
struct Broker {
    connection: Connection,
    channel: Channel,
    exchange: String,
    good: String,
    full: String,
}

impl Broker {
    async fn declare(id: &str) -> Self {
        let connection = connect(AMQP_URL, &format!("relay test {id}"))
            .await
            .expect("RabbitMQ reachable (bash .ci/services.sh)");
        let channel = connection.create_channel().await.expect("channel");
        let prefix = format!("test-relay-{id}.");
        let (exchange, good, full) = (
            format!("{prefix}events"),
            format!("{prefix}good"),
            format!("{prefix}full"),
        );
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions::default(),
                no_args(),
            )
            .await
            .expect("exchange");
        let mut refusing = FieldTable::default();
        refusing.insert("x-max-length".into(), AMQPValue::LongInt(0));
        refusing.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        for (queue, arguments) in [(&good, no_args()), (&full, refusing)] {
            channel
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions::default(),
                    arguments,
                )
                .await
                .expect("queue");
            channel
                .queue_bind(
                    queue.as_str().into(),
                    exchange.as_str().into(),
                    queue.as_str().into(),
                    QueueBindOptions::default(),
                    no_args(),
                )
                .await
                .expect("bind");
        }
        Self {
            connection,
            channel,
            exchange,
            good,
            full,
        }
    }

    /// Takes every message of the good queue: (message_id, type, tenant
    /// header, body).
    async fn drain(&self) -> Vec<(String, String, String, Vec<u8>)> {
        let mut got = Vec::new();
        while let Some(message) = self
            .channel
            .basic_get(self.good.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get")
        {
            let properties = &message.delivery.properties;
            let tenant = properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get("tenant").cloned());
            let tenant = match tenant {
                Some(AMQPValue::LongString(s)) => s.to_string(),
                other => format!("{other:?}"),
            };
            got.push((
                properties
                    .message_id()
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
                properties
                    .kind()
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
                tenant,
                message.delivery.data.clone(),
            ));
        }
        got
    }

    async fn remove(self) {
        for queue in [&self.good, &self.full] {
            self.channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
                .expect("delete queue");
        }
        self.channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await
            .expect("delete exchange");
        inbox_runtime::amqp::close_bounded(&self.connection, "bye").await;
    }

    fn message(&self, queue: &str, n: usize) -> OutgoingMessage {
        OutgoingMessage::new(
            MessageId::new_v7(),
            self.exchange.as_str(),
            queue,
            "ParcelCreatedEvent",
            format!("{{\"n\":{n}}}").into_bytes(),
        )
        .and_then(|m| m.with_header("tenant", "acme"))
        .expect("valid message")
    }
}

/// The shared PostgreSQL (`DATABASE_URL`, or the CI service's).
fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn test_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

async fn sqlx_store(id: &str) -> SqlxStore {
    let database_url = database_url();
    let store = SqlxStore::connect(&database_url, &format!("relay_test_{id}"))
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate().await.expect("migrate");
    store
}

async fn drop_schema(store: &SqlxStore) {
    sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", store.schema()))
        .execute(store.pool())
        .await
        .expect("drop schema");
}

/// Enqueues each message in a committed transaction of its own.
async fn enqueue_committed<S: OutboxStore>(store: &S, messages: &[OutgoingMessage]) {
    for message in messages {
        let mut tx = store.begin().await.expect("begin");
        let _ = tx.enqueue(message).await.expect("enqueue");
        tx.commit().await.expect("commit");
    }
}

fn config(id: &str, batch: u32) -> RelayConfig {
    RelayConfig {
        batch_size: std::num::NonZeroU32::new(batch).expect("non-zero"),
        poll_interval: Duration::from_millis(20),
        retry_base_delay: Duration::from_millis(20),
        retry_max_delay: Duration::from_millis(200),
        ..RelayConfig::new(AMQP_URL, format!("relay test {id}"))
    }
}

async fn wait_until<F: AsyncFn() -> bool>(what: &str, condition: F) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn stop(relay: RelayHandle) {
    relay.shutdown();
    relay.join().await.expect("the relay stops cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_messages_are_published_once_under_their_ids_and_marked() {
    let id = test_id();
    let (broker, store) = (Broker::declare(&id).await, sqlx_store(&id).await);
    let committed: Vec<OutgoingMessage> =
        (0..20).map(|n| broker.message(&broker.good, n)).collect();
    enqueue_committed(&store, &committed).await;
    let rolled_back = broker.message(&broker.good, 99);
    let mut tx = store.begin().await.expect("begin");
    let _ = tx.enqueue(&rolled_back).await.expect("enqueue");
    tx.rollback().await.expect("rollback");
    assert_eq!(store.pending_count().await.expect("count"), 20);

    let relay = Relay::new(store.clone(), config(&id, 7))
        .expect("valid config")
        .spawn();
    wait_until("every committed message is marked published", async || {
        store.pending_count().await.expect("count") == 0
    })
    .await;
    let tally = std::sync::Arc::clone(&relay.tally);
    stop(relay).await;

    let got = broker.drain().await;
    let expected: BTreeMap<String, &OutgoingMessage> =
        committed.iter().map(|m| (m.id().to_string(), m)).collect();
    assert_eq!(got.len(), 20, "each committed message published once");
    for (message_id, kind, tenant, body) in &got {
        let sent = expected.get(message_id).expect("a committed message's id");
        assert_eq!(kind, "ParcelCreatedEvent");
        assert_eq!(tenant, "acme");
        assert_eq!(body.as_slice(), sent.body());
    }
    let distinct: BTreeSet<&String> = got.iter().map(|(id, ..)| id).collect();
    assert_eq!(distinct.len(), 20);
    assert!(!distinct.contains(&rolled_back.id().to_string()));
    for message in &committed {
        let record = store
            .lookup_outgoing(&message.id())
            .await
            .expect("lookup")
            .expect("committed row");
        assert!(record.published_at.is_some());
        assert_eq!(record.attempts, 1);
    }
    assert!(
        store
            .lookup_outgoing(&rolled_back.id())
            .await
            .expect("lookup")
            .is_none()
    );
    assert_eq!(
        (tally.published(), tally.marked(), tally.failed()),
        (20, 20, 0)
    );
    assert!(tally.batches() >= 3, "batches of at most 7");

    broker.remove().await;
    drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_share_the_messages_without_taking_one_twice() {
    let id = test_id();
    let (broker, store) = (Broker::declare(&id).await, sqlx_store(&id).await);
    let committed: Vec<OutgoingMessage> =
        (0..200).map(|n| broker.message(&broker.good, n)).collect();

    // Both connected and polling before the first commit: a relay that is
    // still connecting while the other (pipelined) drains the outbox would
    // take nothing, and the test would prove nothing about sharing.
    let relays = [
        Relay::new(store.clone(), config(&id, 5))
            .expect("valid config")
            .spawn(),
        Relay::new(store.clone(), config(&id, 5))
            .expect("valid config")
            .spawn(),
    ];
    for relay in &relays {
        let connected = relay.broker_connected();
        wait_until("both relays hold a channel", async || *connected.borrow()).await;
    }
    enqueue_committed(&store, &committed).await;
    wait_until("every message is marked published", async || {
        store.pending_count().await.expect("count") == 0
    })
    .await;
    let mut marked = 0;
    for relay in relays {
        assert_eq!(relay.tally.failed(), 0);
        assert!(relay.tally.batches() > 0, "both relays took batches");
        assert_eq!(relay.tally.published(), relay.tally.marked());
        marked += relay.tally.marked();
        stop(relay).await;
    }
    assert_eq!(marked, 200, "each message marked exactly once");

    // No failures, so a message taken by both relays at once would have
    // been published twice, and taken twice.
    let got = broker.drain().await;
    let distinct: BTreeSet<&String> = got.iter().map(|(id, ..)| id).collect();
    assert_eq!((got.len(), distinct.len()), (200, 200));
    for message in &committed {
        assert!(distinct.contains(&message.id().to_string()));
        let record = store
            .lookup_outgoing(&message.id())
            .await
            .expect("lookup")
            .expect("row");
        assert_eq!(record.attempts, 1, "taken once");
    }

    broker.remove().await;
    drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nacked_messages_stay_pending_while_the_others_are_marked() {
    let id = test_id();
    let broker = Broker::declare(&id).await;
    let store = MemoryStore::new();
    let good: Vec<OutgoingMessage> = (0..6).map(|n| broker.message(&broker.good, n)).collect();
    let refused: Vec<OutgoingMessage> = (0..4).map(|n| broker.message(&broker.full, n)).collect();
    let mut all = good.clone();
    all.extend(refused.iter().cloned());
    enqueue_committed(&store, &all).await;

    let relay = Relay::new(store.clone(), config(&id, 10))
        .expect("valid config")
        .spawn();
    let tally = std::sync::Arc::clone(&relay.tally);
    wait_until(
        "the good ones are published and the refused ones failed",
        async || tally.published() == 6 && tally.failed() >= 4,
    )
    .await;
    stop(relay).await;

    assert_eq!(store.pending_count().await.expect("count"), 4);
    for message in &refused {
        let record = store
            .lookup_outgoing(&message.id())
            .await
            .expect("lookup")
            .expect("row");
        assert!(
            record.published_at.is_none(),
            "a nacked message stays pending"
        );
    }
    let got: BTreeSet<String> = broker.drain().await.into_iter().map(|m| m.0).collect();
    let good_ids: BTreeSet<String> = good.iter().map(|m| m.id().to_string()).collect();
    assert_eq!(got, good_ids);
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_exchange_fails_until_it_exists_then_the_same_ids_go_out() {
    let id = test_id();
    let broker = Broker::declare(&id).await;
    let store = MemoryStore::new();
    let missing = format!("test-relay-{id}.missing");
    let messages: Vec<OutgoingMessage> = (0..3)
        .map(|n| {
            OutgoingMessage::new(MessageId::new_v7(), missing.as_str(), "k", "T", vec![n])
                .expect("valid message")
        })
        .collect();
    enqueue_committed(&store, &messages).await;

    let relay = Relay::new(
        store.clone(),
        RelayConfig {
            lease: Duration::from_secs(2),
            confirm_timeout: Duration::from_secs(1),
            ..config(&id, 10)
        },
    )
    .expect("valid config")
    .spawn();
    let tally = std::sync::Arc::clone(&relay.tally);
    wait_until("the publishes to a missing exchange fail", async || {
        tally.failed() >= 3
    })
    .await;
    assert_eq!(store.pending_count().await.expect("count"), 3);
    assert_eq!(tally.published(), 0);

    // The exchange appears (bound to the good queue): once the leases run
    // out, the relay publishes the same messages, under the same ids.
    broker
        .channel
        .exchange_declare(
            missing.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            no_args(),
        )
        .await
        .expect("exchange");
    broker
        .channel
        .queue_bind(
            broker.good.as_str().into(),
            missing.as_str().into(),
            "k".into(),
            QueueBindOptions::default(),
            no_args(),
        )
        .await
        .expect("bind");
    wait_until("the messages are published after all", async || {
        store.pending_count().await.expect("count") == 0
    })
    .await;
    stop(relay).await;
    let got: BTreeSet<String> = broker.drain().await.into_iter().map(|m| m.0).collect();
    let ids: BTreeSet<String> = messages.iter().map(|m| m.id().to_string()).collect();
    assert_eq!(got, ids);
    for message in &messages {
        let record = store
            .lookup_outgoing(&message.id())
            .await
            .expect("lookup")
            .expect("row");
        assert!(record.attempts >= 2, "published on a later take");
    }

    broker
        .channel
        .exchange_delete(missing.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .expect("delete exchange");
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_command_publishes_until_sigterm() {
    let id = test_id();
    let (broker, store) = (Broker::declare(&id).await, sqlx_store(&id).await);
    let committed: Vec<OutgoingMessage> = (0..5).map(|n| broker.message(&broker.good, n)).collect();
    enqueue_committed(&store, &committed).await;

    let database_url = database_url();
    let metrics_addr = {
        let free = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        free.local_addr().expect("its address").to_string()
    };
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
        .args(["--store", "sqlx", "--schema", store.schema()])
        .args(["--database-url", &database_url, "--amqp-url", AMQP_URL])
        .args(["relay", "--metrics-addr", &metrics_addr])
        .args(["--poll-interval-ms", "20"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("parcel-inbox starts");
    wait_until(
        "the relay command marks every message published",
        async || store.pending_count().await.expect("count") == 0,
    )
    .await;
    let ready = scrape(&metrics_addr, "/ready").await;
    assert!(
        ready.starts_with("HTTP/1.1 200") && ready.ends_with("ready\n"),
        "{ready}"
    );
    let metrics = scrape(&metrics_addr, "/metrics").await;
    for line in [
        "outbox_published_total 5",
        "outbox_publish_duration_seconds_count 5",
        "outbox_pending_messages ",
        "outbox_dead_messages 0",
    ] {
        assert!(metrics.contains(line), "{line} missing:\n{metrics}");
    }
    let pid = child.id().expect("running").to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let output = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
        .await
        .expect("stops after SIGTERM")
        .expect("output");
    assert!(output.status.success(), "{:?}", output.status);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("relay stopped: 5 published, 0 failed"),
        "{stdout}"
    );
    let got: BTreeSet<String> = broker.drain().await.into_iter().map(|m| m.0).collect();
    let ids: BTreeSet<String> = committed.iter().map(|m| m.id().to_string()).collect();
    assert_eq!(got, ids);

    broker.remove().await;
    drop_schema(&store).await;
}

/// The relay's background purge deletes what it published once the
/// retention is past, batch by batch, and never a pending row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_purges_published_rows_after_their_retention() {
    let id = test_id();
    let broker = Broker::declare(&id).await;
    let store = MemoryStore::new();
    let published: Vec<OutgoingMessage> = (0..5).map(|n| broker.message(&broker.good, n)).collect();
    enqueue_committed(&store, &published).await;
    let relay = Relay::new(
        store.clone(),
        RelayConfig {
            purge: Some(inbox_runtime::CleanupConfig {
                retention: Duration::from_millis(200),
                interval: Duration::from_millis(50),
                batch_size: std::num::NonZeroU32::new(2).expect("non-zero"),
                ..inbox_runtime::CleanupConfig::default()
            }),
            ..config(&id, 10)
        },
    )
    .expect("valid config")
    .spawn();
    wait_until("every published row is purged", async || {
        for message in &published {
            if store
                .lookup_outgoing(&message.id())
                .await
                .expect("lookup")
                .is_some()
            {
                return false;
            }
        }
        true
    })
    .await;
    stop(relay).await;
    assert_eq!(broker.drain().await.len(), 5, "published before purged");
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_starts_a_round_before_the_poll_interval() {
    let id = test_id();
    let broker = Broker::declare(&id).await;
    let store = MemoryStore::new();
    let (wake, wakeups) = futures::channel::mpsc::unbounded::<()>();
    let relay = Relay::new(
        store.clone(),
        RelayConfig {
            poll_interval: Duration::from_secs(600),
            ..config(&id, 10)
        },
    )
    .expect("valid config")
    .wake_on(wakeups)
    .spawn();
    let tally = std::sync::Arc::clone(&relay.tally);
    // Let it find nothing and settle into its (long) poll wait.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let messages: Vec<OutgoingMessage> = (0..3).map(|n| broker.message(&broker.good, n)).collect();
    enqueue_committed(&store, &messages).await;
    for _ in 0..3 {
        wake.unbounded_send(()).expect("relay listening");
    }
    let woke = Instant::now();
    wait_until("the woken relay publishes", async || tally.published() == 3).await;
    assert!(
        woke.elapsed() < Duration::from_secs(10),
        "{:?}",
        woke.elapsed()
    );
    assert_eq!(store.pending_count().await.expect("count"), 0);

    // A wake-up source that ends leaves polling in charge, not a dead relay.
    drop(wake);
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop(relay).await;
    assert_eq!(broker.drain().await.len(), 3);
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_notifies_a_listening_relay_on_the_sqlx_store() {
    let id = test_id();
    let (broker, store) = (Broker::declare(&id).await, sqlx_store(&id).await);
    let wakeups = inbox_runtime::wakeups::sqlx_wakeups(&store)
        .await
        .expect("LISTEN on the outbox channel");
    let relay = Relay::new(
        store.clone(),
        RelayConfig {
            poll_interval: Duration::from_secs(600),
            ..config(&id, 10)
        },
    )
    .expect("valid config")
    .wake_on(wakeups)
    .spawn();
    let tally = std::sync::Arc::clone(&relay.tally);
    tokio::time::sleep(Duration::from_millis(300)).await;

    // A rolled-back enqueue notifies nobody; the committed ones do, once
    // their transaction commits.
    let rolled_back = broker.message(&broker.good, 99);
    let mut tx = store.begin().await.expect("begin");
    let _ = tx.enqueue(&rolled_back).await.expect("enqueue");
    tx.rollback().await.expect("rollback");
    let messages: Vec<OutgoingMessage> = (0..3).map(|n| broker.message(&broker.good, n)).collect();
    enqueue_committed(&store, &messages).await;
    let committed = Instant::now();
    wait_until("the notified relay publishes", async || {
        tally.published() == 3
    })
    .await;
    assert!(
        committed.elapsed() < Duration::from_secs(10),
        "{:?}",
        committed.elapsed()
    );
    stop(relay).await;
    let got: BTreeSet<String> = broker.drain().await.into_iter().map(|m| m.0).collect();
    let ids: BTreeSet<String> = messages.iter().map(|m| m.id().to_string()).collect();
    assert_eq!(got, ids);

    broker.remove().await;
    drop_schema(&store).await;
}

/// The relay command's `/metrics` text.
/// The whole answer (status line, headers, body) to `GET path`.
async fn scrape(addr: &str, path: &str) -> String {
    try_scrape(addr, path).await.expect("metrics endpoint")
}

/// As [`scrape`], or the error (the endpoint is not listening yet).
async fn try_scrape(addr: &str, path: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await?;
    Ok(text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_reconnects_after_the_broker_closes_its_connection() {
    let id = test_id();
    let broker = Broker::declare(&id).await;
    let store = MemoryStore::new();
    let name = format!("relay outage test {id}");
    let relay = Relay::new(
        store.clone(),
        RelayConfig {
            lease: Duration::from_secs(3),
            confirm_timeout: Duration::from_secs(1),
            ..RelayConfig {
                connection_name: name.clone(),
                ..config(&id, 10)
            }
        },
    )
    .expect("valid config")
    .spawn();
    let tally = std::sync::Arc::clone(&relay.tally);
    let first: Vec<OutgoingMessage> = (0..3).map(|n| broker.message(&broker.good, n)).collect();
    enqueue_committed(&store, &first).await;
    wait_until("the first messages are published", async || {
        tally.published() == 3
    })
    .await;

    // The broker drops the relay's connection (as on a broker restart).
    let listed = std::process::Command::new("rabbitmqctl")
        .args(["list_connections", "--quiet", "--no-table-headers"])
        .args(["pid", "client_properties"])
        .output()
        .expect("rabbitmqctl");
    let needle = format!("{{\"connection_name\",\"{name}\"}}");
    let connection = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .find_map(|line| {
            let (pid, properties) = line.split_once('\t')?;
            properties.contains(&needle).then(|| pid.trim().to_owned())
        })
        .expect("the relay's connection is listed");
    let closed = std::process::Command::new("rabbitmqctl")
        .args(["close_connection", &connection, "relay test: broker outage"])
        .output()
        .expect("rabbitmqctl");
    assert!(closed.status.success(), "{closed:?}");

    let second: Vec<OutgoingMessage> = (3..6).map(|n| broker.message(&broker.good, n)).collect();
    enqueue_committed(&store, &second).await;
    wait_until("the relay reconnects and publishes the rest", async || {
        store.pending_count().await.expect("count") == 0
    })
    .await;
    assert_eq!(tally.connections(), 2, "reconnected once");
    stop(relay).await;
    let got: BTreeSet<String> = broker.drain().await.into_iter().map(|m| m.0).collect();
    let ids: BTreeSet<String> = first
        .iter()
        .chain(&second)
        .map(|m| m.id().to_string())
        .collect();
    assert_eq!(got, ids);
    broker.remove().await;
}

#[cfg(feature = "diesel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_notifies_a_listening_relay_on_the_diesel_store() {
    let id = test_id();
    // Migrated through sqlx, used through diesel: one schema, one ledger.
    let (broker, migrated) = (Broker::declare(&id).await, sqlx_store(&id).await);
    let database_url = database_url();
    let store = inbox_backend_diesel::DieselStore::connect(&database_url, migrated.schema(), 4)
        .await
        .expect("diesel store");
    let wakeups = inbox_runtime::wakeups::diesel_wakeups(&database_url, store.schema())
        .await
        .expect("LISTEN on the outbox channel");
    let relay = Relay::new(
        store.clone(),
        RelayConfig {
            poll_interval: Duration::from_secs(600),
            ..config(&id, 10)
        },
    )
    .expect("valid config")
    .wake_on(wakeups)
    .spawn();
    let tally = std::sync::Arc::clone(&relay.tally);
    tokio::time::sleep(Duration::from_millis(300)).await;

    let messages: Vec<OutgoingMessage> = (0..3).map(|n| broker.message(&broker.good, n)).collect();
    enqueue_committed(&store, &messages).await;
    wait_until("the notified relay publishes", async || {
        tally.published() == 3
    })
    .await;
    stop(relay).await;
    let got: BTreeSet<String> = broker.drain().await.into_iter().map(|m| m.0).collect();
    let ids: BTreeSet<String> = messages.iter().map(|m| m.id().to_string()).collect();
    assert_eq!(got, ids);

    broker.remove().await;
    drop_schema(&migrated).await;
}

/// Waits until `GET /ready` answers with `status` ("200" or "503") and
/// returns the answer.
async fn ready_is(addr: &str, status: &str, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    loop {
        let answer = try_scrape(addr, "/ready")
            .await
            .unwrap_or_else(|error| error.to_string());
        if answer.starts_with(&format!("HTTP/1.1 {status}")) {
            return answer;
        }
        assert!(
            Instant::now() < deadline,
            "/ready not {status} within {limit:?}: {answer}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The relay command is not ready while its store is unreachable (a
/// PostgreSQL of the test's own, stopped), names the store in the 503, is
/// ready again once the server is back, and publishes what is committed
/// then: the outage ended nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_is_not_ready_while_its_store_is_down() {
    let id = test_id();
    let broker = Broker::declare(&id).await;
    let pg = private_servers::PrivatePostgres::start();
    let store = SqlxStore::connect(&pg.url(), &format!("relay_test_{id}"))
        .await
        .expect("private PostgreSQL");
    store.migrate().await.expect("migrate");
    let metrics_addr = {
        let free = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        free.local_addr().expect("its address").to_string()
    };
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
        .args(["--store", "sqlx", "--schema", store.schema()])
        .args(["--database-url", &pg.url(), "--amqp-url", AMQP_URL])
        .args(["relay", "--metrics-addr", &metrics_addr])
        .args(["--poll-interval-ms", "50"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("parcel-inbox starts");
    ready_is(&metrics_addr, "200", Duration::from_secs(30)).await;

    store.pool().close().await;
    pg.halt();
    let down = ready_is(&metrics_addr, "503", Duration::from_secs(30)).await;
    assert!(down.contains("store probe: "), "{down}");
    assert!(!down.contains("broker: "), "the broker is fine: {down}");

    pg.resume();
    ready_is(&metrics_addr, "200", Duration::from_secs(30)).await;
    let store = SqlxStore::connect(&pg.url(), store.schema())
        .await
        .expect("private PostgreSQL again");
    let messages: Vec<OutgoingMessage> = (0..3).map(|n| broker.message(&broker.good, n)).collect();
    enqueue_committed(&store, &messages).await;
    wait_until("the relay publishes after the outage", async || {
        store.pending_count().await.expect("count") == 0
    })
    .await;
    assert!(child.try_wait().expect("poll").is_none(), "still running");
    let _ = child.kill().await;
    let got: BTreeSet<String> = broker.drain().await.into_iter().map(|m| m.0).collect();
    let ids: BTreeSet<String> = messages.iter().map(|m| m.id().to_string()).collect();
    assert_eq!(got, ids);
    broker.remove().await;
}

/// The backends LISTENing on `schema`'s outbox channel: (pid,
/// application_name).
async fn listeners(admin: &SqlxStore) -> Vec<(i32, String)> {
    let channel = inbox_postgres::SchemaName::new(admin.schema())
        .expect("valid schema")
        .outbox_channel();
    sqlx::query_as(
        "SELECT pid, application_name FROM pg_stat_activity \
         WHERE query ILIKE 'LISTEN%' AND position($1 in query) > 0 \
         AND pid <> pg_backend_pid() ORDER BY pid",
    )
    .bind(channel)
    .fetch_all(admin.pool())
    .await
    .expect("pg_stat_activity")
}

/// A TCP proxy to the shared PostgreSQL that the test can cut: its
/// connections closed, new ones accepted and closed at once, until it is
/// restored. What a network partition does to one client and not the
/// others (no other session of the database notices).
struct Proxy {
    addr: std::net::SocketAddr,
    up: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start() -> Self {
        let upstream = "127.0.0.1:5432";
        assert!(
            database_url().contains(upstream),
            "the proxy forwards to {upstream}"
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free port");
        let addr = listener.local_addr().expect("its address");
        let (up, up_rx) = tokio::sync::watch::channel(true);
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                if !*up_rx.borrow() {
                    continue;
                }
                let mut cut = up_rx.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.wait_for(|up| !*up) => {}
                    }
                });
            }
        });
        Self { addr, up, task }
    }

    /// The shared database's URL through the proxy.
    fn url(&self) -> String {
        database_url().replace("127.0.0.1:5432", &self.addr.to_string())
    }

    fn cut(&self) {
        self.up.send_replace(false);
    }

    fn restore(&self) {
        self.up.send_replace(true);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A relay's LISTEN connection killed by the database
/// (`pg_terminate_backend`, as on a restart or a failover) comes back by
/// itself, and a commit after that still wakes a relay whose poll interval
/// is ten minutes: no fallback to polling for the rest of its life. Then
/// the listener's network is cut (`proxy`, which its wake-ups go through)
/// and a commit is made while it cannot listen: nothing notifies it, yet
/// once the network is back the listener wakes the relay once, which
/// publishes that commit too, long before the poll.
async fn a_killed_listener_reconnects_and_wakes_the_relay<S>(
    id: &str,
    broker: &Broker,
    admin: &SqlxStore,
    store: S,
    wakeups: futures::stream::BoxStream<'static, ()>,
    proxy: &Proxy,
) -> Vec<(i32, String)>
where
    S: OutboxStore + Clone + 'static,
{
    let relay = Relay::new(
        store.clone(),
        RelayConfig {
            poll_interval: Duration::from_secs(600),
            ..config(id, 10)
        },
    )
    .expect("valid config")
    .wake_on(wakeups)
    .spawn();
    let tally = std::sync::Arc::clone(&relay.tally);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = listeners(admin).await;
    assert_eq!(before.len(), 1, "one listener: {before:?}");
    let (killed, _): (bool, i32) = sqlx::query_as("SELECT pg_terminate_backend($1), 0")
        .bind(before[0].0)
        .fetch_one(admin.pool())
        .await
        .expect("terminate");
    assert!(killed);
    wait_until("the listener reconnects", async || {
        let now = listeners(admin).await;
        now.len() == 1 && now[0].0 != before[0].0
    })
    .await;

    let messages: Vec<OutgoingMessage> = (0..3).map(|n| broker.message(&broker.good, n)).collect();
    enqueue_committed(&store, &messages).await;
    let committed = Instant::now();
    wait_until("the notified relay publishes", async || {
        tally.published() == 3
    })
    .await;
    assert!(
        committed.elapsed() < Duration::from_secs(10),
        "woken, not polled: {:?}",
        committed.elapsed()
    );

    proxy.cut();
    wait_until("the listener is gone", async || {
        listeners(admin).await.is_empty()
    })
    .await;
    // Past the moment an error of the old listener would have woken the
    // relay (it slept 1 s, woke it once, then ended): only the wake-up
    // after listening again can publish what commits now.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let unnoticed: Vec<OutgoingMessage> = (3..6).map(|n| broker.message(&broker.good, n)).collect();
    enqueue_committed(&store, &unnoticed).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(tally.published(), 3, "nothing woke the relay yet");
    proxy.restore();
    wait_until(
        "the listener's wake-up publishes the unnoticed commit",
        async || tally.published() == 6,
    )
    .await;
    assert_eq!(listeners(admin).await.len(), 1, "listening again");

    stop(relay).await;
    let got: BTreeSet<String> = broker.drain().await.into_iter().map(|m| m.0).collect();
    let ids: BTreeSet<String> = messages
        .iter()
        .chain(&unnoticed)
        .map(|m| m.id().to_string())
        .collect();
    assert_eq!(got, ids);
    before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_sqlx_listener_reconnects_and_wakes_the_relay() {
    let id = test_id();
    let (broker, store) = (Broker::declare(&id).await, sqlx_store(&id).await);
    let proxy = Proxy::start().await;
    let listening = SqlxStore::connect(&proxy.url(), store.schema())
        .await
        .expect("the store through the proxy");
    let wakeups = inbox_runtime::wakeups::sqlx_wakeups(&listening)
        .await
        .expect("LISTEN on the outbox channel");
    a_killed_listener_reconnects_and_wakes_the_relay(
        &id,
        &broker,
        &store,
        store.clone(),
        wakeups,
        &proxy,
    )
    .await;
    broker.remove().await;
    drop_schema(&store).await;
}

#[cfg(feature = "diesel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_diesel_listener_reconnects_and_wakes_the_relay() {
    let id = test_id();
    let (broker, migrated) = (Broker::declare(&id).await, sqlx_store(&id).await);
    let database_url = database_url();
    let store = inbox_backend_diesel::DieselStore::connect(&database_url, migrated.schema(), 4)
        .await
        .expect("diesel store");
    let proxy = Proxy::start().await;
    let wakeups = inbox_runtime::wakeups::diesel_wakeups(&proxy.url(), store.schema())
        .await
        .expect("LISTEN on the outbox channel");
    let killed = a_killed_listener_reconnects_and_wakes_the_relay(
        &id, &broker, &migrated, store, wakeups, &proxy,
    )
    .await;
    assert_eq!(
        killed[0].1,
        inbox_backend_diesel::LISTENER_APPLICATION_NAME,
        "found by its application_name"
    );
    broker.remove().await;
    drop_schema(&migrated).await;
}

/// A message the broker always refuses (a nack from a queue that rejects
/// every publish; returned unroutable, with `mandatory`) backs off on its
/// own and ends dead after `max_attempts` refusals, kept and listed, while
/// the others flow; `outbox-dead` lists it and `outbox-requeue` makes it
/// pending again with a fresh count. With `mandatory` on and four batches
/// in flight, the refused messages spread over them: a batch must never
/// take another batch's return for its own (an unroutable message marked
/// published is a lost event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_broker_always_refuses_ends_dead_while_the_others_flow() {
    let id = test_id();
    let (broker, store) = (Broker::declare(&id).await, sqlx_store(&id).await);
    let (mut good, mut nacked, mut unroutable, mut all) = (vec![], vec![], vec![], vec![]);
    // Batches of 5, one refused message in every third or fourth slot.
    for n in 0..60 {
        let message = match n % 7 {
            2 => broker.message(&broker.full, n),
            5 => broker.message("bound-to-nothing", n),
            _ => broker.message(&broker.good, n),
        };
        match n % 7 {
            2 => nacked.push(message.clone()),
            5 => unroutable.push(message.clone()),
            _ => good.push(message.clone()),
        }
        all.push(message);
    }
    let refused = nacked.len() + unroutable.len();
    enqueue_committed(&store, &all).await;

    let relay = Relay::new(
        store.clone(),
        RelayConfig {
            retry: inbox_api::PublishRetry {
                base_delay: Duration::from_millis(50),
                max_delay: Duration::from_millis(200),
                max_attempts: std::num::NonZeroU32::new(3).expect("non-zero"),
            },
            pipeline_depth: std::num::NonZeroU32::new(4).expect("non-zero"),
            mandatory: true,
            ..config(&id, 5)
        },
    )
    .expect("valid config")
    .spawn();
    let tally = std::sync::Arc::clone(&relay.tally);
    wait_until("every refused message is dead", async || {
        tally.dead() == refused as u64
    })
    .await;
    wait_until("the good ones are published", async || {
        store.pending_count().await.expect("count") == 0
    })
    .await;
    stop(relay).await;

    assert_eq!(tally.published(), good.len() as u64);
    assert_eq!(
        tally.refused(),
        3 * refused as u64,
        "three refusals each, no more"
    );
    for (messages, answer) in [(&nacked, "nacked"), (&unroutable, "returned unroutable")] {
        for message in messages {
            let record = store
                .lookup_outgoing(&message.id())
                .await
                .expect("lookup")
                .expect("kept");
            assert!(record.dead_at.is_some() && record.published_at.is_none());
            assert_eq!(record.failures, 3);
            assert!(
                record
                    .last_error
                    .as_deref()
                    .is_some_and(|e| e.contains(answer)),
                "{record:?}"
            );
        }
    }
    let got: Vec<String> = broker.drain().await.into_iter().map(|m| m.0).collect();
    let good_ids: BTreeSet<String> = good.iter().map(|m| m.id().to_string()).collect();
    assert_eq!(got.len(), good.len(), "each good message once");
    assert_eq!(got.into_iter().collect::<BTreeSet<_>>(), good_ids);
    let (nacked, unroutable) = (&nacked[0], &unroutable[0]);

    let database_url = database_url();
    let command = |args: &[&str]| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
            .args(["--store", "sqlx", "--schema", store.schema()])
            .args(["--database-url", &database_url])
            .args(args)
            .env("RUST_LOG", "warn")
            .output()
            .expect("parcel-inbox runs");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(output.status.success(), "{args:?}: {stdout}");
        stdout
    };
    let listed = command(&["outbox-dead"]);
    for message in [nacked, unroutable] {
        assert!(listed.contains(&message.id().to_string()), "{listed}");
    }
    assert!(
        listed.contains(&format!("{refused} dead outgoing message(s)")),
        "{listed}"
    );
    assert_eq!(store.dead_count().await.expect("count"), refused as u64);
    let requeued = command(&[
        "outbox-requeue",
        "--message-id",
        &unroutable.id().to_string(),
    ]);
    assert!(requeued.contains("requeued 1 dead"), "{requeued}");
    let record = store
        .lookup_outgoing(&unroutable.id())
        .await
        .expect("lookup")
        .expect("kept");
    assert_eq!((record.failures, record.dead_at), (0, None));
    assert_eq!(store.pending_count().await.expect("count"), 1);
    assert_eq!(store.dead_count().await.expect("count"), refused as u64 - 1);
    assert!(
        command(&["outbox-requeue", "--all"]).contains(&format!("requeued {} dead", refused - 1))
    );
    assert_eq!(store.dead_count().await.expect("count"), 0);

    broker.remove().await;
    drop_schema(&store).await;
}

/// An outage charges no message: on a RabbitMQ node of the test's own,
/// a memory alarm blocks every publish (no confirm comes), then the
/// broker closes the relay's connection while confirms are outstanding.
/// The relay sees failures, yet no row counts a refusal, none is dead,
/// and all go out once the alarm clears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_and_a_lost_connection_charge_no_message() {
    let id = test_id();
    let rabbit = private_servers::PrivateRabbit::start().await;
    let connection = connect(&rabbit.url(), "relay outage test setup")
        .await
        .expect("private RabbitMQ");
    let channel = connection.create_channel().await.expect("channel");
    let queue = format!("test-relay-{id}.outage");
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::default(),
            no_args(),
        )
        .await
        .expect("queue");
    let store = MemoryStore::new();
    let name = format!("relay outage test {id}");
    let relay = Relay::new(
        store.clone(),
        RelayConfig {
            lease: Duration::from_secs(2),
            confirm_timeout: Duration::from_secs(1),
            // One refusal would make it dead: any charge shows.
            retry: inbox_api::PublishRetry {
                max_attempts: std::num::NonZeroU32::MIN,
                ..inbox_api::PublishRetry::default()
            },
            ..RelayConfig {
                broker_url: rabbit.url(),
                connection_name: name.clone(),
                ..config(&id, 10)
            }
        },
    )
    .expect("valid config")
    .spawn();
    let tally = std::sync::Arc::clone(&relay.tally);
    let ctl = |args: &[&str]| {
        let mut all = vec!["-n", rabbit.node()];
        all.extend_from_slice(args);
        private_servers::run("rabbitmqctl", &all)
    };
    ctl(&["set_vm_memory_high_watermark", "0"]);
    let messages: Vec<OutgoingMessage> = (0..4_u8)
        .map(|n| {
            OutgoingMessage::new(MessageId::new_v7(), "", queue.as_str(), "T", vec![n])
                .expect("valid message")
        })
        .collect();
    enqueue_committed(&store, &messages).await;
    wait_until("the blocked broker confirms nothing", async || {
        tally.failed() >= 4
    })
    .await;
    // The broker drops the connection while the relay waits for confirms.
    let listed = ctl(&[
        "list_connections",
        "--quiet",
        "--no-table-headers",
        "pid",
        "client_properties",
    ]);
    let needle = format!("{{\"connection_name\",\"{name}\"}}");
    for pid in String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter_map(|line| {
            let (pid, properties) = line.split_once('\t')?;
            properties.contains(&needle).then(|| pid.trim().to_owned())
        })
    {
        let _ = ctl(&["close_connection", &pid, "relay test: connection lost"]);
    }
    wait_until("the relay reconnects", async || tally.connections() >= 2).await;
    ctl(&["set_vm_memory_high_watermark", "0.4"]);
    wait_until("every message goes out after the outage", async || {
        store.pending_count().await.expect("count") == 0
    })
    .await;
    stop(relay).await;

    assert_eq!(tally.refused(), 0, "nothing charged");
    assert_eq!(tally.dead(), 0);
    for message in &messages {
        let record = store
            .lookup_outgoing(&message.id())
            .await
            .expect("lookup")
            .expect("row");
        assert_eq!(
            (record.failures, record.dead_at.is_none()),
            (0, true),
            "{record:?}"
        );
        assert!(record.published_at.is_some());
    }
    close_bounded_quietly(connection).await;
}

async fn close_bounded_quietly(connection: Connection) {
    inbox_runtime::amqp::close_bounded(&connection, "bye").await;
}

/// `api`'s in-process relay declares the exchange it publishes to (as the
/// consumers' topology declares it), so a parcel's event goes out although
/// no `consume` process ever ran; and `api` refuses `--metrics-addr`, a
/// flag of `relay` that it would ignore (its metrics are on `--listen`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_relay_declares_its_exchange_before_any_consumer_does() {
    let prefix = format!("relay-api-{}.", test_id());
    let exchange = consumer_app::parcel::topology::Topology::new(&prefix).exchange();
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
        .args(["--store", "memory", "api", "--metrics-addr", "127.0.0.1:0"])
        .output()
        .expect("parcel-inbox runs");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("--metrics-addr"), "{stderr}");

    let listen = {
        let free = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        free.local_addr().expect("its address")
    };
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
        .args([
            "--store",
            "memory",
            "--amqp-url",
            AMQP_URL,
            "--prefix",
            &prefix,
        ])
        .args(["api", "--listen", &listen.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("parcel-inbox starts");
    // Ready once its relay holds a channel: the exchange is declared then.
    ready_is(&listen.to_string(), "200", Duration::from_secs(30)).await;
    let connection = connect(AMQP_URL, "relay test api").await.expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            },
            no_args(),
        )
        .await
        .expect("the relay declared the exchange");
    let queue = channel
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..QueueDeclareOptions::default()
            },
            no_args(),
        )
        .await
        .expect("a queue of the test's");
    channel
        .queue_bind(
            queue.name().as_str().into(),
            exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            no_args(),
        )
        .await
        .expect("bind");
    let answer = consumer_app::tools::http::post_json(
        listen,
        "/parcels",
        &serde_json::json!({"parcel_id": "P-1", "tracking_number": "TN1", "destination": "Lyon"}),
    )
    .await
    .expect("POST /parcels");
    assert_eq!(answer.status, 201, "{answer:?}");
    let message_id = answer.json()["message_id"]
        .as_str()
        .expect("message_id")
        .to_owned();
    let deadline = Instant::now() + Duration::from_secs(30);
    let got = loop {
        if let Some(message) = channel
            .basic_get(
                queue.name().as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .expect("basic.get")
        {
            break message
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(ToString::to_string);
        }
        assert!(
            Instant::now() < deadline,
            "the parcel's event never reached the queue"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(got, Some(message_id));
    let _ = child.kill().await;
    channel
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .expect("delete the exchange");
    close_bounded_quietly(connection).await;
}

/// The memory outbox, except that a mark waits until the relay has taken
/// `takes_before_mark` non-empty batches: a relay that takes its next batch
/// only after marking the previous one never gets past the first mark.
#[derive(Clone)]
struct MarkAfterTakes {
    inner: MemoryStore,
    takes: std::sync::Arc<tokio::sync::watch::Sender<u32>>,
    takes_before_mark: u32,
}

#[async_trait::async_trait]
impl InboxStore for MarkAfterTakes {
    type Transaction = <MemoryStore as InboxStore>::Transaction;

    async fn begin(&self) -> Result<Self::Transaction, inbox_api::InboxError> {
        self.inner.begin().await
    }

    async fn lookup(
        &self,
        key: &inbox_api::InboxKey,
    ) -> Result<Option<inbox_api::InboxRecord>, inbox_api::InboxError> {
        self.inner.lookup(key).await
    }

    async fn purge_processed_batch(
        &self,
        cutoff: chrono::DateTime<chrono::Utc>,
        limit: std::num::NonZeroU32,
    ) -> Result<u64, inbox_api::InboxError> {
        self.inner.purge_processed_batch(cutoff, limit).await
    }

    async fn purge_processed_batch_from(
        &self,
        cutoff: chrono::DateTime<chrono::Utc>,
        from: Option<chrono::DateTime<chrono::Utc>>,
        limit: std::num::NonZeroU32,
    ) -> Result<inbox_api::PurgedBatch, inbox_api::InboxError> {
        self.inner
            .purge_processed_batch_from(cutoff, from, limit)
            .await
    }
}

#[async_trait::async_trait]
impl OutboxStore for MarkAfterTakes {
    async fn take_pending(
        &self,
        limit: std::num::NonZeroU32,
        lease: Duration,
    ) -> Result<inbox_api::OutboxLease, inbox_api::InboxError> {
        let taken = self.inner.take_pending(limit, lease).await?;
        if !taken.is_empty() {
            self.takes.send_modify(|n| *n += 1);
        }
        Ok(taken)
    }

    async fn mark_published(&self, ids: &[MessageId]) -> Result<u64, inbox_api::InboxError> {
        let mut takes = self.takes.subscribe();
        let _ = takes.wait_for(|n| *n >= self.takes_before_mark).await;
        self.inner.mark_published(ids).await
    }

    async fn release(&self, lease: &inbox_api::OutboxLease) -> Result<u64, inbox_api::InboxError> {
        self.inner.release(lease).await
    }

    async fn lookup_outgoing(
        &self,
        id: &MessageId,
    ) -> Result<Option<inbox_api::OutboxRecord>, inbox_api::InboxError> {
        self.inner.lookup_outgoing(id).await
    }

    async fn pending_count(&self) -> Result<u64, inbox_api::InboxError> {
        self.inner.pending_count().await
    }

    async fn dead_count(&self) -> Result<u64, inbox_api::InboxError> {
        self.inner.dead_count().await
    }

    async fn purge_published_batch(
        &self,
        cutoff: chrono::DateTime<chrono::Utc>,
        limit: std::num::NonZeroU32,
    ) -> Result<u64, inbox_api::InboxError> {
        self.inner.purge_published_batch(cutoff, limit).await
    }

    async fn record_refusals(
        &self,
        lease: &inbox_api::LeaseId,
        refusals: &[(MessageId, String)],
        retry: &inbox_api::PublishRetry,
    ) -> Result<inbox_api::Refused, inbox_api::InboxError> {
        self.inner.record_refusals(lease, refusals, retry).await
    }

    async fn dead_outgoing(
        &self,
        limit: std::num::NonZeroU32,
    ) -> Result<Vec<inbox_api::OutboxRecord>, inbox_api::InboxError> {
        self.inner.dead_outgoing(limit).await
    }

    async fn requeue_dead(&self, ids: &[MessageId]) -> Result<u64, inbox_api::InboxError> {
        self.inner.requeue_dead(ids).await
    }
}

/// With a pipeline depth of 3, the relay takes and publishes the next
/// batches while the first one's mark is still pending (here: held until
/// three batches are taken, which a sequential relay never reaches), and
/// still publishes every message once, marked after its own confirm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_takes_the_next_batches_while_a_mark_is_pending() {
    let id = test_id();
    let broker = Broker::declare(&id).await;
    let store = MarkAfterTakes {
        inner: MemoryStore::new(),
        takes: std::sync::Arc::new(tokio::sync::watch::Sender::new(0)),
        takes_before_mark: 3,
    };
    let messages: Vec<OutgoingMessage> = (0..15).map(|n| broker.message(&broker.good, n)).collect();
    enqueue_committed(&store, &messages).await;
    let relay = Relay::new(
        store.clone(),
        RelayConfig {
            pipeline_depth: std::num::NonZeroU32::new(3).expect("non-zero"),
            ..config(&id, 5)
        },
    )
    .expect("valid config")
    .spawn();
    wait_until("every message is marked published", async || {
        store.pending_count().await.expect("count") == 0
    })
    .await;
    let tally = std::sync::Arc::clone(&relay.tally);
    stop(relay).await;
    assert_eq!((tally.batches(), tally.marked()), (3, 15));
    for message in &messages {
        let record = store
            .lookup_outgoing(&message.id())
            .await
            .expect("lookup")
            .expect("kept");
        assert!(record.published_at.is_some());
        assert_eq!(record.attempts, 1, "taken once");
    }
    let got: BTreeSet<String> = broker.drain().await.into_iter().map(|m| m.0).collect();
    assert_eq!(got.len(), 15);
    broker.remove().await;
}

/// A channel that closes fails only the batch it carried: with four
/// batches in flight, each on a channel of its own, a publish to a missing
/// exchange closes its batch's channel (404); what of that batch the
/// broker had not confirmed stays pending, uncharged, while the batches on
/// the other channels are marked after their own confirms, and the relay opens a new channel on the same
/// connection. Once the exchange exists, the held batch goes out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_channel_fails_only_the_batch_it_carried() {
    let id = test_id();
    let broker = Broker::declare(&id).await;
    // Batch 1's mark waits for batch 2's take: the two are in flight at once.
    let store = MarkAfterTakes {
        inner: MemoryStore::new(),
        takes: std::sync::Arc::new(tokio::sync::watch::Sender::new(0)),
        takes_before_mark: 2,
    };
    let missing = format!("test-relay-{id}.missing");
    let messages: Vec<OutgoingMessage> = (0..20)
        .map(|n| match n {
            7 => OutgoingMessage::new(MessageId::new_v7(), missing.as_str(), "k", "T", vec![7])
                .expect("valid message"),
            n => broker.message(&broker.good, n),
        })
        .collect();
    enqueue_committed(&store, &messages).await;
    let relay = Relay::new(
        store.clone(),
        RelayConfig {
            pipeline_depth: std::num::NonZeroU32::new(4).expect("non-zero"),
            lease: Duration::from_secs(2),
            confirm_timeout: Duration::from_secs(1),
            ..config(&id, 5)
        },
    )
    .expect("valid config")
    .spawn();
    let tally = std::sync::Arc::clone(&relay.tally);
    let (held, flowed) = (&messages[5..10], [&messages[..5], &messages[10..]].concat());
    let published = async |message: &OutgoingMessage| {
        store
            .lookup_outgoing(&message.id())
            .await
            .expect("lookup")
            .expect("kept")
    };
    wait_until("the other three batches are marked", async || {
        for message in &flowed {
            if published(message).await.published_at.is_none() {
                return false;
            }
        }
        true
    })
    .await;
    for message in &flowed {
        assert_eq!(published(message).await.attempts, 1, "taken once");
    }
    // Of the broken batch, what the broker confirmed before the channel
    // closed is marked, after its own confirm; the rest stays pending,
    // charged nothing.
    assert!(tally.failed() >= 1, "the broken batch failed");
    assert!(published(&messages[7]).await.published_at.is_none());
    for message in held {
        let record = published(message).await;
        assert_eq!(record.failures, 0, "a closed channel charges nothing");
    }

    broker
        .channel
        .exchange_declare(
            missing.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            no_args(),
        )
        .await
        .expect("exchange");
    broker
        .channel
        .queue_bind(
            broker.good.as_str().into(),
            missing.as_str().into(),
            "k".into(),
            QueueBindOptions::default(),
            no_args(),
        )
        .await
        .expect("bind");
    wait_until("the held batch goes out", async || {
        store.pending_count().await.expect("count") == 0
    })
    .await;
    stop(relay).await;
    assert_eq!(tally.connections(), 1, "new channels, not connections");
    assert_eq!(tally.refused(), 0);
    let got: BTreeSet<String> = broker.drain().await.into_iter().map(|m| m.0).collect();
    let ids: BTreeSet<String> = messages.iter().map(|m| m.id().to_string()).collect();
    assert_eq!(got, ids);
    broker
        .channel
        .exchange_delete(missing.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .expect("delete exchange");
    broker.remove().await;
}
