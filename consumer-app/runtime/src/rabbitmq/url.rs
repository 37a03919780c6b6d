//! What an AMQP URL asks for beyond lapin's own reading of it: the TLS
//! files of RabbitMQ's URI spec (`cacertfile`, `certfile`, `keyfile`), a
//! default heartbeat, and the host as written (lapin's parser keeps only
//! DNS names and turns `127.0.0.1` into `localhost`, which a TLS
//! certificate check must not see).

use std::time::Duration;

use lapin::tcp::OwnedTLSConfig;
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};

use crate::AppError;
use crate::redact::redact_url;

/// A parsed broker URL, ready to connect.
pub(crate) struct Target {
    uri: AMQPUri,
    tls: OwnedTLSConfig,
}

/// The URL's query parameter `key`, decoded.
fn param(url: &url::Url, key: &str) -> Option<String> {
    url.query_pairs()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
}

impl Target {
    /// Reads `url`; `heartbeat` applies when the URL names none.
    pub(crate) fn parse(url: &str, heartbeat: Duration) -> Result<Self, AppError> {
        let unusable =
            |why: String| AppError::Config(format!("AMQP URL {}: {why}", redact_url(url)));
        let parsed = url::Url::parse(url).map_err(|e| unusable(e.to_string()))?;
        let mut uri: AMQPUri = url.parse().map_err(unusable)?;
        if let Some(host) = parsed.host_str() {
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .clone_into(&mut uri.authority.host);
        }
        if uri.query.heartbeat.is_none() {
            uri.query.heartbeat = Some(u16::try_from(heartbeat.as_secs()).unwrap_or(u16::MAX));
        }
        let read = |key: &str| -> Result<Option<Vec<u8>>, AppError> {
            param(&parsed, key)
                .map(|path| {
                    std::fs::read(&path)
                        .map_err(|e| unusable(format!("cannot read {key} {path}: {e}")))
                })
                .transpose()
        };
        let (ca, cert, key) = (read("cacertfile")?, read("certfile")?, read("keyfile")?);
        let tls_files = ca.is_some() || cert.is_some() || key.is_some();
        match uri.scheme {
            AMQPScheme::AMQP if tls_files => {
                return Err(unusable(
                    "cacertfile, certfile and keyfile apply to amqps:// URLs only".into(),
                ));
            }
            AMQPScheme::AMQPS if !cfg!(feature = "tls") => {
                return Err(unusable(
                    "amqps:// needs TLS, and inbox-runtime was built without its `tls` feature"
                        .into(),
                ));
            }
            _ => {}
        }
        let identity = match (cert, key) {
            (Some(pem), Some(key)) => Some(lapin::tcp::OwnedIdentity::PKCS8 { pem, key }),
            (None, None) => None,
            _ => return Err(unusable("certfile and keyfile go together".into())),
        };
        let cert_chain = ca
            .map(String::from_utf8)
            .transpose()
            .map_err(|_| unusable("cacertfile is not PEM text".into()))?;
        Ok(Self {
            uri,
            tls: OwnedTLSConfig {
                identity,
                cert_chain,
            },
        })
    }

    /// Opens the connection (TCP, TLS when `amqps`, the AMQP handshake).
    pub(crate) async fn connect(
        self,
        properties: ConnectionProperties,
    ) -> Result<Connection, lapin::Error> {
        let runtime = lapin::runtime::default_runtime()?;
        Connection::connect_uri_with_config(self.uri, properties, self.tls, runtime).await
    }
}

/// Whether the broker refused the login (AMQP 403 `ACCESS_REFUSED` while
/// opening the connection): wrong or rotated credentials, a user without
/// access to the vhost, a client certificate it does not accept.
pub(crate) fn is_login_refused(error: &lapin::Error) -> bool {
    matches!(error.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 403)
}

/// What a failed connect most likely means when lapin's error does not say
/// it: a plain `amqp://` connection to a TLS port reads the TLS alert as a
/// frame that does not parse, or, when the server's close overtakes the
/// alert (a race of the two sockets: the kernel drops unread data on a
/// reset), finds the connection reset or cut before any answer.
pub(crate) fn hint(url: &str, error: &lapin::Error) -> &'static str {
    if !url.starts_with("amqp://") {
        return "";
    }
    match error.kind() {
        lapin::ErrorKind::ParsingError(_) => {
            " (the server's answer is not AMQP: a TLS-only port wants amqps://)"
        }
        lapin::ErrorKind::IOError(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::UnexpectedEof
            ) =>
        {
            " (the server closed the connection before answering AMQP: \
             a TLS-only port wants amqps://)"
        }
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_is_kept_as_written_and_the_default_heartbeat_applies() {
        let target = Target::parse("amqp://u:p@127.0.0.2:5672/%2f", Duration::from_secs(10))
            .expect("parses");
        assert_eq!(target.uri.authority.host, "127.0.0.2");
        assert_eq!(target.uri.query.heartbeat, Some(10));
        let named =
            Target::parse("amqp://h/%2f?heartbeat=3", Duration::from_secs(10)).expect("parses");
        assert_eq!(named.uri.query.heartbeat, Some(3));
        assert_eq!(named.uri.authority.host, "h");
    }

    #[test]
    fn tls_files_on_a_plain_url_and_half_an_identity_are_refused() {
        let plain = Target::parse(
            "amqp://u:secret@h/%2f?cacertfile=/etc/hostname",
            Duration::ZERO,
        );
        let error = plain.err().expect("refused").to_string();
        assert!(error.contains("amqps:// URLs only"), "{error}");
        assert!(!error.contains("secret"), "{error}");
        let missing = Target::parse(
            "amqps://h/%2f?cacertfile=/nonexistent/ca.pem",
            Duration::ZERO,
        );
        let error = missing.err().expect("refused").to_string();
        assert!(
            error.contains("cannot read cacertfile /nonexistent/ca.pem"),
            "{error}"
        );
    }

    #[test]
    fn a_plain_url_cut_off_before_any_answer_hints_at_tls() {
        let io = |kind| {
            lapin::Error::from(lapin::ErrorKind::IOError(std::sync::Arc::new(
                std::io::Error::from(kind),
            )))
        };
        for kind in [
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::ConnectionAborted,
            std::io::ErrorKind::UnexpectedEof,
        ] {
            assert!(
                hint("amqp://h/%2f", &io(kind)).contains("amqps://"),
                "{kind:?}"
            );
            assert_eq!(hint("amqps://h/%2f", &io(kind)), "", "{kind:?} over TLS");
        }
        let refused = io(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(
            hint("amqp://h/%2f", &refused),
            "",
            "nothing listens: no hint"
        );
    }
}
