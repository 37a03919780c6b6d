//! The identity of a delivery: which message, seen by which consumer.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use uuid::Uuid;

use crate::{Fingerprint, InboxError};

/// The producer-assigned identity of a message.
///
/// Deduplication is only as good as this id: the producer must assign it once
/// per logical message and reuse it on every retry of the publish. A fresh
/// random id per publish attempt silently turns the inbox off, which is why
/// there is deliberately no `Default` and why [`MessageId::parse`] refuses
/// anything that is not a UUID. A producer whose ids are not UUIDs names
/// its messages through [`MessageId::from_key`], a stable mapping chosen on
/// purpose rather than a silent fallback.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(Uuid);

impl MessageId {
    /// Wraps a UUID the producer assigned.
    pub const fn from_uuid(id: Uuid) -> Self {
        Self(id)
    }

    /// A new time-ordered (v7) id, for producers.
    ///
    /// Time-ordered ids keep the inbox primary key's B-tree inserts local,
    /// which matters on tables of millions of rows.
    pub fn new_v7() -> Self {
        Self(Uuid::now_v7())
    }

    /// Parses the textual form found in a message header.
    ///
    /// # Errors
    /// [`InboxError::InvalidMessageId`] (permanent) when `text` is empty or
    /// not a UUID; the error carries the offending text, truncated, for the
    /// dead-letter reason.
    pub fn parse(text: &str) -> Result<Self, InboxError> {
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err(InboxError::InvalidMessageId {
                value: String::new(),
                reason: "message id is empty",
            });
        }
        Uuid::parse_str(trimmed)
            .map(Self)
            .map_err(|_| InboxError::InvalidMessageId {
                value: truncate(trimmed, 64),
                reason: "message id is not a UUID",
            })
    }

    /// The id of a message whose producer sends its own key rather than a
    /// UUID: an order number, a ULID, a Stripe event id.
    ///
    /// A key that is a UUID is that UUID, so producers that already send
    /// UUIDs keep their ids. Any other key becomes the UUID v5 of its exact
    /// bytes under [`MessageId::KEY_NAMESPACE`]: stable across processes,
    /// versions and stores, so a redelivery of the same key is a duplicate
    /// everywhere. The key is taken as it is (no trimming, case kept): two
    /// keys that differ in a byte are two messages.
    ///
    /// ```
    /// use inbox_api::MessageId;
    ///
    /// # fn main() -> Result<(), inbox_api::InboxError> {
    /// let a = MessageId::from_key("order-1042")?;
    /// assert_eq!(a, MessageId::from_key("order-1042")?);
    /// assert_ne!(a, MessageId::from_key("order-1043")?);
    ///
    /// let uuid = "0190f5a2-6d5e-7c3b-9a41-1f2e3d4c5b6a";
    /// assert_eq!(MessageId::from_key(uuid)?, MessageId::parse(uuid)?);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`InboxError::InvalidMessageId`] (permanent) when `key` is empty or
    /// longer than [`MessageId::MAX_KEY_LEN`] bytes: an empty key would make
    /// every keyless message one message.
    pub fn from_key(key: &str) -> Result<Self, InboxError> {
        if key.trim().is_empty() {
            return Err(InboxError::InvalidMessageId {
                value: String::new(),
                reason: "message id is empty",
            });
        }
        if key.len() > Self::MAX_KEY_LEN {
            return Err(InboxError::InvalidMessageId {
                value: truncate(key, 64),
                reason: "message id is longer than 1024 bytes",
            });
        }
        if let Ok(uuid) = Uuid::parse_str(key.trim()) {
            return Ok(Self(uuid));
        }
        Ok(Self(Uuid::new_v5(&Self::KEY_NAMESPACE, key.as_bytes())))
    }

    /// The id of a message whose producer sends no id at all: the UUID v5
    /// of its body under [`MessageId::CONTENT_NAMESPACE`].
    ///
    /// Two messages with the same bytes are then one message, which is
    /// right only where the body itself names the event (it carries its
    /// own order number and version, say); a body such as "tick" sent
    /// twice on purpose would be taken once.
    pub fn from_content(body: &[u8]) -> Self {
        Self(Uuid::new_v5(&Self::CONTENT_NAMESPACE, body))
    }

    /// The longest key [`MessageId::from_key`] takes, in bytes.
    pub const MAX_KEY_LEN: usize = 1024;

    /// The namespace of [`MessageId::from_key`]'s UUIDs. Fixed for ever:
    /// changing it would make every stored key new again.
    pub const KEY_NAMESPACE: Uuid = Uuid::from_u128(0x6f2c1a4e_8b3d_5e07_9c61_d2f4a8b03e15);

    /// The namespace of [`MessageId::from_content`]'s UUIDs, apart from the
    /// keys' so that a body equal to some key is not that key's message.
    pub const CONTENT_NAMESPACE: Uuid = Uuid::from_u128(0x3b9d7e52_0c4a_5f18_a6e3_91c0d5b7f2a4);

    /// The UUID inside.
    pub const fn as_uuid(&self) -> &Uuid {
        &self.0
    }
}

impl From<Uuid> for MessageId {
    fn from(id: Uuid) -> Self {
        Self(id)
    }
}

impl From<MessageId> for Uuid {
    fn from(id: MessageId) -> Self {
        id.0
    }
}

impl FromStr for MessageId {
    type Err = InboxError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Debug for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MessageId({})", self.0)
    }
}

/// The name of a consumer: the scope of deduplication.
///
/// The inbox key is `(message, consumer)`, never the message alone: keyed on
/// the message id only, a second consumer of the same message would find the
/// first one's row and silently skip its own work.
///
/// Validated on construction so it always fits the `consumer_type
/// VARCHAR(500)` column and prints safely in a log line: non-empty, at most
/// [`ConsumerName::MAX_LEN`] bytes, no control characters, no surrounding
/// whitespace (two names that differ only by a trailing space would be two
/// scopes that look like one).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConsumerName(Arc<str>);

impl ConsumerName {
    /// The longest name, in bytes, that fits the schema's column.
    pub const MAX_LEN: usize = 500;

    /// Validates and wraps a consumer name.
    ///
    /// # Errors
    /// [`InboxError::InvalidConsumerName`] (permanent) naming the broken rule.
    pub fn new(name: impl AsRef<str>) -> Result<Self, InboxError> {
        let name = name.as_ref();
        let reason = if name.is_empty() {
            Some("consumer name is empty")
        } else if name.len() > Self::MAX_LEN {
            Some("consumer name is longer than 500 bytes")
        } else if name.chars().any(char::is_control) {
            Some("consumer name contains a control character")
        } else if name.trim() != name {
            Some("consumer name has leading or trailing whitespace")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(InboxError::InvalidConsumerName {
                value: truncate(name, 64),
                reason,
            }),
            None => Ok(Self(Arc::from(name))),
        }
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name as a metric label value: shares this name's allocation (a
    /// reference count), where `as_str().to_owned()` copied it on every
    /// message even with no metrics recorder installed.
    pub(crate) fn label(&self) -> metrics::SharedString {
        metrics::SharedString::from(Arc::clone(&self.0))
    }
}

impl FromStr for ConsumerName {
    type Err = InboxError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl AsRef<str> for ConsumerName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ConsumerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ConsumerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ConsumerName({:?})", &*self.0)
    }
}

/// The primary key of the inbox: one message as seen by one consumer, and,
/// optionally, the fingerprint of what the message said.
///
/// Equality, hashing and order are the key's alone (`message_id`, then
/// `consumer`): the fingerprint rides along to be stored with the claim
/// and compared on a duplicate, never to make two deliveries of one
/// message two keys.
#[derive(Clone, Debug)]
pub struct InboxKey {
    /// Which message.
    pub message_id: MessageId,
    /// Which consumer's scope.
    pub consumer: ConsumerName,
    fingerprint: Option<Fingerprint>,
}

impl InboxKey {
    /// Pairs a message with the consumer handling it.
    pub fn new(message_id: MessageId, consumer: ConsumerName) -> Self {
        Self {
            message_id,
            consumer,
            fingerprint: None,
        }
    }

    /// The key with the fingerprint of the delivery's payload: the claim
    /// stores it, and a later delivery of the same key whose fingerprint
    /// differs is [`crate::Handled::Conflict`] rather than a duplicate.
    #[must_use]
    pub fn with_fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// The payload's fingerprint, if the caller gave one.
    pub fn fingerprint(&self) -> Option<&Fingerprint> {
        self.fingerprint.as_ref()
    }
}

impl PartialEq for InboxKey {
    fn eq(&self, other: &Self) -> bool {
        self.message_id == other.message_id && self.consumer == other.consumer
    }
}

impl Eq for InboxKey {}

impl std::hash::Hash for InboxKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.message_id.hash(state);
        self.consumer.hash(state);
    }
}

impl PartialOrd for InboxKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for InboxKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.message_id
            .cmp(&other.message_id)
            .then_with(|| self.consumer.cmp(&other.consumer))
    }
}

impl fmt::Display for InboxKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.message_id, self.consumer)
    }
}

/// Cuts `text` to at most `max` bytes on a char boundary, for error messages
/// that quote user input.
pub(crate) fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_id_round_trips_and_rejects_garbage() {
        let id = MessageId::new_v7();
        assert_eq!(MessageId::parse(&id.to_string()).unwrap(), id);
        assert_eq!(
            MessageId::parse(&format!("  {id} ")).unwrap(),
            id,
            "header values may carry whitespace"
        );
        for bad in [
            "",
            "   ",
            "not-a-uuid",
            "12345",
            "00000000-0000-0000-0000-00000000000g",
        ] {
            let err = MessageId::parse(bad).unwrap_err();
            assert!(
                matches!(err, InboxError::InvalidMessageId { .. }),
                "{bad:?}: {err}"
            );
            assert!(
                !err.is_retryable(),
                "a malformed id never becomes valid on retry"
            );
        }
    }

    #[test]
    fn message_id_error_quotes_truncated_input() {
        let long = "x".repeat(1000);
        let err = MessageId::parse(&long).unwrap_err();
        assert!(err.to_string().len() < 200, "{err}");
    }

    #[test]
    fn consumer_name_rules() {
        assert!(ConsumerName::new("notification").is_ok());
        assert!(ConsumerName::new("a".repeat(500)).is_ok());
        assert!(
            ConsumerName::new("é".repeat(250)).is_ok(),
            "500 bytes exactly"
        );
        for bad in [
            String::new(),
            "a".repeat(501),
            "é".repeat(251),
            "tab\there".to_owned(),
            " padded".to_owned(),
            "padded ".to_owned(),
        ] {
            let err = ConsumerName::new(&bad).unwrap_err();
            assert!(
                matches!(err, InboxError::InvalidConsumerName { .. }),
                "{bad:?}"
            );
            assert!(!err.is_retryable());
        }
    }

    #[test]
    fn consumer_label_shares_the_name() {
        let name = ConsumerName::new("notification").unwrap();
        let label = name.label();
        assert_eq!(&*label, "notification");
        assert!(
            std::ptr::eq(label.as_ptr(), name.as_str().as_ptr()),
            "a metric label must not copy the name"
        );
    }

    #[test]
    fn keys_differ_by_consumer() {
        let id = MessageId::new_v7();
        let a = InboxKey::new(id, ConsumerName::new("a").unwrap());
        let b = InboxKey::new(id, ConsumerName::new("b").unwrap());
        assert_ne!(a, b);
        assert_eq!(a.to_string(), format!("{id}@a"));
    }

    #[test]
    fn message_id_conversions_keep_the_uuid() {
        let uuid = Uuid::now_v7();
        let id = MessageId::from(uuid);
        assert_eq!(id, MessageId::from_uuid(uuid));
        assert_eq!(*id.as_uuid(), uuid);
        assert_eq!(Uuid::from(id), uuid);
        assert_eq!(id.to_string().parse::<MessageId>().unwrap(), id);
        assert_eq!(id.to_string(), uuid.hyphenated().to_string());
        assert_eq!(format!("{id:?}"), format!("MessageId({uuid})"));
        assert!("nope".parse::<MessageId>().is_err());
        assert_eq!(MessageId::new_v7().as_uuid().get_version_num(), 7);
        assert_ne!(MessageId::new_v7(), MessageId::new_v7());
    }

    #[test]
    fn consumer_name_conversions_keep_the_text() {
        let name: ConsumerName = "carrier".parse().unwrap();
        assert_eq!(name.as_str(), "carrier");
        assert_eq!(name.as_ref(), "carrier");
        assert_eq!(name.to_string(), "carrier");
        assert_eq!(format!("{name:?}"), "ConsumerName(\"carrier\")");
        assert!(" carrier".parse::<ConsumerName>().is_err());
    }

    #[test]
    fn invalid_input_is_quoted_truncated_on_a_char_boundary() {
        // 64 bytes exactly are quoted whole; one byte more is cut, and a
        // two-byte character straddling the limit is dropped whole.
        let exact = "x".repeat(64);
        assert_eq!(truncate(&exact, 64), exact);
        assert_eq!(truncate(&"x".repeat(65), 64), format!("{exact}…"));
        let straddling = format!("{}é", "x".repeat(63));
        assert_eq!(truncate(&straddling, 64), format!("{}…", "x".repeat(63)));

        let err = MessageId::parse(&"z".repeat(100)).unwrap_err();
        match err {
            InboxError::InvalidMessageId { value, reason } => {
                assert_eq!(value, format!("{}…", "z".repeat(64)));
                assert_eq!(reason, "message id is not a UUID");
            }
            other => panic!("{other:?}"),
        }
        match MessageId::parse("  ").unwrap_err() {
            InboxError::InvalidMessageId { value, reason } => {
                assert_eq!(value, "");
                assert_eq!(reason, "message id is empty");
            }
            other => panic!("{other:?}"),
        }
        let long = "n".repeat(501);
        match ConsumerName::new(&long).unwrap_err() {
            InboxError::InvalidConsumerName { value, reason } => {
                assert_eq!(value, format!("{}…", "n".repeat(64)));
                assert_eq!(reason, "consumer name is longer than 500 bytes");
            }
            other => panic!("{other:?}"),
        }
        for (bad, expected) in [
            ("", "consumer name is empty"),
            ("a\u{7}b", "consumer name contains a control character"),
            (" a", "consumer name has leading or trailing whitespace"),
        ] {
            match ConsumerName::new(bad).unwrap_err() {
                InboxError::InvalidConsumerName { value, reason } => {
                    assert_eq!(value, bad);
                    assert_eq!(reason, expected);
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// The mapping is a promise to every stored row: these values come
    /// from Python's `uuid.uuid5`, not from this crate, so a changed
    /// namespace or byte handling fails here.
    #[test]
    fn keys_and_bodies_map_to_the_documented_uuid_v5() {
        assert_eq!(
            MessageId::from_key("order-1042").unwrap().to_string(),
            "0f4067e5-8224-5c20-a073-d7a5818e069f"
        );
        assert_eq!(
            MessageId::from_content(b"order-1042").to_string(),
            "6a76fd84-f3e6-5e0a-9cb7-32b376ac1b49"
        );
        // Raw bytes, not text: a body need not be UTF-8.
        assert_eq!(
            MessageId::from_content(&[0xff, 0xfe]).to_string(),
            "cd3cd7ce-b9dc-5c8a-87bd-8579c01e5d93"
        );
    }

    #[test]
    fn a_key_that_is_a_uuid_is_that_uuid_and_other_keys_are_kept_byte_for_byte() {
        let id = MessageId::new_v7();
        assert_eq!(MessageId::from_key(&id.to_string()).unwrap(), id);
        assert_eq!(MessageId::from_key(&format!(" {id} ")).unwrap(), id);
        let plain = MessageId::from_key("Order-7").unwrap();
        for other in ["order-7", "Order-7 ", " Order-7", "Order-8"] {
            assert_ne!(MessageId::from_key(other).unwrap(), plain, "{other:?}");
        }
        assert_ne!(
            MessageId::from_key("Order-7").unwrap(),
            MessageId::from_content(b"Order-7"),
            "a key and a body with the same bytes are two messages"
        );
    }

    #[test]
    fn empty_and_oversized_keys_are_refused_as_permanent() {
        assert!(MessageId::from_key(&"k".repeat(MessageId::MAX_KEY_LEN)).is_ok());
        for bad in [
            String::new(),
            "  ".to_owned(),
            "k".repeat(MessageId::MAX_KEY_LEN + 1),
        ] {
            let err = MessageId::from_key(&bad).unwrap_err();
            assert!(
                matches!(err, InboxError::InvalidMessageId { .. }),
                "{bad:?}"
            );
            assert!(!err.is_retryable());
        }
    }

    #[test]
    fn a_fingerprint_does_not_make_another_key() {
        use std::collections::HashSet;
        let key = InboxKey::new(MessageId::new_v7(), ConsumerName::new("c").unwrap());
        let printed = key.clone().with_fingerprint(Fingerprint::of(b"a"));
        let other = key.clone().with_fingerprint(Fingerprint::of(b"b"));
        assert_eq!(printed, other);
        assert_eq!(printed.cmp(&key), std::cmp::Ordering::Equal);
        assert_eq!(
            HashSet::from([key.clone(), printed.clone(), other]).len(),
            1
        );
        assert_eq!(printed.fingerprint(), Some(&Fingerprint::of(b"a")));
        assert_eq!(key.fingerprint(), None);
        let later = InboxKey::new(MessageId::new_v7(), ConsumerName::new("a").unwrap());
        assert!(key < later, "ordered by message id first");
    }
}
