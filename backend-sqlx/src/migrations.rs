//! The inbox's migrations for an application's own sqlx migration setup.
//!
//! An application that migrates with sqlx (`sqlx::migrate!`, `sqlx
//! migrate run`) can run the inbox's schema the same way instead of
//! [`crate::SqlxStore::migrate`]: [`migrator`] is a [`Migrator`] to run on
//! its pool, and [`files`] are the same migrations as files to copy into
//! its migrations folder. Either way each migration creates its objects in
//! the chosen schema (whatever the pool's `search_path`) and records itself
//! in the inbox's own ledger too, so [`crate::SqlxStore::migrate`] finds
//! the schema up to date; a schema migrated by
//! [`crate::SqlxStore::migrate`] first is recognised the other way round
//! (the files are idempotent). Only the default table layout: the
//! partitioned layout is created by [`crate::SqlxStore::migrate`].

use std::borrow::Cow;

use inbox_api::InboxError;
use inbox_postgres::{MIGRATIONS, SchemaName};
use sqlx::error::BoxDynError;
use sqlx::migrate::{Migration, MigrationSource, MigrationType, Migrator};

/// A [`Migrator`] of the inbox's migrations into `schema`, for the
/// application's pool: `migrator("parcels").await?.run(&pool).await`.
///
/// It shares sqlx's ledger (`_sqlx_migrations`) with the application's
/// own migrator, so each must ignore the other's versions: this one is
/// built with `set_ignore_missing(true)`; call the same on the
/// application's (`sqlx::migrate!().set_ignore_missing(true)`).
///
/// # Errors
/// [`InboxError::InvalidArgument`] for a bad schema name.
pub async fn migrator(schema: &str) -> Result<Migrator, InboxError> {
    let source = Source(SchemaName::new(schema)?);
    let mut migrator =
        Migrator::new(source)
            .await
            .map_err(|error| InboxError::InvalidArgument {
                message: format!("the inbox migrations: {error}"),
            })?;
    migrator.set_ignore_missing(true);
    Ok(migrator)
}

/// The inbox's migrations into `schema` as `(file name, contents)`, for
/// an application's migrations folder (sqlx's `<version>_<name>.sql`).
///
/// # Errors
/// [`InboxError::InvalidArgument`] for a bad schema name.
pub fn files(schema: &str) -> Result<Vec<(String, String)>, InboxError> {
    let schema = SchemaName::new(schema)?;
    Ok(MIGRATIONS
        .iter()
        .map(|m| {
            (
                format!(
                    "{}_inbox_{}.sql",
                    m.version,
                    m.description.replace(' ', "_")
                ),
                m.sql_in(&schema),
            )
        })
        .collect())
}

/// What [`MigrationSource::resolve`] returns (futures' `BoxFuture`,
/// spelled out).
type Resolved<'s> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Vec<Migration>, BoxDynError>> + Send + 's>,
>;

/// The migrations of one schema, as sqlx reads a source.
#[derive(Debug)]
struct Source(SchemaName);

impl<'s> MigrationSource<'s> for Source {
    fn resolve(self) -> Resolved<'s> {
        Box::pin(async move {
            Ok(MIGRATIONS
                .iter()
                .map(|m| {
                    Migration::new(
                        m.version,
                        Cow::Owned(format!("inbox {}", m.description)),
                        MigrationType::Simple,
                        Cow::Owned(m.sql_in(&self.0)),
                        false,
                    )
                })
                .collect())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_named_for_sqlx_and_hold_the_schema() {
        let listed = files("parcels").expect("valid");
        assert_eq!(listed.len(), MIGRATIONS.len());
        assert_eq!(
            listed[0].0,
            "20261202000001_inbox_create_inbox_messages.sql"
        );
        assert!(
            listed[0]
                .1
                .starts_with("CREATE SCHEMA IF NOT EXISTS \"parcels\";")
        );
        assert!(files("Robert'); DROP").is_err());
    }
}
