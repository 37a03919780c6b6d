//! NATS JetStream (inbox-runtime's `nats` feature): the broker's own
//! consume ceiling, the runtime on a `nats://` URL, and the outbox relay's
//! JetStream outlet against a bare JetStream publisher, measured as the
//! RabbitMQ rows are (same handler, store, prefetch, batch size, relay
//! window, repetitions and spread), so that the two brokers' rows compare.
//!
//! Every cell has a stream of its own, `bench-{run}_{cell}` (`{run}` a uuid
//! fragment of this run), created as the runtime declares one (file
//! storage, interest retention, the runtime's duplicate window) with the
//! cell's durable pull consumer (explicit ack, no delivery cap), filled
//! before the clock starts (each publish's stream ack awaited, 512 in
//! flight), and deleted after the cell; a last sweep deletes whatever of
//! the run's streams a failed cell left.
//!
//! - bare consume ([`bare_consume`]): per task one pull stream on the
//!   cell's durable consumer (batches of 32, the consumer's
//!   `max_ack_pending` 32 × tasks, as the RabbitMQ bare row's prefetch of
//!   32 per channel), each message acked on its own, no database: what
//!   JetStream and async-nats allow any consumer on this machine;
//! - the runtime per message ([`runtime_drain`]): `inbox_runtime::Service`
//!   on `nats://127.0.0.1:4222`, concurrency `tasks`, the RabbitMQ runtime
//!   row's prefetch (`max_ack_pending` and pull batch here) and handler
//!   ([`BusinessWrite`]: (b)'s INSERT only) on the report's sqlx store;
//!   (b) itself runs right after each drain for as long as the drain took,
//!   as beside the RabbitMQ runtime row, and the ratio is taken to it;
//! - the runtime batched: the same with batches of K (prefetch 2 × K ×
//!   tasks, batch wait 20 ms: the RabbitMQ batched row's settings);
//! - the relay ([`relay::relayed`] on the sqlx outbox, the relay section's
//!   batch and pipeline depth) against [`bare_publish`]: `batch` JetStream
//!   publishes sent, then all their acks awaited, then the next `batch`,
//!   the RabbitMQ bare publisher's window. One stream with a durable
//!   consumer, so that the messages are stored as on RabbitMQ's durable
//!   queue (interest retention keeps nothing without one), purged before
//!   each cell.
//!
//! The consume cells of a concurrency alternate in a rotated order within
//! each repetition, as the RabbitMQ rows do, and so do the two publishers.

use std::future::IntoFuture as _;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use consumer_app::parcel::events::ROUTING_KEY;
use futures::StreamExt as _;
use futures::future::join_all;
use inbox_api::{ConsumerName, MessageId, OutgoingMessage};
use inbox_runtime::async_nats::jetstream::consumer::PullConsumer;
use inbox_runtime::async_nats::jetstream::{self, Context as JetStream};
use inbox_runtime::async_nats::{self, HeaderMap};
use inbox_runtime::nats::names::{self, MESSAGE_TYPE, NATS_MSG_ID};
use inbox_runtime::{BatchConfig, Service, ServiceConfig, ServiceHandle, Topology, WorkerConfig};

use super::e2e::{BUSINESS_WRITE, BoxError, BusinessWrite, per_message_prefetch};
use super::relay;
use super::spread::{self, Spread};

/// The NATS server with JetStream the section runs on (`bash
/// .ci/services.sh` starts it).
pub(crate) const NATS_URL: &str = "nats://127.0.0.1:4222";

/// The consumer name of the runtime cells' handler (its inbox rows).
const CONSUMER: &str = "bench-nats-runtime";

/// Messages in flight while a cell's stream is filled.
const FILL_WINDOW: usize = 512;

/// What a consume cell runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Consume {
    Bare,
    PerMessage,
    Batched,
}

impl Consume {
    const ALL: [Self; 3] = [Self::Bare, Self::PerMessage, Self::Batched];

    fn tag(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::PerMessage => "msg",
            Self::Batched => "batch",
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|c| *c == self).unwrap_or(0)
    }
}

/// What the section measures and how much.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    /// The concurrencies (the report's `INBOX_BENCH_TASKS`).
    pub(crate) tasks: Vec<usize>,
    /// Messages per consume cell; 0 skips the consume rows.
    pub(crate) events: usize,
    /// The batched rows' K.
    pub(crate) batch_k: usize,
    /// Messages per publish cell; 0 skips the relay rows.
    pub(crate) relay_messages: usize,
    /// The relay's batch size, and the bare publisher's window.
    pub(crate) batch: NonZeroU32,
    /// The relay's pipeline depth.
    pub(crate) depth: NonZeroU32,
    pub(crate) reps: usize,
}

/// What the section measured: rates per repetition.
#[derive(Debug)]
pub(crate) struct NatsRates {
    plan: Plan,
    server: String,
    /// `[Consume::index][tasks index]`: deliveries/s per repetition.
    consume: [Vec<Vec<f64>>; 3],
    /// `[tasks index]`: (b) right after each per-message drain.
    beside: Vec<Vec<f64>>,
    /// Messages/s per repetition: the bare publisher, the relay.
    publish: [Vec<f64>; 2],
}

/// Runs the section on `bench`'s schema and pool (its `bench_events`, its
/// outbox, (b) itself), against the server at [`NATS_URL`].
pub(crate) async fn run(bench: &Arc<crate::Bench>, plan: &Plan) -> Result<NatsRates, BoxError> {
    let client = async_nats::ConnectOptions::new()
        .name("inbox bench NATS setup")
        .connect(NATS_URL)
        .await?;
    let js = jetstream::new(client.clone());
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    let mut rates = NatsRates {
        plan: plan.clone(),
        server: client.server_info().version,
        consume: Default::default(),
        beside: vec![Vec::new(); plan.tasks.len()],
        publish: Default::default(),
    };
    for rows in &mut rates.consume {
        *rows = vec![Vec::new(); plan.tasks.len()];
    }
    let result = async {
        if plan.events > 0 {
            // (b)'s connections and statements warm, as after the
            // database rows of a full run.
            crate::run_slice(
                bench,
                crate::Variant::Inbox,
                4,
                1,
                Duration::from_millis(300),
            )
            .await;
            consume_cells(bench, &js, &run_id, plan, &mut rates).await?;
        }
        if plan.relay_messages > 0 {
            publish_cells(bench, &js, &run_id, plan, &mut rates).await?;
        }
        Ok::<(), BoxError>(())
    }
    .await;
    sweep(&js, &run_id).await;
    if let Some(Err(error)) =
        inbox_runtime::shutdown::bounded("drain the NATS setup connection", client.drain()).await
    {
        eprintln!("could not drain the NATS setup connection: {error}");
    }
    result.map(|()| rates)
}

async fn consume_cells(
    bench: &Arc<crate::Bench>,
    js: &JetStream,
    run_id: &str,
    plan: &Plan,
    rates: &mut NatsRates,
) -> Result<(), BoxError> {
    let store = bench.inbox.store();
    for (t, &n) in plan.tasks.iter().enumerate() {
        for rep in 0..plan.reps {
            let mut order = Consume::ALL;
            order.rotate_left(rep % Consume::ALL.len());
            for mode in order {
                let exchange = format!("bench-{run_id}.{}-{n}-{rep}", mode.tag());
                let rate = match mode {
                    Consume::Bare => bare_consume(js, &exchange, n, plan.events).await?,
                    Consume::PerMessage | Consume::Batched => {
                        let k = (mode == Consume::Batched).then_some(plan.batch_k);
                        let (rate, took) =
                            runtime_drain(js, store, &exchange, n, plan.events, k).await?;
                        if mode == Consume::PerMessage {
                            let db =
                                crate::run_slice(bench, crate::Variant::Inbox, n, 1, took).await;
                            let db_rate = db.processed as f64 / db.elapsed.as_secs_f64();
                            eprintln!(
                                "nats {n:>2} tasks, rep {rep}, (b) beside the runtime: {db_rate:.0}"
                            );
                            rates.beside[t].push(db_rate);
                        }
                        rate
                    }
                };
                eprintln!("nats {n:>2} tasks, rep {rep}, {mode:?}: {rate:.0} deliveries/s");
                rates.consume[mode.index()][t].push(rate);
            }
        }
    }
    Ok(())
}

async fn publish_cells(
    bench: &Arc<crate::Bench>,
    js: &JetStream,
    run_id: &str,
    plan: &Plan,
    rates: &mut NatsRates,
) -> Result<(), BoxError> {
    let exchange = format!("bench-{run_id}.relay");
    create(js, &exchange, "relay.q", ROUTING_KEY, None).await?;
    let result = async {
        for rep in 0..plan.reps {
            let mut order = [false, true];
            order.rotate_left(rep % 2);
            for relayed in order {
                js.get_stream(names::stream_name(&exchange))
                    .await?
                    .purge()
                    .await?;
                let messages = relay::events(plan.relay_messages, &exchange)?;
                let rate = if relayed {
                    relay::relayed(
                        NATS_URL,
                        bench.inbox.store(),
                        &messages,
                        plan.batch,
                        plan.depth,
                    )
                    .await?
                } else {
                    bare_publish(&messages, plan.batch).await?
                };
                let who = if relayed { "relay" } else { "bare publisher" };
                eprintln!("nats rep {rep}, {who}: {rate:.0} messages/s");
                rates.publish[usize::from(relayed)].push(rate);
            }
        }
        Ok::<(), BoxError>(())
    }
    .await;
    delete(js, &exchange).await;
    result
}

/// Creates `exchange`'s stream as the runtime declares it, and `queue`'s
/// durable pull consumer bound with `routing_key` as the runtime's (with
/// `max_ack_pending` when given; the runtime sets its own on subscribing).
async fn create(
    js: &JetStream,
    exchange: &str,
    queue: &str,
    routing_key: &str,
    max_ack_pending: Option<i64>,
) -> Result<PullConsumer, BoxError> {
    let stream = js
        .create_stream(inbox_runtime::nats::work_stream(exchange))
        .await?;
    let mut config = inbox_runtime::nats::consumer(exchange, queue, routing_key);
    if let Some(max) = max_ack_pending {
        config.max_ack_pending = max;
    }
    Ok(stream.create_consumer(config).await?)
}

/// Deletes `exchange`'s stream (its consumers go with it).
async fn delete(js: &JetStream, exchange: &str) {
    let name = names::stream_name(exchange);
    if let Err(error) = js.delete_stream(&name).await {
        eprintln!("could not delete stream {name}: {error}");
    }
}

/// Deletes every stream of this run still there (a failed cell's).
async fn sweep(js: &JetStream, run_id: &str) {
    let prefix = names::stream_name(&format!("bench-{run_id}."));
    let mut left = Vec::new();
    let mut listed = js.stream_names();
    while let Some(name) = listed.next().await {
        match name {
            Ok(name) if name.starts_with(&prefix) => left.push(name),
            Ok(_) => {}
            Err(error) => {
                eprintln!("could not list the streams to sweep: {error}");
                break;
            }
        }
    }
    for name in left {
        eprintln!("deleting stream {name}, left by a failed cell");
        if let Err(error) = js.delete_stream(&name).await {
            eprintln!("could not delete stream {name}: {error}");
        }
    }
}

/// The headers the relay's outlet gives a message: its id in
/// `Nats-Msg-Id`, its type.
fn headers(id: &str, kind: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MSG_ID, id);
    headers.insert(MESSAGE_TYPE, kind);
    headers
}

/// Publishes `n` business-write messages (new ids, the JSON string
/// payload) to `exchange` under [`BUSINESS_WRITE`], each stored (its ack
/// awaited), [`FILL_WINDOW`] in flight.
async fn fill(js: &JetStream, exchange: &str, n: usize) -> Result<(), BoxError> {
    let subject = names::subject(exchange, BUSINESS_WRITE);
    let body = serde_json::to_vec(crate::PAYLOAD)?;
    let mut left = n;
    while left > 0 {
        let now = left.min(FILL_WINDOW);
        let mut acks = Vec::with_capacity(now);
        for _ in 0..now {
            let id = MessageId::new_v7().to_string();
            acks.push(
                js.publish_with_headers(
                    subject.clone(),
                    headers(&id, BUSINESS_WRITE),
                    body.clone().into(),
                )
                .await?,
            );
        }
        for ack in join_all(acks.into_iter().map(|a| a.into_future())).await {
            if ack?.duplicate {
                return Err("a new message id was a duplicate in its stream".into());
            }
        }
        left -= now;
    }
    Ok(())
}

/// Bare consume: `n` messages stored in a stream of `exchange`'s, drained
/// by `tasks` pull streams on one durable consumer (batches of 32,
/// `max_ack_pending` 32 × tasks), each message acked on its own, no
/// database. Deliveries/s, timed from the first pull to the last ack sent.
async fn bare_consume(
    js: &JetStream,
    exchange: &str,
    tasks: usize,
    n: usize,
) -> Result<f64, BoxError> {
    let pending = i64::try_from(32 * tasks).unwrap_or(i64::MAX);
    let consumer = create(js, exchange, "bare", BUSINESS_WRITE, Some(pending)).await;
    let result = async {
        let consumer = consumer?;
        fill(js, exchange, n).await?;
        let n = n as u64;
        let done = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let mut workers = Vec::with_capacity(tasks);
        let started = Instant::now();
        for _ in 0..tasks {
            let mut messages = consumer
                .stream()
                .max_messages_per_batch(32)
                .messages()
                .await?;
            let (done, failed) = (Arc::clone(&done), Arc::clone(&failed));
            workers.push(tokio::spawn(async move {
                while let Some(message) = messages.next().await {
                    let acked = match message {
                        Ok(message) => message.ack().await.is_ok(),
                        Err(_) => false,
                    };
                    if !acked {
                        failed.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                    if done.fetch_add(1, Ordering::Relaxed) + 1 >= n {
                        break;
                    }
                }
            }));
        }
        let limit = drain_limit(n);
        while done.load(Ordering::Relaxed) < n
            && failed.load(Ordering::Relaxed) == 0
            && started.elapsed() < limit
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let elapsed = started.elapsed();
        for worker in workers {
            worker.abort();
        }
        if done.load(Ordering::Relaxed) < n {
            return Err(format!(
                "the bare JetStream consumers acked {} of {n} messages ({} failed) in {elapsed:?}",
                done.load(Ordering::Relaxed),
                failed.load(Ordering::Relaxed)
            )
            .into());
        }
        Ok(n as f64 / elapsed.as_secs_f64())
    }
    .await;
    delete(js, exchange).await;
    result
}

/// The longest a drain of `n` messages may take: far below 100 a second is
/// a broken run, not a result.
fn drain_limit(n: u64) -> Duration {
    Duration::from_secs(30 + n / 100)
}

/// The runtime: `n` business-write messages stored in a stream of
/// `exchange`'s, drained by [`Service`] on [`NATS_URL`] at concurrency
/// `tasks` with [`BusinessWrite`] on `store`, per message (`batch_k`
/// `None`) or in batches of K. Deliveries/s and the drain's time, from the
/// service's start (its connection and subscription included, as on
/// RabbitMQ) to the last message finished.
async fn runtime_drain(
    js: &JetStream,
    store: &inbox_backend_sqlx::SqlxStore,
    exchange: &str,
    tasks: usize,
    n: usize,
    batch_k: Option<usize>,
) -> Result<(f64, Duration), BoxError> {
    let queue = "writes";
    let topology = Topology::new(exchange).bind(queue, BUSINESS_WRITE);
    let result = async {
        // The consumer before the messages: interest retention keeps only
        // what a consumer's filter matches. The runtime's declare finds
        // both and keeps them; its subscribe sets its own ack wait and
        // max_ack_pending (the prefetch).
        create(js, exchange, queue, BUSINESS_WRITE, None).await?;
        fill(js, exchange, n).await?;
        let (prefetch, batch) = match batch_k {
            Some(k) => {
                let prefetch = u16::try_from(2 * k * tasks).unwrap_or(u16::MAX);
                let batch = BatchConfig::effective(k, Duration::from_millis(20), prefetch);
                (prefetch, batch)
            }
            None => (per_message_prefetch(tasks), None),
        };
        let config = ServiceConfig {
            worker: WorkerConfig {
                prefetch,
                concurrency: tasks,
                batch,
                ..WorkerConfig::default()
            },
            cleanup: None,
            ..ServiceConfig::new(NATS_URL, format!("inbox bench {exchange}"))
        };
        let service = Service::new(store.clone(), config, topology.clone())
            .consume(queue, BusinessWrite(ConsumerName::new(CONSUMER)?))
            .spawn()?;
        let started = Instant::now();
        let elapsed = drain(service, n as u64, started).await?;
        Ok((n as f64 / elapsed.as_secs_f64(), elapsed))
    }
    .await;
    // The work stream and the dead-letter stream the runtime declared.
    if let Err(error) = topology.remove(NATS_URL).await {
        eprintln!("could not delete the streams of {exchange}: {error}");
    }
    result
}

/// Waits until `service`'s consumer has finished `n` deliveries, then
/// stops it; the time from `started` to the last one. Gives up after
/// [`drain_limit`].
async fn drain(service: ServiceHandle, n: u64, started: Instant) -> Result<Duration, BoxError> {
    let tally = Arc::clone(&service.tally);
    let limit = drain_limit(n);
    while tally.consumer(CONSUMER).finished() < n {
        if started.elapsed() > limit {
            service.shutdown();
            let _ = service.join().await;
            return Err(format!(
                "the runtime on NATS finished {} of {n} messages in {limit:?}",
                tally.consumer(CONSUMER).finished()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = started.elapsed();
    service.shutdown();
    service.join().await?;
    Ok(elapsed)
}

/// The relay's baseline: async-nats alone, timed from its connection to
/// the last ack: `batch` publishes sent (each to the relay's subject, with
/// the relay's headers and body), then all their stream acks awaited (a
/// duplicate or a failure is an error), then the next `batch`. Messages/s.
async fn bare_publish(messages: &[OutgoingMessage], batch: NonZeroU32) -> Result<f64, BoxError> {
    let started = Instant::now();
    let client = async_nats::ConnectOptions::new()
        .name("inbox bench bare JetStream publisher")
        .connect(NATS_URL)
        .await?;
    let js = jetstream::new(client.clone());
    let window = usize::try_from(batch.get()).unwrap_or(100);
    for chunk in messages.chunks(window) {
        let mut acks = Vec::with_capacity(chunk.len());
        for message in chunk {
            acks.push(
                js.publish_with_headers(
                    names::subject(message.exchange(), message.routing_key()),
                    headers(&message.id().to_string(), message.message_type()),
                    message.body().to_vec().into(),
                )
                .await?,
            );
        }
        for ack in join_all(acks.into_iter().map(|a| a.into_future())).await {
            if ack?.duplicate {
                return Err("the bare publisher's new message was a duplicate".into());
            }
        }
    }
    let elapsed = started.elapsed();
    if let Some(Err(error)) =
        inbox_runtime::shutdown::bounded("drain the bare publisher", client.drain()).await
    {
        eprintln!("could not drain the bare JetStream publisher: {error}");
    }
    Ok(messages.len() as f64 / elapsed.as_secs_f64())
}

/// The concurrency (index) whose ratio has the lowest median, and that
/// ratio, as the report's targets take it.
fn worst(candidate: &[Vec<f64>], baseline: &[Vec<f64>]) -> Option<(usize, Spread)> {
    candidate
        .iter()
        .zip(baseline)
        .enumerate()
        .filter_map(|(c, (a, b))| Some((c, Spread::ratios(a, b)?)))
        .min_by(|a, b| a.1.median.total_cmp(&b.1.median))
}

/// A row of the consume table: rates per concurrency per repetition, and
/// the row its ratios are taken to (with its label).
struct Row<'a> {
    label: &'a str,
    rates: &'a [Vec<f64>],
    baseline: Option<(&'a [Vec<f64>], &'a str)>,
}

impl NatsRates {
    /// The Markdown section: the consume table (rates and ratios with
    /// their spread), the publish table, and the two targets.
    pub(crate) fn markdown(&self) -> String {
        use std::fmt::Write as _;
        let plan = &self.plan;
        let reps = plan.reps;
        let mut out = format!(
            "### NATS JetStream\n\n\
             nats-server {} with JetStream on 127.0.0.1:4222; every cell has a stream of its \
             own, as the runtime declares one (file storage, interest retention), with its \
             durable pull consumer (explicit ack), deleted after the cell.\n\n",
            self.server
        );
        if plan.events > 0 {
            let _ = write!(
                out,
                "{} messages stored per cell before the clock starts, then drained; \
                 deliveries/s. Bare: per task one pull stream on the durable consumer \
                 (batches of 32, `max_ack_pending` 32 × tasks), each message acked on its \
                 own, no database. The runtime: `inbox_runtime::Service` on `nats://` with \
                 the RabbitMQ runtime row's handler (only (b)'s business write, sqlx) and \
                 prefetch (max(32, 4 × tasks) per message; batched K={}: 2 × K × tasks, \
                 batch wait 20 ms), timed from its start; (b) run right after each \
                 per-message drain for as long as it took. The three cells of a \
                 concurrency alternate in a rotated order, {reps} repetitions; median \
                 (lowest–highest repetition), each ratio taken within its repetition.\n\n",
                plan.events, plan.batch_k
            );
            let _ = write!(out, "| messages/s |");
            for n in &plan.tasks {
                let _ = write!(out, " {n} task{} |", if *n == 1 { "" } else { "s" });
            }
            for n in &plan.tasks {
                let _ = write!(out, " ratio @{n} |");
            }
            let _ = writeln!(out, " ratio to |");
            let _ = writeln!(
                out,
                "|---|{}{}---|",
                "---:|".repeat(plan.tasks.len()),
                "---:|".repeat(plan.tasks.len())
            );
            const BARE: &str = "JetStream bare pull consume+ack, no database";
            const BESIDE: &str = "(b) inbox per message (sqlx), beside the NATS runtime's drains";
            let bare = &self.consume[Consume::Bare.index()];
            let batched = format!(
                "NATS + runtime batched K={}, business write only (sqlx)",
                plan.batch_k
            );
            let rows = [
                Row {
                    label: BARE,
                    rates: bare,
                    baseline: None,
                },
                Row {
                    label: BESIDE,
                    rates: &self.beside,
                    baseline: None,
                },
                Row {
                    label: "NATS + runtime per message, business write only (sqlx)",
                    rates: &self.consume[Consume::PerMessage.index()],
                    baseline: Some((&self.beside, BESIDE)),
                },
                Row {
                    label: &batched,
                    rates: &self.consume[Consume::Batched.index()],
                    baseline: Some((bare, BARE)),
                },
            ];
            for row in rows {
                let _ = write!(out, "| {} |", row.label);
                for per_task in row.rates {
                    let s = Spread::of(per_task.iter().copied());
                    let _ = write!(out, " {} |", spread::cell(s, 0));
                }
                for (c, per_task) in row.rates.iter().enumerate() {
                    let r = row
                        .baseline
                        .and_then(|(b, _)| Spread::ratios(per_task, b.get(c)?));
                    let _ = write!(out, " {} |", spread::cell(r, 2));
                }
                let _ = writeln!(out, " {} |", row.baseline.map_or("", |(_, name)| name));
            }
            out.push('\n');
        }
        if plan.relay_messages > 0 {
            let _ = write!(
                out,
                "The outbox relay on NATS: {} Parcel events per cell to one stream (with a \
                 durable consumer, so that they are stored), batches of {}: the bare \
                 publisher (async-nats alone, the relay's subject, headers and body) sends a \
                 batch of JetStream publishes, then awaits all their stream acks, then sends \
                 the next; the relay (sqlx outbox, its JetStream outlet) sends the next batch \
                 while up to {} earlier ones await their acks and marks. Both timed from \
                 their start (the connection included) to the last ack (the bare publisher) \
                 or mark (the relay; its messages enqueued beforehand). The stream purged \
                 before each cell; {reps} repetitions, the two alternated; median \
                 (lowest–highest).\n\n\
                 | publisher | messages/s | ratio to bare | target |\n|---|---:|---:|---|\n",
                plan.relay_messages,
                plan.batch,
                plan.depth.get() - 1
            );
            let relay_ratio = Spread::ratios(&self.publish[1], &self.publish[0]);
            for (i, label) in [
                "bare JetStream publisher, acks awaited per batch, same window",
                "outbox relay on NATS (sqlx outbox)",
            ]
            .iter()
            .enumerate()
            {
                let rate = spread::cell(Spread::of(self.publish[i].iter().copied()), 0);
                let (ratio, target) = if i == 0 {
                    (String::new(), String::new())
                } else {
                    (
                        spread::cell(relay_ratio, 2),
                        format!("≥ 0.8: {}", spread::verdict(relay_ratio, 0.8)),
                    )
                };
                let _ = writeln!(out, "| {label} | {rate} | {ratio} | {target} |");
            }
            out.push('\n');
        }
        let _ = writeln!(
            out,
            "Targets on NATS (the concurrency with the lowest median ratio; met only if \
             every repetition met it):\n\n\
             | target | worst ratio: median (lowest–highest) | at | |\n|---|---:|---:|---|"
        );
        let runtime = worst(&self.consume[Consume::PerMessage.index()], &self.beside);
        let _ = writeln!(
            out,
            "| NATS runtime per message ≥ 0.8 × database-only inbox (b) | {} | {} | {} |",
            runtime.map_or_else(|| "n/a".to_owned(), |(_, r)| r.cell(2)),
            runtime.map_or_else(String::new, |(c, _)| format!("@{}", plan.tasks[c])),
            spread::verdict(runtime.map(|(_, r)| r), 0.8)
        );
        let relay = Spread::ratios(&self.publish[1], &self.publish[0]);
        let _ = writeln!(
            out,
            "| NATS relay ≥ 0.8 × bare JetStream publisher | {} | | {} |",
            relay.map_or_else(|| "n/a".to_owned(), |r| r.cell(2)),
            spread::verdict(relay, 0.8)
        );
        out
    }
}
