//! The io_uring driver behind every socket of this crate: one ring per socket, driven inline by
//! whichever task needs it. This module holds all of the crate's `unsafe` code.
//!
//! * **Receive**: one multishot `RecvMsg` request (`IORING_RECV_MULTISHOT`) draws buffers from
//!   a provided-buffer ring (`IORING_REGISTER_PBUF_RING`) registered once at set-up. Each
//!   datagram posts one completion naming its buffer; the reaper copies the payload into a
//!   compact `BytesMut` block (the one copy on the receive path) and hands the buffer straight
//!   back to the kernel by bumping the buffer ring's tail — no system call, no allocation.
//!   A single multishot request also keeps datagrams in socket order (several one-shot
//!   requests completing on different threads could reorder them).
//! * **Send**: every message of a burst becomes a `SendMsg` entry whose `iovec` points at the
//!   caller's `Bytes` (no copy); the entries are linked (`IOSQE_IO_LINK`) so they go out in
//!   order even when the socket buffer is full, and the whole batch is submitted with one
//!   `io_uring_enter`. The `msghdr`, `iovec`s, address and the `Bytes` live in a preallocated
//!   slot owned by the ring until the completion is reaped, so a cancelled `send` future never
//!   leaves the kernel pointing at freed memory.
//! * **Readiness**: the ring's file descriptor is registered with tokio (`AsyncFd`); it turns
//!   readable when completions are posted. Only one task at a time waits on it (as in
//!   `chunnel_net::datagram`), the others wait for their own notification.

use std::alloc::{self, Layout};
use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::mem::{self, ManuallyDrop, MaybeUninit};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use chunnel::Error;
use io_uring::{IoUring, cqueue, opcode, squeue, types};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use crate::udp::Config;

/// The most messages submitted with one `io_uring_enter`.
pub(crate) const MAX_BATCH: usize = 64;

/// `user_data` of the multishot receive.
const RECV_TAG: u64 = u64::MAX;
/// `user_data` of cancellations (set-up probe and teardown).
const CANCEL_TAG: u64 = u64::MAX - 1;
/// The provided-buffer group id (one group per ring).
const BGID: u16 = 0;
/// `struct io_uring_recvmsg_out`, which starts every multishot `RecvMsg` buffer.
const RECVMSG_OUT: usize = 16;
/// Room for a socket address in a receive buffer and a send slot (`sockaddr_in6`).
const NAME_LEN: usize = 28;
/// Header bytes a send slot holds inline (`SendHeader` tags are 1 byte).
const INLINE_HEADER: usize = 32;
/// How long teardown waits for the kernel to give back memory before leaking it instead.
const TEARDOWN_WAIT: Duration = Duration::from_secs(2);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind; keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ------------------------------------------------------------------------------------------
// Socket addresses, as bytes (no unsafe: the kernel reads and writes them through pointers).

/// Encodes `addr` as a `sockaddr_in` / `sockaddr_in6` into `out`; returns its length.
pub(crate) fn encode_addr(addr: &SocketAddr, out: &mut [u8; NAME_LEN]) -> u32 {
    *out = [0; NAME_LEN];
    match addr {
        SocketAddr::V4(a) => {
            out[0..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
            out[2..4].copy_from_slice(&a.port().to_be_bytes());
            out[4..8].copy_from_slice(&a.ip().octets());
            mem::size_of::<libc::sockaddr_in>() as u32
        }
        SocketAddr::V6(a) => {
            out[0..2].copy_from_slice(&(libc::AF_INET6 as u16).to_ne_bytes());
            out[2..4].copy_from_slice(&a.port().to_be_bytes());
            // sin6_flowinfo is stored as given, like the standard library does.
            out[4..8].copy_from_slice(&a.flowinfo().to_ne_bytes());
            out[8..24].copy_from_slice(&a.ip().octets());
            out[24..28].copy_from_slice(&a.scope_id().to_ne_bytes());
            mem::size_of::<libc::sockaddr_in6>() as u32
        }
    }
}

/// Decodes a `sockaddr_in` / `sockaddr_in6` written by the kernel.
pub(crate) fn decode_addr(b: &[u8]) -> Option<SocketAddr> {
    let family = u16::from_ne_bytes(b.get(0..2)?.try_into().ok()?);
    let port = u16::from_be_bytes(b.get(2..4)?.try_into().ok()?);
    match i32::from(family) {
        libc::AF_INET => {
            let ip: [u8; 4] = b.get(4..8)?.try_into().ok()?;
            Some(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(ip), port)))
        }
        libc::AF_INET6 => {
            let flow = u32::from_ne_bytes(b.get(4..8)?.try_into().ok()?);
            let ip: [u8; 16] = b.get(8..24)?.try_into().ok()?;
            let scope = u32::from_ne_bytes(b.get(24..28)?.try_into().ok()?);
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(ip),
                port,
                flow,
                scope,
            )))
        }
        _ => None,
    }
}

// ------------------------------------------------------------------------------------------
// Memory the kernel reads and writes.

/// A heap block with a chosen alignment, freed on drop (unless leaked).
struct Block {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl Block {
    fn new(size: usize, align: usize, zeroed: bool) -> io::Result<Self> {
        let layout = Layout::from_size_align(size.max(1), align)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe {
            if zeroed {
                alloc::alloc_zeroed(layout)
            } else {
                alloc::alloc(layout)
            }
        };
        let ptr = NonNull::new(raw).ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        Ok(Block { ptr, layout })
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: allocated in `Block::new` with this layout and not freed since.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// One entry of a provided-buffer ring (`struct io_uring_buf`). The `resv` field of entry 0
/// doubles as the ring's tail (`struct io_uring_buf_ring`).
#[repr(C)]
struct RawBuf {
    addr: u64,
    len: u32,
    bid: u16,
    resv: u16,
}

/// The receive buffers: `count` buffers of `len` bytes in one never-zeroed arena, lent to the
/// kernel through a registered buffer ring.
struct BufPool {
    ring: Block,
    arena: Block,
    count: u16,
    len: usize,
    tail: u16,
}

impl BufPool {
    fn new(count: u16, len: usize) -> io::Result<Self> {
        debug_assert!(count.is_power_of_two());
        // The ring must be page aligned; it is zeroed so the tail starts at 0.
        let ring = Block::new(usize::from(count) * mem::size_of::<RawBuf>(), 4096, true)?;
        // Never zeroed: the kernel writes a buffer before we read it, and only the bytes it
        // reports writing are read. Pages are only touched where datagrams land.
        let arena = Block::new(usize::from(count) * len, 64, false)?;
        let mut pool = BufPool {
            ring,
            arena,
            count,
            len,
            tail: 0,
        };
        for bid in 0..count {
            pool.give(bid);
        }
        pool.publish();
        Ok(pool)
    }

    fn buf_ptr(&self, bid: u16) -> *mut u8 {
        // SAFETY: bid < count, so the offset stays inside the arena.
        unsafe { self.arena.ptr.as_ptr().add(usize::from(bid) * self.len) }
    }

    /// The first `n` bytes of buffer `bid`, which the kernel reported writing.
    ///
    /// # Safety
    ///
    /// The kernel must have written at least `n` bytes into buffer `bid` (a completion said
    /// so), and the buffer must not have been given back to the kernel since.
    unsafe fn filled(&self, bid: u16, n: usize) -> &[u8] {
        let n = n.min(self.len);
        // SAFETY: in bounds (n <= len, bid < count); initialised per the caller's contract;
        // the kernel does not write the buffer while we hold it.
        unsafe { std::slice::from_raw_parts(self.buf_ptr(bid), n) }
    }

    /// Queues buffer `bid` for the kernel (visible after [`BufPool::publish`]).
    fn give(&mut self, bid: u16) {
        if bid >= self.count {
            return;
        }
        let mask = self.count - 1;
        let addr = self.buf_ptr(bid) as u64;
        let len = self.len as u32;
        // SAFETY: the slot index is masked into the ring; the kernel only reads entries
        // between its head and the published tail, and this one is past the tail. Fields are
        // written one by one so the tail (entry 0's `resv`) is never written here.
        unsafe {
            let e = self
                .ring
                .ptr
                .as_ptr()
                .cast::<RawBuf>()
                .add(usize::from(self.tail & mask));
            ptr::addr_of_mut!((*e).addr).write(addr);
            ptr::addr_of_mut!((*e).len).write(len);
            ptr::addr_of_mut!((*e).bid).write(bid);
        }
        self.tail = self.tail.wrapping_add(1);
    }

    /// Makes the buffers given so far visible to the kernel.
    fn publish(&self) {
        // SAFETY: the tail is the `resv` field of entry 0 of the page-aligned ring, which
        // lives as long as `self`; the kernel reads it with acquire semantics.
        let tail = unsafe {
            AtomicU16::from_ptr(ptr::addr_of_mut!(
                (*self.ring.ptr.as_ptr().cast::<RawBuf>()).resv
            ))
        };
        tail.store(self.tail, Ordering::Release);
    }
}

// ------------------------------------------------------------------------------------------
// Send slots.

#[derive(Clone, Copy, Debug, PartialEq)]
enum SlotState {
    Free,
    /// Submitted; `orphan` when the `send` future that submitted it was dropped (the slot is
    /// freed when its completion is reaped).
    InFlight {
        orphan: bool,
    },
    Done(i32),
}

/// Everything the kernel reads for one `SendMsg`, at a stable address until its completion.
struct SendSlot {
    msg: libc::msghdr,
    iov: [libc::iovec; 2],
    name: [u8; NAME_LEN],
    header: [u8; INLINE_HEADER],
    /// A header longer than `INLINE_HEADER` (never on the library's own paths).
    long_header: Bytes,
    payload: Bytes,
    state: SlotState,
}

// ------------------------------------------------------------------------------------------
// The receive side's consumer.

/// Counters of one socket.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) dropped_oversize: AtomicU64,
    pub(crate) dropped_queue_full: AtomicU64,
    pub(crate) dropped_backlog_full: AtomicU64,
    /// Datagrams from new peers dropped at the listener's peer cap.
    pub(crate) dropped_peer_cap: AtomicU64,
    /// Peers waiting for `accept` evicted at the peer cap.
    pub(crate) evicted: AtomicU64,
}

/// Where reaped datagrams go: the client's queue, or the listener's demultiplexer.
pub(crate) trait Rx: Send {
    /// Address bytes to receive with every datagram (0 for a connected client).
    const NAME_LEN: u32;
    fn deliver(&mut self, from: Option<SocketAddr>, msg: Bytes, stats: &Stats);
    fn error(&mut self, e: io::Error);
}

/// What one reap found.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Reaped {
    pub(crate) delivered: usize,
    pub(crate) sends_done: bool,
}

/// The ring and everything it lends to the kernel; guarded by the driver's mutex.
pub(crate) struct Inner<R> {
    /// Closed explicitly in `Drop`, before the memory it lends out is freed.
    ring: ManuallyDrop<IoUring>,
    fd: RawFd,
    /// Freed in `Drop` only once the kernel has given it back (else leaked).
    bufs: ManuallyDrop<BufPool>,
    /// The multishot receive's `msghdr` (only `msg_namelen` / `msg_controllen` matter).
    recv_msg: Box<libc::msghdr>,
    recv_armed: bool,
    /// As `bufs`.
    slots: ManuallyDrop<Box<[SendSlot]>>,
    free: Vec<u16>,
    in_flight: usize,
    /// Copy target for payloads; hands out `Bytes` and is reclaimed in place once the
    /// application has dropped them.
    out: BytesMut,
    block: usize,
    max_payload: usize,
    /// The ring defers task work (`DEFER_TASKRUN`): completions are posted only by an
    /// `io_uring_enter` with `GETEVENTS` from the submitting thread.
    defer: bool,
    /// A deferring ring starts disabled and is enabled by the first thread that uses it,
    /// which becomes its only issuer (`SINGLE_ISSUER` binds the ring to that thread).
    enabled: bool,
    pub(crate) rx: R,
}

// SAFETY: the raw pointers inside (`msghdr`, `iovec`, the buffer blocks) point into memory
// owned by this same value, which moves between threads as a whole (always behind the
// driver's mutex); the kernel's view of it does not depend on the thread.
unsafe impl<R: Send> Send for Inner<R> {}

const OUT_BLOCK: usize = 64 * 1024;

impl<R: Rx> Inner<R> {
    pub(crate) fn new(fd: RawFd, cfg: &Config, rx: R, defer: bool) -> io::Result<Self> {
        let nbufs = cfg.recv_buffers.clamp(1, 32768).next_power_of_two() as u16;
        let nslots = (2 * cfg.batch).clamp(1, 2 * MAX_BATCH);
        let sq = (cfg.batch + 4).next_power_of_two().max(8) as u32;
        let cq = (2 * (usize::from(nbufs) + nslots) + 16).next_power_of_two() as u32;
        let ring = build_ring(sq, cq, defer)?;
        let buf_len = (RECVMSG_OUT + R::NAME_LEN as usize + cfg.max_payload).next_multiple_of(64);
        let bufs = BufPool::new(nbufs, buf_len)?;
        // SAFETY: the ring memory is page aligned, holds `nbufs` entries and lives in `bufs`,
        // which `Inner` keeps until the ring is closed (see `Drop`).
        unsafe {
            ring.submitter().register_buf_ring_with_flags(
                bufs.ring.ptr.as_ptr() as u64,
                nbufs,
                BGID,
                0,
            )?;
        }
        // SAFETY: msghdr is plain old data; all-zero is a valid value.
        let mut recv_msg: Box<libc::msghdr> = Box::new(unsafe { mem::zeroed() });
        recv_msg.msg_namelen = R::NAME_LEN;
        let slots = (0..nslots)
            .map(|_| SendSlot {
                // SAFETY: plain old data, as above.
                msg: unsafe { mem::zeroed() },
                iov: [libc::iovec {
                    iov_base: ptr::null_mut(),
                    iov_len: 0,
                }; 2],
                name: [0; NAME_LEN],
                header: [0; INLINE_HEADER],
                long_header: Bytes::new(),
                payload: Bytes::new(),
                state: SlotState::Free,
            })
            .collect::<Box<[_]>>();
        let free = (0..nslots as u16).rev().collect();
        let mut inner = Inner {
            ring: ManuallyDrop::new(ring),
            fd,
            bufs: ManuallyDrop::new(bufs),
            recv_msg,
            recv_armed: false,
            slots: ManuallyDrop::new(slots),
            free,
            in_flight: 0,
            out: BytesMut::new(),
            block: 2048,
            max_payload: cfg.max_payload,
            defer,
            enabled: !defer,
            rx,
        };
        // Queued only: a deferring ring is enabled (and submits) on first use.
        inner.arm_recv()?;
        if !defer {
            inner.ring.submit()?;
        }
        Ok(inner)
    }

    /// Queues the multishot receive (submitted by the next `submit`).
    fn arm_recv(&mut self) -> io::Result<()> {
        let e = opcode::RecvMsgMulti::new(types::Fd(self.fd), &*self.recv_msg, BGID)
            .build()
            .user_data(RECV_TAG);
        self.push(&e)?;
        self.recv_armed = true;
        Ok(())
    }

    fn push(&mut self, e: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: every entry pushed here points only at memory owned by `self` (the
            // receive `msghdr`, buffer ring and send slots), which stays put until the
            // entry's completion is reaped (or, at teardown, until the ring is gone).
            if unsafe { self.ring.submission().push(e) }.is_ok() {
                return Ok(());
            }
            // Full: hand what is queued to the kernel, then retry.
            self.submit()?;
        }
    }

    /// Reaps every posted completion: datagrams go to `rx`, send results to their slots,
    /// buffers back to the kernel; re-arms the receive if it ended.
    pub(crate) fn reap(&mut self, stats: &Stats) -> io::Result<Reaped> {
        let mut done = Reaped::default();
        self.enable()?;
        // Deferred work is pending (datagrams arrived): run it, posting its completions. The
        // kernel runs a bounded amount per call, so call again while work remains (bounded
        // too): a burst reaped whole is copied out whole (see the reserve below).
        let mut runs = 0;
        while self.defer && runs < 8 && self.ring.submission().taskrun() {
            self.submit()?;
            runs += 1;
        }
        // Big enough for a burst's receives and its sends together: the room for a batch is
        // reserved before any of it is handed out (below), so a burst split over two batches
        // could allocate a block while the first half is still held.
        let mut cqes = [const { MaybeUninit::<cqueue::Entry>::uninit() }; 2 * MAX_BATCH];
        loop {
            let batch: &[cqueue::Entry] = self.ring.completion().fill(&mut cqes);
            if batch.is_empty() {
                break;
            }
            // Room for the whole batch first, so the block can be reclaimed in place whenever
            // the application has dropped earlier batches (see chunnel_net's RxScratch).
            let name_len = R::NAME_LEN as usize;
            let total: usize = batch
                .iter()
                .filter(|c| c.user_data() == RECV_TAG && c.result() > 0)
                .map(|c| (c.result() as usize).saturating_sub(RECVMSG_OUT + name_len))
                .filter(|&n| n <= self.max_payload)
                .sum();
            if self.out.capacity() - self.out.len() < total {
                self.out.reserve(total.max(self.block));
                self.block = (self.block * 2).min(OUT_BLOCK);
            }
            for c in batch.iter() {
                match c.user_data() {
                    RECV_TAG => self.on_recv(c.result(), c.flags(), stats, &mut done),
                    CANCEL_TAG => {}
                    slot => self.on_send(slot as usize, c.result(), &mut done),
                }
            }
        }
        self.bufs.publish();
        if !self.recv_armed {
            self.arm_recv()?;
            self.ring.submit()?;
        }
        Ok(done)
    }

    fn on_recv(&mut self, res: i32, flags: u32, stats: &Stats, done: &mut Reaped) {
        if !cqueue::more(flags) {
            self.recv_armed = false;
        }
        let bid = cqueue::buffer_select(flags);
        if res < 0 {
            if let Some(bid) = bid {
                self.bufs.give(bid);
            }
            match -res {
                // Out of buffers (the multishot request ended; re-armed after this reap) or
                // cancelled because the submitting thread exited: nothing was lost.
                libc::ENOBUFS | libc::ECANCELED | libc::EINTR | libc::EAGAIN => {}
                e => self.rx.error(io::Error::from_raw_os_error(e)),
            }
            return;
        }
        let Some(bid) = bid else { return };
        // SAFETY: the completion says the kernel wrote `res` bytes into buffer `bid`, which is
        // ours until `give` below.
        let data = unsafe { self.bufs.filled(bid, res as usize) };
        match types::RecvMsgOut::parse(data, &self.recv_msg) {
            Ok(m) if !m.is_payload_truncated() && m.payload_data().len() <= self.max_payload => {
                let from = if R::NAME_LEN > 0 {
                    decode_addr(m.name_data())
                } else {
                    None
                };
                // The one copy of the receive path: kernel buffer -> compact block.
                self.out.extend_from_slice(m.payload_data());
                let payload = self.out.split().freeze();
                self.rx.deliver(from, payload, stats);
                done.delivered += 1;
            }
            _ => {
                stats.dropped_oversize.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.bufs.give(bid);
    }

    fn on_send(&mut self, slot: usize, res: i32, done: &mut Reaped) {
        let Some(s) = self.slots.get_mut(slot) else {
            return;
        };
        self.in_flight = self.in_flight.saturating_sub(1);
        done.sends_done = true;
        match s.state {
            SlotState::InFlight { orphan: true } => {
                s.payload = Bytes::new();
                s.long_header = Bytes::new();
                s.state = SlotState::Free;
                self.free.push(slot as u16);
            }
            SlotState::InFlight { orphan: false } => s.state = SlotState::Done(res),
            SlotState::Free | SlotState::Done(_) => {}
        }
    }

    /// Fills slot `id` and queues its `SendMsg`, linked to the next entry when `link`.
    fn queue_send(
        &mut self,
        id: u16,
        dest: Option<&SocketAddr>,
        header: &[u8],
        payload: Bytes,
        link: bool,
    ) -> io::Result<()> {
        let fd = self.fd;
        let s = &mut self.slots[usize::from(id)];
        let mut parts = 0;
        if !header.is_empty() {
            let base = if header.len() <= INLINE_HEADER {
                s.header[..header.len()].copy_from_slice(header);
                s.header.as_mut_ptr()
            } else {
                s.long_header = Bytes::copy_from_slice(header);
                s.long_header.as_ptr().cast_mut()
            };
            s.iov[0] = libc::iovec {
                iov_base: base.cast(),
                iov_len: header.len(),
            };
            parts = 1;
        }
        s.iov[parts] = libc::iovec {
            iov_base: payload.as_ptr().cast_mut().cast(),
            iov_len: payload.len(),
        };
        s.payload = payload;
        s.msg.msg_iov = s.iov.as_mut_ptr();
        s.msg.msg_iovlen = parts + 1;
        match dest {
            Some(a) => {
                s.msg.msg_namelen = encode_addr(a, &mut s.name);
                s.msg.msg_name = s.name.as_mut_ptr().cast();
            }
            None => {
                s.msg.msg_name = ptr::null_mut();
                s.msg.msg_namelen = 0;
            }
        }
        s.state = SlotState::InFlight { orphan: false };
        let mut e = if parts == 0 {
            // No header: a plain `Send` (with the address, for a listener) spares the
            // kernel copying in a `msghdr` and an `iovec`.
            let mut op =
                opcode::Send::new(types::Fd(fd), s.payload.as_ptr(), s.payload.len() as u32);
            if dest.is_some() {
                op = op
                    .dest_addr(s.name.as_ptr().cast())
                    .dest_addr_len(s.msg.msg_namelen);
            }
            op.build()
        } else {
            opcode::SendMsg::new(types::Fd(fd), &s.msg).build()
        }
        .user_data(u64::from(id));
        if link {
            e = e.flags(squeue::Flags::IO_LINK);
        }
        self.in_flight += 1;
        self.push(&e)
    }

    /// Blocks the thread until a completion is posted or `timeout` passes (the probe only).
    pub(crate) fn wait_completion(&mut self, timeout: Duration) -> io::Result<()> {
        let ts = types::Timespec::from(timeout);
        let args = types::SubmitArgs::new().timespec(&ts);
        match self.ring.submitter().submit_with_args(1, &args) {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME) | Some(libc::EINTR)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Enables a deferring ring on its first use, from the thread that will run it.
    fn enable(&mut self) -> io::Result<()> {
        if !self.enabled {
            self.ring.submitter().register_enable_rings()?;
            self.enabled = true;
            self.submit()?;
        }
        Ok(())
    }

    /// Submits what is queued (one `io_uring_enter`).
    fn submit(&mut self) -> io::Result<()> {
        self.enable()?;
        loop {
            match self.ring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    return Err(io::Error::other(
                        "this io_uring socket's ring is bound to the thread that first used it \
                         (Config::single_thread; the default on a current-thread runtime) and \
                         was used from another thread",
                    ));
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn release(&mut self, id: u16) {
        let s = &mut self.slots[usize::from(id)];
        s.payload = Bytes::new();
        s.long_header = Bytes::new();
        s.state = SlotState::Free;
        self.free.push(id);
    }
}

impl<R> Drop for Inner<R> {
    fn drop(&mut self) {
        // The kernel may still hold the receive buffers and send slots. Cancel everything and
        // wait (bounded) for the completions; if they do not all come, leak the memory rather
        // than free what the kernel might still write.
        // A ring never enabled never gave the kernel anything.
        let mut pending = if self.enabled {
            self.in_flight + usize::from(self.recv_armed)
        } else {
            0
        };
        if pending > 0 {
            let e = opcode::AsyncCancel2::new(types::CancelBuilder::any().all())
                .build()
                .user_data(CANCEL_TAG);
            // SAFETY: the cancel entry points at no memory.
            let pushed = unsafe { self.ring.submission().push(&e) }.is_ok();
            let deadline = Instant::now() + TEARDOWN_WAIT;
            while pushed && pending > 0 && Instant::now() < deadline {
                let ts = types::Timespec::from(Duration::from_millis(50));
                let args = types::SubmitArgs::new().timespec(&ts);
                match self.ring.submitter().submit_with_args(1, &args) {
                    Ok(_) => {}
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
                        ) => {}
                    Err(_) => break,
                }
                for c in self.ring.completion() {
                    match c.user_data() {
                        RECV_TAG if !cqueue::more(c.flags()) && self.recv_armed => {
                            self.recv_armed = false;
                            pending = pending.saturating_sub(1);
                        }
                        RECV_TAG | CANCEL_TAG => {}
                        _ => pending = pending.saturating_sub(1),
                    }
                }
            }
        }
        let _ = self.ring.submitter().unregister_buf_ring(BGID);
        // SAFETY: each field is dropped exactly once, here, and never used again. The ring
        // goes first; the memory it lent out is freed only if every request that could touch
        // it has completed — otherwise it is leaked on purpose.
        unsafe {
            ManuallyDrop::drop(&mut self.ring);
            if pending == 0 {
                ManuallyDrop::drop(&mut self.bufs);
                ManuallyDrop::drop(&mut self.slots);
            }
        }
    }
}

fn build_ring(sq: u32, cq: u32, defer: bool) -> io::Result<IoUring> {
    if defer {
        return IoUring::builder()
            .setup_cqsize(cq)
            .setup_clamp()
            .setup_submit_all()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_taskrun_flag()
            .setup_r_disabled()
            .build(sq);
    }
    // SUBMIT_ALL (5.18) keeps submitting past an entry that fails early; fall back without it.
    match IoUring::builder()
        .setup_cqsize(cq)
        .setup_clamp()
        .setup_submit_all()
        .build(sq)
    {
        Ok(r) => Ok(r),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            IoUring::builder().setup_cqsize(cq).setup_clamp().build(sq)
        }
        Err(e) => Err(e),
    }
}

// ------------------------------------------------------------------------------------------
// The driver: ring + socket + tokio readiness.

/// The descriptor tokio waits on: the ring's, or the eventfd a deferring ring signals
/// (owned elsewhere).
struct RingFd(RawFd);

impl AsRawFd for RingFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// One socket and its ring. Fields drop in order: the tokio registration first (while the
/// ring descriptor is still open), then the ring (which waits for the kernel to let go of
/// its memory), then the socket.
pub(crate) struct Driver<R> {
    afd: AsyncFd<RingFd>,
    /// With a deferring ring, the eventfd the ring signals (tokio waits on it).
    _efd: Option<std::os::fd::OwnedFd>,
    inner: Mutex<Inner<R>>,
    sock: std::net::UdpSocket,
    pub(crate) stats: Stats,
    pub(crate) cfg: Config,
    /// Woken (all waiters) when a reap saw send completions.
    send_done: Notify,
    /// Woken (one waiter) when a `send` reaped datagrams for a client's receivers.
    pub(crate) rx_notify: Notify,
    /// Whether one task is waiting for the ring to become readable.
    reader: AtomicBool,
    /// Tasks waiting for the reader's place.
    waiters: AtomicUsize,
    reader_vacant: Notify,
}

impl<R> std::fmt::Debug for Driver<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("sock", &self.sock)
            .field("ring_fd", &self.afd.get_ref().0)
            .finish_non_exhaustive()
    }
}

/// Held by the task that waits on the ring; gives the place up on drop (also when the
/// waiting future is cancelled) and wakes one other waiter to take it.
struct ReaderGuard<'a> {
    reader: &'a AtomicBool,
    waiters: &'a AtomicUsize,
    vacant: &'a Notify,
}

impl Drop for ReaderGuard<'_> {
    fn drop(&mut self) {
        self.reader.store(false, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.vacant.notify_one();
        }
    }
}

/// Counts a task waiting for the reader's place while it waits.
struct WaiterGuard<'a>(&'a AtomicUsize);

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Maps an I/O error on an established connection.
pub(crate) fn conn_err(op: &'static str, peer: &SocketAddr, e: io::Error) -> Error {
    match Error::from_io(op, peer, e) {
        // Mid-connection, "refused" means the peer's socket is gone.
        Error::ConnectionRefused { .. } => Error::PeerClosed,
        other => other,
    }
}

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io { op, source }
}

impl<R: Rx> Driver<R> {
    /// Sets up a ring for `sock` (must be called inside a tokio runtime with I/O enabled).
    pub(crate) fn new(sock: std::net::UdpSocket, cfg: Config, rx: R) -> Result<Self, Error> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::Io {
                op: "registering the ring with tokio",
                source: io::Error::other("must be called inside a tokio runtime"),
            });
        }
        sock.set_nonblocking(true)
            .map_err(io_err("set_nonblocking"))?;
        let defer = cfg.single_thread.unwrap_or_else(|| {
            tokio::runtime::Handle::current().runtime_flavor()
                == tokio::runtime::RuntimeFlavor::CurrentThread
        });
        let inner = Inner::new(sock.as_raw_fd(), &cfg, rx, defer)
            .map_err(|e| crate::not_available(format!("setting up the ring failed: {e}")))?;
        let efd = if defer {
            // SAFETY: plain system call; the result is checked.
            let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if fd < 0 {
                return Err(io_err("eventfd")(io::Error::last_os_error()));
            }
            // SAFETY: `fd` was just created and is owned by nobody else.
            let efd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            inner
                .ring
                .submitter()
                .register_eventfd(fd)
                .map_err(io_err("registering the eventfd"))?;
            Some(efd)
        } else {
            None
        };
        let wait_fd = efd
            .as_ref()
            .map_or(inner.ring.as_raw_fd(), |e| e.as_raw_fd());
        // SAFETY: the descriptor is the ring's (owned by `inner`) or the eventfd (owned by
        // `_efd`); the driver drops both only after the `AsyncFd` (field order), so it stays
        // open and the same for the registration's lifetime.
        let afd = unsafe { AsyncFd::register_with_interest(RingFd(wait_fd), Interest::READABLE) }
            .map_err(|e| Error::Io {
            op: "registering the ring with tokio",
            source: e.into_parts().1,
        })?;
        Ok(Driver {
            afd,
            _efd: efd,
            inner: Mutex::new(inner),
            sock,
            stats: Stats::default(),
            cfg,
            send_done: Notify::new(),
            rx_notify: Notify::new(),
            reader: AtomicBool::new(false),
            waiters: AtomicUsize::new(0),
            reader_vacant: Notify::new(),
        })
    }

    pub(crate) fn socket(&self) -> &std::net::UdpSocket {
        &self.sock
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Inner<R>> {
        lock(&self.inner)
    }

    /// Reaps under the lock the caller holds; wakes send waiters if their sends completed.
    pub(crate) fn pump(&self, g: &mut Inner<R>) -> io::Result<Reaped> {
        let r = g.reap(&self.stats)?;
        if r.sends_done {
            self.send_done.notify_waiters();
        }
        Ok(r)
    }

    /// Waits until the ring may have completions — if no other task is already waiting for
    /// that — or until `other` completes, whichever comes first. Returns `other`'s output if
    /// it completed; `Ok(None)` means "look again" (also spuriously).
    pub(crate) async fn wait_ready<T>(
        &self,
        other: impl Future<Output = T>,
    ) -> io::Result<Option<T>> {
        tokio::pin!(other);
        if self
            .reader
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            let _guard = ReaderGuard {
                reader: &self.reader,
                waiters: &self.waiters,
                vacant: &self.reader_vacant,
            };
            tokio::select! {
                biased;
                r = self.afd.readable() => {
                    // Cleared before the caller reaps: a completion posted after the reap
                    // marks the descriptor ready again.
                    r?.clear_ready();
                    Ok(None)
                }
                t = &mut other => Ok(Some(t)),
            }
        } else {
            // Another task waits on the ring; wait for it to leave (or for `other`). The
            // counter and the flag are checked crosswise (SeqCst): either the reader sees
            // this waiter and wakes it, or this waiter sees the place free and retries.
            self.waiters.fetch_add(1, Ordering::SeqCst);
            let _w = WaiterGuard(&self.waiters);
            let vacant = self.reader_vacant.notified();
            tokio::pin!(vacant);
            vacant.as_mut().enable();
            if !self.reader.load(Ordering::SeqCst) {
                return Ok(None);
            }
            tokio::select! {
                () = &mut vacant => Ok(None),
                t = &mut other => Ok(Some(t)),
            }
        }
    }

    /// Sends `burst` (each message prefixed by `header`) to `dest`, or to the connected peer.
    /// Up to `cfg.batch` messages go in one `io_uring_enter`, linked so they leave in order.
    pub(crate) async fn send<B>(
        &self,
        dest: Option<&SocketAddr>,
        peer: &SocketAddr,
        header: &[u8],
        burst: B,
    ) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes>,
    {
        let max = self.cfg.max_payload.saturating_sub(header.len());
        let batch = self.cfg.batch.clamp(1, MAX_BATCH);
        let mut it = burst.into_iter();
        // A burst of one (the common case for request/response) skips the batch array.
        let Some(first) = it.next() else {
            return Ok(());
        };
        if first.len() > max {
            return Err(Error::MessageTooLarge {
                len: first.len(),
                max,
            });
        }
        let second = it.next();
        if second.is_none() {
            return self.send_batch(dest, peer, header, &mut [first]).await;
        }
        let mut msgs: [Bytes; MAX_BATCH] = [const { Bytes::new() }; MAX_BATCH];
        msgs[0] = first;
        let mut pending = second;
        let mut n = 1;
        loop {
            let mut too_large = None;
            for m in pending.take().into_iter().chain(it.by_ref()) {
                if m.len() > max {
                    too_large = Some(m.len());
                    break;
                }
                msgs[n] = m;
                n += 1;
                if n == batch {
                    break;
                }
            }
            if n > 0 {
                self.send_batch(dest, peer, header, &mut msgs[..n]).await?;
            }
            if let Some(len) = too_large {
                return Err(Error::MessageTooLarge { len, max });
            }
            if n < batch {
                return Ok(());
            }
            n = 0;
        }
    }

    async fn send_batch(
        &self,
        dest: Option<&SocketAddr>,
        peer: &SocketAddr,
        header: &[u8],
        msgs: &mut [Bytes],
    ) -> Result<(), Error> {
        let n = msgs.len();
        let mut flight = Flight {
            driver: self,
            ids: [0; MAX_BATCH],
            n: 0,
        };
        let err = |e| conn_err("send", peer, e);
        // Take n slots (waiting for other sends to finish if they hold too many), queue the
        // linked chain and submit it. Usually every entry completes inside the submit: then
        // this returns without waiting.
        let mut submitted = false;
        loop {
            let delivered = {
                let mut g = self.lock();
                if !submitted && g.free.len() < n {
                    self.pump(&mut g).map_err(err)?;
                }
                if !submitted && g.free.len() >= n {
                    for (i, m) in msgs.iter_mut().enumerate() {
                        let id = g.free.pop().expect("counted above");
                        flight.ids[i] = id;
                        flight.n = i + 1;
                        g.queue_send(id, dest, header, mem::take(m), i + 1 < n)
                            .map_err(err)?;
                    }
                    g.submit().map_err(err)?;
                    submitted = true;
                }
                let r = if submitted {
                    self.pump(&mut g).map_err(err)?
                } else {
                    Reaped::default()
                };
                if submitted && let Some(res) = flight.collect(&mut g) {
                    drop(g);
                    if r.delivered > 0 {
                        // Datagrams reaped on behalf of the client's receivers.
                        self.rx_notify.notify_one();
                    }
                    return res.map_err(err);
                }
                r.delivered
            };
            if delivered > 0 {
                self.rx_notify.notify_one();
            }
            // Register, then look once more: a reap by another task between the look above
            // and the registration would otherwise go unnoticed.
            let done = self.send_done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            {
                let mut g = self.lock();
                let ready = if submitted {
                    flight.all_done(&g)
                } else {
                    g.free.len() >= n
                };
                if ready {
                    continue;
                }
                self.pump(&mut g).map_err(err)?;
            }
            self.wait_ready(done).await.map_err(io_err("send"))?;
        }
    }
}

/// Send slots one `send_batch` call owns; frees or orphans them if the call is cancelled.
struct Flight<'a, R: Rx> {
    driver: &'a Driver<R>,
    ids: [u16; MAX_BATCH],
    n: usize,
}

impl<R: Rx> Flight<'_, R> {
    fn all_done(&self, g: &Inner<R>) -> bool {
        self.ids[..self.n]
            .iter()
            .all(|&id| matches!(g.slots[usize::from(id)].state, SlotState::Done(_)))
    }

    /// If every slot completed: frees them and returns the first error, in burst order.
    fn collect(&mut self, g: &mut Inner<R>) -> Option<io::Result<()>> {
        if !self.all_done(g) {
            return None;
        }
        let ids = &self.ids[..self.n];
        let mut out = Ok(());
        for &id in ids {
            if let SlotState::Done(res) = g.slots[usize::from(id)].state
                && res < 0
                && out.is_ok()
            {
                out = Err(io::Error::from_raw_os_error(-res));
            }
            g.release(id);
        }
        self.n = 0;
        Some(out)
    }
}

impl<R: Rx> Drop for Flight<'_, R> {
    fn drop(&mut self) {
        if self.n == 0 {
            return;
        }
        let mut g = self.driver.lock();
        for &id in &self.ids[..self.n] {
            match g.slots[usize::from(id)].state {
                SlotState::Done(_) => g.release(id),
                SlotState::InFlight { .. } => {
                    g.slots[usize::from(id)].state = SlotState::InFlight { orphan: true }
                }
                SlotState::Free => {}
            }
        }
    }
}

/// The client's receive side: one bounded queue.
#[derive(Debug)]
pub(crate) struct ClientRx {
    pub(crate) queue: VecDeque<Bytes>,
    pub(crate) error: Option<io::Error>,
    cap: usize,
}

impl ClientRx {
    pub(crate) fn new(cap: usize) -> Self {
        ClientRx {
            queue: VecDeque::new(),
            error: None,
            cap,
        }
    }

    pub(crate) fn drain(&mut self, slots: &mut [Option<Bytes>]) -> usize {
        let n = self.queue.len().min(slots.len());
        for (s, m) in slots.iter_mut().zip(self.queue.drain(..n)) {
            *s = Some(m);
        }
        n
    }
}

impl Rx for ClientRx {
    const NAME_LEN: u32 = 0;
    fn deliver(&mut self, _from: Option<SocketAddr>, msg: Bytes, stats: &Stats) {
        if self.queue.len() >= self.cap {
            stats.dropped_queue_full.fetch_add(1, Ordering::Relaxed);
        } else {
            self.queue.push_back(msg);
        }
    }
    fn error(&mut self, e: io::Error) {
        self.error = Some(e);
    }
}
