//! Replaying dead letters: moving messages from a queue's dead-letter queue
//! back to the queue, after the fault that killed them is fixed.
//!
//! A replayed message is published again under its own message id (the
//! inbox still deduplicates it: a message processed meanwhile is a
//! duplicate, never a second effect) to the queue itself, through the
//! default exchange, with the original properties and headers minus the
//! dead-letter ones (`x-dead-letter-*`, `x-inbox-*`, the broker's
//! `x-death` and `x-delivery-count`); the failed attempt's trace context
//! (`x-dead-letter-traceparent`) comes back as
//! [`crate::trace::REPLAYED_FROM`], so the replayed delivery's span links
//! to the attempt that gave it up. It then gets a **fresh budget**:
//! the broker counts a new delivery from zero, and the attempt ledger
//! starts a message marked dead at one again (what MassTransit and
//! NServiceBus users expect of a replay).
//!
//! Each moved message is acked in the dead-letter queue only after the
//! broker confirmed its publish to the work queue: a crash in between
//! leaves it in both, and the inbox makes the copy harmless. Messages not
//! chosen stay in the dead-letter queue, in their order.

use lapin::message::BasicGetMessage;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel};

use crate::AppError;
use crate::amqp::Publisher;
use crate::topology::Topology;

/// Headers a dead-lettering adds, which a replayed message must not carry.
fn is_dead_letter_header(name: &str) -> bool {
    name.starts_with("x-dead-letter-")
        || name.starts_with("x-inbox-")
        || matches!(
            name,
            "x-death"
                | "x-delivery-count"
                | "x-first-death-exchange"
                | "x-first-death-queue"
                | "x-first-death-reason"
                | "x-last-death-exchange"
                | "x-last-death-queue"
                | "x-last-death-reason"
        )
}

/// `properties` without the dead-letter headers, and with the failed
/// attempt's trace context as [`crate::trace::REPLAYED_FROM`].
pub fn replay_properties(properties: &BasicProperties) -> BasicProperties {
    let headers: FieldTable = properties
        .headers()
        .as_ref()
        .map(|headers| {
            let inner = headers.inner();
            let failed_attempt = inner
                .get(crate::trace::DEAD_LETTER_TRACEPARENT)
                .map(|value| (crate::trace::REPLAYED_FROM.into(), value.clone()));
            inner
                .iter()
                .filter(|(name, _)| !is_dead_letter_header(name.as_str()))
                .filter(|(name, _)| name.as_str() != crate::trace::REPLAYED_FROM)
                .map(|(name, value)| (name.clone(), value.clone()))
                .chain(failed_attempt)
                .collect::<std::collections::BTreeMap<_, _>>()
        })
        .unwrap_or_default()
        .into();
    properties.clone().with_headers(headers)
}

/// What [`replay`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Messages moved back to the queue.
    pub moved: u64,
    /// Messages looked at and left in the dead-letter queue.
    pub kept: u64,
}

/// Moves the messages of `queue`'s dead-letter queue for which `choose`
/// says yes (given the message's `message_id`, if any) back to `queue`.
/// Looks at the messages that are in the dead-letter queue when it starts,
/// each once. `channel` must be in confirm mode.
///
/// # Errors
/// Broker errors; messages already moved stay moved, the others stay (or,
/// with the channel gone, return to) the dead-letter queue.
pub async fn replay(
    channel: &Channel,
    queue: &str,
    mut choose: impl FnMut(Option<&str>) -> bool,
) -> Result<Replayed, AppError> {
    let dead_letter_queue = Topology::dead_letter_queue(queue);
    let waiting = Topology::ready_messages(channel, &dead_letter_queue).await?;
    let mut kept: Vec<BasicGetMessage> = Vec::new();
    let mut report = Replayed::default();
    for _ in 0..waiting {
        let got = channel
            .basic_get(
                dead_letter_queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await
            .map_err(|e| AppError::broker(format!("basic.get from {dead_letter_queue}"), e))?;
        let Some(message) = got else { break };
        let id = message
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned());
        if !choose(id.as_deref()) {
            // Held unacked until the end, so the next get moves on.
            kept.push(message);
            continue;
        }
        Publisher::publish_raw(
            channel,
            "",
            queue,
            &message.delivery.data,
            replay_properties(&message.delivery.properties),
        )
        .await?;
        message
            .delivery
            .ack(BasicAckOptions::default())
            .await
            .map_err(|e| AppError::broker("ack a replayed dead letter", e))?;
        tracing::info!(message_id = id.as_deref().unwrap_or("<none>"), %queue,
            "replayed from the dead-letter queue");
        report.moved += 1;
    }
    for message in kept {
        message
            .delivery
            .nack(BasicNackOptions {
                multiple: false,
                requeue: true,
            })
            .await
            .map_err(|e| AppError::broker("give back a dead letter not replayed", e))?;
        report.kept += 1;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use lapin::types::AMQPValue;

    use super::*;
    use crate::amqp::long_string;

    #[test]
    fn replayed_properties_lose_only_the_dead_letter_headers() {
        let mut headers = FieldTable::default();
        for name in [
            "x-dead-letter-reason",
            "x-dead-letter-detail",
            "x-inbox-attempts",
            "x-inbox-last-error",
            "x-death",
            "x-delivery-count",
            "x-first-death-reason",
        ] {
            headers.insert(name.into(), long_string("gone"));
        }
        headers.insert("tenant".into(), long_string("acme"));
        headers.insert("x-custom".into(), AMQPValue::LongInt(1));
        let properties = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_headers(headers);
        let replayed = replay_properties(&properties);
        let names: Vec<String> = replayed
            .headers()
            .as_ref()
            .map(|h| h.inner().keys().map(|k| k.to_string()).collect())
            .unwrap_or_default();
        assert_eq!(names, vec!["tenant".to_owned(), "x-custom".to_owned()]);
        assert_eq!(
            replayed.message_id().as_ref().map(|id| id.as_str()),
            Some("m-1")
        );
    }

    #[test]
    fn a_replay_names_the_attempt_that_dead_lettered_it() {
        let failed = "00-4bf92f3577b34da6a3ce929d0e0e4736-a3ce929d0e0e4736-01";
        let mut headers = FieldTable::default();
        headers.insert(
            crate::trace::DEAD_LETTER_TRACEPARENT.into(),
            long_string(failed),
        );
        // From an earlier replay: the newer failure replaces it.
        headers.insert(
            crate::trace::REPLAYED_FROM.into(),
            long_string("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        let properties = BasicProperties::default().with_headers(headers);
        let replayed = replay_properties(&properties);
        let headers = replayed.headers().clone().unwrap_or_default();
        let names: Vec<String> = headers.inner().keys().map(|k| k.to_string()).collect();
        assert_eq!(names, vec![crate::trace::REPLAYED_FROM.to_owned()]);
        assert_eq!(
            headers.inner().get(crate::trace::REPLAYED_FROM),
            Some(&long_string(failed))
        );
    }
}
