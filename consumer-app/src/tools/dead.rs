//! `parcel-inbox dead` and `parcel-inbox replay`: what the attempt ledger
//! says was dead-lettered, and moving dead letters back after a fix.
//!
//! `dead` reads the store, not the dead-letter queues: the ledger knows
//! every message a consumer dead-lettered after decoding it (its count, the
//! reason, the last error, when), for as long as the retention keeps the
//! row, and leaves out those processed since (a replay that worked).
//! Messages refused at decode (no message id, not JSON, …) have no key,
//! and are only in the dead-letter queue, with their reason header.
//!
//! `replay` moves dead letters from a consumer's dead-letter queue back to
//! its queue ([`inbox_runtime::replay`]); each comes back with a fresh
//! retry budget, and the inbox still makes sure it is processed at most
//! once.
//!
//! `outbox-dead` and `outbox-requeue` are the producer side's pair: the
//! outgoing messages the broker refused too often (dead in the outbox
//! table, see [`inbox_runtime::relay`]), and making them pending again,
//! with a fresh count, once their exchange or queue is fixed.

use std::fmt::Write as _;
use std::num::NonZeroU32;

use futures::stream::BoxStream;
use inbox_api::{AttemptRecord, ConsumerName, MessageId, OutboxRecord, OutboxStore};

use crate::parcel::role::Role;
use crate::parcel::store::{ParcelStore, StoreKind};
use crate::parcel::topology::Topology;
use crate::tools::stores::{WithOutbox, WithStore};
use inbox_runtime::amqp::{ConnectOptions, connect_with, open_channel};
use inbox_runtime::replay::{Replayed, replay};
use inbox_runtime::{AppError, message::truncate};

/// The widest last error a table row shows (the ledger keeps up to 1000
/// bytes; `x-inbox-last-error` in the dead letter has it all).
const SHOWN_ERROR: usize = 80;

/// The dead messages as a table: consumer, message id, attempts, reason,
/// when, last error (cut to a line).
pub fn dead_table(records: &[AttemptRecord]) -> String {
    let mut table = format!(
        "{:<28} {:<36} {:>8} {:<20} {:<20} last error\n",
        "consumer", "message id", "attempts", "reason", "dead at (UTC)"
    );
    for record in records {
        let (reason, at) = record.dead.as_ref().map_or(("", String::new()), |dead| {
            (
                dead.reason.as_str(),
                dead.at.format("%Y-%m-%d %H:%M:%S").to_string(),
            )
        });
        let _ = writeln!(
            table,
            "{:<28} {:<36} {:>8} {:<20} {:<20} {}",
            record.key.consumer.as_str(),
            record.key.message_id,
            record.attempts,
            reason,
            at,
            truncate(&record.last_error, SHOWN_ERROR)
        );
    }
    let _ = writeln!(table, "{} dead message(s)", records.len());
    table
}

/// `parcel-inbox dead`: prints the dead messages of one consumer or all.
#[derive(Debug)]
pub struct ListDead {
    /// Only this consumer's (its consumer name), or every consumer's.
    pub consumer: Option<ConsumerName>,
    /// At most this many rows, newest first.
    pub limit: NonZeroU32,
}

impl WithStore for ListDead {
    type Output = ();

    async fn run<S: ParcelStore>(self, store: S) -> Result<(), AppError> {
        let dead = store
            .dead_messages(self.consumer.as_ref(), self.limit)
            .await?;
        if store.kind() == StoreKind::Memory {
            println!("(memory store: a fresh, empty store in this process)");
        }
        print!("{}", dead_table(&dead));
        Ok(())
    }
}

/// The role whose consumer is named `name`.
///
/// # Errors
/// [`AppError::Config`] naming the consumers there are.
pub fn role_of(name: &str) -> Result<Role, AppError> {
    Role::ALL
        .into_iter()
        .find(|role| role.consumer_name() == name)
        .ok_or_else(|| {
            let names: Vec<&str> = Role::ALL.iter().map(|r| r.consumer_name()).collect();
            AppError::Config(format!(
                "no consumer named {name:?}; the consumers are {}",
                names.join(", ")
            ))
        })
}

/// `parcel-inbox replay`: moves the dead letters of `role` whose message id
/// is in `ids` (all of them when `ids` is empty) back to its queue, and
/// returns what moved.
///
/// # Errors
/// Broker errors.
pub async fn replay_dead_letters(
    amqp_url: &str,
    connection: ConnectOptions,
    topology: &Topology,
    role: Role,
    ids: &[String],
) -> Result<Replayed, AppError> {
    let connection = connect_with(amqp_url, "parcel-inbox replay", connection).await?;
    let channel = open_channel(&connection, "a channel").await?;
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .map_err(|e| AppError::broker("confirm mode", e))?;
    let chosen =
        |id: Option<&str>| ids.is_empty() || id.is_some_and(|id| ids.iter().any(|i| i == id));
    let replayed = replay(&channel, &topology.queue(role), chosen).await;
    inbox_runtime::amqp::close_bounded(&connection, "replayed").await;
    replayed
}

#[cfg(test)]
mod tests {
    use chrono::{TimeZone, Utc};
    use inbox_api::{DeadMark, InboxKey, MessageId};

    use super::*;

    #[test]
    fn the_table_names_every_column_and_cuts_long_errors() {
        let at = Utc.with_ymd_and_hms(2026, 12, 4, 9, 30, 0).unwrap();
        let id = MessageId::new_v7();
        let record = AttemptRecord {
            key: InboxKey::new(id, ConsumerName::new("parcel-carrier-assignment").unwrap()),
            attempts: 10,
            last_error: format!("carrier down: {}", "x".repeat(200)),
            first_failed_at: at,
            last_failed_at: at,
            dead: Some(DeadMark {
                at,
                reason: "retries_exhausted".into(),
            }),
        };
        let table = dead_table(&[record]);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3, "{table}");
        for column in [
            "consumer",
            "message id",
            "attempts",
            "reason",
            "dead at",
            "last error",
        ] {
            assert!(lines[0].contains(column), "{table}");
        }
        for field in [
            "parcel-carrier-assignment",
            &id.to_string(),
            " 10 ",
            "retries_exhausted",
            "2026-12-04 09:30:00",
            "carrier down: xxx",
        ] {
            assert!(lines[1].contains(field), "{field} in {table}");
        }
        assert!(lines[1].len() < 260, "{}", lines[1].len());
        assert_eq!(lines[2], "1 dead message(s)");
        assert_eq!(dead_table(&[]).lines().last(), Some("0 dead message(s)"));
    }

    #[test]
    fn consumers_are_found_by_name() {
        assert_eq!(
            role_of("parcel-notification").ok(),
            Some(Role::Notification)
        );
        assert_eq!(
            role_of("parcel-carrier-assignment").ok(),
            Some(Role::Carrier)
        );
        assert_eq!(
            role_of("parcel-carrier-assigned-notification").ok(),
            Some(Role::CarrierAssignedNotification)
        );
        let error = role_of("carrier").unwrap_err().to_string();
        assert!(error.contains("parcel-carrier-assignment"), "{error}");
    }
}

/// The dead outgoing messages as a table: message id, exchange, routing
/// key, refusals, when, last error (cut to a line).
pub fn outbox_dead_table(records: &[OutboxRecord]) -> String {
    let mut table = format!(
        "{:<36} {:<24} {:<24} {:>8} {:<20} last error\n",
        "message id", "exchange", "routing key", "refusals", "dead at (UTC)"
    );
    for record in records {
        let at = record
            .dead_at
            .map(|at| at.format("%Y-%m-%d %H:%M:%S").to_string())
            .unwrap_or_default();
        let _ = writeln!(
            table,
            "{:<36} {:<24} {:<24} {:>8} {:<20} {}",
            record.message.id(),
            record.message.exchange(),
            record.message.routing_key(),
            record.failures,
            at,
            truncate(record.last_error.as_deref().unwrap_or(""), SHOWN_ERROR)
        );
    }
    let _ = writeln!(table, "{} dead outgoing message(s)", records.len());
    table
}

/// `parcel-inbox outbox-dead`: prints the dead outgoing messages.
#[derive(Debug)]
pub struct ListDeadOutgoing {
    /// At most this many rows, newest first.
    pub limit: NonZeroU32,
}

impl WithOutbox for ListDeadOutgoing {
    type Output = ();

    async fn run<S: OutboxStore + Clone + 'static>(
        self,
        store: S,
        _wakeups: Option<BoxStream<'static, ()>>,
    ) -> Result<(), AppError> {
        print!(
            "{}",
            outbox_dead_table(&store.dead_outgoing(self.limit).await?)
        );
        Ok(())
    }

    fn listens(&self) -> bool {
        false
    }
}

/// `parcel-inbox outbox-requeue`: makes dead outgoing messages pending
/// again (these ids, or every dead one when `ids` is empty), each with a
/// fresh refusal count; prints how many.
#[derive(Debug)]
pub struct RequeueDeadOutgoing {
    /// Which ones; empty: all.
    pub ids: Vec<MessageId>,
}

impl WithOutbox for RequeueDeadOutgoing {
    type Output = ();

    async fn run<S: OutboxStore + Clone + 'static>(
        self,
        store: S,
        _wakeups: Option<BoxStream<'static, ()>>,
    ) -> Result<(), AppError> {
        let requeued = if self.ids.is_empty() {
            let page = NonZeroU32::new(1000).unwrap_or(NonZeroU32::MIN);
            let mut requeued = 0;
            loop {
                let dead: Vec<MessageId> = store
                    .dead_outgoing(page)
                    .await?
                    .iter()
                    .map(|record| record.message.id())
                    .collect();
                if dead.is_empty() {
                    break requeued;
                }
                requeued += store.requeue_dead(&dead).await?;
            }
        } else {
            store.requeue_dead(&self.ids).await?
        };
        println!("requeued {requeued} dead outgoing message(s); the relay publishes them next");
        Ok(())
    }

    fn listens(&self) -> bool {
        false
    }
}
