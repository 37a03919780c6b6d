//! The conformance suite's inbox, outbox and attempt-ledger contracts, run
//! with every store's pool going through PgBouncer in transaction mode
//! (`.ci/services.sh` starts it on 127.0.0.1:6432, `PGBOUNCER_URL`
//! overrides), and a user's own pool that sets nothing.
//!
//! Through PgBouncer the stores keep no session state: the pool is built
//! from `SqlxStore::pool_options(url, Pooling::Transaction)` (no statement
//! cache), its connections send no startup `options`, so nothing sets
//! `search_path` or a timeout on them. The statements name the schema and
//! every transaction sets its own bounds; these tests prove both. The
//! harness's own reads (effects, rows) go over a direct connection: they
//! are the test's eyes, not the store under test.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use inbox_api::{
    Claim, ConsumerName, InboxError, InboxKey, InboxRecord, InboxStore as _, InboxTransaction as _,
    MessageId,
};
use inbox_backend_sqlx::{Pooling, SchemaName, SqlxStore, SqlxTransaction, classify};
use inbox_conformance::postgres::support::{
    AGE_ATTEMPTS, AGE_OUTBOX, INBOX_ROWS, bouncer_url, record_effect_in, stored_key as key_of,
    stored_record, unreachable_bouncer,
};
use inbox_conformance::{CrashKind, Harness};
use sqlx::Row as _;
use sqlx::postgres::PgPoolOptions;

/// The suite's view of a sqlx store whose pool goes through PgBouncer.
struct BouncerHarness;

/// Checks that PgBouncer is there (failing loudly if not: never a skip)
/// and sweeps old test schemas.
async fn harness() -> BouncerHarness {
    let admin = common::admin_pool().await;
    common::sweep_old_schemas(&admin, common::TEST_PREFIX).await;
    admin.close().await;
    let options = SqlxStore::pool_options(&bouncer_url(), Pooling::Transaction)
        .expect("a valid PGBOUNCER_URL");
    let mut conn = sqlx::ConnectOptions::connect(&options)
        .await
        .unwrap_or_else(|error| unreachable_bouncer(&error));
    // The simple query protocol: one exchange. An extended-protocol
    // statement outside a transaction (parse, then bind and execute) may
    // meet two server sessions here, which is the point of the suite.
    sqlx::raw_sql("SELECT 1")
        .execute(&mut conn)
        .await
        .unwrap_or_else(|error| unreachable_bouncer(&error));
    BouncerHarness
}

/// A store in a new schema, its pool through PgBouncer in transaction
/// mode, migrated through PgBouncer too.
async fn bouncer_store(max: u32) -> SqlxStore {
    let schema = common::unique_schema(common::TEST_PREFIX);
    let options = SqlxStore::pool_options(&bouncer_url(), Pooling::Transaction)
        .expect("a valid PGBOUNCER_URL")
        .application_name(&schema);
    let pool = PgPoolOptions::new()
        .max_connections(max)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(15))
        .connect_with(options)
        .await
        .unwrap_or_else(|error| unreachable_bouncer(&error));
    let store = SqlxStore::new(pool, &schema)
        .expect("valid test schema name")
        .with_pooling(Pooling::Transaction);
    store.migrate().await.expect("migrate through PgBouncer");
    store
}

/// A direct connection in `store`'s schema: the harness's own eyes.
async fn side(store: &SqlxStore) -> sqlx::PgConnection {
    let options = SqlxStore::connect_options(&common::database_url(), store.schema())
        .expect("valid test schema name");
    sqlx::ConnectOptions::connect(&options)
        .await
        .unwrap_or_else(|error| common::unreachable_database(&error))
}

fn schema_of(store: &SqlxStore) -> SchemaName {
    SchemaName::new(store.schema()).expect("valid test schema name")
}

#[async_trait]
impl Harness for BouncerHarness {
    type Store = SqlxStore;

    fn name(&self) -> String {
        "sqlx through PgBouncer (transaction mode)".into()
    }

    async fn fresh_store(&self) -> SqlxStore {
        let store = bouncer_store(10).await;
        sqlx::query(inbox_conformance::postgres::support::EFFECTS_TABLE)
            .execute(&mut side(&store).await)
            .await
            .expect("create conformance_effects");
        store
    }

    async fn record_effect(
        &self,
        tx: &mut SqlxTransaction,
        key: &InboxKey,
    ) -> Result<(), InboxError> {
        let schema = SchemaName::new(&current_schema_of_effects(tx).await?)?;
        // Unnamed, as every statement through a transaction-mode pooler.
        sqlx::query(&record_effect_in(&schema))
            .bind(key.message_id.as_uuid())
            .bind(key.consumer.as_str())
            .persistent(false)
            .execute(tx.conn())
            .await
            .map_err(classify)?;
        Ok(())
    }

    async fn effects(&self, store: &SqlxStore) -> BTreeMap<InboxKey, u64> {
        let rows = sqlx::query(
            "SELECT message_id, consumer, count(*) AS n FROM conformance_effects GROUP BY 1, 2",
        )
        .fetch_all(&mut side(store).await)
        .await
        .expect("read effects");
        rows.into_iter()
            .map(|row| {
                let n: i64 = row.get("n");
                (
                    key_of(row.get("message_id"), row.get("consumer")),
                    u64::try_from(n).expect("a count is never negative"),
                )
            })
            .collect()
    }

    async fn inbox_rows(&self, store: &SqlxStore) -> Vec<InboxRecord> {
        let rows = sqlx::query(INBOX_ROWS)
            .fetch_all(&mut side(store).await)
            .await
            .expect("read inbox rows");
        rows.into_iter()
            .map(|row| {
                stored_record(
                    row.get("id"),
                    row.get("consumer_type"),
                    row.get("received_at"),
                    row.get("processed_at"),
                    row.get("payload_fingerprint"),
                )
            })
            .collect()
    }

    async fn crash(&self, store: &SqlxStore, tx: SqlxTransaction, kind: CrashKind) {
        match kind {
            CrashKind::Drop => drop(tx),
            // The transaction holds its server session until it ends, so
            // its pid is the session to kill, pooler or not.
            CrashKind::KillConnection => kill(store, tx).await,
        }
    }

    async fn age_rows(&self, store: &SqlxStore, age: Duration) {
        sqlx::query(
            "UPDATE inbox_messages SET \
             received_at = received_at - make_interval(secs => $1), \
             processed_at = processed_at - make_interval(secs => $1)",
        )
        .bind(age.as_secs_f64())
        .execute(&mut side(store).await)
        .await
        .expect("age rows");
    }

    async fn store_now(&self, store: &SqlxStore) -> DateTime<Utc> {
        sqlx::query_scalar("SELECT now()")
            .fetch_one(&mut side(store).await)
            .await
            .expect("read the database clock")
    }

    fn blocking_probe(&self) -> Duration {
        Duration::from_millis(300)
    }
}

/// Kills `tx`'s server session from a direct connection, then drops `tx`:
/// a process crash as the database sees it. The transaction holds its
/// server session until it ends, pooler or not.
async fn kill(store: &SqlxStore, mut tx: SqlxTransaction) {
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .persistent(false)
        .fetch_one(tx.conn())
        .await
        .expect("backend pid");
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
        .bind(pid)
        .fetch_one(&mut side(store).await)
        .await
        .expect("pg_terminate_backend");
    assert!(killed, "backend {pid} killed");
    drop(tx);
}

/// The effects table's schema for a transaction: the store's, which the
/// harness learns from the transaction's connection's `application_name`
/// (set to the schema by [`bouncer_store`]; PgBouncer passes it on).
async fn current_schema_of_effects(tx: &mut SqlxTransaction) -> Result<String, InboxError> {
    sqlx::query_scalar("SELECT current_setting('application_name')")
        .persistent(false)
        .fetch_one(tx.conn())
        .await
        .map_err(classify)
}

#[async_trait]
impl inbox_conformance::OutboxHarness for BouncerHarness {
    async fn age_outbox(&self, store: &SqlxStore, age: Duration) {
        sqlx::query(AGE_OUTBOX)
            .bind(age.as_secs_f64())
            .execute(&mut side(store).await)
            .await
            .expect("age the outbox");
    }
}

#[async_trait]
impl inbox_conformance::LedgerHarness for BouncerHarness {
    async fn age_attempts(&self, store: &SqlxStore, age: Duration) {
        sqlx::query(AGE_ATTEMPTS)
            .bind(age.as_secs_f64())
            .execute(&mut side(store).await)
            .await
            .expect("age the attempt ledger");
    }
}

// The suite's contract scenarios, each a named test, through PgBouncer.
inbox_conformance::__with_contract_tests!(conformance harness);
inbox_conformance::__with_outbox_contract_tests!(@tests harness);
inbox_conformance::ledger_conformance_tests!(harness);

/// The bounds hold through PgBouncer: nothing on the connection sets
/// them, the store's transaction does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_bounds_hold_through_pgbouncer() {
    let _ = harness().await;
    let store = bouncer_store(2).await;
    let outside: String = sqlx::raw_sql("SHOW lock_timeout")
        .fetch_one(store.pool())
        .await
        .expect("show")
        .get(0);
    assert_eq!(outside, "0", "the pool's connections set nothing");
    let mut tx = store.begin().await.expect("begin");
    for (setting, expected) in [
        ("lock_timeout", "3s"),
        ("idle_in_transaction_session_timeout", "1min"),
        ("client_connection_check_interval", "1s"),
    ] {
        let value: String = sqlx::query_scalar(&format!("SHOW {setting}"))
            .persistent(false)
            .fetch_one(tx.conn())
            .await
            .expect("show");
        assert_eq!(value, expected, "{setting}");
    }
    tx.rollback().await.expect("rollback");
}

/// A user's own pool, whose `search_path` is the user's (`public`), with
/// no setting of the store's: the store works in its schema, the user's
/// unqualified table resolves in `public`, the bounds hold in the
/// transaction, and the pool's sessions are left as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_pool_keeps_its_search_path_and_gets_the_bounds() {
    let admin = common::admin_pool().await;
    let schema = common::unique_schema(common::TEST_PREFIX);
    let user_table = format!("{schema}_orders");
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&common::database_url())
        .await
        .unwrap_or_else(|error| common::unreachable_database(&error));
    sqlx::query(&format!("CREATE TABLE public.{user_table} (id uuid)"))
        .execute(&admin)
        .await
        .expect("the user's table");
    let store = SqlxStore::new(pool.clone(), &schema).expect("any pool");
    assert!(!store.migrate().await.expect("migrate").is_empty());
    assert!(store.migrate().await.expect("again").is_empty());

    let key = InboxKey::new(MessageId::new_v7(), ConsumerName::new("c").expect("valid"));
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Fresh);
    sqlx::query(&format!("INSERT INTO {user_table} (id) VALUES ($1)"))
        .bind(key.message_id.as_uuid())
        .execute(tx.conn())
        .await
        .expect("the user's unqualified table");
    let lock: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(tx.conn())
        .await
        .expect("show");
    assert_eq!(lock, "3s");
    tx.commit().await.expect("commit");
    assert!(store.lookup(&key).await.expect("lookup").is_some());

    let path: String = sqlx::query_scalar("SHOW search_path")
        .fetch_one(&pool)
        .await
        .expect("show");
    assert_eq!(
        path, "\"$user\", public",
        "the pool's search_path is left alone"
    );
    let lock: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&pool)
        .await
        .expect("show");
    assert_eq!(lock, "0", "SET LOCAL ends with the transaction");
    sqlx::query(&format!("DROP TABLE public.{user_table}"))
        .execute(&admin)
        .await
        .expect("drop the user's table");
}

/// LISTEN needs a session: through a transaction-mode pooler the store
/// refuses it without a direct URL, and listens through one when named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_goes_through_the_direct_url_or_is_refused() {
    let _ = harness().await;
    let store = bouncer_store(2).await;
    let refused = store
        .listen_outbox()
        .await
        .expect_err("no session to LISTEN on");
    assert!(
        matches!(refused, InboxError::InvalidArgument { .. }),
        "{refused:?}"
    );

    let store = store.with_listen_url(&common::database_url());
    let mut listener = store.listen_outbox().await.expect("listen directly");
    let message =
        inbox_api::OutgoingMessage::new(MessageId::new_v7(), "e", "k", "T", []).expect("valid");
    let mut tx = store.begin().await.expect("begin");
    let enqueued = inbox_api::OutboxTransaction::enqueue(&mut tx, &message)
        .await
        .expect("enqueue");
    assert_eq!(enqueued, inbox_api::EnqueueOutcome::Enqueued);
    tx.commit().await.expect("commit");
    let started = Instant::now();
    let notified = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("woken within 5 s")
        .expect("a notification");
    assert_eq!(notified.channel(), schema_of(&store).outbox_channel());
    println!("woken {:?} after commit", started.elapsed());
}

/// A pool of the application's own whose `search_path` is `app` (its own
/// tables and sqlx's ledger live there, one per test, so concurrent runs
/// never share a ledger).
async fn app_pool(app: &str) -> sqlx::PgPool {
    let admin = common::admin_pool().await;
    sqlx::query(&format!("CREATE SCHEMA {app}"))
        .execute(&admin)
        .await
        .expect("the application's schema");
    let options: sqlx::postgres::PgConnectOptions =
        common::database_url().parse().expect("database url");
    PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.options([("search_path", app)]))
        .await
        .unwrap_or_else(|error| common::unreachable_database(&error))
}

/// The inbox's migrations run by the application's own sqlx `Migrator`
/// land in the inbox's schema, and the library's runner then finds nothing
/// to do; a schema the runner migrated first is accepted by the
/// `Migrator`. Either way the store works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_users_migrator_and_the_runner_recognise_each_other() {
    let app = common::unique_schema(common::TEST_PREFIX);
    let pool = app_pool(&app).await;

    // The application's tool first, then the runner.
    let inbox = common::unique_schema(common::TEST_PREFIX);
    let migrator = inbox_backend_sqlx::migrations::migrator(&inbox)
        .await
        .expect("the inbox migrator");
    migrator.run(&pool).await.expect("run in the user's tool");
    let store = SqlxStore::new(pool.clone(), &inbox).expect("any pool");
    assert_eq!(store.migrate().await.expect("runner"), Vec::<i64>::new());
    let in_inbox: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("\"{inbox}\".outbox_messages"))
        .fetch_one(&pool)
        .await
        .expect("regclass");
    assert!(in_inbox.is_some(), "the tables are in the inbox's schema");
    let in_app: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("\"{app}\".inbox_messages"))
        .fetch_one(&pool)
        .await
        .expect("regclass");
    assert!(
        in_app.is_none(),
        "nothing of the inbox in the application's schema"
    );
    claim_once(&store).await;

    // The runner first, then the application's tool (in another
    // application schema, so with a ledger of its own).
    let app = common::unique_schema(common::TEST_PREFIX);
    let pool = app_pool(&app).await;
    let inbox = common::unique_schema(common::TEST_PREFIX);
    let store = SqlxStore::new(pool.clone(), &inbox).expect("any pool");
    assert!(!store.migrate().await.expect("runner").is_empty());
    inbox_backend_sqlx::migrations::migrator(&inbox)
        .await
        .expect("the inbox migrator")
        .run(&pool)
        .await
        .expect("the tool accepts a schema the runner migrated");
    assert_eq!(store.migrate().await.expect("again"), Vec::<i64>::new());
    claim_once(&store).await;
}

/// One fresh claim, committed, then a duplicate.
async fn claim_once(store: &SqlxStore) {
    let key = InboxKey::new(MessageId::new_v7(), ConsumerName::new("c").expect("valid"));
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Fresh);
    tx.commit().await.expect("commit");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Duplicate);
    tx.rollback().await.expect("rollback");
}

/// Median of `samples`, in microseconds.
fn median_micros(mut samples: Vec<Duration>) -> u128 {
    samples.sort();
    samples[samples.len() / 2].as_micros()
}

/// `rounds` messages through `store`: BEGIN (with the store's bounds),
/// a fresh claim, COMMIT; returns the median time per message.
async fn per_message(store: &SqlxStore, rounds: usize) -> u128 {
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let key = InboxKey::new(MessageId::new_v7(), ConsumerName::new("m").expect("valid"));
        let started = Instant::now();
        let mut tx = store.begin().await.expect("begin");
        assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Fresh);
        tx.commit().await.expect("commit");
        samples.push(started.elapsed());
    }
    median_micros(samples)
}

/// The measurements quoted in docs/postgres.md and the pull request (run
/// with `--release -- --ignored --nocapture per_transaction_cost`): the
/// per-transaction cost of the bounds' `SET LOCAL` (median of an empty
/// transaction with and without them), and the per-message cost (BEGIN,
/// claim, COMMIT) directly and through PgBouncer. One connection each,
/// no concurrency: latency, not throughput.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a check: run by hand"]
async fn per_transaction_cost() {
    use inbox_backend_sqlx::SessionTimeouts;
    const ROUNDS: usize = 3000;
    let _ = harness().await;
    let direct_pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&common::database_url())
        .await
        .unwrap_or_else(|error| common::unreachable_database(&error));
    let schema = common::unique_schema(common::TEST_PREFIX);
    let bounded = SqlxStore::new(direct_pool, &schema).expect("any pool");
    bounded.migrate().await.expect("migrate");
    let bare = bounded
        .clone()
        .with_session_timeouts(&SessionTimeouts::SERVER_DEFAULTS);
    for (name, store) in [("warm-up", &bounded), ("warm-up", &bare)] {
        let _ = (name, per_message(store, 200).await);
    }
    let empty = |store: SqlxStore| async move {
        let mut samples = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            let started = Instant::now();
            let tx = store.begin().await.expect("begin");
            tx.commit().await.expect("commit");
            samples.push(started.elapsed());
        }
        median_micros(samples)
    };
    let with_bounds = empty(bounded.clone()).await;
    let without = empty(bare.clone()).await;
    let with_bounds_again = empty(bounded.clone()).await;
    println!(
        "empty transaction, median of {ROUNDS}: with SET LOCAL bounds {with_bounds} µs \
         (again {with_bounds_again} µs), bare BEGIN {without} µs"
    );

    let direct = per_message(&bounded, ROUNDS).await;
    let bouncer = bouncer_store(1).await;
    let _ = per_message(&bouncer, 200).await;
    let through = per_message(&bouncer, ROUNDS).await;
    println!(
        "per message (BEGIN+bounds, claim, COMMIT), median of {ROUNDS}: direct {direct} µs, \
         through PgBouncer (transaction mode, unnamed statements) {through} µs"
    );
    let mut lookups = Vec::with_capacity(ROUNDS);
    let key = InboxKey::new(MessageId::new_v7(), ConsumerName::new("m").expect("valid"));
    for store in [&bounded, &bouncer] {
        let mut samples = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            let started = Instant::now();
            let _ = store.lookup(&key).await.expect("lookup");
            samples.push(started.elapsed());
        }
        lookups.push(median_micros(samples));
    }
    println!(
        "a statement outside a transaction (lookup), median of {ROUNDS}: direct {} µs, \
         through PgBouncer (in a transaction of its own) {} µs",
        lookups[0], lookups[1]
    );
}

/// The partitioned layout's maintenance names its tables unqualified (its
/// `DETACH … CONCURRENTLY` cannot run in a transaction that would set the
/// schema): on a pool whose connections resolve to another schema it is
/// refused loudly instead of maintaining that schema's tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_maintenance_is_refused_on_a_pool_of_another_schema() {
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&common::database_url())
        .await
        .unwrap_or_else(|error| common::unreachable_database(&error));
    let schema = common::unique_schema(common::TEST_PREFIX);
    let store = SqlxStore::new(pool, &schema)
        .expect("any pool")
        .with_layout(inbox_backend_sqlx::Layout::Partitioned);
    assert!(
        !store
            .migrate()
            .await
            .expect("the runner sets its schema")
            .is_empty()
    );
    for refused in [
        store.partitions().await.map(|_| ()),
        store.create_partitions(0, 1).await.map(|_| ()),
        store.drop_expired_days(Utc::now()).await.map(|_| ()),
    ] {
        let error = refused.expect_err("maintenance on another schema");
        assert!(
            matches!(error, InboxError::InvalidArgument { .. }),
            "{error:?}"
        );
    }
}
