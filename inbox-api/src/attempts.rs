//! The attempt ledger: the service's own count of a message's failures.
//!
//! A poison message (one whose handler fails every time) must end in a
//! dead-letter queue after a bounded number of deliveries. The broker's
//! count cannot be the only bound: RabbitMQ 4.3 stopped raising a quorum
//! queue's `x-delivery-count` on `basic.nack` (rabbitmq-server PR #15387),
//! and classic queues and other brokers keep no count at all, so a cap on
//! the broker's number alone lets a failing message loop for ever. The
//! ledger counts failures per `(message, consumer)` in the store itself
//! (MassTransit keeps a receive count, reliar-inbox attempts, last error and
//! a dead state), and the consumer caps on it, falling back on the
//! broker's count only when the ledger could not be written: the ledger
//! counts the message's own failures, while a broker before 4.3 counts the
//! uncharged hand-backs of an outage too.
//!
//! **Outside the handler's transaction.** A failure is recorded after the
//! handler's transaction has rolled back, in a short write of its own: a
//! count written inside that transaction would roll back with it and never
//! grow. The conformance suite checks exactly that.
//!
//! **Not cleared on success.** A processed message has its inbox row, which
//! already says it is done; clearing would cost every message that ever
//! failed one more write on the hot path. The rows go with cleanup
//! ([`AttemptLedgerExt::purge_attempts_before`]), and
//! [`AttemptLedger::dead_messages`] leaves out messages processed since.
//!
//! **A replayed dead message gets a fresh budget.** The failure recorded
//! after a message was marked dead starts the count again at one (and
//! clears the dead mark): a message moved back from the dead-letter queue
//! after a fix is retried as often as a new one, as MassTransit and
//! NServiceBus users expect of a replay.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::{ConsumerName, InboxError, InboxKey, InboxStore};

/// The text of a failure as the ledger keeps it: at most
/// [`LastError::MAX_LEN`] bytes, cut at a character boundary, with control
/// characters (which PostgreSQL's `text` refuses, in NUL's case, and which
/// garble a terminal table) replaced by spaces.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct LastError(String);

impl LastError {
    /// The longest text kept, in bytes: enough for an error chain, small
    /// enough for a header and a table cell.
    pub const MAX_LEN: usize = 1000;

    /// `text`, cleaned and cut to [`LastError::MAX_LEN`] bytes (an ellipsis
    /// marks a cut).
    pub fn new(text: &str) -> Self {
        let clean: String = text
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        // The ellipsis a cut adds counts against the bound too.
        Self(crate::key::truncate(&clean, Self::MAX_LEN - '…'.len_utf8()))
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LastError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for LastError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

/// When and why a message was dead-lettered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadMark {
    /// When it was marked dead (store clock).
    pub at: DateTime<Utc>,
    /// The dead-letter reason label (`retries_exhausted`, `store`, …).
    pub reason: String,
}

/// One `(message, consumer)`'s failures, as the ledger keeps them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttemptRecord {
    /// Which message, for which consumer.
    pub key: InboxKey,
    /// Failed deliveries counted (since the last dead mark, if any was
    /// cleared by a replay).
    pub attempts: u32,
    /// The last failure's text.
    pub last_error: String,
    /// The first counted failure (store clock).
    pub first_failed_at: DateTime<Utc>,
    /// The last failure (store clock).
    pub last_failed_at: DateTime<Utc>,
    /// Set once the message was dead-lettered.
    pub dead: Option<DeadMark>,
}

/// A store that counts failed deliveries per `(message, consumer)` (an
/// optional capability, like [`crate::InboxStats`]).
///
/// The contract (checked by the `inbox-conformance` crate's ledger suite):
///
/// 1. Every call is its own short write, never part of a consumer's
///    transaction: a count survives the rollback of the transaction whose
///    failure it records.
/// 2. [`AttemptLedger::record_failure`] is one atomic increment: N
///    concurrent calls for one key raise its count by exactly N.
/// 3. The key is `(message, consumer)`, as the inbox's.
/// 4. The first failure recorded after a dead mark starts a fresh count at
///    one and clears the mark (a replay).
/// 5. [`AttemptLedger::dead_messages`] lists dead rows whose message has
///    not been processed since; cleanup deletes rows whose last failure is
///    older than a cutoff, in bounded batches.
#[async_trait]
pub trait AttemptLedger: InboxStore {
    /// Records one failed delivery of `key` with its error, and returns the
    /// count including it.
    ///
    /// # Errors
    /// Store failures (retryable ones as for any transaction); the failure
    /// is then not counted.
    async fn record_failure(&self, key: &InboxKey, error: &LastError) -> Result<u32, InboxError>;

    /// Marks `key` dead-lettered with the reason label `reason`. A key with
    /// no failure recorded yet (dead-lettered at its first failure, a
    /// permanent error) gets a row counting that one failure, `error`.
    ///
    /// # Errors
    /// Store failures.
    async fn mark_dead(
        &self,
        key: &InboxKey,
        reason: &str,
        error: &LastError,
    ) -> Result<(), InboxError>;

    /// The ledger's row of `key`, if any failure was recorded.
    ///
    /// # Errors
    /// Store failures.
    async fn attempts(&self, key: &InboxKey) -> Result<Option<AttemptRecord>, InboxError>;

    /// At most `limit` dead rows, of `consumer` or of every consumer, newest
    /// dead mark first, leaving out messages processed since (a replay
    /// that succeeded).
    ///
    /// # Errors
    /// Store failures.
    async fn dead_messages(
        &self,
        consumer: Option<&ConsumerName>,
        limit: NonZeroU32,
    ) -> Result<Vec<AttemptRecord>, InboxError>;

    /// Deletes at most `limit` rows whose last failure is before `cutoff`,
    /// in one short transaction, and returns how many went. Bounded for the
    /// same reason as [`InboxStore::purge_processed_batch`]; loop with
    /// [`AttemptLedgerExt::purge_attempts_before`].
    ///
    /// # Errors
    /// Store failures.
    async fn purge_attempts_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError>;
}

#[async_trait]
impl<S: AttemptLedger> AttemptLedger for Arc<S> {
    async fn record_failure(&self, key: &InboxKey, error: &LastError) -> Result<u32, InboxError> {
        (**self).record_failure(key, error).await
    }

    async fn mark_dead(
        &self,
        key: &InboxKey,
        reason: &str,
        error: &LastError,
    ) -> Result<(), InboxError> {
        (**self).mark_dead(key, reason, error).await
    }

    async fn attempts(&self, key: &InboxKey) -> Result<Option<AttemptRecord>, InboxError> {
        (**self).attempts(key).await
    }

    async fn dead_messages(
        &self,
        consumer: Option<&ConsumerName>,
        limit: NonZeroU32,
    ) -> Result<Vec<AttemptRecord>, InboxError> {
        (**self).dead_messages(consumer, limit).await
    }

    async fn purge_attempts_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        (**self).purge_attempts_batch(cutoff, limit).await
    }
}

/// Conveniences over every [`AttemptLedger`], implemented once so that the
/// metric they record means the same for every store.
#[async_trait]
pub trait AttemptLedgerExt: AttemptLedger {
    /// Deletes every ledger row whose last failure is older than `cutoff`,
    /// `batch_size` rows per transaction, records each batch in
    /// `inbox_attempts_purged_rows_total`, and returns how many went.
    ///
    /// # Errors
    /// As [`AttemptLedger::purge_attempts_batch`]; the batches committed
    /// before an error stay deleted (and counted).
    async fn purge_attempts_before(
        &self,
        cutoff: DateTime<Utc>,
        batch_size: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.purge_attempts_paced(cutoff, batch_size, || std::future::ready(()))
            .await
    }

    /// [`AttemptLedgerExt::purge_attempts_before`] with `pause` awaited after every full
    /// batch, before the next one (a paced cleanup, as
    /// [`crate::InboxStoreExt::purge_processed_paced`]).
    ///
    /// # Errors
    /// As [`AttemptLedgerExt::purge_attempts_before`].
    async fn purge_attempts_paced<P, F>(
        &self,
        cutoff: DateTime<Utc>,
        batch_size: NonZeroU32,
        pause: P,
    ) -> Result<u64, InboxError>
    where
        P: FnMut() -> F + Send,
        F: std::future::Future<Output = ()> + Send,
    {
        crate::store::purge_in_batches(
            batch_size,
            crate::metrics::ATTEMPTS_PURGED_ROWS,
            (),
            |()| async move { Ok((self.purge_attempts_batch(cutoff, batch_size).await?, ())) },
            pause,
        )
        .await
    }
}

impl<S: AttemptLedger + ?Sized> AttemptLedgerExt for S {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_error_is_clean_and_bounded() {
        assert_eq!(LastError::new("boom").as_str(), "boom");
        assert_eq!(LastError::new("a\0b\nc").as_str(), "a b c");
        let long = LastError::new(&"é".repeat(2000));
        assert!(
            long.as_str().len() <= LastError::MAX_LEN,
            "{}",
            long.as_str().len()
        );
        assert!(long.as_str().ends_with('…'));
        assert_eq!(format!("{}", LastError::new("x")), "x");
        assert_eq!(format!("{:?}", LastError::new("x")), "\"x\"");
    }
}
