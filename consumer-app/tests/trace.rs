//! One trace from the request to the last consumer: `POST /parcels` with a
//! client's `traceparent`, the outbox row, the relay's publish, the two
//! consumers of `parcel.created`, the carrier consumer's follow-up event,
//! its publish and the third consumer, all in the client's trace, against
//! the real RabbitMQ (127.0.0.1:5672), on every store (sqlx and diesel on
//! the real PostgreSQL at `DATABASE_URL`, each in a schema of its own;
//! each store's run has a client trace of its own). The context
//! crosses every hop only as the messages' headers carry it (the outbox
//! row, then AMQP), as it would between processes. The spans go through
//! `tracing-opentelemetry` to the OpenTelemetry SDK's in-memory exporter.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use consumer_app::parcel::downstream::{Downstreams, StubCarrier, StubNotifier};
use consumer_app::parcel::role::Role;
use consumer_app::parcel::service::{consumers, with_handlers};
use consumer_app::parcel::store::ParcelStore;
use consumer_app::parcel::topology::Topology;
use consumer_app::tools::http::request_with;
use consumer_app::tools::producer::Producer;
use inbox_runtime::{ServiceConfig, WorkerConfig};
use opentelemetry::trace::{SpanKind, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing_subscriber::layer::SubscriberExt as _;

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The client's span: each store's request continues a trace of its own.
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// The process's one subscriber, exporting to one in-memory exporter: the
/// tests of this file run at once and tell their spans apart by trace.
fn exporter() -> &'static (InMemorySpanExporter, SdkTracerProvider) {
    static TELEMETRY: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    TELEMETRY.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_subscriber::EnvFilter::new(
                "inbox_api=debug,inbox_runtime=info,consumer_app=info",
            ))
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("trace-test")));
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        (exporter, provider)
    })
}

fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
    spans.iter().filter(|s| s.name == name).collect()
}

fn attribute(span: &SpanData, key: &str) -> String {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
        .unwrap_or_default()
}

async fn one_request_is_one_trace_to_the_last_consumer<S: ParcelStore>(
    store: S,
    prefix: &str,
    client_trace: &str,
) {
    let (exporter, provider) = exporter();
    let prefix = prefix.to_owned();
    let topology = Topology::new(&prefix);
    let _remove = topology.remove_on_drop(AMQP_URL);
    let downstreams = Downstreams {
        carrier: Arc::new(StubCarrier::default()),
        notifier: Arc::new(StubNotifier::default()),
    };
    let service = with_handlers(
        store.clone(),
        ServiceConfig {
            worker: WorkerConfig {
                prefetch: 8,
                concurrency: 2,
                ..WorkerConfig::default()
            },
            connection_name: format!("trace {prefix}"),
            cleanup: None,
            gauge_interval: None,
            ..ServiceConfig::new(AMQP_URL, "")
        },
        &topology,
        consumers(downstreams).expect("consumers"),
    )
    .spawn()
    .expect("service starts");
    service
        .wait_consuming(1, Duration::from_secs(20))
        .await
        .expect("RabbitMQ reachable (bash .ci/services.sh)");
    let producer = Producer::start(
        store.clone(),
        &topology,
        AMQP_URL,
        &format!("relay {prefix}"),
    )
    .await
    .expect("producer starts");

    let traceparent = format!("00-{client_trace}-{CLIENT_SPAN}-01");
    let answer = request_with(
        producer.addr(),
        "POST",
        "/parcels",
        Some("application/json"),
        &[("traceparent", traceparent.as_str())],
        r#"{"parcel_id": "P-trace", "tracking_number": "TN1", "destination": "Lyon"}"#,
    )
    .await
    .expect("POST /parcels");
    assert_eq!(answer.status, 201, "{answer:?}");

    let tally = Arc::clone(&service.tally);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !Role::ALL
        .iter()
        .all(|r| tally.consumer(r.consumer_name()).processed() >= 1)
    {
        assert!(
            Instant::now() < deadline,
            "the parcel did not cross both hops"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    producer.stop().await.expect("relay stops");
    service.shutdown();
    service.join().await.expect("clean shutdown");
    provider.force_flush().expect("flush");
    let spans = exporter.get_finished_spans().expect("spans");

    let trace = TraceId::from_hex(client_trace).expect("trace id");
    let in_trace = |span: &&SpanData| span.span_context.trace_id() == trace;
    let summary: Vec<String> = spans
        .iter()
        .map(|s| format!("{} {}", s.name, s.span_context.trace_id()))
        .collect();

    let requests: Vec<&SpanData> = named(&spans, "POST /parcels")
        .into_iter()
        .filter(in_trace)
        .collect();
    assert_eq!(requests.len(), 1, "{summary:#?}");
    assert!(
        in_trace(&requests[0]),
        "the request continues the client's trace"
    );
    assert_eq!(requests[0].span_kind, SpanKind::Server);

    let publishes: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.name.ends_with(" publish"))
        .filter(in_trace)
        .collect();
    assert_eq!(
        publishes.len(),
        2,
        "both relay publishes (parcel.created, its follow-up): {summary:#?}"
    );
    assert!(publishes.iter().all(|s| s.span_kind == SpanKind::Producer));

    let processes: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.name.ends_with(" process"))
        .filter(in_trace)
        .collect();
    let mut consumers: Vec<String> = processes
        .iter()
        .map(|s| attribute(s, "messaging.consumer.group.name"))
        .collect();
    consumers.sort();
    let mut expected: Vec<String> = Role::ALL
        .iter()
        .map(|r| r.consumer_name().to_owned())
        .collect();
    expected.sort();
    assert_eq!(
        consumers, expected,
        "every consumer's process span: {summary:#?}"
    );
    assert!(processes.iter().all(|s| s.span_kind == SpanKind::Consumer));

    for step in ["inbox.claim", "inbox.work", "inbox.commit"] {
        let inside = named(&spans, step).into_iter().filter(in_trace).count();
        assert!(
            inside >= 3,
            "{step}: one per consumer's transaction in the trace, {inside} found: {summary:#?}"
        );
    }
    store.drop_schema().await.expect("drop schema");
}

fn prefix(kind: &str) -> String {
    format!(
        "test-trace-{kind}-{}.",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A schema name from a test prefix: lower-case letters, digits and `_`.
fn schema(prefix: &str) -> String {
    prefix.trim_end_matches('.').replace('-', "_")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_one_request_is_one_trace_to_the_last_consumer() {
    let store = inbox_backend_memory::MemoryStore::new();
    one_request_is_one_trace_to_the_last_consumer(
        store,
        &prefix("memory"),
        "4bf92f3577b34da6a3ce929d0e0e4736",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_one_request_is_one_trace_to_the_last_consumer() {
    let prefix = prefix("sqlx");
    let store = inbox_backend_sqlx::SqlxStore::connect(&database_url(), &schema(&prefix))
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate_all().await.expect("migrate");
    one_request_is_one_trace_to_the_last_consumer(
        store,
        &prefix,
        "4bf92f3577b34da6a3ce929d0e0e4737",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diesel_one_request_is_one_trace_to_the_last_consumer() {
    let prefix = prefix("diesel");
    let store = inbox_backend_diesel::DieselStore::connect(&database_url(), &schema(&prefix), 8)
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    store.migrate_all().await.expect("migrate");
    one_request_is_one_trace_to_the_last_consumer(
        store,
        &prefix,
        "4bf92f3577b34da6a3ce929d0e0e4738",
    )
    .await;
}
