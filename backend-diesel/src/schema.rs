//! diesel's view of the tables in the workspace's `migrations/`.
//!
//! Written by hand to match `migrations/*.sql` (the SQL is the source of
//! truth); the test `schema_rs_matches_the_migrated_table` compares it with
//! the catalog of a freshly migrated schema, so a migration that changes the
//! table without this file fails the build's tests.
//!
//! No schema qualifier on purpose: the store chooses the schema through
//! `search_path`, as the migrations do.
#![allow(missing_docs)]

diesel::table! {
    /// One row per `(message, consumer)` whose claim committed.
    inbox_messages (id, consumer_type) {
        /// The producer's message id.
        id -> Uuid,
        /// The consumer whose scope the claim belongs to.
        #[max_length = 500]
        consumer_type -> Varchar,
        /// When the claim was made (transaction start, store clock).
        received_at -> Timestamptz,
        /// Set by the claim itself; the row becomes visible at COMMIT.
        processed_at -> Nullable<Timestamptz>,
        /// SHA-256 of the payload the claim was made for, if given.
        payload_fingerprint -> Nullable<Bytea>,
        /// The response an idempotent endpoint kept with its claim, if any.
        response -> Nullable<Bytea>,
    }
}
