//! The transactional outbox's conformance suite: the same shape as the
//! inbox's, for every backend whose store is an
//! [`inbox_api::OutboxStore`].
//!
//! - [`contract`]: deterministic tests, one or more per line of the
//!   contract documented on `OutboxStore`: an enqueue commits with the
//!   business writes or not at all, a dropped or killed transaction
//!   enqueues nothing, an enqueue of an id waits for an open enqueue of it,
//!   relays never both hold one message, leases expire,
//!   marks are final, cleanup is bounded and spares pending rows, a
//!   refused message backs off and ends dead, charged by its holder only.
//! - [`model`]: a proptest crash-point model of producer, relay, broker and
//!   consumers (the consumers behind the real inbox of the same store).
//!
//! A backend implements [`OutboxHarness`] beside its [`crate::Harness`] and
//! calls [`crate::outbox_conformance_tests!`] with one line.

pub mod contract;
pub mod model;

use std::time::Duration;

use async_trait::async_trait;
use inbox_api::OutboxStore;

use crate::Harness;

/// What the outbox suite needs beyond [`Harness`]: a store that is an
/// outbox, and a way to let time pass for it.
#[async_trait]
pub trait OutboxHarness: Harness<Store: OutboxStore> {
    /// Makes every outgoing row `age` older: its `created_at`,
    /// `published_at` and lease deadline move back (or the store's clock
    /// moves forward), so that leases expire and cleanup can be tested
    /// without waiting.
    async fn age_outbox(&self, store: &Self::Store, age: Duration);
}

/// Expands to one `#[test]` per outbox contract test, each building its
/// harness with `$setup` (an `async fn() -> impl OutboxHarness`) on its own
/// runtime, plus `outbox_crash_point_model`, the relay model with
/// `PROPTEST_CASES` cases (default `$cases`, 1,000 when not given: the
/// Postgres backends pass fewer, since each case runs real transactions).
#[macro_export]
macro_rules! outbox_conformance_tests {
    ($setup:path) => {
        $crate::outbox_conformance_tests!($setup, cases = 1000);
    };
    ($setup:path, cases = $cases:expr) => {
        $crate::__with_outbox_contract_tests!(@tests $setup);

        #[test]
        fn outbox_crash_point_model() {
            let rt = $crate::runtime();
            let harness = rt.block_on($setup());
            let cases = $crate::proptest_cases($cases);
            if let Err(failure) = $crate::outbox::model::run(&rt, &harness, cases) {
                panic!("{failure}");
            }
        }
    };
    (@tests $setup:path; $($name:ident),+ $(,)?) => {
        $crate::__contract_test_fns!(outbox_contract; $setup; $($name),+);
    };
}

/// The one list of outbox contract tests.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_outbox_contract_tests {
    (@tests $setup:path) => {
        $crate::__with_outbox_contract_tests! { [tests $setup] }
    };
    ([$($args:tt)*]) => {
        $crate::__outbox_contract_list! { [$($args)*]
            outbox_enqueue_is_visible_only_after_commit,
            outbox_rollback_enqueues_nothing,
            outbox_dropped_transaction_enqueues_nothing,
            outbox_killed_connection_enqueues_nothing,
            outbox_enqueue_of_one_id_is_idempotent,
            outbox_an_enqueue_waits_then_already_enqueued_after_commit,
            outbox_an_enqueue_waits_then_enqueues_after_drop,
            outbox_an_enqueue_waits_then_enqueues_after_kill,
            outbox_crossed_enqueues_are_a_retryable_conflict,
            outbox_a_stored_message_round_trips,
            outbox_take_is_oldest_first_and_bounded,
            outbox_a_live_lease_is_not_taken_again,
            outbox_an_expired_lease_is_taken_again,
            outbox_concurrent_relays_never_hold_one_message,
            outbox_mark_published_is_final_and_repeatable,
            outbox_a_late_mark_still_publishes,
            outbox_release_gives_messages_back_at_once,
            outbox_release_leaves_a_newer_lease_alone,
            outbox_purge_deletes_published_rows_in_batches_never_pending,
            outbox_purge_keeps_rows_published_at_the_cutoff,
            outbox_a_shared_store_forwards_every_call,
            outbox_enqueue_in_the_handler_shares_its_fate,
            outbox_a_refused_message_waits_out_its_backoff,
            outbox_a_message_refused_too_often_is_dead_until_requeued,
            outbox_refusals_charge_only_the_holding_lease,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __outbox_contract_list {
    ([tests $setup:path] $($name:ident),+ $(,)?) => {
        $crate::outbox_conformance_tests!(@tests $setup; $($name),+);
    };
    ([run $run:ident] $($name:ident),+ $(,)?) => {
        $run!($($name),+);
    };
}
