//! The message path: deliveries from decode to ack, one at a time or in
//! batches, through one settle loop.
//!
//! ```text
//! deliveries ─► decode (size, message_id, type, JSON, validate) ──bad──► dead-letter(reason)
//!   └► per message: Inbox::handle(key = (message_id, consumer), async |tx| handler.handle(cx(tx), message))
//!      batched:     Inbox::handle_batch(keys, async |tx, i| handler.handle(cx(tx), message[i]))   one COMMIT
//!        each message's outcome ─► (its own failure, retries spent: AttemptLedger::record_failure)
//!          ─► SettlePolicy::decide(outcome, attempt, broker and ledger counts)
//!          Ack        ─► after-commit call (if processed) ─► ack, coalesced with others into one
//!                         multiple-ack where the tags allow (see `ack`)
//!          Retry      ─► the next in-process attempt (a smaller batch), after backoff
//!                         (shutdown during the backoff: nack + requeue instead)
//!          Requeue    ─► the message failed: reject + requeue after a pause (cut short by shutdown);
//!                         not its fault: nack + requeue at once
//!          Release    ─► nack + requeue at once, uncharged (the store is away; the
//!                         store circuit counts it and pauses consumption)
//!          DeadLetter ─► publish with reason headers, then ack; the ledger marks it dead
//! ```
//!
//! **The poison count.** When a delivery fails for good (its handler failed
//! retryably or timed out in every in-process attempt), the failure is
//! recorded in the store's attempt ledger, outside the rolled-back
//! transaction, and the cap is checked against that count (the broker's
//! `x-delivery-count` only when the ledger could not be written); the delivery goes back with
//! `basic.reject(requeue)`, which every RabbitMQ version counts (4.3 stopped
//! counting `nack`). So the cap holds on classic queues and brokers that
//! count nothing. Hand-backs that are not the message's fault (an abandoned
//! attempt, shutdown) are `nack`s and are recorded nowhere.
//!
//! Per-message mode is batched mode with batches of one that use
//! [`Inbox::handle`] instead of [`Inbox::handle_batch`]: the decisions, the
//! counters and the log lines are the same code.
//!
//! **Ack only after commit.** A crash anywhere before the ack leaves the
//! delivery unacknowledged; the broker redelivers it, and the inbox answers
//! `Duplicate` if the transaction had committed, or runs the work if not. In
//! a batch, one failing message rolls back alone (its claim too) and the rest
//! commits (`handle_batch` reruns a failed batch with a savepoint per
//! message).
//!
//! **Dead-lettering with a reason.** RabbitMQ's own dead-lettering (a
//! `reject` without requeue) keeps the message and its headers but can only
//! say `rejected`. So the runtime publishes the message itself (through the
//! [`Settler`]; on RabbitMQ, the `ack` module's) to the
//! queue's dead-letter exchange, with the original properties and headers
//! plus `x-dead-letter-reason` (the stable label also used as the metric
//! label), `x-dead-letter-detail` (the error text), `x-dead-letter-consumer`
//! and `x-dead-letter-queue` (and, for a decoded message,
//! `x-inbox-attempts` and `x-inbox-last-error`: its failure count and last
//! error), without the broker's `x-delivery-count` (a replay starts a fresh
//! count), waits for the broker's confirm, and only then acks the original;
//! the ledger then marks the message dead, which `parcel-inbox dead` lists. If that publish fails, it falls back to `reject`
//! without requeue, which the queue's `x-dead-letter-exchange` routes to the
//! same dead-letter queue: the reason is lost then, never the message.
//!
//! **Bounded time.** Each attempt runs under `handle_timeout`. A timeout
//! drops the handle future, and with it the transaction, which rolls back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_api::metrics as names;
use inbox_api::{Fingerprint, Handled, Inbox, InboxKey, LastError, MessageId};
use tokio::sync::{OwnedSemaphorePermit, watch};
use tracing::{Instrument as _, Span};

use crate::availability::StoreCircuit;
use crate::backoff::jittered;
use crate::config::WorkerConfig;
use crate::context::Context;
use crate::decode::decode;
use crate::delivery::{DeadLetter, Delivery as _, Frame, Settler};
use crate::error::chain;
use crate::handler::Handler;
use crate::message::{RawMessage, truncate};
use crate::settle::{DeadLetterReason, Deliveries, ErrorDisposition, Outcome, Settle};
use crate::shutdown::stopped;
use crate::tally::{ConsumerTally, bump};
use crate::telemetry::MetricNames;
use crate::{AppError, ServiceStore};

/// What the message path does with one queue's deliveries.
pub(crate) struct Worker<S, H, T> {
    pub(crate) inbox: Arc<Inbox<S>>,
    pub(crate) handler: Arc<H>,
    /// Where the handler's events go (the topology's exchange).
    pub(crate) exchange: Arc<str>,
    pub(crate) queue: String,
    pub(crate) config: WorkerConfig,
    pub(crate) metric_names: MetricNames,
    pub(crate) tally: Arc<ConsumerTally>,
    /// What tells the broker: every settle goes through it.
    pub(crate) settler: Arc<T>,
    /// The service's store circuit, told of every attempt's outcome.
    pub(crate) circuit: Arc<StoreCircuit>,
}

impl<S, H, T> Clone for Worker<S, H, T> {
    fn clone(&self) -> Self {
        Self {
            inbox: Arc::clone(&self.inbox),
            handler: Arc::clone(&self.handler),
            exchange: Arc::clone(&self.exchange),
            queue: self.queue.clone(),
            config: self.config.clone(),
            metric_names: self.metric_names,
            tally: Arc::clone(&self.tally),
            settler: Arc::clone(&self.settler),
            circuit: Arc::clone(&self.circuit),
        }
    }
}

/// A decoded delivery.
struct Item<M, D> {
    delivery: D,
    message_id: MessageId,
    message: M,
    key: InboxKey,
    /// The broker's count of earlier deliveries.
    earlier: u64,
    /// The last retryable error, for the requeue log and the dead-letter
    /// detail.
    last_error: Option<String>,
}

/// What a dead-letter of a decoded message carries besides its reason: the
/// key the ledger marks dead, and the headers' count and last error.
struct Failure<'a> {
    key: &'a InboxKey,
    attempts: u64,
    last_error: LastError,
}

/// The result of one attempt, per message (by index into the items).
type Results<T> = Vec<(usize, Result<Handled<T>, AppError>)>;

impl<S, H, T> Worker<S, H, T>
where
    S: ServiceStore,
    H: Handler<S::Transaction>,
    T: Settler,
{
    fn consumer_label(&self) -> String {
        self.handler.name().as_str().to_owned()
    }

    /// Handles deliveries to their ends, each acked, requeued or
    /// dead-lettered: one per call in per-message mode, a batch in batched
    /// mode.
    ///
    /// The backoffs between attempts watch `shutdown`: a graceful stop waits
    /// for in-flight deliveries, and one waiting out a long backoff would
    /// hold the process for as long (SIGTERM ignored, then SIGKILL). On
    /// shutdown a pending requeue goes at once, and a pending retry is
    /// handed back to the broker instead (nack + requeue: not the message's
    /// fault, and the inbox makes the redelivery safe).
    ///
    /// `slot` is the worker's share of the consumer's concurrency. It is
    /// given back as soon as an attempt leaves nothing to do but ack: the
    /// slot bounds the work in progress (open transactions), not acks in
    /// flight, and the acks only join the channel's waiting acks (the
    /// tracker's flush sends them). The prefetch still bounds the unacked
    /// deliveries. Every other ending (requeue pauses,
    /// backoffs, dead-letter publishes) keeps the slot, to slow the
    /// consumer down while messages fail.
    pub(crate) async fn process(
        self,
        deliveries: Vec<T::Delivery>,
        mut shutdown: watch::Receiver<bool>,
        slot: OwnedSemaphorePermit,
    ) {
        let mut slot = Some(slot);
        // The delivery's `process` span: a dead letter names it, so that a
        // replay links back to this attempt.
        let process = Span::current();
        let batched = self.config.batch.is_some();
        let mut items = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            let raw = RawMessage::of(&delivery);
            let shown_id = raw.message_id.map(|id| truncate(id, 64));
            let decoded = decode(
                raw,
                self.config.max_body_bytes,
                self.handler.message_type(),
                self.handler.identity(),
                |message| self.handler.validate(message),
            );
            match decoded {
                Ok((message_id, message)) => {
                    // The body's fingerprint rides with the key: stored by
                    // the claim, compared when the id comes again.
                    let key = InboxKey::new(message_id, self.handler.name().clone())
                        .with_fingerprint(Fingerprint::of(delivery.body()));
                    let earlier = delivery.earlier_deliveries();
                    items.push(Item {
                        delivery,
                        message_id,
                        message,
                        key,
                        earlier,
                        last_error: None,
                    });
                }
                Err(bad) => {
                    // Bad input never opens a transaction.
                    self.dead_letter(
                        &delivery,
                        shown_id.as_deref(),
                        bad.reason.as_str(),
                        &bad.to_string(),
                        None,
                        &process,
                    )
                    .await;
                }
            }
        }
        let policy = self.config.policy();
        let attempts = policy.attempts();
        // Indices into `items` still to be handled.
        let mut open: Vec<usize> = (0..items.len()).collect();
        for attempt in 1..=attempts {
            if open.is_empty() {
                return;
            }
            let results = self.attempt(&items, &open, batched).await;
            if batched && results.iter().any(|(_, result)| result.is_ok()) {
                bump(&self.tally.batches);
            }
            self.tell_circuit(&results);
            let mut acks = Vec::new();
            let mut again = Vec::new();
            let mut retry_delay = Duration::ZERO;
            let mut handed_back = Vec::new();
            let mut requeue = Vec::new();
            let mut pause = Duration::ZERO;
            let mut dead = Vec::new();
            let mut conflicts = Vec::new();
            let mut released = Vec::new();
            for (i, result) in results {
                let item = &mut items[i];
                let outcome = match &result {
                    Ok(Handled::Processed(_)) => Outcome::Processed,
                    Ok(Handled::Duplicate) => Outcome::Duplicate,
                    Ok(Handled::Conflict { .. }) => {
                        Outcome::Conflict(self.handler.conflict_policy())
                    }
                    Err(error) => Outcome::Failed(self.disposition(error)),
                };
                if let Outcome::Failed(ErrorDisposition::Retry) = outcome
                    && let Err(error) = &result
                {
                    tracing::warn!(message_id = %item.message_id, consumer = %item.key.consumer,
                        attempt, error = %chain(error), "retryable failure");
                    item.last_error = Some(chain(error));
                }
                let mut deliveries = Deliveries {
                    broker_earlier: item.earlier,
                    ledger_failures: 0,
                };
                if policy.charges(outcome, attempt) {
                    deliveries.ledger_failures = self.record_failure(item).await;
                }
                match (policy.decide(outcome, attempt, deliveries), result) {
                    (Settle::Ack, Ok(Handled::Processed(intent))) => {
                        // (The ledger is not cleared: the inbox row says done.)
                        self.processed(item, intent).await;
                        acks.push(i);
                    }
                    (Settle::Ack, Ok(Handled::Conflict { .. })) => {
                        // The inbox logged both fingerprints and counted it.
                        bump(&self.tally.conflicts);
                        acks.push(i);
                    }
                    (Settle::Ack, _) => {
                        bump(&self.tally.duplicates);
                        // Normal under at-least-once (a redelivery, a producer's
                        // retry): the duplicates counter tells the rate, the
                        // line is for following one message.
                        tracing::debug!(message_id = %item.message_id, consumer = %item.key.consumer,
                            redelivered = item.delivery.redelivered(), "duplicate delivery discarded");
                        acks.push(i);
                    }
                    (Settle::Retry { delay }, _) => {
                        retry_delay = delay;
                        again.push(i);
                    }
                    (
                        Settle::Requeue {
                            exhausted: false, ..
                        },
                        result,
                    ) => {
                        tracing::debug!(message_id = %item.message_id, consumer = %item.key.consumer,
                            error = %result.err().map(|e| chain(&e)).unwrap_or_default(),
                            "handing the delivery back to the broker");
                        handed_back.push(i);
                    }
                    (Settle::Requeue { pause: wait, .. }, _) => {
                        bump(&self.tally.requeued);
                        metrics::counter!(self.metric_names.requeued, "consumer" => self.consumer_label())
                            .increment(1);
                        tracing::warn!(message_id = %item.message_id, consumer = %item.key.consumer,
                            failed = deliveries.failed(), max = policy.max_deliveries, pause = ?wait,
                            error = %item.last_error.as_deref().unwrap_or("no attempt ran"),
                            "retries exhausted; requeueing for redelivery");
                        pause = pause.max(wait);
                        requeue.push(i);
                    }
                    (Settle::Release, result) => {
                        tracing::debug!(message_id = %item.message_id, consumer = %item.key.consumer,
                            error = %result.err().map(|e| chain(&e)).unwrap_or_default(),
                            "store unavailable: handing the delivery back uncharged");
                        released.push(i);
                    }
                    (
                        Settle::DeadLetter(DeadLetterReason::ConflictingDuplicate),
                        Ok(Handled::Conflict { stored, received }),
                    ) => {
                        conflicts.push((
                            i,
                            format!(
                                "message id {} was processed for a payload with fingerprint \
                                 {stored}; this delivery's is {received}",
                                item.message_id
                            ),
                        ));
                    }
                    (Settle::DeadLetter(why), result) => {
                        let failed = deliveries.failed();
                        let (reason, detail, last_error) = match (why, result) {
                            (DeadLetterReason::Permanent, Err(error)) => {
                                (error.reason(), chain(&error), chain(&error))
                            }
                            _ => {
                                let last = item.last_error.as_deref().unwrap_or("no attempt ran");
                                (
                                    "retries_exhausted",
                                    format!(
                                        "{failed} deliveries × {attempts} attempts failed; \
                                         last error: {last}"
                                    ),
                                    last.to_owned(),
                                )
                            }
                        };
                        dead.push((i, reason, detail, failed, LastError::new(&last_error)));
                    }
                }
            }
            // Neither an ack nor a retry: a frame that keeps the slot.
            let no_other_frame = handed_back.is_empty()
                && requeue.is_empty()
                && dead.is_empty()
                && conflicts.is_empty()
                && released.is_empty();
            if no_other_frame && again.is_empty() {
                drop(slot.take());
            }
            let settle = if no_other_frame && acks.is_empty() {
                // Only retries left: nothing to settle yet.
                Span::none()
            } else {
                crate::trace::settle_span(self.handler.name().as_str(), &self.queue)
            };
            settle.record("acked", acks.len());
            settle.record("handed_back", handed_back.len());
            settle.record("requeued", requeue.len());
            settle.record("released", released.len());
            settle.record("dead_lettered", dead.len() + conflicts.len());
            let stop_signal = &mut shutdown;
            async {
                let acked: Vec<&T::Delivery> = acks.iter().map(|&i| &items[i].delivery).collect();
                self.settler.ack_later(&acked);
                for i in handed_back {
                    self.requeue(&items[i].delivery, &items[i].key).await;
                }
                for i in released {
                    self.hand_back(&items[i].delivery).await;
                }
                for (i, reason, detail, failed, last_error) in dead {
                    let item = &items[i];
                    let id = item.message_id.to_string();
                    let failure = Failure {
                        key: &item.key,
                        attempts: failed,
                        last_error,
                    };
                    self.dead_letter(
                        &item.delivery,
                        Some(&id),
                        reason,
                        &detail,
                        Some(failure),
                        &process,
                    )
                    .await;
                }
                for (i, detail) in conflicts {
                    // Not the key's failure (the key was processed): the
                    // ledger is left alone, as for bad input.
                    let item = &items[i];
                    let id = item.message_id.to_string();
                    self.dead_letter(
                        &item.delivery,
                        Some(&id),
                        "conflicting_duplicate",
                        &detail,
                        None,
                        &process,
                    )
                    .await;
                }
                if !requeue.is_empty() {
                    // Hold the worker's slot for a while, longer with each
                    // delivery: during an outage (PostgreSQL down) this slows the
                    // whole consumer down instead of spinning through the
                    // delivery cap in seconds. Shutdown ends the pause: the
                    // requeue happens either way.
                    tokio::select! {
                        biased;
                        () = stopped(stop_signal) => {}
                        () = tokio::time::sleep(jittered(pause)) => {}
                    }
                    for i in requeue {
                        self.requeue_failed(&items[i].delivery, &items[i].key).await;
                    }
                }
            }
            .instrument(settle)
            .await;
            if !again.is_empty() {
                let stopping = tokio::select! {
                    biased;
                    () = stopped(&mut shutdown) => true,
                    () = tokio::time::sleep(jittered(retry_delay)) => false,
                };
                if stopping {
                    tracing::info!(consumer = %self.consumer_label(), deliveries = again.len(),
                        "shutting down: handing deliveries back to the broker instead of retrying");
                    for i in again {
                        self.requeue(&items[i].delivery, &items[i].key).await;
                    }
                    return;
                }
                for _ in &again {
                    bump(&self.tally.retried);
                }
            }
            open = again;
        }
    }

    /// What the policy does with `error`: its own disposition, except that
    /// a retryable failure while the store circuit is open (a handle
    /// timeout during an outage, say) is the outage's, not the message's.
    fn disposition(&self, error: &AppError) -> ErrorDisposition {
        match error.disposition() {
            ErrorDisposition::Retry if self.circuit.is_open() => ErrorDisposition::StoreUnavailable,
            disposition => disposition,
        }
    }

    /// Tells the store circuit how an attempt went: one success or one
    /// store failure per attempt (a batch's shared failure counts once).
    fn tell_circuit(&self, results: &Results<H::Intent>) {
        if results.iter().any(|(_, result)| result.is_ok()) {
            self.circuit.success();
        } else if let Some(error) = results.iter().find_map(|(_, result)| {
            result
                .as_ref()
                .err()
                .filter(|error| error.is_store_unavailable())
        }) {
            self.circuit.failure(error);
        }
    }

    /// One attempt at the `open` items: one transaction either way.
    async fn attempt(
        &self,
        items: &[Item<H::Message, T::Delivery>],
        open: &[usize],
        batched: bool,
    ) -> Results<H::Intent> {
        let handler = &self.handler;
        let exchange: &str = &self.exchange;
        let timeout = self.config.handle_timeout;
        if let (false, [i]) = (batched, open) {
            let item = &items[*i];
            let work = self.inbox.handle(&item.key, async |tx| {
                let mut cx = Context::new(tx, item.message_id, &item.key.consumer, exchange);
                handler.handle(&mut cx, &item.message).await
            });
            let result = match tokio::time::timeout(timeout, work).await {
                Ok(result) => result,
                Err(_elapsed) => Err(AppError::Timeout(timeout)),
            };
            return vec![(*i, result)];
        }
        let batch: Vec<(InboxKey, usize)> =
            open.iter().map(|&i| (items[i].key.clone(), i)).collect();
        let work = self.inbox.handle_batch(batch, async |tx, &i: &usize| {
            let item = &items[i];
            let mut cx = Context::new(tx, item.message_id, &item.key.consumer, exchange);
            handler.handle(&mut cx, &item.message).await
        });
        match tokio::time::timeout(timeout, work).await {
            Ok(results) => results.into_iter().map(|(_, i, r)| (i, r)).collect(),
            // Nothing of the batch committed: every message goes again.
            Err(_elapsed) => open
                .iter()
                .map(|&i| (i, Err(AppError::Timeout(timeout))))
                .collect(),
        }
    }

    /// Counts a committed message and makes its after-commit call.
    async fn processed(&self, item: &Item<H::Message, T::Delivery>, intent: H::Intent) {
        bump(&self.tally.processed);
        if item.delivery.redelivered() {
            bump(&self.tally.redelivered_processed);
        }
        tracing::debug!(message_id = %item.message_id, consumer = %item.key.consumer,
            redelivered = item.delivery.redelivered(), "processed");
        // Committed: the call that cannot join the transaction, with the
        // message id as its idempotency key.
        if let Err(error) = self.handler.after_commit(intent).await {
            bump(&self.tally.downstream_failed);
            metrics::counter!(self.metric_names.after_commit_failed, "consumer" => self.consumer_label())
                .increment(1);
            tracing::error!(message_id = %item.message_id, consumer = %item.key.consumer,
                error = %chain(&error),
                "downstream call failed after commit; the intent row stays for a re-send");
        }
    }

    /// Settles one delivery through the settler.
    async fn settle(&self, delivery: &T::Delivery, how: Frame) -> Result<(), AppError> {
        self.settler.settle(delivery, how).await
    }

    /// Records a delivery's final failure in the attempt ledger and returns
    /// the count including it, or 0 when the ledger cannot be written (the
    /// broker's count then decides alone; the store is likely down, which
    /// is not the message's fault).
    async fn record_failure(&self, item: &Item<H::Message, T::Delivery>) -> u32 {
        let error = LastError::new(item.last_error.as_deref().unwrap_or("no attempt ran"));
        match self.inbox.store().record_failure(&item.key, &error).await {
            Ok(failures) => failures,
            Err(error) => {
                tracing::warn!(message_id = %item.message_id, consumer = %item.key.consumer,
                    error = %chain(&error),
                    "cannot record the failure in the attempt ledger; capping on the broker's count");
                0
            }
        }
    }

    /// Hands a delivery that failed back with `basic.reject(requeue)`: the
    /// message's own failure, which the broker counts.
    async fn requeue_failed(&self, delivery: &T::Delivery, key: &InboxKey) {
        if let Err(error) = self.settle(delivery, Frame::RequeueFailed).await {
            tracing::warn!(message_id = %key.message_id, consumer = %key.consumer, error = %error,
                "reject failed; the broker redelivers when the channel closes");
        }
    }

    /// Hands a delivery back to the broker uncharged (`basic.nack` with
    /// requeue, which RabbitMQ 4.3 and later do not count as a delivery):
    /// the store is away, or consumption paused before it started, neither
    /// of them the message's fault.
    pub(crate) async fn hand_back(&self, delivery: &T::Delivery) {
        bump(&self.tally.released);
        if let Err(error) = self.settle(delivery, Frame::Release).await {
            tracing::debug!(message_id = delivery.message_id().unwrap_or("<none>"), error = %error,
                "nack failed; the broker redelivers when the channel closes");
        }
    }

    async fn requeue(&self, delivery: &T::Delivery, key: &InboxKey) {
        if let Err(error) = self.settle(delivery, Frame::Requeue).await {
            tracing::warn!(message_id = %key.message_id, consumer = %key.consumer, error = %error,
                "nack failed; the broker redelivers when the channel closes");
        }
    }

    async fn dead_letter(
        &self,
        delivery: &T::Delivery,
        message_id: Option<&str>,
        reason: &str,
        detail: &str,
        failure: Option<Failure<'_>>,
        attempt_span: &Span,
    ) {
        let consumer = self.consumer_label();
        let queue = &self.queue;
        let started = Instant::now();
        tracing::error!(message_id = message_id.unwrap_or("<none>"), consumer = %consumer, %queue,
            reason, detail, "dead-lettering delivery");
        let letter = DeadLetter {
            reason,
            detail,
            consumer: &consumer,
            queue,
            failure: failure
                .as_ref()
                .map(|failure| (failure.attempts, failure.last_error.as_str())),
            traceparent: crate::trace::traceparent_of(attempt_span),
        };
        if let Err(error) = self.settler.dead_letter(delivery, &letter).await {
            tracing::warn!(error = %chain(&error), "reject failed; the broker will redeliver");
            return;
        }
        if let Some(failure) = failure {
            let marked = self
                .inbox
                .store()
                .mark_dead(failure.key, reason, &failure.last_error)
                .await;
            if let Err(error) = marked {
                tracing::warn!(message_id = %failure.key.message_id, consumer = %failure.key.consumer,
                    error = %chain(&error),
                    "dead-lettered, but the attempt ledger cannot mark it dead; `dead` will not list it");
            }
        }
        self.tally.dead_letter(reason);
        metrics::counter!(names::DEAD_LETTERED, "consumer" => consumer, "reason" => reason.to_owned())
            .increment(1);
        tracing::debug!(elapsed = ?started.elapsed(), "dead-letter done");
    }
}
