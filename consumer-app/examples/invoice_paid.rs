//! A second domain on the runtime: each paid invoice becomes one ledger row,
//! exactly once however often it is delivered. The handler is all there is
//! to write; the claim, acks, retries, dead letters and shutdown are the
//! runtime's. `cargo run -p consumer-app --example invoice_paid` consumes
//! until Ctrl-C (`bash .ci/services.sh` first); tests/example.rs runs it.
use inbox_api::{ConsumerName, MessageId};
use inbox_backend_sqlx::{SqlxStore, SqlxTransaction, classify};
use inbox_runtime::{AppError, Handler, Service, ServiceConfig, ServiceHandle, Topology};

const LEDGER: &str =
    "CREATE TABLE IF NOT EXISTS ledger (message_id uuid, invoice text, cents int8)";
const BOOK: &str = "INSERT INTO ledger (message_id, invoice, cents) VALUES ($1, $2, $3)";

/// The `invoice.paid` event.
#[derive(serde::Deserialize)]
pub struct InvoicePaid {
    pub invoice_id: String,
    pub amount_cents: i64,
}

/// Books a paid invoice into the ledger, inside the inbox transaction.
pub struct Ledger(ConsumerName);

impl Handler<SqlxTransaction> for Ledger {
    type Message = InvoicePaid;
    type Intent = ();

    fn name(&self) -> &ConsumerName {
        &self.0
    }

    fn message_type(&self) -> &str {
        "invoice.paid"
    }

    async fn handle(
        &self,
        tx: &mut SqlxTransaction,
        id: MessageId,
        paid: &InvoicePaid,
    ) -> Result<(), AppError> {
        let book = sqlx::query(BOOK).bind(id.as_uuid());
        let book = book.bind(&paid.invoice_id).bind(paid.amount_cents);
        book.execute(tx.conn()).await.map_err(classify)?;
        Ok(())
    }
}

/// Migrates `store` (the inbox, then the ledger) and starts the consumer on
/// `{prefix}invoice-paid`, bound to `{prefix}billing.events`.
pub async fn start(
    store: SqlxStore,
    config: ServiceConfig,
    prefix: &str,
) -> Result<ServiceHandle, AppError> {
    store.migrate().await?;
    let create = sqlx::query(LEDGER);
    create.execute(store.pool()).await.map_err(classify)?;
    let handler = Ledger(ConsumerName::new("invoice-ledger")?);
    let queue = format!("{prefix}invoice-paid");
    let topology = Topology::new(format!("{prefix}billing.events"));
    let service = Service::new(store, config, topology.bind(&queue, "invoice.paid"));
    service.consume(queue, handler).spawn()
}

#[tokio::main]
pub async fn main() -> Result<(), AppError> {
    let env = |name, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let database_url = env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let amqp_url = env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let store = SqlxStore::connect(&database_url, "invoices").await?;
    let service = start(store, ServiceConfig::new(amqp_url, "invoice-paid"), "").await?;
    let _ = tokio::signal::ctrl_c().await;
    service.shutdown();
    service.join().await
}
