//! Cleanup at scale, on both layouts: `rows` expired processed rows in an
//! inbox of each layout, cleaned while a concurrent task claims and commits
//! fresh keys without pause (4 tasks). Reports each cleanup's total time, its
//! longest step, and the claim+commit latency (p50/p99) while idle and
//! during the cleanup.
//!
//! - The plain table (`Layout::Table`): rows deleted in bounded batches
//!   (`purge_processed_paced`: each batch resumes where the one before it
//!   stopped), once in unpaced batches of 10,000 (what the report
//!   measured before, for contrast) and once with the cleanup's
//!   default pacing (`inbox_runtime::CleanupConfig::default()`:
//!   batch size and the pause between batches), or with the pacings of
//!   `INBOX_BENCH_CLEANUP_PACINGS` (`10000/0,1000/20`: batch/pause in ms).
//! - The partitioned layout (`Layout::Partitioned`): v7 rows in one day
//!   partition per repetition, each day detached and dropped whole
//!   (`purge_processed_batch` with the day's end as cutoff).
//!
//! Repetitions interleave everything: in each, every variant gets an idle
//! window (the claimer alone) and then the cleanup of its next part of the
//! rows (the oldest first) with the claimer beside it; each repetition's
//! p99 ratio is taken within it.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chrono::{NaiveTime, Utc};
use inbox_api::{ConsumerName, Inbox, InboxError, InboxKey, InboxStore, InboxStoreExt, MessageId};
use inbox_backend_sqlx::sqlx::{self, postgres::PgPoolOptions};
use inbox_backend_sqlx::{Layout, SqlxStore};

use super::e2e::BoxError;
use super::spread::{self, Spread};

/// The p99 ratio (during over idle) the partitioned layout's cleanup must
/// stay within (issue 14).
const PARTITIONED_TARGET: f64 = 1.2;
/// The same for the plain table's row deletes.
const TABLE_TARGET: f64 = 2.0;
/// Tasks claiming and committing beside a cleanup, each without pause.
const CLAIMERS: usize = 4;
/// Rows inserted per statement of a fill.
const CHUNK: u64 = 1_000_000;

/// How a plain table's cleanup paces its batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pacing {
    batch: NonZeroU32,
    pause: Duration,
}

impl Pacing {
    fn label(self) -> String {
        if self.pause.is_zero() {
            format!("row deletes, batches of {}, no pause", self.batch)
        } else {
            format!(
                "row deletes, batches of {}, {} ms pause",
                self.batch,
                self.pause.as_millis()
            )
        }
    }
}

/// The plain table's pacings: `INBOX_BENCH_CLEANUP_PACINGS`, or the old
/// unpaced 10,000-row batches and the cleanup's default.
fn pacings_from_env() -> Vec<Pacing> {
    let default = inbox_runtime::CleanupConfig::default();
    let defaults = vec![
        Pacing {
            batch: NonZeroU32::new(10_000).unwrap_or(NonZeroU32::MIN),
            pause: Duration::ZERO,
        },
        Pacing {
            batch: default.batch_size,
            pause: default.pause,
        },
    ];
    let Ok(text) = std::env::var("INBOX_BENCH_CLEANUP_PACINGS") else {
        return defaults;
    };
    let parsed: Vec<Pacing> = text
        .split(',')
        .filter_map(|p| {
            let (batch, pause) = p.trim().split_once('/')?;
            Some(Pacing {
                batch: batch.trim().replace('_', "").parse().ok()?,
                pause: Duration::from_millis(pause.trim().parse().ok()?),
            })
        })
        .collect();
    if parsed.is_empty() { defaults } else { parsed }
}

/// One cleanup measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// Row deletes on the plain table.
    Rows(Pacing),
    /// A day partition dropped whole.
    DropDay,
}

impl Variant {
    fn layout(self) -> Layout {
        match self {
            Self::Rows(_) => Layout::Table,
            Self::DropDay => Layout::Partitioned,
        }
    }

    fn target(self) -> f64 {
        match self {
            Self::Rows(_) => TABLE_TARGET,
            Self::DropDay => PARTITIONED_TARGET,
        }
    }

    fn label(self) -> String {
        match self {
            Self::Rows(pacing) => pacing.label(),
            Self::DropDay => "day partition detached (CONCURRENTLY) and dropped".to_owned(),
        }
    }
}

/// What one variant's cleanups measured over the repetitions.
#[derive(Debug)]
struct Measured {
    variant: Variant,
    deleted: u64,
    /// Delete batches, or partitions dropped.
    steps: u64,
    total: Duration,
    longest_step: Duration,
    idle: Vec<Duration>,
    during: Vec<Duration>,
    p99_ratio: Option<Spread>,
}

/// What the cleanup run measured.
#[derive(Debug)]
pub(crate) struct Cleanup {
    rows: u64,
    /// Fill time of the plain table and of the partitioned one.
    fills: (Duration, Duration),
    measured: Vec<Measured>,
}

/// The `p` quantile of `samples` (sorted in place); zero when empty.
pub(crate) fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort_unstable();
    let rank = ((samples.len() as f64) * p).ceil() as usize;
    samples[rank.clamp(1, samples.len()) - 1]
}

/// Claims and commits fresh keys until `stop`, one at a time; returns the
/// latency of each.
async fn claimer(
    inbox: Arc<Inbox<SqlxStore>>,
    stop: Arc<AtomicBool>,
) -> Result<Vec<Duration>, InboxError> {
    let consumer = ConsumerName::new("bench-claimer")?;
    let mut samples = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let key = InboxKey::new(MessageId::new_v7(), consumer.clone());
        let started = Instant::now();
        let _handled = inbox
            .handle(&key, async |_tx| Ok::<_, InboxError>(()))
            .await?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}

/// The claimers running beside `work`: `work`'s result and the claims'
/// latencies.
async fn beside<T>(
    inbox: &Arc<Inbox<SqlxStore>>,
    work: impl Future<Output = Result<T, InboxError>>,
) -> Result<(T, Vec<Duration>), InboxError> {
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..CLAIMERS)
        .map(|_| tokio::spawn(claimer(Arc::clone(inbox), Arc::clone(&stop))))
        .collect();
    let result = work.await;
    stop.store(true, Ordering::Relaxed);
    let mut samples = Vec::new();
    for task in tasks {
        samples.extend(task.await.map_err(|e| InboxError::InvalidArgument {
            message: format!("claimer: {e}"),
        })??);
    }
    Ok((result?, samples))
}

/// The schemas the mode creates under `base`.
pub(crate) fn schemas(base: &str) -> Vec<String> {
    vec![format!("{base}_cleanup_t"), format!("{base}_cleanup_p")]
}

async fn open(url: &str, schema: &str, layout: Layout) -> Result<SqlxStore, BoxError> {
    let options = SqlxStore::connect_options(url, schema)?.application_name(schema);
    let pool = PgPoolOptions::new()
        .max_connections(u32::try_from(CLAIMERS)? + 2)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(options)
        .await?;
    let store = SqlxStore::new(pool, schema)?.with_layout(layout);
    store.migrate().await?;
    Ok(store)
}

/// Runs `statement` (`$1`, `$2`: the first and last row number) over
/// `1..=rows` in chunks, then analyzes the table.
async fn fill(store: &SqlxStore, statement: &str, rows: u64) -> Result<Duration, BoxError> {
    let started = Instant::now();
    let mut start = 1;
    while start <= rows {
        let end = (start + CHUNK - 1).min(rows);
        let mut tx = store.pool().begin().await?;
        sqlx::query("SET LOCAL work_mem = '256MB'")
            .execute(&mut *tx)
            .await?;
        sqlx::query(statement)
            .bind(i64::try_from(start)?)
            .bind(i64::try_from(end)?)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        start = end + 1;
    }
    sqlx::raw_sql("VACUUM ANALYZE inbox_messages")
        .execute(store.pool())
        .await?;
    Ok(started.elapsed())
}

/// Runs the cleanup scenario in schemas of its own under `base`, `rows`
/// expired rows per layout, `idle` of claims alone per window.
pub(crate) async fn run(
    url: &str,
    base: &str,
    rows: u64,
    idle: Duration,
) -> Result<Cleanup, BoxError> {
    let reps = spread::reps();
    let pacings = pacings_from_env();
    let mut variants: Vec<Variant> = pacings.iter().map(|p| Variant::Rows(*p)).collect();
    variants.push(Variant::DropDay);
    let names = schemas(base);
    let table = open(url, &names[0], Layout::Table).await?;
    let partitioned = open(url, &names[1], Layout::Partitioned).await?;
    let result = measure(&table, &partitioned, rows, idle, reps, &variants).await;
    for store in [&table, &partitioned] {
        let drop = format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", store.schema());
        if let Err(error) = sqlx::query(&drop).execute(store.pool()).await {
            eprintln!("could not drop {}: {error}", store.schema());
        }
        inbox_runtime::shutdown::bounded("close a cleanup pool", store.pool().close()).await;
    }
    result
}

async fn measure(
    table: &SqlxStore,
    partitioned: &SqlxStore,
    rows: u64,
    idle: Duration,
    reps: usize,
    variants: &[Variant],
) -> Result<Cleanup, BoxError> {
    // The plain table: expired 30 days ago and before, 3 ms apart (oldest
    // last), ids from md5 so that they are distinct uuids; cut into one
    // part per (repetition, pacing), the oldest first.
    let pacings = variants.len() - 1;
    let parts = reps * pacings;
    let base = Utc::now() - chrono::Duration::days(30);
    let table_fill = fill(
        table,
        &format!(
            "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) \
             SELECT md5('cleanup-' || g)::uuid, 'bench-expired', t, t FROM ( \
               SELECT g, timestamptz '{base}' - g * interval '3 ms' AS t \
               FROM generate_series($1::bigint, $2::bigint) AS g) AS r",
            base = base.to_rfc3339()
        ),
        rows,
    )
    .await?;
    let span = chrono::Duration::milliseconds(i64::try_from(rows.saturating_mul(3))?);
    let oldest = base - span;

    // The partitioned table: v7 ids of `reps` whole days, 9 days and more
    // before today (so that the partitions between them and today are
    // never expired by the cutoffs below), one day per repetition.
    let first_day = Utc::now().date_naive() - chrono::Days::new(u64::try_from(reps)? + 8);
    partitioned
        .create_partitions(u16::try_from(reps + 8)?, 1)
        .await?;
    let part_fill = fill(
        partitioned,
        &format!(
            "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, time_ordered) \
             SELECT (lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0') \
                     || '7' || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid, \
                    'bench-expired', t, t, true FROM ( \
               SELECT timestamptz '{day}T00:00:00Z' + (g % {reps}) * interval '1 day' \
                        + (g / {reps}) * interval '1 ms' * (86400000.0 / ({rows} / {reps} + 1)) AS t, \
                      md5('cleanup-' || g) AS h \
               FROM generate_series($1::bigint, $2::bigint) AS g) AS r",
            day = first_day,
        ),
        rows,
    )
    .await?;
    eprintln!("cleanup: filled {rows} rows per layout in {table_fill:.1?} and {part_fill:.1?}");

    let inboxes = [
        Arc::new(Inbox::new(table.clone())),
        Arc::new(Inbox::new(partitioned.clone())),
    ];
    // Warm up both inboxes' connections and statements.
    for inbox in &inboxes {
        beside(inbox, async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok(())
        })
        .await?;
    }
    let mut measured: Vec<Measured> = variants
        .iter()
        .map(|&variant| Measured {
            variant,
            deleted: 0,
            steps: 0,
            total: Duration::ZERO,
            longest_step: Duration::ZERO,
            idle: Vec::new(),
            during: Vec::new(),
            p99_ratio: None,
        })
        .collect();
    let mut p99s: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); variants.len()];
    for rep in 0..reps {
        for (v, m) in measured.iter_mut().enumerate() {
            let inbox = match m.variant.layout() {
                Layout::Table => &inboxes[0],
                Layout::Partitioned => &inboxes[1],
            };
            let ((), mut idle_part) = beside(inbox, async {
                tokio::time::sleep(idle).await;
                Ok(())
            })
            .await?;
            let started = Instant::now();
            let ((deleted, steps, longest), mut during_part) = match m.variant {
                Variant::Rows(pacing) => {
                    let part = rep * pacings + v;
                    let cutoff = if part + 1 == parts {
                        Utc::now() - chrono::Duration::days(7)
                    } else {
                        oldest + span * i32::try_from(part + 1)? / i32::try_from(parts)?
                    };
                    beside(inbox, purge_rows(table, cutoff, pacing)).await?
                }
                Variant::DropDay => {
                    let day = first_day + chrono::Days::new(u64::try_from(rep)? + 1);
                    let cutoff = day.and_time(NaiveTime::MIN).and_utc();
                    beside(inbox, async {
                        let n = partitioned
                            .purge_processed_batch(cutoff, NonZeroU32::MIN)
                            .await?;
                        Ok((n, 1, started.elapsed()))
                    })
                    .await?
                }
            };
            m.total += started.elapsed();
            m.deleted += deleted;
            m.steps += steps;
            m.longest_step = m.longest_step.max(longest);
            eprintln!(
                "cleanup rep {rep} {}: {deleted} rows in {:.2?}, p99 idle {:.2?}, during {:.2?} ({} claims)",
                m.variant.label(),
                started.elapsed(),
                percentile(&mut idle_part, 0.99),
                percentile(&mut during_part, 0.99),
                during_part.len()
            );
            p99s[v]
                .0
                .push(percentile(&mut idle_part, 0.99).as_secs_f64());
            p99s[v]
                .1
                .push(percentile(&mut during_part, 0.99).as_secs_f64());
            m.idle.extend(idle_part);
            m.during.extend(during_part);
        }
    }
    for (m, (idle, during)) in measured.iter_mut().zip(&p99s) {
        m.p99_ratio = Spread::ratios(during, idle);
    }
    Ok(Cleanup {
        rows,
        fills: (table_fill, part_fill),
        measured,
    })
}

/// Deletes the plain table's rows before `cutoff` with `pacing`, through
/// the cleanup's own paced loop (`purge_processed_paced`, what
/// `inbox_runtime::cleanup_once` runs): rows deleted, batches, the
/// longest batch (the time from the end of one pause to the start of the
/// next).
async fn purge_rows(
    store: &SqlxStore,
    cutoff: chrono::DateTime<Utc>,
    pacing: Pacing,
) -> Result<(u64, u64, Duration), InboxError> {
    let batch_started = Arc::new(std::sync::Mutex::new(Instant::now()));
    let mut longest = Duration::ZERO;
    let mut batches = 1;
    let deleted = store
        .purge_processed_paced(cutoff, pacing.batch, || {
            let started = Arc::clone(&batch_started);
            if let Ok(at) = started.lock() {
                longest = longest.max(at.elapsed());
            }
            batches += 1;
            async move {
                tokio::time::sleep(pacing.pause).await;
                if let Ok(mut at) = started.lock() {
                    *at = Instant::now();
                }
            }
        })
        .await?;
    if let Ok(at) = batch_started.lock() {
        longest = longest.max(at.elapsed());
    }
    Ok((deleted, batches, longest))
}

/// "met" or "MISSED" for a ratio that must stay at most `target`: the
/// worst repetition decides.
fn verdict_at_most(spread: Option<Spread>, target: f64) -> &'static str {
    match spread {
        Some(s) if s.max <= target => "met",
        Some(s) if s.median <= target => "met by the median, MISSED by the worst repetition",
        Some(_) => "MISSED",
        None => "not measured",
    }
}

impl Cleanup {
    /// The Markdown section.
    pub(crate) fn markdown(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let mut out = format!(
            "### Cleanup at scale\n\n\
             {} expired processed rows in each layout: the plain table (inserted with \
             `generate_series` in {:.1} s) and the partitioned one (v7 ids over {} day \
             partitions, in {:.1} s). {CLAIMERS} tasks claim and commit fresh keys (`Inbox::handle`, \
             empty work) without pause, in {} repetitions of, for each cleanup below in turn, an \
             idle window and the cleanup of the next part of the rows (the oldest first); the p99 \
             ratio (during over idle) of each repetition is taken within it. Targets: at most \
             {TABLE_TARGET}× on the plain table, {PARTITIONED_TARGET}× on the partitioned one.\n\n\
             | cleanup | rows deleted | batches / days | total | rows/s | longest step \
             | claim p50 idle | claim p99 idle | claim p50 during | claim p99 during \
             | p99 ratio (all claims) | p99 ratio per repetition | target | |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
            self.rows,
            self.fills.0.as_secs_f64(),
            spread::reps(),
            self.fills.1.as_secs_f64(),
            spread::reps(),
        );
        let mut samples = String::new();
        for m in &self.measured {
            let (mut idle, mut during) = (m.idle.clone(), m.during.clone());
            let (idle_p99, during_p99) =
                (percentile(&mut idle, 0.99), percentile(&mut during, 0.99));
            out.push_str(&format!(
                "| {} | {} | {} | {:.1} s | {:.0} | {:.0} ms | {:.2} ms | {:.2} ms | {:.2} ms \
                 | {:.2} ms | {:.2} | {} | ≤ {} | {} |\n",
                m.variant.label(),
                m.deleted,
                m.steps,
                m.total.as_secs_f64(),
                m.deleted as f64 / m.total.as_secs_f64().max(1e-9),
                ms(m.longest_step),
                ms(percentile(&mut idle, 0.50)),
                ms(idle_p99),
                ms(percentile(&mut during, 0.50)),
                ms(during_p99),
                ms(during_p99) / ms(idle_p99).max(1e-9),
                spread::cell(m.p99_ratio, 2),
                m.variant.target(),
                verdict_at_most(m.p99_ratio, m.variant.target()),
            ));
            samples.push_str(&format!(
                "{}: {} idle, {} during; ",
                m.variant.label(),
                m.idle.len(),
                m.during.len()
            ));
        }
        out.push_str(&format!(
            "\n(claims sampled: {})\n",
            samples.trim_end_matches("; ")
        ));
        out
    }
}
