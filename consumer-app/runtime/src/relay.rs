//! The outbox relay: publishes the committed outgoing messages of an
//! [`OutboxStore`] and marks them published once the broker confirmed them.
//!
//! ```text
//! loop: take_pending(batch, lease) ─► basic.publish each (message_id = the row's id)
//!         on an idle confirm-mode channel of its own ─► hand the batch and
//!         its channel to a task of its own:
//!             await every confirm of the batch
//!             ─► mark_published(the confirmed ids); the others stay leased
//!             ─► the channel back to the idle ones (closed if it failed)
//!       ─► take the next batch at once while fewer than `pipeline_depth`
//!          batches are unsettled; once the outbox runs dry (or anything
//!          fails), settle them all before sleeping (or backing off)
//! ```
//!
//! The pipeline keeps the broker busy while the database takes and marks
//! ([`RelayConfig::pipeline_depth`]); each batch is still marked only after
//! its own confirms, under its own lease. Each batch in flight has a
//! channel to itself (a pool of up to `pipeline_depth` channels on the
//! relay's one connection): lapin hands a `basic.return` to whichever
//! confirm on the channel resolves next, so only a batch alone on its
//! channel can tell its returned (unroutable) messages from its published
//! ones (`attribute_returns`), and a channel that closes fails only the
//! batch it carried.
//!
//! The guarantee is at-least-once publishing under a stable id: a message is
//! marked published only after its confirm, so a relay that dies, loses its
//! broker or its database between the publish and the mark publishes it
//! again later, under the same AMQP `message_id`, and the consumers' inboxes
//! discard the copy. That is what makes the whole path exactly-once in
//! effect.
//!
//! What the broker did not confirm splits in two:
//!
//! - **Refused for its own sake** (a nack: its queue is full and rejects
//!   publishes; returned unroutable: no queue is bound for its routing
//!   key): the refusal is charged to that message
//!   ([`OutboxStore::record_refusals`]), which backs off on its own
//!   ([`PublishRetry`]: doubling delays) and, at the limit, is dead: kept
//!   in the table, never taken, counted in `outbox_dead_lettered_total`
//!   and logged with its id, until `parcel-inbox outbox-requeue` after the
//!   fix. It neither holds back younger messages nor comes back forever.
//! - **Not its fault** (the channel or connection closed, no confirm in
//!   time: an outage, a blocked broker, a missing exchange that closes the
//!   channel for the whole batch): nothing is charged; the message is left
//!   leased, and the lease is its retry delay.
//!
//! Between rounds it waits for the poll interval, or less when a wake-up
//! source says there is something new ([`Relay::wake_on`]).
//!
//! Several relays may run at once: a lease is never held by two of them
//! (the store's contract), so they share the pending rows without
//! publishing one message twice while both live.
//!
//! The relay knows no domain: the rows say which exchange, routing key,
//! type, headers and body to publish.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use futures::future::join_all;
use futures::stream::{BoxStream, Stream, StreamExt};
use inbox_api::metrics as names;
use inbox_api::{
    MessageId, OutboxLease, OutboxStore, OutboxStoreExt, OutgoingMessage, PublishRetry,
};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::amqp::{
    ConnectOptions, OnRefusal, close_bounded, close_channel_bounded, connect_with_backoff,
    open_channel,
};
use crate::backoff::Backoff;
use crate::error::chain;
use crate::redact::redact_url;
use crate::shutdown::stopped;
use crate::tally::bump;
use crate::telemetry::Running;
use crate::{AppError, CleanupConfig};

/// Settings of a [`Relay`].
#[derive(Clone)]
pub struct RelayConfig {
    /// The broker (may hold a password: logged redacted only).
    pub amqp_url: String,
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
    /// Exchanges declared ([`crate::topology::declare_exchange`]:
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
    /// transaction ([`purge_published_once`]). Published rows serve only
    /// diagnostics ([`OutboxStore::lookup_outgoing`]); without a purge the
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

    /// A relay publishing to the broker at `amqp_url` on a connection named
    /// `connection_name`, with batches of 100, up to
    /// [`RelayConfig::DEFAULT_PIPELINE_DEPTH`] in flight, `mandatory`, 30 s
    /// leases, 10 s for the confirms and polling every 500 ms.
    pub fn new(amqp_url: impl Into<String>, connection_name: impl Into<String>) -> Self {
        Self {
            amqp_url: amqp_url.into(),
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

    /// Checks the settings ([`Relay::new`] does too), so that a command
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
            .field("amqp_url", &redact_url(&self.amqp_url))
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

/// What a relay did so far (read through its methods); the
/// metrics say the same to a dashboard, these to a test or a summary line.
#[derive(Debug, Default)]
pub struct RelayTally {
    /// Connections to the broker opened (more than one: it reconnected).
    pub(crate) connections: AtomicU64,
    /// Non-empty batches taken.
    pub(crate) batches: AtomicU64,
    /// Messages the broker confirmed.
    pub(crate) published: AtomicU64,
    /// Rows this relay's marks changed (a mark after a lost answer changes
    /// none).
    pub(crate) marked: AtomicU64,
    /// Messages the broker did not confirm.
    pub(crate) failed: AtomicU64,
    /// Refusals charged to their message (nack, returned): the part of
    /// `failed` that counts toward the dead-letter limit.
    pub(crate) refused: AtomicU64,
    /// Messages dead-lettered in the outbox.
    pub(crate) dead: AtomicU64,
}

impl RelayTally {
    /// Connections to the broker opened (more than one: it reconnected).
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// Non-empty batches taken.
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Messages the broker confirmed.
    pub fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }

    /// Rows this relay's marks changed (a mark after a lost answer changes
    /// none).
    pub fn marked(&self) -> u64 {
        self.marked.load(Ordering::Relaxed)
    }

    /// Messages the broker did not confirm.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    /// Refusals charged to their message (nack, returned): the part of
    /// `failed` that counts toward the dead-letter limit.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Messages dead-lettered in the outbox.
    pub fn dead(&self) -> u64 {
        self.dead.load(Ordering::Relaxed)
    }
}

/// Publishes an [`OutboxStore`]'s pending messages until shutdown.
pub struct Relay<S> {
    store: S,
    config: RelayConfig,
    tally: Arc<RelayTally>,
    /// In a mutex only so that the relay stays `Sync` (`run` takes it
    /// out before the first round).
    wakeups: Option<std::sync::Mutex<BoxStream<'static, ()>>>,
    /// True while it holds an open confirm-mode channel (for readiness).
    broker: watch::Sender<bool>,
}

impl<S: OutboxStore + Clone + 'static> Relay<S> {
    /// A relay of `store`'s messages.
    ///
    /// # Errors
    /// [`AppError::Config`] when the lease is not well above the confirm
    /// timeout, or the confirm timeout is zero.
    pub fn new(store: S, config: RelayConfig) -> Result<Self, AppError> {
        config.check()?;
        Ok(Self {
            store,
            config,
            tally: Arc::default(),
            wakeups: None,
            broker: watch::Sender::new(false),
        })
    }

    /// Also starts a round, before the poll interval is up, whenever
    /// `wakeups` yields (PostgreSQL's `LISTEN` on the outbox's channel,
    /// say): new messages go out within a round trip instead of a poll
    /// interval, without polling fast. Polling stays the fallback for a
    /// lost notification or a stream that ends, so a wake-up source need
    /// not be reliable. Wake-ups that arrive together start one round.
    #[must_use]
    pub fn wake_on(mut self, wakeups: impl Stream<Item = ()> + Send + 'static) -> Self {
        self.wakeups = Some(std::sync::Mutex::new(Box::pin(wakeups)));
        self
    }

    /// Its counters.
    pub fn tally(&self) -> Arc<RelayTally> {
        Arc::clone(&self.tally)
    }

    /// Runs it on a task of its own.
    pub fn spawn(self) -> RelayHandle {
        let (shutdown, shutdown_rx) = watch::channel(false);
        let tally = self.tally();
        let (alive, running) = Running::new();
        let broker = self.broker.subscribe();
        RelayHandle {
            broker,
            shutdown,
            task: tokio::spawn(async move {
                let _alive = alive;
                self.run(shutdown_rx).await
            }),
            running,
            tally,
        }
    }

    /// Publishes until `shutdown` turns true (the batch in flight is
    /// finished first), reconnecting to the broker with backoff.
    ///
    /// # Errors
    /// A permanent store error (the outbox table is missing, say): no
    /// later round could do better.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) -> Result<(), AppError> {
        tracing::info!(config = ?self.config, wake_on = self.wakeups.is_some(),
            "outbox relay starting");
        let mut wakeups = self
            .wakeups
            .take()
            .and_then(|stream| stream.into_inner().ok());
        // On a task of its own: a first purge after a long pause may take
        // many batches, and publishing must not wait for it.
        let purge = self
            .config
            .purge
            .clone()
            .map(|purge| tokio::spawn(purge_loop(self.store.clone(), purge, shutdown.clone())));
        let mut broker: Option<Pool> = None;
        let mut failures = 0_u32;
        let mut next_gauge = Instant::now();
        let mut in_flight: JoinSet<Settling> = JoinSet::new();
        let depth = usize::try_from(self.config.pipeline_depth.get()).unwrap_or(usize::MAX);
        let result = loop {
            if *shutdown.borrow() {
                break Ok(());
            }
            if Instant::now() >= next_gauge {
                next_gauge = Instant::now() + self.config.gauge_interval;
                self.record_gauges().await;
            }
            let channel = match self.channel(&mut broker, &mut shutdown).await {
                Ok(channel) => {
                    self.broker.send_replace(true);
                    channel
                }
                Err(_) if *shutdown.borrow() => break Ok(()),
                // Only before the first connection: a configuration error
                // (refused login, unusable URL) that no retry mends.
                Err(error @ (AppError::CredentialsRefused { .. } | AppError::Config(_))) => {
                    tracing::error!(error = %chain(&error), "the relay cannot connect to RabbitMQ");
                    break Err(error);
                }
                Err(error) => {
                    self.broker.send_replace(false);
                    broker = None;
                    // Batches on the lost connection end on their own (a
                    // channel error, or the confirm timeout); settle them
                    // before backing off, so that none outlives this round.
                    let _ = Settled::all(&mut in_flight).await;
                    failures = failures.saturating_add(1);
                    if !self.pause(&error, failures, &mut shutdown).await {
                        break Ok(());
                    }
                    continue;
                }
            };
            let mut settled = Settled::default();
            let taken = match self.start_batch(channel, &mut in_flight).await {
                Ok((taken, unused)) => {
                    settled.channels.extend(unused);
                    taken
                }
                Err((error, unused)) => {
                    settled.error = Some(error);
                    settled.channels.push(unused);
                    0
                }
            };
            let full = taken == self.config.batch_size.get();
            settled.finished(&mut in_flight);
            if full && settled.is_fine() {
                // A full batch: more are likely waiting. Take the next one
                // at once unless `pipeline_depth` batches await confirms.
                if in_flight.len() >= depth {
                    settled.next(&mut in_flight).await;
                }
            } else {
                // The outbox ran dry (or something failed): settle every
                // batch in flight before sleeping (or backing off).
                settled.merge(Settled::all(&mut in_flight).await);
            }
            if !settled.is_fine() {
                settled.merge(Settled::all(&mut in_flight).await);
            }
            if let Some(pool) = broker.as_mut() {
                pool.give_back(std::mem::take(&mut settled.channels));
            }
            if let Some(error) = settled.error {
                if let AppError::Inbox(inner) = &error
                    && !inner.is_retryable()
                {
                    break Err(error);
                }
                failures = failures.saturating_add(1);
                if !self.pause(&error, failures, &mut shutdown).await {
                    break Ok(());
                }
                continue;
            }
            if settled.stalled {
                // The broker took none of a batch, and not for the
                // messages' own sake: an outage, a blocked connection, a
                // missing exchange. Do not hammer it. (Refused messages
                // back off on their own.)
                failures = failures.saturating_add(1);
                let error = AppError::NotConfirmed(format!(
                    "none of {} messages confirmed",
                    settled.round.failed
                ));
                if !self.pause(&error, failures, &mut shutdown).await {
                    break Ok(());
                }
                continue;
            }
            failures = 0;
            if !full {
                tokio::select! {
                    () = tokio::time::sleep(self.config.poll_interval) => {}
                    woke = next_wakeup(&mut wakeups) => if !woke {
                        tracing::warn!("the relay's wake-ups ended; polling only");
                        wakeups = None;
                    },
                    () = stopped(&mut shutdown) => break Ok(()),
                }
            }
        };
        // The batches in flight are finished (confirmed and marked, or
        // left leased) before the connection closes under them.
        let last = Settled::all(&mut in_flight).await;
        if let Some(error) = &last.error {
            tracing::warn!(error = %chain(error),
                "settling the last batches failed; their messages go out again after their lease");
        }
        if let Some(pool) = broker {
            close_bounded(&pool.connection, "relay stopping").await;
        }
        self.broker.send_replace(false);
        if let Some(purge) = purge {
            // It stops at the shutdown too (a batch in flight is one short
            // transaction); on an error exit, it must not outlive the relay.
            if result.is_err() {
                purge.abort();
            }
            let _ = purge.await;
        }
        tracing::info!("outbox relay stopped");
        result
    }

    /// Refreshes the `outbox_pending_messages` and `outbox_dead_messages`
    /// gauges (counts, so not every round).
    async fn record_gauges(&self) {
        if let Err(error) = self.store.record_pending().await {
            tracing::debug!(error = %chain(&error), "counting pending outbox rows failed");
        }
        if let Err(error) = self.store.record_dead().await {
            tracing::debug!(error = %chain(&error), "counting dead outbox rows failed");
        }
    }

    /// A confirm-mode channel for the next batch, which it has to itself
    /// until the batch is settled: an idle one, or a new one when none is
    /// idle (so never more than the batches in flight plus one), on a new
    /// connection when the old one died.
    async fn channel(
        &self,
        broker: &mut Option<Pool>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Channel, AppError> {
        if let Some(pool) = broker.as_mut() {
            while let Some(channel) = pool.idle.pop() {
                if channel.status().connected() {
                    return Ok(channel);
                }
            }
            if pool.connection.status().connected() {
                return self.open_channel(&pool.connection).await;
            }
            tracing::warn!("RabbitMQ connection lost; reconnecting");
        }
        *broker = None;
        // Refused credentials end the relay only before it has ever
        // connected (a configuration error); later they are a rotation
        // in progress, retried.
        let on_refusal = if self.tally.connections.load(Ordering::Relaxed) == 0 {
            OnRefusal::Fail
        } else {
            OnRefusal::Retry
        };
        let connection = connect_with_backoff(
            &self.config.amqp_url,
            &self.config.connection_name,
            self.config.connection,
            None,
            on_refusal,
            shutdown,
            None,
        )
        .await?;
        bump(&self.tally.connections);
        let channel = self.open_channel(&connection).await?;
        *broker = Some(Pool {
            connection,
            idle: Vec::new(),
        });
        Ok(channel)
    }

    /// A confirm-mode channel on which [`RelayConfig::exchanges`] exist.
    async fn open_channel(&self, connection: &Connection) -> Result<Channel, AppError> {
        let channel = open_confirm_channel(connection).await?;
        for exchange in &self.config.exchanges {
            crate::topology::declare_exchange(&channel, exchange).await?;
        }
        Ok(channel)
    }

    /// Takes a batch and publishes it on `channel`, then leaves its
    /// confirms, its mark and the channel to a task of its own (in
    /// `in_flight`), so that the next batch can be taken and published on
    /// another channel while the broker confirms this one. Returns how
    /// many messages it took, and `channel` when no batch took it.
    async fn start_batch(
        &self,
        channel: Channel,
        in_flight: &mut JoinSet<Settling>,
    ) -> Result<(u32, Option<Channel>), (AppError, Channel)> {
        let lease = match self
            .store
            .take_pending(self.config.batch_size, self.config.lease)
            .await
        {
            Ok(lease) => lease,
            Err(error) => return Err((error.into(), channel)),
        };
        let taken = u32::try_from(lease.messages.len()).unwrap_or(u32::MAX);
        if lease.is_empty() {
            return Ok((0, Some(channel)));
        }
        bump(&self.tally.batches);
        let confirms = publish_batch(
            &channel,
            &lease.messages,
            self.config.mandatory,
            self.config.confirm_timeout,
        )
        .await;
        let settler = Settler {
            store: self.store.clone(),
            tally: Arc::clone(&self.tally),
            retry: self.config.retry,
        };
        in_flight.spawn(async move {
            let results = attribute_returns(&lease.messages, join_all(confirms).await);
            // A confirm that never resolved (the channel closed, or timed
            // out) may still owe this batch a `basic.return`, which lapin
            // would hand to the next batch's confirms: such a channel is
            // never used again.
            let reusable = !results
                .iter()
                .any(|result| result.as_ref().is_err_and(PublishFailure::breaks_channel));
            let outcome = settler.settle(&lease, results).await;
            if !reusable {
                close_channel_bounded(&channel, "reopening after a failure").await;
            }
            Settling {
                outcome,
                channel: reusable.then_some(channel),
            }
        });
        Ok((taken, None))
    }

    async fn pause(
        &self,
        error: &AppError,
        failures: u32,
        shutdown: &mut watch::Receiver<bool>,
    ) -> bool {
        let delay = Backoff::new(self.config.retry_base_delay, self.config.retry_max_delay)
            .delay(failures.saturating_sub(1));
        tracing::warn!(error = %chain(error), ?delay, failures, "outbox relay backing off");
        tokio::select! {
            () = tokio::time::sleep(delay) => true,
            () = stopped(shutdown) => false,
        }
    }
}

/// What settles a batch once its publishes are out: awaits the confirms,
/// charges the refusals, marks the confirmed. It runs on a task of its own
/// per batch, beside the relay's loop.
struct Settler<S> {
    store: S,
    tally: Arc<RelayTally>,
    retry: PublishRetry,
}

impl<S: OutboxStore> Settler<S> {
    /// Settles `lease`, whose publishes ended as `results` (one per
    /// message, in order): its refused messages are charged, its confirmed
    /// ones marked published (and only those: a message is marked only
    /// after its own confirm), the rest stay leased.
    async fn settle(
        self,
        lease: &OutboxLease,
        results: Vec<Result<(), PublishFailure>>,
    ) -> Result<Round, AppError> {
        let mut confirmed = Vec::with_capacity(results.len());
        let mut failed: Vec<(MessageId, PublishFailure)> = Vec::new();
        for (message, result) in lease.messages.iter().zip(results) {
            match result {
                Ok(()) => confirmed.push(message.id()),
                Err(failure) => failed.push((message.id(), failure)),
            }
        }
        let refusals: Vec<(MessageId, String)> = failed
            .iter()
            .filter(|(_, f)| f.is_refusal())
            .map(|(id, f)| (*id, f.to_string()))
            .collect();
        let round = Round {
            confirmed: confirmed.len(),
            failed: failed.len(),
            refused: refusals.len(),
            channel_broken: failed.iter().any(|(_, f)| f.breaks_channel()),
        };
        self.count_failures(&failed, &lease.id);
        self.charge(&lease.id, &refusals).await;
        if confirmed.is_empty() {
            return Ok(round);
        }
        metrics::counter!(names::OUTBOX_PUBLISHED).increment(confirmed.len() as u64);
        self.tally
            .published
            .fetch_add(confirmed.len() as u64, std::sync::atomic::Ordering::Relaxed);
        match self.store.mark_published(&confirmed).await {
            Ok(marked) => {
                self.tally
                    .marked
                    .fetch_add(marked, std::sync::atomic::Ordering::Relaxed);
                Ok(round)
            }
            Err(error) => {
                // Published but not marked: they go out once more, under
                // their ids, when the lease runs out. Harmless downstream.
                tracing::warn!(lease = %lease.id, ids = ?ids(confirmed.iter()),
                    error = %chain(&error),
                    "marking confirmed messages published failed; they will be published again");
                Err(error.into())
            }
        }
    }

    fn count_failures(&self, failed: &[(MessageId, PublishFailure)], lease: &inbox_api::LeaseId) {
        if failed.is_empty() {
            return;
        }
        self.tally
            .failed
            .fetch_add(failed.len() as u64, std::sync::atomic::Ordering::Relaxed);
        for reason in ["nack", "returned", "channel", "timeout"] {
            let of_reason: Vec<&(MessageId, PublishFailure)> = failed
                .iter()
                .filter(|(_, f)| f.reason() == reason)
                .collect();
            let Some((_, first)) = of_reason.first() else {
                continue;
            };
            metrics::counter!(names::OUTBOX_PUBLISH_FAILURES, "reason" => reason)
                .increment(of_reason.len() as u64);
            tracing::warn!(%lease, reason, count = of_reason.len(),
                ids = ?ids(of_reason.iter().map(|(id, _)| id)), error = %first,
                "the broker did not confirm these messages; they stay pending and are published again, under their ids, after their backoff (refused) or lease (outage)");
        }
    }

    /// Charges the broker's refusals to their messages: each backs off on
    /// its own, and those at the limit are dead (counted and logged by id).
    /// A failure to record leaves them leased, uncharged: the lease is then
    /// their retry delay, as for an outage.
    async fn charge(&self, lease: &inbox_api::LeaseId, refusals: &[(MessageId, String)]) {
        if refusals.is_empty() {
            return;
        }
        match self
            .store
            .record_refusals(lease, refusals, &self.retry)
            .await
        {
            Ok(refused) => {
                self.tally
                    .refused
                    .fetch_add(refused.recorded, std::sync::atomic::Ordering::Relaxed);
                if refused.dead.is_empty() {
                    return;
                }
                metrics::counter!(names::OUTBOX_DEAD_LETTERED).increment(refused.dead.len() as u64);
                self.tally.dead.fetch_add(
                    refused.dead.len() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
                for id in &refused.dead {
                    let error = refusals
                        .iter()
                        .find(|(refused, _)| refused == id)
                        .map_or("", |(_, error)| error.as_str());
                    tracing::error!(message_id = %id, %lease, error,
                        max_attempts = self.retry.max_attempts.get(),
                        "the broker refused this outgoing message too often: dead in the outbox \
                         (list with `parcel-inbox outbox-dead`, requeue with `outbox-requeue`)");
                }
            }
            Err(error) => {
                tracing::warn!(%lease, ids = ?ids(refusals.iter().map(|(id, _)| id)),
                    error = %chain(&error),
                    "recording refusals failed; the messages come back when their lease runs out");
            }
        }
    }
}

/// Deletes the outbox's published rows older than the retention, once,
/// `batch_size` per transaction, and returns how many went (each counted
/// once in `outbox_purged_rows_total`, by
/// [`OutboxStoreExt::purge_published_before`]). Pending rows, dead ones
/// included, are never deleted. What the relay's background purge and
/// `parcel-inbox cleanup` run.
///
/// # Errors
/// The store's; the batches committed before stay deleted.
pub async fn purge_published_once<S: OutboxStore>(
    store: &S,
    purge: &CleanupConfig,
) -> Result<u64, AppError> {
    let cutoff = purge.cutoff()?;
    let deleted = store
        .purge_published_paced(cutoff, purge.batch_size, || tokio::time::sleep(purge.pause))
        .await?;
    tracing::info!(deleted, %cutoff, "outbox purge of published rows");
    Ok(deleted)
}

async fn purge_loop<S: OutboxStore>(
    store: S,
    purge: CleanupConfig,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            result = purge_published_once(&store, &purge) => if let Err(error) = result {
                tracing::warn!(error = %chain(&error),
                    "outbox purge failed; next run at the next interval");
            },
            () = stopped(&mut shutdown) => return,
        }
        tokio::select! {
            () = tokio::time::sleep(purge.interval) => {}
            () = stopped(&mut shutdown) => return,
        }
    }
}

/// A relay started by [`Relay::spawn`].
pub struct RelayHandle {
    shutdown: watch::Sender<bool>,
    broker: watch::Receiver<bool>,
    task: tokio::task::JoinHandle<Result<(), AppError>>,
    running: Running,
    /// What it did so far.
    pub tally: Arc<RelayTally>,
}

impl RelayHandle {
    /// Asks it to stop after the batch in flight (idempotent).
    pub fn shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    /// A sender that stops it, for signal handlers.
    pub fn shutdown_sender(&self) -> watch::Sender<bool> {
        self.shutdown.clone()
    }

    /// True while it holds an open channel to the broker (false while
    /// connecting, reconnecting, or stopped): for readiness.
    pub fn broker_connected(&self) -> watch::Receiver<bool> {
        self.broker.clone()
    }

    /// Whether its task still runs (for liveness).
    pub fn running(&self) -> Running {
        self.running.clone()
    }

    /// Waits for it to end (after [`RelayHandle::shutdown`]).
    ///
    /// # Errors
    /// The relay's error, or a panic turned into one.
    pub async fn join(self) -> Result<(), AppError> {
        match self.task.await {
            Ok(result) => result,
            Err(error) => Err(AppError::Unavailable(format!("relay task failed: {error}"))),
        }
    }
}

/// What the broker did with one batch.
#[derive(Clone, Copy, Debug, Default)]
struct Round {
    confirmed: usize,
    failed: usize,
    /// Of `failed`, those the broker refused for their own sake.
    refused: usize,
    /// Its channel failed (closed, or confirms stuck): its task closed
    /// it, and the relay settles every batch before the next round.
    channel_broken: bool,
}

/// The relay's connection and its idle confirm-mode channels. A channel is
/// idle only once the batch it carried is settled with every confirm
/// resolved, so that no return of that batch can reach the next one.
struct Pool {
    connection: Connection,
    idle: Vec<Channel>,
}

impl Pool {
    /// Keeps the channels of settled batches that are still open.
    fn give_back(&mut self, channels: Vec<Channel>) {
        self.idle.extend(
            channels
                .into_iter()
                .filter(|channel| channel.status().connected()),
        );
    }
}

/// One batch's task's outcome.
struct Settling {
    /// What the broker did with it, or its take's or mark's error.
    outcome: Result<Round, AppError>,
    /// Its channel, unless it failed (closed) and must not be reused.
    channel: Option<Channel>,
}

/// What the batches settled since the relay last looked did, together.
#[derive(Default)]
struct Settled {
    /// Their counts, summed.
    round: Round,
    /// Some batch's broker took none of it, and not for the messages' own
    /// sake: back off.
    stalled: bool,
    /// The first error (a failed take or mark, a panicked task).
    error: Option<AppError>,
    /// The channels of the settled batches, to use again.
    channels: Vec<Channel>,
}

impl Settled {
    /// Adds one batch's outcome.
    fn add(&mut self, done: Result<Settling, tokio::task::JoinError>) {
        let done = done.map(|settling| {
            self.channels.extend(settling.channel);
            settling.outcome
        });
        match done {
            Ok(Ok(round)) => {
                self.stalled |= round.confirmed == 0 && round.failed > round.refused;
                self.round.confirmed += round.confirmed;
                self.round.failed += round.failed;
                self.round.refused += round.refused;
                self.round.channel_broken |= round.channel_broken;
            }
            Ok(Err(error)) => self.fail(error),
            Err(error) => self.fail(AppError::Unavailable(format!(
                "a relay batch's task failed: {error}"
            ))),
        }
    }

    /// Keeps the first error, unless a later one is permanent (that one
    /// ends the relay).
    fn fail(&mut self, error: AppError) {
        let permanent = matches!(&error, AppError::Inbox(e) if !e.is_retryable());
        if self.error.is_none() || permanent {
            self.error = Some(error);
        }
    }

    fn merge(&mut self, other: Self) {
        self.stalled |= other.stalled;
        self.round.confirmed += other.round.confirmed;
        self.round.failed += other.round.failed;
        self.round.refused += other.round.refused;
        self.round.channel_broken |= other.round.channel_broken;
        self.channels.extend(other.channels);
        if let Some(error) = other.error {
            self.fail(error);
        }
    }

    /// Nothing that calls for a pause or a new channel.
    fn is_fine(&self) -> bool {
        self.error.is_none() && !self.stalled && !self.round.channel_broken
    }

    /// Adds the batches that finished already, without waiting.
    fn finished(&mut self, in_flight: &mut JoinSet<Settling>) {
        while let Some(done) = in_flight.try_join_next() {
            self.add(done);
        }
    }

    /// Waits for the next batch to finish and adds it.
    async fn next(&mut self, in_flight: &mut JoinSet<Settling>) {
        if let Some(done) = in_flight.join_next().await {
            self.add(done);
        }
    }

    /// Waits for every batch in flight.
    async fn all(in_flight: &mut JoinSet<Settling>) -> Self {
        let mut settled = Self::default();
        while let Some(done) = in_flight.join_next().await {
            settled.add(done);
        }
        settled
    }
}

/// Why the broker did not confirm one message.
#[derive(Debug, thiserror::Error)]
enum PublishFailure {
    #[error("nacked by the broker")]
    Nack,
    #[error("returned unroutable: {0}")]
    Returned(String),
    #[error("channel failed: {0}")]
    Channel(#[source] lapin::Error),
    #[error("no confirm within {0:?}")]
    Timeout(Duration),
}

impl PublishFailure {
    /// The `reason` label of `outbox_publish_failures_total`.
    fn reason(&self) -> &'static str {
        match self {
            Self::Nack => "nack",
            Self::Returned(_) => "returned",
            Self::Channel(_) => "channel",
            Self::Timeout(_) => "timeout",
        }
    }

    fn breaks_channel(&self) -> bool {
        matches!(self, Self::Channel(_) | Self::Timeout(_))
    }

    /// Whether the broker refused this message for its own sake, so that
    /// the refusal counts toward its dead-letter limit. A closed channel or
    /// a missing confirm is the broker's or the network's state, shared by
    /// every message in flight: never charged.
    fn is_refusal(&self) -> bool {
        matches!(self, Self::Nack | Self::Returned(_))
    }
}

async fn open_confirm_channel(connection: &Connection) -> Result<Channel, AppError> {
    let channel = open_channel(connection, "the relay's channel").await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| AppError::broker("enable publisher confirms", e))?;
    Ok(channel)
}

/// The AMQP properties of `message`: its id as `message_id` (the same on
/// every publish: what the consumers' inboxes deduplicate on), its type and
/// headers, persistent.
fn properties(message: &OutgoingMessage) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (name, value) in message.headers() {
        headers.insert(
            name.as_str().into(),
            AMQPValue::LongString(LongString::from(value.as_str())),
        );
    }
    BasicProperties::default()
        .with_message_id(message.id().to_string().into())
        .with_type(message.message_type().into())
        .with_headers(headers)
        .with_delivery_mode(2)
}

/// What one message's confirm said, before the batch matches returns to
/// messages: lapin hands a `basic.return` to whichever confirm resolves
/// next on the channel (possibly another message's nack or ack), so which
/// message came back is known only from the returned message's id.
struct Confirm {
    /// The message's own outcome, a return not yet counted.
    outcome: Result<(), PublishFailure>,
    /// A returned message this confirm carried: its `message_id` (any
    /// message's) and the broker's reason.
    carried: Option<(String, String)>,
}

/// Publishes every message and returns their confirms, to await together
/// (within `timeout` from now in all, publishes included); one per
/// message, in order. Owned futures: they are awaited on the batch's own
/// task while the relay publishes the next batch. [`attribute_returns`]
/// turns them into each message's result.
async fn publish_batch(
    channel: &Channel,
    messages: &[OutgoingMessage],
    mandatory: bool,
    timeout: Duration,
) -> Vec<BoxFuture<'static, Confirm>> {
    let deadline = Instant::now() + timeout;
    let options = BasicPublishOptions {
        mandatory,
        ..BasicPublishOptions::default()
    };
    let mut pending = Vec::with_capacity(messages.len());
    for message in messages {
        let started = Instant::now();
        let span = crate::trace::publish_span(message);
        let sent = tokio::time::timeout_at(
            deadline,
            channel.basic_publish(
                message.exchange().into(),
                message.routing_key().into(),
                options,
                message.body(),
                properties(message),
            ),
        )
        .instrument(span.clone())
        .await;
        pending.push(
            async move {
                let failed = |failure| Confirm {
                    outcome: Err(failure),
                    carried: None,
                };
                let confirm = match sent {
                    Ok(Ok(confirm)) => confirm,
                    Ok(Err(error)) => return failed(PublishFailure::Channel(error)),
                    Err(_) => return failed(PublishFailure::Timeout(timeout)),
                };
                let confirmation = match tokio::time::timeout_at(deadline, confirm).await {
                    Ok(Ok(confirmation)) => confirmation,
                    Ok(Err(error)) => return failed(PublishFailure::Channel(error)),
                    Err(_) => return failed(PublishFailure::Timeout(timeout)),
                };
                let acked = confirmation.is_ack();
                let carried = confirmation.take_message().map(|returned| {
                    let id = returned
                        .delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map(ToString::to_string)
                        .unwrap_or_default();
                    (
                        id,
                        format!("{} {}", returned.reply_code, returned.reply_text),
                    )
                });
                if acked {
                    metrics::histogram!(names::OUTBOX_PUBLISH_DURATION)
                        .record(started.elapsed().as_secs_f64());
                }
                Confirm {
                    outcome: if acked {
                        Ok(())
                    } else {
                        Err(PublishFailure::Nack)
                    },
                    carried,
                }
            }
            .instrument(span)
            .boxed(),
        );
    }
    pending
}

/// Each message's result from its batch's confirms: a message whose id
/// came back in a `basic.return`, carried by any confirm of the batch, was
/// returned, even though its own confirm is an ack (the broker acks an
/// unroutable message after returning it). Sound because a batch has its
/// channel to itself from its first publish until every one of its
/// confirms resolved ([`Pool`]; a channel with a confirm unresolved is
/// closed, never reused), and the broker sends a message's return before
/// its confirm: every return lapin hands out meanwhile is one of this
/// batch's messages, and none of them is left for the next batch.
fn attribute_returns(
    messages: &[OutgoingMessage],
    confirms: Vec<Confirm>,
) -> Vec<Result<(), PublishFailure>> {
    let mut returned: std::collections::HashMap<String, String> =
        confirms.iter().filter_map(|c| c.carried.clone()).collect();
    messages
        .iter()
        .zip(confirms)
        .map(|(message, confirm)| {
            match (confirm.outcome, returned.remove(&message.id().to_string())) {
                (Ok(()), Some(reason)) => Err(PublishFailure::Returned(reason)),
                (outcome, _) => outcome,
            }
        })
        .collect()
}

fn ids<'a>(ids: impl Iterator<Item = &'a MessageId>) -> Vec<String> {
    ids.map(ToString::to_string).collect()
}

/// Waits for the next wake-up and swallows those already queued behind it
/// (one round takes them all); `false` when the stream ended. Without a
/// stream it never resolves.
async fn next_wakeup(wakeups: &mut Option<BoxStream<'static, ()>>) -> bool {
    let Some(stream) = wakeups.as_mut() else {
        return std::future::pending().await;
    };
    if stream.next().await.is_none() {
        return false;
    }
    while let Some(Some(())) = stream.next().now_or_never() {}
    true
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

    #[test]
    fn a_message_keeps_its_id_type_and_headers() {
        let message = OutgoingMessage::new(MessageId::new_v7(), "x", "k", "T", b"{}".to_vec())
            .and_then(|m| m.with_header("tenant", "acme"))
            .expect("valid");
        let properties = properties(&message);
        assert_eq!(
            properties.message_id().as_ref().map(|id| id.as_str()),
            Some(message.id().to_string().as_str())
        );
        assert_eq!(properties.kind().as_ref().map(|t| t.as_str()), Some("T"));
        assert_eq!(properties.delivery_mode(), &Some(2));
        let headers = properties.headers().clone().unwrap_or_default();
        assert_eq!(
            headers.inner().get("tenant"),
            Some(&AMQPValue::LongString("acme".into()))
        );
    }

    /// lapin hands a return to whichever confirm resolves next: here the
    /// nack of another message carries it, and the returned message's own
    /// confirm is a plain ack. The batch still sees which one came back.
    #[test]
    fn a_return_carried_by_another_confirm_is_charged_to_its_own_message() {
        let message = |n: u8| {
            OutgoingMessage::new(MessageId::new_v7(), "x", "k", "T", vec![n]).expect("valid")
        };
        let (nacked, returned, published) = (message(0), message(1), message(2));
        let confirms = vec![
            Confirm {
                outcome: Err(PublishFailure::Nack),
                carried: Some((returned.id().to_string(), "312 NO_ROUTE".into())),
            },
            Confirm {
                outcome: Ok(()),
                carried: None,
            },
            Confirm {
                outcome: Ok(()),
                carried: None,
            },
        ];
        let results = attribute_returns(&[nacked, returned, published], confirms);
        assert!(matches!(results[0], Err(PublishFailure::Nack)));
        assert!(matches!(&results[1], Err(PublishFailure::Returned(r)) if r == "312 NO_ROUTE"));
        assert!(results[2].is_ok());
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

    #[test]
    fn failures_that_break_the_channel_reopen_it() {
        assert!(PublishFailure::Timeout(Duration::ZERO).breaks_channel());
        assert!(!PublishFailure::Nack.breaks_channel());
        // Only the message's own refusals are charged to it.
        assert!(PublishFailure::Nack.is_refusal());
        assert!(PublishFailure::Returned("312 NO_ROUTE".into()).is_refusal());
        assert!(!PublishFailure::Timeout(Duration::ZERO).is_refusal());
        assert_eq!(PublishFailure::Returned(String::new()).reason(), "returned");
    }
}
