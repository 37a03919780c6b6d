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

/// A dead letter's reason, a header of its own on every broker.
pub const DEAD_LETTER_REASON: &str = "x-dead-letter-reason";
/// What went wrong, for a person (at most 1,000 bytes).
pub const DEAD_LETTER_DETAIL: &str = "x-dead-letter-detail";
/// The consumer that gave the message up.
pub const DEAD_LETTER_CONSUMER: &str = "x-dead-letter-consumer";
/// The queue the message was consumed from.
pub const DEAD_LETTER_QUEUE: &str = "x-dead-letter-queue";
/// The span of the attempt that dead-lettered the message (a W3C
/// `traceparent` value), so that a replay links back to it.
pub const DEAD_LETTER_TRACEPARENT: &str = "x-dead-letter-traceparent";
/// The failures the attempt ledger counted (an integer).
pub const INBOX_ATTEMPTS: &str = "x-inbox-attempts";
/// The last failure's error text.
pub const INBOX_LAST_ERROR: &str = "x-inbox-last-error";

/// How long a dead letter's detail may be: a header, not a log.
const DETAIL_LIMIT: usize = 1000;

/// One value of a dead letter's headers, in the two kinds every broker
/// can carry (AMQP as a long string or a 64-bit integer, NATS as text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeadLetterField<'a> {
    /// Text.
    Text(Cow<'a, str>),
    /// A count.
    Count(u64),
}

impl DeadLetter<'_> {
    /// The headers a dead letter adds to the message's own, by name: the
    /// one list every broker writes, so that a dead letter reads the same
    /// (and a replay strips the same names) whatever broker carried it.
    #[must_use]
    pub fn fields(&self) -> Vec<(&'static str, DeadLetterField<'_>)> {
        let text = |value: &str| DeadLetterField::Text(Cow::Owned(value.to_owned()));
        let mut fields = Vec::with_capacity(7);
        if let Some((attempts, last_error)) = self.failure {
            fields.push((INBOX_ATTEMPTS, DeadLetterField::Count(attempts)));
            fields.push((INBOX_LAST_ERROR, DeadLetterField::Text(last_error.into())));
        }
        fields.push((
            DEAD_LETTER_REASON,
            DeadLetterField::Text(self.reason.into()),
        ));
        fields.push((
            DEAD_LETTER_DETAIL,
            text(&crate::text::truncate(self.detail, DETAIL_LIMIT)),
        ));
        fields.push((
            DEAD_LETTER_CONSUMER,
            DeadLetterField::Text(self.consumer.into()),
        ));
        fields.push((DEAD_LETTER_QUEUE, DeadLetterField::Text(self.queue.into())));
        if let Some(traceparent) = &self.traceparent {
            fields.push((
                DEAD_LETTER_TRACEPARENT,
                DeadLetterField::Text(traceparent.as_str().into()),
            ));
        }
        fields
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letter_names_its_fields_once() {
        let detail = "x".repeat(2000);
        let letter = DeadLetter {
            reason: "retries_exhausted",
            detail: &detail,
            consumer: "payments",
            queue: "payments.q",
            failure: Some((3, "boom")),
            traceparent: Some("00-abc-def-01".into()),
        };
        let fields = letter.fields();
        let names: Vec<&str> = fields.iter().map(|(name, _)| *name).collect();
        assert_eq!(
            names,
            [
                INBOX_ATTEMPTS,
                INBOX_LAST_ERROR,
                DEAD_LETTER_REASON,
                DEAD_LETTER_DETAIL,
                DEAD_LETTER_CONSUMER,
                DEAD_LETTER_QUEUE,
                crate::trace::DEAD_LETTER_TRACEPARENT,
            ]
        );
        assert_eq!(fields[0].1, DeadLetterField::Count(3));
        match &fields[3].1 {
            DeadLetterField::Text(text) => {
                assert!(text.len() <= DETAIL_LIMIT + 3, "{}", text.len())
            }
            other => panic!("detail is text: {other:?}"),
        }
        let bad_input = DeadLetter {
            failure: None,
            traceparent: None,
            ..letter
        };
        assert_eq!(bad_input.fields().len(), 4);
    }
}
