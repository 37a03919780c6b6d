//! `/metrics` (Prometheus), `/live` and `/ready` over HTTP (axum), behind
//! the `http` feature: a service that exports its metrics another way, or
//! has no orchestrator to answer, builds without axum or the exporter.
//!
//! [`router`] is an ordinary axum [`Router`], so a service adds its own
//! routes beside these (`router(..).merge(app_routes)`) and [`serve`] serves
//! the lot. What "ready" means is the service's to say: [`Health`] collects
//! named checks (the broker's connection, a store probe), so this module
//! knows neither the broker nor the store.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use futures::future::{BoxFuture, join_all};
use inbox_api::{InboxStore, InboxTransaction};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::AppError;
use crate::error::chain;
use crate::shutdown::stopped;
use crate::telemetry::{MetricNames, Running};

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
    let handle = HANDLE.get_or_init(|| handle).clone();
    // Histogram samples pile up until an upkeep drains them; a thread of
    // its own does it whether or not anything scrapes (as the exporter's
    // own `install` would), and lives as long as the recorder: the process.
    let upkeep = handle.clone();
    std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || {
            loop {
                std::thread::sleep(UPKEEP_EVERY);
                upkeep.run_upkeep();
            }
        })
        .map_err(|source| AppError::Io {
            context: "start the metrics upkeep thread".into(),
            source,
        })?;
    Ok(handle)
}

/// How often histogram samples are drained into their buckets.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// The Prometheus text format's content type.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4";

/// How long `/ready` waits for one check: a probe of a store that hangs
/// (its pool's timeout is 30 s) must not hang the orchestrator's probe.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// One readiness condition: `Ok` when it holds, `Err(what is wrong)`.
type Check = Arc<dyn Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// What `/live` and `/ready` answer.
///
/// `/live` is 200 while [`Running::is_running`] says so (the service's or
/// relay's main loop has not ended: restart the process otherwise);
/// `/ready` is 200 when every check passes, 503 with one line per failed
/// check otherwise (take it out of the load balancer; it may come back).
#[derive(Clone, Default)]
pub struct Health {
    running: Option<Running>,
    checks: Vec<(&'static str, Check)>,
}

impl Health {
    /// No conditions: live and ready as long as the server answers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Live (and ready) only while `running` is.
    #[must_use]
    pub fn live_while(mut self, running: Running) -> Self {
        self.running = Some(running);
        self
    }

    /// Ready only while `check` passes; `name` prefixes its failure in the
    /// 503's body. Each check gets [`CHECK_TIMEOUT`].
    #[must_use]
    pub fn ready_when<F, Fut>(mut self, name: &'static str, check: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), String>> + Send + 'static,
    {
        self.checks.push((
            name,
            Arc::new(move || Box::pin(check()) as BoxFuture<'static, _>),
        ));
        self
    }

    /// Ready only while `flag` reads true (a connection state a loop
    /// publishes): `down` is the failure's text.
    #[must_use]
    pub fn ready_while(
        self,
        name: &'static str,
        flag: watch::Receiver<bool>,
        down: &'static str,
    ) -> Self {
        self.ready_when(name, move || {
            let up = *flag.borrow();
            async move { if up { Ok(()) } else { Err(down.to_owned()) } }
        })
    }

    fn is_live(&self) -> bool {
        self.running.as_ref().is_none_or(Running::is_running)
    }

    /// Every failed check as `name: why`, in registration order.
    async fn failures(&self) -> Vec<String> {
        let mut failures = Vec::new();
        if !self.is_live() {
            failures.push("service: stopped".to_owned());
        }
        let results = join_all(self.checks.iter().map(|(name, check)| async move {
            match tokio::time::timeout(CHECK_TIMEOUT, check()).await {
                Ok(Ok(())) => None,
                Ok(Err(why)) => Some(format!("{name}: {why}")),
                Err(_) => Some(format!("{name}: no answer within {CHECK_TIMEOUT:?}")),
            }
        }))
        .await;
        failures.extend(results.into_iter().flatten());
        failures
    }
}

/// A readiness check that the store answers: a transaction begun and
/// rolled back (a pool that cannot connect, a server that refuses, a
/// missing schema's connection setup all fail it).
pub fn store_reachable<S: InboxStore + Clone>(
    store: S,
) -> impl Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync + 'static {
    move || {
        let store = store.clone();
        Box::pin(async move {
            let tx = store
                .begin()
                .await
                .map_err(|e| format!("unreachable: {}", chain(&e)))?;
            if let Err(error) = tx.rollback().await {
                tracing::debug!(error = %error, "rollback after the readiness probe failed");
            }
            Ok(())
        })
    }
}

/// `/metrics`, `/live` and `/ready`, as a router a service can extend.
pub fn router(metrics: PrometheusHandle, health: Health) -> Router {
    let live = health.clone();
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let body = metrics.render();
                async move { ([(header::CONTENT_TYPE, PROMETHEUS_TEXT)], body) }
            }),
        )
        .route(
            "/live",
            get(move || {
                let live = live.is_live();
                async move {
                    if live {
                        (StatusCode::OK, "live\n")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "stopped\n")
                    }
                }
            }),
        )
        .route(
            "/ready",
            get(move || {
                let health = health.clone();
                async move {
                    let failures = health.failures().await;
                    if failures.is_empty() {
                        (StatusCode::OK, "ready\n".to_owned()).into_response()
                    } else {
                        let body = failures.join("\n") + "\n";
                        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
                    }
                }
            }),
        )
}

/// Binds the telemetry endpoint's address, before anything else starts:
/// a port in use fails the command at once.
///
/// # Errors
/// [`AppError::Io`] when the address cannot be bound.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, AppError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Io {
            context: format!("bind the telemetry endpoint on {addr}"),
            source,
        })
}

/// Serves `router` on `listener` (from [`bind`]) on a task of its own
/// until `shutdown` turns true.
pub fn serve(listener: TcpListener, router: Router, mut shutdown: watch::Receiver<bool>) {
    match listener.local_addr() {
        Ok(bound) => tracing::info!(%bound, "serving /metrics, /live and /ready"),
        Err(error) => tracing::warn!(error = %error, "serving /metrics, /live and /ready"),
    }
    tokio::spawn(async move {
        let served = axum::serve(listener, router)
            .with_graceful_shutdown(async move { stopped(&mut shutdown).await })
            .await;
        if let Err(error) = served {
            tracing::warn!(error = %error, "the telemetry server stopped");
        }
    });
}
