//! QUIC, TLS over TCP or plaintext, negotiated — and bound so that an on-path attacker
//! cannot downgrade the choice.
//!
//! A [`Server`] listens for negotiation on one UDP address (chunnel-negotiate's HELLO and
//! ACCEPT) and runs one endpoint per transport it offers: QUIC ([`crate::quic`], stream
//! mode), TLS 1.3 over TCP ([`crate::tls`]) and plaintext length-framed TCP
//! (`chunnel_net::tcp`). It offers them in its preference order; each option's capability
//! `endpoint` carries the endpoint's address (as the sharding advertisement carries shard
//! addresses), so the ACCEPT tells the client where the picked datapath listens. A
//! [`Client`] offers any subset of the three in its own order, negotiates, and connects to
//! the picked endpoint; both ends return a [`Connection`] (an enum over the three datapaths,
//! `ChunnelConnection<Data = Bytes>`). The server's preference decides; a client with no
//! option in common gets chunnel-negotiate's `Incompatible` error (inside
//! [`Error::Negotiation`]).
//!
//! ## Downgrade protection (docs/wire.md §16)
//!
//! The HELLO and ACCEPT cross the network unprotected, so an on-path attacker could strip
//! the secure offers from the hello or change the pick in the accept. Before either end hands
//! a connection to its application, they compare the negotiation **transcript** (the HELLO
//! and ACCEPT exactly as each end sent or received them, [`chunnel_negotiate::Transcript`])
//! on the picked datapath: the client's first message (BIND) carries the connection id and
//! its transcript hash, the server's answer (BOUND) its own view of both messages.
//!
//! * On a secure pick (QUIC, TLS) the exchange runs inside the authenticated channel: an
//!   attacker can neither read nor change it.
//! * On a plaintext pick, a client that offered a secure option requires the server's
//!   answer to be signed with the server's certificate key (the same identity as its TLS
//!   and QUIC endpoints): the BOUND carries the certificate chain, checked against the
//!   client's trust roots and server name, and a signature over the server's transcript
//!   hash. A server that offers plaintext to such clients therefore needs an identity.
//!
//! Any difference fails the connection at both ends with [`Error::Downgrade`], which names
//! what differs ([`Tampered`]); a missing or bad signature is [`Tampered::Unverified`].
//! Neither end hands the connection to its application before the check has passed. On
//! plaintext no application byte is sent before it either; on a secure pick
//! [`Client::connect_with`] sends the application's first messages right behind the BIND,
//! encrypted to the authenticated server, which delivers them only once the BIND checks out
//! (saving the BIND's round trip). [`Policy::SecureOnly`]
//! refuses plaintext outright ([`Error::PlaintextRefused`]): it is never offered, and an
//! accept that names it is refused before any connection is made.
//!
//! ```
//! use chunnel::ConnectionExt;
//! use chunnel_secure::negotiated::{Client, Server, Transport};
//! use chunnel_secure::{Identity, TrustRoots};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cert = rcgen::generate_simple_self_signed(["localhost".to_string()])?;
//! let identity = Identity::from_pem(cert.cert.pem().as_bytes(), cert.signing_key.serialize_pem().as_bytes())?;
//! let roots = TrustRoots::from_pem(cert.cert.pem().as_bytes())?;
//!
//! // The server prefers TLS over QUIC; the client QUIC over TLS: the server decides.
//! let mut server = Server::builder([Transport::Tls, Transport::Quic])
//!     .identity(identity)
//!     .bind("127.0.0.1:0".parse()?)
//!     .await?;
//! let client = Client::builder([Transport::Quic, Transport::Tls])
//!     .trust(roots, "localhost")
//!     .build()?;
//! let addr = server.local_addr();
//! let (c, s) = tokio::join!(client.connect(addr), server.accept());
//! let (c, s) = (c?, s??);
//! assert_eq!(c.transport(), Transport::Tls);
//! c.send_one("hi".into()).await?;
//! assert_eq!(s.recv_one().await?, "hi");
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use chunnel::negotiate::{Capability, ChunnelInfo, Negotiate};
use chunnel::{Chunnel, ChunnelConnection, ConnectionExt, Listener as _, Offers, Select, select};
use chunnel_negotiate::Transcript;
use rustls::SignatureScheme;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::{ClientConfig, DetectedBy, Error, Identity, ServerConfig, TrustRoots, quic, tls};

/// One of the three datapaths a negotiated connection can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// QUIC v1, one reliable ordered stream ([`crate::quic::Mode::Stream`]).
    Quic,
    /// TLS 1.3 over TCP ([`crate::tls`]).
    Tls,
    /// Plaintext length-framed TCP (`chunnel_net::tcp`): no encryption.
    Plain,
}

impl Transport {
    /// The negotiation id of this transport's option.
    pub fn id(self) -> &'static str {
        match self {
            Transport::Quic => "chunnel/endpoint-quic/1",
            Transport::Tls => "chunnel/endpoint-tls/1",
            Transport::Plain => "chunnel/endpoint-plain/1",
        }
    }

    /// The first label of the option's `endpoint` capability.
    pub fn label(self) -> &'static str {
        match self {
            Transport::Quic => "quic",
            Transport::Tls => "tls",
            Transport::Plain => "plain",
        }
    }

    /// Whether the datapath encrypts and authenticates the server.
    pub fn is_secure(self) -> bool {
        !matches!(self, Transport::Plain)
    }

    /// The transport whose option id is `id`.
    pub fn from_id(id: &str) -> Option<Transport> {
        [Transport::Quic, Transport::Tls, Transport::Plain]
            .into_iter()
            .find(|t| t.id() == id)
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// The capability kind of the options: `endpoint = {<transport>}` at the client,
/// `endpoint = {<transport>, "addr=<ip:port>"}` at the server (exact; the server's rule
/// compares the transport label only).
pub const CAPABILITY: &str = "endpoint";
const ADDR_PREFIX: &str = "addr=";

/// The server's rule: the client's `endpoint` capability names our transport.
fn endpoint_rule(ours: &Capability, theirs: &Capability) -> bool {
    ours.labels
        .first()
        .is_some_and(|t| theirs.labels.iter().any(|l| l == t))
}

/// One option of the negotiated choice: a transport (with, at the server, its endpoint's
/// address), or an empty slot that is never offered. Builds no layer: the datapath is set up
/// after negotiation, on the endpoint the accept names.
#[derive(Clone, Debug)]
pub struct Option3 {
    transport: Option<Transport>,
    addr: Option<SocketAddr>,
}

impl Negotiate for Option3 {
    fn id(&self) -> &'static str {
        self.transport
            .map_or("chunnel/endpoint-none/1", Transport::id)
    }

    fn capabilities(&self) -> Vec<Capability> {
        let Some(t) = self.transport else {
            return Vec::new();
        };
        match self.addr {
            None => vec![Capability::exact(CAPABILITY, [t.label()])],
            Some(a) => vec![
                Capability::exact(
                    CAPABILITY,
                    [t.label().to_string(), format!("{ADDR_PREFIX}{a}")],
                )
                .with_rule(endpoint_rule),
            ],
        }
    }

    fn check_available(&self) -> Result<(), chunnel::Error> {
        match self.transport {
            Some(_) => Ok(()),
            None => Err(chunnel::Error::NotAvailable {
                chunnel: "chunnel/endpoint-none/1",
                reason: "empty slot".into(),
            }),
        }
    }
}

impl<C: ChunnelConnection + Send> Chunnel<C> for Option3 {
    type Connection = C;

    async fn connect_wrap(&mut self, inner: C) -> Result<C, chunnel::Error> {
        Ok(inner)
    }
}

/// The offered choice: up to three transports, preferred first.
pub type Choice = Select<Option3, Select<Option3, Option3>>;

fn choice(order: &[(Transport, Option<SocketAddr>)]) -> Choice {
    let slot = |i: usize| Option3 {
        transport: order.get(i).map(|o| o.0),
        addr: order.get(i).and_then(|o| o.1),
    };
    select(slot(0), select(slot(1), slot(2)))
}

/// The transport and endpoint address of a server stack (the accept's `server_stack`).
fn parse_server_stack(stack: &[ChunnelInfo]) -> Option<(Transport, SocketAddr)> {
    let c = stack.first()?;
    let t = Transport::from_id(&c.id)?;
    let addr = c
        .capabilities
        .iter()
        .filter(|c| c.kind == CAPABILITY)
        .flat_map(|c| &c.labels)
        .find_map(|l| l.strip_prefix(ADDR_PREFIX)?.parse().ok())?;
    Some((t, addr))
}

/// A negotiated connection: the datapath the server picked.
#[derive(Debug)]
pub enum Connection {
    /// QUIC (stream mode).
    Quic(quic::Connection),
    /// TLS 1.3 over TCP.
    Tls(tls::Connection),
    /// Plaintext TCP.
    Plain(chunnel_net::tcp::Connection),
}

impl Connection {
    /// The transport this connection runs on.
    pub fn transport(&self) -> Transport {
        match self {
            Connection::Quic(_) => Transport::Quic,
            Connection::Tls(_) => Transport::Tls,
            Connection::Plain(_) => Transport::Plain,
        }
    }
}

impl ChunnelConnection for Connection {
    type Data = Bytes;

    #[allow(clippy::manual_async_fn)]
    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), chunnel::Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        async move {
            match self {
                Connection::Quic(c) => c.send(burst).await,
                Connection::Tls(c) => c.send(burst).await,
                Connection::Plain(c) => c.send(burst).await,
            }
        }
    }

    #[allow(clippy::manual_async_fn)]
    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Bytes>],
    ) -> impl Future<Output = Result<usize, chunnel::Error>> + Send + 'a {
        async move {
            match self {
                Connection::Quic(c) => c.recv(slots).await,
                Connection::Tls(c) => c.recv(slots).await,
                Connection::Plain(c) => c.recv(slots).await,
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The binding messages (docs/wire.md §16).

/// BIND's type byte.
const BIND: u8 = 0xb1;
/// BOUND's type byte.
const BOUND: u8 = 0xb2;
const BIND_LEN: usize = 1 + 8 + 32;
/// Prefix of the transcript hash.
const HASH_CONTEXT: &[u8] = b"chunnel negotiation transcript v1\0";
/// Prefix of the signed message.
const SIGN_CONTEXT: &[u8] = b"chunnel negotiation transcript signature v1\0";
/// Largest BOUND a client reads (certificate chains included).
const MAX_BOUND: usize = 64 * 1024;

/// What the server found when it compared transcripts (BOUND's status byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Status {
    Agreed = 0,
    Differ = 1,
    Unknown = 2,
    WrongEndpoint = 3,
}

impl Status {
    fn from_u8(b: u8) -> Option<Status> {
        [
            Status::Agreed,
            Status::Differ,
            Status::Unknown,
            Status::WrongEndpoint,
        ]
        .into_iter()
        .find(|s| *s as u8 == b)
    }
}

/// SHA-256 over the context, then the hello and the accept, each after its `u32` length.
fn transcript_hash(t: &Transcript) -> [u8; 32] {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(HASH_CONTEXT);
    for part in [&t.hello, &t.accept] {
        ctx.update(&(part.len() as u32).to_be_bytes());
        ctx.update(part);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(ctx.finish().as_ref());
    out
}

/// The message a plaintext BOUND's signature covers.
fn signed_message(hash: &[u8; 32], status: u8, conn_id: u64) -> Vec<u8> {
    let mut m = Vec::with_capacity(SIGN_CONTEXT.len() + 32 + 9);
    m.extend_from_slice(SIGN_CONTEXT);
    m.extend_from_slice(hash);
    m.push(status);
    m.extend_from_slice(&conn_id.to_be_bytes());
    m
}

fn encode_bind(conn_id: u64, hash: &[u8; 32]) -> Bytes {
    let mut b = BytesMut::with_capacity(BIND_LEN);
    b.put_u8(BIND);
    b.put_u64(conn_id);
    b.put_slice(hash);
    b.freeze()
}

fn decode_bind(m: &[u8]) -> Option<(u64, [u8; 32])> {
    if m.len() != BIND_LEN || m[0] != BIND {
        return None;
    }
    let id = u64::from_be_bytes(m[1..9].try_into().ok()?);
    let h: [u8; 32] = m[9..].try_into().ok()?;
    Some((id, h))
}

/// A decoded BOUND.
#[derive(Debug, Default)]
struct Bound {
    status: u8,
    view: Transcript,
    scheme: u16,
    chain: Vec<CertificateDer<'static>>,
    signature: Bytes,
}

impl Bound {
    fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(
            16 + self.view.hello.len()
                + self.view.accept.len()
                + self.chain.iter().map(|c| c.len() + 4).sum::<usize>()
                + self.signature.len(),
        );
        b.put_u8(BOUND);
        b.put_u8(self.status);
        for part in [&self.view.hello, &self.view.accept] {
            b.put_u32(part.len() as u32);
            b.put_slice(part);
        }
        b.put_u16(self.scheme);
        b.put_u16(self.chain.len() as u16);
        for c in &self.chain {
            b.put_u32(c.len() as u32);
            b.put_slice(c);
        }
        b.put_u16(self.signature.len() as u16);
        b.put_slice(&self.signature);
        b.freeze()
    }

    fn decode(mut m: Bytes) -> Result<Bound, &'static str> {
        fn take(m: &mut Bytes, n: usize, what: &'static str) -> Result<Bytes, &'static str> {
            if m.remaining() < n {
                return Err(what);
            }
            Ok(m.split_to(n))
        }
        if take(&mut m, 1, "empty")?[0] != BOUND {
            return Err("not a BOUND message");
        }
        let status = take(&mut m, 1, "status")?[0];
        let part = |m: &mut Bytes, what| {
            let n = take(m, 4, what)?.get_u32() as usize;
            take(m, n, what)
        };
        let hello = part(&mut m, "hello")?;
        let accept = part(&mut m, "accept")?;
        let scheme = take(&mut m, 2, "scheme")?.get_u16();
        let n = take(&mut m, 2, "chain count")?.get_u16();
        let mut chain = Vec::new();
        for _ in 0..n {
            let c = part(&mut m, "certificate")?;
            chain.push(CertificateDer::from(c.to_vec()));
        }
        let sl = take(&mut m, 2, "signature length")?.get_u16() as usize;
        let signature = take(&mut m, sl, "signature")?;
        if m.has_remaining() {
            return Err("trailing bytes");
        }
        Ok(Bound {
            status,
            view: Transcript { hello, accept },
            scheme,
            chain,
            signature,
        })
    }
}

/// The fuzz target's entry (not a stable API): decodes `m` as a BIND and as a BOUND message
/// (docs/wire.md §16); whatever decodes must re-encode to the same bytes.
#[doc(hidden)]
pub fn fuzz_decode(m: &[u8]) {
    if let Some((id, h)) = decode_bind(m) {
        assert_eq!(
            &encode_bind(id, &h)[..],
            m,
            "a BIND that does not re-encode"
        );
    }
    if let Ok(b) = Bound::decode(Bytes::copy_from_slice(m)) {
        assert_eq!(&b.encode()[..], m, "a BOUND that does not re-encode");
    }
}

/// What an attacker (or a fault) changed, as far as the two transcripts tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tampered {
    /// The HELLO the server received differs from the one the client sent (offers stripped
    /// or changed).
    Hello,
    /// The ACCEPT the client received differs from the one the server sent (pick changed).
    Accept,
    /// Both differ.
    HelloAndAccept,
    /// The server's account of the negotiation could not be authenticated: a plaintext pick
    /// whose answer is unsigned, signed by a key the client does not trust, or badly signed;
    /// or no answer the client can read.
    Unverified,
    /// The server has no record of this negotiation (or it expired).
    Unknown,
}

impl std::fmt::Display for Tampered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tampered::Hello => "the hello was changed",
            Tampered::Accept => "the accept was changed",
            Tampered::HelloAndAccept => "the hello and the accept were changed",
            Tampered::Unverified => "the negotiation could not be authenticated",
            Tampered::Unknown => "the server has no record of this negotiation",
        })
    }
}

/// The transports a hello offers, in its order (for error messages).
fn hello_offers(hello: &[u8]) -> String {
    let Some(body) = hello.get(1..) else {
        return "?".into();
    };
    match chunnel_negotiate::wire::Hello::decode(body) {
        Ok(h) => {
            let names: Vec<String> = h
                .offers
                .options()
                .iter()
                .map(|o| {
                    o.chunnels
                        .first()
                        .and_then(|c| Transport::from_id(&c.id))
                        .map_or_else(|| "?".to_string(), |t| t.to_string())
                })
                .collect();
            format!("[{}]", names.join(", "))
        }
        Err(_) => "(undecodable)".into(),
    }
}

/// The transport an accept picks and its endpoint (for error messages).
fn accept_pick(accept: &[u8]) -> String {
    accept
        .get(1..)
        .and_then(|b| chunnel_negotiate::wire::Accept::decode(b).ok())
        .and_then(|a| parse_server_stack(&a.server_stack))
        .map_or_else(|| "(undecodable)".into(), |(t, a)| format!("{t} at {a}"))
}

/// Compares the client's transcript with the server's view of it.
fn compare(mine: &Transcript, theirs: &Transcript) -> Option<(Tampered, String)> {
    let hello = mine.hello != theirs.hello;
    let accept = mine.accept != theirs.accept;
    let mut detail = Vec::new();
    if hello {
        detail.push(format!(
            "hello: client offered {}, server received {}",
            hello_offers(&mine.hello),
            hello_offers(&theirs.hello)
        ));
    }
    if accept {
        detail.push(format!(
            "accept: server picked {}, client received {}",
            accept_pick(&theirs.accept),
            accept_pick(&mine.accept)
        ));
    }
    let what = match (hello, accept) {
        (false, false) => return None,
        (true, false) => Tampered::Hello,
        (false, true) => Tampered::Accept,
        (true, true) => Tampered::HelloAndAccept,
    };
    Some((what, detail.join("; ")))
}

// ---------------------------------------------------------------------------------------
// Server.

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
const SCHEMES: &[SignatureScheme] = &[
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
}

impl ServerBuilder {
    /// The certificate chain and key of the TLS and QUIC endpoints, which also signs the
    /// answers on the plaintext endpoint. Required if a secure transport is offered; without
    /// it, a plaintext-only server cannot serve clients that offered a secure option (they
    /// refuse an unsigned plaintext pick).
    pub fn identity(mut self, identity: Identity) -> Self {
        self.identity = Some(identity);
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
                signing: signing.clone(),
                transport: t,
            };
            let local = match t {
                Transport::Quic => {
                    let mut l = quic::Listener::bind(ip_any, need_cfg(t)?, quic::Mode::Stream)
                        .map_err(io)?;
                    let local = l.local_addr().map_err(io)?;
                    tasks.push(tokio::spawn(async move {
                        while let Ok(r) = l.accept_client().await {
                            ctx.handshaken(r.map(Connection::Quic));
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
                            ctx.handshaken(r.map(Connection::Tls));
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
                                Ok(c) => ctx.handshaken(Ok(Connection::Plain(c))),
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
        let order: Vec<(Transport, Option<SocketAddr>)> =
            endpoints.iter().map(|&(t, a)| (t, Some(a))).collect();
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
    signing: Option<Arc<SigningIdentity>>,
    transport: Transport,
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
            let _ = this.tx.send(r).await;
        });
    }

    async fn bind(&self, conn: Connection) -> Result<Connection, Error> {
        let peer = match &conn {
            Connection::Quic(c) => c.peer().to_string(),
            Connection::Tls(c) => c.peer().to_string(),
            Connection::Plain(_) => format!("{} client", self.transport),
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
            return Err(bind_err("the first message is not a BIND".into()));
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
        let sent = conn.send_one(bound.encode()).await;
        match (status, record) {
            (Status::Agreed, _) => {
                sent.map_err(|e| bind_err(format!("cannot answer the BIND: {e}")))?;
                Ok(conn)
            }
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
        }
    }

    /// The negotiation address (UDP): what clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The endpoint of `transport`, if offered.
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

// ---------------------------------------------------------------------------------------
// Client.

/// Whether a client accepts a plaintext pick.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// Plaintext is offered if listed; when the client also offered a secure option, a
    /// plaintext pick must come with the server's signature over the transcript.
    #[default]
    AllowPlaintext,
    /// Plaintext is never offered, and a pick of it is refused
    /// ([`Error::PlaintextRefused`]) before any connection is made.
    SecureOnly,
}

/// Builds a [`Client`].
#[derive(Debug)]
pub struct ClientBuilder {
    offers: Vec<Transport>,
    trust: Option<(TrustRoots, String)>,
    policy: Policy,
    negotiate: chunnel_negotiate::Config,
}

impl ClientBuilder {
    /// The roots the server's certificate must chain to and the name it must carry (for the
    /// secure transports, and for the signature on a plaintext pick). Required if a secure
    /// transport is offered.
    pub fn trust(mut self, roots: TrustRoots, server_name: &str) -> Self {
        self.trust = Some((roots, server_name.to_string()));
        self
    }

    /// The plaintext policy (default [`Policy::AllowPlaintext`]).
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// The negotiation settings (default: `chunnel_negotiate::Config::default()`).
    pub fn negotiate_config(mut self, cfg: chunnel_negotiate::Config) -> Self {
        self.negotiate = cfg;
        self
    }

    /// The client.
    pub fn build(self) -> Result<Client, Error> {
        let mut offers = Vec::new();
        for t in self.offers {
            let refused = t == Transport::Plain && self.policy == Policy::SecureOnly;
            if !offers.contains(&t) && !refused {
                offers.push(t);
            }
        }
        if offers.is_empty() {
            return Err(Error::Config {
                what: "the client offers no transport".into(),
            });
        }
        let secure = offers.iter().any(|t| t.is_secure());
        let trust = match (self.trust, secure) {
            (Some((roots, name)), _) => {
                let cfg = ClientConfig::builder(roots.clone(), &name).build()?;
                let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
                    Arc::new(roots.store().clone()),
                    Arc::new(rustls::crypto::ring::default_provider()),
                )
                .build()
                .map_err(|e| Error::Config {
                    what: format!("trust roots: {e}"),
                })?;
                let name = ServerName::try_from(name.clone()).map_err(|e| Error::Config {
                    what: format!("server name {name:?}: {e}"),
                })?;
                Some(Trust {
                    cfg,
                    verifier,
                    name,
                })
            }
            (None, true) => {
                return Err(Error::Config {
                    what: "offering a secure transport needs trust roots and a server name".into(),
                });
            }
            (None, false) => None,
        };
        Ok(Client {
            offers,
            trust,
            policy: self.policy,
            neg: chunnel_negotiate::Client::new(self.negotiate),
            quic_endpoints: Mutex::default(),
        })
    }
}

#[derive(Debug)]
struct Trust {
    cfg: ClientConfig,
    verifier: Arc<rustls::client::WebPkiServerVerifier>,
    name: ServerName<'static>,
}

/// The client side: negotiates with a [`Server`], connects to the picked endpoint, and
/// checks the transcript before returning the connection.
#[derive(Debug)]
pub struct Client {
    offers: Vec<Transport>,
    trust: Option<Trust>,
    policy: Policy,
    neg: chunnel_negotiate::Client,
    /// The QUIC client endpoints (IPv4, IPv6), bound on the first QUIC pick of that family
    /// and shared by every later one (and by the connections they made).
    quic_endpoints: Mutex<[Option<quinn::Endpoint>; 2]>,
}

impl Client {
    /// A client offering `offers` (its preference, first preferred; repeats are ignored).
    pub fn builder(offers: impl IntoIterator<Item = Transport>) -> ClientBuilder {
        ClientBuilder {
            offers: offers.into_iter().collect(),
            trust: None,
            policy: Policy::default(),
            negotiate: chunnel_negotiate::Config::default(),
        }
    }

    /// The transports this client offers, preferred first.
    pub fn offers(&self) -> &[Transport] {
        &self.offers
    }

    /// The offer tree of this client's hellos (what an on-path observer sees).
    pub fn offer_tree(&self) -> chunnel::OfferTree {
        self.choice().offer_tree()
    }

    fn choice(&self) -> Choice {
        let order: Vec<_> = self.offers.iter().map(|&t| (t, None)).collect();
        choice(&order)
    }

    /// Negotiates with the server whose negotiation address is `addr`, connects to the
    /// picked endpoint, and checks the transcript (see the [module docs](self)). No
    /// application byte can have been sent when this fails.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Connection, Error> {
        self.connect_with(addr, []).await
    }

    /// As [`connect`](Self::connect), and sends `first` (the application's first messages)
    /// as early as the binding allows, saving a round trip:
    ///
    /// * on a secure pick (QUIC, TLS) right behind the BIND, in the same write, without
    ///   waiting for the BOUND: they are encrypted to the server the channel authenticated,
    ///   which delivers them to its application only after it has checked the BIND (and
    ///   never if the check fails);
    /// * on a plaintext pick only after the BOUND has been checked, as if sent after
    ///   [`connect`](Self::connect) returned: nothing of `first` goes in the clear before the
    ///   transcript is verified.
    ///
    /// Either way it returns once the BOUND has been checked, so nothing the server sent is
    /// delivered before; on a [`Error::Downgrade`] the connection is dropped. An empty
    /// `first` is [`connect`](Self::connect).
    pub async fn connect_with(
        &self,
        addr: SocketAddr,
        first: impl IntoIterator<Item = Bytes>,
    ) -> Result<Connection, Error> {
        let first: Vec<Bytes> = first.into_iter().collect();
        let peer = addr.to_string();
        let neg_err = |source| Error::Negotiation {
            peer: peer.clone(),
            source,
        };
        let base = chunnel_net::udp::Connect::new(addr)
            .connect_wrap(())
            .await
            .map_err(|e| neg_err(chunnel_negotiate::Error::Chunnel(e)))?;
        let n = match self.neg.connect(&peer, self.choice(), base).await {
            Ok(n) => n,
            // A pick we never offered: the accept was changed (or the server is broken).
            Err(chunnel_negotiate::Error::Wire(w))
                if w.0 == "the accept names a pick we did not offer" =>
            {
                return Err(Error::Downgrade {
                    peer,
                    by: DetectedBy::Local,
                    tampered: Tampered::Accept,
                    detail: w.0.into(),
                });
            }
            Err(e) => return Err(neg_err(e)),
        };
        let transcript = n.transcript().clone();
        let conn_id = n.conn_id();
        let server_stack = Arc::clone(&n.info().server_stack);
        // The negotiation's own connection is not used further.
        drop(n);
        let bad_accept = |detail: String| Error::Downgrade {
            peer: peer.clone(),
            by: DetectedBy::Local,
            tampered: Tampered::Accept,
            detail,
        };
        let Some((transport, mut ep)) = parse_server_stack(&server_stack) else {
            return Err(bad_accept(
                "the accept names no endpoint this client knows".into(),
            ));
        };
        if transport == Transport::Plain && self.policy == Policy::SecureOnly {
            return Err(Error::PlaintextRefused { peer });
        }
        if !self.offers.contains(&transport) {
            return Err(bad_accept(format!(
                "the accept picks {transport}, which this client did not offer"
            )));
        }
        if transcript.hello.is_empty() || transcript.accept.is_empty() {
            return Err(Error::Downgrade {
                peer,
                by: DetectedBy::Local,
                tampered: Tampered::Unverified,
                detail: "the negotiation's transcript was not recorded".into(),
            });
        }
        // A server bound to the unspecified address advertises it; its endpoints are then
        // reached at the address negotiated with.
        if ep.ip().is_unspecified() {
            ep.set_ip(addr.ip());
        }
        let conn = match (transport, &self.trust) {
            (Transport::Quic, Some(t)) => Connection::Quic(
                quic::Connect::new(ep, t.cfg.clone(), quic::Mode::Stream)
                    .with_endpoint(self.quic_endpoint(ep).map_err(|e| Error::Datapath {
                        transport,
                        source: e,
                    })?)
                    .connect_wrap(())
                    .await
                    .map_err(|e| Error::Datapath {
                        transport,
                        source: e,
                    })?,
            ),
            (Transport::Tls, Some(t)) => Connection::Tls(
                tls::Connect::new(ep, t.cfg.clone())
                    .connect_wrap(())
                    .await
                    .map_err(|e| Error::Datapath {
                        transport,
                        source: e,
                    })?,
            ),
            (Transport::Plain, _) => Connection::Plain(
                chunnel_net::tcp::Connect::new(ep)
                    .connect_wrap(())
                    .await
                    .map_err(|e| Error::Datapath {
                        transport,
                        source: e,
                    })?,
            ),
            (_, None) => {
                return Err(bad_accept(format!(
                    "the accept picks {transport}, which this client did not offer"
                )));
            }
        };
        self.check(&peer, conn, conn_id, &transcript, first).await
    }

    /// The shared QUIC client endpoint for connections to `to`'s address family, bound now
    /// if this is the first.
    fn quic_endpoint(&self, to: SocketAddr) -> Result<quinn::Endpoint, chunnel::Error> {
        let mut eps = self
            .quic_endpoints
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (slot, local): (usize, SocketAddr) = match to {
            SocketAddr::V4(_) => (0, (std::net::Ipv4Addr::UNSPECIFIED, 0).into()),
            SocketAddr::V6(_) => (1, (std::net::Ipv6Addr::UNSPECIFIED, 0).into()),
        };
        if let Some(ep) = &eps[slot] {
            return Ok(ep.clone());
        }
        let ep = quinn::Endpoint::client(local)
            .map_err(|e| chunnel::Error::from_io("bind", local, e))?;
        eps[slot] = Some(ep.clone());
        Ok(ep)
    }

    /// The BIND / BOUND exchange on the new datapath (docs/wire.md §16), with the
    /// application's `first` messages right behind the BIND on a secure pick, after the
    /// checked BOUND on plaintext.
    async fn check(
        &self,
        peer: &str,
        conn: Connection,
        conn_id: u64,
        mine: &Transcript,
        first: Vec<Bytes>,
    ) -> Result<Connection, Error> {
        let transport = conn.transport();
        let down = |tampered, detail: String| Error::Downgrade {
            peer: peer.to_string(),
            by: DetectedBy::Local,
            tampered,
            detail,
        };
        let hash = transcript_hash(mine);
        let bind = encode_bind(conn_id, &hash);
        let secure = transport.is_secure();
        let exchange = async {
            if secure {
                // One write: the BIND, then the application's first messages.
                conn.send(std::iter::once(bind).chain(first.iter().cloned()))
                    .await?;
            } else {
                conn.send_one(bind).await?;
            }
            conn.recv_one().await
        };
        let answer = match tokio::time::timeout(BIND_TIMEOUT, exchange).await {
            Ok(Ok(m)) if m.len() <= MAX_BOUND => m,
            Ok(Ok(_)) => return Err(down(Tampered::Unverified, "BOUND too large".into())),
            Ok(Err(e)) => {
                return Err(down(
                    Tampered::Unverified,
                    format!("no answer to the BIND on {transport}: {e}"),
                ));
            }
            Err(_) => {
                return Err(down(
                    Tampered::Unverified,
                    format!("no answer to the BIND within {BIND_TIMEOUT:?}"),
                ));
            }
        };
        let bound = Bound::decode(answer)
            .map_err(|e| down(Tampered::Unverified, format!("malformed BOUND: {e}")))?;
        // Over plaintext, the answer counts only if the server's key signed it — required
        // when this client offered a secure option (it has something to lose).
        let offered_secure = self.offers.iter().any(|t| t.is_secure());
        if transport == Transport::Plain && offered_secure {
            self.verify_signature(&bound, conn_id)
                .map_err(|d| down(Tampered::Unverified, d))?;
        }
        if let Some((what, detail)) = compare(mine, &bound.view) {
            return Err(down(
                if bound.status == Status::Unknown as u8 {
                    Tampered::Unknown
                } else {
                    what
                },
                detail,
            ));
        }
        match Status::from_u8(bound.status) {
            Some(Status::Agreed) => {
                if !secure && !first.is_empty() {
                    // Plaintext: the application's messages only now, after the check.
                    conn.send(first).await.map_err(|e| Error::Datapath {
                        transport,
                        source: e,
                    })?;
                }
                Ok(conn)
            }
            other => Err(down(
                Tampered::Unverified,
                format!("the server refused the binding ({other:?})"),
            )),
        }
    }

    /// Checks a plaintext BOUND's certificate chain and signature.
    fn verify_signature(&self, bound: &Bound, conn_id: u64) -> Result<(), String> {
        let Some(trust) = &self.trust else {
            return Err("no trust roots to check the server's signature with".into());
        };
        let Some((leaf, intermediates)) = bound.chain.split_first() else {
            return Err("plaintext pick without the server's signature".into());
        };
        trust
            .verifier
            .verify_server_cert(leaf, intermediates, &trust.name, &[], UnixTime::now())
            .map_err(|e| format!("the signing certificate is refused: {e}"))?;
        let scheme = SignatureScheme::from(bound.scheme);
        if !SCHEMES.contains(&scheme) {
            return Err(format!("unsupported signature scheme {scheme:?}"));
        }
        let algs = rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .mapping
            .iter()
            .find(|(s, _)| *s == scheme)
            .map(|(_, a)| *a)
            .unwrap_or(&[]);
        let cert = webpki::EndEntityCert::try_from(leaf)
            .map_err(|e| format!("the signing certificate cannot be parsed: {e}"))?;
        let msg = signed_message(&transcript_hash(&bound.view), bound.status, conn_id);
        if algs
            .iter()
            .any(|alg| cert.verify_signature(*alg, &msg, &bound.signature).is_ok())
        {
            Ok(())
        } else {
            Err("bad signature over the server's transcript".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_and_bound_round_trip() {
        let h = [7u8; 32];
        assert_eq!(decode_bind(&encode_bind(42, &h)), Some((42, h)));
        assert_eq!(decode_bind(&encode_bind(42, &h)[..40]), None);
        let b = Bound {
            status: 1,
            view: Transcript {
                hello: Bytes::from_static(b"\x01hello"),
                accept: Bytes::from_static(b"\x02accept"),
            },
            scheme: 0x0403,
            chain: vec![CertificateDer::from(vec![1, 2, 3])],
            signature: Bytes::from_static(b"sig"),
        };
        let d = Bound::decode(b.encode()).unwrap();
        assert_eq!((d.status, &d.view, d.scheme), (1, &b.view, 0x0403));
        assert_eq!(d.chain, b.chain);
        assert_eq!(d.signature, b.signature);
        // Every truncation is refused, never a panic.
        let e = b.encode();
        for n in 0..e.len() {
            assert!(Bound::decode(e.slice(..n)).is_err());
        }
    }

    #[test]
    fn the_hash_separates_hello_from_accept() {
        let t = |h: &'static [u8], a: &'static [u8]| Transcript {
            hello: Bytes::from_static(h),
            accept: Bytes::from_static(a),
        };
        assert_ne!(
            transcript_hash(&t(b"ab", b"c")),
            transcript_hash(&t(b"a", b"bc"))
        );
    }
}
