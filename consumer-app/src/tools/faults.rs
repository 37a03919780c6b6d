//! Fault injection, as a decorator around any handler: the demo, the tests
//! and the chaos harness install it; the production service never does.
//!
//! [`Faults::wrap`] turns a [`Handler`] into a [`Faulty`] one that runs the
//! handler's work and then, still inside the transaction and before the
//! commit, what the faults say: sleep a while (so that a kill lands
//! mid-work), wait on a hold (so that a test can act while every worker is
//! inside a transaction), die as a crash would, or fail with a transient
//! error every time (a poison message that looks transient).

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use inbox_api::{ConsumerName, InboxError, InboxKey};
use tokio::sync::watch;

use crate::parcel::downstream::Downstreams;
use crate::parcel::service::{Wrap, consumers, with_handlers};
use crate::parcel::store::ParcelStore;
use crate::parcel::topology::Topology;
use inbox_runtime::{
    AppError, ConflictPolicy, Context, Handler, Identity, ServiceConfig, ServiceHandle,
};

/// Every consumer of [`crate::parcel::service::Consumers`] wrapped in the
/// same faults.
impl Wrap for std::sync::Arc<Faults> {
    type Out<H> = Faulty<H>;

    fn wrap<H>(&self, handler: H) -> Faulty<H> {
        Faults::wrap(self, handler)
    }
}

/// The faults to inject, shared by the handlers it wraps.
#[derive(Debug)]
pub struct Faults {
    crash_once: Mutex<HashSet<InboxKey>>,
    fail_always: Mutex<HashSet<InboxKey>>,
    crashes: Mutex<BTreeMap<String, u64>>,
    /// Time the work spends inside the transaction, after its writes and
    /// before the commit (to make "killed mid-work" reproducible).
    pub work_delay: Duration,
    /// While true, work waits inside its transaction before the commit.
    hold: watch::Sender<bool>,
    /// Attempts currently waiting on the hold.
    held: AtomicU64,
}

impl Default for Faults {
    fn default() -> Self {
        Self::with_work_delay(Duration::ZERO)
    }
}

impl Faults {
    /// No faults, `work_delay` inside every transaction.
    pub fn with_work_delay(work_delay: Duration) -> Self {
        Self {
            crash_once: Mutex::new(HashSet::new()),
            fail_always: Mutex::new(HashSet::new()),
            crashes: Mutex::new(BTreeMap::new()),
            work_delay,
            hold: watch::Sender::new(false),
            held: AtomicU64::new(0),
        }
    }

    /// `handler`, with these faults injected after its work.
    pub fn wrap<H>(self: &std::sync::Arc<Self>, handler: H) -> Faulty<H> {
        Faulty {
            inner: handler,
            faults: std::sync::Arc::clone(self),
        }
    }

    /// Starts the Parcel service on `store` with every consumer wrapped in
    /// these faults (what the lab's consume binary and the tests run).
    ///
    /// # Errors
    /// As [`inbox_runtime::Service::spawn`].
    pub fn spawn<S: ParcelStore>(
        self: &std::sync::Arc<Self>,
        store: S,
        config: ServiceConfig,
        topology: &Topology,
        downstreams: Downstreams,
    ) -> Result<ServiceHandle, AppError> {
        let consumers = consumers(downstreams)?.map(self);
        with_handlers(store, config, topology, consumers).spawn()
    }

    /// The first attempt of `key` dies after its business writes, before
    /// the commit.
    pub fn crash_first_attempt(&self, key: InboxKey) {
        lock(&self.crash_once).insert(key);
    }

    /// Every attempt of `key` fails with a retryable error after its
    /// business writes (a poison message that looks transient).
    pub fn fail_always(&self, key: InboxKey) {
        lock(&self.fail_always).insert(key);
    }

    /// Ends [`Faults::fail_always`] for `key`: the fix is deployed, and its
    /// next attempt (a replay from the dead-letter queue) succeeds.
    pub fn heal(&self, key: &InboxKey) {
        lock(&self.fail_always).remove(key);
    }

    /// From now on, work stops inside its transaction, after its writes,
    /// until [`Faults::release`]: "mid-work", deterministically.
    pub fn hold(&self) {
        self.hold.send_replace(true);
    }

    /// Lets held work go on to its commit.
    pub fn release(&self) {
        self.hold.send_replace(false);
    }

    /// How many attempts wait on the hold right now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }

    /// Crashes injected so far into the consumer named `consumer`.
    pub fn crashes(&self, consumer: &str) -> u64 {
        lock(&self.crashes).get(consumer).copied().unwrap_or(0)
    }

    /// Called inside the transaction after the work's writes.
    ///
    /// # Errors
    /// [`AppError::Abandoned`] once per key set by
    /// [`Faults::crash_first_attempt`]; a retryable error for every key set
    /// by [`Faults::fail_always`].
    pub async fn before_commit(&self, key: &InboxKey) -> Result<(), AppError> {
        if !self.work_delay.is_zero() {
            tokio::time::sleep(self.work_delay).await;
        }
        if *self.hold.borrow() {
            self.held.fetch_add(1, Ordering::SeqCst);
            let mut hold = self.hold.subscribe();
            let _ = hold.wait_for(|held| !*held).await;
            self.held.fetch_sub(1, Ordering::SeqCst);
        }
        if lock(&self.crash_once).remove(key) {
            *lock(&self.crashes)
                .entry(key.consumer.as_str().to_owned())
                .or_default() += 1;
            // As if the process had died mid-transaction: the transaction is
            // gone (rolled back), the delivery is not acknowledged, and the
            // broker delivers it again.
            tracing::warn!(message_id = %key.message_id, consumer = %key.consumer,
                what = %key, "injected crash mid-transaction; handing the delivery back to the broker");
            return Err(AppError::Abandoned(format!(
                "injected crash of the first attempt of {key}"
            )));
        }
        if lock(&self.fail_always).contains(key) {
            return Err(AppError::Inbox(InboxError::retryable_handler(format!(
                "injected transient failure of {key}"
            ))));
        }
        Ok(())
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A handler with [`Faults`] injected after its work, before the commit.
#[derive(Debug)]
pub struct Faulty<H> {
    inner: H,
    faults: std::sync::Arc<Faults>,
}

impl<Tx: Send, H: Handler<Tx>> Handler<Tx> for Faulty<H> {
    type Message = H::Message;
    type Intent = H::Intent;

    fn name(&self) -> &ConsumerName {
        self.inner.name()
    }

    fn message_type(&self) -> &str {
        self.inner.message_type()
    }

    // The decorator changes what happens before the commit, never which id
    // a delivery has or what a conflicting copy means: both are the inner
    // handler's.
    fn identity(&self) -> &Identity {
        self.inner.identity()
    }

    fn conflict_policy(&self) -> ConflictPolicy {
        self.inner.conflict_policy()
    }

    fn validate(&self, message: &Self::Message) -> Result<(), String> {
        self.inner.validate(message)
    }

    async fn handle(
        &self,
        cx: &mut Context<'_, Tx>,
        message: &Self::Message,
    ) -> Result<Self::Intent, AppError> {
        let intent = self.inner.handle(cx, message).await?;
        let key = InboxKey::new(cx.message_id(), self.inner.name().clone());
        self.faults.before_commit(&key).await?;
        Ok(intent)
    }

    async fn after_commit(&self, intent: Self::Intent) -> Result<(), AppError> {
        self.inner.after_commit(intent).await
    }

    async fn check(&self, cx: &mut Context<'_, Tx>) -> Result<(), AppError> {
        self.inner.check(cx).await
    }
}

#[cfg(test)]
mod tests {
    use inbox_api::MessageId;

    use super::*;

    fn key(consumer: &str) -> InboxKey {
        InboxKey::new(
            MessageId::new_v7(),
            ConsumerName::new(consumer).expect("name"),
        )
    }

    #[tokio::test]
    async fn a_crash_comes_once_and_is_counted_per_consumer() {
        let faults = Faults::default();
        let k = key("c1");
        faults.crash_first_attempt(k.clone());
        assert!(matches!(
            faults.before_commit(&k).await,
            Err(AppError::Abandoned(_))
        ));
        assert!(faults.before_commit(&k).await.is_ok());
        assert_eq!(faults.crashes("c1"), 1);
        assert_eq!(faults.crashes("c2"), 0);
    }

    #[test]
    fn the_wrapped_handler_keeps_its_identity_and_conflict_policy() {
        use crate::parcel::events::CarrierAssignedEvent;
        async fn noop(_cx: Context<'_, ()>, _event: CarrierAssignedEvent) -> Result<(), AppError> {
            Ok(())
        }
        let inner = inbox_runtime::handler_fn("c1", noop)
            .expect("handler")
            .with_identity(Identity::header("x-event-id"))
            .with_conflict_policy(ConflictPolicy::DeadLetter);
        let faulty = std::sync::Arc::new(Faults::default()).wrap(inner);
        assert!(Handler::<()>::identity(&faulty) == &Identity::header("x-event-id"));
        assert_eq!(
            Handler::<()>::conflict_policy(&faulty),
            ConflictPolicy::DeadLetter
        );
    }

    #[tokio::test]
    async fn a_poison_key_fails_every_time_and_retryably() {
        let faults = Faults::default();
        let k = key("c1");
        faults.fail_always(k.clone());
        for _ in 0..3 {
            let error = faults.before_commit(&k).await.expect_err("fails");
            assert!(error.is_retryable(), "{error}");
        }
        assert!(faults.before_commit(&key("c1")).await.is_ok());
    }
}
