//! TLS 1.3 over TCP: length-framed messages (the framing of `chunnel_net::tcp`, see
//! [`chunnel_net::framed`]) inside a TLS 1.3 session driven by rustls with the ring provider.
//!
//! On the wire this is plain TLS 1.3 over TCP, with no negotiation bytes of its own: a stock
//! TLS client (`openssl s_client`, rustls) talks to a [`Listener`], and a [`Connect`] talks to
//! a stock TLS server, as long as the application data is framed as 4-byte big-endian length
//! plus message.
//!
//! * [`Connect`] is the client's base Chunnel (`Chunnel<()>`, like `tcp::Connect`).
//! * [`Listener`] is a `chunnel::Listener` (bound by [`Bind`], a `chunnel::Listen`): it runs up to `max_handshakes` handshakes at once
//!   in their own tasks, each bounded by the handshake timeout, so a stalled or hostile
//!   client never holds up the others. `accept` skips clients whose handshake failed (they
//!   are counted and the last ones kept, see [`Listener::take_failures`]);
//!   [`Listener::accept_client`] returns them one by one as typed errors.
//! * Both advertise [`ID`] and the exact capability [`capability`] (`secure` = `{tls13}`), so a
//!   negotiating peer pairs a TLS stack only with a TLS stack.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use chunnel::{Capability, Chunnel, ChunnelConnection, Negotiate, SendHeader};
use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector, TlsStream};

use crate::Error;
pub use crate::config::{ClientConfig, ServerConfig};

/// The stable id of the TLS datapath in negotiation.
pub const ID: &str = "chunnel/tls/1";
/// The kind of [`capability`].
pub const CAPABILITY_KIND: &str = "secure";
/// The label of [`capability`]: TLS 1.3.
pub const CAPABILITY_LABEL: &str = "tls13";
use crate::handshakes::Handshakes;
pub use crate::handshakes::KEPT_FAILURES;

/// The exact capability `secure` = `{tls13}`: this datapath encrypts and authenticates with
/// TLS 1.3. Exact, so both ends must have it: a TLS client is never paired with a plaintext
/// server or the reverse.
pub fn capability() -> Capability {
    Capability::exact(CAPABILITY_KIND, [CAPABILITY_LABEL])
}

/// A TLS stream whose I/O errors carry this crate's typed [`Error`] instead of a bare
/// rustls error.
struct Typed {
    io: TlsStream<TcpStream>,
    peer: Arc<str>,
}

impl Typed {
    fn map(&self, e: io::Error) -> io::Error {
        match Error::from_stream_io(&self.peer, &e) {
            Some(t) => io::Error::new(e.kind(), t),
            None => e,
        }
    }
}

impl AsyncRead for Typed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(this.map(e))),
            other => other,
        }
    }
}

impl AsyncWrite for Typed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_write(cx, buf) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(this.map(e))),
            other => other,
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_write_vectored(cx, bufs) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(this.map(e))),
            other => other,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_flush(cx) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(this.map(e))),
            other => other,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_shutdown(cx) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(this.map(e))),
            other => other,
        }
    }
}

type Framed = chunnel_net::framed::Connection<ReadHalf<Typed>, WriteHalf<Typed>>;

/// What the handshake settled, for the application (e.g. to authorize a client by its
/// certificate).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Session {
    /// The negotiated protocol version (always TLS 1.3 with this crate's configurations).
    pub version: Option<rustls::ProtocolVersion>,
    /// The negotiated cipher suite.
    pub cipher_suite: Option<rustls::CipherSuite>,
    /// The application protocol agreed by ALPN, if any.
    pub alpn: Option<Vec<u8>>,
    /// Whether the session was resumed from an earlier one (no certificate exchange).
    pub resumed: bool,
    /// The peer's certificate chain, leaf first: the server's on a client; on a server, the
    /// client's under mutual TLS (empty otherwise). Empty on a resumed client connection.
    pub peer_certificates: Vec<CertificateDer<'static>>,
}

impl Session {
    fn of(io: &TlsStream<TcpStream>) -> Self {
        let (_, st) = io.get_ref();
        Session {
            version: st.protocol_version(),
            cipher_suite: st.negotiated_cipher_suite().map(|s| s.suite()),
            alpn: st.alpn_protocol().map(<[u8]>::to_vec),
            resumed: st.handshake_kind() == Some(rustls::HandshakeKind::Resumed),
            peer_certificates: st
                .peer_certificates()
                .map(|c| c.iter().map(|c| c.clone().into_owned()).collect())
                .unwrap_or_default(),
        }
    }
}

/// A TLS connection carrying length-framed messages (client and server side alike).
///
/// `recv` and `send` report a TLS failure on the live connection (e.g. the server refusing
/// this client's certificate, which a TLS 1.3 client learns after its handshake) as
/// [`chunnel::Error::Io`] holding this crate's [`Error`]; find it with [`Error::find`].
pub struct Connection {
    inner: Framed,
    session: Session,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("tls::Connection")
            .field("peer", &self.inner.peer())
            .field("session", &self.session)
            .finish()
    }
}

impl Connection {
    fn new(io: TlsStream<TcpStream>, cfg: &chunnel_net::framed::Config, peer: String) -> Self {
        let session = Session::of(&io);
        let (r, w) = tokio::io::split(Typed {
            io,
            peer: peer.as_str().into(),
        });
        Connection {
            inner: Framed::new(r, w, cfg, peer),
            session,
        }
    }

    /// The peer's address, for messages.
    pub fn peer(&self) -> &str {
        self.inner.peer()
    }

    /// What the handshake settled.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Flushes what is pending, sends TLS `close_notify` and shuts the write direction: the
    /// peer's `recv` then fails with [`chunnel::Error::PeerClosed`] after the messages already
    /// sent.
    pub async fn close(&self) -> Result<(), chunnel::Error> {
        self.inner.close().await
    }
}

impl ChunnelConnection for Connection {
    type Data = Bytes;

    async fn send<B>(&self, burst: B) -> Result<(), chunnel::Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        self.inner.send(burst).await
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, chunnel::Error> {
        self.inner.recv(slots).await
    }
}

impl SendHeader for Connection {
    async fn send_with_header<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> Result<(), chunnel::Error>
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        self.inner.send_with_header(header, burst).await
    }
}

impl chunnel::PeerHandoff for Connection {
    /// A stream connection owns its transport: an address is never shared.
    fn hand_off(&self, _first: Bytes) -> bool {
        false
    }
}

/// As for the TCP datapath: no state to hand over (see `chunnel_net::framed`).
impl chunnel::Handover for Connection {
    fn export(&self, _: &mut chunnel::Handoff<Bytes>) {}
    fn import(&self, _: &mut chunnel::Handoff<Bytes>) {}
}

/// The error for a failed handshake I/O with `peer`.
fn handshake_err(peer: &str, e: io::Error) -> Error {
    if let Some(t) = Error::from_stream_io(peer, &e) {
        return t;
    }
    match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::NotConnected => Error::HandshakeEof {
            peer: peer.to_string(),
        },
        _ => Error::HandshakeIo {
            peer: peer.to_string(),
            source: e,
        },
    }
}

/// The base Chunnel of a TLS client: `connect_wrap(())` opens a TCP connection to `addr` and
/// runs the TLS 1.3 handshake, both bounded by the configuration's handshake timeout.
///
/// Clones share the configuration and so its session cache: a later connection to the same
/// server resumes the session ([`Session::resumed`]).
#[derive(Clone, Debug)]
pub struct Connect {
    addr: SocketAddr,
    cfg: ClientConfig,
}

impl Connect {
    /// Connects to `addr` with `cfg`.
    pub fn new(addr: SocketAddr, cfg: ClientConfig) -> Self {
        Connect { addr, cfg }
    }
}

impl Negotiate for Connect {
    fn id(&self) -> &'static str {
        ID
    }

    fn capabilities(&self) -> Vec<Capability> {
        vec![capability()]
    }
}

impl Chunnel<()> for Connect {
    type Connection = Connection;

    async fn connect_wrap(&mut self, (): ()) -> Result<Connection, chunnel::Error> {
        let addr = self.addr;
        let peer = addr.to_string();
        let after = self.cfg.handshake_timeout;
        let handshake = async {
            let tcp = TcpStream::connect(addr)
                .await
                .map_err(|e| chunnel::Error::from_io("connect", addr, e))?;
            tcp.set_nodelay(true).map_err(|e| chunnel::Error::Io {
                op: "set_nodelay",
                source: e,
            })?;
            let tls = TlsConnector::from(Arc::clone(&self.cfg.rustls))
                .connect(self.cfg.server_name.clone(), tcp)
                .await
                .map_err(|e| handshake_err(&peer, e))?;
            Ok::<_, chunnel::Error>(TlsStream::Client(tls))
        };
        let io = match tokio::time::timeout(after, handshake).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(Error::HandshakeTimeout {
                    peer: peer.clone(),
                    after,
                }
                .into());
            }
        };
        Ok(Connection::new(io, &self.cfg.framing, peer))
    }
}

/// The bind config of a TLS server: [`Listen::listen`](chunnel::Listen::listen) binds `addr`
/// and serves TLS with the server configuration ([`Listener::bind`]). Offers what the
/// [`Listener`] does (id [`ID`], exact capability `secure` {tls13}).
#[derive(Clone, Debug)]
pub struct Bind {
    addr: SocketAddr,
    cfg: ServerConfig,
}

impl Bind {
    /// Binds `addr` (port 0: the kernel picks one) and serves TLS with `cfg`.
    pub fn new(addr: SocketAddr, cfg: ServerConfig) -> Self {
        Bind { addr, cfg }
    }
}

impl Negotiate for Bind {
    fn id(&self) -> &'static str {
        ID
    }

    fn capabilities(&self) -> Vec<Capability> {
        vec![capability()]
    }
}

impl chunnel::Listen for Bind {
    type Listener = Listener;

    fn listen(&self) -> impl Future<Output = Result<Listener, chunnel::Error>> + Send {
        Listener::bind(self.addr, self.cfg.clone())
    }
}

/// A TLS server socket handing out one [`Connection`] per client whose handshake succeeded.
pub struct Listener {
    tcp: TcpListener,
    cfg: ServerConfig,
    handshakes: Handshakes<TlsStream<TcpStream>>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("tls::Listener")
            .field("local_addr", &self.tcp.local_addr().ok())
            .field("handshakes_in_progress", &self.handshakes.in_progress())
            .field("failed_handshakes", &self.handshakes.failed())
            .finish_non_exhaustive()
    }
}

impl Listener {
    /// Binds `addr` and serves TLS with `cfg`.
    pub async fn bind(addr: SocketAddr, cfg: ServerConfig) -> Result<Self, chunnel::Error> {
        let tcp = TcpListener::bind(addr)
            .await
            .map_err(|e| chunnel::Error::from_io("bind", addr, e))?;
        Ok(Listener {
            tcp,
            cfg,
            handshakes: Handshakes::new(),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, chunnel::Error> {
        self.tcp.local_addr().map_err(|e| chunnel::Error::Io {
            op: "local_addr",
            source: e,
        })
    }

    /// How many client handshakes have failed since the listener was bound.
    pub fn failed_handshakes(&self) -> u64 {
        self.handshakes.failed()
    }

    /// The last failed handshakes that [`chunnel::Listener::accept`] skipped (at most
    /// [`KEPT_FAILURES`], oldest first), emptying the list.
    pub fn take_failures(&mut self) -> Vec<Error> {
        self.handshakes.take_failures()
    }

    /// Waits for the next client whose handshake finished: `Ok(Ok(connection))`, or
    /// `Ok(Err(error))` for a client whose handshake failed (the listener keeps serving).
    /// `Err` only when the listening socket itself fails.
    ///
    /// Cancel safe: handshakes run in their own tasks and a finished one is never lost.
    pub async fn accept_client(&mut self) -> Result<Result<Connection, Error>, chunnel::Error> {
        loop {
            let room = self.handshakes.in_progress() < self.cfg.max_handshakes;
            tokio::select! {
                biased;
                (peer, done) = self.handshakes.finished() => {
                    return Ok(done.map(|io| Connection::new(io, &self.cfg.framing, peer)));
                }
                r = self.tcp.accept(), if room => match r {
                    Ok((tcp, addr)) => self.start(tcp, addr),
                    // A peer that reset before we accepted it must not stop the listener.
                    Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => continue,
                    Err(e) => {
                        return Err(chunnel::Error::Io {
                            op: "accept",
                            source: e,
                        });
                    }
                },
            }
        }
    }

    fn start(&mut self, tcp: TcpStream, addr: SocketAddr) {
        let acceptor = TlsAcceptor::from(Arc::clone(&self.cfg.rustls));
        let after = self.cfg.handshake_timeout;
        let peer = addr.to_string();
        let at = peer.clone();
        self.handshakes.spawn(peer, after, async move {
            // Small messages must not wait for Nagle; failure to set it is harmless.
            let _ = tcp.set_nodelay(true);
            match acceptor.accept(tcp).await {
                Ok(s) => Ok(TlsStream::Server(s)),
                Err(e) => Err(handshake_err(&at, e)),
            }
        });
    }
}

impl Negotiate for Listener {
    fn id(&self) -> &'static str {
        ID
    }

    fn capabilities(&self) -> Vec<Capability> {
        vec![capability()]
    }
}

impl chunnel::Listener for Listener {
    type Connection = Connection;

    /// The next client whose handshake succeeded. Failed handshakes are skipped, counted
    /// ([`Listener::failed_handshakes`]) and kept ([`Listener::take_failures`]).
    async fn accept(&mut self) -> Result<Connection, chunnel::Error> {
        loop {
            match self.accept_client().await? {
                Ok(c) => return Ok(c),
                Err(e) => self.handshakes.keep(e),
            }
        }
    }
}
