//! The shared conformance suite every [`inbox_api::InboxStore`] backend runs.
//!
//! Like object_store's `integration.rs`: the tests are plain `pub async fn`s
//! generic over a [`Harness`], and each backend runs all of them from its own
//! crate with one line, [`conformance_tests!`], which expands to one named
//! `#[test]` per contract line plus the proptest crash-point model.
//!
//! Each test returns `Result<(), Failure>` instead of panicking, so the suite
//! can prove its own power: [`broken`] holds deliberately broken stores, and
//! this crate's own tests assert that the suite rejects every one of them.
//!
//! # Use from a backend crate
//! Implement [`Harness`] for the backend in an integration test file and
//! call `inbox_conformance::conformance_tests!(setup)`, where `setup` is an
//! `async fn() -> YourHarness`. `tests/tests/memory.rs` in this crate is the
//! shortest complete example; the Postgres backends do the same in their
//! `tests/conformance.rs`.
//!
//! Postgres backends also implement [`PgHarness`] and call
//! [`postgres_tests!`]: the live PostgreSQL scenarios of [`postgres`].
//!
//! Stores that are also a transactional outbox implement [`OutboxHarness`]
//! and call [`outbox_conformance_tests!`]: the outbox's contract tests and
//! its relay crash-point model ([`outbox`]).
//!
//! Stores that keep an attempt ledger implement [`LedgerHarness`] and call
//! [`ledger_conformance_tests!`]: the ledger's contract tests ([`ledger`]).
//!
//! `PROPTEST_CASES` sets the models' case count (default 1,000 on the memory
//! store, [`postgres::support::MODEL_CASES`] on a Postgres backend).
#![deny(missing_docs)]

pub mod broken;
pub mod contract;
pub mod failing;
mod harness;
pub mod ledger;
pub mod model;
pub mod outbox;
pub mod postgres;
pub mod response;

use std::fmt;

pub use harness::{CrashKind, Harness, TxOf};
pub use ledger::LedgerHarness;
pub use outbox::OutboxHarness;
pub use postgres::PgHarness;

/// A broken promise of the contract, with what was seen.
#[derive(Debug, Clone)]
pub struct Failure {
    /// What went wrong, in words a reader of a CI log understands.
    pub message: String,
}

impl Failure {
    /// A failure with this message.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Failure {}

impl From<inbox_api::InboxError> for Failure {
    fn from(error: inbox_api::InboxError) -> Self {
        let mut message = format!("unexpected store error: {error}");
        let mut source = std::error::Error::source(&error);
        while let Some(s) = source {
            message.push_str(&format!(": {s}"));
            source = s.source();
        }
        Self { message }
    }
}

/// The result of one conformance test.
pub type Outcome = Result<(), Failure>;

/// Fails the enclosing test with a formatted message unless `cond` holds.
#[macro_export]
macro_rules! check {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::Failure::new(format!($($fmt)+)));
        }
    };
}

/// Fails the enclosing test unless the two values are equal.
#[macro_export]
macro_rules! check_eq {
    ($left:expr, $right:expr, $($fmt:tt)+) => {{
        let (left, right) = (&$left, &$right);
        if left != right {
            return Err($crate::Failure::new(format!(
                "{}: expected {:?}, got {:?}", format!($($fmt)+), right, left
            )));
        }
    }};
}

/// A current-thread runtime with timers and I/O, as each generated test uses.
///
/// # Panics
/// When the OS refuses to create the runtime, which no test can survive.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// The model's case count: `PROPTEST_CASES`, else `default`.
pub fn proptest_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[doc(hidden)]
pub mod __private {
    pub use tokio;
}

/// Expands to one `#[test]` per conformance test, each building its harness
/// with `$setup` (an `async fn() -> impl Harness`) on its own runtime, plus
/// `crash_point_model` and `crash_point_model_batched`, the proptest models
/// with `PROPTEST_CASES` cases (default: `cases = N` when given, else
/// 1,000).
#[macro_export]
macro_rules! conformance_tests {
    ($setup:path) => {
        $crate::conformance_tests!($setup, cases = 1000);
    };
    ($setup:path, cases = $cases:expr) => {
        $crate::__with_contract_tests!(conformance $setup);

        #[test]
        fn crash_point_model() {
            let rt = $crate::runtime();
            let harness = rt.block_on($setup());
            let cases = $crate::proptest_cases($cases);
            if let Err(failure) =
                $crate::model::run(&rt, &harness, cases, $crate::model::Mode::PerMessage)
            {
                panic!("{failure}");
            }
        }

        #[test]
        fn crash_point_model_batched() {
            let rt = $crate::runtime();
            let harness = rt.block_on($setup());
            let cases = $crate::proptest_cases($cases);
            if let Err(failure) =
                $crate::model::run(&rt, &harness, cases, $crate::model::Mode::Batched)
            {
                panic!("{failure}");
            }
        }
    };
    (@tests $setup:path; $($name:ident),+ $(,)?) => {
        $crate::__contract_test_fns!(contract; $setup; $($name),+);
    };
}

/// Every suite a PostgreSQL store runs, in one call: the contract and both
/// crash-point models (with [`postgres::support::MODEL_CASES`] cases), the
/// Postgres scenarios, the outbox (its model with
/// [`postgres::support::OUTBOX_MODEL_CASES`] cases), the ledger and the
/// kept responses. For a
/// second instance of a backend's harness (the partitioned inbox layout),
/// called inside a module of its own so the test names do not collide.
#[macro_export]
macro_rules! postgres_store_tests {
    ($setup:path) => {
        $crate::conformance_tests!($setup, cases = $crate::postgres::support::MODEL_CASES);
        $crate::postgres_tests!($setup);
        $crate::outbox_conformance_tests!(
            $setup,
            cases = $crate::postgres::support::OUTBOX_MODEL_CASES
        );
        $crate::ledger_conformance_tests!($setup);
        $crate::response_conformance_tests!($setup);
    };
}

/// The outbox contract tests under one identifier, for
/// [`__contract_test_fns!`].
#[doc(hidden)]
pub use outbox::contract as outbox_contract;

/// One `#[test]` per named test of the suite module `$module`, each
/// building its harness with `$setup` on its own runtime and failing with
/// the test's own message: the runner the inbox, outbox and ledger suites'
/// macros all expand to. (`$module` is one identifier, a limit of
/// `macro_rules!`: the outbox suite names its contract module through
/// [`outbox_contract`].)
#[doc(hidden)]
#[macro_export]
macro_rules! __contract_test_fns {
    ($module:ident; $setup:path; $($name:ident),+ $(,)?) => {
        $(
            #[test]
            fn $name() {
                let rt = $crate::runtime();
                rt.block_on(async {
                    let harness = $setup().await;
                    if let Err(failure) = $crate::$module::$name(&harness).await {
                        panic!("{}", failure);
                    }
                });
            }
        )+
    };
}

/// The one list of contract tests, handed to whoever needs it.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_contract_tests {
    ($($args:tt)*) => {
        $crate::__contract_list! { [$($args)*]
            claim_is_fresh_then_duplicate,
            claim_twice_in_one_transaction_is_duplicate,
            rollback_leaves_no_trace,
            dropped_transaction_leaves_no_trace,
            killed_connection_leaves_no_trace,
            concurrent_claim_waits_then_duplicate_after_commit,
            concurrent_claim_waits_then_fresh_after_rollback,
            concurrent_claim_waits_then_fresh_after_drop,
            concurrent_claim_waits_then_fresh_after_kill,
            distinct_keys_do_not_wait,
            scope_is_per_consumer,
            business_write_commits_with_claim,
            processed_at_is_set_in_the_transaction,
            lookup_does_not_wait,
            purge_deletes_old_processed_rows_in_batches,
            purge_keeps_rows_processed_at_the_cutoff,
            processed_counts_are_per_consumer,
            a_shared_store_forwards_every_call,
            handle_runs_work_once,
            a_copy_with_another_payload_is_a_conflict,
            handle_rolls_back_on_work_error,
            handle_rolls_back_when_cancelled,
            concurrent_first_deliveries_run_work_once,
            claim_batch_answers_each_key_in_order,
            claim_batch_waits_for_pending_keys,
            savepoint_rolls_back_only_later_writes,
            released_savepoint_writes_roll_back_with_the_parent,
            unclaim_gives_the_key_back,
            unclaim_rolls_back_with_its_savepoint,
            a_key_given_back_can_be_claimed_again,
            a_key_given_back_leaves_the_other_claims_alone,
            handle_batch_runs_each_message_once,
            handle_batch_rolls_back_a_failing_message_alone,
            handle_batch_at_once_runs_the_fresh_messages_together,
            handle_batch_at_once_isolates_a_failing_message,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __contract_list {
    ([conformance $setup:path] $($name:ident),+ $(,)?) => {
        $crate::conformance_tests!(@tests $setup; $($name),+);
    };
    ([run $run:ident] $($name:ident),+ $(,)?) => {
        $run!($($name),+);
    };
}
