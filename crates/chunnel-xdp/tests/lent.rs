//! Lent buffers on the AF_XDP client, in two namespaces against a kernel UDP peer: zero copies
//! on receive and send (counted by the datapath and by the allocator), the fallback to copying
//! when the application holds many receive frames (and `lend` saying no while the copying send
//! still goes), a held payload never overwritten, payloads dropped on another thread, and the
//! server gone (and the connection dropped) while payloads are held.
//!
//! Needs root, `ip` and the XDP program (else it prints why and passes, unless
//! CHUNNEL_XDP_REQUIRE=1).

use std::net::{SocketAddr, SocketAddrV4, UdpSocket};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Result, ensure};
use bytes::Bytes;
use chunnel::{Chunnel, ConnectionExt, Emit, LendBuffer, LendRecv, LendStats, Payload};
use chunnel_test::netns::VethPair;
use chunnel_xdp::{AfXdpConnect, ClientConnection, Config, XdpBuf, XdpPayload};

mod support;

use support::{SERVER, in_netns, netns, privileged, program_built};

#[global_allocator]
static A: chunnel_test::alloc::Counting = chunnel_test::alloc::Counting::new();

/// One test at a time: the allocation count is process-wide.
static SERIAL: Mutex<()> = Mutex::new(());

const WAIT: Duration = Duration::from_secs(20);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The namespaces and a kernel UDP socket bound to [`SERVER`] in `b` (usable from any thread),
/// or `None` when this host cannot run the test.
fn setup() -> Result<Option<(VethPair, UdpSocket)>> {
    if !privileged() || !program_built() {
        return Ok(None);
    }
    let ns = netns()?;
    let nsb = ns.b.clone();
    let r = std::thread::spawn(move || -> Result<UdpSocket> {
        chunnel_test::netns::enter(&nsb)?;
        let r = UdpSocket::bind(SERVER)?;
        r.set_read_timeout(Some(WAIT))?;
        Ok(r)
    })
    .join()
    .expect("server thread panicked")?;
    Ok(Some((ns, r)))
}

/// A client of [`SERVER`] from `xa`, with UMEM `frames`.
async fn client(frames: u32) -> Result<ClientConnection> {
    let mut cfg = Config::new("xa", "0.0.0.0:0".parse()?);
    cfg.frames = frames;
    let server: SocketAddrV4 = SERVER.parse()?;
    Ok(AfXdpConnect::new(cfg, server).connect_wrap(()).await?)
}

/// The client's address as the server sees it.
fn addr_of(c: &ClientConnection) -> SocketAddr {
    c.local_addr().into()
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

async fn recv_n(c: &ClientConnection, slots: &mut [Option<XdpPayload>]) -> Result<()> {
    let mut got = 0;
    while got < slots.len() {
        got += tokio::time::timeout(WAIT, c.recv_lent(&mut slots[got..]))
            .await
            .map_err(|_| anyhow::anyhow!("receive stalled after {got}"))??;
    }
    Ok(())
}

const SIZE: usize = 1460;
const BURST: usize = 16;

/// Lends `BURST` buffers, fills, emits them; the kernel peer echoes; receives them lent and
/// checks them through a `Payload`-generic reader.
async fn round(
    c: &ClientConnection,
    r: &UdpSocket,
    bufs: &mut Vec<XdpBuf>,
    slots: &mut [Option<XdpPayload>],
    buf: &mut [u8],
    k: usize,
) -> Result<()> {
    for i in 0..BURST {
        let mut b = c
            .lend(SIZE)
            .ok_or_else(|| anyhow::anyhow!("lend said no"))?;
        b.as_mut().fill((k + i) as u8);
        bufs.push(b);
    }
    c.emit(bufs.drain(..)).await?;
    for _ in 0..BURST {
        let (n, from) = r.recv_from(buf)?;
        r.send_to(&buf[..n], from)?;
    }
    recv_n(c, slots).await?;
    for (i, s) in slots.iter_mut().enumerate() {
        let p = s.take().expect("filled");
        ensure!(p.is_lent(), "datagram {i} was copied");
        // The kernel peer echoes in order on one veth queue.
        ensure!(
            checksum(&p) == SIZE as u64 * u64::from((k + i) as u8),
            "datagram {i} of round {k}: wrong bytes"
        );
    }
    Ok(())
}

#[test]
fn zero_copies_and_no_allocation_both_ways() -> Result<()> {
    let _s = serial();
    let Some((ns, r)) = setup()? else {
        return Ok(());
    };
    in_netns(&ns.a, move || async move {
        let c = client(4096).await?;
        let mut bufs = Vec::with_capacity(BURST);
        let mut slots: Vec<Option<XdpPayload>> = (0..BURST).map(|_| None).collect();
        let mut buf = vec![0u8; 2048];
        for k in 0..20 {
            round(&c, &r, &mut bufs, &mut slots, &mut buf, k).await?;
        }
        let s0 = c.lend_stats();
        let before = A.count();
        for k in 0..300 {
            round(&c, &r, &mut bufs, &mut slots, &mut buf, k).await?;
        }
        let allocs = A.count() - before;
        let n = (300 * BURST) as u64;
        let d = delta(c.lend_stats(), s0);
        ensure!(
            d == LendStats {
                rx_lent: n,
                rx_copied: 0,
                tx_lent: n,
                tx_copied: 0
            },
            "{d:?}"
        );
        ensure!(allocs == 0, "{allocs} allocations for {} datagrams", 2 * n);
        // Both directions went through AF_XDP: the program redirected every echo.
        let redirected = c.counters()?.redirected;
        ensure!(redirected >= 320 * BURST as u64, "redirected {redirected}");

        // The counters do count the copying paths.
        c.send_one(Bytes::from_static(b"copied")).await?;
        let (k, from) = r.recv_from(&mut buf)?;
        ensure!(&buf[..k] == b"copied");
        r.send_to(&buf[..k], from)?;
        ensure!(c.recv_one().await? == "copied");
        let d = delta(c.lend_stats(), s0);
        ensure!((d.tx_copied, d.rx_copied) == (1, 1), "{d:?}");
        Ok(())
    })
    .join()
    .expect("client thread panicked")
}

/// The application holds every datagram: at most half the receive frames are lent, the rest
/// copied (counted), nothing stalls. The sender holds every lent buffer: `lend` says no at half
/// the TX frames, and a `Bytes` send still goes.
#[test]
fn holding_payloads_falls_back_to_copying_without_stalling() -> Result<()> {
    let _s = serial();
    let Some((ns, r)) = setup()? else {
        return Ok(());
    };
    in_netns(&ns.a, move || async move {
        // 256 frames: 128 for receive (64 may be lent), 128 for transmit (64 may be lent).
        let c = client(256).await?;
        let to = addr_of(&c);
        let mut held: Vec<XdpPayload> = Vec::new();
        let mut slots: Vec<Option<XdpPayload>> = (0..16).map(|_| None).collect();
        for k in 0..20u32 {
            for i in 0..16 {
                r.send_to(&msg(k * 16 + i, 1000), to)?;
            }
            recv_n(&c, &mut slots).await?;
            held.extend(slots.iter_mut().filter_map(Option::take));
        }
        for (i, p) in held.iter().enumerate() {
            ensure!(p.as_ref() == &msg(i as u32, 1000)[..], "datagram {i}");
        }
        let st = c.lend_stats();
        let lent = held.iter().filter(|p| p.is_lent()).count() as u64;
        ensure!(st.rx_lent == lent, "{st:?}, {lent} lent");
        ensure!(
            lent == 64,
            "{lent} lent, not half of the 128 receive frames"
        );
        ensure!(st.rx_copied == 320 - 64, "{st:?}");
        drop(held);
        // The frames came back: lending resumes.
        r.send_to(&msg(7, 100), to)?;
        let mut one: Vec<Option<XdpPayload>> = vec![None];
        recv_n(&c, &mut one).await?;
        ensure!(
            one[0].as_ref().is_some_and(XdpPayload::is_lent),
            "not lent after the drop"
        );

        let mut bufs = Vec::new();
        while let Some(b) = c.lend(100) {
            bufs.push(b);
            ensure!(bufs.len() <= 64, "lend never says no");
        }
        ensure!(bufs.len() == 64, "{} lent", bufs.len());
        ensure!(c.lend(4000).is_none(), "a payload over the frame was lent");
        c.send_one(Bytes::from_static(b"by copy")).await?;
        let mut buf = [0u8; 64];
        let (n, _) = r.recv_from(&mut buf)?;
        ensure!(&buf[..n] == b"by copy");
        drop(bufs);
        let mut b = c
            .lend(5)
            .ok_or_else(|| anyhow::anyhow!("dropped buffers not free"))?;
        b.as_mut().copy_from_slice(b"again");
        c.emit([b]).await?;
        let (n, _) = r.recv_from(&mut buf)?;
        ensure!(&buf[..n] == b"again");
        let st = c.lend_stats();
        ensure!((st.tx_copied, st.tx_lent) == (1, 1), "{st:?}");
        Ok(())
    })
    .join()
    .expect("client thread panicked")
}

/// One payload held while 3,000 more datagrams go through the same 128 receive frames.
#[test]
fn held_payload_is_never_overwritten() -> Result<()> {
    let _s = serial();
    let Some((ns, r)) = setup()? else {
        return Ok(());
    };
    in_netns(&ns.a, move || async move {
        let c = client(256).await?;
        let to = addr_of(&c);
        r.send_to(&msg(0, 1200), to)?;
        let mut one: Vec<Option<XdpPayload>> = vec![None];
        recv_n(&c, &mut one).await?;
        let held = one[0].take().expect("filled");
        ensure!(held.is_lent());
        let mut slots: Vec<Option<XdpPayload>> = (0..20).map(|_| None).collect();
        for k in 0..150u32 {
            for i in 0..20 {
                r.send_to(&msg(1 + k * 20 + i, 1200), to)?;
            }
            recv_n(&c, &mut slots).await?;
            for (i, s) in slots.iter_mut().enumerate() {
                let p = s.take().expect("filled");
                ensure!(p.is_lent());
                ensure!(p.as_ref() == &msg(1 + k * 20 + i as u32, 1200)[..]);
            }
            ensure!(
                held.as_ref() == &msg(0, 1200)[..],
                "held payload overwritten"
            );
        }
        ensure!(c.lend_stats().rx_lent == 3001);
        Ok(())
    })
    .join()
    .expect("client thread panicked")
}

/// Payloads dropped on other threads go back to the fill ring: with 128 receive frames (64
/// lendable), 800 datagrams are all lent.
#[test]
fn payloads_dropped_on_another_thread() -> Result<()> {
    let _s = serial();
    let Some((ns, r)) = setup()? else {
        return Ok(());
    };
    let nsa = ns.a.clone();
    std::thread::spawn(move || -> Result<()> {
        chunnel_test::netns::enter(&nsa)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        rt.block_on(async {
            let c = client(256).await?;
            let to = addr_of(&c);
            for k in 0..50u32 {
                for i in 0..16 {
                    r.send_to(&msg(k * 16 + i, 900), to)?;
                }
                let mut slots: Vec<Option<XdpPayload>> = (0..16).map(|_| None).collect();
                recv_n(&c, &mut slots).await?;
                let held: Vec<XdpPayload> = slots.into_iter().flatten().collect();
                std::thread::spawn(move || {
                    for (i, p) in held.into_iter().enumerate().rev() {
                        assert_eq!(p.as_ref(), &msg(k * 16 + i as u32, 900)[..]);
                    }
                })
                .join()
                .expect("dropping thread panicked");
            }
            let st = c.lend_stats();
            ensure!((st.rx_lent, st.rx_copied) == (800, 0), "{st:?}");
            Ok(())
        })
    })
    .join()
    .expect("client thread panicked")
}

/// The server's socket is gone and the connection dropped (socket closed, program detached)
/// while payloads are held: they stay readable, then drop without harm.
#[test]
fn server_gone_while_payloads_are_held() -> Result<()> {
    let _s = serial();
    let Some((ns, r)) = setup()? else {
        return Ok(());
    };
    in_netns(&ns.a, move || async move {
        let c = client(256).await?;
        let to = addr_of(&c);
        for i in 0..8 {
            r.send_to(&msg(i, 700), to)?;
        }
        let mut slots: Vec<Option<XdpPayload>> = (0..8).map(|_| None).collect();
        recv_n(&c, &mut slots).await?;
        let held: Vec<XdpPayload> = slots.into_iter().flatten().collect();
        ensure!(held.iter().all(XdpPayload::is_lent));
        let unsent = c.lend(300).ok_or_else(|| anyhow::anyhow!("lend said no"))?;
        drop(r);
        // The server's port is closed now: a send draws an ICMP error, which the
        // connection reports.
        c.send_one(Bytes::from_static(b"anyone?")).await?;
        let mut extra: Vec<Option<XdpPayload>> = vec![None];
        let e = tokio::time::timeout(WAIT, c.recv_lent(&mut extra)).await?;
        ensure!(
            matches!(e, Err(chunnel::Error::PeerClosed)),
            "expected PeerClosed, got {e:?}"
        );
        drop(c);
        for (i, p) in held.iter().enumerate() {
            ensure!(
                p.as_ref() == &msg(i as u32, 700)[..],
                "datagram {i} after the drop"
            );
        }
        drop(unsent);
        drop(held);
        Ok(())
    })
    .join()
    .expect("client thread panicked")
}
