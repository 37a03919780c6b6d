//! What every test file of this crate needs: the database, a fresh schema
//! per store, and a way to kill a transaction's connection from outside.
//!
//! Each store lives in its own schema `inbox_test_<unixsecs>_<random>`, so
//! concurrent test runs (other engineers, CI, the sqlx backend's tests) never
//! see each other's rows. Schemas whose embedded time is older than an hour
//! are swept when a harness is created; younger ones may belong to a run
//! still going and are left alone.
#![allow(
    dead_code,
    unreachable_pub,
    reason = "each test file uses a different part"
)]

use std::time::Duration;

use diesel::sql_types::{BigInt, Bool, Integer, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use inbox_api::InboxError;
use inbox_backend_diesel::{
    DieselStore, DieselTransaction, Layout, SchemaName, SessionTimeouts, classify,
};

pub use inbox_conformance::postgres::support::{
    EFFECTS_TABLE, LIST_SCHEMAS, RECORD_EFFECT, TEST_PREFIX, database_url, drop_schema_sql,
    like_prefix, redacted, stale_schemas, stored_record, unique_schema,
};

/// A row `inbox_conformance::postgres::support::INBOX_ROWS` reads back.
#[derive(diesel::QueryableByName)]
pub struct InboxRow {
    #[diesel(sql_type = diesel::sql_types::Uuid)]
    id: uuid::Uuid,
    #[diesel(sql_type = Text)]
    consumer_type: String,
    #[diesel(sql_type = diesel::sql_types::Timestamptz)]
    received_at: chrono::DateTime<chrono::Utc>,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Timestamptz>)]
    processed_at: Option<chrono::DateTime<chrono::Utc>>,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Bytea>)]
    payload_fingerprint: Option<Vec<u8>>,
}

impl InboxRow {
    /// The store's record of this row.
    #[allow(dead_code, reason = "not every test file reads inbox rows")]
    pub fn record(self) -> inbox_api::InboxRecord {
        stored_record(
            self.id,
            self.consumer_type,
            self.received_at,
            self.processed_at,
            self.payload_fingerprint,
        )
    }
}

/// `url` with `application_name` set, so a test can find a store's
/// connections in `pg_stat_activity`.
pub fn url_with_application_name(url: &str, name: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}application_name={name}")
}

/// A connection of the test's own (creating and dropping schemas, killing
/// backends, reading state outside any store). Panics, never skips, when the
/// database is not there: a test that quietly passes without its database
/// proves nothing.
pub async fn admin() -> AsyncPgConnection {
    let url = database_url();
    match tokio::time::timeout(Duration::from_secs(10), AsyncPgConnection::establish(&url)).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(error)) => panic!(
            "PostgreSQL not reachable at {}: {error}; start it with \
             `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` \
             (or point DATABASE_URL at a server)",
            redacted(&url)
        ),
        Err(_) => panic!(
            "PostgreSQL at {} did not answer within 10 s",
            redacted(&url)
        ),
    }
}

/// An admin connection whose `search_path` is `schema`.
pub async fn admin_in(schema: &SchemaName) -> AsyncPgConnection {
    let mut conn = admin().await;
    diesel_async::SimpleAsyncConnection::batch_execute(
        &mut conn,
        &format!("SET search_path TO \"{schema}\""),
    )
    .await
    .expect("set search_path");
    conn
}

#[derive(diesel::QueryableByName)]
struct Name {
    #[diesel(sql_type = Text)]
    nspname: String,
}

/// Drops the test schemas whose embedded time is older than
/// `SWEEP_AFTER`. Failures are logged, never fatal: another run may be
/// sweeping the same schema right now.
pub async fn sweep_old_schemas(admin: &mut AsyncPgConnection) {
    let listed: Result<Vec<Name>, _> = diesel::sql_query(format!(
        "SELECT nspname FROM ({LIST_SCHEMAS}) AS s(nspname)"
    ))
    .bind::<Text, _>(like_prefix(TEST_PREFIX))
    .load(admin)
    .await;
    let names = listed.map(|rows| rows.into_iter().map(|n| n.nspname).collect());
    for schema in stale_schemas(
        names.unwrap_or_else(|error: diesel::result::Error| {
            tracing::warn!(%error, "listing old test schemas failed");
            Vec::new()
        }),
        TEST_PREFIX,
    ) {
        if let Err(error) = diesel::sql_query(drop_schema_sql(&schema))
            .execute(admin)
            .await
        {
            tracing::warn!(%schema, %error, "dropping an old test schema failed");
        }
    }
}

/// A store in a new schema of its own, with `pool` connections, not yet
/// migrated. Its connections carry the schema as `application_name`.
pub async fn unmigrated_store(pool: usize, wait: Duration) -> DieselStore {
    store_in(&unique_schema(TEST_PREFIX), pool, wait).await
}

/// A store in `schema`, with `pool` connections, not migrated. Its
/// connections carry the schema as `application_name`.
pub async fn store_in(schema: &str, pool: usize, wait: Duration) -> DieselStore {
    store_with(schema, pool, wait, &SessionTimeouts::default()).await
}

/// As [`store_in`], its sessions under `timeouts`.
pub async fn store_with(
    schema: &str,
    pool: usize,
    wait: Duration,
    timeouts: &SessionTimeouts,
) -> DieselStore {
    store_with_layout(schema, pool, wait, timeouts, Layout::Table).await
}

/// As [`store_with`], its inbox table laid out as `layout`.
pub async fn store_with_layout(
    schema: &str,
    pool: usize,
    wait: Duration,
    timeouts: &SessionTimeouts,
    layout: Layout,
) -> DieselStore {
    let url = url_with_application_name(&database_url(), schema);
    DieselStore::builder(url, schema)
        .expect("valid test schema name")
        .layout(layout)
        .pool_size(pool)
        .session_timeouts(*timeouts)
        .wait_timeout(wait)
        .connect()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "PostgreSQL not reachable at {}: {e} ({:?})",
                redacted(&database_url()),
                std::error::Error::source(&e).map(ToString::to_string)
            )
        })
}

/// A migrated store in a new schema of its own, with `pool` connections and
/// the suite's effects table (no unique constraint: tests count doubles).
pub async fn fresh_store(pool: usize) -> DieselStore {
    fresh_store_laid_out(pool, Layout::Table).await
}

/// As [`fresh_store`], its inbox table laid out as `layout`.
pub async fn fresh_store_laid_out(pool: usize, layout: Layout) -> DieselStore {
    let store = store_with_layout(
        &unique_schema(TEST_PREFIX),
        pool,
        Duration::from_secs(15),
        &SessionTimeouts::default(),
        layout,
    )
    .await;
    store.migrate().await.expect("migrate a fresh schema");
    let mut conn = store.pool().get().await.expect("a pooled connection");
    diesel::sql_query(EFFECTS_TABLE)
        .execute(&mut *conn)
        .await
        .expect("create conformance_effects");
    store
}

/// One business write inside `tx`.
pub async fn record_effect(
    tx: &mut DieselTransaction,
    key: &inbox_api::InboxKey,
) -> Result<(), InboxError> {
    diesel::sql_query(RECORD_EFFECT)
        .bind::<diesel::sql_types::Uuid, _>(key.message_id.as_uuid())
        .bind::<Text, _>(key.consumer.as_str())
        .execute(tx.conn())
        .await
        .map_err(classify)?;
    Ok(())
}

/// The server process behind `tx`'s connection.
pub async fn backend_pid(tx: &mut DieselTransaction) -> Result<i32, InboxError> {
    diesel::select(diesel::dsl::sql::<Integer>("pg_backend_pid()"))
        .get_result(tx.conn())
        .await
        .map_err(classify)
}

/// Kills server process `pid` from another connection, and waits (up to
/// 5 s) until it is gone, so its transaction is rolled back and its locks
/// released when this returns.
pub async fn terminate(pid: i32) -> bool {
    terminate_via(&mut admin().await, pid).await
}

/// As [`terminate`], from a connection the caller has (a pooled one).
pub async fn terminate_via(conn: &mut AsyncPgConnection, pid: i32) -> bool {
    diesel::select(
        diesel::dsl::sql::<Bool>("pg_terminate_backend(")
            .bind::<Integer, _>(pid)
            .sql(", 5000)"),
    )
    .get_result(conn)
    .await
    .expect("pg_terminate_backend")
}

/// Kills `tx`'s connection from `killer`, a connection outside the store's
/// pool, then drops `tx`: a process crash as the database sees it.
///
/// Not a pooled connection: in the suite a COMMIT racing a kill may win and
/// return its connection to the pool just before the kill lands, and a
/// killer checked out of that pool could be that very connection.
pub async fn kill(killer: &mut AsyncPgConnection, mut tx: DieselTransaction) {
    let pid = backend_pid(&mut tx).await.expect("backend pid");
    assert!(terminate_via(killer, pid).await, "backend {pid} killed");
    drop(tx);
}

/// Committed rows of `table` in `schema`, counted on a connection outside
/// the store's pool.
pub async fn count(schema: &SchemaName, table: &str) -> i64 {
    let mut conn = admin_in(schema).await;
    // Only called with literal table names from the tests.
    diesel::select(diesel::dsl::sql::<BigInt>(&format!(
        "(SELECT count(*) FROM {table})"
    )))
    .get_result(&mut conn)
    .await
    .expect("count rows")
}

/// A pooled connection of `store` that answers. The suite kills server
/// processes by pid, and a COMMIT racing the kill may win and hand its
/// connection back to the pool just before the process dies; the pool then
/// holds a dead connection until its driver notices. The store's own
/// `begin` retries past such a connection; the harness's direct queries do
/// it here.
pub async fn live_conn(store: &DieselStore) -> inbox_backend_diesel::PooledConnection {
    for _ in 0..5 {
        let mut conn = store.pool().get().await.expect("a pooled connection");
        match diesel::sql_query("SELECT 1").execute(&mut *conn).await {
            Ok(_) => return conn,
            Err(_) => drop(deadpool::managed::Object::take(conn)),
        }
    }
    panic!("no live connection in the pool after 5 attempts");
}
