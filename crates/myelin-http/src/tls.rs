//! TLS with rustls (on ring): the server side of a listener (a certificate and key from PEM
//! files, picked up again when the files change, ALPN h2 and http/1.1, optionally client
//! certificates checked against a CA), and the client side for `https://` engines (the
//! system's roots or a given CA, optionally a client certificate).
//!
//! No locks on the request path: each executor's listener keeps its own acceptor and looks at
//! the files' modification times at most once per [`RELOAD_CHECK`], on an accept.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

pub use rustls::ClientConfig;
use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

/// How often a listener looks at its certificate files for a change (on an accept).
pub const RELOAD_CHECK: Duration = Duration::from_secs(1);

/// The largest PEM file read (a certificate chain or CA bundle is a few hundred KB at most).
const MAX_PEM_BYTES: u64 = 16 << 20;

/// Why TLS settings could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or held nothing usable.
    #[error("{}: {problem}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// rustls refused the settings (a key that does not match the certificate, say).
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
}

fn file_error(path: &Path, problem: impl fmt::Display) -> TlsError {
    TlsError::File {
        path: path.to_path_buf(),
        problem: problem.to_string(),
    }
}

fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    let size = std::fs::metadata(path)
        .map_err(|error| file_error(path, error))?
        .len();
    if size > MAX_PEM_BYTES {
        return Err(file_error(
            path,
            format!("{size} bytes: larger than any PEM file of certificates or keys"),
        ));
    }
    std::fs::read(path).map_err(|error| file_error(path, error))
}

/// Every `CERTIFICATE` block of a PEM file (at least one).
pub fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read_pem(path)?;
    let certificates = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| file_error(path, format!("not a PEM file of certificates: {error}")))?;
    if certificates.is_empty() {
        return Err(file_error(path, "no CERTIFICATE block in the PEM file"));
    }
    Ok(certificates)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn read_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read_pem(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|error| {
        file_error(
            path,
            format!("no private key (PKCS#8, PKCS#1 or SEC1 PEM block): {error}"),
        )
    })
}

/// The certificates of a CA file as trust roots.
fn roots_of(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for certificate in read_certificates(path)? {
        roots
            .add(certificate)
            .map_err(|error| file_error(path, format!("not a usable CA certificate: {error}")))?;
    }
    Ok(roots)
}

/// rustls on ring: TLS 1.2 and 1.3 with X25519 and the NIST curves. rustls 0.23.48 deprecates
/// ring's provider for lacking post-quantum key exchange (aws-lc-rs has it, but needs cmake
/// and a long C build, which this project keeps out of its 2-core builds; docs/operations.md,
/// "TLS").
#[expect(
    deprecated,
    reason = "ring's provider: no post-quantum key exchange, chosen for the build (see above)"
)]
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// One file's inode, size and modification time.
type Stamp = (u64, u64, SystemTime);

/// The files a listener's TLS comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTlsFiles {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key of the leaf certificate.
    pub key: PathBuf,
    /// PEM CA certificates: when given, a client must present a certificate signed by one
    /// (mutual TLS).
    pub client_ca: Option<PathBuf>,
}

impl ServerTlsFiles {
    fn paths(&self) -> impl Iterator<Item = &Path> {
        [Some(&self.cert), Some(&self.key), self.client_ca.as_ref()]
            .into_iter()
            .flatten()
            .map(PathBuf::as_path)
    }

    /// A rustls server configuration from the files as they are now, offering `alpn`.
    fn build(&self, alpn: &[&[u8]]) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let chain = read_certificates(&self.cert)?;
        let key = read_private_key(&self.key)?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let verifier = WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots_of(ca)?),
                    provider(),
                )
                .build()
                .map_err(|error| file_error(ca, error))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|error| match error {
                rustls::Error::InconsistentKeys(_) => file_error(
                    &self.key,
                    format!("is not the key of {}", self.cert.display()),
                ),
                other => TlsError::Rustls(other),
            })?;
        config.alpn_protocols = alpn.iter().map(|protocol| protocol.to_vec()).collect();
        Ok(Arc::new(config))
    }

    /// What the files look like now (inode, size and modification time of each, through
    /// symbolic links): a changed stamp means a reload is due. A file replaced by a rename
    /// (certbot, Kubernetes secret volumes) always changes its inode.
    fn stamp(&self) -> Vec<Option<Stamp>> {
        use std::os::unix::fs::MetadataExt;
        self.paths()
            .map(|path| {
                let metadata = std::fs::metadata(path).ok()?;
                Some((metadata.ino(), metadata.len(), metadata.modified().ok()?))
            })
            .collect()
    }
}

/// A listener's TLS: its files and the configuration they held when it was made (a bad
/// certificate or key is an error at startup, not at the first handshake). Each serving loop
/// starts its own [`Acceptor`] from it.
#[derive(Clone, Debug)]
pub struct ServerTls {
    files: ServerTlsFiles,
    alpn: &'static [&'static [u8]],
    initial: Arc<rustls::ServerConfig>,
    stamp: Vec<Option<Stamp>>,
}

impl ServerTls {
    /// Loads the files, offering h2 and http/1.1 by ALPN (http/1.1 only without `http2`).
    pub fn load(files: ServerTlsFiles, http2: bool) -> Result<Self, TlsError> {
        let alpn: &'static [&'static [u8]] = if http2 {
            &[b"h2", b"http/1.1"]
        } else {
            &[b"http/1.1"]
        };
        let stamp = files.stamp();
        let initial = files.build(alpn)?;
        Ok(ServerTls {
            files,
            alpn,
            initial,
            stamp,
        })
    }

    /// The files.
    pub fn files(&self) -> &ServerTlsFiles {
        &self.files
    }
}

/// What a listener's TLS did, for its owner's metrics and log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsEvent<'a> {
    /// The certificate files changed and now serve every new connection.
    Reloaded,
    /// The files changed but do not load, for this reason: the old certificate stays in
    /// use, and the files are tried again when they change again.
    ReloadFailed(&'a str),
    /// A client's handshake failed or did not finish within the header read timeout (the
    /// connection is closed).
    HandshakeFailed,
}

impl TlsEvent<'_> {
    /// Every event's name, as [`TlsEvent::name`] gives it.
    pub const NAMES: [&'static str; 3] = ["reloaded", "reload_failed", "handshake_failed"];

    /// The event's name (a metric label).
    pub fn name(&self) -> &'static str {
        match self {
            TlsEvent::Reloaded => Self::NAMES[0],
            TlsEvent::ReloadFailed(_) => Self::NAMES[1],
            TlsEvent::HandshakeFailed => Self::NAMES[2],
        }
    }
}

/// TLS 1.3 session tickets this many resumable sessions per serving loop remember.
const SESSION_CACHE_ENTRIES: usize = 256;

/// `config` (the one loaded at startup, which every serving loop starts from) with a session
/// cache of its own: rustls' cache is behind a mutex, and a serving loop (a data core) shares
/// nothing with the others. A client resuming on another core does a full handshake.
fn own_session_cache(config: &Arc<rustls::ServerConfig>) -> Arc<rustls::ServerConfig> {
    let mut config = (**config).clone();
    config.session_storage = rustls::server::ServerSessionMemoryCache::new(SESSION_CACHE_ENTRIES);
    Arc::new(config)
}

/// One serving loop's TLS acceptor: the certificate in use, replaced when its files change.
pub(crate) struct Acceptor {
    files: ServerTlsFiles,
    alpn: &'static [&'static [u8]],
    current: RefCell<Arc<rustls::ServerConfig>>,
    /// The files' stamp when `current` was loaded.
    stamp: RefCell<Vec<Option<Stamp>>>,
    /// The stamp of files that did not load (not tried again until they change).
    failed: RefCell<Option<Vec<Option<Stamp>>>>,
    checked: Cell<Instant>,
    on_event: Option<fn(TlsEvent)>,
}

impl Acceptor {
    pub(crate) fn new(tls: &ServerTls, on_event: Option<fn(TlsEvent)>) -> Self {
        Acceptor {
            files: tls.files.clone(),
            alpn: tls.alpn,
            current: RefCell::new(own_session_cache(&tls.initial)),
            stamp: RefCell::new(tls.stamp.clone()),
            failed: RefCell::new(None),
            checked: Cell::new(Instant::now()),
            on_event,
        }
    }

    /// The acceptor for a new connection, after looking at the files if [`RELOAD_CHECK`] has
    /// passed since the last look.
    pub(crate) fn acceptor(&self) -> futures_rustls::TlsAcceptor {
        self.config_now(Instant::now()).into()
    }

    /// The configuration in use at `now`, reloaded first if the files changed and
    /// [`RELOAD_CHECK`] has passed since the last look.
    fn config_now(&self, now: Instant) -> Arc<rustls::ServerConfig> {
        if now.duration_since(self.checked.get()) >= RELOAD_CHECK {
            self.checked.set(now);
            let stamp = self.files.stamp();
            let changed =
                stamp != *self.stamp.borrow() && self.failed.borrow().as_ref() != Some(&stamp);
            if changed {
                match self.files.build(self.alpn) {
                    Ok(config) => {
                        // Built here, for this loop: its session cache is its own.
                        *self.current.borrow_mut() = config;
                        *self.stamp.borrow_mut() = stamp;
                        *self.failed.borrow_mut() = None;
                        if let Some(on_event) = self.on_event {
                            on_event(TlsEvent::Reloaded);
                        }
                    }
                    // Tried again once the files change again: a certificate written before
                    // its key fails once and loads when the key is written.
                    Err(error) => {
                        *self.failed.borrow_mut() = Some(stamp);
                        if let Some(on_event) = self.on_event {
                            on_event(TlsEvent::ReloadFailed(&error.to_string()));
                        }
                    }
                }
            }
        }
        self.current.borrow().clone()
    }
}

/// The client side of a TLS handshake over `stream` with `host`, a DNS name or an IP address
/// as the server's certificate names it.
pub async fn connect<S>(
    config: Arc<ClientConfig>,
    host: &str,
    stream: S,
) -> std::io::Result<futures_rustls::client::TlsStream<S>>
where
    S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin,
{
    let name = rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|error| std::io::Error::new(std::io::ErrorKind::InvalidInput, error))?;
    futures_rustls::TlsConnector::from(config)
        .connect(name, stream)
        .await
}

/// How the router reaches `https://` engines.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientTlsFiles {
    /// PEM CA certificates trusted for engines, instead of the system's roots.
    pub ca: Option<PathBuf>,
    /// PEM client certificate chain and key presented to engines (mutual TLS).
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// A rustls client configuration for `https://` engines: the CA file's roots when given, else
/// the system's (`SSL_CERT_FILE` / `SSL_CERT_DIR` or the platform store; none found is not an
/// error here: an https engine's handshake then fails with an unknown issuer). ALPN offers
/// http/1.1 only (the engine pool speaks HTTP/1.1).
pub fn client_config(files: &ClientTlsFiles) -> Result<Arc<ClientConfig>, TlsError> {
    let roots = match &files.ca {
        Some(ca) => roots_of(ca)?,
        None => {
            let mut roots = RootCertStore::empty();
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            roots
        }
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let mut config = match &files.identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => builder
            .with_client_auth_cert(read_certificates(cert)?, read_private_key(key)?)
            .map_err(|error| match error {
                rustls::Error::InconsistentKeys(_) => {
                    file_error(key, format!("is not the key of {}", cert.display()))
                }
                other => TlsError::Rustls(other),
            })?,
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tls")
            .join(name)
    }

    fn files(cert: &str, key: &str) -> ServerTlsFiles {
        ServerTlsFiles {
            cert: fixture(cert),
            key: fixture(key),
            client_ca: None,
        }
    }

    #[test]
    fn loads_a_certificate_and_offers_alpn() {
        let tls = ServerTls::load(files("server.pem", "server.key"), true).unwrap();
        assert_eq!(
            tls.initial.alpn_protocols,
            [b"h2".to_vec(), b"http/1.1".to_vec()]
        );
        let tls = ServerTls::load(files("server.pem", "server.key"), false).unwrap();
        assert_eq!(tls.initial.alpn_protocols, [b"http/1.1".to_vec()]);
        let mutual = ServerTlsFiles {
            client_ca: Some(fixture("ca.pem")),
            ..files("server.pem", "server.key")
        };
        ServerTls::load(mutual, true).unwrap();
    }

    #[test]
    fn bad_files_are_named_in_the_error() {
        let error = ServerTls::load(files("server.pem", "other-server.key"), true).unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains("other-server.key") && text.contains("is not the key of"),
            "{text}"
        );
        let error = ServerTls::load(files("missing.pem", "server.key"), true).unwrap_err();
        assert!(error.to_string().contains("missing.pem"), "{error}");
        let error = ServerTls::load(files("make.sh", "server.key"), true).unwrap_err();
        assert!(
            error.to_string().contains("no CERTIFICATE block"),
            "{error}"
        );
        let error = ServerTls::load(files("server.pem", "server.pem"), true).unwrap_err();
        assert!(error.to_string().contains("no private key"), "{error}");
        let error = client_config(&ClientTlsFiles {
            ca: None,
            identity: Some((fixture("client.pem"), fixture("server.key"))),
        })
        .unwrap_err();
        assert!(error.to_string().contains("is not the key of"), "{error}");
    }

    #[test]
    fn client_config_trusts_the_given_ca_or_the_system() {
        let config = client_config(&ClientTlsFiles {
            ca: Some(fixture("ca.pem")),
            identity: Some((fixture("client.pem"), fixture("client.key"))),
        })
        .unwrap();
        assert_eq!(config.alpn_protocols, [b"http/1.1".to_vec()]);
        assert!(config.client_auth_cert_resolver.has_certs());
        let system = client_config(&ClientTlsFiles::default()).unwrap();
        assert!(!system.client_auth_cert_resolver.has_certs());
    }

    #[test]
    fn every_serving_loop_has_a_session_cache_of_its_own() {
        let tls = ServerTls::load(files("server.pem", "server.key"), true).unwrap();
        let (one, two) = (Acceptor::new(&tls, None), Acceptor::new(&tls, None));
        let storage = |acceptor: &Acceptor| {
            Arc::as_ptr(&acceptor.current.borrow().session_storage) as *const ()
        };
        assert_ne!(storage(&one), storage(&two));
        assert_eq!(
            one.current.borrow().alpn_protocols,
            tls.initial.alpn_protocols
        );
    }

    static RELOADS: AtomicUsize = AtomicUsize::new(0);
    static FAILED_RELOADS: AtomicUsize = AtomicUsize::new(0);

    fn count(event: TlsEvent) {
        match event {
            TlsEvent::Reloaded => RELOADS.fetch_add(1, Ordering::SeqCst),
            TlsEvent::ReloadFailed(_) => FAILED_RELOADS.fetch_add(1, Ordering::SeqCst),
            TlsEvent::HandshakeFailed => 0,
        };
    }

    #[test]
    fn a_changed_certificate_is_picked_up_at_the_next_check_and_a_bad_one_is_not() {
        let dir = std::env::temp_dir().join(format!("myelin-tls-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::copy(fixture("server.pem"), &cert).unwrap();
        std::fs::copy(fixture("server.key"), &key).unwrap();
        let tls = ServerTls::load(
            ServerTlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: None,
            },
            true,
        )
        .unwrap();
        let acceptor = Acceptor::new(&tls, Some(count));
        let start = Instant::now();
        let first = acceptor.config_now(start);
        assert!(Arc::ptr_eq(
            &first,
            &acceptor.config_now(start + RELOAD_CHECK)
        ));

        // Each file replaced by a rename, as renewal tools do; the certificate before its key:
        // the pair does not match at first, then loads.
        let replace = |from: &str, to: &Path| {
            let staged = dir.join("staged");
            std::fs::copy(fixture(from), &staged).unwrap();
            std::fs::rename(&staged, to).unwrap();
        };
        replace("other-server.pem", &cert);
        let half = acceptor.config_now(start + 2 * RELOAD_CHECK);
        assert!(
            Arc::ptr_eq(&first, &half),
            "a mismatched pair must not replace the old one"
        );
        assert_eq!(FAILED_RELOADS.load(Ordering::SeqCst), 1);
        // Unchanged, the pair is not tried (nor counted) again.
        acceptor.config_now(start + 2 * RELOAD_CHECK + RELOAD_CHECK);
        assert_eq!(FAILED_RELOADS.load(Ordering::SeqCst), 1);
        replace("other-server.key", &key);
        // Not before the check interval has passed since the last look.
        let early = acceptor.config_now(start + 3 * RELOAD_CHECK + RELOAD_CHECK / 2);
        assert!(Arc::ptr_eq(&first, &early));
        let reloaded = acceptor.config_now(start + 4 * RELOAD_CHECK);
        assert!(!Arc::ptr_eq(&first, &reloaded));
        assert_eq!(
            reloaded.alpn_protocols,
            [b"h2".to_vec(), b"http/1.1".to_vec()]
        );
        assert_eq!(RELOADS.load(Ordering::SeqCst), 1);
        // Unchanged files: nothing is reloaded.
        let same = acceptor.config_now(start + 5 * RELOAD_CHECK);
        assert!(Arc::ptr_eq(&reloaded, &same));
        assert_eq!(RELOADS.load(Ordering::SeqCst), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
