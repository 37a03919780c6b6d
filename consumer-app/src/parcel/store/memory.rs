//! The memory backend of the Parcel store: the effect "tables" are key
//! prefixes of the store's key-value writes, buffered in the transaction.

use std::collections::{HashMap, HashSet};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use inbox_api::{InboxError, MessageId};
use inbox_backend_memory::{MemoryStore, MemoryTransaction};

use super::{EffectCounts, ParcelStore, StoreKind};
use crate::parcel::effects::{
    CarrierAssignment, Intent, Notification, NotificationKind, ParcelEffects,
};
use crate::parcel::events::ParcelCreatedEvent;
use crate::parcel::role::Role;
use inbox_runtime::AppError;

/// Key prefixes of the memory store's "tables"; notifications per kind
/// ([`notifications`]).
const NOTIFICATIONS: &str = "notifications/";
/// See [`NOTIFICATIONS`].
const CARRIER_ASSIGNMENTS: &str = "carrier_assignments/";
/// See [`NOTIFICATIONS`]; one key per parcel id (the primary key).
const PARCELS: &str = "parcels/";

/// The key prefix of one kind's notifications.
fn notifications(kind: NotificationKind) -> String {
    format!("{NOTIFICATIONS}{}/", kind.as_str())
}

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
            "kind": n.kind.as_str(),
            "parcel_id": n.parcel_id,
            "tracking_number": n.tracking_number,
            "destination": n.destination,
            "body": n.body,
        }))?;
        self.put(row_key(&notifications(n.kind), &n.message_id), value);
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

    /// The memory store has no row locks: two open transactions inserting
    /// one parcel id would both see it absent. The producer enqueues the
    /// parcel's event first, under an id derived from the parcel id
    /// ([`crate::parcel::events::created_message_id`]); that enqueue waits
    /// for the other transaction as PostgreSQL's primary key would.
    async fn insert_parcel(&mut self, parcel: &ParcelCreatedEvent) -> Result<bool, AppError> {
        let key = format!("{PARCELS}{}", parcel.parcel_id);
        if self.get(&key).is_some() {
            return Ok(false);
        }
        let value = serde_json::to_vec(parcel)
            .map_err(|e| AppError::Inbox(InboxError::permanent_handler(e)))?;
        self.put(key, value);
        Ok(true)
    }

    async fn find_parcel(
        &mut self,
        parcel_id: &str,
    ) -> Result<Option<ParcelCreatedEvent>, AppError> {
        self.get(&format!("{PARCELS}{parcel_id}"))
            .map(|value| {
                serde_json::from_slice(&value)
                    .map_err(|e| AppError::Inbox(InboxError::permanent_handler(e)))
            })
            .transpose()
    }
}

fn effects(store: &MemoryStore, prefix: &str) -> EffectCounts {
    let rows = store.scan_prefix(prefix);
    let mut messages = HashSet::new();
    let mut parcels = HashSet::new();
    for (key, value) in &rows {
        let message = key[prefix.len()..].split('/').next().unwrap_or_default();
        messages.insert(message.to_owned());
        if let Ok(json) = serde_json::from_slice::<serde_json::Value>(value)
            && let Some(parcel) = json.get("parcel_id").and_then(|p| p.as_str())
        {
            parcels.insert(parcel.to_owned());
        }
    }
    EffectCounts {
        rows: rows.len() as u64,
        distinct_messages: messages.len() as u64,
        distinct_parcels: parcels.len() as u64,
    }
}

impl ParcelStore for MemoryStore {
    fn kind(&self) -> StoreKind {
        StoreKind::Memory
    }

    async fn migrate_all(&self) -> Result<(), AppError> {
        Ok(())
    }

    async fn effect_counts(&self) -> Result<(EffectCounts, EffectCounts), AppError> {
        Ok((
            effects(self, &notifications(NotificationKind::ParcelCreated)),
            effects(self, CARRIER_ASSIGNMENTS),
        ))
    }

    async fn notification_counts(&self, kind: NotificationKind) -> Result<EffectCounts, AppError> {
        Ok(effects(self, &notifications(kind)))
    }

    async fn parcel_count(&self) -> Result<u64, AppError> {
        Ok(self.scan_prefix(PARCELS).len() as u64)
    }

    async fn drop_schema(&self) -> Result<(), AppError> {
        Ok(())
    }

    /// The memory store's "ledger" lives in this process (as the
    /// store itself does).
    async fn record_stub_call(
        &self,
        downstream: &str,
        idempotency_key: &str,
        parcel_id: &str,
    ) -> Result<u64, AppError> {
        static LEDGER: LazyLock<Mutex<HashMap<(String, String), u64>>> =
            LazyLock::new(Mutex::default);
        let _ = parcel_id;
        let mut ledger = LEDGER
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let calls = ledger
            .entry((downstream.to_owned(), idempotency_key.to_owned()))
            .or_default();
        *calls += 1;
        Ok(*calls)
    }

    /// Intents are not tracked in the memory store: nothing outlives the
    /// process to reconcile.
    async fn mark_dispatched(&self, _role: Role, _id: &MessageId) -> Result<(), AppError> {
        Ok(())
    }

    async fn undispatched(&self, _min_age: Duration, _limit: u32) -> Result<Vec<Intent>, AppError> {
        Ok(Vec::new())
    }
}
