//! The message path: one delivery from decode to ack.
//!
//! ```text
//! delivery ─► decode (size, message_id, type, JSON, event) ──bad──► dead-letter(reason)
//!          └► Inbox::handle(key = (message_id, consumer), async |tx| consumer.handle(tx, event))
//!               Processed ─► after-commit call (idempotency key = message id) ─► ack
//!               Duplicate ─► warn, ack
//!               retryable ─► retry in process with backoff (bounded), then
//!                              nack+requeue, or dead-letter once the delivery count reaches the cap
//!               permanent ─► dead-letter(error kind)
//! ```
//!
//! **Ack only after commit.** A crash anywhere before the ack leaves the
//! delivery unacknowledged; the broker redelivers it, and the inbox answers
//! `Duplicate` if the transaction had committed, or runs the work if not.
//!
//! **Dead-lettering with a reason.** RabbitMQ's own dead-lettering (a
//! `reject` without requeue) keeps the message and its headers but can only
//! say `rejected`. So the app publishes the message itself to the queue's
//! dead-letter exchange, with the original properties and headers plus
//! `x-dead-letter-reason` (the stable label also used as the metric label),
//! `x-dead-letter-detail` (the error text), `x-dead-letter-consumer` and
//! `x-dead-letter-queue`, waits for the broker's confirm, and only then acks
//! the original. If that publish fails, it falls back to `reject` without
//! requeue, which the queue's `x-dead-letter-exchange` routes to the same
//! dead-letter queue: the reason is lost then, never the message.
//!
//! **Nothing loops forever.** A retryable failure is retried in process
//! (`retry_attempts`, exponential backoff), then requeued after a pause that
//! grows with each delivery (10 × the retry delay, doubled, at most 30 s: in
//! an outage this slows the consumer down rather than spinning through the
//! cap); quorum queues count deliveries in `x-delivery-count`, and once a
//! message reaches `max_deliveries` it is dead-lettered with reason
//! `retries_exhausted`. The broker's own `x-delivery-limit` is a backstop
//! above that. A PostgreSQL outage longer than that budget therefore ends
//! in the dead-letter queue, from which the messages can be shovelled back.
//!
//! **Bounded time.** Each attempt runs under `handle_timeout`, well below
//! RabbitMQ's `consumer_timeout` (30 min by default, after which it closes
//! the channel with 406 PRECONDITION_FAILED). A timeout drops the handle
//! future, and with it the transaction, which rolls back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_api::metrics as names;
use inbox_api::{Handled, Inbox, InboxKey, InboxStore};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel};

use crate::AppError;
use crate::amqp::{Publisher, backoff};
use crate::batch::{AckTracker, BatchConfig, Settle};
use crate::consumers::{ParcelConsumer, Role};
use crate::effects::ParcelEffects;
use crate::error::chain;
use crate::event::{RawMessage, decode, truncate};
use crate::tally::{Faults, Tally, bump};
use crate::topology::Topology;

/// Metric: downstream calls that failed after commit.
pub const DOWNSTREAM_FAILED: &str = "parcel_downstream_failed_total";
/// Metric: deliveries requeued after in-process retries.
pub const REQUEUED: &str = "parcel_requeued_total";

/// Settings of the message path.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Unacknowledged deliveries the broker may push per queue consumer.
    pub prefetch: u16,
    /// Deliveries processed at once per queue.
    pub concurrency: usize,
    /// The bound on one attempt (begin to commit).
    pub handle_timeout: Duration,
    /// Attempts per delivery in process before it is requeued.
    pub retry_attempts: u32,
    /// Backoff before the second attempt; doubled each time.
    pub retry_base_delay: Duration,
    /// Deliveries of one message (per the broker's count) before it is
    /// dead-lettered as `retries_exhausted`.
    pub max_deliveries: u32,
    /// The largest body accepted.
    pub max_body_bytes: usize,
    /// Batched mode (`None`: one transaction per delivery, the default).
    /// See [`crate::batch`].
    pub batch: Option<BatchConfig>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            prefetch: 32,
            concurrency: 8,
            handle_timeout: Duration::from_secs(30),
            retry_attempts: 3,
            retry_base_delay: Duration::from_millis(100),
            max_deliveries: 10,
            max_body_bytes: 64 * 1024,
            batch: None,
        }
    }
}

/// What the message path does with one queue's deliveries.
pub(crate) struct Worker<S, C> {
    pub(crate) inbox: Arc<Inbox<S>>,
    pub(crate) consumer: Arc<C>,
    pub(crate) role: Role,
    pub(crate) topology: Topology,
    pub(crate) config: WorkerConfig,
    pub(crate) tally: Arc<Tally>,
    pub(crate) faults: Arc<Faults>,
    /// A channel in confirm mode, for dead-letter publishes.
    pub(crate) dead_letter_channel: Channel,
    /// Batched mode: the consuming channel's unsettled tags, through which
    /// every settle goes (see [`crate::batch`]); `None` per message.
    pub(crate) acks: Option<Arc<AckTracker>>,
}

impl<S, C> Clone for Worker<S, C> {
    fn clone(&self) -> Self {
        Self {
            inbox: Arc::clone(&self.inbox),
            consumer: Arc::clone(&self.consumer),
            role: self.role,
            topology: self.topology.clone(),
            config: self.config.clone(),
            tally: Arc::clone(&self.tally),
            faults: Arc::clone(&self.faults),
            dead_letter_channel: self.dead_letter_channel.clone(),
            acks: self.acks.clone(),
        }
    }
}

/// The broker's count of earlier deliveries of this message
/// (`x-delivery-count`, set by quorum queues on redelivery).
pub fn delivery_count(properties: &BasicProperties) -> u64 {
    let Some(headers) = properties.headers() else {
        return 0;
    };
    headers
        .inner()
        .get("x-delivery-count")
        .and_then(as_u64)
        .unwrap_or(0)
}

fn as_u64(value: &AMQPValue) -> Option<u64> {
    match value {
        AMQPValue::ShortShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::ShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::LongUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongLongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::Timestamp(v) => Some(*v),
        _ => None,
    }
}

/// A header value as text, if it is a string.
pub fn header_text(headers: &FieldTable, name: &str) -> Option<String> {
    match headers.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

fn long_string(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
}

impl<S, C> Worker<S, C>
where
    S: InboxStore<Transaction: ParcelEffects>,
    C: ParcelConsumer,
{
    fn consumer_label(&self) -> String {
        self.consumer.name().as_str().to_owned()
    }

    /// Handles one delivery to its end: acked, requeued or dead-lettered.
    pub(crate) async fn process(self, delivery: Delivery) {
        let properties = &delivery.properties;
        let raw = RawMessage {
            message_id: properties.message_id().as_ref().map(|s| s.as_str()),
            kind: properties.kind().as_ref().map(|s| s.as_str()),
            body: &delivery.data,
        };
        let shown_id = raw.message_id.map(|id| truncate(id, 64));
        let (message_id, event) = match decode(raw, self.config.max_body_bytes) {
            Ok(decoded) => decoded,
            Err(bad) => {
                self.dead_letter(
                    &delivery,
                    shown_id.as_deref(),
                    bad.reason.as_str(),
                    &bad.to_string(),
                )
                .await;
                return;
            }
        };
        let key = InboxKey::new(message_id, self.consumer.name().clone());
        let earlier_deliveries = delivery_count(&delivery.properties);
        let role_tally = self.tally.role(self.role);
        let mut last_error = None;
        for attempt in 1..=self.config.retry_attempts.max(1) {
            let consumer = &self.consumer;
            let faults = &self.faults;
            let event = &event;
            let key_ref = &key;
            let work = self.inbox.handle(&key, async |tx| {
                let intent = consumer.handle(tx, message_id, event).await?;
                faults.before_commit(key_ref).await?;
                Ok::<_, AppError>(intent)
            });
            let outcome = match tokio::time::timeout(self.config.handle_timeout, work).await {
                Ok(outcome) => outcome,
                Err(_elapsed) => Err(AppError::Timeout(self.config.handle_timeout)),
            };
            match outcome {
                Ok(Handled::Processed(intent)) => {
                    bump(&role_tally.processed);
                    if delivery.redelivered {
                        bump(&role_tally.redelivered_processed);
                    }
                    tracing::debug!(%message_id, consumer = %key.consumer, parcel_id = %event.parcel_id,
                        redelivered = delivery.redelivered, "processed");
                    // Committed: the call that cannot join the transaction,
                    // with the message id as its idempotency key.
                    if let Err(error) = self.consumer.after_commit(intent).await {
                        bump(&role_tally.downstream_failed);
                        metrics::counter!(DOWNSTREAM_FAILED, "consumer" => self.consumer_label())
                            .increment(1);
                        tracing::error!(%message_id, consumer = %key.consumer, error = %chain(&error),
                            "downstream call failed after commit; the intent row stays for a re-send");
                    }
                    self.ack(&delivery, &key).await;
                    return;
                }
                Ok(Handled::Duplicate) => {
                    bump(&role_tally.duplicates);
                    tracing::warn!(%message_id, consumer = %key.consumer,
                        redelivered = delivery.redelivered, "duplicate delivery discarded");
                    self.ack(&delivery, &key).await;
                    return;
                }
                Err(AppError::InjectedCrash(what)) => {
                    // As if the process had died mid-transaction: the
                    // transaction is gone (rolled back), the delivery is not
                    // acknowledged, and the broker delivers it again.
                    bump(&role_tally.crashes);
                    tracing::warn!(%message_id, consumer = %key.consumer, %what,
                        "injected crash mid-transaction; handing the delivery back to the broker");
                    self.requeue(&delivery, &key).await;
                    return;
                }
                Err(error) if error.is_retryable() => {
                    tracing::warn!(%message_id, consumer = %key.consumer, attempt,
                        error = %chain(&error), "retryable failure");
                    last_error = Some(error);
                    if attempt < self.config.retry_attempts {
                        bump(&role_tally.retried);
                        let delay = backoff(
                            self.config.retry_base_delay,
                            Duration::from_secs(5),
                            attempt - 1,
                        );
                        tokio::time::sleep(delay).await;
                    }
                }
                Err(error) => {
                    let detail = chain(&error);
                    self.dead_letter(
                        &delivery,
                        Some(&message_id.to_string()),
                        error.reason(),
                        &detail,
                    )
                    .await;
                    return;
                }
            }
        }
        let detail = last_error.map_or_else(|| "no attempt ran".to_owned(), |e| chain(&e));
        if earlier_deliveries + 1 >= u64::from(self.config.max_deliveries) {
            self.dead_letter(
                &delivery,
                Some(&message_id.to_string()),
                "retries_exhausted",
                &format!(
                    "{} deliveries × {} attempts failed; last error: {detail}",
                    earlier_deliveries + 1,
                    self.config.retry_attempts
                ),
            )
            .await;
        } else {
            bump(&role_tally.requeued);
            metrics::counter!(REQUEUED, "consumer" => self.consumer_label()).increment(1);
            // Wait before handing it back, longer with each delivery: during
            // an outage (PostgreSQL down) this holds the worker's permit and
            // so slows the whole consumer down instead of spinning through
            // the delivery cap in seconds.
            let pause = backoff(
                self.config.retry_base_delay.saturating_mul(10),
                Duration::from_secs(30),
                u32::try_from(earlier_deliveries).unwrap_or(u32::MAX),
            );
            tracing::warn!(%message_id, consumer = %key.consumer, deliveries = earlier_deliveries + 1,
                max = self.config.max_deliveries, ?pause, error = %detail,
                "retries exhausted; requeueing for redelivery");
            tokio::time::sleep(pause).await;
            self.requeue(&delivery, &key).await;
        }
    }

    /// Settles one delivery, through the tracker in batched mode.
    async fn settle(&self, delivery: &Delivery, how: Settle) -> Result<bool, lapin::Error> {
        if let Some(tracker) = &self.acks {
            return tracker.settle(delivery, how).await;
        }
        match how {
            Settle::Ack => delivery.ack(BasicAckOptions::default()).await,
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

    async fn ack(&self, delivery: &Delivery, key: &InboxKey) {
        if let Err(error) = self.settle(delivery, Settle::Ack).await {
            // The channel is gone: the broker redelivers, and the inbox
            // answers Duplicate because the transaction committed.
            tracing::warn!(message_id = %key.message_id, consumer = %key.consumer, error = %error,
                "ack failed after commit; the redelivery will be a duplicate");
        }
    }

    pub(crate) async fn requeue(&self, delivery: &Delivery, key: &InboxKey) {
        if let Err(error) = self.settle(delivery, Settle::Requeue).await {
            tracing::warn!(message_id = %key.message_id, consumer = %key.consumer, error = %error,
                "nack failed; the broker redelivers when the channel closes");
        }
    }

    pub(crate) async fn dead_letter(
        &self,
        delivery: &Delivery,
        message_id: Option<&str>,
        reason: &str,
        detail: &str,
    ) {
        let consumer = self.consumer_label();
        let queue = self.topology.queue(self.role);
        let started = Instant::now();
        tracing::error!(message_id = message_id.unwrap_or("<none>"), consumer = %consumer, %queue,
            reason, detail, "dead-lettering delivery");
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        headers.insert("x-dead-letter-reason".into(), long_string(reason));
        headers.insert(
            "x-dead-letter-detail".into(),
            long_string(&truncate(detail, 1000)),
        );
        headers.insert("x-dead-letter-consumer".into(), long_string(&consumer));
        headers.insert("x-dead-letter-queue".into(), long_string(&queue));
        let properties = delivery.properties.clone().with_headers(headers);
        let published = Publisher::publish_raw(
            &self.dead_letter_channel,
            &self.topology.dead_letter_exchange(self.role),
            &queue,
            &delivery.data,
            properties,
        )
        .await;
        let recorded_reason = match published {
            Ok(()) => {
                if let Err(error) = self.settle(delivery, Settle::Ack).await {
                    // Published but not acked: the redelivery will be
                    // dead-lettered again (bad input) or find its row.
                    tracing::warn!(error = %error, "ack after dead-letter publish failed");
                }
                reason.to_owned()
            }
            Err(error) => {
                tracing::warn!(error = %chain(&error), reason,
                    "dead-letter publish failed; rejecting into the queue's dead-letter exchange without the reason");
                if let Err(error) = self.settle(delivery, Settle::Reject).await {
                    tracing::warn!(error = %error, "reject failed; the broker will redeliver");
                    return;
                }
                reason.to_owned()
            }
        };
        self.tally.role(self.role).dead_letter(&recorded_reason);
        metrics::counter!(names::DEAD_LETTERED, "consumer" => consumer, "reason" => recorded_reason)
            .increment(1);
        tracing::debug!(elapsed = ?started.elapsed(), "dead-letter done");
    }
}
