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
//!   ([`PublishRetry`](inbox_api::PublishRetry): doubling delays) and, at the limit, is dead: kept
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

#[cfg(feature = "rabbitmq")]
mod amqp;
mod config;
#[cfg(feature = "nats")]
mod nats;
mod outlet;
mod settle;
mod tally;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::FutureExt;
use futures::stream::{BoxStream, Stream, StreamExt};
use inbox_api::{OutboxStore, OutboxStoreExt};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

pub use config::RelayConfig;
pub use tally::RelayTally;

use crate::backoff::Backoff;
use crate::broker::{OnRefusal, Retrying, connect_with_backoff};
use crate::brokers::BrokerKind;
use crate::error::chain;
use crate::shutdown::stopped;
use crate::tally::bump;
use crate::telemetry::Running;
use crate::{AppError, CleanupConfig};
use outlet::Outlet;
use settle::{Settled, Settler, Settling};

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
    pub async fn run(self, shutdown: watch::Receiver<bool>) -> Result<(), AppError> {
        match BrokerKind::of(&self.config.broker_url)? {
            #[cfg(feature = "rabbitmq")]
            BrokerKind::RabbitMq => self.run_on::<amqp::Pool>(shutdown).await,
            #[cfg(feature = "nats")]
            BrokerKind::Nats => self.run_on::<nats::JetStreamOutlet>(shutdown).await,
        }
    }

    /// [`Relay::run`] on the broker `O` speaks to.
    async fn run_on<O: Outlet>(
        mut self,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), AppError> {
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
        let mut broker: Option<O> = None;
        let mut failures = 0_u32;
        let mut next_gauge = Instant::now();
        let mut in_flight: JoinSet<Settling<O::Lane>> = JoinSet::new();
        let depth = usize::try_from(self.config.pipeline_depth.get()).unwrap_or(usize::MAX);
        let result = loop {
            if *shutdown.borrow() {
                break Ok(());
            }
            if Instant::now() >= next_gauge {
                next_gauge = Instant::now() + self.config.gauge_interval;
                self.record_gauges().await;
            }
            let lane = match self.lane(&mut broker, &mut shutdown).await {
                Ok(lane) => {
                    self.broker.send_replace(true);
                    lane
                }
                Err(_) if *shutdown.borrow() => break Ok(()),
                // Only before the first connection: a configuration error
                // (refused login, unusable URL) that no retry mends.
                Err(error @ (AppError::CredentialsRefused { .. } | AppError::Config(_))) => {
                    tracing::error!(error = %chain(&error), "the relay cannot connect to {}", O::NAME);
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
            let taken = match self.start_batch::<O>(lane, &mut in_flight).await {
                Ok((taken, unused)) => {
                    settled.lanes.extend(unused);
                    taken
                }
                Err((error, unused)) => {
                    settled.error = Some(error);
                    settled.lanes.push(unused);
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
            if let Some(outlet) = broker.as_mut() {
                outlet.give_back(std::mem::take(&mut settled.lanes));
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
        if let Some(outlet) = broker {
            outlet.close().await;
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

    /// A lane for the next batch, which it has to itself until the batch
    /// is settled, on a new connection when the old one died.
    async fn lane<O: Outlet>(
        &self,
        broker: &mut Option<O>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<O::Lane, AppError> {
        if let Some(outlet) = broker.as_mut() {
            if outlet.is_open() {
                return outlet.lane(&self.config.exchanges).await;
            }
            tracing::warn!("{} connection lost; reconnecting", O::NAME);
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
        let (url, name) = (&self.config.broker_url, &self.config.connection_name);
        let options = self.config.connection;
        let retrying = Retrying {
            attempts: None,
            on_refusal,
            last_error: None,
        };
        let mut outlet = connect_with_backoff(
            url,
            O::NAME,
            || O::connect(url, name, options),
            retrying,
            shutdown,
        )
        .await?;
        bump(&self.tally.connections);
        let lane = outlet.lane(&self.config.exchanges).await?;
        *broker = Some(outlet);
        Ok(lane)
    }

    /// Takes a batch and publishes it on `lane`, then leaves its
    /// confirms, its mark and the lane to a task of its own (in
    /// `in_flight`), so that the next batch can be taken and published on
    /// another lane while the broker confirms this one. Returns how
    /// many messages it took, and `lane` when no batch took it.
    async fn start_batch<O: Outlet>(
        &self,
        lane: O::Lane,
        in_flight: &mut JoinSet<Settling<O::Lane>>,
    ) -> Result<(u32, Option<O::Lane>), (AppError, O::Lane)> {
        let lease = match self
            .store
            .take_pending(self.config.batch_size, self.config.lease)
            .await
        {
            Ok(lease) => lease,
            Err(error) => return Err((error.into(), lane)),
        };
        let taken = u32::try_from(lease.messages.len()).unwrap_or(u32::MAX);
        if lease.is_empty() {
            return Ok((0, Some(lane)));
        }
        bump(&self.tally.batches);
        let confirms = O::publish(
            &lane,
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
            let results = confirms.await;
            // A lane with an answer it still owes must not carry the next
            // batch.
            let reusable = !results.iter().any(|result| {
                result
                    .as_ref()
                    .is_err_and(outlet::PublishFailure::breaks_channel)
            });
            let outcome = settler.settle(&lease, results).await;
            let lane = if reusable {
                Some(lane)
            } else {
                O::retire(lane).await;
                None
            };
            Settling { outcome, lane }
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
