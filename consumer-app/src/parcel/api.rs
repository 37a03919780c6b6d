//! `POST /parcels`: the producer side of the loop. A request writes the
//! `parcels` row and its `parcel.created` outbox row in one transaction; the
//! relay ([`inbox_runtime::Relay`]) publishes the event after COMMIT.
//!
//! ```text
//! POST /parcels {"tracking_number", "destination", "parcel_id"?}
//!   └► one transaction: enqueue parcel.created (id = v5(parcel_id)) + INSERT parcels ─► COMMIT
//!        └► 201 {"parcel_id", "message_id"}, Location: /parcels/{parcel_id}
//! relay: outbox ─► RabbitMQ (confirms) ─► the consumers' inboxes
//! ```
//!
//! What a client gets, and why:
//!
//! - **201 Created** with the parcel's id and its event's message id, and a
//!   `Location` header (`GET /parcels/{id}` answers it).
//! - **Idempotent creation by a client-chosen `parcel_id`** (a natural
//!   key in the resource itself): a client that lost the answer sends the
//!   same request again and gets **200 OK** with the same body, and no
//!   second event; the same id with other fields is **409 Conflict**.
//! - **Idempotent requests by an `Idempotency-Key` header**
//!   ([`inbox_runtime::idempotency`]), for clients that let the server pick
//!   the id: the key is claimed in the creation's own transaction and the
//!   response kept with it, so a retry with the same key and body gets the
//!   first response again (`Idempotent-Replayed: true`, the same parcel id,
//!   no second parcel or event); the same key with another body is **422**;
//!   a retry while the first request still runs here is **409** with
//!   `Retry-After`. Without either, the server picks a fresh UUID v7 (a
//!   retry then creates a second parcel).
//! - **Bad input writes nothing**: a body that is not JSON is **400**, a
//!   JSON one without the fields or breaking the event's rules
//!   ([`ParcelCreatedEvent::validate`], the consumers' own) is **422**, a
//!   `Content-Type` other than JSON **415**, a body over [`MAX_BODY`]
//!   **413**; each with a JSON `{"error": reason}`.
//! - **A store failure** is **503** with `Retry-After` when retrying may
//!   succeed (connection lost, pool timeout, serialization failure), **500**
//!   otherwise; the transaction rolled back, so nothing was enqueued.

use std::net::SocketAddr;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::stream::{BoxStream, StreamExt};
use inbox_api::{EnqueueOutcome, InboxTransaction, OutboxTransaction};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::parcel::effects::ParcelEffects;
use crate::parcel::events::{self, ParcelCreatedEvent, created_message_id};
use crate::parcel::store::ParcelStore;
use crate::parcel::topology::Topology;
use inbox_runtime::AppError;
use inbox_runtime::error::chain;
use inbox_runtime::idempotency::{Idempotency, IdempotencyKey};
use inbox_runtime::shutdown::stopped;
use tracing::Instrument as _;

/// The largest request body, in bytes: three fields of at most
/// [`ParcelCreatedEvent::MAX_FIELD_LEN`] bytes each, with room for JSON
/// escapes.
pub const MAX_BODY: usize = 16 * 1024;

/// The counter of `POST /parcels` requests, labelled `outcome` (`created`,
/// `replayed`, `conflict`, `invalid`, `unavailable`, `failed`).
pub const REQUESTS_METRIC: &str = "parcel_api_requests_total";

/// The body of `POST /parcels`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct CreateParcel {
    /// The client's id for the parcel, its idempotency key; a fresh UUID v7
    /// when absent.
    #[serde(default)]
    pub parcel_id: Option<String>,
    /// The number printed on the label.
    pub tracking_number: String,
    /// Where it goes.
    pub destination: String,
}

/// What `POST /parcels` answers on success (201 or 200).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct Receipt {
    /// The parcel's id.
    pub parcel_id: String,
    /// The id its `parcel.created` event is published under (a UUID).
    pub message_id: String,
}

/// What a creation did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Creation {
    /// The parcel and its event committed.
    Created(Receipt),
    /// The parcel existed already, with these very fields: nothing written.
    Replayed(Receipt),
    /// The parcel existed already, with other fields: nothing written.
    Conflict {
        /// The parcel as stored.
        existing: ParcelCreatedEvent,
    },
}

/// Creates `parcel` in `tx`: its `parcels` row and its `parcel.created`
/// outbox row (to `exchange`), or, for a parcel that exists, nothing. The
/// caller commits or rolls back (`POST /parcels` runs it through
/// [`Idempotency::respond`], which does both).
///
/// The enqueue comes first: its id is derived from the parcel id
/// ([`created_message_id`]), so a second transaction creating the same
/// parcel waits there until the first ends, on every store (the memory
/// store has no row lock on `parcels` to wait on).
///
/// # Errors
/// Store failures (roll the transaction back: nothing is enqueued);
/// [`AppError::Inbox`] for an exchange name the outbox refuses.
pub async fn create_parcel_in<T: ParcelEffects + OutboxTransaction>(
    tx: &mut T,
    exchange: &str,
    parcel: &ParcelCreatedEvent,
) -> Result<Creation, AppError> {
    let outgoing = events::created_outgoing(exchange, parcel)?;
    let receipt = Receipt {
        parcel_id: parcel.parcel_id.clone(),
        message_id: outgoing.id().to_string(),
    };
    let fresh = tx.enqueue(&outgoing).await? == EnqueueOutcome::Enqueued;
    if fresh && tx.insert_parcel(parcel).await? {
        return Ok(Creation::Created(receipt));
    }
    // Created before: by a committed transaction, or (the enqueue waited
    // for it) by one that just committed. Nothing was written.
    let existing = tx.find_parcel(&parcel.parcel_id).await?;
    match existing {
        Some(existing) if existing == *parcel => Ok(Creation::Replayed(receipt)),
        Some(existing) => Ok(Creation::Conflict { existing }),
        // Its event exists without it: only a hand-edited table gets here.
        None => Err(AppError::Config(format!(
            "parcel {:?}: its event {} is in the outbox but the parcel is not in `parcels`",
            parcel.parcel_id, receipt.message_id
        ))),
    }
}

/// The `POST /parcels` and `GET /parcels/{id}` routes on a store.
pub struct ParcelApi<S> {
    idempotency: Idempotency<S>,
    exchange: String,
    committed: watch::Sender<()>,
}

impl<S: ParcelStore> ParcelApi<S> {
    /// The routes on `store`, enqueueing to `topology`'s exchange.
    pub fn new(store: S, topology: &Topology) -> Self {
        Self {
            idempotency: Idempotency::new(store),
            exchange: topology.exchange(),
            committed: watch::channel(()).0,
        }
    }

    /// Yields after a creation committed: a relay in the same process wakes
    /// on it ([`inbox_runtime::Relay::wake_on`]) instead of waiting for its
    /// poll, on every store (the memory store has no LISTEN/NOTIFY).
    pub fn committed(&self) -> BoxStream<'static, ()> {
        futures::stream::unfold(self.committed.subscribe(), |mut receiver| async move {
            receiver.changed().await.ok().map(|()| ((), receiver))
        })
        .boxed()
    }

    /// The routes, as a router to merge with others (the telemetry's).
    pub fn router(self) -> Router {
        Router::new()
            .route("/parcels", post(create::<S>))
            .route("/parcels/{parcel_id}", get(show::<S>))
            .layer(DefaultBodyLimit::max(MAX_BODY))
            .with_state(std::sync::Arc::new(self))
    }
}

type Shared<S> = std::sync::Arc<ParcelApi<S>>;

/// `value` as a JSON response with `status` (axum's `json` feature would
/// bring an extractor this module does not use: it parses the body itself,
/// to say 400 or 422 in its own words).
fn json(status: StatusCode, value: &impl Serialize) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

/// A JSON `{"error": reason}` with `status`.
fn refuse(status: StatusCode, outcome: &'static str, reason: impl Into<String>) -> Response {
    metrics::counter!(REQUESTS_METRIC, "outcome" => outcome).increment(1);
    json(status, &serde_json::json!({ "error": reason.into() }))
}

/// `Location: /parcels/{id}`, the id percent-encoded (it may hold any
/// printable character).
fn location(parcel_id: &str) -> HeaderValue {
    let mut path = String::from("/parcels/");
    for byte in parcel_id.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            path.push(char::from(byte));
        } else {
            path.push_str(&format!("%{byte:02X}"));
        }
    }
    HeaderValue::from_str(&path).unwrap_or_else(|_| HeaderValue::from_static("/parcels"))
}

/// The request's parcel and its body, or the status and reason refusing
/// it.
fn parse(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(ParcelCreatedEvent, Bytes), (StatusCode, String)> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return Err((
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "the body must be JSON (Content-Type: application/json)".into(),
        ));
    }
    let body = body.map_err(|rejection| (rejection.status(), rejection.body_text()))?;
    let request: CreateParcel = serde_json::from_slice(&body).map_err(|error| {
        let status = if error.is_data() {
            StatusCode::UNPROCESSABLE_ENTITY
        } else {
            StatusCode::BAD_REQUEST
        };
        (status, format!("invalid request body: {error}"))
    })?;
    let parcel = ParcelCreatedEvent {
        parcel_id: request
            .parcel_id
            .unwrap_or_else(|| uuid::Uuid::now_v7().to_string()),
        tracking_number: request.tracking_number,
        destination: request.destination,
    };
    parcel
        .validate()
        .map_err(|reason| (StatusCode::UNPROCESSABLE_ENTITY, reason))?;
    Ok((parcel, body))
}

/// The route's name, the scope of its idempotency keys.
const CREATE_ROUTE: &str = "POST /parcels";

/// What a client is answered for `creation` of `parcel`, counted and
/// logged.
fn created_response(parcel_id: &str, creation: Creation) -> Response {
    match creation {
        Creation::Created(receipt) => {
            metrics::counter!(REQUESTS_METRIC, "outcome" => "created").increment(1);
            tracing::debug!(parcel_id, message_id = %receipt.message_id, "parcel created");
            let mut response = json(StatusCode::CREATED, &receipt);
            response
                .headers_mut()
                .insert(header::LOCATION, location(parcel_id));
            response
        }
        Creation::Replayed(receipt) => {
            metrics::counter!(REQUESTS_METRIC, "outcome" => "replayed").increment(1);
            tracing::info!(parcel_id, message_id = %receipt.message_id,
                "parcel exists with these fields: answered again, nothing written");
            let mut response = json(StatusCode::OK, &receipt);
            response
                .headers_mut()
                .insert(header::LOCATION, location(parcel_id));
            response
        }
        Creation::Conflict { .. } => {
            tracing::info!(parcel_id, "parcel exists with other fields: refused");
            refuse(
                StatusCode::CONFLICT,
                "conflict",
                format!("parcel {parcel_id:?} exists with another tracking number or destination"),
            )
        }
    }
}

async fn create<S: ParcelStore>(
    State(api): State<Shared<S>>,
    key: IdempotencyKey,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (parcel, body) = match parse(&headers, body) {
        Ok(parsed) => parsed,
        Err((status, reason)) => return refuse(status, "invalid", reason),
    };
    let parcel_id = parcel.parcel_id.as_str();
    let created = std::sync::atomic::AtomicBool::new(false);
    let span = inbox_runtime::trace::request_span("POST", "/parcels", |name| {
        headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    });
    let answered = api
        .idempotency
        .respond(CREATE_ROUTE, &key, &body, async |tx| {
            let creation = create_parcel_in(tx, &api.exchange, &parcel).await?;
            if matches!(creation, Creation::Created(_)) {
                created.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(created_response(parcel_id, creation))
        })
        .instrument(span)
        .await;
    match answered {
        Ok(response) => {
            if created.load(std::sync::atomic::Ordering::Relaxed) {
                api.committed.send_replace(());
            }
            response
        }
        Err(error) => {
            let retryable = error.is_retryable();
            tracing::warn!(parcel_id, message_id = %created_message_id(parcel_id),
                retryable, error = %chain(&error), "parcel creation failed; nothing was written");
            if retryable {
                let mut response = refuse(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    format!(
                        "the store is unavailable, nothing was written: {}",
                        chain(&error)
                    ),
                );
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                response
            } else {
                refuse(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "failed",
                    format!(
                        "the store refused the parcel, nothing was written: {}",
                        chain(&error)
                    ),
                )
            }
        }
    }
}

/// The stored parcel, with its event's id.
#[derive(Serialize)]
struct Shown {
    #[serde(flatten)]
    parcel: ParcelCreatedEvent,
    message_id: String,
}

async fn show<S: ParcelStore>(
    State(api): State<Shared<S>>,
    Path(parcel_id): Path<String>,
) -> Response {
    let found = async {
        let mut tx = api.idempotency.store().begin().await?;
        let found = tx.find_parcel(&parcel_id).await;
        if let Err(error) = tx.rollback().await {
            tracing::debug!(error = %error, "rollback after a read failed");
        }
        found
    }
    .await;
    match found {
        Ok(Some(parcel)) => {
            let message_id = created_message_id(&parcel.parcel_id).to_string();
            json(StatusCode::OK, &Shown { parcel, message_id })
        }
        Ok(None) => json(
            StatusCode::NOT_FOUND,
            &serde_json::json!({ "error": format!("no parcel {parcel_id:?}") }),
        ),
        Err(error) => json(
            StatusCode::SERVICE_UNAVAILABLE,
            &serde_json::json!({ "error": chain(&error) }),
        ),
    }
}

/// An HTTP server running in this process (the `api` command's, the demo's,
/// the tests'), until [`ApiServer::stop`].
pub struct ApiServer {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl ApiServer {
    /// Binds `addr` (port 0: any free one) and serves `router` on it.
    ///
    /// # Errors
    /// [`AppError::Io`] when the address cannot be bound.
    pub async fn start(addr: SocketAddr, router: Router) -> Result<Self, AppError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| AppError::Io {
                context: format!("bind the HTTP API on {addr}"),
                source,
            })?;
        Self::serve(listener, router)
    }

    /// Serves `router` on a bound `listener`.
    ///
    /// # Errors
    /// [`AppError::Io`] when the listener's address cannot be read.
    pub fn serve(listener: TcpListener, router: Router) -> Result<Self, AppError> {
        let addr = listener.local_addr().map_err(|source| AppError::Io {
            context: "read the HTTP API's address".into(),
            source,
        })?;
        let (stop, mut stopping) = watch::channel(false);
        let task = tokio::spawn(async move {
            let served = axum::serve(listener, router)
                .with_graceful_shutdown(async move { stopped(&mut stopping).await })
                .await;
            if let Err(error) = served {
                tracing::warn!(error = %error, "the HTTP API stopped");
            }
        });
        tracing::info!(%addr, "serving the HTTP API");
        Ok(Self { addr, stop, task })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, finishes the requests in flight, and returns.
    pub async fn stop(self) {
        self.stop.send_replace(true);
        if let Err(error) = self.task.await {
            tracing::warn!(error = %error, "the HTTP API's task failed");
        }
    }
}
