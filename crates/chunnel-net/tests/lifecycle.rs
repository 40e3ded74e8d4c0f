//! Lifecycle, typed errors, hostile network input, bounds, batching and concurrency of the
//! kernel datapaths, over real loopback sockets (127.0.0.1, abstract Unix names, temp-dir
//! paths).
//!
//! Every wait that should finish is bounded by [`WAIT`] only to turn a hang into a failure; the
//! few waits that are *expected* to time out (a queue that must stay empty, an accept that
//! must not find a peer) use [`QUIET`]. No test asserts how long anything takes.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ConnectionExt, Error, Listener, PeerHandoff};
use chunnel_net::{framed, tcp, udp, uds};
use chunnel_test::{recv_n, spawn_echo};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bound on anything that should finish (a hang guard, not a timing assertion).
const WAIT: Duration = Duration::from_secs(10);
/// How long a wait that is expected to come up empty is given.
const QUIET: Duration = Duration::from_millis(200);
/// A pause that lets datagrams already sent on loopback reach the receiving socket.
const SETTLE: Duration = Duration::from_millis(100);

async fn within<F: Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(WAIT, f).await {
        Ok(t) => t,
        Err(_) => panic!("{what} did not finish within {WAIT:?}"),
    }
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn unique_name(kind: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "chunnel-life-{kind}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn abstract_addr(kind: &str) -> uds::UnixAddr {
    uds::UnixAddr::Abstract(unique_name(kind).into_bytes())
}

fn temp_path(kind: &str) -> PathBuf {
    std::env::temp_dir().join(format!("{}.sock", unique_name(kind)))
}

/// A 4-byte message carrying `id`.
fn id_msg(id: u32) -> Bytes {
    Bytes::copy_from_slice(&id.to_be_bytes())
}

fn msg_id(m: &Bytes) -> u32 {
    u32::from_be_bytes(
        m[..]
            .try_into()
            .unwrap_or_else(|_| panic!("not an id message: {m:?}")),
    )
}

/// A message of `len` bytes (at least 4) that starts with `id`.
fn numbered(id: u32, len: usize) -> Bytes {
    let mut v = vec![(id % 251) as u8; len.max(4)];
    v[..4].copy_from_slice(&id.to_be_bytes());
    Bytes::from(v)
}

/// One length-prefixed frame as the stream datapaths put it on the wire.
fn frame(payload: &[u8]) -> Vec<u8> {
    let mut v = (payload.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(payload);
    v
}

// ---------------------------------------------------------------------------------------------
// A small harness so every datagram check runs over UDP and Unix datagram sockets alike.
// ---------------------------------------------------------------------------------------------

trait Dgram {
    type Addr: Clone + std::fmt::Debug + Send;
    type Listener: Listener<Connection = Self::Server> + Send + 'static;
    type Server: ChunnelConnection<Data = Bytes> + 'static;
    type Connect: Chunnel<(), Connection = Self::Client> + Clone + Send;
    type Client: ChunnelConnection<Data = Bytes> + 'static;

    const NAME: &'static str;
    /// The default configuration of this family.
    fn config() -> udp::Config;
    /// An address nobody has bound yet (UDP: port 0).
    fn fresh() -> Self::Addr;
    /// Binds `addr`; returns the listener, a client Chunnel for it and the bound address.
    fn bind_at(
        addr: Self::Addr,
        cfg: udp::Config,
    ) -> impl Future<Output = Result<Bound<Self>, Error>> + Send;
    fn peer_count(l: &Self::Listener) -> usize;
    fn dropped(l: &Self::Listener) -> (u64, u64, u64);
    fn close(s: &Self::Server);
}

/// What [`Dgram::bind_at`] returns: the listener, a client Chunnel for it, the bound address.
type Bound<D> = (
    <D as Dgram>::Listener,
    <D as Dgram>::Connect,
    <D as Dgram>::Addr,
);

struct Udp;

impl Dgram for Udp {
    type Addr = SocketAddr;
    type Listener = udp::Listener;
    type Server = udp::ServerConnection;
    type Connect = udp::Connect;
    type Client = udp::Connection;

    const NAME: &'static str = "udp";
    fn config() -> udp::Config {
        udp::Config::default()
    }
    fn fresh() -> SocketAddr {
        loopback()
    }
    async fn bind_at(addr: SocketAddr, cfg: udp::Config) -> Result<Bound<Self>, Error> {
        let l = udp::Listener::bind_with(addr, cfg).await?;
        let a = l.local_addr()?;
        Ok((l, udp::Connect::new(a), a))
    }
    fn peer_count(l: &udp::Listener) -> usize {
        l.peer_count()
    }
    fn dropped(l: &udp::Listener) -> (u64, u64, u64) {
        l.dropped()
    }
    fn close(s: &udp::ServerConnection) {
        s.close()
    }
}

struct UnixDgram;

impl Dgram for UnixDgram {
    type Addr = uds::UnixAddr;
    type Listener = uds::DatagramListener;
    type Server = uds::DatagramServerConnection;
    type Connect = uds::DatagramConnect;
    type Client = uds::DatagramConnection;

    const NAME: &'static str = "unix-dgram";
    fn config() -> udp::Config {
        udp::Config::default().with_max_payload_bytes(uds::MAX_DATAGRAM)
    }
    fn fresh() -> uds::UnixAddr {
        abstract_addr("dgram")
    }
    async fn bind_at(addr: uds::UnixAddr, cfg: udp::Config) -> Result<Bound<Self>, Error> {
        let l = uds::DatagramListener::bind_with(addr.clone(), cfg).await?;
        Ok((l, uds::DatagramConnect::new(addr.clone()), addr))
    }
    fn peer_count(l: &uds::DatagramListener) -> usize {
        l.get_ref().peer_count()
    }
    fn dropped(l: &uds::DatagramListener) -> (u64, u64, u64) {
        l.get_ref().dropped()
    }
    fn close(s: &uds::DatagramServerConnection) {
        s.close()
    }
}

async fn bind<D: Dgram>(cfg: udp::Config) -> (D::Listener, D::Connect) {
    let (l, k, _) = D::bind_at(D::fresh(), cfg)
        .await
        .unwrap_or_else(|e| panic!("{}: bind: {e}", D::NAME));
    (l, k)
}

async fn connect<D: Dgram>(k: &D::Connect) -> D::Client {
    within("connect", k.clone().connect_wrap(()))
        .await
        .unwrap_or_else(|e| panic!("{}: connect: {e}", D::NAME))
}

async fn accept<D: Dgram>(l: &mut D::Listener) -> D::Server {
    within("accept", l.accept())
        .await
        .unwrap_or_else(|e| panic!("{}: accept: {e}", D::NAME))
}

async fn recv_id<C: ChunnelConnection<Data = Bytes>>(c: &C, what: &str) -> u32 {
    let m = within(what, c.recv_one())
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    msg_id(&m)
}

async fn send_id<C: ChunnelConnection<Data = Bytes>>(c: &C, id: u32) {
    within("send", c.send_one(id_msg(id)))
        .await
        .unwrap_or_else(|e| panic!("send of {id}: {e}"));
}

// ---------------------------------------------------------------------------------------------
// 1. Lifecycle: per-peer state is freed.
// ---------------------------------------------------------------------------------------------

/// Three accepted peers: dropping two server connections frees two entries, closing the third
/// frees the last; the closed connection then fails with `Closed` both ways.
async fn peer_state_freed_on_drop_and_close<D: Dgram>() {
    let n = D::NAME;
    let (mut l, k) = bind::<D>(D::config().with_idle_timeout(None)).await;
    let mut clients = Vec::new();
    let mut servers = Vec::new();
    for i in 0..3u32 {
        let c = connect::<D>(&k).await;
        send_id(&c, i).await;
        let s = accept::<D>(&mut l).await;
        assert_eq!(
            recv_id(&s, "server recv").await,
            i,
            "{n}: connection {i} got another peer's message"
        );
        clients.push(c);
        servers.push(s);
    }
    assert_eq!(D::peer_count(&l), 3, "{n}: three accepted peers");
    let last = servers.pop().unwrap();
    drop(servers);
    assert_eq!(
        D::peer_count(&l),
        1,
        "{n}: dropping two server connections must free their peer state"
    );
    D::close(&last);
    assert_eq!(
        D::peer_count(&l),
        0,
        "{n}: close() must free the peer state"
    );
    match within("send after close", last.send_one(id_msg(9))).await {
        Err(Error::Closed) => {}
        other => panic!("{n}: send after close gave {other:?}, not Closed"),
    }
    match within("recv after close", last.recv_one()).await {
        Err(Error::Closed) => {}
        other => panic!("{n}: recv after close gave {other:?}, not Closed"),
    }
    drop(last);
    assert_eq!(D::peer_count(&l), 0, "{n}: drop after close changed state");
    assert_eq!(
        D::dropped(&l),
        (0, 0, 0),
        "{n}: nothing should have been dropped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_peer_state_freed_on_drop_and_close() {
    peer_state_freed_on_drop_and_close::<Udp>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_dgram_peer_state_freed_on_drop_and_close() {
    peer_state_freed_on_drop_and_close::<UnixDgram>().await;
}

/// A peer that sends after its server connection was dropped (or closed) is accepted as a new
/// connection; dropping the old, closed handle late does not remove the new connection's state.
async fn returning_peer_is_a_new_connection<D: Dgram>() {
    let n = D::NAME;
    let (mut l, k) = bind::<D>(D::config().with_idle_timeout(None)).await;
    let c = connect::<D>(&k).await;
    send_id(&c, 1).await;
    let a = accept::<D>(&mut l).await;
    assert_eq!(recv_id(&a, "first recv").await, 1);
    drop(a);
    assert_eq!(
        D::peer_count(&l),
        0,
        "{n}: dropped connection still counted"
    );

    send_id(&c, 2).await;
    let b = accept::<D>(&mut l).await;
    assert_eq!(
        recv_id(&b, "recv on the new connection").await,
        2,
        "{n}: the returning peer's new connection got the wrong message"
    );
    assert_eq!(D::peer_count(&l), 1);

    // Close (not drop) it; the peer returns again; only then is the old handle dropped.
    D::close(&b);
    assert_eq!(D::peer_count(&l), 0);
    send_id(&c, 3).await;
    let c2 = accept::<D>(&mut l).await;
    drop(b);
    assert_eq!(
        D::peer_count(&l),
        1,
        "{n}: dropping a closed connection removed its successor's state"
    );
    assert_eq!(recv_id(&c2, "recv on the third connection").await, 3);
    send_id(&c2, 30).await;
    assert_eq!(
        recv_id(&c, "client recv of the reply").await,
        30,
        "{n}: the new connection cannot answer its peer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_returning_peer_is_a_new_connection() {
    returning_peer_is_a_new_connection::<Udp>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_dgram_returning_peer_is_a_new_connection() {
    returning_peer_is_a_new_connection::<UnixDgram>().await;
}

/// With a 200 ms idle timeout, a server connection whose client goes silent ends with
/// `PeerClosed`, its state is freed, and the same peer later starts a new connection.
async fn idle_timeout_ends_with_peer_closed<D: Dgram>() {
    let n = D::NAME;
    let cfg = D::config().with_idle_timeout(Some(Duration::from_millis(200)));
    let (mut l, k) = bind::<D>(cfg).await;
    let c = connect::<D>(&k).await;
    send_id(&c, 1).await;
    let s = accept::<D>(&mut l).await;
    assert_eq!(recv_id(&s, "recv").await, 1);
    assert_eq!(D::peer_count(&l), 1);
    match within("recv from a silent peer", s.recv_one()).await {
        Err(Error::PeerClosed) => {}
        other => panic!("{n}: idle connection ended with {other:?}, not PeerClosed"),
    }
    assert_eq!(
        D::peer_count(&l),
        0,
        "{n}: an idle-timed-out connection must free its peer state"
    );
    match within("recv after idle close", s.recv_one()).await {
        Err(e) if e.is_closed() => {}
        other => panic!("{n}: recv after the idle close gave {other:?}"),
    }
    send_id(&c, 2).await;
    let s2 = accept::<D>(&mut l).await;
    assert_eq!(recv_id(&s2, "recv on the new connection").await, 2);
    assert_eq!(D::peer_count(&l), 1);
}

/// Waits (bounded) until the listener holds `n` peers.
async fn until_peer_count<D: Dgram>(l: &D::Listener, n: usize, what: &str) {
    within(what, async {
        while D::peer_count(l) != n {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// The idle timeout holds whether or not a receive is pending: a connection the application
/// does not read is ended too (its state freed; its next receive reports `PeerClosed`,
/// then `Closed`), while messages waiting to be read keep it alive. The sweep that ends
/// connections stops when none is left and starts again for the next one.
async fn idle_timeout_without_a_pending_receive<D: Dgram>() {
    let n = D::NAME;
    let cfg = D::config().with_idle_timeout(Some(Duration::from_millis(150)));
    let (mut l, k) = bind::<D>(cfg).await;
    for round in 0..2 {
        let c = connect::<D>(&k).await;
        send_id(&c, 1).await;
        send_id(&c, 2).await;
        let s = accept::<D>(&mut l).await;
        assert_eq!(recv_id(&s, "first").await, 1);
        // The second message waits unread for three timeouts: the connection stays.
        tokio::time::sleep(Duration::from_millis(450)).await;
        assert_eq!(
            D::peer_count(&l),
            1,
            "{n} round {round}: unread messages keep it"
        );
        assert_eq!(recv_id(&s, "second").await, 2);
        // Then nobody reads and the peer is silent: ended, without a receive pending.
        until_peer_count::<D>(&l, 0, "idle end without a pending receive").await;
        match within("recv after the idle end", s.recv_one()).await {
            Err(Error::PeerClosed) => {}
            other => panic!("{n} round {round}: first recv gave {other:?}, not PeerClosed"),
        }
        match within("recv again", s.recv_one()).await {
            Err(e) if e.is_closed() => {}
            other => panic!("{n} round {round}: second recv gave {other:?}, not Closed"),
        }
        drop(c);
    }
}

/// Many connections idle at once are all ended: the sweep looks at a bounded batch at a
/// time and comes back for the rest. The runtime (one thread) is blocked for three idle
/// timeouts, so all 600 connections are due at the sweep's next look: three batches of
/// at most 256.
#[tokio::test(flavor = "current_thread")]
async fn udp_many_connections_idle_at_once_are_all_ended() {
    let cfg = Udp::config().with_idle_timeout(Some(Duration::from_millis(100)));
    let (mut l, k) = bind::<Udp>(cfg).await;
    let mut clients = Vec::new();
    let mut servers = Vec::new();
    for i in 0..600 {
        let c = connect::<Udp>(&k).await;
        send_id(&c, i).await;
        let s = accept::<Udp>(&mut l).await;
        // Read (an unread message would keep the connection alive), then left alone.
        assert_eq!(recv_id(&s, "the one message").await, i);
        servers.push(s);
        clients.push(c);
    }
    std::thread::sleep(Duration::from_millis(300));
    until_peer_count::<Udp>(&l, 0, "600 idle connections ended").await;
    for s in &servers {
        match within("recv after the idle end", s.recv_one()).await {
            Err(Error::PeerClosed) => {}
            other => panic!("an idle connection gave {other:?}, not PeerClosed"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_idle_timeout_without_a_pending_receive() {
    idle_timeout_without_a_pending_receive::<Udp>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_dgram_idle_timeout_without_a_pending_receive() {
    idle_timeout_without_a_pending_receive::<UnixDgram>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_idle_timeout_ends_with_peer_closed() {
    idle_timeout_ends_with_peer_closed::<Udp>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_dgram_idle_timeout_ends_with_peer_closed() {
    idle_timeout_ends_with_peer_closed::<UnixDgram>().await;
}

/// Messages keep a connection alive past its idle timeout: a client that sends every 40 ms
/// for 1.2 s (three times the 400 ms timeout, which leaves 360 ms for a stalled test thread)
/// is served throughout, over the connection it started with. (The listener's idle sweep
/// looks at each connection when it could first be idle: a look that finds it in use must
/// not end it, and must look again later.)
async fn traffic_keeps_the_idle_timer_away<D: Dgram>() {
    let n = D::NAME;
    let cfg = D::config().with_idle_timeout(Some(Duration::from_millis(400)));
    let (mut l, k) = bind::<D>(cfg).await;
    let c = connect::<D>(&k).await;
    send_id(&c, 0).await;
    let s = accept::<D>(&mut l).await;
    // A receive is pending all along, so the idle timer is armed and polled throughout.
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    let server = tokio::spawn(async move {
        loop {
            let r = s.recv_one().await;
            let end = r.is_err();
            if tx.send(r).await.is_err() || end {
                return;
            }
        }
    });
    assert_eq!(
        within("first", rx.recv()).await.unwrap().unwrap(),
        id_msg(0)
    );
    for i in 1..30 {
        tokio::time::sleep(Duration::from_millis(40)).await;
        send_id(&c, i).await;
        match within("recv while the client keeps sending", rx.recv()).await {
            Some(Ok(m)) => assert_eq!(m, id_msg(i), "{n}: message {i}"),
            other => panic!("{n}: a connection in use ended after {i} messages: {other:?}"),
        }
    }
    assert_eq!(D::peer_count(&l), 1, "{n}: still one connection");
    // Then silence ends it.
    match within("recv from a now silent peer", rx.recv()).await {
        Some(Err(Error::PeerClosed)) => {}
        other => panic!("{n}: the silent connection ended with {other:?}, not PeerClosed"),
    }
    within("server task", server).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_traffic_keeps_the_idle_timer_away() {
    traffic_keeps_the_idle_timer_away::<Udp>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_dgram_traffic_keeps_the_idle_timer_away() {
    traffic_keeps_the_idle_timer_away::<UnixDgram>().await;
}

/// `close()` from one task wakes a `recv` parked in another: it returns `Closed`, no hang.
async fn close_wakes_pending_recv<D: Dgram>()
where
    D::Server: Send + Sync,
{
    let n = D::NAME;
    let (mut l, k) = bind::<D>(D::config().with_idle_timeout(None)).await;
    let c = connect::<D>(&k).await;
    send_id(&c, 1).await;
    let s = Arc::new(accept::<D>(&mut l).await);
    assert_eq!(recv_id(&*s, "recv").await, 1);
    let s2 = s.clone();
    let pending = tokio::spawn(async move { s2.recv_one().await });
    tokio::time::sleep(SETTLE).await; // let it park (the outcome is the same if it has not)
    D::close(&s);
    match within("parked recv after close", pending).await {
        Ok(Err(Error::Closed)) => {}
        other => panic!("{n}: a recv parked across close() gave {other:?}"),
    }
    assert_eq!(D::peer_count(&l), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_close_wakes_pending_recv() {
    close_wakes_pending_recv::<Udp>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_dgram_close_wakes_pending_recv() {
    close_wakes_pending_recv::<UnixDgram>().await;
}

/// Peers waiting for `accept` when the listener is dropped are forgotten, while an accepted
/// connection keeps working (and keeps the socket open). Once the last connection goes, the
/// socket is released: the address can be bound again.
///
/// The forgotten peers' entries are not observable once the listener is gone (there is no
/// public accessor on a server connection); what is checked is that their later datagrams
/// never reach the surviving connection and that nothing keeps the socket alive.
async fn unaccepted_peers_forgotten_when_listener_dropped<D: Dgram>() {
    let n = D::NAME;
    let cfg = D::config().with_idle_timeout(None);
    let (mut l, k, addr) = D::bind_at(D::fresh(), cfg.clone()).await.expect("bind");
    let mut clients = Vec::new();
    for i in 0..3u32 {
        let c = connect::<D>(&k).await;
        send_id(&c, i).await;
        clients.push(c);
    }
    tokio::time::sleep(SETTLE).await;
    let a = accept::<D>(&mut l).await; // reads all three datagrams
    assert_eq!(
        recv_id(&a, "recv").await,
        0,
        "{n}: first peer accepted first"
    );
    assert_eq!(
        D::peer_count(&l),
        3,
        "{n}: one accepted and two waiting peers must be counted"
    );
    drop(l);

    // The forgotten peers talk first; the survivor must only ever see its own peer.
    send_id(&clients[1], 11).await;
    send_id(&clients[2], 12).await;
    send_id(&clients[0], 10).await;
    assert_eq!(
        recv_id(&a, "recv after the listener was dropped").await,
        10,
        "{n}: a forgotten peer's datagram reached another connection"
    );
    send_id(&a, 100).await;
    assert_eq!(recv_id(&clients[0], "client recv").await, 100);

    match D::bind_at(addr.clone(), cfg.clone()).await {
        Err(Error::AddrInUse { .. }) => {}
        other => panic!(
            "{n}: rebinding while a connection is alive gave {:?}",
            other.map(|_| ())
        ),
    }
    drop(a);
    let (mut l2, k2, _) = D::bind_at(addr, cfg)
        .await
        .unwrap_or_else(|e| panic!("{n}: the socket was not released: {e}"));
    let fresh = connect::<D>(&k2).await;
    send_id(&fresh, 7).await;
    let s = accept::<D>(&mut l2).await;
    assert_eq!(recv_id(&s, "recv on the rebound listener").await, 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_unaccepted_peers_forgotten_when_listener_dropped() {
    unaccepted_peers_forgotten_when_listener_dropped::<Udp>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_dgram_unaccepted_peers_forgotten_when_listener_dropped() {
    unaccepted_peers_forgotten_when_listener_dropped::<UnixDgram>().await;
}

/// `closer.close()` flushes and half-closes: `other` receives what was sent, then `PeerClosed`
/// (again on every later recv); `closer` can no longer send (`Closed`) but can still receive.
async fn stream_close<R, W>(
    name: &str,
    closer: framed::Connection<R, W>,
    other: framed::Connection<R, W>,
) where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    let sent: Vec<Bytes> = (0..5)
        .map(|i| numbered(i, 10 + 1000 * i as usize))
        .collect();
    within("send", closer.send(sent[..2].to_vec()))
        .await
        .expect("send");
    within("send", closer.send(sent[2..].to_vec()))
        .await
        .expect("send");
    within("close", closer.close()).await.expect("close");
    match within("send after close", closer.send_one(id_msg(1))).await {
        Err(Error::Closed) => {}
        other => panic!("{name}: send after close gave {other:?}, not Closed"),
    }
    within("second close", closer.close())
        .await
        .expect("closing twice must be harmless");

    let got = within("recv", recv_n(&other, sent.len()))
        .await
        .unwrap_or_else(|e| panic!("{name}: messages sent before close were lost: {e}"));
    assert_eq!(got, sent, "{name}: messages before close changed");
    for attempt in 0..2 {
        match within("recv after peer close", other.recv_one()).await {
            Err(Error::PeerClosed) => {}
            other => panic!("{name}: recv #{attempt} after the peer closed gave {other:?}"),
        }
    }
    // Half-close: the other direction still works.
    within("reply", other.send_one(id_msg(42)))
        .await
        .expect("the other side can still send after a half-close");
    assert_eq!(recv_id(&closer, "recv after own close").await, 42);
    within("close", other.close()).await.expect("close");
    match within("recv after both closed", closer.recv_one()).await {
        Err(Error::PeerClosed) => {}
        other => panic!("{name}: recv after the other side closed gave {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_close_delivers_sent_messages_then_peer_closed() {
    let mut l = tcp::Listener::bind(loopback()).await.expect("bind");
    let k = tcp::Connect::new(l.local_addr().unwrap());
    for client_closes in [true, false] {
        let c = within("connect", k.clone().connect_wrap(()))
            .await
            .expect("connect");
        let s = within("accept", l.accept()).await.expect("accept");
        if client_closes {
            stream_close("tcp (client closes)", c, s).await;
        } else {
            stream_close("tcp (server closes)", s, c).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_stream_close_delivers_sent_messages_then_peer_closed() {
    for (i, addr) in [abstract_addr("stream"), temp_path("stream").into()]
        .into_iter()
        .enumerate()
    {
        let mut l = uds::StreamListener::bind(addr.clone()).await.expect("bind");
        let k = uds::StreamConnect::new(addr);
        let c = within("connect", k.clone().connect_wrap(()))
            .await
            .expect("connect");
        let s = within("accept", l.accept()).await.expect("accept");
        if i == 0 {
            stream_close("unix stream (client closes)", c, s).await;
        } else {
            stream_close("unix stream (server closes)", s, c).await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Typed errors.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_bind_in_use_is_addr_in_use() {
    let l = udp::Listener::bind(loopback()).await.expect("bind");
    let addr = l.local_addr().unwrap();
    match udp::Listener::bind(addr).await {
        Err(Error::AddrInUse { addr: a }) => assert_eq!(a, addr.to_string()),
        other => panic!("second UDP bind gave {:?}", other.map(|_| ())),
    }
}

/// A UDP client socket, which `connect` binds (there is no explicit bind), ends up on an
/// ephemeral port of the address its route to the server uses, for IPv4 and IPv6, and an
/// exchange works both ways. (That the bind system call is gone is shown by `strace -c` in
/// docs/evaluation.md, not here: both ways end bound alike.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_client_is_bound_to_an_ephemeral_port_of_the_routes_address() {
    for (listen, family) in [("127.0.0.1:0", "IPv4"), ("[::1]:0", "IPv6")] {
        let mut l = match udp::Listener::bind(listen.parse().unwrap()).await {
            Ok(l) => l,
            // No IPv6 loopback on this host: nothing to check for that family.
            Err(e) if family == "IPv6" => {
                eprintln!("skipping IPv6: {e}");
                continue;
            }
            Err(e) => panic!("bind {listen}: {e}"),
        };
        let server = l.local_addr().unwrap();
        let c = udp::Connect::new(server)
            .connect_wrap(())
            .await
            .expect("connect");
        let local = c.get_ref().local_addr().unwrap();
        assert_eq!(
            local.ip(),
            server.ip(),
            "{family}: local address not the route's"
        );
        assert_ne!(local.port(), 0, "{family}: no ephemeral port bound");
        send_id(&c, 7).await;
        let a = accept::<Udp>(&mut l).await;
        assert_eq!(
            a.peer_addr(),
            &local,
            "{family}: server sees another address"
        );
        assert_eq!(recv_id(&a, "server recv").await, 7);
        send_id(&a, 8).await;
        assert_eq!(recv_id(&c, "client recv").await, 8);
    }
}

/// A UDP connect the kernel refuses at once (the broadcast address, on a socket without
/// `SO_BROADCAST`) is a typed error naming the operation and carrying the kernel's reason,
/// not a panic or a socket that fails later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_connect_to_broadcast_is_a_typed_error() {
    let bad: SocketAddr = "255.255.255.255:9".parse().unwrap();
    match udp::Connect::new(bad).connect_wrap(()).await {
        Err(Error::Io { op, source }) => {
            assert_eq!(op, "connect");
            assert_eq!(
                source.kind(),
                std::io::ErrorKind::PermissionDenied,
                "{source}"
            );
        }
        Err(e) => panic!("connect to the broadcast address gave {e}"),
        Ok(_) => panic!("connect to the broadcast address succeeded"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_bind_in_use_is_addr_in_use() {
    let l = tcp::Listener::bind(loopback()).await.expect("bind");
    let addr = l.local_addr().unwrap();
    match tcp::Listener::bind(addr).await {
        Err(Error::AddrInUse { addr: a }) => assert_eq!(a, addr.to_string()),
        other => panic!("second TCP bind gave {:?}", other.map(|_| ())),
    }
}

/// A second bind of the same abstract name or path fails with `AddrInUse` for both socket
/// kinds, and the failed bind leaves the first listener (and its socket file) working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_bind_in_use_is_addr_in_use() {
    for addr in [abstract_addr("inuse-d"), temp_path("inuse-d").into()] {
        let mut l = uds::DatagramListener::bind(addr.clone())
            .await
            .expect("bind");
        match uds::DatagramListener::bind(addr.clone()).await {
            Err(Error::AddrInUse { .. }) => {}
            other => panic!(
                "second datagram bind of {addr} gave {:?}",
                other.map(|_| ())
            ),
        }
        let c = within(
            "connect",
            uds::DatagramConnect::new(addr.clone()).connect_wrap(()),
        )
        .await
        .expect("the first listener must survive a failed second bind");
        send_id(&c, 5).await;
        let s = within("accept", l.accept()).await.expect("accept");
        assert_eq!(recv_id(&s, "recv").await, 5);
    }
    for addr in [abstract_addr("inuse-s"), temp_path("inuse-s").into()] {
        let mut l = uds::StreamListener::bind(addr.clone()).await.expect("bind");
        match uds::StreamListener::bind(addr.clone()).await {
            Err(Error::AddrInUse { .. }) => {}
            other => panic!("second stream bind of {addr} gave {:?}", other.map(|_| ())),
        }
        let c = within(
            "connect",
            uds::StreamConnect::new(addr.clone()).connect_wrap(()),
        )
        .await
        .expect("the first listener must survive a failed second bind");
        let s = within("accept", l.accept()).await.expect("accept");
        send_id(&c, 6).await;
        assert_eq!(recv_id(&s, "recv").await, 6);
    }
}

/// A listener bound to a path removes its socket file when dropped, so the path can be bound
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_path_listener_removes_its_file_on_drop() {
    let p = temp_path("file");
    let l = uds::StreamListener::bind(p.clone()).await.expect("bind");
    assert!(p.exists(), "socket file missing while bound");
    drop(l);
    assert!(!p.exists(), "socket file left behind by a dropped listener");
    let l = uds::DatagramListener::bind(p.clone())
        .await
        .expect("rebinding a path after the listener was dropped");
    drop(l);
    assert!(!p.exists(), "socket file left behind by a dropped listener");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_connect_to_closed_port_is_connection_refused() {
    let addr = {
        let l = std::net::TcpListener::bind(loopback()).expect("bind");
        l.local_addr().unwrap()
    }; // closed again here
    match within("connect", tcp::Connect::new(addr).connect_wrap(())).await {
        Err(Error::ConnectionRefused { addr: a }) => assert_eq!(a, addr.to_string()),
        other => panic!("connect to a closed port gave {:?}", other.map(|_| ())),
    }
}

/// Connecting to a Unix name nobody listens on: an abstract name gives `ConnectionRefused`,
/// a missing path gives `Io` with `NotFound` (the kernel's ENOENT, which `Error::from_io` does
/// not map to a variant of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_connect_to_missing_name() {
    let abs = abstract_addr("missing");
    match within(
        "connect",
        uds::StreamConnect::new(abs.clone()).connect_wrap(()),
    )
    .await
    {
        Err(Error::ConnectionRefused { addr }) => assert_eq!(addr, abs.to_string()),
        other => panic!(
            "stream connect to a missing abstract name gave {:?}",
            other.map(|_| ())
        ),
    }
    match within(
        "connect",
        uds::DatagramConnect::new(abs.clone()).connect_wrap(()),
    )
    .await
    {
        Err(Error::ConnectionRefused { addr }) => assert_eq!(addr, abs.to_string()),
        other => panic!(
            "datagram connect to a missing abstract name gave {:?}",
            other.map(|_| ())
        ),
    }
    let path = temp_path("missing");
    match within(
        "connect",
        uds::StreamConnect::new(path.clone()).connect_wrap(()),
    )
    .await
    {
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
        other => panic!(
            "stream connect to a missing path gave {:?}",
            other.map(|_| ())
        ),
    }
    match within("connect", uds::DatagramConnect::new(path).connect_wrap(())).await {
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
        other => panic!(
            "datagram connect to a missing path gave {:?}",
            other.map(|_| ())
        ),
    }
}

fn is_invalid_input(r: &Result<(), Error>) -> bool {
    matches!(r, Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::InvalidInput)
}

/// Names longer than `sun_path` allows (108 and 300 bytes; 108-byte paths too) and empty
/// names are rejected with an `Io`/`InvalidInput` error by every constructor, not a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_overlong_names_are_rejected() {
    let mut bad: Vec<uds::UnixAddr> = Vec::new();
    for len in [108, 300] {
        bad.push(uds::UnixAddr::Abstract(vec![b'a'; len]));
        bad.push(PathBuf::from(format!("/tmp/{}", "p".repeat(len - 5))).into());
    }
    bad.push(uds::UnixAddr::Abstract(Vec::new()));
    for addr in bad {
        let r = uds::DatagramListener::bind(addr.clone()).await.map(drop);
        assert!(is_invalid_input(&r), "datagram bind of {addr:?} gave {r:?}");
        let r = uds::StreamListener::bind(addr.clone()).await.map(drop);
        assert!(is_invalid_input(&r), "stream bind of {addr:?} gave {r:?}");
        let r = uds::DatagramConnect::new(addr.clone())
            .connect_wrap(())
            .await
            .map(drop);
        assert!(
            is_invalid_input(&r),
            "datagram connect to {addr:?} gave {r:?}"
        );
        let r = uds::StreamConnect::new(addr.clone())
            .connect_wrap(())
            .await
            .map(drop);
        assert!(
            is_invalid_input(&r),
            "stream connect to {addr:?} gave {r:?}"
        );
    }
}

/// The longest abstract name `UnixAddr` accepts (107 bytes) works end to end for datagrams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_dgram_107_byte_abstract_name_works() {
    let mut name = unique_name("long").into_bytes();
    name.resize(107, b'x');
    let addr = uds::UnixAddr::Abstract(name);
    let mut l = uds::DatagramListener::bind(addr.clone())
        .await
        .expect("a 107-byte abstract name passes UnixAddr::check and binds");
    // The stream datapath builds its address through std and reaches the same length fine.
    let sl_addr = {
        let mut n = unique_name("long-s").into_bytes();
        n.resize(107, b'y');
        uds::UnixAddr::Abstract(n)
    };
    let mut sl = uds::StreamListener::bind(sl_addr.clone())
        .await
        .expect("bind");
    let sc = within("connect", uds::StreamConnect::new(sl_addr).connect_wrap(()))
        .await
        .expect("stream connect to a 107-byte abstract name");
    let ss = within("accept", sl.accept()).await.expect("accept");
    send_id(&sc, 1).await;
    assert_eq!(recv_id(&ss, "stream recv").await, 1);

    let c = within("connect", uds::DatagramConnect::new(addr).connect_wrap(()))
        .await
        .expect("datagram connect to a 107-byte abstract name");
    send_id(&c, 2).await;
    let s = within("accept", l.accept()).await.expect("accept");
    assert_eq!(recv_id(&s, "datagram recv").await, 2);
}

// ---------------------------------------------------------------------------------------------
// 3. Bad input from the network.
// ---------------------------------------------------------------------------------------------

/// A raw client announcing a frame above `max_payload` (1024): that server connection reports
/// `Malformed`, every later recv fails (no resynchronisation, no hang, no panic), and another
/// client of the same listener keeps being served. A frame of exactly 1024 bytes is fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_oversize_frame_header_is_malformed_and_isolated() {
    let cfg = tcp::Config::default().with_max_payload_bytes(1024);
    let mut l = tcp::Listener::bind_with(loopback(), cfg)
        .await
        .expect("bind");
    let addr = l.local_addr().unwrap();

    let mut raw = within("raw connect", tokio::net::TcpStream::connect(addr))
        .await
        .expect("raw connect");
    let bad = within("accept", l.accept()).await.expect("accept raw");
    let good_client = within("connect", tcp::Connect::new(addr).connect_wrap(()))
        .await
        .expect("connect");
    let good = within("accept", l.accept()).await.expect("accept good");
    let echo = tokio::spawn(async move {
        while let Ok(m) = good.recv_one().await {
            if good.send_one(m).await.is_err() {
                break;
            }
        }
    });

    // Exactly the maximum is accepted.
    let max = vec![7u8; 1024];
    raw.write_all(&frame(&max)).await.expect("raw write");
    let got = within("recv max frame", bad.recv_one())
        .await
        .expect("a frame of exactly max_payload");
    assert_eq!(&got[..], &max[..]);

    // One byte over: Malformed.
    raw.write_all(&1025u32.to_be_bytes())
        .await
        .expect("raw write");
    raw.write_all(&[0u8; 64]).await.expect("raw write");
    let mut slots = vec![None; 8];
    match within("recv oversize header", bad.recv(&mut slots)).await {
        Err(Error::Malformed { .. }) => {}
        other => panic!("oversize frame header gave {other:?}, not Malformed"),
    }
    // The stream cannot be resynchronised: later recvs fail, even if valid frames follow.
    raw.write_all(&frame(b"valid")).await.expect("raw write");
    for attempt in 0..2 {
        match within("recv after malformed", bad.recv(&mut slots)).await {
            Err(_) => {}
            Ok(n) => panic!("recv #{attempt} after Malformed returned {n} messages"),
        }
    }

    // The other client is unaffected.
    for i in 0..10 {
        send_id(&good_client, i).await;
        assert_eq!(recv_id(&good_client, "echo").await, i);
    }

    // Dropping the broken connection ends the raw client's stream (EOF or reset, no hang).
    drop(bad);
    let mut buf = [0u8; 16];
    match within("raw read after drop", raw.read(&mut buf)).await {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("raw client read {n} unexpected bytes"),
    }
    echo.abort();
}

/// A complete frame followed by an oversize header in the same segment: the complete frame was
/// sent first and must be delivered before the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_valid_frame_before_malformed_header_is_delivered() {
    let cfg = tcp::Config::default().with_max_payload_bytes(1024);
    let mut l = tcp::Listener::bind_with(loopback(), cfg)
        .await
        .expect("bind");
    let addr = l.local_addr().unwrap();
    let mut raw = within("raw connect", tokio::net::TcpStream::connect(addr))
        .await
        .expect("raw connect");
    let s = within("accept", l.accept()).await.expect("accept");
    let mut wire = frame(b"hello");
    wire.extend_from_slice(&u32::MAX.to_be_bytes());
    raw.write_all(&wire).await.expect("raw write");
    tokio::time::sleep(SETTLE).await; // both parts are in the server's receive buffer
    let mut slots = vec![None; 64];
    match within("recv", s.recv(&mut slots)).await {
        Ok(1) => assert_eq!(slots[0].as_deref(), Some(&b"hello"[..])),
        other => panic!("recv gave {other:?}; the valid frame before the bad header was lost"),
    }
    match within("recv", s.recv(&mut slots)).await {
        Err(Error::Malformed { .. }) => {}
        other => panic!("second recv gave {other:?}, not Malformed"),
    }
}

/// A raw client that sends a complete frame, then part of a frame (a truncated body, or a
/// truncated header), then closes: the server gets the complete frame, then `PeerClosed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_truncated_frame_then_close_is_peer_closed() {
    let mut l = tcp::Listener::bind(loopback()).await.expect("bind");
    let addr = l.local_addr().unwrap();
    let mut body_cut = frame(&[1u8; 100]);
    body_cut.truncate(4 + 10);
    let header_cut = vec![0u8, 0];
    for tail in [body_cut, header_cut] {
        let mut raw = within("raw connect", tokio::net::TcpStream::connect(addr))
            .await
            .expect("raw connect");
        let s = within("accept", l.accept()).await.expect("accept");
        let mut wire = frame(b"whole");
        wire.extend_from_slice(&tail);
        raw.write_all(&wire).await.expect("raw write");
        raw.shutdown().await.expect("raw shutdown");
        let got = within("recv", s.recv_one()).await.expect("the whole frame");
        assert_eq!(&got[..], b"whole");
        for attempt in 0..2 {
            match within("recv of a truncated frame", s.recv_one()).await {
                Err(Error::PeerClosed) => {}
                other => panic!(
                    "recv #{attempt} after a {}-byte partial frame gave {other:?}",
                    tail.len()
                ),
            }
        }
    }
}

/// A datagram above the listener's `max_payload` (100) is dropped and counted, both from an
/// unknown peer and from an accepted one, but not silently: from an unknown peer it starts a
/// connection, and the connection reports the latest one by its first 32 bytes and length
/// (`PeerHandoff::take_oversized`); a normal datagram from the same peer right after is
/// delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_oversize_datagram_is_dropped_and_counted() {
    let cfg = udp::Config::default()
        .with_max_payload_bytes(100)
        .with_idle_timeout(None);
    let mut l = udp::Listener::bind_with(loopback(), cfg)
        .await
        .expect("bind");
    let addr = l.local_addr().unwrap();
    let raw = tokio::net::UdpSocket::bind(loopback())
        .await
        .expect("raw bind");
    raw.connect(addr).await.expect("raw connect");

    raw.send(&[1u8; 101]).await.expect("raw send");
    raw.send(&[2u8; 5000]).await.expect("raw send");
    raw.send(&[3u8; 100]).await.expect("raw send");
    let s = within("accept", l.accept()).await.expect("accept");
    let got = within("recv", s.recv_one()).await.expect("recv");
    assert_eq!(
        &got[..],
        &[3u8; 100][..],
        "the max-size datagram must arrive"
    );
    assert_eq!(l.dropped().0, 2, "two oversize datagrams dropped");
    assert_eq!(l.peer_count(), 1);
    assert_eq!(
        s.take_oversized(),
        Some(chunnel::Oversized {
            prefix: Bytes::from_static(&[2u8; 32]),
            len: 5000,
            limit: 100,
        }),
        "the latest oversize datagram, by its first bytes and whole length"
    );
    assert_eq!(s.take_oversized(), None, "taken once");

    raw.send(&[4u8; 101]).await.expect("raw send");
    raw.send(b"small").await.expect("raw send");
    let got = within("recv", s.recv_one()).await.expect("recv");
    assert_eq!(&got[..], b"small");
    assert_eq!(l.dropped(), (3, 0, 0), "one more oversize datagram dropped");
    assert_eq!(s.take_oversized().map(|o| o.len), Some(101));
}

/// The client side drops oversize datagrams too (`Connection::dropped_oversize`) and delivers
/// the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_client_drops_oversize_datagram() {
    let mut l = udp::Listener::bind(loopback()).await.expect("bind");
    let k = udp::Connect::new(l.local_addr().unwrap())
        .with_config(udp::Config::default().with_max_payload_bytes(100));
    let c = within("connect", k.clone().connect_wrap(()))
        .await
        .expect("connect");
    send_id(&c, 1).await;
    let s = within("accept", l.accept()).await.expect("accept");
    assert_eq!(recv_id(&s, "recv").await, 1);
    within("send", s.send([Bytes::from(vec![0u8; 101]), id_msg(2)]))
        .await
        .expect("send");
    assert_eq!(recv_id(&c, "client recv").await, 2);
    assert_eq!(c.dropped_oversize(), 1);
}

// ---------------------------------------------------------------------------------------------
// 4. Bounds.
// ---------------------------------------------------------------------------------------------

/// With `peer_queue(4)` and a server connection that does not read, 100 datagrams leave only
/// the 4 oldest queued; the rest are dropped and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_peer_queue_is_bounded() {
    let cfg = udp::Config::default()
        .with_peer_queue(4)
        .with_idle_timeout(None);
    let mut l = udp::Listener::bind_with(loopback(), cfg)
        .await
        .expect("bind");
    let c = within(
        "connect",
        udp::Connect::new(l.local_addr().unwrap()).connect_wrap(()),
    )
    .await
    .expect("connect");
    send_id(&c, 1000).await;
    let s = within("accept", l.accept()).await.expect("accept");
    // `s` is not reading; 1000 sits in its queue.
    for chunk in (0..100u32).collect::<Vec<_>>().chunks(10) {
        within("send", c.send(chunk.iter().map(|&i| id_msg(i))))
            .await
            .expect("send");
    }
    tokio::time::sleep(SETTLE).await;
    // Something else (here: accept) reads the socket and sorts everything into the queues.
    // No new peer exists, so it must time out; that is the expected outcome.
    assert!(
        tokio::time::timeout(QUIET, l.accept()).await.is_err(),
        "accept found a peer that does not exist"
    );
    let (_, queue_full, _) = l.dropped();
    assert!(
        queue_full > 0,
        "nothing counted as dropped for a full queue"
    );
    assert!(queue_full <= 97, "dropped {queue_full}, more than 100 - 3");

    let mut slots = vec![None; 64];
    let n = within("recv", s.recv(&mut slots)).await.expect("recv");
    let ids: Vec<u32> = slots[..n]
        .iter()
        .map(|m| msg_id(m.as_ref().unwrap()))
        .collect();
    assert_eq!(
        ids,
        [1000, 0, 1, 2],
        "the queue must hold the 4 oldest datagrams"
    );
    match tokio::time::timeout(QUIET, s.recv(&mut slots)).await {
        Err(_) => {} // expected: nothing more was kept
        Ok(r) => panic!("a queue of 4 yielded more: {r:?}"),
    }
    // Still usable afterwards.
    send_id(&c, 2000).await;
    assert_eq!(recv_id(&s, "recv after overflow").await, 2000);
}

/// With `backlog(2)`, 5 new peers before any accept: 2 are admitted, 3 are dropped and
/// counted; once the backlog has room again a dropped peer can get in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_backlog_is_bounded() {
    let cfg = udp::Config::default()
        .with_backlog(2)
        .with_idle_timeout(None);
    let mut l = udp::Listener::bind_with(loopback(), cfg)
        .await
        .expect("bind");
    let k = udp::Connect::new(l.local_addr().unwrap());
    let mut clients = Vec::new();
    for i in 0..5u32 {
        let c = within("connect", k.clone().connect_wrap(()))
            .await
            .expect("connect");
        send_id(&c, i).await;
        clients.push(c);
    }
    tokio::time::sleep(SETTLE).await;
    let a = within("accept", l.accept()).await.expect("accept 1");
    let b = within("accept", l.accept()).await.expect("accept 2");
    // A third accept must find nothing: the expected outcome is this timeout.
    if let Ok(r) = tokio::time::timeout(QUIET, l.accept()).await {
        panic!(
            "a third peer was accepted past a backlog of 2: {:?}",
            r.map(drop)
        );
    }
    assert!(
        l.dropped().2 > 0,
        "nothing counted as dropped for a full backlog"
    );
    assert_eq!(l.dropped().2, 3, "three new peers did not fit");
    assert_eq!(l.peer_count(), 2);
    assert_eq!(recv_id(&a, "recv").await, 0);
    assert_eq!(recv_id(&b, "recv").await, 1);

    // The backlog is empty again: a peer that was turned away is admitted now.
    send_id(&clients[4], 44).await;
    let e = within("accept", l.accept())
        .await
        .expect("accept after room");
    assert_eq!(recv_id(&e, "recv").await, 44);
}

// ---------------------------------------------------------------------------------------------
// 5. Batching.
// ---------------------------------------------------------------------------------------------

/// Asks the kernel for a larger receive buffer on `sock` (it clamps to `rmem_max`).
///
/// UDP has no flow control: when the receiving task is starved (a loaded machine) the kernel
/// silently drops datagrams past `SO_RCVBUF`, which is not the datapath's doing. Tests that
/// want "nothing lost" give the kernel room so that any loss left is the library's.
fn grow_rcvbuf(sock: &impl std::os::fd::AsRawFd) {
    let bytes: libc::c_int = 4 << 20;
    // SAFETY: `sock` is a live socket for the duration of the call; the option value is a
    // valid c_int of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(
        rc,
        0,
        "setsockopt(SO_RCVBUF): {}",
        std::io::Error::last_os_error()
    );
}

/// 200 messages in one `send` arrive complete and in order at a server reading concurrently.
///
/// The server socket's receive buffer is enlarged first (see [`grow_rcvbuf`]): with the
/// default 208 KiB and a starved reader the kernel drops part of the burst (seen as
/// `RcvbufErrors` in /proc/net/snmp while the whole suite runs on 2 busy cores).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_burst_of_200_arrives_complete_and_in_order() {
    let mut l = udp::Listener::bind(loopback()).await.expect("bind");
    grow_rcvbuf(l.get_ref());
    let c = within(
        "connect",
        udp::Connect::new(l.local_addr().unwrap()).connect_wrap(()),
    )
    .await
    .expect("connect");
    send_id(&c, u32::MAX).await;
    let s = within("accept", l.accept()).await.expect("accept");
    assert_eq!(recv_id(&s, "recv").await, u32::MAX);
    let reader = tokio::spawn(async move { recv_n(&s, 200).await });
    let burst: Vec<Bytes> = (0..200u32)
        .map(|i| numbered(i, 16 + i as usize * 7))
        .collect();
    within("send", c.send(burst.clone())).await.expect("send");
    let got = within("server recv", reader)
        .await
        .expect("reader task")
        .expect("recv");
    let ids: Vec<u32> = got.iter().map(|m| msg_id(&m.slice(..4))).collect();
    assert_eq!(ids, (0..200).collect::<Vec<_>>(), "lost or reordered");
    assert_eq!(got, burst, "contents changed");
    assert_eq!(l.dropped(), (0, 0, 0));
}

/// When many messages are queued, `recv` with 64 slots reads them in batches: a read asks
/// for as many as the last run between two empty reads held (one, after lone messages) and
/// doubles its ask while reads come back full. So 50 queued messages take at most 7 calls
/// (1 + 2 + 4 + 8 + 16 + 32 >= 50), on the server side and on the client side, and nothing is
/// lost or reordered. Reading them one per call (no batching) fails this.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_recv_returns_many_when_queued() {
    async fn check<C: ChunnelConnection<Data = Bytes>>(side: &str, rx: &C) {
        let mut slots = vec![None; 64];
        let mut ids = Vec::new();
        let mut calls = Vec::new();
        while ids.len() < 50 {
            let n = within("recv", rx.recv(&mut slots)).await.expect("recv");
            calls.push(n);
            ids.extend(slots[..n].iter_mut().map(|m| msg_id(&m.take().unwrap())));
        }
        assert!(
            calls.len() <= 7,
            "{side}: 50 queued messages took {} recv calls: {calls:?}",
            calls.len()
        );
        assert_eq!(
            ids,
            (0..50).collect::<Vec<_>>(),
            "{side}: lost or reordered"
        );
    }
    let mut l = udp::Listener::bind(loopback()).await.expect("bind");
    let c = within(
        "connect",
        udp::Connect::new(l.local_addr().unwrap()).connect_wrap(()),
    )
    .await
    .expect("connect");
    send_id(&c, u32::MAX).await;
    let s = within("accept", l.accept()).await.expect("accept");
    assert_eq!(recv_id(&s, "recv").await, u32::MAX);

    within("send", c.send((0..50).map(id_msg)))
        .await
        .expect("send");
    tokio::time::sleep(Duration::from_millis(50)).await;
    check("server", &s).await;

    within("send", s.send((0..50).map(id_msg)))
        .await
        .expect("send");
    tokio::time::sleep(Duration::from_millis(50)).await;
    check("client", &c).await;
}

// ---------------------------------------------------------------------------------------------
// 6. Concurrency.
// ---------------------------------------------------------------------------------------------

/// One client connection shared by 4 sending and 4 receiving tasks against an echo server:
/// every one of 4 x 500 distinct messages comes back exactly once. A credit window keeps at
/// most 128 messages in flight so that no socket buffer overflows (loss would be real loss).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_shared_client_concurrent_send_recv_exactly_once() {
    const SENDERS: u32 = 4;
    const PER: u32 = 500;
    const BURST: u32 = 10;
    const WINDOW: usize = 128;
    const TOTAL: usize = (SENDERS * PER) as usize;

    let l = udp::Listener::bind(loopback()).await.expect("bind");
    let k = udp::Connect::new(l.local_addr().unwrap());
    let echo = spawn_echo(l);
    let c = Arc::new(
        within("connect", k.clone().connect_wrap(()))
            .await
            .expect("connect"),
    );
    let credit = Arc::new(tokio::sync::Semaphore::new(WINDOW));
    let (tx, mut rx) = tokio::sync::mpsc::channel::<u32>(TOTAL + 64);

    let mut receivers = Vec::new();
    for _ in 0..4 {
        let (c, credit, tx) = (c.clone(), credit.clone(), tx.clone());
        receivers.push(tokio::spawn(async move {
            let mut slots = vec![None; 16];
            loop {
                let n = c.recv(&mut slots).await.expect("client recv");
                for m in slots[..n].iter_mut() {
                    let id = msg_id(&m.take().expect("filled slot"));
                    if tx.send(id).await.is_err() {
                        return;
                    }
                }
                credit.add_permits(n);
            }
        }));
    }
    drop(tx);
    let mut senders = Vec::new();
    for s in 0..SENDERS {
        let (c, credit) = (c.clone(), credit.clone());
        senders.push(tokio::spawn(async move {
            for b in 0..PER / BURST {
                credit
                    .acquire_many(BURST)
                    .await
                    .expect("semaphore")
                    .forget();
                let first = s * PER + b * BURST;
                c.send((first..first + BURST).map(id_msg))
                    .await
                    .expect("client send");
                tokio::task::yield_now().await;
            }
        }));
    }

    let mut seen: HashMap<u32, usize> = HashMap::new();
    let collect = async {
        while seen.len() < TOTAL {
            let id = rx.recv().await.expect("receivers ended early");
            *seen.entry(id).or_default() += 1;
        }
    };
    if tokio::time::timeout(WAIT, collect).await.is_err() {
        panic!(
            "only {} of {TOTAL} distinct messages came back (loss)",
            seen.len()
        );
    }
    for s in senders {
        within("sender", s).await.expect("sender task");
    }
    // Anything arriving now would be a duplicate.
    tokio::time::sleep(QUIET).await;
    while let Ok(id) = rx.try_recv() {
        *seen.entry(id).or_default() += 1;
    }
    let dups: Vec<_> = seen.iter().filter(|&(_, &n)| n != 1).collect();
    assert!(dups.is_empty(), "messages seen more than once: {dups:?}");
    let expected: Vec<u32> = (0..SENDERS * PER).collect();
    let mut got: Vec<u32> = seen.into_keys().collect();
    got.sort_unstable();
    assert_eq!(got, expected, "unexpected ids came back");
    for r in receivers {
        r.abort();
    }
    echo.abort();
}

#[tokio::test]
async fn peer_addr_is_public_on_concrete_types() {
    let l = udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    let c = chunnel::Chunnel::connect_wrap(&mut udp::Connect::new(addr), ())
        .await
        .unwrap();
    assert_eq!(*c.peer_addr(), addr);
}

/// One-message sends (their own fast path) that find the peer's queue full wait instead of
/// failing or dropping, and resume in order once the peer reads: a Unix datagram socket
/// blocks its sender when the receiver's queue is full (UDP would drop instead).
#[tokio::test]
async fn single_message_sends_wait_for_a_full_unix_queue_and_keep_order() {
    let path = temp_path("single-full");
    let raw = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
    raw.set_read_timeout(Some(WAIT)).unwrap();
    let conn = uds::DatagramConnect::new(path.clone())
        .connect_wrap(())
        .await
        .unwrap();
    const N: u32 = 2000;
    let sender = tokio::spawn(async move {
        for i in 0..N {
            conn.send([id_msg(i)]).await.unwrap();
        }
        conn
    });
    // The queue (max_dgram_qlen, 512 by default) fills long before N: the sender waits.
    tokio::time::sleep(QUIET).await;
    assert!(!sender.is_finished(), "{N} sends never waited for the peer");
    let reader = tokio::task::spawn_blocking(move || {
        let mut buf = [0u8; 16];
        for i in 0..N {
            let n = raw.recv(&mut buf).unwrap();
            assert_eq!(&buf[..n], &i.to_be_bytes(), "message {i} out of order");
        }
    });
    within("the reader", reader).await.unwrap();
    within("the sender", sender).await.unwrap();
    let _ = std::fs::remove_file(&path);
}

/// A UDP client whose peer's port is closed learns it from the ICMP error (seen as
/// `EPOLLERR`, not readability): a waiting `recv` ends with an error instead of hanging.
#[tokio::test]
async fn udp_recv_ends_when_the_peer_port_is_closed() {
    let addr = {
        let s = std::net::UdpSocket::bind(loopback()).unwrap();
        s.local_addr().unwrap()
    }; // closed again here
    let conn = udp::Connect::new(addr).connect_wrap(()).await.unwrap();
    let mut slots = [None];
    let waiting = conn.recv(&mut slots);
    tokio::pin!(waiting);
    // The receive is already waiting when the error arrives.
    assert!(
        tokio::time::timeout(QUIET, waiting.as_mut()).await.is_err(),
        "recv returned before anything was sent"
    );
    conn.send([id_msg(1)]).await.unwrap();
    match within("recv after ICMP port unreachable", waiting).await {
        Err(e) => assert!(
            e.is_closed() || matches!(e, Error::ConnectionRefused { .. }),
            "unexpected error {e:?}"
        ),
        Ok(n) => panic!("received {n} messages from a closed port"),
    }
}

/// A connection that keeps calling `recv` reads its own datagrams from the shared socket
/// (straight into its slots), even though `accept` waits on the same socket for new peers:
/// only the first datagram, which made the connection, goes through a queue. If `accept`
/// kept the reader role instead, every datagram would go through the connection's queue and
/// wake two tasks.
#[tokio::test(flavor = "current_thread")]
async fn a_connection_reads_its_own_datagrams_while_accept_waits() {
    let mut l = udp::Listener::bind(loopback()).await.unwrap();
    let addr = l.local_addr().unwrap();
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let mut echoes = Vec::new();
        loop {
            tokio::select! {
                c = l.accept() => {
                    let c = c.unwrap();
                    echoes.push(tokio::spawn(async move {
                        while let Ok(m) = c.recv_one().await {
                            if c.send_one(m).await.is_err() {
                                break;
                            }
                        }
                    }));
                }
                _ = &mut stop_rx => break,
            }
        }
        (l, echoes)
    });
    let c = udp::Connect::new(addr).connect_wrap(()).await.unwrap();
    const N: u32 = 200;
    for i in 0..N {
        c.send_one(id_msg(i)).await.unwrap();
        let m = within("echo", c.recv_one()).await.unwrap();
        assert_eq!(m, id_msg(i));
    }
    stop_tx.send(()).unwrap();
    let (l, _echoes) = within("server stop", server).await.unwrap();
    let (direct, queued) = l.delivery();
    assert_eq!(direct + queued, u64::from(N), "every request read once");
    assert!(
        queued <= 5,
        "{queued} of {N} datagrams went through the connection's queue (direct: {direct})"
    );
}

/// Counts the polls of the future it wraps.
struct CountPolls<F> {
    inner: std::pin::Pin<Box<F>>,
    polls: Arc<AtomicU64>,
}

impl<F: Future> Future for CountPolls<F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        self.polls.fetch_add(1, Ordering::Relaxed);
        self.inner.as_mut().poll(cx)
    }
}

/// With many idle connections waiting on one listener, a message for a busy connection costs
/// the idle ones at most one wake-up: the idle connection that waits on the socket and reads
/// the message for the busy one keeps the reader role instead of handing it to another idle
/// connection (a second wake-up) and taking it back. Handing the reader role over on every
/// wake-up polls idle connections about twice per message.
#[tokio::test(flavor = "current_thread")]
async fn idle_connections_are_not_woken_twice_per_message() {
    const IDLE: u32 = 20;
    const N: u32 = 200;
    let cfg = udp::Config::default().with_idle_timeout(None);
    let mut l = udp::Listener::bind_with(loopback(), cfg).await.unwrap();
    let k = udp::Connect::new(l.local_addr().unwrap());
    let mut clients = Vec::new();
    for i in 0..=IDLE {
        let c = within("connect", k.clone().connect_wrap(())).await.unwrap();
        send_id(&c, i).await;
        clients.push(c);
    }
    let polls = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    let mut busy = None;
    for _ in 0..=IDLE {
        let s = within("accept", l.accept()).await.unwrap();
        let first = within("first", s.recv_one()).await.unwrap();
        if first == id_msg(0) {
            busy = Some(s);
            continue;
        }
        let polls = Arc::clone(&polls);
        tasks.push(tokio::spawn(async move {
            let wait = CountPolls {
                inner: Box::pin(async move { s.recv_one().await }),
                polls,
            };
            let _ = wait.await;
        }));
    }
    let busy = busy.expect("the busy peer was accepted");
    let echo = tokio::spawn(async move {
        while let Ok(m) = busy.recv_one().await {
            if busy.send_one(m).await.is_err() {
                break;
            }
        }
    });
    // Let every idle connection start waiting.
    tokio::time::sleep(SETTLE).await;
    let before = polls.load(Ordering::Relaxed);
    let c = &clients[0];
    for i in 0..N {
        c.send_one(id_msg(i)).await.unwrap();
        assert_eq!(within("echo", c.recv_one()).await.unwrap(), id_msg(i));
    }
    let idle_polls = polls.load(Ordering::Relaxed) - before;
    assert!(
        idle_polls <= u64::from(N) * 3 / 2,
        "{idle_polls} polls of idle connections for {N} messages to a busy one"
    );
    echo.abort();
    for t in tasks {
        t.abort();
    }
    drop(l);
}

/// Accepts in a loop (having told the listener so) and parks every accepted connection in a
/// task that waits to receive, counting the polls of those waits. Returns the listener task's
/// handle (it gives the listener back when `stop` fires), the poll counter and how many
/// connections were accepted.
type LoopingServer = tokio::task::JoinHandle<(udp::Listener, Vec<tokio::task::JoinHandle<()>>)>;

fn looping_server(
    mut l: udp::Listener,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> (LoopingServer, Arc<AtomicU64>, Arc<AtomicU64>) {
    let polls = Arc::new(AtomicU64::new(0));
    let accepted = Arc::new(AtomicU64::new(0));
    let (p, a) = (Arc::clone(&polls), Arc::clone(&accepted));
    let task = tokio::spawn(async move {
        l.accepting_in_loop();
        let mut waits = Vec::new();
        loop {
            tokio::select! {
                c = l.accept() => {
                    let c = c.unwrap();
                    a.fetch_add(1, Ordering::Relaxed);
                    let polls = Arc::clone(&p);
                    waits.push(tokio::spawn(async move {
                        let wait = CountPolls {
                            inner: Box::pin(async move {
                                // The first message, then wait for one that never comes.
                                let _ = c.recv_one().await;
                                let _ = c.recv_one().await;
                            }),
                            polls,
                        };
                        wait.await;
                    }));
                }
                _ = &mut stop => break,
            }
        }
        (l, waits)
    });
    (task, polls, accepted)
}

/// New peers, each sending one datagram (short-lived clients), wake a listener whose
/// `accept` loops, not the connections waiting to receive: those are polled about once each
/// (their first message and the start of their wait). When a waiting connection read the
/// socket for everyone, each new peer's datagram woke it too (about twice as many polls).
#[tokio::test(flavor = "current_thread")]
async fn new_peers_wake_a_looping_accept_not_waiting_connections() {
    const N: u64 = 200;
    let cfg = udp::Config::default().with_idle_timeout(None);
    let l = udp::Listener::bind_with(loopback(), cfg).await.unwrap();
    let k = udp::Connect::new(l.local_addr().unwrap());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let (server, polls, accepted) = looping_server(l, stop_rx);
    let mut clients = Vec::new();
    for i in 0..N {
        let c = within("connect", k.clone().connect_wrap(())).await.unwrap();
        send_id(&c, i as u32).await;
        clients.push(c);
        // Let the server take this peer in before the next one comes.
        for _ in 0..20 {
            tokio::task::yield_now().await;
            if accepted.load(Ordering::Relaxed) > i && polls.load(Ordering::Relaxed) > i {
                break;
            }
        }
    }
    within("all accepted", async {
        while accepted.load(Ordering::Relaxed) < N {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    tokio::time::sleep(SETTLE).await;
    let p = polls.load(Ordering::Relaxed);
    assert!(
        p <= N * 3 / 2,
        "{p} polls of {N} waiting connections for {N} new peers"
    );
    stop_tx.send(()).unwrap();
    let (l, waits) = within("server stop", server).await.unwrap();
    drop(l);
    for w in waits {
        w.abort();
    }
}

/// A looping listener keeps the reader role between `accept` calls (it waits on the
/// socket before each new peer comes); dropped, it gives the reader role up, so connections still
/// waiting keep receiving (one of them reads for all), also after a datagram from an unknown
/// peer (which a connection reading while new peers came in handed the reader role to the
/// dropped `accept` for).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_keep_receiving_after_a_looping_listener_is_dropped() {
    const N: u32 = 4;
    let cfg = udp::Config::default().with_idle_timeout(None);
    let mut l = udp::Listener::bind_with(loopback(), cfg).await.unwrap();
    let k = udp::Connect::new(l.local_addr().unwrap());
    let (conn_tx, mut conn_rx) = tokio::sync::mpsc::channel(8);
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        l.accepting_in_loop();
        loop {
            tokio::select! {
                c = l.accept() => conn_tx.send(c.unwrap()).await.unwrap(),
                _ = &mut stop_rx => break,
            }
        }
        drop(l);
    });
    let mut clients = Vec::new();
    let mut waits = Vec::new();
    for i in 0..N {
        // The accept loop is waiting on the socket when this peer's datagram comes.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let c = within("connect", k.clone().connect_wrap(())).await.unwrap();
        send_id(&c, i).await;
        let s = within("accept", conn_rx.recv()).await.unwrap();
        assert_eq!(recv_id(&s, "first").await, i);
        waits.push(tokio::spawn(async move { s.recv_one().await }));
        clients.push(c);
    }
    tokio::time::sleep(SETTLE).await;
    stop_tx.send(()).unwrap();
    within("server stop", server).await.unwrap();
    // First a datagram from a peer the closed listener does not know (dropped): it must not
    // leave the reader role with an `accept` that is gone.
    let stranger = within("connect", k.clone().connect_wrap(())).await.unwrap();
    send_id(&stranger, 99).await;
    tokio::time::sleep(SETTLE).await;
    for (i, c) in clients.iter().enumerate() {
        send_id(c, 100 + i as u32).await;
    }
    for (i, w) in waits.into_iter().enumerate() {
        let m = within("receive after the listener is gone", w)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(msg_id(&m), 100 + i as u32);
    }
}

/// Connections waiting to receive while nobody calls `accept` read for each other: every
/// message reaches its connection, round after round, whichever of them holds the reader
/// role when it comes (one that finds its message queued passes the wake-up of a vacant
/// reader role on to the next waiting connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_connections_all_receive_while_nobody_accepts() {
    const N: u32 = 8;
    let cfg = udp::Config::default().with_idle_timeout(None);
    let mut l = udp::Listener::bind_with(loopback(), cfg).await.unwrap();
    let k = udp::Connect::new(l.local_addr().unwrap());
    let mut clients = Vec::new();
    let mut servers = Vec::new();
    for i in 0..N {
        let c = within("connect", k.clone().connect_wrap(())).await.unwrap();
        send_id(&c, i).await;
        let s = within("accept", l.accept()).await.unwrap();
        assert_eq!(recv_id(&s, "first").await, i);
        clients.push(c);
        servers.push(Arc::new(s));
    }
    // From here on, `accept` is never polled again.
    for round in 1..=5u32 {
        let waits: Vec<_> = servers
            .iter()
            .map(|s| {
                let s = Arc::clone(s);
                tokio::spawn(async move { s.recv_one().await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(20)).await;
        // All at once, so some are queued by whichever connection reads.
        for (i, c) in clients.iter().enumerate() {
            send_id(c, round * 100 + i as u32).await;
        }
        for (i, w) in waits.into_iter().enumerate() {
            let m = within("every waiting connection receives", w)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(msg_id(&m), round * 100 + i as u32);
        }
    }
    drop(l);
}

/// The reader role changes hands all the time on a looping listener with both kinds of
/// traffic (a connection takes it while its peer keeps talking; new peers hand it back to
/// `accept`), on two worker threads: every request still gets its echo. Each hand-over
/// re-registers the socket's one receive waker; a reader whose registration was lost would
/// leave an echo unanswered (a hang, caught by the bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_looping_listener_answers_mixed_new_and_returning_peers() {
    let cfg = udp::Config::default().with_idle_timeout(None);
    let mut l = udp::Listener::bind_with(loopback(), cfg).await.unwrap();
    let k = udp::Connect::new(l.local_addr().unwrap());
    let server = tokio::spawn(async move {
        l.accepting_in_loop();
        while let Ok(c) = l.accept().await {
            tokio::spawn(async move {
                while let Ok(m) = c.recv_one().await {
                    if c.send_one(m).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    let steady: Vec<_> = {
        let mut v = Vec::new();
        for _ in 0..4 {
            v.push(within("connect", k.clone().connect_wrap(())).await.unwrap());
        }
        v
    };
    let mut clients = Vec::new();
    for round in 0..300u32 {
        // A new peer, then every steady peer, some of them concurrently.
        let fresh = within("connect", k.clone().connect_wrap(())).await.unwrap();
        send_id(&fresh, round).await;
        assert_eq!(recv_id(&fresh, "new peer's echo").await, round);
        clients.push(fresh);
        let mut echoes = Vec::new();
        for (i, c) in steady.iter().enumerate() {
            let id = round * 10 + i as u32;
            send_id(c, id).await;
            echoes.push((c, id));
        }
        for (c, id) in echoes {
            assert_eq!(recv_id(c, "steady peer's echo").await, id);
        }
    }
    server.abort();
}

/// `try_send_with_header` sends one datagram (header, then message) at once, on both ends,
/// and says why not otherwise: too large for the datapath, or a closed connection.
#[tokio::test(flavor = "current_thread")]
async fn try_send_with_header_sends_at_once_or_says_why() {
    use chunnel::SendHeader;
    let cfg = udp::Config::default().with_max_payload_bytes(100);
    let mut l = udp::Listener::bind_with(loopback(), cfg.clone())
        .await
        .unwrap();
    let c = udp::Connect::new(l.local_addr().unwrap())
        .with_config(cfg)
        .connect_wrap(())
        .await
        .unwrap();
    let m = Bytes::from_static(b"body");
    assert!(matches!(c.try_send_with_header(b"h:", &m), Some(Ok(()))));
    let s = within("accept", l.accept()).await.unwrap();
    assert_eq!(within("recv", s.recv_one()).await.unwrap(), "h:body");
    assert!(matches!(s.try_send_with_header(b"s:", &m), Some(Ok(()))));
    assert_eq!(within("recv", c.recv_one()).await.unwrap(), "s:body");
    let big = Bytes::from(vec![0u8; 99]);
    assert!(matches!(
        c.try_send_with_header(b"h:", &big),
        Some(Err(Error::MessageTooLarge { len: 99, max: 98 }))
    ));
    s.close();
    assert!(matches!(
        s.try_send_with_header(b"", &m),
        Some(Err(Error::Closed))
    ));
}

/// A fresh connection's first datagram leaves in the first poll of its send: the runtime has
/// not yet reported the new socket writable (that takes an event-loop turn), and asking it
/// first made every new connection's first message wait for that turn.
#[tokio::test(flavor = "current_thread")]
async fn first_send_on_a_fresh_socket_needs_no_event_loop_turn() {
    let peer = std::net::UdpSocket::bind(loopback()).expect("bind peer");
    peer.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let addr = peer.local_addr().expect("peer address");
    for _ in 0..3 {
        let c = udp::Connect::new(addr)
            .connect_wrap(())
            .await
            .expect("connect");
        let mut send = std::pin::pin!(c.send_one(Bytes::from_static(b"first")));
        let polled =
            std::future::poll_fn(|cx| std::task::Poll::Ready(send.as_mut().poll(cx))).await;
        assert!(
            matches!(polled, std::task::Poll::Ready(Ok(()))),
            "the first send did not complete in its first poll: {polled:?}"
        );
        let mut buf = [0u8; 16];
        let (n, _) = peer.recv_from(&mut buf).expect("the datagram arrives");
        assert_eq!(&buf[..n], b"first");
    }
}

// ---------------------------------------------------------------------------------------
// A UDP client bound to a chosen local address.

#[tokio::test]
async fn udp_client_bound_to_a_chosen_port_sends_from_it() {
    let mut l = udp::Listener::bind(loopback()).await.unwrap();
    let server = l.local_addr().unwrap();
    // A port that was free a moment ago (the kernel's choice, released).
    let local = std::net::UdpSocket::bind(loopback())
        .unwrap()
        .local_addr()
        .unwrap();
    let c = udp::Connect::new(server)
        .with_local_addr(local)
        .connect_wrap(())
        .await
        .unwrap();
    assert_eq!(c.get_ref().local_addr().unwrap(), local);
    c.send_one(id_msg(7)).await.unwrap();
    let s = within("accept", l.accept()).await.unwrap();
    assert_eq!(
        *s.peer_addr(),
        local,
        "the server sees the chosen source port"
    );
    assert_eq!(recv_id(&s, "bound client").await, 7);
    // And the connection works both ways.
    send_id(&s, 8).await;
    assert_eq!(recv_id(&c, "bound client's answer").await, 8);
}

#[tokio::test]
async fn udp_client_bind_errors_are_typed() {
    let server = udp::Listener::bind(loopback()).await.unwrap();
    let addr = server.local_addr().unwrap();
    // A port another socket holds.
    let holder = std::net::UdpSocket::bind(loopback()).unwrap();
    let taken = holder.local_addr().unwrap();
    let r = udp::Connect::new(addr)
        .with_local_addr(taken)
        .connect_wrap(())
        .await;
    assert!(
        matches!(&r, Err(Error::AddrInUse { addr }) if *addr == taken.to_string()),
        "{r:?}"
    );
    // An IPv6 local address for an IPv4 server.
    let v6: SocketAddr = "[::1]:0".parse().unwrap();
    let r = udp::Connect::new(addr)
        .with_local_addr(v6)
        .connect_wrap(())
        .await;
    assert!(
        matches!(&r, Err(Error::AddrFamily { local, remote })
            if *local == v6.to_string() && *remote == addr.to_string()),
        "{r:?}"
    );
}
