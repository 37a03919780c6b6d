//! The crash-point model: an at-least-once broker over random schedules.
//!
//! M messages × C consumers are published, some more than once. The broker
//! hands out deliveries in a random order, sometimes two copies of one key at
//! once, and takes back every delivery that was not acknowledged. Each
//! delivery meets a fault from the schedule (a crash after the claim, after
//! the work, a commit whose answer is lost, a lost ack, a failing handler, a
//! cancelled middleware future); once the schedule's faults are spent, the
//! broker drains with healthy deliveries.
//!
//! Every publish carries its payload's fingerprint, and some extra
//! publishes carry another payload under the same id (a producer that
//! reused an id).
//!
//! The invariant after draining: every (message, consumer) has its effect
//! committed exactly once and an inbox row (processed) iff the effect; the
//! row keeps the fingerprint of a payload that was published; and every
//! repeat was answered by what its payload says: `Duplicate` for the
//! payload the row keeps, `Conflict` (naming both fingerprints) for
//! another. Failures shrink to a minimal schedule.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Mutex;

use inbox_api::{
    BatchTransaction, Claim, Fingerprint, Handled, Inbox, InboxError, InboxKey, InboxStore,
    InboxTransaction,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use tokio::task::yield_now;

use crate::contract::new_key;
use crate::{CrashKind, Failure, Harness};
use inbox_api::InboxRecord;

/// What befalls one delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Handled through the middleware and acknowledged.
    None,
    /// Handled and committed, but the ack never reaches the broker.
    AckLost,
    /// The work fails with a retryable error; the middleware rolls back.
    HandlerError,
    /// The consumer dies right after its claim.
    CrashAfterClaim(CrashKind),
    /// The consumer dies after the business write, before commit.
    CrashAfterWork(CrashKind),
    /// The connection dies around COMMIT; the commit may or may not happen.
    CommitLost {
        /// Which way the default harness resolves it.
        commit_happens: bool,
    },
    /// The middleware's future is dropped while the work is in flight.
    CancelledInHandle,
}

/// One broker step of the schedule.
#[derive(Clone, Debug)]
pub struct Step {
    /// Which queued delivery goes next (modulo the queue length).
    pub pick: usize,
    /// Whether a copy of the same key is delivered at the same time.
    pub concurrent_copy: bool,
    /// The fault of the picked delivery.
    pub first: Fault,
    /// The fault of the concurrent copy, if any.
    pub second: Fault,
    /// In batched mode, how many queued deliveries the consumer takes at
    /// once (the picked one first).
    pub batch: usize,
    /// In batched mode, whether the batch goes to
    /// [`Inbox::handle_batch_at_once`] (one call of the work for all fresh
    /// messages) instead of [`Inbox::handle_batch`].
    pub at_once: bool,
}

/// How the consumer hands deliveries to the inbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One transaction per delivery: [`Inbox::handle`].
    PerMessage,
    /// Several deliveries per transaction: [`Inbox::handle_batch`].
    Batched,
}

/// One generated run of the model.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// Distinct messages.
    pub messages: usize,
    /// Consumers of every message.
    pub consumers: usize,
    /// Extra publishes per (message, consumer), cycled.
    pub extra_copies: Vec<u8>,
    /// Whether an extra publish carries another payload than the first,
    /// cycled over the extra publishes.
    pub other_payloads: Vec<bool>,
    /// The faulty prefix of the run.
    pub steps: Vec<Step>,
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} message(s) x {} consumer(s), extra copies {:?}, other payloads {:?}, steps:",
            self.messages, self.consumers, self.extra_copies, self.other_payloads
        )?;
        for step in &self.steps {
            write!(
                f,
                "\n  pick {} (batch {}{}) {:?}",
                step.pick,
                step.batch,
                if step.at_once { ", at once" } else { "" },
                step.first
            )?;
            if step.concurrent_copy {
                write!(f, " || concurrent copy {:?}", step.second)?;
            }
        }
        Ok(())
    }
}

fn crash_kind() -> impl Strategy<Value = CrashKind> {
    prop_oneof![Just(CrashKind::Drop), Just(CrashKind::KillConnection)]
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        3 => Just(Fault::None),
        1 => Just(Fault::AckLost),
        1 => Just(Fault::HandlerError),
        1 => crash_kind().prop_map(Fault::CrashAfterClaim),
        1 => crash_kind().prop_map(Fault::CrashAfterWork),
        1 => any::<bool>().prop_map(|commit_happens| Fault::CommitLost { commit_happens }),
        1 => Just(Fault::CancelledInHandle),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    (
        0usize..16,
        prop::bool::weighted(0.35),
        fault(),
        fault(),
        1usize..=4,
        any::<bool>(),
    )
        .prop_map(
            |(pick, concurrent_copy, first, second, batch, at_once)| Step {
                pick,
                concurrent_copy,
                first,
                second,
                batch,
                at_once,
            },
        )
}

/// Schedules of 1–3 messages × 1–2 consumers with up to 12 faulty steps.
pub fn schedule() -> impl Strategy<Value = Schedule> {
    (
        1usize..=3,
        1usize..=2,
        prop::collection::vec(0u8..=2, 1..=6),
        prop::collection::vec(prop::bool::weighted(0.3), 1..=4),
        prop::collection::vec(step(), 0..=12),
    )
        .prop_map(
            |(messages, consumers, extra_copies, other_payloads, steps)| Schedule {
                messages,
                consumers,
                extra_copies,
                other_payloads,
                steps,
            },
        )
}

/// What the consumer tells the broker about one delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ack {
    /// Acknowledged: the broker forgets the delivery.
    Ack,
    /// Not acknowledged (crash, error, lost ack): the broker redelivers.
    Redeliver,
}

/// A store error during a delivery: retryable ones are redelivered like a
/// crash, permanent ones break the model (no fault injects bad input).
fn on_error(key: &InboxKey, error: InboxError) -> Result<Ack, Failure> {
    if error.is_retryable() {
        Ok(Ack::Redeliver)
    } else {
        Err(Failure::new(format!(
            "permanent error while delivering {key}: {error}"
        )))
    }
}

async fn work<H: Harness>(
    h: &H,
    tx: &mut crate::TxOf<H>,
    key: &InboxKey,
) -> Result<(), InboxError> {
    yield_now().await;
    h.record_effect(tx, key).await?;
    yield_now().await;
    Ok(())
}

/// The repeats' answers (`Duplicate`, `Conflict`), with the delivered key
/// and its fingerprint, checked against the rows after draining.
type Answers = Mutex<Vec<(InboxKey, Handled<()>)>>;

/// Notes `handled` for `key` when it answers a repeat.
fn note(answers: &Answers, key: &InboxKey, handled: Handled<()>) {
    if !matches!(handled, Handled::Processed(())) {
        answers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((key.clone(), handled));
    }
}

/// One delivery of `key` meeting `fault`.
async fn deliver<H: Harness>(
    h: &H,
    inbox: &Inbox<H::Store>,
    answers: &Answers,
    key: &InboxKey,
    fault: Fault,
) -> Result<Ack, Failure> {
    let store = inbox.store();
    match fault {
        Fault::None | Fault::AckLost => {
            match inbox.handle(key, async |tx| work(h, tx, key).await).await {
                Ok(handled) => {
                    note(answers, key, handled);
                    Ok(if fault == Fault::AckLost {
                        Ack::Redeliver
                    } else {
                        Ack::Ack
                    })
                }
                Err(error) => on_error(key, error),
            }
        }
        Fault::HandlerError => {
            let handled = inbox
                .handle(key, async |tx| {
                    work(h, tx, key).await?;
                    Err::<(), _>(InboxError::retryable_handler("carrier API timed out"))
                })
                .await;
            match handled {
                Ok(Handled::Processed(())) => Err(Failure::new(format!(
                    "handle of {key} reported Processed for work that failed"
                ))),
                Ok(repeat) => {
                    note(answers, key, repeat);
                    Ok(Ack::Ack)
                }
                Err(InboxError::Handler { .. }) => Ok(Ack::Redeliver),
                Err(error) => on_error(key, error),
            }
        }
        Fault::CrashAfterClaim(kind) | Fault::CrashAfterWork(kind) => {
            let mut tx = match store.begin().await {
                Ok(tx) => tx,
                Err(error) => return on_error(key, error),
            };
            let claim = match tx.claim(key).await {
                Ok(claim) => claim,
                Err(error) => return on_error(key, error),
            };
            yield_now().await;
            // Work on a Duplicate claim would be a consumer bug, not the
            // store's: only work on what was claimed Fresh.
            if matches!(fault, Fault::CrashAfterWork(_))
                && claim == Claim::Fresh
                && let Err(error) = work(h, &mut tx, key).await
            {
                return on_error(key, error);
            }
            h.crash(store, tx, kind).await;
            Ok(Ack::Redeliver)
        }
        Fault::CommitLost { commit_happens } => {
            let mut tx = match store.begin().await {
                Ok(tx) => tx,
                Err(error) => return on_error(key, error),
            };
            match tx.claim(key).await {
                Ok(Claim::Fresh) => {}
                Ok(Claim::Duplicate) => {
                    let _ = tx.rollback().await;
                    return Ok(Ack::Ack);
                }
                Err(error) => return on_error(key, error),
            }
            if let Err(error) = work(h, &mut tx, key).await {
                return on_error(key, error);
            }
            let _unknown_to_the_consumer = h.commit_lost(store, tx, commit_happens).await;
            Ok(Ack::Redeliver)
        }
        Fault::CancelledInHandle => {
            let (reached, work_started) = tokio::sync::oneshot::channel::<()>();
            let mut reached = Some(reached);
            let handling = inbox.handle(key, async |tx| {
                work(h, tx, key).await?;
                if let Some(signal) = reached.take() {
                    let _ = signal.send(());
                }
                std::future::pending::<()>().await;
                Ok::<_, InboxError>(())
            });
            tokio::select! {
                result = handling => match result {
                    Ok(Handled::Processed(())) => Err(Failure::new("pending work finished")),
                    Ok(repeat) => {
                        note(answers, key, repeat);
                        Ok(Ack::Ack)
                    }
                    Err(error) => on_error(key, error),
                },
                _ = work_started => Ok(Ack::Redeliver),
            }
        }
    }
}

/// One batch of deliveries meeting `fault`; `failing` picks the message a
/// handler error or a cancellation hits. One answer per delivery.
async fn deliver_batch<H: Harness>(
    h: &H,
    inbox: &Inbox<H::Store>,
    answers: &Answers,
    keys: &[InboxKey],
    fault: Fault,
    failing: usize,
    at_once: bool,
) -> Result<Vec<Ack>, Failure> {
    let store = inbox.store();
    let all = |ack: Ack| Ok(vec![ack; keys.len()]);
    let on_batch_error = |error: InboxError| -> Result<Vec<Ack>, Failure> {
        let ack = on_error(&keys[0], error)?;
        Ok(vec![ack; keys.len()])
    };
    // One settle rule for both modes: each message's outcome is the type
    // `Inbox::handle` returns.
    type Outcomes = Vec<(InboxKey, usize, Result<Handled<()>, InboxError>)>;
    let acks = |outcomes: Outcomes| -> Result<Vec<Ack>, Failure> {
        outcomes
            .into_iter()
            .map(|(key, _, outcome)| match outcome {
                Ok(handled) => {
                    note(answers, &key, handled);
                    Ok(Ack::Ack)
                }
                Err(error) => on_error(&key, error),
            })
            .collect()
    };
    let items = || keys.iter().cloned().zip(0..).collect::<Vec<_>>();
    let failing = failing % keys.len();
    // One per-message work for both batch APIs: at once, the fresh
    // messages' work runs in one call, message after message, and an error
    // or a cancellation ends the whole call.
    macro_rules! handle_batch {
        (|$tx:ident, $i:ident| $body:block) => {
            if at_once {
                inbox
                    .handle_batch_at_once(items(), async |$tx, fresh: &[&usize]| {
                        for &&$i in fresh $body
                        Ok::<(), InboxError>(())
                    })
                    .await
            } else {
                inbox
                    .handle_batch(items(), async |$tx, $i: &usize| {
                        let $i = *$i;
                        $body
                        Ok::<(), InboxError>(())
                    })
                    .await
            }
        };
    }
    match fault {
        Fault::None | Fault::AckLost => {
            let outcomes = handle_batch!(|tx, i| {
                work(h, tx, &keys[i]).await?;
            });
            let acked = acks(outcomes)?;
            if fault == Fault::AckLost {
                all(Ack::Redeliver)
            } else {
                Ok(acked)
            }
        }
        Fault::HandlerError => {
            let outcomes = handle_batch!(|tx, i| {
                work(h, tx, &keys[i]).await?;
                if i == failing {
                    return Err(InboxError::retryable_handler("carrier API timed out"));
                }
            });
            acks(outcomes)
        }
        Fault::CrashAfterClaim(_) | Fault::CrashAfterWork(_) | Fault::CommitLost { .. } => {
            let mut tx = match store.begin().await {
                Ok(tx) => tx,
                Err(error) => return on_batch_error(error),
            };
            let claims = match tx.claim_batch(keys).await {
                Ok(claims) => claims,
                Err(error) => return on_batch_error(error),
            };
            yield_now().await;
            if let Fault::CrashAfterClaim(kind) = fault {
                h.crash(store, tx, kind).await;
                return all(Ack::Redeliver);
            }
            for (key, claim) in keys.iter().zip(claims) {
                if claim != Claim::Fresh {
                    continue;
                }
                let worked = async {
                    tx.savepoint().await?;
                    work(h, &mut tx, key).await?;
                    tx.release_savepoint().await
                };
                if let Err(error) = worked.await {
                    return on_batch_error(error);
                }
            }
            match fault {
                Fault::CommitLost { commit_happens } => {
                    let _unknown_to_the_consumer = h.commit_lost(store, tx, commit_happens).await;
                }
                Fault::CrashAfterWork(kind) => h.crash(store, tx, kind).await,
                _ => h.crash(store, tx, CrashKind::Drop).await,
            }
            all(Ack::Redeliver)
        }
        Fault::CancelledInHandle => {
            let (reached, work_started) = tokio::sync::oneshot::channel::<()>();
            let reached = std::sync::Mutex::new(Some(reached));
            let handling = async {
                handle_batch!(|tx, i| {
                    work(h, tx, &keys[i]).await?;
                    if i == failing {
                        let signal = reached
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .take();
                        if let Some(signal) = signal {
                            let _ = signal.send(());
                        }
                        std::future::pending::<()>().await;
                    }
                })
            };
            tokio::select! {
                outcomes = handling => acks(outcomes),
                _ = work_started => all(Ack::Redeliver),
            }
        }
    }
}

/// Runs one schedule against `store` with fresh keys, drains the broker, and
/// checks the invariant.
pub async fn run_schedule<H: Harness>(
    h: &H,
    store: &H::Store,
    schedule: &Schedule,
    mode: Mode,
) -> Result<(), Failure> {
    let inbox = Inbox::new(store.clone());
    let answers = Answers::default();
    let consumers = ["notification", "carrier"];
    // `keys[i]` carries the first payload's fingerprint, `others[i]` the
    // other payload's: one id, two payloads.
    let (mut keys, mut others) = (Vec::new(), Vec::new());
    for m in 0..schedule.messages {
        let message = new_key(consumers[0]).message_id;
        for consumer in consumers.iter().take(schedule.consumers) {
            let key = InboxKey::new(
                message,
                inbox_api::ConsumerName::new(*consumer).expect("valid consumer name"),
            );
            others.push(
                key.clone()
                    .with_fingerprint(Fingerprint::of(format!("other {m}").as_bytes())),
            );
            keys.push(key.with_fingerprint(Fingerprint::of(format!("payload {m}").as_bytes())));
        }
    }
    // Every publish is one delivery in the queue, (key, other payload);
    // duplicates share the key.
    let mut queue: VecDeque<(usize, bool)> = VecDeque::new();
    let mut extras = 0usize;
    for (i, _) in keys.iter().enumerate() {
        let extra = schedule.extra_copies[i % schedule.extra_copies.len()];
        queue.push_back((i, false));
        for _ in 0..extra {
            let other = schedule.other_payloads[extras % schedule.other_payloads.len()];
            extras += 1;
            queue.push_back((i, other));
        }
    }
    let delivered = |(i, other): (usize, bool)| {
        if other {
            others[i].clone()
        } else {
            keys[i].clone()
        }
    };

    let mut steps = schedule.steps.iter();
    let mut rounds = 0usize;
    while !queue.is_empty() {
        rounds += 1;
        if rounds > 1_000 {
            return Err(Failure::new(format!(
                "the broker never drained: {} deliveries still redelivered after {rounds} rounds",
                queue.len()
            )));
        }
        let (pick, concurrent, first, second, batch, at_once) = match steps.next() {
            Some(step) => (
                step.pick,
                step.concurrent_copy,
                step.first,
                step.second,
                step.batch,
                step.at_once,
            ),
            None => (0, false, Fault::None, Fault::None, 4, false),
        };
        let Some(head) = queue.remove(pick % queue.len()) else {
            break;
        };
        let mut taken = vec![head];
        if mode == Mode::Batched {
            while taken.len() < batch
                && let Some(next) = queue.pop_front()
            {
                taken.push(next);
            }
        }
        // The concurrent copy is another queued publish of the head's key if
        // there is one: two independent deliveries. Otherwise it is the head
        // delivery itself, handed out again while the first consumer still
        // works on it (its channel died, say): that consumer's ack then goes
        // nowhere, and only the copy's ack counts.
        let mut orphaned = false;
        let copy = if concurrent {
            match queue.iter().position(|&(k, _)| k == head.0) {
                Some(position) => queue.remove(position),
                None => {
                    orphaned = true;
                    Some(head)
                }
            }
        } else {
            None
        };

        let taken_keys: Vec<InboxKey> = taken.iter().map(|&d| delivered(d)).collect();
        let answers = &answers;
        let run = async |keys: &[InboxKey], fault: Fault| -> Result<Vec<Ack>, Failure> {
            match mode {
                Mode::PerMessage => Ok(vec![deliver(h, &inbox, answers, &keys[0], fault).await?]),
                Mode::Batched => {
                    deliver_batch(h, &inbox, answers, keys, fault, pick, at_once).await
                }
            }
        };
        let (first_acks, copy_acks) = match copy {
            Some(copy) => {
                let copy_keys = [delivered(copy)];
                let (a, b) = tokio::join!(run(&taken_keys, first), run(&copy_keys, second));
                (a?, Some((copy, b?)))
            }
            None => (run(&taken_keys, first).await?, None),
        };
        for (position, (&publish, ack)) in taken.iter().zip(first_acks).enumerate() {
            if ack == Ack::Redeliver && !(position == 0 && orphaned) {
                queue.push_back(publish);
            }
        }
        if let Some((copy, acks)) = copy_acks
            && acks.first() == Some(&Ack::Redeliver)
        {
            queue.push_back(copy);
        }
    }

    let all_effects = h.effects(store).await;
    let rows = h.inbox_rows(store).await;
    for key in &keys {
        let effects = all_effects.get(key).copied().unwrap_or(0);
        let row = rows.iter().find(|r| r.key == *key);
        if effects != 1 {
            return Err(Failure::new(format!(
                "{key}: effect committed {effects} times (row: {row:?})"
            )));
        }
        match row {
            Some(row) if row.processed_at.is_some() => {}
            other => {
                return Err(Failure::new(format!(
                    "{key}: effect committed but inbox row is {other:?}"
                )));
            }
        }
    }
    check_answers(&rows, answers.into_inner().unwrap_or_default())
}

/// Every repeat's answer against the row it repeated: `Duplicate` only
/// for the payload the row keeps, `Conflict` only for another, naming the
/// row's fingerprint and the delivery's.
fn check_answers(
    rows: &[InboxRecord],
    answers: Vec<(InboxKey, Handled<()>)>,
) -> Result<(), Failure> {
    for (key, answer) in answers {
        let received = key.fingerprint().copied();
        let stored = rows
            .iter()
            .find(|r| r.key == key)
            .and_then(|row| row.fingerprint);
        let sound = match &answer {
            Handled::Duplicate => stored.is_some() && stored == received,
            Handled::Conflict {
                stored: s,
                received: r,
            } => Some(*s) == stored && Some(*r) == received && s != r,
            Handled::Processed(()) => true,
        };
        if !sound {
            return Err(Failure::new(format!(
                "{key}: a repeat carrying {received:?} was answered {answer:?}, but the row keeps {stored:?}"
            )));
        }
    }
    Ok(())
}

/// Runs `cases` random schedules against one store of `h` (keys are fresh
/// per case, so cases never see each other). On failure, the message holds
/// the shrunk, minimal schedule.
///
/// # Errors
/// The first broken invariant, after shrinking.
pub fn run<H: Harness>(
    rt: &tokio::runtime::Runtime,
    h: &H,
    cases: u32,
    mode: Mode,
) -> Result<(), Failure> {
    run_with(rt, h, cases, mode, TestRunner::new(config(cases)))
}

/// As [`run`], with a fixed seed: the same schedules on every run. For
/// tests that must find a known bug reliably.
///
/// # Errors
/// As [`run`].
pub fn run_deterministic<H: Harness>(
    rt: &tokio::runtime::Runtime,
    h: &H,
    cases: u32,
    mode: Mode,
) -> Result<(), Failure> {
    let rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
    run_with(
        rt,
        h,
        cases,
        mode,
        TestRunner::new_with_rng(config(cases), rng),
    )
}

fn config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 2_000,
        ..Config::default()
    }
}

fn run_with<H: Harness>(
    rt: &tokio::runtime::Runtime,
    h: &H,
    cases: u32,
    mode: Mode,
    mut runner: TestRunner,
) -> Result<(), Failure> {
    let store = rt.block_on(h.fresh_store());
    let result = runner.run(&schedule(), |schedule| {
        rt.block_on(run_schedule(h, &store, &schedule, mode))
            .map_err(|failure| TestCaseError::fail(failure.message))
    });
    match result {
        Ok(()) => Ok(()),
        Err(TestError::Fail(reason, schedule)) => Err(Failure::new(format!(
            "{}: crash-point model ({mode:?}) broken after shrinking ({cases} cases):\n{reason}\nminimal schedule: {schedule}",
            h.name()
        ))),
        Err(TestError::Abort(reason)) => Err(Failure::new(format!(
            "{}: crash-point model ({mode:?}) aborted: {reason}",
            h.name()
        ))),
    }
}
