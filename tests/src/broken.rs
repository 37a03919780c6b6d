//! Deliberately broken stores: the suite must reject every one of them.
//!
//! Each wraps a correct store and breaks one promise the way real inboxes
//! have broken it. They are generic wrappers, so they break any backend the
//! same way; this crate's tests run them over the memory backend and assert
//! that both the contract tests and the crash-point model fail.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use std::num::NonZeroU32;

use inbox_api::{
    AttemptLedger, AttemptRecord, BatchTransaction, Claim, ConsumerName, EnqueueOutcome,
    InboxError, InboxKey, InboxRecord, InboxStats, InboxStore, InboxTransaction, LastError,
    MessageId, OutboxLease, OutboxRecord, OutboxStore, OutboxTransaction, OutgoingMessage,
    ResponseStore, ResponseTransaction,
};

use crate::{CrashKind, Harness, LedgerHarness, OutboxHarness, TxOf};

/// A partitioned inbox layout broken on purpose, for the Postgres
/// backends: the partition is chosen by arrival time (`received_at`)
/// instead of by the id. PostgreSQL then wants the arrival time in the
/// primary key, so a duplicate that arrives later is a new row (in its own
/// arrival's partition, or beside its first copy) and never meets the first
/// copy: each delivery is `Fresh`. Run it, one statement, on a side
/// connection in the schema of a migrated partitioned store; the contract
/// suite must then fail (`contract::run_all`).
pub const LAYOUT_PARTITIONED_BY_ARRIVAL: &str = "DO $$ BEGIN \
     DROP TABLE inbox_messages CASCADE; \
     CREATE TABLE inbox_messages ( \
         id uuid NOT NULL, consumer_type varchar(500) NOT NULL, \
         received_at timestamptz NOT NULL DEFAULT now(), processed_at timestamptz, \
         time_ordered boolean NOT NULL, payload_fingerprint bytea, response bytea, \
         PRIMARY KEY (id, consumer_type, received_at)) PARTITION BY RANGE (received_at); \
     CREATE TABLE inbox_messages_by_arrival PARTITION OF inbox_messages DEFAULT; \
     CREATE INDEX inbox_messages_processed_at_idx ON inbox_messages (processed_at) \
         WHERE processed_at IS NOT NULL; \
     END $$";

fn lock_unflushed(
    unflushed: &Mutex<Vec<(InboxKey, LastError)>>,
) -> std::sync::MutexGuard<'_, Vec<(InboxKey, LastError)>> {
    unflushed
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Which promise the store breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Broken {
    /// Reads committed state, and if the key is absent inserts it without
    /// looking at the insert's outcome: two concurrent first deliveries both
    /// pass the check (MassTransit before PR #3617).
    CheckThenInsert,
    /// Commits the claim in a transaction of its own before the work: a
    /// crash after the claim loses the message for good.
    ClaimInOwnTransaction,
    /// Does the work first and claims at the end, just before COMMIT,
    /// keeping the work even when the late claim finds a duplicate.
    WorkBeforeClaim,
    /// Treats a key claimed by another *open* transaction as done instead of
    /// waiting for it: if that transaction rolls back, the message is lost.
    ClaimWithoutWaiting,
    /// Claims without the key's payload fingerprint (a store whose claim
    /// never binds it): a copy with another payload passes as a duplicate,
    /// without a word.
    ForgetsFingerprints,
    /// Answers a batch claim with the claims of the fresh keys only (a
    /// `RETURNING` read as the whole answer): the claims no longer line up
    /// with the keys, and a batch that trusted them would run one message's
    /// work for another.
    ClaimBatchAnswersFreshOnly,
    /// An outbox whose enqueue commits in a transaction of its own, before
    /// the business transaction: the message is published even when the
    /// business writes roll back (a producer that publishes before COMMIT).
    PublishBeforeCommit,
    /// An outbox whose relay ignores other relays' leases: a message a live
    /// lease holds is handed to the next relay too (a take without
    /// `SKIP LOCKED` and without `locked_until`).
    LeaseIgnored,
    /// An attempt ledger that forgets: every failure answers "the first",
    /// so a message failing for ever never reaches the delivery cap on a
    /// queue without a broker count.
    LedgerForgetsCounts,
    /// An attempt ledger that writes its count in the consumer's
    /// transaction: the failed attempt rolls back, and the count with it.
    LedgerInFailedTransaction,
    /// Keeps an idempotent endpoint's response outside the transaction
    /// (a response cache beside the database): a reader sees it before
    /// the work commits, and it outlives a rollback, so a retry is
    /// answered with the response of work that never happened.
    ResponseOutsideTransaction,
}

impl Broken {
    /// Every store with a broken inbox: the inbox suite must reject each.
    pub const ALL: [Broken; 4] = [
        Broken::CheckThenInsert,
        Broken::ClaimInOwnTransaction,
        Broken::WorkBeforeClaim,
        Broken::ClaimWithoutWaiting,
    ];

    /// Every store whose inbox deduplicates soundly but forgets what a
    /// message said: the contract tests and the crash-point models (whose
    /// schedules publish copies with other payloads) must reject each.
    pub const FINGERPRINTS: [Broken; 1] = [Broken::ForgetsFingerprints];

    /// Every store whose single claims are sound and whose batch claim is
    /// not: the contract tests and the batched crash-point model must
    /// reject each.
    pub const BATCH: [Broken; 1] = [Broken::ClaimBatchAnswersFreshOnly];

    /// Every store with a broken outbox (its inbox is sound): the outbox
    /// suite must reject each.
    pub const OUTBOX: [Broken; 2] = [Broken::PublishBeforeCommit, Broken::LeaseIgnored];

    /// Every store that keeps responses wrongly (its inbox is sound): the
    /// kept-response suite must reject each.
    pub const RESPONSES: [Broken; 1] = [Broken::ResponseOutsideTransaction];

    /// Every store with a broken attempt ledger (its inbox and outbox are
    /// sound): the ledger suite must reject each.
    pub const LEDGER: [Broken; 2] = [
        Broken::LedgerForgetsCounts,
        Broken::LedgerInFailedTransaction,
    ];
}

/// Keys claimed by open transactions of one [`BrokenStore`], so that
/// [`Broken::ClaimWithoutWaiting`] can answer without waiting.
type InFlight = Arc<Mutex<HashSet<InboxKey>>>;

fn guard<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn lock(set: &InFlight) -> std::sync::MutexGuard<'_, HashSet<InboxKey>> {
    set.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A correct store `S` broken the way `kind` says.
#[derive(Clone, Debug)]
pub struct BrokenStore<S> {
    inner: S,
    kind: Broken,
    in_flight: InFlight,
    /// Every message [`Broken::LeaseIgnored`] handed out, to hand out again.
    leased: Arc<Mutex<Vec<MessageId>>>,
    /// [`Broken::LedgerInFailedTransaction`]'s failures, written "in the
    /// open transaction": kept by a commit, lost by a rollback.
    unflushed: Arc<Mutex<Vec<(InboxKey, LastError)>>>,
    /// Those of them a commit kept, not yet written to the ledger
    /// underneath.
    kept: Arc<Mutex<Vec<(InboxKey, LastError)>>>,
    /// [`Broken::ResponseOutsideTransaction`]'s responses, written at once.
    responses: Arc<Mutex<BTreeMap<InboxKey, Vec<u8>>>>,
}

impl<S> BrokenStore<S> {
    /// Breaks `inner`.
    pub fn new(inner: S, kind: Broken) -> Self {
        Self {
            inner,
            kind,
            in_flight: Arc::default(),
            leased: Arc::default(),
            unflushed: Arc::default(),
            kept: Arc::default(),
            responses: Arc::default(),
        }
    }

    /// The correct store underneath.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

/// Releases the keys an open transaction held in [`InFlight`].
struct HeldKeys {
    set: InFlight,
    keys: Vec<InboxKey>,
}

impl Drop for HeldKeys {
    fn drop(&mut self) {
        let mut set = lock(&self.set);
        for key in &self.keys {
            set.remove(key);
        }
    }
}

/// A transaction of a [`BrokenStore`].
pub struct BrokenTransaction<S: InboxStore> {
    inner: S::Transaction,
    store: BrokenStore<S>,
    held: HeldKeys,
    /// Keys whose claim was skipped or made elsewhere: nothing to unclaim
    /// here.
    not_claimed_here: Vec<InboxKey>,
    /// Keys whose claim [`Broken::WorkBeforeClaim`] postponed.
    deferred: Vec<InboxKey>,
}

impl<S: InboxStore> BrokenTransaction<S> {
    /// The correct transaction underneath, for business writes.
    pub fn inner_mut(&mut self) -> &mut S::Transaction {
        &mut self.inner
    }

    /// [`Broken::WorkBeforeClaim`]'s late claims, made just before COMMIT:
    /// whatever they answer, the work is already in this transaction and
    /// will commit.
    async fn claim_late(&mut self) -> Result<(), InboxError> {
        for key in std::mem::take(&mut self.deferred) {
            let _ = self.inner.claim(&key).await?;
        }
        Ok(())
    }
}

#[async_trait]
impl<S: InboxStore + Clone> InboxStore for BrokenStore<S> {
    type Transaction = BrokenTransaction<S>;

    async fn begin(&self) -> Result<Self::Transaction, InboxError> {
        Ok(BrokenTransaction {
            inner: self.inner.begin().await?,
            store: self.clone(),
            held: HeldKeys {
                set: self.in_flight.clone(),
                keys: Vec::new(),
            },
            not_claimed_here: Vec::new(),
            deferred: Vec::new(),
        })
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
impl<S> ResponseTransaction for BrokenTransaction<S>
where
    S: InboxStore<Transaction: ResponseTransaction> + Clone,
{
    async fn keep_response(&mut self, key: &InboxKey, response: &[u8]) -> Result<(), InboxError> {
        if self.store.kind == Broken::ResponseOutsideTransaction {
            guard(&self.store.responses).insert(key.clone(), response.to_vec());
            Ok(())
        } else {
            self.inner.keep_response(key, response).await
        }
    }
}

#[async_trait]
impl<S> ResponseStore for BrokenStore<S>
where
    S: ResponseStore<Transaction: ResponseTransaction> + Clone,
{
    async fn kept_response(&self, key: &InboxKey) -> Result<Option<Vec<u8>>, InboxError> {
        if self.kind == Broken::ResponseOutsideTransaction {
            Ok(guard(&self.responses).get(key).cloned())
        } else {
            self.inner.kept_response(key).await
        }
    }
}

#[async_trait]
impl<S: InboxStats + Clone> InboxStats for BrokenStore<S> {
    async fn processed_counts(&self) -> Result<BTreeMap<String, u64>, InboxError> {
        self.inner.processed_counts().await
    }
}

#[async_trait]
impl<S: InboxStore + Clone> InboxTransaction for BrokenTransaction<S> {
    async fn claim(&mut self, key: &InboxKey) -> Result<Claim, InboxError> {
        match self.store.kind {
            Broken::CheckThenInsert => {
                if self.store.inner.lookup(key).await?.is_some() {
                    return Ok(Claim::Duplicate);
                }
                // The gap between check and insert is where a concurrent
                // first delivery slips through.
                tokio::task::yield_now().await;
                if self.inner.claim(key).await? == Claim::Duplicate {
                    self.not_claimed_here.push(key.clone());
                }
                Ok(Claim::Fresh)
            }
            Broken::ClaimInOwnTransaction => {
                let mut own = self.store.inner.begin().await?;
                let claim = own.claim(key).await?;
                if claim == Claim::Fresh {
                    own.commit().await?;
                } else {
                    own.rollback().await?;
                }
                self.not_claimed_here.push(key.clone());
                Ok(claim)
            }
            Broken::WorkBeforeClaim => {
                self.deferred.push(key.clone());
                Ok(Claim::Fresh)
            }
            Broken::ClaimWithoutWaiting => {
                let in_flight_elsewhere = {
                    let set = lock(&self.store.in_flight);
                    set.contains(key) && !self.held.keys.contains(key)
                };
                if in_flight_elsewhere {
                    return Ok(Claim::Duplicate);
                }
                lock(&self.store.in_flight).insert(key.clone());
                self.held.keys.push(key.clone());
                self.inner.claim(key).await
            }
            Broken::ForgetsFingerprints => {
                let bare = InboxKey::new(key.message_id, key.consumer.clone());
                self.inner.claim(&bare).await
            }
            // Outbox and ledger bugs: the inbox is sound.
            Broken::PublishBeforeCommit
            | Broken::LeaseIgnored
            | Broken::LedgerForgetsCounts
            | Broken::LedgerInFailedTransaction
            | Broken::ResponseOutsideTransaction
            | Broken::ClaimBatchAnswersFreshOnly => self.inner.claim(key).await,
        }
    }

    async fn commit(mut self) -> Result<(), InboxError> {
        self.claim_late().await?;
        self.inner.commit().await?;
        // Committed "with the transaction": the ledger writes them through
        // at its next call.
        let committed = std::mem::take(&mut *lock_unflushed(&self.store.unflushed));
        lock_unflushed(&self.store.kept).extend(committed);
        Ok(())
    }

    async fn rollback(self) -> Result<(), InboxError> {
        lock_unflushed(&self.store.unflushed).clear();
        self.inner.rollback().await
    }
}

#[async_trait]
impl<S> BatchTransaction for BrokenTransaction<S>
where
    S: InboxStore<Transaction: BatchTransaction> + Clone,
{
    async fn claim_batch(&mut self, keys: &[InboxKey]) -> Result<Vec<Claim>, InboxError> {
        let claims = inbox_api::claim_each(self, keys).await?;
        if self.store.kind != Broken::ClaimBatchAnswersFreshOnly {
            return Ok(claims);
        }
        Ok(claims.into_iter().filter(|c| *c == Claim::Fresh).collect())
    }

    async fn savepoint(&mut self) -> Result<(), InboxError> {
        self.inner.savepoint().await
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), InboxError> {
        self.inner.rollback_to_savepoint().await
    }

    async fn release_savepoint(&mut self) -> Result<(), InboxError> {
        self.inner.release_savepoint().await
    }

    async fn unclaim(&mut self, key: &InboxKey) -> Result<(), InboxError> {
        if self.deferred.contains(key) || self.not_claimed_here.contains(key) {
            self.deferred.retain(|k| k != key);
            return Ok(());
        }
        self.inner.unclaim(key).await
    }
}

#[async_trait]
impl<S> OutboxTransaction for BrokenTransaction<S>
where
    S: OutboxStore + Clone,
{
    async fn enqueue(&mut self, message: &OutgoingMessage) -> Result<EnqueueOutcome, InboxError> {
        if self.store.kind != Broken::PublishBeforeCommit {
            return self.inner.enqueue(message).await;
        }
        // Its own transaction, committed at once: relays see the message
        // whatever becomes of the business writes.
        let mut own = self.store.inner.begin().await?;
        let outcome = own.enqueue(message).await?;
        own.commit().await?;
        Ok(outcome)
    }
}

#[async_trait]
impl<S: OutboxStore + Clone> OutboxStore for BrokenStore<S> {
    async fn take_pending(
        &self,
        limit: std::num::NonZeroU32,
        lease: Duration,
    ) -> Result<OutboxLease, InboxError> {
        let mut taken = self.inner.take_pending(limit, lease).await?;
        if self.kind != Broken::LeaseIgnored {
            return Ok(taken);
        }
        // Whatever an earlier lease holds and is still unpublished is due
        // again for this relay.
        let earlier: Vec<MessageId> = self
            .leased
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        for id in earlier {
            if taken.messages.len() >= limit.get() as usize {
                break;
            }
            if taken.ids().contains(&id) {
                continue;
            }
            if let Some(record) = self.inner.lookup_outgoing(&id).await?
                && record.published_at.is_none()
            {
                taken.messages.push(record.message);
            }
        }
        let mut leased = self
            .leased
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for id in taken.ids() {
            if !leased.contains(&id) {
                leased.push(id);
            }
        }
        Ok(taken)
    }

    async fn mark_published(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
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

    async fn dead_outgoing(
        &self,
        limit: std::num::NonZeroU32,
    ) -> Result<Vec<inbox_api::OutboxRecord>, InboxError> {
        self.inner.dead_outgoing(limit).await
    }

    async fn requeue_dead(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        self.inner.requeue_dead(ids).await
    }
}

/// Runs any harness's backend through a broken store.
pub struct BrokenHarness<H> {
    inner: H,
    kind: Broken,
}

impl<H> BrokenHarness<H> {
    /// Breaks the stores `inner` makes the way `kind` says.
    pub fn new(inner: H, kind: Broken) -> Self {
        Self { inner, kind }
    }
}

#[async_trait]
impl<H: Harness> Harness for BrokenHarness<H> {
    type Store = BrokenStore<H::Store>;

    fn name(&self) -> String {
        format!("{} broken by {:?}", self.inner.name(), self.kind)
    }

    fn layout(&self) -> inbox_postgres::Layout {
        self.inner.layout()
    }

    async fn fresh_store(&self) -> Self::Store {
        BrokenStore::new(self.inner.fresh_store().await, self.kind)
    }

    async fn record_effect(&self, tx: &mut TxOf<Self>, key: &InboxKey) -> Result<(), InboxError> {
        self.inner.record_effect(tx.inner_mut(), key).await
    }

    async fn effects(&self, store: &Self::Store) -> std::collections::BTreeMap<InboxKey, u64> {
        self.inner.effects(store.inner()).await
    }

    async fn inbox_rows(&self, store: &Self::Store) -> Vec<InboxRecord> {
        self.inner.inbox_rows(store.inner()).await
    }

    async fn crash(&self, store: &Self::Store, tx: TxOf<Self>, kind: CrashKind) {
        let BrokenTransaction { inner, held, .. } = tx;
        self.inner.crash(store.inner(), inner, kind).await;
        drop(held);
    }

    async fn commit_lost(
        &self,
        store: &Self::Store,
        mut tx: TxOf<Self>,
        commit_happens: bool,
    ) -> Option<bool> {
        // The late claims come before the COMMIT, as in `commit`.
        if tx.claim_late().await.is_err() {
            return Some(false);
        }
        let BrokenTransaction { inner, held, .. } = tx;
        let outcome = self
            .inner
            .commit_lost(store.inner(), inner, commit_happens)
            .await;
        drop(held);
        outcome
    }

    async fn age_rows(&self, store: &Self::Store, age: Duration) {
        self.inner.age_rows(store.inner(), age).await;
    }

    async fn store_now(&self, store: &Self::Store) -> DateTime<Utc> {
        self.inner.store_now(store.inner()).await
    }

    fn blocking_probe(&self) -> Duration {
        self.inner.blocking_probe()
    }
}

#[async_trait]
impl<H: OutboxHarness> OutboxHarness for BrokenHarness<H>
where
    H::Store: OutboxStore,
{
    async fn age_outbox(&self, store: &Self::Store, age: Duration) {
        self.inner.age_outbox(store.inner(), age).await;
    }
}

impl<S: AttemptLedger> BrokenStore<S> {
    /// Writes the failures a commit kept to the ledger underneath.
    async fn write_kept(&self) -> Result<(), InboxError> {
        let kept = std::mem::take(&mut *lock_unflushed(&self.kept));
        for (key, error) in kept {
            self.inner.record_failure(&key, &error).await?;
        }
        Ok(())
    }
}

#[async_trait]
impl<S: AttemptLedger + Clone> AttemptLedger for BrokenStore<S> {
    async fn record_failure(&self, key: &InboxKey, error: &LastError) -> Result<u32, InboxError> {
        self.write_kept().await?;
        match self.kind {
            Broken::LedgerForgetsCounts => Ok(1),
            Broken::LedgerInFailedTransaction => {
                let pending = {
                    let mut unflushed = lock_unflushed(&self.unflushed);
                    unflushed.push((key.clone(), error.clone()));
                    unflushed.iter().filter(|(k, _)| k == key).count()
                };
                let stored = self.inner.attempts(key).await?.map_or(0, |r| r.attempts);
                Ok(stored + u32::try_from(pending).unwrap_or(u32::MAX))
            }
            _ => self.inner.record_failure(key, error).await,
        }
    }

    async fn mark_dead(
        &self,
        key: &InboxKey,
        reason: &str,
        error: &LastError,
    ) -> Result<(), InboxError> {
        self.write_kept().await?;
        self.inner.mark_dead(key, reason, error).await
    }

    async fn attempts(&self, key: &InboxKey) -> Result<Option<AttemptRecord>, InboxError> {
        self.write_kept().await?;
        self.inner.attempts(key).await
    }

    async fn dead_messages(
        &self,
        consumer: Option<&ConsumerName>,
        limit: NonZeroU32,
    ) -> Result<Vec<AttemptRecord>, InboxError> {
        self.write_kept().await?;
        self.inner.dead_messages(consumer, limit).await
    }

    async fn purge_attempts_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.write_kept().await?;
        self.inner.purge_attempts_batch(cutoff, limit).await
    }
}

#[async_trait]
impl<H: LedgerHarness> LedgerHarness for BrokenHarness<H>
where
    H::Store: AttemptLedger,
{
    async fn age_attempts(&self, store: &Self::Store, age: Duration) {
        self.inner.age_attempts(store.inner(), age).await;
    }
}
