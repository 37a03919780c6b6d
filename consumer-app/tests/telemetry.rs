//! What operators read: `/metrics`, `/live` and `/ready` over a real
//! listening server (the router on its own, composable, each condition
//! reported; the store check against the real PostgreSQL and a closed port;
//! the `consume` binary against the real services and an unreachable
//! broker), and the binary's `--log-format json` lines. Needs PostgreSQL
//! and RabbitMQ (`bash .ci/services.sh`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use consumer_app::parcel::events::EVENT_TYPE;
use consumer_app::parcel::store::ParcelStore;
use consumer_app::parcel::topology::Topology;
use consumer_app::tools::publish::publish;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use inbox_api::MessageId;
use inbox_backend_sqlx::SqlxStore;
use inbox_runtime::amqp::Outgoing;
use inbox_runtime::http::{self as telemetry, Health};
use inbox_runtime::telemetry::Running;
use inbox_runtime::topology::RemoveOnDrop;
use metrics_exporter_prometheus::PrometheusBuilder;
use tokio::sync::watch;

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn unique() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

/// One answer: status, content type, body.
#[derive(Debug)]
struct Answer {
    status: u16,
    content_type: String,
    body: String,
}

/// `GET path` on `addr` with hyper's client, one connection per request.
async fn get(addr: SocketAddr, path: &str) -> Result<Answer, String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(connection);
    let request = hyper::Request::get(path)
        .header(hyper::header::HOST, "localhost")
        .body(Empty::<Bytes>::new())
        .map_err(|e| format!("request: {e}"))?;
    let response = tokio::time::timeout(Duration::from_secs(10), sender.send_request(request))
        .await
        .map_err(|_| format!("GET {path}: no answer in 10 s"))?
        .map_err(|e| format!("GET {path}: {e}"))?;
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    Ok(Answer {
        status,
        content_type,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

async fn serve(router: Router) -> (SocketAddr, watch::Sender<bool>) {
    let listener = telemetry::bind("127.0.0.1:0".parse().expect("address"))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let (stop, stopped) = watch::channel(false);
    telemetry::serve(listener, router, stopped);
    (addr, stop)
}

#[tokio::test]
async fn each_endpoint_answers_and_ready_names_what_is_not() {
    // A recorder of this test's own: the global one is the process's.
    let recorder = PrometheusBuilder::new().build_recorder();
    let metrics = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        metrics::counter!("telemetry_test_total").increment(3);
    });
    let (guard, running) = Running::new();
    let (broker, broker_state) = watch::channel(false);
    let health = Health::new()
        .live_while(running)
        .ready_while("broker", broker_state, "not consuming")
        .ready_when("store", || async {
            Err::<(), _>("unreachable: refused".into())
        });
    // A service's own route beside the telemetry ones.
    let router = telemetry::router(metrics, health)
        .merge(Router::new().route("/parcels", post(|| async { "created\n" })));
    let (addr, stop) = serve(router).await;

    let answer = get(addr, "/metrics").await.expect("metrics");
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.content_type, "text/plain; version=0.0.4");
    assert!(
        answer.body.contains("telemetry_test_total 3"),
        "{}",
        answer.body
    );

    let live = get(addr, "/live").await.expect("live");
    assert_eq!((live.status, live.body.as_str()), (200, "live\n"));

    let ready = get(addr, "/ready").await.expect("ready");
    assert_eq!(ready.status, 503, "{ready:?}");
    assert_eq!(
        ready.body,
        "broker: not consuming\nstore: unreachable: refused\n"
    );

    broker.send_replace(true);
    let ready = get(addr, "/ready").await.expect("ready");
    assert_eq!(ready.status, 503, "{ready:?}");
    assert_eq!(ready.body, "store: unreachable: refused\n");

    assert_eq!(get(addr, "/nothing").await.expect("404").status, 404);
    // The merged route is there (GET is not its method).
    assert_eq!(get(addr, "/parcels").await.expect("405").status, 405);

    // The loop ended: not live, not ready.
    drop(guard);
    let live = get(addr, "/live").await.expect("live");
    assert_eq!((live.status, live.body.as_str()), (503, "stopped\n"));
    let ready = get(addr, "/ready").await.expect("ready");
    assert!(ready.body.starts_with("service: stopped\n"), "{ready:?}");

    stop.send_replace(true);
}

#[tokio::test]
async fn all_checks_passing_is_ready() {
    let metrics = PrometheusBuilder::new().build_recorder().handle();
    let (_guard, running) = Running::new();
    let (_broker, broker_state) = watch::channel(true);
    let health = Health::new()
        .live_while(running)
        .ready_while("broker", broker_state, "not consuming")
        .ready_when("store", || async { Ok(()) });
    let (addr, _stop) = serve(telemetry::router(metrics, health)).await;
    let ready = get(addr, "/ready").await.expect("ready");
    assert_eq!((ready.status, ready.body.as_str()), (200, "ready\n"));
}

#[tokio::test]
async fn the_store_check_tells_a_reachable_store_from_a_refusing_one() {
    let store = SqlxStore::connect(&database_url(), "parcel_inbox_telemetry_probe")
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    let check = telemetry::store_reachable(store);
    assert_eq!(check().await, Ok(()));

    // Port 1 is closed: a pool there never gets a connection.
    let options =
        SqlxStore::connect_options("postgres://postgres@127.0.0.1:1/test", "x").expect("options");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy_with(options);
    let check = telemetry::store_reachable(SqlxStore::new(pool, "x").expect("store"));
    let refused = check().await.expect_err("a closed port is not reachable");
    assert!(refused.starts_with("unreachable: "), "{refused}");
}

/// A spawned `parcel-inbox` whose stderr (the logs) and stdout go to files
/// (a pipe nobody reads would block it), killed when dropped.
struct Process {
    child: tokio::process::Child,
    log: PathBuf,
    out: PathBuf,
}

impl Process {
    fn spawn(args: &[String]) -> Self {
        let base = std::env::temp_dir().join(format!("parcel-inbox-telemetry-{}", unique()));
        let (log, out) = (base.with_extension("log"), base.with_extension("out"));
        let file = |path: &PathBuf| Stdio::from(std::fs::File::create(path).expect("output file"));
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(file(&out))
            .stderr(file(&log))
            .kill_on_drop(true)
            .spawn()
            .expect("start parcel-inbox");
        Self { child, log, out }
    }

    /// What it logged so far (stderr).
    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Both streams, for a failure's message.
    fn output(&self) -> String {
        let out = std::fs::read_to_string(&self.out).unwrap_or_default();
        format!("{}\n--- stdout ---\n{out}", self.logs())
    }

    /// SIGTERM, then its exit code within `limit` (killed and failed
    /// with its output otherwise).
    async fn terminate(mut self, limit: Duration) -> Option<i32> {
        let pid = self.child.id().expect("running").to_string();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill -TERM");
        assert!(sent.success(), "kill -TERM {pid}");
        match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(status) => status.expect("wait").code(),
            Err(_) => {
                let _ = self.child.kill().await;
                panic!(
                    "parcel-inbox still running {limit:?} after SIGTERM:\n{}",
                    self.output()
                );
            }
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.log);
        let _ = std::fs::remove_file(&self.out);
    }
}

/// A free port on 127.0.0.1 (bound, then released for the child).
fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
}

/// Polls `path` until its status is `status`, or fails with the answers and
/// the process's output after `limit`.
async fn wait_for(
    process: &Process,
    addr: SocketAddr,
    path: &str,
    status: u16,
    limit: Duration,
) -> Answer {
    let deadline = Instant::now() + limit;
    loop {
        let answer = match get(addr, path).await {
            Ok(answer) if answer.status == status => return answer,
            other => other,
        };
        assert!(
            Instant::now() < deadline,
            "{path} not {status} within {limit:?}: {answer:?}\n{}",
            process.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A schema and queue prefix of one test's own, migrated; [`Fixture::
/// teardown`] deletes both.
struct Fixture {
    schema: String,
    prefix: String,
    store: SqlxStore,
    /// The queues go when the test ends, passed or failed.
    _remove: RemoveOnDrop,
}

impl Fixture {
    async fn new(name: &str) -> Self {
        let id = unique();
        let schema = format!("app_test_{id}");
        let store = SqlxStore::connect(&database_url(), &schema)
            .await
            .expect("PostgreSQL reachable (bash .ci/services.sh)");
        store.migrate_all().await.expect("migrate");
        let prefix = format!("test-{name}-{id}.");
        Self {
            schema,
            _remove: Topology::new(&prefix).remove_on_drop(AMQP_URL),
            prefix,
            store,
        }
    }

    fn topology(&self) -> Topology {
        Topology::new(&self.prefix)
    }

    /// `parcel-inbox`'s global flags for this fixture and `amqp_url`.
    fn args(&self, amqp_url: &str) -> Vec<String> {
        [
            "--store",
            "sqlx",
            "--database-url",
            &database_url(),
            "--amqp-url",
            amqp_url,
            "--schema",
            &self.schema,
            "--prefix",
            &self.prefix,
        ]
        .map(str::to_owned)
        .to_vec()
    }

    async fn teardown(self) {
        self.store.drop_schema().await.expect("drop schema");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consume_binary_is_ready_only_while_it_consumes() {
    let fixture = Fixture::new("ready").await;
    // Against the real broker: live, then ready once consuming.
    let consume = |amqp_url: &str| {
        let addr = free_addr();
        let addr_text = addr.to_string();
        let mut args = fixture.args(amqp_url);
        args.extend(["consume", "--metrics-addr", &addr_text].map(str::to_owned));
        (Process::spawn(&args), addr)
    };
    let (process, addr) = consume(AMQP_URL);
    let ready = wait_for(&process, addr, "/ready", 200, Duration::from_secs(30)).await;
    assert_eq!(ready.body, "ready\n");
    let live = get(addr, "/live").await.expect("live");
    assert_eq!(live.status, 200, "{live:?}");
    let metrics = get(addr, "/metrics").await.expect("metrics");
    assert_eq!(
        (metrics.status, metrics.content_type.as_str()),
        (200, "text/plain; version=0.0.4")
    );
    assert_eq!(process.terminate(Duration::from_secs(30)).await, Some(0));

    // A broker that refuses (port 1): live, but not ready, and says why.
    let (process, addr) = consume("amqp://guest:guest@127.0.0.1:1/%2f");
    let live = wait_for(&process, addr, "/live", 200, Duration::from_secs(30)).await;
    assert_eq!(live.body, "live\n");
    // Once the first attempt has failed, the 503 carries its cause.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let ready = loop {
        let ready = get(addr, "/ready").await.expect("ready");
        if ready.body.contains("reconnecting:") || std::time::Instant::now() > deadline {
            break ready;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(ready.status, 503, "{ready:?}");
    assert!(
        ready
            .body
            .starts_with("broker: not consuming, reconnecting: ")
            && ready
                .body
                .contains("connect to amqp://guest:***@127.0.0.1:1/")
            && ready.body.to_lowercase().contains("refused")
            && !ready.body.contains("guest:guest"),
        "the broker's failure, its address redacted: {ready:?}"
    );
    assert_eq!(
        ready.body.lines().count(),
        1,
        "the store is reachable, only the broker is not: {ready:?}"
    );
    assert_eq!(process.terminate(Duration::from_secs(30)).await, Some(0));

    fixture.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_parse_line_by_line_and_carry_the_message_id() {
    let fixture = Fixture::new("json").await;
    let mut args = vec!["--log-format".to_owned(), "json".to_owned()];
    args.extend(fixture.args(AMQP_URL));
    args.extend(["consume", "--metrics-addr", "off"].map(str::to_owned));
    let process = Process::spawn(&args);
    // Bad input, dead-lettered by both consumers with a log line each.
    let message_id = MessageId::new_v7().to_string();
    let bad = Outgoing {
        message_id: Some(message_id.clone()),
        kind: Some(EVENT_TYPE.to_owned()),
        body: b"{not json".to_vec(),
    };
    publish(AMQP_URL, &fixture.topology(), &[bad], false)
        .await
        .expect("publish");
    let deadline = Instant::now() + Duration::from_secs(30);
    while process.logs().matches(&message_id).count() < 2 {
        assert!(
            Instant::now() < deadline,
            "no log line names {message_id} within 30 s:\n{}",
            process.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let logs = process.logs();
    assert_eq!(process.terminate(Duration::from_secs(30)).await, Some(0));

    let mut lines = 0;
    let mut naming = Vec::new();
    for line in logs.lines().filter(|l| !l.is_empty()) {
        let event: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}\n{logs}"));
        for field in ["timestamp", "level", "message"] {
            assert!(event.get(field).is_some(), "no {field}: {line}");
        }
        if event["message_id"] == message_id.as_str() {
            naming.push(event);
        }
        lines += 1;
    }
    assert!(lines > naming.len(), "startup lines too:\n{logs}");
    assert_eq!(naming.len(), 2, "one line per consumer:\n{logs}");
    for event in &naming {
        assert_eq!(event["reason"], "invalid_json", "{event}");
        assert!(event["consumer"].is_string(), "{event}");
    }

    fixture.teardown().await;
}
