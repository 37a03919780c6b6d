//! The metric values a dashboard reads, asserted through a debugging
//! recorder while the service runs on the real RabbitMQ (the in-process
//! store): processed, duplicates discarded, failed by stage, requeued,
//! dead-lettered by reason, the inbox row gauge, and purged rows.
//!
//! `metrics` recorders are process-wide and the service records from its
//! own tasks on several threads, so this binary installs a
//! `DebuggingRecorder` globally and holds one scenario: no other test
//! shares its counters. Needs RabbitMQ (`bash .ci/services.sh`).

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use consumer_app::parcel::downstream::{Downstreams, StubCarrier, StubNotifier};
use consumer_app::parcel::events::{EVENT_TYPE, ParcelCreatedEvent, outgoing};
use consumer_app::parcel::role::Role;
use consumer_app::parcel::service::METRIC_NAMES;
use consumer_app::parcel::topology::Topology;
use consumer_app::tools::faults::Faults;
use consumer_app::tools::publish::{Plan, publish};
use inbox_api::metrics as names;
use inbox_api::{ConsumerName, InboxKey, MessageId};
use inbox_backend_memory::MemoryStore;
use inbox_runtime::amqp::Outgoing;
use inbox_runtime::service::cleanup_once;
use inbox_runtime::{CleanupConfig, ServiceConfig, WorkerConfig};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// What the recorder recorded, accumulated: a `Snapshotter` drains its
/// counters and gauges on every snapshot, so the totals are kept here.
struct Recorded {
    snapshotter: Snapshotter,
    series: Mutex<Vec<(metrics::Key, Value)>>,
}

#[derive(Clone, Copy, Debug)]
enum Value {
    Counter(u64),
    Gauge(f64),
}

impl Recorded {
    /// Installs a debugging recorder as the process's recorder.
    fn install() -> Self {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this binary");
        Self {
            snapshotter,
            series: Mutex::default(),
        }
    }

    /// Takes a snapshot and adds it in: counters add up; a gauge keeps its
    /// latest value (a drained gauge that nothing set since reads 0, which
    /// is not taken for a new value).
    fn refresh(&self) {
        let mut series = self.series.lock().expect("lock");
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let value = match value {
                DebugValue::Counter(n) => Value::Counter(n),
                DebugValue::Gauge(g) => Value::Gauge(g.into_inner()),
                DebugValue::Histogram(_) => continue,
            };
            let key = key.key().clone();
            match (series.iter_mut().find(|(k, _)| *k == key), value) {
                (None, value) => series.push((key, value)),
                (Some((_, Value::Counter(total))), Value::Counter(n)) => *total += n,
                (Some((_, Value::Gauge(latest))), Value::Gauge(g)) if g != 0.0 => *latest = g,
                _ => {}
            }
        }
    }

    /// The sum of the counter `name` over the series whose labels include
    /// all of `labels` (0 when none was recorded).
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        let series = self.series.lock().expect("lock");
        series
            .iter()
            .filter(|(key, _)| key.name() == name && has_labels(key, labels))
            .map(|(_, value)| match value {
                Value::Counter(n) => *n,
                Value::Gauge(_) => panic!("{name} is not a counter"),
            })
            .sum()
    }

    /// The latest value of the gauge `name`, if recorded.
    fn gauge(&self, name: &str) -> Option<f64> {
        let series = self.series.lock().expect("lock");
        series
            .iter()
            .find(|(key, _)| key.name() == name)
            .map(|(_, value)| match value {
                Value::Gauge(g) => *g,
                Value::Counter(_) => panic!("{name} is not a gauge"),
            })
    }

    /// Every series and its value, for a failure's message.
    fn dump(&self) -> String {
        let series = self.series.lock().expect("lock");
        let mut lines: Vec<String> = series
            .iter()
            .map(|(key, value)| format!("{key:?} = {value:?}"))
            .collect();
        lines.sort();
        lines.join("\n")
    }

    /// Refreshes every 25 ms until `done` holds, or fails naming `what`
    /// with every metric's value.
    async fn eventually(&self, what: &str, timeout: Duration, mut done: impl FnMut(&Self) -> bool) {
        let deadline = Instant::now() + timeout;
        loop {
            self.refresh();
            if done(self) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {timeout:?} waiting for {what}; metrics:\n{}",
                self.dump()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

fn has_labels(key: &metrics::Key, labels: &[(&str, &str)]) -> bool {
    labels.iter().all(|(name, value)| {
        key.labels()
            .any(|label| label.key() == *name && label.value() == *value)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metric_values_follow_what_the_service_did() {
    let recorded = Recorded::install();
    // The Parcel service's names for the runtime's own counters.
    let runtime_names = METRIC_NAMES;

    let id = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    let prefix = format!("test-metrics-{id}.");
    let topology = Topology::new(&prefix);
    // The queues go when the test ends, passed or failed.
    let _remove = topology.remove_on_drop(AMQP_URL);
    let store = MemoryStore::new();

    // 20 events and 10 copies of them; one more event that always fails in
    // the carrier consumer; two bad messages.
    let plan = Plan::new(20, 0.5, 3, "M").expect("plan");
    let poison = MessageId::new_v7();
    let poison_event = ParcelCreatedEvent {
        parcel_id: "M-poison".into(),
        tracking_number: "TN0000000001".into(),
        destination: "Lyon".into(),
    };
    let carrier = ConsumerName::new(Role::Carrier.consumer_name()).expect("name");
    let faults = Arc::new(Faults::default());
    faults.fail_always(InboxKey::new(poison, carrier));
    let mut messages = plan.messages.clone();
    messages.push(outgoing(&poison, &poison_event).expect("event"));
    messages.push(Outgoing {
        message_id: Some(MessageId::new_v7().to_string()),
        kind: Some(EVENT_TYPE.to_owned()),
        body: b"{not json".to_vec(),
    });
    messages.push(Outgoing {
        message_id: None,
        kind: Some(EVENT_TYPE.to_owned()),
        body: b"{}".to_vec(),
    });

    let downstreams = Downstreams {
        carrier: Arc::new(StubCarrier::default()),
        notifier: Arc::new(StubNotifier::default()),
    };
    let service = faults
        .spawn(
            store.clone(),
            ServiceConfig {
                broker_url: AMQP_URL.to_owned(),
                // One attempt per delivery, two deliveries: the poison
                // message fails twice, is requeued once, then dead-lettered.
                worker: WorkerConfig {
                    retry_attempts: 1,
                    retry_base_delay: Duration::from_millis(5),
                    max_deliveries: 2,
                    ..WorkerConfig::default()
                },
                connection_name: format!("parcel-inbox test metrics {id}"),
                cleanup: None,
                gauge_interval: Some(Duration::from_millis(50)),
                availability: Default::default(),
                connection: Default::default(),
            },
            &topology,
            downstreams,
        )
        .expect("service starts");
    service
        .wait_consuming(1, Duration::from_secs(20))
        .await
        .expect("RabbitMQ reachable (bash .ci/services.sh)");
    publish(AMQP_URL, &topology, &messages, false)
        .await
        .expect("publish");

    let of = |recorded: &Recorded, name: &str, consumer: &str| {
        recorded.counter(name, &[("consumer", consumer)])
    };
    let dead = |recorded: &Recorded, consumer: &str, reason: &str| {
        recorded.counter(
            names::DEAD_LETTERED,
            &[("consumer", consumer), ("reason", reason)],
        )
    };
    let notification = Role::Notification.consumer_name();
    let carrier = Role::Carrier.consumer_name();
    recorded
        .eventually("every message settled", Duration::from_secs(30), |r| {
            [notification, carrier].iter().all(|c| {
                of(r, names::PROCESSED, c) + of(r, names::DUPLICATES_DISCARDED, c) >= 30
                    && dead(r, c, "invalid_json") + dead(r, c, "missing_message_id") >= 2
            }) && dead(r, carrier, "retries_exhausted") >= 1
        })
        .await;
    // The gauge catches up within a few of its 50 ms rounds: 20 rows per
    // consumer, plus the poison event's notification.
    recorded
        .eventually("the row gauge at 41", Duration::from_secs(10), |r| {
            r.gauge(names::ROWS) == Some(41.0)
        })
        .await;
    service.shutdown();
    service.join().await.expect("clean shutdown");
    recorded.refresh();

    let r = &recorded;
    assert_eq!(plan.copies, 10);
    assert_eq!(
        of(r, names::PROCESSED, notification),
        21,
        "20 events + the poison"
    );
    assert_eq!(of(r, names::PROCESSED, carrier), 20);
    assert_eq!(of(r, names::DUPLICATES_DISCARDED, notification), 10);
    assert_eq!(of(r, names::DUPLICATES_DISCARDED, carrier), 10);
    // The poison message's two attempts failed in its work; nothing else
    // failed anywhere.
    assert_eq!(
        r.counter(names::FAILED, &[("consumer", carrier), ("stage", "work")]),
        2,
        "{}",
        r.dump()
    );
    assert_eq!(of(r, names::FAILED, carrier), 2);
    assert_eq!(of(r, names::FAILED, notification), 0);
    assert_eq!(of(r, runtime_names.requeued, carrier), 1);
    assert_eq!(of(r, runtime_names.requeued, notification), 0);
    for consumer in [notification, carrier] {
        assert_eq!(dead(r, consumer, "invalid_json"), 1, "{consumer}");
        assert_eq!(dead(r, consumer, "missing_message_id"), 1, "{consumer}");
    }
    assert_eq!(dead(r, carrier, "retries_exhausted"), 1);
    assert_eq!(of(r, names::DEAD_LETTERED, notification), 2);
    assert_eq!(of(r, names::DEAD_LETTERED, carrier), 3);

    // Every processed row is past a zero retention: one purge of 41 rows
    // in batches of 10 adds 41, once.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let config = CleanupConfig {
        retention: Duration::ZERO,
        interval: Duration::from_secs(3600),
        batch_size: NonZeroU32::new(10).expect("non-zero"),
        ..CleanupConfig::default()
    };
    let purged = cleanup_once(&store, &config).await.expect("cleanup");
    assert_eq!(purged, 41);
    recorded.refresh();
    assert_eq!(recorded.counter(names::PURGED_ROWS, &[]), 41);
}
