//! The store circuit: an outage of the store pauses the consumers, not the
//! messages.
//!
//! ```text
//!            N store-unavailable failures in a row
//! available ───────────────────────────────────────► unavailable
//!  (gauge 1)                                          (gauge 0): consumers cancelled, buffered and
//!      ▲                                                in-flight deliveries handed back uncharged
//!      └──────────── a probe of the store succeeds ◄── probes with backoff
//! ```
//!
//! Why: while PostgreSQL restarts or fails over, or while a deploy's
//! migrations lag, every delivery fails the same way. Retrying them spends
//! each message's in-process attempts and delivery budget on something that
//! is not its fault, and an outage longer than that budget (minutes, with
//! the defaults) would walk every message into the dead-letter queue. So a
//! failure of the store itself ([`AppError::is_store_unavailable`]) is
//! never charged to the message: it is released (`basic.nack` with
//! requeue), and after [`AvailabilityConfig::threshold`] of them in a row
//! the circuit opens. Each consumer then cancels its subscription (the
//! broker keeps the messages), hands back what the broker had already sent,
//! and waits; one probe task checks the store with backoff (`check_store`:
//! a claim and every handler's own [`crate::Handler::check`] in a
//! transaction that is rolled back, so the schema and the role's privileges
//! are checked too) and closes the circuit when it passes; the consumers
//! subscribe again.
//!
//! Each transition logs exactly one line (WARN "store unavailable,
//! consumption paused" with the cause, INFO "store available again,
//! consumption resumed" with the outage's length), sets the
//! `inbox_store_available` gauge (1/0) and, on opening, counts one
//! `inbox_store_outages_total`. [`crate::ServiceHandle::store_available`]
//! and [`crate::ServiceHandle::store_availability`] expose the
//! state, e.g. for a readiness endpoint.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::future::BoxFuture;
use inbox_api::metrics as names;
use inbox_api::{
    BatchTransaction, ConsumerName, InboxKey, InboxStore, InboxTransaction, MessageId,
};
use tokio::sync::watch;

use crate::AppError;
use crate::backoff::Backoff;
use crate::config::AvailabilityConfig;
use crate::error::chain;
use crate::shutdown::stopped;

/// The consumer name of the probe's claim: never a real consumer's, and
/// the claim is rolled back anyway.
const PROBE_CONSUMER: &str = "inbox-availability-probe";

/// What a consumer needs of the store beyond the inbox, checked inside the
/// store check's transaction: its handler's
/// [`crate::Handler::check`], with the handler's type erased.
pub(crate) trait StoreCheck<Tx>: Send + Sync {
    /// Runs the check in `tx`.
    fn check<'a>(&'a self, tx: &'a mut Tx) -> BoxFuture<'a, Result<(), AppError>>;
}

/// The checks of a service's consumers.
pub(crate) type StoreChecks<Tx> = Arc<[Arc<dyn StoreCheck<Tx>>]>;

/// Checks that `store` can serve the consumers now: a transaction opens, a
/// claim (the inbox's first write) succeeds, for batched mode a savepoint
/// too, and each of `checks` (the handlers' own tables) passes; then
/// everything is rolled back. A missing or unmigrated schema, a role
/// without privileges or a store that cannot be reached fail here as they
/// would fail every message.
///
/// # Errors
/// The store's error ([`AppError::is_store_unavailable`] tells an outage or
/// an unusable schema); [`AppError::Config`] when `batched` and the store
/// has no savepoints.
pub(crate) async fn check_store<S>(
    store: &S,
    batched: bool,
    checks: &[Arc<dyn StoreCheck<S::Transaction>>],
) -> Result<(), AppError>
where
    S: InboxStore<Transaction: BatchTransaction>,
{
    let key = InboxKey::new(MessageId::new_v7(), ConsumerName::new(PROBE_CONSUMER)?);
    let mut tx = store.begin().await?;
    let checked = async {
        let _fresh_or_duplicate = tx.claim(&key).await?;
        if batched {
            tx.savepoint().await.map_err(|error| {
                if error.is_retryable() {
                    AppError::from(error)
                } else {
                    AppError::Config(format!(
                        "batched mode (--batch-size) needs savepoints, which this store refused: {}",
                        chain(&error)
                    ))
                }
            })?;
        }
        for check in checks {
            check.check(&mut tx).await?;
        }
        Ok(())
    }
    .await;
    if let Err(error) = tx.rollback().await {
        tracing::debug!(error = %error, "rollback after the store check failed");
    }
    checked
}

/// The shared state of the store circuit; see the module docs.
#[derive(Debug)]
pub(crate) struct StoreCircuit {
    config: AvailabilityConfig,
    /// Store-unavailable failures since the last success.
    consecutive: AtomicU32,
    /// Whether a delivery succeeded since the circuit last closed: if it
    /// opens again before one did, probing goes on from its last backoff,
    /// one step longer, instead of hammering a store that only half came
    /// back.
    succeeded: AtomicBool,
    available: watch::Sender<bool>,
    /// When the current outage began.
    since: Mutex<Option<Instant>>,
}

impl StoreCircuit {
    pub(crate) fn new(config: AvailabilityConfig) -> Self {
        Self {
            config,
            consecutive: AtomicU32::new(0),
            succeeded: AtomicBool::new(true),
            available: watch::Sender::new(true),
            since: Mutex::new(None),
        }
    }

    /// `true` while the store is taken to be available.
    pub(crate) fn subscribe(&self) -> watch::Receiver<bool> {
        self.available.subscribe()
    }

    /// Whether the circuit is open (consumption paused).
    pub(crate) fn is_open(&self) -> bool {
        !*self.available.borrow()
    }

    /// Publishes the gauge's current value (at start).
    pub(crate) fn report(&self) {
        metrics::gauge!(names::STORE_AVAILABLE).set(if self.is_open() { 0.0 } else { 1.0 });
    }

    /// An attempt reached the store and succeeded.
    pub(crate) fn success(&self) {
        self.consecutive.store(0, Ordering::Relaxed);
        self.succeeded.store(true, Ordering::Relaxed);
    }

    /// An attempt failed because the store is away; opens the circuit at
    /// the threshold.
    pub(crate) fn failure(&self, cause: &AppError) {
        let n = self.consecutive.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= self.config.threshold.max(1) {
            self.open(cause);
        }
    }

    /// Opens the circuit (once per outage: only the caller that flips it
    /// logs and counts).
    pub(crate) fn open(&self, cause: &AppError) {
        // The gauge and the outage's start are set under the watch's lock,
        // before any receiver can see the change: whoever reads the state
        // reads the gauge that goes with it.
        let opened = self.available.send_if_modified(|available| {
            if !*available {
                return false;
            }
            *available = false;
            *self.lock_since() = Some(Instant::now());
            metrics::gauge!(names::STORE_AVAILABLE).set(0.0);
            true
        });
        if !opened {
            return;
        }
        metrics::counter!(names::STORE_OUTAGES).increment(1);
        tracing::warn!(cause = %chain(cause), "store unavailable, consumption paused");
    }

    /// Closes the circuit after a successful probe.
    fn close(&self) {
        self.consecutive.store(0, Ordering::Relaxed);
        self.succeeded.store(false, Ordering::Relaxed);
        let mut outage = None;
        let closed = self.available.send_if_modified(|available| {
            if *available {
                return false;
            }
            *available = true;
            outage = self.lock_since().take().map(|since| since.elapsed());
            metrics::gauge!(names::STORE_AVAILABLE).set(1.0);
            true
        });
        if !closed {
            return;
        }
        tracing::info!(outage = ?outage.unwrap_or_default(),
            "store available again, consumption resumed");
    }

    fn lock_since(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Probes `store` whenever the circuit is open, with backoff, and
    /// closes it when the store answers; returns at shutdown.
    pub(crate) async fn probe_loop<S>(
        &self,
        store: S,
        batched: bool,
        checks: StoreChecks<S::Transaction>,
        mut shutdown: watch::Receiver<bool>,
    ) where
        S: InboxStore<Transaction: BatchTransaction>,
    {
        let mut available = self.subscribe();
        let mut failed_probes = 0_u32;
        loop {
            tokio::select! {
                () = stopped(&mut shutdown) => return,
                opened = available.wait_for(|a| !*a) => if opened.is_err() { return },
            }
            if self.succeeded.load(Ordering::Relaxed) {
                failed_probes = 0;
            } else {
                // Reopened before a single delivery succeeded: the store
                // answers the probe but still fails the messages (a table
                // only the handlers use is missing, say). Count the resume
                // as a failed probe, so that such flapping slows down to
                // one try per `max_probe_delay` instead of spinning.
                failed_probes = failed_probes.saturating_add(1);
            }
            loop {
                let delay = Backoff::new(self.config.probe_delay, self.config.max_probe_delay)
                    .delay(failed_probes);
                tokio::select! {
                    () = stopped(&mut shutdown) => return,
                    () = tokio::time::sleep(delay) => {}
                }
                match check_store(&store, batched, &checks).await {
                    Ok(()) => {
                        self.close();
                        break;
                    }
                    Err(error) => {
                        failed_probes = failed_probes.saturating_add(1);
                        tracing::debug!(error = %chain(&error), ?delay, "store probe failed");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use inbox_api::InboxError;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;

    fn outage() -> AppError {
        InboxError::Connection {
            source: Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
        }
        .into()
    }

    /// The gauge and the outages counted since the last look (a
    /// snapshot drains the counters).
    fn look(snapshotter: &metrics_util::debugging::Snapshotter) -> (Option<f64>, u64) {
        let mut gauge = None;
        let mut outages = 0;
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            match value {
                DebugValue::Gauge(v) if key.key().name() == names::STORE_AVAILABLE => {
                    gauge = Some(v.into_inner());
                }
                DebugValue::Counter(n) if key.key().name() == names::STORE_OUTAGES => outages += n,
                _ => {}
            }
        }
        (gauge, outages)
    }

    #[test]
    fn opens_at_the_threshold_in_a_row_and_flips_the_gauge_once_each_way() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let circuit = StoreCircuit::new(AvailabilityConfig::default());
        metrics::with_local_recorder(&recorder, || {
            circuit.report();
            circuit.failure(&outage());
            circuit.failure(&outage());
            // A success between failures: not "in a row".
            circuit.success();
            circuit.failure(&outage());
            circuit.failure(&outage());
            assert!(!circuit.is_open());
        });
        assert_eq!(look(&snapshotter), (Some(1.0), 0));
        metrics::with_local_recorder(&recorder, || {
            circuit.failure(&outage());
            assert!(circuit.is_open());
            // More failures and a second opener change nothing.
            circuit.failure(&outage());
            circuit.open(&outage());
        });
        assert_eq!(
            look(&snapshotter),
            (Some(0.0), 1),
            "one outage, counted once"
        );
        assert!(!*circuit.subscribe().borrow());
        metrics::with_local_recorder(&recorder, || {
            circuit.close();
            circuit.close();
        });
        assert!(!circuit.is_open());
        assert_eq!(look(&snapshotter), (Some(1.0), 0));
        assert!(*circuit.subscribe().borrow());
    }
}
