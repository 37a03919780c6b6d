//! The statements of [`crate::sql`] with the store's schema written into
//! them: [`Statements`].

use crate::layout::Layout;
use crate::{SchemaName, sql};

/// The objects of the inbox's schema that statements name. Longest first,
/// so that `inbox_messages_untimed` is not read as `inbox_messages`.
const OBJECTS: &[&str] = &[
    "inbox_messages_untimed",
    "inbox_time_ordered",
    "outbox_messages",
    "inbox_messages",
    "inbox_attempts",
    "outbox_take",
];

/// `sql` with every object of the inbox's schema that it names
/// (`inbox_messages`, `outbox_messages`, `inbox_attempts`, `outbox_take`,
/// …) qualified by `schema` as a quoted identifier.
///
/// Why qualify instead of relying on `search_path`: a user's pool has the
/// user's `search_path` (often `public`, where their own tables are), and
/// PgBouncer in transaction mode cannot keep a session setting at all. A
/// qualified name resolves the same on any connection, and the user's
/// unqualified tables keep resolving through their own `search_path`.
///
/// Only whole identifiers outside string literals are qualified, and
/// only where they are not already qualified (`x.inbox_messages`).
pub fn qualify(sql: &str, schema: &SchemaName) -> String {
    let quoted = schema.quoted();
    let bytes = sql.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut out = String::with_capacity(sql.len() + 8 * quoted.len());
    let mut in_literal = false;
    let mut i = 0;
    'scan: while i < bytes.len() {
        let b = bytes[i];
        if b == b'\'' {
            in_literal = !in_literal;
        } else if !in_literal && (i == 0 || !(ident(bytes[i - 1]) || bytes[i - 1] == b'.')) {
            for object in OBJECTS {
                let end = i + object.len();
                if sql[i..].starts_with(object) && (end == bytes.len() || !ident(bytes[end])) {
                    out.push_str(&quoted);
                    out.push('.');
                    out.push_str(object);
                    i = end;
                    continue 'scan;
                }
            }
        }
        // Advance by one character (statements may hold non-ASCII text).
        let width = sql[i..].chars().next().map_or(1, char::len_utf8);
        out.push_str(&sql[i..i + width]);
        i += width;
    }
    out
}

/// Every statement a store sends on its hot paths (claims, cleanup, the
/// attempt ledger, the outbox), rendered once per store with the schema
/// qualified ([`qualify`]): the text [`crate::sql`] documents, in one
/// schema. Both drivers send these, so neither depends on the connection's
/// `search_path`.
///
/// Built once when the store is built and shared by its transactions
/// (clone it into an `Arc`): the text never changes afterwards, so a
/// driver's statement cache still prepares each one once per connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Statements {
    /// The claim of one key in the store's layout ([`sql::CLAIM`]).
    pub claim: String,
    /// The pipelined claim ([`sql::CLAIM_PIPELINED`]) in the layout.
    pub claim_pipelined: String,
    /// The batch claim ([`sql::CLAIM_BATCH`]) in the layout.
    pub claim_batch: String,
    /// [`sql::UNCLAIM`].
    pub unclaim: String,
    /// [`sql::LOOKUP`].
    pub lookup: String,
    /// [`sql::KEEP_RESPONSE`].
    pub keep_response: String,
    /// [`sql::KEPT_RESPONSE`].
    pub kept_response: String,
    /// The inbox's cleanup batch in the layout ([`sql::PURGE_BATCH`]).
    pub purge_batch: String,
    /// [`sql::PROCESSED_COUNTS`].
    pub processed_counts: String,
    /// [`sql::RECORD_FAILURE`].
    pub record_failure: String,
    /// [`sql::MARK_DEAD`].
    pub mark_dead: String,
    /// [`sql::LOOKUP_ATTEMPTS`].
    pub lookup_attempts: String,
    /// [`sql::DEAD_MESSAGES`].
    pub dead_messages: String,
    /// [`sql::PURGE_ATTEMPTS_BATCH`].
    pub purge_attempts_batch: String,
    /// [`sql::ENQUEUE`].
    pub enqueue: String,
    /// [`sql::TAKE_PENDING`].
    pub take_pending: String,
    /// [`sql::MARK_PUBLISHED`].
    pub mark_published: String,
    /// [`sql::RELEASE`].
    pub release: String,
    /// [`sql::LOOKUP_OUTGOING`].
    pub lookup_outgoing: String,
    /// [`sql::PENDING_COUNT`].
    pub pending_count: String,
    /// [`sql::DEAD_COUNT`].
    pub dead_count: String,
    /// [`sql::RECORD_REFUSALS`].
    pub record_refusals: String,
    /// [`sql::DEAD_OUTGOING`].
    pub dead_outgoing: String,
    /// [`sql::REQUEUE_DEAD`].
    pub requeue_dead: String,
    /// [`sql::PURGE_PUBLISHED_BATCH`].
    pub purge_published_batch: String,
}

impl Statements {
    /// The statements of a store in `schema` whose inbox table has
    /// `layout`.
    pub fn new(schema: &SchemaName, layout: Layout) -> Self {
        let q = |sql: &str| qualify(sql, schema);
        Self {
            claim: q(layout.claim()),
            claim_pipelined: q(layout.claim_pipelined()),
            claim_batch: q(layout.claim_batch()),
            unclaim: q(sql::UNCLAIM),
            lookup: q(sql::LOOKUP),
            keep_response: q(sql::KEEP_RESPONSE),
            kept_response: q(sql::KEPT_RESPONSE),
            purge_batch: q(layout.purge_batch()),
            processed_counts: q(sql::PROCESSED_COUNTS),
            record_failure: q(sql::RECORD_FAILURE),
            mark_dead: q(sql::MARK_DEAD),
            lookup_attempts: q(sql::LOOKUP_ATTEMPTS),
            dead_messages: q(sql::DEAD_MESSAGES),
            purge_attempts_batch: q(sql::PURGE_ATTEMPTS_BATCH),
            enqueue: q(sql::ENQUEUE),
            take_pending: q(sql::TAKE_PENDING),
            mark_published: q(sql::MARK_PUBLISHED),
            release: q(sql::RELEASE),
            lookup_outgoing: q(sql::LOOKUP_OUTGOING),
            pending_count: q(sql::PENDING_COUNT),
            dead_count: q(sql::DEAD_COUNT),
            record_refusals: q(sql::RECORD_REFUSALS),
            dead_outgoing: q(sql::DEAD_OUTGOING),
            requeue_dead: q(sql::REQUEUE_DEAD),
            purge_published_batch: q(sql::PURGE_PUBLISHED_BATCH),
        }
    }

    /// Every statement, for checks over all of them.
    pub fn all(&self) -> [&str; 25] {
        [
            &self.claim,
            &self.claim_pipelined,
            &self.claim_batch,
            &self.unclaim,
            &self.lookup,
            &self.keep_response,
            &self.kept_response,
            &self.purge_batch,
            &self.processed_counts,
            &self.record_failure,
            &self.mark_dead,
            &self.lookup_attempts,
            &self.dead_messages,
            &self.purge_attempts_batch,
            &self.enqueue,
            &self.take_pending,
            &self.mark_published,
            &self.release,
            &self.lookup_outgoing,
            &self.pending_count,
            &self.dead_count,
            &self.record_refusals,
            &self.dead_outgoing,
            &self.requeue_dead,
            &self.purge_published_batch,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> SchemaName {
        SchemaName::new("app_inbox").expect("valid")
    }

    #[test]
    fn qualifies_whole_names_only() {
        let s = schema();
        assert_eq!(
            qualify(sql::CLAIM, &s),
            "INSERT INTO \"app_inbox\".inbox_messages \
             (id, consumer_type, processed_at, payload_fingerprint) \
             VALUES ($1, $2, now(), $3) ON CONFLICT DO NOTHING"
        );
        assert_eq!(
            qualify(
                "SELECT 1 FROM inbox_messages_untimed, x.inbox_messages, my_inbox_messages",
                &s
            ),
            "SELECT 1 FROM \"app_inbox\".inbox_messages_untimed, x.inbox_messages, my_inbox_messages"
        );
        assert_eq!(
            qualify("SELECT 'inbox_messages' FROM inbox_attempts", &s),
            "SELECT 'inbox_messages' FROM \"app_inbox\".inbox_attempts"
        );
        assert!(qualify(sql::TAKE_PENDING, &s).contains(" FROM \"app_inbox\".outbox_take($1"));
        assert!(
            qualify(sql::CLAIM_PARTITIONED, &s).contains("\"app_inbox\".inbox_time_ordered(k.id)")
        );
    }

    #[test]
    fn every_statement_names_its_tables_in_the_schema() {
        for layout in [Layout::Table, Layout::Partitioned] {
            let statements = Statements::new(&schema(), layout);
            for statement in statements.all() {
                assert!(statement.contains("\"app_inbox\"."), "{statement}");
                // No object of the schema left unqualified.
                let unqualified = qualify(statement, &SchemaName::new("x").expect("valid"));
                assert_eq!(unqualified, statement, "{statement}");
                // Parameters and text otherwise unchanged.
                assert_eq!(
                    sql::pieces(statement)
                        .iter()
                        .filter(|p| matches!(p, sql::Piece::Param(_)))
                        .count(),
                    sql::pieces(&statement.replace("\"app_inbox\".", ""))
                        .iter()
                        .filter(|p| matches!(p, sql::Piece::Param(_)))
                        .count()
                );
            }
        }
    }
}
