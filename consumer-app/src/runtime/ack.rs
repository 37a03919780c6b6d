//! Settling deliveries on the broker, and the tag bookkeeping batched mode
//! needs for it.
//!
//! **Multiple-ack.** `basic.ack(tag, multiple = true)` settles *every*
//! unsettled delivery of the channel up to `tag`, including those of other
//! batches still in flight on the same channel. So a batched channel's
//! unsettled tags are tracked ([`AckTracker`]): a batch acks with one
//! multiple-ack the tags below the lowest tag still unsettled elsewhere
//! (they are contiguous among the channel's unsettled tags), and the rest
//! one by one. Every settle (ack, nack, reject) of a batched channel goes
//! through the tracker, under its lock, so a multiple-ack never covers a tag
//! that something else settles later (RabbitMQ closes the channel on a
//! double settle).

use std::collections::BTreeSet;

use futures::{Stream, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use tokio::sync::{Mutex, watch};

use crate::runtime::AppError;
use crate::runtime::config::BatchConfig;

/// The frame one delivery is settled with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Frame {
    /// `basic.ack`.
    Ack,
    /// `basic.nack` with requeue: "not the message's fault", which does not
    /// raise a quorum queue's delivery count on RabbitMQ 4.3 and later.
    Requeue,
    /// `basic.reject` with requeue: "this message failed", which every
    /// RabbitMQ version counts in a quorum queue's `x-delivery-count`.
    RequeueFailed,
    /// `basic.reject` without requeue (to the queue's dead-letter exchange).
    Reject,
    /// `basic.nack` with requeue, for a delivery handed back uncharged
    /// because the store is away: kept apart from [`Frame::Requeue`], which
    /// is for the message's own failures.
    Release,
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
        how: Frame,
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
                if let Err(error) = settle_one(one, Frame::Ack, false).await {
                    fail(error, one.delivery_tag);
                }
            }
            [.., last] => {
                // Every unsettled tag up to `last` is one of ours.
                frames += 1;
                if let Err(error) = settle_one(last, Frame::Ack, true).await {
                    fail(error, last.delivery_tag);
                }
            }
        }
        for delivery in above {
            frames += 1;
            if let Err(error) = settle_one(delivery, Frame::Ack, false).await {
                fail(error, delivery.delivery_tag);
            }
        }
        frames
    }
}

/// Settles one delivery directly on its channel (`multiple` for an ack
/// covering every unsettled tag up to this one).
pub(crate) async fn settle_one(
    delivery: &Delivery,
    how: Frame,
    multiple: bool,
) -> Result<bool, lapin::Error> {
    match how {
        Frame::Ack => delivery.ack(BasicAckOptions { multiple }).await,
        Frame::Requeue | Frame::Release => {
            delivery
                .nack(BasicNackOptions {
                    multiple: false,
                    requeue: true,
                })
                .await
        }
        Frame::RequeueFailed => delivery.reject(BasicRejectOptions { requeue: true }).await,
        Frame::Reject => delivery.reject(BasicRejectOptions { requeue: false }).await,
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
