#![doc = include_str!("../README.md")]
//!
//! Start at [`Inbox`] (the middleware), [`InboxStore`] and [`InboxTransaction`]
//! (the contract), [`InboxError`] (retryable or permanent), and
//! [`OutboxTransaction`] / [`OutboxStore`] (the outbox); the optional
//! capabilities are [`BatchTransaction`], [`InboxStats`],
//! [`AttemptLedger`] and [`ResponseStore`] (responses kept with a claim,
//! for idempotent HTTP endpoints); [`InboxStoreExt`] and [`OutboxStoreExt`] hold the
//! conveniences; [`metrics`] the metric names.
#![deny(missing_docs)]

mod attempts;
mod error;
mod fingerprint;
mod inbox;
mod key;
pub mod metrics;
mod outbox;
mod redact;
mod response;
mod store;

pub use attempts::{AttemptLedger, AttemptLedgerExt, AttemptRecord, DeadMark, LastError};
pub use error::{BoxError, Disposition, InboxError, chain};
pub use fingerprint::Fingerprint;
pub use inbox::{AsyncWork, AsyncWorkFn, AsyncWorkMut, Handled, Inbox};
pub use key::{ConsumerName, InboxKey, MessageId};
pub use outbox::{
    EnqueueOutcome, LeaseId, OutboxLease, OutboxRecord, OutboxStore, OutboxStoreExt,
    OutboxTransaction, OutgoingMessage, PublishRetry, Refused,
};
pub use redact::redact_url;
pub use response::{ResponseStore, ResponseTransaction};
pub use store::{
    BatchTransaction, Claim, FirstStep, InboxRecord, InboxStats, InboxStore, InboxStoreExt,
    InboxTransaction, PurgedBatch, claim_each,
};
