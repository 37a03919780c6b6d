//! Deterministic tests, one or more per line of the contract documented on
//! `inbox_api::InboxStore`.
//!
//! Each is a plain `pub async fn` generic over a [`Harness`]; failures come
//! back as [`Failure`]s naming what was expected and what was seen.

use std::future::Future;
use std::num::NonZeroU32;
use std::pin::pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use futures::future::join_all;
use inbox_api::{
    BatchTransaction, Claim, ConsumerName, Fingerprint, Handled, Inbox, InboxError, InboxKey,
    InboxRecord, InboxStats, InboxStore, InboxStoreExt, InboxTransaction, MessageId,
};
use std::collections::BTreeMap;

use inbox_postgres::Layout;

use crate::{CrashKind, Failure, Harness, Outcome, check, check_eq};

/// How long a claim that must *not* wait may take before the suite calls it
/// blocked.
const NO_WAIT_LIMIT: Duration = Duration::from_secs(10);

/// A fresh key for `consumer`: time-ordered (v7) and random (v4) ids in
/// turn, so that the suite meets both kinds, and a partitioned store's run
/// fills both its day partitions and its untimed one.
pub fn new_key(consumer: &str) -> InboxKey {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    key_of_kind(
        consumer,
        NEXT.fetch_add(1, Ordering::Relaxed).is_multiple_of(2),
    )
}

/// A fresh key for `consumer` with a time-ordered (v7) id, or a random (v4)
/// one: for the tests whose expectation depends on the kind.
fn key_of_kind(consumer: &str, time_ordered: bool) -> InboxKey {
    let id = if time_ordered {
        MessageId::new_v7()
    } else {
        MessageId::from_uuid(uuid::Uuid::new_v4())
    };
    InboxKey::new(id, consumer_name(consumer))
}

fn consumer_name(name: &str) -> ConsumerName {
    ConsumerName::new(name).expect("test consumer names are valid")
}

/// Committed effects of `key`.
pub async fn effects_of<H: Harness>(h: &H, store: &H::Store, key: &InboxKey) -> u64 {
    h.effects(store).await.get(key).copied().unwrap_or(0)
}

/// The committed inbox row of `key`, read through the harness.
pub async fn row_of<H: Harness>(h: &H, store: &H::Store, key: &InboxKey) -> Option<InboxRecord> {
    h.inbox_rows(store)
        .await
        .into_iter()
        .find(|r| r.key == *key)
}

/// Claims, records one effect and commits.
pub async fn process_once<H: Harness>(h: &H, store: &H::Store, key: &InboxKey) -> Outcome {
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(key).await?, Claim::Fresh, "first claim of {key}");
    h.record_effect(&mut tx, key).await?;
    tx.commit().await?;
    Ok(())
}

/// Whether `fut` is still unfinished after the harness' blocking probe.
async fn stays_pending<F: Future + Unpin>(h: &impl Harness, fut: &mut F) -> bool {
    tokio::time::timeout(h.blocking_probe(), fut).await.is_err()
}

/// Runs `fut` to completion unless it takes longer than [`NO_WAIT_LIMIT`].
async fn without_waiting<F: Future>(what: &str, fut: F) -> Result<F::Output, Failure> {
    tokio::time::timeout(NO_WAIT_LIMIT, fut)
        .await
        .map_err(|_| Failure::new(format!("{what} waited {NO_WAIT_LIMIT:?}; it must not wait")))
}

/// A key's row and effect agree and say "processed exactly once".
async fn expect_processed_once<H: Harness>(h: &H, store: &H::Store, key: &InboxKey) -> Outcome {
    check_eq!(effects_of(h, store, key).await, 1, "effects of {key}");
    let row = row_of(h, store, key).await;
    check!(row.is_some(), "no inbox row for processed {key}");
    check!(
        row.as_ref().is_some_and(|r| r.processed_at.is_some()),
        "inbox row of {key} has no processed_at: {row:?}"
    );
    Ok(())
}

/// A key has neither a row nor an effect.
async fn expect_no_trace<H: Harness>(h: &H, store: &H::Store, key: &InboxKey) -> Outcome {
    check_eq!(effects_of(h, store, key).await, 0, "effects of {key}");
    let row = row_of(h, store, key).await;
    check!(row.is_none(), "inbox row left behind for {key}: {row:?}");
    Ok(())
}

/// After a failed or abandoned attempt left no trace, a redelivery through
/// the middleware runs the work, without waiting on the dead attempt.
async fn redelivery_is_processed<H: Harness>(
    h: &H,
    inbox: &Inbox<H::Store>,
    key: &InboxKey,
    what: &str,
) -> Outcome {
    let handled = without_waiting(
        what,
        inbox.handle(key, async |tx| h.record_effect(tx, key).await),
    )
    .await??;
    check_eq!(handled, Handled::Processed(()), "{what}");
    expect_processed_once(h, inbox.store(), key).await
}

/// Contract 1: a first claim is `Fresh`, every later one `Duplicate`.
pub async fn claim_is_fresh_then_duplicate<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("c1");
    process_once(h, &store, &key).await?;
    for attempt in 0..2 {
        let mut tx = store.begin().await?;
        check_eq!(
            tx.claim(&key).await?,
            Claim::Duplicate,
            "redelivery {attempt}"
        );
        tx.rollback().await?;
    }
    // The same through the one-step open-and-claim the middleware uses.
    let (tx, claim) = store.begin_claim(&key).await.map_err(|(_, e)| e)?;
    check_eq!(claim, Claim::Duplicate, "redelivery through begin_claim");
    tx.rollback().await?;
    expect_processed_once(h, &store, &key).await
}

/// Claiming a key the same transaction holds answers `Duplicate`, like an
/// `INSERT … ON CONFLICT DO NOTHING` repeated in one transaction.
pub async fn claim_twice_in_one_transaction_is_duplicate<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("c1");
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "first claim");
    let second =
        without_waiting("a second claim in the same transaction", tx.claim(&key)).await??;
    check_eq!(
        second,
        Claim::Duplicate,
        "second claim in the same transaction"
    );
    h.record_effect(&mut tx, &key).await?;
    tx.commit().await?;
    check_eq!(h.inbox_rows(&store).await.len(), 1, "rows");
    expect_processed_once(h, &store, &key).await
}

/// Contract 3: a rolled back transaction leaves neither row nor effect, and
/// the key can be claimed again.
pub async fn rollback_leaves_no_trace<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("c1");
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "claim");
    h.record_effect(&mut tx, &key).await?;
    tx.rollback().await?;
    expect_no_trace(h, &store, &key).await?;
    process_once(h, &store, &key).await?;
    expect_processed_once(h, &store, &key).await
}

async fn crash_leaves_no_trace<H: Harness>(h: &H, kind: CrashKind) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("c1");
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "claim");
    h.record_effect(&mut tx, &key).await?;
    h.crash(&store, tx, kind).await;
    expect_no_trace(h, &store, &key).await?;
    // The redelivery must not wait on the dead transaction's claim.
    without_waiting("the claim after a crash", process_once(h, &store, &key)).await??;
    expect_processed_once(h, &store, &key).await
}

/// Contract 3: a transaction dropped without commit (a panic, a cancelled
/// future) leaves no trace.
pub async fn dropped_transaction_leaves_no_trace<H: Harness>(h: &H) -> Outcome {
    crash_leaves_no_trace(h, CrashKind::Drop).await
}

/// Contract 3: a transaction whose connection is killed from outside leaves
/// no trace.
pub async fn killed_connection_leaves_no_trace<H: Harness>(h: &H) -> Outcome {
    crash_leaves_no_trace(h, CrashKind::KillConnection).await
}

/// How the first of two concurrent claimers ends.
#[derive(Clone, Copy, Debug)]
enum Ending {
    Commit,
    Rollback,
    Crash(CrashKind),
}

/// Contract 2: B's claim waits while A holds the key, then sees A's ending.
async fn concurrent_claim<H: Harness>(h: &H, ending: Ending) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("c1");
    let mut a = store.begin().await?;
    check_eq!(a.claim(&key).await?, Claim::Fresh, "A's claim");
    h.record_effect(&mut a, &key).await?;

    let b_store = store.clone();
    let b_key = key.clone();
    // B opens and claims in one step, as the middleware does: a backend
    // that sends BEGIN and the claim together must wait all the same.
    let mut b = pin!(async move { b_store.begin_claim(&b_key).await.map_err(|(_, e)| e) });
    check!(
        stays_pending(h, &mut b).await,
        "B's claim of {key} returned while A still held it uncommitted; it must wait"
    );

    match ending {
        Ending::Commit => {
            a.commit().await?;
        }
        Ending::Rollback => a.rollback().await?,
        Ending::Crash(kind) => h.crash(&store, a, kind).await,
    }

    let (mut b_tx, b_claim) = without_waiting("B's claim after A ended", b).await??;
    match ending {
        Ending::Commit => {
            check_eq!(b_claim, Claim::Duplicate, "B's claim after A committed");
            b_tx.rollback().await?;
        }
        Ending::Rollback | Ending::Crash(_) => {
            check_eq!(
                b_claim,
                Claim::Fresh,
                "B's claim after A ended with {ending:?}"
            );
            h.record_effect(&mut b_tx, &key).await?;
            b_tx.commit().await?;
        }
    }
    expect_processed_once(h, &store, &key).await
}

/// Contract 2: a concurrent claim waits, then sees `Duplicate` after commit.
pub async fn concurrent_claim_waits_then_duplicate_after_commit<H: Harness>(h: &H) -> Outcome {
    concurrent_claim(h, Ending::Commit).await
}

/// Contract 2: a concurrent claim waits, then gets `Fresh` after rollback.
pub async fn concurrent_claim_waits_then_fresh_after_rollback<H: Harness>(h: &H) -> Outcome {
    concurrent_claim(h, Ending::Rollback).await
}

/// Contract 2: a concurrent claim waits, then gets `Fresh` after the holder
/// is dropped.
pub async fn concurrent_claim_waits_then_fresh_after_drop<H: Harness>(h: &H) -> Outcome {
    concurrent_claim(h, Ending::Crash(CrashKind::Drop)).await
}

/// Contract 2: a concurrent claim waits, then gets `Fresh` after the
/// holder's connection is killed.
pub async fn concurrent_claim_waits_then_fresh_after_kill<H: Harness>(h: &H) -> Outcome {
    concurrent_claim(h, Ending::Crash(CrashKind::KillConnection)).await
}

/// Contract 2: claims of different keys never wait on each other.
pub async fn distinct_keys_do_not_wait<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let held = new_key("c1");
    let other = new_key("c1");
    let mut a = store.begin().await?;
    check_eq!(a.claim(&held).await?, Claim::Fresh, "A's claim");
    without_waiting("a claim of another key", process_once(h, &store, &other)).await??;
    a.rollback().await?;
    expect_processed_once(h, &store, &other).await?;
    expect_no_trace(h, &store, &held).await
}

/// Contract 4: the key is `(message, consumer)`: one consumer's claim,
/// pending or committed, never hides the message from another consumer.
pub async fn scope_is_per_consumer<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let message = MessageId::new_v7();
    let notify = InboxKey::new(message, consumer_name("notification"));
    let carrier = InboxKey::new(message, consumer_name("carrier"));

    let mut a = store.begin().await?;
    check_eq!(
        a.claim(&notify).await?,
        Claim::Fresh,
        "notification's claim"
    );
    without_waiting(
        "the other consumer's claim",
        process_once(h, &store, &carrier),
    )
    .await??;
    h.record_effect(&mut a, &notify).await?;
    a.commit().await?;

    expect_processed_once(h, &store, &notify).await?;
    expect_processed_once(h, &store, &carrier).await?;
    check_eq!(h.inbox_rows(&store).await.len(), 2, "one row per consumer");
    Ok(())
}

/// Contract 3: claim and business write become visible together at commit,
/// not before.
pub async fn business_write_commits_with_claim<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("c1");
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "claim");
    h.record_effect(&mut tx, &key).await?;
    expect_no_trace(h, &store, &key).await?;
    check!(
        store.lookup(&key).await?.is_none(),
        "lookup sees an uncommitted claim"
    );
    tx.commit().await?;
    expect_processed_once(h, &store, &key).await
}

/// Contract 5: `processed_at` is set inside the transaction, by the claim
/// itself: a claim that commits, alone or in a batch, with or without the
/// middleware, leaves a row with `processed_at` at or after `received_at`.
pub async fn processed_at_is_set_in_the_transaction<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let inbox = Inbox::new(store.clone());
    let handled_key = new_key("c1");
    let handled = inbox
        .handle(&handled_key, async |tx| {
            h.record_effect(tx, &handled_key).await
        })
        .await?;
    check_eq!(handled, Handled::Processed(()), "handle");

    let (claimed, batched) = (new_key("c1"), new_key("c1"));
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&claimed).await?, Claim::Fresh, "claim");
    check_eq!(
        tx.claim_batch(std::slice::from_ref(&batched)).await?,
        vec![Claim::Fresh],
        "batch claim"
    );
    tx.commit().await?;

    for key in [&handled_key, &claimed, &batched] {
        let Some(row) = row_of(h, &store, key).await else {
            return Err(Failure::new(format!("no row for {key}")));
        };
        let Some(processed_at) = row.processed_at else {
            return Err(Failure::new(format!(
                "a committed claim must record processed_at: {row:?}"
            )));
        };
        check!(
            processed_at >= row.received_at,
            "processed_at {processed_at} before received_at {}",
            row.received_at
        );
    }
    Ok(())
}

/// `lookup` reads committed state without waiting for open transactions.
pub async fn lookup_does_not_wait<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("c1");
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "claim");
    let seen = without_waiting("lookup of a pending key", store.lookup(&key)).await??;
    check!(
        seen.is_none(),
        "lookup returned an uncommitted row: {seen:?}"
    );
    h.record_effect(&mut tx, &key).await?;
    tx.commit().await?;
    let seen = store.lookup(&key).await?;
    check!(
        seen.as_ref()
            .is_some_and(|r| r.key == key && r.processed_at.is_some()),
        "lookup after commit: {seen:?}"
    );
    Ok(())
}

/// Contract 5: cleanup deletes processed rows older than the cutoff, in
/// batches of the given size, and keeps recent rows.
///
/// What "older" means depends on the layout ([`Harness::layout`]): in one
/// table every row goes by its `processed_at`; in PostgreSQL's partitioned
/// layout only ids without time (v4) do, while a time-ordered (v7) id's row
/// stays until its whole day lies before the cutoff, however long ago it
/// was processed (retention counts from the id's own timestamp).
pub async fn purge_deletes_old_processed_rows_in_batches<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let old: Vec<InboxKey> = (0..6).map(|i| key_of_kind("c1", i % 2 == 0)).collect();
    for key in &old {
        process_once(h, &store, key).await?;
    }

    h.age_rows(&store, Duration::from_secs(10 * 24 * 3600))
        .await;
    let recent = new_key("c1");
    process_once(h, &store, &recent).await?;

    let by_day = h.layout() == Layout::Partitioned;
    let (mut kept, purged): (Vec<InboxKey>, Vec<InboxKey>) = old
        .into_iter()
        .partition(|k| by_day && inbox_postgres::time_ordered(&k.message_id));
    let cutoff = h.store_now(&store).await - chrono::Duration::days(7);
    let two = NonZeroU32::new(2).expect("non-zero");
    let first = store.purge_processed_batch(cutoff, two).await?;
    check_eq!(first, 2, "first batch of 2 ({} layout)", h.layout());
    let rest = store.purge_processed_before(cutoff, two).await?;
    check_eq!(
        rest,
        purged.len() as u64 - 2,
        "the remaining old processed rows ({} layout)",
        h.layout()
    );
    let again = store.purge_processed_before(cutoff, two).await?;
    check_eq!(again, 0, "nothing left to purge");

    let mut left: Vec<InboxKey> = h
        .inbox_rows(&store)
        .await
        .into_iter()
        .map(|r| r.key)
        .collect();
    left.sort();
    kept.push(recent);
    kept.sort();
    check_eq!(left, kept, "rows left after purge ({} layout)", h.layout());
    Ok(())
}

/// The cutoff is exclusive: a row processed exactly at the cutoff stays, one
/// processed a microsecond (the coarsest clock among the backends) before
/// it goes. Retention must never be cut shorter than asked.
///
/// In the partitioned layout ([`Harness::layout`]) that is the rule of ids
/// without time; a time-ordered id's row stays until the cutoff reaches the
/// end of its id's day (UTC), and then goes with the whole day.
pub async fn purge_keeps_rows_processed_at_the_cutoff<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = key_of_kind("c1", false);
    let timed = key_of_kind("c1", true);
    process_once(h, &store, &key).await?;
    process_once(h, &store, &timed).await?;
    let Some(processed_at) = row_of(h, &store, &key).await.and_then(|r| r.processed_at) else {
        return Err(Failure::new(format!("no processed row for {key}")));
    };
    let limit = NonZeroU32::new(10).expect("non-zero");
    let at_cutoff = store.purge_processed_batch(processed_at, limit).await?;
    check_eq!(at_cutoff, 0, "rows deleted with cutoff = processed_at");
    check!(
        row_of(h, &store, &key).await.is_some(),
        "the row processed at the cutoff is kept"
    );
    let Some(timed_at) = row_of(h, &store, &timed).await.and_then(|r| r.processed_at) else {
        return Err(Failure::new(format!("no processed row for {timed}")));
    };
    let just_after = processed_at.max(timed_at) + chrono::Duration::microseconds(1);
    let deleted = store.purge_processed_before(just_after, limit).await?;
    if h.layout() != Layout::Partitioned {
        check_eq!(
            deleted,
            2,
            "rows deleted with cutoff 1 µs after processed_at"
        );
        return Ok(());
    }
    check_eq!(
        deleted,
        1,
        "rows deleted with cutoff 1 µs after processed_at: the untimed one"
    );
    check!(
        row_of(h, &store, &timed).await.is_some(),
        "a time-ordered id's row stays while its day lasts"
    );
    let day_end = inbox_postgres::id_day(&timed.message_id)
        .and_then(|day| day.succ_opt())
        .map(|next| next.and_time(chrono::NaiveTime::MIN).and_utc())
        .ok_or_else(|| Failure::new(format!("{timed} has no day")))?;
    let before_end = day_end - chrono::Duration::microseconds(1);
    check_eq!(
        store.purge_processed_before(before_end, limit).await?,
        0,
        "rows deleted with the cutoff just before the id's day ends"
    );
    check_eq!(
        store.purge_processed_before(day_end, limit).await?,
        1,
        "rows deleted with the cutoff at the end of the id's day"
    );
    check!(
        row_of(h, &store, &timed).await.is_none(),
        "the day went whole"
    );
    Ok(())
}

/// A shared store (`Arc<S>`) is the store: every call reaches it.
pub async fn a_shared_store_forwards_every_call<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let shared = std::sync::Arc::new(store.clone());
    let key = new_key("c1");
    let (mut tx, claim) = shared.begin_claim(&key).await.map_err(|(_, e)| e)?;
    check_eq!(claim, Claim::Fresh, "begin_claim through the Arc");
    h.record_effect(&mut tx, &key).await?;
    tx.commit().await?;
    expect_processed_once(h, &store, &key).await?;
    let record = shared.lookup(&key).await?;
    check_eq!(
        record.map(|r| r.key),
        Some(key.clone()),
        "lookup through the Arc"
    );
    check_eq!(
        shared.processed_counts().await?,
        BTreeMap::from([("c1".to_owned(), 1)]),
        "counts through the Arc"
    );
    let future = h.store_now(&store).await + chrono::Duration::days(1);
    let limit = NonZeroU32::new(10).expect("non-zero");
    check_eq!(
        shared.purge_processed_batch(future, limit).await?,
        1,
        "purge through the Arc"
    );
    check_eq!(shared.lookup(&key).await?, None, "purged");
    Ok(())
}

/// Row counts per consumer come from the store ([`InboxStats`]): committed
/// rows only, per consumer name, never a pending claim.
pub async fn processed_counts_are_per_consumer<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    check_eq!(
        store.processed_counts().await?,
        BTreeMap::new(),
        "counts of an empty store"
    );
    let shared = MessageId::new_v7();
    for key in [
        InboxKey::new(shared, consumer_name("carrier")),
        InboxKey::new(shared, consumer_name("notification")),
        new_key("carrier"),
        new_key("carrier"),
    ] {
        process_once(h, &store, &key).await?;
    }
    let mut pending = store.begin().await?;
    check_eq!(
        pending.claim(&new_key("audit")).await?,
        Claim::Fresh,
        "pending claim"
    );
    let expected = BTreeMap::from([("carrier".to_owned(), 3), ("notification".to_owned(), 1)]);
    check_eq!(
        store.processed_counts().await?,
        expected,
        "committed rows per consumer, the pending claim not among them"
    );
    pending.rollback().await?;
    Ok(())
}

/// The middleware runs the work once and reports the duplicate after.
pub async fn handle_runs_work_once<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let inbox = Inbox::new(store.clone());
    let key = new_key("c1");
    let runs = AtomicU32::new(0);
    for expected in [
        Handled::Processed(7),
        Handled::Duplicate,
        Handled::Duplicate,
    ] {
        let handled = inbox
            .handle(&key, async |tx| {
                runs.fetch_add(1, Ordering::SeqCst);
                h.record_effect(tx, &key).await?;
                Ok::<_, InboxError>(7)
            })
            .await?;
        check_eq!(handled, expected, "handle");
    }
    check_eq!(runs.load(Ordering::SeqCst), 1, "work runs");
    expect_processed_once(h, &store, &key).await
}

/// The middleware rolls back the claim with the work when the work fails,
/// returns the work's error, and a redelivery runs the work again.
pub async fn handle_rolls_back_on_work_error<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let inbox = Inbox::new(store.clone());
    let key = new_key("c1");
    let failed = inbox
        .handle(&key, async |tx| {
            h.record_effect(tx, &key).await?;
            Err::<(), _>(InboxError::permanent_handler("carrier refused"))
        })
        .await;
    check!(
        matches!(
            &failed,
            Err(InboxError::Handler {
                retryable: false,
                ..
            })
        ),
        "the work's error must come back as it was: {failed:?}"
    );
    expect_no_trace(h, &store, &key).await?;
    redelivery_is_processed(h, &inbox, &key, "the redelivery after a failed work").await
}

/// The middleware's future dropped mid-work (a crash, a timeout) rolls back.
pub async fn handle_rolls_back_when_cancelled<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let inbox = Inbox::new(store.clone());
    let key = new_key("c1");
    let (reached, mut work_done) = tokio::sync::oneshot::channel::<()>();
    let mut reached = Some(reached);
    {
        let handling = inbox.handle(&key, async |tx| {
            h.record_effect(tx, &key).await?;
            if let Some(signal) = reached.take() {
                let _ = signal.send(());
            }
            std::future::pending::<()>().await;
            Ok::<_, InboxError>(())
        });
        tokio::select! {
            result = handling => {
                return Err(Failure::new(format!("pending work finished: {result:?}")));
            }
            _ = &mut work_done => {}
        }
    }
    expect_no_trace(h, &store, &key).await?;
    redelivery_is_processed(h, &inbox, &key, "the redelivery after a cancelled handle").await
}

/// Contract 1 and 2 under load: many concurrent first deliveries of one key
/// run the work exactly once (check-then-insert fails this).
pub async fn concurrent_first_deliveries_run_work_once<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let inbox = Inbox::new(store.clone());
    let key = new_key("c1");
    let deliveries = (0..8).map(|_| {
        inbox.handle(&key, async |tx| {
            tokio::task::yield_now().await;
            h.record_effect(tx, &key).await?;
            tokio::task::yield_now().await;
            Ok::<_, InboxError>(())
        })
    });
    let results = join_all(deliveries).await;
    let mut processed = 0;
    for result in results {
        match result? {
            Handled::Processed(()) => processed += 1,
            Handled::Duplicate => {}
            conflict @ Handled::Conflict { .. } => {
                return Err(Failure::new(format!(
                    "{conflict:?} for a key without a fingerprint"
                )));
            }
        }
    }
    check_eq!(processed, 1, "deliveries that ran the work");
    expect_processed_once(h, &store, &key).await
}

/// Batched mode: one claim statement answers each key in order, a key
/// repeated in the batch is `Fresh` once.
pub async fn claim_batch_answers_each_key_in_order<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let done = new_key("c1");
    process_once(h, &store, &done).await?;
    let (a, b) = (new_key("c1"), new_key("c1"));
    let mut tx = store.begin().await?;
    let claims = tx
        .claim_batch(&[a.clone(), done.clone(), b.clone(), a.clone()])
        .await?;
    check_eq!(
        claims,
        vec![
            Claim::Fresh,
            Claim::Duplicate,
            Claim::Fresh,
            Claim::Duplicate
        ],
        "claims of [a, done, b, a]"
    );
    for key in [&a, &b] {
        h.record_effect(&mut tx, key).await?;
    }
    tx.commit().await?;
    for key in [&a, &b, &done] {
        expect_processed_once(h, &store, key).await?;
    }
    Ok(())
}

/// Batched mode, contract 2: a batch claim waits for a key another open
/// transaction holds, then sees its ending.
pub async fn claim_batch_waits_for_pending_keys<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let (free, held) = (new_key("c1"), new_key("c1"));
    let mut a = store.begin().await?;
    check_eq!(a.claim(&held).await?, Claim::Fresh, "A's claim");
    h.record_effect(&mut a, &held).await?;

    let b_store = store.clone();
    let batch = [free.clone(), held.clone()];
    let mut b = pin!(async move {
        let mut tx = b_store.begin().await?;
        let claims = tx.claim_batch(&batch).await?;
        Ok::<_, InboxError>((tx, claims))
    });
    check!(
        stays_pending(h, &mut b).await,
        "a batch claim including {held} returned while A still held it"
    );
    a.commit().await?;
    let (mut b_tx, claims) = without_waiting("the batch claim after A committed", b).await??;
    check_eq!(claims, vec![Claim::Fresh, Claim::Duplicate], "batch claims");
    h.record_effect(&mut b_tx, &free).await?;
    b_tx.commit().await?;
    expect_processed_once(h, &store, &free).await?;
    expect_processed_once(h, &store, &held).await
}

/// Savepoints undo the writes made after them, and only those.
pub async fn savepoint_rolls_back_only_later_writes<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let (kept, undone) = (new_key("c1"), new_key("c1"));
    let mut tx = store.begin().await?;
    check_eq!(
        tx.claim_batch(&[kept.clone(), undone.clone()]).await?,
        vec![Claim::Fresh, Claim::Fresh],
        "claims"
    );
    tx.savepoint().await?;
    h.record_effect(&mut tx, &kept).await?;
    tx.release_savepoint().await?;
    tx.savepoint().await?;
    h.record_effect(&mut tx, &undone).await?;
    tx.rollback_to_savepoint().await?;
    tx.unclaim(&undone).await?;
    tx.commit().await?;
    expect_processed_once(h, &store, &kept).await?;
    expect_no_trace(h, &store, &undone).await?;

    // A rollback without a savepoint is refused (and may abort the
    // transaction on Postgres, which is why it runs alone).
    let mut tx = store.begin().await?;
    check!(
        tx.rollback_to_savepoint().await.is_err(),
        "rollback_to_savepoint without an open savepoint must fail"
    );
    Ok(())
}

/// A released savepoint's writes belong to its parent: rolling back to the
/// parent undoes them too, as SQL's `RELEASE SAVEPOINT` does.
pub async fn released_savepoint_writes_roll_back_with_the_parent<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let (outer, inner) = (new_key("c1"), new_key("c1"));
    let mut tx = store.begin().await?;
    check_eq!(
        tx.claim_batch(&[outer.clone(), inner.clone()]).await?,
        vec![Claim::Fresh, Claim::Fresh],
        "claims"
    );
    tx.savepoint().await?;
    h.record_effect(&mut tx, &outer).await?;
    tx.savepoint().await?;
    h.record_effect(&mut tx, &inner).await?;
    tx.release_savepoint().await?;
    // Back to the outer savepoint: both effects go.
    tx.rollback_to_savepoint().await?;
    h.record_effect(&mut tx, &outer).await?;
    tx.unclaim(&inner).await?;
    tx.commit().await?;
    expect_processed_once(h, &store, &outer).await?;
    expect_no_trace(h, &store, &inner).await?;

    // A release without a savepoint is refused (alone in its transaction,
    // as Postgres aborts it).
    let mut tx = store.begin().await?;
    check!(
        tx.release_savepoint().await.is_err(),
        "release_savepoint without an open savepoint must fail"
    );
    Ok(())
}

/// `unclaim` gives a claim back: the key commits no row and is `Fresh`
/// for the next claimer, including one that was waiting.
pub async fn unclaim_gives_the_key_back<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let (kept, given_back) = (new_key("c1"), new_key("c1"));
    let mut a = store.begin().await?;
    check_eq!(
        a.claim_batch(&[kept.clone(), given_back.clone()]).await?,
        vec![Claim::Fresh, Claim::Fresh],
        "A's claims"
    );
    let b_store = store.clone();
    let b_key = given_back.clone();
    let mut b = pin!(async move {
        let mut tx = b_store.begin().await?;
        let claim = tx.claim(&b_key).await?;
        Ok::<_, InboxError>((tx, claim))
    });
    check!(stays_pending(h, &mut b).await, "B's claim must wait for A");
    a.unclaim(&given_back).await?;
    let not_held = new_key("c1");
    check!(
        a.unclaim(&not_held).await.is_err(),
        "unclaim of a key the transaction does not hold must fail"
    );
    drop(a);

    let (mut b_tx, claim) = without_waiting("B's claim after A gave the key back", b).await??;
    check_eq!(claim, Claim::Fresh, "B's claim after unclaim");
    h.record_effect(&mut b_tx, &given_back).await?;
    b_tx.commit().await?;
    expect_processed_once(h, &store, &given_back).await?;
    expect_no_trace(h, &store, &kept).await
}

/// An `unclaim` is a write like any other: rolling back to a savepoint
/// taken before it gives the key back to the transaction, and until the
/// transaction ends nobody else may claim the key (Postgres keeps the
/// deleted row's lock).
pub async fn unclaim_rolls_back_with_its_savepoint<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("c1");
    let mut a = store.begin().await?;
    check_eq!(
        a.claim_batch(std::slice::from_ref(&key)).await?,
        vec![Claim::Fresh],
        "A's claim"
    );
    a.savepoint().await?;
    a.unclaim(&key).await?;

    let b_store = store.clone();
    let b_key = key.clone();
    let mut b = pin!(async move {
        let mut tx = b_store.begin().await?;
        let claim = tx.claim(&b_key).await?;
        Ok::<_, InboxError>((tx, claim))
    });
    check!(
        stays_pending(h, &mut b).await,
        "B claimed a key A gave back inside a savepoint A may still roll back"
    );
    a.rollback_to_savepoint().await?;
    h.record_effect(&mut a, &key).await?;
    a.commit().await?;
    let (_b_tx, claim) = without_waiting("B's claim after A committed", b).await??;
    check_eq!(
        claim,
        Claim::Duplicate,
        "B's claim after A committed the restored claim"
    );
    expect_processed_once(h, &store, &key).await
}

/// A key given back can be claimed again by the same transaction: the
/// unclaim left no row, so the claim is `Fresh` and commits.
pub async fn a_key_given_back_can_be_claimed_again<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("c1");
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "first claim");
    tx.unclaim(&key).await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "claim after unclaim");
    h.record_effect(&mut tx, &key).await?;
    tx.commit().await?;
    expect_processed_once(h, &store, &key).await
}

/// A key given back changes nothing for the transaction's other keys: a
/// key it still holds claims `Duplicate`, a new one `Fresh`, and only the
/// given-back key leaves no trace.
pub async fn a_key_given_back_leaves_the_other_claims_alone<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let (held, given_back, new) = (new_key("c1"), new_key("c1"), new_key("c1"));
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&held).await?, Claim::Fresh, "first claim of held");
    check_eq!(
        tx.claim(&given_back).await?,
        Claim::Fresh,
        "first claim of given_back"
    );
    tx.unclaim(&given_back).await?;
    check_eq!(
        tx.claim(&held).await?,
        Claim::Duplicate,
        "claim of a key still held"
    );
    check_eq!(tx.claim(&new).await?, Claim::Fresh, "claim of a new key");
    h.record_effect(&mut tx, &held).await?;
    h.record_effect(&mut tx, &new).await?;
    tx.commit().await?;
    expect_processed_once(h, &store, &held).await?;
    expect_processed_once(h, &store, &new).await?;
    expect_no_trace(h, &store, &given_back).await
}

/// A fresh store and a batch of four for it: `a`, `done` (processed
/// before), `b`, and `a` again.
async fn a_batch_with_duplicates<H: Harness>(h: &H) -> Result<(H::Store, [InboxKey; 4]), Failure> {
    let store = h.fresh_store().await;
    let done = new_key("c1");
    process_once(h, &store, &done).await?;
    let (a, b) = (new_key("c1"), new_key("c1"));
    let batch = [a.clone(), done, b, a];
    Ok((store, batch))
}

/// Batched middleware: fresh messages run, duplicates (committed before, or
/// repeated in the batch) do not, and all commit at once.
pub async fn handle_batch_runs_each_message_once<H: Harness>(h: &H) -> Outcome {
    let (store, batch) = a_batch_with_duplicates(h).await?;
    let inbox = Inbox::new(store.clone());
    let [a, done, b, _] = batch.clone();
    let runs = AtomicU32::new(0);
    let items = batch.iter().cloned().zip(0..).collect();
    let outcomes = inbox
        .handle_batch(items, async |tx, i: &usize| {
            runs.fetch_add(1, Ordering::SeqCst);
            h.record_effect(tx, &batch[*i]).await?;
            Ok::<_, InboxError>(*i)
        })
        .await;
    let summary: Vec<String> = outcomes
        .iter()
        .map(|(key, i, outcome)| format!("{}:{i}:{outcome:?}", u8::from(*key == batch[*i])))
        .collect();
    check_eq!(
        summary,
        vec![
            "1:0:Ok(Processed(0))",
            "1:1:Ok(Duplicate)",
            "1:2:Ok(Processed(2))",
            "1:3:Ok(Duplicate)"
        ],
        "batch outcomes, each with its own key and item, in order"
    );
    check_eq!(runs.load(Ordering::SeqCst), 2, "work runs");
    for key in [&a, &b, &done] {
        expect_processed_once(h, &store, key).await?;
    }
    Ok(())
}

/// A payload fingerprint, for the conflict scenario.
fn print(payload: &str) -> Fingerprint {
    Fingerprint::of(payload.as_bytes())
}

/// Contract 7: the claim stores the key's fingerprint and lookup returns
/// it; a repeat with another fingerprint is a `Conflict`, with the same one
/// (or none, or against a row without one) a `Duplicate`. Single and both
/// batched paths alike; the work runs once per key either way.
pub async fn a_copy_with_another_payload_is_a_conflict<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let inbox = Inbox::new(store.clone());
    let key = new_key("c1");
    let run = async |key: &InboxKey| {
        inbox
            .handle(key, async |tx| h.record_effect(tx, key).await)
            .await
    };
    check_eq!(
        run(&key.clone().with_fingerprint(print("a"))).await?,
        Handled::Processed(()),
        "first delivery"
    );
    for (copy, expected) in [
        (key.clone().with_fingerprint(print("a")), Handled::Duplicate),
        (key.clone(), Handled::Duplicate),
        (
            key.clone().with_fingerprint(print("b")),
            Handled::Conflict {
                stored: print("a"),
                received: print("b"),
            },
        ),
    ] {
        check_eq!(
            run(&copy).await?,
            expected,
            "a copy with {:?}",
            copy.fingerprint()
        );
    }
    expect_processed_once(h, &store, &key).await?;
    let stored = store.lookup(&key).await?.and_then(|row| row.fingerprint);
    check_eq!(stored, Some(print("a")), "lookup's fingerprint");
    let read = row_of(h, &store, &key)
        .await
        .and_then(|row| row.fingerprint);
    check_eq!(read, Some(print("a")), "the row's fingerprint, read back");

    // A row claimed without a fingerprint cannot tell: a duplicate.
    let bare = new_key("c1");
    process_once(h, &store, &bare).await?;
    check_eq!(
        run(&bare.clone().with_fingerprint(print("b"))).await?,
        Handled::Duplicate,
        "a row without a fingerprint"
    );

    // Both batch paths store each key's fingerprint with its claim, and
    // answer a conflict per message, a copy inside the batch included.
    let (x, y) = (new_key("c1"), new_key("c1"));
    let batch = vec![
        (x.clone().with_fingerprint(print("x")), 0),
        (key.clone().with_fingerprint(print("c")), 1),
        (x.clone().with_fingerprint(print("x2")), 2),
        (key.clone().with_fingerprint(print("a")), 3),
    ];
    let outcomes = inbox
        .handle_batch(batch, async |tx, i: &usize| {
            if *i == 0 {
                h.record_effect(tx, &x).await?;
            }
            Ok::<_, InboxError>(())
        })
        .await;
    let conflict = |stored: &str, received: &str| {
        format!(
            "{:?}",
            Handled::<()>::Conflict {
                stored: print(stored),
                received: print(received)
            }
        )
    };
    check_eq!(
        outcome_summary(&outcomes),
        vec![
            "Processed(())".to_owned(),
            conflict("a", "c"),
            conflict("x", "x2"),
            "Duplicate".to_owned(),
        ],
        "handle_batch"
    );
    let at_once = vec![
        (y.clone().with_fingerprint(print("y")), ()),
        (x.clone().with_fingerprint(print("x3")), ()),
    ];
    let outcomes = inbox
        .handle_batch_at_once(at_once, async |tx, fresh: &[&()]| {
            check_eq!(fresh.len(), 1, "fresh messages of the batch");
            h.record_effect(tx, &y).await?;
            Ok::<_, Failure>(())
        })
        .await;
    let summary: Vec<String> = outcomes
        .iter()
        .map(|(_, _, outcome)| match outcome {
            Ok(handled) => format!("{handled:?}"),
            Err(error) => format!("Err({error:?})"),
        })
        .collect();
    check_eq!(
        summary,
        vec!["Processed(())".to_owned(), conflict("x", "x3")],
        "handle_batch_at_once"
    );
    for (batched, payload) in [(&x, "x"), (&y, "y")] {
        expect_processed_once(h, &store, batched).await?;
        let stored = store.lookup(batched).await?.and_then(|row| row.fingerprint);
        check_eq!(
            stored,
            Some(print(payload)),
            "{batched}'s stored fingerprint"
        );
    }
    Ok(())
}

/// One message's outcome in a batch, as the batch calls return it.
type BatchOutcome<I, T> = (InboxKey, I, Result<Handled<T>, InboxError>);

/// Each outcome of a batch as `Processed(..)`, `Duplicate` or `Err(kind,
/// retryable)`, for comparing a batch's outcomes in one check.
fn outcome_summary<I, T: std::fmt::Debug>(outcomes: &[BatchOutcome<I, T>]) -> Vec<String> {
    outcomes
        .iter()
        .map(|(_, _, outcome)| match outcome {
            Ok(handled) => format!("{handled:?}"),
            Err(error) => format!("Err({}, retryable: {})", error.kind(), error.is_retryable()),
        })
        .collect()
}

/// After a batch in which `failing` failed: the others processed once,
/// `failing` without a trace, and its redelivery runs without waiting.
async fn expect_only_the_failed_one_redone<H: Harness>(
    h: &H,
    store: &H::Store,
    processed: [&InboxKey; 2],
    failing: &InboxKey,
) -> Outcome {
    for key in processed {
        expect_processed_once(h, store, key).await?;
    }
    expect_no_trace(h, store, failing).await?;
    without_waiting(
        "the redelivery of the failed message",
        process_once(h, store, failing),
    )
    .await??;
    expect_processed_once(h, store, failing).await
}

/// Batched middleware: a failing message rolls back alone, its claim too;
/// the rest of the batch commits, and the failed one is `Fresh` again.
pub async fn handle_batch_rolls_back_a_failing_message_alone<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let inbox = Inbox::new(store.clone());
    let (a, failing, b) = (new_key("c1"), new_key("c1"), new_key("c1"));
    let batch = [a.clone(), failing.clone(), b.clone(), failing.clone()];
    let items = batch.iter().cloned().zip(0..).collect();
    let outcomes = inbox
        .handle_batch(items, async |tx, i: &usize| {
            h.record_effect(tx, &batch[*i]).await?;
            if *i == 1 {
                return Err(InboxError::retryable_handler("carrier API timed out"));
            }
            Ok(())
        })
        .await;
    check_eq!(
        outcome_summary(&outcomes),
        vec![
            "Processed(())",
            "Err(handler, retryable: true)",
            "Processed(())",
            "Err(deferred, retryable: true)"
        ],
        "batch outcomes"
    );
    expect_only_the_failed_one_redone(h, &store, [&a, &b], &failing).await
}

/// Batch-at-once middleware: the work runs once, with the fresh messages'
/// items only (in order, a key repeated in the batch once), and all commit
/// together.
pub async fn handle_batch_at_once_runs_the_fresh_messages_together<H: Harness>(h: &H) -> Outcome {
    let (store, batch) = a_batch_with_duplicates(h).await?;
    let inbox = Inbox::new(store.clone());
    let [a, done, b, _] = batch.clone();
    let calls = std::sync::Mutex::new(Vec::new());
    let items = batch.iter().cloned().zip(0..).collect();
    let outcomes = inbox
        .handle_batch_at_once(items, async |tx, fresh: &[&usize]| {
            calls
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(fresh.iter().map(|i| **i).collect::<Vec<usize>>());
            for i in fresh {
                h.record_effect(tx, &batch[**i]).await?;
            }
            Ok::<_, InboxError>(())
        })
        .await;
    let summary: Vec<String> = outcomes
        .iter()
        .map(|(key, i, outcome)| format!("{}:{i}:{outcome:?}", u8::from(*key == batch[*i])))
        .collect();
    check_eq!(
        summary,
        vec![
            "1:0:Ok(Processed(()))",
            "1:1:Ok(Duplicate)",
            "1:2:Ok(Processed(()))",
            "1:3:Ok(Duplicate)"
        ],
        "batch outcomes, each with its own key and item, in order"
    );
    check_eq!(
        calls
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
        vec![vec![0, 2]],
        "calls of the work, with the fresh items"
    );
    for key in [&a, &b, &done] {
        expect_processed_once(h, &store, key).await?;
    }
    Ok(())
}

/// Batch-at-once middleware: when the work fails for the whole batch, the
/// batch runs again one message at a time, so only the failing message is
/// rolled back (its claim too) and charged; the rest commit once.
pub async fn handle_batch_at_once_isolates_a_failing_message<H: Harness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let inbox = Inbox::new(store.clone());
    let (a, failing, b) = (new_key("c1"), new_key("c1"), new_key("c1"));
    let batch = [a.clone(), failing.clone(), b.clone()];
    let sizes = std::sync::Mutex::new(Vec::new());
    let items = batch.iter().cloned().zip(0..).collect();
    let outcomes = inbox
        .handle_batch_at_once(items, async |tx, fresh: &[&usize]| {
            sizes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(fresh.len());
            for i in fresh {
                h.record_effect(tx, &batch[**i]).await?;
                if **i == 1 {
                    return Err(InboxError::retryable_handler("carrier API timed out"));
                }
            }
            Ok(())
        })
        .await;
    check_eq!(
        outcome_summary(&outcomes),
        vec![
            "Processed(())",
            "Err(handler, retryable: true)",
            "Processed(())"
        ],
        "batch outcomes"
    );
    check_eq!(
        sizes
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
        vec![3, 1, 1, 1],
        "the whole batch, then one message at a time"
    );
    expect_only_the_failed_one_redone(h, &store, [&a, &b], &failing).await
}

/// Runs every contract test against `h` and returns the failures by name.
pub async fn run_all<H: Harness>(h: &H) -> Vec<(&'static str, Failure)> {
    let mut failures = Vec::new();
    macro_rules! run {
        ($($name:ident),+ $(,)?) => {$(
            if let Err(failure) = $name(h).await {
                failures.push((stringify!($name), failure));
            }
        )+};
    }
    crate::__with_contract_tests!(run run);
    failures
}
