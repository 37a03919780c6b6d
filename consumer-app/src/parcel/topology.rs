//! The Parcel service's RabbitMQ names, under an optional prefix.
//!
//! ```text
//! {prefix}parcel.events (topic) ──parcel.created──► {prefix}parcel-created-notification (quorum)
//!                                ├─parcel.created──► {prefix}parcel-created-carrier      (quorum)
//!                                └─parcel.carrier-assigned──► {prefix}parcel-carrier-assigned-notification (quorum)
//! each queue ──x-dead-letter-exchange──► {queue}.dlx (fanout) ──► {queue}.dlq (quorum)
//! ```
//!
//! The shape (quorum queues unless `--queue-type classic`, dead-letter
//! exchanges, the delivery limit) is the runtime's [`inbox_runtime::Topology`];
//! this names its parts per [`Role`].

use lapin::Channel;

use crate::parcel::role::Role;
use inbox_runtime::{self, AppError};

/// The names of everything, under an optional prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    prefix: String,
    queue_type: inbox_runtime::QueueType,
}

impl Topology {
    /// Names under `prefix` (may be empty; tests use a unique one).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            queue_type: inbox_runtime::QueueType::default(),
        }
    }

    /// Declares the queues as `queue_type` (quorum by default; classic
    /// queues keep no delivery count, so the attempt ledger alone caps
    /// redeliveries there).
    #[must_use]
    pub fn with_queue_type(mut self, queue_type: inbox_runtime::QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The exchange events are published to.
    pub fn exchange(&self) -> String {
        format!("{}parcel.events", self.prefix)
    }

    /// A consumer's queue.
    pub fn queue(&self, role: Role) -> String {
        format!("{}{}", self.prefix, role.queue_base())
    }

    /// A queue's dead-letter exchange.
    pub fn dead_letter_exchange(&self, role: Role) -> String {
        inbox_runtime::Topology::dead_letter_exchange(&self.queue(role))
    }

    /// A queue's dead-letter queue.
    pub fn dead_letter_queue(&self, role: Role) -> String {
        inbox_runtime::Topology::dead_letter_queue(&self.queue(role))
    }

    /// The runtime's topology: the exchange and every consumer's queue.
    pub fn runtime(&self) -> inbox_runtime::Topology {
        Role::ALL.iter().fold(
            inbox_runtime::Topology::new(self.exchange()).with_queue_type(self.queue_type),
            |topology, role| topology.bind(self.queue(*role), role.routing_key()),
        )
    }

    /// Declares the exchanges, queues and bindings (idempotent).
    ///
    /// # Errors
    /// Broker errors, e.g. an existing queue declared with other arguments.
    pub async fn declare(&self, channel: &Channel) -> Result<(), AppError> {
        self.runtime().declare(channel).await
    }

    /// Deletes everything [`Topology::declare`] made (tests, the demo).
    ///
    /// # Errors
    /// Broker errors.
    pub async fn delete(&self, channel: &Channel) -> Result<(), AppError> {
        self.runtime().delete(channel).await
    }

    /// Deletes it on a connection of its own, bounded in time (see
    /// [`inbox_runtime::Topology::remove`]): the teardown of tests and the demo.
    ///
    /// # Errors
    /// Broker errors, or giving up after the teardown limit.
    pub async fn remove(&self, amqp_url: &str) -> Result<(), AppError> {
        self.runtime().remove(amqp_url).await
    }

    /// Deletes it when the guard is dropped, also when a test panics (see
    /// [`inbox_runtime::Topology::remove_on_drop`]).
    pub fn remove_on_drop(&self, amqp_url: &str) -> inbox_runtime::topology::RemoveOnDrop {
        self.runtime().remove_on_drop(amqp_url)
    }

    /// Ready (unacknowledged ones excluded) messages in a queue, by a passive
    /// declare.
    ///
    /// # Errors
    /// Broker errors; a missing queue closes the channel.
    pub async fn ready_messages(&self, channel: &Channel, queue: &str) -> Result<u32, AppError> {
        inbox_runtime::Topology::ready_messages(channel, queue).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_prefix() {
        let t = Topology::new("t1.");
        assert_eq!(t.exchange(), "t1.parcel.events");
        assert_eq!(t.queue(Role::Carrier), "t1.parcel-created-carrier");
        assert_eq!(
            t.dead_letter_queue(Role::Notification),
            "t1.parcel-created-notification.dlq"
        );
        assert_eq!(
            Topology::new("").queue(Role::Notification),
            "parcel-created-notification"
        );
        let runtime = t.runtime();
        assert_eq!(runtime.exchange(), "t1.parcel.events");
        assert_eq!(runtime.bindings().len(), 3);
    }
}
