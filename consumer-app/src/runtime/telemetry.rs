//! Logs and metrics: the tracing subscriber, and a Prometheus `/metrics`
//! endpoint.
//!
//! The endpoint is a few lines of tokio instead of the exporter's hyper
//! listener: one GET, one text answer, and a smaller build. The metric names
//! are those of [`inbox_api::metrics`] (processed, duplicates discarded,
//! failed, handle latency, purged rows, dead-lettered, inbox rows) plus the
//! runtime's two of its own, whose names a service picks ([`MetricNames`]):
//! an existing dashboard keeps its names when the runtime moves under it.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::runtime::AppError;

/// The names of the runtime's own counters (both labelled `consumer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetricNames {
    /// Deliveries requeued after their in-process retries failed.
    pub requeued: &'static str,
    /// After-commit calls that failed (the commit stands).
    pub after_commit_failed: &'static str,
    /// The help text of `after_commit_failed`, naming the service's calls.
    pub after_commit_failed_help: &'static str,
}

impl Default for MetricNames {
    fn default() -> Self {
        Self {
            requeued: "inbox_consumer_requeued_total",
            after_commit_failed: "inbox_consumer_after_commit_failed_total",
            after_commit_failed_help: "Downstream calls that failed after commit",
        }
    }
}

/// Installs a `tracing` subscriber reading `RUST_LOG` (default `info`),
/// writing to stderr, once; later calls do nothing.
///
/// Colours only when stderr is a terminal: in a file, a pipe or a log
/// collector the escape codes are noise that breaks grep and parsers.
pub fn init_logging() {
    use std::io::IsTerminal as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder as the process's `metrics` recorder,
/// once, describing the runtime's counters under `names`, and returns its
/// handle.
///
/// # Errors
/// [`AppError::Config`] when another recorder was installed first.
pub fn install_recorder(names: MetricNames) -> Result<PrometheusHandle, AppError> {
    if let Some(handle) = HANDLE.get() {
        return Ok(handle.clone());
    }
    let handle = PrometheusBuilder::new()
        .set_buckets(&[
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ])
        .map_err(|e| AppError::Config(format!("histogram buckets: {e}")))?
        .install_recorder()
        .map_err(|e| AppError::Config(format!("cannot install the metrics recorder: {e}")))?;
    inbox_api::metrics::describe();
    metrics::describe_counter!(
        names.requeued,
        "Deliveries requeued after their in-process retries failed"
    );
    metrics::describe_counter!(names.after_commit_failed, names.after_commit_failed_help);
    Ok(HANDLE.get_or_init(|| handle).clone())
}

/// Serves `GET /metrics` on `addr` until `shutdown` turns true; returns the
/// bound address (useful with port 0).
///
/// # Errors
/// [`AppError::Io`] when the address cannot be bound.
pub async fn serve_metrics(
    addr: SocketAddr,
    handle: PrometheusHandle,
    mut shutdown: watch::Receiver<bool>,
) -> Result<SocketAddr, AppError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Io {
            context: format!("bind the metrics endpoint on {addr}"),
            source,
        })?;
    let bound = listener.local_addr().map_err(|source| AppError::Io {
        context: "read the metrics endpoint's address".into(),
        source,
    })?;
    tracing::info!(%bound, "serving Prometheus metrics on /metrics");
    tokio::spawn(async move {
        let mut upkeep = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|stop| *stop) => return,
                _ = upkeep.tick() => handle.run_upkeep(),
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let handle = handle.clone();
                        tokio::spawn(async move {
                            if let Err(error) = answer(stream, &handle).await {
                                tracing::debug!(error = %error, "metrics request failed");
                            }
                        });
                    }
                    Err(error) => tracing::warn!(error = %error, "metrics accept failed"),
                },
            }
        }
    });
    Ok(bound)
}

async fn answer(
    mut stream: tokio::net::TcpStream,
    handle: &PrometheusHandle,
) -> std::io::Result<()> {
    let mut request = vec![0_u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut request))
        .await
        .map_err(|_| std::io::Error::other("request timed out"))??;
    let request = String::from_utf8_lossy(&request[..read]);
    let path = request.split_whitespace().nth(1).unwrap_or("");
    let (status, content_type, body) = if request.starts_with("GET ") && path == "/metrics" {
        ("200 OK", "text/plain; version=0.0.4", handle.render())
    } else {
        (
            "404 Not Found",
            "text/plain",
            "try GET /metrics\n".to_owned(),
        )
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}
