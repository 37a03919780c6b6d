//! End to end through RabbitMQ: messages/s draining a pre-published queue.
//!
//! Each cell declares the app's topology under its own prefix, publishes
//! `events` parcel events (each routed to both consumers' queues, so two
//! deliveries per event), then starts the consumers and times the drain of
//! both queues:
//!
//! - bare: per queue `tasks` lapin consumers (one channel each, prefetch
//!   32) that ack every delivery one by one and touch no database;
//! - the app per message: `consumer_app::parcel::service::spawn` on the sqlx store,
//!   concurrency `tasks` per queue (one transaction per delivery);
//! - the app batched: the same with `--batch-size 100 --batch-wait 20`;
//! - the runtime alone ([`runtime_cell`]): `inbox_runtime::Service`
//!   per message on one queue, with a handler that does only the report's
//!   business write (no Parcel domain, whose consumers add two more
//!   transactions per message), to set against the database-only inbox (b)
//!   at the same concurrency: the runtime's own cost;
//! - the same work without the runtime ([`lapin_loop_cell`]): per task a
//!   lapin consumer that runs `Inbox::handle` around the same write and
//!   acks each delivery, what a user would write by hand: the cost of the
//!   broker and its client alone, which no runtime on lapin can go below.
//!
//! Rates are deliveries per second (both queues together; one queue for
//! the runtime alone).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use consumer_app::parcel::downstream::{Downstreams, StubCarrier, StubNotifier};
use consumer_app::parcel::events::{ROUTING_KEY, outgoing};
use consumer_app::parcel::role::Role;
use consumer_app::parcel::service::spawn;
use consumer_app::parcel::store::ParcelStore;
use consumer_app::parcel::topology::Topology;
use futures::StreamExt as _;
use inbox_api::{ConsumerName, Inbox, InboxError, InboxKey, MessageId};
use inbox_backend_sqlx::{SqlxStore, SqlxTransaction, classify};
use inbox_runtime::amqp::{Outgoing, Publisher, close_bounded, connect};
use inbox_runtime::{
    AppError, BatchConfig, Context, Handler, Service, ServiceConfig, ServiceHandle, WorkerConfig,
};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;

pub(crate) const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// What an end-to-end cell runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum E2e {
    Bare,
    PerMessage,
    Batched(usize),
    /// The runtime alone, on the report's own store: [`runtime_cell`].
    Runtime,
    /// The same work as the runtime alone in a hand-written lapin loop:
    /// [`lapin_loop_cell`].
    LapinLoop,
}

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn events(n: usize, tag: &str) -> Result<Vec<Outgoing>, BoxError> {
    (0..n)
        .map(|i| {
            let event = consumer_app::parcel::events::ParcelCreatedEvent {
                parcel_id: format!("{tag}-{i}"),
                tracking_number: format!("TN{i}"),
                destination: "Lyon".to_owned(),
            };
            Ok(outgoing(&MessageId::new_v7(), &event)?)
        })
        .collect()
}

/// The prefetch of the app's consumers per message: enough that the next
/// delivery is there when a worker's slot frees, at any concurrency.
pub(crate) fn per_message_prefetch(tasks: usize) -> u16 {
    u16::try_from((4 * tasks).max(32)).unwrap_or(u16::MAX)
}

/// Declares `topology` and publishes `messages` to its exchange under
/// `routing_key`, with confirms: the queue to drain. Returns the connection
/// and publisher, to delete the topology with after the drain.
async fn prepublish(
    amqp_url: &str,
    topology: &inbox_runtime::Topology,
    routing_key: &str,
    messages: &[Outgoing],
) -> Result<(lapin::Connection, Publisher), BoxError> {
    let connection = connect(amqp_url, "inbox bench publisher").await?;
    let publisher = Publisher::new(&connection, topology.exchange(), routing_key).await?;
    topology.declare(publisher.channel()).await?;
    publisher.publish_all(messages, 512, |_| {}).await?;
    Ok((connection, publisher))
}

/// Waits until `service`'s consumers named `consumers` have finished
/// `deliveries` deliveries between them, then stops it; the time from
/// `started` to the last one.
async fn drain(
    service: ServiceHandle,
    consumers: &[&str],
    deliveries: u64,
    started: Instant,
) -> Result<Duration, BoxError> {
    let tally = Arc::clone(&service.tally);
    while consumers
        .iter()
        .map(|name| tally.consumer(name).finished())
        .sum::<u64>()
        < deliveries
    {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = started.elapsed();
    service.shutdown();
    service.join().await?;
    Ok(elapsed)
}

/// One cell: deliveries/s for `mode` at `tasks`, draining `n` events.
pub(crate) async fn cell(
    mode: E2e,
    tasks: usize,
    n: usize,
    store: &SqlxStore,
    prefix: &str,
) -> Result<f64, BoxError> {
    if matches!(mode, E2e::Runtime | E2e::LapinLoop) {
        return Err(
            "the runtime-alone cells run on the report's store: call runtime_cell or lapin_loop_cell"
                .into(),
        );
    }
    let topology = Topology::new(prefix);
    let amqp = topology.runtime();
    let (connection, publisher) =
        prepublish(AMQP_URL, &amqp, ROUTING_KEY, &events(n, prefix)?).await?;
    let deliveries = 2 * n as u64;

    let started;
    match mode {
        E2e::Bare => {
            let done = Arc::new(AtomicU64::new(0));
            let consumer_conn = connect(AMQP_URL, "inbox bench bare consumer").await?;
            let mut channels = Vec::new();
            let mut workers = Vec::new();
            started = Instant::now();
            for role in Role::PARCEL_CREATED {
                for t in 0..tasks {
                    let channel = consumer_conn.create_channel().await?;
                    channel.basic_qos(32, BasicQosOptions::default()).await?;
                    let mut consumer = channel
                        .basic_consume(
                            topology.queue(role).as_str().into(),
                            format!("bare-{t}").as_str().into(),
                            BasicConsumeOptions::default(),
                            FieldTable::default(),
                        )
                        .await?;
                    let done = Arc::clone(&done);
                    channels.push(channel);
                    workers.push(tokio::spawn(async move {
                        while let Some(Ok(delivery)) = consumer.next().await {
                            if delivery.ack(BasicAckOptions::default()).await.is_err() {
                                break;
                            }
                            if done.fetch_add(1, Ordering::Relaxed) + 1 >= deliveries {
                                break;
                            }
                        }
                    }));
                }
            }
            while done.load(Ordering::Relaxed) < deliveries {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let elapsed = started.elapsed();
            for worker in workers {
                worker.abort();
            }
            close_bounded(&consumer_conn, "bye").await;
            let rate = deliveries as f64 / elapsed.as_secs_f64();
            finish(&publisher, &amqp).await;
            close_bounded(&connection, "bye").await;
            Ok(rate)
        }
        E2e::PerMessage | E2e::Batched(_) | E2e::Runtime | E2e::LapinLoop => {
            let prefetch = match mode {
                E2e::Batched(k) => u16::try_from(2 * k * tasks).unwrap_or(u16::MAX),
                _ => per_message_prefetch(tasks),
            };
            let batch = match mode {
                E2e::Batched(k) => BatchConfig::effective(k, Duration::from_millis(20), prefetch),
                _ => None,
            };
            let service = spawn(
                store.clone(),
                ServiceConfig {
                    broker_url: AMQP_URL.to_owned(),
                    worker: WorkerConfig {
                        prefetch,
                        concurrency: tasks,
                        batch,
                        ..WorkerConfig::default()
                    },
                    connection_name: format!("inbox bench {prefix}"),
                    cleanup: None,
                    gauge_interval: None,
                    availability: Default::default(),
                    connection: Default::default(),
                },
                &topology,
                Downstreams {
                    carrier: Arc::new(StubCarrier::default()),
                    notifier: Arc::new(StubNotifier::default()),
                },
            )?;
            started = Instant::now();
            let consumers = Role::ALL.map(|r| r.consumer_name());
            let elapsed = drain(service, &consumers, deliveries, started).await?;
            let rate = deliveries as f64 / elapsed.as_secs_f64();
            finish(&publisher, &amqp).await;
            close_bounded(&connection, "bye").await;
            Ok(rate)
        }
    }
}

/// The AMQP `type` of the runtime-alone cell's messages.
pub(crate) const BUSINESS_WRITE: &str = "bench.write";

/// The report's business write as a runtime [`Handler`]: the INSERT of (a)
/// and (b), nothing else, so the runtime-alone cell differs from (b) only by
/// the runtime around it. The message is the payload, a JSON string. The
/// NATS section (`support/nats.rs`) runs the same handler, so that its rows
/// differ from these by the broker alone.
pub(crate) struct BusinessWrite(pub(crate) ConsumerName);

impl Handler<SqlxTransaction> for BusinessWrite {
    type Message = String;
    type Intent = ();

    fn name(&self) -> &ConsumerName {
        &self.0
    }

    fn message_type(&self) -> &str {
        BUSINESS_WRITE
    }

    async fn handle(
        &self,
        cx: &mut Context<'_, SqlxTransaction>,
        payload: &String,
    ) -> Result<(), AppError> {
        inbox_backend_sqlx::sqlx::query(crate::BUSINESS)
            .bind(cx.message_id().as_uuid())
            .bind(payload)
            .execute(cx.conn())
            .await?;
        Ok(())
    }
}

/// The queue the runtime-alone cells drain: `n` business-write messages
/// pre-published to one queue of its own under `prefix`.
struct Writes {
    queue: String,
    topology: inbox_runtime::Topology,
    /// The publisher's connection, closed after the drain.
    connection: lapin::Connection,
    /// Deletes the topology after the drain.
    publisher: Publisher,
}

impl Writes {
    async fn publish(amqp_url: &str, n: usize, prefix: &str) -> Result<Self, BoxError> {
        let queue = format!("{prefix}writes");
        let topology =
            inbox_runtime::Topology::new(format!("{prefix}bench")).bind(&queue, BUSINESS_WRITE);
        let messages = (0..n)
            .map(|_| Outgoing::json(&MessageId::new_v7(), BUSINESS_WRITE, &crate::PAYLOAD))
            .collect::<Result<Vec<_>, _>>()?;
        let (connection, publisher) =
            prepublish(amqp_url, &topology, BUSINESS_WRITE, &messages).await?;
        Ok(Self {
            queue,
            topology,
            connection,
            publisher,
        })
    }

    /// Deletes the queue's topology and closes the publisher's connection.
    async fn finish(self) {
        finish(&self.publisher, &self.topology).await;
        close_bounded(&self.connection, "bye").await;
    }
}

/// The runtime alone: `n` messages pre-published to one queue, drained by
/// [`Service`] per message at concurrency `tasks` on `store` (whose schema
/// has the report's `bench_events`), with [`BusinessWrite`] as the handler,
/// through the broker at `amqp_url`. Returns deliveries/s and the drain's
/// time.
pub(crate) async fn runtime_cell(
    amqp_url: &str,
    tasks: usize,
    n: usize,
    store: &SqlxStore,
    prefix: &str,
) -> Result<(f64, Duration), BoxError> {
    let writes = Writes::publish(amqp_url, n, prefix).await?;
    let handler = BusinessWrite(ConsumerName::new("bench-runtime")?);
    let config = ServiceConfig {
        worker: WorkerConfig {
            prefetch: per_message_prefetch(tasks),
            concurrency: tasks,
            ..WorkerConfig::default()
        },
        cleanup: None,
        ..ServiceConfig::new(amqp_url, format!("inbox bench {prefix}"))
    };
    let service = Service::new(store.clone(), config, writes.topology.clone())
        .consume(writes.queue.clone(), handler)
        .spawn()?;
    let started = Instant::now();
    let elapsed = drain(service, &["bench-runtime"], n as u64, started).await?;
    writes.finish().await;
    Ok((n as f64 / elapsed.as_secs_f64(), elapsed))
}

/// The runtime-alone cell's work without the runtime: `n` messages
/// pre-published to one queue as for [`runtime_cell`], drained by `tasks`
/// lapin consumers (a channel each, prefetch 32), each delivery decoded
/// (its `message_id`, its JSON payload), handled by `Inbox::handle` around
/// the business write on `store`, and acked on its own. No retries, no
/// dead-letters, no coalesced acks: the loop a user would write by hand,
/// so its rate is what the broker and lapin leave of (b). Returns
/// deliveries/s.
pub(crate) async fn lapin_loop_cell(
    tasks: usize,
    n: usize,
    store: &SqlxStore,
    prefix: &str,
) -> Result<f64, BoxError> {
    let writes = Writes::publish(AMQP_URL, n, prefix).await?;
    let inbox = Arc::new(Inbox::new(store.clone()));
    let consumer_name = ConsumerName::new("bench-lapin-loop")?;
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let consumer_conn = connect(AMQP_URL, "inbox bench lapin loop").await?;
    let mut workers = Vec::new();
    let started = Instant::now();
    for t in 0..tasks {
        let channel = consumer_conn.create_channel().await?;
        channel.basic_qos(32, BasicQosOptions::default()).await?;
        let mut consumer = channel
            .basic_consume(
                writes.queue.as_str().into(),
                format!("lapin-loop-{t}").as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let (inbox, name) = (Arc::clone(&inbox), consumer_name.clone());
        let (done, failed) = (Arc::clone(&done), Arc::clone(&failed));
        workers.push(tokio::spawn(async move {
            let _channel = channel;
            while let Some(Ok(delivery)) = consumer.next().await {
                let id = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .and_then(|id| MessageId::parse(id.as_str()).ok());
                let payload = serde_json::from_slice::<String>(&delivery.data).ok();
                let (Some(id), Some(payload)) = (id, payload) else {
                    failed.fetch_add(1, Ordering::Relaxed);
                    break;
                };
                let key = InboxKey::new(id, name.clone());
                let handled = inbox
                    .handle(&key, async |tx| {
                        inbox_backend_sqlx::sqlx::query(crate::BUSINESS)
                            .bind(id.as_uuid())
                            .bind(&payload)
                            .execute(tx.conn())
                            .await
                            .map_err(classify)?;
                        Ok::<_, InboxError>(())
                    })
                    .await;
                if handled.is_err() || delivery.ack(BasicAckOptions::default()).await.is_err() {
                    failed.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let n = n as u64;
    while done.load(Ordering::Relaxed) < n && failed.load(Ordering::Relaxed) == 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = started.elapsed();
    for worker in workers {
        worker.abort();
    }
    close_bounded(&consumer_conn, "bye").await;
    writes.finish().await;
    if failed.load(Ordering::Relaxed) > 0 {
        return Err("the hand-written lapin loop failed a delivery".into());
    }
    Ok(n as f64 / elapsed.as_secs_f64())
}

async fn finish(publisher: &Publisher, topology: &inbox_runtime::Topology) {
    if let Err(error) = topology.delete(publisher.channel()).await {
        eprintln!("could not delete {}: {error}", topology.exchange());
    }
}

/// The app's store for the end-to-end cells, in `schema`.
pub(crate) async fn store(url: &str, schema: &str, pool: u32) -> Result<SqlxStore, BoxError> {
    let options = SqlxStore::connect_options(url, schema)?;
    let pool = inbox_backend_sqlx::sqlx::postgres::PgPoolOptions::new()
        .max_connections(pool)
        .connect_with(options)
        .await?;
    let store = SqlxStore::new(pool, schema)?;
    store.migrate_all().await?;
    Ok(store)
}
