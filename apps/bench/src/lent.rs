//! `chunnel-bench lent` (and the `lent` part of `datapaths`): lent (zero-copy) buffers against
//! the copying path of the same datapath, in the same run, for shared memory (`chunnel-shm`)
//! and io_uring (`chunnel-uring`) at 1460 B and 8 KiB.
//!
//! * Throughput, one direction, bursts of 32 for 300 ms (io_uring: bursts of 16, each
//!   acknowledged by the receiver before the next, or after 20 ms if the ack was lost, so the
//!   receiving socket's buffer does not overflow). The sender produces each message's
//!   bytes once (`fill`): copying path into a reused `BytesMut` whose `Bytes` it sends
//!   (shared memory copies them into the ring; io_uring hands them to the kernel), lent path
//!   into buffers from `LendBuffer::lend`, sent with `Emit::emit` (a `None` from `lend` falls
//!   back to a copying send, counted). The receiver reads each message's first and last byte:
//!   copying path `recv` (the datapath copies each message out), lent path `recv_lent` (a
//!   view of the ring slot / the kernel's receive buffer, given back on drop). Rate = messages
//!   the receiver got / time until it acknowledged the end (over UDP, datagrams the receiving
//!   socket dropped are not counted).
//! * Latency: echo round trip, one message in flight: the client sends from lent buffers and
//!   receives lent payloads; the echo server is the copying library echo. Against the raw
//!   baseline of the technology at the same size in the same repetition (`shm.rs`'s raw ring,
//!   `uring.rs`'s raw io_uring echo), with the datapaths' bar.
//!
//! Shared memory: negotiated over UDP, busy-polling, 1 MiB rings (both paths). io_uring: two
//! client connections bound to each other (a connection lends; a listener's connections do
//! not). Client pinned to CPU 0, server to CPU 1, current-thread runtimes; repetitions
//! interleaved; medians with min/max; ratios per repetition.

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use bytes::{Bytes, BytesMut};
use chunnel::{
    Chunnel, ChunnelConnection, ConnectionExt, Either, Emit, Identity, LendRecv, LendStats, select,
};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_net::udp;
use chunnel_shm::{LocalFastPath, Role, WaitPolicy};
use serde_json::{Value, json};

use crate::harness::{CLIENT_CPU, SERVER_CPU, meets_bar};
use crate::stats::{quantile, spread};

const SIZES: [usize; 2] = [1460, 8192];
const BURST: usize = 32;
const TPUT_MILLIS: u64 = 300;
const WARMUP: usize = 1000;
const STALL: Duration = Duration::from_secs(60);
/// Over UDP the sender waits for an ack every this many messages (16 x 8 KiB stays inside a
/// default socket receive buffer), or 20 ms if the ack was lost.
const UDP_WINDOW: usize = 16;

#[derive(clap::Args, Clone)]
pub(crate) struct Args {
    /// Timed round trips per latency measurement.
    #[arg(long, default_value_t = 20_000)]
    msgs: usize,
    /// Repetitions.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Skip io_uring.
    #[arg(long)]
    no_uring: bool,
}

pub(crate) fn run(a: Args) -> Result<()> {
    let started = Instant::now();
    let mut out = crate::harness::run_header("lent", a.msgs, a.reps);
    crate::harness::merge(
        &mut out,
        json!({
            "lent": measure(a.msgs, a.reps, !a.no_uring)?,
            "wall_seconds": started.elapsed().as_secs_f64(),
        }),
    );
    println!("{out}");
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Tech {
    Shm,
    Uring,
}

impl Tech {
    fn name(self) -> &'static str {
        match self {
            Tech::Shm => "shared_memory",
            Tech::Uring => "io_uring",
        }
    }
}

#[derive(Default)]
struct Row {
    raw_p50: Vec<f64>,
    lent_p50: Vec<f64>,
    lent_p99: Vec<f64>,
    copy_tput: Vec<f64>,
    lent_tput: Vec<f64>,
    copy_stats: LendStats,
    lent_stats: LendStats,
}

/// Every row (datapath x size); see the module docs.
pub(crate) fn measure(msgs: usize, reps: usize, uring: bool) -> Result<Value> {
    ensure!(msgs >= 1 && reps >= 1, "need --msgs >= 1 and --reps >= 1");
    let mut techs = vec![Tech::Shm];
    let uring_skip = if !uring {
        Some("--no-uring".to_owned())
    } else if let Err(e) = chunnel_uring::check_available() {
        Some(e.to_string())
    } else {
        techs.push(Tech::Uring);
        None
    };
    let mut rows: Vec<Row> = (0..techs.len() * SIZES.len())
        .map(|_| Row::default())
        .collect();
    for rep in 0..reps {
        for (ti, &t) in techs.iter().enumerate() {
            for (si, &size) in SIZES.iter().enumerate() {
                let row = &mut rows[ti * SIZES.len() + si];
                let ctx = || format!("{} {size} B rep {rep}", t.name());
                let raw = raw_p50(t, msgs, size).with_context(ctx)?;
                let (p50, p99) = latency(t, msgs, size).with_context(ctx)?;
                let (copy, cs) = throughput(t, size, false).with_context(ctx)?;
                let (lent, ls) = throughput(t, size, true).with_context(ctx)?;
                eprintln!(
                    "rep {rep} {:<13} {size:>5} B: raw p50 {raw:>6.2} us  lent p50 {p50:>6.2} us  \
                     copy {copy:>9.0} msg/s  lent {lent:>9.0} msg/s  ({:.2}x)",
                    t.name(),
                    lent / copy
                );
                row.raw_p50.push(raw);
                row.lent_p50.push(p50);
                row.lent_p99.push(p99);
                row.copy_tput.push(copy);
                row.lent_tput.push(lent);
                row.copy_stats = add(row.copy_stats, cs);
                row.lent_stats = add(row.lent_stats, ls);
            }
        }
    }
    let mut out = Vec::new();
    let mut all_meet = true;
    for (ti, &t) in techs.iter().enumerate() {
        for (si, &size) in SIZES.iter().enumerate() {
            let r = &rows[ti * SIZES.len() + si];
            let per = |a: &[f64], b: &[f64]| -> Vec<f64> {
                a.iter().zip(b).map(|(x, y)| x / y).collect()
            };
            let p50_ratio = per(&r.lent_p50, &r.raw_p50);
            let tput_ratio = per(&r.lent_tput, &r.copy_tput);
            let med = |xs: &[f64]| crate::harness::med(xs);
            let meets = meets_bar(med(&r.raw_p50), med(&r.lent_p50), med(&p50_ratio));
            all_meet &= meets;
            out.push(json!({
                "datapath": t.name(),
                "size": size,
                "raw_rtt_p50_us": spread(&r.raw_p50),
                "lent_rtt_p50_us": spread(&r.lent_p50),
                "lent_rtt_p99_us": spread(&r.lent_p99),
                "p50_ratio_lent_over_raw": spread(&p50_ratio),
                "p50_lent_minus_raw_us": med(&r.lent_p50) - med(&r.raw_p50),
                "meets_bar": meets,
                "copy_msgs_per_s": spread(&r.copy_tput),
                "lent_msgs_per_s": spread(&r.lent_tput),
                "throughput_ratio_lent_over_copy": spread(&tput_ratio),
                "counters_copy_path": counters(r.copy_stats),
                "counters_lent_path": counters(r.lent_stats),
            }));
        }
    }
    Ok(json!({
        "what": "lent (zero-copy) buffers vs the copying path of the same datapath, same run; \
                 lent echo p50 vs the raw technology at the same size (lent.rs)",
        "sizes": SIZES,
        "reps": reps,
        "io_uring_skipped": uring_skip,
        "results": out,
        "all_lent_p50_meet_bar": all_meet,
    }))
}

fn add(a: LendStats, b: LendStats) -> LendStats {
    LendStats {
        rx_lent: a.rx_lent + b.rx_lent,
        rx_copied: a.rx_copied + b.rx_copied,
        tx_lent: a.tx_lent + b.tx_lent,
        tx_copied: a.tx_copied + b.tx_copied,
    }
}

fn counters(s: LendStats) -> Value {
    json!({ "rx_lent": s.rx_lent, "rx_copied": s.rx_copied, "tx_lent": s.tx_lent, "tx_copied": s.tx_copied })
}

fn pin(cpu: usize) {
    if let Err(e) = crate::pin_to(cpu) {
        eprintln!("warning: {e}");
    }
}

/// Runs `server` and `client` on their pinned threads (server first; it sends what the
/// client needs), bounded by [`STALL`].
fn two<T, S, C, R>(server: S, client: C) -> Result<R>
where
    T: Send + 'static,
    R: Send + 'static,
    S: FnOnce(mpsc::SyncSender<T>) -> Result<()> + Send + 'static,
    C: FnOnce(T) -> Result<R> + Send + 'static,
{
    let (tx, rx) = mpsc::sync_channel(1);
    let server = std::thread::spawn(move || {
        pin(SERVER_CPU);
        server(tx)
    });
    let Ok(t) = rx.recv_timeout(Duration::from_secs(10)) else {
        let e = server.join().map_err(|_| anyhow!("server panicked"))?;
        return Err(e.err().unwrap_or_else(|| anyhow!("server did not start")));
    };
    let (done_tx, done_rx) = mpsc::sync_channel(1);
    std::thread::spawn(move || {
        pin(CLIENT_CPU);
        let _ = done_tx.send(client(t));
    });
    let r = done_rx
        .recv_timeout(STALL)
        .map_err(|_| anyhow!("stalled for {STALL:?}"))??;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server.is_finished() {
        ensure!(Instant::now() < deadline, "server did not stop");
        std::thread::sleep(Duration::from_millis(2));
    }
    server.join().map_err(|_| anyhow!("server panicked"))??;
    Ok(r)
}

fn raw_p50(t: Tech, msgs: usize, size: usize) -> Result<f64> {
    match t {
        Tech::Shm => {
            let mut ns = crate::shm::raw_ring(msgs, size)?;
            ns.sort_unstable();
            let us: Vec<f64> = ns.iter().map(|&n| n as f64 / 1000.0).collect();
            Ok(quantile(&us, 0.5))
        }
        Tech::Uring => crate::uring::raw_p50(msgs, size),
    }
}

fn rt() -> Result<tokio::runtime::Runtime> {
    crate::harness::runtime()
}

fn shm_cfg() -> chunnel_shm::Config {
    chunnel_shm::Config {
        wait: WaitPolicy::busy_poll(),
        ring_bytes: 1 << 20,
        ..chunnel_shm::Config::default()
    }
}

/// What a connection of either datapath offers here.
trait Lending: ChunnelConnection<Data = Bytes> + LendRecv + Emit {}
impl<T: ChunnelConnection<Data = Bytes> + LendRecv + Emit> Lending for T {}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Serve {
    /// The copying library echo, until an empty message (echoed too).
    Echo,
    /// Count messages (reading their first and last byte), lent or copied, until an empty
    /// one; answer `count | rx_lent | rx_copied`. With `ack`, also send a 1-byte ack after
    /// every [`UDP_WINDOW`] messages (flow control over UDP).
    Count { lent: bool, ack: bool },
}

async fn serve<C: Lending>(c: &C, how: Serve) -> Result<()> {
    match how {
        Serve::Echo => {
            let mut slots = vec![None; BURST];
            loop {
                let n = c.recv(&mut slots).await?;
                let batch: Vec<Bytes> = slots[..n].iter_mut().filter_map(Option::take).collect();
                let done = batch.iter().any(Bytes::is_empty);
                c.send(batch).await?;
                if done {
                    return Ok(());
                }
            }
        }
        Serve::Count { lent, ack } => {
            let mut count = 0u64;
            let mut acked = 0u64;
            let mut sum = 0u64;
            let mut slots: Vec<Option<Bytes>> = vec![None; BURST];
            let mut lslots: Vec<Option<C::Lent>> = (0..BURST).map(|_| None).collect();
            let mut end = false;
            while !end {
                if ack && count - acked >= UDP_WINDOW as u64 {
                    acked = count;
                    c.send_one(Bytes::from_static(b"a")).await?;
                }
                let mut seen = |m: &[u8]| {
                    if m.is_empty() {
                        end = true;
                    } else {
                        count += 1;
                        sum += u64::from(m[0]) + u64::from(m[m.len() - 1]);
                    }
                };
                if lent {
                    let n = c.recv_lent(&mut lslots).await?;
                    for m in lslots[..n].iter_mut().filter_map(Option::take) {
                        seen(m.as_ref());
                    }
                } else {
                    let n = c.recv(&mut slots).await?;
                    for m in slots[..n].iter_mut().filter_map(Option::take) {
                        seen(&m);
                    }
                }
            }
            std::hint::black_box(sum);
            let st = c.lend_stats();
            let mut reply = Vec::with_capacity(24);
            for v in [count, st.rx_lent, st.rx_copied] {
                reply.extend_from_slice(&v.to_be_bytes());
            }
            c.send_one(reply.into()).await?;
            Ok(())
        }
    }
}

/// Lent echo round trips: (p50, p99) in µs.
async fn lent_pings<C: Lending>(c: &C, msgs: usize, size: usize) -> Result<(f64, f64)> {
    let mut one: Vec<Option<C::Lent>> = vec![None];
    let mut rtts = Vec::with_capacity(msgs);
    for i in 0..WARMUP + msgs {
        let t = Instant::now();
        match c.lend(size) {
            Some(mut b) => {
                b.as_mut().fill(0x5a);
                c.emit(std::iter::once(b)).await?;
            }
            None => c.send_one(Bytes::from(vec![0x5a; size])).await?,
        }
        let got = loop {
            if c.recv_lent(&mut one).await? == 1
                && let Some(m) = one[0].take()
            {
                break m;
            }
        };
        let dt = t.elapsed();
        ensure!(got.as_ref().len() == size, "echo of the wrong size");
        drop(got);
        if i >= WARMUP {
            rtts.push(dt.as_nanos() as f64 / 1000.0);
        }
    }
    c.send_one(Bytes::new()).await?;
    let _ = tokio::time::timeout(Duration::from_secs(1), c.recv_one()).await;
    rtts.sort_by(f64::total_cmp);
    Ok((quantile(&rtts, 0.5), quantile(&rtts, 0.99)))
}

/// Streams for [`TPUT_MILLIS`]; returns (messages/s the receiver got, both ends' counters).
async fn stream<C: Lending>(
    c: &C,
    size: usize,
    lent: bool,
    window: Option<usize>,
) -> Result<(f64, LendStats)> {
    let burst_len = window.unwrap_or(BURST);
    let mut bm = BytesMut::with_capacity(2 * BURST * size);
    let mut burst: Vec<Bytes> = Vec::with_capacity(BURST);
    let mut bufs = Vec::with_capacity(BURST);
    let start = Instant::now();
    let deadline = start + Duration::from_millis(TPUT_MILLIS);
    let mut ack: Vec<Option<Bytes>> = vec![None];
    while Instant::now() < deadline {
        for i in 0..burst_len {
            let v = (i as u8) | 1;
            if lent && let Some(mut b) = c.lend(size) {
                b.as_mut().fill(v);
                bufs.push(b);
                continue;
            }
            bm.resize(size, v);
            burst.push(bm.split().freeze());
        }
        if !bufs.is_empty() {
            c.emit(bufs.drain(..)).await?;
        }
        if !burst.is_empty() {
            c.send(burst.drain(..)).await?;
        }
        if window.is_some() {
            let _ = tokio::time::timeout(Duration::from_millis(20), c.recv(&mut ack)).await;
        }
    }
    // The end marker, again until answered (a datagram may be dropped).
    let reply = 'end: {
        for _ in 0..200 {
            c.send_one(Bytes::new()).await?;
            if let Ok(m) = tokio::time::timeout(Duration::from_millis(20), c.recv_one()).await {
                let m = m?;
                if m.len() == 24 {
                    break 'end m;
                }
            }
        }
        bail!("the receiver did not answer the end of the stream");
    };
    let secs = start.elapsed().as_secs_f64();
    let word = |i: usize| u64::from_be_bytes(reply[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let mine = c.lend_stats();
    let stats = LendStats {
        rx_lent: word(1),
        rx_copied: word(2),
        tx_lent: mine.tx_lent,
        tx_copied: mine.tx_copied,
    };
    Ok((word(0) as f64 / secs, stats))
}

#[derive(Clone, Copy, Debug)]
enum Job {
    Pings {
        msgs: usize,
        size: usize,
    },
    Stream {
        size: usize,
        lent: bool,
        window: Option<usize>,
    },
}

enum Out {
    Latency(f64, f64),
    Throughput(f64, LendStats),
}

async fn job<C: Lending>(c: &C, j: Job) -> Result<Out> {
    Ok(match j {
        Job::Pings { msgs, size } => {
            let (a, b) = lent_pings(c, msgs, size).await?;
            Out::Latency(a, b)
        }
        Job::Stream { size, lent, window } => {
            let (a, b) = stream(c, size, lent, window).await?;
            Out::Throughput(a, b)
        }
    })
}

fn run_job(t: Tech, how: Serve, j: Job) -> Result<Out> {
    match t {
        Tech::Shm => two(
            move |tx| shm_server(tx, how),
            move |addr| shm_client(addr, j),
        ),
        Tech::Uring => two(
            move |tx| uring_server(tx, how),
            move |(a, b)| uring_client(a, b, j),
        ),
    }
}

fn latency(t: Tech, msgs: usize, size: usize) -> Result<(f64, f64)> {
    match run_job(t, Serve::Echo, Job::Pings { msgs, size })? {
        Out::Latency(a, b) => Ok((a, b)),
        Out::Throughput(..) => bail!("unexpected result"),
    }
}

fn throughput(t: Tech, size: usize, lent: bool) -> Result<(f64, LendStats)> {
    let ack = t == Tech::Uring;
    let window = ack.then_some(UDP_WINDOW);
    match run_job(
        t,
        Serve::Count { lent, ack },
        Job::Stream { size, lent, window },
    )? {
        Out::Throughput(a, b) => Ok((a, b)),
        Out::Latency(..) => bail!("unexpected result"),
    }
}

fn shm_client(addr: SocketAddr, j: Job) -> Result<Out> {
    rt()?.block_on(async move {
        let base = udp::Connect::new(addr).connect_wrap(()).await?;
        let stack = select(LocalFastPath::new(Role::Client, shm_cfg()), Identity);
        let conn = Client::new(Config::default())
            .connect(&addr.to_string(), stack, base)
            .await?;
        let Either::Left(shm) = conn.get_ref() else {
            bail!("the client did not pick shared memory");
        };
        job(shm, j).await
    })
}

fn uring_cfg() -> chunnel_uring::udp::Config {
    chunnel_uring::udp::Config::default()
        .with_recv_buffers(256)
        .with_send_buffers(64)
}

/// Two free loopback ports (bound and released: the two connections bind them).
fn two_ports() -> Result<(SocketAddr, SocketAddr)> {
    let a = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let b = std::net::UdpSocket::bind("127.0.0.1:0")?;
    Ok((a.local_addr()?, b.local_addr()?))
}

fn uring_server(tx: mpsc::SyncSender<(SocketAddr, SocketAddr)>, how: Serve) -> Result<()> {
    let (a, b) = two_ports()?;
    rt()?.block_on(async move {
        let conn = chunnel_uring::udp::Connect::new(a)
            .with_local_addr(b)
            .with_config(uring_cfg())
            .connect_wrap(())
            .await?;
        tx.send((a, b))?;
        serve(&conn, how).await
    })
}

fn uring_client(a: SocketAddr, b: SocketAddr, j: Job) -> Result<Out> {
    rt()?.block_on(async move {
        let conn = chunnel_uring::udp::Connect::new(b)
            .with_local_addr(a)
            .with_config(uring_cfg())
            .connect_wrap(())
            .await?;
        job(&conn, j).await
    })
}

fn shm_server(tx: mpsc::SyncSender<SocketAddr>, how: Serve) -> Result<()> {
    rt()?.block_on(async move {
        let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
        tx.send(listener.local_addr()?)?;
        let stack = select(LocalFastPath::new(Role::Server, shm_cfg()), Identity);
        let mut l = listen(stack, listener, Config::default());
        let conn = tokio::time::timeout(Duration::from_secs(10), l.accept()).await??;
        let Either::Left(shm) = conn.get_ref() else {
            bail!("the server did not pick shared memory");
        };
        serve(shm, how).await
    })
}
