//! AF_XDP server against a kernel UDP client across two network namespaces joined by a
//! single-queue veth pair, and the fallback to kernel UDP.
//!
//! Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN for setns, CAP_BPF) and `ip` (iproute2); without
//! them, or without the XDP program (built only when clang is installed), the namespace tests
//! print why and pass without running; set CHUNNEL_XDP_REQUIRE=1 to make that a failure, as
//! CI should. Each test creates its own uniquely named namespaces and
//! removes them in a Drop guard, even when it fails. Addresses exist only inside them.

use std::net::{SocketAddr, SocketAddrV4};
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use chunnel::{
    Chunnel, ChunnelConnection, ConnectionExt, Error, Listen, Negotiate, Offers, Side, select,
};
use chunnel_net::udp;
use chunnel_xdp::{AfXdpUdp, Config};

mod support;

use support::{SERVER, echo, in_netns, netns, privileged};

fn sizes() -> [usize; 6] {
    [1, 17, 64, 512, 1400, chunnel_xdp::MAX_PAYLOAD]
}

fn message(i: usize) -> Bytes {
    let n = sizes()[i % sizes().len()];
    (0..n)
        .map(|k| (k as u8) ^ (i as u8) ^ ((i >> 8) as u8))
        .collect::<Vec<u8>>()
        .into()
}

/// A kernel UDP client (chunnel-net) in `ns`: `rounds` single request/response exchanges, then
/// `bursts` bursts of 32. Returns how many messages were echoed.
async fn udp_client(rounds: usize, bursts: usize) -> Result<usize> {
    let addr: SocketAddr = SERVER.parse()?;
    let conn = chunnel_net::udp::Connect::new(addr)
        .connect_wrap(())
        .await?;
    let mut echoed = 0;
    let t = std::time::Instant::now();
    for i in 0..rounds {
        let m = message(i);
        let mut tries = 0;
        let got = 'send: loop {
            conn.send_one(m.clone()).await?;
            loop {
                match tokio::time::timeout(Duration::from_secs(1), conn.recv_one()).await {
                    // A late second echo of the previous message, sent twice after a timeout
                    // on a loaded machine: not this one's.
                    Ok(Ok(r)) if i > 0 && r != m && r == message(i - 1) => continue,
                    Ok(r) => break 'send r?,
                    Err(_) if tries < 3 => {
                        tries += 1;
                        continue 'send;
                    }
                    Err(_) => bail!("no echo for message {i} after {tries} retries"),
                }
            }
        };
        ensure!(got == m, "message {i}: echoed {} bytes differ", got.len());
        echoed += 1;
    }
    if rounds > 0 {
        let rtt = t.elapsed() / rounds as u32;
        eprintln!("{rounds} request/response rounds: mean RTT {rtt:?} (sizes 1..=1472 B)");
    }
    for b in 0..bursts {
        let burst: Vec<Bytes> = (0..32).map(|k| message(rounds + b * 32 + k)).collect();
        conn.send(burst.clone()).await?;
        let mut got = Vec::new();
        while got.len() < burst.len() {
            let mut slots = vec![None; 32];
            let n = tokio::time::timeout(Duration::from_secs(2), conn.recv(&mut slots))
                .await
                .with_context(|| format!("burst {b}: got {} of 32", got.len()))??;
            got.extend(slots[..n].iter_mut().map(|s| s.take().unwrap()));
        }
        ensure!(got == burst, "burst {b}: echo differs (loss or reordering)");
        echoed += 32;
    }
    Ok(echoed)
}

#[test]
fn kernel_udp_client_af_xdp_server() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    if !chunnel_xdp::embedded_program_available() {
        assert!(
            std::env::var_os("CHUNNEL_XDP_REQUIRE").is_none(),
            "CHUNNEL_XDP_REQUIRE is set but the XDP program was not built (is clang installed?)"
        );
        eprintln!("skipping: the XDP program was not built (is clang installed?)");
        return Ok(());
    }
    let ns = netns()?;
    let (ready_tx, ready_rx) = std_mpsc::sync_channel(1);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let server = in_netns(&ns.b, move || async move {
        let local: SocketAddrV4 = SERVER.parse()?;
        let xdp = AfXdpUdp::new(Config::new("xb", local));
        xdp.check_available()?;
        let listener = xdp.listen().await?;
        ready_tx.send(listener.attach_mode())?;
        let listener = echo(listener, stop_rx).await;
        Ok((listener.counters()?, listener.stats()))
    });
    let mode = match ready_rx.recv_timeout(Duration::from_secs(20)) {
        Ok(m) => m,
        Err(_) => {
            let r = server.join().expect("server thread panicked");
            bail!("server did not start: {:?}", r.err());
        }
    };
    eprintln!("XDP program attached in {mode} mode");

    let rounds = 1200;
    let bursts = 20;
    let client = in_netns(&ns.a, move || udp_client(rounds, bursts));
    let echoed = client.join().expect("client thread panicked");
    let _ = stop_tx.send(());
    let (counters, stats) = server.join().expect("server thread panicked")?;
    let echoed = echoed?;
    eprintln!("echoed {echoed}; XDP counters {counters:?}; datapath {stats:?}");
    let total = rounds + bursts * 32;
    ensure!(echoed == total, "echoed {echoed} of {total}");
    // The program's own counters: every request went through the AF_XDP socket...
    ensure!(
        counters.redirected >= total as u64,
        "redirected {} < {total} messages",
        counters.redirected
    );
    ensure!(
        stats.delivered >= total as u64,
        "delivered {}",
        stats.delivered
    );
    // ...and the kernel still got what was not ours (at least the ARP exchange that let the
    // client find the server's MAC address without a static neighbour entry).
    ensure!(counters.passed >= 1, "nothing was passed to the kernel");
    ensure!(
        counters.rx_total == counters.redirected + counters.passed + counters.no_socket,
        "counters do not add up: {counters:?}"
    );
    Ok(())
}

#[test]
fn select_falls_back_to_kernel_udp_without_the_program() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let ns = netns()?;
    let (ready_tx, ready_rx) = std_mpsc::sync_channel(1);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let server = in_netns(&ns.b, move || async move {
        let local: SocketAddrV4 = SERVER.parse()?;
        let mut cfg = Config::new("xb", local);
        cfg.bpf_object = Some("/nonexistent/xdp_udp_steer.o".into());
        let xdp = AfXdpUdp::new(cfg);
        let why = xdp.check_available().unwrap_err();
        ensure!(
            matches!(&why, Error::NotAvailable { reason, .. } if reason.contains("does not exist")),
            "unexpected: {why}"
        );
        let stack = select(xdp, udp::Bind::new(local.into()));
        let listener = stack.listen().await?;
        ready_tx.send(listener.side())?;
        echo(listener, stop_rx).await;
        Ok(())
    });
    let side = ready_rx
        .recv_timeout(Duration::from_secs(20))
        .context("server did not start")?;
    ensure!(
        side == Side::Right,
        "picked {side:?}, expected the kernel UDP fallback"
    );
    let echoed = in_netns(&ns.a, || udp_client(300, 5))
        .join()
        .expect("client thread panicked");
    let _ = stop_tx.send(());
    server.join().expect("server thread panicked")?;
    ensure!(echoed? == 300 + 5 * 32);
    Ok(())
}

/// The program passes the availability check but cannot be attached (the queue and the
/// interface are taken by another AF_XDP listener): `listen` falls back at bind time.
#[test]
fn select_falls_back_when_attach_fails() -> Result<()> {
    if !privileged() || !chunnel_xdp::embedded_program_available() {
        return Ok(());
    }
    let ns = netns()?;
    let r = in_netns(&ns.b, move || async move {
        let first = AfXdpUdp::new(Config::new("xb", "10.79.0.2:7001".parse()?))
            .listen()
            .await?;
        let local: SocketAddrV4 = SERVER.parse()?;
        let xdp = AfXdpUdp::new(Config::new("xb", local));
        xdp.check_available()?;
        let t = std::time::Instant::now();
        match xdp.listen().await {
            Err(Error::NotAvailable { reason, .. }) => {
                eprintln!("second listener: {reason} (after {:?})", t.elapsed())
            }
            other => bail!("expected NotAvailable, got {other:?}"),
        }
        let stack = select(xdp, udp::Bind::new(local.into()));
        stack.available()?;
        let second = stack.listen().await?;
        drop(first);
        Ok(second.side())
    })
    .join()
    .expect("thread panicked")?;
    ensure!(r == Side::Right, "picked {r:?}");
    Ok(())
}

#[test]
fn missing_program_is_not_available() {
    if chunnel_xdp::embedded_program_available() {
        return;
    }
    // Built without clang (or with CHUNNEL_XDP_NO_BPF): the reason names the build problem.
    let xdp = AfXdpUdp::new(Config::new("lo", "127.0.0.1:9".parse().unwrap()));
    match xdp.check_available() {
        Err(Error::NotAvailable { reason, .. }) => {
            eprintln!("reason: {reason}");
            assert!(reason.contains("not built"), "{reason}");
        }
        other => panic!("expected NotAvailable, got {other:?}"),
    }
}

#[test]
fn unknown_interface_is_not_available() {
    let xdp = AfXdpUdp::new(Config::new("nosuchif0", "10.0.0.1:9".parse().unwrap()));
    match xdp.check_available() {
        Err(Error::NotAvailable { chunnel, reason }) => {
            assert_eq!(chunnel, chunnel_xdp::ID);
            eprintln!("reason: {reason}");
        }
        other => panic!("expected NotAvailable, got {other:?}"),
    }
}

/// The listener's peer table is capped (`Config::max_peers`): with three connections held, a
/// datagram from a fourth source is dropped and counted, never given state.
#[test]
fn the_peer_table_is_capped() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    if !chunnel_xdp::embedded_program_available() {
        assert!(
            std::env::var_os("CHUNNEL_XDP_REQUIRE").is_none(),
            "CHUNNEL_XDP_REQUIRE is set but the XDP program was not built (is clang installed?)"
        );
        eprintln!("skipping: the XDP program was not built (is clang installed?)");
        return Ok(());
    }
    const CAP: usize = 3;
    let ns = netns()?;
    let (ready_tx, ready_rx) = std_mpsc::sync_channel(1);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = in_netns(&ns.b, move || async move {
        let local: SocketAddrV4 = SERVER.parse()?;
        let mut cfg = Config::new("xb", local);
        cfg.max_peers = CAP;
        let mut listener = AfXdpUdp::new(cfg).listen().await?;
        ready_tx.send(())?;
        let mut held = Vec::new();
        for _ in 0..CAP {
            let c = chunnel::Listener::accept(&mut listener).await?;
            let m = c.recv_one().await?;
            c.send_one(m).await?;
            held.push(c);
        }
        // Accepting on (as a server does): the reader sorts the new sources' datagrams, and
        // the cap leaves none of them a connection to hand out.
        tokio::select! {
            c = chunnel::Listener::accept(&mut listener) => {
                bail!("a source past the cap got a connection: {c:?}")
            }
            _ = stop_rx => {}
        }
        Ok(listener.stats())
    });
    ready_rx
        .recv_timeout(Duration::from_secs(20))
        .context("server did not start")?;
    let client = in_netns(&ns.a, move || async move {
        let addr: SocketAddr = SERVER.parse()?;
        let mut echoed = Vec::new();
        let mut sockets = Vec::new();
        for i in 0..2 * CAP {
            let s = tokio::net::UdpSocket::bind("0.0.0.0:0").await?;
            let tries = if i < CAP { 3 } else { 1 };
            let mut got = false;
            for _ in 0..tries {
                s.send_to(&[i as u8], addr).await?;
                let mut buf = [0u8; 16];
                if let Ok(Ok((n, _))) =
                    tokio::time::timeout(Duration::from_millis(500), s.recv_from(&mut buf)).await
                {
                    got = n == 1 && buf[0] == i as u8;
                    break;
                }
            }
            echoed.push(got);
            sockets.push(s);
        }
        Ok(echoed)
    });
    let echoed = client.join().expect("client thread panicked")?;
    let _ = stop_tx.send(());
    let stats = server.join().expect("server thread panicked")?;
    eprintln!("echoed {echoed:?}; datapath {stats:?}");
    ensure!(
        echoed == [true, true, true, false, false, false],
        "{echoed:?}"
    );
    ensure!(stats.dropped_peer_cap == CAP as u64, "{stats:?}");
    Ok(())
}
