//! The store: a deadpool pool of `AsyncPgConnection`s bound to one schema.

use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use deadpool::Runtime;
use deadpool::managed::{Object, Timeouts};
use diesel::connection::{CacheSize, TransactionDepthChange};
use diesel::sql_types::{BigInt, Bytea, Nullable, Text, Timestamptz, Uuid};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod,
};
use diesel_async::{
    AnsiTransactionManager, AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
    TransactionManager,
};
use inbox_api::{
    Claim, FirstStep, InboxError, InboxKey, InboxRecord, InboxStats, InboxStore, PurgedBatch,
};
use inbox_postgres::{Layout, Pooling, SessionTimeouts, Statements, sql};

use crate::error::{classify, classify_pool};
use crate::migrate::Migrating;
use crate::transaction::{Pooled, refine};
use crate::{DieselTransaction, SchemaName};

/// The pool type the store runs on.
pub type DieselPool = Pool<AsyncPgConnection>;

/// A connection checked out of a [`DieselPool`].
pub type PooledConnection = Object<AsyncDieselConnectionManager<AsyncPgConnection>>;

/// An [`InboxStore`] on PostgreSQL through diesel-async.
///
/// Cloning is cheap and shares the pool. The store's statements name its
/// schema ([`Statements`]) and every transaction sets the store's
/// [`SessionTimeouts`] with `SET LOCAL` right after `BEGIN`, so it works
/// on any pool: the one [`DieselStore::builder`] builds, or the
/// application's own ([`DieselStore::from_pool`]). The builder's pool also
/// sets `search_path` to the schema on each connection, so the unqualified
/// names of [`crate::schema`] and the consumer's tables in that schema
/// resolve there; on an application's pool, its own `search_path` rules.
#[derive(Clone)]
pub struct DieselStore {
    pool: DieselPool,
    schema: SchemaName,
    layout: Layout,
    /// The statements with the schema qualified, for this layout.
    statements: Arc<Statements>,
    /// `SET LOCAL` of the bounds, appended to every `BEGIN`.
    set_local: Arc<str>,
    pooling: Pooling,
}

impl fmt::Debug for DieselStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = self.pool.status();
        f.debug_struct("DieselStore")
            .field("schema", &self.schema)
            .field("pool_max_size", &status.max_size)
            .field("pool_size", &status.size)
            .field("pool_available", &status.available)
            .finish()
    }
}

/// Opens one connection as diesel-async's `establish` does, keeping
/// the cause of a failed connect: diesel-async reduces tokio-postgres'
/// error to its top line ("error connecting to server"), which drops the
/// "Connection refused" or "timed out" an operator needs to fix a URL. An
/// error the server sent (starting up, no such database, authentication)
/// keeps its message, which [`crate::classify`] reads as diesel-async's own
/// mapping would have given it.
async fn establish(url: &str) -> diesel::ConnectionResult<AsyncPgConnection> {
    match connect(url).await? {
        Ok((client, connection)) => {
            AsyncPgConnection::try_from_client_and_connection(client, connection).await
        }
        Err(error) => Err(connect_error(&error)),
    }
}

/// Connects through [`crate::tls::Target`] (libpq's `sslmode` and
/// certificate files); an unusable URL is a connection error naming what
/// is wrong, with the URL's password hidden.
async fn connect(
    url: &str,
) -> diesel::ConnectionResult<
    Result<
        (
            tokio_postgres::Client,
            tokio_postgres::Connection<tokio_postgres::Socket, crate::tls::Stream>,
        ),
        tokio_postgres::Error,
    >,
> {
    let target = crate::tls::Target::parse(url).map_err(|why| {
        diesel::ConnectionError::InvalidConnectionUrl(format!(
            "{}: {why}",
            inbox_api::redact_url(url)
        ))
    })?;
    Ok(target.connect().await)
}

/// How [`connect_error`] marks a refused login in the text diesel keeps
/// (diesel's connection error has no SQLSTATE), for
/// [`DieselStoreBuilder::connect`] to report it as one.
const LOGIN_REFUSED: &str = "login refused: ";

/// Whether any error of `error`'s chain says `text`.
fn chain_contains(error: &(dyn std::error::Error + 'static), text: &str) -> bool {
    let mut cause = Some(error);
    while let Some(inner) = cause {
        if inner.to_string().contains(text) {
            return true;
        }
        cause = inner.source();
    }
    false
}

/// A failed connect as [`establish`] reports it.
fn connect_error(error: &tokio_postgres::Error) -> diesel::ConnectionError {
    {
        match error.as_db_error() {
            Some(server) => diesel::ConnectionError::CouldntSetupConfiguration(
                diesel::result::Error::DatabaseError(
                    diesel::result::DatabaseErrorKind::Unknown,
                    Box::new(if inbox_postgres::is_login_refused(server.code().code()) {
                        format!("{LOGIN_REFUSED}{}", server.message())
                    } else {
                        server.message().to_owned()
                    }),
                ),
            ),
            None => {
                let mut text = error.to_string();
                let mut source = std::error::Error::source(error);
                while let Some(cause) = source {
                    text.push_str(&format!(": {cause}"));
                    source = cause.source();
                }
                diesel::ConnectionError::BadConnection(text)
            }
        }
    }
}

/// Opens one connection ([`establish`]) for a pool that reaches PostgreSQL
/// as `pooling` says. diesel-async's connection setup sends two statements
/// (`SET TIME ZONE`, `SET CLIENT_ENCODING`) as prepared statements outside
/// any transaction: through a transaction-mode pooler, a statement's parse
/// and its execution may then reach two different server sessions
/// ("prepared statement … does not exist", seen in one test run in ten).
/// So behind such a pooler the setup runs inside a transaction, which
/// keeps one server session for it; its `SET`s (not `LOCAL`) outlive the
/// COMMIT, and PgBouncer, which tracks both parameters, carries them to
/// whichever server session serves the client next.
async fn establish_for(url: &str, pooling: Pooling) -> diesel::ConnectionResult<AsyncPgConnection> {
    if pooling == Pooling::Session {
        return establish(url).await;
    }
    let (client, mut connection) = connect(url).await?.map_err(|error| connect_error(&error))?;
    {
        // The connection is not driven yet (diesel-async spawns it below):
        // drive it here until BEGIN is answered.
        let begin = client.batch_execute("BEGIN");
        futures::pin_mut!(begin);
        match futures::future::select(begin, &mut connection).await {
            futures::future::Either::Left((Ok(()), _)) => {}
            futures::future::Either::Left((Err(error), _)) => return Err(connect_error(&error)),
            futures::future::Either::Right((ended, _)) => {
                return Err(diesel::ConnectionError::BadConnection(format!(
                    "the connection ended during its setup: {ended:?}"
                )));
            }
        }
    }
    let mut conn = AsyncPgConnection::try_from_client_and_connection(client, connection).await?;
    conn.batch_execute("COMMIT")
        .await
        .map_err(diesel::ConnectionError::CouldntSetupConfiguration)?;
    Ok(conn)
}

/// Settings of a [`DieselStore`]; start from [`DieselStore::builder`].
#[must_use]
pub struct DieselStoreBuilder {
    url: String,
    schema: SchemaName,
    pool_size: usize,
    wait_timeout: Duration,
    connect_timeout: Duration,
    verify_on_checkout: bool,
    timeouts: SessionTimeouts,
    layout: Layout,
    pooling: Pooling,
}

impl fmt::Debug for DieselStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL may carry a password.
        f.debug_struct("DieselStoreBuilder")
            .field("schema", &self.schema)
            .field("pool_size", &self.pool_size)
            .field("wait_timeout", &self.wait_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("verify_on_checkout", &self.verify_on_checkout)
            .field("timeouts", &self.timeouts)
            .finish_non_exhaustive()
    }
}

impl DieselStoreBuilder {
    /// The inbox table's layout (default [`Layout::Table`]):
    /// [`DieselStore::migrate`] creates it in a new schema and refuses a
    /// schema with the other one; the claims and the cleanup follow it.
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// How many connections the pool holds at most (default 10). Every open
    /// inbox transaction holds one for its whole duration.
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size;
        self
    }

    /// How long [`InboxStore::begin`] waits for a free connection before
    /// failing with the retryable [`InboxError::PoolTimeout`] (default 5 s).
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// How long opening one connection may take (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Whether a pooled connection is pinged (`SELECT 1`) before each use
    /// (default `false`).
    ///
    /// Off by default because it costs a round trip per transaction: a
    /// connection the server closed is noticed without it (the driver's
    /// background task sees the socket close and the pool drops it), and the
    /// rare one that died unnoticed fails `BEGIN`, which [`InboxStore::begin`]
    /// retries on another connection.
    pub fn verify_on_checkout(mut self, verify: bool) -> Self {
        self.verify_on_checkout = verify;
        self
    }

    /// The time bounds every connection sets on its session when it opens
    /// (default [`SessionTimeouts::default`]): a claim waits at most
    /// `lock_timeout` on another transaction's lock, and the server ends a
    /// session idle inside a transaction for `idle_in_transaction`, so a
    /// frozen holder cannot block a key for longer.
    pub fn session_timeouts(mut self, timeouts: SessionTimeouts) -> Self {
        self.timeouts = timeouts;
        self
    }

    /// How the pool reaches PostgreSQL (default [`Pooling::Session`]).
    /// With [`Pooling::Transaction`] (PgBouncer in transaction mode) the
    /// connections set nothing at connect time (a session `SET` through
    /// such a pooler would land on whichever server session serves it and
    /// stay there for the next client) and keep no prepared statement; see
    /// [`DieselStore::with_pooling`].
    pub fn pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// Builds the store without connecting (connections open on demand).
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] for a zero pool size.
    pub fn build(self) -> Result<DieselStore, InboxError> {
        if self.pool_size == 0 {
            return Err(InboxError::InvalidArgument {
                message: "pool size must be at least 1".into(),
            });
        }
        let mut config = ManagerConfig::<AsyncPgConnection>::default();
        config.recycling_method = if self.verify_on_checkout {
            RecyclingMethod::Verified
        } else {
            RecyclingMethod::Fast
        };
        // The connection's whole setup, one round trip: the schema (for
        // `crate::schema` and the consumer's tables), then the session's
        // time bounds (every transaction sets them again, but a statement
        // outside one has them too). None behind a transaction-mode pooler.
        let setup = match self.pooling {
            Pooling::Session => format!(
                "SET search_path TO {}; {}",
                self.schema.quoted(),
                self.timeouts.set_statements()
            ),
            Pooling::Transaction => String::new(),
        };
        let pooling = self.pooling;
        config.custom_setup = Box::new(move |url| {
            let setup = setup.clone();
            Box::pin(async move {
                let mut conn = establish_for(url, pooling).await?;
                if !setup.is_empty() {
                    conn.batch_execute(&setup)
                        .await
                        .map_err(diesel::ConnectionError::CouldntSetupConfiguration)?;
                }
                Ok(conn)
            })
        });
        let manager = AsyncDieselConnectionManager::new_with_config(self.url, config);
        let pool = Pool::builder(manager)
            .max_size(self.pool_size)
            .timeouts(Timeouts {
                wait: Some(self.wait_timeout),
                create: Some(self.connect_timeout),
                recycle: Some(self.connect_timeout),
            })
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| InboxError::InvalidArgument {
                message: format!("cannot build the connection pool: {e}"),
            })?;
        Ok(DieselStore::from_pool_in(pool, self.schema)
            .with_layout(self.layout)
            .with_session_timeouts(&self.timeouts)
            .with_pooling(self.pooling))
    }

    /// Builds the store and opens one connection, so that a wrong URL fails
    /// here rather than on the first message.
    ///
    /// # Errors
    /// As [`DieselStoreBuilder::build`]; [`InboxError::Connection`] or
    /// [`InboxError::PoolTimeout`] when the database cannot be reached.
    pub async fn connect(self) -> Result<DieselStore, InboxError> {
        let url = self.url.clone();
        let store = self.build()?;
        let mut conn = store.pool.get().await.map_err(|error| {
            let error = classify_pool(error);
            let refused = chain_contains(&error, LOGIN_REFUSED);
            inbox_postgres::connect_failed(&url, refused, error)
        })?;
        warn_unless_english_messages(&mut conn).await;
        Ok(store)
    }
}

/// Error classification reads PostgreSQL's message text where diesel drops
/// the SQLSTATE (see [`crate::classify`]); say so once if that cannot work.
async fn warn_unless_english_messages(conn: &mut AsyncPgConnection) {
    let setting = diesel::select(diesel::dsl::sql::<diesel::sql_types::Text>(
        "current_setting('lc_messages')",
    ))
    .get_result::<String>(conn)
    .await;
    match setting {
        Ok(locale)
            if locale.is_empty()
                || locale.starts_with('C')
                || locale.starts_with("POSIX")
                || locale.starts_with("en") => {}
        Ok(locale) => tracing::warn!(lc_messages = %locale,
            "server messages are not in English: deadlocks, lock timeouts and missing tables \
             will be classified as permanent store errors instead of retryable conflicts / schema errors"),
        Err(error) => tracing::debug!(error = %error, "cannot read lc_messages"),
    }
}

impl DieselStore {
    /// Starts configuring a store on the database at `url`, keeping its
    /// tables in `schema`.
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] when `schema` is not a plain
    /// identifier (see [`SchemaName`]).
    pub fn builder(url: impl Into<String>, schema: &str) -> Result<DieselStoreBuilder, InboxError> {
        Ok(DieselStoreBuilder {
            url: url.into(),
            schema: SchemaName::new(schema)?,
            pool_size: 10,
            wait_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            verify_on_checkout: false,
            timeouts: SessionTimeouts::default(),
            layout: Layout::Table,
            pooling: Pooling::Session,
        })
    }

    /// A store on the application's own pool, keeping its tables in
    /// `schema`. The pool's connections need no setting: the store's
    /// statements name `schema` (so the application's unqualified tables
    /// keep resolving through its own `search_path`), and every inbox
    /// transaction sets the default [`SessionTimeouts`] with `SET LOCAL`
    /// after `BEGIN` ([`DieselStore::with_session_timeouts`] tunes them).
    /// Behind PgBouncer in transaction mode add
    /// [`DieselStore::with_pooling`]. Run [`DieselStore::migrate`] first.
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] when `schema` is not a plain
    /// identifier (see [`SchemaName`]).
    pub fn from_pool(pool: DieselPool, schema: &str) -> Result<Self, InboxError> {
        Ok(Self::from_pool_in(pool, SchemaName::new(schema)?))
    }

    fn from_pool_in(pool: DieselPool, schema: SchemaName) -> Self {
        let layout = Layout::Table;
        Self {
            pool,
            statements: Arc::new(Statements::new(&schema, layout)),
            schema,
            layout,
            set_local: SessionTimeouts::default().set_local_statements().into(),
            pooling: Pooling::Session,
        }
    }

    /// The same store with the inbox table laid out as `layout` (default
    /// [`Layout::Table`]), as [`DieselStoreBuilder::layout`].
    #[must_use]
    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self.statements = Arc::new(Statements::new(&self.schema, layout));
        self
    }

    /// The same store with its transactions under `timeouts`: each `BEGIN`
    /// is followed by their `SET LOCAL` in the same round trip, so they
    /// hold on any pool and through PgBouncer, and end with the
    /// transaction. [`SessionTimeouts::SERVER_DEFAULTS`] sends a bare
    /// `BEGIN`.
    #[must_use]
    pub fn with_session_timeouts(mut self, timeouts: &SessionTimeouts) -> Self {
        self.set_local = timeouts.set_local_statements().into();
        self
    }

    /// The same store for a pool that reaches PostgreSQL as `pooling` says
    /// (default [`Pooling::Session`]). With [`Pooling::Transaction`]
    /// (PgBouncer in transaction mode) the store turns each checked-out
    /// connection's statement cache off (a statement prepared on one server
    /// session is missing on the next), and runs each statement outside
    /// the consumer's transactions in a transaction of its own
    /// (diesel-async prepares and executes in two exchanges, which the
    /// pooler could hand to two server sessions). LISTEN needs a session:
    /// give [`crate::OutboxListener::connect`] a direct URL.
    #[must_use]
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// How the store's pool reaches PostgreSQL.
    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// A pool manager's configuration for an application's own pool that
    /// reaches PostgreSQL as `pooling` says, for
    /// [`AsyncDieselConnectionManager::new_with_config`]: no ping on
    /// checkout ([`RecyclingMethod::Fast`]: a ping is a prepared statement
    /// outside a transaction, which a transaction-mode pooler may split
    /// across server sessions) and a connection setup that survives such a
    /// split (see the crate's docs on PgBouncer). A pool behind PgBouncer
    /// in transaction mode needs it; a direct pool may use it.
    pub fn manager_config(pooling: Pooling) -> ManagerConfig<AsyncPgConnection> {
        let mut config = ManagerConfig::<AsyncPgConnection>::default();
        config.recycling_method = RecyclingMethod::Fast;
        config.custom_setup = Box::new(move |url| Box::pin(establish_for(url, pooling)));
        config
    }

    /// A store on `url` in `schema` with at most `pool_size` connections,
    /// checked by opening one connection.
    ///
    /// # Errors
    /// As [`DieselStore::builder`] and [`DieselStoreBuilder::connect`].
    pub async fn connect(url: &str, schema: &str, pool_size: usize) -> Result<Self, InboxError> {
        Self::builder(url, schema)?
            .pool_size(pool_size)
            .connect()
            .await
    }

    /// The pool, for the application's own queries outside the inbox.
    pub fn pool(&self) -> &DieselPool {
        &self.pool
    }

    /// The schema the store's connections use.
    pub fn schema(&self) -> &SchemaName {
        &self.schema
    }

    /// Creates the schema if needed and applies the pending migrations of
    /// `inbox-postgres` (recorded in the ledger the sqlx backend uses too),
    /// in one transaction, serialised against other instances migrating at
    /// once. Returns the versions applied (empty when up to date).
    ///
    /// # Errors
    /// [`InboxError::Schema`] when an applied migration's file changed;
    /// store errors otherwise.
    pub async fn migrate(&self) -> Result<Vec<i64>, InboxError> {
        let conn = self.pool.get().await.map_err(classify_pool)?;
        // A connection of its own, closed afterwards: an interrupted
        // migration then cannot leave a pooled connection mid-transaction.
        let mut conn = Object::take(conn);
        inbox_postgres::migrate_with_layout(&mut Migrating(&mut conn), &self.schema, self.layout)
            .await
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
        let mut conn = self.pool.get().await.map_err(classify_pool)?;
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
        let mut conn = self.pool.get().await.map_err(classify_pool)?;
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
    /// As [`inbox_postgres::create_partitions`].
    pub async fn create_partitions(
        &self,
        days_behind: u16,
        days_ahead: u16,
    ) -> Result<u64, InboxError> {
        let mut conn = self.pool.get().await.map_err(classify_pool)?;
        let mut m = Migrating(&mut conn);
        inbox_postgres::require_session_schema(&mut m, &self.schema).await?;
        inbox_postgres::create_partitions(&mut m, self.layout, days_behind, days_ahead).await
    }

    /// One batch of a cleanup `statement` (`$1` cutoff, `$2` limit): the
    /// outbox's and the attempt ledger's, each on a pooled connection in a
    /// transaction of its own (the inbox's resumes where the batch before
    /// it stopped: [`sql::PURGE_BATCH`]). Returns the rows deleted.
    pub(crate) async fn purge_batch(
        &self,
        statement: &str,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
        table: &'static str,
    ) -> Result<u64, InboxError> {
        let mut conn = self.checkout().await?;
        let deleted = diesel::sql_query(statement)
            .bind::<Timestamptz, _>(cutoff)
            .bind::<BigInt, _>(i64::from(limit.get()))
            .execute(&mut *conn)
            .await;
        let deleted = conn.finish(deleted).await;
        match deleted {
            Ok(n) => {
                tracing::debug!(table, deleted = n, %cutoff, limit, "purge batch");
                Ok(u64::try_from(n).unwrap_or(u64::MAX))
            }
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }

    /// `BEGIN` and the bounds' `SET LOCAL`, one simple query.
    pub(crate) fn begin_text(&self) -> String {
        if self.set_local.is_empty() {
            "BEGIN".to_owned()
        } else {
            format!("BEGIN; {}", self.set_local)
        }
    }

    /// [`sql::BEGIN_PIPELINED`] and the bounds' `SET LOCAL`, one simple
    /// query.
    pub(crate) fn begin_pipelined_text(&self) -> String {
        if self.set_local.is_empty() {
            sql::BEGIN_PIPELINED.to_owned()
        } else {
            format!("{}; {}", sql::BEGIN_PIPELINED, self.set_local)
        }
    }

    /// The store's statements.
    pub(crate) fn statements(&self) -> &Arc<Statements> {
        &self.statements
    }

    /// A pooled connection, fit for this store's pooling: with
    /// [`Pooling::Transaction`] its statement cache is off.
    pub(crate) async fn connection(&self) -> Result<Pooled, InboxError> {
        let mut conn = self.pool.get().await.map_err(classify_pool)?;
        if self.pooling == Pooling::Transaction {
            conn.set_prepared_statement_cache_size(CacheSize::Disabled);
        }
        Ok(conn)
    }

    /// A connection for one statement outside the consumer's transactions:
    /// see [`Checkout`].
    pub(crate) async fn checkout(&self) -> Result<Checkout, InboxError> {
        let mut conn = self.connection().await?;
        let open = self.pooling == Pooling::Transaction;
        if open && let Err(error) = conn.batch_execute(&self.begin_text()).await {
            drop(Object::take(conn));
            return Err(classify(error));
        }
        Ok(Checkout {
            conn: Some(conn),
            open,
        })
    }

    /// Checks out a connection and runs `BEGIN` with the bounds, retrying
    /// on another connection when a pooled one turns out to be dead (BEGIN
    /// has no effect, so retrying it is always safe).
    async fn begin_on_fresh_connection(&self) -> Result<Pooled, InboxError> {
        const ATTEMPTS: usize = 3;
        let mut attempt = 0;
        let begin = self.begin_text();
        loop {
            attempt += 1;
            let mut conn = self.connection().await?;
            match begin_with(&mut conn, &begin).await {
                Ok(()) => return Ok(conn),
                Err(error) => {
                    let error = classify(error);
                    drop(Object::take(conn));
                    if attempt >= ATTEMPTS || !matches!(error, InboxError::Connection { .. }) {
                        return Err(error);
                    }
                    tracing::debug!(error = %error, attempt, "BEGIN on a dead pooled connection; retrying");
                }
            }
        }
    }
}

/// Sends `begin` (a `BEGIN` and more, one simple query) around diesel's
/// transaction manager, then tells the manager, so that commit, rollback
/// and the work's nested transactions see depth 1.
pub(crate) async fn begin_with(
    conn: &mut AsyncPgConnection,
    begin: &str,
) -> diesel::QueryResult<()> {
    conn.batch_execute(begin).await?;
    AnsiTransactionManager::transaction_manager_status_mut(conn)
        .transaction_state()
        .and_then(|state| state.change_transaction_depth(TransactionDepthChange::IncreaseDepth))
}

/// A pooled connection for one statement outside the consumer's
/// transactions. With [`Pooling::Transaction`] the statement runs in a
/// transaction of its own, committed by [`Checkout::finish`]; a checkout
/// dropped with that transaction open (an error, a cancelled future)
/// closes its connection rather than hand it back mid-transaction.
pub(crate) struct Checkout {
    conn: Option<Pooled>,
    open: bool,
}

impl Checkout {
    /// `result`, after committing the statement's own transaction when it
    /// succeeded (a failed COMMIT is the result then).
    pub(crate) async fn finish<T>(
        &mut self,
        result: diesel::QueryResult<T>,
    ) -> diesel::QueryResult<T> {
        let value = result?;
        if self.open {
            self.batch_execute("COMMIT").await?;
            self.open = false;
        }
        Ok(value)
    }

    /// Closes the connection instead of returning it to the pool.
    pub(crate) fn discard(mut self) {
        if let Some(conn) = self.conn.take() {
            drop(Object::take(conn));
        }
    }
}

impl std::ops::Deref for Checkout {
    type Target = AsyncPgConnection;

    fn deref(&self) -> &AsyncPgConnection {
        match &self.conn {
            Some(conn) => conn,
            None => unreachable!("a checkout is used only while it holds its connection"),
        }
    }
}

impl std::ops::DerefMut for Checkout {
    fn deref_mut(&mut self) -> &mut AsyncPgConnection {
        match &mut self.conn {
            Some(conn) => conn,
            None => unreachable!("a checkout is used only while it holds its connection"),
        }
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if self.open
            && let Some(conn) = self.conn.take()
        {
            drop(Object::take(conn));
        }
    }
}

#[async_trait]
impl InboxStore for DieselStore {
    type Transaction = DieselTransaction;

    async fn begin(&self) -> Result<DieselTransaction, InboxError> {
        Ok(DieselTransaction::new(
            self.begin_on_fresh_connection().await?,
            self.layout,
            Arc::clone(&self.statements),
        ))
    }

    /// BEGIN and the claim pipelined in one round trip
    /// (the transaction's `begin_claim`); retried on another connection
    /// when a pooled one turns out to be dead at BEGIN, as
    /// [`InboxStore::begin`] is (the claim wrote nothing then).
    async fn begin_claim(
        &self,
        key: &InboxKey,
    ) -> Result<(DieselTransaction, Claim), (FirstStep, InboxError)> {
        const ATTEMPTS: usize = 3;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let conn = self
                .connection()
                .await
                .map_err(|error| (FirstStep::Begin, error))?;
            let begin = self.begin_pipelined_text();
            let statements = Arc::clone(&self.statements);
            match DieselTransaction::begin_claim(conn, self.layout, statements, &begin, key).await {
                Err((FirstStep::Begin, error @ InboxError::Connection { .. }))
                    if attempt < ATTEMPTS =>
                {
                    tracing::debug!(error = %error, attempt, "BEGIN on a dead pooled connection; retrying");
                }
                outcome => return outcome,
            }
        }
    }

    async fn lookup(&self, key: &InboxKey) -> Result<Option<InboxRecord>, InboxError> {
        // A read: safe to repeat once on another connection when the pooled
        // one turns out to be dead.
        let mut retried = false;
        loop {
            let mut conn = self.checkout().await?;
            let row = diesel::sql_query(&self.statements.lookup)
                .bind::<Uuid, _>(key.message_id.as_uuid())
                .bind::<Text, _>(key.consumer.as_str())
                .get_result::<Times>(&mut *conn)
                .await
                .optional();
            let row = conn.finish(row).await;
            match row {
                Ok(row) => {
                    return row
                        .map(|times| {
                            Ok(InboxRecord {
                                key: InboxKey::new(key.message_id, key.consumer.clone()),
                                received_at: times.received_at,
                                processed_at: times.processed_at,
                                fingerprint: inbox_postgres::stored_fingerprint(
                                    times.payload_fingerprint,
                                )?,
                            })
                        })
                        .transpose();
                }
                Err(error) => {
                    let error = refine(&mut conn, error).await;
                    if retried || !matches!(error, InboxError::Connection { .. }) {
                        return Err(error);
                    }
                    conn.discard();
                    retried = true;
                }
            }
        }
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

    /// One statement, its own transaction: `inbox-postgres`'s
    /// [`sql::PURGE_BATCH`].
    async fn purge_processed_batch_from(
        &self,
        cutoff: DateTime<Utc>,
        from: Option<DateTime<Utc>>,
        limit: NonZeroU32,
    ) -> Result<PurgedBatch, InboxError> {
        // The partitioned layout drops its expired days whole first, then
        // deletes the untimed partition's rows in the usual batch.
        let dropped = match self.layout {
            Layout::Table => 0,
            Layout::Partitioned => {
                let mut conn = self.pool.get().await.map_err(classify_pool)?;
                {
                    let mut m = Migrating(&mut conn);
                    inbox_postgres::require_session_schema(&mut m, &self.schema).await?;
                    inbox_postgres::drop_expired_partitions(&mut m, cutoff).await?
                }
            }
        };
        let mut conn = self.checkout().await?;
        let batch = diesel::sql_query(&self.statements.purge_batch)
            .bind::<Timestamptz, _>(cutoff)
            .bind::<Nullable<Timestamptz>, _>(from)
            .bind::<BigInt, _>(i64::from(limit.get()))
            .get_result::<Purged>(&mut *conn)
            .await;
        let batch = conn.finish(batch).await;
        match batch {
            Ok(batch) => {
                tracing::debug!(deleted = batch.deleted, %cutoff, ?from, limit, "inbox purge batch");
                Ok(PurgedBatch::new(
                    dropped + u64::try_from(batch.deleted).unwrap_or(0),
                    batch.last,
                ))
            }
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }
}

#[async_trait]
impl InboxStats for DieselStore {
    async fn processed_counts(&self) -> Result<BTreeMap<String, u64>, InboxError> {
        let mut conn = self.checkout().await?;
        let rows = diesel::sql_query(&self.statements.processed_counts)
            .load::<ConsumerCount>(&mut *conn)
            .await;
        let rows = conn.finish(rows).await;
        match rows {
            Ok(rows) => Ok(rows
                .into_iter()
                .map(|row| (row.consumer_type, u64::try_from(row.count).unwrap_or(0)))
                .collect()),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }
}

/// The columns [`sql::PROCESSED_COUNTS`] returns.
#[derive(QueryableByName)]
struct ConsumerCount {
    #[diesel(sql_type = Text)]
    consumer_type: String,
    #[diesel(sql_type = BigInt)]
    count: i64,
}

/// The row [`sql::PURGE_BATCH`] returns.
#[derive(QueryableByName)]
struct Purged {
    #[diesel(sql_type = BigInt)]
    deleted: i64,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    last: Option<DateTime<Utc>>,
}

/// The columns [`sql::LOOKUP`] returns.
#[derive(QueryableByName)]
struct Times {
    #[diesel(sql_type = Timestamptz)]
    received_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    processed_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Bytea>)]
    payload_fingerprint: Option<Vec<u8>>,
}
