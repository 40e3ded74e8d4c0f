//! The connection over the two rings, and how a receiver waits for an empty ring.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel::{ChunnelConnection, Emit, Error, LendBuffer, LendRecv, LendStats, SendHeader};

use crate::lend::{ShmBuf, ShmPayload};
use crate::ring::{ATTACHED, CLOSED, Consumer, Popped, Producer, Region};
use crate::shared::Shared;
use crate::{Role, WaitPolicy};
use chunnel::util::lock;

/// How long a receiver spins in place before giving the runtime a turn (when it spins longer
/// than this in total, other tasks of its runtime still run every this often).
const SPIN_SLICE: Duration = Duration::from_micros(20);

/// A connection over shared memory, built by [`crate::LocalFastPath`] when negotiation picked
/// it. `Data = Bytes`; messages up to [`ShmConnection::max_message`] bytes.
///
/// * **Send** copies each message into the ring (the send side's one copy) and publishes the
///   burst with one release store; a receiver that is parked is woken by a futex wake (a
///   system call only then). A full ring makes `send` wait (spinning, then sleeping with a
///   backoff of up to 1 ms) until the receiver frees room: the ring is bounded.
/// * **Recv** copies each message out into a reused block (the receive side's one copy; no
///   allocation per message once the application drops what it received) and waits on an
///   empty ring as [`WaitPolicy`] says.
/// * The peer closing (drop) or dying ends the connection: `recv` returns the messages still
///   in the ring, then [`Error::PeerClosed`]; `send` fails with it at once.
///
/// `recv` is cancel safe. Many tasks may send and receive at once (each ring end is behind a
/// short lock held only while copying).
///
/// It also lends the rings (no copy): [`LendRecv`], [`LendBuffer`] and [`Emit`]; see the
/// crate docs ("Lent buffers").
#[derive(Debug)]
pub struct ShmConnection<C> {
    sh: Arc<Shared>,
    waiter: OnceLock<std::thread::Thread>,
    inner: C,
}

impl<C> ShmConnection<C> {
    pub(crate) fn new(region: Region, role: Role, wait: WaitPolicy, inner: C) -> Self {
        let (txr, rxr) = match role {
            Role::Client => (0, 1),
            Role::Server => (1, 0),
        };
        let sh = Arc::new(Shared {
            region,
            tx: Mutex::new(Producer::new(txr)),
            rx: Mutex::new(Consumer::new(rxr)),
            rx_lent: AtomicU64::new(0),
            rx_copied: AtomicU64::new(0),
            tx_lent: AtomicU64::new(0),
            tx_copied: AtomicU64::new(0),
            role,
            wait,
            notify: tokio::sync::Notify::new(),
            armed: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
        });
        debug_assert_eq!((txr, rxr), (sh.tx_ring(), sh.rx_ring()));
        ShmConnection {
            sh,
            waiter: OnceLock::new(),
            inner,
        }
    }

    /// The largest message this connection carries (set by the client's
    /// [`crate::Config::max_message`]).
    pub fn max_message(&self) -> usize {
        self.sh.region.max_msg()
    }

    /// The connection negotiation was run on (kept open, unused, for the connection's life).
    pub fn inner(&self) -> &C {
        &self.inner
    }

    fn try_recv(&self, slots: &mut [Option<Bytes>]) -> Result<usize, Error> {
        let n = lock(&self.sh.rx).pop(&self.sh.region, slots)?;
        self.sh.rx_copied.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    /// As `try_recv`, lending records where the window allows.
    fn try_recv_lent(&self, slots: &mut [Option<ShmPayload>]) -> Result<usize, Error> {
        let sh = &self.sh;
        let (mut lent, mut copied) = (0u64, 0u64);
        let max = slots.len();
        let mut it = slots.iter_mut();
        let n = lock(&sh.rx).pop_with(&sh.region, max, true, |p| {
            let msg = match p {
                Popped::Lent(span) => {
                    lent += 1;
                    ShmPayload::lent(Arc::clone(sh), span)
                }
                Popped::Copied(b) => {
                    copied += 1;
                    ShmPayload::copied(b)
                }
            };
            if let Some(s) = it.next() {
                *s = Some(msg);
            }
        })?;
        sh.rx_lent.fetch_add(lent, Ordering::Relaxed);
        sh.rx_copied.fetch_add(copied, Ordering::Relaxed);
        Ok(n)
    }

    /// Received messages the application still holds as lent payloads.
    pub fn held(&self) -> usize {
        lock(&self.sh.rx).held()
    }

    fn waiter(&self) -> Result<&std::thread::Thread, Error> {
        if let Some(t) = self.waiter.get() {
            return Ok(t);
        }
        let sh = Arc::clone(&self.sh);
        let handle = std::thread::Builder::new()
            .name("chunnel-shm-wait".into())
            .spawn(move || sh.watch())
            .map_err(|e| Error::Io {
                op: "spawn the shared-memory waiter thread",
                source: e,
            })?;
        // A racing receiver may have set it first; its thread serves, ours ends with the
        // connection like it.
        Ok(self.waiter.get_or_init(|| handle.thread().clone()))
    }

    async fn recv_inner<T>(
        &self,
        slots: &mut [Option<T>],
        try_recv: impl Fn(&Self, &mut [Option<T>]) -> Result<usize, Error>,
    ) -> Result<usize, Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        // Nothing to read and the peer is gone: the end of the stream. Re-checks the ring
        // after seeing the peer's close, since records published before it must still be
        // delivered.
        let end_of_stream = |slots: &mut [Option<T>]| match try_recv(self, slots)? {
            0 => Err(Error::PeerClosed),
            n => Ok(n),
        };
        let sh = &*self.sh;
        let ring = sh.rx_ring();
        let started = Instant::now();
        let mut last_check = started;
        let mut parked = false;
        loop {
            let n = try_recv(self, slots)?;
            if n > 0 {
                if parked {
                    sh.region.sleeping(ring).store(0, Ordering::Relaxed);
                }
                return Ok(n);
            }
            if sh.peer_closed() {
                return end_of_stream(slots);
            }
            let now = Instant::now();
            if now.duration_since(last_check) >= sh.wait.liveness {
                last_check = now;
                if sh.peer_gone() {
                    return end_of_stream(slots);
                }
            }
            let spent = now.duration_since(started);
            if spent < sh.wait.spin {
                // Busy-poll in place for a slice, then let the runtime run other tasks.
                let slice_end = now + SPIN_SLICE.min(sh.wait.spin - spent);
                let mut i = 0u32;
                while !sh.region.has_data(ring) {
                    std::hint::spin_loop();
                    i = i.wrapping_add(1);
                    if i.is_multiple_of(64) && Instant::now() >= slice_end {
                        break;
                    }
                }
                if !sh.region.has_data(ring) {
                    tokio::task::yield_now().await;
                }
                continue;
            }
            // Park: ask the producer to ring, re-check, and let the waiter thread block on
            // the futex for us.
            let notified = sh.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            sh.region.sleeping(ring).store(1, Ordering::Relaxed);
            parked = true;
            // Pairs with the producer's fence between publishing `head` and reading
            // `sleeping` (see `Region::ring_bell`).
            std::sync::atomic::fence(Ordering::SeqCst);
            if sh.region.has_data(ring) || sh.peer_closed() {
                continue;
            }
            let waiter = self.waiter()?;
            sh.armed.store(true, Ordering::Release);
            waiter.unpark();
            notified.await;
        }
    }

    async fn send_parts<'a, B>(&'a self, header: &'a [u8], burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes>,
    {
        let sh = &*self.sh;
        let max = sh.region.max_msg();
        let mut burst = burst.into_iter().peekable();
        while burst.peek().is_some() {
            if sh.peer_closed() {
                return Err(Error::PeerClosed);
            }
            {
                let mut tx = lock(&sh.tx);
                let mut pushed = 0usize;
                let mut full = false;
                while let Some(m) = burst.peek() {
                    let len = header.len() + m.len();
                    if len > max {
                        if pushed > 0 {
                            tx.publish(&sh.region);
                            sh.tx_copied.fetch_add(pushed as u64, Ordering::Relaxed);
                        }
                        return Err(Error::MessageTooLarge { len, max });
                    }
                    if !tx.push(&sh.region, [header, m])? {
                        full = true;
                        break;
                    }
                    burst.next();
                    pushed += 1;
                }
                if pushed > 0 {
                    tx.publish(&sh.region);
                    sh.tx_copied.fetch_add(pushed as u64, Ordering::Relaxed);
                }
                if !full {
                    return Ok(());
                }
            }
            self.wait_for_room().await?;
        }
        Ok(())
    }

    /// The ring is full: wait until the receiver frees some room (or goes away).
    async fn wait_for_room(&self) -> Result<(), Error> {
        let sh = &*self.sh;
        let ring = sh.tx_ring();
        let before = sh.region.tail(ring).load(Ordering::Acquire);
        let started = Instant::now();
        let mut last_check = started;
        let mut backoff = Duration::from_micros(50);
        loop {
            if sh.region.tail(ring).load(Ordering::Acquire) != before {
                return Ok(());
            }
            let now = Instant::now();
            if sh.peer_closed() {
                return Err(Error::PeerClosed);
            }
            if now.duration_since(last_check) >= sh.wait.liveness {
                last_check = now;
                if sh.peer_gone() {
                    return Err(Error::PeerClosed);
                }
            }
            if now.duration_since(started) < sh.wait.spin {
                std::hint::spin_loop();
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(1));
            }
        }
    }
}

impl<C> Drop for ShmConnection<C> {
    fn drop(&mut self) {
        let sh = &*self.sh;
        sh.region.state(sh.me()).store(CLOSED, Ordering::Release);
        // Wake the peer's parked receiver so it sees the close now.
        sh.region.wake(sh.tx_ring());
        // End our waiter thread (it holds the mapping until then).
        sh.shutdown.store(true, Ordering::Release);
        sh.region.wake(sh.rx_ring());
        if let Some(t) = self.waiter.get() {
            t.unpark();
        }
    }
}

pub(crate) fn mark_attached(region: &Region, role: Role) {
    let me = match role {
        Role::Client => 0,
        Role::Server => 1,
    };
    region.state(me).store(ATTACHED, Ordering::Release);
}

pub(crate) fn peer_attached(region: &Region) -> bool {
    region.state(1).load(Ordering::Acquire) != 0
}

impl<C: Send + Sync> ChunnelConnection for ShmConnection<C> {
    type Data = Bytes;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        self.send_parts(&[], burst)
    }

    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Bytes>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        self.recv_inner(slots, Self::try_recv)
    }
}

/// The header is copied into the ring in front of each message (no extra cost: the message
/// is copied anyway).
impl<C: Send + Sync> SendHeader for ShmConnection<C> {
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

/// Lent send buffers: space reserved in the send ring, filled by the application and
/// published by [`Emit::emit`] without a copy. `None` when the ring has no room now, `len` is
/// over [`ShmConnection::max_message`], or [`crate::LEND_WINDOW`] buffers are out: then send
/// the message with the copying `send` (which waits for room). A lent buffer not yet emitted
/// holds back the messages sent after it (they leave in order).
impl<C: Send + Sync> LendBuffer for ShmConnection<C> {
    type Buf = ShmBuf;

    fn lend(&self, len: usize) -> Option<ShmBuf> {
        let sh = &self.sh;
        if len > sh.region.max_msg() || sh.peer_closed() {
            return None;
        }
        let span = lock(&sh.tx).reserve(&sh.region, len).ok()??;
        Some(ShmBuf::new(Arc::clone(sh), span))
    }
}

impl<C: Send + Sync> Emit for ShmConnection<C> {
    async fn emit<B>(&self, bufs: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = ShmBuf> + Send,
        B::IntoIter: Send,
    {
        let sh = &self.sh;
        if sh.peer_closed() {
            // The buffers go back unsent as they drop.
            return Err(Error::PeerClosed);
        }
        let mut n = 0u64;
        let mut tx = lock(&sh.tx);
        for b in bufs {
            if let Some(span) = b.into_span(sh) {
                tx.finish(&sh.region, span, true);
                n += 1;
            }
        }
        tx.publish(&sh.region);
        drop(tx);
        sh.tx_lent.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }
}

/// Received messages as views of the receive ring (see [`ShmPayload`]); copied instead when
/// the application holds [`crate::RX_HOLES`] of them or half the ring.
///
/// A lent payload is memory the peer process mapped too: a peer that writes a record after
/// publishing it (a bug, or a hostile peer) changes bytes the application is reading. Lengths
/// and positions stay bounds-checked either way; use the copying `recv` when the peer is not
/// trusted with that.
impl<C: Send + Sync> LendRecv for ShmConnection<C> {
    type Lent = ShmPayload;

    fn recv_lent<'a>(
        &'a self,
        slots: &'a mut [Option<ShmPayload>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        self.recv_inner(slots, Self::try_recv_lent)
    }

    fn lend_stats(&self) -> LendStats {
        let sh = &self.sh;
        LendStats {
            rx_lent: sh.rx_lent.load(Ordering::Relaxed),
            rx_copied: sh.rx_copied.load(Ordering::Relaxed),
            tx_lent: sh.tx_lent.load(Ordering::Relaxed),
            tx_copied: sh.tx_copied.load(Ordering::Relaxed),
        }
    }
}
