#![doc = include_str!("../README.md")]
//!
//! # Semantics
//!
//! For tests and the application's offline mode: it keeps the same contract
//! as the Postgres backends (the contract on `inbox_api::InboxStore`), so code that is correct on
//! it is correct there, and the shared conformance suite runs against it in
//! milliseconds. It is a real transactional store, not a `HashSet` of seen
//! ids:
//!
//! - **A claim is one atomic insert-or-nothing.** Absent key: this
//!   transaction now holds it as a *pending* row and gets
//!   [`Claim::Fresh`](inbox_api::Claim::Fresh). Committed key, or a key this
//!   same transaction already holds (Postgres' `ON CONFLICT DO NOTHING`):
//!   [`Claim::Duplicate`](inbox_api::Claim::Duplicate).
//! - **A claim of a key held by another open transaction waits** for it,
//!   asynchronously (no thread is blocked, nothing polls): the holder
//!   commits, the waiter gets `Duplicate`; it rolls back or is dropped, the
//!   waiter retries and gets `Fresh` unless another waiter got there first.
//!   Never two `Fresh` for one key. A wait that would close a cycle (two
//!   transactions each claiming the other's key) is refused as a deadlock,
//!   [`InboxError::Conflict`](inbox_api::InboxError::Conflict) (Postgres'
//!   40P01), and that transaction is aborted.
//! - **Distinct keys never wait on each other.** Rows live in 64 shards
//!   chosen by key hash, each behind its own short-lived mutex; the hot path
//!   (begin, claim, write, commit) takes no global lock and never
//!   holds a lock across an `.await`.
//! - **All or nothing.** Business writes ([`MemoryTransaction::put`],
//!   [`MemoryTransaction::delete`]) are buffered in the transaction; commit
//!   locks every shard it touches (in one global order, so commits cannot
//!   deadlock), publishes the claims and the writes together, and only then
//!   wakes waiters. Rollback, or dropping an unfinished transaction (a
//!   panic, a cancelled future), releases its claims and discards its
//!   writes synchronously: no trace is left.
//! - **Timestamps** come from a [`Clock`]: a `Fresh` claim records both
//!   `received_at` and `processed_at`, which become visible with the commit
//!   (a committed row is a processed message). A [`ManualClock`] makes
//!   retention tests instant.
//! - **Cleanup** deletes only committed, processed rows older than the
//!   cutoff, at most `limit` per batch, through a per-shard index on
//!   `processed_at`, one shard lock at a time.
//!
//! - **Outbox.** [`OutboxTransaction::enqueue`](inbox_api::OutboxTransaction::enqueue)
//!   buffers the outgoing message with the writes; it reaches the outbox
//!   with the commit or never. Its id is reserved meanwhile: an enqueue of
//!   the same id by another transaction waits, as on Postgres. Relays lease pending messages until a
//!   deadline on the store clock, so a relay that dies gives them back when
//!   its lease runs out, exactly as `locked_until` does on Postgres.
//!
//! - **Attempt ledger.** [`AttemptLedger`](inbox_api::AttemptLedger):
//!   failed deliveries per key, recorded at once and apart from every
//!   transaction (a failure's transaction has rolled back), on the store
//!   clock, as `inbox_attempts` on Postgres.
//!
//! Where it differs from Postgres, knowingly: business keys carry no row
//! locks, so two transactions writing the same business key do not wait for
//! each other and the last commit wins. Effects should use unique keys (the
//! message id in the key) — which is what makes them safe on Postgres too.
//! Reads are read-committed. Nothing survives the process.
#![deny(missing_docs)]

mod attempts;
mod clock;
mod deadlock;
mod outbox;
mod processed;
mod store;
mod transaction;
mod writes;

pub use clock::{Clock, ManualClock, SystemClock};
pub use store::{MemoryStore, Snapshot};
pub use transaction::MemoryTransaction;
