//! The stores the app runs on, chosen by cargo feature and `--store`.
//!
//! [`ParcelStore`] is what the app needs beyond [`InboxStore`]: applying its
//! own migration after the inbox's, counting rows for `stats`, the demo and
//! the `inbox_rows` gauge. Each backend implements it behind its feature.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::str::FromStr;

use std::time::Duration;

use inbox_api::{BatchTransaction, InboxStore, MessageId};

use crate::AppError;
use crate::consumers::Role;
use crate::dispatch::Intent;
use crate::effects::ParcelEffects;

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
    /// Rows in the inbox table.
    pub inbox_rows: u64,
    /// Inbox rows per consumer.
    pub inbox_per_consumer: BTreeMap<String, u64>,
    /// The notification consumer's effects.
    pub notifications: EffectCounts,
    /// The carrier consumer's effects.
    pub carrier_assignments: EffectCounts,
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "inbox rows:                {}", self.inbox_rows)?;
        for (consumer, rows) in &self.inbox_per_consumer {
            writeln!(f, "  {consumer:<28} {rows}")?;
        }
        for (name, counts) in [
            ("notifications", self.notifications),
            ("carrier_assignments", self.carrier_assignments),
        ] {
            writeln!(
                f,
                "{name:<26} rows {} | distinct messages {} | distinct parcels {} | double effects {}",
                counts.rows,
                counts.distinct_messages,
                counts.distinct_parcels,
                counts.double_effects()
            )?;
        }
        Ok(())
    }
}

/// An inbox store the app can run on.
pub trait ParcelStore: InboxStore<Transaction: ParcelEffects + BatchTransaction> + Clone {
    /// Which implementation.
    fn kind(&self) -> StoreKind;

    /// Applies the inbox's migrations, then the app's, to the store's
    /// schema. Idempotent.
    fn migrate_all(&self) -> impl Future<Output = Result<(), AppError>> + Send;

    /// Counts rows for `stats`.
    fn stats(&self) -> impl Future<Output = Result<Stats, AppError>> + Send;

    /// Rows in the inbox table (the `inbox_rows` gauge).
    fn inbox_rows(&self) -> impl Future<Output = Result<u64, AppError>> + Send;

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

#[cfg(any(feature = "sqlx", feature = "diesel"))]
fn count(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

/// SQL shared by both Postgres backends.
#[cfg(any(feature = "sqlx", feature = "diesel"))]
mod sql {
    pub(super) const INBOX_PER_CONSUMER: &str =
        "SELECT consumer_type, count(*)::int8 AS n FROM inbox_messages GROUP BY consumer_type";
    pub(super) const INBOX_ROWS: &str = "SELECT count(*)::int8 AS n FROM inbox_messages";
    pub(super) const NOTIFICATIONS: &str = "SELECT count(*)::int8 AS rows, \
        count(DISTINCT message_id)::int8 AS messages, count(DISTINCT parcel_id)::int8 AS parcels \
        FROM notifications";
    pub(super) const CARRIER: &str = "SELECT count(*)::int8 AS rows, \
        count(DISTINCT message_id)::int8 AS messages, count(DISTINCT parcel_id)::int8 AS parcels \
        FROM carrier_assignments";
    pub(super) const RECORD_STUB_CALL: &str = "INSERT INTO stub_ledger \
        (downstream, idempotency_key, parcel_id) VALUES ($1, $2, $3) \
        ON CONFLICT (downstream, idempotency_key) \
        DO UPDATE SET calls = stub_ledger.calls + 1, last_call_at = now() RETURNING calls";
    pub(super) const MARK_NOTIFICATION: &str = "UPDATE notifications SET dispatched_at = now() \
        WHERE message_id = $1 AND dispatched_at IS NULL";
    pub(super) const MARK_CARRIER: &str = "UPDATE carrier_assignments SET dispatched_at = now() \
        WHERE message_id = $1 AND dispatched_at IS NULL";
    pub(super) const UNDISPATCHED_NOTIFICATIONS: &str = "SELECT message_id, parcel_id, \
        tracking_number, destination, body FROM notifications \
        WHERE dispatched_at IS NULL AND created_at < now() - make_interval(secs => $1) \
        ORDER BY created_at LIMIT $2";
    pub(super) const UNDISPATCHED_CARRIER: &str = "SELECT message_id, parcel_id, carrier, slot \
        FROM carrier_assignments \
        WHERE dispatched_at IS NULL AND created_at < now() - make_interval(secs => $1) \
        ORDER BY created_at LIMIT $2";

    pub(super) fn mark(role: crate::consumers::Role) -> &'static str {
        match role {
            crate::consumers::Role::Notification => MARK_NOTIFICATION,
            crate::consumers::Role::Carrier => MARK_CARRIER,
        }
    }
}

#[cfg(feature = "sqlx")]
mod sqlx_store {
    use inbox_backend_sqlx::{SqlxStore, classify};
    use sqlx::Row;

    use std::time::Duration;

    use inbox_api::MessageId;

    use super::{EffectCounts, ParcelStore, Stats, StoreKind, count, sql};
    use crate::AppError;
    use crate::consumers::Role;
    use crate::dispatch::Intent;
    use crate::effects::{CarrierAssignment, Notification, app_migration_script};

    async fn effects(store: &SqlxStore, query: &str) -> Result<EffectCounts, AppError> {
        let row = sqlx::query(query)
            .fetch_one(store.pool())
            .await
            .map_err(classify)?;
        Ok(EffectCounts {
            rows: count(row.try_get("rows").map_err(classify)?),
            distinct_messages: count(row.try_get("messages").map_err(classify)?),
            distinct_parcels: count(row.try_get("parcels").map_err(classify)?),
        })
    }

    impl ParcelStore for SqlxStore {
        fn kind(&self) -> StoreKind {
            StoreKind::Sqlx
        }

        async fn migrate_all(&self) -> Result<(), AppError> {
            self.migrate().await?;
            let script = app_migration_script();
            sqlx::raw_sql(&script)
                .execute(self.pool())
                .await
                .map_err(classify)?;
            tracing::info!(schema = self.schema(), "app tables migrated (sqlx)");
            Ok(())
        }

        async fn stats(&self) -> Result<Stats, AppError> {
            let rows = sqlx::query(sql::INBOX_PER_CONSUMER)
                .fetch_all(self.pool())
                .await
                .map_err(classify)?;
            let mut stats = Stats::default();
            for row in rows {
                let consumer: String = row.try_get("consumer_type").map_err(classify)?;
                let n: i64 = row.try_get("n").map_err(classify)?;
                stats.inbox_rows += count(n);
                stats.inbox_per_consumer.insert(consumer, count(n));
            }
            stats.notifications = effects(self, sql::NOTIFICATIONS).await?;
            stats.carrier_assignments = effects(self, sql::CARRIER).await?;
            Ok(stats)
        }

        async fn inbox_rows(&self) -> Result<u64, AppError> {
            let n: i64 = sqlx::query_scalar(sql::INBOX_ROWS)
                .fetch_one(self.pool())
                .await
                .map_err(classify)?;
            Ok(count(n))
        }

        async fn drop_schema(&self) -> Result<(), AppError> {
            // The name is validated by the store (a plain identifier).
            let drop = format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.schema());
            sqlx::query(&drop)
                .execute(self.pool())
                .await
                .map_err(classify)?;
            Ok(())
        }

        async fn record_stub_call(
            &self,
            downstream: &str,
            idempotency_key: &str,
            parcel_id: &str,
        ) -> Result<u64, AppError> {
            let calls: i64 = sqlx::query_scalar(sql::RECORD_STUB_CALL)
                .bind(downstream)
                .bind(idempotency_key)
                .bind(parcel_id)
                .fetch_one(self.pool())
                .await
                .map_err(classify)?;
            Ok(count(calls))
        }

        async fn mark_dispatched(
            &self,
            role: Role,
            message_id: &MessageId,
        ) -> Result<(), AppError> {
            sqlx::query(sql::mark(role))
                .bind(message_id.as_uuid())
                .execute(self.pool())
                .await
                .map_err(classify)?;
            Ok(())
        }

        async fn undispatched(
            &self,
            min_age: Duration,
            limit: u32,
        ) -> Result<Vec<Intent>, AppError> {
            let mut intents = Vec::new();
            let rows = sqlx::query(sql::UNDISPATCHED_NOTIFICATIONS)
                .bind(min_age.as_secs_f64())
                .bind(i64::from(limit))
                .fetch_all(self.pool())
                .await
                .map_err(classify)?;
            for row in rows {
                let id: uuid::Uuid = row.try_get("message_id").map_err(classify)?;
                intents.push(Intent::Notification(Notification {
                    message_id: id.into(),
                    parcel_id: row.try_get("parcel_id").map_err(classify)?,
                    tracking_number: row.try_get("tracking_number").map_err(classify)?,
                    destination: row.try_get("destination").map_err(classify)?,
                    body: row.try_get("body").map_err(classify)?,
                }));
            }
            let rows = sqlx::query(sql::UNDISPATCHED_CARRIER)
                .bind(min_age.as_secs_f64())
                .bind(i64::from(limit))
                .fetch_all(self.pool())
                .await
                .map_err(classify)?;
            for row in rows {
                let id: uuid::Uuid = row.try_get("message_id").map_err(classify)?;
                intents.push(Intent::Carrier(CarrierAssignment {
                    message_id: id.into(),
                    parcel_id: row.try_get("parcel_id").map_err(classify)?,
                    carrier: row.try_get("carrier").map_err(classify)?,
                    slot: row.try_get("slot").map_err(classify)?,
                }));
            }
            Ok(intents)
        }
    }
}

#[cfg(feature = "diesel")]
mod diesel_store {
    use std::time::Duration;

    use diesel::QueryableByName;
    use diesel::sql_types::{BigInt, Double, Text, Uuid as SqlUuid};
    use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
    use inbox_api::MessageId;
    use inbox_backend_diesel::{DieselStore, classify, classify_pool};

    use super::{EffectCounts, ParcelStore, Stats, StoreKind, count, sql};
    use crate::AppError;
    use crate::consumers::Role;
    use crate::dispatch::Intent;
    use crate::effects::{CarrierAssignment, Notification, app_migration_script};

    #[derive(QueryableByName)]
    struct Calls {
        #[diesel(sql_type = BigInt)]
        calls: i64,
    }

    #[derive(QueryableByName)]
    struct PendingNotification {
        #[diesel(sql_type = SqlUuid)]
        message_id: uuid::Uuid,
        #[diesel(sql_type = Text)]
        parcel_id: String,
        #[diesel(sql_type = Text)]
        tracking_number: String,
        #[diesel(sql_type = Text)]
        destination: String,
        #[diesel(sql_type = Text)]
        body: String,
    }

    #[derive(QueryableByName)]
    struct PendingCarrier {
        #[diesel(sql_type = SqlUuid)]
        message_id: uuid::Uuid,
        #[diesel(sql_type = Text)]
        parcel_id: String,
        #[diesel(sql_type = Text)]
        carrier: String,
        #[diesel(sql_type = Text)]
        slot: String,
    }

    #[derive(QueryableByName)]
    struct PerConsumer {
        #[diesel(sql_type = Text)]
        consumer_type: String,
        #[diesel(sql_type = BigInt)]
        n: i64,
    }

    #[derive(QueryableByName)]
    struct Total {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }

    #[derive(QueryableByName)]
    struct Effects {
        #[diesel(sql_type = BigInt)]
        rows: i64,
        #[diesel(sql_type = BigInt)]
        messages: i64,
        #[diesel(sql_type = BigInt)]
        parcels: i64,
    }

    async fn effects(store: &DieselStore, query: &str) -> Result<EffectCounts, AppError> {
        let mut conn = store.pool().get().await.map_err(classify_pool)?;
        let row: Effects = diesel::sql_query(query)
            .get_result(&mut *conn)
            .await
            .map_err(classify)?;
        Ok(EffectCounts {
            rows: count(row.rows),
            distinct_messages: count(row.messages),
            distinct_parcels: count(row.parcels),
        })
    }

    impl ParcelStore for DieselStore {
        fn kind(&self) -> StoreKind {
            StoreKind::Diesel
        }

        async fn migrate_all(&self) -> Result<(), AppError> {
            self.migrate().await?;
            let mut conn = self.pool().get().await.map_err(classify_pool)?;
            conn.batch_execute(&app_migration_script())
                .await
                .map_err(classify)?;
            tracing::info!(
                schema = self.schema().as_str(),
                "app tables migrated (diesel)"
            );
            Ok(())
        }

        async fn stats(&self) -> Result<Stats, AppError> {
            let rows: Vec<PerConsumer> = {
                let mut conn = self.pool().get().await.map_err(classify_pool)?;
                diesel::sql_query(sql::INBOX_PER_CONSUMER)
                    .load(&mut *conn)
                    .await
                    .map_err(classify)?
            };
            let mut stats = Stats::default();
            for row in rows {
                stats.inbox_rows += count(row.n);
                stats
                    .inbox_per_consumer
                    .insert(row.consumer_type, count(row.n));
            }
            stats.notifications = effects(self, sql::NOTIFICATIONS).await?;
            stats.carrier_assignments = effects(self, sql::CARRIER).await?;
            Ok(stats)
        }

        async fn inbox_rows(&self) -> Result<u64, AppError> {
            let mut conn = self.pool().get().await.map_err(classify_pool)?;
            let total: Total = diesel::sql_query(sql::INBOX_ROWS)
                .get_result(&mut *conn)
                .await
                .map_err(classify)?;
            Ok(count(total.n))
        }

        async fn drop_schema(&self) -> Result<(), AppError> {
            let mut conn = self.pool().get().await.map_err(classify_pool)?;
            let drop = format!(
                "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                self.schema().as_str()
            );
            conn.batch_execute(&drop).await.map_err(classify)?;
            Ok(())
        }

        async fn record_stub_call(
            &self,
            downstream: &str,
            idempotency_key: &str,
            parcel_id: &str,
        ) -> Result<u64, AppError> {
            let mut conn = self.pool().get().await.map_err(classify_pool)?;
            let row: Calls = diesel::sql_query(sql::RECORD_STUB_CALL)
                .bind::<Text, _>(downstream)
                .bind::<Text, _>(idempotency_key)
                .bind::<Text, _>(parcel_id)
                .get_result(&mut *conn)
                .await
                .map_err(classify)?;
            Ok(count(row.calls))
        }

        async fn mark_dispatched(
            &self,
            role: Role,
            message_id: &MessageId,
        ) -> Result<(), AppError> {
            let mut conn = self.pool().get().await.map_err(classify_pool)?;
            diesel::sql_query(sql::mark(role))
                .bind::<SqlUuid, _>(*message_id.as_uuid())
                .execute(&mut *conn)
                .await
                .map_err(classify)?;
            Ok(())
        }

        async fn undispatched(
            &self,
            min_age: Duration,
            limit: u32,
        ) -> Result<Vec<Intent>, AppError> {
            let mut conn = self.pool().get().await.map_err(classify_pool)?;
            let notifications: Vec<PendingNotification> =
                diesel::sql_query(sql::UNDISPATCHED_NOTIFICATIONS)
                    .bind::<Double, _>(min_age.as_secs_f64())
                    .bind::<BigInt, _>(i64::from(limit))
                    .load(&mut *conn)
                    .await
                    .map_err(classify)?;
            let carrier: Vec<PendingCarrier> = diesel::sql_query(sql::UNDISPATCHED_CARRIER)
                .bind::<Double, _>(min_age.as_secs_f64())
                .bind::<BigInt, _>(i64::from(limit))
                .load(&mut *conn)
                .await
                .map_err(classify)?;
            let mut intents: Vec<Intent> = notifications
                .into_iter()
                .map(|n| {
                    Intent::Notification(Notification {
                        message_id: n.message_id.into(),
                        parcel_id: n.parcel_id,
                        tracking_number: n.tracking_number,
                        destination: n.destination,
                        body: n.body,
                    })
                })
                .collect();
            intents.extend(carrier.into_iter().map(|a| {
                Intent::Carrier(CarrierAssignment {
                    message_id: a.message_id.into(),
                    parcel_id: a.parcel_id,
                    carrier: a.carrier,
                    slot: a.slot,
                })
            }));
            Ok(intents)
        }
    }
}

#[cfg(feature = "memory")]
mod memory_store {
    use std::collections::{HashMap, HashSet};
    use std::sync::{LazyLock, Mutex};
    use std::time::Duration;

    use inbox_api::MessageId;
    use inbox_backend_memory::MemoryStore;

    use super::{EffectCounts, ParcelStore, Stats, StoreKind};
    use crate::AppError;
    use crate::consumers::Role;
    use crate::dispatch::Intent;
    use crate::effects::{CARRIER_ASSIGNMENTS, NOTIFICATIONS};

    fn effects(store: &MemoryStore, prefix: &str) -> EffectCounts {
        let rows = store.scan_prefix(prefix);
        let mut messages = HashSet::new();
        let mut parcels = HashSet::new();
        for (key, value) in &rows {
            let message = key[prefix.len()..].split('/').next().unwrap_or_default();
            messages.insert(message.to_owned());
            if let Ok(json) = serde_json::from_slice::<serde_json::Value>(value)
                && let Some(parcel) = json.get("parcel_id").and_then(|p| p.as_str())
            {
                parcels.insert(parcel.to_owned());
            }
        }
        EffectCounts {
            rows: rows.len() as u64,
            distinct_messages: messages.len() as u64,
            distinct_parcels: parcels.len() as u64,
        }
    }

    impl ParcelStore for MemoryStore {
        fn kind(&self) -> StoreKind {
            StoreKind::Memory
        }

        async fn migrate_all(&self) -> Result<(), AppError> {
            Ok(())
        }

        async fn stats(&self) -> Result<Stats, AppError> {
            let mut stats = Stats::default();
            for record in self.records() {
                stats.inbox_rows += 1;
                *stats
                    .inbox_per_consumer
                    .entry(record.key.consumer.as_str().to_owned())
                    .or_default() += 1;
            }
            stats.notifications = effects(self, NOTIFICATIONS);
            stats.carrier_assignments = effects(self, CARRIER_ASSIGNMENTS);
            Ok(stats)
        }

        async fn inbox_rows(&self) -> Result<u64, AppError> {
            Ok(self.inbox_len() as u64)
        }

        async fn drop_schema(&self) -> Result<(), AppError> {
            Ok(())
        }

        /// The memory store's "ledger" lives in this process (as the
        /// store itself does).
        async fn record_stub_call(
            &self,
            downstream: &str,
            idempotency_key: &str,
            parcel_id: &str,
        ) -> Result<u64, AppError> {
            static LEDGER: LazyLock<Mutex<HashMap<(String, String), u64>>> =
                LazyLock::new(Mutex::default);
            let _ = parcel_id;
            let mut ledger = LEDGER
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let calls = ledger
                .entry((downstream.to_owned(), idempotency_key.to_owned()))
                .or_default();
            *calls += 1;
            Ok(*calls)
        }

        /// Intents are not tracked in the memory store: nothing outlives the
        /// process to reconcile.
        async fn mark_dispatched(&self, _role: Role, _id: &MessageId) -> Result<(), AppError> {
            Ok(())
        }

        async fn undispatched(
            &self,
            _min_age: Duration,
            _limit: u32,
        ) -> Result<Vec<Intent>, AppError> {
            Ok(Vec::new())
        }
    }
}

/// The conformance suite's deliberately broken stores, runnable in the app
/// (`consume --fault-broken-store`, for the chaos harness to prove it can
/// fail). Every app-level method goes to the correct store underneath.
#[cfg(feature = "fault-injection")]
mod broken_store {
    use std::time::Duration;

    use inbox_api::{InboxStore, MessageId};
    use inbox_conformance::broken::{BrokenStore, BrokenTransaction};

    use super::{ParcelStore, Stats, StoreKind};
    use crate::AppError;
    use crate::consumers::Role;
    use crate::dispatch::Intent;
    use crate::effects::{CarrierAssignment, Notification, ParcelEffects};

    impl<S> ParcelEffects for BrokenTransaction<S>
    where
        S: InboxStore + Clone,
        S::Transaction: ParcelEffects,
    {
        async fn record_notification(&mut self, n: &Notification) -> Result<(), AppError> {
            self.inner_mut().record_notification(n).await
        }

        async fn reserve_carrier_slot(&mut self, a: &CarrierAssignment) -> Result<(), AppError> {
            self.inner_mut().reserve_carrier_slot(a).await
        }
    }

    impl<S: ParcelStore> ParcelStore for BrokenStore<S> {
        fn kind(&self) -> StoreKind {
            self.inner().kind()
        }

        async fn migrate_all(&self) -> Result<(), AppError> {
            self.inner().migrate_all().await
        }

        async fn stats(&self) -> Result<Stats, AppError> {
            self.inner().stats().await
        }

        async fn inbox_rows(&self) -> Result<u64, AppError> {
            self.inner().inbox_rows().await
        }

        async fn drop_schema(&self) -> Result<(), AppError> {
            self.inner().drop_schema().await
        }

        async fn record_stub_call(
            &self,
            downstream: &str,
            idempotency_key: &str,
            parcel_id: &str,
        ) -> Result<u64, AppError> {
            self.inner()
                .record_stub_call(downstream, idempotency_key, parcel_id)
                .await
        }

        async fn mark_dispatched(
            &self,
            role: Role,
            message_id: &MessageId,
        ) -> Result<(), AppError> {
            self.inner().mark_dispatched(role, message_id).await
        }

        async fn undispatched(
            &self,
            min_age: Duration,
            limit: u32,
        ) -> Result<Vec<Intent>, AppError> {
            self.inner().undispatched(min_age, limit).await
        }
    }
}

/// Where the store lives.
#[derive(Clone)]
pub struct StoreConfig {
    /// Which implementation.
    pub kind: StoreKind,
    /// The PostgreSQL URL (may hold a password: log it through
    /// [`crate::redact::redact_url`]).
    pub database_url: String,
    /// The schema holding the inbox and the app's tables.
    pub schema: String,
    /// Connections in the pool.
    pub pool_size: u32,
}

impl fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreConfig")
            .field("kind", &self.kind)
            .field(
                "database_url",
                &crate::redact::redact_url(&self.database_url),
            )
            .field("schema", &self.schema)
            .field("pool_size", &self.pool_size)
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

/// Connects the configured store, retrying with backoff while the database
/// is unreachable (`attempts` times; `None`: forever), and runs `task` on it.
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
        StoreKind::Sqlx => {
            let store = retry_connect(config, attempts, || async {
                use inbox_backend_sqlx::{SqlxStore, classify};
                let options = SqlxStore::connect_options(&config.database_url, &config.schema)?;
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(config.pool_size.max(1))
                    .connect_with(options)
                    .await
                    .map_err(classify)?;
                SqlxStore::new(pool, &config.schema)
            })
            .await?;
            task.run(store).await
        }
        #[cfg(feature = "diesel")]
        StoreKind::Diesel => {
            let pool_size = usize::try_from(config.pool_size).unwrap_or(10);
            let store = retry_connect(config, attempts, || async {
                inbox_backend_diesel::DieselStore::connect(
                    &config.database_url,
                    &config.schema,
                    pool_size,
                )
                .await
            })
            .await?;
            task.run(store).await
        }
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
    let url = crate::redact::redact_url(&config.database_url);
    let mut attempt = 0;
    loop {
        match connect().await {
            Ok(store) => return Ok(store),
            Err(error) if error.is_retryable() => {
                attempt += 1;
                if attempts.is_some_and(|max| attempt >= max) {
                    return Err(AppError::Unavailable(format!(
                        "PostgreSQL at {url} unreachable after {attempt} attempts: {}",
                        crate::error::chain(&error)
                    )));
                }
                let delay = crate::amqp::backoff(
                    std::time::Duration::from_millis(200),
                    std::time::Duration::from_secs(10),
                    attempt,
                );
                tracing::warn!(%url, store = %config.kind, attempt, ?delay,
                    error = %crate::error::chain(&error), "PostgreSQL unreachable; retrying");
                tokio::time::sleep(delay).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}
