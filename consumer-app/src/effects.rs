//! The consumers' business writes, backend-generic.
//!
//! A consumer writes through [`ParcelEffects`] on the inbox transaction it is
//! handed, so its rows commit together with the claim or not at all. Each
//! store's transaction implements it behind its cargo feature: SQL on the
//! transaction's connection for the Postgres backends, buffered key-value
//! writes for the memory store.

use std::future::Future;

use inbox_api::MessageId;

use crate::AppError;

/// A notification the recipient is to receive: the row written in the
/// transaction (the *intent*), sent after commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The message that caused it; also the sender's idempotency key.
    pub message_id: MessageId,
    /// Which parcel.
    pub parcel_id: String,
    /// The label number.
    pub tracking_number: String,
    /// Where it goes.
    pub destination: String,
    /// The text sent.
    pub body: String,
}

/// A carrier slot reserved for a parcel: the row written in the transaction
/// (the *intent*), booked with the carrier after commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CarrierAssignment {
    /// The message that caused it; also the carrier's idempotency key.
    pub message_id: MessageId,
    /// Which parcel.
    pub parcel_id: String,
    /// Which carrier.
    pub carrier: String,
    /// The reserved pick-up slot.
    pub slot: String,
}

/// The business writes of the two consumers, inside an inbox transaction.
pub trait ParcelEffects: Send {
    /// Records a notification to send (one `notifications` row).
    fn record_notification(
        &mut self,
        notification: &Notification,
    ) -> impl Future<Output = Result<(), AppError>> + Send;

    /// Reserves a carrier slot (one `carrier_assignments` row).
    fn reserve_carrier_slot(
        &mut self,
        assignment: &CarrierAssignment,
    ) -> impl Future<Output = Result<(), AppError>> + Send;
}

/// The app's schema: its tables, in the store's schema, after the inbox's.
pub const APP_MIGRATION: &str = include_str!("../migrations/0001_parcel_effects.sql");

/// The app's migration as one script for the simple query protocol: several
/// statements in one simple query run as one implicit transaction, so the
/// advisory lock in front serialises concurrent `migrate` runs of several
/// instances (two `CREATE TABLE IF NOT EXISTS` at once can fail on the
/// catalog's unique index) until the script commits, and a failure rolls the
/// whole script back.
pub fn app_migration_script() -> String {
    format!("SELECT pg_advisory_xact_lock(hashtext('parcel-inbox-app-migrate'));\n{APP_MIGRATION}")
}

#[cfg(feature = "sqlx")]
mod sqlx_impl {
    use inbox_backend_sqlx::{SqlxTransaction, classify};

    use super::{CarrierAssignment, Notification, ParcelEffects};
    use crate::AppError;

    impl ParcelEffects for SqlxTransaction {
        async fn record_notification(&mut self, n: &Notification) -> Result<(), AppError> {
            sqlx::query(
                "INSERT INTO notifications \
                 (message_id, parcel_id, tracking_number, destination, body) \
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(n.message_id.as_uuid())
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
            sqlx::query(
                "INSERT INTO carrier_assignments (message_id, parcel_id, carrier, slot) \
                 VALUES ($1, $2, $3, $4)",
            )
            .bind(a.message_id.as_uuid())
            .bind(&a.parcel_id)
            .bind(&a.carrier)
            .bind(&a.slot)
            .execute(self.conn())
            .await
            .map_err(classify)?;
            Ok(())
        }
    }
}

#[cfg(feature = "diesel")]
mod diesel_impl {
    use diesel::sql_types::{Text, Uuid};
    use diesel_async::RunQueryDsl;
    use inbox_backend_diesel::{DieselTransaction, classify};

    use super::{CarrierAssignment, Notification, ParcelEffects};
    use crate::AppError;

    impl ParcelEffects for DieselTransaction {
        async fn record_notification(&mut self, n: &Notification) -> Result<(), AppError> {
            diesel::sql_query(
                "INSERT INTO notifications \
                 (message_id, parcel_id, tracking_number, destination, body) \
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind::<Uuid, _>(*n.message_id.as_uuid())
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
            diesel::sql_query(
                "INSERT INTO carrier_assignments (message_id, parcel_id, carrier, slot) \
                 VALUES ($1, $2, $3, $4)",
            )
            .bind::<Uuid, _>(*a.message_id.as_uuid())
            .bind::<Text, _>(&a.parcel_id)
            .bind::<Text, _>(&a.carrier)
            .bind::<Text, _>(&a.slot)
            .execute(self.conn())
            .await
            .map_err(classify)?;
            Ok(())
        }
    }
}

#[cfg(feature = "memory")]
mod memory_impl {
    use inbox_api::InboxError;
    use inbox_backend_memory::MemoryTransaction;

    use super::{CarrierAssignment, Notification, ParcelEffects};
    use crate::AppError;

    /// Key prefixes of the memory store's "tables".
    pub(crate) const NOTIFICATIONS: &str = "notifications/";
    /// See [`NOTIFICATIONS`].
    pub(crate) const CARRIER_ASSIGNMENTS: &str = "carrier_assignments/";

    /// Each row gets a fresh key (message id plus a random row id), like a
    /// BIGSERIAL: a second effect of one message would be a second entry,
    /// visible and countable, not an overwrite that hides it.
    fn row_key(prefix: &str, message_id: &inbox_api::MessageId) -> String {
        format!("{prefix}{message_id}/{}", uuid::Uuid::new_v4())
    }

    fn encode(value: &serde_json::Value) -> Result<Vec<u8>, AppError> {
        serde_json::to_vec(value).map_err(|e| AppError::Inbox(InboxError::permanent_handler(e)))
    }

    impl ParcelEffects for MemoryTransaction {
        async fn record_notification(&mut self, n: &Notification) -> Result<(), AppError> {
            let value = encode(&serde_json::json!({
                "message_id": n.message_id.to_string(),
                "parcel_id": n.parcel_id,
                "tracking_number": n.tracking_number,
                "destination": n.destination,
                "body": n.body,
            }))?;
            self.put(row_key(NOTIFICATIONS, &n.message_id), value);
            Ok(())
        }

        async fn reserve_carrier_slot(&mut self, a: &CarrierAssignment) -> Result<(), AppError> {
            let value = encode(&serde_json::json!({
                "message_id": a.message_id.to_string(),
                "parcel_id": a.parcel_id,
                "carrier": a.carrier,
                "slot": a.slot,
            }))?;
            self.put(row_key(CARRIER_ASSIGNMENTS, &a.message_id), value);
            Ok(())
        }
    }
}

#[cfg(feature = "memory")]
pub(crate) use memory_impl::{CARRIER_ASSIGNMENTS, NOTIFICATIONS};
