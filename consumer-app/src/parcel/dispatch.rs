//! After-commit dispatch made complete: intent rows are marked dispatched
//! once their downstream call succeeded, and a reconciler re-sends the
//! committed ones that never were (see the trade-off in
//! [`crate::parcel::downstream`]).
//!
//! ```text
//! inbox tx: claim, INSERT intent (dispatched_at NULL), COMMIT
//!   └► call downstream (idempotency key = message id) ─ok─► UPDATE dispatched_at = now()
//! reconciler (on start, then every interval, in each `consume` process):
//!   SELECT intents WHERE dispatched_at IS NULL AND created_at < now() - min_age
//!   └► call downstream again (it dedupes by key) ─ok─► UPDATE dispatched_at
//! ```
//!
//! A process killed between COMMIT and the call leaves an undispatched row;
//! some process's reconciler sends it after `min_age`. A call that happened
//! but whose `UPDATE` did not (killed in between, or a reconciler racing the
//! message path) is sent again: the downstream's idempotency key turns that
//! into a counted no-op. The result is at-least-once calls, exactly-once
//! effects downstream.
//!
//! [`LedgerCarrier`] and [`LedgerNotifier`] are stub downstreams that keep
//! such a deduplicating ledger durably in the `stub_ledger` table (written
//! through the pool, outside any inbox transaction), so that several
//! processes share it and it survives `kill -9`: what the chaos harness
//! counts bookings from.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::watch;

use crate::parcel::downstream::{CarrierApi, Downstreams, NotificationSender};
use crate::parcel::effects::{CarrierAssignment, Intent, Notification};
use crate::parcel::role::Role;
use crate::parcel::store::ParcelStore;
use inbox_runtime::AppError;
use inbox_runtime::error::chain;

/// The `downstream` column of the stub carrier's ledger rows.
pub const CARRIER_LEDGER: &str = "carrier";
/// The `downstream` column of the stub notifier's ledger rows.
pub const NOTIFIER_LEDGER: &str = "notifier";

/// The reconciler's settings.
#[derive(Clone, Debug)]
pub struct ReconcileConfig {
    /// How often it runs (it also runs once at start).
    pub interval: Duration,
    /// Only intents committed longer ago than this are re-sent (so that the
    /// message path's own call normally wins).
    pub min_age: Duration,
    /// Intents per round.
    pub batch: u32,
}

impl Default for ReconcileConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            min_age: Duration::from_secs(5),
            batch: 500,
        }
    }
}

/// A downstream wrapped so that a successful call marks its intent
/// dispatched.
pub struct MarkDispatched<S> {
    store: S,
    inner: Downstreams,
}

impl<S: ParcelStore> MarkDispatched<S> {
    /// Wraps `inner`; returns downstreams to hand to the service (and the
    /// reconciler).
    pub fn wrap(store: S, inner: Downstreams) -> Downstreams {
        let wrapped = Arc::new(Self { store, inner });
        Downstreams {
            carrier: wrapped.clone(),
            notifier: wrapped,
        }
    }
}

impl<S: ParcelStore> CarrierApi for MarkDispatched<S> {
    fn book<'a>(
        &'a self,
        idempotency_key: &'a str,
        assignment: &'a CarrierAssignment,
    ) -> BoxFuture<'a, Result<(), AppError>> {
        Box::pin(async move {
            self.inner.carrier.book(idempotency_key, assignment).await?;
            self.store
                .mark_dispatched(Role::Carrier, &assignment.message_id)
                .await
        })
    }
}

impl<S: ParcelStore> NotificationSender for MarkDispatched<S> {
    fn send<'a>(
        &'a self,
        idempotency_key: &'a str,
        notification: &'a Notification,
    ) -> BoxFuture<'a, Result<(), AppError>> {
        Box::pin(async move {
            self.inner
                .notifier
                .send(idempotency_key, notification)
                .await?;
            self.store
                .mark_dispatched(Role::Notification, &notification.message_id)
                .await
        })
    }
}

/// A stub carrier whose deduplicating ledger is the `stub_ledger` table.
pub struct LedgerCarrier<S> {
    store: S,
}

impl<S> LedgerCarrier<S> {
    /// A stub carrier recording into `store`'s ledger.
    pub fn new(store: S) -> Self {
        Self { store }
    }
}

impl<S: ParcelStore> CarrierApi for LedgerCarrier<S> {
    fn book<'a>(
        &'a self,
        idempotency_key: &'a str,
        assignment: &'a CarrierAssignment,
    ) -> BoxFuture<'a, Result<(), AppError>> {
        Box::pin(async move {
            let calls = self
                .store
                .record_stub_call(CARRIER_LEDGER, idempotency_key, &assignment.parcel_id)
                .await?;
            if calls > 1 {
                tracing::info!(idempotency_key, parcel_id = %assignment.parcel_id, calls,
                    "stub carrier: repeated booking request deduplicated");
            }
            Ok(())
        })
    }
}

/// A stub notifier whose deduplicating ledger is the `stub_ledger` table.
pub struct LedgerNotifier<S> {
    store: S,
}

impl<S> LedgerNotifier<S> {
    /// A stub notifier recording into `store`'s ledger.
    pub fn new(store: S) -> Self {
        Self { store }
    }
}

impl<S: ParcelStore> NotificationSender for LedgerNotifier<S> {
    fn send<'a>(
        &'a self,
        idempotency_key: &'a str,
        notification: &'a Notification,
    ) -> BoxFuture<'a, Result<(), AppError>> {
        Box::pin(async move {
            let calls = self
                .store
                .record_stub_call(NOTIFIER_LEDGER, idempotency_key, &notification.parcel_id)
                .await?;
            if calls > 1 {
                tracing::info!(idempotency_key, parcel_id = %notification.parcel_id, calls,
                    "stub notifier: repeated notification deduplicated");
            }
            Ok(())
        })
    }
}

/// One reconciler round: re-sends up to `config.batch` committed intents
/// older than `config.min_age` that are not dispatched, through
/// `downstreams` (which should mark them, see [`MarkDispatched`]). Returns
/// how many were re-sent successfully.
///
/// # Errors
/// The store's error reading the intents; a failed re-send only logs (the
/// next round tries again).
pub async fn reconcile_once<S: ParcelStore>(
    store: &S,
    downstreams: &Downstreams,
    config: &ReconcileConfig,
) -> Result<usize, AppError> {
    let pending = store.undispatched(config.min_age, config.batch).await?;
    let mut sent = 0;
    for intent in pending {
        let result = match &intent {
            Intent::Notification(n) => {
                downstreams
                    .notifier
                    .send(&n.message_id.to_string(), n)
                    .await
            }
            Intent::Carrier(a) => downstreams.carrier.book(&a.message_id.to_string(), a).await,
        };
        match result {
            Ok(()) => {
                sent += 1;
                tracing::info!(
                    ?intent,
                    "reconciler: re-sent a committed, undispatched intent"
                );
            }
            Err(error) => {
                tracing::warn!(?intent, error = %chain(&error), "reconciler: re-send failed; next round retries");
            }
        }
    }
    Ok(sent)
}

/// Runs [`reconcile_once`] at start and then every `config.interval`
/// until `shutdown` turns true.
pub async fn reconcile_loop<S: ParcelStore>(
    store: S,
    downstreams: Downstreams,
    config: ReconcileConfig,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        match reconcile_once(&store, &downstreams, &config).await {
            Ok(0) => {}
            Ok(sent) => tracing::warn!(
                sent,
                "reconciler re-sent intents a process had committed but not dispatched"
            ),
            Err(error) => tracing::warn!(error = %chain(&error), "reconciler round failed"),
        }
        tokio::select! {
            () = tokio::time::sleep(config.interval) => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
    }
}
