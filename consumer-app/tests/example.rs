//! The example consumer (`examples/invoice_paid.rs`), of another domain
//! than the Parcel one, built and run here against the real RabbitMQ
//! (127.0.0.1:5672, guest/guest) and PostgreSQL (`DATABASE_URL`): every
//! invoice lands in the ledger exactly once, although one of them is
//! delivered twice. Its own queue prefix and schema, removed afterwards.

use std::time::{Duration, Instant};

use inbox_api::MessageId;
use inbox_backend_sqlx::SqlxStore;
use inbox_runtime::amqp::{Outgoing, Publisher, connect};
use inbox_runtime::tally::get;
use inbox_runtime::{ServiceConfig, Topology, WorkerConfig};

#[path = "../examples/invoice_paid.rs"]
#[allow(
    dead_code,
    unreachable_pub,
    reason = "the example's main and its pub items are used by the example binary"
)]
mod invoice_paid;

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_invoice_is_booked_once() {
    let id = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    let (prefix, schema) = (format!("test-invoice-{id}."), format!("invoice_test_{id}"));
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let store = SqlxStore::connect(&database_url, &schema)
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    let config = ServiceConfig {
        worker: WorkerConfig {
            retry_base_delay: Duration::from_millis(5),
            ..WorkerConfig::default()
        },
        cleanup: None,
        ..ServiceConfig::new(AMQP_URL, format!("invoice test {id}"))
    };
    let service = invoice_paid::start(store.clone(), config, &prefix)
        .await
        .expect("the example starts");
    service
        .wait_consuming(1, Duration::from_secs(20))
        .await
        .expect("consuming (RabbitMQ reachable? bash .ci/services.sh)");

    // Two invoices; the first published twice with one message id, as a
    // producer retrying a publish would.
    let connection = connect(AMQP_URL, "invoice test publisher")
        .await
        .expect("connect");
    let exchange = format!("{prefix}billing.events");
    let publisher = Publisher::new(&connection, &exchange, "invoice.paid")
        .await
        .expect("publisher");
    let (first, second) = (MessageId::new_v7(), MessageId::new_v7());
    for (message_id, invoice, cents) in [
        (first, "INV-1", 1250),
        (first, "INV-1", 1250),
        (second, "INV-2", 990),
    ] {
        let body = serde_json::json!({ "invoice_id": invoice, "amount_cents": cents });
        let message = Outgoing::json(&message_id, "invoice.paid", &body).expect("message");
        publisher.publish(&message).await.expect("confirmed");
    }

    let tally = std::sync::Arc::clone(&service.tally);
    let deadline = Instant::now() + Duration::from_secs(30);
    while tally.consumer("invoice-ledger").finished() < 3 {
        assert!(Instant::now() < deadline, "three deliveries finished");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    service.shutdown();
    service.join().await.expect("clean shutdown");

    let ledger = tally.consumer("invoice-ledger");
    assert_eq!(get(&ledger.processed), 2);
    assert_eq!(get(&ledger.duplicates), 1, "the copy was discarded");
    assert_eq!(ledger.dead_lettered_total(), 0);
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT invoice, cents FROM ledger ORDER BY invoice")
            .fetch_all(store.pool())
            .await
            .expect("ledger rows");
    assert_eq!(
        rows,
        vec![("INV-1".to_owned(), 1250), ("INV-2".to_owned(), 990)],
        "each invoice booked exactly once"
    );

    let channel = connection.create_channel().await.expect("channel");
    Topology::new(exchange)
        .bind(format!("{prefix}invoice-paid"), "invoice.paid")
        .delete(&channel)
        .await
        .expect("delete topology");
    inbox_runtime::amqp::close_bounded(&connection, "bye").await;
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(store.pool())
        .await
        .expect("drop schema");
}
