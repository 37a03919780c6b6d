#![doc = include_str!("../README.md")]
//!
//! # How it is built
//!
//! The generic runtime: delivery → key → [`inbox_api::Inbox`] → settle. It
//! knows no domain and is written once above the broker: a user writes a
//! [`Handler`] per consumer and wires it in with [`Service`]; the URL's
//! scheme picks the broker (`amqp://`: RabbitMQ, feature `rabbitmq`, on by
//! default); everything else is here.
//!
//! ```text
//! broker ─► Subscription (RabbitMQ: basic.consume, prefetch, coalesced acks)
//!   ─► queue_loop (concurrency, batching, the outage pause, shutdown)
//!             └► worker: decode ─► Inbox::handle / handle_batch(key = (message_id, handler.name()))
//!                  └► SettlePolicy::decide ─► Settler: ack | retry | requeue | dead-letter (reason headers)
//! beside it: cleanup of old inbox rows, the inbox_rows gauge, counters (Tally), metrics,
//!   the store circuit (a store outage pauses consumption; nothing is charged to the messages)
//! and apart: the outbox relay (take_pending ─► publish with confirms ─► mark_published)
//! ```
//!
//! Why a runtime at all: the inbox makes one transaction exactly-once, but a
//! consumer also has to ack only after the commit, bound its retries, keep a
//! poison message from looping, say why it dead-lettered something, survive
//! a broker or database restart and stop without losing a delivery. Written
//! once here, a new consumer gets all of it by implementing [`Handler`]
//! (`examples/orders.rs` is a service of two, in under 60 lines).
//!
//! - [`handler`]: the trait a consumer implements, and [`handler_fn`],
//!   which makes a plain async function one.
//! - [`context`]: what a handler gets: the transaction, the message's id,
//!   and [`Context::publish`], the outbox one call away.
//! - [`service`]: [`Service`], the builder that runs handlers on queues.
//! - [`settle`]: the one decision of what happens after an attempt.
//! - [`availability`]: the store circuit, which pauses consumption during a
//!   store outage, and the start-up check of the store.
//! - [`relay`]: [`Relay`], the outbox's publisher (confirms, stable ids),
//!   started beside the consumers by [`Service::with_relay`] with its
//!   [`wakeups`].
//! - [`replay`]: moving dead letters back to their queue after a fix.
//! - [`identity`]: where a consumer's message id comes from (the
//!   `message_id` property, a header, a body field, the body's hash).
//! - [`config`], [`topology`], [`message`], [`decode`]: settings, queue
//!   names, a delivery's parts and their decoding.
//! - [`delivery`]: what the message path needs of a broker, written once
//!   above every broker: [`delivery::Delivery`] (what it reads),
//!   [`delivery::Settler`] (ack, requeue, dead-letter) and
//!   [`delivery::Subscription`] (a queue's deliveries, paused during a
//!   store outage). [`broker::Broker`] is what the service's supervisor
//!   needs beside them (connect, declare, subscribe, close), and
//!   [`brokers`] picks the broker a URL names. RabbitMQ's implementations
//!   are a private module beside [`amqp`]; the relay's publishing is a
//!   trait of its own, inside [`relay`].
//! - [`amqp`], [`backoff`], [`shutdown`], [`telemetry`], [`tally`],
//!   [`redact`], [`error`]: plumbing.
//! - `http` (feature `http`): `/metrics`, `/live` and `/ready`.
//! - `nats` (feature `nats`): NATS JetStream as a second broker, picked by
//!   a `nats://` URL; its name mapping in `nats::names`.

#![deny(missing_docs)]

#[cfg(not(any(feature = "rabbitmq", feature = "nats")))]
compile_error!(
    "inbox-runtime needs a broker: enable its `rabbitmq` feature (on by default) or `nats`"
);

#[cfg(feature = "rabbitmq")]
pub mod amqp;
pub mod availability;
pub mod backoff;
pub mod broker;
pub mod brokers;
pub mod config;
pub mod context;
pub mod decode;
pub mod delivery;
pub mod error;
pub mod handler;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "http")]
pub mod idempotency;
pub mod identity;
pub mod message;
pub mod redact;
pub mod relay;
#[cfg(feature = "rabbitmq")]
pub mod replay;
pub mod service;
pub mod settle;
pub mod shutdown;
pub mod tally;
pub mod telemetry;
mod text;
pub mod topology;
pub mod trace;
pub mod wakeups;

#[cfg(feature = "nats")]
pub mod nats;
mod queue;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;
mod worker;

use inbox_api::{AttemptLedger, BatchTransaction, InboxStats, InboxStore};

// What the public API names, so a service needs no version of its own.
/// async-nats, for a NATS producer or test beside the runtime (the `nats`
/// feature).
#[cfg(feature = "nats")]
pub use async_nats;
pub use inbox_api;
#[cfg(feature = "rabbitmq")]
pub use lapin;

/// The sqlx store (PostgreSQL), the `sqlx` feature's: [`sqlx_store::SqlxStore`].
#[cfg(feature = "sqlx")]
pub use inbox_backend_sqlx as sqlx_store;

/// The diesel-async store (PostgreSQL), the `diesel` feature's:
/// [`diesel_store::DieselStore`].
#[cfg(feature = "diesel")]
pub use inbox_backend_diesel as diesel_store;

/// The in-process store, the `memory` feature's: [`memory_store::MemoryStore`].
#[cfg(feature = "memory")]
pub use inbox_backend_memory as memory_store;

pub use config::{AvailabilityConfig, BatchConfig, CleanupConfig, ServiceConfig, WorkerConfig};
pub use context::{Context, Event};
pub use error::AppError;
pub use handler::{FnHandler, Handler, HandlerFn, handler_fn};
pub use identity::Identity;
pub use relay::{Relay, RelayConfig, RelayHandle};
pub use service::{BrokerReadiness, Service, ServiceHandle};
pub use settle::{ConflictPolicy, Deliveries, ErrorDisposition, Outcome, Settle, SettlePolicy};
pub use tally::{ConsumerTally, Tally};
pub use topology::{QueueType, Topology};
pub use wakeups::OutboxWakeups;

/// A store the runtime can run on: transactions with savepoints (batched
/// mode), row counts for the `inbox_rows` gauge, an attempt ledger (the
/// poison count that holds where the broker counts nothing), and cheap
/// clones (the cleanup and gauge tasks hold their own).
pub trait ServiceStore:
    InboxStore<Transaction: BatchTransaction> + InboxStats + AttemptLedger + Clone
{
}

impl<S> ServiceStore for S where
    S: InboxStore<Transaction: BatchTransaction> + InboxStats + AttemptLedger + Clone
{
}

/// What a service on the runtime names, in one `use`.
pub mod prelude {
    pub use crate::{
        AppError, ConflictPolicy, Context, Event, Handler, Identity, RelayConfig, Service,
        ServiceConfig, ServiceHandle, ServiceStore, Topology, handler_fn,
    };
    pub use inbox_api::{ConsumerName, MessageId};

    #[cfg(feature = "diesel")]
    pub use crate::diesel_store::{DieselStore, DieselTransaction};
    #[cfg(feature = "memory")]
    pub use crate::memory_store::{MemoryStore, MemoryTransaction};
    #[cfg(feature = "sqlx")]
    pub use crate::sqlx_store::{SqlxStore, SqlxTransaction};
}
