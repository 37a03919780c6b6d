//! Responses kept with a claim on the sqlx backend: `inbox-postgres`'s
//! statements, the keep in the consumer's transaction (so it commits with
//! the claim), the read on the pool.

use std::sync::Arc;

use async_trait::async_trait;
use inbox_api::{InboxError, InboxKey, ResponseStore, ResponseTransaction};

use crate::{SqlxStore, SqlxTransaction, classify};

#[async_trait]
impl ResponseTransaction for SqlxTransaction {
    async fn keep_response(&mut self, key: &InboxKey, response: &[u8]) -> Result<(), InboxError> {
        self.claims.may_keep_response(key)?;
        let statements = Arc::clone(&self.statements);
        sqlx::query(&statements.keep_response)
            .bind(key.message_id.as_uuid())
            .bind(key.consumer.as_str())
            .bind(response)
            .persistent(self.persistent)
            .execute(self.conn())
            .await
            .map_err(classify)?;
        Ok(())
    }
}

#[async_trait]
impl ResponseStore for SqlxStore {
    async fn kept_response(&self, key: &InboxKey) -> Result<Option<Vec<u8>>, InboxError> {
        let mut one = self.one_statement().await?;
        let response: Option<Option<Vec<u8>>> = sqlx::query_scalar(&self.statements.kept_response)
            .bind(key.message_id.as_uuid())
            .bind(key.consumer.as_str())
            .persistent(self.persistent())
            .fetch_optional(one.conn())
            .await
            .map_err(classify)?;
        one.done().await?;
        Ok(response.flatten())
    }
}
