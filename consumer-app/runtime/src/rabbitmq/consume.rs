//! A queue's RabbitMQ subscription (`basic.consume`) as a
//! [`Subscription`]: a consuming channel with its prefetch, the
//! [`AckTracker`] that records each delivery as it arrives and flushes the
//! coalesced acks, and the confirming channel its dead letters go out on.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use lapin::message::Delivery;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::{Channel, Connection};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::ack::{AckTracker, AmqpSettler};
use crate::AppError;
use crate::amqp::{close_channel_bounded, no_args, open_channel};
use crate::delivery::Subscription;

/// How long a paused consumer waits for its cancelled stream to end.
const PAUSE_DRAIN_LIMIT: Duration = Duration::from_secs(10);

/// One queue's subscription on a RabbitMQ connection.
pub(crate) struct AmqpSubscription {
    channel: Channel,
    queue: String,
    /// The consumer name, the first part of every consumer tag.
    consumer: String,
    deliveries: lapin::Consumer,
    tag: String,
    /// `false` once cancelled (a pause, a stop).
    active: bool,
    settler: Arc<AmqpSettler>,
    stop_flushing: watch::Sender<bool>,
    flusher: JoinHandle<()>,
}

impl AmqpSubscription {
    /// Opens the channels of `consumer`'s subscription to `queue` on
    /// `connection`, with `prefetch` unacked deliveries and acks flushed
    /// every `ack_flush` at the latest, and subscribes.
    ///
    /// # Errors
    /// The broker's.
    pub(crate) async fn open(
        connection: &Connection,
        queue: &str,
        consumer: &str,
        prefetch: u16,
        ack_flush: Duration,
    ) -> Result<Self, AppError> {
        let channel = open_channel(connection, "consumer channel").await?;
        let dead_letter_channel = open_channel(connection, "dead-letter channel").await?;
        dead_letter_channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| AppError::broker("enable confirms on the dead-letter channel", e))?;
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| AppError::broker("set prefetch", e))?;
        let settler = Arc::new(AmqpSettler {
            acks: Arc::new(AckTracker::new(prefetch)),
            dead_letter_channel,
        });
        let (deliveries, tag) = basic_consume(&channel, queue, consumer).await?;
        // The channel's waiting acks go out from here (see `ack`).
        let (stop_flushing, flushing) = watch::channel(false);
        let acks = Arc::clone(&settler.acks);
        let flusher = tokio::spawn(async move { acks.flush_loop(ack_flush, flushing).await });
        Ok(Self {
            channel,
            queue: queue.to_owned(),
            consumer: consumer.to_owned(),
            deliveries,
            tag,
            active: true,
            settler,
            stop_flushing,
            flusher,
        })
    }

    async fn cancel(&mut self) -> Result<(), AppError> {
        self.active = false;
        self.channel
            .basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default())
            .await
            .map_err(|e| AppError::broker(format!("cancel the consumer of {}", self.queue), e))
    }
}

/// `basic.consume` of `queue` under a fresh tag of `consumer`'s.
async fn basic_consume(
    channel: &Channel,
    queue: &str,
    consumer: &str,
) -> Result<(lapin::Consumer, String), AppError> {
    let tag = format!("{consumer}-{}", uuid::Uuid::new_v4().simple());
    let deliveries = channel
        .basic_consume(
            queue.into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            no_args(),
        )
        .await
        .map_err(|e| AppError::broker(format!("consume {queue}"), e))?;
    Ok((deliveries, tag))
}

impl Subscription for AmqpSubscription {
    type Delivery = Delivery;
    type Settler = AmqpSettler;

    fn settler(&self) -> Arc<AmqpSettler> {
        Arc::clone(&self.settler)
    }

    async fn next(&mut self) -> Option<Result<Delivery, AppError>> {
        match self.deliveries.next().await? {
            Ok(delivery) => {
                // Before anything can settle it: a multiple-ack must never
                // cover a delivery the tracker does not know.
                self.settler.acks.received(&delivery);
                Some(Ok(delivery))
            }
            Err(error) => Some(Err(AppError::broker(
                format!("consuming {}", self.queue),
                error,
            ))),
        }
    }

    /// Cancels the subscription; the cancel-ok ends the stream after the
    /// deliveries that came before it, which are returned. Bounded, in case
    /// it never comes.
    async fn pause(&mut self) -> Result<Vec<Delivery>, AppError> {
        self.cancel().await?;
        let mut sent = Vec::new();
        loop {
            match tokio::time::timeout(PAUSE_DRAIN_LIMIT, self.next()).await {
                Ok(Some(Ok(delivery))) => sent.push(delivery),
                Ok(Some(Err(error))) => return Err(error),
                Ok(None) => break,
                Err(_) => {
                    tracing::warn!(queue = %self.queue, limit = ?PAUSE_DRAIN_LIMIT,
                        "the cancelled consumer's stream did not end; going on");
                    // A delivery still on its way would not be in the
                    // tracker, and a multiple-ack could cover it unprocessed.
                    self.settler.acks.single_acks_only();
                    break;
                }
            }
        }
        Ok(sent)
    }

    async fn resume(&mut self) -> Result<(), AppError> {
        let (deliveries, tag) = basic_consume(&self.channel, &self.queue, &self.consumer).await?;
        self.deliveries = deliveries;
        self.tag = tag;
        self.active = true;
        Ok(())
    }

    async fn stop(&mut self) {
        if self.active
            && let Err(error) = self.cancel().await
        {
            tracing::warn!(queue = %self.queue, error = %crate::error::chain(&error),
                "cancelling the consumer failed");
        }
    }

    async fn close(self) {
        // Every delivery settled: the last waiting acks go out before the
        // channel closes (a closed channel would requeue them as duplicates).
        self.stop_flushing.send_replace(true);
        if let Err(error) = self.flusher.await {
            tracing::error!(queue = %self.queue, error = %error, "the ack flusher failed");
        }
        drop(self.deliveries);
        close_channel_bounded(&self.channel, "shutdown").await;
        close_channel_bounded(&self.settler.dead_letter_channel, "shutdown").await;
    }

    fn abandon(self) {
        // The channel is gone: waiting acks cannot go out, and their
        // deliveries come back as duplicates.
        self.flusher.abort();
    }
}
