//! The shared conformance suite, run against the real PostgreSQL.
//!
//! Every store the suite asks for gets its own fresh schema; crashes of kind
//! `KillConnection` are real: the transaction's server process is terminated
//! from another connection with `pg_terminate_backend`.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Bool, Double, Integer, Text, Timestamptz};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use inbox_api::{InboxError, InboxKey, InboxRecord, InboxTransaction as _};
use inbox_backend_diesel::classify;
use inbox_backend_diesel::{DieselStore, DieselTransaction, Layout, SessionTimeouts};
use inbox_conformance::{CrashKind, Harness, PgHarness};

/// The suite's view of the diesel backend.
struct DieselHarness {
    /// Kills transactions' server processes: a connection of its own,
    /// outside every store's pool (see `common::kill`).
    killer: tokio::sync::Mutex<AsyncPgConnection>,
    /// The inbox layout of every store it makes.
    layout: Layout,
}

/// Builds the harness: checks that the database is there (failing loudly if
/// not) and sweeps the test schemas of runs older than an hour.
async fn harness() -> DieselHarness {
    let mut admin = common::admin().await;
    common::sweep_old_schemas(&mut admin).await;
    DieselHarness {
        killer: tokio::sync::Mutex::new(admin),
        layout: Layout::Table,
    }
}

/// As [`harness`], every store with the partitioned inbox layout.
async fn partitioned_harness() -> DieselHarness {
    DieselHarness {
        layout: Layout::Partitioned,
        ..harness().await
    }
}

inbox_conformance::conformance_tests!(
    harness,
    cases = inbox_conformance::postgres::support::MODEL_CASES
);

use inbox_conformance::postgres::support::stored_key as key_of;

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
impl Harness for DieselHarness {
    type Store = DieselStore;

    fn name(&self) -> String {
        "diesel-async (PostgreSQL)".into()
    }

    async fn fresh_store(&self) -> DieselStore {
        common::fresh_store_laid_out(10, self.layout).await
    }

    fn layout(&self) -> Layout {
        self.layout
    }

    async fn record_effect(
        &self,
        tx: &mut DieselTransaction,
        key: &InboxKey,
    ) -> Result<(), InboxError> {
        common::record_effect(tx, key).await
    }

    async fn effects(&self, store: &DieselStore) -> BTreeMap<InboxKey, u64> {
        let mut conn = common::live_conn(store).await;
        let rows: Vec<EffectCount> = diesel::sql_query(
            "SELECT message_id, consumer, count(*) AS n FROM conformance_effects GROUP BY 1, 2",
        )
        .load(&mut *conn)
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
        let mut conn = common::live_conn(store).await;
        let rows: Vec<common::InboxRow> =
            diesel::sql_query(inbox_conformance::postgres::support::INBOX_ROWS)
                .load(&mut *conn)
                .await
                .expect("read inbox rows");
        rows.into_iter().map(common::InboxRow::record).collect()
    }

    async fn crash(&self, _store: &DieselStore, tx: DieselTransaction, kind: CrashKind) {
        match kind {
            CrashKind::Drop => drop(tx),
            CrashKind::KillConnection => common::kill(&mut *self.killer.lock().await, tx).await,
        }
    }

    async fn commit_lost(
        &self,
        _store: &DieselStore,
        mut tx: DieselTransaction,
        commit_happens: bool,
    ) -> Option<bool> {
        let pid = match common::backend_pid(&mut tx).await {
            Ok(pid) => pid,
            // The connection is already gone, and the transaction with it.
            Err(_) => return Some(false),
        };
        let mut killer = self.killer.lock().await;
        if !commit_happens {
            // Killed before COMMIT is sent: the transaction dies with its
            // process, and COMMIT meets a closed connection.
            common::terminate_via(&mut killer, pid).await;
            return match tx.commit().await {
                Ok(()) => Some(true),
                Err(_) => Some(false),
            };
        }
        // COMMIT and the kill race: the server may commit and die before the
        // answer leaves, which is the lost commit a consumer cannot tell from
        // a failed one. An Ok means it committed; an error means nobody
        // knows, and redelivery has to find out.
        let kill = diesel::select(
            diesel::dsl::sql::<Bool>("pg_terminate_backend(")
                .bind::<Integer, _>(pid)
                .sql(", 5000)"),
        )
        .get_result::<bool>(&mut *killer);
        let (committed, _) = tokio::join!(tx.commit(), kill);
        committed.ok().map(|()| true)
    }

    async fn age_rows(&self, store: &DieselStore, age: Duration) {
        let mut conn = common::live_conn(store).await;
        diesel::sql_query(
            "UPDATE inbox_messages SET \
             received_at = received_at - make_interval(secs => $1), \
             processed_at = processed_at - make_interval(secs => $1)",
        )
        .bind::<Double, _>(age.as_secs_f64())
        .execute(&mut *conn)
        .await
        .expect("age rows");
    }

    async fn store_now(&self, store: &DieselStore) -> DateTime<Utc> {
        let mut conn = common::live_conn(store).await;
        diesel::select(diesel::dsl::sql::<Timestamptz>("now()"))
            .get_result(&mut *conn)
            .await
            .expect("read the database clock")
    }

    fn blocking_probe(&self) -> Duration {
        // A claim that is not blocked answers in well under a millisecond
        // on localhost; a loaded two-core machine needs the margin.
        Duration::from_millis(300)
    }
}

inbox_conformance::postgres_tests!(harness);

inbox_conformance::outbox_conformance_tests!(
    harness,
    cases = inbox_conformance::postgres::support::OUTBOX_MODEL_CASES
);

#[async_trait]
impl inbox_conformance::OutboxHarness for DieselHarness {
    async fn age_outbox(&self, store: &DieselStore, age: Duration) {
        let mut conn = common::live_conn(store).await;
        diesel::sql_query(inbox_conformance::postgres::support::AGE_OUTBOX)
            .bind::<Double, _>(age.as_secs_f64())
            .execute(&mut *conn)
            .await
            .expect("age the outbox");
    }
}

inbox_conformance::ledger_conformance_tests!(harness);

inbox_conformance::response_conformance_tests!(harness);

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
impl inbox_conformance::LedgerHarness for DieselHarness {
    async fn age_attempts(&self, store: &DieselStore, age: Duration) {
        let mut conn = common::live_conn(store).await;
        diesel::sql_query(inbox_conformance::postgres::support::AGE_ATTEMPTS)
            .bind::<Double, _>(age.as_secs_f64())
            .execute(&mut *conn)
            .await
            .expect("age the attempt ledger");
    }
}

#[derive(diesel::QueryableByName)]
struct Int8 {
    #[diesel(sql_type = BigInt)]
    v: i64,
}

#[derive(diesel::QueryableByName)]
struct PlanLine {
    #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
    line: String,
}

#[async_trait]
impl PgHarness for DieselHarness {
    async fn store_laid_out(&self, schema: &str, pool: usize, layout: Layout) -> DieselStore {
        common::store_with_layout(
            schema,
            pool,
            Duration::from_secs(15),
            &SessionTimeouts::default(),
            layout,
        )
        .await
    }

    async fn store_with(
        &self,
        schema: &str,
        pool: usize,
        timeouts: &SessionTimeouts,
    ) -> DieselStore {
        common::store_with_layout(schema, pool, Duration::from_secs(15), timeouts, self.layout)
            .await
    }

    async fn connect_to(&self, url: &str) -> Result<DieselStore, InboxError> {
        DieselStore::builder(url, "inbox")?
            .connect_timeout(Duration::from_secs(2))
            .connect()
            .await
    }

    async fn migrate(&self, store: &DieselStore) -> Result<Vec<i64>, InboxError> {
        store.migrate().await
    }

    fn schema_of(&self, store: &DieselStore) -> String {
        store.schema().to_string()
    }

    async fn side_execute(&self, store: &DieselStore, sql: &str) -> Result<u64, InboxError> {
        let mut conn = common::admin_in(store.schema()).await;
        let n = diesel::sql_query(sql)
            .execute(&mut conn)
            .await
            .map_err(classify)?;
        Ok(u64::try_from(n).unwrap_or(u64::MAX))
    }

    async fn side_i64(&self, store: &DieselStore, sql: &str) -> Result<i64, InboxError> {
        let mut conn = common::admin_in(store.schema()).await;
        let row: Int8 = diesel::sql_query(format!("SELECT ({sql}) AS v"))
            .get_result(&mut conn)
            .await
            .map_err(classify)?;
        Ok(row.v)
    }

    async fn explain(&self, store: &DieselStore, sql: &str) -> Result<Vec<String>, InboxError> {
        let mut conn = common::admin_in(store.schema()).await;
        let lines: Vec<PlanLine> = diesel::sql_query(format!("EXPLAIN {sql}"))
            .load(&mut conn)
            .await
            .map_err(classify)?;
        Ok(lines.into_iter().map(|l| l.line).collect())
    }

    async fn tx_execute(&self, tx: &mut DieselTransaction, sql: &str) -> Result<(), InboxError> {
        diesel::sql_query(sql)
            .execute(tx.conn())
            .await
            .map_err(classify)?;
        Ok(())
    }

    async fn tx_i64(&self, tx: &mut DieselTransaction, sql: &str) -> Result<i64, InboxError> {
        let row: Int8 = diesel::sql_query(format!("SELECT ({sql}) AS v"))
            .get_result(tx.conn())
            .await
            .map_err(classify)?;
        Ok(row.v)
    }
}
