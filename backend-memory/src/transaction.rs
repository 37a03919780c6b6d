//! The transaction: claims held as pending rows, writes buffered until commit.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use inbox_api::{
    BatchTransaction, Claim, EnqueueOutcome, InboxError, InboxKey, InboxTransaction,
    OutboxTransaction, OutgoingMessage, ResponseTransaction,
};
use smallvec::SmallVec;

use crate::deadlock::{Aborted, TxId};
use crate::outbox::EnqueueAttempt;
use crate::store::{ClaimAttempt, Shared};
use crate::writes::Writes;
use tokio_sync::sync::futures::OwnedNotified;

/// A key this transaction claimed `Fresh`, and so holds.
#[derive(Debug)]
pub(crate) struct OwnClaim {
    pub(crate) key: InboxKey,
    /// Cached so commit and release need not hash the key again.
    pub(crate) shard: usize,
    /// Given back by `unclaim`: still held (as Postgres holds a deleted
    /// row's lock) until the transaction ends, but committed as nothing.
    pub(crate) given_back: bool,
    /// The response kept with the claim, committed with it.
    pub(crate) response: Option<Arc<[u8]>>,
}

/// The keys a transaction holds: inline for the usual one, so a message's
/// transaction allocates nothing for it.
pub(crate) type Claims = SmallVec<[OwnClaim; 1]>;

/// An open transaction of a [`crate::MemoryStore`].
///
/// Claims take effect at once as pending rows (that is what makes a
/// concurrent claim of the same key wait); business writes are buffered
/// here. [`InboxTransaction::commit`] publishes both atomically.
/// [`InboxTransaction::rollback`], or dropping the transaction unfinished
/// (a panicking or cancelled handler), releases the claims and discards the
/// writes synchronously, so no trace is left.
///
/// Reads are read-committed, like Postgres' default: [`MemoryTransaction::get`]
/// sees this transaction's own writes, and otherwise the latest committed
/// value.
pub struct MemoryTransaction {
    shared: Arc<Shared>,
    id: TxId,
    /// Usually one; searched linearly, newest first.
    claims: Claims,
    writes: Writes,
    /// Outgoing messages enqueued, with their enqueue time; published to
    /// the outbox at commit, like the writes.
    outgoing: Vec<(OutgoingMessage, DateTime<Utc>)>,
    /// Set when a claim was refused as a deadlock: Postgres aborts the whole
    /// transaction then, and so do we (claims released, writes dropped);
    /// only rollback or drop remain useful.
    aborted: bool,
    /// Open savepoints, oldest first.
    savepoints: Vec<Savepoint>,
    /// How many of `claims` are given back: zero on every path but a
    /// batch's failed message, so the others skip looking for them.
    given_back: usize,
    /// Positions in `claims` whose `given_back` flipped while a savepoint
    /// was open, oldest first: what rolling back to it undoes.
    flips: Vec<usize>,
    /// Responses replaced while a savepoint was open, oldest first: the
    /// claim's position and the response it had before.
    kept: Vec<(usize, Option<Arc<[u8]>>)>,
}

/// What a savepoint restores: the buffered writes as they were, and which
/// claims existed.
#[derive(Debug)]
struct Savepoint {
    /// A copy, not a journal: batches are small and writes few per message.
    writes: Writes,
    claims: usize,
    outgoing: usize,
    flips: usize,
    kept: usize,
}

impl MemoryTransaction {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        let id = shared.next_tx_id();
        Self {
            shared,
            id,
            claims: Claims::new(),
            writes: Writes::default(),
            outgoing: Vec::new(),
            aborted: false,
            given_back: 0,
            flips: Vec::new(),
            kept: Vec::new(),
            savepoints: Vec::new(),
        }
    }

    /// Buffers a business write of `value` under `key`, published at commit
    /// together with the claims. The last commit to write a key wins.
    pub fn put(&mut self, key: impl Into<String>, value: impl Into<Vec<u8>>) {
        self.writes.insert(key.into(), Some(value.into()));
    }

    /// Reads a business key: this transaction's own pending write or delete
    /// first, otherwise the committed value.
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        match self.writes.get(key) {
            Some(write) => write.clone(),
            None => self.shared.kv_get(key),
        }
    }

    /// Buffers the deletion of a business key, applied at commit.
    pub fn delete(&mut self, key: &str) {
        self.writes.insert(key.to_owned(), None);
    }

    fn ensure_open(&self) -> Result<(), InboxError> {
        if self.aborted {
            Err(InboxError::Conflict {
                source: Box::new(Aborted),
            })
        } else {
            Ok(())
        }
    }

    /// Removes one pending claim of this transaction and wakes its waiters.
    fn release_one(&self, claim: &OwnClaim) {
        let waiters = self
            .shared
            .lock_inbox(claim.shard)
            .release_claim(&claim.key, self.id);
        if let Some(notify) = waiters {
            notify.notify_waiters();
        }
    }

    /// Gives back the ids of outgoing messages this transaction will not
    /// commit, waking whoever waits to enqueue them.
    fn unreserve(&self, outgoing: &[(OutgoingMessage, DateTime<Utc>)]) {
        if outgoing.is_empty() {
            return;
        }
        let waiters: Vec<_> = {
            let mut outbox = self.shared.lock_outbox();
            outgoing
                .iter()
                .filter_map(|(message, _)| outbox.unreserve(&message.id(), self.id))
                .collect()
        };
        for notify in waiters {
            notify.notify_waiters();
        }
    }

    /// Waits until transaction `owner` ends (`released` resolves), unless
    /// waiting would close a cycle: then this transaction is aborted, as
    /// Postgres aborts a deadlock's victim (40P01), and the error says so.
    /// `what` names the key or id waited for, in the log.
    async fn wait_for(
        &mut self,
        owner: TxId,
        released: OwnedNotified,
        what: &(dyn fmt::Display + Sync),
    ) -> Result<(), InboxError> {
        let waited = match self.shared.waits.wait_for(self.id, owner) {
            Ok(edge) => {
                released.await;
                drop(edge);
                Ok(())
            }
            Err(deadlock) => Err(deadlock),
        };
        if let Err(deadlock) = waited {
            tracing::debug!(%what, tx = self.id, holder = owner, "deadlock: aborting transaction");
            self.release();
            self.aborted = true;
            return Err(InboxError::Conflict {
                source: Box::new(deadlock),
            });
        }
        Ok(())
    }

    /// Gives back, or takes again, the claim at `index`, undoably while a
    /// savepoint is open.
    fn flip(&mut self, index: usize) {
        self.toggle(index);
        if !self.savepoints.is_empty() {
            self.flips.push(index);
        }
    }

    /// Flips whether the claim at `index` is given back, keeping the count.
    fn toggle(&mut self, index: usize) {
        if let Some(claim) = self.claims.get_mut(index) {
            claim.given_back = !claim.given_back;
            if claim.given_back {
                self.given_back += 1;
            } else {
                self.given_back -= 1;
            }
        }
    }

    /// Sets the response of the claim at `index`, undoably while a
    /// savepoint is open.
    fn set_response(&mut self, index: usize, response: Option<Arc<[u8]>>) {
        if let Some(claim) = self.claims.get_mut(index) {
            let before = std::mem::replace(&mut claim.response, response);
            if !self.savepoints.is_empty() {
                self.kept.push((index, before));
            }
        }
    }

    /// The position of this transaction's claim of `key`, which `what`
    /// needs it to hold (claimed `Fresh`, not given back).
    fn held(&self, key: &InboxKey, what: &str) -> Result<usize, InboxError> {
        self.claims
            .iter()
            .rposition(|claim| !claim.given_back && claim.key == *key)
            .ok_or_else(|| InboxError::InvalidArgument {
                message: format!("{what}({key}): the key is not held by this transaction"),
            })
    }

    fn no_savepoint(&self) -> InboxError {
        InboxError::InvalidArgument {
            message: "no savepoint is open in this transaction".to_owned(),
        }
    }

    /// Removes this transaction's pending claims (waking whoever waits for
    /// them) and drops its writes. Synchronous, so `Drop` can call it.
    ///
    /// One shard at a time: unlike a commit, a release has nothing to make
    /// visible atomically.
    fn release(&mut self) {
        self.writes.clear();
        let outgoing = std::mem::take(&mut self.outgoing);
        self.unreserve(&outgoing);
        self.savepoints.clear();
        self.flips.clear();
        self.kept.clear();
        self.given_back = 0;
        let claims = std::mem::take(&mut self.claims);
        for claim in &claims {
            self.release_one(claim);
        }
    }
}

impl Drop for MemoryTransaction {
    fn drop(&mut self) {
        // After commit or rollback there is nothing left to release.
        self.release();
    }
}

impl fmt::Debug for MemoryTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryTransaction")
            .field("id", &self.id)
            .field("claims", &self.claims)
            .field("writes", &self.writes.len())
            .field("outgoing", &self.outgoing.len())
            .field("aborted", &self.aborted)
            .finish()
    }
}

#[async_trait]
impl InboxTransaction for MemoryTransaction {
    /// Inserts a pending row for `key`, or finds out why it cannot.
    ///
    /// A `Fresh` claim records the store clock as both `received_at` and
    /// `processed_at`; both become visible with the commit.
    ///
    /// Waiting does not block a thread: the claim sleeps on the holder's
    /// notification, taken under the shard lock, then takes the lock again
    /// and retries, exactly like Postgres re-checking a conflicting tuple
    /// after the inserting transaction ended.
    async fn claim(&mut self, key: &InboxKey) -> Result<Claim, InboxError> {
        self.ensure_open()?;
        if self.given_back > 0
            && let Some(index) = self
                .claims
                .iter()
                .rposition(|claim| claim.given_back && claim.key == *key)
        {
            // Postgres: the unclaim's DELETE left no row, so the insert
            // inserts again, keeping no response.
            self.flip(index);
            self.set_response(index, None);
            return Ok(Claim::Fresh);
        }
        let shard = self.shared.inbox_shard_of(key);
        loop {
            let now = self.shared.clock.now();
            // The guard is a temporary of this statement: no std lock is
            // ever held across the `.await` below.
            let attempt = self.shared.lock_inbox(shard).try_claim(key, self.id, now);
            let (owner, released) = match attempt {
                ClaimAttempt::Fresh => {
                    self.claims.push(OwnClaim {
                        key: key.clone(),
                        shard,
                        given_back: false,
                        response: None,
                    });
                    return Ok(Claim::Fresh);
                }
                ClaimAttempt::Duplicate => return Ok(Claim::Duplicate),
                ClaimAttempt::Wait { owner, released } => (owner, released),
            };
            self.wait_for(owner, released, key).await?;
        }
    }

    async fn commit(mut self) -> Result<(), InboxError> {
        if self.aborted {
            // Postgres would answer ROLLBACK to this COMMIT; say so loudly.
            return self.ensure_open();
        }
        let mut claims = std::mem::take(&mut self.claims);
        let given_back = if self.given_back > 0 {
            let (given_back, kept) = claims.into_iter().partition(|claim| claim.given_back);
            claims = kept;
            given_back
        } else {
            Claims::new()
        };
        let writes = std::mem::take(&mut self.writes);
        let outgoing = std::mem::take(&mut self.outgoing);
        self.shared.commit(self.id, claims, writes, outgoing);
        // The transaction has ended: whoever waits for a given-back key
        // finds no row and claims it.
        for claim in &given_back {
            self.release_one(claim);
        }
        Ok(())
    }

    async fn rollback(mut self) -> Result<(), InboxError> {
        self.release();
        Ok(())
    }
}

#[async_trait]
impl BatchTransaction for MemoryTransaction {
    async fn savepoint(&mut self) -> Result<(), InboxError> {
        self.ensure_open()?;
        self.savepoints.push(Savepoint {
            writes: self.writes.clone(),
            claims: self.claims.len(),
            outgoing: self.outgoing.len(),
            flips: self.flips.len(),
            kept: self.kept.len(),
        });
        Ok(())
    }

    /// Restores the writes and the claims given back since the newest
    /// savepoint, and releases the claims made since it (waking their
    /// waiters at once: nothing of theirs can commit any more).
    async fn rollback_to_savepoint(&mut self) -> Result<(), InboxError> {
        self.ensure_open()?;
        let savepoint = self.savepoints.pop().ok_or_else(|| self.no_savepoint())?;
        self.writes = savepoint.writes;
        let undone: Vec<usize> = self.flips.drain(savepoint.flips..).collect();
        for index in undone.into_iter().rev() {
            self.toggle(index);
        }
        let replaced: Vec<_> = self.kept.drain(savepoint.kept..).collect();
        for (index, before) in replaced.into_iter().rev() {
            if let Some(claim) = self.claims.get_mut(index) {
                claim.response = before;
            }
        }
        let keep = savepoint.outgoing.min(self.outgoing.len());
        let later: Vec<_> = self.outgoing.drain(keep..).collect();
        self.unreserve(&later);
        let keep = savepoint.claims.min(self.claims.len());
        let later: Claims = self.claims.drain(keep..).collect();
        for claim in &later {
            self.given_back -= usize::from(claim.given_back);
            self.release_one(claim);
        }
        Ok(())
    }

    async fn release_savepoint(&mut self) -> Result<(), InboxError> {
        self.ensure_open()?;
        self.savepoints.pop().ok_or_else(|| self.no_savepoint())?;
        if self.savepoints.is_empty() {
            // Nothing can roll back to before these flips any more.
            self.flips.clear();
            self.kept.clear();
        }
        Ok(())
    }

    /// Gives a claim back: it commits as nothing, yet stays held until the
    /// transaction ends, as Postgres keeps the lock of the row the unclaim
    /// deletes. So a concurrent claim of the key waits (this transaction
    /// may still roll back to a savepoint taken before the unclaim, which
    /// restores the claim) and finds no row once this transaction ends.
    async fn unclaim(&mut self, key: &InboxKey) -> Result<(), InboxError> {
        self.ensure_open()?;
        let position = self.held(key, "unclaim")?;
        self.flip(position);
        Ok(())
    }
}

#[async_trait]
impl ResponseTransaction for MemoryTransaction {
    /// Keeps `response` on this transaction's claim of `key`: published
    /// with the claim at commit, dropped with it on rollback.
    async fn keep_response(&mut self, key: &InboxKey, response: &[u8]) -> Result<(), InboxError> {
        self.ensure_open()?;
        let position = self.held(key, "keep_response")?;
        self.set_response(position, Some(Arc::from(response)));
        Ok(())
    }
}

#[async_trait]
impl OutboxTransaction for MemoryTransaction {
    /// Reserves the message's id and buffers the message, published to the
    /// outbox at commit together with the claims and writes, and discarded
    /// with them by a rollback or a drop. The enqueue time is the store
    /// clock's now.
    ///
    /// An id this transaction enqueued already, or one already committed,
    /// is [`EnqueueOutcome::AlreadyEnqueued`]. An id another open
    /// transaction enqueued makes this enqueue wait for it, as the primary
    /// key does on PostgreSQL: it commits, `AlreadyEnqueued`; it rolls back
    /// or is dropped, `Enqueued`. A wait that would close a cycle is a
    /// deadlock ([`InboxError::Conflict`]), and aborts this transaction.
    async fn enqueue(&mut self, message: &OutgoingMessage) -> Result<EnqueueOutcome, InboxError> {
        self.ensure_open()?;
        let id = message.id();
        loop {
            // The guard is a temporary of this statement: never held across
            // the await below.
            let attempt = self.shared.lock_outbox().try_reserve(id, self.id);
            let (owner, released) = match attempt {
                EnqueueAttempt::Fresh => {
                    self.outgoing
                        .push((message.clone(), self.shared.clock.now()));
                    return Ok(EnqueueOutcome::Enqueued);
                }
                EnqueueAttempt::Duplicate => return Ok(EnqueueOutcome::AlreadyEnqueued),
                EnqueueAttempt::Wait { owner, released } => (owner, released),
            };
            self.wait_for(owner, released, &id).await?;
        }
    }
}
