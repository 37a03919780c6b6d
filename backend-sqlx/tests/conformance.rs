//! The shared conformance suite, run against the real PostgreSQL.
//!
//! Every store the suite asks for gets its own fresh schema; crashes of kind
//! `KillConnection` are real: the transaction's server process is terminated
//! from another connection with `pg_terminate_backend`. A lost commit is
//! real too: the store's connections go through a TCP relay that swallows
//! the server's answer to COMMIT and then cuts the connection.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use common::relay::Relay;
use inbox_api::{
    ConsumerName, InboxError, InboxKey, InboxRecord, InboxTransaction as _, MessageId,
};
use inbox_backend_sqlx::{Layout, SessionTimeouts, SqlxStore, SqlxTransaction, classify};
use inbox_conformance::{CrashKind, Harness, PgHarness};
use sqlx::Row as _;

/// The suite's view of the sqlx backend.
struct SqlxHarness {
    /// The relay in front of each store, by schema.
    relays: Mutex<HashMap<String, Arc<Relay>>>,
    /// The inbox layout of every store it makes.
    layout: Layout,
    /// Run on every store's schema after its migration, to break it on
    /// purpose (`inbox_conformance::broken`'s layouts).
    breakage: Option<&'static str>,
}

impl SqlxHarness {
    fn relay_of(&self, store: &SqlxStore) -> Arc<Relay> {
        self.relays
            .lock()
            .expect("relays")
            .get(store.schema())
            .cloned()
            .expect("every store of this harness has a relay")
    }
}

/// Builds the harness: checks that the database is there (failing loudly if
/// not) and sweeps the test schemas of runs older than an hour.
async fn harness() -> SqlxHarness {
    let admin = common::admin_pool().await;
    common::sweep_old_schemas(&admin, common::TEST_PREFIX).await;
    // Left behind by benchmark runs that were killed before their cleanup.
    common::sweep_old_schemas(&admin, "inbox_bench_").await;
    admin.close().await;
    SqlxHarness {
        relays: Mutex::default(),
        layout: Layout::Table,
        breakage: None,
    }
}

/// As [`harness`], every store with the partitioned inbox layout.
async fn partitioned_harness() -> SqlxHarness {
    SqlxHarness {
        layout: Layout::Partitioned,
        ..harness().await
    }
}

inbox_conformance::conformance_tests!(
    harness,
    cases = inbox_conformance::postgres::support::MODEL_CASES
);

use inbox_conformance::postgres::support::{INBOX_ROWS, stored_key as key_of, stored_record};

#[async_trait]
impl Harness for SqlxHarness {
    type Store = SqlxStore;

    fn name(&self) -> String {
        "sqlx (PostgreSQL)".into()
    }

    fn layout(&self) -> Layout {
        self.layout
    }

    async fn fresh_store(&self) -> SqlxStore {
        let relay = Relay::start(common::server_addr().await).await;
        let store = common::store_in(
            &common::unique_schema(common::TEST_PREFIX),
            10,
            Some(relay.port()),
        )
        .await
        .with_layout(self.layout);
        store.migrate().await.expect("migrate a fresh schema");
        if let Some(breakage) = self.breakage {
            sqlx::query(breakage)
                .execute(&mut side(&store).await)
                .await
                .expect("break the store's layout");
        }
        common::create_effects_table(&store).await;
        self.relays
            .lock()
            .expect("relays")
            .insert(store.schema().to_owned(), Arc::new(relay));
        store
    }

    async fn record_effect(
        &self,
        tx: &mut SqlxTransaction,
        key: &InboxKey,
    ) -> Result<(), InboxError> {
        common::record_effect(tx, key).await
    }

    async fn effects(&self, store: &SqlxStore) -> BTreeMap<InboxKey, u64> {
        let rows = sqlx::query(
            "SELECT message_id, consumer, count(*) AS n FROM conformance_effects GROUP BY 1, 2",
        )
        .fetch_all(store.pool())
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
            .fetch_all(store.pool())
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
            CrashKind::KillConnection => common::kill(store, tx).await,
        }
    }

    async fn commit_lost(
        &self,
        store: &SqlxStore,
        mut tx: SqlxTransaction,
        commit_happens: bool,
    ) -> Option<bool> {
        let ids = async {
            let pid = common::backend_pid(&mut tx).await?;
            let port = common::client_port(&mut tx).await?;
            let xid = common::xact_id(&mut tx).await?;
            Ok::<_, InboxError>((pid, port, xid))
        };
        let Ok((pid, port, xid)) = ids.await else {
            // The connection is already gone, and the transaction with it.
            return Some(false);
        };
        if !commit_happens {
            // Killed before COMMIT is sent: the transaction dies with its
            // process, and COMMIT meets a closed connection.
            common::terminate(store.pool(), pid).await;
            let committed = tx.commit().await.is_ok();
            return Some(committed);
        }
        // COMMIT runs and commits, but its answer is swallowed by the relay;
        // once the server session is idle again the connection is cut. The
        // consumer sees a broken connection and cannot tell what happened.
        let relay = self.relay_of(store);
        relay.swallow_answers(port);
        let commit = tokio::spawn(tx.commit());
        let started = Instant::now();
        loop {
            let status = common::xact_status(store, &xid).await;
            if status.as_deref() != Some("in progress") {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "COMMIT of {xid} did not finish"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        relay.cut(port);
        let answered = commit.await.expect("commit task");
        assert!(answered.is_err(), "the COMMIT's answer was swallowed");
        let status = common::xact_status(store, &xid).await;
        Some(status.as_deref() == Some("committed"))
    }

    async fn age_rows(&self, store: &SqlxStore, age: Duration) {
        sqlx::query(
            "UPDATE inbox_messages SET \
             received_at = received_at - make_interval(secs => $1), \
             processed_at = processed_at - make_interval(secs => $1)",
        )
        .bind(age.as_secs_f64())
        .execute(store.pool())
        .await
        .expect("age rows");
    }

    async fn store_now(&self, store: &SqlxStore) -> DateTime<Utc> {
        sqlx::query_scalar("SELECT now()")
            .fetch_one(store.pool())
            .await
            .expect("read the database clock")
    }

    fn blocking_probe(&self) -> Duration {
        // A claim that is not blocked answers in well under a millisecond
        // on localhost; a loaded two-core machine needs the margin.
        Duration::from_millis(300)
    }
}

/// The harness' lost commit is what it claims to be: with
/// `commit_happens` the row is durable although the consumer saw an error,
/// without it nothing is; the redelivery finds out either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_commit_lost_is_real() {
    use inbox_api::{Claim, InboxStore as _};

    let h = harness().await;
    let store = h.fresh_store().await;
    for commit_happens in [true, false] {
        let key = InboxKey::new(
            MessageId::new_v7(),
            ConsumerName::new("lost").expect("valid consumer"),
        );
        let mut tx = store.begin().await.expect("begin");
        assert_eq!(tx.claim(&key).await.expect("claim"), Claim::Fresh);
        h.record_effect(&mut tx, &key).await.expect("work");
        let outcome = h.commit_lost(&store, tx, commit_happens).await;
        assert_eq!(outcome, Some(commit_happens));
        let durable = store.lookup(&key).await.expect("lookup").is_some();
        assert_eq!(durable, commit_happens);
        let effects = h.effects(&store).await.get(&key).copied().unwrap_or(0);
        assert_eq!(effects, u64::from(commit_happens));
    }
}

inbox_conformance::postgres_tests!(harness);

inbox_conformance::outbox_conformance_tests!(
    harness,
    cases = inbox_conformance::postgres::support::OUTBOX_MODEL_CASES
);

#[async_trait]
impl inbox_conformance::OutboxHarness for SqlxHarness {
    async fn age_outbox(&self, store: &SqlxStore, age: Duration) {
        sqlx::query(inbox_conformance::postgres::support::AGE_OUTBOX)
            .bind(age.as_secs_f64())
            .execute(store.pool())
            .await
            .expect("age the outbox");
    }
}

inbox_conformance::ledger_conformance_tests!(harness);

inbox_conformance::response_conformance_tests!(harness);

/// The suite can fail on a layout: a partitioned inbox whose partition is
/// chosen by arrival time instead of by the id lets a later duplicate miss
/// its first copy, and the contract tests reject it.
#[test]
fn the_suite_rejects_a_layout_partitioned_by_arrival_time() {
    let rt = inbox_conformance::runtime();
    let failures = rt.block_on(async {
        let harness = SqlxHarness {
            breakage: Some(inbox_conformance::broken::LAYOUT_PARTITIONED_BY_ARRIVAL),
            ..partitioned_harness().await
        };
        inbox_conformance::contract::run_all(&harness).await
    });
    let names: Vec<_> = failures.iter().map(|(name, _)| *name).collect();
    println!("a layout partitioned by arrival rejected by {names:?}");
    assert!(
        names.contains(&"claim_is_fresh_then_duplicate"),
        "a duplicate met no first copy, yet the suite did not say so: {names:?}"
    );
}

/// The whole suite again, every store with the partitioned inbox layout in
/// a schema of its own: the contract and both crash-point models, the
/// Postgres scenarios, the outbox and the ledger. The suite's keys mix
/// time-ordered (v7) and random (v4) ids, so its claims land in real day
/// partitions and in the untimed one; tests whose expectation depends on
/// the layout ask the harness's (`Harness::layout`).
mod partitioned {
    inbox_conformance::postgres_store_tests!(super::partitioned_harness);
}

#[async_trait]
impl inbox_conformance::LedgerHarness for SqlxHarness {
    async fn age_attempts(&self, store: &SqlxStore, age: Duration) {
        sqlx::query(inbox_conformance::postgres::support::AGE_ATTEMPTS)
            .bind(age.as_secs_f64())
            .execute(store.pool())
            .await
            .expect("age the attempt ledger");
    }
}

/// A connection of its own (outside every store's pool) in `store`'s
/// schema.
async fn side(store: &SqlxStore) -> sqlx::PgConnection {
    let options = SqlxStore::connect_options(&common::database_url(), store.schema())
        .expect("valid test schema name");
    sqlx::ConnectOptions::connect(&options)
        .await
        .unwrap_or_else(|error| common::unreachable_database(&error))
}

#[async_trait]
impl PgHarness for SqlxHarness {
    async fn store_with(&self, schema: &str, pool: usize, timeouts: &SessionTimeouts) -> SqlxStore {
        let pool = u32::try_from(pool).expect("a small pool");
        common::store_with(schema, pool, None, timeouts)
            .await
            .with_layout(self.layout)
    }

    async fn store_laid_out(&self, schema: &str, pool: usize, layout: Layout) -> SqlxStore {
        let pool = u32::try_from(pool).expect("a small pool");
        common::store_in(schema, pool, None)
            .await
            .with_layout(layout)
    }

    async fn connect_to(&self, url: &str) -> Result<SqlxStore, InboxError> {
        let options = SqlxStore::connect_options(url, "inbox")?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_secs(2))
            .connect_with(options)
            .await
            .map_err(classify)?;
        SqlxStore::new(pool, "inbox")
    }

    async fn migrate(&self, store: &SqlxStore) -> Result<Vec<i64>, InboxError> {
        store.migrate().await
    }

    fn schema_of(&self, store: &SqlxStore) -> String {
        store.schema().to_owned()
    }

    async fn side_execute(&self, store: &SqlxStore, sql: &str) -> Result<u64, InboxError> {
        let mut conn = side(store).await;
        let done = sqlx::query(sql)
            .execute(&mut conn)
            .await
            .map_err(classify)?;
        Ok(done.rows_affected())
    }

    async fn side_i64(&self, store: &SqlxStore, sql: &str) -> Result<i64, InboxError> {
        let mut conn = side(store).await;
        sqlx::query_scalar(sql)
            .fetch_one(&mut conn)
            .await
            .map_err(classify)
    }

    async fn explain(&self, store: &SqlxStore, sql: &str) -> Result<Vec<String>, InboxError> {
        let mut conn = side(store).await;
        sqlx::query_scalar(&format!("EXPLAIN {sql}"))
            .fetch_all(&mut conn)
            .await
            .map_err(classify)
    }

    async fn tx_execute(&self, tx: &mut SqlxTransaction, sql: &str) -> Result<(), InboxError> {
        sqlx::query(sql)
            .execute(tx.conn())
            .await
            .map_err(classify)?;
        Ok(())
    }

    async fn tx_i64(&self, tx: &mut SqlxTransaction, sql: &str) -> Result<i64, InboxError> {
        sqlx::query_scalar(sql)
            .fetch_one(tx.conn())
            .await
            .map_err(classify)
    }
}
