//! The app's cleanup, as `cleanup` and the service's background task run it:
//! dashboards sum `inbox_purged_rows_total`, so one purge of N rows must add
//! exactly N (the store's purge counts its batches; the app must not count
//! them again), and the attempt ledger is cleaned with the inbox. Needs no
//! service: the in-process store.

use std::num::NonZeroU32;
use std::time::Duration;

use consumer_app::runtime::CleanupConfig;
use consumer_app::runtime::service::cleanup_once;
use inbox_api::{ConsumerName, Handled, Inbox, InboxError, InboxKey, MessageId};
use inbox_backend_memory::MemoryStore;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// The values of every series of the counter `name`.
fn counter_values(snapshotter: &metrics_util::debugging::Snapshotter, name: &str) -> Vec<u64> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == name)
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => n,
            other => panic!("{name} is not a counter: {other:?}"),
        })
        .collect()
}

#[tokio::test]
async fn one_cleanup_of_n_rows_adds_exactly_n_to_the_purged_counter() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let store = MemoryStore::new();
    let inbox = Inbox::new(store.clone());
    let consumer = ConsumerName::new("carrier").expect("valid name");
    for _ in 0..5 {
        let key = InboxKey::new(MessageId::new_v7(), consumer.clone());
        let handled = inbox.handle(&key, async |_| Ok::<_, InboxError>(())).await;
        assert!(matches!(handled, Ok(Handled::Processed(()))), "{handled:?}");
    }
    // Past the processed_at of every row, so that all five go.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let config = CleanupConfig {
        retention: Duration::ZERO,
        interval: Duration::from_secs(3600),
        // Three batches (2, 2, 1): a per-batch count and a total both show.
        batch_size: NonZeroU32::new(2).expect("non-zero"),
    };

    let deleted = cleanup_once(&store, &config).await.expect("cleanup");

    assert_eq!(deleted, 5);
    let purged = counter_values(&snapshotter, inbox_api::metrics::PURGED_ROWS);
    assert_eq!(purged, [5], "one series, counting each purged row once");
}

/// Cleanup takes the attempt ledger's rows along: a row whose last failure
/// is older than the retention goes (dead or not), a newer one stays, and
/// `inbox_attempts_purged_rows_total` counts what went.
#[tokio::test]
async fn cleanup_purges_old_attempt_ledger_rows_and_keeps_new_ones() {
    use inbox_api::{AttemptLedger, LastError};
    use inbox_backend_memory::ManualClock;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    // The store's clock sits two days back, so its rows are two days old
    // by the cleanup's wall clock.
    let clock = std::sync::Arc::new(ManualClock::new(
        chrono::Utc::now() - chrono::Duration::days(2),
    ));
    let store = MemoryStore::with_clock(clock.clone());
    let consumer = ConsumerName::new("carrier").expect("valid name");
    let old: Vec<InboxKey> = (0..3)
        .map(|_| InboxKey::new(MessageId::new_v7(), consumer.clone()))
        .collect();
    for key in &old {
        store
            .record_failure(key, &LastError::new("carrier down"))
            .await
            .expect("record");
    }
    store
        .mark_dead(
            &old[0],
            "retries_exhausted",
            &LastError::new("carrier down"),
        )
        .await
        .expect("mark dead");
    clock.set(chrono::Utc::now());
    let recent = InboxKey::new(MessageId::new_v7(), consumer);
    store
        .record_failure(&recent, &LastError::new("carrier down"))
        .await
        .expect("record");
    let config = CleanupConfig {
        retention: Duration::from_secs(24 * 3600),
        interval: Duration::from_secs(3600),
        batch_size: NonZeroU32::new(2).expect("non-zero"),
    };

    cleanup_once(&store, &config).await.expect("cleanup");

    for key in &old {
        assert_eq!(store.attempts(key).await.expect("ledger"), None, "{key}");
    }
    assert_eq!(
        store
            .attempts(&recent)
            .await
            .expect("ledger")
            .map(|r| r.attempts),
        Some(1)
    );
    let purged = counter_values(&snapshotter, inbox_api::metrics::ATTEMPTS_PURGED_ROWS);
    assert_eq!(purged, [3]);
}
