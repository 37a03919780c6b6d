//! Crash points for the outbox relay: an [`OutboxStore`] decorator that the
//! lab's relay binary (`parcel-lab-relay`) puts between the real
//! [`Relay`](inbox_runtime::relay::Relay) and its store.
//!
//! The relay's round is take → publish → await confirms → mark. The two
//! windows where a crash matters are reached through the store: right
//! after [`OutboxStore::take_pending`] returned a lease (the messages are
//! committed and leased, nothing is published yet) and right before
//! [`OutboxStore::mark_published`] (the broker confirmed them, the store
//! does not know). A decorator reaches both without a hook in the
//! production relay. A crash is `std::process::exit(CRASH_EXIT)`: no
//! destructor runs, so neither the AMQP connection nor the database
//! session is closed politely, as with `kill -9`; the distinct status lets
//! the harness count crash points apart from real crashes.
//!
//! The decisions are drawn from a seeded generator, so that one harness
//! seed replays the same crash points (as far as the rounds' timing does).

use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use inbox_api::{
    InboxError, InboxKey, InboxRecord, InboxStore, MessageId, OutboxLease, OutboxRecord,
    OutboxStore,
};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};

use crate::broken::BrokenRelay;

/// The exit status of a deliberate crash point (not a real crash).
pub const CRASH_EXIT: i32 = 86;

/// Where and how often the relay crashes.
#[derive(Clone, Copy, Debug, Default)]
pub struct CrashPoints {
    /// Probability, per non-empty lease, of dying right after the take.
    pub after_take: f64,
    /// Probability, per mark, of dying right before it (after the confirms).
    pub before_mark: f64,
    /// The generator's seed.
    pub seed: u64,
}

/// `S` with crash points, and optionally broken the way a
/// [`BrokenRelay`] says.
pub struct FaultyOutbox<S> {
    inner: S,
    points: CrashPoints,
    broken: Option<BrokenRelay>,
    /// Behind a mutex only so that the store stays `Sync`; one draw per
    /// round, never contended.
    rng: std::sync::Arc<Mutex<StdRng>>,
}

impl<S: Clone> Clone for FaultyOutbox<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            points: self.points,
            broken: self.broken,
            rng: std::sync::Arc::clone(&self.rng),
        }
    }
}

impl<S> FaultyOutbox<S> {
    /// `inner` with these crash points; `broken` makes the relay's store
    /// use broken on purpose (the harness must then report a violation).
    pub fn new(inner: S, points: CrashPoints, broken: Option<BrokenRelay>) -> Self {
        Self {
            inner,
            points,
            broken,
            rng: std::sync::Arc::new(Mutex::new(StdRng::seed_from_u64(points.seed))),
        }
    }

    /// Dies here with probability `p`, saying where.
    fn maybe_crash(&self, p: f64, point: &str, ids: &[MessageId]) {
        if p <= 0.0 {
            return;
        }
        let draw: f64 = self
            .rng
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .random();
        if draw < p {
            tracing::warn!(point, messages = ids.len(), first = ?ids.first().map(ToString::to_string),
                "relay crash point: exiting without any cleanup (fault injection)");
            std::process::exit(CRASH_EXIT);
        }
    }
}

#[async_trait]
impl<S: InboxStore> InboxStore for FaultyOutbox<S> {
    type Transaction = S::Transaction;

    async fn begin(&self) -> Result<Self::Transaction, InboxError> {
        self.inner.begin().await
    }

    async fn lookup(&self, key: &InboxKey) -> Result<Option<InboxRecord>, InboxError> {
        self.inner.lookup(key).await
    }

    async fn purge_processed_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.inner.purge_processed_batch(cutoff, limit).await
    }

    async fn purge_processed_batch_from(
        &self,
        cutoff: DateTime<Utc>,
        from: Option<DateTime<Utc>>,
        limit: NonZeroU32,
    ) -> Result<inbox_api::PurgedBatch, InboxError> {
        self.inner
            .purge_processed_batch_from(cutoff, from, limit)
            .await
    }
}

#[async_trait]
impl<S: OutboxStore> OutboxStore for FaultyOutbox<S> {
    async fn take_pending(
        &self,
        limit: NonZeroU32,
        lease: Duration,
    ) -> Result<OutboxLease, InboxError> {
        let taken = self.inner.take_pending(limit, lease).await?;
        if taken.is_empty() {
            return Ok(taken);
        }
        let ids = taken.ids();
        if self.broken == Some(BrokenRelay::MarkBeforeConfirm) {
            // The broken order: published in the store's eyes before the
            // broker has even seen them.
            self.inner.mark_published(&ids).await?;
        }
        self.maybe_crash(self.points.after_take, "after take, before publish", &ids);
        Ok(taken)
    }

    async fn mark_published(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        self.maybe_crash(self.points.before_mark, "after confirm, before mark", ids);
        self.inner.mark_published(ids).await
    }

    async fn release(&self, lease: &OutboxLease) -> Result<u64, InboxError> {
        self.inner.release(lease).await
    }

    async fn lookup_outgoing(&self, id: &MessageId) -> Result<Option<OutboxRecord>, InboxError> {
        self.inner.lookup_outgoing(id).await
    }

    async fn pending_count(&self) -> Result<u64, InboxError> {
        self.inner.pending_count().await
    }

    async fn dead_count(&self) -> Result<u64, InboxError> {
        self.inner.dead_count().await
    }

    async fn purge_published_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.inner.purge_published_batch(cutoff, limit).await
    }

    async fn record_refusals(
        &self,
        lease: &inbox_api::LeaseId,
        refusals: &[(MessageId, String)],
        retry: &inbox_api::PublishRetry,
    ) -> Result<inbox_api::Refused, InboxError> {
        self.inner.record_refusals(lease, refusals, retry).await
    }

    async fn dead_outgoing(&self, limit: NonZeroU32) -> Result<Vec<OutboxRecord>, InboxError> {
        self.inner.dead_outgoing(limit).await
    }

    async fn requeue_dead(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        self.inner.requeue_dead(ids).await
    }
}
