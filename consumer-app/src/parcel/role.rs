//! Which of the Parcel consumers: the name both the inbox scope and the
//! queue are derived from, so that the two never drift apart.

use crate::parcel::events;

/// Which consumer (and so which queue, and which routing key it is bound
/// with).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// [`crate::parcel::consumers::NotificationConsumer`] on `parcel-created-notification`.
    Notification,
    /// [`crate::parcel::consumers::CarrierAssignmentConsumer`] on `parcel-created-carrier`.
    Carrier,
    /// [`crate::parcel::consumers::CarrierAssignedNotificationConsumer`] on
    /// `parcel-carrier-assigned-notification`: the second hop, fed by the
    /// carrier consumer's outbox.
    CarrierAssignedNotification,
}

impl Role {
    /// Every consumer: the queues to declare, the dead letters to look at.
    pub const ALL: [Self; 3] = [
        Self::Notification,
        Self::Carrier,
        Self::CarrierAssignedNotification,
    ];

    /// The consumers of `parcel.created`: what a message published straight
    /// to the exchange (`publish`) reaches. The third consumer hears only
    /// of what a relay publishes from the carrier consumer's outbox.
    pub const PARCEL_CREATED: [Self; 2] = [Self::Notification, Self::Carrier];

    /// The consumer name: the inbox scope and the metric label.
    pub fn consumer_name(self) -> &'static str {
        match self {
            Self::Notification => "parcel-notification",
            Self::Carrier => "parcel-carrier-assignment",
            Self::CarrierAssignedNotification => "parcel-carrier-assigned-notification",
        }
    }

    /// The queue's base name (before the prefix).
    pub fn queue_base(self) -> &'static str {
        match self {
            Self::Notification => "parcel-created-notification",
            Self::Carrier => "parcel-created-carrier",
            Self::CarrierAssignedNotification => "parcel-carrier-assigned-notification",
        }
    }

    /// The routing key its queue is bound with.
    pub fn routing_key(self) -> &'static str {
        match self {
            Self::Notification | Self::Carrier => events::ROUTING_KEY,
            Self::CarrierAssignedNotification => events::CARRIER_ASSIGNED_ROUTING_KEY,
        }
    }
}
