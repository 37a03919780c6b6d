//! The app's cleanup, as `cleanup` and the service's background task run it:
//! dashboards sum `inbox_purged_rows_total`, so one purge of N rows must add
//! exactly N (the store's purge counts its batches; the app must not count
//! them again). Needs no service: the in-process store.

use std::num::NonZeroU32;
use std::time::Duration;

use consumer_app::runtime::CleanupConfig;
use consumer_app::runtime::service::cleanup_once;
use inbox_api::{ConsumerName, Handled, Inbox, InboxError, InboxKey, MessageId};
use inbox_backend_memory::MemoryStore;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

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
    let purged: Vec<u64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == inbox_api::metrics::PURGED_ROWS)
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => n,
            other => panic!(
                "{} is not a counter: {other:?}",
                inbox_api::metrics::PURGED_ROWS
            ),
        })
        .collect();
    assert_eq!(purged, [5], "one series, counting each purged row once");
}
