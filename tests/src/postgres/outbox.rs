//! The outbox's live PostgreSQL scenarios: what the lease statements do
//! with real connections, real row locks and the database clock, beyond
//! what the shared outbox suite can ask of every backend.

use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::time::Duration;

use inbox_api::{
    EnqueueOutcome, InboxStore, InboxTransaction, MessageId, OutboxStore, OutboxTransaction,
};
use inbox_postgres::sql;

use super::PgHarness;
use super::scenarios::{expect_index, migrated, terminate};
use crate::outbox::OutboxHarness;
use crate::outbox::contract::{LEASE, enqueue_committed, new_message};
use crate::{Failure, Outcome, check, check_eq};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
}

/// Enqueues `n` messages in one committed transaction, in order.
async fn enqueue_many<H: PgHarness + OutboxHarness>(
    store: &H::Store,
    n: usize,
) -> Result<Vec<MessageId>, Failure> {
    let mut tx = store.begin().await?;
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let message = new_message();
        check_eq!(
            tx.enqueue(&message).await?,
            EnqueueOutcome::Enqueued,
            "enqueue"
        );
        ids.push(message.id());
    }
    tx.commit().await?;
    Ok(ids)
}

/// A relay's rows locked by another connection (a relay in the middle of
/// its take) are skipped at once, never waited for, and taken once that
/// connection is gone: `FOR UPDATE SKIP LOCKED` with two real connections.
pub async fn outbox_relays_on_two_connections_skip_locked_rows<H: PgHarness + OutboxHarness>(
    h: &H,
) -> Outcome {
    let store = migrated(h, 4).await?;
    let ids = enqueue_many::<H>(&store, 6).await?;
    let mut locker = store.begin().await?;
    h.tx_execute(
        &mut locker,
        "SELECT message_id FROM outbox_messages ORDER BY position LIMIT 3 FOR UPDATE",
    )
    .await?;
    let take = tokio::time::timeout(Duration::from_secs(5), store.take_pending(nz(10), LEASE))
        .await
        .map_err(|_| Failure::new("take_pending waited for another connection's row locks"))??;
    check_eq!(take.ids(), ids[3..].to_vec(), "the rows not locked");
    terminate(h, &store, &mut locker).await?;
    h.crash(&store, locker, crate::CrashKind::Drop).await;
    let rest = store.take_pending(nz(10), LEASE).await?;
    check_eq!(
        rest.ids(),
        ids[..3].to_vec(),
        "the rows a killed connection had locked"
    );
    Ok(())
}

/// Six relays on six connections, in parallel on the runtime's threads,
/// take batches until nothing is due: each message goes to exactly one.
pub async fn outbox_parallel_relays_take_each_message_once<H: PgHarness + OutboxHarness>(
    h: &H,
) -> Outcome {
    let store = migrated(h, 8).await?;
    let all: BTreeSet<MessageId> = enqueue_many::<H>(&store, 300).await?.into_iter().collect();
    let relays: Vec<_> = (0..6)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut taken = Vec::new();
                loop {
                    let lease = store.take_pending(nz(7), LEASE).await?;
                    if lease.is_empty() {
                        return Ok::<_, inbox_api::InboxError>(taken);
                    }
                    taken.extend(lease.ids());
                }
            })
        })
        .collect();
    let mut seen = BTreeSet::new();
    for relay in relays {
        let taken = relay
            .await
            .map_err(|e| Failure::new(format!("relay task: {e}")))??;
        for id in taken {
            check!(seen.insert(id), "two relays took {id}");
        }
    }
    check_eq!(seen, all, "the messages taken");
    Ok(())
}

/// A lease runs out on the database clock, in the unit the relay asked
/// for: a relay that died is replaced without anyone moving the time.
pub async fn outbox_a_dead_relays_lease_runs_out_on_the_database_clock<
    H: PgHarness + OutboxHarness,
>(
    h: &H,
) -> Outcome {
    let store = migrated(h, 2).await?;
    let message = new_message();
    enqueue_committed(h, &store, &message).await?;
    let lease = Duration::from_millis(300);
    let dead = store.take_pending(nz(1), lease).await?;
    check_eq!(dead.ids(), vec![message.id()], "the dead relay's lease");
    let early = store.take_pending(nz(1), lease).await?;
    check!(
        early.is_empty(),
        "taken under a live lease: {:?}",
        early.ids()
    );
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let next = store.take_pending(nz(1), LEASE).await?;
    check_eq!(
        next.ids(),
        vec![message.id()],
        "taken after the lease ran out"
    );
    Ok(())
}

/// Taking a batch rewrites each row on its own page (a HOT update: the
/// lease columns are in no index), so a take adds no index entries and
/// about a third of the WAL. On full pages every taken row would move to
/// another page: this counts the rows whose page changed, over enough rows
/// to fill several pages.
pub async fn outbox_a_take_rewrites_rows_in_place<H: PgHarness + OutboxHarness>(h: &H) -> Outcome {
    const PAGES: &str =
        "SELECT coalesce(sum((ctid::text::point)[0]), 0)::int8 FROM outbox_messages";
    let store = migrated(h, 2).await?;
    let ids = enqueue_many::<H>(&store, 400).await?;
    let pages = h
        .side_i64(
            &store,
            "SELECT count(DISTINCT (ctid::text::point)[0])::int8 FROM outbox_messages",
        )
        .await?;
    check!(pages >= 4, "the rows fill only {pages} pages");
    let before = h.side_i64(&store, PAGES).await?;
    let lease = store.take_pending(nz(400), LEASE).await?;
    check_eq!(lease.ids().len(), ids.len(), "rows taken");
    let after = h.side_i64(&store, PAGES).await?;
    check_eq!(
        after,
        before,
        "the sum of the rows' page numbers (a taken row moved to another page)"
    );
    Ok(())
}

/// A take reads about its batch, not the backlog, even when the planner's
/// statistics predate the backlog (an outbox filled in a burst since the
/// last ANALYZE): 40,000 pending rows enqueued after the table was analyzed
/// empty, and one take of 100 must fetch fewer heap blocks than half the
/// table has. Planned on those statistics, the take read every pending row
/// and sorted them (1,025 blocks fetched for a take of 100 from 20,000
/// rows, against 407).
pub async fn outbox_a_take_reads_its_batch_not_the_backlog<H: PgHarness + OutboxHarness>(
    h: &H,
) -> Outcome {
    let store = migrated(h, 2).await?;
    h.side_execute(&store, "ANALYZE outbox_messages").await?;
    h.side_execute(
        &store,
        "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, body) \
         SELECT gen_random_uuid(), 'parcels', 'k', 'T', '\\x00' FROM generate_series(1, 40000)",
    )
    .await?;
    let pages = h
        .side_i64(
            &store,
            "SELECT pg_relation_size('outbox_messages') / current_setting('block_size')::int8",
        )
        .await?;
    let take = sql::TAKE_PENDING
        .replace("$1", "30000")
        .replace("$2", "gen_random_uuid()")
        .replace("$3", "100");
    h.side_execute(&store, "CREATE TABLE take_cost (fetched int8, taken int8)")
        .await?;
    // One transaction, statement after statement: the transaction's own
    // block counts before and after the take.
    h.side_execute(
        &store,
        &format!(
            "DO $$ DECLARE before int8; taken int8; BEGIN \
             before := pg_stat_get_xact_blocks_fetched('outbox_messages'::regclass); \
             SELECT count(*) INTO taken FROM ({take}) AS t; \
             INSERT INTO take_cost VALUES \
               (pg_stat_get_xact_blocks_fetched('outbox_messages'::regclass) - before, taken); \
             END $$"
        ),
    )
    .await?;
    let taken = h.side_i64(&store, "SELECT taken FROM take_cost").await?;
    check_eq!(taken, 100, "rows taken");
    let fetched = h.side_i64(&store, "SELECT fetched FROM take_cost").await?;
    check!(
        fetched < pages / 2,
        "a take of 100 fetched {fetched} blocks of a {pages}-page table"
    );
    Ok(())
}

/// The purge walks the partial index on `published_at` without scanning
/// the table, on a table of mostly published rows. (What a take reads:
/// [`outbox_a_take_reads_its_batch_not_the_backlog`].)
pub async fn outbox_purge_uses_its_partial_index<H: PgHarness + OutboxHarness>(h: &H) -> Outcome {
    let store = migrated(h, 2).await?;
    h.side_execute(
        &store,
        "INSERT INTO outbox_messages \
         (message_id, exchange, routing_key, message_type, body, created_at, published_at) \
         SELECT gen_random_uuid(), 'parcels', 'k', 'T', '\\x00', \
                now() - interval '2 days', now() - (n % 48) * interval '1 hour' \
         FROM generate_series(1, 20000) AS n",
    )
    .await?;
    enqueue_many::<H>(&store, 50).await?;
    h.side_execute(&store, "ANALYZE outbox_messages").await?;
    let purge = sql::PURGE_PUBLISHED_BATCH
        .replace("$1", "now() - interval '1 day'")
        .replace("$2", "1000");
    expect_index(
        h,
        &store,
        &purge,
        "outbox_messages_published_at_idx",
        &["outbox_messages"],
    )
    .await?;
    let cutoff = chrono::Utc::now() - chrono::Duration::days(1);
    let mut purged = 0;
    loop {
        let n = store.purge_published_batch(cutoff, nz(1000)).await?;
        if n == 0 {
            break;
        }
        purged += n;
    }
    let left = h
        .side_i64(&store, "SELECT count(*) FROM outbox_messages")
        .await?;
    check_eq!(
        u64::try_from(left).unwrap_or(0) + purged,
        20_050,
        "rows purged and kept"
    );
    check_eq!(store.pending_count().await?, 50, "pending rows kept");
    Ok(())
}
