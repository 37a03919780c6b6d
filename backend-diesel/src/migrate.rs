//! A small runner for the workspace's flat `migrations/*.sql` files.
//!
//! Why not diesel_migrations: it expects one directory per migration
//! (`<version>_<name>/up.sql`), while the workspace keeps sqlx's flat layout
//! as the single source of the schema. Rather than a second copy of the SQL,
//! build.rs embeds those very files, and this runner applies the pending ones
//! in one transaction, recording each in a version table of its own.

use diesel::prelude::*;
use diesel::sql_types::BigInt;
use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
    TransactionManager,
};
use inbox_api::InboxError;

use crate::SchemaName;
use crate::error::classify;

/// One embedded migration file.
pub(crate) struct Migration {
    /// The `<version>` part of the file name.
    pub(crate) version: i64,
    /// The `<name>` part, underscores as spaces.
    pub(crate) description: &'static str,
    /// The file's contents.
    pub(crate) sql: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/migrations.rs"));

diesel::table! {
    /// What this runner has applied, per schema.
    inbox_diesel_migrations (version) {
        version -> BigInt,
        description -> Text,
        checksum -> BigInt,
        applied_at -> Timestamptz,
    }
}

/// Serialises concurrent runners (several instances starting at once) on
/// one transaction-scoped advisory lock; any fixed key works.
const ADVISORY_LOCK_KEY: i64 = 0x1b0c_d1e5;

/// Applies the pending migrations to `schema` (which the connection's
/// `search_path` already points at), creating the schema if needed.
/// Returns the versions it applied.
pub(crate) async fn run(
    conn: &mut AsyncPgConnection,
    schema: &SchemaName,
) -> Result<Vec<i64>, InboxError> {
    AnsiTransactionManager::begin_transaction(conn)
        .await
        .map_err(classify)?;
    match apply(conn, schema).await {
        Ok(applied) => {
            AnsiTransactionManager::commit_transaction(conn)
                .await
                .map_err(classify)?;
            Ok(applied)
        }
        Err(error) => {
            // The caller closes this connection on error anyway; the
            // rollback is a courtesy to the server.
            if let Err(rollback) = AnsiTransactionManager::rollback_transaction(conn).await {
                tracing::debug!(error = %rollback, "rollback after failed migration failed");
            }
            Err(error)
        }
    }
}

async fn apply(conn: &mut AsyncPgConnection, schema: &SchemaName) -> Result<Vec<i64>, InboxError> {
    diesel::sql_query("SELECT pg_advisory_xact_lock($1)")
        .bind::<BigInt, _>(ADVISORY_LOCK_KEY)
        .execute(conn)
        .await
        .map_err(classify)?;
    conn.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {schema};
         CREATE TABLE IF NOT EXISTS inbox_diesel_migrations (
             version     BIGINT      PRIMARY KEY,
             description TEXT        NOT NULL,
             checksum    BIGINT      NOT NULL,
             applied_at  TIMESTAMPTZ NOT NULL DEFAULT now()
         );",
        schema = schema.quoted()
    ))
    .await
    .map_err(classify)?;

    let applied: Vec<(i64, i64)> = inbox_diesel_migrations::table
        .select((
            inbox_diesel_migrations::version,
            inbox_diesel_migrations::checksum,
        ))
        .load(conn)
        .await
        .map_err(classify)?;

    let mut newly = Vec::new();
    for migration in MIGRATIONS {
        let checksum = checksum(migration.sql);
        match applied.iter().find(|(v, _)| *v == migration.version) {
            Some((_, recorded)) if *recorded == checksum => continue,
            Some(_) => {
                // As sqlx does: an applied file that changed means the
                // database may not match the code. Refuse, loudly.
                return Err(InboxError::Schema {
                    source: format!(
                        "migration {} ({}) was applied to schema {schema} with different \
                         contents; migrations must not be edited once applied",
                        migration.version, migration.description
                    )
                    .into(),
                });
            }
            None => {}
        }
        conn.batch_execute(migration.sql).await.map_err(classify)?;
        diesel::insert_into(inbox_diesel_migrations::table)
            .values((
                inbox_diesel_migrations::version.eq(migration.version),
                inbox_diesel_migrations::description.eq(migration.description),
                inbox_diesel_migrations::checksum.eq(checksum),
            ))
            .execute(conn)
            .await
            .map_err(classify)?;
        tracing::info!(schema = %schema, version = migration.version,
            description = migration.description, "applied migration");
        newly.push(migration.version);
    }
    Ok(newly)
}

/// FNV-1a over the file: detects an edited migration, nothing more (not a
/// security property, so no cryptographic hash is needed).
fn checksum(sql: &str) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in sql.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    i64::from_ne_bytes(hash.to_ne_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embeds_the_workspace_migrations_in_order() {
        assert!(!MIGRATIONS.is_empty());
        assert!(MIGRATIONS.windows(2).all(|w| w[0].version < w[1].version));
        let first = &MIGRATIONS[0];
        assert_eq!(first.version, 20261202000001);
        assert_eq!(first.description, "create inbox messages");
        assert!(
            first
                .sql
                .contains("CREATE TABLE IF NOT EXISTS inbox_messages")
        );
    }

    #[test]
    fn checksum_sees_edits() {
        assert_eq!(checksum("a"), checksum("a"));
        assert_ne!(checksum("CREATE TABLE a"), checksum("CREATE TABLE b"));
    }
}
