//! Claim-and-commit throughput of the memory store, as a Markdown table,
//! with the floor beneath it (the same two hash-map inserts with no store
//! around them) measured in the same run.
//!
//! `cargo bench -p inbox-backend-memory` runs each scenario for
//! `INBOX_BENCH_SECONDS` (default 1.5) on one core (a current-thread tokio
//! runtime, one task: the figure the target "≥ 1,000,000 claim+commit/s on
//! one core" is about), then on a multi-threaded runtime with 2 workers and
//! 1 or 2 tasks; `INBOX_BENCH_MESSAGES=N` runs exactly N messages per task
//! instead. Each scenario gets a fresh store; every task uses its own keys,
//! so tasks never wait on each other's claims.
//!
//! The one-core rows also give messages per second of the thread's own CPU
//! time (Linux' `/proc/thread-self/schedstat`): on a shared machine that
//! figure moves less than the wall-clock rate when other processes take
//! the core away.
//!
//! `INBOX_BENCH_ONLY=text` runs only the rows whose id (printed in the
//! table, e.g. `raw/1-core/1`, `handle/2-workers/2`) contains `text`: to
//! profile one scenario, `INBOX_BENCH_ONLY=handle/1-core perf record …`.
//!
//! Run as a test (`cargo test --all-targets`, no `--bench` argument) it only
//! does a short smoke run, so CI stays fast.

use std::collections::HashMap;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use foldhash::fast::RandomState;
use inbox_api::{
    Claim, ConsumerName, Inbox, InboxError, InboxKey, InboxStore, InboxTransaction, MessageId,
};
use inbox_backend_memory::MemoryStore;
use tokio_sync as tokio;
use uuid::Uuid;

/// What one message costs in each scenario.
#[derive(Clone, Copy, Debug)]
enum Scenario {
    /// begin, claim (Fresh), one put, commit: by hand.
    Raw,
    /// The same through `Inbox::handle` (metrics and tracing calls included,
    /// with no recorder or subscriber installed).
    Handle,
    /// A redelivery: begin, claim (Duplicate), rollback.
    Duplicate,
    /// No store: the two hash-map inserts every claim+commit makes (the
    /// inbox row, the business value), into plain foldhash maps that grow
    /// as the store's do. The floor under `raw` and `handle` on this
    /// machine, measured in the same run: what is left between them and it
    /// is the store's and the middleware's own cost.
    Floor,
}

impl Scenario {
    fn id(self) -> &'static str {
        match self {
            Self::Raw => "raw",
            Self::Handle => "handle",
            Self::Duplicate => "duplicate",
            Self::Floor => "floor",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Raw => "begin, claim Fresh, put, commit",
            Self::Handle => "`Inbox::handle` (claim, put, commit)",
            Self::Duplicate => "redelivery: begin, claim Duplicate, rollback",
            Self::Floor => "floor: the same two map inserts, no store",
        }
    }
}

/// When a task stops.
#[derive(Clone, Copy, Debug)]
enum Budget {
    Messages(u64),
    Time(Duration),
}

/// Keys already committed, for the duplicate scenario to claim again.
const DUPLICATE_POOL: u64 = 10_000;

fn budget_from_env() -> Budget {
    let benching = std::env::args().any(|arg| arg == "--bench");
    if !benching {
        return Budget::Messages(1_000);
    }
    if let Some(count) = std::env::var("INBOX_BENCH_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return Budget::Messages(count);
    }
    let seconds = std::env::var("INBOX_BENCH_SECONDS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(1.5);
    Budget::Time(Duration::from_secs_f64(seconds))
}

fn key(task: u64, n: u64, consumer: &ConsumerName) -> InboxKey {
    InboxKey::new(
        MessageId::from(Uuid::from_u64_pair(task, n)),
        consumer.clone(),
    )
}

/// Commits the keys the duplicate scenario claims again.
async fn seed_duplicates(store: &MemoryStore, task: u64) {
    let consumer = ConsumerName::new("bench").expect("valid consumer name");
    for n in 0..DUPLICATE_POOL {
        let mut tx = store.begin().await.expect("begin");
        let claim = tx.claim(&key(task, n, &consumer)).await.expect("claim");
        assert_eq!(claim, Claim::Fresh);
        tx.commit().await.expect("commit");
    }
}

/// The floor scenario's maps: an inbox row is a key and a slot of the
/// store's size (owner, timestamp, waiters: 32 bytes).
#[derive(Default)]
struct FloorMaps {
    rows: HashMap<InboxKey, [u64; 4], RandomState>,
    values: HashMap<String, Vec<u8>, RandomState>,
}

/// One task's loop; returns how many messages it handled, and the floor's
/// maps, to be freed after the clock stops as the store's rows are.
async fn worker(
    scenario: Scenario,
    inbox: Arc<Inbox<MemoryStore>>,
    task: u64,
    stop: Budget,
) -> (u64, FloorMaps) {
    let consumer = ConsumerName::new("bench").expect("valid consumer name");
    let store = inbox.store();
    let deadline = match stop {
        Budget::Time(time) => Some(Instant::now() + time),
        Budget::Messages(_) => None,
    };
    let mut floor = FloorMaps::default();
    let mut n: u64 = 0;
    loop {
        match (stop, deadline) {
            (Budget::Messages(count), _) if n >= count => break,
            (_, Some(deadline)) if n.is_multiple_of(64) && Instant::now() >= deadline => break,
            _ => {}
        }
        match scenario {
            Scenario::Raw => {
                let key = key(task, n, &consumer);
                let mut tx = store.begin().await.expect("begin");
                let claim = tx.claim(&key).await.expect("claim");
                assert_eq!(claim, Claim::Fresh);
                tx.put(format!("effect/{task}/{n}"), b"done".as_slice());
                tx.commit().await.expect("commit");
            }
            Scenario::Handle => {
                let key = key(task, n, &consumer);
                let outcome = inbox
                    .handle(&key, async |tx| {
                        tx.put(format!("effect/{task}/{n}"), b"done".as_slice());
                        Ok::<_, InboxError>(())
                    })
                    .await
                    .expect("handle");
                assert!(!outcome.is_duplicate());
            }
            Scenario::Floor => {
                let key = key(task, n, &consumer);
                let fresh = floor.rows.insert(key, [task, n, 0, 0]).is_none();
                assert!(fresh);
                floor
                    .values
                    .insert(format!("effect/{task}/{n}"), b"done".to_vec());
            }
            Scenario::Duplicate => {
                let key = key(task, n % DUPLICATE_POOL, &consumer);
                let mut tx = store.begin().await.expect("begin");
                let claim = tx.claim(&key).await.expect("claim");
                assert_eq!(claim, Claim::Duplicate);
                tx.rollback().await.expect("rollback");
            }
        }
        n += 1;
    }
    (n, floor)
}

/// Where the tasks run.
#[derive(Clone, Copy, Debug)]
enum Flavour {
    /// A current-thread runtime on this thread: one core.
    OneCore,
    /// A multi-threaded runtime with 2 workers.
    TwoWorkers,
}

impl Flavour {
    fn id(self) -> &'static str {
        match self {
            Self::OneCore => "1-core",
            Self::TwoWorkers => "2-workers",
        }
    }
}

struct Row {
    scenario: Scenario,
    flavour: Flavour,
    tasks: u64,
    messages: u64,
    elapsed: Duration,
    /// CPU time of the thread that ran it all, when known (one core only).
    cpu: Option<Duration>,
}

/// The CPU time this thread has used so far (Linux only).
fn thread_cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let nanos = stat.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(nanos))
}

impl Row {
    fn id(&self) -> String {
        row_id(self.scenario, self.flavour, self.tasks)
    }
}

fn row_id(scenario: Scenario, flavour: Flavour, tasks: u64) -> String {
    format!("{}/{}/{tasks}", scenario.id(), flavour.id())
}

/// One task on a current-thread runtime: everything on this thread.
fn run_one_core(scenario: Scenario, stop: Budget) -> Row {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio runtime");
    let inbox = Arc::new(Inbox::new(MemoryStore::new()));
    if let Scenario::Duplicate = scenario {
        runtime.block_on(seed_duplicates(inbox.store(), 0));
    }
    let cpu_before = thread_cpu_time();
    let started = Instant::now();
    let (messages, floor) = runtime.block_on(worker(scenario, Arc::clone(&inbox), 0, stop));
    let elapsed = started.elapsed();
    let cpu = thread_cpu_time()
        .zip(cpu_before)
        .map(|(after, before)| after.saturating_sub(before));
    drop(floor);
    Row {
        scenario,
        flavour: Flavour::OneCore,
        tasks: 1,
        messages,
        elapsed,
        cpu,
    }
}

fn run(runtime: &tokio::runtime::Runtime, scenario: Scenario, tasks: u64, stop: Budget) -> Row {
    let inbox = Arc::new(Inbox::new(MemoryStore::new()));
    // A std barrier, blocking each worker until all tasks and this thread
    // arrive: the loops never suspend (an uncontended memory store is always
    // ready), so a task woken by an async barrier can sit unstealable in a
    // busy worker's LIFO slot and run only after the other task finished.
    // Blocking here pins one task per worker and starts the clock once every
    // setup (the duplicate scenario's committed keys) is done.
    let barrier = Arc::new(Barrier::new(usize::try_from(tasks).expect("few tasks") + 1));
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (inbox, barrier) = (inbox.clone(), barrier.clone());
            runtime.spawn(async move {
                if let Scenario::Duplicate = scenario {
                    seed_duplicates(inbox.store(), task).await;
                }
                barrier.wait();
                worker(scenario, inbox, task, stop).await
            })
        })
        .collect();
    barrier.wait();
    let started = Instant::now();
    let (messages, floors) = runtime.block_on(async {
        let mut messages = 0;
        let mut floors = Vec::new();
        for handle in handles {
            let (n, floor) = handle.await.expect("bench task");
            messages += n;
            floors.push(floor);
        }
        (messages, floors)
    });
    let elapsed = started.elapsed();
    drop(floors);
    Row {
        scenario,
        flavour: Flavour::TwoWorkers,
        tasks,
        messages,
        elapsed,
        cpu: None,
    }
}

fn main() {
    let stop = budget_from_env();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .expect("tokio runtime");
    let only = std::env::var("INBOX_BENCH_ONLY").unwrap_or_default();
    let mut rows = Vec::new();
    for scenario in [
        Scenario::Floor,
        Scenario::Raw,
        Scenario::Handle,
        Scenario::Duplicate,
    ] {
        if row_id(scenario, Flavour::OneCore, 1).contains(&only) {
            rows.push(run_one_core(scenario, stop));
        }
        // Never more tasks than workers: each blocks one at the barrier.
        for tasks in [1, 2] {
            if row_id(scenario, Flavour::TwoWorkers, tasks).contains(&only) {
                rows.push(run(&runtime, scenario, tasks, stop));
            }
        }
    }
    println!();
    println!(
        "Memory store throughput ({stop:?} per task, distinct keys per task; \
         1-core: a current-thread runtime, 2-workers: a multi-threaded one)"
    );
    println!();
    println!("| scenario | row | tasks | messages | seconds | messages/s | per CPU-second |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for row in &rows {
        let seconds = row.elapsed.as_secs_f64();
        // Precision loss is irrelevant for a rate printed without decimals.
        #[allow(clippy::cast_precision_loss)]
        let rate = |seconds: f64| row.messages as f64 / seconds;
        let per_cpu = row
            .cpu
            .filter(|cpu| !cpu.is_zero())
            .map(|cpu| format!("{:.0}", rate(cpu.as_secs_f64())))
            .unwrap_or_default();
        println!(
            "| {} | `{}` | {} | {} | {:.3} | {:.0} | {} |",
            row.scenario.label(),
            row.id(),
            row.tasks,
            row.messages,
            seconds,
            rate(seconds),
            per_cpu,
        );
    }
}
