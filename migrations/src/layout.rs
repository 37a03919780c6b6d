//! The two layouts of the inbox table, and the partitioned one's upkeep.
//!
//! [`Layout::Table`] (the default) is one table, cleaned by bounded row
//! deletes. [`Layout::Partitioned`] ranges the table on the message id
//! (see `layouts/partitioned.sql` for the exact rules): UUIDv7 ids by the
//! UTC day of their timestamp, whole days detached and dropped after the
//! retention, every other id in one "untimed" partition cleaned by rows.
//! A message id maps to one partition forever, so a duplicate always meets
//! its first copy; an id whose day was dropped is refused
//! ([`InboxError::Expired`]) instead of claimed, since its first copy may
//! be gone with the day.
//!
//! The layout is chosen when a schema is first migrated and checked on
//! every later migration ([`crate::migrate_with_layout`]); a store sends
//! the claim statements of its layout ([`Layout::claim`]).

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, NaiveDate, NaiveTime, Utc};
use inbox_api::{InboxError, MessageId};

use crate::sql;
use crate::{MigrationConnection, SchemaName};

/// The partitioned layout's DDL, applied once to a schema without an inbox
/// table, before the migrations.
pub const PARTITIONED_DDL: &str = include_str!("../layouts/partitioned.sql");

/// The SQLSTATE of an INSERT whose row has no partition (`check_violation`).
pub const NO_PARTITION: &str = "23514";

/// The name prefix of the partitioned layout's day partitions, followed by
/// `YYYYMMDD`.
const DAY_PREFIX: &str = "inbox_messages_p";

/// How the inbox table is laid out in a schema.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Layout {
    /// One table, cleaned by bounded row deletes. The default.
    #[default]
    Table,
    /// Range partitions on the id: v7 ids by UTC day (dropped whole after
    /// the retention), other ids in one untimed partition.
    Partitioned,
}

impl Layout {
    /// The claim of one key in this layout (see [`sql::CLAIM`]).
    pub fn claim(self) -> &'static str {
        match self {
            Self::Table => sql::CLAIM,
            Self::Partitioned => sql::CLAIM_PARTITIONED,
        }
    }

    /// The claim of one key in this layout for a pipeline behind
    /// [`sql::BEGIN_PIPELINED`] (see [`sql::CLAIM_PIPELINED`]).
    pub fn claim_pipelined(self) -> &'static str {
        match self {
            Self::Table => sql::CLAIM_PIPELINED,
            Self::Partitioned => sql::CLAIM_PARTITIONED_PIPELINED,
        }
    }

    /// The claim of a batch in this layout (see [`sql::CLAIM_BATCH`]).
    pub fn claim_batch(self) -> &'static str {
        match self {
            Self::Table => sql::CLAIM_BATCH,
            Self::Partitioned => sql::CLAIM_BATCH_PARTITIONED,
        }
    }

    /// One batch of row cleanup in this layout: the whole table, or only
    /// the untimed partition (rows of a day partition are never deleted
    /// one by one: their day goes whole).
    pub fn purge_batch(self) -> &'static str {
        match self {
            Self::Table => sql::PURGE_BATCH,
            Self::Partitioned => sql::PURGE_UNTIMED_BATCH,
        }
    }

    /// The name used on the command line and in configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Table => "table",
            Self::Partitioned => "partitioned",
        }
    }

    /// What a claim that failed with `sqlstate` means in this layout, for
    /// the key with `id`: `None` to classify it as usual.
    ///
    /// In the partitioned layout a v7 id without a partition fails with
    /// [`NO_PARTITION`]. Its day lies before today (UTC): the day was
    /// dropped after the retention (or never created), and the first copy
    /// may have gone with it, so the claim is refused as
    /// [`InboxError::Expired`] (permanent: dead-lettered, never claimed
    /// blind). Its day is today or later (clock skew, or maintenance not
    /// run): retryable, since [`create_partitions`] creates the day.
    pub fn claim_failure(
        self,
        sqlstate: Option<&str>,
        id: &MessageId,
        now: DateTime<Utc>,
    ) -> Option<InboxError> {
        if self != Self::Partitioned || sqlstate != Some(NO_PARTITION) {
            return None;
        }
        let day = id_day(id)?;
        if day < now.date_naive() {
            Some(InboxError::Expired {
                message_id: id.to_string(),
            })
        } else {
            Some(InboxError::Store {
                retryable: true,
                source: format!(
                    "no inbox partition for day {day} of message {id} yet: run the partition \
                     maintenance (inbox_create_partitions)"
                )
                .into(),
            })
        }
    }
}

impl Layout {
    /// Whether a batch's claim that failed with `sqlstate` failed because
    /// of a key it does not name: in the partitioned layout a key without a
    /// partition ([`NO_PARTITION`]) fails the batch's one INSERT. The store
    /// then answers [`InboxError::KeyRefusedInBatch`], and the batch claims
    /// its keys one by one, where [`Layout::claim_failure`] charges only the
    /// refused ones.
    pub fn batch_claim_refused_a_key(self, sqlstate: Option<&str>) -> bool {
        self == Self::Partitioned && sqlstate == Some(NO_PARTITION)
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Layout {
    type Err = InboxError;

    fn from_str(s: &str) -> Result<Self, InboxError> {
        match s {
            "table" => Ok(Self::Table),
            "partitioned" => Ok(Self::Partitioned),
            other => Err(InboxError::InvalidArgument {
                message: format!("unknown inbox layout {other:?}: expected table or partitioned"),
            }),
        }
    }
}

/// Whether `id` carries its time (version nibble 7): the rule that routes
/// it to a day partition, the same as SQL's `inbox_time_ordered`.
pub fn time_ordered(id: &MessageId) -> bool {
    id.as_uuid().as_bytes()[6] >> 4 == 7
}

/// The UTC day of a time-ordered id's timestamp (its first 48 bits, in
/// milliseconds), or `None` for an id without time.
pub fn id_day(id: &MessageId) -> Option<NaiveDate> {
    if !time_ordered(id) {
        return None;
    }
    let bytes = id.as_uuid().as_bytes();
    let millis = bytes[..6]
        .iter()
        .fold(0_i64, |acc, b| (acc << 8) | i64::from(*b));
    DateTime::<Utc>::from_timestamp_millis(millis).map(|t| t.date_naive())
}

/// Refuses `conn` unless its `search_path` resolves to `schema`: the
/// partitioned layout's maintenance ([`create_partitions`],
/// [`drop_expired_partitions`], [`partitions`]) names its tables
/// unqualified (a `DETACH … CONCURRENTLY` cannot run inside a transaction
/// that would set `search_path` for it), and on a connection of some other
/// schema it would maintain that schema's tables, or fail obscurely. So it
/// is refused loudly: run it on a pool whose connections set the schema
/// (the stores' own `connect_options` and builder do).
///
/// # Errors
/// [`InboxError::InvalidArgument`] naming both schemas when the
/// connection resolves to another schema; the driver's errors.
pub async fn require_session_schema<C: MigrationConnection>(
    conn: &mut C,
    schema: &SchemaName,
) -> Result<(), InboxError> {
    let current = conn.query_text("SELECT current_schema()::text").await?;
    // None: no schema of the search_path exists (the store's was dropped,
    // say): nothing else can be maintained by mistake, and the statements
    // fail with the missing table's own error.
    if current.is_none() || current.as_deref() == Some(schema.as_str()) {
        Ok(())
    } else {
        Err(InboxError::InvalidArgument {
            message: format!(
                "the partitioned layout's maintenance runs on connections whose search_path is \
                 the store's schema {:?}, and this one's is {current:?}: build the pool from \
                 the store's connect options (a session pool, not a transaction-mode pooler)",
                schema.as_str()
            ),
        })
    }
}

/// Creates the missing day partitions from `days_behind` days before
/// today (UTC) to `days_ahead` days after it, and returns how many it
/// created. Run it daily with `days_behind = 0`: a dropped day is then
/// never recreated, and its ids stay refused. The connection's
/// `search_path` must name the schema, whose layout is `layout`.
///
/// # Errors
/// [`InboxError::InvalidArgument`] for [`Layout::Table`]; the driver's
/// errors.
pub async fn create_partitions<C: MigrationConnection>(
    conn: &mut C,
    layout: Layout,
    days_behind: u16,
    days_ahead: u16,
) -> Result<u64, InboxError> {
    if layout != Layout::Partitioned {
        return Err(InboxError::InvalidArgument {
            message: "partition maintenance needs the partitioned inbox layout".into(),
        });
    }
    // Integers only reach the text.
    let created = conn
        .query_text(&format!(
            "SELECT inbox_create_partitions({days_behind}, {days_ahead})::text"
        ))
        .await?;
    let created = created.and_then(|n| n.parse().ok()).unwrap_or(0);
    if created > 0 {
        tracing::info!(created, days_behind, days_ahead, "inbox partitions created");
    }
    Ok(created)
}

/// The days [`create_partitions`] is asked to create ahead of today by the
/// maintenance the project runs (`parcel-inbox partitions`; the chaos
/// harness passes the same 3): as many as the migration creates, so that a
/// maintenance run missed for a day or two leaves no v7 id without its day.
pub const DAYS_AHEAD: u16 = 3;

/// One partition of the partitioned inbox table, as [`partitions`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    /// The table's name (`inbox_messages_pYYYYMMDD`, `inbox_messages_untimed`).
    pub name: String,
    /// The UTC day of a day partition; `None` for the untimed one.
    pub day: Option<NaiveDate>,
    /// Its bounds as PostgreSQL states them (`FOR VALUES FROM … TO …`).
    pub bounds: String,
    /// The planner's estimate of its rows; `None` when it was never
    /// analyzed.
    pub estimated_rows: Option<u64>,
}

/// The partitions of the inbox table in the connection's schema, whose
/// layout is `layout`, by name (the untimed one after the days).
///
/// # Errors
/// [`InboxError::InvalidArgument`] for [`Layout::Table`];
/// [`InboxError::Schema`] when the schema's inbox table is missing or not
/// partitioned; the driver's errors.
pub async fn partitions<C: MigrationConnection>(
    conn: &mut C,
    layout: Layout,
) -> Result<Vec<Partition>, InboxError> {
    if layout != Layout::Partitioned {
        return Err(InboxError::InvalidArgument {
            message: "partition maintenance needs the partitioned inbox layout".into(),
        });
    }
    let kind = conn
        .query_text(
            "SELECT (SELECT relkind::text FROM pg_class WHERE oid = to_regclass('inbox_messages'))",
        )
        .await?;
    match kind.as_deref() {
        Some("p") => {}
        found => {
            return Err(InboxError::Schema {
                source: match found {
                    None => "the schema has no inbox table: migrate it first".into(),
                    Some(_) => "the schema's inbox table has the table layout, not the \
                                partitioned one"
                        .into(),
                },
            });
        }
    }
    let listed = conn.query_text(sql::PARTITIONS).await?;
    Ok(listed
        .iter()
        .flat_map(|text| text.lines())
        .filter_map(|line| {
            let mut fields = line.split('\t');
            let name = fields.next()?.to_owned();
            let bounds = fields.next()?.to_owned();
            let estimated_rows = fields.next().and_then(|rows| rows.parse().ok());
            Some(Partition {
                day: partition_day(&name),
                name,
                bounds,
                estimated_rows,
            })
        })
        .collect())
}

/// Detaches and drops every day partition whose whole day lies before
/// `cutoff`, and returns the rows they held: exact for a day of at most
/// 8 MiB, the planner's estimate for a larger one, which spares the drop a
/// full count (see `day_rows`; the log line says which).
///
/// Each day goes with `DETACH PARTITION … CONCURRENTLY` (which takes no
/// lock that blocks claims on the other days; it waits for transactions
/// that might still use the day instead), then a `DROP TABLE` of what is
/// by then a table of its own. A detach interrupted halfway is finished
/// (`FINALIZE`) on the next run, a detached table whose drop was
/// interrupted is dropped. Sends each statement on its own, outside any
/// transaction block, as `DETACH … CONCURRENTLY` requires.
///
/// # Errors
/// The driver's errors.
pub async fn drop_expired_partitions<C: MigrationConnection>(
    conn: &mut C,
    cutoff: DateTime<Utc>,
) -> Result<u64, InboxError> {
    let listed = conn.query_text(sql::DAY_PARTITIONS).await?;
    let mut dropped = 0;
    for entry in listed.iter().flat_map(|l| l.split(',')) {
        let Some((name, state)) = entry.split_once(':') else {
            continue;
        };
        let Some(day) = partition_day(name) else {
            continue;
        };
        if !day_expired(day, cutoff) {
            continue;
        }
        // `name` is the prefix and eight digits (partition_day checked), so
        // formatting it into a statement is safe.
        match state {
            "attached" => {
                conn.execute(&format!(
                    "ALTER TABLE inbox_messages DETACH PARTITION {name} CONCURRENTLY"
                ))
                .await?;
            }
            "pending" => {
                conn.execute(&format!(
                    "ALTER TABLE inbox_messages DETACH PARTITION {name} FINALIZE"
                ))
                .await?;
            }
            _ => {}
        }
        let (rows, estimated) = day_rows(conn, name).await?;
        conn.execute(&format!("DROP TABLE {name}")).await?;
        tracing::info!(
            partition = name,
            %day,
            rows,
            estimated,
            %cutoff,
            "inbox day partition dropped"
        );
        dropped += rows;
    }
    Ok(dropped)
}

/// The size up to which a dropped day's rows are counted exactly
/// ([`day_rows`]): 8 MiB, about 80,000 claims, a few milliseconds of one
/// core.
const EXACT_COUNT_BYTES: u64 = 8 << 20;

/// The rows of the detached day table `name`, and whether the number is an
/// estimate.
///
/// Why not always `count(*)`: sampling the claims' backends during the
/// cleanup benchmark's drops (`pg_stat_activity`, `pg_locks`) showed them
/// never waiting on a lock, only on the CPU and their own WAL flush, and
/// the count of a 1 M-row day was most of the drop's CPU (about 52 ms of a
/// core, plus parallel workers started for it, against about 6 ms for the
/// detach and 22–31 ms for the DROP's file truncation; see
/// `docs/benchmark-notes.md`). On a busy database that CPU comes out of the
/// claims' latency, for a number that only feeds a log line and a counter.
/// So a large day reports the planner's estimate (`reltuples` per page,
/// times the table's pages now, as the planner scales it), which
/// autovacuum keeps current on a day that stopped receiving inserts a
/// retention ago; a small day, or one never analyzed, is counted.
async fn day_rows<C: MigrationConnection>(
    conn: &mut C,
    name: &str,
) -> Result<(u64, bool), InboxError> {
    // `name` is a day partition's name (checked by the caller). One row
    // always, NULL when the day must be counted.
    let estimate = conn
        .query_text(&format!(
            "SELECT (SELECT (c.reltuples::float8 / c.relpages * (pg_relation_size(c.oid) \
             / current_setting('block_size')::int8))::int8::text \
             FROM pg_class AS c WHERE c.oid = '{name}'::regclass \
             AND c.reltuples >= 0 AND c.relpages > 0 \
             AND pg_relation_size(c.oid) > {EXACT_COUNT_BYTES})"
        ))
        .await?
        .and_then(|n| n.parse::<u64>().ok());
    if let Some(rows) = estimate {
        return Ok((rows, true));
    }
    let rows = conn
        .query_text(&format!("SELECT count(*)::text FROM {name}"))
        .await?
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    Ok((rows, false))
}

/// The day of a day partition's name, or `None` for any other name.
pub fn partition_day(name: &str) -> Option<NaiveDate> {
    let digits = name.strip_prefix(DAY_PREFIX)?;
    if digits.len() != 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    NaiveDate::parse_from_str(digits, "%Y%m%d").ok()
}

/// Whether every id of `day` lies before `cutoff`: the day's end (the next
/// midnight, UTC) is not after it. Only then may the day be dropped: a
/// day dropped earlier would forget ids younger than the retention.
pub fn day_expired(day: NaiveDate, cutoff: DateTime<Utc>) -> bool {
    day.succ_opt()
        .map(|next| next.and_time(NaiveTime::MIN).and_utc() <= cutoff)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(text: &str) -> MessageId {
        MessageId::parse(text).expect("a uuid")
    }

    #[test]
    fn routing_uses_the_version_nibble() {
        // A v4 id whose random first bits read as a recent timestamp.
        let v4 = id("019aeb3c-0000-4000-8000-000000000000");
        assert!(!time_ordered(&v4));
        assert_eq!(id_day(&v4), None);
        let v7 = id("019aeb3c-0000-7000-8000-000000000000");
        assert!(time_ordered(&v7));
        assert!(id_day(&v7).is_some());
        let now = MessageId::from_uuid(uuid::Uuid::now_v7());
        assert_eq!(id_day(&now), Some(Utc::now().date_naive()));
    }

    #[test]
    fn a_day_expires_only_when_all_of_it_is_before_the_cutoff() {
        let day = NaiveDate::from_ymd_opt(2026, 12, 1).expect("a date");
        let midnight = |d: u32| {
            NaiveDate::from_ymd_opt(2026, 12, d)
                .expect("a date")
                .and_time(NaiveTime::MIN)
                .and_utc()
        };
        assert!(day_expired(day, midnight(2)));
        assert!(!day_expired(
            day,
            midnight(2) - chrono::Duration::milliseconds(1)
        ));
        assert!(!day_expired(day, midnight(1)));
    }

    #[test]
    fn only_day_partitions_are_named_days() {
        assert_eq!(
            partition_day("inbox_messages_p20261204"),
            NaiveDate::from_ymd_opt(2026, 12, 4)
        );
        for other in [
            "inbox_messages_untimed",
            "inbox_messages_p2026120",
            "inbox_messages_p20261304",
            "inbox_messages_p2026120x",
            "inbox_messages_p20261204; DROP",
        ] {
            assert_eq!(partition_day(other), None, "{other}");
        }
    }

    #[test]
    fn a_missing_partition_is_expired_in_the_past_and_retryable_ahead() {
        let now = Utc::now();
        let past = MessageId::from_uuid(uuid::Uuid::new_v7(uuid::Timestamp::from_unix(
            uuid::NoContext,
            u64::try_from((now - chrono::Duration::days(2)).timestamp()).expect("after 1970"),
            0,
        )));
        let future = MessageId::from_uuid(uuid::Uuid::new_v7(uuid::Timestamp::from_unix(
            uuid::NoContext,
            u64::try_from((now + chrono::Duration::days(9)).timestamp()).expect("after 1970"),
            0,
        )));
        let p = Layout::Partitioned;
        let expired = p
            .claim_failure(Some(NO_PARTITION), &past, now)
            .expect("mapped");
        assert_eq!(expired.kind(), "expired");
        assert!(!expired.is_retryable());
        let ahead = p
            .claim_failure(Some(NO_PARTITION), &future, now)
            .expect("mapped");
        assert!(ahead.is_retryable());
        assert!(p.claim_failure(Some("23505"), &past, now).is_none());
        assert!(
            Layout::Table
                .claim_failure(Some(NO_PARTITION), &past, now)
                .is_none()
        );
    }

    #[test]
    fn layouts_parse_their_names() {
        for layout in [Layout::Table, Layout::Partitioned] {
            assert_eq!(layout.as_str().parse::<Layout>().expect("parses"), layout);
        }
        assert!("heap".parse::<Layout>().is_err());
    }
}
