//! A shop whose orders are charged and shipped once each, however often RabbitMQ delivers them.
use inbox_runtime::{prelude::*, sqlx_store::migrations::migrator};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

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
async fn charge(mut cx: Context<'_, SqlxTransaction>, order: OrderPlaced) -> Result<(), AppError> {
    let (id, cents) = (order.order_id, order.cents);
    let charge = sqlx::query("INSERT INTO shop.payments (order_id, cents) VALUES ($1, $2)");
    charge.bind(id).bind(cents).execute(cx.conn()).await?;
    cx.publish(&PaymentTaken { order_id: id }).await?;
    Ok(())
}

async fn ship(mut cx: Context<'_, SqlxTransaction>, paid: PaymentTaken) -> Result<(), AppError> {
    let ship = sqlx::query("INSERT INTO shop.shipments (order_id) VALUES ($1)");
    ship.bind(paid.order_id).execute(cx.conn()).await?;
    Ok(())
}

pub async fn start(
    pool: PgPool,
    broker_url: &str,
    prefix: &str,
) -> Result<ServiceHandle, AppError> {
    migrator("shop_inbox").await?.run(&pool).await?; // or store.migrate()
    let store = SqlxStore::new(pool.clone(), "shop_inbox")?;
    let tables = sqlx::raw_sql(include_str!("orders.sql"));
    tables.execute(&pool).await?;
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
    let pool = PgPool::connect("postgres://postgres@127.0.0.1:5432/test").await?;
    let shop = start(pool, "amqp://guest:guest@127.0.0.1:5672/%2f", "").await?;
    let _ = tokio::signal::ctrl_c().await;
    shop.shutdown();
    shop.join().await
}
