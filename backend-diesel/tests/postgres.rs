//! The diesel backend's own tests against the real PostgreSQL: what only
//! concerns diesel (its pool after crashes, `Object::take` and the cancel on
//! drop, diesel's error kinds, nested diesel transactions, `schema.rs`, the
//! statement cache). The behaviour every Postgres backend shares is
//! inbox-conformance's Postgres suite, run from `tests/conformance.rs`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::{AnsiTransactionManager, AsyncConnection, RunQueryDsl, TransactionManager};
use inbox_api::{
    BatchTransaction, Claim, Handled, Inbox, InboxError, InboxKey, InboxStore, InboxTransaction,
};
use inbox_backend_diesel::{DieselStore, DieselTransaction, classify};

use inbox_conformance::contract::new_key as key;

/// Committed effects of `key`, counted outside the store's pool.
async fn effects_of(store: &DieselStore, key: &InboxKey) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let mut conn = common::admin_in(store.schema()).await;
    let row: N = diesel::sql_query(
        "SELECT count(*) AS n FROM conformance_effects WHERE message_id = $1 AND consumer = $2",
    )
    .bind::<diesel::sql_types::Uuid, _>(key.message_id.as_uuid())
    .bind::<Text, _>(key.consumer.as_str())
    .get_result(&mut conn)
    .await
    .expect("count effects");
    row.n
}

/// One delivery through the middleware: the work records one effect.
async fn deliver(inbox: &Inbox<DieselStore>, key: &InboxKey) -> Result<Handled<()>, InboxError> {
    inbox
        .handle(key, async |tx: &mut DieselTransaction| {
            common::record_effect(tx, key).await
        })
        .await
}

/// Redelivers `key` like an at-least-once broker until it is acknowledged.
async fn redeliver_until_acked(inbox: &Inbox<DieselStore>, key: &InboxKey) -> Handled<()> {
    for _ in 0..100 {
        match deliver(inbox, key).await {
            Ok(handled) => return handled,
            Err(error) if error.is_retryable() => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(error) => panic!("{key}: permanent error on redelivery: {error:?}"),
        }
    }
    panic!("{key}: never acknowledged after 100 deliveries");
}

/// Asserts the invariant for `key`: one effect, one processed row.
async fn assert_exactly_once(store: &DieselStore, key: &InboxKey) {
    assert_eq!(effects_of(store, key).await, 1, "{key}: effects");
    let row = store.lookup(key).await.expect("lookup");
    assert!(
        row.as_ref().is_some_and(|r| r.processed_at.is_some()),
        "{key}: inbox row {row:?}"
    );
}

/// Whether `fut` is still pending after `wait`: it is blocked.
async fn still_pending<F: std::future::Future>(
    fut: &mut std::pin::Pin<&mut F>,
    wait: Duration,
) -> bool {
    tokio::time::timeout(wait, fut.as_mut()).await.is_err()
}

// ---------------------------------------------------------------------------
// The pool after crashes
// ---------------------------------------------------------------------------

/// Why `DieselTransaction`'s Drop closes its connection: diesel-async's
/// deadpool manager keeps a connection returned mid-transaction as it is
/// until the next checkout recycles it, so the server session stays idle in
/// transaction and keeps the claim's row lock.
#[tokio::test]
async fn a_plain_pooled_connection_dropped_mid_transaction_keeps_its_locks() {
    let store = common::fresh_store(2).await;
    let k = key("raw");
    let mut conn = store.pool().get().await.expect("conn");
    AnsiTransactionManager::begin_transaction(&mut *conn)
        .await
        .expect("begin");
    diesel::sql_query("INSERT INTO inbox_messages (id, consumer_type) VALUES ($1, $2)")
        .bind::<diesel::sql_types::Uuid, _>(k.message_id.as_uuid())
        .bind::<Text, _>(k.consumer.as_str())
        .execute(&mut *conn)
        .await
        .expect("claim by hand");
    drop(conn); // back into the pool, transaction open

    let mut admin = common::admin_in(store.schema()).await;
    let states: Vec<String> = diesel::select(diesel::dsl::sql::<diesel::sql_types::Array<Text>>(
        &format!(
            "ARRAY(SELECT state FROM pg_stat_activity WHERE application_name = '{}')",
            store.schema()
        ),
    ))
    .get_result(&mut admin)
    .await
    .expect("pg_stat_activity");
    assert!(
        states.iter().any(|s| s == "idle in transaction"),
        "expected the pooled session idle in transaction, got {states:?}"
    );
    // A claim of the same key from elsewhere waits on that lock, for as long
    // as nobody checks the connection out of the pool again.
    let mut other = common::admin_in(store.schema()).await;
    let claim = diesel::sql_query(
        "INSERT INTO inbox_messages (id, consumer_type) VALUES ($1, $2) ON CONFLICT DO NOTHING",
    )
    .bind::<diesel::sql_types::Uuid, _>(k.message_id.as_uuid())
    .bind::<Text, _>(k.consumer.as_str())
    .execute(&mut other);
    tokio::pin!(claim);
    assert!(
        still_pending(&mut claim, Duration::from_millis(500)).await,
        "the claim should wait on the pooled connection's open transaction"
    );
    // The next checkout recycles it: the manager sees the open transaction
    // and discards the connection, which releases the lock.
    let next = store.pool().get().await.expect("checkout");
    let inserted = tokio::time::timeout(Duration::from_secs(5), claim)
        .await
        .expect("released by the checkout")
        .expect("claim");
    assert_eq!(
        inserted, 1,
        "the pooled transaction's claim was rolled back"
    );
    drop(next);
}

/// The critical property: crash many transactions in every way (drop, kill
/// from outside, cancel in the middle of a statement), then check that every
/// connection of the pool works, is outside any transaction (its autocommit
/// writes are visible from another connection at once), that no crashed
/// write leaked, and that every crashed key is processed exactly once on
/// redelivery.
#[tokio::test]
async fn crashed_transactions_never_return_to_the_pool_open() {
    const POOL: usize = 4;
    const CRASHES: usize = 48;
    let store = common::fresh_store(POOL).await;
    let mut admin = common::admin_in(store.schema()).await;
    diesel::sql_query("CREATE TABLE pool_probe (round int NOT NULL, pid int NOT NULL)")
        .execute(&mut admin)
        .await
        .expect("create pool_probe");

    let keys: Vec<InboxKey> = (0..CRASHES).map(|_| key("crash")).collect();
    for batch in keys.chunks(POOL).enumerate() {
        let (b, batch) = batch;
        let crashes = batch.iter().enumerate().map(|(i, k)| {
            let store = store.clone();
            async move {
                let mut tx = store.begin().await.expect("begin");
                assert_eq!(tx.claim(k).await.expect("claim"), Claim::Fresh);
                common::record_effect(&mut tx, k).await.expect("effect");
                match (b * POOL + i) % 3 {
                    0 => drop(tx),
                    1 => {
                        let pid = common::backend_pid(&mut tx).await.expect("pid");
                        assert!(common::terminate(pid).await);
                        drop(tx);
                    }
                    _ => {
                        // Cancelled while the server runs a statement.
                        let slow = diesel::sql_query("SELECT pg_sleep(2)").execute(tx.conn());
                        let cancelled = tokio::time::timeout(Duration::from_millis(50), slow).await;
                        assert!(cancelled.is_err(), "pg_sleep(2) finished within 50 ms?");
                        drop(tx);
                    }
                }
            }
        });
        futures::future::join_all(crashes).await;
    }

    for k in &keys {
        assert_eq!(effects_of(&store, k).await, 0, "{k}: crashed write leaked");
        assert!(
            store.lookup(k).await.expect("lookup").is_none(),
            "{k}: claim leaked"
        );
    }

    // Every slot at once, several rounds: each connection's autocommit write
    // must be visible from outside immediately.
    for round in 0..3 {
        let mut held = Vec::new();
        for _ in 0..POOL {
            held.push(store.pool().get().await.expect("a pooled connection"));
        }
        let mut pids = Vec::new();
        for conn in &mut held {
            let pid: i32 = diesel::select(diesel::dsl::sql::<Integer>("pg_backend_pid()"))
                .get_result(&mut **conn)
                .await
                .expect("a pooled connection that works");
            diesel::sql_query("INSERT INTO pool_probe (round, pid) VALUES ($1, $2)")
                .bind::<Integer, _>(round)
                .bind::<Integer, _>(pid)
                .execute(&mut **conn)
                .await
                .expect("autocommit write");
            pids.push(pid);
        }
        let visible: i64 = diesel::select(diesel::dsl::sql::<BigInt>(&format!(
            "(SELECT count(DISTINCT pid) FROM pool_probe WHERE round = {round})"
        )))
        .get_result(&mut admin)
        .await
        .expect("count probes");
        assert_eq!(
            visible,
            i64::try_from(POOL).expect("small"),
            "round {round}: a pooled connection's write is not visible outside (inside a transaction?), pids {pids:?}"
        );
    }

    // No session of this store is left inside a transaction.
    let open: i64 = diesel::select(diesel::dsl::sql::<BigInt>(&format!(
        "(SELECT count(*) FROM pg_stat_activity WHERE application_name = '{}' \
          AND state LIKE 'idle in transaction%')",
        store.schema()
    )))
    .get_result(&mut admin)
    .await
    .expect("pg_stat_activity");
    assert_eq!(open, 0, "sessions idle in transaction");

    // Redelivery of every crashed key: exactly once, and never blocked by a
    // crashed transaction's lock.
    let inbox = Inbox::new(store.clone());
    let started = Instant::now();
    for k in &keys {
        assert!(matches!(
            redeliver_until_acked(&inbox, k).await,
            Handled::Processed(())
        ));
        assert_exactly_once(&store, k).await;
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "redelivery took {:?}: something held the claims",
        started.elapsed()
    );
}

/// A transaction dropped while the server still executes its statement (a
/// timeout around `Inbox::handle`) must release its claim promptly, not
/// when the statement would have finished.
#[tokio::test]
async fn cancelled_mid_statement_releases_the_claim_promptly() {
    let store = common::fresh_store(4).await;
    let k = key("cancel");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(tx.claim(&k).await.expect("claim"), Claim::Fresh);
    let slow = diesel::sql_query("SELECT pg_sleep(5)").execute(tx.conn());
    assert!(
        tokio::time::timeout(Duration::from_millis(100), slow)
            .await
            .is_err()
    );
    drop(tx);

    let started = Instant::now();
    let mut again = store.begin().await.expect("begin");
    let claim = tokio::time::timeout(Duration::from_secs(3), again.claim(&k)).await;
    assert!(
        matches!(claim, Ok(Ok(Claim::Fresh))),
        "redelivery claim after {:?}: {claim:?}",
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------
// Pool exhaustion
// ---------------------------------------------------------------------------

/// More concurrent handlers than pool slots, with crashes of every kind:
/// every handler eventually gets a connection (or a retryable pool timeout),
/// and every key ends with exactly one effect and a processed row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_exhaustion_with_crashes_keeps_the_invariant() {
    const POOL: usize = 4;
    const TASKS: usize = 32;
    const KEYS_PER_TASK: usize = 4;
    let store = common::unmigrated_store(POOL, Duration::from_millis(200)).await;
    store.migrate().await.expect("migrate");
    {
        let mut conn = store.pool().get().await.expect("conn");
        diesel::sql_query(common::EFFECTS_TABLE)
            .execute(&mut *conn)
            .await
            .expect("effects table");
    }
    let inbox = Arc::new(Inbox::new(store.clone()));
    // Every task handles its own keys and, concurrently with all the
    // others, a few shared hot keys.
    let hot: Arc<Vec<InboxKey>> = Arc::new((0..4).map(|_| key("hot")).collect());
    let pool_timeouts = Arc::new(AtomicUsize::new(0));
    let crashes = Arc::new(AtomicUsize::new(0));

    let mut tasks = Vec::new();
    let mut all_keys: Vec<InboxKey> = hot.to_vec();
    for t in 0..TASKS {
        let own: Vec<InboxKey> = (0..KEYS_PER_TASK).map(|_| key("own")).collect();
        all_keys.extend(own.iter().cloned());
        let (inbox, hot) = (Arc::clone(&inbox), Arc::clone(&hot));
        let (pool_timeouts, crashes) = (Arc::clone(&pool_timeouts), Arc::clone(&crashes));
        tasks.push(tokio::spawn(async move {
            let mut deliveries = own;
            deliveries.push(hot[t % hot.len()].clone());
            let mut attempt = t;
            while let Some(k) = deliveries.pop() {
                attempt += 1;
                let outcome = match attempt % 5 {
                    // Crash: the middleware's future is dropped mid-work.
                    0 => {
                        let work = inbox.handle(&k, async |tx: &mut DieselTransaction| {
                            common::record_effect(tx, &k).await?;
                            tokio::time::sleep(Duration::from_secs(5)).await;
                            Ok::<_, InboxError>(())
                        });
                        match tokio::time::timeout(Duration::from_millis(20), work).await {
                            Err(_) => {
                                crashes.fetch_add(1, Ordering::Relaxed);
                                Err(None)
                            }
                            Ok(result) => result.map_err(Some),
                        }
                    }
                    // Crash: the server kills the connection under the work.
                    1 => inbox
                        .handle(&k, async |tx: &mut DieselTransaction| {
                            common::record_effect(tx, &k).await?;
                            diesel::sql_query("SELECT pg_terminate_backend(pg_backend_pid())")
                                .execute(tx.conn())
                                .await
                                .map_err(classify)?;
                            Ok::<_, InboxError>(())
                        })
                        .await
                        .inspect_err(|_| {
                            crashes.fetch_add(1, Ordering::Relaxed);
                        })
                        .map_err(Some),
                    _ => deliver(&inbox, &k).await.map_err(Some),
                };
                match outcome {
                    Ok(_) => {}
                    Err(None) => deliveries.insert(0, k),
                    Err(Some(error)) => {
                        assert!(error.is_retryable(), "{k}: permanent error {error:?}");
                        if matches!(error, InboxError::PoolTimeout { .. }) {
                            pool_timeouts.fetch_add(1, Ordering::Relaxed);
                        }
                        deliveries.insert(0, k);
                    }
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("handler task");
    }
    eprintln!(
        "pool exhaustion: {} crashes, {} pool timeouts retried",
        AtomicUsize::load(&crashes, Ordering::Relaxed),
        AtomicUsize::load(&pool_timeouts, Ordering::Relaxed)
    );
    assert!(AtomicUsize::load(&crashes, Ordering::Relaxed) > 0);
    for k in &all_keys {
        assert_exactly_once(&store, k).await;
    }
    let rows = common::count(store.schema(), "inbox_messages").await;
    assert_eq!(
        rows,
        i64::try_from(all_keys.len()).expect("small"),
        "no stray rows"
    );
    let status = store.pool().status();
    assert!(status.size <= POOL, "{status:?}");
    // And the pool still serves a full set of working connections.
    let mut held = Vec::new();
    for _ in 0..POOL {
        let mut conn = store.pool().get().await.expect("conn after the storm");
        diesel::sql_query("SELECT 1")
            .execute(&mut *conn)
            .await
            .expect("a live connection");
        held.push(conn);
    }
}

// ---------------------------------------------------------------------------
// Errors from the real server
// ---------------------------------------------------------------------------

/// The documented limit of diesel-async 0.9: it keeps the SQLSTATE only for
/// the codes it has a `DatabaseErrorKind` for. A deadlock raised with a
/// message PostgreSQL never uses cannot be recognised, and falls to the
/// permanent default; if this starts failing, diesel exposes the code and
/// the message table can go.
#[tokio::test]
async fn sqlstate_without_a_diesel_kind_is_only_known_by_its_message() {
    let store = common::fresh_store(4).await;
    let mut tx = store.begin().await.expect("begin");
    let error = diesel::sql_query(
        "DO $$ BEGIN RAISE EXCEPTION 'custom text' USING ERRCODE = '40P01'; END $$",
    )
    .execute(tx.conn())
    .await
    .map_err(classify)
    .expect_err("raised");
    assert!(
        matches!(
            error,
            InboxError::Store {
                retryable: false,
                ..
            }
        ),
        "{error:?}"
    );
}

#[tokio::test]
async fn a_full_pool_is_a_retryable_pool_timeout() {
    let store = common::unmigrated_store(1, Duration::from_millis(100)).await;
    store.migrate().await.expect("migrate");
    let held = store.begin().await.expect("begin");
    let started = Instant::now();
    let error = store.begin().await.expect_err("pool is full");
    assert!(matches!(error, InboxError::PoolTimeout { .. }), "{error:?}");
    assert!(error.is_retryable());
    assert!(started.elapsed() < Duration::from_secs(2));
    held.rollback().await.expect("rollback");
    store
        .begin()
        .await
        .expect("a slot again")
        .rollback()
        .await
        .expect("rollback");
}

#[tokio::test]
async fn a_bad_schema_name_is_refused_before_any_sql() {
    for bad in ["Inbox", "x; DROP SCHEMA public", "\"quoted\"", ""] {
        let error = DieselStore::builder(common::database_url(), bad).expect_err(bad);
        assert!(
            matches!(error, InboxError::InvalidArgument { .. }),
            "{error:?}"
        );
    }
}

// ---------------------------------------------------------------------------
// Transactions the consumer nests
// ---------------------------------------------------------------------------

/// A `conn.transaction(..)` inside the work is a savepoint: its failure
/// rolls back only its own writes, and the claim and the other writes
/// commit.
#[tokio::test]
async fn a_nested_transaction_in_the_work_is_a_savepoint() {
    let store = common::fresh_store(2).await;
    let inbox = Inbox::new(store.clone());
    let k = key("nested");
    let handled = inbox
        .handle(&k, async |tx: &mut DieselTransaction| {
            common::record_effect(tx, &k).await?;
            let inner = tx
                .conn()
                .transaction(async |conn| {
                    diesel::sql_query(
                        "INSERT INTO conformance_effects (message_id, consumer) VALUES ($1, 'inner')",
                    )
                    .bind::<diesel::sql_types::Uuid, _>(k.message_id.as_uuid())
                    .execute(conn)
                    .await?;
                    Err::<(), _>(diesel::result::Error::RollbackTransaction)
                })
                .await;
            assert!(inner.is_err());
            Ok::<_, InboxError>(())
        })
        .await
        .expect("handled");
    assert!(matches!(handled, Handled::Processed(())));
    assert_exactly_once(&store, &k).await;
    let inner = common::count(
        store.schema(),
        "conformance_effects WHERE consumer = 'inner'",
    )
    .await;
    assert_eq!(inner, 0, "the savepoint's write was rolled back");
}

/// In batched mode each message's work runs in the store's own savepoint;
/// a `conn.transaction(..)` inside it nests as diesel's savepoint, and a
/// failing message is rolled back alone, claim and all.
#[tokio::test]
async fn batched_mode_nests_diesel_transactions_and_isolates_failures() {
    let store = common::fresh_store(2).await;
    let inbox = Inbox::new(store.clone());
    let keys: Vec<InboxKey> = (0..4).map(|_| key("batch")).collect();
    let batch = keys.iter().cloned().zip(0..).collect();
    let items = inbox
        .handle_batch(batch, async |tx: &mut DieselTransaction, &index: &usize| {
            let k = &keys[index];
            common::record_effect(tx, k).await?;
            let inner = tx
                .conn()
                .transaction(async |conn| {
                    diesel::sql_query(
                        "INSERT INTO conformance_effects (message_id, consumer) VALUES ($1, 'inner')",
                    )
                    .bind::<diesel::sql_types::Uuid, _>(k.message_id.as_uuid())
                    .execute(conn)
                    .await?;
                    Err::<(), _>(diesel::result::Error::RollbackTransaction)
                })
                .await;
            assert!(inner.is_err());
            if index == 2 {
                return Err(InboxError::retryable_handler("message 2 fails"));
            }
            Ok(())
        })
        .await;
    for (k, index, item) in &items {
        if *index == 2 {
            assert!(matches!(item, Err(InboxError::Handler { .. })), "{item:?}");
            assert_eq!(effects_of(&store, k).await, 0);
            assert!(
                store.lookup(k).await.expect("lookup").is_none(),
                "claim given back"
            );
        } else {
            assert!(matches!(item, Ok(Handled::Processed(()))), "{item:?}");
            assert_exactly_once(&store, k).await;
        }
    }
    let inner = common::count(
        store.schema(),
        "conformance_effects WHERE consumer = 'inner'",
    )
    .await;
    assert_eq!(inner, 0, "diesel's savepoints rolled back");
    // The failed one on redelivery.
    assert!(matches!(
        redeliver_until_acked(&inbox, &keys[2]).await,
        Handled::Processed(())
    ));
    assert_exactly_once(&store, &keys[2]).await;
}

/// A savepoint the work opened by hand and left open would make COMMIT
/// release only the savepoint; the store refuses and discards the
/// connection instead of pooling an open transaction.
#[tokio::test]
async fn an_unbalanced_savepoint_is_refused_at_commit() {
    let store = common::fresh_store(1).await;
    let k = key("unbalanced");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(tx.claim(&k).await.expect("claim"), Claim::Fresh);
    AnsiTransactionManager::begin_transaction(tx.conn())
        .await
        .expect("savepoint");
    let error = tx.commit().await.expect_err("unbalanced");
    assert!(!error.is_retryable(), "{error:?}");
    assert!(store.lookup(&k).await.expect("lookup").is_none());
    // The pool's only slot is usable and not inside a transaction.
    let mut conn = store.pool().get().await.expect("conn");
    diesel::sql_query("CREATE TABLE after_unbalanced (x int)")
        .execute(&mut *conn)
        .await
        .expect("autocommit DDL");
    drop(conn);
    assert_eq!(common::count(store.schema(), "after_unbalanced").await, 0);
}

// ---------------------------------------------------------------------------
// schema.rs
// ---------------------------------------------------------------------------

/// `schema.rs` is written by hand; this compares it with the catalog of a
/// freshly migrated schema, so a migration that changes the table without it
/// fails here.
#[tokio::test]
async fn schema_rs_matches_the_migrated_table() {
    #[derive(diesel::QueryableByName, Debug, PartialEq)]
    struct Column {
        #[diesel(sql_type = Text)]
        name: String,
        #[diesel(sql_type = Text)]
        ty: String,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        nullable: bool,
    }
    let store = common::fresh_store(1).await;
    let mut admin = common::admin_in(store.schema()).await;
    let columns: Vec<Column> = diesel::sql_query(
        "SELECT a.attname::text AS name, format_type(a.atttypid, a.atttypmod) AS ty, \
                NOT a.attnotnull AS nullable \
         FROM pg_attribute a \
         WHERE a.attrelid = 'inbox_messages'::regclass AND a.attnum > 0 AND NOT a.attisdropped \
         ORDER BY a.attnum",
    )
    .load(&mut admin)
    .await
    .expect("catalog");
    let expected = [
        ("id", "uuid", false),
        ("consumer_type", "character varying(500)", false),
        ("received_at", "timestamp with time zone", false),
        ("processed_at", "timestamp with time zone", true),
        ("payload_fingerprint", "bytea", true),
        ("response", "bytea", true),
    ];
    let expected: Vec<Column> = expected
        .iter()
        .map(|(n, t, null)| Column {
            name: (*n).into(),
            ty: (*t).into(),
            nullable: *null,
        })
        .collect();
    assert_eq!(columns, expected, "update src/schema.rs with the migration");

    let pk: Vec<String> = diesel::select(diesel::dsl::sql::<diesel::sql_types::Array<Text>>(
        "ARRAY(SELECT a.attname::text FROM pg_index i \
           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
           WHERE i.indrelid = 'inbox_messages'::regclass AND i.indisprimary \
           ORDER BY array_position(i.indkey, a.attnum))",
    ))
    .get_result(&mut admin)
    .await
    .expect("primary key");
    assert_eq!(pk, ["id", "consumer_type"], "table! primary key");

    // And the DSL's full-row select runs against it.
    use diesel::QueryDsl;
    use inbox_backend_diesel::schema::inbox_messages::dsl::*;
    type Row = (
        uuid::Uuid,
        String,
        chrono::DateTime<chrono::Utc>,
        Option<chrono::DateTime<chrono::Utc>>,
        Option<Vec<u8>>,
    );
    let rows: Vec<Row> = inbox_messages
        .select((
            id,
            consumer_type,
            received_at,
            processed_at,
            payload_fingerprint,
        ))
        .load(&mut admin)
        .await
        .expect("DSL select");
    assert!(rows.is_empty());
}

// ---------------------------------------------------------------------------
// Statement caching
// ---------------------------------------------------------------------------

/// The claims (single and batched, both recording `processed_at`) are
/// prepared once per connection and reused: a statement diesel re-prepares
/// on every call (its UPDATE DSL, `sql_query`) costs a round trip per
/// message, which the benchmark showed. No UPDATE of the inbox runs at all.
#[tokio::test]
async fn hot_statements_are_prepared_once_per_connection() {
    let store = common::fresh_store(1).await;
    for round in 0..3 {
        let k = key("prepared");
        let mut tx = store.begin().await.expect("begin");
        assert_eq!(tx.claim(&k).await.expect("claim"), Claim::Fresh);
        tx.commit().await.expect("commit");
        // The pipelined claim, behind its BEGIN, is prepared once too.
        let (mut tx, claim) = store
            .begin_claim(&key("prepared"))
            .await
            .expect("begin_claim");
        assert_eq!(claim, Claim::Fresh);
        // Batches of different sizes share one statement too.
        let batch: Vec<InboxKey> = (0..=round).map(|_| key("prepared")).collect();
        let claims = tx.claim_batch(&batch).await.expect("claim batch");
        assert!(claims.iter().all(|c| *c == Claim::Fresh));
        tx.commit().await.expect("commit");
    }
    let mut conn = store.pool().get().await.expect("the same connection");
    let prepared: Vec<String> = diesel::select(diesel::dsl::sql::<diesel::sql_types::Array<Text>>(
        "ARRAY(SELECT statement FROM pg_prepared_statements ORDER BY statement)",
    ))
    .get_result(&mut *conn)
    .await
    .expect("pg_prepared_statements");
    // The statements name the store's schema.
    for start in [
        ".inbox_messages (id, consumer_type, processed_at, payload_fingerprint) VALUES",
        ".inbox_messages (id, consumer_type, processed_at, payload_fingerprint) SELECT id",
        ".inbox_messages (id, consumer_type, processed_at, payload_fingerprint) SELECT $1",
    ] {
        let start = format!("INSERT INTO \"{}\"{start}", store.schema());
        let n = prepared.iter().filter(|s| s.starts_with(&start)).count();
        assert_eq!(n, 1, "{start}… prepared {n} times: {prepared:#?}");
    }
    assert!(
        !prepared.iter().any(|s| s.contains("UPDATE")),
        "no UPDATE on the hot path: {prepared:#?}"
    );
}

/// The pipelined claim writes only inside the transaction its BEGIN opened
/// (`inbox_postgres::sql::BEGIN_PIPELINED`): were BEGIN to fail, the claim
/// would run alone, and must not commit a row without its work.
#[tokio::test]
async fn a_pipelined_claim_without_its_begin_writes_nothing() {
    let store = common::fresh_store(1).await;
    async fn claim_alone(store: &DieselStore, k: &InboxKey) -> usize {
        let mut conn = store.pool().get().await.expect("connection");
        diesel::sql_query(inbox_postgres::sql::CLAIM_PIPELINED)
            .bind::<diesel::sql_types::Uuid, _>(k.message_id.as_uuid())
            .bind::<Text, _>(k.consumer.as_str())
            .bind::<diesel::sql_types::Nullable<diesel::sql_types::Bytea>, _>(None::<Vec<u8>>)
            .execute(&mut *conn)
            .await
            .expect("the claim alone")
    }
    let alone = key("guard");
    assert_eq!(claim_alone(&store, &alone).await, 0, "inserted alone");
    assert_eq!(store.lookup(&alone).await.expect("lookup"), None);

    let k = key("guard");
    let (mut tx, claim) = store.begin_claim(&k).await.expect("begin_claim");
    assert_eq!(claim, Claim::Fresh);
    common::record_effect(&mut tx, &k).await.expect("work");
    tx.commit().await.expect("commit");
    assert_exactly_once(&store, &k).await;

    // COMMIT ended the mark with the transaction, on the same connection.
    assert_eq!(
        claim_alone(&store, &alone).await,
        0,
        "inserted after COMMIT"
    );
    assert_eq!(store.lookup(&alone).await.expect("lookup"), None);
}

/// The outbox's hot statements (the producer's enqueue, the relay's take)
/// are prepared once per connection, like the claims: diesel would
/// re-prepare an `sql_query` on every call.
#[tokio::test]
async fn outbox_hot_statements_are_prepared_once_per_connection() {
    use inbox_api::{OutboxStore, OutboxTransaction};
    use inbox_conformance::outbox::contract::new_message;

    let store = common::fresh_store(1).await;
    for round in 0..3 {
        let mut tx = store.begin().await.expect("begin");
        for _ in 0..=round {
            let _ = tx.enqueue(&new_message()).await.expect("enqueue");
        }
        tx.commit().await.expect("commit");
        let lease = store
            .take_pending(std::num::NonZeroU32::MIN, Duration::from_secs(30))
            .await
            .expect("take");
        assert_eq!(lease.messages.len(), 1);
    }
    let mut conn = store.pool().get().await.expect("the same connection");
    let prepared: Vec<String> = diesel::select(diesel::dsl::sql::<diesel::sql_types::Array<Text>>(
        "ARRAY(SELECT statement FROM pg_prepared_statements ORDER BY statement)",
    ))
    .get_result(&mut *conn)
    .await
    .expect("pg_prepared_statements");
    for part in [".outbox_messages (message_id", ".outbox_take("] {
        let n = prepared.iter().filter(|s| s.contains(part)).count();
        assert_eq!(n, 1, "…{part}… prepared {n} times: {prepared:#?}");
    }
}

/// The outbox's trigger wakes a listener when a transaction that enqueued
/// messages commits, and not when one rolls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_enqueued_wakes_an_outbox_listener() {
    use inbox_api::{MessageId, OutboxTransaction, OutgoingMessage};
    use inbox_backend_diesel::OutboxListener;

    let store = common::fresh_store(2).await;
    let mut listener = OutboxListener::connect(&common::database_url(), store.schema())
        .await
        .expect("LISTEN");
    let message =
        || OutgoingMessage::new(MessageId::new_v7(), "x", "k", "T", Vec::new()).expect("valid");
    let mut tx = store.begin().await.expect("begin");
    let _ = tx.enqueue(&message()).await.expect("enqueue");
    tx.rollback().await.expect("rollback");
    let quiet = tokio::time::timeout(Duration::from_millis(300), listener.next()).await;
    assert!(quiet.is_err(), "a rollback notifies nobody");

    let mut tx = store.begin().await.expect("begin");
    let _ = tx.enqueue(&message()).await.expect("enqueue");
    let _ = tx.enqueue(&message()).await.expect("enqueue");
    tx.commit().await.expect("commit");
    let woke = tokio::time::timeout(Duration::from_secs(5), listener.next()).await;
    assert_eq!(woke, Ok(Some(())), "a commit wakes the listener");
    let again = tokio::time::timeout(Duration::from_millis(300), listener.next()).await;
    assert!(again.is_err(), "one wake-up per transaction");
    drop(listener);
    let mut admin = common::admin().await;
    diesel::sql_query(common::drop_schema_sql(store.schema()))
        .execute(&mut admin)
        .await
        .expect("drop the test schema");
}
