//! The AF_XDP datapath of `chunnel-bench datapaths` (also runnable alone: `chunnel-bench
//! xdp`): echo round trips from a kernel UDP client to an AF_XDP server, through the library
//! vs a hand-written echo loop on the same socket code; and AF_XDP at both ends, the library's
//! client and server vs a hand-written client loop against the hand-written echo.
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
//! * `raw_af_xdp_pair` (`both_ends` in the JSON): AF_XDP at both ends without the library.
//!   Client (namespace A, CPU 0): `chunnel_xdp::raw::client_path` (the library's route and
//!   neighbour lookup) and a `raw::Socket` on `xa` steering its port, the same round trips,
//!   bursts and end message as the kernel client, each frame built into a TX chunk, one
//!   `sendto` kick, `poll(POLLIN)` when the RX ring is empty; server: `raw_af_xdp`.
//! * `af_xdp_lib_pair`: `chunnel_xdp::AfXdpConnect` (the shared `ping` loop of the other
//!   datapaths, current-thread tokio) against the `af_xdp_lib` server.
//!
//! The four variants are interleaved per repetition. Each run loads the programs afresh, so
//! their counters (redirected frames in particular) are that run's alone; with AF_XDP at both
//! ends the client's program counts the echoes it redirected, the server's the requests.
//!
//! * `lent` (`af_xdp.lent` in the JSON): the library's client (`AfXdpConnect`) against the
//!   `af_xdp_lib` server at 1460 B, in the same repetition: copying (`send` of a `Bytes`
//!   built per message into a reused `BytesMut`, `recv`) vs lent (`LendBuffer::lend` filled in
//!   the TX UMEM frame, `Emit::emit`, `LendRecv::recv_lent` viewing the payload in its RX
//!   frame; a `None` from `lend` falls back to a copying send, counted). Each: warm-up,
//!   `--msgs` timed echo round trips, then echo throughput in bursts of 32 for 300 ms. The
//!   lent p50 is compared with `raw_af_xdp_pair` run at 1460 B in the same repetition (the
//!   bar above); the client's `lend_stats` over the run are reported (copies should be 0 on
//!   the lent path). UMEM frames are 2048 B, so 1460 B is the only size: no 8 KiB row.
//!
//! If AF_XDP cannot run here (not root, no `ip`, the program not built, the kernel refusing),
//! the result is `{"skipped": reason}`, unless `CHUNNEL_XDP_REQUIRE` is set (as CI does):
//! then it is an error.

use std::net::{SocketAddr, SocketAddrV4};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail, ensure};
use bytes::{Bytes, BytesMut};
use chunnel::{
    Chunnel as _, ChunnelConnection as _, Emit as _, LendBuffer as _, LendRecv as _, LendStats,
    Listen as _, Listener as _, Negotiate,
};
use chunnel_test::netns::{self, VethPair};
use chunnel_xdp::{AfXdpConnect, AfXdpUdp, Config, Counters, XdpBuf, XdpPayload, raw};
use serde_json::{Value, json};

use crate::harness::{
    BURST, Sample, TPUT_MILLIS, TPUT_SIZE, WARMUP, compare, echo_until_empty, meets_bar, merge,
    pair, ping, raw_tokio_client, run_header, runtime, side_stats, summarize,
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
        "af_xdp_both_ends_lib_meets_bar": af_xdp["both_ends"]["meets_bar"].as_bool(),
        "af_xdp_both_ends_all_redirected": af_xdp["both_ends"]["all_redirected_both_directions"].as_bool(),
        "af_xdp_lent_meets_bar": af_xdp["lent"]["results"][0]["meets_bar"].as_bool(),
        "af_xdp_lent_zero_copies": af_xdp["lent"]["results"][0]["lent_path_zero_copies"].as_bool(),
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
    /// Kernel UDP client, raw echo loop.
    Raw,
    /// Kernel UDP client, the library's listener.
    Lib,
    /// Raw client loop, raw echo loop: AF_XDP at both ends.
    RawPair,
    /// The library's client and listener.
    LibPair,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Raw => "raw_af_xdp",
            Variant::Lib => "af_xdp_lib",
            Variant::RawPair => "raw_af_xdp_pair",
            Variant::LibPair => "af_xdp_lib_pair",
        }
    }
}

/// What a server saw in one run.
#[derive(Clone, Copy, Debug, Default)]
struct Report {
    counters: Counters,
    attach_mode: &'static str,
    /// Datagrams echoed (raw) or delivered to connections (library); at a client, echoes
    /// received.
    echoed: u64,
    /// Frames that were not a datagram for us (dropped).
    malformed: u64,
    tx_kicks: u64,
    /// The kernel's drop counts (rx_dropped, rx_ring_full, fill_ring_empty).
    kernel: (u64, u64, u64),
    /// The thread's CPU time (user + system) from ready to the end message.
    cpu_ns: u64,
}

/// One run: the client's sample, the server's report, and the client's when it is AF_XDP.
type Run = (Sample, Report, Option<Report>);

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

    let variants = [
        Variant::Raw,
        Variant::Lib,
        Variant::RawPair,
        Variant::LibPair,
    ];
    let mut res: Vec<Vec<Run>> = vec![Vec::new(); variants.len()];
    let mut lent_runs: Vec<LentRun> = Vec::with_capacity(reps);
    let mut lent_err: Option<String> = None;
    for rep in 0..reps {
        for (i, &v) in variants.iter().enumerate() {
            // A failure here (the program cannot be attached, no echo...) is reported like
            // an unavailable datapath: an error under CHUNNEL_XDP_REQUIRE, `skipped` otherwise.
            let (s, r, c) = match run_once(v, &ns, msgs) {
                Ok(x) => x,
                Err(e) => {
                    drop(ns);
                    return skip(format!("{} failed in repetition {rep}: {e:#}", v.name()));
                }
            };
            eprintln!(
                "rep {rep} af_xdp {:<10} 64 B: p50 {:>7.2} us  p99 {:>7.2} us  {:>9.0} msg/s  \
                 ({} mode; redirected {}, passed {}, echoed {}, kicks {}, server cpu {:.0} ns/echo{})",
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
                c.map(|c| format!(
                    "; client redirected {}, passed {}, cpu {:.0} ns/echo",
                    c.counters.redirected,
                    c.counters.passed,
                    cpu_per_echo(&c)
                ))
                .unwrap_or_default(),
            );
            res[i].push((s, r, c));
        }
        if lent_err.is_none() {
            // A failure here is reported under `lent` alone; the other variants stand.
            match lent_rep(&ns, msgs, rep) {
                Ok(l) => {
                    eprintln!(
                        "rep {rep} af_xdp lent {LENT_SIZE} B: raw pair p50 {:>7.2} us  copying p50 \
                         {:>7.2} us {:>9.0} msg/s  lent p50 {:>7.2} us {:>9.0} msg/s  (lent path \
                         {:?}; copying path {:?})",
                        l.raw.p50_us,
                        l.copy.p50_us,
                        l.copy.msgs_per_s,
                        l.lent.p50_us,
                        l.lent.msgs_per_s,
                        l.lent_stats,
                        l.copy_stats,
                    );
                    lent_runs.push(l);
                }
                Err(e) => {
                    if required() {
                        drop(ns);
                        bail!("af_xdp lent failed in repetition {rep}: {e:#}");
                    }
                    eprintln!("af_xdp lent failed in repetition {rep}: {e:#}");
                    lent_err = Some(format!("failed in repetition {rep}: {e:#}"));
                }
            }
        }
    }
    drop(ns);

    let samples: Vec<Vec<Sample>> = res
        .iter()
        .map(|r| r.iter().map(|(s, _, _)| *s).collect())
        .collect();
    // Every timed and warm-up request, and the end message, went through the socket (the
    // throughput phase adds more).
    let expected = (WARMUP + msgs + 1) as u64;
    let all_redirected = res[..2]
        .iter()
        .flatten()
        .all(|(_, r, _)| r.counters.redirected >= expected);
    // Both ends: the requests at the server, the echoes at the client.
    let both_redirected = res[2..].iter().flatten().all(|(_, r, c)| {
        r.counters.redirected >= expected && c.is_some_and(|c| c.counters.redirected >= expected)
    });
    let run_json = |r: &Report, cpu_key: &str| {
        let mut v = json!({
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
        });
        v[cpu_key] = json!(cpu_per_echo(r));
        v
    };
    let side = |i: usize, what: &str| {
        let runs: Vec<Value> = res[i]
            .iter()
            .map(|(_, r, _)| run_json(r, "server_cpu_ns_per_echo"))
            .collect();
        let mut v = side_stats(&samples[i], what);
        merge(
            &mut v,
            json!({
            "xdp_redirected": spread(&res[i].iter().map(|(_, r, _)| r.counters.redirected as f64).collect::<Vec<_>>()),
            "server_cpu_ns_per_echo": spread(&res[i].iter().map(|(_, r, _)| cpu_per_echo(r)).collect::<Vec<_>>()),
            "runs": runs,
            }),
        );
        let clients: Vec<&Report> = res[i].iter().filter_map(|(_, _, c)| c.as_ref()).collect();
        if !clients.is_empty() {
            merge(
                &mut v,
                json!({
                "client_xdp_redirected": spread(&clients.iter().map(|c| c.counters.redirected as f64).collect::<Vec<_>>()),
                "client_cpu_ns_per_echo": spread(&clients.iter().map(|c| cpu_per_echo(c)).collect::<Vec<_>>()),
                "client_runs": clients.iter().map(|c| run_json(c, "client_cpu_ns_per_echo")).collect::<Vec<_>>(),
                }),
            );
        }
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
    let mut both = json!({
        "raw": side(2, "raw_af_xdp_pair: chunnel_xdp::raw client loop (poll() wait) against the \
                        raw_af_xdp echo loop, no Chunnel/listener/tokio at either end"),
        "library": side(3, "af_xdp_lib_pair: chunnel_xdp::AfXdpConnect client (ping loop) against \
                            the AfXdpUdp listener echo, current-thread tokio at both ends"),
        "client": format!("AF_XDP on {DEV_A} in namespace A (the route's source address, an \
                           ephemeral port held by a kernel UDP socket)"),
        "min_redirected_per_run_expected": expected,
        "all_redirected_both_directions": both_redirected,
    });
    merge(&mut both, compare(&samples[2], &samples[3]));
    out["both_ends"] = both;
    out["lent"] = lent_json(&lent_runs, lent_err.as_deref());
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
fn run_once(v: Variant, ns: &VethPair, msgs: usize) -> Result<Run> {
    let (report_tx, report_rx) = mpsc::sync_channel(1);
    let (client_tx, client_rx) = mpsc::sync_channel(1);
    let (nsa, nsb) = (ns.a.clone(), ns.b.clone());
    let kernel_client = move |addr: SocketAddr| {
        netns::enter(&nsa)?;
        raw_tokio_client(addr, msgs, TPUT_SIZE)
    };
    let nsa = ns.a.clone();
    let sample = match v {
        Variant::Raw => pair(move |tx| raw_server(&nsb, tx, report_tx), kernel_client)?,
        Variant::Lib => pair(move |tx| lib_server(&nsb, tx, report_tx), kernel_client)?,
        Variant::RawPair => pair(
            move |tx| raw_server(&nsb, tx, report_tx),
            move |_| raw_client(&nsa, msgs, TPUT_SIZE, client_tx),
        )?,
        Variant::LibPair => pair(
            move |tx| lib_server(&nsb, tx, report_tx),
            move |_| lib_client(&nsa, msgs, client_tx),
        )?,
    };
    let report = report_rx
        .recv_timeout(Duration::from_secs(5))
        .map_err(|_| anyhow!("the server sent no report"))?;
    ensure!(
        report.counters.redirected > 0,
        "no frame went through the AF_XDP socket: {report:?}"
    );
    let client = match v {
        Variant::Raw | Variant::Lib => None,
        Variant::RawPair | Variant::LibPair => {
            let c = client_rx
                .recv_timeout(Duration::from_secs(5))
                .map_err(|_| anyhow!("the client sent no report"))?;
            ensure!(
                c.counters.redirected > 0,
                "no echo went through the client's AF_XDP socket: {c:?}"
            );
            Some(c)
        }
    };
    Ok((sample, report, client))
}

fn client_config() -> Result<Config> {
    Ok(Config::new(DEV_A, "0.0.0.0:0".parse()?))
}

/// The hand-written AF_XDP client: the kernel client loop's round trips, bursts and end
/// message, on a `raw::Socket`; `poll()` when waiting.
fn raw_client(
    ns: &str,
    msgs: usize,
    size: usize,
    report_tx: mpsc::SyncSender<Report>,
) -> Result<Sample> {
    netns::enter(ns)?;
    let mut cfg = client_config()?;
    let server: SocketAddrV4 = SERVER.parse()?;
    let (path, _port) = raw::client_path(&cfg, server, Duration::from_secs(1))?;
    cfg.local = path.local();
    let mut sock = raw::Socket::open(&cfg)?;
    let cpu0 = thread_cpu_ns();
    let mut c = RawClient {
        sock: &mut sock,
        path,
        ip_id: 0,
        received: 0,
        malformed: 0,
    };
    let msg = vec![0xabu8; size];
    let mut rtts = Vec::with_capacity(msgs);
    for i in 0..WARMUP + msgs {
        let t = Instant::now();
        c.send(&msg, 1)?;
        c.recv(1, size)?;
        if i >= WARMUP {
            rtts.push(t.elapsed().as_nanos() as u64);
        }
    }
    let start = Instant::now();
    let deadline = start + Duration::from_millis(TPUT_MILLIS);
    let mut done = 0u64;
    while Instant::now() < deadline {
        c.send(&msg, BURST)?;
        c.recv(BURST, size)?;
        done += BURST as u64;
    }
    let tput = done as f64 / start.elapsed().as_secs_f64();
    c.send(&[], 1)?;
    let _ = c.recv(1, 0);
    let (received, malformed) = (c.received, c.malformed);
    let _ = report_tx.send(Report {
        counters: sock.counters()?,
        attach_mode: sock.attach_mode(),
        echoed: received,
        malformed,
        tx_kicks: sock.tx_kicks(),
        kernel: sock.kernel_stats().unwrap_or_default(),
        cpu_ns: thread_cpu_ns().saturating_sub(cpu0),
    });
    Ok(summarize(rtts, tput))
}

struct RawClient<'a> {
    sock: &'a mut raw::Socket,
    path: raw::Reply,
    ip_id: u16,
    received: u64,
    malformed: u64,
}

impl RawClient<'_> {
    /// Sends `n` copies of `payload`.
    fn send(&mut self, payload: &[u8], n: usize) -> Result<()> {
        let mut sent = 0;
        let mut stuck = 0u32;
        while sent < n {
            let (path, ip_id) = (&self.path, &mut self.ip_id);
            let q = self.sock.send_batch(|buf| {
                if sent == n {
                    return None;
                }
                let len = raw::build_reply(buf, path, *ip_id, payload)?;
                *ip_id = ip_id.wrapping_add(1);
                sent += 1;
                Some(len)
            });
            self.sock.flush_tx();
            if q == 0 {
                stuck += 1;
                ensure!(stuck < 100_000, "TX ring stuck");
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Waits for `n` echoes of `size` bytes from the server (5 s at most).
    fn recv(&mut self, n: usize, size: usize) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let server = self.path.peer();
        let mut got = 0;
        let mut wrong = 0;
        while got < n {
            let k = self
                .sock
                .recv_batch(n - got, |f| match raw::parse_reply(f) {
                    Some((r, range)) if r.peer() == server => {
                        if range.len() == size {
                            got += 1;
                        } else {
                            wrong += 1;
                        }
                    }
                    _ => self.malformed += 1,
                });
            if self.sock.fill_needs_wakeup() {
                self.sock.kick_rx();
            }
            ensure!(wrong == 0, "an echo of the wrong size");
            if k > 0 {
                continue;
            }
            ensure!(Instant::now() < deadline, "no echo for 5 s ({got} of {n})");
            let mut pfd = libc::pollfd {
                fd: self.sock.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call; the socket outlives it.
            let r = unsafe { libc::poll(&mut pfd, 1, 100) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                ensure!(e.kind() == std::io::ErrorKind::Interrupted, "poll: {e}");
            }
        }
        self.received += n as u64;
        Ok(())
    }
}

/// The library's client: `AfXdpConnect`, the shared `ping` loop.
fn lib_client(ns: &str, msgs: usize, report_tx: mpsc::SyncSender<Report>) -> Result<Sample> {
    netns::enter(ns)?;
    runtime()?.block_on(async move {
        let conn = AfXdpConnect::new(client_config()?, SERVER.parse()?)
            .connect_wrap(())
            .await?;
        let cpu0 = thread_cpu_ns();
        let sample = ping(&conn, msgs, TPUT_SIZE, true).await?;
        let cpu_ns = thread_cpu_ns().saturating_sub(cpu0);
        let stats = conn.stats();
        let _ = report_tx.send(Report {
            counters: conn.counters()?,
            attach_mode: conn.attach_mode(),
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
        Ok(sample)
    })
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

// ---- lent buffers -------------------------------------------------------------------------

/// The only lent size: UMEM frames are 2048 B, so 8 KiB does not fit in one.
const LENT_SIZE: usize = 1460;

/// One repetition of the lent variant.
struct LentRun {
    /// `raw_af_xdp_pair` at [`LENT_SIZE`].
    raw: Sample,
    copy: Sample,
    lent: Sample,
    copy_stats: LendStats,
    lent_stats: LendStats,
}

/// The raw pair at [`LENT_SIZE`], then the library client copying and lending (order
/// alternating per repetition), each against a fresh library listener.
fn lent_rep(ns: &VethPair, msgs: usize, rep: usize) -> Result<LentRun> {
    let (report_tx, report_rx) = mpsc::sync_channel(1);
    let (client_tx, client_rx) = mpsc::sync_channel(1);
    let (nsa, nsb) = (ns.a.clone(), ns.b.clone());
    let raw = pair(
        move |tx| raw_server(&nsb, tx, report_tx),
        move |_| raw_client(&nsa, msgs, LENT_SIZE, client_tx),
    )?;
    let r: Report = report_rx
        .recv_timeout(Duration::from_secs(5))
        .map_err(|_| anyhow!("the raw server sent no report"))?;
    let c: Report = client_rx
        .recv_timeout(Duration::from_secs(5))
        .map_err(|_| anyhow!("the raw client sent no report"))?;
    ensure!(
        r.counters.redirected > 0 && c.counters.redirected > 0,
        "raw pair at {LENT_SIZE} B: nothing redirected"
    );
    let ((copy, copy_stats), (lent, lent_stats)) = if rep.is_multiple_of(2) {
        let c = lib_lent_run(ns, msgs, false)?;
        (c, lib_lent_run(ns, msgs, true)?)
    } else {
        let l = lib_lent_run(ns, msgs, true)?;
        (lib_lent_run(ns, msgs, false)?, l)
    };
    Ok(LentRun {
        raw,
        copy,
        lent,
        copy_stats,
        lent_stats,
    })
}

/// The library client (copying or lending) against the library listener's echo.
fn lib_lent_run(ns: &VethPair, msgs: usize, lent: bool) -> Result<(Sample, LendStats)> {
    let (report_tx, report_rx) = mpsc::sync_channel(1);
    let (stats_tx, stats_rx) = mpsc::sync_channel(1);
    let (nsa, nsb) = (ns.a.clone(), ns.b.clone());
    let s = pair(
        move |tx| lib_server(&nsb, tx, report_tx),
        move |_| lent_client(&nsa, msgs, lent, stats_tx),
    )?;
    let r: Report = report_rx
        .recv_timeout(Duration::from_secs(5))
        .map_err(|_| anyhow!("the server sent no report"))?;
    let (st, redirected): (LendStats, u64) = stats_rx
        .recv_timeout(Duration::from_secs(5))
        .map_err(|_| anyhow!("the client sent no report"))?;
    ensure!(
        r.counters.redirected > 0 && redirected > 0,
        "library pair at {LENT_SIZE} B (lent {lent}): nothing redirected"
    );
    Ok((s, st))
}

/// Warm-up, `msgs` timed echo round trips of [`LENT_SIZE`] bytes, echo throughput in bursts of
/// [`BURST`] for [`TPUT_MILLIS`], the end message; sends the client's `lend_stats` over the
/// run and its program's redirected count.
fn lent_client(
    ns: &str,
    msgs: usize,
    lent: bool,
    stats_tx: mpsc::SyncSender<(LendStats, u64)>,
) -> Result<Sample> {
    netns::enter(ns)?;
    runtime()?.block_on(async move {
        let conn = AfXdpConnect::new(client_config()?, SERVER.parse()?)
            .connect_wrap(())
            .await?;
        let mut e = LentEcho {
            conn: &conn,
            lent,
            bm: BytesMut::with_capacity(2 * BURST * LENT_SIZE),
            burst: Vec::with_capacity(BURST),
            bufs: Vec::with_capacity(BURST),
            copied: vec![None; BURST],
            slots: (0..BURST).map(|_| None).collect(),
        };
        let s0 = conn.lend_stats();
        let mut rtts = Vec::with_capacity(msgs);
        for i in 0..WARMUP + msgs {
            let t = Instant::now();
            e.round(1).await?;
            if i >= WARMUP {
                rtts.push(t.elapsed().as_nanos() as u64);
            }
        }
        let start = Instant::now();
        let deadline = start + Duration::from_millis(TPUT_MILLIS);
        let mut done = 0u64;
        while Instant::now() < deadline {
            e.round(BURST).await?;
            done += BURST as u64;
        }
        let rate = done as f64 / start.elapsed().as_secs_f64();
        let s1 = conn.lend_stats();
        let st = LendStats {
            rx_lent: s1.rx_lent - s0.rx_lent,
            rx_copied: s1.rx_copied - s0.rx_copied,
            tx_lent: s1.tx_lent - s0.tx_lent,
            tx_copied: s1.tx_copied - s0.tx_copied,
        };
        conn.send([Bytes::new()]).await?;
        let mut one = vec![None];
        let _ = tokio::time::timeout(Duration::from_secs(1), conn.recv(&mut one)).await;
        let _ = stats_tx.send((st, conn.counters()?.redirected));
        Ok(summarize(rtts, rate))
    })
}

/// The echo client's state: the copying path builds each message once into a reused
/// `BytesMut` and sends its `Bytes`; the lent path fills a lent TX frame (falling back to
/// the copying send when `lend` says no). Each echo's first and last byte are read.
struct LentEcho<'a> {
    conn: &'a chunnel_xdp::ClientConnection,
    lent: bool,
    bm: BytesMut,
    burst: Vec<Bytes>,
    bufs: Vec<XdpBuf>,
    copied: Vec<Option<Bytes>>,
    slots: Vec<Option<XdpPayload>>,
}

impl LentEcho<'_> {
    /// Sends `n` messages and waits for their `n` echoes (5 s at most).
    async fn round(&mut self, n: usize) -> Result<()> {
        let c = self.conn;
        for i in 0..n {
            let v = (i as u8) | 1;
            if self.lent
                && let Some(mut b) = c.lend(LENT_SIZE)
            {
                b.as_mut().fill(v);
                self.bufs.push(b);
                continue;
            }
            self.bm.resize(LENT_SIZE, v);
            self.burst.push(self.bm.split().freeze());
        }
        if !self.bufs.is_empty() {
            c.emit(self.bufs.drain(..)).await?;
        }
        if !self.burst.is_empty() {
            c.send(self.burst.drain(..)).await?;
        }
        let wait = Duration::from_secs(5);
        let mut got = 0;
        let mut sum = 0u32;
        if self.lent {
            while got < n {
                got += tokio::time::timeout(wait, c.recv_lent(&mut self.slots[got..n])).await??;
            }
            for s in &mut self.slots[..n] {
                let p = s.take().ok_or_else(|| anyhow!("an empty slot"))?;
                let b: &[u8] = p.as_ref();
                ensure!(b.len() == LENT_SIZE, "an echo of the wrong size");
                sum += u32::from(b[0]) + u32::from(b[LENT_SIZE - 1]);
            }
        } else {
            while got < n {
                got += tokio::time::timeout(wait, c.recv(&mut self.copied[got..n])).await??;
            }
            for s in &mut self.copied[..n] {
                let b = s.take().ok_or_else(|| anyhow!("an empty slot"))?;
                ensure!(b.len() == LENT_SIZE, "an echo of the wrong size");
                sum += u32::from(b[0]) + u32::from(b[LENT_SIZE - 1]);
            }
        }
        std::hint::black_box(sum);
        Ok(())
    }
}

fn lend_json(s: LendStats) -> Value {
    json!({ "rx_lent": s.rx_lent, "rx_copied": s.rx_copied, "tx_lent": s.tx_lent, "tx_copied": s.tx_copied })
}

/// `af_xdp.lent`: the same fields as `datapaths`' `lent.results` rows, plus the copying
/// path's p50 and both paths' lend counters.
fn lent_json(runs: &[LentRun], err: Option<&str>) -> Value {
    if let Some(e) = err {
        return json!({ "skipped": e });
    }
    let col = |f: &dyn Fn(&LentRun) -> f64| runs.iter().map(f).collect::<Vec<f64>>();
    let med = crate::harness::med;
    let raw = col(&|r| r.raw.p50_us);
    let lent = col(&|r| r.lent.p50_us);
    let p50_ratio = col(&|r| r.lent.p50_us / r.raw.p50_us);
    let tput_ratio = col(&|r| r.lent.msgs_per_s / r.copy.msgs_per_s);
    let sum = |f: &dyn Fn(&LentRun) -> LendStats| {
        runs.iter()
            .map(f)
            .fold(LendStats::default(), |a, b| LendStats {
                rx_lent: a.rx_lent + b.rx_lent,
                rx_copied: a.rx_copied + b.rx_copied,
                tx_lent: a.tx_lent + b.tx_lent,
                tx_copied: a.tx_copied + b.tx_copied,
            })
    };
    let lent_stats = sum(&|r| r.lent_stats);
    json!({
        "what": "AF_XDP at both ends, the library client (AfXdpConnect) against the library \
                 listener's copying echo at 1460 B: copying send/recv vs lent lend+emit/recv_lent \
                 in the same repetition (echo round trips, then echo throughput in bursts of 32 \
                 for 300 ms); the lent p50 against raw_af_xdp_pair at 1460 B",
        "sizes_note": "UMEM frames are 2048 B: 1460 B only, no 8 KiB",
        "results": [{
            "datapath": "af_xdp_client",
            "size": LENT_SIZE,
            "raw_rtt_p50_us": spread(&raw),
            "lent_rtt_p50_us": spread(&lent),
            "copy_rtt_p50_us": spread(&col(&|r| r.copy.p50_us)),
            "lent_rtt_p99_us": spread(&col(&|r| r.lent.p99_us)),
            "p50_ratio_lent_over_raw": spread(&p50_ratio),
            "p50_lent_minus_raw_us": med(&lent) - med(&raw),
            "meets_bar": meets_bar(med(&raw), med(&lent), med(&p50_ratio)),
            "raw_msgs_per_s": spread(&col(&|r| r.raw.msgs_per_s)),
            "copy_msgs_per_s": spread(&col(&|r| r.copy.msgs_per_s)),
            "lent_msgs_per_s": spread(&col(&|r| r.lent.msgs_per_s)),
            "throughput_ratio_lent_over_copy": spread(&tput_ratio),
            "lend_stats_lent_path": lend_json(lent_stats),
            "lend_stats_copy_path": lend_json(sum(&|r| r.copy_stats)),
            "lent_path_zero_copies": lent_stats.rx_copied == 0 && lent_stats.tx_copied == 0,
        }],
    })
}
