//! `chunnel-bench overhead`: what no-op Chunnels cost on the data path.
//!
//! For UDP and Unix datagram sockets, 64 B and 1 KiB messages, and stacks of 0, 1, 3 and 5
//! `Noop` layers (on both ends), plus a raw tokio socket baseline written without the library,
//! and the metrics rows: a `chunnel_metrics::Metered` layer on both ends with no recorder
//! (`metered`: the facade's handles do nothing, the snapshot atomics count) and with a
//! Prometheus recorder (`metered+prometheus`: every message counted where a scrape reads it),
//! compared per repetition with the 0-layer stack (metrics off):
//! * latency: one message in flight, `--pings` round trips, p50/p99;
//! * throughput: bursts of `--burst` messages in flight for `--millis`, messages/s.
//!
//! Client and server run in one single-threaded runtime pinned to one core. Configurations
//! are interleaved and repeated `--reps` times; figures are medians with min/max. Then the
//! `probe` subcommand runs under callgrind (instructions per message, 0/1/3/5 layers and the
//! two metered stacks) and natively (heap allocations per message, 5 layers and metered).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ChunnelExt, Identity, Layered, Listener, Noop, stack};
use chunnel_metrics::Metered;
use chunnel_metrics::metrics::Recorder;
use chunnel_net::{udp, uds};
use serde_json::{Value, json};

use crate::stats::{quantile, spread};

#[derive(clap::Args, Clone)]
pub(crate) struct Args {
    /// Repetitions of every configuration (interleaved).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Round trips per latency measurement.
    #[arg(long, default_value_t = 3000)]
    pings: usize,
    /// Milliseconds per throughput measurement.
    #[arg(long, default_value_t = 300)]
    millis: u64,
    /// Messages in flight in the throughput run.
    #[arg(long, default_value_t = 32)]
    burst: usize,
    /// CPU to pin to; negative to leave unpinned.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    cpu: i64,
    /// Skip the callgrind part.
    #[arg(long)]
    no_callgrind: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Transport {
    Udp,
    Unix,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Layers {
    Raw,
    N(usize),
    /// One `Metered` layer on each end, no recorder installed.
    Metered,
    /// One `Metered` layer on each end, its handles in a Prometheus recorder.
    MeteredProm,
}

impl Layers {
    fn label(self) -> String {
        match self {
            Layers::Raw => "raw".into(),
            Layers::N(n) => n.to_string(),
            Layers::Metered => "metered".into(),
            Layers::MeteredProm => "metered+prometheus".into(),
        }
    }
}

/// The recorder of the `metered+prometheus` rows (not installed globally, so the `metered`
/// rows measure the layer with no recorder in the same process).
type Prom = Arc<dyn Recorder + Send + Sync>;

struct Sample {
    msgs_per_s: f64,
    p50_us: f64,
    p99_us: f64,
}

pub(crate) fn run(a: Args) -> Result<()> {
    if a.cpu >= 0 {
        crate::pin_to(a.cpu as usize)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut configs = Vec::new();
    for t in [Transport::Udp, Transport::Unix] {
        for size in [64usize, 1024] {
            for l in [
                Layers::Raw,
                Layers::N(0),
                Layers::N(1),
                Layers::N(3),
                Layers::N(5),
                Layers::Metered,
                Layers::MeteredProm,
            ] {
                configs.push((t, size, l));
            }
        }
    }
    let (prom, prom_handle) = chunnel_metrics::prometheus::recorder();
    let prom: Prom = prom;
    let started = Instant::now();
    let mut samples: Vec<Vec<Sample>> = configs.iter().map(|_| Vec::new()).collect();
    for rep in 0..a.reps {
        for (i, &(t, size, l)) in configs.iter().enumerate() {
            let s = rt
                .block_on(async {
                    tokio::time::timeout(Duration::from_secs(30), measure(t, size, l, &a, &prom))
                        .await
                })
                .with_context(|| format!("{t:?} {size} B {l:?} stalled"))??;
            eprintln!(
                "rep {rep} {t:?} {size:>4} B layers {:>3}: {:>9.0} msg/s  p50 {:>6.1} us  p99 {:>6.1} us",
                l.label(),
                s.msgs_per_s,
                s.p50_us,
                s.p99_us
            );
            samples[i].push(s);
        }
    }

    let mut results = Vec::new();
    for (i, &(t, size, l)) in configs.iter().enumerate() {
        let raw_i = configs
            .iter()
            .position(|&(t2, s2, l2)| t2 == t && s2 == size && l2 == Layers::Raw)
            .expect("raw config exists");
        let get = |i: usize, f: fn(&Sample) -> f64| samples[i].iter().map(f).collect::<Vec<_>>();
        let tput = get(i, |s| s.msgs_per_s);
        let p50 = get(i, |s| s.p50_us);
        let p99 = get(i, |s| s.p99_us);
        // Ratios per repetition (same rep = measured close in time), then their spread.
        let tput_ratio: Vec<f64> = tput
            .iter()
            .zip(get(raw_i, |s| s.msgs_per_s))
            .map(|(x, r)| x / r)
            .collect();
        let p50_ratio: Vec<f64> = p50
            .iter()
            .zip(get(raw_i, |s| s.p50_us))
            .map(|(x, r)| x / r)
            .collect();
        results.push(json!({
            "transport": format!("{t:?}").to_lowercase(),
            "size": size,
            "layers": l.label(),
            "msgs_per_s": spread(&tput),
            "rtt_p50_us": spread(&p50),
            "rtt_p99_us": spread(&p99),
            "throughput_ratio_to_raw": spread(&tput_ratio),
            "p50_ratio_to_raw": spread(&p50_ratio),
        }));
    }
    let wall = started.elapsed();

    // Metrics on vs off: per repetition, the metered stacks against the 0-layer stack of the
    // same repetition (metrics off: the stack an application has without a `Metered` layer).
    let mut metrics_rows = Vec::new();
    for t in [Transport::Udp, Transport::Unix] {
        for size in [64usize, 1024] {
            let at = |l: Layers| {
                configs
                    .iter()
                    .position(|&c| c == (t, size, l))
                    .expect("config exists")
            };
            let off = at(Layers::N(0));
            let ratio = |on: usize, f: fn(&Sample) -> f64| -> Vec<f64> {
                samples[on]
                    .iter()
                    .zip(&samples[off])
                    .map(|(x, o)| f(x) / f(o))
                    .collect()
            };
            let mut row = serde_json::Map::new();
            row.insert("transport".into(), json!(format!("{t:?}").to_lowercase()));
            row.insert("size".into(), json!(size));
            for (l, key) in [
                (Layers::Metered, "metered"),
                (Layers::MeteredProm, "metered_prometheus"),
            ] {
                let on = at(l);
                row.insert(
                    format!("{key}_p50_ratio_to_off"),
                    spread(&ratio(on, |s| s.p50_us)),
                );
                row.insert(
                    format!("{key}_throughput_ratio_to_off"),
                    spread(&ratio(on, |s| s.msgs_per_s)),
                );
            }
            metrics_rows.push(Value::Object(row));
        }
    }
    let med_of = |t: &str, size: u64, key: &str| {
        metrics_rows
            .iter()
            .find(|r| r["transport"] == t && r["size"] == size)
            .and_then(|r| r[key]["median"].as_f64())
            .unwrap_or(f64::NAN)
    };
    let on_p50 = med_of("udp", 64, "metered_prometheus_p50_ratio_to_off");
    let on_tput = med_of("udp", 64, "metered_prometheus_throughput_ratio_to_off");
    // The recorder really counted: the messages its `chunnel_messages_total` series hold.
    let prom_counted = prometheus_messages(&prom_handle.render());

    let zero_udp64 = results
        .iter()
        .find(|r| r["transport"] == "udp" && r["size"] == 64 && r["layers"] == "0")
        .map(|r| {
            r["throughput_ratio_to_raw"]["median"]
                .as_f64()
                .unwrap_or(f64::NAN)
        })
        .unwrap_or(f64::NAN);

    let allocs = alloc_per_msg()?;
    let metered_allocs = alloc_per_msg_metered()?;
    let callgrind = if a.no_callgrind {
        Value::Null
    } else {
        callgrind()?
    };
    let five_minus_zero = callgrind["five_minus_zero_per_msg"].as_f64();

    eprintln!(
        "\n0-layer UDP 64 B throughput / raw: {zero_udp64:.3} (median of {} reps)",
        a.reps
    );
    if let Some(d) = five_minus_zero {
        eprintln!(
            "callgrind, UDP 64 B: 5 layers - 0 layers = {d:.1} instructions per message \
             traversal (send or recv)"
        );
    }
    eprintln!("heap allocations per message through 5 layers: {allocs}");
    eprintln!(
        "metrics on (Metered + Prometheus recorder) / off (0 layers), UDP 64 B: p50 {on_p50:.3}, \
         throughput {on_tput:.3}; the recorder counted {prom_counted} messages; allocations \
         per message through a metered stack: {metered_allocs}"
    );
    if let Some(d) = callgrind["metered_minus_zero_per_msg"].as_object() {
        eprintln!("callgrind, UDP 64 B: metered - 0 layers per message traversal: {d:?}");
    }

    let out = json!({
        "bench": "overhead",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "cpu": a.cpu,
        "reps": a.reps,
        "pings": a.pings,
        "throughput_millis": a.millis,
        "burst": a.burst,
        "wall_seconds": wall.as_secs_f64(),
        "results": results,
        "callgrind": callgrind,
        "allocations_per_msg_5_layers": allocs,
        "metrics": {
            "off": "the 0-layer stack (no Metered layer) of the same repetition",
            "metered": "Layered(Metered) on both ends, no recorder installed",
            "metered_prometheus": "Layered(Metered) on both ends, handles in a Prometheus recorder",
            "rows": metrics_rows,
            "prometheus_messages_counted": prom_counted,
            "allocations_per_msg_metered_prometheus": metered_allocs,
        },
        "checks": {
            "metrics_on_udp64_p50_ratio_to_off": on_p50,
            "metrics_on_udp64_throughput_ratio_to_off": on_tput,
            "metrics_on_within_5pct": on_p50 <= 1.05 && on_tput >= 0.95,
            "metrics_no_alloc_per_msg": metered_allocs == 0.0,
            "zero_layer_udp64_throughput_ratio": zero_udp64,
            "zero_layer_within_5pct_of_raw": zero_udp64 >= 0.95,
            "five_minus_zero_instr_per_msg": five_minus_zero,
            "at_most_10_instr_per_layer": five_minus_zero.map(|d| d <= 50.0),
            "no_alloc_per_msg": allocs == 0.0,
        },
    });
    println!("{out}");
    Ok(())
}

async fn measure(t: Transport, size: usize, l: Layers, a: &Args, prom: &Prom) -> Result<Sample> {
    match (t, l) {
        (Transport::Udp, Layers::Raw) => raw_udp(size, a).await,
        (Transport::Unix, Layers::Raw) => raw_unix(size, a).await,
        (Transport::Udp, l) => {
            let lis = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
            let c = udp::Connect::new(lis.local_addr()?);
            with_layers(l, c, lis, size, a, prom).await
        }
        (Transport::Unix, l) => {
            let path = sock_path("lib-srv");
            let lis = uds::DatagramListener::bind(path.clone()).await?;
            let c = uds::DatagramConnect::new(path);
            with_layers(l, c, lis, size, a, prom).await
        }
    }
}

/// A `Metered` layer for the metrics rows: with the Prometheus recorder or with none.
fn meter(name: &str, prom: Option<&Prom>) -> Layered<Metered> {
    let m = Metered::new(name).layer("datagram");
    Layered(match prom {
        Some(r) => m.with_recorder(r.clone()),
        None => m,
    })
}

/// The sum of every `chunnel_messages_total` series in an exposition text.
fn prometheus_messages(text: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with("chunnel_messages_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<u64>().ok())
        .sum()
}

async fn with_layers<C, L>(
    layers: Layers,
    c: C,
    l: L,
    size: usize,
    a: &Args,
    prom: &Prom,
) -> Result<Sample>
where
    C: Chunnel<()> + Send + 'static,
    C::Connection: ChunnelConnection<Data = Bytes> + 'static,
    L: Listener + 'static,
    L::Connection: ChunnelConnection<Data = Bytes> + 'static,
{
    let n = match layers {
        Layers::N(n) => n,
        Layers::Metered | Layers::MeteredProm => {
            let p = (layers == Layers::MeteredProm).then_some(prom);
            let server = meter("bench-server", p).serve(l);
            return lib(stack![meter("bench-client", p), c], server, size, a).await;
        }
        Layers::Raw => bail!("the raw baseline has no layers"),
    };
    match n {
        0 => lib(stack![Identity, c], Identity.serve(l), size, a).await,
        1 => lib(stack![Noop, c], Noop.serve(l), size, a).await,
        3 => {
            lib(
                stack![Noop, Noop, Noop, c],
                stack![Noop, Noop, Noop].serve(l),
                size,
                a,
            )
            .await
        }
        5 => {
            let s = stack![Noop, Noop, Noop, Noop, Noop];
            lib(stack![Noop, Noop, Noop, Noop, Noop, c], s.serve(l), size, a).await
        }
        _ => bail!("unsupported layer count {n}"),
    }
}

fn sock_path(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "chunnel-bench-{tag}-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

async fn lib<C, L>(mut client: C, mut listener: L, size: usize, a: &Args) -> Result<Sample>
where
    C: Chunnel<()>,
    C::Connection: ChunnelConnection<Data = Bytes>,
    L: Listener + 'static,
    L::Connection: ChunnelConnection<Data = Bytes> + 'static,
{
    let conn = client.connect_wrap(()).await?;
    let msg = Bytes::from(vec![0xabu8; size]);
    // The first message makes the server accept.
    conn.send([msg.clone()]).await?;
    let server = listener.accept().await?;
    let burst = a.burst;
    let echo = tokio::spawn(async move {
        let _listener = listener;
        let mut slots = vec![None; burst];
        while let Ok(n) = server.recv(&mut slots).await {
            if server
                .send(slots[..n].iter_mut().filter_map(Option::take))
                .await
                .is_err()
            {
                break;
            }
        }
    });
    let mut slots = vec![None; a.burst];
    recv_exact(&conn, &mut slots[..1]).await?;

    let mut rtts = Vec::with_capacity(a.pings);
    for i in 0..a.pings + 200 {
        let t = Instant::now();
        conn.send([msg.clone()]).await?;
        recv_exact(&conn, &mut slots[..1]).await?;
        if i >= 200 {
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let deadline = Instant::now() + Duration::from_millis(a.millis);
    let start = Instant::now();
    let mut done = 0u64;
    while Instant::now() < deadline {
        conn.send(std::iter::repeat_n(&msg, burst).cloned()).await?;
        recv_exact(&conn, &mut slots).await?;
        done += burst as u64;
    }
    let msgs_per_s = done as f64 / start.elapsed().as_secs_f64();
    echo.abort();
    Ok(summarize(rtts, msgs_per_s))
}

async fn recv_exact<C: ChunnelConnection<Data = Bytes>>(
    conn: &C,
    slots: &mut [Option<Bytes>],
) -> Result<()> {
    let mut got = 0;
    while got < slots.len() {
        got += conn.recv(&mut slots[got..]).await?;
    }
    for s in slots.iter_mut() {
        *s = None;
    }
    Ok(())
}

fn summarize(mut rtts: Vec<f64>, msgs_per_s: f64) -> Sample {
    rtts.sort_by(f64::total_cmp);
    Sample {
        msgs_per_s,
        p50_us: quantile(&rtts, 0.5),
        p99_us: quantile(&rtts, 0.99),
    }
}

/// The raw baseline: tokio's UDP socket, one system call per message, no library code.
async fn raw_udp(size: usize, a: &Args) -> Result<Sample> {
    let server = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
    let addr = server.local_addr()?;
    let echo = tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        while let Ok((n, from)) = server.recv_from(&mut buf).await {
            if server.send_to(&buf[..n], from).await.is_err() {
                break;
            }
        }
    });
    let client = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
    client.connect(addr).await?;
    let r = raw_client(&client, size, a).await;
    echo.abort();
    r
}

/// The raw baseline over Unix datagram sockets.
async fn raw_unix(size: usize, a: &Args) -> Result<Sample> {
    let spath = sock_path("raw-srv");
    let cpath = sock_path("raw-cli");
    let server = tokio::net::UnixDatagram::bind(&spath)?;
    let echo = tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        while let Ok((n, from)) = server.recv_from(&mut buf).await {
            let Some(p) = from.as_pathname() else { break };
            if server.send_to(&buf[..n], p).await.is_err() {
                break;
            }
        }
    });
    let client = tokio::net::UnixDatagram::bind(&cpath)?;
    client.connect(&spath)?;
    let r = raw_client(&client, size, a).await;
    echo.abort();
    let _ = std::fs::remove_file(&spath);
    let _ = std::fs::remove_file(&cpath);
    r
}

trait RawSock {
    async fn send_raw(&self, b: &[u8]) -> std::io::Result<usize>;
    async fn recv_raw(&self, b: &mut [u8]) -> std::io::Result<usize>;
}

impl RawSock for tokio::net::UdpSocket {
    async fn send_raw(&self, b: &[u8]) -> std::io::Result<usize> {
        self.send(b).await
    }
    async fn recv_raw(&self, b: &mut [u8]) -> std::io::Result<usize> {
        self.recv(b).await
    }
}

impl RawSock for tokio::net::UnixDatagram {
    async fn send_raw(&self, b: &[u8]) -> std::io::Result<usize> {
        self.send(b).await
    }
    async fn recv_raw(&self, b: &mut [u8]) -> std::io::Result<usize> {
        self.recv(b).await
    }
}

async fn raw_client<S: RawSock>(sock: &S, size: usize, a: &Args) -> Result<Sample> {
    let msg = vec![0xabu8; size];
    let mut buf = vec![0u8; 65_536];
    let mut rtts = Vec::with_capacity(a.pings);
    for i in 0..a.pings + 200 {
        let t = Instant::now();
        sock.send_raw(&msg).await?;
        sock.recv_raw(&mut buf).await?;
        if i >= 200 {
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let deadline = Instant::now() + Duration::from_millis(a.millis);
    let start = Instant::now();
    let mut done = 0u64;
    while Instant::now() < deadline {
        for _ in 0..a.burst {
            sock.send_raw(&msg).await?;
        }
        for _ in 0..a.burst {
            sock.recv_raw(&mut buf).await?;
        }
        done += a.burst as u64;
    }
    Ok(summarize(rtts, done as f64 / start.elapsed().as_secs_f64()))
}

fn self_exe() -> Result<PathBuf> {
    std::env::current_exe().context("locating chunnel-bench")
}

/// Heap allocations per message through 5 layers, counted natively in the probe loop.
fn alloc_per_msg() -> Result<f64> {
    let out = Command::new(self_exe()?)
        .args(["probe", "--layers", "5", "--bursts", "2000"])
        .output()
        .context("running the allocation probe")?;
    if !out.status.success() {
        bail!("probe failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let v: Value = serde_json::from_slice(&out.stdout).context("probe output")?;
    let allocs = v["allocations"].as_f64().unwrap_or(f64::NAN);
    let msgs = v["messages"].as_f64().unwrap_or(f64::NAN);
    Ok(allocs / msgs)
}

/// Heap allocations per message through a stack metered into a Prometheus recorder.
fn alloc_per_msg_metered() -> Result<f64> {
    let out = Command::new(self_exe()?)
        .args([
            "probe",
            "--layers",
            "0",
            "--metered",
            "prometheus",
            "--bursts",
            "2000",
        ])
        .output()
        .context("running the allocation probe (metered)")?;
    if !out.status.success() {
        bail!("probe failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let v: Value = serde_json::from_slice(&out.stdout).context("probe output")?;
    let allocs = v["allocations"].as_f64().unwrap_or(f64::NAN);
    let msgs = v["messages"].as_f64().unwrap_or(f64::NAN);
    Ok(allocs / msgs)
}

/// Instructions per message under callgrind for 0, 1, 3, 5 layers (UDP, 64 B, bursts of 32).
fn callgrind() -> Result<Value> {
    if Command::new("valgrind").arg("--version").output().is_err() {
        eprintln!("valgrind not found: skipping instruction counts");
        return Ok(json!({ "skipped": "valgrind not installed" }));
    }
    let exe = self_exe()?;
    let (b1, b2) = (200usize, 1200usize);
    let mut per_msg = serde_json::Map::new();
    let mut counts = Vec::new();
    for layers in [0usize, 1, 3, 5] {
        let i1 = callgrind_run(&exe, layers, b1)?;
        let i2 = callgrind_run(&exe, layers, b2)?;
        let v = (i2 as f64 - i1 as f64) / ((b2 - b1) * 32) as f64;
        eprintln!("callgrind: {layers} layers: {v:.1} instructions per message round trip");
        per_msg.insert(layers.to_string(), json!(v));
        counts.push(v);
    }
    // Each probe message crosses the client stack twice (down on send, up on recv); one
    // traversal is what one message costs a sender or a receiver.
    let round_trip = counts[3] - counts[0];
    let d = round_trip / 2.0;
    // The metered stacks: one Metered layer (no recorder; Prometheus recorder) over UDP.
    let mut metered = serde_json::Map::new();
    let mut metered_minus_zero = serde_json::Map::new();
    for mode in ["noop", "prometheus"] {
        let extra = ["--metered".to_string(), mode.to_string()];
        let i1 = callgrind_run_with(&exe, 0, b1, &extra)?;
        let i2 = callgrind_run_with(&exe, 0, b2, &extra)?;
        let v = (i2 as f64 - i1 as f64) / ((b2 - b1) * 32) as f64;
        eprintln!(
            "callgrind: metered ({mode} recorder): {v:.1} instructions per message round trip"
        );
        metered.insert(mode.to_string(), json!(v));
        metered_minus_zero.insert(mode.to_string(), json!((v - counts[0]) / 2.0));
    }
    Ok(json!({
        "workload": "udp, 64 B, bursts of 32; each message is sent and received through the stack",
        "instr_per_msg_round_trip": per_msg,
        "five_minus_zero_per_round_trip": round_trip,
        "five_minus_zero_per_msg": d,
        "per_layer_per_msg": d / 5.0,
        "metered_instr_per_msg_round_trip": metered,
        "metered_minus_zero_per_msg": metered_minus_zero,
        "method": format!("(Ir({b2} bursts) - Ir({b1} bursts)) / (1000 bursts x 32), measured_loop only"),
    }))
}

fn callgrind_run(exe: &Path, layers: usize, bursts: usize) -> Result<u64> {
    callgrind_run_with(exe, layers, bursts, &[])
}

fn callgrind_run_with(exe: &Path, layers: usize, bursts: usize, extra: &[String]) -> Result<u64> {
    let mut args: Vec<String> = [
        "probe",
        "--layers",
        &layers.to_string(),
        "--bursts",
        &bursts.to_string(),
    ]
    .map(String::from)
    .to_vec();
    args.extend_from_slice(extra);
    crate::probe::callgrind_ir(exe, "*measured_loop*", &args)
}
