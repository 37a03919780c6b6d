//! What the inbox costs on PostgreSQL: messages per second at 1, 4 and 16
//! concurrent consumers, for
//!
//! - (a) a bare transaction doing only the business write: BEGIN, one
//!   INSERT, COMMIT. The limit any inbox is measured against.
//! - (b) the inbox: `Inbox::handle` on the sqlx backend around the same
//!   write (BEGIN, claim, write, mark processed, COMMIT).
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
//! Run: `cargo bench -p inbox-conformance --bench postgres`.
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`),
//! `INBOX_BENCH_SECS` (seconds per cell, default 2), `INBOX_BENCH_TASKS`
//! (default `1,4,16`).

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use inbox_api::{ConsumerName, Handled, Inbox, InboxError, InboxKey, MessageId};
use inbox_backend_sqlx::sqlx::{self, PgPool, postgres::PgPoolOptions};
use inbox_backend_sqlx::{SqlxStore, classify};

use diesel::ExpressionMethods as _;
use inbox_backend_diesel::{DieselStore, classify as classify_diesel};

diesel::table! {
    /// `bench_events` for diesel's DSL. The table has no primary key;
    /// diesel's `table!` wants one and only uses it for `find`.
    bench_events (message_id) {
        message_id -> Uuid,
        payload -> Text,
    }
}

const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// Each cell's time is cut into slices of about this length, run in turn
/// with the other variants' slices.
const SLICE: Duration = Duration::from_millis(250);

const BUSINESS: &str = "INSERT INTO bench_events (message_id, payload) VALUES ($1, $2)";
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
}

impl Variant {
    const ALL: [Self; 5] = [
        Self::BareTx,
        Self::Inbox,
        Self::Article,
        Self::DieselBareTx,
        Self::DieselInbox,
    ];

    fn header(self) -> &'static str {
        match self {
            Self::BareTx => "(a) bare tx",
            Self::Inbox => "(b) inbox (sqlx)",
            Self::Article => "(c) article",
            Self::DieselBareTx => "(d) bare tx (diesel)",
            Self::DieselInbox => "(e) inbox (diesel)",
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
    /// Handles one delivery of `key`; `true` when its work ran.
    async fn deliver(&self, variant: Variant, key: &InboxKey) -> Result<bool, InboxError> {
        let id = key.message_id.as_uuid();
        match variant {
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
            Variant::Inbox => {
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
                            Ok(true) => {
                                processed.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(false) => {}
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

/// Runs every variant in `variants` at `tasks` consumers for `secs` each,
/// interleaved in slices; returns (messages/s, failed deliveries/s) per
/// variant.
async fn measure(
    bench: &Arc<Bench>,
    variants: &[Variant],
    tasks: usize,
    copies: usize,
    secs: f64,
) -> Vec<(f64, f64)> {
    // Whole slices, at least 3, whose total is the cell's time.
    let slices = ((secs / SLICE.as_secs_f64()).round() as u32).max(3);
    let slice = Duration::from_secs_f64(secs / f64::from(slices));
    let mut tallies = vec![Tally::default(); variants.len()];
    for _ in 0..slices {
        for (i, variant) in variants.iter().enumerate() {
            let t = run_slice(bench, *variant, tasks, copies, slice).await;
            tallies[i].processed += t.processed;
            tallies[i].failed += t.failed;
            tallies[i].elapsed += t.elapsed;
        }
    }
    tallies
        .iter()
        .map(|t| {
            let total = t.elapsed.as_secs_f64();
            (t.processed as f64 / total, t.failed as f64 / total)
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

async fn bench(url: &str, schema: &str) -> Result<String, InboxError> {
    let secs = env_secs();
    let tasks = env_tasks();
    let pool_size = u32::try_from(tasks.iter().copied().max().unwrap_or(16))
        .unwrap_or(16)
        .max(16)
        + 1;
    let bench = setup(url, schema, pool_size).await?;

    // Warm up: connections, prepared statements, caches.
    for variant in Variant::ALL {
        run_slice(&bench, variant, 4, 1, Duration::from_millis(300)).await;
    }

    let col = |v: Variant| Variant::ALL.iter().position(|x| *x == v).unwrap_or(0);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nPostgreSQL {} (fsync={}, synchronous_commit={}), pool {pool_size}, \
         {secs} s per cell in interleaved slices of about {} ms, {} cores\n",
        setting(&bench.pool, "server_version").await,
        setting(&bench.pool, "fsync").await,
        setting(&bench.pool, "synchronous_commit").await,
        SLICE.as_millis(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    let _ = writeln!(out, "Every message new and delivered once:\n");
    let _ = write!(out, "| tasks |");
    for variant in Variant::ALL {
        let _ = write!(out, " {} msg/s |", variant.header());
    }
    let _ = writeln!(out, " b/a | b/c | e/d | e/b |");
    let _ = write!(out, "|---:|");
    for _ in Variant::ALL {
        let _ = write!(out, "---:|");
    }
    let _ = writeln!(out, "---:|---:|---:|---:|");
    for &n in &tasks {
        let rates = measure(&bench, &Variant::ALL, n, 1, secs).await;
        eprintln!("{n:>2} tasks, single deliveries: {rates:.0?}");
        let _ = write!(out, "| {n} |");
        for (rate, _) in &rates {
            let _ = write!(out, " {rate:.0} |");
        }
        let (a, b, c, d, e) = (
            rates[col(Variant::BareTx)].0,
            rates[col(Variant::Inbox)].0,
            rates[col(Variant::Article)].0,
            rates[col(Variant::DieselBareTx)].0,
            rates[col(Variant::DieselInbox)].0,
        );
        let _ = writeln!(
            out,
            " {:.2} | {:.2} | {:.2} | {:.2} |",
            b / a,
            b / c,
            e / d,
            e / b
        );
    }

    // A redelivery racing the first delivery: the case the inbox exists for.
    // Two connections per task, so at most half the pool's tasks; (a) is left
    // out, it has no deduplication to race.
    let _ = writeln!(
        out,
        "\nEvery message delivered twice at once (a redelivery racing the first delivery); \
         failed = deliveries that ended in an error:\n"
    );
    let _ = writeln!(
        out,
        "| tasks | (b) inbox msg/s | (b) failed/s | (c) article msg/s | (c) failed/s | b/c \
         | (e) inbox (diesel) msg/s | (e) failed/s | e/b |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let pair = [Variant::Inbox, Variant::Article, Variant::DieselInbox];
    let max_pairs = usize::try_from(pool_size - 1).unwrap_or(16) / 2;
    let mut pair_tasks: Vec<usize> = tasks.iter().map(|n| (*n).min(max_pairs)).collect();
    pair_tasks.dedup();
    for n in pair_tasks {
        let rates = measure(&bench, &pair, n, 2, secs).await;
        eprintln!("{n:>2} tasks, racing copies: {rates:.0?}");
        let ((b, b_failed), (c, c_failed), (e, e_failed)) = (rates[0], rates[1], rates[2]);
        let _ = writeln!(
            out,
            "| {n} | {b:.0} | {b_failed:.0} | {c:.0} | {c_failed:.0} | {:.2} \
             | {e:.0} | {e_failed:.0} | {:.2} |",
            b / c,
            e / b
        );
    }
    bench.pool.close().await;
    Ok(out)
}

fn main() {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned());
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let random = uuid::Uuid::new_v4().simple().to_string();
    let schema = format!("inbox_bench_{secs}_{}", &random[..8]);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = rt.block_on(bench(&url, &schema));

    // Drop the schema whatever happened.
    rt.block_on(async {
        match PgPoolOptions::new().max_connections(1).connect(&url).await {
            Ok(admin) => {
                // `schema` is built above from digits and hex only.
                let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
                if let Err(error) = sqlx::query(&drop).execute(&admin).await {
                    eprintln!("could not drop {schema}: {error}");
                }
            }
            Err(error) => eprintln!("could not drop {schema}: {error}"),
        }
    });

    match result {
        Ok(table) => println!("{table}"),
        Err(error) => {
            eprintln!(
                "benchmark failed: {error}: {:?}\n(is PostgreSQL running at DATABASE_URL?)",
                std::error::Error::source(&error)
            );
            std::process::exit(1);
        }
    }
}
