//! The shop example (`examples/orders.rs`, and its diesel and in-process
//! twins), built and run against the real RabbitMQ (127.0.0.1:5672), NATS
//! JetStream (127.0.0.1:4222) and PostgreSQL (`DATABASE_URL`): orders,
//! some sent twice, are each charged once, and each payment's
//! `payment.taken` event (published by the relay from the outbox) is
//! shipped once. The same `start` runs on either broker: only the URL
//! differs. Each run has its own queue prefix and order ids; the topology
//! is removed afterwards.

use std::future::Future;
use std::time::{Duration, Instant};

use inbox_runtime::amqp::{Outgoing, Publisher, close_bounded, connect};
use inbox_runtime::async_nats::{self, HeaderMap};
use inbox_runtime::nats::{names, publish_confirmed};
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
const NATS_URL: &str = "nats://127.0.0.1:4222";
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

/// Publishes each order to the shop's exchange on the broker at `url`,
/// as a producer of its own would, the first `COPIES` twice under one
/// message id (a producer retrying). Returns how many copies the broker
/// itself dropped: JetStream drops a copy within its duplicate window
/// (`Nats-Msg-Id`), RabbitMQ delivers it and the inbox drops it.
async fn publish_orders(url: &str, exchange: &str, orders: &[(MessageId, Vec<u8>)]) -> u64 {
    let copies = |i: usize| if (i as i64) < COPIES { 2 } else { 1 };
    if url.starts_with("nats://") {
        let client = async_nats::connect(url.trim_start_matches("nats://"))
            .await
            .expect("NATS reachable (bash .ci/services.sh)");
        let js = async_nats::jetstream::new(client);
        let subject = names::subject(exchange, "order.placed");
        let mut dropped = 0;
        for (i, (id, body)) in orders.iter().enumerate() {
            for _ in 0..copies(i) {
                let id = id.to_string();
                let stored = publish_confirmed(
                    &js,
                    &subject,
                    &id,
                    Some("order.placed"),
                    HeaderMap::new(),
                    body.clone(),
                )
                .await
                .expect("stored");
                dropped += u64::from(stored.duplicate);
            }
        }
        return dropped;
    }
    let connection = connect(url, "shop test publisher").await.expect("connect");
    let publisher = Publisher::new(&connection, exchange, "order.placed")
        .await
        .expect("publisher");
    for (i, (id, body)) in orders.iter().enumerate() {
        let message = Outgoing {
            message_id: Some(id.to_string()),
            kind: Some("order.placed".into()),
            body: body.clone(),
        };
        for _ in 0..copies(i) {
            publisher.publish(&message).await.expect("confirmed");
        }
    }
    close_bounded(&connection, "bye").await;
    0
}

/// Starts the shop under a fresh prefix with `start` on the broker at
/// `url`, publishes the orders (the first `COPIES` twice, under one
/// message id each, as a retrying producer would), waits until every
/// payment is shipped, stops it, and returns the order ids.
async fn run_shop<F, Fut>(url: &str, start: F) -> Vec<i64>
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

    let exchange = format!("{prefix}shop");
    let ids: Vec<i64> = (first..first + ORDERS).collect();
    let orders: Vec<(MessageId, Vec<u8>)> = ids
        .iter()
        .map(|&order_id| {
            let body = serde_json::json!({ "order_id": order_id, "cents": 100 + order_id % 900 });
            (MessageId::new_v7(), body.to_string().into_bytes())
        })
        .collect();
    let dropped_by_broker = publish_orders(url, &exchange, &orders).await;
    let copies = COPIES as u64 - dropped_by_broker;

    let deadline = Instant::now() + Duration::from_secs(60);
    let (payments, shipping) = (
        shop.tally.consumer("payments"),
        shop.tally.consumer("shipping"),
    );
    while payments.finished() < ORDERS as u64 + copies || shipping.finished() < ORDERS as u64 {
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
    assert_eq!(
        payments.duplicates() + dropped_by_broker,
        COPIES as u64,
        "each copy discarded, by the inbox or by the broker"
    );
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

    Topology::new(exchange)
        .bind(format!("{prefix}payments"), "order.placed")
        .bind(format!("{prefix}shipping"), "payment.taken")
        .remove(url)
        .await
        .expect("delete topology");
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
    let ids = run_shop(AMQP_URL, async |prefix| {
        orders::start(pool, AMQP_URL, &prefix).await
    })
    .await;
    assert_eq!(rows(&ids).await, (ORDERS, ORDERS));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_diesel_shop_charges_and_ships_each_order_once() {
    let _one_at_a_time = POSTGRES.lock().await;
    let url = database_url();
    let ids = run_shop(AMQP_URL, async |prefix| {
        orders_diesel::start(&url, AMQP_URL, &prefix).await
    })
    .await;
    assert_eq!(rows(&ids).await, (ORDERS, ORDERS));
}

/// The in-process shop on `url`: every order charged and shipped once.
async fn in_process_shop(url: &str) {
    let store = MemoryStore::new();
    let shop = store.clone();
    let ids = run_shop(url, async |prefix| {
        orders_memory::start(shop, url, &prefix).await
    })
    .await;
    let held = |kind: &str| {
        let ids = ids
            .iter()
            .filter(|id| store.get(&format!("{kind}/{id}")).is_some())
            .count();
        i64::try_from(ids).expect("small")
    };
    assert_eq!((held("payments"), held("shipments")), (ORDERS, ORDERS));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_shop_charges_and_ships_each_order_once() {
    in_process_shop(AMQP_URL).await;
}

/// The same shop, the same `start`, on NATS JetStream: one URL changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_shop_on_nats_charges_and_ships_each_order_once() {
    in_process_shop(NATS_URL).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sqlx_shop_on_nats_charges_and_ships_each_order_once() {
    let _one_at_a_time = POSTGRES.lock().await;
    let pool = sqlx::PgPool::connect(&database_url())
        .await
        .expect("PostgreSQL reachable");
    let ids = run_shop(NATS_URL, async |prefix| {
        orders::start(pool, NATS_URL, &prefix).await
    })
    .await;
    assert_eq!(rows(&ids).await, (ORDERS, ORDERS));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_diesel_shop_on_nats_charges_and_ships_each_order_once() {
    let _one_at_a_time = POSTGRES.lock().await;
    let url = database_url();
    let ids = run_shop(NATS_URL, async |prefix| {
        orders_diesel::start(&url, NATS_URL, &prefix).await
    })
    .await;
    assert_eq!(rows(&ids).await, (ORDERS, ORDERS));
}
