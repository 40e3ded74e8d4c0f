//! The server: [`Server`] and its builder; a negotiation listener, an endpoint per offered
//! transport, and the transcripts it keeps for the clients' BINDs.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use chunnel::{ConnectionExt, Listener as _, Offers as _};
use chunnel_negotiate::Transcript;
use rustls::SignatureScheme;
use rustls::pki_types::CertificateDer;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::{DetectedBy, Error, Identity, ServerConfig, quic, tls};

use super::Transport;
use super::bind::{
    Bound, Status, Tampered, decode_bind, decode_rebind, signed_message, transcript_hash,
};
use super::connection::{BOUND_DELAY, Connection, Link};
use super::option::{choice, parse_server_stack};

/// How long a server keeps a negotiation's transcript for the client's BIND.
const RECORD_TTL: Duration = Duration::from_secs(30);
/// Most transcripts a server keeps at once.
const MAX_RECORDS: usize = 1 << 16;
/// How long a data connection may take to send its BIND, and a BIND may wait for its
/// negotiation's record (the client may connect before the server's negotiation task has
/// filed it).
pub const BIND_TIMEOUT: Duration = Duration::from_secs(10);
const RECORD_WAIT: Duration = Duration::from_secs(5);

struct Record {
    transcript: Transcript,
    transport: Transport,
    at: Instant,
}

#[derive(Default)]
struct Records {
    map: Mutex<HashMap<u64, Record>>,
    added: Notify,
}

impl Records {
    fn insert(&self, id: u64, r: Record) {
        {
            let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
            if m.len() >= MAX_RECORDS / 2 {
                let now = Instant::now();
                m.retain(|_, r| now.duration_since(r.at) < RECORD_TTL);
            }
            if m.len() < MAX_RECORDS {
                m.insert(id, r);
            }
        }
        self.added.notify_waiters();
    }

    async fn take(&self, id: u64) -> Option<Record> {
        let deadline = Instant::now() + RECORD_WAIT;
        loop {
            let added = self.added.notified();
            tokio::pin!(added);
            added.as_mut().enable();
            if let Some(r) = self
                .map
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id)
            {
                return Some(r);
            }
            if tokio::time::timeout_at(deadline, added).await.is_err() {
                return None;
            }
        }
    }
}

/// The server's signing identity for plaintext BOUNDs.
struct SigningIdentity {
    chain: Vec<CertificateDer<'static>>,
    key: Arc<dyn rustls::sign::SigningKey>,
}

/// TLS 1.3 signature schemes, in the order a server tries them for its key.
pub(super) const SCHEMES: &[SignatureScheme] = &[
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ED25519,
    SignatureScheme::RSA_PSS_SHA256,
];

impl SigningIdentity {
    fn new(id: &Identity) -> Result<Self, Error> {
        let key = rustls::crypto::ring::sign::any_supported_type(id.key()).map_err(|e| {
            Error::Config {
                what: format!("signing key: {e}"),
            }
        })?;
        if key.choose_scheme(SCHEMES).is_none() {
            return Err(Error::Config {
                what: "the identity's key supports no TLS 1.3 signature scheme".into(),
            });
        }
        Ok(SigningIdentity {
            chain: id.chain().to_vec(),
            key,
        })
    }

    fn sign(&self, msg: &[u8]) -> Option<(u16, Vec<u8>)> {
        let signer = self.key.choose_scheme(SCHEMES)?;
        let sig = signer.sign(msg).ok()?;
        Some((u16::from(signer.scheme()), sig))
    }
}

/// Builds a [`Server`].
#[derive(Debug)]
pub struct ServerBuilder {
    order: Vec<Transport>,
    identity: Option<Identity>,
    negotiate: chunnel_negotiate::Config,
    at: Vec<(Transport, SocketAddr)>,
    told: Vec<(Transport, SocketAddr)>,
    bound_delay: Duration,
}

impl ServerBuilder {
    /// Binds `transport`'s endpoint to `addr` (default: the negotiation IP, a port of the
    /// system's choosing). A server restarted with the same endpoint addresses meets its
    /// clients' remembered picks there (docs/wire.md §16.5).
    pub fn endpoint(mut self, transport: Transport, addr: SocketAddr) -> Self {
        self.at.retain(|(t, _)| *t != transport);
        self.at.push((transport, addr));
        self
    }

    /// The certificate chain and key of the TLS and QUIC endpoints, which also signs the
    /// answers on the plaintext endpoint. Required if a secure transport is offered; without
    /// it, a plaintext-only server cannot serve clients that offered a secure option (they
    /// refuse an unsigned plaintext pick).
    pub fn identity(mut self, identity: Identity) -> Self {
        self.identity = Some(identity);
        self
    }

    /// The address clients are told for `transport`'s endpoint (default: the address it is
    /// bound to), for a server behind a port forward, a NAT or a relay that reaches the
    /// endpoint. The transcript binding covers it as it covers the rest of the accept.
    pub fn advertise(mut self, transport: Transport, addr: SocketAddr) -> Self {
        self.told.retain(|(t, _)| *t != transport);
        self.told.push((transport, addr));
        self
    }

    /// How long the BOUND agreeing to a client's BIND or REBIND waits for the application's
    /// first reply to ride with (default [`BOUND_DELAY`]). It goes earlier if the application
    /// receives with nothing left to read; a client's connect waits for it.
    pub fn bound_delay(mut self, delay: Duration) -> Self {
        self.bound_delay = delay;
        self
    }

    /// The negotiation settings (default: `chunnel_negotiate::Config::default()`).
    pub fn negotiate_config(mut self, cfg: chunnel_negotiate::Config) -> Self {
        self.negotiate = cfg;
        self
    }

    /// Binds the negotiation socket (UDP) to `addr` and each offered endpoint to the same
    /// IP with a port of the system's choosing, and starts serving.
    pub async fn bind(self, addr: SocketAddr) -> Result<Server, Error> {
        let ip_any = SocketAddr::new(addr.ip(), 0);
        let (tx, rx) = mpsc::channel(128);
        let records = Arc::new(Records::default());
        let decider = Arc::new(OnceLock::new());
        let signing = match &self.identity {
            Some(id) => Some(Arc::new(SigningIdentity::new(id)?)),
            None => None,
        };
        let tls_cfg = match &self.identity {
            Some(id) => Some(ServerConfig::builder(id.clone()).build()?),
            None => None,
        };
        let need_cfg = |t: Transport| {
            tls_cfg.clone().ok_or_else(|| Error::Config {
                what: format!("offering {t} needs an identity"),
            })
        };
        let mut tasks = Vec::new();
        let mut endpoints = Vec::new();
        let io = |e: chunnel::Error| Error::Config {
            what: format!("cannot bind an endpoint: {e}"),
        };
        for &t in &self.order {
            if endpoints.iter().any(|(e, _)| *e == t) {
                continue;
            }
            let ctx = Serve {
                tx: tx.clone(),
                records: Arc::clone(&records),
                decider: Arc::clone(&decider),
                signing: signing.clone(),
                transport: t,
                bound_delay: self.bound_delay,
            };
            let ip_any = self
                .at
                .iter()
                .find(|(e, _)| *e == t)
                .map_or(ip_any, |(_, a)| *a);
            let local = match t {
                Transport::Quic => {
                    let mut l = quic::Listener::bind(ip_any, need_cfg(t)?, quic::Mode::Stream)
                        .map_err(io)?;
                    let local = l.local_addr().map_err(io)?;
                    tasks.push(tokio::spawn(async move {
                        while let Ok(r) = l.accept_client().await {
                            ctx.handshaken(r.map(|c| Connection::new(Link::Quic(c))));
                        }
                    }));
                    local
                }
                Transport::Tls => {
                    let mut l = tls::Listener::bind(ip_any, need_cfg(t)?)
                        .await
                        .map_err(io)?;
                    let local = l.local_addr().map_err(io)?;
                    tasks.push(tokio::spawn(async move {
                        while let Ok(r) = l.accept_client().await {
                            ctx.handshaken(r.map(|c| Connection::new(Link::Tls(c))));
                        }
                    }));
                    local
                }
                Transport::Plain => {
                    let mut l = chunnel_net::tcp::Listener::bind(ip_any).await.map_err(io)?;
                    let local = l.local_addr().map_err(io)?;
                    tasks.push(tokio::spawn(async move {
                        loop {
                            match l.accept().await {
                                Ok(c) => ctx.handshaken(Ok(Connection::new(Link::Plain(c)))),
                                Err(e) if e.is_closed() => return,
                                Err(_) => {}
                            }
                        }
                    }));
                    local
                }
            };
            endpoints.push((t, local));
        }
        if endpoints.is_empty() {
            return Err(Error::Config {
                what: "a negotiated server must offer at least one transport".into(),
            });
        }
        let told = |t: Transport, bound: SocketAddr| {
            self.told
                .iter()
                .find(|(e, _)| *e == t)
                .map_or(bound, |(_, a)| *a)
        };
        let order: Vec<(Transport, Option<SocketAddr>)> = endpoints
            .iter()
            .map(|&(t, a)| (t, Some(told(t, a))))
            .collect();
        // The same options the negotiation listener decides with, for REBINDs (§16.5).
        let _ = decider.set(chunnel_negotiate::proto::Server::new(
            choice(&order).offer_tree(),
        ));
        let udp = chunnel_net::udp::Listener::bind(addr).await.map_err(io)?;
        let local = udp.local_addr().map_err(io)?;
        let recs = Arc::clone(&records);
        let etx = tx.clone();
        let serving =
            chunnel_negotiate::listen_with(choice(&order), udp, self.negotiate, move |r| match r {
                Ok(n) => {
                    if let Some((t, _)) = parse_server_stack(&n.info().server_stack) {
                        recs.insert(
                            n.conn_id(),
                            Record {
                                transcript: n.transcript().clone(),
                                transport: t,
                                at: Instant::now(),
                            },
                        );
                    }
                }
                Err(chunnel_negotiate::Error::Chunnel(e)) if e.is_closed() => {}
                Err(source) => {
                    let _ = etx.try_send(Err(Error::Negotiation {
                        peer: "client".into(),
                        source,
                    }));
                }
            });
        Ok(Server {
            local,
            endpoints,
            rx,
            _serving: serving,
            tasks,
        })
    }
}

/// What an endpoint's accept loop needs to check a new connection's BIND.
#[derive(Clone)]
struct Serve {
    tx: mpsc::Sender<Result<Connection, Error>>,
    records: Arc<Records>,
    /// Decides a REBIND's hello as the negotiation listener would (set once the endpoints
    /// are bound).
    decider: Arc<OnceLock<chunnel_negotiate::proto::Server>>,
    signing: Option<Arc<SigningIdentity>>,
    transport: Transport,
    bound_delay: Duration,
}

impl Serve {
    /// A datapath handshake finished (or failed): check its BIND in a task of its own.
    fn handshaken(&self, r: Result<Connection, Error>) {
        let this = self.clone();
        tokio::spawn(async move {
            let r = match r {
                Ok(c) => this.bind(c).await,
                Err(e) => Err(e),
            };
            // `Ok(None)`: a REBIND told to negotiate afresh; not a failure.
            match r.transpose() {
                None => {}
                Some(Ok(c)) => {
                    // The agreeing BOUND rides with the application's first reply, or goes
                    // alone after BOUND_DELAY (also while the connection waits in accept).
                    let flusher = c.bound_flusher();
                    let later = async {
                        tokio::time::sleep(this.bound_delay).await;
                        flusher.flush().await;
                    };
                    let _ = tokio::join!(this.tx.send(Ok(c)), later);
                }
                Some(Err(e)) => {
                    let _ = this.tx.send(Err(e)).await;
                }
            }
        });
    }

    async fn bind(&self, conn: Connection) -> Result<Option<Connection>, Error> {
        let peer = match conn.link() {
            Link::Quic(c) => c.peer().to_string(),
            Link::Tls(c) => c.peer().to_string(),
            Link::Plain(_) => format!("{} client", self.transport),
        };
        let bind_err = |detail: String| Error::Downgrade {
            peer: peer.clone(),
            by: DetectedBy::Local,
            tampered: Tampered::Unverified,
            detail,
        };
        let first = match tokio::time::timeout(BIND_TIMEOUT, conn.recv_one()).await {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => return Err(bind_err(format!("no BIND: {e}"))),
            Err(_) => return Err(bind_err(format!("no BIND within {BIND_TIMEOUT:?}"))),
        };
        let Some((conn_id, client_hash)) = decode_bind(&first) else {
            return match decode_rebind(&first) {
                // Never on plaintext: a client remembers secure picks only.
                Some(hello) if self.transport.is_secure() => self.rebind(conn, hello).await,
                _ => Err(bind_err("the first message is not a BIND".into())),
            };
        };
        let record = self.records.take(conn_id).await;
        let (status, view) = match &record {
            None => (Status::Unknown, Transcript::default()),
            Some(r) if r.transport != self.transport => {
                (Status::WrongEndpoint, r.transcript.clone())
            }
            Some(r) if transcript_hash(&r.transcript) != client_hash => {
                (Status::Differ, r.transcript.clone())
            }
            Some(r) => (Status::Agreed, r.transcript.clone()),
        };
        let mut bound = Bound {
            status: status as u8,
            view,
            ..Bound::default()
        };
        if self.transport == Transport::Plain
            && let Some(s) = &self.signing
        {
            let msg = signed_message(&transcript_hash(&bound.view), bound.status, conn_id);
            if let Some((scheme, sig)) = s.sign(&msg) {
                bound.scheme = scheme;
                bound.chain = s.chain.clone();
                bound.signature = sig.into();
            }
        }
        if status == Status::Agreed {
            conn.hold_bound(bound.encode());
            return Ok(Some(conn));
        }
        // Refusals go at once, before the connection closes.
        let _ = conn.send_one(bound.encode()).await;
        match (status, record) {
            (_, None) => Err(Error::Downgrade {
                peer,
                by: DetectedBy::Local,
                tampered: Tampered::Unknown,
                detail: format!("no negotiation with connection id {conn_id:#x}"),
            }),
            (s, Some(r)) => Err(Error::Downgrade {
                peer,
                by: DetectedBy::Local,
                tampered: Tampered::Unverified,
                detail: match s {
                    Status::WrongEndpoint => format!(
                        "the client came to the {} endpoint; this server picked {}",
                        self.transport, r.transport
                    ),
                    _ => "the client's transcript hash differs from ours".into(),
                },
            }),
        }
    }
}

impl Serve {
    /// A REBIND (docs/wire.md §16.5) on a secure endpoint: re-decide its hello against this
    /// server's options; agreed only if the pick is this endpoint's transport.
    async fn rebind(
        &self,
        conn: Connection,
        hello: bytes::Bytes,
    ) -> Result<Option<Connection>, Error> {
        let pick = self
            .decider
            .get()
            .map(|d| d.handle_hello_bytes(&hello))
            .and_then(|d| match d {
                chunnel_negotiate::proto::Decision::Accept { accept, .. } => {
                    parse_server_stack(&accept.server_stack).map(|(t, _)| t)
                }
                chunnel_negotiate::proto::Decision::Reject { .. } => None,
            });
        let status = if pick == Some(self.transport) {
            Status::Agreed
        } else {
            Status::Renegotiate
        };
        let bound = Bound {
            status: status as u8,
            view: Transcript {
                hello,
                accept: bytes::Bytes::new(),
            },
            ..Bound::default()
        };
        if status == Status::Agreed {
            conn.hold_bound(bound.encode());
            return Ok(Some(conn));
        }
        // Told to negotiate afresh: the messages behind the REBIND are read and dropped,
        // undelivered, until the client closes (so the BOUND is not cut off by our close).
        if conn.send_one(bound.encode()).await.is_ok() {
            let drain = async { while conn.recv_one().await.is_ok() {} };
            let _ = tokio::time::timeout(BIND_TIMEOUT, drain).await;
        }
        Ok(None)
    }
}

/// The server side: a negotiation listener (UDP) and one endpoint per offered transport.
/// Dropping it stops everything.
#[derive(Debug)]
pub struct Server {
    local: SocketAddr,
    endpoints: Vec<(Transport, SocketAddr)>,
    rx: mpsc::Receiver<Result<Connection, Error>>,
    _serving: chunnel_negotiate::Serving,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Server {
    /// A server offering `order` (its preference, first preferred; repeats are ignored).
    pub fn builder(order: impl IntoIterator<Item = Transport>) -> ServerBuilder {
        ServerBuilder {
            order: order.into_iter().collect(),
            identity: None,
            negotiate: chunnel_negotiate::Config::default(),
            at: Vec::new(),
            told: Vec::new(),
            bound_delay: BOUND_DELAY,
        }
    }

    /// The negotiation address (UDP): what clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The address `transport`'s endpoint is bound to, if offered.
    pub fn endpoint(&self, transport: Transport) -> Option<SocketAddr> {
        self.endpoints
            .iter()
            .find(|(t, _)| *t == transport)
            .map(|(_, a)| *a)
    }

    /// The next connection whose transcript both ends agreed on, or one client's failure
    /// (an incompatible or malformed negotiation, a failed datapath handshake, a
    /// [`Error::Downgrade`]). After a client's failure the server keeps serving;
    /// `Err(chunnel::Error::Closed)` means it stopped.
    pub async fn accept(&mut self) -> Result<Result<Connection, Error>, chunnel::Error> {
        self.rx.recv().await.ok_or(chunnel::Error::Closed)
    }
}
