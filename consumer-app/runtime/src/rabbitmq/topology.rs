//! A [`Topology`] declared on RabbitMQ (see [`crate::topology`] for the
//! shape): the exchanges, queues and bindings, their deletion, and a
//! queue's depth.

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

use crate::AppError;
use crate::amqp::long_string;
use crate::topology::{BROKER_DELIVERY_LIMIT, QueueType, Topology};

impl Topology {
    /// Declares the exchanges, queues and bindings (idempotent).
    ///
    /// # Errors
    /// Broker errors, e.g. an existing queue declared with other arguments.
    pub async fn declare(&self, channel: &Channel) -> Result<(), AppError> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        declare_exchange(channel, self.exchange()).await?;
        for binding in self.bindings() {
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
            let queue_type = long_string(self.queue_type().as_str());
            let mut dlq_args = FieldTable::default();
            dlq_args.insert("x-queue-type".into(), queue_type.clone());
            declare_queue(channel, &dlq, dlq_args).await?;
            bind(channel, &dlq, &dlx, "").await?;

            let mut args = FieldTable::default();
            args.insert("x-queue-type".into(), queue_type);
            args.insert("x-dead-letter-exchange".into(), long_string(&dlx));
            if self.queue_type() == QueueType::Quorum {
                args.insert(
                    "x-delivery-limit".into(),
                    AMQPValue::LongInt(BROKER_DELIVERY_LIMIT),
                );
            }
            declare_queue(channel, queue, args).await?;
            bind(channel, queue, self.exchange(), &binding.routing_key).await?;
        }
        Ok(())
    }

    /// Deletes everything [`Topology::declare`] made (tests, demos).
    ///
    /// # Errors
    /// Broker errors.
    pub async fn delete(&self, channel: &Channel) -> Result<(), AppError> {
        for binding in self.bindings() {
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
pub(crate) async fn declare_exchange(channel: &Channel, exchange: &str) -> Result<(), AppError> {
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
