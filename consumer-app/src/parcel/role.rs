//! Which of the two Parcel consumers: the name both the inbox scope and the
//! queue are derived from, so that the two never drift apart.

/// Which of the two consumers (and so which queue).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// [`crate::parcel::consumers::NotificationConsumer`] on `parcel-created-notification`.
    Notification,
    /// [`crate::parcel::consumers::CarrierAssignmentConsumer`] on `parcel-created-carrier`.
    Carrier,
}

impl Role {
    /// Both roles.
    pub const ALL: [Self; 2] = [Self::Notification, Self::Carrier];

    /// The consumer name: the inbox scope and the metric label.
    pub fn consumer_name(self) -> &'static str {
        match self {
            Self::Notification => "parcel-notification",
            Self::Carrier => "parcel-carrier-assignment",
        }
    }

    /// The queue's base name (before the prefix).
    pub fn queue_base(self) -> &'static str {
        match self {
            Self::Notification => "parcel-created-notification",
            Self::Carrier => "parcel-created-carrier",
        }
    }
}
