//! The Parcel events and their rules: `parcel.created` (what `POST
//! /parcels` enqueues, and the first two consumers take) and
//! `parcel.carrier-assigned` (what the carrier consumer enqueues, and the
//! third consumer takes).
//!
//! The runtime's decoding ([`inbox_runtime::decode::decode`]) refuses what
//! is not this event (wrong type, not JSON, missing fields) before any
//! transaction opens; [`ParcelCreatedEvent::validate`] adds the event's own
//! rules, refused the same way (`invalid_event`).

use inbox_api::{MessageId, OutgoingMessage};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use inbox_runtime::AppError;
use inbox_runtime::Identity;
use inbox_runtime::amqp::Outgoing;
use inbox_runtime::message::{BadInput, RawMessage};

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
    /// An event no producer sends, for the consumers' store checks (their
    /// write of it is always rolled back).
    pub fn probe() -> Self {
        Self {
            parcel_id: "inbox-store-check".into(),
            tracking_number: "PROBE".into(),
            destination: "nowhere".into(),
        }
    }

    /// The longest accepted text field, in bytes.
    pub const MAX_FIELD_LEN: usize = 200;

    /// The rules beyond the JSON shape: every field non-blank, at most
    /// [`Self::MAX_FIELD_LEN`] bytes, and free of control characters (they
    /// end up in rows, labels and log lines).
    ///
    /// JSON may carry `\u0000`, but PostgreSQL's `text` cannot store it:
    /// let through, such an event would fail only in the consumers that
    /// write the field, as a store error, while the others processed it.
    /// The other control characters (tabs, line breaks, escapes, DEL, the
    /// C1 range) PostgreSQL stores, but an identifier, a tracking number or
    /// a place name never holds one, and a line break or an escape in a
    /// label or a log line forges output. Refused here, any of them is bad
    /// input for every consumer alike.
    ///
    /// # Errors
    /// Which field breaks which rule.
    pub fn validate(&self) -> Result<(), String> {
        validate_text(&[
            ("parcel_id", &self.parcel_id),
            ("tracking_number", &self.tracking_number),
            ("destination", &self.destination),
        ])
    }
}

/// The rules of [`ParcelCreatedEvent::validate`] for any event's text
/// fields, given as `(name, value)`.
///
/// # Errors
/// Which field breaks which rule.
fn validate_text(fields: &[(&str, &str)]) -> Result<(), String> {
    for (name, value) in fields {
        if value.trim().is_empty() {
            return Err(format!("{name} is empty"));
        }
        if let Some(control) = value.chars().find(|c| c.is_control()) {
            return Err(format!(
                "{name} contains the control character U+{:04X} (a text field is one line of printable text; PostgreSQL text cannot store U+0000)",
                u32::from(control)
            ));
        }
        if value.len() > ParcelCreatedEvent::MAX_FIELD_LEN {
            return Err(format!(
                "{name} is longer than {} bytes",
                ParcelCreatedEvent::MAX_FIELD_LEN
            ));
        }
    }
    Ok(())
}

/// The AMQP `type` of a [`CarrierAssignedEvent`].
pub const CARRIER_ASSIGNED_TYPE: &str = "parcel.carrier-assigned";

/// The routing key carrier-assigned events are published with.
pub const CARRIER_ASSIGNED_ROUTING_KEY: &str = "parcel.carrier-assigned";

/// A carrier slot was reserved for a parcel: what the carrier consumer
/// tells the rest of the system, in the same transaction as its
/// reservation. It carries the parcel's label fields too, so that its
/// consumers need not read the producer's tables (event-carried state).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CarrierAssignedEvent {
    /// Which parcel.
    pub parcel_id: String,
    /// The label number.
    pub tracking_number: String,
    /// Where it goes.
    pub destination: String,
    /// Which carrier.
    pub carrier: String,
    /// The reserved pick-up slot.
    pub slot: String,
}

impl CarrierAssignedEvent {
    /// An event no producer sends, for the third consumer's store check.
    pub fn probe() -> Self {
        let created = ParcelCreatedEvent::probe();
        Self {
            parcel_id: created.parcel_id,
            tracking_number: created.tracking_number,
            destination: created.destination,
            carrier: "probe".into(),
            slot: "never".into(),
        }
    }

    /// The same rules as [`ParcelCreatedEvent::validate`], for every field.
    ///
    /// # Errors
    /// Which field breaks which rule.
    pub fn validate(&self) -> Result<(), String> {
        validate_text(&[
            ("parcel_id", &self.parcel_id),
            ("tracking_number", &self.tracking_number),
            ("destination", &self.destination),
            ("carrier", &self.carrier),
            ("slot", &self.slot),
        ])
    }
}

// The carrier consumer publishes it with `Context::publish`, which takes
// the type and the routing key from here.
impl inbox_runtime::Event for CarrierAssignedEvent {
    const TYPE: &'static str = CARRIER_ASSIGNED_TYPE;
    const ROUTING_KEY: &'static str = CARRIER_ASSIGNED_ROUTING_KEY;
}

/// Turns a raw delivery into a message id and a [`ParcelCreatedEvent`], or
/// says why not: the runtime's decoding with this event's type and rules.
///
/// # Errors
/// A [`BadInput`] naming the first rule broken.
pub fn decode(
    raw: RawMessage<'_>,
    max_body_bytes: usize,
) -> Result<(MessageId, ParcelCreatedEvent), BadInput> {
    inbox_runtime::decode::decode(
        raw,
        max_body_bytes,
        EVENT_TYPE,
        &Identity::default(),
        ParcelCreatedEvent::validate,
    )
}

/// A well-formed `parcel.created` message with its id, ready to publish.
///
/// # Errors
/// Never in practice (serialising plain strings).
pub fn outgoing(message_id: &MessageId, event: &ParcelCreatedEvent) -> Result<Outgoing, AppError> {
    Outgoing::json(message_id, EVENT_TYPE, event)
}

/// The UUID v5 namespace of the ids of `parcel.created` events.
const CREATED_NAMESPACE: Uuid = Uuid::from_u128(0x18f0_666b_07d6_4c43_8e11_cdb0_2abe_1fc6);

/// The message id of the `parcel.created` event of `parcel_id`: a UUID v5 of
/// the parcel id, so one parcel has one event id however often its creation
/// is retried. A retried request that finds the parcel enqueues nothing, and
/// two concurrent creations of one id meet at the outbox's key, where the
/// second waits for the first (the memory store's only lock for it).
pub fn created_message_id(parcel_id: &str) -> MessageId {
    MessageId::from_uuid(Uuid::new_v5(&CREATED_NAMESPACE, parcel_id.as_bytes()))
}

/// The outbox row announcing `event`: to `exchange` with [`ROUTING_KEY`],
/// of type [`EVENT_TYPE`], under [`created_message_id`], the JSON body the
/// consumers decode, and the current span's trace context
/// ([`inbox_runtime::trace::with_current_context`]).
///
/// # Errors
/// [`AppError::Inbox`] when the exchange name is not one the broker takes.
pub fn created_outgoing(
    exchange: &str,
    event: &ParcelCreatedEvent,
) -> Result<OutgoingMessage, AppError> {
    let body = serde_json::to_vec(event)
        .map_err(|e| AppError::Config(format!("cannot serialise the event: {e}")))?;
    let message = OutgoingMessage::new(
        created_message_id(&event.parcel_id),
        exchange,
        ROUTING_KEY,
        EVENT_TYPE,
        body,
    )?;
    Ok(inbox_runtime::trace::with_current_context(message)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use inbox_runtime::message::BadInputReason;

    const ID: &str = "0192f0a4-6c1e-7d2a-9b1c-3f4e5d6c7b8a";
    const BODY: &[u8] = br#"{"parcel_id":"P-1","tracking_number":"TN1","destination":"Lyon"}"#;

    fn raw<'a>(id: Option<&'a str>, kind: Option<&'a str>, body: &'a [u8]) -> RawMessage<'a> {
        RawMessage {
            message_id: id,
            kind,
            headers: None,
            body,
        }
    }

    fn reason(r: RawMessage<'_>) -> BadInputReason {
        decode(r, 1024).expect_err("bad input").reason
    }

    #[test]
    fn one_parcel_has_one_event_id() {
        assert_eq!(created_message_id("P-1"), created_message_id("P-1"));
        assert_ne!(created_message_id("P-1"), created_message_id("P-2"));
        let event: ParcelCreatedEvent = serde_json::from_slice(BODY).unwrap();
        let outgoing = created_outgoing("t.parcel.events", &event).unwrap();
        assert_eq!(outgoing.id(), created_message_id("P-1"));
        assert_eq!(outgoing.message_type(), EVENT_TYPE);
        let raw = raw(Some(ID), Some(EVENT_TYPE), outgoing.body());
        assert_eq!(decode(raw, 1024).unwrap().1, event);
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

    #[test]
    fn a_control_character_in_any_text_field_is_refused_naming_the_field() {
        for (field, body) in [
            (
                "parcel_id",
                br#"{"parcel_id":"P\u00001","tracking_number":"TN1","destination":"Lyon"}"#
                    .as_slice(),
            ),
            (
                "tracking_number",
                br#"{"parcel_id":"P-1","tracking_number":"TN\u0000","destination":"Lyon"}"#,
            ),
            (
                "destination",
                br#"{"parcel_id":"P-1","tracking_number":"TN1","destination":"\u0000Lyon"}"#,
            ),
        ] {
            let bad = decode(raw(Some(ID), Some(EVENT_TYPE), body), 1024).expect_err(field);
            assert_eq!(bad.reason, BadInputReason::InvalidEvent, "{field}");
            let said = bad.to_string();
            assert!(
                said.contains(field) && said.contains("U+0000"),
                "{field}: {said}"
            );
        }
        // Every other control character too, C0, DEL and C1 alike.
        for control in ["\\u0009", "\\n", "\\r", "\\u001b", "\\u007f", "\\u0085"] {
            let body = format!(
                r#"{{"parcel_id":"P-1","tracking_number":"TN1","destination":"Ly{control}on"}}"#
            );
            let bad =
                decode(raw(Some(ID), Some(EVENT_TYPE), body.as_bytes()), 1024).expect_err(control);
            assert_eq!(bad.reason, BadInputReason::InvalidEvent, "{control}");
            assert!(bad.to_string().contains("destination"), "{control}: {bad}");
        }
        // Printable text beyond ASCII stays valid.
        let fine = br#"{"parcel_id":"P-1","tracking_number":"TN1","destination":"Gda\u0144sk"}"#;
        assert!(decode(raw(Some(ID), Some(EVENT_TYPE), fine), 1024).is_ok());
    }
}
