//! The relay's crash-point model: producers, relays, a broker and two
//! consumers behind the real inbox, over random schedules.
//!
//! Producers enqueue messages with a business write and then commit, roll
//! back, die (dropped transaction or killed connection) or lose their
//! COMMIT's answer; some retry with the same id. Relays take leases and
//! meet a fault: a crash after the take, a crash after publishing and
//! before marking, a lost confirm (they give the lease back and the
//! messages go out again), a lost mark (it happened or not), a broker that
//! refuses part of a batch; sometimes two relays run at once. Time passes
//! (leases expire). The broker fans every publish out to both consumers,
//! which handle deliveries through [`Inbox::handle`] on the same store,
//! losing acks and failing now and then. Then everything drains.
//!
//! The invariant: every producer's business write and its outgoing row
//! committed together or not at all; nothing that was not committed ever
//! reached the broker; every committed message was marked published and
//! processed exactly once by each consumer; no two live leases ever held
//! one message. Failures shrink to a minimal schedule.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::num::NonZeroU32;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use inbox_api::{
    ConsumerName, EnqueueOutcome, Inbox, InboxError, InboxKey, InboxStore, InboxTransaction,
    LeaseId, MessageId, OutboxLease, OutboxStore, OutboxTransaction, OutgoingMessage,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

use super::OutboxHarness;
use super::contract::{LEASE, new_message, producer_key};
use crate::{CrashKind, Failure};

/// How many cases share one store before the next gets a fresh one.
const CASES_PER_STORE: usize = 100;

/// The consumers every published message is delivered to.
const CONSUMERS: [&str; 2] = ["notification", "carrier"];

/// How a producer's transaction ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProducerFate {
    /// COMMIT, answered.
    Commit,
    /// ROLLBACK.
    Rollback,
    /// The producer dies with the transaction open.
    Crash(CrashKind),
    /// The connection dies around COMMIT; the commit may or may not happen.
    CommitLost {
        /// Which way the harness resolves it.
        commit_happens: bool,
    },
}

/// What befalls one relay pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelayFault {
    /// Take, publish, confirm, mark.
    None,
    /// The relay dies right after taking its lease.
    CrashAfterTake,
    /// The relay publishes the batch and dies before marking it.
    CrashAfterPublish,
    /// The broker got the batch but its confirms are lost: the relay gives
    /// the lease back, and the messages will go out again.
    LostConfirm,
    /// The mark's answer is lost (the mark happened or not), and the relay
    /// dies.
    LostMark {
        /// Whether the mark reached the store.
        mark_happens: bool,
    },
    /// The broker confirms only the first `published` messages: the relay
    /// marks those and gives the rest back.
    PartialPublish {
        /// How many of the batch are confirmed.
        published: usize,
    },
}

/// What a consumer's delivery meets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConsumerFault {
    /// Handled and acknowledged.
    None,
    /// Handled, but the ack is lost: the broker redelivers.
    AckLost,
    /// The work fails; the broker redelivers.
    HandlerError,
}

/// One step of a schedule.
#[derive(Clone, Debug)]
pub enum Step {
    /// A producer enqueues one new message.
    Produce {
        /// How its transaction ends.
        fate: ProducerFate,
        /// Whether it then retries with the same id, not knowing the
        /// outcome.
        retry: bool,
    },
    /// A relay pass (and another one at the same time, if `concurrent`).
    Relay {
        /// The batch size.
        limit: u32,
        /// Its fault.
        fault: RelayFault,
        /// A second relay running at the same time, and its fault.
        concurrent: Option<RelayFault>,
    },
    /// Time passes beyond every lease.
    Expire,
    /// A consumer handles some queued deliveries.
    Consume {
        /// Which consumer.
        consumer: usize,
        /// How many deliveries at most.
        deliveries: usize,
        /// What each meets.
        fault: ConsumerFault,
    },
}

/// One generated run of the model.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// The faulty prefix of the run; then everything drains.
    pub steps: Vec<Step>,
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} step(s):", self.steps.len())?;
        for step in &self.steps {
            write!(f, "\n  {step:?}")?;
        }
        Ok(())
    }
}

fn crash_kind() -> impl Strategy<Value = CrashKind> {
    prop_oneof![Just(CrashKind::Drop), Just(CrashKind::KillConnection)]
}

fn producer_fate() -> impl Strategy<Value = ProducerFate> {
    prop_oneof![
        3 => Just(ProducerFate::Commit),
        1 => Just(ProducerFate::Rollback),
        1 => crash_kind().prop_map(ProducerFate::Crash),
        1 => any::<bool>().prop_map(|commit_happens| ProducerFate::CommitLost { commit_happens }),
    ]
}

fn relay_fault() -> impl Strategy<Value = RelayFault> {
    prop_oneof![
        3 => Just(RelayFault::None),
        1 => Just(RelayFault::CrashAfterTake),
        1 => Just(RelayFault::CrashAfterPublish),
        1 => Just(RelayFault::LostConfirm),
        1 => any::<bool>().prop_map(|mark_happens| RelayFault::LostMark { mark_happens }),
        1 => (0usize..3).prop_map(|published| RelayFault::PartialPublish { published }),
    ]
}

fn consumer_fault() -> impl Strategy<Value = ConsumerFault> {
    prop_oneof![
        3 => Just(ConsumerFault::None),
        1 => Just(ConsumerFault::AckLost),
        1 => Just(ConsumerFault::HandlerError),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (producer_fate(), prop::bool::weighted(0.3))
            .prop_map(|(fate, retry)| Step::Produce { fate, retry }),
        4 => (1u32..=4, relay_fault(), prop::option::weighted(0.3, relay_fault()))
            .prop_map(|(limit, fault, concurrent)| Step::Relay { limit, fault, concurrent }),
        1 => Just(Step::Expire),
        2 => (0usize..2, 1usize..=4, consumer_fault())
            .prop_map(|(consumer, deliveries, fault)| Step::Consume { consumer, deliveries, fault }),
    ]
}

/// Schedules of up to 16 faulty steps.
pub fn schedule() -> impl Strategy<Value = Schedule> {
    prop::collection::vec(step(), 0..=16).prop_map(|steps| Schedule { steps })
}

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
}

/// A store error in a step: retryable ones are what the fault injects (the
/// step just did not happen), permanent ones break the model.
fn tolerate(what: &str, result: Result<(), InboxError>) -> Result<(), Failure> {
    match result {
        Err(error) if !error.is_retryable() => {
            Err(Failure::new(format!("permanent error in {what}: {error}")))
        }
        _ => Ok(()),
    }
}

/// The broker and the model's knowledge, shared by concurrent relays (never
/// locked across an await).
#[derive(Default)]
struct State {
    /// Every publish, in order.
    published: Vec<MessageId>,
    /// Each consumer's queue of deliveries.
    queues: [VecDeque<MessageId>; 2],
    /// Messages held by leases that are live as far as the model knows:
    /// not expired, released or marked.
    held: BTreeMap<MessageId, LeaseId>,
}

struct World<'a, H: OutboxHarness> {
    h: &'a H,
    store: &'a H::Store,
    inbox: Inbox<H::Store>,
    state: Mutex<State>,
    produced: Vec<OutgoingMessage>,
}

impl<H: OutboxHarness> World<'_, H> {
    /// The shared state; never held across an await.
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn consumer_key(id: MessageId, consumer: usize) -> InboxKey {
        InboxKey::new(
            id,
            ConsumerName::new(CONSUMERS[consumer]).expect("valid consumer name"),
        )
    }

    async fn produce(&mut self, fate: ProducerFate, retry: bool) -> Result<(), Failure> {
        let message = new_message();
        self.produced.push(message.clone());
        let (h, store) = (self.h, self.store);
        let attempt = async {
            let mut tx = store.begin().await?;
            h.record_effect(&mut tx, &producer_key(&message)).await?;
            let _ = tx.enqueue(&message).await?;
            match fate {
                ProducerFate::Commit => tx.commit().await,
                ProducerFate::Rollback => tx.rollback().await,
                ProducerFate::Crash(kind) => {
                    h.crash(store, tx, kind).await;
                    Ok(())
                }
                ProducerFate::CommitLost { commit_happens } => {
                    let _unknown_to_the_producer = h.commit_lost(store, tx, commit_happens).await;
                    Ok(())
                }
            }
        };
        tolerate("a producer", attempt.await)?;
        if retry {
            // The producer does not know whether its first attempt
            // committed: the outbox row tells it, through the same id.
            let again = async {
                let mut tx = store.begin().await?;
                match tx.enqueue(&message).await? {
                    EnqueueOutcome::Enqueued => {
                        h.record_effect(&mut tx, &producer_key(&message)).await?;
                        tx.commit().await
                    }
                    EnqueueOutcome::AlreadyEnqueued => tx.rollback().await,
                }
            };
            tolerate("a producer's retry", again.await)?;
        }
        Ok(())
    }

    /// Records a lease in the model, failing if a live lease of another
    /// relay holds one of its messages.
    fn hold(&self, lease: &OutboxLease) -> Result<(), Failure> {
        let mut state = self.state();
        for id in lease.ids() {
            if let Some(other) = state.held.insert(id, lease.id)
                && other != lease.id
            {
                return Err(Failure::new(format!(
                    "two live leases hold {id}: {other} and {}",
                    lease.id
                )));
            }
        }
        Ok(())
    }

    fn unhold(&self, ids: &[MessageId]) {
        let mut state = self.state();
        for id in ids {
            state.held.remove(id);
        }
    }

    fn publish(&self, messages: &[OutgoingMessage]) {
        let mut state = self.state();
        for message in messages {
            state.published.push(message.id());
            for queue in &mut state.queues {
                queue.push_back(message.id());
            }
        }
    }

    async fn relay(&self, limit: u32, fault: RelayFault) -> Result<(), Failure> {
        let lease = match self.store.take_pending(nz(limit), LEASE).await {
            Ok(lease) => lease,
            Err(error) => return tolerate("a relay's take", Err(error)),
        };
        self.hold(&lease)?;
        if fault == RelayFault::CrashAfterTake {
            return Ok(());
        }
        let confirmed = match fault {
            RelayFault::PartialPublish { published } => published.min(lease.messages.len()),
            _ => lease.messages.len(),
        };
        // Another relay may run between these awaits.
        tokio::task::yield_now().await;
        self.publish(&lease.messages[..confirmed]);
        tokio::task::yield_now().await;
        let ids = lease.ids();
        match fault {
            RelayFault::None => {
                tolerate("a mark", self.store.mark_published(&ids).await.map(drop))?;
                self.unhold(&ids);
            }
            RelayFault::CrashAfterTake | RelayFault::CrashAfterPublish => {}
            RelayFault::LostConfirm => {
                tolerate("a release", self.store.release(&lease).await.map(drop))?;
                self.unhold(&ids);
            }
            RelayFault::LostMark { mark_happens } => {
                if mark_happens {
                    tolerate("a mark", self.store.mark_published(&ids).await.map(drop))?;
                    self.unhold(&ids);
                }
            }
            RelayFault::PartialPublish { .. } => {
                tolerate(
                    "a mark",
                    self.store.mark_published(&ids[..confirmed]).await.map(drop),
                )?;
                tolerate("a release", self.store.release(&lease).await.map(drop))?;
                self.unhold(&ids);
            }
        }
        Ok(())
    }

    async fn expire(&self) {
        self.h
            .age_outbox(self.store, LEASE + Duration::from_secs(1))
            .await;
        self.state().held.clear();
    }

    async fn consume(
        &self,
        consumer: usize,
        deliveries: usize,
        fault: ConsumerFault,
    ) -> Result<(), Failure> {
        for _ in 0..deliveries {
            let Some(id) = self.state().queues[consumer].pop_front() else {
                return Ok(());
            };
            let key = Self::consumer_key(id, consumer);
            let h = self.h;
            let handled = self
                .inbox
                .handle(&key, async |tx| {
                    h.record_effect(tx, &key).await?;
                    if fault == ConsumerFault::HandlerError {
                        return Err(InboxError::retryable_handler("downstream timed out"));
                    }
                    Ok(())
                })
                .await;
            let redeliver = match handled {
                Ok(_) => fault == ConsumerFault::AckLost,
                Err(error) if error.is_retryable() => true,
                Err(error) => {
                    return Err(Failure::new(format!(
                        "permanent error handling {key}: {error}"
                    )));
                }
            };
            if redeliver {
                self.state().queues[consumer].push_back(id);
            }
        }
        Ok(())
    }

    /// Healthy relays and consumers until nothing is pending or queued,
    /// letting leases of dead relays expire.
    async fn drain(&self) -> Result<(), Failure> {
        for _ in 0..100 {
            loop {
                let lease = self.store.take_pending(nz(4), LEASE).await?;
                if lease.is_empty() {
                    break;
                }
                self.hold(&lease)?;
                self.publish(&lease.messages);
                self.store.mark_published(&lease.ids()).await?;
                self.unhold(&lease.ids());
            }
            for consumer in 0..CONSUMERS.len() {
                let queued = self.state().queues[consumer].len();
                self.consume(consumer, queued, ConsumerFault::None).await?;
            }
            if self.store.pending_count().await? == 0 {
                return Ok(());
            }
            self.expire().await;
        }
        Err(Failure::new(
            "the outbox never drained: messages stay pending after 100 rounds",
        ))
    }

    async fn check(&self) -> Result<(), Failure> {
        let effects = self.h.effects(self.store).await;
        let rows: BTreeSet<InboxKey> = self
            .h
            .inbox_rows(self.store)
            .await
            .into_iter()
            .map(|row| row.key)
            .collect();
        let published = self.state().published.clone();
        for message in &self.produced {
            let id = message.id();
            let record = self.store.lookup_outgoing(&id).await?;
            let committed = record.is_some();
            let business = effects.get(&producer_key(message)).copied().unwrap_or(0);
            if business != u64::from(committed) {
                return Err(Failure::new(format!(
                    "{id}: business write committed {business} time(s), outgoing row {}",
                    if committed { "committed" } else { "absent" }
                )));
            }
            if !committed && published.contains(&id) {
                return Err(Failure::new(format!(
                    "{id} was never committed, yet the relay published it"
                )));
            }
            if committed && record.as_ref().is_some_and(|r| r.published_at.is_none()) {
                return Err(Failure::new(format!("{id} committed but never marked")));
            }
            for consumer in 0..CONSUMERS.len() {
                let key = Self::consumer_key(id, consumer);
                let processed = effects.get(&key).copied().unwrap_or(0);
                if processed != u64::from(committed) {
                    return Err(Failure::new(format!(
                        "{key}: processed {processed} time(s), but the message was {}",
                        if committed {
                            "committed"
                        } else {
                            "rolled back"
                        }
                    )));
                }
                let row = rows.contains(&key);
                if row != committed {
                    return Err(Failure::new(format!(
                        "{key}: inbox row {row}, message committed {committed}"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Marks whatever an earlier case left pending (only a failed case does)
/// as published, so that every case, and above all a shrunk one, starts
/// from an outbox with nothing due: its schedule alone explains it.
async fn clear_leftovers<H: OutboxHarness>(h: &H, store: &H::Store) -> Result<(), Failure> {
    if store.pending_count().await? == 0 {
        return Ok(());
    }
    h.age_outbox(store, LEASE + Duration::from_secs(1)).await;
    for _ in 0..1_000 {
        let lease = store.take_pending(nz(100), LEASE).await?;
        if lease.is_empty() {
            return Ok(());
        }
        store.mark_published(&lease.ids()).await?;
    }
    Err(Failure::new("leftovers of earlier cases never cleared"))
}

/// Runs one schedule against `store` with fresh messages, drains, and
/// checks the invariant.
pub async fn run_schedule<H: OutboxHarness>(
    h: &H,
    store: &H::Store,
    schedule: &Schedule,
) -> Result<(), Failure> {
    clear_leftovers(h, store).await?;
    let mut world = World {
        h,
        store,
        inbox: Inbox::new(store.clone()),
        state: Mutex::default(),
        produced: Vec::new(),
    };
    for step in &schedule.steps {
        match *step {
            Step::Produce { fate, retry } => world.produce(fate, retry).await?,
            Step::Relay {
                limit,
                fault,
                concurrent,
            } => match concurrent {
                Some(other) => {
                    let (a, b) = tokio::join!(world.relay(limit, fault), world.relay(limit, other));
                    a?;
                    b?;
                }
                None => world.relay(limit, fault).await?,
            },
            Step::Expire => world.expire().await,
            Step::Consume {
                consumer,
                deliveries,
                fault,
            } => world.consume(consumer, deliveries, fault).await?,
        }
    }
    world.drain().await?;
    world.check().await
}

/// Runs `cases` random schedules against one store of `h`. On failure, the
/// message holds the shrunk, minimal schedule.
///
/// # Errors
/// The first broken invariant, after shrinking.
pub fn run<H: OutboxHarness>(
    rt: &tokio::runtime::Runtime,
    h: &H,
    cases: u32,
) -> Result<(), Failure> {
    run_with(rt, h, cases, TestRunner::new(config(cases)))
}

/// As [`run`], with a fixed seed: the same schedules on every run, for
/// tests that must find a known bug reliably.
///
/// # Errors
/// As [`run`].
pub fn run_deterministic<H: OutboxHarness>(
    rt: &tokio::runtime::Runtime,
    h: &H,
    cases: u32,
) -> Result<(), Failure> {
    let rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
    run_with(rt, h, cases, TestRunner::new_with_rng(config(cases), rng))
}

fn config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 1_000,
        ..Config::default()
    }
}

fn run_with<H: OutboxHarness>(
    rt: &tokio::runtime::Runtime,
    h: &H,
    cases: u32,
    mut runner: TestRunner,
) -> Result<(), Failure> {
    // A fresh store every CASES_PER_STORE cases: each case reads back every
    // effect and inbox row of its store, so one store for a long run makes
    // the run quadratic (a memory run of 1,000 cases took 14 s instead of
    // about 2).
    let stores = Mutex::new((0usize, rt.block_on(h.fresh_store())));
    let result = runner.run(&schedule(), |schedule| {
        let store = {
            let mut stores = stores.lock().unwrap_or_else(PoisonError::into_inner);
            stores.0 += 1;
            if stores.0.is_multiple_of(CASES_PER_STORE) {
                stores.1 = rt.block_on(h.fresh_store());
            }
            stores.1.clone()
        };
        rt.block_on(run_schedule(h, &store, &schedule))
            .map_err(|failure| TestCaseError::fail(failure.message))
    });
    match result {
        Ok(()) => Ok(()),
        Err(TestError::Fail(reason, schedule)) => Err(Failure::new(format!(
            "{}: outbox crash-point model broken after shrinking ({cases} cases):\n{reason}\nminimal schedule: {schedule}",
            h.name()
        ))),
        Err(TestError::Abort(reason)) => Err(Failure::new(format!(
            "{}: outbox crash-point model aborted: {reason}",
            h.name()
        ))),
    }
}
