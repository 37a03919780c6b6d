//! The storage contract every backend keeps.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::{Fingerprint, InboxError, InboxKey};

/// The answer to a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[must_use = "a Duplicate claim means the work must be skipped"]
pub enum Claim {
    /// No committed row for this key: this transaction now holds it and must
    /// do the work. Concurrent claims of the same key wait for this
    /// transaction to end.
    Fresh,
    /// A transaction that claimed this key has committed: the work is done,
    /// skip it and acknowledge the delivery.
    Duplicate,
}

/// The step of [`InboxStore::begin_claim`] that failed: what the metric
/// `inbox_failed_total` labels `stage`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FirstStep {
    /// Opening the transaction (a connection, `BEGIN`).
    Begin,
    /// The claim, inside the open transaction.
    Claim,
}

impl FirstStep {
    /// The stage label: `begin` or `claim`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Begin => "begin",
            Self::Claim => "claim",
        }
    }
}

/// [`BatchTransaction::claim_batch`]'s default: each key claimed on its
/// own, in sorted order. Public so that a transaction wrapping another (a
/// decorator that changes one step) can answer a batch as the default does.
///
/// Sorted, so overlapping batches take their keys in one global order and
/// cannot wait on each other in a cycle; ties by position, so the first
/// occurrence of a repeated key is the one that gets `Fresh`.
///
/// # Errors
/// The first claim's error; the transaction must then be rolled back.
pub async fn claim_each<T: InboxTransaction + ?Sized>(
    tx: &mut T,
    keys: &[InboxKey],
) -> Result<Vec<Claim>, InboxError> {
    let mut order: Vec<usize> = (0..keys.len()).collect();
    order.sort_by(|&a, &b| keys[a].cmp(&keys[b]).then(a.cmp(&b)));
    let mut claims = vec![Claim::Duplicate; keys.len()];
    for index in order {
        claims[index] = tx.claim(&keys[index]).await?;
    }
    Ok(claims)
}

/// One committed inbox row, as read back for diagnostics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InboxRecord {
    /// Which message, for which consumer.
    pub key: InboxKey,
    /// When the claim was made (store clock).
    pub received_at: DateTime<Utc>,
    /// When the message was processed: recorded by the claim, in the same
    /// transaction as the work, so every committed row is processed. Always
    /// `Some` for rows written by this version; an `Option` because the
    /// column stays nullable (rows written before the claim recorded it may
    /// lack it).
    pub processed_at: Option<DateTime<Utc>>,
    /// The fingerprint of the payload the claim was made for
    /// ([`InboxKey::with_fingerprint`]); `None` for a claim made without
    /// one, and for rows written before stores kept it.
    pub fingerprint: Option<Fingerprint>,
}

/// A store of inbox rows with transactions the consumer's own writes share.
///
/// Implementations keep this contract, checked line by line by the
/// `inbox-conformance` crate's shared suite:
///
/// 1. [`InboxTransaction::claim`] is one atomic insert-or-nothing, never a
///    check followed by an insert.
/// 2. A claim of a key held by another open transaction waits for it: commit
///    means `Duplicate`, rollback or drop means `Fresh`. Distinct keys never
///    wait on each other.
/// 3. The inbox row and the business writes commit together or not at all; a
///    transaction dropped without commit leaves no trace.
/// 4. The key is `(message, consumer)`.
/// 5. `processed_at` is set inside the transaction, by the claim itself
///    (the row becomes visible only at COMMIT, with the work), and cleanup
///    deletes processed rows in bounded batches.
/// 6. Every error is classified retryable or permanent.
/// 7. The claim stores the key's payload fingerprint
///    ([`InboxKey::fingerprint`]) in the row, single and batched claims
///    alike, and [`InboxStore::lookup`] gives it back; the fingerprint is
///    not part of the key (a copy with another fingerprint is still the
///    same key, a `Duplicate` to the store).
#[async_trait]
pub trait InboxStore: Send + Sync + 'static {
    /// The backend's transaction. It also gives the consumer the backend's
    /// native handle (a `PgConnection`, an `AsyncPgConnection`, …) for its
    /// business writes, so they share the claim's fate.
    type Transaction: InboxTransaction;

    /// Opens a transaction.
    ///
    /// # Errors
    /// Retryable when no connection is available.
    async fn begin(&self) -> Result<Self::Transaction, InboxError>;

    /// Opens a transaction and claims `key` as its first write: exactly
    /// [`InboxStore::begin`] followed by [`InboxTransaction::claim`], which
    /// is what this default does.
    ///
    /// A backend whose driver can send both in one round trip overrides it
    /// (the diesel backend pipelines `BEGIN` and the claim on its
    /// connection). Per message, that round trip is the whole difference
    /// between a bare transaction (BEGIN, the business write, COMMIT) and
    /// an inbox one, so [`crate::Inbox::handle`] opens its transactions
    /// here. An override must keep the claim's semantics to the letter:
    /// the claim runs inside the transaction or not at all.
    ///
    /// # Errors
    /// The failed step and its error, as [`InboxStore::begin`] and
    /// [`InboxTransaction::claim`] give them.
    async fn begin_claim(
        &self,
        key: &InboxKey,
    ) -> Result<(Self::Transaction, Claim), (FirstStep, InboxError)> {
        let mut tx = self
            .begin()
            .await
            .map_err(|error| (FirstStep::Begin, error))?;
        let claim = tx
            .claim(key)
            .await
            .map_err(|error| (FirstStep::Claim, error))?;
        Ok((tx, claim))
    }

    /// Reads the committed row of `key`, without waiting for open
    /// transactions.
    ///
    /// For diagnostics and tests only. Never use it to decide whether to do
    /// the work: a check followed by a claim lets two concurrent first
    /// deliveries both pass the check (MassTransit PR #3617).
    ///
    /// # Errors
    /// As [`InboxStore::begin`].
    async fn lookup(&self, key: &InboxKey) -> Result<Option<InboxRecord>, InboxError>;

    /// Deletes at most `limit` processed rows whose `processed_at` is before
    /// `cutoff`, in one short transaction of its own, and returns how many
    /// went.
    ///
    /// Bounded so that cleanup never holds locks long enough to stall the
    /// claims running beside it, and so several instances cleaning at once
    /// do not fail each other. Rows without `processed_at` (possible only
    /// for rows written before the claim recorded it) are kept. To delete
    /// everything older than a cutoff, call
    /// [`InboxStoreExt::purge_processed_before`], which loops over this and
    /// records the purge metric.
    ///
    /// # Errors
    /// As the store's transactions.
    async fn purge_processed_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError>;

    /// One batch of a purge that goes on from the batch before it: as
    /// [`InboxStore::purge_processed_batch`], but only rows with
    /// `processed_at` at or after `from` (the previous batch's
    /// [`PurgedBatch::resume_from`]; `None` for the first batch), and it
    /// says where the next batch may start.
    ///
    /// A store whose batches would otherwise grow dearer as a purge
    /// advances overrides it: PostgreSQL keeps the index entries of deleted
    /// rows until VACUUM, and a batch that starts at the head of the index
    /// walks all of them. The default ignores `from` and never gives a
    /// resume point, which is right for a store without that cost.
    ///
    /// A row that commits behind the resume point while a purge runs (its
    /// `processed_at` older than rows already deleted: a transaction that
    /// claimed long before it committed) is left for the next purge.
    ///
    /// # Errors
    /// As [`InboxStore::purge_processed_batch`].
    async fn purge_processed_batch_from(
        &self,
        cutoff: DateTime<Utc>,
        from: Option<DateTime<Utc>>,
        limit: NonZeroU32,
    ) -> Result<PurgedBatch, InboxError> {
        let _ = from;
        Ok(PurgedBatch::new(
            self.purge_processed_batch(cutoff, limit).await?,
            None,
        ))
    }
}

/// What one batch of [`InboxStore::purge_processed_batch_from`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PurgedBatch {
    /// Rows deleted.
    pub deleted: u64,
    /// Where the next batch may start: the latest `processed_at` this
    /// batch deleted (rows sharing it may remain, so the next batch starts
    /// at it, not after it). `None`: start where the purge started.
    pub resume_from: Option<DateTime<Utc>>,
}

impl PurgedBatch {
    /// A batch that deleted `deleted` rows, the next to start at
    /// `resume_from`.
    pub const fn new(deleted: u64, resume_from: Option<DateTime<Utc>>) -> Self {
        Self {
            deleted,
            resume_from,
        }
    }
}

/// An open transaction of an [`InboxStore`].
///
/// Dropping it without [`InboxTransaction::commit`] rolls it back: its claims
/// are released (a waiting claim then gets `Fresh`) and its writes vanish.
/// Backends whose driver can only queue that rollback must make sure the
/// connection is not reused inside an open transaction.
#[async_trait]
pub trait InboxTransaction: Send {
    /// Claims `key` for this transaction: the first write of the
    /// transaction, one atomic insert-or-nothing.
    ///
    /// A `Fresh` claim records `processed_at` too (the store's clock at the
    /// claim; in Postgres `now()`, i.e. the transaction's start). The row
    /// only becomes visible at COMMIT, together with the work, so a
    /// committed row means a processed message; there is no separate
    /// marking step.
    ///
    /// Waits while another open transaction holds the key. Claiming a key
    /// this transaction already holds answers `Duplicate`.
    ///
    /// # Errors
    /// Store failures only; a duplicate is [`Claim::Duplicate`], not an error.
    async fn claim(&mut self, key: &InboxKey) -> Result<Claim, InboxError>;

    /// Makes the claims and the business writes durable, together.
    ///
    /// # Errors
    /// A lost connection during commit is retryable and leaves the outcome
    /// unknown; redelivery resolves it.
    async fn commit(self) -> Result<(), InboxError>;

    /// Discards the claims and the business writes.
    ///
    /// # Errors
    /// Store failures; the transaction is gone either way.
    async fn rollback(self) -> Result<(), InboxError>;
}

/// The operations batched mode needs beyond [`InboxTransaction`]: many
/// claims in one statement, savepoints, and giving a claim back.
///
/// A capability of its own (as object_store keeps multipart uploads out of
/// its core trait) so that a store without savepoints still serves
/// [`crate::Inbox::handle`], and [`crate::Inbox::handle_batch`] over such a
/// store fails to compile instead of failing at service start.
#[async_trait]
pub trait BatchTransaction: InboxTransaction {
    /// Claims every key in one round trip (batched mode), answering one
    /// [`Claim`] per key, in order.
    ///
    /// Same semantics as [`InboxTransaction::claim`] for each key, including
    /// the `processed_at` a `Fresh` claim records. A key that occurs twice in
    /// `keys` is `Fresh` at most once, at its first occurrence. Postgres
    /// backends use one `INSERT … SELECT unnest(…) ON CONFLICT DO NOTHING
    /// RETURNING`, taking the keys in sorted order so that two overlapping
    /// batches lock in the same order. The default claims one by one.
    ///
    /// # Errors
    /// As [`InboxTransaction::claim`]; on error the transaction must be
    /// rolled back.
    async fn claim_batch(&mut self, keys: &[InboxKey]) -> Result<Vec<Claim>, InboxError> {
        claim_each(self, keys).await
    }

    /// Opens a savepoint: the writes made after it can be undone alone with
    /// [`BatchTransaction::rollback_to_savepoint`], while the rest of the
    /// transaction goes on. Batched mode runs each message's work inside one,
    /// so that one failing message does not fail its batch.
    ///
    /// Savepoints nest like SQL's: rollback and release act on the newest.
    ///
    /// # Errors
    /// Store failures.
    async fn savepoint(&mut self) -> Result<(), InboxError>;

    /// Undoes every write since the newest savepoint and drops it.
    ///
    /// # Errors
    /// Store failures, or [`InboxError::InvalidArgument`] without a savepoint.
    async fn rollback_to_savepoint(&mut self) -> Result<(), InboxError>;

    /// Keeps the writes since the newest savepoint and drops it.
    ///
    /// # Errors
    /// Store failures, or [`InboxError::InvalidArgument`] without a savepoint.
    async fn release_savepoint(&mut self) -> Result<(), InboxError>;

    /// Gives back a claim this transaction made `Fresh` (deletes its
    /// uncommitted row), so that a message whose work failed in a batch is
    /// not recorded when the rest of the batch commits. A claim waiting on
    /// the key gets `Fresh` once this transaction ends, not before: like
    /// any write, an unclaim is undone by rolling back to a savepoint taken
    /// before it, which gives the claim back to this transaction.
    ///
    /// # Errors
    /// Store failures, or [`InboxError::InvalidArgument`] for a key this
    /// transaction does not hold.
    async fn unclaim(&mut self, key: &InboxKey) -> Result<(), InboxError>;
}

#[async_trait]
impl<S: InboxStore> InboxStore for Arc<S> {
    type Transaction = S::Transaction;

    async fn begin(&self) -> Result<Self::Transaction, InboxError> {
        (**self).begin().await
    }

    async fn begin_claim(
        &self,
        key: &InboxKey,
    ) -> Result<(Self::Transaction, Claim), (FirstStep, InboxError)> {
        (**self).begin_claim(key).await
    }

    async fn lookup(&self, key: &InboxKey) -> Result<Option<InboxRecord>, InboxError> {
        (**self).lookup(key).await
    }

    async fn purge_processed_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        (**self).purge_processed_batch(cutoff, limit).await
    }

    async fn purge_processed_batch_from(
        &self,
        cutoff: DateTime<Utc>,
        from: Option<DateTime<Utc>>,
        limit: NonZeroU32,
    ) -> Result<PurgedBatch, InboxError> {
        (**self)
            .purge_processed_batch_from(cutoff, from, limit)
            .await
    }
}

/// Diagnostics a store can answer about its rows (an optional capability).
///
/// The inbox table is the store's own: applications that report how many
/// messages each consumer has processed ask here instead of reading a table
/// whose name and layout belong to the backend.
#[async_trait]
pub trait InboxStats: InboxStore {
    /// The number of committed inbox rows per consumer name. Consumers with
    /// no row are absent.
    ///
    /// # Errors
    /// As [`InboxStore::begin`].
    async fn processed_counts(&self) -> Result<BTreeMap<String, u64>, InboxError>;
}

#[async_trait]
impl<S: InboxStats> InboxStats for Arc<S> {
    async fn processed_counts(&self) -> Result<BTreeMap<String, u64>, InboxError> {
        (**self).processed_counts().await
    }
}

/// Conveniences over every [`InboxStore`], implemented once for all of them.
///
/// Kept out of [`InboxStore`] so that a backend cannot override them: the
/// metric a purge records must mean the same for every store.
#[async_trait]
pub trait InboxStoreExt: InboxStore {
    /// Deletes every processed row older than `cutoff`, `batch_size` rows per
    /// transaction ([`InboxStore::purge_processed_batch`]), records each
    /// batch in `inbox_purged_rows_total`, and returns how many went.
    ///
    /// # Errors
    /// As [`InboxStore::purge_processed_batch`]; rows deleted by the batches
    /// that committed before an error stay deleted (and counted).
    async fn purge_processed_before(
        &self,
        cutoff: DateTime<Utc>,
        batch_size: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.purge_processed_paced(cutoff, batch_size, || std::future::ready(()))
            .await
    }

    /// [`InboxStoreExt::purge_processed_before`] with `pause` awaited after
    /// every full batch, before the next one: a paced cleanup, which
    /// leaves the database to the claims between its batches (the
    /// application's cleanup sleeps there; see its default pacing).
    ///
    /// # Errors
    /// As [`InboxStoreExt::purge_processed_before`].
    async fn purge_processed_paced<P, F>(
        &self,
        cutoff: DateTime<Utc>,
        batch_size: NonZeroU32,
        pause: P,
    ) -> Result<u64, InboxError>
    where
        P: FnMut() -> F + Send,
        F: std::future::Future<Output = ()> + Send,
    {
        purge_in_batches(
            batch_size,
            crate::metrics::PURGED_ROWS,
            None,
            |from| async move {
                let batch = self
                    .purge_processed_batch_from(cutoff, from, batch_size)
                    .await?;
                Ok((batch.deleted, batch.resume_from.or(from)))
            },
            pause,
        )
        .await
    }
}

impl<S: InboxStore + ?Sized> InboxStoreExt for S {}

/// Runs `batch` until it deletes fewer than `batch_size` rows, counting each
/// batch's rows in the counter `metric` and awaiting `pause` between two
/// batches: the loop of every cleanup, inbox's and outbox's. Each batch
/// gets the position the one before it returned (`start` for the first):
/// where the inbox's purge resumes; `()` for a purge without one.
pub(crate) async fn purge_in_batches<T, B, BF, P, PF>(
    batch_size: NonZeroU32,
    metric: &'static str,
    start: T,
    mut batch: B,
    mut pause: P,
) -> Result<u64, InboxError>
where
    B: FnMut(T) -> BF,
    BF: std::future::Future<Output = Result<(u64, T), InboxError>>,
    P: FnMut() -> PF,
    PF: std::future::Future<Output = ()>,
{
    let mut total = 0;
    let mut position = start;
    loop {
        let (deleted, next) = batch(position).await?;
        position = next;
        metrics::counter!(metric).increment(deleted);
        total += deleted;
        if deleted < u64::from(batch_size.get()) {
            tracing::debug!(total, metric, "purge finished");
            return Ok(total);
        }
        pause().await;
    }
}
