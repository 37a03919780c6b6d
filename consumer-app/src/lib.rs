//! The Parcel Tracking service, the first user of [`inbox_runtime`] (the
//! generic RabbitMQ runtime: delivery → key → [`inbox_api::Inbox::handle`] /
//! `handle_batch` → settle, reason headers, batching, shutdown, reconnect,
//! metrics), and the tools around both.
//!
//! Two places, the second knowing the first:
//!
//! - [`parcel`]: the Parcel Tracking domain, the runtime's first user: two
//!   consumers of `parcel.created`, their effects, downstream calls, events,
//!   and one file per store backend.
//! - [`tools`]: what exercises both: the command line's pieces, the demo,
//!   the load generator, store selection and fault injection.
//!
//! `consumer-app/runtime/examples/orders.rs` is a second, tiny user of the
//! runtime, of another domain.

#![deny(missing_docs)]

pub mod parcel;
pub mod tools;

pub use inbox_runtime::AppError;

/// What the service's commands fail with: the runtime's errors, and the
/// demo's proof not holding (a result, not a failure of any message, so it
/// is no handler error).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The runtime, a store or the broker failed.
    #[error(transparent)]
    App(#[from] AppError),
    /// The demo ran, and what it checks did not hold.
    #[error("check failed: {0}")]
    CheckFailed(String),
}

#[cfg(not(any(feature = "sqlx", feature = "diesel", feature = "memory")))]
compile_error!("enable at least one store feature: sqlx, diesel or memory");
