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
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, TimeDelta, Utc};
use inbox_api::{
    InboxError, LeaseId, MessageId, OutboxLease, OutboxRecord, OutboxStore, OutgoingMessage,
};

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
}

/// Every committed outgoing row, with the two indexes the SQL table has.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    rows: Map<MessageId, Row>,
    /// Pending rows in enqueue order: the partial index the relay scans.
    pending: BTreeMap<u64, MessageId>,
    /// Published rows by age: the partial index cleanup scans.
    published: BTreeSet<(DateTime<Utc>, u64, MessageId)>,
    next_position: u64,
}

impl Outbox {
    /// Whether a committed row has this id.
    pub(crate) fn contains(&self, id: &MessageId) -> bool {
        self.rows.contains_key(id)
    }

    /// Adds a committed row, unless one with its id exists (the first
    /// commit wins, as the primary key decides on PostgreSQL).
    pub(crate) fn insert(&mut self, message: OutgoingMessage, created_at: DateTime<Utc>) {
        let id = message.id();
        if self.rows.contains_key(&id) {
            return;
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
            },
        );
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
            if row.lease.is_some_and(|(_, until)| until > now) {
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

    async fn purge_published_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        let limit = usize::try_from(limit.get()).unwrap_or(usize::MAX);
        Ok(self.shared.lock_outbox().purge(cutoff, limit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message() -> OutgoingMessage {
        OutgoingMessage::new(MessageId::new_v7(), "e", "k", "T", b"x".to_vec()).unwrap()
    }

    #[test]
    fn take_skips_live_leases_and_published_rows() {
        let t0 = DateTime::<Utc>::from_timestamp(0, 0).unwrap();
        let later = t0 + TimeDelta::seconds(30);
        let mut outbox = Outbox::default();
        let (a, b, c) = (message(), message(), message());
        for m in [&a, &b, &c] {
            outbox.insert(m.clone(), t0);
        }
        outbox.insert(a.clone(), later);
        assert_eq!(outbox.rows.len(), 3, "the first row of an id wins");

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
        assert!(!outbox.contains(&a.id()));
    }
}
