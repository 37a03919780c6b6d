//! The broker as the tools see it, whichever it is: publish a message as a
//! producer would, count what is left in the consumers' queues, read the
//! dead letters with their reasons. The demo speaks only this, so that the
//! same run, with the same checks, works on RabbitMQ and on NATS
//! JetStream; the service and the relay pick their broker from the URL
//! themselves (the runtime's [`BrokerKind::of`]).
//!
//! | what            | RabbitMQ                          | NATS JetStream |
//! |-----------------|-----------------------------------|----------------|
//! | publish         | to the exchange, publisher confirm | to `{exchange}.{key}`, the stream's ack; a `Nats-Msg-Id` seen within the duplicate window is dropped by the stream |
//! | left in a queue | ready messages (passive declare)  | the durable consumer's `num_pending` + `num_ack_pending` |
//! | dead letters    | the queue's `.dlq`, peeked (got, never acked, given back) | subject `dlq.{exchange}.{queue}` of the `{exchange}_DLQ` stream |

use inbox_runtime::AppError;
use inbox_runtime::amqp::{Outgoing, Publisher, close_bounded, connect, open_channel};
use inbox_runtime::async_nats::HeaderMap;
use inbox_runtime::async_nats::jetstream::{self, consumer::pull};
use inbox_runtime::broker::ConnectOptions;
use inbox_runtime::brokers::BrokerKind;
use inbox_runtime::delivery::DEAD_LETTER_REASON;
use inbox_runtime::nats::{self, names};
use lapin::options::BasicGetOptions;

use crate::parcel::role::Role;
use crate::parcel::topology::Topology;

/// The broker a tool runs on, as `--broker` names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BrokerChoice {
    /// RabbitMQ, at `--amqp-url`.
    #[default]
    #[value(name = "rabbitmq")]
    RabbitMq,
    /// NATS JetStream, at `--nats-url`.
    Nats,
}

impl BrokerChoice {
    /// Its `--broker` value.
    pub fn name(self) -> &'static str {
        match self {
            Self::RabbitMq => "rabbitmq",
            Self::Nats => "nats",
        }
    }

    /// The runtime's name for it.
    pub fn kind(self) -> BrokerKind {
        match self {
            Self::RabbitMq => BrokerKind::RabbitMq,
            Self::Nats => BrokerKind::Nats,
        }
    }
}

/// What became of one published message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sent {
    /// Stored, to be delivered to the consumers bound to its key.
    Stored,
    /// Dropped by the broker as a copy of a message id it already had
    /// (JetStream's duplicate window): no consumer will see it.
    DroppedAsDuplicate,
}

/// A dead letter, as read back from the broker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// The queue whose consumer dead-lettered it.
    pub queue: String,
    /// The original message's id, if it had one.
    pub message_id: Option<String>,
    /// `x-dead-letter-reason` (e.g. `invalid_json`, `retries_exhausted`).
    pub reason: Option<String>,
}

/// An open connection to the broker of a URL, for the tools.
pub enum Broker {
    /// RabbitMQ (`amqp://`, `amqps://`), with a confirming publisher per
    /// (exchange, routing key) opened on first use: a channel per message
    /// would cost a round trip each.
    RabbitMq {
        /// The connection.
        connection: lapin::Connection,
        /// The publishers opened so far.
        publishers: tokio::sync::Mutex<Vec<((String, String), Publisher)>>,
    },
    /// NATS JetStream (`nats://`, `tls://`).
    Nats(jetstream::Context),
}

impl Broker {
    /// Connects to the broker `url`'s scheme names, as `name`.
    ///
    /// # Errors
    /// An unknown scheme, or the broker's connection error.
    pub async fn connect(url: &str, name: &str) -> Result<Self, AppError> {
        match BrokerKind::of(url)? {
            BrokerKind::RabbitMq => Ok(Self::RabbitMq {
                connection: connect(url, name).await?,
                publishers: tokio::sync::Mutex::default(),
            }),
            BrokerKind::Nats => {
                let client = nats::connect(url, name, ConnectOptions::default()).await?;
                Ok(Self::Nats(jetstream::new(client)))
            }
        }
    }

    /// The broker's name in output.
    pub fn name(&self) -> &'static str {
        match self {
            Self::RabbitMq { .. } => BrokerKind::RabbitMq.name(),
            Self::Nats(_) => BrokerKind::Nats.name(),
        }
    }

    /// Publishes `message` to `exchange` with `routing_key` and waits until
    /// the broker has it (publisher confirm, stream ack). The exchange (the
    /// stream) must exist: the service declares it.
    ///
    /// # Errors
    /// A message the broker did not take.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Outgoing,
    ) -> Result<Sent, AppError> {
        match self {
            Self::RabbitMq {
                connection,
                publishers,
            } => {
                let route = (exchange.to_owned(), routing_key.to_owned());
                let mut publishers = publishers.lock().await;
                let index = match publishers.iter().position(|(r, _)| *r == route) {
                    Some(index) => index,
                    None => {
                        let publisher = Publisher::new(connection, exchange, routing_key).await?;
                        publishers.push((route, publisher));
                        publishers.len() - 1
                    }
                };
                publishers[index].1.publish(message).await?;
                Ok(Sent::Stored)
            }
            Self::Nats(js) => {
                let id = message.message_id.as_deref().ok_or_else(|| {
                    AppError::Config("a message to JetStream needs an id (Nats-Msg-Id)".into())
                })?;
                let stored = nats::publish_confirmed(
                    js,
                    &names::subject(exchange, routing_key),
                    id,
                    message.kind.as_deref(),
                    HeaderMap::new(),
                    message.body.clone(),
                )
                .await
                .map_err(|e| AppError::broker(format!("publish to {exchange}"), e))?;
                Ok(if stored.duplicate {
                    Sent::DroppedAsDuplicate
                } else {
                    Sent::Stored
                })
            }
        }
    }

    /// Messages still waiting in, or delivered and unsettled from, each
    /// consumer's queue, and dead letters of each: `(name, count)`, the
    /// queue then its dead letters, per role.
    ///
    /// On RabbitMQ a queue's count is its ready messages (unacknowledged
    /// ones are not counted, as a passive declare reports); on JetStream it
    /// is the consumer's pending plus its unacknowledged ones.
    ///
    /// # Errors
    /// Broker errors, e.g. a queue that is not there.
    pub async fn leftovers(&self, topology: &Topology) -> Result<Vec<(String, u64)>, AppError> {
        let mut left = Vec::new();
        match self {
            Self::RabbitMq { connection, .. } => {
                let channel = open_channel(connection, "an inspection channel").await?;
                for role in Role::ALL {
                    for queue in [topology.queue(role), topology.dead_letter_queue(role)] {
                        let ready = topology.ready_messages(&channel, &queue).await?;
                        left.push((queue, u64::from(ready)));
                    }
                }
                let _ = channel.close(200, "inspected".into()).await;
            }
            Self::Nats(js) => {
                let exchange = topology.exchange();
                let letters = self.dead_letters(topology).await?;
                let stream = js
                    .get_stream(names::stream_name(&exchange))
                    .await
                    .map_err(|e| AppError::broker(format!("find the stream of {exchange}"), e))?;
                for role in Role::ALL {
                    let queue = topology.queue(role);
                    let mut consumer: jetstream::consumer::Consumer<pull::Config> = stream
                        .get_consumer(&names::consumer_name(&queue))
                        .await
                        .map_err(|e| {
                            AppError::broker(format!("find the consumer of {queue}"), e)
                        })?;
                    let info = consumer.info().await.map_err(|e| {
                        AppError::broker(format!("inspect the consumer of {queue}"), e)
                    })?;
                    let unsettled = u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX);
                    left.push((queue.clone(), info.num_pending.saturating_add(unsettled)));
                    let dead = letters.iter().filter(|l| l.queue == queue).count() as u64;
                    left.push((names::dead_letter_subject(&exchange, &queue), dead));
                }
            }
        }
        Ok(left)
    }

    /// Every consumer's dead letters, with their reasons, left where they
    /// are.
    ///
    /// # Errors
    /// Broker errors.
    pub async fn dead_letters(&self, topology: &Topology) -> Result<Vec<DeadLetter>, AppError> {
        match self {
            Self::RabbitMq { connection, .. } => peek_dead_letters(connection, topology).await,
            Self::Nats(js) => read_dead_letter_stream(js, topology).await,
        }
    }

    /// Closes the connection (bounded; what was published is out).
    pub async fn close(self) {
        match self {
            Self::RabbitMq {
                connection,
                publishers,
            } => {
                for (_, publisher) in publishers.into_inner() {
                    publisher.close().await;
                }
                close_bounded(&connection, "done").await;
            }
            Self::Nats(js) => {
                let client = js.client();
                if let Err(error) = client.drain().await {
                    tracing::debug!(error = %error, "draining the NATS connection failed");
                }
            }
        }
    }
}

/// RabbitMQ: each dead-letter queue's messages, got without an ack on a
/// channel of their own, which closing gives back to the queue in order.
async fn peek_dead_letters(
    connection: &lapin::Connection,
    topology: &Topology,
) -> Result<Vec<DeadLetter>, AppError> {
    let mut letters = Vec::new();
    for role in Role::ALL {
        let queue = topology.dead_letter_queue(role);
        let channel = open_channel(connection, "a dead-letter channel").await?;
        // A missing queue fails here, before any read.
        inbox_runtime::Topology::ready_messages(&channel, &queue).await?;
        while let Some(message) = channel
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
            .await
            .map_err(|e| AppError::broker(format!("read {queue}"), e))?
        {
            let properties = &message.delivery.properties;
            letters.push(DeadLetter {
                queue: topology.queue(role),
                message_id: properties.message_id().as_ref().map(ToString::to_string),
                reason: properties
                    .headers()
                    .as_ref()
                    .and_then(|h| inbox_runtime::message::header_text(h, DEAD_LETTER_REASON)),
            });
        }
        // Never acked: closing the channel puts them back.
        let _ = channel.close(200, "peeked".into()).await;
    }
    Ok(letters)
}

/// JetStream: the exchange's dead-letter stream, read by sequence (a
/// direct get: no consumer, nothing acked), each letter's queue from its
/// subject.
async fn read_dead_letter_stream(
    js: &jetstream::Context,
    topology: &Topology,
) -> Result<Vec<DeadLetter>, AppError> {
    let exchange = topology.exchange();
    let stream_name = names::dead_letter_stream(&exchange);
    let mut stream = js
        .get_stream(&stream_name)
        .await
        .map_err(|e| AppError::broker(format!("find stream {stream_name}"), e))?;
    let state = stream
        .info()
        .await
        .map_err(|e| AppError::broker(format!("inspect stream {stream_name}"), e))?
        .state
        .clone();
    let mut letters = Vec::new();
    if state.messages == 0 {
        return Ok(letters);
    }
    let queues: Vec<(String, String)> = Role::ALL
        .iter()
        .map(|role| {
            let queue = topology.queue(*role);
            (names::dead_letter_subject(&exchange, &queue), queue)
        })
        .collect();
    for sequence in state.first_sequence..=state.last_sequence {
        // A letter purged in between leaves a gap: not an error.
        let Ok(message) = stream.get_raw_message(sequence).await else {
            continue;
        };
        let header = |name: &str| {
            message
                .headers
                .get(name)
                .map(|value| value.as_str().to_owned())
        };
        let queue = queues
            .iter()
            .find(|(subject, _)| *subject == message.subject.as_str())
            .map_or_else(|| message.subject.to_string(), |(_, queue)| queue.clone());
        letters.push(DeadLetter {
            queue,
            message_id: header(names::ORIGINAL_MESSAGE_ID),
            reason: header(DEAD_LETTER_REASON),
        });
    }
    Ok(letters)
}
