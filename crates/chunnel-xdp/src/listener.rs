//! The AF_XDP UDP server: one socket on one queue, a receive task that demultiplexes frames by
//! peer address into per-peer connections, and batched transmission.

use std::collections::HashMap;
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::PoisonError;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use chunnel::{ChunnelConnection, Error, PeerHandoff, SendHeader};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use crate::bpf::{Counters, Program};
use crate::frame::{self, Endpoints};
use crate::xsk::{Xsk, XskSizes};
use crate::{Config, ID};

struct Fd(RawFd);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Datapath statistics kept in user space.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Datagrams handed to connections.
    pub delivered: u64,
    /// Frames from the socket that were not a valid IPv4/UDP datagram for us.
    pub malformed: u64,
    /// Datagrams dropped because a peer's queue or the accept backlog was full.
    pub dropped: u64,
    /// Datagrams from new sources dropped at [`crate::Config::max_peers`].
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

struct Peer {
    tx: mpsc::Sender<Bytes>,
}

/// Fields drop in order: the tokio registration first (while the socket is open), then the
/// XDP program (detached), then the socket and its UMEM.
pub(crate) struct Shared {
    afd: AsyncFd<Fd>,
    program: Mutex<Program>,
    xsk: Mutex<Xsk>,
    peers: Mutex<HashMap<SocketAddrV4, Peer>>,
    ip_id: AtomicU16,
    closed: AtomicBool,
    cfg: Config,
    delivered: AtomicU64,
    malformed: AtomicU64,
    dropped: AtomicU64,
    dropped_peer_cap: AtomicU64,
    sent: AtomicU64,
    rx_batches: AtomicU64,
}

/// The server side of the AF_XDP datapath: a [`chunnel::Listener`] handing out one
/// [`ServerConnection`] per peer (IPv4 address + UDP port).
///
/// Built by [`AfXdpUdp`](crate::AfXdpUdp)'s [`chunnel::Listen::listen`]. Dropping it stops
/// reception; the XDP program stays attached (and the socket open) until the last connection
/// is dropped too.
pub struct Listener {
    shared: Arc<Shared>,
    accept: mpsc::Receiver<ServerConnection>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("interface", &self.shared.cfg.interface)
            .field("local", &self.shared.cfg.local)
            .finish_non_exhaustive()
    }
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
                std::thread::sleep(Duration::from_millis(10 * tries));
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

impl Listener {
    pub(crate) fn start(cfg: Config, obj: &[u8], ifindex: u32) -> Result<Listener, Error> {
        let (xsk, program) = open_socket(&cfg, obj, ifindex)?;
        // SAFETY: the descriptor is the socket's, owned by `Shared::xsk`, which drops after
        // `Shared::afd` (field order), so it stays open and the same for the registration's
        // lifetime.
        let afd =
            unsafe { AsyncFd::register_with_interest(Fd(xsk.fd()), tokio::io::Interest::READABLE) }
                .map_err(|e| Error::Io {
                    op: "registering the AF_XDP socket with tokio",
                    source: e.into_parts().1,
                })?;
        let (accept_tx, accept) = mpsc::channel(cfg.backlog.max(1));
        let shared = Arc::new(Shared {
            xsk: Mutex::new(xsk),
            afd,
            program: Mutex::new(program),
            peers: Mutex::new(HashMap::new()),
            ip_id: AtomicU16::new(0),
            closed: AtomicBool::new(false),
            cfg,
            delivered: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            dropped_peer_cap: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            rx_batches: AtomicU64::new(0),
        });
        let task = tokio::spawn(rx_loop(shared.clone(), accept_tx));
        Ok(Listener {
            shared,
            accept,
            task,
        })
    }

    /// The XDP program's counters (read from its BPF map).
    pub fn counters(&self) -> Result<Counters, Error> {
        self.shared.counters()
    }

    /// User-space statistics.
    pub fn stats(&self) -> Stats {
        self.shared.stats()
    }

    /// The attach mode the program ended up in (`"driver"` or `"skb"`).
    pub fn attach_mode(&self) -> &'static str {
        match self
            .shared
            .program
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .mode
        {
            aya::programs::XdpMode::Skb => "skb",
            _ => "driver",
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &Config {
        &self.shared.cfg
    }
}

impl Shared {
    fn counters(&self) -> Result<Counters, Error> {
        self.program
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .counters()
            .map_err(|e| Error::Layer {
                layer: ID,
                source: e.into(),
            })
    }

    fn stats(&self) -> Stats {
        let (kd, kf, ke) = self
            .xsk
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .stats()
            .unwrap_or_default();
        Stats {
            kernel_rx_dropped: kd,
            kernel_rx_ring_full: kf,
            kernel_fill_ring_empty: ke,
            delivered: self.delivered.load(Ordering::Relaxed),
            malformed: self.malformed.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            dropped_peer_cap: self.dropped_peer_cap.load(Ordering::Relaxed),
            sent: self.sent.load(Ordering::Relaxed),
            tx_kicks: self
                .xsk
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .kicks,
            rx_batches: self.rx_batches.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.task.abort();
        // Connections see Closed once their queue is empty.
        self.shared
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

impl chunnel::Listener for Listener {
    type Connection = ServerConnection;

    async fn accept(&mut self) -> Result<ServerConnection, Error> {
        self.accept.recv().await.ok_or(Error::Closed)
    }
}

async fn rx_loop(shared: Arc<Shared>, accept: mpsc::Sender<ServerConnection>) {
    let batch = shared.cfg.batch.max(1);
    let mut got: Vec<(Endpoints, Bytes)> = Vec::with_capacity(batch);
    let mut buf = BytesMut::new();
    loop {
        let n = {
            let mut x = shared.xsk.lock().unwrap_or_else(PoisonError::into_inner);
            if buf.capacity() < batch * x.frame_size() / 2 {
                buf = BytesMut::with_capacity(batch * x.frame_size());
            }
            let mut malformed = 0;
            let n = x.recv_batch(batch, |f| match frame::parse(f) {
                Ok((ep, range)) => {
                    buf.extend_from_slice(&f[range]);
                    got.push((ep, buf.split().freeze()));
                }
                Err(_) => malformed += 1,
            });
            if x.fill_needs_wakeup() {
                x.kick_rx();
            }
            if malformed > 0 {
                shared.malformed.fetch_add(malformed, Ordering::Relaxed);
            }
            n
        };
        if n > 0 {
            shared.rx_batches.fetch_add(1, Ordering::Relaxed);
        }
        for (ep, msg) in got.drain(..) {
            dispatch(&shared, &accept, ep, msg);
        }
        if n == 0 {
            // Wait for the socket to become readable; the timeout covers a missed wake-up.
            if let Ok(Ok(mut guard)) =
                tokio::time::timeout(Duration::from_millis(5), shared.afd.readable()).await
            {
                guard.clear_ready();
            }
            if shared.closed.load(Ordering::Acquire) {
                return;
            }
        } else if n == batch {
            // Let connection tasks run between full batches.
            tokio::task::yield_now().await;
        }
    }
}

fn dispatch(
    shared: &Arc<Shared>,
    accept: &mpsc::Sender<ServerConnection>,
    ep: Endpoints,
    msg: Bytes,
) {
    let mut peers = shared.peers.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(p) = peers.get(&ep.src) {
        match p.tx.try_send(msg) {
            Ok(()) => {
                shared.delivered.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                shared.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            // The connection was dropped: treat the datagram as a new peer's.
            Err(mpsc::error::TrySendError::Closed(m)) => {
                peers.remove(&ep.src);
                return new_peer(shared, &mut peers, accept, ep, m);
            }
        }
    }
    new_peer(shared, &mut peers, accept, ep, msg)
}

fn new_peer(
    shared: &Arc<Shared>,
    peers: &mut HashMap<SocketAddrV4, Peer>,
    accept: &mpsc::Sender<ServerConnection>,
    ep: Endpoints,
    first: Bytes,
) {
    if peers.len() >= shared.cfg.max_peers {
        // Forget the peers whose connection is gone (their entries are otherwise removed
        // lazily, when they send again); if none is, the newcomer is dropped.
        peers.retain(|_, p| !p.tx.is_closed());
        if peers.len() >= shared.cfg.max_peers {
            shared.dropped_peer_cap.fetch_add(1, Ordering::Relaxed);
            return;
        }
    }
    let (tx, rx) = mpsc::channel(shared.cfg.peer_queue.max(1));
    let _ = tx.try_send(first);
    // Replies go back the way the datagram came: swap the ends.
    let reply = Endpoints {
        src_mac: ep.dst_mac,
        dst_mac: ep.src_mac,
        src: ep.dst,
        dst: ep.src,
    };
    let conn = ServerConnection {
        shared: shared.clone(),
        ep: reply,
        rx: tokio::sync::Mutex::new(rx),
    };
    match accept.try_send(conn) {
        Ok(()) => {
            shared.delivered.fetch_add(1, Ordering::Relaxed);
            peers.insert(ep.src, Peer { tx });
        }
        // Backlog full (or the listener is gone): the datagram is dropped, and the peer's next
        // one tries again.
        Err(_) => {
            shared.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One peer of a [`Listener`]: receives the datagrams from one (address, port), sends
/// datagrams back to it (to the MAC address its frames came from).
pub struct ServerConnection {
    shared: Arc<Shared>,
    ep: Endpoints,
    rx: tokio::sync::Mutex<mpsc::Receiver<Bytes>>,
}

impl std::fmt::Debug for ServerConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConnection")
            .field("peer", &self.ep.dst)
            .field("local", &self.ep.src)
            .finish_non_exhaustive()
    }
}

impl ServerConnection {
    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddrV4 {
        self.ep.dst
    }

    /// The XDP program's counters (shared by every connection of the listener).
    pub fn counters(&self) -> Result<Counters, Error> {
        self.shared.counters()
    }

    async fn send_parts<B>(&self, header: &[u8], burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        let max = self.shared.cfg.max_payload;
        let mut it = burst.into_iter().peekable();
        let mut spins = 0u32;
        loop {
            let mut err = None;
            let queued = {
                let mut x = self
                    .shared
                    .xsk
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let room = x.frame_size() - frame::HEADERS;
                let max = max.min(room);
                let ep = &self.ep;
                let ip_id = &self.shared.ip_id;
                let n = x.send_batch(|buf| {
                    let m = it.peek()?;
                    let len = header.len() + m.len();
                    if len > max {
                        err = Some(Error::MessageTooLarge { len, max });
                        return None;
                    }
                    let id = ip_id.fetch_add(1, Ordering::Relaxed);
                    let l = frame::build(buf, ep, id, &[header, m]);
                    it.next();
                    Some(l)
                });
                x.flush_tx();
                n
            };
            self.shared.sent.fetch_add(queued as u64, Ordering::Relaxed);
            if let Some(e) = err {
                return Err(e);
            }
            if it.peek().is_none() {
                return Ok(());
            }
            // TX ring or pool full: let the kernel complete some frames.
            if queued == 0 {
                spins += 1;
                if spins > 10 {
                    tokio::time::sleep(Duration::from_micros(100)).await;
                } else {
                    tokio::task::yield_now().await;
                }
            } else {
                spins = 0;
            }
        }
    }
}

impl ChunnelConnection for ServerConnection {
    type Data = Bytes;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        self.send_parts(&[], burst)
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let mut rx = self.rx.lock().await;
        let first = rx.recv().await.ok_or(Error::Closed)?;
        slots[0] = Some(first);
        let mut n = 1;
        while n < slots.len() {
            match rx.try_recv() {
                Ok(m) => {
                    slots[n] = Some(m);
                    n += 1;
                }
                Err(_) => break,
            }
        }
        Ok(n)
    }
}

impl SendHeader for ServerConnection {
    fn send_with_header<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        self.send_parts(header, burst)
    }
}

impl PeerHandoff for ServerConnection {
    fn hand_off(&self, _first: Bytes) -> bool {
        false
    }
}
