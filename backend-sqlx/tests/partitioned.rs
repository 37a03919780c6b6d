//! The partitioned inbox layout (`Layout::Partitioned`) against the real
//! PostgreSQL: where each kind of id goes, what an expired or a future id
//! gets, and cleanup dropping whole days while claims run.

mod common;

use std::num::NonZeroU32;

use chrono::{Duration, Utc};
use inbox_api::{
    Claim, ConsumerName, InboxError, InboxKey, InboxStore, InboxStoreExt as _, InboxTransaction,
    MessageId,
};
use inbox_backend_sqlx::{Layout, SqlxStore};

/// A migrated store with the partitioned layout in a fresh schema.
async fn partitioned_store() -> SqlxStore {
    let store = common::store_in(&common::unique_schema(common::TEST_PREFIX), 8, None)
        .await
        .with_layout(Layout::Partitioned);
    store
        .migrate()
        .await
        .expect("migrate a fresh partitioned schema");
    store
}

/// A v7 id whose timestamp lies `offset` from now.
fn v7_at(offset: Duration) -> MessageId {
    let at = Utc::now() + offset;
    let seconds = u64::try_from(at.timestamp()).expect("after 1970");
    MessageId::from_uuid(uuid::Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        seconds,
        0,
    )))
}

fn key(id: MessageId) -> InboxKey {
    InboxKey::new(id, ConsumerName::new("c1").expect("a consumer name"))
}

async fn claim_and_commit(store: &SqlxStore, key: &InboxKey) -> Result<Claim, InboxError> {
    let mut tx = store.begin().await?;
    let claim = tx.claim(key).await?;
    tx.commit().await?;
    Ok(claim)
}

/// The partition a key's row lives in.
async fn partition_of(store: &SqlxStore, key: &InboxKey) -> Option<String> {
    sqlx::query_scalar(
        "SELECT tableoid::regclass::text FROM inbox_messages WHERE id = $1 AND consumer_type = $2",
    )
    .bind(key.message_id.as_uuid())
    .bind(key.consumer.as_str())
    .fetch_optional(store.pool())
    .await
    .expect("partition query")
}

#[tokio::test]
async fn v4_ids_go_to_the_untimed_partition_by_their_version_not_their_bits() {
    let store = partitioned_store().await;
    // A v4 id whose first 48 random bits equal this millisecond: a router
    // by range would put it in today's partition.
    let mut bytes = *v7_at(Duration::zero()).as_uuid().as_bytes();
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    let v4 = key(MessageId::from_uuid(uuid::Uuid::from_bytes(bytes)));
    assert_eq!(v4.message_id.as_uuid().get_version_num(), 4);
    assert_eq!(
        claim_and_commit(&store, &v4).await.expect("claim"),
        Claim::Fresh
    );
    assert_eq!(
        claim_and_commit(&store, &v4).await.expect("claim"),
        Claim::Duplicate
    );
    assert_eq!(
        partition_of(&store, &v4).await.as_deref(),
        Some("inbox_messages_untimed")
    );
    let v7 = key(v7_at(Duration::zero()));
    assert_eq!(
        claim_and_commit(&store, &v7).await.expect("claim"),
        Claim::Fresh
    );
    let today = format!("inbox_messages_p{}", Utc::now().format("%Y%m%d"));
    assert_eq!(partition_of(&store, &v7).await, Some(today));

    // The untimed partition is cleaned by rows, on processed_at.
    sqlx::query("UPDATE inbox_messages SET processed_at = now() - interval '10 days'")
        .execute(store.pool())
        .await
        .expect("age rows");
    let limit = NonZeroU32::new(10).expect("non-zero");
    let deleted = store
        .purge_processed_before(Utc::now() - Duration::days(7), limit)
        .await
        .expect("purge");
    assert_eq!(deleted, 1, "only the untimed row goes by its processed_at");
    assert_eq!(store.lookup(&v4).await.expect("lookup"), None);
    assert!(
        store.lookup(&v7).await.expect("lookup").is_some(),
        "today's day stays"
    );
}

#[tokio::test]
async fn a_duplicate_across_days_meets_its_first_copy_and_an_expired_id_is_refused() {
    let store = partitioned_store().await;
    assert_eq!(store.create_partitions(3, 0).await.expect("maintenance"), 2);
    let old = key(v7_at(-Duration::days(2)));
    let today = key(v7_at(Duration::zero()));
    for k in [&old, &today] {
        assert_eq!(
            claim_and_commit(&store, k).await.expect("claim"),
            Claim::Fresh
        );
        assert_eq!(
            claim_and_commit(&store, k).await.expect("claim"),
            Claim::Duplicate
        );
    }

    // Cleanup with a cutoff a day back drops the days before yesterday
    // whole, and with them the old row; today's stays.
    let limit = NonZeroU32::new(100).expect("non-zero");
    let dropped = store
        .purge_processed_before(Utc::now() - Duration::days(1), limit)
        .await
        .expect("purge");
    assert_eq!(dropped, 1, "the old day's one row");
    assert_eq!(
        claim_and_commit(&store, &today).await.expect("claim"),
        Claim::Duplicate
    );

    // The old id can no longer be told apart from a first delivery:
    // refused, permanently, as expired; never claimed blind.
    let error = claim_and_commit(&store, &old).await.expect_err("expired");
    assert_eq!(error.kind(), "expired", "{error:?}");
    assert!(!error.is_retryable());
    // Maintenance in production (days_behind 0) does not bring it back.
    store.create_partitions(0, 3).await.expect("maintenance");
    let error = claim_and_commit(&store, &old)
        .await
        .expect_err("still expired");
    assert_eq!(error.kind(), "expired");
}

#[tokio::test]
async fn a_future_id_beyond_the_created_days_is_retryable_until_maintenance_creates_its_day() {
    let store = partitioned_store().await;
    let future = key(v7_at(Duration::days(10)));
    let error = claim_and_commit(&store, &future)
        .await
        .expect_err("no day yet");
    assert!(error.is_retryable(), "{error:?}");
    assert_ne!(error.kind(), "expired");
    store.create_partitions(0, 11).await.expect("maintenance");
    assert_eq!(
        claim_and_commit(&store, &future).await.expect("claim"),
        Claim::Fresh
    );
    assert_eq!(
        claim_and_commit(&store, &future).await.expect("claim"),
        Claim::Duplicate
    );
}

#[tokio::test]
async fn cleanup_drops_a_day_while_claims_of_today_run() {
    let store = partitioned_store().await;
    store.create_partitions(3, 0).await.expect("maintenance");
    for _ in 0..50 {
        let old = key(v7_at(-Duration::days(3)));
        let claim = claim_and_commit(&store, &old)
            .await
            .expect("claim an old id");
        assert_eq!(claim, Claim::Fresh);
    }
    let claimer = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut fresh = 0;
            for _ in 0..200 {
                let k = key(v7_at(Duration::zero()));
                if claim_and_commit(&store, &k)
                    .await
                    .expect("claim during cleanup")
                    == Claim::Fresh
                {
                    fresh += 1;
                }
            }
            fresh
        })
    };
    let limit = NonZeroU32::new(1000).expect("non-zero");
    let dropped = store
        .purge_processed_before(Utc::now() - Duration::days(1), limit)
        .await
        .expect("purge");
    assert_eq!(dropped, 50);
    assert_eq!(claimer.await.expect("claimer"), 200);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox_messages")
        .fetch_one(store.pool())
        .await
        .expect("count");
    assert_eq!(left, 200);
}

#[tokio::test]
async fn a_schema_keeps_the_layout_it_was_created_with() {
    let store = partitioned_store().await;
    let as_table = SqlxStore::new(store.pool().clone(), store.schema())
        .expect("schema name")
        .with_layout(Layout::Table);
    let error = as_table.migrate().await.expect_err("layout mismatch");
    assert!(matches!(error, InboxError::Schema { .. }), "{error:?}");
    let plain = common::fresh_store(2)
        .await
        .with_layout(Layout::Partitioned);
    let error = plain.migrate().await.expect_err("layout mismatch");
    assert!(matches!(error, InboxError::Schema { .. }), "{error:?}");
}
