//! `chunnel-bench kv`: the sharded key-value store under a YCSB-style open-loop load (paper
//! §7.3, Figure 6, and §8.2, Figure 9), with `chunnel_kv::ycsb`.
//!
//! * **Sweep** (Figure 6): p50/p95/p99 latency vs offered load (Poisson arrivals, latency
//!   from the scheduled send time) for client push and server-side sharding against one
//!   `KvServer` with `--shards` shards; each mode stops at the first load whose median p95
//!   (over repetitions) exceeds `--p95-bound-us` or whose median repetition skipped, lost or
//!   left unanswered a request. Reported:
//!   the largest offered load meeting the bound per mode, and their ratio.
//! * **Full vs inline** (Figure 9): at one moderate load (`--ab-load`), "full" (the store as
//!   built: negotiation, serialization and client-push sharding Chunnels) against
//!   "no_chunnels" (the same GET/PUT logic and `Store`, hand-encoded requests over raw tokio
//!   UDP sockets, client push to the shard sockets, request-id multiplexing on one socket per
//!   shard, the same retry policy) and "no_chunnels_no_mux" (one outstanding request per
//!   socket: a pool of sockets per shard, no id matching).
//!
//! Placement (this machine has 2 cores): the load generator and the client, one
//! current-thread runtime that busy-polls the clock, on `--cpu` (default 0); every server
//! thread — the canonical listener's runtime (which does the forwarding of server-side
//! sharding), the `--shards` shard threads and the inline servers' shard threads — on
//! `--server-cpu` (default 1; negative: unpinned).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use chunnel_kv::ycsb::{self, KeyDist, OpGen, RunConfig, RunStats, Target, Workload};
use chunnel_kv::{
    ClientConfig, KvClient, KvError, KvServer, Msg, Offer, Op, ServerConfig, Sharding, Store,
};
use serde_json::{Value, json};
use tokio::net::UdpSocket;
use tokio::sync::{Semaphore, oneshot};

use crate::stats::{median, spread};

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum WorkloadArg {
    A,
    B,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum DistArg {
    Uniform,
    Zipfian,
}

#[derive(clap::Args, Clone)]
pub(crate) struct Args {
    /// Repetitions of every measured point (interleaved across modes).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Shards of the server.
    #[arg(long, default_value_t = 2)]
    shards: usize,
    /// Records inserted by the load phase.
    #[arg(long, default_value_t = 12_000)]
    records: u64,
    /// Bytes per value.
    #[arg(long, default_value_t = 100)]
    value_size: usize,
    /// YCSB workload: A (50/50) or B (95/5 read/update).
    #[arg(long, value_enum, default_value = "b")]
    workload: WorkloadArg,
    /// Key choice.
    #[arg(long, value_enum, default_value = "zipfian")]
    dist: DistArg,
    /// Offered loads of the sweep, requests per second, ascending.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "5000,10000,20000,40000,60000,70000,80000,100000,120000"
    )]
    loads: Vec<f64>,
    /// The p95 latency bound of the sweep, microseconds.
    #[arg(long, default_value_t = 200.0)]
    p95_bound_us: f64,
    /// Warm-up of every run phase (issued, not recorded), milliseconds.
    #[arg(long, default_value_t = 300)]
    warmup_ms: u64,
    /// Recorded part of every sweep run phase, milliseconds.
    #[arg(long, default_value_t = 1000)]
    run_ms: u64,
    /// Offered load of the full-vs-inline comparison, requests per second.
    #[arg(long, default_value_t = 10_000.0)]
    ab_load: f64,
    /// Recorded part of every full-vs-inline run phase, milliseconds.
    #[arg(long, default_value_t = 1000)]
    ab_ms: u64,
    /// Skip the full-vs-inline comparison.
    #[arg(long)]
    no_ab: bool,
    /// CPU of the load generator and client; negative to leave unpinned.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    cpu: i64,
    /// CPU of every server thread; negative to leave unpinned.
    #[arg(long, default_value_t = 1, allow_hyphen_values = true)]
    server_cpu: i64,
    /// Profiling aid: run only this variant (client_push, server_side, full, no_chunnels,
    /// no_chunnels_no_mux) at `--profile-load` for `--profile-ms`, print its figures on
    /// stderr and exit (no JSON). For `perf` / `strace` on one path. `paired`: only the
    /// paired full/no_chunnels comparison, `--reps` runs (for quick A/B of a change).
    #[arg(long, hide = true)]
    profile: Option<String>,
    /// Offered load with `--profile`.
    #[arg(long, hide = true, default_value_t = 20_000.0)]
    profile_load: f64,
    /// Recorded milliseconds with `--profile`.
    #[arg(long, hide = true, default_value_t = 5000)]
    profile_ms: u64,
}

impl Args {
    fn workload(&self) -> Workload {
        match self.workload {
            WorkloadArg::A => Workload::A,
            WorkloadArg::B => Workload::B,
        }
    }

    fn keys(&self) -> KeyDist {
        match self.dist {
            DistArg::Uniform => KeyDist::uniform(self.records),
            DistArg::Zipfian => KeyDist::zipfian(self.records),
        }
    }

    fn ops(&self, seed: u64) -> OpGen {
        OpGen::new(self.workload(), self.keys(), self.value_size, seed)
    }
}

fn cpu_opt(c: i64) -> Option<usize> {
    usize::try_from(c).ok()
}

pub(crate) fn run(a: Args) -> Result<()> {
    anyhow::ensure!(a.shards >= 1 && a.reps >= 1 && !a.loads.is_empty());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let servers = Servers::start(a.shards, cpu_opt(a.server_cpu))?;
    if let Some(c) = cpu_opt(a.cpu) {
        crate::pin_to(c)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let local = tokio::task::LocalSet::new();
    let started = Instant::now();
    let result = local.block_on(&rt, async {
        tokio::time::timeout(Duration::from_secs(900), measure(&a, &servers))
            .await
            .context("kv benchmark stalled")?
    });
    drop(local);
    drop(rt);
    let server_stats = servers.stop()?;
    let Some(mut out) = result? else {
        return Ok(()); // --profile
    };
    let o = out.as_object_mut().expect("object");
    o.insert("bench".into(), json!("kv"));
    o.insert(
        "command".into(),
        json!(std::env::args().collect::<Vec<_>>().join(" ")),
    );
    o.insert(
        "machine".into(),
        json!({
            "cores": cores,
            "note": "a 2-core VM: the generator/client and the whole server share 2 cores, \
                     one each; absolute loads are far below the paper's 3 client machines \
                     and a many-core server",
        }),
    );
    o.insert(
        "placement".into(),
        json!({
            "generator_cpu": a.cpu,
            "server_cpu": a.server_cpu,
            "what": "generator + client (one current-thread runtime busy-polling the clock) \
                     on generator_cpu; canonical listener runtime (server-side forwarding), \
                     every shard thread and the inline servers' shard threads on server_cpu",
        }),
    );
    o.insert("server".into(), server_stats);
    o.insert(
        "wall_seconds".into(),
        json!(started.elapsed().as_secs_f64()),
    );
    println!("{out}");
    Ok(())
}

/// The servers: the store as built, and the inline (no Chunnels) shards, on one thread
/// pinned to the server CPU (the shard threads inherit the pinning).
struct Servers {
    kv_addr: SocketAddr,
    raw_addrs: Vec<SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<Value>>>,
}

impl Servers {
    fn start(shards: usize, cpu: Option<usize>) -> Result<Self> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("kv-servers".into())
            .spawn(move || -> Result<Value> {
                if let Some(c) = cpu {
                    crate::pin_to(c)?;
                }
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    let kv =
                        KvServer::start("127.0.0.1:0".parse()?, ServerConfig::new(shards)).await?;
                    let mut raw = Vec::new();
                    let mut raw_addrs = Vec::new();
                    for i in 0..shards {
                        let (s, addr) = RawShard::spawn(i)?;
                        raw.push(s);
                        raw_addrs.push(addr);
                    }
                    let _ = tx.send((kv.addr(), raw_addrs));
                    let _ = stop_rx.await;
                    let st = kv.shard_stats();
                    let c = kv.counts();
                    let out = json!({
                        "kv_requests": st.requests.load(Ordering::Relaxed),
                        "kv_replies_dropped": st.replies_dropped.load(Ordering::Relaxed),
                        "kv_malformed": st.malformed.load(Ordering::Relaxed),
                        "clients_client_push": c.client_push.load(Ordering::Relaxed),
                        "clients_server_side": c.server_side.load(Ordering::Relaxed),
                        "inline_requests": raw.iter_mut().map(RawShard::stop).sum::<u64>(),
                    });
                    drop(kv);
                    Ok(out)
                })
            })?;
        let (kv_addr, raw_addrs) = rx.recv().context("servers failed to start")?;
        Ok(Servers {
            kv_addr,
            raw_addrs,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    fn stop(mut self) -> Result<Value> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            _ => anyhow::bail!("server thread panicked"),
        }
    }
}

/// One inline shard: a thread with its own runtime, a raw UDP socket and a `Store`.
struct RawShard {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl RawShard {
    fn spawn(i: usize) -> Result<(Self, SocketAddr)> {
        let sock = std::net::UdpSocket::bind("127.0.0.1:0")?;
        sock.set_nonblocking(true)?;
        let addr = sock.local_addr()?;
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("inline-shard-{i}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async move {
                    let sock = UdpSocket::from_std(sock).expect("tokio socket");
                    let mut served = 0u64;
                    tokio::select! {
                        _ = raw_serve(&sock, &mut served) => {}
                        _ = stop_rx => {}
                    }
                    served
                })
            })?;
        Ok((
            RawShard {
                stop: Some(stop_tx),
                thread: Some(thread),
            },
            addr,
        ))
    }

    fn stop(&mut self) -> u64 {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or(0)
    }
}

async fn raw_serve(sock: &UdpSocket, served: &mut u64) {
    let mut store = Store::new();
    let mut buf = vec![0u8; 65536];
    let mut out = Vec::with_capacity(2048);
    loop {
        let Ok((n, peer)) = sock.recv_from(&mut buf).await else {
            continue;
        };
        let Some(req) = decode_request(&buf[..n]) else {
            continue;
        };
        if let Some(Msg::Response { id, value }) = store.handle(req) {
            *served += 1;
            out.clear();
            encode_response(&mut out, id, value.as_deref());
            let _ = sock.send_to(&out, peer).await;
        }
    }
}

// Hand-rolled wire format of the inline variants (little endian):
// request  = client u64 | id u64 | op u8 (0 get, 1 put, 2 delete) | key_len u16 | key
//            [| value (put: the rest)]
// response = id u64 | present u8 | value (the rest)

fn encode_request(out: &mut Vec<u8>, client: u64, id: u64, op: &Op) {
    out.extend_from_slice(&client.to_le_bytes());
    out.extend_from_slice(&id.to_le_bytes());
    let (tag, key, value) = match op {
        Op::Get { key } => (0u8, key, None),
        Op::Put { key, value } => (1, key, Some(value)),
        Op::Delete { key } => (2, key, None),
    };
    out.push(tag);
    out.extend_from_slice(&(key.len() as u16).to_le_bytes());
    out.extend_from_slice(key);
    if let Some(v) = value {
        out.extend_from_slice(v);
    }
}

fn decode_request(b: &[u8]) -> Option<Msg> {
    let client = u64::from_le_bytes(b.get(0..8)?.try_into().ok()?);
    let id = u64::from_le_bytes(b.get(8..16)?.try_into().ok()?);
    let tag = *b.get(16)?;
    let klen = usize::from(u16::from_le_bytes(b.get(17..19)?.try_into().ok()?));
    let key = b.get(19..19 + klen)?.to_vec();
    let rest = &b[19 + klen..];
    let op = match tag {
        0 => Op::Get { key },
        1 => Op::Put {
            key,
            value: rest.to_vec(),
        },
        2 => Op::Delete { key },
        _ => return None,
    };
    Some(Msg::Request { client, id, op })
}

fn encode_response(out: &mut Vec<u8>, id: u64, value: Option<&[u8]>) {
    out.extend_from_slice(&id.to_le_bytes());
    out.push(u8::from(value.is_some()));
    if let Some(v) = value {
        out.extend_from_slice(v);
    }
}

fn decode_response(b: &[u8]) -> Option<(u64, Option<Vec<u8>>)> {
    let id = u64::from_le_bytes(b.get(0..8)?.try_into().ok()?);
    let value = match *b.get(8)? {
        0 => None,
        _ => Some(b[9..].to_vec()),
    };
    Some((id, value))
}

type Pending = Mutex<HashMap<u64, oneshot::Sender<Option<Vec<u8>>>>>;

/// Retry policy shared with `KvClient` (its defaults).
const TIMEOUT: Duration = Duration::from_millis(100);
const ATTEMPTS: u32 = 8;

/// "No Chunnels": client push over raw sockets, one socket per shard, requests multiplexed
/// by id (one receive task per socket), retries as `KvClient`.
struct Inline {
    socks: Vec<Rc<UdpSocket>>,
    client: u64,
    next: AtomicU64,
    pending: Arc<Pending>,
    slots: Semaphore,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Inline {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Inline {
    async fn connect(shards: &[SocketAddr], client: u64) -> Result<Self> {
        let pending: Arc<Pending> = Arc::default();
        let mut socks = Vec::new();
        let mut tasks = Vec::new();
        for a in shards {
            let s = UdpSocket::bind("127.0.0.1:0").await?;
            s.connect(a).await?;
            let s = Rc::new(s);
            let (s2, p) = (Rc::clone(&s), Arc::clone(&pending));
            tasks.push(tokio::task::spawn_local(async move {
                let mut buf = vec![0u8; 65536];
                loop {
                    let Ok(n) = s2.recv(&mut buf).await else {
                        continue;
                    };
                    if let Some((id, value)) = decode_response(&buf[..n])
                        && let Some(tx) = p.lock().unwrap_or_else(|e| e.into_inner()).remove(&id)
                    {
                        let _ = tx.send(value);
                    }
                }
            }));
            socks.push(s);
        }
        Ok(Inline {
            socks,
            client,
            next: AtomicU64::new(1),
            pending,
            slots: Semaphore::new(1024),
            tasks,
        })
    }
}

struct Remove<'a>(&'a Pending, u64);

impl Drop for Remove<'_> {
    fn drop(&mut self) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.1);
    }
}

impl Target for Inline {
    async fn call(&self, op: Op) -> Result<Option<Vec<u8>>, KvError> {
        let _slot = self.slots.acquire().await.map_err(|_| KvError::Closed)?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, mut rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, tx);
        let _entry = Remove(&self.pending, id);
        let sock = &self.socks[chunnel_std::shard::shard_of(op.key(), self.socks.len())];
        let mut wait = TIMEOUT;
        let mut buf = Vec::with_capacity(64 + op.key().len());
        encode_request(&mut buf, self.client, id, &op);
        for _ in 0..ATTEMPTS {
            let _ = sock.send(&buf).await;
            match tokio::time::timeout(wait, &mut rx).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(_)) => return Err(KvError::Closed),
                Err(_) => wait = (wait * 2).min(Duration::from_secs(1)),
            }
        }
        Err(KvError::Timeout { attempts: ATTEMPTS })
    }
}

/// Paired comparison: one open-loop run whose requests alternate between two targets, so
/// both see the same machine at the same moments (this VM drifts between latency regimes
/// over seconds, which moves back-to-back runs apart). Latency per target from the call's
/// start (the generator busy-polls, so that is within a microsecond of the scheduled time at
/// these loads), recorded after `record_from`.
struct Paired<A, B> {
    a: Rc<A>,
    b: Rc<B>,
    turn: std::cell::Cell<u64>,
    record_from: std::cell::Cell<Option<Instant>>,
    lat_us: std::cell::RefCell<[Vec<f64>; 2]>,
}

impl<A: Target, B: Target> Paired<A, B> {
    fn new(a: Rc<A>, b: Rc<B>) -> Self {
        Paired {
            a,
            b,
            turn: std::cell::Cell::new(0),
            record_from: std::cell::Cell::new(None),
            lat_us: std::cell::RefCell::new([Vec::new(), Vec::new()]),
        }
    }

    /// Starts a run: clears the samples; records those that start `warmup` from now.
    fn start(&self, warmup: Duration) {
        self.record_from.set(Some(Instant::now() + warmup));
        for v in self.lat_us.borrow_mut().iter_mut() {
            v.clear();
        }
    }

    /// p50 of each target's samples, µs.
    fn p50s(&self) -> [f64; 2] {
        let mut l = self.lat_us.borrow_mut();
        l.iter_mut().for_each(|v| v.sort_by(f64::total_cmp));
        [
            crate::stats::quantile(&l[0], 0.5),
            crate::stats::quantile(&l[1], 0.5),
        ]
    }

    fn counts(&self) -> [usize; 2] {
        let l = self.lat_us.borrow();
        [l[0].len(), l[1].len()]
    }
}

impl<A: Target, B: Target> Target for Paired<A, B> {
    async fn call(&self, op: Op) -> Result<Option<Vec<u8>>, KvError> {
        let t = self.turn.get();
        self.turn.set(t.wrapping_add(1));
        let which = (t % 2) as usize;
        let start = Instant::now();
        let r = if which == 0 {
            self.a.call(op).await
        } else {
            self.b.call(op).await
        };
        if r.is_ok() && self.record_from.get().is_some_and(|f| start >= f) {
            self.lat_us.borrow_mut()[which].push(start.elapsed().as_secs_f64() * 1e6);
        }
        r
    }
}

/// "No Chunnels, no multiplexing": one outstanding request per socket; a pool of connected
/// sockets per shard (grown on demand); the reply is whatever the socket receives next with
/// the request's id.
struct InlineNoMux {
    shards: Vec<SocketAddr>,
    pools: Vec<std::cell::RefCell<Vec<UdpSocket>>>,
    client: u64,
    next: AtomicU64,
    slots: Semaphore,
}

impl InlineNoMux {
    async fn connect(shards: &[SocketAddr], client: u64, per_shard: usize) -> Result<Self> {
        let mut pools = Vec::new();
        for a in shards {
            let mut pool = Vec::new();
            for _ in 0..per_shard {
                let s = UdpSocket::bind("127.0.0.1:0").await?;
                s.connect(a).await?;
                pool.push(s);
            }
            pools.push(std::cell::RefCell::new(pool));
        }
        Ok(InlineNoMux {
            shards: shards.to_vec(),
            pools,
            client,
            next: AtomicU64::new(1),
            slots: Semaphore::new(1024),
        })
    }
}

impl Target for InlineNoMux {
    async fn call(&self, op: Op) -> Result<Option<Vec<u8>>, KvError> {
        let _slot = self.slots.acquire().await.map_err(|_| KvError::Closed)?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let shard = chunnel_std::shard::shard_of(op.key(), self.shards.len());
        let pooled = self.pools[shard].borrow_mut().pop();
        let sock = match pooled {
            Some(s) => s,
            None => {
                let s = UdpSocket::bind("127.0.0.1:0")
                    .await
                    .map_err(|_| KvError::Closed)?;
                s.connect(self.shards[shard])
                    .await
                    .map_err(|_| KvError::Closed)?;
                s
            }
        };
        let mut buf = Vec::with_capacity(64 + op.key().len());
        encode_request(&mut buf, self.client, id, &op);
        let mut rbuf = vec![0u8; 2048];
        let mut wait = TIMEOUT;
        for _ in 0..ATTEMPTS {
            let _ = sock.send(&buf).await;
            let got = tokio::time::timeout(wait, async {
                loop {
                    if let Ok(n) = sock.recv(&mut rbuf).await
                        && let Some((rid, v)) = decode_response(&rbuf[..n])
                        && rid == id
                    {
                        return v;
                    }
                }
            })
            .await;
            match got {
                Ok(v) => {
                    self.pools[shard].borrow_mut().push(sock);
                    return Ok(v);
                }
                Err(_) => wait = (wait * 2).min(Duration::from_secs(1)),
            }
        }
        Err(KvError::Timeout { attempts: ATTEMPTS })
    }
}

/// Quantiles of one run, microseconds, and its health.
#[derive(Clone, Debug)]
struct Point {
    p50: f64,
    p95: f64,
    p99: f64,
    achieved: f64,
    skipped: u64,
    errors: u64,
    unfinished: u64,
    max_send_lag_us: f64,
}

impl Point {
    fn of(s: &RunStats) -> Self {
        Point {
            p50: s.quantile_us(0.50),
            p95: s.quantile_us(0.95),
            p99: s.quantile_us(0.99),
            achieved: s.achieved_rate,
            skipped: s.skipped,
            errors: s.errors,
            unfinished: s.unfinished,
            max_send_lag_us: s.max_send_lag.as_secs_f64() * 1e6,
        }
    }
}

fn summarize(points: &[Point]) -> Value {
    let col = |f: fn(&Point) -> f64| spread(&points.iter().map(f).collect::<Vec<_>>());
    json!({
        "p50_us": col(|p| p.p50),
        "p95_us": col(|p| p.p95),
        "p99_us": col(|p| p.p99),
        "achieved_rps": col(|p| p.achieved),
        "max_send_lag_us": col(|p| p.max_send_lag_us),
        "skipped": points.iter().map(|p| p.skipped).collect::<Vec<_>>(),
        "errors": points.iter().map(|p| p.errors).collect::<Vec<_>>(),
        "unfinished": points.iter().map(|p| p.unfinished).collect::<Vec<_>>(),
    })
}

fn med(points: &[Point], f: fn(&Point) -> f64) -> f64 {
    let mut v: Vec<f64> = points.iter().map(f).collect();
    v.sort_by(f64::total_cmp);
    median(&v)
}

async fn phase<T: Target + 'static>(
    t: &Rc<T>,
    a: &Args,
    rate: f64,
    recorded: Duration,
    seed: u64,
) -> Point {
    let mut cfg = RunConfig::new(rate, Duration::from_millis(a.warmup_ms), recorded);
    cfg.seed = seed.wrapping_mul(0x9e37_79b9).wrapping_add(17);
    let s = ycsb::run(Rc::clone(t), a.ops(seed), &cfg).await;
    // Let queues left by an overloaded run empty before the next one.
    tokio::time::sleep(Duration::from_millis(100)).await;
    Point::of(&s)
}

async fn kv_client(addr: SocketAddr, offer: Offer) -> Result<Rc<KvClient>> {
    Ok(Rc::new(
        // The receive task joins the generator's `LocalSet`, as the inline variants' do.
        KvClient::connect(
            addr,
            ClientConfig::default()
                .with_offer(offer)
                .with_local_receiver(true),
        )
        .await?,
    ))
}

const MODES: [(&str, Offer); 2] = [
    ("client_push", Offer::ClientPush),
    ("server_side", Offer::ServerSide),
];

async fn measure(a: &Args, servers: &Servers) -> Result<Option<Value>> {
    let push = kv_client(servers.kv_addr, Offer::ClientPush).await?;
    let via = kv_client(servers.kv_addr, Offer::ServerSide).await?;
    anyhow::ensure!(push.sharding() == Sharding::ClientPush);
    anyhow::ensure!(via.sharding() == Sharding::ServerSide);
    let load_started = Instant::now();
    ycsb::load(&*push, a.records, a.value_size, 32).await?;
    let load_secs = load_started.elapsed().as_secs_f64();
    eprintln!(
        "loaded {} records of {} B in {load_secs:.2} s",
        a.records, a.value_size
    );
    let client_id = 0x1234_5678_9abc_def0;
    let inline = Rc::new(Inline::connect(&servers.raw_addrs, client_id).await?);
    let nomux = Rc::new(InlineNoMux::connect(&servers.raw_addrs, client_id + 1, 32).await?);
    // The inline shards are separate processes' worth of state: load them too.
    ycsb::load(&*inline, a.records, a.value_size, 32).await?;

    if let Some(p) = &a.profile {
        let d = Duration::from_millis(a.profile_ms);
        if p == "paired" {
            // Only the paired comparison: `--reps` runs at `--profile-load`.
            let pair = Rc::new(Paired::new(Rc::clone(&push), Rc::clone(&inline)));
            let mut ratios = Vec::new();
            for rep in 0..a.reps {
                pair.start(Duration::from_millis(a.warmup_ms));
                let pt = phase(&pair, a, a.profile_load, d, 88_000 + rep as u64).await;
                let [f, n] = pair.p50s();
                anyhow::ensure!(pt.errors + pt.unfinished == 0, "paired run failed: {pt:?}");
                eprintln!(
                    "paired run {rep}: full p50 {f:.2} us, no_chunnels p50 {n:.2} us, x{:.3}",
                    f / n
                );
                ratios.push(f / n);
            }
            ratios.sort_by(f64::total_cmp);
            eprintln!("paired median x{:.3} {ratios:?}", median(&ratios));
            return Ok(None);
        }
        let pt = match p.as_str() {
            "client_push" | "full" => phase(&push, a, a.profile_load, d, 1).await,
            "server_side" => phase(&via, a, a.profile_load, d, 1).await,
            "no_chunnels" => phase(&inline, a, a.profile_load, d, 1).await,
            "no_chunnels_no_mux" => phase(&nomux, a, a.profile_load, d, 1).await,
            other => anyhow::bail!("unknown profile variant {other}"),
        };
        eprintln!("{p} at {} req/s: {pt:?}", a.profile_load);
        return Ok(None);
    }

    // Sweep.
    let mut sweep: Vec<Vec<Value>> = vec![Vec::new(), Vec::new()];
    let mut best: [Option<f64>; 2] = [None, None];
    let mut stopped = [false, false];
    for (li, &load) in a.loads.iter().enumerate() {
        let mut pts: [Vec<Point>; 2] = [Vec::new(), Vec::new()];
        for rep in 0..a.reps {
            let seed = 1000 * li as u64 + rep as u64 + 1;
            for (m, _) in MODES.iter().enumerate() {
                if stopped[m] {
                    continue;
                }
                let t = if m == 0 { &push } else { &via };
                pts[m].push(phase(t, a, load, Duration::from_millis(a.run_ms), seed).await);
            }
        }
        for m in 0..2 {
            if stopped[m] {
                continue;
            }
            let p = &pts[m];
            let p95 = med(p, |x| x.p95);
            // Median over repetitions, for the losses too: one repetition hit by a stall
            // of this shared VM does not decide alone.
            let lost = med(p, |x| (x.skipped + x.errors + x.unfinished) as f64);
            let ok = p95 <= a.p95_bound_us && lost == 0.0;
            eprintln!(
                "{:>12} {load:>8} req/s: p50 {:>8.1} p95 {p95:>8.1} p99 {:>8.1} us {}",
                MODES[m].0,
                med(p, |x| x.p50),
                med(p, |x| x.p99),
                if ok { "ok" } else { "FAILS" }
            );
            let mut v = summarize(p);
            v["offered_rps"] = json!(load);
            v["meets_bound"] = json!(ok);
            sweep[m].push(v);
            if ok {
                best[m] = Some(load);
            } else {
                stopped[m] = true;
            }
        }
        if stopped.iter().all(|&s| s) {
            break;
        }
    }
    let ratio = match best {
        [Some(c), Some(s)] => json!(c / s),
        _ => Value::Null,
    };
    let sweep_top = a.loads.last().copied();
    let note = |m: usize| -> Value {
        match best[m] {
            None => json!("meets the bound at no measured load"),
            Some(l) if !stopped[m] && Some(l) == sweep_top => {
                json!("meets the bound at the largest load measured (a lower bound)")
            }
            Some(_) => Value::Null,
        }
    };

    // Full vs inline.
    let full_vs_inline = if a.no_ab {
        json!("not measured")
    } else {
        let d = Duration::from_millis(a.ab_ms);
        let mut full = Vec::new();
        let mut nochan = Vec::new();
        let mut nomuxp = Vec::new();
        for rep in 0..a.reps {
            let seed = 77_000 + rep as u64;
            full.push(phase(&push, a, a.ab_load, d, seed).await);
            nochan.push(phase(&inline, a, a.ab_load, d, seed).await);
            nomuxp.push(phase(&nomux, a, a.ab_load, d, seed).await);
        }
        let ratios = |x: &[Point], y: &[Point], f: fn(&Point) -> f64| -> Vec<f64> {
            x.iter().zip(y).map(|(a, b)| f(a) / f(b)).collect()
        };
        // Paired: full and no_chunnels alternate request by request in one run (each gets
        // half of the offered load).
        let pair = Rc::new(Paired::new(Rc::clone(&push), Rc::clone(&inline)));
        let mut paired_ratio = Vec::new();
        let mut paired_p50 = [Vec::new(), Vec::new()];
        let mut paired_n = [0usize; 2];
        let mut paired_errors = 0u64;
        for rep in 0..a.reps {
            pair.start(Duration::from_millis(a.warmup_ms));
            let pt = phase(&pair, a, a.ab_load, d, 88_000 + rep as u64).await;
            let [f, n] = pair.p50s();
            let c = pair.counts();
            paired_n = [paired_n[0] + c[0], paired_n[1] + c[1]];
            anyhow::ensure!(
                c[0] > 0 && c[1] > 0,
                "paired run {rep} recorded no replies of one variant: {pt:?}"
            );
            paired_errors += pt.errors + pt.unfinished;
            paired_ratio.push(f / n);
            paired_p50[0].push(f);
            paired_p50[1].push(n);
        }
        let mut sorted_paired = paired_ratio.clone();
        sorted_paired.sort_by(f64::total_cmp);
        let paired_med = median(&sorted_paired);
        let r50 = ratios(&full, &nochan, |p| p.p50);
        let mut sorted = r50.clone();
        sorted.sort_by(f64::total_cmp);
        let r50_med = median(&sorted);
        eprintln!(
            "full vs inline at {} req/s: full p50 {:.1} us, no_chunnels p50 {:.1} us, \
             no_mux p50 {:.1} us, full/no_chunnels p50 x{r50_med:.3}; paired (alternating \
             requests in one run): x{paired_med:.3} {:?}",
            a.ab_load,
            med(&full, |p| p.p50),
            med(&nochan, |p| p.p50),
            med(&nomuxp, |p| p.p50),
            paired_ratio,
        );
        json!({
            "offered_rps": a.ab_load,
            "recorded_ms": a.ab_ms,
            "sharding": "client push in all three",
            "variants": {
                "full": summarize(&full),
                "no_chunnels": summarize(&nochan),
                "no_chunnels_no_mux": summarize(&nomuxp),
            },
            "ratio_full_over_no_chunnels": {
                "p50": spread(&r50),
                "p99": spread(&ratios(&full, &nochan, |p| p.p99)),
            },
            "ratio_full_over_no_mux": {
                "p50": spread(&ratios(&full, &nomuxp, |p| p.p50)),
                "p99": spread(&ratios(&full, &nomuxp, |p| p.p99)),
            },
            "paired": {
                "what": "one open-loop run per repetition at offered_rps in total, requests \
                         alternating between full and no_chunnels (half the load each); \
                         latency from each call's start; p50 per variant per run",
                "p50_ratio_full_over_no_chunnels": spread(&paired_ratio),
                "full_p50_us": spread(&paired_p50[0]),
                "no_chunnels_p50_us": spread(&paired_p50[1]),
                "samples": {"full": paired_n[0], "no_chunnels": paired_n[1]},
                "failed_or_unfinished": paired_errors,
            },
            "bar_full_median_within_10pct": r50_med <= 1.10,
            "bar_full_median_within_10pct_paired": paired_med <= 1.10,
        })
    };

    Ok(Some(json!({
        "workload": a.workload().name(),
        "key_dist": a.keys().name(),
        "records": a.records,
        "value_size": a.value_size,
        "load_phase_seconds": load_secs,
        "shards": a.shards,
        "reps": a.reps,
        "warmup_ms": a.warmup_ms,
        "run_ms": a.run_ms,
        "latency": "from the scheduled send time (open loop, Poisson arrivals)",
        "p95_bound_us": a.p95_bound_us,
        "p95_bound_why": P95_WHY,
        "sweep": {
            "client_push": sweep[0],
            "server_side": sweep[1],
        },
        "max_load_meeting_bound": {
            "client_push": best[0],
            "server_side": best[1],
            "client_push_note": note(0),
            "server_side_note": note(1),
            "ratio_client_push_over_server_side": ratio,
        },
        "full_vs_inline": full_vs_inline,
    })))
}

const P95_WHY: &str = "the default 200 us is ~3-4x this machine's unloaded median round trip \
    (50-90 us, most of it the ~45 us cross-core wake-up of this VM, client and server on \
    different cores), the same multiple as the paper's 50 us bound over its ~15 us; \
    50 us is below the unloaded round trip here and no load would meet it";
