//! Keeping a long handling from being redelivered mid-way: JetStream
//! redelivers a message not acked within the consumer's `ack_wait`, to
//! this consumer or another, while the first handling still runs. The
//! inbox would answer the second copy `Duplicate` once the first commits,
//! but until then the two run side by side (the second waits on the
//! first's claim, or times out and is retried).
//!
//! So the subscription records every delivery it hands out
//! ([`InProgress::received`]) until its settlement ([`InProgress::settled`]),
//! and [`InProgress::tick_loop`] sends `+WPI` ("work in progress", which
//! restarts the server's `ack_wait` timer) for those held longer than half
//! the `ack_wait`, checking four times per `ack_wait`: a delivery is
//! touched again at most three quarters of the way through. `ack_wait`
//! stays above the worker's bound on one delivery anyway (see
//! [`super::ack_wait_for`]); this covers what that bound cannot (a slow
//! batch, deliveries waiting their turn behind others).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_nats::Subject;
use async_nats::jetstream::AckKind;
use tokio::sync::watch;
use tokio::time::Instant;

/// The unsettled deliveries of one subscription, by ack subject, with
/// when each was last received or touched.
#[derive(Debug)]
pub(crate) struct InProgress {
    held: Mutex<HashMap<String, (Subject, Instant)>>,
    ack_wait: Duration,
}

impl InProgress {
    /// A tracker for a consumer with `ack_wait`.
    pub(crate) fn new(ack_wait: Duration) -> Self {
        Self {
            held: Mutex::default(),
            ack_wait,
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Subject, Instant)>> {
        // A panic while holding it leaves a plain map, still consistent.
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a delivery handed to the worker.
    pub(crate) fn received(&self, ack_subject: &Subject) {
        self.received_at(ack_subject, Instant::now());
    }

    fn received_at(&self, ack_subject: &Subject, at: Instant) {
        self.held()
            .insert(ack_subject.to_string(), (ack_subject.clone(), at));
    }

    /// Forgets a delivery once its settlement is decided.
    pub(crate) fn settled(&self, ack_subject: &Subject) {
        self.held().remove(ack_subject.as_str());
    }

    /// How many deliveries are held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.held().len()
    }

    /// The deliveries held at least half the `ack_wait` as of `now`,
    /// marked as touched now.
    pub(crate) fn due(&self, now: Instant) -> Vec<Subject> {
        let half = self.ack_wait / 2;
        let mut held = self.held();
        held.values_mut()
            .filter(|(_, touched)| now.saturating_duration_since(*touched) >= half)
            .map(|(subject, touched)| {
                *touched = now;
                subject.clone()
            })
            .collect()
    }

    /// Sends "in progress" for the deliveries due, four times per
    /// `ack_wait`, until `stop`.
    pub(crate) async fn tick_loop(
        &self,
        client: async_nats::Client,
        mut stop: watch::Receiver<bool>,
    ) {
        let period = (self.ack_wait / 4).max(Duration::from_millis(50));
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = stop.wait_for(|stop| *stop) => return,
                _ = ticks.tick() => {}
            }
            for subject in self.due(Instant::now()) {
                if let Err(error) = client.publish(subject, AckKind::Progress.into()).await {
                    // The connection is away: the server redelivers after
                    // `ack_wait`, and the inbox sorts the copies out.
                    tracing::debug!(error = %error, "in-progress signal failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_deliveries_held_half_the_ack_wait_are_due() {
        let progress = InProgress::new(Duration::from_secs(10));
        let (a, b): (Subject, Subject) = ("$JS.ACK.a".into(), "$JS.ACK.b".into());
        let start = Instant::now();
        let at = |secs| start + Duration::from_secs(secs);
        progress.received_at(&a, start);
        progress.received_at(&b, at(4));
        assert_eq!(progress.due(at(5)), vec![a.clone()]);
        // Touched: not due again until another half has passed.
        assert!(progress.due(at(6)).is_empty());
        assert_eq!(progress.due(at(10)).len(), 2);
        progress.settled(&a);
        progress.settled(&b);
        assert_eq!(progress.len(), 0);
    }
}
