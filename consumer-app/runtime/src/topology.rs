//! The topology a service declares: where messages are published (an
//! exchange), the queues bound to it, and their dead letters. Each broker
//! declares it in its own terms; on RabbitMQ: one topic exchange, and per
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

use crate::AppError;

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
}

/// Removing a topology from whichever broker its URL names.
pub use crate::brokers::RemoveOnDrop;

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
