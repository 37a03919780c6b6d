//! A PostgreSQL cluster, a RabbitMQ node and a NATS server of a test's own, for the faults
//! that stop a server: `initdb`/`pg_ctl` into a temporary directory on a
//! free port, and a RabbitMQ node with its own name, ports and files. The
//! shared servers (127.0.0.1:5432, 127.0.0.1:5672) that other tests use are
//! never touched; each guard stops its server and removes its directory on
//! drop, also when the caller panics. Either can also be started TLS-only
//! (`start_tls`), with the certificates of a [`pki::Pki`] the test makes.
//!
//! Used by consumer-app's outage tests and by parcel-lab's chaos harness
//! (`parcel-chaos --private-postgres`, `--private-rabbitmq`); a crate of its own
//! because parcel-lab depends on consumer-app, so neither can hold it for
//! both. Test support: a missing binary or a server that does not come up
//! panics with the command's output, nothing is skipped.
#![deny(missing_docs)]

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use lapin::{Connection, ConnectionProperties};

pub mod pki;

fn id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

/// Runs `program args` to its end and fails the test, with its output,
/// unless it succeeds.
///
/// # Panics
/// When the program cannot run or fails.
pub fn run(program: &str, args: &[&str]) -> Output {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        output.status.success(),
        "{program} {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// A TCP port nobody listens on right now.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("its address").port()
}

fn is_root() -> bool {
    let output = run("id", &["-u"]);
    String::from_utf8_lossy(&output.stdout).trim() == "0"
}

/// Waits until `127.0.0.1:port` accepts connections, or panics.
pub async fn listening(port: u16, what: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "{what} not listening on {port} after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ------------------------------------------------------- private PostgreSQL

/// A PostgreSQL cluster of the test's own: `initdb` into a temporary
/// directory, started on a free port, stopped and removed on drop (also when
/// the test panics). Run as user `postgres` when the tests run as root
/// (PostgreSQL refuses to run as root).
pub struct PrivatePostgres {
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
    listen: &'static str,
}

/// The roles of a TLS cluster ([`PrivatePostgres::start_tls`]) besides
/// `postgres`: one that logs in with its client certificate, one with this
/// password.
pub const TLS_CERT_USER: &str = "certuser";
/// See [`TLS_CERT_USER`].
pub const TLS_PASSWORD_USER: &str = "pwuser";
/// The password of [`TLS_PASSWORD_USER`].
pub const TLS_PASSWORD: &str = "right-password";

impl PrivatePostgres {
    /// Creates the cluster and starts it.
    #[must_use]
    pub fn start() -> Self {
        let cluster = Self::create("127.0.0.1");
        cluster.resume();
        cluster
    }

    /// A cluster that takes TLS connections only, with `pki`'s server
    /// certificate, on 127.0.0.1 and 127.0.0.2 (which the certificate does
    /// not name). `pg_hba.conf` has `hostssl` lines only: `postgres`
    /// trusted, [`TLS_CERT_USER`] by client certificate (`cert`), and
    /// [`TLS_PASSWORD_USER`] by password (SCRAM); a plain connection
    /// matches no line.
    #[must_use]
    pub fn start_tls(pki: &pki::Pki) -> Self {
        let cluster = Self::create("127.0.0.1,127.0.0.2");
        pki.install_server_files(&cluster.dir);
        pki::restrict(&cluster.dir.join("server.key"));
        if cluster.as_postgres {
            for file in ["ca.pem", "server.pem", "server.key"] {
                run(
                    "chown",
                    &[
                        "postgres:postgres",
                        &cluster.dir.join(file).display().to_string(),
                    ],
                );
            }
        }
        let append = |file: &str, text: &str| {
            use std::io::Write as _;
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(cluster.dir.join(file))
                .expect("open a cluster file");
            f.write_all(text.as_bytes()).expect("write a cluster file");
        };
        append(
            "postgresql.conf",
            "ssl = on\nssl_cert_file = 'server.pem'\nssl_key_file = 'server.key'\n\
             ssl_ca_file = 'ca.pem'\n",
        );
        std::fs::write(
            cluster.dir.join("pg_hba.conf"),
            format!(
                "local all all trust\n\
                 hostssl all postgres 127.0.0.0/8 trust\n\
                 hostssl all {TLS_CERT_USER} 127.0.0.0/8 cert\n\
                 hostssl all {TLS_PASSWORD_USER} 127.0.0.0/8 scram-sha-256\n"
            ),
        )
        .expect("pg_hba.conf");
        cluster.resume();
        let _ = cluster.psql(&format!(
            "CREATE ROLE {TLS_CERT_USER} LOGIN SUPERUSER; \
                     CREATE ROLE {TLS_PASSWORD_USER} LOGIN SUPERUSER PASSWORD '{TLS_PASSWORD}'"
        ));
        cluster
    }

    fn create(listen: &'static str) -> Self {
        let dir = std::env::temp_dir().join(format!("inbox-private-pg-{}", id()));
        let cluster = Self {
            dir,
            port: free_port(),
            as_postgres: is_root(),
            listen,
        };
        let data = cluster.data();
        cluster.pg(
            "initdb",
            &["-D", &data, "-A", "trust", "-U", "postgres", "--no-sync"],
        );
        cluster
    }

    /// Its port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Runs `sql` as `postgres` over the cluster's Unix socket (no TLS, no
    /// `pg_hba` host line) and returns psql's unaligned, tuples-only output.
    ///
    /// # Panics
    /// When psql fails.
    #[must_use]
    pub fn psql(&self, sql: &str) -> String {
        let port = self.port.to_string();
        let out = self.pg(
            "psql",
            &[
                "-h",
                &self.data(),
                "-p",
                &port,
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-Atqc",
                sql,
            ],
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    fn data(&self) -> String {
        self.dir.display().to_string()
    }

    /// Runs a PostgreSQL binary (`PG_BIN` or the PATH) as the cluster's user.
    fn pg(&self, binary: &str, args: &[&str]) -> Output {
        let binary = match std::env::var("PG_BIN") {
            Ok(dir) => format!("{dir}/{binary}"),
            Err(_) => binary.to_owned(),
        };
        if self.as_postgres {
            let mut all = vec!["-u", "postgres", "--", binary.as_str()];
            all.extend_from_slice(args);
            run("runuser", &all)
        } else {
            run(&binary, args)
        }
    }

    /// The URL of its `postgres` database, as user `postgres`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Starts the server (again) and waits until it accepts connections.
    pub fn resume(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses={} -c fsync=off",
            self.port,
            self.data(),
            self.listen
        );
        let log = format!("{}/server.log", self.data());
        self.pg(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-o",
                &options,
                "-l",
                &log,
                "-w",
                "start",
            ],
        );
    }

    /// Stops the server as an operator's restart would (`-m fast`: open
    /// sessions are terminated, 57P01).
    pub fn halt(&self) {
        self.pg("pg_ctl", &["-D", &self.data(), "-m", "fast", "-w", "stop"]);
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        // Best effort, never a second panic: stopped already is fine.
        let mut args = vec!["-D".to_owned(), self.data()];
        args.extend(["-m", "immediate", "stop"].map(str::to_owned));
        let mut command = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", "pg_ctl"]);
            c
        } else {
            Command::new("pg_ctl")
        };
        let _ = command.args(&args).output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// --------------------------------------------------------- private RabbitMQ

/// A RabbitMQ node of the test's own (its name, ports, data, logs and
/// config in a temporary directory), so that `rabbitmqctl stop_app`
/// disturbs no other test; halted and removed on drop. The shared node's
/// config file names port 5672, hence a config file of its own.
pub struct PrivateRabbit {
    dir: PathBuf,
    node: String,
    port: u16,
    /// The TLS listener of a node started with
    /// [`PrivateRabbit::start_tls_beside_plain`].
    tls_port: Option<u16>,
}

impl PrivateRabbit {
    /// Starts the node and waits until it takes AMQP connections.
    pub async fn start() -> Self {
        let rabbit = Self::create();
        let config = format!("listeners.tcp.local = 127.0.0.1:{}\n", rabbit.port);
        rabbit.boot(&config, "[]");
        rabbit.up().await;
        rabbit
    }

    /// Starts a node that speaks TLS only (`amqps://`), with `pki`'s
    /// server certificate, on 127.0.0.1 and 127.0.0.2 (which the
    /// certificate does not name: a client that checks host names must
    /// refuse it there). Client certificates signed by `pki`'s CA are
    /// asked for but not required; with `auth_mechanism=external` the
    /// certificate's common name is the login.
    pub async fn start_tls(pki: &pki::Pki) -> Self {
        let rabbit = Self::create();
        let port = rabbit.port;
        let config = rabbit.tls_config(
            pki,
            &format!(
                "listeners.tcp = none\n\
                 listeners.ssl.1 = 127.0.0.1:{port}\n\
                 listeners.ssl.2 = 127.0.0.2:{port}\n"
            ),
        );
        rabbit.boot(&config, "[rabbitmq_auth_mechanism_ssl]");
        listening(port, "the private RabbitMQ (TLS)", Duration::from_secs(120)).await;
        rabbit.ctl_args(&["await_startup", "--timeout", "120"]);
        rabbit
    }

    /// Starts a node with a plain listener ([`Self::port`], [`Self::url`])
    /// and a TLS listener beside it ([`Self::tls_port`]), both on
    /// 127.0.0.1, with `pki`'s server certificate as in
    /// [`Self::start_tls`]: one node, so that a comparison of the two
    /// differs by TLS alone.
    pub async fn start_tls_beside_plain(pki: &pki::Pki) -> Self {
        let mut rabbit = Self::create();
        let (port, tls_port) = (rabbit.port, free_port());
        rabbit.tls_port = Some(tls_port);
        let config = rabbit.tls_config(
            pki,
            &format!(
                "listeners.tcp.local = 127.0.0.1:{port}\n\
                 listeners.ssl.1 = 127.0.0.1:{tls_port}\n"
            ),
        );
        rabbit.boot(&config, "[rabbitmq_auth_mechanism_ssl]");
        rabbit.up().await;
        listening(
            tls_port,
            "the private RabbitMQ (TLS)",
            Duration::from_secs(120),
        )
        .await;
        rabbit
    }

    /// The TLS listener of a node started with
    /// [`Self::start_tls_beside_plain`]; `None` for any other.
    #[must_use]
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// `listeners` and the TLS options every TLS node shares: `pki`'s
    /// files, installed into the node's directory; client certificates
    /// asked for, not required; EXTERNAL login by common name.
    fn tls_config(&self, pki: &pki::Pki, listeners: &str) -> String {
        pki.install_server_files(&self.dir);
        let file = |name: &str| self.dir.join(name).display().to_string();
        format!(
            "{listeners}\
             ssl_options.cacertfile = {}\n\
             ssl_options.certfile = {}\n\
             ssl_options.keyfile = {}\n\
             ssl_options.verify = verify_peer\n\
             ssl_options.fail_if_no_peer_cert = false\n\
             ssl_cert_login_from = common_name\n\
             auth_mechanisms.1 = PLAIN\n\
             auth_mechanisms.2 = AMQPLAIN\n\
             auth_mechanisms.3 = EXTERNAL\n",
            file("ca.pem"),
            file("server.pem"),
            file("server.key"),
        )
    }

    fn create() -> Self {
        let id = id();
        let dir = std::env::temp_dir().join(format!("inbox-private-rmq-{id}"));
        std::fs::create_dir_all(&dir).expect("node directory");
        Self {
            node: format!("inbox-test-{id}@localhost"),
            port: free_port(),
            tls_port: None,
            dir,
        }
    }

    /// Writes `config` and the `plugins` list and starts the node detached.
    fn boot(&self, config: &str, plugins: &str) {
        let rabbit = self;
        let file = |name: &str| rabbit.dir.join(name).display().to_string();
        std::fs::write(file("rabbitmq.conf"), config).expect("config file");
        std::fs::write(file("enabled_plugins"), format!("{plugins}.\n")).expect("plugins file");
        if is_root() {
            // The server drops to the rabbitmq user, which must own its files.
            run(
                "chown",
                &["-R", "rabbitmq:rabbitmq", &rabbit.dir.display().to_string()],
            );
        }
        let mut command = Command::new("rabbitmq-server");
        if !config.contains("listeners.tcp = none") {
            // A TLS-only node must not get a plain listener from the
            // environment on the port its TLS listener takes.
            command.env("RABBITMQ_NODE_PORT", rabbit.port.to_string());
        }
        let status = command
            .arg("-detached")
            .env("RABBITMQ_NODENAME", &rabbit.node)
            .env("RABBITMQ_DIST_PORT", free_port().to_string())
            .env("RABBITMQ_CONFIG_FILE", file("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", file("enabled_plugins"))
            .env("RABBITMQ_MNESIA_BASE", file("mnesia"))
            .env("RABBITMQ_LOG_BASE", file("log"))
            .env("RABBITMQ_PID_FILE", file("pid"))
            .env("ERL_CRASH_DUMP", file("erl_crash.dump"))
            .stdin(Stdio::null())
            .status()
            .expect("run rabbitmq-server");
        assert!(status.success(), "rabbitmq-server -detached: {status}");
    }

    /// Its port (plain or TLS, as it was started).
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its AMQP URL (user guest, vhost /).
    #[must_use]
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// Waits until the node takes AMQP connections (a booting node listens
    /// a moment before it answers).
    pub async fn up(&self) {
        listening(self.port, "the private RabbitMQ", Duration::from_secs(120)).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        let url = self.url();
        let probe = || {
            Connection::connect(
                &url,
                ConnectionProperties::default()
                    .with_connection_name("private-servers probe".into()),
            )
        };
        while let Err(error) = probe().await {
            assert!(Instant::now() < deadline, "private RabbitMQ: {error}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Its node name, for `rabbitmqctl -n`.
    #[must_use]
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Runs `rabbitmqctl -n <node> command` (`stop_app`, `start_app`).
    pub fn ctl(&self, command: &str) {
        self.ctl_args(&[command]);
    }

    /// Runs `rabbitmqctl -n <node> args…` and returns its output.
    pub fn ctl_args(&self, args: &[&str]) -> Output {
        let mut all = vec!["-n", self.node.as_str()];
        all.extend_from_slice(args);
        run("rabbitmqctl", &all)
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["-n", &self.node, "stop"])
            .output();
        // A node that did not stop when asked is killed by its pid.
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid")) {
            let _ = Command::new("kill").args(["-9", pid.trim()]).output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ------------------------------------------------------------ private NATS

/// A NATS server with JetStream of the test's own (`nats-server`), its
/// store in a temporary directory, on a free port: stopped
/// ([`PrivateNats::stop`]) and started again ([`PrivateNats::resume`]) on
/// the same port and store, killed and removed on drop.
pub struct PrivateNats {
    dir: PathBuf,
    port: u16,
    login: Option<(String, String)>,
    /// TLS only, with these server files and client certificates verified.
    tls: Option<pki::Pki>,
    server: Option<std::process::Child>,
}

impl PrivateNats {
    /// Starts a server that takes anyone.
    pub async fn start() -> Self {
        Self::start_with(None, None).await
    }

    /// Starts a server that takes only `user` with `password`.
    pub async fn start_with_login(user: &str, password: &str) -> Self {
        Self::start_with(Some((user.to_owned(), password.to_owned())), None).await
    }

    /// Starts a server that takes TLS connections only, with `pki`'s
    /// server certificate, and only clients with a certificate of `pki`'s
    /// CA.
    pub async fn start_tls(pki: &pki::Pki) -> Self {
        Self::start_with(None, Some(pki.clone())).await
    }

    async fn start_with(login: Option<(String, String)>, tls: Option<pki::Pki>) -> Self {
        let dir = std::env::temp_dir().join(format!("private-nats-{}", id()));
        std::fs::create_dir_all(&dir).expect("the server's directory");
        let mut server = Self {
            dir,
            port: free_port(),
            login,
            tls,
            server: None,
        };
        server.resume().await;
        server
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `nats://127.0.0.1:<port>` (no credentials; `tls://` for a TLS
    /// server, without its files).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "tls" } else { "nats" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again), and waits until it listens.
    pub async fn resume(&mut self) {
        let port = self.port.to_string();
        let store = self.dir.join("jetstream");
        let store = store.to_string_lossy();
        let log = self.dir.join("server.log");
        let log = log.to_string_lossy();
        let mut args = vec![
            "-a",
            "127.0.0.1",
            "-p",
            &port,
            "-js",
            "-sd",
            &store,
            "-l",
            &log,
        ];
        if let Some((user, password)) = &self.login {
            args.extend(["--user", user.as_str(), "--pass", password.as_str()]);
        }
        let tls_files = self.tls.as_ref().map(|pki| {
            [&pki.server_cert, &pki.server_key, &pki.ca].map(|p| p.to_string_lossy().into_owned())
        });
        if let Some([cert, key, ca]) = &tls_files {
            args.extend([
                "--tls",
                "--tlscert",
                cert.as_str(),
                "--tlskey",
                key.as_str(),
                "--tlscacert",
                ca.as_str(),
                "--tlsverify",
            ]);
        }
        let child = Command::new("nats-server")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run nats-server: {e}"));
        self.server = Some(child);
        listening(self.port, "nats-server", Duration::from_secs(10)).await;
    }

    /// Kills the server (as a crash would), keeping its store.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.server.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
