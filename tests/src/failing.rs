//! A sound store whose every transaction fails at one step: for the promise
//! that every message of a batch whose own store step failed still gets
//! its outcome (`BatchAborted`, to be redelivered), never none at all.
//!
//! A batch settles its deliveries by the outcomes it gets back; a message
//! left without one would be neither acknowledged nor handed back until
//! the channel closed.

use std::num::NonZeroU32;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use inbox_api::{
    BatchTransaction, Claim, InboxError, InboxKey, InboxRecord, InboxStore, InboxTransaction,
    PurgedBatch,
};

/// Which step of every transaction fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Opening the transaction (no connection).
    Begin,
    /// The claim, single or batched (the connection lost mid-transaction).
    Claim,
    /// The commit (lost: nothing of the transaction is kept here).
    Commit,
}

impl Stage {
    /// Every stage.
    pub const ALL: [Stage; 3] = [Stage::Begin, Stage::Claim, Stage::Commit];

    /// The store error of this stage: a lost connection, retryable.
    pub fn error(self) -> InboxError {
        InboxError::Connection {
            source: format!("the store failed at {self:?} on purpose").into(),
        }
    }
}

/// The store `S`, failing at [`Stage`].
#[derive(Clone, Debug)]
pub struct FailingStore<S> {
    inner: S,
    stage: Stage,
}

impl<S> FailingStore<S> {
    /// `inner`, failing every transaction at `stage`.
    pub fn new(inner: S, stage: Stage) -> Self {
        Self { inner, stage }
    }
}

/// A transaction of a [`FailingStore`].
pub struct FailingTransaction<S: InboxStore> {
    inner: S::Transaction,
    stage: Stage,
}

impl<S: InboxStore> FailingTransaction<S> {
    /// The sound transaction underneath, for business writes.
    pub fn inner_mut(&mut self) -> &mut S::Transaction {
        &mut self.inner
    }
}

#[async_trait]
impl<S: InboxStore + Clone> InboxStore for FailingStore<S> {
    type Transaction = FailingTransaction<S>;

    async fn begin(&self) -> Result<Self::Transaction, InboxError> {
        if self.stage == Stage::Begin {
            return Err(self.stage.error());
        }
        Ok(FailingTransaction {
            inner: self.inner.begin().await?,
            stage: self.stage,
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
    ) -> Result<PurgedBatch, InboxError> {
        self.inner
            .purge_processed_batch_from(cutoff, from, limit)
            .await
    }
}

#[async_trait]
impl<S: InboxStore> InboxTransaction for FailingTransaction<S> {
    async fn claim(&mut self, key: &InboxKey) -> Result<Claim, InboxError> {
        if self.stage == Stage::Claim {
            return Err(self.stage.error());
        }
        self.inner.claim(key).await
    }

    async fn commit(self) -> Result<(), InboxError> {
        if self.stage == Stage::Commit {
            // Lost before it reached the server: nothing kept.
            self.inner.rollback().await?;
            return Err(self.stage.error());
        }
        self.inner.commit().await
    }

    async fn rollback(self) -> Result<(), InboxError> {
        self.inner.rollback().await
    }
}

#[async_trait]
impl<S> BatchTransaction for FailingTransaction<S>
where
    S: InboxStore<Transaction: BatchTransaction>,
{
    async fn claim_batch(&mut self, keys: &[InboxKey]) -> Result<Vec<Claim>, InboxError> {
        if self.stage == Stage::Claim {
            return Err(self.stage.error());
        }
        self.inner.claim_batch(keys).await
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
        self.inner.unclaim(key).await
    }
}
