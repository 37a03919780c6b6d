//! What a handler gets besides its message: the inbox transaction, who it
//! is, which message it handles, and [`Context::publish`], the outbox one
//! call away.
//!
//! A [`Context`] dereferences to the store's transaction, so a handler's
//! writes go through it as through the transaction itself (`&mut **cx`, or
//! [`Context::tx`]), and they commit with the inbox claim or not at all.

use std::ops::{Deref, DerefMut};

use inbox_api::{ConsumerName, EnqueueOutcome, MessageId, OutboxTransaction, OutgoingMessage};
use serde::Serialize;

use crate::AppError;
use crate::message::follow_up_id;

/// The header naming the message that caused a published event.
pub const CAUSATION_HEADER: &str = "causation_id";
/// The header naming the message a chain of events started from.
pub const CORRELATION_HEADER: &str = "correlation_id";

/// A message a handler publishes (or takes): its type says what it is
/// called on the wire.
///
/// ```
/// use inbox_runtime::Event;
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct OrderPlaced { order: u64 }
///
/// impl Event for OrderPlaced {
///     const TYPE: &'static str = "order.placed";
/// }
/// assert_eq!(OrderPlaced::ROUTING_KEY, "order.placed");
/// ```
pub trait Event: Serialize {
    /// The AMQP `type` property; consumers of this event take it by it.
    const TYPE: &'static str;
    /// The routing key it is published with: its type unless it says
    /// otherwise.
    const ROUTING_KEY: &'static str = Self::TYPE;
}

/// The handling of one message by one consumer, inside its inbox
/// transaction.
///
/// Built by the runtime for each attempt; a handler borrows it.
pub struct Context<'a, Tx> {
    tx: &'a mut Tx,
    message_id: MessageId,
    consumer: &'a ConsumerName,
    exchange: &'a str,
    /// How many events of each type this attempt has published, so that
    /// the second of a type gets an id of its own (and the same one again
    /// on every re-run).
    published: Vec<(&'static str, u32)>,
}

impl<'a, Tx> Context<'a, Tx> {
    /// The handling of `message_id` by `consumer` in `tx`, publishing to
    /// `exchange`.
    pub fn new(
        tx: &'a mut Tx,
        message_id: MessageId,
        consumer: &'a ConsumerName,
        exchange: &'a str,
    ) -> Self {
        Self {
            tx,
            message_id,
            consumer,
            exchange,
            published: Vec::new(),
        }
    }

    /// The id of the message being handled (the inbox key's first half,
    /// and a natural idempotency key for calls after the commit).
    pub fn message_id(&self) -> MessageId {
        self.message_id
    }

    /// The consumer handling it (the inbox key's second half).
    pub fn consumer(&self) -> &ConsumerName {
        self.consumer
    }

    /// The transaction, for a driver call that wants it by name.
    pub fn tx(&mut self) -> &mut Tx {
        self.tx
    }

    /// A context of a shorter life over the same transaction and message:
    /// what passes a `&mut Context` on to a function that takes one by
    /// value. Its publish count moves with it.
    pub fn reborrow(&mut self) -> Context<'_, Tx> {
        Context {
            tx: self.tx,
            message_id: self.message_id,
            consumer: self.consumer,
            exchange: self.exchange,
            published: std::mem::take(&mut self.published),
        }
    }

    /// The id of the next event of type `message_type`: the same on every
    /// run of the handler, so a retried handler enqueues the same row and a
    /// copy that reached the broker is discarded by the next inbox.
    fn next_id(&mut self, message_type: &'static str) -> MessageId {
        let count = match self.published.iter_mut().find(|(t, _)| *t == message_type) {
            Some((_, n)) => {
                *n += 1;
                *n
            }
            None => {
                self.published.push((message_type, 0));
                0
            }
        };
        if count == 0 {
            follow_up_id(&self.message_id, self.consumer, message_type)
        } else {
            follow_up_id(
                &self.message_id,
                self.consumer,
                &format!("{message_type}#{count}"),
            )
        }
    }
}

impl<Tx: OutboxTransaction> Context<'_, Tx> {
    /// Writes `event` to the outbox in this transaction: the relay
    /// publishes it to the service's exchange, with [`Event::ROUTING_KEY`]
    /// and [`Event::TYPE`], iff the transaction commits.
    ///
    /// Its id is derived from the message being handled, the consumer and
    /// the event's type (and, for the second and later event of one type in
    /// one handling, its index), so a handler that runs again after a
    /// failure enqueues the same message. The causation and correlation
    /// headers name the message being handled; with the `otel` feature the
    /// W3C trace context of the handling continues the trace
    /// ([`crate::trace`]).
    ///
    /// # Errors
    /// A store error from the enqueue (classified like any); a body that
    /// does not serialise is the handler's permanent failure.
    pub async fn publish<E: Event + Sync>(&mut self, event: &E) -> Result<MessageId, AppError> {
        let body = serde_json::to_vec(event).map_err(|e| {
            inbox_api::InboxError::permanent_handler(format!(
                "cannot serialise the {} event: {e}",
                E::TYPE
            ))
        })?;
        let id = self.next_id(E::TYPE);
        let cause = self.message_id.to_string();
        let message = OutgoingMessage::new(id, self.exchange, E::ROUTING_KEY, E::TYPE, body)?
            .with_header(CAUSATION_HEADER, cause.clone())?
            .with_header(CORRELATION_HEADER, cause)?;
        let message = crate::trace::with_current_context(message)?;
        if self.tx.enqueue(&message).await? == EnqueueOutcome::AlreadyEnqueued {
            // Only a message handled twice gets here, which the claim in
            // front rules out: worth a line if it ever happens.
            tracing::warn!(message_id = %self.message_id, consumer = %self.consumer,
                follow_up = %id, "the event was enqueued before; the first copy stands");
        }
        Ok(id)
    }
}

impl<Tx> Deref for Context<'_, Tx> {
    type Target = Tx;

    fn deref(&self) -> &Tx {
        self.tx
    }
}

impl<Tx> DerefMut for Context<'_, Tx> {
    fn deref_mut(&mut self) -> &mut Tx {
        self.tx
    }
}
