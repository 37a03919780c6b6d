//! TLS to PostgreSQL through diesel-async's tokio-postgres, with libpq's
//! URL parameters read by the backend: the shared scenarios of
//! `inbox_conformance::postgres::tls`.

use async_trait::async_trait;
use inbox_api::InboxError;
use inbox_backend_diesel::DieselStore;
use inbox_conformance::postgres::tls::{OpenStore, tls_connections};

struct Diesel;

#[async_trait]
impl OpenStore for Diesel {
    type Store = DieselStore;

    async fn open(&self, url: &str, schema: &str) -> Result<DieselStore, InboxError> {
        let store = DieselStore::connect(url, schema, 2).await?;
        store.migrate().await?;
        Ok(store)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_connections_mean_what_libpq_says() {
    tls_connections(Diesel).await;
}
