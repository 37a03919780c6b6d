//! The sqlx backend of the Parcel store: the effects on the inbox
//! transaction's connection, and the rest through the pool.

use std::time::Duration;

use inbox_api::MessageId;
use inbox_backend_sqlx::{SqlxStore, SqlxTransaction, classify};
use sqlx::Row;

use super::{EffectCounts, ParcelStore, StoreKind, count, sql};
use crate::parcel::effects::{
    CarrierAssignment, Intent, Notification, NotificationKind, ParcelEffects, app_migration_script,
};
use crate::parcel::events::ParcelCreatedEvent;
use crate::parcel::role::Role;
use inbox_runtime::AppError;

async fn effects(
    store: &SqlxStore,
    query: &str,
    kind: Option<NotificationKind>,
) -> Result<EffectCounts, AppError> {
    let mut query = sqlx::query(query);
    if let Some(kind) = kind {
        query = query.bind(kind.as_str());
    }
    let row = query.fetch_one(store.pool()).await.map_err(classify)?;
    Ok(EffectCounts {
        rows: count(row.try_get("rows").map_err(classify)?),
        distinct_messages: count(row.try_get("messages").map_err(classify)?),
        distinct_parcels: count(row.try_get("parcels").map_err(classify)?),
    })
}

impl ParcelStore for SqlxStore {
    async fn create_partitions(&self, days_ahead: u16) -> Result<u64, AppError> {
        Ok(Self::create_partitions(self, 0, days_ahead).await?)
    }

    async fn drop_expired_days(
        &self,
        cutoff: chrono::DateTime<chrono::Utc>,
    ) -> Result<Option<u64>, AppError> {
        Ok(Self::drop_expired_days(self, cutoff).await?)
    }

    async fn partitions(&self) -> Result<Vec<inbox_postgres::Partition>, AppError> {
        Ok(Self::partitions(self).await?)
    }

    fn kind(&self) -> StoreKind {
        StoreKind::Sqlx
    }

    async fn migrate_all(&self) -> Result<(), AppError> {
        self.migrate().await?;
        let script = app_migration_script();
        sqlx::raw_sql(&script)
            .execute(self.pool())
            .await
            .map_err(classify)?;
        tracing::info!(schema = self.schema(), "app tables migrated (sqlx)");
        Ok(())
    }

    async fn effect_counts(&self) -> Result<(EffectCounts, EffectCounts), AppError> {
        Ok((
            self.notification_counts(NotificationKind::ParcelCreated)
                .await?,
            effects(self, sql::CARRIER, None).await?,
        ))
    }

    async fn notification_counts(&self, kind: NotificationKind) -> Result<EffectCounts, AppError> {
        effects(self, sql::NOTIFICATIONS, Some(kind)).await
    }

    async fn parcel_count(&self) -> Result<u64, AppError> {
        let rows: i64 = sqlx::query_scalar(sql::PARCELS)
            .fetch_one(self.pool())
            .await
            .map_err(classify)?;
        Ok(count(rows))
    }

    async fn drop_schema(&self) -> Result<(), AppError> {
        // The name is validated by the store (a plain identifier).
        let drop = format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.schema());
        sqlx::query(&drop)
            .execute(self.pool())
            .await
            .map_err(classify)?;
        Ok(())
    }

    async fn record_stub_call(
        &self,
        downstream: &str,
        idempotency_key: &str,
        parcel_id: &str,
    ) -> Result<u64, AppError> {
        let calls: i64 = sqlx::query_scalar(sql::RECORD_STUB_CALL)
            .bind(downstream)
            .bind(idempotency_key)
            .bind(parcel_id)
            .fetch_one(self.pool())
            .await
            .map_err(classify)?;
        Ok(count(calls))
    }

    async fn mark_dispatched(&self, role: Role, message_id: &MessageId) -> Result<(), AppError> {
        sqlx::query(sql::mark(role))
            .bind(message_id.as_uuid())
            .execute(self.pool())
            .await
            .map_err(classify)?;
        Ok(())
    }

    async fn undispatched(&self, min_age: Duration, limit: u32) -> Result<Vec<Intent>, AppError> {
        let mut intents = Vec::new();
        let rows = sqlx::query(sql::UNDISPATCHED_NOTIFICATIONS)
            .bind(min_age.as_secs_f64())
            .bind(i64::from(limit))
            .fetch_all(self.pool())
            .await
            .map_err(classify)?;
        for row in rows {
            let id: uuid::Uuid = row.try_get("message_id").map_err(classify)?;
            let kind: String = row.try_get("kind").map_err(classify)?;
            intents.push(Intent::Notification(Notification {
                message_id: id.into(),
                kind: NotificationKind::parse(&kind)?,
                parcel_id: row.try_get("parcel_id").map_err(classify)?,
                tracking_number: row.try_get("tracking_number").map_err(classify)?,
                destination: row.try_get("destination").map_err(classify)?,
                body: row.try_get("body").map_err(classify)?,
            }));
        }
        let rows = sqlx::query(sql::UNDISPATCHED_CARRIER)
            .bind(min_age.as_secs_f64())
            .bind(i64::from(limit))
            .fetch_all(self.pool())
            .await
            .map_err(classify)?;
        for row in rows {
            let id: uuid::Uuid = row.try_get("message_id").map_err(classify)?;
            intents.push(Intent::Carrier(CarrierAssignment {
                message_id: id.into(),
                parcel_id: row.try_get("parcel_id").map_err(classify)?,
                carrier: row.try_get("carrier").map_err(classify)?,
                slot: row.try_get("slot").map_err(classify)?,
            }));
        }
        Ok(intents)
    }
}

impl ParcelEffects for SqlxTransaction {
    async fn record_notification(&mut self, n: &Notification) -> Result<(), AppError> {
        sqlx::query(sql::RECORD_NOTIFICATION)
            .bind(n.message_id.as_uuid())
            .bind(n.kind.as_str())
            .bind(&n.parcel_id)
            .bind(&n.tracking_number)
            .bind(&n.destination)
            .bind(&n.body)
            .execute(self.conn())
            .await
            .map_err(classify)?;
        Ok(())
    }

    async fn reserve_carrier_slot(&mut self, a: &CarrierAssignment) -> Result<(), AppError> {
        sqlx::query(sql::RESERVE_CARRIER_SLOT)
            .bind(a.message_id.as_uuid())
            .bind(&a.parcel_id)
            .bind(&a.carrier)
            .bind(&a.slot)
            .execute(self.conn())
            .await
            .map_err(classify)?;
        Ok(())
    }

    async fn insert_parcel(&mut self, parcel: &ParcelCreatedEvent) -> Result<bool, AppError> {
        let done = sqlx::query(sql::INSERT_PARCEL)
            .bind(&parcel.parcel_id)
            .bind(&parcel.tracking_number)
            .bind(&parcel.destination)
            .execute(self.conn())
            .await
            .map_err(classify)?;
        Ok(done.rows_affected() == 1)
    }

    async fn find_parcel(
        &mut self,
        parcel_id: &str,
    ) -> Result<Option<ParcelCreatedEvent>, AppError> {
        let row = sqlx::query(sql::FIND_PARCEL)
            .bind(parcel_id)
            .fetch_optional(self.conn())
            .await
            .map_err(classify)?;
        row.map(|row| {
            Ok(ParcelCreatedEvent {
                parcel_id: row.try_get("parcel_id").map_err(classify)?,
                tracking_number: row.try_get("tracking_number").map_err(classify)?,
                destination: row.try_get("destination").map_err(classify)?,
            })
        })
        .transpose()
    }
}
