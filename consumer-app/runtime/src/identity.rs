//! Where a consumer's message id comes from: [`Identity`].
//!
//! The inbox deduplicates on `(message id, consumer)`, so the id must be the
//! one the producer reuses on every retry of the same message. Producers
//! differ in where they put it: the AMQP `message_id` property (the
//! default, and what the runtime's own relay sets), a header of their own,
//! a field of the body (an order number), or nowhere at all. A consumer
//! names the place once, in [`crate::Handler::identity`], and every
//! delivery's id is read from there.
//!
//! Ids that are not UUIDs are refused unless the consumer accepts keys
//! ([`Identity::accept_keys`]): then a key is mapped to a UUID by
//! [`MessageId::from_key`], a documented UUID v5 that is the same on every
//! store and every version, so an existing producer's ids work unchanged.
//! A missing or unusable id is bad input (`missing_message_id`,
//! `invalid_message_id`), dead-lettered before any transaction opens: a
//! fresh id in its place would turn deduplication off without a word.

use std::fmt;

use inbox_api::MessageId;

use crate::delivery::HeaderValue;
use crate::message::{BadInput, BadInputReason, RawMessage, truncate};

/// Where a delivery's message id is read, and whether ids that are not
/// UUIDs are taken. [`Identity::message_id`] is the default.
///
/// ```
/// use inbox_runtime::identity::Identity;
///
/// // The producer puts its order number in the body: {"order_id": 1042, ...}
/// let by_order = Identity::body_field("order_id").accept_keys();
/// // A producer that sets a header of its own.
/// let by_header = Identity::header("x-event-id");
/// // A producer that sends no id: the body itself names the message.
/// let by_content = Identity::content_hash();
/// # let _ = (by_order, by_header, by_content);
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Identity {
    source: Source,
    keys: bool,
}

#[derive(Clone, PartialEq, Eq)]
enum Source {
    MessageId,
    Header(String),
    /// A JSON pointer into the body.
    BodyField(String),
    ContentHash,
}

/// The default [`Identity`], for [`crate::Handler::identity`]'s default.
pub(crate) static DEFAULT: Identity = Identity::message_id();

impl Identity {
    /// The AMQP `message_id` property, a UUID (the runtime's relay sets
    /// it to the outbox row's id). The default.
    pub const fn message_id() -> Self {
        Self {
            source: Source::MessageId,
            keys: false,
        }
    }

    /// The header `name`, a string or an integer.
    pub fn header(name: impl Into<String>) -> Self {
        Self {
            source: Source::Header(name.into()),
            keys: false,
        }
    }

    /// A field of the JSON body, a string or an integer: a top-level
    /// field's name (`"order_id"`), or a JSON pointer into nested objects
    /// (`"/order/id"`, RFC 6901).
    pub fn body_field(field: &str) -> Self {
        let pointer = if field.starts_with('/') {
            field.to_owned()
        } else {
            format!("/{}", field.replace('~', "~0").replace('/', "~1"))
        };
        Self {
            source: Source::BodyField(pointer),
            keys: false,
        }
    }

    /// The body's bytes ([`MessageId::from_content`]), for producers that
    /// send no id: two deliveries with the same body are one message. Right
    /// only where the body names its event (an order number and a version,
    /// say); a body sent twice on purpose is taken once.
    pub const fn content_hash() -> Self {
        Self {
            source: Source::ContentHash,
            keys: true,
        }
    }

    /// Takes ids that are not UUIDs, each mapped by
    /// [`MessageId::from_key`] (a UUID stays itself). Off by default, so
    /// that a producer that means to send UUIDs and sends something else is
    /// told so rather than deduplicated on a key it did not mean.
    #[must_use]
    pub const fn accept_keys(mut self) -> Self {
        self.keys = true;
        self
    }

    /// Whether the id is read from the parsed body, so that decoding reads
    /// it after the JSON (the other sources come before the type check).
    pub(crate) fn reads_json(&self) -> bool {
        matches!(self.source, Source::BodyField(_))
    }

    /// The id of the delivery `raw`, whose body parsed as `json` where
    /// [`Identity::reads_json`].
    pub(crate) fn of(
        &self,
        raw: &RawMessage<'_>,
        json: Option<&serde_json::Value>,
    ) -> Result<MessageId, BadInput> {
        let text = match &self.source {
            Source::ContentHash => return Ok(MessageId::from_content(raw.body)),
            Source::MessageId => raw.message_id.map(str::to_owned),
            Source::Header(name) => raw
                .headers
                .and_then(|headers| headers.header(name))
                .map(|value| {
                    header_key(&value).ok_or_else(|| self.unusable("a string or an integer"))
                })
                .transpose()?,
            Source::BodyField(pointer) => json
                .and_then(|body| body.pointer(pointer))
                .filter(|value| !value.is_null())
                .map(|value| json_key(value).ok_or_else(|| self.unusable("a string or an integer")))
                .transpose()?,
        };
        let text = text.ok_or_else(|| {
            BadInput::new(
                BadInputReason::MissingMessageId,
                format!("{self} is missing; the producer must set it and reuse it on retries"),
            )
        })?;
        if self.keys {
            MessageId::from_key(&text)
        } else {
            MessageId::parse(&text).map_err(|_| {
                inbox_api::InboxError::InvalidMessageId {
                    value: truncate(text.trim(), 64),
                    reason: "message id is not a UUID (a consumer that takes other keys says Identity::accept_keys)",
                }
            })
        }
        .map_err(|e| BadInput::new(BadInputReason::InvalidMessageId, format!("{self}: {e}")))
    }

    fn unusable(&self, expected: &str) -> BadInput {
        BadInput::new(
            BadInputReason::InvalidMessageId,
            format!("{self} is not {expected}"),
        )
    }
}

impl Default for Identity {
    fn default() -> Self {
        Self::message_id()
    }
}

/// Names the source, for error details and logs.
impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Source::MessageId => f.write_str("the message_id property"),
            Source::Header(name) => write!(f, "header {name:?}"),
            Source::BodyField(pointer) => write!(f, "body field {pointer:?}"),
            Source::ContentHash => f.write_str("the body's content hash"),
        }
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Identity({self}, keys: {})", self.keys)
    }
}

/// A header value usable as an id: text, or an integer of any width
/// (a producer in another language picks its own), as its decimal text.
fn header_key(value: &HeaderValue<'_>) -> Option<String> {
    Some(match value {
        HeaderValue::Text(text) => text.clone().into_owned(),
        HeaderValue::Integer(value) => value.to_string(),
        HeaderValue::Other => return None,
    })
}

/// A body field usable as an id: a string, or an integer (written as its
/// decimal text, so `1042` and `"1042"` are one key). Floats, booleans,
/// arrays and objects are refused: none names one message reliably.
fn json_key(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        _ => None,
    }
}

// Read through RabbitMQ's header table, as a consumer on it reads them.
#[cfg(all(test, feature = "rabbitmq"))]
mod tests {
    use super::*;
    use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

    fn raw<'a>(
        message_id: Option<&'a str>,
        headers: Option<&'a FieldTable>,
        body: &'a [u8],
    ) -> RawMessage<'a> {
        RawMessage {
            message_id,
            kind: Some("t"),
            headers: headers.map(|h| h as &dyn crate::delivery::Headers),
            body,
        }
    }

    fn reason(result: Result<MessageId, BadInput>) -> BadInputReason {
        result.expect_err("bad input").reason
    }

    #[test]
    fn the_default_takes_the_message_id_property_as_a_uuid_only() {
        let id = MessageId::new_v7();
        let text = id.to_string();
        assert_eq!(
            Identity::default().of(&raw(Some(&text), None, b"{}"), None),
            Ok(id)
        );
        assert_eq!(
            reason(Identity::default().of(&raw(Some("order-7"), None, b"{}"), None)),
            BadInputReason::InvalidMessageId
        );
        assert_eq!(
            reason(Identity::default().of(&raw(None, None, b"{}"), None)),
            BadInputReason::MissingMessageId
        );
        let keys = Identity::message_id().accept_keys();
        assert_eq!(
            keys.of(&raw(Some("order-7"), None, b"{}"), None),
            MessageId::from_key("order-7").map_err(|_| unreachable!())
        );
        assert_eq!(keys.of(&raw(Some(&text), None, b"{}"), None), Ok(id));
    }

    #[test]
    fn a_header_is_read_as_text_or_as_an_integer_of_any_width() {
        let identity = Identity::header("x-event-id").accept_keys();
        let expected = MessageId::from_key("42").expect("key");
        for value in [
            AMQPValue::LongString(LongString::from("42")),
            AMQPValue::ShortString(ShortString::from("42")),
            AMQPValue::ShortShortInt(42),
            AMQPValue::ShortShortUInt(42),
            AMQPValue::ShortInt(42),
            AMQPValue::ShortUInt(42),
            AMQPValue::LongInt(42),
            AMQPValue::LongUInt(42),
            AMQPValue::LongLongInt(42),
        ] {
            let mut headers = FieldTable::default();
            headers.insert("x-event-id".into(), value.clone());
            assert_eq!(
                identity.of(&raw(None, Some(&headers), b"{}"), None),
                Ok(expected),
                "{value:?}"
            );
        }
        let mut headers = FieldTable::default();
        headers.insert("x-event-id".into(), AMQPValue::Boolean(true));
        assert_eq!(
            reason(identity.of(&raw(None, Some(&headers), b"{}"), None)),
            BadInputReason::InvalidMessageId
        );
        let mut other = FieldTable::default();
        other.insert("x-other".into(), AMQPValue::LongInt(42));
        assert_eq!(
            reason(identity.of(&raw(Some("ignored"), Some(&other), b"{}"), None)),
            BadInputReason::MissingMessageId,
            "the message_id property is not a fallback"
        );
        assert_eq!(
            reason(identity.of(&raw(None, None, b"{}"), None)),
            BadInputReason::MissingMessageId
        );
    }

    #[test]
    fn a_body_field_is_a_name_or_a_pointer_and_an_integer_is_its_decimal_text() {
        let json: serde_json::Value = serde_json::json!({"order_id": 1042, "order": {"id": "1042"}, "a/b": "x", "f": 1.5, "n": null});
        let by_name = Identity::body_field("order_id").accept_keys();
        let by_pointer = Identity::body_field("/order/id").accept_keys();
        let key = MessageId::from_key("1042").expect("key");
        assert_eq!(by_name.of(&raw(None, None, b""), Some(&json)), Ok(key));
        assert_eq!(by_pointer.of(&raw(None, None, b""), Some(&json)), Ok(key));
        assert_eq!(
            Identity::body_field("a/b")
                .accept_keys()
                .of(&raw(None, None, b""), Some(&json)),
            MessageId::from_key("x").map_err(|_| unreachable!()),
            "a name with a slash is one field, escaped"
        );
        for (field, expected) in [
            ("f", BadInputReason::InvalidMessageId),
            ("order", BadInputReason::InvalidMessageId),
            ("n", BadInputReason::MissingMessageId),
            ("absent", BadInputReason::MissingMessageId),
        ] {
            let identity = Identity::body_field(field).accept_keys();
            assert_eq!(
                reason(identity.of(&raw(None, None, b""), Some(&json))),
                expected,
                "{field}"
            );
        }
        assert_eq!(
            reason(Identity::body_field("order_id").of(&raw(None, None, b""), Some(&json))),
            BadInputReason::InvalidMessageId,
            "1042 is not a UUID without accept_keys"
        );
    }

    #[test]
    fn a_content_hash_is_the_body_bytes_and_ignores_every_property() {
        let identity = Identity::content_hash();
        let a = identity.of(&raw(None, None, b"{\"a\":1}"), None);
        assert_eq!(a, Ok(MessageId::from_content(b"{\"a\":1}")));
        assert_eq!(identity.of(&raw(Some("x"), None, b"{\"a\":1}"), None), a);
        assert_ne!(identity.of(&raw(None, None, b"{\"a\": 1}"), None), a);
    }

    #[test]
    fn errors_name_the_source() {
        let bad = Identity::header("x-event-id")
            .of(&raw(None, None, b""), None)
            .expect_err("missing");
        assert!(
            bad.detail.contains("header \"x-event-id\""),
            "{}",
            bad.detail
        );
        let bad = Identity::default()
            .of(&raw(Some("order-7"), None, b""), None)
            .expect_err("not a uuid");
        assert!(bad.detail.contains("accept_keys"), "{}", bad.detail);
    }
}
