//! Every SQL statement of the inbox, its attempt ledger and its outbox,
//! once, for every driver.
//!
//! Names are unqualified here, written once; a store sends them with its
//! schema qualified ([`crate::Statements`], built once per store, so each
//! stays constant and is prepared once per connection), and the migration
//! runner sets `search_path` for its own transaction. The schema name is
//! validated ([`crate::SchemaName`]) before it reaches any text. Parameters
//! are PostgreSQL's
//! positional `$n`; [`pieces`] splits a statement at them for drivers that
//! build statements from fragments and bind markers (diesel).

/// Claims one key: `$1` message id (uuid), `$2` consumer name (text), `$3`
/// the payload's fingerprint (bytea, NULL when the caller gave none; see
/// [`crate::fingerprint_column`]). Affects one row when the claim is fresh,
/// none for a duplicate (whose stored fingerprint is left as it was).
///
/// `INSERT … ON CONFLICT DO NOTHING`, the first statement of the
/// transaction: a concurrent claim of the same key waits on the primary
/// key's unique index until the holder ends, then sees its committed row
/// (a duplicate) or inserts its own. No check-then-insert, and no unique
/// violation for a duplicate. The claim records `processed_at` itself: the
/// row only becomes visible at COMMIT, together with the work, so a
/// committed row is a processed message. `now()` is the transaction's
/// start, like `received_at`'s default.
pub const CLAIM: &str = "INSERT INTO inbox_messages \
     (id, consumer_type, processed_at, payload_fingerprint) \
     VALUES ($1, $2, now(), $3) ON CONFLICT DO NOTHING";

/// The mark [`BEGIN_PIPELINED`] sets and the pipelined claims require, as
/// the condition of their `SELECT`.
macro_rules! pipelined_claim_guard {
    () => {
        " WHERE current_setting('inbox.pipelined_claim', true) = 'on'"
    };
}

/// Opens the transaction of a pipelined claim ([`CLAIM_PIPELINED`],
/// [`CLAIM_PARTITIONED_PIPELINED`]): a driver that pipelines sends this and
/// the claim together, without waiting for this one's answer, so the
/// message costs one round trip less than BEGIN and [`CLAIM`] apart.
///
/// `SET LOCAL` marks the session as inside this very transaction until it
/// ends, and the pipelined claims insert nothing without the mark. Sent
/// apart, the claim would otherwise depend on BEGIN having succeeded: after
/// a failed BEGIN it would run in a transaction of its own and commit at
/// once, recording the message without its work. With the mark it writes
/// nothing then, and the driver reports BEGIN's error. One simple-query
/// message, so the mark exists iff BEGIN succeeded.
pub const BEGIN_PIPELINED: &str = "BEGIN; SET LOCAL inbox.pipelined_claim = 'on'";

/// [`CLAIM`] for a pipeline behind [`BEGIN_PIPELINED`]: the same
/// parameters, row and outcome (the same `INSERT … ON CONFLICT DO NOTHING`,
/// waiting on a concurrent holder alike), inserting only inside the
/// transaction that BEGIN opened.
pub const CLAIM_PIPELINED: &str = concat!(
    "INSERT INTO inbox_messages (id, consumer_type, processed_at, payload_fingerprint) \
     SELECT $1::uuid, $2::text, now(), $3::bytea",
    pipelined_claim_guard!(),
    " ON CONFLICT DO NOTHING"
);

/// [`CLAIM_PARTITIONED`] for a pipeline behind [`BEGIN_PIPELINED`], as
/// [`CLAIM_PIPELINED`].
pub const CLAIM_PARTITIONED_PIPELINED: &str = concat!(
    "INSERT INTO inbox_messages \
     (id, consumer_type, processed_at, time_ordered, payload_fingerprint) \
     SELECT k.id, k.consumer_type, now(), inbox_time_ordered(k.id), k.fingerprint \
     FROM (SELECT $1::uuid AS id, $2::text AS consumer_type, $3::bytea AS fingerprint) AS k",
    pipelined_claim_guard!(),
    " ON CONFLICT DO NOTHING"
);

/// Claims a batch: `$1` message ids (uuid[]), `$2` consumer names (text[]),
/// `$3` fingerprints (bytea[], NULL where none), parallel arrays (see
/// [`crate::key_columns`]). Returns `(id uuid,
/// consumer_type text)` for each key inserted.
///
/// The keys are inserted in sorted order (bytewise, like `InboxKey`'s
/// `Ord`), so two overlapping batches take their row locks in one global
/// order and cannot deadlock. A key repeated in the batch conflicts with its
/// own first copy and is skipped. `processed_at` as in [`CLAIM`].
pub const CLAIM_BATCH: &str = "INSERT INTO inbox_messages \
     (id, consumer_type, processed_at, payload_fingerprint) \
     SELECT id, consumer_type, now(), fingerprint \
     FROM unnest($1::uuid[], $2::text[], $3::bytea[]) AS k(id, consumer_type, fingerprint) \
     ORDER BY id, consumer_type COLLATE \"C\" \
     ON CONFLICT DO NOTHING RETURNING id, consumer_type::text";

/// [`CLAIM`] in the partitioned layout ([`crate::Layout::Partitioned`]):
/// the same parameters and outcome, and the partition key `time_ordered`
/// computed from the id by the schema's own function, which the table's
/// CHECK holds every row to. A subquery names the id once, so each
/// parameter occurs once, in order (see [`pieces`]).
pub const CLAIM_PARTITIONED: &str = "INSERT INTO inbox_messages \
     (id, consumer_type, processed_at, time_ordered, payload_fingerprint) \
     SELECT k.id, k.consumer_type, now(), inbox_time_ordered(k.id), k.fingerprint \
     FROM (SELECT $1::uuid AS id, $2::text AS consumer_type, $3::bytea AS fingerprint) AS k \
     ON CONFLICT DO NOTHING";

/// [`CLAIM_BATCH`] in the partitioned layout, as [`CLAIM_PARTITIONED`].
pub const CLAIM_BATCH_PARTITIONED: &str = "INSERT INTO inbox_messages \
     (id, consumer_type, processed_at, time_ordered, payload_fingerprint) \
     SELECT id, consumer_type, now(), inbox_time_ordered(id), fingerprint \
     FROM unnest($1::uuid[], $2::text[], $3::bytea[]) AS k(id, consumer_type, fingerprint) \
     ORDER BY id, consumer_type COLLATE \"C\" \
     ON CONFLICT DO NOTHING RETURNING id, consumer_type::text";

/// Gives a key claimed in this transaction back: `$1` id, `$2` consumer.
///
/// Deleting the row this transaction inserted: a claim waiting on it waits
/// on this transaction, and finds no row once it ends.
pub const UNCLAIM: &str = "DELETE FROM inbox_messages WHERE id = $1 AND consumer_type = $2";

/// One committed row: `$1` id, `$2` consumer. Returns `(received_at
/// timestamptz, processed_at timestamptz NULL, payload_fingerprint bytea
/// NULL)`.
pub const LOOKUP: &str = "SELECT received_at, processed_at, payload_fingerprint FROM inbox_messages \
     WHERE id = $1 AND consumer_type = $2";

/// Keeps a response with a key this transaction claimed: `$1` id, `$2`
/// consumer, `$3` the response (bytea). Affects one row; none when the key
/// has no row (never claimed, or given back), which the stores refuse as
/// an invalid argument.
///
/// An UPDATE of the row the claim inserted, in the same transaction: it
/// becomes visible at COMMIT with the claim and the work, and vanishes
/// with them on rollback.
pub const KEEP_RESPONSE: &str = "UPDATE inbox_messages SET response = $3 \
     WHERE id = $1 AND consumer_type = $2";

/// The response kept with one committed row: `$1` id, `$2` consumer.
/// Returns `(response bytea NULL)`, no row when the key has none.
pub const KEPT_RESPONSE: &str = "SELECT response FROM inbox_messages \
     WHERE id = $1 AND consumer_type = $2";

/// One batch of the inbox's cleanup on `$table` ([`PURGE_BATCH`] says
/// what it does), written once for both layouts.
macro_rules! purge_batch {
    ($table:literal) => {
        concat!(
            "WITH gone AS (DELETE FROM ",
            $table,
            " WHERE ctid = ANY(ARRAY(SELECT ctid FROM ",
            $table,
            " WHERE processed_at < $1 AND processed_at >= coalesce($2::timestamptz, '-infinity') \
             ORDER BY processed_at LIMIT $3 FOR UPDATE SKIP LOCKED)) RETURNING processed_at) \
             SELECT count(*)::int8 AS deleted, max(processed_at) AS last FROM gone"
        )
    };
}

/// One batch of cleanup, in one statement and so in one short transaction:
/// `$1` cutoff (timestamptz), `$2` where to resume (timestamptz, NULL for
/// the first batch), `$3` batch size (int8). Returns one row: `(deleted
/// int8, last timestamptz NULL)`, the rows deleted and the latest
/// `processed_at` among them, which the next batch passes as `$2`.
///
/// The inner SELECT walks the partial index `inbox_messages_processed_at_idx`
/// in `processed_at` order from `$2` and stops after `$3` rows. Starting at
/// `$2` is what keeps the batches of a long purge equally cheap: the index
/// entries of the rows earlier batches deleted stay in the index until
/// VACUUM, and a batch starting at the index's head would walk all of them
/// (measured: +1,200 buffers per batch for every 250,000 rows deleted
/// before it). `>=`, not `>`: rows sharing the last batch's `processed_at`
/// may not all have fit in it. `FOR UPDATE SKIP LOCKED` lets several
/// instances clean at once without blocking or failing each other
/// (MassTransit #3996), each taking rows the others have not. Deleting by
/// `ctid` then goes straight to the locked tuples (a TID scan); deleting by
/// primary key instead (`(id, consumer_type) IN (…)`) plans as a hash
/// semi-join over a sequential scan of the whole table.
pub const PURGE_BATCH: &str = purge_batch!("inbox_messages");

/// [`PURGE_BATCH`] in the partitioned layout: only the untimed partition's
/// rows (ids without time) are deleted one by one; the day partitions go
/// whole ([`crate::drop_expired_partitions`]).
pub const PURGE_UNTIMED_BATCH: &str = purge_batch!("inbox_messages_untimed");

/// The partitioned layout's day tables in the connection's schema, as one
/// text `name:state,…` (NULL when there are none), state `attached`,
/// `pending` (a detach interrupted halfway) or `detached` (a detached
/// table whose drop was interrupted).
pub const DAY_PARTITIONS: &str = "SELECT string_agg(c.relname::text || ':' || \
     CASE WHEN i.inhrelid IS NULL THEN 'detached' \
          WHEN i.inhdetachpending THEN 'pending' ELSE 'attached' END, ',' ORDER BY c.relname) \
     FROM pg_class AS c LEFT JOIN pg_inherits AS i ON i.inhrelid = c.oid \
     WHERE c.relnamespace = to_regnamespace(current_schema()) AND c.relkind = 'r' \
     AND c.relname ~ '^inbox_messages_p[0-9]{8}$'";

/// The partitions of the connection's schema's inbox table (NULL when it
/// has none, or is not partitioned), as one text with one line per
/// partition, `name TAB bounds TAB estimated rows`: the bounds as
/// PostgreSQL states them, the rows as the planner estimates them
/// (`reltuples` per page times the table's pages now), empty when the
/// partition was never analyzed. Never a `count(*)`: the listing must not
/// read a large day to print a number.
pub const PARTITIONS: &str = "SELECT string_agg(c.relname::text || E'\\t' || \
     pg_get_expr(c.relpartbound, c.oid) || \
     CASE WHEN i.inhdetachpending THEN ' (detach pending)' ELSE '' END || E'\\t' || \
     coalesce(CASE WHEN c.reltuples < 0 THEN NULL WHEN c.relpages = 0 THEN c.reltuples::int8 \
     ELSE (c.reltuples::float8 / c.relpages * (pg_relation_size(c.oid) \
     / current_setting('block_size')::int8))::int8 END::text, ''), E'\\n' ORDER BY c.relname) \
     FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid \
     WHERE i.inhparent = to_regclass('inbox_messages')";

/// Committed inbox rows per consumer. Returns `(consumer_type text, count
/// int8)`.
pub const PROCESSED_COUNTS: &str = "SELECT consumer_type::text, count(*) \
     FROM inbox_messages GROUP BY consumer_type";

/// Records one failed delivery, in one statement and so outside the
/// handler's (rolled-back) transaction: `$1` message id (uuid), `$2`
/// consumer (text), `$3` the error's text. Returns the count including this
/// failure (int4).
///
/// One upsert, so concurrent failures of one key each add one (the row
/// lock of `ON CONFLICT DO UPDATE` serialises them; no read-then-write).
/// Every `SET` expression reads the old row: a row marked dead starts a
/// fresh count at one, its dead mark cleared (a replay after a fix).
pub const RECORD_FAILURE: &str = "INSERT INTO inbox_attempts AS a \
     (message_id, consumer, attempts, last_error) VALUES ($1, $2, 1, $3) \
     ON CONFLICT (message_id, consumer) DO UPDATE SET \
     attempts = CASE WHEN a.dead_at IS NULL THEN a.attempts + 1 ELSE 1 END, \
     first_failed_at = CASE WHEN a.dead_at IS NULL THEN a.first_failed_at ELSE now() END, \
     last_error = EXCLUDED.last_error, last_failed_at = now(), \
     dead_at = NULL, dead_reason = NULL \
     RETURNING attempts";

/// Marks a message dead-lettered: `$1` message id, `$2` consumer, `$3` the
/// error's text, `$4` the reason label. A key without a row (dead at its
/// first failure) gets one counting that failure; an existing row keeps its
/// count and takes the error as its last.
pub const MARK_DEAD: &str = "INSERT INTO inbox_attempts AS a \
     (message_id, consumer, attempts, last_error, dead_at, dead_reason) \
     VALUES ($1, $2, 1, $3, now(), $4) \
     ON CONFLICT (message_id, consumer) DO UPDATE SET \
     last_error = EXCLUDED.last_error, last_failed_at = now(), \
     dead_at = now(), dead_reason = EXCLUDED.dead_reason";

/// The columns of one ledger row, as [`crate::AttemptColumns`] reads them,
/// for a statement that names the table `a`.
macro_rules! attempt_row_columns {
    () => {
        "a.message_id, a.consumer::text AS consumer, a.attempts, a.last_error, \
         a.first_failed_at, a.last_failed_at, a.dead_at, a.dead_reason::text AS dead_reason"
    };
}

/// One key's ledger row: `$1` message id, `$2` consumer. Returns the
/// columns of [`crate::AttemptColumns`].
pub const LOOKUP_ATTEMPTS: &str = concat!(
    "SELECT ",
    attempt_row_columns!(),
    " FROM inbox_attempts AS a WHERE a.message_id = $1 AND a.consumer = $2"
);

/// Dead rows, newest first: `$1` consumer (text, NULL for every consumer),
/// `$2` limit (int8). Returns the columns of [`crate::AttemptColumns`].
///
/// Walks the partial index of dead rows; a message processed since (its
/// inbox row committed: a replay that succeeded) is left out.
pub const DEAD_MESSAGES: &str = concat!(
    "SELECT ",
    attempt_row_columns!(),
    " FROM inbox_attempts AS a \
     WHERE a.dead_at IS NOT NULL AND a.consumer = COALESCE($1, a.consumer) \
     AND NOT EXISTS (SELECT 1 FROM inbox_messages AS m \
                     WHERE m.id = a.message_id AND m.consumer_type = a.consumer) \
     ORDER BY a.dead_at DESC LIMIT $2"
);

/// One batch of ledger cleanup: `$1` cutoff (timestamptz), `$2` batch size
/// (int8). Affects the rows deleted. The shape of [`PURGE_BATCH`] without
/// its resume point (the ledger holds failures only, a small table),
/// through the index on `last_failed_at`.
pub const PURGE_ATTEMPTS_BATCH: &str = "DELETE FROM inbox_attempts WHERE ctid = ANY(ARRAY(\
     SELECT ctid FROM inbox_attempts WHERE last_failed_at < $1 \
     ORDER BY last_failed_at LIMIT $2 FOR UPDATE SKIP LOCKED))";

/// The columns of one outgoing row, as [`crate::OutboxRow`] reads them,
/// for a statement that names the table `o`. The headers come back as two
/// arrays sorted by name, so drivers decode text arrays, not JSON.
macro_rules! outbox_row_columns {
    () => {
        "o.message_id, o.position, o.exchange::text AS exchange, \
         o.routing_key::text AS routing_key, o.message_type::text AS message_type, \
         ARRAY(SELECT h.key FROM jsonb_each_text(o.headers) AS h ORDER BY h.key) AS header_names, \
         ARRAY(SELECT h.value FROM jsonb_each_text(o.headers) AS h ORDER BY h.key) AS header_values, \
         o.body, o.created_at, o.published_at, o.locked_until, o.attempts, \
         o.failures, o.last_error, o.next_attempt_at, o.dead_at"
    };
}

/// Enqueues one outgoing message in the caller's transaction: `$1`
/// message id (uuid), `$2` exchange, `$3` routing key, `$4` type (text),
/// `$5` header names and `$6` header values (text[], parallel, see
/// [`crate::header_columns`]), `$7` body (bytea). Affects one row when
/// enqueued, none when the id exists.
///
/// `ON CONFLICT DO NOTHING`, like the claim: the same id twice is an
/// outcome, not a unique violation, and an enqueue of an id another open
/// transaction enqueued waits for it. The row is invisible to relays until
/// COMMIT, and gone with a rollback.
pub const ENQUEUE: &str = "INSERT INTO outbox_messages \
     (message_id, exchange, routing_key, message_type, headers, body) \
     VALUES ($1, $2, $3, $4, jsonb_object($5::text[], $6::text[]), $7) \
     ON CONFLICT (message_id) DO NOTHING";

/// Leases the oldest due messages, in one statement and so one short
/// transaction: `$1` lease length in milliseconds (float8), `$2` lease id
/// (uuid), `$3` batch size (int8). Returns the leased rows (in no
/// particular order: [`crate::lease_from_rows`] sorts them).
///
/// The take itself is the function `outbox_take` of migration
/// `20261207000002_outbox_take_plans_by_its_batch.sql`, which says what it
/// locks and why it runs under its own planner settings: right after a
/// burst of enqueues, stale statistics made the planner read the whole
/// backlog for every take.
pub const TAKE_PENDING: &str = concat!(
    "SELECT ",
    outbox_row_columns!(),
    " FROM outbox_take($1::float8, $2::uuid, $3::int8) AS o"
);

/// Marks messages published: `$1` message ids (uuid[]). Affects the rows
/// that were still pending; repeating it changes nothing.
///
/// Not restricted to the caller's lease: whoever got the broker's confirm
/// knows the message went out, even if its lease ran out meanwhile.
pub const MARK_PUBLISHED: &str = "UPDATE outbox_messages \
     SET published_at = now(), locked_until = NULL, lease_id = NULL \
     WHERE message_id = ANY($1) AND published_at IS NULL";

/// Gives a lease's unpublished messages back: `$1` message ids (uuid[]),
/// `$2` lease id. Rows another lease took since (after this one expired)
/// keep that lease. By primary key, so no index on `lease_id` is needed.
pub const RELEASE: &str = "UPDATE outbox_messages SET locked_until = NULL, lease_id = NULL \
     WHERE message_id = ANY($1) AND lease_id = $2 AND published_at IS NULL";

/// One committed outgoing row: `$1` message id. Returns the columns of
/// [`crate::OutboxRow`].
pub const LOOKUP_OUTGOING: &str = concat!(
    "SELECT ",
    outbox_row_columns!(),
    " FROM outbox_messages AS o WHERE o.message_id = $1"
);

/// Committed messages not yet published, dead ones not counted. Returns
/// one int8.
pub const PENDING_COUNT: &str =
    "SELECT count(*) FROM outbox_messages WHERE published_at IS NULL AND dead_at IS NULL";

/// Counts the dead outgoing messages (through the partial index of dead
/// rows, which are rare).
pub const DEAD_COUNT: &str = "SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL";

/// Records the broker's refusals of messages a lease holds: `$1` message
/// ids (uuid[]), `$2` the broker's answers (text[], parallel), `$3` lease
/// id, `$4` base delay and `$5` longest delay (milliseconds, float8), `$6`
/// the retry limit (int4). Returns (message_id, dead) per charged row.
///
/// The `n`th refusal waits `$4 × 2^(n−1)` ms, at most `$5`
/// (`inbox_api::PublishRetry::delay`); the `$6`th sets `dead_at`. The
/// lease lets go at once: `next_attempt_at` is the retry delay now. Only
/// rows this lease still holds, unpublished and alive, are charged, so a
/// repeated call charges nothing twice.
pub const RECORD_REFUSALS: &str = "UPDATE outbox_messages AS o \
     SET failures = o.failures + 1, last_error = r.error, \
         locked_until = NULL, lease_id = NULL, \
         next_attempt_at = CASE WHEN o.failures + 1 >= p.max_attempts THEN NULL \
             ELSE now() + least(p.max_ms, p.base_ms * power(2, least(o.failures, 40))) \
                 * interval '1 millisecond' END, \
         dead_at = CASE WHEN o.failures + 1 >= p.max_attempts THEN now() END \
     FROM unnest($1::uuid[], $2::text[]) AS r(message_id, error), \
          (SELECT $3::uuid AS lease_id, $4::float8 AS base_ms, $5::float8 AS max_ms, \
                  $6::int4 AS max_attempts) AS p \
     WHERE o.message_id = r.message_id AND o.lease_id = p.lease_id \
       AND o.published_at IS NULL AND o.dead_at IS NULL \
     RETURNING o.message_id, o.dead_at IS NOT NULL AS dead";

/// The dead outgoing rows, the most recently dead first: `$1` limit
/// (int8). Returns the columns of [`crate::OutboxRow`].
pub const DEAD_OUTGOING: &str = concat!(
    "SELECT ",
    outbox_row_columns!(),
    " FROM outbox_messages AS o WHERE o.dead_at IS NOT NULL \
     ORDER BY o.dead_at DESC, o.position DESC LIMIT $1"
);

/// Makes dead rows pending again with a fresh count: `$1` message ids
/// (uuid[]). Affects the rows that were dead. `last_error` stays, for
/// whoever looks at the row next.
pub const REQUEUE_DEAD: &str = "UPDATE outbox_messages \
     SET dead_at = NULL, failures = 0, next_attempt_at = NULL, \
         locked_until = NULL, lease_id = NULL \
     WHERE message_id = ANY($1) AND dead_at IS NOT NULL AND published_at IS NULL";

/// One batch of outbox cleanup: `$1` cutoff (timestamptz), `$2` batch size
/// (int8). Affects the rows deleted. The shape of [`PURGE_BATCH`] without
/// its resume point, through the partial index on `published_at`; pending
/// rows have none and are never deleted.
pub const PURGE_PUBLISHED_BATCH: &str = "DELETE FROM outbox_messages WHERE ctid = ANY(ARRAY(\
     SELECT ctid FROM outbox_messages WHERE published_at < $1 \
     ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED))";

/// A part of a statement: text to send as it is, or a parameter marker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece<'a> {
    /// SQL text.
    Text(&'a str),
    /// The parameter `$n` (1-based).
    Param(usize),
}

/// Splits `sql` into text and `$n` markers, in order.
///
/// For drivers whose query builders emit their own placeholders (diesel's
/// `push_bind_param`): they send the text pieces and bind the parameter a
/// marker names. The statements have no `$` inside string literals, no dollar
/// quoting, so every `$` followed by digits is a parameter.
pub fn pieces(sql: &str) -> Vec<Piece<'_>> {
    let bytes = sql.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'$' {
            let digits = bytes[i + 1..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count();
            if digits > 0 {
                let number = &sql[i + 1..i + 1 + digits];
                if let Ok(n) = number.parse() {
                    if start < i {
                        out.push(Piece::Text(&sql[start..i]));
                    }
                    out.push(Piece::Param(n));
                    i += 1 + digits;
                    start = i;
                    continue;
                }
            }
        }
        i += 1;
    }
    if start < sql.len() {
        out.push(Piece::Text(&sql[start..]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_split_at_parameters() {
        assert_eq!(
            pieces("SELECT $1, x FROM t WHERE y = $12"),
            vec![
                Piece::Text("SELECT "),
                Piece::Param(1),
                Piece::Text(", x FROM t WHERE y = "),
                Piece::Param(12),
            ]
        );
        assert_eq!(pieces("SELECT 1"), vec![Piece::Text("SELECT 1")]);
        assert_eq!(pieces("$1$2"), vec![Piece::Param(1), Piece::Param(2)]);
        assert_eq!(pieces("a $ b"), vec![Piece::Text("a $ b")]);
    }

    #[test]
    fn statements_use_their_parameters_in_order() {
        for (sql, count) in [
            (CLAIM, 3),
            (CLAIM_BATCH, 3),
            (CLAIM_PARTITIONED, 3),
            (CLAIM_BATCH_PARTITIONED, 3),
            (CLAIM_PIPELINED, 3),
            (CLAIM_PARTITIONED_PIPELINED, 3),
            (BEGIN_PIPELINED, 0),
            (PURGE_UNTIMED_BATCH, 3),
            (DAY_PARTITIONS, 0),
            (PARTITIONS, 0),
            (UNCLAIM, 2),
            (LOOKUP, 2),
            (PURGE_BATCH, 3),
            (PROCESSED_COUNTS, 0),
            (RECORD_FAILURE, 3),
            (MARK_DEAD, 4),
            (LOOKUP_ATTEMPTS, 2),
            (DEAD_MESSAGES, 2),
            (PURGE_ATTEMPTS_BATCH, 2),
            (ENQUEUE, 7),
            (TAKE_PENDING, 3),
            (MARK_PUBLISHED, 1),
            (RELEASE, 2),
            (LOOKUP_OUTGOING, 1),
            (PENDING_COUNT, 0),
            (DEAD_COUNT, 0),
            (RECORD_REFUSALS, 6),
            (DEAD_OUTGOING, 1),
            (REQUEUE_DEAD, 1),
            (PURGE_PUBLISHED_BATCH, 2),
        ] {
            let params: Vec<usize> = pieces(sql)
                .into_iter()
                .filter_map(|p| match p {
                    Piece::Param(n) => Some(n),
                    Piece::Text(_) => None,
                })
                .collect();
            assert_eq!(params, (1..=count).collect::<Vec<_>>(), "{sql}");
            // Rebuilt from its pieces, the statement is itself again.
            let rebuilt: String = pieces(sql)
                .into_iter()
                .map(|p| match p {
                    Piece::Text(t) => t.to_owned(),
                    Piece::Param(n) => format!("${n}"),
                })
                .collect();
            assert_eq!(rebuilt, sql);
        }
    }
}
