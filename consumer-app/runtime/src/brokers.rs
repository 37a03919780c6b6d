//! The brokers the runtime speaks, and a connection to whichever of them
//! a URL names: what the service's supervisor holds, so that a
//! [`crate::Service`] is one type whatever its broker.

use crate::AppError;
use crate::broker::{Broker, ConnectOptions};
use crate::redact::redact_url;
use crate::topology::Topology;

/// The brokers the runtime speaks, as a URL's scheme names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerKind {
    /// RabbitMQ (AMQP 0-9-1): `amqp://` or `amqps://`.
    RabbitMq,
}

impl BrokerKind {
    /// The broker `url` names by its scheme.
    ///
    /// # Errors
    /// [`AppError::Config`] for a scheme the runtime does not speak.
    pub fn of(url: &str) -> Result<Self, AppError> {
        let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
        match scheme.to_ascii_lowercase().as_str() {
            "amqp" | "amqps" => Ok(Self::RabbitMq),
            _ => Err(AppError::Config(format!(
                "broker URL {}: expected amqp:// or amqps://",
                redact_url(url)
            ))),
        }
    }

    /// The broker's name in log lines.
    pub fn name(self) -> &'static str {
        match self {
            Self::RabbitMq => crate::rabbitmq::RabbitMq::NAME,
        }
    }
}

/// A connection to whichever broker the URL named.
pub(crate) enum Connected {
    RabbitMq(crate::rabbitmq::RabbitMq),
}

impl Connected {
    /// Connects once to the broker `url` names.
    pub(crate) async fn connect(
        url: &str,
        name: &str,
        options: ConnectOptions,
    ) -> Result<Self, AppError> {
        match BrokerKind::of(url)? {
            BrokerKind::RabbitMq => crate::rabbitmq::RabbitMq::connect(url, name, options)
                .await
                .map(Self::RabbitMq),
        }
    }

    pub(crate) async fn declare(&self, topology: &Topology) -> Result<(), AppError> {
        match self {
            Self::RabbitMq(broker) => broker.declare(topology).await,
        }
    }

    pub(crate) async fn close(&self, reason: &str) {
        match self {
            Self::RabbitMq(broker) => broker.close(reason).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scheme_picks_the_broker() {
        assert_eq!(
            BrokerKind::of("amqp://h/%2f").ok(),
            Some(BrokerKind::RabbitMq)
        );
        assert_eq!(BrokerKind::of("AMQPS://h").ok(), Some(BrokerKind::RabbitMq));
        let error = BrokerKind::of("kafka://user:secret@h:9092")
            .expect_err("not a broker of ours")
            .to_string();
        assert!(error.contains("amqp://"), "{error}");
        assert!(!error.contains("secret"), "{error}");
    }
}
