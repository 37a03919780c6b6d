//! In-process counters of what the message path did, per consumer.
//!
//! The Prometheus metrics are the operational view; these are what demos
//! and tests read back to prove their claims without scraping.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

/// Counters of one consumer.
#[derive(Debug, Default)]
pub struct ConsumerTally {
    /// Deliveries whose work committed.
    pub processed: AtomicU64,
    /// Deliveries recognised as duplicates and acknowledged.
    pub duplicates: AtomicU64,
    /// Deliveries requeued for a later redelivery.
    pub requeued: AtomicU64,
    /// Attempts that failed with a retryable error and were retried in
    /// process.
    pub retried: AtomicU64,
    /// Deliveries handed back uncharged because the store, not the message,
    /// failed (an outage, an unusable schema), or because consumption
    /// paused while the broker had already sent them.
    pub released: AtomicU64,
    /// Redelivered deliveries (the broker's `redelivered` flag) that
    /// committed: work that a crash or a lost connection made run again.
    pub redelivered_processed: AtomicU64,
    /// Downstream calls that failed after commit.
    pub downstream_failed: AtomicU64,
    /// Batches committed in batched mode (each with one or more
    /// messages).
    pub batches: AtomicU64,
    dead_lettered: Mutex<BTreeMap<String, u64>>,
}

impl ConsumerTally {
    /// Counts a dead-lettered delivery under `reason`.
    pub fn dead_letter(&self, reason: &str) {
        *self
            .dead_lettered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(reason.to_owned())
            .or_default() += 1;
    }

    /// Dead-lettered deliveries per reason.
    pub fn dead_lettered(&self) -> BTreeMap<String, u64> {
        self.dead_lettered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// All dead-lettered deliveries.
    pub fn dead_lettered_total(&self) -> u64 {
        self.dead_lettered().values().sum()
    }

    /// Processed plus duplicates plus dead-lettered: deliveries finished
    /// with an ack.
    pub fn finished(&self) -> u64 {
        self.processed.load(Ordering::Relaxed)
            + self.duplicates.load(Ordering::Relaxed)
            + self.dead_lettered_total()
    }
}

/// Counters of every consumer of a service, by consumer name.
#[derive(Debug, Default)]
pub struct Tally {
    consumers: BTreeMap<String, Arc<ConsumerTally>>,
}

impl Tally {
    /// Counters for `names`, all zero.
    pub(crate) fn new<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        Self {
            consumers: names
                .into_iter()
                .map(|name| (name.to_owned(), Arc::default()))
                .collect(),
        }
    }

    /// The counters of the consumer named `name` (all zero for a name the
    /// service does not run).
    pub fn consumer(&self, name: &str) -> &ConsumerTally {
        static NONE: LazyLock<ConsumerTally> = LazyLock::new(ConsumerTally::default);
        self.consumers.get(name).map_or(&*NONE, |tally| tally)
    }

    /// How many consumers it counts for.
    pub fn len(&self) -> usize {
        self.consumers.len()
    }

    /// Whether it counts for no consumer.
    pub fn is_empty(&self) -> bool {
        self.consumers.is_empty()
    }

    /// The consumer's counters to hand to its worker.
    pub(crate) fn shared(&self, name: &str) -> Arc<ConsumerTally> {
        self.consumers.get(name).cloned().unwrap_or_default()
    }
}

/// Reads a counter.
pub fn get(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// Adds one to a counter.
pub fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}
