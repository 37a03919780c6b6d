//! The command line's pieces that more than one binary uses: the flags, the
//! `consume` path (the service with its metrics endpoint and reconciler,
//! until a signal) and the `relay` path (the outbox relay, likewise).

use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args};
use futures::stream::BoxStream;
use inbox_api::{OutboxStore, PublishRetry};
use inbox_postgres::SessionTimeouts;
use tokio::sync::watch;

use crate::parcel::dispatch::{
    LedgerCarrier, LedgerNotifier, MarkDispatched, ReconcileConfig, reconcile_loop,
};
use crate::parcel::downstream::Downstreams;
use crate::parcel::service::{self, METRIC_NAMES};
use crate::parcel::store::{ParcelStore, StoreKind};
use crate::parcel::topology::Topology;
use crate::tools::logging::LogFormat;
use crate::tools::stores::{StoreConfig, WithOutbox, WithStore};
use inbox_runtime::amqp::ConnectOptions;
use inbox_runtime::http::{self as telemetry, Health, install_recorder};
use inbox_runtime::relay::{Relay, RelayConfig};
use inbox_runtime::{
    AppError, AvailabilityConfig, BatchConfig, CleanupConfig, QueueType, ServiceConfig,
    ServiceHandle, WorkerConfig,
};

/// The flags every command takes.
// No Debug: the URLs may hold passwords.
#[derive(Args, Clone)]
pub struct Global {
    /// The store (each must be compiled in: cargo features sqlx, diesel, memory).
    #[arg(long, env = "PARCEL_STORE", global = true, default_value_t = default_store())]
    pub store: StoreKind,
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        global = true,
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    pub database_url: String,
    /// RabbitMQ URL.
    #[arg(
        long,
        env = "AMQP_URL",
        global = true,
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
    /// Seconds a connection to RabbitMQ may take to open (TCP, AMQP
    /// handshake) or a channel to open before the attempt fails: a broker
    /// that accepts and never answers is retried (services) or reported
    /// (one-shot commands), not waited on for ever.
    #[arg(
        long,
        env = "AMQP_CONNECT_TIMEOUT_SECS",
        global = true,
        default_value_t = inbox_runtime::amqp::CONNECT_TIMEOUT.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub amqp_connect_timeout_secs: u64,
    /// The AMQP heartbeat timeout in seconds, unless the AMQP URL names its
    /// own `heartbeat`: RabbitMQ closes a connection silent for two to three
    /// times it, which bounds how long a frozen or cut-off consumer keeps
    /// its unacknowledged deliveries from the others (0: no heartbeat).
    #[arg(
        long,
        env = "AMQP_HEARTBEAT_SECS",
        global = true,
        default_value_t = inbox_runtime::amqp::DEFAULT_HEARTBEAT.as_secs(),
        value_parser = clap::value_parser!(u64).range(0..=65535)
    )]
    pub amqp_heartbeat_secs: u64,
    /// PostgreSQL schema of the inbox and the app's tables (search_path).
    #[arg(
        long,
        env = "INBOX_SCHEMA",
        global = true,
        default_value = DEFAULT_SCHEMA
    )]
    pub schema: String,
    /// Prefix of every exchange and queue name (tests use their own).
    #[arg(long, env = "PARCEL_PREFIX", global = true, default_value = "")]
    pub prefix: String,
    /// PostgreSQL connections in the pool.
    #[arg(long, env = "DATABASE_POOL_SIZE", global = true, default_value_t = 16)]
    pub pool_size: u32,
    /// Log lines as text (coloured only on a terminal) or as JSON objects
    /// (one per line, for log collectors).
    #[arg(long, env = "LOG_FORMAT", global = true, value_enum, default_value_t)]
    pub log_format: LogFormat,
    /// Milliseconds a statement (above all the claim) waits for a lock another
    /// transaction holds; then the delivery goes back to the broker, uncharged
    /// (PostgreSQL's lock_timeout; 0: wait for ever).
    #[arg(long, env = "INBOX_LOCK_TIMEOUT_MS", global = true, default_value_t = default_lock_timeout_ms())]
    pub lock_timeout_ms: u64,
    /// Seconds a database session may sit inside a transaction without a
    /// statement before PostgreSQL ends it, releasing a frozen holder's claims;
    /// above --handle-timeout-secs (idle_in_transaction_session_timeout; 0: never).
    #[arg(long, env = "INBOX_IDLE_IN_TRANSACTION_TIMEOUT_SECS", global = true, default_value_t = default_idle_in_transaction_secs())]
    pub idle_in_transaction_timeout_secs: u64,
    /// Queue type to declare, quorum or classic. Classic queues keep no
    /// delivery count; the store's attempt ledger caps redeliveries there.
    #[arg(
        long,
        env = "PARCEL_QUEUE_TYPE",
        global = true,
        default_value = "quorum"
    )]
    pub queue_type: QueueType,
    /// The inbox table's layout, table or partitioned (daily partitions
    /// of v7 ids, dropped whole by the cleanup). `migrate` creates it in
    /// a new schema and refuses a schema of the other layout; every other
    /// command must name the layout its schema has, since the claims'
    /// statements differ.
    #[arg(long, env = "INBOX_LAYOUT", global = true, default_value = "table")]
    pub layout: inbox_postgres::Layout,
}

impl Global {
    /// The RabbitMQ names and queue type these flags say.
    pub fn topology(&self) -> Topology {
        Topology::new(&self.prefix).with_queue_type(self.queue_type)
    }

    /// `--amqp-connect-timeout-secs` and `--amqp-heartbeat-secs`.
    pub fn amqp_connection(&self) -> ConnectOptions {
        ConnectOptions::default()
            .timeout(Duration::from_secs(self.amqp_connect_timeout_secs))
            .heartbeat(Duration::from_secs(self.amqp_heartbeat_secs))
    }
}

/// What a command does with the global flags' subjects: which of them
/// could have an effect on it. [`Global::idle`] turns it into the flags
/// that could not.
#[derive(Clone, Copy, Debug, Default)]
pub struct Uses {
    /// The command's name, for the errors.
    pub command: &'static str,
    /// It opens the store (`--store`, and the database's flags unless the
    /// store is the memory one).
    pub store: bool,
    /// It uses the store in `--schema` (not a schema of its own).
    pub schema: bool,
    /// It connects to RabbitMQ (`--amqp-url`).
    pub broker: bool,
    /// It names exchanges or queues after `--prefix`.
    pub names: bool,
    /// It declares the consumers' queues (`--queue-type`).
    pub queues: bool,
}

/// Flags that would have no effect in this invocation, and why: given on
/// the command line, [`refuse_idle`] refuses them.
#[derive(Clone, Debug)]
pub struct Idle {
    /// The flags' clap ids (their fields' names; the long flag is the id
    /// with dashes).
    pub ids: Vec<String>,
    /// Why they would do nothing, after "has no effect: ".
    pub because: String,
}

impl Idle {
    /// `ids` have no effect `because`.
    pub fn new(ids: &[&str], because: impl Into<String>) -> Self {
        Self {
            ids: ids.iter().map(|id| (*id).to_owned()).collect(),
            because: because.into(),
        }
    }

    /// Every flag of the group `A` has no effect `because`: read from the
    /// group itself, so that a flag added to it is covered.
    pub fn all_of<A: Args>(because: impl Into<String>) -> Self {
        Self {
            ids: A::augment_args(clap::Command::new("idle"))
                .get_arguments()
                .map(|arg| arg.get_id().to_string())
                .collect(),
            because: because.into(),
        }
    }
}

/// Refuses, as a usage error (exit status 2, as for a flag a command does
/// not have at all, such as `api --metrics-addr`), the first flag of
/// `idle` given on the command line of `matches` (the subcommand's, which
/// hold the global flags too).
///
/// Why only the command line: an operator who types a flag expects it to
/// do something, and a silent no-op hides a mistake (a pool size that
/// never applied, a queue type that was never declared). An environment
/// variable is the fleet's configuration, shared by every command
/// (`DATABASE_POOL_SIZE` for `publish` too), so there it is ignored where
/// it has no subject.
///
/// # Errors
/// The refusal, naming the flag and why it would do nothing.
pub fn refuse_idle(matches: &ArgMatches, idle: &[Idle]) -> Result<(), clap::Error> {
    for rule in idle {
        for id in &rule.ids {
            if matches.value_source(id) == Some(ValueSource::CommandLine) {
                return Err(clap::Error::raw(
                    clap::error::ErrorKind::ArgumentConflict,
                    format!("--{} has no effect: {}", id.replace('_', "-"), rule.because),
                ));
            }
        }
    }
    Ok(())
}

impl Global {
    /// The global flags that have no effect on a command that `uses` what
    /// it says, with this store. The one table of which global flag acts
    /// on what; `--log-format` acts everywhere.
    pub fn idle(&self, uses: Uses) -> Vec<Idle> {
        const DATABASE: &[&str] = &[
            "database_url",
            "pool_size",
            "lock_timeout_ms",
            "idle_in_transaction_timeout_secs",
            "layout",
        ];
        let command = uses.command;
        let mut idle = Vec::new();
        if !uses.store {
            idle.push(Idle::new(&["store"], format!("`{command}` opens no store")));
            idle.push(Idle::new(DATABASE, format!("`{command}` uses no database")));
            idle.push(Idle::new(
                &["schema"],
                format!("`{command}` uses no database"),
            ));
        } else if self.store == StoreKind::Memory {
            let why = "the memory store has no database (its state lives in this process)";
            idle.push(Idle::new(DATABASE, why));
            idle.push(Idle::new(&["schema"], why));
        } else if !uses.schema {
            idle.push(Idle::new(
                &["schema"],
                format!("`{command}` creates a schema of its own"),
            ));
        }
        if !uses.broker {
            idle.push(Idle::new(
                &[
                    "amqp_url",
                    "amqp_connect_timeout_secs",
                    "amqp_heartbeat_secs",
                ],
                format!("`{command}` does not connect to RabbitMQ"),
            ));
        }
        if !uses.names {
            idle.push(Idle::new(
                &["prefix"],
                format!("`{command}` names no exchange or queue of the service's"),
            ));
        }
        if !uses.queues {
            idle.push(Idle::new(
                &["queue_type"],
                format!("`{command}` declares no queue (`consume` and `publish` do)"),
            ));
        }
        idle
    }
}

/// [`SessionTimeouts`]' default lock timeout, in the flag's unit.
fn default_lock_timeout_ms() -> u64 {
    u64::try_from(SessionTimeouts::DEFAULT_LOCK_TIMEOUT.as_millis()).unwrap_or(u64::MAX)
}

/// [`SessionTimeouts`]' default idle-in-transaction timeout, in the flag's
/// unit.
fn default_idle_in_transaction_secs() -> u64 {
    SessionTimeouts::DEFAULT_IDLE_IN_TRANSACTION.as_secs()
}

/// The schema `--schema` names unless told otherwise.
pub const DEFAULT_SCHEMA: &str = "parcel_inbox";

/// The first store compiled in.
pub fn default_store() -> StoreKind {
    StoreKind::compiled()
        .first()
        .copied()
        .unwrap_or(StoreKind::Sqlx)
}

/// The message path's flags.
#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    /// Unacknowledged deliveries per queue consumer (basic.qos).
    #[arg(long, env = "PARCEL_PREFETCH", default_value_t = 32)]
    pub prefetch: u16,
    /// Deliveries processed at once per queue.
    #[arg(long, env = "PARCEL_CONCURRENCY", default_value_t = 8)]
    pub concurrency: usize,
    /// Bound on one attempt, begin to commit (keep it well below RabbitMQ's consumer_timeout).
    #[arg(long, env = "PARCEL_HANDLE_TIMEOUT_SECS", default_value_t = 30)]
    pub handle_timeout_secs: u64,
    /// In-process attempts per delivery before it is requeued.
    #[arg(long, env = "PARCEL_RETRY_ATTEMPTS", default_value_t = 3)]
    pub retry_attempts: u32,
    /// Failed deliveries of one message before it is dead-lettered as
    /// retries_exhausted (by the store's attempt ledger; the broker's
    /// x-delivery-count only when the ledger could not be written).
    #[arg(long, env = "PARCEL_MAX_DELIVERIES", default_value_t = 10)]
    pub max_deliveries: u32,
    /// Largest accepted body, in bytes.
    #[arg(long, env = "PARCEL_MAX_BODY_BYTES", default_value_t = 64 * 1024)]
    pub max_body_bytes: usize,
    /// Batched mode: up to this many deliveries per transaction (needs
    /// --batch-wait and a prefetch above 1; best with prefetch = 2 × batch size × concurrency, so the next batch arrives while one commits).
    #[arg(long, env = "PARCEL_BATCH_SIZE", requires = "batch_wait")]
    pub batch_size: Option<usize>,
    /// Batched mode: milliseconds a batch waits for more deliveries after its first.
    #[arg(long, env = "PARCEL_BATCH_WAIT_MS", requires = "batch_size")]
    pub batch_wait: Option<u64>,
}

impl WorkerArgs {
    /// The message path's settings these flags make.
    pub fn config(&self) -> WorkerConfig {
        WorkerConfig {
            prefetch: self.prefetch,
            concurrency: self.concurrency,
            handle_timeout: Duration::from_secs(self.handle_timeout_secs.max(1)),
            retry_attempts: self.retry_attempts.max(1),
            max_deliveries: self.max_deliveries.max(1),
            max_body_bytes: self.max_body_bytes,
            batch: match (self.batch_size, self.batch_wait) {
                (Some(size), Some(wait)) => {
                    BatchConfig::effective(size, Duration::from_millis(wait), self.prefetch)
                }
                _ => None,
            },
            ..WorkerConfig::default()
        }
    }
}

impl WorkerArgs {
    /// The flags that would have no effect: the batch's, when batched mode
    /// cannot run (a batch of one, or a prefetch of one delivery).
    pub fn idle(&self) -> Vec<Idle> {
        match self.batch_size {
            Some(size) if size <= 1 || self.prefetch <= 1 => vec![Idle::new(
                &["batch_size", "batch_wait"],
                format!(
                    "batched mode needs a batch size and a prefetch above 1 \
                     (--batch-size {size}, --prefetch {})",
                    self.prefetch
                ),
            )],
            _ => Vec::new(),
        }
    }
}

/// Cleanup's flags.
#[derive(Args, Debug, Clone)]
pub struct CleanupArgs {
    /// Keep processed inbox rows this many days.
    #[arg(long, env = "INBOX_RETENTION_DAYS", default_value_t = 7.0)]
    pub retention_days: f64,
    /// Rows per delete transaction.
    #[arg(long, env = "INBOX_CLEANUP_BATCH", default_value_t = CleanupConfig::DEFAULT_BATCH)]
    pub cleanup_batch: std::num::NonZeroU32,
    /// Milliseconds to pause after each full delete batch (the pacing that
    /// keeps the claims' latency during a cleanup near idle; see
    /// `CleanupConfig::DEFAULT_BATCH`).
    #[arg(long, env = "INBOX_CLEANUP_PAUSE_MS", default_value_t = pause_ms_default())]
    pub cleanup_pause_ms: u64,
}

impl CleanupArgs {
    /// Cleanup's settings, run every `interval`.
    ///
    /// # Errors
    /// [`AppError::Config`] for a negative or non-finite retention.
    pub fn config(&self, interval: Duration) -> Result<CleanupConfig, AppError> {
        Ok(CleanupConfig {
            retention: retention(self.retention_days, "days", 86_400.0)?,
            interval,
            batch_size: self.cleanup_batch,
            pause: Duration::from_millis(self.cleanup_pause_ms),
        })
    }
}

/// The cleanups' default pause in milliseconds, for their flags.
fn pause_ms_default() -> u64 {
    u64::try_from(CleanupConfig::DEFAULT_PAUSE.as_millis()).unwrap_or(u64::MAX)
}

/// A retention flag's value, `amount` of a unit of `unit_secs` seconds.
fn retention(amount: f64, unit: &str, unit_secs: f64) -> Result<Duration, AppError> {
    Duration::try_from_secs_f64(amount * unit_secs)
        .ok()
        .ok_or_else(|| {
            AppError::Config(format!(
                "retention of {amount} {unit} is not a non-negative number in range"
            ))
        })
}

/// The flags of the outbox's purge of published rows (the relay's
/// background purge and `cleanup`'s).
#[derive(Args, Debug, Clone)]
pub struct OutboxPurgeArgs {
    /// Keep published outbox rows this many hours (for diagnostics: what
    /// was published, when, after how many attempts).
    #[arg(long, env = "OUTBOX_RETENTION_HOURS", default_value_t = 168.0)]
    pub published_retention_hours: f64,
    /// Published outbox rows per delete transaction.
    #[arg(long, env = "OUTBOX_PURGE_BATCH", default_value_t = CleanupConfig::DEFAULT_BATCH)]
    pub purge_batch: NonZeroU32,
    /// Milliseconds to pause after each full delete batch (the same pacing
    /// as the inbox's cleanup).
    #[arg(long, env = "OUTBOX_PURGE_PAUSE_MS", default_value_t = pause_ms_default())]
    pub purge_pause_ms: u64,
}

impl OutboxPurgeArgs {
    /// The purge's settings, run every `interval`.
    ///
    /// # Errors
    /// [`AppError::Config`] for a negative or non-finite retention.
    pub fn config(&self, interval: Duration) -> Result<CleanupConfig, AppError> {
        Ok(CleanupConfig {
            retention: retention(self.published_retention_hours, "hours", 3600.0)?,
            interval,
            batch_size: self.purge_batch,
            pause: Duration::from_millis(self.purge_pause_ms),
        })
    }
}

/// The flags of `consume`.
#[derive(Args, Debug, Clone)]
pub struct ConsumeArgs {
    #[command(flatten)]
    #[allow(missing_docs, reason = "clap reads the flattened struct's docs")]
    pub worker: WorkerArgs,
    #[command(flatten)]
    #[allow(missing_docs, reason = "clap reads the flattened struct's docs")]
    pub cleanup: CleanupArgs,
    /// Seconds between background cleanups (0: off).
    #[arg(long, env = "INBOX_CLEANUP_INTERVAL_SECS", default_value_t = 3600)]
    pub cleanup_interval_secs: u64,
    /// Where to serve /metrics (Prometheus), /live and /ready ("off" to
    /// disable).
    #[arg(long, env = "METRICS_ADDR", default_value = "127.0.0.1:9464")]
    pub metrics_addr: String,
    /// Seconds between refreshes of the inbox_rows gauge.
    #[arg(long, default_value_t = 15)]
    pub gauge_interval_secs: u64,
    /// Seconds between reconciler rounds, which re-send committed intents
    /// whose after-commit call never happened (the process died between
    /// COMMIT and the call). It also runs once at start.
    #[arg(long, env = "PARCEL_DISPATCH_INTERVAL_SECS", default_value_t = 10)]
    pub dispatch_interval_secs: u64,
    /// Age an undispatched intent must reach before the reconciler re-sends it.
    #[arg(long, env = "PARCEL_DISPATCH_MIN_AGE_SECS", default_value_t = 5)]
    pub dispatch_min_age_secs: u64,
    /// Store failures in a row (unreachable, schema unusable) after which
    /// consumption pauses until the store answers; those deliveries go back
    /// uncharged.
    #[arg(long, env = "PARCEL_STORE_OUTAGE_THRESHOLD", default_value_t = 3)]
    pub store_outage_threshold: u32,
}

impl ConsumeArgs {
    /// The flags that would have no effect: the cleanup's when it is off,
    /// the gauge's interval without a metrics endpoint, the batch's when
    /// batched mode cannot run.
    pub fn idle(&self) -> Vec<Idle> {
        let mut idle = self.worker.idle();
        if self.cleanup_interval_secs == 0 {
            idle.push(Idle::all_of::<CleanupArgs>(
                "--cleanup-interval-secs 0 turns the background cleanup off",
            ));
        }
        if matches!(self.metrics_addr.as_str(), "off" | "") {
            idle.push(Idle::new(
                &["gauge_interval_secs"],
                "the inbox_rows gauge is only served on the metrics endpoint, \
                 which --metrics-addr off turns off",
            ));
        }
        idle
    }

    /// The `consume` path these flags (and `global`'s) make, started by
    /// `spawner`.
    ///
    /// # Errors
    /// [`AppError::Config`] for an unusable flag.
    pub fn consume<P: Spawner>(&self, global: &Global, spawner: P) -> Result<Consume<P>, AppError> {
        let cleanup = if self.cleanup_interval_secs == 0 {
            None
        } else {
            Some(
                self.cleanup
                    .config(Duration::from_secs(self.cleanup_interval_secs))?,
            )
        };
        let metrics_addr = parse_metrics_addr(&self.metrics_addr)?;
        let idle = global.idle_in_transaction_timeout_secs;
        if idle != 0 && idle <= self.worker.handle_timeout_secs {
            // PostgreSQL would end live transactions that are merely slow,
            // before the consumer's own timeout could hand them back.
            return Err(AppError::Config(format!(
                "--idle-in-transaction-timeout-secs ({idle}) must exceed \
                 --handle-timeout-secs ({}), or be 0",
                self.worker.handle_timeout_secs
            )));
        }
        Ok(Consume {
            schema: global.schema.clone(),
            config: ServiceConfig {
                broker_url: global.amqp_url.clone(),
                worker: self.worker.config(),
                connection_name: format!(
                    "parcel-inbox consume {}{}",
                    global.prefix,
                    std::process::id()
                ),
                cleanup,
                gauge_interval: Some(Duration::from_secs(self.gauge_interval_secs.max(1))),
                availability: AvailabilityConfig {
                    threshold: self.store_outage_threshold.max(1),
                    ..AvailabilityConfig::default()
                },
                connection: global.amqp_connection(),
            },
            topology: global.topology(),
            metrics_addr,
            reconcile: ReconcileConfig {
                interval: Duration::from_secs(self.dispatch_interval_secs.max(1)),
                min_age: Duration::from_secs(self.dispatch_min_age_secs),
                ..ReconcileConfig::default()
            },
            spawner,
        })
    }
}

impl Global {
    /// Where the store lives.
    pub fn store(&self) -> StoreConfig {
        StoreConfig {
            kind: self.store,
            database_url: self.database_url.clone(),
            schema: self.schema.clone(),
            pool_size: self.pool_size,
            timeouts: SessionTimeouts {
                lock_timeout: Some(Duration::from_millis(self.lock_timeout_ms)),
                idle_in_transaction: Some(Duration::from_secs(
                    self.idle_in_transaction_timeout_secs,
                )),
                ..SessionTimeouts::default()
            },
            layout: self.layout,
        }
    }
}

/// `consume`: the service, its metrics endpoint and the reconciler, until
/// SIGINT/SIGTERM. `spawner` starts the service: [`Plain`] in the binary;
/// a test tool passes one that decorates the consumers.
pub struct Consume<P = Plain> {
    /// The store's schema, named in the fix when it is not migrated.
    pub schema: String,
    /// The service's settings.
    pub config: ServiceConfig,
    /// The queue names.
    pub topology: Topology,
    /// Where to serve `/metrics` (`None`: nowhere).
    pub metrics_addr: Option<SocketAddr>,
    /// The reconciler's settings.
    pub reconcile: ReconcileConfig,
    /// What starts the service.
    pub spawner: P,
}

/// What starts the Parcel service for [`Consume`].
pub trait Spawner: Send + Sync {
    /// Starts both consumers on `store`.
    ///
    /// # Errors
    /// As [`inbox_runtime::Service::spawn`].
    fn spawn<S: ParcelStore>(
        &self,
        store: S,
        config: ServiceConfig,
        topology: &Topology,
        downstreams: Downstreams,
    ) -> Result<ServiceHandle, AppError>;
}

/// The production service: the consumers as they are.
#[derive(Clone, Copy, Debug, Default)]
pub struct Plain;

impl Spawner for Plain {
    fn spawn<S: ParcelStore>(
        &self,
        store: S,
        config: ServiceConfig,
        topology: &Topology,
        downstreams: Downstreams,
    ) -> Result<ServiceHandle, AppError> {
        service::spawn(store, config, topology, downstreams)
    }
}

impl<P: Spawner> WithStore for Consume<P> {
    type Output = ();

    async fn run<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        self.serve(store).await
    }
}

impl<P: Spawner> Consume<P> {
    /// Runs the service on `store` until a signal.
    ///
    /// # Errors
    /// The metrics endpoint's, or the service's.
    pub async fn serve<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        let schema = self.schema.clone();
        let (stop_metrics, metrics_stopped) = watch::channel(false);
        // Bound and recording before anything runs: a port in use fails at
        // once, and no early count is lost.
        let endpoint = match self.metrics_addr {
            Some(addr) => Some((
                telemetry::bind(addr).await?,
                install_recorder(METRIC_NAMES)?,
            )),
            None => None,
        };
        // The stubs keep their ledger in the database (shared by every
        // instance, surviving kill -9); a successful call marks the intent
        // dispatched, and the reconciler re-sends the ones that never were.
        let downstreams = MarkDispatched::wrap(
            store.clone(),
            Downstreams {
                carrier: Arc::new(LedgerCarrier::new(store.clone())),
                notifier: Arc::new(LedgerNotifier::new(store.clone())),
            },
        );
        let service = self.spawner.spawn(
            store.clone(),
            self.config,
            &self.topology,
            downstreams.clone(),
        )?;
        if let Some((listener, metrics)) = endpoint {
            // Ready = consuming on an open connection, no store outage
            // pausing the consumers, and the store answers a probe now
            // (an idle service's circuit has seen no error to open on).
            let health = Health::new()
                .live_while(service.running())
                .ready_when("broker", {
                    let broker = service.broker_readiness();
                    move || std::future::ready(broker.status())
                })
                .ready_while(
                    "store",
                    service.store_availability(),
                    "outage: consumption paused until the store answers",
                )
                .ready_when("store probe", telemetry::store_reachable(store.clone()));
            let router = telemetry::router(metrics, health);
            telemetry::serve(listener, router, metrics_stopped);
        }
        let shutdown = service.shutdown_sender();
        let reconciler = tokio::spawn(reconcile_loop(
            store,
            downstreams,
            self.reconcile,
            shutdown.subscribe(),
        ));
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!(
                "shutting down: no new deliveries; finishing in-flight ones (signal again to exit at once)"
            );
            shutdown.send_replace(true);
            wait_for_signal().await;
            tracing::warn!("second signal: exiting now; unacked deliveries will be redelivered");
            std::process::exit(130);
        });
        let stop_reconciler = service.shutdown_sender();
        let result = service.join().await;
        stop_reconciler.send_replace(true);
        let _ = reconciler.await;
        stop_metrics.send_replace(true);
        result.map_err(|error| with_migrate_hint(error, &schema))
    }
}

/// A start refused because the store's schema is missing, not migrated or
/// not the role's to use, told with its fix: the operator reads what to run,
/// not only which relation was missing.
fn with_migrate_hint(error: AppError, schema: &str) -> AppError {
    if !error.is_store_unavailable() || error.is_retryable() {
        return error;
    }
    let flag = if schema == DEFAULT_SCHEMA {
        String::new()
    } else {
        format!(" --schema {schema}")
    };
    AppError::Config(format!(
        "the schema {schema:?} is not ready for the inbox ({}): run `parcel-inbox migrate{flag}` \
         (with a role that may use its tables), then start again",
        inbox_runtime::error::chain(&error)
    ))
}

/// The flags of `relay`.
#[derive(Args, Debug, Clone)]
pub struct RelayArgs {
    #[command(flatten)]
    #[allow(missing_docs, reason = "clap reads the flattened struct's docs")]
    pub settings: RelaySettings,
    /// Where to serve /metrics (Prometheus), /live and /ready ("off" to
    /// disable).
    #[arg(long, env = "RELAY_METRICS_ADDR", default_value = "127.0.0.1:9465")]
    pub metrics_addr: String,
}

/// The relay's flags that `relay` and `api` (its in-process relay) share;
/// `api` serves its metrics on `--listen`, so it takes no `--metrics-addr`.
#[derive(Args, Debug, Clone)]
pub struct RelaySettings {
    /// Outgoing messages taken, published and confirmed per round.
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value = "100")]
    pub batch_size: NonZeroU32,
    /// Batches published and not yet confirmed and marked at once, each on a
    /// channel of its own (1: take, publish, confirm and mark one batch
    /// after the other).
    #[arg(long, env = "OUTBOX_PIPELINE_DEPTH", default_value_t = RelayConfig::DEFAULT_PIPELINE_DEPTH)]
    pub pipeline_depth: NonZeroU32,
    /// Seconds a taken batch stays this relay's; then another relay may
    /// publish what it did not mark (at least twice --confirm-timeout-secs).
    #[arg(long, env = "OUTBOX_LEASE_SECS", default_value_t = 30)]
    pub lease_secs: u64,
    /// Milliseconds between rounds when the last one found less than a batch.
    #[arg(long, env = "OUTBOX_POLL_INTERVAL_MS", default_value_t = 500)]
    pub poll_interval_ms: u64,
    /// Seconds to wait for a batch's confirms before counting them failed.
    #[arg(long, env = "OUTBOX_CONFIRM_TIMEOUT_SECS", default_value_t = 10)]
    pub confirm_timeout_secs: u64,
    #[command(flatten)]
    #[allow(missing_docs, reason = "clap reads the flattened struct's docs")]
    pub purge: OutboxPurgeArgs,
    /// Milliseconds a message waits after the broker first refused it (nack,
    /// returned unroutable); doubled per refusal in a row.
    #[arg(long, env = "OUTBOX_RETRY_BASE_MS", default_value_t = 1000)]
    pub retry_base_ms: u64,
    /// The longest wait between two publishes of a refused message, in
    /// seconds.
    #[arg(long, env = "OUTBOX_RETRY_MAX_SECS", default_value_t = 300)]
    pub retry_max_secs: u64,
    /// Refusals after which a message is dead in the outbox (listed by
    /// `outbox-dead`, requeued by `outbox-requeue`). Outages, lost
    /// connections and missing confirms never count.
    #[arg(long, env = "OUTBOX_MAX_PUBLISH_ATTEMPTS", default_value = "10")]
    pub max_publish_attempts: NonZeroU32,
    /// Seconds between background purges of published outbox rows (0: off).
    #[arg(long, env = "OUTBOX_PURGE_INTERVAL_SECS", default_value_t = 3600)]
    pub purge_interval_secs: u64,
}

impl RelayArgs {
    /// The `relay` command these flags (and `global`'s) make.
    ///
    /// # Errors
    /// [`AppError::Config`] for an unusable flag.
    pub fn relay(&self, global: &Global) -> Result<RelayCommand, AppError> {
        Ok(RelayCommand {
            config: self.settings.config(
                global,
                format!("parcel-inbox relay {}{}", global.prefix, std::process::id()),
            )?,
            metrics_addr: parse_metrics_addr(&self.metrics_addr)?,
        })
    }
}

impl RelaySettings {
    /// The flags that would have no effect: the purge's when it is off.
    pub fn idle(&self) -> Vec<Idle> {
        match self.purge_interval_secs {
            0 => vec![Idle::all_of::<OutboxPurgeArgs>(
                "--purge-interval-secs 0 turns the background purge off",
            )],
            _ => Vec::new(),
        }
    }

    /// The relay these flags (and `global`'s) make, on a connection named
    /// `connection_name`. It declares the Parcel exchange before
    /// publishing, so that the events go out before any `consume` process
    /// has declared its topology.
    ///
    /// # Errors
    /// [`AppError::Config`] for an unusable flag.
    pub fn config(
        &self,
        global: &Global,
        connection_name: String,
    ) -> Result<RelayConfig, AppError> {
        let config = RelayConfig {
            batch_size: self.batch_size,
            pipeline_depth: self.pipeline_depth,
            lease: Duration::from_secs(self.lease_secs),
            poll_interval: Duration::from_millis(self.poll_interval_ms),
            confirm_timeout: Duration::from_secs(self.confirm_timeout_secs),
            retry: PublishRetry {
                base_delay: Duration::from_millis(self.retry_base_ms),
                max_delay: Duration::from_secs(self.retry_max_secs),
                max_attempts: self.max_publish_attempts,
            },
            purge: match self.purge_interval_secs {
                0 => None,
                secs => Some(self.purge.config(Duration::from_secs(secs))?),
            },
            exchanges: vec![global.topology().exchange()],
            connection: global.amqp_connection(),
            ..RelayConfig::new(global.amqp_url.clone(), connection_name)
        };
        config.check()?;
        Ok(config)
    }
}

/// `relay`: the outbox relay and its metrics endpoint, until SIGINT/SIGTERM.
#[derive(Debug)]
pub struct RelayCommand {
    /// The relay's settings.
    pub config: RelayConfig,
    /// Where to serve `/metrics` (`None`: nowhere).
    pub metrics_addr: Option<SocketAddr>,
}

impl WithOutbox for RelayCommand {
    type Output = ();

    async fn run<S: OutboxStore + Clone + 'static>(
        self,
        store: S,
        wakeups: Option<BoxStream<'static, ()>>,
    ) -> Result<(), AppError> {
        let (stop_metrics, metrics_stopped) = watch::channel(false);
        // Bound and recording before anything runs: a port in use fails at
        // once, and no early count is lost.
        let endpoint = match self.metrics_addr {
            Some(addr) => Some((
                telemetry::bind(addr).await?,
                install_recorder(METRIC_NAMES)?,
            )),
            None => None,
        };
        let mut relay = Relay::new(store.clone(), self.config)?;
        if let Some(wakeups) = wakeups {
            relay = relay.wake_on(wakeups);
        }
        let relay = relay.spawn();
        if let Some((listener, metrics)) = endpoint {
            // Ready = a channel to the broker and a store that answers now:
            // a relay that can reach only one of them publishes nothing.
            let health = Health::new()
                .live_while(relay.running())
                .ready_while(
                    "broker",
                    relay.broker_connected(),
                    "no channel to the broker (connecting or reconnecting)",
                )
                .ready_when("store probe", telemetry::store_reachable(store));
            let router = telemetry::router(metrics, health);
            telemetry::serve(listener, router, metrics_stopped);
        }
        let shutdown = relay.shutdown_sender();
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!(
                "shutting down: finishing the batch in flight (signal again to exit at once)"
            );
            shutdown.send_replace(true);
            wait_for_signal().await;
            tracing::warn!(
                "second signal: exiting now; unmarked messages are published again after their lease"
            );
            std::process::exit(130);
        });
        let tally = Arc::clone(&relay.tally);
        let result = relay.join().await;
        stop_metrics.send_replace(true);
        println!(
            "relay stopped: {} published, {} failed, in {} batches",
            tally.published(),
            tally.failed(),
            tally.batches()
        );
        result
    }
}

/// The flags of `api`.
#[derive(Args, Debug, Clone)]
pub struct ApiArgs {
    /// Where to serve POST /parcels, GET /parcels/{id}, /metrics, /live and /ready.
    #[arg(long, env = "PARCEL_API_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Run no relay in this process: `parcel-inbox relay` processes publish
    /// the outbox (PostgreSQL stores only; the memory store's outbox lives
    /// in this process).
    #[arg(long)]
    pub no_relay: bool,
    #[command(flatten)]
    #[allow(missing_docs, reason = "clap reads the flattened struct's docs")]
    pub relay: RelaySettings,
}

impl ApiArgs {
    /// The flags that would have no effect: every relay flag with
    /// `--no-relay`, else the relay's own idle ones.
    pub fn idle(&self) -> Vec<Idle> {
        match self.no_relay {
            true => vec![Idle::all_of::<RelaySettings>(
                "--no-relay runs no relay in this process (`parcel-inbox relay` takes the relay's flags)",
            )],
            false => self.relay.idle(),
        }
    }

    /// The `api` command these flags (and `global`'s) make.
    ///
    /// # Errors
    /// [`AppError::Config`] for an unusable flag.
    pub fn api(&self, global: &Global) -> Result<ApiCommand, AppError> {
        if self.no_relay && global.store == StoreKind::Memory {
            return Err(AppError::Config(
                "--no-relay with the memory store: its outbox lives in this process, \
                 so no other process could publish it"
                    .into(),
            ));
        }
        let relay = if self.no_relay {
            None
        } else {
            Some(self.relay.config(
                global,
                format!("parcel-inbox api {}{}", global.prefix, std::process::id()),
            )?)
        };
        Ok(ApiCommand {
            listen: self.listen,
            topology: global.topology(),
            relay,
        })
    }
}

/// `api`: `POST /parcels` beside `/metrics`, `/live` and `/ready`, and (by
/// default) a relay woken by each creation, until SIGINT/SIGTERM.
///
/// Why the relay runs in the API's process by default: it publishes a
/// parcel's event as soon as its creation commits (no LISTEN round trip, no
/// poll), on every store, the memory store included; and more relays may
/// still run apart (`parcel-inbox relay`), sharing the outbox through its
/// leases. This is also what MassTransit's and Wolverine's outboxes do: the
/// delivery service runs in the application's host.
#[derive(Debug)]
pub struct ApiCommand {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The exchange the parcel events go to.
    pub topology: Topology,
    /// The in-process relay's settings (`None`: no relay here).
    pub relay: Option<RelayConfig>,
}

impl WithStore for ApiCommand {
    type Output = ();

    async fn run<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        let listener = telemetry::bind(self.listen).await?;
        let metrics = install_recorder(METRIC_NAMES)?;
        let api = crate::parcel::api::ParcelApi::new(store.clone(), &self.topology);
        let mut health =
            Health::new().ready_when("store probe", telemetry::store_reachable(store.clone()));
        let relay = match self.relay {
            Some(config) => {
                let relay = Relay::new(store, config)?.wake_on(api.committed()).spawn();
                health = health.live_while(relay.running()).ready_while(
                    "broker",
                    relay.broker_connected(),
                    "no channel to the broker (connecting or reconnecting)",
                );
                Some(relay)
            }
            None => None,
        };
        let router = telemetry::router(metrics, health).merge(api.router());
        let server = crate::parcel::api::ApiServer::serve(listener, router)?;
        println!("listening on http://{}", server.local_addr());
        // A relay that ends on its own (a refused login at start-up) ends
        // the command with its error: an API whose events never go out
        // must not look healthy.
        let relay_ended = relay.as_ref().map(|relay| relay.running().ended());
        tokio::select! {
            () = wait_for_signal() => {
                tracing::info!("shutting down: finishing the requests in flight");
            }
            () = async {
                match relay_ended {
                    Some(ended) => ended.await,
                    None => std::future::pending().await,
                }
            } => {
                tracing::error!("the outbox relay stopped; shutting down the API");
            }
        }
        server.stop().await;
        match relay {
            Some(relay) => {
                relay.shutdown();
                let tally = Arc::clone(&relay.tally);
                let result = relay.join().await;
                println!(
                    "relay stopped: {} published, {} failed, in {} batches",
                    tally.published(),
                    tally.failed(),
                    tally.batches()
                );
                result
            }
            None => Ok(()),
        }
    }
}

/// Parses a `--metrics-addr` (`off` or empty: none).
fn parse_metrics_addr(addr: &str) -> Result<Option<SocketAddr>, AppError> {
    match addr {
        "off" | "" => Ok(None),
        addr => addr
            .parse::<SocketAddr>()
            .map(Some)
            .map_err(|e| AppError::Config(format!("--metrics-addr {addr:?}: {e}"))),
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(error) => {
                tracing::warn!(error = %error, "cannot listen for SIGTERM; SIGINT only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Runs a binary's async body on a multi-threaded runtime with logging set
/// up, and turns its result into the exit status: on error, the whole
/// cause chain on stderr and a failure status. Every binary of the service
/// and of its lab starts and ends this way.
pub fn run_main<E: std::error::Error>(
    log_format: LogFormat,
    body: impl Future<Output = Result<(), E>>,
) -> ExitCode {
    crate::tools::logging::init_logging(log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(body) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", inbox_runtime::error::chain(&error));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{Args, Command, FromArgMatches};

    use super::*;

    /// Parses `A` alone from `args`.
    fn parse<A: Args + FromArgMatches>(args: &[&str]) -> (A, Command) {
        let command = A::augment_args(Command::new("t"));
        let matches = command
            .clone()
            .try_get_matches_from(std::iter::once("t").chain(args.iter().copied()))
            .expect("the flags parse");
        (A::from_arg_matches(&matches).expect("the flags"), command)
    }

    /// Every id a rule names is a flag of the command it is checked on: a
    /// misspelt id would never be refused.
    fn assert_ids_exist(idle: &[Idle], command: &Command) {
        assert!(!idle.is_empty());
        for id in idle.iter().flat_map(|rule| &rule.ids) {
            assert!(
                command.get_arguments().any(|arg| arg.get_id() == id),
                "{id} is not a flag"
            );
        }
    }

    #[test]
    fn every_idle_rule_names_existing_flags() {
        let (global, command) = parse::<Global>(&[]);
        assert_ids_exist(&global.idle(Uses::default()), &command);
        if cfg!(feature = "memory") {
            let (global, command) = parse::<Global>(&["--store=memory"]);
            let idle = global.idle(Uses {
                store: true,
                ..Uses::default()
            });
            assert_ids_exist(&idle, &command);
            assert!(
                idle.iter()
                    .any(|rule| rule.ids.iter().any(|id| id == "pool_size")),
                "{idle:?}"
            );
        }
        let (consume, command) = parse::<ConsumeArgs>(&[
            "--cleanup-interval-secs=0",
            "--metrics-addr=off",
            "--batch-size=1",
            "--batch-wait=1",
        ]);
        assert_eq!(consume.idle().len(), 3);
        assert_ids_exist(&consume.idle(), &command);
        let (api, command) = parse::<ApiArgs>(&["--no-relay"]);
        assert_ids_exist(&api.idle(), &command);
        assert!(api.idle()[0].ids.len() >= 11, "{:?}", api.idle());
    }

    #[test]
    fn flags_where_they_act_are_not_idle() {
        let (global, _) = parse::<Global>(&["--pool-size=3"]);
        let all = Uses {
            command: "consume",
            store: true,
            schema: true,
            broker: true,
            names: true,
            queues: true,
        };
        assert!(global.idle(all).is_empty());
        let (consume, _) = parse::<ConsumeArgs>(&["--batch-size=10", "--batch-wait=5"]);
        assert!(consume.idle().is_empty(), "{:?}", consume.idle());
        let (api, _) = parse::<ApiArgs>(&[]);
        assert!(api.idle().is_empty(), "{:?}", api.idle());
    }
}
