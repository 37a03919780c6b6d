//! The attempt ledger: failed deliveries per `(message, consumer)`, with
//! PostgreSQL's semantics (`inbox_attempts` in `inbox-postgres`).
//!
//! Kept apart from the transactions on purpose: a failure is recorded after
//! the consumer's transaction rolled back, so it must not share that
//! transaction's fate. Every call changes the ledger at once, under one
//! mutex: failures are rare next to claims, and each call is a few map
//! operations. The mutex is never held while an inbox shard is locked.

use std::num::NonZeroU32;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use inbox_api::{
    AttemptLedger, AttemptRecord, ConsumerName, DeadMark, InboxError, InboxKey, InboxStore,
    LastError,
};

use crate::store::{Map, MemoryStore, lock};

/// Every ledger row, by key.
pub(crate) type Ledger = Map<InboxKey, AttemptRecord>;

/// A key's first row, counting `attempts`, at `now`.
fn new_row(key: &InboxKey, attempts: u32, now: DateTime<Utc>) -> AttemptRecord {
    AttemptRecord {
        key: key.clone(),
        attempts,
        last_error: String::new(),
        first_failed_at: now,
        last_failed_at: now,
        dead: None,
    }
}

#[async_trait]
impl AttemptLedger for MemoryStore {
    async fn record_failure(&self, key: &InboxKey, error: &LastError) -> Result<u32, InboxError> {
        let now = self.shared.clock.now();
        let mut ledger = lock(&self.shared.attempts);
        let row = ledger
            .entry(key.clone())
            .or_insert_with(|| new_row(key, 0, now));
        if row.dead.take().is_some() {
            // A replayed dead message: a fresh count.
            row.attempts = 0;
            row.first_failed_at = now;
        }
        row.attempts = row.attempts.saturating_add(1);
        row.last_error = error.as_str().to_owned();
        row.last_failed_at = now;
        Ok(row.attempts)
    }

    async fn mark_dead(
        &self,
        key: &InboxKey,
        reason: &str,
        error: &LastError,
    ) -> Result<(), InboxError> {
        let now = self.shared.clock.now();
        let mut ledger = lock(&self.shared.attempts);
        let row = ledger
            .entry(key.clone())
            .or_insert_with(|| new_row(key, 1, now));
        row.last_error = error.as_str().to_owned();
        row.last_failed_at = now;
        row.dead = Some(DeadMark {
            at: now,
            reason: reason.to_owned(),
        });
        Ok(())
    }

    async fn attempts(&self, key: &InboxKey) -> Result<Option<AttemptRecord>, InboxError> {
        Ok(lock(&self.shared.attempts).get(key).cloned())
    }

    async fn dead_messages(
        &self,
        consumer: Option<&ConsumerName>,
        limit: NonZeroU32,
    ) -> Result<Vec<AttemptRecord>, InboxError> {
        let mut dead: Vec<AttemptRecord> = lock(&self.shared.attempts)
            .values()
            .filter(|row| row.dead.is_some())
            .filter(|row| consumer.is_none_or(|c| row.key.consumer == *c))
            .cloned()
            .collect();
        // Newest dead mark first, as the SQL's ORDER BY dead_at DESC.
        dead.sort_by(|a, b| {
            let at = |r: &AttemptRecord| r.dead.as_ref().map(|d| d.at);
            at(b).cmp(&at(a)).then_with(|| a.key.cmp(&b.key))
        });
        let mut listed = Vec::new();
        for row in dead {
            if listed.len() >= limit.get() as usize {
                break;
            }
            // Processed since (a replay that succeeded): not dead any more.
            if self.lookup(&row.key).await?.is_none() {
                listed.push(row);
            }
        }
        Ok(listed)
    }

    async fn purge_attempts_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        let mut ledger = lock(&self.shared.attempts);
        let mut old: Vec<(DateTime<Utc>, InboxKey)> = ledger
            .values()
            .filter(|row| row.last_failed_at < cutoff)
            .map(|row| (row.last_failed_at, row.key.clone()))
            .collect();
        old.sort_unstable();
        old.truncate(limit.get() as usize);
        for (_, key) in &old {
            ledger.remove(key);
        }
        Ok(old.len() as u64)
    }
}
