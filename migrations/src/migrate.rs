//! The schema's migrations and the one runner both drivers use.
//!
//! The migrations are the flat `<version>_<description>.sql` files next to
//! this crate's manifest, embedded with `include_str!` so that every crate
//! built on them packages and deploys without the source tree. The runner
//! is driver-neutral: it decides every statement (transaction, advisory
//! lock, schema, ledger, checksums) and a driver only executes them through
//! [`MigrationConnection`]. A schema migrated through one driver is
//! therefore migrated for the other too.
//!
//! # Databases migrated before the shared ledger
//!
//! Earlier versions kept two ledgers, sqlx's `_sqlx_migrations` and
//! `inbox_diesel_migrations`. The runner reads neither: on such a schema it
//! finds [`LEDGER_TABLE`] missing and applies every migration again. That is
//! harmless because every migration is idempotent (`CREATE … IF NOT
//! EXISTS`, `ADD COLUMN IF NOT EXISTS`, `CREATE OR REPLACE`, `COMMENT
//! ON`), which the test `migrations_are_idempotent`
//! holds each file to; the old ledger tables are left alone.

use async_trait::async_trait;
use inbox_api::InboxError;

use crate::SchemaName;
use crate::layout::{Layout, PARTITIONED_DDL};

/// One embedded migration file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Migration {
    /// The `<version>` part of the file name.
    pub version: i64,
    /// The `<description>` part, underscores as spaces.
    pub description: &'static str,
    /// The file's contents.
    pub sql: &'static str,
}

impl Migration {
    /// The migration as an application's own migration tool runs it (sqlx's
    /// `Migrator`, diesel's migration harness), inside the tool's
    /// transaction for that migration, on any connection: it creates
    /// `schema` if needed, puts `schema` first in `search_path` for this
    /// transaction only (so the file's objects land there, while the tool's
    /// own ledger table, named unqualified, still resolves where the tool
    /// keeps it), runs the file, and records the migration in this crate's
    /// ledger ([`LEDGER_TABLE`]) too. That last step is what makes a
    /// database migrated by the tool recognised by [`migrate`] (which then
    /// has nothing to do), and the files are idempotent, so a database
    /// migrated by [`migrate`] first is recognised by the tool (which
    /// re-applies them harmlessly).
    ///
    /// Must run inside a transaction (both tools' default): outside one
    /// the `search_path` would stay for the session.
    pub fn sql_in(&self, schema: &SchemaName) -> String {
        format!(
            "CREATE SCHEMA IF NOT EXISTS {quoted};\n\
             SELECT set_config('search_path', {prefix} || current_setting('search_path'), true);\n\
             {ledger};\n\
             {sql}\n;\n\
             INSERT INTO {LEDGER_TABLE} (version, description, checksum) \
             VALUES ({version}, '{description}', {checksum}) ON CONFLICT (version) DO NOTHING;\n",
            quoted = schema.quoted(),
            prefix = SchemaName::literal_of(&format!("{}, ", schema.quoted())),
            ledger = LEDGER_DDL,
            sql = self.sql,
            version = self.version,
            description = self.description,
            checksum = self.checksum(),
        )
    }

    /// FNV-1a over the file: detects an edited migration, nothing more (not
    /// a security property, so no cryptographic hash is needed).
    pub fn checksum(&self) -> i64 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in self.sql.bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        i64::from_ne_bytes(hash.to_ne_bytes())
    }
}

/// The schema, in version order. A test checks this list against the
/// directory, so a file added without an entry here fails the build's tests.
pub static MIGRATIONS: &[Migration] = &[
    Migration {
        version: 20261202000001,
        description: "create inbox messages",
        sql: include_str!("../20261202000001_create_inbox_messages.sql"),
    },
    Migration {
        version: 20261203000001,
        description: "processed at set by the claim",
        sql: include_str!("../20261203000001_processed_at_set_by_the_claim.sql"),
    },
    Migration {
        version: 20261204000001,
        description: "create outbox messages",
        sql: include_str!("../20261204000001_create_outbox_messages.sql"),
    },
    Migration {
        version: 20261204000002,
        description: "notify relays on enqueue",
        sql: include_str!("../20261204000002_notify_relays_on_enqueue.sql"),
    },
    Migration {
        version: 20261205000001,
        description: "create inbox attempts",
        sql: include_str!("../20261205000001_create_inbox_attempts.sql"),
    },
    Migration {
        version: 20261206000001,
        description: "outbox publish refusals",
        sql: include_str!("../20261206000001_outbox_publish_refusals.sql"),
    },
    Migration {
        version: 20261207000001,
        description: "outbox room for the lease",
        sql: include_str!("../20261207000001_outbox_room_for_the_lease.sql"),
    },
    Migration {
        version: 20261207000002,
        description: "outbox take plans by its batch",
        sql: include_str!("../20261207000002_outbox_take_plans_by_its_batch.sql"),
    },
    Migration {
        version: 20261208000001,
        description: "functions keep their schema",
        sql: include_str!("../20261208000001_functions_keep_their_schema.sql"),
    },
    Migration {
        version: 20261209000001,
        description: "inbox payload fingerprint",
        sql: include_str!("../20261209000001_inbox_payload_fingerprint.sql"),
    },
    Migration {
        version: 20261210000001,
        description: "inbox kept response",
        sql: include_str!("../20261210000001_inbox_kept_response.sql"),
    },
];

/// The ledger: one row per applied migration, in the store's schema.
pub const LEDGER_TABLE: &str = "inbox_schema_migrations";

/// Creates the ledger ([`LEDGER_TABLE`]) in the current schema if needed.
const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS inbox_schema_migrations (
             version     BIGINT      PRIMARY KEY,
             description TEXT        NOT NULL,
             checksum    BIGINT      NOT NULL,
             applied_at  TIMESTAMPTZ NOT NULL DEFAULT now()
         )";

/// Serialises concurrent runners (several instances starting at once) on
/// one transaction-scoped advisory lock, released by COMMIT, ROLLBACK or a
/// closed connection, so an interrupted runner cannot keep it. Any fixed
/// key works.
pub const ADVISORY_LOCK_KEY: i64 = 0x1b0c_d1e5;

/// Opens the runner's transaction on `schema`. Without a lock timeout: the
/// sessions' own ([`crate::SessionTimeouts`]) would fail a runner that
/// waits a few seconds on another instance's migration (the advisory lock)
/// or on a consumer's lock on a table it alters; a migration should wait
/// its turn. With the schema as `search_path` for this transaction only:
/// the migration files name their objects unqualified, so they run on any
/// connection (a user's pool, PgBouncer in transaction mode) and create
/// everything in `schema`, and the connection's own `search_path` is back
/// when the transaction ends.
fn begin(schema: &SchemaName) -> String {
    format!(
        "BEGIN; SET LOCAL lock_timeout = 0; SET LOCAL search_path TO {}",
        schema.quoted()
    )
}

/// What the runner needs from a driver: a connection it may use for one
/// transaction. Every statement it sends is parameterless.
#[async_trait]
pub trait MigrationConnection: Send {
    /// Runs `sql` (one or more statements) over the simple query protocol.
    async fn execute(&mut self, sql: &str) -> Result<(), InboxError>;

    /// Runs the query of the ledger, whose rows are two `int8` columns
    /// named `version` and `checksum`.
    async fn query_ledger(&mut self, sql: &str) -> Result<Vec<(i64, i64)>, InboxError>;

    /// Runs a query of one row and one `text` column.
    async fn query_text(&mut self, sql: &str) -> Result<Option<String>, InboxError>;
}

/// Creates `schema` if needed and applies the pending [`MIGRATIONS`] to it,
/// in one transaction, serialised against other runners. Returns the
/// versions applied (empty when up to date).
///
/// Any connection will do: the runner sets `search_path` to `schema` for
/// its own transaction only. Close the connection
/// afterwards if this future may have been dropped midway: it would still
/// be inside the transaction.
///
/// # Errors
/// [`InboxError::Schema`] when an applied migration's file
/// changed; the driver's errors otherwise.
pub async fn migrate<C: MigrationConnection>(
    conn: &mut C,
    schema: &SchemaName,
) -> Result<Vec<i64>, InboxError> {
    migrate_with_layout(conn, schema, Layout::Table).await
}

/// [`migrate`] for a schema whose inbox table has `layout`: a schema
/// without an inbox table gets that layout (the partitioned one's DDL runs
/// before the migrations, in the same transaction); a schema with one must
/// already have it, since a store sends its layout's statements.
///
/// # Errors
/// As [`migrate`]; [`InboxError::Schema`] when the schema's inbox table
/// has the other layout (converting one into the other means copying the
/// table, which this runner does not do behind an application's back).
pub async fn migrate_with_layout<C: MigrationConnection>(
    conn: &mut C,
    schema: &SchemaName,
    layout: Layout,
) -> Result<Vec<i64>, InboxError> {
    conn.execute(&begin(schema)).await?;
    match apply(conn, schema, layout).await {
        Ok(applied) => {
            conn.execute("COMMIT").await?;
            if !applied.is_empty() {
                tracing::info!(%schema, ?applied, "inbox schema migrated");
            }
            Ok(applied)
        }
        Err(error) => {
            // The caller closes this connection on error anyway; the
            // rollback is a courtesy to the server.
            if let Err(rollback) = conn.execute("ROLLBACK").await {
                tracing::debug!(error = %rollback, "rollback after a failed migration failed");
            }
            Err(error)
        }
    }
}

async fn apply<C: MigrationConnection>(
    conn: &mut C,
    schema: &SchemaName,
    layout: Layout,
) -> Result<Vec<i64>, InboxError> {
    conn.execute(&format!(
        "SELECT pg_advisory_xact_lock({ADVISORY_LOCK_KEY})"
    ))
    .await?;
    // Look before creating: CREATE SCHEMA needs the CREATE privilege on the
    // database even when the schema exists, which an application role on a
    // provisioned schema often lacks. Under the lock, no other runner
    // creates it in between.
    conn.execute(&format!(
        "DO $$ BEGIN \
           IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = {literal}) THEN \
             CREATE SCHEMA {quoted}; \
           END IF; \
         END $$",
        literal = schema.literal(),
        quoted = schema.quoted(),
    ))
    .await?;
    // search_path is resolved per statement, so a schema created after
    // connecting counts now.
    let current = conn.query_text("SELECT current_schema()::text").await?;
    if current.as_deref() != Some(schema.as_str()) {
        return Err(InboxError::InvalidArgument {
            message: format!(
                "the connection uses schema {current:?}, not {:?}: its search_path must name \
                 the store's schema",
                schema.as_str()
            ),
        });
    }
    conn.execute(LEDGER_DDL).await?;
    ensure_layout(conn, schema, layout).await?;
    let applied = conn
        .query_ledger(&format!("SELECT version, checksum FROM {LEDGER_TABLE}"))
        .await?;
    let mut newly = Vec::new();
    for migration in pending(&applied, schema)? {
        conn.execute(migration.sql).await?;
        // Version and checksum are integers, the description comes from a
        // file name of this crate (a test keeps it to [a-z0-9 ]).
        conn.execute(&format!(
            "INSERT INTO {LEDGER_TABLE} (version, description, checksum) VALUES ({}, '{}', {})",
            migration.version,
            migration.description,
            migration.checksum()
        ))
        .await?;
        tracing::info!(%schema, version = migration.version,
            description = migration.description, "applied migration");
        newly.push(migration.version);
    }
    Ok(newly)
}

/// Creates the partitioned table when `layout` asks for it and the schema
/// has no inbox table yet, and refuses a schema whose table has the other
/// layout.
async fn ensure_layout<C: MigrationConnection>(
    conn: &mut C,
    schema: &SchemaName,
    layout: Layout,
) -> Result<(), InboxError> {
    let kind = conn
        .query_text(
            "SELECT (SELECT relkind::text FROM pg_class WHERE oid = to_regclass('inbox_messages'))",
        )
        .await?;
    let found = match kind.as_deref() {
        None => {
            if layout == Layout::Partitioned {
                conn.execute(PARTITIONED_DDL).await?;
                tracing::info!(%schema, "partitioned inbox layout created");
            }
            return Ok(());
        }
        Some("p") => Layout::Partitioned,
        Some(_) => Layout::Table,
    };
    if found == layout {
        Ok(())
    } else {
        Err(InboxError::Schema {
            source: format!(
                "schema {schema} has the {found} inbox layout, but the store was configured for \
                 the {layout} layout"
            )
            .into(),
        })
    }
}

/// The migrations not yet in the ledger, given its `(version, checksum)`
/// rows, in order.
///
/// # Errors
/// [`InboxError::Schema`] when a recorded checksum differs from the
/// embedded file's: the database may not match the code, so refuse loudly.
pub fn pending(
    applied: &[(i64, i64)],
    schema: &SchemaName,
) -> Result<Vec<&'static Migration>, InboxError> {
    let mut pending = Vec::new();
    for migration in MIGRATIONS {
        match applied.iter().find(|(v, _)| *v == migration.version) {
            Some((_, recorded)) if *recorded == migration.checksum() => {}
            Some(_) => {
                return Err(InboxError::Schema {
                    source: format!(
                        "migration {} ({}) was applied to schema {schema} with different \
                         contents; migrations must not be edited once applied",
                        migration.version, migration.description
                    )
                    .into(),
                });
            }
            None => pending.push(migration),
        }
    }
    Ok(pending)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> SchemaName {
        SchemaName::new("inbox").expect("valid")
    }

    #[test]
    fn the_list_is_the_directory() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .expect("the crate directory")
            .map(|entry| {
                entry
                    .expect("an entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .filter(|name| name.ends_with(".sql"))
            .collect();
        files.sort();
        let listed: Vec<String> = MIGRATIONS
            .iter()
            .map(|m| format!("{}_{}.sql", m.version, m.description.replace(' ', "_")))
            .collect();
        assert_eq!(files, listed);
        for (file, migration) in files.iter().zip(MIGRATIONS) {
            let text = std::fs::read_to_string(dir.join(file)).expect("readable");
            assert_eq!(text, migration.sql, "{file}");
        }
    }

    #[test]
    fn migrations_are_ordered_and_quotable() {
        assert!(MIGRATIONS.windows(2).all(|w| w[0].version < w[1].version));
        for m in MIGRATIONS {
            assert!(
                m.description
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b' '),
                "{m:?}"
            );
            // The runner applies every pending file inside one transaction.
            assert!(
                !m.sql.trim_start().starts_with("-- no-transaction"),
                "{m:?}"
            );
        }
    }

    #[test]
    fn migrations_are_idempotent() {
        // Re-applying under a new ledger must be harmless (see the module
        // docs): every DDL statement says IF NOT EXISTS or OR REPLACE, or
        // is a COMMENT.
        for m in MIGRATIONS {
            let code: String = m
                .sql
                .lines()
                .filter(|line| !line.trim_start().starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n");
            // Dollar-quoted function bodies hold semicolons: blank them out.
            let code: String = code
                .split("$$")
                .enumerate()
                .map(|(i, part)| if i % 2 == 0 { part } else { " " })
                .collect();
            // String literals may hold semicolons: blank them out ('' is
            // an escaped quote, which toggling twice handles).
            let mut quoted = false;
            let code: String = code
                .chars()
                .map(|c| {
                    if c == '\'' {
                        quoted = !quoted;
                    }
                    if quoted { ' ' } else { c }
                })
                .collect();
            for statement in code.split(';').map(str::trim).filter(|s| !s.is_empty()) {
                let upper = statement.to_ascii_uppercase();
                let words = upper.split_whitespace().collect::<Vec<_>>().join(" ");
                // An ALTER TABLE that only adds columns, each IF NOT EXISTS.
                let adds_columns = words.starts_with("ALTER TABLE ")
                    && words.matches(" ADD ").count()
                        == words.matches(" ADD COLUMN IF NOT EXISTS ").count()
                    && [" DROP ", " RENAME ", " ALTER COLUMN ", " TYPE "]
                        .iter()
                        .all(|clause| !words.contains(clause));
                // A function's own setting, set again to the same value.
                let sets_a_function = words.starts_with("ALTER FUNCTION ")
                    && words.contains(" SET ")
                    && !words.contains(" RENAME ")
                    && !words.contains(" OWNER ");
                let ok = upper.starts_with("COMMENT ON ")
                    || sets_a_function
                    || upper.starts_with("CREATE OR REPLACE ")
                    || (upper.starts_with("CREATE ") && upper.contains(" IF NOT EXISTS "))
                    || adds_columns;
                assert!(ok, "migration {} is not idempotent: {statement}", m.version);
            }
        }
    }

    #[test]
    fn pending_follows_the_ledger() {
        let all: Vec<i64> = MIGRATIONS.iter().map(|m| m.version).collect();
        let got: Vec<i64> = pending(&[], &schema())
            .expect("fresh")
            .iter()
            .map(|m| m.version)
            .collect();
        assert_eq!(got, all);

        let first = &MIGRATIONS[0];
        let got: Vec<i64> = pending(&[(first.version, first.checksum())], &schema())
            .expect("one applied")
            .iter()
            .map(|m| m.version)
            .collect();
        assert_eq!(got, all[1..].to_vec());

        let done: Vec<(i64, i64)> = MIGRATIONS
            .iter()
            .map(|m| (m.version, m.checksum()))
            .collect();
        assert!(pending(&done, &schema()).expect("up to date").is_empty());

        let edited = [(first.version, first.checksum().wrapping_add(1))];
        let err = pending(&edited, &schema()).expect_err("edited");
        assert!(matches!(err, InboxError::Schema { .. }), "{err:?}");
        assert!(!err.is_retryable());
    }

    #[test]
    fn a_migration_for_a_users_tool_lands_in_the_schema_and_the_ledger() {
        let schema = SchemaName::new("app_inbox").expect("valid");
        let text = MIGRATIONS[0].sql_in(&schema);
        assert!(text.starts_with("CREATE SCHEMA IF NOT EXISTS \"app_inbox\";\n"));
        assert!(text.contains(
            "SELECT set_config('search_path', '\"app_inbox\", ' || current_setting('search_path'), true);"
        ));
        assert!(text.contains(MIGRATIONS[0].sql));
        assert!(text.ends_with(&format!(
            "VALUES ({}, 'create inbox messages', {}) ON CONFLICT (version) DO NOTHING;\n",
            MIGRATIONS[0].version,
            MIGRATIONS[0].checksum()
        )));
        assert!(LEDGER_DDL.contains(LEDGER_TABLE));
    }

    #[test]
    fn checksum_sees_edits() {
        let a = Migration {
            version: 1,
            description: "a",
            sql: "CREATE TABLE a",
        };
        let b = Migration {
            sql: "CREATE TABLE b",
            ..a
        };
        assert_eq!(a.checksum(), a.checksum());
        assert_ne!(a.checksum(), b.checksum());
    }
}
