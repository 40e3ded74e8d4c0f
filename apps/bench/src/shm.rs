//! `chunnel-bench shm`: echo round trip over the shared-memory datapath (`chunnel-shm`)
//! against a raw shared-memory ring written without the library and against kernel UDP
//! through the library.
//!
//! Each configuration runs a client thread pinned to CPU 0 and an echo server thread pinned to
//! CPU 1 (each with its own single-threaded tokio runtime for the library cases), one message
//! in flight, `msgs` timed round trips after a warm-up. The library cases negotiate over UDP
//! with the same server stack `select(LocalFastPath, Identity)`: the shm client offers the same
//! select (shared memory is picked), the UDP client offers `Identity` only (plain UDP is
//! picked). Shared-memory receivers busy-poll (`WaitPolicy::busy_poll`, the lowest-latency
//! setting; it keeps both CPUs busy while running); UDP receivers wait in epoll as usual.
//! Configurations are interleaved, 5 repetitions; figures are the median with min/max, and the
//! UDP/shm p50 ratio per repetition.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ConnectionExt, Identity, Side, select};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_net::udp;
use chunnel_shm::{LocalFastPath, Role, WaitPolicy};
use serde_json::{Value, json};

use crate::stats::{quantile, spread};

const REPS: usize = 5;
const WARMUP: usize = 2000;
const CLIENT_CPU: usize = 0;
const SERVER_CPU: usize = 1;

#[derive(clap::Args, Clone)]
pub(crate) struct Args {
    /// Timed round trips per measurement.
    #[arg(long, default_value_t = 20_000)]
    msgs: usize,
    /// Message size in bytes.
    #[arg(long, default_value_t = 64)]
    size: usize,
}

pub(crate) fn run(a: Args) -> Result<()> {
    let out = measure(a.msgs, a.size)?;
    println!("{out}");
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// The hand-written ring below, no library.
    RawRing,
    /// `chunnel-shm` through negotiation.
    LibShm,
    /// Kernel UDP through negotiation.
    LibUdp,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::RawRing => "raw_ring",
            Mode::LibShm => "chunnel_shm",
            Mode::LibUdp => "chunnel_udp",
        }
    }
}

/// Round-trip times in µs, sorted.
fn summarize(mut ns: Vec<u64>) -> (f64, f64) {
    ns.sort_unstable();
    let us: Vec<f64> = ns.iter().map(|&n| n as f64 / 1000.0).collect();
    (quantile(&us, 0.5), quantile(&us, 0.99))
}

/// p50/p99 echo round trips: shm through the library vs a raw ring vs UDP through the
/// library; see the module docs.
pub(crate) fn measure(msgs: usize, size: usize) -> Result<Value> {
    if size == 0 || size > 60_000 {
        bail!("size must be 1..=60000 (a UDP datagram)");
    }
    let modes = [Mode::RawRing, Mode::LibShm, Mode::LibUdp];
    let mut p50: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut p99: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let started = Instant::now();
    for rep in 0..REPS {
        for (i, &m) in modes.iter().enumerate() {
            let rtts = match m {
                Mode::RawRing => raw_ring(msgs, size),
                Mode::LibShm | Mode::LibUdp => library(m, msgs, size),
            }
            .with_context(|| format!("{} rep {rep}", m.name()))?;
            let (a, b) = summarize(rtts);
            eprintln!(
                "rep {rep} {:>11} {size} B: p50 {a:>7.2} us  p99 {b:>7.2} us",
                m.name()
            );
            p50[i].push(a);
            p99[i].push(b);
        }
    }
    let ratio = |num: usize, den: usize| -> Vec<f64> {
        p50[num].iter().zip(&p50[den]).map(|(n, d)| n / d).collect()
    };
    let udp_over_shm = ratio(2, 1);
    let lib_over_raw = ratio(1, 0);
    let mut results = serde_json::Map::new();
    for (i, m) in modes.iter().enumerate() {
        results.insert(
            m.name().into(),
            json!({ "rtt_p50_us": spread(&p50[i]), "rtt_p99_us": spread(&p99[i]) }),
        );
    }
    let median_ratio = crate::stats::median(&{
        let mut v = udp_over_shm.clone();
        v.sort_by(f64::total_cmp);
        v
    });
    eprintln!("p50 UDP / shm: {median_ratio:.1}x (median of {REPS} reps; bar: >= 5x)");
    Ok(json!({
        "bench": "shm",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "msgs": msgs,
        "size": size,
        "reps": REPS,
        "cpus": { "client": CLIENT_CPU, "server": SERVER_CPU },
        "shm_wait": "busy_poll",
        "wall_seconds": started.elapsed().as_secs_f64(),
        "results": results,
        "p50_ratio_udp_over_shm": spread(&udp_over_shm),
        "p50_ratio_lib_shm_over_raw_ring": spread(&lib_over_raw),
        "checks": { "shm_at_least_5x_lower_p50_than_udp": median_ratio >= 5.0 },
    }))
}

fn pin(cpu: usize) {
    // On a 1-CPU machine the pin fails; run unpinned then (reported by the caller's figures).
    if let Err(e) = crate::pin_to(cpu) {
        eprintln!("warning: {e}");
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn shm_config() -> chunnel_shm::Config {
    chunnel_shm::Config {
        wait: WaitPolicy::busy_poll(),
        ..chunnel_shm::Config::default()
    }
}

/// Echo through the library: a negotiating server thread and a client thread.
fn library(mode: Mode, msgs: usize, size: usize) -> Result<Vec<u64>> {
    let (addr_tx, addr_rx) = std::sync::mpsc::sync_channel(1);
    let server = std::thread::spawn(move || -> Result<Side> {
        pin(SERVER_CPU);
        runtime()?.block_on(async move {
            let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
            addr_tx.send(listener.local_addr()?)?;
            let stack = select(LocalFastPath::new(Role::Server, shm_config()), Identity);
            let mut l = listen(stack, listener, Config::default());
            let conn = tokio::time::timeout(Duration::from_secs(10), l.accept()).await??;
            let side = conn.get_ref().side();
            let mut slots = vec![None; 8];
            // Until the client's end message (an empty datagram) or its close.
            while let Ok(n) = conn.recv(&mut slots).await {
                let batch: Vec<Bytes> = slots[..n].iter_mut().filter_map(Option::take).collect();
                let done = batch.iter().any(|m| m.is_empty());
                conn.send(batch).await?;
                if done {
                    break;
                }
            }
            Ok(side)
        })
    });
    let addr = addr_rx.recv_timeout(Duration::from_secs(10))?;
    let client = std::thread::spawn(move || -> Result<(Side, Vec<u64>)> {
        pin(CLIENT_CPU);
        runtime()?.block_on(async move {
            let base = udp::Connect::new(addr).connect_wrap(()).await?;
            let neg = Client::new(Config::default());
            let key = addr.to_string();
            let payload = Bytes::from(vec![0x5a; size]);
            macro_rules! pingpong {
                ($conn:expr, $side:expr) => {{
                    let conn = $conn;
                    let mut rtts = Vec::with_capacity(msgs);
                    for i in 0..WARMUP + msgs {
                        let t = Instant::now();
                        conn.send_one(payload.clone()).await?;
                        let m = conn.recv_one().await?;
                        let dt = t.elapsed().as_nanos() as u64;
                        anyhow::ensure!(m.len() == size, "echo of the wrong size");
                        if i >= WARMUP {
                            rtts.push(dt);
                        }
                    }
                    conn.send_one(Bytes::new()).await?;
                    let _ = tokio::time::timeout(Duration::from_secs(1), conn.recv_one()).await;
                    Ok(($side, rtts))
                }};
            }
            match mode {
                Mode::LibShm => {
                    let stack = select(LocalFastPath::new(Role::Client, shm_config()), Identity);
                    let conn = neg.connect(&key, stack, base).await?;
                    let side = conn.get_ref().side();
                    pingpong!(conn, side)
                }
                _ => {
                    let conn = neg.connect(&key, Identity, base).await?;
                    pingpong!(conn, Side::Right)
                }
            }
        })
    });
    let (side, rtts) = client
        .join()
        .map_err(|_| anyhow::anyhow!("client panicked"))??;
    let server_side = server
        .join()
        .map_err(|_| anyhow::anyhow!("server panicked"))??;
    let want = if mode == Mode::LibShm {
        Side::Left
    } else {
        Side::Right
    };
    anyhow::ensure!(
        side == want && server_side == want,
        "{}: negotiation picked client {side:?} / server {server_side:?}",
        mode.name()
    );
    Ok(rtts)
}

/// The baseline without the library: two fixed-slot SPSC rings in one `/dev/shm` mapping,
/// head and tail on their own cache lines, busy-polling, each message copied in and out
/// (into a reused buffer).
struct RawRing {
    base: *mut u8,
    slots: u64,
    slot: usize,
}

// SAFETY: the mapping is shared memory used by exactly one producer thread and one consumer
// thread per ring, synchronized by the head/tail atomics.
unsafe impl Send for RawRing {}

impl RawRing {
    const DATA: usize = 128;

    fn head(&self) -> &AtomicU64 {
        // SAFETY: `base` is a page-aligned live mapping of at least DATA bytes; offset 0 is
        // 8-aligned and only ever accessed atomically.
        unsafe { &*(self.base as *const AtomicU64) }
    }

    fn tail(&self) -> &AtomicU64 {
        // SAFETY: as in `head`, at offset 64 (its own cache line).
        unsafe { &*(self.base.add(64) as *const AtomicU64) }
    }

    fn push(&self, head: &mut u64, msg: &[u8]) {
        while *head - self.tail().load(Ordering::Acquire) == self.slots {
            std::hint::spin_loop();
        }
        let at = Self::DATA + (*head % self.slots) as usize * self.slot;
        // SAFETY: the slot lies inside the mapping (slot >= 8 + msg.len(), checked at set-up)
        // and belongs to the producer until `head` is published.
        unsafe {
            std::ptr::write(self.base.add(at) as *mut u64, msg.len() as u64);
            std::ptr::copy_nonoverlapping(msg.as_ptr(), self.base.add(at + 8), msg.len());
        }
        *head += 1;
        self.head().store(*head, Ordering::Release);
    }

    fn pop(&self, tail: &mut u64, buf: &mut Vec<u8>) {
        while self.head().load(Ordering::Acquire) == *tail {
            std::hint::spin_loop();
        }
        let at = Self::DATA + (*tail % self.slots) as usize * self.slot;
        // SAFETY: the slot lies inside the mapping and was published by the producer; the
        // length is our own peer's and clamped to the slot anyway.
        unsafe {
            let len = (std::ptr::read(self.base.add(at) as *const u64) as usize).min(self.slot - 8);
            buf.clear();
            buf.extend_from_slice(std::slice::from_raw_parts(self.base.add(at + 8), len));
        }
        *tail += 1;
        self.tail().store(*tail, Ordering::Release);
    }
}

/// Round trips (ns) over the raw ring (also `lent.rs`'s baseline).
pub(crate) fn raw_ring(msgs: usize, size: usize) -> Result<Vec<u64>> {
    const SLOTS: u64 = 64;
    let slot = (8 + size).div_ceil(64) * 64;
    let ring_len = RawRing::DATA + SLOTS as usize * slot;
    let len = 2 * ring_len;
    let path = format!("/dev/shm/chunnel-bench-raw-{}", std::process::id());
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)?;
    let _ = std::fs::remove_file(&path);
    file.set_len(len as u64)?;
    use std::os::fd::AsRawFd;
    // SAFETY: a fresh shared mapping of the whole (zeroed) file; checked for failure; unmapped
    // below after both threads have finished with it.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if base == libc::MAP_FAILED {
        bail!("mmap: {}", std::io::Error::last_os_error());
    }
    let base = base.cast::<u8>();
    let ring = |i: usize| RawRing {
        // SAFETY: both rings lie inside the mapping (`len = 2 * ring_len`).
        base: unsafe { base.add(i * ring_len) },
        slots: SLOTS,
        slot,
    };
    let (to_server, to_client) = (ring(0), ring(1));
    let (from_client, back) = (ring(0), ring(1));
    let total = WARMUP + msgs;
    let server = std::thread::spawn(move || {
        pin(SERVER_CPU);
        let (mut tail, mut head) = (0u64, 0u64);
        let mut buf = Vec::with_capacity(size);
        for _ in 0..total {
            from_client.pop(&mut tail, &mut buf);
            back.push(&mut head, &buf);
        }
    });
    let client = std::thread::spawn(move || {
        pin(CLIENT_CPU);
        let msg = vec![0x5au8; size];
        let mut buf = Vec::with_capacity(size);
        let (mut head, mut tail) = (0u64, 0u64);
        let mut rtts = Vec::with_capacity(msgs);
        for i in 0..total {
            let t = Instant::now();
            to_server.push(&mut head, &msg);
            to_client.pop(&mut tail, &mut buf);
            let dt = t.elapsed().as_nanos() as u64;
            if i >= WARMUP {
                rtts.push(dt);
            }
        }
        rtts
    });
    let rtts = client.join();
    let served = server.join();
    // SAFETY: both threads have ended; nothing uses the mapping any more.
    unsafe {
        libc::munmap(base.cast(), len);
    }
    served.map_err(|_| anyhow::anyhow!("raw server panicked"))?;
    rtts.map_err(|_| anyhow::anyhow!("raw client panicked"))
}
