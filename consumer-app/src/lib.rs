//! Parcel Tracking: a RabbitMQ service whose two consumers act exactly once
//! per message, through the inbox.
//!
//! `ParcelCreatedEvent`s are published to a topic exchange and routed to two
//! quorum queues. [`consumers::NotificationConsumer`] records (and after
//! commit sends) a notification; [`consumers::CarrierAssignmentConsumer`]
//! reserves (and after commit books) a carrier slot. Neither contains any
//! idempotency code: the message path ([`worker`]) wraps each in
//! [`inbox_api::Inbox::handle`], scoped by the consumer's name, and acks only
//! after the commit.
//!
//! - [`event`]: the event and the validation of a delivery (bad input).
//! - [`effects`]: the business writes, one trait over every store.
//! - [`downstream`]: the non-transactional calls and the trade-off chosen.
//! - [`dispatch`]: marking intents dispatched, the reconciler, the durable
//!   stub ledger.
//! - [`worker`]: one delivery from decode to ack, retry or dead-letter.
//! - [`batch`]: batched mode, many deliveries per transaction.
//! - [`service`]: consuming, reconnecting, shutting down, cleanup.
//! - [`topology`], [`amqp`]: RabbitMQ names and plumbing.
//! - [`store`]: the stores (cargo features `sqlx`, `diesel`, `memory`).
//! - [`publish`], [`demo`], [`telemetry`]: the load generator, the demo,
//!   logs and metrics.
#![deny(missing_docs)]

pub mod amqp;
pub mod batch;
pub mod consumers;
pub mod demo;
pub mod dispatch;
pub mod downstream;
pub mod effects;
pub mod error;
pub mod event;
pub mod publish;
pub mod redact;
pub mod service;
pub mod store;
pub mod tally;
pub mod telemetry;
pub mod topology;
pub mod worker;

pub use error::AppError;

#[cfg(not(any(feature = "sqlx", feature = "diesel", feature = "memory")))]
compile_error!("enable at least one store feature: sqlx, diesel or memory");
