//! `parcel-inbox demo`: the whole story in one command, checked.
//!
//! Migrates a fresh schema, starts both consumers in process, publishes N
//! events plus copies that reuse their message ids, makes the first attempt
//! of one message die mid-transaction (after its business write, before the
//! commit) so the broker redelivers it, waits until every delivery is
//! accounted for and the queues are empty, then proves from the database and
//! the stub downstreams' ledgers:
//!
//! - carrier bookings = distinct parcels, and no parcel booked twice;
//! - notifications = distinct parcels;
//! - duplicates discarded = copies sent, for each consumer;
//! - the crashed message was redelivered and processed exactly once.
//!
//! Any failed check makes it exit non-zero.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_api::{ConsumerName, InboxKey};

use crate::parcel::downstream::{Downstreams, StubCarrier, StubNotifier};
use crate::parcel::role::Role;
use crate::parcel::service::{consumers, with_handlers};
use crate::parcel::store::{ParcelStore, Stats};
use crate::parcel::topology::Topology;
use crate::runtime::amqp::{close_bounded, connect};
use crate::runtime::tally::{Tally, get};
use crate::runtime::{AppError, ServiceConfig, WorkerConfig};
use crate::tools::faults::Faults;
use crate::tools::publish::{Plan, publish};
use crate::tools::stores::{StoreConfig, WithStore, with_store};

/// Settings of a demo run.
#[derive(Clone)]
pub struct DemoConfig {
    /// The store; its schema is replaced by a fresh one per run.
    pub store: StoreConfig,
    /// The broker.
    pub amqp_url: String,
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
                "amqp_url",
                &crate::runtime::redact::redact_url(&self.amqp_url),
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
/// [`AppError::CheckFailed`] (with the summary) when a check fails; any
/// infrastructure error otherwise.
pub async fn run(mut config: DemoConfig) -> Result<String, AppError> {
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    config.store.schema = format!("parcel_demo_{run_id}");
    with_store(&config.store.clone(), Some(5), Demo { config, run_id }).await
}

struct Demo {
    config: DemoConfig,
    run_id: String,
}

impl WithStore for Demo {
    type Output = String;

    async fn run<S: ParcelStore>(self, store: S) -> Result<String, AppError> {
        let topology = Topology::new(format!("demo-{}.", self.run_id));
        store.migrate_all().await?;
        let outcome = self.exercise(&store, &topology).await;
        if !self.config.keep
            && let Err(error) = cleanup(&store, &topology, &self.config.amqp_url).await
        {
            tracing::warn!(error = %crate::runtime::error::chain(&error), "demo cleanup failed");
        }
        outcome
    }
}

async fn cleanup<S: ParcelStore>(
    store: &S,
    topology: &Topology,
    amqp_url: &str,
) -> Result<(), AppError> {
    topology.remove(amqp_url).await?;
    store.drop_schema().await
}

impl Demo {
    async fn exercise<S: ParcelStore>(
        &self,
        store: &S,
        topology: &Topology,
    ) -> Result<String, AppError> {
        let cfg = &self.config;
        let plan = Plan::new(
            cfg.events,
            cfg.duplicate_rate,
            42,
            &format!("P{}", self.run_id),
        )?;
        let crashed = crash_target(&plan)
            .ok_or_else(|| AppError::Config("the demo needs at least one event".into()))?;
        let faults = Arc::new(Faults::default());
        faults.crash_first_attempt(InboxKey::new(
            crashed,
            ConsumerName::new(Role::Carrier.consumer_name())?,
        ));
        let carrier = Arc::new(StubCarrier::default());
        let notifier = Arc::new(StubNotifier::default());
        let consumers = consumers(
            Downstreams {
                carrier: carrier.clone(),
                notifier: notifier.clone(),
            },
            topology,
        )?
        .map(&faults);
        let service = with_handlers(
            store.clone(),
            ServiceConfig {
                amqp_url: cfg.amqp_url.clone(),
                worker: cfg.worker.clone(),
                connection_name: format!("parcel-inbox demo {}", self.run_id),
                cleanup: None,
                gauge_interval: Some(Duration::from_secs(5)),
                ..ServiceConfig::new(&cfg.amqp_url, "")
            },
            topology,
            consumers,
        )
        .spawn()?;
        service.wait_consuming(1, Duration::from_secs(30)).await?;

        let started = Instant::now();
        publish(&cfg.amqp_url, topology, &plan.messages, true).await?;
        let expected_finished = (plan.ids.len() + plan.copies) as u64;
        let drained = wait_drained(&service.tally, expected_finished, cfg.drain_timeout).await;
        let ready = queue_depths(&cfg.amqp_url, topology).await?;
        let elapsed = started.elapsed();
        service.shutdown();
        let tally = Arc::clone(&service.tally);
        service.join().await?;
        let stats = store.stats().await?;

        let report = Report {
            store: store.kind().as_str(),
            distinct: plan.ids.len() as u64,
            copies: plan.copies as u64,
            published: plan.messages.len() as u64,
            tally: &tally,
            faults: &faults,
            stats: &stats,
            carrier: &carrier,
            notifier: &notifier,
            ready,
            drained,
            elapsed,
        };
        let (summary, failures) = report.render();
        if failures.is_empty() {
            Ok(summary)
        } else {
            Err(AppError::CheckFailed(format!(
                "{}\n{summary}",
                failures.join("; ")
            )))
        }
    }
}

/// The message whose first attempt the demo crashes: one published once, so
/// that its redelivery (not a copy that happened to come first) is what
/// processes it, as the check says. The first message if all have copies.
fn crash_target(plan: &Plan) -> Option<inbox_api::MessageId> {
    let published_once = |id: &inbox_api::MessageId| {
        let id = id.to_string();
        plan.messages
            .iter()
            .filter(|m| m.message_id.as_deref() == Some(id.as_str()))
            .count()
            == 1
    };
    plan.ids
        .iter()
        .copied()
        .find(published_once)
        .or_else(|| plan.ids.first().copied())
}

/// Waits until both consumers finished `expected` deliveries each.
async fn wait_drained(tally: &Tally, expected: u64, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        let done = Role::PARCEL_CREATED
            .iter()
            .all(|role| tally.consumer(role.consumer_name()).finished() >= expected);
        if done {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Ready messages left in each queue and dead-letter queue.
async fn queue_depths(amqp_url: &str, topology: &Topology) -> Result<Vec<(String, u32)>, AppError> {
    let connection = connect(amqp_url, "parcel-inbox demo inspect").await?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| AppError::broker("open channel", e))?;
    let mut depths = Vec::new();
    for role in Role::ALL {
        for queue in [topology.queue(role), topology.dead_letter_queue(role)] {
            let ready = topology.ready_messages(&channel, &queue).await?;
            depths.push((queue, ready));
        }
    }
    close_bounded(&connection, "bye").await;
    Ok(depths)
}

struct Report<'a> {
    store: &'static str,
    distinct: u64,
    copies: u64,
    published: u64,
    tally: &'a Tally,
    faults: &'a Faults,
    stats: &'a Stats,
    carrier: &'a StubCarrier,
    notifier: &'a StubNotifier,
    ready: Vec<(String, u32)>,
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
        let _ = writeln!(out, "== parcel-inbox demo ({} store) ==", self.store);
        let _ = writeln!(
            out,
            "published {} messages: {} distinct parcel events + {} copies reusing their message ids; drained in {:.2?}",
            self.published, self.distinct, self.copies, self.elapsed
        );
        for role in Role::ALL {
            let t = self.tally.consumer(role.consumer_name());
            let _ = writeln!(
                out,
                "{:<26} processed {} | duplicates discarded {} | injected crashes {} | redelivered+processed {} | requeued {} | dead-lettered {}",
                role.consumer_name(),
                get(&t.processed),
                get(&t.duplicates),
                self.faults.crashes(role.consumer_name()),
                get(&t.redelivered_processed),
                get(&t.requeued),
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
        let n = self.distinct;
        check(
            &mut out,
            self.drained,
            "every delivery finished (processed, duplicate or dead-lettered) for both consumers"
                .to_owned(),
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
            sent == n,
            format!("notifications sent {sent} = distinct parcels {n}"),
        );
        let rows = self.stats.notifications;
        check(
            &mut out,
            rows.rows == n && rows.distinct_parcels == n,
            format!(
                "notifications rows {} = distinct parcels {n} (double effects {})",
                rows.rows,
                rows.double_effects()
            ),
        );
        let rows = self.stats.carrier_assignments;
        check(
            &mut out,
            rows.rows == n && rows.distinct_parcels == n,
            format!(
                "carrier_assignments rows {} = distinct parcels {n} (double effects {})",
                rows.rows,
                rows.double_effects()
            ),
        );
        for role in Role::PARCEL_CREATED {
            let dups = get(&self.tally.consumer(role.consumer_name()).duplicates);
            check(
                &mut out,
                dups == self.copies,
                format!(
                    "{}: duplicates discarded {dups} = copies sent {}",
                    role.consumer_name(),
                    self.copies
                ),
            );
        }
        let carrier = self.tally.consumer(Role::Carrier.consumer_name());
        let crashes = self.faults.crashes(Role::Carrier.consumer_name());
        check(
            &mut out,
            crashes == 1 && get(&carrier.redelivered_processed) >= 1,
            format!(
                "the crashed first attempt rolled back and its redelivery was processed ({} crash, {} redelivered+processed)",
                crashes,
                get(&carrier.redelivered_processed)
            ),
        );
        let dead: u64 = Role::ALL
            .iter()
            .map(|r| self.tally.consumer(r.consumer_name()).dead_lettered_total())
            .sum();
        check(
            &mut out,
            dead == 0,
            format!("nothing dead-lettered ({dead})"),
        );
        let left: u32 = self.ready.iter().map(|(_, n)| n).sum();
        check(
            &mut out,
            left == 0,
            format!("queues and dead-letter queues empty ({left} ready messages left)"),
        );
        check(
            &mut out,
            self.stats.inbox_rows == 2 * n,
            format!("inbox rows {} = 2 consumers × {n}", self.stats.inbox_rows),
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
    fn the_crashed_message_has_no_copy() {
        let plan = Plan::new(60, 0.5, 42, "P").expect("plan");
        let crashed = crash_target(&plan).expect("a target").to_string();
        let published = plan
            .messages
            .iter()
            .filter(|m| m.message_id.as_deref() == Some(crashed.as_str()))
            .count();
        assert_eq!(published, 1);
    }
}
