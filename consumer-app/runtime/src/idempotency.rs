//! Idempotent HTTP endpoints on the inbox: a request that carries an
//! `Idempotency-Key` header does its work once, and every retry with the
//! same key is answered with the first response.
//!
//! The key is claimed like a message: `(MessageId::from_key(key), route)`
//! in the transaction of the endpoint's own writes (and its outbox rows),
//! with the request body's fingerprint; the response is kept with the
//! claim ([`inbox_api::ResponseTransaction`]) and commits with the work or
//! not at all. So a key is never "taken" by a request whose work rolled
//! back, and it expires with the inbox's retention (the cleanup deletes
//! the row and its response). What a client gets:
//!
//! - the first request: the endpoint's response, kept;
//! - a retry with the same key and the same body: the kept response, with
//!   `Idempotent-Replayed: true`; no work runs;
//! - the same key with another body: **422**, nothing runs;
//! - a retry while the first request is still running in this process:
//!   **409** with `Retry-After: 1`; in another process the retry's claim
//!   waits for the first request's transaction and then replays its
//!   response (two requests never both do the work);
//! - a key that is not 1–255 visible ASCII characters: **400**.
//!
//! Without the header the work runs in a plain transaction, as before.
//!
//! ```
//! use axum::body::Bytes;
//! use axum::extract::State;
//! use axum::http::StatusCode;
//! use axum::response::{IntoResponse, Response};
//! use inbox_runtime::idempotency::{Idempotency, IdempotencyKey};
//! use inbox_runtime::inbox_api::{ResponseStore, ResponseTransaction};
//!
//! async fn create<S: ResponseStore<Transaction: ResponseTransaction>>(
//!     State(idempotency): State<Idempotency<S>>,
//!     key: IdempotencyKey,
//!     body: Bytes,
//! ) -> Response {
//!     let answered = idempotency
//!         .respond("POST /orders", &key, &body, async |tx| {
//!             // the order's INSERT and its outbox row go through `tx`
//!             let _ = tx;
//!             Ok((StatusCode::CREATED, "created").into_response())
//!         })
//!         .await;
//!     answered.unwrap_or_else(|error| {
//!         (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response()
//!     })
//! }
//!
//! fn routes<S>(store: S) -> axum::Router
//! where
//!     S: ResponseStore<Transaction: ResponseTransaction>,
//! {
//!     axum::Router::new()
//!         .route("/orders", axum::routing::post(create::<S>))
//!         .with_state(Idempotency::new(store))
//! }
//! ```

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use inbox_api::{
    AsyncWork, ConsumerName, Fingerprint, Handled, Inbox, InboxKey, InboxTransaction, MessageId,
    ResponseStore, ResponseTransaction,
};
use serde::{Deserialize, Serialize};

use crate::AppError;

/// The request header that names a request's idempotency key.
pub const KEY_HEADER: &str = "idempotency-key";

/// The response header set on a replayed response.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The longest key taken, in bytes (Stripe's limit).
pub const MAX_KEY_LEN: usize = 255;

/// The largest response body kept, in bytes: a kept response is a row's
/// column, and an endpoint that answers more than this should answer a
/// reference to it.
pub const MAX_KEPT_BODY: usize = 1024 * 1024;

/// The counter of requests with an idempotency key, labelled `route` and
/// `outcome` (`processed`, `replayed`, `conflict`, `in_flight`, `failed`).
pub const REQUESTS_METRIC: &str = "http_idempotent_requests_total";

/// A request's `Idempotency-Key`, as an axum extractor: empty when the
/// request has none; a key that is not 1–[`MAX_KEY_LEN`] visible ASCII
/// characters is refused with 400 before the handler runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IdempotencyKey(Option<String>);

impl IdempotencyKey {
    /// The key, if the request carried one.
    #[must_use]
    pub fn get(&self) -> Option<&str> {
        self.0.as_deref()
    }

    /// Reads the header's value: `None` when absent.
    ///
    /// # Errors
    /// The reason a present value is unusable.
    pub fn from_header(value: Option<&HeaderValue>) -> Result<Self, String> {
        let Some(value) = value else {
            return Ok(Self(None));
        };
        match value.to_str() {
            Ok(text)
                if !text.is_empty()
                    && text.len() <= MAX_KEY_LEN
                    && text.bytes().all(|b| b.is_ascii_graphic()) =>
            {
                Ok(Self(Some(text.to_owned())))
            }
            _ => Err(format!(
                "the Idempotency-Key header must be 1 to {MAX_KEY_LEN} visible ASCII characters"
            )),
        }
    }
}

impl<St: Send + Sync> FromRequestParts<St> for IdempotencyKey {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &St) -> Result<Self, Response> {
        Self::from_header(parts.headers.get(KEY_HEADER))
            .map_err(|reason| error(StatusCode::BAD_REQUEST, &reason))
    }
}

/// A response as kept with its claim: status, headers and body.
#[derive(Debug, Serialize, Deserialize)]
struct Head {
    status: u16,
    headers: Vec<(String, String)>,
}

/// Headers a kept response does not repeat: they describe one
/// transmission, not the answer.
const PER_TRANSMISSION: [HeaderName; 4] = [
    header::CONTENT_LENGTH,
    header::DATE,
    header::TRANSFER_ENCODING,
    header::CONNECTION,
];

/// A response whose body has been read, so that it can be kept and sent.
struct Kept {
    head: Head,
    body: Bytes,
}

impl Kept {
    async fn read(response: Response) -> Result<Self, AppError> {
        let (parts, body) = response.into_parts();
        let body = axum::body::to_bytes(body, MAX_KEPT_BODY)
            .await
            .map_err(|e| {
                AppError::Config(format!(
                    "an idempotent response's body cannot be kept (over {MAX_KEPT_BODY} bytes, or unreadable): {e}"
                ))
            })?;
        let headers = parts
            .headers
            .iter()
            .filter(|(name, _)| !PER_TRANSMISSION.contains(name))
            .filter_map(|(name, value)| {
                value
                    .to_str()
                    .ok()
                    .map(|v| (name.as_str().to_owned(), v.to_owned()))
            })
            .collect();
        Ok(Self {
            head: Head {
                status: parts.status.as_u16(),
                headers,
            },
            body,
        })
    }

    /// The head as one line of JSON, a newline, then the body's bytes.
    fn encode(&self) -> Result<Vec<u8>, AppError> {
        let mut bytes = serde_json::to_vec(&self.head)
            .map_err(|e| AppError::Config(format!("encode a kept response: {e}")))?;
        bytes.push(b'\n');
        bytes.extend_from_slice(&self.body);
        Ok(bytes)
    }

    fn decode(bytes: &[u8]) -> Result<Self, AppError> {
        let split = bytes
            .iter()
            .position(|b| *b == b'\n')
            .unwrap_or(bytes.len());
        let head = serde_json::from_slice(&bytes[..split])
            .map_err(|e| AppError::Config(format!("a kept response cannot be read: {e}")))?;
        let body = Bytes::copy_from_slice(bytes.get(split + 1..).unwrap_or_default());
        Ok(Self { head, body })
    }

    fn into_response(self, replayed: bool) -> Response {
        let mut response = Response::new(Body::from(self.body));
        *response.status_mut() =
            StatusCode::from_u16(self.head.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        for (name, value) in self.head.headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(&value),
            ) {
                response.headers_mut().append(name, value);
            }
        }
        if replayed {
            response.headers_mut().insert(
                HeaderName::from_static(REPLAYED_HEADER),
                HeaderValue::from_static("true"),
            );
        }
        response
    }
}

/// A JSON `{"error": reason}` with `status`.
fn error(status: StatusCode, reason: &str) -> Response {
    let body = serde_json::json!({ "error": reason }).to_string();
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}

/// The keys being worked on in this process.
type InFlight = Arc<Mutex<HashSet<InboxKey>>>;

/// Takes `key` out of the in-flight set when the request ends, however.
struct Running {
    set: InFlight,
    key: InboxKey,
}

impl Running {
    /// `None` when a request with `key` is already running here.
    fn start(set: &InFlight, key: &InboxKey) -> Option<Self> {
        let mut keys = set
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        keys.insert(key.clone()).then(|| Self {
            set: Arc::clone(set),
            key: key.clone(),
        })
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.key);
    }
}

/// Idempotent requests on a store: an axum state to share between
/// handlers (clones share the store and the in-flight keys).
pub struct Idempotency<S> {
    inbox: Arc<Inbox<S>>,
    in_flight: InFlight,
}

impl<S> Clone for Idempotency<S> {
    fn clone(&self) -> Self {
        Self {
            inbox: Arc::clone(&self.inbox),
            in_flight: Arc::clone(&self.in_flight),
        }
    }
}

impl<S> Idempotency<S>
where
    S: ResponseStore<Transaction: ResponseTransaction>,
{
    /// Idempotent requests on `store`.
    pub fn new(store: S) -> Self {
        Self {
            inbox: Arc::new(Inbox::new(store)),
            in_flight: InFlight::default(),
        }
    }

    /// The store underneath.
    pub fn store(&self) -> &S {
        self.inbox.store()
    }

    /// Answers a request to `route` (a name for the endpoint, such as
    /// `POST /orders`: the key's scope) whose body is `body`: with the
    /// work's response, run in one transaction with the claim of `key` and
    /// kept with it; or, for a key seen before, as the module docs say.
    /// Without a key, the work runs in a plain transaction.
    ///
    /// The work's `Ok` response commits, whatever its status (a refusal
    /// the work decided is the answer to every retry too); its `Err` rolls
    /// back, keeps nothing, and is returned for the caller to answer (a
    /// retry then runs the work again).
    ///
    /// # Errors
    /// The work's error, or the store's; [`AppError::is_retryable`] says
    /// whether a retry may succeed.
    pub async fn respond<F>(
        &self,
        route: &str,
        key: &IdempotencyKey,
        body: &[u8],
        work: F,
    ) -> Result<Response, AppError>
    where
        for<'t> F: AsyncFnOnce(&'t mut S::Transaction) -> Result<Response, AppError>
            + AsyncWork<&'t mut S::Transaction, Result<Response, AppError>, Fut: Send>
            + Send,
    {
        let Some(raw) = key.get() else {
            let mut tx = self.store().begin().await?;
            return match work(&mut tx).await {
                Ok(response) => {
                    tx.commit().await?;
                    Ok(response)
                }
                Err(error) => {
                    if let Err(rollback) = tx.rollback().await {
                        tracing::debug!(error = %rollback, "rollback after failed work failed");
                    }
                    Err(error)
                }
            };
        };
        let key = InboxKey::new(MessageId::from_key(raw)?, ConsumerName::new(route)?)
            .with_fingerprint(Fingerprint::of(body));
        let count = |outcome: &'static str| {
            metrics::counter!(REQUESTS_METRIC, "route" => route.to_owned(), "outcome" => outcome)
                .increment(1);
        };
        let Some(_running) = Running::start(&self.in_flight, &key) else {
            count("in_flight");
            tracing::info!(message_id = %key.message_id, route,
                "a request with this Idempotency-Key is still running: 409");
            let mut response = error(
                StatusCode::CONFLICT,
                "a request with this Idempotency-Key is still being processed; retry later",
            );
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return Ok(response);
        };
        let claim = key.clone();
        let handled = self
            .inbox
            .handle(&key, async move |tx| {
                let kept = Kept::read(work(&mut *tx).await?).await?;
                tx.keep_response(&claim, &kept.encode()?).await?;
                Ok::<_, AppError>(kept)
            })
            .await;
        match handled {
            Ok(Handled::Processed(kept)) => {
                count("processed");
                Ok(kept.into_response(false))
            }
            Ok(Handled::Duplicate) => match self.store().kept_response(&key).await? {
                Some(bytes) => {
                    count("replayed");
                    tracing::info!(message_id = %key.message_id, route,
                        "a retried request: the kept response answered, nothing ran");
                    Ok(Kept::decode(&bytes)?.into_response(true))
                }
                None => {
                    count("conflict");
                    Ok(error(
                        StatusCode::CONFLICT,
                        "this Idempotency-Key was used by a request whose response was not kept",
                    ))
                }
            },
            Ok(Handled::Conflict { stored, received }) => {
                count("conflict");
                tracing::warn!(message_id = %key.message_id, route, %stored, %received,
                    "an Idempotency-Key reused with another request body: 422");
                Ok(error(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "this Idempotency-Key was used with another request body",
                ))
            }
            Err(error) => {
                count("failed");
                Err(error)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_response_reads_back_as_it_was() {
        let kept = Kept {
            head: Head {
                status: 201,
                headers: vec![
                    ("content-type".into(), "application/json".into()),
                    ("location".into(), "/parcels/P-1".into()),
                ],
            },
            body: Bytes::from_static(b"{\"a\":\n1}"),
        };
        let bytes = kept.encode().expect("encode");
        let back = Kept::decode(&bytes).expect("decode");
        assert_eq!(back.head.status, 201);
        assert_eq!(back.head.headers, kept.head.headers);
        assert_eq!(back.body, kept.body);
        let response = back.into_response(true);
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers()[REPLAYED_HEADER], "true");
        assert_eq!(response.headers()[header::LOCATION], "/parcels/P-1");
    }

    #[test]
    fn a_key_must_be_visible_ascii_of_bounded_length() {
        let key = |text: &str| {
            IdempotencyKey::from_header(Some(&HeaderValue::from_str(text).expect("header")))
        };
        assert_eq!(key("order-42").expect("valid").get(), Some("order-42"));
        assert!(key("").is_err());
        assert!(key("with space").is_err());
        assert!(key(&"k".repeat(MAX_KEY_LEN + 1)).is_err());
        assert!(key(&"k".repeat(MAX_KEY_LEN)).is_ok());
        assert_eq!(
            IdempotencyKey::from_header(None).expect("absent").get(),
            None
        );
    }
}
