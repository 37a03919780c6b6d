//! The two consumers of `parcel.created`: plain business code.
//!
//! Neither contains any idempotency code. The message path
//! ([`crate::worker`]) wraps each call in
//! `Inbox::handle(&InboxKey::new(message_id, consumer.name()), async |tx| consumer.handle(tx, …))`,
//! so the consumer's writes share the claim's transaction, and a redelivered
//! message never reaches it. After the commit, the message path hands the
//! returned intent to [`ParcelConsumer::after_commit`] for the call that
//! cannot join the transaction (see [`crate::downstream`]).

use std::future::Future;
use std::sync::Arc;

use inbox_api::{ConsumerName, MessageId};

use crate::AppError;
use crate::downstream::{CarrierApi, NotificationSender};
use crate::effects::{CarrierAssignment, Notification, ParcelEffects};
use crate::event::ParcelCreatedEvent;

/// Which of the two consumers (and so which queue).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// [`NotificationConsumer`] on `parcel-created-notification`.
    Notification,
    /// [`CarrierAssignmentConsumer`] on `parcel-created-carrier`.
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

/// A consumer the message path can drive.
pub trait ParcelConsumer: Send + Sync + 'static {
    /// What the transaction decided to do outside it, after commit.
    type Intent: Send + 'static;

    /// The scope of deduplication.
    fn name(&self) -> &ConsumerName;

    /// The business work, inside the inbox transaction `tx`.
    fn handle<T: ParcelEffects>(
        &self,
        tx: &mut T,
        message_id: MessageId,
        event: &ParcelCreatedEvent,
    ) -> impl Future<Output = Result<Self::Intent, AppError>> + Send;

    /// The non-transactional call, after the commit succeeded.
    fn after_commit(
        &self,
        intent: Self::Intent,
    ) -> impl Future<Output = Result<(), AppError>> + Send;
}

/// Tells the recipient their parcel is on its way.
pub struct NotificationConsumer {
    name: ConsumerName,
    sender: Arc<dyn NotificationSender>,
}

impl NotificationConsumer {
    /// A consumer sending through `sender` after commit.
    ///
    /// # Errors
    /// Never in practice: the name is a valid constant.
    pub fn new(sender: Arc<dyn NotificationSender>) -> Result<Self, AppError> {
        Ok(Self {
            name: ConsumerName::new(Role::Notification.consumer_name())?,
            sender,
        })
    }
}

impl ParcelConsumer for NotificationConsumer {
    type Intent = Notification;

    fn name(&self) -> &ConsumerName {
        &self.name
    }

    async fn handle<T: ParcelEffects>(
        &self,
        tx: &mut T,
        message_id: MessageId,
        event: &ParcelCreatedEvent,
    ) -> Result<Notification, AppError> {
        let notification = Notification {
            message_id,
            parcel_id: event.parcel_id.clone(),
            tracking_number: event.tracking_number.clone(),
            destination: event.destination.clone(),
            body: format!(
                "Your parcel {} is on its way to {}.",
                event.tracking_number, event.destination
            ),
        };
        tx.record_notification(&notification).await?;
        Ok(notification)
    }

    async fn after_commit(&self, notification: Notification) -> Result<(), AppError> {
        let key = notification.message_id.to_string();
        self.sender.send(&key, &notification).await
    }
}

/// Reserves a pick-up slot with the carrier.
pub struct CarrierAssignmentConsumer {
    name: ConsumerName,
    carrier: Arc<dyn CarrierApi>,
}

impl CarrierAssignmentConsumer {
    /// The carriers slots are spread over.
    pub const CARRIERS: [&'static str; 3] = ["swiftpost", "rollerfreight", "bluevan"];

    /// A consumer booking through `carrier` after commit.
    ///
    /// # Errors
    /// Never in practice: the name is a valid constant.
    pub fn new(carrier: Arc<dyn CarrierApi>) -> Result<Self, AppError> {
        Ok(Self {
            name: ConsumerName::new(Role::Carrier.consumer_name())?,
            carrier,
        })
    }

    /// A deterministic carrier and slot for a parcel (a stand-in for a real
    /// capacity lookup).
    fn pick(event: &ParcelCreatedEvent) -> (String, String) {
        let hash = event
            .parcel_id
            .bytes()
            .chain(event.destination.bytes())
            .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
        let carriers = Self::CARRIERS.len() as u64;
        let carrier = Self::CARRIERS[usize::try_from(hash % carriers).unwrap_or(0)];
        let hour = 8 + (hash / carriers) % 10;
        (
            carrier.to_owned(),
            format!("tomorrow {hour:02}:00-{:02}:00", hour + 1),
        )
    }
}

impl ParcelConsumer for CarrierAssignmentConsumer {
    type Intent = CarrierAssignment;

    fn name(&self) -> &ConsumerName {
        &self.name
    }

    async fn handle<T: ParcelEffects>(
        &self,
        tx: &mut T,
        message_id: MessageId,
        event: &ParcelCreatedEvent,
    ) -> Result<CarrierAssignment, AppError> {
        let (carrier, slot) = Self::pick(event);
        let assignment = CarrierAssignment {
            message_id,
            parcel_id: event.parcel_id.clone(),
            carrier,
            slot,
        };
        tx.reserve_carrier_slot(&assignment).await?;
        Ok(assignment)
    }

    async fn after_commit(&self, assignment: CarrierAssignment) -> Result<(), AppError> {
        let key = assignment.message_id.to_string();
        self.carrier.book(&key, &assignment).await
    }
}
