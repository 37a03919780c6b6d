//! Responses kept with a claim on the diesel backend: `inbox-postgres`'s
//! statements, the keep in the consumer's transaction (so it commits with
//! the claim), the read on a pooled connection of its own. One statement
//! per idempotent request, so `sql_query` is enough.

use async_trait::async_trait;
use diesel::sql_types::{Bytea, Nullable, Text, Uuid};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::RunQueryDsl;
use inbox_api::{InboxError, InboxKey, ResponseStore, ResponseTransaction};

use crate::transaction::refine;
use crate::{DieselStore, DieselTransaction};

/// The column [`inbox_postgres::sql::KEPT_RESPONSE`] returns.
#[derive(QueryableByName)]
struct Kept {
    #[diesel(sql_type = Nullable<Bytea>)]
    response: Option<Vec<u8>>,
}

#[async_trait]
impl ResponseTransaction for DieselTransaction {
    async fn keep_response(&mut self, key: &InboxKey, response: &[u8]) -> Result<(), InboxError> {
        self.claims.may_keep_response(key)?;
        let statements = self.statements();
        let kept = diesel::sql_query(&statements.keep_response)
            .bind::<Uuid, _>(key.message_id.as_uuid())
            .bind::<Text, _>(key.consumer.as_str())
            .bind::<Bytea, _>(response)
            .execute(self.conn())
            .await;
        match kept {
            Ok(_) => Ok(()),
            Err(error) => Err(self.refine(error).await),
        }
    }
}

#[async_trait]
impl ResponseStore for DieselStore {
    async fn kept_response(&self, key: &InboxKey) -> Result<Option<Vec<u8>>, InboxError> {
        let mut conn = self.checkout().await?;
        let row = diesel::sql_query(&self.statements().kept_response)
            .bind::<Uuid, _>(key.message_id.as_uuid())
            .bind::<Text, _>(key.consumer.as_str())
            .get_result::<Kept>(&mut *conn)
            .await
            .optional();
        let row = conn.finish(row).await;
        match row {
            Ok(row) => Ok(row.and_then(|kept| kept.response)),
            Err(error) => Err(refine(&mut conn, error).await),
        }
    }
}
