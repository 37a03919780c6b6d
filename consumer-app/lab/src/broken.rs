//! The conformance suite's deliberately broken stores, runnable as Parcel
//! stores (`parcel-lab-consume --fault-broken-store <kind>`).
//!
//! A newtype over [`BrokenStore`] and its transaction: the Parcel traits
//! and the broken store live in two other crates, so only a type of this
//! crate may join them. The inbox methods go to the broken store (that is
//! the point); every Parcel method goes to the correct store underneath.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use consumer_app::parcel::effects::{
    CarrierAssignment, Intent, Notification, NotificationKind, ParcelEffects,
};
use consumer_app::parcel::events::ParcelCreatedEvent;
use consumer_app::parcel::role::Role;
use consumer_app::parcel::store::{EffectCounts, ParcelStore, StoreKind};
use inbox_api::{
    AttemptLedger, AttemptRecord, BatchTransaction, Claim, ConsumerName, EnqueueOutcome,
    InboxError, InboxKey, InboxRecord, InboxStats, InboxStore, InboxTransaction, LastError,
    MessageId, OutboxLease, OutboxRecord, OutboxStore, OutboxTransaction, OutgoingMessage,
    ResponseStore, ResponseTransaction,
};
use inbox_conformance::broken::{Broken, BrokenStore, BrokenTransaction};
use inbox_runtime::AppError;

/// Parses a `--fault-broken-store` name.
///
/// # Errors
/// [`AppError::Config`] for a name that is not a broken store.
pub fn parse(name: &str) -> Result<Broken, AppError> {
    match name {
        "claim-in-own-transaction" => Ok(Broken::ClaimInOwnTransaction),
        "check-then-insert" => Ok(Broken::CheckThenInsert),
        "work-before-claim" => Ok(Broken::WorkBeforeClaim),
        "claim-without-waiting" => Ok(Broken::ClaimWithoutWaiting),
        other => Err(AppError::Config(format!(
            "--fault-broken-store {other:?}: not a broken store"
        ))),
    }
}

/// A correct Parcel store `S` whose inbox is broken the way its kind says.
#[derive(Clone, Debug)]
pub struct BrokenParcelStore<S>(BrokenStore<S>);

impl<S> BrokenParcelStore<S> {
    /// `store`, broken the way `kind` says.
    pub fn new(store: S, kind: Broken) -> Self {
        Self(BrokenStore::new(store, kind))
    }
}

/// The transaction of a [`BrokenParcelStore`].
pub struct BrokenParcelTransaction<S: InboxStore>(BrokenTransaction<S>);

#[async_trait]
impl<S: InboxStore + Clone> InboxStore for BrokenParcelStore<S> {
    type Transaction = BrokenParcelTransaction<S>;

    async fn begin(&self) -> Result<Self::Transaction, InboxError> {
        Ok(BrokenParcelTransaction(self.0.begin().await?))
    }

    async fn lookup(&self, key: &InboxKey) -> Result<Option<InboxRecord>, InboxError> {
        self.0.lookup(key).await
    }

    async fn purge_processed_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.0.purge_processed_batch(cutoff, limit).await
    }

    async fn purge_processed_batch_from(
        &self,
        cutoff: DateTime<Utc>,
        from: Option<DateTime<Utc>>,
        limit: NonZeroU32,
    ) -> Result<inbox_api::PurgedBatch, InboxError> {
        self.0.purge_processed_batch_from(cutoff, from, limit).await
    }
}

#[async_trait]
impl<S: InboxStats + Clone> InboxStats for BrokenParcelStore<S> {
    async fn processed_counts(&self) -> Result<BTreeMap<String, u64>, InboxError> {
        self.0.processed_counts().await
    }
}

/// The ledger is sound in every broken inbox: the one underneath.
#[async_trait]
impl<S: AttemptLedger + Clone> AttemptLedger for BrokenParcelStore<S> {
    async fn record_failure(&self, key: &InboxKey, error: &LastError) -> Result<u32, InboxError> {
        self.0.record_failure(key, error).await
    }

    async fn mark_dead(
        &self,
        key: &InboxKey,
        reason: &str,
        error: &LastError,
    ) -> Result<(), InboxError> {
        self.0.mark_dead(key, reason, error).await
    }

    async fn attempts(&self, key: &InboxKey) -> Result<Option<AttemptRecord>, InboxError> {
        self.0.attempts(key).await
    }

    async fn dead_messages(
        &self,
        consumer: Option<&ConsumerName>,
        limit: NonZeroU32,
    ) -> Result<Vec<AttemptRecord>, InboxError> {
        self.0.dead_messages(consumer, limit).await
    }

    async fn purge_attempts_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.0.purge_attempts_batch(cutoff, limit).await
    }
}

#[async_trait]
impl<S: InboxStore + Clone> InboxTransaction for BrokenParcelTransaction<S> {
    async fn claim(&mut self, key: &InboxKey) -> Result<Claim, InboxError> {
        self.0.claim(key).await
    }

    async fn commit(self) -> Result<(), InboxError> {
        self.0.commit().await
    }

    async fn rollback(self) -> Result<(), InboxError> {
        self.0.rollback().await
    }
}

#[async_trait]
impl<S> ResponseTransaction for BrokenParcelTransaction<S>
where
    S: InboxStore<Transaction: ResponseTransaction> + Clone,
{
    async fn keep_response(&mut self, key: &InboxKey, response: &[u8]) -> Result<(), InboxError> {
        self.0.keep_response(key, response).await
    }
}

#[async_trait]
impl<S> ResponseStore for BrokenParcelStore<S>
where
    S: ResponseStore<Transaction: ResponseTransaction> + Clone,
{
    async fn kept_response(&self, key: &InboxKey) -> Result<Option<Vec<u8>>, InboxError> {
        self.0.kept_response(key).await
    }
}

#[async_trait]
impl<S> BatchTransaction for BrokenParcelTransaction<S>
where
    S: InboxStore<Transaction: BatchTransaction> + Clone,
{
    async fn claim_batch(&mut self, keys: &[InboxKey]) -> Result<Vec<Claim>, InboxError> {
        self.0.claim_batch(keys).await
    }

    async fn savepoint(&mut self) -> Result<(), InboxError> {
        self.0.savepoint().await
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), InboxError> {
        self.0.rollback_to_savepoint().await
    }

    async fn release_savepoint(&mut self) -> Result<(), InboxError> {
        self.0.release_savepoint().await
    }

    async fn unclaim(&mut self, key: &InboxKey) -> Result<(), InboxError> {
        self.0.unclaim(key).await
    }
}

/// The outbox goes to the broken store too: its outbox kinds
/// (`PublishBeforeCommit`, `LeaseIgnored`) break it, the others pass it on.
#[async_trait]
impl<S: OutboxStore + Clone> OutboxTransaction for BrokenParcelTransaction<S> {
    async fn enqueue(&mut self, message: &OutgoingMessage) -> Result<EnqueueOutcome, InboxError> {
        self.0.enqueue(message).await
    }
}

#[async_trait]
impl<S: OutboxStore + Clone> OutboxStore for BrokenParcelStore<S> {
    async fn take_pending(
        &self,
        limit: NonZeroU32,
        lease: Duration,
    ) -> Result<OutboxLease, InboxError> {
        self.0.take_pending(limit, lease).await
    }

    async fn mark_published(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        self.0.mark_published(ids).await
    }

    async fn release(&self, lease: &OutboxLease) -> Result<u64, InboxError> {
        self.0.release(lease).await
    }

    async fn lookup_outgoing(&self, id: &MessageId) -> Result<Option<OutboxRecord>, InboxError> {
        self.0.lookup_outgoing(id).await
    }

    async fn pending_count(&self) -> Result<u64, InboxError> {
        self.0.pending_count().await
    }

    async fn dead_count(&self) -> Result<u64, InboxError> {
        self.0.dead_count().await
    }

    async fn purge_published_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        self.0.purge_published_batch(cutoff, limit).await
    }

    async fn record_refusals(
        &self,
        lease: &inbox_api::LeaseId,
        refusals: &[(MessageId, String)],
        retry: &inbox_api::PublishRetry,
    ) -> Result<inbox_api::Refused, InboxError> {
        self.0.record_refusals(lease, refusals, retry).await
    }

    async fn dead_outgoing(&self, limit: NonZeroU32) -> Result<Vec<OutboxRecord>, InboxError> {
        self.0.dead_outgoing(limit).await
    }

    async fn requeue_dead(&self, ids: &[MessageId]) -> Result<u64, InboxError> {
        self.0.requeue_dead(ids).await
    }
}

impl<S> ParcelEffects for BrokenParcelTransaction<S>
where
    S: OutboxStore + Clone,
    S::Transaction: ParcelEffects,
{
    async fn record_notification(&mut self, n: &Notification) -> Result<(), AppError> {
        self.0.inner_mut().record_notification(n).await
    }

    async fn reserve_carrier_slot(&mut self, a: &CarrierAssignment) -> Result<(), AppError> {
        self.0.inner_mut().reserve_carrier_slot(a).await
    }

    async fn insert_parcel(&mut self, parcel: &ParcelCreatedEvent) -> Result<bool, AppError> {
        self.0.inner_mut().insert_parcel(parcel).await
    }

    async fn find_parcel(
        &mut self,
        parcel_id: &str,
    ) -> Result<Option<ParcelCreatedEvent>, AppError> {
        self.0.inner_mut().find_parcel(parcel_id).await
    }
}

impl<S: ParcelStore> ParcelStore for BrokenParcelStore<S> {
    fn kind(&self) -> StoreKind {
        self.0.inner().kind()
    }

    async fn migrate_all(&self) -> Result<(), AppError> {
        self.0.inner().migrate_all().await
    }

    async fn effect_counts(&self) -> Result<(EffectCounts, EffectCounts), AppError> {
        self.0.inner().effect_counts().await
    }

    async fn notification_counts(&self, kind: NotificationKind) -> Result<EffectCounts, AppError> {
        self.0.inner().notification_counts(kind).await
    }

    async fn parcel_count(&self) -> Result<u64, AppError> {
        self.0.inner().parcel_count().await
    }

    async fn drop_schema(&self) -> Result<(), AppError> {
        self.0.inner().drop_schema().await
    }

    async fn record_stub_call(
        &self,
        downstream: &str,
        idempotency_key: &str,
        parcel_id: &str,
    ) -> Result<u64, AppError> {
        self.0
            .inner()
            .record_stub_call(downstream, idempotency_key, parcel_id)
            .await
    }

    async fn mark_dispatched(&self, role: Role, message_id: &MessageId) -> Result<(), AppError> {
        self.0.inner().mark_dispatched(role, message_id).await
    }

    async fn undispatched(&self, min_age: Duration, limit: u32) -> Result<Vec<Intent>, AppError> {
        self.0.inner().undispatched(min_age, limit).await
    }
}

/// A relay (or producer) that breaks the outbox's promise, for the chaos
/// run to catch (`parcel-chaos --broken-relay <kind>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokenRelay {
    /// The producer publishes its event to the broker itself, before its
    /// transaction commits (the "dual write" the outbox replaces): a
    /// creation that then rolls back is delivered all the same, and its
    /// ghost gets effects. Applied by the harness's producer.
    PublishBeforeCommit,
    /// The relay marks a batch published as soon as it takes it, before
    /// the broker confirmed anything: a relay killed before the confirm
    /// loses the batch for good. Applied by `parcel-lab-relay`'s store
    /// ([`crate::relay_faults::FaultyOutbox`]).
    MarkBeforeConfirm,
}

impl BrokenRelay {
    /// Every broken relay, with its flag's name.
    pub const ALL: [(&'static str, BrokenRelay); 2] = [
        ("publish-before-commit", BrokenRelay::PublishBeforeCommit),
        ("mark-before-confirm", BrokenRelay::MarkBeforeConfirm),
    ];

    /// Parses a `--broken-relay` name.
    ///
    /// # Errors
    /// [`AppError::Config`] for a name that is not a broken relay.
    pub fn parse(name: &str) -> Result<Self, AppError> {
        Self::ALL
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, kind)| *kind)
            .ok_or_else(|| {
                AppError::Config(format!(
                    "--broken-relay {name:?}: not a broken relay (publish-before-commit, mark-before-confirm)"
                ))
            })
    }

    /// Its flag's name.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, kind)| *kind == self)
            .map_or("?", |(n, _)| n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_broken_store_has_a_name() {
        for (name, kind) in [
            ("claim-in-own-transaction", Broken::ClaimInOwnTransaction),
            ("check-then-insert", Broken::CheckThenInsert),
            ("work-before-claim", Broken::WorkBeforeClaim),
            ("claim-without-waiting", Broken::ClaimWithoutWaiting),
        ] {
            assert_eq!(parse(name).expect(name), kind);
        }
        assert_eq!(Broken::ALL.len(), 4);
        assert!(parse("fine").is_err());
    }

    #[test]
    fn every_broken_relay_has_a_name() {
        for (name, kind) in BrokenRelay::ALL {
            assert_eq!(BrokenRelay::parse(name).expect(name), kind);
            assert_eq!(kind.name(), name);
        }
        assert!(BrokenRelay::parse("fine").is_err());
    }
}
