//! TLS to PostgreSQL through sqlx, which reads libpq's URL parameters
//! itself: the shared scenarios of `inbox_conformance::postgres::tls`.

use async_trait::async_trait;
use inbox_api::InboxError;
use inbox_backend_sqlx::SqlxStore;
use inbox_conformance::postgres::tls::{OpenStore, tls_connections};

struct Sqlx;

#[async_trait]
impl OpenStore for Sqlx {
    type Store = SqlxStore;
    const VERIFY_CA_SKIPS_HOST_NAME: bool = false;

    async fn open(&self, url: &str, schema: &str) -> Result<SqlxStore, InboxError> {
        let store = SqlxStore::connect(url, schema).await?;
        store.migrate().await?;
        Ok(store)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_connections_mean_what_libpq_says() {
    tls_connections(Sqlx).await;
}
