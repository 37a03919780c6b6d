//! The Inbox pattern's vocabulary: exactly-once *effects* on top of
//! at-least-once delivery.
//!
//! A broker redelivers after a crash, a lost ack or a restart. In the same
//! database transaction as the consumer's own writes, the inbox records
//! `(message_id, consumer)`; a second delivery finds the record, and is
//! acknowledged and dropped without running the work again.
//!
//! - [`MessageId`], [`ConsumerName`], [`InboxKey`]: what is deduplicated.
//! - [`InboxStore`] / [`InboxTransaction`]: the contract each backend keeps
//!   (`inbox-backend-memory`, `inbox-backend-sqlx`, `inbox-backend-diesel`).
//! - Optional capabilities in traits of their own: [`BatchTransaction`]
//!   (many claims per statement, savepoints; what [`Inbox::handle_batch`]
//!   needs), [`InboxStats`] (row counts per consumer) and [`AttemptLedger`]
//!   (failed deliveries per message, the service's own poison count,
//!   written outside the rolled-back transaction).
//! - [`InboxStoreExt`]: conveniences implemented once for every store
//!   (`purge_processed_before`, which records the purge metric).
//! - [`Inbox::handle`] / [`Inbox::handle_batch`]: the middleware a consumer
//!   runs inside; both answer each message with the same outcome type.
//! - [`InboxError`]: one error type, each error retryable or permanent.
//! - [`OutgoingMessage`], [`OutboxTransaction`], [`OutboxStore`]: the
//!   transactional outbox, the producer's half: an outgoing message is
//!   enqueued in the transaction of the business writes, and a relay
//!   publishes what committed ([`OutboxStoreExt`] for its conveniences).
//! - [`metrics`]: the metric names, documented in one place.
//!
//! This crate depends on no backend and no runtime.
#![deny(missing_docs)]

mod attempts;
mod error;
mod inbox;
mod key;
pub mod metrics;
mod outbox;
mod store;

pub use attempts::{AttemptLedger, AttemptLedgerExt, AttemptRecord, DeadMark, LastError};
pub use error::{BoxError, Disposition, InboxError};
pub use inbox::{AsyncWork, AsyncWorkFn, AsyncWorkMut, Handled, Inbox};
pub use key::{ConsumerName, InboxKey, MessageId};
pub use outbox::{
    EnqueueOutcome, LeaseId, OutboxLease, OutboxRecord, OutboxStore, OutboxStoreExt,
    OutboxTransaction, OutgoingMessage, PublishRetry, Refused,
};
pub use store::{
    BatchTransaction, Claim, FirstStep, InboxRecord, InboxStats, InboxStore, InboxStoreExt,
    InboxTransaction, PurgedBatch,
};
