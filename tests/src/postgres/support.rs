//! What every Postgres backend's test scaffolding shares: where the
//! database is, how test schemas are named, and which ones a later run may
//! sweep.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Used when `DATABASE_URL` is not set.
pub const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// Schemas made by tests start with this.
pub const TEST_PREFIX: &str = "inbox_test_";

/// How old a test schema must be before a later run may drop it.
pub const SWEEP_AFTER: Duration = Duration::from_secs(3600);

/// Lists the schemas whose name starts with `$1` (a `LIKE` pattern, see
/// [`like_prefix`]): one `text` column.
pub const LIST_SCHEMAS: &str = "SELECT nspname::text FROM pg_namespace WHERE nspname LIKE $1";

/// A business table for the suites' effects. No unique constraint on
/// purpose: a double effect must show up as two rows.
pub const EFFECTS_TABLE: &str = "CREATE TABLE IF NOT EXISTS conformance_effects (
    message_id uuid NOT NULL,
    consumer   text NOT NULL,
    effect_id  uuid NOT NULL DEFAULT gen_random_uuid()
)";

/// The business write of the suites: one effect row, `$1` message id,
/// `$2` consumer.
pub const RECORD_EFFECT: &str =
    "INSERT INTO conformance_effects (message_id, consumer) VALUES ($1, $2)";

/// Lets time pass for the outbox (`OutboxHarness::age_outbox`): `$1`
/// seconds (float8) off every row's timestamps and lease deadline.
pub const AGE_OUTBOX: &str = "UPDATE outbox_messages SET \
     created_at = created_at - make_interval(secs => $1), \
     published_at = published_at - make_interval(secs => $1), \
     locked_until = locked_until - make_interval(secs => $1), \
     next_attempt_at = next_attempt_at - make_interval(secs => $1), \
     dead_at = dead_at - make_interval(secs => $1)";

/// Moves every attempt-ledger row `$1` seconds into the past, as
/// [`AGE_OUTBOX`] does for the outbox.
pub const AGE_ATTEMPTS: &str = "UPDATE inbox_attempts SET \
     first_failed_at = first_failed_at - make_interval(secs => $1), \
     last_failed_at = last_failed_at - make_interval(secs => $1), \
     dead_at = dead_at - make_interval(secs => $1)";

/// Crash-point model cases (each model, each layout) for a Postgres
/// backend's default run: a case runs dozens of real statements and the
/// four models of a backend take minutes at this count, so CI keeps it
/// below the memory store's 1,000; run more with `PROPTEST_CASES`.
pub const MODEL_CASES: u32 = 500;

/// Outbox model cases for a Postgres backend's default run: each case runs
/// a few dozen real statements, so CI keeps it short; run more with
/// `PROPTEST_CASES`.
pub const OUTBOX_MODEL_CASES: u32 = 100;

/// `DATABASE_URL`, or the local test database.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned())
}

/// The URL without its password, for messages that end up in CI logs.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.split_once('@') {
        Some((userinfo, host)) if userinfo.contains(':') => {
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{scheme}://{user}:***@{host}")
        }
        _ => url.to_owned(),
    }
}

/// The one message for a missing database, whichever test meets it first.
/// Panics, never skips: a test that quietly passes without its database
/// proves nothing.
pub fn unreachable_database(error: &dyn std::fmt::Display) -> ! {
    panic!(
        "PostgreSQL not reachable at {}: {error}; start it with \
         `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` \
         (or point DATABASE_URL at a server)",
        redacted(&database_url())
    )
}

/// PgBouncer in transaction mode in front of the test database, as
/// `.ci/services.sh` starts it (`.ci/pgbouncer.ini`).
pub const DEFAULT_BOUNCER_URL: &str = "postgres://postgres@127.0.0.1:6432/test";

/// `PGBOUNCER_URL`, or the local PgBouncer of `.ci/services.sh`.
pub fn bouncer_url() -> String {
    std::env::var("PGBOUNCER_URL").unwrap_or_else(|_| DEFAULT_BOUNCER_URL.to_owned())
}

/// The one message for a missing PgBouncer. Panics, never skips, as
/// [`unreachable_database`].
pub fn unreachable_bouncer(error: &dyn std::fmt::Display) -> ! {
    panic!(
        "PgBouncer not reachable at {}: {error}; start it with `bash .ci/services.sh` \
         (or point PGBOUNCER_URL at a PgBouncer in transaction mode)",
        redacted(&bouncer_url())
    )
}

/// The business write of [`RECORD_EFFECT`] with the effects table in
/// `schema`, for a store whose connections do not use the schema (a
/// user's pool, PgBouncer in transaction mode): `$1` message id, `$2`
/// consumer.
pub fn record_effect_in(schema: &inbox_postgres::SchemaName) -> String {
    format!(
        "INSERT INTO {}.conformance_effects (message_id, consumer) VALUES ($1, $2)",
        schema.quoted()
    )
}

/// Seconds since the epoch, as embedded in schema names.
pub fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// A schema name nobody else uses: `<prefix><unixsecs>_<random>`, so
/// concurrent runs (other engineers, CI) never see each other's rows.
pub fn unique_schema(prefix: &str) -> String {
    let random = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}{}_{}", unix_secs(), &random[..8])
}

/// The creation time embedded in a schema name made by [`unique_schema`].
pub fn embedded_secs(schema: &str, prefix: &str) -> Option<u64> {
    let rest = schema.strip_prefix(prefix)?;
    let (secs, random) = rest.split_once('_')?;
    if random.is_empty() {
        return None;
    }
    secs.parse().ok()
}

/// `prefix` as a `LIKE` pattern matching the names that start with it.
pub fn like_prefix(prefix: &str) -> String {
    format!("{}%", prefix.replace('_', "\\_"))
}

/// Whether a run may drop `schema`: made by [`unique_schema`] with
/// `prefix` more than [`SWEEP_AFTER`] ago. Younger ones may belong to a run
/// still going and are left alone.
pub fn is_stale(schema: &str, prefix: &str) -> bool {
    let limit = unix_secs().saturating_sub(SWEEP_AFTER.as_secs());
    embedded_secs(schema, prefix).is_some_and(|secs| secs < limit)
}

/// Of the schemas [`LIST_SCHEMAS`] listed for `prefix`, the ones a run may
/// drop: stale (see [`is_stale`]) and valid names, so that quoting them in
/// [`drop_schema_sql`] is safe.
pub fn stale_schemas(listed: Vec<String>, prefix: &str) -> Vec<inbox_postgres::SchemaName> {
    listed
        .into_iter()
        .filter(|name| is_stale(name, prefix))
        .filter_map(|name| inbox_postgres::SchemaName::new(&name).ok())
        .collect()
}

/// Drops one test schema and everything in it.
pub fn drop_schema_sql(schema: &inbox_postgres::SchemaName) -> String {
    format!("DROP SCHEMA IF EXISTS {} CASCADE", schema.quoted())
}

/// Every inbox row of the schema on the search path, with the columns an
/// [`inbox_api::InboxRecord`] holds: what the suites read back.
pub const INBOX_ROWS: &str = "SELECT id, consumer_type::text AS consumer_type, received_at, \
     processed_at, payload_fingerprint FROM inbox_messages ORDER BY 1, 2";

/// A row [`INBOX_ROWS`] read back, as the store's record.
pub fn stored_record(
    id: uuid::Uuid,
    consumer: String,
    received_at: chrono::DateTime<chrono::Utc>,
    processed_at: Option<chrono::DateTime<chrono::Utc>>,
    fingerprint: Option<Vec<u8>>,
) -> inbox_api::InboxRecord {
    inbox_api::InboxRecord {
        key: stored_key(id, consumer),
        received_at,
        processed_at,
        fingerprint: inbox_postgres::stored_fingerprint(fingerprint)
            .expect("stored fingerprints are 32 bytes"),
    }
}

/// The key of a stored row, as the suites read rows back.
pub fn stored_key(id: uuid::Uuid, consumer: String) -> inbox_api::InboxKey {
    inbox_api::InboxKey::new(
        inbox_api::MessageId::from_uuid(id),
        inbox_api::ConsumerName::new(consumer).expect("stored consumer names are valid"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_round_trip() {
        let name = unique_schema(TEST_PREFIX);
        let secs = embedded_secs(&name, TEST_PREFIX).expect("embedded");
        assert!(secs.abs_diff(unix_secs()) < 5);
        assert!(!is_stale(&name, TEST_PREFIX));
        assert!(is_stale("inbox_test_1_abcdef12", TEST_PREFIX));
        assert!(!is_stale("inbox_test_x", TEST_PREFIX));
        assert!(!is_stale("other_1_abcdef12", TEST_PREFIX));
        assert_eq!(like_prefix("inbox_test_"), "inbox\\_test\\_%");
        assert_eq!(
            redacted("postgres://u:secret@h/db"),
            "postgres://u:***@h/db"
        );
        assert_eq!(redacted("postgres://u@h/db"), "postgres://u@h/db");
    }
}
