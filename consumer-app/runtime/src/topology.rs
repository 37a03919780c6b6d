//! The RabbitMQ topology a service declares: one topic exchange, and per
//! consumer a quorum queue with its own dead-letter exchange and queue.
//!
//! ```text
//! exchange (topic) ──routing key──► queue (quorum) ──x-dead-letter-exchange──► {queue}.dlx (fanout) ──► {queue}.dlq (quorum)
//! ```
//!
//! Quorum queues by default: replicated, durable, and they count
//! deliveries (`x-delivery-count`), which the settle policy uses to bound
//! redeliveries beside the store's attempt ledger. Classic queues
//! ([`QueueType::Classic`]) count nothing; there the ledger alone bounds
//! them. The queue's own dead-letter exchange is the safety net for
//! what the runtime cannot dead-letter itself (a `reject` when the
//! dead-letter publish failed, the broker's delivery limit); the runtime
//! normally publishes to the same exchange itself, with its reason headers.
//! The `.dlx`/`.dlq` names are a convention the message path relies on, so
//! they are derived here, not configured.

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

use crate::AppError;
use crate::amqp::long_string;
use crate::amqp::{close_bounded, connect};
use crate::shutdown::TEARDOWN_LIMIT;

/// The broker's own cap on deliveries of one message (`x-delivery-limit`),
/// above any sensible `max_deliveries`: only reached if the runtime cannot
/// act. A constant because changing a queue's arguments needs a new queue.
pub const BROKER_DELIVERY_LIMIT: i32 = 50;

/// The kind of queue [`Topology::declare`] makes, for the work queues and
/// their dead-letter queues alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QueueType {
    /// Replicated, counts deliveries (`x-delivery-count`), with the
    /// broker's own delivery limit as a last resort.
    #[default]
    Quorum,
    /// A single-node queue that keeps no delivery count: the delivery cap
    /// then rests on the store's attempt ledger alone.
    Classic,
}

impl QueueType {
    /// The `x-queue-type` argument.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Quorum => "quorum",
            Self::Classic => "classic",
        }
    }
}

impl std::str::FromStr for QueueType {
    type Err = AppError;

    fn from_str(text: &str) -> Result<Self, AppError> {
        match text {
            "quorum" => Ok(Self::Quorum),
            "classic" => Ok(Self::Classic),
            other => Err(AppError::Config(format!(
                "queue type {other:?}: expected quorum or classic"
            ))),
        }
    }
}

/// A queue bound to the exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// The queue's name.
    pub queue: String,
    /// The routing key it is bound with.
    pub routing_key: String,
}

/// An exchange and the queues bound to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    exchange: String,
    bindings: Vec<Binding>,
    queue_type: QueueType,
}

impl Topology {
    /// A topic exchange named `exchange`, with no queue yet.
    pub fn new(exchange: impl Into<String>) -> Self {
        Self {
            exchange: exchange.into(),
            bindings: Vec::new(),
            queue_type: QueueType::default(),
        }
    }

    /// Declares its queues as `queue_type` (quorum by default).
    #[must_use]
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// The kind of queue it declares.
    pub fn queue_type(&self) -> QueueType {
        self.queue_type
    }

    /// Adds `queue`, bound with `routing_key` (and its dead-letter exchange
    /// and queue).
    #[must_use]
    pub fn bind(mut self, queue: impl Into<String>, routing_key: impl Into<String>) -> Self {
        self.bindings.push(Binding {
            queue: queue.into(),
            routing_key: routing_key.into(),
        });
        self
    }

    /// The exchange messages are published to.
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The queues, in the order they were bound.
    pub fn bindings(&self) -> &[Binding] {
        &self.bindings
    }

    /// A queue's dead-letter exchange.
    pub fn dead_letter_exchange(queue: &str) -> String {
        format!("{queue}.dlx")
    }

    /// A queue's dead-letter queue.
    pub fn dead_letter_queue(queue: &str) -> String {
        format!("{queue}.dlq")
    }

    /// Declares the exchanges, queues and bindings (idempotent).
    ///
    /// # Errors
    /// Broker errors, e.g. an existing queue declared with other arguments.
    pub async fn declare(&self, channel: &Channel) -> Result<(), AppError> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        declare_exchange(channel, &self.exchange).await?;
        for binding in &self.bindings {
            let queue = &binding.queue;
            let dlx = Self::dead_letter_exchange(queue);
            let dlq = Self::dead_letter_queue(queue);
            channel
                .exchange_declare(
                    dlx.clone().into(),
                    ExchangeKind::Fanout,
                    durable,
                    FieldTable::default(),
                )
                .await
                .map_err(|e| AppError::broker(format!("declare exchange {dlx}"), e))?;
            let queue_type = long_string(self.queue_type.as_str());
            let mut dlq_args = FieldTable::default();
            dlq_args.insert("x-queue-type".into(), queue_type.clone());
            declare_queue(channel, &dlq, dlq_args).await?;
            bind(channel, &dlq, &dlx, "").await?;

            let mut args = FieldTable::default();
            args.insert("x-queue-type".into(), queue_type);
            args.insert("x-dead-letter-exchange".into(), long_string(&dlx));
            if self.queue_type == QueueType::Quorum {
                args.insert(
                    "x-delivery-limit".into(),
                    AMQPValue::LongInt(BROKER_DELIVERY_LIMIT),
                );
            }
            declare_queue(channel, queue, args).await?;
            bind(channel, queue, &self.exchange, &binding.routing_key).await?;
        }
        Ok(())
    }

    /// Deletes everything [`Topology::declare`] made (tests, demos).
    ///
    /// # Errors
    /// Broker errors.
    pub async fn delete(&self, channel: &Channel) -> Result<(), AppError> {
        for binding in &self.bindings {
            let queue = &binding.queue;
            for queue in [queue.clone(), Self::dead_letter_queue(queue)] {
                channel
                    .queue_delete(queue.clone().into(), QueueDeleteOptions::default())
                    .await
                    .map_err(|e| AppError::broker(format!("delete queue {queue}"), e))?;
            }
            let dlx = Self::dead_letter_exchange(queue);
            channel
                .exchange_delete(dlx.clone().into(), ExchangeDeleteOptions::default())
                .await
                .map_err(|e| AppError::broker(format!("delete exchange {dlx}"), e))?;
        }
        channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await
            .map_err(|e| AppError::broker(format!("delete exchange {}", self.exchange), e))?;
        Ok(())
    }

    /// [`Topology::delete`] on a connection of its own, closed afterwards
    /// whatever happened; gives up (with a log line) after
    /// [`TEARDOWN_LIMIT`] per step, so a teardown never hangs.
    ///
    /// # Errors
    /// Broker errors, or [`AppError::Unavailable`] when it gave up.
    pub async fn remove(&self, amqp_url: &str) -> Result<(), AppError> {
        let connection =
            tokio::time::timeout(TEARDOWN_LIMIT, connect(amqp_url, "topology removal"))
                .await
                .map_err(|_| {
                    AppError::Unavailable(format!(
                        "no broker connection within {TEARDOWN_LIMIT:?} to delete the topology"
                    ))
                })??;
        let delete = async {
            let channel = crate::amqp::open_channel(&connection, "channel").await?;
            self.delete(&channel).await
        };
        let result = match tokio::time::timeout(TEARDOWN_LIMIT, delete).await {
            Ok(result) => result,
            Err(_) => {
                tracing::warn!(exchange = %self.exchange, "topology delete not done in {TEARDOWN_LIMIT:?}; giving up");
                Err(AppError::Unavailable(format!(
                    "topology delete not done in {TEARDOWN_LIMIT:?}"
                )))
            }
        };
        close_bounded(&connection, "topology removed").await;
        result
    }

    /// A guard that, when dropped, deletes this topology as
    /// [`Topology::remove`] does: a test's queues go whether the test
    /// passed or panicked half-way.
    pub fn remove_on_drop(&self, amqp_url: &str) -> RemoveOnDrop {
        RemoveOnDrop {
            topology: self.clone(),
            amqp_url: amqp_url.to_owned(),
        }
    }

    /// Ready (unacknowledged ones excluded) messages in a queue, by a passive
    /// declare.
    ///
    /// # Errors
    /// Broker errors; a missing queue closes the channel.
    pub async fn ready_messages(channel: &Channel, queue: &str) -> Result<u32, AppError> {
        let declared = channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| AppError::broker(format!("inspect queue {queue}"), e))?;
        Ok(declared.message_count())
    }
}

/// Declares `exchange` as every [`Topology`] declares its exchange:
/// durable, topic (idempotent). What a publisher that must not wait for a
/// consumer's declaration (the outbox relay) declares before publishing.
///
/// # Errors
/// Broker errors, e.g. the exchange exists with another kind.
pub async fn declare_exchange(channel: &Channel, exchange: &str) -> Result<(), AppError> {
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|e| AppError::broker(format!("declare exchange {exchange}"), e))
}

async fn declare_queue(channel: &Channel, queue: &str, args: FieldTable) -> Result<(), AppError> {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            args,
        )
        .await
        .map_err(|e| AppError::broker(format!("declare queue {queue}"), e))?;
    Ok(())
}

async fn bind(channel: &Channel, queue: &str, exchange: &str, key: &str) -> Result<(), AppError> {
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| AppError::broker(format!("bind {queue} to {exchange}"), e))
}

/// Deletes its topology when dropped (see [`Topology::remove_on_drop`]).
/// Drop cannot await, so the removal runs on a thread of its own with a
/// small runtime, each step bounded; a failure only logs.
#[derive(Debug)]
pub struct RemoveOnDrop {
    topology: Topology,
    amqp_url: String,
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let topology = self.topology.clone();
        let amqp_url = std::mem::take(&mut self.amqp_url);
        let removal = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            match runtime {
                Ok(runtime) => {
                    if let Err(error) = runtime.block_on(topology.remove(&amqp_url)) {
                        tracing::warn!(exchange = %topology.exchange, error = %error,
                            "deleting the topology failed");
                    }
                }
                Err(error) => tracing::warn!(error = %error, "no runtime to delete the topology"),
            }
        });
        let _ = removal.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letter_names_follow_the_queue() {
        let t = Topology::new("x.events").bind("x.q", "k");
        assert_eq!(t.exchange(), "x.events");
        assert_eq!(t.bindings()[0].routing_key, "k");
        assert_eq!(Topology::dead_letter_exchange("x.q"), "x.q.dlx");
        assert_eq!(Topology::dead_letter_queue("x.q"), "x.q.dlq");
    }

    #[test]
    fn queue_types_parse_and_default_to_quorum() {
        assert_eq!(Topology::new("x").queue_type(), QueueType::Quorum);
        let classic = Topology::new("x").with_queue_type(QueueType::Classic);
        assert_eq!(classic.queue_type().as_str(), "classic");
        assert_eq!("quorum".parse::<QueueType>().ok(), Some(QueueType::Quorum));
        assert_eq!(
            "classic".parse::<QueueType>().ok(),
            Some(QueueType::Classic)
        );
        assert!("stream".parse::<QueueType>().is_err());
    }
}
