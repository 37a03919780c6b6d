//! A JetStream message read as a [`Delivery`]: its id is JetStream's own
//! `Nats-Msg-Id` (the header its duplicate window deduplicates on, so the
//! broker and the inbox agree on what "the same message" is), its type the
//! [`MESSAGE_TYPE`] header, its counts from the ack subject's metadata.

use std::borrow::Cow;

use async_nats::{HeaderMap, Subject};

use super::names::{MESSAGE_TYPE, NATS_MSG_ID};
use crate::delivery::{Delivery, HeaderValue, Headers};

/// One JetStream delivery, with what its ack subject says about it.
#[derive(Debug)]
pub(crate) struct JetStreamDelivery {
    /// The message as it came (subject, reply = the ack subject, headers,
    /// body).
    pub(crate) message: async_nats::Message,
    /// The server's count of deliveries of this message to this consumer,
    /// this one included.
    pub(crate) delivered: u64,
    /// The stream the message is stored in.
    pub(crate) stream: String,
    /// Its sequence there.
    pub(crate) stream_sequence: u64,
}

impl JetStreamDelivery {
    /// Reads a pulled message's metadata from its ack subject.
    pub(crate) fn new(message: async_nats::jetstream::Message) -> Self {
        let (delivered, stream, stream_sequence) = match message.info() {
            Ok(info) => (
                u64::try_from(info.delivered).unwrap_or(1),
                info.stream.to_owned(),
                info.stream_sequence,
            ),
            Err(error) => {
                // Only a message without a JetStream ack subject: settling
                // it will fail, and the broker redelivers it.
                tracing::warn!(subject = %message.subject, error = %error,
                    "a JetStream delivery without metadata");
                (1, String::new(), 0)
            }
        };
        Self {
            message: message.message,
            delivered,
            stream,
            stream_sequence,
        }
    }

    /// The subject its settlement goes to (`$JS.ACK...`).
    pub(crate) fn ack_subject(&self) -> Option<&Subject> {
        self.message.reply.as_ref()
    }

    /// A header's text, by its exact name or, failing that, by its name in
    /// any case.
    pub(crate) fn header_str(&self, name: &str) -> Option<&str> {
        lookup(self.message.headers.as_ref()?, name)
    }
}

/// `name`'s first value in `headers`. Exact first (NATS header names keep
/// their case, and JetStream's own are matched exactly); then in any case,
/// because a producer writing through an HTTP-minded library may change
/// the case, and a header that is there should not read as missing.
/// Iterates rather than calling `HeaderMap::get`, which panics on a name
/// with characters a header may not have, and a header name to look up
/// may come from a user's configuration.
pub(crate) fn lookup<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    let first = |values: &'a Vec<async_nats::HeaderValue>| values.first().map(|v| v.as_str());
    headers
        .iter()
        .find(|(key, _)| AsRef::<str>::as_ref(*key) == name)
        .and_then(|(_, values)| first(values))
        .or_else(|| {
            headers
                .iter()
                .find(|(key, _)| AsRef::<str>::as_ref(*key).eq_ignore_ascii_case(name))
                .and_then(|(_, values)| first(values))
        })
}

impl Headers for JetStreamDelivery {
    /// NATS headers are text only: a value that looks like an integer is
    /// still [`HeaderValue::Text`]. The runtime's readers accept both kinds
    /// where an integer makes sense (an id by header is its decimal text
    /// either way), so the meaning is AMQP's.
    fn header(&self, name: &str) -> Option<HeaderValue<'_>> {
        self.header_str(name)
            .map(|text| HeaderValue::Text(Cow::Borrowed(text)))
    }
}

impl Delivery for JetStreamDelivery {
    fn message_id(&self) -> Option<&str> {
        self.header_str(NATS_MSG_ID).filter(|id| !id.is_empty())
    }

    fn kind(&self) -> Option<&str> {
        self.header_str(MESSAGE_TYPE)
            .filter(|kind| !kind.is_empty())
    }

    fn body(&self) -> &[u8] {
        &self.message.payload
    }

    fn redelivered(&self) -> bool {
        self.delivered > 1
    }

    /// Every earlier delivery to this consumer, whether or not it was the
    /// message's fault (a `nak` of a hand-back counts too): only the
    /// attempt ledger's fallback, see [`crate::settle`].
    fn earlier_deliveries(&self) -> u64 {
        self.delivered.saturating_sub(1)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A delivery as a test makes it.
    pub(crate) fn delivery(headers: &[(&str, &str)], delivered: u64) -> JetStreamDelivery {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.insert(*name, *value);
        }
        JetStreamDelivery {
            message: async_nats::Message {
                subject: "shop.order.placed".into(),
                reply: Some("$JS.ACK.shop.payments.1.7.7.0.0".into()),
                payload: "{}".into(),
                headers: Some(map),
                status: None,
                description: None,
                length: 0,
            },
            delivered,
            stream: "shop".into(),
            stream_sequence: 7,
        }
    }

    #[test]
    fn the_id_and_type_are_headers() {
        let d = delivery(
            &[
                ("Nats-Msg-Id", "m-1"),
                ("Inbox-Message-Type", "order.placed"),
            ],
            1,
        );
        assert_eq!(d.message_id(), Some("m-1"));
        assert_eq!(d.kind(), Some("order.placed"));
        assert!(!d.redelivered());
        assert_eq!(d.earlier_deliveries(), 0);
        let none = delivery(&[("Nats-Msg-Id", "")], 3);
        assert_eq!(none.message_id(), None);
        assert_eq!(none.kind(), None);
        assert!(none.redelivered());
        assert_eq!(none.earlier_deliveries(), 2);
    }

    #[test]
    fn headers_are_text_found_in_any_case() {
        let d = delivery(&[("x-order-key", "42"), ("X-Other", "a")], 1);
        assert_eq!(
            d.header("x-order-key"),
            Some(HeaderValue::Text("42".into()))
        );
        assert_eq!(
            d.header("X-ORDER-KEY"),
            Some(HeaderValue::Text("42".into()))
        );
        assert_eq!(d.header("x-other"), Some(HeaderValue::Text("a".into())));
        // Integer-looking text is text, not a count.
        assert_eq!(d.header("x-order-key").and_then(|v| v.as_count()), None);
        assert_eq!(d.header("missing"), None);
        // A name no header may have is simply absent, never a panic.
        assert_eq!(d.header("bad:name\r\n"), None);
    }

    #[test]
    fn a_header_id_reads_like_amqp() {
        let d = delivery(&[("x-event-id", "A-1")], 1);
        let raw = crate::message::RawMessage {
            message_id: None,
            kind: None,
            headers: Some(&d as &dyn Headers),
            body: b"{}",
        };
        let id = crate::Identity::header("x-event-id")
            .accept_keys()
            .of(&raw, None);
        assert!(id.is_ok(), "{id:?}");
    }
}
