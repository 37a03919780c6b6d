//! Batched mode: up to `size` deliveries through one
//! [`Inbox::handle_batch`](inbox_api::Inbox::handle_batch) transaction.
//!
//! ```text
//! deliveries (up to size, or until wait passes) ─► decode each ──bad──► dead-letter(reason)
//!   └► Inbox::handle_batch(keys, async |tx, i| consumer.handle(tx, event[i]))   one COMMIT
//!        Processed ─► after-commit call ─┐
//!        Duplicate ──────────────────────┴► ack (one multiple-ack where the tags allow)
//!        Failed(retryable) / Redeliver ─► next in-process attempt (a smaller batch),
//!                                          then requeue, or dead-letter at the delivery cap
//!        Failed(permanent) ─► dead-letter(error kind)
//!   store error (begin, claim, commit) ─► the whole batch: retried, then requeued / capped
//! ```
//!
//! The guarantee is the per-message one: one failing message rolls back
//! alone (its claim too) and the rest of the batch commits; nothing is acked
//! before the commit. (`handle_batch` runs a batch without savepoints first
//! and reruns it with one per message only after a failure; see its docs.)
//!
//! **Multiple-ack.** `basic.ack(tag, multiple = true)` settles *every*
//! unsettled delivery of the channel up to `tag`, including those of other
//! batches still in flight on the same channel. So the channel's unsettled
//! tags are tracked ([`AckTracker`]): a batch acks with one multiple-ack the
//! tags below the lowest tag still unsettled elsewhere (they are contiguous
//! among the channel's unsettled tags), and the rest one by one. Every
//! settle (ack, nack, reject) of a batched channel goes through the tracker,
//! under its lock, so a multiple-ack never covers a tag that something else
//! settles later (RabbitMQ closes the channel on a double settle).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use inbox_api::{BatchTransaction, Handled, InboxKey, InboxStore, InboxTransaction, MessageId};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use tokio::sync::{Mutex, watch};

use crate::AppError;
use crate::amqp::backoff;
use crate::consumers::ParcelConsumer;
use crate::error::chain;
use crate::event::{ParcelCreatedEvent, RawMessage, decode, truncate};
use crate::store::ParcelStore;
use crate::tally::bump;
use crate::worker::{DOWNSTREAM_FAILED, REQUEUED, Worker, delivery_count};

/// Settings of batched mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchConfig {
    /// The most deliveries in one transaction.
    pub size: usize,
    /// How long a batch waits for more deliveries after its first one.
    pub wait: Duration,
}

impl BatchConfig {
    /// Batched mode when it can batch anything: `size > 1` and a prefetch
    /// above one (with prefetch 1 the broker never has a second delivery
    /// outstanding).
    pub fn effective(size: usize, wait: Duration, prefetch: u16) -> Option<Self> {
        (size > 1 && prefetch > 1).then_some(Self { size, wait })
    }
}

/// How one delivery is settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settle {
    /// `basic.ack`.
    Ack,
    /// `basic.nack` with requeue.
    Requeue,
    /// `basic.reject` without requeue (to the queue's dead-letter exchange).
    Reject,
}

/// The unsettled delivery tags of one consuming channel (batched mode).
#[derive(Debug, Default)]
pub(crate) struct AckTracker {
    unsettled: Mutex<BTreeSet<u64>>,
}

impl AckTracker {
    /// Records a delivery as received; called in delivery order by the
    /// consuming loop.
    pub(crate) async fn received(&self, delivery: &Delivery) {
        self.unsettled.lock().await.insert(delivery.delivery_tag);
    }

    /// Settles one delivery.
    pub(crate) async fn settle(
        &self,
        delivery: &Delivery,
        how: Settle,
    ) -> Result<bool, lapin::Error> {
        let mut unsettled = self.unsettled.lock().await;
        let result = settle_one(delivery, how, false).await;
        unsettled.remove(&delivery.delivery_tag);
        result
    }

    /// Acks `deliveries`: the ones below every other unsettled tag of the
    /// channel with a single multiple-ack, the others one by one. Returns
    /// how many `basic.ack` frames went out.
    pub(crate) async fn ack_all(&self, deliveries: &[&Delivery]) -> usize {
        if deliveries.is_empty() {
            return 0;
        }
        let mut unsettled = self.unsettled.lock().await;
        for delivery in deliveries {
            unsettled.remove(&delivery.delivery_tag);
        }
        let lowest_other = unsettled.first().copied().unwrap_or(u64::MAX);
        let (mut below, above): (Vec<&Delivery>, Vec<&Delivery>) = deliveries
            .iter()
            .copied()
            .partition(|d| d.delivery_tag < lowest_other);
        below.sort_by_key(|d| d.delivery_tag);
        let mut frames = 0;
        let fail = |error: lapin::Error, tag: u64| {
            // The channel is gone: the broker redelivers, and the inbox
            // answers Duplicate because the batch committed.
            tracing::warn!(tag, error = %error,
                "ack failed after commit; the redelivery will be a duplicate");
        };
        match below.as_slice() {
            [] => {}
            [one] => {
                frames += 1;
                if let Err(error) = settle_one(one, Settle::Ack, false).await {
                    fail(error, one.delivery_tag);
                }
            }
            [.., last] => {
                // Every unsettled tag up to `last` is one of ours.
                frames += 1;
                if let Err(error) = settle_one(last, Settle::Ack, true).await {
                    fail(error, last.delivery_tag);
                }
            }
        }
        for delivery in above {
            frames += 1;
            if let Err(error) = settle_one(delivery, Settle::Ack, false).await {
                fail(error, delivery.delivery_tag);
            }
        }
        frames
    }
}

async fn settle_one(
    delivery: &Delivery,
    how: Settle,
    multiple: bool,
) -> Result<bool, lapin::Error> {
    match how {
        Settle::Ack => delivery.ack(BasicAckOptions { multiple }).await,
        Settle::Requeue => {
            delivery
                .nack(BasicNackOptions {
                    multiple: false,
                    requeue: true,
                })
                .await
        }
        Settle::Reject => delivery.reject(BasicRejectOptions { requeue: false }).await,
    }
}

/// Pulls deliveries after `first` until the batch is full, `wait` has
/// passed since the first, or shutdown. Returns the batch and the
/// consumer's failure, if it failed meanwhile (the batch is still to be
/// processed: its deliveries cannot be acked then, and come back).
pub(crate) async fn collect<S>(
    first: Delivery,
    consumer: &mut S,
    config: BatchConfig,
    tracker: &AckTracker,
    shutdown: &mut watch::Receiver<bool>,
    queue: &str,
) -> (Vec<Delivery>, Option<AppError>)
where
    S: Stream<Item = Result<Delivery, lapin::Error>> + Unpin,
{
    tracker.received(&first).await;
    let mut batch = Vec::with_capacity(config.size);
    batch.push(first);
    let deadline = tokio::time::Instant::now() + config.wait;
    while batch.len() < config.size {
        let next = tokio::select! {
            biased;
            _ = shutdown.wait_for(|stop| *stop) => break,
            () = tokio::time::sleep_until(deadline) => break,
            next = consumer.next() => next,
        };
        match next {
            Some(Ok(delivery)) => {
                tracker.received(&delivery).await;
                batch.push(delivery);
            }
            Some(Err(error)) => {
                return (
                    batch,
                    Some(AppError::broker(format!("consuming {queue}"), error)),
                );
            }
            None => {
                return (
                    batch,
                    Some(AppError::Unavailable(format!(
                        "the broker cancelled the consumer of {queue}"
                    ))),
                );
            }
        }
    }
    (batch, None)
}

/// A decoded delivery of a batch.
struct Item {
    delivery: Delivery,
    message_id: MessageId,
    event: ParcelCreatedEvent,
    key: InboxKey,
    /// The last retryable error, for the requeue log and the dead-letter
    /// detail.
    last_error: Option<String>,
}

impl<S, C> Worker<S, C>
where
    S: ParcelStore,
    C: ParcelConsumer,
{
    /// Handles one batch of deliveries to their ends: each acked, requeued
    /// or dead-lettered.
    pub(crate) async fn process_batch(self, deliveries: Vec<Delivery>) {
        let mut items = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            let properties = &delivery.properties;
            let raw = RawMessage {
                message_id: properties.message_id().as_ref().map(|s| s.as_str()),
                kind: properties.kind().as_ref().map(|s| s.as_str()),
                body: &delivery.data,
            };
            let shown_id = raw.message_id.map(|id| truncate(id, 64));
            match decode(raw, self.config.max_body_bytes) {
                Ok((message_id, event)) => {
                    let key = InboxKey::new(message_id, self.consumer.name().clone());
                    items.push(Item {
                        delivery,
                        message_id,
                        event,
                        key,
                        last_error: None,
                    });
                }
                Err(bad) => {
                    // Bad input never enters a batch.
                    self.dead_letter(
                        &delivery,
                        shown_id.as_deref(),
                        bad.reason.as_str(),
                        &bad.to_string(),
                    )
                    .await;
                }
            }
        }
        let role_tally = self.tally.role(self.role);
        let attempts = self.config.retry_attempts.max(1);
        // Indices into `items` still to be handled.
        let mut open: Vec<usize> = (0..items.len()).collect();
        for attempt in 1..=attempts {
            if open.is_empty() {
                return;
            }
            let batch: Vec<(InboxKey, usize)> =
                open.iter().map(|&i| (items[i].key.clone(), i)).collect();
            let outcome = {
                let (consumer, faults, items_ref) = (&self.consumer, &self.faults, &items);
                let work = self.inbox.handle_batch(batch, async |tx, &i: &usize| {
                    let item = &items_ref[i];
                    let intent = consumer.handle(tx, item.message_id, &item.event).await?;
                    faults.before_commit(&item.key).await?;
                    Ok::<_, AppError>(intent)
                });
                tokio::time::timeout(self.config.handle_timeout, work).await
            };
            let Ok(results) = outcome else {
                // Nothing of the batch committed: every message goes again.
                let error = AppError::Timeout(self.config.handle_timeout);
                tracing::warn!(batch = open.len(), attempt, error = %chain(&error),
                    consumer = %self.consumer.name(), "retryable failure of a batch");
                let detail = chain(&error);
                for &i in &open {
                    items[i].last_error = Some(detail.clone());
                }
                self.pause_before_retry(attempt, attempts, open.len()).await;
                continue;
            };

            // Committed. After-commit calls, then the acks; the failures
            // after that.
            if results.iter().any(|(_, _, result)| result.is_ok()) {
                bump(&role_tally.batches);
            }
            let mut acks = Vec::new();
            let mut again = Vec::new();
            let mut crashed = Vec::new();
            let mut dead = Vec::new();
            for (_, i, result) in results {
                let item = &mut items[i];
                match result {
                    Ok(Handled::Processed(intent)) => {
                        bump(&role_tally.processed);
                        if item.delivery.redelivered {
                            bump(&role_tally.redelivered_processed);
                        }
                        tracing::debug!(message_id = %item.message_id, consumer = %item.key.consumer,
                            parcel_id = %item.event.parcel_id, redelivered = item.delivery.redelivered,
                            "processed (batched)");
                        if let Err(error) = self.consumer.after_commit(intent).await {
                            bump(&role_tally.downstream_failed);
                            metrics::counter!(DOWNSTREAM_FAILED, "consumer" => self.consumer.name().as_str().to_owned())
                                .increment(1);
                            tracing::error!(message_id = %item.message_id, consumer = %item.key.consumer,
                                error = %chain(&error),
                                "downstream call failed after commit; the intent row stays for a re-send");
                        }
                        acks.push(i);
                    }
                    Ok(Handled::Duplicate) => {
                        bump(&role_tally.duplicates);
                        tracing::warn!(message_id = %item.message_id, consumer = %item.key.consumer,
                            redelivered = item.delivery.redelivered, "duplicate delivery discarded");
                        acks.push(i);
                    }
                    Err(AppError::InjectedCrash(what)) => {
                        bump(&role_tally.crashes);
                        tracing::warn!(message_id = %item.message_id, consumer = %item.key.consumer,
                            %what, "injected crash mid-transaction; handing the delivery back to the broker");
                        crashed.push(i);
                    }
                    Err(error) if error.is_retryable() => {
                        tracing::warn!(message_id = %item.message_id, consumer = %item.key.consumer,
                            attempt, error = %chain(&error), "retryable failure (batched)");
                        item.last_error = Some(chain(&error));
                        again.push(i);
                    }
                    Err(error) => dead.push((i, error)),
                }
            }
            let acked: Vec<&Delivery> = acks.iter().map(|&i| &items[i].delivery).collect();
            self.ack_batch(&acked).await;
            for i in crashed {
                self.requeue(&items[i].delivery, &items[i].key).await;
            }
            for (i, error) in dead {
                let item = &items[i];
                self.dead_letter(
                    &item.delivery,
                    Some(&item.message_id.to_string()),
                    error.reason(),
                    &chain(&error),
                )
                .await;
            }
            open = again;
            if !open.is_empty() {
                self.pause_before_retry(attempt, attempts, open.len()).await;
            }
        }
        if open.is_empty() {
            return;
        }
        // Retries exhausted: per message, requeue or dead-letter at the cap.
        let mut pause = Duration::ZERO;
        let mut requeue = Vec::new();
        for &i in &open {
            let item = &items[i];
            let earlier = delivery_count(&item.delivery.properties);
            let detail = item
                .last_error
                .clone()
                .unwrap_or_else(|| "a copy of a failed message".to_owned());
            if earlier + 1 >= u64::from(self.config.max_deliveries) {
                self.dead_letter(
                    &item.delivery,
                    Some(&item.message_id.to_string()),
                    "retries_exhausted",
                    &format!(
                        "{} deliveries × {} attempts failed; last error: {detail}",
                        earlier + 1,
                        attempts
                    ),
                )
                .await;
            } else {
                bump(&role_tally.requeued);
                metrics::counter!(REQUEUED, "consumer" => self.consumer.name().as_str().to_owned())
                    .increment(1);
                pause = pause.max(backoff(
                    self.config.retry_base_delay.saturating_mul(10),
                    Duration::from_secs(30),
                    u32::try_from(earlier).unwrap_or(u32::MAX),
                ));
                tracing::warn!(message_id = %item.message_id, consumer = %item.key.consumer,
                    deliveries = earlier + 1, max = self.config.max_deliveries, error = %detail,
                    "retries exhausted; requeueing for redelivery");
                requeue.push(i);
            }
        }
        if !requeue.is_empty() {
            // As in per-message mode: hold the worker's slot for a while, so
            // an outage slows the consumer instead of spinning through the cap.
            tokio::time::sleep(pause).await;
            for i in requeue {
                self.requeue(&items[i].delivery, &items[i].key).await;
            }
        }
    }

    /// Backoff before the next in-process attempt, if there is one.
    async fn pause_before_retry(&self, attempt: u32, attempts: u32, messages: usize) {
        if attempt < attempts {
            let role_tally = self.tally.role(self.role);
            for _ in 0..messages {
                bump(&role_tally.retried);
            }
            let delay = backoff(
                self.config.retry_base_delay,
                Duration::from_secs(5),
                attempt - 1,
            );
            tokio::time::sleep(delay).await;
        }
    }

    /// Acks committed deliveries: through the channel's tracker (one
    /// multiple-ack where it can), or one by one without one.
    async fn ack_batch(&self, deliveries: &[&Delivery]) {
        match &self.acks {
            Some(tracker) => {
                let frames = tracker.ack_all(deliveries).await;
                tracing::trace!(acked = deliveries.len(), frames, "batch acked");
            }
            None => {
                for delivery in deliveries {
                    if let Err(error) = delivery.ack(BasicAckOptions::default()).await {
                        tracing::warn!(tag = delivery.delivery_tag, error = %error,
                            "ack failed after commit; the redelivery will be a duplicate");
                    }
                }
            }
        }
    }
}

/// A tracker shared by a batched channel's batches.
pub(crate) fn tracker() -> Arc<AckTracker> {
    Arc::new(AckTracker::default())
}

/// Checks that `store` supports batched mode (savepoints), so that a store
/// without it is refused at start rather than dead-lettering every batch.
///
/// # Errors
/// [`AppError::Config`] when the store has no savepoints; the store's own
/// error when it cannot be reached.
pub async fn probe<S>(store: &S) -> Result<(), AppError>
where
    S: InboxStore<Transaction: BatchTransaction>,
{
    let mut tx = store.begin().await?;
    let savepoint = tx.savepoint().await;
    if let Err(error) = tx.rollback().await {
        tracing::debug!(error = %error, "rollback after the batched-mode probe failed");
    }
    match savepoint {
        Ok(()) => Ok(()),
        Err(error) if error.is_retryable() => Err(error.into()),
        Err(error) => Err(AppError::Config(format!(
            "batched mode (--batch-size) needs savepoints, which this store refused: {}",
            chain(&error)
        ))),
    }
}
