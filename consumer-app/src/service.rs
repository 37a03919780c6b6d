//! The running service: both consumers, reconnecting, shutting down
//! gracefully, with cleanup and the `inbox_rows` gauge beside them.
//!
//! One AMQP connection; per queue one consuming channel (with its own
//! prefetch) and one confirm-mode channel for dead-letter publishes. When
//! the connection or a channel dies, every in-flight delivery of it is
//! redelivered by the broker (the inbox makes that safe), and the service
//! reconnects with backoff. PostgreSQL going away shows up as retryable
//! store errors: the message path retries and requeues, and the pool
//! reconnects by itself.
//!
//! Shutdown (SIGINT/SIGTERM, or [`ServiceHandle::shutdown`]): cancel the
//! consumers so nothing new arrives, let in-flight deliveries finish and ack,
//! close the channels (the broker requeues what was prefetched but never
//! started) and the connection.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use futures::StreamExt;
use inbox_api::metrics as names;
use inbox_api::{Inbox, InboxStore, InboxStoreExt};
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::{Channel, Connection};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

use crate::AppError;
use crate::amqp::{backoff, connect_with_backoff, no_args};
use crate::consumers::{CarrierAssignmentConsumer, NotificationConsumer, ParcelConsumer, Role};
use crate::downstream::{CarrierApi, NotificationSender};
use crate::error::chain;
use crate::store::ParcelStore;
use crate::tally::{Faults, Tally};
use crate::topology::Topology;
use crate::worker::{Worker, WorkerConfig};

/// Cleanup of processed inbox rows.
#[derive(Clone, Debug)]
pub struct CleanupConfig {
    /// Rows processed longer ago than this go.
    pub retention: Duration,
    /// How often the background task runs.
    pub interval: Duration,
    /// Rows per delete transaction.
    pub batch_size: NonZeroU32,
}

impl Default for CleanupConfig {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(7 * 24 * 3600),
            interval: Duration::from_secs(3600),
            batch_size: NonZeroU32::new(1000).unwrap_or(NonZeroU32::MIN),
        }
    }
}

/// Settings of a running service.
#[derive(Clone)]
pub struct ServiceConfig {
    /// The broker (may hold a password: logged redacted only).
    pub amqp_url: String,
    /// The names of exchanges and queues.
    pub topology: Topology,
    /// The message path's settings.
    pub worker: WorkerConfig,
    /// The AMQP connection's name, as `rabbitmqctl list_connections
    /// user_provided_name` shows it.
    pub connection_name: String,
    /// Background cleanup; `None`: off.
    pub cleanup: Option<CleanupConfig>,
    /// How often the `inbox_rows` gauge is refreshed; `None`: never.
    pub gauge_interval: Option<Duration>,
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig")
            .field("amqp_url", &crate::redact::redact_url(&self.amqp_url))
            .field("topology", &self.topology)
            .field("worker", &self.worker)
            .field("connection_name", &self.connection_name)
            .field("cleanup", &self.cleanup)
            .field("gauge_interval", &self.gauge_interval)
            .finish()
    }
}

/// The non-transactional downstreams the consumers call after commit.
#[derive(Clone)]
pub struct Downstreams {
    /// The carrier's booking API.
    pub carrier: Arc<dyn CarrierApi>,
    /// The notification channel.
    pub notifier: Arc<dyn NotificationSender>,
}

/// A service started by [`spawn`].
pub struct ServiceHandle {
    shutdown: watch::Sender<bool>,
    sessions: watch::Receiver<u64>,
    task: tokio::task::JoinHandle<Result<(), AppError>>,
    /// What the message path did.
    pub tally: Arc<Tally>,
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

    /// How many connections the service has consumed on so far.
    pub fn sessions(&self) -> u64 {
        *self.sessions.borrow()
    }

    /// Waits for the service to end (after [`ServiceHandle::shutdown`]).
    ///
    /// # Errors
    /// The service's error, or a panic turned into one.
    pub async fn join(self) -> Result<(), AppError> {
        match self.task.await {
            Ok(result) => result,
            Err(error) => Err(AppError::Unavailable(format!(
                "service task failed: {error}"
            ))),
        }
    }
}

/// Starts both consumers, cleanup and the gauge on `store`.
pub fn spawn<S: ParcelStore>(
    store: S,
    config: ServiceConfig,
    downstreams: Downstreams,
    faults: Arc<Faults>,
) -> Result<ServiceHandle, AppError> {
    let tally = Arc::new(Tally::default());
    let (shutdown, shutdown_rx) = watch::channel(false);
    let (sessions_tx, sessions) = watch::channel(0_u64);
    let notification = Arc::new(NotificationConsumer::new(downstreams.notifier)?);
    let carrier = Arc::new(CarrierAssignmentConsumer::new(downstreams.carrier)?);
    let supervisor = Supervisor {
        inbox: Arc::new(Inbox::new(store.clone())),
        config: config.clone(),
        tally: Arc::clone(&tally),
        faults,
        notification,
        carrier,
        sessions: sessions_tx,
    };
    let mut background = Vec::new();
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
        task,
        tally,
    })
}

/// Logs `error` and waits the backoff of the `failures`-th failure in a
/// row; `false` when shutdown came first.
async fn pause_after(
    error: &AppError,
    what: &'static str,
    failures: u32,
    shutdown: &mut watch::Receiver<bool>,
) -> bool {
    let delay = backoff(
        Duration::from_millis(200),
        Duration::from_secs(10),
        failures,
    );
    tracing::warn!(error = %chain(error), ?delay, "{what}");
    tokio::select! {
        () = tokio::time::sleep(delay) => true,
        () = stopped(shutdown) => false,
    }
}

/// Resolves when `shutdown` turns true or its sender is gone.
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

struct Supervisor<S> {
    inbox: Arc<Inbox<S>>,
    config: ServiceConfig,
    tally: Arc<Tally>,
    faults: Arc<Faults>,
    notification: Arc<NotificationConsumer>,
    carrier: Arc<CarrierAssignmentConsumer>,
    sessions: watch::Sender<u64>,
}

impl<S: ParcelStore> Supervisor<S> {
    async fn run(self, mut shutdown: watch::Receiver<bool>) -> Result<(), AppError> {
        let mut failures = 0;
        if self.config.worker.batch.is_some() {
            // A store without savepoints is refused for good; a store that
            // cannot be reached right now (a restart, a killed backend) is
            // asked again, as the consumers would retry their transactions.
            loop {
                match crate::batch::probe(self.inbox.store()).await {
                    Ok(()) => break,
                    Err(error) if error.is_retryable() => {
                        failures += 1;
                        let what = "batched-mode probe of the store failed; retrying";
                        if !pause_after(&error, what, failures, &mut shutdown).await {
                            return Ok(());
                        }
                    }
                    Err(error) => return Err(error),
                }
            }
            failures = 0;
        }
        loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            let connection = match connect_with_backoff(
                &self.config.amqp_url,
                &self.config.connection_name,
                None,
                &mut shutdown,
            )
            .await
            {
                Ok(connection) => connection,
                Err(_) if *shutdown.borrow() => return Ok(()),
                Err(error) => return Err(error),
            };
            let result = self.session(&connection, shutdown.clone()).await;
            let _ = connection.close(200, "parcel-inbox closing".into()).await;
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

    /// Consumes on one connection until shutdown (`Ok`) or a failure (`Err`).
    async fn session(
        &self,
        connection: &Connection,
        shutdown: watch::Receiver<bool>,
    ) -> Result<(), AppError> {
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| AppError::broker("open channel", e))?;
        self.config.topology.declare(&channel).await?;
        let _ = channel.close(200, "topology declared".into()).await;

        let mut loops = JoinSet::new();
        let notification = self
            .worker(
                connection,
                Role::Notification,
                Arc::clone(&self.notification),
            )
            .await?;
        let carrier = self
            .worker(connection, Role::Carrier, Arc::clone(&self.carrier))
            .await?;
        loops.spawn(queue_loop(notification.0, notification.1, shutdown.clone()));
        loops.spawn(queue_loop(carrier.0, carrier.1, shutdown.clone()));
        self.sessions.send_modify(|n| *n += 1);
        tracing::info!(exchange = %self.config.topology.exchange(), "consuming");

        while let Some(ended) = loops.join_next().await {
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

    async fn worker<C: ParcelConsumer>(
        &self,
        connection: &Connection,
        role: Role,
        consumer: Arc<C>,
    ) -> Result<(Channel, Worker<S, C>), AppError> {
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| AppError::broker("open consumer channel", e))?;
        let dead_letter_channel = connection
            .create_channel()
            .await
            .map_err(|e| AppError::broker("open dead-letter channel", e))?;
        dead_letter_channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| AppError::broker("enable confirms on the dead-letter channel", e))?;
        Ok((
            channel,
            Worker {
                inbox: Arc::clone(&self.inbox),
                consumer,
                role,
                topology: self.config.topology.clone(),
                config: self.config.worker.clone(),
                tally: Arc::clone(&self.tally),
                faults: Arc::clone(&self.faults),
                dead_letter_channel,
                acks: self.config.worker.batch.map(|_| crate::batch::tracker()),
            },
        ))
    }
}

/// Consumes one queue until shutdown or a broker failure.
async fn queue_loop<S, C>(
    channel: Channel,
    worker: Worker<S, C>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), AppError>
where
    S: ParcelStore,
    C: ParcelConsumer,
{
    let queue = worker.topology.queue(worker.role);
    channel
        .basic_qos(worker.config.prefetch, BasicQosOptions::default())
        .await
        .map_err(|e| AppError::broker("set prefetch", e))?;
    let tag = format!(
        "{}-{}",
        worker.consumer.name(),
        uuid::Uuid::new_v4().simple()
    );
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            no_args(),
        )
        .await
        .map_err(|e| AppError::broker(format!("consume {queue}"), e))?;
    let permits = Arc::new(Semaphore::new(worker.config.concurrency.max(1)));
    if let Some(batch) = worker.config.batch {
        let wanted = batch.size.saturating_mul(worker.config.concurrency.max(1));
        if usize::from(worker.config.prefetch) < wanted {
            tracing::warn!(%queue, prefetch = worker.config.prefetch, batch_size = batch.size,
                concurrency = worker.config.concurrency,
                "prefetch below batch size × concurrency: batches will run short");
        }
        tracing::info!(%queue, batch_size = batch.size, batch_wait = ?batch.wait, "batched mode");
    }
    let mut in_flight = JoinSet::new();

    let failure = loop {
        while let Some(done) = in_flight.try_join_next() {
            if let Err(error) = done {
                tracing::error!(%queue, error = %error, "delivery task failed");
            }
        }
        let permit = tokio::select! {
            biased;
            () = stopped(&mut shutdown) => break None,
            permit = Arc::clone(&permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break None,
            },
        };
        let next = tokio::select! {
            biased;
            () = stopped(&mut shutdown) => break None,
            next = consumer.next() => next,
        };
        match next {
            Some(Ok(delivery)) => match (worker.config.batch, &worker.acks) {
                (Some(batch), Some(tracker)) => {
                    let (deliveries, failed) = crate::batch::collect(
                        delivery,
                        &mut consumer,
                        batch,
                        tracker,
                        &mut shutdown,
                        &queue,
                    )
                    .await;
                    let worker = worker.clone();
                    in_flight.spawn(async move {
                        worker.process_batch(deliveries).await;
                        drop(permit);
                    });
                    if let Some(error) = failed {
                        break Some(error);
                    }
                }
                _ => {
                    let worker = worker.clone();
                    in_flight.spawn(async move {
                        worker.process(delivery).await;
                        drop(permit);
                    });
                }
            },
            Some(Err(error)) => break Some(AppError::broker(format!("consuming {queue}"), error)),
            None => {
                break Some(AppError::Unavailable(format!(
                    "the broker cancelled the consumer of {queue}"
                )));
            }
        }
    };

    if let Some(error) = failure {
        // The channel is gone: whatever is in flight cannot be acked, and the
        // broker redelivers it. Let those tasks end on their own (their
        // transactions commit or roll back; the inbox sorts out the
        // redelivery).
        in_flight.detach_all();
        return Err(error);
    }

    // Graceful: nothing new, finish what runs, then close.
    if let Err(error) = channel
        .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
        .await
    {
        tracing::warn!(%queue, error = %error, "cancelling the consumer failed");
    }
    while in_flight.try_join_next().is_some() {}
    let running = in_flight.len();
    if running > 0 {
        tracing::info!(%queue, running, "waiting for in-flight deliveries");
    }
    while let Some(done) = in_flight.join_next().await {
        if let Err(error) = done {
            tracing::error!(%queue, error = %error, "delivery task failed");
        }
    }
    drop(consumer);
    let _ = channel.close(200, "shutdown".into()).await;
    let _ = worker
        .dead_letter_channel
        .close(200, "shutdown".into())
        .await;
    tracing::info!(%queue, "consumer stopped");
    Ok(())
}

/// Deletes processed inbox rows older than the retention, once.
///
/// # Errors
/// The store's.
pub async fn cleanup_once<S: InboxStore>(
    store: &S,
    cleanup: &CleanupConfig,
) -> Result<u64, AppError> {
    let retention = chrono::Duration::from_std(cleanup.retention)
        .map_err(|e| AppError::Config(format!("retention out of range: {e}")))?;
    let cutoff = Utc::now() - retention;
    let deleted = store
        .purge_processed_before(cutoff, cleanup.batch_size)
        .await?;
    tracing::info!(deleted, %cutoff, "inbox cleanup");
    Ok(deleted)
}

async fn cleanup_loop<S: InboxStore>(
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

async fn gauge_loop<S: ParcelStore>(
    store: S,
    every: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        match store.inbox_rows().await {
            #[expect(clippy::cast_precision_loss, reason = "a gauge is an f64")]
            Ok(rows) => metrics::gauge!(names::ROWS).set(rows as f64),
            Err(error) => tracing::debug!(error = %chain(&error), "counting inbox rows failed"),
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = stopped(&mut shutdown) => return,
        }
    }
}
