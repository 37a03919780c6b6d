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
//! | `inbox_conflicting_duplicates_total` | counter | `consumer` | [`crate::Inbox::handle`], on `Conflict`: a processed id with another payload |
//! | `inbox_failed_total` | counter | `consumer`, `stage` (`begin`, `claim`, `work`, `commit`, `lookup` of a repeat's fingerprint), `retryable` (`true`, `false`, `unknown` for the work's own errors) | [`crate::Inbox::handle`] |
//! | `inbox_handle_duration_seconds` | histogram | `consumer`, `outcome` (`processed`, `duplicate`, `conflict`, `failed`) | [`crate::Inbox::handle`] |
//! | `inbox_batch_reruns_total` | counter | none | [`crate::Inbox::handle_batch`], when a work failure makes it rerun a batch with savepoints |
//! | `inbox_purged_rows_total` | counter | none | [`crate::InboxStoreExt::purge_processed_before`], once per batch |
//! | `inbox_attempts_purged_rows_total` | counter | none | [`crate::AttemptLedgerExt::purge_attempts_before`], once per batch |
//! | `inbox_dead_lettered_total` | counter | `consumer`, `reason` | the consuming application |
//! | `inbox_rows` | gauge | none | the consuming application (periodic count) |
//! | `inbox_store_available` | gauge | none | the consuming application: 1 while it consumes, 0 while a store outage pauses it |
//! | `inbox_store_outages_total` | counter | none | the consuming application, when a store outage pauses it |
//! | `outbox_purged_rows_total` | counter | none | [`crate::OutboxStoreExt::purge_published_before`], once per batch |
//! | `outbox_pending_messages` | gauge | none | [`crate::OutboxStoreExt::record_pending`] |
//! | `outbox_dead_messages` | gauge | none | [`crate::OutboxStoreExt::record_dead`] |
//! | `outbox_published_total` | counter | none | the relay, per message the broker confirmed |
//! | `outbox_publish_failures_total` | counter | `reason` (`nack`, `returned`, `channel`, `timeout`) | the relay, per message the broker did not confirm |
//! | `outbox_publish_duration_seconds` | histogram | none | the relay, publish to confirm of one message |

/// Messages whose work committed.
pub const PROCESSED: &str = "inbox_processed_total";
/// Deliveries recognised as duplicates and dropped without running the work.
pub const DUPLICATES_DISCARDED: &str = "inbox_duplicates_discarded_total";
/// Deliveries of a processed key whose payload fingerprint differs from
/// the stored one: a producer reused an id for another message.
pub const CONFLICTING_DUPLICATES: &str = "inbox_conflicting_duplicates_total";
/// Deliveries whose handling failed and rolled back.
pub const FAILED: &str = "inbox_failed_total";
/// Wall time of one [`crate::Inbox::handle`] call, begin to commit.
pub const HANDLE_DURATION: &str = "inbox_handle_duration_seconds";
/// Batches rolled back and run again: after a message's work failed in the
/// optimistic attempt ([`crate::Inbox::handle_batch`]), after the whole
/// batch's work failed ([`crate::Inbox::handle_batch_at_once`]), or after
/// the batch's claim refused a key and its keys are claimed one by one.
pub const BATCH_RERUNS: &str = "inbox_batch_reruns_total";
/// Rows deleted by cleanup.
pub const PURGED_ROWS: &str = "inbox_purged_rows_total";
/// Attempt-ledger rows deleted by cleanup.
pub const ATTEMPTS_PURGED_ROWS: &str = "inbox_attempts_purged_rows_total";
/// Deliveries sent to a dead-letter queue (recorded by the application).
pub const DEAD_LETTERED: &str = "inbox_dead_lettered_total";
/// Rows in the inbox table (a gauge the application refreshes).
pub const ROWS: &str = "inbox_rows";
/// 1 while the store answers and the application consumes, 0 while an
/// outage (unreachable, schema unusable) pauses consumption.
pub const STORE_AVAILABLE: &str = "inbox_store_available";
/// Store outages that paused consumption.
pub const STORE_OUTAGES: &str = "inbox_store_outages_total";

/// Published outbox rows deleted by cleanup.
pub const OUTBOX_PURGED_ROWS: &str = "outbox_purged_rows_total";
/// Committed outgoing messages not yet published (a gauge): a relay that
/// falls behind, or a broker that refuses, shows as a rising line.
pub const OUTBOX_PENDING: &str = "outbox_pending_messages";
/// Outgoing messages dead in the outbox now (a gauge): refused too often,
/// kept, never published until an operator requeues them.
pub const OUTBOX_DEAD: &str = "outbox_dead_messages";
/// Outgoing messages the broker confirmed (each then marked published).
pub const OUTBOX_PUBLISHED: &str = "outbox_published_total";
/// Publishes the broker did not confirm: the message stays pending and is
/// published again, under its id, once its lease runs out.
pub const OUTBOX_PUBLISH_FAILURES: &str = "outbox_publish_failures_total";
/// Outgoing messages dead-lettered in the outbox after the broker refused
/// them [`crate::PublishRetry::max_attempts`] times: kept, never published
/// until requeued.
pub const OUTBOX_DEAD_LETTERED: &str = "outbox_dead_lettered_total";
/// Time from handing one outgoing message to the broker to its confirm.
pub const OUTBOX_PUBLISH_DURATION: &str = "outbox_publish_duration_seconds";

/// Registers help texts and units for every name above.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(PROCESSED, "Messages whose work committed, per consumer");
    describe_counter!(
        DUPLICATES_DISCARDED,
        "Duplicate deliveries acknowledged without running the work, per consumer"
    );
    describe_counter!(
        CONFLICTING_DUPLICATES,
        "Deliveries of a processed message id with another payload fingerprint, per consumer"
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
        "Batches rolled back and rerun: a message's or the whole batch's work failed, or the claim refused a key"
    );
    describe_counter!(PURGED_ROWS, "Processed inbox rows deleted by cleanup");
    describe_counter!(
        ATTEMPTS_PURGED_ROWS,
        "Attempt-ledger rows (failed deliveries) deleted by cleanup"
    );
    describe_counter!(
        DEAD_LETTERED,
        "Deliveries rejected into a dead-letter queue, per consumer and reason"
    );
    describe_gauge!(ROWS, "Rows in the inbox table");
    describe_gauge!(
        STORE_AVAILABLE,
        "1 while the store answers and messages are consumed, 0 while an outage pauses consumption"
    );
    describe_counter!(STORE_OUTAGES, "Store outages that paused consumption");
    describe_counter!(
        OUTBOX_PURGED_ROWS,
        "Published outbox rows deleted by cleanup"
    );
    describe_gauge!(
        OUTBOX_PENDING,
        "Committed outgoing messages not yet published"
    );
    describe_gauge!(
        OUTBOX_DEAD,
        "Outgoing messages dead in the outbox (refused too often), waiting for a requeue"
    );
    describe_counter!(
        OUTBOX_PUBLISHED,
        "Outgoing messages published and confirmed by the broker"
    );
    describe_counter!(
        OUTBOX_PUBLISH_FAILURES,
        "Outgoing messages the broker did not confirm, per reason"
    );
    describe_counter!(
        OUTBOX_DEAD_LETTERED,
        "Outgoing messages dead in the outbox after the broker refused them too often"
    );
    describe_histogram!(
        OUTBOX_PUBLISH_DURATION,
        Unit::Seconds,
        "Time from publishing one outgoing message to its confirm"
    );
}

#[cfg(test)]
mod tests {
    use metrics_util::debugging::DebuggingRecorder;

    use super::*;

    /// Every name gets a help text (and the duration its unit) from
    /// [`describe`]: an exporter shows them beside the series.
    #[test]
    fn describe_gives_every_metric_a_help_text() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            describe();
            for name in [
                PROCESSED,
                DUPLICATES_DISCARDED,
                CONFLICTING_DUPLICATES,
                FAILED,
                BATCH_RERUNS,
                PURGED_ROWS,
                ATTEMPTS_PURGED_ROWS,
                DEAD_LETTERED,
                OUTBOX_PURGED_ROWS,
                OUTBOX_PUBLISHED,
                OUTBOX_PUBLISH_FAILURES,
                OUTBOX_DEAD_LETTERED,
                STORE_OUTAGES,
            ] {
                metrics::counter!(name).increment(1);
            }
            metrics::histogram!(HANDLE_DURATION).record(0.1);
            metrics::histogram!(OUTBOX_PUBLISH_DURATION).record(0.1);
            metrics::gauge!(ROWS).set(1.0);
            metrics::gauge!(STORE_AVAILABLE).set(1.0);
            metrics::gauge!(OUTBOX_PENDING).set(1.0);
            metrics::gauge!(OUTBOX_DEAD).set(1.0);
        });
        let described: Vec<(String, Option<metrics::Unit>, String)> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, unit, help, _)| {
                let help = help.map(|h| h.to_string()).unwrap_or_default();
                (key.key().name().to_owned(), unit, help)
            })
            .collect();
        assert_eq!(described.len(), 19, "{described:?}");
        for (name, unit, help) in &described {
            assert!(help.len() > 10, "{name} has no help text: {help:?}");
            let expected = [HANDLE_DURATION, OUTBOX_PUBLISH_DURATION]
                .contains(&name.as_str())
                .then_some(metrics::Unit::Seconds);
            assert_eq!(*unit, expected, "{name}");
        }
    }
}
