//! The names of every metric the inbox and its app record, in one place.
//!
//! Recorded through the [`metrics`] facade, so any exporter (Prometheus,
//! StatsD, …) the application installs receives them; with none installed
//! they cost a no-op call. Call [`describe`] once after installing an
//! exporter to attach help texts and units.
//!
//! | name | type | labels | recorded by |
//! |---|---|---|---|
//! | `inbox_processed_total` | counter | `consumer` | [`crate::Inbox::handle`], after commit |
//! | `inbox_duplicates_discarded_total` | counter | `consumer` | [`crate::Inbox::handle`], on `Duplicate` |
//! | `inbox_failed_total` | counter | `consumer`, `stage` (`begin`, `claim`, `work`, `commit`), `retryable` (`true`, `false`, `unknown` for the work's own errors) | [`crate::Inbox::handle`] |
//! | `inbox_handle_duration_seconds` | histogram | `consumer`, `outcome` (`processed`, `duplicate`, `failed`) | [`crate::Inbox::handle`] |
//! | `inbox_batch_reruns_total` | counter | none | [`crate::Inbox::handle_batch`], when a work failure makes it rerun a batch with savepoints |
//! | `inbox_purged_rows_total` | counter | none | [`crate::InboxStoreExt::purge_processed_before`], once per batch |
//! | `inbox_dead_lettered_total` | counter | `consumer`, `reason` | the consuming application |
//! | `inbox_rows` | gauge | none | the consuming application (periodic count) |

/// Messages whose work committed.
pub const PROCESSED: &str = "inbox_processed_total";
/// Deliveries recognised as duplicates and dropped without running the work.
pub const DUPLICATES_DISCARDED: &str = "inbox_duplicates_discarded_total";
/// Deliveries whose handling failed and rolled back.
pub const FAILED: &str = "inbox_failed_total";
/// Wall time of one [`crate::Inbox::handle`] call, begin to commit.
pub const HANDLE_DURATION: &str = "inbox_handle_duration_seconds";
/// Batches rerun with a savepoint per message after a work failure in the
/// optimistic attempt ([`crate::Inbox::handle_batch`]).
pub const BATCH_RERUNS: &str = "inbox_batch_reruns_total";
/// Rows deleted by cleanup.
pub const PURGED_ROWS: &str = "inbox_purged_rows_total";
/// Deliveries sent to a dead-letter queue (recorded by the application).
pub const DEAD_LETTERED: &str = "inbox_dead_lettered_total";
/// Rows in the inbox table (a gauge the application refreshes).
pub const ROWS: &str = "inbox_rows";

/// Registers help texts and units for every name above.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(PROCESSED, "Messages whose work committed, per consumer");
    describe_counter!(
        DUPLICATES_DISCARDED,
        "Duplicate deliveries acknowledged without running the work, per consumer"
    );
    describe_counter!(
        FAILED,
        "Deliveries whose handling failed and rolled back, per consumer and stage"
    );
    describe_histogram!(
        HANDLE_DURATION,
        Unit::Seconds,
        "Time from begin to commit of one delivery"
    );
    describe_counter!(
        BATCH_RERUNS,
        "Batches rerun with savepoints after a message's work failed"
    );
    describe_counter!(PURGED_ROWS, "Processed inbox rows deleted by cleanup");
    describe_counter!(
        DEAD_LETTERED,
        "Deliveries rejected into a dead-letter queue, per consumer and reason"
    );
    describe_gauge!(ROWS, "Rows in the inbox table");
}
