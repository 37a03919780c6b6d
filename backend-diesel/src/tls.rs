//! A PostgreSQL URL read as libpq reads it, for tokio-postgres: the
//! `sslmode` values it lacks (`verify-ca`, `verify-full`, `allow`) and the
//! certificate files (`sslrootcert`, `sslcert`, `sslkey`), which it would
//! refuse as unknown options. Every connection the store opens (the pool's,
//! LISTEN's) goes through [`Target`], so one URL means the same on each.
//!
//! With the `tls` feature the connector is rustls on ring: `disable` never
//! encrypts; `allow` and `prefer` encrypt when the server offers it;
//! `require` insists; none of those checks the certificate unless
//! `sslrootcert` is given (then as `verify-ca`, as libpq does); `verify-ca`
//! checks the chain against `sslrootcert` or the system's roots;
//! `verify-full` the host name too. Without the feature a URL that asks for
//! TLS is refused rather than connected in plain text.

use std::str::FromStr;

use tokio_postgres::config::SslMode;
use tokio_postgres::{Client, Config, Connection, Socket};

/// The connector every connection uses.
#[cfg(feature = "tls")]
type Connector = tokio_postgres_rustls::MakeRustlsConnect;
#[cfg(not(feature = "tls"))]
type Connector = tokio_postgres::NoTls;

/// The stream of a connection made through [`Target`].
pub(crate) type Stream = <Connector as tokio_postgres::tls::MakeTlsConnect<Socket>>::Stream;

/// libpq's `sslmode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl Mode {
    fn parse(value: &str) -> Result<Self, String> {
        Ok(match value {
            "disable" => Self::Disable,
            "allow" => Self::Allow,
            "prefer" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            other => {
                return Err(format!(
                    "sslmode={other}: not one of disable, allow, prefer, require, verify-ca, verify-full"
                ));
            }
        })
    }

    fn tokio_postgres(self) -> SslMode {
        match self {
            Self::Disable => SslMode::Disable,
            Self::Allow | Self::Prefer => SslMode::Prefer,
            Self::Require | Self::VerifyCa | Self::VerifyFull => SslMode::Require,
        }
    }
}

/// The TLS parameters of a URL.
#[derive(Debug, Default)]
struct Params {
    mode: Option<Mode>,
    root_cert: Option<String>,
    cert: Option<String>,
    key: Option<String>,
}

/// What to connect to, and how.
pub(crate) struct Target {
    config: Config,
    connector: Connector,
}

impl Target {
    /// Reads `url` (a `postgres://` URL or a `key=value` string; only a URL
    /// can carry the certificate files). The files are read here, on every
    /// connect, so a renewed certificate is used from the next connection.
    ///
    /// # Errors
    /// A description of what in the URL is unusable (the caller adds the
    /// redacted URL).
    pub(crate) fn parse(url: &str) -> Result<Self, String> {
        let (rest, params) = split(url)?;
        let mut config = Config::from_str(&rest).map_err(|e| e.to_string())?;
        let mode = params.mode.unwrap_or(Mode::Prefer);
        config.ssl_mode(mode.tokio_postgres());
        let connector = connector(mode, &params)?;
        Ok(Self { config, connector })
    }

    /// Opens the connection.
    ///
    /// # Errors
    /// tokio-postgres's: unreachable, refused, TLS handshake, authentication.
    pub(crate) async fn connect(
        &self,
    ) -> Result<(Client, Connection<Socket, Stream>), tokio_postgres::Error> {
        #[allow(
            clippy::clone_on_copy,
            reason = "NoTls is Copy, rustls' connector is not"
        )]
        let connector = self.connector.clone();
        self.config.connect(connector).await
    }

    /// The parsed settings (host, port, timeouts).
    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    /// These settings with `config` changed by `change` (a connect timeout).
    pub(crate) fn with_config(mut self, change: impl FnOnce(&mut Config)) -> Self {
        change(&mut self.config);
        self
    }
}

/// Takes the libpq-only parameters out of `url`.
fn split(url: &str) -> Result<(String, Params), String> {
    if !url.contains("://") {
        return Ok((url.to_owned(), Params::default()));
    }
    let mut parsed = url::Url::parse(url).map_err(|e| e.to_string())?;
    let mut params = Params::default();
    let mut kept = Vec::new();
    for (key, value) in parsed.query_pairs() {
        let value = value.into_owned();
        match key.as_ref() {
            "sslmode" => params.mode = Some(Mode::parse(&value)?),
            "sslrootcert" => params.root_cert = Some(value),
            "sslcert" => params.cert = Some(value),
            "sslkey" => params.key = Some(value),
            _ => kept.push((key.into_owned(), value)),
        }
    }
    if kept.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(kept);
    }
    Ok((parsed.into(), params))
}

#[cfg(not(feature = "tls"))]
fn connector(mode: Mode, params: &Params) -> Result<Connector, String> {
    let files = params.root_cert.is_some() || params.cert.is_some() || params.key.is_some();
    if matches!(mode, Mode::Require | Mode::VerifyCa | Mode::VerifyFull) || files {
        return Err(
            "the URL asks for TLS, and inbox-backend-diesel was built without its `tls` feature"
                .to_owned(),
        );
    }
    Ok(tokio_postgres::NoTls)
}

#[cfg(feature = "tls")]
fn connector(mode: Mode, params: &Params) -> Result<Connector, String> {
    use std::sync::Arc;

    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    // The process's provider when the application installed one; else
    // ring, the tree's one provider (rustls marks it deprecated to steer
    // towards aws-lc-rs, whose C build this project chose not to carry).
    let provider = match rustls::crypto::CryptoProvider::get_default() {
        Some(provider) => Arc::clone(provider),
        #[allow(deprecated)]
        None => Arc::new(rustls::crypto::ring::default_provider()),
    };
    let mut roots = rustls::RootCertStore::empty();
    match params.root_cert.as_deref() {
        Some("system") | None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                // A system store may hold certificates rustls cannot use;
                // the others still count.
                let _ = roots.add(cert);
            }
        }
        Some(path) => {
            for cert in CertificateDer::pem_file_iter(path)
                .map_err(|e| format!("sslrootcert {path}: {e}"))?
            {
                roots
                    .add(cert.map_err(|e| format!("sslrootcert {path}: {e}"))?)
                    .map_err(|e| format!("sslrootcert {path}: {e}"))?;
            }
        }
    }
    let check = match mode {
        Mode::VerifyFull => Check::Full,
        Mode::VerifyCa => Check::Chain,
        _ if params.root_cert.is_some() => Check::Chain,
        _ => Check::Nothing,
    };
    let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = if check == Check::Full {
        builder.with_root_certificates(roots)
    } else {
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::clone(&provider),
        )
        .build()
        .map_err(|e| format!("sslrootcert: {e}"));
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Lenient {
                chain: if check == Check::Chain {
                    Some(verifier?)
                } else {
                    None
                },
                provider,
            }))
    };
    let config = match (&params.cert, &params.key) {
        (Some(cert), Some(key)) => {
            let certs = CertificateDer::pem_file_iter(cert)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("sslcert {cert}: {e}"))?;
            let key =
                PrivateKeyDer::from_pem_file(key).map_err(|e| format!("sslkey {key}: {e}"))?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| format!("sslcert/sslkey: {e}"))?
        }
        (None, None) => builder.with_no_client_auth(),
        _ => return Err("sslcert and sslkey go together".to_owned()),
    };
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// What is checked of the server's certificate.
#[cfg(feature = "tls")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Check {
    Nothing,
    Chain,
    Full,
}

/// libpq's `require` (nothing checked) and `verify-ca` (the chain, not the
/// host name). The handshake's signatures are still verified, so the
/// connection is encrypted to whoever holds the certificate's key.
#[cfg(feature = "tls")]
#[derive(Debug)]
struct Lenient {
    chain: Option<std::sync::Arc<rustls::client::WebPkiServerVerifier>>,
    provider: std::sync::Arc<rustls::crypto::CryptoProvider>,
}

#[cfg(feature = "tls")]
impl rustls::client::danger::ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        intermediates: &[rustls::pki_types::CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        use rustls::{CertificateError, Error};
        let Some(chain) = &self.chain else {
            return Ok(rustls::client::danger::ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(rustls::client::danger::ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libpq_parameters_leave_the_url_and_the_mode_maps() {
        let (rest, params) = split(
            "postgres://u:p@h:5432/db?sslmode=verify-full&sslrootcert=/ca.pem&application_name=x",
        )
        .expect("splits");
        assert_eq!(rest, "postgres://u:p@h:5432/db?application_name=x");
        assert_eq!(params.mode, Some(Mode::VerifyFull));
        assert_eq!(params.root_cert.as_deref(), Some("/ca.pem"));
        assert_eq!(Mode::VerifyCa.tokio_postgres(), SslMode::Require);
        assert!(Mode::parse("verify_full").is_err());
        let (rest, _) = split("postgres://h/db?sslmode=disable").expect("splits");
        assert_eq!(rest, "postgres://h/db");
    }
}
