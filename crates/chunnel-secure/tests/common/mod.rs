//! rcgen-made certificates and an echo server for the TLS tests.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use chunnel::{ChunnelConnection, ConnectionExt};
use chunnel_secure::{Error, Identity, ServerConfig, TrustRoots, tls};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use tokio::sync::mpsc;

/// A bound on every wait in these tests.
pub const BOUND: Duration = Duration::from_secs(15);

/// A certificate (PEM) and its key (PEM).
#[derive(Clone)]
pub struct Pem {
    pub cert: String,
    pub key: String,
}

impl Pem {
    pub fn identity(&self) -> Identity {
        Identity::from_pem(self.cert.as_bytes(), self.key.as_bytes()).unwrap()
    }
}

pub struct Ca {
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::CrlSign,
        ];
        p.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        Ca {
            pem: cert.pem(),
            issuer: Issuer::new(p, key),
        }
    }

    pub fn roots(&self) -> TrustRoots {
        TrustRoots::from_pem(self.pem.as_bytes()).unwrap()
    }

    /// A leaf for `names`, valid now unless `expired`.
    pub fn leaf(&self, names: &[&str], expired: bool) -> Pem {
        let mut p = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .unwrap();
        p.distinguished_name.push(
            DnType::CommonName,
            names.first().copied().unwrap_or("client"),
        );
        if expired {
            p.not_before = rcgen::date_time_ymd(2000, 1, 1);
            p.not_after = rcgen::date_time_ymd(2001, 1, 1);
        }
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

/// Everything the tests need: a CA, a server certificate for `localhost` signed by it, an
/// expired one, one for the wrong name, a client certificate, and a second, untrusted CA with
/// its own server and client certificates.
pub struct Pki {
    pub ca: Ca,
    pub server: Pem,
    pub expired: Pem,
    pub wrong_name: Pem,
    pub client: Pem,
    pub other_ca: Ca,
    pub other_server: Pem,
    pub other_client: Pem,
}

impl Pki {
    pub fn new() -> Pki {
        let ca = Ca::new("chunnel test CA");
        let other_ca = Ca::new("untrusted test CA");
        Pki {
            server: ca.leaf(&["localhost", "127.0.0.1"], false),
            expired: ca.leaf(&["localhost"], true),
            wrong_name: ca.leaf(&["not-localhost.example"], false),
            client: ca.leaf(&["client.test"], false),
            other_server: other_ca.leaf(&["localhost"], false),
            other_client: other_ca.leaf(&["client.test"], false),
            ca,
            other_ca,
        }
    }

    /// Writes the PEM files into a fresh directory; returns it.
    pub fn write(&self) -> PathBuf {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "chunnel-secure-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in [
            ("ca.pem", &self.ca.pem),
            ("server.pem", &self.server.cert),
            ("server.key", &self.server.key),
            ("client.pem", &self.client.cert),
            ("client.key", &self.client.key),
        ] {
            std::fs::write(dir.join(name), text).unwrap();
        }
        dir
    }
}

/// One finished handshake, as the echo server saw it.
pub type Seen = Result<tls::Session, Error>;

/// Binds a TLS listener on loopback that echoes every message of every client, and reports
/// each handshake's outcome on the channel.
pub async fn echo_server(cfg: ServerConfig) -> (SocketAddr, mpsc::Receiver<Seen>) {
    let mut l = tls::Listener::bind("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            match l.accept_client().await {
                Ok(Ok(c)) => {
                    let _ = tx.send(Ok(c.session().clone())).await;
                    tokio::spawn(async move {
                        let mut slots = vec![None; 16];
                        while let Ok(n) = c.recv(&mut slots).await {
                            let burst: Vec<_> =
                                slots[..n].iter_mut().filter_map(Option::take).collect();
                            if c.send(burst).await.is_err() {
                                break;
                            }
                        }
                    });
                }
                Ok(Err(e)) => {
                    let _ = tx.send(Err(e)).await;
                }
                Err(_) => return,
            }
        }
    });
    (addr, rx)
}

/// The next handshake outcome the server reports, within [`BOUND`].
pub async fn next(rx: &mut mpsc::Receiver<Seen>) -> Seen {
    tokio::time::timeout(BOUND, rx.recv())
        .await
        .expect("server reported nothing in time")
        .expect("server gone")
}

/// One echo through `c`.
pub async fn echo<C: ChunnelConnection<Data = bytes::Bytes>>(c: &C, msg: &'static str) {
    c.send_one(msg.into()).await.unwrap();
    let back = tokio::time::timeout(BOUND, c.recv_one())
        .await
        .expect("echo in time")
        .unwrap();
    assert_eq!(back, msg);
}

pub fn server_cfg(p: &Pem) -> chunnel_secure::ServerConfigBuilder {
    ServerConfig::builder(p.identity())
}
