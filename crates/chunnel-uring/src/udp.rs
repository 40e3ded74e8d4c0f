//! UDP over io_uring: addressed datagrams, wire-compatible with `chunnel_net::udp`.
//!
//! * Client: [`Connect`] is a `Chunnel<()>`; its [`Connection`] owns a socket connected to the
//!   server and a ring.
//! * Server: [`Listener::bind`] gives a [`chunnel::Listener`] handing out one
//!   [`ServerConnection`] per peer address; all of them share the listener's socket and ring.
//!
//! The listener is `chunnel_net::datagram`'s, on a [`RingIo`]: the same bounded per-peer
//! queues (overflow is dropped and counted), accept backlog, peer cap, listener-wide idle sweep
//! and session recognition as kernel UDP. A client gets `PeerClosed` when its server is gone
//! (ICMP).

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use std::sync::{Arc, OnceLock};

use chunnel::{
    Chunnel, ChunnelConnection, Emit, Error, LendBuffer, LendRecv, Negotiate, SendHeader,
};
use chunnel_net::datagram::{self, Config as DatagramConfig, DatagramIo, RxBatch};

use crate::driver::{ClientRx, Driver, Rx, SendPool, Stats, UringBuf, UringPayload, conn_err};

mod bind;
pub use crate::config::{Config, MAX_PAYLOAD};
pub use bind::Bind;

use chunnel::util::lock;

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io { op, source }
}

// ------------------------------------------------------------------------------------------
// Client.

/// The base Chunnel of an io_uring UDP client: `connect_wrap(())` binds an ephemeral port,
/// connects it to `addr` and sets up its ring.
#[derive(Clone, Debug)]
pub struct Connect {
    addr: SocketAddr,
    local: Option<SocketAddr>,
    cfg: Config,
}

impl Connect {
    /// Connects to `addr` with the default [`Config`].
    pub fn new(addr: SocketAddr) -> Self {
        Connect {
            addr,
            local: None,
            cfg: Config::default(),
        }
    }

    /// Binds the client socket to `local` instead of an ephemeral port of the unspecified
    /// address. `connect_wrap` then fails with [`Error::AddrInUse`] if another socket holds
    /// `local`, and with [`Error::AddrFamily`] if `local` and the server address are not
    /// both IPv4 or both IPv6.
    pub fn with_local_addr(mut self, local: SocketAddr) -> Self {
        self.local = Some(local);
        self
    }

    /// Uses `cfg` instead of the default.
    pub fn with_config(mut self, cfg: Config) -> Self {
        self.cfg = cfg;
        self
    }

    /// The server address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Negotiate for Connect {
    fn id(&self) -> &'static str {
        crate::ID
    }

    /// None: the wire is plain UDP, so the peer may use any UDP datapath.
    fn capabilities(&self) -> Vec<chunnel::Capability> {
        Vec::new()
    }

    fn check_available(&self) -> Result<(), Error> {
        self.cfg.check()
    }
}

impl Chunnel<()> for Connect {
    type Connection = Connection;

    async fn connect_wrap(&mut self, (): ()) -> Result<Connection, Error> {
        self.cfg.check()?;
        let local: SocketAddr = match self.local {
            Some(l) if l.is_ipv4() != self.addr.is_ipv4() => {
                return Err(Error::AddrFamily {
                    local: l.to_string(),
                    remote: self.addr.to_string(),
                });
            }
            Some(l) => l,
            None if self.addr.is_ipv4() => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
            None => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let sock =
            std::net::UdpSocket::bind(local).map_err(|e| Error::from_io("bind", local, e))?;
        sock.connect(self.addr)
            .map_err(|e| Error::from_io("connect", self.addr, e))?;
        let rx = ClientRx::new(self.cfg.peer_queue);
        Ok(Connection {
            driver: Driver::new(sock, self.cfg.clone(), rx)?,
            peer: self.addr,
            closed: AtomicBool::new(false),
            send_pool: OnceLock::new(),
        })
    }
}

/// A client-side io_uring UDP connection.
#[derive(Debug)]
pub struct Connection {
    driver: Driver<ClientRx>,
    peer: SocketAddr,
    closed: AtomicBool,
    /// Lent send buffers, allocated on the first `lend` (`None` if that failed).
    send_pool: OnceLock<Option<Arc<SendPool>>>,
}

impl Connection {
    /// The server this connection talks to.
    pub fn peer_addr(&self) -> &SocketAddr {
        &self.peer
    }

    /// The local address.
    pub fn local_addr(&self) -> Result<SocketAddr, Error> {
        self.driver
            .socket()
            .local_addr()
            .map_err(io_err("local_addr"))
    }

    /// Incoming datagrams dropped so far: (over `max_payload`, queue full).
    pub fn dropped(&self) -> (u64, u64) {
        let s = &self.driver.stats;
        (
            s.dropped_oversize.load(Ordering::Relaxed),
            s.dropped_queue_full.load(Ordering::Relaxed),
        )
    }

    /// Closes the connection: later calls fail with [`Error::Closed`]. The socket and ring
    /// are released when the connection is dropped.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.driver.rx_notify.notify_waiters();
        self.driver.rx_notify.notify_one();
    }

    fn check_open(&self) -> Result<(), Error> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }
}

impl chunnel::PeerHandoff for Connection {
    /// A client socket is connected to one peer: there is nothing to hand off to.
    fn hand_off(&self, _first: Bytes) -> bool {
        false
    }

    /// As [`Connection::close`].
    fn release(&self) {
        self.close();
    }
}

impl SendHeader for Connection {
    async fn send_with_header<'a, B>(&'a self, header: &'a [u8], burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        self.check_open()?;
        self.driver.send(None, &self.peer, header, burst).await
    }
}

impl ChunnelConnection for Connection {
    type Data = Bytes;

    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        self.send_with_header(&[], burst).await
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, Error> {
        self.recv_with(slots, false, ClientRx::drain).await
    }
}

impl Connection {
    async fn recv_with<T>(
        &self,
        slots: &mut [Option<T>],
        lend: bool,
        drain: fn(&mut ClientRx, &mut [Option<T>]) -> usize,
    ) -> Result<usize, Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let d = &self.driver;
        loop {
            self.check_open()?;
            {
                let mut g = d.lock();
                if lend {
                    g.rx.lend = true;
                }
                if g.rx.queue.is_empty() {
                    d.pump(&mut g)
                        .map_err(|e| conn_err("recv", &self.peer, e))?;
                }
                let n = drain(&mut g.rx, slots);
                if n > 0 {
                    let more = !g.rx.queue.is_empty();
                    drop(g);
                    if more {
                        d.rx_notify.notify_one();
                    }
                    return Ok(n);
                }
                if let Some(e) = g.rx.error.take() {
                    return Err(conn_err("recv", &self.peer, e));
                }
            }
            // Whoever else reaps datagrams for this connection (a `send`, another `recv`)
            // calls `notify_one`, which leaves a permit if nobody waits yet: registering only
            // now loses no wake-up.
            d.wait_ready(d.rx_notify.notified())
                .await
                .map_err(|e| conn_err("recv", &self.peer, e))?;
        }
    }
}

/// Received datagrams in the kernel's provided receive buffers, handed back to the buffer
/// ring when dropped ([`UringPayload`]). From the first `recv_lent` on, the connection lends
/// every datagram while at most half its [`Config::recv_buffers`] are lent, and copies past
/// that (so the kernel always has buffers to receive into); `recv` on a lent datagram copies
/// it into `Bytes` (mixing the two is allowed, not free).
impl LendRecv for Connection {
    type Lent = UringPayload;

    fn recv_lent<'a>(
        &'a self,
        slots: &'a mut [Option<UringPayload>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        self.recv_with(slots, true, ClientRx::drain_lent)
    }

    fn lend_stats(&self) -> chunnel::LendStats {
        self.driver.stats.lend_stats()
    }
}

/// Send buffers from a pool of [`Config::send_buffers`] blocks of `max_payload` bytes,
/// allocated on the first `lend`; a buffer is free again once its send completed (or when
/// dropped unsent). `None` when all are out (or `len` is over `max_payload`): send the
/// message as `Bytes` then.
impl LendBuffer for Connection {
    type Buf = UringBuf;

    fn lend(&self, len: usize) -> Option<UringBuf> {
        let pool = self.send_pool.get_or_init(|| {
            let n = self.driver.cfg.send_buffers.clamp(1, 32768) as u16;
            SendPool::new(n, self.driver.cfg.max_payload.max(1)).ok()
        });
        pool.as_ref()?.lend(len)
    }
}

impl Emit for Connection {
    async fn emit<B>(&self, bufs: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = UringBuf> + Send,
        B::IntoIter: Send,
    {
        self.check_open()?;
        self.driver.send(None, &self.peer, &[], bufs).await
    }
}

/// Datagrams the ring already reaped for this connection but no `recv` took yet are handed
/// over (as buffered messages, delivered first by a reconfigurable select); those still in the
/// kernel's socket queue go with the socket.
impl chunnel::Handover for Connection {
    fn export(&self, state: &mut chunnel::Handoff<Bytes>) {
        state.buffered.extend(
            self.driver
                .lock()
                .rx
                .queue
                .drain(..)
                .map(UringPayload::into_bytes),
        );
    }

    fn import(&self, _: &mut chunnel::Handoff<Bytes>) {}
}

// ------------------------------------------------------------------------------------------
// Server.

/// The io_uring side of a [`Listener`]: one socket and its ring, as a
/// [`DatagramIo`]. The peer table, queues, backlog, idle
/// sweep and which task reads are `chunnel_net::datagram`'s.
#[derive(Debug)]
pub struct RingIo {
    driver: Driver<RingRx>,
}

/// Datagrams a reap found, waiting for the listener's next
/// [`DatagramIo::recv_batch`]. Bounded by the ring: at most one entry per completion a reap
/// takes, and every reap is followed by a `recv_batch` that empties it.
#[derive(Debug, Default)]
pub struct RingRx {
    batch: RxBatch<SocketAddr>,
    error: Option<io::Error>,
}

impl Rx for RingRx {
    const NAME_LEN: u32 = 28;

    fn deliver(&mut self, from: Option<SocketAddr>, msg: Bytes, _: &Stats) {
        self.batch.push(from, msg);
    }

    /// Kept for the listener, which counts it and hands its first bytes to the peer's
    /// connection ([`chunnel::PeerHandoff::take_oversized`]).
    fn oversize(&mut self, from: Option<SocketAddr>, prefix: &[u8], len: usize, _: &Stats) {
        self.batch.push_oversized(from, prefix, len);
    }

    fn error(&mut self, e: io::Error) {
        self.error = Some(e);
    }
}

impl RingIo {
    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, Error> {
        self.driver
            .socket()
            .local_addr()
            .map_err(io_err("local_addr"))
    }
}

impl DatagramIo for RingIo {
    type Addr = SocketAddr;
    /// The other half of a swap with [`RingRx`]: the datagrams being sorted.
    type RxState = RingRx;
    type TxState = ();

    fn rx_state(&self, _: &DatagramConfig) -> RingRx {
        RingRx::default()
    }

    fn poll_recv_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        {
            let mut w = lock(&self.driver.rx_waker);
            match w.as_ref() {
                Some(old) if old.will_wake(cx.waker()) => {}
                _ => *w = Some(cx.waker().clone()),
            }
        }
        // Datagrams a `send` reaped meanwhile are ready whatever the ring says.
        if !self.driver.lock().rx.batch.is_empty() {
            return Poll::Ready(Ok(()));
        }
        self.driver.poll_ready(cx)
    }

    fn recv_batch(
        &self,
        st: &mut RingRx,
        _: &DatagramConfig,
        deliver: impl FnMut(Option<SocketAddr>, Bytes),
        oversize: impl FnMut(Option<SocketAddr>, &[u8], usize),
    ) -> io::Result<usize> {
        {
            let mut g = self.driver.lock();
            if g.rx.batch.is_empty() {
                self.driver.pump(&mut g)?;
            }
            if let Some(e) = g.rx.error.take() {
                return Err(e);
            }
            if g.rx.batch.is_empty() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            // Sorted outside the driver lock (sends take it), from `st`, whose batch is
            // empty and keeps its capacity.
            st.batch.swap(&mut g.rx.batch);
        }
        Ok(st.batch.hand_out(deliver, oversize))
    }

    async fn send_burst<'a, B>(
        &'a self,
        _: &'a (),
        _: &'a DatagramConfig,
        dest: &'a SocketAddr,
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
        self.driver.send(Some(dest), dest, header, burst).await
    }
}

chunnel_net::datagram_listener! {
    /// An io_uring UDP server socket: `chunnel_net::datagram`'s listener on a [`RingIo`] (see
    /// there for how peers are demultiplexed); its counters and peer count through `Deref`.
    pub struct Listener(RingIo);
}

/// A server-side connection to one peer of a [`Listener`].
pub type ServerConnection = datagram::ServerConnection<RingIo>;

impl Listener {
    /// Binds `addr` with the default [`Config`].
    pub async fn bind(addr: SocketAddr) -> Result<Self, Error> {
        Self::bind_with(addr, Config::default()).await
    }

    /// Binds `addr` with `cfg`. Fails with [`Error::NotAvailable`] where io_uring cannot be
    /// used (see [`crate::check_available`]); bind a `chunnel_net::udp::Listener` then.
    pub async fn bind_with(addr: SocketAddr, cfg: Config) -> Result<Self, Error> {
        cfg.check()?;
        let sock = std::net::UdpSocket::bind(addr).map_err(|e| Error::from_io("bind", addr, e))?;
        let driver = Driver::new(sock, cfg.clone(), RingRx::default())?;
        Ok(Listener(datagram::Listener::new(
            RingIo { driver },
            cfg.datagram,
        )))
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, Error> {
        self.0.get_ref().local_addr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver;

    #[test]
    fn addr_round_trip() {
        for a in ["127.0.0.1:9", "[::1]:65535", "10.1.2.3:0", "[fe80::1%2]:7"] {
            let a: SocketAddr = a.parse().unwrap();
            let mut buf = [0u8; 28];
            let n = driver::encode_addr(&a, &mut buf);
            assert_eq!(driver::decode_addr(&buf[..n as usize]), Some(a));
        }
        assert_eq!(driver::decode_addr(&[0u8; 28]), None);
        assert_eq!(driver::decode_addr(&[2u8]), None);
    }

    #[test]
    fn forced_unavailable_reports_reason() {
        let c = Connect::new("127.0.0.1:1".parse().unwrap())
            .with_config(Config::default().with_forced_unavailable(true));
        match c.check_available() {
            Err(Error::NotAvailable { chunnel, reason }) => {
                assert_eq!(chunnel, crate::ID);
                assert!(reason.contains("forced"), "{reason}");
            }
            other => panic!("expected NotAvailable, got {other:?}"),
        }
    }
}
