//! The transactional outbox: the producer's half of exactly-once effects.
//!
//! A service that writes its own rows and then publishes an event has two
//! ways to lose consistency: publish and crash before COMMIT (the world
//! hears of something that never happened), or COMMIT and crash before
//! publishing (it never hears of something that did). The outbox closes
//! both: the outgoing message is a row written by
//! [`OutboxTransaction::enqueue`] in the *same* transaction as the business
//! writes, so it exists iff they commit. A relay then publishes the
//! committed rows and marks them published only after the broker confirmed
//! them. A relay that dies in between publishes again, under the same
//! [`MessageId`], and the consumers' inboxes discard the copy.
//!
//! The relay's store operations ([`OutboxStore`]) are leases, not held
//! transactions: [`OutboxStore::take_pending`] marks a batch as taken until
//! a deadline, in one short statement that skips rows other relays are
//! taking at the same moment (PostgreSQL's `FOR UPDATE SKIP LOCKED`). Two
//! relays never hold one message at once, and a relay that dies, freezes or
//! loses its connection holds nothing once its lease runs out: another
//! relay takes the messages then.

use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{InboxError, InboxStore, InboxTransaction, MessageId};

/// One message to publish, validated so that every stored row can be
/// published as it is: a row the broker would refuse would block nothing
/// (the relay moves on) but would never be delivered either, so refuse it
/// at enqueue, in the producer's transaction, where the error is seen.
///
/// The [`MessageId`] is the producer's: assign it once per logical message
/// (from the business row, say) so that a producer retrying its own
/// transaction enqueues the same message, not a second one.
#[derive(Clone, PartialEq, Eq)]
pub struct OutgoingMessage {
    id: MessageId,
    exchange: String,
    routing_key: String,
    message_type: String,
    headers: BTreeMap<String, String>,
    body: Vec<u8>,
}

impl OutgoingMessage {
    /// The longest exchange name, routing key, type and header name, in
    /// bytes: AMQP 0-9-1's short string.
    pub const MAX_SHORT: usize = 255;
    /// The longest header value, in bytes. Headers travel in every frame's
    /// properties; large data belongs in the body.
    pub const MAX_HEADER_VALUE: usize = 4096;
    /// At most this many headers.
    pub const MAX_HEADERS: usize = 64;
    /// The largest body, in bytes (1 MiB). The outbox row lives in the
    /// producer's transaction and table; a message far larger than an event
    /// should be stored elsewhere and referenced.
    pub const MAX_BODY: usize = 1 << 20;

    /// A message for `exchange` with `routing_key`, of AMQP type
    /// `message_type`, carrying `body`; no headers yet
    /// ([`OutgoingMessage::with_header`]).
    ///
    /// Rules: the exchange may be empty (the default exchange) and otherwise
    /// holds only ASCII letters, digits, `-`, `_`, `.` and `:` (RabbitMQ's
    /// rule for names); routing key and type hold no control characters;
    /// the type is not empty; each is at most [`Self::MAX_SHORT`] bytes; the
    /// body at most [`Self::MAX_BODY`].
    ///
    /// # Errors
    /// [`InboxError::InvalidOutgoingMessage`] (permanent) naming the rule.
    pub fn new(
        id: MessageId,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        message_type: impl Into<String>,
        body: impl Into<Vec<u8>>,
    ) -> Result<Self, InboxError> {
        let message = Self {
            id,
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            message_type: message_type.into(),
            headers: BTreeMap::new(),
            body: body.into(),
        };
        message.check()?;
        Ok(message)
    }

    /// Adds (or replaces) the header `name` with the text `value`.
    ///
    /// Names are 1 to [`Self::MAX_SHORT`] bytes of ASCII letters, digits,
    /// `-`, `_` and `.`; values at most [`Self::MAX_HEADER_VALUE`] bytes
    /// without control characters; at most [`Self::MAX_HEADERS`] headers.
    ///
    /// # Errors
    /// [`InboxError::InvalidOutgoingMessage`] naming the rule.
    pub fn with_header(
        mut self,
        name: impl Into<String>,
        value: impl Into<String>,
    ) -> Result<Self, InboxError> {
        self.headers.insert(name.into(), value.into());
        self.check()?;
        Ok(self)
    }

    /// Rebuilds a message from its parts (a stored row, say), checking every
    /// rule as [`OutgoingMessage::new`] and [`OutgoingMessage::with_header`]
    /// do.
    ///
    /// # Errors
    /// [`InboxError::InvalidOutgoingMessage`] naming the rule.
    pub fn from_parts(
        id: MessageId,
        exchange: String,
        routing_key: String,
        message_type: String,
        headers: BTreeMap<String, String>,
        body: Vec<u8>,
    ) -> Result<Self, InboxError> {
        let message = Self {
            id,
            exchange,
            routing_key,
            message_type,
            headers,
            body,
        };
        message.check()?;
        Ok(message)
    }

    /// The id the relay publishes it under, every time.
    pub fn id(&self) -> MessageId {
        self.id
    }

    /// The exchange to publish to (empty: the default exchange).
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The routing key.
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }

    /// The AMQP `type` property: what the consumer dispatches on.
    pub fn message_type(&self) -> &str {
        &self.message_type
    }

    /// The headers, sorted by name.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    fn check(&self) -> Result<(), InboxError> {
        let fail = |field: &'static str, value: &str, reason: &'static str| {
            Err(InboxError::InvalidOutgoingMessage {
                field,
                value: crate::key::truncate(value, 64),
                reason,
            })
        };
        let name_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if self.exchange.len() > Self::MAX_SHORT {
            return fail("exchange", &self.exchange, "longer than 255 bytes");
        }
        if !self.exchange.chars().all(|c| name_char(c) || c == ':') {
            return fail(
                "exchange",
                &self.exchange,
                "only ASCII letters, digits, '-', '_', '.' and ':' are allowed",
            );
        }
        if let Some(reason) = short_text_rule(&self.routing_key) {
            return fail("routing_key", &self.routing_key, reason);
        }
        if self.message_type.is_empty() {
            return fail("message_type", "", "empty");
        }
        if let Some(reason) = short_text_rule(&self.message_type) {
            return fail("message_type", &self.message_type, reason);
        }
        if self.headers.len() > Self::MAX_HEADERS {
            return fail("headers", "", "more than 64 headers");
        }
        for (name, value) in &self.headers {
            if name.is_empty() || name.len() > Self::MAX_SHORT {
                return fail("header name", name, "empty or longer than 255 bytes");
            }
            if !name.chars().all(name_char) {
                return fail(
                    "header name",
                    name,
                    "only ASCII letters, digits, '-', '_' and '.' are allowed",
                );
            }
            if value.len() > Self::MAX_HEADER_VALUE {
                return fail("header value", value, "longer than 4096 bytes");
            }
            if value.chars().any(char::is_control) {
                return fail("header value", value, "contains a control character");
            }
        }
        if self.body.len() > Self::MAX_BODY {
            return fail("body", "", "larger than 1 MiB");
        }
        Ok(())
    }
}

/// The rule a routing key or a type breaks, if any: AMQP short strings
/// that a log line prints safely.
fn short_text_rule(text: &str) -> Option<&'static str> {
    if text.len() > OutgoingMessage::MAX_SHORT {
        Some("longer than 255 bytes")
    } else if text.chars().any(char::is_control) {
        Some("contains a control character")
    } else {
        None
    }
}

impl fmt::Debug for OutgoingMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The body may be large or personal: its size is enough in a log.
        f.debug_struct("OutgoingMessage")
            .field("id", &self.id)
            .field("exchange", &self.exchange)
            .field("routing_key", &self.routing_key)
            .field("message_type", &self.message_type)
            .field("headers", &self.headers)
            .field("body_len", &self.body.len())
            .finish()
    }
}

/// What [`OutboxTransaction::enqueue`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[must_use = "AlreadyEnqueued means an earlier copy, not this one, will be published"]
pub enum EnqueueOutcome {
    /// A new outgoing row, published once the transaction commits.
    Enqueued,
    /// A row with this message id exists already (committed, or enqueued
    /// earlier in this transaction): nothing was written, and the first
    /// row's contents are what will be published. A producer retrying its
    /// transaction with the same id lands here, which is the point.
    AlreadyEnqueued,
}

/// A transaction that can enqueue outgoing messages: the capability the
/// producer's business transaction needs.
///
/// Implemented by the backends' transaction types, so the outgoing row and
/// the business writes share one transaction: committed together, or, on
/// rollback, drop or a killed connection, neither.
#[async_trait]
pub trait OutboxTransaction: InboxTransaction {
    /// Writes `message` as an outgoing row of this transaction, visible to
    /// relays only after COMMIT.
    ///
    /// The same id twice is idempotent ([`EnqueueOutcome::AlreadyEnqueued`]),
    /// never a unique violation. On PostgreSQL an enqueue of an id another
    /// open transaction enqueued waits for that transaction, as a claim
    /// does.
    ///
    /// # Errors
    /// Store failures; the transaction must then be rolled back.
    async fn enqueue(&mut self, message: &OutgoingMessage) -> Result<EnqueueOutcome, InboxError>;
}

/// Which [`OutboxStore::take_pending`] call holds a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(Uuid);

impl LeaseId {
    /// A new, random lease id.
    pub fn new() -> Self {
        Self(Uuid::new_v4())
    }

    /// The UUID inside (stored in the `lease_id` column on PostgreSQL).
    pub const fn as_uuid(&self) -> &Uuid {
        &self.0
    }
}

impl Default for LeaseId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// A batch of pending messages one relay holds until `expires_at`.
///
/// Not a database transaction: nothing stays open while the relay talks to
/// the broker. Publish the messages, then
/// [`OutboxStore::mark_published`] the confirmed ones and
/// [`OutboxStore::release`] the lease so that the rest are retaken at once.
/// A relay that does neither (it died) holds the messages until
/// `expires_at`; then any relay takes them again, and publishes them under
/// the same ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxLease {
    /// Which lease this is.
    pub id: LeaseId,
    /// When another relay may take these messages (store clock).
    pub expires_at: DateTime<Utc>,
    /// The messages, oldest first.
    pub messages: Vec<OutgoingMessage>,
}

impl OutboxLease {
    /// The ids of the messages, in order.
    pub fn ids(&self) -> Vec<MessageId> {
        self.messages.iter().map(OutgoingMessage::id).collect()
    }

    /// Whether the store had nothing to take.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }
}

/// One committed outgoing row, as read back for diagnostics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxRecord {
    /// The message.
    pub message: OutgoingMessage,
    /// When it was enqueued (store clock; the transaction's start on
    /// PostgreSQL).
    pub created_at: DateTime<Utc>,
    /// When a relay marked it published, after the broker's confirm.
    pub published_at: Option<DateTime<Utc>>,
    /// How many times a relay took it: more than one means a relay died,
    /// lost its broker or gave it back.
    pub attempts: u32,
    /// How many times the broker refused this message itself (a nack, or
    /// returned unroutable): what its backoff and dead-letter limit count
    /// ([`OutboxStore::record_refusals`]). An outage or a lost connection
    /// adds nothing.
    pub failures: u32,
    /// The broker's answer to the last refusal.
    pub last_error: Option<String>,
    /// Not taken before this (store clock): the backoff after a refusal.
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// When it was dead-lettered after [`PublishRetry::max_attempts`]
    /// refusals: kept, never taken, not counted pending, until
    /// [`OutboxStore::requeue_dead`].
    pub dead_at: Option<DateTime<Utc>>,
}

/// How a relay retries a message the broker refuses for its own sake (a
/// nack, returned unroutable): the `n`th refusal in a row waits
/// `base_delay × 2^(n−1)`, at most `max_delay`, and the `max_attempts`th
/// makes it dead. A pure value: the memory store applies
/// [`PublishRetry::delay`], the Postgres statement the same formula.
///
/// Per message, so that one message its exchange refuses neither blocks
/// the others nor comes back every round forever.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublishRetry {
    /// The pause after the first refusal.
    pub base_delay: Duration,
    /// The longest pause.
    pub max_delay: Duration,
    /// Refusals after which the message is dead.
    pub max_attempts: NonZeroU32,
}

impl PublishRetry {
    /// The pause after the `failures`th refusal (counting from one).
    pub fn delay(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(40);
        self.base_delay
            .saturating_mul(2_u32.saturating_pow(doublings.min(31)))
            .min(self.max_delay)
    }

    /// Whether `failures` refusals make a message dead.
    pub fn is_dead(&self, failures: u32) -> bool {
        failures >= self.max_attempts.get()
    }
}

impl Default for PublishRetry {
    /// 1 s doubling to 5 min, dead after 10 refusals (about 15 minutes of
    /// refusals in all).
    fn default() -> Self {
        Self {
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(300),
            max_attempts: NonZeroU32::new(10).unwrap_or(NonZeroU32::MIN),
        }
    }
}

/// What [`OutboxStore::record_refusals`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Refused {
    /// Refusals recorded (rows still held by the lease, unpublished, alive).
    pub recorded: u64,
    /// The messages that reached the limit with this refusal: dead now.
    pub dead: Vec<MessageId>,
}

/// The outgoing rows of a store, as a relay sees them: take a batch, mark
/// what the broker confirmed, purge what was published long ago.
///
/// The contract (checked by the `inbox-conformance` crate's outbox suite):
///
/// 1. A message enqueued in a transaction is pending iff that transaction
///    committed.
/// 2. [`OutboxStore::take_pending`] never hands one message to two leases
///    that are both unexpired, however many relays call it at once.
/// 3. A lease that expires (its relay died) gives its unpublished messages
///    back; a message marked published is never taken again.
/// 4. Cleanup deletes published rows older than a cutoff, in bounded
///    batches, never a pending one.
/// 5. A refused message is not taken again before its backoff, and is
///    dead (kept, never taken, not pending) after the retry limit, until
///    requeued.
#[async_trait]
pub trait OutboxStore: InboxStore<Transaction: OutboxTransaction> {
    /// Leases at most `limit` pending messages whose lease (if any) has
    /// expired, oldest first, until `lease` from now, in one short
    /// transaction of its own. Messages another relay is taking at the same
    /// moment are skipped, never waited for. An empty lease means nothing is
    /// due.
    ///
    /// # Errors
    /// Store failures (retryable ones as for any transaction).
    async fn take_pending(
        &self,
        limit: NonZeroU32,
        lease: Duration,
    ) -> Result<OutboxLease, InboxError>;

    /// Records that the broker confirmed these messages: they are never
    /// taken again. Ids already published or absent are ignored, so the
    /// call can be repeated after a lost answer. Returns how many rows
    /// changed.
    ///
    /// # Errors
    /// Store failures. The marks may or may not have committed after a lost
    /// connection; repeating the call is safe, and a message left unmarked
    /// is only published once more.
    async fn mark_published(&self, ids: &[MessageId]) -> Result<u64, InboxError>;

    /// Gives the lease's unpublished messages back at once (the broker
    /// refused them, the relay is shutting down), instead of letting the
    /// lease run out. Messages another lease has taken since are left
    /// alone. Returns how many were given back.
    ///
    /// # Errors
    /// Store failures; the lease then simply expires.
    async fn release(&self, lease: &OutboxLease) -> Result<u64, InboxError>;

    /// The committed row of `id`, without waiting for open transactions.
    /// For diagnostics and tests.
    ///
    /// # Errors
    /// Store failures.
    async fn lookup_outgoing(&self, id: &MessageId) -> Result<Option<OutboxRecord>, InboxError>;

    /// How many committed messages are not yet published (leased or not).
    ///
    /// # Errors
    /// Store failures.
    async fn pending_count(&self) -> Result<u64, InboxError>;

    /// How many messages are dead (refused
    /// [`PublishRetry::max_attempts`] times, kept, never taken until
    /// [`OutboxStore::requeue_dead`]).
    ///
    /// # Errors
    /// As [`OutboxStore::take_pending`].
    async fn dead_count(&self) -> Result<u64, InboxError>;

    /// Deletes at most `limit` published rows whose `published_at` is before
    /// `cutoff`, in one short transaction, and returns how many went.
    /// Pending rows are never deleted. Bounded for the same reason as the
    /// inbox's cleanup ([`InboxStore::purge_processed_batch`]); loop with
    /// [`OutboxStoreExt::purge_published_before`].
    ///
    /// # Errors
    /// Store failures.
    async fn purge_published_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError>;

    /// Records that the broker refused these messages of `lease` (id and
    /// the broker's answer each): their refusal count goes up by one, the
    /// lease lets go of them, and they are not taken again before the
    /// backoff `retry` gives (or never, dead, at its limit). Rows no longer
    /// held by `lease` (taken by another relay since), published or dead
    /// are left alone, so a repeated call charges nothing twice.
    ///
    /// Call it only for the message's own refusals (nack, returned): a
    /// broker outage or a lost channel must charge nothing, so those
    /// messages are left to their lease.
    ///
    /// # Errors
    /// Store failures; the lease then simply expires, uncharged.
    async fn record_refusals(
        &self,
        lease: &LeaseId,
        refusals: &[(MessageId, String)],
        retry: &PublishRetry,
    ) -> Result<Refused, InboxError>;

    /// The dead messages, the most recently dead first, at most `limit`.
    ///
    /// # Errors
    /// Store failures.
    async fn dead_outgoing(&self, limit: NonZeroU32) -> Result<Vec<OutboxRecord>, InboxError>;

    /// Makes these dead messages pending again, with a fresh refusal count
    /// (after the fix: the exchange exists now, say). Returns how many were
    /// dead; other ids are ignored.
    ///
    /// # Errors
    /// Store failures.
    async fn requeue_dead(&self, ids: &[MessageId]) -> Result<u64, InboxError>;
}

#[async_trait]
impl<S: OutboxStore> OutboxStore for Arc<S> {
    async fn take_pending(
        &self,
        limit: NonZeroU32,
        lease: Duration,
    ) -> Result<OutboxLease, InboxError> {
        (**self).take_pending(limit, lease).await
    }

    async fn mark_published(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        (**self).mark_published(ids).await
    }

    async fn release(&self, lease: &OutboxLease) -> Result<u64, InboxError> {
        (**self).release(lease).await
    }

    async fn lookup_outgoing(&self, id: &MessageId) -> Result<Option<OutboxRecord>, InboxError> {
        (**self).lookup_outgoing(id).await
    }

    async fn pending_count(&self) -> Result<u64, InboxError> {
        (**self).pending_count().await
    }

    async fn dead_count(&self) -> Result<u64, InboxError> {
        (**self).dead_count().await
    }

    async fn purge_published_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        (**self).purge_published_batch(cutoff, limit).await
    }

    async fn record_refusals(
        &self,
        lease: &LeaseId,
        refusals: &[(MessageId, String)],
        retry: &PublishRetry,
    ) -> Result<Refused, InboxError> {
        (**self).record_refusals(lease, refusals, retry).await
    }

    async fn dead_outgoing(&self, limit: NonZeroU32) -> Result<Vec<OutboxRecord>, InboxError> {
        (**self).dead_outgoing(limit).await
    }

    async fn requeue_dead(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        (**self).requeue_dead(ids).await
    }
}

/// Conveniences over every [`OutboxStore`], implemented once for all of
/// them, so that the metrics they record mean the same for every store.
#[async_trait]
pub trait OutboxStoreExt: OutboxStore {
    /// Deletes every published row older than `cutoff`, `batch_size` rows
    /// per transaction ([`OutboxStore::purge_published_batch`]), records
    /// each batch in `outbox_purged_rows_total`, and returns how many went.
    ///
    /// # Errors
    /// As [`OutboxStore::purge_published_batch`]; the batches committed
    /// before an error stay deleted (and counted).
    async fn purge_published_before(
        &self,
        cutoff: DateTime<Utc>,
        batch_size: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.purge_published_paced(cutoff, batch_size, || std::future::ready(()))
            .await
    }

    /// [`OutboxStoreExt::purge_published_before`] with `pause` awaited after every full
    /// batch, before the next one (a paced cleanup, as
    /// [`crate::InboxStoreExt::purge_processed_paced`]).
    ///
    /// # Errors
    /// As [`OutboxStoreExt::purge_published_before`].
    async fn purge_published_paced<P, F>(
        &self,
        cutoff: DateTime<Utc>,
        batch_size: NonZeroU32,
        pause: P,
    ) -> Result<u64, InboxError>
    where
        P: FnMut() -> F + Send,
        F: std::future::Future<Output = ()> + Send,
    {
        crate::store::purge_in_batches(
            batch_size,
            crate::metrics::OUTBOX_PURGED_ROWS,
            (),
            |()| async move { Ok((self.purge_published_batch(cutoff, batch_size).await?, ())) },
            pause,
        )
        .await
    }

    /// Reads [`OutboxStore::pending_count`] into the `outbox_pending_messages`
    /// gauge and returns it: a relay that falls behind shows as a rising
    /// line.
    ///
    /// # Errors
    /// As [`OutboxStore::pending_count`]; the gauge keeps its last value.
    async fn record_pending(&self) -> Result<u64, InboxError> {
        let pending = self.pending_count().await?;
        // A gauge is a float; counts far beyond 2^53 do not occur here.
        #[allow(clippy::cast_precision_loss)]
        metrics::gauge!(crate::metrics::OUTBOX_PENDING).set(pending as f64);
        Ok(pending)
    }

    /// Reads [`OutboxStore::dead_count`] into the `outbox_dead_messages`
    /// gauge and returns it: the counter `outbox_dead_lettered_total` says
    /// how many died, this how many still wait for an operator (requeued
    /// or purged ones no longer count).
    ///
    /// # Errors
    /// As [`OutboxStore::dead_count`]; the gauge keeps its last value.
    async fn record_dead(&self) -> Result<u64, InboxError> {
        let dead = self.dead_count().await?;
        // A gauge is a float; counts far beyond 2^53 do not occur here.
        #[allow(clippy::cast_precision_loss)]
        metrics::gauge!(crate::metrics::OUTBOX_DEAD).set(dead as f64);
        Ok(dead)
    }
}

impl<S: OutboxStore + ?Sized> OutboxStoreExt for S {}

#[cfg(test)]
mod tests {
    use super::*;

    fn message() -> OutgoingMessage {
        OutgoingMessage::new(
            MessageId::new_v7(),
            "parcels",
            "parcel.created",
            "ParcelCreatedEvent",
            b"{}".to_vec(),
        )
        .unwrap()
    }

    fn reason(result: Result<OutgoingMessage, InboxError>) -> (&'static str, &'static str) {
        match result.unwrap_err() {
            InboxError::InvalidOutgoingMessage { field, reason, .. } => (field, reason),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_valid_message_keeps_its_parts() {
        let m = message().with_header("tenant", "acme").unwrap();
        assert_eq!(m.exchange(), "parcels");
        assert_eq!(m.routing_key(), "parcel.created");
        assert_eq!(m.message_type(), "ParcelCreatedEvent");
        assert_eq!(m.headers().get("tenant").map(String::as_str), Some("acme"));
        assert_eq!(m.body(), b"{}");
        let rebuilt = OutgoingMessage::from_parts(
            m.id(),
            m.exchange().into(),
            m.routing_key().into(),
            m.message_type().into(),
            m.headers().clone(),
            m.body().to_vec(),
        )
        .unwrap();
        assert_eq!(rebuilt, m);
        // Debug names the message and says how large its body is, never
        // what it holds.
        let shown = format!("{m:?}");
        assert!(!shown.contains("{}"), "no body in Debug: {shown}");
        assert!(shown.contains(m.routing_key()), "{shown}");
        assert!(shown.contains("body_len: 2"), "{shown}");
        // The default exchange and an empty routing key are valid AMQP.
        OutgoingMessage::new(MessageId::new_v7(), "", "", "T", Vec::new()).unwrap();
        // The limits themselves are allowed.
        let at_limits = OutgoingMessage::new(
            MessageId::new_v7(),
            "e".repeat(255),
            "k".repeat(255),
            "t".repeat(255),
            vec![0; OutgoingMessage::MAX_BODY],
        )
        .unwrap()
        .with_header("h".repeat(255), "v".repeat(4096))
        .unwrap();
        assert_eq!(at_limits.body().len(), 1 << 20);
    }

    #[test]
    fn every_rule_is_named() {
        let id = MessageId::new_v7();
        let cases = [
            (
                OutgoingMessage::new(id, "e".repeat(256), "k", "T", Vec::new()),
                ("exchange", "longer than 255 bytes"),
            ),
            (
                OutgoingMessage::new(id, "par cels", "k", "T", Vec::new()),
                (
                    "exchange",
                    "only ASCII letters, digits, '-', '_', '.' and ':' are allowed",
                ),
            ),
            (
                OutgoingMessage::new(id, "e", "k".repeat(256), "T", Vec::new()),
                ("routing_key", "longer than 255 bytes"),
            ),
            (
                OutgoingMessage::new(id, "e", "a\nb", "T", Vec::new()),
                ("routing_key", "contains a control character"),
            ),
            (
                OutgoingMessage::new(id, "e", "k", "", Vec::new()),
                ("message_type", "empty"),
            ),
            (
                OutgoingMessage::new(id, "e", "k", "T".repeat(256), Vec::new()),
                ("message_type", "longer than 255 bytes"),
            ),
            (
                OutgoingMessage::new(id, "e", "k", "T\0", Vec::new()),
                ("message_type", "contains a control character"),
            ),
            (
                OutgoingMessage::new(id, "e", "k", "T", vec![0; OutgoingMessage::MAX_BODY + 1]),
                ("body", "larger than 1 MiB"),
            ),
            (
                message().with_header("", "v"),
                ("header name", "empty or longer than 255 bytes"),
            ),
            (
                message().with_header("a b", "v"),
                (
                    "header name",
                    "only ASCII letters, digits, '-', '_' and '.' are allowed",
                ),
            ),
            (
                message().with_header("h", "v".repeat(4097)),
                ("header value", "longer than 4096 bytes"),
            ),
            (
                message().with_header("h", "a\u{0}b"),
                ("header value", "contains a control character"),
            ),
        ];
        for (result, expected) in cases {
            assert_eq!(reason(result), expected);
        }
        let mut many = message();
        for n in 0..OutgoingMessage::MAX_HEADERS {
            many = many.with_header(format!("h{n}"), "v").unwrap();
        }
        assert_eq!(
            reason(many.with_header("one-more", "v")),
            ("headers", "more than 64 headers")
        );
    }

    #[test]
    fn an_invalid_message_is_permanent_and_quoted_truncated() {
        let error =
            OutgoingMessage::new(MessageId::new_v7(), "x y".repeat(100), "k", "T", []).unwrap_err();
        assert!(!error.is_retryable());
        assert_eq!(error.kind(), "invalid_outgoing_message");
        assert!(error.to_string().len() < 200, "{error}");
    }

    #[test]
    fn the_publish_backoff_doubles_up_to_its_cap_and_ends_dead() {
        let retry = PublishRetry {
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(1),
            max_attempts: NonZeroU32::new(3).unwrap(),
        };
        let delays: Vec<u128> = (1..=6).map(|n| retry.delay(n).as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(retry.delay(u32::MAX), Duration::from_secs(1));
        assert!(!retry.is_dead(2) && retry.is_dead(3) && retry.is_dead(4));
        assert!(PublishRetry::default().delay(1) <= PublishRetry::default().max_delay);
    }

    #[test]
    fn a_lease_lists_its_ids_in_order() {
        let (a, b) = (message(), message());
        let lease = OutboxLease {
            id: LeaseId::new(),
            expires_at: Utc::now(),
            messages: vec![a.clone(), b.clone()],
        };
        assert_eq!(lease.ids(), vec![a.id(), b.id()]);
        assert!(!lease.is_empty());
        assert_ne!(LeaseId::new(), LeaseId::default());
        let id = LeaseId::new();
        assert_eq!(id.to_string(), id.as_uuid().to_string());
    }
}
