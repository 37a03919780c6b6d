//! A schema name that is safe to splice into SQL text.

use std::fmt;

use inbox_api::InboxError;

/// The PostgreSQL schema a store keeps its tables in.
///
/// The name travels into `search_path` (a startup parameter or `SET
/// search_path`, neither of which takes bind parameters) and into `CREATE
/// SCHEMA`, so it ends up in SQL text. Rather than quote arbitrary user text,
/// only plain lower-case identifiers are accepted: `[a-z_][a-z0-9_]{0,62}`,
/// what PostgreSQL folds an unquoted name to within its 63-byte limit, and
/// not `pg_…` (reserved for system schemas, which `CREATE SCHEMA` refuses).
/// The name is still double-quoted where it is used, so a keyword such as
/// `user` works too.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SchemaName(String);

impl SchemaName {
    /// Validates `name`.
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] (permanent) naming the rule broken.
    pub fn new(name: &str) -> Result<Self, InboxError> {
        let bytes = name.as_bytes();
        let reason = match bytes.first() {
            None => Some("is empty"),
            Some(_) if bytes.len() > 63 => Some("is longer than 63 bytes"),
            Some(first) if !(first.is_ascii_lowercase() || *first == b'_') => {
                Some("must start with a lowercase ASCII letter or '_'")
            }
            Some(_)
                if !bytes
                    .iter()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_') =>
            {
                Some("may contain only lowercase ASCII letters, digits and '_'")
            }
            Some(_) if name.starts_with("pg_") => Some("must not start with 'pg_' (reserved)"),
            Some(_) => None,
        };
        match reason {
            None => Ok(Self(name.to_owned())),
            Some(reason) => {
                let shown: String = name.chars().take(70).collect();
                Err(InboxError::InvalidArgument {
                    message: format!("schema name {shown:?} {reason}"),
                })
            }
        }
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The channel the outbox's trigger NOTIFYs when outgoing rows commit
    /// in this schema: `outbox_` and the name, cut to PostgreSQL's 63-byte
    /// limit exactly as the trigger cuts it (the name is ASCII, so bytes
    /// are characters). Two schemas sharing their first 56 bytes share a
    /// channel: a needless wake-up, nothing worse.
    pub fn outbox_channel(&self) -> String {
        let mut channel = format!("outbox_{}", self.0);
        channel.truncate(63);
        channel
    }

    /// The name as a quoted SQL identifier. Safe by construction: the
    /// validated alphabet contains no quote.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }

    /// The name as a SQL string literal. Safe by construction, as
    /// [`SchemaName::quoted`].
    pub fn literal(&self) -> String {
        format!("'{}'", self.0)
    }

    /// `text` as a SQL string literal, its quotes doubled: for texts
    /// built from a validated name (such as its quoted form).
    pub(crate) fn literal_of(text: &str) -> String {
        format!("'{}'", text.replace('\'', "''"))
    }
}

impl fmt::Display for SchemaName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SchemaName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SchemaName({:?})", self.0)
    }
}

impl AsRef<str> for SchemaName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_identifiers() {
        for ok in [
            "public",
            "inbox",
            "_x",
            "a1_b2",
            "inbox_test_1700000000_ab12",
            "user",
            &"a".repeat(63),
        ] {
            let name = SchemaName::new(ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
            assert_eq!(name.as_str(), ok);
        }
        let user = SchemaName::new("user").expect("valid");
        assert_eq!(user.quoted(), "\"user\"");
        assert_eq!(user.literal(), "'user'");
    }

    #[test]
    fn rejects_everything_else() {
        for bad in [
            "",
            "Public",
            "1abc",
            "a-b",
            "a b",
            "a.b",
            "a\"; DROP TABLE x; --",
            "x'; DROP SCHEMA public; --",
            "a\0",
            "ä",
            "pg_catalog",
            "pg_temp",
            &"a".repeat(64),
        ] {
            let err = SchemaName::new(bad).expect_err(bad);
            assert!(matches!(err, InboxError::InvalidArgument { .. }), "{bad:?}");
            assert!(!err.is_retryable());
        }
    }

    #[test]
    fn the_outbox_channel_fits_a_notify() {
        let short = SchemaName::new("parcel_inbox").expect("valid");
        assert_eq!(short.outbox_channel(), "outbox_parcel_inbox");
        let long = SchemaName::new(&"s".repeat(63)).expect("valid");
        assert_eq!(long.outbox_channel().len(), 63);
        assert!(long.outbox_channel().starts_with("outbox_sss"));
    }
}
