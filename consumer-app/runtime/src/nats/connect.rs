//! Opening the NATS connection: the URL's credentials, the runtime's
//! timeouts, and the errors the supervisor tells apart (a refused login,
//! an unusable URL, a server that is away or silent).
//!
//! async-nats tries the server once here (no `retry_on_initial_connect`):
//! the runtime's `connect_with_backoff` does the retrying, with its
//! backoff, logs and readiness. Once connected, async-nats reconnects on
//! its own for ever, and a pull subscription picks up where it was.

use async_nats::{ConnectErrorKind, ServerAddr};

use crate::AppError;
use crate::broker::ConnectOptions;
use crate::redact::redact_url;

/// The server address and the async-nats options `url` and `options` make.
/// A user and a password in the URL log in with both; a user alone is a
/// token (`nats://s3cr3t@host`, as the NATS CLI reads it). The address
/// passed on has no credentials, so that async-nats' own log lines cannot
/// show them.
///
/// # Errors
/// [`AppError::Config`] for a URL async-nats cannot use.
pub(crate) fn options(
    url: &str,
    name: &str,
    options: ConnectOptions,
) -> Result<(ServerAddr, async_nats::ConnectOptions), AppError> {
    let unusable = |why: &dyn std::fmt::Display| {
        AppError::Config(format!("broker URL {}: {why}", redact_url(url)))
    };
    let mut parsed = url::Url::parse(url).map_err(|e| unusable(&e))?;
    let user = percent_decoded(parsed.username());
    let password = parsed.password().map(percent_decoded);
    let mut connect = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(options.timeout)
        .event_callback(|event| async move {
            match event {
                async_nats::Event::Connected => tracing::info!("NATS connection (re)established"),
                async_nats::Event::Disconnected => {
                    tracing::warn!("NATS connection lost; async-nats reconnects");
                }
                other => tracing::debug!(event = %other, "NATS connection event"),
            }
        });
    if !options.heartbeat.is_zero() {
        connect = connect.ping_interval(options.heartbeat);
    }
    connect = match (user.is_empty(), password) {
        (false, Some(password)) => connect.user_and_password(user, password),
        (false, None) => connect.token(user),
        (true, _) => connect,
    };
    connect = tls_files(&parsed, connect).map_err(|why| unusable(&why))?;
    // Infallible on a parsed URL with a host; an error would be a URL
    // without one, which the parse below refuses.
    let _ = parsed.set_username("");
    let _ = parsed.set_password(None);
    parsed.set_query(None);
    let addr: ServerAddr = parsed.as_str().parse().map_err(|e| unusable(&e))?;
    Ok((addr, connect))
}

/// The TLS files of a `tls://` URL's query, as on an `amqps://` one:
/// `cacertfile` (the CA that signed the server's certificate, instead of
/// the system's roots), `certfile` and `keyfile` (a client certificate,
/// together). Checked to be readable here, so that a wrong path is a
/// configuration error at once, not a connection retried for ever.
fn tls_files(
    url: &url::Url,
    mut connect: async_nats::ConnectOptions,
) -> Result<async_nats::ConnectOptions, String> {
    let param = |name: &str| {
        url.query_pairs()
            .find(|(key, _)| key == name)
            .map(|(_, value)| std::path::PathBuf::from(value.into_owned()))
    };
    let (ca, cert, key) = (param("cacertfile"), param("certfile"), param("keyfile"));
    if ca.is_none() && cert.is_none() && key.is_none() {
        return Ok(connect);
    }
    if !url.scheme().eq_ignore_ascii_case("tls") {
        return Err("cacertfile, certfile and keyfile apply to tls:// URLs only".into());
    }
    let readable = |what: &str, path: &std::path::Path| {
        std::fs::File::open(path)
            .map(drop)
            .map_err(|e| format!("cannot read {what} {}: {e}", path.display()))
    };
    if let Some(ca) = ca {
        readable("cacertfile", &ca)?;
        connect = connect.add_root_certificates(ca);
    }
    match (cert, key) {
        (Some(cert), Some(key)) => {
            readable("certfile", &cert)?;
            readable("keyfile", &key)?;
            connect = connect.add_client_certificate(cert, key);
        }
        (None, None) => {}
        _ => return Err("certfile and keyfile go together".into()),
    }
    Ok(connect.require_tls(true))
}

/// Connects once to the server at `url`, within `options.timeout`: the
/// runtime's own connection, public so that a tool beside a service (a
/// demo's inspection, a test's producer) reads the URL's credentials and
/// TLS files exactly as the service does.
///
/// # Errors
/// [`AppError::CredentialsRefused`] when the server refuses the login;
/// [`AppError::Config`] for an unusable URL; [`AppError::Unavailable`]
/// when it does not answer in time; otherwise [`AppError::Broker`].
pub async fn connect(
    url: &str,
    name: &str,
    connect_options: ConnectOptions,
) -> Result<async_nats::Client, AppError> {
    let (addr, options) = options(url, name, connect_options)?;
    let timeout = connect_options.timeout;
    let silent = || {
        AppError::Unavailable(format!(
            "connect to {}: no NATS answer within {timeout:?} (something accepts the \
             connection but does not speak NATS, or the server is hung)",
            redact_url(url)
        ))
    };
    match tokio::time::timeout(timeout, options.connect(addr)).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(error)) => Err(match error.kind() {
            ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
                AppError::CredentialsRefused {
                    url: redact_url(url),
                    source: error.into(),
                }
            }
            ConnectErrorKind::ServerParse => {
                AppError::Config(format!("broker URL {}: {error}", redact_url(url)))
            }
            ConnectErrorKind::TimedOut => silent(),
            ConnectErrorKind::Dns
            | ConnectErrorKind::Tls
            | ConnectErrorKind::Io
            | ConnectErrorKind::MaxReconnects => {
                AppError::broker(format!("connect to {}", redact_url(url)), error)
            }
        }),
        Err(_) => Err(silent()),
    }
}

/// `text` with its `%XX` escapes decoded (a URL's user and password);
/// invalid UTF-8 replaced.
fn percent_decoded(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_decoded_and_kept_out_of_the_address() {
        assert_eq!(percent_decoded("p%40ss%2Fw"), "p@ss/w");
        assert_eq!(percent_decoded("100%"), "100%");
        let (addr, _) = options(
            "nats://user:p%40ss@127.0.0.1:4222",
            "n",
            ConnectOptions::default(),
        )
        .expect("usable");
        assert!(!addr.as_url_str().contains("user"), "{}", addr.as_url_str());
        assert!(!addr.as_url_str().contains("ss"), "{}", addr.as_url_str());
        assert_eq!(addr.port(), 4222);
        let (tls, _) = options("tls://h:4222", "n", ConnectOptions::default()).expect("usable");
        assert!(tls.tls_required());
    }

    #[test]
    fn tls_files_need_a_tls_url_and_readable_paths() {
        let refused = |url: &str| {
            let error = options(url, "n", ConnectOptions::default()).expect_err("refused");
            assert!(matches!(error, AppError::Config(_)), "{error:?}");
            error.to_string()
        };
        assert!(refused("nats://h:4222?cacertfile=/etc/hostname").contains("tls:// URLs only"));
        assert!(
            refused("tls://h:4222?cacertfile=/nonexistent/ca.pem")
                .contains("cannot read cacertfile /nonexistent/ca.pem")
        );
        assert!(refused("tls://h:4222?certfile=/etc/hostname").contains("go together"));
        let (addr, _) = options(
            "tls://h:4222?cacertfile=/etc/hostname",
            "n",
            ConnectOptions::default(),
        )
        .expect("usable");
        assert!(!addr.as_url_str().contains('?'), "{}", addr.as_url_str());
    }

    #[test]
    fn an_unusable_url_is_a_configuration_error_without_the_password() {
        let error = options("nats://user:secret@[bad", "n", ConnectOptions::default())
            .expect_err("unusable");
        assert!(matches!(error, AppError::Config(_)), "{error:?}");
        assert!(!error.to_string().contains("secret"), "{error}");
    }

    #[tokio::test]
    async fn nobody_listening_is_a_broker_error_not_a_refusal() {
        // A port nothing listens on (the discard port, closed here).
        let error = connect("nats://127.0.0.1:9", "n", ConnectOptions::default())
            .await
            .expect_err("nothing listens");
        assert!(
            matches!(error, AppError::Broker { .. } | AppError::Unavailable(_)),
            "{error:?}"
        );
    }
}
