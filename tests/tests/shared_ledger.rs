//! One ledger for both Postgres drivers: a schema migrated through one is
//! migrated for the other, in either order.

use std::time::Duration;

use inbox_backend_diesel::DieselStore;
use inbox_backend_sqlx::SqlxStore;
use inbox_conformance::postgres::support::{TEST_PREFIX, database_url, unique_schema};
use inbox_postgres::MIGRATIONS;

async fn both(schema: &str) -> (SqlxStore, DieselStore) {
    let sqlx = SqlxStore::connect(&database_url(), schema)
        .await
        .expect("sqlx store");
    let diesel = DieselStore::builder(database_url(), schema)
        .expect("valid schema")
        .pool_size(1)
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("diesel store");
    (sqlx, diesel)
}

#[tokio::test]
async fn migrated_by_sqlx_is_migrated_for_diesel() {
    let (sqlx, diesel) = both(&unique_schema(TEST_PREFIX)).await;
    assert_eq!(sqlx.migrate().await.expect("sqlx").len(), MIGRATIONS.len());
    assert_eq!(diesel.migrate().await.expect("diesel"), Vec::<i64>::new());
}

#[tokio::test]
async fn migrated_by_diesel_is_migrated_for_sqlx() {
    let (sqlx, diesel) = both(&unique_schema(TEST_PREFIX)).await;
    assert_eq!(
        diesel.migrate().await.expect("diesel").len(),
        MIGRATIONS.len()
    );
    assert_eq!(sqlx.migrate().await.expect("sqlx"), Vec::<i64>::new());
}
