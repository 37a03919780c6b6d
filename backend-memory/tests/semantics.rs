//! The memory store's contract, through its public API only: claims and
//! their waits, atomic commits, rollback and drop, timestamps, cleanup, and
//! the idempotency middleware running on it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use inbox_api::{
    BatchTransaction, Claim, ConsumerName, Disposition, Handled, Inbox, InboxError, InboxKey,
    InboxStore, InboxStoreExt, InboxTransaction, MessageId,
};

fn nz(n: u32) -> std::num::NonZeroU32 {
    std::num::NonZeroU32::new(n).expect("non-zero")
}
use inbox_backend_memory::{ManualClock, MemoryStore, MemoryTransaction};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tokio_sync as tokio;

/// How long a claim must stay unresolved to count as waiting (the shared
/// suite's default probe).
const PROBE: Duration = Duration::from_millis(100);

/// Long enough for anything that should finish promptly.
const PROMPT: Duration = Duration::from_secs(5);

fn key(consumer: &str) -> InboxKey {
    InboxKey::new(
        MessageId::new_v7(),
        ConsumerName::new(consumer).expect("valid consumer"),
    )
}

fn t0() -> DateTime<Utc> {
    DateTime::<Utc>::from_timestamp(1_700_000_000, 0).expect("valid time")
}

async fn claim(store: &MemoryStore, key: &InboxKey) -> (Claim, MemoryTransaction) {
    let mut tx = store.begin().await.expect("begin");
    let claim = tx.claim(key).await.expect("claim");
    (claim, tx)
}

type Claiming = JoinHandle<(Result<Claim, InboxError>, MemoryTransaction)>;

/// Starts a claim of `key` in a new transaction, on its own task, so the
/// test can watch whether it completes.
fn spawn_claim(store: &MemoryStore, key: &InboxKey) -> Claiming {
    let store = store.clone();
    let key = key.clone();
    tokio::spawn(async move {
        let mut tx = store.begin().await.expect("begin");
        let claim = tx.claim(&key).await;
        (claim, tx)
    })
}

async fn assert_waiting(claiming: &mut Claiming) {
    assert!(
        timeout(PROBE, claiming).await.is_err(),
        "the claim should still be waiting for the holder"
    );
}

async fn finish(claiming: Claiming) -> (Claim, MemoryTransaction) {
    let (claim, tx) = timeout(PROMPT, claiming)
        .await
        .expect("the waiting claim should resolve once the holder ends")
        .expect("claim task");
    (claim.expect("claim"), tx)
}

// --- claims without contention ---------------------------------------------

#[tokio::test]
async fn first_claim_is_fresh_and_a_committed_one_is_duplicate() {
    let store = MemoryStore::new();
    let k = key("c");
    let (first, tx) = claim(&store, &k).await;
    assert_eq!(first, Claim::Fresh);
    tx.commit().await.unwrap();
    let (second, tx) = claim(&store, &k).await;
    assert_eq!(second, Claim::Duplicate);
    tx.rollback().await.unwrap();
    assert_eq!(store.inbox_len(), 1);
}

#[tokio::test]
async fn claim_after_rollback_or_drop_is_fresh() {
    let store = MemoryStore::new();
    let k = key("c");
    let (first, tx) = claim(&store, &k).await;
    assert_eq!(first, Claim::Fresh);
    tx.rollback().await.unwrap();
    let (second, tx) = claim(&store, &k).await;
    assert_eq!(second, Claim::Fresh);
    drop(tx);
    let (third, tx) = claim(&store, &k).await;
    assert_eq!(third, Claim::Fresh);
    tx.commit().await.unwrap();
    assert_eq!(store.inbox_len(), 1);
}

#[tokio::test]
async fn reclaim_in_the_same_transaction_is_duplicate_and_does_not_wait() {
    let store = MemoryStore::new();
    let k = key("c");
    let mut tx = store.begin().await.unwrap();
    assert_eq!(tx.claim(&k).await.unwrap(), Claim::Fresh);
    let again = timeout(PROBE, tx.claim(&k))
        .await
        .expect("must not wait on itself");
    assert_eq!(again.unwrap(), Claim::Duplicate);
    tx.commit().await.unwrap();
    assert_eq!(store.inbox_len(), 1);
}

#[tokio::test]
async fn scope_is_per_consumer() {
    let store = MemoryStore::new();
    let id = MessageId::new_v7();
    let a = InboxKey::new(id, ConsumerName::new("a").unwrap());
    let b = InboxKey::new(id, ConsumerName::new("b").unwrap());
    let (claim_a, tx_a) = claim(&store, &a).await;
    // Held (not committed) by consumer a: consumer b must neither wait nor
    // be told Duplicate.
    let (claim_b, tx_b) = timeout(PROBE, claim(&store, &b)).await.expect("no wait");
    assert_eq!((claim_a, claim_b), (Claim::Fresh, Claim::Fresh));
    tx_a.commit().await.unwrap();
    tx_b.commit().await.unwrap();
    assert_eq!(store.inbox_len(), 2);
}

// --- concurrent claims of one key -------------------------------------------

#[tokio::test]
async fn waiter_gets_duplicate_when_the_holder_commits() {
    let store = MemoryStore::new();
    let k = key("c");
    let (first, mut holder) = claim(&store, &k).await;
    assert_eq!(first, Claim::Fresh);
    holder.put("effect", "done");
    let mut waiter = spawn_claim(&store, &k);
    assert_waiting(&mut waiter).await;
    holder.commit().await.unwrap();
    let (second, tx) = finish(waiter).await;
    assert_eq!(second, Claim::Duplicate);
    drop(tx);
    assert_eq!(store.inbox_len(), 1);
}

#[tokio::test]
async fn waiter_gets_fresh_when_the_holder_rolls_back() {
    let store = MemoryStore::new();
    let k = key("c");
    let (_, holder) = claim(&store, &k).await;
    let mut waiter = spawn_claim(&store, &k);
    assert_waiting(&mut waiter).await;
    holder.rollback().await.unwrap();
    let (second, tx) = finish(waiter).await;
    assert_eq!(second, Claim::Fresh);
    tx.commit().await.unwrap();
    assert_eq!(store.inbox_len(), 1);
}

#[tokio::test]
async fn waiter_gets_fresh_when_the_holder_is_dropped() {
    let store = MemoryStore::new();
    let k = key("c");
    let (_, holder) = claim(&store, &k).await;
    let mut waiter = spawn_claim(&store, &k);
    assert_waiting(&mut waiter).await;
    drop(holder);
    let (second, tx) = finish(waiter).await;
    assert_eq!(second, Claim::Fresh);
    tx.commit().await.unwrap();
    assert_eq!(store.inbox_len(), 1);
}

#[tokio::test]
async fn a_waiter_keeps_waiting_for_as_long_as_the_holder_is_open() {
    let store = MemoryStore::new();
    let k = key("c");
    let (_, holder) = claim(&store, &k).await;
    let mut waiter = spawn_claim(&store, &k);
    for _ in 0..3 {
        assert_waiting(&mut waiter).await;
    }
    holder.commit().await.unwrap();
    assert_eq!(finish(waiter).await.0, Claim::Duplicate);
}

#[tokio::test]
async fn of_many_waiters_exactly_one_gets_fresh() {
    let store = MemoryStore::new();
    let k = key("c");
    let (_, holder) = claim(&store, &k).await;
    let mut waiters: Vec<_> = (0..8).map(|_| spawn_claim(&store, &k)).collect();
    for waiter in &mut waiters {
        assert_waiting(waiter).await;
    }
    holder.rollback().await.unwrap();

    // One waiter wins the key; the others wait for it in turn.
    let started = std::time::Instant::now();
    while !waiters.iter().any(JoinHandle::is_finished) {
        assert!(started.elapsed() < PROMPT, "no waiter got the released key");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(PROBE).await;
    let (finished, pending): (Vec<_>, Vec<_>) =
        waiters.into_iter().partition(JoinHandle::is_finished);
    assert_eq!(finished.len(), 1, "exactly one waiter may win");
    assert_eq!(pending.len(), 7);
    for winner in finished {
        let (claim, tx) = finish(winner).await;
        assert_eq!(claim, Claim::Fresh);
        tx.commit().await.unwrap();
    }
    for waiter in pending {
        assert_eq!(finish(waiter).await.0, Claim::Duplicate);
    }
}

#[tokio::test]
async fn a_cancelled_waiter_leaves_no_trace() {
    let store = MemoryStore::new();
    let k = key("c");
    let (_, holder) = claim(&store, &k).await;
    let mut tx = store.begin().await.unwrap();
    assert!(
        timeout(PROBE, tx.claim(&k)).await.is_err(),
        "waits, then is cancelled"
    );
    drop(tx);
    holder.rollback().await.unwrap();
    let (again, tx) = claim(&store, &k).await;
    assert_eq!(again, Claim::Fresh);
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn distinct_keys_do_not_wait_on_each_other() {
    let store = MemoryStore::new();
    // Enough held keys that some share a shard with the probe keys.
    let mut holders = Vec::new();
    for _ in 0..200 {
        let (claim, tx) = claim(&store, &key("c")).await;
        assert_eq!(claim, Claim::Fresh);
        holders.push(tx);
    }
    for _ in 0..200 {
        let (claim, tx) = timeout(PROBE, claim(&store, &key("c")))
            .await
            .expect("a claim of an unheld key never waits");
        assert_eq!(claim, Claim::Fresh);
        drop(tx);
    }
    drop(holders);
    assert_eq!(store.inbox_len(), 0);
}

#[tokio::test]
async fn lookup_sees_only_committed_rows_and_never_waits() {
    let store = MemoryStore::new();
    let k = key("c");
    let (_, holder) = claim(&store, &k).await;
    let found = timeout(PROBE, store.lookup(&k)).await.expect("no wait");
    assert_eq!(found.unwrap(), None);
    holder.commit().await.unwrap();
    let row = store.lookup(&k).await.unwrap().expect("committed");
    assert_eq!(row.key, k);
    assert!(row.processed_at.is_some());
}

#[tokio::test]
async fn crossed_claims_are_a_deadlock_that_aborts_one_transaction() {
    let store = MemoryStore::new();
    let (k1, k2) = (key("c"), key("c"));
    let (_, mut a) = claim(&store, &k1).await;
    let (_, mut b) = claim(&store, &k2).await;
    b.put("b-effect", "x");

    // a waits for b's key...
    let a_claims_k2 = {
        let k2 = k2.clone();
        tokio::spawn(async move {
            let claim = a.claim(&k2).await;
            (claim, a)
        })
    };
    let mut a_claims_k2 = a_claims_k2;
    assert_waiting(&mut a_claims_k2).await;

    // ...so b waiting for a's key would close a cycle: b is aborted.
    let err = timeout(PROMPT, b.claim(&k1))
        .await
        .expect("a deadlock is reported, not waited out")
        .unwrap_err();
    assert!(matches!(err, InboxError::Conflict { .. }), "{err}");
    assert_eq!(err.disposition(), Disposition::Retry);
    // The log line an operator reads names the cause, as Postgres's 40P01 does.
    assert!(
        source_text(&err).starts_with("deadlock detected"),
        "{err:?}"
    );

    // b's claims are released at once, so a proceeds.
    let (claim, a) = finish(a_claims_k2).await;
    assert_eq!(claim, Claim::Fresh);
    a.commit().await.unwrap();

    // The aborted transaction refuses further work and cannot commit.
    let refused = b.savepoint().await.unwrap_err();
    assert!(matches!(refused, InboxError::Conflict { .. }), "{refused}");
    assert!(
        source_text(&refused).contains("aborted by a deadlock"),
        "{refused:?}"
    );
    assert!(
        b.commit().await.is_err(),
        "an aborted transaction never commits"
    );
    assert_eq!(store.get("b-effect"), None);
    assert_eq!(store.inbox_len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_deliveries_with_crashes_commit_each_effect_once() {
    const KEYS: usize = 200;
    const RACERS: usize = 4;
    let store = MemoryStore::new();
    let keys: Vec<_> = (0..KEYS).map(|_| key("c")).collect();
    let fresh_claims = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        for racer in 0..RACERS {
            let (store, k, fresh_claims) = (store.clone(), k.clone(), fresh_claims.clone());
            tasks.push(tokio::spawn(async move {
                for attempt in 0.. {
                    let mut tx = store.begin().await.unwrap();
                    if tx.claim(&k).await.unwrap() == Claim::Duplicate {
                        return;
                    }
                    fresh_claims.fetch_add(1, Ordering::Relaxed);
                    tx.put(format!("effect/{}/{racer}-{attempt}", k.message_id), "x");
                    tokio::task::yield_now().await;
                    // A deterministic mix of crashes, rollbacks and commits.
                    match (i + racer * 7 + attempt) % 4 {
                        0 if attempt < 3 => drop(tx),
                        1 if attempt < 3 => tx.rollback().await.unwrap(),
                        _ => {
                            tx.commit().await.unwrap();
                            return;
                        }
                    }
                }
            }));
        }
    }
    for task in tasks {
        timeout(PROMPT, task).await.expect("no hang").unwrap();
    }
    for k in &keys {
        let effects = store.scan_prefix(&format!("effect/{}/", k.message_id));
        assert_eq!(effects.len(), 1, "{k}: {effects:?}");
    }
    let records = store.records();
    assert_eq!(records.len(), KEYS);
    assert!(records.iter().all(|r| r.processed_at.is_some()));
    assert!(fresh_claims.load(Ordering::Relaxed) >= KEYS);
}

// --- all or nothing ----------------------------------------------------------

#[tokio::test]
async fn claim_and_writes_become_visible_together_at_commit() {
    let store = MemoryStore::new();
    let k = key("c");
    let (_, mut tx) = claim(&store, &k).await;
    tx.put("effect/1", "a");
    tx.put("effect/2", b"b".to_vec());
    assert_eq!(
        tx.get("effect/1"),
        Some(b"a".to_vec()),
        "own writes are visible"
    );

    // Nothing leaks before commit, to the store or to other transactions.
    assert_eq!(store.get("effect/1"), None);
    assert_eq!(store.lookup(&k).await.unwrap(), None);
    assert_eq!(store.inbox_len(), 0);
    assert!(store.scan_prefix("").is_empty());
    let other = store.begin().await.unwrap();
    assert_eq!(other.get("effect/1"), None);

    tx.commit().await.unwrap();
    assert_eq!(other.get("effect/1"), Some(b"a".to_vec()), "read committed");
    assert_eq!(
        store.scan_prefix("effect/"),
        vec![
            ("effect/1".to_owned(), b"a".to_vec()),
            ("effect/2".to_owned(), b"b".to_vec())
        ]
    );
    assert!(store.lookup(&k).await.unwrap().is_some());
    let snapshot = store.snapshot();
    assert_eq!(snapshot.records, store.records());
    assert_eq!(snapshot.values.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_never_see_half_a_commit() {
    let store = MemoryStore::new();
    let writers: Vec<_> = (0..2)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                for _ in 0..500 {
                    let k = key("c");
                    let mut tx = store.begin().await.unwrap();
                    assert_eq!(tx.claim(&k).await.unwrap(), Claim::Fresh);
                    tx.put(format!("effect/{}", k.message_id), "e");
                    tx.put(format!("audit/{}", k.message_id), "a");
                    tx.commit().await.unwrap();
                }
            })
        })
        .collect();
    let mut snapshots = 0;
    while writers.iter().any(|w| !w.is_finished()) || snapshots == 0 {
        let snapshot = store.snapshot();
        let rows: BTreeSet<String> = snapshot
            .records
            .iter()
            .map(|r| r.key.message_id.to_string())
            .collect();
        let of = |prefix: &str| -> BTreeSet<String> {
            snapshot
                .values
                .keys()
                .filter_map(|k| k.strip_prefix(prefix).map(str::to_owned))
                .collect()
        };
        assert_eq!(rows, of("effect/"), "inbox row iff effect");
        assert_eq!(rows, of("audit/"), "every write of a commit or none");
        snapshots += 1;
        tokio::task::yield_now().await;
    }
    for writer in writers {
        writer.await.unwrap();
    }
    assert_eq!(store.inbox_len(), 1000);
}

#[tokio::test]
async fn rollback_and_drop_discard_writes_and_deletes() {
    let store = MemoryStore::new();
    let mut seed = store.begin().await.unwrap();
    seed.put("kept", "v1");
    seed.commit().await.unwrap();

    let k = key("c");
    let (_, mut tx) = claim(&store, &k).await;
    tx.put("new", "x");
    tx.delete("kept");
    assert_eq!(tx.get("kept"), None, "own delete is visible");
    tx.rollback().await.unwrap();

    let (_, mut tx) = claim(&store, &k).await;
    tx.put("new", "x");
    tx.delete("kept");
    drop(tx);

    assert_eq!(store.get("kept"), Some(b"v1".to_vec()));
    assert_eq!(store.get("new"), None);
    assert_eq!(store.inbox_len(), 0);
    assert!(store.records().is_empty());
}

#[tokio::test]
async fn delete_and_overwrite_apply_at_commit_last_writer_wins() {
    let store = MemoryStore::new();
    let mut seed = store.begin().await.unwrap();
    seed.put("gone", "v");
    seed.put("shared", "seed");
    seed.commit().await.unwrap();

    let mut first = store.begin().await.unwrap();
    let mut second = store.begin().await.unwrap();
    first.put("shared", "first");
    second.put("shared", "second");
    second.delete("gone");
    second.commit().await.unwrap();
    first.commit().await.unwrap();
    assert_eq!(
        store.get("shared"),
        Some(b"first".to_vec()),
        "last commit wins"
    );
    assert_eq!(store.get("gone"), None);
}

#[tokio::test]
async fn an_empty_transaction_commits() {
    let store = MemoryStore::default();
    store.begin().await.unwrap().commit().await.unwrap();
    store.begin().await.unwrap().rollback().await.unwrap();
    assert_eq!(store.inbox_len(), 0);
}

#[tokio::test]
async fn clones_share_state() {
    let store = MemoryStore::new();
    let clone = store.clone();
    let k = key("c");
    let (_, mut tx) = claim(&clone, &k).await;
    tx.put("x", "1");
    tx.commit().await.unwrap();
    assert_eq!(store.get("x"), Some(b"1".to_vec()));
    assert_eq!(claim(&store, &k).await.0, Claim::Duplicate);
}

#[tokio::test]
async fn scan_prefix_filters_and_sorts() {
    let store = MemoryStore::new();
    let mut tx = store.begin().await.unwrap();
    for name in ["b/2", "a/1", "b/1", "b/10", "c"] {
        tx.put(name, name);
    }
    tx.commit().await.unwrap();
    let keys: Vec<_> = store
        .scan_prefix("b/")
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(keys, ["b/1", "b/10", "b/2"]);
    assert_eq!(store.scan_prefix("").len(), 5);
}

// --- timestamps ---------------------------------------------------------------

#[tokio::test]
async fn timestamps_come_from_the_store_clock() {
    let clock = Arc::new(ManualClock::new(t0()));
    let store = MemoryStore::with_clock(clock.clone());
    let (first, second) = (key("c"), key("c"));

    let mut tx = store.begin().await.unwrap();
    assert_eq!(tx.claim(&first).await.unwrap(), Claim::Fresh);
    clock.advance(Duration::from_secs(5));
    assert_eq!(tx.claim(&second).await.unwrap(), Claim::Fresh);
    clock.advance(Duration::from_secs(5));
    tx.commit().await.unwrap();

    // The claim records both, at its own time, not at the commit's.
    let row = store.lookup(&first).await.unwrap().unwrap();
    assert_eq!(row.received_at, t0());
    assert_eq!(row.processed_at, Some(t0()));
    let row = store.lookup(&second).await.unwrap().unwrap();
    assert_eq!(row.received_at, t0() + TimeDelta::seconds(5));
    assert_eq!(row.processed_at, Some(t0() + TimeDelta::seconds(5)));
}

// --- cleanup -----------------------------------------------------------------

/// Commits one claim of a new key (processed, as every committed claim)
/// at the clock's current time.
async fn commit_row(store: &MemoryStore) -> InboxKey {
    let k = key("c");
    let (claim, tx) = claim(store, &k).await;
    assert_eq!(claim, Claim::Fresh);
    tx.commit().await.expect("commit");
    k
}

#[tokio::test]
async fn purge_deletes_only_old_processed_rows_in_bounded_batches() {
    let clock = Arc::new(ManualClock::new(t0()));
    let store = MemoryStore::with_clock(clock.clone());

    let mut old = Vec::new();
    for _ in 0..5 {
        old.push(commit_row(&store).await);
    }
    // Claimed (and so stamped processed) long ago, but never committed: not
    // a row yet.
    let in_flight = key("c");
    let (_, holder) = claim(&store, &in_flight).await;

    clock.advance(Duration::from_secs(3600));
    let recent = commit_row(&store).await;
    let cutoff = t0() + TimeDelta::seconds(60);

    assert_eq!(store.purge_processed_batch(cutoff, nz(2)).await.unwrap(), 2);
    assert_eq!(store.purge_processed_batch(cutoff, nz(2)).await.unwrap(), 2);
    assert_eq!(store.purge_processed_batch(cutoff, nz(2)).await.unwrap(), 1);
    assert_eq!(store.purge_processed_batch(cutoff, nz(2)).await.unwrap(), 0);

    for k in &old {
        assert_eq!(store.lookup(k).await.unwrap(), None);
    }
    assert!(store.lookup(&recent).await.unwrap().is_some());

    // The in-flight claim was untouched and still commits; only then is
    // it old enough to go.
    holder.commit().await.unwrap();
    assert_eq!(store.inbox_len(), 2);
    assert_eq!(
        store.purge_processed_before(cutoff, nz(10)).await.unwrap(),
        1
    );
    assert_eq!(store.lookup(&in_flight).await.unwrap(), None);

    // Purged keys are claimable again (retention is the dedup window).
    assert_eq!(claim(&store, &old[0]).await.0, Claim::Fresh);
}

#[tokio::test]
async fn purge_before_loops_batches_over_many_rows() {
    let clock = Arc::new(ManualClock::new(t0()));
    let store = MemoryStore::with_clock(clock.clone());
    for _ in 0..1_000 {
        commit_row(&store).await;
        clock.advance(Duration::from_millis(1));
    }
    let cutoff = t0() + TimeDelta::milliseconds(900);
    // One batch larger than a shard's chunk and than any shard.
    assert_eq!(
        store.purge_processed_batch(cutoff, nz(700)).await.unwrap(),
        700
    );
    assert_eq!(
        store.purge_processed_before(cutoff, nz(64)).await.unwrap(),
        200
    );
    assert_eq!(store.inbox_len(), 100);
    assert!(
        store
            .records()
            .iter()
            .all(|r| r.processed_at.is_some_and(|at| at >= cutoff))
    );
}

#[tokio::test]
async fn one_batch_empties_shards_holding_more_than_a_lock_chunk() {
    // About 310 rows a shard over 64 shards: more than one shard-lock chunk
    // (256 rows) each, so a batch must come back to a shard until it is
    // empty or the limit is reached.
    let clock = Arc::new(ManualClock::new(t0()));
    let store = MemoryStore::with_clock(clock.clone());
    for _ in 0..20_000 {
        commit_row(&store).await;
    }
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        store
            .purge_processed_batch(t0() + TimeDelta::seconds(1), nz(20_000))
            .await
            .unwrap(),
        20_000
    );
    assert_eq!(store.inbox_len(), 0);
}

// --- the middleware on this store ------------------------------------------

#[tokio::test]
async fn handle_runs_the_work_once_per_key() {
    let inbox = Inbox::new(MemoryStore::new());
    let k = key("notification");
    let runs = AtomicUsize::new(0);
    for delivery in 0..3 {
        let outcome = inbox
            .handle(&k, async |tx| {
                runs.fetch_add(1, Ordering::Relaxed);
                tx.put(format!("sent/{}", k.message_id), "email");
                Ok::<_, InboxError>(delivery)
            })
            .await
            .unwrap();
        let expected = if delivery == 0 {
            Handled::Processed(0)
        } else {
            Handled::Duplicate
        };
        assert_eq!(outcome, expected);
    }
    assert_eq!(runs.load(Ordering::Relaxed), 1);
    let row = inbox.store().lookup(&k).await.unwrap().unwrap();
    assert!(row.processed_at.is_some(), "handle marks the row processed");
}

#[tokio::test]
async fn a_failed_handler_rolls_back_and_the_redelivery_runs_again() {
    let inbox = Inbox::new(MemoryStore::new());
    let k = key("c");
    let err = inbox
        .handle(&k, async |tx| {
            tx.put("effect", "half");
            Err::<(), _>(InboxError::retryable_handler("downstream timeout"))
        })
        .await
        .unwrap_err();
    assert_eq!(err.disposition(), Disposition::Retry);
    assert_eq!(inbox.store().get("effect"), None);
    assert_eq!(inbox.store().inbox_len(), 0);

    let again = inbox
        .handle(&k, async |tx| {
            tx.put("effect", "whole");
            Ok::<_, InboxError>(())
        })
        .await
        .unwrap();
    assert_eq!(again, Handled::Processed(()));
    assert_eq!(inbox.store().get("effect"), Some(b"whole".to_vec()));
}

#[tokio::test]
async fn a_panicking_handler_leaves_no_trace() {
    let store = MemoryStore::new();
    let inbox = Arc::new(Inbox::new(store.clone()));
    let k = key("c");
    let crashed = {
        let (inbox, k) = (inbox.clone(), k.clone());
        tokio::spawn(async move {
            let explode = true;
            inbox
                .handle(&k, async |tx| {
                    tx.put("effect", "half");
                    if explode {
                        panic!("handler bug");
                    }
                    Ok::<_, InboxError>(())
                })
                .await
        })
        .await
    };
    assert!(crashed.unwrap_err().is_panic());
    assert_eq!(store.get("effect"), None);
    assert_eq!(store.inbox_len(), 0);
    assert_eq!(
        claim(&store, &k).await.0,
        Claim::Fresh,
        "claim was released"
    );
}

/// The Send story of `Inbox::handle` with a concrete store: the work
/// borrows data local to the spawned task and the transaction, and the
/// whole future is spawned on a multi-threaded runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handle_with_a_closure_borrowing_local_data_can_be_spawned() {
    let inbox = Arc::new(Inbox::new(MemoryStore::new()));
    let k = key("tracking");
    let task = {
        let (inbox, k) = (inbox.clone(), k.clone());
        tokio::spawn(async move {
            let parcel = String::from("P-1");
            let scans = vec![1_u8, 2, 3];
            inbox
                .handle(&k, async |tx| {
                    tx.put(format!("parcel/{parcel}"), scans.as_slice());
                    tokio::task::yield_now().await;
                    Ok::<_, InboxError>(parcel.len() + scans.len())
                })
                .await
        })
    };
    assert_eq!(task.await.unwrap().unwrap(), Handled::Processed(6));
    assert_eq!(inbox.store().get("parcel/P-1"), Some(vec![1, 2, 3]));
}

#[tokio::test]
async fn handle_works_through_an_arc_store() {
    let store = Arc::new(MemoryStore::new());
    let inbox = Inbox::new(store.clone());
    let k = key("c");
    let outcome = inbox
        .handle(&k, async |tx| {
            tx.put("via-arc", "1");
            Ok::<_, InboxError>(())
        })
        .await
        .unwrap();
    assert_eq!(outcome, Handled::Processed(()));
    assert_eq!(store.get("via-arc"), Some(b"1".to_vec()));
}

/// The message of the error beneath `err` (what a log line shows after the
/// kind).
fn source_text(err: &InboxError) -> String {
    std::error::Error::source(err)
        .map(ToString::to_string)
        .unwrap_or_default()
}
