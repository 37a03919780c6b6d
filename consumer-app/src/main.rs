//! `parcel-inbox`: the Parcel Tracking service's command line.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use consumer_app::batch::BatchConfig;
use consumer_app::demo::{self, DemoConfig};
use consumer_app::dispatch::{
    LedgerCarrier, LedgerNotifier, MarkDispatched, ReconcileConfig, reconcile_loop,
};
use consumer_app::publish::{Plan, publish};
use consumer_app::redact::redact_url;
use consumer_app::service::{CleanupConfig, Downstreams, ServiceConfig, cleanup_once, spawn};
use consumer_app::store::{ParcelStore, StoreConfig, StoreKind, WithStore, with_store};
use consumer_app::tally::Faults;
use consumer_app::telemetry::{init_logging, install_recorder, serve_metrics};
use consumer_app::topology::Topology;
use consumer_app::worker::WorkerConfig;
use consumer_app::{AppError, error::chain};
use tokio::sync::watch;

/// Parcel Tracking: RabbitMQ consumers with exactly-once effects through the inbox.
// No Debug: the URLs may hold passwords.
#[derive(Parser)]
#[command(name = "parcel-inbox", version, about)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Clone)]
struct Global {
    /// The store (each must be compiled in: cargo features sqlx, diesel, memory).
    #[arg(long, env = "PARCEL_STORE", global = true, default_value_t = default_store())]
    store: StoreKind,
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        global = true,
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// RabbitMQ URL.
    #[arg(
        long,
        env = "AMQP_URL",
        global = true,
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// PostgreSQL schema of the inbox and the app's tables (search_path).
    #[arg(
        long,
        env = "INBOX_SCHEMA",
        global = true,
        default_value = "parcel_inbox"
    )]
    schema: String,
    /// Prefix of every exchange and queue name (tests use their own).
    #[arg(long, env = "PARCEL_PREFIX", global = true, default_value = "")]
    prefix: String,
    /// PostgreSQL connections in the pool.
    #[arg(long, env = "DATABASE_POOL_SIZE", global = true, default_value_t = 16)]
    pool_size: u32,
}

fn default_store() -> StoreKind {
    StoreKind::compiled()
        .first()
        .copied()
        .unwrap_or(StoreKind::Sqlx)
}

#[derive(Args, Debug, Clone)]
struct WorkerArgs {
    /// Unacknowledged deliveries per queue consumer (basic.qos).
    #[arg(long, env = "PARCEL_PREFETCH", default_value_t = 32)]
    prefetch: u16,
    /// Deliveries processed at once per queue.
    #[arg(long, env = "PARCEL_CONCURRENCY", default_value_t = 8)]
    concurrency: usize,
    /// Bound on one attempt, begin to commit (keep it well below RabbitMQ's consumer_timeout).
    #[arg(long, env = "PARCEL_HANDLE_TIMEOUT_SECS", default_value_t = 30)]
    handle_timeout_secs: u64,
    /// In-process attempts per delivery before it is requeued.
    #[arg(long, env = "PARCEL_RETRY_ATTEMPTS", default_value_t = 3)]
    retry_attempts: u32,
    /// Deliveries of one message before it is dead-lettered as retries_exhausted.
    #[arg(long, env = "PARCEL_MAX_DELIVERIES", default_value_t = 10)]
    max_deliveries: u32,
    /// Largest accepted body, in bytes.
    #[arg(long, env = "PARCEL_MAX_BODY_BYTES", default_value_t = 64 * 1024)]
    max_body_bytes: usize,
    /// Batched mode: up to this many deliveries per transaction (needs
    /// --batch-wait and a prefetch above 1; best with prefetch = 2 × batch size × concurrency, so the next batch arrives while one commits).
    #[arg(long, env = "PARCEL_BATCH_SIZE", requires = "batch_wait")]
    batch_size: Option<usize>,
    /// Batched mode: milliseconds a batch waits for more deliveries after its first.
    #[arg(long, env = "PARCEL_BATCH_WAIT_MS", requires = "batch_size")]
    batch_wait: Option<u64>,
}

impl WorkerArgs {
    fn config(&self) -> WorkerConfig {
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

#[derive(Args, Debug, Clone)]
struct CleanupArgs {
    /// Keep processed inbox rows this many days.
    #[arg(long, env = "INBOX_RETENTION_DAYS", default_value_t = 7.0)]
    retention_days: f64,
    /// Rows per delete transaction.
    #[arg(long, env = "INBOX_CLEANUP_BATCH", default_value = "1000")]
    cleanup_batch: std::num::NonZeroU32,
}

impl CleanupArgs {
    fn config(&self, interval: Duration) -> Result<CleanupConfig, AppError> {
        if !(self.retention_days >= 0.0 && self.retention_days.is_finite()) {
            return Err(AppError::Config(format!(
                "retention of {} days is not a non-negative number",
                self.retention_days
            )));
        }
        Ok(CleanupConfig {
            retention: Duration::from_secs_f64(self.retention_days * 86_400.0),
            interval,
            batch_size: self.cleanup_batch,
        })
    }
}

#[derive(Subcommand)]
enum Command {
    /// Create the schema, the inbox table and the app's tables (idempotent).
    Migrate,
    /// Run both consumers until SIGINT/SIGTERM.
    Consume {
        #[command(flatten)]
        worker: WorkerArgs,
        #[command(flatten)]
        cleanup: CleanupArgs,
        /// Seconds between background cleanups (0: off).
        #[arg(long, env = "INBOX_CLEANUP_INTERVAL_SECS", default_value_t = 3600)]
        cleanup_interval_secs: u64,
        /// Where to serve Prometheus /metrics ("off" to disable).
        #[arg(long, env = "METRICS_ADDR", default_value = "127.0.0.1:9464")]
        metrics_addr: String,
        /// Seconds between refreshes of the inbox_rows gauge.
        #[arg(long, default_value_t = 15)]
        gauge_interval_secs: u64,
        /// Fault injection for tests: time spent inside each transaction after the writes.
        #[arg(long, hide = true, default_value_t = 0)]
        fault_work_delay_ms: u64,
        /// Seconds between reconciler rounds, which re-send committed intents
        /// whose after-commit call never happened (the process died between
        /// COMMIT and the call). It also runs once at start.
        #[arg(long, env = "PARCEL_DISPATCH_INTERVAL_SECS", default_value_t = 10)]
        dispatch_interval_secs: u64,
        /// Age an undispatched intent must reach before the reconciler re-sends it.
        #[arg(long, env = "PARCEL_DISPATCH_MIN_AGE_SECS", default_value_t = 5)]
        dispatch_min_age_secs: u64,
        /// Fault injection for the chaos harness: run on one of the
        /// conformance suite's deliberately broken stores
        /// (claim-in-own-transaction, check-then-insert, work-before-claim,
        /// claim-without-waiting). Needs the `fault-injection` feature.
        #[arg(long, hide = true)]
        fault_broken_store: Option<String>,
    },
    /// Publish parcel events (with copies reusing message ids), with publisher confirms.
    Publish {
        /// Distinct events.
        #[arg(long, default_value_t = 100)]
        count: usize,
        /// Copies per event on average (0.1 = one copy per ten events).
        #[arg(long, default_value_t = 0.1)]
        duplicate_rate: f64,
        /// Seed of the copies' choice and placement.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Do not show progress.
        #[arg(long)]
        quiet: bool,
    },
    /// Delete processed inbox rows older than the retention, once, and print the count.
    Cleanup {
        #[command(flatten)]
        cleanup: CleanupArgs,
    },
    /// Print inbox rows, per-consumer counts, effects and double effects.
    Stats,
    /// Migrate, consume, publish with copies and a crash, and prove exactly-once effects.
    Demo {
        /// Distinct events.
        #[arg(long, default_value_t = 200)]
        events: usize,
        /// Copies per event on average.
        #[arg(long, default_value_t = 0.25)]
        duplicate_rate: f64,
        /// Keep the demo's schema and queues afterwards.
        #[arg(long)]
        keep: bool,
        /// Seconds to wait for the queues to drain.
        #[arg(long, default_value_t = 120)]
        drain_timeout_secs: u64,
        #[command(flatten)]
        worker: WorkerArgs,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
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
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", chain(&error));
            ExitCode::FAILURE
        }
    }
}

impl Global {
    fn store(&self) -> StoreConfig {
        StoreConfig {
            kind: self.store,
            database_url: self.database_url.clone(),
            schema: self.schema.clone(),
            pool_size: self.pool_size,
        }
    }
}

async fn run(cli: Cli) -> Result<(), AppError> {
    let global = cli.global;
    tracing::info!(store = %global.store, database = %redact_url(&global.database_url),
        amqp = %redact_url(&global.amqp_url), schema = %global.schema, prefix = %global.prefix,
        "parcel-inbox starting");
    let store = global.store();
    match cli.command {
        Command::Migrate => with_store(&store, Some(10), Migrate).await,
        Command::Stats => with_store(&store, Some(5), PrintStats).await,
        Command::Cleanup { cleanup } => {
            let config = cleanup.config(Duration::ZERO)?;
            with_store(&store, Some(5), CleanupOnce(config)).await
        }
        Command::Publish {
            count,
            duplicate_rate,
            seed,
            quiet,
        } => {
            let plan = Plan::new(count, duplicate_rate, seed, "P")?;
            publish(
                &global.amqp_url,
                &Topology::new(&global.prefix),
                &plan.messages,
                !quiet,
            )
            .await?;
            println!(
                "published {} messages ({} distinct events, {} copies) to {}",
                plan.messages.len(),
                plan.ids.len(),
                plan.copies,
                Topology::new(&global.prefix).exchange()
            );
            Ok(())
        }
        Command::Consume {
            worker,
            cleanup,
            cleanup_interval_secs,
            metrics_addr,
            gauge_interval_secs,
            fault_work_delay_ms,
            dispatch_interval_secs,
            dispatch_min_age_secs,
            fault_broken_store,
        } => {
            let cleanup = if cleanup_interval_secs == 0 {
                None
            } else {
                Some(cleanup.config(Duration::from_secs(cleanup_interval_secs))?)
            };
            let metrics_addr = match metrics_addr.as_str() {
                "off" | "" => None,
                addr => Some(
                    addr.parse::<SocketAddr>()
                        .map_err(|e| AppError::Config(format!("--metrics-addr {addr:?}: {e}")))?,
                ),
            };
            let consume = Consume {
                config: ServiceConfig {
                    amqp_url: global.amqp_url.clone(),
                    topology: Topology::new(&global.prefix),
                    worker: worker.config(),
                    connection_name: format!(
                        "parcel-inbox consume {}{}",
                        global.prefix,
                        std::process::id()
                    ),
                    cleanup,
                    gauge_interval: Some(Duration::from_secs(gauge_interval_secs.max(1))),
                },
                metrics_addr,
                work_delay: Duration::from_millis(fault_work_delay_ms),
                reconcile: ReconcileConfig {
                    interval: Duration::from_secs(dispatch_interval_secs.max(1)),
                    min_age: Duration::from_secs(dispatch_min_age_secs),
                    ..ReconcileConfig::default()
                },
                broken: broken_store(fault_broken_store.as_deref())?,
            };
            with_store(&store, None, consume).await
        }
        Command::Demo {
            events,
            duplicate_rate,
            keep,
            drain_timeout_secs,
            worker,
        } => {
            let summary = demo::run(DemoConfig {
                store,
                amqp_url: global.amqp_url.clone(),
                events,
                duplicate_rate,
                keep,
                worker: worker.config(),
                drain_timeout: Duration::from_secs(drain_timeout_secs),
            })
            .await?;
            println!("{summary}");
            Ok(())
        }
    }
}

struct Migrate;

impl WithStore for Migrate {
    type Output = ();

    async fn run<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        store.migrate_all().await?;
        println!("migrated ({} store)", store.kind());
        Ok(())
    }
}

struct PrintStats;

impl WithStore for PrintStats {
    type Output = ();

    async fn run<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        let stats = store.stats().await?;
        if store.kind() == StoreKind::Memory {
            println!("(memory store: a fresh, empty store in this process)");
        }
        print!("{stats}");
        Ok(())
    }
}

struct CleanupOnce(CleanupConfig);

impl WithStore for CleanupOnce {
    type Output = ();

    async fn run<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        let deleted = cleanup_once(&store, &self.0).await?;
        println!(
            "deleted {deleted} processed inbox rows older than {:.1} days",
            self.0.retention.as_secs_f64() / 86_400.0
        );
        Ok(())
    }
}

struct Consume {
    config: ServiceConfig,
    metrics_addr: Option<SocketAddr>,
    work_delay: Duration,
    reconcile: ReconcileConfig,
    broken: Option<BrokenKind>,
}

#[cfg(feature = "fault-injection")]
type BrokenKind = inbox_conformance::broken::Broken;
#[cfg(not(feature = "fault-injection"))]
type BrokenKind = std::convert::Infallible;

/// Parses `--fault-broken-store`.
fn broken_store(name: Option<&str>) -> Result<Option<BrokenKind>, AppError> {
    let Some(name) = name else {
        return Ok(None);
    };
    #[cfg(feature = "fault-injection")]
    {
        use inbox_conformance::broken::Broken;
        let kind = match name {
            "claim-in-own-transaction" => Broken::ClaimInOwnTransaction,
            "check-then-insert" => Broken::CheckThenInsert,
            "work-before-claim" => Broken::WorkBeforeClaim,
            "claim-without-waiting" => Broken::ClaimWithoutWaiting,
            other => {
                return Err(AppError::Config(format!(
                    "--fault-broken-store {other:?}: not a broken store"
                )));
            }
        };
        tracing::warn!(broken = ?kind, "running on a DELIBERATELY BROKEN inbox store (fault injection)");
        Ok(Some(kind))
    }
    #[cfg(not(feature = "fault-injection"))]
    Err(AppError::Config(format!(
        "--fault-broken-store {name:?}: built without the fault-injection feature"
    )))
}

impl WithStore for Consume {
    type Output = ();

    async fn run<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        match self.broken {
            None => self.serve(store).await,
            #[cfg(feature = "fault-injection")]
            Some(kind) => {
                self.serve(inbox_conformance::broken::BrokenStore::new(store, kind))
                    .await
            }
            #[cfg(not(feature = "fault-injection"))]
            Some(never) => match never {},
        }
    }
}

impl Consume {
    async fn serve<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        let (stop_metrics, metrics_stopped) = watch::channel(false);
        if let Some(addr) = self.metrics_addr {
            let handle = install_recorder()?;
            serve_metrics(addr, handle, metrics_stopped).await?;
        }
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
        let service = spawn(
            store.clone(),
            self.config,
            downstreams.clone(),
            Arc::new(Faults::with_work_delay(self.work_delay)),
        )?;
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
        result
    }
}

async fn wait_for_signal() {
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
