//! In-process counters of what the message path did, per consumer, and the
//! fault-injection hook.
//!
//! The Prometheus metrics are the operational view; these are what the demo
//! and the tests read back to prove their claims without scraping.

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use inbox_api::InboxKey;
use tokio::sync::watch;

use crate::AppError;
use crate::consumers::Role;

/// Counters of one consumer.
#[derive(Debug, Default)]
pub struct RoleTally {
    /// Deliveries whose work committed.
    pub processed: AtomicU64,
    /// Deliveries recognised as duplicates and acknowledged.
    pub duplicates: AtomicU64,
    /// Deliveries requeued for a later redelivery.
    pub requeued: AtomicU64,
    /// Attempts that failed with a retryable error and were retried in
    /// process.
    pub retried: AtomicU64,
    /// Injected crashes.
    pub crashes: AtomicU64,
    /// Redelivered deliveries (the broker's `redelivered` flag) that
    /// committed: work that a crash or a lost connection made run again.
    pub redelivered_processed: AtomicU64,
    /// Downstream calls that failed after commit.
    pub downstream_failed: AtomicU64,
    /// Batches committed in batched mode (each with one or more
    /// messages; see [`crate::batch`]).
    pub batches: AtomicU64,
    dead_lettered: Mutex<BTreeMap<String, u64>>,
}

impl RoleTally {
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

/// Counters of both consumers.
#[derive(Debug, Default)]
pub struct Tally {
    notification: RoleTally,
    carrier: RoleTally,
}

impl Tally {
    /// One consumer's counters.
    pub fn role(&self, role: Role) -> &RoleTally {
        match role {
            Role::Notification => &self.notification,
            Role::Carrier => &self.carrier,
        }
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

/// Fault injection, for the demo and the tests: off unless configured.
#[derive(Debug)]
pub struct Faults {
    crash_once: Mutex<HashSet<InboxKey>>,
    fail_always: Mutex<HashSet<InboxKey>>,
    /// Time the work spends inside the transaction, after its writes and
    /// before the commit (to make "killed mid-work" reproducible).
    pub work_delay: Duration,
    /// While true, work waits inside its transaction before the commit.
    hold: watch::Sender<bool>,
    /// Attempts currently waiting on the hold.
    held: AtomicU64,
}

impl Default for Faults {
    fn default() -> Self {
        Self::with_work_delay(Duration::ZERO)
    }
}

impl Faults {
    /// No faults, `work_delay` inside every transaction.
    pub fn with_work_delay(work_delay: Duration) -> Self {
        Self {
            crash_once: Mutex::new(HashSet::new()),
            fail_always: Mutex::new(HashSet::new()),
            work_delay,
            hold: watch::Sender::new(false),
            held: AtomicU64::new(0),
        }
    }

    /// The first attempt of `key` dies after its business writes, before
    /// the commit.
    pub fn crash_first_attempt(&self, key: InboxKey) {
        self.crash_once
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key);
    }

    /// Every attempt of `key` fails with a retryable error after its
    /// business writes (a poison message that looks transient).
    pub fn fail_always(&self, key: InboxKey) {
        self.fail_always
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key);
    }

    /// From now on, work stops inside its transaction, after its writes,
    /// until [`Faults::release`]: "mid-work", deterministically.
    pub fn hold(&self) {
        self.hold.send_replace(true);
    }

    /// Lets held work go on to its commit.
    pub fn release(&self) {
        self.hold.send_replace(false);
    }

    /// How many attempts wait on the hold right now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }

    /// Called inside the transaction after the work's writes.
    ///
    /// # Errors
    /// [`AppError::InjectedCrash`] once per key set by
    /// [`Faults::crash_first_attempt`].
    pub async fn before_commit(&self, key: &InboxKey) -> Result<(), AppError> {
        if !self.work_delay.is_zero() {
            tokio::time::sleep(self.work_delay).await;
        }
        if *self.hold.borrow() {
            self.held.fetch_add(1, Ordering::SeqCst);
            let mut hold = self.hold.subscribe();
            let _ = hold.wait_for(|held| !*held).await;
            self.held.fetch_sub(1, Ordering::SeqCst);
        }
        let crash = self
            .crash_once
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(key);
        if crash {
            return Err(AppError::InjectedCrash(key.to_string()));
        }
        let fail = self
            .fail_always
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(key);
        if fail {
            return Err(AppError::Inbox(inbox_api::InboxError::retryable_handler(
                format!("injected transient failure of {key}"),
            )));
        }
        Ok(())
    }
}
