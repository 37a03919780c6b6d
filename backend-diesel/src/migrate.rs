//! [`inbox_postgres::migrate`]'s view of a diesel-async connection.
//!
//! The runner, its ledger and the schema are `inbox-postgres`'s, shared with
//! the sqlx backend (so a schema migrated by either is migrated for both);
//! this only sends the runner's statements.

use async_trait::async_trait;
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use inbox_api::InboxError;
use inbox_postgres::MigrationConnection;

use crate::error::classify;

/// A connection lent to the runner for one migration.
pub(crate) struct Migrating<'c>(pub(crate) &'c mut AsyncPgConnection);

#[derive(QueryableByName)]
struct Pair {
    #[diesel(sql_type = BigInt)]
    version: i64,
    #[diesel(sql_type = BigInt)]
    checksum: i64,
}

#[derive(QueryableByName)]
struct OneText {
    #[diesel(sql_type = Nullable<Text>)]
    value: Option<String>,
}

#[async_trait]
impl MigrationConnection for Migrating<'_> {
    async fn execute(&mut self, sql: &str) -> Result<(), InboxError> {
        self.0.batch_execute(sql).await.map_err(classify)
    }

    async fn query_ledger(&mut self, sql: &str) -> Result<Vec<(i64, i64)>, InboxError> {
        let rows: Vec<Pair> = diesel::sql_query(sql)
            .load(self.0)
            .await
            .map_err(classify)?;
        Ok(rows.into_iter().map(|p| (p.version, p.checksum)).collect())
    }

    async fn query_text(&mut self, sql: &str) -> Result<Option<String>, InboxError> {
        let wrapped = format!("SELECT ({sql}) AS value");
        let row: OneText = diesel::sql_query(wrapped)
            .get_result(self.0)
            .await
            .map_err(classify)?;
        Ok(row.value)
    }
}
