//! The stores the Parcel service runs on: one file per backend, each behind
//! its cargo feature (`sqlx`, `diesel`, `memory`).
//!
//! [`ParcelStore`] is what the Parcel domain needs beyond the runtime's
//! [`ServiceStore`](inbox_runtime::ServiceStore): its own migration after
//! the inbox's, the effect tables' counts for `stats`, the stub downstreams'
//! ledger and the intents' dispatch marks. Inbox row counts are the
//! backend's own answer ([`InboxStats`]): the inbox table's name and layout
//! belong to the backend, so nothing here reads it.
//!
//! - `sqlx.rs`, `diesel.rs`: the Postgres backends, over the SQL in
//!   `sql.rs` that both send;
//! - `memory.rs`: the in-process backend (nothing outlives the process).

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use inbox_api::{
    AttemptLedger, BatchTransaction, InboxStats, InboxStore, MessageId, OutboxStore, ResponseStore,
    ResponseTransaction,
};

use crate::parcel::effects::{Intent, NotificationKind, ParcelEffects};
use crate::parcel::role::Role;
use inbox_runtime::AppError;

#[cfg(feature = "diesel")]
mod diesel;
#[cfg(feature = "memory")]
mod memory;
#[cfg(any(feature = "sqlx", feature = "diesel"))]
mod sql;
#[cfg(feature = "sqlx")]
mod sqlx;

/// Which store implementation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StoreKind {
    /// PostgreSQL through sqlx.
    Sqlx,
    /// PostgreSQL through diesel-async.
    Diesel,
    /// In-process (nothing survives the process).
    Memory,
}

impl StoreKind {
    /// The stores compiled into this binary, the default first.
    pub fn compiled() -> Vec<Self> {
        let mut kinds = Vec::new();
        if cfg!(feature = "sqlx") {
            kinds.push(Self::Sqlx);
        }
        if cfg!(feature = "diesel") {
            kinds.push(Self::Diesel);
        }
        if cfg!(feature = "memory") {
            kinds.push(Self::Memory);
        }
        kinds
    }

    /// The name used by `--store`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sqlx => "sqlx",
            Self::Diesel => "diesel",
            Self::Memory => "memory",
        }
    }
}

impl fmt::Display for StoreKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for StoreKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let kind = match s {
            "sqlx" => Self::Sqlx,
            "diesel" => Self::Diesel,
            "memory" => Self::Memory,
            other => return Err(format!("unknown store {other:?} (sqlx, diesel, memory)")),
        };
        if Self::compiled().contains(&kind) {
            Ok(kind)
        } else {
            Err(format!(
                "store {kind} is not compiled in; rebuild with `--features {kind}` (compiled: {})",
                Self::compiled()
                    .iter()
                    .map(|k| k.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        }
    }
}

/// Row counts of one effect table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EffectCounts {
    /// Rows.
    pub rows: u64,
    /// Distinct message ids among them.
    pub distinct_messages: u64,
    /// Distinct parcels among them.
    pub distinct_parcels: u64,
}

impl EffectCounts {
    /// Rows beyond one per message: double effects (0 when the inbox works).
    pub fn double_effects(&self) -> u64 {
        self.rows.saturating_sub(self.distinct_messages)
    }
}

/// What `stats` reports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Rows in the `parcels` table (`POST /parcels`).
    pub parcels: u64,
    /// Rows in the inbox table.
    pub inbox_rows: u64,
    /// Inbox rows per consumer.
    pub inbox_per_consumer: BTreeMap<String, u64>,
    /// The notification consumer's effects (`parcel_created` notifications).
    pub notifications: EffectCounts,
    /// The third consumer's effects (`carrier_assigned` notifications).
    pub carrier_assigned_notifications: EffectCounts,
    /// The carrier consumer's effects.
    pub carrier_assignments: EffectCounts,
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "parcels:                   {}", self.parcels)?;
        writeln!(f, "inbox rows:                {}", self.inbox_rows)?;
        for (consumer, rows) in &self.inbox_per_consumer {
            writeln!(f, "  {consumer:<28} {rows}")?;
        }
        for (name, counts) in [
            ("notifications", self.notifications),
            ("carrier_assignments", self.carrier_assignments),
            (
                "carrier_assigned_notifications",
                self.carrier_assigned_notifications,
            ),
        ] {
            writeln!(
                f,
                "{name:<30} rows {} | distinct messages {} | distinct parcels {} | double effects {}",
                counts.rows,
                counts.distinct_messages,
                counts.distinct_parcels,
                counts.double_effects()
            )?;
        }
        Ok(())
    }
}

/// A store the Parcel service can run on: the consumers' inbox, and the
/// producer's outbox (`POST /parcels` enqueues, the relay publishes) and
/// kept responses (`POST /parcels` with an `Idempotency-Key`).
pub trait ParcelStore:
    InboxStore<Transaction: ParcelEffects + BatchTransaction + ResponseTransaction>
    + OutboxStore
    + InboxStats
    + AttemptLedger
    + ResponseStore
    + Clone
{
    /// Which implementation.
    fn kind(&self) -> StoreKind;

    /// Applies the inbox's migrations, then the app's, to the store's
    /// schema. Idempotent.
    fn migrate_all(&self) -> impl Future<Output = Result<(), AppError>> + Send;

    /// Counts the effects of the two consumers of `parcel.created`:
    /// notifications of its kind, then carrier assignments.
    fn effect_counts(
        &self,
    ) -> impl Future<Output = Result<(EffectCounts, EffectCounts), AppError>> + Send;

    /// Counts the `notifications` rows of `kind`.
    fn notification_counts(
        &self,
        kind: NotificationKind,
    ) -> impl Future<Output = Result<EffectCounts, AppError>> + Send;

    /// Counts the `parcels` rows.
    fn parcel_count(&self) -> impl Future<Output = Result<u64, AppError>> + Send;

    /// Counts rows for `stats`: the inbox's per consumer (from the backend,
    /// [`InboxStats`]), and the effects.
    fn stats(&self) -> impl Future<Output = Result<Stats, AppError>> + Send {
        async move {
            let inbox_per_consumer = self.processed_counts().await?;
            let (notifications, carrier_assignments) = self.effect_counts().await?;
            Ok(Stats {
                parcels: self.parcel_count().await?,
                carrier_assigned_notifications: self
                    .notification_counts(NotificationKind::CarrierAssigned)
                    .await?,
                inbox_rows: inbox_per_consumer.values().sum(),
                inbox_per_consumer,
                notifications,
                carrier_assignments,
            })
        }
    }

    /// The partitioned layout's maintenance: creates the missing day
    /// partitions from today (UTC) to `days_ahead` days after it, never a
    /// day before today (a dropped day stays gone, its ids refused), and
    /// returns how many.
    ///
    /// # Errors
    /// [`AppError::Config`] on the memory store (it has no partitions);
    /// the store's (a store of the table layout refuses).
    fn create_partitions(
        &self,
        days_ahead: u16,
    ) -> impl Future<Output = Result<u64, AppError>> + Send {
        let _ = days_ahead;
        async { Err(no_partitions(self.kind())) }
    }

    /// The partitioned layout's cleanup of whole days: drops the day
    /// partitions that ended at or before `cutoff` and returns their rows;
    /// `None` for a store without days (the table layout, the memory
    /// store). The inbox's purge drops them too; `cleanup` calls this first
    /// to report the days apart from the deleted rows.
    ///
    /// # Errors
    /// The store's.
    fn drop_expired_days(
        &self,
        cutoff: chrono::DateTime<chrono::Utc>,
    ) -> impl Future<Output = Result<Option<u64>, AppError>> + Send {
        let _ = cutoff;
        async { Ok(None) }
    }

    /// The partitioned layout's partitions, with their bounds and the
    /// planner's row estimates.
    ///
    /// # Errors
    /// As [`ParcelStore::create_partitions`].
    fn partitions(
        &self,
    ) -> impl Future<Output = Result<Vec<inbox_postgres::Partition>, AppError>> + Send {
        async { Err(no_partitions(self.kind())) }
    }

    /// Drops the store's schema with everything in it (the demo's and the
    /// tests' cleanup).
    fn drop_schema(&self) -> impl Future<Output = Result<(), AppError>> + Send;

    /// Records one call in the stub downstreams' ledger (`stub_ledger`),
    /// outside any inbox transaction; returns the key's call count so far
    /// (1: a new booking or sending, more: deduplicated).
    fn record_stub_call(
        &self,
        downstream: &str,
        idempotency_key: &str,
        parcel_id: &str,
    ) -> impl Future<Output = Result<u64, AppError>> + Send;

    /// Marks `role`'s intent rows of `message_id` dispatched.
    fn mark_dispatched(
        &self,
        role: Role,
        message_id: &MessageId,
    ) -> impl Future<Output = Result<(), AppError>> + Send;

    /// Committed intents not yet dispatched, created longer than `min_age`
    /// ago, oldest first, at most `limit` of each kind.
    fn undispatched(
        &self,
        min_age: Duration,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<Intent>, AppError>> + Send;
}

/// The refusal of partition maintenance by a store without partitions.
fn no_partitions(kind: StoreKind) -> AppError {
    AppError::Config(format!(
        "the {kind} store has no partitions: the partitioned inbox layout is PostgreSQL's"
    ))
}

/// A row count from PostgreSQL (never negative) as a `u64`.
#[cfg(any(feature = "sqlx", feature = "diesel"))]
fn count(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}
