//! A delivery as the runtime reads it, whatever the broker delivered it.
//!
//! The message path (decode, identity, the inbox key, the settle decision,
//! the trace) needs six things of a delivery: its message id, its type, a
//! header by name, its body, whether the broker delivered it before, and
//! the broker's count of earlier deliveries. [`Delivery`] is those six and
//! nothing else, so that the path is written once above every broker:
//! RabbitMQ's delivery implements it in [`crate::amqp`]. Headers are read
//! through [`Headers`], a lookup that gives text or an integer, the two
//! kinds a producer in any language can put in a header. What the runtime
//! then tells the broker about a delivery goes through a [`Settler`], and
//! deliveries come from a queue's [`Subscription`].

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;

use crate::AppError;

/// A header's value, in the two kinds a message id or a trace context can
/// be read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeaderValue<'a> {
    /// A string (invalid UTF-8 replaced).
    Text(Cow<'a, str>),
    /// An integer of any width the broker's wire format has.
    Integer(i128),
    /// A value of another kind (a boolean, a float, a table): there, but
    /// neither text nor an integer.
    Other,
}

impl HeaderValue<'_> {
    /// The value as text, if it is text.
    #[must_use]
    pub fn as_text(&self) -> Option<&str> {
        match self {
            Self::Text(text) => Some(text),
            Self::Integer(_) | Self::Other => None,
        }
    }

    /// The value as a count, if it is a non-negative integer.
    #[must_use]
    pub fn as_count(&self) -> Option<u64> {
        match self {
            Self::Integer(value) => u64::try_from(*value).ok(),
            Self::Text(_) | Self::Other => None,
        }
    }
}

/// A delivery's headers, looked up by name.
pub trait Headers: Send + Sync + std::fmt::Debug {
    /// The value of the header `name`, if it is there.
    fn header(&self, name: &str) -> Option<HeaderValue<'_>>;
}

/// What the runtime reads of a delivery.
pub trait Delivery: Headers + Send + Sync + 'static {
    /// The message id the producer set, if any (AMQP's `message_id`).
    fn message_id(&self) -> Option<&str>;
    /// The message's type, if any (AMQP's `type`), which picks the handler.
    fn kind(&self) -> Option<&str>;
    /// The body.
    fn body(&self) -> &[u8];
    /// Whether the broker delivered this message before (to anyone).
    fn redelivered(&self) -> bool;
    /// The broker's count of earlier deliveries of this message, 0 where
    /// the broker keeps none: only a fallback for the attempt ledger's
    /// count (see [`crate::settle`]).
    fn earlier_deliveries(&self) -> u64;
}

/// How one delivery is settled on its broker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Done: the broker forgets the message (AMQP `basic.ack`).
    Ack,
    /// Back to the queue, "not the message's fault": not counted as a
    /// failure where the broker tells the two apart (AMQP `basic.nack`
    /// with requeue, which RabbitMQ 4.3 does not count in a quorum queue's
    /// `x-delivery-count`).
    Requeue,
    /// Back to the queue, "this message failed": counted by the broker
    /// (AMQP `basic.reject` with requeue, which every RabbitMQ counts).
    RequeueFailed,
    /// Given up, to the broker's own dead-lettering if it has one (AMQP
    /// `basic.reject` without requeue): the fallback when a dead letter of
    /// ours could not be published.
    Reject,
    /// Back to the queue uncharged because the store is away: kept apart
    /// from [`Frame::Requeue`], which is for the message's own failures.
    Release,
}

/// What a dead letter says besides the message itself: why, where from,
/// and for a decoded message that failed, its count and last error.
#[derive(Clone, Debug)]
pub struct DeadLetter<'a> {
    /// The stable reason label (`retries_exhausted`, `invalid_json`, ...).
    pub reason: &'a str,
    /// What went wrong, for a person.
    pub detail: &'a str,
    /// The consumer that gave up.
    pub consumer: &'a str,
    /// The queue the delivery came from.
    pub queue: &'a str,
    /// The failures the attempt ledger counted and the last error, for a
    /// message that failed (none for bad input or a conflict).
    pub failure: Option<(u64, &'a str)>,
    /// The `traceparent` of the attempt that gave up, so that a replay
    /// links back to it.
    pub traceparent: Option<String>,
}

/// Settles one consumer's deliveries on the broker they came from.
///
/// The worker decides (see [`crate::settle`]); a settler only says it to
/// its broker, so that the decision is written once above every broker.
pub trait Settler: Send + Sync + 'static {
    /// The deliveries it settles.
    type Delivery: Delivery;

    /// Acks deliveries whose transactions committed. The broker may get
    /// the acks later, coalesced; one that never goes out (the process or
    /// the connection died) means a redelivery the inbox answers with
    /// `Duplicate`.
    fn ack_later(&self, deliveries: &[&Self::Delivery]);

    /// Settles one delivery now (an [`Frame::Ack`] may wait as
    /// [`Settler::ack_later`]'s do).
    ///
    /// # Errors
    /// The broker's, when the frame could not be sent: the broker
    /// redelivers when the connection closes.
    fn settle<'a>(
        &'a self,
        delivery: &'a Self::Delivery,
        frame: Frame,
    ) -> BoxFuture<'a, Result<(), AppError>>;

    /// Moves `delivery` to its queue's dead letters with `letter`, then
    /// settles it; where the dead letter cannot be published, hands it to
    /// the broker's own dead-lettering without the reason
    /// ([`Frame::Reject`]).
    ///
    /// # Errors
    /// The broker's, when the delivery could not be settled at all: the
    /// broker redelivers it.
    fn dead_letter<'a>(
        &'a self,
        delivery: &'a Self::Delivery,
        letter: &'a DeadLetter<'a>,
    ) -> BoxFuture<'a, Result<(), AppError>>;
}

/// One queue's subscription on a broker: its deliveries in order, and a
/// pause for store outages.
///
/// The consuming loop (prefetch, concurrency, batching, the outage pause,
/// shutdown) is written once above it. Whatever bookkeeping the broker
/// needs before a delivery can be settled (RabbitMQ's tracker of unsettled
/// tags) happens in [`Subscription::next`].
pub trait Subscription: Send + 'static {
    /// Its deliveries.
    type Delivery: Delivery;
    /// What settles them.
    type Settler: Settler<Delivery = Self::Delivery>;

    /// The settler of this subscription's deliveries.
    fn settler(&self) -> Arc<Self::Settler>;

    /// The next delivery; `None` when the broker ended the subscription.
    fn next(&mut self) -> impl Future<Output = Option<Result<Self::Delivery, AppError>>> + Send;

    /// Stops the broker's deliveries and returns those it had already
    /// sent, for the caller to hand back.
    ///
    /// # Errors
    /// The broker's: the subscription is then lost.
    fn pause(&mut self) -> impl Future<Output = Result<Vec<Self::Delivery>, AppError>> + Send;

    /// Starts the deliveries again after [`Subscription::pause`].
    ///
    /// # Errors
    /// The broker's.
    fn resume(&mut self) -> impl Future<Output = Result<(), AppError>> + Send;

    /// Stops the broker's deliveries for good, before a graceful close
    /// (deliveries in flight still settle).
    fn stop(&mut self) -> impl Future<Output = ()> + Send;

    /// Closes the subscription once every delivery settled: what waits to
    /// go out (coalesced acks) goes out first.
    fn close(self) -> impl Future<Output = ()> + Send;

    /// Drops the subscription after a broker failure: nothing can go out
    /// any more, and the broker redelivers what was not settled.
    fn abandon(self);
}
