//! `chunnel-bench negotiate --flood N`: well-behaved negotiating clients during a flood of
//! hellos from distinct sources. The negotiating echo server (the real one, `listen_with`,
//! with the listener's peer cap `--flood-max-peers`) runs in this process on 127.0.0.1; a
//! thread of its own sends `N` well-formed `HELLO` datagrams (one each, from a distinct
//! (address, port) pair on 127.0.0.2..=127.0.0.9, with a conn_id fixed per source) that never
//! go on to send data; meanwhile `--flood-clients` clients, spread over the flood, each make
//! a fresh 1-RTT connection and one echo, and their connect + echo latencies are reported.
//!
//! The stack is twelve two-way selects of a pass-through layer with one exact capability
//! (`chunnel_test::kind::Kind`): identical offers are decided in microseconds (and then remembered), while
//! `--flood-slow` clients send offers that are compatible only after a long search (each
//! with a 0-RTT pick the server has not seen, so nothing remembered answers them): slow
//! decisions mixed into the flood.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use chunnel::{Chunnel, ConnectionExt, Offers};
use chunnel_negotiate::wire::{Hello, VERSION};
use chunnel_negotiate::{Client, Config, listen_with};
use chunnel_net::udp;
use serde_json::json;

use crate::harness::echo;
use crate::stats::quantile;

/// Source addresses of the flood: 127.0.0.2..=127.0.0.9.
const FLOOD_IPS: u8 = 8;
/// Source ports of the flood on each address (bound explicitly, so every source is new).
const FLOOD_PORTS: std::ops::Range<u16> = 10_000..61_000;
/// Flood sockets open at once.
const POOL: usize = 256;
/// Clients connecting at the same time.
const LANES: usize = 4;
/// A client that has not connected and echoed by then fails the run.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

use chunnel_test::kinds;

pub(crate) struct FloodArgs {
    pub(crate) hellos: usize,
    pub(crate) slow: usize,
    pub(crate) clients: usize,
    pub(crate) max_peers: Option<usize>,
    pub(crate) rate: u64,
    pub(crate) max_secs: u64,
    pub(crate) idle_ms: u64,
    pub(crate) size: usize,
}

/// The flood's source `i`: a distinct (address, port) pair for every `i`.
fn source(i: usize) -> SocketAddrV4 {
    let ip = Ipv4Addr::new(127, 0, 0, 2 + (i % FLOOD_IPS as usize) as u8);
    let port = FLOOD_PORTS.start + (i / FLOOD_IPS as usize) as u16;
    SocketAddrV4::new(ip, port)
}

/// Sends one hello from each of `n` distinct sources to `to`, at most `rate` a second, for
/// at most `max`: pools of `POOL` sockets, each bound to the next source, send and are
/// closed before the next pool opens. Returns (hellos sent, sources skipped as in use,
/// seconds).
fn flood(to: SocketAddr, n: usize, rate: u64, max: Duration) -> Result<(usize, usize, f64)> {
    let template = Hello {
        version: VERSION,
        conn_id: 0,
        offers: kinds!(0).offer_tree(),
        zero_rtt: None,
        early: Vec::new(),
        dictated: false,
    }
    .encode();
    let mut hello = template.to_vec();
    // Tag, version and flags come first, then the conn_id.
    const CONN_ID: std::ops::Range<usize> = 3..11;
    let capacity = FLOOD_IPS as usize * FLOOD_PORTS.len();
    let t0 = Instant::now();
    let (mut sent, mut skipped, mut i) = (0, 0, 0);
    let mut pool = Vec::with_capacity(POOL);
    while sent < n && t0.elapsed() < max {
        ensure!(i < capacity, "out of flood sources after {sent} hellos");
        pool.clear();
        while pool.len() < POOL.min(n - sent) && i < capacity {
            let src = source(i);
            i += 1;
            match UdpSocket::bind(src) {
                Ok(s) => pool.push((s, i as u64)),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => skipped += 1,
                Err(e) => return Err(e).with_context(|| format!("binding flood source {src}")),
            }
        }
        for (s, id) in &pool {
            hello[CONN_ID].copy_from_slice(&id.to_be_bytes());
            s.send_to(&hello, to)?;
            sent += 1;
        }
        // Paced to `rate`.
        let due = Duration::from_secs_f64(sent as f64 / rate as f64);
        if let Some(wait) = due.checked_sub(t0.elapsed()) {
            std::thread::sleep(wait);
        }
    }
    Ok((sent, skipped, t0.elapsed().as_secs_f64()))
}

/// The negotiating echo server with a peer cap. Returns its address and a handle on its
/// listener's counters.
async fn server(
    idle: Duration,
    max_peers: Option<usize>,
) -> Result<(SocketAddr, udp::PeerCounter, usize)> {
    let mut cfg = udp::Config::default().with_idle_timeout((!idle.is_zero()).then_some(idle));
    if let Some(k) = max_peers {
        cfg = cfg.with_max_peers(k);
    }
    let cap = cfg.max_peers;
    let l = udp::Listener::bind_with("127.0.0.1:0".parse()?, cfg).await?;
    let addr = l.local_addr()?;
    let counter = l.peer_counter();
    let serving = listen_with(kinds!(0), l, Config::default(), |r| {
        if let Ok(conn) = r {
            tokio::spawn(echo(conn));
        }
    });
    // Served for the rest of the run.
    std::mem::forget(serving);
    Ok((addr, counter, cap))
}

/// One client: a fresh socket, 1-RTT connect, one echo; microseconds.
async fn client(addr: SocketAddr, msg: Bytes) -> Result<f64> {
    let t = Instant::now();
    let base = udp::Connect::new(addr).connect_wrap(()).await?;
    let c = Client::new(Config::default())
        .connect(&addr.to_string(), kinds!(0), base)
        .await?;
    c.send_one(msg.clone()).await?;
    let r = c.recv_one().await?;
    ensure!(r.len() == msg.len(), "echo of {} bytes", r.len());
    Ok(t.elapsed().as_secs_f64() * 1e6)
}

/// One slow-deciding client, until `stop`: from a fresh socket each time, a hello the server
/// must search long for (offers of base 1, and a 0-RTT pick of no option, another each
/// time, so nothing remembered answers it), then its answer (waited for at most 5 s).
/// Returns the answers' latencies (µs) and the hellos left unanswered.
async fn slow_client(
    addr: SocketAddr,
    lane: u64,
    stop: Arc<AtomicBool>,
) -> Result<(Vec<f64>, usize)> {
    let offers = kinds!(1).offer_tree();
    let (mut us, mut unanswered) = (Vec::new(), 0);
    let mut buf = vec![0u8; 65_536];
    let mut k: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        k += 1;
        // 13 branches or more for 12 selects: no option. The rest spell (lane, k) in bits.
        let id = lane << 32 | k;
        let mut pick = vec![0u8; 13];
        pick.extend((0..48).map(|i| ((id >> i) & 1) as u8));
        let hello = Hello {
            version: VERSION,
            conn_id: id,
            offers: offers.clone(),
            zero_rtt: Some(chunnel::Pick::from_slice(&pick)),
            early: Vec::new(),
            dictated: false,
        }
        .encode();
        let s = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
        let t = Instant::now();
        s.send_to(&hello, addr).await?;
        match tokio::time::timeout(Duration::from_secs(5), s.recv_from(&mut buf)).await {
            Ok(Ok(_)) => us.push(t.elapsed().as_secs_f64() * 1e6),
            _ => unanswered += 1,
        }
    }
    Ok((us, unanswered))
}

/// The kernel's count of UDP datagrams dropped for a full receive buffer (all sockets of
/// the host: `RcvbufErrors` in /proc/net/snmp).
fn udp_rcvbuf_errors() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/net/snmp").ok()?;
    let mut udp = s.lines().filter(|l| l.starts_with("Udp:"));
    let (names, values) = (udp.next()?, udp.next()?);
    let i = names.split_whitespace().position(|n| n == "RcvbufErrors")?;
    values.split_whitespace().nth(i)?.parse().ok()
}

/// Peak resident set size of this process (the server's), in kB.
fn peak_rss_kb() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

pub(crate) fn run(a: FloodArgs) -> Result<()> {
    ensure!(a.rate > 0, "--flood-rate must be positive");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let started = Instant::now();
    let drops_before = udp_rcvbuf_errors();
    let out = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(a.max_secs + 120), measure(&a))
            .await
            .context("negotiate flood benchmark stalled")?
    })?;
    let (flood_sent, skipped, flood_secs, mut us, peak, stats, cap, mut slow, slow_lost) = out;
    slow.sort_by(f64::total_cmp);
    us.sort_by(f64::total_cmp);
    let connected = us.len();
    let rss = peak_rss_kb();
    let q = |p: f64| {
        if us.is_empty() {
            f64::NAN
        } else {
            quantile(&us, p)
        }
    };
    let out = json!({
        "bench": "negotiate_flood",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "what": "1-RTT connect + one echo per client, loopback UDP, during a flood of well-formed \
                 HELLOs from distinct sources (127.0.0.2..=127.0.0.9) that never send data",
        "flood_kind": "hello",
        "flood_hellos": flood_sent,
        "flood_sources_skipped_in_use": skipped,
        "flood_secs": flood_secs,
        "flood_rate_limit": a.rate,
        "clients": a.clients,
        "clients_connected": connected,
        "connect_p50_us": q(0.5),
        "connect_p99_us": q(0.99),
        "connect_max_us": us.last().copied().unwrap_or(f64::NAN),
        "slow_clients": a.slow,
        "slow_answers": slow.len(),
        "slow_unanswered": slow_lost,
        "slow_answer_p50_us": if slow.is_empty() { f64::NAN } else { quantile(&slow, 0.5) },
        "kernel_udp_rcvbuf_drops": udp_rcvbuf_errors()
            .zip(drops_before)
            .map(|(a, b)| a.saturating_sub(b)),
        "server_peak_rss_kb": rss,
        "server_peak_peers": peak,
        "server_idle_ms": a.idle_ms,
        "peer_cap_stats": [stats.0, stats.1],
        "max_peers": cap,
        "wall_seconds": started.elapsed().as_secs_f64(),
    });
    println!("{out}");
    ensure!(
        connected == a.clients,
        "only {connected} of {} clients connected during the flood",
        a.clients
    );
    Ok(())
}

type Measured = (
    usize,
    usize,
    f64,
    Vec<f64>,
    usize,
    (u64, u64),
    usize,
    Vec<f64>,
    usize,
);

async fn measure(a: &FloodArgs) -> Result<Measured> {
    let (addr, counter, cap) = server(Duration::from_millis(a.idle_ms), a.max_peers).await?;
    let msg = Bytes::from(vec![7u8; a.size]);
    // Warm-up: the server answers before the flood starts.
    client(addr, msg.clone()).await?;

    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (stop, counter) = (stop.clone(), counter.clone());
        tokio::spawn(async move {
            let mut peak = 0;
            while !stop.load(Ordering::Relaxed) {
                peak = peak.max(counter.count());
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            peak.max(counter.count())
        })
    };
    let slow_stop = Arc::new(AtomicBool::new(false));
    let slow: Vec<_> = (0..a.slow as u64)
        .map(|lane| tokio::spawn(slow_client(addr, lane, slow_stop.clone())))
        .collect();
    let (n, rate, max) = (a.hellos, a.rate, Duration::from_secs(a.max_secs));
    let flooding = std::thread::Builder::new()
        .name("flood".into())
        .spawn(move || flood(addr, n, rate, max))?;

    // Clients spread over the flood's expected length, `LANES` at a time.
    let expected =
        Duration::from_secs_f64((a.hellos as f64 / a.rate as f64).min(a.max_secs as f64));
    let gap = expected / a.clients.max(1) as u32 * LANES as u32;
    let per_lane = a.clients.div_ceil(LANES);
    let mut lanes = Vec::new();
    for lane in 0..LANES {
        let count = per_lane.min(a.clients.saturating_sub(lane * per_lane));
        let msg = msg.clone();
        lanes.push(tokio::spawn(async move {
            let mut us = Vec::with_capacity(count);
            let t0 = tokio::time::Instant::now() + gap * lane as u32 / LANES as u32;
            for k in 0..count {
                tokio::time::sleep_until(t0 + gap * k as u32).await;
                match tokio::time::timeout(CLIENT_TIMEOUT, client(addr, msg.clone())).await {
                    Ok(Ok(t)) => us.push(t),
                    Ok(Err(e)) => eprintln!("client failed: {e:#}"),
                    Err(_) => eprintln!("client did not connect within {CLIENT_TIMEOUT:?}"),
                }
            }
            us
        }));
    }
    let mut us = Vec::with_capacity(a.clients);
    for l in lanes {
        us.extend(l.await?);
    }
    let (sent, skipped, secs) = match tokio::task::spawn_blocking(move || flooding.join()).await? {
        Ok(r) => r?,
        Err(_) => bail!("flood thread panicked"),
    };
    slow_stop.store(true, Ordering::Relaxed);
    let (mut slow_us, mut slow_lost) = (Vec::new(), 0);
    for c in slow {
        let (us, lost) = c.await??;
        slow_us.extend(us);
        slow_lost += lost;
    }
    // Whatever loopback still holds is read before the counters are looked at.
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Relaxed);
    let peak = sampler.await?;
    eprintln!(
        "flood: {sent} hellos in {secs:.2} s; {} of {} clients connected; peak peers {peak} (cap {cap}); peer cap stats {:?}",
        us.len(),
        a.clients,
        counter.peer_cap_stats()
    );
    if a.slow > 0 {
        eprintln!(
            "slow-deciding clients: {} answers, {slow_lost} unanswered",
            slow_us.len()
        );
    }
    Ok((
        sent,
        skipped,
        secs,
        us,
        peak,
        counter.peer_cap_stats(),
        cap,
        slow_us,
        slow_lost,
    ))
}
