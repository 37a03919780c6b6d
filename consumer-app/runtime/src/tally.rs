//! In-process counters of what the message path did, per consumer.
//!
//! The Prometheus metrics are the operational view; these are what demos
//! and tests read back to prove their claims without scraping. Read through
//! methods: the atomics are the runtime's to write.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

/// Counters of one consumer.
#[derive(Debug, Default)]
pub struct ConsumerTally {
    /// Deliveries whose work committed.
    pub(crate) processed: AtomicU64,
    /// Deliveries recognised as duplicates and acknowledged.
    pub(crate) duplicates: AtomicU64,
    /// Deliveries of a processed id with another payload, acknowledged and
    /// dropped ([`crate::settle::ConflictPolicy::Acknowledge`]).
    pub(crate) conflicts: AtomicU64,
    /// Deliveries requeued for a later redelivery.
    pub(crate) requeued: AtomicU64,
    /// Attempts that failed with a retryable error and were retried in
    /// process.
    pub(crate) retried: AtomicU64,
    /// Deliveries handed back uncharged because the store, not the message,
    /// failed (an outage, an unusable schema), or because consumption
    /// paused while the broker had already sent them.
    pub(crate) released: AtomicU64,
    /// Redelivered deliveries (the broker's `redelivered` flag) that
    /// committed: work that a crash or a lost connection made run again.
    pub(crate) redelivered_processed: AtomicU64,
    /// Downstream calls that failed after commit.
    pub(crate) downstream_failed: AtomicU64,
    /// Batches committed in batched mode (each with one or more
    /// messages).
    pub(crate) batches: AtomicU64,
    dead_lettered: Mutex<BTreeMap<String, u64>>,
}

impl ConsumerTally {
    /// Deliveries whose work committed.
    pub fn processed(&self) -> u64 {
        self.processed.load(Ordering::Relaxed)
    }

    /// Deliveries recognised as duplicates and acknowledged.
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }

    /// Deliveries of a processed id with another payload that were
    /// acknowledged and dropped; those dead-lettered instead count under
    /// [`ConsumerTally::dead_lettered`]'s `conflicting_duplicate`.
    pub fn conflicts(&self) -> u64 {
        self.conflicts.load(Ordering::Relaxed)
    }

    /// Deliveries requeued for a later redelivery.
    pub fn requeued(&self) -> u64 {
        self.requeued.load(Ordering::Relaxed)
    }

    /// Attempts that failed with a retryable error and were retried in
    /// process.
    pub fn retried(&self) -> u64 {
        self.retried.load(Ordering::Relaxed)
    }

    /// Deliveries handed back uncharged because the store, not the message,
    /// failed (an outage, an unusable schema), or because consumption
    /// paused while the broker had already sent them.
    pub fn released(&self) -> u64 {
        self.released.load(Ordering::Relaxed)
    }

    /// Redelivered deliveries (the broker's `redelivered` flag) that
    /// committed: work that a crash or a lost connection made run again.
    pub fn redelivered_processed(&self) -> u64 {
        self.redelivered_processed.load(Ordering::Relaxed)
    }

    /// Downstream calls that failed after commit.
    pub fn downstream_failed(&self) -> u64 {
        self.downstream_failed.load(Ordering::Relaxed)
    }

    /// Batches committed in batched mode (each with one or more
    /// messages).
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

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

    /// Processed, duplicates, acknowledged conflicts and dead-lettered:
    /// deliveries finished with an ack.
    pub fn finished(&self) -> u64 {
        self.processed() + self.duplicates() + self.conflicts() + self.dead_lettered_total()
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

/// Adds one to a counter.
pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}
