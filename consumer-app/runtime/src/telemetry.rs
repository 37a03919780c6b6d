//! The runtime's own metric names, and the liveness flag a loop holds.
//!
//! The metric names are those of [`inbox_api::metrics`] (processed,
//! duplicates discarded, failed, handle latency, purged rows, dead-lettered,
//! inbox rows) plus the runtime's two of its own, whose names a service picks
//! ([`MetricNames`]): an existing dashboard keeps its names when the runtime
//! moves under it. The HTTP side (`/metrics`, `/live`, `/ready`) is the
//! `http` feature's.

use tokio::sync::watch;

/// The names of the runtime's own counters (both labelled `consumer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetricNames {
    /// Deliveries requeued after their in-process retries failed.
    pub requeued: &'static str,
    /// After-commit calls that failed (the commit stands).
    pub after_commit_failed: &'static str,
    /// The help text of `after_commit_failed`, naming the service's calls.
    pub after_commit_failed_help: &'static str,
}

impl Default for MetricNames {
    fn default() -> Self {
        Self {
            requeued: "inbox_consumer_requeued_total",
            after_commit_failed: "inbox_consumer_after_commit_failed_total",
            after_commit_failed_help: "Downstream calls that failed after commit",
        }
    }
}

/// Reads true while the task holding its [`RunningGuard`] has not ended
/// (returned, failed or panicked: the guard is dropped either way).
#[derive(Clone, Debug)]
pub struct Running(watch::Receiver<()>);

/// Held by the task [`Running`] watches; dropping it ends "running".
#[derive(Debug)]
pub struct RunningGuard(#[expect(dead_code, reason = "held for its drop")] watch::Sender<()>);

impl Running {
    /// A guard for the task and the flag that watches it.
    pub fn new() -> (RunningGuard, Self) {
        let (guard, running) = watch::channel(());
        (RunningGuard(guard), Self(running))
    }

    /// Whether the guard still exists.
    pub fn is_running(&self) -> bool {
        self.0.has_changed().is_ok()
    }

    /// Resolves when the task has ended (its guard dropped): for a host
    /// that must not go on serving after a task it depends on has failed.
    pub async fn ended(mut self) {
        while self.0.changed().await.is_ok() {}
    }
}
