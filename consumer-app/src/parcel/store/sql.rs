//! The SQL both Postgres backends send for the Parcel tables (the inbox's
//! own statements live in the `inbox-postgres` crate).

use crate::parcel::role::Role;

/// Of one kind (`$1`).
pub(super) const NOTIFICATIONS: &str = "SELECT count(*)::int8 AS rows, \
    count(DISTINCT message_id)::int8 AS messages, count(DISTINCT parcel_id)::int8 AS parcels \
    FROM notifications WHERE kind = $1";
pub(super) const RECORD_NOTIFICATION: &str = "INSERT INTO notifications \
    (message_id, kind, parcel_id, tracking_number, destination, body) \
    VALUES ($1, $2, $3, $4, $5, $6)";
pub(super) const RESERVE_CARRIER_SLOT: &str = "INSERT INTO carrier_assignments \
    (message_id, parcel_id, carrier, slot) VALUES ($1, $2, $3, $4)";
pub(super) const CARRIER: &str = "SELECT count(*)::int8 AS rows, \
    count(DISTINCT message_id)::int8 AS messages, count(DISTINCT parcel_id)::int8 AS parcels \
    FROM carrier_assignments";
pub(super) const RECORD_STUB_CALL: &str = "INSERT INTO stub_ledger \
    (downstream, idempotency_key, parcel_id) VALUES ($1, $2, $3) \
    ON CONFLICT (downstream, idempotency_key) \
    DO UPDATE SET calls = stub_ledger.calls + 1, last_call_at = now() RETURNING calls";
pub(super) const MARK_NOTIFICATION: &str = "UPDATE notifications SET dispatched_at = now() \
    WHERE message_id = $1 AND dispatched_at IS NULL";
pub(super) const MARK_CARRIER: &str = "UPDATE carrier_assignments SET dispatched_at = now() \
    WHERE message_id = $1 AND dispatched_at IS NULL";
pub(super) const UNDISPATCHED_NOTIFICATIONS: &str = "SELECT message_id, kind, parcel_id, \
    tracking_number, destination, body FROM notifications \
    WHERE dispatched_at IS NULL AND created_at < now() - make_interval(secs => $1) \
    ORDER BY created_at LIMIT $2";
pub(super) const UNDISPATCHED_CARRIER: &str = "SELECT message_id, parcel_id, carrier, slot \
    FROM carrier_assignments \
    WHERE dispatched_at IS NULL AND created_at < now() - make_interval(secs => $1) \
    ORDER BY created_at LIMIT $2";
pub(super) const PARCELS: &str = "SELECT count(*)::int8 AS count FROM parcels";
/// Waits for an open transaction inserting the same id, as the primary key
/// makes it; affects no row when the parcel exists.
pub(super) const INSERT_PARCEL: &str = "INSERT INTO parcels \
    (parcel_id, tracking_number, destination) VALUES ($1, $2, $3) \
    ON CONFLICT (parcel_id) DO NOTHING";
pub(super) const FIND_PARCEL: &str = "SELECT parcel_id, tracking_number, destination \
    FROM parcels WHERE parcel_id = $1";

/// The statement marking `role`'s intents dispatched.
pub(super) fn mark(role: Role) -> &'static str {
    match role {
        Role::Notification | Role::CarrierAssignedNotification => MARK_NOTIFICATION,
        Role::Carrier => MARK_CARRIER,
    }
}
