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
                "inbox_api=debug,inbox_runtime=info,inbox_runtime::trace=debug,consumer_app=info",
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
    // Each consumer settles its delivery (an ack) in a span of its own,
    // inside its process span.
    for process in &processes {
        let settles: Vec<&SpanData> = spans
            .iter()
            .filter(|s| {
                s.name.ends_with(" settle") && s.parent_span_id == process.span_context.span_id()
            })
            .collect();
        assert_eq!(
            settles.len(),
            1,
            "{} settles once: {summary:#?}",
            process.name
        );
        assert_eq!(attribute(settles[0], "messaging.operation.type"), "settle");
        assert_eq!(attribute(settles[0], "acked"), "1");
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

/// A message dead-lettered by a handler that refuses it, then replayed
/// after the fix: both deliveries are in the producer's trace, the dead
/// letter names the attempt that gave it up, and the replayed delivery's
/// span links to that attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_dead_letter_links_to_the_attempt_that_gave_it_up() {
    use std::sync::atomic::{AtomicBool, Ordering};

    use inbox_runtime::lapin::BasicProperties;
    use inbox_runtime::lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    use inbox_runtime::lapin::types::{AMQPValue, FieldTable};
    use inbox_runtime::prelude::*;

    static REFUSE: AtomicBool = AtomicBool::new(true);
    #[derive(Clone, serde::Serialize, serde::Deserialize)]
    struct Order {
        id: i64,
    }
    impl Event for Order {
        const TYPE: &'static str = "trace.order";
    }
    async fn take(_cx: Context<'_, MemoryTransaction>, _order: Order) -> Result<(), AppError> {
        if REFUSE.load(Ordering::SeqCst) {
            return Err(AppError::permanent("refused until the fix"));
        }
        Ok(())
    }

    let (exporter, provider) = exporter();
    let prefix = prefix("replay");
    let queue = format!("{prefix}orders");
    let topology = inbox_runtime::Topology::new(format!("{prefix}shop")).bind(&queue, Order::TYPE);
    let _remove = topology.remove_on_drop(AMQP_URL);
    let service = Service::new(
        MemoryStore::new(),
        ServiceConfig {
            cleanup: None,
            gauge_interval: None,
            ..ServiceConfig::new(AMQP_URL, "trace replay")
        },
        topology.clone(),
    )
    .consume(&queue, handler_fn("trace-orders", take).expect("handler"))
    .spawn()
    .expect("service starts");
    service
        .wait_consuming(1, Duration::from_secs(20))
        .await
        .expect("RabbitMQ reachable (bash .ci/services.sh)");

    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4739";
    let connection = inbox_runtime::amqp::connect(AMQP_URL, "trace replay client")
        .await
        .expect("connect");
    let channel = inbox_runtime::amqp::open_channel(&connection, "client")
        .await
        .expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let mut headers = FieldTable::default();
    headers.insert(
        "traceparent".into(),
        AMQPValue::LongString(format!("00-{client_trace}-{CLIENT_SPAN}-01").into()),
    );
    let properties = BasicProperties::default()
        .with_message_id(uuid::Uuid::new_v4().to_string().into())
        .with_type(Order::TYPE.into())
        .with_headers(headers);
    channel
        .basic_publish(
            topology.exchange().into(),
            Order::TYPE.into(),
            BasicPublishOptions::default(),
            br#"{"id": 1}"#,
            properties,
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");

    let tally = Arc::clone(&service.tally);
    let wait = async |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    wait("the order is dead-lettered", &|| {
        tally.consumer("trace-orders").dead_lettered_total() >= 1
    })
    .await;
    REFUSE.store(false, Ordering::SeqCst);
    let replayed = inbox_runtime::replay::replay(&channel, &queue, |_| true)
        .await
        .expect("replay");
    assert_eq!(replayed.moved, 1);
    wait("the replayed order is processed", &|| {
        tally.consumer("trace-orders").processed() >= 1
    })
    .await;
    inbox_runtime::amqp::close_bounded(&connection, "done").await;
    service.shutdown();
    service.join().await.expect("clean shutdown");
    provider.force_flush().expect("flush");
    let spans = exporter.get_finished_spans().expect("spans");

    let trace = TraceId::from_hex(client_trace).expect("trace id");
    let summary: Vec<String> = spans
        .iter()
        .map(|s| format!("{} {}", s.name, s.span_context.trace_id()))
        .collect();
    let mut processes: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.name == format!("{queue} process"))
        .collect();
    processes.sort_by_key(|s| s.start_time);
    let [failed, replayed] = processes[..] else {
        panic!("two deliveries, the failed one and the replay: {summary:#?}");
    };
    for span in [failed, replayed] {
        assert_eq!(
            span.span_context.trace_id(),
            trace,
            "in the producer's trace"
        );
        assert_eq!(
            span.parent_span_id.to_string(),
            CLIENT_SPAN,
            "a child of the producer's span"
        );
    }
    let links: Vec<_> = replayed
        .links
        .iter()
        .map(|l| l.span_context.span_id())
        .collect();
    assert_eq!(
        links,
        vec![failed.span_context.span_id()],
        "the replay links to the attempt that dead-lettered it"
    );
    assert!(failed.links.is_empty(), "a first delivery links to nothing");
    let mut settles: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.name == format!("{queue} settle"))
        .collect();
    settles.sort_by_key(|s| s.start_time);
    let settled: Vec<String> = settles
        .iter()
        .map(|s| {
            format!(
                "acked={} dead_lettered={}",
                attribute(s, "acked"),
                attribute(s, "dead_lettered")
            )
        })
        .collect();
    assert_eq!(
        settled,
        ["acked=0 dead_lettered=1", "acked=1 dead_lettered=0"],
        "{summary:#?}"
    );
}
