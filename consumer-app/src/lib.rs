//! Exactly-once effects for RabbitMQ consumers through the inbox: a generic
//! runtime, the Parcel Tracking service built on it, and the tools around
//! both.
//!
//! Three places, each knowing only the ones before it:
//!
//! - [`runtime`]: the generic RabbitMQ runtime (delivery → key →
//!   [`inbox_api::Inbox::handle`] / `handle_batch` → settle, reason headers,
//!   batching, shutdown, reconnect, metrics). It knows no domain: a consumer
//!   is a [`runtime::Handler`], wired in with [`runtime::Service`].
//! - [`parcel`]: the Parcel Tracking domain, the runtime's first user: two
//!   consumers of `parcel.created`, their effects, downstream calls, events,
//!   and one file per store backend.
//! - [`tools`]: what exercises both: the command line's pieces, the demo,
//!   the load generator, store selection and fault injection.
//!
//! `consumer-app/examples/invoice_paid.rs` is a second, tiny user of the
//! runtime, of another domain: a handler and a few lines of wiring.

#![deny(missing_docs)]

pub mod parcel;
pub mod runtime;
pub mod tools;

pub use runtime::AppError;

#[cfg(not(any(feature = "sqlx", feature = "diesel", feature = "memory")))]
compile_error!("enable at least one store feature: sqlx, diesel or memory");
