//! The conformance suite's inbox, outbox and attempt-ledger contracts, run
//! with every store on a pool of the test's own
//! ([`DieselStore::from_pool`]) that goes through PgBouncer in transaction
//! mode (`.ci/services.sh` starts it on 127.0.0.1:6432, `PGBOUNCER_URL`
//! overrides), and a user's own pool that sets nothing.
//!
//! The pool's connections set nothing (no `search_path`, no timeout): the
//! statements name the schema and every transaction sets its own bounds;
//! [`Pooling::Transaction`] keeps no prepared statement between
//! transactions. The harness's own reads (effects, rows) go over a direct
//! connection: they are the test's eyes, not the store under test.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Double, Text, Timestamptz};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection as _};
use inbox_api::{
    Claim, ConsumerName, InboxError, InboxKey, InboxRecord, InboxStore as _, InboxTransaction as _,
    MessageId,
};
use inbox_backend_diesel::{DieselStore, DieselTransaction, Pooling, SchemaName, classify};
use inbox_conformance::postgres::support::{
    AGE_ATTEMPTS, AGE_OUTBOX, EFFECTS_TABLE, bouncer_url, record_effect_in, stored_key as key_of,
    unreachable_bouncer,
};
use inbox_conformance::{CrashKind, Harness};

/// The suite's view of a diesel store on a pool through PgBouncer.
struct BouncerHarness;

/// Checks that PgBouncer is there (failing loudly if not: never a skip)
/// and sweeps old test schemas.
async fn harness() -> BouncerHarness {
    common::sweep_old_schemas(&mut common::admin().await).await;
    let pool = bouncer_pool("inbox_bouncer_probe", 1);
    let mut conn = pool
        .get()
        .await
        .unwrap_or_else(|error| unreachable_bouncer(&error));
    conn.batch_execute("SELECT 1")
        .await
        .unwrap_or_else(|error| unreachable_bouncer(&error));
    BouncerHarness
}

/// A pool of the test's own through PgBouncer: what an application hands
/// to [`DieselStore::from_pool`]. Its connections carry `name` as
/// `application_name` (PgBouncer passes it on).
fn bouncer_pool(name: &str, max: usize) -> Pool<AsyncPgConnection> {
    let url = common::url_with_application_name(&bouncer_url(), name);
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(
        url,
        DieselStore::manager_config(Pooling::Transaction),
    );
    Pool::builder(manager)
        .max_size(max)
        .wait_timeout(Some(Duration::from_secs(15)))
        .runtime(deadpool::Runtime::Tokio1)
        .build()
        .unwrap_or_else(|error| unreachable_bouncer(&error))
}

/// A store in a new schema on a pool through PgBouncer, migrated through
/// PgBouncer too, with the suite's effects table.
async fn bouncer_store(max: usize) -> DieselStore {
    let schema = common::unique_schema(common::TEST_PREFIX);
    let store = DieselStore::from_pool(bouncer_pool(&schema, max), &schema)
        .expect("valid test schema name")
        .with_pooling(Pooling::Transaction);
    store.migrate().await.expect("migrate through PgBouncer");
    diesel::sql_query(EFFECTS_TABLE)
        .execute(&mut common::admin_in(store.schema()).await)
        .await
        .expect("create conformance_effects");
    store
}

#[derive(diesel::QueryableByName)]
struct EffectCount {
    #[diesel(sql_type = diesel::sql_types::Uuid)]
    message_id: uuid::Uuid,
    #[diesel(sql_type = Text)]
    consumer: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[async_trait]
impl Harness for BouncerHarness {
    type Store = DieselStore;

    fn name(&self) -> String {
        "diesel-async through PgBouncer (transaction mode)".into()
    }

    async fn fresh_store(&self) -> DieselStore {
        bouncer_store(10).await
    }

    async fn record_effect(
        &self,
        tx: &mut DieselTransaction,
        key: &InboxKey,
    ) -> Result<(), InboxError> {
        // The store's schema, from the connection's application_name.
        let schema: String = diesel::select(diesel::dsl::sql::<Text>(
            "current_setting('application_name')",
        ))
        .get_result(tx.conn())
        .await
        .map_err(classify)?;
        diesel::sql_query(record_effect_in(&SchemaName::new(&schema)?))
            .bind::<diesel::sql_types::Uuid, _>(key.message_id.as_uuid())
            .bind::<Text, _>(key.consumer.as_str())
            .execute(tx.conn())
            .await
            .map_err(classify)?;
        Ok(())
    }

    async fn effects(&self, store: &DieselStore) -> BTreeMap<InboxKey, u64> {
        let rows: Vec<EffectCount> = diesel::sql_query(
            "SELECT message_id, consumer, count(*) AS n FROM conformance_effects GROUP BY 1, 2",
        )
        .load(&mut common::admin_in(store.schema()).await)
        .await
        .expect("read effects");
        rows.into_iter()
            .map(|row| {
                (
                    key_of(row.message_id, row.consumer),
                    u64::try_from(row.n).expect("a count is never negative"),
                )
            })
            .collect()
    }

    async fn inbox_rows(&self, store: &DieselStore) -> Vec<InboxRecord> {
        let rows: Vec<common::InboxRow> =
            diesel::sql_query(inbox_conformance::postgres::support::INBOX_ROWS)
                .load(&mut common::admin_in(store.schema()).await)
                .await
                .expect("read inbox rows");
        rows.into_iter().map(common::InboxRow::record).collect()
    }

    async fn crash(&self, _store: &DieselStore, tx: DieselTransaction, kind: CrashKind) {
        match kind {
            CrashKind::Drop => drop(tx),
            // The transaction holds its server session until it ends, so
            // its pid is the session to kill, pooler or not.
            CrashKind::KillConnection => common::kill(&mut common::admin().await, tx).await,
        }
    }

    async fn age_rows(&self, store: &DieselStore, age: Duration) {
        diesel::sql_query(
            "UPDATE inbox_messages SET \
             received_at = received_at - make_interval(secs => $1), \
             processed_at = processed_at - make_interval(secs => $1)",
        )
        .bind::<Double, _>(age.as_secs_f64())
        .execute(&mut common::admin_in(store.schema()).await)
        .await
        .expect("age rows");
    }

    async fn store_now(&self, _store: &DieselStore) -> DateTime<Utc> {
        diesel::select(diesel::dsl::sql::<Timestamptz>("now()"))
            .get_result(&mut common::admin().await)
            .await
            .expect("read the database clock")
    }

    fn blocking_probe(&self) -> Duration {
        Duration::from_millis(300)
    }
}

#[async_trait]
impl inbox_conformance::OutboxHarness for BouncerHarness {
    async fn age_outbox(&self, store: &DieselStore, age: Duration) {
        diesel::sql_query(AGE_OUTBOX)
            .bind::<Double, _>(age.as_secs_f64())
            .execute(&mut common::admin_in(store.schema()).await)
            .await
            .expect("age the outbox");
    }
}

#[async_trait]
impl inbox_conformance::LedgerHarness for BouncerHarness {
    async fn age_attempts(&self, store: &DieselStore, age: Duration) {
        diesel::sql_query(AGE_ATTEMPTS)
            .bind::<Double, _>(age.as_secs_f64())
            .execute(&mut common::admin_in(store.schema()).await)
            .await
            .expect("age the attempt ledger");
    }
}

// The suite's contract scenarios, each a named test, through PgBouncer.
inbox_conformance::__with_contract_tests!(conformance harness);
inbox_conformance::__with_outbox_contract_tests!(@tests harness);
inbox_conformance::ledger_conformance_tests!(harness);

/// `SHOW name` on `conn`.
async fn show(conn: &mut AsyncPgConnection, name: &str) -> String {
    diesel::select(diesel::dsl::sql::<Text>(&format!(
        "current_setting('{name}')"
    )))
    .get_result(conn)
    .await
    .expect("current_setting")
}

/// The bounds hold through PgBouncer: nothing on the connection sets
/// them, the store's transaction does (and the pipelined begin too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_bounds_hold_through_pgbouncer() {
    let _ = harness().await;
    let store = bouncer_store(2).await;
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(show(tx.conn(), "lock_timeout").await, "3s");
    assert_eq!(
        show(tx.conn(), "idle_in_transaction_session_timeout").await,
        "1min"
    );
    assert_eq!(
        show(tx.conn(), "client_connection_check_interval").await,
        "1s"
    );
    tx.rollback().await.expect("rollback");

    let key = InboxKey::new(MessageId::new_v7(), ConsumerName::new("c").expect("valid"));
    let (mut tx, claim) = store.begin_claim(&key).await.expect("begin and claim");
    assert_eq!(claim, Claim::Fresh);
    assert_eq!(show(tx.conn(), "lock_timeout").await, "3s");
    tx.commit().await.expect("commit");
    assert!(store.lookup(&key).await.expect("lookup").is_some());
}

/// A user's own pool, whose `search_path` is the user's (`public`), with
/// no setting of the store's: the store works in its schema, the user's
/// unqualified table resolves in `public`, the bounds hold in the
/// transaction, and the pool's sessions are left as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_pool_keeps_its_search_path_and_gets_the_bounds() {
    let schema = common::unique_schema(common::TEST_PREFIX);
    let user_table = format!("{schema}_orders");
    let mut admin = common::admin().await;
    admin
        .batch_execute(&format!("CREATE TABLE public.{user_table} (id uuid)"))
        .await
        .expect("the user's table");
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(common::database_url());
    let pool = Pool::builder(manager).max_size(2).build().expect("pool");
    let store = DieselStore::from_pool(pool.clone(), &schema).expect("any pool");
    assert!(!store.migrate().await.expect("migrate").is_empty());
    assert!(store.migrate().await.expect("again").is_empty());

    let key = InboxKey::new(MessageId::new_v7(), ConsumerName::new("c").expect("valid"));
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Fresh);
    diesel::sql_query(format!("INSERT INTO {user_table} (id) VALUES ($1)"))
        .bind::<diesel::sql_types::Uuid, _>(key.message_id.as_uuid())
        .execute(tx.conn())
        .await
        .expect("the user's unqualified table");
    assert_eq!(show(tx.conn(), "lock_timeout").await, "3s");
    tx.commit().await.expect("commit");
    assert!(store.lookup(&key).await.expect("lookup").is_some());

    let mut conn = pool.get().await.expect("a pooled connection");
    assert_eq!(show(&mut conn, "search_path").await, "\"$user\", public");
    assert_eq!(show(&mut conn, "lock_timeout").await, "0");
    admin
        .batch_execute(&format!("DROP TABLE public.{user_table}"))
        .await
        .expect("drop the user's table");
}

/// The inbox's migrations run by the application's own diesel migration
/// harness (diesel_migrations on diesel-async's `AsyncConnectionWrapper`)
/// land in the inbox's schema, and the library's runner then finds nothing
/// to do; a schema the runner migrated first is accepted by the harness.
/// Either way the store works. Each harness run has an application schema
/// of its own (diesel's ledger lives there), so concurrent runs never
/// share a ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_users_harness_and_the_runner_recognise_each_other() {
    // The application's tool first, then the runner.
    let inbox = common::unique_schema(common::TEST_PREFIX);
    run_harness(&inbox).await;
    let store = users_store(&inbox);
    assert_eq!(store.migrate().await.expect("runner"), Vec::<i64>::new());
    let placed: Option<String> =
        diesel::select(diesel::dsl::sql::<diesel::sql_types::Nullable<Text>>(
            &format!("to_regclass('\"{inbox}\".outbox_messages')::text"),
        ))
        .get_result(&mut common::admin().await)
        .await
        .expect("regclass");
    assert!(placed.is_some(), "the tables are in the inbox's schema");
    claim_once(&store).await;

    // The runner first, then the application's tool.
    let inbox = common::unique_schema(common::TEST_PREFIX);
    let store = users_store(&inbox);
    assert!(!store.migrate().await.expect("runner").is_empty());
    run_harness(&inbox).await;
    assert_eq!(store.migrate().await.expect("again"), Vec::<i64>::new());
    claim_once(&store).await;
}

/// A store on a plain pool of the application's own.
fn users_store(inbox: &str) -> DieselStore {
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(common::database_url());
    let pool = Pool::builder(manager).max_size(2).build().expect("pool");
    DieselStore::from_pool(pool, inbox).expect("any pool")
}

/// Runs the pending migrations of [`InboxMigrations`] into `inbox` through
/// diesel_migrations' harness, on a connection whose `search_path` is an
/// application schema of its own.
async fn run_harness(inbox: &str) {
    use diesel::Connection as _;
    use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
    use diesel_migrations::MigrationHarness as _;

    let app = common::unique_schema(common::TEST_PREFIX);
    common::admin()
        .await
        .batch_execute(&format!("CREATE SCHEMA {app}"))
        .await
        .expect("the application's schema");
    let separator = if common::database_url().contains('?') {
        '&'
    } else {
        '?'
    };
    let url = format!(
        "{}{separator}options=-c%20search_path%3D{app}",
        common::database_url()
    );
    let source = inbox_backend_diesel::InboxMigrations::new(inbox).expect("valid schema");
    tokio::task::spawn_blocking(move || {
        let mut conn = AsyncConnectionWrapper::<AsyncPgConnection>::establish(&url)
            .unwrap_or_else(|error| panic!("PostgreSQL not reachable: {error}"));
        conn.run_pending_migrations(source)
            .map(|applied| applied.len())
            .expect("the harness runs the inbox's migrations")
    })
    .await
    .expect("the harness's thread");
}

/// One fresh claim, committed, then a duplicate.
async fn claim_once(store: &DieselStore) {
    let key = InboxKey::new(MessageId::new_v7(), ConsumerName::new("c").expect("valid"));
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Fresh);
    tx.commit().await.expect("commit");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Duplicate);
    tx.rollback().await.expect("rollback");
}
