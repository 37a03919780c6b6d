//! Connections to a RabbitMQ node that speaks TLS only, with certificates
//! the test makes itself: a verified `amqps://` connection carries
//! messages; a wrong CA, a wrong host name, the system roots alone and a
//! plain connection are each refused with a cause that says why and the URL
//! without its password; a client certificate logs in
//! (`auth_mechanism=external`); a refused password is "credentials
//! refused", fatal at start-up and retried once running, until the
//! credentials work again.
//!
//! One node for the file (a node takes seconds to boot on two cores); the
//! scenarios run in order in one test, each named in its assertions.

use std::time::Duration;

use inbox_runtime::AppError;
use inbox_runtime::amqp::{ConnectOptions, OnRefusal, connect, connect_with_backoff};
use inbox_runtime::error::chain;
use inbox_runtime::lapin::options::{BasicGetOptions, QueueDeclareOptions};
use inbox_runtime::lapin::types::FieldTable;
use inbox_runtime::lapin::{BasicProperties, Connection};
use private_servers::PrivateRabbit;
use private_servers::pki::{Pki, assert_refusal};
use tokio::sync::watch;

const SECRET: &str = "s3cret-not-in-logs";

struct Tls {
    rabbit: PrivateRabbit,
    pki: Pki,
}

impl Tls {
    fn url(&self, userinfo: &str, host: &str, query: &str) -> String {
        format!(
            "amqps://{userinfo}@{host}:{}/%2f?{query}",
            self.rabbit.port()
        )
    }

    fn ca(&self) -> String {
        format!("cacertfile={}", self.pki.ca.display())
    }

    fn add_user(&self, user: &str, password: &str) {
        self.rabbit.ctl_args(&["add_user", user, password]);
        self.rabbit
            .ctl_args(&["set_permissions", "-p", "/", user, ".*", ".*", ".*"]);
    }

    /// `rabbitmqctl list_connections user ssl`, one line per connection.
    fn connections(&self) -> String {
        let out = self
            .rabbit
            .ctl_args(&["list_connections", "user", "ssl", "-q"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// Connects and expects a refusal whose text holds every one of `causes`
/// (any one of each alternative list) and the redacted URL.
async fn refused(url: &str, what: &str, causes: &[&str]) -> AppError {
    let error = match connect(url, "tls test").await {
        Ok(_) => panic!("{what}: connected, but must be refused"),
        Err(error) => error,
    };
    assert_refusal(what, &chain(&error), causes, url, &[SECRET]);
    error
}

/// A queue round trip on `connection`: declare, publish, get it back.
async fn round_trip(connection: &Connection, queue: &str) {
    let channel = connection.create_channel().await.expect("channel");
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare");
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            Default::default(),
            b"over tls",
            BasicProperties::default(),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    let got = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(message) = channel
                .basic_get(queue.into(), BasicGetOptions { no_ack: true })
                .await
                .expect("get")
            {
                return message;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the message came back");
    assert_eq!(got.delivery.data, b"over tls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_only_broker() {
    let dir = std::env::temp_dir().join(format!("inbox-broker-tls-{}", std::process::id()));
    let pki = Pki::new(&dir);
    let tls = Tls {
        rabbit: PrivateRabbit::start_tls(&pki).await,
        pki,
    };
    let guest = "guest:guest";

    // Verified: the CA file, the host name the certificate names.
    let verified = tls.url(guest, "127.0.0.1", &tls.ca());
    let connection = connect(&verified, "tls test verified")
        .await
        .unwrap_or_else(|e| panic!("verified amqps:// connects: {}", chain(&e)));
    round_trip(&connection, "tls-round-trip").await;
    assert!(
        tls.connections()
            .lines()
            .any(|l| l.starts_with("guest") && l.ends_with("true")),
        "the broker sees a TLS connection: {}",
        tls.connections()
    );
    connection.close(200, "done".into()).await.expect("close");

    // Refused: each with its cause and the redacted URL.
    let password = format!("guest:{SECRET}");
    let other_ca = format!("cacertfile={}", tls.pki.other_ca.display());
    refused(
        &tls.url(&password, "127.0.0.1", &other_ca),
        "a CA that signed nothing here",
        &["UnknownIssuer", "unknown issuer"],
    )
    .await;
    refused(
        &tls.url(&password, "127.0.0.1", ""),
        "the system roots alone",
        &["UnknownIssuer", "unknown issuer"],
    )
    .await;
    refused(
        &tls.url(&password, "127.0.0.2", &tls.ca()),
        "a host name the certificate does not name",
        &["NotValidForName", "not valid for name"],
    )
    .await;
    let plain = format!("amqp://{password}@127.0.0.1:{}/%2f", tls.rabbit.port());
    refused(&plain, "plain AMQP to a TLS-only port", &["TLS", "tls"]).await;

    // A client certificate is the login.
    let (cert, key) = tls.pki.client("certuser");
    tls.add_user("certuser", &uuid::Uuid::new_v4().to_string());
    let external = tls
        .url(
            "",
            "127.0.0.1",
            &format!(
                "auth_mechanism=external&{}&certfile={}&keyfile={}",
                tls.ca(),
                cert.display(),
                key.display()
            ),
        )
        .replace("amqps://@", "amqps://");
    let connection = connect(&external, "tls test certificate login")
        .await
        .unwrap_or_else(|e| panic!("client certificate login: {}", chain(&e)));
    round_trip(&connection, "tls-certificate-login").await;
    assert!(
        tls.connections().lines().any(|l| l.starts_with("certuser")),
        "logged in as the certificate's name: {}",
        tls.connections()
    );
    connection.close(200, "done".into()).await.expect("close");

    // A refused password: fatal at start-up, retried once running.
    let rotated = tls.url(&format!("rotated:{SECRET}"), "127.0.0.1", &tls.ca());
    let error = refused(&rotated, "an unknown user", &["credentials refused"]).await;
    assert!(
        matches!(error, AppError::CredentialsRefused { .. }),
        "a refused login is its own error: {error:?}"
    );
    let (_stop, mut shutdown) = watch::channel(false);
    let at_start = connect_with_backoff(
        &rotated,
        "tls test start",
        ConnectOptions::default(),
        None,
        OnRefusal::Fail,
        &mut shutdown,
        None,
    )
    .await;
    assert!(
        matches!(at_start, Err(AppError::CredentialsRefused { .. })),
        "at start-up a refused login ends the attempt at once"
    );
    let (last_error, mut seen) = watch::channel(None::<String>);
    let retrying = tokio::spawn(async move {
        let (_stop, mut shutdown) = watch::channel(false);
        connect_with_backoff(
            &rotated,
            "tls test rotation",
            ConnectOptions::default(),
            None,
            OnRefusal::Retry,
            &mut shutdown,
            Some(&last_error),
        )
        .await
    });
    tokio::time::timeout(
        Duration::from_secs(30),
        seen.wait_for(|e| {
            e.as_deref()
                .is_some_and(|e| e.contains("credentials refused"))
        }),
    )
    .await
    .expect("the refusal is reported while retrying")
    .expect("still retrying");
    tls.add_user("rotated", SECRET);
    let connection = tokio::time::timeout(Duration::from_secs(60), retrying)
        .await
        .expect("connected once the credentials work")
        .expect("task")
        .unwrap_or_else(|e| panic!("rotation: {}", chain(&e)));
    connection.close(200, "done".into()).await.expect("close");
    drop(tls);
    let _ = std::fs::remove_dir_all(&dir);
}
