//! The outbox on the diesel backend: `inbox-postgres`'s statements, sent.
//!
//! The enqueue and the take are prepared fragments ([`crate::statements`]);
//! the rarer statements go through `sql_query`. Parameters, row decoding
//! and the lease's deadline are `inbox-postgres`'s, shared with the sqlx
//! backend.

use std::num::NonZeroU32;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use diesel::OptionalExtension;
use diesel::sql_types::{Array, BigInt, Double, Integer, Text, Uuid};
use diesel_async::RunQueryDsl;
use inbox_api::{
    EnqueueOutcome, InboxError, LeaseId, MessageId, OutboxLease, OutboxRecord, OutboxStore,
    OutboxTransaction, OutgoingMessage, PublishRetry, Refused,
};
use inbox_postgres::{OutboxColumns, OutboxRow};

use crate::statements::{DeadOutgoing, Enqueue, LookupOutgoing, TakePending};
use crate::store::Checkout;
use crate::transaction::refine;
use crate::{DieselStore, DieselTransaction};

/// The rows a statement affected, as the trait counts them.
fn affected(rows: usize) -> u64 {
    u64::try_from(rows).unwrap_or(u64::MAX)
}

impl DieselStore {
    /// A pooled connection for one statement of the relay.
    async fn relay_connection(&self) -> Result<Checkout, InboxError> {
        self.checkout().await
    }
}

#[async_trait]
impl OutboxTransaction for DieselTransaction {
    async fn enqueue(&mut self, message: &OutgoingMessage) -> Result<EnqueueOutcome, InboxError> {
        let statements = self.statements();
        match Enqueue::of(&statements.enqueue, message)
            .execute(self.conn())
            .await
        {
            Ok(rows) => inbox_postgres::enqueued(affected(rows)),
            Err(error) => Err(refine(self.conn(), error).await),
        }
    }
}

#[async_trait]
impl OutboxStore for DieselStore {
    async fn take_pending(
        &self,
        limit: NonZeroU32,
        lease: Duration,
    ) -> Result<OutboxLease, InboxError> {
        let id = LeaseId::new();
        let take = TakePending {
            sql: &self.statements().take_pending,
            lease_millis: inbox_postgres::lease_millis(lease),
            lease_id: *id.as_uuid(),
            limit: i64::from(limit.get()),
        };
        let mut conn = self.relay_connection().await?;
        let taken = take.load::<OutboxColumns>(&mut *conn).await;
        match conn.finish(taken).await {
            Ok(rows) => inbox_postgres::lease_from_rows(id, lease, rows),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }

    async fn mark_published(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        let mut conn = self.relay_connection().await?;
        let marked = diesel::sql_query(&self.statements().mark_published)
            .bind::<Array<Uuid>, _>(inbox_postgres::id_column(ids))
            .execute(&mut *conn)
            .await;
        let marked = conn.finish(marked).await;
        match marked {
            Ok(rows) => Ok(affected(rows)),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }

    async fn release(&self, lease: &OutboxLease) -> Result<u64, InboxError> {
        let mut conn = self.relay_connection().await?;
        let released = diesel::sql_query(&self.statements().release)
            .bind::<Array<Uuid>, _>(inbox_postgres::id_column(&lease.ids()))
            .bind::<Uuid, _>(lease.id.as_uuid())
            .execute(&mut *conn)
            .await;
        let released = conn.finish(released).await;
        match released {
            Ok(rows) => Ok(affected(rows)),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }

    async fn lookup_outgoing(&self, id: &MessageId) -> Result<Option<OutboxRecord>, InboxError> {
        let mut conn = self.relay_connection().await?;
        let row = LookupOutgoing(&self.statements().lookup_outgoing, *id.as_uuid())
            .get_result::<OutboxColumns>(&mut *conn)
            .await
            .optional();
        let row = conn.finish(row).await;
        match row {
            Ok(row) => row
                .map(|columns| OutboxRow::from(columns).into_record())
                .transpose(),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }

    async fn pending_count(&self) -> Result<u64, InboxError> {
        let mut conn = self.relay_connection().await?;
        let count = diesel::select(diesel::dsl::sql::<BigInt>(&format!(
            "({})",
            self.statements().pending_count
        )))
        .get_result::<i64>(&mut *conn)
        .await;
        let count = conn.finish(count).await;
        match count {
            Ok(count) => Ok(u64::try_from(count).unwrap_or(0)),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }

    async fn dead_count(&self) -> Result<u64, InboxError> {
        let mut conn = self.relay_connection().await?;
        let count = diesel::select(diesel::dsl::sql::<BigInt>(&format!(
            "({})",
            self.statements().dead_count
        )))
        .get_result::<i64>(&mut *conn)
        .await;
        let count = conn.finish(count).await;
        match count {
            Ok(count) => Ok(u64::try_from(count).unwrap_or(0)),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }

    async fn purge_published_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.purge_batch(
            &self.statements().purge_published_batch,
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
        let mut conn = self.relay_connection().await?;
        let rows = diesel::sql_query(&self.statements().record_refusals)
            .bind::<Array<Uuid>, _>(ids)
            .bind::<Array<Text>, _>(errors)
            .bind::<Uuid, _>(lease.as_uuid())
            .bind::<Double, _>(base)
            .bind::<Double, _>(max)
            .bind::<Integer, _>(attempts)
            .load::<RefusedRow>(&mut *conn)
            .await;
        let rows = conn.finish(rows).await;
        match rows {
            Ok(rows) => Ok(inbox_postgres::refused(
                rows.into_iter().map(|r| (r.message_id, r.dead)).collect(),
            )),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }

    async fn dead_outgoing(&self, limit: NonZeroU32) -> Result<Vec<OutboxRecord>, InboxError> {
        let mut conn = self.relay_connection().await?;
        let rows = DeadOutgoing(&self.statements().dead_outgoing, i64::from(limit.get()))
            .load::<OutboxColumns>(&mut *conn)
            .await;
        let rows = conn.finish(rows).await;
        match rows {
            Ok(rows) => inbox_postgres::records(rows),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }

    async fn requeue_dead(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        let mut conn = self.relay_connection().await?;
        let requeued = diesel::sql_query(&self.statements().requeue_dead)
            .bind::<Array<Uuid>, _>(inbox_postgres::id_column(ids))
            .execute(&mut *conn)
            .await;
        let requeued = conn.finish(requeued).await;
        match requeued {
            Ok(rows) => Ok(affected(rows)),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }
}

/// A row of [`inbox_postgres::sql::RECORD_REFUSALS`].
#[derive(diesel::QueryableByName)]
struct RefusedRow {
    #[diesel(sql_type = Uuid)]
    message_id: uuid::Uuid,
    #[diesel(sql_type = diesel::sql_types::Bool)]
    dead: bool,
}
