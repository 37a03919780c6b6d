//! The Parcel service: both consumers on the runtime.
//!
//! The wiring is all the Parcel domain adds to the runtime: its topology,
//! its two handlers on their queues, and its metric names.

use crate::parcel::consumers::{CarrierAssignmentConsumer, NotificationConsumer};
use crate::parcel::downstream::Downstreams;
use crate::parcel::role::Role;
use crate::parcel::store::ParcelStore;
use crate::parcel::topology::Topology;
use crate::runtime::telemetry::MetricNames;
use crate::runtime::{AppError, Handler, Service, ServiceConfig, ServiceHandle};

/// The names of the runtime's own counters in the Parcel service, as its
/// dashboards know them.
pub const METRIC_NAMES: MetricNames = MetricNames {
    requeued: "parcel_requeued_total",
    after_commit_failed: "parcel_downstream_failed_total",
    after_commit_failed_help: "Downstream calls (carrier, notifier) that failed after commit",
};

/// Both consumers, calling `downstreams` after commit.
///
/// # Errors
/// Never in practice: the names are valid constants.
pub fn consumers(
    downstreams: Downstreams,
) -> Result<(NotificationConsumer, CarrierAssignmentConsumer), AppError> {
    Ok((
        NotificationConsumer::new(downstreams.notifier)?,
        CarrierAssignmentConsumer::new(downstreams.carrier)?,
    ))
}

/// The service on `topology` with `notification` and `carrier` as the two
/// consumers: the consumers [`consumers`] makes, or those wrapped in a
/// decorator (the demo's and the tests' fault injection).
pub fn with_handlers<S, N, C>(
    store: S,
    config: ServiceConfig,
    topology: &Topology,
    notification: N,
    carrier: C,
) -> Service<S>
where
    S: ParcelStore,
    N: Handler<S::Transaction>,
    C: Handler<S::Transaction>,
{
    Service::new(store, config, topology.runtime())
        .metric_names(METRIC_NAMES)
        .consume(topology.queue(Role::Notification), notification)
        .consume(topology.queue(Role::Carrier), carrier)
}

/// Starts both consumers, cleanup and the gauge on `store`.
///
/// # Errors
/// As [`Service::spawn`].
pub fn spawn<S: ParcelStore>(
    store: S,
    config: ServiceConfig,
    topology: &Topology,
    downstreams: Downstreams,
) -> Result<ServiceHandle, AppError> {
    let (notification, carrier) = consumers(downstreams)?;
    with_handlers(store, config, topology, notification, carrier).spawn()
}
