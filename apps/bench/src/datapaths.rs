//! `chunnel-bench datapaths`: every datapath through the library against a raw baseline of
//! the same technology written without it, and the paper's Figure 7 (no-op layers) on the
//! fastest datapath (shared memory).
//!
//! Datapaths (echo round trip, one message in flight, `--msgs` timed round trips after a
//! warm-up, p50/p99; 64 B throughput in bursts of 32 for 300 ms):
//! * kernel UDP: `raw_tokio` (tokio `UdpSocket`, one system call per message, the bar's
//!   baseline: the same wait mechanism as the library) and, for context, `raw_std_blocking`
//!   (blocking `std::net::UdpSocket`, no epoll) vs `chunnel_net::udp` (`Connect` against a
//!   `Listener` echo, no negotiation). Measured here, interleaved, `--reps` repetitions.
//! * io_uring: `crate::uring::measure` (raw `io-uring` crate echo vs `chunnel_uring::udp`;
//!   5 interleaved repetitions inside).
//! * shared memory: `crate::shm::measure` (a raw SPSC ring in `/dev/shm` vs `chunnel-shm`
//!   picked by negotiation, busy-polling, and UDP through the same negotiation; 5 interleaved
//!   repetitions inside). The library's 64 B throughput comes from the Figure 7 runs at 0
//!   layers (the raw ring has no throughput mode).
//! * AF_XDP: `crate::xdp::measure` (a kernel UDP client in one network namespace, the
//!   `raw_tokio` client loop below, against an AF_XDP server across a veth pair in another:
//!   a hand-written echo on `chunnel_xdp::raw` vs the `chunnel_xdp::AfXdpUdp` listener;
//!   `--reps` interleaved repetitions; XDP program counters per run; and AF_XDP at both ends,
//!   `AfXdpConnect` against the listener vs a raw client loop against the raw echo, in
//!   `af_xdp.both_ends`, both ends' counters per run). Recorded as `skipped`
//!   when AF_XDP cannot run here (not root, no XDP program...) unless `CHUNNEL_XDP_REQUIRE`
//!   is set; `--no-xdp` skips it. `chunnel-bench xdp` runs it alone.
//!
//! * lent buffers: `crate::lent::measure` (lent vs copying throughput at 1460 B and 8 KiB for
//!   shared memory and io_uring, and the lent echo's p50 against the raw technology at the same
//!   size; `--reps` interleaved repetitions); `--no-lent` skips it.
//!
//! Figure 7: the negotiated shared-memory connection with 0, 1, 3, 5 `Noop` layers stacked on
//! it at both ends (`stack![Noop, .., Noop].connect_wrap(negotiated)`), at 64, 128, 512 and
//! 1460 B; p50/p99 and the p50 ratio to 0 layers per repetition; 64 B also throughput.
//!
//! Client thread pinned to CPU 0, server thread to CPU 1, each with its own current-thread
//! tokio runtime. Figures are the median with min/max over repetitions; ratios are taken per
//! repetition. The bar (issue 7): library within 10 % of raw at p50, or at most 1 µs above
//! it when the raw p50 is under 10 µs; shared memory at least 5x lower p50 than kernel UDP.

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use chunnel::{Chunnel, Identity, Listener, Noop, Side, select, stack};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_net::udp;
use chunnel_shm::{LocalFastPath, Role, WaitPolicy};
use serde_json::{Value, json};

use crate::harness::{
    BURST, Sample, TPUT_MILLIS, TPUT_SIZE, WARMUP, compare, echo_until_empty, med, meets_bar,
    merge, pair, ping, raw_tokio_client, run_header, runtime, side_stats, summarize,
};
use crate::stats::spread;

const LAYERS: [usize; 4] = [0, 1, 3, 5];
const SIZES: [usize; 4] = [64, 128, 512, 1460];

#[derive(clap::Args, Clone)]
pub(crate) struct Args {
    /// Timed round trips per latency measurement (every datapath and Figure 7).
    #[arg(long, default_value_t = 20_000)]
    msgs: usize,
    /// Repetitions of the kernel UDP and Figure 7 measurements (io_uring and shared memory
    /// reuse their subcommands' measurement: always 5).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Skip the io_uring datapath.
    #[arg(long)]
    no_uring: bool,
    /// Skip the AF_XDP datapath (needs root; see `chunnel-bench xdp`).
    #[arg(long)]
    no_xdp: bool,
    /// Skip the lent-buffer variants (see `chunnel-bench lent`).
    #[arg(long)]
    no_lent: bool,
}

pub(crate) fn run(a: Args) -> Result<()> {
    ensure!(
        a.msgs >= 1 && a.reps >= 1,
        "need --msgs >= 1 and --reps >= 1"
    );
    let started = Instant::now();

    // Kernel UDP: raw sockets vs chunnel_net::udp, interleaved.
    let udp_variants = [UdpVariant::RawTokio, UdpVariant::RawStd, UdpVariant::Lib];
    let mut udp: Vec<Vec<Sample>> = vec![Vec::new(); udp_variants.len()];
    for rep in 0..a.reps {
        for (i, &v) in udp_variants.iter().enumerate() {
            let s =
                udp_run(v, a.msgs, TPUT_SIZE).with_context(|| format!("udp {v:?} rep {rep}"))?;
            eprintln!(
                "rep {rep} udp {:<16} 64 B: p50 {:>7.2} us  p99 {:>7.2} us  {:>9.0} msg/s",
                v.name(),
                s.p50_us,
                s.p99_us,
                s.msgs_per_s
            );
            udp[i].push(s);
        }
    }
    let kernel_udp = {
        let mut v = json!({
            "raw": side_stats(&udp[0], "tokio UdpSocket echo (send/recv, one system call per message)"),
            "raw_std_blocking": side_stats(&udp[1], "context: blocking std UdpSocket echo (no epoll)"),
            "library": side_stats(&udp[2], "chunnel_net::udp Connect vs Listener echo (sendmmsg/recvmmsg)"),
        });
        merge(&mut v, compare(&udp[0], &udp[2]));
        v
    };

    // io_uring: the `uring` subcommand's measurement.
    let io_uring = if a.no_uring {
        json!({ "skipped": "--no-uring" })
    } else {
        match crate::uring::measure(a.msgs, 64) {
            Ok(u) => {
                let v = &u["variants"];
                let raw_p50 = v["raw_uring"]["rtt_p50_us"]["median"]
                    .as_f64()
                    .unwrap_or(f64::NAN);
                let lib_p50 = v["uring_lib"]["rtt_p50_us"]["median"]
                    .as_f64()
                    .unwrap_or(f64::NAN);
                let ratio = v["uring_lib"]["p50_ratio_to_raw"]["median"]
                    .as_f64()
                    .unwrap_or(f64::NAN);
                let pick = |k: &str, what: &str| {
                    json!({
                        "what": what,
                        "rtt_p50_us": v[k]["rtt_p50_us"],
                        "rtt_p99_us": v[k]["rtt_p99_us"],
                        "msgs_per_s_64b": v[k]["msgs_per_s_64b"],
                    })
                };
                json!({
                    "raw": pick("raw_uring", "io-uring crate echo, no runtime (uring.rs)"),
                    "library": pick("uring_lib", "chunnel_uring::udp Connect vs Listener echo"),
                    "p50_ratio_lib_over_raw": v["uring_lib"]["p50_ratio_to_raw"],
                    "p99_ratio_lib_over_raw": v["uring_lib"]["p99_ratio_to_raw"],
                    "throughput_ratio_lib_over_raw": v["uring_lib"]["throughput_ratio_to_raw"],
                    "p50_lib_minus_raw_us": lib_p50 - raw_p50,
                    "meets_bar": meets_bar(raw_p50, lib_p50, ratio),
                    "reps": u["reps"],
                })
            }
            Err(e) => {
                eprintln!("io_uring skipped: {e:#}");
                json!({ "skipped": format!("{e:#}") })
            }
        }
    };

    // AF_XDP: kernel UDP client vs AF_XDP server across two namespaces (crate::xdp).
    let af_xdp = if a.no_xdp {
        json!({ "skipped": "--no-xdp" })
    } else {
        crate::xdp::measure(a.msgs, a.reps)?
    };

    // Shared memory: the `shm` subcommand's measurement (also the UDP-vs-shm check).
    let s = crate::shm::measure(a.msgs, 64)?;
    let r = &s["results"];
    let shm_raw_p50 = r["raw_ring"]["rtt_p50_us"]["median"]
        .as_f64()
        .unwrap_or(f64::NAN);
    let shm_lib_p50 = r["chunnel_shm"]["rtt_p50_us"]["median"]
        .as_f64()
        .unwrap_or(f64::NAN);
    let shm_ratio = s["p50_ratio_lib_shm_over_raw_ring"]["median"]
        .as_f64()
        .unwrap_or(f64::NAN);
    let udp_over_shm = s["p50_ratio_udp_over_shm"]["median"]
        .as_f64()
        .unwrap_or(f64::NAN);

    // Figure 7 on shared memory, interleaved.
    let mut fig: Vec<Vec<Sample>> = vec![Vec::new(); LAYERS.len() * SIZES.len()];
    for rep in 0..a.reps {
        for (si, &size) in SIZES.iter().enumerate() {
            for (li, &layers) in LAYERS.iter().enumerate() {
                let tput = size == TPUT_SIZE;
                let s = shm_layers(layers, a.msgs, size, tput)
                    .with_context(|| format!("shm {layers} layers {size} B rep {rep}"))?;
                eprintln!(
                    "rep {rep} shm {layers} layers {size:>4} B: p50 {:>6.3} us  p99 {:>6.3} us{}",
                    s.p50_us,
                    s.p99_us,
                    if tput {
                        format!("  {:>10.0} msg/s", s.msgs_per_s)
                    } else {
                        String::new()
                    }
                );
                fig[si * LAYERS.len() + li].push(s);
            }
        }
    }
    let mut figure7 = Vec::new();
    for (si, &size) in SIZES.iter().enumerate() {
        let zero = &fig[si * LAYERS.len()];
        for (li, &layers) in LAYERS.iter().enumerate() {
            let xs = &fig[si * LAYERS.len() + li];
            let ratio: Vec<f64> = xs
                .iter()
                .zip(zero)
                .map(|(x, z)| x.p50_us / z.p50_us)
                .collect();
            let mut row = json!({
                "layers": layers,
                "size": size,
                "rtt_p50_us": spread(&xs.iter().map(|s| s.p50_us).collect::<Vec<_>>()),
                "rtt_p99_us": spread(&xs.iter().map(|s| s.p99_us).collect::<Vec<_>>()),
                "p50_ratio_to_0_layers": spread(&ratio),
            });
            if size == TPUT_SIZE {
                let t: Vec<f64> = xs.iter().map(|s| s.msgs_per_s).collect();
                let tr: Vec<f64> = xs
                    .iter()
                    .zip(zero)
                    .map(|(x, z)| x.msgs_per_s / z.msgs_per_s)
                    .collect();
                row["msgs_per_s"] = spread(&t);
                row["throughput_ratio_to_0_layers"] = spread(&tr);
            }
            figure7.push(row);
        }
    }
    let shm_lib_tput: Vec<f64> = fig[0].iter().map(|s| s.msgs_per_s).collect();
    let shared_memory = json!({
        "raw": {
            "what": "hand-written SPSC rings in one /dev/shm mapping, busy-polling (shm.rs)",
            "rtt_p50_us": r["raw_ring"]["rtt_p50_us"],
            "rtt_p99_us": r["raw_ring"]["rtt_p99_us"],
            "msgs_per_s_64b": null,
        },
        "library": {
            "what": "chunnel-shm LocalFastPath picked by negotiation over UDP, busy-poll",
            "rtt_p50_us": r["chunnel_shm"]["rtt_p50_us"],
            "rtt_p99_us": r["chunnel_shm"]["rtt_p99_us"],
            "msgs_per_s_64b": spread(&shm_lib_tput),
        },
        "udp_through_same_negotiation": {
            "rtt_p50_us": r["chunnel_udp"]["rtt_p50_us"],
            "rtt_p99_us": r["chunnel_udp"]["rtt_p99_us"],
        },
        "p50_ratio_lib_over_raw": s["p50_ratio_lib_shm_over_raw_ring"],
        "p50_lib_minus_raw_us": shm_lib_p50 - shm_raw_p50,
        "p50_ratio_udp_over_shm": s["p50_ratio_udp_over_shm"],
        "meets_bar": meets_bar(shm_raw_p50, shm_lib_p50, shm_ratio),
        "reps": s["reps"],
        "notes": "raw ring throughput not measured (shm.rs's raw ring is latency only); \
                  library throughput is the Figure 7 0-layer 64 B run",
    });

    // Lent buffers vs the copying path (shared memory, io_uring; 1460 B and 8 KiB).
    let lent = if a.no_lent {
        json!({ "skipped": "--no-lent" })
    } else {
        crate::lent::measure(a.msgs, a.reps, !a.no_uring)?
    };

    let bar = |v: &Value| v["meets_bar"].as_bool();
    let shm_vs_raw_udp = med(&udp[0].iter().map(|s| s.p50_us).collect::<Vec<_>>()) / shm_lib_p50;
    let all_meet = [
        bar(&kernel_udp),
        bar(&io_uring),
        bar(&shared_memory),
        bar(&af_xdp),
        bar(&af_xdp["both_ends"]),
    ]
    .iter()
    .flatten()
    .all(|&b| b);
    let checks = json!({
        "kernel_udp_lib_meets_bar": bar(&kernel_udp),
        "io_uring_lib_meets_bar": bar(&io_uring),
        "shm_lib_meets_bar": bar(&shared_memory),
        "af_xdp_lib_meets_bar": bar(&af_xdp),
        "af_xdp_all_requests_redirected": af_xdp["all_requests_redirected"].as_bool(),
        "af_xdp_both_ends_lib_meets_bar": af_xdp["both_ends"]["meets_bar"].as_bool(),
        "af_xdp_both_ends_all_redirected": af_xdp["both_ends"]["all_redirected_both_directions"].as_bool(),
        "all_measured_datapaths_meet_bar": all_meet,
        "shm_p50_ratio_udp_over_shm": udp_over_shm,
        "shm_p50_ratio_raw_tokio_udp_over_shm": shm_vs_raw_udp,
        "shm_at_least_5x_lower_p50_than_udp": udp_over_shm >= 5.0,
        "lent_p50_meets_bar": lent["all_lent_p50_meet_bar"].as_bool(),
    });
    eprintln!("\nchecks: {checks}");
    let mut out = run_header("datapaths", a.msgs, a.reps);
    merge(
        &mut out,
        json!({
            "bar": "library p50 within 10% of raw, or at most 1 us above raw when raw p50 < 10 us; \
                    shm p50 >= 5x lower than kernel UDP",
            "wall_seconds": started.elapsed().as_secs_f64(),
            "datapaths": {
                "kernel_udp": kernel_udp,
                "io_uring": io_uring,
                "shared_memory": shared_memory,
                "af_xdp": af_xdp,
            },
            "lent": lent,
            "figure7": {
                "datapath": "shared memory (chunnel-shm negotiated, busy-poll) + N Noop layers at both ends",
                "layers": LAYERS,
                "sizes": SIZES,
                "results": figure7,
            },
            "checks": checks,
        }),
    );
    println!("{out}");
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum UdpVariant {
    RawTokio,
    RawStd,
    Lib,
}

impl UdpVariant {
    fn name(self) -> &'static str {
        match self {
            UdpVariant::RawTokio => "raw_tokio",
            UdpVariant::RawStd => "raw_std_blocking",
            UdpVariant::Lib => "chunnel_net_udp",
        }
    }
}

fn udp_run(v: UdpVariant, msgs: usize, size: usize) -> Result<Sample> {
    match v {
        UdpVariant::RawTokio => pair(raw_tokio_server, move |a| raw_tokio_client(a, msgs, size)),
        UdpVariant::RawStd => pair(raw_std_server, move |a| raw_std_client(a, msgs, size)),
        UdpVariant::Lib => pair(lib_udp_server, move |a| lib_udp_client(a, msgs, size)),
    }
}

/// Raw tokio echo: until an empty datagram (echoed too).
fn raw_tokio_server(addr_tx: mpsc::SyncSender<SocketAddr>) -> Result<()> {
    runtime()?.block_on(async move {
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
        addr_tx.send(sock.local_addr()?)?;
        let mut buf = vec![0u8; 65_536];
        loop {
            let (n, from) =
                tokio::time::timeout(Duration::from_secs(10), sock.recv_from(&mut buf)).await??;
            sock.send_to(&buf[..n], from).await?;
            if n == 0 {
                return Ok(());
            }
        }
    })
}

fn raw_std_server(addr_tx: mpsc::SyncSender<SocketAddr>) -> Result<()> {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0")?;
    sock.set_read_timeout(Some(Duration::from_secs(10)))?;
    addr_tx.send(sock.local_addr()?)?;
    let mut buf = vec![0u8; 65_536];
    loop {
        let (n, from) = sock.recv_from(&mut buf)?;
        sock.send_to(&buf[..n], from)?;
        if n == 0 {
            return Ok(());
        }
    }
}

fn raw_std_client(addr: SocketAddr, msgs: usize, size: usize) -> Result<Sample> {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0")?;
    sock.set_read_timeout(Some(Duration::from_secs(5)))?;
    sock.connect(addr)?;
    let msg = vec![0xabu8; size];
    let small = [0xcdu8; TPUT_SIZE];
    let mut buf = vec![0u8; 65_536];
    let mut rtts = Vec::with_capacity(msgs);
    for i in 0..WARMUP + msgs {
        let t = Instant::now();
        sock.send(&msg)?;
        let n = sock.recv(&mut buf)?;
        let dt = t.elapsed().as_nanos() as u64;
        ensure!(n == size, "echo of the wrong size");
        if i >= WARMUP {
            rtts.push(dt);
        }
    }
    let start = Instant::now();
    let deadline = start + Duration::from_millis(TPUT_MILLIS);
    let mut done = 0u64;
    while Instant::now() < deadline {
        for _ in 0..BURST {
            sock.send(&small)?;
        }
        for _ in 0..BURST {
            sock.recv(&mut buf)?;
        }
        done += BURST as u64;
    }
    let tput = done as f64 / start.elapsed().as_secs_f64();
    sock.send(&[])?;
    sock.set_read_timeout(Some(Duration::from_secs(1)))?;
    let _ = sock.recv(&mut buf);
    Ok(summarize(rtts, tput))
}

fn lib_udp_server(addr_tx: mpsc::SyncSender<SocketAddr>) -> Result<()> {
    runtime()?.block_on(async move {
        let mut l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
        addr_tx.send(l.local_addr()?)?;
        let conn = tokio::time::timeout(Duration::from_secs(10), l.accept()).await??;
        echo_until_empty(&conn).await
    })
}

fn lib_udp_client(addr: SocketAddr, msgs: usize, size: usize) -> Result<Sample> {
    runtime()?.block_on(async move {
        let conn = udp::Connect::new(addr).connect_wrap(()).await?;
        ping(&conn, msgs, size, true).await
    })
}

// ------------------------------------------------------------------------------------------
// Library connections: echo server and client loops.

fn shm_config() -> chunnel_shm::Config {
    chunnel_shm::Config {
        wait: WaitPolicy::busy_poll(),
        ..chunnel_shm::Config::default()
    }
}

/// `$body` with `$c` bound to `$conn` under `$n` `Noop` layers.
macro_rules! with_noops {
    ($n:expr, $conn:expr, |$c:ident| $body:expr) => {
        match $n {
            0 => {
                let $c = $conn;
                $body
            }
            1 => {
                let $c = Noop.connect_wrap($conn).await?;
                $body
            }
            3 => {
                let $c = stack![Noop, Noop, Noop].connect_wrap($conn).await?;
                $body
            }
            5 => {
                let $c = stack![Noop, Noop, Noop, Noop, Noop]
                    .connect_wrap($conn)
                    .await?;
                $body
            }
            n => bail!("unsupported layer count {n}"),
        }
    };
}

fn shm_layers(layers: usize, msgs: usize, size: usize, tput: bool) -> Result<Sample> {
    pair(
        move |addr_tx| {
            runtime()?.block_on(async move {
                let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
                addr_tx.send(listener.local_addr()?)?;
                let stack = select(LocalFastPath::new(Role::Server, shm_config()), Identity);
                let mut l = listen(stack, listener, Config::default());
                let conn = tokio::time::timeout(Duration::from_secs(10), l.accept()).await??;
                ensure!(
                    conn.get_ref().side() == Side::Left,
                    "negotiation did not pick shared memory (server)"
                );
                with_noops!(layers, conn, |c| echo_until_empty(&c).await)
            })
        },
        move |addr| {
            runtime()?.block_on(async move {
                let base = udp::Connect::new(addr).connect_wrap(()).await?;
                let neg = Client::new(Config::default());
                let stack = select(LocalFastPath::new(Role::Client, shm_config()), Identity);
                let conn = neg.connect(&addr.to_string(), stack, base).await?;
                ensure!(
                    conn.get_ref().side() == Side::Left,
                    "negotiation did not pick shared memory (client)"
                );
                with_noops!(layers, conn, |c| ping(&c, msgs, size, tput).await)
            })
        },
    )
}
