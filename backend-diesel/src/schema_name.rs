//! A schema name that is safe to splice into `SET search_path`.

use std::fmt;

use inbox_api::InboxError;

/// The PostgreSQL schema a store keeps its tables in.
///
/// `SET search_path` takes no bind parameters, so the name ends up in SQL
/// text. Rather than quote arbitrary user text, only plain lower-case
/// identifiers are accepted (`[a-z_][a-z0-9_]{0,62}`: what PostgreSQL folds
/// an unquoted name to, within its 63-byte limit; not `pg_…`); the name is still
/// double-quoted when used, so a keyword such as `user` works too.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct SchemaName(String);

impl SchemaName {
    /// Validates `name`.
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] (permanent) when `name` is not a
    /// plain identifier.
    pub fn new(name: &str) -> Result<Self, InboxError> {
        let mut chars = name.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
        let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        // `pg_` names are reserved for system schemas: CREATE SCHEMA refuses
        // them, so refuse them here, as the sqlx backend does.
        if first_ok && rest_ok && name.len() <= 63 && !name.starts_with("pg_") {
            Ok(Self(name.to_owned()))
        } else {
            Err(InboxError::InvalidArgument {
                message: format!(
                    "schema name {:?} is not a plain identifier ([a-z_][a-z0-9_]{{0,62}}, not pg_…)",
                    name.chars().take(80).collect::<String>()
                ),
            })
        }
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name as a quoted SQL identifier. Safe by construction: the
    /// validated alphabet contains no quote.
    pub(crate) fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
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
            "_x",
            "inbox_test_1700000000_ab12",
            "user",
            &"a".repeat(63),
        ] {
            assert_eq!(SchemaName::new(ok).unwrap().as_str(), ok);
        }
        assert_eq!(SchemaName::new("user").unwrap().quoted(), "\"user\"");
    }

    #[test]
    fn rejects_everything_else() {
        for bad in [
            "",
            "Public",
            "1abc",
            "a-b",
            "a b",
            "a\"; DROP TABLE x; --",
            "ä",
            "a.b",
            "pg_catalog",
            "pg_x",
            &"a".repeat(64),
        ] {
            let err = SchemaName::new(bad).unwrap_err();
            assert!(matches!(err, InboxError::InvalidArgument { .. }), "{bad:?}");
            assert!(!err.is_retryable());
        }
    }
}
