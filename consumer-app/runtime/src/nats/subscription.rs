//! A queue's JetStream subscription: its durable pull consumer's
//! `messages()` stream, with the ack queue and the in-progress ticker
//! beside it.
//!
//! **Transient errors.** While the server restarts, the pull stream yields
//! errors (a missed idle heartbeat, a failed pull request, no responders)
//! and then carries on by itself once async-nats has reconnected: those are
//! logged and skipped, never an end of the consuming loop. Only the stream
//! ending (the consumer deleted, a pull the server refuses for good) ends
//! it, and the supervisor then reconnects and declares again.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::consumer::pull::{MessagesErrorKind, Stream as Messages};
use futures::{FutureExt as _, StreamExt as _};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::delivery::JetStreamDelivery;
use super::progress::InProgress;
use super::settle::{JetStreamSettler, ack_loop, failed_delay};
use crate::AppError;
use crate::config::WorkerConfig;
use crate::delivery::Subscription;
use crate::shutdown::bounded;

/// The idle heartbeat asked of the server per pull request: two missed
/// ones are a `MissingHeartbeat` error, a sign (logged) that the server is
/// away. Well below the pull's 30 s expiry, as the server requires.
const PULL_HEARTBEAT: Duration = Duration::from_secs(5);

/// One queue's subscription on a JetStream connection.
pub(crate) struct JetStreamSubscription {
    queue: String,
    consumer: PullConsumer,
    /// `None` once stopped.
    messages: Option<Messages>,
    batch: usize,
    settler: Arc<JetStreamSettler>,
    /// Transient errors in a row, for the log level.
    transient: u32,
    stop_tasks: watch::Sender<bool>,
    acker: JoinHandle<()>,
    ticker: JoinHandle<()>,
}

impl JetStreamSubscription {
    /// Subscribes to `consumer` (the durable of `queue`, bound to
    /// `exchange`) with the worker's prefetch as the pull batch, and starts
    /// the ack queue and the in-progress ticker.
    ///
    /// # Errors
    /// The server's, when the first pull cannot start.
    pub(crate) async fn open(
        js: &async_nats::jetstream::Context,
        consumer: PullConsumer,
        queue: &str,
        exchange: &str,
        config: &WorkerConfig,
    ) -> Result<Self, AppError> {
        let client = js.client();
        let ack_wait = consumer.cached_info().config.ack_wait;
        let in_progress = Arc::new(InProgress::new(ack_wait));
        let (acks, queued) = mpsc::unbounded_channel();
        let settler = Arc::new(JetStreamSettler {
            client: client.clone(),
            js: js.clone(),
            exchange: exchange.to_owned(),
            acks,
            in_progress: Arc::clone(&in_progress),
            failed_delay: failed_delay(config.retry_base_delay, config.retry_attempts),
        });
        let (stop_tasks, stopping) = watch::channel(false);
        let acker = tokio::spawn(ack_loop(client.clone(), queued, stopping.clone()));
        let ticker = tokio::spawn(async move { in_progress.tick_loop(client, stopping).await });
        let mut subscription = Self {
            queue: queue.to_owned(),
            consumer,
            messages: None,
            batch: usize::from(config.prefetch.max(1)),
            settler,
            transient: 0,
            stop_tasks,
            acker,
            ticker,
        };
        subscription.messages = Some(subscription.pull().await?);
        Ok(subscription)
    }

    /// A new pull stream on the consumer.
    async fn pull(&self) -> Result<Messages, AppError> {
        self.consumer
            .stream()
            .max_messages_per_batch(self.batch)
            .heartbeat(PULL_HEARTBEAT)
            .messages()
            .await
            .map_err(|e| AppError::broker(format!("pull from {}", self.queue), e))
    }

    /// A pulled message as a delivery, recorded as in progress.
    fn received(&mut self, message: async_nats::jetstream::Message) -> JetStreamDelivery {
        self.transient = 0;
        let delivery = JetStreamDelivery::new(message);
        if let Some(subject) = delivery.ack_subject() {
            self.settler.in_progress.received(subject);
        }
        delivery
    }

    /// The messages the pull stream holds ready, without waiting.
    fn take_ready(&mut self) -> Vec<async_nats::jetstream::Message> {
        let mut held = Vec::new();
        if let Some(messages) = self.messages.as_mut() {
            while let Some(Some(item)) = messages.next().now_or_never() {
                match item {
                    Ok(message) => held.push(message),
                    Err(error) => tracing::debug!(queue = %self.queue, error = %error,
                        "pull error while taking the held messages"),
                }
            }
        }
        held
    }

    fn stop_tasks(&self) {
        self.stop_tasks.send_replace(true);
    }
}

impl Subscription for JetStreamSubscription {
    type Delivery = JetStreamDelivery;
    type Settler = JetStreamSettler;

    fn settler(&self) -> Arc<JetStreamSettler> {
        Arc::clone(&self.settler)
    }

    async fn next(&mut self) -> Option<Result<JetStreamDelivery, AppError>> {
        loop {
            let next = self.messages.as_mut()?.next().await;
            match next? {
                Ok(message) => return Some(Ok(self.received(message))),
                Err(error) => match error.kind() {
                    // The stream ends after these.
                    MessagesErrorKind::ConsumerDeleted
                    | MessagesErrorKind::PushBasedConsumer
                    | MessagesErrorKind::RequestLimitExceeded => {
                        return Some(Err(AppError::broker(
                            format!("consuming {}", self.queue),
                            error,
                        )));
                    }
                    MessagesErrorKind::MissingHeartbeat
                    | MessagesErrorKind::Pull
                    | MessagesErrorKind::NoResponders
                    | MessagesErrorKind::Other => {
                        self.transient = self.transient.saturating_add(1);
                        if self.transient == 1 {
                            tracing::warn!(queue = %self.queue, error = %error,
                                "JetStream pull interrupted; waiting for the server");
                        } else {
                            tracing::debug!(queue = %self.queue, error = %error,
                                in_a_row = self.transient, "JetStream pull still interrupted");
                        }
                    }
                },
            }
        }
    }

    /// Takes what the pull stream already holds, to be handed back, and
    /// keeps the stream itself, unpolled, until [`Subscription::resume`].
    ///
    /// Not dropped: a pull request still open when the stream goes would
    /// send its messages to an inbox nobody reads, and they would come back
    /// only after `ack_wait` (measured: a store-outage pause lost one that
    /// way). Kept, the stream receives at most what the consumer's
    /// `max_ack_pending` (the prefetch) lets the server send, and those
    /// wait for the resume; a pause longer than `ack_wait` has them
    /// redelivered, and the inbox sorts out the copies.
    async fn pause(&mut self) -> Result<Vec<JetStreamDelivery>, AppError> {
        let held = self.take_ready();
        Ok(held
            .into_iter()
            .map(|message| self.received(message))
            .collect())
    }

    async fn resume(&mut self) -> Result<(), AppError> {
        if self.messages.is_none() {
            self.messages = Some(self.pull().await?);
        }
        Ok(())
    }

    /// Drops the pull stream for good, after `nak`ing (no delay) what it
    /// held and the worker never saw, so that another consumer gets those
    /// at once. A message the server was sending as it went reaches nobody
    /// and comes back after `ack_wait`.
    async fn stop(&mut self) {
        let held = self.take_ready();
        self.messages = None;
        for message in held {
            let Some(subject) = message.reply.clone() else {
                continue;
            };
            if let Err(error) = self
                .settler
                .client
                .publish(subject, AckKind::Nak(None).into())
                .await
            {
                tracing::debug!(queue = %self.queue, error = %error,
                    "handing back an unhandled message failed; it comes back after ack_wait");
            }
        }
    }

    async fn close(self) {
        self.stop_tasks();
        // Every delivery settled: the queued acks go out, then reach the
        // server before the connection closes.
        if let Some(Err(error)) = bounded("send the last JetStream acks", self.acker).await {
            tracing::error!(queue = %self.queue, error = %error, "the ack task failed");
        }
        self.ticker.abort();
        if let Some(Err(error)) =
            bounded("flush the NATS connection", self.settler.client.flush()).await
        {
            tracing::warn!(queue = %self.queue, error = %error,
                "flushing the last acks failed; their deliveries come back as duplicates");
        }
    }

    fn abandon(self) {
        // Queued acks cannot be trusted to go out: their deliveries come
        // back as duplicates.
        self.acker.abort();
        self.ticker.abort();
    }
}
