//! Live switches of the stateful Chunnels: `Reliable` and `Ordered` hand their state to the
//! implementation that replaces them, so a reconfigurable select between two of them can be
//! switched under traffic, at both ends, over a lossy link, without losing, duplicating or
//! reordering a message.
//!
//! Each test runs 4 tasks sending on one client connection while both ends switch their select
//! back and forth every few milliseconds (each end on its own: the branches are wire
//! compatible), with 5% of datagrams dropped and 5% reordered in both directions of the client.
//! The receiver checks every sender's messages arrive exactly once, in order.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use chunnel::{
    Chunnel, ChunnelConnection, ChunnelExt, Listener, Lock, LockFree, ReconfigHandle, Shared, Side,
    select, stack,
};
use chunnel_net::udp;
use chunnel_std::ordered::{self, Ordered};
use chunnel_std::reliable::{self, Reliable};
use chunnel_test::fault::{FaultInjector, Faults};

const SENDERS: u64 = 4;

fn msg(sender: u64, i: u64) -> Bytes {
    let mut b = BytesMut::with_capacity(16);
    b.put_u64(sender);
    b.put_u64(i);
    b.freeze()
}

fn lossy(seed: u64) -> FaultInjector {
    let f = Faults::none().with_drop(0.05).with_reorder(0.05, 3);
    FaultInjector::seeded(seed)
        .with_send(f)
        .with_recv(f)
        .without_log()
}

/// Switches `handle` to the other side every `every` until `stop`; returns the switch count.
fn spawn_switcher(
    handle: ReconfigHandle,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut side = Side::Left;
        let mut switches = 0;
        while !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(every).await;
            side = match side {
                Side::Left => Side::Right,
                Side::Right => Side::Left,
            };
            match tokio::time::timeout(Duration::from_secs(10), handle.reconfigure(side)).await {
                Ok(Ok(n)) => switches += n as u64,
                Ok(Err(e)) => panic!("switch failed: {e}"),
                Err(_) => panic!("a switch took over 10 s"),
            }
        }
        switches
    })
}

fn spawn_senders<C>(conn: Arc<C>, per_sender: u64) -> Vec<tokio::task::JoinHandle<()>>
where
    C: ChunnelConnection<Data = Bytes> + 'static,
{
    (0..SENDERS)
        .map(|s| {
            let conn = conn.clone();
            tokio::spawn(async move {
                for i in (0..per_sender).step_by(8) {
                    let end = (i + 8).min(per_sender);
                    conn.send((i..end).map(|j| msg(s, j))).await.expect("send");
                }
            })
        })
        .collect()
}

/// Receives until every sender's `per_sender` messages arrived; panics on a loss, a
/// duplicate or a reordering (or if nothing arrives for 20 s).
async fn receive_all<C: ChunnelConnection<Data = Bytes>>(conn: &C, per_sender: u64) {
    let mut next = vec![0u64; SENDERS as usize];
    let total = per_sender * SENDERS;
    let mut got = 0;
    let mut slots = vec![None; 32];
    while got < total {
        let k = match tokio::time::timeout(Duration::from_secs(20), conn.recv(&mut slots)).await {
            Ok(Ok(k)) => k,
            Ok(Err(e)) => panic!("recv failed after {got} messages: {e}"),
            Err(_) => panic!("nothing for 20 s after {got} of {total}; next per sender {next:?}"),
        };
        for s in &mut slots[..k] {
            let m = s.take().expect("filled slot");
            let sender = u64::from_be_bytes(m[..8].try_into().unwrap()) as usize;
            let i = u64::from_be_bytes(m[8..16].try_into().unwrap());
            assert_eq!(
                i, next[sender],
                "sender {sender}: got message {i}, expected {} (after {got} messages)",
                next[sender]
            );
            next[sender] += 1;
            got += 1;
        }
    }
    // Nothing more may come (a duplicate).
    if let Ok(Ok(k)) = tokio::time::timeout(Duration::from_millis(200), conn.recv(&mut slots)).await
    {
        panic!("{k} message(s) after all {total} arrived");
    }
}

fn per_sender() -> u64 {
    if cfg!(debug_assertions) {
        5_000
    } else {
        25_000
    }
}

/// Sends from 4 tasks on `conn` while both ends switch every 7 and 11 ms, until the server
/// received everything (checked exactly once and in order); returns the messages per sender
/// and the client's and server's switch counts.
async fn switch_under_traffic<C, L>(
    conn: Arc<C>,
    server: &mut L,
    cli_handle: ReconfigHandle,
    srv_handle: ReconfigHandle,
) -> (u64, u64, u64)
where
    C: ChunnelConnection<Data = Bytes> + 'static,
    L: Listener,
    L::Connection: ChunnelConnection<Data = Bytes>,
{
    let n = per_sender();
    // `conn` lives until everything arrived: dropping the client's connection would drop
    // the messages it has not had acknowledged yet.
    let senders = spawn_senders(conn.clone(), n);
    let peer = tokio::time::timeout(Duration::from_secs(5), server.accept())
        .await
        .expect("accept in time")
        .expect("accept");
    let stop = Arc::new(AtomicBool::new(false));
    let cli_sw = spawn_switcher(cli_handle, Duration::from_millis(7), stop.clone());
    let srv_sw = spawn_switcher(srv_handle, Duration::from_millis(11), stop.clone());
    receive_all(&peer, n).await;
    stop.store(true, Ordering::Relaxed);
    let (c, s) = (cli_sw.await.unwrap(), srv_sw.await.unwrap());
    for t in senders {
        t.await.unwrap();
    }
    (n, c, s)
}

/// `select(Reliable, Reliable with another window)` below `Ordered`, switched at both ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliable_switched_live_at_both_ends_loses_nothing() {
    let listener = udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let small = reliable::Config::default().with_window(64);

    let srv_sel =
        select(Reliable::default(), Reliable::new(small.clone())).reconfigurable::<Lock>();
    let srv_handle = srv_sel.handle();
    let mut server = stack![Ordered::default(), srv_sel, Shared].serve(listener);

    let cli_sel = select(Reliable::default(), Reliable::new(small)).reconfigurable::<LockFree>();
    let cli_handle = cli_sel.handle();
    let faults = lossy(0xA11CE);
    let mut client = stack![
        Ordered::default(),
        cli_sel,
        Shared,
        faults.clone(),
        udp::Connect::new(addr)
    ];
    let conn = Arc::new(client.connect_wrap(()).await.expect("connect"));
    let (n, c, s) = switch_under_traffic(conn, &mut server, cli_handle, srv_handle).await;
    eprintln!(
        "{} messages, {c} client and {s} server switches, {} datagrams dropped",
        n * SENDERS,
        faults.stats.dropped_sent() + faults.stats.dropped_received()
    );
    assert!(c >= 5 && s >= 5, "too few switches: client {c}, server {s}");
    assert!(faults.stats.dropped_sent() > 0);
}

/// `select(Ordered, Ordered with another capacity)` over `Reliable`, switched at both ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_switched_live_at_both_ends_loses_nothing() {
    let listener = udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let big = ordered::Config::default().with_capacity(4096);

    let srv_sel =
        select(Ordered::default(), Ordered::new(big.clone())).reconfigurable::<LockFree>();
    let srv_handle = srv_sel.handle();
    let mut server = stack![srv_sel, Shared, Reliable::default()].serve(listener);

    let cli_sel = select(Ordered::default(), Ordered::new(big)).reconfigurable::<Lock>();
    let cli_handle = cli_sel.handle();
    let faults = lossy(0xB0B);
    let mut client = stack![
        cli_sel,
        Shared,
        Reliable::default(),
        faults.clone(),
        udp::Connect::new(addr)
    ];
    let conn = Arc::new(client.connect_wrap(()).await.expect("connect"));
    let (n, c, s) = switch_under_traffic(conn, &mut server, cli_handle, srv_handle).await;
    eprintln!(
        "{} messages, {c} client and {s} server switches",
        n * SENDERS
    );
    assert!(c >= 5 && s >= 5, "too few switches: client {c}, server {s}");
}
