//! The Inbox pattern on PostgreSQL through sqlx.
//!
//! [`SqlxStore`] keeps the inbox in the table `inbox_messages` of one schema
//! and hands the consumer a [`SqlxTransaction`]: the claim of the message,
//! which also records it processed, and the consumer's own writes (through
//! [`SqlxTransaction::conn`]) share one PostgreSQL transaction, so they
//! commit together or not at all. That shared fate is the whole point: an
//! inbox kept in another transaction (or another database) than the
//! business writes cannot tell a crash before the work from a crash after
//! it.
//!
//! ```no_run
//! use inbox_api::{ConsumerName, Handled, Inbox, InboxError, InboxKey, MessageId};
//! use inbox_backend_sqlx::{SqlxStore, classify};
//!
//! # async fn on_delivery(header_id: &str, parcel: &str) -> Result<(), InboxError> {
//! // One schema per application; the pool's connections find it through
//! // search_path.
//! let store = SqlxStore::connect("postgres://postgres@127.0.0.1:5432/app", "parcels").await?;
//! store.migrate().await?;
//! let inbox = Inbox::new(store);
//!
//! let key = InboxKey::new(MessageId::parse(header_id)?, ConsumerName::new("tracking")?);
//! let outcome = inbox
//!     .handle(&key, async |tx| {
//!         // The business write joins the claim's transaction.
//!         sqlx::query("INSERT INTO parcel_events (message_id, parcel) VALUES ($1, $2)")
//!             .bind(key.message_id.as_uuid())
//!             .bind(parcel)
//!             .execute(tx.conn())
//!             .await
//!             .map_err(classify)?;
//!         Ok::<_, InboxError>(())
//!     })
//!     .await?;
//! // Acknowledge the delivery now, whether it was processed or a duplicate.
//! let _ = matches!(outcome, Handled::Duplicate);
//! # Ok(())
//! # }
//! ```
//!
//! # How the contract is kept
//!
//! - **Claim**: `INSERT … ON CONFLICT DO NOTHING`, the first statement of
//!   the transaction. A concurrent claim of the same key waits on the primary
//!   key's unique index until the holder ends, then sees its committed row
//!   (`Duplicate`) or inserts its own (`Fresh`). No check-then-insert, no
//!   unique violation for a duplicate.
//! - **Processed**: the claim's INSERT sets `processed_at = now()` (the
//!   transaction's start). The row becomes visible only at COMMIT, with the
//!   work, so a committed row is a processed message.
//! - **Batched mode** ([`inbox_api::Inbox::handle_batch`]): one
//!   `INSERT … SELECT unnest(…) ON CONFLICT DO NOTHING RETURNING` claims a
//!   whole batch, keys in sorted order so overlapping batches cannot
//!   deadlock; each message's work runs in its own savepoint, and a failing
//!   message's claim is deleted again (`unclaim`) before the one COMMIT.
//! - **Cleanup**: one short `DELETE` per batch through the partial index on
//!   `processed_at`, skipping rows another cleaner has locked.
//! - **Errors**: [`classify`] maps SQLSTATEs and sqlx error kinds onto
//!   retryable and permanent [`InboxError`]s.
//! - **Schema**: the migrations in the workspace's `migrations/` (shared with
//!   the diesel backend) are embedded at compile time; every query is checked
//!   at run time, so building needs no database.
#![deny(missing_docs)]

mod error;

use std::collections::{BTreeMap, HashSet};
use std::num::NonZeroU32;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use inbox_api::{
    BatchTransaction, Claim, ConsumerName, InboxError, InboxKey, InboxRecord, InboxStats,
    InboxStore, InboxTransaction, MessageId,
};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool, Postgres, Row};

pub use error::classify;
/// The sqlx this crate is built with, so that business writes on
/// [`SqlxTransaction::conn`] use the same version (a second sqlx in the
/// dependency tree would have its own, incompatible `PgConnection`).
pub use sqlx;

/// The workspace's migrations, embedded so that a deployed binary migrates
/// without the source tree.
static MIGRATOR: Migrator = sqlx::migrate!("../migrations");

/// The claim records `processed_at` itself: the row only becomes visible at
/// COMMIT, together with the work, so a committed row is a processed
/// message. `now()` is the transaction's start, like `received_at`'s
/// default.
const CLAIM: &str = "INSERT INTO inbox_messages (id, consumer_type, processed_at) \
     VALUES ($1, $2, now()) ON CONFLICT DO NOTHING";

/// Batched claim: the keys arrive as two parallel arrays and are inserted in
/// sorted order (bytewise, like `InboxKey`'s `Ord`), so two overlapping
/// batches take their row locks in one global order and cannot deadlock.
/// A key repeated in the batch conflicts with its own first copy and is
/// skipped; `RETURNING` names the keys that were inserted. `processed_at`
/// as in [`CLAIM`].
const CLAIM_BATCH: &str = "INSERT INTO inbox_messages (id, consumer_type, processed_at) \
     SELECT id, consumer_type, now() \
     FROM unnest($1::uuid[], $2::text[]) AS k(id, consumer_type) \
     ORDER BY id, consumer_type COLLATE \"C\" \
     ON CONFLICT DO NOTHING RETURNING id, consumer_type";

const UNCLAIM: &str = "DELETE FROM inbox_messages WHERE id = $1 AND consumer_type = $2";

const LOOKUP: &str = "SELECT received_at, processed_at FROM inbox_messages \
                      WHERE id = $1 AND consumer_type = $2";

/// One batch of cleanup, in one statement and so in one short transaction.
///
/// The inner SELECT walks the partial index `inbox_messages_processed_at_idx`
/// in `processed_at` order and stops after `$2` rows; `FOR UPDATE SKIP
/// LOCKED` lets several instances clean at once without blocking or failing
/// each other (MassTransit #3996), each taking rows the others have not.
/// Deleting by `ctid` then goes straight to the locked tuples.
pub const PURGE_BATCH: &str = "DELETE FROM inbox_messages WHERE ctid = ANY(ARRAY(\
     SELECT ctid FROM inbox_messages WHERE processed_at < $1 \
     ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED))";

/// Checks that `schema` is a plain, unquoted PostgreSQL identifier:
/// `[a-z_][a-z0-9_]{0,62}`, not starting with `pg_` (reserved by the
/// server).
///
/// The name travels into the connections' `search_path` and, quoted, into
/// `CREATE SCHEMA`; accepting nothing but this shape is what keeps it from
/// ever carrying SQL.
///
/// # Errors
/// [`InboxError::InvalidArgument`] (permanent) naming the rule broken.
pub fn validate_schema_name(schema: &str) -> Result<(), InboxError> {
    let bytes = schema.as_bytes();
    let reason = match bytes.first() {
        None => Some("is empty"),
        Some(_) if bytes.len() > 63 => Some("is longer than 63 bytes"),
        Some(first) if !(first.is_ascii_lowercase() || *first == b'_') => {
            Some("must start with a lowercase ASCII letter or '_'")
        }
        Some(_)
            if !bytes
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_') =>
        {
            Some("may contain only lowercase ASCII letters, digits and '_'")
        }
        Some(_) if schema.starts_with("pg_") => Some("must not start with 'pg_' (reserved)"),
        Some(_) => None,
    };
    match reason {
        None => Ok(()),
        Some(reason) => {
            let shown: String = schema.chars().take(70).collect();
            Err(InboxError::InvalidArgument {
                message: format!("schema name {shown:?} {reason}"),
            })
        }
    }
}

/// An [`InboxStore`] on a PostgreSQL schema, through a [`PgPool`].
///
/// Cheap to clone: clones share the pool.
#[derive(Clone, Debug)]
pub struct SqlxStore {
    pool: PgPool,
    schema: Arc<str>,
}

impl SqlxStore {
    /// Connection options for `url` whose sessions use `schema`: they set
    /// `search_path` to it at connect time, as a startup parameter.
    ///
    /// Setting it per connection, instead of naming the schema in every
    /// statement, keeps the statements constant (so they are prepared once
    /// per connection) and the migrations schema-agnostic, and no text ever
    /// reaches SQL by string formatting. Tune the returned options (TLS,
    /// `application_name`, …) and build a pool for [`SqlxStore::new`].
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] for a bad schema name; a bad URL as
    /// [`classify`] maps it (permanent).
    pub fn connect_options(url: &str, schema: &str) -> Result<PgConnectOptions, InboxError> {
        validate_schema_name(schema)?;
        let options: PgConnectOptions = url.parse().map_err(classify)?;
        Ok(options.options([("search_path", schema)]))
    }

    /// Connects a pool with sqlx's default settings to `url`, its sessions
    /// using `schema`. Does not create or migrate anything: call
    /// [`SqlxStore::migrate`].
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] for a bad schema name; connection
    /// failures as [`classify`] maps them (retryable).
    pub async fn connect(url: &str, schema: &str) -> Result<Self, InboxError> {
        let options = Self::connect_options(url, schema)?;
        let pool = PgPoolOptions::new()
            .connect_with(options)
            .await
            .map_err(classify)?;
        Self::new(pool, schema)
    }

    /// Wraps a pool whose connections already use `schema`: build it from
    /// [`SqlxStore::connect_options`]. [`SqlxStore::migrate`] checks it.
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] for a bad schema name.
    pub fn new(pool: PgPool, schema: &str) -> Result<Self, InboxError> {
        validate_schema_name(schema)?;
        Ok(Self {
            pool,
            schema: Arc::from(schema),
        })
    }

    /// The pool, for the application's own queries outside the inbox.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema holding the inbox table.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// Creates the schema if needed and applies the workspace's migrations to
    /// it (sqlx's migrator, its bookkeeping table `_sqlx_migrations` in the
    /// same schema). Safe to run from several instances at once: the
    /// migrator serialises them with an advisory lock, and every statement
    /// is `IF NOT EXISTS`.
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] when the pool's connections do not
    /// use the schema (the pool was not built from
    /// [`SqlxStore::connect_options`]); [`InboxError::Schema`] when a
    /// migration fails or the applied ones differ from the embedded ones;
    /// connection failures as [`classify`] maps them.
    pub async fn migrate(&self) -> Result<(), InboxError> {
        let mut conn = self.pool.acquire().await.map_err(classify)?;
        // The migrator takes a session-level advisory lock, which it keeps
        // if it fails or is cancelled midway; back in the pool the
        // connection would block every later migration of this database.
        // Closing it releases the lock on every path; migrating is rare.
        conn.close_on_drop();
        // Look before creating: CREATE SCHEMA needs the CREATE privilege on
        // the database even when the schema exists, which an application
        // role on a provisioned schema often lacks.
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
                .bind(&*self.schema)
                .fetch_one(&mut *conn)
                .await
                .map_err(classify)?;
        if !exists {
            // The name is validated (a plain identifier), so quoting it is
            // enough.
            let create = format!("CREATE SCHEMA IF NOT EXISTS \"{}\"", self.schema);
            if let Err(error) = sqlx::query(&create).execute(&mut *conn).await {
                // Two instances creating the schema at once: one of them
                // loses on the catalog's unique index despite IF NOT EXISTS.
                let raced = error
                    .as_database_error()
                    .and_then(|db| db.code())
                    .is_some_and(|code| code == "23505" || code == "42P06");
                if !raced {
                    return Err(classify(error));
                }
            }
        }
        // search_path is resolved per statement, so a schema created after
        // connecting counts now.
        let current: Option<String> = sqlx::query_scalar("SELECT current_schema()::text")
            .fetch_one(&mut *conn)
            .await
            .map_err(classify)?;
        if current.as_deref() != Some(&*self.schema) {
            return Err(InboxError::InvalidArgument {
                message: format!(
                    "the pool's connections use schema {current:?}, not {:?}: \
                     build the pool from SqlxStore::connect_options",
                    self.schema
                ),
            });
        }
        // `run_direct` rather than `run`: `run`'s generic `Acquire` makes
        // this future not `Send` (sqlx's own comment on `run_direct`).
        MIGRATOR
            .run_direct(&mut *conn)
            .await
            .map_err(error::classify_migrate_error)?;
        tracing::info!(schema = %self.schema, "inbox schema migrated");
        Ok(())
    }
}

#[async_trait]
impl InboxStore for SqlxStore {
    type Transaction = SqlxTransaction;

    async fn begin(&self) -> Result<SqlxTransaction, InboxError> {
        let tx = self.pool.begin().await.map_err(classify)?;
        Ok(SqlxTransaction {
            tx,
            claimed: HashSet::new(),
            changes: Vec::new(),
            savepoints: Vec::new(),
            release_pending: None,
        })
    }

    async fn lookup(&self, key: &InboxKey) -> Result<Option<InboxRecord>, InboxError> {
        let row = sqlx::query(LOOKUP)
            .bind(key.message_id.as_uuid())
            .bind(key.consumer.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(classify)?;
        row.map(|row| {
            Ok(InboxRecord {
                key: key.clone(),
                received_at: row.try_get("received_at").map_err(classify)?,
                processed_at: row.try_get("processed_at").map_err(classify)?,
            })
        })
        .transpose()
    }

    async fn purge_processed_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        let deleted = sqlx::query(PURGE_BATCH)
            .bind(cutoff)
            .bind(i64::from(limit.get()))
            .execute(&self.pool)
            .await
            .map_err(classify)?
            .rows_affected();
        tracing::debug!(schema = %self.schema, %cutoff, limit, deleted, "inbox purge batch");
        Ok(deleted)
    }
}

#[async_trait]
impl InboxStats for SqlxStore {
    async fn processed_counts(&self) -> Result<BTreeMap<String, u64>, InboxError> {
        let rows: Vec<(String, i64)> = sqlx::query_as(PROCESSED_COUNTS)
            .fetch_all(&self.pool)
            .await
            .map_err(classify)?;
        Ok(rows
            .into_iter()
            .map(|(consumer, n)| (consumer, u64::try_from(n).unwrap_or(0)))
            .collect())
    }
}

/// Committed inbox rows per consumer ([`InboxStats::processed_counts`]).
const PROCESSED_COUNTS: &str =
    "SELECT consumer_type, count(*)::int8 FROM inbox_messages GROUP BY consumer_type";

/// An open inbox transaction: a [`sqlx::Transaction`] on one pooled
/// connection.
///
/// Dropped without commit, it rolls back. sqlx can only *queue* that
/// rollback (`Drop` cannot wait); the pool flushes it before it hands the
/// connection out again, and a connection that cannot do so is closed, which
/// the server also treats as a rollback. Either way no claim outlives its
/// transaction, but another connection may briefly still see the claim held.
#[derive(Debug)]
pub struct SqlxTransaction {
    tx: sqlx::Transaction<'static, Postgres>,
    /// Keys this transaction claimed `Fresh`, so that unclaiming any other
    /// key is refused instead of deleting a row someone else committed.
    claimed: HashSet<InboxKey>,
    /// Changes to `claimed` made while a savepoint is open, oldest first,
    /// so that rolling back to a savepoint can undo them.
    changes: Vec<ClaimChange>,
    /// One entry per open savepoint, newest last: the length of `changes`
    /// when it was taken.
    savepoints: Vec<usize>,
    /// A savepoint released by the caller but not yet on the server (its
    /// depth): the RELEASE rides along with the next SAVEPOINT, and COMMIT
    /// makes it unnecessary, so batched mode pays one round trip per
    /// message for its savepoints instead of two.
    release_pending: Option<usize>,
}

/// One change to the set of keys a transaction holds.
#[derive(Debug)]
enum ClaimChange {
    Claimed(InboxKey),
    Unclaimed(InboxKey),
}

impl SqlxTransaction {
    /// Records that `key` is now held, undoably while a savepoint is open.
    fn hold(&mut self, key: &InboxKey) {
        if self.claimed.insert(key.clone()) && !self.savepoints.is_empty() {
            self.changes.push(ClaimChange::Claimed(key.clone()));
        }
    }

    /// Records that `key` is no longer held, undoably.
    fn release(&mut self, key: &InboxKey) {
        if self.claimed.remove(key) && !self.savepoints.is_empty() {
            self.changes.push(ClaimChange::Unclaimed(key.clone()));
        }
    }
}

impl SqlxTransaction {
    /// The transaction's connection, for the consumer's business writes:
    /// whatever runs here commits or rolls back together with the claim.
    ///
    /// Do not `COMMIT` or `ROLLBACK` through it; the inbox does that.
    pub fn conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

#[async_trait]
impl InboxTransaction for SqlxTransaction {
    async fn claim(&mut self, key: &InboxKey) -> Result<Claim, InboxError> {
        let inserted = sqlx::query(CLAIM)
            .bind(key.message_id.as_uuid())
            .bind(key.consumer.as_str())
            .execute(&mut *self.tx)
            .await
            .map_err(classify)?
            .rows_affected();
        if inserted == 1 {
            self.hold(key);
            Ok(Claim::Fresh)
        } else {
            Ok(Claim::Duplicate)
        }
    }

    async fn commit(self) -> Result<(), InboxError> {
        self.tx.commit().await.map_err(classify)
    }

    async fn rollback(self) -> Result<(), InboxError> {
        self.tx.rollback().await.map_err(classify)
    }
}

#[async_trait]
impl BatchTransaction for SqlxTransaction {
    async fn claim_batch(&mut self, keys: &[InboxKey]) -> Result<Vec<Claim>, InboxError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (ids, consumers) = columns(keys);
        let inserted: Vec<(sqlx::types::Uuid, String)> = sqlx::query_as(CLAIM_BATCH)
            .bind(ids)
            .bind(consumers)
            .fetch_all(&mut *self.tx)
            .await
            .map_err(classify)?;
        let mut fresh: HashSet<InboxKey> = HashSet::with_capacity(inserted.len());
        for (id, consumer) in inserted {
            fresh.insert(InboxKey::new(
                MessageId::from_uuid(id),
                ConsumerName::new(consumer)?,
            ));
        }
        // `fresh.remove`: a repeated key is Fresh at its first occurrence
        // only.
        let mut claims = Vec::with_capacity(keys.len());
        for key in keys {
            if fresh.remove(key) {
                self.hold(key);
                claims.push(Claim::Fresh);
            } else {
                claims.push(Claim::Duplicate);
            }
        }
        Ok(claims)
    }

    async fn savepoint(&mut self) -> Result<(), InboxError> {
        // Named by depth only: nothing from outside reaches the SQL.
        let name = savepoint_name(self.savepoints.len());
        let sql = match self.release_pending {
            Some(released) => format!(
                "RELEASE SAVEPOINT {}; SAVEPOINT {name}",
                savepoint_name(released)
            ),
            None => format!("SAVEPOINT {name}"),
        };
        simple(&mut self.tx, sql).await?;
        self.release_pending = None;
        self.savepoints.push(self.changes.len());
        Ok(())
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), InboxError> {
        let Some(depth) = self.savepoints.len().checked_sub(1) else {
            return Err(no_savepoint());
        };
        let name = savepoint_name(depth);
        // One round trip: undo, then drop the savepoint. Rolling back to it
        // also drops a released-but-pending newer one.
        simple(
            &mut self.tx,
            format!("ROLLBACK TO SAVEPOINT {name}; RELEASE SAVEPOINT {name}"),
        )
        .await?;
        self.release_pending = None;
        let mark = self.savepoints.pop().unwrap_or_default();
        for change in self.changes.drain(mark..).rev() {
            match change {
                ClaimChange::Claimed(key) => self.claimed.remove(&key),
                ClaimChange::Unclaimed(key) => self.claimed.insert(key),
            };
        }
        Ok(())
    }

    async fn release_savepoint(&mut self) -> Result<(), InboxError> {
        let Some(depth) = self.savepoints.len().checked_sub(1) else {
            return Err(no_savepoint());
        };
        // Deferred: writes inside a savepoint that is released later, or
        // never (COMMIT releases every savepoint), end up exactly where
        // they would after an immediate RELEASE. Releasing an outer
        // savepoint also releases the inner pending one.
        self.release_pending = Some(depth);
        self.savepoints.pop();
        if self.savepoints.is_empty() {
            // Nothing left to roll back to: the changes need no undoing.
            self.changes.clear();
        }
        Ok(())
    }

    async fn unclaim(&mut self, key: &InboxKey) -> Result<(), InboxError> {
        if !self.claimed.contains(key) {
            return Err(InboxError::InvalidArgument {
                message: format!("unclaim({key}): the key is not held by this transaction"),
            });
        }
        // Deleting the row this transaction inserted: a claim waiting on it
        // waits on this transaction, and finds no row once it ends.
        sqlx::query(UNCLAIM)
            .bind(key.message_id.as_uuid())
            .bind(key.consumer.as_str())
            .execute(&mut *self.tx)
            .await
            .map_err(classify)?;
        self.release(key);
        Ok(())
    }
}

/// The keys as the two parallel arrays the batch statements unnest.
fn columns(keys: &[InboxKey]) -> (Vec<sqlx::types::Uuid>, Vec<String>) {
    keys.iter()
        .map(|k| (*k.message_id.as_uuid(), k.consumer.as_str().to_owned()))
        .unzip()
}

/// Runs generated, parameterless SQL (savepoint commands, possibly two in
/// one string) in one round trip over the simple query protocol.
async fn simple(conn: &mut PgConnection, sql: String) -> Result<(), InboxError> {
    sqlx::Executor::execute(conn, sql.as_str())
        .await
        .map_err(classify)?;
    Ok(())
}

fn savepoint_name(depth: usize) -> String {
    format!("inbox_savepoint_{depth}")
}

fn no_savepoint() -> InboxError {
    InboxError::InvalidArgument {
        message: "no open savepoint in this transaction".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>(_: &T) {}

    #[test]
    fn futures_are_send() {
        // Consumers spawn these; a non-Send future would be a compile error
        // far from here otherwise. Checked by type only, never run.
        fn check(store: &SqlxStore, tx: &mut SqlxTransaction, key: &InboxKey) {
            assert_send(&store.migrate());
            assert_send(&SqlxStore::connect("postgres://u@localhost/db", "inbox"));
            assert_send(&store.begin());
            assert_send(&store.lookup(key));
            assert_send(&tx.claim(key));
            assert_send(&tx.unclaim(key));
        }
        let _ = check;
    }

    #[test]
    fn schema_names() {
        for good in [
            "inbox",
            "_x",
            "a1_b2",
            "inbox_test_1764680000_abcdef12",
            &"a".repeat(63),
        ] {
            validate_schema_name(good).unwrap_or_else(|e| panic!("{good:?}: {e}"));
        }
        for bad in [
            "",
            "1abc",
            "Inbox",
            "in-box",
            "a b",
            "x\"; DROP SCHEMA public; --",
            "a\0",
            "é",
            "pg_temp",
            &"a".repeat(64),
        ] {
            let err = validate_schema_name(bad).expect_err(bad);
            assert!(matches!(err, InboxError::InvalidArgument { .. }), "{bad:?}");
            assert!(!err.is_retryable());
        }
    }

    #[test]
    fn connect_options_validate_the_schema_and_set_search_path() {
        let bad = SqlxStore::connect_options("postgres://u@h/db", "Robert'); DROP TABLE x;--");
        assert!(matches!(bad, Err(InboxError::InvalidArgument { .. })));

        let options =
            SqlxStore::connect_options("postgres://u@h/db", "inbox_a").expect("valid options");
        assert_eq!(options.get_options(), Some("-c search_path=inbox_a"));
    }

    #[test]
    fn a_bad_url_is_permanent() {
        let err =
            SqlxStore::connect_options("postgres://u@h:notaport/db", "inbox").expect_err("bad url");
        assert!(!err.is_retryable(), "{err:?}");
    }
}
