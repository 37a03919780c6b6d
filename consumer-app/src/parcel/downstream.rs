//! Calls that cannot join the transaction: the carrier's booking API and the
//! notification sender.
//!
//! # The trade-off
//!
//! The inbox makes *database* effects exactly-once: the claim and the rows
//! commit together. An HTTP call or an e-mail cannot join that transaction.
//! Made inside it, the call happens even when the commit then fails, and the
//! redelivery makes it again: at-least-once, with duplicates the inbox cannot
//! see. So the consumers follow the safe shape:
//!
//! 1. **Intent in the transaction.** The consumer writes what it is going to
//!    do (a `carrier_assignments` row with the reserved slot, a
//!    `notifications` row with the text) in the inbox transaction. Those
//!    rows are exactly-once.
//! 2. **Call after commit.** Only after the commit succeeded does the
//!    message path make the call, and only then does it ack the delivery.
//!    A delivery whose transaction rolled back never calls.
//! 3. **Message id as idempotency key.** The call carries the message id, so
//!    a downstream that deduplicates on it (as the stubs here do, and as
//!    carriers' booking APIs commonly do with an `Idempotency-Key` header)
//!    turns any repeated call into a no-op: a later reconciler, or an
//!    operator replaying intents, can safely call again.
//!
//! The window between the commit and the call is closed by
//! [`crate::parcel::dispatch`]: each intent row has a `dispatched_at`, set once the
//! call succeeded. If the process dies between COMMIT and the call, the
//! redelivery is a `Duplicate` (the message path does not call again), but
//! the row stays undispatched, and the reconciler that every `consume`
//! process runs (at start, then every `--dispatch-interval-secs`) re-sends
//! intents undispatched for longer than `--dispatch-min-age-secs`. A call
//! that happened but was not marked (killed in between, or the reconciler
//! racing the message path) is sent again, and the idempotency key makes the
//! repeat a no-op downstream. So: at-least-once calls, at most one effect per
//! key downstream, and no booking lost; the price is the grace period before
//! a lost call is repaired, and a downstream that must dedupe by key (one
//! that cannot is not made safe by this). The alternative (call again on
//! every `Duplicate`) would repair at once but send a request per
//! redelivery.
//!
//! [`StubCarrier`] and [`StubNotifier`] keep an in-process ledger keyed by
//! idempotency key, counting calls, for tests in one process;
//! `parcel-inbox consume` uses [`crate::parcel::dispatch::LedgerCarrier`] and
//! [`crate::parcel::dispatch::LedgerNotifier`], whose ledger is a table shared by
//! every process and surviving `kill -9`, so a run proves that no parcel was
//! booked (or notified) twice and none was left out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;

use crate::parcel::effects::{CarrierAssignment, Notification};
use inbox_runtime::AppError;

/// The non-transactional downstreams the consumers call after commit.
#[derive(Clone)]
pub struct Downstreams {
    /// The carrier's booking API.
    pub carrier: Arc<dyn CarrierApi>,
    /// The notification channel.
    pub notifier: Arc<dyn NotificationSender>,
}

/// A carrier's booking API.
pub trait CarrierApi: Send + Sync + 'static {
    /// Books the assignment's slot; `idempotency_key` identifies the booking
    /// across retries (the message id).
    fn book<'a>(
        &'a self,
        idempotency_key: &'a str,
        assignment: &'a CarrierAssignment,
    ) -> BoxFuture<'a, Result<(), AppError>>;
}

/// A notification channel (e-mail, SMS, push).
pub trait NotificationSender: Send + Sync + 'static {
    /// Sends the notification; `idempotency_key` identifies it across
    /// retries (the message id).
    fn send<'a>(
        &'a self,
        idempotency_key: &'a str,
        notification: &'a Notification,
    ) -> BoxFuture<'a, Result<(), AppError>>;
}

/// One idempotency key as a stub downstream saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerEntry {
    /// The parcel the first call was for.
    pub parcel_id: String,
    /// How many calls carried this key (1 unless someone retried).
    pub calls: u64,
}

/// A ledger of calls, keyed by idempotency key.
#[derive(Debug, Default)]
pub struct Ledger {
    entries: Mutex<HashMap<String, LedgerEntry>>,
}

impl Ledger {
    /// Records one call; returns `true` when the key is new (a real booking
    /// or sending), `false` when the downstream deduplicated it.
    pub fn record(&self, key: &str, parcel_id: &str) -> bool {
        let mut entries = self
            .entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match entries.get_mut(key) {
            Some(entry) => {
                entry.calls += 1;
                false
            }
            None => {
                entries.insert(
                    key.to_owned(),
                    LedgerEntry {
                        parcel_id: parcel_id.to_owned(),
                        calls: 1,
                    },
                );
                true
            }
        }
    }

    /// A copy of every entry.
    pub fn entries(&self) -> HashMap<String, LedgerEntry> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Distinct idempotency keys: the bookings (or sendings) that happened.
    pub fn distinct_keys(&self) -> usize {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    /// Calls in total, repeats included.
    pub fn calls(&self) -> u64 {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .map(|e| e.calls)
            .sum()
    }

    /// Parcels that more than one key was booked for: a double effect that
    /// idempotency keys could not catch (two different messages about one
    /// parcel). Sorted.
    pub fn parcels_booked_more_than_once(&self) -> Vec<String> {
        let mut per_parcel: HashMap<String, u64> = HashMap::new();
        for entry in self.entries().into_values() {
            *per_parcel.entry(entry.parcel_id).or_default() += 1;
        }
        let mut twice: Vec<String> = per_parcel
            .into_iter()
            .filter(|(_, n)| *n > 1)
            .map(|(p, _)| p)
            .collect();
        twice.sort();
        twice
    }

    /// Distinct parcels in the ledger.
    pub fn distinct_parcels(&self) -> usize {
        let entries = self.entries();
        let mut parcels: Vec<&str> = entries.values().map(|e| e.parcel_id.as_str()).collect();
        parcels.sort_unstable();
        parcels.dedup();
        parcels.len()
    }
}

/// A carrier API that books nothing, but remembers every call.
#[derive(Debug, Default)]
pub struct StubCarrier {
    /// Every booking, keyed by idempotency key.
    pub ledger: Ledger,
}

impl CarrierApi for StubCarrier {
    fn book<'a>(
        &'a self,
        idempotency_key: &'a str,
        assignment: &'a CarrierAssignment,
    ) -> BoxFuture<'a, Result<(), AppError>> {
        Box::pin(async move {
            if !self.ledger.record(idempotency_key, &assignment.parcel_id) {
                tracing::info!(idempotency_key, parcel_id = %assignment.parcel_id,
                    "stub carrier: repeated booking request deduplicated");
            }
            Ok(())
        })
    }
}

/// A notification sender that sends nothing, but remembers every call.
#[derive(Debug, Default)]
pub struct StubNotifier {
    /// Every notification, keyed by idempotency key.
    pub ledger: Ledger,
}

impl NotificationSender for StubNotifier {
    fn send<'a>(
        &'a self,
        idempotency_key: &'a str,
        notification: &'a Notification,
    ) -> BoxFuture<'a, Result<(), AppError>> {
        Box::pin(async move {
            if !self.ledger.record(idempotency_key, &notification.parcel_id) {
                tracing::info!(idempotency_key, parcel_id = %notification.parcel_id,
                    "stub notifier: repeated notification deduplicated");
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ledger_counts_calls_and_keys_apart() {
        let ledger = Ledger::default();
        assert!(ledger.record("m1", "P-1"));
        assert!(!ledger.record("m1", "P-1"));
        assert!(ledger.record("m2", "P-2"));
        assert_eq!(ledger.distinct_keys(), 2);
        assert_eq!(ledger.calls(), 3);
        assert!(ledger.parcels_booked_more_than_once().is_empty());
        assert!(ledger.record("m3", "P-2"));
        assert_eq!(
            ledger.parcels_booked_more_than_once(),
            vec!["P-2".to_owned()]
        );
        assert_eq!(ledger.distinct_parcels(), 2);
    }
}
