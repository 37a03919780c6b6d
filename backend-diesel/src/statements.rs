//! The hot statements as query fragments that diesel-async prepares once per
//! connection (in [`inbox_postgres::Pooling::Session`]).
//!
//! diesel marks every `sql_query` and every `INSERT … SELECT` built by hand
//! unsafe to cache, so diesel-async prepares them anew on every call: a
//! round trip and a parse of their own per message (measured on the
//! processed-mark UPDATE the inbox used to run: re-prepared, the diesel
//! inbox ran at 0.74 of the sqlx inbox at 16 tasks). The SQL text is
//! the store's [`inbox_postgres::Statements`] (its schema qualified), sent
//! piece by piece with diesel's own bind markers; it is fixed per store, so
//! the statement cache keeps it under its text (no static [`QueryId`]:
//! two stores in two schemas on one pool must not share a cache entry). The rarer statements (unclaim, lookup, purge, the outbox's marks
//! and counts) go through `sql_query`; the outbox's enqueue (the producer's
//! hot path) and take (the relay's) are fragments too.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::result::{Error as DieselError, QueryResult};
use diesel::sql_types::{Array, BigInt, Bytea, Integer, Nullable, Text, Timestamptz, Uuid};
use inbox_api::{InboxKey, OutgoingMessage};
use inbox_postgres::sql::{self, Piece};

/// Sends `statement`, binding its parameter `$n` with `bind(n, out)`.
fn walk<'b>(
    statement: &'b str,
    out: &mut AstPass<'_, 'b, Pg>,
    mut bind: impl FnMut(usize, &mut AstPass<'_, 'b, Pg>) -> QueryResult<()>,
) -> QueryResult<()> {
    for piece in sql::pieces(statement) {
        match piece {
            Piece::Text(text) => out.push_sql(text),
            Piece::Param(n) => bind(n, out)?,
        }
    }
    Ok(())
}

fn no_such_parameter(n: usize) -> DieselError {
    DieselError::QueryBuilderError(format!("statement has no parameter ${n}").into())
}

/// A statement whose text is not known at compile time: the cache keys
/// it by its text.
macro_rules! cached_by_text {
    ($($t:tt)*) => {
        impl QueryId for $($t)* {
            type QueryId = ();
            const HAS_STATIC_QUERY_ID: bool = false;
        }
    };
}

/// The store's claim of one key ([`sql::CLAIM`] in its layout and schema,
/// or the pipelined form, [`sql::CLAIM_PIPELINED`]); executes to the rows
/// inserted (0 or 1).
pub(crate) struct ClaimOne<'k> {
    sql: &'k str,
    key: &'k InboxKey,
    /// `$3`, owned here so the bind outlives the statement's walk.
    fingerprint: Option<Vec<u8>>,
}

impl<'k> ClaimOne<'k> {
    pub(crate) fn new(sql: &'k str, key: &'k InboxKey) -> Self {
        Self {
            sql,
            key,
            fingerprint: inbox_postgres::fingerprint_column(key),
        }
    }
}

cached_by_text!(ClaimOne<'_>);

impl QueryFragment<Pg> for ClaimOne<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        let key = self.key;
        walk(self.sql, &mut out, |n, out| match n {
            1 => out.push_bind_param::<Uuid, _>(key.message_id.as_uuid()),
            2 => out.push_bind_param::<Text, _>(key.consumer.as_str()),
            3 => out.push_bind_param::<Nullable<Bytea>, _>(&self.fingerprint),
            n => Err(no_such_parameter(n)),
        })
    }
}

/// [`sql::CLAIM_BATCH`] (in the store's layout and schema) over the keys as
/// parallel arrays; loads the `(id, consumer)` rows inserted.
pub(crate) struct ClaimBatch<'s> {
    sql: &'s str,
    columns: inbox_postgres::KeyColumns,
}

impl<'s> ClaimBatch<'s> {
    pub(crate) fn of(sql: &'s str, keys: &[InboxKey]) -> Self {
        Self {
            sql,
            columns: inbox_postgres::key_columns(keys),
        }
    }
}

cached_by_text!(ClaimBatch<'_>);

impl Query for ClaimBatch<'_> {
    type SqlType = (Uuid, Text);
}

impl QueryFragment<Pg> for ClaimBatch<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        walk(self.sql, &mut out, |n, out| match n {
            1 => out.push_bind_param::<Array<Uuid>, _>(&self.columns.ids),
            2 => out.push_bind_param::<Array<Text>, _>(&self.columns.consumers),
            3 => out.push_bind_param::<Array<Nullable<Bytea>>, _>(&self.columns.fingerprints),
            n => Err(no_such_parameter(n)),
        })
    }
}

/// The SQL types of [`inbox_postgres::OutboxColumns`].
type OutboxSqlType = (
    Uuid,
    BigInt,
    Text,
    Text,
    Text,
    Array<Text>,
    Array<Text>,
    Bytea,
    Timestamptz,
    Nullable<Timestamptz>,
    Nullable<Timestamptz>,
    Integer,
    Integer,
    Nullable<Text>,
    Nullable<Timestamptz>,
    Nullable<Timestamptz>,
);

/// [`sql::ENQUEUE`] for one message, in the producer's transaction (its
/// hot path, so prepared once); executes to the rows inserted (0 or 1).
pub(crate) struct Enqueue<'m> {
    pub(crate) sql: &'m str,
    pub(crate) id: uuid::Uuid,
    pub(crate) message: &'m OutgoingMessage,
    pub(crate) names: Vec<String>,
    pub(crate) values: Vec<String>,
}

impl<'m> Enqueue<'m> {
    pub(crate) fn of(sql: &'m str, message: &'m OutgoingMessage) -> Self {
        let (names, values) = inbox_postgres::header_columns(message);
        Self {
            sql,
            id: *message.id().as_uuid(),
            message,
            names,
            values,
        }
    }
}

cached_by_text!(Enqueue<'_>);

impl QueryFragment<Pg> for Enqueue<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        let m = self.message;
        walk(self.sql, &mut out, |n, out| match n {
            1 => out.push_bind_param::<Uuid, _>(&self.id),
            2 => out.push_bind_param::<Text, _>(m.exchange()),
            3 => out.push_bind_param::<Text, _>(m.routing_key()),
            4 => out.push_bind_param::<Text, _>(m.message_type()),
            5 => out.push_bind_param::<Array<Text>, _>(&self.names),
            6 => out.push_bind_param::<Array<Text>, _>(&self.values),
            7 => out.push_bind_param::<Bytea, _>(m.body()),
            n => Err(no_such_parameter(n)),
        })
    }
}

/// [`sql::TAKE_PENDING`]; loads [`inbox_postgres::OutboxColumns`]. The
/// relay's hot path, so prepared once per connection.
pub(crate) struct TakePending<'s> {
    pub(crate) sql: &'s str,
    pub(crate) lease_millis: i64,
    pub(crate) lease_id: uuid::Uuid,
    pub(crate) limit: i64,
}

cached_by_text!(TakePending<'_>);

impl Query for TakePending<'_> {
    type SqlType = OutboxSqlType;
}

impl QueryFragment<Pg> for TakePending<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        walk(self.sql, &mut out, |n, out| match n {
            1 => out.push_bind_param::<BigInt, _>(&self.lease_millis),
            2 => out.push_bind_param::<Uuid, _>(&self.lease_id),
            3 => out.push_bind_param::<BigInt, _>(&self.limit),
            n => Err(no_such_parameter(n)),
        })
    }
}

/// [`sql::LOOKUP_OUTGOING`] (`.0`) of id `.1`; loads
/// [`inbox_postgres::OutboxColumns`].
pub(crate) struct LookupOutgoing<'s>(pub(crate) &'s str, pub(crate) uuid::Uuid);

cached_by_text!(LookupOutgoing<'_>);

impl Query for LookupOutgoing<'_> {
    type SqlType = OutboxSqlType;
}

impl QueryFragment<Pg> for LookupOutgoing<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        walk(self.0, &mut out, |n, out| match n {
            1 => out.push_bind_param::<Uuid, _>(&self.1),
            n => Err(no_such_parameter(n)),
        })
    }
}

/// [`sql::DEAD_OUTGOING`] (`.0`): `.1` is the limit; loads
/// [`inbox_postgres::OutboxColumns`].
pub(crate) struct DeadOutgoing<'s>(pub(crate) &'s str, pub(crate) i64);

cached_by_text!(DeadOutgoing<'_>);

impl Query for DeadOutgoing<'_> {
    type SqlType = OutboxSqlType;
}

impl QueryFragment<Pg> for DeadOutgoing<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        walk(self.0, &mut out, |n, out| match n {
            1 => out.push_bind_param::<BigInt, _>(&self.1),
            n => Err(no_such_parameter(n)),
        })
    }
}
