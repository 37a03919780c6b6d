//! sqlx errors mapped onto [`InboxError`], by SQLSTATE and error kind.
//!
//! This crate only says what sqlx knows: the SQLSTATE of a database error,
//! or what sqlx's own error kinds mean. The SQLSTATE table itself is
//! `inbox-postgres`'s, shared with the diesel backend. Message text is never
//! read.

use inbox_api::InboxError;
use inbox_postgres::ErrorClass;

/// Maps a sqlx error onto the inbox's error kinds, keeping it as the source.
///
/// Public so that consumer code can convert the errors of its own business
/// writes inside [`inbox_api::Inbox::handle`] with the same rules:
/// `.execute(tx.conn()).await.map_err(classify)?`.
///
/// | sqlx error | [`InboxError`] | disposition |
/// |---|---|---|
/// | a database error | by its SQLSTATE ([`inbox_postgres::ErrorClass::of_sqlstate`]) | |
/// | `Io`, `Tls`, `Protocol`, `PoolClosed`, `WorkerCrashed` | `Connection` | retry |
/// | `PoolTimedOut` | `PoolTimeout` | retry |
/// | `ColumnNotFound`, `TypeNotFound`, decode errors | `Schema` | dead-letter |
/// | `BeginFailed` | `Store { retryable: true }` | retry |
/// | a database error without a SQLSTATE, anything else | `Store { retryable: false }` | dead-letter |
pub fn classify(error: sqlx::Error) -> InboxError {
    use sqlx::Error as E;

    let class = match &error {
        E::Database(db) => match db.code() {
            Some(code) => ErrorClass::of_sqlstate(&code),
            // Postgres always sends a code; an error without one did not
            // come from the server we know.
            None => ErrorClass::Store { retryable: false },
        },
        E::Io(_) | E::Tls(_) | E::Protocol(_) | E::PoolClosed | E::WorkerCrashed => {
            ErrorClass::Connection
        }
        E::PoolTimedOut => ErrorClass::PoolTimeout,
        E::ColumnNotFound(_)
        | E::TypeNotFound { .. }
        | E::ColumnDecode { .. }
        | E::Decode(_)
        | E::ColumnIndexOutOfBounds { .. } => ErrorClass::Schema,
        // The connection was found inside a transaction it should not be
        // in; another connection will do.
        E::BeginFailed => ErrorClass::Store { retryable: true },
        // Configuration, InvalidArgument, Encode, RowNotFound, ... : the
        // same call fails the same way next time.
        _ => ErrorClass::Store { retryable: false },
    };
    class.into_error(Box::new(error))
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
    fn the_sqlstate_decides() {
        // The table itself is inbox-postgres's; this checks that the code
        // sqlx reports is the one it reads.
        assert!(matches!(db("40P01"), InboxError::Conflict { .. }));
        assert!(matches!(db("57P01"), InboxError::Connection { .. }));
        assert!(matches!(db("42P01"), InboxError::Schema { .. }));
        assert!(matches!(
            db("23505"),
            InboxError::Store {
                retryable: false,
                ..
            }
        ));
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
