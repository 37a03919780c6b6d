//! `parcel-inbox demo`: the whole loop in one command, checked.
//!
//! Migrates a fresh schema, starts the three consumers and the producer
//! (`POST /parcels` on a real listening server, and an outbox relay) in
//! process, and creates N parcels through real HTTP requests. Each creation
//! commits the parcel and its `parcel.created` event; the relay publishes
//! it; the carrier consumer reserves a slot and enqueues
//! `parcel.carrier-assigned` in its inbox transaction; the relay publishes
//! that; the third consumer notifies. On the way: clients retry some
//! requests (answered 200, nothing written), a copy of some messages of each
//! kind is published again under its id (what a relay that died between
//! confirm and mark does), and the first attempt of one message in each hop
//! dies after its writes, before COMMIT. Then it proves from the database,
//! the outbox and the stub downstreams' ledgers:
//!
//! - parcels = outbox rows published = carrier-assigned events =
//!   notifications of each kind = carrier bookings, and nothing twice;
//! - duplicates discarded = copies sent, for each consumer;
//! - each crashed message was redelivered and processed exactly once;
//! - nothing dead-lettered, nothing left in the queues.
//!
//! Any failed check makes it exit non-zero.
//!
//! The same run works on RabbitMQ and on NATS JetStream: the service and
//! the relay pick their broker from the URL, and what the demo does on the
//! broker itself (the copies, the leftovers, the dead letters) goes through
//! [`crate::tools::broker::Broker`]. One difference shows in the counts:
//! JetStream drops a copy published under an id it stored within its
//! duplicate window (2 minutes), before any consumer sees it, so there a
//! copy is discarded by the broker or by the inbox, and the demo counts
//! both.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_api::{ConsumerName, InboxKey, MessageId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::Error;
use crate::parcel::downstream::{Downstreams, StubCarrier, StubNotifier};
use crate::parcel::events::{CARRIER_ASSIGNED_TYPE, ParcelCreatedEvent, created_message_id};
use crate::parcel::role::Role;
use crate::parcel::service::{consumers, with_handlers};
use crate::parcel::store::{ParcelStore, Stats};
use crate::parcel::topology::Topology;
use crate::tools::broker::{Broker, DeadLetter, Sent};
use crate::tools::faults::Faults;
use crate::tools::producer::{Producer, copy_messages, create_parcels};
use crate::tools::stores::{StoreConfig, WithStore, with_store};
use inbox_runtime::brokers::BrokerKind;
use inbox_runtime::message::follow_up_id;
use inbox_runtime::tally::Tally;
use inbox_runtime::{AppError, ServiceConfig, WorkerConfig};

/// Settings of a demo run.
#[derive(Clone)]
pub struct DemoConfig {
    /// The store; its schema is replaced by a fresh one per run.
    pub store: StoreConfig,
    /// The broker: an `amqp://` URL runs the demo on RabbitMQ, a `nats://`
    /// one on NATS JetStream.
    pub broker_url: String,
    /// Distinct events.
    pub events: usize,
    /// Copies per event, on average.
    pub duplicate_rate: f64,
    /// Keep the schema and the queues afterwards.
    pub keep: bool,
    /// The message path's settings.
    pub worker: WorkerConfig,
    /// How long to wait for the queues to drain.
    pub drain_timeout: Duration,
}

impl std::fmt::Debug for DemoConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DemoConfig")
            .field("store", &self.store)
            .field(
                "broker_url",
                &inbox_runtime::redact::redact_url(&self.broker_url),
            )
            .field("events", &self.events)
            .field("duplicate_rate", &self.duplicate_rate)
            .field("keep", &self.keep)
            .field("worker", &self.worker)
            .field("drain_timeout", &self.drain_timeout)
            .finish()
    }
}

/// Runs the demo; returns its printed summary.
///
/// # Errors
/// [`Error::CheckFailed`] (with the summary) when a check fails; any
/// infrastructure error otherwise.
pub async fn run(mut config: DemoConfig) -> Result<String, Error> {
    // An unknown scheme is refused before a schema is made.
    BrokerKind::of(&config.broker_url)?;
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    config.store.schema = format!("parcel_demo_{run_id}");
    with_store(&config.store.clone(), Some(5), Demo { config, run_id })
        .await?
        .map_err(Error::CheckFailed)
}

struct Demo {
    config: DemoConfig,
    run_id: String,
}

impl WithStore for Demo {
    /// The summary, or the failed checks with it.
    type Output = Result<String, String>;

    async fn run<S: ParcelStore>(self, store: S) -> Result<Result<String, String>, AppError> {
        let topology = Topology::new(format!("demo-{}.", self.run_id));
        store.migrate_all().await?;
        let outcome = self.exercise(&store, &topology).await;
        if !self.config.keep
            && let Err(error) = cleanup(&store, &topology, &self.config.broker_url).await
        {
            tracing::warn!(error = %inbox_runtime::error::chain(&error), "demo cleanup failed");
        }
        outcome
    }
}

async fn cleanup<S: ParcelStore>(
    store: &S,
    topology: &Topology,
    broker_url: &str,
) -> Result<(), AppError> {
    // The schema goes even when the broker is away (the run may have
    // failed for that very reason).
    let removed = topology.remove(broker_url).await;
    let dropped = store.drop_schema().await;
    removed.and(dropped)
}

impl Demo {
    async fn exercise<S: ParcelStore>(
        &self,
        store: &S,
        topology: &Topology,
    ) -> Result<Result<String, String>, AppError> {
        let cfg = &self.config;
        let parcels = parcels(cfg.events, &format!("P{}", self.run_id));
        if parcels.is_empty() {
            return Err(AppError::Config("the demo needs at least one event".into()));
        }
        let created: Vec<MessageId> = parcels
            .iter()
            .map(|p| created_message_id(&p.parcel_id))
            .collect();
        let carrier_name = ConsumerName::new(Role::Carrier.consumer_name())?;
        let follow_ups: Vec<MessageId> = created
            .iter()
            .map(|id| follow_up_id(id, &carrier_name, CARRIER_ASSIGNED_TYPE))
            .collect();
        // One crash per hop, on messages that get no copy (so that their
        // redelivery, not a copy, is what processes them).
        let crashed_follow_up = follow_ups.len().min(2) - 1;
        let faults = Arc::new(Faults::default());
        faults.crash_first_attempt(InboxKey::new(created[0], carrier_name.clone()));
        faults.crash_first_attempt(InboxKey::new(
            follow_ups[crashed_follow_up],
            ConsumerName::new(Role::CarrierAssignedNotification.consumer_name())?,
        ));
        let repeated = repeated(parcels.len(), cfg.duplicate_rate, 2)?;
        // First, so that a broker that is away says so at once, with its
        // cause, rather than as a service that never starts consuming.
        let broker = Broker::connect(
            &cfg.broker_url,
            &format!("parcel-inbox demo inspect {}", self.run_id),
        )
        .await?;

        let carrier = Arc::new(StubCarrier::default());
        let notifier = Arc::new(StubNotifier::default());
        let consumers = consumers(Downstreams {
            carrier: carrier.clone(),
            notifier: notifier.clone(),
        })?
        .map(&faults);
        let service = with_handlers(
            store.clone(),
            ServiceConfig {
                broker_url: cfg.broker_url.clone(),
                worker: cfg.worker.clone(),
                connection_name: format!("parcel-inbox demo {}", self.run_id),
                cleanup: None,
                gauge_interval: Some(Duration::from_secs(5)),
                ..ServiceConfig::new(&cfg.broker_url, "")
            },
            topology,
            consumers,
        )
        .spawn()?;
        service.wait_consuming(1, Duration::from_secs(30)).await?;
        let producer = Producer::start(
            store.clone(),
            topology,
            &cfg.broker_url,
            &format!("parcel-inbox demo relay {}", self.run_id),
        )
        .await?;

        let started = Instant::now();
        let answers = create_parcels(producer.addr(), &parcels).await?;
        let created_201 = answers.iter().filter(|a| a.status == 201).count() as u64;
        let retry: Vec<ParcelCreatedEvent> = repeated.iter().map(|&i| parcels[i].clone()).collect();
        let answers = create_parcels(producer.addr(), &retry).await?;
        let retried_200 = answers.iter().filter(|a| a.status == 200).count() as u64;
        let tally = Arc::clone(&service.tally);
        let n = parcels.len() as u64;
        let mut drained = wait_for(&tally, cfg.drain_timeout, |t, role| {
            t.consumer(role.consumer_name()).finished() >= n
        })
        .await;
        // Copies of both kinds, under their ids, once the originals are in.
        let mut copies: Vec<MessageId> = repeated.iter().map(|&i| created[i]).collect();
        copies.extend(repeated.iter().map(|&i| follow_ups[i]));
        let sent = copy_messages(store, &broker, &copies).await?;
        let k = repeated.len() as u64;
        let dropped = |role: Role| {
            sent.iter()
                .filter(|(key, outcome)| {
                    key == role.routing_key() && *outcome == Sent::DroppedAsDuplicate
                })
                .count() as u64
        };
        drained &= wait_for(&tally, cfg.drain_timeout, |t, role| {
            t.consumer(role.consumer_name()).finished() >= n + k - dropped(role)
        })
        .await;
        let deadline = Instant::now() + cfg.drain_timeout;
        while store.pending_count().await? > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let left = leftovers(&broker, topology).await?;
        let dead_letters = broker.dead_letters(topology).await?;
        let broker_name = broker.name();
        broker.close().await;
        let elapsed = started.elapsed();
        let relay = producer.relay_tally();
        producer.stop().await?;
        service.shutdown();
        service.join().await?;
        let mut carrier_assigned_events = 0;
        for id in &follow_ups {
            if store
                .lookup_outgoing(id)
                .await?
                .is_some_and(|r| r.published_at.is_some())
            {
                carrier_assigned_events += 1;
            }
        }
        let stats = store.stats().await?;

        let report = Report {
            store: store.kind().as_str(),
            broker: broker_name,
            dropped_by_broker: Role::ALL.map(dropped),
            distinct: n,
            created_201,
            retried: retry.len() as u64,
            retried_200,
            copies: k,
            relay_marked: relay.marked(),
            pending: store.pending_count().await?,
            carrier_assigned_events,
            tally: &tally,
            faults: &faults,
            stats: &stats,
            carrier: &carrier,
            notifier: &notifier,
            left,
            dead_letters,
            drained,
            elapsed,
        };
        let (summary, failures) = report.render();
        if failures.is_empty() {
            Ok(Ok(summary))
        } else {
            Ok(Err(format!("{}\n{summary}", failures.join("; "))))
        }
    }
}

/// `count` parcels `{tag}-000001`…, with tracking numbers and destinations
/// that vary.
fn parcels(count: usize, tag: &str) -> Vec<ParcelCreatedEvent> {
    let destinations = ["Lyon", "Porto", "Gdańsk", "Utrecht", "Bologna", "Ghent"];
    (0..count)
        .map(|i| ParcelCreatedEvent {
            parcel_id: format!("{tag}-{:06}", i + 1),
            tracking_number: format!(
                "TN{:010}",
                (i as u64 + 1).wrapping_mul(7_919) % 10_000_000_000
            ),
            destination: destinations[i % destinations.len()].to_owned(),
        })
        .collect()
}

/// The parcels whose request is retried and whose messages get a copy:
/// `round(count × rate)` picks (repeats allowed) among all but the first
/// `skip` (the crash targets), reproducibly (seed 42).
fn repeated(count: usize, rate: f64, skip: usize) -> Result<Vec<usize>, AppError> {
    if !(0.0..=10.0).contains(&rate) {
        return Err(AppError::Config(format!(
            "duplicate rate {rate} is outside 0..=10"
        )));
    }
    if count <= skip {
        return Ok(Vec::new());
    }
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "a count times a small rate, rounded"
    )]
    let picks = (count as f64 * rate).round() as usize;
    let mut rng = StdRng::seed_from_u64(42);
    Ok((0..picks).map(|_| rng.random_range(skip..count)).collect())
}

/// Waits until `done` holds for every consumer, or `timeout`.
async fn wait_for(tally: &Tally, timeout: Duration, done: impl Fn(&Tally, Role) -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if Role::ALL.iter().all(|role| done(tally, *role)) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How long the leftovers may take to reach zero once every delivery is
/// finished: a settled delivery's ack may still be on its way (acks are
/// flushed in batches), and JetStream counts it as pending until then.
const SETTLE_GRACE: Duration = Duration::from_secs(10);

/// What is left in each queue and dead-letter queue, polled until it is
/// all zero or [`SETTLE_GRACE`] passed.
async fn leftovers(broker: &Broker, topology: &Topology) -> Result<Vec<(String, u64)>, AppError> {
    let deadline = Instant::now() + SETTLE_GRACE;
    loop {
        let left = broker.leftovers(topology).await?;
        if left.iter().all(|(_, n)| *n == 0) || Instant::now() >= deadline {
            return Ok(left);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

struct Report<'a> {
    store: &'static str,
    broker: &'static str,
    /// Copies the broker dropped as duplicates, per role of [`Role::ALL`].
    dropped_by_broker: [u64; 3],
    distinct: u64,
    created_201: u64,
    retried: u64,
    retried_200: u64,
    copies: u64,
    relay_marked: u64,
    pending: u64,
    carrier_assigned_events: u64,
    tally: &'a Tally,
    faults: &'a Faults,
    stats: &'a Stats,
    carrier: &'a StubCarrier,
    notifier: &'a StubNotifier,
    left: Vec<(String, u64)>,
    dead_letters: Vec<DeadLetter>,
    drained: bool,
    elapsed: Duration,
}

impl Report<'_> {
    fn render(&self) -> (String, Vec<String>) {
        let mut out = String::new();
        let mut failures = Vec::new();
        let mut check = |out: &mut String, ok: bool, what: String| {
            let _ = writeln!(out, "  [{}] {what}", if ok { "ok" } else { "FAIL" });
            if !ok {
                failures.push(what);
            }
        };
        let n = self.distinct;
        let _ = writeln!(
            out,
            "== parcel-inbox demo ({} store, {}) ==",
            self.store, self.broker
        );
        let _ = writeln!(
            out,
            "POST /parcels: {n} parcels created over HTTP + {} client retries; {} copies of each kind of message published again under their ids; drained in {:.2?}",
            self.retried, self.copies, self.elapsed
        );
        let _ = writeln!(
            out,
            "relay: {} outbox rows marked published | {} pending",
            self.relay_marked, self.pending
        );
        for role in Role::ALL {
            let t = self.tally.consumer(role.consumer_name());
            let _ = writeln!(
                out,
                "{:<36} processed {} | duplicates discarded {} | injected crashes {} | redelivered+processed {} | requeued {} | dead-lettered {}",
                role.consumer_name(),
                t.processed(),
                t.duplicates(),
                self.faults.crashes(role.consumer_name()),
                t.redelivered_processed(),
                t.requeued(),
                t.dead_lettered_total()
            );
        }
        let _ = writeln!(
            out,
            "stub carrier: {} bookings from {} calls | stub notifier: {} notifications from {} calls",
            self.carrier.ledger.distinct_keys(),
            self.carrier.ledger.calls(),
            self.notifier.ledger.distinct_keys(),
            self.notifier.ledger.calls()
        );
        let _ = write!(out, "database:\n{}", self.stats);
        let _ = writeln!(out, "checks:");
        check(
            &mut out,
            self.drained,
            "every delivery finished (processed, duplicate or dead-lettered) for every consumer"
                .to_owned(),
        );
        check(
            &mut out,
            self.created_201 == n && self.stats.parcels == n,
            format!(
                "parcels created {} (201) = parcels rows {} = {n}",
                self.created_201, self.stats.parcels
            ),
        );
        check(
            &mut out,
            self.retried_200 == self.retried,
            format!(
                "client retries answered 200, nothing written: {} of {}",
                self.retried_200, self.retried
            ),
        );
        check(
            &mut out,
            self.relay_marked == 2 * n && self.pending == 0,
            format!(
                "outbox rows published {} = 2 × {n} (parcel.created + parcel.carrier-assigned), {} pending",
                self.relay_marked, self.pending
            ),
        );
        check(
            &mut out,
            self.carrier_assigned_events == n,
            format!(
                "carrier-assigned events {} = parcels {n}",
                self.carrier_assigned_events
            ),
        );
        let booked = self.carrier.ledger.distinct_keys() as u64;
        check(
            &mut out,
            booked == n,
            format!("carrier bookings {booked} = distinct parcels {n}"),
        );
        let twice = self.carrier.ledger.parcels_booked_more_than_once();
        check(
            &mut out,
            twice.is_empty(),
            format!("no parcel booked twice (found {})", twice.len()),
        );
        let sent = self.notifier.ledger.distinct_keys() as u64;
        check(
            &mut out,
            sent == 2 * n,
            format!("notifications sent {sent} = 2 kinds × {n} parcels"),
        );
        for (name, rows) in [
            ("notifications (parcel created)", self.stats.notifications),
            (
                "notifications (carrier assigned)",
                self.stats.carrier_assigned_notifications,
            ),
            ("carrier_assignments", self.stats.carrier_assignments),
        ] {
            check(
                &mut out,
                rows.rows == n && rows.distinct_parcels == n,
                format!(
                    "{name} rows {} = distinct parcels {n} (double effects {})",
                    rows.rows,
                    rows.double_effects()
                ),
            );
        }
        for (role, dropped) in Role::ALL.into_iter().zip(self.dropped_by_broker) {
            let dups = self.tally.consumer(role.consumer_name()).duplicates();
            // RabbitMQ never drops a copy: its line stays as it always read.
            let by_broker = if self.broker == BrokerKind::RabbitMq.name() && dropped == 0 {
                String::new()
            } else {
                format!(" + dropped by the broker as duplicates {dropped}")
            };
            check(
                &mut out,
                dups + dropped == self.copies,
                format!(
                    "{}: duplicates discarded {dups}{by_broker} = copies sent {}",
                    role.consumer_name(),
                    self.copies
                ),
            );
        }
        for role in [Role::Carrier, Role::CarrierAssignedNotification] {
            let t = self.tally.consumer(role.consumer_name());
            let crashes = self.faults.crashes(role.consumer_name());
            check(
                &mut out,
                crashes == 1 && t.redelivered_processed() >= 1,
                format!(
                    "{}: the crashed first attempt rolled back and its redelivery was processed ({} crash, {} redelivered+processed)",
                    role.consumer_name(),
                    crashes,
                    t.redelivered_processed()
                ),
            );
        }
        let dead: u64 = Role::ALL
            .iter()
            .map(|r| self.tally.consumer(r.consumer_name()).dead_lettered_total())
            .sum();
        check(
            &mut out,
            dead == 0 && self.dead_letters.is_empty(),
            format!(
                "nothing dead-lettered ({dead} counted, {} dead letters on the broker)",
                self.dead_letters.len()
            ),
        );
        for letter in &self.dead_letters {
            let _ = writeln!(
                out,
                "    dead letter of {}: message {} ({})",
                letter.queue,
                letter.message_id.as_deref().unwrap_or("without an id"),
                letter.reason.as_deref().unwrap_or("no reason given")
            );
        }
        let left: u64 = self.left.iter().map(|(_, n)| n).sum();
        check(
            &mut out,
            left == 0,
            format!("queues and dead-letter queues empty ({left} messages left)"),
        );
        for (queue, count) in self.left.iter().filter(|(_, n)| *n > 0) {
            let _ = writeln!(out, "    {queue}: {count} left");
        }
        check(
            &mut out,
            self.stats.inbox_rows == 3 * n,
            format!("inbox rows {} = 3 consumers × {n}", self.stats.inbox_rows),
        );
        let _ = writeln!(
            out,
            "{}",
            if failures.is_empty() {
                "RESULT: exactly-once effects held"
            } else {
                "RESULT: FAILED"
            }
        );
        (out, failures)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crash_targets_get_no_copy_and_the_count_follows_the_rate() {
        let picks = repeated(60, 0.5, 2).expect("picks");
        assert_eq!(picks.len(), 30);
        assert!(picks.iter().all(|&i| (2..60).contains(&i)));
        assert!(repeated(2, 0.5, 2).expect("none").is_empty());
        assert!(repeated(10, 11.0, 2).is_err());
    }
}
