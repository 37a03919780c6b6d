//! What the middleware records, asserted value by value through a
//! debugging recorder: dashboards and alerts read these numbers, so a
//! counter that counts twice (or never) is a bug like any other.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

use chrono::TimeDelta;
use inbox_api::{
    ConsumerName, Handled, Inbox, InboxError, InboxKey, InboxStoreExt, InboxTransaction, MessageId,
};
use inbox_backend_memory::MemoryStore;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio_sync as tokio;

fn key(consumer: &str) -> InboxKey {
    InboxKey::new(
        MessageId::new_v7(),
        ConsumerName::new(consumer).expect("valid"),
    )
}

/// Every series as `name{label=value,…}` (labels sorted) → its value:
/// counters and gauges as numbers, histograms as their sample count.
fn series(snapshotter: &Snapshotter) -> BTreeMap<String, f64> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let mut labels: Vec<String> = key
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            let name = format!("{}{{{}}}", key.key().name(), labels.join(","));
            let value = match value {
                DebugValue::Counter(n) => n as f64,
                DebugValue::Gauge(g) => g.into_inner(),
                DebugValue::Histogram(samples) => samples.len() as f64,
            };
            (name, value)
        })
        .collect()
}

fn expect(found: &BTreeMap<String, f64>, expected: &[(&str, f64)]) {
    let expected: BTreeMap<String, f64> = expected
        .iter()
        .map(|(k, v)| ((*k).to_owned(), *v))
        .collect();
    assert_eq!(*found, expected);
}

#[tokio::test]
async fn handle_counts_each_outcome_once() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let inbox = Inbox::new(MemoryStore::new());
    let k = key("carrier");

    let first = inbox.handle(&k, async |_| Ok::<_, InboxError>(())).await;
    assert!(matches!(first, Ok(Handled::Processed(()))));
    assert!(!first.as_ref().is_ok_and(Handled::is_duplicate));
    let again = inbox.handle(&k, async |_| Ok::<_, InboxError>(())).await;
    assert!(again.as_ref().is_ok_and(Handled::is_duplicate), "{again:?}");
    let failing = key("carrier");
    let failed = inbox
        .handle(&failing, async |_| {
            Err::<(), _>(InboxError::retryable_handler("carrier API down"))
        })
        .await;
    assert!(failed.is_err());

    expect(
        &series(&snapshotter),
        &[
            ("inbox_duplicates_discarded_total{consumer=carrier}", 1.0),
            (
                "inbox_failed_total{consumer=carrier,retryable=unknown,stage=work}",
                1.0,
            ),
            (
                "inbox_handle_duration_seconds{consumer=carrier,outcome=duplicate}",
                1.0,
            ),
            (
                "inbox_handle_duration_seconds{consumer=carrier,outcome=failed}",
                1.0,
            ),
            (
                "inbox_handle_duration_seconds{consumer=carrier,outcome=processed}",
                1.0,
            ),
            ("inbox_processed_total{consumer=carrier}", 1.0),
        ],
    );
}

/// One batch: a fresh message, one processed before, one whose work fails,
/// and a copy of the fresh one. The failure makes the batch rerun once
/// with savepoints; each message is counted once, by its own outcome.
#[tokio::test]
async fn handle_batch_counts_each_message_once_and_the_rerun() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let store = MemoryStore::new();
    let inbox = Inbox::new(store.clone());
    let done = key("notification");
    let mut tx = inbox_api::InboxStore::begin(&store).await.expect("begin");
    assert_eq!(
        tx.claim(&done).await.expect("claim"),
        inbox_api::Claim::Fresh
    );
    tx.commit().await.expect("commit");

    let (fresh, failing) = (key("notification"), key("notification"));
    let batch = vec![
        (fresh.clone(), false),
        (done.clone(), false),
        (failing.clone(), true),
        (fresh.clone(), false),
    ];
    let outcomes = inbox
        .handle_batch(batch, async |_, &fails: &bool| {
            if fails {
                return Err(InboxError::retryable_handler("downstream down"));
            }
            Ok(())
        })
        .await;
    let kinds: Vec<String> = outcomes
        .iter()
        .map(|(_, _, outcome)| match outcome {
            Ok(handled) => format!("{handled:?}"),
            Err(error) => error.kind().to_owned(),
        })
        .collect();
    assert_eq!(
        kinds,
        ["Processed(())", "Duplicate", "handler", "Duplicate"]
    );

    expect(
        &series(&snapshotter),
        &[
            ("inbox_batch_reruns_total{}", 1.0),
            (
                "inbox_duplicates_discarded_total{consumer=notification}",
                2.0,
            ),
            (
                "inbox_failed_total{consumer=notification,retryable=unknown,stage=work}",
                1.0,
            ),
            (
                "inbox_handle_duration_seconds{consumer=notification,outcome=duplicate}",
                2.0,
            ),
            (
                "inbox_handle_duration_seconds{consumer=notification,outcome=failed}",
                1.0,
            ),
            (
                "inbox_handle_duration_seconds{consumer=notification,outcome=processed}",
                1.0,
            ),
            ("inbox_processed_total{consumer=notification}", 1.0),
        ],
    );
}

#[tokio::test]
async fn a_clean_batch_never_reruns() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let inbox = Inbox::new(MemoryStore::new());
    let batch = vec![(key("c"), ()), (key("c"), ())];
    let outcomes = inbox
        .handle_batch(batch, async |_, ()| Ok::<_, InboxError>(()))
        .await;
    assert!(outcomes.iter().all(|(_, _, o)| o.is_ok()));
    let found = series(&snapshotter);
    assert_eq!(found.get("inbox_batch_reruns_total{}"), None, "{found:?}");
    assert_eq!(found.get("inbox_processed_total{consumer=c}"), Some(&2.0));
}

#[tokio::test]
async fn purge_counts_every_deleted_row_once() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let store = MemoryStore::new();
    let inbox = Inbox::new(store.clone());
    for _ in 0..5 {
        let k = key("c");
        let handled = inbox.handle(&k, async |_| Ok::<_, InboxError>(())).await;
        assert!(matches!(handled, Ok(Handled::Processed(()))));
    }
    let cutoff = chrono::Utc::now() + TimeDelta::days(1);
    let two = NonZeroU32::new(2).expect("non-zero");
    assert_eq!(
        store
            .purge_processed_before(cutoff, two)
            .await
            .expect("purge"),
        5
    );
    let found = series(&snapshotter);
    assert_eq!(
        found.get("inbox_purged_rows_total{}"),
        Some(&5.0),
        "{found:?}"
    );
}

/// The outbox's conveniences: the purge counts every row it deleted, batch
/// by batch, and the pending gauge shows the backlog.
#[tokio::test]
async fn outbox_purge_and_pending_are_recorded() {
    use inbox_api::{OutboxStore, OutboxStoreExt, OutboxTransaction, OutgoingMessage};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let clock = std::sync::Arc::new(inbox_backend_memory::ManualClock::new(chrono::Utc::now()));
    let store = MemoryStore::with_clock(clock.clone());
    let mut tx = inbox_api::InboxStore::begin(&store).await.expect("begin");
    for _ in 0..7 {
        let message =
            OutgoingMessage::new(MessageId::new_v7(), "parcels", "k", "T", b"{}".to_vec())
                .expect("valid");
        let _ = tx.enqueue(&message).await.expect("enqueue");
    }
    tx.commit().await.expect("commit");
    let nz = |n| NonZeroU32::new(n).expect("non-zero");
    assert_eq!(store.record_pending().await.expect("pending"), 7);
    let lease = store
        .take_pending(nz(5), std::time::Duration::from_secs(30))
        .await
        .expect("take");
    assert_eq!(store.mark_published(&lease.ids()).await.expect("mark"), 5);
    clock.advance(std::time::Duration::from_secs(60));
    let purged = store
        .purge_published_before(clock_now(&clock), nz(2))
        .await
        .expect("purge");
    assert_eq!(purged, 5);
    assert_eq!(store.record_pending().await.expect("pending"), 2);
    expect(
        &series(&snapshotter),
        &[
            ("outbox_pending_messages{}", 2.0),
            ("outbox_purged_rows_total{}", 5.0),
        ],
    );
}

fn clock_now(clock: &inbox_backend_memory::ManualClock) -> chrono::DateTime<chrono::Utc> {
    inbox_backend_memory::Clock::now(clock)
}
