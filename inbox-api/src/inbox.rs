//! The idempotency middleware: begin, claim (which records the message
//! processed), work, commit.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use tracing::Instrument as _;

use crate::metrics as names;
use crate::{
    BatchTransaction, Claim, Fingerprint, InboxError, InboxKey, InboxStore, InboxTransaction,
};

/// What [`Inbox::handle`] did with a delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Handled<T> {
    /// The work ran and committed together with the claim; `T` is what the
    /// work returned. Acknowledge the delivery now, not before.
    Processed(T),
    /// The message was already processed by this consumer; the work did not
    /// run. Acknowledge the delivery and drop it.
    Duplicate,
    /// The key was processed before, for a payload with another
    /// fingerprint ([`InboxKey::with_fingerprint`]): the producer reused a
    /// message id for a different message. The work did not run; nothing
    /// was written. Whether to drop it or keep it for a person (a dead
    /// letter) is the consumer's policy; redelivering it changes nothing.
    Conflict {
        /// The fingerprint stored with the processed message.
        stored: Fingerprint,
        /// The fingerprint of this delivery.
        received: Fingerprint,
    },
}

impl<T> Handled<T> {
    /// Whether the work was skipped as a duplicate (a conflict is not
    /// one: its payload differs).
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Self::Duplicate)
    }

    /// Whether the key was processed before for another payload.
    pub fn is_conflict(&self) -> bool {
        matches!(self, Self::Conflict { .. })
    }
}

/// Names the future of an async closure so its `Send`-ness can be required.
///
/// `AsyncFnOnce::CallOnceFuture` is not stable, and a plain
/// `FnOnce(&mut Tx) -> Fut` cannot tie `Fut` to the borrow of the
/// transaction. This is the shape diesel-async 0.9 settled on for its
/// `transaction` method. It is implemented for every async closure; users
/// never name it, they write `async |tx| { … }`.
pub trait AsyncWork<Arg, R>:
    AsyncFnOnce(Arg) -> R + FnOnce(Arg) -> <Self as AsyncWork<Arg, R>>::Fut
{
    /// The closure's future.
    type Fut: Future<Output = R>;
}

impl<F, Arg, Fut, R> AsyncWork<Arg, R> for F
where
    F: AsyncFnOnce(Arg) -> R + FnOnce(Arg) -> Fut,
    Fut: Future<Output = R>,
{
    type Fut = Fut;
}

/// The two-argument, callable-many-times sibling of [`AsyncWork`], for
/// [`Inbox::handle_batch`]'s per-message work.
pub trait AsyncWorkMut<A, B, R>:
    AsyncFnMut(A, B) -> R + FnMut(A, B) -> <Self as AsyncWorkMut<A, B, R>>::Fut
{
    /// The closure's future.
    type Fut: Future<Output = R>;
}

impl<F, A, B, Fut, R> AsyncWorkMut<A, B, R> for F
where
    F: AsyncFnMut(A, B) -> R + FnMut(A, B) -> Fut,
    Fut: Future<Output = R>,
{
    type Fut = Fut;
}

/// The shared-reference sibling of [`AsyncWorkMut`], for
/// [`Inbox::handle_batch_at_once`]'s work, which a rerun calls again while
/// the first call's borrow could still be live.
pub trait AsyncWorkFn<A, B, R>:
    AsyncFn(A, B) -> R + Fn(A, B) -> <Self as AsyncWorkFn<A, B, R>>::Fut
{
    /// The closure's future.
    type Fut: Future<Output = R>;
}

impl<F, A, B, Fut, R> AsyncWorkFn<A, B, R> for F
where
    F: AsyncFn(A, B) -> R + Fn(A, B) -> Fut,
    Fut: Future<Output = R>,
{
    type Fut = Fut;
}

/// The idempotency middleware around a consumer's work.
///
/// Like a tower layer it owns the step around the consumer: the consumer's
/// code receives an open transaction and contains no idempotency code at all.
/// Cheap to share: wrap it in an `Arc` or clone the store inside.
#[derive(Clone, Debug)]
pub struct Inbox<S> {
    store: S,
}

impl<S: InboxStore> Inbox<S> {
    /// Wraps a store.
    pub fn new(store: S) -> Self {
        Self { store }
    }

    /// The store underneath, for cleanup and diagnostics.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Runs `work` exactly once per `key`, however often the message is
    /// delivered.
    ///
    /// In one transaction: claim `key` (the first write, which also records
    /// `processed_at`), run `work` with the transaction so its writes share
    /// the claim's fate, commit. Returns [`Handled::Duplicate`] without
    /// running `work` when this consumer already processed the message.
    ///
    /// Acknowledge the delivery only after this returns `Ok`. If `work`
    /// returns an error the transaction is rolled back (the claim with it, so
    /// a redelivery runs the work again) and the error is returned. If the
    /// returned future is dropped midway (a crash, a timeout) the transaction
    /// is dropped and rolls back.
    ///
    /// Errors of the store are converted into `E` (hence `E:
    /// From<InboxError>`, as in sqlx's `Connection::transaction`), so a
    /// consumer keeps its own error type; [`InboxError`] itself works too.
    ///
    /// Bound the work's time (for example with `tokio::time::timeout` around
    /// this call) below the broker's consumer timeout: a transaction that
    /// outlives the broker channel gets redelivered while it still holds the
    /// claim, and the redelivery waits on it.
    ///
    /// # Errors
    /// The work's error, or a store error converted into `E`; check
    /// [`InboxError::disposition`] to choose between redelivery and
    /// dead-lettering.
    ///
    /// # Example
    /// ```
    /// use inbox_api::{Handled, Inbox, InboxError, InboxKey, InboxStore};
    ///
    /// async fn on_delivery<S: InboxStore>(
    ///     inbox: &Inbox<S>,
    ///     key: &InboxKey,
    ///     parcel: &str, // borrowed local data is fine
    /// ) -> Result<bool, InboxError> {
    ///     let outcome = inbox
    ///         .handle(key, async |tx| {
    ///             // business writes go through `tx` (a backend exposes its
    ///             // native connection on its transaction type)
    ///             let _ = tx;
    ///             Ok::<_, InboxError>(parcel.len())
    ///         })
    ///         .await?;
    ///     Ok(matches!(outcome, Handled::Processed(_)))
    /// }
    ///
    /// // The future is Send, so it can be spawned.
    /// fn spawnable<S: InboxStore>(inbox: std::sync::Arc<Inbox<S>>, key: InboxKey) {
    ///     tokio::spawn(async move {
    ///         let parcel = String::from("P-1");
    ///         on_delivery(&inbox, &key, &parcel).await
    ///     });
    /// }
    /// ```
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn cannot promise `Send`; the explicit bound lets callers spawn it"
    )]
    pub fn handle<'a, T, E, F>(
        &'a self,
        key: &'a InboxKey,
        work: F,
    ) -> impl Future<Output = Result<Handled<T>, E>> + Send + 'a
    where
        for<'t> F: AsyncFnOnce(&'t mut S::Transaction) -> Result<T, E>
            + AsyncWork<&'t mut S::Transaction, Result<T, E>, Fut: Send>
            + Send
            + 'a,
        E: From<InboxError> + Send + 'a,
        T: Send + 'a,
    {
        async move {
            let started = Instant::now();
            // Cloned per metric: a reference count, not a copy of the name.
            let consumer = key.consumer.label();
            let fail = |stage: &'static str, retryable: &'static str| {
                metrics::counter!(names::FAILED,
                    "consumer" => consumer.clone(),
                    "stage" => stage,
                    "retryable" => retryable)
                .increment(1);
                metrics::histogram!(names::HANDLE_DURATION,
                    "consumer" => consumer.clone(), "outcome" => "failed")
                .record(started.elapsed().as_secs_f64());
            };
            let store_failed = |stage: &'static str, error: InboxError| {
                tracing::warn!(message_id = %key.message_id, consumer = %key.consumer,
                    stage, error = %error, retryable = error.is_retryable(), "inbox store failed");
                fail(
                    stage,
                    if error.is_retryable() {
                        "true"
                    } else {
                        "false"
                    },
                );
                E::from(error)
            };

            // Spans at debug level: a trace shows the claim, the work and
            // the commit inside a consumer's process span, and a service
            // logging at info pays nothing for them.
            let claimed = self
                .store
                .begin_claim(key)
                .instrument(tracing::debug_span!("inbox.claim",
                    messaging.message.id = %key.message_id, consumer = %key.consumer))
                .await;
            let mut tx = match claimed {
                Ok((tx, Claim::Fresh)) => tx,
                Ok((tx, Claim::Duplicate)) => {
                    // Nothing was written; the row that made this a duplicate
                    // is committed, so a failed rollback changes nothing.
                    if let Err(error) = tx.rollback().await {
                        tracing::debug!(message_id = %key.message_id, consumer = %key.consumer,
                            error = %error, "rollback after duplicate failed");
                    }
                    let handled = self
                        .repeat(key)
                        .await
                        .map_err(|e| store_failed("lookup", e))?;
                    let outcome = count_repeat(key, &handled);
                    metrics::histogram!(names::HANDLE_DURATION,
                        "consumer" => consumer.clone(), "outcome" => outcome)
                    .record(started.elapsed().as_secs_f64());
                    return Ok(handled);
                }
                Err((step, error)) => return Err(store_failed(step.as_str(), error)),
            };

            let value = match work(&mut tx)
                .instrument(tracing::debug_span!("inbox.work"))
                .await
            {
                Ok(value) => value,
                Err(error) => {
                    if let Err(rollback) = tx.rollback().await {
                        // The work's error is the one the caller must act
                        // on; the transaction is gone either way.
                        tracing::warn!(message_id = %key.message_id, consumer = %key.consumer,
                            error = %rollback, "rollback after failed work failed");
                    }
                    // Whether the work's error is retryable is the caller's
                    // call (its type is theirs); the metric records the stage.
                    fail("work", "unknown");
                    return Err(error);
                }
            };

            tx.commit()
                .instrument(tracing::debug_span!("inbox.commit"))
                .await
                .map_err(|e| store_failed("commit", e))?;

            metrics::counter!(names::PROCESSED, "consumer" => consumer.clone()).increment(1);
            metrics::histogram!(names::HANDLE_DURATION,
                "consumer" => consumer.clone(), "outcome" => "processed")
            .record(started.elapsed().as_secs_f64());
            Ok(Handled::Processed(value))
        }
    }
    /// Batched mode: runs `work` once per fresh message of `items`, all in
    /// one transaction with one claim statement and one COMMIT.
    ///
    /// Per-message transactions cap throughput at one commit per message;
    /// this pays one per batch. The guarantee stays per message: a failing
    /// message is rolled back alone (its claim too) while the rest of the
    /// batch commits. `work` gets the transaction and the message's item
    /// (whatever the caller paired with the key: a decoded event, a
    /// delivery).
    ///
    /// The batch first runs optimistically, without savepoints: a savepoint
    /// costs a round trip per message and, in PostgreSQL, a subtransaction
    /// (above 64 per transaction they slow every session's snapshots). Only
    /// when a message's work fails is that attempt rolled back whole and the
    /// batch run again, this time each fresh message inside its own savepoint
    /// ([`BatchTransaction::savepoint`]), the failed message not run again
    /// but given back ([`BatchTransaction::unclaim`]) with its first error.
    /// So `work` may run twice for a message whose batch had to be rerun;
    /// only the committed run has effects, as long as the work keeps its
    /// effects inside the transaction (the rule of the whole crate).
    ///
    /// Returns every `(key, item)` with its outcome, in the order given and
    /// of the same type as [`Inbox::handle`]'s, so one piece of code settles
    /// both modes. Acknowledge `Processed` and `Duplicate` items now that the
    /// batch has committed, not before. A key repeated in the batch runs at
    /// most once; its later copies are `Duplicate` if the first committed,
    /// [`InboxError::Deferred`] if its work failed. A batch claim refused
    /// because of a key it does not name ([`InboxError::KeyRefusedInBatch`]:
    /// an expired id, or one ahead of the partitions, in PostgreSQL's
    /// partitioned layout) is dropped, and the batch claims its keys one by
    /// one, each in a savepoint: a refused key gets its own error and the
    /// others run. A store failure of the
    /// batch's own steps (begin, claim, savepoint, commit) gives every item
    /// [`InboxError::BatchAborted`] with the shared cause: nothing of the
    /// batch committed (for a lost commit: maybe all of it), redeliver each.
    ///
    /// # Example
    /// ```
    /// use inbox_api::{BatchTransaction, Handled, Inbox, InboxError, InboxKey, InboxStore};
    ///
    /// async fn on_deliveries<S>(inbox: &Inbox<S>, batch: Vec<(InboxKey, String)>) -> usize
    /// where
    ///     S: InboxStore,
    ///     S::Transaction: BatchTransaction,
    /// {
    ///     let outcomes = inbox
    ///         .handle_batch(batch, async |tx, parcel: &String| {
    ///             let _ = tx; // business writes for `parcel` go through `tx`
    ///             Ok::<_, InboxError>(parcel.len())
    ///         })
    ///         .await;
    ///     // Settle each delivery as `Inbox::handle`'s outcome would be.
    ///     outcomes
    ///         .iter()
    ///         .filter(|(_, _, outcome)| matches!(outcome, Ok(Handled::Processed(_))))
    ///         .count()
    /// }
    /// ```
    pub fn handle_batch<'a, I, T, E, F>(
        &'a self,
        items: Vec<(InboxKey, I)>,
        work: F,
    ) -> impl Future<Output = Vec<(InboxKey, I, Result<Handled<T>, E>)>> + Send + 'a
    where
        S::Transaction: BatchTransaction,
        for<'t, 'i> F: AsyncFnMut(&'t mut S::Transaction, &'i I) -> Result<T, E>
            + AsyncWorkMut<&'t mut S::Transaction, &'i I, Result<T, E>, Fut: Send>
            + Send
            + 'a,
        E: From<InboxError> + Send + 'a,
        T: Send + 'a,
        I: Send + Sync + 'a,
    {
        self.run_batch(items, work, BatchStart::Optimistic, Instant::now())
    }

    /// [`Inbox::handle_batch`]'s body; `start` skips the optimistic attempt
    /// (or the batch's claim) when the caller already saw it fail.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn cannot promise `Send`; the explicit bound lets callers spawn it"
    )]
    fn run_batch<'a, I, T, E, F>(
        &'a self,
        items: Vec<(InboxKey, I)>,
        mut work: F,
        start: BatchStart,
        started: Instant,
    ) -> impl Future<Output = Vec<(InboxKey, I, Result<Handled<T>, E>)>> + Send + 'a
    where
        S::Transaction: BatchTransaction,
        for<'t, 'i> F: AsyncFnMut(&'t mut S::Transaction, &'i I) -> Result<T, E>
            + AsyncWorkMut<&'t mut S::Transaction, &'i I, Result<T, E>, Fut: Send>
            + Send
            + 'a,
        E: From<InboxError> + Send + 'a,
        T: Send + 'a,
        I: Send + Sync + 'a,
    {
        async move {
            let (keys, payloads): (Vec<InboxKey>, Vec<I>) = items.into_iter().unzip();
            // A store step's error ends the batch, with the stage it
            // happened in.
            macro_rules! step {
                ($run:lifetime, $stage:literal, $e:expr) => {
                    match $e.await {
                        Ok(value) => value,
                        Err(error) => break $run Err(($stage, error)),
                    }
                };
            }
            let work_failed = |key: &InboxKey| {
                metrics::counter!(names::FAILED,
                        "consumer" => key.consumer.label(),
                        "stage" => "work",
                        "retryable" => "unknown")
                .increment(1);
            };
            // Messages whose work failed in the optimistic attempt, with
            // their error: the rerun gives their claims back unrun.
            let mut failed_before: HashMap<usize, E> = HashMap::new();
            let mut with_savepoints = !matches!(start, BatchStart::Optimistic);
            // Set once the batch's one claim statement was refused because
            // of a key it did not name: the keys are then claimed one by
            // one, each in a savepoint, so only the refused ones fail.
            let mut claim_one_by_one = matches!(start, BatchStart::OneByOne);
            let run: Result<Vec<Slot<T, E>>, StepFailure> = 'run: loop {
                let mut tx = step!('run, "begin", self.store.begin());
                let claims = if claim_one_by_one {
                    None
                } else {
                    match tx
                        .claim_batch(&keys)
                        .instrument(tracing::debug_span!("inbox.claim", batch = keys.len()))
                        .await
                    {
                        Ok(claims) => Some(claims),
                        Err(error @ InboxError::KeyRefusedInBatch { .. }) => {
                            drop_attempt(tx, "the refused batch claim").await;
                            metrics::counter!(names::BATCH_RERUNS).increment(1);
                            tracing::debug!(batch = keys.len(), error = %error,
                                "the batch's claim refused a key; claiming one by one");
                            claim_one_by_one = true;
                            with_savepoints = true;
                            continue;
                        }
                        Err(error) => break 'run Err(("claim", error)),
                    }
                };
                if let Some(claims) = &claims
                    && claims.len() != keys.len()
                {
                    break 'run Err((
                        "claim",
                        InboxError::InvalidArgument {
                            message: format!(
                                "claim_batch answered {} claims for {} keys",
                                claims.len(),
                                keys.len()
                            ),
                        },
                    ));
                }

                let mut slots: Vec<Slot<T, E>> = Vec::with_capacity(keys.len());
                let mut fresh_at: HashMap<&InboxKey, usize> = HashMap::new();
                let mut first_failure: Option<(usize, E)> = None;
                for (index, key) in keys.iter().enumerate() {
                    let claim = match &claims {
                        Some(claims) => claims[index],
                        None => {
                            step!('run, "claim", tx.savepoint());
                            match tx.claim(key).await {
                                Ok(claim) => {
                                    step!('run, "claim", tx.release_savepoint());
                                    claim
                                }
                                Err(error) => {
                                    // This key's own refusal (expired, no
                                    // partition yet): undone alone, charged
                                    // alone. A lost connection fails the
                                    // rollback, and with it the batch.
                                    step!('run, "claim", tx.rollback_to_savepoint());
                                    metrics::counter!(names::FAILED,
                                        "consumer" => key.consumer.label(),
                                        "stage" => "claim",
                                        "retryable" => if error.is_retryable() { "true" } else { "false" })
                                    .increment(1);
                                    slots.push(Slot::Failed(E::from(error)));
                                    continue;
                                }
                            }
                        }
                    };
                    if claim == Claim::Duplicate {
                        // A later copy of a key fresh earlier in this batch
                        // follows its first copy, which is decided by now.
                        slots.push(match fresh_at.get(key) {
                            Some(&first) if !matches!(slots[first], Slot::Processed(_)) => {
                                Slot::Deferred
                            }
                            _ => Slot::Duplicate,
                        });
                        continue;
                    }
                    fresh_at.insert(key, index);
                    if let Some(error) = failed_before.remove(&index) {
                        step!('run, "work", tx.unclaim(key));
                        slots.push(Slot::Failed(error));
                        continue;
                    }
                    let work_span = || tracing::debug_span!("inbox.work", messaging.message.id = %key.message_id);
                    if !with_savepoints {
                        match work(&mut tx, &payloads[index])
                            .instrument(work_span())
                            .await
                        {
                            Ok(value) => slots.push(Slot::Processed(value)),
                            Err(error) => {
                                first_failure = Some((index, error));
                                break;
                            }
                        }
                        continue;
                    }
                    step!('run, "work", tx.savepoint());
                    match work(&mut tx, &payloads[index])
                        .instrument(work_span())
                        .await
                    {
                        Ok(value) => {
                            step!('run, "work", tx.release_savepoint());
                            slots.push(Slot::Processed(value));
                        }
                        Err(error) => {
                            step!('run, "work", tx.rollback_to_savepoint());
                            step!('run, "work", tx.unclaim(key));
                            work_failed(key);
                            slots.push(Slot::Failed(error));
                        }
                    }
                }

                if let Some((index, error)) = first_failure {
                    // Without savepoints the failure cannot be undone alone (and
                    // in PostgreSQL a failed statement aborts the whole
                    // transaction): drop this attempt, rerun with savepoints.
                    drop_attempt(tx, "the optimistic batch attempt").await;
                    work_failed(&keys[index]);
                    metrics::counter!(names::BATCH_RERUNS).increment(1);
                    tracing::debug!(message_id = %keys[index].message_id,
                            consumer = %keys[index].consumer, batch = keys.len(),
                            "work failed in an optimistic batch; rerunning with savepoints");
                    failed_before.insert(index, error);
                    with_savepoints = true;
                    continue;
                }
                step!(
                    'run,
                    "commit",
                    tx.commit()
                        .instrument(tracing::debug_span!("inbox.commit", batch = keys.len()))
                );
                break 'run Ok(slots);
            };
            match run {
                Ok(slots) => self.settle(keys, payloads, slots, started).await,
                Err((stage, error)) => abort(keys, payloads, stage, error, started),
            }
        }
    }

    /// Batch-at-once mode: one transaction, one claim statement, and `work`
    /// called once with every fresh message of `items`, so the consumer can
    /// write the whole batch's business rows in one statement too.
    ///
    /// [`Inbox::handle_batch`] saves the per-message BEGIN, claim and
    /// COMMIT but still runs the work once per message, so a batch of K
    /// still pays K business statements; where those are the bulk of the
    /// cost (one INSERT per message) a multi-row write is what makes a batch
    /// many times cheaper than K messages. This is MassTransit's batch
    /// consumer (`Batch<T>`) or Wolverine's batched handler, with the
    /// inbox's guarantee kept per message.
    ///
    /// `work` gets the transaction and the items of the fresh messages, in
    /// the order given, each message once (duplicates, committed before or
    /// repeated in the batch, are left out). When it returns `Ok` the batch
    /// commits and every fresh message is `Processed(())`. When it fails,
    /// or the batch's claim refuses a key it does not name
    /// ([`InboxError::KeyRefusedInBatch`]), that attempt is rolled back
    /// whole and the batch runs again as [`Inbox::handle_batch`] reruns a
    /// failed batch: `work` is called once per fresh message, on a slice of
    /// one, each in its own savepoint, so the failing message is rolled back
    /// alone with its own error and the rest commit. So `work` runs twice
    /// for the messages of a failed attempt; only the committed run has
    /// effects, as long as the work keeps its effects inside the
    /// transaction. The whole batch's error belongs to no one message: it
    /// is dropped (the rerun returns each message's own), the attempt is
    /// logged at debug level and counted in `inbox_batch_reruns_total`.
    ///
    /// A store failure of the batch's own steps (begin, claim, commit)
    /// gives every item [`InboxError::BatchAborted`], as in
    /// [`Inbox::handle_batch`], whose outcome type this shares.
    ///
    /// # Example
    /// ```
    /// use inbox_api::{BatchTransaction, Handled, Inbox, InboxError, InboxKey, InboxStore};
    ///
    /// async fn on_deliveries<S>(inbox: &Inbox<S>, batch: Vec<(InboxKey, String)>) -> usize
    /// where
    ///     S: InboxStore,
    ///     S::Transaction: BatchTransaction,
    /// {
    ///     let outcomes = inbox
    ///         .handle_batch_at_once(batch, async |tx, parcels: &[&String]| {
    ///             // one multi-row business write for all `parcels` through `tx`
    ///             let _ = (tx, parcels.len());
    ///             Ok::<_, InboxError>(())
    ///         })
    ///         .await;
    ///     outcomes
    ///         .iter()
    ///         .filter(|(_, _, outcome)| matches!(outcome, Ok(Handled::Processed(()))))
    ///         .count()
    /// }
    /// ```
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn cannot promise `Send`; the explicit bound lets callers spawn it"
    )]
    pub fn handle_batch_at_once<'a, I, E, F>(
        &'a self,
        items: Vec<(InboxKey, I)>,
        work: F,
    ) -> impl Future<Output = Vec<(InboxKey, I, Result<Handled<()>, E>)>> + Send + 'a
    where
        S::Transaction: BatchTransaction,
        // `AsyncFn`, not `AsyncFnMut`: the rerun's per-message closure
        // holds `work` by shared reference, and an async closure that
        // borrowed it mutably could not be called again while its future
        // lived.
        for<'t, 's, 'i> F: AsyncFn(&'t mut S::Transaction, &'s [&'i I]) -> Result<(), E>
            + AsyncWorkFn<&'t mut S::Transaction, &'s [&'i I], Result<(), E>, Fut: Send>
            + Send
            + Sync
            + 'a,
        E: From<InboxError> + Send + 'a,
        I: Send + Sync + 'a,
    {
        async move {
            let started = Instant::now();
            let (keys, payloads): (Vec<InboxKey>, Vec<I>) = items.into_iter().unzip();
            let attempt: Result<AtOnce<E>, StepFailure> = async {
                let mut tx = self.store.begin().await.map_err(|e| ("begin", e))?;
                let claims = match tx
                    .claim_batch(&keys)
                    .instrument(tracing::debug_span!("inbox.claim", batch = keys.len()))
                    .await
                {
                    Ok(claims) if claims.len() == keys.len() => claims,
                    Ok(_) | Err(InboxError::KeyRefusedInBatch { .. }) => {
                        // The rerun claims one by one and reports a wrong
                        // answer or each refused key on its own message.
                        drop_attempt(tx, "the refused batch claim").await;
                        tracing::debug!(
                            batch = keys.len(),
                            "the batch's claim refused a key; claiming one by one"
                        );
                        return Ok(AtOnce::Rerun(BatchStart::OneByOne));
                    }
                    Err(error) => return Err(("claim", error)),
                };
                let fresh: Vec<&I> = payloads
                    .iter()
                    .zip(&claims)
                    .filter(|(_, claim)| **claim == Claim::Fresh)
                    .map(|(item, _)| item)
                    .collect();
                // The whole batch's error is not any one message's: the rerun
                // finds whose it is.
                if !fresh.is_empty()
                    && work(&mut tx, &fresh)
                        .instrument(tracing::debug_span!("inbox.work", batch = fresh.len()))
                        .await
                        .is_err()
                {
                    drop_attempt(tx, "the failed batch-at-once attempt").await;
                    tracing::debug!(
                        batch = keys.len(),
                        fresh = fresh.len(),
                        "work failed for a whole batch; rerunning one message at a time"
                    );
                    return Ok(AtOnce::Rerun(BatchStart::Savepoints));
                }
                tx.commit()
                    .instrument(tracing::debug_span!("inbox.commit", batch = keys.len()))
                    .await
                    .map_err(|e| ("commit", e))?;
                Ok(AtOnce::Committed(
                    claims
                        .iter()
                        .map(|claim| match claim {
                            Claim::Fresh => Slot::Processed(()),
                            // Committed before, or a later copy of a key
                            // that just committed.
                            Claim::Duplicate => Slot::Duplicate,
                        })
                        .collect(),
                ))
            }
            .await;
            match attempt {
                Ok(AtOnce::Committed(slots)) => self.settle(keys, payloads, slots, started).await,
                Err((stage, error)) => abort(keys, payloads, stage, error, started),
                Ok(AtOnce::Rerun(start)) => {
                    metrics::counter!(names::BATCH_RERUNS).increment(1);
                    let items = keys.into_iter().zip(payloads).collect();
                    let work = &work;
                    self.run_batch(
                        items,
                        async move |tx, item: &I| {
                            // A copy of the reference, so the future borrows
                            // `work` from this frame, not from the closure.
                            let work: &F = work;
                            work(tx, std::slice::from_ref(&item)).await
                        },
                        start,
                        started,
                    )
                    .await
                }
            }
        }
    }

    /// What a repeated key is: [`Handled::Duplicate`], or
    /// [`Handled::Conflict`] when the delivery carries a fingerprint and
    /// the stored row another. Only repeats pay the lookup; a fresh claim
    /// costs what it did.
    async fn repeat<T>(&self, key: &InboxKey) -> Result<Handled<T>, InboxError> {
        let Some(received) = key.fingerprint() else {
            return Ok(Handled::Duplicate);
        };
        // `None` (no row: purged since the claim; no fingerprint: a row
        // from before stores kept it) cannot be told apart from the same
        // payload, and is taken as it.
        Ok(
            match self
                .store
                .lookup(key)
                .await?
                .and_then(|row| row.fingerprint)
            {
                Some(stored) if stored != *received => Handled::Conflict {
                    stored,
                    received: *received,
                },
                _ => Handled::Duplicate,
            },
        )
    }

    /// Turns a committed batch's slots into [`Inbox::handle`]'s outcome
    /// type, counting each message once.
    async fn settle<I, T, E: From<InboxError>>(
        &self,
        keys: Vec<InboxKey>,
        payloads: Vec<I>,
        slots: Vec<Slot<T, E>>,
        started: Instant,
    ) -> Vec<(InboxKey, I, Result<Handled<T>, E>)> {
        let elapsed = started.elapsed().as_secs_f64();
        let mut settled = Vec::with_capacity(keys.len());
        for ((key, item), slot) in keys.into_iter().zip(payloads).zip(slots) {
            let consumer = key.consumer.label();
            let (outcome, result) = match slot {
                Slot::Processed(value) => {
                    metrics::counter!(names::PROCESSED, "consumer" => consumer.clone())
                        .increment(1);
                    ("processed", Ok(Handled::Processed(value)))
                }
                Slot::Duplicate => match self.repeat(&key).await {
                    Ok(handled) => (count_repeat(&key, &handled), Ok(handled)),
                    Err(error) => {
                        // The batch committed; only this message's lookup
                        // failed, and its redelivery is a repeat again.
                        tracing::warn!(message_id = %key.message_id, consumer = %key.consumer,
                            error = %error, "inbox store failed looking up a duplicate's fingerprint");
                        metrics::counter!(names::FAILED, "consumer" => consumer.clone(),
                            "stage" => "lookup",
                            "retryable" => if error.is_retryable() { "true" } else { "false" })
                        .increment(1);
                        ("failed", Err(E::from(error)))
                    }
                },
                Slot::Failed(error) => ("failed", Err(error)),
                Slot::Deferred => ("failed", Err(E::from(InboxError::Deferred))),
            };
            metrics::histogram!(names::HANDLE_DURATION,
                "consumer" => consumer, "outcome" => outcome)
            .record(elapsed);
            settled.push((key, item, result));
        }
        settled
    }
}

/// Counts and logs a repeated key's outcome ([`Inbox::repeat`]'s), and
/// returns its `outcome` label.
fn count_repeat<T>(key: &InboxKey, handled: &Handled<T>) -> &'static str {
    let consumer = key.consumer.label();
    match handled {
        Handled::Conflict { stored, received } => {
            metrics::counter!(names::CONFLICTING_DUPLICATES, "consumer" => consumer).increment(1);
            tracing::warn!(message_id = %key.message_id, consumer = %key.consumer,
                stored = %stored, received = %received,
                "a processed message id came again with another payload");
            "conflict"
        }
        _ => {
            metrics::counter!(names::DUPLICATES_DISCARDED, "consumer" => consumer).increment(1);
            // Normal under at-least-once: the counter tells the rate, the
            // line is for following one message.
            tracing::debug!(message_id = %key.message_id, consumer = %key.consumer,
                "duplicate delivery discarded");
            "duplicate"
        }
    }
}

/// Every item of a batch whose own store step (`stage`) failed gets
/// [`InboxError::BatchAborted`] with the shared cause: nothing of it
/// committed (for a lost commit: maybe all of it), so each is redelivered.
fn abort<I, T, E: From<InboxError>>(
    keys: Vec<InboxKey>,
    payloads: Vec<I>,
    stage: &'static str,
    error: InboxError,
    started: Instant,
) -> Vec<(InboxKey, I, Result<Handled<T>, E>)> {
    tracing::warn!(batch = keys.len(), stage, error = %error,
        retryable = error.is_retryable(), "inbox store failed during a batch");
    let retryable = if error.is_retryable() {
        "true"
    } else {
        "false"
    };
    let cause = Arc::new(error);
    let elapsed = started.elapsed().as_secs_f64();
    keys.into_iter()
        .zip(payloads)
        .map(|(key, item)| {
            let consumer = key.consumer.label();
            metrics::counter!(names::FAILED, "consumer" => consumer.clone(),
                "stage" => stage, "retryable" => retryable)
            .increment(1);
            metrics::histogram!(names::HANDLE_DURATION,
                "consumer" => consumer, "outcome" => "failed")
            .record(elapsed);
            let error = InboxError::BatchAborted {
                source: Arc::clone(&cause),
            };
            (key, item, Err(E::from(error)))
        })
        .collect()
}

/// A batch's own store step that failed: its stage (the metric label) and
/// the error.
type StepFailure = (&'static str, InboxError);

/// Where [`Inbox::handle_batch`]'s body starts.
#[derive(Clone, Copy)]
enum BatchStart {
    /// One claim statement, no savepoints until a message's work fails.
    Optimistic,
    /// One claim statement and a savepoint per message: the batch as a
    /// whole has just failed.
    Savepoints,
    /// Each key claimed alone, in a savepoint: the batch's claim statement
    /// has just refused a key it did not name.
    OneByOne,
}

/// How [`Inbox::handle_batch_at_once`]'s attempt ended, short of a store
/// failure.
enum AtOnce<E> {
    /// Committed; each message's slot.
    Committed(Vec<Slot<(), E>>),
    /// Rolled back; run the batch again from here.
    Rerun(BatchStart),
}

/// Rolls back a batch attempt that is being dropped and run again: the
/// transaction is gone either way, so a failed rollback is only logged.
async fn drop_attempt<Tx: InboxTransaction>(tx: Tx, what: &'static str) {
    if let Err(error) = tx.rollback().await {
        tracing::debug!(error = %error, "rollback of {what} failed");
    }
}

/// What became of one message of a batch inside [`Inbox::handle_batch`], before it is
/// turned into the outcome type [`Inbox::handle`] shares.
enum Slot<T, E> {
    Processed(T),
    Duplicate,
    Failed(E),
    Deferred,
}
