//! One error type for every store, classified by what the caller should do.

use std::sync::Arc;

/// A boxed error source, kept so the chain reaches the log.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What a message handler should do with a delivery that failed.
///
/// This is the only question an error has to answer at the broker boundary:
/// a retryable failure is redelivered (the same message will likely succeed
/// later), a permanent one goes to the dead-letter queue (retrying would loop
/// forever).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Disposition {
    /// Transient: roll back and redeliver later.
    Retry,
    /// Will fail again the same way: dead-letter with the reason.
    DeadLetter,
}

/// Everything that can go wrong in the inbox.
///
/// A duplicate delivery is *not* an error: it is [`crate::Claim::Duplicate`],
/// an outcome. Treating a unique violation as an error is how a duplicate
/// froze a Kafka partition in another inbox (Wolverine #2639).
///
/// Each variant is either retryable or permanent ([`InboxError::is_retryable`],
/// [`InboxError::disposition`]); backends classify driver errors by SQLSTATE
/// or error kind, never by message text.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// The message id is missing or not a UUID. Permanent.
    #[error("invalid message id {value:?}: {reason}")]
    InvalidMessageId {
        /// The offending text, truncated.
        value: String,
        /// Which rule it broke.
        reason: &'static str,
    },

    /// The consumer name breaks a rule of [`crate::ConsumerName`]. Permanent.
    #[error("invalid consumer name {value:?}: {reason}")]
    InvalidConsumerName {
        /// The offending text, truncated.
        value: String,
        /// Which rule it broke.
        reason: &'static str,
    },

    /// An outgoing message breaks a rule of [`crate::OutgoingMessage`]
    /// (a name the broker would refuse, an oversized body). Permanent: the
    /// producer's transaction must not commit a message that can never be
    /// published.
    #[error("invalid outgoing message: {field} {value:?}: {reason}")]
    InvalidOutgoingMessage {
        /// Which part of the message.
        field: &'static str,
        /// The offending text, truncated (empty for sizes and counts).
        value: String,
        /// Which rule it broke.
        reason: &'static str,
    },

    /// An argument outside its domain (a zero batch size, a bad schema
    /// name). Permanent: a programming or configuration error.
    #[error("invalid argument: {message}")]
    InvalidArgument {
        /// What was wrong.
        message: String,
    },

    /// The connection to the store failed or was lost. Retryable: whether the
    /// transaction committed is unknown, and redelivery resolves it (a
    /// committed claim answers `Duplicate`, a lost one `Fresh`).
    #[error("store connection failed")]
    Connection {
        /// The driver's error.
        #[source]
        source: BoxError,
    },

    /// No connection became free in time. Retryable.
    #[error("timed out waiting for a store connection")]
    PoolTimeout {
        /// The pool's error, when it gave one.
        #[source]
        source: Option<BoxError>,
    },

    /// The store aborted the transaction to resolve a conflict with another
    /// one (serialization failure 40001, deadlock 40P01). Retryable.
    #[error("transaction aborted by a concurrent conflict")]
    Conflict {
        /// The driver's error.
        #[source]
        source: BoxError,
    },

    /// Another transaction held a lock this one needed for longer than the
    /// store's lock timeout (PostgreSQL's `lock_timeout`, SQLSTATE 55P03):
    /// most often the claim of the same key by a holder that is slow,
    /// frozen (a paused VM, a stopped process) or cut off from the network.
    ///
    /// Retryable, and not the message's fault ([`InboxError::held_by_another`]):
    /// the holder either commits (the redelivery is then a duplicate) or is
    /// ended by the server (`idle_in_transaction_session_timeout`, a lost
    /// connection) and its claim released, so the delivery should go back
    /// to the broker without being charged a failed attempt.
    #[error("a lock held by another transaction was not released within the lock timeout")]
    LockTimeout {
        /// The driver's error.
        #[source]
        source: BoxError,
    },

    /// The inbox table or schema is missing, not what this code expects, or
    /// not the role's to use (no privilege). Permanent until someone
    /// migrates or grants: redelivering cannot fix it. It is the
    /// deployment's fault, not the message's: a consuming service pauses on
    /// it rather than dead-lettering.
    #[error("inbox schema is missing, incompatible or not accessible")]
    Schema {
        /// The driver's error.
        #[source]
        source: BoxError,
    },

    /// Any other store failure, classified by the backend.
    #[error("store failed")]
    Store {
        /// Whether redelivery can help.
        retryable: bool,
        /// The driver's error.
        #[source]
        source: BoxError,
    },

    /// The transaction of a whole batch ([`crate::Inbox::handle_batch`])
    /// failed at a store step, so this message, like every other of the
    /// batch, was not committed (or, for a lost commit, may have been:
    /// redelivery resolves it). Each message of the batch carries the same
    /// shared cause; retryable and labelled as that cause.
    #[error("the batch's transaction failed")]
    BatchAborted {
        /// The store error that ended the batch, shared by its messages.
        #[source]
        source: Arc<InboxError>,
    },

    /// The message is older than the store's retention and the store can no
    /// longer tell whether it was processed: the record of its first copy
    /// may already have been dropped (PostgreSQL's partitioned layout drops
    /// a whole day of ids at once). Permanent: claiming it could run the
    /// work a second time, so it is dead-lettered with the reason
    /// `expired` for an operator to decide.
    #[error("message {message_id} is older than the inbox's retention")]
    Expired {
        /// The message id, as text.
        message_id: String,
    },

    /// A batch's claim ([`crate::BatchTransaction::claim_batch`]) was
    /// refused because of one or more of its keys, without saying which
    /// (PostgreSQL's partitioned layout: one key whose day has no partition,
    /// expired or ahead of the maintenance, fails the batch's one INSERT).
    /// [`crate::Inbox::handle_batch`] then claims that batch's keys one by
    /// one, so that only the refused keys are charged, each with its own
    /// error, and the others are processed. Retryable where it surfaces.
    #[error("a batch's claim was refused because of a key it did not name")]
    KeyRefusedInBatch {
        /// The driver's error.
        #[source]
        source: BoxError,
    },

    /// Not run in this batch: an earlier copy of the same message in the
    /// batch failed, and its failure decides. Retryable, and not this
    /// delivery's own failure: hand it back without charging it.
    #[error("deferred: an earlier copy of this message in the batch failed")]
    Deferred,

    /// The consumer's own work failed. The transaction was rolled back; the
    /// consumer decided whether the failure is worth a retry.
    #[error("handler failed")]
    Handler {
        /// Whether redelivery can help.
        retryable: bool,
        /// The consumer's error.
        #[source]
        source: BoxError,
    },
}

impl InboxError {
    /// A handler failure worth retrying (a timeout of a downstream call, say).
    pub fn retryable_handler(source: impl Into<BoxError>) -> Self {
        Self::Handler {
            retryable: true,
            source: source.into(),
        }
    }

    /// A handler failure that will repeat on every delivery (the message
    /// breaks a business rule, say): dead-letter it.
    pub fn permanent_handler(source: impl Into<BoxError>) -> Self {
        Self::Handler {
            retryable: false,
            source: source.into(),
        }
    }

    /// Whether redelivering the message can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::InvalidMessageId { .. }
            | Self::InvalidConsumerName { .. }
            | Self::InvalidOutgoingMessage { .. }
            | Self::InvalidArgument { .. }
            | Self::Expired { .. }
            | Self::Schema { .. } => false,
            Self::Connection { .. }
            | Self::PoolTimeout { .. }
            | Self::Conflict { .. }
            | Self::LockTimeout { .. }
            | Self::KeyRefusedInBatch { .. }
            | Self::Deferred => true,
            Self::Store { retryable, .. } | Self::Handler { retryable, .. } => *retryable,
            Self::BatchAborted { source } => source.is_retryable(),
        }
    }

    /// Whether the failure is another transaction's, not the message's: it
    /// held what this attempt needed past the lock timeout
    /// ([`InboxError::LockTimeout`], also as the cause of a
    /// [`InboxError::BatchAborted`]). A consumer hands such a delivery back
    /// without counting it against the message's retry budget: a frozen
    /// holder must not walk a healthy message into the dead-letter queue.
    pub fn held_by_another(&self) -> bool {
        match self {
            Self::LockTimeout { .. } => true,
            Self::BatchAborted { source } => source.held_by_another(),
            _ => false,
        }
    }

    /// What to do with the delivery: redeliver or dead-letter.
    pub fn disposition(&self) -> Disposition {
        if self.is_retryable() {
            Disposition::Retry
        } else {
            Disposition::DeadLetter
        }
    }

    /// A short, stable label for metrics and dead-letter reasons.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidMessageId { .. } => "invalid_message_id",
            Self::InvalidConsumerName { .. } => "invalid_consumer_name",
            Self::InvalidOutgoingMessage { .. } => "invalid_outgoing_message",
            Self::InvalidArgument { .. } => "invalid_argument",
            Self::Connection { .. } => "connection",
            Self::PoolTimeout { .. } => "pool_timeout",
            Self::Conflict { .. } => "conflict",
            Self::LockTimeout { .. } => "lock_timeout",
            Self::Schema { .. } => "schema",
            Self::Store { .. } => "store",
            Self::Handler { .. } => "handler",
            Self::Expired { .. } => "expired",
            Self::Deferred => "deferred",
            Self::KeyRefusedInBatch { .. } => "key_refused_in_batch",
            Self::BatchAborted { source } => source.kind(),
        }
    }
}

/// The error and its chain of sources on one line, for logs and the
/// dead-letter detail header, the same in every crate.
///
/// A cause that its error's own text already ends with is not repeated:
/// some drivers (sqlx's I/O error) print their source in their message too,
/// which read "Connection refused (os error 111): Connection refused (os
/// error 111)".
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        let cause = inner.to_string();
        if !text.ends_with(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
        source = inner.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io() -> BoxError {
        Box::new(std::io::Error::other("boom"))
    }

    #[test]
    fn classification() {
        let retryable = [
            InboxError::Connection { source: io() },
            InboxError::PoolTimeout { source: None },
            InboxError::Conflict { source: io() },
            InboxError::retryable_handler(io()),
            InboxError::Store {
                retryable: true,
                source: io(),
            },
        ];
        for e in &retryable {
            assert!(e.is_retryable(), "{e:?}");
            assert_eq!(e.disposition(), Disposition::Retry);
        }
        let permanent = [
            InboxError::Schema { source: io() },
            InboxError::permanent_handler(io()),
            InboxError::InvalidArgument {
                message: "x".into(),
            },
        ];
        for e in &permanent {
            assert!(!e.is_retryable(), "{e:?}");
            assert_eq!(e.disposition(), Disposition::DeadLetter);
        }
    }

    #[test]
    fn source_is_kept() {
        let e = InboxError::Connection { source: io() };
        let src = std::error::Error::source(&e).expect("source kept");
        assert_eq!(src.to_string(), "boom");
    }

    /// Every variant's label and disposition, pinned: the labels are
    /// metric label values and dead-letter reasons that dashboards and
    /// alerts match on, so changing one is a breaking change.
    #[test]
    fn every_kind_label_and_disposition() {
        let conflict = InboxError::Conflict { source: io() };
        let schema = InboxError::Schema { source: io() };
        let cases: Vec<(InboxError, &str, bool)> = vec![
            (
                InboxError::InvalidMessageId {
                    value: "x".into(),
                    reason: "r",
                },
                "invalid_message_id",
                false,
            ),
            (
                InboxError::InvalidConsumerName {
                    value: "x".into(),
                    reason: "r",
                },
                "invalid_consumer_name",
                false,
            ),
            (
                InboxError::InvalidOutgoingMessage {
                    field: "exchange",
                    value: "x".into(),
                    reason: "r",
                },
                "invalid_outgoing_message",
                false,
            ),
            (
                InboxError::InvalidArgument {
                    message: "x".into(),
                },
                "invalid_argument",
                false,
            ),
            (InboxError::Connection { source: io() }, "connection", true),
            (
                InboxError::PoolTimeout { source: None },
                "pool_timeout",
                true,
            ),
            (InboxError::Conflict { source: io() }, "conflict", true),
            (
                InboxError::LockTimeout { source: io() },
                "lock_timeout",
                true,
            ),
            (InboxError::Schema { source: io() }, "schema", false),
            (
                InboxError::Store {
                    retryable: true,
                    source: io(),
                },
                "store",
                true,
            ),
            (
                InboxError::Store {
                    retryable: false,
                    source: io(),
                },
                "store",
                false,
            ),
            (InboxError::retryable_handler(io()), "handler", true),
            (InboxError::permanent_handler(io()), "handler", false),
            (InboxError::Deferred, "deferred", true),
            (
                InboxError::Expired {
                    message_id: "x".into(),
                },
                "expired",
                false,
            ),
            (
                InboxError::BatchAborted {
                    source: Arc::new(conflict),
                },
                "conflict",
                true,
            ),
            (
                InboxError::BatchAborted {
                    source: Arc::new(schema),
                },
                "schema",
                false,
            ),
        ];
        for (error, kind, retryable) in cases {
            assert_eq!(error.kind(), kind, "{error:?}");
            assert_eq!(error.is_retryable(), retryable, "{error:?}");
            let expected = if retryable {
                Disposition::Retry
            } else {
                Disposition::DeadLetter
            };
            assert_eq!(error.disposition(), expected, "{error:?}");
        }
    }

    #[test]
    fn only_a_lock_timeout_is_held_by_another() {
        let lock_timeout = || InboxError::LockTimeout { source: io() };
        assert!(lock_timeout().held_by_another());
        assert!(
            InboxError::BatchAborted {
                source: Arc::new(lock_timeout()),
            }
            .held_by_another()
        );
        for other in [
            InboxError::Conflict { source: io() },
            InboxError::Connection { source: io() },
            InboxError::retryable_handler(io()),
            InboxError::Deferred,
            InboxError::BatchAborted {
                source: Arc::new(InboxError::Conflict { source: io() }),
            },
        ] {
            assert!(!other.held_by_another(), "{other:?}");
        }
    }

    #[test]
    fn a_batch_abort_keeps_its_cause() {
        let error = InboxError::BatchAborted {
            source: Arc::new(InboxError::Connection { source: io() }),
        };
        let cause = std::error::Error::source(&error).expect("cause kept");
        assert_eq!(cause.to_string(), "store connection failed");
        assert_eq!(
            std::error::Error::source(cause).map(ToString::to_string),
            Some("boom".to_owned())
        );
    }
}
