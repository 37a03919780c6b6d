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
use inbox_api::{
    ConsumerName, InboxError, InboxKey, InboxRecord, InboxTransaction as _, MessageId,
};
use inbox_backend_sqlx::{SqlxStore, SqlxTransaction, classify};
use inbox_conformance::{CrashKind, Harness};
use sqlx::Row as _;

/// The suite's view of the sqlx backend.
struct SqlxHarness;

/// Builds the harness: checks that the database is there (failing loudly if
/// not) and sweeps the test schemas of runs older than an hour.
async fn harness() -> SqlxHarness {
    let admin = common::admin_pool().await;
    common::sweep_old_schemas(&admin, common::TEST_PREFIX).await;
    admin.close().await;
    SqlxHarness
}

inbox_conformance::conformance_tests!(harness);

const EFFECTS_TABLE: &str = "CREATE TABLE conformance_effects (
    message_id uuid NOT NULL,
    consumer   text NOT NULL,
    effect_id  uuid NOT NULL DEFAULT gen_random_uuid()
)";

fn key_of(id: sqlx::types::Uuid, consumer: String) -> InboxKey {
    InboxKey::new(
        MessageId::from_uuid(id),
        ConsumerName::new(consumer).expect("stored consumer names are valid"),
    )
}

#[async_trait]
impl Harness for SqlxHarness {
    type Store = SqlxStore;

    fn name(&self) -> String {
        "sqlx (PostgreSQL)".into()
    }

    async fn fresh_store(&self) -> SqlxStore {
        let store = common::fresh_store(10).await;
        // No unique constraint: the suite counts doubles.
        sqlx::query(EFFECTS_TABLE)
            .execute(store.pool())
            .await
            .expect("create conformance_effects");
        store
    }

    async fn record_effect(
        &self,
        tx: &mut SqlxTransaction,
        key: &InboxKey,
    ) -> Result<(), InboxError> {
        sqlx::query("INSERT INTO conformance_effects (message_id, consumer) VALUES ($1, $2)")
            .bind(key.message_id.as_uuid())
            .bind(key.consumer.as_str())
            .execute(tx.conn())
            .await
            .map_err(classify)?;
        Ok(())
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
        let rows = sqlx::query(
            "SELECT id, consumer_type, received_at, processed_at FROM inbox_messages ORDER BY 1, 2",
        )
        .fetch_all(store.pool())
        .await
        .expect("read inbox rows");
        rows.into_iter()
            .map(|row| InboxRecord {
                key: key_of(row.get("id"), row.get("consumer_type")),
                received_at: row.get("received_at"),
                processed_at: row.get("processed_at"),
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
        let pid = match common::backend_pid(&mut tx).await {
            Ok(pid) => pid,
            // The connection is already gone, and the transaction with it.
            Err(_) => return Some(false),
        };
        if !commit_happens {
            // Killed before COMMIT is sent: the transaction dies with its
            // process, and COMMIT meets a closed connection.
            common::terminate(store.pool(), pid).await;
            return match tx.commit().await {
                Ok(()) => Some(true),
                Err(_) => Some(false),
            };
        }
        // COMMIT and the kill race: the server may commit and die before the
        // answer leaves, which is the lost commit a consumer cannot tell
        // from a failed one. An Ok means it committed; an error means
        // nobody knows, and redelivery has to find out.
        let mut killer = store
            .pool()
            .acquire()
            .await
            .expect("a connection to kill from");
        let kill = async {
            sqlx::query_scalar::<_, bool>("SELECT pg_terminate_backend($1, 5000)")
                .bind(pid)
                .fetch_one(&mut *killer)
                .await
        };
        let (committed, _) = tokio::join!(tx.commit(), kill);
        committed.ok().map(|()| true)
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
