//! Settling a published batch: each message's result charged, counted and
//! marked; and the outcomes of the batches in flight gathered for the
//! relay's loop.

use std::sync::Arc;

use inbox_api::metrics as names;
use inbox_api::{MessageId, OutboxLease, OutboxStore, PublishRetry};
use tokio::task::JoinSet;

use super::outlet::PublishFailure;
use super::tally::RelayTally;
use crate::AppError;
use crate::error::chain;

/// What settles a batch once its publishes are out: awaits the confirms,
/// charges the refusals, marks the confirmed. It runs on a task of its own
/// per batch, beside the relay's loop.
pub(crate) struct Settler<S> {
    pub(crate) store: S,
    pub(crate) tally: Arc<RelayTally>,
    pub(crate) retry: PublishRetry,
}

impl<S: OutboxStore> Settler<S> {
    /// Settles `lease`, whose publishes ended as `results` (one per
    /// message, in order): its refused messages are charged, its confirmed
    /// ones marked published (and only those: a message is marked only
    /// after its own confirm), the rest stay leased.
    pub(crate) async fn settle(
        self,
        lease: &OutboxLease,
        results: Vec<Result<(), PublishFailure>>,
    ) -> Result<Round, AppError> {
        let mut confirmed = Vec::with_capacity(results.len());
        let mut failed: Vec<(MessageId, PublishFailure)> = Vec::new();
        for (message, result) in lease.messages.iter().zip(results) {
            match result {
                Ok(()) => confirmed.push(message.id()),
                Err(failure) => failed.push((message.id(), failure)),
            }
        }
        let refusals: Vec<(MessageId, String)> = failed
            .iter()
            .filter(|(_, f)| f.is_refusal())
            .map(|(id, f)| (*id, f.to_string()))
            .collect();
        let round = Round {
            confirmed: confirmed.len(),
            failed: failed.len(),
            refused: refusals.len(),
            channel_broken: failed.iter().any(|(_, f)| f.breaks_channel()),
        };
        self.count_failures(&failed, &lease.id);
        self.charge(&lease.id, &refusals).await;
        if confirmed.is_empty() {
            return Ok(round);
        }
        metrics::counter!(names::OUTBOX_PUBLISHED).increment(confirmed.len() as u64);
        self.tally
            .published
            .fetch_add(confirmed.len() as u64, std::sync::atomic::Ordering::Relaxed);
        match self.store.mark_published(&confirmed).await {
            Ok(marked) => {
                self.tally
                    .marked
                    .fetch_add(marked, std::sync::atomic::Ordering::Relaxed);
                Ok(round)
            }
            Err(error) => {
                // Published but not marked: they go out once more, under
                // their ids, when the lease runs out. Harmless downstream.
                tracing::warn!(lease = %lease.id, ids = ?ids(confirmed.iter()),
                    error = %chain(&error),
                    "marking confirmed messages published failed; they will be published again");
                Err(error.into())
            }
        }
    }

    fn count_failures(&self, failed: &[(MessageId, PublishFailure)], lease: &inbox_api::LeaseId) {
        if failed.is_empty() {
            return;
        }
        self.tally
            .failed
            .fetch_add(failed.len() as u64, std::sync::atomic::Ordering::Relaxed);
        for reason in ["nack", "returned", "channel", "timeout"] {
            let of_reason: Vec<&(MessageId, PublishFailure)> = failed
                .iter()
                .filter(|(_, f)| f.reason() == reason)
                .collect();
            let Some((_, first)) = of_reason.first() else {
                continue;
            };
            metrics::counter!(names::OUTBOX_PUBLISH_FAILURES, "reason" => reason)
                .increment(of_reason.len() as u64);
            tracing::warn!(%lease, reason, count = of_reason.len(),
                ids = ?ids(of_reason.iter().map(|(id, _)| id)), error = %first,
                "the broker did not confirm these messages; they stay pending and are published again, under their ids, after their backoff (refused) or lease (outage)");
        }
    }

    /// Charges the broker's refusals to their messages: each backs off on
    /// its own, and those at the limit are dead (counted and logged by id).
    /// A failure to record leaves them leased, uncharged: the lease is then
    /// their retry delay, as for an outage.
    async fn charge(&self, lease: &inbox_api::LeaseId, refusals: &[(MessageId, String)]) {
        if refusals.is_empty() {
            return;
        }
        match self
            .store
            .record_refusals(lease, refusals, &self.retry)
            .await
        {
            Ok(refused) => {
                self.tally
                    .refused
                    .fetch_add(refused.recorded, std::sync::atomic::Ordering::Relaxed);
                if refused.dead.is_empty() {
                    return;
                }
                metrics::counter!(names::OUTBOX_DEAD_LETTERED).increment(refused.dead.len() as u64);
                self.tally.dead.fetch_add(
                    refused.dead.len() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
                for id in &refused.dead {
                    let error = refusals
                        .iter()
                        .find(|(refused, _)| refused == id)
                        .map_or("", |(_, error)| error.as_str());
                    tracing::error!(message_id = %id, %lease, error,
                        max_attempts = self.retry.max_attempts.get(),
                        "the broker refused this outgoing message too often: dead in the outbox \
                         (list with `parcel-inbox outbox-dead`, requeue with `outbox-requeue`)");
                }
            }
            Err(error) => {
                tracing::warn!(%lease, ids = ?ids(refusals.iter().map(|(id, _)| id)),
                    error = %chain(&error),
                    "recording refusals failed; the messages come back when their lease runs out");
            }
        }
    }
}

/// What the broker did with one batch.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Round {
    pub(crate) confirmed: usize,
    pub(crate) failed: usize,
    /// Of `failed`, those the broker refused for their own sake.
    pub(crate) refused: usize,
    /// Its channel failed (closed, or confirms stuck): its task closed
    /// it, and the relay settles every batch before the next round.
    pub(crate) channel_broken: bool,
}

/// One batch's task's outcome.
pub(crate) struct Settling<L> {
    /// What the broker did with it, or its take's or mark's error.
    pub(crate) outcome: Result<Round, AppError>,
    /// Its lane, unless it failed (closed) and must not be reused.
    pub(crate) lane: Option<L>,
}

/// What the batches settled since the relay last looked did, together.
pub(crate) struct Settled<L> {
    /// Their counts, summed.
    pub(crate) round: Round,
    /// Some batch's broker took none of it, and not for the messages' own
    /// sake: back off.
    pub(crate) stalled: bool,
    /// The first error (a failed take or mark, a panicked task).
    pub(crate) error: Option<AppError>,
    /// The lanes of the settled batches, to use again.
    pub(crate) lanes: Vec<L>,
}

impl<L> Default for Settled<L> {
    fn default() -> Self {
        Self {
            round: Round::default(),
            stalled: false,
            error: None,
            lanes: Vec::new(),
        }
    }
}

impl<L: Send + 'static> Settled<L> {
    /// Adds one batch's outcome.
    fn add(&mut self, done: Result<Settling<L>, tokio::task::JoinError>) {
        let done = done.map(|settling| {
            self.lanes.extend(settling.lane);
            settling.outcome
        });
        match done {
            Ok(Ok(round)) => {
                self.stalled |= round.confirmed == 0 && round.failed > round.refused;
                self.round.confirmed += round.confirmed;
                self.round.failed += round.failed;
                self.round.refused += round.refused;
                self.round.channel_broken |= round.channel_broken;
            }
            Ok(Err(error)) => self.fail(error),
            Err(error) => self.fail(AppError::Unavailable(format!(
                "a relay batch's task failed: {error}"
            ))),
        }
    }

    /// Keeps the first error, unless a later one is permanent (that one
    /// ends the relay).
    pub(crate) fn fail(&mut self, error: AppError) {
        let permanent = matches!(&error, AppError::Inbox(e) if !e.is_retryable());
        if self.error.is_none() || permanent {
            self.error = Some(error);
        }
    }

    pub(crate) fn merge(&mut self, other: Self) {
        self.stalled |= other.stalled;
        self.round.confirmed += other.round.confirmed;
        self.round.failed += other.round.failed;
        self.round.refused += other.round.refused;
        self.round.channel_broken |= other.round.channel_broken;
        self.lanes.extend(other.lanes);
        if let Some(error) = other.error {
            self.fail(error);
        }
    }

    /// Nothing that calls for a pause or a new channel.
    pub(crate) fn is_fine(&self) -> bool {
        self.error.is_none() && !self.stalled && !self.round.channel_broken
    }

    /// Adds the batches that finished already, without waiting.
    pub(crate) fn finished(&mut self, in_flight: &mut JoinSet<Settling<L>>) {
        while let Some(done) = in_flight.try_join_next() {
            self.add(done);
        }
    }

    /// Waits for the next batch to finish and adds it.
    pub(crate) async fn next(&mut self, in_flight: &mut JoinSet<Settling<L>>) {
        if let Some(done) = in_flight.join_next().await {
            self.add(done);
        }
    }

    /// Waits for every batch in flight.
    pub(crate) async fn all(in_flight: &mut JoinSet<Settling<L>>) -> Self {
        let mut settled = Self::default();
        while let Some(done) = in_flight.join_next().await {
            settled.add(done);
        }
        settled
    }
}

fn ids<'a>(ids: impl Iterator<Item = &'a MessageId>) -> Vec<String> {
    ids.map(ToString::to_string).collect()
}
