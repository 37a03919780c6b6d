//! The outbox on the sqlx backend: `inbox-postgres`'s statements, sent.
//!
//! Everything else (the parameters' shapes, decoding and ordering rows,
//! the lease's deadline) is `inbox-postgres`'s, shared with the diesel
//! backend.

use std::num::NonZeroU32;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use inbox_api::{
    EnqueueOutcome, InboxError, LeaseId, MessageId, OutboxLease, OutboxRecord, OutboxStore,
    OutboxTransaction, OutgoingMessage, PublishRetry, Refused,
};
use inbox_postgres::{OutboxColumns, OutboxRow, sql};

use crate::{SqlxStore, SqlxTransaction, classify};

#[async_trait]
impl OutboxTransaction for SqlxTransaction {
    async fn enqueue(&mut self, message: &OutgoingMessage) -> Result<EnqueueOutcome, InboxError> {
        let (names, values) = inbox_postgres::header_columns(message);
        let inserted = sqlx::query(sql::ENQUEUE)
            .bind(message.id().as_uuid())
            .bind(message.exchange())
            .bind(message.routing_key())
            .bind(message.message_type())
            .bind(names)
            .bind(values)
            .bind(message.body())
            .execute(self.conn())
            .await
            .map_err(classify)?
            .rows_affected();
        inbox_postgres::enqueued(inserted)
    }
}

#[async_trait]
impl OutboxStore for SqlxStore {
    async fn take_pending(
        &self,
        limit: NonZeroU32,
        lease: Duration,
    ) -> Result<OutboxLease, InboxError> {
        let id = LeaseId::new();
        let rows = sqlx::query_as::<_, OutboxColumns>(sql::TAKE_PENDING)
            .bind(inbox_postgres::lease_millis(lease))
            .bind(id.as_uuid())
            .bind(i64::from(limit.get()))
            .fetch_all(&self.pool)
            .await
            .map_err(classify)?;
        inbox_postgres::lease_from_rows(id, lease, rows)
    }

    async fn mark_published(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        Ok(sqlx::query(sql::MARK_PUBLISHED)
            .bind(inbox_postgres::id_column(ids))
            .execute(&self.pool)
            .await
            .map_err(classify)?
            .rows_affected())
    }

    async fn release(&self, lease: &OutboxLease) -> Result<u64, InboxError> {
        Ok(sqlx::query(sql::RELEASE)
            .bind(inbox_postgres::id_column(&lease.ids()))
            .bind(lease.id.as_uuid())
            .execute(&self.pool)
            .await
            .map_err(classify)?
            .rows_affected())
    }

    async fn lookup_outgoing(&self, id: &MessageId) -> Result<Option<OutboxRecord>, InboxError> {
        let row = sqlx::query_as::<_, OutboxColumns>(sql::LOOKUP_OUTGOING)
            .bind(id.as_uuid())
            .fetch_optional(&self.pool)
            .await
            .map_err(classify)?;
        row.map(|columns| OutboxRow::from(columns).into_record())
            .transpose()
    }

    async fn pending_count(&self) -> Result<u64, InboxError> {
        let count: i64 = sqlx::query_scalar(sql::PENDING_COUNT)
            .fetch_one(&self.pool)
            .await
            .map_err(classify)?;
        Ok(u64::try_from(count).unwrap_or(0))
    }

    async fn dead_count(&self) -> Result<u64, InboxError> {
        let count: i64 = sqlx::query_scalar(sql::DEAD_COUNT)
            .fetch_one(&self.pool)
            .await
            .map_err(classify)?;
        Ok(u64::try_from(count).unwrap_or(0))
    }

    async fn purge_published_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.purge_batch(sql::PURGE_PUBLISHED_BATCH, cutoff, limit, "outbox")
            .await
    }

    async fn record_refusals(
        &self,
        lease: &LeaseId,
        refusals: &[(MessageId, String)],
        retry: &PublishRetry,
    ) -> Result<Refused, InboxError> {
        let (ids, errors) = inbox_postgres::refusal_columns(refusals);
        let (base, max, attempts) = inbox_postgres::retry_columns(retry);
        let rows = sqlx::query_as::<_, (sqlx::types::Uuid, bool)>(sql::RECORD_REFUSALS)
            .bind(ids)
            .bind(errors)
            .bind(lease.as_uuid())
            .bind(base)
            .bind(max)
            .bind(attempts)
            .fetch_all(&self.pool)
            .await
            .map_err(classify)?;
        Ok(inbox_postgres::refused(rows))
    }

    async fn dead_outgoing(&self, limit: NonZeroU32) -> Result<Vec<OutboxRecord>, InboxError> {
        let rows = sqlx::query_as::<_, OutboxColumns>(sql::DEAD_OUTGOING)
            .bind(i64::from(limit.get()))
            .fetch_all(&self.pool)
            .await
            .map_err(classify)?;
        inbox_postgres::records(rows)
    }

    async fn requeue_dead(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        Ok(sqlx::query(sql::REQUEUE_DEAD)
            .bind(inbox_postgres::id_column(ids))
            .execute(&self.pool)
            .await
            .map_err(classify)?
            .rows_affected())
    }
}
