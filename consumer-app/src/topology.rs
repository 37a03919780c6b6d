//! The RabbitMQ topology the app declares, and its names.
//!
//! ```text
//! {prefix}parcel.events (topic) ──parcel.created──► {prefix}parcel-created-notification (quorum)
//!                                └─parcel.created──► {prefix}parcel-created-carrier      (quorum)
//! each queue ──x-dead-letter-exchange──► {queue}.dlx (fanout) ──► {queue}.dlq (quorum)
//! ```
//!
//! Quorum queues: replicated, durable, and they count deliveries
//! (`x-delivery-count`), which the message path uses to bound redeliveries.
//! The queue's own dead-letter exchange is the safety net for what the app
//! cannot dead-letter itself (a `reject` when the dead-letter publish failed,
//! the broker's delivery limit); the app normally publishes to the same
//! exchange itself, with its reason headers (see [`crate::worker`]).

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, ExchangeKind};

use crate::AppError;
use crate::consumers::Role;
use crate::event::ROUTING_KEY;

/// The broker's own cap on deliveries of one message (`x-delivery-limit`),
/// above the app's `--max-deliveries`: only reached if the app cannot act.
/// A constant because changing a queue's arguments needs a new queue.
pub const BROKER_DELIVERY_LIMIT: i32 = 50;

/// The names of everything, under an optional prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    prefix: String,
}

impl Topology {
    /// Names under `prefix` (may be empty; tests use a unique one).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
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
        format!("{}.dlx", self.queue(role))
    }

    /// A queue's dead-letter queue.
    pub fn dead_letter_queue(&self, role: Role) -> String {
        format!("{}.dlq", self.queue(role))
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
        channel
            .exchange_declare(
                self.exchange().into(),
                ExchangeKind::Topic,
                durable,
                FieldTable::default(),
            )
            .await
            .map_err(|e| AppError::broker(format!("declare exchange {}", self.exchange()), e))?;
        for role in Role::ALL {
            let dlx = self.dead_letter_exchange(role);
            let dlq = self.dead_letter_queue(role);
            let queue = self.queue(role);
            channel
                .exchange_declare(
                    dlx.clone().into(),
                    ExchangeKind::Fanout,
                    durable,
                    FieldTable::default(),
                )
                .await
                .map_err(|e| AppError::broker(format!("declare exchange {dlx}"), e))?;
            let mut dlq_args = FieldTable::default();
            dlq_args.insert("x-queue-type".into(), long_string("quorum"));
            declare_queue(channel, &dlq, dlq_args).await?;
            bind(channel, &dlq, &dlx, "").await?;

            let mut args = FieldTable::default();
            args.insert("x-queue-type".into(), long_string("quorum"));
            args.insert("x-dead-letter-exchange".into(), long_string(&dlx));
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongInt(BROKER_DELIVERY_LIMIT),
            );
            declare_queue(channel, &queue, args).await?;
            bind(channel, &queue, &self.exchange(), ROUTING_KEY).await?;
        }
        Ok(())
    }

    /// Deletes everything [`Topology::declare`] made (tests, the demo).
    ///
    /// # Errors
    /// Broker errors.
    pub async fn delete(&self, channel: &Channel) -> Result<(), AppError> {
        for role in Role::ALL {
            for queue in [self.queue(role), self.dead_letter_queue(role)] {
                channel
                    .queue_delete(queue.clone().into(), QueueDeleteOptions::default())
                    .await
                    .map_err(|e| AppError::broker(format!("delete queue {queue}"), e))?;
            }
            let dlx = self.dead_letter_exchange(role);
            channel
                .exchange_delete(dlx.clone().into(), ExchangeDeleteOptions::default())
                .await
                .map_err(|e| AppError::broker(format!("delete exchange {dlx}"), e))?;
        }
        channel
            .exchange_delete(self.exchange().into(), ExchangeDeleteOptions::default())
            .await
            .map_err(|e| AppError::broker(format!("delete exchange {}", self.exchange()), e))?;
        Ok(())
    }

    /// Ready (unacknowledged ones excluded) messages in a queue, by a passive
    /// declare.
    ///
    /// # Errors
    /// Broker errors; a missing queue closes the channel.
    pub async fn ready_messages(&self, channel: &Channel, queue: &str) -> Result<u32, AppError> {
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

fn long_string(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
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
    }
}
