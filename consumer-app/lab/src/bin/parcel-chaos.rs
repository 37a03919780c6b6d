//! `parcel-chaos`: a Jepsen-style run of the Parcel Tracking service with
//! real processes, to check "exactly-once effects" under faults.
//!
//! It starts K consume processes (`parcel-lab-consume`, the service's
//! consume path with fault injection: the binary next to this one, or
//! `--consume-binary`) on one queue prefix and one schema of its own,
//! publishes N events plus copies reusing their message ids (same id, same
//! body; some right behind their original, and two publisher channels
//! sending at once) plus bad input of every class the app knows, and while
//! that runs, at seeded random moments: SIGKILLs a consumer and restarts it,
//! terminates its PostgreSQL backends (found by the `application_name` each
//! process gets in its database URL) and has RabbitMQ close its connection
//! (`rabbitmqctl close_connection`, found by the connection name, which holds
//! the process id), and with `--freezes` stops a consumer with SIGSTOP and
//! resumes it with SIGCONT `--freeze-secs` later (a paused VM: its open
//! transactions keep their claims until PostgreSQL's
//! idle-in-transaction timeout ends them, and RabbitMQ requeues its
//! deliveries once its heartbeat is missed, at the runtime's default
//! heartbeat), and with `--pg-restarts` stops
//! PostgreSQL (`pg_ctl stop -m fast`, a server restart) and starts it again
//! `--pg-down-secs` later: the run then uses a PostgreSQL cluster of its own
//! (`--private-postgres`, implied), so the shared server is never stopped;
//! likewise `--rabbit-restarts` stops RabbitMQ (`rabbitmqctl stop_app`) once
//! everything is published and starts it again `--rabbit-down-secs` later,
//! on a node of the run's own (`--private-rabbitmq`, implied).
//! Then it waits until the work queues are empty (ready and
//! unacked) and every intent is dispatched, stops the consumers, and checks
//! from the database, the stub downstreams' durable ledger and the
//! dead-letter queues:
//!
//! - every valid (message, consumer) effect exactly once (no double, none lost);
//! - inbox rows = the distinct valid (message, consumer) pairs, each with its effect;
//! - carrier bookings = notifications sent = distinct parcels (ledger keys);
//! - every bad message in both dead-letter queues with its reason, and no
//!   valid message dead-lettered.
//!
//! It prints one summary table and exits 1 on any violation (2 when the run
//! itself could not be carried out). The seed is printed first: the same seed
//! gives the same publish plan (message ids included) and the same fault
//! schedule (times, kinds, targets), so a failing run can be replayed.
//!
//! CI size (the `chaos` test): `parcel-chaos --events 2000 --kills 6`, per
//! store with `--freezes 2 --pg-restarts 1 --rabbit-restarts 1`.
//! Full size, by hand:
//!
//! ```text
//! bash .ci/services.sh
//! cargo build -p parcel-lab --bins
//! target/debug/parcel-chaos --store sqlx --events 10000 --kills 20
//! target/debug/parcel-chaos --store sqlx --events 10000 --kills 20 \
//!     --freezes 6 --pg-restarts 3 --rabbit-restarts 2
//! ```
//!
//! `--broken claim-in-own-transaction` runs the consumers on the
//! conformance suite's deliberately broken store: the run must then report
//! losses or doubles.
//!
//! With `--relays R` the outbox is in the loop: the valid events are parcel
//! creations, `POST /parcels` requests at a steady rate to the endpoint
//! served in this process (the parcel row and its outbox row in one
//! transaction), some of which do not commit: `--abort-rate` of them are
//! failed at COMMIT, after their writes, by a lab-only trigger on the run's
//! `parcels` table, and the endpoint's backends are terminated at seeded
//! moments. R relay processes (`parcel-lab-relay`: the real relay with
//! crash points right after a take and right before a mark) publish the
//! events; they are killed and restarted, their backends terminated and
//! their broker connections closed, on the same seeded schedule. Which
//! creations committed is read from the `parcels` table at the end, and
//! the checks add: the second hop (the `parcel.carrier-assigned` event the
//! carrier consumer enqueued, which the relays publish) consumed once per
//! committed parcel, with its notification; no effect of a creation that
//! did not commit (ghosts); and no outbox row left unpublished. Copies come from the relays
//! themselves then, not from the harness. `--broken-relay
//! publish-before-commit` (the producer publishes each event before its
//! request) and `--broken-relay mark-before-confirm` (the relays mark a
//! batch when they take it) must make the run fail.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use consumer_app::parcel::api::{ApiServer, CreateParcel, ParcelApi};
use consumer_app::parcel::dispatch::{CARRIER_LEDGER, NOTIFIER_LEDGER};
use consumer_app::parcel::events::{
    CARRIER_ASSIGNED_TYPE, EVENT_TYPE, ParcelCreatedEvent, ROUTING_KEY, created_message_id,
    created_outgoing,
};
use consumer_app::parcel::role::Role;
use consumer_app::parcel::store::{ParcelStore, StoreKind};
use consumer_app::parcel::topology::Topology;
use consumer_app::tools::http::request as request_http;
use consumer_app::tools::stores::{StoreConfig, WithStore, with_store};
use inbox_api::{ConsumerName, InboxKey, InboxStats, InboxStore, MessageId, OutboxStore};
use inbox_backend_sqlx::{Layout, SqlxStore};
use inbox_runtime::AppError;
use inbox_runtime::amqp::{Outgoing, Publisher, close_bounded, connect, open_channel};
use inbox_runtime::error::chain;
use inbox_runtime::message::{BadInputReason, follow_up_id, header_text};
use inbox_runtime::redact::redact_url;
use lapin::options::BasicGetOptions;
use parcel_lab::broken::BrokenRelay;
use parcel_lab::relay_faults::CRASH_EXIT;
use private_servers::{PrivatePostgres, PrivateRabbit};
use rand::rngs::StdRng;
use rand::{Rng as _, RngCore as _, SeedableRng as _};
use sqlx::Row;
use sqlx::postgres::{PgPool, PgPoolOptions};
use tokio::process::{Child, Command};

/// Largest body the consumers accept in a chaos run (`--max-body-bytes`);
/// the oversized class is just above it.
const MAX_BODY: usize = 4096;
/// Deliveries each consume process handles at once (per queue).
const CONCURRENCY: u16 = 4;
/// The share of the valid events published under a v4 (random) id; the
/// others carry a v7 id, as a producer using `MessageId::new_v7` would: in
/// the partitioned layout the v7 ones land in the day partitions, the v4
/// ones in the untimed partition, and both must be deduplicated.
const V4_SHARE: f64 = 0.2;

/// Chaos run: K consume processes, duplicates, bad input, kill -9, PostgreSQL
/// backends terminated, AMQP connections closed; then exactly-once checked.
///
/// Exit status: 0 all checks held, 1 a violation (lost, doubled, missing
/// dead letter…), 2 the run could not be carried out.
///
/// CI size: `parcel-chaos --events 2000 --kills 6 --freezes 2 --pg-restarts 1
/// --rabbit-restarts 1`. Full size: `parcel-chaos --events 10000 --kills 20
/// --freezes 6 --pg-restarts 3 --rabbit-restarts 2`. Replay: add `--seed
/// <printed seed>`.
#[derive(Parser, Debug)]
#[command(name = "parcel-chaos", version, about, long_about)]
struct Cli {
    /// The consumers' store: sqlx or diesel.
    #[arg(long, default_value = "sqlx")]
    store: StoreKind,
    /// The inbox table's layout: table, or partitioned (daily partitions
    /// of v7 ids, the others in one untimed partition). The run's schema
    /// is migrated to it and its day partitions created ahead; the plan's
    /// ids are mostly v7 either way (see [`V4_SHARE`]), so a partitioned
    /// run claims into day partitions and the untimed one alike.
    #[arg(long, default_value = "table")]
    layout: Layout,
    /// Consume processes (at least 3).
    #[arg(long, default_value_t = 3)]
    consumers: usize,
    /// Distinct valid events (one parcel each).
    #[arg(long, default_value_t = 2000)]
    events: usize,
    /// Copies (same message id, same body) per event on average.
    #[arg(long, default_value_t = 0.15)]
    duplicate_rate: f64,
    /// Bad messages of EACH class, as a fraction of --events (at least one each).
    #[arg(long, default_value_t = 0.01)]
    bad_rate: f64,
    /// kill -9 (and restart) of a consume process.
    #[arg(long, default_value_t = 6)]
    kills: usize,
    /// pg_terminate_backend of one process's connections (default: --kills).
    #[arg(long)]
    pg_kills: Option<usize>,
    /// rabbitmqctl close_connection of one process's connection (default: --kills).
    #[arg(long)]
    amqp_kills: Option<usize>,
    /// SIGSTOP of a consume process, SIGCONT --freeze-secs later. With any,
    /// every consumer runs with short database bounds (lock timeout 1 s,
    /// idle-in-transaction timeout 4 s), so that a frozen holder's claims
    /// are released within seconds; its deliveries are released by
    /// RabbitMQ at the runtime's default heartbeat.
    #[arg(long, default_value_t = 0)]
    freezes: usize,
    /// How long a frozen consume process stays stopped. The default
    /// outlasts RabbitMQ's detection of the silent connection at the
    /// default heartbeat (2–3 timeouts, at most 30 s), so that the freeze's
    /// deliveries go to the other consumers while it is stopped.
    #[arg(long, default_value_t = DEFAULT_FREEZE_SECS)]
    freeze_secs: u64,
    /// PostgreSQL stopped (`pg_ctl stop -m fast`) and started again
    /// --pg-down-secs later. Implies --private-postgres.
    #[arg(long, default_value_t = 0)]
    pg_restarts: usize,
    /// How long PostgreSQL stays down in a --pg-restarts fault.
    #[arg(long, default_value_t = 5)]
    pg_down_secs: u64,
    /// Run on a PostgreSQL cluster of the run's own (initdb into a temporary
    /// directory, a free port; removed at the end) instead of
    /// --database-url.
    #[arg(long)]
    private_postgres: bool,
    /// RabbitMQ stopped (`rabbitmqctl stop_app`) and started again
    /// --rabbit-down-secs later; held until everything is published (the
    /// harness's publisher does not reconnect). Implies --private-rabbitmq.
    #[arg(long, default_value_t = 0)]
    rabbit_restarts: usize,
    /// How long RabbitMQ stays down in a --rabbit-restarts fault.
    #[arg(long, default_value_t = 5)]
    rabbit_down_secs: u64,
    /// Run on a RabbitMQ node of the run's own (its own name, ports and
    /// files in a temporary directory; removed at the end) instead of
    /// --amqp-url.
    #[arg(long)]
    private_rabbitmq: bool,
    /// Seed of the plan and the fault schedule (default: from the clock; printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Run the consumers on a deliberately broken inbox store
    /// (claim-in-own-transaction, check-then-insert, work-before-claim,
    /// claim-without-waiting).
    #[arg(long)]
    broken: Option<String>,
    /// Messages published per second (both publisher channels together): the
    /// faults are spread over the publishing time plus two seconds.
    #[arg(long, default_value_t = 200.0)]
    publish_rate: f64,
    /// Time each consumer transaction holds after its writes (widens the
    /// "killed mid-transaction" window).
    #[arg(long, default_value_t = 5)]
    work_delay_ms: u64,
    /// Run the consumers in batched mode with this batch size (batch wait
    /// 20 ms, prefetch 2 × size × concurrency); per-message mode without it.
    #[arg(long, value_parser = clap::value_parser!(u16).range(2..=1000))]
    batch_size: Option<u16>,
    /// Relay processes (`parcel-lab-relay`). With any, the valid events are
    /// not published by the harness: they are parcel creations through
    /// `POST /parcels` (some failed at COMMIT on purpose, see
    /// --abort-rate), which the relays publish; the relays are
    /// killed and restarted, their backends terminated and their broker
    /// connections closed, and they crash at seeded points of their rounds.
    #[arg(long, default_value_t = 0)]
    relays: usize,
    /// kill -9 (and restart) of a relay process (default: --kills).
    #[arg(long)]
    relay_kills: Option<usize>,
    /// pg_terminate_backend of one relay's connections (default: --relay-kills).
    #[arg(long)]
    relay_pg_kills: Option<usize>,
    /// rabbitmqctl close_connection of one relay's connection, which lands
    /// while it awaits confirms (default: --relay-kills).
    #[arg(long)]
    relay_amqp_kills: Option<usize>,
    /// pg_terminate_backend of the endpoint's connections: creations in
    /// flight then do not commit (default: --relay-kills).
    #[arg(long)]
    producer_pg_kills: Option<usize>,
    /// Fraction of the creations failed on purpose at COMMIT, after their
    /// writes (a lab-only trigger on the run's `parcels` table).
    #[arg(long, default_value_t = 0.05)]
    abort_rate: f64,
    /// Probability, per relay round, of a crash right after the take, and
    /// likewise right before the mark (after the confirms).
    #[arg(long, default_value_t = 0.02)]
    relay_crash_rate: f64,
    /// Use a deliberately broken relay (publish-before-commit,
    /// mark-before-confirm): the run must then report a violation.
    #[arg(long)]
    broken_relay: Option<String>,
    /// Seconds to wait for the queues to drain after the last publish.
    #[arg(long, default_value_t = 240)]
    drain_timeout_secs: u64,
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// RabbitMQ URL.
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// The parcel-lab-consume binary (default: next to this one).
    #[arg(long, alias = "parcel-inbox")]
    consume_binary: Option<PathBuf>,
    /// The parcel-lab-relay binary (default: next to this one).
    #[arg(long)]
    relay_binary: Option<PathBuf>,
    /// Keep the schema, queues and logs even when the run passes (they are
    /// always kept when it fails).
    #[arg(long)]
    keep: bool,
    /// Drop the schema and queues even when the run fails (tests).
    #[arg(long)]
    always_clean: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    consumer_app::tools::logging::init_logging(consumer_app::tools::logging::LogFormat::Text);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the runtime: {error}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("error: {}", chain(&error));
            ExitCode::from(2)
        }
    }
}

// ------------------------------------------------------------------ plan

/// The run's randomness: rand's `StdRng` seeded from `--seed`, so that a
/// seed replays the same plan and fault schedule (under the locked rand
/// version). A thin wrapper keeps the plan's and the schedule's calls short.
struct Rng(StdRng);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(StdRng::seed_from_u64(seed))
    }

    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        self.0.random_range(..n)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        self.0.random()
    }

    fn uuid(&mut self) -> uuid::Uuid {
        uuid::Builder::from_random_bytes(self.0.random()).into_uuid()
    }

    /// A v7 id of the time `millis` (since the Unix epoch), its other bits
    /// from the seed.
    fn uuid_v7(&mut self, millis: u64) -> uuid::Uuid {
        uuid::Builder::from_unix_timestamp_millis(millis, &self.0.random()).into_uuid()
    }
}

/// What a published message is, for the checks.
#[derive(Clone, Debug)]
enum Kind {
    /// Valid event number `n` (parcel `C-{n}`); copies have the same kind.
    Valid(usize),
    /// A bad message (`BAD-{n}` in its body).
    Bad,
}

struct Plan {
    messages: Vec<(Kind, Outgoing)>,
    /// Message ids of the valid events, by number.
    valid_ids: Vec<uuid::Uuid>,
    copies: usize,
    back_to_back: usize,
    bad: Vec<BadInputReason>,
    /// With relays: the numbers of the creations rolled back on purpose.
    aborted: HashSet<usize>,
}

fn event_for(parcel_id: String, rng: &mut Rng) -> ParcelCreatedEvent {
    let destinations = ["Lyon", "Porto", "Gdansk", "Utrecht", "Bologna", "Ghent"];
    ParcelCreatedEvent {
        parcel_id,
        tracking_number: format!("TN{:010}", rng.next() % 10_000_000_000),
        destination: destinations[rng.below(destinations.len())].to_owned(),
    }
}

fn json(event: &ParcelCreatedEvent) -> Result<Vec<u8>, AppError> {
    serde_json::to_vec(event).map_err(|e| AppError::Config(format!("serialise: {e}")))
}

fn bad_message(n: usize, reason: BadInputReason, rng: &mut Rng) -> Result<Outgoing, AppError> {
    let marker = format!("BAD-{n:06}");
    let good = json(&event_for(marker.clone(), rng))?;
    let id = Some(rng.uuid().to_string());
    let kind = Some(EVENT_TYPE.to_owned());
    Ok(match reason {
        BadInputReason::MissingMessageId => Outgoing {
            message_id: None,
            kind,
            body: good,
        },
        BadInputReason::InvalidMessageId => Outgoing {
            message_id: Some(format!("order-{marker}")),
            kind,
            body: good,
        },
        BadInputReason::InvalidJson => Outgoing {
            message_id: id,
            kind,
            body: format!("{{\"parcel_id\": \"{marker}\", ").into_bytes(),
        },
        BadInputReason::InvalidEvent => Outgoing {
            message_id: id,
            kind,
            body: format!("{{\"parcel\": \"{marker}\"}}").into_bytes(),
        },
        BadInputReason::UnknownType => Outgoing {
            message_id: id,
            kind: Some("parcel.deleted".to_owned()),
            body: good,
        },
        BadInputReason::Oversized => {
            let mut event = event_for(marker, rng);
            event.destination = "x".repeat(MAX_BODY + 10);
            Outgoing {
                message_id: id,
                kind,
                body: json(&event)?,
            }
        }
    })
}

impl Plan {
    /// The plan of `cli`'s run, drawn from `rng`; the valid events' v7 ids
    /// carry the time `now_millis` plus their number in milliseconds (so a
    /// replayed seed gives the same ids but for their time bits).
    fn new(cli: &Cli, rng: &mut Rng, now_millis: u64) -> Result<Self, AppError> {
        let mut messages = Vec::new();
        let mut valid_ids: Vec<uuid::Uuid> = Vec::with_capacity(cli.events);
        for n in 0..cli.events {
            let id = if rng.unit() < V4_SHARE {
                rng.uuid()
            } else {
                rng.uuid_v7(now_millis + n as u64)
            };
            let event = event_for(format!("C-{n:06}"), rng);
            messages.push((
                Kind::Valid(n),
                Outgoing {
                    message_id: Some(id.to_string()),
                    kind: Some(EVENT_TYPE.to_owned()),
                    body: json(&event)?,
                },
            ));
            valid_ids.push(id);
        }
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss,
            reason = "a count times a small rate"
        )]
        let scaled = |rate: f64| (cli.events as f64 * rate).ceil() as usize;
        // With relays the copies come from the relays themselves (a crash
        // after the confirms, before the mark); a copy published by the
        // harness could be of a creation that never committed.
        let copies = if cli.relays > 0 {
            0
        } else {
            scaled(cli.duplicate_rate)
        };
        let mut back_to_back = 0;
        for _ in 0..copies {
            let n = rng.below(cli.events);
            let copy = messages
                .iter()
                .find(|(k, _)| matches!(k, Kind::Valid(m) if *m == n))
                .map(|(k, o)| (k.clone(), o.clone()));
            let Some(copy) = copy else { continue };
            // Half right behind the original (the two publisher channels
            // take alternate messages, so these go out at the same time),
            // half anywhere.
            let at = if rng.below(2) == 0 {
                back_to_back += 1;
                messages
                    .iter()
                    .position(|(k, _)| matches!(k, Kind::Valid(m) if *m == n))
                    .map_or(0, |p| p + 1)
            } else {
                rng.below(messages.len() + 1)
            };
            messages.insert(at, copy);
        }
        let per_class = scaled(cli.bad_rate).max(1);
        let mut bad = Vec::new();
        for reason in BadInputReason::ALL {
            for _ in 0..per_class {
                let n = bad.len();
                let message = bad_message(n, reason, rng)?;
                let at = rng.below(messages.len() + 1);
                messages.insert(at, (Kind::Bad, message));
                bad.push(reason);
            }
        }
        // Drawn last: the plans of runs without relays stay as they were.
        let aborted: HashSet<usize> = if cli.relays > 0 {
            (0..cli.events)
                .filter(|_| rng.unit() < cli.abort_rate)
                .collect()
        } else {
            HashSet::new()
        };
        // With relays the events' ids are the endpoint's, derived from
        // the parcel ids.
        if cli.relays > 0 {
            for (n, id) in valid_ids.iter_mut().enumerate() {
                *id = uuid::Uuid::from(created_message_id(&parcel_id(n, aborted.contains(&n))));
            }
        }
        Ok(Self {
            messages,
            valid_ids,
            copies,
            back_to_back,
            bad,
            aborted,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FaultKind {
    Kill,
    Postgres,
    Amqp,
    Freeze,
    PostgresRestart,
    RabbitRestart,
    RelayKill,
    RelayPostgres,
    RelayAmqp,
    ProducerPostgres,
}

#[derive(Clone, Debug)]
struct Fault {
    at: Duration,
    kind: FaultKind,
    target: usize,
}

fn schedule(cli: &Cli, window: Duration, rng: &mut Rng) -> Vec<Fault> {
    let mut kinds = Vec::new();
    kinds.extend(std::iter::repeat_n(FaultKind::Kill, cli.kills));
    kinds.extend(std::iter::repeat_n(
        FaultKind::Postgres,
        cli.pg_kills.unwrap_or(cli.kills),
    ));
    kinds.extend(std::iter::repeat_n(
        FaultKind::Amqp,
        cli.amqp_kills.unwrap_or(cli.kills),
    ));
    // Appended last: the schedules of runs without them stay as they were.
    kinds.extend(std::iter::repeat_n(FaultKind::Freeze, cli.freezes));
    kinds.extend(std::iter::repeat_n(
        FaultKind::PostgresRestart,
        cli.pg_restarts,
    ));
    kinds.extend(std::iter::repeat_n(
        FaultKind::RabbitRestart,
        cli.rabbit_restarts,
    ));
    let mut faults: Vec<Fault> = kinds
        .into_iter()
        .map(|kind| Fault {
            at: Duration::from_millis(300) + window.mul_f64(rng.unit()),
            kind,
            target: rng.below(cli.consumers),
        })
        .collect();
    // Drawn after the others: the schedules of runs without relays stay
    // as they were.
    if cli.relays > 0 {
        let relay_kills = cli.relay_kills.unwrap_or(cli.kills);
        let mut relay_kinds = Vec::new();
        relay_kinds.extend(std::iter::repeat_n(FaultKind::RelayKill, relay_kills));
        relay_kinds.extend(std::iter::repeat_n(
            FaultKind::RelayPostgres,
            cli.relay_pg_kills.unwrap_or(relay_kills),
        ));
        relay_kinds.extend(std::iter::repeat_n(
            FaultKind::RelayAmqp,
            cli.relay_amqp_kills.unwrap_or(relay_kills),
        ));
        relay_kinds.extend(std::iter::repeat_n(
            FaultKind::ProducerPostgres,
            cli.producer_pg_kills.unwrap_or(relay_kills),
        ));
        // The producer's faults while it produces (the window's last two
        // seconds are the drain's start).
        let producing = window.saturating_sub(Duration::from_secs(2));
        faults.extend(relay_kinds.into_iter().map(|kind| {
            Fault {
                at: Duration::from_millis(300)
                    + if kind == FaultKind::ProducerPostgres {
                        producing
                    } else {
                        window
                    }
                    .mul_f64(rng.unit()),
                kind,
                target: rng.below(cli.relays),
            }
        }));
    }
    faults.sort_by_key(|f| f.at);
    faults
}

// ------------------------------------------------------------- processes

struct Names {
    prefix: String,
    schema: String,
    logs: PathBuf,
}

impl Names {
    fn application_name(&self, k: usize) -> String {
        format!("{}-c{k}", self.schema)
    }

    fn relay_application_name(&self, k: usize) -> String {
        format!("{}-r{k}", self.schema)
    }

    fn producer_application_name(&self) -> String {
        format!("{}-producer", self.schema)
    }
}

fn with_application_name(url: &str, name: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}application_name={name}")
}

/// The consumers' bounds when a run freezes them, as in the killed-process
/// test: a claim waits at most 1 s on a lock a frozen process holds (and is
/// handed back uncharged); PostgreSQL ends a frozen session 4 s after its
/// last statement, releasing its claims; the handle timeout stays below it,
/// as the flags demand.
const FREEZE_BOUNDS: [&str; 6] = [
    "--lock-timeout-ms",
    "1000",
    "--idle-in-transaction-timeout-secs",
    "4",
    "--handle-timeout-secs",
    "3",
];

/// How long a freeze lasts unless told otherwise: RabbitMQ's detection of a
/// silent connection at the runtime's default heartbeat (it closes the
/// connection 2 to 3 heartbeat timeouts after the last byte and requeues
/// its unacked deliveries; 29 s measured by the killed-process test), and
/// 5 s more.
const DEFAULT_FREEZE_SECS: u64 = 3 * inbox_runtime::amqp::DEFAULT_HEARTBEAT.as_secs() + 5;

/// The run's processes of one kind: the consumers, or the relays.
struct Consumers<'a> {
    cli: &'a Cli,
    names: &'a Names,
    binary: PathBuf,
    /// `Some(run seed)` for relay processes (their crash points' seeds
    /// derive from it), `None` for consume processes.
    relay_seed: Option<u64>,
    children: Vec<Child>,
    generation: Vec<usize>,
    /// When each frozen (SIGSTOPped) process is to be resumed.
    frozen: Vec<Option<Instant>>,
    unexpected_exits: usize,
    /// Relays that exited at a deliberate crash point (and were restarted).
    crash_points: usize,
}

impl<'a> Consumers<'a> {
    fn new(cli: &'a Cli, names: &'a Names, binary: PathBuf) -> Self {
        Self {
            cli,
            names,
            binary,
            relay_seed: None,
            children: Vec::new(),
            generation: vec![0; cli.consumers],
            frozen: vec![None; cli.consumers],
            unexpected_exits: 0,
            crash_points: 0,
        }
    }

    /// The `--relays` relay processes.
    fn relays(cli: &'a Cli, names: &'a Names, binary: PathBuf, seed: u64) -> Self {
        Self {
            relay_seed: Some(seed),
            generation: vec![0; cli.relays],
            frozen: vec![None; cli.relays],
            ..Self::new(cli, names, binary)
        }
    }

    fn count(&self) -> usize {
        self.generation.len()
    }

    /// What a process is called in RabbitMQ's connection names
    /// (`parcel-inbox <word> <prefix><pid>`) and in the logs.
    fn word(&self) -> &'static str {
        if self.relay_seed.is_some() {
            "relay"
        } else {
            "consume"
        }
    }

    fn application_name(&self, k: usize) -> String {
        if self.relay_seed.is_some() {
            self.names.relay_application_name(k)
        } else {
            self.names.application_name(k)
        }
    }

    /// Process `k`'s stdout and stderr: its log file, appended to.
    fn log(&self, k: usize) -> Result<(Stdio, Stdio), AppError> {
        let letter = if self.relay_seed.is_some() { 'r' } else { 'c' };
        let log = self.names.logs.join(format!("{letter}{k}.log"));
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .map_err(|source| AppError::Io {
                    context: format!("open {}", log.display()),
                    source,
                })
        };
        Ok((open()?.into(), open()?.into()))
    }

    /// A relay process: short leases and confirm timeouts, so that what a
    /// killed relay held goes out again within seconds; no purge, since
    /// the outbox rows are the record of which creations committed.
    fn relay_command(&self, k: usize, seed: u64) -> Result<Command, AppError> {
        let (stdout, stderr) = self.log(k)?;
        let crash = self.cli.relay_crash_rate.to_string();
        let fault_seed = seed ^ ((k as u64) << 32) ^ self.generation[k] as u64;
        let mut command = Command::new(&self.binary);
        command
            .args([
                "--store",
                self.cli.store.as_str(),
                "--database-url",
                &with_application_name(&self.cli.database_url, &self.application_name(k)),
                "--amqp-url",
                &self.cli.amqp_url,
                "--schema",
                &self.names.schema,
                "--layout",
                self.cli.layout.as_str(),
                "--prefix",
                &self.names.prefix,
                "--pool-size",
                "4",
                "--batch-size",
                "20",
                "--lease-secs",
                "4",
                "--confirm-timeout-secs",
                "2",
                "--poll-interval-ms",
                "200",
                "--metrics-addr",
                "off",
                "--purge-interval-secs",
                "0",
                "--fault-crash-after-take",
                &crash,
                "--fault-crash-before-mark",
                &crash,
                "--fault-seed",
                &fault_seed.to_string(),
            ])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .kill_on_drop(true);
        if let Some(BrokenRelay::MarkBeforeConfirm) = broken_relay(self.cli)? {
            command.args([
                "--fault-broken-relay",
                BrokenRelay::MarkBeforeConfirm.name(),
            ]);
        }
        Ok(command)
    }

    fn command(&self, k: usize) -> Result<Command, AppError> {
        if let Some(seed) = self.relay_seed {
            return self.relay_command(k, seed);
        }
        let (stdout, stderr) = self.log(k)?;
        // Batched: one batch in work and the next arriving, per worker.
        let prefetch = self
            .cli
            .batch_size
            .map_or(8, |size| size.saturating_mul(2 * CONCURRENCY));
        let mut command = Command::new(&self.binary);
        command
            .args([
                "--store",
                self.cli.store.as_str(),
                "--database-url",
                &with_application_name(&self.cli.database_url, &self.names.application_name(k)),
                "--amqp-url",
                &self.cli.amqp_url,
                "--schema",
                &self.names.schema,
                "--layout",
                self.cli.layout.as_str(),
                "--prefix",
                &self.names.prefix,
                "--pool-size",
                "8",
                "--metrics-addr",
                "off",
                "--cleanup-interval-secs",
                "0",
                "--concurrency",
                &CONCURRENCY.to_string(),
                "--prefetch",
                &prefetch.to_string(),
                "--max-deliveries",
                "40",
                "--max-body-bytes",
                &MAX_BODY.to_string(),
                "--dispatch-interval-secs",
                "1",
                "--dispatch-min-age-secs",
                "2",
                "--fault-work-delay-ms",
                &self.cli.work_delay_ms.to_string(),
            ])
            .env("RUST_LOG", "warn,inbox_runtime::worker=error")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .kill_on_drop(true);
        if let Some(kind) = &self.cli.broken {
            command.args(["--fault-broken-store", kind]);
        }
        if let Some(size) = self.cli.batch_size {
            command.args(["--batch-size", &size.to_string(), "--batch-wait", "20"]);
        }
        if self.cli.freezes > 0 {
            command.args(FREEZE_BOUNDS);
        }
        Ok(command)
    }

    fn spawn(&mut self, k: usize) -> Result<Child, AppError> {
        self.generation[k] += 1;
        self.command(k)?.spawn().map_err(|source| AppError::Io {
            context: format!("start {}", self.binary.display()),
            source,
        })
    }

    fn start_all(&mut self) -> Result<(), AppError> {
        for k in 0..self.count() {
            let child = self.spawn(k)?;
            self.children.push(child);
        }
        Ok(())
    }

    /// Restarts any process that exited by itself (a crash: counted).
    fn supervise(&mut self) -> Result<(), AppError> {
        for k in 0..self.children.len() {
            if let Ok(Some(status)) = self.children[k].try_wait() {
                self.exited(k, status);
                self.children[k] = self.spawn(k)?;
            }
        }
        Ok(())
    }

    /// Counts process `k`'s exit by itself: a crash point, or a crash.
    fn exited(&mut self, k: usize, status: std::process::ExitStatus) {
        if self.relay_seed.is_some() && status.code() == Some(CRASH_EXIT) {
            self.crash_points += 1;
            tracing::info!(relay = k, "relay exited at a crash point; restarting");
        } else {
            self.unexpected_exits += 1;
            tracing::error!(process = k, kind = self.word(), %status,
                "process exited by itself; restarting");
        }
    }

    async fn kill_and_restart(&mut self, k: usize) -> Result<(), AppError> {
        // SIGKILL ends a stopped process too; its successor runs.
        self.frozen[k] = None;
        // One that exited by itself since the last look is counted first.
        if let Ok(Some(status)) = self.children[k].try_wait() {
            self.exited(k, status);
        }
        let child = &mut self.children[k];
        let _ = child.start_kill();
        let _ = child.wait().await;
        self.children[k] = self.spawn(k)?;
        Ok(())
    }

    fn pid(&self, k: usize) -> Option<u32> {
        self.children[k].id()
    }

    /// Has RabbitMQ (`node`) close process `k`'s connection; false when it
    /// has none right now.
    async fn close_connection(&self, k: usize, node: Option<&str>) -> Result<bool, AppError> {
        match self.pid(k) {
            Some(pid) => close_amqp_connection(node, &self.names.prefix, self.word(), pid).await,
            None => Ok(false),
        }
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`) to process `k`.
    async fn signal(&self, k: usize, signal: &str) -> bool {
        match self.pid(k) {
            Some(pid) => Command::new("kill")
                .args([&format!("-{signal}"), &pid.to_string()])
                .status()
                .await
                .is_ok_and(|s| s.success()),
            None => false,
        }
    }

    /// SIGSTOP to process `k`, to be resumed at `until`; false when it is
    /// frozen already (or gone).
    async fn freeze(&mut self, k: usize, until: Instant) -> bool {
        if self.frozen[k].is_some() || !self.signal(k, "STOP").await {
            return false;
        }
        self.frozen[k] = Some(until);
        true
    }

    /// SIGCONT to every frozen process whose time is up (all with `all`);
    /// true while some stay frozen.
    async fn thaw(&mut self, all: bool) -> bool {
        let now = Instant::now();
        for k in 0..self.frozen.len() {
            if self.frozen[k].is_some_and(|until| all || until <= now) {
                let resumed = self.signal(k, "CONT").await;
                tracing::info!(consumer = k, resumed, "SIGCONT");
                self.frozen[k] = None;
            }
        }
        self.frozen.iter().any(Option::is_some)
    }

    /// SIGTERM to all, then SIGKILL to what is still running after 20 s.
    async fn stop_all(&mut self) {
        // A stopped process would only see its SIGTERM once resumed.
        self.thaw(true).await;
        for k in 0..self.children.len() {
            self.signal(k, "TERM").await;
        }
        for child in &mut self.children {
            if tokio::time::timeout(Duration::from_secs(20), child.wait())
                .await
                .is_err()
            {
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
        }
    }
}

async fn run_tool(program: &str, args: &[&str]) -> Result<String, AppError> {
    let output = Command::new(program)
        .args(args)
        .output()
        .await
        .map_err(|source| AppError::Io {
            context: format!("run {program}"),
            source,
        })?;
    if !output.status.success() {
        return Err(AppError::Unavailable(format!(
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Runs `rabbitmqctl` against `node` (`None`: its default node).
async fn rabbitmqctl(node: Option<&str>, args: &[&str]) -> Result<String, AppError> {
    let mut all = Vec::with_capacity(args.len() + 2);
    if let Some(node) = node {
        all.extend(["-n", node]);
    }
    all.extend_from_slice(args);
    run_tool("rabbitmqctl", &all).await
}

/// Has RabbitMQ close the AMQP connection of the process `pid`; false when it
/// has none right now (e.g. just restarted, not yet connected).
async fn close_amqp_connection(
    node: Option<&str>,
    prefix: &str,
    word: &str,
    pid: u32,
) -> Result<bool, AppError> {
    let listed = rabbitmqctl(
        node,
        &[
            "list_connections",
            "--quiet",
            "--no-table-headers",
            "pid",
            "client_properties",
        ],
    )
    .await?;
    let needle = format!("{{\"connection_name\",\"parcel-inbox {word} {prefix}{pid}\"}}");
    let Some(connection) = listed.lines().find_map(|line| {
        let (conn, properties) = line.split_once('\t')?;
        properties.contains(&needle).then(|| conn.trim().to_owned())
    }) else {
        return Ok(false);
    };
    rabbitmqctl(
        node,
        &[
            "close_connection",
            &connection,
            "parcel-chaos: closing a process's connection",
        ],
    )
    .await?;
    Ok(true)
}

/// Terminates every PostgreSQL backend of consumer `application_name`.
async fn terminate_backends(pool: &PgPool, application_name: &str) -> Result<u64, AppError> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE application_name = $1 AND pid <> pg_backend_pid()",
    )
    .bind(application_name)
    .fetch_one(pool)
    .await
    .map_err(db)?;
    Ok(u64::try_from(n).unwrap_or(0))
}

fn db(error: sqlx::Error) -> AppError {
    AppError::Unavailable(format!("PostgreSQL: {error}"))
}

/// Messages (ready + unacknowledged) per queue name, from rabbitmqctl.
async fn queue_depths(node: Option<&str>, queues: &[String]) -> Result<Vec<u64>, AppError> {
    let listed = rabbitmqctl(
        node,
        &[
            "list_queues",
            "--quiet",
            "--no-table-headers",
            "name",
            "messages",
        ],
    )
    .await?;
    let depth: HashMap<&str, u64> = listed
        .lines()
        .filter_map(|line| {
            let (name, n) = line.split_once('\t')?;
            Some((name.trim(), n.trim().parse().ok()?))
        })
        .collect();
    Ok(queues
        .iter()
        .map(|q| depth.get(q.as_str()).copied().unwrap_or(u64::MAX))
        .collect())
}

async fn undispatched(pool: &PgPool, schema: &str) -> Result<i64, AppError> {
    sqlx::query_scalar(&format!(
        "SELECT (SELECT count(*) FROM \"{schema}\".notifications WHERE dispatched_at IS NULL) \
         + (SELECT count(*) FROM \"{schema}\".carrier_assignments WHERE dispatched_at IS NULL)"
    ))
    .fetch_one(pool)
    .await
    .map_err(db)
}

// --------------------------------------------------------------- publish

/// Publishes the plan on two confirm channels at once (alternate messages),
/// paced to `rate` messages per second overall.
async fn publish_plan(
    amqp_url: String,
    topology: Topology,
    messages: Vec<Outgoing>,
    rate: f64,
) -> Result<(), AppError> {
    let connection = connect(&amqp_url, "parcel-chaos publisher").await?;
    let started = Instant::now();
    let mut streams = Vec::new();
    for lane in 0..2 {
        let publisher = Publisher::new(&connection, &topology.exchange(), ROUTING_KEY).await?;
        let lane_messages: Vec<(usize, Outgoing)> = messages
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 2 == lane)
            .map(|(i, m)| (i, m.clone()))
            .collect();
        streams.push(async move {
            for chunk in lane_messages.chunks(16) {
                if let Some((first, _)) = chunk.first() {
                    #[expect(clippy::cast_precision_loss, reason = "a message index")]
                    let due = Duration::from_secs_f64(*first as f64 / rate.max(1.0));
                    let now = started.elapsed();
                    if due > now {
                        tokio::time::sleep(due - now).await;
                    }
                }
                let batch: Vec<Outgoing> = chunk.iter().map(|(_, m)| m.clone()).collect();
                publisher.publish_all(&batch, 16, |_| {}).await?;
            }
            publisher.close().await;
            Ok::<_, AppError>(())
        });
    }
    let results = futures::future::join_all(streams).await;
    close_bounded(&connection, "published").await;
    results.into_iter().collect()
}

// ------------------------------------------------------------- creations

fn broken_relay(cli: &Cli) -> Result<Option<BrokenRelay>, AppError> {
    cli.broken_relay
        .as_deref()
        .map(BrokenRelay::parse)
        .transpose()
}

/// The suffix of the parcel ids the lab's trigger aborts at COMMIT.
const ABORT_SUFFIX: &str = "-abort";

/// The parcel id of creation `n` (marked for the trigger when it is to be
/// rolled back).
fn parcel_id(n: usize, aborted: bool) -> String {
    if aborted {
        format!("C-{n:06}{ABORT_SUFFIX}")
    } else {
        format!("C-{n:06}")
    }
}

/// The lab-only abort after the write: a deferred constraint trigger on
/// the run's `parcels` table fails the COMMIT of every parcel whose id
/// ends in [`ABORT_SUFFIX`], after the endpoint wrote the parcel and its
/// outbox row. The production schema has no such trigger; the run's schema
/// is its own.
async fn install_abort_trigger(pool: &PgPool, schema: &str) -> Result<(), AppError> {
    for statement in [
        format!(
            "CREATE FUNCTION \"{schema}\".chaos_abort() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'parcel-chaos: deliberate abort of %', NEW.parcel_id; END $$"
        ),
        format!(
            "CREATE CONSTRAINT TRIGGER chaos_abort AFTER INSERT ON \"{schema}\".parcels \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW \
             WHEN (NEW.parcel_id LIKE '%{ABORT_SUFFIX}') EXECUTE FUNCTION \"{schema}\".chaos_abort()"
        ),
    ] {
        sqlx::query(&statement).execute(pool).await.map_err(db)?;
    }
    Ok(())
}

/// What the producer's requests got; the `parcels` table, not this, says
/// what committed.
#[derive(Debug, Default)]
struct Creations {
    /// Answered 201.
    created: u64,
    /// Answered otherwise (the deliberate aborts: 500; a terminated
    /// backend, a stopped PostgreSQL: 503).
    refused: u64,
    /// No answer (committed or not, the table tells).
    failed: u64,
}

/// Starts `POST /parcels` in this process on the run's store (its own
/// `application_name`, so that its backends can be terminated).
struct ServeApi(Topology);

impl WithStore for ServeApi {
    type Output = ApiServer;

    async fn run<S: ParcelStore>(self, store: S) -> Result<ApiServer, AppError> {
        let any_port = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        ApiServer::start(any_port, ParcelApi::new(store, &self.0).router()).await
    }
}

async fn start_api(cli: &Cli, names: &Names, topology: &Topology) -> Result<ApiServer, AppError> {
    let store = StoreConfig {
        kind: cli.store,
        database_url: with_application_name(&cli.database_url, &names.producer_application_name()),
        schema: names.schema.clone(),
        pool_size: 4,
        timeouts: inbox_backend_sqlx::SessionTimeouts::default(),
        layout: cli.layout,
    };
    with_store(&store, Some(10), ServeApi(topology.clone())).await
}

/// The parcel creations of a run with relays: a `POST /parcels` per valid
/// event, paced to a steady rate, one at a time.
struct Produce {
    /// The parcel of each creation, in order.
    parcels: Vec<ParcelCreatedEvent>,
    api: std::net::SocketAddr,
    exchange: String,
    rate: f64,
    amqp_url: String,
    broken: Option<BrokenRelay>,
}

impl Produce {
    fn new(
        cli: &Cli,
        plan: &Plan,
        topology: &Topology,
        api: std::net::SocketAddr,
    ) -> Result<Self, AppError> {
        let mut parcels = Vec::new();
        for (kind, message) in &plan.messages {
            if let Kind::Valid(n) = kind {
                let mut parcel: ParcelCreatedEvent = serde_json::from_slice(&message.body)
                    .map_err(|e| AppError::Config(format!("a planned event: {e}")))?;
                parcel.parcel_id = parcel_id(*n, plan.aborted.contains(n));
                parcels.push(parcel);
            }
        }
        Ok(Self {
            parcels,
            api,
            exchange: topology.exchange(),
            rate: cli.publish_rate,
            amqp_url: cli.amqp_url.clone(),
            broken: broken_relay(cli)?,
        })
    }

    async fn run(self) -> Result<Creations, AppError> {
        let broker = match self.broken {
            Some(BrokenRelay::PublishBeforeCommit) => {
                let connection = connect(&self.amqp_url, "parcel-chaos broken producer").await?;
                let publisher = Publisher::new(&connection, &self.exchange, ROUTING_KEY).await?;
                Some((connection, publisher))
            }
            _ => None,
        };
        let started = Instant::now();
        let mut done = Creations::default();
        for (i, parcel) in self.parcels.iter().enumerate() {
            #[expect(clippy::cast_precision_loss, reason = "a creation index")]
            let due = Duration::from_secs_f64(i as f64 / self.rate.max(1.0));
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
            if let Some((_, publisher)) = &broker {
                // BROKEN on purpose (--broken-relay publish-before-commit):
                // the event goes out before the creation's transaction ends.
                let event = created_outgoing(&self.exchange, parcel)?;
                let outgoing = Outgoing {
                    message_id: Some(event.id().to_string()),
                    kind: Some(event.message_type().to_owned()),
                    body: event.body().to_vec(),
                };
                publisher.publish_all(&[outgoing], 1, |_| {}).await?;
            }
            let request = CreateParcel {
                parcel_id: Some(parcel.parcel_id.clone()),
                tracking_number: parcel.tracking_number.clone(),
                destination: parcel.destination.clone(),
            };
            let body = serde_json::to_vec(&request)
                .map_err(|e| AppError::Config(format!("serialise: {e}")))?;
            match request_http(self.api, "POST", "/parcels", Some("application/json"), body).await {
                Ok(answer) if answer.status == 201 => done.created += 1,
                Ok(answer) => {
                    done.refused += 1;
                    tracing::debug!(parcel_id = %parcel.parcel_id, status = answer.status,
                        body = %answer.body, "a creation was refused");
                }
                Err(error) => {
                    done.failed += 1;
                    tracing::info!(parcel_id = %parcel.parcel_id, error = %chain(&error),
                        "a creation got no answer");
                }
            }
        }
        if let Some((connection, publisher)) = broker {
            publisher.close().await;
            close_bounded(&connection, "produced").await;
        }
        Ok(done)
    }
}

/// Which planned creations committed: those with a `parcels` row.
async fn committed_creations(
    pool: &PgPool,
    schema: &str,
    plan: &Plan,
) -> Result<(Vec<uuid::Uuid>, HashSet<uuid::Uuid>), AppError> {
    let rows: Vec<String> =
        sqlx::query_scalar(&format!("SELECT parcel_id FROM \"{schema}\".parcels"))
            .fetch_all(pool)
            .await
            .map_err(db)?;
    let stored: HashSet<String> = rows.into_iter().collect();
    let mut committed = Vec::new();
    let mut not_committed = HashSet::new();
    for (n, id) in plan.valid_ids.iter().enumerate() {
        if stored.contains(&parcel_id(n, plan.aborted.contains(&n))) {
            committed.push(*id);
        } else {
            not_committed.insert(*id);
        }
    }
    Ok((committed, not_committed))
}

// ---------------------------------------------------------------- checks

#[derive(Debug, Default)]
struct Verdict {
    effects: u64,
    expected_effects: u64,
    doubles: u64,
    lost: u64,
    stray: u64,
    inbox_rows: u64,
    inbox_mismatch: u64,
    bookings: u64,
    notified: u64,
    ledger_calls: u64,
    dead_lettered: u64,
    dead_letter_missing: u64,
    dead_letter_wrong_reason: u64,
    valid_dead_lettered: u64,
    /// Effects (rows or downstream calls) of creations that did not commit.
    ghosts: u64,
    /// Outbox rows still not published at the end.
    outbox_pending: u64,
    /// Inbox rows the valid (message, consumer) pairs make.
    expected_inbox_rows: u64,
    /// Carrier-assigned events their consumer's inbox holds.
    carrier_assigned_consumed: u64,
    /// Partitioned layout: inbox rows in the day partitions and in the
    /// untimed one, and the day partitions holding rows.
    partitions: Option<PartitionSpread>,
    details: Vec<String>,
}

/// Where a partitioned inbox's rows went.
#[derive(Debug, Default, Clone, Copy)]
struct PartitionSpread {
    timed: u64,
    untimed: u64,
    days: u64,
    /// Whether the plan's ids should have filled both kinds (the harness
    /// published them: v7 and v4; with relays the ids are the endpoint's).
    both_expected: bool,
}

impl PartitionSpread {
    /// Both kinds of partition took claims, where both were expected: a
    /// partitioned run that claimed into only one proves less than it says.
    fn exercised(&self) -> bool {
        !self.both_expected || (self.timed > 0 && self.untimed > 0)
    }
}

impl Verdict {
    fn ok(&self) -> bool {
        self.doubles == 0
            && self.lost == 0
            && self.stray == 0
            && self.inbox_mismatch == 0
            && self.dead_letter_missing == 0
            && self.dead_letter_wrong_reason == 0
            && self.valid_dead_lettered == 0
            && self.ghosts == 0
            && self.outbox_pending == 0
            && self.effects == self.expected_effects
            && self.partitions.is_none_or(|p| p.exercised())
    }

    fn note(&mut self, text: String) {
        if self.details.len() < 20 {
            self.details.push(text);
        }
    }
}

async fn per_message(
    pool: &PgPool,
    schema: &str,
    table: &str,
) -> Result<HashMap<uuid::Uuid, i64>, AppError> {
    let rows = sqlx::query(&format!(
        "SELECT message_id, count(*) AS n FROM \"{schema}\".{table} GROUP BY message_id"
    ))
    .fetch_all(pool)
    .await
    .map_err(db)?;
    rows.iter()
        .map(|r| Ok((r.try_get("message_id")?, r.try_get("n")?)))
        .collect::<Result<_, sqlx::Error>>()
        .map_err(db)
}

/// Where the partitioned inbox of `schema` holds its rows.
async fn partition_spread(
    pool: &PgPool,
    schema: &str,
    both_expected: bool,
) -> Result<PartitionSpread, AppError> {
    let (timed, untimed, days): (i64, i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*) FILTER (WHERE time_ordered), count(*) FILTER (WHERE NOT time_ordered), \
                count(DISTINCT tableoid) FILTER (WHERE time_ordered) \
         FROM \"{schema}\".inbox_messages"
    ))
    .fetch_one(pool)
    .await
    .map_err(db)?;
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    Ok(PartitionSpread {
        timed: count(timed),
        untimed: count(untimed),
        days: count(days),
        both_expected,
    })
}

/// The `parcel.carrier-assigned` event's id that the carrier consumer
/// enqueues for the `parcel.created` event `id` (the app's own derivation).
fn follow_up(id: uuid::Uuid) -> Result<uuid::Uuid, AppError> {
    let carrier = ConsumerName::new(Role::Carrier.consumer_name())?;
    Ok(uuid::Uuid::from(follow_up_id(
        &MessageId::from(id),
        &carrier,
        CARRIER_ASSIGNED_TYPE,
    )))
}

/// Checks the effects of the `valid_ids` (each exactly once per consumer
/// of `parcel.created`), of their `follow_ups` (the carrier-assigned events
/// the carrier consumer enqueued; empty when no relay runs, since nothing
/// publishes them then) once by their consumer, and that the
/// `not_committed` creations and their follow-ups have none (ghosts).
async fn check_database(
    pool: &PgPool,
    inbox: &SqlxStore,
    schema: &str,
    (valid_ids, follow_ups): (&[uuid::Uuid], &[uuid::Uuid]),
    not_committed: &HashSet<uuid::Uuid>,
    verdict: &mut Verdict,
) -> Result<(), AppError> {
    let valid: HashSet<uuid::Uuid> = valid_ids.iter().chain(follow_ups).copied().collect();
    // Each consumer, the table of its effect, and the ids it must act on.
    let mut hops = vec![
        (Role::Notification, "notifications", valid_ids),
        (Role::Carrier, "carrier_assignments", valid_ids),
    ];
    if !follow_ups.is_empty() {
        hops.push((
            Role::CarrierAssignedNotification,
            "notifications",
            follow_ups,
        ));
    }
    // The inbox's rows through the backend's own answers (its table is the
    // backend's business): the totals per consumer, and each valid key.
    let counts = inbox.processed_counts().await?;
    let inbox_total: u64 = counts.values().sum();
    let mut present: HashSet<(uuid::Uuid, String)> = HashSet::new();
    for (role, _, ids) in &hops {
        let consumer = ConsumerName::new(role.consumer_name())?;
        for id in *ids {
            let key = InboxKey::new(MessageId::from(*id), consumer.clone());
            if inbox.lookup(&key).await?.is_some() {
                present.insert((*id, role.consumer_name().to_owned()));
            }
        }
        verdict.expected_inbox_rows += ids.len() as u64;
    }
    verdict.inbox_rows = inbox_total;
    verdict.carrier_assigned_consumed = present
        .iter()
        .filter(|(_, c)| c == Role::CarrierAssignedNotification.consumer_name())
        .count() as u64;
    let mut effects: HashMap<&str, HashMap<uuid::Uuid, i64>> = HashMap::new();
    for (_, table, _) in &hops {
        if !effects.contains_key(table) {
            effects.insert(table, per_message(pool, schema, table).await?);
        }
    }
    for (role, table, ids) in &hops {
        let counts = &effects[table];
        let consumer = role.consumer_name();
        for id in *ids {
            let n = u64::try_from(counts.get(id).copied().unwrap_or(0)).unwrap_or(0);
            verdict.effects += n;
            verdict.expected_effects += 1;
            if n == 0 {
                verdict.lost += 1;
                verdict.note(format!("lost: {consumer} never acted on {id}"));
            } else if n > 1 {
                verdict.doubles += n - 1;
                verdict.note(format!("doubled: {consumer} acted {n} times on {id}"));
            }
            let has_row = present.contains(&(*id, consumer.to_owned()));
            if has_row != (n > 0) {
                verdict.inbox_mismatch += 1;
                verdict.note(format!(
                    "inbox row {} but {n} effects: {consumer} {id}",
                    if has_row { "present" } else { "absent" }
                ));
            }
        }
    }
    for (table, counts) in &effects {
        for (id, n) in counts {
            if not_committed.contains(id) {
                verdict.ghosts += u64::try_from(*n).unwrap_or(0);
                verdict.note(format!(
                    "ghost: {table} has an effect of {id}, whose creation did not commit"
                ));
            } else if !valid.contains(id) {
                verdict.stray += u64::try_from(*n).unwrap_or(0);
                verdict.note(format!("stray effect of a non-event {id} in {table}"));
            }
        }
    }
    // Rows of keys that are not valid (message, consumer) pairs.
    verdict.stray += inbox_total.saturating_sub(present.len() as u64);

    let ledger = sqlx::query(&format!(
        "SELECT downstream, idempotency_key, parcel_id, calls FROM \"{schema}\".stub_ledger"
    ))
    .fetch_all(pool)
    .await
    .map_err(db)?;
    let mut keys: HashMap<&str, HashSet<String>> = HashMap::new();
    let mut parcels: HashMap<&str, HashMap<String, u64>> = HashMap::new();
    for row in &ledger {
        let downstream: String = row.try_get("downstream").map_err(db)?;
        let key: String = row.try_get("idempotency_key").map_err(db)?;
        let parcel: String = row.try_get("parcel_id").map_err(db)?;
        let calls: i64 = row.try_get("calls").map_err(db)?;
        verdict.ledger_calls += u64::try_from(calls).unwrap_or(0);
        let name = if downstream == CARRIER_LEDGER {
            CARRIER_LEDGER
        } else {
            NOTIFIER_LEDGER
        };
        keys.entry(name).or_default().insert(key);
        *parcels.entry(name).or_default().entry(parcel).or_default() += 1;
    }
    for name in [CARRIER_LEDGER, NOTIFIER_LEDGER] {
        let keys = keys.remove(name).unwrap_or_default();
        let parcels = parcels.remove(name).unwrap_or_default();
        let count = parcels.len() as u64;
        if name == CARRIER_LEDGER {
            verdict.bookings = count;
        } else {
            verdict.notified = count;
        }
        // The notifier gets one call per notification: one or two a parcel.
        let (expected, per_parcel) = match name {
            NOTIFIER_LEDGER if !follow_ups.is_empty() => (valid.clone(), 2),
            _ => (valid_ids.iter().copied().collect(), 1),
        };
        for id in &expected {
            if !keys.contains(&id.to_string()) {
                verdict.lost += 1;
                verdict.note(format!("lost: the stub {name} never got {id}"));
            }
        }
        for (parcel, n) in &parcels {
            if *n > per_parcel {
                verdict.doubles += n - per_parcel;
                verdict.note(format!(
                    "doubled: the stub {name} booked {parcel} {n} times"
                ));
            }
        }
        let valid_keys: HashSet<String> = expected.iter().map(ToString::to_string).collect();
        let ghost_keys: HashSet<String> = not_committed.iter().map(ToString::to_string).collect();
        for key in keys.difference(&valid_keys) {
            if ghost_keys.contains(key) {
                verdict.ghosts += 1;
                verdict.note(format!(
                    "ghost: the stub {name} got {key}, whose creation did not commit"
                ));
            } else {
                verdict.stray += 1;
            }
        }
    }
    Ok(())
}

/// Drains every dead-letter queue and checks every bad message is in each
/// of the `parcel.created` consumers' queues
/// with its reason, and no valid one.
async fn check_dead_letters(
    amqp_url: &str,
    topology: &Topology,
    plan: &Plan,
    verdict: &mut Verdict,
) -> Result<(), AppError> {
    let connection = connect(amqp_url, "parcel-chaos dead-letter reader").await?;
    let channel = open_channel(&connection, "channel").await?;
    for role in Role::ALL {
        let dlq = topology.dead_letter_queue(role);
        let mut seen: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        while let Some(message) = channel
            .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .map_err(|e| AppError::broker(format!("basic.get {dlq}"), e))?
        {
            verdict.dead_lettered += 1;
            let headers = message
                .delivery
                .properties
                .headers()
                .clone()
                .unwrap_or_default();
            let reason = header_text(&headers, "x-dead-letter-reason")
                .unwrap_or_else(|| "<no reason header>".to_owned());
            let body = String::from_utf8_lossy(&message.delivery.data);
            if let Some(at) = body.find("BAD-")
                && let Some(n) = body.get(at + 4..at + 10).and_then(|d| d.parse().ok())
            {
                seen.entry(n).or_default().push(reason);
            } else {
                verdict.valid_dead_lettered += 1;
                let detail = header_text(&headers, "x-dead-letter-detail").unwrap_or_default();
                verdict.note(format!(
                    "a valid message dead-lettered from {dlq}: {reason} ({detail})"
                ));
            }
        }
        // The bad input goes to parcel.created: only its consumers see it
        // (the other dead-letter queue must hold nothing valid either).
        if !Role::PARCEL_CREATED.contains(&role) {
            continue;
        }
        for (n, expected) in plan.bad.iter().enumerate() {
            match seen.get(&n) {
                None => {
                    verdict.dead_letter_missing += 1;
                    verdict.note(format!("BAD-{n:06} ({expected}) missing from {dlq}"));
                }
                Some(reasons) if reasons.iter().any(|r| r != expected.as_str()) => {
                    verdict.dead_letter_wrong_reason += 1;
                    verdict.note(format!(
                        "BAD-{n:06} in {dlq} with reason {reasons:?}, expected {expected}"
                    ));
                }
                Some(_) => {}
            }
        }
    }
    close_bounded(&connection, "bye").await;
    Ok(())
}

// ------------------------------------------------------------------- run

/// Applies the inbox's and the app's migrations to the run's schema.
struct Migrate;

impl WithStore for Migrate {
    type Output = ();

    async fn run<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        store.migrate_all().await
    }
}

#[derive(Debug, Default)]
struct FaultCounts {
    kills: usize,
    pg_kills: usize,
    pg_backends: u64,
    amqp_kills: usize,
    amqp_missed: usize,
    freezes: usize,
    freezes_missed: usize,
    pg_restarts: usize,
    pg_restarts_missed: usize,
    pg_kills_missed: usize,
    rabbit_restarts: usize,
    rabbit_restarts_missed: usize,
    relay_kills: usize,
    relay_pg_kills: usize,
    relay_pg_backends: u64,
    /// Relay and producer backend kills due while PostgreSQL was down.
    relay_pg_missed: usize,
    relay_amqp_kills: usize,
    relay_amqp_missed: usize,
    producer_pg_kills: usize,
    producer_pg_backends: u64,
}

/// What a run with relays adds to the summary.
struct RelayRun {
    creations: Creations,
    /// Creations with a `parcels` row at the end (the truth).
    committed: u64,
    not_committed: u64,
    crash_points: usize,
    unexpected_exits: usize,
}

/// The servers of the run's own, stopped and removed when dropped.
#[derive(Default)]
struct Servers {
    postgres: Option<PrivatePostgres>,
    rabbit: Option<PrivateRabbit>,
}

impl Servers {
    /// The node `rabbitmqctl` is to talk to (`None`: its default, the
    /// shared one).
    fn rabbit_node(&self) -> Option<&str> {
        self.rabbit.as_ref().map(PrivateRabbit::node)
    }
}

/// The lab binary `name`: `explicit` (its flag), or the one next to this
/// binary.
fn lab_binary(explicit: Option<&PathBuf>, name: &str) -> Result<PathBuf, AppError> {
    if let Some(path) = explicit {
        return Ok(path.clone());
    }
    let me = std::env::current_exe().map_err(|source| AppError::Io {
        context: "find the current executable".into(),
        source,
    })?;
    let dir = me.parent().unwrap_or(Path::new("."));
    // Test binaries live in deps/, the bins one level up.
    for candidate in [dir.join(name), dir.join("..").join(name)] {
        if candidate.exists() {
            return Ok(candidate);
        }
    }
    Err(AppError::Config(format!(
        "no {name} binary next to {} (build it, or pass its flag)",
        me.display()
    )))
}

async fn run(mut cli: Cli) -> Result<bool, AppError> {
    if cli.consumers < 3 {
        return Err(AppError::Config("--consumers must be at least 3".into()));
    }
    if cli.events == 0 {
        return Err(AppError::Config("--events must be at least 1".into()));
    }
    let started = Instant::now();
    let seed = cli.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    println!(
        "parcel-chaos seed {seed} (replay: --seed {seed}); store {}, layout {}, {} consumers, {} relays, {} events, broken: {}, broken relay: {}",
        cli.store,
        cli.layout,
        cli.consumers,
        cli.relays,
        cli.events,
        cli.broken.as_deref().unwrap_or("no"),
        cli.broken_relay.as_deref().unwrap_or("no")
    );
    let binary = lab_binary(cli.consume_binary.as_ref(), "parcel-lab-consume")?;
    let relay_binary = match cli.relays {
        0 => PathBuf::new(),
        _ => lab_binary(cli.relay_binary.as_ref(), "parcel-lab-relay")?,
    };
    if broken_relay(&cli)?.is_some() && cli.relays == 0 {
        return Err(AppError::Config("--broken-relay needs --relays".into()));
    }
    let mut servers = Servers::default();
    if cli.private_postgres || cli.pg_restarts > 0 {
        let postgres = tokio::task::spawn_blocking(PrivatePostgres::start)
            .await
            .map_err(|e| AppError::Unavailable(format!("private PostgreSQL: {e}")))?;
        cli.database_url = postgres.url();
        println!("a private PostgreSQL cluster: {}", cli.database_url);
        servers.postgres = Some(postgres);
    }
    if cli.private_rabbitmq || cli.rabbit_restarts > 0 {
        let rabbit = PrivateRabbit::start().await;
        cli.amqp_url = rabbit.url();
        println!(
            "a private RabbitMQ node: {} ({})",
            rabbit.node(),
            cli.amqp_url
        );
        servers.rabbit = Some(rabbit);
    }
    let mut rng = Rng::new(seed);
    let now_millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0));
    let plan = Plan::new(&cli, &mut rng, now_millis)?;
    #[expect(clippy::cast_precision_loss, reason = "a message count")]
    let publish_secs = plan.messages.len() as f64 / cli.publish_rate.max(1.0);
    let faults = schedule(&cli, Duration::from_secs_f64(publish_secs + 2.0), &mut rng);

    let id = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    let names = Names {
        prefix: format!("chaos-{id}."),
        schema: format!("chaos_{id}"),
        logs: std::env::temp_dir().join(format!("parcel-chaos-{id}")),
    };
    std::fs::create_dir_all(&names.logs).map_err(|source| AppError::Io {
        context: format!("create {}", names.logs.display()),
        source,
    })?;
    println!(
        "schema {}, queue prefix {}, consumer logs in {}; plan: {} messages ({} copies, {} back-to-back; {} bad), {} faults over {:.1}s",
        names.schema,
        names.prefix,
        names.logs.display(),
        plan.messages.len(),
        plan.copies,
        plan.back_to_back,
        plan.bad.len(),
        faults.len(),
        publish_secs + 2.0
    );
    tracing::info!(database = %redact_url(&cli.database_url), amqp = %redact_url(&cli.amqp_url),
        binary = %binary.display(), "parcel-chaos starting");

    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&with_application_name(&cli.database_url, "parcel-chaos"))
        .await
        .map_err(db)?;
    let store = StoreConfig {
        kind: cli.store,
        database_url: cli.database_url.clone(),
        schema: names.schema.clone(),
        pool_size: 2,
        timeouts: inbox_backend_sqlx::SessionTimeouts::default(),
        layout: cli.layout,
    };
    with_store(&store, Some(10), Migrate).await?;
    let topology = Topology::new(&names.prefix);
    {
        let connection = connect(&cli.amqp_url, "parcel-chaos setup").await?;
        let channel = open_channel(&connection, "channel").await?;
        topology.declare(&channel).await?;
        close_bounded(&connection, "declared").await;
    }
    let work_queues: Vec<String> = Role::ALL.iter().map(|r| topology.queue(*r)).collect();

    let inbox = SqlxStore::connect(
        &with_application_name(&cli.database_url, "parcel-chaos"),
        &names.schema,
    )
    .await?
    .with_layout(cli.layout);
    if cli.layout == Layout::Partitioned {
        // The maintenance a deployment runs daily: today and the days
        // ahead, so that no v7 id of the run lacks its partition.
        let created = inbox.create_partitions(0, 3).await?;
        println!("partitioned inbox: {created} day partitions created ahead");
    }
    let api = match cli.relays {
        0 => None,
        _ => {
            install_abort_trigger(&pool, &names.schema).await?;
            Some(start_api(&cli, &names, &topology).await?)
        }
    };
    let produce = match &api {
        None => None,
        Some(api) => Some(Produce::new(&cli, &plan, &topology, api.local_addr())?),
    };
    let mut consumers = Consumers::new(&cli, &names, binary);
    consumers.start_all()?;
    let mut relays = Consumers::relays(&cli, &names, relay_binary, seed);
    relays.start_all()?;
    let outcome = drive(
        &cli,
        &servers,
        &names,
        (&pool, &inbox),
        &plan,
        produce,
        &faults,
        &topology,
        &work_queues,
        (&mut consumers, &mut relays),
    )
    .await;
    if let Some(api) = api {
        api.stop().await;
    }
    relays.stop_all().await;
    consumers.stop_all().await;
    let (counts, drained, creations) = match outcome {
        Ok(done) => done,
        Err(error) => {
            eprintln!(
                "run aborted; schema {} and queues {} kept",
                names.schema, names.prefix
            );
            return Err(error);
        }
    };

    let mut verdict = Verdict::default();
    let (expected, mut not_committed) = match cli.relays {
        0 => (plan.valid_ids.clone(), HashSet::new()),
        _ => committed_creations(&pool, &names.schema, &plan).await?,
    };
    // The second hop's events exist only where a relay publishes them.
    let follow_ups = match cli.relays {
        0 => Vec::new(),
        _ => expected
            .iter()
            .map(|id| follow_up(*id))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let ghost_follow_ups = not_committed
        .iter()
        .map(|id| follow_up(*id))
        .collect::<Result<Vec<_>, _>>()?;
    not_committed.extend(ghost_follow_ups);
    if cli.relays > 0 {
        verdict.outbox_pending = inbox.pending_count().await?;
    }
    check_database(
        &pool,
        &inbox,
        &names.schema,
        (&expected, &follow_ups),
        &not_committed,
        &mut verdict,
    )
    .await?;
    check_dead_letters(&cli.amqp_url, &topology, &plan, &mut verdict).await?;
    if cli.layout == Layout::Partitioned {
        verdict.partitions = Some(partition_spread(&pool, &names.schema, cli.relays == 0).await?);
    }
    if !drained {
        verdict.note("the queues did not drain within --drain-timeout-secs".into());
    }
    let ok =
        verdict.ok() && drained && consumers.unexpected_exits == 0 && relays.unexpected_exits == 0;
    let relay_run = creations.map(|creations| RelayRun {
        creations,
        committed: expected.len() as u64,
        not_committed: (plan.valid_ids.len() - expected.len()) as u64,
        crash_points: relays.crash_points,
        unexpected_exits: relays.unexpected_exits,
    });
    let wall = started.elapsed();
    print!(
        "{}",
        table(
            &cli,
            seed,
            &plan,
            &counts,
            &verdict,
            expected.len() as u64,
            relay_run.as_ref(),
            consumers.unexpected_exits,
            drained,
            wall
        )
    );
    for detail in &verdict.details {
        println!("  {detail}");
    }
    println!(
        "RESULT: {} lost={} doubles={} stray={} inbox_mismatch={} dead_letter_missing={} valid_dead_lettered={} ghosts={} outbox_pending={} seed={seed}",
        if ok { "PASS" } else { "FAIL" },
        verdict.lost,
        verdict.doubles,
        verdict.stray,
        verdict.inbox_mismatch,
        verdict.dead_letter_missing + verdict.dead_letter_wrong_reason,
        verdict.valid_dead_lettered,
        verdict.ghosts,
        verdict.outbox_pending
    );

    if (ok && !cli.keep) || cli.always_clean {
        let _ = sqlx::query(&format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            names.schema
        ))
        .execute(&pool)
        .await;
        // Bounded (a run once sat 20 minutes in its final close after
        // deleting the topology, its verdict already printed).
        if let Err(error) = topology.remove(&cli.amqp_url).await {
            tracing::warn!(error = %chain(&error), "deleting the topology failed");
        }
        if !cli.keep {
            let _ = std::fs::remove_dir_all(&names.logs);
        }
    } else {
        println!(
            "kept: schema {}, queues {}*, logs {}",
            names.schema,
            names.prefix,
            names.logs.display()
        );
    }
    Ok(ok)
}

/// Publishes, injects the faults, and waits for the drain.
#[expect(clippy::too_many_arguments, reason = "one call site, the run's parts")]
async fn drive(
    cli: &Cli,
    servers: &Servers,
    names: &Names,
    (pool, inbox): (&PgPool, &SqlxStore),
    plan: &Plan,
    produce: Option<Produce>,
    faults: &[Fault],
    topology: &Topology,
    work_queues: &[String],
    (consumers, relays): (&mut Consumers<'_>, &mut Consumers<'_>),
) -> Result<(FaultCounts, bool, Option<Creations>), AppError> {
    let t0 = Instant::now();
    // With relays the harness publishes only the bad input; the valid
    // events are the producer's creations, which the relays publish.
    let direct: Vec<Outgoing> = plan
        .messages
        .iter()
        .filter(|(kind, _)| produce.is_none() || matches!(kind, Kind::Bad))
        .map(|(_, m)| m.clone())
        .collect();
    let mut publisher = tokio::spawn(publish_plan(
        cli.amqp_url.clone(),
        topology.clone(),
        direct,
        cli.publish_rate,
    ));
    let mut producer = produce.map(|produce| tokio::spawn(produce.run()));
    let mut creations: Option<Creations> = None;
    let mut published = false;
    let mut counts = FaultCounts::default();
    let mut next = 0;
    let mut frozen = false;
    // When the stopped PostgreSQL is to be started again.
    let mut pg_down: Option<Instant> = None;
    // RabbitMQ restarts due before everything was published, and when the
    // stopped RabbitMQ is to be started again.
    let mut rabbit_held = 0;
    let mut rabbit_down: Option<Instant> = None;
    while !published
        || producer.is_some()
        || next < faults.len()
        || frozen
        || pg_down.is_some()
        || rabbit_held > 0
        || rabbit_down.is_some()
    {
        consumers.supervise()?;
        relays.supervise()?;
        frozen = consumers.thaw(false).await;
        if producer
            .as_ref()
            .is_some_and(tokio::task::JoinHandle::is_finished)
            && let Some(done) = producer.take()
        {
            let done = done
                .await
                .map_err(|e| AppError::Unavailable(format!("the producer failed: {e}")))??;
            tracing::info!(elapsed = ?t0.elapsed(), ?done, "every creation requested");
            creations = Some(done);
        }
        if let (Some(until), Some(postgres)) = (pg_down, &servers.postgres)
            && until <= Instant::now()
        {
            tokio::task::block_in_place(|| postgres.resume());
            pg_down = None;
            tracing::info!(at = ?t0.elapsed(), "PostgreSQL started again");
        }
        if let Some(rabbit) = &servers.rabbit {
            if rabbit_down.is_some_and(|until| until <= Instant::now()) {
                tokio::task::block_in_place(|| rabbit.ctl("start_app"));
                rabbit.up().await;
                rabbit_down = None;
                tracing::info!(at = ?t0.elapsed(), "RabbitMQ started again (start_app)");
            } else if published && producer.is_none() && rabbit_held > 0 && rabbit_down.is_none() {
                rabbit_held -= 1;
                tokio::task::block_in_place(|| rabbit.ctl("stop_app"));
                rabbit_down = Some(Instant::now() + Duration::from_secs(cli.rabbit_down_secs));
                counts.rabbit_restarts += 1;
                tracing::info!(at = ?t0.elapsed(), "RabbitMQ stopped (stop_app)");
            }
        }
        if !published && publisher.is_finished() {
            match (&mut publisher).await {
                Ok(Ok(())) => {
                    published = true;
                    tracing::info!(elapsed = ?t0.elapsed(), "everything published (confirmed)");
                }
                Ok(Err(error)) => return Err(error),
                Err(error) => {
                    return Err(AppError::Unavailable(format!("publisher failed: {error}")));
                }
            }
        }
        while next < faults.len() && faults[next].at <= t0.elapsed() {
            let fault = &faults[next];
            next += 1;
            let k = fault.target;
            match fault.kind {
                FaultKind::Kill => {
                    consumers.kill_and_restart(k).await?;
                    counts.kills += 1;
                    tracing::info!(consumer = k, at = ?t0.elapsed(), "kill -9 and restart");
                }
                FaultKind::Postgres if pg_down.is_some() => {
                    counts.pg_kills_missed += 1;
                }
                FaultKind::Postgres => {
                    let n = terminate_backends(pool, &names.application_name(k)).await?;
                    counts.pg_kills += 1;
                    counts.pg_backends += n;
                    tracing::info!(consumer = k, backends = n, at = ?t0.elapsed(), "pg_terminate_backend");
                }
                FaultKind::Amqp => {
                    let closed = rabbit_down.is_none()
                        && consumers.close_connection(k, servers.rabbit_node()).await?;
                    if closed {
                        counts.amqp_kills += 1;
                    } else {
                        counts.amqp_missed += 1;
                    }
                    tracing::info!(consumer = k, closed, at = ?t0.elapsed(), "rabbitmqctl close_connection");
                }
                FaultKind::PostgresRestart => match &servers.postgres {
                    Some(postgres) if pg_down.is_none() => {
                        tokio::task::block_in_place(|| postgres.halt());
                        pg_down = Some(Instant::now() + Duration::from_secs(cli.pg_down_secs));
                        counts.pg_restarts += 1;
                        tracing::info!(at = ?t0.elapsed(), "PostgreSQL stopped (pg_ctl stop -m fast)");
                    }
                    _ => counts.pg_restarts_missed += 1,
                },
                FaultKind::RabbitRestart if servers.rabbit.is_some() => rabbit_held += 1,
                FaultKind::RabbitRestart => counts.rabbit_restarts_missed += 1,
                FaultKind::RelayKill => {
                    relays.kill_and_restart(k).await?;
                    counts.relay_kills += 1;
                    tracing::info!(relay = k, at = ?t0.elapsed(), "kill -9 and restart");
                }
                FaultKind::RelayPostgres | FaultKind::ProducerPostgres if pg_down.is_some() => {
                    counts.relay_pg_missed += 1;
                }
                FaultKind::RelayPostgres => {
                    let n = terminate_backends(pool, &relays.application_name(k)).await?;
                    counts.relay_pg_kills += 1;
                    counts.relay_pg_backends += n;
                    tracing::info!(relay = k, backends = n, at = ?t0.elapsed(), "pg_terminate_backend");
                }
                FaultKind::ProducerPostgres => {
                    let n = terminate_backends(pool, &names.producer_application_name()).await?;
                    counts.producer_pg_kills += 1;
                    counts.producer_pg_backends += n;
                    tracing::info!(backends = n, at = ?t0.elapsed(), "producer pg_terminate_backend");
                }
                FaultKind::RelayAmqp => {
                    let closed = rabbit_down.is_none()
                        && relays.close_connection(k, servers.rabbit_node()).await?;
                    if closed {
                        counts.relay_amqp_kills += 1;
                    } else {
                        counts.relay_amqp_missed += 1;
                    }
                    tracing::info!(relay = k, closed, at = ?t0.elapsed(), "rabbitmqctl close_connection");
                }
                FaultKind::Freeze => {
                    let until = Instant::now() + Duration::from_secs(cli.freeze_secs);
                    if consumers.freeze(k, until).await {
                        counts.freezes += 1;
                        frozen = true;
                    } else {
                        counts.freezes_missed += 1;
                    }
                    tracing::info!(consumer = k, at = ?t0.elapsed(), "SIGSTOP");
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    tracing::info!("publishing and faults done; waiting for the queues to drain");
    let deadline = Instant::now() + Duration::from_secs(cli.drain_timeout_secs);
    let mut quiet_rounds = 0;
    while Instant::now() < deadline {
        consumers.supervise()?;
        relays.supervise()?;
        let depths = queue_depths(servers.rabbit_node(), work_queues).await?;
        let pending = undispatched(pool, &names.schema).await?;
        let outbox = match creations {
            Some(_) => inbox.pending_count().await?,
            None => 0,
        };
        if depths.iter().all(|d| *d == 0) && pending == 0 && outbox == 0 {
            quiet_rounds += 1;
            // Twice in a row, a second apart: nothing in flight anywhere.
            if quiet_rounds >= 2 {
                return Ok((counts, true, creations));
            }
        } else {
            quiet_rounds = 0;
            tracing::info!(
                ?depths,
                undispatched = pending,
                outbox_pending = outbox,
                "draining"
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Ok((counts, false, creations))
}

#[expect(clippy::too_many_arguments, reason = "the table's inputs")]
fn table(
    cli: &Cli,
    seed: u64,
    plan: &Plan,
    counts: &FaultCounts,
    v: &Verdict,
    expected: u64,
    relay_run: Option<&RelayRun>,
    unexpected_exits: usize,
    drained: bool,
    wall: Duration,
) -> String {
    let valid = expected;
    let pairs = v.expected_inbox_rows;
    let bad = plan.bad.len() as u64;
    let mark = |ok: bool| if ok { "ok" } else { "VIOLATION" };
    let mut rows: Vec<(String, String, String, &str)> = vec![
        (
            "sent".into(),
            plan.messages.len().to_string(),
            String::new(),
            "",
        ),
        (
            "  valid events".into(),
            valid.to_string(),
            String::new(),
            "",
        ),
        (
            "  duplicates (same id+body)".into(),
            format!("{} ({} back-to-back)", plan.copies, plan.back_to_back),
            String::new(),
            "",
        ),
        (
            "  bad (6 classes)".into(),
            bad.to_string(),
            String::new(),
            "",
        ),
        (
            "kills (kill -9 + restart)".into(),
            counts.kills.to_string(),
            String::new(),
            "",
        ),
        (
            "pg kills (terminate_backend)".into(),
            if counts.pg_kills_missed == 0 {
                format!("{} ({} backends)", counts.pg_kills, counts.pg_backends)
            } else {
                format!(
                    "{} ({} b., {} while down)",
                    counts.pg_kills, counts.pg_backends, counts.pg_kills_missed
                )
            },
            String::new(),
            "",
        ),
        (
            format!("pg restarts (down {} s)", cli.pg_down_secs),
            format!(
                "{} ({} while down)",
                counts.pg_restarts, counts.pg_restarts_missed
            ),
            String::new(),
            "",
        ),
        (
            format!("rabbit restarts (down {} s)", cli.rabbit_down_secs),
            format!(
                "{} ({} not run)",
                counts.rabbit_restarts, counts.rabbit_restarts_missed
            ),
            String::new(),
            "",
        ),
        (
            "amqp kills (close_connection)".into(),
            format!(
                "{} ({} not connected)",
                counts.amqp_kills, counts.amqp_missed
            ),
            String::new(),
            "",
        ),
        (
            format!("freezes (SIGSTOP, {} s)", cli.freeze_secs),
            format!(
                "{} ({} already frozen)",
                counts.freezes, counts.freezes_missed
            ),
            String::new(),
            "",
        ),
    ];
    // A row that only reports, and one whose value must be zero.
    let fact = |name: &str, value: String| (name.to_owned(), value, String::new(), "");
    let zero = |name: &str, n: u64| (name.to_owned(), n.to_string(), "0".to_owned(), mark(n == 0));
    if let Some(r) = relay_run {
        rows.extend([
            fact("creations requested", plan.valid_ids.len().to_string()),
            fact("  committed (parcels rows)", r.committed.to_string()),
            fact(
                "  not committed",
                format!(
                    "{} ({} planned aborts)",
                    r.not_committed,
                    plan.aborted.len()
                ),
            ),
            fact(
                "  answers (201 / other / none)",
                format!(
                    "{} / {} / {}",
                    r.creations.created, r.creations.refused, r.creations.failed
                ),
            ),
            fact(
                "relay kills (kill -9 + restart)",
                counts.relay_kills.to_string(),
            ),
            fact("relay crash points hit", r.crash_points.to_string()),
            fact(
                "relay pg kills",
                format!(
                    "{} ({} b., {} while down)",
                    counts.relay_pg_kills, counts.relay_pg_backends, counts.relay_pg_missed
                ),
            ),
            fact(
                "relay amqp kills",
                format!(
                    "{} ({} not connected)",
                    counts.relay_amqp_kills, counts.relay_amqp_missed
                ),
            ),
            fact(
                "producer pg kills",
                format!(
                    "{} ({} backends)",
                    counts.producer_pg_kills, counts.producer_pg_backends
                ),
            ),
            (
                "carrier-assigned consumed".into(),
                v.carrier_assigned_consumed.to_string(),
                r.committed.to_string(),
                mark(v.carrier_assigned_consumed == r.committed),
            ),
            zero("ghost effects (not committed)", v.ghosts),
            zero("outbox pending at the end", v.outbox_pending),
            zero("relay crashes", r.unexpected_exits as u64),
        ]);
    }
    rows.extend([
        (
            "effects".into(),
            v.effects.to_string(),
            v.expected_effects.to_string(),
            mark(v.effects == v.expected_effects),
        ),
        zero("doubles", v.doubles),
        zero("lost", v.lost),
        zero("stray effects", v.stray),
        (
            "inbox rows".into(),
            v.inbox_rows.to_string(),
            pairs.to_string(),
            mark(v.inbox_rows == pairs && v.inbox_mismatch == 0),
        ),
        (
            "  in day partitions / untimed".into(),
            v.partitions.map_or_else(
                || "(table layout)".to_owned(),
                |p| format!("{} in {} days / {}", p.timed, p.days, p.untimed),
            ),
            String::new(),
            mark(v.partitions.is_none_or(|p| p.exercised())),
        ),
        (
            "carrier bookings".into(),
            v.bookings.to_string(),
            valid.to_string(),
            mark(v.bookings == valid),
        ),
        (
            "notifications sent".into(),
            v.notified.to_string(),
            valid.to_string(),
            mark(v.notified == valid),
        ),
        (
            "downstream calls (deduped)".into(),
            v.ledger_calls.to_string(),
            String::new(),
            "",
        ),
        (
            "dead-lettered".into(),
            v.dead_lettered.to_string(),
            format!(">= {}", 2 * bad),
            mark(
                v.dead_letter_missing == 0
                    && v.dead_letter_wrong_reason == 0
                    && v.valid_dead_lettered == 0,
            ),
        ),
        zero("valid dead-lettered", v.valid_dead_lettered),
        (
            "consumer crashes".into(),
            unexpected_exits.to_string(),
            "0".into(),
            mark(unexpected_exits == 0),
        ),
        (
            "drained".into(),
            drained.to_string(),
            "true".into(),
            mark(drained),
        ),
        (
            "wall time".into(),
            format!("{:.1?}", wall),
            String::new(),
            "",
        ),
    ]);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nparcel-chaos summary: seed {seed}, store {}, layout {}, {} consumers, {} relays, broken {}, broken relay {}",
        cli.store,
        cli.layout,
        cli.consumers,
        cli.relays,
        cli.broken.as_deref().unwrap_or("no"),
        cli.broken_relay.as_deref().unwrap_or("no")
    );
    let _ = writeln!(
        out,
        "| {:<31} | {:>24} | {:>10} | {:<9} |",
        "", "value", "expected", ""
    );
    let _ = writeln!(out, "|{:-<33}|{:-<26}|{:-<12}|{:-<11}|", "", "", "", "");
    for (name, value, expected, ok) in rows {
        let _ = writeln!(
            out,
            "| {name:<31} | {value:>24} | {expected:>10} | {ok:<9} |"
        );
    }
    out
}
