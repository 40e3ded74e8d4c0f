//! A flood of new source addresses against a UDP listener with a small peer cap
//! (`Config::max_peers`, issue 20 item 4), over real loopback sockets: the peer table never
//! grows past the cap, and the eviction/drop counters account for the sources left out.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use chunnel::{Chunnel, ConnectionExt, Listener as _};
use chunnel_net::udp;
use chunnel_test::flood::{PER_SOURCE, from_distinct_sources};
use tokio::net::UdpSocket;

const CAP: usize = 256;

/// Samples the listener's peer count every millisecond until `stop`; returns the peak.
fn sample_peak(counter: udp::PeerCounter, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut peak = 0;
        while !stop.load(Ordering::Relaxed) {
            peak = peak.max(counter.count());
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        peak.max(counter.count())
    })
}

/// A server that accepts every new peer and keeps its connection (as a server waiting for a
/// first valid request does): accepted peers fill the table, are never evicted by the
/// strangers behind them, and the rest are dropped and counted. (Before `max_peers`, every
/// source got a peer: ~2,500 here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_new_sources_never_grows_past_the_peer_cap_with_an_accepting_server() {
    let cfg = udp::Config::default().with_max_peers(CAP);
    let mut l = udp::Listener::bind_with("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let peak = sample_peak(l.peer_counter(), stop.clone());
    let accepted = Arc::new(AtomicUsize::new(0));
    let acc = accepted.clone();
    let (done, mut flood_over) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            tokio::select! {
                c = l.accept() => {
                    acc.fetch_add(1, Ordering::Relaxed);
                    held.push(c.unwrap());
                }
                _ = &mut flood_over => break,
            }
        }
        (l, held)
    });
    let t0 = Instant::now();
    let sources = from_distinct_sources(addr).await;
    let elapsed = t0.elapsed();
    // Whatever loopback still holds is read before the counters are looked at.
    tokio::time::sleep(Duration::from_millis(200)).await;
    done.send(()).unwrap();
    let (l, held) = server.await.unwrap();
    stop.store(true, Ordering::Relaxed);
    let peak = peak.await.unwrap();
    let (evicted, dropped_cap) = l.peer_cap_stats();
    let (direct, queued) = l.delivery();
    let (_, dropped_queue, dropped_backlog) = l.dropped();
    let seen = direct + queued + dropped_queue + dropped_backlog + dropped_cap;
    eprintln!(
        "sources {sources}, datagrams {}, seen {seen}, peak peers {peak}, accepted {}, \
         evicted {evicted}, dropped at cap {dropped_cap}, backlog drops {dropped_backlog}, \
         {:?}",
        sources * PER_SOURCE,
        held.len(),
        elapsed
    );
    assert!(peak <= CAP, "peak peers {peak} > cap {CAP}");
    assert!(l.peer_count() <= CAP);
    assert!(held.len() <= CAP);
    assert_eq!(held.len(), accepted.load(Ordering::Relaxed));
    // Every source left out was evicted or had its datagrams dropped at the cap (each such
    // source sent PER_SOURCE; some may have been lost on loopback, none admitted).
    let left_out = (sources - held.len()) as u64;
    assert!(
        evicted + dropped_cap >= left_out,
        "{left_out} sources left out, {evicted} evicted + {dropped_cap} dropped"
    );
    // Accepted connections still work after the flood.
    let c = &held[0];
    c.send_one(bytes::Bytes::from_static(b"still here"))
        .await
        .unwrap();
}

/// Starts a listener with one accepted connection that keeps receiving (it reads the socket
/// for everyone, sorting new peers into the backlog) while `accept` is not called.
async fn listener_with_a_reader(cfg: udp::Config) -> (udp::Listener, SocketAddr) {
    let mut l = udp::Listener::bind_with("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    let keeper = udp::Connect::new(addr).connect_wrap(()).await.unwrap();
    keeper
        .send_one(bytes::Bytes::from_static(b"k"))
        .await
        .unwrap();
    let conn = l.accept().await.unwrap();
    tokio::spawn(async move {
        let _keeper = keeper;
        while conn.recv_one().await.is_ok() {}
    });
    (l, addr)
}

/// A server that does not accept during the flood (a slow acceptor with a long backlog): at
/// the cap, new sources evict the oldest peers nobody accepted; the table never exceeds the
/// cap. (Before `max_peers`, every source got a peer: ~2,500 here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_cap_new_sources_evict_the_oldest_unaccepted_peers() {
    let cfg = udp::Config::default()
        .with_max_peers(CAP)
        .with_backlog(1 << 16);
    let (mut l, addr) = listener_with_a_reader(cfg).await;
    let stop = Arc::new(AtomicBool::new(false));
    let peak = sample_peak(l.peer_counter(), stop.clone());
    let sources = from_distinct_sources(addr).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Ordering::Relaxed);
    let peak = peak.await.unwrap();
    let (evicted, dropped_cap) = l.peer_cap_stats();
    eprintln!(
        "sources {sources}, peak peers {peak}, now {}, evicted {evicted}, dropped at cap \
         {dropped_cap}",
        l.peer_count()
    );
    assert!(peak <= CAP, "peak peers {peak} > cap {CAP}");
    // Only new peers were evicted (the keeper is accepted): all but the cap's worth.
    assert!(
        evicted as usize + CAP >= sources - 1 - (sources / 20),
        "evicted {evicted}"
    );
    // A new client after the flood still gets in: the oldest waiting peers make room.
    let late = udp::Connect::new(addr).connect_wrap(()).await.unwrap();
    let late_addr = late.get_ref().local_addr().unwrap();
    late.send_one(bytes::Bytes::from_static(b"late"))
        .await
        .unwrap();
    let mut found = false;
    while let Ok(Ok(c)) = tokio::time::timeout(Duration::from_secs(2), l.accept()).await {
        if *c.peer_addr() == late_addr {
            found = true;
            break;
        }
    }
    assert!(found, "the late client was never accepted");
}

/// Under pressure (more than half the cap in use), new peers silent for longer than
/// `SILENT_GRACE` go first: one new source after the grace evicts all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_peers_past_the_grace_are_evicted_under_pressure() {
    let cfg = udp::Config::default()
        .with_max_peers(CAP)
        .with_backlog(1 << 16);
    let (l, addr) = listener_with_a_reader(cfg).await;
    let ip = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    let mut pool = Vec::new();
    for _ in 0..(CAP * 3 / 4) {
        let s = UdpSocket::bind(SocketAddr::new(ip, 0)).await.unwrap();
        s.send_to(b"x", addr).await.unwrap();
        pool.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(l.peer_count(), 1 + CAP * 3 / 4);
    tokio::time::sleep(chunnel_net::datagram::SILENT_GRACE).await;
    let s = UdpSocket::bind(SocketAddr::new(ip, 0)).await.unwrap();
    s.send_to(b"x", addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(l.peer_count(), 2, "the keeper and the newest peer");
    assert_eq!(l.peer_cap_stats(), ((CAP * 3 / 4) as u64, 0));
}

/// At the cap with nobody waiting for `accept`, a new source evicts the accepted connection
/// marked silent longest ago (`PeerHandoff::mark_silent`), whose `recv` then reports
/// `PeerClosed`; connections not marked (or unmarked again) stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_cap_a_new_source_evicts_the_longest_silent_accepted_connection() {
    use chunnel::PeerHandoff;
    let cfg = udp::Config::default().with_max_peers(4);
    let mut l = udp::Listener::bind_with("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    let mut socks = Vec::new();
    let mut conns = Vec::new();
    for _ in 0..4 {
        let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        s.send_to(b"x", addr).await.unwrap();
        socks.push(s);
        let c = l.accept().await.unwrap();
        assert_eq!(c.recv_one().await.unwrap(), "x");
        conns.push(c);
    }
    conns[2].mark_silent(true);
    conns[1].mark_silent(true);
    conns[3].mark_silent(true);
    conns[3].mark_silent(false);
    let late = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    late.send_to(b"late", addr).await.unwrap();
    let c = tokio::time::timeout(Duration::from_secs(5), l.accept())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(*c.peer_addr(), late.local_addr().unwrap());
    assert_eq!(l.peer_count(), 4);
    assert_eq!(l.peer_cap_stats(), (1, 0));
    assert!(matches!(
        conns[2].recv_one().await,
        Err(chunnel::Error::PeerClosed)
    ));
    // Full again, and the only silent connection left is conns[1].
    let later = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    later.send_to(b"later", addr).await.unwrap();
    let c2 = tokio::time::timeout(Duration::from_secs(5), l.accept())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(*c2.peer_addr(), later.local_addr().unwrap());
    assert!(matches!(
        conns[1].recv_one().await,
        Err(chunnel::Error::PeerClosed)
    ));
    // Nobody silent is left: the next new source is dropped at the cap.
    let last = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    last.send_to(b"last", addr).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), l.accept())
            .await
            .is_err()
    );
    assert_eq!(l.peer_cap_stats(), (2, 1));
    assert_eq!(l.peer_count(), 4);
}

/// What a listener holds for peers that send and are not read is capped in bytes: per peer
/// (`peer_queue_bytes`) and for all peers together (`queued_bytes`). Datagrams over either
/// cap are dropped and counted as a full queue; a connection that reads later gets what was
/// kept, in order; the count goes back to zero as queues are read or their peers leave.
#[tokio::test]
async fn queued_bytes_are_capped_per_peer_and_for_the_listener() {
    const SIZE: usize = 1000;
    let cfg = udp::Config::default()
        .with_peer_queue_bytes(10 * SIZE)
        .with_queued_bytes(50 * SIZE);
    let mut l = udp::Listener::bind_with("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    // `accept` reads the socket and sorts datagrams into queues; with no new peer it runs
    // until the timeout.
    async fn pump(l: &mut udp::Listener) {
        let _ = tokio::time::timeout(Duration::from_millis(300), l.accept()).await;
    }

    // One peer sends 60 datagrams; its connection is accepted and not read.
    let one = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    one.send_to(&[0u8; SIZE], addr).await.unwrap();
    let conn = l.accept().await.unwrap();
    let first = conn.recv_one().await.unwrap();
    assert_eq!(first[0], 0);
    for i in 1..60u8 {
        one.send_to(&[i; SIZE], addr).await.unwrap();
    }
    pump(&mut l).await;
    assert_eq!(l.queued_bytes(), 10 * SIZE, "per-peer cap");
    assert_eq!(l.dropped().1, 49, "the rest dropped as a full queue");
    for i in 1..=10u8 {
        let m = conn.recv_one().await.unwrap();
        assert_eq!((m.len(), m[0]), (SIZE, i), "kept in order");
    }
    assert_eq!(l.queued_bytes(), 0);

    // Eight new peers, 10 datagrams each (each within its own cap): 80 KB offered, the
    // listener keeps 50 KB in all.
    let mut peers = Vec::new();
    for _ in 0..8 {
        let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        for i in 0..10u8 {
            s.send_to(&[i; SIZE], addr).await.unwrap();
        }
        peers.push(s);
    }
    let mut accepted = Vec::new();
    while let Ok(Ok(c)) = tokio::time::timeout(Duration::from_millis(300), l.accept()).await {
        accepted.push(c);
    }
    assert_eq!(l.queued_bytes(), 50 * SIZE, "listener-wide cap");
    assert_eq!(l.dropped().1, 49 + 30, "80 offered, 50 kept");
    // Dropping the connections frees what their queues held.
    drop(accepted);
    assert_eq!(l.queued_bytes(), 0);
}

/// A UDP listener's socket asks for a large receive buffer (`udp::LISTENER_RECV_BUFFER`,
/// capped by the kernel at `net.core.rmem_max`), so a burst of new peers waits in the kernel
/// rather than being dropped there; `set_recv_buffer` changes it.
#[tokio::test]
async fn a_listener_asks_for_a_large_receive_buffer() {
    let l = udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let max: usize = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let want = udp::LISTENER_RECV_BUFFER.min(max);
    // The kernel reports twice what it granted (its bookkeeping).
    let granted = l.set_recv_buffer(udp::LISTENER_RECV_BUFFER).unwrap();
    assert!(granted >= want, "granted {granted} < {want}");
    assert!(l.set_recv_buffer(64 << 10).unwrap() < granted);
}
