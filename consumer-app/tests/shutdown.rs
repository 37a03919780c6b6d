//! A graceful shutdown does not wait out a delivery's backoff: SIGTERM in
//! the middle of a long retry delay or requeue pause stops the service
//! promptly, and the delivery goes back to the broker, not lost. Needs
//! RabbitMQ (127.0.0.1:5672); the store is the in-process one.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use inbox_api::{ConsumerName, MessageId};
use inbox_backend_memory::MemoryStore;
use inbox_runtime::amqp::{Outgoing, Publisher, connect};
use inbox_runtime::{AppError, Context, Handler, Service, ServiceConfig, Topology, WorkerConfig};

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Fails every attempt with a retryable error, counting the attempts.
struct AlwaysFails {
    name: ConsumerName,
    attempts: Arc<AtomicU32>,
}

impl<Tx: Send> Handler<Tx> for AlwaysFails {
    type Message = serde_json::Value;
    type Intent = ();

    fn name(&self) -> &ConsumerName {
        &self.name
    }

    fn message_type(&self) -> &str {
        "test.event"
    }

    async fn handle(
        &self,
        _cx: &mut Context<'_, Tx>,
        _message: &Self::Message,
    ) -> Result<(), AppError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        Err(AppError::Downstream {
            retryable: true,
            message: "always down".into(),
        })
    }
}

/// Starts a service whose one handler always fails, with backoffs far
/// longer than the test's bound and `retry_attempts` in-process attempts,
/// publishes one message, waits for the first attempt (after it the worker
/// sits in a retry delay, or with one attempt in a requeue pause), shuts
/// down and checks the service stopped within `bound`, with no second
/// attempt, and the message is back in its queue.
async fn shutdown_during_backoff(test: &str, retry_attempts: u32, bound: Duration) {
    let id = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    let exchange = format!("test-{test}-{id}.events");
    let queue = format!("test-{test}-{id}.work");
    let topology = Topology::new(&exchange).bind(&queue, "test.event");
    // The queues go when the test ends, passed or failed.
    let _remove = topology.remove_on_drop(AMQP_URL);
    let attempts = Arc::new(AtomicU32::new(0));
    let config = ServiceConfig {
        worker: WorkerConfig {
            retry_attempts,
            // Capped by the policy: 5 s per retry, 30 s per requeue pause.
            retry_base_delay: Duration::from_secs(60),
            ..WorkerConfig::default()
        },
        cleanup: None,
        ..ServiceConfig::new(AMQP_URL, format!("shutdown test {test} {id}"))
    };
    let service = Service::new(MemoryStore::new(), config, topology.clone())
        .consume(
            &queue,
            AlwaysFails {
                name: ConsumerName::new("always-fails").expect("valid name"),
                attempts: Arc::clone(&attempts),
            },
        )
        .spawn()
        .expect("service starts");
    service
        .wait_consuming(1, Duration::from_secs(20))
        .await
        .expect("consuming (RabbitMQ reachable? bash .ci/services.sh)");

    let connection = connect(AMQP_URL, "shutdown test publisher")
        .await
        .expect("connect");
    let publisher = Publisher::new(&connection, &exchange, "test.event")
        .await
        .expect("publisher");
    let message = Outgoing::json(&MessageId::new_v7(), "test.event", &serde_json::json!({}))
        .expect("message");
    publisher.publish(&message).await.expect("confirmed");

    let deadline = Instant::now() + Duration::from_secs(20);
    while attempts.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the handler never ran");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Well inside the backoff that follows the attempt.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let asked = Instant::now();
    service.shutdown();
    let joined = tokio::time::timeout(Duration::from_secs(60), service.join()).await;
    let took = asked.elapsed();
    joined
        .expect("the service ends at all")
        .expect("clean shutdown");
    assert!(
        took < bound,
        "shutdown took {took:?} (bound {bound:?}): it waited out the backoff"
    );
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        1,
        "no attempt after shutdown"
    );

    // The broker requeues what the closed channel held a moment after the
    // close; poll for it.
    let channel = connection.create_channel().await.expect("channel");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ready = Topology::ready_messages(&channel, &queue)
            .await
            .expect("queue depth");
        if ready == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the delivery is not back in its queue ({ready} ready)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    inbox_runtime::amqp::close_bounded(&connection, "bye").await;
}

/// Between in-process attempts (a 5 s retry delay here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_during_a_retry_delay_hands_the_delivery_back_at_once() {
    shutdown_during_backoff("retry", 2, Duration::from_secs(3)).await;
}

/// After the in-process attempts ran out (a 30 s requeue pause here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_during_a_requeue_pause_requeues_at_once() {
    shutdown_during_backoff("requeue", 1, Duration::from_secs(10)).await;
}
