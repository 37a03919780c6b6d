#![doc = include_str!("../README.md")]
//!
//! # The crate
//!
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
//! // One schema for the inbox; every statement names it.
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
//! - **Outbox**: [`SqlxTransaction`] implements
//!   [`inbox_api::OutboxTransaction`], so an outgoing message is one more
//!   row of the business transaction (`INSERT … ON CONFLICT DO NOTHING`
//!   into `outbox_messages`); [`SqlxStore`] implements
//!   [`inbox_api::OutboxStore`] for the relay: leases taken with `FOR
//!   UPDATE SKIP LOCKED` in one short statement, expiring on their own.
//! - **Attempt ledger**: [`SqlxStore`] implements
//!   [`inbox_api::AttemptLedger`], each failure one upsert on the pool, in
//!   its own transaction, outside the consumer's (which has rolled back).
//! - **Time bounds**: every transaction sets [`SessionTimeouts`] with
//!   `SET LOCAL` right after `BEGIN`, in the same round trip (and every
//!   connection of [`SqlxStore::connect_options`] sets them at startup
//!   too): a claim of a key a frozen holder
//!   keeps gives up after `lock_timeout` ([`InboxError::LockTimeout`]), the
//!   server ends a session idle inside a transaction, and a transaction
//!   dropped mid-statement closes its connection so the server stops the
//!   statement (see [`SqlxTransaction`]).
//! - **Errors**: [`classify`] reads the SQLSTATE (or sqlx's error kind) and
//!   maps it through `inbox-postgres`'s table onto retryable and permanent
//!   [`InboxError`]s.
//! - **Schema**: `inbox-postgres` owns the migrations, the statements and
//!   the savepoint bookkeeping, shared with the diesel backend; this crate
//!   only sends them. A schema migrated by either backend is migrated for
//!   both. Building needs no database.
#![deny(missing_docs)]

mod attempts;
mod error;
pub mod migrations;
mod outbox;
mod responses;

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use inbox_api::{
    BatchTransaction, Claim, InboxError, InboxKey, InboxRecord, InboxStats, InboxStore,
    InboxTransaction, PurgedBatch,
};
/// The inbox table's layouts, shared with the diesel backend.
pub use inbox_postgres::Layout;
use inbox_postgres::{
    Claims, MigrationConnection, SavepointDriver, Statements, fingerprint_column, key_columns,
    stored_fingerprint,
};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgTransactionManager};
use sqlx::{PgConnection, PgPool, Postgres, Row, TransactionManager};

pub use error::classify;
/// How the pool reaches PostgreSQL (directly or through PgBouncer in
/// transaction mode), shared with the diesel backend.
pub use inbox_postgres::Pooling;
/// The schema-name rules, shared with the diesel backend.
pub use inbox_postgres::SchemaName;
/// The time bounds of every inbox session, shared with the diesel backend.
pub use inbox_postgres::SessionTimeouts;
/// The sqlx this crate is built with, so that business writes on
/// [`SqlxTransaction::conn`] use the same version (a second sqlx in the
/// dependency tree would have its own, incompatible `PgConnection`).
pub use sqlx;

/// An [`InboxStore`] on a PostgreSQL schema, through a [`PgPool`].
///
/// Cheap to clone: clones share the pool.
#[derive(Clone, Debug)]
pub struct SqlxStore {
    pool: PgPool,
    schema: Arc<SchemaName>,
    layout: Layout,
    /// The statements with the schema qualified, for this layout.
    statements: Arc<Statements>,
    /// `BEGIN` and the session bounds as `SET LOCAL`, one round trip.
    begin: Arc<str>,
    pooling: Pooling,
    /// A direct URL (not through a transaction-mode pooler) for LISTEN.
    listen_url: Option<Arc<str>>,
}

impl SqlxStore {
    /// Connection options for `url` whose sessions use `schema` under the
    /// default [`SessionTimeouts`]: see [`SqlxStore::connect_options_with`].
    ///
    /// # Errors
    /// As [`SqlxStore::connect_options_with`].
    pub fn connect_options(url: &str, schema: &str) -> Result<PgConnectOptions, InboxError> {
        Self::connect_options_with(url, schema, &SessionTimeouts::default())
    }

    /// Connection options for `url` whose sessions use `schema` and the
    /// time bounds `timeouts`: both are set at connect time, as startup
    /// parameters, so they cost no round trip per transaction.
    ///
    /// The store itself needs neither: its statements name the schema and
    /// its transactions set the bounds ([`SqlxStore::new`]). The schema as
    /// `search_path` is for the consumer's own unqualified tables in that
    /// schema; a bound set here holds inside the store's transactions too
    /// (the store then leaves it alone). Not for PgBouncer in transaction
    /// mode, which refuses startup `options`: use
    /// [`SqlxStore::pool_options`] there. The timeouts bound what a frozen
    /// holder of a claim can do to everyone else (see [`SessionTimeouts`]);
    /// `client_connection_check_interval` is also what stops a statement
    /// whose transaction was dropped (see [`SqlxTransaction`]). Tune the
    /// returned options (TLS, `application_name`, …) and build a pool for
    /// [`SqlxStore::new`].
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] for a bad schema name; a bad URL as
    /// [`classify`] maps it (permanent).
    pub fn connect_options_with(
        url: &str,
        schema: &str,
        timeouts: &SessionTimeouts,
    ) -> Result<PgConnectOptions, InboxError> {
        let schema = SchemaName::new(schema)?;
        let options = parse_url(url)?;
        let settings = timeouts.settings();
        Ok(options.options(
            std::iter::once(("search_path", schema.as_str()))
                .chain(settings.iter().map(|(name, value)| (*name, value.as_str()))),
        ))
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
            .map_err(|error| {
                let refused = error
                    .as_database_error()
                    .and_then(|db| db.code())
                    .is_some_and(|code| inbox_postgres::is_login_refused(&code));
                inbox_postgres::connect_failed(url, refused, classify(error))
            })?;
        Self::new(pool, schema)
    }

    /// Connection options for `url` that suit `pooling`, with no session
    /// setting at all: every statement of the store names its schema and
    /// every transaction sets its own bounds, so nothing depends on the
    /// session. For [`Pooling::Transaction`] (PgBouncer in transaction
    /// mode) the statement cache is off (`statement_cache_capacity(0)`): a
    /// statement prepared on one server session would be missing on the
    /// next. Build a pool with them and hand it to [`SqlxStore::new`]; a
    /// pool of your own behind PgBouncer needs the same
    /// `statement_cache_capacity(0)`.
    ///
    /// # Errors
    /// A bad URL as [`classify`] maps it (permanent).
    pub fn pool_options(url: &str, pooling: Pooling) -> Result<PgConnectOptions, InboxError> {
        let options = parse_url(url)?;
        Ok(match pooling {
            Pooling::Session => options,
            Pooling::Transaction => options.statement_cache_capacity(0),
        })
    }

    /// Wraps any pool: the application's own, whatever its `search_path`.
    /// The store's statements name `schema` (its tables, quoted), so the
    /// application's unqualified tables keep resolving through the pool's
    /// own `search_path`, and every inbox transaction sets the default
    /// [`SessionTimeouts`] with `SET LOCAL` right after `BEGIN` (tune them
    /// with [`SqlxStore::with_session_timeouts`]), so they hold on a pool
    /// whose connections set nothing. Behind PgBouncer in transaction mode
    /// add [`SqlxStore::with_pooling`].
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] for a bad schema name.
    ///
    /// A bound the pool's connections already set at startup (a pool built
    /// from [`SqlxStore::connect_options_with`]) is left to them, so the
    /// value chosen there holds inside the transactions too.
    pub fn new(pool: PgPool, schema: &str) -> Result<Self, InboxError> {
        let schema = SchemaName::new(schema)?;
        let layout = Layout::Table;
        let timeouts = unset_at_startup(&pool, SessionTimeouts::default());
        Ok(Self {
            pool,
            statements: Arc::new(Statements::new(&schema, layout)),
            schema: Arc::new(schema),
            layout,
            begin: timeouts.begin_statement().into(),
            pooling: Pooling::Session,
            listen_url: None,
        })
    }

    /// The same store with its transactions under `timeouts` instead of
    /// the default [`SessionTimeouts`]: `BEGIN` is followed by `SET LOCAL`
    /// of each bound in the same round trip (measured at about 30 µs per
    /// transaction on a local server), so the bounds hold on any pool and
    /// through PgBouncer, and end with the transaction.
    /// [`SessionTimeouts::SERVER_DEFAULTS`] sends a bare `BEGIN`.
    #[must_use]
    pub fn with_session_timeouts(mut self, timeouts: &SessionTimeouts) -> Self {
        self.begin = timeouts.begin_statement().into();
        self
    }

    /// The same store for a pool that reaches PostgreSQL as `pooling` says
    /// (default [`Pooling::Session`]). With [`Pooling::Transaction`]
    /// [`SqlxStore::listen_outbox`] LISTENs only through the direct URL of
    /// [`SqlxStore::with_listen_url`], and refuses without one (relays
    /// poll then). The pool itself must not cache statements: build it
    /// from [`SqlxStore::pool_options`].
    #[must_use]
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// The same store with a direct URL to PostgreSQL (not through the
    /// pooler) for [`SqlxStore::listen_outbox`]: LISTEN belongs to a
    /// session, which a transaction-mode pooler does not keep.
    #[must_use]
    pub fn with_listen_url(mut self, url: &str) -> Self {
        self.listen_url = Some(url.into());
        self
    }

    /// How the store's pool reaches PostgreSQL.
    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// The same store with the inbox table laid out as `layout` (the
    /// default is [`Layout::Table`]). [`SqlxStore::migrate`] creates that
    /// layout in a new schema and refuses a schema with the other one; the
    /// claims and the cleanup follow it. See [`Layout`] for the
    /// partitioned layout's rules.
    #[must_use]
    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self.statements = Arc::new(Statements::new(&self.schema, layout));
        self
    }

    /// The inbox table's layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The partitioned layout's cleanup of whole days: detaches and drops
    /// the day partitions whose day ended at or before `cutoff`
    /// ([`inbox_postgres::drop_expired_partitions`]) and returns their rows;
    /// `None` on the table layout, which has no days. The purge does this
    /// first too; calling it before lets a caller report the days apart
    /// from the deleted rows.
    ///
    /// # Errors
    /// As [`inbox_postgres::drop_expired_partitions`].
    pub async fn drop_expired_days(
        &self,
        cutoff: DateTime<Utc>,
    ) -> Result<Option<u64>, InboxError> {
        if self.layout != Layout::Partitioned {
            return Ok(None);
        }
        let mut conn = self.pool.acquire().await.map_err(classify)?;
        Ok(Some({
            let mut m = Migrating(&mut conn);
            inbox_postgres::require_session_schema(&mut m, &self.schema).await?;
            inbox_postgres::drop_expired_partitions(&mut m, cutoff).await?
        }))
    }

    /// The partitioned layout's partitions, with their bounds and the
    /// planner's row estimates ([`inbox_postgres::partitions`]).
    ///
    /// # Errors
    /// As [`inbox_postgres::partitions`].
    pub async fn partitions(&self) -> Result<Vec<inbox_postgres::Partition>, InboxError> {
        let mut conn = self.pool.acquire().await.map_err(classify)?;
        let mut m = Migrating(&mut conn);
        inbox_postgres::require_session_schema(&mut m, &self.schema).await?;
        inbox_postgres::partitions(&mut m, self.layout).await
    }

    /// The partitioned layout's maintenance: creates the missing day
    /// partitions from `days_behind` days before today (UTC) to
    /// `days_ahead` after it ([`inbox_postgres::create_partitions`]) and
    /// returns how many.
    ///
    /// # Errors
    /// As [`inbox_postgres::create_partitions`], statements' failures as
    /// [`classify`] maps them.
    pub async fn create_partitions(
        &self,
        days_behind: u16,
        days_ahead: u16,
    ) -> Result<u64, InboxError> {
        let mut conn = self.pool.acquire().await.map_err(classify)?;
        let layout = self.layout;
        let mut m = Migrating(&mut conn);
        inbox_postgres::require_session_schema(&mut m, &self.schema).await?;
        inbox_postgres::create_partitions(&mut m, layout, days_behind, days_ahead).await
    }

    /// The pool, for the application's own queries outside the inbox.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema holding the inbox table.
    pub fn schema(&self) -> &str {
        self.schema.as_str()
    }

    /// Creates the schema if needed and applies the pending migrations of
    /// `inbox-postgres` to it, recording them in its ledger (the one the
    /// diesel backend uses too). Safe to run from several instances at
    /// once: the runner serialises them with an advisory lock. Returns the
    /// versions applied (empty when up to date).
    ///
    /// Works on any pool, through PgBouncer in transaction mode too: the
    /// runner's transaction sets its own `search_path`.
    ///
    /// # Errors
    /// [`InboxError::Schema`] when the applied migrations differ from the
    /// embedded ones; failures of the statements as [`classify`] maps
    /// them.
    pub async fn migrate(&self) -> Result<Vec<i64>, InboxError> {
        let mut conn = self.pool.acquire().await.map_err(classify)?;
        // Cancelled midway, the runner would leave the connection inside its
        // transaction; back in the pool it would hold the advisory lock and
        // block every later migration of this database. Closing it rolls
        // back on every path; migrating is rare.
        conn.close_on_drop();
        inbox_postgres::migrate_with_layout(&mut Migrating(&mut conn), &self.schema, self.layout)
            .await
    }
}

impl SqlxStore {
    /// A listener on the schema's outbox channel
    /// ([`SchemaName::outbox_channel`]), which the outbox's trigger
    /// notifies when a transaction that enqueued messages commits: a relay
    /// waits on it instead of polling fast.
    ///
    /// It holds one connection for as long as it lives (LISTEN belongs to a
    /// session). What is notified while that connection is lost is lost:
    /// whoever listens must wake its relay once after listening again
    /// (`consumer_app::tools::stores::sqlx_wakeups` does), and a relay keeps
    /// polling as its fallback.
    ///
    /// With [`Pooling::Transaction`] it connects to the URL of
    /// [`SqlxStore::with_listen_url`] instead of the pool (a LISTEN through
    /// a transaction-mode pooler would listen on a session the pooler hands
    /// to someone else).
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] for [`Pooling::Transaction`] without
    /// a listen URL: poll instead; connection and statement failures as
    /// [`classify`] maps them.
    pub async fn listen_outbox(&self) -> Result<sqlx::postgres::PgListener, InboxError> {
        let connected = match (&self.listen_url, self.pooling) {
            (Some(url), _) => {
                // Refused here when it asks for TLS this build lacks.
                parse_url(url)?;
                sqlx::postgres::PgListener::connect(&libpq_url(url)).await
            }
            (None, Pooling::Session) => sqlx::postgres::PgListener::connect_with(&self.pool).await,
            (None, Pooling::Transaction) => {
                return Err(InboxError::InvalidArgument {
                    message: "LISTEN needs a session, which a transaction-mode pooler does not \
                              keep: name a direct URL with SqlxStore::with_listen_url, or let \
                              the relay poll"
                        .into(),
                });
            }
        };
        let mut listener = connected.map_err(classify)?;
        listener
            .listen(&self.schema.outbox_channel())
            .await
            .map_err(classify)?;
        Ok(listener)
    }
}

impl SqlxStore {
    /// One batch of a cleanup `statement` (`$1` cutoff, `$2` limit): the
    /// outbox's and the attempt ledger's (the inbox's resumes where the
    /// batch before it stopped: [`inbox_postgres::sql::PURGE_BATCH`]). Returns the rows
    /// deleted.
    pub(crate) async fn purge_batch(
        &self,
        statement: &str,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
        table: &'static str,
    ) -> Result<u64, InboxError> {
        let mut one = self.one_statement().await?;
        let deleted = sqlx::query(statement)
            .bind(cutoff)
            .bind(i64::from(limit.get()))
            .persistent(self.persistent())
            .execute(one.conn())
            .await
            .map_err(classify)?
            .rows_affected();
        one.done().await?;
        tracing::debug!(schema = %self.schema, table, %cutoff, limit, deleted, "purge batch");
        Ok(deleted)
    }
}

/// `timeouts` without the settings `pool`'s connections set as startup
/// parameters (`-c name=value`).
fn unset_at_startup(pool: &PgPool, mut timeouts: SessionTimeouts) -> SessionTimeouts {
    let options = pool.connect_options();
    let startup = options.get_options().unwrap_or_default();
    let set = |name: &str| startup.contains(&format!("-c {name}="));
    if set("lock_timeout") {
        timeouts.lock_timeout = None;
    }
    if set("idle_in_transaction_session_timeout") {
        timeouts.idle_in_transaction = None;
    }
    if set("client_connection_check_interval") {
        timeouts.client_check_interval = None;
    }
    timeouts
}

impl SqlxStore {
    /// Whether statements are prepared under a name and kept (session
    /// pooling), or sent unnamed (transaction pooling: a named statement
    /// would outlive the server session it was prepared on, and collide
    /// with another client's of the same name there).
    pub(crate) fn persistent(&self) -> bool {
        self.pooling == Pooling::Session
    }

    /// A connection for one statement outside the consumer's transactions
    /// (a lookup, the relay's take, a ledger upsert). Through a
    /// transaction-mode pooler the statement runs inside a transaction of
    /// its own: sqlx sends an unnamed statement's parse and its execution
    /// as two exchanges, and outside a transaction the pooler may hand them
    /// to two different server sessions.
    pub(crate) async fn one_statement(&self) -> Result<OneStatement, InboxError> {
        let mut conn = self.pool.acquire().await.map_err(classify)?;
        let wrapped = self.pooling == Pooling::Transaction;
        if wrapped {
            let begin = std::borrow::Cow::Owned(self.begin.to_string());
            PgTransactionManager::begin(&mut conn, Some(begin))
                .await
                .map_err(classify)?;
        }
        Ok(OneStatement {
            conn: Some(conn),
            open: wrapped,
        })
    }
}

/// A pooled connection for one statement: see [`SqlxStore::one_statement`].
pub(crate) struct OneStatement {
    /// Always `Some` until [`Drop`] takes it to close it.
    conn: Option<PoolConnection<Postgres>>,
    /// Inside a transaction of its own that [`OneStatement::done`] has not
    /// committed yet.
    open: bool,
}

impl OneStatement {
    /// The connection to run the statement on.
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        self.conn
            .as_mut()
            .expect("the connection is only taken by drop")
    }

    /// Commits the statement's own transaction, if it has one.
    pub(crate) async fn done(mut self) -> Result<(), InboxError> {
        if self.open {
            PgTransactionManager::commit(self.conn())
                .await
                .map_err(classify)?;
            self.open = false;
        }
        Ok(())
    }
}

impl Drop for OneStatement {
    fn drop(&mut self) {
        // Failed or cancelled inside its own transaction: closed rather
        // than handed back to the pool mid-transaction. Closed at once, as
        // a dropped `SqlxTransaction` is: over TLS a graceful close waits
        // for the server's close_notify, which a server busy in the
        // statement never sends.
        if self.open
            && let Some(conn) = self.conn.take()
        {
            drop(conn.detach());
        }
    }
}

/// [`inbox_postgres::migrate`]'s view of a sqlx connection.
struct Migrating<'c>(&'c mut PgConnection);

#[async_trait]
impl MigrationConnection for Migrating<'_> {
    async fn execute(&mut self, sql: &str) -> Result<(), InboxError> {
        // A `&str` without arguments goes over the simple query protocol,
        // which takes several statements at once.
        sqlx::Executor::execute(&mut *self.0, sql)
            .await
            .map_err(classify)?;
        Ok(())
    }

    async fn query_ledger(&mut self, sql: &str) -> Result<Vec<(i64, i64)>, InboxError> {
        // Unnamed: the runner may run through a transaction-mode pooler,
        // where a named statement would outlive its server session.
        sqlx::query_as(sql)
            .persistent(false)
            .fetch_all(&mut *self.0)
            .await
            .map_err(classify)
    }

    async fn query_text(&mut self, sql: &str) -> Result<Option<String>, InboxError> {
        sqlx::query_scalar(sql)
            .persistent(false)
            .fetch_one(&mut *self.0)
            .await
            .map_err(classify)
    }
}

#[async_trait]
impl InboxStore for SqlxStore {
    type Transaction = SqlxTransaction;

    async fn begin(&self) -> Result<SqlxTransaction, InboxError> {
        let mut conn = self.pool.acquire().await.map_err(classify)?;
        // BEGIN and the bounds' SET LOCAL in one simple query: one round
        // trip, as a bare BEGIN.
        let begin = std::borrow::Cow::Owned(self.begin.to_string());
        PgTransactionManager::begin(&mut conn, Some(begin))
            .await
            .map_err(classify)?;
        Ok(SqlxTransaction {
            conn: Some(conn),
            claims: Claims::new(),
            layout: self.layout,
            statements: Arc::clone(&self.statements),
            persistent: self.persistent(),
        })
    }

    async fn lookup(&self, key: &InboxKey) -> Result<Option<InboxRecord>, InboxError> {
        let mut one = self.one_statement().await?;
        let row = sqlx::query(&self.statements.lookup)
            .bind(key.message_id.as_uuid())
            .bind(key.consumer.as_str())
            .persistent(self.persistent())
            .fetch_optional(one.conn())
            .await
            .map_err(classify)?;
        one.done().await?;
        row.map(|row| {
            Ok(InboxRecord {
                key: InboxKey::new(key.message_id, key.consumer.clone()),
                received_at: row.try_get("received_at").map_err(classify)?,
                processed_at: row.try_get("processed_at").map_err(classify)?,
                fingerprint: stored_fingerprint(
                    row.try_get("payload_fingerprint").map_err(classify)?,
                )?,
            })
        })
        .transpose()
    }

    async fn purge_processed_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        Ok(self
            .purge_processed_batch_from(cutoff, None, limit)
            .await?
            .deleted)
    }

    async fn purge_processed_batch_from(
        &self,
        cutoff: DateTime<Utc>,
        from: Option<DateTime<Utc>>,
        limit: NonZeroU32,
    ) -> Result<PurgedBatch, InboxError> {
        // The partitioned layout drops its expired days whole first (no
        // row deletes, and no lock that blocks claims of other days), then
        // deletes the untimed partition's rows in the usual batch.
        let dropped = match self.layout {
            Layout::Table => 0,
            Layout::Partitioned => {
                let mut conn = self.pool.acquire().await.map_err(classify)?;
                {
                    let mut m = Migrating(&mut conn);
                    inbox_postgres::require_session_schema(&mut m, &self.schema).await?;
                    inbox_postgres::drop_expired_partitions(&mut m, cutoff).await?
                }
            }
        };
        let mut one = self.one_statement().await?;
        let (deleted, last): (i64, Option<DateTime<Utc>>) =
            sqlx::query_as(&self.statements.purge_batch)
                .bind(cutoff)
                .bind(from)
                .bind(i64::from(limit.get()))
                .persistent(self.persistent())
                .fetch_one(one.conn())
                .await
                .map_err(classify)?;
        one.done().await?;
        tracing::debug!(schema = %self.schema, %cutoff, ?from, limit, deleted, "inbox purge batch");
        Ok(PurgedBatch::new(
            dropped + u64::try_from(deleted).unwrap_or(0),
            last,
        ))
    }
}

#[async_trait]
impl InboxStats for SqlxStore {
    async fn processed_counts(&self) -> Result<BTreeMap<String, u64>, InboxError> {
        let mut one = self.one_statement().await?;
        let rows: Vec<(String, i64)> = sqlx::query_as(&self.statements.processed_counts)
            .persistent(self.persistent())
            .fetch_all(one.conn())
            .await
            .map_err(classify)?;
        one.done().await?;
        Ok(rows
            .into_iter()
            .map(|(consumer, n)| (consumer, u64::try_from(n).unwrap_or(0)))
            .collect())
    }
}

/// An open inbox transaction on one pooled connection, begun and ended
/// through sqlx's transaction manager (so a `tx.conn().begin()` in the
/// consumer's work nests as a savepoint, as on a [`sqlx::Transaction`]).
///
/// # Dropped without commit
///
/// It closes its connection instead of handing it back to the pool, and the
/// server rolls back a transaction whose client went away. A
/// [`sqlx::Transaction`] would only *queue* a rollback for the pool to
/// flush, and the pool would first wait for whatever statement was still
/// running: dropped during a slow statement or a lock wait (a timeout
/// around `Inbox::handle` fired), the statement would run on to its end,
/// holding the claim's lock. With the connection closed, the server stops
/// the statement within `client_connection_check_interval` (one of the
/// [`SessionTimeouts`] the store's connections set, 1 s by default) and
/// ends the session, releasing its locks; the pool opens a new connection
/// in the freed slot on demand. The diesel backend sends a cancel request
/// to the same end; sqlx keeps the key such a request needs to itself, and
/// a `pg_cancel_backend(pid)` would cost a round trip per transaction to
/// learn the pid and could hit the next user of a pid. The connection is
/// also closed when commit or rollback fails, since its state is unknown
/// then.
pub struct SqlxTransaction {
    /// `Some` for the whole life of the value; `None` only once commit,
    /// rollback or drop handed the connection back or closed it.
    conn: Option<PoolConnection<Postgres>>,
    /// The keys it holds and its savepoints.
    claims: Claims,
    /// The store's layout, for its claim statements.
    layout: Layout,
    /// The store's statements.
    statements: Arc<Statements>,
    /// Whether its statements are prepared and kept
    /// ([`SqlxStore::persistent`]).
    persistent: bool,
}

impl std::fmt::Debug for SqlxTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxTransaction")
            .field("open", &self.conn.is_some())
            .field("claimed", &self.claims.held())
            .field("savepoints", &self.claims.savepoint_depth())
            .finish()
    }
}

impl SqlxTransaction {
    /// The transaction's connection, for the consumer's business writes:
    /// whatever runs here commits or rolls back together with the claim.
    ///
    /// Do not `COMMIT` or `ROLLBACK` through it; the inbox does that.
    pub fn conn(&mut self) -> &mut PgConnection {
        match self.conn.as_mut() {
            Some(conn) => conn,
            // commit/rollback consume `self`, so no caller can observe it.
            None => unreachable!("SqlxTransaction used after it ended"),
        }
    }

    /// Ends the transaction, committing or rolling back through sqlx's
    /// transaction manager: the connection goes back to the pool when that
    /// succeeds, and is closed when it fails (its state is unknown).
    async fn end(mut self, commit: bool) -> Result<(), InboxError> {
        let Some(mut conn) = self.conn.take() else {
            return Ok(());
        };
        // If this future is dropped mid-COMMIT, `conn` is dropped with it
        // and returned to the pool, which flushes or closes it; the outcome
        // is unknown then, as for any lost COMMIT, and redelivery resolves
        // it.
        let ended = if commit {
            PgTransactionManager::commit(&mut conn).await
        } else {
            PgTransactionManager::rollback(&mut conn).await
        };
        match ended {
            Ok(()) if PgTransactionManager::get_transaction_depth(&conn) == 0 => Ok(()),
            Ok(()) => {
                conn.close_on_drop();
                Err(InboxError::Store {
                    retryable: false,
                    source: "transaction ended with an unbalanced nested transaction: the \
                             consumer's work began one on the connection and did not end it"
                        .into(),
                })
            }
            Err(error) => {
                conn.close_on_drop();
                Err(classify(error))
            }
        }
    }
}

impl Drop for SqlxTransaction {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            tracing::debug!(
                claimed = self.claims.held(),
                "inbox transaction dropped without commit: closing its connection"
            );
            // Closed at once, not gracefully (`close_on_drop`): over TLS a
            // graceful close sends close_notify and waits for the server's,
            // which a server busy in the statement never sends, so the
            // socket stayed open and the server never noticed its client
            // had gone. Dropping the detached connection closes the socket
            // now, TLS or not; the pool opens another in its slot.
            drop(conn.detach());
        }
    }
}

#[async_trait]
impl SavepointDriver for SqlxTransaction {
    fn claims(&mut self) -> &mut Claims {
        &mut self.claims
    }

    async fn send_simple(&mut self, sql: String) -> Result<(), InboxError> {
        sqlx::Executor::execute(self.conn(), sql.as_str())
            .await
            .map_err(classify)?;
        Ok(())
    }
}

/// The SQLSTATE of a database error, for the layout's claim rules.
fn sqlstate_of(error: &sqlx::Error) -> Option<String> {
    match error {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

#[async_trait]
impl InboxTransaction for SqlxTransaction {
    async fn claim(&mut self, key: &InboxKey) -> Result<Claim, InboxError> {
        let layout = self.layout;
        let statements = Arc::clone(&self.statements);
        let inserted = sqlx::query(&statements.claim)
            .bind(key.message_id.as_uuid())
            .bind(key.consumer.as_str())
            .bind(fingerprint_column(key))
            .persistent(self.persistent)
            .execute(self.conn())
            .await
            .map_err(|error| {
                let sqlstate = sqlstate_of(&error);
                layout
                    .claim_failure(sqlstate.as_deref(), &key.message_id, Utc::now())
                    .unwrap_or_else(|| classify(error))
            })?
            .rows_affected();
        self.claims.claimed(key, inserted)
    }

    async fn commit(self) -> Result<(), InboxError> {
        self.end(true).await
    }

    async fn rollback(self) -> Result<(), InboxError> {
        self.end(false).await
    }
}

#[async_trait]
impl BatchTransaction for SqlxTransaction {
    async fn claim_batch(&mut self, keys: &[InboxKey]) -> Result<Vec<Claim>, InboxError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let columns = key_columns(keys);
        let layout = self.layout;
        let statements = Arc::clone(&self.statements);
        let inserted: Vec<(sqlx::types::Uuid, String)> = sqlx::query_as(&statements.claim_batch)
            .bind(columns.ids)
            .bind(columns.consumers)
            .bind(columns.fingerprints)
            .persistent(self.persistent)
            .fetch_all(self.conn())
            .await
            .map_err(|error| {
                let sqlstate = sqlstate_of(&error);
                if layout.batch_claim_refused_a_key(sqlstate.as_deref()) {
                    InboxError::KeyRefusedInBatch {
                        source: Box::new(error),
                    }
                } else {
                    classify(error)
                }
            })?;
        self.claims.claimed_batch(keys, inserted)
    }

    inbox_postgres::savepoint_methods!();

    async fn unclaim(&mut self, key: &InboxKey) -> Result<(), InboxError> {
        self.claims.may_unclaim(key)?;
        let statements = Arc::clone(&self.statements);
        sqlx::query(&statements.unclaim)
            .bind(key.message_id.as_uuid())
            .bind(key.consumer.as_str())
            .persistent(self.persistent)
            .execute(self.conn())
            .await
            .map_err(classify)?;
        self.claims.unclaimed(key);
        Ok(())
    }
}

/// `url` with libpq's meaning of `sslmode=require` beside `sslrootcert`:
/// the chain is checked, as with `verify-ca` (sqlx alone would check
/// nothing), so a URL means the same to `psql`, to this crate and to the
/// diesel backend.
fn libpq_url(url: &str) -> std::borrow::Cow<'_, str> {
    let Some((base, query)) = url.split_once('?') else {
        return url.into();
    };
    let names_a_root = query.split('&').any(|p| p.starts_with("sslrootcert="));
    if !names_a_root || !query.split('&').any(|p| p == "sslmode=require") {
        return url.into();
    }
    let query: Vec<&str> = query
        .split('&')
        .map(|p| {
            if p == "sslmode=require" {
                "sslmode=verify-ca"
            } else {
                p
            }
        })
        .collect();
    format!("{base}?{}", query.join("&")).into()
}

/// `url` ([`libpq_url`]) as sqlx's options, refused when it asks for TLS
/// that this build cannot give: without the crate's `tls` feature sqlx
/// would only say it "was built without TLS support", which does not name
/// the switch to turn on.
fn parse_url(url: &str) -> Result<PgConnectOptions, InboxError> {
    let options: PgConnectOptions = libpq_url(url).parse().map_err(classify)?;
    if !cfg!(feature = "tls")
        && matches!(
            options.get_ssl_mode(),
            sqlx::postgres::PgSslMode::Require
                | sqlx::postgres::PgSslMode::VerifyCa
                | sqlx::postgres::PgSslMode::VerifyFull
        )
    {
        return Err(InboxError::InvalidArgument {
            message: format!(
                "{} asks for TLS, but inbox-backend-sqlx was built without its `tls` feature",
                inbox_api::redact_url(url)
            ),
        });
    }
    Ok(options)
}

#[cfg(test)]
mod tests {

    #[test]
    fn require_with_a_root_certificate_checks_the_chain() {
        assert_eq!(
            libpq_url("postgres://u@h/db?sslmode=require&sslrootcert=/ca.pem&x=1"),
            "postgres://u@h/db?sslmode=verify-ca&sslrootcert=/ca.pem&x=1"
        );
        assert_eq!(
            libpq_url("postgres://u@h/db?sslmode=require"),
            "postgres://u@h/db?sslmode=require"
        );
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn a_url_asking_for_tls_names_the_missing_feature() {
        let error = parse_url("postgres://u:pw@h/db?sslmode=verify-full").expect_err("refused");
        let text = error.to_string();
        assert!(
            text.contains("`tls` feature") && !text.contains("pw@"),
            "{text}"
        );
    }
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
            let message =
                inbox_api::OutgoingMessage::new(key.message_id, "e", "k", "T", []).expect("valid");
            assert_send(&inbox_api::OutboxTransaction::enqueue(tx, &message));
            let limit = std::num::NonZeroU32::MIN;
            let lease = std::time::Duration::from_secs(1);
            assert_send(&inbox_api::OutboxStore::take_pending(store, limit, lease));
            assert_send(&inbox_api::OutboxStore::mark_published(store, &[]));
        }
        let _ = check;
    }

    #[test]
    fn connect_options_validate_the_schema_and_set_search_path() {
        let bad = SqlxStore::connect_options("postgres://u@h/db", "Robert'); DROP TABLE x;--");
        assert!(matches!(bad, Err(InboxError::InvalidArgument { .. })));

        let options =
            SqlxStore::connect_options("postgres://u@h/db", "inbox_a").expect("valid options");
        assert_eq!(
            options.get_options(),
            Some(
                "-c search_path=inbox_a -c lock_timeout=3000 \
                 -c idle_in_transaction_session_timeout=60000 \
                 -c client_connection_check_interval=1000"
            )
        );
        let bare = SqlxStore::connect_options_with(
            "postgres://u@h/db",
            "inbox_a",
            &SessionTimeouts::SERVER_DEFAULTS,
        )
        .expect("valid options");
        assert_eq!(bare.get_options(), Some("-c search_path=inbox_a"));
    }

    #[tokio::test]
    async fn transactions_set_the_bounds_a_pool_does_not_set_at_startup() {
        let url = "postgres://u@localhost/db";
        let plain: PgConnectOptions = url.parse().expect("url");
        let store = SqlxStore::new(PgPoolOptions::new().connect_lazy_with(plain), "inbox")
            .expect("any pool");
        assert_eq!(&*store.begin, SessionTimeouts::default().begin_statement());

        let configured = SessionTimeouts {
            lock_timeout: Some(std::time::Duration::ZERO),
            ..SessionTimeouts::default()
        };
        let options = SqlxStore::connect_options_with(url, "inbox", &configured).expect("options");
        let store = SqlxStore::new(PgPoolOptions::new().connect_lazy_with(options), "inbox")
            .expect("any pool");
        assert_eq!(&*store.begin, "BEGIN", "the startup settings hold");
        let store = store.with_session_timeouts(&SessionTimeouts::SERVER_DEFAULTS);
        assert_eq!(&*store.begin, "BEGIN");
    }

    #[test]
    fn a_bad_url_is_permanent() {
        let err =
            SqlxStore::connect_options("postgres://u@h:notaport/db", "inbox").expect_err("bad url");
        assert!(!err.is_retryable(), "{err:?}");
    }
}
