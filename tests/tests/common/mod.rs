//! The memory backend's harness, shared by this crate's test files.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use inbox_api::{ConsumerName, InboxError, InboxKey, InboxRecord, MessageId};
use inbox_backend_memory::{ManualClock, MemoryStore, MemoryTransaction};
use inbox_conformance::Harness;

/// Effects are KV entries `effect/<message>/<consumer>/<unique>`: appended,
/// never overwritten, so doubles stay countable.
const EFFECT_PREFIX: &str = "effect/";

/// A memory store with a manual clock, so cleanup is testable.
#[derive(Clone)]
pub(crate) struct MemoryUnderTest {
    pub(crate) store: MemoryStore,
    pub(crate) clock: Arc<ManualClock>,
}

#[async_trait]
impl inbox_api::InboxStore for MemoryUnderTest {
    type Transaction = MemoryTransaction;

    async fn begin(&self) -> Result<MemoryTransaction, InboxError> {
        self.store.begin().await
    }

    async fn lookup(&self, key: &InboxKey) -> Result<Option<InboxRecord>, InboxError> {
        self.store.lookup(key).await
    }

    async fn purge_processed_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: std::num::NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.store.purge_processed_batch(cutoff, limit).await
    }
}

#[async_trait]
impl inbox_api::ResponseStore for MemoryUnderTest {
    async fn kept_response(&self, key: &InboxKey) -> Result<Option<Vec<u8>>, InboxError> {
        self.store.kept_response(key).await
    }
}

#[async_trait]
impl inbox_api::InboxStats for MemoryUnderTest {
    async fn processed_counts(&self) -> Result<BTreeMap<String, u64>, InboxError> {
        self.store.processed_counts().await
    }
}

#[async_trait]
impl inbox_api::OutboxStore for MemoryUnderTest {
    async fn take_pending(
        &self,
        limit: std::num::NonZeroU32,
        lease: Duration,
    ) -> Result<inbox_api::OutboxLease, InboxError> {
        self.store.take_pending(limit, lease).await
    }

    async fn mark_published(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        self.store.mark_published(ids).await
    }

    async fn release(&self, lease: &inbox_api::OutboxLease) -> Result<u64, InboxError> {
        self.store.release(lease).await
    }

    async fn lookup_outgoing(
        &self,
        id: &MessageId,
    ) -> Result<Option<inbox_api::OutboxRecord>, InboxError> {
        self.store.lookup_outgoing(id).await
    }

    async fn pending_count(&self) -> Result<u64, InboxError> {
        self.store.pending_count().await
    }

    async fn dead_count(&self) -> Result<u64, InboxError> {
        self.store.dead_count().await
    }

    async fn purge_published_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: std::num::NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.store.purge_published_batch(cutoff, limit).await
    }

    async fn record_refusals(
        &self,
        lease: &inbox_api::LeaseId,
        refusals: &[(MessageId, String)],
        retry: &inbox_api::PublishRetry,
    ) -> Result<inbox_api::Refused, InboxError> {
        self.store.record_refusals(lease, refusals, retry).await
    }

    async fn dead_outgoing(
        &self,
        limit: std::num::NonZeroU32,
    ) -> Result<Vec<inbox_api::OutboxRecord>, InboxError> {
        self.store.dead_outgoing(limit).await
    }

    async fn requeue_dead(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        self.store.requeue_dead(ids).await
    }
}

pub(crate) struct MemoryHarness;

#[allow(dead_code)] // used by memory.rs, not by every test file
pub(crate) async fn memory_harness() -> MemoryHarness {
    MemoryHarness
}

#[async_trait]
impl Harness for MemoryHarness {
    type Store = MemoryUnderTest;

    fn name(&self) -> String {
        "memory".to_owned()
    }

    async fn fresh_store(&self) -> MemoryUnderTest {
        let clock = Arc::new(ManualClock::new(Utc::now()));
        MemoryUnderTest {
            store: MemoryStore::with_clock(clock.clone()),
            clock,
        }
    }

    async fn record_effect(
        &self,
        tx: &mut MemoryTransaction,
        key: &InboxKey,
    ) -> Result<(), InboxError> {
        let unique = uuid::Uuid::new_v4();
        tx.put(
            format!(
                "{EFFECT_PREFIX}{}/{}/{unique}",
                key.message_id, key.consumer
            ),
            b"1".to_vec(),
        );
        Ok(())
    }

    async fn effects(&self, store: &MemoryUnderTest) -> BTreeMap<InboxKey, u64> {
        let mut effects = BTreeMap::new();
        for (name, _) in store.store.scan_prefix(EFFECT_PREFIX) {
            let mut parts = name[EFFECT_PREFIX.len()..].splitn(3, '/');
            let (Some(message), Some(consumer)) = (parts.next(), parts.next()) else {
                panic!("malformed effect key {name}");
            };
            let key = InboxKey::new(
                MessageId::parse(message).expect("effect keys hold message ids"),
                ConsumerName::new(consumer).expect("effect keys hold consumer names"),
            );
            *effects.entry(key).or_default() += 1;
        }
        effects
    }

    async fn inbox_rows(&self, store: &MemoryUnderTest) -> Vec<InboxRecord> {
        store.store.records()
    }

    async fn age_rows(&self, store: &MemoryUnderTest, age: Duration) {
        store.clock.advance(age);
    }

    async fn store_now(&self, store: &MemoryUnderTest) -> DateTime<Utc> {
        inbox_backend_memory::Clock::now(&*store.clock)
    }
}

#[async_trait]
impl inbox_conformance::OutboxHarness for MemoryHarness {
    /// The manual clock moves: leases run out and rows age together.
    async fn age_outbox(&self, store: &MemoryUnderTest, age: Duration) {
        store.clock.advance(age);
    }
}

#[async_trait]
impl inbox_api::AttemptLedger for MemoryUnderTest {
    async fn record_failure(
        &self,
        key: &InboxKey,
        error: &inbox_api::LastError,
    ) -> Result<u32, InboxError> {
        self.store.record_failure(key, error).await
    }

    async fn mark_dead(
        &self,
        key: &InboxKey,
        reason: &str,
        error: &inbox_api::LastError,
    ) -> Result<(), InboxError> {
        self.store.mark_dead(key, reason, error).await
    }

    async fn attempts(
        &self,
        key: &InboxKey,
    ) -> Result<Option<inbox_api::AttemptRecord>, InboxError> {
        self.store.attempts(key).await
    }

    async fn dead_messages(
        &self,
        consumer: Option<&ConsumerName>,
        limit: std::num::NonZeroU32,
    ) -> Result<Vec<inbox_api::AttemptRecord>, InboxError> {
        self.store.dead_messages(consumer, limit).await
    }

    async fn purge_attempts_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: std::num::NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.store.purge_attempts_batch(cutoff, limit).await
    }
}

#[async_trait]
impl inbox_conformance::LedgerHarness for MemoryHarness {
    /// The manual clock moves: every row ages together.
    async fn age_attempts(&self, store: &MemoryUnderTest, age: Duration) {
        store.clock.advance(age);
    }
}
