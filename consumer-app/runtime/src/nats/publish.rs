//! Publishing to JetStream with the stream's acknowledgement, for the
//! dead letters and (later) the outbox relay: a message the stream did
//! not store is an error here, never a silent loss.
//!
//! The message id goes in `Nats-Msg-Id`, so a re-publish of the same
//! message within the stream's duplicate window (2 min by default) is
//! stored once and acknowledged as a duplicate: the relay's "published,
//! but the mark was lost" case costs nothing downstream.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use bytes::Bytes;

use super::names::{MESSAGE_TYPE, NATS_MSG_ID};

/// What the stream said of a stored message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Published {
    /// The stream that stored it.
    pub stream: String,
    /// Its sequence there (the first copy's, for a duplicate).
    pub sequence: u64,
    /// A copy of a message id the stream already had within its duplicate
    /// window: stored once, so nothing to do.
    pub duplicate: bool,
}

/// Why a publish was not confirmed.
#[derive(Debug, thiserror::Error)]
pub enum PublishFailure {
    /// JetStream refused this message for its own sake: no stream takes
    /// its subject (NATS' "no responders", AMQP's unroutable), it is larger
    /// than the server takes, or the stream answered with an error about
    /// it. Counts toward the message's dead-letter limit.
    #[error("refused by JetStream: {0}")]
    Refused(#[source] PublishError),
    /// No answer in time, or the connection broke: the server's or the
    /// network's state, shared by every message in flight, never charged.
    /// The message may be stored all the same; publishing it again under
    /// its id is a duplicate the stream drops.
    #[error("not confirmed by JetStream: {0}")]
    Unconfirmed(#[source] PublishError),
}

impl PublishFailure {
    pub(crate) fn of(error: PublishError) -> Self {
        match error.kind() {
            PublishErrorKind::StreamNotFound
            | PublishErrorKind::MaxPayloadExceeded
            | PublishErrorKind::WrongLastMessageId
            | PublishErrorKind::WrongLastSequence
            | PublishErrorKind::Other => Self::Refused(error),
            PublishErrorKind::TimedOut
            | PublishErrorKind::BrokenPipe
            | PublishErrorKind::MaxAckPending => Self::Unconfirmed(error),
        }
    }

    /// Whether the broker refused this message for its own sake (see
    /// [`PublishFailure::Refused`]).
    pub fn is_refusal(&self) -> bool {
        matches!(self, Self::Refused(_))
    }

    /// The `reason` label of a publish-failure metric.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Refused(_) => "refused",
            Self::Unconfirmed(_) => "unconfirmed",
        }
    }
}

/// Publishes `body` to `subject` (see [`super::names::subject`]) with
/// `headers`, its id in `Nats-Msg-Id`
/// and its type (if any) in [`MESSAGE_TYPE`], and waits for the stream's
/// acknowledgement: how a producer (and, next, the outbox relay) hands a
/// message to JetStream so that the consumers' inboxes know its id.
///
/// # Errors
/// [`PublishFailure`]: refused (the message's fault) or unconfirmed.
pub async fn publish_confirmed(
    js: &async_nats::jetstream::Context,
    subject: &str,
    message_id: &str,
    kind: Option<&str>,
    mut headers: HeaderMap,
    body: Vec<u8>,
) -> Result<Published, PublishFailure> {
    headers.insert(NATS_MSG_ID, message_id);
    if let Some(kind) = kind {
        headers.insert(MESSAGE_TYPE, kind);
    }
    send(js, subject.to_owned(), headers, body.into()).await
}

/// How long a publish acknowledgement may take before the publish counts
/// as unconfirmed: async-nats' own limit (the context's timeout, 5 s by
/// default) fires first; this only guards against one that never does.
const ACK_LIMIT: Duration = Duration::from_secs(10);

/// Publishes as it is (headers complete) and waits for the ack.
pub(crate) async fn send(
    js: &async_nats::jetstream::Context,
    subject: String,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Published, PublishFailure> {
    let pending = js
        .publish_with_headers(subject, headers, body)
        .await
        .map_err(PublishFailure::of)?;
    match tokio::time::timeout(ACK_LIMIT, pending.into_future()).await {
        Ok(Ok(ack)) => Ok(Published {
            stream: ack.stream,
            sequence: ack.sequence,
            duplicate: ack.duplicate,
        }),
        Ok(Err(error)) => Err(PublishFailure::of(error)),
        Err(_) => Err(PublishFailure::Unconfirmed(PublishError::new(
            PublishErrorKind::TimedOut,
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_stream_or_a_too_large_message_is_the_messages_fault() {
        for kind in [
            PublishErrorKind::StreamNotFound,
            PublishErrorKind::MaxPayloadExceeded,
            PublishErrorKind::Other,
        ] {
            assert!(
                PublishFailure::of(PublishError::new(kind)).is_refusal(),
                "{kind:?}"
            );
        }
        for kind in [
            PublishErrorKind::TimedOut,
            PublishErrorKind::BrokenPipe,
            PublishErrorKind::MaxAckPending,
        ] {
            assert!(
                !PublishFailure::of(PublishError::new(kind)).is_refusal(),
                "{kind:?}"
            );
        }
    }
}
