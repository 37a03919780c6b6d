//! The producer side in one process, for the demo and the tests: `POST
//! /parcels` on a real listening server (127.0.0.1, a free port) and an
//! outbox relay woken by each creation, plus what a run needs around them:
//! creating parcels over HTTP, and publishing copies of outbox messages
//! (the redeliveries a relay that died between publish and mark makes).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use inbox_api::{MessageId, OutboxStore};

use crate::parcel::api::{ApiServer, ParcelApi};
use crate::parcel::events::ParcelCreatedEvent;
use crate::parcel::store::ParcelStore;
use crate::parcel::topology::Topology;
use crate::tools::broker::{Broker, Sent};
use crate::tools::http::{Answer, post_json};
use inbox_runtime::AppError;
use inbox_runtime::amqp::Outgoing;
use inbox_runtime::relay::{Relay, RelayConfig, RelayHandle, RelayTally};

/// The endpoint and a relay, running in this process.
pub struct Producer {
    server: ApiServer,
    relay: RelayHandle,
}

impl Producer {
    /// Serves `POST /parcels` on `store` (enqueueing to `topology`'s
    /// exchange) on 127.0.0.1 at a free port, with a relay publishing to
    /// `broker_url` (RabbitMQ or NATS JetStream, by its scheme), woken by each creation and polling every 100 ms for the
    /// consumers' follow-ups.
    ///
    /// # Errors
    /// The relay's settings, or a failed bind.
    pub async fn start<S: ParcelStore>(
        store: S,
        topology: &Topology,
        broker_url: &str,
        connection_name: &str,
    ) -> Result<Self, AppError> {
        let api = ParcelApi::new(store.clone(), topology);
        let config = RelayConfig {
            poll_interval: Duration::from_millis(100),
            ..RelayConfig::new(broker_url, connection_name)
        };
        let relay = Relay::new(store, config)?.wake_on(api.committed()).spawn();
        let server = ApiServer::start(([127, 0, 0, 1], 0).into(), api.router()).await?;
        Ok(Self { server, relay })
    }

    /// Where `POST /parcels` listens.
    pub fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// What the relay did so far.
    pub fn relay_tally(&self) -> Arc<RelayTally> {
        Arc::clone(&self.relay.tally)
    }

    /// Stops the server, then the relay after its batch in flight.
    ///
    /// # Errors
    /// The relay's failure, if it failed.
    pub async fn stop(self) -> Result<(), AppError> {
        self.server.stop().await;
        self.relay.shutdown();
        self.relay.join().await
    }
}

/// `POST /parcels` for each parcel, with its id (the client's idempotency
/// key), one request at a time; the answers in order.
///
/// # Errors
/// A request that got no answer.
pub async fn create_parcels(
    addr: SocketAddr,
    parcels: &[ParcelCreatedEvent],
) -> Result<Vec<Answer>, AppError> {
    let mut answers = Vec::with_capacity(parcels.len());
    for parcel in parcels {
        let body = serde_json::json!({
            "parcel_id": parcel.parcel_id,
            "tracking_number": parcel.tracking_number,
            "destination": parcel.destination,
        });
        answers.push(post_json(addr, "/parcels", &body).await?);
    }
    Ok(answers)
}

/// Publishes a copy of each stored outgoing message of `ids` (to its
/// exchange, with its routing key, type and id, confirmed): what a relay
/// that died between the broker's confirm and its mark publishes again.
/// Returns how many copies went out (ids without a row are skipped).
///
/// # Errors
/// Store or broker failures.
pub async fn publish_copies<S: OutboxStore>(
    store: &S,
    broker_url: &str,
    ids: &[MessageId],
) -> Result<usize, AppError> {
    let broker = Broker::connect(broker_url, "parcel-inbox copies").await?;
    let copies = copy_messages(store, &broker, ids).await;
    broker.close().await;
    Ok(copies?.len())
}

/// [`publish_copies`] on an open connection: what became of each copy, by
/// its routing key. On JetStream a copy within the stream's duplicate
/// window is dropped by the stream ([`Sent::DroppedAsDuplicate`]), so no
/// consumer sees it; on RabbitMQ every copy reaches the consumers, whose
/// inboxes discard it.
///
/// # Errors
/// Store or broker failures.
pub async fn copy_messages<S: OutboxStore>(
    store: &S,
    broker: &Broker,
    ids: &[MessageId],
) -> Result<Vec<(String, Sent)>, AppError> {
    let mut sent = Vec::with_capacity(ids.len());
    for id in ids {
        let Some(record) = store.lookup_outgoing(id).await? else {
            continue;
        };
        let message = record.message;
        let outcome = broker
            .publish(
                message.exchange(),
                message.routing_key(),
                &Outgoing {
                    message_id: Some(message.id().to_string()),
                    kind: Some(message.message_type().to_owned()),
                    body: message.body().to_vec(),
                },
            )
            .await?;
        sent.push((message.routing_key().to_owned(), outcome));
    }
    Ok(sent)
}
