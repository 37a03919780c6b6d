//! The relay's NATS JetStream outlet: each message published to
//! `{exchange}.{routing key}` with its outbox id in `Nats-Msg-Id`, and
//! the stream's acknowledgement awaited.
//!
//! JetStream answers each publish on its own (no channel whose returns a
//! batch must keep to itself), so a lane is the JetStream context itself,
//! cloned per batch. A re-publish of a message whose mark was lost is
//! stored once, within the stream's duplicate window
//! ([`crate::nats::DUPLICATE_WINDOW`]): a second guard behind the
//! consumers' inboxes. What no stream takes ("no responders") is the
//! message's own refusal, as an unroutable message is on RabbitMQ; a
//! message that a stream takes but no consumer's filter matches is
//! acknowledged and dropped by interest retention, as RabbitMQ drops a
//! message to an exchange without a matching queue when `mandatory` is
//! off: JetStream cannot say which.

use std::collections::HashSet;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use futures::FutureExt as _;
use futures::future::BoxFuture;
use inbox_api::OutgoingMessage;
use inbox_api::metrics as names;
use tokio::time::Instant;
use tracing::Instrument as _;

use super::outlet::{Outlet, PublishFailure};
use crate::AppError;
use crate::broker::{Broker as _, ConnectOptions};
use crate::nats::names::{MESSAGE_TYPE, NATS_MSG_ID, subject};
use crate::nats::{JetStream, PublishFailure as Refusal};

/// The relay's connection to a NATS server with JetStream.
pub(crate) struct JetStreamOutlet {
    broker: JetStream,
    /// The exchanges whose streams exist (declared once per connection).
    declared: HashSet<String>,
}

impl Outlet for JetStreamOutlet {
    type Lane = Context;

    const NAME: &'static str = JetStream::NAME;

    async fn connect(url: &str, name: &str, options: ConnectOptions) -> Result<Self, AppError> {
        Ok(Self {
            broker: JetStream::connect(url, name, options).await?,
            declared: HashSet::new(),
        })
    }

    fn is_open(&self) -> bool {
        self.broker.is_open()
    }

    /// The context, once the exchanges' streams exist.
    async fn lane(&mut self, exchanges: &[String]) -> Result<Context, AppError> {
        for exchange in exchanges {
            if !self.declared.contains(exchange) {
                self.broker.declare_stream(exchange).await?;
                self.declared.insert(exchange.clone());
            }
        }
        Ok(self.broker.context().clone())
    }

    async fn publish(
        lane: &Context,
        messages: &[OutgoingMessage],
        _mandatory: bool,
        timeout: Duration,
    ) -> BoxFuture<'static, Vec<Result<(), PublishFailure>>> {
        let deadline = Instant::now() + timeout;
        let mut pending = Vec::with_capacity(messages.len());
        for message in messages {
            let started = Instant::now();
            let span = crate::trace::publish_span(message, "nats");
            let subject = subject(message.exchange(), message.routing_key());
            let sent = tokio::time::timeout_at(
                deadline,
                lane.publish_with_headers(
                    subject,
                    headers(message),
                    message.body().to_vec().into(),
                ),
            )
            .instrument(span.clone())
            .await;
            pending.push(
                async move {
                    let ack = match sent {
                        Ok(Ok(ack)) => ack,
                        Ok(Err(error)) => return Err(failure(Refusal::of(error))),
                        Err(_) => return Err(PublishFailure::Timeout(timeout)),
                    };
                    match tokio::time::timeout_at(deadline, ack.into_future()).await {
                        Ok(Ok(_)) => {
                            metrics::histogram!(names::OUTBOX_PUBLISH_DURATION)
                                .record(started.elapsed().as_secs_f64());
                            Ok(())
                        }
                        Ok(Err(error)) => Err(failure(Refusal::of(error))),
                        Err(_) => Err(PublishFailure::Timeout(timeout)),
                    }
                }
                .instrument(span)
                .boxed(),
            );
        }
        futures::future::join_all(pending).boxed()
    }

    fn give_back(&mut self, _lanes: Vec<Context>) {}

    async fn retire(_lane: Context) {}

    async fn close(self) {
        self.broker.close("relay stopping").await;
    }
}

/// The message's headers on NATS: its own, its id in `Nats-Msg-Id` (the
/// same on every publish: what the stream's duplicate window and the
/// consumers' inboxes deduplicate on) and its type.
fn headers(message: &OutgoingMessage) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in message.headers() {
        headers.insert(name.as_str(), value.as_str());
    }
    headers.insert(NATS_MSG_ID, message.id().to_string().as_str());
    headers.insert(MESSAGE_TYPE, message.message_type());
    headers
}

/// A JetStream publish failure as the relay counts it: a refusal is
/// charged to its message (as a return is on RabbitMQ), the rest not.
fn failure(refusal: Refusal) -> PublishFailure {
    match refusal {
        Refusal::Refused(error) => PublishFailure::Returned(error.to_string()),
        Refusal::Unconfirmed(error) => PublishFailure::Channel(error.into()),
    }
}

#[cfg(test)]
mod tests {
    use async_nats::jetstream::context::{PublishError, PublishErrorKind};
    use inbox_api::MessageId;

    use super::*;

    #[test]
    fn a_message_keeps_its_id_type_and_headers() {
        let message = OutgoingMessage::new(MessageId::new_v7(), "x", "k", "T", b"{}".to_vec())
            .and_then(|m| m.with_header("tenant", "acme"))
            .expect("valid");
        let headers = headers(&message);
        let id = message.id().to_string();
        assert_eq!(
            headers.get(NATS_MSG_ID).map(|v| v.as_str()),
            Some(id.as_str())
        );
        assert_eq!(headers.get(MESSAGE_TYPE).map(|v| v.as_str()), Some("T"));
        assert_eq!(headers.get("tenant").map(|v| v.as_str()), Some("acme"));
    }

    #[test]
    fn only_a_refusal_is_charged_to_its_message() {
        let refused = failure(Refusal::of(PublishError::new(
            PublishErrorKind::StreamNotFound,
        )));
        assert!(refused.is_refusal(), "{refused:?}");
        let lost = failure(Refusal::of(PublishError::new(PublishErrorKind::BrokenPipe)));
        assert!(!lost.is_refusal() && lost.breaks_channel(), "{lost:?}");
    }
}
