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
//! it. The rarer statements (unclaim, lookup, purge) go through `sql_query`.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::result::{Error as DieselError, QueryResult};
use diesel::sql_types::{Array, Text, Uuid};
use inbox_api::InboxKey;
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

/// [`sql::CLAIM`] for one key; executes to the rows inserted (0 or 1).
pub(crate) struct ClaimOne<'k>(pub(crate) &'k InboxKey);

/// The statement cache's key for [`ClaimOne`].
pub(crate) struct ClaimOneId;

impl QueryId for ClaimOne<'_> {
    type QueryId = ClaimOneId;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl QueryFragment<Pg> for ClaimOne<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        let key = self.0;
        walk(sql::CLAIM, &mut out, |n, out| match n {
            1 => out.push_bind_param::<Uuid, _>(key.message_id.as_uuid()),
            2 => out.push_bind_param::<Text, _>(key.consumer.as_str()),
            n => Err(no_such_parameter(n)),
        })
    }
}

/// [`sql::CLAIM_BATCH`] over the keys as two parallel arrays; loads the
/// `(id, consumer)` rows inserted.
pub(crate) struct ClaimBatch {
    pub(crate) ids: Vec<uuid::Uuid>,
    pub(crate) consumers: Vec<String>,
}

impl ClaimBatch {
    pub(crate) fn of(keys: &[InboxKey]) -> Self {
        let (ids, consumers) = inbox_postgres::key_columns(keys);
        Self { ids, consumers }
    }
}

impl QueryId for ClaimBatch {
    type QueryId = ClaimBatch;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for ClaimBatch {
    type SqlType = (Uuid, Text);
}

impl QueryFragment<Pg> for ClaimBatch {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        walk(sql::CLAIM_BATCH, &mut out, |n, out| match n {
            1 => out.push_bind_param::<Array<Uuid>, _>(&self.ids),
            2 => out.push_bind_param::<Array<Text>, _>(&self.consumers),
            n => Err(no_such_parameter(n)),
        })
    }
}
