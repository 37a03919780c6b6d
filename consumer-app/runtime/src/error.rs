//! The runtime's one error type, shared with the handlers it runs.
//!
//! One type rather than one per layer: a handler's error travels through the
//! inbox and the settle policy unchanged, so the policy can ask it what to do
//! ([`AppError::disposition`]) and the dead-letter header can carry its
//! stable label ([`AppError::reason`]).

use std::time::Duration;

use inbox_api::InboxError;

use crate::message::BadInput;
use crate::settle::ErrorDisposition;

/// Everything that can go wrong in a service built on the runtime, its
/// handlers included.
///
/// Like [`InboxError`], each error says what the message path must do with
/// the delivery ([`AppError::disposition`]): retry it, hand it back to the
/// broker, or dead-letter it with [`AppError::reason`] as the reason.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AppError {
    /// The inbox or the store behind it failed; its own classification holds.
    #[error(transparent)]
    Inbox(#[from] InboxError),

    /// The delivery cannot be processed, now or ever.
    #[error(transparent)]
    BadInput(#[from] BadInput),

    /// The broker refused or lost something.
    #[error("broker: {context}")]
    Broker {
        /// What the app was doing.
        context: String,
        /// The broker client's error (lapin's, async-nats').
        #[source]
        source: inbox_api::BoxError,
    },

    /// The broker refused the login (AMQP `ACCESS_REFUSED`): wrong or
    /// rotated credentials, no access to the vhost, a client certificate it
    /// does not take. At start-up it ends the command (a configuration
    /// error); a running service retries it (a rotation in progress).
    #[error("credentials refused by the broker at {url}")]
    CredentialsRefused {
        /// The broker's URL, password hidden.
        url: String,
        /// The broker client's error, with the broker's reply.
        #[source]
        source: inbox_api::BoxError,
    },

    /// A publish was not confirmed by the broker (nack, or returned).
    #[error("publish not confirmed: {0}")]
    NotConfirmed(String),

    /// One handling of a delivery took longer than its bound; the
    /// transaction was dropped, so it rolled back.
    #[error("handling timed out after {0:?}")]
    Timeout(Duration),

    /// The handler gave this attempt up without blaming the message (it is
    /// shutting down, or a test stands in for a process dying mid-
    /// transaction): the transaction rolled back and the delivery goes
    /// straight back to the broker, uncharged, as a crash would leave it.
    #[error("attempt abandoned: {0}")]
    Abandoned(String),

    /// A non-transactional downstream call (an HTTP API, a mail sender)
    /// failed after the commit.
    #[error("downstream call failed: {message}")]
    Downstream {
        /// Whether calling again may succeed.
        retryable: bool,
        /// What failed.
        message: String,
    },

    /// A flag or setting is unusable.
    #[error("configuration: {0}")]
    Config(String),

    /// A local I/O failure (metrics listener, signal handler, a child
    /// process).
    #[error("{context}")]
    Io {
        /// What the app was doing.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// A service (PostgreSQL, RabbitMQ) stayed unreachable.
    #[error("{0}")]
    Unavailable(String),
}

impl AppError {
    /// Wraps a broker client's error with what the app was doing.
    pub fn broker(context: impl Into<String>, source: impl Into<inbox_api::BoxError>) -> Self {
        Self::Broker {
            context: context.into(),
            source: source.into(),
        }
    }

    /// A failure of the handler's own that may pass on a later attempt (a
    /// downstream that timed out, a row another message has yet to write):
    /// retried in process, then handed back, then dead-lettered as
    /// `handler` when the poison count is spent.
    pub fn transient(error: impl Into<inbox_api::BoxError>) -> Self {
        Self::Inbox(InboxError::retryable_handler(error))
    }

    /// A failure of the handler's own that no attempt will mend (a rule of
    /// the business the message breaks): dead-lettered as `handler` at once.
    pub fn permanent(error: impl Into<inbox_api::BoxError>) -> Self {
        Self::Inbox(InboxError::permanent_handler(error))
    }

    /// Whether delivering the message again can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Inbox(e) => e.is_retryable(),
            Self::Downstream { retryable, .. } => *retryable,
            Self::Broker { .. }
            | Self::NotConfirmed(_)
            | Self::Timeout(_)
            | Self::Abandoned(_)
            | Self::Io { .. }
            | Self::Unavailable(_) => true,
            Self::BadInput(_) | Self::Config(_) | Self::CredentialsRefused { .. } => false,
        }
    }

    /// What the settle policy does with a delivery that failed with this
    /// error: retry it, hand it back to the broker at once, pause for the
    /// store, or dead-letter it.
    ///
    /// A lock another transaction held past the store's lock timeout
    /// ([`InboxError::held_by_another`]: a frozen holder of the same key) is
    /// handed back at once, uncharged: retrying in process would only wait
    /// on the same holder again, and it is not the message's fault.
    pub fn disposition(&self) -> ErrorDisposition {
        match self {
            Self::Abandoned(_) => ErrorDisposition::Requeue,
            Self::Inbox(error) if error.held_by_another() => ErrorDisposition::Requeue,
            error if error.is_store_unavailable() => ErrorDisposition::StoreUnavailable,
            error if error.is_retryable() => ErrorDisposition::Retry,
            _ => ErrorDisposition::DeadLetter,
        }
    }

    /// Whether the store, not the message, failed: it cannot be reached
    /// (connection refused or lost, the server shutting down or starting,
    /// no pooled connection in time) or the whole schema is unusable
    /// (missing, not migrated, or not this role's to use). Every message
    /// would fail the same way right now, so the runtime pauses consumption
    /// and hands the delivery back uncharged instead of spending its retries
    /// or dead-lettering it; a failure of one message (a conflict, a
    /// constraint, a handler's own error) is not one of these.
    ///
    /// Which SQLSTATE falls in which class is `inbox-postgres`' table; this
    /// is the one place that reads the classes as "the store is away".
    pub fn is_store_unavailable(&self) -> bool {
        match self {
            Self::Inbox(error) => store_unavailable(error),
            _ => false,
        }
    }

    /// A short, stable label: the dead-letter reason and the metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Inbox(e) => e.kind(),
            Self::BadInput(b) => b.reason.as_str(),
            Self::Broker { .. } => "broker",
            Self::CredentialsRefused { .. } => "credentials_refused",
            Self::NotConfirmed(_) => "not_confirmed",
            Self::Timeout(_) => "timeout",
            Self::Abandoned(_) => "abandoned",
            Self::Downstream { .. } => "downstream",
            Self::Config(_) => "config",
            Self::Io { .. } => "io",
            Self::Unavailable(_) => "unavailable",
        }
    }
}

/// [`AppError::is_store_unavailable`] for the inbox's error (a failed batch
/// by the cause it shares).
fn store_unavailable(error: &InboxError) -> bool {
    match error {
        InboxError::Connection { .. }
        | InboxError::PoolTimeout { .. }
        | InboxError::Schema { .. } => true,
        InboxError::BatchAborted { source } => store_unavailable(source),
        _ => false,
    }
}

/// The error and its chain of sources on one line, for logs and the
/// dead-letter detail header: `inbox-api`'s one function.
pub use inbox_api::chain;

// `?` on a driver's error in a handler: the backend's own classification
// decides what the runtime does with it (a serialization failure retries, a
// constraint violation dead-letters), so a handler needs no `map_err`.
#[cfg(feature = "sqlx")]
impl From<inbox_backend_sqlx::sqlx::Error> for AppError {
    fn from(error: inbox_backend_sqlx::sqlx::Error) -> Self {
        Self::Inbox(inbox_backend_sqlx::classify(error))
    }
}

/// A migration that fails (the application's migrator running the inbox's
/// migrations, `sqlx_store::migrations::migrator`) leaves the schema
/// unusable: the store's failure, as a missing schema is.
#[cfg(feature = "sqlx")]
impl From<inbox_backend_sqlx::sqlx::migrate::MigrateError> for AppError {
    fn from(error: inbox_backend_sqlx::sqlx::migrate::MigrateError) -> Self {
        Self::Inbox(InboxError::Schema {
            source: Box::new(error),
        })
    }
}

#[cfg(feature = "diesel")]
impl From<inbox_backend_diesel::diesel::result::Error> for AppError {
    fn from(error: inbox_backend_diesel::diesel::result::Error) -> Self {
        Self::Inbox(inbox_backend_diesel::classify(error))
    }
}

#[cfg(feature = "diesel")]
impl From<inbox_backend_diesel::diesel_async::pooled_connection::deadpool::PoolError> for AppError {
    fn from(
        error: inbox_backend_diesel::diesel_async::pooled_connection::deadpool::PoolError,
    ) -> Self {
        Self::Inbox(inbox_backend_diesel::classify_pool(error))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_held_by_another_is_requeued_uncharged() {
        let lock_timeout = || InboxError::LockTimeout {
            source: "canceling statement due to lock timeout".into(),
        };
        assert_eq!(
            AppError::from(lock_timeout()).disposition(),
            ErrorDisposition::Requeue
        );
        let batch = InboxError::BatchAborted {
            source: std::sync::Arc::new(lock_timeout()),
        };
        assert_eq!(
            AppError::from(batch).disposition(),
            ErrorDisposition::Requeue
        );
        let conflict = InboxError::Conflict {
            source: "deadlock detected".into(),
        };
        assert_eq!(
            AppError::from(conflict).disposition(),
            ErrorDisposition::Retry
        );
    }

    /// An error that prints its source in its own message, as sqlx's
    /// `Io` does.
    #[derive(Debug, thiserror::Error)]
    #[error("error communicating with database: {0}")]
    struct Echoing(#[source] std::io::Error);

    fn io() -> inbox_api::BoxError {
        Box::new(std::io::Error::other("boom"))
    }

    #[test]
    fn store_wide_failures_pause_and_a_message_s_own_do_not() {
        let store_wide = [
            InboxError::Connection { source: io() },
            InboxError::PoolTimeout { source: None },
            InboxError::Schema { source: io() },
            InboxError::BatchAborted {
                source: std::sync::Arc::new(InboxError::Connection { source: io() }),
            },
        ];
        for error in store_wide {
            let error = AppError::from(error);
            assert!(error.is_store_unavailable(), "{error:?}");
            assert_eq!(error.disposition(), ErrorDisposition::StoreUnavailable);
        }
        let own = [
            AppError::from(InboxError::Conflict { source: io() }),
            AppError::from(InboxError::Store {
                retryable: false,
                source: io(),
            }),
            AppError::from(InboxError::retryable_handler(io())),
            AppError::from(InboxError::BatchAborted {
                source: std::sync::Arc::new(InboxError::Conflict { source: io() }),
            }),
            AppError::Timeout(Duration::from_secs(1)),
            AppError::Downstream {
                retryable: true,
                message: "503".into(),
            },
        ];
        for error in own {
            assert!(!error.is_store_unavailable(), "{error:?}");
            assert_ne!(error.disposition(), ErrorDisposition::StoreUnavailable);
        }
    }

    #[test]
    fn chain_names_each_cause_once() {
        let refused = || std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let error = AppError::Io {
            context: "connect".into(),
            source: std::io::Error::other(Echoing(refused())),
        };
        let text = chain(&error);
        let cause = refused().to_string();
        assert_eq!(text.matches(&cause).count(), 1, "{text}");
        assert!(
            text.starts_with("connect: error communicating with database: "),
            "{text}"
        );
    }
}
