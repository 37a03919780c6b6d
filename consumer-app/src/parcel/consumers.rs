//! The two consumers of `parcel.created`: plain business code, as two
//! runtime [`Handler`]s.
//!
//! Neither contains any idempotency code. The runtime wraps each call in
//! `Inbox::handle(&InboxKey::new(message_id, consumer.name()), async |tx| consumer.handle(tx, …))`,
//! so the consumer's writes share the claim's transaction, and a redelivered
//! message never reaches it. After the commit, the runtime hands the
//! returned intent to [`Handler::after_commit`] for the call that cannot
//! join the transaction (see [`crate::parcel::downstream`]). Both are
//! written against [`ParcelEffects`], so they run on every store whose
//! transaction can make the two writes.

use std::sync::Arc;

use inbox_api::{ConsumerName, MessageId};

use crate::parcel::downstream::{CarrierApi, NotificationSender};
use crate::parcel::effects::{CarrierAssignment, Notification, ParcelEffects};
use crate::parcel::events::{EVENT_TYPE, ParcelCreatedEvent};
use crate::parcel::role::Role;
use crate::runtime::{AppError, Handler};

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

impl<T: ParcelEffects> Handler<T> for NotificationConsumer {
    type Message = ParcelCreatedEvent;
    type Intent = Notification;

    fn name(&self) -> &ConsumerName {
        &self.name
    }

    fn message_type(&self) -> &str {
        EVENT_TYPE
    }

    fn validate(&self, event: &ParcelCreatedEvent) -> Result<(), String> {
        event.validate()
    }

    /// Its own write of a probe event, in the check's rolled-back
    /// transaction: the table, its columns, the role's privileges (the
    /// sequence's too) exactly as a message needs them.
    async fn check(&self, tx: &mut T) -> Result<(), AppError> {
        self.handle(tx, MessageId::new_v7(), &ParcelCreatedEvent::probe())
            .await
            .map(drop)
    }

    async fn handle(
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

impl<T: ParcelEffects> Handler<T> for CarrierAssignmentConsumer {
    type Message = ParcelCreatedEvent;
    type Intent = CarrierAssignment;

    fn name(&self) -> &ConsumerName {
        &self.name
    }

    fn message_type(&self) -> &str {
        EVENT_TYPE
    }

    fn validate(&self, event: &ParcelCreatedEvent) -> Result<(), String> {
        event.validate()
    }

    /// Its own write of a probe event, in the check's rolled-back
    /// transaction: the table, its columns, the role's privileges (the
    /// sequence's too) exactly as a message needs them.
    async fn check(&self, tx: &mut T) -> Result<(), AppError> {
        self.handle(tx, MessageId::new_v7(), &ParcelCreatedEvent::probe())
            .await
            .map(drop)
    }

    async fn handle(
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
