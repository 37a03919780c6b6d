//! A relay's counters.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a relay did so far (read through its methods); the
/// metrics say the same to a dashboard, these to a test or a summary line.
#[derive(Debug, Default)]
pub struct RelayTally {
    /// Connections to the broker opened (more than one: it reconnected).
    pub(crate) connections: AtomicU64,
    /// Non-empty batches taken.
    pub(crate) batches: AtomicU64,
    /// Messages the broker confirmed.
    pub(crate) published: AtomicU64,
    /// Rows this relay's marks changed (a mark after a lost answer changes
    /// none).
    pub(crate) marked: AtomicU64,
    /// Messages the broker did not confirm.
    pub(crate) failed: AtomicU64,
    /// Refusals charged to their message (nack, returned): the part of
    /// `failed` that counts toward the dead-letter limit.
    pub(crate) refused: AtomicU64,
    /// Messages dead-lettered in the outbox.
    pub(crate) dead: AtomicU64,
}

impl RelayTally {
    /// Connections to the broker opened (more than one: it reconnected).
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// Non-empty batches taken.
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Messages the broker confirmed.
    pub fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }

    /// Rows this relay's marks changed (a mark after a lost answer changes
    /// none).
    pub fn marked(&self) -> u64 {
        self.marked.load(Ordering::Relaxed)
    }

    /// Messages the broker did not confirm.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    /// Refusals charged to their message (nack, returned): the part of
    /// `failed` that counts toward the dead-letter limit.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Messages dead-lettered in the outbox.
    pub fn dead(&self) -> u64 {
        self.dead.load(Ordering::Relaxed)
    }
}
