//! The inbox's migrations for an application's own diesel migrations:
//! [`InboxMigrations`].

use std::fmt;

use diesel::connection::BoxableConnection;
use diesel::migration::{
    Migration, MigrationMetadata, MigrationName, MigrationSource, MigrationVersion,
};
use diesel::pg::Pg;
use inbox_api::InboxError;
use inbox_postgres::{MIGRATIONS, SchemaName};

/// The inbox's migrations into one schema as an embedded
/// [`MigrationSource`], for diesel_migrations' harness
/// (`MigrationHarness::run_pending_migrations`, on a sync connection or
/// diesel-async's `AsyncConnectionWrapper`), beside or instead of the
/// application's own `embed_migrations!()`.
///
/// Each migration creates its objects in the schema whatever the
/// connection's `search_path`, and records itself in the inbox's own
/// ledger too, so [`crate::DieselStore::migrate`] finds the schema up to
/// date; a schema [`crate::DieselStore::migrate`] migrated first is
/// accepted by the harness (the files are idempotent). Only the default
/// table layout: the partitioned layout is created by
/// [`crate::DieselStore::migrate`]. The inbox's versions share diesel's
/// ledger (`__diesel_schema_migrations`) with the application's; they are
/// dates (`20261202000001`, …), as diesel's own versions are.
#[derive(Clone, Debug)]
pub struct InboxMigrations {
    schema: SchemaName,
}

impl InboxMigrations {
    /// The migrations into `schema`.
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] for a bad schema name.
    pub fn new(schema: &str) -> Result<Self, InboxError> {
        Ok(Self {
            schema: SchemaName::new(schema)?,
        })
    }
}

impl MigrationSource<Pg> for InboxMigrations {
    fn migrations(&self) -> diesel::migration::Result<Vec<Box<dyn Migration<Pg>>>> {
        Ok(MIGRATIONS
            .iter()
            .map(|m| {
                Box::new(InboxMigration {
                    name: Name {
                        version: m.version.to_string(),
                        description: m.description,
                    },
                    sql: m.sql_in(&self.schema),
                }) as Box<dyn Migration<Pg>>
            })
            .collect())
    }
}

/// One migration of [`InboxMigrations`].
struct InboxMigration {
    name: Name,
    sql: String,
}

/// Its name: `<version>_inbox_<description>`, its version the file's.
struct Name {
    version: String,
    description: &'static str,
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}_inbox_{}",
            self.version,
            self.description.replace(' ', "_")
        )
    }
}

impl MigrationName for Name {
    fn version(&self) -> MigrationVersion<'_> {
        MigrationVersion::from(self.version.as_str())
    }
}

/// Every migration runs in the harness's transaction (the default), which
/// its `search_path` setting needs.
struct InTransaction;

impl MigrationMetadata for InTransaction {}

impl Migration<Pg> for InboxMigration {
    fn run(&self, conn: &mut dyn BoxableConnection<Pg>) -> diesel::migration::Result<()> {
        conn.batch_execute(&self.sql)?;
        Ok(())
    }

    fn revert(&self, _conn: &mut dyn BoxableConnection<Pg>) -> diesel::migration::Result<()> {
        Err(format!(
            "the inbox's migration {} is not reverted: drop the schema instead",
            self.name
        )
        .into())
    }

    fn metadata(&self) -> &dyn MigrationMetadata {
        &InTransaction
    }

    fn name(&self) -> &dyn MigrationName {
        &self.name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_is_listed_under_its_version() {
        let source = InboxMigrations::new("parcels").expect("valid");
        let migrations = source.migrations().expect("listed");
        assert_eq!(migrations.len(), MIGRATIONS.len());
        assert_eq!(
            migrations[0].name().to_string(),
            "20261202000001_inbox_create_inbox_messages"
        );
        assert_eq!(
            migrations[0].name().version().to_string(),
            MIGRATIONS[0].version.to_string()
        );
        assert!(InboxMigrations::new("Bad Name").is_err());
    }
}
