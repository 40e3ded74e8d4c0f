//! The AF_XDP UDP server: one socket on one queue as a [`DatagramIo`] ([`XdpIo`]: receive a
//! batch of frames, send a burst), under `chunnel_net::datagram`'s listener, which
//! demultiplexes by peer (IPv4 address + UDP port) into per-peer connections.

use std::hash::{Hash, Hasher};
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use chunnel::Error;
use chunnel::util::lock;
use chunnel_net::datagram::{self, Config as DatagramConfig, DatagramIo, RxBatch};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::bpf::{Counters, Program};
use crate::frame::{self, Endpoints};
use crate::xsk::{Xsk, XskSizes};
use crate::{Config, ID};

#[derive(Debug)]
pub(crate) struct Fd(pub(crate) RawFd);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Datapath statistics: the listener's (delivered, dropped) and the socket's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Datagrams handed to connections.
    pub delivered: u64,
    /// Frames from the socket that were not a valid IPv4/UDP datagram for us.
    pub malformed: u64,
    /// Datagrams dropped because a peer's queue or the accept backlog was full, or because
    /// they were over `max_payload`.
    pub dropped: u64,
    /// Datagrams from new sources dropped at the peer cap
    /// ([`chunnel_net::datagram::Config::max_peers`]).
    pub dropped_peer_cap: u64,
    /// Frames transmitted (queued on the TX ring).
    pub sent: u64,
    /// TX kicks (`sendto` system calls).
    pub tx_kicks: u64,
    /// RX ring accesses that returned frames (batches).
    pub rx_batches: u64,
    /// The kernel's counts for the socket (`XDP_STATISTICS`): frames dropped, dropped because
    /// the RX ring was full, and times the fill ring was empty.
    pub kernel_rx_dropped: u64,
    /// See `kernel_rx_dropped`.
    pub kernel_rx_ring_full: u64,
    /// See `kernel_rx_dropped`.
    pub kernel_fill_ring_empty: u64,
}

/// A peer of the AF_XDP listener: its IPv4 address and UDP port (what it is told apart by)
/// and the frame addressing a reply takes (the MAC addresses and local address its frames
/// came with).
#[derive(Clone, Copy)]
pub struct XdpPeer {
    /// Reply addressing: `src` is the local end, `dst` the peer.
    ep: Endpoints,
}

impl XdpPeer {
    /// The peer's address.
    pub fn addr(&self) -> SocketAddrV4 {
        self.ep.dst
    }
}

impl PartialEq for XdpPeer {
    fn eq(&self, other: &Self) -> bool {
        self.ep.dst == other.ep.dst
    }
}

impl Eq for XdpPeer {}

impl Hash for XdpPeer {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.ep.dst.hash(h);
    }
}

impl std::fmt::Debug for XdpPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.ep.dst.fmt(f)
    }
}

/// The AF_XDP socket under a [`Listener`]: its UMEM and rings, the XDP program steering the
/// port to it, and its own counters. Fields drop in order: the tokio registration first
/// (while the socket is open), then the XDP program (detached), then the socket and its UMEM.
pub struct XdpIo {
    afd: AsyncFd<Fd>,
    program: Mutex<Program>,
    xsk: Mutex<Xsk>,
    ip_id: AtomicU16,
    cfg: Config,
    malformed: AtomicU64,
    sent: AtomicU64,
    rx_batches: AtomicU64,
}

impl std::fmt::Debug for XdpIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdpIo")
            .field("interface", &self.cfg.interface)
            .field("local", &self.cfg.local)
            .finish_non_exhaustive()
    }
}

/// A listener's receive scratch: payloads are copied out of the UMEM into `buf` (handed
/// out as `Bytes`), collected with their senders before the listener sorts them.
#[derive(Debug, Default)]
pub struct XdpRx {
    buf: BytesMut,
    got: RxBatch<XdpPeer>,
}

pub(crate) fn not_available(reason: impl Into<String>) -> Error {
    Error::NotAvailable {
        chunnel: ID,
        reason: reason.into(),
    }
}

/// Creates the AF_XDP socket on (`cfg.interface`, `cfg.queue`) and loads and attaches the
/// program steering `cfg.local`'s UDP to it. A socket on the same queue that was just closed
/// may still be torn down: EBUSY is retried briefly.
pub(crate) fn open_socket(cfg: &Config, obj: &[u8], ifindex: u32) -> Result<(Xsk, Program), Error> {
    let sizes = XskSizes {
        frames: cfg.frames,
        frame_size: cfg.frame_size,
    };
    let mut tries = 0;
    let xsk = loop {
        match Xsk::new(ifindex, cfg.queue, sizes) {
            Ok(x) => break x,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 5 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(10 * tries));
            }
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                return Err(not_available(format!(
                    "queue {} of {} is already bound by another AF_XDP socket: {e}",
                    cfg.queue, cfg.interface
                )));
            }
            Err(e) => {
                return Err(not_available(format!(
                    "creating the AF_XDP socket on {} queue {}: {e}",
                    cfg.interface, cfg.queue
                )));
            }
        }
    };
    let program = Program::load(
        obj,
        &cfg.interface,
        cfg.mode,
        cfg.local,
        cfg.queue,
        xsk.fd(),
    )
    .map_err(not_available)?;
    Ok((xsk, program))
}

impl XdpIo {
    fn counters(&self) -> Result<Counters, Error> {
        lock(&self.program).counters().map_err(|e| Error::Layer {
            layer: ID,
            source: e.into(),
        })
    }

    fn attach_mode(&self) -> &'static str {
        match lock(&self.program).mode {
            aya::programs::XdpMode::Skb => "skb",
            _ => "driver",
        }
    }
}

impl DatagramIo for XdpIo {
    type Addr = XdpPeer;
    type RxState = XdpRx;
    type TxState = ();

    fn rx_state(&self, _: &DatagramConfig) -> XdpRx {
        XdpRx::default()
    }

    fn poll_recv_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // The readiness is cleared by `recv_batch` when it finds the RX ring empty.
        self.afd.poll_read_ready(cx).map(|r| r.map(drop))
    }

    fn recv_batch(
        &self,
        st: &mut XdpRx,
        cfg: &DatagramConfig,
        deliver: impl FnMut(Option<XdpPeer>, Bytes),
        oversize: impl FnMut(Option<XdpPeer>, &[u8], usize),
    ) -> std::io::Result<usize> {
        let batch = cfg.batch.max(1);
        let n = self.afd.try_io(Interest::READABLE, |_| {
            let mut x = lock(&self.xsk);
            if st.buf.capacity() < batch * x.frame_size() / 2 {
                st.buf = BytesMut::with_capacity(batch * x.frame_size());
            }
            let mut malformed = 0;
            let XdpRx { buf, got } = st;
            let n = x.recv_batch(batch, |f| match frame::parse(f) {
                Ok((ep, range)) => {
                    // Replies go back the way the datagram came: the ends swapped.
                    let peer = XdpPeer {
                        ep: Endpoints {
                            src_mac: ep.dst_mac,
                            dst_mac: ep.src_mac,
                            src: ep.dst,
                            dst: ep.src,
                        },
                    };
                    let payload = &f[range];
                    if payload.len() > cfg.max_payload {
                        got.push_oversized(Some(peer), payload, payload.len());
                    } else {
                        buf.extend_from_slice(payload);
                        got.push(Some(peer), buf.split().freeze());
                    }
                }
                Err(_) => malformed += 1,
            });
            if x.fill_needs_wakeup() {
                x.kick_rx();
            }
            if malformed > 0 {
                self.malformed.fetch_add(malformed, Ordering::Relaxed);
            }
            if n == 0 {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            Ok(n)
        })?;
        self.rx_batches.fetch_add(1, Ordering::Relaxed);
        st.got.hand_out(deliver, oversize);
        Ok(n)
    }

    async fn send_burst<'a, B>(
        &'a self,
        _: &'a (),
        cfg: &'a DatagramConfig,
        dest: &'a XdpPeer,
        header: &'a [u8],
        burst: B,
        closed: &'a AtomicBool,
    ) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        if closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        crate::tx::send_frames(
            &self.xsk,
            &self.ip_id,
            &[&self.sent],
            cfg.max_payload,
            &dest.ep,
            header,
            burst,
        )
        .await
    }
}

chunnel_net::datagram_listener! {
    /// The server side of the AF_XDP datapath: `chunnel_net::datagram`'s listener on an
    /// [`XdpIo`], handing out one [`ServerConnection`] per peer (IPv4 address + UDP port); its
    /// peer count and the listener's counters through `Deref`.
    ///
    /// Built by [`AfXdpUdp`](crate::AfXdpUdp)'s [`chunnel::Listen::listen`]. Dropping it stops
    /// admitting new peers; the XDP program stays attached (and the socket open) until the last
    /// connection is dropped too.
    pub struct Listener(XdpIo);
}

/// One peer of a [`Listener`]: receives the datagrams from one (address, port), sends
/// datagrams back to it (to the MAC address its frames came from).
pub type ServerConnection = datagram::ServerConnection<XdpIo>;

impl Listener {
    pub(crate) fn start(cfg: Config, obj: &[u8], ifindex: u32) -> Result<Listener, Error> {
        let (xsk, program) = open_socket(&cfg, obj, ifindex)?;
        // SAFETY: the descriptor is the socket's, owned by `XdpIo::xsk`, which drops after
        // `XdpIo::afd` (field order), so it stays open and the same for the registration's
        // lifetime.
        let afd = unsafe { AsyncFd::register_with_interest(Fd(xsk.fd()), Interest::READABLE) }
            .map_err(|e| Error::Io {
                op: "registering the AF_XDP socket with tokio",
                source: e.into_parts().1,
            })?;
        let datagram = cfg.datagram.clone();
        let io = XdpIo {
            xsk: Mutex::new(xsk),
            afd,
            program: Mutex::new(program),
            ip_id: AtomicU16::new(0),
            cfg,
            malformed: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            rx_batches: AtomicU64::new(0),
        };
        Ok(Listener(datagram::Listener::new(io, datagram)))
    }

    /// The XDP program's counters (read from its BPF map).
    pub fn counters(&self) -> Result<Counters, Error> {
        self.0.get_ref().counters()
    }

    /// Statistics: the listener's and the socket's.
    pub fn stats(&self) -> Stats {
        let io = self.0.get_ref();
        let (kd, kf, ke, kicks) = {
            let x = lock(&io.xsk);
            let (kd, kf, ke) = x.stats().unwrap_or_default();
            (kd, kf, ke, x.kicks)
        };
        let (direct, queued) = self.0.delivery();
        let (oversize, queue_full, backlog_full) = self.0.dropped();
        Stats {
            kernel_rx_dropped: kd,
            kernel_rx_ring_full: kf,
            kernel_fill_ring_empty: ke,
            delivered: direct + queued,
            malformed: io.malformed.load(Ordering::Relaxed),
            dropped: oversize + queue_full + backlog_full,
            dropped_peer_cap: self.0.peer_cap_stats().1,
            sent: io.sent.load(Ordering::Relaxed),
            tx_kicks: kicks,
            rx_batches: io.rx_batches.load(Ordering::Relaxed),
        }
    }

    /// The attach mode the program ended up in (`"driver"` or `"skb"`).
    pub fn attach_mode(&self) -> &'static str {
        self.0.get_ref().attach_mode()
    }

    /// The configuration in use.
    pub fn config(&self) -> &Config {
        &self.0.get_ref().cfg
    }
}
