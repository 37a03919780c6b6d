//! How the claim's cost grows with the inbox table (issue 14 item 1).
//!
//! For random (v4) and for time-ordered (v7) ids, and for v7 ids in the
//! partitioned layout (the fill over its day partitions), one schema's inbox is
//! pre-filled with committed rows (`generate_series` in SQL, sorted by id
//! within each million so that the fill itself stays fast, then `VACUUM
//! ANALYZE`), size after size (by default 1,000,000 then 10,000,000;
//! `INBOX_BENCH_TABLE_SIZES` for others, 50,000,000 by hand). At each size
//! the filled table and an empty one (truncated before each of its slices,
//! so it stays empty) are measured side by side in interleaved slices, for
//! both drivers, per message (`Inbox::handle`, one new key, no work: claim
//! and commit) and batched (`Inbox::handle_batch`, K = 100), at
//! `INBOX_BENCH_TABLE_TASKS` (default 4) concurrent tasks, the claims using
//! ids of the same kind as the fill. Each size's ratio to the empty table
//! is taken within each repetition, as everywhere in the report.
//!
//! Printed beside each size: the table's and its indexes' sizes, and
//! whether the indexes fit in `shared_buffers` (when they do not, a random
//! id's claim may read its index page from outside PostgreSQL's cache).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use inbox_api::{ConsumerName, Handled, Inbox, InboxError, InboxKey, MessageId};
use inbox_backend_diesel::DieselStore;
use inbox_backend_sqlx::sqlx::{self, PgPool, postgres::PgPoolOptions};
use inbox_backend_sqlx::{Layout, SqlxStore};
use plotters::prelude::*;

use super::cleanup::percentile;
use super::e2e::BoxError;
use super::processed;
use super::spread::{self, Spread};

/// The claims' and the fill's kind of id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ids {
    /// Random: every claim lands on a random page of the primary key.
    V4,
    /// Time-ordered: claims append at the index's right edge.
    V7,
    /// Time-ordered, in the partitioned layout (`Layout::Partitioned`):
    /// the fill spread over its day partitions, the claims in today's.
    V7Partitioned,
}

impl Ids {
    const ALL: [Self; 3] = [Self::V7, Self::V4, Self::V7Partitioned];

    /// The short name, in schema names.
    fn name(self) -> &'static str {
        match self {
            Self::V4 => "v4",
            Self::V7 => "v7",
            Self::V7Partitioned => "v7p",
        }
    }

    /// The name in the report.
    fn label(self) -> &'static str {
        match self {
            Self::V4 => "v4",
            Self::V7 => "v7",
            Self::V7Partitioned => "v7 partitioned",
        }
    }

    fn layout(self) -> Layout {
        match self {
            Self::V4 | Self::V7 => Layout::Table,
            Self::V7Partitioned => Layout::Partitioned,
        }
    }

    fn new_id(self) -> MessageId {
        match self {
            Self::V4 => MessageId::from_uuid(uuid::Uuid::new_v4()),
            Self::V7 | Self::V7Partitioned => MessageId::new_v7(),
        }
    }

    /// The SQL of a fill row's id, from `t` (its timestamp) and `h` (an
    /// md5 in hex); v7: the 48-bit millisecond time, version 7, variant
    /// `10`, 74 bits of the md5.
    fn sql_id(self) -> &'static str {
        match self {
            Self::V4 => "gen_random_uuid()",
            Self::V7 | Self::V7Partitioned => {
                "(lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0') \
                 || '7' || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid"
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Driver {
    Sqlx,
    Diesel,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    PerMessage,
    Batched,
}

const K: usize = 100;
const DRIVERS: [Driver; 2] = [Driver::Sqlx, Driver::Diesel];
const MODES: [Mode; 2] = [Mode::PerMessage, Mode::Batched];

/// One schema's inbox through both drivers.
struct Table {
    schema: String,
    pool: PgPool,
    sqlx: Inbox<SqlxStore>,
    diesel: Inbox<DieselStore>,
    consumer: ConsumerName,
}

impl Table {
    async fn open(url: &str, schema: &str, tasks: usize, ids: Ids) -> Result<Self, BoxError> {
        let size = u32::try_from(tasks).unwrap_or(16) + 2;
        let options = SqlxStore::connect_options(url, schema)?.application_name(schema);
        let pool = PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await?;
        let store = SqlxStore::new(pool.clone(), schema)?.with_layout(ids.layout());
        store.migrate().await?;
        if ids.layout() == Layout::Partitioned {
            // The fill's 6 days before now, and today's claims.
            store.create_partitions(7, 1).await?;
        }
        let diesel = DieselStore::builder(url, schema)?
            .layout(ids.layout())
            .pool_size(tasks + 1)
            .wait_timeout(Duration::from_secs(30))
            .connect()
            .await?;
        diesel.migrate().await?;
        Ok(Self {
            schema: schema.to_owned(),
            pool,
            sqlx: Inbox::new(store),
            diesel: Inbox::new(diesel),
            consumer: ConsumerName::new("bench")?,
        })
    }

    /// Adds the committed rows `from..to` (1-based) of a fill whose
    /// timestamps spread over the 6 days before now up to row `horizon`.
    async fn fill(&self, ids: Ids, from: u64, to: u64, horizon: u64) -> Result<(), BoxError> {
        const CHUNK: u64 = 1_000_000;
        let mut start = from;
        while start <= to {
            let end = (start + CHUNK - 1).min(to);
            let insert = format!(
                "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at{flag}) \
                 SELECT {id}, $3, t, t{flag_value} FROM ( \
                   SELECT now() - interval '6 days' \
                            + (g::float8 / $4::float8) * interval '6 days' - interval '1 minute' AS t, \
                          md5(g::text || $5) AS h \
                   FROM generate_series($1::bigint, $2::bigint) AS g) AS r \
                 ORDER BY 1",
                id = ids.sql_id(),
                // The partitioned layout's partition key, from the id.
                flag = if ids.layout() == Layout::Partitioned {
                    ", time_ordered"
                } else {
                    ""
                },
                flag_value = if ids.layout() == Layout::Partitioned {
                    ", true"
                } else {
                    ""
                },
            );
            let mut tx = self.pool.begin().await?;
            sqlx::query("SET LOCAL work_mem = '256MB'")
                .execute(&mut *tx)
                .await?;
            sqlx::query(&insert)
                .bind(i64::try_from(start)?)
                .bind(i64::try_from(end)?)
                .bind(self.consumer.as_str())
                .bind(i64::try_from(horizon.max(1))?)
                .bind(&self.schema)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            start = end + 1;
        }
        sqlx::raw_sql("VACUUM ANALYZE inbox_messages")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn truncate(&self) -> Result<(), BoxError> {
        sqlx::raw_sql("TRUNCATE inbox_messages")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn sizes(&self) -> Result<Sizes, BoxError> {
        // A partitioned table's parent holds no data: summed over its
        // leaves (a plain table has no partition tree, hence the coalesce).
        let (table, pkey, indexes, buffers): (i64, i64, i64, i64) = sqlx::query_as(
            "SELECT coalesce((SELECT sum(pg_relation_size(relid))::int8 \
                     FROM pg_partition_tree('inbox_messages') WHERE isleaf), \
                     pg_relation_size('inbox_messages')), \
                    coalesce((SELECT sum(pg_relation_size(relid))::int8 \
                     FROM pg_partition_tree('inbox_messages_pkey') WHERE isleaf), \
                     pg_relation_size('inbox_messages_pkey')), \
                    coalesce((SELECT sum(pg_indexes_size(relid))::int8 \
                     FROM pg_partition_tree('inbox_messages') WHERE isleaf), \
                     pg_indexes_size('inbox_messages')), \
                    pg_size_bytes(current_setting('shared_buffers'))",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(Sizes {
            table,
            pkey,
            indexes,
            shared_buffers: buffers,
        })
    }

    /// One delivery (per message: one key; batched: `K` keys); how many
    /// messages were processed.
    async fn deliver(&self, driver: Driver, mode: Mode, ids: Ids) -> Result<u64, InboxError> {
        let key = || InboxKey::new(ids.new_id(), self.consumer.clone());
        match (driver, mode) {
            (Driver::Sqlx, Mode::PerMessage) => {
                let handled = self
                    .sqlx
                    .handle(&key(), async |_tx| Ok::<_, InboxError>(()))
                    .await?;
                Ok(u64::from(matches!(handled, Handled::Processed(()))))
            }
            (Driver::Diesel, Mode::PerMessage) => {
                let handled = self
                    .diesel
                    .handle(&key(), async |_tx| Ok::<_, InboxError>(()))
                    .await?;
                Ok(u64::from(matches!(handled, Handled::Processed(()))))
            }
            (Driver::Sqlx, Mode::Batched) => {
                let items = (0..K).map(|_| (key(), ())).collect();
                let outcomes = self
                    .sqlx
                    .handle_batch(items, async |_tx, (): &()| Ok::<_, InboxError>(()))
                    .await;
                processed(outcomes)
            }
            (Driver::Diesel, Mode::Batched) => {
                let items = (0..K).map(|_| (key(), ())).collect();
                let outcomes = self
                    .diesel
                    .handle_batch(items, async |_tx, (): &()| Ok::<_, InboxError>(()))
                    .await;
                processed(outcomes)
            }
        }
    }

    async fn close(self) {
        inbox_runtime::shutdown::bounded("close a table-size pool", self.pool.close()).await;
    }
}

/// A table's size on disk.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    table: i64,
    pkey: i64,
    indexes: i64,
    shared_buffers: i64,
}

/// What one (table, driver, mode) did over a measurement.
#[derive(Clone, Debug, Default)]
struct Series {
    /// Messages/s per repetition.
    reps: Vec<f64>,
    /// Latency of each delivery (one claim+commit, or one batch).
    latencies: Vec<Duration>,
}

/// Runs `tasks` tasks delivering to `table` for `span`.
async fn slice(
    table: &Arc<Table>,
    driver: Driver,
    mode: Mode,
    ids: Ids,
    tasks: usize,
    span: Duration,
) -> Result<(u64, Duration, Vec<Duration>), BoxError> {
    let processed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + span;
    let workers: Vec<_> = (0..tasks)
        .map(|_| {
            let (table, processed) = (Arc::clone(table), Arc::clone(&processed));
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                while Instant::now() < deadline {
                    let one = Instant::now();
                    let n = table.deliver(driver, mode, ids).await?;
                    latencies.push(one.elapsed());
                    processed.fetch_add(n, Ordering::Relaxed);
                }
                Ok::<_, InboxError>(latencies)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for worker in workers {
        latencies.extend(worker.await??);
    }
    Ok((
        processed.load(Ordering::Relaxed),
        started.elapsed(),
        latencies,
    ))
}

/// The cells of one measurement: (empty?, driver, mode).
fn cells() -> Vec<(bool, Driver, Mode)> {
    let mut cells = Vec::new();
    for empty in [true, false] {
        for driver in DRIVERS {
            for mode in MODES {
                cells.push((empty, driver, mode));
            }
        }
    }
    cells
}

/// Measures the empty and the filled table side by side: rounds of one
/// slice per cell, the order rotated per round, grouped into repetitions.
async fn measure(
    empty: &Arc<Table>,
    filled: &Arc<Table>,
    ids: Ids,
    tasks: usize,
    secs: f64,
) -> Result<Vec<Series>, BoxError> {
    let cells = cells();
    let reps = spread::reps();
    let rounds = ((secs / 0.25).round() as usize).max(reps).div_ceil(reps) * reps;
    let span = Duration::from_secs_f64(secs / rounds as f64);
    let mut done = vec![vec![(0_u64, Duration::ZERO); reps]; cells.len()];
    let mut series = vec![Series::default(); cells.len()];
    for round in 0..rounds {
        let rep = round * reps / rounds;
        for k in 0..cells.len() {
            let i = (k + round) % cells.len();
            let (is_empty, driver, mode) = cells[i];
            let table = if is_empty {
                empty.truncate().await?;
                empty
            } else {
                filled
            };
            let (n, elapsed, latencies) = slice(table, driver, mode, ids, tasks, span).await?;
            done[i][rep].0 += n;
            done[i][rep].1 += elapsed;
            series[i].latencies.extend(latencies);
        }
    }
    for (i, per_rep) in done.iter().enumerate() {
        series[i].reps = per_rep
            .iter()
            .map(|(n, t)| *n as f64 / t.as_secs_f64())
            .collect();
    }
    Ok(series)
}

/// One measured size of one kind of id.
struct Measured {
    ids: Ids,
    rows: u64,
    fill: Duration,
    sizes: Sizes,
    /// Per [`cells`].
    series: Vec<Series>,
}

/// What the table-size mode measured.
pub(crate) struct TableSize {
    tasks: usize,
    secs: f64,
    measured: Vec<Measured>,
}

/// The sizes to pre-fill (`INBOX_BENCH_TABLE_SIZES`, comma-separated; the
/// empty table is always the baseline); empty: skip the mode.
pub(crate) fn sizes_from_env() -> Vec<u64> {
    let mut sizes: Vec<u64> = std::env::var("INBOX_BENCH_TABLE_SIZES").ok().map_or_else(
        || vec![1_000_000, 10_000_000],
        |v| {
            v.split(',')
                .filter_map(|s| s.trim().replace('_', "").parse().ok())
                .filter(|n| *n > 0)
                .collect()
        },
    );
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

/// The schemas the mode creates under `base` (dropped by the mode, and by
/// the report's own cleanup should it fail half way).
pub(crate) fn schemas(base: &str) -> Vec<String> {
    Ids::ALL
        .iter()
        .flat_map(|ids| {
            [
                format!("{base}_t{}_empty", ids.name()),
                format!("{base}_t{}_filled", ids.name()),
            ]
        })
        .collect()
}

/// Runs the mode; `sizes` ascending and non-empty.
pub(crate) async fn run(url: &str, base: &str, sizes: &[u64]) -> Result<TableSize, BoxError> {
    let tasks = std::env::var("INBOX_BENCH_TABLE_TASKS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(4);
    let secs = std::env::var("INBOX_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .unwrap_or(2.0);
    let horizon = sizes.iter().copied().max().unwrap_or(1);
    let mut measured = Vec::new();
    for ids in Ids::ALL {
        let empty =
            Arc::new(Table::open(url, &format!("{base}_t{}_empty", ids.name()), tasks, ids).await?);
        let filled = Arc::new(
            Table::open(url, &format!("{base}_t{}_filled", ids.name()), tasks, ids).await?,
        );
        let mut rows = 0;
        let result = async {
            for &size in sizes {
                let started = Instant::now();
                filled.fill(ids, rows + 1, size, horizon).await?;
                let fill = started.elapsed();
                rows = size;
                let sizes = filled.sizes().await?;
                eprintln!(
                    "table size {} {size}: filled in {fill:.1?}, {sizes:?}",
                    ids.name()
                );
                // Warm up both tables' connections and statements.
                for (is_empty, driver, mode) in cells() {
                    let table = if is_empty { &empty } else { &filled };
                    slice(table, driver, mode, ids, tasks, Duration::from_millis(200)).await?;
                }
                let series = measure(&empty, &filled, ids, tasks, secs).await?;
                for (cell, s) in cells().iter().zip(&series) {
                    eprintln!("table size {} {size} {cell:?}: {:.0?}", ids.name(), s.reps);
                }
                measured.push(Measured {
                    ids,
                    rows: size,
                    fill,
                    sizes,
                    series,
                });
            }
            Ok::<(), BoxError>(())
        }
        .await;
        for table in [empty, filled] {
            let schema = table.schema.clone();
            let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
            if let Err(error) = sqlx::query(&drop).execute(&table.pool).await {
                eprintln!("could not drop {schema}: {error}");
            }
            if let Ok(table) = Arc::try_unwrap(table) {
                table.close().await;
            }
        }
        result?;
    }
    Ok(TableSize {
        tasks,
        secs,
        measured,
    })
}

fn mib(bytes: i64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl TableSize {
    fn index(empty: bool, driver: Driver, mode: Mode) -> usize {
        cells()
            .iter()
            .position(|c| *c == (empty, driver, mode))
            .unwrap_or(0)
    }

    /// The Markdown section.
    pub(crate) fn markdown(&self) -> String {
        use std::fmt::Write as _;
        let mut out = format!(
            "### Claim cost against table size\n\n\
             The inbox pre-filled with committed rows of one consumer (`generate_series`, \
             then `VACUUM ANALYZE`), against an empty inbox measured in the same \
             interleaved slices ({} s per cell, {} repetitions, {} tasks): per message \
             (`Inbox::handle`, claim and commit of a new id, no work) and batched \
             (`Inbox::handle_batch`, K = {K}); claims use ids of the fill's kind. \
             Latency: of one claim+commit, or of one batch. Ratios: median \
             (lowest–highest) of the repetitions; target at 10,000,000 rows: ≥ 0.8 × \
             the empty table's rate. The chart is \
             [benchmark-table-size.svg](benchmark-table-size.svg).\n\n\
             | ids | rows | fill | table | PK index | all indexes | indexes in shared_buffers | driver \
             | per message msg/s | ratio to empty | p50 / p99 | batched msg/s | ratio to empty \
             | batch p50 / p99 |\n\
             |---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|\n",
            self.secs,
            spread::reps(),
            self.tasks
        );
        let mut targets = String::new();
        for ids in Ids::ALL {
            let of_ids: Vec<&Measured> = self.measured.iter().filter(|m| m.ids == ids).collect();
            // The empty table's row: every measurement of this kind pooled.
            for driver in DRIVERS {
                let mut cols = Vec::new();
                for mode in MODES {
                    let i = Self::index(true, driver, mode);
                    let rates: Vec<f64> = of_ids
                        .iter()
                        .flat_map(|m| m.series[i].reps.clone())
                        .collect();
                    let mut lat: Vec<Duration> = of_ids
                        .iter()
                        .flat_map(|m| m.series[i].latencies.clone())
                        .collect();
                    cols.push(format!(
                        "{} | | {:.2} / {:.2} ms",
                        spread::cell(Spread::of(rates), 0),
                        ms(percentile(&mut lat, 0.5)),
                        ms(percentile(&mut lat, 0.99))
                    ));
                }
                let _ = writeln!(
                    out,
                    "| {} | 0 | | | | | | {driver:?} | {} | {} |",
                    ids.label(),
                    cols[0],
                    cols[1]
                );
            }
            for m in &of_ids {
                let fits = if m.sizes.indexes <= m.sizes.shared_buffers {
                    "yes"
                } else {
                    "no"
                };
                for driver in DRIVERS {
                    let mut cols = Vec::new();
                    for mode in MODES {
                        let e = Self::index(true, driver, mode);
                        let f = Self::index(false, driver, mode);
                        let ratio = Spread::ratios(&m.series[f].reps, &m.series[e].reps);
                        let mut lat = m.series[f].latencies.clone();
                        cols.push(format!(
                            "{} | {} | {:.2} / {:.2} ms",
                            spread::cell(Spread::of(m.series[f].reps.iter().copied()), 0),
                            spread::cell(ratio, 2),
                            ms(percentile(&mut lat, 0.5)),
                            ms(percentile(&mut lat, 0.99))
                        ));
                        if m.rows == 10_000_000 {
                            let _ = writeln!(
                                targets,
                                "| {} ids, {driver:?}, {} | {} | {} |",
                                ids.label(),
                                match mode {
                                    Mode::PerMessage => "per message",
                                    Mode::Batched => "batched K=100",
                                },
                                spread::cell(ratio, 2),
                                spread::verdict(ratio, 0.8)
                            );
                        }
                    }
                    let _ = writeln!(
                        out,
                        "| {} | {} | {:.1} s | {} | {} | {} | {fits} ({} shared_buffers) | {driver:?} | {} | {} |",
                        ids.label(),
                        m.rows,
                        m.fill.as_secs_f64(),
                        mib(m.sizes.table),
                        mib(m.sizes.pkey),
                        mib(m.sizes.indexes),
                        mib(m.sizes.shared_buffers),
                        cols[0],
                        cols[1]
                    );
                }
            }
        }
        if !targets.is_empty() {
            let _ = write!(
                out,
                "\n| target: rate at 10,000,000 rows ≥ 0.8 × empty | ratio | |\n|---|---:|---|\n{targets}"
            );
        }
        out
    }

    /// Rate against table size: one line per kind of id, driver and mode
    /// (medians), log scale.
    pub(crate) fn svg(&self) -> Result<String, String> {
        let mut sizes: Vec<u64> = vec![0];
        sizes.extend(self.measured.iter().map(|m| m.rows));
        sizes.sort_unstable();
        sizes.dedup();
        let label = |rows: u64| match rows {
            0 => "empty".to_owned(),
            r if r >= 1_000_000 => format!("{}M", r / 1_000_000),
            r => format!("{r}"),
        };
        let mut lines: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for ids in Ids::ALL {
            for driver in DRIVERS {
                for mode in MODES {
                    let e = Self::index(true, driver, mode);
                    let f = Self::index(false, driver, mode);
                    let of_ids: Vec<&Measured> =
                        self.measured.iter().filter(|m| m.ids == ids).collect();
                    let mut points = Vec::new();
                    let empty = Spread::of(of_ids.iter().flat_map(|m| m.series[e].reps.clone()));
                    if let Some(s) = empty {
                        points.push((0.0, s.median));
                    }
                    for m in &of_ids {
                        let x = sizes.iter().position(|s| *s == m.rows).unwrap_or(0);
                        if let Some(s) = Spread::of(m.series[f].reps.iter().copied()) {
                            points.push((x as f64, s.median));
                        }
                    }
                    let name = format!(
                        "{} ids, {driver:?}, {}",
                        ids.label(),
                        match mode {
                            Mode::PerMessage => "per message",
                            Mode::Batched => "batched K=100",
                        }
                    );
                    lines.push((name, points));
                }
            }
        }
        let max = lines
            .iter()
            .flat_map(|(_, p)| p.iter().map(|(_, y)| *y))
            .fold(10.0_f64, f64::max);
        let min = lines
            .iter()
            .flat_map(|(_, p)| p.iter().map(|(_, y)| *y))
            .fold(max, f64::min)
            .max(1.0);
        let mut out = String::new();
        {
            let root = SVGBackend::with_string(&mut out, (900, 520)).into_drawing_area();
            root.fill(&WHITE).map_err(|e| e.to_string())?;
            let n = sizes.len().max(2) as f64 - 1.0;
            let mut chart = ChartBuilder::on(&root)
                .caption(
                    "Claim+commit rate against inbox table size (medians, one run)",
                    ("sans-serif", 18),
                )
                .margin(10)
                .x_label_area_size(40)
                .y_label_area_size(70)
                .build_cartesian_2d(-0.2_f64..n + 0.2, (min / 2.0..max * 2.0).log_scale())
                .map_err(|e| e.to_string())?;
            let sizes_for_labels = sizes.clone();
            chart
                .configure_mesh()
                .x_desc("rows in the inbox")
                .y_desc("messages/s (log scale)")
                .x_labels(sizes.len() * 2 + 1)
                .x_label_formatter(&|x| {
                    let i = x.round();
                    if (x - i).abs() < 0.01 && i >= 0.0 {
                        sizes_for_labels
                            .get(i as usize)
                            .map_or_else(String::new, |r| label(*r))
                    } else {
                        String::new()
                    }
                })
                .draw()
                .map_err(|e| e.to_string())?;
            for (k, (name, points)) in lines.into_iter().enumerate() {
                let colour = Palette99::pick(k).to_rgba();
                let style = if k % 2 == 0 {
                    colour.stroke_width(2)
                } else {
                    colour.stroke_width(1)
                };
                chart
                    .draw_series(LineSeries::new(points.clone(), style))
                    .map_err(|e| e.to_string())?
                    .label(name)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 15, y)], colour.stroke_width(2))
                    });
                chart
                    .draw_series(
                        points
                            .into_iter()
                            .map(|p| Circle::new(p, 3, colour.filled())),
                    )
                    .map_err(|e| e.to_string())?;
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::LowerLeft)
                .draw()
                .map_err(|e| e.to_string())?;
            root.present().map_err(|e| e.to_string())?;
        }
        Ok(out)
    }
}
