//! The hot statements as query fragments that diesel-async prepares once per
//! connection.
//!
//! diesel marks every `sql_query` and every `INSERT … SELECT` built by hand
//! unsafe to cache, so diesel-async prepares them anew on every call: a
//! round trip and a parse of their own per message (measured on the
//! processed-mark UPDATE the inbox used to run: re-prepared, the diesel
//! inbox ran at 0.74 of the sqlx inbox at 16 tasks). The SQL text is
//! `inbox-postgres`'s, sent piece by piece with diesel's own bind markers;
//! since it never varies, a static [`QueryId`] lets the statement cache keep
//! it. The rarer statements (unclaim, lookup, purge, the outbox's marks
//! and counts) go through `sql_query`; the outbox's enqueue (the producer's
//! hot path) and take (the relay's) are fragments too.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::result::{Error as DieselError, QueryResult};
use diesel::sql_types::{Array, BigInt, Bytea, Integer, Nullable, Text, Timestamptz, Uuid};
use inbox_api::{InboxKey, OutgoingMessage};
use inbox_postgres::Layout;
use inbox_postgres::sql::{self, Piece};

/// Sends `statement`, binding its parameter `$n` with `bind(n, out)`.
fn walk<'b>(
    statement: &'static str,
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

/// [`sql::CLAIM`] for one key, or [`sql::CLAIM_PARTITIONED`] when
/// `PARTITIONED`, or their pipelined forms ([`sql::CLAIM_PIPELINED`]) when
/// `PIPELINED`; executes to the rows inserted (0 or 1). The layout and the
/// form are type parameters so that each statement keeps its own static
/// cache key.
pub(crate) struct ClaimOne<'k, const PARTITIONED: bool, const PIPELINED: bool>(
    pub(crate) &'k InboxKey,
);

/// The statement cache's key for [`ClaimOne`].
pub(crate) struct ClaimOneId<const PARTITIONED: bool, const PIPELINED: bool>;

/// The statement of a layout.
const fn layout(partitioned: bool) -> Layout {
    if partitioned {
        Layout::Partitioned
    } else {
        Layout::Table
    }
}

impl<const P: bool, const Q: bool> QueryId for ClaimOne<'_, P, Q> {
    type QueryId = ClaimOneId<P, Q>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<const P: bool, const Q: bool> QueryFragment<Pg> for ClaimOne<'_, P, Q> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        let key = self.0;
        let statement = if Q {
            layout(P).claim_pipelined()
        } else {
            layout(P).claim()
        };
        walk(statement, &mut out, |n, out| match n {
            1 => out.push_bind_param::<Uuid, _>(key.message_id.as_uuid()),
            2 => out.push_bind_param::<Text, _>(key.consumer.as_str()),
            n => Err(no_such_parameter(n)),
        })
    }
}

/// [`sql::CLAIM_BATCH`] over the keys as two parallel arrays; loads the
/// `(id, consumer)` rows inserted.
pub(crate) struct ClaimBatch<const PARTITIONED: bool> {
    pub(crate) ids: Vec<uuid::Uuid>,
    pub(crate) consumers: Vec<String>,
}

impl<const P: bool> ClaimBatch<P> {
    pub(crate) fn of(keys: &[InboxKey]) -> Self {
        let (ids, consumers) = inbox_postgres::key_columns(keys);
        Self { ids, consumers }
    }
}

impl<const P: bool> QueryId for ClaimBatch<P> {
    type QueryId = ClaimBatch<P>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<const P: bool> Query for ClaimBatch<P> {
    type SqlType = (Uuid, Text);
}

impl<const P: bool> QueryFragment<Pg> for ClaimBatch<P> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        walk(layout(P).claim_batch(), &mut out, |n, out| match n {
            1 => out.push_bind_param::<Array<Uuid>, _>(&self.ids),
            2 => out.push_bind_param::<Array<Text>, _>(&self.consumers),
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
    pub(crate) id: uuid::Uuid,
    pub(crate) message: &'m OutgoingMessage,
    pub(crate) names: Vec<String>,
    pub(crate) values: Vec<String>,
}

impl<'m> Enqueue<'m> {
    pub(crate) fn of(message: &'m OutgoingMessage) -> Self {
        let (names, values) = inbox_postgres::header_columns(message);
        Self {
            id: *message.id().as_uuid(),
            message,
            names,
            values,
        }
    }
}

/// The statement cache's key for [`Enqueue`].
pub(crate) struct EnqueueId;

impl QueryId for Enqueue<'_> {
    type QueryId = EnqueueId;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl QueryFragment<Pg> for Enqueue<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        let m = self.message;
        walk(sql::ENQUEUE, &mut out, |n, out| match n {
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
pub(crate) struct TakePending {
    pub(crate) lease_millis: i64,
    pub(crate) lease_id: uuid::Uuid,
    pub(crate) limit: i64,
}

impl QueryId for TakePending {
    type QueryId = TakePending;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for TakePending {
    type SqlType = OutboxSqlType;
}

impl QueryFragment<Pg> for TakePending {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        walk(sql::TAKE_PENDING, &mut out, |n, out| match n {
            1 => out.push_bind_param::<BigInt, _>(&self.lease_millis),
            2 => out.push_bind_param::<Uuid, _>(&self.lease_id),
            3 => out.push_bind_param::<BigInt, _>(&self.limit),
            n => Err(no_such_parameter(n)),
        })
    }
}

/// [`sql::LOOKUP_OUTGOING`]; loads [`inbox_postgres::OutboxColumns`].
pub(crate) struct LookupOutgoing(pub(crate) uuid::Uuid);

impl QueryId for LookupOutgoing {
    type QueryId = LookupOutgoing;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for LookupOutgoing {
    type SqlType = OutboxSqlType;
}

impl QueryFragment<Pg> for LookupOutgoing {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        walk(sql::LOOKUP_OUTGOING, &mut out, |n, out| match n {
            1 => out.push_bind_param::<Uuid, _>(&self.0),
            n => Err(no_such_parameter(n)),
        })
    }
}

/// [`sql::DEAD_OUTGOING`]: `.0` is the limit; loads
/// [`inbox_postgres::OutboxColumns`].
pub(crate) struct DeadOutgoing(pub(crate) i64);

impl QueryId for DeadOutgoing {
    type QueryId = DeadOutgoing;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for DeadOutgoing {
    type SqlType = OutboxSqlType;
}

impl QueryFragment<Pg> for DeadOutgoing {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        walk(sql::DEAD_OUTGOING, &mut out, |n, out| match n {
            1 => out.push_bind_param::<BigInt, _>(&self.0),
            n => Err(no_such_parameter(n)),
        })
    }
}
