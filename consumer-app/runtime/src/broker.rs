//! What the service's supervisor needs of a broker: connect (with backoff,
//! and the rules for a refused login), declare the topology, open a
//! queue's [`Subscription`], close.
//!
//! The supervisor, the consuming loop, the worker and the settle policy are
//! written once above [`Broker`]; a broker is picked by the URL's scheme
//! ([`BrokerKind::of`]), so that moving a service to another broker is a
//! change of URL (and of the crate feature that compiles the broker in).

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;

use crate::AppError;
use crate::backoff::RECONNECT;
use crate::config::WorkerConfig;
use crate::delivery::Subscription;
use crate::redact::redact_url;
use crate::topology::Topology;

/// How long a connection (TCP, TLS and the broker's handshake) or a
/// channel may take to open before it counts as failed, unless a
/// configuration says otherwise: a broker that accepts the TCP connection
/// and never speaks (a hung node, a load balancer with no healthy backend,
/// a port-forward to nothing) would otherwise hold the caller for ever,
/// unlogged. A healthy broker answers in milliseconds; 5 s leaves room for
/// a loaded one.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The heartbeat timeout asked of the broker when the URL names none
/// (`?heartbeat=N`). It bounds how long a frozen or cut-off consumer keeps
/// its unacknowledged deliveries: the broker closes a connection that has
/// been silent for two to three timeouts (RabbitMQ checks the bytes received
/// once per timeout and gives up at the second check in a row that finds
/// none) and hands those deliveries to another consumer. RabbitMQ's server
/// default is 60 s, two to three minutes of stalled messages; its
/// maintainers advise 5–15 s. 10 s stays clear of false alarms from a
/// loaded process and frees a frozen consumer's deliveries within 20–30 s
/// (29 s measured by `parcel-lab`'s frozen-process test).
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(10);

/// How the runtime opens a connection, beside what the URL says.
///
/// The URL stays the one place for the broker's address, credentials and
/// TLS files (`amqps://…?cacertfile=…&certfile=…&keyfile=…`, the query
/// parameters of RabbitMQ's own URI spec); these are the defaults it may
/// override.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// How long TCP, TLS and the broker's handshake may take together.
    pub timeout: Duration,
    /// The heartbeat timeout asked for when the URL has no `heartbeat`
    /// parameter; zero turns heartbeats off (not advised).
    pub heartbeat: Duration,
}

impl Default for ConnectOptions {
    /// [`CONNECT_TIMEOUT`] and [`DEFAULT_HEARTBEAT`].
    fn default() -> Self {
        Self {
            timeout: CONNECT_TIMEOUT,
            heartbeat: DEFAULT_HEARTBEAT,
        }
    }
}

impl ConnectOptions {
    /// These options with `timeout`.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// These options with `heartbeat`.
    #[must_use]
    pub fn heartbeat(mut self, heartbeat: Duration) -> Self {
        self.heartbeat = heartbeat;
        self
    }
}

/// A broker the service consumes from: one connection, shared by its
/// queues' subscriptions.
pub trait Broker: Sized + Send + Sync + 'static {
    /// One queue's deliveries.
    type Subscription: Subscription;

    /// The broker's name in log lines ("RabbitMQ").
    const NAME: &'static str;

    /// Opens one connection named `name` to the broker at `url`.
    ///
    /// # Errors
    /// [`AppError::CredentialsRefused`] when the broker refuses the login,
    /// [`AppError::Config`] when the URL is unusable; otherwise the
    /// broker's error, or [`AppError::Unavailable`] past the timeout.
    fn connect(
        url: &str,
        name: &str,
        options: ConnectOptions,
    ) -> impl Future<Output = Result<Self, AppError>> + Send;

    /// Declares what `topology` names (idempotent): where messages are
    /// published, the queues that receive them, their dead letters.
    ///
    /// # Errors
    /// The broker's, e.g. an existing queue declared with other settings.
    fn declare(&self, topology: &Topology) -> impl Future<Output = Result<(), AppError>> + Send;

    /// Subscribes `consumer` to `queue` (one of the topology's), with the
    /// worker's prefetch and ack settings.
    ///
    /// # Errors
    /// The broker's.
    fn subscribe(
        &self,
        queue: &str,
        consumer: &str,
        config: &WorkerConfig,
    ) -> impl Future<Output = Result<Self::Subscription, AppError>> + Send;

    /// Closes the connection, bounded: a close that never answers is given
    /// up with a log line.
    fn close(&self, reason: &str) -> impl Future<Output = ()> + Send;
}

/// The URL schemes this build speaks, for the error that names them.
#[cfg(feature = "nats")]
const SCHEMES: &str = "amqp://, amqps://, nats:// or tls://";
#[cfg(not(feature = "nats"))]
const SCHEMES: &str = "amqp:// or amqps://";

/// The brokers the runtime speaks, as a URL's scheme names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerKind {
    /// RabbitMQ (AMQP 0-9-1): `amqp://` or `amqps://`.
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
            "amqp" | "amqps" => Ok(Self::RabbitMq),
            #[cfg(feature = "nats")]
            "nats" | "tls" => Ok(Self::Nats),
            // Said plainly: "expected amqp://" would leave the reader
            // wondering why a NATS URL is refused.
            #[cfg(not(feature = "nats"))]
            "nats" | "tls" => Err(AppError::Config(format!(
                "broker URL {}: NATS needs inbox-runtime's `nats` feature, which this build \
                 does not have",
                redact_url(url)
            ))),
            _ => Err(AppError::Config(format!(
                "broker URL {}: expected {}",
                redact_url(url),
                SCHEMES
            ))),
        }
    }

    /// The broker's name in log lines.
    pub fn name(self) -> &'static str {
        match self {
            Self::RabbitMq => crate::rabbitmq::RabbitMq::NAME,
            #[cfg(feature = "nats")]
            Self::Nats => crate::nats::JetStream::NAME,
        }
    }
}

/// A connection to whichever broker the URL named: what the supervisor
/// holds, so that a [`crate::Service`] is one type whatever its broker.
#[allow(
    clippy::large_enum_variant,
    reason = "one value per connection, held for its life: its size costs nothing"
)]
pub(crate) enum Connected {
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
            Self::RabbitMq(broker) => broker.declare(topology).await,
            #[cfg(feature = "nats")]
            Self::Nats(broker) => broker.declare(topology).await,
        }
    }

    pub(crate) async fn close(&self, reason: &str) {
        match self {
            Self::RabbitMq(broker) => broker.close(reason).await,
            #[cfg(feature = "nats")]
            Self::Nats(broker) => broker.close(reason).await,
        }
    }
}

/// What [`connect_with_backoff`] does when the broker refuses the login.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnRefusal {
    /// Give up at once with [`AppError::CredentialsRefused`]: at start-up a
    /// refused login is a configuration error, and retrying it for ever
    /// would only hide it.
    Fail,
    /// Retry like any other failure, logged as "credentials refused": once
    /// running, a refusal is usually a rotation in progress.
    Retry,
}

/// How [`connect_with_backoff`] keeps trying.
#[derive(Clone, Copy, Debug)]
pub struct Retrying<'a> {
    /// Attempts before giving up (`None`: forever).
    pub attempts: Option<u32>,
    /// What a refused login does.
    pub on_refusal: OnRefusal,
    /// Where each failure's cause goes, `None` once connected (for a
    /// readiness check that says why).
    pub last_error: Option<&'a watch::Sender<Option<String>>>,
}

/// Runs `connect` (one attempt to reach the broker at `url`, called
/// `broker` in log lines), retrying with [`RECONNECT`]'s jittered backoff
/// until it works, `attempts` run out, the broker refuses the login and
/// `on_refusal` says [`OnRefusal::Fail`], the URL is unusable
/// ([`AppError::Config`]), or `shutdown` turns true, which ends an attempt
/// in progress too.
///
/// # Errors
/// The last connection error, or [`AppError::Unavailable`] on shutdown.
pub async fn connect_with_backoff<T, F, Fut>(
    url: &str,
    broker: &str,
    mut connect: F,
    retrying: Retrying<'_>,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<T, AppError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, AppError>>,
{
    let report = |error: Option<String>| {
        if let Some(last_error) = retrying.last_error {
            last_error.send_replace(error);
        }
    };
    let shut = || AppError::Unavailable(format!("shutdown while connecting to {broker}"));
    let mut attempt = 0;
    loop {
        let connected = tokio::select! {
            connected = connect() => connected,
            _ = shutdown.wait_for(|stop| *stop) => return Err(shut()),
        };
        match connected {
            Ok(connection) => {
                report(None);
                if attempt > 0 {
                    tracing::info!(url = %redact_url(url), attempt, "connected to {broker}");
                }
                return Ok(connection);
            }
            Err(error) => {
                report(Some(crate::error::chain(&error)));
                attempt += 1;
                let refused = matches!(error, AppError::CredentialsRefused { .. });
                if retrying.attempts.is_some_and(|max| attempt >= max)
                    || (refused && retrying.on_refusal == OnRefusal::Fail)
                    || matches!(error, AppError::Config(_))
                {
                    return Err(error);
                }
                let delay = RECONNECT.delay(attempt);
                if refused {
                    tracing::warn!(url = %redact_url(url), attempt, ?delay,
                        error = %crate::error::chain(&error), "{broker} credentials refused; retrying");
                } else {
                    tracing::warn!(url = %redact_url(url), attempt, ?delay,
                        error = %crate::error::chain(&error), "{broker} unreachable; retrying");
                }
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    _ = shutdown.wait_for(|stop| *stop) => return Err(shut()),
                }
            }
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
}
