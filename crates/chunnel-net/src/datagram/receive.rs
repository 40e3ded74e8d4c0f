//! Receiving: the per-socket scratch that `recvmmsg` fills and hands out as `Bytes`, and a
//! listener's pump, which reads a batch and sorts it into per-peer queues, or straight into
//! the slots of the connection that reads for itself (direct delivery).

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;

use crate::sys::{self, DgramAddr, MAX_BATCH, RecvMeta};
use bytes::{Bytes, BytesMut};

use super::config::Config;
use super::datapath::DatagramIo;
use super::demux::{Peer, PeerQueue};
use super::listener::Shared;
use super::lock;

/// A kernel socket's receive state (a client connection's, or a listener's
/// [`DatagramIo::RxState`](super::DatagramIo::RxState)): datagrams land in a per-thread kernel scratch, then each
/// is copied once into `out`, a compact buffer that hands out `Bytes` slices. `out` is
/// reclaimed in place (no allocation) once the application has dropped the messages it
/// handed out.
pub struct RxScratch {
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
/// would be 2 x 64 KiB of fresh heap, and its page faults, for every short-lived client). Bounded
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
    pub(super) fn new(first: usize) -> Self {
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
    /// and `oversize(addr, prefix, len)` for each larger than `cfg.max_payload` (`prefix` is
    /// its first bytes, at most [`chunnel::Oversized::PREFIX`], `len` its whole length). Returns the number read from the kernel (including dropped ones).
    /// With `want_addr` false (a connected socket) the senders' addresses are not read:
    /// `addr` is `None`.
    pub(super) fn read<A: DgramAddr>(
        &mut self,
        fd: RawFd,
        cfg: &Config,
        want: usize,
        want_addr: bool,
        deliver: impl FnMut(Option<A>, Bytes),
        oversize: impl FnMut(Option<A>, &[u8], usize),
    ) -> io::Result<usize> {
        KERNEL_SCRATCH.with(|k| match k.try_borrow_mut() {
            Ok(mut k) => self.read_with(&mut k, fd, cfg, want, want_addr, deliver, oversize),
            // Re-entered from `deliver` (no caller does; kept correct regardless).
            Err(_) => self.read_with(
                &mut KernelScratch::default(),
                fd,
                cfg,
                want,
                want_addr,
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

impl std::fmt::Debug for RxScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RxScratch").finish_non_exhaustive()
    }
}

/// A connection reading for itself in [`Shared::pump_for`].
pub(super) struct Direct<'a, A> {
    pub(super) peer: &'a Peer<A>,
    pub(super) slots: &'a mut [Option<Bytes>],
}

impl<S: DatagramIo> Shared<S> {
    /// Reads one batch from the socket and sorts it into peer queues (`accept`'s read: the
    /// new peers it finds are in the backlog when it looks next, so it is not notified).
    pub(super) fn pump(&self) -> io::Result<usize> {
        self.pump_for(None).map(|(n, _)| n)
    }

    /// As [`Shared::pump`]; with `me`, datagrams from `me`'s peer go straight into `me`'s
    /// slots while its queue is empty (the calling connection reads them anyway: no queue, no
    /// wake-up, no lookup). Returns (datagrams read, delivered into the slots).
    pub(super) fn pump_for(
        &self,
        mut me: Option<Direct<'_, S::Addr>>,
    ) -> io::Result<(usize, usize)> {
        // A connection reads (`accept` otherwise, which needs no notification of new peers).
        let conn_reads = me.is_some();
        let mut rx = lock(&self.rx);
        let mut direct = 0;
        let n = self.sock.recv_batch(
            &mut rx,
            &self.cfg,
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
                            self.stats.drop_queue_full();
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
                    self.stats.drop_queue_full();
                } else {
                    q.push_back(m);
                    self.stats.queued.fetch_add(1, Ordering::Relaxed);
                    drop(q);
                    drop(d);
                    peer.notify.notify_one();
                }
            },
            |addr, prefix, len| {
                self.stats.drop_oversize();
                self.note_oversized(addr, prefix, len, conn_reads)
            },
        )?;
        if direct > 0 {
            self.stats
                .direct
                .fetch_add(direct as u64, Ordering::Relaxed);
        }
        Ok((n, direct))
    }
}
