//! What the suite needs to know about a backend, and nothing more.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use inbox_api::{BatchTransaction, InboxError, InboxKey, InboxRecord, InboxStats, InboxStore};
use inbox_postgres::Layout;

/// The transaction type of a harness's store.
pub type TxOf<H> = <<H as Harness>::Store as InboxStore>::Transaction;

/// How a transaction dies without committing, as the suite injects it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CrashKind {
    /// The transaction value is dropped (a panic, a cancelled future).
    Drop,
    /// The connection under the transaction is killed from outside
    /// (`pg_terminate_backend` on Postgres). Backends without connections
    /// treat it as [`CrashKind::Drop`].
    KillConnection,
}

/// A backend under test: how to make an isolated store, how to do one
/// business write inside a transaction, how to read the committed state
/// back, and how to crash a transaction.
///
/// Implement it once per backend and call [`crate::conformance_tests!`]
/// with it; every backend then runs every test of the suite.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// The store under test. Cloning must share state (a pool, an `Arc`).
    /// The suite covers batched mode too, so the store's transactions must
    /// offer the batch capability.
    type Store: InboxStore<Transaction: BatchTransaction> + InboxStats + Clone;

    /// A short name for failure messages.
    fn name(&self) -> String;

    /// A fresh, empty, isolated store (its own schema, database or
    /// instance), migrated and ready, with an effects table of its own.
    /// Runs must never see each other.
    async fn fresh_store(&self) -> Self::Store;

    /// One business write in `tx`: append one effect row for `key`.
    ///
    /// The effect store must *not* deduplicate (no unique constraint): the
    /// suite counts effects per key to see doubles.
    async fn record_effect(&self, tx: &mut TxOf<Self>, key: &InboxKey) -> Result<(), InboxError>;

    /// Committed effects per key, read from a fresh connection (a dropped
    /// sqlx transaction only queues its rollback on its own connection).
    async fn effects(&self, store: &Self::Store) -> BTreeMap<InboxKey, u64>;

    /// Every committed inbox row, read from a fresh connection.
    async fn inbox_rows(&self, store: &Self::Store) -> Vec<InboxRecord>;

    /// Ends `tx` without committing, the way `kind` says.
    ///
    /// The default drops it, which every backend must survive. Backends with
    /// connections override it to kill the connection from outside for
    /// [`CrashKind::KillConnection`].
    async fn crash(&self, store: &Self::Store, tx: TxOf<Self>, kind: CrashKind) {
        let _ = (store, kind);
        drop(tx);
    }

    /// Commits `tx`, but the answer is lost: the connection dies around
    /// COMMIT. Returns whether the commit took effect *if the harness knows*
    /// (`None` when it does not: the suite then finds out by redelivery).
    ///
    /// The default uses `commit_happens` to pick the outcome: commit and
    /// report a lost connection, or drop the transaction. Backends with
    /// connections override it to kill the connection while COMMIT is in
    /// flight.
    async fn commit_lost(
        &self,
        store: &Self::Store,
        tx: TxOf<Self>,
        commit_happens: bool,
    ) -> Option<bool> {
        let _ = store;
        if commit_happens {
            let committed = inbox_api::InboxTransaction::commit(tx).await.is_ok();
            Some(committed)
        } else {
            drop(tx);
            Some(false)
        }
    }

    /// Makes every committed row `age` older (advance the store's clock, or
    /// move the timestamps back), so cleanup can be tested without waiting.
    async fn age_rows(&self, store: &Self::Store, age: Duration);

    /// The store's idea of now, against which rows are timestamped (a
    /// manual clock in the memory backend; the database clock otherwise).
    async fn store_now(&self, store: &Self::Store) -> chrono::DateTime<chrono::Utc> {
        let _ = store;
        chrono::Utc::now()
    }

    /// How the harness's stores lay their inbox out. Tests whose
    /// expectation depends on it (what cleanup removes: rows by
    /// `processed_at`, or whole days of time-ordered ids) ask this instead
    /// of being skipped. [`Layout::Table`] unless the harness runs
    /// PostgreSQL's partitioned layout; the memory store keeps the table's
    /// rules.
    fn layout(&self) -> Layout {
        Layout::Table
    }

    /// How long the suite waits to decide that a claim is blocked (it must
    /// still be pending after this long). Longer for stores over a network.
    fn blocking_probe(&self) -> Duration {
        Duration::from_millis(100)
    }
}
