//! QUIC (RFC 9000, quinn with rustls's ring provider) as a datapath, in one of two modes a
//! stack states up front ([`Mode`]):
//!
//! * [`Mode::Stream`], id [`STREAM_ID`]: reliable, ordered messages on **one bidirectional
//!   QUIC stream** that the client opens, framed exactly like `chunnel_net::tcp` and
//!   [`crate::tls`] (4-byte big-endian length, then the message; see
//!   [`chunnel_net::framed`]). Flow control bounds what a sender may have in flight: a peer
//!   that stops reading makes `send` wait, it never makes the sender's memory grow. A QUIC
//!   stream exists for the peer only once bytes flow on it, so the **client speaks first**:
//!   a server's `send` or `recv` waits until the client's first message opens the stream.
//! * [`Mode::Datagram`], id [`DATAGRAM_ID`]: unreliable, unordered messages, **one message per
//!   QUIC DATAGRAM frame** (RFC 9221) with no framing of its own. A message larger than the
//!   connection's current [`Connection::max_datagram_size`] fails with
//!   [`chunnel::Error::MessageTooLarge`]; a peer without datagram support fails the
//!   connection with [`Error::DatagramsUnsupported`].
//!
//! ```text
//!   application messages            application messages
//!          │  Mode::Stream                  │  Mode::Datagram
//!   [len u32 BE | message]…         one message = one DATAGRAM frame
//!   one bidirectional stream                │
//!          └──────────── QUIC v1 (TLS 1.3 handshake, packet protection) ── UDP
//! ```
//!
//! [`Connect`] is the client's base Chunnel (`Chunnel<()>`) and [`Listener`] a
//! `chunnel::Listener` (bound by [`Bind`], a `chunnel::Listen`). They take the same
//! [`ClientConfig`] and [`ServerConfig`] as [`crate::tls`] (certificates, trust roots, server
//! name, ALPN, mutual TLS, handshake timeout, largest framed message, handshake concurrency);
//! [`ClientConfig::to_quinn`] and [`ServerConfig::to_quinn`] turn them into quinn
//! configurations for code that drives quinn itself. Handshake failures are the same typed [`Error`]s as over TCP (QUIC carries the TLS
//! alert in its close code), plus [`Error::Quic`] for the rest.
//!
//! On the wire this is plain QUIC v1: a quinn client that opens one bidirectional stream and
//! writes length-framed messages talks to a [`Listener`] in stream mode, and a [`Connect`]
//! talks to a plain quinn server that accepts that stream (see `tests/quic.rs`).
//!
//! ## Negotiation
//!
//! Both ends advertise the mode's id and three exact capabilities ([`Mode::capabilities`]):
//! `secure` = `{tls13}` (the same as [`crate::tls::capability`]: QUIC's handshake is TLS
//! 1.3), `quic` = `{v1}` (so a QUIC option never pairs with TLS over TCP), and `delivery` =
//! `{ordered, reliable}` in stream mode or `{unreliable}` in datagram mode (so the two modes
//! never pair, and a stack can read off what the datapath already provides: a stream-mode
//! stack needs no `Reliable`, `Ordered` or TLS Chunnel on top).
//!
//! ## 0-RTT is off
//!
//! The configurations of this crate disable TLS early data (client `enable_early_data` false,
//! server `max_early_data_size` 0), so QUIC 0-RTT is off and every connection's first
//! message waits for the 1-RTT handshake. 0-RTT data is not protected against replay: an
//! attacker who records a client's first flight can replay it, and the server would act on
//! it twice. An application that wants it builds its rustls configurations itself
//! ([`ClientConfig::from_rustls`], [`ServerConfig::from_rustls`]; quinn requires
//! `max_early_data_size` = `u32::MAX` on the server) and drives quinn's `into_0rtt` directly,
//! sending only idempotent requests early.
//!
//! ## Connection migration
//!
//! As quinn gives it: a [`Listener`] accepts a client whose address changes (NAT rebinding,
//! a new network): quinn validates the new path and the connection carries on
//! (`quinn::ServerConfig::migration`, on by default). A client moves its connections to a
//! new local socket with `quinn::Endpoint::rebind` on [`Connect::endpoint`]. Only the client
//! migrates (QUIC v1 has no server migration).
//!
//! ## Closing
//!
//! Dropping the last handle of a QUIC connection closes it at once, and data not yet
//! acknowledged may be lost. [`Connection::close`] delivers first: in stream mode it finishes
//! the stream and waits until the peer has acknowledged every byte; the peer's `recv` then
//! fails with [`chunnel::Error::PeerClosed`] after the messages already sent. A peer that
//! has vanished makes it wait until the idle timeout (quinn's default: 30 s) fails it.
//!
//! ## Cancel safety
//!
//! `recv` is cancel safe in datagram mode, and in stream mode as for
//! [`chunnel_net::framed`] (bytes read stay buffered). A cancelled stream-mode `send` may
//! still deliver its burst, whole frames only, with the next `send`; a cancelled
//! datagram-mode `send` has sent a prefix of its burst. [`Listener::accept_client`] is cancel
//! safe.
//!
//! ## Example
//!
//! ```
//! use chunnel::{Chunnel, ConnectionExt, Listener as _};
//! use chunnel_secure::quic::{self, Mode};
//! use chunnel_secure::{ClientConfig, Identity, ServerConfig, TrustRoots};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cert = rcgen::generate_simple_self_signed(["localhost".to_string()])?;
//! let identity = Identity::from_pem(cert.cert.pem().as_bytes(), cert.signing_key.serialize_pem().as_bytes())?;
//! let roots = TrustRoots::from_pem(cert.cert.pem().as_bytes())?;
//!
//! let mut listener = quic::Listener::bind(
//!     "127.0.0.1:0".parse()?,
//!     ServerConfig::builder(identity).alpn(["echo/1"]).build()?,
//!     Mode::Stream,
//! )?;
//! let client_cfg = ClientConfig::builder(roots, "localhost").alpn(["echo/1"]).build()?;
//! let mut connect = quic::Connect::new(listener.local_addr()?, client_cfg, Mode::Stream);
//!
//! let (client, server) = tokio::join!(connect.connect_wrap(()), listener.accept());
//! let (client, server) = (client?, server?);
//! client.send_one("ping".into()).await?;
//! let got = server.recv_one().await?;
//! server.send_one(got).await?;
//! assert_eq!(client.recv_one().await?, "ping");
//! assert_eq!(client.session().alpn.as_deref(), Some(&b"echo/1"[..]));
//! client.close().await?;
//! # Ok(()) }
//! ```

use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use chunnel::{Capability, Chunnel, ChunnelConnection, Negotiate, SendHeader};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::OnceCell;

pub use crate::config::{ClientConfig, ServerConfig};
use crate::{DetectedBy, Error};

/// The negotiation id of the stream mode.
pub const STREAM_ID: &str = "chunnel/quic-stream/1";
/// The negotiation id of the datagram mode.
pub const DATAGRAM_ID: &str = "chunnel/quic-dgram/1";
/// The kind of the capability naming the QUIC version, labelled [`QUIC_V1`].
pub const CAPABILITY_KIND: &str = "quic";
/// The label of QUIC version 1 (RFC 9000).
pub const QUIC_V1: &str = "v1";
/// The kind of the capability saying what a mode delivers.
pub const DELIVERY_KIND: &str = "delivery";
use crate::handshakes::Handshakes;
pub use crate::handshakes::KEPT_FAILURES;

/// The QUIC application error code [`Connection::close`] sends (0: no error).
const CLOSE_OK: u32 = 0;

/// Which service a QUIC connection gives the stack above it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Unreliable, unordered messages, one per QUIC DATAGRAM frame.
    Datagram,
    /// Reliable, ordered, length-framed messages on one bidirectional stream.
    Stream,
}

impl Mode {
    /// The negotiation id: [`STREAM_ID`] or [`DATAGRAM_ID`].
    pub fn id(self) -> &'static str {
        match self {
            Mode::Datagram => DATAGRAM_ID,
            Mode::Stream => STREAM_ID,
        }
    }

    /// The capabilities both ends advertise: `secure` = `{tls13}`, `quic` = `{v1}` and
    /// `delivery` = `{ordered, reliable}` (stream) or `{unreliable}` (datagram), all exact.
    pub fn capabilities(self) -> Vec<Capability> {
        let delivery: &[&'static str] = match self {
            Mode::Datagram => &["unreliable"],
            Mode::Stream => &["ordered", "reliable"],
        };
        vec![
            crate::tls::capability(),
            Capability::exact(CAPABILITY_KIND, [QUIC_V1]),
            Capability::exact(DELIVERY_KIND, delivery.iter().copied()),
        ]
    }

    /// The transport settings this crate uses for `side` in this mode: quinn's defaults,
    /// except that a server accepts exactly one bidirectional stream from each client in
    /// stream mode and none in datagram mode, and no end accepts unidirectional streams or
    /// streams the server opens (nothing here would read them).
    pub fn transport(self, side: quinn::Side) -> quinn::TransportConfig {
        let mut t = quinn::TransportConfig::default();
        let bidi = match (side, self) {
            (quinn::Side::Server, Mode::Stream) => 1u8,
            _ => 0,
        };
        t.max_concurrent_bidi_streams(bidi.into())
            .max_concurrent_uni_streams(0u8.into());
        t
    }
}

fn config_err(what: impl std::fmt::Display) -> Error {
    Error::Config {
        what: what.to_string(),
    }
}

impl ClientConfig {
    /// This configuration as a quinn client configuration (the same rustls configuration:
    /// trust roots, ALPN, client certificate, session cache), with the transport settings of
    /// [`Mode::transport`].
    pub fn to_quinn(&self, mode: Mode) -> Result<quinn::ClientConfig, Error> {
        let crypto = QuicClientConfig::try_from(Arc::clone(&self.rustls))
            .map_err(|e| config_err(format!("QUIC client: {e}")))?;
        let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
        cfg.transport_config(Arc::new(mode.transport(quinn::Side::Client)));
        Ok(cfg)
    }
}

impl ServerConfig {
    /// This configuration as a quinn server configuration (the same rustls configuration:
    /// identity, client authentication, ALPN), with the transport settings of
    /// [`Mode::transport`], at most `max_handshakes` connection attempts queued before they
    /// are refused, and client migration on.
    pub fn to_quinn(&self, mode: Mode) -> Result<quinn::ServerConfig, Error> {
        let crypto = QuicServerConfig::try_from(Arc::clone(&self.rustls))
            .map_err(|e| config_err(format!("QUIC server: {e}")))?;
        let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        cfg.transport_config(Arc::new(mode.transport(quinn::Side::Server)))
            .max_incoming(self.max_handshakes)
            .migration(true);
        Ok(cfg)
    }
}

/// What the handshake settled, for the application.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Session {
    /// The application protocol agreed by ALPN, if any.
    pub alpn: Option<Vec<u8>>,
    /// On a server, the name the client asked for (SNI), if any.
    pub server_name: Option<String>,
    /// The peer's certificate chain, leaf first: the server's on a client; on a server, the
    /// client's under mutual TLS (empty otherwise).
    pub peer_certificates: Vec<CertificateDer<'static>>,
}

impl Session {
    fn of(conn: &quinn::Connection) -> Self {
        let hs = conn
            .handshake_data()
            .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok());
        let certs = conn
            .peer_identity()
            .and_then(|d| d.downcast::<Vec<CertificateDer<'static>>>().ok());
        Session {
            alpn: hs.as_ref().and_then(|h| h.protocol.clone()),
            server_name: hs.and_then(|h| h.server_name),
            peer_certificates: certs.map(|c| *c).unwrap_or_default(),
        }
    }
}

/// The chunnel error for a failed QUIC connection: a close by either application is the end
/// of the connection, anything else this crate's typed [`Error`].
fn conn_err(peer: &str, id: &'static str, e: quinn::ConnectionError) -> chunnel::Error {
    use quinn::ConnectionError as C;
    match e {
        C::ApplicationClosed(_) | C::Reset => chunnel::Error::PeerClosed,
        C::LocallyClosed => chunnel::Error::Closed,
        e => Error::from_quic(peer, e).at(id),
    }
}

/// The I/O error handed to the framing for a stream error: a typed [`Error`] inside (kind
/// `Other`, so that `chunnel::Error::from_io` keeps it as [`chunnel::Error::Io`]) when the
/// connection failed, else the stream's own error (a close maps to
/// [`chunnel::Error::PeerClosed`]).
fn stream_io_err(peer: &str, e: io::Error) -> io::Error {
    use quinn::ConnectionError as C;
    let lost = match e.get_ref() {
        Some(i) => match (
            i.downcast_ref::<quinn::ReadError>(),
            i.downcast_ref::<quinn::WriteError>(),
        ) {
            (Some(quinn::ReadError::ConnectionLost(c)), _)
            | (_, Some(quinn::WriteError::ConnectionLost(c))) => Some(c.clone()),
            _ => None,
        },
        None => None,
    };
    match lost {
        Some(C::ApplicationClosed(_) | C::Reset) => io::Error::new(io::ErrorKind::NotConnected, e),
        Some(C::LocallyClosed) => io::Error::new(io::ErrorKind::NotConnected, e),
        Some(c) => io::Error::other(Error::from_quic(peer, c)),
        None => e,
    }
}

/// The receiving half of the message stream, with typed errors.
struct RecvHalf {
    io: quinn::RecvStream,
    peer: Arc<str>,
}

impl AsyncRead for RecvHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match AsyncRead::poll_read(Pin::new(&mut this.io), cx, buf) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(stream_io_err(&this.peer, e))),
            other => other,
        }
    }
}

type Stopped =
    Pin<Box<dyn Future<Output = Result<Option<quinn::VarInt>, quinn::StoppedError>> + Send + Sync>>;

/// The sending half of the message stream, with typed errors; its shutdown finishes the
/// stream and waits until the peer has acknowledged all of it.
struct SendHalf {
    io: quinn::SendStream,
    peer: Arc<str>,
    stopped: Option<Stopped>,
}

impl AsyncWrite for SendHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match AsyncWrite::poll_write(Pin::new(&mut this.io), cx, buf) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(stream_io_err(&this.peer, e))),
            other => other,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.stopped.is_none() {
            // Finishing twice is an error of ours, not of the peer: ignore it.
            let _ = this.io.finish();
            this.stopped = Some(Box::pin(this.io.stopped()));
        }
        let Some(stopped) = this.stopped.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        match stopped.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            // Acknowledged in full, or stopped by the peer (it wants no more): done.
            Poll::Ready(Ok(_)) => Poll::Ready(Ok(())),
            Poll::Ready(Err(quinn::StoppedError::ConnectionLost(c))) => {
                let e = io::Error::new(
                    io::ErrorKind::NotConnected,
                    quinn::WriteError::ConnectionLost(c),
                );
                Poll::Ready(Err(stream_io_err(&this.peer, e)))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(io::Error::new(io::ErrorKind::NotConnected, e))),
        }
    }
}

type Framed = chunnel_net::framed::Connection<RecvHalf, SendHalf>;

enum Inner {
    /// The message stream: opened by the client at connect, accepted by the server when
    /// first used (a QUIC stream exists for the peer only once data flows on it).
    Stream {
        framed: Box<OnceCell<Framed>>,
        cfg: chunnel_net::framed::Config,
    },
    Datagram,
}

/// A QUIC connection carrying messages in one [`Mode`] (client and server side alike).
///
/// Failures of the connection (the peer refusing this end's certificate after the client's
/// handshake, an idle timeout, a protocol violation) reach `send` and `recv` as this crate's
/// [`Error`]; find it with [`Error::find`]. A close by the peer's application is
/// [`chunnel::Error::PeerClosed`].
pub struct Connection {
    conn: quinn::Connection,
    inner: Inner,
    mode: Mode,
    session: Session,
    peer: String,
    /// Keeps the endpoint (its socket and driver) alive while the connection lives.
    _endpoint: quinn::Endpoint,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("quic::Connection")
            .field("peer", &self.peer)
            .field("mode", &self.mode)
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

impl Connection {
    fn new(
        conn: quinn::Connection,
        endpoint: quinn::Endpoint,
        mode: Mode,
        streams: Option<(quinn::SendStream, quinn::RecvStream)>,
        cfg: &chunnel_net::framed::Config,
    ) -> Self {
        let peer = conn.remote_address().to_string();
        let inner = match mode {
            Mode::Datagram => Inner::Datagram,
            Mode::Stream => {
                let framed = match streams {
                    Some((s, r)) => OnceCell::new_with(Some(frame(&peer, s, r, cfg))),
                    None => OnceCell::new(),
                };
                Inner::Stream {
                    framed: Box::new(framed),
                    cfg: cfg.clone(),
                }
            }
        };
        Connection {
            session: Session::of(&conn),
            conn,
            inner,
            mode,
            peer,
            _endpoint: endpoint,
        }
    }

    /// The peer's address (its current one: it changes when the client migrates).
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The mode of this connection.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// What the handshake settled.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The quinn connection (statistics, RTT, the peer's current address, keying material
    /// exporter). Opening other streams on it is the application's business; this datapath
    /// uses only its one stream or its datagrams.
    pub fn quinn(&self) -> &quinn::Connection {
        &self.conn
    }

    /// The largest message the datagram mode can send right now (it follows the path MTU);
    /// `None` when the peer does not accept datagrams.
    pub fn max_datagram_size(&self) -> Option<usize> {
        self.conn.max_datagram_size()
    }

    /// Closes gracefully. Stream mode: sends what is pending, finishes the stream and waits
    /// until the peer has acknowledged everything (the peer's `recv` then fails with
    /// [`chunnel::Error::PeerClosed`] after the messages already sent); a server whose
    /// client never opened the stream closes the connection. Datagram mode: closes the
    /// connection (application code 0); datagrams still queued may be lost, as any datagram
    /// may. Later sends fail.
    pub async fn close(&self) -> Result<(), chunnel::Error> {
        match &self.inner {
            Inner::Stream { framed, .. } => match framed.get() {
                Some(f) => f.close().await,
                None => {
                    self.conn.close(CLOSE_OK.into(), b"");
                    Ok(())
                }
            },
            Inner::Datagram => {
                self.conn.close(CLOSE_OK.into(), b"");
                Ok(())
            }
        }
    }

    /// The message stream, accepting it first on a server.
    async fn framed(&self) -> Result<&Framed, chunnel::Error> {
        let Inner::Stream { framed, cfg } = &self.inner else {
            return Err(chunnel::Error::BadPick {
                what: "a datagram-mode QUIC connection has no stream",
            });
        };
        framed
            .get_or_try_init(|| async {
                let (s, r) = self
                    .conn
                    .accept_bi()
                    .await
                    .map_err(|e| conn_err(&self.peer, STREAM_ID, e))?;
                Ok(frame(&self.peer, s, r, cfg))
            })
            .await
    }

    fn datagram_err(&self, e: quinn::SendDatagramError, len: usize) -> chunnel::Error {
        use quinn::SendDatagramError as S;
        let peer = self.peer.clone();
        match e {
            S::UnsupportedByPeer => Error::DatagramsUnsupported {
                peer,
                by: DetectedBy::Peer,
            }
            .at(DATAGRAM_ID),
            S::Disabled => Error::DatagramsUnsupported {
                peer,
                by: DetectedBy::Local,
            }
            .at(DATAGRAM_ID),
            S::TooLarge => chunnel::Error::MessageTooLarge {
                len,
                max: self.conn.max_datagram_size().unwrap_or(0),
            },
            S::ConnectionLost(c) => conn_err(&self.peer, DATAGRAM_ID, c),
        }
    }

    async fn send_datagrams(
        &self,
        header: &[u8],
        burst: impl Iterator<Item = Bytes>,
    ) -> Result<(), chunnel::Error> {
        for m in burst {
            let len = header.len() + m.len();
            let max = self.conn.max_datagram_size().ok_or_else(|| {
                Error::DatagramsUnsupported {
                    peer: self.peer.clone(),
                    by: DetectedBy::Peer,
                }
                .at(DATAGRAM_ID)
            })?;
            if len > max {
                return Err(chunnel::Error::MessageTooLarge { len, max });
            }
            let d = if header.is_empty() {
                m
            } else {
                let mut b = BytesMut::with_capacity(len);
                b.put_slice(header);
                b.put_slice(&m);
                b.freeze()
            };
            // Waits while quinn's datagram send buffer is full (congestion), instead of
            // dropping the oldest queued datagram.
            self.conn
                .send_datagram_wait(d)
                .await
                .map_err(|e| self.datagram_err(e, len))?;
        }
        Ok(())
    }

    async fn recv_datagrams(&self, slots: &mut [Option<Bytes>]) -> Result<usize, chunnel::Error> {
        let first = self
            .conn
            .read_datagram()
            .await
            .map_err(|e| conn_err(&self.peer, DATAGRAM_ID, e))?;
        slots[0] = Some(first);
        let mut n = 1;
        // Take what else is already queued, without waiting.
        while n < slots.len() {
            let mut next = std::pin::pin!(self.conn.read_datagram());
            match std::future::poll_fn(|cx| Poll::Ready(next.as_mut().poll(cx))).await {
                Poll::Ready(Ok(d)) => {
                    slots[n] = Some(d);
                    n += 1;
                }
                // An error is reported by the next `recv`.
                _ => break,
            }
        }
        Ok(n)
    }
}

fn frame(
    peer: &str,
    s: quinn::SendStream,
    r: quinn::RecvStream,
    cfg: &chunnel_net::framed::Config,
) -> Framed {
    let p: Arc<str> = peer.into();
    Framed::new(
        RecvHalf {
            io: r,
            peer: Arc::clone(&p),
        },
        SendHalf {
            io: s,
            peer: p,
            stopped: None,
        },
        cfg,
        peer.to_string(),
    )
}

impl ChunnelConnection for Connection {
    type Data = Bytes;

    async fn send<B>(&self, burst: B) -> Result<(), chunnel::Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        self.send_with_header(&[], burst).await
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, chunnel::Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        match self.mode {
            Mode::Stream => self.framed().await?.recv(slots).await,
            Mode::Datagram => self.recv_datagrams(slots).await,
        }
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
        match self.mode {
            Mode::Stream => self.framed().await?.send_with_header(header, burst).await,
            Mode::Datagram => self.send_datagrams(header, burst.into_iter()).await,
        }
    }
}

impl chunnel::PeerHandoff for Connection {
    /// A QUIC connection owns its transport: an address is never shared.
    fn hand_off(&self, _first: Bytes) -> bool {
        false
    }
}

/// No state to hand over: in stream mode as for `chunnel_net::framed`; in datagram mode
/// quinn's queue of received datagrams stays with the connection.
impl chunnel::Handover for Connection {
    fn export(&self, _: &mut chunnel::Handoff<Bytes>) {}
    fn import(&self, _: &mut chunnel::Handoff<Bytes>) {}
}

/// The base Chunnel of a QUIC client: `connect_wrap(())` runs the QUIC handshake with the
/// server at `addr` (bounded by the configuration's handshake timeout) and, in stream mode,
/// opens the message stream.
///
/// The first `connect_wrap` binds a UDP endpoint on an ephemeral port of the server's
/// address family ([`Connect::with_endpoint`] gives one instead); later ones, and clones made
/// after it, share it. Clones share the configuration and its TLS session cache.
#[derive(Clone, Debug)]
pub struct Connect {
    addr: SocketAddr,
    cfg: ClientConfig,
    mode: Mode,
    endpoint: Option<quinn::Endpoint>,
    quinn: Option<quinn::ClientConfig>,
}

impl Connect {
    /// Connects to `addr` with `cfg`, in `mode`.
    pub fn new(addr: SocketAddr, cfg: ClientConfig, mode: Mode) -> Self {
        Connect {
            addr,
            cfg,
            mode,
            endpoint: None,
            quinn: None,
        }
    }

    /// Connects from this quinn endpoint (e.g. one bound to a chosen address, or shared with
    /// other code).
    pub fn with_endpoint(mut self, endpoint: quinn::Endpoint) -> Self {
        self.endpoint = Some(endpoint);
        self
    }

    /// Uses these quinn transport settings instead of [`Mode::transport`]'s (windows,
    /// datagram buffers, idle timeout, keep-alive).
    pub fn with_transport(mut self, transport: quinn::TransportConfig) -> Result<Self, Error> {
        let mut q = self.cfg.to_quinn(self.mode)?;
        q.transport_config(Arc::new(transport));
        self.quinn = Some(q);
        Ok(self)
    }

    /// The endpoint, once the first connection made (or given) it: rebind it to migrate
    /// every connection to a new local socket.
    pub fn endpoint(&self) -> Option<&quinn::Endpoint> {
        self.endpoint.as_ref()
    }

    fn setup(&mut self) -> Result<(quinn::Endpoint, quinn::ClientConfig), chunnel::Error> {
        let id = self.mode.id();
        if self.quinn.is_none() {
            self.quinn = Some(self.cfg.to_quinn(self.mode).map_err(|e| e.at(id))?);
        }
        if self.endpoint.is_none() {
            let local: SocketAddr = match self.addr {
                SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
                SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
            };
            let ep = quinn::Endpoint::client(local)
                .map_err(|e| chunnel::Error::from_io("bind", local, e))?;
            self.endpoint = Some(ep);
        }
        match (&self.endpoint, &self.quinn) {
            (Some(e), Some(q)) => Ok((e.clone(), q.clone())),
            _ => Err(chunnel::Error::Closed),
        }
    }
}

impl Negotiate for Connect {
    fn id(&self) -> &'static str {
        self.mode.id()
    }

    fn capabilities(&self) -> Vec<Capability> {
        self.mode.capabilities()
    }
}

impl Chunnel<()> for Connect {
    type Connection = Connection;

    async fn connect_wrap(&mut self, (): ()) -> Result<Connection, chunnel::Error> {
        let (endpoint, qcfg) = self.setup()?;
        let (addr, mode, id) = (self.addr, self.mode, self.mode.id());
        let peer = addr.to_string();
        let after = self.cfg.handshake_timeout;
        let name = self.cfg.server_name.to_str();
        let connecting = endpoint.connect_with(qcfg, addr, &name).map_err(|source| {
            Error::QuicConnect {
                peer: peer.clone(),
                source,
            }
            .at(id)
        })?;
        let handshake = async {
            let conn = connecting
                .await
                .map_err(|e| Error::from_quic(&peer, e).at(id))?;
            let streams = match mode {
                Mode::Stream => Some(conn.open_bi().await.map_err(|e| conn_err(&peer, id, e))?),
                Mode::Datagram => {
                    check_datagrams(&conn, &peer).map_err(|e| e.at(id))?;
                    None
                }
            };
            Ok::<_, chunnel::Error>((conn, streams))
        };
        let (conn, streams) = match tokio::time::timeout(after, handshake).await {
            Ok(r) => r?,
            Err(_) => return Err(Error::HandshakeTimeout { peer, after }.at(id)),
        };
        Ok(Connection::new(
            conn,
            endpoint,
            mode,
            streams,
            &self.cfg.framing,
        ))
    }
}

/// Datagram mode needs DATAGRAM frames both ways; a connection without them is closed.
fn check_datagrams(conn: &quinn::Connection, peer: &str) -> Result<(), Error> {
    if conn.max_datagram_size().is_some() {
        return Ok(());
    }
    conn.close(CLOSE_OK.into(), b"datagrams unsupported");
    Err(Error::DatagramsUnsupported {
        peer: peer.to_string(),
        by: DetectedBy::Peer,
    })
}

/// The bind config of a QUIC server: [`Listen::listen`](chunnel::Listen::listen) binds a UDP
/// socket on `addr` and serves QUIC in `mode` ([`Listener::bind`]; needs a tokio runtime).
/// Offers what the [`Listener`] does (the mode's id and capabilities).
#[derive(Clone, Debug)]
pub struct Bind {
    addr: SocketAddr,
    cfg: ServerConfig,
    mode: Mode,
}

impl Bind {
    /// Binds `addr` (port 0: the kernel picks one) and serves QUIC in `mode` with `cfg`.
    pub fn new(addr: SocketAddr, cfg: ServerConfig, mode: Mode) -> Self {
        Bind { addr, cfg, mode }
    }
}

impl Negotiate for Bind {
    fn id(&self) -> &'static str {
        self.mode.id()
    }

    fn capabilities(&self) -> Vec<Capability> {
        self.mode.capabilities()
    }
}

impl chunnel::Listen for Bind {
    type Listener = Listener;

    async fn listen(&self) -> Result<Listener, chunnel::Error> {
        Listener::bind(self.addr, self.cfg.clone(), self.mode)
    }
}

/// A QUIC server endpoint handing out one [`Connection`] per client whose handshake
/// succeeded.
///
/// Up to `max_handshakes` handshakes run at once, each in its own task and bounded by the
/// handshake timeout; finished ones wait for [`chunnel::Listener::accept`] in the same bounded
/// set, and while it is full further connection attempts queue in quinn (at most
/// `max_handshakes` of them, the rest refused). A client's failure never stops the listener.
pub struct Listener {
    endpoint: quinn::Endpoint,
    cfg: ServerConfig,
    mode: Mode,
    handshakes: Handshakes<quinn::Connection>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("quic::Listener")
            .field("local_addr", &self.endpoint.local_addr().ok())
            .field("mode", &self.mode)
            .field("handshakes_in_progress", &self.handshakes.in_progress())
            .field("failed_handshakes", &self.handshakes.failed())
            .finish_non_exhaustive()
    }
}

impl Listener {
    /// Binds a UDP socket on `addr` and serves QUIC in `mode` with `cfg`. Needs a tokio
    /// runtime (quinn spawns the endpoint's driver).
    pub fn bind(addr: SocketAddr, cfg: ServerConfig, mode: Mode) -> Result<Self, chunnel::Error> {
        let q = cfg.to_quinn(mode).map_err(|e| e.at(mode.id()))?;
        let endpoint = quinn::Endpoint::server(q, addr)
            .map_err(|e| chunnel::Error::from_io("bind", addr, e))?;
        Ok(Self::from_endpoint(endpoint, cfg, mode))
    }

    /// Serves on an endpoint made elsewhere (its server configuration is used as it is,
    /// e.g. one from [`ServerConfig::to_quinn`] with other transport settings); `cfg` gives
    /// the handshake timeout, the concurrency bound and the framing.
    pub fn from_endpoint(endpoint: quinn::Endpoint, cfg: ServerConfig, mode: Mode) -> Self {
        Listener {
            endpoint,
            cfg,
            mode,
            handshakes: Handshakes::new(),
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, chunnel::Error> {
        self.endpoint.local_addr().map_err(|e| chunnel::Error::Io {
            op: "local_addr",
            source: e,
        })
    }

    /// The quinn endpoint.
    pub fn endpoint(&self) -> &quinn::Endpoint {
        &self.endpoint
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
    /// `Err` only when the endpoint itself is closed.
    ///
    /// Cancel safe: handshakes run in their own tasks and a finished one is never lost.
    pub async fn accept_client(&mut self) -> Result<Result<Connection, Error>, chunnel::Error> {
        loop {
            let room = self.handshakes.in_progress() < self.cfg.max_handshakes;
            tokio::select! {
                biased;
                (_, done) = self.handshakes.finished() => {
                    return Ok(done.map(|conn| {
                        Connection::new(
                            conn,
                            self.endpoint.clone(),
                            self.mode,
                            None,
                            &self.cfg.framing,
                        )
                    }));
                }
                incoming = self.endpoint.accept(), if room => match incoming {
                    Some(i) => self.start(i),
                    None => return Err(chunnel::Error::Closed),
                },
            }
        }
    }

    fn start(&mut self, incoming: quinn::Incoming) {
        let after = self.cfg.handshake_timeout;
        let mode = self.mode;
        let peer = incoming.remote_address().to_string();
        let at = peer.clone();
        self.handshakes.spawn(peer, after, async move {
            let conn = incoming
                .accept()
                .map_err(|e| Error::from_quic(&at, e))?
                .await
                .map_err(|e| Error::from_quic(&at, e))?;
            if mode == Mode::Datagram {
                check_datagrams(&conn, &at)?;
            }
            Ok(conn)
        });
    }
}

/// Stops accepting: clients connecting later are refused. Accepted connections live on.
impl Drop for Listener {
    fn drop(&mut self) {
        self.endpoint.set_server_config(None);
    }
}

impl Negotiate for Listener {
    fn id(&self) -> &'static str {
        self.mode.id()
    }

    fn capabilities(&self) -> Vec<Capability> {
        self.mode.capabilities()
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
