//! Certificates, trust roots and the client and server configurations of [`crate::tls`].

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::Error;

/// How long a handshake may take by default before it fails with
/// [`Error::HandshakeTimeout`].
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How many server handshakes may run at once by default; further TCP connections wait in
/// the kernel's backlog until one finishes (each is bounded by the handshake timeout).
pub const DEFAULT_MAX_HANDSHAKES: usize = 256;

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn pem_err(what: &str, e: rustls::pki_types::pem::Error) -> Error {
    Error::Config {
        what: format!("{what}: {e}"),
    }
}

/// A certificate chain (leaf first) and its private key: a server's identity, or a client's
/// for mutual TLS.
#[derive(Debug)]
pub struct Identity {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Identity {
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl Identity {
    /// The certificate chain, leaf first.
    #[cfg(feature = "quic")]
    pub(crate) fn chain(&self) -> &[CertificateDer<'static>] {
        &self.chain
    }

    /// The private key.
    #[cfg(feature = "quic")]
    pub(crate) fn key(&self) -> &PrivateKeyDer<'static> {
        &self.key
    }

    /// From DER certificates (leaf first) and a DER private key (PKCS#8, PKCS#1 or SEC1).
    pub fn from_der(chain: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>) -> Self {
        Identity { chain, key }
    }

    /// From PEM text in memory: every `CERTIFICATE` section of `chain_pem` (leaf first) and
    /// the first private key of `key_pem`.
    pub fn from_pem(chain_pem: &[u8], key_pem: &[u8]) -> Result<Self, Error> {
        let chain = CertificateDer::pem_slice_iter(chain_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| pem_err("certificate chain", e))?;
        if chain.is_empty() {
            return Err(Error::Config {
                what: "certificate chain: no CERTIFICATE section".into(),
            });
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| pem_err("private key", e))?;
        Ok(Identity { chain, key })
    }

    /// From PEM files: the chain (leaf first) and the private key.
    pub fn from_pem_files(chain: impl AsRef<Path>, key: impl AsRef<Path>) -> Result<Self, Error> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|e| Error::Config {
                what: format!("cannot read {}: {e}", p.display()),
            })
        };
        Self::from_pem(&read(chain.as_ref())?, &read(key.as_ref())?)
    }
}

/// The certificate authorities an end trusts: a client's roots for the server, a server's
/// for client certificates (mutual TLS).
#[derive(Clone, Debug)]
pub struct TrustRoots {
    store: RootCertStore,
}

impl Default for TrustRoots {
    fn default() -> Self {
        TrustRoots {
            store: RootCertStore::empty(),
        }
    }
}

impl TrustRoots {
    /// The roots as rustls holds them.
    #[cfg(feature = "quic")]
    pub(crate) fn store(&self) -> &RootCertStore {
        &self.store
    }

    /// No root: add some before use.
    pub fn empty() -> Self {
        TrustRoots::default()
    }

    /// Adds one DER certificate as a trust anchor.
    pub fn add_der(&mut self, cert: CertificateDer<'_>) -> Result<&mut Self, Error> {
        self.store.add(cert).map_err(|e| Error::Config {
            what: format!("trust root: {e}"),
        })?;
        Ok(self)
    }

    /// Every `CERTIFICATE` section of PEM text, as trust anchors.
    pub fn from_pem(pem: &[u8]) -> Result<Self, Error> {
        let mut roots = TrustRoots::empty();
        for c in CertificateDer::pem_slice_iter(pem) {
            roots.add_der(c.map_err(|e| pem_err("trust roots", e))?)?;
        }
        if roots.store.is_empty() {
            return Err(Error::Config {
                what: "trust roots: no CERTIFICATE section".into(),
            });
        }
        Ok(roots)
    }

    /// Every certificate of a PEM file (a CA bundle), as trust anchors.
    pub fn from_pem_file(path: impl AsRef<Path>) -> Result<Self, Error> {
        let p = path.as_ref();
        let pem = std::fs::read(p).map_err(|e| Error::Config {
            what: format!("cannot read {}: {e}", p.display()),
        })?;
        Self::from_pem(&pem)
    }

    /// The operating system's trust store (on Linux the OpenSSL bundle, e.g.
    /// `/etc/ssl/certs/ca-certificates.crt`, or `SSL_CERT_FILE`/`SSL_CERT_DIR`). Certificates
    /// that do not parse are skipped; an empty store is an error.
    #[cfg(feature = "platform-roots")]
    pub fn platform() -> Result<Self, Error> {
        let found = rustls_native_certs::load_native_certs();
        let mut roots = TrustRoots::empty();
        let (added, _ignored) = roots.store.add_parsable_certificates(found.certs);
        if added == 0 {
            return Err(Error::Config {
                what: format!(
                    "no usable certificate in the platform trust store ({} errors)",
                    found.errors.len()
                ),
            });
        }
        Ok(roots)
    }

    /// How many trust anchors there are.
    pub fn len(&self) -> usize {
        self.store.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.store.is_empty()
    }
}

/// Settings shared by both ends.
#[derive(Clone, Debug)]
struct Common {
    handshake_timeout: Duration,
    framing: chunnel_net::framed::Config,
}

impl Default for Common {
    fn default() -> Self {
        Common {
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            framing: chunnel_net::framed::Config::default(),
        }
    }
}

/// A TLS client's configuration, built by [`ClientConfig::builder`].
///
/// TLS 1.3 only, ring's cipher suites, session resumption on (an in-memory cache of 256
/// sessions shared by every clone of this configuration and of the [`crate::tls::Connect`]
/// holding it), early data off.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    pub(crate) rustls: Arc<rustls::ClientConfig>,
    pub(crate) server_name: ServerName<'static>,
    pub(crate) handshake_timeout: Duration,
    pub(crate) framing: chunnel_net::framed::Config,
}

impl ClientConfig {
    /// Starts a configuration trusting `roots` and expecting a server certificate for
    /// `server_name` (a DNS name or an IP address; also sent as SNI when it is a DNS name).
    pub fn builder(roots: TrustRoots, server_name: &str) -> ClientConfigBuilder {
        ClientConfigBuilder {
            roots,
            server_name: server_name.to_string(),
            alpn: Vec::new(),
            identity: None,
            common: Common::default(),
        }
    }

    /// Uses a rustls configuration made elsewhere (it should allow TLS 1.3 only to keep the
    /// `secure`/`tls13` capability true).
    pub fn from_rustls(
        rustls: Arc<rustls::ClientConfig>,
        server_name: &str,
    ) -> Result<Self, Error> {
        Ok(ClientConfig {
            rustls,
            server_name: parse_name(server_name)?,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            framing: chunnel_net::framed::Config::default(),
        })
    }

    /// The rustls configuration.
    pub fn rustls(&self) -> &Arc<rustls::ClientConfig> {
        &self.rustls
    }
}

fn parse_name(name: &str) -> Result<ServerName<'static>, Error> {
    ServerName::try_from(name.to_string()).map_err(|e| Error::Config {
        what: format!("server name {name:?}: {e}"),
    })
}

/// Builds a [`ClientConfig`].
#[derive(Debug)]
pub struct ClientConfigBuilder {
    roots: TrustRoots,
    server_name: String,
    alpn: Vec<Vec<u8>>,
    identity: Option<Identity>,
    common: Common,
}

impl ClientConfigBuilder {
    /// Offers these application protocols (ALPN), in preference order.
    pub fn alpn<P: AsRef<[u8]>>(mut self, protocols: impl IntoIterator<Item = P>) -> Self {
        self.alpn = protocols.into_iter().map(|p| p.as_ref().to_vec()).collect();
        self
    }

    /// Presents this certificate when the server asks for one (mutual TLS).
    pub fn client_identity(mut self, identity: Identity) -> Self {
        self.identity = Some(identity);
        self
    }

    /// Bounds the handshake (default [`DEFAULT_HANDSHAKE_TIMEOUT`]), the TCP connect included.
    pub fn handshake_timeout(mut self, t: Duration) -> Self {
        self.common.handshake_timeout = t;
        self
    }

    /// Framing settings of the messages on the TLS stream (largest message).
    pub fn framing(mut self, cfg: chunnel_net::framed::Config) -> Self {
        self.common.framing = cfg;
        self
    }

    /// Checks the settings and builds the configuration.
    pub fn build(self) -> Result<ClientConfig, Error> {
        if self.roots.is_empty() {
            return Err(Error::Config {
                what: "client trust roots are empty".into(),
            });
        }
        let server_name = parse_name(&self.server_name)?;
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Config {
                what: e.to_string(),
            })?
            .with_root_certificates(self.roots.store);
        let mut cfg = match self.identity {
            Some(id) => builder
                .with_client_auth_cert(id.chain, id.key)
                .map_err(|e| Error::Config {
                    what: format!("client identity: {e}"),
                })?,
            None => builder.with_no_client_auth(),
        };
        cfg.alpn_protocols = self.alpn;
        // Resumption stays at rustls's default (in-memory, 256 sessions); early data stays off.
        cfg.enable_early_data = false;
        Ok(ClientConfig {
            rustls: Arc::new(cfg),
            server_name,
            handshake_timeout: self.common.handshake_timeout,
            framing: self.common.framing,
        })
    }
}

/// A TLS server's configuration, built by [`ServerConfig::builder`].
///
/// TLS 1.3 only, ring's cipher suites, session resumption on (stateful: an in-memory cache of
/// 256 sessions, two tickets sent per handshake), early data off.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub(crate) rustls: Arc<rustls::ServerConfig>,
    pub(crate) handshake_timeout: Duration,
    pub(crate) framing: chunnel_net::framed::Config,
    pub(crate) max_handshakes: usize,
}

impl ServerConfig {
    /// Starts a configuration presenting `identity`.
    pub fn builder(identity: Identity) -> ServerConfigBuilder {
        ServerConfigBuilder {
            identity,
            client_roots: None,
            alpn: Vec::new(),
            common: Common::default(),
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
        }
    }

    /// Uses a rustls configuration made elsewhere.
    pub fn from_rustls(rustls: Arc<rustls::ServerConfig>) -> Self {
        ServerConfig {
            rustls,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            framing: chunnel_net::framed::Config::default(),
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
        }
    }

    /// The rustls configuration.
    pub fn rustls(&self) -> &Arc<rustls::ServerConfig> {
        &self.rustls
    }
}

/// Builds a [`ServerConfig`].
#[derive(Debug)]
pub struct ServerConfigBuilder {
    identity: Identity,
    client_roots: Option<TrustRoots>,
    alpn: Vec<Vec<u8>>,
    common: Common,
    max_handshakes: usize,
}

impl ServerConfigBuilder {
    /// Requires every client to present a certificate issued by one of `roots` (mutual TLS).
    /// A client without one fails with [`Error::MissingClientCertificate`], one from another
    /// CA with [`Error::UnknownCa`].
    pub fn client_auth(mut self, roots: TrustRoots) -> Self {
        self.client_roots = Some(roots);
        self
    }

    /// Accepts these application protocols (ALPN), in preference order. A client offering
    /// protocols of which none is here is refused; a client offering none is accepted.
    pub fn alpn<P: AsRef<[u8]>>(mut self, protocols: impl IntoIterator<Item = P>) -> Self {
        self.alpn = protocols.into_iter().map(|p| p.as_ref().to_vec()).collect();
        self
    }

    /// Bounds each client's handshake (default [`DEFAULT_HANDSHAKE_TIMEOUT`]).
    pub fn handshake_timeout(mut self, t: Duration) -> Self {
        self.common.handshake_timeout = t;
        self
    }

    /// How many handshakes may run at once (default [`DEFAULT_MAX_HANDSHAKES`], at least 1).
    pub fn max_handshakes(mut self, n: usize) -> Self {
        self.max_handshakes = n.max(1);
        self
    }

    /// Framing settings of the messages on the TLS stream (largest message).
    pub fn framing(mut self, cfg: chunnel_net::framed::Config) -> Self {
        self.common.framing = cfg;
        self
    }

    /// Checks the settings (the key must match the leaf certificate) and builds the
    /// configuration.
    pub fn build(self) -> Result<ServerConfig, Error> {
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Config {
                what: e.to_string(),
            })?;
        let builder = match self.client_roots {
            Some(roots) => {
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots.store),
                    provider(),
                )
                .build()
                .map_err(|e| Error::Config {
                    what: format!("client certificate roots: {e}"),
                })?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut cfg = builder
            .with_single_cert(self.identity.chain, self.identity.key)
            .map_err(|e| Error::Config {
                what: format!("server identity: {e}"),
            })?;
        cfg.alpn_protocols = self.alpn;
        // Resumption: rustls's default in-memory session cache and two TLS 1.3 tickets per
        // handshake. Early data (0-RTT) stays off: max_early_data_size is 0.
        cfg.max_early_data_size = 0;
        Ok(ServerConfig {
            rustls: Arc::new(cfg),
            handshake_timeout: self.common.handshake_timeout,
            framing: self.common.framing,
            max_handshakes: self.max_handshakes,
        })
    }
}
