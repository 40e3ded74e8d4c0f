//! UDP over io_uring: addressed datagrams, wire-compatible with `chunnel_net::udp`.
//!
//! * Client: [`Connect`] is a `Chunnel<()>`; its [`Connection`] owns a socket connected to the
//!   server and a ring.
//! * Server: [`Listener::bind`] gives a [`chunnel::Listener`] handing out one
//!   [`ServerConnection`] per peer address; all of them share the listener's socket and ring.
//!
//! Semantics follow `chunnel_net::udp` (see `chunnel_net::datagram`): bounded per-peer queues
//! (overflow is dropped and counted), a bounded accept backlog, an idle timeout for server
//! connections whose peer went away, `PeerClosed` on a client whose server is gone (ICMP).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Error, Negotiate, SendHeader};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::driver::{ClientRx, Driver, Rx, Stats, conn_err};

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
        })
    }
}

/// A client-side io_uring UDP connection.
#[derive(Debug)]
pub struct Connection {
    driver: Driver<ClientRx>,
    peer: SocketAddr,
    closed: AtomicBool,
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
        if slots.is_empty() {
            return Ok(0);
        }
        let d = &self.driver;
        loop {
            self.check_open()?;
            {
                let mut g = d.lock();
                if g.rx.queue.is_empty() {
                    d.pump(&mut g)
                        .map_err(|e| conn_err("recv", &self.peer, e))?;
                }
                let n = g.rx.drain(slots);
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

/// Datagrams the ring already reaped for this connection but no `recv` took yet are handed
/// over (as buffered messages, delivered first by a reconfigurable select); those still in the
/// kernel's socket queue go with the socket.
impl chunnel::Handover for Connection {
    fn export(&self, state: &mut chunnel::Handoff<Bytes>) {
        state.buffered.extend(self.driver.lock().rx.queue.drain(..));
    }

    fn import(&self, _: &mut chunnel::Handoff<Bytes>) {}
}

// ------------------------------------------------------------------------------------------
// Server.

/// Per-peer state on a listener.
#[derive(Debug)]
struct Peer {
    queue: Mutex<VecDeque<Bytes>>,
    notify: Notify,
    closed: AtomicBool,
}

impl Peer {
    fn new(first: Option<Bytes>) -> Arc<Self> {
        Arc::new(Peer {
            queue: Mutex::new(first.into_iter().collect()),
            notify: Notify::new(),
            closed: AtomicBool::new(false),
        })
    }
}

/// The listener's receive side: demultiplexing by source address (under the driver lock).
#[derive(Debug)]
pub(crate) struct Demux {
    peers: HashMap<SocketAddr, Arc<Peer>>,
    backlog: VecDeque<(SocketAddr, Arc<Peer>)>,
    listener_open: bool,
    error: Option<io::Error>,
    accept_notify: Arc<Notify>,
    peer_queue: usize,
    max_backlog: usize,
    max_peers: usize,
}

impl Rx for Demux {
    const NAME_LEN: u32 = 28;

    fn deliver(&mut self, from: Option<SocketAddr>, msg: Bytes, stats: &Stats) {
        let Some(addr) = from else {
            return; // no way to answer it
        };
        // The queue is filled under the driver lock, so a connection that finds its queue
        // empty under that lock and leaves the map can never miss a message.
        let peer = match self.peers.get(&addr) {
            Some(p) => p,
            None => {
                if !self.listener_open || self.backlog.len() >= self.max_backlog {
                    stats.dropped_backlog_full.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                if self.peers.len() >= self.max_peers {
                    // Room is made only from peers nobody accepted yet, oldest first.
                    let Some((old, p)) = self.backlog.pop_front() else {
                        stats.dropped_peer_cap.fetch_add(1, Ordering::Relaxed);
                        return;
                    };
                    p.closed.store(true, Ordering::Release);
                    self.peers.remove(&old);
                    stats.evicted.fetch_add(1, Ordering::Relaxed);
                }
                let p = Peer::new(None);
                self.backlog.push_back((addr, p.clone()));
                self.accept_notify.notify_one();
                self.peers.entry(addr).or_insert(p)
            }
        };
        let mut q = lock(&peer.queue);
        if q.len() >= self.peer_queue {
            stats.dropped_queue_full.fetch_add(1, Ordering::Relaxed);
        } else {
            q.push_back(msg);
            drop(q);
            peer.notify.notify_one();
        }
    }

    fn error(&mut self, e: io::Error) {
        // An error for one peer (a refused earlier send) must not stop the listener.
        if e.kind() != io::ErrorKind::ConnectionRefused {
            self.error = Some(e);
        }
    }
}

/// An io_uring UDP server socket; see the [module docs](self) for how peers are
/// demultiplexed.
#[derive(Debug)]
pub struct Listener {
    driver: Arc<Driver<Demux>>,
    accept_notify: Arc<Notify>,
}

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
        let accept_notify = Arc::new(Notify::new());
        let rx = Demux {
            peers: HashMap::new(),
            backlog: VecDeque::new(),
            listener_open: true,
            error: None,
            accept_notify: accept_notify.clone(),
            peer_queue: cfg.peer_queue,
            max_backlog: cfg.backlog,
            max_peers: cfg.max_peers,
        };
        Ok(Listener {
            driver: Arc::new(Driver::new(sock, cfg, rx)?),
            accept_notify,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, Error> {
        self.driver
            .socket()
            .local_addr()
            .map_err(io_err("local_addr"))
    }

    /// Peers with live state on this listener (accepted or waiting to be accepted).
    pub fn peer_count(&self) -> usize {
        self.driver.lock().rx.peers.len()
    }

    /// Datagrams dropped so far: (over `max_payload`, peer queue full, backlog full).
    pub fn dropped(&self) -> (u64, u64, u64) {
        let s = &self.driver.stats;
        (
            s.dropped_oversize.load(Ordering::Relaxed),
            s.dropped_queue_full.load(Ordering::Relaxed),
            s.dropped_backlog_full.load(Ordering::Relaxed),
        )
    }
}

impl Listener {
    /// What [`Config::max_peers`] did so far: (peers waiting for `accept` evicted to admit
    /// new ones, datagrams from new peers dropped at the cap with no peer to evict).
    pub fn peer_cap_stats(&self) -> (u64, u64) {
        let s = &self.driver.stats;
        (
            s.evicted.load(Ordering::Relaxed),
            s.dropped_peer_cap.load(Ordering::Relaxed),
        )
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Connections already accepted keep working; new peers are no longer admitted, and
        // peers nobody accepted are forgotten.
        let mut g = self.driver.lock();
        g.rx.listener_open = false;
        let pending: Vec<_> = g.rx.backlog.drain(..).collect();
        for (addr, _) in pending {
            g.rx.peers.remove(&addr);
        }
    }
}

impl chunnel::Listener for Listener {
    type Connection = ServerConnection;

    async fn accept(&mut self) -> Result<ServerConnection, Error> {
        let d = &self.driver;
        loop {
            let notified = self.accept_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut g = d.lock();
                if g.rx.backlog.is_empty() {
                    d.pump(&mut g).map_err(io_err("accept"))?;
                }
                if let Some((addr, peer)) = g.rx.backlog.pop_front() {
                    return Ok(ServerConnection {
                        driver: d.clone(),
                        addr,
                        peer,
                        last_rx: Mutex::new(Instant::now()),
                    });
                }
                if let Some(e) = g.rx.error.take() {
                    return Err(Error::Io {
                        op: "accept",
                        source: e,
                    });
                }
            }
            d.wait_ready(notified).await.map_err(io_err("accept"))?;
        }
    }
}

/// A server-side connection to one peer of a [`Listener`].
#[derive(Debug)]
pub struct ServerConnection {
    driver: Arc<Driver<Demux>>,
    addr: SocketAddr,
    peer: Arc<Peer>,
    last_rx: Mutex<Instant>,
}

impl ServerConnection {
    /// The peer this connection talks to.
    pub fn peer_addr(&self) -> &SocketAddr {
        &self.addr
    }

    /// Closes the connection and frees its state on the listener; later calls fail with
    /// [`Error::Closed`]. A datagram the same peer sends afterwards starts a new connection.
    pub fn close(&self) {
        let mut g = self.driver.lock();
        self.leave(&mut g.rx);
        drop(g);
        self.peer.notify.notify_waiters();
    }

    /// Removes this peer from the listener (driver lock held).
    fn leave(&self, d: &mut Demux) {
        if !self.peer.closed.swap(true, Ordering::AcqRel)
            && d.peers
                .get(&self.addr)
                .is_some_and(|p| Arc::ptr_eq(p, &self.peer))
        {
            d.peers.remove(&self.addr);
        }
    }

    /// Ends the connection for idleness, unless a message slipped in meanwhile.
    fn close_if_idle(&self) -> bool {
        let mut g = self.driver.lock();
        if !lock(&self.peer.queue).is_empty() {
            return false;
        }
        self.leave(&mut g.rx);
        true
    }

    fn drain(&self, slots: &mut [Option<Bytes>]) -> usize {
        let mut q = lock(&self.peer.queue);
        let n = q.len().min(slots.len());
        for (s, m) in slots.iter_mut().zip(q.drain(..n)) {
            *s = Some(m);
        }
        n
    }
}

impl Drop for ServerConnection {
    fn drop(&mut self) {
        self.close();
    }
}

impl chunnel::PeerHandoff for ServerConnection {
    fn hand_off(&self, first: Bytes) -> bool {
        let mut g = self.driver.lock();
        let d = &mut g.rx;
        self.leave(d);
        let admitted =
            d.listener_open && d.backlog.len() < d.max_backlog && !d.peers.contains_key(&self.addr);
        if admitted {
            let p = Peer::new(Some(first));
            d.peers.insert(self.addr, p.clone());
            d.backlog.push_back((self.addr, p));
            d.accept_notify.notify_one();
        }
        drop(g);
        self.peer.notify.notify_waiters();
        admitted
    }

    /// As [`ServerConnection::close`]: the peer leaves the listener's table now.
    fn release(&self) {
        self.close();
    }
}

impl SendHeader for ServerConnection {
    async fn send_with_header<'a, B>(&'a self, header: &'a [u8], burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        if self.peer.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        self.driver
            .send(Some(&self.addr), &self.addr, header, burst)
            .await
    }
}

impl ChunnelConnection for ServerConnection {
    type Data = Bytes;

    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        self.send_with_header(&[], burst).await
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let d = &self.driver;
        loop {
            let notified = self.peer.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let n = self.drain(slots);
            if n > 0 {
                *lock(&self.last_rx) = Instant::now();
                return Ok(n);
            }
            if self.peer.closed.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            let reaped = {
                let mut g = d.lock();
                d.pump(&mut g)
                    .map_err(|e| conn_err("recv", &self.addr, e))?
            };
            if reaped.delivered > 0 {
                continue;
            }
            let idle = async {
                match d.cfg.idle_timeout {
                    Some(t) => {
                        let deadline = *lock(&self.last_rx) + t;
                        tokio::time::sleep_until(deadline).await
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(idle);
            let woken = async {
                tokio::select! {
                    () = &mut notified => false,
                    () = &mut idle => true,
                }
            };
            let idle_fired = d
                .wait_ready(woken)
                .await
                .map_err(|e| conn_err("recv", &self.addr, e))?;
            if idle_fired == Some(true) && self.close_if_idle() {
                return Err(Error::PeerClosed);
            }
        }
    }
}

/// No state to hand over (see `chunnel_net::datagram`'s server connection): a server
/// connection is never itself a select branch, and its queue outlives a switch below
/// [`chunnel::Shared`].
impl chunnel::Handover for ServerConnection {
    fn export(&self, _: &mut chunnel::Handoff<Self::Data>) {}
    fn import(&self, _: &mut chunnel::Handoff<Self::Data>) {}
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
