//! Opening the store `--store` picks, with a retry while the database is
//! not up yet, and running a task on it (or on its outbox) whatever its
//! type.

use std::fmt;
use std::future::Future;

use futures::stream::BoxStream;
use inbox_api::OutboxStore;

use crate::parcel::store::{ParcelStore, StoreKind};
use inbox_runtime::AppError;

/// Where the store lives.
#[derive(Clone)]
pub struct StoreConfig {
    /// Which implementation.
    pub kind: StoreKind,
    /// The PostgreSQL URL (may hold a password: log it through
    /// [`inbox_runtime::redact::redact_url`]).
    pub database_url: String,
    /// The schema holding the inbox and the app's tables.
    pub schema: String,
    /// Connections in the pool.
    pub pool_size: u32,
    /// The time bounds each PostgreSQL session sets.
    pub timeouts: inbox_postgres::SessionTimeouts,
    /// The inbox table's layout (the Postgres stores; the memory store
    /// has none): what `migrate` creates in a new schema, and the claim
    /// and cleanup statements the store sends.
    pub layout: inbox_postgres::Layout,
}

impl fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreConfig")
            .field("kind", &self.kind)
            .field(
                "database_url",
                &inbox_runtime::redact::redact_url(&self.database_url),
            )
            .field("schema", &self.schema)
            .field("pool_size", &self.pool_size)
            .field("timeouts", &self.timeouts)
            .field("layout", &self.layout)
            .finish()
    }
}

/// Something to do with a store, whichever implementation `--store` picked.
///
/// (A generic closure cannot be written, hence a trait.)
pub trait WithStore {
    /// What the task returns.
    type Output;

    /// Runs the task.
    fn run<S: ParcelStore>(self, store: S) -> impl Future<Output = Result<Self::Output, AppError>>;
}

/// How long one connection attempt may wait for the server to answer: a
/// server that drops packets (a wrong host, a firewall) fails an attempt
/// after this instead of after the operating system's minutes.
#[cfg(feature = "sqlx")]
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a transaction waits for a pooled connection (the diesel
/// store's default too). Well below the 30 s handle timeout, so that a
/// store outage shows up as a pool timeout (the store circuit pauses
/// consumption) rather than as the message's own timeout; sqlx's default
/// is 30 s.
#[cfg(feature = "sqlx")]
const ACQUIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Connects the configured store, retrying with backoff while the database
/// is unreachable (`attempts` times; `None`: forever), and runs `task` on it.
///
/// One-shot commands pass `Some(1)`: a wrong URL should fail in seconds with
/// its cause, not after minutes of retries. A long-running service passes
/// `None` and waits for its database to come up.
///
/// # Errors
/// The connection's last error, or the task's.
pub async fn with_store<W: WithStore>(
    config: &StoreConfig,
    attempts: Option<u32>,
    task: W,
) -> Result<W::Output, AppError> {
    // Only the Postgres stores connect (and so retry).
    let _ = attempts;
    match config.kind {
        #[cfg(feature = "sqlx")]
        StoreKind::Sqlx => task.run(open_sqlx(config, attempts).await?).await,
        #[cfg(feature = "diesel")]
        StoreKind::Diesel => task.run(open_diesel(config, attempts).await?).await,
        #[cfg(feature = "memory")]
        StoreKind::Memory => task.run(inbox_backend_memory::MemoryStore::new()).await,
        #[allow(
            unreachable_patterns,
            reason = "which arms exist depends on the features"
        )]
        other => Err(AppError::Config(format!(
            "store {other} is not compiled in"
        ))),
    }
}

/// Something to do with the outbox of the store `--store` picks (the
/// relay): it needs the outbox, not the Parcel domain's tables.
pub trait WithOutbox {
    /// What the task returns.
    type Output;

    /// Runs the task; `wakeups` yields when new outgoing messages committed
    /// (PostgreSQL's LISTEN/NOTIFY on the Postgres stores; `None` on the
    /// memory store, or when LISTEN failed, and polling alone must do).
    fn run<S: OutboxStore + Clone + 'static>(
        self,
        store: S,
        wakeups: Option<BoxStream<'static, ()>>,
    ) -> impl Future<Output = Result<Self::Output, AppError>>;
    /// Whether the task wants wake-ups (a LISTEN connection of their own on
    /// the Postgres stores); a one-shot task does not.
    fn listens(&self) -> bool {
        true
    }
}

/// As [`with_store`], for a task on the store's outbox.
///
/// # Errors
/// The connection's last error, or the task's.
pub async fn with_outbox<W: WithOutbox>(
    config: &StoreConfig,
    attempts: Option<u32>,
    task: W,
) -> Result<W::Output, AppError> {
    let _ = attempts;
    match config.kind {
        #[cfg(feature = "sqlx")]
        StoreKind::Sqlx => {
            let store = open_sqlx(config, attempts).await?;
            let wakeups = match task.listens() {
                true => inbox_runtime::wakeups::sqlx_wakeups(&store).await,
                false => None,
            };
            task.run(store, wakeups).await
        }
        #[cfg(feature = "diesel")]
        StoreKind::Diesel => {
            let store = open_diesel(config, attempts).await?;
            let wakeups = match task.listens() {
                true => {
                    inbox_runtime::wakeups::diesel_wakeups(&config.database_url, store.schema())
                        .await
                }
                false => None,
            };
            task.run(store, wakeups).await
        }
        #[cfg(feature = "memory")]
        StoreKind::Memory => {
            task.run(inbox_backend_memory::MemoryStore::new(), None)
                .await
        }
        #[allow(
            unreachable_patterns,
            reason = "which arms exist depends on the features"
        )]
        other => Err(AppError::Config(format!(
            "store {other} is not compiled in"
        ))),
    }
}

#[cfg(feature = "sqlx")]
async fn open_sqlx(
    config: &StoreConfig,
    attempts: Option<u32>,
) -> Result<inbox_backend_sqlx::SqlxStore, AppError> {
    retry_connect(config, attempts, || async {
        use inbox_backend_sqlx::{SqlxStore, classify};
        use sqlx::{ConnectOptions as _, Connection as _};
        let options = SqlxStore::connect_options_with(
            &config.database_url,
            &config.schema,
            &config.timeouts,
        )?;
        // sqlx's pool takes "connection refused" for a server still
        // starting: it retries silently until its acquire timeout (30 s)
        // and then reports only "pool timed out". One direct connection
        // first fails at once with the real cause.
        let probe = tokio::time::timeout(CONNECT_TIMEOUT, options.connect())
            .await
            .map_err(|_| inbox_api::InboxError::Connection {
                source: Box::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer within {CONNECT_TIMEOUT:?}"),
                )),
            })?
            .map_err(classify)?;
        let closed =
            inbox_runtime::shutdown::bounded("close the probe connection", probe.close()).await;
        if let Some(Err(error)) = closed {
            tracing::debug!(error = %error, "closing the probe connection failed");
        }
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(config.pool_size.max(1))
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(options)
            .await
            .map_err(classify)?;
        Ok(SqlxStore::new(pool, &config.schema)?.with_layout(config.layout))
    })
    .await
}

#[cfg(feature = "diesel")]
async fn open_diesel(
    config: &StoreConfig,
    attempts: Option<u32>,
) -> Result<inbox_backend_diesel::DieselStore, AppError> {
    let pool_size = usize::try_from(config.pool_size).unwrap_or(10);
    retry_connect(config, attempts, || async {
        inbox_backend_diesel::DieselStore::builder(config.database_url.as_str(), &config.schema)?
            .pool_size(pool_size)
            .session_timeouts(config.timeouts)
            .layout(config.layout)
            .connect()
            .await
    })
    .await
}

#[cfg(any(feature = "sqlx", feature = "diesel"))]
async fn retry_connect<S, F, Fut>(
    config: &StoreConfig,
    attempts: Option<u32>,
    mut connect: F,
) -> Result<S, AppError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<S, inbox_api::InboxError>>,
{
    let url = inbox_runtime::redact::redact_url(&config.database_url);
    let mut attempt = 0;
    loop {
        match connect().await {
            Ok(store) => return Ok(store),
            Err(error) if error.is_retryable() => {
                attempt += 1;
                if attempts.is_some_and(|max| attempt >= max) {
                    let after = if attempt == 1 {
                        String::new()
                    } else {
                        format!(" after {attempt} attempts")
                    };
                    return Err(AppError::Unavailable(format!(
                        "PostgreSQL at {url} unreachable{after}: {}",
                        inbox_runtime::error::chain(&error)
                    )));
                }
                let delay = inbox_runtime::backoff::RECONNECT.delay(attempt);
                tracing::warn!(%url, store = %config.kind, attempt, ?delay,
                    error = %inbox_runtime::error::chain(&error), "PostgreSQL unreachable; retrying");
                tokio::time::sleep(delay).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}
