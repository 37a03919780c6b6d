//! The sqlx backend's own tests against the real PostgreSQL: what only
//! concerns sqlx (a commit whose answer is lost on the wire, through a TCP
//! relay; a kill while the server runs COMMIT; a pool built without the
//! schema's search_path; the batch claim as sqlx sends it). The behaviour
//! every Postgres backend shares is inbox-conformance's Postgres suite, run
//! from `tests/conformance.rs`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::relay::Relay;
use common::{backend_pid, create_effects_table, effects_of, fresh_store, record_effect};
use inbox_api::{
    BatchTransaction, Claim, Handled, Inbox, InboxError, InboxKey, InboxStore, InboxTransaction,
};
use inbox_backend_sqlx::SqlxStore;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::Barrier;

use inbox_conformance::contract::new_key;

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

// ----------------------------------------------------- error classification

// A pool whose connections do not use the store's schema is no longer
// refused: the store names its schema itself. tests/pgbouncer.rs
// (`a_users_pool_keeps_its_search_path_and_gets_the_bounds`) migrates and
// uses such a pool.

// --------------------------------------------------------------- batches

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
        last.starts_with(&format!(
            "INSERT INTO \"{}\".inbox_messages",
            store.schema()
        )) && last.contains("unnest"),
        "{last}"
    );
    tx.commit().await.expect("commit");
    assert_eq!(
        common::count(&store, "inbox_messages WHERE processed_at IS NOT NULL").await,
        100
    );
}
