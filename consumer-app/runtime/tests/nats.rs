//! NATS JetStream end to end, against the real server (127.0.0.1:4222,
//! `bash .ci/services.sh`), with the in-process store: a service started
//! exactly as a user starts one, on a `nats://` URL. Each test has its own
//! exchange and queue (a uuid suffix) and deletes its streams at the end.
//! Without a server the tests skip, except under `CI=true`, where an
//! unreachable server fails them.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use inbox_runtime::WorkerConfig;
use inbox_runtime::async_nats;
use inbox_runtime::async_nats::HeaderMap;
use inbox_runtime::async_nats::jetstream::{self, consumer::pull, stream};
use inbox_runtime::inbox_api::InboxError;
use inbox_runtime::nats::{names, publish_confirmed};
use inbox_runtime::prelude::*;
use private_servers::PrivateNats;
use serde::{Deserialize, Serialize};

const NATS_URL: &str = "nats://127.0.0.1:4222";

/// An order of one test (`test`), number `n`, whose handler fails
/// transiently its first `fail` attempts and takes `slow_ms` each.
#[derive(Clone, Serialize, Deserialize)]
struct Order {
    test: String,
    n: u64,
    #[serde(default)]
    fail: u64,
    #[serde(default)]
    slow_ms: u64,
    /// Attempts that fail as if the store were away.
    #[serde(default)]
    outage: u64,
}
impl Event for Order {
    const TYPE: &'static str = "order.placed";
}

/// Handler attempts, by (test, order number).
static CALLS: LazyLock<Mutex<HashMap<(String, u64), u64>>> = LazyLock::new(Mutex::default);

fn bump(order: &Order) -> u64 {
    let mut calls = CALLS.lock().unwrap_or_else(|e| e.into_inner());
    let count = calls.entry((order.test.clone(), order.n)).or_default();
    *count += 1;
    *count
}

/// Every attempt of `test`'s handler, and how many orders it saw.
fn calls(test: &str) -> (u64, usize) {
    let calls = CALLS.lock().unwrap_or_else(|e| e.into_inner());
    let mine: Vec<u64> = calls
        .iter()
        .filter(|((t, _), _)| t == test)
        .map(|(_, n)| *n)
        .collect();
    (mine.iter().sum(), mine.len())
}

async fn handle(mut cx: Context<'_, MemoryTransaction>, order: Order) -> Result<(), AppError> {
    let attempt = bump(&order);
    if order.slow_ms > 0 {
        tokio::time::sleep(Duration::from_millis(order.slow_ms)).await;
    }
    if attempt <= order.outage {
        return Err(AppError::Inbox(InboxError::Connection {
            source: "the store is away (simulated)".into(),
        }));
    }
    if attempt <= order.fail {
        return Err(AppError::transient(format!("attempt {attempt} fails")));
    }
    cx.put(format!("orders/{}/{}", order.test, order.n), "done");
    Ok(())
}

/// One test's names and connection.
struct Setup {
    url: String,
    test: String,
    exchange: String,
    queue: String,
    js: jetstream::Context,
}

impl Setup {
    /// A fresh exchange (with a `.`, to exercise the mapping) and queue;
    /// `None` (skipped) when NATS is unreachable outside CI.
    async fn new(what: &str) -> Option<Self> {
        Self::on(what, NATS_URL).await
    }

    /// The same on the server at `url`.
    async fn on(what: &str, url: &str) -> Option<Self> {
        let id = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
        let client = match async_nats::connect(url).await {
            Ok(client) => client,
            Err(error) if std::env::var("CI").as_deref() == Ok("true") => {
                panic!("NATS unreachable at {NATS_URL} under CI: {error}")
            }
            Err(error) => {
                eprintln!(
                    "skipped: NATS unreachable at {NATS_URL} ({error}); bash .ci/services.sh"
                );
                return None;
            }
        };
        Some(Self {
            url: url.to_owned(),
            test: format!("{what}-{id}"),
            exchange: format!("test-{what}-{id}.shop"),
            queue: format!("test-{what}-{id}.payments"),
            js: jetstream::new(client),
        })
    }

    fn topology(&self) -> Topology {
        Topology::new(&self.exchange).bind(&self.queue, "order.*")
    }

    /// A service consuming the queue with `config`'s worker settings.
    async fn start(&self, tweak: impl FnOnce(&mut WorkerConfig)) -> ServiceHandle {
        let mut config = ServiceConfig::new(&self.url, format!("nats test {}", self.test));
        config.worker.retry_base_delay = Duration::from_millis(10);
        tweak(&mut config.worker);
        let service = Service::new(MemoryStore::new(), config, self.topology())
            .consume(
                &self.queue,
                handler_fn("payments", handle).expect("valid consumer name"),
            )
            .spawn()
            .expect("the service starts");
        service
            .wait_ready(Duration::from_secs(30))
            .await
            .expect("consuming on NATS");
        service
    }

    fn order(&self, n: u64, fail: u64, slow_ms: u64) -> Vec<u8> {
        serde_json::to_vec(&Order {
            test: self.test.clone(),
            n,
            fail,
            slow_ms,
            outage: 0,
        })
        .expect("json")
    }

    /// Publishes `body` under `id` as an `order.placed` to `order.placed`.
    async fn publish(&self, id: &str, body: Vec<u8>) -> inbox_runtime::nats::Published {
        publish_confirmed(
            &self.js,
            &names::subject(&self.exchange, "order.placed"),
            id,
            Some(Order::TYPE),
            HeaderMap::new(),
            body,
        )
        .await
        .expect("stored by JetStream")
    }

    /// The queue's consumer: (pending, ack pending).
    async fn consumer_counts(&self) -> (u64, usize) {
        let stream = self
            .js
            .get_stream(names::stream_name(&self.exchange))
            .await
            .expect("the work stream");
        let mut consumer: jetstream::consumer::Consumer<pull::Config> = stream
            .get_consumer(&names::consumer_name(&self.queue))
            .await
            .expect("the queue's consumer");
        let info = consumer.info().await.expect("consumer info");
        (info.num_pending, info.num_ack_pending)
    }

    /// Messages still stored in the work stream.
    async fn stored(&self) -> u64 {
        let mut stream = self
            .js
            .get_stream(names::stream_name(&self.exchange))
            .await
            .expect("the work stream");
        stream.info().await.expect("stream info").state.messages
    }

    /// Waits until nothing is pending or unacked on the queue and the
    /// interest stream holds nothing.
    async fn wait_drained(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let counts = self.consumer_counts().await;
            let stored = self.stored().await;
            if counts == (0, 0) && stored == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "drained within 30 s: (pending, ack pending) {counts:?}, stored {stored}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The dead letters of the queue, as header maps, in order.
    async fn dead_letters(&self) -> Vec<(HeaderMap, Vec<u8>)> {
        let mut stream = self
            .js
            .get_stream(names::dead_letter_stream(&self.exchange))
            .await
            .expect("the dead-letter stream");
        let state = stream.info().await.expect("info").state.clone();
        let mut letters = Vec::new();
        if state.messages == 0 {
            return letters;
        }
        for sequence in state.first_sequence..=state.last_sequence {
            let message = stream
                .get_raw_message(sequence)
                .await
                .expect("a dead letter");
            assert_eq!(
                message.subject.as_str(),
                names::dead_letter_subject(&self.exchange, &self.queue)
            );
            letters.push((message.headers, message.payload.to_vec()));
        }
        letters
    }

    async fn delete(self) {
        for stream in [
            names::stream_name(&self.exchange),
            names::dead_letter_stream(&self.exchange),
        ] {
            self.js.delete_stream(&stream).await.expect("delete stream");
        }
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).map(|value| value.as_str())
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "{what} within 30 s");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn fresh_id() -> String {
    MessageId::new_v7().to_string()
}

/// (a) Every message published with its `Nats-Msg-Id` is processed once
/// and acked (nothing pending, nothing left in the interest stream); a
/// re-publish within the duplicate window is dropped by JetStream itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_message_is_processed_once_and_acked() {
    let Some(setup) = Setup::new("once").await else {
        return;
    };
    let service = setup.start(|_| {}).await;
    let ids: Vec<String> = (0..20).map(|_| fresh_id()).collect();
    for (n, id) in ids.iter().enumerate() {
        let published = setup.publish(id, setup.order(n as u64, 0, 0)).await;
        assert!(!published.duplicate);
    }
    let again = setup.publish(&ids[0], setup.order(0, 0, 0)).await;
    assert!(
        again.duplicate,
        "a re-publish within the window is a duplicate"
    );

    let tally = service.tally.consumer("payments");
    wait_for("20 processed", || tally.processed() == 20).await;
    setup.wait_drained().await;
    assert_eq!(calls(&setup.test), (20, 20), "one attempt per order");
    assert_eq!(
        (
            tally.duplicates(),
            tally.requeued(),
            tally.dead_lettered_total()
        ),
        (0, 0, 0)
    );
    service.shutdown();
    service.join().await.expect("clean shutdown");
    setup.delete().await;
}

/// (b) The same id stored again after the duplicate window (shortened to
/// 1 s for the test) reaches the consumer, whose inbox answers
/// `Duplicate`: acked, counted, never handled twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_after_the_duplicate_window_is_an_inbox_duplicate() {
    let Some(setup) = Setup::new("dup").await else {
        return;
    };
    let service = setup.start(|_| {}).await;
    let mut stream = setup
        .js
        .get_stream(names::stream_name(&setup.exchange))
        .await
        .expect("the work stream");
    let config = stream::Config {
        duplicate_window: Duration::from_secs(1),
        ..stream.info().await.expect("info").config.clone()
    };
    setup
        .js
        .update_stream(config)
        .await
        .expect("shorter window");

    let id = fresh_id();
    setup.publish(&id, setup.order(1, 0, 0)).await;
    let tally = service.tally.consumer("payments");
    wait_for("the first copy processed", || tally.processed() == 1).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = setup.publish(&id, setup.order(1, 0, 0)).await;
    assert!(!second.duplicate, "stored again after the window");
    wait_for("the copy answered Duplicate", || tally.duplicates() == 1).await;
    setup.wait_drained().await;
    assert_eq!(tally.processed(), 1);
    assert_eq!(calls(&setup.test), (1, 1), "the handler ran once");
    service.shutdown();
    service.join().await.expect("clean shutdown");
    setup.delete().await;
}

/// (c) A handler failing transiently is redelivered by JetStream (one
/// in-process attempt per delivery here) and then succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_failure_is_redelivered_then_succeeds() {
    let Some(setup) = Setup::new("retry").await else {
        return;
    };
    let service = setup
        .start(|worker| {
            worker.retry_attempts = 1;
            worker.max_deliveries = 5;
        })
        .await;
    setup.publish(&fresh_id(), setup.order(1, 2, 0)).await;
    let tally = service.tally.consumer("payments");
    wait_for("processed after two failures", || tally.processed() == 1).await;
    setup.wait_drained().await;
    assert_eq!(
        calls(&setup.test),
        (3, 1),
        "two failed attempts, one success"
    );
    assert_eq!(tally.requeued(), 2, "each failure went back to JetStream");
    assert_eq!(tally.redelivered_processed(), 1);
    assert_eq!(tally.dead_lettered_total(), 0);
    service.shutdown();
    service.join().await.expect("clean shutdown");
    setup.delete().await;
}

/// (d) A message that always fails is dead-lettered after
/// `max_deliveries`, and bad input (a body that is not an order, no
/// message id) at once: each on `dlq.{exchange}.{queue}` with its reason,
/// the original terminated (nothing pending, nothing stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_and_bad_input_are_dead_lettered_with_their_reason() {
    let Some(setup) = Setup::new("dead").await else {
        return;
    };
    let service = setup
        .start(|worker| {
            worker.retry_attempts = 1;
            worker.max_deliveries = 2;
        })
        .await;
    let poison = fresh_id();
    setup.publish(&poison, setup.order(1, u64::MAX, 0)).await;
    let not_json = fresh_id();
    setup.publish(&not_json, b"not json".to_vec()).await;
    // No Nats-Msg-Id at all.
    let mut headers = HeaderMap::new();
    headers.insert(names::MESSAGE_TYPE, Order::TYPE);
    setup
        .js
        .publish_with_headers(
            names::subject(&setup.exchange, "order.placed"),
            headers,
            setup.order(3, 0, 0).into(),
        )
        .await
        .expect("sent")
        .await
        .expect("stored");

    let tally = service.tally.consumer("payments");
    wait_for("three dead letters", || tally.dead_lettered_total() == 3).await;
    setup.wait_drained().await;
    let reasons: Vec<(String, u64)> = tally.dead_lettered().into_iter().collect();
    assert_eq!(
        reasons,
        [
            ("invalid_json".to_owned(), 1),
            ("missing_message_id".to_owned(), 1),
            ("retries_exhausted".to_owned(), 1)
        ]
    );
    assert_eq!(
        calls(&setup.test),
        (2, 1),
        "the poison ran max_deliveries times"
    );
    assert_eq!(tally.processed(), 0);

    let letters = setup.dead_letters().await;
    assert_eq!(letters.len(), 3, "one letter each");
    let by_reason: HashMap<&str, &HeaderMap> = letters
        .iter()
        .map(|(headers, _)| {
            (
                header(headers, "x-dead-letter-reason").expect("a reason"),
                headers,
            )
        })
        .collect();
    let exhausted = by_reason["retries_exhausted"];
    assert_eq!(
        header(exhausted, names::ORIGINAL_MESSAGE_ID),
        Some(poison.as_str())
    );
    assert_eq!(header(exhausted, "x-inbox-attempts"), Some("2"));
    assert_eq!(
        header(exhausted, "x-dead-letter-queue"),
        Some(setup.queue.as_str())
    );
    assert_eq!(
        header(exhausted, "x-dead-letter-consumer"),
        Some("payments")
    );
    assert_eq!(header(exhausted, names::MESSAGE_TYPE), Some(Order::TYPE));
    assert!(
        header(exhausted, "x-inbox-last-error").is_some_and(|e| e.contains("fails")),
        "{exhausted:?}"
    );
    assert_ne!(header(exhausted, names::NATS_MSG_ID), Some(poison.as_str()));
    let bad = by_reason["invalid_json"];
    assert_eq!(
        header(bad, names::ORIGINAL_MESSAGE_ID),
        Some(not_json.as_str())
    );
    assert!(letters.iter().any(|(_, body)| body == b"not json"));
    let missing = by_reason["missing_message_id"];
    assert_eq!(header(missing, names::ORIGINAL_MESSAGE_ID), None);
    assert_eq!(
        header(missing, names::DEAD_LETTER_SUBJECT),
        Some(names::subject(&setup.exchange, "order.placed").as_str())
    );

    service.shutdown();
    service.join().await.expect("clean shutdown");
    setup.delete().await;
}

/// (e) A shutdown while deliveries are being handled lets them finish and
/// acks them before the connection closes: nothing comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_shutdown_acks_what_was_in_flight() {
    let Some(setup) = Setup::new("stop").await else {
        return;
    };
    let service = setup.start(|worker| worker.concurrency = 4).await;
    for n in 0..4 {
        setup.publish(&fresh_id(), setup.order(n, 0, 1500)).await;
    }
    wait_for("four handlers running", || calls(&setup.test).1 == 4).await;
    let tally = service.tally.consumer("payments");
    assert_eq!(tally.processed(), 0, "still in flight at the shutdown");
    service.shutdown();
    let tally = std::sync::Arc::clone(&service.tally);
    service.join().await.expect("clean shutdown");
    assert_eq!(tally.consumer("payments").processed(), 4);
    // Acked before the close: nothing pending, nothing to redeliver.
    setup.wait_drained().await;
    assert_eq!(calls(&setup.test), (4, 4));
    setup.delete().await;
}

/// A refused login at start-up ends the service with
/// `CredentialsRefused`, the password hidden; the right one consumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_login_ends_the_service_as_credentials_refused() {
    let server = PrivateNats::start_with_login("app", "right-secret").await;
    let url = |password: &str| format!("nats://app:{password}@127.0.0.1:{}", server.port());
    let service = |url: String| {
        Service::new(
            MemoryStore::new(),
            ServiceConfig::new(url, "refused test"),
            Topology::new("refused.shop").bind("refused.q", "order.*"),
        )
        .consume(
            "refused.q",
            handler_fn("payments", handle).expect("valid consumer name"),
        )
        .spawn()
        .expect("the service starts")
    };
    let refused = service(url("wrong-secret"));
    let error = tokio::time::timeout(Duration::from_secs(30), refused.join())
        .await
        .expect("ends at the refusal")
        .expect_err("refused");
    assert!(
        matches!(error, AppError::CredentialsRefused { .. }),
        "{error:?}"
    );
    assert!(
        !format!("{error} {error:?}").contains("wrong-secret"),
        "{error:?}"
    );

    let accepted = service(url("right-secret"));
    accepted
        .wait_ready(Duration::from_secs(30))
        .await
        .expect("the right password consumes");
    accepted.shutdown();
    accepted.join().await.expect("clean shutdown");
}

/// A server restart (killed, down past two missed idle heartbeats, back on
/// its store) is ridden out by the same consuming loop: the pull errors
/// in between are skipped, not an end of the subscription, and messages
/// published after the restart are processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consuming_loop_rides_out_a_server_restart() {
    let mut server = PrivateNats::start().await;
    let setup = Setup::on("restart", &server.url())
        .await
        .expect("the private server is up");
    let service = setup.start(|_| {}).await;
    for n in 0..3 {
        setup.publish(&fresh_id(), setup.order(n, 0, 0)).await;
    }
    let tally = service.tally.consumer("payments");
    wait_for("3 processed before the restart", || tally.processed() == 3).await;

    server.stop();
    tokio::time::sleep(Duration::from_secs(12)).await;
    let readiness = service.broker_readiness();
    let during = readiness.status();
    assert!(
        during.as_ref().is_err_and(|why| why.contains("lost")),
        "readiness while the server is away: {during:?}"
    );
    server.resume().await;

    let deadline = Instant::now() + Duration::from_secs(30);
    for n in 3..6 {
        let subject = names::subject(&setup.exchange, "order.placed");
        let id = fresh_id();
        // The test's own client reconnects too: retry until it has.
        loop {
            match publish_confirmed(
                &setup.js,
                &subject,
                &id,
                Some(Order::TYPE),
                HeaderMap::new(),
                setup.order(n, 0, 0),
            )
            .await
            {
                Ok(_) => break,
                Err(error) => {
                    assert!(
                        Instant::now() < deadline,
                        "publish after the restart: {error}"
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
    wait_for("3 more processed after the restart", || {
        tally.processed() == 6
    })
    .await;
    setup.wait_drained().await;
    assert_eq!(
        service.sessions(),
        1,
        "the first session's loop never ended"
    );
    assert_eq!(readiness.status(), Ok(()), "ready again after the restart");
    assert_eq!(calls(&setup.test), (6, 6));
    service.shutdown();
    service.join().await.expect("clean shutdown");
    setup.delete().await;
}

/// A store outage (every attempt failing as "store away") opens the store
/// circuit: the subscription pauses, hands back what it holds (a `nak`,
/// uncharged), resumes once the store answers, and every order is then
/// processed once, none dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_pauses_and_resumes_the_subscription() {
    let Some(setup) = Setup::new("outage").await else {
        return;
    };
    let service = setup.start(|_| {}).await;
    let mut availability = service.store_availability();
    let paused = tokio::spawn(async move { availability.wait_for(|up| !*up).await.is_ok() });
    for n in 0..6 {
        let body = serde_json::to_vec(&Order {
            test: setup.test.clone(),
            n,
            fail: 0,
            slow_ms: 0,
            outage: 1,
        })
        .expect("json");
        setup.publish(&fresh_id(), body).await;
    }
    let tally = service.tally.consumer("payments");
    wait_for("6 processed after the outage", || tally.processed() == 6).await;
    setup.wait_drained().await;
    assert!(
        tokio::time::timeout(Duration::from_secs(1), paused)
            .await
            .is_ok_and(|seen| seen.is_ok_and(|paused| paused)),
        "the store circuit opened"
    );
    assert!(tally.released() >= 6, "released {}", tally.released());
    assert_eq!(tally.dead_lettered_total(), 0);
    assert_eq!(
        calls(&setup.test),
        (12, 6),
        "one failed and one good attempt each"
    );
    service.shutdown();
    service.join().await.expect("clean shutdown");
    setup.delete().await;
}

/// `tls://` with the URL's TLS files (a CA and a client certificate, the
/// query parameters of an `amqps://` URL) against a TLS-only server that
/// verifies client certificates; the same files on a `nats://` URL are a
/// configuration error that ends the service at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_urls_take_the_ca_and_client_certificate_from_the_query() {
    let dir = std::env::temp_dir().join(format!(
        "nats-tls-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    ));
    let pki = private_servers::pki::Pki::new(&dir);
    let server = PrivateNats::start_tls(&pki).await;
    let (cert, key) = pki.client("app");
    let query = format!(
        "?cacertfile={}&certfile={}&keyfile={}",
        pki.ca.display(),
        cert.display(),
        key.display()
    );
    let service = |url: String| {
        Service::new(
            MemoryStore::new(),
            ServiceConfig::new(url, "tls test"),
            Topology::new("tls.shop").bind("tls.q", "order.*"),
        )
        .consume(
            "tls.q",
            handler_fn("payments", handle).expect("valid consumer name"),
        )
        .spawn()
        .expect("the service starts")
    };
    let plain = service(format!("nats://127.0.0.1:{}{query}", server.port()));
    let error = tokio::time::timeout(Duration::from_secs(30), plain.join())
        .await
        .expect("ends at once")
        .expect_err("a configuration error");
    assert!(matches!(error, AppError::Config(_)), "{error:?}");

    // Without a client certificate the server refuses the handshake: the
    // service keeps retrying, never consuming.
    let anonymous = service(format!("{}?cacertfile={}", server.url(), pki.ca.display()));
    assert!(
        anonymous.wait_ready(Duration::from_secs(3)).await.is_err(),
        "consuming without a client certificate"
    );
    assert!(
        anonymous.broker_readiness().status().is_err(),
        "not ready, with a reason"
    );
    anonymous.shutdown();
    anonymous.join().await.expect("stops while retrying");

    let tls = service(format!("{}{query}", server.url()));
    tls.wait_ready(Duration::from_secs(30))
        .await
        .expect("consuming over TLS with a client certificate");
    tls.shutdown();
    tls.join().await.expect("clean shutdown");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Batched mode on JetStream: many deliveries per transaction, each acked
/// once its batch committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_mode_processes_and_acks_every_message() {
    let Some(setup) = Setup::new("batch").await else {
        return;
    };
    let service = setup
        .start(|worker| {
            worker.batch = inbox_runtime::BatchConfig::effective(
                8,
                Duration::from_millis(50),
                worker.prefetch,
            );
            worker.concurrency = 2;
        })
        .await;
    for n in 0..40 {
        setup.publish(&fresh_id(), setup.order(n, 0, 0)).await;
    }
    let tally = service.tally.consumer("payments");
    wait_for("40 processed", || tally.processed() == 40).await;
    setup.wait_drained().await;
    assert!(
        tally.batches() >= 5 && tally.batches() < 40,
        "batches {}",
        tally.batches()
    );
    assert_eq!(calls(&setup.test), (40, 40));
    service.shutdown();
    service.join().await.expect("clean shutdown");
    setup.delete().await;
}

/// `publish_confirmed` tells a refusal (no stream takes the subject: the
/// message's own fault, like an unroutable AMQP message) from a stored
/// message, and a re-publish of an id within the window is a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_confirmed_tells_refusals_and_duplicates() {
    let Some(setup) = Setup::new("publish").await else {
        return;
    };
    let refused = publish_confirmed(
        &setup.js,
        &format!("nobody-{}.order.placed", setup.test),
        &fresh_id(),
        Some(Order::TYPE),
        HeaderMap::new(),
        b"{}".to_vec(),
    )
    .await
    .expect_err("no stream takes it");
    assert!(refused.is_refusal(), "{refused:?}");
    assert_eq!(refused.reason(), "refused");

    // A stream of the test's own (no consumer needed: limits retention).
    let stream = names::stream_name(&setup.exchange);
    setup
        .js
        .create_stream(stream::Config {
            name: stream.clone(),
            subjects: vec![names::stream_subjects(&setup.exchange)],
            ..stream::Config::default()
        })
        .await
        .expect("a stream");
    let subject = names::subject(&setup.exchange, "order.placed");
    let id = fresh_id();
    let publish = || {
        publish_confirmed(
            &setup.js,
            &subject,
            &id,
            Some(Order::TYPE),
            HeaderMap::new(),
            b"{}".to_vec(),
        )
    };
    let first = publish().await.expect("stored");
    let second = publish().await.expect("acknowledged");
    assert_eq!(
        (first.duplicate, second.duplicate, second.sequence),
        (false, true, first.sequence)
    );
    assert_eq!(first.stream, stream);
    let stored = setup
        .js
        .get_stream(&stream)
        .await
        .expect("the stream")
        .get_raw_message(first.sequence)
        .await
        .expect("the message");
    assert_eq!(
        header(&stored.headers, names::NATS_MSG_ID),
        Some(id.as_str())
    );
    assert_eq!(
        header(&stored.headers, names::MESSAGE_TYPE),
        Some(Order::TYPE)
    );
    setup.js.delete_stream(&stream).await.expect("delete");
}
