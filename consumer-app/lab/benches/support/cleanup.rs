//! Cleanup at scale: `rows` expired processed rows (inserted with
//! `generate_series`), purged with `purge_processed_batch` in bounded
//! batches, while a concurrent task claims and commits fresh keys. Reports
//! the purge's total time, its longest batch, and the claim+commit
//! latency (p50/p99) while idle and during the purge.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chrono::Utc;
use inbox_api::{ConsumerName, Inbox, InboxError, InboxKey, InboxStore, MessageId};
use inbox_backend_sqlx::sqlx;
use inbox_backend_sqlx::{SqlxStore, classify};

use super::spread::{self, Spread};

/// What the cleanup run measured.
#[derive(Debug)]
pub(crate) struct Cleanup {
    pub(crate) rows: u64,
    pub(crate) batch: NonZeroU32,
    pub(crate) deleted: u64,
    pub(crate) batches: u64,
    pub(crate) total: Duration,
    pub(crate) longest_batch: Duration,
    pub(crate) insert: Duration,
    pub(crate) idle_p50: Duration,
    pub(crate) idle_p99: Duration,
    pub(crate) purge_p50: Duration,
    pub(crate) purge_p99: Duration,
    /// The p99 during a purge over the p99 idle, per repetition.
    pub(crate) p99_ratio: Option<Spread>,
    pub(crate) idle_claims: usize,
    pub(crate) purge_claims: usize,
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

/// Runs the cleanup scenario on `store` (its inbox table is used as is).
pub(crate) async fn run(
    store: &SqlxStore,
    rows: u64,
    batch: NonZeroU32,
    idle: Duration,
) -> Result<Cleanup, InboxError> {
    // The newest row's processed_at is about `base` - 30 days.
    let base = Utc::now();
    let insert_started = Instant::now();
    // Expired 30 days ago, spread over an hour; ids from md5 so they are
    // distinct uuids.
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) \
         SELECT md5('cleanup-' || g)::uuid, 'bench-expired', \
                now() - interval '30 days' - g * interval '3 ms', \
                now() - interval '30 days' - g * interval '3 ms' \
         FROM generate_series(1, $1) AS g",
    )
    .bind(i64::try_from(rows).unwrap_or(i64::MAX))
    .execute(store.pool())
    .await
    .map_err(classify)?;
    sqlx::query("ANALYZE inbox_messages")
        .execute(store.pool())
        .await
        .map_err(classify)?;
    let insert = insert_started.elapsed();

    let inbox = Arc::new(Inbox::new(store.clone()));
    // Repetitions: idle, then the purge of the oldest 1/reps of the rows,
    // then idle again, the next part, and so on; each repetition's p99
    // ratio is taken within it.
    let reps = spread::reps();
    let span = chrono::Duration::milliseconds(i64::try_from(rows.saturating_mul(3)).unwrap_or(0));
    let oldest = base - chrono::Duration::days(30) - span;
    let (mut idle_samples, mut purge_samples) = (Vec::new(), Vec::new());
    let mut p99s: (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    let mut total = Duration::ZERO;
    let mut deleted = 0;
    let mut batches = 0;
    let mut longest = Duration::ZERO;
    for part in 1..=reps {
        // Idle: the claimer alone.
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(claimer(Arc::clone(&inbox), Arc::clone(&stop)));
        tokio::time::sleep(idle / u32::try_from(reps).unwrap_or(3)).await;
        stop.store(true, Ordering::Relaxed);
        let mut idle_part = task.await.map_err(|e| InboxError::InvalidArgument {
            message: format!("claimer: {e}"),
        })??;

        // During this part's purge (the last one: everything expired).
        let cutoff = if part == reps {
            Utc::now() - chrono::Duration::days(7)
        } else {
            oldest + span * i32::try_from(part).unwrap_or(1) / i32::try_from(reps).unwrap_or(3)
        };
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(claimer(Arc::clone(&inbox), Arc::clone(&stop)));
        let started = Instant::now();
        loop {
            let one = Instant::now();
            let n = store.purge_processed_batch(cutoff, batch).await?;
            longest = longest.max(one.elapsed());
            deleted += n;
            batches += 1;
            if n < u64::from(batch.get()) {
                break;
            }
        }
        total += started.elapsed();
        stop.store(true, Ordering::Relaxed);
        let mut purge_part = task.await.map_err(|e| InboxError::InvalidArgument {
            message: format!("claimer: {e}"),
        })??;
        p99s.0.push(percentile(&mut idle_part, 0.99).as_secs_f64());
        p99s.1.push(percentile(&mut purge_part, 0.99).as_secs_f64());
        idle_samples.extend(idle_part);
        purge_samples.extend(purge_part);
    }
    let p99_ratio = Spread::ratios(&p99s.1, &p99s.0);

    Ok(Cleanup {
        rows,
        batch,
        deleted,
        batches,
        total,
        longest_batch: longest,
        insert,
        idle_p50: percentile(&mut idle_samples, 0.50),
        idle_p99: percentile(&mut idle_samples, 0.99),
        purge_p50: percentile(&mut purge_samples, 0.50),
        purge_p99: percentile(&mut purge_samples, 0.99),
        p99_ratio,
        idle_claims: idle_samples.len(),
        purge_claims: purge_samples.len(),
    })
}

impl Cleanup {
    /// The Markdown section.
    pub(crate) fn markdown(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        format!(
            "### Cleanup at scale\n\n\
             {} expired processed rows (inserted with `generate_series` in {:.1} s), purged with \
             `purge_processed_batch` in batches of {} while one task claims and commits fresh keys \
             (`Inbox::handle`, empty work) without pause; in {} repetitions of an idle \
             window and the purge of the next part of the rows (the oldest first), the p99 \
             ratio of each taken within it.\n\n\
             | rows deleted | batches | total | rows/s | longest batch | claim p50 idle | claim p99 idle \
             | claim p50 during purge | claim p99 during purge | p99 ratio (all claims) \
             | p99 ratio per repetition |\n\
             |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n\
             | {} | {} | {:.1} s | {:.0} | {:.0} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} | {} |\n\n\
             (claims sampled: {} idle, {} during the purge)\n",
            self.rows,
            self.insert.as_secs_f64(),
            self.batch,
            spread::reps(),
            self.deleted,
            self.batches,
            self.total.as_secs_f64(),
            self.deleted as f64 / self.total.as_secs_f64().max(1e-9),
            ms(self.longest_batch),
            ms(self.idle_p50),
            ms(self.idle_p99),
            ms(self.purge_p50),
            ms(self.purge_p99),
            ms(self.purge_p99) / ms(self.idle_p99).max(1e-9),
            spread::cell(self.p99_ratio, 2),
            self.idle_claims,
            self.purge_claims,
        )
    }
}
