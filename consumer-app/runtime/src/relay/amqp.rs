//! The relay's RabbitMQ outlet: publishes a batch on a confirm-mode
//! channel it has to itself (a pool of them on one connection), with
//! `mandatory` so that an unroutable message comes back, and matches each
//! message to its confirm and its return.

use futures::FutureExt as _;
use futures::future::BoxFuture;
use inbox_api::OutgoingMessage;
use inbox_api::metrics as names;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection};
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument as _;

use super::outlet::{Outlet, PublishFailure};
use crate::AppError;
use crate::amqp::{close_bounded, close_channel_bounded, connect_with, open_channel};
use crate::broker::ConnectOptions;

/// The relay's connection and its idle confirm-mode channels. A channel is
/// idle only once the batch it carried is settled with every confirm
/// resolved, so that no return of that batch can reach the next one.
pub(crate) struct Pool {
    connection: Connection,
    idle: Vec<Channel>,
}

impl Outlet for Pool {
    type Lane = Channel;

    const NAME: &'static str = "RabbitMQ";

    async fn connect(url: &str, name: &str, options: ConnectOptions) -> Result<Self, AppError> {
        Ok(Self {
            connection: connect_with(url, name, options).await?,
            idle: Vec::new(),
        })
    }

    fn is_open(&self) -> bool {
        self.connection.status().connected()
    }

    /// An idle channel, or a new one when none is idle (so never more than
    /// the batches in flight plus one).
    async fn lane(&mut self, exchanges: &[String]) -> Result<Channel, AppError> {
        while let Some(channel) = self.idle.pop() {
            if channel.status().connected() {
                return Ok(channel);
            }
        }
        let channel = open_confirm_channel(&self.connection).await?;
        for exchange in exchanges {
            crate::rabbitmq::topology::declare_exchange(&channel, exchange).await?;
        }
        Ok(channel)
    }

    async fn publish(
        lane: &Channel,
        messages: &[OutgoingMessage],
        mandatory: bool,
        timeout: Duration,
    ) -> BoxFuture<'static, Vec<Result<(), PublishFailure>>> {
        let confirms = publish_batch(lane, messages, mandatory, timeout).await;
        let ids: Vec<String> = messages.iter().map(|m| m.id().to_string()).collect();
        async move { attribute_returns(&ids, futures::future::join_all(confirms).await) }.boxed()
    }

    /// Keeps the channels of settled batches that are still open.
    fn give_back(&mut self, channels: Vec<Channel>) {
        self.idle.extend(
            channels
                .into_iter()
                .filter(|channel| channel.status().connected()),
        );
    }

    /// A confirm that never resolved (the channel closed, or timed out)
    /// may still owe its batch a `basic.return`, which lapin would hand to
    /// the next batch's confirms: such a channel is never used again.
    async fn retire(channel: Channel) {
        close_channel_bounded(&channel, "reopening after a failure").await;
    }

    async fn close(self) {
        close_bounded(&self.connection, "relay stopping").await;
    }
}

async fn open_confirm_channel(connection: &Connection) -> Result<Channel, AppError> {
    let channel = open_channel(connection, "the relay's channel").await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| AppError::broker("enable publisher confirms", e))?;
    Ok(channel)
}

/// The AMQP properties of `message`: its id as `message_id` (the same on
/// every publish: what the consumers' inboxes deduplicate on), its type and
/// headers, persistent.
fn properties(message: &OutgoingMessage) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (name, value) in message.headers() {
        headers.insert(
            name.as_str().into(),
            AMQPValue::LongString(LongString::from(value.as_str())),
        );
    }
    BasicProperties::default()
        .with_message_id(message.id().to_string().into())
        .with_type(message.message_type().into())
        .with_headers(headers)
        .with_delivery_mode(2)
}

/// What one message's confirm said, before the batch matches returns to
/// messages: lapin hands a `basic.return` to whichever confirm resolves
/// next on the channel (possibly another message's nack or ack), so which
/// message came back is known only from the returned message's id.
struct Confirm {
    /// The message's own outcome, a return not yet counted.
    outcome: Result<(), PublishFailure>,
    /// A returned message this confirm carried: its `message_id` (any
    /// message's) and the broker's reason.
    carried: Option<(String, String)>,
}

/// Publishes every message and returns their confirms, to await together
/// (within `timeout` from now in all, publishes included); one per
/// message, in order. Owned futures: they are awaited on the batch's own
/// task while the relay publishes the next batch. [`attribute_returns`]
/// turns them into each message's result.
async fn publish_batch(
    channel: &Channel,
    messages: &[OutgoingMessage],
    mandatory: bool,
    timeout: Duration,
) -> Vec<BoxFuture<'static, Confirm>> {
    let deadline = Instant::now() + timeout;
    let options = BasicPublishOptions {
        mandatory,
        ..BasicPublishOptions::default()
    };
    let mut pending = Vec::with_capacity(messages.len());
    for message in messages {
        let started = Instant::now();
        let span = crate::trace::publish_span(message, "rabbitmq");
        let sent = tokio::time::timeout_at(
            deadline,
            channel.basic_publish(
                message.exchange().into(),
                message.routing_key().into(),
                options,
                message.body(),
                properties(message),
            ),
        )
        .instrument(span.clone())
        .await;
        pending.push(
            async move {
                let failed = |failure| Confirm {
                    outcome: Err(failure),
                    carried: None,
                };
                let confirm = match sent {
                    Ok(Ok(confirm)) => confirm,
                    Ok(Err(error)) => return failed(PublishFailure::Channel(error.into())),
                    Err(_) => return failed(PublishFailure::Timeout(timeout)),
                };
                let confirmation = match tokio::time::timeout_at(deadline, confirm).await {
                    Ok(Ok(confirmation)) => confirmation,
                    Ok(Err(error)) => return failed(PublishFailure::Channel(error.into())),
                    Err(_) => return failed(PublishFailure::Timeout(timeout)),
                };
                let acked = confirmation.is_ack();
                let carried = confirmation.take_message().map(|returned| {
                    let id = returned
                        .delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map(ToString::to_string)
                        .unwrap_or_default();
                    (
                        id,
                        format!("{} {}", returned.reply_code, returned.reply_text),
                    )
                });
                if acked {
                    metrics::histogram!(names::OUTBOX_PUBLISH_DURATION)
                        .record(started.elapsed().as_secs_f64());
                }
                Confirm {
                    outcome: if acked {
                        Ok(())
                    } else {
                        Err(PublishFailure::Nack)
                    },
                    carried,
                }
            }
            .instrument(span)
            .boxed(),
        );
    }
    pending
}

/// Each message's result from its batch's confirms: a message whose id
/// came back in a `basic.return`, carried by any confirm of the batch, was
/// returned, even though its own confirm is an ack (the broker acks an
/// unroutable message after returning it). Sound because a batch has its
/// channel to itself from its first publish until every one of its
/// confirms resolved ([`Pool`]; a channel with a confirm unresolved is
/// closed, never reused), and the broker sends a message's return before
/// its confirm: every return lapin hands out meanwhile is one of this
/// batch's messages, and none of them is left for the next batch.
fn attribute_returns(ids: &[String], confirms: Vec<Confirm>) -> Vec<Result<(), PublishFailure>> {
    let mut returned: std::collections::HashMap<String, String> =
        confirms.iter().filter_map(|c| c.carried.clone()).collect();
    ids.iter()
        .zip(confirms)
        .map(
            |(id, confirm)| match (confirm.outcome, returned.remove(id)) {
                (Ok(()), Some(reason)) => Err(PublishFailure::Returned(reason)),
                (outcome, _) => outcome,
            },
        )
        .collect()
}

#[cfg(test)]
mod tests {
    use inbox_api::MessageId;

    use super::*;

    #[test]
    fn a_message_keeps_its_id_type_and_headers() {
        let message = OutgoingMessage::new(MessageId::new_v7(), "x", "k", "T", b"{}".to_vec())
            .and_then(|m| m.with_header("tenant", "acme"))
            .expect("valid");
        let properties = properties(&message);
        assert_eq!(
            properties.message_id().as_ref().map(|id| id.as_str()),
            Some(message.id().to_string().as_str())
        );
        assert_eq!(properties.kind().as_ref().map(|t| t.as_str()), Some("T"));
        assert_eq!(properties.delivery_mode(), &Some(2));
        let headers = properties.headers().clone().unwrap_or_default();
        assert_eq!(
            headers.inner().get("tenant"),
            Some(&AMQPValue::LongString("acme".into()))
        );
    }

    /// lapin hands a return to whichever confirm resolves next: here the
    /// nack of another message carries it, and the returned message's own
    /// confirm is a plain ack. The batch still sees which one came back.
    #[test]
    fn a_return_carried_by_another_confirm_is_charged_to_its_own_message() {
        let message = |n: u8| {
            OutgoingMessage::new(MessageId::new_v7(), "x", "k", "T", vec![n]).expect("valid")
        };
        let (nacked, returned, published) = (message(0), message(1), message(2));
        let confirms = vec![
            Confirm {
                outcome: Err(PublishFailure::Nack),
                carried: Some((returned.id().to_string(), "312 NO_ROUTE".into())),
            },
            Confirm {
                outcome: Ok(()),
                carried: None,
            },
            Confirm {
                outcome: Ok(()),
                carried: None,
            },
        ];
        let ids: Vec<String> = [nacked, returned, published]
            .iter()
            .map(|m| m.id().to_string())
            .collect();
        let results = attribute_returns(&ids, confirms);
        assert!(matches!(results[0], Err(PublishFailure::Nack)));
        assert!(matches!(&results[1], Err(PublishFailure::Returned(r)) if r == "312 NO_ROUTE"));
        assert!(results[2].is_ok());
    }
}
