//! A delivery turned into its message id and its message, or the reason it
//! never can be: [`decode`].

use inbox_api::MessageId;
use serde::de::DeserializeOwned;

use crate::identity::Identity;
use crate::message::{BadInput, BadInputReason, RawMessage, truncate};

/// Turns a raw delivery into a message id (read where `identity` says)
/// and a message of type `message_type` (the AMQP `type` property),
/// checked by `validate`, or says why not.
///
/// The checks run cheapest first, and the size check before anything reads
/// the body; an id read from a body field comes after the JSON parse, every
/// other id before the type check.
///
/// # Errors
/// A [`BadInput`] naming the first rule broken.
pub fn decode<M: DeserializeOwned>(
    raw: RawMessage<'_>,
    max_body_bytes: usize,
    message_type: &str,
    identity: &Identity,
    validate: impl FnOnce(&M) -> Result<(), String>,
) -> Result<(MessageId, M), BadInput> {
    if raw.body.len() > max_body_bytes {
        return Err(BadInput::new(
            BadInputReason::Oversized,
            format!(
                "body of {} bytes exceeds the maximum of {max_body_bytes}",
                raw.body.len()
            ),
        ));
    }
    let early = if identity.reads_json() {
        None
    } else {
        Some(identity.of(&raw, None)?)
    };
    match raw.kind {
        Some(kind) if kind == message_type => {}
        Some(other) => {
            return Err(BadInput::new(
                BadInputReason::UnknownType,
                format!("type {:?} is not {message_type:?}", truncate(other, 64)),
            ));
        }
        None => {
            return Err(BadInput::new(
                BadInputReason::UnknownType,
                format!("the type property is missing (expected {message_type:?})"),
            ));
        }
    }
    let json: serde_json::Value = serde_json::from_slice(raw.body)
        .map_err(|e| BadInput::new(BadInputReason::InvalidJson, e.to_string()))?;
    let message_id = match early {
        Some(id) => id,
        None => identity.of(&raw, Some(&json))?,
    };
    let message: M = serde_json::from_value(json)
        .map_err(|e| BadInput::new(BadInputReason::InvalidEvent, e.to_string()))?;
    validate(&message).map_err(|e| BadInput::new(BadInputReason::InvalidEvent, e))?;
    Ok((message_id, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Deserialize)]
    struct Placed {
        order_id: u64,
    }

    fn run(
        message_id: Option<&str>,
        kind: Option<&str>,
        body: &[u8],
        identity: &Identity,
    ) -> Result<(MessageId, Placed), BadInput> {
        let raw = RawMessage {
            message_id,
            kind,
            headers: None,
            body,
        };
        decode(raw, 64, "placed", identity, |p: &Placed| {
            if p.order_id == 0 {
                Err("order 0".to_owned())
            } else {
                Ok(())
            }
        })
    }

    fn reason(result: Result<(MessageId, Placed), BadInput>) -> BadInputReason {
        result.expect_err("bad input").reason
    }

    #[test]
    fn the_first_rule_broken_names_the_reason_cheapest_first() {
        let id = MessageId::new_v7().to_string();
        let ok = Identity::default();
        let body = br#"{"order_id": 7}"#;
        assert_eq!(
            run(Some(&id), Some("placed"), body, &ok).map(|(_, m)| m),
            Ok(Placed { order_id: 7 })
        );
        for (message_id, kind, body, expected) in [
            (
                Some(id.as_str()),
                Some("placed"),
                &[b' '; 65][..],
                BadInputReason::Oversized,
            ),
            (None, None, b"not json", BadInputReason::MissingMessageId),
            (
                Some("x"),
                None,
                b"not json",
                BadInputReason::InvalidMessageId,
            ),
            (Some(id.as_str()), None, b"{}", BadInputReason::UnknownType),
            (
                Some(id.as_str()),
                Some("other"),
                b"{}",
                BadInputReason::UnknownType,
            ),
            (
                Some(id.as_str()),
                Some("placed"),
                b"not json",
                BadInputReason::InvalidJson,
            ),
            (
                Some(id.as_str()),
                Some("placed"),
                b"{}",
                BadInputReason::InvalidEvent,
            ),
            (
                Some(id.as_str()),
                Some("placed"),
                br#"{"order_id": 0}"#,
                BadInputReason::InvalidEvent,
            ),
        ] {
            assert_eq!(
                reason(run(message_id, kind, body, &ok)),
                expected,
                "{body:?}"
            );
        }
    }

    #[test]
    fn a_body_field_id_is_read_after_the_type_and_the_json() {
        let by_order = Identity::body_field("order_id").accept_keys();
        let (id, _) = run(None, Some("placed"), br#"{"order_id": 7}"#, &by_order).expect("decodes");
        assert_eq!(id, MessageId::from_key("7").expect("key"));
        assert_eq!(
            reason(run(None, Some("other"), br#"{"order_id": 7}"#, &by_order)),
            BadInputReason::UnknownType
        );
        assert_eq!(
            reason(run(None, Some("placed"), b"not json", &by_order)),
            BadInputReason::InvalidJson
        );
        assert_eq!(
            reason(run(None, Some("placed"), br#"{"id": 7}"#, &by_order)),
            BadInputReason::MissingMessageId
        );
    }
}
