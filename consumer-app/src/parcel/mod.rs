//! Parcel Tracking, the runtime's first user: a producer (`POST /parcels`,
//! the parcel and its `parcel.created` event in one transaction) and three
//! consumers that act exactly once per message.
//!
//! ```text
//! POST /parcels ─► parcels + outbox(parcel.created) ─► relay ─► RabbitMQ
//!   parcel.created ─► NotificationConsumer: notifications (parcel_created)
//!                  └► CarrierAssignmentConsumer: carrier_assignments
//!                       + outbox(parcel.carrier-assigned) ─► relay ─► RabbitMQ
//!   parcel.carrier-assigned ─► CarrierAssignedNotificationConsumer:
//!                                notifications (carrier_assigned)
//! ```
//!
//! [`consumers::NotificationConsumer`] records (and after commit sends) a
//! notification; [`consumers::CarrierAssignmentConsumer`] reserves (and
//! after commit books) a carrier slot and enqueues the follow-up event in
//! the same inbox transaction; [`consumers::CarrierAssignedNotificationConsumer`]
//! notifies again from that event, through its own inbox. All are plain
//! business code, as [`inbox_runtime::Handler`]s: the runtime claims the
//! message in the transaction they write in, and acks only after the commit.
//!
//! - [`api`]: `POST /parcels`, the producer side: the parcel and its
//!   `parcel.created` outbox row in one transaction.
//! - [`events`]: the events and their rules.
//! - [`consumers`], [`role`]: the consumers and their names.
//! - [`effects`]: the business writes, one trait over every store.
//! - [`downstream`]: the non-transactional calls and the trade-off chosen.
//! - [`dispatch`]: marking intents dispatched, the reconciler, the durable
//!   stub ledger.
//! - [`store`]: one file per store backend (cargo features `sqlx`,
//!   `diesel`, `memory`).
//! - [`topology`], [`service`]: the queue names, and the wiring into the
//!   runtime.

pub mod api;
pub mod consumers;
pub mod dispatch;
pub mod downstream;
pub mod effects;
pub mod events;
pub mod role;
pub mod service;
pub mod store;
pub mod topology;
