//! The shared state: sharded inbox rows, sharded business key-value space.

use std::collections::btree_map::BTreeMap;
use std::collections::hash_map::{Entry, HashMap};
use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use foldhash::fast::RandomState;
use inbox_api::{
    Fingerprint, InboxError, InboxKey, InboxRecord, InboxStats, InboxStore, OutgoingMessage,
    ResponseStore,
};
use smallvec::SmallVec;
use tokio_sync::sync::Notify;

use crate::clock::{Clock, SystemClock};
use crate::deadlock::{TxId, WaitGraph};
use crate::outbox::Outbox;
use crate::processed::ProcessedIndex;
use crate::transaction::{Claims, MemoryTransaction};
use crate::writes::Writes;

/// Shards per map. Distinct keys contend only when they hash to the same
/// shard, and then only for the few instructions of a map operation; 64
/// keeps that rare on any machine this store is meant for.
pub(crate) const SHARDS: usize = 64;

/// Rows deleted under one shard lock at most, whatever the purge's limit,
/// so a large cleanup batch never stalls claims for long.
const PURGE_CHUNK: usize = 256;

/// Locks a mutex, recovering it if a thread panicked while holding it.
///
/// Recovering is sound here: every critical section in this crate is a
/// handful of map and set operations that do not panic (allocation failure
/// aborts rather than unwinds), so a poisoned lock still guards consistent
/// state. Refusing it would turn one panicking handler into a store that
/// fails every later call.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The hash map of this crate, with foldhash rather than the standard
/// SipHash: hashing is on the hot path (each message hashes its inbox key
/// three times and its business key twice, and the growing maps rehash
/// every key), and foldhash does it in a fraction of the time. Each map
/// gets its own random seed;
/// foldhash resists the casual collision attack a seeded hash does, not a
/// determined one studying the process (see its docs), which is enough for
/// a store whose keys come from the application's own producers.
pub(crate) type Map<K, V> = HashMap<K, V, RandomState>;

/// Keeps each shard's lock on its own cache lines, so that two cores
/// working on neighbouring shards do not slow each other down.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Padded<T>(T);

/// An inbox row's state.
#[derive(Debug)]
pub(crate) enum Slot {
    /// Claimed by an open transaction: other claimers wait for it to end,
    /// readers do not see it. The equivalent of Postgres' uncommitted tuple
    /// with its row lock.
    Pending {
        /// The transaction holding the claim.
        owner: TxId,
        /// When it was claimed; becomes the row's `received_at`.
        received_at: DateTime<Utc>,
        /// The claiming key's payload fingerprint, kept with the row.
        fingerprint: Option<Fingerprint>,
        /// Created by the first claimer that has to wait, so an uncontended
        /// claim allocates nothing for waking; signalled when the claim
        /// commits or is released.
        waiters: Option<Arc<Notify>>,
    },
    /// Committed: a claim of this key is a duplicate.
    Committed {
        /// When the claim was made, which is also when the message counts
        /// as processed: the row became visible only with the work's commit.
        received_at: DateTime<Utc>,
        /// The payload fingerprint the claim was made with.
        fingerprint: Option<Fingerprint>,
        /// The response kept with the claim (idempotent HTTP), if any.
        response: Option<Arc<[u8]>>,
    },
}

/// One shard of the inbox.
#[derive(Debug, Default)]
pub(crate) struct InboxShard {
    /// Every row, pending or committed.
    rows: Map<InboxKey, Slot>,
    /// Committed rows that are processed, oldest first: the memory twin of
    /// the SQL partial index on `processed_at`, so cleanup finds its rows
    /// without scanning the shard.
    processed: ProcessedIndex,
    /// How many rows are committed (the rest are pending).
    committed: usize,
}

/// What a claim found, decided under the shard lock.
pub(crate) enum ClaimAttempt {
    /// The key was free; this transaction holds it now.
    Fresh,
    /// Committed already, or held by this same transaction.
    Duplicate,
    /// Held by `owner`; `released` resolves when that transaction ends.
    Wait {
        /// The holder.
        owner: TxId,
        /// Registered before the shard lock was released, so the wake-up
        /// of a holder ending right after cannot be missed.
        released: tokio_sync::sync::futures::OwnedNotified,
    },
}

impl InboxShard {
    /// The atomic insert-or-nothing of a claim.
    pub(crate) fn try_claim(
        &mut self,
        key: &InboxKey,
        me: TxId,
        now: DateTime<Utc>,
    ) -> ClaimAttempt {
        match self.rows.entry(key.clone()) {
            Entry::Vacant(vacant) => {
                vacant.insert(Slot::Pending {
                    owner: me,
                    received_at: now,
                    fingerprint: key.fingerprint().copied(),
                    waiters: None,
                });
                ClaimAttempt::Fresh
            }
            Entry::Occupied(occupied) => match occupied.into_mut() {
                Slot::Committed { .. } => ClaimAttempt::Duplicate,
                // Postgres: a second `INSERT … ON CONFLICT DO NOTHING` of a
                // row this transaction inserted inserts nothing.
                Slot::Pending { owner, .. } if *owner == me => ClaimAttempt::Duplicate,
                Slot::Pending { owner, waiters, .. } => {
                    let notify = waiters.get_or_insert_with(Default::default);
                    // `notify_waiters` wakes every `Notified` created before
                    // it, polled or not: creating it here, under the lock
                    // the holder needs to end its claim, closes the window
                    // for a lost wake-up.
                    let released = Arc::clone(notify).notified_owned();
                    ClaimAttempt::Wait {
                        owner: *owner,
                        released,
                    }
                }
            },
        }
    }

    /// Turns `owner`'s pending claim of `key` into a committed row, and
    /// hands back whom to wake.
    pub(crate) fn commit_claim(
        &mut self,
        key: &InboxKey,
        owner: TxId,
        response: Option<Arc<[u8]>>,
    ) -> Option<Arc<Notify>> {
        match self.rows.get_mut(key) {
            Some(slot @ Slot::Pending { .. }) => {
                let Slot::Pending {
                    owner: holder,
                    received_at,
                    fingerprint,
                    waiters,
                } = slot
                else {
                    return None;
                };
                debug_assert_eq!(*holder, owner, "only the holder commits a claim");
                let waiters = waiters.take();
                let at = *received_at;
                *slot = Slot::Committed {
                    received_at: at,
                    fingerprint: *fingerprint,
                    response,
                };
                self.committed += 1;
                self.processed.insert((at, key.clone()));
                waiters
            }
            other => {
                // Unreachable: a pending claim is removed only by its own
                // transaction, and turns into a committed row only here.
                tracing::error!(%key, found = ?other, "committing a claim that is not pending");
                debug_assert!(false, "committing a claim that is not pending: {other:?}");
                None
            }
        }
    }

    /// Removes `owner`'s pending claim of `key` (rollback, drop, abort) and
    /// hands back whom to wake.
    pub(crate) fn release_claim(&mut self, key: &InboxKey, owner: TxId) -> Option<Arc<Notify>> {
        match self.rows.get(key) {
            Some(Slot::Pending { owner: holder, .. }) if *holder == owner => {}
            _ => return None,
        }
        match self.rows.remove(key) {
            Some(Slot::Pending { waiters, .. }) => waiters,
            _ => None,
        }
    }

    /// Deletes up to `limit` processed rows older than `cutoff`, oldest
    /// first, and returns how many went.
    fn purge(&mut self, cutoff: DateTime<Utc>, limit: usize) -> usize {
        let mut deleted = 0;
        while deleted < limit {
            match self.processed.first() {
                Some((at, _)) if *at < cutoff => {}
                _ => break,
            }
            if let Some((_, key)) = self.processed.pop_first() {
                // The index lists committed rows only; checking anyway keeps
                // a bug from ever deleting an in-flight claim.
                if let Some(Slot::Committed { .. }) = self.rows.get(&key) {
                    self.rows.remove(&key);
                    self.committed -= 1;
                    deleted += 1;
                }
            }
        }
        deleted
    }

    /// The response kept with `key`'s committed row, if any.
    pub(crate) fn kept_response(&self, key: &InboxKey) -> Option<Vec<u8>> {
        match self.rows.get(key) {
            Some(Slot::Committed { response, .. }) => response.as_deref().map(<[u8]>::to_vec),
            _ => None,
        }
    }

    fn record(key: &InboxKey, slot: &Slot) -> Option<InboxRecord> {
        match slot {
            Slot::Committed {
                received_at,
                fingerprint,
                ..
            } => Some(InboxRecord {
                key: InboxKey::new(key.message_id, key.consumer.clone()),
                received_at: *received_at,
                processed_at: Some(*received_at),
                fingerprint: *fingerprint,
            }),
            Slot::Pending { .. } => None,
        }
    }
}

/// One shard of the business key-value space: committed values only.
pub(crate) type KvShard = Map<String, Vec<u8>>;

/// A buffered business write: a value, or `None` for a delete.
pub(crate) type Write = Option<Vec<u8>>;

/// Everything a [`MemoryStore`] and its transactions share.
pub(crate) struct Shared {
    pub(crate) clock: Arc<dyn Clock>,
    /// Picks shards; the maps inside each shard hash with their own keys,
    /// so a shard's keys do not all land in neighbouring buckets.
    hasher: RandomState,
    inbox: Box<[Padded<Mutex<InboxShard>>]>,
    kv: Box<[Padded<Mutex<KvShard>>]>,
    next_tx: AtomicU64,
    pub(crate) waits: WaitGraph,
    /// Committed outgoing rows; locked after every inbox and key-value
    /// shard, last in the global lock order.
    outbox: Mutex<Outbox>,
    /// The attempt ledger; never locked together with anything else.
    pub(crate) attempts: Mutex<crate::attempts::Ledger>,
}

impl Shared {
    fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            hasher: RandomState::default(),
            inbox: (0..SHARDS).map(|_| Padded::default()).collect(),
            kv: (0..SHARDS).map(|_| Padded::default()).collect(),
            next_tx: AtomicU64::new(1),
            waits: WaitGraph::default(),
            outbox: Mutex::default(),
            attempts: Mutex::default(),
        }
    }

    /// A new transaction id. An atomic counter, not a lock: `Relaxed` is
    /// enough because only uniqueness matters.
    pub(crate) fn next_tx_id(&self) -> TxId {
        self.next_tx.fetch_add(1, Ordering::Relaxed)
    }

    fn shard_of<K: Hash + ?Sized>(&self, key: &K) -> usize {
        // Truncating the hash is the point: only its low bits pick a shard.
        #[allow(clippy::cast_possible_truncation)]
        let hash = self.hasher.hash_one(key) as usize;
        hash % SHARDS
    }

    pub(crate) fn inbox_shard_of(&self, key: &InboxKey) -> usize {
        self.shard_of(key)
    }

    pub(crate) fn kv_shard_of(&self, key: &str) -> usize {
        self.shard_of(key)
    }

    pub(crate) fn lock_inbox(&self, shard: usize) -> MutexGuard<'_, InboxShard> {
        lock(&self.inbox[shard].0)
    }

    pub(crate) fn lock_kv(&self, shard: usize) -> MutexGuard<'_, KvShard> {
        lock(&self.kv[shard].0)
    }

    pub(crate) fn lock_outbox(&self) -> MutexGuard<'_, Outbox> {
        lock(&self.outbox)
    }

    /// The committed value of a business key.
    pub(crate) fn kv_get(&self, key: &str) -> Option<Vec<u8>> {
        self.lock_kv(self.kv_shard_of(key)).get(key).cloned()
    }

    /// Every shard locked at once, in the global lock order, for reads that
    /// must not see half of a commit.
    fn lock_all_inbox(&self) -> Vec<MutexGuard<'_, InboxShard>> {
        self.inbox.iter().map(|shard| lock(&shard.0)).collect()
    }

    fn lock_all_kv(&self) -> Vec<MutexGuard<'_, KvShard>> {
        self.kv.iter().map(|shard| lock(&shard.0)).collect()
    }

    /// Makes `owner`'s claims, writes and outgoing messages visible, all at
    /// once.
    ///
    /// Every shard involved is locked before anything changes, in the one
    /// global order every multi-shard lock in this crate follows (inbox
    /// shards by ascending index, then key-value shards by ascending index,
    /// then the outbox),
    /// so two commits can never deadlock and no reader that locks shards in
    /// that order sees half of a commit. Waiters are woken after the locks
    /// are released, so they do not wake into a held lock.
    pub(crate) fn commit(
        &self,
        owner: TxId,
        mut claims: Claims,
        writes: Writes,
        outgoing: Vec<(OutgoingMessage, DateTime<Utc>)>,
    ) {
        // Inline lists: a message's transaction (one claim, a write or two,
        // so one or two shards of each kind) commits without allocating.
        claims.sort_unstable_by_key(|claim| claim.shard);
        let mut writes: SmallVec<[(usize, String, Write); 2]> = writes
            .into_iter()
            .map(|(key, value)| (self.kv_shard_of(&key), key, value))
            .collect();
        writes.sort_unstable_by_key(|write| write.0);

        let mut inbox_guards: SmallVec<[_; 2]> = claims
            .chunk_by(|a, b| a.shard == b.shard)
            .filter_map(|group| group.first())
            .map(|claim| self.lock_inbox(claim.shard))
            .collect();
        let mut kv_guards: SmallVec<[_; 2]> = writes
            .chunk_by(|a, b| a.0 == b.0)
            .filter_map(|group| group.first())
            .map(|write| self.lock_kv(write.0))
            .collect();
        let outbox_guard = (!outgoing.is_empty()).then(|| self.lock_outbox());

        let mut wake: SmallVec<[Arc<Notify>; 1]> = SmallVec::new();
        for (group, shard) in claims
            .chunk_by(|a, b| a.shard == b.shard)
            .zip(inbox_guards.iter_mut())
        {
            for claim in group {
                wake.extend(shard.commit_claim(&claim.key, owner, claim.response.clone()));
            }
        }
        for (group, shard) in writes
            .chunk_by_mut(|a, b| a.0 == b.0)
            .zip(kv_guards.iter_mut())
        {
            for (_, key, value) in group {
                // Last writer wins: business keys carry no row locks here
                // (see the crate docs); effects should use unique keys.
                match value.take() {
                    Some(value) => {
                        shard.insert(std::mem::take(key), value);
                    }
                    None => {
                        shard.remove(key.as_str());
                    }
                }
            }
        }
        if let Some(mut outbox) = outbox_guard {
            for (message, created_at) in outgoing {
                wake.extend(outbox.insert(message, created_at, owner));
            }
        }
        drop(kv_guards);
        drop(inbox_guards);
        for notify in wake {
            notify.notify_waiters();
        }
    }
}

/// An in-process [`InboxStore`] with Postgres' claim semantics, plus a
/// transactional key-value space for the consumer's business writes.
///
/// Cloning is cheap and shares the state, like cloning a connection pool.
/// See the crate docs for the semantics.
#[derive(Clone)]
pub struct MemoryStore {
    pub(crate) shared: Arc<Shared>,
}

impl MemoryStore {
    /// An empty store reading the system clock.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }

    /// An empty store reading `clock`, e.g. a shared [`crate::ManualClock`]
    /// to test retention without waiting.
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        Self {
            shared: Arc::new(Shared::new(clock)),
        }
    }

    /// The committed value of a business key (what any new transaction
    /// would read).
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        self.shared.kv_get(key)
    }

    /// Every committed business key starting with `prefix`, with its value,
    /// sorted by key. Sees either all or none of any commit's writes.
    pub fn scan_prefix(&self, prefix: &str) -> Vec<(String, Vec<u8>)> {
        let guards = self.shared.lock_all_kv();
        let mut found: Vec<_> = guards
            .iter()
            .flat_map(|shard| shard.iter())
            .filter(|(key, _)| key.starts_with(prefix))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect();
        drop(guards);
        found.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        found
    }

    /// Every committed inbox row, sorted by key; pending claims are not
    /// rows yet. Sees either all or none of any commit's claims.
    pub fn records(&self) -> Vec<InboxRecord> {
        let guards = self.shared.lock_all_inbox();
        let mut rows: Vec<_> = guards
            .iter()
            .flat_map(|shard| shard.rows.iter())
            .filter_map(|(key, slot)| InboxShard::record(key, slot))
            .collect();
        drop(guards);
        rows.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        rows
    }

    /// How many inbox rows are committed.
    pub fn inbox_len(&self) -> usize {
        let guards = self.shared.lock_all_inbox();
        guards.iter().map(|shard| shard.committed).sum()
    }

    /// The committed inbox rows and business values as of one instant: no
    /// commit is half in it. For tests of the all-or-nothing rule, which
    /// [`MemoryStore::records`] followed by [`MemoryStore::scan_prefix`]
    /// cannot check (a commit can land between the two calls).
    pub fn snapshot(&self) -> Snapshot {
        // Global lock order: all inbox shards, then all key-value shards.
        let inbox = self.shared.lock_all_inbox();
        let kv = self.shared.lock_all_kv();
        let mut records: Vec<_> = inbox
            .iter()
            .flat_map(|shard| shard.rows.iter())
            .filter_map(|(key, slot)| InboxShard::record(key, slot))
            .collect();
        let values: BTreeMap<_, _> = kv
            .iter()
            .flat_map(|shard| shard.iter())
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect();
        drop(kv);
        drop(inbox);
        records.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        Snapshot { records, values }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("clock", &self.shared.clock)
            .finish_non_exhaustive()
    }
}

/// A consistent copy of a [`MemoryStore`]'s committed state, from
/// [`MemoryStore::snapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Snapshot {
    /// Every committed inbox row, sorted by key.
    pub records: Vec<InboxRecord>,
    /// Every committed business value.
    pub values: BTreeMap<String, Vec<u8>>,
}

#[async_trait]
impl InboxStore for MemoryStore {
    type Transaction = MemoryTransaction;

    async fn begin(&self) -> Result<MemoryTransaction, InboxError> {
        Ok(MemoryTransaction::new(Arc::clone(&self.shared)))
    }

    async fn lookup(&self, key: &InboxKey) -> Result<Option<InboxRecord>, InboxError> {
        let shard = self.shared.lock_inbox(self.shared.inbox_shard_of(key));
        Ok(shard
            .rows
            .get(key)
            .and_then(|slot| InboxShard::record(key, slot)))
    }

    /// Deletes, shard by shard and oldest first within a shard, at most
    /// `limit` processed rows older than `cutoff`.
    ///
    /// Each deletion is atomic, the batch as a whole is not (Postgres'
    /// batch is one statement): nothing can observe the difference that
    /// matters, since a purged row and a concurrent claim of it serialize
    /// on the shard lock either way. At most one shard is locked at a time,
    /// for at most a few hundred deletions, so claims never wait long.
    async fn purge_processed_batch(
        &self,
        cutoff: DateTime<Utc>,
        limit: NonZeroU32,
    ) -> Result<u64, InboxError> {
        let mut remaining = usize::try_from(limit.get()).unwrap_or(usize::MAX);
        let mut deleted: u64 = 0;
        for shard in self.shared.inbox.iter() {
            loop {
                let chunk = remaining.min(PURGE_CHUNK);
                let done = lock(&shard.0).purge(cutoff, chunk);
                remaining -= done;
                deleted += done as u64;
                if remaining == 0 {
                    return Ok(deleted);
                }
                if done < chunk {
                    break;
                }
            }
        }
        Ok(deleted)
    }
}

#[async_trait]
impl ResponseStore for MemoryStore {
    async fn kept_response(&self, key: &InboxKey) -> Result<Option<Vec<u8>>, InboxError> {
        let shard = self.shared.lock_inbox(self.shared.inbox_shard_of(key));
        Ok(shard.kept_response(key))
    }
}

#[async_trait]
impl InboxStats for MemoryStore {
    async fn processed_counts(&self) -> Result<BTreeMap<String, u64>, InboxError> {
        let guards = self.shared.lock_all_inbox();
        let mut counts = BTreeMap::new();
        for (key, slot) in guards.iter().flat_map(|shard| shard.rows.iter()) {
            if InboxShard::record(key, slot).is_some() {
                *counts.entry(key.consumer.as_str().to_owned()).or_default() += 1;
            }
        }
        Ok(counts)
    }
}

#[cfg(test)]
mod tests {
    use inbox_api::{Claim, ConsumerName, InboxTransaction, MessageId};
    use tokio_sync as tokio;

    use super::*;

    fn key() -> InboxKey {
        InboxKey::new(MessageId::new_v7(), ConsumerName::new("c").unwrap())
    }

    /// Distinct keys contend only when they share a shard: with every key in
    /// one shard the store stays correct but serialises on one lock, which no
    /// semantic test can see.
    #[test]
    fn distinct_keys_spread_over_the_shards() {
        let store = MemoryStore::new();
        let inbox: std::collections::BTreeSet<usize> = (0..256)
            .map(|_| store.shared.inbox_shard_of(&key()))
            .collect();
        let kv: std::collections::BTreeSet<usize> = (0..256)
            .map(|n| store.shared.kv_shard_of(&format!("effect/{n}")))
            .collect();
        // 256 keys over 64 shards leave fewer than 32 in use with a
        // probability far below 1e-30.
        assert!(
            inbox.len() > SHARDS / 2,
            "inbox keys in {} shards",
            inbox.len()
        );
        assert!(kv.len() > SHARDS / 2, "kv keys in {} shards", kv.len());
    }

    /// A store is often a field of something logged with `{:?}`: its Debug
    /// names it and stays one short line, whatever it holds.
    #[tokio::test]
    async fn debug_output_stays_short_however_many_rows() {
        let store = MemoryStore::new();
        for _ in 0..100 {
            let mut tx = store.begin().await.unwrap();
            assert_eq!(tx.claim(&key()).await.unwrap(), Claim::Fresh);
            tx.commit().await.unwrap();
        }
        let shown = format!("{store:?}");
        assert!(shown.starts_with("MemoryStore {"), "{shown}");
        assert!(shown.len() < 200, "{shown}");
    }

    /// A transaction's Debug is what a stuck-claim investigation reads: which
    /// transaction, which keys it holds, how many writes it buffers.
    #[tokio::test]
    async fn transaction_debug_names_its_claims() {
        let store = MemoryStore::new();
        let k = key();
        let mut tx = store.begin().await.unwrap();
        assert_eq!(tx.claim(&k).await.unwrap(), Claim::Fresh);
        tx.put("effect", "x");
        let shown = format!("{tx:?}");
        assert!(shown.starts_with("MemoryTransaction {"), "{shown}");
        assert!(
            shown.contains(&k.message_id.as_uuid().to_string()),
            "{shown}"
        );
        assert!(shown.contains("writes: 1"), "{shown}");
    }

    #[tokio::test]
    async fn a_poisoned_shard_is_recovered() {
        let store = MemoryStore::new();
        let k = key();
        let shard = store.shared.inbox_shard_of(&k);
        let shared = Arc::clone(&store.shared);
        let panicked = std::thread::spawn(move || {
            let _guard = shared.lock_inbox(shard);
            panic!("poison the shard");
        })
        .join();
        assert!(panicked.is_err());
        assert!(store.shared.inbox[shard].0.is_poisoned());

        let mut tx = store.begin().await.unwrap();
        assert_eq!(tx.claim(&k).await.unwrap(), Claim::Fresh);
        tx.commit().await.unwrap();
        assert!(store.lookup(&k).await.unwrap().is_some());
    }

    #[test]
    fn keys_spread_over_all_shards() {
        let store = MemoryStore::new();
        let mut used = [false; SHARDS];
        for _ in 0..10_000 {
            used[store.shared.inbox_shard_of(&key())] = true;
        }
        assert!(used.iter().all(|&u| u));
    }

    #[test]
    fn shard_purge_respects_its_limit_and_the_cutoff() {
        let t0 = DateTime::<Utc>::from_timestamp(0, 0).unwrap();
        let mut shard = InboxShard::default();
        for second in 0..10 {
            let k = key();
            let at = t0 + chrono::TimeDelta::seconds(second);
            assert!(matches!(shard.try_claim(&k, 1, at), ClaimAttempt::Fresh));
            assert!(shard.commit_claim(&k, 1, None).is_none());
        }
        let cutoff = t0 + chrono::TimeDelta::seconds(7);
        assert_eq!(shard.purge(cutoff, 3), 3);
        assert_eq!(shard.purge(cutoff, 100), 4);
        assert_eq!(shard.purge(cutoff, 100), 0);
        assert_eq!(shard.committed, 3);
        assert_eq!(shard.rows.len(), 3);
    }

    #[test]
    fn a_waiter_registered_before_release_is_woken() {
        // The lost-wake-up window: the waiter's notification exists before
        // the holder releases, even though nobody has polled it yet.
        let mut shard = InboxShard::default();
        let k = key();
        let t0 = Utc::now();
        assert!(matches!(shard.try_claim(&k, 1, t0), ClaimAttempt::Fresh));
        let ClaimAttempt::Wait { owner, released } = shard.try_claim(&k, 2, t0) else {
            panic!("second transaction must wait");
        };
        assert_eq!(owner, 1);
        let notify = shard.release_claim(&k, 1).expect("a waiter registered");
        notify.notify_waiters();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        runtime.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(1), released)
                .await
                .expect("woken");
        });
        assert!(matches!(shard.try_claim(&k, 2, t0), ClaimAttempt::Fresh));
    }

    #[test]
    fn only_the_holder_releases_a_claim() {
        let mut shard = InboxShard::default();
        let k = key();
        assert!(matches!(
            shard.try_claim(&k, 1, Utc::now()),
            ClaimAttempt::Fresh
        ));
        assert!(shard.release_claim(&k, 2).is_none());
        assert!(matches!(
            shard.try_claim(&k, 1, Utc::now()),
            ClaimAttempt::Duplicate
        ));
    }
}
