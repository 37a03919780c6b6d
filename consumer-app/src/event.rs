//! The event and the validation of a delivery into it.
//!
//! Everything that makes a delivery unprocessable forever is found here,
//! before any transaction opens, and named by a [`BadInputReason`] that ends
//! up in the dead-letter header and the `inbox_dead_lettered_total` metric.

use std::fmt;

use inbox_api::MessageId;
use serde::{Deserialize, Serialize};

/// The AMQP `type` property of a [`ParcelCreatedEvent`].
pub const EVENT_TYPE: &str = "parcel.created";

/// The routing key parcel-created events are published with.
pub const ROUTING_KEY: &str = "parcel.created";

/// A parcel entered the network: both consumers act on it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParcelCreatedEvent {
    /// The parcel's identity in the tracking system.
    pub parcel_id: String,
    /// The number printed on the label.
    pub tracking_number: String,
    /// Where it goes (a city or postcode).
    pub destination: String,
}

impl ParcelCreatedEvent {
    /// The longest accepted text field, in bytes.
    pub const MAX_FIELD_LEN: usize = 200;

    fn validate(&self) -> Result<(), String> {
        for (name, value) in [
            ("parcel_id", &self.parcel_id),
            ("tracking_number", &self.tracking_number),
            ("destination", &self.destination),
        ] {
            if value.trim().is_empty() {
                return Err(format!("{name} is empty"));
            }
            if value.len() > Self::MAX_FIELD_LEN {
                return Err(format!(
                    "{name} is longer than {} bytes",
                    Self::MAX_FIELD_LEN
                ));
            }
        }
        Ok(())
    }
}

/// Why a delivery can never be processed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BadInputReason {
    /// No AMQP `message_id` property: deduplication is impossible.
    MissingMessageId,
    /// A `message_id` that is not a UUID.
    InvalidMessageId,
    /// A body that is not JSON.
    InvalidJson,
    /// JSON that is not a [`ParcelCreatedEvent`].
    InvalidEvent,
    /// A missing or unknown AMQP `type` property.
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
    fn new(reason: BadInputReason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }
}

/// The parts of a delivery the validation reads: kept apart from lapin's
/// types so that the rules are unit-testable.
#[derive(Clone, Copy, Debug)]
pub struct RawMessage<'a> {
    /// The AMQP `message_id` property.
    pub message_id: Option<&'a str>,
    /// The AMQP `type` property.
    pub kind: Option<&'a str>,
    /// The body.
    pub body: &'a [u8],
}

/// Turns a raw delivery into a message id and an event, or says why not.
///
/// The checks run cheapest first, and the size check before anything reads
/// the body.
///
/// # Errors
/// A [`BadInput`] naming the first rule broken.
pub fn decode(
    raw: RawMessage<'_>,
    max_body_bytes: usize,
) -> Result<(MessageId, ParcelCreatedEvent), BadInput> {
    if raw.body.len() > max_body_bytes {
        return Err(BadInput::new(
            BadInputReason::Oversized,
            format!(
                "body of {} bytes exceeds the maximum of {max_body_bytes}",
                raw.body.len()
            ),
        ));
    }
    let id_text = raw.message_id.ok_or_else(|| {
        BadInput::new(
            BadInputReason::MissingMessageId,
            "the message_id property is missing; the producer must set one and reuse it on retries",
        )
    })?;
    let message_id = MessageId::parse(id_text)
        .map_err(|e| BadInput::new(BadInputReason::InvalidMessageId, e.to_string()))?;
    match raw.kind {
        Some(EVENT_TYPE) => {}
        Some(other) => {
            return Err(BadInput::new(
                BadInputReason::UnknownType,
                format!("type {:?} is not {EVENT_TYPE:?}", truncate(other, 64)),
            ));
        }
        None => {
            return Err(BadInput::new(
                BadInputReason::UnknownType,
                format!("the type property is missing (expected {EVENT_TYPE:?})"),
            ));
        }
    }
    let json: serde_json::Value = serde_json::from_slice(raw.body)
        .map_err(|e| BadInput::new(BadInputReason::InvalidJson, e.to_string()))?;
    let event: ParcelCreatedEvent = serde_json::from_value(json)
        .map_err(|e| BadInput::new(BadInputReason::InvalidEvent, e.to_string()))?;
    event
        .validate()
        .map_err(|e| BadInput::new(BadInputReason::InvalidEvent, e))?;
    Ok((message_id, event))
}

/// Cuts `text` to at most `max` bytes on a char boundary.
pub fn truncate(text: &str, max: usize) -> String {
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

    const ID: &str = "0192f0a4-6c1e-7d2a-9b1c-3f4e5d6c7b8a";
    const BODY: &[u8] = br#"{"parcel_id":"P-1","tracking_number":"TN1","destination":"Lyon"}"#;

    fn raw<'a>(id: Option<&'a str>, kind: Option<&'a str>, body: &'a [u8]) -> RawMessage<'a> {
        RawMessage {
            message_id: id,
            kind,
            body,
        }
    }

    fn reason(r: RawMessage<'_>) -> BadInputReason {
        decode(r, 1024).expect_err("bad input").reason
    }

    #[test]
    fn a_good_message_decodes() {
        let (id, event) = decode(raw(Some(ID), Some(EVENT_TYPE), BODY), 1024).unwrap();
        assert_eq!(id.to_string(), ID);
        assert_eq!(event.parcel_id, "P-1");
    }

    #[test]
    fn each_bad_input_class_is_named() {
        use BadInputReason::*;
        assert_eq!(reason(raw(None, Some(EVENT_TYPE), BODY)), MissingMessageId);
        assert_eq!(
            reason(raw(Some("42"), Some(EVENT_TYPE), BODY)),
            InvalidMessageId
        );
        assert_eq!(
            reason(raw(Some(""), Some(EVENT_TYPE), BODY)),
            InvalidMessageId
        );
        assert_eq!(
            reason(raw(Some(ID), Some(EVENT_TYPE), b"{nope")),
            InvalidJson
        );
        assert_eq!(
            reason(raw(Some(ID), Some(EVENT_TYPE), br#"{"a":1}"#)),
            InvalidEvent
        );
        assert_eq!(
            reason(raw(Some(ID), Some(EVENT_TYPE), b"[1,2]")),
            InvalidEvent
        );
        assert_eq!(
            reason(raw(
                Some(ID),
                Some(EVENT_TYPE),
                br#"{"parcel_id":" ","tracking_number":"T","destination":"D"}"#
            )),
            InvalidEvent
        );
        assert_eq!(
            reason(raw(Some(ID), Some("parcel.deleted"), BODY)),
            UnknownType
        );
        assert_eq!(reason(raw(Some(ID), None, BODY)), UnknownType);
        let big = vec![b' '; 2000];
        assert_eq!(reason(raw(Some(ID), Some(EVENT_TYPE), &big)), Oversized);
    }
}
