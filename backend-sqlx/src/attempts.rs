//! The attempt ledger on the sqlx backend: `inbox-postgres`'s statements,
//! each sent on the pool, so each runs in its own (autocommit) transaction
//! and never in the consumer's, whose failure it records after its rollback.

use std::num::NonZeroU32;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use inbox_api::{AttemptLedger, AttemptRecord, ConsumerName, InboxError, InboxKey, LastError};
use inbox_postgres::{AttemptColumns, attempt_record};

use crate::{SqlxStore, classify};

#[async_trait]
impl AttemptLedger for SqlxStore {
    async fn record_failure(&self, key: &InboxKey, error: &LastError) -> Result<u32, InboxError> {
        let mut one = self.one_statement().await?;
        let attempts: i32 = sqlx::query_scalar(&self.statements.record_failure)
            .bind(key.message_id.as_uuid())
            .bind(key.consumer.as_str())
            .bind(error.as_str())
            .persistent(self.persistent())
            .fetch_one(one.conn())
            .await
            .map_err(classify)?;
        one.done().await?;
        Ok(inbox_postgres::attempt_count(attempts))
    }

    async fn mark_dead(
        &self,
        key: &InboxKey,
        reason: &str,
        error: &LastError,
    ) -> Result<(), InboxError> {
        let mut one = self.one_statement().await?;
        sqlx::query(&self.statements.mark_dead)
            .bind(key.message_id.as_uuid())
            .bind(key.consumer.as_str())
            .bind(error.as_str())
            .bind(reason)
            .persistent(self.persistent())
            .execute(one.conn())
            .await
            .map_err(classify)?;
        one.done().await?;
        Ok(())
    }

    async fn attempts(&self, key: &InboxKey) -> Result<Option<AttemptRecord>, InboxError> {
        let mut one = self.one_statement().await?;
        let row = sqlx::query_as::<_, AttemptColumns>(&self.statements.lookup_attempts)
            .bind(key.message_id.as_uuid())
            .bind(key.consumer.as_str())
            .persistent(self.persistent())
            .fetch_optional(one.conn())
            .await
            .map_err(classify)?;
        one.done().await?;
        row.map(attempt_record).transpose()
    }

    async fn dead_messages(
        &self,
        consumer: Option<&ConsumerName>,
        limit: NonZeroU32,
    ) -> Result<Vec<AttemptRecord>, InboxError> {
        let mut one = self.one_statement().await?;
        let rows = sqlx::query_as::<_, AttemptColumns>(&self.statements.dead_messages)
            .bind(consumer.map(ConsumerName::as_str))
            .bind(i64::from(limit.get()))
            .persistent(self.persistent())
            .fetch_all(one.conn())
            .await
            .map_err(classify)?;
        one.done().await?;
        rows.into_iter().map(attempt_record).collect()
    }

    async fn purge_attempts_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.purge_batch(
            &self.statements.purge_attempts_batch,
            cutoff,
            limit,
            "attempts",
        )
        .await
    }
}
