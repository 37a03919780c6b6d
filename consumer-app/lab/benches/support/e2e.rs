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
//! - the app batched: the same with `--batch-size 100 --batch-wait 20`.
//!
//! Rates are deliveries per second (both queues together).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use consumer_app::parcel::downstream::{Downstreams, StubCarrier, StubNotifier};
use consumer_app::parcel::events::{ROUTING_KEY, outgoing};
use consumer_app::parcel::role::Role;
use consumer_app::parcel::service::spawn;
use consumer_app::parcel::store::ParcelStore;
use consumer_app::parcel::topology::Topology;
use consumer_app::runtime::amqp::{Outgoing, Publisher, close_bounded, connect};
use consumer_app::runtime::{BatchConfig, ServiceConfig, WorkerConfig};
use futures::StreamExt as _;
use inbox_api::MessageId;
use inbox_backend_sqlx::SqlxStore;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;

pub(crate) const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// What an end-to-end cell runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum E2e {
    Bare,
    PerMessage,
    Batched(usize),
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

/// One cell: deliveries/s for `mode` at `tasks`, draining `n` events.
pub(crate) async fn cell(
    mode: E2e,
    tasks: usize,
    n: usize,
    store: &SqlxStore,
    prefix: &str,
) -> Result<f64, BoxError> {
    let topology = Topology::new(prefix);
    let connection = connect(AMQP_URL, "inbox bench publisher").await?;
    let publisher = Publisher::new(&connection, &topology.exchange(), ROUTING_KEY).await?;
    topology.declare(publisher.channel()).await?;
    let messages = events(n, prefix)?;
    publisher.publish_all(&messages, 512, |_| {}).await?;
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
            finish(&publisher, &topology).await;
            close_bounded(&connection, "bye").await;
            Ok(rate)
        }
        E2e::PerMessage | E2e::Batched(_) => {
            let prefetch = match mode {
                E2e::Batched(k) => u16::try_from(2 * k * tasks).unwrap_or(u16::MAX),
                _ => u16::try_from((4 * tasks).max(32)).unwrap_or(u16::MAX),
            };
            let batch = match mode {
                E2e::Batched(k) => BatchConfig::effective(k, Duration::from_millis(20), prefetch),
                _ => None,
            };
            let service = spawn(
                store.clone(),
                ServiceConfig {
                    amqp_url: AMQP_URL.to_owned(),
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
                },
                &topology,
                Downstreams {
                    carrier: Arc::new(StubCarrier::default()),
                    notifier: Arc::new(StubNotifier::default()),
                },
            )?;
            started = Instant::now();
            let tally = Arc::clone(&service.tally);
            while Role::ALL
                .iter()
                .map(|r| tally.consumer(r.consumer_name()).finished())
                .sum::<u64>()
                < deliveries
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let elapsed = started.elapsed();
            service.shutdown();
            service.join().await?;
            let rate = deliveries as f64 / elapsed.as_secs_f64();
            finish(&publisher, &topology).await;
            close_bounded(&connection, "bye").await;
            Ok(rate)
        }
    }
}

async fn finish(publisher: &Publisher, topology: &Topology) {
    if let Err(error) = topology.delete(publisher.channel()).await {
        eprintln!("could not delete {}: {error}", topology.prefix());
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
