//! Lent buffers over shared memory: zero copies on receive and send (counted by the datapath
//! and by the allocator), the fallback to copying when the application holds too much, a held
//! payload never overwritten, payloads dropped on another thread, and a peer killed while
//! payloads are held.

mod support;

use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use chunnel::{
    Chunnel, ChunnelConnection, ConnectionExt, Either, Emit, Error, LendBuffer, LendRecv,
    LendStats, Payload,
};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_net::udp;
use chunnel_shm::{LEND_WINDOW, ShmConnection, ShmPayload};
use support::{ChildProc, WAIT, client_stack, server_stack};

#[global_allocator]
static A: chunnel_test::alloc::Counting = chunnel_test::alloc::Counting::new();

/// One test at a time: the allocation count is process-wide.
static SERIAL: Mutex<()> = Mutex::new(());

/// Not a test of its own: the entry point of the child processes (a no-op when run normally).
#[test]
fn child_entry() -> Result<()> {
    support::child_main()
}

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A negotiated client and server connection in this process (shared memory picked).
macro_rules! pair {
    () => {{
        let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
        let addr = listener.local_addr()?;
        let mut server = listen(server_stack(), listener, Config::default());
        let base = udp::Connect::new(addr).connect_wrap(()).await?;
        let client = Client::new(Config::default());
        let key = addr.to_string();
        let (c, s) = tokio::time::timeout(WAIT, async {
            tokio::join!(client.connect(&key, client_stack(), base), server.accept())
        })
        .await?;
        (c?, s?)
    }};
}

macro_rules! shm {
    ($neg:expr) => {
        match $neg.get_ref() {
            Either::Left(shm) => shm,
            Either::Right(_) => bail!("shared memory was not picked"),
        }
    };
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

const SIZE: usize = 1460;
const BURST: usize = 16;

/// `from` lends `BURST` buffers, fills them, emits them; `to` receives them lent, checks
/// them through a `Payload`-generic reader and drops them.
async fn lent_burst<C1: Send + Sync, C2: Send + Sync>(
    from: &ShmConnection<C1>,
    to: &ShmConnection<C2>,
    bufs: &mut Vec<chunnel_shm::ShmBuf>,
    slots: &mut [Option<ShmPayload>],
    round: usize,
) -> Result<()> {
    for i in 0..BURST {
        let mut b = from.lend(SIZE).context("lend")?;
        b.as_mut().fill((round + i) as u8);
        bufs.push(b);
    }
    from.emit(bufs.drain(..)).await?;
    let mut got = 0;
    while got < BURST {
        got += to.recv_lent(&mut slots[got..]).await?;
    }
    for (i, s) in slots.iter_mut().enumerate() {
        let p = s.take().context("slot")?;
        anyhow::ensure!(p.is_lent(), "message {i} was copied");
        anyhow::ensure!(
            p.len() == SIZE && checksum(&p) == SIZE as u64 * u64::from((round + i) as u8)
        );
    }
    Ok(())
}

#[test]
fn zero_copies_and_no_allocation_both_ways() -> Result<()> {
    let _s = serial();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let (c, s) = pair!();
        let (c, s) = (shm!(c), shm!(s));
        let mut bufs = Vec::with_capacity(BURST);
        let mut slots: Vec<Option<ShmPayload>> = (0..BURST).map(|_| None).collect();
        for round in 0..20 {
            lent_burst(c, s, &mut bufs, &mut slots, round).await?;
            lent_burst(s, c, &mut bufs, &mut slots, round).await?;
        }
        let (c0, s0) = (c.lend_stats(), s.lend_stats());
        let before = A.count();
        for round in 0..200 {
            lent_burst(c, s, &mut bufs, &mut slots, round).await?;
            lent_burst(s, c, &mut bufs, &mut slots, round).await?;
        }
        let allocs = A.count() - before;
        let n = (200 * BURST) as u64;
        let want = LendStats {
            rx_lent: n,
            rx_copied: 0,
            tx_lent: n,
            tx_copied: 0,
        };
        assert_eq!(delta(c.lend_stats(), c0), want, "client");
        assert_eq!(delta(s.lend_stats(), s0), want, "server");
        assert_eq!(allocs, 0, "{allocs} allocations for {} messages", 2 * n);
        // The counters do count copies: the copying path, once each way.
        let (c1, s1) = (c.lend_stats(), s.lend_stats());
        c.send_one(Bytes::from_static(b"copied")).await?;
        assert_eq!(s.recv_one().await?, "copied");
        assert_eq!(delta(c.lend_stats(), c1).tx_copied, 1);
        assert_eq!(delta(s.lend_stats(), s1).rx_copied, 1);
        Ok(())
    })
}

fn msg(i: u32, len: usize) -> Vec<u8> {
    let mut m = vec![(i % 251) as u8; len];
    m[..4].copy_from_slice(&i.to_be_bytes());
    m
}

fn check(p: &ShmPayload, i: u32, len: usize) -> Result<()> {
    anyhow::ensure!(p.as_ref() == &msg(i, len)[..], "message {i} differs");
    Ok(())
}

fn multi() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// The receiver holds every payload: the datapath lends what it can, then copies (counted),
/// and the sender never stalls. The sender holds lent buffers: `lend` says no past its window
/// (the application then sends by copy).
#[test]
fn holding_payloads_falls_back_to_copying_without_stalling() -> Result<()> {
    let _s = serial();
    multi()?.block_on(async {
        let (c, s) = pair!();
        const N: u32 = 2000;
        const LEN: usize = 1000;
        let sender = tokio::spawn(async move {
            for k in 0..N / 20 {
                let burst: Vec<Bytes> = (k * 20..k * 20 + 20).map(|i| msg(i, LEN).into()).collect();
                c.send(burst).await?;
            }
            Ok::<_, Error>(c)
        });
        let srv = shm!(s);
        let mut held: Vec<ShmPayload> = Vec::new();
        let mut slots: Vec<Option<ShmPayload>> = (0..32).map(|_| None).collect();
        let started = Instant::now();
        while held.len() < N as usize {
            let n = tokio::time::timeout(WAIT, srv.recv_lent(&mut slots))
                .await
                .context("receiver stalled")??;
            held.extend(slots[..n].iter_mut().filter_map(Option::take));
        }
        let c = tokio::time::timeout(WAIT, sender).await???;
        eprintln!("{N} messages held in {:?}", started.elapsed());
        for (i, p) in held.iter().enumerate() {
            check(p, i as u32, LEN)?;
        }
        let st = srv.lend_stats();
        let lent = held.iter().filter(|p| p.is_lent()).count() as u64;
        assert_eq!(st.rx_lent, lent);
        assert_eq!(st.rx_lent + st.rx_copied, u64::from(N));
        assert!(
            st.rx_lent >= 1 && st.rx_copied >= u64::from(N) - 64,
            "{st:?}"
        );
        assert_eq!(srv.held() as u64, lent);
        drop(held);
        assert_eq!(srv.held(), 0);

        // Send side: lend until the datapath says no; nothing stalls.
        let cl = shm!(c);
        let mut bufs = Vec::new();
        while let Some(mut b) = cl.lend(100) {
            b.as_mut().fill(9);
            bufs.push(b);
            anyhow::ensure!(bufs.len() <= LEND_WINDOW, "lend never says no");
        }
        let lent_tx = bufs.len();
        assert!(lent_tx >= 1);
        cl.emit(bufs).await?;
        let mut got = 0;
        while got < lent_tx {
            got += tokio::time::timeout(WAIT, srv.recv_lent(&mut slots)).await??;
            slots.iter_mut().for_each(|s| *s = None);
        }
        let t = cl.lend_stats();
        assert_eq!(t.tx_lent, lent_tx as u64);
        assert_eq!(t.tx_copied, u64::from(N));
        Ok(())
    })
}

/// One payload held while the sender goes round the ring twenty times: its bytes never
/// change. A lent send buffer dropped unsent is skipped by the receiver.
#[test]
fn held_payload_is_never_overwritten() -> Result<()> {
    let _s = serial();
    multi()?.block_on(async {
        let (c, s) = pair!();
        let (cl, srv) = (shm!(c), shm!(s));
        let mut slot: Vec<Option<ShmPayload>> = vec![None];
        cl.send_one(Bytes::from(msg(0, 100))).await?;
        srv.recv_lent(&mut slot).await?;
        slot[0] = None;
        cl.send_one(Bytes::from(msg(1, 1000))).await?;
        srv.recv_lent(&mut slot).await?;
        let held = slot[0].take().context("held")?;
        assert!(held.is_lent());
        // 256 KiB ring: 5,000 x ~1 KiB is 20 laps.
        let mut slots: Vec<Option<ShmPayload>> = (0..32).map(|_| None).collect();
        let mut next = 2u32;
        while next < 5000 {
            let burst: Vec<Bytes> = (next..next + 20).map(|i| msg(i, 1000).into()).collect();
            cl.send(burst).await?;
            let mut got = 0;
            while got < 20 {
                let n = tokio::time::timeout(WAIT, srv.recv_lent(&mut slots[..20 - got]))
                    .await
                    .context("stalled")??;
                for p in slots[..n].iter_mut().filter_map(Option::take) {
                    check(&p, next + got as u32, 1000)?;
                    got += 1;
                }
            }
            check(&held, 1, 1000)?;
            next += 20;
        }
        check(&held, 1, 1000)?;
        // Dropped unsent: skipped.
        drop(cl.lend(500).context("lend")?);
        cl.send_one(Bytes::from_static(b"after")).await?;
        assert_eq!(srv.recv_lent(&mut slot).await?, 1);
        assert_eq!(slot[0].take().context("after")?.as_ref(), b"after");
        drop(held);
        assert_eq!(srv.held(), 0);
        Ok(())
    })
}

#[test]
fn payloads_dropped_on_another_thread() -> Result<()> {
    let _s = serial();
    multi()?.block_on(async {
        let (c, s) = pair!();
        let (cl, srv) = (shm!(c), shm!(s));
        for round in 0..50u32 {
            let burst: Vec<Bytes> = (0..16).map(|i| msg(round * 16 + i, 800).into()).collect();
            cl.send(burst).await?;
            let mut slots: Vec<Option<ShmPayload>> = (0..16).map(|_| None).collect();
            let mut got = 0;
            while got < 16 {
                got += tokio::time::timeout(WAIT, srv.recv_lent(&mut slots[got..])).await??;
            }
            let held: Vec<ShmPayload> = slots.into_iter().flatten().collect();
            // Dropped in reverse order on a plain thread.
            std::thread::spawn(move || {
                for (i, p) in held.into_iter().enumerate().rev() {
                    check(&p, round * 16 + i as u32, 800).expect("bytes");
                    drop(p);
                }
            })
            .join()
            .map_err(|_| anyhow::anyhow!("dropping thread panicked"))?;
            assert_eq!(srv.held(), 0);
        }
        assert!(srv.lend_stats().rx_lent > 0);
        Ok(())
    })
}

/// The peer process is killed while this side holds its messages: they stay readable, the
/// connection ends with `PeerClosed`, and dropping them (after the connection) is fine.
#[test]
fn peer_killed_while_payloads_are_held() -> Result<()> {
    let _s = serial();
    multi()?.block_on(async {
        let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
        let addr = listener.local_addr()?;
        let mut server = listen(server_stack(), listener, Config::default());
        let child = ChildProc::spawn(
            "client (lends, then killed)",
            &[],
            &[
                ("CHUNNEL_SHM_CHILD", "client-lend-hang".into()),
                ("CHUNNEL_SHM_ADDR", addr.to_string()),
            ],
        )?;
        let conn = tokio::time::timeout(WAIT, server.accept()).await??;
        let srv = shm!(conn);
        let mut slots: Vec<Option<ShmPayload>> = (0..10).map(|_| None).collect();
        let mut got = 0;
        while got < 10 {
            got += tokio::time::timeout(WAIT, srv.recv_lent(&mut slots[got..])).await??;
        }
        let held: Vec<ShmPayload> = slots.into_iter().flatten().collect();
        let (line, mut child) = tokio::task::spawn_blocking(move || (child.line(), child)).await?;
        assert_eq!(line?, "SENT");
        child.child.kill()?;
        child.child.wait()?;
        let mut one: Vec<Option<ShmPayload>> = vec![None];
        let end = tokio::time::timeout(WAIT, srv.recv_lent(&mut one)).await?;
        assert!(matches!(end, Err(Error::PeerClosed)), "got {end:?}");
        for (i, p) in held.iter().enumerate() {
            assert_eq!(
                p.as_ref(),
                &[i as u8; 1000][..],
                "message {i} after the kill"
            );
        }
        assert!(held.iter().all(ShmPayload::is_lent));
        drop(conn);
        drop(server);
        // The mapping lives as long as the payloads.
        for (i, p) in held.iter().enumerate() {
            assert_eq!(p.as_ref(), &[i as u8; 1000][..]);
        }
        drop(held);
        Ok(())
    })
}
