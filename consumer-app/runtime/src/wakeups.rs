//! Wake-ups for the outbox relay: a stream that yields when an outbox row
//! committed, so that the relay publishes it at once instead of at its
//! next poll.
//!
//! PostgreSQL's LISTEN/NOTIFY gives them (the enqueue's trigger notifies);
//! without wake-ups the relay still publishes everything, on its poll
//! interval. [`OutboxWakeups`] says how a store gives them, so that
//! [`crate::Service::with_relay`] starts the relay with its wake-ups in one
//! call.

use std::future::Future;

use futures::stream::BoxStream;

/// A store whose committed outbox rows can wake a relay.
pub trait OutboxWakeups {
    /// The wake-ups, or `None` when the store has none (the relay polls).
    fn wakeups(&self) -> impl Future<Output = Option<BoxStream<'static, ()>>> + Send;
}

#[cfg(feature = "sqlx")]
impl OutboxWakeups for inbox_backend_sqlx::SqlxStore {
    fn wakeups(&self) -> impl Future<Output = Option<BoxStream<'static, ()>>> + Send {
        sqlx_wakeups(self)
    }
}

/// The diesel store keeps no URL to LISTEN on a connection of its own, so
/// through the builder its relay polls; [`diesel_wakeups`] gives the
/// wake-ups from a URL (as `parcel-inbox relay` does).
#[cfg(feature = "diesel")]
impl OutboxWakeups for inbox_backend_diesel::DieselStore {
    async fn wakeups(&self) -> Option<BoxStream<'static, ()>> {
        None
    }
}

/// The in-process store has no notifications: its relay polls.
#[cfg(feature = "memory")]
impl OutboxWakeups for inbox_backend_memory::MemoryStore {
    async fn wakeups(&self) -> Option<BoxStream<'static, ()>> {
        None
    }
}

/// The sqlx store's outbox notifications as wake-ups, or `None` (polling
/// only) when LISTEN fails.
///
/// After a lost listener connection (or any listener error) it LISTENs
/// again on a new one, with backoff
/// ([`crate::backoff::RECONNECT`]), and then wakes the
/// relay once: a commit made while it was disconnected notified nobody, and
/// that round publishes it (as diesel's `OutboxListener` does). sqlx's own
/// reconnect (`PgListener`'s `eager_reconnect`) is off: it would reconnect
/// silently, so those commits would wait for the poll interval.
#[cfg(feature = "sqlx")]
pub async fn sqlx_wakeups(store: &inbox_backend_sqlx::SqlxStore) -> Option<BoxStream<'static, ()>> {
    use futures::StreamExt;

    use crate::backoff::RECONNECT;
    // Bounded like every connect of the runtime: a server that accepts and
    // stays silent must not hold the relay (and its shutdown) for ever.
    let listen = async |store: &inbox_backend_sqlx::SqlxStore| {
        let limit = crate::amqp::CONNECT_TIMEOUT;
        let mut listener = tokio::time::timeout(limit, store.listen_outbox())
            .await
            .map_err(|_| inbox_api::InboxError::Connection {
                source: format!("LISTEN: no answer from PostgreSQL within {limit:?}").into(),
            })??;
        listener.eager_reconnect(false);
        Ok::<_, inbox_api::InboxError>(listener)
    };
    match listen(store).await {
        Ok(listener) => Some(
            futures::stream::unfold(
                (store.clone(), listener),
                move |(store, mut listener)| async move {
                    match listener.try_recv().await {
                        Ok(Some(_)) => return Some(((), (store, listener))),
                        Ok(None) => {
                            tracing::warn!("outbox LISTEN connection lost; listening again")
                        }
                        Err(error) => {
                            tracing::warn!(error = %error, "outbox LISTEN failed; listening again");
                        }
                    }
                    drop(listener);
                    let mut attempt = 0_u32;
                    loop {
                        tokio::time::sleep(RECONNECT.delay(attempt)).await;
                        match listen(&store).await {
                            Ok(listener) => {
                                tracing::info!("outbox LISTEN again; waking the relay once");
                                return Some(((), (store, listener)));
                            }
                            Err(error) => tracing::debug!(
                                error = %crate::error::chain(&error),
                                attempt, "outbox LISTEN failed again"
                            ),
                        }
                        attempt = attempt.saturating_add(1);
                    }
                },
            )
            .boxed(),
        ),
        Err(error) => {
            tracing::warn!(error = %crate::error::chain(&error),
                "LISTEN on the outbox channel failed; the relay polls only");
            None
        }
    }
}

/// The diesel store's outbox notifications as wake-ups, through a
/// connection of their own, or `None` (polling only) when LISTEN fails.
/// The listener reconnects by itself after a lost connection (and wakes
/// the relay once then).
#[cfg(feature = "diesel")]
pub async fn diesel_wakeups(
    url: &str,
    schema: &inbox_backend_diesel::SchemaName,
) -> Option<BoxStream<'static, ()>> {
    use futures::StreamExt;
    match inbox_backend_diesel::OutboxListener::connect(url, schema).await {
        Ok(listener) => Some(
            futures::stream::unfold(listener, |mut listener| async move {
                listener.next().await.map(|()| ((), listener))
            })
            .boxed(),
        ),
        Err(error) => {
            tracing::warn!(error = %crate::error::chain(&error),
                "LISTEN on the outbox channel failed; the relay polls only");
            None
        }
    }
}
