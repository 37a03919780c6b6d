#![doc = include_str!("../README.md")]
//!
//! # The crate
//!
//! The Inbox pattern on PostgreSQL through [diesel-async] and a [deadpool]
//! pool: exactly-once *effects* for at-least-once consumers.
//!
//! [`DieselStore`] implements [`inbox_api::InboxStore`]. Its transaction,
//! [`DieselTransaction`], holds one pooled [`AsyncPgConnection`] with an open
//! transaction whose first write is the claim (`INSERT … ON CONFLICT DO
//! NOTHING` into `inbox_messages`); the consumer's business writes go
//! through [`DieselTransaction::conn`] on that same connection, so they
//! commit together with the claim or not at all.
//!
//! - The schema, the statements, the SQLSTATE table and the savepoint
//!   bookkeeping are `inbox-postgres`'s, shared with the sqlx backend: this
//!   crate sends the statements and recovers SQLSTATEs from diesel's errors.
//!   [`DieselStore::migrate`] applies the schema; [`schema`] is diesel's
//!   view of it. Each store lives in one PostgreSQL schema, chosen by
//!   `search_path` ([`SchemaName`]).
//! - A transaction dropped without commit closes its connection instead of
//!   returning it to the pool (see [`DieselTransaction`] for why).
//! - Every connection sets [`SessionTimeouts`] when it opens
//!   ([`DieselStoreBuilder::session_timeouts`]): a claim of a key a frozen
//!   holder keeps gives up after `lock_timeout`
//!   ([`inbox_api::InboxError::LockTimeout`]), and the server ends a
//!   session idle inside a transaction, releasing its claims.
//! - Batched mode ([`inbox_api::Inbox::handle_batch`]): one `INSERT … SELECT
//!   unnest(…)` claims the batch in key order, each message's work runs in a
//!   savepoint of its own, a failed message's claim is deleted again.
//! - The hot statements are prepared once per connection (diesel re-prepares
//!   its UPDATEs, hand-built `INSERT … SELECT`s and `sql_query`s on every
//!   call, so the batch claim is written as a fixed query fragment); prefer diesel's DSL over `sql_query` for the
//!   consumer's own hot writes for the same reason.
//! - The transactional outbox: [`DieselTransaction`] implements
//!   [`inbox_api::OutboxTransaction`] (an outgoing message is one more row
//!   of the business transaction) and [`DieselStore`] implements
//!   [`inbox_api::OutboxStore`] for the relay, with `inbox-postgres`'s
//!   statements: leases taken with `FOR UPDATE SKIP LOCKED`, expiring on
//!   their own.
//! - The attempt ledger: [`DieselStore`] implements
//!   [`inbox_api::AttemptLedger`], each failure one upsert on a pooled
//!   connection outside any transaction (the consumer's has rolled back).
//! - [`classify`] turns diesel errors into [`inbox_api::InboxError`]s that
//!   say retry or dead-letter, by the SQLSTATE table both backends share.
//!
//! # Example
//!
//! ```no_run
//! use diesel::prelude::*;
//! use diesel_async::RunQueryDsl;
//! use inbox_api::{ConsumerName, Handled, Inbox, InboxError, InboxKey, MessageId};
//! use inbox_backend_diesel::{DieselStore, classify};
//!
//! diesel::table! {
//!     // A business table of the consumer, in the same schema.
//!     parcel_events (id) {
//!         id -> Int8,
//!         parcel -> Text,
//!         message_id -> Uuid,
//!     }
//! }
//!
//! # async fn run() -> Result<(), InboxError> {
//! let store = DieselStore::connect("postgres://postgres@127.0.0.1/app", "inbox", 8).await?;
//! store.migrate().await?;
//! let inbox = Inbox::new(store);
//!
//! // From the delivery's headers; the producer reuses the id on retries.
//! let key = InboxKey::new(
//!     MessageId::parse("0192f0a4-6c1e-7d2a-9b1c-3f4e5d6c7b8a")?,
//!     ConsumerName::new("parcel-tracking")?,
//! );
//! let parcel = String::from("P-1");
//! let outcome = inbox
//!     .handle(&key, async |tx| {
//!         // Inside the claim's transaction: commits with it, or not at all.
//!         diesel::insert_into(parcel_events::table)
//!             .values((
//!                 parcel_events::parcel.eq(&parcel),
//!                 parcel_events::message_id.eq(key.message_id.as_uuid()),
//!             ))
//!             .execute(tx.conn())
//!             .await
//!             .map_err(classify)?;
//!         Ok::<_, InboxError>(())
//!     })
//!     .await?;
//! match outcome {
//!     Handled::Processed(()) => { /* ack */ }
//!     Handled::Duplicate => { /* already done: ack and drop */ }
//!     // Only for keys made `with_fingerprint`: the id came again with
//!     // another payload; the work did not run. Log, then ack or dead-letter.
//!     Handled::Conflict { .. } => { /* ack or dead-letter */ }
//! }
//! # Ok(())
//! # }
//! ```
//!
//! [diesel-async]: diesel_async
#![deny(missing_docs)]

mod attempts;
mod error;
mod listen;
mod migrate;
mod migrations;
mod outbox;
mod responses;
pub mod schema;
mod statements;
mod store;
mod tls;
mod transaction;

/// The diesel this crate is built with, so that the consumer's business
/// writes on [`DieselTransaction::conn`] use the same version.
pub use diesel;
/// The diesel-async this crate is built with (its `RunQueryDsl` runs
/// queries on [`DieselTransaction::conn`]).
pub use diesel_async;
pub use diesel_async::AsyncPgConnection;
pub use error::{classify, classify_connection, classify_pool};
/// The inbox table's layouts, shared with the sqlx backend.
pub use inbox_postgres::Layout;
/// How the pool reaches PostgreSQL (directly or through PgBouncer in
/// transaction mode), shared with the sqlx backend.
pub use inbox_postgres::Pooling;
/// The schema-name rules, shared with the sqlx backend.
pub use inbox_postgres::SchemaName;
/// The time bounds of every inbox session, shared with the sqlx backend.
pub use inbox_postgres::SessionTimeouts;
pub use listen::{LISTENER_APPLICATION_NAME, OutboxListener};
pub use migrations::InboxMigrations;
pub use store::{DieselPool, DieselStore, DieselStoreBuilder, PooledConnection};
pub use transaction::DieselTransaction;
