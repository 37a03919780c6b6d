//! The brokers the runtime speaks, and a connection to whichever of them
//! a URL names: what the service's supervisor holds, so that a
//! [`crate::Service`] is one type whatever its broker.

use crate::AppError;
use crate::broker::{Broker, ConnectOptions};
use crate::redact::redact_url;
use crate::shutdown::TEARDOWN_LIMIT;
use crate::topology::Topology;

/// The URL schemes this build speaks, for the error that names them.
const SCHEMES: &str = match (cfg!(feature = "rabbitmq"), cfg!(feature = "nats")) {
    (true, true) => "amqp://, amqps://, nats:// or tls://",
    (true, false) => "amqp:// or amqps://",
    (false, _) => "nats:// or tls://",
};

/// The brokers the runtime speaks, as a URL's scheme names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerKind {
    /// RabbitMQ (AMQP 0-9-1): `amqp://` or `amqps://`.
    #[cfg(feature = "rabbitmq")]
    RabbitMq,
    /// NATS JetStream: `nats://` or `tls://` (the `nats` feature).
    #[cfg(feature = "nats")]
    Nats,
}

impl BrokerKind {
    /// The broker `url` names by its scheme.
    ///
    /// # Errors
    /// [`AppError::Config`] for a scheme the runtime does not speak.
    pub fn of(url: &str) -> Result<Self, AppError> {
        let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
        match scheme.to_ascii_lowercase().as_str() {
            #[cfg(feature = "rabbitmq")]
            "amqp" | "amqps" => Ok(Self::RabbitMq),
            #[cfg(not(feature = "rabbitmq"))]
            "amqp" | "amqps" => Err(not_built(url, "rabbitmq")),
            #[cfg(feature = "nats")]
            "nats" | "tls" => Ok(Self::Nats),
            #[cfg(not(feature = "nats"))]
            "nats" | "tls" => Err(not_built(url, "nats")),
            _ => Err(AppError::Config(format!(
                "broker URL {}: expected {SCHEMES}",
                redact_url(url)
            ))),
        }
    }

    /// The broker's name in log lines.
    pub fn name(self) -> &'static str {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq => crate::rabbitmq::RabbitMq::NAME,
            #[cfg(feature = "nats")]
            Self::Nats => crate::nats::JetStream::NAME,
        }
    }
}

/// The error for a URL of a broker whose feature is off.
#[cfg_attr(all(feature = "rabbitmq", feature = "nats"), allow(dead_code))]
fn not_built(url: &str, feature: &str) -> AppError {
    AppError::Config(format!(
        "broker URL {}: inbox-runtime was built without its `{feature}` feature",
        redact_url(url)
    ))
}

/// A connection to whichever broker the URL named.
#[allow(
    clippy::large_enum_variant,
    reason = "one value per connection, held for its life: its size costs nothing"
)]
pub(crate) enum Connected {
    #[cfg(feature = "rabbitmq")]
    RabbitMq(crate::rabbitmq::RabbitMq),
    #[cfg(feature = "nats")]
    Nats(crate::nats::JetStream),
}

impl Connected {
    /// Connects once to the broker `url` names.
    pub(crate) async fn connect(
        url: &str,
        name: &str,
        options: ConnectOptions,
    ) -> Result<Self, AppError> {
        match BrokerKind::of(url)? {
            #[cfg(feature = "rabbitmq")]
            BrokerKind::RabbitMq => crate::rabbitmq::RabbitMq::connect(url, name, options)
                .await
                .map(Self::RabbitMq),
            #[cfg(feature = "nats")]
            BrokerKind::Nats => crate::nats::JetStream::connect(url, name, options)
                .await
                .map(Self::Nats),
        }
    }

    pub(crate) async fn declare(&self, topology: &Topology) -> Result<(), AppError> {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(broker) => broker.declare(topology).await,
            #[cfg(feature = "nats")]
            Self::Nats(broker) => broker.declare(topology).await,
        }
    }

    pub(crate) async fn delete(&self, topology: &Topology) -> Result<(), AppError> {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(broker) => broker.delete(topology).await,
            #[cfg(feature = "nats")]
            Self::Nats(broker) => broker.delete(topology).await,
        }
    }

    pub(crate) fn is_connected(&self) -> bool {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(broker) => broker.is_connected(),
            #[cfg(feature = "nats")]
            Self::Nats(broker) => broker.is_connected(),
        }
    }

    pub(crate) async fn close(&self, reason: &str) {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(broker) => broker.close(reason).await,
            #[cfg(feature = "nats")]
            Self::Nats(broker) => broker.close(reason).await,
        }
    }
}

impl Topology {
    /// Deletes this topology (as [`Broker::delete`]) on a connection of its
    /// own to the broker `url` names, closed afterwards whatever happened;
    /// gives up (with a log line) after [`TEARDOWN_LIMIT`] per step, so a
    /// teardown never hangs.
    ///
    /// # Errors
    /// Broker errors, or [`AppError::Unavailable`] when it gave up.
    pub async fn remove(&self, url: &str) -> Result<(), AppError> {
        let connecting = Connected::connect(url, "topology removal", ConnectOptions::default());
        let connection = tokio::time::timeout(TEARDOWN_LIMIT, connecting)
            .await
            .map_err(|_| {
                AppError::Unavailable(format!(
                    "no broker connection within {TEARDOWN_LIMIT:?} to delete the topology"
                ))
            })??;
        let result = match tokio::time::timeout(TEARDOWN_LIMIT, connection.delete(self)).await {
            Ok(result) => result,
            Err(_) => {
                tracing::warn!(exchange = %self.exchange(), "topology delete not done in {TEARDOWN_LIMIT:?}; giving up");
                Err(AppError::Unavailable(format!(
                    "topology delete not done in {TEARDOWN_LIMIT:?}"
                )))
            }
        };
        connection.close("topology removed").await;
        result
    }

    /// A guard that, when dropped, deletes this topology as
    /// [`Topology::remove`] does: a test's queues go whether the test
    /// passed or panicked half-way.
    pub fn remove_on_drop(&self, url: &str) -> RemoveOnDrop {
        RemoveOnDrop {
            topology: self.clone(),
            url: url.to_owned(),
        }
    }
}

/// Deletes its topology when dropped (see [`Topology::remove_on_drop`]).
/// Drop cannot await, so the removal runs on a thread of its own with a
/// small runtime, each step bounded; a failure only logs.
#[derive(Debug)]
pub struct RemoveOnDrop {
    topology: Topology,
    url: String,
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let topology = self.topology.clone();
        let url = std::mem::take(&mut self.url);
        let removal = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            match runtime {
                Ok(runtime) => {
                    if let Err(error) = runtime.block_on(topology.remove(&url)) {
                        tracing::warn!(exchange = %topology.exchange(), error = %error,
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

    #[cfg(feature = "rabbitmq")]
    #[test]
    fn amqp_urls_pick_rabbitmq() {
        assert_eq!(
            BrokerKind::of("amqp://h/%2f").ok(),
            Some(BrokerKind::RabbitMq)
        );
        assert_eq!(BrokerKind::of("AMQPS://h").ok(), Some(BrokerKind::RabbitMq));
    }

    #[test]
    fn an_unknown_scheme_names_the_known_ones_and_hides_the_password() {
        let error = BrokerKind::of("kafka://user:secret@h:9092")
            .expect_err("not a broker of ours")
            .to_string();
        assert!(error.contains(SCHEMES), "{error}");
        assert!(!error.contains("secret"), "{error}");
    }

    #[cfg(feature = "nats")]
    #[test]
    fn nats_and_tls_urls_pick_jetstream() {
        assert_eq!(
            BrokerKind::of("nats://127.0.0.1:4222").ok(),
            Some(BrokerKind::Nats)
        );
        assert_eq!(BrokerKind::of("tls://h:4222").ok(), Some(BrokerKind::Nats));
        assert_eq!(BrokerKind::Nats.name(), "NATS JetStream");
    }

    #[cfg(not(feature = "nats"))]
    #[test]
    fn a_nats_url_without_the_feature_names_it() {
        let error = BrokerKind::of("nats://user:secret@h:4222").expect_err("not compiled in");
        assert!(matches!(error, AppError::Config(_)), "{error:?}");
        let error = error.to_string();
        assert!(error.contains("`nats` feature"), "{error}");
        assert!(!error.contains("secret"), "{error}");
    }

    #[cfg(not(feature = "rabbitmq"))]
    #[test]
    fn an_amqp_url_without_the_feature_names_it() {
        let error = BrokerKind::of("amqp://guest:secret@h").expect_err("not compiled in");
        let error = error.to_string();
        assert!(error.contains("`rabbitmq` feature"), "{error}");
        assert!(!error.contains("secret"), "{error}");
    }
}
