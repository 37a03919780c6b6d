//! The running service: consumers on their queues, reconnecting, shutting
//! down gracefully, with cleanup and the `inbox_rows` gauge beside them.
//!
//! One AMQP connection; per queue one consuming channel (with its own
//! prefetch) and one confirm-mode channel for dead-letter publishes. When
//! the connection or a channel dies, every in-flight delivery of it is
//! redelivered by the broker (the inbox makes that safe), and the service
//! reconnects with backoff.
//!
//! The store is checked before anything is consumed (`check_store`): a
//! schema that is missing, not migrated or not this role's to use refuses
//! the start with that error (run the migrations); a store that cannot be
//! reached yet is waited for. PostgreSQL going away mid-run, or the schema
//! with it, opens the store circuit ([`crate::availability`]):
//! the consumers pause, the deliveries they hold go back uncharged, and
//! consumption resumes when a probe of the store succeeds.
//!
//! Shutdown (SIGINT/SIGTERM in the binary, or [`ServiceHandle::shutdown`]):
//! cancel the consumers so nothing new arrives, let in-flight deliveries
//! finish and ack, close the channels (the broker requeues what was
//! prefetched but never started) and the connection.
//!
//! ```no_run
//! # use inbox_runtime::{Service, ServiceConfig, ServiceStore, Handler, AppError, Topology};
//! # fn wire<S: ServiceStore, H: Handler<S::Transaction>>(store: S, config: ServiceConfig, handler: H) -> Result<(), AppError> {
//! let topology = Topology::new("shop.events").bind("shop.invoice-paid", "invoice.paid");
//! let service = Service::new(store, config, topology)
//!     .consume("shop.invoice-paid", handler)
//!     .spawn()?;
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use inbox_api::metrics as names;
use inbox_api::{
    AttemptLedger, AttemptLedgerExt, Inbox, InboxStats, InboxStore, InboxStoreExt, MessageId,
    OutboxStore,
};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::availability::{StoreCheck, StoreChecks, StoreCircuit, check_store};
use crate::backoff::RECONNECT;
use crate::broker::{Broker, OnRefusal, Retrying, connect_with_backoff};
use crate::brokers::{BrokerKind, Connected};
use crate::config::{CleanupConfig, ServiceConfig};
use crate::context::Context;
use crate::delivery::Subscription as _;
use crate::error::chain;
use crate::handler::Handler;
use crate::queue::queue_loop;
use crate::relay::{Relay, RelayConfig, RelayTally};
use crate::shutdown::stopped;
use crate::tally::{ConsumerTally, Tally};
use crate::telemetry::{MetricNames, Running};
use crate::topology::Topology;
use crate::wakeups::OutboxWakeups;
use crate::worker::Worker;
use crate::{AppError, ServiceStore};

/// How often a running session looks at its broker connection, for
/// readiness (see [`Broker::is_connected`]).
const CONNECTION_CHECK: Duration = Duration::from_millis(500);

/// A service being put together: a store, settings, the topology to declare,
/// and a [`Handler`] per queue. [`Service::spawn`] starts it.
pub struct Service<S: ServiceStore> {
    store: S,
    config: ServiceConfig,
    topology: Topology,
    metric_names: MetricNames,
    consumers: Vec<Box<dyn Consume<S>>>,
    relay: Option<StartRelay<S>>,
}

/// A task of the service's: the consumers' supervisor, or the relay.
type Task = JoinHandle<Result<(), AppError>>;

/// Starts the service's relay on its store, stopping with `shutdown`.
type StartRelay<S> =
    Box<dyn FnOnce(S, watch::Receiver<bool>) -> Result<(Arc<RelayTally>, Task), AppError> + Send>;

impl<S: ServiceStore> Service<S> {
    /// A service on `store` that declares `topology` on every (re)connect,
    /// with no consumer yet.
    pub fn new(store: S, config: ServiceConfig, topology: Topology) -> Self {
        Self {
            store,
            config,
            topology,
            metric_names: MetricNames::default(),
            consumers: Vec::new(),
            relay: None,
        }
    }

    /// Runs the outbox relay beside the consumers, with the default
    /// [`RelayConfig`] on the service's broker (and its connect options): what the handlers publish
    /// with [`Context::publish`] goes out, with publisher confirms, after
    /// their transactions commit. Its wake-ups ([`OutboxWakeups`]) start
    /// with it; it stops with the service, and [`ServiceHandle::join`]
    /// waits for both.
    #[must_use]
    pub fn with_relay(self) -> Self
    where
        S: OutboxStore + OutboxWakeups + Send + Sync + 'static,
    {
        let mut config = RelayConfig::new(
            self.config.broker_url.clone(),
            format!("{} relay", self.config.connection_name),
        );
        config.connection = self.config.connection;
        self.relay(config)
    }

    /// [`Service::with_relay`] with settings of its own. The topology's
    /// exchange is added to [`RelayConfig::exchanges`], so that the relay
    /// can publish before any consumer of the events has declared it.
    #[must_use]
    pub fn relay(mut self, mut config: RelayConfig) -> Self
    where
        S: OutboxStore + OutboxWakeups + Send + Sync + 'static,
    {
        let exchange = self.topology.exchange().to_owned();
        if !config.exchanges.contains(&exchange) {
            config.exchanges.push(exchange);
        }
        self.relay = Some(Box::new(move |store: S, shutdown| {
            let relay = Relay::new(store.clone(), config)?;
            let tally = relay.tally();
            let task = tokio::spawn(async move {
                let relay = match store.wakeups().await {
                    Some(wakeups) => relay.wake_on(wakeups),
                    None => relay,
                };
                relay.run(shutdown).await
            });
            Ok((tally, task))
        }));
        self
    }

    /// Runs `handler` on the deliveries of `queue` (one of the topology's),
    /// with its own channels, prefetch and concurrency.
    #[must_use]
    pub fn consume<H: Handler<S::Transaction>>(
        mut self,
        queue: impl Into<String>,
        handler: H,
    ) -> Self {
        self.consumers.push(Box::new(Registered {
            queue: queue.into(),
            exchange: Arc::from(self.topology.exchange()),
            handler: Arc::new(handler),
            tally: Arc::default(),
            metric_names: MetricNames::default(),
        }));
        self
    }

    /// Names the runtime's own counters (see [`MetricNames`]).
    #[must_use]
    pub fn metric_names(mut self, names: MetricNames) -> Self {
        self.metric_names = names;
        self
    }

    /// Starts the consumers, cleanup and the gauge.
    ///
    /// # Errors
    /// [`AppError::Config`] for a service without consumers, two of them
    /// with one consumer name (they would share their inbox rows), or a
    /// broker URL whose scheme names no broker the runtime speaks.
    pub fn spawn(mut self) -> Result<ServiceHandle, AppError> {
        if self.consumers.is_empty() {
            return Err(AppError::Config("a service needs a consumer".into()));
        }
        let names: Vec<&str> = self.consumers.iter().map(|c| c.name()).collect();
        let tally = Arc::new(Tally::new(names.iter().copied()));
        if names.len() != tally.len() {
            return Err(AppError::Config(
                "two consumers share one consumer name".into(),
            ));
        }
        for consumer in &mut self.consumers {
            let shared = tally.shared(consumer.name());
            consumer.count_into(shared, self.metric_names);
        }
        let broker_kind = BrokerKind::of(&self.config.broker_url)?;
        let (shutdown, shutdown_rx) = watch::channel(false);
        let relay = match self.relay.take() {
            Some(start) => Some(start(self.store.clone(), shutdown_rx.clone())?),
            None => None,
        };
        let (sessions_tx, sessions) = watch::channel(0_u64);
        let (broker_tx, broker) = watch::channel(false);
        let (broker_error_tx, broker_error) = watch::channel(None);
        let (alive, running) = Running::new();
        let config = self.config;
        let store = self.store;
        let circuit = Arc::new(StoreCircuit::new(config.availability));
        let availability = circuit.subscribe();
        let checks: StoreChecks<S::Transaction> =
            self.consumers.iter().map(|c| c.store_check()).collect();
        let supervisor = Supervisor {
            inbox: Arc::new(Inbox::new(store.clone())),
            broker_kind,
            config: config.clone(),
            topology: self.topology,
            consumers: self.consumers,
            sessions: sessions_tx,
            broker: broker_tx,
            broker_error: broker_error_tx,
            circuit: Arc::clone(&circuit),
            checks: Arc::clone(&checks),
        };
        let mut background = Vec::new();
        let batched = config.worker.batch.is_some();
        let (probe_store, probe_stop) = (store.clone(), shutdown_rx.clone());
        background.push(tokio::spawn(async move {
            circuit
                .probe_loop(probe_store, batched, checks, probe_stop)
                .await;
        }));
        if let Some(cleanup) = config.cleanup.clone() {
            background.push(tokio::spawn(cleanup_loop(
                store.clone(),
                cleanup,
                shutdown_rx.clone(),
            )));
        }
        if let Some(every) = config.gauge_interval {
            background.push(tokio::spawn(gauge_loop(store, every, shutdown_rx.clone())));
        }
        let stop_background = shutdown.clone();
        let task = tokio::spawn(async move {
            let _alive = alive;
            let result = supervisor.run(shutdown_rx).await;
            // However the consumers ended, the background tasks end with them.
            stop_background.send_replace(true);
            for task in background {
                // They watch the same shutdown flag; a failure only logs.
                let _ = task.await;
            }
            result
        });
        Ok(ServiceHandle {
            shutdown,
            sessions,
            broker,
            broker_error,
            running,
            availability,
            task,
            tally,
            relay,
        })
    }
}

/// A queue's consuming loop, once opened on a connection.
type QueueLoop =
    Box<dyn FnOnce(watch::Receiver<bool>) -> BoxFuture<'static, Result<(), AppError>> + Send>;

/// One registered consumer, its handler's type erased, so that a service
/// holds consumers of different message types.
trait Consume<S: ServiceStore>: Send + Sync {
    /// The consumer name.
    fn name(&self) -> &str;

    /// Where its counters go and what its metrics are called.
    fn count_into(&mut self, tally: Arc<ConsumerTally>, names: MetricNames);

    /// Its handler's check of the store, for the store check.
    fn store_check(&self) -> Arc<dyn StoreCheck<S::Transaction>>;

    /// Subscribes on `broker`; the loop is then ready to spawn.
    fn open<'a>(
        &'a self,
        broker: &'a Connected,
        inbox: &'a Arc<Inbox<S>>,
        config: &'a ServiceConfig,
        circuit: &'a Arc<StoreCircuit>,
    ) -> BoxFuture<'a, Result<QueueLoop, AppError>>;
}

struct Registered<H> {
    queue: String,
    /// Where the handler's [`Context::publish`](crate::Context::publish)
    /// sends: the topology's exchange.
    exchange: Arc<str>,
    handler: Arc<H>,
    tally: Arc<ConsumerTally>,
    metric_names: MetricNames,
}

impl<S, H> Consume<S> for Registered<H>
where
    S: ServiceStore,
    H: Handler<S::Transaction>,
{
    fn name(&self) -> &str {
        self.handler.name().as_str()
    }

    fn count_into(&mut self, tally: Arc<ConsumerTally>, names: MetricNames) {
        self.tally = tally;
        self.metric_names = names;
    }

    fn store_check(&self) -> Arc<dyn StoreCheck<S::Transaction>> {
        Arc::new(HandlerCheck {
            handler: Arc::clone(&self.handler),
            exchange: Arc::clone(&self.exchange),
        })
    }

    fn open<'a>(
        &'a self,
        broker: &'a Connected,
        inbox: &'a Arc<Inbox<S>>,
        config: &'a ServiceConfig,
        circuit: &'a Arc<StoreCircuit>,
    ) -> BoxFuture<'a, Result<QueueLoop, AppError>> {
        Box::pin(async move {
            match broker {
                #[cfg(feature = "rabbitmq")]
                Connected::RabbitMq(broker) => self.open_on(broker, inbox, config, circuit).await,
                #[cfg(feature = "nats")]
                Connected::Nats(broker) => self.open_on(broker, inbox, config, circuit).await,
            }
        })
    }
}

impl<H> Registered<H> {
    /// Subscribes on `broker` and makes the queue's loop, ready to spawn.
    async fn open_on<S, B>(
        &self,
        broker: &B,
        inbox: &Arc<Inbox<S>>,
        config: &ServiceConfig,
        circuit: &Arc<StoreCircuit>,
    ) -> Result<QueueLoop, AppError>
    where
        S: ServiceStore,
        H: Handler<S::Transaction>,
        B: Broker,
    {
        let subscription = broker
            .subscribe(&self.queue, self.handler.name().as_str(), &config.worker)
            .await?;
        let worker = Worker {
            inbox: Arc::clone(inbox),
            handler: Arc::clone(&self.handler),
            exchange: Arc::clone(&self.exchange),
            queue: self.queue.clone(),
            config: config.worker.clone(),
            metric_names: self.metric_names,
            tally: Arc::clone(&self.tally),
            settler: subscription.settler(),
            circuit: Arc::clone(circuit),
        };
        let run: QueueLoop =
            Box::new(move |shutdown| Box::pin(queue_loop(subscription, worker, shutdown)));
        Ok(run)
    }
}

/// A handler as a [`StoreCheck`].
struct HandlerCheck<H> {
    handler: Arc<H>,
    exchange: Arc<str>,
}

impl<Tx: Send, H: Handler<Tx>> StoreCheck<Tx> for HandlerCheck<H> {
    fn check<'a>(&'a self, tx: &'a mut Tx) -> BoxFuture<'a, Result<(), AppError>> {
        Box::pin(async move {
            // A message of its own, which the rollback forgets.
            let mut cx = Context::new(tx, MessageId::new_v7(), self.handler.name(), &self.exchange);
            self.handler.check(&mut cx).await
        })
    }
}

/// A service started by [`Service::spawn`].
pub struct ServiceHandle {
    shutdown: watch::Sender<bool>,
    sessions: watch::Receiver<u64>,
    broker: watch::Receiver<bool>,
    broker_error: watch::Receiver<Option<String>>,
    running: Running,
    availability: watch::Receiver<bool>,
    task: Task,
    /// What the message path did, per consumer.
    pub tally: Arc<Tally>,
    /// The relay's counters and task, when it runs beside the consumers.
    relay: Option<(Arc<RelayTally>, Task)>,
}

impl ServiceHandle {
    /// Asks for a graceful shutdown (idempotent).
    pub fn shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    /// A sender that triggers shutdown, for signal handlers.
    pub fn shutdown_sender(&self) -> watch::Sender<bool> {
        self.shutdown.clone()
    }

    /// Waits until the service is consuming on its `n`-th connection
    /// (1 = the first), or `timeout` passes.
    ///
    /// # Errors
    /// [`AppError::Unavailable`] on timeout.
    pub async fn wait_consuming(&self, n: u64, timeout: Duration) -> Result<(), AppError> {
        let mut sessions = self.sessions.clone();
        tokio::time::timeout(timeout, sessions.wait_for(|s| *s >= n))
            .await
            .map_err(|_| {
                AppError::Unavailable(format!(
                    "service not consuming (session {n}) within {timeout:?}"
                ))
            })?
            .map_err(|_| AppError::Unavailable("service stopped".into()))?;
        Ok(())
    }

    /// Waits until every consumer consumes (its channels open on a
    /// connection to the broker), or `timeout` passes: what a test or a
    /// start-up script waits for before it publishes.
    ///
    /// # Errors
    /// [`AppError::Unavailable`] on timeout, or when the service stopped.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), AppError> {
        let mut broker = self.broker.clone();
        tokio::time::timeout(timeout, broker.wait_for(|up| *up))
            .await
            .map_err(|_| {
                AppError::Unavailable(format!("the consumers did not start within {timeout:?}"))
            })?
            .map_err(|_| AppError::Unavailable("service stopped".into()))?;
        Ok(())
    }

    /// The counters of the relay started by [`Service::with_relay`], if
    /// any.
    pub fn relay(&self) -> Option<&RelayTally> {
        self.relay.as_ref().map(|(tally, _)| &**tally)
    }

    /// Whether the consumers consume, and if not, why: what a readiness
    /// check answers.
    pub fn broker_readiness(&self) -> BrokerReadiness {
        BrokerReadiness {
            connected: self.broker.clone(),
            last_error: self.broker_error.clone(),
        }
    }

    /// True while the consumers consume on an open connection (false
    /// while connecting, reconnecting, or stopped): for readiness.
    pub fn broker_connected(&self) -> watch::Receiver<bool> {
        self.broker.clone()
    }

    /// Whether the service's task still runs (for liveness): false once it
    /// ended, however it ended.
    pub fn running(&self) -> Running {
        self.running.clone()
    }

    /// Whether the store answers and the service consumes: `false` while a
    /// store outage pauses it (see [`crate::availability`]). Cheap:
    /// a readiness endpoint may call it per request.
    pub fn store_available(&self) -> bool {
        *self.availability.borrow()
    }

    /// The store's availability as a watch: `true` while the service
    /// consumes, `false` while a store outage pauses it; a receiver sees
    /// every change (`changed`, `wait_for`).
    pub fn store_availability(&self) -> watch::Receiver<bool> {
        self.availability.clone()
    }

    /// How many connections the service has consumed on so far.
    pub fn sessions(&self) -> u64 {
        *self.sessions.borrow()
    }

    /// Waits for the service to end (after [`ServiceHandle::shutdown`]).
    ///
    /// # Errors
    /// The service's error, or a panic turned into one.
    pub async fn join(self) -> Result<(), AppError> {
        let service = joined(self.task, "service").await;
        // The relay watches the same shutdown (and the service's end sets
        // it), so it is ending too.
        let relay = match self.relay {
            Some((_, task)) => joined(task, "relay").await,
            None => Ok(()),
        };
        service.and(relay)
    }
}

/// The broker side of a service's readiness: consuming, or why not.
#[derive(Clone, Debug)]
pub struct BrokerReadiness {
    connected: watch::Receiver<bool>,
    last_error: watch::Receiver<Option<String>>,
}

impl BrokerReadiness {
    /// `Ok` while the consumers consume; otherwise what the service is
    /// doing and the cause of the last failure (the broker's address
    /// redacted), so that a 503 says why.
    ///
    /// # Errors
    /// The reason it is not consuming.
    pub fn status(&self) -> Result<(), String> {
        if *self.connected.borrow() {
            return Ok(());
        }
        match &*self.last_error.borrow() {
            Some(error) => Err(format!("not consuming, reconnecting: {error}")),
            None => Err("not consuming yet (connecting)".to_owned()),
        }
    }
}

/// A task's result, a panic turned into an error.
async fn joined(task: JoinHandle<Result<(), AppError>>, what: &str) -> Result<(), AppError> {
    match task.await {
        Ok(result) => result,
        Err(error) => Err(AppError::Unavailable(format!(
            "{what} task failed: {error}"
        ))),
    }
}

/// Logs `error` and waits the backoff of the `failures`-th failure in a
/// row; `false` when shutdown came first.
async fn pause_after(
    error: &AppError,
    what: &'static str,
    failures: u32,
    shutdown: &mut watch::Receiver<bool>,
) -> bool {
    let delay = RECONNECT.delay(failures);
    tracing::warn!(error = %chain(error), ?delay, "{what}");
    tokio::select! {
        () = tokio::time::sleep(delay) => true,
        () = stopped(shutdown) => false,
    }
}

struct Supervisor<S: ServiceStore> {
    inbox: Arc<Inbox<S>>,
    /// The broker the URL names, checked before anything starts.
    broker_kind: BrokerKind,
    config: ServiceConfig,
    topology: Topology,
    consumers: Vec<Box<dyn Consume<S>>>,
    sessions: watch::Sender<u64>,
    /// True while a session consumes (see [`ServiceHandle::broker_connected`]).
    broker: watch::Sender<bool>,
    /// Why the last connection attempt or session failed, for readiness.
    broker_error: watch::Sender<Option<String>>,
    circuit: Arc<StoreCircuit>,
    checks: StoreChecks<S::Transaction>,
}

impl<S: ServiceStore> Supervisor<S> {
    async fn run(self, mut shutdown: watch::Receiver<bool>) -> Result<(), AppError> {
        let mut failures = 0;
        // Before anything is consumed: a schema that is missing, not
        // migrated or not this role's (or, in batched mode, a store without
        // savepoints) would fail every message, so the start is refused
        // with the cause; a store that cannot be reached right now (still
        // starting, restarting) is asked again.
        let batched = self.config.worker.batch.is_some();
        loop {
            match check_store(self.inbox.store(), batched, &self.checks).await {
                Ok(()) => break,
                Err(error) if error.is_retryable() => {
                    failures += 1;
                    let what = "the store cannot be reached yet; waiting for it before consuming";
                    if !pause_after(&error, what, failures, &mut shutdown).await {
                        return Ok(());
                    }
                }
                Err(error) => {
                    tracing::error!(error = %chain(&error),
                        "the store is not ready for the inbox; not consuming (migrate its schema first)");
                    return Err(error);
                }
            }
        }
        failures = 0;
        self.circuit.report();
        let mut connected_once = false;
        loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            // Refused credentials end the service only before it has ever
            // connected (a configuration error); later they are a rotation
            // in progress, retried.
            let on_refusal = if connected_once {
                OnRefusal::Retry
            } else {
                OnRefusal::Fail
            };
            let url = &self.config.broker_url;
            let (name, options) = (&self.config.connection_name, self.config.connection);
            let retrying = Retrying {
                attempts: None,
                on_refusal,
                last_error: Some(&self.broker_error),
            };
            let connection = match connect_with_backoff(
                url,
                self.broker_kind.name(),
                || Connected::connect(url, name, options),
                retrying,
                &mut shutdown,
            )
            .await
            {
                Ok(connection) => {
                    connected_once = true;
                    connection
                }
                Err(_) if *shutdown.borrow() => return Ok(()),
                Err(error) => return Err(error),
            };
            let result = self.session(&connection, shutdown.clone()).await;
            self.broker.send_replace(false);
            if let Err(error) = &result {
                self.broker_error.send_replace(Some(chain(error)));
            }
            connection.close("service closing").await;
            match result {
                Ok(()) => {
                    tracing::info!("consumers stopped; connection closed");
                    return Ok(());
                }
                Err(error) => {
                    failures += 1;
                    let what = "consumer session ended; reconnecting";
                    if !pause_after(&error, what, failures, &mut shutdown).await {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Keeps readiness true to a connection its client reconnects by
    /// itself: not consuming while it has no server, with that as the
    /// reason.
    fn follow_connection(&self, connection: &Connected) {
        let connected = connection.is_connected();
        let changed = self
            .broker
            .send_if_modified(|up| std::mem::replace(up, connected) != connected);
        if changed && !connected {
            self.broker_error.send_replace(Some(
                "the broker connection is lost; its client reconnects".to_owned(),
            ));
        }
    }

    /// Consumes on one connection until shutdown (`Ok`) or a failure (`Err`).
    async fn session(
        &self,
        connection: &Connected,
        shutdown: watch::Receiver<bool>,
    ) -> Result<(), AppError> {
        connection.declare(&self.topology).await?;

        let mut loops = JoinSet::new();
        let mut started = Vec::with_capacity(self.consumers.len());
        for consumer in &self.consumers {
            started.push(
                consumer
                    .open(connection, &self.inbox, &self.config, &self.circuit)
                    .await?,
            );
        }
        for consume in started {
            loops.spawn(consume(shutdown.clone()));
        }
        self.sessions.send_modify(|n| *n += 1);
        self.broker.send_replace(true);
        tracing::info!(exchange = %self.topology.exchange(), "consuming");

        let mut watch_connection = tokio::time::interval(CONNECTION_CHECK);
        loop {
            let ended = tokio::select! {
                ended = loops.join_next() => ended,
                _ = watch_connection.tick() => {
                    self.follow_connection(connection);
                    continue;
                }
            };
            let Some(ended) = ended else { break };
            let error = match ended {
                Ok(Ok(())) => continue,
                Ok(Err(error)) => error,
                Err(panic) => AppError::Unavailable(format!("consumer loop failed: {panic}")),
            };
            // Do not abort the other queue's loop: that would drop its
            // in-flight deliveries mid-way, possibly between the commit and
            // the after-commit call. Closing the connection (the caller
            // does) ends it; its in-flight work finishes, and its unacked
            // deliveries come back as duplicates.
            loops.detach_all();
            return Err(error);
        }
        Ok(())
    }
}

/// Deletes processed inbox rows older than the retention, once, and the
/// attempt-ledger rows whose last failure is older than it (a count that
/// old no longer matters: the message was processed, or is dead and listed
/// for as long as the retention). Returns the inbox rows deleted.
///
/// # Errors
/// The store's.
pub async fn cleanup_once<S: InboxStore + AttemptLedger>(
    store: &S,
    cleanup: &CleanupConfig,
) -> Result<u64, AppError> {
    let cutoff = cleanup.cutoff()?;
    let deleted = store
        .purge_processed_paced(cutoff, cleanup.batch_size, || {
            tokio::time::sleep(cleanup.pause)
        })
        .await?;
    let attempts = store
        .purge_attempts_paced(cutoff, cleanup.batch_size, || {
            tokio::time::sleep(cleanup.pause)
        })
        .await?;
    tracing::info!(deleted, attempts, %cutoff, "inbox cleanup");
    Ok(deleted)
}

async fn cleanup_loop<S: InboxStore + AttemptLedger>(
    store: S,
    cleanup: CleanupConfig,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        if let Err(error) = cleanup_once(&store, &cleanup).await {
            tracing::warn!(error = %chain(&error), "inbox cleanup failed; next run at the next interval");
        }
        tokio::select! {
            () = tokio::time::sleep(cleanup.interval) => {}
            () = stopped(&mut shutdown) => return,
        }
    }
}

async fn gauge_loop<S: InboxStats>(store: S, every: Duration, mut shutdown: watch::Receiver<bool>) {
    loop {
        match store.processed_counts().await {
            #[expect(clippy::cast_precision_loss, reason = "a gauge is an f64")]
            Ok(counts) => metrics::gauge!(names::ROWS).set(counts.values().sum::<u64>() as f64),
            Err(error) => tracing::debug!(error = %chain(&error), "counting inbox rows failed"),
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = stopped(&mut shutdown) => return,
        }
    }
}
