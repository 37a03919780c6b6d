//! Responses kept with a claim: what an idempotent HTTP endpoint needs
//! from the inbox.
//!
//! An endpoint that takes an `Idempotency-Key` claims `(key, route)` in the
//! transaction of its own writes, like a consumer claims a message, and
//! keeps the response it answered with beside the claim. A retried request
//! finds the claim taken (`Duplicate`) and is answered from the kept
//! response instead of doing the work again. Kept in the inbox row, the
//! response commits with the work or not at all, and expires with the row
//! (the inbox's cleanup deletes both).
//!
//! A capability of its own, as [`crate::BatchTransaction`] is: a store
//! without it still serves consumers, and an endpoint over such a store
//! fails to compile.

use std::sync::Arc;

use async_trait::async_trait;

use crate::{InboxError, InboxKey, InboxStore, InboxTransaction};

/// A transaction that can keep a response with a key it claimed.
#[async_trait]
pub trait ResponseTransaction: InboxTransaction {
    /// Keeps `response` (opaque bytes, encoded by the caller) with `key`,
    /// which this transaction claimed `Fresh`, replacing any response kept
    /// with it before in this transaction.
    ///
    /// Part of the transaction: visible at COMMIT together with the claim
    /// and the work, gone on rollback. Inside a savepoint, rolling back to
    /// it undoes the keep too.
    ///
    /// # Errors
    /// Store failures, or [`InboxError::InvalidArgument`] for a key that
    /// has no row this transaction can write (never claimed, or given
    /// back).
    async fn keep_response(&mut self, key: &InboxKey, response: &[u8]) -> Result<(), InboxError>;
}

/// A store whose transactions keep responses, and that reads them back.
///
/// The contract ([`ResponseTransaction::keep_response`] and this):
///
/// 1. A response kept in a transaction is read back after its COMMIT, and
///    never before it, nor after a rollback.
/// 2. It is deleted with its row: cleanup ([`InboxStore::purge_processed_batch`])
///    removes both.
/// 3. A key that was claimed without keeping a response reads back `None`.
#[async_trait]
pub trait ResponseStore: InboxStore<Transaction: ResponseTransaction> {
    /// The response kept with `key`'s committed row; `None` when the key
    /// has no committed row, or its row keeps none. Does not wait for open
    /// transactions: call it after a claim of `key` answered `Duplicate`,
    /// which waited for the holder to end.
    ///
    /// # Errors
    /// As [`InboxStore::begin`].
    async fn kept_response(&self, key: &InboxKey) -> Result<Option<Vec<u8>>, InboxError>;
}

#[async_trait]
impl<S: ResponseStore> ResponseStore for Arc<S> {
    async fn kept_response(&self, key: &InboxKey) -> Result<Option<Vec<u8>>, InboxError> {
        (**self).kept_response(key).await
    }
}
