//! What a user of the runtime writes: a [`Handler`] per consumer.
//!
//! The runtime owns everything around the handler: decoding the delivery
//! into [`Handler::Message`] (or dead-lettering it as bad input), opening
//! the inbox transaction and claiming `(message_id, handler.name())` in it,
//! committing, acking only after the commit, retrying and dead-lettering.
//! The handler holds no idempotency code: [`Handler::handle`] runs at most
//! once per committed message and consumer, inside the transaction, and
//! [`Handler::after_commit`] makes the call that cannot join it.

use std::future::Future;

use inbox_api::{ConsumerName, MessageId};
use serde::de::DeserializeOwned;

use crate::AppError;

/// One consumer's business code, over the store's transaction type `Tx`.
///
/// Generic over `Tx` rather than over the store, so that a handler written
/// against a capability of transactions (a trait of business writes, say)
/// runs on every store whose transaction has it.
pub trait Handler<Tx>: Send + Sync + 'static {
    /// The body of the deliveries it takes, as JSON.
    type Message: DeserializeOwned + Send + Sync + 'static;
    /// What the transaction decided to do outside it, after commit.
    type Intent: Send + 'static;

    /// The scope of deduplication (the inbox key's consumer), also the
    /// `consumer` label of the metrics.
    fn name(&self) -> &ConsumerName;

    /// The AMQP `type` property of the deliveries it takes; any other is
    /// dead-lettered as `unknown_type`.
    fn message_type(&self) -> &str;

    /// Rules the message must meet beyond its JSON shape; a refusal
    /// dead-lettered as `invalid_event`, before any transaction opens.
    ///
    /// # Errors
    /// What is wrong, for the dead-letter detail.
    fn validate(&self, message: &Self::Message) -> Result<(), String> {
        let _ = message;
        Ok(())
    }

    /// The business work, inside the inbox transaction `tx`: its writes
    /// commit together with the claim or not at all.
    fn handle(
        &self,
        tx: &mut Tx,
        message_id: MessageId,
        message: &Self::Message,
    ) -> impl Future<Output = Result<Self::Intent, AppError>> + Send;

    /// The non-transactional call, after the commit succeeded and before the
    /// ack. A failure is logged and counted, never retried here: the commit
    /// stands (keep the intent in the transaction to repair it later).
    fn after_commit(
        &self,
        intent: Self::Intent,
    ) -> impl Future<Output = Result<(), AppError>> + Send {
        drop(intent);
        async { Ok(()) }
    }

    /// Checks that the store has what [`Handler::handle`] needs beyond the
    /// inbox (the handler's own tables, the role's privileges on them),
    /// inside a transaction that is then rolled back. The runtime asks
    /// before consuming (a failure with a store-wide error refuses the
    /// start) and whenever it probes the store during an outage (consumption
    /// stays paused until it passes), so that a missing table is found once,
    /// not by every message. The default checks nothing.
    ///
    /// # Errors
    /// What is missing, classified like any store error (a missing table
    /// or a privilege is the store's failure, not a message's).
    fn check(&self, tx: &mut Tx) -> impl Future<Output = Result<(), AppError>> + Send {
        let _ = tx;
        async { Ok(()) }
    }
}
