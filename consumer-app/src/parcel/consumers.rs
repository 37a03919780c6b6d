//! The Parcel consumers: plain business code, as runtime [`Handler`]s. Two
//! take `parcel.created`; the carrier consumer's follow-up,
//! `parcel.carrier-assigned`, enqueued in its inbox transaction
//! (consume-transform-produce), is taken by the third, so one chain crosses
//! two hops, each exactly once in effect.
//!
//! Neither contains any idempotency code. The runtime wraps each call in
//! `Inbox::handle(&InboxKey::new(message_id, consumer.name()), async |tx| consumer.handle(&mut Context::new(tx, …), …))`,
//! so the consumer's writes share the claim's transaction, and a redelivered
//! message never reaches it. After the commit, the runtime hands the
//! returned intent to [`Handler::after_commit`] for the call that cannot
//! join the transaction (see [`crate::parcel::downstream`]). Both are
//! written against [`ParcelEffects`], so they run on every store whose
//! transaction can make the two writes.

use std::sync::Arc;

use inbox_api::{ConsumerName, MessageId};

use crate::parcel::downstream::{CarrierApi, NotificationSender};
use crate::parcel::effects::{CarrierAssignment, Notification, NotificationKind, ParcelEffects};
use crate::parcel::events::{
    CARRIER_ASSIGNED_TYPE, CarrierAssignedEvent, EVENT_TYPE, ParcelCreatedEvent,
};
use crate::parcel::role::Role;
use inbox_runtime::{AppError, Context, Handler};

/// An event a notification is sent for: what differs between the two
/// notification consumers (which consumer, which type, which text).
pub trait Notifies: serde::de::DeserializeOwned + Send + Sync + 'static {
    /// The consumer taking it.
    const ROLE: Role;
    /// Its AMQP type.
    const TYPE: &'static str;
    /// The notification's kind.
    const KIND: NotificationKind;

    /// An event no producer sends, for the store check.
    fn probe() -> Self;

    /// Its rules beyond the JSON shape.
    ///
    /// # Errors
    /// Which field breaks which rule.
    fn validate(&self) -> Result<(), String>;

    /// The notification to record for it, caused by `message_id`.
    fn notification(&self, message_id: MessageId) -> Notification;
}

impl Notifies for ParcelCreatedEvent {
    const ROLE: Role = Role::Notification;
    const TYPE: &'static str = EVENT_TYPE;
    const KIND: NotificationKind = NotificationKind::ParcelCreated;

    fn probe() -> Self {
        Self::probe()
    }

    fn validate(&self) -> Result<(), String> {
        Self::validate(self)
    }

    fn notification(&self, message_id: MessageId) -> Notification {
        Notification {
            message_id,
            kind: Self::KIND,
            parcel_id: self.parcel_id.clone(),
            tracking_number: self.tracking_number.clone(),
            destination: self.destination.clone(),
            body: format!(
                "Your parcel {} is on its way to {}.",
                self.tracking_number, self.destination
            ),
        }
    }
}

impl Notifies for CarrierAssignedEvent {
    const ROLE: Role = Role::CarrierAssignedNotification;
    const TYPE: &'static str = CARRIER_ASSIGNED_TYPE;
    const KIND: NotificationKind = NotificationKind::CarrierAssigned;

    fn probe() -> Self {
        Self::probe()
    }

    fn validate(&self) -> Result<(), String> {
        Self::validate(self)
    }

    fn notification(&self, message_id: MessageId) -> Notification {
        Notification {
            message_id,
            kind: Self::KIND,
            parcel_id: self.parcel_id.clone(),
            tracking_number: self.tracking_number.clone(),
            destination: self.destination.clone(),
            body: format!(
                "Your parcel {} will be picked up by {} ({}).",
                self.tracking_number, self.carrier, self.slot
            ),
        }
    }
}

/// Tells the recipient about their parcel: that it is on its way
/// (`parcel.created`, [`NotificationConsumer`]), or which carrier has it
/// (`parcel.carrier-assigned`, [`CarrierAssignedNotificationConsumer`], the
/// second hop, through an inbox of its own: a carrier-assigned event that
/// arrives twice, from a relay re-publishing after a crash, notifies once).
pub struct NotifyingConsumer<E> {
    name: ConsumerName,
    sender: Arc<dyn NotificationSender>,
    event: std::marker::PhantomData<fn() -> E>,
}

/// Notifies on `parcel.created`.
pub type NotificationConsumer = NotifyingConsumer<ParcelCreatedEvent>;

/// Notifies on `parcel.carrier-assigned`.
pub type CarrierAssignedNotificationConsumer = NotifyingConsumer<CarrierAssignedEvent>;

impl<E: Notifies> NotifyingConsumer<E> {
    /// A consumer sending through `sender` after commit.
    ///
    /// # Errors
    /// Never in practice: the name is a valid constant.
    pub fn new(sender: Arc<dyn NotificationSender>) -> Result<Self, AppError> {
        Ok(Self {
            name: ConsumerName::new(E::ROLE.consumer_name())?,
            sender,
            event: std::marker::PhantomData,
        })
    }
}

impl<T: ParcelEffects, E: Notifies> Handler<T> for NotifyingConsumer<E> {
    type Message = E;
    type Intent = Notification;

    fn name(&self) -> &ConsumerName {
        &self.name
    }

    fn message_type(&self) -> &str {
        E::TYPE
    }

    fn validate(&self, event: &E) -> Result<(), String> {
        event.validate()
    }

    /// Its own write of a probe event, in the check's rolled-back
    /// transaction: the table, its columns, the role's privileges (the
    /// sequence's too) exactly as a message needs them.
    async fn check(&self, cx: &mut Context<'_, T>) -> Result<(), AppError> {
        self.handle(cx, &E::probe()).await.map(drop)
    }

    async fn handle(&self, cx: &mut Context<'_, T>, event: &E) -> Result<Notification, AppError> {
        let notification = event.notification(cx.message_id());
        cx.record_notification(&notification).await?;
        Ok(notification)
    }

    async fn after_commit(&self, notification: Notification) -> Result<(), AppError> {
        let key = notification.message_id.to_string();
        self.sender.send(&key, &notification).await
    }
}

/// Reserves a pick-up slot with the carrier, and tells the others
/// (`parcel.carrier-assigned`) in the same transaction.
pub struct CarrierAssignmentConsumer {
    name: ConsumerName,
    carrier: Arc<dyn CarrierApi>,
}

impl CarrierAssignmentConsumer {
    /// The carriers slots are spread over.
    pub const CARRIERS: [&'static str; 3] = ["swiftpost", "rollerfreight", "bluevan"];

    /// A consumer booking through `carrier` after commit, and publishing
    /// its carrier-assigned events through the outbox.
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
    async fn check(&self, cx: &mut Context<'_, T>) -> Result<(), AppError> {
        self.handle(cx, &ParcelCreatedEvent::probe())
            .await
            .map(drop)
    }

    async fn handle(
        &self,
        cx: &mut Context<'_, T>,
        event: &ParcelCreatedEvent,
    ) -> Result<CarrierAssignment, AppError> {
        let message_id = cx.message_id();
        let (carrier, slot) = Self::pick(event);
        let assignment = CarrierAssignment {
            message_id,
            parcel_id: event.parcel_id.clone(),
            carrier,
            slot,
        };
        cx.reserve_carrier_slot(&assignment).await?;
        // The follow-up, in the same transaction: published iff the
        // reservation commits, under an id every re-run derives again.
        let assigned = CarrierAssignedEvent {
            parcel_id: event.parcel_id.clone(),
            tracking_number: event.tracking_number.clone(),
            destination: event.destination.clone(),
            carrier: assignment.carrier.clone(),
            slot: assignment.slot.clone(),
        };
        cx.publish(&assigned).await?;
        Ok(assignment)
    }

    async fn after_commit(&self, assignment: CarrierAssignment) -> Result<(), AppError> {
        let key = assignment.message_id.to_string();
        self.carrier.book(&key, &assignment).await
    }
}
