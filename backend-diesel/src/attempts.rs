//! The attempt ledger on the diesel backend: `inbox-postgres`'s statements,
//! each on a pooled connection of its own outside any transaction, so each
//! commits by itself and never with the consumer's rolled-back work. Rare
//! statements (one per failed delivery), so `sql_query` is enough.

use std::num::NonZeroU32;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Integer, Nullable, Text, Timestamptz, Uuid};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::RunQueryDsl;
use inbox_api::{AttemptLedger, AttemptRecord, ConsumerName, InboxError, InboxKey, LastError};
use inbox_postgres::{AttemptColumns, attempt_record};

use crate::DieselStore;
use crate::transaction::refine;

/// The count [`inbox_postgres::sql::RECORD_FAILURE`] returns.
#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = Integer)]
    attempts: i32,
}

/// The columns of [`AttemptColumns`], by name.
#[derive(QueryableByName)]
struct Row {
    #[diesel(sql_type = Uuid)]
    message_id: uuid::Uuid,
    #[diesel(sql_type = Text)]
    consumer: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Text)]
    last_error: String,
    #[diesel(sql_type = Timestamptz)]
    first_failed_at: DateTime<Utc>,
    #[diesel(sql_type = Timestamptz)]
    last_failed_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    dead_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Text>)]
    dead_reason: Option<String>,
}

impl Row {
    fn record(self) -> Result<AttemptRecord, InboxError> {
        let columns: AttemptColumns = (
            self.message_id,
            self.consumer,
            self.attempts,
            self.last_error,
            self.first_failed_at,
            self.last_failed_at,
            self.dead_at,
            self.dead_reason,
        );
        attempt_record(columns)
    }
}

#[async_trait]
impl AttemptLedger for DieselStore {
    async fn record_failure(&self, key: &InboxKey, error: &LastError) -> Result<u32, InboxError> {
        let mut conn = self.checkout().await?;
        let counted = diesel::sql_query(&self.statements().record_failure)
            .bind::<Uuid, _>(key.message_id.as_uuid())
            .bind::<Text, _>(key.consumer.as_str())
            .bind::<Text, _>(error.as_str())
            .get_result::<Count>(&mut *conn)
            .await;
        let counted = conn.finish(counted).await;
        match counted {
            Ok(count) => Ok(inbox_postgres::attempt_count(count.attempts)),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }

    async fn mark_dead(
        &self,
        key: &InboxKey,
        reason: &str,
        error: &LastError,
    ) -> Result<(), InboxError> {
        let mut conn = self.checkout().await?;
        let marked = diesel::sql_query(&self.statements().mark_dead)
            .bind::<Uuid, _>(key.message_id.as_uuid())
            .bind::<Text, _>(key.consumer.as_str())
            .bind::<Text, _>(error.as_str())
            .bind::<Text, _>(reason)
            .execute(&mut *conn)
            .await;
        let marked = conn.finish(marked).await;
        match marked {
            Ok(_) => Ok(()),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }

    async fn attempts(&self, key: &InboxKey) -> Result<Option<AttemptRecord>, InboxError> {
        let mut conn = self.checkout().await?;
        let row = diesel::sql_query(&self.statements().lookup_attempts)
            .bind::<Uuid, _>(key.message_id.as_uuid())
            .bind::<Text, _>(key.consumer.as_str())
            .get_result::<Row>(&mut *conn)
            .await
            .optional();
        let row = conn.finish(row).await;
        match row {
            Ok(row) => row.map(Row::record).transpose(),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }

    async fn dead_messages(
        &self,
        consumer: Option<&ConsumerName>,
        limit: NonZeroU32,
    ) -> Result<Vec<AttemptRecord>, InboxError> {
        let mut conn = self.checkout().await?;
        let rows = diesel::sql_query(&self.statements().dead_messages)
            .bind::<Nullable<Text>, _>(consumer.map(ConsumerName::as_str))
            .bind::<BigInt, _>(i64::from(limit.get()))
            .load::<Row>(&mut *conn)
            .await;
        let rows = conn.finish(rows).await;
        match rows {
            Ok(rows) => rows.into_iter().map(Row::record).collect(),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }

    async fn purge_attempts_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.purge_batch(
            &self.statements().purge_attempts_batch,
            cutoff,
            limit,
            "attempts",
        )
        .await
    }
}
