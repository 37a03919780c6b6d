//! Settling deliveries on the broker, and the tag bookkeeping that lets
//! acks go out coalesced.
//!
//! **Why coalesce.** An ack is a frame through lapin's RPC task and its I/O
//! thread, and a wake-up of each: profiled per message (strace, 1 task),
//! the runtime made about 27 futex calls per delivery where the
//! database-only inbox makes under one, and the broker handles one ack
//! method per delivery. So a committed delivery's ack is not sent by its
//! worker: it waits in its channel's [`AckTracker`] until half the prefetch
//! is waiting, `ack_flush` has passed, or the consumer stops, and then goes
//! out with the others in one `basic.ack(multiple)` where the tags allow.
//! The guarantee is unchanged: a delivery is acked only after its
//! transaction committed; an ack still waiting when the process dies or the
//! channel closes is never sent, the broker redelivers, and the inbox
//! answers `Duplicate`.
//!
//! **Multiple-ack.** `basic.ack(tag, multiple = true)` settles *every*
//! unsettled delivery of the channel up to `tag`, including those still
//! being handled. So every delivery of a consuming channel is recorded as
//! received, in delivery order ([`AckTracker::received`]), and a flush acks
//! with one multiple-ack only the waiting tags below the lowest tag still
//! unsettled (they are contiguous among the channel's unsettled tags), and
//! the rest one by one. Nacks and rejects go out at once, under the same
//! lock as the flush's frames, so a multiple-ack never covers a tag settled
//! otherwise later, and nothing is settled twice (RabbitMQ closes the
//! channel on a double settle).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::Mutex as SyncMutex;
use std::time::Duration;

use lapin::Acker;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use tokio::sync::{Mutex, Notify, watch};

use futures::future::BoxFuture;
use lapin::Channel;
use lapin::types::{AMQPValue, FieldTable};

use crate::AppError;
use crate::amqp::{Publisher, long_string};
pub(crate) use crate::delivery::Frame;
use crate::delivery::{DeadLetter, DeadLetterField, Settler};
use crate::topology::Topology;

/// The unsettled delivery tags of one consuming channel, and the acks
/// waiting to go out.
#[derive(Debug)]
pub(crate) struct AckTracker {
    tags: SyncMutex<Tags>,
    /// Held while frames go out: a flush's view of the unsettled tags stays
    /// true until its frames are on their way.
    sending: Mutex<()>,
    /// The first ack waits (the flush timer starts).
    waiting: Notify,
    /// Enough acks wait to flush at once.
    full: Notify,
    /// Waiting acks that flush at once.
    flush_at: usize,
}

#[derive(Debug, Default)]
struct Tags {
    /// Received, not yet decided.
    unsettled: BTreeSet<u64>,
    /// Decided to ack (committed), not yet sent.
    pending: BTreeMap<u64, Acker>,
    /// Set when a delivery may have escaped [`AckTracker::received`] (a
    /// cancelled consumer's stream that did not end): no multiple-ack then,
    /// since it could cover that delivery.
    single_only: bool,
}

impl AckTracker {
    /// A tracker for a channel with `prefetch` unacked deliveries: half of
    /// them waiting flush at once, so that waiting acks never stall the
    /// broker's deliveries.
    pub(crate) fn new(prefetch: u16) -> Self {
        Self {
            tags: SyncMutex::default(),
            sending: Mutex::new(()),
            waiting: Notify::new(),
            full: Notify::new(),
            flush_at: usize::from(prefetch / 2).max(1),
        }
    }

    fn tags(&self) -> std::sync::MutexGuard<'_, Tags> {
        // A panic while holding it leaves plain sets, still consistent.
        self.tags
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a delivery as received; called in delivery order by the
    /// consuming loop, before anything can settle it.
    pub(crate) fn received(&self, delivery: &Delivery) {
        self.tags().unsettled.insert(delivery.delivery_tag);
    }

    /// Forbids multiple-acks on this channel from now on (see
    /// [`Tags::single_only`]).
    pub(crate) fn single_acks_only(&self) {
        self.tags().single_only = true;
    }

    /// Settles one delivery now with a nack or reject (an ack waits: see
    /// [`AckTracker::ack_later`]).
    pub(crate) async fn settle(
        &self,
        delivery: &Delivery,
        how: Frame,
    ) -> Result<bool, lapin::Error> {
        if how == Frame::Ack {
            self.ack_later(&[delivery]);
            return Ok(true);
        }
        let _sending = self.sending.lock().await;
        self.tags().unsettled.remove(&delivery.delivery_tag);
        settle_one(&delivery.acker, how, false).await
    }

    /// Queues the acks of committed deliveries; they go out with the next
    /// flush.
    pub(crate) fn ack_later(&self, deliveries: &[&Delivery]) {
        if deliveries.is_empty() {
            return;
        }
        let waiting = {
            let mut tags = self.tags();
            for delivery in deliveries {
                tags.unsettled.remove(&delivery.delivery_tag);
                tags.pending
                    .insert(delivery.delivery_tag, delivery.acker.clone());
            }
            tags.pending.len()
        };
        self.waiting.notify_one();
        if waiting >= self.flush_at {
            self.full.notify_one();
        }
    }

    /// Sends the waiting acks: those below every unsettled tag of the
    /// channel with a single multiple-ack, the others one by one. Returns
    /// how many `basic.ack` frames went out.
    pub(crate) async fn flush(&self) -> usize {
        let _sending = self.sending.lock().await;
        let (below, above) = {
            let mut tags = self.tags();
            let pending = std::mem::take(&mut tags.pending);
            let lowest_other = match (tags.single_only, tags.unsettled.first()) {
                (true, _) => 0,
                (false, Some(&lowest)) => lowest,
                (false, None) => u64::MAX,
            };
            let mut below = pending;
            let above = below.split_off(&lowest_other);
            (below, above)
        };
        let fail = |error: lapin::Error, tag: u64| {
            // The channel is gone: the broker redelivers, and the inbox
            // answers Duplicate because the transaction committed.
            tracing::warn!(tag, error = %error,
                "ack failed after commit; the redelivery will be a duplicate");
        };
        let mut frames = 0;
        let acked = below.len() + above.len();
        // Every unsettled tag up to the last of `below` is one of `below`.
        if let Some((&tag, acker)) = below.last_key_value() {
            frames += 1;
            if let Err(error) = settle_one(acker, Frame::Ack, below.len() > 1).await {
                fail(error, tag);
            }
        }
        for (tag, acker) in above {
            frames += 1;
            if let Err(error) = settle_one(&acker, Frame::Ack, false).await {
                fail(error, tag);
            }
        }
        if frames > 0 {
            tracing::trace!(acked, frames, "acks flushed");
        }
        frames
    }

    /// Flushes waiting acks `every` after the first of them waits, or at
    /// once when half the prefetch waits, until `stop`; then a last time.
    pub(crate) async fn flush_loop(&self, every: Duration, mut stop: watch::Receiver<bool>) {
        loop {
            tokio::select! {
                biased;
                _ = stop.wait_for(|stop| *stop) => break,
                () = self.waiting.notified() => {}
            }
            tokio::select! {
                biased;
                _ = stop.wait_for(|stop| *stop) => break,
                () = self.full.notified() => {}
                () = tokio::time::sleep(every) => {}
            }
            self.flush().await;
        }
        self.flush().await;
    }
}

/// The RabbitMQ [`Settler`] of one consuming channel: acks through its
/// [`AckTracker`], dead letters published to the queue's dead-letter
/// exchange on a channel of their own in confirm mode.
pub(crate) struct AmqpSettler {
    /// The consuming channel's unsettled tags and waiting acks.
    pub(crate) acks: Arc<AckTracker>,
    /// A channel in confirm mode, for dead-letter publishes.
    pub(crate) dead_letter_channel: Channel,
}

impl Settler for AmqpSettler {
    type Delivery = Delivery;

    fn ack_later(&self, deliveries: &[&Delivery]) {
        self.acks.ack_later(deliveries);
    }

    fn settle<'a>(
        &'a self,
        delivery: &'a Delivery,
        frame: Frame,
    ) -> BoxFuture<'a, Result<(), AppError>> {
        Box::pin(async move {
            self.acks
                .settle(delivery, frame)
                .await
                .map(drop)
                .map_err(|e| AppError::broker(format!("{frame:?} of a delivery"), e))
        })
    }

    fn dead_letter<'a>(
        &'a self,
        delivery: &'a Delivery,
        letter: &'a DeadLetter<'a>,
    ) -> BoxFuture<'a, Result<(), AppError>> {
        Box::pin(async move {
            let properties = delivery
                .properties
                .clone()
                .with_headers(dead_letter_headers(
                    delivery.properties.headers().as_ref(),
                    letter,
                ));
            let published = Publisher::publish_raw(
                &self.dead_letter_channel,
                &Topology::dead_letter_exchange(letter.queue),
                letter.queue,
                &delivery.data,
                properties,
            )
            .await;
            match published {
                Ok(()) => {
                    if let Err(error) = self.settle(delivery, Frame::Ack).await {
                        // Published but not acked: the redelivery will be
                        // dead-lettered again (bad input) or find its row.
                        tracing::warn!(error = %error, "ack after dead-letter publish failed");
                    }
                    Ok(())
                }
                Err(error) => {
                    tracing::warn!(error = %crate::error::chain(&error), reason = letter.reason,
                        "dead-letter publish failed; rejecting into the queue's dead-letter exchange without the reason");
                    self.settle(delivery, Frame::Reject).await
                }
            }
        })
    }
}

/// A dead letter's headers: the message's own, without the broker's count
/// (it belongs to this queue's delivery; a replay from the dead-letter
/// queue is a new delivery with a fresh count), with `letter`'s
/// ([`DeadLetter::fields`]).
fn dead_letter_headers(original: Option<&FieldTable>, letter: &DeadLetter<'_>) -> FieldTable {
    let mut headers: FieldTable = original
        .map(|headers| {
            let mut inner = headers.inner().clone();
            inner.remove("x-delivery-count");
            inner
        })
        .unwrap_or_default()
        .into();
    for (name, value) in letter.fields() {
        let value = match value {
            DeadLetterField::Text(text) => long_string(&text),
            DeadLetterField::Count(count) => {
                AMQPValue::LongLongInt(i64::try_from(count).unwrap_or(i64::MAX))
            }
        };
        headers.insert(name.into(), value);
    }
    headers
}

/// Settles one delivery directly on its channel (`multiple` for an ack
/// covering every unsettled tag up to this one).
pub(crate) async fn settle_one(
    acker: &Acker,
    how: Frame,
    multiple: bool,
) -> Result<bool, lapin::Error> {
    match how {
        Frame::Ack => acker.ack(BasicAckOptions { multiple }).await,
        Frame::Requeue | Frame::Release => {
            acker
                .nack(BasicNackOptions {
                    multiple: false,
                    requeue: true,
                })
                .await
        }
        Frame::RequeueFailed => acker.reject(BasicRejectOptions { requeue: true }).await,
        Frame::Reject => acker.reject(BasicRejectOptions { requeue: false }).await,
    }
}
