//! NATS JetStream as a [`crate::broker::Broker`], the `nats`
//! feature's: a `nats://` (or `tls://`) URL runs the same service, message
//! path and inbox on JetStream instead of RabbitMQ.
//!
//! ```text
//! exchange ──► stream {exchange} (interest retention, file, subjects {exchange}.>)
//!   binding (queue, key) ──► durable pull consumer {queue}, filter {exchange}.{key}
//!   dead letters ──► stream {exchange}_DLQ (limits retention, subjects dlq.{exchange}.>)
//!                    subject dlq.{exchange}.{queue}
//! ```
//!
//! - A message is published to `{exchange}.{routing key}` with its id in
//!   `Nats-Msg-Id` (what JetStream's duplicate window deduplicates on, and
//!   what the consumers read as the message id) and its type in
//!   [`names::MESSAGE_TYPE`].
//! - **Interest retention** makes the stream a set of queues: a message
//!   stays until every consumer whose filter matches it acked it (or
//!   terminated it after its dead letter was stored), and a message no
//!   consumer's filter matches is not kept (as an unbound routing key on a
//!   topic exchange; but JetStream still acks its publish).
//! - **No delivery cap on the server** (`max_deliver` unlimited): JetStream
//!   counts every redelivery, the message's fault or not, so the attempt
//!   ledger decides when a message is poison, as on a classic RabbitMQ
//!   queue; [`crate::delivery::Delivery::earlier_deliveries`] is only its
//!   fallback.
//! - **`ack_wait`** is set by [`Broker::subscribe`] from the worker's
//!   settings ([`ack_wait_for`]), above the longest the worker holds one
//!   delivery; a handling longer than half of it sends "in progress"
//!   (module `progress`). `declare` creates a missing consumer with
//!   [`DECLARED_ACK_WAIT`] and leaves an existing one as it is; `subscribe`
//!   then updates it (the last subscriber's settings win when several
//!   services with different settings share a queue).
//! - **Settling** (module `settle`): ack, requeue and dead letters mean what
//!   they mean on RabbitMQ, with one difference: JetStream has no
//!   dead-letter exchange to fall back on, so a dead letter that cannot be
//!   published is `nak`ed with a delay, never dropped.

pub mod names;

mod connect;
mod delivery;
mod progress;
mod publish;
mod settle;
mod subscription;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::stream::{self, RetentionPolicy, StorageType};

use crate::AppError;
use crate::broker::{Broker, ConnectOptions};
use crate::config::WorkerConfig;
use crate::shutdown::bounded;
use crate::topology::Topology;

pub use connect::connect;
pub use publish::{PublishFailure, Published, publish_confirmed};
pub(crate) use subscription::JetStreamSubscription;

/// How long a stream remembers a message id to drop a re-publish of it:
/// JetStream's default, which covers a relay's retry after a lost publish
/// ack. A longer window costs server memory per message.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// The `ack_wait` a consumer is created with by `declare`, before a
/// subscriber sets its own ([`ack_wait_for`]): the worker's default bound
/// with room to spare.
pub const DECLARED_ACK_WAIT: Duration = Duration::from_secs(150);

/// The room `ack_wait` leaves beyond the worker's own bound (a slow
/// commit, the settle frame on its way).
const ACK_WAIT_MARGIN: Duration = Duration::from_secs(10);

/// The `ack_wait` of a consumer whose worker runs with `config`: longer
/// than the worker can hold one delivery before it settles it, so that
/// the server never redelivers a message still being handled: every
/// in-process attempt (`handle_timeout` each), the longest backoff
/// between two of them, the longest pause before a requeue (see
/// [`crate::settle`]), and a margin. A crashed consumer's messages come
/// back after it (140 s with the default settings); the in-progress
/// signal (module `progress`) covers a
/// delivery held longer all the same.
#[must_use]
pub fn ack_wait_for(config: &WorkerConfig) -> Duration {
    let attempts = config.policy().attempts();
    config
        .handle_timeout
        .saturating_mul(attempts)
        .saturating_add(crate::settle::MAX_RETRY_DELAY.saturating_mul(attempts - 1))
        .saturating_add(crate::settle::MAX_REQUEUE_PAUSE)
        .saturating_add(ACK_WAIT_MARGIN)
}

/// What `declare` made for one queue, for its `subscribe`.
#[derive(Clone, Debug)]
struct Declared {
    exchange: String,
    stream: String,
    consumer: pull::Config,
}

/// A connection to a NATS server with JetStream.
pub(crate) struct JetStream {
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
    /// By queue: its exchange, stream and consumer, from `declare`.
    declared: Mutex<HashMap<String, Declared>>,
}

impl JetStream {
    /// The JetStream context, for publishing.
    pub(crate) fn context(&self) -> &async_nats::jetstream::Context {
        &self.js
    }

    /// Whether the client is connected (async-nats reconnects on its own;
    /// a client that lost its server says so here).
    pub(crate) fn is_open(&self) -> bool {
        self.client.connection_state() != async_nats::connection::State::Disconnected
    }

    /// Gets or creates `exchange`'s work stream: what a publisher needs
    /// before any consumer has declared its topology (the outbox relay).
    ///
    /// # Errors
    /// The server's.
    pub(crate) async fn declare_stream(
        &self,
        exchange: &str,
    ) -> Result<async_nats::jetstream::stream::Stream, AppError> {
        let work = self
            .js
            .get_or_create_stream(work_stream(exchange))
            .await
            .map_err(|e| {
                AppError::broker(format!("declare the stream of exchange {exchange}"), e)
            })?;
        let found = &work.cached_info().config;
        if found.retention != RetentionPolicy::Interest {
            // Still correct (each consumer acks its own), but acked
            // messages stay until the stream's limits drop them.
            tracing::warn!(stream = %found.name, retention = ?found.retention,
                "the exchange's stream exists without interest retention; acked messages stay");
        }
        Ok(work)
    }

    fn declared(&self) -> std::sync::MutexGuard<'_, HashMap<String, Declared>> {
        self.declared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The work stream of `exchange`, as `declare` creates it.
#[must_use]
pub fn work_stream(exchange: &str) -> stream::Config {
    stream::Config {
        name: names::stream_name(exchange),
        subjects: vec![names::stream_subjects(exchange)],
        retention: RetentionPolicy::Interest,
        storage: StorageType::File,
        duplicate_window: DUPLICATE_WINDOW,
        ..stream::Config::default()
    }
}

/// The dead-letter stream of `exchange`: kept until replayed or purged.
fn dead_letter_stream(exchange: &str) -> stream::Config {
    stream::Config {
        name: names::dead_letter_stream(exchange),
        subjects: vec![names::dead_letter_subjects(exchange)],
        retention: RetentionPolicy::Limits,
        storage: StorageType::File,
        duplicate_window: DUPLICATE_WINDOW,
        ..stream::Config::default()
    }
}

/// The durable pull consumer of `queue`, bound to `exchange` with
/// `routing_key`, as `declare` creates it.
#[must_use]
pub fn consumer(exchange: &str, queue: &str, routing_key: &str) -> pull::Config {
    pull::Config {
        durable_name: Some(names::consumer_name(queue)),
        filter_subject: names::filter_subject(exchange, routing_key),
        deliver_policy: DeliverPolicy::All,
        ack_policy: AckPolicy::Explicit,
        ack_wait: DECLARED_ACK_WAIT,
        // Unlimited: the attempt ledger decides (see the module's notes).
        max_deliver: -1,
        ..pull::Config::default()
    }
}

/// Whether a stream delete failed because the stream is not there.
fn stream_not_found(error: &async_nats::jetstream::context::DeleteStreamError) -> bool {
    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::DeleteStreamErrorKind;
    matches!(error.kind(), DeleteStreamErrorKind::JetStream(inner)
        if inner.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

impl Broker for JetStream {
    type Subscription = JetStreamSubscription;

    const NAME: &'static str = "NATS JetStream";

    async fn connect(url: &str, name: &str, options: ConnectOptions) -> Result<Self, AppError> {
        let client = connect::connect(url, name, options).await?;
        let js = async_nats::jetstream::new(client.clone());
        Ok(Self {
            client,
            js,
            declared: Mutex::default(),
        })
    }

    /// Gets or creates the exchange's stream and dead-letter stream and
    /// each queue's consumer. An existing stream or consumer is left as it
    /// is (an operator's change to it, a subscriber's `ack_wait`, stays),
    /// so declaring again is harmless.
    async fn declare(&self, topology: &Topology) -> Result<(), AppError> {
        let exchange = topology.exchange();
        let work = self.declare_stream(exchange).await?;
        self.js
            .get_or_create_stream(dead_letter_stream(exchange))
            .await
            .map_err(|e| {
                AppError::broker(
                    format!("declare the dead-letter stream of exchange {exchange}"),
                    e,
                )
            })?;
        let stream_name = names::stream_name(exchange);
        for binding in topology.bindings() {
            let config = consumer(exchange, &binding.queue, &binding.routing_key);
            let durable = names::consumer_name(&binding.queue);
            let existing = work.get_consumer::<pull::Config>(&durable).await;
            match existing {
                Ok(found) => {
                    let filter = &found.cached_info().config.filter_subject;
                    if *filter != config.filter_subject {
                        return Err(AppError::Config(format!(
                            "queue {}: its JetStream consumer {durable} filters {filter}, \
                             the topology binds {}; delete the consumer to rebind it",
                            binding.queue, config.filter_subject
                        )));
                    }
                }
                Err(_) => {
                    let _created: PullConsumer =
                        work.create_consumer(config.clone()).await.map_err(|e| {
                            AppError::broker(
                                format!("declare the consumer of queue {}", binding.queue),
                                e,
                            )
                        })?;
                }
            }
            self.declared().insert(
                binding.queue.clone(),
                Declared {
                    exchange: exchange.to_owned(),
                    stream: stream_name.clone(),
                    consumer: config,
                },
            );
        }
        Ok(())
    }

    /// Updates the queue's consumer with the worker's settings (`ack_wait`
    /// from [`ack_wait_for`], the prefetch as `max_ack_pending`) and pulls
    /// from it.
    async fn subscribe(
        &self,
        queue: &str,
        consumer: &str,
        config: &WorkerConfig,
    ) -> Result<JetStreamSubscription, AppError> {
        let declared = self.declared().get(queue).cloned().ok_or_else(|| {
            AppError::Config(format!(
                "queue {queue} is not in the topology declared on NATS"
            ))
        })?;
        let settings = pull::Config {
            ack_wait: ack_wait_for(config),
            max_ack_pending: i64::from(config.prefetch.max(1)),
            ..declared.consumer
        };
        let pull: PullConsumer = self
            .js
            .create_consumer_on_stream(settings, &declared.stream)
            .await
            .map_err(|e| AppError::broker(format!("update the consumer of queue {queue}"), e))?;
        tracing::debug!(%queue, %consumer, ack_wait = ?pull.cached_info().config.ack_wait,
            "subscribing on JetStream");
        JetStreamSubscription::open(&self.js, pull, queue, &declared.exchange, config).await
    }

    /// Deletes the exchange's stream (its consumers go with it) and its
    /// dead-letter stream; a stream already gone is not an error.
    async fn delete(&self, topology: &Topology) -> Result<(), AppError> {
        let exchange = topology.exchange();
        for stream in [
            names::stream_name(exchange),
            names::dead_letter_stream(exchange),
        ] {
            match self.js.delete_stream(&stream).await {
                Ok(_) => {}
                Err(error) if stream_not_found(&error) => {}
                Err(error) => {
                    return Err(AppError::broker(format!("delete stream {stream}"), error));
                }
            }
        }
        self.declared()
            .retain(|_, declared| declared.exchange != exchange);
        Ok(())
    }

    fn is_connected(&self) -> bool {
        self.is_open()
    }

    /// Drains the connection (what was published goes out, then it
    /// closes), bounded.
    async fn close(&self, reason: &str) {
        if let Some(Err(error)) = bounded("drain the NATS connection", self.client.drain()).await {
            tracing::debug!(reason, error = %error, "draining the NATS connection failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_wait_outlasts_every_in_process_attempt() {
        let config = WorkerConfig::default();
        // 3 attempts of 30 s, 2 backoffs of at most 5 s, a requeue pause
        // of at most 30 s, 10 s of margin.
        assert_eq!(
            ack_wait_for(&config),
            Duration::from_secs(90 + 10 + 30 + 10)
        );
        let one = WorkerConfig {
            retry_attempts: 0,
            handle_timeout: Duration::from_secs(1),
            ..WorkerConfig::default()
        };
        assert_eq!(ack_wait_for(&one), Duration::from_secs(1 + 30 + 10));
        assert!(ack_wait_for(&config) <= DECLARED_ACK_WAIT);
    }

    #[test]
    fn the_topology_maps_to_streams_and_consumers() {
        let work = work_stream("shop.events");
        assert_eq!(work.name, "shop_events");
        assert_eq!(work.subjects, ["shop.events.>"]);
        assert_eq!(work.retention, RetentionPolicy::Interest);
        let dead = dead_letter_stream("shop.events");
        assert_eq!(dead.name, "shop_events_DLQ");
        assert_eq!(dead.subjects, ["dlq.shop.events.>"]);
        assert_eq!(dead.retention, RetentionPolicy::Limits);
        let consumer = consumer("shop.events", "pay.q", "order.#");
        assert_eq!(consumer.durable_name.as_deref(), Some("pay_q"));
        assert_eq!(consumer.filter_subject, "shop.events.order.>");
        assert_eq!(consumer.max_deliver, -1);
        assert_eq!(consumer.ack_policy, AckPolicy::Explicit);
    }
}
