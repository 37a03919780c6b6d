//! End-to-end latency of the full loop (issue 13 item 6b): from the 201 of
//! `POST /parcels` to the last consumer's transaction of that parcel, at a
//! steady request rate.
//!
//! Everything the production path has, in one process, on the sqlx store
//! and the shared RabbitMQ: the endpoint on a real listening server
//! (`ParcelApi` on `ApiServer`), an outbox relay woken by the outbox's
//! `LISTEN/NOTIFY` (the `relay` command's setup), and the app's consumers
//! (`parcel::service::spawn`, per message): `parcel.created` reaches the
//! carrier and the notification consumers; the carrier enqueues
//! `parcel.carrier-assigned` in its own transaction, which the relay
//! publishes to the third consumer. Requests are sent on a fixed schedule,
//! each on its own task, so a slow answer does not slow the schedule.
//!
//! The end of a parcel's chain is the latest `created_at` of its three
//! effect rows (its carrier assignment and its two notifications):
//! PostgreSQL's `now()`, the start of the consumer's transaction, whose
//! commit follows within the (stub) work's time; the 201's time is the
//! client's wall clock on the same machine.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use consumer_app::parcel::api::{ApiServer, ParcelApi};
use consumer_app::parcel::downstream::{Downstreams, StubCarrier, StubNotifier};
use consumer_app::parcel::service::spawn;
use consumer_app::parcel::store::ParcelStore as _;
use consumer_app::parcel::topology::Topology;
use consumer_app::tools::http::post_json;
use inbox_backend_sqlx::sqlx;
use inbox_runtime::amqp::{close_bounded, connect};
use inbox_runtime::relay::{Relay, RelayConfig};
use inbox_runtime::wakeups::sqlx_wakeups;
use inbox_runtime::{ServiceConfig, WorkerConfig};
use tokio::sync::Mutex;

use super::cleanup::percentile;
use super::e2e::{AMQP_URL, BoxError};

/// What the latency run measured.
#[derive(Debug)]
pub(crate) struct Latency {
    rate: f64,
    sent: usize,
    created: usize,
    completed: usize,
    p50: Duration,
    p99: Duration,
    max: Duration,
}

/// The effect rows a parcel's full chain leaves: its carrier assignment
/// and its two notifications (created, carrier assigned).
const EFFECTS_PER_PARCEL: i64 = 3;

/// Runs the loop at `rate` requests/s for `secs` on a store in `schema`,
/// with the broker's names under `prefix`.
pub(crate) async fn run(
    url: &str,
    schema: &str,
    prefix: &str,
    rate: f64,
    secs: f64,
) -> Result<Latency, BoxError> {
    let store = super::e2e::store(url, schema, 16).await?;
    let topology = Topology::new(prefix);
    let connection = connect(AMQP_URL, "inbox bench latency setup").await?;
    let channel = connection.create_channel().await?;
    topology.declare(&channel).await?;
    let service = spawn(
        store.clone(),
        ServiceConfig {
            worker: WorkerConfig {
                prefetch: 32,
                concurrency: 4,
                ..WorkerConfig::default()
            },
            cleanup: None,
            gauge_interval: None,
            ..ServiceConfig::new(AMQP_URL, format!("inbox bench latency {prefix}"))
        },
        &topology,
        Downstreams {
            carrier: Arc::new(StubCarrier::default()),
            notifier: Arc::new(StubNotifier::default()),
        },
    )?;
    service.wait_consuming(1, Duration::from_secs(30)).await?;
    let mut relay = Relay::new(
        store.clone(),
        RelayConfig::new(AMQP_URL, "inbox bench latency relay"),
    )?;
    if let Some(wakeups) = sqlx_wakeups(&store).await {
        relay = relay.wake_on(wakeups);
    }
    let relay = relay.spawn();
    let server = ApiServer::start(
        ([127, 0, 0, 1], 0).into(),
        ParcelApi::new(store.clone(), &topology).router(),
    )
    .await?;
    let addr = server.local_addr();

    // The schedule: one request every 1/rate s.
    let sent = ((rate * secs).round() as usize).max(1);
    let answered: Arc<Mutex<HashMap<String, DateTime<Utc>>>> = Arc::default();
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let mut requests = Vec::with_capacity(sent);
    for i in 0..sent {
        ticks.tick().await;
        let answered = Arc::clone(&answered);
        let parcel_id = format!("LAT-{i}");
        requests.push(tokio::spawn(async move {
            let body = serde_json::json!({
                "parcel_id": parcel_id,
                "tracking_number": format!("TN{i}"),
                "destination": "Lyon",
            });
            let answer = post_json(addr, "/parcels", &body).await;
            let at = Utc::now();
            match answer {
                Ok(answer) if answer.status == 201 => {
                    answered.lock().await.insert(parcel_id, at);
                }
                Ok(answer) => eprintln!("latency: {parcel_id} got {}", answer.status),
                Err(error) => eprintln!("latency: {parcel_id} failed: {error}"),
            }
        }));
    }
    for request in requests {
        request.await?;
    }
    let answered = Arc::try_unwrap(answered)
        .map_err(|_| "requests still running")?
        .into_inner();

    // Until every created parcel's chain has ended (or a generous limit).
    let query = "SELECT parcel_id, max(at) FROM ( \
                   SELECT parcel_id, created_at AS at FROM notifications \
                   UNION ALL SELECT parcel_id, created_at FROM carrier_assignments) AS e \
                 GROUP BY parcel_id HAVING count(*) >= $1";
    let limit = tokio::time::Instant::now() + Duration::from_secs(60);
    let ends: Vec<(String, DateTime<Utc>)> = loop {
        let ends: Vec<(String, DateTime<Utc>)> = sqlx::query_as(query)
            .bind(EFFECTS_PER_PARCEL)
            .fetch_all(store.pool())
            .await?;
        if ends.len() >= answered.len() || tokio::time::Instant::now() > limit {
            break ends;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    server.stop().await;
    relay.shutdown();
    let relayed = relay.join().await;
    service.shutdown();
    let served = service.join().await;
    if let Err(error) = topology.delete(&channel).await {
        eprintln!("could not delete {}: {error}", topology.prefix());
    }
    close_bounded(&connection, "bye").await;
    let _ = store.drop_schema().await;
    relayed?;
    served?;

    let mut latencies: Vec<Duration> = ends
        .iter()
        .filter_map(|(parcel, end)| {
            let created = answered.get(parcel)?;
            (*end - *created).to_std().ok().or(Some(Duration::ZERO))
        })
        .collect();
    Ok(Latency {
        rate,
        sent,
        created: answered.len(),
        completed: latencies.len(),
        p50: percentile(&mut latencies, 0.50),
        p99: percentile(&mut latencies, 0.99),
        max: latencies.last().copied().unwrap_or_default(),
    })
}

impl Latency {
    /// The Markdown section.
    pub(crate) fn markdown(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        format!(
            "### End-to-end latency, endpoint to last consumer\n\n\
             `POST /parcels` at a steady {:.0} requests/s (sqlx store, per-message consumers \
             at concurrency 4, the relay woken by LISTEN/NOTIFY): from the client's 201 to the \
             start of the last of the parcel's three consumer transactions (carrier \
             assignment, created notification, carrier-assigned notification, which crosses \
             the relay twice).\n\n\
             | requests/s | sent | 201 | chains complete | p50 | p99 | max |\n\
             |---:|---:|---:|---:|---:|---:|---:|\n\
             | {:.0} | {} | {} | {} | {:.1} ms | {:.1} ms | {:.1} ms |\n",
            self.rate,
            self.rate,
            self.sent,
            self.created,
            self.completed,
            ms(self.p50),
            ms(self.p99),
            ms(self.max),
        )
    }
}
