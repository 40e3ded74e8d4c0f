//! Datagram sockets (UDP, Unix datagram) as Chunnel connections, shared by [`crate::udp`] and
//! [`crate::uds`].
//!
//! * A **client** connection owns a connected socket and receives with `recvmmsg` straight
//!   into its own scratch buffer.
//! * A **listener** owns one bound socket shared by every server-side connection. Whichever
//!   task needs data (a connection's `recv` or the listener's `accept`) reads a batch and
//!   demultiplexes it by source address into bounded per-peer queues, waking their owners;
//!   there is no extra task or channel hop. A datagram from an unknown peer starts a new
//!   connection that `accept` hands out. Queues are bounded; a full queue drops datagrams
//!   (this is a best-effort datapath) and counts them.
//! * Dropping or closing a server-side connection removes its peer state; an idle timeout
//!   (default 60 s) ends connections whose peer went away without a word, since datagram
//!   sockets carry no close signal.
//! * The peers a listener keeps are capped ([`Config::max_peers`]): at the cap a new source
//!   evicts a peer nobody accepted yet or an accepted one marked silent, or is dropped and
//!   counted ([`Listener::peer_cap_stats`]).

// `DgramSocket` is deliberately crate-private (a sealed trait): users name the concrete types
// (`udp::Connection`, `uds::DatagramListener`...), never the trait.
#![allow(private_bounds, private_interfaces)]

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use chunnel::{ChunnelConnection, Error, SendHeader};
use tokio::io::{Interest, Ready};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::sys::{self, DgramAddr, MAX_BATCH, RecvMeta};

/// Settings shared by the datagram datapaths.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Largest message carried, in bytes. Larger sends fail with
    /// [`Error::MessageTooLarge`]; larger incoming datagrams are dropped and counted. A
    /// listener does not drop them silently: it keeps the datagram's first bytes and its
    /// length for the peer's connection ([`chunnel::PeerHandoff::take_oversized`]; a
    /// datagram from a new peer starts a connection that `accept` hands out), so
    /// negotiation can refuse a hello too large for this limit.
    pub max_payload: usize,
    /// Most datagrams moved per system call (at most 64).
    pub batch: usize,
    /// Datagrams buffered per server-side connection before new ones are dropped.
    pub peer_queue: usize,
    /// New peers waiting for `accept` before datagrams from further new peers are dropped.
    pub backlog: usize,
    /// A server-side connection that receives nothing for this long ends: its state on the
    /// listener is freed and its next `recv` returns [`Error::PeerClosed`], whether or not
    /// one was pending (messages received but not yet read count as activity). One task
    /// per listener checks, so a connection carries no timer. `None` keeps it until dropped.
    pub idle_timeout: Option<Duration>,
    /// Most peers a listener keeps state for (accepted connections and new peers waiting
    /// for `accept`); default 16,384. At the cap, a datagram from a new address evicts the
    /// oldest peer still waiting for `accept` (never handed out), else the accepted
    /// connection marked silent longest ago ([`chunnel::PeerHandoff::mark_silent`]: the
    /// layer above saw nothing valid from it yet), or is dropped and counted
    /// ([`Listener::peer_cap_stats`]) if there is neither: other accepted connections are
    /// never evicted by new peers. While more than half the cap is in use, new peers that waited
    /// for `accept` longer than [`SILENT_GRACE`] are evicted first.
    pub max_peers: usize,
    /// Bytes of datagrams buffered per server-side connection (besides the count,
    /// [`Config::peer_queue`]) before new ones are dropped and counted as a full queue;
    /// default 1 MiB.
    pub peer_queue_bytes: usize,
    /// Bytes of datagrams buffered by a listener for all its peers together (connections not
    /// reading, new peers waiting for `accept`) before new ones are dropped and counted as
    /// a full queue; default 64 MiB. With [`Config::max_peers`] it bounds what a flood of
    /// peers that send and never read can make a listener hold.
    pub queued_bytes: usize,
}

/// How long a new peer may wait for `accept` while the listener's peer table is more than
/// half full ([`Config::max_peers`]) before a datagram from another new peer evicts it.
pub const SILENT_GRACE: Duration = Duration::from_secs(1);

impl Config {
    pub(crate) fn with_max_payload(max_payload: usize) -> Self {
        Config {
            max_payload,
            batch: 32,
            peer_queue: 1024,
            backlog: 128,
            idle_timeout: Some(Duration::from_secs(60)),
            max_peers: 16_384,
            peer_queue_bytes: 1 << 20,
            queued_bytes: 64 << 20,
        }
    }

    /// Sets [`Config::peer_queue_bytes`] (at least 1).
    pub fn with_peer_queue_bytes(mut self, n: usize) -> Self {
        self.peer_queue_bytes = n.max(1);
        self
    }

    /// Sets [`Config::queued_bytes`] (at least 1).
    pub fn with_queued_bytes(mut self, n: usize) -> Self {
        self.queued_bytes = n.max(1);
        self
    }

    /// Sets [`Config::max_peers`] (at least 1).
    pub fn with_max_peers(mut self, n: usize) -> Self {
        self.max_peers = n.max(1);
        self
    }

    /// Sets [`Config::max_payload`].
    pub fn with_max_payload_bytes(mut self, n: usize) -> Self {
        self.max_payload = n.max(1);
        self
    }

    /// Sets [`Config::batch`] (clamped to 1..=64).
    pub fn with_batch(mut self, n: usize) -> Self {
        self.batch = n.clamp(1, MAX_BATCH);
        self
    }

    /// Sets [`Config::peer_queue`].
    pub fn with_peer_queue(mut self, n: usize) -> Self {
        self.peer_queue = n.max(1);
        self
    }

    /// Sets [`Config::backlog`].
    pub fn with_backlog(mut self, n: usize) -> Self {
        self.backlog = n.max(1);
        self
    }

    /// Sets [`Config::idle_timeout`].
    pub fn with_idle_timeout(mut self, t: Option<Duration>) -> Self {
        self.idle_timeout = t;
        self
    }

    /// Memory one socket's receive scratch uses: `batch * (max_payload + 1)` bytes.
    pub fn scratch_bytes(&self) -> usize {
        self.batch * (self.max_payload + 1)
    }
}

/// The tokio socket types the datagram machinery runs on.
pub(crate) trait DgramSocket: AsRawFd + Send + Sync + 'static {
    type Addr: DgramAddr;
    /// Waits until the socket is ready for any of `interest`; returns what it is ready for.
    /// (Writability, and a client's read or error; a listener's reader uses
    /// [`DgramSocket::poll_read_ready`].)
    fn ready(&self, interest: Interest) -> impl Future<Output = io::Result<Ready>> + Send;
    fn try_io_with<R>(
        &self,
        interest: Interest,
        f: impl FnOnce() -> io::Result<R>,
    ) -> io::Result<R>;
    /// Takes the pending socket error (`SO_ERROR`).
    fn take_error(&self) -> io::Result<Option<io::Error>>;
    /// Polls for readability, registering `cx` in the socket's one receive-waker slot (the
    /// task of the latest call is the one woken). Only a listener's reader calls it, under
    /// [`Shared::read_register`].
    fn poll_read_ready(&self, cx: &mut std::task::Context<'_>) -> Poll<io::Result<()>>;

    /// Sends with `f` at once, before asking the runtime whether the socket is writable;
    /// only if the kernel says it is full does `f` run again under the runtime's readiness
    /// protocol ([`DgramSocket::try_io_with`], which then clears the stale readiness).
    ///
    /// A datagram socket's send buffer is almost never full, and the runtime knows nothing
    /// of a fresh socket until its first event: asking it first made every new
    /// connection's first send wait for an event-loop turn (an `epoll_wait` and a task
    /// wake-up) before its first datagram could leave.
    fn try_send_with<R>(&self, mut f: impl FnMut() -> io::Result<R>) -> io::Result<R> {
        match f() {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.try_io_with(Interest::WRITABLE, f)
            }
            r => r,
        }
    }
}

impl DgramSocket for tokio::net::UdpSocket {
    type Addr = std::net::SocketAddr;
    async fn ready(&self, interest: Interest) -> io::Result<Ready> {
        tokio::net::UdpSocket::ready(self, interest).await
    }
    fn try_io_with<R>(
        &self,
        interest: Interest,
        f: impl FnOnce() -> io::Result<R>,
    ) -> io::Result<R> {
        self.try_io(interest, f)
    }
    fn take_error(&self) -> io::Result<Option<io::Error>> {
        tokio::net::UdpSocket::take_error(self)
    }
    fn poll_read_ready(&self, cx: &mut std::task::Context<'_>) -> Poll<io::Result<()>> {
        self.poll_recv_ready(cx)
    }
}

impl DgramSocket for tokio::net::UnixDatagram {
    type Addr = sys::UnixAddr;
    async fn ready(&self, interest: Interest) -> io::Result<Ready> {
        tokio::net::UnixDatagram::ready(self, interest).await
    }
    fn try_io_with<R>(
        &self,
        interest: Interest,
        f: impl FnOnce() -> io::Result<R>,
    ) -> io::Result<R> {
        self.try_io(interest, f)
    }
    fn take_error(&self) -> io::Result<Option<io::Error>> {
        tokio::net::UnixDatagram::take_error(self)
    }
    fn poll_read_ready(&self, cx: &mut std::task::Context<'_>) -> Poll<io::Result<()>> {
        self.poll_recv_ready(cx)
    }
}

/// Per-connection receive state: datagrams land in the thread's [`KernelScratch`], then each
/// is copied once into `out`, a compact buffer that hands out `Bytes` slices. `out` is
/// reclaimed in place (no allocation) once the application has dropped the messages it
/// handed out.
struct RxScratch {
    out: BytesMut,
    /// Next reservation for `out`: starts small (a connection that sees one message does not
    /// fault in 64 KiB) and doubles up to `OUT_BLOCK`.
    block: usize,
    /// How many datagrams the next read asks the kernel for (see [`RxScratch::read_with`]).
    next: usize,
    /// Datagrams read since the socket was last found empty.
    run: usize,
    /// The size of the last run: what the first read after a wait asks for.
    hint: usize,
    /// No read yet. A first read of one datagram copies it into a buffer of its own size
    /// (one allocation) instead of reserving a block and sharing it (two): a short-lived
    /// client usually reads one answer.
    first: bool,
}

const OUT_BLOCK: usize = 64 * 1024;

/// What the kernel writes into during one `recvmmsg`: up to `batch` slots of the largest
/// datagram. Only used for the duration of one read, so one per thread serves every socket
/// the thread reads: a new connection costs no receive allocation (a per-connection scratch
/// was 2 x 64 KiB of fresh heap, and its page faults, for every short-lived client). Bounded
/// by `MAX_BATCH x (max_payload + 1)` per thread; only the bytes the kernel writes are touched.
#[derive(Default)]
struct KernelScratch {
    scratch: sys::Scratch,
    metas: Vec<RecvMeta>,
}

thread_local! {
    static KERNEL_SCRATCH: std::cell::RefCell<KernelScratch> =
        std::cell::RefCell::new(KernelScratch::default());
}

impl RxScratch {
    /// `first`: what the first read asks for. One for a client socket (its first datagram
    /// is usually the one answer it waits for), a whole batch for a listener (clients may
    /// have queued up before the first `accept`).
    fn new(first: usize) -> Self {
        RxScratch {
            out: BytesMut::new(),
            // Small enough for the allocator's per-thread cache (a connection's first
            // datagram alone is copied into a buffer of its own: see `first`).
            block: 512,
            next: first,
            run: 0,
            hint: first,
            first: true,
        }
    }

    /// Reads up to `want` datagrams; calls `deliver(addr, payload)` for each well-formed one,
    /// and `oversize(addr, prefix, len)` for each larger than `cfg.max_payload` (counted as
    /// dropped; `prefix` is its first bytes, at most [`chunnel::Oversized::PREFIX`], `len`
    /// its whole length). Returns the number read from the kernel (including dropped ones).
    /// With `want_addr` false (a connected socket) the senders' addresses are not read:
    /// `addr` is `None`.
    #[allow(clippy::too_many_arguments)]
    fn read<A: DgramAddr>(
        &mut self,
        fd: RawFd,
        cfg: &Config,
        want: usize,
        want_addr: bool,
        stats: &Stats,
        deliver: impl FnMut(Option<A>, Bytes),
        oversize: impl FnMut(Option<A>, &[u8], usize),
    ) -> io::Result<usize> {
        KERNEL_SCRATCH.with(|k| match k.try_borrow_mut() {
            Ok(mut k) => self.read_with(&mut k, fd, cfg, want, want_addr, stats, deliver, oversize),
            // Re-entered from `deliver` (no caller does; kept correct regardless).
            Err(_) => self.read_with(
                &mut KernelScratch::default(),
                fd,
                cfg,
                want,
                want_addr,
                stats,
                deliver,
                oversize,
            ),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn read_with<A: DgramAddr>(
        &mut self,
        k: &mut KernelScratch,
        fd: RawFd,
        cfg: &Config,
        want: usize,
        want_addr: bool,
        stats: &Stats,
        mut deliver: impl FnMut(Option<A>, Bytes),
        mut oversize: impl FnMut(Option<A>, &[u8], usize),
    ) -> io::Result<usize> {
        // One spare byte per slot tells an exactly-max datagram from an oversize one.
        let slot = cfg.max_payload + 1;
        // Adaptive batch. `recvmmsg` asked for more datagrams than are queued tries the
        // socket once more for the next one before it returns, which costs a lone request
        // (the common case at moderate load) a measurable part of its latency. So a read asks
        // for as many as the last run between two empty reads held (one, when requests come
        // one at a time), and doubles its ask while reads come back full, except after the
        // first datagram of a run: a lone datagram is the common case, and the read that
        // then finds the socket empty is cheaper as a one-datagram `recvfrom` than as a
        // `recvmmsg` of two.
        let want = want.clamp(1, cfg.batch).min(self.next);
        // Sized to what callers ask for, never zeroed (see `sys::Scratch`).
        k.scratch.ensure(want, slot);
        if k.metas.len() < want {
            k.metas.resize(
                want,
                RecvMeta {
                    len: 0,
                    wire_len: 0,
                    truncated: false,
                    addr: sys::RawAddr::zeroed(),
                },
            );
        }
        let n = match sys::recv_batch(fd, &mut k.scratch, &mut k.metas[..want], want_addr) {
            Ok(n) => n,
            Err(e) => {
                if e.kind() == io::ErrorKind::WouldBlock {
                    self.end_run(0);
                }
                return Err(e);
            }
        };
        if n < want {
            self.end_run(n);
        } else {
            self.run += n;
            self.next = if self.run == 1 {
                1
            } else {
                want.saturating_mul(2).min(MAX_BATCH)
            };
        }
        let ok = |m: &RecvMeta| !m.truncated && m.len <= cfg.max_payload;
        if std::mem::take(&mut self.first) && n == 1 && ok(&k.metas[0]) {
            let payload = Bytes::copy_from_slice(k.scratch.filled(0, k.metas[0].len));
            let addr = if want_addr {
                A::from_raw(&k.metas[0].addr)
            } else {
                None
            };
            deliver(addr, payload);
            return Ok(n);
        }
        // Room for the whole batch is made before any of it is handed out: the block can then
        // be reclaimed in place whenever the application has dropped the previous batches.
        // Reserving in the middle of a batch would find the batch's first messages alive and
        // allocate a new block every time a block boundary fell inside a batch.
        let total: usize = k.metas[..n].iter().filter(|m| ok(m)).map(|m| m.len).sum();
        if self.out.capacity() - self.out.len() < total {
            self.out.reserve(total.max(self.block));
            self.block = (self.block * 2).min(OUT_BLOCK);
        }
        for (i, m) in k.metas[..n].iter().enumerate() {
            if !ok(m) {
                stats.dropped_oversize.fetch_add(1, Ordering::Relaxed);
                let addr = if want_addr {
                    A::from_raw(&m.addr)
                } else {
                    None
                };
                let prefix = k.scratch.filled(i, m.len.min(chunnel::Oversized::PREFIX));
                oversize(addr, prefix, m.wire_len.max(m.len));
                continue;
            }
            self.out.extend_from_slice(k.scratch.filled(i, m.len));
            let payload = self.out.split().freeze();
            let addr = if want_addr {
                A::from_raw(&m.addr)
            } else {
                None
            };
            deliver(addr, payload);
        }
        Ok(n)
    }

    /// The socket was found empty after `n` more datagrams: the run is over, and its size is
    /// what the next read asks for.
    fn end_run(&mut self, n: usize) {
        let run = self.run + n;
        if run > 0 {
            self.hint = run.min(MAX_BATCH);
        }
        self.run = 0;
        self.next = self.hint;
    }
}

/// Counters of one socket.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) dropped_oversize: AtomicU64,
    pub(crate) dropped_queue_full: AtomicU64,
    pub(crate) dropped_backlog_full: AtomicU64,
    /// Datagrams from new peers dropped at [`Config::max_peers`] (no evictable peer).
    pub(crate) dropped_peer_cap: AtomicU64,
    /// Peers evicted to make room: new ones `accept` had not taken (at the cap, or past the
    /// grace under pressure) and, at the cap, accepted ones still marked silent.
    pub(crate) evicted: AtomicU64,
    /// Datagrams a connection read for itself, straight into its slots.
    pub(crate) direct: AtomicU64,
    /// Datagrams sorted into a peer queue (read by another task, or while older ones wait).
    pub(crate) queued: AtomicU64,
    /// Known addresses that started another session ([`chunnel::Listener::recognise_sessions`]).
    pub(crate) new_sessions: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind; keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Maps an I/O error on an established connection.
fn conn_err(op: &'static str, peer: &(dyn std::fmt::Debug + Sync), e: io::Error) -> Error {
    match Error::from_io(op, format!("{peer:?}"), e) {
        // Mid-connection, "refused" means the peer's socket is gone.
        Error::ConnectionRefused { .. } => Error::PeerClosed,
        other => other,
    }
}

/// Spare vectors for [`Spill`]: a send that has to wait for writability with messages it
/// already took from its burst parks them in one of these, so neither the messages nor a
/// batch-sized array live in the send future. Reused, so a blocked send does not allocate
/// once the pool is warm.
#[derive(Debug, Default)]
struct SpillPool(Mutex<Vec<Vec<Bytes>>>);

/// Spare vectors kept per socket (one per send blocked at the same time, beyond which they
/// are freed).
const SPILL_POOL: usize = 8;

/// Messages of a burst taken from its iterator but not sent yet, kept across a wait.
struct Spill<'a> {
    pool: &'a SpillPool,
    v: Option<Vec<Bytes>>,
    /// A one-message burst kept across a wait (no vector needed).
    one: Option<Bytes>,
}

impl Spill<'_> {
    fn keep(&mut self, msgs: impl Iterator<Item = Bytes>) {
        let pool = self.pool;
        let v = self.v.get_or_insert_with(|| {
            lock(&pool.0)
                .pop()
                .unwrap_or_else(|| Vec::with_capacity(MAX_BATCH))
        });
        v.extend(msgs);
    }
}

impl Drop for Spill<'_> {
    fn drop(&mut self) {
        if let Some(mut v) = self.v.take() {
            v.clear();
            let mut pool = lock(&self.pool.0);
            if pool.len() < SPILL_POOL {
                pool.push(v);
            }
        }
    }
}

/// One datagram (`header` then `msg`) sent if the socket takes it at once; `None` if it
/// would block (the caller waits with [`send_burst`]).
fn try_send_now<S: DgramSocket>(
    sock: &S,
    cfg: &Config,
    dest: Option<&S::Addr>,
    peer: &(dyn std::fmt::Debug + Sync),
    header: &[u8],
    msg: &Bytes,
) -> Option<Result<(), Error>> {
    let max = cfg.max_payload.saturating_sub(header.len());
    if msg.len() > max {
        return Some(Err(Error::MessageTooLarge {
            len: msg.len(),
            max,
        }));
    }
    let fd = sock.as_raw_fd();
    let raw = dest.map(DgramAddr::to_raw);
    match sock.try_send_with(|| sys::send_one(fd, header, msg, raw.as_ref())) {
        Ok(_) => Some(Ok(())),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
        Err(e) => Some(Err(conn_err("send", peer, e))),
    }
}

/// Sends a burst in batches of `sendmmsg`, waiting for writability as needed.
///
/// The batch arrays live in [`send_step`]'s stack frame, not in this future: a future is
/// copied when a task is spawned and when it finishes, and 64-entry arrays made it ~4.8 KB.
///
/// `closed`, if given, is looked at first (the connection's closed flag). Written as a function
/// returning an `async move` block, not as an `async fn`, which would keep each argument
/// twice in the future (as an upvar and as a local).
#[allow(clippy::too_many_arguments)]
// Not an `async fn`: it would keep its arguments twice in the future.
#[allow(clippy::manual_async_fn)]
fn send_burst<'a, S: DgramSocket, B>(
    sock: &'a S,
    cfg: &'a Config,
    dest: Option<&'a S::Addr>,
    peer: &'a (dyn std::fmt::Debug + Sync),
    header: &'a [u8],
    burst: B,
    pool: &'a SpillPool,
    closed: Option<&'a AtomicBool>,
) -> impl Future<Output = Result<(), Error>> + Send
where
    B: IntoIterator<Item = Bytes> + Send,
    B::IntoIter: Send,
{
    async move {
        if closed.is_some_and(|c| c.load(Ordering::Acquire)) {
            return Err(Error::Closed);
        }
        let max = cfg.max_payload.saturating_sub(header.len());
        let mut it = burst.into_iter();
        let mut spill = Spill {
            pool,
            v: None,
            one: None,
        };
        let mut too_large = None;
        loop {
            match send_step(
                sock,
                cfg,
                dest,
                header,
                max,
                &mut it,
                &mut spill,
                &mut too_large,
            ) {
                Ok(true) => break,
                // Boxed: waiting for room is the rare case, and tokio's readiness future inline
                // made every send's future (which is copied when it is created, at each layer)
                // a few hundred bytes larger.
                Ok(false) => Box::pin(sock.ready(Interest::WRITABLE))
                    .await
                    .map(drop)
                    .map_err(|e| conn_err("send", peer, e))?,
                Err(e) => return Err(conn_err("send", peer, e)),
            }
        }
        match too_large {
            Some(len) => Err(Error::MessageTooLarge { len, max }),
            None => Ok(()),
        }
    }
}

/// Sends what it can of a burst without waiting: first the messages `spill` kept, then
/// more from `it`, in batches of `cfg.batch`. Returns `Ok(true)` when the burst is done (or
/// stopped at a message over `max`, recorded in `too_large`), `Ok(false)` when the socket is
/// full (the unsent messages are in `spill`).
#[allow(clippy::too_many_arguments)]
fn send_step<S: DgramSocket>(
    sock: &S,
    cfg: &Config,
    dest: Option<&S::Addr>,
    header: &[u8],
    max: usize,
    it: &mut impl Iterator<Item = Bytes>,
    spill: &mut Spill<'_>,
    too_large: &mut Option<usize>,
) -> io::Result<bool> {
    let fd = sock.as_raw_fd();
    // Encoded here, in this frame, rather than by the caller: a kernel address (~136 bytes)
    // held across the caller's await would be carried by every send future.
    let raw = dest.map(DgramAddr::to_raw);
    let dest = raw.as_ref();
    // A burst of one message (a request, a reply) is the common case: it is sent from a
    // one-entry array, without setting up (and dropping) the 64 entries of a full batch.
    let mut first = None;
    if cfg.batch >= 2 && spill.v.as_ref().is_none_or(Vec::is_empty) && too_large.is_none() {
        // A message kept by an earlier step goes first (it was already checked against `max`).
        let next = match spill.one.take() {
            Some(m) => Some(m),
            None => it.next(),
        };
        match next {
            None => return Ok(true),
            Some(m) if m.len() > max => {
                *too_large = Some(m.len());
                return Ok(true);
            }
            Some(m) => match it.next() {
                None => {
                    let one = [Some(m)];
                    return match sock.try_send_with(|| sys::send_batch(fd, header, &one, dest)) {
                        Ok(_) => Ok(true),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            let [one] = one;
                            spill.one = one;
                            Ok(false)
                        }
                        Err(e) => Err(e),
                    };
                }
                Some(second) => first = Some([m, second]),
            },
        }
    }
    let mut batch: [Option<Bytes>; MAX_BATCH] = [const { None }; MAX_BATCH];
    loop {
        let mut n = 0;
        if let Some([a, b]) = first.take() {
            batch[0] = Some(a);
            n = 1;
            // The second may be over `max`: checked like any other.
            if b.len() > max {
                *too_large = Some(b.len());
            } else {
                batch[1] = Some(b);
                n = 2;
            }
        }
        if let Some(v) = spill.v.as_mut() {
            // At most one batch's remainder was kept.
            for m in v.drain(..) {
                batch[n] = Some(m);
                n += 1;
            }
        }
        let mut more = too_large.is_none();
        while more && n < cfg.batch {
            match it.next() {
                Some(m) if m.len() > max => {
                    *too_large = Some(m.len());
                    more = false;
                }
                Some(m) => {
                    batch[n] = Some(m);
                    n += 1;
                }
                None => more = false,
            }
        }
        let mut sent = 0;
        while sent < n {
            match sock.try_send_with(|| sys::send_batch(fd, header, &batch[sent..n], dest)) {
                Ok(k) => sent += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    spill.keep(batch[sent..n].iter_mut().filter_map(Option::take));
                    return Ok(false);
                }
                Err(e) => return Err(e),
            }
        }
        if !more {
            return Ok(true);
        }
    }
}

/// The client side: a socket connected to one peer.
#[derive(Debug)]
pub struct Connection<S: DgramSocket> {
    sock: S,
    peer: S::Addr,
    cfg: Config,
    rx: Mutex<RxScratch>,
    stats: Stats,
    closed: AtomicBool,
    spill: SpillPool,
}

impl std::fmt::Debug for RxScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RxScratch").finish_non_exhaustive()
    }
}

impl<S: DgramSocket> Connection<S> {
    pub(crate) fn new(sock: S, peer: S::Addr, cfg: Config) -> Self {
        Connection {
            sock,
            peer,
            cfg,
            rx: Mutex::new(RxScratch::new(1)),
            stats: Stats::default(),
            closed: AtomicBool::new(false),
            spill: SpillPool::default(),
        }
    }

    /// The socket underneath.
    pub fn get_ref(&self) -> &S {
        &self.sock
    }

    /// Incoming datagrams dropped because they exceeded `max_payload`.
    pub fn dropped_oversize(&self) -> u64 {
        self.stats.dropped_oversize.load(Ordering::Relaxed)
    }

    /// Closes the connection: later calls fail with [`Error::Closed`]. The socket itself is
    /// released when the connection is dropped.
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
}

impl<S: DgramSocket> chunnel::PeerHandoff for Connection<S> {
    /// A client socket is connected to one peer: there is nothing to hand off to.
    fn hand_off(&self, _first: Bytes) -> bool {
        false
    }

    /// As [`Connection::close`].
    fn release(&self) {
        self.close();
    }
}

impl<S: DgramSocket> SendHeader for Connection<S> {
    fn send_with_header<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        send_burst(
            &self.sock,
            &self.cfg,
            None,
            &self.peer,
            header,
            burst,
            &self.spill,
            Some(&self.closed),
        )
    }

    fn try_send_with_header(&self, header: &[u8], msg: &Bytes) -> Option<Result<(), Error>> {
        if let Err(e) = self.check_open() {
            return Some(Err(e));
        }
        try_send_now(&self.sock, &self.cfg, None, &self.peer, header, msg)
    }
}

impl<S: DgramSocket> ChunnelConnection for Connection<S> {
    type Data = Bytes;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        send_burst(
            &self.sock,
            &self.cfg,
            None,
            &self.peer,
            &[],
            burst,
            &self.spill,
            Some(&self.closed),
        )
    }

    // Not an `async fn`: it would keep its arguments twice in the future.
    #[allow(clippy::manual_async_fn)]
    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Bytes>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        async move {
            if slots.is_empty() {
                return Ok(0);
            }
            loop {
                self.check_open()?;
                let res = {
                    let mut rx = lock(&self.rx);
                    let fd = self.sock.as_raw_fd();
                    let mut filled = 0;
                    self.sock
                        .try_io_with(Interest::READABLE, || {
                            rx.read::<S::Addr>(
                                fd,
                                &self.cfg,
                                slots.len(),
                                false,
                                &self.stats,
                                |_, m| {
                                    slots[filled] = Some(m);
                                    filled += 1;
                                },
                                // Dropped and counted (`dropped_oversize`).
                                |_, _, _| {},
                            )
                        })
                        .map(|_| filled)
                };
                match res {
                    Ok(0) => continue, // only oversize datagrams: read again
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        // A connected socket learns that its peer is gone from an ICMP error,
                        // which shows up as `EPOLLERR`, not as readability. One wait for both
                        // (one waiter registered with the reactor, not two).
                        let ready = self
                            .sock
                            .ready(Interest::READABLE | Interest::ERROR)
                            .await
                            .map_err(|e| conn_err("recv", &self.peer, e))?;
                        if ready.is_error() {
                            let pending = self.sock.try_io_with(Interest::ERROR, || {
                                match self.sock.take_error() {
                                    Ok(Some(e)) => Ok(e),
                                    Ok(None) => Err(io::ErrorKind::WouldBlock.into()),
                                    Err(e) => Ok(e),
                                }
                            });
                            if let Ok(e) = pending {
                                return Err(conn_err("recv", &self.peer, e));
                            }
                        }
                    }
                    Err(e) => return Err(conn_err("recv", &self.peer, e)),
                }
            }
        }
    }
}

/// The hash of the peer map, looked up for every datagram a listener receives.
///
/// `SipHash` (std's default) cost more than the rest of demultiplexing a datagram. This is
/// a keyed folded multiply (the construction of `foldhash`/`ahash`'s fallback): each word
/// is mixed as `fold(acc ^ word, key)`, where `fold` multiplies to 128 bits and XORs the
/// halves. Trade-off: peers choose their source ports (and, off-path, addresses), so an
/// unkeyed fast hash (FxHash) would let one client flood a bucket; here the 64-bit key is
/// random per listener and never leaves the process, so collisions cannot be precomputed.
/// It is not a cryptographic PRF (an attacker able to measure lookup timing over many
/// probes may learn about the key), which is the same minimal-DoS-resistance level as
/// `foldhash`; the per-peer queues and the backlog stay bounded either way.
#[derive(Clone, Debug)]
struct PeerHash {
    key: u64,
}

impl PeerHash {
    fn new() -> Self {
        use std::hash::BuildHasher;
        // std's per-process random keys, advanced per `RandomState`.
        let key = std::hash::RandomState::new().hash_one(0x5eed_u64) | 1;
        PeerHash { key }
    }
}

impl std::hash::BuildHasher for PeerHash {
    type Hasher = PeerHasher;
    fn build_hasher(&self) -> PeerHasher {
        PeerHasher {
            acc: self.key,
            key: self.key,
        }
    }
}

struct PeerHasher {
    acc: u64,
    key: u64,
}

impl PeerHasher {
    #[inline]
    fn mix(&mut self, word: u64) {
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        let p = u128::from(self.acc ^ word) * u128::from(self.key ^ K);
        self.acc = (p as u64) ^ ((p >> 64) as u64);
    }
}

impl std::hash::Hasher for PeerHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.mix(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            // The length keeps "a" and "a\0" apart.
            self.mix(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }
    fn write_u8(&mut self, n: u8) {
        self.mix(u64::from(n));
    }
    fn write_u16(&mut self, n: u16) {
        self.mix(u64::from(n));
    }
    fn write_u32(&mut self, n: u32) {
        self.mix(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.mix(n);
    }
    fn write_u128(&mut self, n: u128) {
        self.mix(n as u64);
        self.mix((n >> 64) as u64);
    }
    fn write_usize(&mut self, n: usize) {
        self.mix(n as u64);
    }
    fn finish(&self) -> u64 {
        self.acc
    }
}

/// Per-peer state on a listener.
#[derive(Debug)]
struct Peer<A> {
    /// The peer's address (the key it has in the map, kept here too so that its connection
    /// and its idle-sweep entry need no copy of their own).
    addr: A,
    queue: Mutex<PeerQueue>,
    notify: Notify,
    closed: AtomicBool,
    /// Closed by the idle sweep: the next `recv` reports [`Error::PeerClosed`] (once).
    idled: AtomicBool,
    /// When a message was last handed to the connection, in [`Shared::nanos_now`] units.
    last_rx: AtomicU64,
    /// Marked by the layer above as not having sent anything valid yet
    /// ([`chunnel::PeerHandoff::mark_silent`]): at the cap, a new peer may evict it.
    silent: AtomicBool,
    /// Listed in [`Demux::silent`] (changed under the demux lock only), so that marking a
    /// connection again does not list it twice.
    silent_listed: AtomicBool,
    /// How many receives of this connection wait for the reader's place (listed once in
    /// [`Shared::vacancy`] while any do); reset by the reader that offers it the place.
    wants_place: AtomicU32,
    /// The session its datagrams started ([`chunnel::Listener::recognise_sessions`]); 0:
    /// none yet. Changed under the demux lock only.
    session: AtomicU64,
}

/// A peer's received messages, oldest first: the first inline (a connection usually
/// starts with one message, which then needs no allocation), the others behind it, in a
/// queue allocated the first time there are two (a peer that never has two holds no empty
/// queue: every peer of a listener lives as long as its connection).
#[derive(Debug, Default)]
struct PeerQueue {
    /// `None` only when the queue is empty.
    first: Option<Bytes>,
    // Boxed on purpose: 8 bytes in every peer instead of an empty deque's 32.
    #[allow(clippy::box_collection)]
    rest: Option<Box<VecDeque<Bytes>>>,
    /// The latest datagram too large for `max_payload`, by its first bytes (boxed: 8 bytes
    /// in every peer, most of which never see one).
    oversized: Option<Box<chunnel::Oversized>>,
    /// Bytes of the datagrams queued here.
    bytes: usize,
    /// The listener's count of bytes queued for all its peers ([`Config::queued_bytes`]),
    /// which this queue's bytes are part of until they leave it (or it is dropped).
    total: Option<Arc<AtomicUsize>>,
}

impl Drop for PeerQueue {
    fn drop(&mut self) {
        if let Some(t) = &self.total {
            t.fetch_sub(self.bytes, Ordering::Relaxed);
        }
    }
}

impl PeerQueue {
    /// An empty queue whose bytes count towards `total`.
    fn counted(total: &Arc<AtomicUsize>) -> Self {
        PeerQueue {
            first: None,
            rest: None,
            oversized: None,
            bytes: 0,
            total: Some(Arc::clone(total)),
        }
    }

    fn one(m: Bytes, total: &Arc<AtomicUsize>) -> Self {
        let mut q = PeerQueue::counted(total);
        q.push_back(m);
        q
    }

    /// Whether `m` fits: under [`Config::peer_queue`] datagrams and
    /// [`Config::peer_queue_bytes`] here, and [`Config::queued_bytes`] in all.
    fn has_room(&self, m: &Bytes, cfg: &Config) -> bool {
        self.len() < cfg.peer_queue
            && self.bytes + m.len() <= cfg.peer_queue_bytes
            && self
                .total
                .as_ref()
                .is_none_or(|t| t.load(Ordering::Relaxed) + m.len() <= cfg.queued_bytes)
    }

    fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.rest.as_ref().map_or(0, |r| r.len())
    }

    fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    fn push_back(&mut self, m: Bytes) {
        self.bytes += m.len();
        if let Some(t) = &self.total {
            t.fetch_add(m.len(), Ordering::Relaxed);
        }
        if self.first.is_none() {
            self.first = Some(m);
        } else {
            self.rest.get_or_insert_default().push_back(m);
        }
    }

    fn pop_front(&mut self) -> Option<Bytes> {
        let m = self.first.take()?;
        self.first = self.rest.as_mut().and_then(|r| r.pop_front());
        self.bytes -= m.len();
        if let Some(t) = &self.total {
            t.fetch_sub(m.len(), Ordering::Relaxed);
        }
        Some(m)
    }
}

impl<A> Peer<A> {
    fn new(addr: A, queue: PeerQueue) -> Self {
        Peer {
            addr,
            queue: Mutex::new(queue),
            notify: Notify::new(),
            closed: AtomicBool::new(false),
            idled: AtomicBool::new(false),
            silent: AtomicBool::new(false),
            silent_listed: AtomicBool::new(false),
            last_rx: AtomicU64::new(0),
            wants_place: AtomicU32::new(0),
            session: AtomicU64::new(0),
        }
    }
}

/// The accepted connections of a listener with an idle timeout, by when each is next
/// checked (the earliest on top). One task per listener sweeps it; a connection has no
/// timer of its own (a timer per connection was an allocation and a timer-wheel insertion
/// per connection, and a timer to poll in every wait of its receives).
struct IdleSweep<A> {
    due: std::collections::BinaryHeap<IdleEntry<A>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl<A> std::fmt::Debug for IdleSweep<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleSweep")
            .field("connections", &self.due.len())
            .finish_non_exhaustive()
    }
}

struct IdleEntry<A> {
    /// When to look again, in [`Shared::nanos_now`] units.
    at: u64,
    peer: std::sync::Weak<Peer<A>>,
}

impl<A> PartialEq for IdleEntry<A> {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl<A> Eq for IdleEntry<A> {}

impl<A> PartialOrd for IdleEntry<A> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<A> Ord for IdleEntry<A> {
    /// Reversed: `BinaryHeap` keeps the greatest on top, the sweep wants the earliest.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.at.cmp(&self.at)
    }
}

/// The listener's peers by address: a table of the peers themselves (each knows its
/// address), hashed by [`PeerHash`]: 8 bytes a slot, with no copy of the address beside
/// each (a map from address to peer kept 40).
struct PeerMap<A> {
    table: hashbrown::HashTable<Arc<Peer<A>>>,
    hash: PeerHash,
}

impl<A> std::fmt::Debug for PeerMap<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerMap")
            .field("peers", &self.table.len())
            .finish_non_exhaustive()
    }
}

impl<A: DgramAddr> PeerMap<A> {
    fn new() -> Self {
        PeerMap {
            table: hashbrown::HashTable::new(),
            hash: PeerHash::new(),
        }
    }

    fn hash_of(&self, addr: &A) -> u64 {
        use std::hash::BuildHasher;
        self.hash.hash_one(addr)
    }

    fn get(&self, addr: &A) -> Option<&Arc<Peer<A>>> {
        self.table.find(self.hash_of(addr), |p| p.addr == *addr)
    }

    fn contains(&self, addr: &A) -> bool {
        self.get(addr).is_some()
    }

    /// Adds `peer` under its address, in place of any peer there.
    fn insert(&mut self, peer: Arc<Peer<A>>) {
        use std::hash::BuildHasher;
        let h = self.hash_of(&peer.addr);
        let hash = &self.hash;
        match self
            .table
            .entry(h, |p| p.addr == peer.addr, |p| hash.hash_one(&p.addr))
        {
            hashbrown::hash_table::Entry::Occupied(mut e) => *e.get_mut() = peer,
            hashbrown::hash_table::Entry::Vacant(e) => {
                e.insert(peer);
            }
        }
    }

    fn remove(&mut self, addr: &A) -> Option<Arc<Peer<A>>> {
        let h = self.hash_of(addr);
        self.table
            .find_entry(h, |p| p.addr == *addr)
            .ok()
            .map(|e| e.remove().0)
    }

    fn len(&self) -> usize {
        self.table.len()
    }

    fn values(&self) -> impl Iterator<Item = &Arc<Peer<A>>> {
        self.table.iter()
    }
}

#[derive(Debug)]
struct Demux<A> {
    peers: PeerMap<A>,
    backlog: VecDeque<Arc<Peer<A>>>,
    /// Accepted connections marked silent, oldest mark first (entries of connections gone,
    /// closed or no longer silent are skipped when met; pruned at twice the peer cap).
    silent: VecDeque<std::sync::Weak<Peer<A>>>,
}

impl<A: DgramAddr> Demux<A> {
    /// Closes `peer` and removes it from the map if it is still `addr`'s peer (a new
    /// connection of the same address may have replaced it). Nothing if already closed.
    fn leave(&mut self, peer: &Arc<Peer<A>>) {
        if !peer.closed.swap(true, Ordering::AcqRel)
            && self
                .peers
                .get(&peer.addr)
                .is_some_and(|p| Arc::ptr_eq(p, peer))
        {
            self.peers.remove(&peer.addr);
        }
    }
}

/// A connection reading for itself in [`Shared::pump_for`].
struct Direct<'a, A> {
    peer: &'a Peer<A>,
    slots: &'a mut [Option<Bytes>],
}

/// Recognises a datagram that starts a session ([`chunnel::Listener::recognise_sessions`]).
type SessionOf = fn(&[u8]) -> Option<u64>;

/// State shared by a listener and its connections.
#[derive(Debug)]
pub(crate) struct Shared<S: DgramSocket> {
    sock: S,
    cfg: Config,
    demux: Mutex<Demux<S::Addr>>,
    rx: Mutex<RxScratch>,
    accept_notify: Notify,
    stats: Stats,
    /// Bytes queued for all peers ([`Config::queued_bytes`]).
    queued_bytes: Arc<AtomicUsize>,
    /// How to recognise a datagram that starts a session
    /// ([`chunnel::Listener::recognise_sessions`]).
    session_of: std::sync::OnceLock<SessionOf>,
    listener_open: AtomicBool,
    /// Which task, if any, waits for the socket to become readable ([`NO_READER`],
    /// [`ACCEPT_READER`], [`CONN_READER`]). Only that task waits on the socket; the others
    /// wait on their own queue's notification (or for the reader's place to fall vacant), so
    /// a datagram wakes one task, not every connection. A connection about to wait takes the
    /// place from `accept` (waking it through [`Shared::accept_waker`]) unless the datagrams
    /// coming in start new connections ([`Shared::fresh`]): the datagrams a connection reads
    /// for itself go straight into its slots, where those `accept` reads go through a queue
    /// and a wake-up of the connection's task. A looping `accept` keeps the place between
    /// calls ([`Shared::looping`]).
    reader: AtomicU8,
    /// Whether the last datagram sorted started a new connection. While it did (a stream of
    /// new peers, each sending one request: short-lived clients), a connection about to wait
    /// leaves the reader's place to `accept`, which those datagrams are for: a connection
    /// holding it would be woken for each of them only to queue it and wake `accept`.
    fresh: AtomicBool,
    /// `accept` is called in a loop ([`chunnel::Listener::accepting_in_loop`]): it keeps the
    /// reader's place between calls, and a connection holding the place hands it to
    /// `accept` once new peers are what comes in.
    accept_in_loop: AtomicBool,
    /// Held while the reader checks that it still is the reader and registers its task in
    /// the socket's one receive-waker slot ([`DgramSocket::poll_read_ready`]). A task that
    /// takes the place registers after it took it, so it registers after any task that
    /// still saw itself as the reader: the slot ends with the real reader's waker. (A
    /// readiness future per wait put a waiter in a locked list and took it out again: a
    /// few hundred instructions per wait, and its size in every receive future.)
    read_register: Mutex<()>,
    /// Connections waiting for the reader's place, oldest first (entries of connections that
    /// stopped waiting are skipped when met); `vacancy_waiters` connections still wait. A
    /// reader leaving the place wakes the first through the connection's own wake-up, so a
    /// waiting receive holds one registration, not two.
    vacancy: Mutex<VecDeque<std::sync::Weak<Peer<S::Addr>>>>,
    vacancy_waiters: AtomicUsize,
    /// `accept` waiting for the place to change hands: to fall vacant while a connection
    /// holds it, or to be taken from `accept` by a connection. One task, woken through a
    /// plain waker slot: while a connection serves requests the place changes hands once per
    /// request, and `accept` re-registers after every such wake-up.
    accept_waker: Mutex<Option<Waker>>,
    /// The origin of the connections' receive times (kept as nanoseconds since it).
    epoch: Instant,
    spill: SpillPool,
    idle: Mutex<IdleSweep<S::Addr>>,
}

/// A receive's wait for the reader's place (see [`Shared::want_place`]); it stops waiting on
/// drop. (A receive cancelled after the place was offered to it passes the offer on through
/// its [`ReaderGuard`], armed for that.)
struct Wanting<'a, S: DgramSocket> {
    shared: &'a Shared<S>,
    peer: &'a Peer<S::Addr>,
}

impl<S: DgramSocket> Drop for Wanting<'_, S> {
    fn drop(&mut self) {
        // The connection's last waiting receive takes it off the count; not if the place was
        // offered meanwhile (the offering reader reset the count and took it off).
        let last = self
            .peer
            .wants_place
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if last == Ok(1) {
            self.shared.vacancy_waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Nobody waits on the socket (see [`Shared::reader`]).
const NO_READER: u8 = 0;
/// `accept` waits on the socket; a connection about to wait takes the place from it.
const ACCEPT_READER: u8 = 1;
/// A connection waits on the socket.
const CONN_READER: u8 = 2;

/// A task's claim on the reader's place (see [`Shared::reader`]): `role` is the place it
/// holds ([`NO_READER`]: none). Dropped (also when the waiting future is cancelled), it gives
/// a held place up and wakes the tasks waiting to take it.
///
/// `armed` is set by a connection's `recv` that came back from waiting without the place: it
/// may have taken the one wake-up a vacant place sends. If it ends without taking the place
/// (its message was queued, or it read one for itself), the place may still be vacant with
/// connections waiting for it: on drop, after giving up any place of its own, one of them is
/// woken in its stead. (One struct for both, not two: every receive future holds it.)
struct ReaderGuard<'a, S: DgramSocket> {
    shared: &'a Shared<S>,
    role: u8,
    armed: bool,
}

impl<'a, S: DgramSocket> ReaderGuard<'a, S> {
    /// No place held, not armed.
    fn new(shared: &'a Shared<S>) -> Self {
        ReaderGuard {
            shared,
            role: NO_READER,
            armed: false,
        }
    }

    /// Whether a place is held.
    fn holds(&self) -> bool {
        self.role != NO_READER
    }

    /// Gives up the place held, as a drop does (nothing if none).
    fn release(&mut self) {
        let role = std::mem::replace(&mut self.role, NO_READER);
        self.shared.release_reader(role);
    }

    /// A connection's place goes to `accept` (which then holds it without a guard until it
    /// next waits: see `wait_readable`), and `accept` is woken to notice.
    fn hand_to_accept(&mut self) {
        let sh = self.shared;
        let role = std::mem::replace(&mut self.role, NO_READER);
        let handed = role == CONN_READER
            && sh
                .reader
                .compare_exchange(
                    CONN_READER,
                    ACCEPT_READER,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_ok();
        if !handed {
            sh.release_reader(role); // released as usual
        } else if sh.looping() {
            sh.wake_accept();
        } else {
            // The listener was dropped meanwhile (it closes, then releases an `accept` place;
            // this looks after taking one: one of the two sees the other). No `accept` will
            // come for the place: it is released as any.
            sh.release_reader(ACCEPT_READER);
        }
    }
}

impl<S: DgramSocket> Drop for ReaderGuard<'_, S> {
    fn drop(&mut self) {
        // The place first, so the next waiter is woken by that before `armed` is looked at.
        self.release();
        let sh = self.shared;
        if self.armed
            && sh.reader.load(Ordering::SeqCst) == NO_READER
            && sh.vacancy_waiters.load(Ordering::SeqCst) > 0
        {
            sh.offer_place();
        }
    }
}

impl<S: DgramSocket> Shared<S> {
    /// Gives up the reader's place held as `role` (nothing for [`NO_READER`]), waking the
    /// tasks waiting to take it.
    fn release_reader(&self, role: u8) {
        if role == NO_READER {
            return;
        }
        if role == ACCEPT_READER && self.looping() {
            // A looping `accept` keeps the place between calls, also when a call is
            // cancelled: its next call takes it up again (the caller's promise), and the
            // listener's drop gives it up.
            return;
        }
        // `accept` may have lost the place to a connection meanwhile: then it is not ours.
        if self
            .reader
            .compare_exchange(role, NO_READER, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            if role == CONN_READER {
                self.wake_accept();
            }
            // Pairs with the increment in `want_place`: a waiter this does not see sees the
            // place vacant.
            if self.vacancy_waiters.load(Ordering::SeqCst) > 0 {
                self.offer_place();
            }
        }
    }

    /// Lists `peer`'s connection as waiting for the reader's place, then counts it: a reader
    /// that sees the count finds it listed.
    fn want_place<'a>(&'a self, peer: &'a Arc<Peer<S::Addr>>) -> Wanting<'a, S> {
        // Under the list's lock, which `offer_place` takes too: the count, the entry and the
        // waiters change together.
        let mut q = lock(&self.vacancy);
        if peer.wants_place.fetch_add(1, Ordering::SeqCst) == 0 {
            // Entries of connections that stopped waiting are skipped when met; a list much
            // longer than the waiters is swept here (of those entries and of this peer's
            // older ones), so it stays bounded.
            let waiting = self.vacancy_waiters.load(Ordering::SeqCst);
            if q.len() > waiting.saturating_mul(2).saturating_add(16) {
                q.retain(|w| {
                    w.upgrade().is_some_and(|p| {
                        !Arc::ptr_eq(&p, peer) && p.wants_place.load(Ordering::SeqCst) > 0
                    })
                });
            }
            q.push_back(Arc::downgrade(peer));
            self.vacancy_waiters.fetch_add(1, Ordering::SeqCst);
        }
        drop(q);
        Wanting { shared: self, peer }
    }

    /// Wakes the connection that has waited longest for the reader's place, through its own
    /// wake-up: every receive of it that waits (they look at the place again; one takes it,
    /// the others wait again).
    fn offer_place(&self) {
        let mut q = lock(&self.vacancy);
        while let Some(w) = q.pop_front() {
            if let Some(p) = w.upgrade()
                && p.wants_place.swap(0, Ordering::SeqCst) > 0
            {
                self.vacancy_waiters.fetch_sub(1, Ordering::SeqCst);
                drop(q);
                p.notify.notify_waiters();
                return;
            }
        }
    }

    /// Now, as nanoseconds since [`Shared::epoch`].
    fn nanos_now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The instant `nanos` after [`Shared::epoch`].
    fn instant_of(&self, nanos: u64) -> Instant {
        self.epoch + Duration::from_nanos(nanos)
    }

    /// Puts a newly accepted connection under the idle sweep (started on first use; it
    /// ends when nothing is left to watch, or with the listener and its connections).
    fn watch_idle(self: &Arc<Self>, peer: &Arc<Peer<S::Addr>>, timeout: Duration) {
        let now = self.nanos_now();
        peer.last_rx.store(now, Ordering::Relaxed);
        let mut g = lock(&self.idle);
        g.due.push(IdleEntry {
            at: now.saturating_add(nanos(timeout)),
            peer: Arc::downgrade(peer),
        });
        if g.task.as_ref().is_none_or(|t| t.is_finished()) {
            g.task = Some(tokio::spawn(sweep_idle(Arc::downgrade(self), timeout)));
        }
    }

    /// Ends the connections idle for `timeout` as of `now`; those that are not are looked
    /// at again when they could be. Looks at no more than [`SWEEP_BATCH`] connections.
    /// Returns when to sweep next (`None`: nothing to watch; `now` itself: more are due).
    fn sweep_idle_once(&self, timeout: Duration, now: u64) -> Option<u64> {
        let timeout = nanos(timeout);
        for _ in 0..SWEEP_BATCH {
            let e = {
                let mut g = lock(&self.idle);
                match g.due.peek() {
                    Some(e) if e.at <= now => g.due.pop()?,
                    Some(e) => return Some(e.at),
                    None => {
                        g.task = None;
                        return None;
                    }
                }
            };
            let Some(peer) = e.peer.upgrade() else {
                continue; // the connection was dropped
            };
            let quiet_until = peer.last_rx.load(Ordering::Relaxed).saturating_add(timeout);
            let mut d = lock(&self.demux);
            // Looked at under the demux lock, which `close` takes too: a connection the
            // application closed meanwhile is not reported as idle.
            if peer.closed.load(Ordering::Acquire) {
                continue;
            }
            // Messages waiting to be read count as activity (the application is behind,
            // the peer is not silent). The queue is filled under the demux lock, so one
            // found empty here stays so until the connection has left the map.
            let at = if quiet_until > now {
                Some(quiet_until)
            } else if !lock(&peer.queue).is_empty() {
                Some(now.saturating_add(timeout))
            } else {
                None
            };
            if let Some(at) = at {
                drop(d);
                lock(&self.idle).due.push(IdleEntry { at, ..e });
                continue;
            }
            peer.idled.store(true, Ordering::Release);
            d.leave(&peer);
            drop(d);
            peer.notify.notify_waiters();
        }
        Some(now)
    }

    /// Whether `accept` is called in a loop (the caller's promise) on a listener not yet
    /// dropped: an `accept` place is then kept between calls and taken up again.
    fn looping(&self) -> bool {
        self.accept_in_loop.load(Ordering::SeqCst) && self.listener_open.load(Ordering::SeqCst)
    }

    /// Records whether the datagram just sorted started a new connection (see
    /// [`Shared::fresh`]); written only on a change.
    fn set_fresh(&self, fresh: bool) {
        if self.fresh.load(Ordering::Relaxed) != fresh {
            self.fresh.store(fresh, Ordering::Relaxed);
        }
    }

    /// Whether a connection about to wait may take the reader's place from `accept`: not
    /// while the datagrams coming in start new connections (see [`Shared::fresh`]).
    fn conn_may_take_from_accept(&self) -> bool {
        !self.fresh.load(Ordering::Relaxed)
    }

    /// Whether a connection about to wait would get the reader's place now (it is vacant, or
    /// `accept` holds it and may be asked to give it up).
    fn place_open_to_conn(&self) -> bool {
        match self.reader.load(Ordering::SeqCst) {
            NO_READER => true,
            ACCEPT_READER => self.conn_may_take_from_accept(),
            _ => false,
        }
    }

    /// Wakes `accept` if it waits for the reader's place to change hands.
    fn wake_accept(&self) {
        let w = lock(&self.accept_waker).take();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// Whether the reader's place is `held`; if so, registers `cx` to be woken when that
    /// changes (see [`Shared::accept_waker`]).
    fn accept_sees_held(&self, held: u8, cx: &mut std::task::Context<'_>) -> bool {
        if self.reader.load(Ordering::SeqCst) != held {
            return false;
        }
        {
            let mut w = lock(&self.accept_waker);
            match w.as_ref() {
                Some(old) if old.will_wake(cx.waker()) => {}
                _ => *w = Some(cx.waker().clone()),
            }
        }
        // Looked at again after registering: a change before the registration is seen here,
        // one after it takes the waker.
        self.reader.load(Ordering::SeqCst) == held
    }

    /// Waits until the socket may be readable — if no other task is already waiting for
    /// that — or until `other` completes, whichever comes first. Returns `other`'s output if
    /// it completed. `role` is [`ACCEPT_READER`] or [`CONN_READER`]: a connection takes the
    /// place from `accept`, which then stops waiting on the socket (`Ok(None)`) and waits
    /// for the place to fall vacant instead. A place taken is kept in `held`, across calls,
    /// until the caller drops it.
    ///
    /// A function returning an `async move` block (an `async fn` would keep its arguments
    /// twice), with its waits as plain `poll_fn`s: every receive future holds this one.
    // Not an `async fn`: it would keep its arguments twice in the future.
    #[allow(clippy::manual_async_fn)]
    fn wait_readable<'s, 'h, T, F>(
        &'s self,
        role: u8,
        held: &'h mut ReaderGuard<'s, S>,
        me: Option<&'h Arc<Peer<S::Addr>>>,
        mut other: F,
    ) -> impl Future<Output = io::Result<Option<T>>> + use<'s, 'h, T, F, S>
    where
        F: Future<Output = T> + Unpin,
    {
        async move {
            // A place kept from an earlier wait of the same caller is still ours unless a
            // connection took it from `accept`; then the stale guard is let go (its release finds
            // the place not ours and does nothing).
            if held.holds() && self.reader.load(Ordering::SeqCst) != role {
                held.release();
            }
            let taken = if held.holds() {
                Ok(role)
            } else {
                match self.reader.load(Ordering::SeqCst) {
                    NO_READER => self.reader.compare_exchange(
                        NO_READER,
                        role,
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    ),
                    // Kept by an earlier `accept` of the loop, or handed to it by a connection.
                    ACCEPT_READER if role == ACCEPT_READER => Ok(ACCEPT_READER),
                    ACCEPT_READER if role == CONN_READER && self.conn_may_take_from_accept() => {
                        let r = self.reader.compare_exchange(
                            ACCEPT_READER,
                            CONN_READER,
                            Ordering::SeqCst,
                            Ordering::SeqCst,
                        );
                        if r.is_ok() {
                            // `accept` stops waiting on the socket.
                            self.wake_accept();
                        }
                        r
                    }
                    other_role => Err(other_role),
                }
            };
            if taken.is_ok() {
                // Kept by the caller until it stops reading (returns, or is cancelled): a reader
                // that loops (it read datagrams for other connections, or nothing) keeps the place
                // instead of handing it to a waiting connection and taking it back.
                held.role = role;
                if role == ACCEPT_READER {
                    std::future::poll_fn(|cx| {
                        if let Poll::Ready(t) = Pin::new(&mut other).poll(cx) {
                            return Poll::Ready(Ok(Some(t)));
                        }
                        if !self.accept_sees_held(ACCEPT_READER, cx) {
                            return Poll::Ready(Ok(None)); // taken by a connection
                        }
                        self.poll_socket(ACCEPT_READER, cx).map(|r| r.map(|_| None))
                    })
                    .await
                } else {
                    std::future::poll_fn(|cx| {
                        // Readiness first, as the reason to be here.
                        if let Poll::Ready(r) = self.poll_socket(CONN_READER, cx) {
                            return Poll::Ready(r.map(|_| None));
                        }
                        Pin::new(&mut other).poll(cx).map(|t| Ok(Some(t)))
                    })
                    .await
                }
            } else if role == ACCEPT_READER {
                // A connection holds the place (and reads for everyone): `accept` waits for it to
                // fall vacant. That happens once per request a connection serves, and the
                // connection usually takes the place back before this task runs, so this path
                // is kept to a look and a registration.
                std::future::poll_fn(|cx| {
                    if let Poll::Ready(t) = Pin::new(&mut other).poll(cx) {
                        return Poll::Ready(Ok(Some(t)));
                    }
                    if self.accept_sees_held(CONN_READER, cx) {
                        Poll::Pending
                    } else {
                        Poll::Ready(Ok(None))
                    }
                })
                .await
            } else if taken == Err(ACCEPT_READER) && self.looping() {
                // A looping `accept` reads for this connection (new peers are coming in): only
                // this connection's own wake-up is waited for. `accept` keeps the place between
                // calls (a cancelled call too) until the listener is dropped, which closes first,
                // then wakes every connection (this one registered its wake-up before looking).
                Ok(Some(other.await))
            } else {
                // A connection waits for the place to fall vacant. Listed and counted before the
                // place is looked at again: a reader leaving after this offers it the place
                // through `other` (its own wake-up, registered by the caller); one that left
                // before it is seen here. (`accept` never comes here: it has no `me`.)
                let Some(me) = me else {
                    return Ok(Some(other.await));
                };
                let _wanting = self.want_place(me);
                if self.place_open_to_conn() {
                    return Ok(None);
                }
                // Armed while waiting: a receive cancelled after the place was offered to it
                // passes the offer on (its guard's drop) instead of losing it.
                held.armed = true;
                Ok(Some(other.await))
            }
        }
    }

    /// The reader's wait on the socket: ready (or no longer `role`'s place: the caller
    /// looks again), or pending with `cx` registered to be woken when it may be readable.
    fn poll_socket(&self, role: u8, cx: &mut std::task::Context<'_>) -> Poll<io::Result<()>> {
        let _registering = lock(&self.read_register);
        if self.reader.load(Ordering::SeqCst) != role {
            return Poll::Ready(Ok(()));
        }
        self.sock.poll_read_ready(cx)
    }

    /// Reads one batch from the socket and sorts it into peer queues (`accept`'s read: the
    /// new peers it finds are in the backlog when it looks next, so it is not notified).
    fn pump(&self) -> io::Result<usize> {
        self.pump_for(None).map(|(n, _)| n)
    }

    /// As [`Shared::pump`]; with `me`, datagrams from `me`'s peer go straight into `me`'s
    /// slots while its queue is empty (the calling connection reads them anyway: no queue, no
    /// wake-up, no lookup). Returns (datagrams read, delivered into the slots).
    fn pump_for(&self, mut me: Option<Direct<'_, S::Addr>>) -> io::Result<(usize, usize)> {
        // A connection reads (`accept` otherwise, which needs no notification of new peers).
        let conn_reads = me.is_some();
        let mut rx = lock(&self.rx);
        let fd = self.sock.as_raw_fd();
        let mut direct = 0;
        let n = self.sock.try_io_with(Interest::READABLE, || {
            rx.read::<S::Addr>(
                fd,
                &self.cfg,
                self.cfg.batch,
                true,
                &self.stats,
                |addr, m| {
                    let Some(addr) = addr else {
                        return; // unnamed sender: no way to answer it
                    };
                    if let Some(me) = me.as_mut()
                        && direct < me.slots.len()
                        && addr == me.peer.addr
                        && !me.peer.closed.load(Ordering::Acquire)
                    {
                        // Only while nothing older waits in the queue (order); the queue is
                        // filled only by pumps, and this one holds the receive lock.
                        if lock(&me.peer.queue).is_empty() {
                            me.slots[direct] = Some(m);
                            direct += 1;
                            self.set_fresh(false);
                            return;
                        }
                    }
                    // The queue is filled under the demux lock, so a connection that finds its
                    // queue empty under that lock and leaves the map can never miss a message.
                    let mut d = lock(&self.demux);
                    let known = match d.peers.get(&addr) {
                        Some(p) if self.starts_another_session(p, &m) => {
                            // A new client on a known address: the old connection ends (after
                            // what it has queued) and this datagram starts a new one.
                            let p = p.clone();
                            p.idled.store(true, Ordering::Release);
                            d.leave(&p);
                            p.notify.notify_waiters();
                            self.stats.new_sessions.fetch_add(1, Ordering::Relaxed);
                            None
                        }
                        known => known.cloned(),
                    };
                    let peer = match known {
                        Some(p) => p,
                        None => {
                            if !self.admit_new(&mut d) {
                                return;
                            }
                            // Nobody waits on a new peer's queue yet.
                            let session = self.session_of.get().and_then(|f| f(&m)).unwrap_or(0);
                            let mut q = PeerQueue::counted(&self.queued_bytes);
                            if q.has_room(&m, &self.cfg) {
                                q.push_back(m);
                                self.stats.queued.fetch_add(1, Ordering::Relaxed);
                            } else {
                                self.stats
                                    .dropped_queue_full
                                    .fetch_add(1, Ordering::Relaxed);
                            }
                            let p = self.new_peer(addr, q);
                            p.session.store(session, Ordering::Relaxed);
                            d.peers.insert(p.clone());
                            d.backlog.push_back(p);
                            drop(d);
                            if conn_reads {
                                self.accept_notify.notify_one();
                            }
                            self.set_fresh(true);
                            return;
                        }
                    };
                    self.set_fresh(false);
                    let mut q = lock(&peer.queue);
                    if !q.has_room(&m, &self.cfg) {
                        self.stats
                            .dropped_queue_full
                            .fetch_add(1, Ordering::Relaxed);
                    } else {
                        q.push_back(m);
                        self.stats.queued.fetch_add(1, Ordering::Relaxed);
                        drop(q);
                        drop(d);
                        peer.notify.notify_one();
                    }
                },
                |addr, prefix, len| self.note_oversized(addr, prefix, len, conn_reads),
            )
        })?;
        if direct > 0 {
            self.stats
                .direct
                .fetch_add(direct as u64, Ordering::Relaxed);
        }
        Ok((n, direct))
    }
}

impl<S: DgramSocket> Shared<S> {
    /// Whether a datagram from a new address may start a peer (demux lock held), making
    /// room first: while the table is more than half full, peers that waited for `accept`
    /// longer than [`SILENT_GRACE`] are evicted; at [`Config::max_peers`], the oldest peer
    /// still waiting for `accept` is, or the datagram is dropped and counted. Accepted
    /// connections are never evicted here.
    fn admit_new(&self, d: &mut Demux<S::Addr>) -> bool {
        if !self.listener_open.load(Ordering::Acquire) {
            self.stats
                .dropped_backlog_full
                .fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let cap = self.cfg.max_peers;
        if d.peers.len() > cap / 2 {
            let now = self.nanos_now();
            let grace = nanos(SILENT_GRACE);
            while let Some(p) = d.backlog.front() {
                if p.last_rx.load(Ordering::Relaxed).saturating_add(grace) > now {
                    break;
                }
                self.evict_front(d);
            }
        }
        if d.peers.len() >= cap && !self.evict_front(d) {
            self.stats.dropped_peer_cap.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        if d.backlog.len() >= self.cfg.backlog {
            self.stats
                .dropped_backlog_full
                .fetch_add(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Evicts the oldest peer waiting for `accept`, or else the accepted connection marked
    /// silent longest (its next `recv` reports [`Error::PeerClosed`]), demux lock held;
    /// whether there was one.
    fn evict_front(&self, d: &mut Demux<S::Addr>) -> bool {
        if let Some(p) = d.backlog.pop_front() {
            d.leave(&p);
        } else {
            let p = loop {
                let Some(w) = d.silent.pop_front() else {
                    return false;
                };
                if let Some(p) = w.upgrade() {
                    p.silent_listed.store(false, Ordering::Relaxed);
                    if p.silent.load(Ordering::Acquire) && !p.closed.load(Ordering::Acquire) {
                        break p;
                    }
                }
            };
            p.idled.store(true, Ordering::Release);
            d.leave(&p);
            p.notify.notify_waiters();
        }
        self.stats.evicted.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Whether `m`, queued for the known peer `p`, starts another session than `p`'s
    /// ([`chunnel::Listener::recognise_sessions`]); a peer without one yet takes `m`'s.
    /// Demux lock held.
    fn starts_another_session(&self, p: &Peer<S::Addr>, m: &[u8]) -> bool {
        let Some(id) = self.session_of.get().and_then(|f| f(m)) else {
            return false;
        };
        match p.session.load(Ordering::Relaxed) {
            0 => {
                p.session.store(id, Ordering::Relaxed);
                false
            }
            s => s != id,
        }
    }

    /// A new peer's state, stamped with its arrival (the grace under pressure counts from
    /// it; `accept` restamps it for the idle sweep).
    fn new_peer(&self, addr: S::Addr, q: PeerQueue) -> Arc<Peer<S::Addr>> {
        let p = Peer::new(addr, q);
        p.last_rx.store(self.nanos_now(), Ordering::Relaxed);
        Arc::new(p)
    }

    /// A datagram larger than `max_payload` from `addr`: its first bytes and length are kept
    /// (the latest one per peer) for the peer's connection to take
    /// ([`chunnel::PeerHandoff::take_oversized`]); from a new peer it starts a connection,
    /// as any datagram does, so `accept` hands it out and the layer above can answer.
    fn note_oversized(&self, addr: Option<S::Addr>, prefix: &[u8], len: usize, notify: bool) {
        let Some(addr) = addr else {
            return; // unnamed sender: no way to answer it
        };
        let ev = Box::new(chunnel::Oversized {
            prefix: Bytes::copy_from_slice(prefix),
            len,
            limit: self.cfg.max_payload,
        });
        let mut d = lock(&self.demux);
        if let Some(p) = d.peers.get(&addr) {
            lock(&p.queue).oversized = Some(ev);
            return;
        }
        if !self.admit_new(&mut d) {
            return;
        }
        let mut q = PeerQueue::counted(&self.queued_bytes);
        q.oversized = Some(ev);
        let p = self.new_peer(addr, q);
        d.peers.insert(p.clone());
        d.backlog.push_back(p);
        drop(d);
        if notify {
            self.accept_notify.notify_one();
        }
        self.set_fresh(true);
    }
}

/// Connections the idle sweep looks at before it lets other tasks run.
const SWEEP_BATCH: usize = 256;

/// A duration in [`Shared::nanos_now`] units.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The idle sweep of one listener: sleeps until the earliest connection could be idle.
async fn sweep_idle<S: DgramSocket>(shared: std::sync::Weak<Shared<S>>, timeout: Duration) {
    loop {
        let Some(sh) = shared.upgrade() else {
            return; // the listener and all its connections are gone
        };
        let now = sh.nanos_now();
        let Some(next) = sh.sweep_idle_once(timeout, now) else {
            return;
        };
        let at = sh.instant_of(next);
        drop(sh);
        if next <= now {
            // More are due: let other tasks run between batches.
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep_until(at).await;
        }
    }
}

/// The server side of a datagram datapath: one bound socket, a connection per peer.
#[derive(Debug)]
pub struct Listener<S: DgramSocket> {
    shared: Arc<Shared<S>>,
}

impl<S: DgramSocket> Listener<S> {
    pub(crate) fn new(sock: S, cfg: Config) -> Self {
        Listener {
            shared: Arc::new(Shared {
                sock,
                cfg,
                demux: Mutex::new(Demux {
                    peers: PeerMap::new(),
                    backlog: VecDeque::new(),
                    silent: VecDeque::new(),
                }),
                rx: Mutex::new(RxScratch::new(MAX_BATCH)),
                accept_notify: Notify::new(),
                stats: Stats::default(),
                queued_bytes: Arc::default(),
                session_of: std::sync::OnceLock::new(),
                listener_open: AtomicBool::new(true),
                reader: AtomicU8::new(NO_READER),
                fresh: AtomicBool::new(false),
                read_register: Mutex::new(()),
                accept_in_loop: AtomicBool::new(false),
                vacancy: Mutex::new(VecDeque::new()),
                vacancy_waiters: AtomicUsize::new(0),
                accept_waker: Mutex::new(None),
                epoch: Instant::now(),
                spill: SpillPool::default(),
                idle: Mutex::new(IdleSweep {
                    due: std::collections::BinaryHeap::new(),
                    task: None,
                }),
            }),
        }
    }

    /// The socket underneath (e.g. for its local address).
    pub fn get_ref(&self) -> &S {
        &self.shared.sock
    }

    /// Peers with live state on this listener (accepted or waiting to be accepted).
    pub fn peer_count(&self) -> usize {
        lock(&self.shared.demux).peers.len()
    }

    /// A handle that reads [`Listener::peer_count`] after the listener itself was moved
    /// away (into a serving loop, say).
    pub fn peer_counter(&self) -> PeerCounter<S> {
        PeerCounter(Arc::downgrade(&self.shared))
    }

    /// How received datagrams reached their connections so far: (read by the connection
    /// itself straight into its slots, sorted into a per-peer queue first). A connection that
    /// keeps calling `recv` reads its own datagrams; a queue means a task hop per datagram.
    pub fn delivery(&self) -> (u64, u64) {
        let s = &self.shared.stats;
        (
            s.direct.load(Ordering::Relaxed),
            s.queued.load(Ordering::Relaxed),
        )
    }

    /// Datagrams from known addresses that started another session than their address had
    /// ([`chunnel::Listener::recognise_sessions`]): each ended the old connection and started
    /// a new one.
    pub fn new_sessions(&self) -> u64 {
        self.shared.stats.new_sessions.load(Ordering::Relaxed)
    }

    /// Bytes of datagrams queued now for all peers (at most [`Config::queued_bytes`]).
    pub fn queued_bytes(&self) -> usize {
        self.shared.queued_bytes.load(Ordering::Relaxed)
    }

    /// Datagrams dropped so far: (over `max_payload`, peer queue full, backlog full).
    pub fn dropped(&self) -> (u64, u64, u64) {
        let s = &self.shared.stats;
        (
            s.dropped_oversize.load(Ordering::Relaxed),
            s.dropped_queue_full.load(Ordering::Relaxed),
            s.dropped_backlog_full.load(Ordering::Relaxed),
        )
    }

    /// What [`Config::max_peers`] did so far: (peers evicted to admit new ones: waiting for
    /// `accept`, or accepted and marked silent; datagrams from new peers dropped at the cap
    /// with no peer to evict).
    pub fn peer_cap_stats(&self) -> (u64, u64) {
        let s = &self.shared.stats;
        (
            s.evicted.load(Ordering::Relaxed),
            s.dropped_peer_cap.load(Ordering::Relaxed),
        )
    }
}

/// See [`Listener::peer_counter`].
#[derive(Debug)]
pub struct PeerCounter<S: DgramSocket>(std::sync::Weak<Shared<S>>);

impl<S: DgramSocket> Clone for PeerCounter<S> {
    fn clone(&self) -> Self {
        PeerCounter(self.0.clone())
    }
}

impl<S: DgramSocket> PeerCounter<S> {
    /// The listener's [`Listener::peer_count`] now; 0 once the listener and all of its
    /// connections are gone.
    pub fn count(&self) -> usize {
        self.0.upgrade().map_or(0, |sh| lock(&sh.demux).peers.len())
    }

    /// The listener's [`Listener::peer_cap_stats`] now; (0, 0) once the listener and all of
    /// its connections are gone.
    pub fn peer_cap_stats(&self) -> (u64, u64) {
        self.0.upgrade().map_or((0, 0), |sh| {
            (
                sh.stats.evicted.load(Ordering::Relaxed),
                sh.stats.dropped_peer_cap.load(Ordering::Relaxed),
            )
        })
    }
}

impl<S: DgramSocket> Drop for Listener<S> {
    fn drop(&mut self) {
        // Connections already accepted keep working; new peers are no longer admitted, and
        // peers nobody accepted are forgotten.
        // Closed before the place is given up (see `ReaderGuard::hand_to_accept`).
        self.shared.listener_open.store(false, Ordering::SeqCst);
        {
            let mut d = lock(&self.shared.demux);
            let pending: Vec<_> = d.backlog.drain(..).collect();
            for p in pending {
                d.peers.remove(&p.addr);
            }
        }
        // A place `accept` kept between calls (or was handed) is given up as any reader
        // gives it up (the listener is closed: `looping` is false now): a waiting connection
        // takes it. Nothing if `accept` does not hold it.
        self.shared.release_reader(ACCEPT_READER);
        if self.shared.accept_in_loop.load(Ordering::Relaxed) {
            // Connections that left the reading to the looping `accept` wait on their own
            // wake-up only (see `wait_readable`): all are woken to take over.
            let peers: Vec<_> = lock(&self.shared.demux).peers.values().cloned().collect();
            for p in peers {
                p.notify.notify_waiters();
            }
        }
    }
}

impl<S: DgramSocket> chunnel::Listener for Listener<S> {
    type Connection = ServerConnection<S>;

    async fn accept(&mut self) -> Result<ServerConnection<S>, Error> {
        let sh = &self.shared;
        // Registered once and kept until it fires: this task is woken whenever the reader's
        // place falls vacant (once per datagram a connection reads), and re-registering on
        // every such wake-up was most of what the wake-up cost.
        let notified = sh.accept_notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // The reader's place, once taken, is kept until this call returns; in a loop, until
        // the next call (unless a connection took it meanwhile): see `wait_readable`.
        let mut held = ReaderGuard::new(sh);
        loop {
            let next = lock(&sh.demux).backlog.pop_front();
            if let Some(peer) = next {
                if let Some(t) = sh.cfg.idle_timeout {
                    sh.watch_idle(&peer, t);
                }
                // A looping `accept` keeps the place (the guard's drop leaves it): the next call
                // takes it up again.
                return Ok(ServerConnection {
                    shared: sh.clone(),
                    peer,
                });
            }
            // While a connection waits on the socket it reads (and sorts new peers into the
            // backlog) for everyone: reading here too would only cost a system call on every
            // wake-up (the reader's place falling vacant wakes this task once per datagram
            // the reader takes). Once the place is free, `wait_readable` takes it; tokio's
            // readiness is only cleared by a read that would block, so nothing is missed.
            // A connection may have taken the place from us (see `wait_readable`).
            if held.holds() && sh.reader.load(Ordering::SeqCst) != ACCEPT_READER {
                held.release();
            }
            if held.holds() || sh.reader.load(Ordering::Acquire) != CONN_READER {
                match sh.pump() {
                    Ok(_) => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    // An error for one peer (e.g. a refused earlier send) must not stop the
                    // listener: it is consumed and the loop goes on.
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => continue,
                    Err(e) => {
                        return Err(Error::Io {
                            op: "accept",
                            source: e,
                        });
                    }
                }
            }
            let fired = sh
                .wait_readable(ACCEPT_READER, &mut held, None, notified.as_mut())
                .await
                .map_err(|e| Error::Io {
                    op: "accept",
                    source: e,
                })?;
            if fired.is_some() {
                notified.set(sh.accept_notify.notified());
                notified.as_mut().enable();
            }
        }
    }

    fn recognise_sessions(&mut self, session_of: fn(&[u8]) -> Option<u64>) {
        let _ = self.shared.session_of.set(session_of);
    }

    fn accepting_in_loop(&mut self) {
        self.shared.accept_in_loop.store(true, Ordering::Relaxed);
    }
}

/// A server-side connection to one peer of a [`Listener`].
#[derive(Debug)]
pub struct ServerConnection<S: DgramSocket> {
    shared: Arc<Shared<S>>,
    /// The peer's state on the listener, its address included.
    peer: Arc<Peer<S::Addr>>,
}

impl<S: DgramSocket> ServerConnection<S> {
    /// Closes the connection and frees its state on the listener; later calls fail with
    /// [`Error::Closed`]. A datagram the same peer sends afterwards starts a new connection.
    pub fn close(&self) {
        let mut d = lock(&self.shared.demux);
        self.leave(&mut d);
        drop(d);
        self.peer.notify.notify_waiters();
    }

    /// Removes this peer from the listener (demux lock held).
    fn leave(&self, d: &mut Demux<S::Addr>) {
        d.leave(&self.peer);
    }

    /// The error of a closed connection: [`Error::PeerClosed`] the first time after the
    /// idle sweep closed it, [`Error::Closed`] otherwise.
    fn closed_error(&self) -> Error {
        if self.peer.idled.swap(false, Ordering::AcqRel) {
            Error::PeerClosed
        } else {
            Error::Closed
        }
    }

    fn drain(&self, slots: &mut [Option<Bytes>]) -> usize {
        let mut q = lock(&self.peer.queue);
        let mut n = 0;
        for s in slots.iter_mut() {
            match q.pop_front() {
                Some(m) => *s = Some(m),
                None => break,
            }
            n += 1;
        }
        n
    }
}

impl<S: DgramSocket> Drop for ServerConnection<S> {
    fn drop(&mut self) {
        self.close();
    }
}

impl<S: DgramSocket> chunnel::PeerHandoff for ServerConnection<S> {
    fn hand_off(&self, first: Bytes) -> bool {
        let sh = &self.shared;
        let mut d = lock(&sh.demux);
        self.leave(&mut d);
        let admitted = sh.listener_open.load(Ordering::Acquire)
            && d.backlog.len() < sh.cfg.backlog
            && !d.peers.contains(&self.peer.addr);
        if admitted {
            let p = sh.new_peer(
                self.peer.addr.clone(),
                PeerQueue::one(first, &sh.queued_bytes),
            );
            d.peers.insert(p.clone());
            d.backlog.push_back(p);
            sh.accept_notify.notify_one();
        }
        drop(d);
        self.peer.notify.notify_waiters();
        admitted
    }

    /// As [`ServerConnection::close`]: the peer leaves the listener's table now.
    fn release(&self) {
        self.close();
    }

    fn take_oversized(&self) -> Option<chunnel::Oversized> {
        lock(&self.peer.queue).oversized.take().map(|b| *b)
    }

    /// A silent connection is listed; at [`Config::max_peers`], with no new peer waiting for
    /// `accept`, a new peer evicts the one marked longest ago.
    fn mark_silent(&self, silent: bool) {
        self.peer.silent.store(silent, Ordering::Release);
        if !silent {
            return; // its entry, if any, is skipped or pruned when met
        }
        let cap = self.shared.cfg.max_peers;
        let mut d = lock(&self.shared.demux);
        if self.peer.silent_listed.swap(true, Ordering::Relaxed) {
            return;
        }
        // Entries of connections gone, closed or no longer silent are dropped at twice the
        // cap (each live connection is listed at most once, so the list stays under it).
        if d.silent.len() >= cap.saturating_mul(2) {
            d.silent.retain(|w| {
                w.upgrade().is_some_and(|p| {
                    let keep =
                        p.silent.load(Ordering::Acquire) && !p.closed.load(Ordering::Acquire);
                    if !keep {
                        p.silent_listed.store(false, Ordering::Relaxed);
                    }
                    keep
                })
            });
        }
        d.silent.push_back(Arc::downgrade(&self.peer));
    }

    /// More than half of [`Config::max_peers`] in use.
    fn crowded(&self) -> bool {
        lock(&self.shared.demux).peers.len() > self.shared.cfg.max_peers / 2
    }

    fn take_queued(&self) -> Option<Bytes> {
        let m = lock(&self.peer.queue).pop_front()?;
        self.peer
            .last_rx
            .store(self.shared.nanos_now(), Ordering::Relaxed);
        Some(m)
    }
}

impl<S: DgramSocket> SendHeader for ServerConnection<S> {
    fn send_with_header<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        let sh = &self.shared;
        send_burst(
            &sh.sock,
            &sh.cfg,
            Some(&self.peer.addr),
            &self.peer.addr,
            header,
            burst,
            &sh.spill,
            Some(&self.peer.closed),
        )
    }

    fn try_send_with_header(&self, header: &[u8], msg: &Bytes) -> Option<Result<(), Error>> {
        if self.peer.closed.load(Ordering::Acquire) {
            return Some(Err(Error::Closed));
        }
        let sh = &self.shared;
        try_send_now(
            &sh.sock,
            &sh.cfg,
            Some(&self.peer.addr),
            &self.peer.addr,
            header,
            msg,
        )
    }
}

impl<S: DgramSocket> ChunnelConnection for ServerConnection<S> {
    type Data = Bytes;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        let sh = &self.shared;
        send_burst(
            &sh.sock,
            &sh.cfg,
            Some(&self.peer.addr),
            &self.peer.addr,
            &[],
            burst,
            &sh.spill,
            Some(&self.peer.closed),
        )
    }

    // Not an `async fn`: it would keep its arguments twice in the future.
    #[allow(clippy::manual_async_fn)]
    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Bytes>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        async move {
            if slots.is_empty() {
                return Ok(0);
            }
            // The reader's place, once taken, is kept until this call returns (or handed to a
            // looping `accept` while new peers come in): woken for other connections' datagrams,
            // this one sorts them out and waits again, without handing the place to another
            // waiting connection (a wake-up of that one's task) and taking it back.
            let mut held = ReaderGuard::new(&self.shared);
            loop {
                let n = self.drain(slots);
                if n > 0 {
                    self.peer
                        .last_rx
                        .store(self.shared.nanos_now(), Ordering::Relaxed);
                    return Ok(n);
                }
                if self.peer.closed.load(Ordering::Acquire) {
                    return Err(self.closed_error());
                }
                // As in `accept`: another connection waiting on the socket reads for this one
                // too. One that finds `accept` there reads for itself (and then takes its place),
                // unless new peers are what comes in: then `accept` keeps reading for everyone.
                if held.holds() || self.shared.place_open_to_conn() {
                    let me = Direct {
                        peer: &self.peer,
                        slots: &mut *slots,
                    };
                    match self.shared.pump_for(Some(me)) {
                        Ok((_, 0)) => {
                            // New peers coming in, for an `accept` that loops: the place goes to
                            // it, so their next datagrams wake it directly, not this task first.
                            if held.holds()
                                && !self.shared.conn_may_take_from_accept()
                                && self.shared.looping()
                            {
                                held.hand_to_accept();
                            }
                            continue;
                        }
                        Ok((_, direct)) => {
                            self.peer
                                .last_rx
                                .store(self.shared.nanos_now(), Ordering::Relaxed);
                            return Ok(direct);
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => continue,
                        Err(e) => return Err(conn_err("recv", &self.peer.addr, e)),
                    }
                }
                // About to wait: register for this connection's wake-ups first, then look once
                // more (a message queued, or a close, between the look above and now is seen
                // here; one after it wakes the registration). The idle sweep closes the
                // connection and wakes it the same way.
                let notified = self.peer.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if !lock(&self.peer.queue).is_empty() || self.peer.closed.load(Ordering::Acquire) {
                    continue;
                }
                self.shared
                    .wait_readable(CONN_READER, &mut held, Some(&self.peer), notified)
                    .await
                    .map_err(|e| conn_err("recv", &self.peer.addr, e))?;
                // Back without the place: this call may have taken the wake-up that a vacant place
                // sends one waiting connection.
                held.armed = !held.holds();
            }
        }
    }
}

/// No state to hand over: a client connection delivers every datagram it reads in the same
/// `recv` call (its scratch area is sized to the caller's slots), so nothing received waits in
/// it between calls. Below [`chunnel::Shared`] it outlives a switch anyway; as a branch of a
/// reconfigurable select, datagrams still in the old socket's kernel queue go with that socket.
impl<S: DgramSocket> chunnel::Handover for Connection<S> {
    fn export(&self, _: &mut chunnel::Handoff<Self::Data>) {}
    fn import(&self, _: &mut chunnel::Handoff<Self::Data>) {}
}

/// No state to hand over. Received datagrams do wait in this connection's per-peer queue on
/// the listener, but a server connection is never itself a select branch (it comes from
/// `accept`, not from a Chunnel); under a reconfigurable select it sits below
/// [`chunnel::Shared`], so the queue outlives the switch and the new branch reads it. Exporting
/// the queue would only move it, needlessly, into the switch's carry-over queue.
impl<S: DgramSocket> chunnel::Handover for ServerConnection<S> {
    fn export(&self, _: &mut chunnel::Handoff<Self::Data>) {}
    fn import(&self, _: &mut chunnel::Handoff<Self::Data>) {}
}

macro_rules! peer_addr {
    ($sock:ty, $addr:ty, $($conn:ident . $($field:ident).+),+) => {$(
        impl $conn<$sock> {
            /// The peer this connection talks to.
            pub fn peer_addr(&self) -> &$addr {
                &self.$($field).+
            }
        }
    )+};
}

peer_addr!(
    tokio::net::UdpSocket,
    std::net::SocketAddr,
    Connection.peer,
    ServerConnection.peer.addr
);
peer_addr!(
    tokio::net::UnixDatagram,
    sys::UnixAddr,
    Connection.peer,
    ServerConnection.peer.addr
);

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Poll, Wake, Waker};

    use super::*;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counter() -> (Arc<Count>, Waker) {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        (Arc::clone(&c), Waker::from(c))
    }

    /// The peer table finds each peer by its address through growth, replaces a peer of the
    /// same address, and forgets what is removed.
    #[test]
    fn peer_map_finds_peers_by_their_own_address() {
        let addr = |i: u16| std::net::SocketAddr::from(([127, 0, 0, 1], i));
        let mut m = PeerMap::new();
        for i in 1..=3000 {
            m.insert(Arc::new(Peer::new(addr(i), PeerQueue::default())));
        }
        assert_eq!(m.len(), 3000);
        for i in 1..=3000 {
            assert_eq!(m.get(&addr(i)).map(|p| p.addr), Some(addr(i)));
        }
        assert!(!m.contains(&addr(3001)));
        let again = Arc::new(Peer::new(
            addr(7),
            PeerQueue::one(Bytes::from_static(b"x"), &Arc::default()),
        ));
        m.insert(Arc::clone(&again));
        assert_eq!(m.len(), 3000, "replaced, not added");
        assert!(Arc::ptr_eq(m.get(&addr(7)).expect("there"), &again));
        for i in (1..=3000).step_by(2) {
            assert_eq!(m.remove(&addr(i)).map(|p| p.addr), Some(addr(i)));
        }
        assert_eq!(m.remove(&addr(1)).map(|p| p.addr), None);
        assert_eq!(m.len(), 1500);
        assert_eq!(m.values().filter(|p| p.addr.port() % 2 == 0).count(), 1500);
    }

    /// A peer's queue keeps arrival order across its inline first slot and the rest, however
    /// pushes and pops interleave.
    #[test]
    fn peer_queue_is_first_in_first_out() {
        let mut q = PeerQueue::default();
        let mut model = std::collections::VecDeque::new();
        let mut next = 0u32;
        // A fixed pattern of pushes (true) and pops (false).
        for (i, push) in [
            true, false, true, true, false, true, true, true, false, false,
        ]
        .iter()
        .cycle()
        .take(200)
        .enumerate()
        {
            if *push || i % 7 == 0 {
                let m = Bytes::from(next.to_be_bytes().to_vec());
                next += 1;
                q.push_back(m.clone());
                model.push_back(m);
            } else {
                assert_eq!(q.pop_front(), model.pop_front());
            }
            assert_eq!(q.len(), model.len());
            assert_eq!(q.is_empty(), model.is_empty());
        }
        while let Some(m) = model.pop_front() {
            assert_eq!(q.pop_front(), Some(m));
        }
        assert!(q.pop_front().is_none() && q.is_empty());
    }

    /// A task that still acts as the reader after the place changed hands does not
    /// register in the socket's one receive-waker slot: the new reader's registration stays,
    /// and a datagram wakes the new reader. (Registering without the check overwrote it, and
    /// the new reader slept through the datagram.)
    #[tokio::test(flavor = "current_thread")]
    async fn a_stale_reader_does_not_take_the_receive_waker_slot() {
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let l = Listener::new(sock, crate::udp::Config::default());
        let sh = &l.shared;
        // Nothing to read yet: a read clears any readiness the runtime assumed.
        assert!(sh.pump().is_err());
        let (old, old_waker) = counter();
        let (new, new_waker) = counter();
        sh.reader.store(ACCEPT_READER, Ordering::SeqCst);
        let mut old_cx = Context::from_waker(&old_waker);
        assert!(sh.poll_socket(ACCEPT_READER, &mut old_cx).is_pending());
        // A connection takes the place and registers.
        sh.reader.store(CONN_READER, Ordering::SeqCst);
        let mut new_cx = Context::from_waker(&new_waker);
        assert!(sh.poll_socket(CONN_READER, &mut new_cx).is_pending());
        // The old reader polls again before it notices: told to look again, not registered.
        assert!(matches!(
            sh.poll_socket(ACCEPT_READER, &mut old_cx),
            Poll::Ready(Ok(()))
        ));
        let peer = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        peer.send_to(b"x", addr).unwrap();
        // Let the runtime see the datagram.
        for _ in 0..100 {
            if new.0.load(Ordering::SeqCst) > 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(
            new.0.load(Ordering::SeqCst),
            1,
            "the new reader was not woken"
        );
        assert_eq!(old.0.load(Ordering::SeqCst), 0);
        sh.reader.store(NO_READER, Ordering::SeqCst);
    }

    /// A listener with `n` accepted connections, each having read its first datagram, and
    /// their clients.
    async fn accepted(
        n: usize,
    ) -> (
        Listener<tokio::net::UdpSocket>,
        Vec<tokio::net::UdpSocket>,
        Vec<Arc<ServerConnection<tokio::net::UdpSocket>>>,
    ) {
        use chunnel::Listener as _;
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let to = sock.local_addr().unwrap();
        let mut l = Listener::new(sock, crate::udp::Config::default());
        let (mut cs, mut ss) = (Vec::new(), Vec::new());
        for i in 0..n {
            let c = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
            c.connect(to).await.unwrap();
            c.send(&[i as u8]).await.unwrap();
            let s = Arc::new(l.accept().await.unwrap());
            let mut sl = [None];
            assert_eq!(s.recv(&mut sl).await.unwrap(), 1);
            cs.push(c);
            ss.push(s);
        }
        assert_eq!(l.shared.reader.load(Ordering::SeqCst), NO_READER);
        (l, cs, ss)
    }

    /// A task receiving one datagram on `s`; its first byte.
    fn receiving(s: Arc<ServerConnection<tokio::net::UdpSocket>>) -> tokio::task::JoinHandle<u8> {
        tokio::spawn(async move {
            let mut sl = [None];
            s.recv(&mut sl).await.unwrap();
            sl[0].take().unwrap()[0]
        })
    }

    const SETTLE: std::time::Duration = std::time::Duration::from_millis(100);
    const WAIT: std::time::Duration = std::time::Duration::from_secs(3);

    /// Two receives on one connection both wait for the reader's place: both are served (a
    /// per-connection flag, not a count, left the second unlisted and asleep).
    #[tokio::test]
    async fn two_receives_of_one_connection_both_get_the_place() {
        let (l, cs, ss) = accepted(2).await;
        let holder = receiving(ss[1].clone());
        tokio::time::sleep(SETTLE).await;
        assert_eq!(l.shared.reader.load(Ordering::SeqCst), CONN_READER);
        let (t1, t2) = (receiving(ss[0].clone()), receiving(ss[0].clone()));
        tokio::time::sleep(SETTLE).await;
        cs[1].send(b"x").await.unwrap();
        assert_eq!(holder.await.unwrap(), b'x');
        tokio::time::sleep(SETTLE).await;
        cs[0].send(b"1").await.unwrap();
        tokio::time::sleep(SETTLE).await;
        cs[0].send(b"2").await.unwrap();
        let both = async { (t1.await.unwrap(), t2.await.unwrap()) };
        let mut got = tokio::time::timeout(WAIT, both)
            .await
            .map(|(a, b)| [a, b])
            .expect("both receives of the connection get a datagram");
        got.sort_unstable();
        assert_eq!(got, [b'1', b'2']);
    }

    /// A receive offered the reader's place and cancelled before it ran passes the offer on:
    /// the next waiting connection gets the place (it was lost, and the socket unread).
    #[tokio::test]
    async fn an_offer_to_a_cancelled_receive_goes_to_the_next_waiter() {
        let (l, cs, ss) = accepted(3).await;
        let holder = receiving(ss[1].clone());
        tokio::time::sleep(SETTLE).await;
        assert_eq!(l.shared.reader.load(Ordering::SeqCst), CONN_READER);
        let mut sl = [None];
        let mut first = Box::pin(ss[0].recv(&mut sl));
        // Polled once: listed first.
        let mut cx = Context::from_waker(Waker::noop());
        assert!(first.as_mut().poll(&mut cx).is_pending());
        let second = receiving(ss[2].clone()); // listed second
        tokio::time::sleep(SETTLE).await;
        assert_eq!(l.shared.vacancy_waiters.load(Ordering::SeqCst), 2);
        cs[1].send(b"x").await.unwrap();
        assert_eq!(holder.await.unwrap(), b'x');
        // The place was offered to the first, which is cancelled without running.
        drop(first);
        cs[2].send(b"y").await.unwrap();
        let got = tokio::time::timeout(WAIT, second).await;
        assert_eq!(
            got.expect("the second waiter reads its datagram").unwrap(),
            b'y'
        );
    }

    /// A connection waiting for the reader's place is offered it through its own wake-up,
    /// once; one that stopped waiting is skipped; the list of waiters stays bounded however
    /// often connections start and stop waiting.
    #[tokio::test]
    async fn the_place_is_offered_to_a_waiting_connection_through_its_own_wake_up() {
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let l = Listener::new(sock, crate::udp::Config::default());
        let sh = &l.shared;
        let addr = |i: u16| std::net::SocketAddr::from(([127, 0, 0, 1], i));
        let (a, b) = (
            Arc::new(Peer::new(addr(1), PeerQueue::default())),
            Arc::new(Peer::new(addr(2), PeerQueue::default())),
        );
        for _ in 0..1000 {
            drop(sh.want_place(&a));
        }
        assert_eq!(sh.vacancy_waiters.load(Ordering::SeqCst), 0);
        assert!(lock(&sh.vacancy).len() <= 17, "swept as it grows");
        let gone = sh.want_place(&a);
        let waiting = sh.want_place(&b);
        drop(gone); // `a` stops waiting: skipped
        assert_eq!(sh.vacancy_waiters.load(Ordering::SeqCst), 1);
        let woken = b.notify.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        sh.offer_place();
        assert_eq!(sh.vacancy_waiters.load(Ordering::SeqCst), 0);
        assert_eq!(b.wants_place.load(Ordering::SeqCst), 0);
        tokio::time::timeout(std::time::Duration::from_secs(5), woken)
            .await
            .expect("the waiting connection is woken");
        // Offered already: stopping its wait does not count it off twice.
        drop(waiting);
        assert_eq!(sh.vacancy_waiters.load(Ordering::SeqCst), 0);
        sh.offer_place(); // nobody waits: nothing
        assert_eq!(sh.vacancy_waiters.load(Ordering::SeqCst), 0);
    }
}
