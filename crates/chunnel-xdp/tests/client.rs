//! The AF_XDP client (`AfXdpConnect`) across two network namespaces joined by a single-queue
//! veth pair: against an AF_XDP server (both ends redirected, shown by the XDP programs'
//! counters at both ends) and a kernel UDP server; `select` falling back to kernel UDP at
//! either end; malformed frames; an unresolvable peer.
//!
//! Needs root and `ip`, and the XDP program (built when clang is installed); without them the
//! tests print why and pass without running, unless CHUNNEL_XDP_REQUIRE=1 is set. Each test
//! creates its own uniquely named namespaces and removes them in a Drop guard.

use std::collections::HashSet;
use std::net::SocketAddrV4;
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Error, Listen, Negotiate, Side, select};
use chunnel_net::udp;
use chunnel_xdp::{AfXdpConnect, AfXdpUdp, Config, Counters, Stats};
use tokio::sync::{Semaphore, oneshot};

mod support;

use support::{SERVER, echo, in_netns, netns, privileged, program_built};

fn server_addr() -> SocketAddrV4 {
    SERVER.parse().unwrap()
}

/// The client's configuration: interface `xa`, the route's source address, an ephemeral port.
fn client_cfg() -> Config {
    Config::new("xa", "0.0.0.0:0".parse().unwrap())
}

/// Messages in flight in [`concurrent_exchange`].
const WINDOW: usize = 32;

/// Message `k` of sender `s`: both numbers, then a body whose length and bytes depend on both.
fn payload(s: u32, k: u32) -> Bytes {
    let len = (k as usize * 37 + s as usize * 11) % 1400;
    let mut v = Vec::with_capacity(8 + len);
    v.extend_from_slice(&s.to_be_bytes());
    v.extend_from_slice(&k.to_be_bytes());
    v.extend((0..len).map(|i| (i as u32 ^ s.wrapping_mul(31) ^ k) as u8));
    v.into()
}

/// `senders` tasks share `conn`, each sending `per` messages in bursts of up to 4; one
/// receiver checks that every echo is intact and arrives once. Returns how many were echoed.
///
/// At most [`WINDOW`] messages are in flight: a kernel UDP end is best-effort too, and in a
/// fresh namespace its socket buffer (`net.core.rmem_max` caps it) and the queue of datagrams
/// waiting for ARP (101) hold about a hundred datagrams of this size.
async fn concurrent_exchange<C>(conn: Arc<C>, senders: u32, per: u32) -> Result<usize>
where
    C: ChunnelConnection<Data = Bytes> + Send + Sync + 'static,
{
    let window = Arc::new(Semaphore::new(WINDOW));
    let mut tasks = tokio::task::JoinSet::new();
    for s in 0..senders {
        let (conn, window) = (conn.clone(), window.clone());
        tasks.spawn(async move {
            let mut k = 0;
            while k < per {
                let n = (per - k).min(4);
                window.acquire_many(n).await?.forget();
                conn.send((k..k + n).map(|k| payload(s, k))).await?;
                k += n;
            }
            anyhow::Ok(())
        });
    }
    let total = (senders * per) as usize;
    let mut seen = HashSet::with_capacity(total);
    let mut slots = vec![None; 32];
    while seen.len() < total {
        let n = tokio::time::timeout(Duration::from_secs(5), conn.recv(&mut slots))
            .await
            .with_context(|| format!("echoed {} of {total}, then nothing for 5 s", seen.len()))??;
        for m in slots[..n].iter_mut().map(|m| m.take().unwrap()) {
            ensure!(m.len() >= 8, "a {}-byte echo", m.len());
            let s = u32::from_be_bytes(m[0..4].try_into()?);
            let k = u32::from_be_bytes(m[4..8].try_into()?);
            ensure!(s < senders && k < per, "an echo of no message ({s}, {k})");
            ensure!(m == payload(s, k), "echo of ({s}, {k}) corrupted");
            ensure!(seen.insert((s, k)), "({s}, {k}) echoed twice");
        }
        window.add_permits(n);
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(seen.len())
}

/// What a server run reports.
type ServerReport = Option<(Counters, Stats)>;

/// Starts `listener`'s echo in namespace `ns`; returns (ready, stop, join).
fn spawn_server<L, F, Fut>(
    ns: &str,
    make: F,
    report: fn(&L) -> Result<ServerReport>,
) -> Result<(
    oneshot::Sender<()>,
    std::thread::JoinHandle<Result<ServerReport>>,
)>
where
    L: chunnel::Listener + Send + 'static,
    L::Connection: ChunnelConnection<Data = Bytes> + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<L>>,
{
    let (ready_tx, ready_rx) = std_mpsc::sync_channel(1);
    let (stop_tx, stop_rx) = oneshot::channel();
    let server = in_netns(ns, move || async move {
        let listener = make().await?;
        ready_tx.send(())?;
        let listener = echo(listener, stop_rx).await;
        report(&listener)
    });
    if ready_rx.recv_timeout(Duration::from_secs(20)).is_err() {
        let r = server.join().expect("server thread panicked");
        bail!("server did not start: {:?}", r.err());
    }
    Ok((stop_tx, server))
}

fn xdp_report(l: &chunnel_xdp::Listener) -> Result<ServerReport> {
    Ok(Some((l.counters()?, l.stats())))
}

fn no_report<L>(_: &L) -> Result<ServerReport> {
    Ok(None)
}

/// Both ends on AF_XDP: several tasks send on one client connection; the XDP programs'
/// counters at both ends show every request and every echo went to an AF_XDP socket.
#[test]
fn af_xdp_client_af_xdp_server() -> Result<()> {
    if !privileged() || !program_built() {
        return Ok(());
    }
    let ns = netns()?;
    let (stop, server) = spawn_server(
        &ns.b,
        || async {
            Ok(AfXdpUdp::new(Config::new("xb", server_addr()))
                .listen()
                .await?)
        },
        xdp_report,
    )?;
    let (senders, per) = (4u32, 1500u32);
    let client = in_netns(&ns.a, move || async move {
        let conn = AfXdpConnect::new(client_cfg(), server_addr())
            .connect_wrap(())
            .await?;
        eprintln!(
            "client {} -> {} ({} mode)",
            conn.local_addr(),
            conn.peer_addr(),
            conn.attach_mode()
        );
        let conn = Arc::new(conn);
        let echoed = concurrent_exchange(conn.clone(), senders, per).await?;
        Ok((echoed, conn.counters()?, conn.stats()))
    })
    .join()
    .expect("client thread panicked");
    let _ = stop.send(());
    let (sc, ss) = server.join().expect("server thread panicked")?.unwrap();
    let (echoed, cc, cs) = client?;
    eprintln!("client: XDP {cc:?}, datapath {cs:?}\nserver: XDP {sc:?}, datapath {ss:?}");
    let total = (senders * per) as u64;
    ensure!(echoed as u64 == total);
    // Requests: redirected to the server's socket; echoes: redirected to the client's.
    ensure!(
        sc.redirected >= total,
        "server redirected {} < {total}",
        sc.redirected
    );
    ensure!(
        cc.redirected >= total,
        "client redirected {} < {total}",
        cc.redirected
    );
    ensure!(ss.delivered >= total && cs.delivered >= total);
    ensure!(cs.sent >= total && ss.sent >= total);
    ensure!(cs.malformed == 0 && ss.malformed == 0);
    for c in [cc, sc] {
        ensure!(
            c.rx_total == c.redirected + c.passed + c.no_socket,
            "counters do not add up: {c:?}"
        );
        ensure!(c.no_socket == 0, "{c:?}");
    }
    Ok(())
}

/// The AF_XDP client against a kernel UDP server (chunnel-net).
#[test]
fn af_xdp_client_kernel_udp_server() -> Result<()> {
    if !privileged() || !program_built() {
        return Ok(());
    }
    let ns = netns()?;
    let (stop, server) = spawn_server(
        &ns.b,
        || async { Ok(udp::Bind::new(SERVER.parse()?).listen().await?) },
        no_report,
    )?;
    let (senders, per) = (3u32, 1000u32);
    let client = in_netns(&ns.a, move || async move {
        let conn = Arc::new(
            AfXdpConnect::new(client_cfg(), server_addr())
                .connect_wrap(())
                .await?,
        );
        let echoed = concurrent_exchange(conn.clone(), senders, per).await?;
        Ok((echoed, conn.counters()?, conn.stats()))
    })
    .join()
    .expect("client thread panicked");
    let _ = stop.send(());
    server.join().expect("server thread panicked")?;
    let (echoed, cc, cs) = client?;
    eprintln!("client: XDP {cc:?}, datapath {cs:?}");
    let total = (senders * per) as u64;
    ensure!(echoed as u64 == total);
    ensure!(
        cc.redirected >= total,
        "client redirected {} < {total}",
        cc.redirected
    );
    ensure!(cs.malformed == 0, "{cs:?}");
    Ok(())
}

/// `select(AfXdpUdp, udp::Bind)` at the server and `select(AfXdpConnect, udp::Connect)` at
/// the client: AF_XDP cannot run at one end (first the server, then the client, both by a
/// missing program object), that end falls back to kernel UDP, the other stays on AF_XDP,
/// and messages flow.
#[test]
fn select_falls_back_at_either_end() -> Result<()> {
    if !privileged() || !program_built() {
        return Ok(());
    }
    let missing = || Some("/nonexistent/xdp_udp_steer.o".into());
    for xdp_server in [false, true] {
        let ns = netns()?;
        let (side_tx, side_rx) = std_mpsc::sync_channel(1);
        let (stop, server) = spawn_server(
            &ns.b,
            move || async move {
                let mut cfg = Config::new("xb", server_addr());
                if !xdp_server {
                    cfg.bpf_object = missing();
                }
                let l = select(AfXdpUdp::new(cfg), udp::Bind::new(SERVER.parse()?))
                    .listen()
                    .await?;
                side_tx.send(l.side())?;
                Ok(l)
            },
            no_report,
        )?;
        let client = in_netns(&ns.a, move || async move {
            let mut cfg = client_cfg();
            if xdp_server {
                cfg.bpf_object = missing();
            }
            let xdp = AfXdpConnect::new(cfg, server_addr());
            let why = xdp.check_available().err();
            let conn = select(xdp, udp::Connect::new(SERVER.parse()?))
                .connect_wrap(())
                .await?;
            let side = conn.side();
            let conn = Arc::new(conn);
            let echoed = concurrent_exchange(conn, 2, 300).await?;
            Ok((side, why, echoed))
        })
        .join()
        .expect("client thread panicked");
        let _ = stop.send(());
        server.join().expect("server thread panicked")?;
        let server_side = side_rx.recv()?;
        let (client_side, why, echoed) = client?;
        eprintln!("server {server_side:?}, client {client_side:?} ({why:?})");
        ensure!(echoed == 600);
        let (want_server, want_client) = if xdp_server {
            (Side::Left, Side::Right)
        } else {
            (Side::Right, Side::Left)
        };
        ensure!(server_side == want_server, "server picked {server_side:?}");
        ensure!(client_side == want_client, "client picked {client_side:?}");
        if xdp_server {
            ensure!(
                matches!(&why, Some(Error::NotAvailable { reason, .. }) if reason.contains("does not exist")),
                "{why:?}"
            );
        }
    }
    Ok(())
}

/// An XDP program already on the client's interface (here an AF_XDP listener's): the client
/// cannot attach its own, reports `NotAvailable` before trying, and the select connects over
/// kernel UDP to the AF_XDP server.
#[test]
fn client_select_falls_back_when_attach_would_fail() -> Result<()> {
    if !privileged() || !program_built() {
        return Ok(());
    }
    let ns = netns()?;
    let (stop, server) = spawn_server(
        &ns.b,
        || async {
            Ok(AfXdpUdp::new(Config::new("xb", server_addr()))
                .listen()
                .await?)
        },
        xdp_report,
    )?;
    let client = in_netns(&ns.a, move || async move {
        let _other = AfXdpUdp::new(Config::new("xa", "10.79.0.1:7001".parse()?))
            .listen()
            .await?;
        let mut xdp = AfXdpConnect::new(client_cfg(), server_addr());
        let why = xdp.check_available().err();
        ensure!(
            matches!(&why, Some(Error::NotAvailable { reason, .. }) if reason.contains("already attached")),
            "{why:?}"
        );
        match xdp.connect_wrap(()).await {
            Err(Error::NotAvailable { .. }) => {}
            other => bail!("expected NotAvailable, got {other:?}"),
        }
        let conn = select(xdp, udp::Connect::new(SERVER.parse()?))
            .connect_wrap(())
            .await?;
        ensure!(conn.side() == Side::Right, "picked {:?}", conn.side());
        concurrent_exchange(Arc::new(conn), 2, 300).await
    })
    .join()
    .expect("client thread panicked");
    let _ = stop.send(());
    let (sc, _) = server.join().expect("server thread panicked")?.unwrap();
    ensure!(client? == 600);
    ensure!(sc.redirected >= 600, "{sc:?}");
    Ok(())
}

/// Frames a kernel UDP client would never send, written onto the wire from the server's
/// namespace with a packet socket: the client counts and drops them, and goes on.
#[test]
fn malformed_frames_do_not_break_the_connection() -> Result<()> {
    if !privileged() || !program_built() {
        return Ok(());
    }
    let ns = netns()?;
    let (stop, server) = spawn_server(
        &ns.b,
        || async { Ok(udp::Bind::new(SERVER.parse()?).listen().await?) },
        no_report,
    )?;
    let (to_inject, injected) = std_mpsc::sync_channel::<(SocketAddrV4, [u8; 6], [u8; 6])>(1);
    let (done_tx, done_rx) = std_mpsc::sync_channel::<usize>(1);
    let injector = std::thread::spawn({
        let nsb = ns.b.clone();
        move || -> Result<()> {
            chunnel_test::netns::enter(&nsb)?;
            let (client, client_mac, server_mac) =
                injected.recv_timeout(Duration::from_secs(20))?;
            let frames = bad_frames(client, client_mac, server_mac);
            inject("xb", client_mac, &frames)?;
            done_tx.send(frames.len())?;
            Ok(())
        }
    });
    let client = in_netns(&ns.a, move || async move {
        let conn = Arc::new(
            AfXdpConnect::new(client_cfg(), server_addr())
                .connect_wrap(())
                .await?,
        );
        let before = concurrent_exchange(conn.clone(), 1, 100).await?;
        let (mac, server_mac) = conn.macs();
        to_inject.send((conn.local_addr(), mac, server_mac))?;
        let n = done_rx.recv_timeout(Duration::from_secs(20))?;
        // Let the client read them: a recv that finds only bad frames keeps waiting.
        let mut slots = vec![None; 8];
        let r = tokio::time::timeout(Duration::from_millis(300), conn.recv(&mut slots)).await;
        ensure!(r.is_err(), "a bad frame was delivered: {r:?}");
        let after = concurrent_exchange(conn.clone(), 2, 200).await?;
        Ok((before + after, n, conn.counters()?, conn.stats()))
    })
    .join()
    .expect("client thread panicked");
    let _ = stop.send(());
    server.join().expect("server thread panicked")?;
    injector.join().expect("injector panicked")?;
    let (echoed, bad, cc, cs) = client?;
    eprintln!("client: XDP {cc:?}, datapath {cs:?}");
    ensure!(echoed == 500);
    ensure!(bad == 4);
    // Three are not datagrams (bad IPv4 checksum, UDP length past the packet, a truncated
    // IPv4 header), one comes from a stranger; all four went to the AF_XDP socket.
    ensure!(cs.malformed == 3, "{cs:?}");
    ensure!(cs.dropped == 1, "{cs:?}");
    ensure!(cc.redirected >= 500 + 4, "{cc:?}");
    Ok(())
}

/// Ethernet + IPv4 + UDP to `to`, from the server's address (or `from_port`).
fn frame(to: SocketAddrV4, dst: [u8; 6], src: [u8; 6], from_port: u16, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[0x08, 0x00]);
    let total = (20 + 8 + body.len()) as u16;
    let mut ip = vec![0x45, 0, 0, 0, 0, 1, 0x40, 0, 64, 17, 0, 0, 10, 79, 0, 2];
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip.extend_from_slice(&to.ip().octets());
    let c = checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&from_port.to_be_bytes());
    f.extend_from_slice(&to.port().to_be_bytes());
    f.extend_from_slice(&((8 + body.len()) as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]); // no UDP checksum
    f.extend_from_slice(body);
    f
}

fn checksum(b: &[u8]) -> u16 {
    let mut s: u32 = b
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// Four frames the XDP program redirects to the client but the client must not deliver.
fn bad_frames(to: SocketAddrV4, dst: [u8; 6], src: [u8; 6]) -> Vec<Vec<u8>> {
    let port = server_addr().port();
    let mut bad_ip_sum = frame(to, dst, src, port, b"bad checksum");
    bad_ip_sum[14 + 10] ^= 0xff;
    let mut long_udp = frame(to, dst, src, port, b"short");
    long_udp[14 + 20 + 4..14 + 20 + 6].copy_from_slice(&400u16.to_be_bytes());
    // IPv4 total length shorter than its header and the UDP header: the program still sees a
    // whole UDP header in the frame, the parser refuses the packet.
    let mut short_total = frame(to, dst, src, port, b"truncated");
    short_total[14 + 2..14 + 4].copy_from_slice(&24u16.to_be_bytes());
    short_total[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
    let c = checksum(&short_total[14..34]);
    short_total[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
    let stranger = frame(to, dst, src, port + 1, b"from another port");
    vec![bad_ip_sum, long_udp, short_total, stranger]
}

/// Sends raw Ethernet frames out of `ifname` (in the calling thread's namespace).
fn inject(ifname: &str, dst: [u8; 6], frames: &[Vec<u8>]) -> Result<()> {
    let name = std::ffi::CString::new(ifname)?;
    // SAFETY: a valid C string.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    ensure!(ifindex != 0, "no interface {ifname}");
    // SAFETY: plain socket(2); closed below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    ensure!(
        fd >= 0,
        "AF_PACKET socket: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: sockaddr_ll is plain data.
    let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sa.sll_family = libc::AF_PACKET as u16;
    sa.sll_ifindex = ifindex as i32;
    sa.sll_halen = 6;
    sa.sll_addr[..6].copy_from_slice(&dst);
    let mut res = Ok(());
    for f in frames {
        // SAFETY: `f` and `sa` are valid for the lengths given.
        let r = unsafe {
            libc::sendto(
                fd,
                f.as_ptr().cast(),
                f.len(),
                0,
                (&raw const sa).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if r < 0 {
            res = Err(anyhow::anyhow!(
                "sendto: {}",
                std::io::Error::last_os_error()
            ));
            break;
        }
    }
    // SAFETY: our descriptor, closed once.
    unsafe { libc::close(fd) };
    res
}

/// A peer on the link that does not answer ARP: `connect_wrap` gives up after the resolve
/// timeout with a `HostUnreachable` error; a peer the interface does not route to (a local
/// address) is `NotAvailable`.
#[test]
fn unresolvable_or_unrouted_peers() -> Result<()> {
    if !privileged() || !program_built() {
        return Ok(());
    }
    let ns = netns()?;
    in_netns(&ns.a, || async {
        let t = std::time::Instant::now();
        let r = AfXdpConnect::new(client_cfg(), "10.79.0.9:7000".parse()?)
            .with_resolve_timeout(Duration::from_millis(300))
            .connect_wrap(())
            .await;
        match r {
            Err(Error::Io { source, .. })
                if source.kind() == std::io::ErrorKind::HostUnreachable =>
            {
                eprintln!("{source} (after {:?})", t.elapsed());
            }
            other => bail!("expected HostUnreachable, got {other:?}"),
        }
        ensure!(t.elapsed() < Duration::from_secs(2));
        let lo = AfXdpConnect::new(client_cfg(), "127.0.0.1:7000".parse()?);
        match lo.check_available() {
            Err(Error::NotAvailable { reason, .. }) if reason.contains("127.0.0.1") => {
                eprintln!("{reason}")
            }
            other => bail!("expected NotAvailable, got {other:?}"),
        }
        // The failed attempt left nothing attached: the client is available.
        AfXdpConnect::new(client_cfg(), server_addr()).check_available()?;
        Ok(())
    })
    .join()
    .expect("thread panicked")
}

/// The server goes away: its namespace's kernel answers the next request with an ICMP port
/// unreachable, and the client's `recv` reports `PeerClosed`, as a kernel UDP client's does.
#[test]
fn a_closed_server_port_is_peer_closed() -> Result<()> {
    if !privileged() || !program_built() {
        return Ok(());
    }
    let ns = netns()?;
    let (stop, server) = spawn_server(
        &ns.b,
        || async {
            Ok(AfXdpUdp::new(Config::new("xb", server_addr()))
                .listen()
                .await?)
        },
        xdp_report,
    )?;
    let (served_tx, served_rx) = std_mpsc::sync_channel::<()>(1);
    let (gone_tx, gone_rx) = std_mpsc::sync_channel::<()>(1);
    let client = in_netns(&ns.a, move || async move {
        let conn = Arc::new(
            AfXdpConnect::new(client_cfg(), server_addr())
                .connect_wrap(())
                .await?,
        );
        ensure!(concurrent_exchange(conn.clone(), 1, 50).await? == 50);
        served_tx.send(())?;
        gone_rx.recv_timeout(Duration::from_secs(20))?;
        conn.send([payload(0, 0)]).await?;
        let mut slots = vec![None; 4];
        match tokio::time::timeout(Duration::from_secs(2), conn.recv(&mut slots)).await {
            Ok(Err(Error::PeerClosed)) => Ok(()),
            other => bail!("expected PeerClosed, got {other:?}"),
        }
    });
    served_rx.recv_timeout(Duration::from_secs(30))?;
    let _ = stop.send(());
    // The listener, its connection and the program are dropped with the server's runtime.
    server.join().expect("server thread panicked")?;
    gone_tx.send(())?;
    client.join().expect("client thread panicked")
}
