//! `orders.rs` on diesel-async: the store lines and the business SQL change, nothing else.
use diesel::sql_types::BigInt;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use inbox_runtime::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Clone, Serialize, Deserialize)]
pub struct OrderPlaced {
    pub order_id: i64,
    pub cents: i64,
}
impl Event for OrderPlaced {
    const TYPE: &'static str = "order.placed";
}
#[derive(Clone, Serialize, Deserialize)]
pub struct PaymentTaken {
    pub order_id: i64,
}
impl Event for PaymentTaken {
    const TYPE: &'static str = "payment.taken";
}

/// The payment and the `payment.taken` event commit with the inbox claim, or none does.
async fn charge(
    mut cx: Context<'_, DieselTransaction>,
    order: OrderPlaced,
) -> Result<(), AppError> {
    let (id, cents) = (order.order_id, order.cents);
    let charge = diesel::sql_query("INSERT INTO shop.payments (order_id, cents) VALUES ($1, $2)");
    let charge = charge.bind::<BigInt, _>(id).bind::<BigInt, _>(cents);
    charge.execute(cx.conn()).await?;
    cx.publish(&PaymentTaken { order_id: id }).await?;
    Ok(())
}

async fn ship(mut cx: Context<'_, DieselTransaction>, paid: PaymentTaken) -> Result<(), AppError> {
    let ship = diesel::sql_query("INSERT INTO shop.shipments (order_id) VALUES ($1)");
    ship.bind::<BigInt, _>(paid.order_id)
        .execute(cx.conn())
        .await?;
    Ok(())
}

pub async fn start(url: &str, broker_url: &str, prefix: &str) -> Result<ServiceHandle, AppError> {
    let store = DieselStore::connect(url, "shop_inbox_diesel", 8).await?;
    store.migrate().await?;
    let mut conn = store.pool().get().await?;
    conn.batch_execute(include_str!("orders.sql")).await?;
    let (payments, shipping) = (format!("{prefix}payments"), format!("{prefix}shipping"));
    let topology = Topology::new(format!("{prefix}shop"))
        .bind(&payments, OrderPlaced::TYPE)
        .bind(&shipping, PaymentTaken::TYPE);
    Service::new(store, ServiceConfig::new(broker_url, "shop"), topology)
        .consume(payments, handler_fn("payments", charge)?)
        .consume(shipping, handler_fn("shipping", ship)?)
        .with_relay()
        .spawn()
}

#[tokio::main]
async fn main() -> Result<(), AppError> {
    let url = "postgres://postgres@127.0.0.1:5432/test";
    let shop = start(url, "amqp://guest:guest@127.0.0.1:5672/%2f", "").await?;
    let _ = tokio::signal::ctrl_c().await;
    shop.shutdown();
    shop.join().await
}
