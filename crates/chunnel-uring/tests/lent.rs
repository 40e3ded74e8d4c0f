//! Lent buffers over io_uring: zero copies on receive and send (counted by the datapath and by
//! the allocator), the fallback to copying when the application holds many receive buffers,
//! a held payload never overwritten, payloads dropped on another thread, and the peer gone
//! (and the connection dropped) while payloads are held. Skipped where io_uring cannot run.

use std::net::UdpSocket;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use chunnel::{Chunnel, ConnectionExt, Emit, LendBuffer, LendRecv, LendStats, Payload};
use chunnel_uring::{UringPayload, udp};

#[global_allocator]
static A: chunnel_test::alloc::Counting = chunnel_test::alloc::Counting::new();

/// One test at a time: the allocation count is process-wide.
static SERIAL: Mutex<()> = Mutex::new(());

const WAIT: Duration = Duration::from_secs(20);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn available() -> bool {
    match chunnel_uring::check_available() {
        Ok(()) => true,
        Err(e) => {
            eprintln!("skipped: {e}");
            false
        }
    }
}

fn current() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn reflector() -> UdpSocket {
    let r = UdpSocket::bind("127.0.0.1:0").unwrap();
    r.set_read_timeout(Some(WAIT)).unwrap();
    r
}

async fn client(peer: &UdpSocket, cfg: udp::Config) -> udp::Connection {
    udp::Connect::new(peer.local_addr().unwrap())
        .with_config(cfg)
        .connect_wrap(())
        .await
        .unwrap()
}

fn delta(after: LendStats, before: LendStats) -> LendStats {
    LendStats {
        rx_lent: after.rx_lent - before.rx_lent,
        rx_copied: after.rx_copied - before.rx_copied,
        tx_lent: after.tx_lent - before.tx_lent,
        tx_copied: after.tx_copied - before.tx_copied,
    }
}

/// A layer that only reads bytes, generic over any payload.
fn checksum<P: Payload>(p: &P) -> u64 {
    p.as_ref().iter().map(|&b| u64::from(b)).sum()
}

fn msg(i: u32, len: usize) -> Vec<u8> {
    let mut m = vec![(i % 251) as u8; len];
    m[..4].copy_from_slice(&i.to_be_bytes());
    m
}

async fn recv_n(c: &udp::Connection, slots: &mut [Option<UringPayload>]) {
    let mut got = 0;
    while got < slots.len() {
        got += tokio::time::timeout(WAIT, c.recv_lent(&mut slots[got..]))
            .await
            .expect("receive stalled")
            .unwrap();
    }
}

const SIZE: usize = 1460;
const BURST: usize = 16;

/// Lends `BURST` buffers, fills, emits them; the reflector echoes; receives them lent and
/// checks them through a `Payload`-generic reader.
async fn round(
    c: &udp::Connection,
    r: &UdpSocket,
    bufs: &mut Vec<chunnel_uring::UringBuf>,
    slots: &mut [Option<UringPayload>],
    buf: &mut [u8],
    k: usize,
) {
    for i in 0..BURST {
        let mut b = c.lend(SIZE).expect("lend");
        b.as_mut().fill((k + i) as u8);
        bufs.push(b);
    }
    c.emit(bufs.drain(..)).await.unwrap();
    for _ in 0..BURST {
        let (n, from) = r.recv_from(buf).unwrap();
        r.send_to(&buf[..n], from).unwrap();
    }
    recv_n(c, slots).await;
    for (i, s) in slots.iter_mut().enumerate() {
        let p = s.take().unwrap();
        assert!(p.is_lent(), "datagram {i} was copied");
        assert_eq!(checksum(&p), SIZE as u64 * u64::from((k + i) as u8));
    }
}

#[test]
fn zero_copies_and_no_allocation_both_ways() {
    let _s = serial();
    if !available() {
        return;
    }
    current().block_on(async {
        let r = reflector();
        let c = client(&r, udp::Config::default()).await;
        let mut bufs = Vec::with_capacity(BURST);
        let mut slots: Vec<Option<UringPayload>> = (0..BURST).map(|_| None).collect();
        let mut buf = vec![0u8; 2048];
        for k in 0..20 {
            round(&c, &r, &mut bufs, &mut slots, &mut buf, k).await;
        }
        let s0 = c.lend_stats();
        let before = A.count();
        for k in 0..300 {
            round(&c, &r, &mut bufs, &mut slots, &mut buf, k).await;
        }
        let allocs = A.count() - before;
        let n = (300 * BURST) as u64;
        assert_eq!(
            delta(c.lend_stats(), s0),
            LendStats {
                rx_lent: n,
                rx_copied: 0,
                tx_lent: n,
                tx_copied: 0
            }
        );
        assert_eq!(allocs, 0, "{allocs} allocations for {} datagrams", 2 * n);

        // The counters do count the copying paths (a connection that never lent).
        let c2 = client(&r, udp::Config::default()).await;
        c2.send_one(Bytes::from_static(b"copied")).await.unwrap();
        let (k, from) = r.recv_from(&mut buf).unwrap();
        r.send_to(&buf[..k], from).unwrap();
        assert_eq!(c2.recv_one().await.unwrap(), "copied");
        let st = c2.lend_stats();
        assert_eq!((st.tx_copied, st.rx_copied, st.rx_lent), (1, 1, 0));
    });
}

/// The application holds every datagram: at most half the receive buffers are lent, the
/// rest copied (counted), nothing stalls. The sender holds every lent buffer: `lend` says no
/// past the pool, and a `Bytes` send still goes.
#[test]
fn holding_payloads_falls_back_to_copying_without_stalling() {
    let _s = serial();
    if !available() {
        return;
    }
    current().block_on(async {
        let r = reflector();
        let cfg = udp::Config::default()
            .with_recv_buffers(64)
            .with_send_buffers(8);
        let c = client(&r, cfg).await;
        let to = c.local_addr().unwrap();
        let to: std::net::SocketAddr = ([127, 0, 0, 1], to.port()).into();
        let mut held: Vec<UringPayload> = Vec::new();
        let mut slots: Vec<Option<UringPayload>> = (0..16).map(|_| None).collect();
        for k in 0..20u32 {
            for i in 0..16 {
                r.send_to(&msg(k * 16 + i, 1000), to).unwrap();
            }
            recv_n(&c, &mut slots).await;
            held.extend(slots.iter_mut().filter_map(Option::take));
        }
        for (i, p) in held.iter().enumerate() {
            assert_eq!(p.as_ref(), &msg(i as u32, 1000)[..], "datagram {i}");
        }
        let st = c.lend_stats();
        let lent = held.iter().filter(|p| p.is_lent()).count() as u64;
        assert_eq!(st.rx_lent, lent);
        assert_eq!(lent, 32, "half of the 64 receive buffers");
        assert_eq!(st.rx_copied, 320 - 32);
        drop(held);

        let mut bufs = Vec::new();
        while let Some(b) = c.lend(100) {
            bufs.push(b);
            assert!(bufs.len() <= 8, "lend never says no");
        }
        assert_eq!(bufs.len(), 8);
        c.send_one(Bytes::from_static(b"by copy")).await.unwrap();
        let mut buf = [0u8; 64];
        let (n, _) = r.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"by copy");
        drop(bufs);
        assert!(
            c.lend(100).is_some(),
            "dropped unsent buffers are free again"
        );
        assert_eq!(c.lend_stats().tx_copied, 1);
    });
}

/// One payload held while 3,000 more datagrams go through the same 64 buffers.
#[test]
fn held_payload_is_never_overwritten() {
    let _s = serial();
    if !available() {
        return;
    }
    current().block_on(async {
        let r = reflector();
        let c = client(&r, udp::Config::default()).await;
        let to = c.local_addr().unwrap();
        let to: std::net::SocketAddr = ([127, 0, 0, 1], to.port()).into();
        r.send_to(&msg(0, 1200), to).unwrap();
        let mut one: Vec<Option<UringPayload>> = vec![None];
        recv_n(&c, &mut one).await;
        let held = one[0].take().unwrap();
        assert!(held.is_lent());
        let mut slots: Vec<Option<UringPayload>> = (0..20).map(|_| None).collect();
        for k in 0..150u32 {
            for i in 0..20 {
                r.send_to(&msg(1 + k * 20 + i, 1200), to).unwrap();
            }
            recv_n(&c, &mut slots).await;
            for (i, s) in slots.iter_mut().enumerate() {
                assert_eq!(
                    s.take().unwrap().as_ref(),
                    &msg(1 + k * 20 + i as u32, 1200)[..]
                );
            }
            assert_eq!(held.as_ref(), &msg(0, 1200)[..], "held payload overwritten");
        }
        assert!(c.lend_stats().rx_lent >= 3000);
    });
}

#[test]
fn payloads_dropped_on_another_thread() {
    let _s = serial();
    if !available() {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let r = reflector();
        let c = client(&r, udp::Config::default()).await;
        let to = c.local_addr().unwrap();
        let to: std::net::SocketAddr = ([127, 0, 0, 1], to.port()).into();
        for k in 0..50u32 {
            for i in 0..16 {
                r.send_to(&msg(k * 16 + i, 900), to).unwrap();
            }
            let mut slots: Vec<Option<UringPayload>> = (0..16).map(|_| None).collect();
            recv_n(&c, &mut slots).await;
            let held: Vec<UringPayload> = slots.into_iter().flatten().collect();
            std::thread::spawn(move || {
                for (i, p) in held.into_iter().enumerate().rev() {
                    assert_eq!(p.as_ref(), &msg(k * 16 + i as u32, 900)[..]);
                }
            })
            .join()
            .unwrap();
        }
        // Every buffer came back: all 800 were lent (never more than 16 out at once).
        assert_eq!(c.lend_stats().rx_lent, 800);
    });
}

/// The peer's socket is gone and the connection dropped while payloads are held: they stay
/// readable, then drop without harm.
#[test]
fn peer_gone_while_payloads_are_held() {
    let _s = serial();
    if !available() {
        return;
    }
    current().block_on(async {
        let r = reflector();
        let c = client(&r, udp::Config::default()).await;
        let to = c.local_addr().unwrap();
        let to: std::net::SocketAddr = ([127, 0, 0, 1], to.port()).into();
        for i in 0..10 {
            r.send_to(&msg(i, 1000), to).unwrap();
        }
        let mut slots: Vec<Option<UringPayload>> = (0..10).map(|_| None).collect();
        recv_n(&c, &mut slots).await;
        let held: Vec<UringPayload> = slots.into_iter().flatten().collect();
        assert!(held.iter().all(UringPayload::is_lent));
        drop(r);
        // The peer is gone: a send draws ICMP "port unreachable", which ends the connection.
        c.send_one(Bytes::from_static(b"anyone?")).await.unwrap();
        let mut one: Vec<Option<UringPayload>> = vec![None];
        let end = tokio::time::timeout(WAIT, c.recv_lent(&mut one))
            .await
            .unwrap();
        assert!(
            matches!(end, Err(chunnel::Error::PeerClosed)),
            "got {end:?}"
        );
        for (i, p) in held.iter().enumerate() {
            assert_eq!(p.as_ref(), &msg(i as u32, 1000)[..]);
        }
        drop(c);
        for (i, p) in held.iter().enumerate() {
            assert_eq!(p.as_ref(), &msg(i as u32, 1000)[..], "after the connection");
        }
        drop(held);
    });
}
