//! `chunnel-bench uring`: the io_uring UDP datapath (`chunnel-uring`) against a raw io_uring
//! UDP echo written without the library.
//!
//! Variants, each an echo over loopback with the client on one core and the server on
//! another (when the machine has two):
//! * `raw_uring`: the `io-uring` crate directly, one thread per side, no runtime. Client:
//!   `Send` + `Recv` entries submitted together, `submit_and_wait(2)` (one `io_uring_enter`
//!   per round trip); for throughput, 32 `Send`s in one enter, then one `Recv` at a time.
//!   Server: one `RecvMsg` outstanding; each datagram is echoed from its own buffer with a
//!   `SendMsg` (zero copy) while the next `RecvMsg` is armed, in the same enter. (Several
//!   receives outstanding on one socket are all woken by every datagram: slower.)
//! * `uring_lib`: `chunnel_uring::udp::Connect` against a `chunnel_uring::udp::Listener` echo,
//!   each side on its own current-thread tokio runtime.
//! * `uring_lib_any_thread` (context): the same with `Config::single_thread` off (the ring
//!   does not defer completion work; what a multi-thread runtime gets).
//! * `kernel_lib` (context only): the same echo over `chunnel_net::udp` (tokio, `sendmmsg` /
//!   `recvmmsg`).
//!
//! Latency: one message of `size` bytes in flight, `msgs` round trips after 500 of warm-up,
//! p50/p99. Throughput: 64-byte messages in bursts of 32 (send 32, receive 32) for 300 ms,
//! messages/s. Variants are interleaved and repeated 5 times; figures are medians with
//! min/max, and ratios are taken per repetition.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Listener};
use io_uring::{IoUring, cqueue, opcode, types};
use serde_json::{Value, json};

use crate::stats::{quantile, spread};

const WARMUP: usize = 500;
const BURST: usize = 32;
const TPUT_MILLIS: u64 = 300;
const TPUT_SIZE: usize = 64;
/// Any single variant run that takes longer than this counts as stalled.
const STALL: Duration = Duration::from_secs(120);

/// Repetitions (each runs every variant, interleaved).
const REPS: usize = 5;

#[derive(clap::Args, Clone)]
pub(crate) struct Args {
    /// Round trips per latency measurement.
    #[arg(long, default_value_t = 20_000)]
    msgs: usize,
    /// Payload of the latency messages, in bytes.
    #[arg(long, default_value_t = 64)]
    size: usize,
}

pub(crate) fn run(a: Args) -> Result<()> {
    let started = Instant::now();
    let mut out = measure(a.msgs, a.size)?;
    let o = out.as_object_mut().expect("object");
    o.insert("bench".into(), json!("uring"));
    o.insert(
        "command".into(),
        json!(std::env::args().collect::<Vec<_>>().join(" ")),
    );
    o.insert(
        "wall_seconds".into(),
        json!(started.elapsed().as_secs_f64()),
    );
    println!("{out}");
    Ok(())
}

/// Echo round-trip p50/p99 (µs, `size`-byte messages, `msgs` round trips) and 64 B
/// throughput for a raw io_uring echo, the io_uring datapath through the library, and (for
/// context) the kernel UDP datapath through the library; 5 interleaved repetitions.
pub(crate) fn measure(msgs: usize, size: usize) -> Result<Value> {
    measure_reps(msgs, size, REPS)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    RawUring,
    UringLib,
    UringLibAnyThread,
    KernelLib,
}

const VARIANTS: [Variant; 4] = [
    Variant::RawUring,
    Variant::UringLib,
    Variant::UringLibAnyThread,
    Variant::KernelLib,
];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::RawUring => "raw_uring",
            Variant::UringLib => "uring_lib",
            Variant::UringLibAnyThread => "uring_lib_any_thread",
            Variant::KernelLib => "kernel_lib",
        }
    }
}

struct Sample {
    p50_us: f64,
    p99_us: f64,
    msgs_per_s: f64,
}

fn cpus() -> (Option<usize>, Option<usize>) {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    if n >= 2 {
        (Some(0), Some(1))
    } else {
        (None, None)
    }
}

fn measure_reps(msgs: usize, size: usize, reps: usize) -> Result<Value> {
    ensure!(
        msgs >= 1 && reps >= 1,
        "need at least one message and one repetition"
    );
    ensure!(
        (1..=udp_max()).contains(&size),
        "size must be 1..={} bytes",
        udp_max()
    );
    chunnel_uring::check_available().map_err(|e| anyhow!("io_uring datapath: {e}"))?;
    let (client_cpu, server_cpu) = cpus();
    let mut samples: Vec<Vec<Sample>> = VARIANTS.iter().map(|_| Vec::new()).collect();
    for rep in 0..reps {
        for (i, &v) in VARIANTS.iter().enumerate() {
            let s = run_variant(v, msgs, size, client_cpu, server_cpu)
                .with_context(|| format!("rep {rep} {}", v.name()))?;
            eprintln!(
                "rep {rep} {:<10} {size:>5} B: p50 {:>7.1} us  p99 {:>7.1} us  | 64 B x{BURST}: {:>9.0} msg/s",
                v.name(),
                s.p50_us,
                s.p99_us,
                s.msgs_per_s
            );
            samples[i].push(s);
        }
    }
    let get = |i: usize, f: fn(&Sample) -> f64| samples[i].iter().map(f).collect::<Vec<_>>();
    let ratio = |i: usize, f: fn(&Sample) -> f64| -> Vec<f64> {
        get(i, f)
            .iter()
            .zip(get(0, f))
            .map(|(x, r)| x / r)
            .collect()
    };
    let mut variants = serde_json::Map::new();
    for (i, v) in VARIANTS.iter().enumerate() {
        variants.insert(
            v.name().into(),
            json!({
                "rtt_p50_us": spread(&get(i, |s| s.p50_us)),
                "rtt_p99_us": spread(&get(i, |s| s.p99_us)),
                "msgs_per_s_64b": spread(&get(i, |s| s.msgs_per_s)),
                "p50_ratio_to_raw": spread(&ratio(i, |s| s.p50_us)),
                "p99_ratio_to_raw": spread(&ratio(i, |s| s.p99_us)),
                "throughput_ratio_to_raw": spread(&ratio(i, |s| s.msgs_per_s)),
            }),
        );
    }
    let p50_ratio = variants["uring_lib"]["p50_ratio_to_raw"]["median"]
        .as_f64()
        .unwrap_or(f64::NAN);
    eprintln!(
        "\nuring_lib / raw_uring p50 round trip: {p50_ratio:.3} (median of {reps} reps; bar <= 1.10)"
    );
    Ok(json!({
        "msgs": msgs,
        "size": size,
        "reps": reps,
        "throughput": { "size": TPUT_SIZE, "burst": BURST, "millis": TPUT_MILLIS },
        "placement": {
            "client_cpu": client_cpu,
            "server_cpu": server_cpu,
            "what": "client thread pinned to client_cpu, server thread to server_cpu (each \
                     with its own current-thread runtime for the library variants)",
        },
        "variants": variants,
        "checks": {
            "uring_lib_p50_ratio_to_raw": p50_ratio,
            "uring_lib_within_10pct_of_raw_p50": p50_ratio <= 1.10,
        },
    }))
}

/// The raw io_uring echo's p50 (µs) at `size` (`lent.rs`'s baseline).
pub(crate) fn raw_p50(msgs: usize, size: usize) -> Result<f64> {
    let (c, s) = cpus();
    Ok(run_variant(Variant::RawUring, msgs, size, c, s)?.p50_us)
}

fn udp_max() -> usize {
    chunnel_uring::udp::MAX_PAYLOAD
}

/// Runs one variant: a server thread and a client thread, pinned; bounded by [`STALL`].
fn run_variant(
    v: Variant,
    msgs: usize,
    size: usize,
    client_cpu: Option<usize>,
    server_cpu: Option<usize>,
) -> Result<Sample> {
    let (addr_tx, addr_rx) = mpsc::sync_channel::<Result<SocketAddr>>(1);
    let (stop_tx, stop_rx) = mpsc::sync_channel::<()>(1);
    let server = std::thread::Builder::new()
        .name(format!("{}-server", v.name()))
        .spawn(move || -> Result<()> {
            if let Some(c) = server_cpu {
                crate::pin_to(c)?;
            }
            match v {
                Variant::RawUring => raw_server(addr_tx, stop_rx),
                Variant::UringLib | Variant::UringLibAnyThread | Variant::KernelLib => {
                    lib_server(v, addr_tx, stop_rx)
                }
            }
        })?;
    let addr = addr_rx
        .recv_timeout(Duration::from_secs(10))
        .context("server did not start")??;
    let (done_tx, done_rx) = mpsc::sync_channel::<Result<Sample>>(1);
    std::thread::Builder::new()
        .name(format!("{}-client", v.name()))
        .spawn(move || {
            let r = (|| {
                if let Some(c) = client_cpu {
                    crate::pin_to(c)?;
                }
                match v {
                    Variant::RawUring => raw_client(addr, msgs, size),
                    Variant::UringLib | Variant::UringLibAnyThread | Variant::KernelLib => {
                        lib_client(v, addr, msgs, size)
                    }
                }
            })();
            let _ = done_tx.send(r);
        })?;
    // A stalled run leaves its threads behind (the process ends soon after) and fails.
    let sample = done_rx
        .recv_timeout(STALL)
        .map_err(|_| anyhow!("{} stalled for {STALL:?}", v.name()))??;
    let _ = stop_tx.send(());
    if v == Variant::RawUring {
        // The raw server blocks in io_uring_enter: wake it with a stop datagram.
        let s = std::net::UdpSocket::bind("127.0.0.1:0")?;
        s.send_to(STOP, addr)?;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server.is_finished() {
        ensure!(Instant::now() < deadline, "server did not stop");
        std::thread::sleep(Duration::from_millis(5));
    }
    server
        .join()
        .map_err(|_| anyhow!("server thread panicked"))??;
    Ok(sample)
}

fn summarize(mut rtts: Vec<f64>, msgs_per_s: f64) -> Sample {
    rtts.sort_by(f64::total_cmp);
    Sample {
        p50_us: quantile(&rtts, 0.5),
        p99_us: quantile(&rtts, 0.99),
        msgs_per_s,
    }
}

// ------------------------------------------------------------------------------------------
// Through the library.

/// `uring_lib` leaves `single_thread` to its default (yes on these current-thread runtimes:
/// the ring defers completion work to its thread); `uring_lib_any_thread` turns it off, as on
/// a multi-thread runtime.
fn uring_cfg(v: Variant) -> chunnel_uring::udp::Config {
    let cfg = chunnel_uring::udp::Config::default();
    match v {
        Variant::UringLibAnyThread => cfg.with_single_thread(Some(false)),
        _ => cfg,
    }
}

fn lib_server(
    v: Variant,
    addr_tx: mpsc::SyncSender<Result<SocketAddr>>,
    stop_rx: mpsc::Receiver<()>,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let any: SocketAddr = "127.0.0.1:0".parse()?;
        match v {
            Variant::UringLib | Variant::UringLibAnyThread => {
                let bound = chunnel_uring::udp::Listener::bind_with(any, uring_cfg(v))
                    .await
                    .and_then(|l| Ok((l.local_addr()?, l)));
                announce_and_echo(bound, addr_tx, stop_rx).await
            }
            _ => {
                let bound = chunnel_net::udp::Listener::bind(any)
                    .await
                    .and_then(|l| Ok((l.local_addr()?, l)));
                announce_and_echo(bound, addr_tx, stop_rx).await
            }
        }
    })
}

/// Tells the bound address (or the error) to the waiting client side, then echoes.
async fn announce_and_echo<L>(
    bound: Result<(SocketAddr, L), chunnel::Error>,
    addr_tx: mpsc::SyncSender<Result<SocketAddr>>,
    stop_rx: mpsc::Receiver<()>,
) -> Result<()>
where
    L: Listener,
    L::Connection: ChunnelConnection<Data = Bytes>,
{
    match bound {
        Ok((addr, l)) => {
            let _ = addr_tx.send(Ok(addr));
            echo(l, stop_rx).await
        }
        Err(e) => {
            let _ = addr_tx.send(Err(e.into()));
            Ok(())
        }
    }
}

/// Accepts one peer and echoes every burst back until told to stop.
async fn echo<L>(mut l: L, stop_rx: mpsc::Receiver<()>) -> Result<()>
where
    L: Listener,
    L::Connection: ChunnelConnection<Data = Bytes>,
{
    let stopped = || stop_rx.try_recv().is_ok();
    let conn = loop {
        match tokio::time::timeout(Duration::from_millis(100), l.accept()).await {
            Ok(c) => break c?,
            Err(_) if stopped() => return Ok(()),
            Err(_) => {}
        }
    };
    let mut slots = vec![None; BURST];
    loop {
        match tokio::time::timeout(Duration::from_millis(100), conn.recv(&mut slots)).await {
            Ok(n) => {
                let n = n?;
                conn.send(slots[..n].iter_mut().filter_map(Option::take))
                    .await?;
            }
            Err(_) if stopped() => return Ok(()),
            Err(_) => {}
        }
    }
}

fn lib_client(v: Variant, addr: SocketAddr, msgs: usize, size: usize) -> Result<Sample> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match v {
            Variant::UringLib | Variant::UringLibAnyThread => {
                let c = chunnel_uring::udp::Connect::new(addr)
                    .with_config(uring_cfg(v))
                    .connect_wrap(())
                    .await?;
                lib_client_on(&c, msgs, size).await
            }
            _ => {
                let c = chunnel_net::udp::Connect::new(addr)
                    .connect_wrap(())
                    .await?;
                lib_client_on(&c, msgs, size).await
            }
        }
    })
}

async fn lib_client_on<C: ChunnelConnection<Data = Bytes>>(
    conn: &C,
    msgs: usize,
    size: usize,
) -> Result<Sample> {
    let msg = Bytes::from(vec![0xabu8; size]);
    let mut slots = vec![None; BURST];
    let mut rtts = Vec::with_capacity(msgs);
    for i in 0..WARMUP + msgs {
        let t = Instant::now();
        conn.send([msg.clone()]).await?;
        recv_exact(conn, &mut slots[..1]).await?;
        if i >= WARMUP {
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
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
    Ok(summarize(rtts, done as f64 / start.elapsed().as_secs_f64()))
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

// ------------------------------------------------------------------------------------------
// Raw io_uring, without the library.

/// Tells the raw server to stop (a datagram no client of this benchmark sends otherwise).
const STOP: &[u8] = b"\xffchunnel-bench-stop";
const RAW_SLOTS: usize = 8;
const RAW_BUF: usize = 65_536;
const SEND_BIT: u64 = 1 << 32;

/// One receive-then-echo slot of the raw server (boxed: the kernel holds pointers into it).
struct RawSlot {
    buf: Vec<u8>,
    iov: libc::iovec,
    name: libc::sockaddr_storage,
    msg: libc::msghdr,
}

fn raw_server(
    addr_tx: mpsc::SyncSender<Result<SocketAddr>>,
    _stop_rx: mpsc::Receiver<()>,
) -> Result<()> {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let _ = addr_tx.send(sock.local_addr().map_err(Into::into));
    let fd = types::Fd(sock.as_raw_fd());
    // Declared before the ring, so that on every path the ring (cancelling what is still in
    // flight) is dropped before the memory it points into.
    let mut slots: Vec<Box<RawSlot>> = (0..RAW_SLOTS)
        .map(|_| {
            Box::new(RawSlot {
                buf: vec![0u8; RAW_BUF],
                iov: libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                },
                // SAFETY: plain old data; all-zero is valid.
                name: unsafe { std::mem::zeroed() },
                // SAFETY: as above.
                msg: unsafe { std::mem::zeroed() },
            })
        })
        .collect();
    let mut ring = IoUring::new(4 * RAW_SLOTS as u32)?;
    let mut free: Vec<usize> = (1..RAW_SLOTS).collect();
    let arm = |ring: &mut IoUring, s: &mut RawSlot, i: usize| -> Result<()> {
        s.iov = libc::iovec {
            iov_base: s.buf.as_mut_ptr().cast(),
            iov_len: s.buf.len(),
        };
        s.msg.msg_name = (&mut s.name as *mut libc::sockaddr_storage).cast();
        s.msg.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as u32;
        s.msg.msg_iov = &mut s.iov;
        s.msg.msg_iovlen = 1;
        let e = opcode::RecvMsg::new(fd, &mut s.msg)
            .build()
            .user_data(i as u64);
        // SAFETY: the slot is boxed and outlives the ring's use of it (the ring is dropped
        // first; see the end of this function).
        unsafe { ring.submission().push(&e) }.map_err(|_| anyhow!("submission queue full"))?;
        Ok(())
    };
    // One receive outstanding at a time (several on one socket would all be woken by every
    // datagram); each datagram is echoed from its own buffer while the next receive is armed
    // on a free one, in the same io_uring_enter.
    arm(&mut ring, &mut slots[0], 0)?;
    'outer: loop {
        ring.submit_and_wait(1)?;
        let cqes: Vec<cqueue::Entry> = ring.completion().collect();
        for c in cqes {
            let ud = c.user_data();
            let i = (ud & 0xffff) as usize;
            if ud & SEND_BIT != 0 {
                free.push(i);
                continue;
            }
            if c.result() < 0 {
                bail!(
                    "raw server recvmsg: {}",
                    std::io::Error::from_raw_os_error(-c.result())
                );
            }
            let n = c.result() as usize;
            if &slots[i].buf[..n] == STOP {
                break 'outer;
            }
            let s = &mut slots[i];
            s.iov.iov_len = n;
            let e = opcode::SendMsg::new(fd, &s.msg)
                .build()
                .user_data(SEND_BIT | i as u64);
            // SAFETY: as above.
            unsafe { ring.submission().push(&e) }.map_err(|_| anyhow!("submission queue full"))?;
            let j = free.pop().context("raw server: no free buffer")?;
            arm(&mut ring, &mut slots[j], j)?;
        }
    }
    // Close the ring (cancelling the pending receive) before the slots go.
    drop(ring);
    drop(slots);
    Ok(())
}

fn raw_client(addr: SocketAddr, msgs: usize, size: usize) -> Result<Sample> {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0")?;
    sock.connect(addr)?;
    let fd = types::Fd(sock.as_raw_fd());
    // The buffers are declared before the ring, so that on every path (errors included) the
    // ring is dropped first.
    let msg = vec![0xabu8; size];
    let mut bufs = vec![vec![0u8; RAW_BUF]; 1];
    let small = [0xcdu8; TPUT_SIZE];
    let mut ring = IoUring::new(2 * BURST as u32)?;
    let mut rtts = Vec::with_capacity(msgs);
    for i in 0..WARMUP + msgs {
        let t = Instant::now();
        let send = opcode::Send::new(fd, msg.as_ptr(), msg.len() as u32)
            .build()
            .user_data(SEND_BIT);
        let recv = opcode::Recv::new(fd, bufs[0].as_mut_ptr(), RAW_BUF as u32)
            .build()
            .user_data(0);
        // SAFETY: `msg` and `bufs` outlive the completions, which are awaited right here.
        unsafe {
            let mut sq = ring.submission();
            sq.push(&send).map_err(|_| anyhow!("sq full"))?;
            sq.push(&recv).map_err(|_| anyhow!("sq full"))?;
        }
        wait_all(&mut ring, 2, size)?;
        if i >= WARMUP {
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let start = Instant::now();
    let deadline = start + Duration::from_millis(TPUT_MILLIS);
    let mut done = 0u64;
    while Instant::now() < deadline {
        {
            let mut sq = ring.submission();
            for _ in 0..BURST {
                let send = opcode::Send::new(fd, small.as_ptr(), TPUT_SIZE as u32)
                    .build()
                    .user_data(SEND_BIT);
                // SAFETY: as above.
                unsafe { sq.push(&send) }.map_err(|_| anyhow!("sq full"))?;
            }
        }
        wait_all(&mut ring, BURST, TPUT_SIZE)?;
        // One receive at a time (it completes inline while datagrams are queued).
        for _ in 0..BURST {
            let recv = opcode::Recv::new(fd, bufs[0].as_mut_ptr(), RAW_BUF as u32)
                .build()
                .user_data(0);
            // SAFETY: as above.
            unsafe { ring.submission().push(&recv) }.map_err(|_| anyhow!("sq full"))?;
            wait_all(&mut ring, 1, TPUT_SIZE)?;
        }
        done += BURST as u64;
    }
    Ok(summarize(rtts, done as f64 / start.elapsed().as_secs_f64()))
}

/// Submits what is queued and waits for `n` completions, checking every result.
fn wait_all(ring: &mut IoUring, n: usize, size: usize) -> Result<()> {
    let mut seen = 0;
    let mut first = true;
    while seen < n {
        if first {
            ring.submit_and_wait(n)?;
            first = false;
        } else {
            ring.submitter().submit_and_wait(n - seen)?;
        }
        for c in ring.completion() {
            ensure!(
                c.result() == size as i32,
                "raw client: result {} (expected {size})",
                c.result()
            );
            seen += 1;
        }
    }
    Ok(())
}
