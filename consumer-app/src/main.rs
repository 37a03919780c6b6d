//! `parcel-inbox`: the Parcel Tracking service's command line.

use std::num::NonZeroU32;
use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use consumer_app::parcel::store::{ParcelStore, StoreKind};
use consumer_app::tools::broker::BrokerChoice;
use consumer_app::tools::cli::{
    ApiArgs, CleanupArgs, ConsumeArgs, Global, Idle, OutboxPurgeArgs, Plain, RelayArgs, Uses,
    WorkerArgs, refuse_idle, run_main,
};
use consumer_app::tools::dead::{
    ListDead, ListDeadOutgoing, RequeueDeadOutgoing, replay_dead_letters, role_of,
};
use consumer_app::tools::demo::{self, DemoConfig};
use consumer_app::tools::publish::{Plan, publish_with};
use consumer_app::tools::stores::{WithOutbox, WithStore, with_outbox, with_store};
use futures::stream::BoxStream;
use inbox_api::{ConsumerName, MessageId, OutboxStore};
use inbox_postgres::Layout;
use inbox_runtime::brokers::BrokerKind;
use inbox_runtime::redact::redact_url;
use inbox_runtime::relay::purge_published_once;
use inbox_runtime::service::cleanup_once;
use inbox_runtime::{AppError, CleanupConfig};

/// Parcel Tracking: RabbitMQ consumers with exactly-once effects through the inbox.
// No Debug: the URLs may hold passwords.
#[derive(Parser)]
#[command(name = "parcel-inbox", version, about)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the schema, the inbox table and the app's tables (idempotent).
    Migrate,
    /// Run both consumers until SIGINT/SIGTERM.
    Consume(ConsumeArgs),
    /// Publish the outbox's committed messages (publisher confirms, each under its own
    /// message id on every attempt) until SIGINT/SIGTERM; several may run at once.
    Relay(RelayArgs),
    /// Serve POST /parcels (the parcel and its parcel.created event in one
    /// transaction), GET /parcels/{id}, /metrics, /live and /ready, with an
    /// outbox relay in the same process unless --no-relay; until SIGINT/SIGTERM.
    Api(ApiArgs),
    /// Publish parcel events (with copies reusing message ids), with publisher confirms.
    Publish {
        /// Distinct events.
        #[arg(long, default_value_t = 100)]
        count: usize,
        /// Copies per event on average (0.1 = one copy per ten events).
        #[arg(long, default_value_t = 0.1)]
        duplicate_rate: f64,
        /// Seed of the copies' choice and placement.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Do not show progress.
        #[arg(long)]
        quiet: bool,
    },
    /// Delete processed inbox rows older than the inbox's retention and published outbox
    /// rows older than the outbox's, once, and print the counts.
    Cleanup {
        #[command(flatten)]
        cleanup: CleanupArgs,
        #[command(flatten)]
        purge: OutboxPurgeArgs,
    },
    /// The partitioned inbox layout's maintenance (run it daily): create the
    /// missing day partitions from today (UTC) to --ahead days after it (never
    /// a past day: a dropped day stays gone), then list every partition with
    /// its bounds and estimated rows. Needs --layout partitioned.
    Partitions {
        /// Days after today to create.
        #[arg(long, default_value_t = inbox_postgres::DAYS_AHEAD)]
        ahead: u16,
    },
    /// Print inbox rows, per-consumer counts, effects and double effects.
    Stats,
    /// List dead-lettered messages (from the store's attempt ledger), newest first:
    /// consumer, message id, attempts, reason, when, last error.
    Dead {
        /// Only this consumer's (parcel-notification or parcel-carrier-assignment).
        #[arg(long)]
        consumer: Option<String>,
        /// At most this many rows.
        #[arg(long, default_value = "100")]
        limit: NonZeroU32,
    },
    /// Move dead letters of a consumer back to its queue, after the fix: each is
    /// processed at most once, with a fresh retry budget.
    Replay {
        /// Whose dead-letter queue (parcel-notification or parcel-carrier-assignment).
        #[arg(long)]
        consumer: String,
        /// Only these message ids (repeatable); without it, --all is required.
        #[arg(long = "message-id", required_unless_present = "all")]
        message_ids: Vec<String>,
        /// Every message in the dead-letter queue.
        #[arg(long, conflicts_with = "message_ids")]
        all: bool,
    },
    /// List outgoing messages dead in the outbox (the broker refused each of them
    /// --max-publish-attempts times), newest first: message id, exchange, routing key,
    /// refusals, when, last error.
    OutboxDead {
        /// At most this many rows.
        #[arg(long, default_value = "100")]
        limit: NonZeroU32,
    },
    /// Make dead outgoing messages pending again, after the fix, each with a fresh count:
    /// the relay publishes them under their ids.
    OutboxRequeue {
        /// Only these message ids (repeatable); without it, --all is required.
        #[arg(long = "message-id", required_unless_present = "all")]
        message_ids: Vec<String>,
        /// Every dead outgoing message.
        #[arg(long, conflicts_with = "message_ids")]
        all: bool,
    },
    /// Run the full loop in process (POST /parcels over HTTP, the relay, three consumers),
    /// with client retries, message copies and a crash per hop, and prove exactly-once effects,
    /// on RabbitMQ (--amqp-url) or, with --broker nats, on NATS JetStream (--nats-url).
    Demo {
        /// The broker to run it on: rabbitmq (at --amqp-url) or nats (NATS JetStream, at
        /// --nats-url; a copy JetStream drops as a duplicate is counted as the broker's).
        #[arg(long, env = "PARCEL_BROKER", value_enum, default_value_t)]
        broker: BrokerChoice,
        /// NATS URL (nats:// or tls://), for --broker nats.
        #[arg(
            long,
            env = "NATS_URL",
            hide_env_values = true,
            default_value = "nats://127.0.0.1:4222"
        )]
        nats_url: String,
        /// Distinct events.
        #[arg(long, default_value_t = 200)]
        events: usize,
        /// Copies per event on average.
        #[arg(long, default_value_t = 0.25)]
        duplicate_rate: f64,
        /// Keep the demo's schema and queues afterwards.
        #[arg(long)]
        keep: bool,
        /// Seconds to wait for the queues to drain.
        #[arg(long, default_value_t = 120)]
        drain_timeout_secs: u64,
        #[command(flatten)]
        worker: WorkerArgs,
    },
}

/// Connection attempts of a one-shot command.
const ONE_SHOT: Option<u32> = Some(1);

impl Command {
    /// The flags given to this command that would have no effect on it
    /// (see [`refuse_idle`]): the global ones by what the command uses,
    /// then its own.
    fn idle(&self, global: &Global) -> Vec<Idle> {
        let store = Uses {
            store: true,
            schema: true,
            ..Uses::default()
        };
        let broker = Uses {
            broker: true,
            names: true,
            ..Uses::default()
        };
        let (uses, own) = match self {
            Command::Migrate => (
                Uses {
                    command: "migrate",
                    ..store
                },
                Vec::new(),
            ),
            Command::Stats => (
                Uses {
                    command: "stats",
                    ..store
                },
                Vec::new(),
            ),
            Command::Partitions { .. } => (
                Uses {
                    command: "partitions",
                    ..store
                },
                Vec::new(),
            ),
            Command::Dead { .. } => (
                Uses {
                    command: "dead",
                    ..store
                },
                Vec::new(),
            ),
            Command::OutboxDead { .. } => (
                Uses {
                    command: "outbox-dead",
                    ..store
                },
                Vec::new(),
            ),
            Command::OutboxRequeue { .. } => (
                Uses {
                    command: "outbox-requeue",
                    ..store
                },
                Vec::new(),
            ),
            Command::Cleanup { .. } => (
                Uses {
                    command: "cleanup",
                    ..store
                },
                Vec::new(),
            ),
            Command::Replay { .. } => (
                Uses {
                    command: "replay",
                    ..broker
                },
                Vec::new(),
            ),
            Command::Publish { .. } => (
                Uses {
                    command: "publish",
                    queues: true,
                    ..broker
                },
                Vec::new(),
            ),
            Command::Consume(args) => (
                Uses {
                    command: "consume",
                    store: true,
                    schema: true,
                    broker: true,
                    names: true,
                    queues: true,
                },
                args.idle(),
            ),
            Command::Relay(args) => (
                Uses {
                    command: "relay",
                    store: true,
                    schema: true,
                    ..broker
                },
                args.settings.idle(),
            ),
            // The exchange's name goes into every outbox row, relay or not.
            Command::Api(args) => (
                Uses {
                    command: if args.no_relay {
                        "api --no-relay"
                    } else {
                        "api"
                    },
                    store: true,
                    schema: true,
                    broker: !args.no_relay,
                    names: true,
                    queues: false,
                },
                args.idle(),
            ),
            // A fresh schema and topology of its own per run.
            Command::Demo { worker, broker, .. } => {
                let mut own = worker.idle();
                own.push(match broker {
                    BrokerChoice::RabbitMq => Idle::new(
                        &["nats_url"],
                        "`demo` runs on RabbitMQ (--amqp-url) unless --broker nats",
                    ),
                    BrokerChoice::Nats => Idle::new(
                        &[
                            "amqp_url",
                            "amqp_connect_timeout_secs",
                            "amqp_heartbeat_secs",
                        ],
                        "`demo --broker nats` does not connect to RabbitMQ",
                    ),
                });
                (
                    Uses {
                        command: "demo",
                        store: true,
                        broker: true,
                        ..Uses::default()
                    },
                    own,
                )
            }
        };
        let mut idle = global.idle(uses);
        idle.extend(own);
        idle
    }
}

fn main() -> ExitCode {
    let mut command = Cli::command();
    let matches = command.get_matches_mut();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut command).exit());
    if let Some((_, given)) = matches.subcommand()
        && let Err(refused) = refuse_idle(given, &cli.command.idle(&cli.global))
    {
        refused.format(&mut command).exit();
    }
    run_main(cli.global.log_format, run(cli))
}

/// The demo's check failing is an error of the command, not of the runtime,
/// so only the demo's arm speaks [`consumer_app::Error`].
async fn run(cli: Cli) -> Result<(), consumer_app::Error> {
    let Cli { global, command } = cli;
    tracing::info!(store = %global.store, database = %redact_url(&global.database_url),
        amqp = %redact_url(&global.amqp_url), schema = %global.schema, prefix = %global.prefix,
        "parcel-inbox starting");
    match command {
        Command::Demo {
            broker,
            nats_url,
            events,
            duplicate_rate,
            keep,
            drain_timeout_secs,
            worker,
        } => {
            let (flag, broker_url) = match broker {
                BrokerChoice::RabbitMq => ("--amqp-url", global.amqp_url.clone()),
                BrokerChoice::Nats => ("--nats-url", nats_url),
            };
            // `--broker` says which broker; a URL of the other would run the
            // demo somewhere the user did not ask for.
            if BrokerKind::of(&broker_url)? != broker.kind() {
                return Err(AppError::Config(format!(
                    "{flag} {} is not a {} URL (--broker {})",
                    redact_url(&broker_url),
                    broker.kind().name(),
                    broker.name()
                ))
                .into());
            }
            let summary = demo::run(DemoConfig {
                store: global.store(),
                broker_url,
                events,
                duplicate_rate,
                keep,
                worker: worker.config(),
                drain_timeout: Duration::from_secs(drain_timeout_secs),
            })
            .await?;
            println!("{summary}");
            Ok(())
        }
        command => Ok(run_command(Cli { global, command }).await?),
    }
}

async fn run_command(cli: Cli) -> Result<(), AppError> {
    let global = cli.global;
    let store = global.store();
    // One-shot commands try the database once: whoever runs them is waiting
    // for an answer, and a wrong URL should say so in seconds, with its cause.
    // Only the services, `consume` and `relay`, wait for their database to
    // come up.
    match cli.command {
        // `run` takes it before it gets here.
        Command::Demo { .. } => Err(AppError::Config("the demo is run by `run`".into())),
        Command::Migrate => with_store(&store, ONE_SHOT, Migrate).await,
        Command::Stats => with_store(&store, ONE_SHOT, PrintStats).await,
        Command::Partitions { ahead } => {
            if global.store == StoreKind::Memory {
                return Err(AppError::Config(
                    "`partitions` needs a PostgreSQL store: the memory store has no partitions"
                        .into(),
                ));
            }
            if global.layout != Layout::Partitioned {
                return Err(AppError::Config(format!(
                    "`partitions` needs the partitioned inbox layout: the {} layout has no \
                     partitions (cleanup deletes its rows). For a schema migrated with \
                     --layout partitioned, pass --layout partitioned (or INBOX_LAYOUT=partitioned)",
                    global.layout
                )));
            }
            with_store(&store, ONE_SHOT, MaintainPartitions { ahead }).await
        }
        Command::Dead { consumer, limit } => {
            let consumer = consumer.map(ConsumerName::new).transpose()?;
            with_store(&store, ONE_SHOT, ListDead { consumer, limit }).await
        }
        Command::Replay {
            consumer,
            message_ids,
            all: _,
        } => {
            let role = role_of(&consumer)?;
            let topology = global.topology();
            let replayed = replay_dead_letters(
                &global.amqp_url,
                global.amqp_connection(),
                &topology,
                role,
                &message_ids,
            )
            .await?;
            println!(
                "replayed {} message(s) from {} to {}; {} left in the dead-letter queue",
                replayed.moved,
                topology.dead_letter_queue(role),
                topology.queue(role),
                replayed.kept
            );
            Ok(())
        }
        Command::OutboxDead { limit } => {
            with_outbox(&store, ONE_SHOT, ListDeadOutgoing { limit }).await
        }
        Command::OutboxRequeue {
            message_ids,
            all: _,
        } => {
            let ids = message_ids
                .iter()
                .map(|id| MessageId::parse(id))
                .collect::<Result<Vec<_>, _>>()?;
            with_outbox(&store, ONE_SHOT, RequeueDeadOutgoing { ids }).await
        }
        Command::Cleanup { cleanup, purge } => {
            let (config, purge) = (
                cleanup.config(Duration::ZERO)?,
                purge.config(Duration::ZERO)?,
            );
            with_store(&store, ONE_SHOT, CleanupOnce(config)).await?;
            with_outbox(&store, ONE_SHOT, PurgeOnce(purge)).await
        }
        Command::Publish {
            count,
            duplicate_rate,
            seed,
            quiet,
        } => {
            let plan = Plan::new(count, duplicate_rate, seed, "P")?;
            publish_with(
                &global.amqp_url,
                global.amqp_connection(),
                &global.topology(),
                &plan.messages,
                !quiet,
            )
            .await?;
            println!(
                "published {} messages ({} distinct events, {} copies) to {}",
                plan.messages.len(),
                plan.ids.len(),
                plan.copies,
                global.topology().exchange()
            );
            Ok(())
        }
        Command::Consume(args) => {
            let consume = args.consume(&global, Plain)?;
            with_store(&store, None, consume).await
        }
        Command::Api(args) => {
            let api = args.api(&global)?;
            with_store(&store, None, api).await
        }
        Command::Relay(args) => {
            let relay = args.relay(&global)?;
            with_outbox(&store, None, relay).await
        }
    }
}

struct Migrate;

impl WithStore for Migrate {
    type Output = ();

    async fn run<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        store.migrate_all().await?;
        println!("migrated ({} store)", store.kind());
        Ok(())
    }
}

struct PrintStats;

impl WithStore for PrintStats {
    type Output = ();

    async fn run<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        let stats = store.stats().await?;
        if store.kind() == StoreKind::Memory {
            println!("(memory store: a fresh, empty store in this process)");
        }
        print!("{stats}");
        Ok(())
    }
}

struct MaintainPartitions {
    ahead: u16,
}

impl WithStore for MaintainPartitions {
    type Output = ();

    async fn run<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        // Listed first: a schema of the other layout, or not migrated, is
        // refused with its cause before anything is created.
        store.partitions().await?;
        let created = store.create_partitions(self.ahead).await?;
        println!(
            "created {created} day partition(s); the days from today to {} day(s) ahead (UTC) exist",
            self.ahead
        );
        let partitions = store.partitions().await?;
        println!(
            "{:<26} {:<10} {:>14}  bounds",
            "partition", "day (UTC)", "estimated rows"
        );
        for partition in &partitions {
            println!(
                "{:<26} {:<10} {:>14}  {}",
                partition.name,
                partition
                    .day
                    .map_or_else(|| "untimed".to_owned(), |day| day.to_string()),
                partition
                    .estimated_rows
                    .map_or_else(|| "not analyzed".to_owned(), |rows| rows.to_string()),
                partition.bounds
            );
        }
        println!("{} partition(s)", partitions.len());
        Ok(())
    }
}

struct CleanupOnce(CleanupConfig);

impl WithStore for CleanupOnce {
    type Output = ();

    async fn run<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        let days = self.0.retention.as_secs_f64() / 86_400.0;
        let cutoff = self.0.cutoff()?;
        // The days first, so that the purge's count is rows deleted one by
        // one, not whole days' rows as well; named from the listing before.
        let expiring: Vec<String> = match store.partitions().await {
            Ok(partitions) => partitions
                .iter()
                .filter_map(|p| {
                    p.day
                        .filter(|day| inbox_postgres::day_expired(*day, cutoff))
                })
                .map(|day| day.to_string())
                .collect(),
            Err(_) => Vec::new(),
        };
        let dropped = store.drop_expired_days(cutoff).await?;
        let deleted = cleanup_once(&store, &self.0).await?;
        if let Some(rows) = dropped {
            println!(
                "dropped {} day partition(s) older than {days:.1} days ({}) holding {rows} inbox rows \
                 (the planner's estimate for a day over 8 MiB)",
                expiring.len(),
                expiring.join(", ")
            );
        }
        println!("deleted {deleted} processed inbox rows older than {days:.1} days");
        Ok(())
    }
}

struct PurgeOnce(CleanupConfig);

impl WithOutbox for PurgeOnce {
    type Output = ();

    async fn run<S: OutboxStore + Clone + 'static>(
        self,
        store: S,
        _wakeups: Option<BoxStream<'static, ()>>,
    ) -> Result<(), AppError> {
        let deleted = purge_published_once(&store, &self.0).await?;
        println!(
            "deleted {deleted} published outbox rows older than {:.1} hours",
            self.0.retention.as_secs_f64() / 3600.0
        );
        Ok(())
    }

    fn listens(&self) -> bool {
        false
    }
}
