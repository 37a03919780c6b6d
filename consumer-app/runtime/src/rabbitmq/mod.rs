//! RabbitMQ as a [`Broker`]: one AMQP connection; the topology declared
//! on a channel of its own; per queue a consuming channel with its
//! prefetch and a confirming channel for its dead letters
//! ([`consume`]).

pub(crate) mod ack;
mod consume;
pub(crate) mod topology;
pub(crate) mod url;

use lapin::Connection;

use crate::AppError;
use crate::amqp::{close_bounded, close_channel_bounded, connect_with, open_channel};
use crate::broker::{Broker, ConnectOptions};
use crate::config::WorkerConfig;
use crate::topology::Topology;
use consume::AmqpSubscription;

/// A connection to RabbitMQ.
pub(crate) struct RabbitMq {
    connection: Connection,
}

impl Broker for RabbitMq {
    type Subscription = AmqpSubscription;

    const NAME: &'static str = "RabbitMQ";

    async fn connect(url: &str, name: &str, options: ConnectOptions) -> Result<Self, AppError> {
        let connection = connect_with(url, name, options).await?;
        Ok(Self { connection })
    }

    async fn declare(&self, topology: &Topology) -> Result<(), AppError> {
        let channel = open_channel(&self.connection, "channel").await?;
        let declared = topology.declare(&channel).await;
        close_channel_bounded(&channel, "topology declared").await;
        declared
    }

    async fn subscribe(
        &self,
        queue: &str,
        consumer: &str,
        config: &WorkerConfig,
    ) -> Result<AmqpSubscription, AppError> {
        AmqpSubscription::open(
            &self.connection,
            queue,
            consumer,
            config.prefetch,
            config.ack_flush,
        )
        .await
    }

    async fn delete(&self, topology: &Topology) -> Result<(), AppError> {
        let channel = open_channel(&self.connection, "channel").await?;
        let deleted = topology.delete(&channel).await;
        close_channel_bounded(&channel, "topology deleted").await;
        deleted
    }

    async fn close(&self, reason: &str) {
        close_bounded(&self.connection, reason).await;
    }
}
