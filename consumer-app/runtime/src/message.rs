//! A delivery's parts the runtime reads: its message id, its type, its body,
//! and the headers the broker and the dead-letter path set.
//!
//! Everything that makes a delivery unprocessable forever is found here,
//! before any transaction opens, and named by a [`BadInputReason`] that ends
//! up in the dead-letter header and the `inbox_dead_lettered_total` metric.
//! A missing message id is refused rather than replaced by a fresh one: a
//! fresh id per delivery would silently turn deduplication off.

use std::fmt;

use inbox_api::MessageId;

use crate::delivery::{Delivery, Headers};

/// The UUID v5 namespace of [`follow_up_id`].
const FOLLOW_UP_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x847d_5bbe_20d9_4f4d_91b2_0662_9eea_7d5c);

/// The id of the message of type `message_type` that `consumer` sends
/// because of the message `cause` (consume-transform-produce): a UUID v5 of
/// the three, the same on every run of the handler.
///
/// Why not a fresh id: a handler whose transaction committed its outbox row
/// and then lost the answer, or one re-run after a crash, enqueues its
/// follow-up again; under the same id the second enqueue is
/// `AlreadyEnqueued`, and a copy that reached the broker anyway is
/// discarded by the next consumer's inbox. A fresh id per run would make
/// each copy a new message (iterate PR #1711). Including the consumer and
/// the type keeps the follow-ups of several consumers of one message, or
/// several kinds from one consumer, apart.
pub fn follow_up_id(
    cause: &MessageId,
    consumer: &inbox_api::ConsumerName,
    message_type: &str,
) -> MessageId {
    let mut name = Vec::with_capacity(16 + consumer.as_str().len() + message_type.len() + 2);
    name.extend_from_slice(cause.as_uuid().as_bytes());
    name.extend_from_slice(consumer.as_str().as_bytes());
    name.push(0);
    name.extend_from_slice(message_type.as_bytes());
    MessageId::from_uuid(uuid::Uuid::new_v5(&FOLLOW_UP_NAMESPACE, &name))
}

/// Why a delivery can never be processed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BadInputReason {
    /// No message id where the consumer's [`crate::identity::Identity`]
    /// reads it: deduplication is impossible.
    MissingMessageId,
    /// An id that is not a UUID (or, where keys are taken, an empty or
    /// oversized key, or a value of another kind).
    InvalidMessageId,
    /// A body that is not JSON.
    InvalidJson,
    /// JSON that is not the handler's message, or one its validation
    /// refuses.
    InvalidEvent,
    /// A missing AMQP `type` property, or one the handler does not take.
    UnknownType,
    /// A body over the configured maximum.
    Oversized,
}

impl BadInputReason {
    /// Every reason, for tests and docs.
    pub const ALL: [Self; 6] = [
        Self::MissingMessageId,
        Self::InvalidMessageId,
        Self::InvalidJson,
        Self::InvalidEvent,
        Self::UnknownType,
        Self::Oversized,
    ];

    /// The stable label in headers and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::MissingMessageId => "missing_message_id",
            Self::InvalidMessageId => "invalid_message_id",
            Self::InvalidJson => "invalid_json",
            Self::InvalidEvent => "invalid_event",
            Self::UnknownType => "unknown_type",
            Self::Oversized => "oversized",
        }
    }
}

impl fmt::Display for BadInputReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A delivery that can never be processed, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad input ({reason}): {detail}")]
pub struct BadInput {
    /// The class of the problem.
    pub reason: BadInputReason,
    /// A human-readable explanation (user text truncated).
    pub detail: String,
}

impl BadInput {
    /// A bad input of class `reason`.
    pub fn new(reason: BadInputReason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }
}

/// The parts of a delivery the validation reads: kept apart from any
/// broker's types so that the rules are unit-testable.
#[derive(Clone, Copy, Debug)]
pub struct RawMessage<'a> {
    /// The AMQP `message_id` property.
    pub message_id: Option<&'a str>,
    /// The AMQP `type` property.
    pub kind: Option<&'a str>,
    /// The headers, for an [`crate::identity::Identity::header`].
    pub headers: Option<&'a dyn Headers>,
    /// The body.
    pub body: &'a [u8],
}

impl<'a> RawMessage<'a> {
    /// The parts of `delivery`.
    pub fn of(delivery: &'a impl Delivery) -> Self {
        Self {
            message_id: delivery.message_id(),
            kind: delivery.kind(),
            headers: Some(delivery),
            body: delivery.body(),
        }
    }
}

pub use crate::text::truncate;

/// A header value as text, if it is a string.
pub fn header_text(headers: &impl Headers, name: &str) -> Option<String> {
    Some(headers.header(name)?.as_text()?.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_char_boundaries() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("ééé", 3), "é…");
    }
}
