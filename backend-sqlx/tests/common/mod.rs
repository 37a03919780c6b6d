//! What every test file of this crate needs: the database, a fresh schema
//! per store, and a way to kill a transaction's connection from outside.
//!
//! Each store lives in its own schema `inbox_test_<unixsecs>_<random>`, so
//! concurrent test runs (other engineers, CI) never see each other's rows.
//! Schemas whose embedded time is older than an hour are swept when a test
//! connects; younger ones may belong to a run still going and are left
//! alone.
#![allow(
    dead_code,
    unreachable_pub,
    reason = "each test file uses a different part"
)]

pub mod relay;

use std::time::Duration;

use inbox_api::InboxError;
use inbox_backend_sqlx::{SessionTimeouts, SqlxStore, SqlxTransaction, classify};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

pub use inbox_conformance::postgres::support::{
    EFFECTS_TABLE, LIST_SCHEMAS, RECORD_EFFECT, TEST_PREFIX, database_url, drop_schema_sql,
    like_prefix, stale_schemas, unique_schema, unreachable_database,
};

/// A small pool for the tests' own statements (creating and dropping
/// schemas, killing backends). Panics, never skips, when the database is not
/// there: a test that quietly passes without its database proves nothing.
pub async fn admin_pool() -> PgPool {
    let url = database_url();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&url)
        .await;
    pool.unwrap_or_else(|error| unreachable_database(&error))
}

/// A store on `schema` through [`SqlxStore::connect`], not migrated.
pub async fn connect(schema: &str) -> SqlxStore {
    SqlxStore::connect(&database_url(), schema)
        .await
        .unwrap_or_else(|error| unreachable_database(&error))
}

/// Drops the schemas starting with `prefix` whose embedded time is older
/// than `SWEEP_AFTER`. Failures are logged, never fatal: another run may
/// be sweeping the same schema right now.
pub async fn sweep_old_schemas(admin: &PgPool, prefix: &str) {
    let listed = sqlx::query_scalar(LIST_SCHEMAS)
        .bind(like_prefix(prefix))
        .fetch_all(admin)
        .await;
    let names = listed.unwrap_or_else(|error| {
        tracing::warn!(%error, "listing old test schemas failed");
        Vec::new()
    });
    for schema in stale_schemas(names, prefix) {
        if let Err(error) = sqlx::query(&drop_schema_sql(&schema)).execute(admin).await {
            tracing::warn!(%schema, %error, "dropping an old test schema failed");
        }
    }
}

/// A migrated store in a new schema of its own, with `max` connections.
/// Its connections carry the schema as `application_name`, so tests can
/// find them in `pg_stat_activity`.
pub async fn fresh_store(max: u32) -> SqlxStore {
    fresh_store_via(max, None).await
}

/// As [`fresh_store`], the connections going through the relay listening on
/// `relay_port` when there is one.
pub async fn fresh_store_via(max: u32, relay_port: Option<u16>) -> SqlxStore {
    let store = store_in(&unique_schema(TEST_PREFIX), max, relay_port).await;
    store.migrate().await.expect("migrate a fresh schema");
    store
}

/// A store in `schema` with `max` connections, not migrated, through the
/// relay listening on `relay_port` when there is one. Its connections carry
/// the schema as `application_name`.
pub async fn store_in(schema: &str, max: u32, relay_port: Option<u16>) -> SqlxStore {
    store_with(schema, max, relay_port, &SessionTimeouts::default()).await
}

/// As [`store_in`], its sessions under `timeouts`.
pub async fn store_with(
    schema: &str,
    max: u32,
    relay_port: Option<u16>,
    timeouts: &SessionTimeouts,
) -> SqlxStore {
    let mut options = SqlxStore::connect_options_with(&database_url(), schema, timeouts)
        .expect("valid test schema name")
        .application_name(schema);
    if let Some(port) = relay_port {
        options = options.host("127.0.0.1").port(port);
    }
    let pool = PgPoolOptions::new()
        .max_connections(max)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(15))
        .idle_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .unwrap_or_else(|error| unreachable_database(&error));
    SqlxStore::new(pool, schema)
        .expect("valid test schema name")
        .with_session_timeouts(timeouts)
}

/// The server's TCP address, from `DATABASE_URL`.
pub async fn server_addr() -> std::net::SocketAddr {
    let options: PgConnectOptions = database_url().parse().expect("database url");
    tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("resolve the database host")
        .next()
        .expect("an address for the database host")
}

/// The port of the client end of `tx`'s connection, as the server sees it
/// (the relay's port towards the server, when relayed).
pub async fn client_port(tx: &mut SqlxTransaction) -> Result<u16, InboxError> {
    let port: Option<i32> = sqlx::query_scalar("SELECT inet_client_port()")
        .fetch_one(tx.conn())
        .await
        .map_err(classify)?;
    port.and_then(|p| u16::try_from(p).ok())
        .ok_or_else(|| InboxError::InvalidArgument {
            message: "not a TCP connection".into(),
        })
}

/// The transaction id of `tx`, assigned now if it has none yet, as text
/// (for `pg_xact_status`).
pub async fn xact_id(tx: &mut SqlxTransaction) -> Result<String, InboxError> {
    sqlx::query_scalar("SELECT pg_current_xact_id()::text")
        .fetch_one(tx.conn())
        .await
        .map_err(classify)
}

/// `committed`, `aborted` or `in progress`: what the server knows of a
/// transaction id, from another connection.
pub async fn xact_status(store: &SqlxStore, xid: &str) -> Option<String> {
    sqlx::query_scalar("SELECT pg_xact_status($1::xid8)")
        .bind(xid)
        .fetch_one(store.pool())
        .await
        .expect("pg_xact_status")
}

/// The server process behind `tx`'s connection.
pub async fn backend_pid(tx: &mut SqlxTransaction) -> Result<i32, InboxError> {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(tx.conn())
        .await
        .map_err(classify)
}

/// Kills server process `pid` from another connection of `pool`, and waits
/// (up to 5 s, PostgreSQL 14+) until it is gone, so its transaction is
/// rolled back and its locks released when this returns.
pub async fn terminate(pool: &PgPool, pid: i32) -> bool {
    sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
        .bind(pid)
        .fetch_one(pool)
        .await
        .expect("pg_terminate_backend")
}

/// Kills `tx`'s connection from outside, then drops `tx`: a process crash
/// as the database sees it.
pub async fn kill(store: &SqlxStore, mut tx: SqlxTransaction) {
    let pid = backend_pid(&mut tx).await.expect("backend pid");
    assert!(terminate(store.pool(), pid).await, "backend {pid} killed");
    drop(tx);
}

/// Committed rows of `table` in `store`'s schema, counted on a fresh
/// connection.
pub async fn count(store: &SqlxStore, table: &str) -> i64 {
    // Only called with literal table names from the tests.
    sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
        .fetch_one(store.pool())
        .await
        .expect("count rows")
}

/// Creates [`EFFECTS_TABLE`] in `store`'s schema.
pub async fn create_effects_table(store: &SqlxStore) {
    sqlx::query(EFFECTS_TABLE)
        .execute(store.pool())
        .await
        .expect("create conformance_effects");
}

/// One effect row for `key`, written in `tx`: the consumer's business write.
pub async fn record_effect(
    tx: &mut SqlxTransaction,
    key: &inbox_api::InboxKey,
) -> Result<(), InboxError> {
    sqlx::query(RECORD_EFFECT)
        .bind(key.message_id.as_uuid())
        .bind(key.consumer.as_str())
        .execute(tx.conn())
        .await
        .map_err(classify)?;
    Ok(())
}

/// Committed effects of `key`, read on a fresh connection.
pub async fn effects_of(store: &SqlxStore, key: &inbox_api::InboxKey) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM conformance_effects WHERE message_id = $1 AND consumer = $2",
    )
    .bind(key.message_id.as_uuid())
    .bind(key.consumer.as_str())
    .fetch_one(store.pool())
    .await
    .expect("count effects")
}
