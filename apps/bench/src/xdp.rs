//! The AF_XDP datapath of `chunnel-bench datapaths` (also runnable alone: `chunnel-bench
//! xdp`): echo round trips from a kernel UDP client to an AF_XDP server, through the library
//! vs a hand-written echo loop on the same socket code.
//!
//! Topology: two fresh network namespaces joined by a single-queue veth pair
//! (`chunnel_test::netns::VethPair`, as `crates/chunnel-xdp/tests/netns.rs`): `xa`
//! 10.79.0.1 in namespace A, `xb` 10.79.0.2 in namespace B, deleted at the end. The XDP
//! program passes ARP to the kernel, so no static neighbour entry is needed; replies carry a
//! computed UDP checksum, so the client's kernel accepts them.
//!
//! * Client (namespace A, CPU 0): the kernel UDP datapath's `raw_tokio` client loop
//!   (`datapaths::raw_tokio_client`): warm-up, `--msgs` timed 64 B round trips with one
//!   message in flight, then 64 B bursts of 32 for 300 ms, then an empty end message.
//! * `raw_af_xdp` (namespace B, CPU 1): `chunnel_xdp::raw::Socket` (the library's XSK socket
//!   and XDP program, no Chunnel / listener / tokio) in a loop: take up to 64 RX descriptors,
//!   copy out each payload (recycling the chunk to the fill ring), write the reply frame
//!   (swapped addresses and ports, IPv4 and UDP checksums) into TX chunks, one `sendto`
//!   kick; when the RX ring is empty, block in `poll(POLLIN)` on the socket.
//! * `af_xdp_lib` (namespace B, CPU 1): `chunnel_xdp::AfXdpUdp::listen` in a current-thread
//!   tokio runtime, `accept`, then the shared `echo_until_empty` loop.
//!
//! The two variants are interleaved per repetition. Each run loads the program afresh, so its
//! counters (redirected frames in particular) are that run's alone.
//!
//! If AF_XDP cannot run here (not root, no `ip`, the program not built, the kernel refusing),
//! the result is `{"skipped": reason}`, unless `CHUNNEL_XDP_REQUIRE` is set (as CI does):
//! then it is an error.

use std::net::{SocketAddr, SocketAddrV4};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail, ensure};
use chunnel::{Listen as _, Listener as _, Negotiate};
use chunnel_test::netns::{self, VethPair};
use chunnel_xdp::{AfXdpUdp, Config, Counters, raw};
use serde_json::{Value, json};

use crate::datapaths::{
    Sample, TPUT_SIZE, WARMUP, compare, echo_until_empty, merge, pair, raw_tokio_client,
    run_header, runtime, side_stats,
};
use crate::stats::spread;

const DEV_A: &str = "xa";
const DEV_B: &str = "xb";
const ADDR_A: &str = "10.79.0.1/24";
const ADDR_B: &str = "10.79.0.2/24";
const SERVER: &str = "10.79.0.2:7000";
/// A server that hears nothing for this long gives up.
const IDLE: Duration = Duration::from_secs(10);

#[derive(clap::Args, Clone)]
pub(crate) struct Args {
    /// Timed round trips per measurement.
    #[arg(long, default_value_t = 20_000)]
    msgs: usize,
    /// Repetitions (the two variants interleaved in each).
    #[arg(long, default_value_t = 5)]
    reps: usize,
}

/// `chunnel-bench xdp`: the AF_XDP datapath alone; one JSON line.
pub(crate) fn run(a: Args) -> Result<()> {
    ensure!(
        a.msgs >= 1 && a.reps >= 1,
        "need --msgs >= 1 and --reps >= 1"
    );
    let started = Instant::now();
    let af_xdp = measure(a.msgs, a.reps)?;
    let checks = json!({
        "af_xdp_lib_meets_bar": af_xdp["meets_bar"].as_bool(),
        "af_xdp_all_requests_redirected": af_xdp["all_requests_redirected"].as_bool(),
    });
    eprintln!("\nchecks: {checks}");
    let mut out = run_header("xdp", a.msgs, a.reps);
    merge(
        &mut out,
        json!({
            "bar": "library p50 within 10% of raw, or at most 1 us above raw when raw p50 < 10 us",
            "wall_seconds": started.elapsed().as_secs_f64(),
            "af_xdp": af_xdp,
            "checks": checks,
        }),
    );
    println!("{out}");
    Ok(())
}

/// Whether AF_XDP must be measured (CI): then "cannot run here" is an error.
fn required() -> bool {
    std::env::var_os("CHUNNEL_XDP_REQUIRE").is_some()
}

/// AF_XDP cannot run here: `{"skipped": why}`, or an error under `CHUNNEL_XDP_REQUIRE`.
fn skip(why: String) -> Result<Value> {
    if required() {
        bail!("CHUNNEL_XDP_REQUIRE is set but AF_XDP cannot be measured: {why}");
    }
    eprintln!("AF_XDP skipped: {why}");
    Ok(json!({ "skipped": why }))
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    Raw,
    Lib,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Raw => "raw_af_xdp",
            Variant::Lib => "af_xdp_lib",
        }
    }
}

/// What a server saw in one run.
#[derive(Clone, Copy, Debug, Default)]
struct Report {
    counters: Counters,
    attach_mode: &'static str,
    /// Datagrams echoed (raw) or delivered to connections (library).
    echoed: u64,
    /// Frames that were not a datagram for us (dropped).
    malformed: u64,
    tx_kicks: u64,
    /// The kernel's drop counts (rx_dropped, rx_ring_full, fill_ring_empty).
    kernel: (u64, u64, u64),
    /// The server thread's CPU time (user + system) from ready to the end message.
    cpu_ns: u64,
}

/// The calling thread's CPU time (user + system) in nanoseconds.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `ts`, which lives across the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The AF_XDP datapath's JSON (same schema as the others in `datapaths`), or `skipped`.
pub(crate) fn measure(msgs: usize, reps: usize) -> Result<Value> {
    if !netns::can_create() {
        return skip("not root, or `ip` (iproute2) is missing".into());
    }
    if !chunnel_xdp::embedded_program_available() {
        let why = AfXdpUdp::new(Config::new("lo", "127.0.0.1:9".parse()?))
            .check_available()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_else(|| "the XDP program was not built (is clang installed?)".into());
        return skip(why);
    }
    let ns = match VethPair::new("chbxdp", (DEV_A, DEV_B), (ADDR_A, ADDR_B)) {
        Ok(ns) => ns,
        Err(e) => return skip(format!("creating the namespaces: {e}")),
    };
    // The availability check where the server will run (interface, capabilities, AF_XDP).
    let nsb = ns.b.clone();
    let avail = std::thread::spawn(move || -> Result<std::result::Result<(), String>> {
        netns::enter(&nsb)?;
        Ok(AfXdpUdp::new(config()?)
            .check_available()
            .map_err(|e| e.to_string()))
    })
    .join()
    .map_err(|_| anyhow!("availability check panicked"))??;
    if let Err(why) = avail {
        return skip(why);
    }
    eprintln!(
        "AF_XDP: namespaces {} ({DEV_A} {ADDR_A}) / {} ({DEV_B} {ADDR_B}), server {SERVER}",
        ns.a, ns.b
    );

    let variants = [Variant::Raw, Variant::Lib];
    let mut res: Vec<Vec<(Sample, Report)>> = vec![Vec::new(); variants.len()];
    for rep in 0..reps {
        for (i, &v) in variants.iter().enumerate() {
            // A failure here (the program cannot be attached, no echo...) is reported like
            // an unavailable datapath: an error under CHUNNEL_XDP_REQUIRE, `skipped` otherwise.
            let (s, r) = match run_once(v, &ns, msgs) {
                Ok(x) => x,
                Err(e) => {
                    drop(ns);
                    return skip(format!("{} failed in repetition {rep}: {e:#}", v.name()));
                }
            };
            eprintln!(
                "rep {rep} af_xdp {:<10} 64 B: p50 {:>7.2} us  p99 {:>7.2} us  {:>9.0} msg/s  \
                 ({} mode; redirected {}, passed {}, echoed {}, kicks {}, server cpu {:.0} ns/echo)",
                v.name(),
                s.p50_us,
                s.p99_us,
                s.msgs_per_s,
                r.attach_mode,
                r.counters.redirected,
                r.counters.passed,
                r.echoed,
                r.tx_kicks,
                cpu_per_echo(&r),
            );
            res[i].push((s, r));
        }
    }
    drop(ns);

    let samples: Vec<Vec<Sample>> = res
        .iter()
        .map(|r| r.iter().map(|(s, _)| *s).collect())
        .collect();
    // Every timed and warm-up request, and the end message, went through the socket (the
    // throughput phase adds more).
    let expected = (WARMUP + msgs + 1) as u64;
    let all_redirected = res
        .iter()
        .flatten()
        .all(|(_, r)| r.counters.redirected >= expected);
    let side = |i: usize, what: &str| {
        let runs: Vec<Value> = res[i]
            .iter()
            .map(|(_, r)| {
                json!({
                    "attach_mode": r.attach_mode,
                    "xdp_rx_total": r.counters.rx_total,
                    "xdp_redirected": r.counters.redirected,
                    "xdp_passed": r.counters.passed,
                    "xdp_no_socket": r.counters.no_socket,
                    "echoed": r.echoed,
                    "malformed": r.malformed,
                    "tx_kicks": r.tx_kicks,
                    "kernel_rx_dropped": r.kernel.0,
                    "kernel_rx_ring_full": r.kernel.1,
                    "kernel_fill_ring_empty": r.kernel.2,
                    "server_cpu_ns_per_echo": cpu_per_echo(r),
                })
            })
            .collect();
        let mut v = side_stats(&samples[i], what);
        merge(
            &mut v,
            json!({
            "xdp_redirected": spread(&res[i].iter().map(|(_, r)| r.counters.redirected as f64).collect::<Vec<_>>()),
            "server_cpu_ns_per_echo": spread(&res[i].iter().map(|(_, r)| cpu_per_echo(r)).collect::<Vec<_>>()),
            "runs": runs,
            }),
        );
        v
    };
    let mut out = json!({
        "raw": side(0, "raw_af_xdp: chunnel_xdp::raw XSK socket + XDP program, hand-written \
                        echo loop, poll() wait, no Chunnel/listener/tokio"),
        "library": side(1, "af_xdp_lib: chunnel_xdp::AfXdpUdp listener + ServerConnection \
                            echo in a current-thread tokio runtime"),
        "client": "kernel UDP, the kernel_udp raw_tokio client loop, in namespace A",
        "topology": format!("two network namespaces, single-queue veth {DEV_A} ({ADDR_A}) - \
                             {DEV_B} ({ADDR_B}); server {SERVER}"),
        "min_redirected_per_run_expected": expected,
        "all_requests_redirected": all_redirected,
        "reps": reps,
    });
    merge(&mut out, compare(&samples[0], &samples[1]));
    Ok(out)
}

/// Server CPU time per echoed datagram over the whole run (round trips and bursts).
fn cpu_per_echo(r: &Report) -> f64 {
    r.cpu_ns as f64 / r.echoed.max(1) as f64
}

fn config() -> Result<Config> {
    let local: SocketAddrV4 = SERVER.parse()?;
    Ok(Config::new(DEV_B, local))
}

/// One run of `v`: server in namespace B, client in namespace A.
fn run_once(v: Variant, ns: &VethPair, msgs: usize) -> Result<(Sample, Report)> {
    let (report_tx, report_rx) = mpsc::sync_channel(1);
    let (nsa, nsb) = (ns.a.clone(), ns.b.clone());
    let client = move |addr: SocketAddr| {
        netns::enter(&nsa)?;
        raw_tokio_client(addr, msgs, TPUT_SIZE)
    };
    let sample = match v {
        Variant::Raw => pair(move |tx| raw_server(&nsb, tx, report_tx), client)?,
        Variant::Lib => pair(move |tx| lib_server(&nsb, tx, report_tx), client)?,
    };
    let report = report_rx
        .recv_timeout(Duration::from_secs(5))
        .map_err(|_| anyhow!("the server sent no report"))?;
    ensure!(
        report.counters.redirected > 0,
        "no frame went through the AF_XDP socket: {report:?}"
    );
    Ok((sample, report))
}

/// The hand-written echo: no Chunnel, listener or tokio; `poll()` when idle. Ends after
/// echoing an empty datagram.
fn raw_server(
    ns: &str,
    addr_tx: mpsc::SyncSender<SocketAddr>,
    report_tx: mpsc::SyncSender<Report>,
) -> Result<()> {
    netns::enter(ns)?;
    let cfg = config()?;
    let batch = cfg.batch.max(1);
    let mut sock = raw::Socket::open(&cfg)?;
    addr_tx.send(SERVER.parse()?)?;
    let cpu0 = thread_cpu_ns();
    let room = sock.frame_size() - raw::HEADERS;
    // Payloads of one RX batch, copied out so their chunks go straight back to the fill ring.
    let mut scratch: Vec<u8> = Vec::with_capacity(batch * sock.frame_size());
    let mut replies: Vec<(raw::Reply, std::ops::Range<usize>)> = Vec::with_capacity(batch);
    let (mut echoed, mut malformed, mut ip_id) = (0u64, 0u64, 0u16);
    let mut heard = Instant::now();
    let mut done = false;
    while !done {
        scratch.clear();
        replies.clear();
        let n = sock.recv_batch(batch, |f| match raw::parse_reply(f) {
            Some((r, range)) if range.len() <= room => {
                let at = scratch.len();
                scratch.extend_from_slice(&f[range]);
                replies.push((r, at..scratch.len()));
            }
            // Not a datagram for us, or too large to echo: drop it.
            _ => malformed += 1,
        });
        if sock.fill_needs_wakeup() {
            sock.kick_rx();
        }
        if n == 0 {
            let mut pfd = libc::pollfd {
                fd: sock.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call; the socket outlives it.
            let r = unsafe { libc::poll(&mut pfd, 1, 100) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                ensure!(e.kind() == std::io::ErrorKind::Interrupted, "poll: {e}");
            }
            ensure!(heard.elapsed() < IDLE, "no datagram for {IDLE:?}");
            continue;
        }
        heard = Instant::now();
        let mut sent = 0;
        let mut stuck = 0u32;
        while sent < replies.len() {
            let q = sock.send_batch(|buf| {
                let (r, range) = replies.get(sent)?;
                let len = raw::build_reply(buf, r, ip_id, &scratch[range.clone()])?;
                ip_id = ip_id.wrapping_add(1);
                sent += 1;
                Some(len)
            });
            sock.flush_tx();
            if q == 0 {
                // TX ring or pool full: let the kernel complete frames.
                stuck += 1;
                ensure!(stuck < 100_000, "TX ring stuck");
                std::thread::yield_now();
            }
        }
        echoed += replies.len() as u64;
        done = replies.iter().any(|(_, r)| r.is_empty());
    }
    let _ = report_tx.send(Report {
        counters: sock.counters()?,
        attach_mode: sock.attach_mode(),
        echoed,
        malformed,
        tx_kicks: sock.tx_kicks(),
        kernel: sock.kernel_stats().unwrap_or_default(),
        cpu_ns: thread_cpu_ns().saturating_sub(cpu0),
    });
    Ok(())
}

/// The library: `AfXdpUdp` listener, one accepted connection, the shared echo loop.
fn lib_server(
    ns: &str,
    addr_tx: mpsc::SyncSender<SocketAddr>,
    report_tx: mpsc::SyncSender<Report>,
) -> Result<()> {
    netns::enter(ns)?;
    runtime()?.block_on(async move {
        let mut listener = AfXdpUdp::new(config()?).listen().await?;
        addr_tx.send(SERVER.parse()?)?;
        let cpu0 = thread_cpu_ns();
        let conn = tokio::time::timeout(IDLE, listener.accept()).await??;
        echo_until_empty(&conn).await?;
        let cpu_ns = thread_cpu_ns().saturating_sub(cpu0);
        let stats = listener.stats();
        let _ = report_tx.send(Report {
            counters: listener.counters()?,
            attach_mode: listener.attach_mode(),
            echoed: stats.delivered,
            malformed: stats.malformed,
            tx_kicks: stats.tx_kicks,
            kernel: (
                stats.kernel_rx_dropped,
                stats.kernel_rx_ring_full,
                stats.kernel_fill_ring_empty,
            ),
            cpu_ns,
        });
        Ok(())
    })
}
