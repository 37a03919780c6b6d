//! The outbox: committed outgoing rows, their leases, and the relay's
//! operations, with PostgreSQL's semantics (`outbox_messages` in
//! `inbox-postgres`).
//!
//! Rows become visible with the commit of the transaction that enqueued
//! them (see `Shared::commit`), never before. Leases are deadlines on the
//! store's [`crate::Clock`], as `locked_until` is on PostgreSQL: a relay
//! that dies holds nothing once its lease has run out. One mutex guards the
//! whole outbox: every operation on it is a few map operations, and the
//! relay's calls are rare next to the consumers' claims.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, TimeDelta, Utc};
use inbox_api::{
    InboxError, LeaseId, MessageId, OutboxLease, OutboxRecord, OutboxStore, OutgoingMessage,
    PublishRetry, Refused,
};

use tokio_sync::sync::Notify;
use tokio_sync::sync::futures::OwnedNotified;

use crate::deadlock::TxId;
use crate::store::{Map, MemoryStore};

/// One committed outgoing row.
#[derive(Debug)]
struct Row {
    message: OutgoingMessage,
    position: u64,
    created_at: DateTime<Utc>,
    published_at: Option<DateTime<Utc>>,
    /// The lease holding it, and until when.
    lease: Option<(LeaseId, DateTime<Utc>)>,
    attempts: u32,
    /// The broker's refusals, its last answer, the backoff's end, and when
    /// it died (then it is out of `pending`, as the SQL filters it out).
    failures: u32,
    last_error: Option<String>,
    next_attempt_at: Option<DateTime<Utc>>,
    dead_at: Option<DateTime<Utc>>,
}

/// An id an open transaction enqueued: the memory twin of the uncommitted
/// tuple's entry in the primary key's index, which makes a second enqueue
/// of the id wait on PostgreSQL.
#[derive(Debug)]
struct Reservation {
    owner: TxId,
    /// Created by the first enqueue that has to wait.
    waiters: Option<Arc<Notify>>,
}

/// What an enqueue found, decided under the outbox lock.
pub(crate) enum EnqueueAttempt {
    /// The id was free: this transaction holds it now.
    Fresh,
    /// Committed already, or enqueued by this same transaction.
    Duplicate,
    /// Enqueued by the open transaction `owner`; `released` resolves when
    /// it ends.
    Wait {
        /// The holder.
        owner: TxId,
        /// Registered under the lock, so the holder's end cannot be missed.
        released: OwnedNotified,
    },
}

/// Every committed outgoing row, with the two indexes the SQL table has,
/// and the ids open transactions have enqueued.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    rows: Map<MessageId, Row>,
    reserved: Map<MessageId, Reservation>,
    /// Pending rows in enqueue order: the partial index the relay scans.
    pending: BTreeMap<u64, MessageId>,
    /// Published rows by age: the partial index cleanup scans.
    published: BTreeSet<(DateTime<Utc>, u64, MessageId)>,
    next_position: u64,
}

impl Outbox {
    /// The atomic insert-or-nothing of an enqueue: reserves `id` for
    /// transaction `me`, or says why it cannot.
    pub(crate) fn try_reserve(&mut self, id: MessageId, me: TxId) -> EnqueueAttempt {
        if self.rows.contains_key(&id) {
            return EnqueueAttempt::Duplicate;
        }
        match self.reserved.get_mut(&id) {
            None => {
                self.reserved.insert(
                    id,
                    Reservation {
                        owner: me,
                        waiters: None,
                    },
                );
                EnqueueAttempt::Fresh
            }
            Some(reservation) if reservation.owner == me => EnqueueAttempt::Duplicate,
            Some(reservation) => {
                let notify = reservation.waiters.get_or_insert_with(Default::default);
                EnqueueAttempt::Wait {
                    owner: reservation.owner,
                    released: Arc::clone(notify).notified_owned(),
                }
            }
        }
    }

    /// Drops `owner`'s reservation of `id` (rollback, drop, a savepoint
    /// rolled back) and hands back whom to wake.
    pub(crate) fn unreserve(&mut self, id: &MessageId, owner: TxId) -> Option<Arc<Notify>> {
        match self.reserved.get(id) {
            Some(reservation) if reservation.owner == owner => {}
            _ => return None,
        }
        self.reserved.remove(id).and_then(|r| r.waiters)
    }

    /// Turns `owner`'s reservation into a committed row and hands back whom
    /// to wake: a waiting enqueue of the id then finds the row.
    pub(crate) fn insert(
        &mut self,
        message: OutgoingMessage,
        created_at: DateTime<Utc>,
        owner: TxId,
    ) -> Option<Arc<Notify>> {
        let id = message.id();
        let waiters = self.unreserve(&id, owner);
        if self.rows.contains_key(&id) {
            // Unreachable while reservations work: a committed id is never
            // reserved again.
            return waiters;
        }
        let position = self.next_position;
        self.next_position += 1;
        self.pending.insert(position, id);
        self.rows.insert(
            id,
            Row {
                message,
                position,
                created_at,
                published_at: None,
                lease: None,
                attempts: 0,
                failures: 0,
                last_error: None,
                next_attempt_at: None,
                dead_at: None,
            },
        );
        waiters
    }

    fn take(
        &mut self,
        now: DateTime<Utc>,
        limit: usize,
        lease: LeaseId,
        until: DateTime<Utc>,
    ) -> Vec<OutgoingMessage> {
        let mut taken = Vec::new();
        for id in self.pending.values() {
            if taken.len() == limit {
                break;
            }
            let Some(row) = self.rows.get_mut(id) else {
                continue;
            };
            if row.lease.is_some_and(|(_, until)| until > now)
                || row.next_attempt_at.is_some_and(|next| next > now)
            {
                continue;
            }
            row.lease = Some((lease, until));
            row.attempts = row.attempts.saturating_add(1);
            taken.push(row.message.clone());
        }
        taken
    }

    fn mark_published(&mut self, ids: &[MessageId], now: DateTime<Utc>) -> u64 {
        let mut marked = 0;
        for id in ids {
            let Some(row) = self.rows.get_mut(id) else {
                continue;
            };
            if row.published_at.is_some() {
                continue;
            }
            row.published_at = Some(now);
            row.lease = None;
            self.pending.remove(&row.position);
            self.published.insert((now, row.position, *id));
            marked += 1;
        }
        marked
    }

    fn release(&mut self, lease: &OutboxLease) -> u64 {
        let mut released = 0;
        for id in lease.ids() {
            if let Some(row) = self.rows.get_mut(&id)
                && row.published_at.is_none()
                && row.lease.is_some_and(|(holder, _)| holder == lease.id)
            {
                row.lease = None;
                released += 1;
            }
        }
        released
    }

    fn record_refusals(
        &mut self,
        lease: &LeaseId,
        refusals: &[(MessageId, String)],
        retry: &PublishRetry,
        now: DateTime<Utc>,
    ) -> Refused {
        let mut refused = Refused::default();
        for (id, error) in refusals {
            let Some(row) = self.rows.get_mut(id) else {
                continue;
            };
            if row.published_at.is_some()
                || row.dead_at.is_some()
                || row.lease.is_none_or(|(holder, _)| holder != *lease)
            {
                continue;
            }
            row.failures = row.failures.saturating_add(1);
            row.last_error = Some(error.clone());
            row.lease = None;
            refused.recorded += 1;
            if retry.is_dead(row.failures) {
                row.next_attempt_at = None;
                row.dead_at = Some(now);
                self.pending.remove(&row.position);
                refused.dead.push(*id);
            } else {
                let delay =
                    TimeDelta::from_std(retry.delay(row.failures)).unwrap_or(TimeDelta::MAX);
                row.next_attempt_at = Some(
                    now.checked_add_signed(delay)
                        .unwrap_or(DateTime::<Utc>::MAX_UTC),
                );
            }
        }
        refused
    }

    fn dead(&self, limit: usize) -> Vec<OutboxRecord> {
        let mut dead: Vec<&Row> = self.rows.values().filter(|r| r.dead_at.is_some()).collect();
        dead.sort_by_key(|r| std::cmp::Reverse((r.dead_at, r.position)));
        dead.into_iter()
            .take(limit)
            .filter_map(|row| self.record(&row.message.id()))
            .collect()
    }

    fn requeue_dead(&mut self, ids: &[MessageId]) -> u64 {
        let mut requeued = 0;
        for id in ids {
            if let Some(row) = self.rows.get_mut(id)
                && row.dead_at.is_some()
                && row.published_at.is_none()
            {
                row.dead_at = None;
                row.failures = 0;
                row.next_attempt_at = None;
                row.lease = None;
                self.pending.insert(row.position, *id);
                requeued += 1;
            }
        }
        requeued
    }

    fn purge(&mut self, cutoff: DateTime<Utc>, limit: usize) -> u64 {
        let mut deleted = 0;
        while deleted < limit {
            match self.published.first() {
                Some((at, _, _)) if *at < cutoff => {}
                _ => break,
            }
            if let Some((_, _, id)) = self.published.pop_first() {
                self.rows.remove(&id);
                deleted += 1;
            }
        }
        deleted as u64
    }

    fn record(&self, id: &MessageId) -> Option<OutboxRecord> {
        self.rows.get(id).map(|row| OutboxRecord {
            message: row.message.clone(),
            created_at: row.created_at,
            published_at: row.published_at,
            attempts: row.attempts,
            failures: row.failures,
            last_error: row.last_error.clone(),
            next_attempt_at: row.next_attempt_at,
            dead_at: row.dead_at,
        })
    }
}

#[async_trait]
impl OutboxStore for MemoryStore {
    async fn take_pending(
        &self,
        limit: NonZeroU32,
        lease: Duration,
    ) -> Result<OutboxLease, InboxError> {
        let id = LeaseId::new();
        let now = self.shared.clock.now();
        // Whole milliseconds, at least one, as on PostgreSQL.
        let millis = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX).max(1);
        let expires_at = now
            .checked_add_signed(TimeDelta::try_milliseconds(millis).unwrap_or(TimeDelta::MAX))
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        let limit = usize::try_from(limit.get()).unwrap_or(usize::MAX);
        let messages = self.shared.lock_outbox().take(now, limit, id, expires_at);
        Ok(OutboxLease {
            id,
            expires_at,
            messages,
        })
    }

    async fn mark_published(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        let now = self.shared.clock.now();
        Ok(self.shared.lock_outbox().mark_published(ids, now))
    }

    async fn release(&self, lease: &OutboxLease) -> Result<u64, InboxError> {
        Ok(self.shared.lock_outbox().release(lease))
    }

    async fn lookup_outgoing(&self, id: &MessageId) -> Result<Option<OutboxRecord>, InboxError> {
        Ok(self.shared.lock_outbox().record(id))
    }

    async fn pending_count(&self) -> Result<u64, InboxError> {
        Ok(self.shared.lock_outbox().pending.len() as u64)
    }

    async fn dead_count(&self) -> Result<u64, InboxError> {
        let outbox = self.shared.lock_outbox();
        Ok(outbox.rows.values().filter(|r| r.dead_at.is_some()).count() as u64)
    }

    async fn purge_published_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        let limit = usize::try_from(limit.get()).unwrap_or(usize::MAX);
        Ok(self.shared.lock_outbox().purge(cutoff, limit))
    }

    async fn record_refusals(
        &self,
        lease: &LeaseId,
        refusals: &[(MessageId, String)],
        retry: &PublishRetry,
    ) -> Result<Refused, InboxError> {
        let now = self.shared.clock.now();
        Ok(self
            .shared
            .lock_outbox()
            .record_refusals(lease, refusals, retry, now))
    }

    async fn dead_outgoing(&self, limit: NonZeroU32) -> Result<Vec<OutboxRecord>, InboxError> {
        let limit = usize::try_from(limit.get()).unwrap_or(usize::MAX);
        Ok(self.shared.lock_outbox().dead(limit))
    }

    async fn requeue_dead(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        Ok(self.shared.lock_outbox().requeue_dead(ids))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message() -> OutgoingMessage {
        OutgoingMessage::new(MessageId::new_v7(), "e", "k", "T", b"x".to_vec()).unwrap()
    }

    #[test]
    fn a_reserved_id_makes_others_wait_until_its_owner_ends() {
        let mut outbox = Outbox::default();
        let m = message();
        assert!(matches!(
            outbox.try_reserve(m.id(), 1),
            EnqueueAttempt::Fresh
        ));
        assert!(matches!(
            outbox.try_reserve(m.id(), 1),
            EnqueueAttempt::Duplicate
        ));
        let EnqueueAttempt::Wait { owner, .. } = outbox.try_reserve(m.id(), 2) else {
            panic!("another transaction must wait");
        };
        assert_eq!(owner, 1);
        assert!(outbox.unreserve(&m.id(), 2).is_none(), "only the owner");
        assert!(
            outbox.unreserve(&m.id(), 1).is_some(),
            "the waiter is woken"
        );
        assert!(matches!(
            outbox.try_reserve(m.id(), 2),
            EnqueueAttempt::Fresh
        ));
    }

    #[test]
    fn take_skips_live_leases_and_published_rows() {
        let t0 = DateTime::<Utc>::from_timestamp(0, 0).unwrap();
        let later = t0 + TimeDelta::seconds(30);
        let mut outbox = Outbox::default();
        let (a, b, c) = (message(), message(), message());
        for m in [&a, &b, &c] {
            assert!(matches!(
                outbox.try_reserve(m.id(), 1),
                EnqueueAttempt::Fresh
            ));
            assert!(outbox.insert(m.clone(), t0, 1).is_none());
        }
        assert!(matches!(
            outbox.try_reserve(a.id(), 2),
            EnqueueAttempt::Duplicate
        ));
        assert_eq!(outbox.rows.len(), 3);

        let first = LeaseId::new();
        let taken = outbox.take(t0, 2, first, later);
        assert_eq!(taken, vec![a.clone(), b.clone()]);
        let second = outbox.take(t0, 10, LeaseId::new(), later);
        assert_eq!(second, vec![c.clone()]);
        assert_eq!(outbox.mark_published(&[a.id(), a.id()], t0), 1);
        // At the deadline the lease has run out.
        let retaken = outbox.take(later, 10, LeaseId::new(), later);
        assert_eq!(retaken, vec![b.clone(), c.clone()]);
        assert_eq!(outbox.record(&b.id()).map(|r| r.attempts), Some(2));
        assert_eq!(outbox.purge(t0 + TimeDelta::seconds(1), 10), 1);
        assert!(!outbox.rows.contains_key(&a.id()));
    }
}
