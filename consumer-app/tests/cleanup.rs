//! The app's cleanup, as `cleanup` and the service's background task run it:
//! dashboards sum `inbox_purged_rows_total`, so one purge of N rows must add
//! exactly N (the store's purge counts its batches; the app must not count
//! them again), on the in-process store, and the attempt ledger is cleaned
//! with the inbox. On PostgreSQL, the `cleanup` subcommand and the
//! service's cleanup loop delete the rows older than the retention and keep
//! the newer ones, and two of them at once neither fail nor wait for each
//! other (`bash .ci/services.sh`).

use std::num::NonZeroU32;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use consumer_app::parcel::downstream::{Downstreams, StubCarrier, StubNotifier};
use consumer_app::parcel::service::spawn;
use consumer_app::parcel::store::ParcelStore;
use consumer_app::parcel::topology::Topology;
use futures::StreamExt;
use inbox_api::{
    ConsumerName, Handled, Inbox, InboxError, InboxKey, InboxStats, InboxStore, MessageId,
};
use inbox_backend_memory::MemoryStore;
use inbox_backend_sqlx::SqlxStore;
use inbox_runtime::service::cleanup_once;
use inbox_runtime::{CleanupConfig, ServiceConfig};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

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
        ..CleanupConfig::default()
    };

    let deleted = cleanup_once(&store, &config).await.expect("cleanup");

    assert_eq!(deleted, 5);
    let purged = counter_values(&snapshotter, inbox_api::metrics::PURGED_ROWS);
    assert_eq!(purged, [5], "one series, counting each purged row once");
}

/// A migrated schema of the test's own.
async fn postgres_store() -> (SqlxStore, String) {
    let id = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    let schema = format!("app_test_{id}");
    let store = SqlxStore::connect(&database_url(), &schema)
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate_all().await.expect("migrate");
    (store, schema)
}

/// `n` messages processed by the consumer `cleanup-test`, eight at a time.
async fn processed(store: &SqlxStore, n: usize) -> Vec<InboxKey> {
    let inbox = Inbox::new(store.clone());
    let consumer = ConsumerName::new("cleanup-test").expect("valid name");
    let keys: Vec<InboxKey> = (0..n)
        .map(|_| InboxKey::new(MessageId::new_v7(), consumer.clone()))
        .collect();
    futures::stream::iter(&keys)
        .for_each_concurrent(8, |key| {
            let inbox = &inbox;
            async move {
                let handled = inbox.handle(key, async |_| Ok::<_, InboxError>(())).await;
                assert!(matches!(handled, Ok(Handled::Processed(()))), "{handled:?}");
            }
        })
        .await;
    keys
}

/// Moves every row's timestamps ten days back: past a week's retention.
async fn age_every_row(store: &SqlxStore) {
    sqlx::query(
        "UPDATE inbox_messages SET received_at = received_at - interval '10 days', \
         processed_at = processed_at - interval '10 days'",
    )
    .execute(store.pool())
    .await
    .expect("age rows");
}

async fn rows(store: &SqlxStore) -> u64 {
    let counts = store.processed_counts().await.expect("count");
    counts.values().sum()
}

/// Asserts that none of `old` and all of `new` are still there.
async fn only_the_newer_rows_remain(store: &SqlxStore, old: &[InboxKey], new: &[InboxKey]) {
    assert_eq!(rows(store).await, new.len() as u64);
    for key in old.iter().take(20) {
        assert!(
            store.lookup(key).await.expect("lookup").is_none(),
            "{key:?} kept"
        );
    }
    for key in new {
        assert!(
            store.lookup(key).await.expect("lookup").is_some(),
            "{key:?} gone"
        );
    }
}

/// Starts `parcel-inbox cleanup` (a week's retention, batches of `batch`)
/// on `schema`.
fn cleanup_command(schema: &str, batch: u32) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
        .args(["--store", "sqlx", "--database-url", &database_url()])
        .args(["--schema", schema, "cleanup", "--retention-days", "7"])
        .args(["--cleanup-batch", &batch.to_string()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start parcel-inbox cleanup")
}

/// Waits for `child` at most `limit` (killing it and failing otherwise);
/// asserts it succeeded and returns how many rows it says it deleted.
fn deleted_by(mut child: std::process::Child, limit: Duration) -> u64 {
    let started = Instant::now();
    while child.try_wait().expect("poll").is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let output = child.wait_with_output().expect("output");
            panic!(
                "cleanup still running after {limit:?}:\n{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().expect("output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "cleanup failed:\n{text}");
    text.split_whitespace()
        .skip_while(|word| *word != "deleted")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cleanup_command_deletes_what_is_past_the_retention_and_keeps_the_rest() {
    let (store, schema) = postgres_store().await;
    let old = processed(&store, 30).await;
    age_every_row(&store).await;
    let new = processed(&store, 10).await;

    let child = cleanup_command(&schema, 7);
    let deleted = tokio::task::spawn_blocking(move || deleted_by(child, Duration::from_secs(60)))
        .await
        .expect("wait");

    assert_eq!(deleted, 30, "five batches of 7 and one of 2, counted once");
    only_the_newer_rows_remain(&store, &old, &new).await;
    store.drop_schema().await.expect("drop schema");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_cleanup_commands_at_once_share_the_rows_without_failing() {
    let (store, schema) = postgres_store().await;
    let old = processed(&store, 2000).await;
    age_every_row(&store).await;
    let new = processed(&store, 10).await;

    // Small batches, so that the two runs overlap for many rounds.
    let (a, b) = (cleanup_command(&schema, 20), cleanup_command(&schema, 20));
    let limit = Duration::from_secs(60);
    let (a, b) = tokio::join!(
        tokio::task::spawn_blocking(move || deleted_by(a, limit)),
        tokio::task::spawn_blocking(move || deleted_by(b, limit)),
    );
    let (a, b) = (a.expect("wait"), b.expect("wait"));

    assert_eq!(a + b, 2000, "each row deleted once: {a} + {b}");
    only_the_newer_rows_remain(&store, &old, &new).await;
    store.drop_schema().await.expect("drop schema");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_cleanup_loops_of_two_instances_delete_the_old_rows_only() {
    let (store, schema) = postgres_store().await;
    let old = processed(&store, 300).await;
    age_every_row(&store).await;
    let new = processed(&store, 10).await;
    let topology = Topology::new(format!("test-cleanup-{schema}."));
    let _remove = topology.remove_on_drop(AMQP_URL);
    let start = |n: u32| {
        let config = ServiceConfig {
            cleanup: Some(CleanupConfig {
                retention: Duration::from_secs(7 * 86_400),
                interval: Duration::from_millis(50),
                batch_size: NonZeroU32::new(10).expect("non-zero"),
                ..CleanupConfig::default()
            }),
            ..ServiceConfig::new(AMQP_URL, format!("parcel-inbox test cleanup {schema} {n}"))
        };
        let downstreams = Downstreams {
            carrier: Arc::new(StubCarrier::default()),
            notifier: Arc::new(StubNotifier::default()),
        };
        spawn(store.clone(), config, &topology, downstreams).expect("service starts")
    };
    let (one, two) = (start(1), start(2));

    let deadline = Instant::now() + Duration::from_secs(30);
    while rows(&store).await > new.len() as u64 {
        assert!(Instant::now() < deadline, "old rows still there after 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A few more rounds of both loops change nothing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for service in [one, two] {
        service.shutdown();
        tokio::time::timeout(Duration::from_secs(30), service.join())
            .await
            .expect("stops within 30 s")
            .expect("clean shutdown");
    }
    only_the_newer_rows_remain(&store, &old, &new).await;
    store.drop_schema().await.expect("drop schema");
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
        ..CleanupConfig::default()
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

/// `parcel-inbox cleanup` purges the outbox too, with its own retention:
/// on every Postgres store, the published rows older than it go, counted
/// once in its output, and a newer published row and every pending one
/// stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cleanup_command_purges_published_outbox_rows_past_their_retention() {
    use inbox_api::{InboxTransaction, OutboxStore, OutboxTransaction, OutgoingMessage};

    let mut stores = vec!["sqlx"];
    if cfg!(feature = "diesel") {
        stores.push("diesel");
    }
    for kind in stores {
        let (store, schema) = postgres_store().await;
        let messages: Vec<OutgoingMessage> = (0..6_u8)
            .map(|n| {
                OutgoingMessage::new(MessageId::new_v7(), "parcels", "k", "T", vec![n])
                    .expect("valid message")
            })
            .collect();
        let mut tx = store.begin().await.expect("begin");
        for message in &messages {
            let _ = tx.enqueue(message).await.expect("enqueue");
        }
        tx.commit().await.expect("commit");
        let ids: Vec<MessageId> = messages.iter().map(OutgoingMessage::id).collect();
        // Four published: three of them two hours ago, one just now; two
        // pending.
        store.mark_published(&ids[..4]).await.expect("mark");
        sqlx::query(
            "UPDATE outbox_messages SET published_at = published_at - interval '2 hours' \
             WHERE message_id = ANY($1)",
        )
        .bind(ids[..3].iter().map(|id| *id.as_uuid()).collect::<Vec<_>>())
        .execute(store.pool())
        .await
        .expect("age rows");

        let output = Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
            .args(["--store", kind, "--database-url", &database_url()])
            .args([
                "--schema",
                &schema,
                "cleanup",
                "--published-retention-hours",
                "1",
            ])
            .args(["--purge-batch", "2"])
            .env("RUST_LOG", "warn")
            .output()
            .expect("run parcel-inbox cleanup");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{kind}: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            stdout.contains("deleted 3 published outbox rows older than 1.0 hours"),
            "{kind}: {stdout}"
        );
        for (n, id) in ids.iter().enumerate() {
            let kept = store.lookup_outgoing(id).await.expect("lookup").is_some();
            assert_eq!(kept, n >= 3, "{kind}: message {n}");
        }
        assert_eq!(store.pending_count().await.expect("count"), 2, "{kind}");
        store.drop_schema().await.expect("drop schema");
    }
}

/// One outbox purge of N rows adds exactly N to `outbox_purged_rows_total`
/// (the store's purge counts its batches; the relay's purge must not count
/// them again), and keeps the pending rows.
#[tokio::test]
async fn one_outbox_purge_of_n_rows_adds_exactly_n_to_its_counter() {
    use inbox_api::{InboxTransaction, OutboxStore, OutboxTransaction, OutgoingMessage};
    use inbox_runtime::relay::purge_published_once;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let store = MemoryStore::new();
    let messages: Vec<OutgoingMessage> = (0..6_u8)
        .map(|n| {
            OutgoingMessage::new(MessageId::new_v7(), "parcels", "k", "T", vec![n])
                .expect("valid message")
        })
        .collect();
    let mut tx = store.begin().await.expect("begin");
    for message in &messages {
        let _ = tx.enqueue(message).await.expect("enqueue");
    }
    tx.commit().await.expect("commit");
    let ids: Vec<MessageId> = messages.iter().map(OutgoingMessage::id).collect();
    store.mark_published(&ids[..5]).await.expect("mark");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let config = CleanupConfig {
        retention: Duration::ZERO,
        interval: Duration::from_secs(3600),
        batch_size: NonZeroU32::new(2).expect("non-zero"),
        ..CleanupConfig::default()
    };

    let deleted = purge_published_once(&store, &config).await.expect("purge");

    assert_eq!(deleted, 5);
    assert_eq!(store.pending_count().await.expect("count"), 1);
    let purged = counter_values(&snapshotter, inbox_api::metrics::OUTBOX_PURGED_ROWS);
    assert_eq!(purged, [5], "one series, counting each purged row once");
}
