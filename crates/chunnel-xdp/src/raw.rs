//! For benchmarks: the AF_XDP socket and the XDP steering program without the library's
//! Chunnel, listener and tokio layers.
//!
//! `chunnel-bench datapaths` measures [`crate::Listener`] against a hand-written echo loop
//! built on this module, and [`crate::AfXdpConnect`] against a hand-written client loop
//! ([`client_path`](crate::raw::client_path) finds the client's frame addressing the way
//! the library does), so that the difference between the two is the library's layers, not
//! the socket code: [`Socket`](crate::raw::Socket) is the same XSK socket (UMEM, four rings,
//! copy mode, need-wakeup) and the same XDP program the listener uses, driven directly by the
//! caller. [`parse_reply`](crate::raw::parse_reply) / [`build_reply`](crate::raw::build_reply)
//! are the listener's frame parser and builder.
//!
//! Not a stable API: hidden from the documentation, may change with the benchmark.

use std::net::SocketAddrV4;
use std::ops::Range;
use std::os::fd::RawFd;

use chunnel::{Error, Negotiate};

use crate::bpf::{Counters, Program};
use crate::frame::{self, Endpoints};
use crate::listener::not_available;
use crate::xsk::Xsk;
use crate::{AfXdpUdp, Config};

/// Ethernet + IPv4 (no options) + UDP header bytes of a frame [`build_reply`] writes.
pub const HEADERS: usize = frame::HEADERS;

/// An AF_XDP socket bound to one queue with the steering program attached in front of it.
///
/// Fields drop in order: the program is detached first, then the socket and its UMEM are
/// released (as in the listener).
pub struct Socket {
    program: Program,
    xsk: Xsk,
}

impl std::fmt::Debug for Socket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Socket")
            .field("fd", &self.xsk.fd())
            .field("mode", &self.program.mode)
            .finish_non_exhaustive()
    }
}

impl Socket {
    /// Checks availability like [`AfXdpUdp`], creates the socket on (`cfg.interface`,
    /// `cfg.queue`) with `cfg.frames` × `cfg.frame_size` UMEM, and loads and attaches the
    /// program steering UDP for `cfg.local` to it. Retries briefly while the queue is still
    /// held by a socket that was just closed. Needs no runtime.
    pub fn open(cfg: &Config) -> Result<Socket, Error> {
        let xdp = AfXdpUdp::new(cfg.clone());
        xdp.check_available()?;
        let obj = crate::bpf::object(cfg.bpf_object.as_deref()).map_err(not_available)?;
        let ifindex = crate::ifindex(&cfg.interface)?;
        let (xsk, program) = crate::listener::open_socket(cfg, &obj, ifindex)?;
        Ok(Socket { program, xsk })
    }

    /// The socket's descriptor (to `poll` for `POLLIN`).
    pub fn fd(&self) -> RawFd {
        self.xsk.fd()
    }

    /// Bytes per UMEM chunk: the largest frame.
    pub fn frame_size(&self) -> usize {
        self.xsk.frame_size()
    }

    /// Consumes up to `max` received frames from the RX ring, handing each to `f`, and gives
    /// their chunks back to the fill ring (one producer update). Returns how many.
    pub fn recv_batch(&mut self, max: usize, f: impl FnMut(&[u8])) -> usize {
        self.xsk.recv_batch(max, f)
    }

    /// Whether the kernel asks for a wake-up ([`Socket::kick_rx`]) to refill from the fill
    /// ring.
    pub fn fill_needs_wakeup(&self) -> bool {
        self.xsk.fill_needs_wakeup()
    }

    /// Wakes the kernel's receive path (a zero-length `recvfrom`).
    pub fn kick_rx(&mut self) {
        self.xsk.kick_rx()
    }

    /// Reclaims completed TX chunks, writes frames into free ones with `build` (frame length,
    /// or `None` to stop), publishes them with one producer update and kicks the kernel
    /// (`sendto`). Returns how many were queued (fewer when the ring or pool is full).
    pub fn send_batch(&mut self, build: impl FnMut(&mut [u8]) -> Option<usize>) -> usize {
        self.xsk.send_batch(build)
    }

    /// Kicks until the kernel has taken every queued TX descriptor (or stops progressing).
    pub fn flush_tx(&mut self) {
        self.xsk.flush_tx()
    }

    /// TX kicks (`sendto`) issued so far.
    pub fn tx_kicks(&self) -> u64 {
        self.xsk.kicks
    }

    /// The XDP program's counters.
    pub fn counters(&self) -> Result<Counters, Error> {
        self.program.counters().map_err(|e| Error::Layer {
            layer: crate::ID,
            source: e.into(),
        })
    }

    /// The kernel's drop counts for the socket: (rx_dropped, rx_ring_full,
    /// rx_fill_ring_empty).
    pub fn kernel_stats(&self) -> std::io::Result<(u64, u64, u64)> {
        self.xsk.stats()
    }

    /// The attach mode the program ended up in (`"driver"` or `"skb"`).
    pub fn attach_mode(&self) -> &'static str {
        match self.program.mode {
            aya::programs::XdpMode::Skb => "skb",
            _ => "driver",
        }
    }
}

/// Where a reply to a received datagram goes: its endpoints, swapped. Also a client's
/// addressing of its requests ([`client_path`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply(Endpoints);

impl Reply {
    /// The peer (the received datagram's source).
    pub fn peer(&self) -> SocketAddrV4 {
        self.0.dst
    }

    /// The local end (the address and port frames are sent from).
    pub fn local(&self) -> SocketAddrV4 {
        self.0.src
    }
}

/// A client's frame addressing to `peer` through `cfg.interface`, found as
/// [`crate::AfXdpConnect`] finds it (route, local address and port, the next hop's MAC
/// address, resolved by the kernel within `timeout`), and the kernel UDP socket holding the
/// local port (keep it while the socket is used). Open the [`Socket`] with `cfg.local` set to
/// [`Reply::local`] so the program steers the replies to it. Runs its own short-lived tokio
/// runtime (for the resolution's timer); call it outside one.
pub fn client_path(
    cfg: &Config,
    peer: SocketAddrV4,
    timeout: std::time::Duration,
) -> Result<(Reply, std::net::UdpSocket), Error> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|source| Error::Io {
            op: "starting a runtime",
            source,
        })?;
    let (ep, hold) = rt.block_on(crate::client::resolve_path(cfg, peer, timeout))?;
    Ok((Reply(ep), hold))
}

/// Parses a received Ethernet/IPv4/UDP frame (the listener's parser): the reply's endpoints
/// and the payload's byte range in `frame`. `None` for anything else (malformed frames are
/// to be dropped).
pub fn parse_reply(frame: &[u8]) -> Option<(Reply, Range<usize>)> {
    let (ep, range) = frame::parse(frame).ok()?;
    Some((
        Reply(Endpoints {
            src_mac: ep.dst_mac,
            dst_mac: ep.src_mac,
            src: ep.dst,
            dst: ep.src,
        }),
        range,
    ))
}

/// Writes the reply frame carrying `payload` into `buf` (the listener's builder: IPv4 header
/// and UDP checksums computed); returns its length, or `None` if `buf` is shorter than
/// [`HEADERS`] + `payload.len()`.
pub fn build_reply(buf: &mut [u8], reply: &Reply, ip_id: u16, payload: &[u8]) -> Option<usize> {
    if buf.len() < HEADERS + payload.len() {
        return None;
    }
    Some(frame::build(buf, &reply.0, ip_id, &[payload]))
}
