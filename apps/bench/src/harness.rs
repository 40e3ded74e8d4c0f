//! What several benchmarks share: for the datapath benchmarks (`datapaths`, `lent`, `xdp`) the
//! CPUs they pin to, the sizes of their runs, the JSON header and the latency bar; for the
//! negotiation benchmarks (`negotiate` and its flood) the echo server's task.

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, ensure};
use bytes::Bytes;
use chunnel::{ChunnelConnection, ConnectionExt};
use serde_json::{Value, json};

use crate::stats::{median, quantile, spread};

pub(crate) const CLIENT_CPU: usize = 0;
pub(crate) const SERVER_CPU: usize = 1;
pub(crate) const WARMUP: usize = 2000;
pub(crate) const BURST: usize = 32;
pub(crate) const TPUT_SIZE: usize = 64;
pub(crate) const TPUT_MILLIS: u64 = 300;
/// One run (set-up, latency, throughput) taking longer than this has stalled.
pub(crate) const STALL: Duration = Duration::from_secs(120);

pub(crate) fn med(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    median(&v)
}

/// The fields every datapath benchmark's JSON starts with.
pub(crate) fn run_header(bench: &str, msgs: usize, reps: usize) -> Value {
    json!({
        "bench": bench,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "msgs": msgs,
        "reps": reps,
        "warmup": WARMUP,
        "throughput": { "size": TPUT_SIZE, "burst": BURST, "millis": TPUT_MILLIS },
        "cpus": { "client": CLIENT_CPU, "server": SERVER_CPU },
    })
}

/// Adds `extra`'s fields to the object `v`.
pub(crate) fn merge(v: &mut Value, extra: Value) {
    if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
}

/// The bar on p50 round trips (medians; `ratio` is the median per-repetition ratio).
pub(crate) fn meets_bar(raw_p50: f64, lib_p50: f64, ratio: f64) -> bool {
    if raw_p50 < 10.0 {
        lib_p50 - raw_p50 <= 1.0
    } else {
        ratio <= 1.10
    }
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// The negotiating server's per-connection task: echoes every message. (A block, not an
/// `async fn`, which would hold the connection twice in every task.)
#[allow(clippy::manual_async_fn)]
pub(crate) fn echo<C: ChunnelConnection<Data = Bytes>>(conn: C) -> impl Future<Output = ()> {
    async move {
        while let Ok(m) = conn.recv_one().await {
            if conn.send_one(m).await.is_err() {
                break;
            }
        }
    }
}

#[derive(Default, Clone, Copy)]
pub(crate) struct Sample {
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    /// 64 B messages per second; NaN when not measured.
    pub(crate) msgs_per_s: f64,
}

/// p50, p99 and 64 B throughput over the repetitions of one variant.
pub(crate) fn side_stats(samples: &[Sample], what: &str) -> Value {
    let get = |f: fn(&Sample) -> f64| samples.iter().map(f).collect::<Vec<f64>>();
    json!({
        "what": what,
        "rtt_p50_us": spread(&get(|s| s.p50_us)),
        "rtt_p99_us": spread(&get(|s| s.p99_us)),
        "msgs_per_s_64b": spread(&get(|s| s.msgs_per_s)),
    })
}

/// A library variant against its raw baseline, repetition by repetition: the ratios, the
/// p50 difference and whether the bar holds.
pub(crate) fn compare(raw: &[Sample], lib: &[Sample]) -> Value {
    let per_rep = |f: fn(&Sample) -> f64| -> Vec<f64> {
        lib.iter().zip(raw).map(|(l, r)| f(l) / f(r)).collect()
    };
    let raw_p50 = med(&raw.iter().map(|s| s.p50_us).collect::<Vec<_>>());
    let lib_p50 = med(&lib.iter().map(|s| s.p50_us).collect::<Vec<_>>());
    let ratio = med(&per_rep(|s| s.p50_us));
    json!({
        "p50_ratio_lib_over_raw": spread(&per_rep(|s| s.p50_us)),
        "p99_ratio_lib_over_raw": spread(&per_rep(|s| s.p99_us)),
        "throughput_ratio_lib_over_raw": spread(&per_rep(|s| s.msgs_per_s)),
        "p50_lib_minus_raw_us": lib_p50 - raw_p50,
        "meets_bar": meets_bar(raw_p50, lib_p50, ratio),
    })
}

fn pin(cpu: usize) {
    if let Err(e) = crate::pin_to(cpu) {
        eprintln!("warning: {e}");
    }
}

pub(crate) fn summarize(mut ns: Vec<u64>, msgs_per_s: f64) -> Sample {
    ns.sort_unstable();
    let us: Vec<f64> = ns.iter().map(|&n| n as f64 / 1000.0).collect();
    Sample {
        p50_us: quantile(&us, 0.5),
        p99_us: quantile(&us, 0.99),
        msgs_per_s,
    }
}

/// Runs `server` (pinned to the server CPU; it reports its address, then serves until the
/// client's end message) and `client` (pinned to the client CPU), bounded by [`STALL`].
pub(crate) fn pair<S, C>(server: S, client: C) -> Result<Sample>
where
    S: FnOnce(mpsc::SyncSender<SocketAddr>) -> Result<()> + Send + 'static,
    C: FnOnce(SocketAddr) -> Result<Sample> + Send + 'static,
{
    let (addr_tx, addr_rx) = mpsc::sync_channel(1);
    let server = std::thread::spawn(move || {
        pin(SERVER_CPU);
        server(addr_tx)
    });
    let addr = match addr_rx.recv_timeout(Duration::from_secs(10)) {
        Ok(a) => a,
        Err(_) => {
            let e = server.join().map_err(|_| anyhow!("server panicked"))?;
            return Err(e.err().unwrap_or_else(|| anyhow!("server did not start")));
        }
    };
    let (done_tx, done_rx) = mpsc::sync_channel(1);
    std::thread::spawn(move || {
        pin(CLIENT_CPU);
        let _ = done_tx.send(client(addr));
    });
    // A stalled run leaves its threads behind (the process ends soon after) and fails.
    let sample = done_rx
        .recv_timeout(STALL)
        .map_err(|_| anyhow!("stalled for {STALL:?}"))??;
    let deadline = Instant::now() + Duration::from_secs(15);
    while !server.is_finished() {
        ensure!(Instant::now() < deadline, "server did not stop");
        std::thread::sleep(Duration::from_millis(2));
    }
    server.join().map_err(|_| anyhow!("server panicked"))??;
    Ok(sample)
}

// ------------------------------------------------------------------------------------------
// Kernel UDP.

/// The raw kernel UDP client loop (also the AF_XDP datapath's client, in its namespace).
pub(crate) fn raw_tokio_client(addr: SocketAddr, msgs: usize, size: usize) -> Result<Sample> {
    runtime()?.block_on(async move {
        let local = if addr.ip().is_loopback() {
            "127.0.0.1:0"
        } else {
            "0.0.0.0:0"
        };
        let sock = tokio::net::UdpSocket::bind(local).await?;
        sock.connect(addr).await?;
        let msg = vec![0xabu8; size];
        let small = [0xcdu8; TPUT_SIZE];
        let mut buf = vec![0u8; 65_536];
        let mut rtts = Vec::with_capacity(msgs);
        for i in 0..WARMUP + msgs {
            let t = Instant::now();
            sock.send(&msg).await?;
            let n = sock.recv(&mut buf).await?;
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
                sock.send(&small).await?;
            }
            for _ in 0..BURST {
                tokio::time::timeout(Duration::from_secs(5), sock.recv(&mut buf)).await??;
            }
            done += BURST as u64;
        }
        let tput = done as f64 / start.elapsed().as_secs_f64();
        sock.send(&[]).await?;
        let _ = tokio::time::timeout(Duration::from_secs(1), sock.recv(&mut buf)).await;
        Ok(summarize(rtts, tput))
    })
}

/// Echoes every burst until an empty message (echoed too); 10 s of silence is an error.
pub(crate) async fn echo_until_empty<C: ChunnelConnection<Data = Bytes>>(conn: &C) -> Result<()> {
    let mut slots = vec![None; BURST];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), conn.recv(&mut slots)).await??;
        let batch: Vec<Bytes> = slots[..n].iter_mut().filter_map(Option::take).collect();
        let done = batch.iter().any(|m| m.is_empty());
        conn.send(batch).await?;
        if done {
            return Ok(());
        }
    }
}

async fn recv_exact<C: ChunnelConnection<Data = Bytes>>(
    conn: &C,
    slots: &mut [Option<Bytes>],
) -> Result<()> {
    let mut got = 0;
    while got < slots.len() {
        got += tokio::time::timeout(Duration::from_secs(5), conn.recv(&mut slots[got..])).await??;
    }
    for s in slots.iter_mut() {
        *s = None;
    }
    Ok(())
}

/// Warm-up, `msgs` timed round trips of `size` bytes, optionally 64 B throughput, then the
/// end message.
pub(crate) async fn ping<C: ChunnelConnection<Data = Bytes>>(
    conn: &C,
    msgs: usize,
    size: usize,
    tput: bool,
) -> Result<Sample> {
    let msg = Bytes::from(vec![0xabu8; size]);
    let mut slots = vec![None; BURST];
    let mut rtts = Vec::with_capacity(msgs);
    for i in 0..WARMUP + msgs {
        let t = Instant::now();
        conn.send([msg.clone()]).await?;
        let n = conn.recv(&mut slots[..1]).await?;
        let dt = t.elapsed().as_nanos() as u64;
        ensure!(
            n == 1 && slots[0].take().map(|m| m.len()) == Some(size),
            "echo of the wrong size"
        );
        if i >= WARMUP {
            rtts.push(dt);
        }
    }
    let mut rate = f64::NAN;
    if tput {
        let small = Bytes::from(vec![0xcdu8; TPUT_SIZE]);
        let start = Instant::now();
        let deadline = start + Duration::from_millis(TPUT_MILLIS);
        let mut done = 0u64;
        while Instant::now() < deadline {
            conn.send(std::iter::repeat_n(&small, BURST).cloned())
                .await?;
            recv_exact(conn, &mut slots).await?;
            done += BURST as u64;
        }
        rate = done as f64 / start.elapsed().as_secs_f64();
    }
    conn.send([Bytes::new()]).await?;
    let _ = tokio::time::timeout(Duration::from_secs(1), conn.recv(&mut slots[..1])).await;
    Ok(summarize(rtts, rate))
}

// ------------------------------------------------------------------------------------------
// Figure 7: shared memory + N no-op layers.
