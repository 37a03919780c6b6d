//! The runtime's settings, with the defaults the binary's flags start from.

use std::num::NonZeroU32;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::AppError;
use crate::settle::SettlePolicy;

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

/// Settings of the message path.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Unacknowledged deliveries the broker may push per queue consumer.
    pub prefetch: u16,
    /// Deliveries (or batches) processed at once per queue.
    pub concurrency: usize,
    /// The bound on one attempt (begin to commit). Keep it well below
    /// RabbitMQ's `consumer_timeout` (30 min by default), after which the
    /// broker closes the channel with 406 PRECONDITION_FAILED.
    pub handle_timeout: Duration,
    /// Attempts per delivery in process before it is requeued.
    pub retry_attempts: u32,
    /// Backoff before the second attempt; doubled each time.
    pub retry_base_delay: Duration,
    /// Failed deliveries of one message before it is dead-lettered as
    /// `retries_exhausted`, by the store's attempt ledger (the broker's
    /// `x-delivery-count` only when the ledger could not be written), so
    /// the cap holds on queues that count nothing (classic queues, nacks
    /// on RabbitMQ 4.3) and spares hand-backs that were not the message's
    /// fault on brokers that count them.
    pub max_deliveries: u32,
    /// The largest body accepted.
    pub max_body_bytes: usize,
    /// Batched mode (`None`: one transaction per delivery, the default).
    pub batch: Option<BatchConfig>,
    /// How long a committed delivery's ack may wait to go out with others
    /// in one `basic.ack(multiple)`: acks go sooner once half the prefetch
    /// waits, and on shutdown. An ack per delivery cost a frame and two
    /// thread wake-ups each; an ack still waiting at a crash is never sent,
    /// and the redelivery is a duplicate the inbox drops.
    pub ack_flush: Duration,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            prefetch: 32,
            concurrency: 8,
            handle_timeout: Duration::from_secs(30),
            retry_attempts: 3,
            retry_base_delay: Duration::from_millis(100),
            max_deliveries: 10,
            max_body_bytes: 64 * 1024,
            batch: None,
            ack_flush: Duration::from_millis(2),
        }
    }
}

impl WorkerConfig {
    /// The settle policy these settings make.
    pub fn policy(&self) -> SettlePolicy {
        SettlePolicy {
            retry_attempts: self.retry_attempts,
            max_deliveries: self.max_deliveries,
            retry_base_delay: self.retry_base_delay,
        }
    }
}

/// Settings of batched mode: up to `size` deliveries through one
/// [`Inbox::handle_batch`](inbox_api::Inbox::handle_batch) transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchConfig {
    /// The most deliveries in one transaction.
    pub size: usize,
    /// How long a batch waits for more deliveries after its first one.
    pub wait: Duration,
}

impl BatchConfig {
    /// Batched mode when it can batch anything: `size > 1` and a prefetch
    /// above one (with prefetch 1 the broker never has a second delivery
    /// outstanding).
    pub fn effective(size: usize, wait: Duration, prefetch: u16) -> Option<Self> {
        (size > 1 && prefetch > 1).then_some(Self { size, wait })
    }
}

/// Cleanup of processed inbox rows.
#[derive(Clone, Debug)]
pub struct CleanupConfig {
    /// Rows processed longer ago than this go. A duplicate must meet its
    /// first copy within it, so keep it above the longest redelivery delay.
    pub retention: Duration,
    /// How often the background task runs.
    pub interval: Duration,
    /// Rows per delete transaction (bounded, so that cleanup never holds
    /// many locks at once). Default [`CleanupConfig::DEFAULT_BATCH`].
    pub batch_size: NonZeroU32,
    /// The pause after each full batch, before the next one. Default
    /// [`CleanupConfig::DEFAULT_PAUSE`].
    pub pause: Duration,
}

impl CleanupConfig {
    /// The default batch of row deletes. With [`CleanupConfig::DEFAULT_PAUSE`]
    /// the one pacing of every cleanup (the inbox's rows, its attempt
    /// ledger, the outbox's published rows; the service's and the relay's
    /// background runs, `parcel-inbox cleanup`).
    ///
    /// Why small and paced: a delete batch competes with the claims running
    /// beside it for the CPU, the WAL and its flush at COMMIT, and a claim
    /// that lands on a batch waits for it. Two quiet-machine runs of the
    /// benchmark measured claim p99 during unpaced batches of 10,000 rows
    /// at 3.5× and 5.3× idle (target 2×). Batches of 1,000 keep each
    /// collision a few milliseconds long, and the pause after each leaves
    /// the database to the claims most of the time; the `cleanup` section
    /// of the report compares the pacings (one run on a machine loaded by
    /// other builds, 1 M rows, p99 ratio median (range) over 3
    /// repetitions: 1,000 + 20 ms 1.32 (0.77–1.73), 500 + 20 ms 0.88
    /// (0.80–1.18), 1,000 unpaced 1.52 (1.46–1.85); there the load's own
    /// tail hid the unpaced 10,000's cost: 1.09 (1.08–1.24)). The price is
    /// time: 15,000 rows/s in that run, so an hour of 1,000 messages/s goes
    /// in about four minutes. The partitioned layout drops whole days
    /// instead, needing no pacing for them.
    ///
    /// Why not smaller still: measured per batch (`perf stat` on the
    /// backend, WAL from the LSN), 1,000 rows cost 2.2 ms of CPU and 112 KiB
    /// of WAL, 250 rows 1.8 ms and 28 KiB: below 1,000 the statement's own
    /// overhead dominates (7 µs per row at 100 against 2.2 µs), so smaller
    /// batches spend more CPU in all for a smaller bite each. The quiet
    /// machine still measured 2.63× (2.47–3.05) at this pacing (target 2×),
    /// and the cause found since is not the pacing: every batch walks the
    /// index entries of the rows the earlier batches deleted (dead until
    /// VACUUM), +1,200 buffers per 250,000 rows already gone, so a batch
    /// late in a 1 M purge does about twice the work of the first (see
    /// `docs/benchmark-notes.md`, 2026-12-04 18:40).
    pub const DEFAULT_BATCH: NonZeroU32 = NonZeroU32::new(1000).expect("non-zero");
    /// The default pause between two batches; see
    /// [`CleanupConfig::DEFAULT_BATCH`].
    pub const DEFAULT_PAUSE: Duration = Duration::from_millis(20);

    /// The rows to delete are those older than this: now minus the
    /// retention. One rule for every cleanup (the inbox's processed rows,
    /// its attempt ledger, the outbox's published rows).
    ///
    /// # Errors
    /// [`AppError::Config`] for a retention beyond what a timestamp holds.
    pub fn cutoff(&self) -> Result<DateTime<Utc>, AppError> {
        let retention = chrono::Duration::from_std(self.retention)
            .map_err(|e| AppError::Config(format!("retention out of range: {e}")))?;
        Utc::now()
            .checked_sub_signed(retention)
            .ok_or_else(|| AppError::Config(format!("retention {:?} out of range", self.retention)))
    }
}

impl Default for CleanupConfig {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(7 * 24 * 3600),
            interval: Duration::from_secs(3600),
            batch_size: Self::DEFAULT_BATCH,
            pause: Self::DEFAULT_PAUSE,
        }
    }
}

/// Settings of the store circuit ([`crate::availability`]): when
/// a store outage pauses consumption, and how often the paused service
/// probes the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AvailabilityConfig {
    /// Store-unavailable failures in a row (no success between them) that
    /// open the circuit. One lost connection (a killed backend) is
    /// released and redelivered without pausing anything.
    pub threshold: u32,
    /// The wait before the first probe of an open circuit; doubled per
    /// failed probe.
    pub probe_delay: Duration,
    /// The longest wait between probes.
    pub max_probe_delay: Duration,
}

impl Default for AvailabilityConfig {
    fn default() -> Self {
        Self {
            threshold: 3,
            probe_delay: Duration::from_millis(200),
            max_probe_delay: Duration::from_secs(10),
        }
    }
}

/// Settings of a running service.
#[derive(Clone)]
pub struct ServiceConfig {
    /// The broker (may hold a password: logged redacted only).
    pub broker_url: String,
    /// The message path's settings.
    pub worker: WorkerConfig,
    /// The AMQP connection's name, as `rabbitmqctl list_connections
    /// user_provided_name` shows it.
    pub connection_name: String,
    /// Background cleanup; `None`: off.
    pub cleanup: Option<CleanupConfig>,
    /// How often the `inbox_rows` gauge is refreshed; `None`: never.
    pub gauge_interval: Option<Duration>,
    /// When a store outage pauses consumption, and how the store is probed.
    pub availability: AvailabilityConfig,
    /// How connections to the broker open: the connect timeout (TCP, TLS,
    /// AMQP handshake; an attempt that takes longer counts as failed and is
    /// retried) and the heartbeat asked for unless the URL names one.
    pub connection: ConnectOptions,
}

impl ServiceConfig {
    /// A service on the broker at `broker_url`, its connection named
    /// `connection_name`: the default message path and cleanup (the inbox
    /// table must not grow for ever), no gauge.
    pub fn new(broker_url: impl Into<String>, connection_name: impl Into<String>) -> Self {
        Self {
            broker_url: broker_url.into(),
            worker: WorkerConfig::default(),
            connection_name: connection_name.into(),
            cleanup: Some(CleanupConfig::default()),
            gauge_interval: None,
            availability: AvailabilityConfig::default(),
            connection: ConnectOptions::default(),
        }
    }
}

impl ServiceConfig {
    /// This configuration with `heartbeat` as the heartbeat timeout asked
    /// of the broker when the URL names none (see
    /// [`DEFAULT_HEARTBEAT`] for why it matters).
    #[must_use]
    pub fn heartbeat(mut self, heartbeat: Duration) -> Self {
        self.connection.heartbeat = heartbeat;
        self
    }
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig")
            .field("broker_url", &crate::redact::redact_url(&self.broker_url))
            .field("worker", &self.worker)
            .field("connection_name", &self.connection_name)
            .field("cleanup", &self.cleanup)
            .field("gauge_interval", &self.gauge_interval)
            .field("availability", &self.availability)
            .field("connection", &self.connection)
            .finish()
    }
}
