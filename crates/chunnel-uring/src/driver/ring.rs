//! The ring ([`Inner`]) and everything it lends to the kernel: the receive buffers, the
//! multishot receive's `msghdr`, the send slots; reaping completions, queueing sends, and a
//! teardown that waits for the kernel to give the memory back.

use std::io;
use std::mem::{self, ManuallyDrop, MaybeUninit};
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::ptr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use io_uring::{IoUring, cqueue, opcode, squeue, types};

use crate::config::Config;

use super::addr::{decode_addr, encode_addr};
use super::buf::{BufPool, UringBuf};
use super::rx::{Reaped, Rx, Stats};
use super::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum SlotState {
    Free,
    /// Submitted; `orphan` when the `send` future that submitted it was dropped (the slot is
    /// freed when its completion is reaped).
    InFlight {
        orphan: bool,
    },
    Done(i32),
}

/// A message being sent: the application's `Bytes`, or a send buffer the connection lent.
#[derive(Debug)]
pub(crate) enum SlotPayload {
    Bytes(Bytes),
    Lent(UringBuf),
}

impl SlotPayload {
    pub(crate) const EMPTY: SlotPayload = SlotPayload::Bytes(Bytes::new());

    pub(crate) fn len(&self) -> usize {
        match self {
            SlotPayload::Bytes(b) => b.len(),
            SlotPayload::Lent(b) => b.len(),
        }
    }

    fn ptr(&self) -> *const u8 {
        match self {
            SlotPayload::Bytes(b) => b.as_ptr(),
            SlotPayload::Lent(b) => b.ptr(),
        }
    }
}

impl Default for SlotPayload {
    fn default() -> Self {
        SlotPayload::EMPTY
    }
}

impl From<Bytes> for SlotPayload {
    fn from(b: Bytes) -> Self {
        SlotPayload::Bytes(b)
    }
}

impl From<UringBuf> for SlotPayload {
    fn from(b: UringBuf) -> Self {
        SlotPayload::Lent(b)
    }
}

/// Everything the kernel reads for one `SendMsg`, at a stable address until its completion.
pub(super) struct SendSlot {
    msg: libc::msghdr,
    iov: [libc::iovec; 2],
    name: [u8; NAME_LEN],
    header: [u8; INLINE_HEADER],
    /// A header longer than `INLINE_HEADER` (never on the library's own paths).
    long_header: Bytes,
    payload: SlotPayload,
    pub(super) state: SlotState,
}

/// The ring and everything it lends to the kernel; guarded by the driver's mutex.
pub(crate) struct Inner<R> {
    /// Closed explicitly in `Drop`, before the memory it lends out is freed.
    pub(super) ring: ManuallyDrop<IoUring>,
    fd: RawFd,
    /// Freed in `Drop` only once the kernel has given it back (else leaked).
    bufs: ManuallyDrop<BufPool>,
    /// The multishot receive's `msghdr` (only `msg_namelen` / `msg_controllen` matter).
    recv_msg: Box<libc::msghdr>,
    recv_armed: bool,
    /// As `bufs`.
    pub(super) slots: ManuallyDrop<Box<[SendSlot]>>,
    pub(super) free: Vec<u16>,
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
                payload: SlotPayload::EMPTY,
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
        // Buffers the application gave back go to the kernel first (published below).
        self.bufs.take_back();
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
                let (lent, total) = self.bufs.lent();
                if self.rx.lends() && lent < total / 2 {
                    // Lent: the buffer goes back to the kernel when the payload is dropped.
                    // At most half the buffers are lent, so the kernel keeps buffers to
                    // receive into; past that, copies.
                    let payload = m.payload_data();
                    let off = payload.as_ptr() as usize - data.as_ptr() as usize;
                    let p = self.bufs.lend(bid, off, payload.len());
                    stats.rx_lent.fetch_add(1, Ordering::Relaxed);
                    self.rx.deliver_lent(from, p, stats);
                    done.delivered += 1;
                    return;
                }
                // The one copy of the copying receive path: kernel buffer -> compact block.
                stats.rx_copied.fetch_add(1, Ordering::Relaxed);
                self.out.extend_from_slice(m.payload_data());
                let payload = self.out.split().freeze();
                self.rx.deliver(from, payload, stats);
                done.delivered += 1;
            }
            Ok(m) => {
                let from = if R::NAME_LEN > 0 {
                    decode_addr(m.name_data())
                } else {
                    None
                };
                let data = m.payload_data();
                let len = (m.incoming_payload_len() as usize).max(data.len());
                let prefix = &data[..data.len().min(chunnel::Oversized::PREFIX)];
                self.rx.oversize(from, prefix, len, stats);
            }
            Err(_) => {
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
                s.payload = SlotPayload::EMPTY;
                s.long_header = Bytes::new();
                s.state = SlotState::Free;
                self.free.push(slot as u16);
            }
            SlotState::InFlight { orphan: false } => s.state = SlotState::Done(res),
            SlotState::Free | SlotState::Done(_) => {}
        }
    }

    /// Fills slot `id` and queues its `SendMsg`, linked to the next entry when `link`.
    pub(super) fn queue_send(
        &mut self,
        id: u16,
        dest: Option<&SocketAddr>,
        header: &[u8],
        payload: SlotPayload,
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
            iov_base: payload.ptr().cast_mut().cast(),
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
            let mut op = opcode::Send::new(types::Fd(fd), s.payload.ptr(), s.payload.len() as u32);
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
    pub(super) fn submit(&mut self) -> io::Result<()> {
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

    pub(super) fn release(&mut self, id: u16) {
        let s = &mut self.slots[usize::from(id)];
        s.payload = SlotPayload::EMPTY;
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
