//! The kept-response suite: the same shape as the inbox's, for every
//! backend whose store is an [`inbox_api::ResponseStore`].
//!
//! One deterministic test or more per line of the contract documented on
//! `ResponseStore`: a response kept in a transaction is read back after
//! its commit and never before it nor after a rollback (a savepoint's
//! rollback included), only a key the transaction holds takes one, a
//! repeat that waited for the holder reads it, and cleanup deletes it with
//! its row. A backend calls [`crate::response_conformance_tests!`] with its
//! [`crate::Harness`] setup.

use std::sync::Arc;
use std::time::Duration;

use inbox_api::{
    BatchTransaction, Claim, InboxError, InboxKey, InboxStore, InboxStoreExt, InboxTransaction,
    ResponseStore, ResponseTransaction,
};

use crate::contract::new_key;
use crate::{Failure, Harness, Outcome, check, check_eq};

/// A store the suite can run on: a [`Harness`] store that keeps responses.
pub trait ResponseHarness:
    Harness<Store: ResponseStore<Transaction: ResponseTransaction + BatchTransaction>>
{
}

impl<H> ResponseHarness for H where
    H: Harness<Store: ResponseStore<Transaction: ResponseTransaction + BatchTransaction>>
{
}

/// Expands to one `#[test]` per kept-response contract test, each building
/// its harness with `$setup` (an `async fn() -> impl Harness` whose store
/// is a `ResponseStore`) on its own runtime.
#[macro_export]
macro_rules! response_conformance_tests {
    ($setup:path) => {
        $crate::__with_response_contract_tests!([tests $setup]);
    };
    (@tests $setup:path; $($name:ident),+ $(,)?) => {
        $crate::__contract_test_fns!(response; $setup; $($name),+);
    };
}

/// The one list of kept-response contract tests.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_response_contract_tests {
    ([$($args:tt)*]) => {
        $crate::__response_contract_list! { [$($args)*]
            response_is_read_back_after_commit_only,
            response_vanishes_with_a_rollback,
            response_is_refused_for_a_key_not_held,
            response_kept_in_a_rolled_back_savepoint_is_undone,
            response_is_read_by_a_repeat_that_waited,
            response_is_purged_with_its_row,
            response_a_shared_store_forwards,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __response_contract_list {
    ([tests $setup:path] $($name:ident),+ $(,)?) => {
        $crate::response_conformance_tests!(@tests $setup; $($name),+);
    };
    ([run $run:ident] $($name:ident),+ $(,)?) => {
        $run!($($name),+);
    };
}

/// Contract line 1: the keep is part of the transaction. Before COMMIT no
/// reader sees it (and reading does not wait for the holder); the last
/// keep of the transaction is what commits.
pub async fn response_is_read_back_after_commit_only<H: ResponseHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("http");
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "first claim of {key}");
    h.record_effect(&mut tx, &key).await?;
    tx.keep_response(&key, b"draft").await?;
    tx.keep_response(&key, b"201 created").await?;
    let read = tokio::time::timeout(Duration::from_secs(5), store.kept_response(&key)).await;
    check!(
        matches!(read, Ok(Ok(None))),
        "before COMMIT the response must be invisible and reading must not wait: {read:?}"
    );
    tx.commit().await?;
    check_eq!(
        store.kept_response(&key).await?,
        Some(b"201 created".to_vec()),
        "the committed response"
    );
    Ok(())
}

/// Contract lines 1 and 3: a rolled-back keep leaves nothing; a later
/// claim that keeps no response reads back `None`.
pub async fn response_vanishes_with_a_rollback<H: ResponseHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("http");
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "first claim of {key}");
    tx.keep_response(&key, b"500 failed").await?;
    tx.rollback().await?;
    check_eq!(
        store.kept_response(&key).await?,
        None,
        "the response of a rolled-back transaction"
    );
    let mut tx = store.begin().await?;
    check_eq!(
        tx.claim(&key).await?,
        Claim::Fresh,
        "the claim after the rollback"
    );
    tx.commit().await?;
    check_eq!(
        store.kept_response(&key).await?,
        None,
        "a claim that kept no response"
    );
    Ok(())
}

/// Only a key this transaction holds takes a response: never one it did
/// not claim, and never another transaction's committed row.
pub async fn response_is_refused_for_a_key_not_held<H: ResponseHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("http");
    let mut tx = store.begin().await?;
    let unclaimed = tx.keep_response(&key, b"nobody's").await;
    check!(
        matches!(unclaimed, Err(InboxError::InvalidArgument { .. })),
        "keeping a response for a key never claimed: {unclaimed:?}"
    );
    tx.rollback().await?;

    let mut first = store.begin().await?;
    check_eq!(
        first.claim(&key).await?,
        Claim::Fresh,
        "first claim of {key}"
    );
    first.keep_response(&key, b"first").await?;
    first.commit().await?;
    let mut repeat = store.begin().await?;
    check_eq!(
        repeat.claim(&key).await?,
        Claim::Duplicate,
        "the repeat's claim"
    );
    let overwrite = repeat.keep_response(&key, b"second").await;
    check!(
        matches!(overwrite, Err(InboxError::InvalidArgument { .. })),
        "keeping a response on another transaction's row: {overwrite:?}"
    );
    // A store may have aborted the transaction on the refusal; either end
    // leaves the row alone.
    let _ = repeat.commit().await;
    check_eq!(
        store.kept_response(&key).await?,
        Some(b"first".to_vec()),
        "the first transaction's response"
    );
    Ok(())
}

/// Contract line 1, inside a transaction: rolling back to a savepoint
/// undoes a keep made after it, and keeps the one made before.
pub async fn response_kept_in_a_rolled_back_savepoint_is_undone<H: ResponseHarness>(
    h: &H,
) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("http");
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "first claim of {key}");
    tx.keep_response(&key, b"before").await?;
    tx.savepoint().await?;
    tx.keep_response(&key, b"after").await?;
    tx.rollback_to_savepoint().await?;
    tx.commit().await?;
    check_eq!(
        store.kept_response(&key).await?,
        Some(b"before".to_vec()),
        "the response kept before the savepoint"
    );
    Ok(())
}

/// The idempotent request's path: a repeat's claim waits while the first
/// request's transaction holds the key, answers `Duplicate` once it
/// commits, and the response it then reads is the committed one.
pub async fn response_is_read_by_a_repeat_that_waited<H: ResponseHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key = new_key("http");
    let mut first = store.begin().await?;
    check_eq!(
        first.claim(&key).await?,
        Claim::Fresh,
        "first claim of {key}"
    );
    let repeat = async {
        let mut tx = store.begin().await?;
        let claim = tx.claim(&key).await?;
        tx.rollback().await?;
        Ok::<_, InboxError>((claim, store.kept_response(&key).await?))
    };
    let holder = async {
        // Long enough for the repeat's claim to be waiting on the key.
        tokio::time::sleep(Duration::from_millis(100)).await;
        first.keep_response(&key, b"201 created").await?;
        first.commit().await
    };
    let (repeated, held) = tokio::join!(repeat, holder);
    held?;
    let (claim, response) = repeated?;
    check_eq!(claim, Claim::Duplicate, "the repeat's claim");
    check_eq!(
        response,
        Some(b"201 created".to_vec()),
        "the response the repeat reads"
    );
    Ok(())
}

/// Contract line 2: cleanup deletes the response with its row. The old
/// key's id is not time-ordered, as an idempotency key's never is
/// (`MessageId::from_key` gives a UUID v5): row cleanup purges it on every
/// layout (the partitioned one drops whole days of time-ordered ids).
pub async fn response_is_purged_with_its_row<H: ResponseHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let old = InboxKey::new(
        inbox_api::MessageId::from_key("order-42")?,
        inbox_api::ConsumerName::new("http")?,
    );
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&old).await?, Claim::Fresh, "claim of {old}");
    tx.keep_response(&old, b"old").await?;
    tx.commit().await?;
    h.age_rows(&store, Duration::from_secs(10 * 24 * 3600))
        .await;
    let recent = new_key("http");
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&recent).await?, Claim::Fresh, "claim of {recent}");
    tx.keep_response(&recent, b"recent").await?;
    tx.commit().await?;

    let cutoff = h.store_now(&store).await - chrono::Duration::days(7);
    let limit = std::num::NonZeroU32::new(100).unwrap_or(std::num::NonZeroU32::MIN);
    let purged = store.purge_processed_before(cutoff, limit).await?;
    check_eq!(purged, 1, "rows purged");
    check_eq!(
        store.kept_response(&old).await?,
        None,
        "the purged row's response"
    );
    check_eq!(
        store.kept_response(&recent).await?,
        Some(b"recent".to_vec()),
        "the recent row's response"
    );
    Ok(())
}

/// A shared store (`Arc<S>`) reads what the store underneath kept.
pub async fn response_a_shared_store_forwards<H: ResponseHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let key: InboxKey = new_key("http");
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "claim of {key}");
    tx.keep_response(&key, b"shared").await?;
    tx.commit().await?;
    let shared = Arc::new(store.clone());
    check_eq!(
        shared.kept_response(&key).await?,
        Some(b"shared".to_vec()),
        "the response read through the Arc"
    );
    Ok(())
}

/// Runs every kept-response contract test against `h` and returns the
/// failures by name.
pub async fn run_all<H: ResponseHarness>(h: &H) -> Vec<(&'static str, Failure)> {
    let mut failures = Vec::new();
    macro_rules! run {
        ($($name:ident),+ $(,)?) => {$(
            if let Err(failure) = $name(h).await {
                failures.push((stringify!($name), failure));
            }
        )+};
    }
    crate::__with_response_contract_tests!([run run]);
    failures
}
