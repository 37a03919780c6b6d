//! `orders.rs` on the in-process store (tests, a laptop): the store lines and the writes change.
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
    mut cx: Context<'_, MemoryTransaction>,
    order: OrderPlaced,
) -> Result<(), AppError> {
    let (id, cents) = (order.order_id, order.cents);
    cx.put(format!("payments/{id}"), cents.to_string());
    cx.publish(&PaymentTaken { order_id: id }).await?;
    Ok(())
}

async fn ship(mut cx: Context<'_, MemoryTransaction>, paid: PaymentTaken) -> Result<(), AppError> {
    cx.put(format!("shipments/{}", paid.order_id), "");
    Ok(())
}

pub async fn start(
    store: MemoryStore,
    broker_url: &str,
    prefix: &str,
) -> Result<ServiceHandle, AppError> {
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
    let shop = start(
        MemoryStore::new(),
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        "",
    )
    .await?;
    let _ = tokio::signal::ctrl_c().await;
    shop.shutdown();
    shop.join().await
}
