//! The scenarios, each a `pub async fn(&impl PgHarness) -> Outcome`.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::num::NonZeroU32;

use inbox_api::{
    BatchTransaction, Claim, Handled, Inbox, InboxError, InboxKey, InboxStore, InboxStoreExt as _,
    InboxTransaction,
};
use inbox_postgres::{LEDGER_TABLE, Layout, MIGRATIONS, SessionTimeouts};
use tokio::sync::Barrier;

use super::PgHarness;
use super::support::{EFFECTS_TABLE, TEST_PREFIX, unique_schema};
use crate::contract::{effects_of, new_key};
use crate::{Failure, Outcome, TxOf, check, check_eq};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
}

/// A migrated store in a new schema with at most `pool` connections, and
/// the suite's effects table.
pub(super) async fn migrated<H: PgHarness>(h: &H, pool: usize) -> Result<H::Store, Failure> {
    let store = h.store_in(&unique_schema(TEST_PREFIX), pool).await;
    h.migrate(&store).await?;
    h.side_execute(&store, EFFECTS_TABLE).await?;
    Ok(store)
}

/// Fails unless the plan of `sql` walks `index` and has no sequential
/// scan of any table in `tables`.
pub(super) async fn expect_index<H: PgHarness>(
    h: &H,
    store: &H::Store,
    sql: &str,
    index: &str,
    tables: &[&str],
) -> Outcome {
    let plan = h.explain(store, sql).await?;
    check!(
        plan.iter().any(|l| l.contains(index)),
        "the plan does not use {index}:\n{}",
        plan.join("\n")
    );
    for table in tables {
        check!(
            !plan
                .iter()
                .any(|l| l.contains(&format!("Seq Scan on {table}"))),
            "the plan scans {table}:\n{}",
            plan.join("\n")
        );
    }
    Ok(())
}

/// One delivery through the middleware: the work records one effect.
async fn deliver<H: PgHarness>(
    h: &H,
    inbox: &Inbox<H::Store>,
    key: &InboxKey,
) -> Result<Handled<()>, InboxError> {
    inbox
        .handle(key, async |tx| h.record_effect(tx, key).await)
        .await
}

/// Redelivers `key` like an at-least-once broker until it is acknowledged.
async fn redeliver_until_acked<H: PgHarness>(
    h: &H,
    inbox: &Inbox<H::Store>,
    key: &InboxKey,
) -> Result<Handled<()>, Failure> {
    for _ in 0..100 {
        match deliver(h, inbox, key).await {
            Ok(handled) => return Ok(handled),
            Err(error) if error.is_retryable() => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(error) => {
                return Err(Failure::new(format!(
                    "{key}: permanent error on redelivery: {error:?}"
                )));
            }
        }
    }
    Err(Failure::new(format!(
        "{key}: never acknowledged after 100 deliveries"
    )))
}

/// The invariant for `key`: one effect, one processed row.
async fn expect_exactly_once<H: PgHarness>(h: &H, store: &H::Store, key: &InboxKey) -> Outcome {
    check_eq!(effects_of(h, store, key).await, 1, "{key}: effects");
    let row = store.lookup(key).await?;
    check!(
        row.as_ref().is_some_and(|r| r.processed_at.is_some()),
        "{key}: inbox row {row:?}"
    );
    Ok(())
}

/// No effect and no row for `key`.
async fn expect_no_trace<H: PgHarness>(h: &H, store: &H::Store, key: &InboxKey) -> Outcome {
    check_eq!(effects_of(h, store, key).await, 0, "{key}: effects");
    let row = store.lookup(key).await?;
    check!(row.is_none(), "{key}: row left behind: {row:?}");
    Ok(())
}

/// Whether `fut` is still pending after `wait`: it is blocked.
async fn still_pending<F: Future>(fut: &mut std::pin::Pin<&mut F>, wait: Duration) -> bool {
    tokio::time::timeout(wait, fut.as_mut()).await.is_err()
}

/// Kills the server process behind `tx` from a side connection and waits
/// (up to 5 s) until it is gone, its locks released.
pub(super) async fn terminate<H: PgHarness>(h: &H, store: &H::Store, tx: &mut TxOf<H>) -> Outcome {
    let pid = h.tx_i64(tx, "SELECT pg_backend_pid()::int8").await?;
    let killed = h
        .side_i64(
            store,
            &format!("SELECT pg_terminate_backend({pid}::int, 5000)::int::int8"),
        )
        .await?;
    check_eq!(killed, 1, "backend {pid} terminated");
    Ok(())
}

fn expect_kind(error: &InboxError, kind: &str, what: &str) -> Outcome {
    check!(
        error.kind() == kind,
        "{what}: expected a {kind} error, got {error:?}"
    );
    Ok(())
}

// ---------------------------------------------------------------- claims

/// Two connections claim one key at the same instant, twenty times:
/// exactly one `Fresh` each time, and the work is done once.
pub async fn concurrent_claims_of_one_key_give_exactly_one_fresh<H: PgHarness>(h: &H) -> Outcome {
    let store = migrated(h, 4).await?;
    for round in 0..20 {
        let key = new_key("race");
        let (mut a, mut b) = (store.begin().await?, store.begin().await?);
        let barrier = Barrier::new(2);
        let attempt = async |tx: &mut TxOf<H>| -> Result<Claim, InboxError> {
            barrier.wait().await;
            let claim = tx.claim(&key).await?;
            if claim == Claim::Fresh {
                h.record_effect(tx, &key).await?;
                // Hold the claim a moment so that the other one waits.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Ok(claim)
        };
        let (ca, cb) = tokio::join!(
            async {
                let c = attempt(&mut a).await?;
                a.commit().await?;
                Ok::<_, InboxError>(c)
            },
            async {
                let c = attempt(&mut b).await?;
                b.commit().await?;
                Ok::<_, InboxError>(c)
            }
        );
        let (ca, cb) = (ca?, cb?);
        let fresh = [ca, cb].iter().filter(|c| **c == Claim::Fresh).count();
        check_eq!(fresh, 1, "round {round}: {ca:?} / {cb:?}");
        expect_exactly_once(h, &store, &key).await?;
    }
    Ok(())
}

/// A claim of a held key waits; the holder's COMMIT makes it `Duplicate`,
/// its ROLLBACK makes it `Fresh`.
pub async fn a_blocked_claim_is_duplicate_after_commit_and_fresh_after_rollback<H: PgHarness>(
    h: &H,
) -> Outcome {
    let store = migrated(h, 4).await?;
    for commit in [true, false] {
        let key = new_key("blocked");
        let mut a = store.begin().await?;
        check_eq!(a.claim(&key).await?, Claim::Fresh, "a's claim");
        let mut b = store.begin().await?;
        let seen = {
            let claim_b = b.claim(&key);
            tokio::pin!(claim_b);
            check!(
                still_pending(&mut claim_b, h.blocking_probe()).await,
                "b's claim must wait for a"
            );
            if commit {
                a.commit().await?;
            } else {
                a.rollback().await?;
            }
            tokio::time::timeout(Duration::from_secs(5), claim_b)
                .await
                .map_err(|_| Failure::new("b's claim still blocked after a ended"))??
        };
        let expected = if commit {
            Claim::Duplicate
        } else {
            Claim::Fresh
        };
        check_eq!(seen, expected, "b's claim after a's commit={commit}");
        b.rollback().await?;
    }
    Ok(())
}

// ------------------------------------------------------- killed backends

/// A real `pg_terminate_backend` (57P01 on the wire, or a closed socket)
/// is a retryable connection error for the next statement.
pub async fn a_terminated_backend_is_a_retryable_connection_error<H: PgHarness>(h: &H) -> Outcome {
    let store = migrated(h, 3).await?;
    let mut tx = store.begin().await?;
    terminate(h, &store, &mut tx).await?;
    let error = match tx.claim(&new_key("dead")).await {
        Ok(claim) => {
            return Err(Failure::new(format!(
                "claim on a killed backend: {claim:?}"
            )));
        }
        Err(error) => error,
    };
    expect_kind(&error, "connection", "claim after kill")?;
    check!(error.is_retryable(), "{error:?}");
    Ok(())
}

/// Killed after the claim, after the work, inside `Inbox::handle`, and
/// racing COMMIT: a redelivery always ends with exactly one effect.
pub async fn a_killed_backend_at_each_crash_point_is_processed_once<H: PgHarness>(
    h: &H,
) -> Outcome {
    let store = migrated(h, 4).await?;
    let inbox = Inbox::new(store.clone());

    for with_work in [false, true] {
        let key = new_key("kill");
        let mut tx = store.begin().await?;
        check_eq!(tx.claim(&key).await?, Claim::Fresh, "claim");
        if with_work {
            h.record_effect(&mut tx, &key).await?;
        }
        terminate(h, &store, &mut tx).await?;
        match h.record_effect(&mut tx, &key).await {
            Ok(()) => return Err(Failure::new("a write on a killed backend succeeded")),
            Err(error) => expect_kind(&error, "connection", "write after kill")?,
        }
        match tx.commit().await {
            Ok(()) => return Err(Failure::new("COMMIT on a killed backend succeeded")),
            Err(error) => check!(error.is_retryable(), "commit after kill: {error:?}"),
        }
        expect_no_trace(h, &store, &key).await?;
        check_eq!(
            redeliver_until_acked(h, &inbox, &key).await?,
            Handled::Processed(()),
            "redelivery"
        );
        expect_exactly_once(h, &store, &key).await?;
    }

    // Inside the middleware: the work's next write meets the dead backend.
    let key = new_key("kill-in-handle");
    let result = inbox
        .handle(&key, async |tx| {
            h.record_effect(tx, &key).await?;
            terminate(h, &store, tx)
                .await
                .map_err(|f| InboxError::InvalidArgument { message: f.message })?;
            h.record_effect(tx, &key).await
        })
        .await;
    match result {
        Ok(handled) => {
            return Err(Failure::new(format!(
                "handled on a dead backend: {handled:?}"
            )));
        }
        Err(error) => {
            expect_kind(&error, "connection", "handle after kill")?;
            check!(error.is_retryable(), "{error:?}");
        }
    }
    expect_no_trace(h, &store, &key).await?;
    check_eq!(
        redeliver_until_acked(h, &inbox, &key).await?,
        Handled::Processed(()),
        "redelivery"
    );
    expect_exactly_once(h, &store, &key).await?;

    // Around COMMIT: whichever wins, redelivery ends with one effect, and a
    // commit that succeeded makes the redelivery a duplicate.
    for round in 0..20u32 {
        let key = new_key("commit-race");
        let mut tx = store.begin().await?;
        check_eq!(tx.claim(&key).await?, Claim::Fresh, "claim");
        h.record_effect(&mut tx, &key).await?;
        let pid = h.tx_i64(&mut tx, "SELECT pg_backend_pid()::int8").await?;
        // Stagger the two across each other's round trips.
        let step = Duration::from_micros(150 * u64::from(round % 5));
        let (commit_delay, kill_delay) = if round % 2 == 0 {
            (Duration::ZERO, step)
        } else {
            (step * 3, Duration::ZERO)
        };
        let kill = async {
            tokio::time::sleep(kill_delay).await;
            h.side_i64(
                &store,
                &format!("SELECT pg_terminate_backend({pid}::int, 5000)::int::int8"),
            )
            .await
        };
        let commit = async {
            tokio::time::sleep(commit_delay).await;
            tx.commit().await
        };
        let (committed, killed) = tokio::join!(commit, kill);
        killed?;
        if let Err(error) = &committed {
            check!(
                error.is_retryable(),
                "a lost COMMIT must be retryable: {error:?}"
            );
        }
        let handled = redeliver_until_acked(h, &inbox, &key).await?;
        if committed.is_ok() {
            check!(
                handled == Handled::Duplicate,
                "round {round}: committed, yet redelivery ran the work"
            );
        }
        expect_exactly_once(h, &store, &key).await?;
    }
    Ok(())
}

/// Crashed transactions (dropped, killed) leave no session of the pool
/// idle inside a transaction, do not hold up the redelivery, and the pool
/// serves claims afterwards.
pub async fn the_pool_is_clean_after_crashes<H: PgHarness>(h: &H) -> Outcome {
    let store = migrated(h, 3).await?;
    let inbox = Inbox::new(store.clone());
    for i in 0..12 {
        let key = new_key("crash");
        let mut tx = store.begin().await?;
        check_eq!(tx.claim(&key).await?, Claim::Fresh, "claim");
        h.record_effect(&mut tx, &key).await?;
        let kind = if i % 2 == 0 {
            crate::CrashKind::Drop
        } else {
            crate::CrashKind::KillConnection
        };
        h.crash(&store, tx, kind).await;
        let handled = tokio::time::timeout(Duration::from_secs(5), deliver(h, &inbox, &key))
            .await
            .map_err(|_| Failure::new(format!("redelivery waited on the {kind:?} claim")))??;
        check_eq!(handled, Handled::Processed(()), "redelivery after {kind:?}");
        expect_exactly_once(h, &store, &key).await?;
    }
    let schema = h.schema_of(&store);
    let started = Instant::now();
    loop {
        let stuck = h
            .side_i64(
                &store,
                &format!(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{schema}' \
                     AND state LIKE 'idle in transaction%'"
                ),
            )
            .await?;
        if stuck == 0 {
            break;
        }
        check!(
            started.elapsed() < Duration::from_secs(5),
            "{stuck} sessions of the pool idle in transaction"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Every connection the pool can hand out at once claims.
    let keys: Vec<InboxKey> = (0..3).map(|_| new_key("after")).collect();
    let mut open = Vec::new();
    for key in &keys {
        let mut tx = store.begin().await?;
        check_eq!(tx.claim(key).await?, Claim::Fresh, "claim after crashes");
        h.record_effect(&mut tx, key).await?;
        open.push(tx);
    }
    for tx in open {
        tx.commit().await?;
    }
    for key in &keys {
        expect_exactly_once(h, &store, key).await?;
    }
    Ok(())
}

// ------------------------------------------------------------ conflicts

/// Two transactions each claim a key, then the other's: a real deadlock.
/// The server aborts one (40P01), which is a retryable conflict.
pub async fn a_deadlock_is_a_retryable_conflict<H: PgHarness>(h: &H) -> Outcome {
    let store = migrated(h, 4).await?;
    let (k1, k2) = (new_key("deadlock"), new_key("deadlock"));
    let mut a = store.begin().await?;
    let mut b = store.begin().await?;
    check_eq!(a.claim(&k1).await?, Claim::Fresh, "a claims k1");
    check_eq!(b.claim(&k2).await?, Claim::Fresh, "b claims k2");
    let (ra, rb) = tokio::join!(a.claim(&k2), b.claim(&k1));
    let errors: Vec<InboxError> = [ra, rb].into_iter().filter_map(Result::err).collect();
    check_eq!(errors.len(), 1, "deadlock victims");
    expect_kind(&errors[0], "conflict", "the deadlock victim")?;
    check!(errors[0].is_retryable(), "{:?}", errors[0]);
    Ok(())
}

/// A migrated store in a new schema, its sessions under `timeouts`, and
/// the suite's effects table.
async fn migrated_with<H: PgHarness>(
    h: &H,
    pool: usize,
    timeouts: SessionTimeouts,
) -> Result<H::Store, Failure> {
    let store = h
        .store_with(&unique_schema(TEST_PREFIX), pool, &timeouts)
        .await;
    h.migrate(&store).await?;
    h.side_execute(&store, EFFECTS_TABLE).await?;
    Ok(store)
}

/// A claim of a key another open transaction holds gives up after the
/// store's `lock_timeout` (set on the session, not by the test) with the
/// retryable [`InboxError::LockTimeout`], which blames the holder, not the
/// message; once the holder commits, the next claim is a duplicate.
pub async fn a_claim_of_a_held_key_gives_up_after_the_lock_timeout<H: PgHarness>(h: &H) -> Outcome {
    let lock_timeout = Duration::from_millis(500);
    let store = migrated_with(
        h,
        4,
        SessionTimeouts {
            lock_timeout: Some(lock_timeout),
            ..SessionTimeouts::default()
        },
    )
    .await?;
    let key = new_key("lock-timeout");
    let mut holder = store.begin().await?;
    check_eq!(
        holder.claim(&key).await?,
        Claim::Fresh,
        "the holder's claim"
    );
    let mut second = store.begin().await?;
    let started = Instant::now();
    let claimed = second.claim(&key).await;
    let waited = started.elapsed();
    drop(second);
    match claimed {
        Ok(claim) => return Err(Failure::new(format!("claim past lock_timeout: {claim:?}"))),
        Err(error) => {
            expect_kind(&error, "lock_timeout", "a claim of a held key")?;
            check!(error.is_retryable() && error.held_by_another(), "{error:?}");
        }
    }
    check!(
        waited >= lock_timeout.mul_f32(0.8) && waited < lock_timeout * 4,
        "gave up after {waited:?}, lock_timeout {lock_timeout:?}"
    );
    h.record_effect(&mut holder, &key).await?;
    holder.commit().await?;
    let mut third = store.begin().await?;
    check_eq!(
        third.claim(&key).await?,
        Claim::Duplicate,
        "after the commit"
    );
    third.rollback().await?;
    expect_exactly_once(h, &store, &key).await
}

/// A holder that stops sending statements inside its transaction (a frozen
/// process, as PostgreSQL sees it) is ended by the server after
/// `idle_in_transaction_session_timeout`: its claim is released, a waiting
/// claim of the key gets `Fresh`, and the holder's own commit fails
/// retryably, so its redelivery finds a duplicate.
pub async fn a_holder_idle_in_its_transaction_is_ended_and_its_key_claimed_again<H: PgHarness>(
    h: &H,
) -> Outcome {
    let idle = Duration::from_secs(2);
    let store = migrated_with(
        h,
        4,
        SessionTimeouts {
            lock_timeout: Some(Duration::from_secs(20)),
            idle_in_transaction: Some(idle),
            ..SessionTimeouts::default()
        },
    )
    .await?;
    let key = new_key("idle-holder");
    let mut frozen = store.begin().await?;
    check_eq!(frozen.claim(&key).await?, Claim::Fresh, "the frozen claim");
    h.record_effect(&mut frozen, &key).await?;
    let started = Instant::now();
    let mut other = store.begin().await?;
    check_eq!(
        other.claim(&key).await?,
        Claim::Fresh,
        "the claim after the server ended the frozen holder"
    );
    let waited = started.elapsed();
    check!(
        waited >= idle.mul_f32(0.8) && waited < idle * 5,
        "claimed after {waited:?}, idle_in_transaction_session_timeout {idle:?}"
    );
    h.record_effect(&mut other, &key).await?;
    other.commit().await?;
    match frozen.commit().await {
        Ok(()) => return Err(Failure::new("the ended holder's commit succeeded")),
        Err(error) => check!(error.is_retryable(), "the ended holder's commit: {error:?}"),
    }
    let inbox = Inbox::new(store.clone());
    check_eq!(
        redeliver_until_acked(h, &inbox, &key).await?,
        Handled::Duplicate,
        "the frozen holder's redelivery"
    );
    expect_exactly_once(h, &store, &key).await
}

/// A transaction dropped while its statement runs (a timeout around
/// `Inbox::handle` fired during a slow query) stops that statement: within
/// a couple of seconds its server process runs nothing and the key it
/// claimed can be claimed again, instead of after the statement's 30 s.
pub async fn a_transaction_dropped_mid_statement_stops_the_statement<H: PgHarness>(
    h: &H,
) -> Outcome {
    let store = migrated(h, 4).await?;
    let key = new_key("dropped-mid-statement");
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&key).await?, Claim::Fresh, "the claim");
    let pid = h.tx_i64(&mut tx, "SELECT pg_backend_pid()::int8").await?;
    let slow = tokio::time::timeout(
        Duration::from_millis(200),
        h.tx_execute(&mut tx, "SELECT pg_sleep(30)"),
    )
    .await;
    check!(slow.is_err(), "pg_sleep(30) returned: {slow:?}");
    let dropped = Instant::now();
    drop(tx);
    let running =
        format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {pid} AND state = 'active'");
    while h.side_i64(&store, &running).await? != 0 {
        check!(
            dropped.elapsed() < Duration::from_secs(3),
            "backend {pid} still runs its statement {:?} after the drop",
            dropped.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut again = store.begin().await?;
    check_eq!(again.claim(&key).await?, Claim::Fresh, "the released key");
    check!(
        dropped.elapsed() < Duration::from_secs(4),
        "the key was released {:?} after the drop",
        dropped.elapsed()
    );
    again.rollback().await?;
    Ok(())
}

/// A serialization failure (40001) is a retryable conflict.
pub async fn a_serialization_failure_is_a_retryable_conflict<H: PgHarness>(h: &H) -> Outcome {
    let store = migrated(h, 2).await?;
    let mut tx = store.begin().await?;
    let raised = h
        .tx_execute(
            &mut tx,
            "DO $$ BEGIN RAISE EXCEPTION 'could not serialize access due to concurrent update' \
             USING ERRCODE = '40001'; END $$",
        )
        .await;
    match raised {
        Ok(()) => Err(Failure::new("RAISE did not fail")),
        Err(error) => {
            expect_kind(&error, "conflict", "40001")?;
            check!(error.is_retryable(), "{error:?}");
            Ok(())
        }
    }
}

/// A schema nobody migrated: 42P01 (undefined table) is a permanent schema
/// error for claims, lookups and the purge alike.
pub async fn a_missing_table_is_a_permanent_schema_error<H: PgHarness>(h: &H) -> Outcome {
    let store = h.store_in(&unique_schema(TEST_PREFIX), 2).await;
    let key = new_key("schema");
    let mut tx = store.begin().await?;
    let claim = tx.claim(&key).await;
    drop(tx);
    let lookup = store.lookup(&key).await;
    let purge = store
        .purge_processed_batch(chrono::Utc::now(), nz(10))
        .await;
    for (what, error) in [
        ("claim", claim.err()),
        ("lookup", lookup.err()),
        ("purge", purge.err()),
    ] {
        let Some(error) = error else {
            return Err(Failure::new(format!("{what} without a table succeeded")));
        };
        expect_kind(&error, "schema", what)?;
        check!(!error.is_retryable(), "{what}: {error:?}");
    }
    Ok(())
}

/// Nothing listens: a retryable error (a failed connection, or a pool
/// that gave up waiting for one, as sqlx's does), not a dead letter.
pub async fn an_unreachable_server_is_a_retryable_connection_error<H: PgHarness>(h: &H) -> Outcome {
    match h.connect_to("postgres://postgres@127.0.0.1:1/test").await {
        Ok(_) => Err(Failure::new("connected to port 1")),
        Err(error) => {
            check!(
                matches!(error.kind(), "connection" | "pool_timeout"),
                "unreachable server: {error:?}"
            );
            check!(error.is_retryable(), "{error:?}");
            Ok(())
        }
    }
}

// --------------------------------------------------------------- cleanup

/// Inserts `n` rows processed `age_days` ago, and as many in flight.
///
/// Their ids are random (v4): in the partitioned layout they live in the
/// untimed partition, which cleanup deletes row by row as the table layout
/// does, so the cleanup scenarios expect the same counts in both layouts.
/// That layout's partition key (`time_ordered`) is written as its claim
/// writes it.
async fn seed<H: PgHarness>(h: &H, store: &H::Store, n: u32, age_days: u32) -> Outcome {
    let (key_column, key_value) = match h.layout() {
        Layout::Table => ("", ""),
        Layout::Partitioned => (", time_ordered", ", false"),
    };
    h.side_execute(
        store,
        &format!(
            "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at{key_column}) \
             SELECT gen_random_uuid(), 'seed', now() - make_interval(days => {age_days}), \
                    now() - make_interval(days => {age_days}){key_value} \
             FROM generate_series(1, {n})"
        ),
    )
    .await?;
    h.side_execute(
        store,
        &format!(
            "INSERT INTO inbox_messages (id, consumer_type{key_column}) \
             SELECT gen_random_uuid(), 'in-flight'{key_value} FROM generate_series(1, {n})"
        ),
    )
    .await?;
    Ok(())
}

/// The purge statement's plan walks the partial index on `processed_at`,
/// and the purge deletes exactly the processed rows older than the cutoff.
/// The statement is the layout's (in the partitioned one, the untimed
/// partition's).
pub async fn purge_uses_the_partial_index_and_deletes_exactly_the_expired_rows<H: PgHarness>(
    h: &H,
) -> Outcome {
    let store = migrated(h, 2).await?;
    seed(h, &store, 20_000, 1).await?;
    seed(h, &store, 200, 30).await?;
    h.side_execute(&store, "ANALYZE inbox_messages").await?;
    let purge = h
        .layout()
        .purge_batch()
        .replace("$1", "now() - interval '7 days'")
        .replace("$3", "1000");
    expect_index(
        h,
        &store,
        &purge.replace("$2", "NULL"),
        "inbox_messages_processed_at_idx",
        &["inbox_messages"],
    )
    .await?;
    // A batch that resumes starts its index scan at the resume point, so
    // it never walks the entries of the rows the batches before it deleted.
    let resumed = h
        .explain(&store, &purge.replace("$2", "(now() - interval '30 days')"))
        .await?;
    check!(
        resumed
            .iter()
            .any(|l| l.contains("Index Cond") && l.contains("processed_at >=")),
        "the resume point is not a bound of the index scan:\n{}",
        resumed.join("\n")
    );
    let cutoff = chrono::Utc::now() - chrono::Duration::days(7);
    let mut purged = 0;
    loop {
        let n = store.purge_processed_batch(cutoff, nz(64)).await?;
        check!(n <= 64, "a batch of 64 deleted {n}");
        if n == 0 {
            break;
        }
        purged += n;
    }
    check_eq!(purged, 200, "purged rows");
    // Again through the purge that resumes from batch to batch: the 200
    // rows share one processed_at (one INSERT's now()), more than a batch
    // of 64 holds, so each batch resumes at the time the one before it
    // stopped at and must still find the rest.
    seed(h, &store, 200, 30).await?;
    check_eq!(
        store.purge_processed_before(cutoff, nz(64)).await?,
        200,
        "rows purged in resumed batches"
    );
    let left = h
        .side_i64(&store, "SELECT count(*) FROM inbox_messages")
        .await?;
    check_eq!(left, 40_400, "recent and in-flight rows kept");
    Ok(())
}

/// Two cleaners at once, while a transaction holds some of the old rows:
/// nobody waits, nobody fails, and together they delete every row once.
pub async fn concurrent_cleaners_skip_each_others_rows<H: PgHarness>(h: &H) -> Outcome {
    let store = migrated(h, 4).await?;
    seed(h, &store, 100, 30).await?;
    let cutoff = chrono::Utc::now() - chrono::Duration::days(7);
    let mut holder = store.begin().await?;
    h.tx_execute(
        &mut holder,
        "SELECT 1 FROM inbox_messages WHERE consumer_type = 'seed' \
         ORDER BY processed_at, id LIMIT 30 FOR UPDATE",
    )
    .await?;
    let started = Instant::now();
    let (a, b) = tokio::join!(
        store.purge_processed_batch(cutoff, nz(50)),
        store.purge_processed_batch(cutoff, nz(50))
    );
    let (a, b) = (a?, b?);
    check!(
        started.elapsed() < Duration::from_secs(2),
        "a cleaner waited"
    );
    check!(a <= 50 && b <= 50, "batches of 50 deleted {a} and {b}");
    let mut rest = 0;
    loop {
        let n = store.purge_processed_batch(cutoff, nz(50)).await?;
        if n == 0 {
            break;
        }
        rest += n;
    }
    check_eq!(a + b + rest, 70, "every unlocked old row, once");
    holder.rollback().await?;
    let locked = store.purge_processed_batch(cutoff, nz(50)).await?;
    check_eq!(locked, 30, "the rows the holder had locked");
    let left = h
        .side_i64(&store, "SELECT count(*) FROM inbox_messages")
        .await?;
    check_eq!(left, 100, "in-flight rows kept");
    Ok(())
}

/// Nothing to purge: zero, no error.
pub async fn purge_on_an_empty_table_deletes_nothing<H: PgHarness>(h: &H) -> Outcome {
    let store = migrated(h, 1).await?;
    let n = store
        .purge_processed_batch(chrono::Utc::now(), nz(100))
        .await?;
    check_eq!(n, 0, "purged from an empty table");
    Ok(())
}

// --------------------------------------------------------------- batches

/// Two batches of the same twenty keys in opposite orders: the batch claim
/// sorts them in SQL, so both lock in one order and one waits for the other
/// instead of deadlocking.
pub async fn overlapping_batches_in_opposite_orders_do_not_deadlock<H: PgHarness>(
    h: &H,
) -> Outcome {
    let store = migrated(h, 4).await?;
    for round in 0..20 {
        let keys: Vec<InboxKey> = (0..20).map(|_| new_key("batch")).collect();
        let mut reversed = keys.clone();
        reversed.reverse();
        let barrier = Arc::new(Barrier::new(2));
        let claim = async |batch: Vec<InboxKey>| -> Result<usize, InboxError> {
            let mut tx = store.begin().await?;
            barrier.wait().await;
            let claims = tx.claim_batch(&batch).await?;
            tx.commit().await?;
            Ok(claims.iter().filter(|c| **c == Claim::Fresh).count())
        };
        let (a, b) = tokio::join!(claim(keys), claim(reversed));
        let fresh = a.map_err(|e| Failure::new(format!("round {round}: {e:?}")))?
            + b.map_err(|e| Failure::new(format!("round {round}: {e:?}")))?;
        check_eq!(fresh, 20, "round {round}: each key Fresh exactly once");
    }
    let rows = h
        .side_i64(
            &store,
            "SELECT count(*) FROM inbox_messages WHERE processed_at IS NOT NULL",
        )
        .await?;
    check_eq!(rows, 400, "processed rows");
    Ok(())
}

/// Savepoints nest like SQL's although their RELEASE is deferred to the
/// next SAVEPOINT (or to COMMIT): released work stays with its parent,
/// rolling back the parent undoes it, and the keys the transaction holds
/// follow the same rules.
pub async fn nested_savepoints_with_deferred_release_keep_sql_semantics<H: PgHarness>(
    h: &H,
) -> Outcome {
    let store = migrated(h, 3).await?;
    let [kept, undone_with_parent, undone, later] = [(); 4].map(|()| new_key("savepoints"));
    let mut tx = store.begin().await?;
    check_eq!(tx.claim(&kept).await?, Claim::Fresh, "claim kept");

    // Outer savepoint; inside it a claim and a released inner savepoint.
    tx.savepoint().await?;
    check_eq!(
        tx.claim(&undone_with_parent).await?,
        Claim::Fresh,
        "claim in outer"
    );
    tx.savepoint().await?;
    h.record_effect(&mut tx, &undone_with_parent).await?;
    tx.release_savepoint().await?;
    // Rolling back the outer one undoes the released inner work and claim.
    tx.rollback_to_savepoint().await?;
    let unclaimed = tx.unclaim(&undone_with_parent).await;
    check!(
        matches!(unclaimed, Err(InboxError::InvalidArgument { .. })),
        "the claim was rolled back, so it is not held: {unclaimed:?}"
    );

    // Released then followed by another savepoint that is rolled back:
    // the released work stays, the later one goes.
    tx.savepoint().await?;
    h.record_effect(&mut tx, &kept).await?;
    tx.release_savepoint().await?;
    tx.savepoint().await?;
    check_eq!(tx.claim(&undone).await?, Claim::Fresh, "claim undone");
    h.record_effect(&mut tx, &undone).await?;
    tx.rollback_to_savepoint().await?;
    check!(
        tx.rollback_to_savepoint().await.is_err(),
        "no savepoint left"
    );

    // An unclaim inside a savepoint that is rolled back is undone too.
    check_eq!(tx.claim(&later).await?, Claim::Fresh, "claim later");
    tx.savepoint().await?;
    tx.unclaim(&later).await?;
    tx.rollback_to_savepoint().await?;
    tx.savepoint().await?;
    tx.unclaim(&later).await?;
    tx.rollback_to_savepoint().await?;

    // A savepoint released and never followed by another: COMMIT covers it.
    tx.savepoint().await?;
    h.record_effect(&mut tx, &later).await?;
    tx.release_savepoint().await?;
    tx.commit().await?;

    expect_exactly_once(h, &store, &kept).await?;
    expect_exactly_once(h, &store, &later).await?;
    expect_no_trace(h, &store, &undone_with_parent).await?;
    expect_no_trace(h, &store, &undone).await
}

// ------------------------------------------------------------ migrations

/// Two instances migrate one new schema at once: both succeed, exactly one
/// applies, and the ledger lists every migration once.
pub async fn concurrent_migrations_of_one_schema_succeed<H: PgHarness>(h: &H) -> Outcome {
    let schema = unique_schema(TEST_PREFIX);
    let (a, b) = tokio::join!(h.store_in(&schema, 2), h.store_in(&schema, 2));
    let (ra, rb) = tokio::join!(h.migrate(&a), h.migrate(&b));
    let (ra, rb) = (ra?, rb?);
    let all: Vec<i64> = MIGRATIONS.iter().map(|m| m.version).collect();
    check!(
        (ra == all && rb.is_empty()) || (rb == all && ra.is_empty()),
        "exactly one runner applies: {ra:?} / {rb:?}"
    );
    check!(
        h.migrate(&a).await?.is_empty(),
        "migrating again applies nothing"
    );
    let recorded = h
        .side_i64(&a, &format!("SELECT count(*) FROM {LEDGER_TABLE}"))
        .await?;
    check_eq!(
        recorded,
        i64::try_from(MIGRATIONS.len()).unwrap_or(i64::MAX),
        "ledger rows"
    );
    Ok(())
}

/// A migration whose recorded checksum differs from the embedded file is
/// refused as a permanent schema error.
pub async fn an_edited_migration_is_refused<H: PgHarness>(h: &H) -> Outcome {
    let store = migrated(h, 2).await?;
    h.side_execute(
        &store,
        &format!("UPDATE {LEDGER_TABLE} SET checksum = checksum + 1"),
    )
    .await?;
    match h.migrate(&store).await {
        Ok(applied) => Err(Failure::new(format!(
            "an edited migration was accepted: {applied:?}"
        ))),
        Err(error) => expect_kind(&error, "schema", "edited migration"),
    }
}

/// A migration cancelled while it holds the runner's advisory lock does not
/// leave that lock behind, where it would block every other instance's
/// migration of this database.
pub async fn a_cancelled_migration_does_not_block_other_instances<H: PgHarness>(h: &H) -> Outcome {
    let schema = unique_schema(TEST_PREFIX);
    let first = h.store_in(&schema, 3).await;
    h.migrate(&first).await?;
    // Hold the ledger, so that the next migration takes the advisory lock
    // and then waits.
    let mut blocker = first.begin().await?;
    h.tx_execute(
        &mut blocker,
        &format!("LOCK TABLE {LEDGER_TABLE} IN ACCESS EXCLUSIVE MODE"),
    )
    .await?;
    let cancelled = tokio::time::timeout(Duration::from_millis(500), h.migrate(&first)).await;
    check!(cancelled.is_err(), "the migration waited and was cancelled");
    blocker.rollback().await?;
    let other = h.store_in(&schema, 1).await;
    let migrated = tokio::time::timeout(Duration::from_secs(10), h.migrate(&other))
        .await
        .map_err(|_| Failure::new("another instance's migration is blocked"))??;
    check!(migrated.is_empty(), "nothing left to apply: {migrated:?}");
    Ok(())
}
