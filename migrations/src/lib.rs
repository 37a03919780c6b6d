#![doc = include_str!("../README.md")]
//!
//! # The crate
//!
//! The PostgreSQL layer of the Inbox pattern that every driver shares.
//!
//! The sqlx and diesel backends differ only in how they send a statement
//! and how they learn a failed statement's SQLSTATE. Everything else about
//! PostgreSQL lives here, once:
//!
//! - [`MIGRATIONS`]: the schema, embedded from this crate's `*.sql` files,
//!   and [`migrate()`], the runner both drivers use, with one ledger
//!   ([`LEDGER_TABLE`]), checksums and an advisory lock. A schema migrated
//!   through one driver is migrated for the other.
//! - [`sql`]: every statement the inbox and its outbox send, and the
//!   outbox table (`outbox_messages`) among the migrations;
//!   [`Statements`]: the same statements with a store's schema qualified
//!   ([`qualify`]), so that no driver depends on `search_path`.
//! - [`AttemptColumns`] and [`attempt_record`]: the attempt ledger's rows
//!   (`inbox_attempts`), decoded once for both drivers.
//! - [`OutboxRow`] and its helpers: the outbox's parameters and rows,
//!   decoded once for both drivers.
//! - [`Layout`]: the plain inbox table or the opt-in partitioned one
//!   (v7 ids by day, dropped whole after the retention), its claim
//!   statements and its partition upkeep ([`create_partitions`],
//!   [`drop_expired_partitions`]).
//! - [`ErrorClass`]: the SQLSTATE table deciding retry or dead-letter.
//! - [`SchemaName`]: the one validation of a schema name.
//! - [`SessionTimeouts`]: the time bounds every inbox session sets
//!   (`lock_timeout`, `idle_in_transaction_session_timeout`,
//!   `client_connection_check_interval`), so that a frozen holder cannot
//!   block a key for longer than they allow.
//! - [`Claims`]: which keys a transaction holds, and the savepoint
//!   statements of batched mode, as a state machine.
//!
//! It depends on no driver.
//!
//! ```
//! use inbox_postgres::{ErrorClass, SchemaName, sql};
//!
//! let schema = SchemaName::new("parcels")?;
//! assert_eq!(schema.quoted(), "\"parcels\"");
//! assert!(sql::CLAIM.starts_with("INSERT INTO inbox_messages"));
//! assert_eq!(ErrorClass::of_sqlstate("40P01"), ErrorClass::Conflict);
//! # Ok::<(), inbox_api::InboxError>(())
//! ```
#![deny(missing_docs)]

mod attempts;
mod claims;
mod layout;
mod migrate;
mod outbox;
mod schema_name;
mod session;
pub mod sql;
mod sqlstate;
mod statements;

pub use attempts::{AttemptColumns, attempt_count, attempt_record};
pub use claims::{
    Claims, KeyColumns, SavepointDriver, fingerprint_column, key_columns, rollback_to_savepoint,
    savepoint, stored_fingerprint,
};
pub use layout::{
    DAYS_AHEAD, Layout, NO_PARTITION, PARTITIONED_DDL, Partition, create_partitions, day_expired,
    drop_expired_partitions, id_day, partition_day, partitions, require_session_schema,
    time_ordered,
};
pub use migrate::{
    ADVISORY_LOCK_KEY, LEDGER_TABLE, MIGRATIONS, Migration, MigrationConnection, migrate,
    migrate_with_layout, pending,
};
pub use outbox::{
    OutboxColumns, OutboxRow, enqueued, header_columns, id_column, lease_from_rows, lease_millis,
    records, refusal_columns, refused, retry_columns,
};
pub use schema_name::SchemaName;
pub use session::{Pooling, SessionTimeouts};
pub use sqlstate::{ErrorClass, classify_sqlstate, connect_failed, is_login_refused};
pub use statements::{Statements, qualify};

// The error type the exported `savepoint_methods!` names, so that a driver
// calling the macro needs no import for it.
#[doc(hidden)]
pub use inbox_api::InboxError;
