//! Every message of a batch whose own store step failed (begin, claim,
//! commit) gets exactly one outcome, `BatchAborted` with the shared
//! retryable cause, in the order given; nothing of it is kept; and the
//! redelivery on a sound store processes each message once. The same for
//! all three entry points of `Inbox` (one message: the store's error).

use inbox_api::{ConsumerName, Handled, Inbox, InboxError, InboxKey, MessageId};
use inbox_backend_memory::{MemoryStore, MemoryTransaction};
use inbox_conformance::failing::{FailingStore, Stage};
use inbox_conformance::runtime;

fn key() -> InboxKey {
    InboxKey::new(MessageId::new_v7(), ConsumerName::new("c").expect("valid"))
}

async fn write(tx: &mut MemoryTransaction, key: &InboxKey) -> Result<(), InboxError> {
    tx.put(format!("effect/{}", key.message_id), "1");
    Ok(())
}

/// One message's outcome, as the batch calls return it.
type Outcome<T> = (InboxKey, usize, Result<Handled<T>, InboxError>);

/// Each outcome as `(key, item)` still paired, and whether it is the
/// batch's abort with a retryable connection error underneath.
fn aborted<T: std::fmt::Debug>(outcomes: &[Outcome<T>], keys: &[InboxKey]) {
    assert_eq!(outcomes.len(), keys.len(), "one outcome per message");
    for (i, (key, item, outcome)) in outcomes.iter().enumerate() {
        assert_eq!((key, *item), (&keys[i], i), "in the order given, paired");
        match outcome {
            Err(error @ InboxError::BatchAborted { source }) => {
                assert!(error.is_retryable(), "{error}");
                assert_eq!(source.kind(), "connection", "{error}");
            }
            other => panic!("message {i}: {other:?}"),
        }
    }
}

#[test]
fn every_message_of_a_failed_batch_gets_its_outcome() {
    runtime().block_on(async {
        for stage in Stage::ALL {
            let store = MemoryStore::new();
            let sound = Inbox::new(store.clone());
            // One message processed before: a duplicate in a sound batch.
            let done = key();
            let _ = sound
                .handle(&done, async |tx| write(tx, &done).await)
                .await
                .expect("processed");
            let keys = vec![key(), done.clone(), key()];
            let items = || keys.iter().cloned().zip(0..).collect::<Vec<_>>();
            let failing = Inbox::new(FailingStore::new(store.clone(), stage));

            let outcomes = failing
                .handle_batch(items(), async |tx, i: &usize| {
                    write(tx.inner_mut(), &keys[*i]).await
                })
                .await;
            aborted(&outcomes, &keys);
            let outcomes = failing
                .handle_batch_at_once(items(), async |tx, fresh: &[&usize]| {
                    for i in fresh {
                        write(tx.inner_mut(), &keys[**i]).await?;
                    }
                    Ok::<_, InboxError>(())
                })
                .await;
            aborted(&outcomes, &keys);
            let single = failing
                .handle(&keys[0], async |tx| write(tx.inner_mut(), &keys[0]).await)
                .await;
            assert!(
                matches!(&single, Err(InboxError::Connection { .. })),
                "{stage:?}: {single:?}"
            );
            assert_eq!(
                store.scan_prefix("effect/").len(),
                1,
                "{stage:?}: nothing kept"
            );

            // Redelivered to a sound store: each fresh message once.
            let outcomes = sound
                .handle_batch(items(), async |tx, i: &usize| write(tx, &keys[*i]).await)
                .await;
            let summary: Vec<String> = outcomes
                .iter()
                .map(|(_, _, outcome)| format!("{outcome:?}"))
                .collect();
            assert_eq!(
                summary,
                ["Ok(Processed(()))", "Ok(Duplicate)", "Ok(Processed(()))"],
                "{stage:?}"
            );
            assert_eq!(store.scan_prefix("effect/").len(), 3, "{stage:?}");
        }
    });
}
