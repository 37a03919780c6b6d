//! sqlx errors mapped onto [`InboxError`], by SQLSTATE and error kind.
//!
//! The mapping answers one question for the broker boundary: redeliver or
//! dead-letter. It never looks at message text: messages are localised by
//! the server (`lc_messages`) and change between versions, SQLSTATEs do not.

use inbox_api::InboxError;
use sqlx::migrate::MigrateError;

/// What a SQLSTATE means for the delivery, before the source is attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Conflict,
    Connection,
    Schema,
    Store { retryable: bool },
}

/// Classifies a SQLSTATE (the five-character code of a PostgreSQL error).
///
/// Unknown codes are permanent: a message that fails in a way nobody
/// anticipated goes to the dead-letter queue where a person sees it, instead
/// of looping through redeliveries.
fn class_of_sqlstate(code: &str) -> Class {
    match code {
        // serialization_failure, deadlock_detected: the textbook retryable
        // conflicts (MassTransit #5114). lock_not_available: a lock_timeout
        // or NOWAIT lost a race with another transaction.
        "40001" | "40P01" | "55P03" => Class::Conflict,
        // statement_completion_unknown: like a lost connection, the outcome
        // is unknown and redelivery resolves it.
        "40003" => Class::Connection,
        // Other class 40 codes (transaction_rollback) are rollbacks forced by
        // concurrency too.
        c if c.starts_with("40") => Class::Conflict,
        // admin_shutdown (pg_terminate_backend), crash_shutdown,
        // cannot_connect_now (starting up), idle_session_timeout; and
        // idle_in_transaction_session_timeout, after which the server closes
        // the connection.
        "57P01" | "57P02" | "57P03" | "57P05" | "25P03" => Class::Connection,
        // connection_exception and its subclasses.
        c if c.starts_with("08") => Class::Connection,
        // query_canceled (statement_timeout, pg_cancel_backend): the next
        // attempt may well run under less load.
        "57014" => Class::Store { retryable: true },
        // read_only_sql_transaction: connected to a standby during a
        // failover; a later connection reaches the new primary.
        "25006" => Class::Store { retryable: true },
        // undefined_table, invalid_schema_name, undefined_column,
        // undefined_function, undefined_object: nobody migrated this schema.
        "42P01" | "3F000" | "42703" | "42883" | "42704" => Class::Schema,
        // insufficient_resources (disk full, out of memory, too many
        // connections) and system errors (I/O): they pass.
        c if c.starts_with("53") || c.starts_with("58") => Class::Store { retryable: true },
        // data_exception and integrity_constraint_violation: this input will
        // fail the same way every time.
        c if c.starts_with("22") || c.starts_with("23") => Class::Store { retryable: false },
        _ => Class::Store { retryable: false },
    }
}

/// Maps a sqlx error onto the inbox's error kinds, keeping it as the source.
///
/// Public so that consumer code can convert the errors of its own business
/// writes inside [`inbox_api::Inbox::handle`] with the same rules:
/// `.execute(tx.conn()).await.map_err(classify)?`.
///
/// | sqlx error | [`InboxError`] | disposition |
/// |---|---|---|
/// | SQLSTATE 40001, 40P01, 55P03 (other class 40) | `Conflict` | retry |
/// | SQLSTATE 08xxx, 57P01/02/03/05, 25P03, 40003; `Io`, `Tls`, `Protocol`, `PoolClosed`, `WorkerCrashed` | `Connection` | retry |
/// | `PoolTimedOut` | `PoolTimeout` | retry |
/// | SQLSTATE 42P01, 3F000, 42703, 42883, 42704; `ColumnNotFound`, `TypeNotFound`, decode errors, failed migrations | `Schema` | dead-letter |
/// | SQLSTATE 53xxx, 58xxx, 57014, 25006; `BeginFailed` | `Store { retryable: true }` | retry |
/// | SQLSTATE 22xxx, 23xxx, anything else | `Store { retryable: false }` | dead-letter |
pub fn classify(error: sqlx::Error) -> InboxError {
    use sqlx::Error as E;

    let class = match &error {
        E::Database(db) => match db.code() {
            Some(code) => class_of_sqlstate(&code),
            // Postgres always sends a code; an error without one did not
            // come from the server we know.
            None => Class::Store { retryable: false },
        },
        E::Io(_) | E::Tls(_) | E::Protocol(_) | E::PoolClosed | E::WorkerCrashed => {
            Class::Connection
        }
        E::PoolTimedOut => {
            return InboxError::PoolTimeout {
                source: Some(Box::new(error)),
            };
        }
        E::ColumnNotFound(_)
        | E::TypeNotFound { .. }
        | E::ColumnDecode { .. }
        | E::Decode(_)
        | E::ColumnIndexOutOfBounds { .. } => Class::Schema,
        // The connection was found inside a transaction it should not be
        // in; another connection will do.
        E::BeginFailed => Class::Store { retryable: true },
        E::Migrate(_) => return classify_migrate(error),
        // Configuration, InvalidArgument, Encode, RowNotFound, ... : the
        // same call fails the same way next time.
        _ => Class::Store { retryable: false },
    };
    let source = Box::new(error);
    match class {
        Class::Conflict => InboxError::Conflict { source },
        Class::Connection => InboxError::Connection { source },
        Class::Schema => InboxError::Schema { source },
        Class::Store { retryable } => InboxError::Store { retryable, source },
    }
}

/// A failed migration is a schema problem, unless the database itself failed
/// underneath it (a lost connection is still retryable).
pub(crate) fn classify_migrate_error(error: MigrateError) -> InboxError {
    match error {
        MigrateError::Execute(inner) | MigrateError::ExecuteMigration(inner, _) => classify(inner),
        other => InboxError::Schema {
            source: Box::new(other),
        },
    }
}

fn classify_migrate(error: sqlx::Error) -> InboxError {
    match error {
        sqlx::Error::Migrate(inner) => classify_migrate_error(*inner),
        other => classify(other),
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::error::Error as _;

    use sqlx::error::{DatabaseError, ErrorKind};

    use super::*;

    /// A database error carrying just a SQLSTATE, as PgDatabaseError cannot
    /// be built outside sqlx.
    #[derive(Debug)]
    struct Fake(&'static str);

    impl std::fmt::Display for Fake {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "fake error {}", self.0)
        }
    }

    impl std::error::Error for Fake {}

    impl DatabaseError for Fake {
        fn message(&self) -> &str {
            // Deliberately misleading text: classification must ignore it.
            "deadlock detected; connection lost; relation does not exist"
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.0))
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> ErrorKind {
            ErrorKind::Other
        }
    }

    fn db(code: &'static str) -> InboxError {
        classify(sqlx::Error::Database(Box::new(Fake(code))))
    }

    #[test]
    fn sqlstates_map_to_kinds() {
        for code in ["40001", "40P01", "55P03", "40002"] {
            let e = db(code);
            assert!(matches!(e, InboxError::Conflict { .. }), "{code}: {e:?}");
            assert!(e.is_retryable(), "{code}");
        }
        for code in [
            "08000", "08003", "08006", "08001", "08P01", "57P01", "57P02", "57P03", "57P05",
            "25P03", "40003",
        ] {
            let e = db(code);
            assert!(matches!(e, InboxError::Connection { .. }), "{code}: {e:?}");
            assert!(e.is_retryable(), "{code}");
        }
        for code in ["42P01", "3F000", "42703", "42883", "42704"] {
            let e = db(code);
            assert!(matches!(e, InboxError::Schema { .. }), "{code}: {e:?}");
            assert!(!e.is_retryable(), "{code}");
        }
        for code in [
            "53000", "53100", "53200", "53300", "58030", "57014", "25006",
        ] {
            let e = db(code);
            assert!(
                matches!(
                    e,
                    InboxError::Store {
                        retryable: true,
                        ..
                    }
                ),
                "{code}: {e:?}"
            );
        }
        for code in [
            "22001", "22P02", "23505", "23502", "23503", "42601", "42501", "XX000", "25P02",
        ] {
            let e = db(code);
            assert!(
                matches!(
                    e,
                    InboxError::Store {
                        retryable: false,
                        ..
                    }
                ),
                "{code}: {e:?}"
            );
        }
    }

    #[test]
    fn driver_errors_map_to_kinds() {
        let connection = [
            sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
            sqlx::Error::Tls("handshake".into()),
            sqlx::Error::Protocol("unexpected message".into()),
            sqlx::Error::PoolClosed,
            sqlx::Error::WorkerCrashed,
        ];
        for e in connection {
            let mapped = classify(e);
            assert!(
                matches!(mapped, InboxError::Connection { .. }),
                "{mapped:?}"
            );
        }

        let timeout = classify(sqlx::Error::PoolTimedOut);
        assert!(matches!(
            timeout,
            InboxError::PoolTimeout { source: Some(_) }
        ));
        assert!(timeout.is_retryable());

        let schema = [
            sqlx::Error::ColumnNotFound("processed_at".into()),
            sqlx::Error::TypeNotFound {
                type_name: "inbox_state".into(),
            },
            sqlx::Error::Decode("bad".into()),
            sqlx::Error::ColumnDecode {
                index: "1".into(),
                source: "bad".into(),
            },
        ];
        for e in schema {
            let mapped = classify(e);
            assert!(matches!(mapped, InboxError::Schema { .. }), "{mapped:?}");
            assert!(!mapped.is_retryable());
        }

        for e in [
            sqlx::Error::RowNotFound,
            sqlx::Error::Configuration("bad url".into()),
            sqlx::Error::Encode("bad".into()),
        ] {
            let mapped = classify(e);
            assert!(
                matches!(
                    mapped,
                    InboxError::Store {
                        retryable: false,
                        ..
                    }
                ),
                "{mapped:?}"
            );
        }
    }

    #[test]
    fn migration_errors_look_through_to_the_database() {
        let lost = sqlx::Error::Migrate(Box::new(MigrateError::Execute(sqlx::Error::Io(
            std::io::Error::from(std::io::ErrorKind::BrokenPipe),
        ))));
        assert!(matches!(classify(lost), InboxError::Connection { .. }));

        let dirty = sqlx::Error::Migrate(Box::new(MigrateError::Dirty(20261202000001)));
        assert!(matches!(classify(dirty), InboxError::Schema { .. }));

        let missing = classify_migrate_error(MigrateError::VersionMissing(1));
        assert!(matches!(missing, InboxError::Schema { .. }));
    }

    #[test]
    fn the_source_is_kept() {
        let e = db("40P01");
        let source = e.source().expect("source kept");
        let sqlx_error = source
            .downcast_ref::<sqlx::Error>()
            .expect("the source is the sqlx error");
        let code = sqlx_error
            .as_database_error()
            .and_then(DatabaseError::code)
            .expect("code");
        assert_eq!(code, "40P01");
    }
}
