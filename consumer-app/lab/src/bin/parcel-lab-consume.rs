//! `parcel-lab-consume`: `parcel-inbox consume` with fault injection, for
//! the chaos harness.
//!
//! The same flags as `parcel-inbox [global flags] consume [flags]` (without
//! the word `consume`), plus two the production binary does not have:
//! `--fault-work-delay-ms` (time each transaction holds after its writes,
//! so that a kill lands mid-work) and `--fault-broken-store <kind>` (run on
//! one of the conformance suite's deliberately broken stores, so that the
//! harness can show it catches a broken inbox).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use consumer_app::parcel::downstream::Downstreams;
use consumer_app::parcel::store::ParcelStore;
use consumer_app::parcel::topology::Topology;
use consumer_app::tools::cli::{Consume, ConsumeArgs, Global, Spawner, run_main};
use consumer_app::tools::faults::Faults;
use consumer_app::tools::stores::{WithStore, with_store};
use inbox_conformance::broken::Broken;
use inbox_runtime::{AppError, ServiceConfig, ServiceHandle};
use parcel_lab::broken::{self, BrokenParcelStore};

/// `parcel-inbox consume` with fault injection (test tool).
// No Debug: the URLs may hold passwords.
#[derive(Parser)]
#[command(name = "parcel-lab-consume", version, about)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(flatten)]
    consume: ConsumeArgs,
    /// Time spent inside each transaction after the writes.
    #[arg(long, default_value_t = 0)]
    fault_work_delay_ms: u64,
    /// Run on one of the conformance suite's deliberately broken stores
    /// (claim-in-own-transaction, check-then-insert, work-before-claim,
    /// claim-without-waiting).
    #[arg(long)]
    fault_broken_store: Option<String>,
}

/// Starts the service with both consumers wrapped in the faults.
struct WithFaults(Arc<Faults>);

impl Spawner for WithFaults {
    fn spawn<S: ParcelStore>(
        &self,
        store: S,
        config: ServiceConfig,
        topology: &Topology,
        downstreams: Downstreams,
    ) -> Result<ServiceHandle, AppError> {
        self.0.spawn(store, config, topology, downstreams)
    }
}

/// The consume path on the store broken the way `kind` says.
struct OnBroken {
    consume: Consume<WithFaults>,
    kind: Broken,
}

impl WithStore for OnBroken {
    type Output = ();

    async fn run<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        tracing::warn!(broken = ?self.kind, "running on a DELIBERATELY BROKEN inbox store (fault injection)");
        self.consume
            .serve(BrokenParcelStore::new(store, self.kind))
            .await
    }
}

async fn run(cli: Cli) -> Result<(), AppError> {
    let faults = Arc::new(Faults::with_work_delay(Duration::from_millis(
        cli.fault_work_delay_ms,
    )));
    let consume = cli.consume.consume(&cli.global, WithFaults(faults))?;
    let store = cli.global.store();
    match cli.fault_broken_store.as_deref() {
        None => with_store(&store, None, consume).await,
        Some(name) => {
            let kind = broken::parse(name)?;
            with_store(&store, None, OnBroken { consume, kind }).await
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    run_main(cli.global.log_format, run(cli))
}
