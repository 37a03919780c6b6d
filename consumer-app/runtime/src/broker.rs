//! What the service's supervisor needs of a broker: connect (with backoff,
//! and the rules for a refused login), declare the topology, open a
//! queue's [`Subscription`], close.
//!
//! The supervisor, the consuming loop, the worker and the settle policy are
//! written once above [`Broker`]; a broker is picked by the URL's scheme
//! ([`crate::brokers::BrokerKind::of`]), so that moving a service to
//! another broker is a change of URL (and of the crate feature that
//! compiles the broker in).

use std::future::Future;

use tokio::sync::watch;

use crate::AppError;
use crate::backoff::RECONNECT;
use crate::config::WorkerConfig;
pub use crate::config::{CONNECT_TIMEOUT, ConnectOptions, DEFAULT_HEARTBEAT};
use crate::delivery::Subscription;
use crate::redact::redact_url;
use crate::topology::Topology;

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

    /// Deletes what [`Broker::declare`] made for `topology`, its dead
    /// letters included (tests, demos).
    ///
    /// # Errors
    /// The broker's.
    fn delete(&self, topology: &Topology) -> impl Future<Output = Result<(), AppError>> + Send;

    /// Whether the connection stands right now. A broker whose client
    /// reconnects by itself under a running session (NATS) says here that
    /// it lost its server, so that readiness does not claim to consume
    /// meanwhile; one whose lost connection ends the session (RabbitMQ)
    /// keeps the default.
    fn is_connected(&self) -> bool {
        true
    }

    /// Closes the connection, bounded: a close that never answers is given
    /// up with a log line.
    fn close(&self, reason: &str) -> impl Future<Output = ()> + Send;
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
