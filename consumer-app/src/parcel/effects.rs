//! The consumers' business writes, backend-generic.
//!
//! A consumer writes through [`ParcelEffects`] on the inbox transaction it is
//! handed, so its rows commit together with the claim or not at all. Each
//! store's transaction implements it behind its cargo feature, in that
//! store's file under [`crate::parcel::store`]: SQL on the transaction's
//! connection for the Postgres backends, buffered key-value writes for the
//! memory store.

use std::future::Future;

use inbox_api::{MessageId, OutboxTransaction};

use crate::parcel::events::ParcelCreatedEvent;
use inbox_runtime::AppError;

/// Which notification: the `kind` column of `notifications`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NotificationKind {
    /// "Your parcel is on its way", for `parcel.created`.
    ParcelCreated,
    /// "A carrier has your parcel", for `parcel.carrier-assigned`.
    CarrierAssigned,
}

impl NotificationKind {
    /// Both kinds.
    pub const ALL: [Self; 2] = [Self::ParcelCreated, Self::CarrierAssigned];

    /// The value stored in the `kind` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ParcelCreated => "parcel_created",
            Self::CarrierAssigned => "carrier_assigned",
        }
    }

    /// The kind a stored value names.
    ///
    /// # Errors
    /// [`AppError::Config`] for a value no release writes.
    pub fn parse(value: &str) -> Result<Self, AppError> {
        Self::ALL
            .into_iter()
            .find(|kind| kind.as_str() == value)
            .ok_or_else(|| AppError::Config(format!("unknown notification kind {value:?}")))
    }
}

/// A notification the recipient is to receive: the row written in the
/// transaction (the *intent*), sent after commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The message that caused it; also the sender's idempotency key.
    pub message_id: MessageId,
    /// Which notification.
    pub kind: NotificationKind,
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

/// A committed intent, as the reconciler reads it back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Intent {
    /// A notification to send.
    Notification(Notification),
    /// A carrier slot to book.
    Carrier(CarrierAssignment),
}

/// The Parcel domain's writes inside one store transaction: the two
/// consumers' effects (inside their inbox transaction), and the producer's
/// `parcels` row (inside the transaction that enqueues its event, hence the
/// [`OutboxTransaction`] supertrait: a write and the messages it causes
/// commit together).
pub trait ParcelEffects: OutboxTransaction {
    /// Records a notification to send (one `notifications` row, of its
    /// kind).
    fn record_notification(
        &mut self,
        notification: &Notification,
    ) -> impl Future<Output = Result<(), AppError>> + Send;

    /// Reserves a carrier slot (one `carrier_assignments` row).
    fn reserve_carrier_slot(
        &mut self,
        assignment: &CarrierAssignment,
    ) -> impl Future<Output = Result<(), AppError>> + Send;

    /// Inserts the `parcels` row `parcel` describes unless a row with its
    /// id exists (committed, or written earlier in this transaction; on
    /// PostgreSQL one another open transaction wrote is waited for).
    /// Returns whether it inserted.
    fn insert_parcel(
        &mut self,
        parcel: &ParcelCreatedEvent,
    ) -> impl Future<Output = Result<bool, AppError>> + Send;

    /// The `parcels` row of `parcel_id`, as this transaction sees it.
    fn find_parcel(
        &mut self,
        parcel_id: &str,
    ) -> impl Future<Output = Result<Option<ParcelCreatedEvent>, AppError>> + Send;
}

/// The app's schema: its tables, in the store's schema, after the inbox's,
/// in order (each script idempotent).
pub const APP_MIGRATIONS: [&str; 3] = [
    include_str!("../../migrations/0001_parcel_effects.sql"),
    include_str!("../../migrations/0002_parcels.sql"),
    include_str!("../../migrations/0003_notification_kind.sql"),
];

/// The app's migration as one script for the simple query protocol: several
/// statements in one simple query run as one implicit transaction, so the
/// advisory lock in front serialises concurrent `migrate` runs of several
/// instances (two `CREATE TABLE IF NOT EXISTS` at once can fail on the
/// catalog's unique index) until the script commits, and a failure rolls the
/// whole script back.
pub fn app_migration_script() -> String {
    format!(
        "SELECT pg_advisory_xact_lock(hashtext('parcel-inbox-app-migrate'));\n{}",
        APP_MIGRATIONS.join("\n")
    )
}
