//! The partitioned inbox layout (`Layout::Partitioned`): where each kind of
//! id goes, what an expired or a future id gets, and cleanup dropping whole
//! days while claims run. Every Postgres backend runs these.

use std::num::NonZeroU32;

use chrono::{Duration, Utc};
use inbox_api::{
    Claim, ConsumerName, Handled, Inbox, InboxError, InboxKey, InboxStore, InboxStoreExt as _,
    InboxTransaction, MessageId,
};

use inbox_postgres::Layout;

use super::PgHarness;
use super::support::{EFFECTS_TABLE, TEST_PREFIX, unique_schema};
use crate::{Failure, Outcome, check, check_eq};

/// A migrated store with the partitioned layout in a fresh schema.
async fn partitioned_store<H: PgHarness>(h: &H) -> Result<H::Store, Failure> {
    let store = h
        .store_laid_out(&unique_schema(TEST_PREFIX), 8, Layout::Partitioned)
        .await;
    h.migrate(&store).await?;
    Ok(store)
}

/// A v7 id whose timestamp lies `offset` from now.
fn v7_at(offset: Duration) -> MessageId {
    let at = Utc::now() + offset;
    let seconds = u64::try_from(at.timestamp()).unwrap_or(0);
    MessageId::from_uuid(uuid::Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        seconds,
        0,
    )))
}

fn key(id: MessageId) -> Result<InboxKey, Failure> {
    Ok(InboxKey::new(id, ConsumerName::new("c1")?))
}

async fn claim_and_commit<S: InboxStore>(store: &S, key: &InboxKey) -> Result<Claim, InboxError> {
    let mut tx = store.begin().await?;
    let claim = tx.claim(key).await?;
    tx.commit().await?;
    Ok(claim)
}

/// How many rows of `key`'s id the table `table` holds.
async fn rows_in<H: PgHarness>(
    h: &H,
    store: &H::Store,
    table: &str,
    key: &InboxKey,
) -> Result<i64, InboxError> {
    // A uuid's text is hex and dashes, and the table a name of this file.
    h.side_i64(
        store,
        &format!(
            "SELECT count(*) FROM {table} WHERE id = '{}'",
            key.message_id.as_uuid()
        ),
    )
    .await
}

/// A v4 id whose first 48 random bits equal a current timestamp goes to
/// the untimed partition (routed by the version nibble: a router by range
/// would put it in today's day), is deduplicated there, and is cleaned by
/// rows on `processed_at`; a v7 id goes to its day, which row cleanup
/// never touches.
pub async fn partitioned_v4_ids_go_to_the_untimed_partition<H: PgHarness>(h: &H) -> Outcome {
    let store = partitioned_store(h).await?;
    let mut bytes = *v7_at(Duration::zero()).as_uuid().as_bytes();
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    let v4 = key(MessageId::from_uuid(uuid::Uuid::from_bytes(bytes)))?;
    check_eq!(v4.message_id.as_uuid().get_version_num(), 4, "a v4 id");
    check_eq!(
        claim_and_commit(&store, &v4).await?,
        Claim::Fresh,
        "v4 first"
    );
    check_eq!(
        claim_and_commit(&store, &v4).await?,
        Claim::Duplicate,
        "v4 again"
    );
    check_eq!(
        rows_in(h, &store, "inbox_messages_untimed", &v4).await?,
        1,
        "the v4 row in the untimed partition"
    );
    let v7 = key(v7_at(Duration::zero()))?;
    check_eq!(
        claim_and_commit(&store, &v7).await?,
        Claim::Fresh,
        "v7 first"
    );
    let today = format!("inbox_messages_p{}", Utc::now().format("%Y%m%d"));
    check_eq!(
        rows_in(h, &store, &today, &v7).await?,
        1,
        "the v7 row in today's partition"
    );

    h.side_execute(
        &store,
        "UPDATE inbox_messages SET processed_at = now() - interval '10 days'",
    )
    .await?;
    let limit = NonZeroU32::new(10).ok_or_else(|| Failure::new("zero"))?;
    let deleted = store
        .purge_processed_before(Utc::now() - Duration::days(7), limit)
        .await?;
    check_eq!(deleted, 1, "only the untimed row goes by its processed_at");
    check!(store.lookup(&v4).await?.is_none(), "the v4 row was purged");
    check!(store.lookup(&v7).await?.is_some(), "today's day stays");
    Ok(())
}

/// A duplicate meets its first copy in an earlier day; cleanup drops the
/// expired days whole (counting their rows) and keeps today; an id whose
/// day was dropped is refused as `expired` (never claimed blind), also
/// after the maintenance runs again.
pub async fn partitioned_an_expired_id_is_refused_after_its_day_is_dropped<H: PgHarness>(
    h: &H,
) -> Outcome {
    let store = partitioned_store(h).await?;
    check_eq!(
        h.side_i64(&store, "SELECT inbox_create_partitions(3, 0)::int8")
            .await?,
        2,
        "the days before yesterday created"
    );
    let old = key(v7_at(-Duration::days(2)))?;
    let today = key(v7_at(Duration::zero()))?;
    for k in [&old, &today] {
        check_eq!(
            claim_and_commit(&store, k).await?,
            Claim::Fresh,
            "{k} first"
        );
        check_eq!(
            claim_and_commit(&store, k).await?,
            Claim::Duplicate,
            "{k} again"
        );
    }
    let limit = NonZeroU32::new(100).ok_or_else(|| Failure::new("zero"))?;
    let dropped = store
        .purge_processed_before(Utc::now() - Duration::days(1), limit)
        .await?;
    check_eq!(dropped, 1, "the old day's one row");
    check_eq!(
        claim_and_commit(&store, &today).await?,
        Claim::Duplicate,
        "today's id after cleanup"
    );
    for round in ["after the drop", "after maintenance"] {
        match claim_and_commit(&store, &old).await {
            Err(error) => {
                check_eq!(error.kind(), "expired", "{round}: {error:?}");
                check!(!error.is_retryable(), "{round}: expired is permanent");
            }
            Ok(claim) => {
                return Err(Failure::new(format!(
                    "{round}: an id of a dropped day was claimed: {claim:?}"
                )));
            }
        }
        h.side_i64(&store, "SELECT inbox_create_partitions(0, 3)::int8")
            .await?;
    }
    Ok(())
}

/// An id beyond the created days is a retryable failure (not `expired`)
/// until the maintenance creates its day, and then claimed exactly once.
pub async fn partitioned_a_future_id_waits_for_its_day<H: PgHarness>(h: &H) -> Outcome {
    let store = partitioned_store(h).await?;
    let future = key(v7_at(Duration::days(10)))?;
    match claim_and_commit(&store, &future).await {
        Err(error) => {
            check!(error.is_retryable(), "retryable: {error:?}");
            check!(error.kind() != "expired", "not expired: {error:?}");
        }
        Ok(claim) => {
            return Err(Failure::new(format!(
                "an id without a day was claimed: {claim:?}"
            )));
        }
    }
    h.side_i64(&store, "SELECT inbox_create_partitions(0, 11)::int8")
        .await?;
    check_eq!(
        claim_and_commit(&store, &future).await?,
        Claim::Fresh,
        "after maintenance"
    );
    check_eq!(
        claim_and_commit(&store, &future).await?,
        Claim::Duplicate,
        "again"
    );
    Ok(())
}

/// Cleanup detaches and drops an old day while claims of today run: every
/// claim succeeds, and exactly the old day's rows go.
pub async fn partitioned_cleanup_drops_a_day_while_claims_run<H: PgHarness>(h: &H) -> Outcome {
    let store = partitioned_store(h).await?;
    h.side_i64(&store, "SELECT inbox_create_partitions(3, 0)::int8")
        .await?;
    for _ in 0..50 {
        let old = key(v7_at(-Duration::days(3)))?;
        check_eq!(
            claim_and_commit(&store, &old).await?,
            Claim::Fresh,
            "old id"
        );
    }
    let claimer = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut fresh = 0;
            for _ in 0..200 {
                let k = key(v7_at(Duration::zero()))?;
                if claim_and_commit(&store, &k).await? == Claim::Fresh {
                    fresh += 1;
                }
            }
            Ok::<_, Failure>(fresh)
        })
    };
    let limit = NonZeroU32::new(1000).ok_or_else(|| Failure::new("zero"))?;
    let dropped = store
        .purge_processed_before(Utc::now() - Duration::days(1), limit)
        .await?;
    check_eq!(dropped, 50, "the old day's rows");
    let fresh = claimer
        .await
        .map_err(|e| Failure::new(format!("claimer: {e}")))??;
    check_eq!(fresh, 200, "claims during cleanup");
    check_eq!(
        h.side_i64(&store, "SELECT count(*) FROM inbox_messages")
            .await?,
        200,
        "rows left"
    );
    Ok(())
}

/// A day too large to count on the way out (over 8 MiB) reports the
/// planner's estimate of its rows instead, close to the truth once
/// analyzed, and still goes whole.
pub async fn partitioned_a_large_dropped_day_reports_its_estimated_rows<H: PgHarness>(
    h: &H,
) -> Outcome {
    let store = partitioned_store(h).await?;
    h.side_i64(&store, "SELECT inbox_create_partitions(3, 0)::int8")
        .await?;
    let day = (Utc::now() - Duration::days(2)).date_naive();
    let table = format!("inbox_messages_p{}", day.format("%Y%m%d"));
    // 120,000 v7 ids spread over the day (about 12 MiB of heap).
    let rows: i64 = 120_000;
    h.side_execute(
        &store,
        &format!(
            "INSERT INTO inbox_messages (id, consumer_type, processed_at, time_ordered) \
             SELECT (lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0') \
                     || '7' || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid, 'c1', t, true \
             FROM (SELECT timestamptz '{day}T00:00:00Z' + g * interval '700 ms' AS t, \
                          md5('large-day-' || g) AS h \
                   FROM generate_series(1, {rows}) AS g) AS r"
        ),
    )
    .await?;
    h.side_execute(&store, &format!("ANALYZE {table}")).await?;
    let limit = NonZeroU32::new(100).ok_or_else(|| Failure::new("zero"))?;
    let dropped = store
        .purge_processed_before(Utc::now() - Duration::days(1), limit)
        .await?;
    let dropped = i64::try_from(dropped).map_err(|e| Failure::new(e.to_string()))?;
    check!(
        (dropped - rows).abs() <= rows / 50,
        "estimated {dropped} rows for {rows}"
    );
    check_eq!(
        h.side_i64(
            &store,
            &format!("SELECT (to_regclass('{table}') IS NULL)::int::int8")
        )
        .await?,
        1,
        "the day is gone"
    );
    Ok(())
}

/// A schema keeps the layout it was created with: migrating it for the
/// other layout fails with a schema error.
pub async fn partitioned_a_schema_keeps_its_layout<H: PgHarness>(h: &H) -> Outcome {
    let partitioned = partitioned_store(h).await?;
    let as_table = h
        .store_laid_out(&h.schema_of(&partitioned), 2, Layout::Table)
        .await;
    match h.migrate(&as_table).await {
        Err(InboxError::Schema { .. }) => {}
        other => return Err(Failure::new(format!("table on partitioned: {other:?}"))),
    }
    let table = h
        .store_laid_out(&unique_schema(TEST_PREFIX), 2, Layout::Table)
        .await;
    h.migrate(&table).await?;
    let as_partitioned = h
        .store_laid_out(&h.schema_of(&table), 2, Layout::Partitioned)
        .await;
    match h.migrate(&as_partitioned).await {
        Err(InboxError::Schema { .. }) => Ok(()),
        other => Err(Failure::new(format!("partitioned on table: {other:?}"))),
    }
}

/// In batched mode, an expired id and an id ahead of the created days fail
/// the batch's one claim statement without naming themselves; the batch
/// then claims one by one, so only those two are charged (expired:
/// permanent; ahead: retryable) and the others are processed once. The
/// same for a batch handled at once (`Inbox::handle_batch_at_once`).
pub async fn partitioned_a_batch_charges_only_its_expired_and_future_ids<H: PgHarness>(
    h: &H,
) -> Outcome {
    let store = partitioned_store(h).await?;
    h.side_execute(&store, EFFECTS_TABLE).await?;
    for at_once in [false, true] {
        let fine = [
            key(v7_at(Duration::zero()))?,
            key(MessageId::from_uuid(uuid::Uuid::new_v4()))?,
            key(v7_at(-Duration::days(1)))?,
        ];
        let expired = key(v7_at(-Duration::days(3)))?;
        let future = key(v7_at(Duration::days(10)))?;
        let batch = [
            fine[0].clone(),
            expired.clone(),
            fine[1].clone(),
            future.clone(),
            fine[2].clone(),
        ];
        let items: Vec<(InboxKey, InboxKey)> =
            batch.iter().map(|k| (k.clone(), k.clone())).collect();
        let inbox = Inbox::new(store.clone());
        let outcomes = if at_once {
            inbox
                .handle_batch_at_once(items, async |tx, keys: &[&InboxKey]| {
                    for key in keys {
                        h.record_effect(tx, key).await?;
                    }
                    Ok(())
                })
                .await
        } else {
            inbox
                .handle_batch(items, async |tx, key: &InboxKey| {
                    h.record_effect(tx, key).await
                })
                .await
        };
        for (key, _, outcome) in &outcomes {
            match outcome {
                Ok(Handled::Processed(())) if fine.contains(key) => {}
                Err(error) if *key == expired => {
                    check_eq!(error.kind(), "expired", "the expired id: {error:?}");
                    check!(!error.is_retryable(), "expired is permanent");
                }
                Err(error) if *key == future => {
                    check!(
                        error.is_retryable(),
                        "the future id is retryable: {error:?}"
                    );
                    check!(error.kind() != "expired", "the future id: {error:?}");
                }
                other => {
                    return Err(Failure::new(format!("at once {at_once}: {key}: {other:?}")));
                }
            }
        }
        let effects = h.effects(&store).await;
        for k in &fine {
            check_eq!(effects.get(k).copied(), Some(1), "effects of {k}");
        }
        for k in [&expired, &future] {
            check_eq!(effects.get(k).copied(), None, "effects of the refused {k}");
        }
    }
    Ok(())
}
