//! The client side: [`AfXdpConnect`], a `Chunnel<()>` whose connection talks UDP to one peer
//! from an AF_XDP socket, the counterpart of `chunnel_net::udp::Connect` (same semantics:
//! one peer, datagrams from other sources are dropped, one message per datagram, no header).
//!
//! Setting up a connection:
//! 1. the route to the peer (rtnetlink `RTM_GETROUTE`) must leave through the configured
//!    interface; it gives the next hop (the peer, or a gateway) and, when the local address
//!    is `0.0.0.0`, the source address the kernel would use;
//! 2. a kernel UDP socket is bound to the local address and port (port 0: the kernel picks
//!    one) and connected to the peer. It receives nothing (the XDP program takes the port's
//!    datagrams before the kernel sees them); it holds the port, so no kernel socket takes it
//!    and a taken port fails with [`Error::AddrInUse`] as with kernel UDP; and the kernel
//!    reports on it the ICMP error of a peer whose port is closed (the program passes ICMP to
//!    the kernel), which `recv` returns as [`Error::PeerClosed`], as a connected UDP socket does;
//! 3. the next hop's MAC address is read from the kernel's neighbour table; if it is not
//!    there, the kernel is asked to resolve it (`RTM_NEWNEIGH` with `NTF_USE`: the kernel
//!    sends its own ARP request, no datagram reaches any application) and the table is read
//!    again until [`AfXdpConnect::with_resolve_timeout`] (default 1 s) runs out, which is an
//!    [`Error::Io`] of kind `HostUnreachable`. The XDP program passes ARP to the kernel, so
//!    the kernel keeps answering and resolving on the interface;
//! 4. the AF_XDP socket is created on the configured queue and the XDP program attached,
//!    steering the local address and port to it.
//!
//! The connection reads the RX ring in the task that calls `recv` (no receive task), straight
//! into the caller's slots: a read takes at most as many frames as there are slots, so nothing
//! received waits in user space between calls. Sending is the server's path (`tx.rs`).
//!
//! Lent buffers ([`chunnel::LendRecv`], [`chunnel::LendBuffer`], [`chunnel::Emit`]):
//! `recv_lent` hands out [`XdpPayload`]s viewing the UDP payload in its UMEM frame, which goes
//! back to the fill ring when the payload drops (on any thread; the connection moves dropped
//! frames to the fill ring at its next receive or send). While the application holds a quarter
//! of the UMEM (half the receive frames), further messages are copied instead, so the kernel
//! always has frames to receive into. `lend` gives an [`XdpBuf`] over a free TX frame's
//! payload region; `emit` writes the headers around it and puts the frame on the TX ring, no
//! copy. The listener's server connections queue `Bytes` in `chunnel_net::datagram` and keep
//! copying.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use chunnel::util::lock;
use chunnel::{
    Chunnel, ChunnelConnection, Emit, Error, LendBuffer, LendRecv, LendStats, Negotiate, SendHeader,
};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::bpf::{Counters, Program};
use crate::frame::{self, Endpoints};
use crate::lend::{XdpBuf, XdpPayload};
use crate::listener::{Fd, Stats, not_available, open_socket};
use crate::netlink::{NUD_FAILED, Netlink};
use crate::xsk::Lender;
use crate::xsk::Xsk;
use crate::{Config, ID};

/// The default bound on resolving the peer's MAC address.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(1);

/// Received payloads are copied into blocks of this size, handed out as `Bytes` slices; a
/// block is reused in place once the application dropped every message cut from it.
const RX_BLOCK: usize = 64 * 1024;

/// The AF_XDP UDP datapath's client: `connect_wrap(())` sets up an AF_XDP socket on
/// `cfg.interface` for `cfg.local` (address `0.0.0.0`: the route's source address; port 0:
/// an ephemeral port) talking to `peer`. A [`Negotiate`] leaf with the server's id [`ID`],
/// so `select(AfXdpConnect, chunnel_net::udp::Connect)` uses AF_XDP where it can and kernel
/// UDP elsewhere.
///
/// One AF_XDP socket per interface queue and one XDP program per interface: a second
/// connection (or a listener) on the same interface is not available.
#[derive(Clone, Debug)]
pub struct AfXdpConnect {
    cfg: Config,
    peer: SocketAddrV4,
    resolve_timeout: Duration,
}

impl AfXdpConnect {
    /// A client of `peer` with `cfg` (its `local` is the client's own address and port).
    pub fn new(cfg: Config, peer: SocketAddrV4) -> Self {
        AfXdpConnect {
            cfg,
            peer,
            resolve_timeout: RESOLVE_TIMEOUT,
        }
    }

    /// Bounds the wait for the peer's (or the gateway's) MAC address.
    pub fn with_resolve_timeout(mut self, t: Duration) -> Self {
        self.resolve_timeout = t;
        self
    }

    /// The server address.
    pub fn addr(&self) -> SocketAddrV4 {
        self.peer
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }
}

impl Negotiate for AfXdpConnect {
    fn id(&self) -> &'static str {
        ID
    }

    /// None: the wire is plain UDP, so the server may use any UDP datapath.
    fn capabilities(&self) -> Vec<chunnel::Capability> {
        Vec::new()
    }

    /// [`AfXdpUdp`](crate::AfXdpUdp)'s checks (program, capabilities, interface, AF_XDP
    /// sockets), and: the route to the peer leaves through the interface, and no XDP program
    /// is attached to it yet (attaching would fail).
    fn check_available(&self) -> Result<(), Error> {
        crate::check_host(&self.cfg)?;
        let ifindex = crate::ifindex(&self.cfg.interface)?;
        let mut nl = Netlink::open()
            .map_err(|e| not_available(format!("cannot open an rtnetlink socket: {e}")))?;
        route_through(&mut nl, &self.cfg.interface, ifindex, self.peer)?;
        let link = nl
            .link(ifindex)
            .map_err(|e| not_available(format!("reading interface {}: {e}", self.cfg.interface)))?;
        if link.xdp_attached {
            return Err(not_available(format!(
                "an XDP program is already attached to {} (one program per interface)",
                self.cfg.interface
            )));
        }
        Ok(())
    }
}

/// The route to `peer`, which must leave through `ifindex`.
fn route_through(
    nl: &mut Netlink,
    ifname: &str,
    ifindex: u32,
    peer: SocketAddrV4,
) -> Result<crate::netlink::Route, Error> {
    let route = nl
        .route(*peer.ip())
        .map_err(|e| not_available(format!("no route to {}: {e}", peer.ip())))?;
    if route.oif != ifindex {
        return Err(not_available(format!(
            "the route to {} leaves through interface #{}, not {ifname} (#{ifindex})",
            peer.ip(),
            route.oif
        )));
    }
    Ok(route)
}

/// The frame addressing from this host to `peer` through `cfg.interface`, and the kernel
/// socket holding the local port (see the module docs, steps 1–3).
pub(crate) async fn resolve_path(
    cfg: &Config,
    peer: SocketAddrV4,
    timeout: Duration,
) -> Result<(Endpoints, std::net::UdpSocket), Error> {
    let ifindex = crate::ifindex(&cfg.interface)?;
    let nl_err = |op: &'static str| move |source| Error::Io { op, source };
    let mut nl = Netlink::open().map_err(nl_err("opening an rtnetlink socket"))?;
    let route = route_through(&mut nl, &cfg.interface, ifindex, peer)?;
    let ip = match (*cfg.local.ip(), route.prefsrc) {
        (ip, _) if !ip.is_unspecified() => ip,
        (_, Some(src)) => src,
        (_, None) => {
            return Err(not_available(format!(
                "no local address: set Config::local (the route to {} names no source)",
                peer.ip()
            )));
        }
    };
    let want = SocketAddrV4::new(ip, cfg.local.port());
    let hold = std::net::UdpSocket::bind(want).map_err(|e| Error::from_io("bind", want, e))?;
    hold.connect(peer)
        .map_err(|e| Error::from_io("connect", peer, e))?;
    let local = match hold.local_addr() {
        Ok(std::net::SocketAddr::V4(a)) => a,
        Ok(other) => {
            return Err(Error::AddrFamily {
                local: other.to_string(),
                remote: peer.to_string(),
            });
        }
        Err(source) => {
            return Err(Error::Io {
                op: "local_addr",
                source,
            });
        }
    };
    let src_mac = nl
        .link(ifindex)
        .map_err(nl_err("reading the interface's MAC address"))?
        .mac
        .ok_or_else(|| not_available(format!("{} has no MAC address", cfg.interface)))?;
    let hop = route.next_hop(*peer.ip());
    let dst_mac = resolve_mac(&mut nl, ifindex, hop, &cfg.interface, timeout).await?;
    Ok((
        Endpoints {
            src_mac,
            dst_mac,
            src: local,
            dst: peer,
        },
        hold,
    ))
}

/// `hop`'s MAC address from the neighbour table, asking the kernel to resolve it (again every
/// 200 ms) until `timeout`.
async fn resolve_mac(
    nl: &mut Netlink,
    ifindex: u32,
    hop: Ipv4Addr,
    ifname: &str,
    timeout: Duration,
) -> Result<[u8; 6], Error> {
    let io = |source| Error::Io {
        op: "resolving the peer's MAC address",
        source,
    };
    let start = Instant::now();
    let mut solicited: Option<Instant> = None;
    let mut pause = Duration::from_micros(200);
    let mut last = None;
    loop {
        let n = nl.neighbour(ifindex, hop).map_err(io)?;
        if let Some(mac) = n.and_then(|n| n.usable()) {
            return Ok(mac);
        }
        last = n.map(|n| n.state).or(last);
        if start.elapsed() >= timeout {
            let state = match last {
                Some(s) if s & NUD_FAILED != 0 => "failed",
                Some(_) => "incomplete",
                None => "none",
            };
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::HostUnreachable,
                format!(
                    "no ARP answer from {hop} on {ifname} within {timeout:?} (neighbour entry: \
                     {state})"
                ),
            )));
        }
        if solicited.is_none_or(|t| t.elapsed() >= Duration::from_millis(200)) {
            nl.solicit(ifindex, hop).map_err(io)?;
            solicited = Some(Instant::now());
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

impl Chunnel<()> for AfXdpConnect {
    type Connection = ClientConnection;

    /// Checks availability, finds the path to the peer, creates the socket and attaches the
    /// program. Must run inside a tokio runtime with I/O and timers. Fails with
    /// [`Error::NotAvailable`] where [`Negotiate::check_available`] does and where the program
    /// cannot be attached, with [`Error::AddrInUse`] when the local port is taken, and with
    /// an [`Error::Io`] of kind `HostUnreachable` when the next hop does not answer ARP.
    async fn connect_wrap(&mut self, (): ()) -> Result<ClientConnection, Error> {
        self.check_available()?;
        let obj = crate::bpf::object(self.cfg.bpf_object.as_deref()).map_err(not_available)?;
        let ifindex = crate::ifindex(&self.cfg.interface)?;
        let (ep, hold) = resolve_path(&self.cfg, self.peer, self.resolve_timeout).await?;
        let mut cfg = self.cfg.clone();
        cfg.local = ep.src;
        let (xsk, program) = open_socket(&cfg, &obj, ifindex)?;
        ClientConnection::start(cfg, ep, xsk, program, hold)
    }
}

/// Counters of a client connection (see [`Stats`] for the fields).
#[derive(Debug, Default)]
struct Count {
    delivered: AtomicU64,
    malformed: AtomicU64,
    dropped: AtomicU64,
    sent: AtomicU64,
    rx_batches: AtomicU64,
    rx_lent: AtomicU64,
    rx_copied: AtomicU64,
    tx_lent: AtomicU64,
    tx_copied: AtomicU64,
}

/// A client-side AF_XDP UDP connection to one peer. Fields drop in order: the tokio
/// registration first (while the socket is open), then the program (detached), then the
/// socket and its UMEM, then the kernel socket holding the port.
pub struct ClientConnection {
    afd: AsyncFd<Fd>,
    program: Mutex<Program>,
    xsk: Mutex<Xsk>,
    /// Received payloads are copied into this block (locked after `xsk`, only by `read`).
    block: Mutex<BytesMut>,
    /// The kernel socket holding the local port, connected to the peer: it receives nothing,
    /// but the kernel reports an ICMP error from the peer on it (its port closed), which
    /// `recv` turns into [`Error::PeerClosed`] as kernel UDP does.
    port: tokio::net::UdpSocket,
    ep: Endpoints,
    cfg: Config,
    ip_id: AtomicU16,
    closed: AtomicBool,
    count: Count,
    /// `recv_lent` lends while fewer receive frames than this are out, and copies past it.
    lend_bound: usize,
}

impl std::fmt::Debug for ClientConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConnection")
            .field("interface", &self.cfg.interface)
            .field("local", &self.ep.src)
            .field("peer", &self.ep.dst)
            .finish_non_exhaustive()
    }
}

impl ClientConnection {
    fn start(
        cfg: Config,
        ep: Endpoints,
        xsk: Xsk,
        program: Program,
        port: std::net::UdpSocket,
    ) -> Result<Self, Error> {
        let port = port
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UdpSocket::from_std(port))
            .map_err(|source| Error::Io {
                op: "registering the port's socket with tokio",
                source,
            })?;
        // SAFETY: the descriptor is the socket's, owned by `xsk`, which drops after `afd`
        // (field order), so it stays open and the same for the registration's lifetime.
        let afd = unsafe { AsyncFd::register_with_interest(Fd(xsk.fd()), Interest::READABLE) }
            .map_err(|e| Error::Io {
                op: "registering the AF_XDP socket with tokio",
                source: e.into_parts().1,
            })?;
        Ok(ClientConnection {
            afd,
            program: Mutex::new(program),
            xsk: Mutex::new(xsk),
            block: Mutex::new(BytesMut::new()),
            port,
            ep,
            ip_id: AtomicU16::new(0),
            lend_bound: (cfg.frames / 4) as usize,
            cfg,
            closed: AtomicBool::new(false),
            count: Count::default(),
        })
    }

    /// The server this connection talks to.
    pub fn peer_addr(&self) -> SocketAddrV4 {
        self.ep.dst
    }

    /// The local address and port (the source of every frame sent).
    pub fn local_addr(&self) -> SocketAddrV4 {
        self.ep.src
    }

    /// The MAC addresses frames are sent from and to (the interface's, the next hop's).
    pub fn macs(&self) -> ([u8; 6], [u8; 6]) {
        (self.ep.src_mac, self.ep.dst_mac)
    }

    /// The XDP program's counters (read from its BPF map).
    pub fn counters(&self) -> Result<Counters, Error> {
        lock(&self.program).counters().map_err(|e| Error::Layer {
            layer: ID,
            source: e.into(),
        })
    }

    /// Statistics. `delivered`: datagrams handed to `recv`; `malformed`: redirected frames
    /// that were not a valid IPv4/UDP datagram; `dropped`: datagrams from another source than
    /// the peer or over `max_payload`; `dropped_peer_cap` is always 0.
    pub fn stats(&self) -> Stats {
        let (kd, kf, ke, kicks) = {
            let x = lock(&self.xsk);
            let (kd, kf, ke) = x.stats().unwrap_or_default();
            (kd, kf, ke, x.kicks)
        };
        let c = &self.count;
        Stats {
            delivered: c.delivered.load(Ordering::Relaxed),
            malformed: c.malformed.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            dropped_peer_cap: 0,
            sent: c.sent.load(Ordering::Relaxed),
            tx_kicks: kicks,
            rx_batches: c.rx_batches.load(Ordering::Relaxed),
            kernel_rx_dropped: kd,
            kernel_rx_ring_full: kf,
            kernel_fill_ring_empty: ke,
        }
    }

    /// The attach mode the program ended up in (`"driver"` or `"skb"`).
    pub fn attach_mode(&self) -> &'static str {
        match lock(&self.program).mode {
            aya::programs::XdpMode::Skb => "skb",
            _ => "driver",
        }
    }

    /// Closes the connection: later calls fail with [`Error::Closed`]. The socket is released
    /// (and the program detached) when the connection is dropped.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    fn check_open(&self) -> Result<(), Error> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    /// Takes up to `slots.len()` (at most `batch`) frames from the RX ring into `slots`;
    /// returns how many frames it took (some may have been dropped) and how many slots it
    /// filled. `put` makes a slot's value from the frame, the payload's range in it, a
    /// [`Lender`] when `lend` is set and fewer than `lend_bound` receive frames are lent, and
    /// the copy block.
    fn read<T>(
        &self,
        slots: &mut [Option<T>],
        lend: bool,
        mut put: impl FnMut(&[u8], std::ops::Range<usize>, Option<Lender<'_>>, &mut BytesMut) -> T,
    ) -> (usize, usize) {
        let want = slots.len().min(self.cfg.batch.max(1));
        let peer = self.ep.dst;
        let max = self.cfg.max_payload;
        let (mut filled, mut lent, mut malformed, mut dropped) = (0usize, 0u64, 0u64, 0u64);
        let mut xsk = lock(&self.xsk);
        xsk.refill();
        let mut budget = if lend {
            self.lend_bound.saturating_sub(xsk.umem().rx_out())
        } else {
            0
        };
        let mut block = lock(&self.block);
        let n = xsk.recv_lent(want, |f, lender| match frame::parse(f) {
            Ok((ep, range)) if ep.src == peer && range.len() <= max => {
                let l = if budget > 0 {
                    budget -= 1;
                    lent += 1;
                    Some(lender)
                } else {
                    None
                };
                slots[filled] = Some(put(f, range, l, &mut block));
                filled += 1;
            }
            // Another source (a connected socket ignores it too) or too large.
            Ok(_) => dropped += 1,
            Err(_) => malformed += 1,
        });
        if xsk.fill_needs_wakeup() {
            xsk.kick_rx();
        }
        drop(block);
        drop(xsk);
        if n > 0 {
            let c = &self.count;
            c.rx_batches.fetch_add(1, Ordering::Relaxed);
            c.delivered.fetch_add(filled as u64, Ordering::Relaxed);
            if lent > 0 {
                c.rx_lent.fetch_add(lent, Ordering::Relaxed);
            }
            if filled as u64 > lent {
                c.rx_copied
                    .fetch_add(filled as u64 - lent, Ordering::Relaxed);
            }
            if malformed > 0 {
                c.malformed.fetch_add(malformed, Ordering::Relaxed);
            }
            if dropped > 0 {
                c.dropped.fetch_add(dropped, Ordering::Relaxed);
            }
        }
        (n, filled)
    }

    /// `recv` over `read`: waits for frames on the ring or an ICMP error on the port.
    async fn recv_with<T>(
        &self,
        slots: &mut [Option<T>],
        read: impl Fn(&Self, &mut [Option<T>]) -> (usize, usize),
    ) -> Result<usize, Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        loop {
            self.check_open()?;
            // The ring first: frames may be there without a readiness event pending.
            let (n, filled) = read(self, slots);
            if filled > 0 {
                return Ok(filled);
            }
            if n > 0 {
                continue; // only dropped frames: read again
            }
            // One wait for both: a frame on the ring, or an ICMP error on the port's socket.
            let mut ready = tokio::select! {
                biased;
                r = self.afd.readable() => r.map_err(|source| Error::Io {
                    op: "waiting on the AF_XDP socket",
                    source,
                })?,
                r = self.port.ready(Interest::ERROR) => {
                    r.map_err(|e| peer_err(&self.ep.dst, e))?;
                    let pending = self.port.try_io(Interest::ERROR, || {
                        match self.port.take_error() {
                            Ok(Some(e)) => Ok(e),
                            Ok(None) => Err(std::io::ErrorKind::WouldBlock.into()),
                            Err(e) => Ok(e),
                        }
                    });
                    if let Ok(e) = pending {
                        return Err(peer_err(&self.ep.dst, e));
                    }
                    continue;
                }
            };
            // Clears the readiness only if no event arrived since it was reported, so a frame
            // landing between this read and the clear still wakes the next wait.
            if let Ok(Ok((_, filled))) = ready.try_io(|_| match read(self, slots) {
                (0, _) => Err(std::io::ErrorKind::WouldBlock.into()),
                r => Ok(r),
            }) && filled > 0
            {
                return Ok(filled);
            }
        }
    }

    fn read_copied(&self, slots: &mut [Option<Bytes>]) -> (usize, usize) {
        self.read(slots, false, |f, range, _, block| copy(block, &f[range]))
    }

    fn read_lent(&self, slots: &mut [Option<XdpPayload>]) -> (usize, usize) {
        self.read(slots, true, |f, range, lender, block| match lender {
            Some(l) => XdpPayload::lent(l.lend(range)),
            None => XdpPayload::copied(copy(block, &f[range])),
        })
    }
}

/// Copies `p` into `block` and cuts it off as `Bytes`; the block is reclaimed in place once
/// every message cut from it is gone.
fn copy(block: &mut BytesMut, p: &[u8]) -> Bytes {
    if block.capacity() < p.len() {
        block.reserve(RX_BLOCK.max(p.len()));
    }
    block.extend_from_slice(p);
    block.split().freeze()
}

/// An error on the connection: "refused" means the peer's port is closed.
fn peer_err(peer: &SocketAddrV4, e: std::io::Error) -> Error {
    match Error::from_io("recv", peer, e) {
        Error::ConnectionRefused { .. } => Error::PeerClosed,
        other => other,
    }
}

impl chunnel::PeerHandoff for ClientConnection {
    /// A client talks to one peer: there is nothing to hand off to.
    fn hand_off(&self, _first: Bytes) -> bool {
        false
    }

    /// As [`ClientConnection::close`].
    fn release(&self) {
        self.close();
    }
}

impl SendHeader for ClientConnection {
    async fn send_with_header<'a, B>(&'a self, header: &'a [u8], burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        self.check_open()?;
        crate::tx::send_frames(
            &self.xsk,
            &self.ip_id,
            &[&self.count.sent, &self.count.tx_copied],
            self.cfg.max_payload,
            &self.ep,
            header,
            burst,
        )
        .await
    }
}

impl ChunnelConnection for ClientConnection {
    type Data = Bytes;

    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        self.send_with_header(&[], burst).await
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, Error> {
        self.recv_with(slots, Self::read_copied).await
    }
}

/// Received datagrams lent in their UMEM frames ([`XdpPayload`]), each given back to the fill
/// ring when dropped. At most a quarter of the UMEM's frames (half the receive frames) are
/// lent at once; past that, messages are copied (counted in `rx_copied`) so the kernel keeps
/// frames to receive into.
impl LendRecv for ClientConnection {
    type Lent = XdpPayload;

    fn recv_lent<'a>(
        &'a self,
        slots: &'a mut [Option<XdpPayload>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        self.recv_with(slots, Self::read_lent)
    }

    fn lend_stats(&self) -> LendStats {
        let c = &self.count;
        LendStats {
            rx_lent: c.rx_lent.load(Ordering::Relaxed),
            rx_copied: c.rx_copied.load(Ordering::Relaxed),
            tx_lent: c.tx_lent.load(Ordering::Relaxed),
            tx_copied: c.tx_copied.load(Ordering::Relaxed),
        }
    }
}

/// Free TX frames of the UMEM: `None` when every TX frame is in flight or lent, or when `len`
/// is over `max_payload` or the frame size less the headers (send the message as `Bytes`
/// then).
impl LendBuffer for ClientConnection {
    type Buf = XdpBuf;

    fn lend(&self, len: usize) -> Option<XdpBuf> {
        if len > self.cfg.max_payload || self.closed.load(Ordering::Relaxed) {
            return None;
        }
        lock(&self.xsk).lend_tx(len).map(XdpBuf)
    }
}

/// Writes the headers in front of each lent payload and queues the frames on the TX ring
/// (no copy); returns as `send` does. A buffer another connection lent fails the emit with
/// [`Error::Layer`].
impl Emit for ClientConnection {
    async fn emit<B>(&self, bufs: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = XdpBuf> + Send,
        B::IntoIter: Send,
    {
        self.check_open()?;
        let frames = bufs.into_iter().map(|b| b.0);
        crate::tx::emit_frames(
            &self.xsk,
            &self.ip_id,
            &[&self.count.sent, &self.count.tx_lent],
            &self.ep,
            frames,
        )
        .await
    }
}

/// Nothing received waits in the connection between calls (a read takes at most as many
/// frames as the caller has slots); frames still in the RX ring go with the socket.
impl chunnel::Handover for ClientConnection {
    fn export(&self, _: &mut chunnel::Handoff<Bytes>) {}
    fn import(&self, _: &mut chunnel::Handoff<Bytes>) {}
}
