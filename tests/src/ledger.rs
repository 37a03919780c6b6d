//! The attempt ledger's conformance suite: the same shape as the inbox's,
//! for every backend whose store is an [`inbox_api::AttemptLedger`].
//!
//! One deterministic test or more per line of the contract documented on
//! `AttemptLedger`: a failure's count survives the rollback of the
//! transaction it failed in, concurrent failures each count, the key is
//! per consumer, a dead mark is listed until the message is processed or
//! replayed, and cleanup is bounded. A backend implements
//! [`LedgerHarness`] beside its [`crate::Harness`] and calls
//! [`crate::ledger_conformance_tests!`] with one line.

use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::join_all;
use inbox_api::{
    AttemptLedger, AttemptLedgerExt, AttemptRecord, Claim, ConsumerName, InboxKey, InboxStore,
    InboxTransaction, LastError,
};

use crate::contract::{new_key, process_once};
use crate::{Failure, Harness, Outcome, check, check_eq};

/// What the ledger suite needs beyond [`Harness`]: a store that is a
/// ledger, and a way to let time pass for it.
#[async_trait]
pub trait LedgerHarness: Harness<Store: AttemptLedger> {
    /// Makes every ledger row `age` older (its timestamps move back, or the
    /// store's clock moves forward), so cleanup can be tested without
    /// waiting.
    async fn age_attempts(&self, store: &Self::Store, age: Duration);
}

/// Expands to one `#[test]` per ledger contract test, each building its
/// harness with `$setup` (an `async fn() -> impl LedgerHarness`) on its own
/// runtime.
#[macro_export]
macro_rules! ledger_conformance_tests {
    ($setup:path) => {
        $crate::__with_ledger_contract_tests!([tests $setup]);
    };
    (@tests $setup:path; $($name:ident),+ $(,)?) => {
        $crate::__contract_test_fns!(ledger; $setup; $($name),+);
    };
}

/// The one list of ledger contract tests.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_ledger_contract_tests {
    ([$($args:tt)*]) => {
        $crate::__ledger_contract_list! { [$($args)*]
            ledger_counts_each_failure,
            ledger_count_survives_the_failed_transaction,
            ledger_concurrent_failures_each_count,
            ledger_scope_is_per_consumer,
            ledger_dead_messages_are_listed_per_consumer,
            ledger_a_replayed_dead_message_starts_afresh,
            ledger_a_dead_message_processed_since_is_not_listed,
            ledger_keeps_the_error_text_cleaned_and_bounded,
            ledger_purge_deletes_old_rows_in_batches,
            ledger_a_shared_store_forwards_every_call,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __ledger_contract_list {
    ([tests $setup:path] $($name:ident),+ $(,)?) => {
        $crate::ledger_conformance_tests!(@tests $setup; $($name),+);
    };
    ([run $run:ident] $($name:ident),+ $(,)?) => {
        $run!($($name),+);
    };
}

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
}

fn error(text: &str) -> LastError {
    LastError::new(text)
}

/// The ledger row of `key`, which must exist.
async fn row<S: AttemptLedger>(store: &S, key: &InboxKey) -> Result<AttemptRecord, Failure> {
    store
        .attempts(key)
        .await?
        .ok_or_else(|| Failure::new(format!("no ledger row for {key}")))
}

/// The keys `dead_messages` lists, in its order.
async fn dead_keys<S: AttemptLedger>(
    store: &S,
    consumer: Option<&str>,
) -> Result<Vec<InboxKey>, Failure> {
    let consumer = consumer.map(|c| ConsumerName::new(c).expect("valid consumer"));
    Ok(store
        .dead_messages(consumer.as_ref(), nz(100))
        .await?
        .into_iter()
        .map(|r| r.key)
        .collect())
}

/// Each failure adds one, the row keeps the last error, and a key that
/// never failed has no row.
pub async fn ledger_counts_each_failure<H: LedgerHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("c1");
    check!(
        store.attempts(&key).await?.is_none(),
        "a key that never failed has a ledger row"
    );
    for n in 1..=3 {
        let counted = store
            .record_failure(&key, &error(&format!("failure {n}")))
            .await?;
        check_eq!(counted, n, "the count after failure {n}");
    }
    let record = row(&store, &key).await?;
    check_eq!(record.attempts, 3, "the stored count");
    check_eq!(record.last_error, "failure 3", "the last error");
    check!(
        record.first_failed_at <= record.last_failed_at,
        "first failure after the last: {record:?}"
    );
    check!(
        record.dead.is_none(),
        "a failing key is not dead: {record:?}"
    );
    check_eq!(record.key, key, "the row's key");
    Ok(())
}

/// Contract line 1: the failure is recorded after its transaction rolled
/// back (or was dropped), and the count survives that end; recording it
/// while the failed attempt still holds its claim does not wait for it.
pub async fn ledger_count_survives_the_failed_transaction<H: LedgerHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("c1");

    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "first claim of {key}");
    h.record_effect(&mut tx, &key).await?;
    let counted = tokio::time::timeout(
        Duration::from_secs(10),
        store.record_failure(&key, &error("work failed")),
    )
    .await
    .map_err(|_| Failure::new("recording a failure waited for the failed attempt's claim"))??;
    check_eq!(counted, 1, "the first failure's count");
    tx.rollback().await?;
    check_eq!(
        row(&store, &key).await?.attempts,
        1,
        "the count after its transaction rolled back"
    );

    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "second claim of {key}");
    drop(tx);
    check_eq!(
        store.record_failure(&key, &error("dropped")).await?,
        2,
        "the count after a dropped attempt"
    );
    // A transaction of someone else's commits meanwhile: nothing changes.
    process_once(h, &store, &new_key("c1")).await?;
    check_eq!(
        row(&store, &key).await?.attempts,
        2,
        "the count after another transaction committed"
    );
    Ok(())
}

/// Contract line 2: failures of one key at the same moment each count once
/// (an atomic increment, never a read followed by a write).
pub async fn ledger_concurrent_failures_each_count<H: LedgerHarness>(h: &H) -> Outcome {
    const N: u32 = 8;
    let store = h.fresh_store().await;
    let key = new_key("c1");
    let counts = join_all((0..N).map(|n| {
        let (store, key) = (store.clone(), key.clone());
        async move {
            store
                .record_failure(&key, &error(&format!("racer {n}")))
                .await
        }
    }))
    .await;
    let mut seen = BTreeSet::new();
    for count in counts {
        seen.insert(count?);
    }
    check_eq!(
        seen,
        (1..=N).collect::<BTreeSet<u32>>(),
        "the counts {N} concurrent failures answered"
    );
    check_eq!(row(&store, &key).await?.attempts, N, "the stored count");
    Ok(())
}

/// Contract line 3: one message failing for one consumer is not counted
/// for another.
pub async fn ledger_scope_is_per_consumer<H: LedgerHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let a = new_key("c1");
    let b = InboxKey::new(a.message_id, ConsumerName::new("c2").expect("valid"));
    store.record_failure(&a, &error("a")).await?;
    store.record_failure(&a, &error("a")).await?;
    check_eq!(
        store.record_failure(&b, &error("b")).await?,
        1,
        "the other consumer's first failure"
    );
    check_eq!(row(&store, &a).await?.attempts, 2, "c1's count");
    store
        .mark_dead(&a, "retries_exhausted", &error("a"))
        .await?;
    check!(
        row(&store, &b).await?.dead.is_none(),
        "c1's dead mark reached c2"
    );
    Ok(())
}

/// Dead rows are listed newest first with their count, reason and last
/// error, per consumer or all, at most `limit`; a key dead at its first
/// failure (a permanent error) counts that one.
pub async fn ledger_dead_messages_are_listed_per_consumer<H: LedgerHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let (old, new, other) = (new_key("c1"), new_key("c1"), new_key("c2"));
    let failing = new_key("c1");
    for _ in 0..3 {
        store.record_failure(&old, &error("timeout")).await?;
    }
    store
        .record_failure(&failing, &error("still failing"))
        .await?;
    store
        .mark_dead(&old, "retries_exhausted", &error("timeout"))
        .await?;
    store.record_failure(&other, &error("x")).await?;
    store
        .mark_dead(&other, "retries_exhausted", &error("x"))
        .await?;
    // Different dead times (the store clock may be coarse).
    h.age_attempts(&store, Duration::from_secs(1)).await;
    store.mark_dead(&new, "store", &error("permanent")).await?;

    check_eq!(
        dead_keys(&store, Some("c1")).await?,
        vec![new.clone(), old.clone()],
        "c1's dead messages, newest first"
    );
    check_eq!(
        dead_keys(&store, Some("c2")).await?,
        vec![other.clone()],
        "c2's dead messages"
    );
    let all: BTreeSet<InboxKey> = dead_keys(&store, None).await?.into_iter().collect();
    check_eq!(
        all,
        BTreeSet::from([old.clone(), new.clone(), other]),
        "every consumer's dead messages"
    );
    check_eq!(
        store.dead_messages(None, nz(1)).await?.len(),
        1,
        "a listing limited to 1"
    );
    let listed = store.dead_messages(None, nz(10)).await?;
    let first = listed
        .iter()
        .find(|r| r.key == old)
        .ok_or_else(|| Failure::new("the old dead key is not listed"))?;
    check_eq!(first.attempts, 3, "the dead key's count");
    check_eq!(first.last_error, "timeout", "the dead key's last error");
    check_eq!(
        first.dead.as_ref().map(|d| d.reason.as_str()),
        Some("retries_exhausted"),
        "the dead key's reason"
    );
    let permanent = row(&store, &new).await?;
    check_eq!(permanent.attempts, 1, "a key dead at its first failure");
    check_eq!(permanent.last_error, "permanent", "its error");
    Ok(())
}

/// Contract line 4: a replayed dead message fails afresh: its next failure
/// counts one, and it is not dead any more.
pub async fn ledger_a_replayed_dead_message_starts_afresh<H: LedgerHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("c1");
    for _ in 0..3 {
        store.record_failure(&key, &error("before the fix")).await?;
    }
    store
        .mark_dead(&key, "retries_exhausted", &error("before the fix"))
        .await?;
    check_eq!(
        row(&store, &key).await?.attempts,
        3,
        "a dead mark keeps the count"
    );
    check_eq!(
        store.record_failure(&key, &error("after replay")).await?,
        1,
        "the first failure after the replay"
    );
    let record = row(&store, &key).await?;
    check!(
        record.dead.is_none(),
        "still dead after a replay: {record:?}"
    );
    check!(
        dead_keys(&store, None).await?.is_empty(),
        "a replayed message is listed dead"
    );
    Ok(())
}

/// A dead message replayed and processed is not dead any more, though its
/// row stays (a success clears nothing).
pub async fn ledger_a_dead_message_processed_since_is_not_listed<H: LedgerHarness>(
    h: &H,
) -> Outcome {
    let store = h.fresh_store().await;
    let (processed, still_dead) = (new_key("c1"), new_key("c1"));
    for key in [&processed, &still_dead] {
        store.record_failure(key, &error("boom")).await?;
        store
            .mark_dead(key, "retries_exhausted", &error("boom"))
            .await?;
    }
    process_once(h, &store, &processed).await?;
    check_eq!(
        dead_keys(&store, Some("c1")).await?,
        vec![still_dead],
        "dead messages after one was processed"
    );
    check!(
        store.attempts(&processed).await?.is_some(),
        "the processed message's row is gone: success must not cost a write"
    );
    Ok(())
}

/// The error text round-trips as [`LastError`] made it: control characters
/// (NUL, which PostgreSQL's text refuses) replaced, length bounded.
pub async fn ledger_keeps_the_error_text_cleaned_and_bounded<H: LedgerHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("c1");
    let odd = LastError::new(&format!("nul\0tab\tnewline\n{}", "é".repeat(3000)));
    store.record_failure(&key, &odd).await?;
    let record = row(&store, &key).await?;
    check_eq!(record.last_error, odd.as_str(), "the stored error");
    check!(
        record.last_error.len() <= LastError::MAX_LEN,
        "stored error of {} bytes",
        record.last_error.len()
    );
    Ok(())
}

/// Contract line 5: cleanup deletes rows whose last failure is older than
/// the cutoff, dead or not, in batches, and keeps newer ones.
pub async fn ledger_purge_deletes_old_rows_in_batches<H: LedgerHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let old: Vec<InboxKey> = (0..3).map(|_| new_key("c1")).collect();
    for key in &old {
        store.record_failure(key, &error("old")).await?;
    }
    store
        .mark_dead(&old[0], "retries_exhausted", &error("old"))
        .await?;
    h.age_attempts(&store, Duration::from_secs(10 * 24 * 3600))
        .await;
    let recent = new_key("c1");
    store.record_failure(&recent, &error("recent")).await?;

    let cutoff = h.store_now(&store).await - chrono::Duration::days(7);
    let first = store.purge_attempts_batch(cutoff, nz(2)).await?;
    check_eq!(first, 2, "first batch of 2");
    let rest = store.purge_attempts_before(cutoff, nz(2)).await?;
    check_eq!(rest, 1, "the remaining old row");
    check_eq!(
        store.purge_attempts_before(cutoff, nz(2)).await?,
        0,
        "nothing left to purge"
    );
    for key in &old {
        check!(
            store.attempts(key).await?.is_none(),
            "old row of {key} left"
        );
    }
    check_eq!(row(&store, &recent).await?.attempts, 1, "the recent row");
    Ok(())
}

/// A shared store (`Arc<S>`) is the ledger: every call reaches it.
pub async fn ledger_a_shared_store_forwards_every_call<H: LedgerHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let shared = Arc::new(store.clone());
    let key = new_key("c1");
    // Twice, so that an answer of 1 that forwards nothing shows.
    for expected in [1, 2] {
        check_eq!(
            shared.record_failure(&key, &error("e")).await?,
            expected,
            "record through the Arc"
        );
    }
    shared
        .mark_dead(&key, "retries_exhausted", &error("e"))
        .await?;
    check!(
        row(&store, &key).await?.dead.is_some(),
        "mark through the Arc"
    );
    check_eq!(
        shared.attempts(&key).await?.map(|r| r.attempts),
        Some(2),
        "read through the Arc"
    );
    check_eq!(
        shared.dead_messages(None, nz(10)).await?.len(),
        1,
        "list through the Arc"
    );
    h.age_attempts(&store, Duration::from_secs(3600)).await;
    let cutoff = h.store_now(&store).await;
    check_eq!(
        shared.purge_attempts_batch(cutoff, nz(10)).await?,
        1,
        "purge through the Arc"
    );
    check_eq!(
        store.attempts(&key).await?,
        None,
        "the purge deleted the row underneath"
    );
    Ok(())
}

/// Runs every ledger contract test against `h` and returns the failures by
/// name.
pub async fn run_all<H: LedgerHarness>(h: &H) -> Vec<(&'static str, Failure)> {
    let mut failures = Vec::new();
    macro_rules! run {
        ($($name:ident),+ $(,)?) => {$(
            if let Err(failure) = $name(h).await {
                failures.push((stringify!($name), failure));
            }
        )+};
    }
    crate::__with_ledger_contract_tests!([run run]);
    failures
}
