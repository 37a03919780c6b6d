//! The live PostgreSQL behaviour every Postgres backend must show, whatever
//! its driver: real deadlocks, lock timeouts and serialization failures are
//! retryable conflicts, a killed backend is a retryable connection error and
//! leaves nothing behind, a missing table is a permanent schema error, the
//! purge goes through the partial index and cleaners share the work, the
//! pool is clean after crashes, and migrations are shared, idempotent and
//! safe to run at once. The outbox's lease statements skip rows other
//! connections lock, run out on the database clock, and walk their partial
//! indexes; so do the attempt ledger's dead listing and purge.
//!
//! Shaped like the contract suite: plain `pub async fn`s generic over a
//! [`PgHarness`], each returning an [`crate::Outcome`], and one macro,
//! [`crate::postgres_tests!`], that a backend calls with its setup to get
//! one named `#[test]` per scenario. [`support`] holds what the drivers'
//! test scaffolding shares (database URL, schema names, the sweep rule).

mod ledger;
mod outbox;
mod partitioned;
mod scenarios;
pub mod support;
#[cfg(feature = "tls")]
pub mod tls;

use async_trait::async_trait;
use inbox_api::InboxError;
use inbox_postgres::{Layout, SessionTimeouts};

pub use ledger::*;
pub use outbox::*;
pub use partitioned::*;
pub use scenarios::*;

use crate::{Harness, TxOf};

/// What the Postgres suite needs beyond [`Harness`]: stores in a chosen
/// schema, the backend's migration, and raw SQL on a side connection and
/// inside a transaction.
#[async_trait]
pub trait PgHarness: Harness {
    /// A store whose connections use `schema` (and carry it as
    /// `application_name`), with at most `pool` connections, the default
    /// [`SessionTimeouts`] and the harness's layout ([`Harness::layout`]);
    /// not migrated.
    async fn store_in(&self, schema: &str, pool: usize) -> Self::Store {
        self.store_with(schema, pool, &SessionTimeouts::default())
            .await
    }

    /// As [`PgHarness::store_in`], its sessions under `timeouts`.
    async fn store_with(
        &self,
        schema: &str,
        pool: usize,
        timeouts: &SessionTimeouts,
    ) -> Self::Store;

    /// As [`PgHarness::store_in`], for the inbox layout `layout` whatever
    /// the harness's; not migrated.
    async fn store_laid_out(&self, schema: &str, pool: usize, layout: Layout) -> Self::Store;

    /// A store on the server at `url` (schema `inbox`), connecting now.
    async fn connect_to(&self, url: &str) -> Result<Self::Store, InboxError>;

    /// The backend's migration of `store`'s schema: the versions applied.
    async fn migrate(&self, store: &Self::Store) -> Result<Vec<i64>, InboxError>;

    /// The schema `store` keeps its tables in.
    fn schema_of(&self, store: &Self::Store) -> String;

    /// Runs `sql` on a connection of its own (not from the store's pool)
    /// whose `search_path` is `store`'s schema; returns the rows affected.
    async fn side_execute(&self, store: &Self::Store, sql: &str) -> Result<u64, InboxError>;

    /// Runs a query of one row and one `int8` column on a side connection.
    async fn side_i64(&self, store: &Self::Store, sql: &str) -> Result<i64, InboxError>;

    /// The plan of `sql` (`EXPLAIN`, one line per row) on a side
    /// connection.
    async fn explain(&self, store: &Self::Store, sql: &str) -> Result<Vec<String>, InboxError>;

    /// Runs `sql` inside `tx`, through the driver, its errors classified as
    /// the backend classifies the consumer's own statements.
    async fn tx_execute(&self, tx: &mut TxOf<Self>, sql: &str) -> Result<(), InboxError>;

    /// Runs a query of one row and one `int8` column inside `tx`.
    async fn tx_i64(&self, tx: &mut TxOf<Self>, sql: &str) -> Result<i64, InboxError>;
}

/// Expands to one `#[test]` per Postgres scenario, each building its
/// harness with `$setup` (an `async fn() -> impl PgHarness +
/// OutboxHarness`) on its own multi-threaded runtime.
#[macro_export]
macro_rules! postgres_tests {
    ($setup:path) => {
        $crate::__with_postgres_tests!(@tests $setup);
    };
    (@tests $setup:path; $($name:ident),+ $(,)?) => {
        $(
            #[test]
            fn $name() {
                let rt = $crate::__private::tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("tokio runtime");
                rt.block_on(async {
                    let harness = $setup().await;
                    if let Err(failure) = $crate::postgres::$name(&harness).await {
                        panic!("{}", failure);
                    }
                });
            }
        )+
    };
}

/// The one list of Postgres scenarios.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_postgres_tests {
    (@tests $setup:path) => {
        $crate::postgres_tests! { @tests $setup;
            concurrent_claims_of_one_key_give_exactly_one_fresh,
            a_blocked_claim_is_duplicate_after_commit_and_fresh_after_rollback,
            a_terminated_backend_is_a_retryable_connection_error,
            a_killed_backend_at_each_crash_point_is_processed_once,
            a_deadlock_is_a_retryable_conflict,
            a_claim_of_a_held_key_gives_up_after_the_lock_timeout,
            a_holder_idle_in_its_transaction_is_ended_and_its_key_claimed_again,
            a_transaction_dropped_mid_statement_stops_the_statement,
            a_serialization_failure_is_a_retryable_conflict,
            a_missing_table_is_a_permanent_schema_error,
            an_unreachable_server_is_a_retryable_connection_error,
            the_pool_is_clean_after_crashes,
            purge_uses_the_partial_index_and_deletes_exactly_the_expired_rows,
            concurrent_cleaners_skip_each_others_rows,
            purge_on_an_empty_table_deletes_nothing,
            overlapping_batches_in_opposite_orders_do_not_deadlock,
            nested_savepoints_with_deferred_release_keep_sql_semantics,
            concurrent_migrations_of_one_schema_succeed,
            an_edited_migration_is_refused,
            a_cancelled_migration_does_not_block_other_instances,
            outbox_relays_on_two_connections_skip_locked_rows,
            outbox_parallel_relays_take_each_message_once,
            outbox_a_dead_relays_lease_runs_out_on_the_database_clock,
            outbox_purge_uses_its_partial_index,
            outbox_a_take_rewrites_rows_in_place,
            outbox_a_take_reads_its_batch_not_the_backlog,
            ledger_dead_list_and_purge_use_their_indexes,
            partitioned_v4_ids_go_to_the_untimed_partition,
            partitioned_an_expired_id_is_refused_after_its_day_is_dropped,
            partitioned_a_future_id_waits_for_its_day,
            partitioned_cleanup_drops_a_day_while_claims_run,
            partitioned_a_large_dropped_day_reports_its_estimated_rows,
            partitioned_a_schema_keeps_its_layout,
            partitioned_a_batch_charges_only_its_expired_and_future_ids,
        }
    };
}
