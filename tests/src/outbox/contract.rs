//! Deterministic tests of the outbox contract documented on
//! `inbox_api::OutboxStore`, each a plain `pub async fn` generic over an
//! [`OutboxHarness`], returning a [`Failure`] naming what was expected and
//! what was seen.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use inbox_api::{
    ConsumerName, EnqueueOutcome, Handled, Inbox, InboxError, InboxKey, InboxStore,
    InboxTransaction, MessageId, OutboxStore, OutboxStoreExt, OutboxTransaction, OutgoingMessage,
    PublishRetry,
};

use super::OutboxHarness;
use crate::contract::effects_of;
use crate::{CrashKind, Failure, Outcome, TxOf, check, check_eq};

/// The lease every test takes: long enough never to run out by itself
/// while a test runs; tests that need it expired age the outbox past it.
pub const LEASE: Duration = Duration::from_secs(60);

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
}

/// A fresh outgoing message with a body naming it.
pub fn new_message() -> OutgoingMessage {
    let id = MessageId::new_v7();
    OutgoingMessage::new(
        id,
        "parcels",
        "parcel.created",
        "ParcelCreatedEvent",
        format!("{{\"id\":\"{id}\"}}").into_bytes(),
    )
    .expect("the suite's messages are valid")
}

/// The producer's business write for `message`: one effect under the
/// consumer name `producer`, so the suite can see whether it committed.
pub fn producer_key(message: &OutgoingMessage) -> InboxKey {
    InboxKey::new(
        message.id(),
        ConsumerName::new("producer").expect("valid consumer name"),
    )
}

/// A producer's transaction, left open: the business write, then the
/// enqueue.
pub async fn produce<H: OutboxHarness>(
    h: &H,
    store: &H::Store,
    message: &OutgoingMessage,
) -> Result<TxOf<H>, Failure> {
    let mut tx = store.begin().await?;
    h.record_effect(&mut tx, &producer_key(message)).await?;
    check_eq!(
        tx.enqueue(message).await?,
        EnqueueOutcome::Enqueued,
        "first enqueue of {}",
        message.id()
    );
    Ok(tx)
}

/// Enqueues `message` with its business write and commits.
pub async fn enqueue_committed<H: OutboxHarness>(
    h: &H,
    store: &H::Store,
    message: &OutgoingMessage,
) -> Outcome {
    produce(h, store, message).await?.commit().await?;
    Ok(())
}

/// Neither the business write nor the message of `message` exists, and no
/// relay can take it.
async fn expect_not_enqueued<H: OutboxHarness>(
    h: &H,
    store: &H::Store,
    message: &OutgoingMessage,
    what: &str,
) -> Outcome {
    check_eq!(
        effects_of(h, store, &producer_key(message)).await,
        0,
        "{what}: business writes"
    );
    let record = store.lookup_outgoing(&message.id()).await?;
    check!(record.is_none(), "{what}: outgoing row left: {record:?}");
    check_eq!(store.pending_count().await?, 0, "{what}: pending messages");
    let lease = store.take_pending(nz(10), LEASE).await?;
    check!(lease.is_empty(), "{what}: a relay took {:?}", lease.ids());
    Ok(())
}

/// A message enqueued and committed is pending, with its business write.
async fn expect_enqueued<H: OutboxHarness>(
    h: &H,
    store: &H::Store,
    message: &OutgoingMessage,
) -> Outcome {
    check_eq!(
        effects_of(h, store, &producer_key(message)).await,
        1,
        "business writes of {}",
        message.id()
    );
    let record = store.lookup_outgoing(&message.id()).await?;
    check_eq!(
        record.as_ref().map(|r| &r.message),
        Some(message),
        "the committed outgoing row"
    );
    check!(
        record.as_ref().is_some_and(|r| r.published_at.is_none()),
        "a fresh row is pending: {record:?}"
    );
    Ok(())
}

/// Takes leases until the store has nothing due, returning the ids in the
/// order taken.
async fn take_all<S: OutboxStore>(store: &S, limit: u32) -> Result<Vec<MessageId>, Failure> {
    let mut ids = Vec::new();
    for _ in 0..1_000 {
        let lease = store.take_pending(nz(limit), LEASE).await?;
        if lease.is_empty() {
            return Ok(ids);
        }
        check!(
            lease.messages.len() <= limit as usize,
            "a lease of limit {limit} holds {}",
            lease.messages.len()
        );
        ids.extend(lease.ids());
    }
    Err(Failure::new("take_pending never ran dry"))
}

/// The contract's line 1: the message is invisible until COMMIT, and then
/// committed together with the business write.
pub async fn outbox_enqueue_is_visible_only_after_commit<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let message = new_message();
    let tx = produce(h, &store, &message).await?;
    check!(
        store.lookup_outgoing(&message.id()).await?.is_none(),
        "an uncommitted enqueue is visible"
    );
    check_eq!(store.pending_count().await?, 0, "pending before COMMIT");
    let early = store.take_pending(nz(10), LEASE).await?;
    check!(
        early.is_empty(),
        "a relay took an uncommitted message: {:?}",
        early.ids()
    );
    tx.commit().await?;
    expect_enqueued(h, &store, &message).await?;
    check_eq!(store.pending_count().await?, 1, "pending after COMMIT");
    let lease = store.take_pending(nz(10), LEASE).await?;
    check_eq!(lease.messages, vec![message], "the relay's lease");
    Ok(())
}

/// A rollback takes the message with the business write; the same id can
/// then be enqueued afresh.
pub async fn outbox_rollback_enqueues_nothing<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let message = new_message();
    produce(h, &store, &message).await?.rollback().await?;
    expect_not_enqueued(h, &store, &message, "after rollback").await?;
    enqueue_committed(h, &store, &message).await?;
    expect_enqueued(h, &store, &message).await
}

async fn crashed_producer_enqueues_nothing<H: OutboxHarness>(h: &H, kind: CrashKind) -> Outcome {
    let store = h.fresh_store().await;
    let message = new_message();
    let tx = produce(h, &store, &message).await?;
    h.crash(&store, tx, kind).await;
    expect_not_enqueued(h, &store, &message, &format!("after {kind:?}")).await?;
    enqueue_committed(h, &store, &message).await?;
    expect_enqueued(h, &store, &message).await
}

/// A producer that dies (its transaction dropped) enqueued nothing.
pub async fn outbox_dropped_transaction_enqueues_nothing<H: OutboxHarness>(h: &H) -> Outcome {
    crashed_producer_enqueues_nothing(h, CrashKind::Drop).await
}

/// A producer whose connection is killed enqueued nothing.
pub async fn outbox_killed_connection_enqueues_nothing<H: OutboxHarness>(h: &H) -> Outcome {
    crashed_producer_enqueues_nothing(h, CrashKind::KillConnection).await
}

/// The same id twice, in one transaction or after a commit, is
/// `AlreadyEnqueued`: one row, holding the first contents.
pub async fn outbox_enqueue_of_one_id_is_idempotent<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let message = new_message();
    let changed = OutgoingMessage::new(message.id(), "other", "k", "Other", b"second".to_vec())?;
    let mut tx = produce(h, &store, &message).await?;
    check_eq!(
        tx.enqueue(&changed).await?,
        EnqueueOutcome::AlreadyEnqueued,
        "second enqueue in one transaction"
    );
    tx.commit().await?;
    let mut retry = store.begin().await?;
    check_eq!(
        retry.enqueue(&changed).await?,
        EnqueueOutcome::AlreadyEnqueued,
        "enqueue of a committed id"
    );
    retry.commit().await?;
    expect_enqueued(h, &store, &message).await?;
    check_eq!(store.pending_count().await?, 1, "rows for one id");
    Ok(())
}

/// What a relay takes is exactly what was enqueued: headers, a binary
/// body, the default exchange, text beyond ASCII.
pub async fn outbox_a_stored_message_round_trips<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let before = h.store_now(&store).await;
    let rich = OutgoingMessage::new(
        MessageId::new_v7(),
        "parcels.events:v2",
        "parcel.créé.€",
        "Parcel Created ✓",
        (0..=255u8).collect::<Vec<u8>>(),
    )?
    .with_header("tenant", "acme")?
    .with_header("trace-id", "00-4bf92f-00f067aa-01 ünïcode")?
    .with_header("empty", "")?;
    let bare = OutgoingMessage::new(MessageId::new_v7(), "", "queue-name", "T", Vec::new())?;
    let mut tx = store.begin().await?;
    for message in [&rich, &bare] {
        check_eq!(
            tx.enqueue(message).await?,
            EnqueueOutcome::Enqueued,
            "enqueue"
        );
    }
    tx.commit().await?;
    for message in [&rich, &bare] {
        let record = store.lookup_outgoing(&message.id()).await?;
        let Some(record) = record else {
            return Err(Failure::new(format!("{} was not stored", message.id())));
        };
        check_eq!(&record.message, message, "stored message");
        check_eq!(record.attempts, 0, "attempts of an untaken message");
        check_eq!(record.published_at, None, "published_at of a new row");
        check!(
            record.created_at >= before - chrono::Duration::seconds(5),
            "created_at {} before the test began ({before})",
            record.created_at
        );
    }
    let lease = store.take_pending(nz(10), LEASE).await?;
    check_eq!(lease.messages, vec![rich, bare], "the lease's messages");
    Ok(())
}

/// Relays take the oldest messages first, at most `limit` per lease, each
/// once, enqueue order kept inside one transaction too.
pub async fn outbox_take_is_oldest_first_and_bounded<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let mut expected = Vec::new();
    for _ in 0..4 {
        let message = new_message();
        enqueue_committed(h, &store, &message).await?;
        expected.push(message.id());
    }
    let mut tx = store.begin().await?;
    for _ in 0..3 {
        let message = new_message();
        check_eq!(
            tx.enqueue(&message).await?,
            EnqueueOutcome::Enqueued,
            "enqueue"
        );
        expected.push(message.id());
    }
    tx.commit().await?;
    let mut taken = Vec::new();
    for (round, size) in [3, 3, 1, 0].into_iter().enumerate() {
        let lease = store.take_pending(nz(3), LEASE).await?;
        check_eq!(lease.messages.len(), size, "lease {round}'s size");
        taken.extend(lease.ids());
    }
    check_eq!(taken, expected, "the order relays take messages in");
    for id in &expected {
        let attempts = store.lookup_outgoing(id).await?.map(|r| r.attempts);
        check_eq!(attempts, Some(1), "attempts of {id}");
    }
    Ok(())
}

/// While a lease lives, no relay takes its messages.
pub async fn outbox_a_live_lease_is_not_taken_again<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let message = new_message();
    enqueue_committed(h, &store, &message).await?;
    let first = store.take_pending(nz(10), LEASE).await?;
    check_eq!(first.ids(), vec![message.id()], "the first lease");
    check!(
        first.expires_at > h.store_now(&store).await,
        "a lease taken for {LEASE:?} has expired at once: {}",
        first.expires_at
    );
    h.age_outbox(&store, LEASE / 2).await;
    let second = store.take_pending(nz(10), LEASE).await?;
    check!(
        second.is_empty(),
        "a second relay took {:?} under a live lease",
        second.ids()
    );
    check_eq!(store.pending_count().await?, 1, "leased is still pending");
    Ok(())
}

/// A relay that died holds nothing once its lease ran out: the next relay
/// takes the same message, under the same id.
pub async fn outbox_an_expired_lease_is_taken_again<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let message = new_message();
    enqueue_committed(h, &store, &message).await?;
    let dead = store.take_pending(nz(10), LEASE).await?;
    check_eq!(dead.ids(), vec![message.id()], "the dead relay's lease");
    drop(dead);
    h.age_outbox(&store, LEASE + Duration::from_secs(1)).await;
    let next = store.take_pending(nz(10), LEASE).await?;
    check_eq!(
        next.messages,
        vec![message.clone()],
        "the next relay's lease"
    );
    let attempts = store
        .lookup_outgoing(&message.id())
        .await?
        .map(|r| r.attempts);
    check_eq!(attempts, Some(2), "attempts after a retake");
    Ok(())
}

/// Four relays take at once, in batches, until nothing is due: every
/// message is taken by exactly one of them.
pub async fn outbox_concurrent_relays_never_hold_one_message<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let mut all = BTreeSet::new();
    let mut tx = store.begin().await?;
    for _ in 0..40 {
        let message = new_message();
        check_eq!(
            tx.enqueue(&message).await?,
            EnqueueOutcome::Enqueued,
            "enqueue"
        );
        all.insert(message.id());
    }
    tx.commit().await?;
    let relays = (0..4).map(|_| take_all(&store, 3));
    let mut holders: BTreeMap<MessageId, usize> = BTreeMap::new();
    for (relay, taken) in join_all(relays).await.into_iter().enumerate() {
        for id in taken? {
            if let Some(other) = holders.insert(id, relay) {
                return Err(Failure::new(format!(
                    "relays {other} and {relay} both hold {id}"
                )));
            }
        }
    }
    let taken: BTreeSet<MessageId> = holders.keys().copied().collect();
    check_eq!(taken, all, "the messages the relays took");
    Ok(())
}

/// A mark is final: marked messages are never taken again, and marking
/// twice (after a lost answer) or an unknown id changes nothing.
pub async fn outbox_mark_published_is_final_and_repeatable<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let (a, b) = (new_message(), new_message());
    enqueue_committed(h, &store, &a).await?;
    enqueue_committed(h, &store, &b).await?;
    let lease = store.take_pending(nz(10), LEASE).await?;
    check_eq!(lease.ids(), vec![a.id(), b.id()], "the lease");
    check_eq!(
        store.mark_published(&[a.id()]).await?,
        1,
        "rows the first mark changed"
    );
    check_eq!(
        store.mark_published(&[a.id(), MessageId::new_v7()]).await?,
        0,
        "rows a repeated mark changed"
    );
    check_eq!(store.mark_published(&[]).await?, 0, "an empty mark");
    check_eq!(store.pending_count().await?, 1, "pending after the mark");
    let record = store.lookup_outgoing(&a.id()).await?;
    check!(
        record.as_ref().is_some_and(|r| r.published_at.is_some()),
        "a marked row has published_at: {record:?}"
    );
    h.age_outbox(&store, LEASE + Duration::from_secs(1)).await;
    let retaken = store.take_pending(nz(10), LEASE).await?;
    check_eq!(
        retaken.ids(),
        vec![b.id()],
        "after the lease ran out, only the unmarked message"
    );
    Ok(())
}

/// A relay whose lease ran out while it waited for the broker's confirm
/// still marks the message: it was published. The relay that retook it
/// then finds nothing to mark or release.
pub async fn outbox_a_late_mark_still_publishes<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let message = new_message();
    enqueue_committed(h, &store, &message).await?;
    let slow = store.take_pending(nz(10), LEASE).await?;
    h.age_outbox(&store, LEASE + Duration::from_secs(1)).await;
    let fast = store.take_pending(nz(10), LEASE).await?;
    check_eq!(fast.ids(), slow.ids(), "the retaken lease");
    check_eq!(
        store.mark_published(&slow.ids()).await?,
        1,
        "the slow relay's mark"
    );
    check_eq!(
        store.mark_published(&fast.ids()).await?,
        0,
        "the second mark"
    );
    check_eq!(
        store.release(&fast).await?,
        0,
        "release of a published lease"
    );
    check_eq!(store.pending_count().await?, 0, "pending");
    Ok(())
}

/// A relay that cannot publish gives its lease back, and the messages are
/// due again at once, not after the lease's time.
pub async fn outbox_release_gives_messages_back_at_once<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let (a, b) = (new_message(), new_message());
    enqueue_committed(h, &store, &a).await?;
    enqueue_committed(h, &store, &b).await?;
    let lease = store.take_pending(nz(10), LEASE).await?;
    check_eq!(store.mark_published(&[a.id()]).await?, 1, "mark of a");
    check_eq!(
        store.release(&lease).await?,
        1,
        "released (the published message is not)"
    );
    let again = store.take_pending(nz(10), LEASE).await?;
    check_eq!(again.ids(), vec![b.id()], "taken again at once");
    Ok(())
}

/// Releasing a lease that ran out and was retaken by another relay must not
/// free the newer lease's messages.
pub async fn outbox_release_leaves_a_newer_lease_alone<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let message = new_message();
    enqueue_committed(h, &store, &message).await?;
    let old = store.take_pending(nz(10), LEASE).await?;
    h.age_outbox(&store, LEASE + Duration::from_secs(1)).await;
    let newer = store.take_pending(nz(10), LEASE).await?;
    check_eq!(newer.ids(), vec![message.id()], "the newer lease");
    check_eq!(
        store.release(&old).await?,
        0,
        "release of the expired lease"
    );
    let third = store.take_pending(nz(10), LEASE).await?;
    check!(
        third.is_empty(),
        "the old lease's release freed the newer lease's {:?}",
        third.ids()
    );
    Ok(())
}

/// Cleanup deletes published rows older than the cutoff, at most `limit`
/// per batch, and never a pending or leased one.
pub async fn outbox_purge_deletes_published_rows_in_batches_never_pending<H: OutboxHarness>(
    h: &H,
) -> Outcome {
    let store = h.fresh_store().await;
    let mut published = Vec::new();
    for _ in 0..5 {
        let message = new_message();
        enqueue_committed(h, &store, &message).await?;
        published.push(message.id());
    }
    let lease = store.take_pending(nz(10), LEASE).await?;
    check_eq!(lease.ids(), published, "the lease");
    check_eq!(store.mark_published(&published).await?, 5, "marks");
    let (leased, pending) = (new_message(), new_message());
    enqueue_committed(h, &store, &leased).await?;
    let held = store.take_pending(nz(1), LEASE).await?;
    check_eq!(held.ids(), vec![leased.id()], "the held lease");
    enqueue_committed(h, &store, &pending).await?;
    h.age_outbox(&store, Duration::from_secs(3600)).await;
    let cutoff = h.store_now(&store).await - chrono::Duration::seconds(60);
    for (batch, expected) in [2, 2, 1, 0].into_iter().enumerate() {
        check_eq!(
            store.purge_published_batch(cutoff, nz(2)).await?,
            expected,
            "rows purged by batch {batch}"
        );
    }
    for id in &published {
        check!(
            store.lookup_outgoing(id).await?.is_none(),
            "published {id} survived the purge"
        );
    }
    for message in [&leased, &pending] {
        check!(
            store.lookup_outgoing(&message.id()).await?.is_some(),
            "cleanup deleted the unpublished {}",
            message.id()
        );
    }
    check_eq!(store.pending_count().await?, 2, "pending after cleanup");
    check_eq!(
        store.purge_published_before(cutoff, nz(2)).await?,
        0,
        "the convenience loop on nothing left"
    );
    Ok(())
}

/// The cutoff is exclusive: a row published exactly at it stays, one a
/// microsecond older goes (the Ext loop, through every batch).
pub async fn outbox_purge_keeps_rows_published_at_the_cutoff<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let message = new_message();
    enqueue_committed(h, &store, &message).await?;
    let lease = store.take_pending(nz(10), LEASE).await?;
    store.mark_published(&lease.ids()).await?;
    let at = store
        .lookup_outgoing(&message.id())
        .await?
        .and_then(|r| r.published_at)
        .ok_or_else(|| Failure::new("no published_at after the mark"))?;
    check_eq!(
        store.purge_published_before(at, nz(1)).await?,
        0,
        "purged with the cutoff at published_at"
    );
    check_eq!(
        store
            .purge_published_before(at + chrono::Duration::microseconds(1), nz(1))
            .await?,
        1,
        "purged with the cutoff a microsecond later"
    );
    Ok(())
}

/// `Arc<S>` forwards every outbox call to the store it shares, so an
/// application may hand one store to its consumers and its relay.
pub async fn outbox_a_shared_store_forwards_every_call<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let shared = Arc::new(store.clone());
    let (a, b) = (new_message(), new_message());
    let mut tx = shared.begin().await?;
    check_eq!(tx.enqueue(&a).await?, EnqueueOutcome::Enqueued, "enqueue a");
    check_eq!(tx.enqueue(&b).await?, EnqueueOutcome::Enqueued, "enqueue b");
    tx.commit().await?;
    check_eq!(shared.pending_count().await?, 2, "pending through the Arc");
    let lease = shared.take_pending(nz(10), LEASE).await?;
    check_eq!(lease.ids(), vec![a.id(), b.id()], "take through the Arc");
    check_eq!(shared.mark_published(&[a.id()]).await?, 1, "mark");
    check_eq!(shared.release(&lease).await?, 1, "release through the Arc");
    let record = shared.lookup_outgoing(&a.id()).await?;
    check!(
        record.is_some_and(|r| r.published_at.is_some()),
        "lookup through the Arc"
    );
    h.age_outbox(&store, Duration::from_secs(3600)).await;
    let future = h.store_now(&store).await + chrono::Duration::seconds(1);
    check_eq!(
        shared.purge_published_batch(future, nz(10)).await?,
        1,
        "purge through the Arc"
    );
    check_eq!(shared.record_pending().await?, 1, "the Ext pending count");
    let refused = shared
        .record_refusals(&lease.id, &[(b.id(), "nack".into())], &RETRY)
        .await?;
    check_eq!(refused.recorded, 0, "a released lease charges nothing");
    check!(shared.dead_outgoing(nz(10)).await?.is_empty(), "none dead");
    check_eq!(
        shared.requeue_dead(&[b.id()]).await?,
        0,
        "requeue through the Arc"
    );
    Ok(())
}

/// The retry policy of the refusal tests: 10 s doubling to 40 s, dead at
/// the third refusal.
pub const RETRY: PublishRetry = PublishRetry {
    base_delay: Duration::from_secs(10),
    max_delay: Duration::from_secs(40),
    max_attempts: NonZeroU32::new(3).expect("non-zero"),
};

/// The contract's line 5: a refused message lets go of its lease and is
/// not taken before its backoff (10 s, then 20 s), while the others are;
/// the refusal is recorded on the row; a repeated call charges nothing.
pub async fn outbox_a_refused_message_waits_out_its_backoff<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let (a, b) = (new_message(), new_message());
    enqueue_committed(h, &store, &a).await?;
    enqueue_committed(h, &store, &b).await?;
    let lease = store.take_pending(nz(10), LEASE).await?;
    check_eq!(lease.ids(), vec![a.id(), b.id()], "the first lease");
    let refusal = [(a.id(), "nacked by the broker".to_owned())];
    let refused = store.record_refusals(&lease.id, &refusal, &RETRY).await?;
    check_eq!(refused.recorded, 1, "refusals recorded");
    check!(
        refused.dead.is_empty(),
        "dead after one: {:?}",
        refused.dead
    );
    let again = store.record_refusals(&lease.id, &refusal, &RETRY).await?;
    check_eq!(
        again.recorded,
        0,
        "the lease let go: a repeat charges nothing"
    );
    let record = store.lookup_outgoing(&a.id()).await?;
    check_eq!(
        record.as_ref().map(|r| (r.failures, r.last_error.clone())),
        Some((1, Some("nacked by the broker".to_owned()))),
        "the refused row"
    );
    let now = h.store_now(&store).await;
    check!(
        record
            .as_ref()
            .and_then(|r| r.next_attempt_at)
            .is_some_and(|next| next > now + chrono::Duration::seconds(5)
                && next <= now + chrono::Duration::seconds(11)),
        "its backoff ends about 10 s from {now}: {record:?}"
    );
    check_eq!(store.pending_count().await?, 2, "refused is still pending");
    store.mark_published(&[b.id()]).await?;
    let early = store.take_pending(nz(10), LEASE).await?;
    check!(
        early.is_empty(),
        "taken during its backoff: {:?}",
        early.ids()
    );

    h.age_outbox(&store, Duration::from_secs(11)).await;
    let second = store.take_pending(nz(10), LEASE).await?;
    check_eq!(second.ids(), vec![a.id()], "taken after its backoff");
    store.record_refusals(&second.id, &refusal, &RETRY).await?;
    h.age_outbox(&store, Duration::from_secs(11)).await;
    let doubled = store.take_pending(nz(10), LEASE).await?;
    check!(
        doubled.is_empty(),
        "the second backoff is 20 s: {:?}",
        doubled.ids()
    );
    h.age_outbox(&store, Duration::from_secs(10)).await;
    let third = store.take_pending(nz(10), LEASE).await?;
    check_eq!(third.ids(), vec![a.id()], "taken after the second backoff");
    Ok(())
}

/// At the retry limit the message is dead: kept, listed, never taken, not
/// pending, never purged; the others flow; a requeue makes it pending again
/// with a fresh count.
pub async fn outbox_a_message_refused_too_often_is_dead_until_requeued<H: OutboxHarness>(
    h: &H,
) -> Outcome {
    let store = h.fresh_store().await;
    let (refused, other) = (new_message(), new_message());
    enqueue_committed(h, &store, &refused).await?;
    let refusal = [(refused.id(), "returned unroutable: 312 NO_ROUTE".to_owned())];
    let mut dead = Vec::new();
    for n in 1..=RETRY.max_attempts.get() {
        h.age_outbox(&store, RETRY.max_delay + Duration::from_secs(1))
            .await;
        let lease = store.take_pending(nz(10), LEASE).await?;
        check_eq!(lease.ids(), vec![refused.id()], "take {n}");
        dead = store
            .record_refusals(&lease.id, &refusal, &RETRY)
            .await?
            .dead;
    }
    check_eq!(dead, vec![refused.id()], "dead at the limit");
    let record = store.lookup_outgoing(&refused.id()).await?;
    check!(
        record
            .as_ref()
            .is_some_and(|r| r.dead_at.is_some() && r.failures == 3 && r.published_at.is_none()),
        "the dead row is kept: {record:?}"
    );
    check_eq!(store.pending_count().await?, 0, "dead is not pending");
    check_eq!(store.dead_count().await?, 1, "counted dead");
    enqueue_committed(h, &store, &other).await?;
    h.age_outbox(&store, Duration::from_secs(3600)).await;
    let lease = store.take_pending(nz(10), LEASE).await?;
    check_eq!(lease.ids(), vec![other.id()], "only the living are taken");
    store.mark_published(&[other.id()]).await?;
    let listed: Vec<MessageId> = store
        .dead_outgoing(nz(10))
        .await?
        .iter()
        .map(|r| r.message.id())
        .collect();
    check_eq!(listed, vec![refused.id()], "the dead listed");
    let future = h.store_now(&store).await + chrono::Duration::seconds(1);
    check_eq!(
        store.purge_published_batch(future, nz(10)).await?,
        1,
        "purge takes the published row, never the dead one"
    );
    check_eq!(
        store.requeue_dead(&[refused.id(), other.id()]).await?,
        1,
        "requeued"
    );
    check_eq!(store.requeue_dead(&[refused.id()]).await?, 0, "once");
    check_eq!(store.pending_count().await?, 1, "pending again");
    check_eq!(store.dead_count().await?, 0, "no longer counted dead");
    let lease = store.take_pending(nz(10), LEASE).await?;
    check_eq!(lease.ids(), vec![refused.id()], "taken after the requeue");
    let record = store.lookup_outgoing(&refused.id()).await?;
    check_eq!(
        record.map(|r| (r.failures, r.dead_at)),
        Some((0, None)),
        "a fresh count"
    );
    Ok(())
}

/// Only the lease that holds a message can charge it: a relay whose lease
/// ran out (another took the message since) and a published message are
/// not charged.
pub async fn outbox_refusals_charge_only_the_holding_lease<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let (a, b) = (new_message(), new_message());
    enqueue_committed(h, &store, &a).await?;
    enqueue_committed(h, &store, &b).await?;
    let old = store.take_pending(nz(10), LEASE).await?;
    h.age_outbox(&store, LEASE + Duration::from_secs(1)).await;
    let new = store.take_pending(nz(10), LEASE).await?;
    check_eq!(new.ids(), vec![a.id(), b.id()], "retaken");
    store.mark_published(&[b.id()]).await?;
    let refusals = [(a.id(), "nack".to_owned()), (b.id(), "nack".to_owned())];
    let stale = store.record_refusals(&old.id, &refusals, &RETRY).await?;
    check_eq!(
        stale.recorded,
        0,
        "an expired, retaken lease charges nothing"
    );
    let current = store.record_refusals(&new.id, &refusals, &RETRY).await?;
    check_eq!(
        current.recorded,
        1,
        "the holder charges its unpublished one"
    );
    let failures = |r: Option<inbox_api::OutboxRecord>| r.map(|r| r.failures);
    check_eq!(
        failures(store.lookup_outgoing(&a.id()).await?),
        Some(1),
        "a"
    );
    check_eq!(
        failures(store.lookup_outgoing(&b.id()).await?),
        Some(0),
        "b"
    );
    Ok(())
}

/// A consumer that publishes in its handler (an inbox-processed message
/// causing an outgoing one): the outgoing message commits with the claim,
/// a failing handler enqueues nothing, and a duplicate delivery does not
/// run the handler, so nothing is enqueued twice.
pub async fn outbox_enqueue_in_the_handler_shares_its_fate<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let inbox = Inbox::new(store.clone());
    let incoming = InboxKey::new(MessageId::new_v7(), ConsumerName::new("booking")?);
    let outgoing = new_message();
    let failed = inbox
        .handle(&incoming, async |tx| {
            let _ = tx.enqueue(&outgoing).await?;
            Err::<(), _>(InboxError::retryable_handler("carrier API timed out"))
        })
        .await;
    check!(
        matches!(failed, Err(InboxError::Handler { .. })),
        "the failing handler: {failed:?}"
    );
    check!(
        store.lookup_outgoing(&outgoing.id()).await?.is_none(),
        "a failed handler's message was enqueued"
    );
    for delivery in 0..2 {
        let handled = inbox
            .handle(&incoming, async |tx| {
                h.record_effect(tx, &incoming).await?;
                tx.enqueue(&outgoing).await
            })
            .await?;
        let expected = if delivery == 0 {
            Handled::Processed(EnqueueOutcome::Enqueued)
        } else {
            Handled::Duplicate
        };
        check_eq!(handled, expected, "delivery {delivery}");
    }
    check_eq!(
        effects_of(h, &store, &incoming).await,
        1,
        "the handler's effect"
    );
    check_eq!(store.pending_count().await?, 1, "outgoing rows");
    Ok(())
}

/// How the first of two enqueues of one id ends, while the second waits.
#[derive(Clone, Copy, Debug)]
enum FirstEnds {
    Commit,
    Crash(CrashKind),
}

/// An enqueue of an id another open transaction enqueued waits for it, as a
/// claim does (the primary key's uncommitted entry on PostgreSQL): that
/// transaction commits, the wait ends in `AlreadyEnqueued`; it dies, the
/// wait ends in `Enqueued`. One row either way.
async fn enqueue_waits_for_an_open_enqueue<H: OutboxHarness>(h: &H, end: FirstEnds) -> Outcome {
    let store = h.fresh_store().await;
    let message = new_message();
    let first = produce(h, &store, &message).await?;
    let second_store = store.clone();
    let second_message = message.clone();
    let mut second = std::pin::pin!(async move {
        let mut tx = second_store.begin().await?;
        let outcome = tx.enqueue(&second_message).await?;
        tx.commit().await?;
        Ok::<_, InboxError>(outcome)
    });
    check!(
        tokio::time::timeout(h.blocking_probe(), &mut second)
            .await
            .is_err(),
        "the second enqueue of {} did not wait for the open first one",
        message.id()
    );
    let expected = match end {
        FirstEnds::Commit => {
            first.commit().await?;
            EnqueueOutcome::AlreadyEnqueued
        }
        FirstEnds::Crash(kind) => {
            h.crash(&store, first, kind).await;
            EnqueueOutcome::Enqueued
        }
    };
    let outcome = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .map_err(|_| Failure::new("the second enqueue never ended"))??;
    check_eq!(outcome, expected, "the waiting enqueue after {end:?}");
    check!(
        store.lookup_outgoing(&message.id()).await?.is_some(),
        "no row for {}",
        message.id()
    );
    check_eq!(store.pending_count().await?, 1, "rows for one id");
    Ok(())
}

/// The first enqueue commits: the waiting one is `AlreadyEnqueued`.
pub async fn outbox_an_enqueue_waits_then_already_enqueued_after_commit<H: OutboxHarness>(
    h: &H,
) -> Outcome {
    enqueue_waits_for_an_open_enqueue(h, FirstEnds::Commit).await
}

/// The first enqueue's transaction is dropped: the waiting one enqueues.
pub async fn outbox_an_enqueue_waits_then_enqueues_after_drop<H: OutboxHarness>(h: &H) -> Outcome {
    enqueue_waits_for_an_open_enqueue(h, FirstEnds::Crash(CrashKind::Drop)).await
}

/// The first enqueue's connection is killed: the waiting one enqueues.
pub async fn outbox_an_enqueue_waits_then_enqueues_after_kill<H: OutboxHarness>(h: &H) -> Outcome {
    enqueue_waits_for_an_open_enqueue(h, FirstEnds::Crash(CrashKind::KillConnection)).await
}

/// Two producers each enqueue the id the other holds: a deadlock, which
/// ends one of them with a retryable conflict (40P01 on PostgreSQL) while
/// the other goes on and commits both messages.
pub async fn outbox_crossed_enqueues_are_a_retryable_conflict<H: OutboxHarness>(h: &H) -> Outcome {
    let store = h.fresh_store().await;
    let (x, y) = (new_message(), new_message());
    let mut a = store.begin().await?;
    let mut b = store.begin().await?;
    check_eq!(
        a.enqueue(&x).await?,
        EnqueueOutcome::Enqueued,
        "A enqueues x"
    );
    check_eq!(
        b.enqueue(&y).await?,
        EnqueueOutcome::Enqueued,
        "B enqueues y"
    );
    let (a_crossed, b_crossed) = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(
            async {
                let outcome = a.enqueue(&y).await;
                (a, outcome)
            },
            async {
                // A waits on y first, then B closes the cycle.
                tokio::time::sleep(h.blocking_probe()).await;
                let outcome = b.enqueue(&x).await;
                (b, outcome)
            }
        )
    })
    .await
    .map_err(|_| Failure::new("crossed enqueues hung: the deadlock was not detected"))?;
    let (survivor, victim_error) = match (a_crossed, b_crossed) {
        ((a, Ok(outcome)), (b, Err(error))) => {
            check_eq!(outcome, EnqueueOutcome::Enqueued, "A's enqueue of y");
            drop(b);
            (a, error)
        }
        ((a, Err(error)), (b, Ok(outcome))) => {
            check_eq!(outcome, EnqueueOutcome::Enqueued, "B's enqueue of x");
            drop(a);
            (b, error)
        }
        ((_, a), (_, b)) => {
            return Err(Failure::new(format!(
                "crossed enqueues: exactly one must fail, got {a:?} and {b:?}"
            )));
        }
    };
    check!(
        victim_error.is_retryable() && victim_error.kind() == "conflict",
        "the deadlock's victim: {victim_error:?}"
    );
    survivor.commit().await?;
    check_eq!(store.pending_count().await?, 2, "both messages, once each");
    Ok(())
}

/// Runs every outbox contract test against `h` and returns the failures by
/// name.
pub async fn run_all<H: OutboxHarness>(h: &H) -> Vec<(&'static str, Failure)> {
    let mut failures = Vec::new();
    macro_rules! run {
        ($($name:ident),+ $(,)?) => {$(
            if let Err(failure) = $name(h).await {
                failures.push((stringify!($name), failure));
            }
        )+};
    }
    crate::__with_outbox_contract_tests!([run run]);
    failures
}
