//! End-to-end tests against a real RabbitMQ (127.0.0.1:5672, guest/guest)
//! and a real PostgreSQL (`DATABASE_URL`, default
//! postgres://postgres@127.0.0.1:5432/test); the demo also on NATS
//! JetStream (127.0.0.1:4222).
//!
//! Every scenario runs once per compiled store (`cargo test -p consumer-app
//! --all-features` runs all three), each test with its own exchange/queue
//! prefix and its own database schema. An unreachable service fails the test
//! with a message saying so: nothing is skipped silently. `bash
//! .ci/services.sh` starts both.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use consumer_app::parcel::downstream::{Downstreams, StubCarrier, StubNotifier};
use consumer_app::parcel::events::EVENT_TYPE;
use consumer_app::parcel::role::Role;
use consumer_app::parcel::service::{consumers, with_handlers};
use consumer_app::parcel::store::{ParcelStore, Stats, StoreKind};
use consumer_app::parcel::topology::Topology;
use consumer_app::tools::faults::Faults;
use consumer_app::tools::publish::{Plan, publish};
use inbox_api::{ConsumerName, InboxKey};
use inbox_runtime::amqp::{Outgoing, connect};
use inbox_runtime::message::{BadInputReason, header_text};
use inbox_runtime::{QueueType, ServiceConfig, ServiceHandle, WorkerConfig};
use lapin::options::BasicGetOptions;

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const NATS_URL: &str = "nats://127.0.0.1:4222";

/// `url` with `application_name` set, so a test can find its connections.
#[cfg(any(feature = "sqlx", feature = "diesel"))]
fn with_application_name(url: &str, name: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}application_name={name}")
}

#[cfg(any(feature = "sqlx", feature = "diesel"))]
fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

#[cfg(any(feature = "sqlx", feature = "diesel"))]
fn unreachable_postgres(error: &inbox_api::InboxError) -> ! {
    panic!(
        "PostgreSQL is not reachable at {} ({}); start it with `bash .ci/services.sh`",
        inbox_runtime::redact::redact_url(&database_url()),
        inbox_runtime::error::chain(error)
    )
}

fn unique() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

/// Names for one test: a queue prefix and a schema.
struct Names {
    prefix: String,
    schema: String,
    connection: String,
}

fn names(test: &str) -> Names {
    let id = unique();
    Names {
        prefix: format!("test-{test}-{id}."),
        schema: format!("app_test_{id}"),
        connection: format!("parcel-inbox test {test} {id}"),
    }
}

async fn require_rabbitmq() {
    if let Err(error) = connect(AMQP_URL, "parcel-inbox test probe").await {
        panic!(
            "RabbitMQ is not reachable at 127.0.0.1:5672 ({}); start it with `bash .ci/services.sh`",
            inbox_runtime::error::chain(&error)
        );
    }
}

/// Fails (never skips, under `CI=true` or not) when NATS is away: the
/// demo on NATS is a test like the others.
async fn require_nats() {
    let probe = inbox_runtime::nats::connect(
        NATS_URL,
        "parcel-inbox test probe",
        inbox_runtime::broker::ConnectOptions::default(),
    )
    .await;
    match probe {
        Ok(client) => drop(client.drain().await),
        Err(error) => panic!(
            "NATS is not reachable at {NATS_URL} ({}); start it with `bash .ci/services.sh`",
            inbox_runtime::error::chain(&error)
        ),
    }
}

fn worker_config() -> WorkerConfig {
    WorkerConfig {
        prefetch: 16,
        concurrency: 4,
        handle_timeout: Duration::from_secs(10),
        retry_attempts: 3,
        retry_base_delay: Duration::from_millis(5),
        max_deliveries: 5,
        max_body_bytes: 1024,
        batch: None,
        ack_flush: Duration::from_millis(2),
    }
}

struct Running {
    service: ServiceHandle,
    carrier: Arc<StubCarrier>,
    notifier: Arc<StubNotifier>,
}

async fn start<S: ParcelStore>(store: &S, names: &Names, faults: Faults) -> Running {
    start_with(store, names, Arc::new(faults)).await
}

async fn start_with<S: ParcelStore>(store: &S, names: &Names, faults: Arc<Faults>) -> Running {
    start_on(store, names, faults, &Topology::new(&names.prefix)).await
}

/// As [`start_with`], on `topology` (a classic-queue one, say).
async fn start_on<S: ParcelStore>(
    store: &S,
    names: &Names,
    faults: Arc<Faults>,
    topology: &Topology,
) -> Running {
    start_configured(store, names, faults, topology, worker_config()).await
}

/// As [`start_on`], with the message path's settings `worker`.
async fn start_configured<S: ParcelStore>(
    store: &S,
    names: &Names,
    faults: Arc<Faults>,
    topology: &Topology,
    worker: WorkerConfig,
) -> Running {
    if std::env::var_os("RUST_LOG").is_some() {
        consumer_app::tools::logging::init_logging(Default::default());
    }
    let carrier = Arc::new(StubCarrier::default());
    let notifier = Arc::new(StubNotifier::default());
    let consumers = consumers(Downstreams {
        carrier: carrier.clone(),
        notifier: notifier.clone(),
    })
    .expect("consumers")
    .map(&faults);
    let service = with_handlers(
        store.clone(),
        ServiceConfig {
            broker_url: AMQP_URL.to_owned(),
            worker,
            connection_name: names.connection.clone(),
            cleanup: None,
            gauge_interval: None,
            availability: Default::default(),
            connection: Default::default(),
        },
        topology,
        consumers,
    )
    .spawn()
    .expect("service starts");
    service
        .wait_consuming(1, Duration::from_secs(20))
        .await
        .expect("service consuming");
    Running {
        service,
        carrier,
        notifier,
    }
}

/// Polls `done` every 25 ms until it holds or `timeout` passes.
async fn eventually(what: &str, timeout: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Removes a test's queues, exchanges and schema when the test panics (on
/// success the test calls [`cleanup`] itself), so failures leave no junk.
struct Teardown<S: ParcelStore> {
    store: S,
    prefix: String,
}

impl<S: ParcelStore> Teardown<S> {
    fn new(store: &S, names: &Names) -> Self {
        Self {
            store: store.clone(),
            prefix: names.prefix.clone(),
        }
    }
}

impl<S: ParcelStore> Drop for Teardown<S> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let (store, prefix) = (self.store.clone(), self.prefix.clone());
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async move {
                if let Ok(connection) = connect(AMQP_URL, "parcel-inbox test teardown").await {
                    if let Ok(channel) = connection.create_channel().await {
                        let _ = Topology::new(prefix).delete(&channel).await;
                    }
                    inbox_runtime::amqp::close_bounded(&connection, "bye").await;
                }
                let _ = store.drop_schema().await;
            });
        });
    }
}

async fn cleanup<S: ParcelStore>(store: &S, names: &Names) {
    let connection = connect(AMQP_URL, "parcel-inbox test cleanup")
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    Topology::new(&names.prefix)
        .delete(&channel)
        .await
        .expect("delete topology");
    inbox_runtime::amqp::close_bounded(&connection, "bye").await;
    store.drop_schema().await.expect("drop schema");
}

/// The database URL the binary gets in a test.
fn database_url_for_cli() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// Runs `parcel-inbox` with `args` and the shared configuration `env`
/// (as an operator's environment: each command takes what it uses, where
/// a flag it cannot use would be refused), killed after a minute; returns
/// its stdout, failing with everything it printed unless it succeeded.
async fn parcel_inbox(env: &[(&str, String)], args: &[&str]) -> String {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
        .envs(env.iter().map(|(name, value)| (name, value)))
        .args(args)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(60), child)
        .await
        .unwrap_or_else(|_| panic!("parcel-inbox {args:?} ran over a minute; killed"))
        .expect("run parcel-inbox");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "parcel-inbox {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// The message id and headers of the first message in `queue` (a
/// dead-letter queue), which stays there.
async fn peek_dead_letter(
    channel: &lapin::Channel,
    queue: &str,
) -> (Option<String>, lapin::types::FieldTable) {
    let message = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .expect("basic.get")
        .expect("a message in the dead-letter queue");
    let properties = &message.delivery.properties;
    let id = properties.message_id().as_ref().map(|id| id.to_string());
    let headers = properties.headers().clone().unwrap_or_default();
    message
        .delivery
        .nack(lapin::options::BasicNackOptions {
            multiple: false,
            requeue: true,
        })
        .await
        .expect("give it back to the dead-letter queue");
    (id, headers)
}

fn assert_exactly_once(stats: &Stats, n: u64) {
    for (table, counts) in [
        ("notifications", stats.notifications),
        ("carrier_assignments", stats.carrier_assignments),
    ] {
        assert_eq!(counts.rows, n, "{table}: one row per message\n{stats}");
        assert_eq!(counts.distinct_messages, n, "{table}\n{stats}");
        assert_eq!(counts.distinct_parcels, n, "{table}\n{stats}");
        assert_eq!(counts.double_effects(), 0, "{table}\n{stats}");
    }
    for role in Role::PARCEL_CREATED {
        assert_eq!(
            stats.inbox_per_consumer.get(role.consumer_name()).copied(),
            Some(n),
            "inbox rows of {}\n{stats}",
            role.consumer_name()
        );
    }
}

// ---------------------------------------------------------------- scenarios

/// Copies reusing message ids: each consumer's effect exactly once, and both
/// consumers act on every message independently.
async fn duplicates_are_discarded_per_consumer<S: ParcelStore>(store: S, names: Names) {
    require_rabbitmq().await;
    let _teardown = Teardown::new(&store, &names);
    let run = start(&store, &names, Faults::default()).await;
    let plan = Plan::new(60, 0.5, 7, &format!("P{}", names.schema)).expect("plan");
    assert_eq!(plan.copies, 30);
    let topology = Topology::new(&names.prefix);
    publish(AMQP_URL, &topology, &plan.messages, false)
        .await
        .expect("publish");
    let tally = Arc::clone(&run.service.tally);
    eventually(
        "90 deliveries per consumer",
        Duration::from_secs(30),
        async || {
            Role::PARCEL_CREATED
                .iter()
                .all(|r| tally.consumer(r.consumer_name()).finished() >= 90)
        },
    )
    .await;
    run.service.shutdown();
    run.service.join().await.expect("clean shutdown");

    for role in Role::PARCEL_CREATED {
        let t = tally.consumer(role.consumer_name());
        assert_eq!(t.processed(), 60, "{role:?}");
        assert_eq!(t.duplicates(), 30, "{role:?}: every copy discarded");
        assert_eq!(t.dead_lettered_total(), 0, "{role:?}");
    }
    let stats = store.stats().await.expect("stats");
    assert_exactly_once(&stats, 60);
    assert_eq!(run.carrier.ledger.distinct_keys(), 60);
    assert_eq!(run.carrier.ledger.calls(), 60, "no booking call repeated");
    assert!(
        run.carrier
            .ledger
            .parcels_booked_more_than_once()
            .is_empty()
    );
    assert_eq!(run.notifier.ledger.calls(), 60);
    // Both consumers hold their own row for the same message.
    for id in plan.ids.iter().take(5) {
        for role in Role::PARCEL_CREATED {
            let key = InboxKey::new(*id, ConsumerName::new(role.consumer_name()).expect("name"));
            let record = store.lookup(&key).await.expect("lookup");
            assert!(
                record.is_some_and(|r| r.processed_at.is_some()),
                "{key} processed"
            );
        }
    }
    cleanup(&store, &names).await;
}

/// Each class of bad input lands in each queue's dead-letter queue with its
/// reason, and the consumers keep running.
async fn bad_input_is_dead_lettered_with_reason<S: ParcelStore>(store: S, names: Names) {
    require_rabbitmq().await;
    let _teardown = Teardown::new(&store, &names);
    let run = start(&store, &names, Faults::default()).await;
    let topology = Topology::new(&names.prefix);
    let good = br#"{"parcel_id":"P-1","tracking_number":"TN1","destination":"Lyon"}"#.to_vec();
    let id = || Some(uuid::Uuid::now_v7().to_string());
    let event = || Some(EVENT_TYPE.to_owned());
    let mut oversized = br#"{"parcel_id":"P-2","tracking_number":"TN2","destination":""#.to_vec();
    oversized.extend(std::iter::repeat_n(b'x', 2000));
    oversized.extend(br#""}"#);
    let bad = [
        (
            BadInputReason::MissingMessageId,
            Outgoing {
                message_id: None,
                kind: event(),
                body: good.clone(),
            },
        ),
        (
            BadInputReason::InvalidMessageId,
            Outgoing {
                message_id: Some("order-42".into()),
                kind: event(),
                body: good.clone(),
            },
        ),
        (
            BadInputReason::InvalidJson,
            Outgoing {
                message_id: id(),
                kind: event(),
                body: b"{\"parcel_id\": ".to_vec(),
            },
        ),
        (
            BadInputReason::InvalidEvent,
            Outgoing {
                message_id: id(),
                kind: event(),
                body: br#"{"parcel":"P-1"}"#.to_vec(),
            },
        ),
        // JSON carries a NUL that PostgreSQL text cannot store: refused
        // in decoding by both consumers alike, not as a store error by
        // the one that writes the field.
        (
            BadInputReason::InvalidEvent,
            Outgoing {
                message_id: id(),
                kind: event(),
                body: br#"{"parcel_id":"P-3","tracking_number":"TN3","destination":"Ly\u0000on"}"#
                    .to_vec(),
            },
        ),
        // Any other control character likewise (an escape that would
        // forge a terminal's or a label's output).
        (
            BadInputReason::InvalidEvent,
            Outgoing {
                message_id: id(),
                kind: event(),
                body:
                    br#"{"parcel_id":"P-4","tracking_number":"TN\u001b[2J","destination":"Lyon"}"#
                        .to_vec(),
            },
        ),
        (
            BadInputReason::UnknownType,
            Outgoing {
                message_id: id(),
                kind: Some("parcel.deleted".into()),
                body: good.clone(),
            },
        ),
        (
            BadInputReason::Oversized,
            Outgoing {
                message_id: id(),
                kind: event(),
                body: oversized,
            },
        ),
    ];
    let mut messages: Vec<Outgoing> = bad.iter().map(|(_, m)| m.clone()).collect();
    // A good message after the bad ones: the consumers are still running.
    messages.push(Outgoing {
        message_id: id(),
        kind: event(),
        body: good.clone(),
    });
    publish(AMQP_URL, &topology, &messages, false)
        .await
        .expect("publish");

    let tally = Arc::clone(&run.service.tally);
    eventually(
        "7 dead-lettered and 1 processed per consumer",
        Duration::from_secs(20),
        async || {
            Role::PARCEL_CREATED.iter().all(|r| {
                let t = tally.consumer(r.consumer_name());
                t.dead_lettered_total() >= 7 && t.processed() >= 1
            })
        },
    )
    .await;

    let expected: BTreeSet<String> = BadInputReason::ALL
        .iter()
        .map(|r| r.as_str().to_owned())
        .collect();
    let connection = connect(AMQP_URL, "parcel-inbox test dlq reader")
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    for role in Role::PARCEL_CREATED {
        let counted: BTreeSet<String> = tally
            .consumer(role.consumer_name())
            .dead_lettered()
            .into_keys()
            .collect();
        assert_eq!(counted, expected, "{role:?}: one dead-letter per class");
        let dlq = topology.dead_letter_queue(role);
        let mut reasons = BTreeSet::new();
        let mut details = Vec::new();
        for _ in 0..bad.len() {
            let message = channel
                .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .expect("basic.get")
                .unwrap_or_else(|| {
                    panic!(
                        "{dlq}: fewer than {} dead letters (got {reasons:?})",
                        bad.len()
                    )
                });
            let headers = message
                .delivery
                .properties
                .headers()
                .clone()
                .unwrap_or_default();
            let reason = header_text(&headers, "x-dead-letter-reason").expect("reason header");
            let detail = header_text(&headers, "x-dead-letter-detail").expect("detail header");
            assert!(!detail.is_empty());
            assert_eq!(
                header_text(&headers, "x-dead-letter-consumer").as_deref(),
                Some(role.consumer_name())
            );
            reasons.insert(reason);
            details.push(detail);
        }
        for (field, control) in [("destination", "U+0000"), ("tracking_number", "U+001B")] {
            assert!(
                details
                    .iter()
                    .any(|d| d.contains(field) && d.contains(control)),
                "{dlq}: the {control} event's detail names its field: {details:?}"
            );
        }
        assert_eq!(
            reasons, expected,
            "{dlq}: every bad-input class with its reason"
        );
        assert_eq!(
            topology
                .ready_messages(&channel, &topology.queue(role))
                .await
                .expect("depth"),
            0,
            "nothing left in the work queue"
        );
    }
    inbox_runtime::amqp::close_bounded(&connection, "bye").await;
    run.service.shutdown();
    run.service.join().await.expect("clean shutdown");
    let stats = store.stats().await.expect("stats");
    assert_exactly_once(&stats, 1);
    cleanup(&store, &names).await;
}

/// A message whose work always fails with a retryable error is retried in
/// process, requeued, and once the broker's delivery count reaches the cap,
/// dead-lettered as `retries_exhausted`: nothing loops forever. Its effect
/// never commits; the other messages are unaffected.
async fn retryable_failures_are_capped<S: ParcelStore>(store: S, names: Names) {
    require_rabbitmq().await;
    let _teardown = Teardown::new(&store, &names);
    let plan = Plan::new(5, 0.0, 11, &format!("P{}", names.schema)).expect("plan");
    let poison = plan.ids[2];
    let faults = Arc::new(Faults::default());
    faults.fail_always(InboxKey::new(
        poison,
        ConsumerName::new(Role::Carrier.consumer_name()).expect("name"),
    ));
    let run = start_with(&store, &names, faults).await;
    let topology = Topology::new(&names.prefix);
    publish(AMQP_URL, &topology, &plan.messages, false)
        .await
        .expect("publish");
    let tally = Arc::clone(&run.service.tally);
    eventually(
        "the poison message dead-lettered",
        Duration::from_secs(30),
        async || {
            tally
                .consumer(Role::Carrier.consumer_name())
                .dead_lettered_total()
                >= 1
                && tally
                    .consumer(Role::Notification.consumer_name())
                    .processed()
                    >= 5
        },
    )
    .await;
    run.service.shutdown();
    run.service.join().await.expect("clean shutdown");
    let carrier = tally.consumer(Role::Carrier.consumer_name());
    assert_eq!(
        carrier.dead_lettered().into_iter().collect::<Vec<_>>(),
        vec![("retries_exhausted".to_owned(), 1)]
    );
    let max = u64::from(worker_config().max_deliveries);
    assert_eq!(carrier.requeued(), max - 1, "requeued until the cap");
    assert_eq!(carrier.processed(), 4);
    let stats = store.stats().await.expect("stats");
    assert_eq!(
        stats.carrier_assignments.rows, 4,
        "the failing work never committed"
    );
    assert_eq!(
        stats.notifications.rows, 5,
        "the other consumer is unaffected"
    );

    let connection = connect(AMQP_URL, "parcel-inbox test dlq reader")
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    let (message_id, headers) =
        peek_dead_letter(&channel, &topology.dead_letter_queue(Role::Carrier)).await;
    assert_eq!(message_id, Some(poison.to_string()));
    assert_eq!(
        header_text(&headers, "x-dead-letter-reason").as_deref(),
        Some("retries_exhausted")
    );
    inbox_runtime::amqp::close_bounded(&connection, "bye").await;
    cleanup(&store, &names).await;
}

/// A poison message on a classic queue, which keeps no delivery count (as
/// a quorum queue on RabbitMQ 4.3 keeps none for nacks): the broker's count
/// stays 0, so only the attempt ledger can bring it to the cap. It is
/// dead-lettered after exactly `max_deliveries` failed deliveries with its
/// count and last error in headers, `dead` lists it, and once the fault is
/// fixed a replay from the dead-letter queue processes it exactly once.
async fn poison_on_a_classic_queue_is_capped_by_the_ledger_and_replayed_once<S: ParcelStore>(
    store: S,
    names: Names,
) {
    require_rabbitmq().await;
    let _teardown = Teardown::new(&store, &names);
    let plan = Plan::new(5, 0.0, 17, &format!("P{}", names.schema)).expect("plan");
    let poison = InboxKey::new(
        plan.ids[1],
        ConsumerName::new(Role::Carrier.consumer_name()).expect("name"),
    );
    // An attempt abandoned mid-transaction is handed back, not the
    // message's fault: it must cost nothing in the ledger.
    let abandoned = InboxKey::new(plan.ids[3], poison.consumer.clone());
    let faults = Arc::new(Faults::default());
    faults.fail_always(poison.clone());
    faults.crash_first_attempt(abandoned.clone());
    let topology = Topology::new(&names.prefix).with_queue_type(QueueType::Classic);
    let run = start_on(&store, &names, Arc::clone(&faults), &topology).await;
    publish(AMQP_URL, &topology, &plan.messages, false)
        .await
        .expect("publish");
    let tally = Arc::clone(&run.service.tally);
    let carrier = tally.consumer(Role::Carrier.consumer_name());
    eventually(
        "the poison message dead-lettered on a classic queue",
        Duration::from_secs(60),
        async || carrier.dead_lettered_total() >= 1 && carrier.processed() >= 4,
    )
    .await;
    let max = worker_config().max_deliveries;
    assert_eq!(
        carrier.dead_lettered().into_iter().collect::<Vec<_>>(),
        vec![("retries_exhausted".to_owned(), 1)]
    );
    assert_eq!(faults.crashes(Role::Carrier.consumer_name()), 1);
    assert_eq!(
        store.attempts(&abandoned).await.expect("ledger"),
        None,
        "an abandoned attempt was charged to its message"
    );
    assert_eq!(
        carrier.requeued(),
        u64::from(max - 1),
        "rejected back to the queue until the cap"
    );
    let record = store
        .attempts(&poison)
        .await
        .expect("ledger")
        .expect("the poison message's ledger row");
    assert_eq!(record.attempts, max, "{record:?}");
    assert_eq!(
        record.dead.as_ref().map(|d| d.reason.as_str()),
        Some("retries_exhausted")
    );
    assert!(
        record.last_error.contains("injected transient failure"),
        "{record:?}"
    );
    let dead = store
        .dead_messages(Some(&poison.consumer), std::num::NonZeroU32::MIN)
        .await
        .expect("dead messages");
    assert_eq!(
        dead.iter().map(|r| r.key.clone()).collect::<Vec<_>>(),
        vec![poison.clone()]
    );

    let connection = connect(AMQP_URL, "parcel-inbox test replay")
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    let carrier_queue = topology.queue(Role::Carrier);
    let dead_letter_queue = topology.dead_letter_queue(Role::Carrier);
    let (message_id, headers) = peek_dead_letter(&channel, &dead_letter_queue).await;
    assert_eq!(message_id, Some(poison.message_id.to_string()));
    assert_eq!(
        header_text(&headers, "x-dead-letter-reason").as_deref(),
        Some("retries_exhausted")
    );
    assert_eq!(
        headers.inner().get("x-inbox-attempts"),
        Some(&lapin::types::AMQPValue::LongLongInt(i64::from(max)))
    );
    let last_error = header_text(&headers, "x-inbox-last-error").unwrap_or_default();
    assert!(
        last_error.contains("injected transient failure"),
        "{last_error}"
    );
    assert!(!headers.contains_key("x-delivery-count"), "{headers:?}");

    let poison_id = poison.message_id.to_string();
    // What the operator sees (a Postgres store: the binary opens its own;
    // the memory store lives only in this process).
    let operator_env = [
        ("PARCEL_STORE", store.kind().to_string()),
        ("DATABASE_URL", database_url_for_cli()),
        ("INBOX_SCHEMA", names.schema.clone()),
        ("PARCEL_PREFIX", names.prefix.clone()),
    ];
    let carrier_name = Role::Carrier.consumer_name();
    if store.kind() != StoreKind::Memory {
        let listed = parcel_inbox(&operator_env, &["dead", "--consumer", carrier_name]).await;
        let row = listed
            .lines()
            .find(|line| line.contains(&poison_id))
            .unwrap_or_else(|| panic!("dead does not list {poison_id}:\n{listed}"));
        for field in [
            carrier_name,
            " 5 ",
            "retries_exhausted",
            "injected transient failure",
        ] {
            assert!(row.contains(field), "{field} missing in {row}");
        }
        assert!(listed.contains("1 dead message(s)"), "{listed}");
    }

    // The fix is deployed; the operator replays the dead letter.
    faults.heal(&poison);
    let replayed = parcel_inbox(
        &operator_env,
        &[
            "replay",
            "--consumer",
            carrier_name,
            "--message-id",
            &poison_id,
        ],
    )
    .await;
    assert!(
        replayed.contains("replayed 1 message(s)") && replayed.contains("0 left"),
        "{replayed}"
    );
    eventually(
        "the replayed message processed",
        Duration::from_secs(30),
        async || carrier.processed() >= 5,
    )
    .await;
    // Time for a second copy to show, if one were coming.
    tokio::time::sleep(Duration::from_millis(500)).await;
    run.service.shutdown();
    run.service.join().await.expect("clean shutdown");
    assert_exactly_once(&store.stats().await.expect("stats"), 5);
    assert_eq!(carrier.processed(), 5, "processed once after the replay");
    assert_eq!(carrier.dead_lettered_total(), 1, "not dead-lettered again");
    for queue in [&carrier_queue, &dead_letter_queue] {
        assert_eq!(
            inbox_runtime::Topology::ready_messages(&channel, queue)
                .await
                .expect("queue depth"),
            0,
            "{queue} is empty"
        );
    }
    assert!(
        store
            .dead_messages(None, std::num::NonZeroU32::MIN)
            .await
            .expect("dead messages")
            .is_empty(),
        "a replayed and processed message is not listed dead"
    );
    if store.kind() != StoreKind::Memory {
        let listed = parcel_inbox(&operator_env, &["dead"]).await;
        assert!(listed.contains("0 dead message(s)"), "{listed}");
    }
    inbox_runtime::amqp::close_bounded(&connection, "bye").await;
    cleanup(&store, &names).await;
}

/// PostgreSQL drops every connection of the service while each worker is
/// inside an open transaction (`pg_terminate_backend`, as a failover or a
/// restart would): the open transactions roll back, the message path sees
/// the store fail (not the message), hands the deliveries back uncharged,
/// and every effect still happens exactly once after their redelivery.
/// (Postgres stores only; the store's URL carries a unique
/// `application_name` so the test finds its connections.)
#[cfg(any(feature = "sqlx", feature = "diesel"))]
async fn database_connections_killed_mid_work<S: ParcelStore>(
    store: S,
    names: Names,
    application_name: &str,
) {
    const N: u64 = 30;
    require_rabbitmq().await;
    let _teardown = Teardown::new(&store, &names);
    let faults = Arc::new(Faults::default());
    faults.hold();
    let run = start_with(&store, &names, Arc::clone(&faults)).await;
    let plan = Plan::new(N as usize, 0.0, 13, &format!("P{}", names.schema)).expect("plan");
    let topology = Topology::new(&names.prefix);
    publish(AMQP_URL, &topology, &plan.messages, false)
        .await
        .expect("publish");
    let concurrency = worker_config().concurrency as u64;
    eventually(
        "all workers held mid-transaction",
        Duration::from_secs(20),
        async || faults.held() >= 2 * concurrency,
    )
    .await;
    let sql = format!(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE application_name = '{application_name}' AND pid <> pg_backend_pid()"
    );
    let killed = tokio::process::Command::new("psql")
        .args([&database_url(), "-Atc", &sql])
        .output()
        .await
        .expect("psql runs");
    assert!(killed.status.success(), "psql: {killed:?}");
    let killed: u64 = String::from_utf8_lossy(&killed.stdout)
        .trim()
        .parse()
        .expect("a count");
    assert!(killed >= 2 * concurrency, "terminated {killed} connections");
    faults.release();

    let tally = Arc::clone(&run.service.tally);
    eventually(
        "every message processed by both consumers",
        Duration::from_secs(30),
        async || {
            Role::PARCEL_CREATED
                .iter()
                .all(|r| tally.consumer(r.consumer_name()).processed() >= N)
        },
    )
    .await;
    run.service.shutdown();
    run.service.join().await.expect("clean shutdown");
    // A lost connection is the store's failure, not the message's: handed
    // back uncharged (no in-process retry spent) and redelivered.
    let released: u64 = Role::PARCEL_CREATED
        .iter()
        .map(|r| tally.consumer(r.consumer_name()).released())
        .sum();
    assert!(
        released >= 2 * concurrency,
        "the killed transactions were handed back ({released})"
    );
    for role in Role::PARCEL_CREATED {
        assert_eq!(
            tally.consumer(role.consumer_name()).processed(),
            N,
            "{role:?}"
        );
        assert_eq!(
            tally.consumer(role.consumer_name()).dead_lettered_total(),
            0,
            "{role:?}"
        );
    }
    let stats = store.stats().await.expect("stats");
    assert_exactly_once(&stats, N);
    cleanup(&store, &names).await;
}

/// The broker closes the consumer's connection mid-work (as `rabbitmqctl
/// close_connection` does): in-flight deliveries come back, the service
/// reconnects, and every effect still happens exactly once.
async fn closed_connection_redelivers_exactly_once<S: ParcelStore>(store: S, names: Names) {
    const N: u64 = 60;
    require_rabbitmq().await;
    let _teardown = Teardown::new(&store, &names);
    let faults = Arc::new(Faults::default());
    let run = start_with(&store, &names, Arc::clone(&faults)).await;
    let pid = connection_pid(&names.connection).await;
    let plan = Plan::new(N as usize, 0.0, 3, &format!("P{}", names.schema)).expect("plan");
    let topology = Topology::new(&names.prefix);
    // Mid-work, deterministically: every worker stops inside its open
    // transaction (its rows written, not committed) while the connection
    // is closed under it. Held before publishing: the memory store drains
    // 60 messages faster than a test can react, so holding after "some work
    // done" found nothing left to hold on a quiet machine.
    faults.hold();
    publish(AMQP_URL, &topology, &plan.messages, false)
        .await
        .expect("publish");
    let tally = Arc::clone(&run.service.tally);
    let concurrency = worker_config().concurrency as u64;
    eventually(
        "all workers held mid-transaction",
        Duration::from_secs(20),
        async || faults.held() >= 2 * concurrency,
    )
    .await;
    close_connection(&pid).await;
    faults.release();
    run.service
        .wait_consuming(2, Duration::from_secs(30))
        .await
        .expect("the service reconnected");
    let waiting = Instant::now();
    eventually(
        "every effect in the database",
        Duration::from_secs(40),
        async || {
            let stats = store.stats().await.expect("stats");
            let done = stats.notifications.rows >= N && stats.carrier_assignments.rows >= N;
            if !done && waiting.elapsed() > Duration::from_secs(15) {
                let c = connect(AMQP_URL, "parcel-inbox test depth")
                    .await
                    .expect("connect");
                let ch = c.create_channel().await.expect("channel");
                let mut depths = Vec::new();
                for role in Role::PARCEL_CREATED {
                    depths.push(
                        topology
                            .ready_messages(&ch, &topology.queue(role))
                            .await
                            .expect("depth"),
                    );
                }
                inbox_runtime::amqp::close_bounded(&c, "bye").await;
                eprintln!("still waiting: ready {depths:?}\n{stats}{tally:?}");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            done
        },
    )
    .await;
    // Let stragglers (redeliveries of work that committed) arrive.
    let depth_zero = async || {
        let c = connect(AMQP_URL, "parcel-inbox test depth")
            .await
            .expect("connect");
        let ch = c.create_channel().await.expect("channel");
        let mut total = 0;
        for role in Role::PARCEL_CREATED {
            total += topology
                .ready_messages(&ch, &topology.queue(role))
                .await
                .expect("depth");
        }
        inbox_runtime::amqp::close_bounded(&c, "bye").await;
        total == 0
    };
    eventually("queues empty", Duration::from_secs(20), depth_zero).await;
    run.service.shutdown();
    run.service.join().await.expect("clean shutdown");

    let redelivered: u64 = Role::PARCEL_CREATED
        .iter()
        .map(|r| {
            tally.consumer(r.consumer_name()).redelivered_processed()
                + tally.consumer(r.consumer_name()).duplicates()
        })
        .sum();
    assert!(
        redelivered >= 1,
        "closing the connection mid-work caused redeliveries: {:?}",
        tally
    );
    for role in Role::PARCEL_CREATED {
        assert_eq!(
            tally.consumer(role.consumer_name()).processed(),
            N,
            "{role:?}: processed once each"
        );
    }
    let stats = store.stats().await.expect("stats");
    assert_exactly_once(&stats, N);
    assert!(
        run.carrier
            .ledger
            .parcels_booked_more_than_once()
            .is_empty()
    );
    cleanup(&store, &names).await;
}

/// Acks wait to be coalesced (`ack_flush`): the connection closes after
/// every message committed and before any ack went out. Every delivery
/// comes back and is dropped as a duplicate, each effect happened once;
/// and a graceful shutdown sends the acks still waiting (with an hour's
/// `ack_flush`, nothing else would), so nothing is left in the queues.
async fn waiting_acks_lost_with_the_connection_come_back_as_duplicates<S: ParcelStore>(
    store: S,
    names: Names,
) {
    // Below half the prefetch per queue: no flush by count.
    const N: u64 = 5;
    require_rabbitmq().await;
    let _teardown = Teardown::new(&store, &names);
    let topology = Topology::new(&names.prefix);
    let worker = WorkerConfig {
        ack_flush: Duration::from_secs(3600),
        ..worker_config()
    };
    assert!(N < u64::from(worker.prefetch / 2));
    let run = start_configured(
        &store,
        &names,
        Arc::new(Faults::default()),
        &topology,
        worker,
    )
    .await;
    let pid = connection_pid(&names.connection).await;
    let plan = Plan::new(N as usize, 0.0, 3, &format!("P{}", names.schema)).expect("plan");
    publish(AMQP_URL, &topology, &plan.messages, false)
        .await
        .expect("publish");
    let tally = Arc::clone(&run.service.tally);
    let counted = |count: fn(&inbox_runtime::ConsumerTally) -> u64| {
        Role::PARCEL_CREATED
            .iter()
            .map(|r| count(tally.consumer(r.consumer_name())))
            .collect::<Vec<u64>>()
    };
    eventually(
        "every delivery committed",
        Duration::from_secs(20),
        async || counted(|c| c.processed()) == [N, N],
    )
    .await;
    close_connection(&pid).await;
    run.service
        .wait_consuming(2, Duration::from_secs(30))
        .await
        .expect("the service reconnected");
    eventually(
        "every delivery back as a duplicate",
        Duration::from_secs(20),
        async || counted(|c| c.duplicates()) == [N, N],
    )
    .await;
    run.service.shutdown();
    run.service.join().await.expect("clean shutdown");
    assert_eq!(counted(|c| c.processed()), [N, N], "{tally:?}");
    let stats = store.stats().await.expect("stats");
    assert_exactly_once(&stats, N);
    let c = connect(AMQP_URL, "parcel-inbox test depth")
        .await
        .expect("connect");
    let ch = c.create_channel().await.expect("channel");
    for role in Role::PARCEL_CREATED {
        assert_eq!(
            topology
                .ready_messages(&ch, &topology.queue(role))
                .await
                .expect("depth"),
            0,
            "{role:?}: the shutdown acked the duplicates"
        );
    }
    inbox_runtime::amqp::close_bounded(&c, "bye").await;
    cleanup(&store, &names).await;
}

/// The broker's id of the AMQP connection called `name`.
async fn connection_pid(name: &str) -> String {
    let listed = tokio::process::Command::new("rabbitmqctl")
        .args([
            "list_connections",
            "--quiet",
            "--no-table-headers",
            "pid",
            "client_properties",
        ])
        .output()
        .await
        .expect("rabbitmqctl runs (the broker is local)");
    assert!(
        listed.status.success(),
        "rabbitmqctl list_connections: {listed:?}"
    );
    let text = String::from_utf8_lossy(&listed.stdout);
    // client_properties is an Erlang term holding {"connection_name","…"}.
    let needle = format!("{{\"connection_name\",\"{name}\"}}");
    text.lines()
        .find_map(|line| {
            let (pid, properties) = line.split_once('\t')?;
            properties.contains(&needle).then(|| pid.trim().to_owned())
        })
        .unwrap_or_else(|| panic!("no connection named {name:?} in:\n{text}"))
}

/// Has the broker close a connection, as an operator would.
async fn close_connection(pid: &str) {
    let closed = tokio::process::Command::new("rabbitmqctl")
        .args([
            "close_connection",
            pid,
            "test: closing the consumer's connection mid-work",
        ])
        .output()
        .await
        .expect("rabbitmqctl runs");
    assert!(
        closed.status.success(),
        "rabbitmqctl close_connection: {closed:?}"
    );
}

/// Graceful shutdown mid-stream: in-flight deliveries finish and are acked,
/// the rest stays in the queue; a second instance processes exactly the rest
/// and sees no duplicate (nothing committed was left unacked).
async fn graceful_shutdown_loses_nothing<S: ParcelStore>(store: S, names: Names) {
    require_rabbitmq().await;
    let _teardown = Teardown::new(&store, &names);
    let first = start(
        &store,
        &names,
        Faults::with_work_delay(Duration::from_millis(100)),
    )
    .await;
    let plan = Plan::new(60, 0.0, 5, &format!("P{}", names.schema)).expect("plan");
    let topology = Topology::new(&names.prefix);
    publish(AMQP_URL, &topology, &plan.messages, false)
        .await
        .expect("publish");
    let tally = Arc::clone(&first.service.tally);
    eventually("some work done", Duration::from_secs(20), async || {
        Role::PARCEL_CREATED
            .iter()
            .all(|r| tally.consumer(r.consumer_name()).processed() >= 4)
    })
    .await;
    first.service.shutdown();
    tokio::time::timeout(Duration::from_secs(20), first.service.join())
        .await
        .expect("shutdown finishes in-flight work promptly")
        .expect("clean shutdown");
    let done_first: Vec<u64> = Role::PARCEL_CREATED
        .iter()
        .map(|r| tally.consumer(r.consumer_name()).processed())
        .collect();
    assert!(
        done_first.iter().all(|n| *n < 60),
        "shut down mid-stream: {done_first:?}"
    );
    let stats = store.stats().await.expect("stats");
    assert_eq!(stats.notifications.rows, done_first[0]);
    assert_eq!(stats.carrier_assignments.rows, done_first[1]);

    let second = start(&store, &names, Faults::default()).await;
    let tally2 = Arc::clone(&second.service.tally);
    eventually("the rest processed", Duration::from_secs(30), async || {
        Role::PARCEL_CREATED
            .iter()
            .zip(&done_first)
            .all(|(r, before)| tally2.consumer(r.consumer_name()).processed() + before >= 60)
    })
    .await;
    second.service.shutdown();
    second.service.join().await.expect("clean shutdown");
    for role in Role::PARCEL_CREATED {
        assert_eq!(
            tally2.consumer(role.consumer_name()).duplicates(),
            0,
            "{role:?}: every committed delivery was acked before shutdown"
        );
    }
    let stats = store.stats().await.expect("stats");
    assert_exactly_once(&stats, 60);
    cleanup(&store, &names).await;
}

/// The main-job command: `parcel-inbox demo` exits 0 with every check ok,
/// and no password from the URLs it was given appears in its output.
async fn demo_command_proves_exactly_once(store: &str) {
    require_rabbitmq().await;
    let (stdout, _) = run_demo(&["--store", store, "--amqp-url", AMQP_URL, "demo"]).await;
    assert!(
        stdout.contains("duplicates discarded 30 = copies sent 30"),
        "{stdout}"
    );
}

/// The same demo on NATS JetStream (`demo --broker nats`): every check ok,
/// each copy discarded by the inbox or dropped by JetStream's duplicate
/// window (which of the two depends on the window, so only their sum is
/// fixed).
async fn demo_on_nats_proves_exactly_once(store: &str) {
    require_nats().await;
    let (stdout, _) = run_demo(&[
        "--store",
        store,
        "demo",
        "--broker",
        "nats",
        "--nats-url",
        NATS_URL,
    ])
    .await;
    assert!(stdout.contains(", NATS JetStream) =="), "{stdout}");
    let copies: Vec<&str> = stdout
        .lines()
        .filter(|line| line.contains("[ok]") && line.contains(" = copies sent 30"))
        .collect();
    assert_eq!(copies.len(), 3, "one line per consumer:\n{stdout}");
    assert!(
        copies
            .iter()
            .all(|line| line.contains("dropped by the broker as duplicates")),
        "{stdout}"
    );
    assert!(
        stdout.contains("queues and dead-letter queues empty (0 messages left)"),
        "{stdout}"
    );
}

/// Runs `parcel-inbox {args} --events 60 --duplicate-rate 0.5` and checks
/// what every run must show: exit 0, every check ok, 60 bookings, and no
/// password in the output. Returns (stdout, stderr).
async fn run_demo(args: &[&str]) -> (String, String) {
    // Trust auth ignores the password; it is there to be kept out of logs.
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:pg-s3cret@127.0.0.1:5432/test".to_owned());
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
        .args(args)
        .args(["--events", "60", "--duplicate-rate", "0.5"])
        // From the environment: the memory store would refuse the flag.
        .env("DATABASE_URL", &database_url)
        .env(
            "RUST_LOG",
            "debug,lapin=info,sqlx=info,tokio_postgres=info,async_nats=info",
        )
        .output()
        .await
        .expect("run parcel-inbox demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("RESULT: exactly-once effects held"),
        "{stdout}"
    );
    assert!(!stdout.contains("FAIL"), "{stdout}");
    assert!(
        stdout.contains("carrier bookings 60 = distinct parcels 60"),
        "{stdout}"
    );
    for secret in ["guest:guest", "pg-s3cret"] {
        assert!(!stderr.contains(secret), "{secret} leaked into the logs");
        assert!(!stdout.contains(secret), "{secret} leaked into the output");
    }
    (stdout.into_owned(), stderr.into_owned())
}

// ------------------------------------------------------------ the backends

/// One named `#[tokio::test]` per scenario for a backend: `$store` is an
/// async fn from the test's [`Names`] to a migrated store, `$kind` the
/// `--store` name; `postgres` adds the scenarios only a database that
/// outlives the process can run.
macro_rules! e2e_tests {
    ($store:path, $kind:literal) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn duplicates_are_discarded_per_consumer() {
            let names = names(concat!("dup-", $kind));
            super::duplicates_are_discarded_per_consumer($store(&names).await, names).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn bad_input_is_dead_lettered_with_reason() {
            let names = names(concat!("bad-", $kind));
            super::bad_input_is_dead_lettered_with_reason($store(&names).await, names).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn retryable_failures_are_capped() {
            let names = names(concat!("cap-", $kind));
            super::retryable_failures_are_capped($store(&names).await, names).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn poison_on_a_classic_queue_is_capped_by_the_ledger_and_replayed_once() {
            let names = names(concat!("classic-", $kind));
            super::poison_on_a_classic_queue_is_capped_by_the_ledger_and_replayed_once(
                $store(&names).await,
                names,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn demo_command_proves_exactly_once() {
            super::demo_command_proves_exactly_once($kind).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn demo_on_nats_proves_exactly_once() {
            super::demo_on_nats_proves_exactly_once($kind).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn closed_connection_redelivers_exactly_once() {
            let names = names(concat!("close-", $kind));
            super::closed_connection_redelivers_exactly_once($store(&names).await, names).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn waiting_acks_lost_with_the_connection_come_back_as_duplicates() {
            let names = names(concat!("acks-", $kind));
            super::waiting_acks_lost_with_the_connection_come_back_as_duplicates(
                $store(&names).await,
                names,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn graceful_shutdown_loses_nothing() {
            let names = names(concat!("stop-", $kind));
            super::graceful_shutdown_loses_nothing($store(&names).await, names).await;
        }
    };
    ($store:path, $kind:literal, postgres) => {
        e2e_tests!($store, $kind);

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn database_connections_killed_mid_work() {
            let names = names(concat!("pgkill-", $kind));
            let application_name = names.schema.clone();
            super::database_connections_killed_mid_work(
                $store(&names).await,
                names,
                &application_name,
            )
            .await;
        }
    };
}

#[cfg(feature = "sqlx")]
mod sqlx_store {
    use super::*;
    use inbox_backend_sqlx::SqlxStore;

    async fn store(names: &Names) -> SqlxStore {
        let url = with_application_name(&database_url(), &names.schema);
        let store = SqlxStore::connect(&url, &names.schema)
            .await
            .unwrap_or_else(|e| unreachable_postgres(&e));
        store.migrate_all().await.expect("migrate");
        store
    }

    e2e_tests!(store, "sqlx", postgres);
}

#[cfg(feature = "diesel")]
mod diesel_store {
    use super::*;
    use inbox_backend_diesel::DieselStore;

    async fn store(names: &Names) -> DieselStore {
        let url = with_application_name(&database_url(), &names.schema);
        let store = DieselStore::connect(&url, &names.schema, 8)
            .await
            .unwrap_or_else(|e| unreachable_postgres(&e));
        store.migrate_all().await.expect("migrate");
        store
    }

    e2e_tests!(store, "diesel", postgres);
}

#[cfg(feature = "memory")]
mod memory_store {
    use super::*;
    use inbox_backend_memory::MemoryStore;

    async fn store(_names: &Names) -> MemoryStore {
        MemoryStore::new()
    }

    e2e_tests!(store, "memory");
}
