//! A one-request HTTP/1.1 client (hyper's, already built for axum): how the
//! demo and the tests call `POST /parcels` on a real listening server.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

use inbox_runtime::AppError;

/// The longest wait for an answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// One answer: status, the headers a caller checks, body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// `Content-Type`, empty when absent.
    pub content_type: String,
    /// `Location`, empty when absent.
    pub location: String,
    /// `Retry-After`, empty when absent.
    pub retry_after: String,
    /// Whether `Idempotent-Replayed: true` says the answer was kept from
    /// an earlier request with the same `Idempotency-Key`.
    pub replayed: bool,
    /// The body, as text.
    pub body: String,
}

impl Answer {
    /// The body parsed as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// Sends `method path` with `body` (and `content_type`, unless `None`) to
/// `addr` on a connection of its own, and reads the whole answer.
///
/// # Errors
/// [`AppError::Io`] when the connection, the exchange or the wait fails.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: impl Into<Bytes>,
) -> Result<Answer, AppError> {
    request_with(addr, method, path, content_type, &[], body).await
}

/// As [`request`], with more request `headers` (name, value).
///
/// # Errors
/// As [`request`].
pub async fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Result<Answer, AppError> {
    let io = |context: String| {
        move |error: Box<dyn std::error::Error + Send + Sync>| AppError::Io {
            context,
            source: std::io::Error::other(error),
        }
    };
    let what = format!("{method} http://{addr}{path}");
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| io(format!("{what}: connect"))(e.into()))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| io(format!("{what}: handshake"))(e.into()))?;
        tokio::spawn(connection);
        let mut builder = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, addr.to_string());
        if let Some(content_type) = content_type {
            builder = builder.header(hyper::header::CONTENT_TYPE, content_type);
        }
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let request = builder
            .body(Full::new(body.into()))
            .map_err(|e| io(format!("{what}: request"))(e.into()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| io(format!("{what}: send"))(e.into()))?;
        let header = |name: hyper::header::HeaderName| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let (content_type, location, retry_after) = (
            header(hyper::header::CONTENT_TYPE),
            header(hyper::header::LOCATION),
            header(hyper::header::RETRY_AFTER),
        );
        let replayed = header(hyper::header::HeaderName::from_static(
            inbox_runtime::idempotency::REPLAYED_HEADER,
        )) == "true";
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| io(format!("{what}: body"))(e.into()))?
            .to_bytes();
        Ok(Answer {
            status,
            content_type,
            location,
            retry_after,
            replayed,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    };
    tokio::time::timeout(ANSWER_TIMEOUT, exchange)
        .await
        .map_err(|_| AppError::Io {
            context: what.clone(),
            source: std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {ANSWER_TIMEOUT:?}"),
            ),
        })?
}

/// `POST path` with a JSON `body`.
///
/// # Errors
/// As [`request`].
pub async fn post_json(
    addr: SocketAddr,
    path: &str,
    body: &serde_json::Value,
) -> Result<Answer, AppError> {
    request(
        addr,
        "POST",
        path,
        Some("application/json"),
        body.to_string(),
    )
    .await
}
