//! diesel / pool errors → [`InboxError`], by what the caller should do.
//!
//! The SQLSTATE table is `inbox-postgres`'s
//! ([`inbox_postgres::ErrorClass::of_sqlstate`]), shared with the sqlx
//! backend; this module only finds the SQLSTATE of a diesel error, and
//! classifies what never reached the server:
//!
//! | error | [`InboxError`] |
//! |---|---|
//! | a database error with a SQLSTATE (below) | by the shared table |
//! | no SQLSTATE: connection closed, I/O | `Connection` (retry) |
//! | a column that does not decode | `Schema` (dead-letter) |
//! | pool: waited too long for a slot | `PoolTimeout` (retry) |
//! | pool: could not open a connection | `Connection` (retry) |
//! | misuse of the transaction, anything else | `Store { retryable: false }` |
//!
//! # Where the SQLSTATE comes from
//!
//! diesel 2.3's [`DatabaseErrorInformation`] has no accessor for the
//! SQLSTATE, and diesel-async 0.9 keeps only a [`DatabaseErrorKind`]: it maps
//! 40001 to `SerializationFailure` and the integrity classes to their kinds,
//! errors without a SQLSTATE (connection closed, I/O) to
//! `UnableToSendCommand`, and everything else (deadlock, lock timeout,
//! terminated backend, undefined table) to `Unknown`, dropping the code. The
//! boxed information cannot be downcast. So:
//!
//! 1. the kind decides wherever it is specific;
//! 2. for `Unknown`, and only there, the SQLSTATE is recovered from
//!    PostgreSQL's primary message against a short table of the server's own
//!    message templates ([`sqlstate_from_message`]). This is the one place
//!    that reads message text, because there is no other way; it assumes the
//!    server's `lc_messages` is English or C (`DieselStore::connect` warns
//!    otherwise);
//! 3. where that fails, structure still helps: an error that carries a
//!    statement position is a parse-analysis error (permanent), and inside
//!    the store a probe tells whether the connection is still alive (a dead
//!    one makes the error `Connection`, whatever the message said).

use diesel::ConnectionError;
use diesel::result::{DatabaseErrorInformation, DatabaseErrorKind, Error as DieselError};
use diesel_async::pooled_connection::deadpool::PoolError;
use inbox_api::{BoxError, InboxError};
use inbox_postgres::classify_sqlstate;

/// Converts a diesel error into an [`InboxError`] that says whether
/// redelivery can help.
///
/// Use it for the business writes made through
/// [`crate::DieselTransaction::conn`], so that a deadlock in the consumer's
/// own SQL is retried like one in the claim:
///
/// ```
/// # use inbox_api::InboxError;
/// fn business(result: diesel::QueryResult<usize>) -> Result<usize, InboxError> {
///     result.map_err(inbox_backend_diesel::classify)
/// }
/// ```
pub fn classify(error: DieselError) -> InboxError {
    // A failed COMMIT whose cleanup ROLLBACK failed too: the COMMIT's error
    // is the one that decided the outcome.
    let error = match error {
        DieselError::RollbackErrorOnCommit {
            commit_error,
            rollback_error,
        } => {
            tracing::debug!(%rollback_error, "rollback after a failed commit failed too");
            return classify(*commit_error);
        }
        other => other,
    };
    match &error {
        DieselError::DatabaseError(kind, info) => match sqlstate_of(*kind, &**info) {
            Some(code) => classify_sqlstate(code, boxed(error)),
            None if matches!(
                kind,
                DatabaseErrorKind::UnableToSendCommand | DatabaseErrorKind::ClosedConnection
            ) =>
            {
                InboxError::Connection {
                    source: boxed(error),
                }
            }
            // A parse-analysis error points into the statement: the SQL does
            // not fit the schema, and will not on redelivery either.
            None => InboxError::Store {
                retryable: false,
                source: boxed(error),
            },
        },
        // A column that does not decode into the Rust type: the table is
        // not what this code expects (sqlx maps its decode errors the same).
        DieselError::DeserializationError(_) => InboxError::Schema {
            source: boxed(error),
        },
        // The transaction manager lost track (a cancelled BEGIN/COMMIT): the
        // connection is discarded, and redelivery on a fresh one works.
        DieselError::BrokenTransactionManager => InboxError::Connection {
            source: boxed(error),
        },
        // Misuse of the transaction (committing twice, nesting by hand):
        // a programming error, which redelivery repeats.
        DieselError::AlreadyInTransaction
        | DieselError::NotInTransaction
        | DieselError::RollbackTransaction
        | DieselError::NotFound
        | DieselError::InvalidCString(_)
        | DieselError::QueryBuilderError(_)
        | DieselError::SerializationError(_)
        | DieselError::IntegerConversion(_) => InboxError::Store {
            retryable: false,
            source: boxed(error),
        },
        // `diesel::result::Error` is non-exhaustive.
        _ => InboxError::Store {
            retryable: false,
            source: boxed(error),
        },
    }
}

/// Converts a pool error: waiting too long for a slot is `PoolTimeout`,
/// failing to open a connection is `Connection`; both are retryable.
pub fn classify_pool(error: PoolError) -> InboxError {
    use deadpool::managed::PoolError as P;
    match error {
        // Opening a connection took too long: the database is unreachable
        // or overloaded, not the pool full.
        P::Timeout(deadpool::managed::TimeoutType::Create) => InboxError::Connection {
            source: boxed(error),
        },
        P::Timeout(_) => InboxError::PoolTimeout {
            source: Some(boxed(error)),
        },
        P::Backend(diesel_async::pooled_connection::PoolError::ConnectionError(e)) => {
            classify_connection(e)
        }
        P::Backend(diesel_async::pooled_connection::PoolError::QueryError(e)) => classify(e),
        // A closed pool is a shutdown in progress: the delivery goes back
        // to the broker and another instance takes it.
        P::Closed | P::PostCreateHook(_) => InboxError::Connection {
            source: boxed(error),
        },
        // Built without a runtime but with timeouts: a bug in this crate.
        P::NoRuntimeSpecified => InboxError::Store {
            retryable: false,
            source: boxed(error),
        },
    }
}

/// Converts an error of opening a connection. Always `Connection`
/// (retryable), except a setup statement failing on a missing object.
///
/// A wrong password or database name is a configuration error, but it is
/// not the message's fault: dead-lettering every delivery until someone
/// fixes the configuration would lose the queue's order and flood the
/// dead-letter queue, so it stays retryable.
pub fn classify_connection(error: ConnectionError) -> InboxError {
    match error {
        ConnectionError::CouldntSetupConfiguration(e) => match classify(e) {
            schema @ InboxError::Schema { .. } => schema,
            other => InboxError::Connection {
                source: Box::new(other),
            },
        },
        other => InboxError::Connection {
            source: boxed(other),
        },
    }
}

/// The SQLSTATE of `error` when it is a database error, as far as diesel
/// lets us know it.
pub(crate) fn sqlstate(error: &DieselError) -> Option<&'static str> {
    match error {
        DieselError::DatabaseError(kind, info) => sqlstate_of(*kind, &**info),
        _ => None,
    }
}

/// The SQLSTATE of a database error, as far as diesel lets us know it.
fn sqlstate_of(
    kind: DatabaseErrorKind,
    info: &(dyn DatabaseErrorInformation + Send + Sync),
) -> Option<&'static str> {
    match kind {
        DatabaseErrorKind::UniqueViolation => Some("23505"),
        DatabaseErrorKind::ForeignKeyViolation => Some("23503"),
        DatabaseErrorKind::NotNullViolation => Some("23502"),
        DatabaseErrorKind::CheckViolation => Some("23514"),
        DatabaseErrorKind::ExclusionViolation => Some("23P01"),
        DatabaseErrorKind::RestrictViolation => Some("23001"),
        DatabaseErrorKind::SerializationFailure => Some("40001"),
        DatabaseErrorKind::ReadOnlyTransaction => Some("25006"),
        DatabaseErrorKind::UnableToSendCommand | DatabaseErrorKind::ClosedConnection => None,
        _ => sqlstate_from_message(info.message()).or_else(|| {
            // Only parse analysis (class 42, 22P02 in literals) reports a
            // position; without the message we still know it is permanent.
            info.statement_position().map(|_| "42000")
        }),
    }
}

/// Recovers the SQLSTATE of the PostgreSQL errors that matter for retrying
/// from their primary message (PostgreSQL 12–17, English or C locale).
///
/// Only used for errors diesel reports as `DatabaseErrorKind::Unknown`
/// (see the module docs for why). Matching is on the fixed part of each
/// template, never on quoted object names.
pub(crate) fn sqlstate_from_message(message: &str) -> Option<&'static str> {
    const EXACT_OR_PREFIX: &[(&str, &str)] = &[
        ("deadlock detected", "40P01"),
        ("could not serialize access", "40001"),
        ("could not obtain lock on", "55P03"),
        ("canceling statement due to lock timeout", "55P03"),
        ("canceling statement due to statement timeout", "57014"),
        ("canceling statement due to user request", "57014"),
        (
            "terminating connection due to administrator command",
            "57P01",
        ),
        (
            "terminating connection because of crash of another server process",
            "57P02",
        ),
        (
            "terminating connection due to idle-in-transaction timeout",
            "25P03",
        ),
        (
            "terminating connection due to idle-session timeout",
            "57P05",
        ),
        ("the database system is shutting down", "57P03"),
        ("the database system is starting up", "57P03"),
        ("the database system is in recovery mode", "57P03"),
        ("sorry, too many clients already", "53300"),
        ("cannot execute ", "25006"), // "cannot execute INSERT in a read-only transaction"
        ("current transaction is aborted", "25P02"),
        // "permission denied for table t", "… for schema s": the role may
        // not use the schema, which pauses the service like a missing one.
        ("permission denied for ", "42501"),
    ];
    for (pattern, code) in EXACT_OR_PREFIX {
        if message.starts_with(pattern) {
            if *code == "25006" && !message.ends_with("in a read-only transaction") {
                continue;
            }
            return Some(code);
        }
    }
    // `relation "x" does not exist`, `schema "x" does not exist`,
    // `column "c" does not exist`, `column "c" of relation "t" does not exist`,
    // `function f(integer) does not exist`.
    if message.ends_with("does not exist") {
        if message.starts_with("relation \"") {
            return Some("42P01");
        }
        if message.starts_with("schema \"") {
            return Some("3F000");
        }
        if message.starts_with("column \"") {
            return Some("42703");
        }
        if message.starts_with("function ") {
            return Some("42883");
        }
        if message.starts_with("type \"") {
            return Some("42704");
        }
    }
    None
}

/// Whether classification of `error` hinged on nothing but an unknown
/// message: then a probe of the connection can still tell a lost
/// connection (retry) from a real failure.
pub(crate) fn is_unrecognised(error: &InboxError) -> bool {
    matches!(
        error,
        InboxError::Store {
            retryable: false,
            ..
        }
    )
}

fn boxed(error: impl std::error::Error + Send + Sync + 'static) -> BoxError {
    Box::new(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A database error as diesel-async builds it.
    fn db(kind: DatabaseErrorKind, message: &str) -> DieselError {
        DieselError::DatabaseError(kind, Box::new(message.to_owned()))
    }

    struct Positioned;
    impl DatabaseErrorInformation for Positioned {
        fn message(&self) -> &str {
            "Relation «x» existiert nicht"
        }
        fn details(&self) -> Option<&str> {
            None
        }
        fn hint(&self) -> Option<&str> {
            None
        }
        fn table_name(&self) -> Option<&str> {
            None
        }
        fn column_name(&self) -> Option<&str> {
            None
        }
        fn constraint_name(&self) -> Option<&str> {
            None
        }
        fn statement_position(&self) -> Option<i32> {
            Some(15)
        }
    }

    #[test]
    fn conflicts_are_retryable() {
        use DatabaseErrorKind::*;
        for e in [
            db(
                SerializationFailure,
                "could not serialize access due to concurrent update",
            ),
            db(Unknown, "deadlock detected"),
        ] {
            let c = classify(e);
            assert!(matches!(c, InboxError::Conflict { .. }), "{c:?}");
            assert!(c.is_retryable());
        }
    }

    #[test]
    fn lock_timeouts_are_held_by_another() {
        use DatabaseErrorKind::*;
        for e in [
            db(
                Unknown,
                "could not obtain lock on row in relation \"inbox_messages\"",
            ),
            db(Unknown, "canceling statement due to lock timeout"),
        ] {
            let c = classify(e);
            assert!(matches!(c, InboxError::LockTimeout { .. }), "{c:?}");
            assert!(c.is_retryable() && c.held_by_another());
        }
    }

    #[test]
    fn lost_connections_are_retryable() {
        use DatabaseErrorKind::*;
        for e in [
            db(UnableToSendCommand, "connection closed"),
            db(ClosedConnection, "server closed the connection"),
            db(
                Unknown,
                "terminating connection due to administrator command",
            ),
            db(
                Unknown,
                "terminating connection due to idle-in-transaction timeout",
            ),
            db(Unknown, "the database system is shutting down"),
            DieselError::BrokenTransactionManager,
        ] {
            let c = classify(e);
            assert!(matches!(c, InboxError::Connection { .. }), "{c:?}");
            assert!(c.is_retryable());
        }
    }

    #[test]
    fn missing_schema_is_permanent() {
        use DatabaseErrorKind::*;
        for e in [
            db(Unknown, "relation \"inbox_messages\" does not exist"),
            db(Unknown, "schema \"inbox_x\" does not exist"),
            db(
                Unknown,
                "column \"processed_at\" of relation \"inbox_messages\" does not exist",
            ),
        ] {
            let c = classify(e);
            assert!(matches!(c, InboxError::Schema { .. }), "{c:?}");
            assert!(!c.is_retryable());
        }
    }

    #[test]
    fn transient_server_states_are_retryable() {
        use DatabaseErrorKind::*;
        for e in [
            db(Unknown, "canceling statement due to statement timeout"),
            db(Unknown, "sorry, too many clients already"),
            db(
                ReadOnlyTransaction,
                "cannot execute INSERT in a read-only transaction",
            ),
        ] {
            let c = classify(e);
            assert!(
                matches!(
                    c,
                    InboxError::Store {
                        retryable: true,
                        ..
                    }
                ),
                "{c:?}"
            );
        }
    }

    #[test]
    fn data_and_programming_errors_are_permanent() {
        use DatabaseErrorKind::*;
        for e in [
            db(
                UniqueViolation,
                "duplicate key value violates unique constraint",
            ),
            db(NotNullViolation, "null value in column"),
            db(CheckViolation, "new row violates check constraint"),
            db(Unknown, "syntax error at or near \"SELEC\""),
            db(
                Unknown,
                "current transaction is aborted, commands ignored until end of transaction block",
            ),
            DieselError::NotInTransaction,
            DieselError::AlreadyInTransaction,
            DieselError::NotFound,
            DieselError::DatabaseError(Unknown, Box::new(Positioned)),
        ] {
            let c = classify(e);
            assert!(
                matches!(
                    c,
                    InboxError::Store {
                        retryable: false,
                        ..
                    }
                ),
                "{c:?}"
            );
            assert!(is_unrecognised(&c));
        }
    }

    #[test]
    fn a_duplicate_key_is_never_a_retry_loop() {
        // Wolverine #2639: a unique violation must not loop. The claim never
        // sees one (ON CONFLICT DO NOTHING); a business table might.
        let c = classify(db(DatabaseErrorKind::UniqueViolation, "duplicate key"));
        assert!(!c.is_retryable());
    }

    #[test]
    fn rollback_error_on_commit_follows_the_commit_error() {
        let e = DieselError::RollbackErrorOnCommit {
            rollback_error: Box::new(db(DatabaseErrorKind::UnableToSendCommand, "closed")),
            commit_error: Box::new(db(DatabaseErrorKind::SerializationFailure, "40001")),
        };
        let c = classify(e);
        assert!(matches!(c, InboxError::Conflict { .. }), "{c:?}");
    }

    #[test]
    fn pool_errors() {
        use deadpool::managed::{PoolError as P, TimeoutType};
        let c = classify_pool(P::Timeout(TimeoutType::Wait));
        assert!(matches!(c, InboxError::PoolTimeout { .. }), "{c:?}");
        let c = classify_pool(P::Timeout(TimeoutType::Create));
        assert!(matches!(c, InboxError::Connection { .. }), "{c:?}");
        let c = classify_pool(P::Backend(
            diesel_async::pooled_connection::PoolError::ConnectionError(
                ConnectionError::BadConnection("connection refused".into()),
            ),
        ));
        assert!(matches!(c, InboxError::Connection { .. }), "{c:?}");
        let c = classify_pool(P::Closed);
        assert!(c.is_retryable(), "{c:?}");
        let c = classify_connection(ConnectionError::CouldntSetupConfiguration(db(
            DatabaseErrorKind::Unknown,
            "schema \"nope\" does not exist",
        )));
        assert!(matches!(c, InboxError::Schema { .. }), "{c:?}");
    }

    #[test]
    fn message_table_ignores_quoted_names() {
        // A table named like a template must not fool the matcher.
        assert_eq!(
            sqlstate_from_message("relation \"deadlock detected\" does not exist"),
            Some("42P01")
        );
        assert_eq!(
            sqlstate_from_message("permission denied for table t"),
            Some("42501")
        );
        assert_eq!(sqlstate_from_message("permission denied to create t"), None);
    }
}
