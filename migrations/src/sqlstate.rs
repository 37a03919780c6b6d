//! PostgreSQL errors mapped onto [`InboxError`], by SQLSTATE.
//!
//! The mapping answers one question for the broker boundary: redeliver or
//! dead-letter. It is keyed on the SQLSTATE, never on message text:
//! messages are localised by the server (`lc_messages`) and change between
//! versions, SQLSTATEs do not. Each driver only says what it knows about a
//! failure (the SQLSTATE, or a driver-level [`ErrorClass`] for errors that
//! never reached the server) and keeps the driver's error as the source.
//!
//! | SQLSTATE | meaning | [`InboxError`] |
//! |---|---|---|
//! | 40001, 40P01, other class 40 | serialization failure, deadlock, other rollbacks | `Conflict` (retry) |
//! | 55P03 | lock not available: `lock_timeout` (or `NOWAIT`) gave up on another transaction's lock | `LockTimeout` (retry, not charged to the message) |
//! | class 08, 57P01–57P03, 57P05, 25P03, 40003 | connection lost, terminated, server shutting down or starting, idle timeouts, commit outcome unknown | `Connection` (retry) |
//! | 57014, 25006, class 53, class 58 | statement timeout or cancel, read-only (failover), out of resources, system error | `Store { retryable: true }` |
//! | 42P01, 3F000, 42703, 42883, 42704, 42501 | undefined table / schema / column / function / object, insufficient privilege | `Schema` (permanent for the message; a consuming service pauses until someone migrates or grants) |
//! | class 22, class 23, anything else | data errors, constraint violations, syntax, the unforeseen | `Store { retryable: false }` |

use inbox_api::{BoxError, InboxError};

/// What a failure means for the delivery, before the driver's error is
/// attached as the source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// The server aborted the transaction to resolve a conflict. Retryable.
    Conflict,
    /// Another transaction held a lock past `lock_timeout`. Retryable, and
    /// not the message's fault.
    LockTimeout,
    /// The connection failed, or the outcome is unknown. Retryable.
    Connection,
    /// No pooled connection became free in time. Retryable.
    PoolTimeout,
    /// The schema is missing, not what the code expects, or not the
    /// role's to use. Permanent for the message (redelivery cannot fix
    /// it); a store-wide condition, which a consuming service waits out.
    Schema,
    /// Any other failure, retryable or not.
    Store {
        /// Whether redelivery can help.
        retryable: bool,
    },
}

impl ErrorClass {
    /// Classifies a SQLSTATE (the five-character code of a PostgreSQL
    /// error).
    ///
    /// Unknown codes are permanent: a message that fails in a way nobody
    /// anticipated goes to the dead-letter queue where a person sees it,
    /// instead of looping through redeliveries.
    pub fn of_sqlstate(code: &str) -> Self {
        match code {
            // serialization_failure, deadlock_detected: the textbook
            // retryable conflicts (MassTransit #5114).
            "40001" | "40P01" => Self::Conflict,
            // lock_not_available: lock_timeout (or NOWAIT) gave up on a lock
            // another transaction holds, typically a claim of the same key
            // by a frozen holder. Its own kind, so that the consumer hands
            // the delivery back without charging it.
            "55P03" => Self::LockTimeout,
            // statement_completion_unknown: like a lost connection, the
            // outcome is unknown and redelivery resolves it.
            "40003" => Self::Connection,
            // Other class 40 codes (transaction_rollback) are rollbacks
            // forced by concurrency too.
            c if c.starts_with("40") => Self::Conflict,
            // admin_shutdown (pg_terminate_backend), crash_shutdown,
            // cannot_connect_now (starting up), idle_session_timeout; and
            // idle_in_transaction_session_timeout, after which the server
            // closes the connection.
            "57P01" | "57P02" | "57P03" | "57P05" | "25P03" => Self::Connection,
            // connection_exception and its subclasses.
            c if c.starts_with("08") => Self::Connection,
            // query_canceled (statement_timeout, pg_cancel_backend): the next
            // attempt may well run under less load. read_only_sql_transaction:
            // connected to a standby during a failover; a later connection
            // reaches the new primary.
            "57014" | "25006" => Self::Store { retryable: true },
            // undefined_table, invalid_schema_name, undefined_column,
            // undefined_function, undefined_object: nobody migrated this
            // schema. insufficient_privilege: the role may not use it. Both
            // are the deployment's fault, never one message's.
            "42P01" | "3F000" | "42703" | "42883" | "42704" | "42501" => Self::Schema,
            // insufficient_resources (disk full, out of memory, too many
            // connections) and system errors (I/O): they pass.
            c if c.starts_with("53") || c.starts_with("58") => Self::Store { retryable: true },
            // data_exception, integrity_constraint_violation, syntax, and
            // anything unforeseen: this input fails the same way every time.
            _ => Self::Store { retryable: false },
        }
    }

    /// The [`InboxError`] of this class, keeping `source` (the driver's
    /// error) for the log.
    pub fn into_error(self, source: BoxError) -> InboxError {
        match self {
            Self::Conflict => InboxError::Conflict { source },
            Self::LockTimeout => InboxError::LockTimeout { source },
            Self::Connection => InboxError::Connection { source },
            Self::PoolTimeout => InboxError::PoolTimeout {
                source: Some(source),
            },
            Self::Schema => InboxError::Schema { source },
            Self::Store { retryable } => InboxError::Store { retryable, source },
        }
    }
}

/// Classifies a PostgreSQL error by its SQLSTATE, keeping `source`:
/// [`ErrorClass::of_sqlstate`] then [`ErrorClass::into_error`].
pub fn classify_sqlstate(code: &str, source: BoxError) -> InboxError {
    ErrorClass::of_sqlstate(code).into_error(source)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(code: &str) -> ErrorClass {
        ErrorClass::of_sqlstate(code)
    }

    #[test]
    fn conflicts() {
        for code in ["40001", "40P01", "40002"] {
            assert_eq!(class(code), ErrorClass::Conflict, "{code}");
        }
    }

    #[test]
    fn lock_timeouts() {
        assert_eq!(class("55P03"), ErrorClass::LockTimeout);
        let error = classify_sqlstate("55P03", "canceling statement due to lock timeout".into());
        assert!(error.is_retryable() && error.held_by_another(), "{error:?}");
        assert_eq!(error.kind(), "lock_timeout");
    }

    #[test]
    fn lost_connections() {
        for code in [
            "08000", "08003", "08006", "08001", "08P01", "57P01", "57P02", "57P03", "57P05",
            "25P03", "40003",
        ] {
            assert_eq!(class(code), ErrorClass::Connection, "{code}");
        }
    }

    #[test]
    fn missing_schema() {
        for code in ["42P01", "3F000", "42703", "42883", "42704", "42501"] {
            assert_eq!(class(code), ErrorClass::Schema, "{code}");
        }
    }

    #[test]
    fn transient_store_failures() {
        for code in [
            "53000", "53100", "53200", "53300", "58030", "57014", "25006",
        ] {
            assert_eq!(class(code), ErrorClass::Store { retryable: true }, "{code}");
        }
    }

    #[test]
    fn permanent_store_failures() {
        for code in [
            "22001", "22P02", "23505", "23502", "23503", "42601", "XX000", "25P02", "",
        ] {
            assert_eq!(
                class(code),
                ErrorClass::Store { retryable: false },
                "{code}"
            );
        }
    }

    #[test]
    fn errors_keep_their_source_and_disposition() {
        type IsKind = fn(&InboxError) -> bool;
        let cases: [(&str, IsKind, bool); 5] = [
            ("40P01", |e| matches!(e, InboxError::Conflict { .. }), true),
            (
                "57P01",
                |e| matches!(e, InboxError::Connection { .. }),
                true,
            ),
            ("42P01", |e| matches!(e, InboxError::Schema { .. }), false),
            (
                "57014",
                |e| {
                    matches!(
                        e,
                        InboxError::Store {
                            retryable: true,
                            ..
                        }
                    )
                },
                true,
            ),
            (
                "23505",
                |e| {
                    matches!(
                        e,
                        InboxError::Store {
                            retryable: false,
                            ..
                        }
                    )
                },
                false,
            ),
        ];
        for (code, is_kind, retryable) in cases {
            let error = classify_sqlstate(code, format!("server said {code}").into());
            assert!(is_kind(&error), "{code}: {error:?}");
            assert_eq!(error.is_retryable(), retryable, "{code}");
            let source = std::error::Error::source(&error).expect("source kept");
            assert_eq!(source.to_string(), format!("server said {code}"));
        }
        let timeout = ErrorClass::PoolTimeout.into_error("waited".into());
        assert!(matches!(
            timeout,
            InboxError::PoolTimeout { source: Some(_) }
        ));
        assert!(timeout.is_retryable());
    }
}

/// Whether a SQLSTATE says the server refused the login (class 28:
/// `invalid_authorization_specification`, `invalid_password`; a
/// `pg_hba.conf` line that rejects the connection, or none that matches).
pub fn is_login_refused(code: &str) -> bool {
    code.starts_with("28")
}

/// A store constructor's failed connect, as both drivers report it: the
/// URL it tried, password hidden, beside the cause. A refused login is a
/// configuration error ([`InboxError::InvalidArgument`], permanent) that
/// says "credentials refused": retrying cannot mend a wrong password, and
/// "connection failed" would send an operator to the network.
pub fn connect_failed(url: &str, login_refused: bool, error: InboxError) -> InboxError {
    let url = inbox_api::redact_url(url);
    if login_refused {
        return InboxError::InvalidArgument {
            message: format!(
                "credentials refused by PostgreSQL at {url}: {}",
                inbox_api::chain(&error)
            ),
        };
    }
    match error {
        InboxError::Connection { source } => InboxError::Connection {
            source: Box::new(ConnectTo { url, source }),
        },
        other => other,
    }
}

/// [`connect_failed`]'s context: which URL the cause is about.
#[derive(Debug)]
struct ConnectTo {
    url: String,
    source: BoxError,
}

impl std::fmt::Display for ConnectTo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "connect to {}", self.url)
    }
}

impl std::error::Error for ConnectTo {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.source.as_ref())
    }
}
