//! The hot statement whose SQL diesel's DSL cannot express or would not
//! cache (the batch claim), as a query fragment diesel-async prepares once
//! per connection.
//!
//! diesel marks every UPDATE, every `INSERT … SELECT` built by hand and every
//! `sql_query` unsafe to cache, so diesel-async prepares them anew on every
//! call: a round trip and a parse of their own per message (measured on the
//! processed-mark UPDATE the inbox used to run: as a DSL UPDATE the diesel
//! inbox ran at 0.74 of the sqlx inbox at 16 tasks). The SQL of this
//! fragment never varies, so a static [`QueryId`] lets the statement cache
//! keep it, like the claim's INSERT.
//! Its table and columns are those of [`crate::schema`]; the SQL text is
//! the sqlx backend's.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::result::QueryResult;
use diesel::sql_types::{Array, Text, Uuid};

/// The keys as the two parallel arrays the batch claim unnests.
pub(crate) struct KeyColumns {
    pub(crate) ids: Vec<uuid::Uuid>,
    pub(crate) consumers: Vec<String>,
}

impl KeyColumns {
    pub(crate) fn of<'k>(keys: impl IntoIterator<Item = &'k inbox_api::InboxKey>) -> Self {
        let (ids, consumers) = keys
            .into_iter()
            .map(|k| (*k.message_id.as_uuid(), k.consumer.as_str().to_owned()))
            .unzip();
        Self { ids, consumers }
    }

    fn walk<'b>(&'b self, out: &mut AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("unnest(");
        out.push_bind_param::<Array<Uuid>, _>(&self.ids)?;
        out.push_sql("::uuid[], ");
        out.push_bind_param::<Array<Text>, _>(&self.consumers)?;
        out.push_sql("::text[]) AS k(id, consumer_type)");
        Ok(())
    }
}

/// Claims a batch in one statement: the keys in one global order (so that
/// overlapping batches take their row locks in the same order and cannot
/// deadlock), `ON CONFLICT DO NOTHING`, `RETURNING` the keys inserted. A key
/// repeated in the batch conflicts with its own first copy and is skipped.
/// Each row carries `processed_at = now()`, as the single claim does.
pub(crate) struct ClaimBatch(pub(crate) KeyColumns);

impl QueryId for ClaimBatch {
    type QueryId = ClaimBatch;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for ClaimBatch {
    type SqlType = (Uuid, Text);
}

impl QueryFragment<Pg> for ClaimBatch {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(
            "INSERT INTO inbox_messages (id, consumer_type, processed_at) \
             SELECT id, consumer_type, now() FROM ",
        );
        self.0.walk(&mut out)?;
        out.push_sql(
            " ORDER BY id, consumer_type COLLATE \"C\" \
             ON CONFLICT DO NOTHING RETURNING id, consumer_type::text",
        );
        Ok(())
    }
}
