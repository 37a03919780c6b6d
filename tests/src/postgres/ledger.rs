//! The attempt ledger's live PostgreSQL scenario: `parcel-inbox dead` and
//! cleanup walk their indexes, however many rows the ledger keeps.

use std::num::NonZeroU32;

use inbox_api::{AttemptLedger, AttemptLedgerExt};
use inbox_postgres::sql;

use super::PgHarness;
use super::scenarios::{expect_index, migrated};
use crate::ledger::LedgerHarness;
use crate::{Outcome, check, check_eq};

/// Over 20,000 ledger rows of which 200 are dead: the dead listing walks
/// the partial index of dead rows and the purge the index on
/// `last_failed_at`, neither scanning the table, and each answers exactly
/// its rows.
pub async fn ledger_dead_list_and_purge_use_their_indexes<H: PgHarness + LedgerHarness>(
    h: &H,
) -> Outcome {
    let store = migrated(h, 2).await?;
    h.side_execute(
        &store,
        "INSERT INTO inbox_attempts (message_id, consumer, attempts, last_error, \
         first_failed_at, last_failed_at, dead_at, dead_reason) \
         SELECT gen_random_uuid(), 'c' || (n % 2), 1 + n % 5, 'boom', \
                now() - (n % 48) * interval '1 hour', now() - (n % 48) * interval '1 hour', \
                CASE WHEN n % 100 = 0 THEN now() END, \
                CASE WHEN n % 100 = 0 THEN 'retries_exhausted' END \
         FROM generate_series(1, 20000) AS n",
    )
    .await?;
    h.side_execute(&store, "ANALYZE inbox_attempts").await?;

    let dead = sql::DEAD_MESSAGES
        .replace("$1", "NULL::text")
        .replace("$2", "100");
    expect_index(
        h,
        &store,
        &dead,
        "inbox_attempts_dead_idx",
        &["inbox_attempts"],
    )
    .await?;
    let listed = store
        .dead_messages(None, NonZeroU32::new(1000).unwrap_or(NonZeroU32::MIN))
        .await?;
    check_eq!(listed.len(), 200, "dead rows listed");
    check!(
        listed.windows(2).all(|w| {
            let at = |i: usize| w[i].dead.as_ref().map(|d| d.at);
            at(0) >= at(1)
        }),
        "the dead listing is not newest first"
    );

    let purge = sql::PURGE_ATTEMPTS_BATCH
        .replace("$1", "now() - interval '1 day'")
        .replace("$2", "1000");
    expect_index(
        h,
        &store,
        &purge,
        "inbox_attempts_last_failed_at_idx",
        &["inbox_attempts"],
    )
    .await?;
    let cutoff = chrono::Utc::now() - chrono::Duration::days(1);
    let purged = store
        .purge_attempts_before(cutoff, NonZeroU32::new(1000).unwrap_or(NonZeroU32::MIN))
        .await?;
    let left = h
        .side_i64(&store, "SELECT count(*) FROM inbox_attempts")
        .await?;
    check_eq!(
        u64::try_from(left).unwrap_or(0) + purged,
        20_000,
        "rows purged and kept"
    );
    check!(purged > 9_000, "only {purged} old rows purged");
    let old_left = h
        .side_i64(
            &store,
            "SELECT count(*) FROM inbox_attempts WHERE last_failed_at < now() - interval '25 hours'",
        )
        .await?;
    check_eq!(old_left, 0, "rows older than the cutoff left");
    Ok(())
}
