//! The sqlx backend's own tests against the real PostgreSQL, beyond the
//! shared suite: real concurrency on separate connections, lock waits seen
//! in `pg_stat_activity`, crashes injected with `pg_terminate_backend` (and
//! a commit whose answer is lost on the wire), pool hygiene after crashes,
//! classification of real server errors, and cleanup on 100,000 rows.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use common::relay::Relay;
use common::{backend_pid, create_effects_table, effects_of, fresh_store, record_effect};
use inbox_api::{
    BatchTransaction, Claim, ConsumerName, Handled, Inbox, InboxError, InboxKey, InboxStore,
    InboxStoreExt, InboxTransaction, MessageId,
};

fn nz(n: u32) -> std::num::NonZeroU32 {
    std::num::NonZeroU32::new(n).expect("non-zero")
}
use inbox_backend_sqlx::{PURGE_BATCH, SqlxStore};
use sqlx::postgres::PgPoolOptions;
use tokio::sync::Barrier;

fn new_key(consumer: &str) -> InboxKey {
    InboxKey::new(
        MessageId::new_v7(),
        ConsumerName::new(consumer).expect("valid consumer"),
    )
}

/// Polls `probe` until it holds, for at most `limit`.
async fn eventually<F, Fut>(what: &str, limit: Duration, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while !probe().await {
        assert!(start.elapsed() < limit, "{what} not seen within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// What server process `pid` is waiting for (`Lock`, `Timeout`, …), if any.
async fn wait_event_type(store: &SqlxStore, pid: i32) -> Option<String> {
    sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
        .bind(pid)
        .fetch_optional(store.pool())
        .await
        .expect("read pg_stat_activity")
        .flatten()
}

/// Redelivers `key` through the middleware and returns what it did.
async fn redeliver(store: &SqlxStore, key: &InboxKey) -> Handled<()> {
    Inbox::new(store.clone())
        .handle(key, async |tx| record_effect(tx, key).await)
        .await
        .expect("redelivery")
}

/// After a crash and a redelivery: one effect, one processed row.
async fn assert_processed_once(store: &SqlxStore, key: &InboxKey) {
    assert_eq!(effects_of(store, key).await, 1, "effects of {key}");
    let row = store.lookup(key).await.expect("lookup");
    assert!(
        row.as_ref().is_some_and(|r| r.processed_at.is_some()),
        "row of {key}: {row:?}"
    );
}

async fn assert_no_trace(store: &SqlxStore, key: &InboxKey) {
    assert_eq!(effects_of(store, key).await, 0, "effects of {key}");
    let row = store.lookup(key).await.expect("lookup");
    assert!(row.is_none(), "row of {key} left behind: {row:?}");
}

// ---------------------------------------------------------------- claims

/// Two connections claim one key at the same instant, 50 times: exactly one
/// `Fresh` each time, never two, never none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_connections_claiming_one_key_get_exactly_one_fresh() {
    let store = fresh_store(4).await;
    for round in 0..50 {
        let key = new_key("race");
        let barrier = Arc::new(Barrier::new(2));
        let claimers = (0..2).map(|_| {
            let (store, key, barrier) = (store.clone(), key.clone(), barrier.clone());
            tokio::spawn(async move {
                // Both transactions are open on their own connections
                // before either claims.
                let mut tx = store.begin().await.expect("begin");
                barrier.wait().await;
                let claim = tx.claim(&key).await.expect("claim");
                match claim {
                    Claim::Fresh => {
                        tx.commit().await.expect("commit");
                    }
                    Claim::Duplicate => tx.rollback().await.expect("rollback"),
                }
                claim
            })
        });
        let claims = futures::future::join_all(claimers).await;
        let fresh = claims
            .into_iter()
            .map(|c| c.expect("claimer task"))
            .filter(|c| *c == Claim::Fresh)
            .count();
        assert_eq!(fresh, 1, "round {round}: Fresh claims of one key");
    }
    assert_eq!(common::count(&store, "inbox_messages").await, 50);
}

async fn blocked_claim(commit_first: bool) {
    let store = fresh_store(4).await;
    let key = new_key("blocked");
    let mut a = store.begin().await.expect("begin A");
    assert_eq!(a.claim(&key).await.expect("A claims"), Claim::Fresh);
    let a_pid = backend_pid(&mut a).await.expect("A's pid");

    let mut b = store.begin().await.expect("begin B");
    let b_pid = backend_pid(&mut b).await.expect("B's pid");
    let b_key = key.clone();
    let b_claim = tokio::spawn(async move {
        let claim = b.claim(&b_key).await;
        (b, claim)
    });

    // B is waiting on a lock held by A, as the server itself reports: not
    // just slow.
    eventually("B waiting on a lock", Duration::from_secs(5), || async {
        wait_event_type(&store, b_pid).await.as_deref() == Some("Lock")
    })
    .await;
    let blockers: Vec<i32> = sqlx::query_scalar("SELECT unnest(pg_blocking_pids($1))")
        .bind(b_pid)
        .fetch_all(store.pool())
        .await
        .expect("pg_blocking_pids");
    assert_eq!(blockers, vec![a_pid], "B is blocked by A and only A");

    if commit_first {
        a.commit().await.expect("commit A");
    } else {
        a.rollback().await.expect("rollback A");
    }
    let (b, claim) = tokio::time::timeout(Duration::from_secs(5), b_claim)
        .await
        .expect("B's claim returns once A ended")
        .expect("B's task");
    let claim = claim.expect("B's claim");
    if commit_first {
        assert_eq!(claim, Claim::Duplicate, "after A committed");
        b.rollback().await.expect("rollback B");
    } else {
        assert_eq!(claim, Claim::Fresh, "after A rolled back");
        b.commit().await.expect("commit B");
    }
    let row = store.lookup(&key).await.expect("lookup");
    assert!(row.is_some_and(|r| r.processed_at.is_some()));
}

/// A claim blocked by an uncommitted claim answers `Duplicate` once the
/// holder commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_claim_is_duplicate_after_commit() {
    blocked_claim(true).await;
}

/// A claim blocked by an uncommitted claim answers `Fresh` once the holder
/// rolls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_claim_is_fresh_after_rollback() {
    blocked_claim(false).await;
}

/// A duplicate is an outcome, never a unique violation, even when the
/// duplicate claim raced with the first one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_deliveries_run_the_work_once() {
    let store = fresh_store(10).await;
    create_effects_table(&store).await;
    let inbox = Arc::new(Inbox::new(store.clone()));
    for _ in 0..10 {
        let key = new_key("burst");
        let barrier = Arc::new(Barrier::new(8));
        let deliveries = (0..8).map(|_| {
            let (inbox, key, barrier) = (inbox.clone(), key.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                inbox
                    .handle(&key, async |tx| record_effect(tx, &key).await)
                    .await
            })
        });
        let mut processed = 0;
        for result in futures::future::join_all(deliveries).await {
            if let Handled::Processed(()) = result.expect("task").expect("handle") {
                processed += 1;
            }
        }
        assert_eq!(processed, 1);
        assert_processed_once(&store, &key).await;
    }
}

// --------------------------------------------------------------- crashes

/// The connection is killed right after the claim: no trace, and the
/// redelivery runs the work once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_claim_then_redelivered_once() {
    let store = fresh_store(4).await;
    create_effects_table(&store).await;
    let key = new_key("crash");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Fresh);
    common::kill(&store, tx).await;
    assert_no_trace(&store, &key).await;
    assert_eq!(redeliver(&store, &key).await, Handled::Processed(()));
    assert_eq!(redeliver(&store, &key).await, Handled::Duplicate);
    assert_processed_once(&store, &key).await;
}

/// The connection is killed after the work, before COMMIT: the effect
/// vanishes with the claim; the redelivery runs it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_work_then_redelivered_once() {
    let store = fresh_store(4).await;
    create_effects_table(&store).await;
    let key = new_key("crash");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Fresh);
    record_effect(&mut tx, &key).await.expect("work");
    common::kill(&store, tx).await;
    assert_no_trace(&store, &key).await;
    assert_eq!(redeliver(&store, &key).await, Handled::Processed(()));
    assert_processed_once(&store, &key).await;
}

/// The connection dies inside the work, under the middleware: `handle`
/// reports a retryable connection error, and the redelivery runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_inside_handle_is_retryable_and_redelivered_once() {
    let store = fresh_store(4).await;
    create_effects_table(&store).await;
    let key = new_key("crash");
    let killer = store.clone();
    let result = Inbox::new(store.clone())
        .handle(&key, async |tx| {
            record_effect(tx, &key).await?;
            let pid = backend_pid(tx).await?;
            assert!(common::terminate(killer.pool(), pid).await);
            // The next write meets the dead connection.
            record_effect(tx, &key).await
        })
        .await;
    let error = result.expect_err("the connection was killed");
    assert!(
        matches!(error, InboxError::Connection { .. }),
        "a killed connection is a Connection error: {error:?}"
    );
    assert!(error.is_retryable());
    assert_no_trace(&store, &key).await;
    assert_eq!(redeliver(&store, &key).await, Handled::Processed(()));
    assert_processed_once(&store, &key).await;
}

/// The connection is killed while the server is executing COMMIT (held
/// there by a deferred trigger that sleeps): the commit fails, nothing is
/// committed, and the redelivery runs the work once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_during_commit_then_redelivered_once() {
    let store = fresh_store(4).await;
    create_effects_table(&store).await;
    for ddl in [
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep(0.5); RETURN NULL; END $$",
        "CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON conformance_effects \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()",
    ] {
        sqlx::query(ddl)
            .execute(store.pool())
            .await
            .expect("slow commit trigger");
    }
    let key = new_key("crash");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Fresh);
    record_effect(&mut tx, &key).await.expect("work");
    let pid = backend_pid(&mut tx).await.expect("pid");
    let commit = tokio::spawn(tx.commit());
    eventually(
        "COMMIT sleeping in the deferred trigger",
        Duration::from_secs(5),
        || async {
            let activity: Option<(Option<String>, Option<String>)> =
                sqlx::query_as("SELECT query, wait_event FROM pg_stat_activity WHERE pid = $1")
                    .bind(pid)
                    .fetch_optional(store.pool())
                    .await
                    .expect("pg_stat_activity");
            matches!(activity, Some((Some(q), Some(w))) if q == "COMMIT" && w == "PgSleep")
        },
    )
    .await;
    assert!(common::terminate(store.pool(), pid).await);
    let error = commit
        .await
        .expect("commit task")
        .expect_err("COMMIT of a killed backend");
    assert!(error.is_retryable(), "{error:?}");
    assert_no_trace(&store, &key).await;
    assert_eq!(redeliver(&store, &key).await, Handled::Processed(()));
    assert_processed_once(&store, &key).await;
}

/// COMMIT reaches the server and commits, but its answer never reaches the
/// client, whose connection then breaks: the consumer sees a retryable
/// error and cannot know the outcome. The redelivery finds out: `Duplicate`,
/// and the effect stays single.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_answer_lost_then_redelivery_is_duplicate() {
    let store = fresh_store(4).await;
    create_effects_table(&store).await;

    let relay = Relay::start(common::server_addr().await).await;
    let options = SqlxStore::connect_options(&common::database_url(), store.schema())
        .expect("options")
        .host("127.0.0.1")
        .port(relay.port());
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .expect("connect through the relay");
    let relayed = SqlxStore::new(pool, store.schema()).expect("store");

    let key = new_key("lost");
    let mut tx = relayed.begin().await.expect("begin");
    assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Fresh);
    record_effect(&mut tx, &key).await.expect("work");
    let port = common::client_port(&mut tx).await.expect("relayed port");

    relay.swallow_answers(port);
    let commit = tokio::spawn(tx.commit());
    eventually(
        "the commit, from another connection",
        Duration::from_secs(5),
        || async { store.lookup(&key).await.expect("lookup").is_some() },
    )
    .await;
    relay.cut(port);

    let error = tokio::time::timeout(Duration::from_secs(5), commit)
        .await
        .expect("commit returns once the connection is cut")
        .expect("commit task")
        .expect_err("the answer was lost");
    assert!(
        matches!(error, InboxError::Connection { .. }),
        "lost answer: {error:?}"
    );
    assert!(error.is_retryable());

    assert_eq!(redeliver(&store, &key).await, Handled::Duplicate);
    assert_processed_once(&store, &key).await;
}

/// COMMIT and `pg_terminate_backend` race, 30 times: whatever each outcome
/// (committed and answered, committed with the answer lost, or killed
/// first), one redelivery settles it to exactly one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_racing_commit_then_redelivery_settles_to_one_effect() {
    let store = fresh_store(6).await;
    create_effects_table(&store).await;
    let (mut answered, mut lost_but_committed, mut not_committed) = (0, 0, 0);
    for i in 0..30 {
        let key = new_key("race");
        let mut tx = store.begin().await.expect("begin");
        assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Fresh);
        record_effect(&mut tx, &key).await.expect("work");
        let pid = backend_pid(&mut tx).await.expect("pid");
        let mut killer = store.pool().acquire().await.expect("killer connection");
        // Vary who goes first: the kill sent first, together, or a little
        // after the COMMIT.
        let kill = async {
            match i % 3 {
                0 => {}
                1 => tokio::task::yield_now().await,
                _ => tokio::time::sleep(Duration::from_millis(1)).await,
            }
            sqlx::query("SELECT pg_terminate_backend($1, 5000)")
                .bind(pid)
                .execute(&mut *killer)
                .await
        };
        let (killed, committed) = if i % 3 == 0 {
            let (killed, committed) = tokio::join!(kill, tx.commit());
            (killed, committed)
        } else {
            let (committed, killed) = tokio::join!(tx.commit(), kill);
            (killed, committed)
        };
        killed.expect("pg_terminate_backend");
        drop(killer);
        let durable = store.lookup(&key).await.expect("lookup").is_some();
        match (committed, durable) {
            (Ok(()), true) => answered += 1,
            (Ok(()), false) => panic!("COMMIT answered Ok but nothing was committed"),
            (Err(e), true) => {
                assert!(e.is_retryable(), "{e:?}");
                lost_but_committed += 1;
            }
            (Err(e), false) => {
                assert!(e.is_retryable(), "{e:?}");
                not_committed += 1;
            }
        }
        let redelivered = redeliver(&store, &key).await;
        assert_eq!(redelivered.is_duplicate(), durable, "redelivery of {key}");
        assert_processed_once(&store, &key).await;
    }
    println!(
        "commit/kill race outcomes: {answered} answered, {lost_but_committed} committed \
         with the answer lost, {not_committed} not committed"
    );
}

/// After a series of dropped and killed transactions, no connection of the
/// pool is left inside a transaction, and every one of them works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_is_clean_after_crashes() {
    const SIZE: u32 = 3;
    let store = fresh_store(SIZE).await;
    create_effects_table(&store).await;
    let admin = common::admin_pool().await;
    for i in 0..12 {
        let key = new_key("crash");
        let mut tx = store.begin().await.expect("begin");
        assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Fresh);
        record_effect(&mut tx, &key).await.expect("work");
        if i % 2 == 0 {
            drop(tx);
        } else {
            common::kill(&store, tx).await;
        }
        // The dropped claim must not hold up the redelivery.
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(5), redeliver(&store, &key))
                .await
                .expect("redelivery does not wait on the crashed claim"),
            Handled::Processed(())
        );
        assert_processed_once(&store, &key).await;
    }

    // The server's view: none of this pool's sessions idles inside a
    // transaction (a dropped sqlx transaction only queues its ROLLBACK; the
    // pool flushes it on release).
    eventually(
        "no session of the pool idle in transaction",
        Duration::from_secs(5),
        || async {
            let stuck: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
            )
            .bind(store.schema())
            .fetch_one(&admin)
            .await
            .expect("pg_stat_activity");
            stuck == 0
        },
    )
    .await;

    // The client's view: every connection the pool hands out, all at once,
    // starts outside a transaction and can claim.
    let mut held = Vec::new();
    for _ in 0..SIZE {
        held.push(store.pool().acquire().await.expect("acquire"));
    }
    for conn in &mut held {
        // SAVEPOINT is refused (25P01) outside a transaction block: the
        // probe that tells whether a session is inside one.
        let probe = sqlx::query("SAVEPOINT probe").execute(&mut **conn).await;
        let code = probe
            .as_ref()
            .err()
            .and_then(sqlx::Error::as_database_error)
            .and_then(|db| db.code().map(|c| c.into_owned()));
        assert_eq!(
            code.as_deref(),
            Some("25P01"),
            "a pooled connection is still inside a transaction: {probe:?}"
        );
    }
    drop(held);
    assert_eq!(
        redeliver(&store, &new_key("after")).await,
        Handled::Processed(())
    );
}

// ----------------------------------------------------- error classification

/// A real `pg_terminate_backend` (SQLSTATE 57P01 on the wire, or a closed
/// socket) is a retryable connection error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_backend_is_a_retryable_connection_error() {
    let store = fresh_store(3).await;
    let mut tx = store.begin().await.expect("begin");
    let pid = backend_pid(&mut tx).await.expect("pid");
    assert!(common::terminate(store.pool(), pid).await);
    let error = tx
        .claim(&new_key("dead"))
        .await
        .expect_err("claim on a killed connection");
    assert!(matches!(error, InboxError::Connection { .. }), "{error:?}");
    assert!(error.is_retryable());
    let source = std::error::Error::source(&error).expect("source kept");
    let sqlx_error = source.downcast_ref::<sqlx::Error>().expect("a sqlx error");
    println!("a terminated backend surfaced as {sqlx_error:?}");
    match sqlx_error {
        sqlx::Error::Database(db) => {
            assert_eq!(db.code().as_deref(), Some("57P01"), "{db}");
        }
        sqlx::Error::Io(_) => {}
        other => panic!("unexpected error for a terminated backend: {other:?}"),
    }
}

/// A schema nobody migrated: `42P01` (undefined table) is a permanent
/// schema error, for claims and lookups alike; the database is fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_is_a_permanent_schema_error() {
    let schema = common::unique_schema(common::TEST_PREFIX);
    let unmigrated = common::connect(&schema).await;
    let mut tx = unmigrated.begin().await.expect("begin");
    let error = tx.claim(&new_key("x")).await.expect_err("no table");
    assert!(matches!(error, InboxError::Schema { .. }), "{error:?}");
    assert!(!error.is_retryable());
    let code = std::error::Error::source(&error)
        .and_then(|s| s.downcast_ref::<sqlx::Error>())
        .and_then(sqlx::Error::as_database_error)
        .and_then(|db| db.code().map(|c| c.into_owned()));
    assert_eq!(code.as_deref(), Some("42P01"));
    drop(tx);

    let error = unmigrated
        .lookup(&new_key("x"))
        .await
        .expect_err("lookup without a table");
    assert!(matches!(error, InboxError::Schema { .. }), "{error:?}");
}

/// A pool whose connections do not use the store's schema is refused by
/// `migrate` instead of migrating some other schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_refuses_a_pool_without_the_search_path() {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&common::database_url())
        .await
        .unwrap_or_else(|error| common::unreachable_database(&error));
    let schema = common::unique_schema(common::TEST_PREFIX);
    let store = SqlxStore::new(pool, &schema).expect("valid name");
    let error = store.migrate().await.expect_err("wrong search_path");
    assert!(
        matches!(error, InboxError::InvalidArgument { .. }),
        "{error:?}"
    );
}

/// Migrating is idempotent and safe from several instances at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_of_one_schema_succeed() {
    let schema = common::unique_schema(common::TEST_PREFIX);
    let (a, b) = tokio::join!(common::connect(&schema), common::connect(&schema));
    let (ra, rb) = tokio::join!(a.migrate(), b.migrate());
    ra.expect("migrate a");
    rb.expect("migrate b");
    a.migrate().await.expect("migrate again");
    let versions: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(a.pool())
        .await
        .expect("migrations table in the store's schema");
    let files = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../migrations"))
        .expect("the workspace's migrations")
        .filter(|entry| {
            entry
                .as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "sql"))
        })
        .count();
    assert_eq!(versions, i64::try_from(files).expect("few files"));
}

/// No server at the address: a retryable connection error, not a panic.
#[tokio::test]
async fn an_unreachable_server_is_a_retryable_error() {
    // Port 1 on loopback: nothing listens there.
    let error = SqlxStore::connect("postgres://postgres@127.0.0.1:1/test", "inbox")
        .await
        .expect_err("nothing listens on port 1");
    assert!(error.is_retryable(), "{error:?}");
}

// ---------------------------------------------------------------- cleanup

const ROWS: i64 = 100_000;

/// 100,000 rows: 10% never processed, 30% processed within the last day,
/// 60% processed 8 to 27 days ago.
async fn fill(store: &SqlxStore) {
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) \
         SELECT gen_random_uuid(), 'consumer-' || (i % 3), now() - interval '30 days', \
                CASE WHEN i % 10 = 0 THEN NULL \
                     WHEN i % 10 < 4 THEN now() - make_interval(mins => (i % 1000)::int) \
                     ELSE now() - make_interval(days => (8 + i % 20)::int) END \
         FROM generate_series(1, $1::bigint) AS i",
    )
    .bind(ROWS)
    .execute(store.pool())
    .await
    .expect("fill");
    sqlx::query("ANALYZE inbox_messages")
        .execute(store.pool())
        .await
        .expect("analyze");
}

async fn count_where(store: &SqlxStore, predicate: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM inbox_messages WHERE {predicate}"
    ))
    .fetch_one(store.pool())
    .await
    .expect("count")
}

/// On 100,000 rows the batch delete finds its rows through the partial
/// index on `processed_at` (EXPLAIN says so), deletes exactly the expired
/// processed rows, batch by batch, and keeps unprocessed and recent ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_uses_the_index_and_deletes_exactly_the_expired_rows() {
    let store = fresh_store(3).await;
    fill(&store).await;
    let cutoff = Utc::now() - chrono::Duration::days(7);

    let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {PURGE_BATCH}"))
        .bind(cutoff)
        .bind(1000_i64)
        .fetch_all(store.pool())
        .await
        .expect("explain");
    let plan = plan.join("\n");
    println!("{plan}");
    assert!(
        plan.contains("inbox_messages_processed_at_idx"),
        "the purge must use the processed_at index:\n{plan}"
    );
    assert!(
        !plan.contains("Seq Scan"),
        "the purge must not scan the table:\n{plan}"
    );

    let expired = ROWS * 6 / 10;
    assert_eq!(
        count_where(&store, "processed_at < now() - interval '7 days'").await,
        expired
    );
    assert_eq!(
        store
            .purge_processed_batch(cutoff, nz(1000))
            .await
            .expect("one batch"),
        1000,
        "a batch is bounded by its limit"
    );
    let started = Instant::now();
    let rest = store
        .purge_processed_before(cutoff, nz(5000))
        .await
        .expect("purge");
    println!("purged {rest} rows in {:?}", started.elapsed());
    assert_eq!(rest, u64::try_from(expired - 1000).expect("positive"));

    assert_eq!(count_where(&store, "processed_at IS NULL").await, ROWS / 10);
    assert_eq!(
        count_where(&store, "processed_at IS NOT NULL").await,
        ROWS * 3 / 10,
        "recent processed rows stay"
    );
    assert_eq!(
        count_where(&store, "processed_at < now() - interval '7 days'").await,
        0
    );
}

/// Two cleaners at once neither fail nor block each other, and together
/// delete each expired row exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_purges_share_the_work() {
    let store = fresh_store(4).await;
    fill(&store).await;
    let cutoff = Utc::now() - chrono::Duration::days(7);
    let (a, b) = tokio::join!(
        store.purge_processed_before(cutoff, nz(500)),
        store.purge_processed_before(cutoff, nz(500))
    );
    let (a, b) = (a.expect("cleaner a"), b.expect("cleaner b"));
    println!("cleaner a deleted {a}, cleaner b {b}");
    assert_eq!(a + b, u64::try_from(ROWS * 6 / 10).expect("positive"));
    assert_eq!(
        count_where(&store, "processed_at < now() - interval '7 days'").await,
        0
    );
    assert_eq!(count_where(&store, "true").await, ROWS * 4 / 10);
}

/// The purge's bind types match the statement (a batch on an empty table).
#[tokio::test]
async fn purge_on_an_empty_table_deletes_nothing() {
    let store = fresh_store(2).await;
    let deleted = store
        .purge_processed_batch(Utc::now(), nz(10))
        .await
        .expect("purge");
    assert_eq!(deleted, 0);
}

// --------------------------------------------------------------- batches

/// Two batches over the same keys, claimed at once in opposite orders,
/// 20 times: the claim statement sorts the keys, so the batches lock in one
/// order and one waits for the other instead of deadlocking (40P01).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_batches_in_opposite_orders_do_not_deadlock() {
    let store = fresh_store(4).await;
    for round in 0..20 {
        let keys: Vec<InboxKey> = (0..20).map(|_| new_key("batch")).collect();
        let mut reversed = keys.clone();
        reversed.reverse();
        let barrier = Arc::new(Barrier::new(2));
        let claimers = [keys.clone(), reversed].map(|batch| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                let mut tx = store.begin().await.expect("begin");
                barrier.wait().await;
                let claims = tx.claim_batch(&batch).await?;
                let fresh = claims.iter().filter(|c| **c == Claim::Fresh).count();
                tx.commit().await?;
                Ok::<_, InboxError>(fresh)
            })
        });
        let mut fresh = 0;
        for claimer in futures::future::join_all(claimers).await {
            fresh += claimer
                .expect("claimer task")
                .unwrap_or_else(|e| panic!("round {round}: {e:?}"));
        }
        assert_eq!(fresh, 20, "round {round}: each key Fresh exactly once");
    }
    assert_eq!(common::count(&store, "inbox_messages").await, 400);
    assert_eq!(
        common::count(&store, "inbox_messages WHERE processed_at IS NULL").await,
        0
    );
}

/// A batch of 100 keys is claimed by the one `INSERT … unnest` statement
/// (not key by key, as the trait's default does), which also records
/// `processed_at`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_100_keys_is_claimed_by_one_unnest_insert() {
    let store = fresh_store(2).await;
    let keys: Vec<InboxKey> = (0..100).map(|_| new_key("batch")).collect();
    let mut tx = store.begin().await.expect("begin");
    let pid = backend_pid(&mut tx).await.expect("pid");
    let claims = tx.claim_batch(&keys).await.expect("claim batch");
    assert!(claims.iter().all(|c| *c == Claim::Fresh));
    // The session's last statement is the batch INSERT itself.
    let last: String = sqlx::query_scalar("SELECT query FROM pg_stat_activity WHERE pid = $1")
        .bind(pid)
        .fetch_one(store.pool())
        .await
        .expect("pg_stat_activity");
    assert!(
        last.starts_with("INSERT INTO inbox_messages") && last.contains("unnest"),
        "{last}"
    );
    tx.commit().await.expect("commit");
    assert_eq!(
        common::count(&store, "inbox_messages WHERE processed_at IS NOT NULL").await,
        100
    );
}

/// Savepoints nest like SQL's although their RELEASE is deferred to the
/// next SAVEPOINT (or to COMMIT): released work stays with its parent,
/// rolling back the parent undoes it, and the keys the transaction holds
/// follow the same rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_savepoints_with_deferred_release_keep_sql_semantics() {
    let store = fresh_store(3).await;
    create_effects_table(&store).await;
    let [kept, undone_with_parent, undone, later] = [(); 4].map(|()| new_key("savepoints"));
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(tx.claim(&kept).await.expect("claim"), Claim::Fresh);

    // Outer savepoint; inside it a claim and a released inner savepoint.
    tx.savepoint().await.expect("outer");
    assert_eq!(
        tx.claim(&undone_with_parent).await.expect("claim"),
        Claim::Fresh
    );
    tx.savepoint().await.expect("inner");
    record_effect(&mut tx, &undone_with_parent)
        .await
        .expect("work");
    tx.release_savepoint().await.expect("release inner");
    // Rolling back the outer one undoes the released inner work and claim.
    tx.rollback_to_savepoint().await.expect("rollback outer");
    let error = tx
        .unclaim(&undone_with_parent)
        .await
        .expect_err("the claim was rolled back");
    assert!(matches!(error, InboxError::InvalidArgument { .. }));

    // Released then followed by another savepoint that is rolled back:
    // the released work stays, the later one goes.
    tx.savepoint().await.expect("first");
    record_effect(&mut tx, &kept).await.expect("work");
    tx.release_savepoint().await.expect("release first");
    tx.savepoint().await.expect("second");
    assert_eq!(tx.claim(&undone).await.expect("claim"), Claim::Fresh);
    record_effect(&mut tx, &undone).await.expect("work");
    tx.rollback_to_savepoint().await.expect("rollback second");
    assert!(tx.rollback_to_savepoint().await.is_err(), "none left");

    // An unclaim inside a savepoint that is rolled back is undone too.
    assert_eq!(tx.claim(&later).await.expect("claim"), Claim::Fresh);
    tx.savepoint().await.expect("third");
    tx.unclaim(&later).await.expect("unclaim");
    tx.rollback_to_savepoint().await.expect("rollback third");
    // Held again: it can be given back (and is taken again at once).
    tx.savepoint().await.expect("fourth");
    tx.unclaim(&later).await.expect("held again");
    tx.rollback_to_savepoint().await.expect("rollback fourth");

    // A savepoint released and never followed by another: COMMIT covers it.
    tx.savepoint().await.expect("last");
    record_effect(&mut tx, &later).await.expect("work");
    tx.release_savepoint().await.expect("release last");
    tx.commit().await.expect("commit");

    assert_processed_once(&store, &kept).await;
    assert_processed_once(&store, &later).await;
    assert_no_trace(&store, &undone_with_parent).await;
    assert_no_trace(&store, &undone).await;
}

/// A migration cancelled while the migrator holds its advisory lock does
/// not leave that lock behind on a pooled connection, where it would block
/// every other instance's migration of this database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_migration_does_not_block_other_instances() {
    let schema = common::unique_schema(common::TEST_PREFIX);
    let first = common::connect(&schema).await;
    first.migrate().await.expect("first migration");

    // Hold the migrator's bookkeeping table, so that the next migration
    // takes the advisory lock and then waits.
    let mut blocker = first.pool().begin().await.expect("begin");
    sqlx::query("LOCK TABLE _sqlx_migrations IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await
        .expect("lock the migrations table");
    let cancelled = tokio::time::timeout(Duration::from_millis(500), first.migrate()).await;
    assert!(cancelled.is_err(), "the migration waited and was cancelled");
    blocker.rollback().await.expect("release the table");

    let other = common::connect(&schema).await;
    tokio::time::timeout(Duration::from_secs(10), other.migrate())
        .await
        .expect("another instance's migration is not blocked")
        .expect("migrate");
}
