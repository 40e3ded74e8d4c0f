//! The driver: a ring, its socket and tokio readiness (the ring's descriptor, or a deferring
//! ring's eventfd, registered with `AsyncFd`); which task waits on it, and sending bursts.

use std::future::Future;
use std::io;
use std::mem;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use chunnel::Error;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use crate::config::Config;

use super::ring::{Inner, SlotPayload, SlotState};
use super::rx::{Reaped, Rx, Stats};
use super::*;

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
    /// The task polling for datagrams ([`Driver::poll_ready`] through a listener's
    /// `poll_recv_ready`), woken as `rx_notify` is.
    pub(crate) rx_waker: Mutex<Option<std::task::Waker>>,
    /// Whether a task holds the reader role: the right to wait for the ring to become
    /// readable, held by one task at a time.
    reader: AtomicBool,
    /// Tasks waiting for the reader role to fall vacant.
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

/// Held by the task that waits on the ring; gives the reader role up on drop (also when the
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

/// Counts a task waiting for the reader role while it waits.
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
            rx_waker: Mutex::new(None),
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

    /// Polls the ring for completions, registering `cx` in its one poll slot; on `Ready` the
    /// readiness is cleared before the caller reaps (a completion posted after the reap marks
    /// the descriptor ready again).
    pub(crate) fn poll_ready(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.afd.poll_read_ready(cx) {
            std::task::Poll::Ready(Ok(mut g)) => {
                g.clear_ready();
                std::task::Poll::Ready(Ok(()))
            }
            std::task::Poll::Ready(Err(e)) => std::task::Poll::Ready(Err(e)),
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }

    /// Wakes whoever waits for datagrams a `send` reaped: one client receive, or the task
    /// registered by a listener's `poll_recv_ready`.
    fn wake_receiver(&self) {
        self.rx_notify.notify_one();
        if let Some(w) = lock(&self.rx_waker).take() {
            w.wake();
        }
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
            // this waiter and wakes it, or this waiter sees the reader role free and retries.
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
        B: IntoIterator,
        B::Item: Into<SlotPayload>,
    {
        let max = self.cfg.max_payload.saturating_sub(header.len());
        let batch = self.cfg.batch.clamp(1, MAX_BATCH);
        let stats = &self.stats;
        let mut it = burst.into_iter().map(|m| {
            let m: SlotPayload = m.into();
            let counter = match m {
                SlotPayload::Lent(_) => &stats.tx_lent,
                SlotPayload::Bytes(_) => &stats.tx_copied,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            m
        });
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
        let mut msgs: [SlotPayload; MAX_BATCH] = [const { SlotPayload::EMPTY }; MAX_BATCH];
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
        msgs: &mut [SlotPayload],
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
                if !submitted && g.free.len() < n && self.pump(&mut g).map_err(err)?.delivered > 0 {
                    self.wake_receiver();
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
                        // Datagrams reaped on behalf of the receivers.
                        self.wake_receiver();
                    }
                    return res.map_err(err);
                }
                r.delivered
            };
            if delivered > 0 {
                self.wake_receiver();
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
                if self.pump(&mut g).map_err(err)?.delivered > 0 {
                    self.wake_receiver();
                }
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
