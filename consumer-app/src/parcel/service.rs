//! The Parcel service: its consumers on the runtime.
//!
//! The wiring is all the Parcel domain adds to the runtime: its topology,
//! its three handlers on their queues, and its metric names.

use crate::parcel::consumers::{
    CarrierAssignedNotificationConsumer, CarrierAssignmentConsumer, NotificationConsumer,
};
use crate::parcel::downstream::Downstreams;
use crate::parcel::role::Role;
use crate::parcel::store::ParcelStore;
use crate::parcel::topology::Topology;
use inbox_runtime::telemetry::MetricNames;
use inbox_runtime::{AppError, Handler, Service, ServiceConfig, ServiceHandle};

/// The names of the runtime's own counters in the Parcel service, as its
/// dashboards know them.
pub const METRIC_NAMES: MetricNames = MetricNames {
    requeued: "parcel_requeued_total",
    after_commit_failed: "parcel_downstream_failed_total",
    after_commit_failed_help: "Downstream calls (carrier, notifier) that failed after commit",
};

/// The three consumers, one per [`Role`]; generic so that a decorator (the
/// demo's and the tests' fault injection) can wrap each ([`Consumers::map`]).
#[derive(Clone, Debug)]
pub struct Consumers<N, C, A> {
    /// Notifies on `parcel.created`.
    pub notification: N,
    /// Reserves a carrier slot on `parcel.created`, and enqueues
    /// `parcel.carrier-assigned`.
    pub carrier: C,
    /// Notifies on `parcel.carrier-assigned`.
    pub carrier_assigned: A,
}

/// The consumers [`consumers`] makes.
pub type ParcelConsumers =
    Consumers<NotificationConsumer, CarrierAssignmentConsumer, CarrierAssignedNotificationConsumer>;

impl<N, C, A> Consumers<N, C, A> {
    /// Each consumer passed through `wrap` (one decorator type for all).
    pub fn map<W: Wrap>(self, wrap: &W) -> Consumers<W::Out<N>, W::Out<C>, W::Out<A>> {
        Consumers {
            notification: wrap.wrap(self.notification),
            carrier: wrap.wrap(self.carrier),
            carrier_assigned: wrap.wrap(self.carrier_assigned),
        }
    }
}

/// A handler decorator for [`Consumers::map`].
pub trait Wrap {
    /// What a wrapped `H` is.
    type Out<H>;

    /// Wraps `handler`.
    fn wrap<H>(&self, handler: H) -> Self::Out<H>;
}

/// The consumers, calling `downstreams` after commit; the carrier consumer
/// publishes to the exchange of the topology it runs on.
///
/// # Errors
/// Never in practice: the names are valid constants.
pub fn consumers(downstreams: Downstreams) -> Result<ParcelConsumers, AppError> {
    Ok(Consumers {
        notification: NotificationConsumer::new(downstreams.notifier.clone())?,
        carrier: CarrierAssignmentConsumer::new(downstreams.carrier)?,
        carrier_assigned: CarrierAssignedNotificationConsumer::new(downstreams.notifier)?,
    })
}

/// The service on `topology` with `consumers` on their queues: the
/// consumers [`consumers`] makes, or those wrapped in a decorator.
pub fn with_handlers<S, N, C, A>(
    store: S,
    config: ServiceConfig,
    topology: &Topology,
    consumers: Consumers<N, C, A>,
) -> Service<S>
where
    S: ParcelStore,
    N: Handler<S::Transaction>,
    C: Handler<S::Transaction>,
    A: Handler<S::Transaction>,
{
    Service::new(store, config, topology.runtime())
        .metric_names(METRIC_NAMES)
        .consume(topology.queue(Role::Notification), consumers.notification)
        .consume(topology.queue(Role::Carrier), consumers.carrier)
        .consume(
            topology.queue(Role::CarrierAssignedNotification),
            consumers.carrier_assigned,
        )
}

/// Starts the consumers, cleanup and the gauge on `store`.
///
/// # Errors
/// As [`Service::spawn`].
pub fn spawn<S: ParcelStore>(
    store: S,
    config: ServiceConfig,
    topology: &Topology,
    downstreams: Downstreams,
) -> Result<ServiceHandle, AppError> {
    with_handlers(store, config, topology, consumers(downstreams)?).spawn()
}
