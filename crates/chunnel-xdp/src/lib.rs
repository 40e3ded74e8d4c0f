//! # chunnel-xdp: an AF_XDP datapath, wire-compatible with kernel UDP
//!
//! [`AfXdpUdp`] serves UDP on (interface, IPv4 address, port) from an AF_XDP socket instead of
//! a kernel socket; [`AfXdpConnect`] is its client, a `Chunnel<()>` like
//! `chunnel_net::udp::Connect` talking to one peer from an AF_XDP socket (see below and
//! [`AfXdpConnect`] for how it finds its route, local port and the peer's MAC address). A small XDP program (`bpf/xdp_udp_steer.c`, built by `build.rs` with
//! clang and embedded in the library) looks at every frame arriving on the interface and
//! redirects only IPv4/UDP frames for the configured address and port to the socket's queue
//! through an `XSKMAP`; everything else — ARP, ICMP, other ports, fragments — is passed to the
//! kernel, so the interface keeps working normally (in particular the kernel keeps answering
//! ARP, so peers need no static neighbour entries). The program counts each verdict in a
//! per-CPU array ([`Counters`], [`Listener::counters`]).
//!
//! Peers are ordinary kernel UDP sockets: frames are plain Ethernet II / IPv4 / UDP, the
//! IPv4 header checksum and the UDP checksum are computed on transmission, and replies go to
//! the MAC address the peer's frame came from.
//!
//! ```no_run
//! use chunnel::{select, ConnectionExt, Listen, Listener as _};
//! use chunnel_xdp::{AfXdpUdp, Config};
//! # async fn demo() -> Result<(), chunnel::Error> {
//! let addr: std::net::SocketAddrV4 = "10.77.0.2:7000".parse().unwrap();
//! // AF_XDP when this host can run it, kernel UDP otherwise.
//! let kernel = chunnel_net::udp::Bind::new(addr.into());
//! let mut listener = select(AfXdpUdp::new(Config::new("veth0", addr)), kernel)
//!     .listen()
//!     .await?;
//! let conn = listener.accept().await?;
//! let m = conn.recv_one().await?;
//! conn.send_one(m).await?;
//! # Ok(()) }
//! ```
//!
//! At the client:
//!
//! ```no_run
//! use chunnel::{select, Chunnel, ConnectionExt};
//! use chunnel_xdp::{AfXdpConnect, Config};
//! # async fn demo() -> Result<(), chunnel::Error> {
//! let server: std::net::SocketAddrV4 = "10.77.0.2:7000".parse().unwrap();
//! // Local address 0.0.0.0: the route's source address; port 0: an ephemeral port.
//! let xdp = AfXdpConnect::new(Config::new("veth1", "0.0.0.0:0".parse().unwrap()), server);
//! let mut stack = select(xdp, chunnel_net::udp::Connect::new(server.into()));
//! let conn = stack.connect_wrap(()).await?;
//! conn.send_one("hello".into()).await?;
//! # Ok(()) }
//! ```
//!
//! ## Availability and fallback
//!
//! [`AfXdpUdp`] implements [`chunnel::Negotiate`] with id [`ID`] and no capability: the wire
//! format is kernel UDP's, so a kernel UDP client needs to know nothing. Its
//! `check_available` fails with [`chunnel::Error::NotAvailable`] and a clear reason when the
//! XDP program was not built (no clang at build time) and no object file is configured, when
//! the process lacks `CAP_NET_ADMIN` / `CAP_NET_RAW` / `CAP_BPF` (or `CAP_SYS_ADMIN`), when the
//! interface does not exist, or when the kernel refuses AF_XDP sockets. Loading or attaching
//! the program can still fail when it listens (another XDP program on the interface, a
//! verifier rejection): that is `NotAvailable` too, and a [`chunnel::Select`]'s
//! [`Listen`](chunnel::Listen) then binds the fallback branch, so
//! `select(AfXdpUdp, chunnel_net::udp::Bind).listen()` yields a working listener whenever
//! kernel UDP can bind the address.
//!
//! [`AfXdpConnect`] has the same id and checks, and two more, since a client's `Select`
//! decides from availability alone (building a branch consumes its input, so it cannot try
//! one and fall back): the route to the peer must leave through the interface, and no XDP
//! program may be attached to it already (one program per interface: a listener's or another
//! client's). `select(AfXdpConnect, chunnel_net::udp::Connect)` then connects over kernel UDP.
//! An attach that fails anyway (a race with another program) is `NotAvailable` from
//! `connect_wrap`.
//!
//! ## Datapath
//!
//! * One AF_XDP socket bound to one queue (default 0) in copy mode with `XDP_USE_NEED_WAKEUP`
//!   (zero-copy is not supported on veth). Use single-queue interfaces, or steer the flows to
//!   the bound queue: the program redirects by the frame's receive queue.
//! * UMEM: [`Config::frames`] chunks of [`Config::frame_size`] bytes; half are receive buffers
//!   (recycled to the fill ring as soon as a frame's payload is copied out), half the
//!   transmit pool (recycled from the completion ring).
//! * Peers: the [`Listener`] is `chunnel_net::datagram`'s, on an [`XdpIo`]: the same per-peer
//!   queues, accept backlog, peer cap, idle sweep and session recognition as kernel UDP, and
//!   no receive task — whichever task needs data (a connection's `recv` or `accept`) reads
//!   the RX ring and sorts what it finds.
//! * Batching: a read drains up to `batch` descriptors ([`Config::datagram`]) per RX-ring
//!   access and refills the fill ring with one producer update; `send` writes a whole burst
//!   into the TX ring with one producer update and kicks the kernel (`sendto`) once per ring
//!   access.
//! * Waiting: the reading task waits on the socket through tokio's `AsyncFd` (epoll); a read
//!   wakes the kernel's fill path only when the ring asks.
//! * Messages up to `max_payload` bytes (default 1472: a 1500-byte MTU); larger sends fail
//!   with `MessageTooLarge`, larger received datagrams are dropped and counted. No IP
//!   fragmentation.
//! * Received UDP checksums are not verified (a kernel sender on veth leaves them to the
//!   device, `CHECKSUM_PARTIAL`); the IPv4 header checksum is.
//! * Lent buffers (client only): [`ClientConnection`] implements [`chunnel::LendRecv`]
//!   ([`XdpPayload`]: the UDP payload viewed in its UMEM frame, which stays out of the fill
//!   ring until the payload drops, on any thread; past half the receive frames held, messages
//!   are copied instead) and [`chunnel::LendBuffer`] + [`chunnel::Emit`] ([`XdpBuf`]: a free TX
//!   frame's payload region; `emit` writes the headers in front of it, no copy; at most half
//!   the TX frames are lent). The listener's server connections keep copying (their queues
//!   are `chunnel_net::datagram`'s, of `Bytes`).
//!
//! The client finds its path with rtnetlink (`netlink.rs`): the route to the peer (output
//! interface, gateway, source address), then the next hop's entry in the kernel's neighbour
//! table, asking the kernel to resolve it when missing (`NTF_USE`: the kernel sends its own
//! ARP request; the XDP program passes ARP to the kernel, so no static entries are needed at
//! either end), for at most [`AfXdpConnect::with_resolve_timeout`] (1 s by default), after
//! which `connect_wrap` fails with an `Io` error of kind `HostUnreachable`. Datagrams from
//! other sources than the peer are dropped and counted, as a connected UDP socket ignores
//! them. One AF_XDP socket binds one interface queue, so a host runs one AF_XDP endpoint
//! (client or server) per interface.
//!
//! The unsafe code is in `xsk.rs` (the socket and its rings, written against the kernel ABI
//! with `libc`; no libxdp), `netlink.rs` (the rtnetlink socket calls) and in the aya loader
//! it calls.
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

mod bpf;
mod client;
mod frame;
mod lend;
mod listener;
mod netlink;
/// For benchmarks: the XSK socket and XDP program without the library's layers (not a
/// stable API).
#[doc(hidden)]
pub mod raw;
pub mod shard;
mod tx;
mod xsk;

use std::net::SocketAddrV4;
use std::path::PathBuf;

use chunnel::{Error, Negotiate};

pub use crate::bpf::{AttachMode, Counters, embedded_program_available};
pub use crate::client::{AfXdpConnect, ClientConnection, RESOLVE_TIMEOUT};
pub use crate::lend::{XdpBuf, XdpPayload};
use crate::listener::not_available;
pub use crate::listener::{Listener, ServerConnection, Stats, XdpIo, XdpPeer, XdpRx};
pub use crate::shard::{ShardCounters, ShardOffload, ShardOffloadConfig, XdpShard};

/// The Chunnel's stable id.
pub const ID: &str = "chunnel/af-xdp-udp/1";

/// Largest payload with the default 1500-byte MTU (1500 − 20 IP − 8 UDP).
pub const MAX_PAYLOAD: usize = 1472;

/// Configuration of an AF_XDP UDP endpoint.
#[derive(Clone, Debug)]
pub struct Config {
    /// The interface to attach to.
    pub interface: String,
    /// The local IPv4 address and UDP port to serve. Address `0.0.0.0` matches any
    /// destination address on the interface. For a client ([`AfXdpConnect`]): its own address
    /// and port, `0.0.0.0` for the route's source address, port 0 for an ephemeral port.
    pub local: SocketAddrV4,
    /// The interface queue to bind (default 0).
    pub queue: u32,
    /// How to attach the XDP program (default: native, falling back to generic).
    pub mode: AttachMode,
    /// A BPF object file to load instead of the one embedded at build time.
    pub bpf_object: Option<PathBuf>,
    /// UMEM chunks (power of two; default 4096: 2048 for reception, 2048 for transmission).
    pub frames: u32,
    /// Bytes per UMEM chunk (2048 or 4096; default 2048).
    pub frame_size: u32,
    /// Message size, batch, queues, backlog, peer cap, idle timeout: the settings every
    /// datagram datapath shares (read and written through `Deref`: `cfg.max_peers`). Here
    /// `batch` (default 64) is the descriptors taken per RX-ring access, and `max_payload`
    /// (default [`MAX_PAYLOAD`]) is also capped by the chunk size for sends.
    pub datagram: chunnel_net::datagram::Config,
}

impl std::ops::Deref for Config {
    type Target = chunnel_net::datagram::Config;
    fn deref(&self) -> &Self::Target {
        &self.datagram
    }
}

impl std::ops::DerefMut for Config {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.datagram
    }
}

impl Config {
    /// Defaults for serving `local` on `interface` (or, for a client, sending from it).
    pub fn new(interface: impl Into<String>, local: SocketAddrV4) -> Self {
        Config {
            interface: interface.into(),
            local,
            queue: 0,
            mode: AttachMode::Auto,
            bpf_object: None,
            frames: 4096,
            frame_size: 2048,
            datagram: chunnel_net::udp::Config::default()
                .with_max_payload_bytes(MAX_PAYLOAD)
                .with_batch(64),
        }
    }
}

/// The AF_XDP UDP datapath (server side): a [`Negotiate`] leaf and a bind config whose
/// [`Listen::listen`](chunnel::Listen::listen) yields a [`Listener`].
#[derive(Clone, Debug)]
pub struct AfXdpUdp {
    cfg: Config,
}

impl AfXdpUdp {
    /// A datapath with `cfg`.
    pub fn new(cfg: Config) -> Self {
        AfXdpUdp { cfg }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }
}

impl chunnel::Listen for AfXdpUdp {
    type Listener = Listener;

    /// Creates the socket, loads and attaches the XDP program and starts receiving. Must be
    /// called inside a tokio runtime (with timers and I/O enabled). Fails with
    /// [`Error::NotAvailable`] where [`Negotiate::check_available`] does, and where the
    /// program cannot be loaded or attached.
    async fn listen(&self) -> Result<Listener, Error> {
        self.check_available()?;
        let obj = bpf::object(self.cfg.bpf_object.as_deref()).map_err(not_available)?;
        let ifindex = ifindex(&self.cfg.interface)?;
        Listener::start(self.cfg.clone(), &obj, ifindex)
    }
}

fn ifindex(name: &str) -> Result<u32, Error> {
    let c = std::ffi::CString::new(name)
        .map_err(|_| not_available(format!("bad interface name {name:?}")))?;
    // SAFETY: a valid C string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        Err(not_available(format!(
            "no interface named {name} in this network namespace"
        )))
    } else {
        Ok(i)
    }
}

/// The effective capability set of this process, or `None` if it cannot be read.
fn effective_caps() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("CapEff:"))?;
    u64::from_str_radix(line["CapEff:".len()..].trim(), 16).ok()
}

const CAP_NET_ADMIN: u32 = 12;
const CAP_NET_RAW: u32 = 13;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_BPF: u32 = 39;

impl Negotiate for AfXdpUdp {
    fn id(&self) -> &'static str {
        ID
    }

    fn check_available(&self) -> Result<(), Error> {
        check_host(&self.cfg)
    }
}

/// What both ends need: the XDP program (embedded or `cfg.bpf_object`), the capabilities,
/// the interface, and a kernel that creates AF_XDP sockets.
fn check_host(cfg: &Config) -> Result<(), Error> {
    if cfg.bpf_object.is_none() && !embedded_program_available() {
        bpf::object(None).map_err(not_available)?;
    }
    if let Some(p) = &cfg.bpf_object
        && !p.is_file()
    {
        return Err(not_available(format!(
            "the XDP object {} does not exist",
            p.display()
        )));
    }
    if let Some(caps) = effective_caps() {
        let has = |c: u32| caps & (1u64 << c) != 0;
        let mut missing = Vec::new();
        if !has(CAP_NET_ADMIN) {
            missing.push("CAP_NET_ADMIN");
        }
        if !has(CAP_NET_RAW) {
            missing.push("CAP_NET_RAW");
        }
        if !has(CAP_BPF) && !has(CAP_SYS_ADMIN) {
            missing.push("CAP_BPF (or CAP_SYS_ADMIN)");
        }
        if !missing.is_empty() {
            return Err(not_available(format!(
                "the process lacks {} (run as root or grant them)",
                missing.join(", ")
            )));
        }
    }
    ifindex(&cfg.interface)?;
    xsk::probe().map_err(|e| not_available(format!("the kernel refuses AF_XDP sockets: {e}")))?;
    Ok(())
}
