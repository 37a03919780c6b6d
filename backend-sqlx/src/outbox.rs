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
use inbox_postgres::{OutboxColumns, OutboxRow};

use crate::{SqlxStore, SqlxTransaction, classify};

#[async_trait]
impl OutboxTransaction for SqlxTransaction {
    async fn enqueue(&mut self, message: &OutgoingMessage) -> Result<EnqueueOutcome, InboxError> {
        let (names, values) = inbox_postgres::header_columns(message);
        let statements = std::sync::Arc::clone(&self.statements);
        let inserted = sqlx::query(&statements.enqueue)
            .bind(message.id().as_uuid())
            .bind(message.exchange())
            .bind(message.routing_key())
            .bind(message.message_type())
            .bind(names)
            .bind(values)
            .bind(message.body())
            .persistent(self.persistent)
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
        let mut one = self.one_statement().await?;
        let rows = sqlx::query_as::<_, OutboxColumns>(&self.statements.take_pending)
            .bind(inbox_postgres::lease_millis(lease))
            .bind(id.as_uuid())
            .bind(i64::from(limit.get()))
            .persistent(self.persistent())
            .fetch_all(one.conn())
            .await
            .map_err(classify)?;
        one.done().await?;
        inbox_postgres::lease_from_rows(id, lease, rows)
    }

    async fn mark_published(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        let mut one = self.one_statement().await?;
        let done = sqlx::query(&self.statements.mark_published)
            .bind(inbox_postgres::id_column(ids))
            .persistent(self.persistent())
            .execute(one.conn())
            .await
            .map_err(classify)?
            .rows_affected();
        one.done().await?;
        Ok(done)
    }

    async fn release(&self, lease: &OutboxLease) -> Result<u64, InboxError> {
        let mut one = self.one_statement().await?;
        let done = sqlx::query(&self.statements.release)
            .bind(inbox_postgres::id_column(&lease.ids()))
            .bind(lease.id.as_uuid())
            .persistent(self.persistent())
            .execute(one.conn())
            .await
            .map_err(classify)?
            .rows_affected();
        one.done().await?;
        Ok(done)
    }

    async fn lookup_outgoing(&self, id: &MessageId) -> Result<Option<OutboxRecord>, InboxError> {
        let mut one = self.one_statement().await?;
        let row = sqlx::query_as::<_, OutboxColumns>(&self.statements.lookup_outgoing)
            .bind(id.as_uuid())
            .persistent(self.persistent())
            .fetch_optional(one.conn())
            .await
            .map_err(classify)?;
        one.done().await?;
        row.map(|columns| OutboxRow::from(columns).into_record())
            .transpose()
    }

    async fn pending_count(&self) -> Result<u64, InboxError> {
        let mut one = self.one_statement().await?;
        let count: i64 = sqlx::query_scalar(&self.statements.pending_count)
            .persistent(self.persistent())
            .fetch_one(one.conn())
            .await
            .map_err(classify)?;
        one.done().await?;
        Ok(u64::try_from(count).unwrap_or(0))
    }

    async fn dead_count(&self) -> Result<u64, InboxError> {
        let mut one = self.one_statement().await?;
        let count: i64 = sqlx::query_scalar(&self.statements.dead_count)
            .persistent(self.persistent())
            .fetch_one(one.conn())
            .await
            .map_err(classify)?;
        one.done().await?;
        Ok(u64::try_from(count).unwrap_or(0))
    }

    async fn purge_published_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.purge_batch(
            &self.statements.purge_published_batch,
            cutoff,
            limit,
            "outbox",
        )
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
        let mut one = self.one_statement().await?;
        let rows = sqlx::query_as::<_, (sqlx::types::Uuid, bool)>(&self.statements.record_refusals)
            .bind(ids)
            .bind(errors)
            .bind(lease.as_uuid())
            .bind(base)
            .bind(max)
            .bind(attempts)
            .persistent(self.persistent())
            .fetch_all(one.conn())
            .await
            .map_err(classify)?;
        one.done().await?;
        Ok(inbox_postgres::refused(rows))
    }

    async fn dead_outgoing(&self, limit: NonZeroU32) -> Result<Vec<OutboxRecord>, InboxError> {
        let mut one = self.one_statement().await?;
        let rows = sqlx::query_as::<_, OutboxColumns>(&self.statements.dead_outgoing)
            .bind(i64::from(limit.get()))
            .persistent(self.persistent())
            .fetch_all(one.conn())
            .await
            .map_err(classify)?;
        one.done().await?;
        inbox_postgres::records(rows)
    }

    async fn requeue_dead(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        let mut one = self.one_statement().await?;
        let done = sqlx::query(&self.statements.requeue_dead)
            .bind(inbox_postgres::id_column(ids))
            .persistent(self.persistent())
            .execute(one.conn())
            .await
            .map_err(classify)?
            .rows_affected();
        one.done().await?;
        Ok(done)
    }
}
