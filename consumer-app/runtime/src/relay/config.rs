//! A relay's settings.

use std::fmt;
use std::num::NonZeroU32;
use std::time::Duration;

use inbox_api::PublishRetry;

use crate::broker::ConnectOptions;
use crate::redact::redact_url;
use crate::{AppError, CleanupConfig};

/// Settings of a [`Relay`](super::Relay).
#[derive(Clone)]
pub struct RelayConfig {
    /// The broker (may hold a password: logged redacted only).
    pub broker_url: String,
    /// The AMQP connection's name, as `rabbitmqctl list_connections
    /// user_provided_name` shows it.
    pub connection_name: String,
    /// The most messages taken, published and confirmed in one round.
    pub batch_size: NonZeroU32,
    /// The most batches published and not yet settled (confirmed and
    /// marked) at once. A round of one batch is strictly sequential: take,
    /// publish, await its confirms, mark; the broker idles while the
    /// database takes and marks, and the database while the broker
    /// confirms. With a depth above one, the next batch is taken and
    /// published while the previous ones' confirms arrive and their marks
    /// run, each batch under its own lease, on a channel of its own
    /// (so that its returns and confirms are only its own), settled on a
    /// task of its own. [`RelayConfig::DEFAULT_PIPELINE_DEPTH`] by default.
    /// Every batch beyond the first is also one more batch of copies after
    /// a crash (published, not marked, out again after its lease), and one
    /// more channel on the relay's connection.
    pub pipeline_depth: NonZeroU32,
    /// How long a taken batch stays this relay's. Another relay takes the
    /// messages it did not mark once this runs out, so it must be well
    /// above `confirm_timeout`.
    pub lease: Duration,
    /// The pause after a round that found fewer messages than a batch.
    pub poll_interval: Duration,
    /// The longest wait for a batch's publishes and confirms; what is not
    /// confirmed by then counts as failed.
    pub confirm_timeout: Duration,
    /// The first pause after a round in which the broker confirmed nothing
    /// (or the store failed); doubled per such round in a row.
    pub retry_base_delay: Duration,
    /// The longest such pause.
    pub retry_max_delay: Duration,
    /// How often the `outbox_pending_messages` and `outbox_dead_messages`
    /// gauges are refreshed (counts of rows, so not every round).
    pub gauge_interval: Duration,
    /// Publish with the `mandatory` flag: a message no queue is bound for
    /// comes back and stays pending (counted as `returned`) instead of
    /// being dropped by the broker.
    pub mandatory: bool,
    /// The backoff and dead-letter limit of a message the broker refuses
    /// (nack, returned).
    pub retry: PublishRetry,
    /// Exchanges declared (`declare_exchange`:
    /// durable, topic, as a consumer's topology declares them) on every
    /// channel the relay opens, before it publishes: a message to one of
    /// them goes out even before any consumer has declared its topology.
    /// Empty by default: the relay knows no domain, and an exchange of
    /// another kind must be declared by its owner.
    pub exchanges: Vec<String>,
    /// How connections to the broker open: the connect timeout (TCP, TLS,
    /// AMQP handshake; an attempt that takes longer counts as failed and is
    /// retried) and the heartbeat asked for unless the URL names one.
    pub connection: ConnectOptions,
    /// Background purge of published rows (`None`: off): every `interval`,
    /// the rows published longer than `retention` ago go, `batch_size` per
    /// transaction ([`purge_published_once`](super::purge_published_once)). Published rows serve only
    /// diagnostics ([`OutboxStore::lookup_outgoing`](inbox_api::OutboxStore::lookup_outgoing)); without a purge the
    /// table grows by every message ever sent.
    pub purge: Option<CleanupConfig>,
}

impl RelayConfig {
    /// The default [`RelayConfig::pipeline_depth`]: 4, by measurement
    /// (`INBOX_BENCH_SECTIONS=relay`, 10,000 messages, batches of 100, on
    /// the quiet machine): depth 4 published about twice as fast as depth 1
    /// (0.64× the bare publisher against 0.36×), because at depth 1 the
    /// broker idles during every take and mark and the database during
    /// every batch's confirms; with a channel per batch (`mandatory` on),
    /// under load 9–12, depth 4 again beat 1 and 2 (sqlx 0.42–0.50× against
    /// 0.25×) and 8 or 16 did no better. Deeper costs a channel and a batch
    /// of copies after a crash per step (docs/benchmark-notes.md has the
    /// figures).
    pub const DEFAULT_PIPELINE_DEPTH: NonZeroU32 = NonZeroU32::MIN.saturating_add(3);

    /// A relay publishing to the broker at `broker_url` on a connection named
    /// `connection_name`, with batches of 100, up to
    /// [`RelayConfig::DEFAULT_PIPELINE_DEPTH`] in flight, `mandatory`, 30 s
    /// leases, 10 s for the confirms and polling every 500 ms.
    pub fn new(broker_url: impl Into<String>, connection_name: impl Into<String>) -> Self {
        Self {
            broker_url: broker_url.into(),
            connection_name: connection_name.into(),
            batch_size: NonZeroU32::new(100).unwrap_or(NonZeroU32::MIN),
            pipeline_depth: Self::DEFAULT_PIPELINE_DEPTH,
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_millis(500),
            confirm_timeout: Duration::from_secs(10),
            retry_base_delay: Duration::from_millis(200),
            retry_max_delay: Duration::from_secs(10),
            gauge_interval: Duration::from_secs(15),
            mandatory: true,
            retry: PublishRetry::default(),
            exchanges: Vec::new(),
            connection: ConnectOptions::default(),
            purge: Some(CleanupConfig::default()),
        }
    }

    /// This configuration with `heartbeat` as the heartbeat timeout asked
    /// of the broker when the URL names none (see
    /// [`crate::amqp::DEFAULT_HEARTBEAT`]).
    #[must_use]
    pub fn heartbeat(mut self, heartbeat: Duration) -> Self {
        self.connection.heartbeat = heartbeat;
        self
    }

    /// Checks the settings ([`Relay::new`](super::Relay::new) does too), so that a command
    /// line can refuse them before it connects anywhere.
    ///
    /// # Errors
    /// [`AppError::Config`] when the lease is not at least twice the
    /// confirm timeout, or the confirm timeout is zero.
    pub fn check(&self) -> Result<(), AppError> {
        if self.lease < self.confirm_timeout.saturating_mul(2) {
            return Err(AppError::Config(format!(
                "the relay's lease ({:?}) must be at least twice its confirm timeout ({:?}): \
                 another relay would take messages this one is still publishing",
                self.lease, self.confirm_timeout
            )));
        }
        if self.confirm_timeout.is_zero() {
            return Err(AppError::Config(
                "the relay's confirm timeout must be above zero".into(),
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for RelayConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelayConfig")
            .field("broker_url", &redact_url(&self.broker_url))
            .field("connection_name", &self.connection_name)
            .field("batch_size", &self.batch_size)
            .field("pipeline_depth", &self.pipeline_depth)
            .field("lease", &self.lease)
            .field("poll_interval", &self.poll_interval)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("retry_base_delay", &self.retry_base_delay)
            .field("retry_max_delay", &self.retry_max_delay)
            .field("gauge_interval", &self.gauge_interval)
            .field("mandatory", &self.mandatory)
            .field("retry", &self.retry)
            .field("exchanges", &self.exchanges)
            .field("connection", &self.connection)
            .field("purge", &self.purge)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_must_outlast_the_confirms() {
        let mut config = RelayConfig::new("amqp://guest:secret@localhost", "t");
        assert!(config.check().is_ok());
        assert!(!format!("{config:?}").contains("secret"));
        config.lease = config.confirm_timeout;
        assert!(matches!(config.check(), Err(AppError::Config(_))));
        config.confirm_timeout = Duration::ZERO;
        assert!(matches!(config.check(), Err(AppError::Config(_))));
    }

    /// Each batch in flight has a channel of its own, so `mandatory` no
    /// longer limits the depth.
    #[test]
    fn batches_overlap_with_mandatory_on() {
        let mut config = RelayConfig::new("amqp://localhost", "t");
        assert!(config.mandatory && config.pipeline_depth.get() > 1);
        assert!(config.check().is_ok());
        config.pipeline_depth = NonZeroU32::new(8).expect("non-zero");
        assert!(config.check().is_ok());
    }
}
