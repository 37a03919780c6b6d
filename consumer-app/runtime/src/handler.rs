//! What a user of the runtime writes: a [`Handler`] per consumer.
//!
//! The runtime owns everything around the handler: decoding the delivery
//! into [`Handler::Message`] (or dead-lettering it as bad input), opening
//! the inbox transaction and claiming `(message_id, handler.name())` in it,
//! committing, acking only after the commit, retrying and dead-lettering.
//! The handler holds no idempotency code: [`Handler::handle`] runs at most
//! once per committed message and consumer, inside the transaction, and
//! [`Handler::after_commit`] makes the call that cannot join it.

use std::future::Future;
use std::marker::PhantomData;

use inbox_api::ConsumerName;
use serde::de::DeserializeOwned;

use crate::AppError;
use crate::context::{Context, Event};
use crate::identity::{DEFAULT as DEFAULT_IDENTITY, Identity};
use crate::settle::ConflictPolicy;

/// One consumer's business code, over the store's transaction type `Tx`.
///
/// Generic over `Tx` rather than over the store, so that a handler written
/// against a capability of transactions (a trait of business writes, say)
/// runs on every store whose transaction has it.
pub trait Handler<Tx>: Send + Sync + 'static {
    /// The body of the deliveries it takes, as JSON.
    type Message: DeserializeOwned + Send + Sync + 'static;
    /// What the transaction decided to do outside it, after commit.
    type Intent: Send + 'static;

    /// The scope of deduplication (the inbox key's consumer), also the
    /// `consumer` label of the metrics.
    fn name(&self) -> &ConsumerName;

    /// The AMQP `type` property of the deliveries it takes; any other is
    /// dead-lettered as `unknown_type`.
    fn message_type(&self) -> &str;

    /// Where the message id is read: the AMQP `message_id` property, a
    /// UUID, by default. A consumer of a producer that sends its own keys
    /// (a header, an order number in the body) or none says so here; see
    /// [`Identity`].
    fn identity(&self) -> &Identity {
        &DEFAULT_IDENTITY
    }

    /// What to do with a delivery whose id this consumer processed before
    /// for another payload: acknowledge and drop it (the default), or
    /// dead-letter it as `conflicting_duplicate`. See [`ConflictPolicy`].
    fn conflict_policy(&self) -> ConflictPolicy {
        ConflictPolicy::default()
    }

    /// Rules the message must meet beyond its JSON shape; a refusal
    /// dead-lettered as `invalid_event`, before any transaction opens.
    ///
    /// # Errors
    /// What is wrong, for the dead-letter detail.
    fn validate(&self, message: &Self::Message) -> Result<(), String> {
        let _ = message;
        Ok(())
    }

    /// The business work, inside the inbox transaction (`cx` dereferences to
    /// it): its writes, and the events it publishes through
    /// [`Context::publish`], commit together with the claim or not at all.
    fn handle(
        &self,
        cx: &mut Context<'_, Tx>,
        message: &Self::Message,
    ) -> impl Future<Output = Result<Self::Intent, AppError>> + Send;

    /// The non-transactional call, after the commit succeeded and before the
    /// ack. A failure is logged and counted, never retried here: the commit
    /// stands (keep the intent in the transaction to repair it later).
    fn after_commit(
        &self,
        intent: Self::Intent,
    ) -> impl Future<Output = Result<(), AppError>> + Send {
        drop(intent);
        async { Ok(()) }
    }

    /// Checks that the store has what [`Handler::handle`] needs beyond the
    /// inbox (the handler's own tables, the role's privileges on them),
    /// inside a transaction that is then rolled back. The runtime asks
    /// before consuming (a failure with a store-wide error refuses the
    /// start) and whenever it probes the store during an outage (consumption
    /// stays paused until it passes), so that a missing table is found once,
    /// not by every message. The default checks nothing.
    ///
    /// # Errors
    /// What is missing, classified like any store error (a missing table
    /// or a privilege is the store's failure, not a message's).
    fn check(&self, cx: &mut Context<'_, Tx>) -> impl Future<Output = Result<(), AppError>> + Send {
        let _ = cx;
        async { Ok(()) }
    }
}

/// A plain async function that handles one message type: what
/// [`handler_fn`] takes, so that `async fn(Context<'_, Tx>, M) -> Result<(),
/// AppError>` is a handler as an axum handler is a function.
///
/// Implemented for every such function; a user never implements it.
pub trait HandlerFn<'a, Tx: 'a, M>: Send + Sync + 'static {
    /// The function's future.
    type Future: Future<Output = Result<(), AppError>> + Send + 'a;

    /// Calls the function.
    fn call(&self, cx: Context<'a, Tx>, message: M) -> Self::Future;
}

impl<'a, Tx: 'a, M, F, Fut> HandlerFn<'a, Tx, M> for F
where
    F: Fn(Context<'a, Tx>, M) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), AppError>> + Send + 'a,
{
    type Future = Fut;

    fn call(&self, cx: Context<'a, Tx>, message: M) -> Fut {
        self(cx, message)
    }
}

/// A function as a [`Handler`]: [`handler_fn`]'s result.
pub struct FnHandler<F, M> {
    name: ConsumerName,
    identity: Identity,
    conflicts: ConflictPolicy,
    f: F,
    message: PhantomData<fn() -> M>,
}

/// The consumer `name` running `f` on every message of type `M` (taken by
/// its [`Event::TYPE`]).
///
/// ```
/// use inbox_runtime::prelude::*;
///
/// #[derive(Clone, serde::Serialize, serde::Deserialize)]
/// struct OrderPlaced { order: u64 }
/// impl Event for OrderPlaced { const TYPE: &'static str = "order.placed"; }
///
/// async fn bill<Tx>(cx: Context<'_, Tx>, placed: OrderPlaced) -> Result<(), AppError> {
///     tracing::info!(order = placed.order, message_id = %cx.message_id(), "billed");
///     Ok(())
/// }
///
/// fn billing<S: ServiceStore>() -> Result<impl Handler<S::Transaction>, AppError> {
///     handler_fn("billing", bill::<S::Transaction>)
/// }
/// ```
///
/// # Errors
/// [`AppError::Inbox`] when `name` is not a valid consumer name.
pub fn handler_fn<Tx, M, F>(name: &str, f: F) -> Result<FnHandler<F, M>, AppError>
where
    F: for<'a> HandlerFn<'a, Tx, M>,
{
    Ok(FnHandler {
        name: ConsumerName::new(name)?,
        identity: Identity::default(),
        conflicts: ConflictPolicy::default(),
        f,
        message: PhantomData,
    })
}

impl<F, M> FnHandler<F, M> {
    /// Reads the message id where `identity` says rather than from the
    /// `message_id` property.
    ///
    /// ```
    /// use inbox_runtime::prelude::*;
    ///
    /// #[derive(Clone, serde::Serialize, serde::Deserialize)]
    /// struct OrderPlaced { order_id: u64 }
    /// impl Event for OrderPlaced { const TYPE: &'static str = "order.placed"; }
    ///
    /// async fn bill<Tx>(_cx: Context<'_, Tx>, _placed: OrderPlaced) -> Result<(), AppError> {
    ///     Ok(())
    /// }
    ///
    /// fn billing<S: ServiceStore>() -> Result<impl Handler<S::Transaction>, AppError> {
    ///     // One bill per order number, whatever ids the producer's retries carry.
    ///     Ok(handler_fn("billing", bill::<S::Transaction>)?
    ///         .with_identity(Identity::body_field("order_id").accept_keys()))
    /// }
    /// ```
    #[must_use]
    pub fn with_identity(mut self, identity: Identity) -> Self {
        self.identity = identity;
        self
    }

    /// Sets what happens to a delivery whose id was processed before for
    /// another payload (acknowledged and dropped by default).
    #[must_use]
    pub fn with_conflict_policy(mut self, policy: ConflictPolicy) -> Self {
        self.conflicts = policy;
        self
    }
}

impl<Tx, M, F> Handler<Tx> for FnHandler<F, M>
where
    Tx: Send,
    M: Event + DeserializeOwned + Clone + Send + Sync + 'static,
    F: for<'a> HandlerFn<'a, Tx, M>,
{
    type Message = M;
    type Intent = ();

    fn name(&self) -> &ConsumerName {
        &self.name
    }

    fn message_type(&self) -> &str {
        M::TYPE
    }

    fn identity(&self) -> &Identity {
        &self.identity
    }

    fn conflict_policy(&self) -> ConflictPolicy {
        self.conflicts
    }

    fn handle(
        &self,
        cx: &mut Context<'_, Tx>,
        message: &M,
    ) -> impl Future<Output = Result<(), AppError>> + Send {
        self.f.call(cx.reborrow(), message.clone())
    }
}
