//! What the inbox costs on PostgreSQL: messages per second at 1, 4 and 16
//! concurrent consumers, for
//!
//! - (a) a bare transaction doing only the business write: BEGIN, one
//!   INSERT, COMMIT. The limit any inbox is measured against.
//! - (b) the inbox: `Inbox::handle` on the sqlx backend around the same
//!   write (BEGIN, claim (which sets `processed_at`), write, COMMIT).
//! - (c) the article's algorithm ported: BEGIN, `SELECT EXISTS` on the inbox
//!   table, plain INSERT into it, the write, COMMIT. Its table has the same
//!   definition as (b)'s, so only the algorithm differs.
//! - (d) (a) through diesel-async: `conn.transaction(..)` on a connection of
//!   a deadpool pool of the same size, the same INSERT (diesel DSL, so that
//!   diesel prepares it once per connection as sqlx does; a `sql_query` is
//!   re-prepared on every call).
//! - (e) (b) on the diesel backend: `Inbox::handle` on `DieselStore`, in the
//!   same schema, around (d)'s INSERT. `e/b` is the diesel inbox's rate over
//!   the sqlx inbox's.
//!
//! The first table delivers every message once (new v7 ids): the steady
//! state of a consumer. The second delivers every message twice at once, a
//! redelivery racing the first delivery: there (c)'s losing copy fails with
//! a unique violation where (b)'s waits and answers `Duplicate`. Cells are
//! interleaved in short slices so that drift on a shared machine spreads
//! over all columns alike.
//!
//! The same run also measures, into one report (`docs/benchmark.md` and
//! the chart `docs/benchmark.svg`, ratios to the bare baselines of this
//! run):
//!
//! - (f)–(i) batched mode: `Inbox::handle_batch` over K = 10 and 100 new
//!   messages per transaction, sqlx and diesel (diesel's rows are skipped
//!   if its store refuses savepoints);
//! - (j), (k) batched at once: `Inbox::handle_batch_at_once` over K = 100
//!   new messages, the work writing their business rows in one multi-row
//!   INSERT (sqlx: `UNNEST` of one array parameter; diesel: its multi-row
//!   `VALUES`), against the per-message inbox of the same driver;
//! - (l), (m) (b) and (g) with every key carrying its payload's
//!   fingerprint (hashed per message, stored by the claim), as the runtime
//!   sends every delivery: what conflict detection costs a fresh message;
//! - the memory store through `Inbox::handle`, on one core (a
//!   current-thread runtime on its own thread);
//! - end to end through RabbitMQ (`support/e2e.rs`): bare consume+ack with
//!   no database, against the app (`consumer_app::parcel::service`) per message
//!   and batched (K = 100), draining a pre-published queue; and the runtime
//!   alone (per message, a handler doing only (b)'s business write) against
//!   (b) run beside it at the same concurrency: the runtime's own cost;
//! - cleanup at scale (`support/cleanup.rs`): 1,000,000 expired rows in
//!   each layout, the plain table's purged in unpaced batches of 10,000
//!   and with the cleanup's default pacing, the partitioned one's day
//!   partitions dropped, with the claim latency beside each;
//! - the outbox relay's publish rate (`support/relay.rs`) over the sqlx and
//!   the diesel outbox, against a bare lapin publisher with confirms and
//!   the same window, in interleaved repetitions;
//! - NATS JetStream (`support/nats.rs`): bare pull consume+ack, the runtime
//!   on a `nats://` URL per message (against (b) beside its drains) and
//!   batched, and the relay's JetStream outlet against a bare JetStream
//!   publisher with the same window;
//! - claim cost against table size (`support/table_size.rs`): the inbox
//!   pre-filled with 1,000,000 and 10,000,000 rows of v4 and of v7 ids,
//!   against an empty one, both drivers, per message and batched; written
//!   to `docs/benchmark-table-size.svg` too;
//! - what TLS costs (`support/tls.rs`): the runtime alone per message at
//!   each concurrency, with the database, the broker, both or neither over
//!   TLS, and the sqlx relay over TLS against plain, on a private RabbitMQ
//!   node with both listeners;
//! - the full loop's latency (`support/latency.rs`): `POST /parcels` at a
//!   steady rate, from the 201 to the last consumer's transaction of the
//!   parcel (p50, p99).
//!
//! Run: `cargo bench -p parcel-lab --bench report` (PostgreSQL,
//! RabbitMQ and NATS with JetStream up: `bash .ci/services.sh`).
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test?sslmode=disable`),
//! `INBOX_BENCH_SECS` (seconds per cell, default 2), `INBOX_BENCH_TASKS`
//! (default `1,4,16`), `INBOX_BENCH_E2E_EVENTS` (events per end-to-end
//! cell, default 10,000), `INBOX_BENCH_CLEANUP_ROWS` (default 1,000,000; 0
//! skips the cleanup run), `INBOX_BENCH_RELAY_MESSAGES` (messages per relay
//! cell, default 10,000; 0 skips) and `INBOX_BENCH_RELAY_BATCH` (the relay's
//! batch size and the bare publisher's window, default 100),
//! `INBOX_BENCH_RELAY_DEPTH` (the relay's pipeline depth, default
//! `RelayConfig`'s), `INBOX_BENCH_TLS_EVENTS` (messages per TLS cell,
//! default 4,000; 0 skips),
//! `INBOX_BENCH_NATS_EVENTS` (messages per NATS consume cell, default
//! 2,000; 0 skips), `INBOX_BENCH_NATS_RELAY_MESSAGES` (messages per NATS
//! publish cell, default 5,000; 0 skips),
//! `INBOX_BENCH_REPS` (repetitions behind each ratio's spread, at least and
//! by default 3), `INBOX_BENCH_TABLE_SIZES` (pre-filled sizes, default
//! `1000000,10000000`; empty skips), `INBOX_BENCH_TABLE_TASKS` (default
//! 4), `INBOX_BENCH_LATENCY_SECS` (default 10; 0 skips) and
//! `INBOX_BENCH_LATENCY_RATE` (requests/s, default 50).
//! `INBOX_BENCH_CLEANUP_PACINGS` (the plain table's cleanups to compare,
//! `batch/pause-ms` comma-separated, for example `10000/0,1000/20`).
//! `INBOX_BENCH_SECTIONS` (for example `relay,cleanup`) measures only the
//! sections named (`support/sections.rs`) and then leaves `docs/` alone.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use inbox_api::{ConsumerName, Fingerprint, Handled, Inbox, InboxError, InboxKey, MessageId};
use inbox_backend_sqlx::sqlx::{self, PgPool, postgres::PgPoolOptions};
use inbox_backend_sqlx::{SqlxStore, classify};

use diesel::ExpressionMethods as _;
use inbox_backend_diesel::{DieselStore, classify as classify_diesel};
use sections::{Section, Sections};

diesel::table! {
    /// `bench_events` for diesel's DSL. The table has no primary key;
    /// diesel's `table!` wants one and only uses it for `find`.
    bench_events (message_id) {
        message_id -> Uuid,
        payload -> Text,
    }
}

/// Plain connections, said explicitly: with the `tls` feature libpq's
/// default (`prefer`) would negotiate TLS with a server that offers it, and
/// the report's rows must stay comparable with the earlier, plain ones.
const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable";
/// Each cell's time is cut into slices of about this length, run in turn
/// with the other variants' slices.
const SLICE: Duration = Duration::from_millis(250);

const BUSINESS: &str = "INSERT INTO bench_events (message_id, payload) VALUES ($1, $2)";
/// [`BUSINESS`] for a whole batch in one statement: one array parameter
/// whatever K, so sqlx prepares it once per connection.
const BUSINESS_MANY: &str =
    "INSERT INTO bench_events (message_id, payload) SELECT id, $2 FROM UNNEST($1::uuid[]) AS id";
const ARTICLE_CHECK: &str =
    "SELECT EXISTS (SELECT 1 FROM article_inbox WHERE id = $1 AND consumer_type = $2)";
const ARTICLE_INSERT: &str = "INSERT INTO article_inbox (id, consumer_type) VALUES ($1, $2)";
const PAYLOAD: &str = "parcel P-1 scanned at depot 7";

/// One way of handling a delivery. New variants (other backends) go here
/// and into [`Variant::ALL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    BareTx,
    Inbox,
    Article,
    DieselBareTx,
    DieselInbox,
    /// (b) in batched mode: `Inbox::handle_batch` over K new messages.
    SqlxBatch(usize),
    /// (e) in batched mode.
    DieselBatch(usize),
    /// (b) batched at once: `Inbox::handle_batch_at_once` over K new
    /// messages, their business rows in one multi-row INSERT.
    SqlxBatchAtOnce(usize),
    /// (e) batched at once.
    DieselBatchAtOnce(usize),
    /// (b) with each key carrying its payload's fingerprint, as the
    /// runtime sends every delivery: the hash and the claim's third column.
    InboxFingerprinted,
    /// (g) with fingerprinted keys.
    SqlxBatchFingerprinted(usize),
}

impl Variant {
    const ALL: [Self; 6] = [
        Self::BareTx,
        Self::Inbox,
        Self::Article,
        Self::DieselBareTx,
        Self::DieselInbox,
        Self::InboxFingerprinted,
    ];

    fn header(self) -> &'static str {
        match self {
            Self::BareTx => "(a) bare tx, business write only (sqlx)",
            Self::Inbox => "(b) inbox per message (sqlx)",
            Self::Article => "(c) article's check-then-insert (sqlx)",
            Self::DieselBareTx => "(d) bare tx, business write only (diesel)",
            Self::DieselInbox => "(e) inbox per message (diesel)",
            Self::SqlxBatch(10) => "(f) inbox batched K=10 (sqlx)",
            Self::SqlxBatch(_) => "(g) inbox batched K=100 (sqlx)",
            Self::DieselBatch(10) => "(h) inbox batched K=10 (diesel)",
            Self::DieselBatch(_) => "(i) inbox batched K=100 (diesel)",
            Self::SqlxBatchAtOnce(_) => {
                "(j) inbox batched at once K=100, one multi-row write (sqlx)"
            }
            Self::DieselBatchAtOnce(_) => {
                "(k) inbox batched at once K=100, one multi-row write (diesel)"
            }
            Self::InboxFingerprinted => "(l) (b) with the payload fingerprinted (sqlx)",
            Self::SqlxBatchFingerprinted(_) => "(m) (g) with the payloads fingerprinted (sqlx)",
        }
    }
}

/// What every variant works on: one schema, one pool.
struct Bench {
    pool: PgPool,
    inbox: Inbox<SqlxStore>,
    diesel: Inbox<DieselStore>,
    consumer: ConsumerName,
}

impl Bench {
    /// Handles one delivery of `key` (batched variants: of `key` and K - 1
    /// more new messages); how many messages' work ran.
    async fn deliver(&self, variant: Variant, key: &InboxKey) -> Result<u64, InboxError> {
        match variant {
            Variant::SqlxBatch(k) | Variant::SqlxBatchFingerprinted(k) => {
                let mut items = batch_items(key, k);
                if variant == Variant::SqlxBatchFingerprinted(k) {
                    items = items
                        .into_iter()
                        .map(|(key, id)| (fingerprinted(key), id))
                        .collect();
                }
                let outcomes = self
                    .inbox
                    .handle_batch(items, async |tx, id: &uuid::Uuid| {
                        sqlx::query(BUSINESS)
                            .bind(id)
                            .bind(PAYLOAD)
                            .execute(tx.conn())
                            .await
                            .map_err(classify)?;
                        Ok::<_, InboxError>(())
                    })
                    .await;
                return processed(outcomes);
            }
            Variant::DieselBatch(k) => {
                use inbox_backend_diesel::diesel_async::RunQueryDsl as _;
                let outcomes = self
                    .diesel
                    .handle_batch(batch_items(key, k), async |tx, id: &uuid::Uuid| {
                        diesel::insert_into(bench_events::table)
                            .values((
                                bench_events::message_id.eq(id),
                                bench_events::payload.eq(PAYLOAD),
                            ))
                            .execute(tx.conn())
                            .await
                            .map_err(classify_diesel)?;
                        Ok::<_, InboxError>(())
                    })
                    .await;
                return processed(outcomes);
            }
            Variant::SqlxBatchAtOnce(k) => {
                let outcomes = self
                    .inbox
                    .handle_batch_at_once(batch_items(key, k), async |tx, ids: &[&uuid::Uuid]| {
                        let ids: Vec<uuid::Uuid> = ids.iter().map(|id| **id).collect();
                        sqlx::query(BUSINESS_MANY)
                            .bind(ids)
                            .bind(PAYLOAD)
                            .execute(tx.conn())
                            .await
                            .map_err(classify)?;
                        Ok::<_, InboxError>(())
                    })
                    .await;
                return processed(outcomes);
            }
            Variant::DieselBatchAtOnce(k) => {
                use inbox_backend_diesel::diesel_async::RunQueryDsl as _;
                let outcomes = self
                    .diesel
                    .handle_batch_at_once(batch_items(key, k), async |tx, ids: &[&uuid::Uuid]| {
                        let rows: Vec<_> = ids
                            .iter()
                            .map(|id| {
                                (
                                    bench_events::message_id.eq(**id),
                                    bench_events::payload.eq(PAYLOAD),
                                )
                            })
                            .collect();
                        diesel::insert_into(bench_events::table)
                            .values(rows)
                            .execute(tx.conn())
                            .await
                            .map_err(classify_diesel)?;
                        Ok::<_, InboxError>(())
                    })
                    .await;
                return processed(outcomes);
            }
            _ => {}
        }
        self.deliver_one(variant, key).await.map(u64::from)
    }

    /// Handles one delivery of `key`; `true` when its work ran.
    async fn deliver_one(&self, variant: Variant, key: &InboxKey) -> Result<bool, InboxError> {
        let id = key.message_id.as_uuid();
        match variant {
            Variant::SqlxBatch(_)
            | Variant::DieselBatch(_)
            | Variant::SqlxBatchAtOnce(_)
            | Variant::DieselBatchAtOnce(_)
            | Variant::SqlxBatchFingerprinted(_) => Ok(false),
            Variant::BareTx => {
                let mut tx = self.pool.begin().await.map_err(classify)?;
                sqlx::query(BUSINESS)
                    .bind(id)
                    .bind(PAYLOAD)
                    .execute(&mut *tx)
                    .await
                    .map_err(classify)?;
                tx.commit().await.map_err(classify)?;
                Ok(true)
            }
            Variant::Inbox | Variant::InboxFingerprinted => {
                let printed;
                let key = if variant == Variant::InboxFingerprinted {
                    printed = fingerprinted(key.clone());
                    &printed
                } else {
                    key
                };
                let handled = self
                    .inbox
                    .handle(key, async |tx| {
                        sqlx::query(BUSINESS)
                            .bind(id)
                            .bind(PAYLOAD)
                            .execute(tx.conn())
                            .await
                            .map_err(classify)?;
                        Ok::<_, InboxError>(())
                    })
                    .await?;
                Ok(matches!(handled, Handled::Processed(())))
            }
            Variant::Article => {
                let mut tx = self.pool.begin().await.map_err(classify)?;
                let seen: bool = sqlx::query_scalar(ARTICLE_CHECK)
                    .bind(id)
                    .bind(key.consumer.as_str())
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(classify)?;
                if seen {
                    tx.rollback().await.map_err(classify)?;
                    return Ok(false);
                }
                sqlx::query(ARTICLE_INSERT)
                    .bind(id)
                    .bind(key.consumer.as_str())
                    .execute(&mut *tx)
                    .await
                    .map_err(classify)?;
                sqlx::query(BUSINESS)
                    .bind(id)
                    .bind(PAYLOAD)
                    .execute(&mut *tx)
                    .await
                    .map_err(classify)?;
                tx.commit().await.map_err(classify)?;
                Ok(true)
            }
            Variant::DieselBareTx => {
                // Scoped: diesel-async's `RunQueryDsl` is implemented for
                // every type and would shadow `AtomicU64::load` below.
                use inbox_backend_diesel::diesel_async::{AsyncConnection as _, RunQueryDsl as _};
                let mut conn = self
                    .diesel
                    .store()
                    .pool()
                    .get()
                    .await
                    .map_err(inbox_backend_diesel::classify_pool)?;
                conn.transaction(async |conn| {
                    diesel::insert_into(bench_events::table)
                        .values((
                            bench_events::message_id.eq(id),
                            bench_events::payload.eq(PAYLOAD),
                        ))
                        .execute(conn)
                        .await
                })
                .await
                .map_err(classify_diesel)?;
                Ok(true)
            }
            Variant::DieselInbox => {
                use inbox_backend_diesel::diesel_async::RunQueryDsl as _;
                let handled = self
                    .diesel
                    .handle(key, async |tx| {
                        diesel::insert_into(bench_events::table)
                            .values((
                                bench_events::message_id.eq(id),
                                bench_events::payload.eq(PAYLOAD),
                            ))
                            .execute(tx.conn())
                            .await
                            .map_err(classify_diesel)?;
                        Ok::<_, InboxError>(())
                    })
                    .await?;
                Ok(matches!(handled, Handled::Processed(())))
            }
        }
    }
}

/// `key` and `k - 1` new messages of the same consumer, each paired with
/// its id for the business write.
fn batch_items(key: &InboxKey, k: usize) -> Vec<(InboxKey, uuid::Uuid)> {
    std::iter::once(key.clone())
        .chain((1..k).map(|_| InboxKey::new(MessageId::new_v7(), key.consumer.clone())))
        .map(|key| {
            let id = *key.message_id.as_uuid();
            (key, id)
        })
        .collect()
}

/// `key` with the fingerprint of its message's body, computed per message
/// as the runtime does for every delivery.
fn fingerprinted(key: InboxKey) -> InboxKey {
    let body = format!("{PAYLOAD} {}", key.message_id);
    key.with_fingerprint(Fingerprint::of(body.as_bytes()))
}

/// How many messages of a batch ran their work; the first error, if any.
fn processed<I, T>(
    outcomes: Vec<(InboxKey, I, Result<Handled<T>, InboxError>)>,
) -> Result<u64, InboxError> {
    let mut ran = 0;
    for (_, _, outcome) in outcomes {
        if let Handled::Processed(_) = outcome? {
            ran += 1;
        }
    }
    Ok(ran)
}

/// What a slice did.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    /// Messages whose work ran and committed.
    processed: u64,
    /// Deliveries that ended in an error (a broker would redeliver or
    /// dead-letter them).
    failed: u64,
    /// From the start to the end of the last delivery in flight at the
    /// deadline.
    elapsed: Duration,
}

/// Runs `tasks` consumers of `variant` for `span`, each delivering every new
/// message `copies` times at once (1: the steady state; 2: a redelivery
/// racing the first delivery).
async fn run_slice(
    bench: &Arc<Bench>,
    variant: Variant,
    tasks: usize,
    copies: usize,
    span: Duration,
) -> Tally {
    let processed = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + span;
    let workers: Vec<_> = (0..tasks)
        .map(|_| {
            let (bench, processed, failed) = (bench.clone(), processed.clone(), failed.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let key = InboxKey::new(MessageId::new_v7(), bench.consumer.clone());
                    let deliveries = (0..copies).map(|_| bench.deliver(variant, &key));
                    for result in futures::future::join_all(deliveries).await {
                        match result {
                            Ok(n) => {
                                processed.fetch_add(n, Ordering::Relaxed);
                            }
                            // A single delivery of a new message must not
                            // fail; a racing copy may (that is the point).
                            Err(error) if copies == 1 => panic!("{variant:?} failed: {error:?}"),
                            Err(_) => {
                                failed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        if let Err(error) = worker.await {
            std::panic::resume_unwind(error.into_panic());
        }
    }
    Tally {
        processed: processed.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        elapsed: started.elapsed(),
    }
}

/// What one variant did in one cell.
#[derive(Clone, Debug, Default)]
struct Measured {
    /// Messages/s over the whole cell.
    rate: f64,
    /// Failed deliveries/s over the whole cell.
    failed: f64,
    /// Messages/s in each repetition (a contiguous run of rounds), for the
    /// spread of every ratio taken against another variant of the cell.
    reps: Vec<f64>,
}

/// Runs every variant in `variants` at `tasks` consumers for `secs` each,
/// interleaved in slices (one slice of each variant per round, the order
/// rotated every round so that no variant always follows another), the
/// rounds grouped into [`spread::reps`] repetitions.
async fn measure(
    bench: &Arc<Bench>,
    variants: &[Variant],
    tasks: usize,
    copies: usize,
    secs: f64,
) -> Vec<Measured> {
    // Whole rounds, a multiple of the repetitions, whose total is the
    // cell's time.
    let reps = spread::reps();
    let rounds = ((secs / SLICE.as_secs_f64()).round() as usize)
        .max(reps)
        .div_ceil(reps)
        * reps;
    let slice = Duration::from_secs_f64(secs / rounds as f64);
    let mut tallies = vec![vec![Tally::default(); reps]; variants.len()];
    for round in 0..rounds {
        let rep = round * reps / rounds;
        for k in 0..variants.len() {
            let i = (k + round) % variants.len();
            let t = run_slice(bench, variants[i], tasks, copies, slice).await;
            let into = &mut tallies[i][rep];
            into.processed += t.processed;
            into.failed += t.failed;
            into.elapsed += t.elapsed;
        }
    }
    tallies
        .iter()
        .map(|per_rep| {
            let total = per_rep.iter().fold(Tally::default(), |a, t| Tally {
                processed: a.processed + t.processed,
                failed: a.failed + t.failed,
                elapsed: a.elapsed + t.elapsed,
            });
            let secs = total.elapsed.as_secs_f64();
            Measured {
                rate: total.processed as f64 / secs,
                failed: total.failed as f64 / secs,
                reps: per_rep
                    .iter()
                    .map(|t| t.processed as f64 / t.elapsed.as_secs_f64())
                    .collect(),
            }
        })
        .collect()
}

fn env_secs() -> f64 {
    std::env::var("INBOX_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .unwrap_or(2.0)
}

/// A count from the environment variable `name`, `default` when unset or
/// unreadable (0 skips a section).
fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(default)
}

/// The relay's batch size and pipeline depth, for the relay and the TLS
/// sections alike.
fn relay_window() -> (std::num::NonZeroU32, std::num::NonZeroU32) {
    let batch = std::num::NonZeroU32::new(
        u32::try_from(env_count("INBOX_BENCH_RELAY_BATCH", 100)).unwrap_or(100),
    )
    .unwrap_or(std::num::NonZeroU32::MIN);
    let default_depth = inbox_runtime::relay::RelayConfig::new("", "").pipeline_depth;
    let depth = std::num::NonZeroU32::new(
        u32::try_from(env_count(
            "INBOX_BENCH_RELAY_DEPTH",
            usize::try_from(default_depth.get()).unwrap_or(1),
        ))
        .unwrap_or(1),
    )
    .unwrap_or(default_depth);
    (batch, depth)
}

fn env_tasks() -> Vec<usize> {
    std::env::var("INBOX_BENCH_TASKS")
        .ok()
        .map(|v| {
            v.split(',')
                .filter_map(|t| t.trim().parse().ok())
                .filter(|t| *t > 0)
                .collect::<Vec<usize>>()
        })
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| vec![1, 4, 16])
}

async fn setting(pool: &PgPool, name: &str) -> String {
    sqlx::query_scalar("SELECT current_setting($1)")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| format!("? ({e})"))
}

async fn setup(url: &str, schema: &str, pool_size: u32) -> Result<Arc<Bench>, InboxError> {
    let options = SqlxStore::connect_options(url, schema)?.application_name(schema);
    let pool = PgPoolOptions::new()
        .max_connections(pool_size)
        .min_connections(pool_size)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .map_err(classify)?;
    let store = SqlxStore::new(pool.clone(), schema)?;
    store.migrate().await?;
    for ddl in [
        "CREATE TABLE bench_events (message_id uuid NOT NULL, payload text NOT NULL)",
        "CREATE TABLE article_inbox (LIKE inbox_messages INCLUDING ALL)",
    ] {
        sqlx::query(ddl).execute(&pool).await.map_err(classify)?;
    }
    // The diesel backend on the same schema and tables, with a pool of the
    // same size, opened in full up front as sqlx's `min_connections` does.
    let diesel_store = DieselStore::builder(url, schema)?
        .pool_size(usize::try_from(pool_size).unwrap_or(17))
        .wait_timeout(Duration::from_secs(30))
        .connect()
        .await?;
    diesel_store.migrate().await?;
    let mut opened = Vec::new();
    for _ in 0..pool_size {
        opened.push(
            diesel_store
                .pool()
                .get()
                .await
                .map_err(inbox_backend_diesel::classify_pool)?,
        );
    }
    drop(opened);
    Ok(Arc::new(Bench {
        pool,
        inbox: Inbox::new(store),
        diesel: Inbox::new(diesel_store),
        consumer: ConsumerName::new("bench")?,
    }))
}

#[path = "support/chart.rs"]
mod chart;
#[path = "support/cleanup.rs"]
mod cleanup;
#[path = "support/e2e.rs"]
mod e2e;
#[path = "support/latency.rs"]
mod latency;
#[path = "support/nats.rs"]
mod nats;
#[path = "support/relay.rs"]
mod relay;
#[path = "support/sections.rs"]
mod sections;
#[path = "support/spread.rs"]
mod spread;
#[path = "support/table_size.rs"]
mod table_size;
#[path = "support/tls.rs"]
mod tls;

use e2e::{BoxError, E2e};
use spread::Spread;

/// The batched variants, measured in the same interleaved slices.
const BATCHED: [Variant; 7] = [
    Variant::SqlxBatch(10),
    Variant::SqlxBatch(100),
    Variant::DieselBatch(10),
    Variant::DieselBatch(100),
    Variant::SqlxBatchAtOnce(100),
    Variant::DieselBatchAtOnce(100),
    Variant::SqlxBatchFingerprinted(100),
];

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".to_owned())
}

/// Claim+commit/s of the memory store through `Inbox::handle` (one put as
/// the business write), `tasks` tasks on one current-thread runtime on a
/// thread of its own: one core.
fn memory_rate(tasks: usize, secs: f64) -> Result<f64, BoxError> {
    use inbox_backend_memory::MemoryStore;
    let run = move || -> Result<f64, BoxError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let inbox = Arc::new(Inbox::new(MemoryStore::new()));
            let consumer = ConsumerName::new("bench")?;
            let started = Instant::now();
            let deadline = started + Duration::from_secs_f64(secs);
            let workers: Vec<_> = (0..tasks)
                .map(|_| {
                    let (inbox, consumer) = (Arc::clone(&inbox), consumer.clone());
                    tokio::spawn(async move {
                        let mut done = 0_u64;
                        while Instant::now() < deadline {
                            for _ in 0..64 {
                                let key = InboxKey::new(MessageId::new_v7(), consumer.clone());
                                let handled = inbox
                                    .handle(&key, async |tx| {
                                        tx.put(format!("effect/{done}"), PAYLOAD.as_bytes());
                                        Ok::<_, InboxError>(())
                                    })
                                    .await?;
                                done += u64::from(matches!(handled, Handled::Processed(())));
                            }
                        }
                        Ok::<_, InboxError>(done)
                    })
                })
                .collect();
            let mut total = 0;
            for worker in workers {
                total += worker.await??;
            }
            Ok::<f64, BoxError>(total as f64 / started.elapsed().as_secs_f64())
        })
    };
    std::thread::spawn(run)
        .join()
        .map_err(|_| -> BoxError { "memory bench thread panicked".into() })?
}

/// Whether the diesel backend runs batched mode (it may not have landed).
async fn diesel_batches(bench: &Bench) -> bool {
    let key = InboxKey::new(MessageId::new_v7(), bench.consumer.clone());
    match bench.deliver(Variant::DieselBatch(2), &key).await {
        Ok(_) => true,
        Err(error) => {
            eprintln!("diesel batched mode unavailable, its rows are skipped: {error}");
            false
        }
    }
}

/// One row of the report.
struct Row {
    label: String,
    rates: Vec<Option<f64>>,
    /// Per concurrency, the rate of each repetition (empty: one run only).
    reps: Vec<Vec<f64>>,
    /// The row whose rates this one is divided by.
    baseline: Option<usize>,
}

fn fmt_rate(rate: Option<f64>) -> String {
    rate.map_or_else(|| "n/a".to_owned(), |r| format!("{r:.0}"))
}

impl Row {
    /// Its ratio to `baseline` at concurrency `c`, with the spread over the
    /// repetitions both ran in.
    fn ratio(&self, baseline: &Self, c: usize) -> Option<Spread> {
        Spread::ratios(self.reps.get(c)?, baseline.reps.get(c)?)
    }
}

/// The concurrency (index) whose ratio has the lowest median, and that
/// ratio.
fn worst_ratio(row: &Row, baseline: &Row) -> Option<(usize, Spread)> {
    (0..row.rates.len())
        .filter_map(|c| Some((c, row.ratio(baseline, c)?)))
        .min_by(|a, b| a.1.median.total_cmp(&b.1.median))
}

async fn bench(url: &str, schema: &str, sections: &Sections) -> Result<(String, String), BoxError> {
    let secs = env_secs();
    let tasks = env_tasks();
    let pool_size = u32::try_from(tasks.iter().copied().max().unwrap_or(16))
        .unwrap_or(16)
        .max(16)
        + 1;
    let load_before = load_average();
    let bench = setup(url, schema, pool_size).await?;
    let diesel_batched = diesel_batches(&bench).await;
    let mut variants: Vec<Variant> = Variant::ALL.to_vec();
    variants.extend(BATCHED.iter().filter(|v| {
        diesel_batched || !matches!(v, Variant::DieselBatch(_) | Variant::DieselBatchAtOnce(_))
    }));

    // Warm up: connections, prepared statements, caches.
    if sections.has(Section::Postgres) || sections.has(Section::Race) {
        for &variant in &variants {
            run_slice(&bench, variant, 4, 1, Duration::from_millis(300)).await;
        }
    }

    let mut out = String::new();
    let _ = writeln!(
        out,
        "PostgreSQL {} (fsync={}, synchronous_commit={}), pool {pool_size}, \
         {secs} s per cell in interleaved slices of about {} ms, {} cores, \
         load average at start {load_before}.\n",
        setting(&bench.pool, "server_version").await,
        setting(&bench.pool, "fsync").await,
        setting(&bench.pool, "synchronous_commit").await,
        SLICE.as_millis(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );

    // Every message new and delivered once.
    let mut rates: Vec<Vec<Measured>> = vec![Vec::new(); variants.len()];
    for &n in tasks.iter().filter(|_| sections.has(Section::Postgres)) {
        let cell = measure(&bench, &variants, n, 1, secs).await;
        eprintln!(
            "{n:>2} tasks, single deliveries: {:.0?}",
            cell.iter().map(|m| m.rate).collect::<Vec<_>>()
        );
        for (i, measured) in cell.into_iter().enumerate() {
            rates[i].push(measured);
        }
    }
    let of = |v: Variant| -> (Vec<Option<f64>>, Vec<Vec<f64>>) {
        variants
            .iter()
            .position(|x| *x == v)
            .filter(|i| !rates[*i].is_empty())
            .map_or_else(
                || (vec![None; tasks.len()], vec![Vec::new(); tasks.len()]),
                |i| {
                    (
                        rates[i].iter().map(|m| Some(m.rate)).collect(),
                        rates[i].iter().map(|m| m.reps.clone()).collect(),
                    )
                },
            )
    };
    let mut memory = Vec::new();
    for &n in &tasks {
        if !sections.has(Section::Memory) {
            memory.push(None);
            continue;
        }
        let rate = memory_rate(n, secs)?;
        eprintln!("{n:>2} tasks, memory store on one core: {rate:.0}");
        memory.push(Some(rate));
    }

    // End to end through RabbitMQ.
    let e2e_events = std::env::var("INBOX_BENCH_E2E_EVENTS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(10_000);
    let app_schema = format!("{schema}_app");
    let app_store = e2e::store(url, &app_schema, pool_size).await?;
    let modes = [
        E2e::Bare,
        E2e::PerMessage,
        E2e::Batched(100),
        E2e::Runtime,
        E2e::LapinLoop,
    ];
    // Per mode, per concurrency, the rate of each repetition; the modes
    // alternate within a repetition, in a rotated order.
    let mut e2e_reps: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); tasks.len()]; modes.len()];
    // (b) run right after each runtime-alone drain, as long as it took.
    let mut beside_runtime: Vec<Vec<f64>> = vec![Vec::new(); tasks.len()];
    let e2e_result: Result<(), BoxError> = async {
        for (c, &n) in tasks
            .iter()
            .enumerate()
            .filter(|_| sections.has(Section::EndToEnd) || sections.has(Section::Runtime))
        {
            for rep in 0..spread::reps() {
                for k in 0..modes.len() {
                    let m = (k + rep) % modes.len();
                    let mode = modes[m];
                    let section = if matches!(mode, E2e::Runtime | E2e::LapinLoop) {
                        Section::Runtime
                    } else {
                        Section::EndToEnd
                    };
                    if !sections.has(section) {
                        continue;
                    }
                    let prefix = format!("{schema}.{m}.{n}.{rep}.");
                    let rate = if mode == E2e::Runtime {
                        let store = bench.inbox.store();
                        let (rate, took) =
                            e2e::runtime_cell(e2e::AMQP_URL, n, e2e_events, store, &prefix).await?;
                        let db = run_slice(&bench, Variant::Inbox, n, 1, took).await;
                        let db_rate = db.processed as f64 / db.elapsed.as_secs_f64();
                        eprintln!("{n:>2} tasks, rep {rep}, (b) beside the runtime: {db_rate:.0}");
                        beside_runtime[c].push(db_rate);
                        rate
                    } else if mode == E2e::LapinLoop {
                        let store = bench.inbox.store();
                        e2e::lapin_loop_cell(n, e2e_events, store, &prefix).await?
                    } else {
                        e2e::cell(mode, n, e2e_events, &app_store, &prefix).await?
                    };
                    eprintln!(
                        "{n:>2} tasks, rep {rep}, end to end {mode:?}: {rate:.0} deliveries/s"
                    );
                    e2e_reps[m][c].push(rate);
                }
            }
        }
        Ok::<(), BoxError>(())
    }
    .await;
    let _ = consumer_app::parcel::store::ParcelStore::drop_schema(&app_store).await;
    if let Err(error) = e2e_result {
        eprintln!("end-to-end rows skipped (is RabbitMQ running?): {error}");
        e2e_reps = vec![vec![Vec::new(); tasks.len()]; modes.len()];
        beside_runtime = vec![Vec::new(); tasks.len()];
    }
    // A drain's rate is its repetitions' median.
    let medians = |per_task: &Vec<Vec<f64>>| -> Vec<Option<f64>> {
        per_task
            .iter()
            .map(|reps| Spread::of(reps.iter().copied()).map(|s| s.median))
            .collect()
    };
    let e2e_rates: Vec<Vec<Option<f64>>> = e2e_reps.iter().map(medians).collect();

    let rows = vec![
        Row {
            label: Variant::BareTx.header().into(),
            rates: of(Variant::BareTx).0,
            reps: of(Variant::BareTx).1,
            baseline: None,
        },
        Row {
            label: Variant::DieselBareTx.header().into(),
            rates: of(Variant::DieselBareTx).0,
            reps: of(Variant::DieselBareTx).1,
            baseline: None,
        },
        Row {
            label: Variant::Inbox.header().into(),
            rates: of(Variant::Inbox).0,
            reps: of(Variant::Inbox).1,
            baseline: Some(0),
        },
        Row {
            label: Variant::DieselInbox.header().into(),
            rates: of(Variant::DieselInbox).0,
            reps: of(Variant::DieselInbox).1,
            baseline: Some(1),
        },
        Row {
            label: Variant::SqlxBatch(10).header().into(),
            rates: of(Variant::SqlxBatch(10)).0,
            reps: of(Variant::SqlxBatch(10)).1,
            baseline: Some(0),
        },
        Row {
            label: Variant::SqlxBatch(100).header().into(),
            rates: of(Variant::SqlxBatch(100)).0,
            reps: of(Variant::SqlxBatch(100)).1,
            baseline: Some(0),
        },
        Row {
            label: Variant::DieselBatch(10).header().into(),
            rates: of(Variant::DieselBatch(10)).0,
            reps: of(Variant::DieselBatch(10)).1,
            baseline: Some(1),
        },
        Row {
            label: Variant::DieselBatch(100).header().into(),
            rates: of(Variant::DieselBatch(100)).0,
            reps: of(Variant::DieselBatch(100)).1,
            baseline: Some(1),
        },
        Row {
            label: Variant::SqlxBatchAtOnce(100).header().into(),
            rates: of(Variant::SqlxBatchAtOnce(100)).0,
            reps: of(Variant::SqlxBatchAtOnce(100)).1,
            baseline: Some(2),
        },
        Row {
            label: Variant::DieselBatchAtOnce(100).header().into(),
            rates: of(Variant::DieselBatchAtOnce(100)).0,
            reps: of(Variant::DieselBatchAtOnce(100)).1,
            baseline: Some(3),
        },
        Row {
            label: Variant::Article.header().into(),
            rates: of(Variant::Article).0,
            reps: of(Variant::Article).1,
            baseline: Some(0),
        },
        Row {
            label: "memory store, Inbox::handle, 1 core".into(),
            rates: memory,
            reps: vec![Vec::new(); tasks.len()],
            baseline: None,
        },
        Row {
            label: "RabbitMQ bare consume+ack, no database".into(),
            rates: e2e_rates[0].clone(),
            reps: e2e_reps[0].clone(),
            baseline: None,
        },
        Row {
            label: "RabbitMQ + app per message (sqlx)".into(),
            rates: e2e_rates[1].clone(),
            reps: e2e_reps[1].clone(),
            baseline: Some(12),
        },
        Row {
            label: "RabbitMQ + app batched K=100 (sqlx)".into(),
            rates: e2e_rates[2].clone(),
            reps: e2e_reps[2].clone(),
            baseline: Some(12),
        },
        Row {
            label: "(b) inbox per message (sqlx), beside the runtime's drains".into(),
            rates: medians(&beside_runtime),
            reps: beside_runtime,
            baseline: None,
        },
        Row {
            label: "RabbitMQ + runtime per message, business write only (sqlx)".into(),
            rates: e2e_rates[3].clone(),
            reps: e2e_reps[3].clone(),
            baseline: Some(15),
        },
        Row {
            label: "RabbitMQ + hand-written lapin loop per message, business write only (sqlx)"
                .into(),
            rates: e2e_rates[4].clone(),
            reps: e2e_reps[4].clone(),
            baseline: Some(15),
        },
        // 18, 19: what the payload fingerprint costs, against the same
        // variant without it, in the same slices.
        Row {
            label: Variant::InboxFingerprinted.header().into(),
            rates: of(Variant::InboxFingerprinted).0,
            reps: of(Variant::InboxFingerprinted).1,
            baseline: Some(2),
        },
        Row {
            label: Variant::SqlxBatchFingerprinted(100).header().into(),
            rates: of(Variant::SqlxBatchFingerprinted(100)).0,
            reps: of(Variant::SqlxBatchFingerprinted(100)).1,
            baseline: Some(5),
        },
    ];

    let _ = write!(out, "| messages/s | ");
    for n in &tasks {
        let _ = write!(out, "{n} task{} | ", if *n == 1 { "" } else { "s" });
    }
    for n in &tasks {
        let _ = write!(out, "ratio @{n} | ");
    }
    let _ = writeln!(out, "ratio to |");
    let _ = writeln!(
        out,
        "|---|{}{}---|",
        "---:|".repeat(tasks.len()),
        "---:|".repeat(tasks.len())
    );
    for row in &rows {
        let _ = write!(out, "| {} | ", row.label);
        for rate in &row.rates {
            let _ = write!(out, "{} | ", fmt_rate(*rate));
        }
        for c in 0..row.rates.len() {
            let r = row.baseline.and_then(|b| row.ratio(&rows[b], c));
            let _ = write!(out, "{} | ", spread::cell(r, 2));
        }
        let _ = writeln!(
            out,
            "{} |",
            row.baseline.map_or("", |b| rows[b].label.as_str())
        );
    }
    let _ = writeln!(
        out,
        "\nEnd-to-end rows: {e2e_events} events pre-published to the app's topic exchange, each routed \
         to both consumers' queues; rate = deliveries acked per second over both queues; \
         tasks = consumers per queue (bare) or the app's concurrency per queue (prefetch \
         max(32, 4 × tasks) per message, 2 × 100 × tasks batched so that the next batch arrives while one commits, batch wait 20 ms); \
         the drains of a concurrency alternate, in a rotated order, for {reps} repetitions, \
         and each shows its median rate. The runtime row: the same events on one queue, \
         drained by `inbox_runtime::Service` per message (prefetch as the app's) with \
         a handler doing only (b)'s business write, and (b) itself run right after each drain \
         for as long as the drain took, in the same schema and pool. The lapin-loop row: the \
         same events and write without the runtime, per task a lapin consumer (prefetch 32) \
         running `Inbox::handle` and acking each delivery: what the broker and its client \
         leave of (b) on this machine, a floor for any runtime on lapin.\n\n\
         Ratios: median (lowest–highest) over {reps} repetitions, each taken within one \
         repetition (the database rows: the cell's time cut into rounds of one slice per \
         variant, in a rotated order, the rounds grouped into {reps} repetitions).",
        reps = spread::reps()
    );

    // Targets, from this run.
    let check = |ok: Option<bool>| match ok {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "not measured",
    };
    let mut targets = String::new();
    let _ = writeln!(
        targets,
        "\n### Targets (the concurrency with the lowest median ratio; met only if \
         every repetition met it)\n"
    );
    let _ = writeln!(
        targets,
        "| target | worst ratio: median (lowest–highest) | at | |\n|---|---:|---:|---|"
    );
    for (name, a, b, want) in [
        ("batched K=100 ≥ 8 × per message (sqlx)", 5, 2, 8.0),
        ("batched K=100 ≥ 8 × per message (diesel)", 7, 3, 8.0),
        ("batched at once K=100 ≥ 8 × per message (sqlx)", 8, 2, 8.0),
        (
            "batched at once K=100 ≥ 8 × per message (diesel)",
            9,
            3,
            8.0,
        ),
        (
            "end-to-end batched ≥ 0.5 × bare RabbitMQ consume+ack",
            14,
            12,
            0.5,
        ),
        ("per-message inbox ≥ 0.80 × bare tx (sqlx)", 2, 0, 0.8),
        ("fingerprinted per message ≥ 0.95 × (b)", 18, 2, 0.95),
        ("fingerprinted batched K=100 ≥ 0.95 × (g)", 19, 5, 0.95),
        ("per-message inbox ≥ 0.80 × bare tx (diesel)", 3, 1, 0.8),
        (
            "runtime per message ≥ 0.8 × database-only inbox (b)",
            16,
            15,
            0.8,
        ),
    ] {
        let worst = worst_ratio(&rows[a], &rows[b]);
        let _ = writeln!(
            targets,
            "| {name} | {} | {} | {} |",
            worst.map_or_else(|| "n/a".to_owned(), |(_, r)| r.cell(2)),
            worst.map_or_else(String::new, |(c, _)| format!("@{}", tasks[c])),
            spread::verdict(worst.map(|(_, r)| r), want)
        );
    }
    let best_memory = rows[11].rates.iter().flatten().copied().reduce(f64::max);
    let _ = writeln!(
        targets,
        "| memory ≥ 1,000,000 claim+commit/s on one core | {} /s (best) | | {} |",
        fmt_rate(best_memory),
        check(best_memory.map(|m| m >= 1_000_000.0))
    );
    // Not a target: what the runtime costs beyond what the broker and lapin
    // cost any consumer, its row over the hand-written loop's, which share
    // (b) as their baseline.
    let own: Vec<String> = (0..tasks.len())
        .filter_map(|c| {
            let r = rows[16].ratio(&rows[17], c)?;
            Some(format!("{} @{}", r.cell(2), tasks[c]))
        })
        .collect();
    if !own.is_empty() {
        let _ = writeln!(
            targets,
            "\nThe runtime over the hand-written lapin loop (the runtime's own cost; above 1: \
             faster than the loop): {}.",
            own.join(", ")
        );
    }
    out.push_str(&targets);

    let _ = writeln!(out);
    // A redelivery racing the first delivery: the case the inbox exists for.
    // Two connections per task, so at most half the pool's tasks; (a) is left
    // out, it has no deduplication to race.
    let _ = writeln!(
        out,
        "\nEvery message delivered twice at once (a redelivery racing the first delivery); \
         failed = deliveries that ended in an error; ratios: median (lowest–highest) of {} \
         repetitions:\n",
        spread::reps()
    );
    let _ = writeln!(
        out,
        "| tasks | (b) inbox msg/s | (b) failed/s | (c) article msg/s | (c) failed/s | b/c \
         | (e) inbox (diesel) msg/s | (e) failed/s | e/b |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let pair = [Variant::Inbox, Variant::Article, Variant::DieselInbox];
    let max_pairs = usize::try_from(pool_size - 1).unwrap_or(16) / 2;
    let mut pair_tasks: Vec<usize> = tasks
        .iter()
        .filter(|_| sections.has(Section::Race))
        .map(|n| (*n).min(max_pairs))
        .collect();
    pair_tasks.dedup();
    for n in pair_tasks {
        let rates = measure(&bench, &pair, n, 2, secs).await;
        eprintln!(
            "{n:>2} tasks, racing copies: {:.0?}",
            rates.iter().map(|m| (m.rate, m.failed)).collect::<Vec<_>>()
        );
        let (b, c, e) = (&rates[0], &rates[1], &rates[2]);
        let _ = writeln!(
            out,
            "| {n} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {:.0} | {:.0} | {} |",
            b.rate,
            b.failed,
            c.rate,
            c.failed,
            spread::cell(Spread::ratios(&b.reps, &c.reps), 2),
            e.rate,
            e.failed,
            spread::cell(Spread::ratios(&e.reps, &b.reps), 2),
        );
    }

    // The outbox relay against a bare publisher.
    let relay_messages = env_count("INBOX_BENCH_RELAY_MESSAGES", 10_000);
    let (batch, depth) = relay_window();
    if relay_messages > 0 && sections.has(Section::Relay) {
        match relay::run(
            bench.inbox.store(),
            bench.diesel.store(),
            &format!("{schema}."),
            relay_messages,
            batch,
            depth,
            spread::reps(),
        )
        .await
        {
            Ok(rates) => {
                let _ = write!(out, "\n{}", rates.markdown());
            }
            Err(error) => eprintln!("relay rows skipped (is RabbitMQ running?): {error}"),
        }
    }

    // NATS JetStream: the broker's own ceiling, the runtime and the relay
    // on it, with (b) beside the runtime's drains as on RabbitMQ.
    let nats_events = env_count("INBOX_BENCH_NATS_EVENTS", 2_000);
    let nats_relay = env_count("INBOX_BENCH_NATS_RELAY_MESSAGES", 5_000);
    if sections.has(Section::Nats) && (nats_events > 0 || nats_relay > 0) {
        let plan = nats::Plan {
            tasks: tasks.clone(),
            events: nats_events,
            batch_k: 100,
            relay_messages: nats_relay,
            batch,
            depth,
            reps: spread::reps(),
        };
        match nats::run(&bench, &plan).await {
            Ok(rates) => {
                let _ = write!(out, "\n{}", rates.markdown());
            }
            Err(error) => eprintln!(
                "NATS rows skipped (is NATS with JetStream at {}?): {error}",
                nats::NATS_URL
            ),
        }
    }

    // The runtime and the relay over TLS, against plain connections.
    let tls_events = env_count("INBOX_BENCH_TLS_EVENTS", 4_000);
    if tls_events > 0 && sections.has(Section::Tls) {
        match tls::run(
            url,
            schema,
            &format!("{schema}."),
            &tasks,
            tls_events,
            batch,
            depth,
            spread::reps(),
        )
        .await
        {
            Ok(cost) => {
                let _ = write!(out, "\n{}", cost.markdown());
            }
            Err(error) => eprintln!("TLS rows skipped: {error}"),
        }
    }

    // End-to-end latency of the full loop, endpoint to last consumer.
    let latency_secs = std::env::var("INBOX_BENCH_LATENCY_SECS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(10.0);
    let latency_rate = std::env::var("INBOX_BENCH_LATENCY_RATE")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|r| *r > 0.0)
        .unwrap_or(50.0);
    if latency_secs > 0.0 && sections.has(Section::Latency) {
        match latency::run(
            url,
            &format!("{schema}_loop"),
            &format!("{schema}.loop."),
            latency_rate,
            latency_secs,
        )
        .await
        {
            Ok(measured) => {
                eprintln!("latency: {measured:?}");
                let _ = write!(out, "\n{}", measured.markdown());
            }
            Err(error) => eprintln!("latency rows skipped (is RabbitMQ running?): {error}"),
        }
    }

    // Cleanup at scale, on both layouts, in schemas of its own.
    let rows_env = std::env::var("INBOX_BENCH_CLEANUP_ROWS")
        .ok()
        .and_then(|v| v.replace('_', "").parse::<u64>().ok())
        .unwrap_or(1_000_000);
    let mut cleanup_md = String::new();
    if rows_env > 0 && sections.has(Section::Cleanup) {
        let result = cleanup::run(
            url,
            schema,
            rows_env,
            Duration::from_secs_f64(secs.max(2.0)),
        )
        .await?;
        cleanup_md = result.markdown();
    }
    let _ = writeln!(out, "\nLoad average at the end: {}.", load_average());

    let chart_rows: Vec<chart::Bars> = rows
        .iter()
        .map(|r| chart::Bars {
            label: r.label.clone(),
            rates: r.rates.clone(),
        })
        .collect();
    let svg = chart::svg(
        "Inbox throughput, messages/s (one run)",
        &tasks,
        &chart_rows,
    )?;
    inbox_runtime::shutdown::bounded("close the benchmark pool", bench.pool.close()).await;
    Ok((format!("{out}\n{cleanup_md}"), svg))
}

fn main() {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned());
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let random = uuid::Uuid::new_v4().simple().to_string();
    let schema = format!("inbox_bench_{secs}_{}", &random[..8]);

    let sections = match Sections::from_env() {
        Ok(sections) => sections,
        Err(error) => {
            eprintln!("{error}");
            std::process::exit(2);
        }
    };

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = rt.block_on(bench(&url, &schema, &sections));
    // Claim cost against table size, after the rest (whose pools are
    // closed by then): its own schemas and pools.
    let sizes = if sections.has(Section::TableSize) {
        table_size::sizes_from_env()
    } else {
        Vec::new()
    };
    let table_size = match &result {
        Ok(_) if !sizes.is_empty() => match rt.block_on(table_size::run(&url, &schema, &sizes)) {
            Ok(measured) => Some(measured),
            Err(error) => {
                eprintln!("table-size rows skipped: {error}");
                None
            }
        },
        _ => None,
    };

    // Drop the schemas whatever happened.
    rt.block_on(async {
        match PgPoolOptions::new().max_connections(1).connect(&url).await {
            Ok(admin) => {
                // `schema` is built above from digits and hex only.
                let mut names = vec![
                    schema.clone(),
                    format!("{schema}_app"),
                    format!("{schema}_loop"),
                ];
                names.extend(table_size::schemas(&schema));
                names.extend(cleanup::schemas(&schema));
                for name in names {
                    let drop = format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE");
                    if let Err(error) = sqlx::query(&drop).execute(&admin).await {
                        eprintln!("could not drop {name}: {error}");
                    }
                }
            }
            Err(error) => eprintln!("could not drop {schema}: {error}"),
        }
    });

    match result {
        Ok((mut report, svg)) => {
            let mut size_svg = None;
            if let Some(measured) = &table_size {
                report.push_str(&format!("\n{}", measured.markdown()));
                match measured.svg() {
                    Ok(svg) => size_svg = Some(svg),
                    Err(error) => eprintln!("no table-size chart: {error}"),
                }
            }
            println!("{report}");
            if !sections.complete() {
                eprintln!("a partial run (INBOX_BENCH_SECTIONS): docs/ left as it was");
                return;
            }
            // Into the workspace's docs/, which docs/results.md quotes.
            let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs");
            let md = format!(
                "# Benchmark\n\n\
                 One run of `cargo bench -p parcel-lab --bench report` \
                 (PostgreSQL and RabbitMQ on localhost; the chart is \
                 [benchmark.svg](benchmark.svg); what bounds the missed targets: \
                 [benchmark-notes.md](benchmark-notes.md)).\n\n![messages/s](benchmark.svg)\n\n{report}"
            );
            let written = std::fs::create_dir_all(&docs)
                .and_then(|()| std::fs::write(docs.join("benchmark.md"), md))
                .and_then(|()| std::fs::write(docs.join("benchmark.svg"), svg))
                .and_then(|()| match &size_svg {
                    Some(svg) => std::fs::write(docs.join("benchmark-table-size.svg"), svg),
                    None => Ok(()),
                });
            match written {
                Ok(()) => eprintln!("wrote {}/benchmark.md and benchmark.svg", docs.display()),
                Err(error) => eprintln!("could not write {}: {error}", docs.display()),
            }
        }
        Err(error) => {
            eprintln!(
                "benchmark failed: {error}: {:?}\n(is PostgreSQL running at DATABASE_URL?)",
                std::error::Error::source(&*error)
            );
            std::process::exit(1);
        }
    }
}
