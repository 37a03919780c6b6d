//! The diesel-async backend of the Parcel store: the effects on the inbox
//! transaction's connection, and the rest through the pool.

use std::time::Duration;

use diesel::sql_types::{BigInt, Double, Text, Uuid as SqlUuid};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use inbox_api::MessageId;
use inbox_backend_diesel::{DieselStore, DieselTransaction, classify, classify_pool};

use super::{EffectCounts, ParcelStore, StoreKind, count, sql};
use crate::parcel::effects::{
    CarrierAssignment, Intent, Notification, NotificationKind, ParcelEffects, app_migration_script,
};
use crate::parcel::events::ParcelCreatedEvent;
use crate::parcel::role::Role;
use inbox_runtime::AppError;

#[derive(QueryableByName)]
struct Calls {
    #[diesel(sql_type = BigInt)]
    calls: i64,
}

#[derive(QueryableByName)]
struct PendingNotification {
    #[diesel(sql_type = SqlUuid)]
    message_id: uuid::Uuid,
    #[diesel(sql_type = Text)]
    kind: String,
    #[diesel(sql_type = Text)]
    parcel_id: String,
    #[diesel(sql_type = Text)]
    tracking_number: String,
    #[diesel(sql_type = Text)]
    destination: String,
    #[diesel(sql_type = Text)]
    body: String,
}

#[derive(QueryableByName)]
struct PendingCarrier {
    #[diesel(sql_type = SqlUuid)]
    message_id: uuid::Uuid,
    #[diesel(sql_type = Text)]
    parcel_id: String,
    #[diesel(sql_type = Text)]
    carrier: String,
    #[diesel(sql_type = Text)]
    slot: String,
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    count: i64,
}

#[derive(QueryableByName)]
struct ParcelRow {
    #[diesel(sql_type = Text)]
    parcel_id: String,
    #[diesel(sql_type = Text)]
    tracking_number: String,
    #[diesel(sql_type = Text)]
    destination: String,
}

#[derive(QueryableByName)]
struct Effects {
    #[diesel(sql_type = BigInt)]
    rows: i64,
    #[diesel(sql_type = BigInt)]
    messages: i64,
    #[diesel(sql_type = BigInt)]
    parcels: i64,
}

async fn effects(
    store: &DieselStore,
    query: &str,
    kind: Option<NotificationKind>,
) -> Result<EffectCounts, AppError> {
    let mut conn = store.pool().get().await.map_err(classify_pool)?;
    let row: Effects = match kind {
        Some(kind) => {
            diesel::sql_query(query)
                .bind::<Text, _>(kind.as_str())
                .get_result(&mut *conn)
                .await
        }
        None => diesel::sql_query(query).get_result(&mut *conn).await,
    }
    .map_err(classify)?;
    Ok(EffectCounts {
        rows: count(row.rows),
        distinct_messages: count(row.messages),
        distinct_parcels: count(row.parcels),
    })
}

impl ParcelStore for DieselStore {
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
        StoreKind::Diesel
    }

    async fn migrate_all(&self) -> Result<(), AppError> {
        self.migrate().await?;
        let mut conn = self.pool().get().await.map_err(classify_pool)?;
        conn.batch_execute(&app_migration_script())
            .await
            .map_err(classify)?;
        tracing::info!(
            schema = self.schema().as_str(),
            "app tables migrated (diesel)"
        );
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
        let mut conn = self.pool().get().await.map_err(classify_pool)?;
        let row: Count = diesel::sql_query(sql::PARCELS)
            .get_result(&mut *conn)
            .await
            .map_err(classify)?;
        Ok(count(row.count))
    }

    async fn drop_schema(&self) -> Result<(), AppError> {
        let mut conn = self.pool().get().await.map_err(classify_pool)?;
        let drop = format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.schema().as_str()
        );
        conn.batch_execute(&drop).await.map_err(classify)?;
        Ok(())
    }

    async fn record_stub_call(
        &self,
        downstream: &str,
        idempotency_key: &str,
        parcel_id: &str,
    ) -> Result<u64, AppError> {
        let mut conn = self.pool().get().await.map_err(classify_pool)?;
        let row: Calls = diesel::sql_query(sql::RECORD_STUB_CALL)
            .bind::<Text, _>(downstream)
            .bind::<Text, _>(idempotency_key)
            .bind::<Text, _>(parcel_id)
            .get_result(&mut *conn)
            .await
            .map_err(classify)?;
        Ok(count(row.calls))
    }

    async fn mark_dispatched(&self, role: Role, message_id: &MessageId) -> Result<(), AppError> {
        let mut conn = self.pool().get().await.map_err(classify_pool)?;
        diesel::sql_query(sql::mark(role))
            .bind::<SqlUuid, _>(*message_id.as_uuid())
            .execute(&mut *conn)
            .await
            .map_err(classify)?;
        Ok(())
    }

    async fn undispatched(&self, min_age: Duration, limit: u32) -> Result<Vec<Intent>, AppError> {
        let mut conn = self.pool().get().await.map_err(classify_pool)?;
        let notifications: Vec<PendingNotification> =
            diesel::sql_query(sql::UNDISPATCHED_NOTIFICATIONS)
                .bind::<Double, _>(min_age.as_secs_f64())
                .bind::<BigInt, _>(i64::from(limit))
                .load(&mut *conn)
                .await
                .map_err(classify)?;
        let carrier: Vec<PendingCarrier> = diesel::sql_query(sql::UNDISPATCHED_CARRIER)
            .bind::<Double, _>(min_age.as_secs_f64())
            .bind::<BigInt, _>(i64::from(limit))
            .load(&mut *conn)
            .await
            .map_err(classify)?;
        let mut intents: Vec<Intent> = notifications
            .into_iter()
            .map(|n| {
                Ok(Intent::Notification(Notification {
                    message_id: n.message_id.into(),
                    kind: NotificationKind::parse(&n.kind)?,
                    parcel_id: n.parcel_id,
                    tracking_number: n.tracking_number,
                    destination: n.destination,
                    body: n.body,
                }))
            })
            .collect::<Result<_, AppError>>()?;
        intents.extend(carrier.into_iter().map(|a| {
            Intent::Carrier(CarrierAssignment {
                message_id: a.message_id.into(),
                parcel_id: a.parcel_id,
                carrier: a.carrier,
                slot: a.slot,
            })
        }));
        Ok(intents)
    }
}

impl ParcelEffects for DieselTransaction {
    async fn record_notification(&mut self, n: &Notification) -> Result<(), AppError> {
        diesel::sql_query(sql::RECORD_NOTIFICATION)
            .bind::<SqlUuid, _>(*n.message_id.as_uuid())
            .bind::<Text, _>(n.kind.as_str())
            .bind::<Text, _>(&n.parcel_id)
            .bind::<Text, _>(&n.tracking_number)
            .bind::<Text, _>(&n.destination)
            .bind::<Text, _>(&n.body)
            .execute(self.conn())
            .await
            .map_err(classify)?;
        Ok(())
    }

    async fn reserve_carrier_slot(&mut self, a: &CarrierAssignment) -> Result<(), AppError> {
        diesel::sql_query(sql::RESERVE_CARRIER_SLOT)
            .bind::<SqlUuid, _>(*a.message_id.as_uuid())
            .bind::<Text, _>(&a.parcel_id)
            .bind::<Text, _>(&a.carrier)
            .bind::<Text, _>(&a.slot)
            .execute(self.conn())
            .await
            .map_err(classify)?;
        Ok(())
    }

    async fn insert_parcel(&mut self, parcel: &ParcelCreatedEvent) -> Result<bool, AppError> {
        let inserted = diesel::sql_query(sql::INSERT_PARCEL)
            .bind::<Text, _>(&parcel.parcel_id)
            .bind::<Text, _>(&parcel.tracking_number)
            .bind::<Text, _>(&parcel.destination)
            .execute(self.conn())
            .await
            .map_err(classify)?;
        Ok(inserted == 1)
    }

    async fn find_parcel(
        &mut self,
        parcel_id: &str,
    ) -> Result<Option<ParcelCreatedEvent>, AppError> {
        let row: Option<ParcelRow> = diesel::sql_query(sql::FIND_PARCEL)
            .bind::<Text, _>(parcel_id)
            .get_result(self.conn())
            .await
            .optional()
            .map_err(classify)?;
        Ok(row.map(|row| ParcelCreatedEvent {
            parcel_id: row.parcel_id,
            tracking_number: row.tracking_number,
            destination: row.destination,
        }))
    }
}
