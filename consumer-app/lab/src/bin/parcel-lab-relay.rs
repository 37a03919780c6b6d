//! `parcel-lab-relay`: `parcel-inbox relay` with crash points, for the
//! chaos harness.
//!
//! The same flags as `parcel-inbox [global flags] relay [flags]` (without
//! the word `relay`), plus what the production binary does not have:
//! `--fault-crash-after-take <p>` and `--fault-crash-before-mark <p>` (the
//! probability, per round, of exiting on the spot right after a batch was
//! taken, or right after its confirms and before its mark), seeded by
//! `--fault-seed`, and `--fault-broken-relay mark-before-confirm` (mark a
//! batch published as soon as it is taken, so that the harness can show it
//! catches a relay that loses messages). A crash point exits with status
//! 86 ([`parcel_lab::relay_faults::CRASH_EXIT`]).

use std::process::ExitCode;

use clap::Parser;
use consumer_app::tools::cli::{Global, RelayArgs, RelayCommand, run_main};
use consumer_app::tools::stores::{WithOutbox, with_outbox};
use futures::stream::BoxStream;
use inbox_api::OutboxStore;
use inbox_runtime::AppError;
use parcel_lab::broken::BrokenRelay;
use parcel_lab::relay_faults::{CrashPoints, FaultyOutbox};

/// `parcel-inbox relay` with crash points (test tool).
// No Debug: the URLs may hold passwords.
#[derive(Parser)]
#[command(name = "parcel-lab-relay", version, about)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(flatten)]
    relay: RelayArgs,
    /// Probability, per taken batch, of exiting right after the take.
    #[arg(long, default_value_t = 0.0)]
    fault_crash_after_take: f64,
    /// Probability, per mark, of exiting right before it (after the confirms).
    #[arg(long, default_value_t = 0.0)]
    fault_crash_before_mark: f64,
    /// Seed of the crash points.
    #[arg(long, default_value_t = 1)]
    fault_seed: u64,
    /// Run a deliberately broken relay (mark-before-confirm).
    #[arg(long)]
    fault_broken_relay: Option<String>,
}

/// The relay command on the store with crash points.
struct WithCrashPoints {
    relay: RelayCommand,
    points: CrashPoints,
    broken: Option<BrokenRelay>,
}

impl WithOutbox for WithCrashPoints {
    type Output = ();

    async fn run<S: OutboxStore + Clone + 'static>(
        self,
        store: S,
        wakeups: Option<BoxStream<'static, ()>>,
    ) -> Result<(), AppError> {
        if let Some(broken) = self.broken {
            tracing::warn!(
                broken = broken.name(),
                "running a DELIBERATELY BROKEN relay (fault injection)"
            );
        }
        let store = FaultyOutbox::new(store, self.points, self.broken);
        self.relay.run(store, wakeups).await
    }
}

async fn run(cli: Cli) -> Result<(), AppError> {
    let broken = cli
        .fault_broken_relay
        .as_deref()
        .map(BrokenRelay::parse)
        .transpose()?;
    if broken == Some(BrokenRelay::PublishBeforeCommit) {
        return Err(AppError::Config(
            "publish-before-commit is the producer's fault: pass it to parcel-chaos".into(),
        ));
    }
    let task = WithCrashPoints {
        relay: cli.relay.relay(&cli.global)?,
        points: CrashPoints {
            after_take: cli.fault_crash_after_take,
            before_mark: cli.fault_crash_before_mark,
            seed: cli.fault_seed,
        },
        broken,
    };
    with_outbox(&cli.global.store(), None, task).await
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    run_main(cli.global.log_format, run(cli))
}
