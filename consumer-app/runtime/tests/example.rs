//! The shop example (`examples/orders.rs`, and its diesel and in-process
//! twins), built and run against the real RabbitMQ (127.0.0.1:5672) and
//! PostgreSQL (`DATABASE_URL`): orders, some delivered twice, are each
//! charged once, and each payment's `payment.taken` event (published by the
//! relay from the outbox) is shipped once. Each run has its own queue
//! prefix and order ids; the topology is removed afterwards.

use std::future::Future;
use std::time::{Duration, Instant};

use inbox_runtime::amqp::{Outgoing, Publisher, close_bounded, connect};
use inbox_runtime::prelude::*;

#[path = "../examples/orders.rs"]
#[allow(
    dead_code,
    unreachable_pub,
    reason = "main and the pub items are the binary's"
)]
mod orders;
#[path = "../examples/orders_diesel.rs"]
#[allow(
    dead_code,
    unreachable_pub,
    reason = "main and the pub items are the binary's"
)]
mod orders_diesel;
#[path = "../examples/orders_memory.rs"]
#[allow(
    dead_code,
    unreachable_pub,
    reason = "main and the pub items are the binary's"
)]
mod orders_memory;

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const ORDERS: i64 = 20;
const COPIES: i64 = 5;

/// The shop's tables are shared by the PostgreSQL runs: one at a time.
static POSTGRES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A queue prefix and a first order id of this run's own.
fn run_id() -> (String, i64) {
    let id = uuid::Uuid::new_v4();
    let prefix = format!("test-shop-{}.", &id.simple().to_string()[..10]);
    let first = i64::from(u32::from_le_bytes(
        id.as_bytes()[..4].try_into().expect("4 bytes"),
    ));
    (prefix, first * 1_000)
}

/// Starts the shop under a fresh prefix with `start`, publishes the orders
/// (the first `COPIES` twice, under one message id each, as a retrying
/// producer would), waits until every payment is shipped, stops it, and
/// returns the order ids.
async fn run_shop<F, Fut>(start: F) -> Vec<i64>
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = Result<ServiceHandle, AppError>>,
{
    let (prefix, first) = run_id();
    let shop = start(prefix.clone())
        .await
        .expect("the shop starts (bash .ci/services.sh)");
    shop.wait_ready(Duration::from_secs(30))
        .await
        .expect("consuming");

    let connection = connect(AMQP_URL, "shop test publisher")
        .await
        .expect("connect");
    let exchange = format!("{prefix}shop");
    let publisher = Publisher::new(&connection, &exchange, "order.placed")
        .await
        .expect("publisher");
    let ids: Vec<i64> = (first..first + ORDERS).collect();
    for (i, &order_id) in ids.iter().enumerate() {
        let message_id = MessageId::new_v7();
        let body = serde_json::json!({ "order_id": order_id, "cents": 100 + order_id % 900 });
        let message = Outgoing::json(&message_id, "order.placed", &body).expect("message");
        let sends = if (i as i64) < COPIES { 2 } else { 1 };
        for _ in 0..sends {
            publisher.publish(&message).await.expect("confirmed");
        }
    }

    let deadline = Instant::now() + Duration::from_secs(60);
    let (payments, shipping) = (
        shop.tally.consumer("payments"),
        shop.tally.consumer("shipping"),
    );
    while payments.finished() < (ORDERS + COPIES) as u64 || shipping.finished() < ORDERS as u64 {
        assert!(
            Instant::now() < deadline,
            "every order charged and shipped within 60 s: payments {}/{} processed/duplicates, shipping {}",
            payments.processed(),
            payments.duplicates(),
            shipping.processed()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(
        payments.processed(),
        ORDERS as u64,
        "each order charged once"
    );
    assert_eq!(payments.duplicates(), COPIES as u64, "each copy discarded");
    assert_eq!(
        shipping.processed(),
        ORDERS as u64,
        "each payment shipped once"
    );
    assert_eq!(
        payments.dead_lettered_total() + shipping.dead_lettered_total(),
        0
    );
    let relay = shop.relay().expect("the relay runs with the service");
    assert!(
        relay.published() >= ORDERS as u64,
        "the relay published every event"
    );
    shop.shutdown();
    shop.join().await.expect("clean shutdown");

    let channel = connection.create_channel().await.expect("channel");
    Topology::new(exchange)
        .bind(format!("{prefix}payments"), "order.placed")
        .bind(format!("{prefix}shipping"), "payment.taken")
        .delete(&channel)
        .await
        .expect("delete topology");
    close_bounded(&connection, "bye").await;
    ids
}

/// How many of `ids` the shop's tables hold: (payments, shipments).
async fn rows(ids: &[i64]) -> (i64, i64) {
    let pool = sqlx::PgPool::connect(&database_url())
        .await
        .expect("PostgreSQL");
    let count = async |table: &str| -> i64 {
        let sql = format!("SELECT count(*) FROM shop.{table} WHERE order_id = ANY($1)");
        sqlx::query_scalar(&sql)
            .bind(ids)
            .fetch_one(&pool)
            .await
            .expect("count")
    };
    (count("payments").await, count("shipments").await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sqlx_shop_charges_and_ships_each_order_once() {
    let _one_at_a_time = POSTGRES.lock().await;
    let pool = sqlx::PgPool::connect(&database_url())
        .await
        .expect("PostgreSQL reachable");
    let ids = run_shop(async |prefix| orders::start(pool, AMQP_URL, &prefix).await).await;
    assert_eq!(rows(&ids).await, (ORDERS, ORDERS));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_diesel_shop_charges_and_ships_each_order_once() {
    let _one_at_a_time = POSTGRES.lock().await;
    let url = database_url();
    let ids = run_shop(async |prefix| orders_diesel::start(&url, AMQP_URL, &prefix).await).await;
    assert_eq!(rows(&ids).await, (ORDERS, ORDERS));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_shop_charges_and_ships_each_order_once() {
    let store = MemoryStore::new();
    let shop = store.clone();
    let ids = run_shop(async |prefix| orders_memory::start(shop, AMQP_URL, &prefix).await).await;
    let held = |kind: &str| {
        let ids = ids
            .iter()
            .filter(|id| store.get(&format!("{kind}/{id}")).is_some())
            .count();
        i64::try_from(ids).expect("small")
    };
    assert_eq!((held("payments"), held("shipments")), (ORDERS, ORDERS));
}
