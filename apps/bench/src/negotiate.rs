//! `chunnel-bench negotiate`: connection set-up cost on loopback — a fresh client socket,
//! connect, and the first echo of one message — for a raw UDP exchange, 1-RTT negotiation
//! and 0-RTT reconnect. Client and server share one pinned core and one current-thread
//! runtime (as in `overhead`), so the figures are CPU cost plus kernel loopback, without
//! cross-core wake-ups.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use bytes::Bytes;
use chunnel::{Chunnel, ConnectionExt, Identity, Noop, select};
use chunnel_negotiate::{Client, Config, ZeroRtt, listen, listen_with};
use chunnel_net::udp;
use serde_json::json;

use crate::harness::echo;
use crate::stats::{quantile, spread};

#[derive(clap::Args, Clone)]
pub(crate) struct Args {
    /// Repetitions (each measures every variant, interleaved).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Connections per variant per repetition.
    #[arg(long, default_value_t = 2000)]
    conns: usize,
    /// Payload of the first message.
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// CPU to pin to; negative to leave unpinned.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    cpu: i64,
    /// Run the servers on their own thread and runtime pinned to this CPU (as separate
    /// processes would be); without it, client and servers share one core and one
    /// runtime, so every figure is the whole CPU cost of a connection.
    #[arg(long)]
    server_cpu: Option<usize>,
    /// Idle timeout of the negotiating server's connections, in ms. Every connection a run
    /// makes stays on the server (a UDP client leaves without a word) until then: with the
    /// default, all of them, so the server's state grows for the whole run.
    #[arg(long, default_value_t = 2000)]
    idle_ms: u64,
    /// Before measuring, run connections of every variant for this long (ms). Longer than
    /// `--idle-ms`, the server is measured in steady state: as many connections expire as
    /// start, and their teardown runs alongside. Default: a short warm-up only.
    #[arg(long, default_value_t = 0)]
    warmup_ms: u64,
    /// The negotiating echo server takes its connections from `NegotiatedListener::accept` in
    /// a loop of its own (`listen`), instead of from `listen_with`'s callback (the default:
    /// no queue and no accept task between the handshake and the echo task it spawns).
    #[arg(long)]
    accept_loop: bool,
    /// Profiling aid: after the warm-up, run only `--profile-conns` connections of this
    /// variant (raw_udp, one_rtt, zero_rtt) and exit (no JSON). For `strace` / `perf` /
    /// callgrind on one path.
    #[arg(long, hide = true)]
    profile: Option<String>,
    /// Connections to run with `--profile`.
    #[arg(long, hide = true, default_value_t = 1000)]
    profile_conns: usize,
    /// Flood mode: send this many well-formed hellos, each from a distinct source (address,
    /// port) on 127.0.0.2..=127.0.0.9, while `--flood-clients` clients connect and echo once
    /// each; reports their latencies (`"bench": "negotiate_flood"`). 0: off. Ignores
    /// `--reps`, `--conns`, `--cpu`, `--server-cpu`, `--warmup-ms` and `--accept-loop`.
    #[arg(long, default_value_t = 0)]
    flood: usize,
    /// Flood mode: well-behaved clients (1-RTT connect + one echo each) during the flood.
    #[arg(long, default_value_t = 1000)]
    flood_clients: usize,
    /// Flood mode: slow-deciding clients during the flood, each sending, one after the
    /// other, hellos the server must search tens of milliseconds for (see
    /// `negotiate_flood.rs`).
    #[arg(long, default_value_t = 0)]
    flood_slow: usize,
    /// Flood mode: the listener's peer cap (`Config::max_peers`); default: the listener's.
    #[arg(long)]
    flood_max_peers: Option<usize>,
    /// Flood mode: hellos per second at most.
    #[arg(long, default_value_t = 10_000)]
    flood_rate: u64,
    /// Flood mode: the flood stops after this many seconds, sent or not.
    #[arg(long, default_value_t = 20)]
    flood_secs: u64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    Raw,
    OneRtt,
    ZeroRtt,
    RawEager,
}

const VARIANTS: [Variant; 4] = [
    Variant::Raw,
    Variant::OneRtt,
    Variant::ZeroRtt,
    Variant::RawEager,
];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Raw => "raw_udp",
            Variant::OneRtt => "one_rtt",
            Variant::ZeroRtt => "zero_rtt",
            Variant::RawEager => "raw_udp_eager",
        }
    }
}

/// The stack both ends use: a select, so there is something to negotiate.
pub(crate) fn stack() -> chunnel::Select<Noop, Identity> {
    select(Noop, Identity)
}

pub(crate) fn run(a: Args) -> Result<()> {
    if a.flood > 0 {
        return crate::negotiate_flood::run(crate::negotiate_flood::FloodArgs {
            hellos: a.flood,
            slow: a.flood_slow,
            clients: a.flood_clients,
            max_peers: a.flood_max_peers,
            rate: a.flood_rate,
            max_secs: a.flood_secs,
            idle_ms: a.idle_ms,
            size: a.size,
        });
    }
    if a.cpu >= 0 {
        crate::pin_to(a.cpu as usize)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let started = Instant::now();
    let (p50s, p99s) = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(600), measure_all(&a))
            .await
            .context("negotiate benchmark stalled")?
    })?;
    let wall = started.elapsed();

    // Ratios per repetition (same repetition = measured close in time) against raw (or
    // another base variant).
    let ratio_to = |xs: &[Vec<f64>], i: usize, base: usize| -> Vec<f64> {
        xs[i].iter().zip(&xs[base]).map(|(x, r)| x / r).collect()
    };
    let ratio = |xs: &[Vec<f64>], i: usize| ratio_to(xs, i, 0);
    let eager = VARIANTS.len() - 1;
    let mut variants = serde_json::Map::new();
    for (i, v) in VARIANTS.iter().enumerate() {
        variants.insert(
            v.name().into(),
            json!({
                "p50_us": spread(&p50s[i]),
                "p99_us": spread(&p99s[i]),
                "p50_ratio_vs_raw": spread(&ratio(&p50s, i)),
                "p99_ratio_vs_raw": spread(&ratio(&p99s, i)),
                "p50_ratio_vs_raw_eager": spread(&ratio_to(&p50s, i, eager)),
            }),
        );
    }
    let med = |i: usize, base: usize| {
        let mut r = ratio_to(&p50s, i, base);
        r.sort_by(f64::total_cmp);
        crate::stats::median(&r)
    };
    let (one, zero) = (med(1, 0), med(2, 0));
    let out = json!({
        "bench": "negotiate",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "what": "fresh client socket + connect + first echo of one message, loopback UDP",
        "cpu": a.cpu,
        "server_cpu": a.server_cpu,
        "server_idle_ms": a.idle_ms,
        "warmup_ms": a.warmup_ms,
        "server_accept": if a.accept_loop { "listen + accept loop" } else { "listen_with" },
        "reps": a.reps,
        "conns_per_rep": a.conns,
        "size": a.size,
        "wall_seconds": wall.as_secs_f64(),
        "variants": variants,
        "checks": {
            "one_rtt_p50_ratio": one,
            "one_rtt_within_2_2x": one <= 2.2,
            "zero_rtt_p50_ratio": zero,
            "zero_rtt_within_1_2x": zero <= 1.2,
            // Against a raw exchange with chunnel-net's system-call savings (no explicit
            // bind; the first send before the runtime reports the fresh socket writable): not
            // the bar, reported alongside.
            "one_rtt_p50_ratio_vs_raw_eager": med(1, eager),
            "zero_rtt_p50_ratio_vs_raw_eager": med(2, eager),
        },
    });
    println!("{out}");
    Ok(())
}

type PerVariant = Vec<Vec<f64>>;

/// Starts both echo servers: on this runtime, or on a thread of their own pinned to
/// `server_cpu`. Returns (raw address, negotiating address).
async fn start_servers(
    server_cpu: Option<usize>,
    idle: Duration,
    accept_loop: bool,
) -> Result<(SocketAddr, SocketAddr)> {
    let Some(cpu) = server_cpu else {
        return servers(idle, accept_loop).await;
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("servers".into())
        .spawn(move || {
            let run = || -> Result<()> {
                crate::pin_to(cpu)?;
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async {
                    let addrs = servers(idle, accept_loop).await;
                    let _ = tx.send(addrs);
                    std::future::pending::<()>().await;
                });
                Ok(())
            };
            if let Err(e) = run() {
                eprintln!("server thread: {e:#}");
            }
        })?;
    rx.await.context("server thread failed to start")?
}

async fn servers(idle: Duration, accept_loop: bool) -> Result<(SocketAddr, SocketAddr)> {
    // Servers: a raw echo socket, and a negotiating echo server.
    let raw = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
    let raw_addr = raw.local_addr()?;
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok((n, from)) = raw.recv_from(&mut buf).await {
            let _ = raw.send_to(&buf[..n], from).await;
        }
    });
    let cfg = udp::Config::default().with_idle_timeout((!idle.is_zero()).then_some(idle));
    let l = udp::Listener::bind_with("127.0.0.1:0".parse()?, cfg).await?;
    let addr = l.local_addr()?;
    if accept_loop {
        let mut server = listen(stack(), l, Config::default());
        tokio::spawn(async move {
            while let Ok(conn) = server.accept().await {
                tokio::spawn(echo(conn));
            }
        });
    } else {
        let serving = listen_with(stack(), l, Config::default(), |r| {
            if let Ok(conn) = r {
                tokio::spawn(echo(conn));
            }
        });
        // Served for the rest of the run.
        std::mem::forget(serving);
    }
    Ok((raw_addr, addr))
}

async fn measure_all(a: &Args) -> Result<(PerVariant, PerVariant)> {
    let (raw_addr, addr) = start_servers(
        a.server_cpu,
        Duration::from_millis(a.idle_ms),
        a.accept_loop,
    )
    .await?;
    let client = Client::new(Config::default());
    let key = addr.to_string();
    let msg = Bytes::from(vec![7u8; a.size]);
    // Warm up every path (and teach the client a pick for 0-RTT).
    for v in VARIANTS {
        for _ in 0..50 {
            one(v, &client, &key, raw_addr, addr, &msg).await?;
        }
    }
    ensure!(client.remembered(&key).is_some(), "no pick remembered");
    let until = Instant::now() + Duration::from_millis(a.warmup_ms);
    while Instant::now() < until {
        for v in VARIANTS {
            one(v, &client, &key, raw_addr, addr, &msg).await?;
        }
    }
    if let Some(name) = &a.profile {
        let v = VARIANTS
            .into_iter()
            .find(|v| v.name() == name)
            .with_context(|| format!("--profile: no variant {name:?}"))?;
        for _ in 0..a.profile_conns {
            one(v, &client, &key, raw_addr, addr, &msg).await?;
        }
        std::process::exit(0);
    }

    let mut p50s: PerVariant = vec![Vec::new(); VARIANTS.len()];
    let mut p99s: PerVariant = vec![Vec::new(); VARIANTS.len()];
    for rep in 0..a.reps {
        for (i, v) in VARIANTS.iter().enumerate() {
            let mut us = Vec::with_capacity(a.conns);
            for _ in 0..a.conns {
                us.push(one(*v, &client, &key, raw_addr, addr, &msg).await?);
            }
            us.sort_by(f64::total_cmp);
            let (p50, p99) = (quantile(&us, 0.5), quantile(&us, 0.99));
            eprintln!(
                "rep {rep} {:>8}: connect + first echo p50 {p50:>6.1} us  p99 {p99:>6.1} us",
                v.name()
            );
            p50s[i].push(p50);
            p99s[i].push(p99);
        }
    }
    Ok((p50s, p99s))
}

/// One connection set-up plus first echo, in microseconds. Each variant reads the clock
/// before its socket or connection is dropped: tearing down (closing a socket, a negotiated
/// connection's CLOSE) is not part of the figure.
async fn one(
    v: Variant,
    client: &Client,
    key: &str,
    raw_addr: SocketAddr,
    addr: SocketAddr,
    msg: &Bytes,
) -> Result<f64> {
    let t = Instant::now();
    let elapsed = match v {
        Variant::Raw => {
            let s = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
            s.connect(raw_addr).await?;
            s.send(msg).await?;
            let mut buf = [0u8; 2048];
            let n = s.recv(&mut buf).await?;
            ensure!(n == msg.len(), "raw echo of {n} bytes");
            t.elapsed()
        }
        Variant::RawEager => {
            // The tightest raw exchange we know, with both of chunnel-net's system-call
            // savings: the socket is bound by its connect (no explicit bind), and the first
            // datagram leaves before the runtime knows the socket, instead of after the
            // event-loop turn that reports it writable.
            let s = connected_udp(raw_addr)?;
            s.send(msg)?;
            let s = tokio::net::UdpSocket::from_std(s)?;
            let mut buf = [0u8; 2048];
            let n = s.recv(&mut buf).await?;
            ensure!(n == msg.len(), "raw echo of {n} bytes");
            t.elapsed()
        }
        Variant::OneRtt => {
            let base = udp::Connect::new(addr).connect_wrap(()).await?;
            let t1 = t.elapsed();
            let c = client.connect(key, stack(), base).await?;
            let t2 = t.elapsed();
            c.send_one(msg.clone()).await?;
            let r = c.recv_one().await?;
            if std::env::var_os("PHASES").is_some() {
                eprintln!(
                    "base {t1:?} connect {t2:?} echo {:?} hellos {}",
                    t.elapsed(),
                    c.info().hellos_sent
                );
            }
            ensure!(r.len() == msg.len(), "echo of {} bytes", r.len());
            t.elapsed()
        }
        Variant::ZeroRtt => {
            let base = udp::Connect::new(addr).connect_wrap(()).await?;
            let c = client
                .connect_0rtt(key, stack(), base, [msg.clone()])
                .await?;
            let r = c.recv_one().await?;
            ensure!(r.len() == msg.len(), "echo of {} bytes", r.len());
            ensure!(c.info().zero_rtt == ZeroRtt::Accepted, "0-RTT not accepted");
            t.elapsed()
        }
    };
    Ok(elapsed.as_secs_f64() * 1e6)
}

/// A non-blocking UDP socket connected to `peer` without an explicit bind (`connect` binds
/// it), as `chunnel_net::udp::Connect` makes them.
fn connected_udp(peer: SocketAddr) -> Result<std::net::UdpSocket> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let SocketAddr::V4(v4) = peer else {
        anyhow::bail!("the raw exchange uses IPv4 loopback");
    };
    // SAFETY: plain system call; checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: `fd` is new and owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: v4.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*v4.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: `sin` is a valid sockaddr_in of the size passed.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&sin as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(std::net::UdpSocket::from(fd))
}
