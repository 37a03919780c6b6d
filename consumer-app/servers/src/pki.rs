//! Certificates made by the test itself: a certificate authority, a server
//! certificate for `127.0.0.1` and `localhost` signed by it, a client
//! certificate per user, and a second, unrelated authority for the
//! "wrong CA" cases. Everything is PEM in a directory of the caller's
//! choice, so that servers and clients read them as files, as in
//! production.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// The names the server certificate is valid for. A client that dials
/// another address of this machine (`127.0.0.2`) sees a certificate for
/// the wrong host.
pub const SERVER_NAMES: [&str; 2] = ["127.0.0.1", "localhost"];

/// The PEM files of one test PKI.
#[derive(Clone, Debug)]
pub struct Pki {
    /// The authority that signed the server and client certificates.
    pub ca: PathBuf,
    /// An authority that signed nothing here: trusting it instead of
    /// [`Pki::ca`] must fail verification.
    pub other_ca: PathBuf,
    /// The server's certificate (for [`SERVER_NAMES`]).
    pub server_cert: PathBuf,
    /// The server's private key.
    pub server_key: PathBuf,
    dir: PathBuf,
    issuer: std::sync::Arc<CertifiedIssuer<'static, KeyPair>>,
}

fn authority(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    CertifiedIssuer::self_signed(params, KeyPair::generate().expect("CA key")).expect("CA")
}

fn write(path: &Path, contents: &str) {
    std::fs::write(path, contents).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

impl Pki {
    /// Makes the authorities and the server certificate in `dir` (created
    /// if missing).
    ///
    /// # Panics
    /// When a certificate cannot be made or a file written.
    #[must_use]
    pub fn new(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).expect("PKI directory");
        let issuer = authority("inbox test CA");
        let other = authority("inbox unrelated CA");
        let pki = Self {
            ca: dir.join("ca.pem"),
            other_ca: dir.join("other-ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            dir: dir.to_path_buf(),
            issuer: std::sync::Arc::new(issuer),
        };
        write(&pki.ca, &pki.issuer.pem());
        write(&pki.other_ca, &other.pem());

        let mut params = CertificateParams::new(SERVER_NAMES.map(str::to_owned).to_vec())
            .expect("server parameters");
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate().expect("server key");
        let cert = params.signed_by(&key, &pki.issuer).expect("server cert");
        write(&pki.server_cert, &cert.pem());
        write(&pki.server_key, &key.serialize_pem());
        pki
    }

    /// A client certificate whose common name is `user` (what PostgreSQL's
    /// `cert` authentication and RabbitMQ's `EXTERNAL` mechanism log in
    /// as), signed by [`Pki::ca`]: the paths of its certificate and key.
    ///
    /// # Panics
    /// When the certificate cannot be made or written.
    #[must_use]
    pub fn client(&self, user: &str) -> (PathBuf, PathBuf) {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("client parameters");
        params.distinguished_name.push(DnType::CommonName, user);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().expect("client key");
        let cert = params.signed_by(&key, &self.issuer).expect("client cert");
        let (cert_path, key_path) = (
            self.dir.join(format!("client-{user}.pem")),
            self.dir.join(format!("client-{user}.key")),
        );
        write(&cert_path, &cert.pem());
        write(&key_path, &key.serialize_pem());
        restrict(&key_path);
        (cert_path, key_path)
    }

    /// Copies the CA and the server's certificate and key into `dir` as
    /// `ca.pem`, `server.pem` and `server.key` (a server's own directory,
    /// which its user owns).
    ///
    /// # Panics
    /// When a file cannot be copied.
    pub fn install_server_files(&self, dir: &Path) {
        for (from, to) in [
            (&self.ca, "ca.pem"),
            (&self.server_cert, "server.pem"),
            (&self.server_key, "server.key"),
        ] {
            std::fs::copy(from, dir.join(to)).expect("copy a PKI file");
        }
    }

    /// The directory the files are in.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Asserts what every refused connection's error must say, whichever
/// server refused it: why (one of `causes`), to which URL (password hidden;
/// the query aside), and none of `secrets`. Prints the text, so that a run
/// with `--nocapture` shows each refusal as a user would read it.
///
/// # Panics
/// When the text lacks any of it.
pub fn assert_refusal(what: &str, text: &str, causes: &[&str], url: &str, secrets: &[&str]) {
    println!("{what}: {text}");
    assert!(
        causes.iter().any(|cause| text.contains(cause)),
        "{what}: names none of {causes:?}: {text}"
    );
    let shown = inbox_api::redact_url(url);
    let shown = shown.split('?').next().unwrap_or_default();
    assert!(text.contains(shown), "{what}: no URL {shown} in: {text}");
    for secret in secrets {
        assert!(!text.contains(secret), "{what}: shows a secret: {text}");
    }
}

/// Mode 0600: PostgreSQL refuses a key file others can read, and libpq a
/// client key likewise.
pub fn restrict(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}
