//! `chunnel-bench soak`: the key-value store under YCSB load for a long time (issue 26, item
//! 5), while its stack is switched live, its server is killed and restarted, and malformed
//! frames are sent at it.
//!
//! * **Server**: `chunnel_kv::KvServer` (`--shards` shard threads, negotiating canonical
//!   listener) in a **child process** (this binary again, `soak --serve ADDR`) on a fixed
//!   loopback port, so it can be killed (SIGKILL, a crash: no clean-up) and started again
//!   at the same address every `--restart-secs`. Its RSS and open descriptors are read from
//!   `/proc/<pid>`.
//! * **Client**: the store's client logic (request ids, retries with a doubling timeout,
//!   replies matched by id; as `chunnel_kv::KvClient`) over the store's client stack made
//!   **reconfigurable**: `select(ClientShard, ViaCanonical).reconfigurable::<LockFree>()`
//!   over `Shared | Serialize<Msg, bincode>`, negotiated with the server. Every
//!   `--switch-ms` the connection is switched live to the other branch (client push <->
//!   server-side sharding through the canonical address); the server serves both at once,
//!   so the switch is unilateral. Switches are counted by the stack
//!   (`ReconfigConnection::switches`), not by the timer.
//! * **Load**: YCSB workload B (95 % reads), scrambled-zipfian keys over `--records`
//!   records (loaded first), open-loop Poisson arrivals at `--rate` requests/s.
//! * **Recovery**: a request that fails (typed error: no reply after every retry, or the
//!   connection ended) marks its connection broken; one task reconnects (negotiates again,
//!   every 100 ms until it succeeds) and requests issued meanwhile wait for the new
//!   connection up to `--recover-secs`, then fail with a typed error.
//! * **Malformed frames**: `--malformed-rate` datagrams/s at the canonical address and the
//!   shard sockets, from sockets replaced every 30 s (new peers): random bytes, a data tag
//!   over garbage, truncated requests, garbage negotiation / close / reconfiguration
//!   messages, empty and oversized datagrams.
//!
//! Counted per request: **served** (a reply), **errors** (a typed error), **lost** (neither
//! within `--lost-after-secs`: the call is abandoned and counted). Every `--sample-secs` one
//! CSV row `t_s,served,errors,lost,switches,restarts,malformed,rss_kb,fds` (counters
//! cumulative; rss_kb and fds of the server process now). At the end one JSON line on stdout.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use chunnel::Side;
use chunnel_kv::live::LiveClient;
use chunnel_kv::ycsb::{self, KeyDist, OpGen, Rng, Workload};
use chunnel_kv::{ClientConfig, KvServer, Msg, Op, ServerConfig};
use chunnel_std::serialize::{Bincode, Format};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

#[derive(clap::Args, Clone, Debug)]
pub(crate) struct Args {
    /// Length of the loaded run, seconds.
    #[arg(long, default_value_t = 3600)]
    duration: u64,
    /// Where to write the CSV samples.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Offered load, requests per second (open loop, Poisson).
    #[arg(long, default_value_t = 2000.0)]
    rate: f64,
    /// Seconds between CSV samples.
    #[arg(long, default_value_t = 5.0)]
    sample_secs: f64,
    /// Milliseconds between live switches of the client's stack.
    #[arg(long, default_value_t = 1000)]
    switch_ms: u64,
    /// Seconds between kills (SIGKILL) and restarts of the server process; 0: never.
    #[arg(long, default_value_t = 180.0)]
    restart_secs: f64,
    /// Malformed datagrams per second sent at the server.
    #[arg(long, default_value_t = 200.0)]
    malformed_rate: f64,
    /// Shards of the server.
    #[arg(long, default_value_t = 2)]
    shards: usize,
    /// Records loaded before the run (keys of the workload).
    #[arg(long, default_value_t = 10_000)]
    records: u64,
    /// Bytes per value.
    #[arg(long, default_value_t = 100)]
    value_size: usize,
    /// Client: wait for a reply before the first retry, milliseconds (doubles, at most 1 s).
    #[arg(long, default_value_t = 100)]
    timeout_ms: u64,
    /// Client: sends of one request before it fails with a typed timeout.
    #[arg(long, default_value_t = 5)]
    attempts: u32,
    /// A request without a reply or a typed error after this long is lost.
    #[arg(long, default_value_t = 60)]
    lost_after_secs: u64,
    /// A request waits this long for a connection while the client reconnects.
    #[arg(long, default_value_t = 20)]
    recover_secs: u64,
    /// Canonical UDP port of the server on 127.0.0.1; 0: one the kernel picks (kept across
    /// restarts).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Seed of the workload and the malformed frames.
    #[arg(long, default_value_t = 26)]
    seed: u64,
    /// Skip the check of reply values (and the memory it keeps: up to 32 value hashes per key).
    #[arg(long)]
    no_value_check: bool,
    /// Internal: run as the server process on this address.
    #[arg(long, hide = true)]
    serve: Option<SocketAddr>,
}

pub(crate) fn run(a: Args) -> Result<()> {
    if let Some(addr) = a.serve {
        return serve(addr, a.shards);
    }
    let csv = a.csv.clone().context("--csv <path> is required")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let summary = rt.block_on(soak(a, csv))?;
    println!("{summary}");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The server process

fn serve(addr: SocketAddr, shards: usize) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let server = KvServer::start(addr, ServerConfig::new(shards)).await?;
        let mut out = std::io::stdout();
        writeln!(
            out,
            "ready {} {}",
            server.addr(),
            server.shard_addrs().join(",")
        )?;
        out.flush()?;
        // Evidence from the server's side, on stderr (the soak's server log).
        let pid = std::process::id();
        loop {
            tokio::time::sleep(Duration::from_secs(10)).await;
            let st = server.shard_stats();
            let c = server.counts();
            eprintln!(
                "server pid {pid}: shard requests {} malformed {} replies_dropped {} \
                 peers_refused {}; accepted client_push {} server_side {} failed {}; \
                 heap {} kB, tasks {}",
                st.requests.load(Relaxed),
                st.malformed.load(Relaxed),
                st.replies_dropped.load(Relaxed),
                st.peers_refused.load(Relaxed),
                c.client_push.load(Relaxed),
                c.server_side.load(Relaxed),
                c.failed.load(Relaxed),
                heap_in_use() / 1024,
                tokio::runtime::Handle::current()
                    .metrics()
                    .num_alive_tasks(),
            );
        }
    })
}

/// The server child process.
struct Server {
    child: Child,
    /// The canonical address it bound (the port the kernel picked if asked for port 0).
    addr: SocketAddr,
    shards: Vec<SocketAddr>,
}

impl Server {
    /// Starts `exe soak --serve addr` and waits (at most 15 s) for its "ready ADDR SHARDS"
    /// line.
    async fn start(exe: &Path, addr: SocketAddr, shards: usize, log: &Path) -> Result<Server> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let mut child = Command::new(exe)
            .args(["soak", "--serve", &addr.to_string()])
            .args(["--shards", &shards.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .context("starting the server process")?;
        let stdout = child.stdout.take().context("server stdout")?;
        let line = tokio::time::timeout(
            Duration::from_secs(15),
            tokio::task::spawn_blocking(move || {
                let mut line = String::new();
                BufReader::new(stdout).read_line(&mut line).map(|_| line)
            }),
        )
        .await;
        let line = match line {
            Ok(Ok(Ok(l))) if l.starts_with("ready ") => l,
            other => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the server process did not become ready: {other:?}");
            }
        };
        let mut fields = line["ready ".len()..].split_whitespace();
        let addr = fields
            .next()
            .context("no address in the ready line")?
            .parse()
            .context("server address")?;
        let shards = fields
            .next()
            .context("no shards in the ready line")?
            .split(',')
            .map(|s| s.parse().context("shard address"))
            .collect::<Result<_>>()?;
        Ok(Server {
            child,
            addr,
            shards,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL and reap.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Heap bytes in use in this process (glibc's `mallinfo2`: arena chunks in use plus mmapped
/// blocks): what RSS would be without the allocator's free memory, so a leak shows here.
fn heap_in_use() -> u64 {
    // SAFETY: mallinfo2 takes no arguments and returns a plain struct.
    let m = unsafe { libc::mallinfo2() };
    (m.uordblks + m.hblkhd) as u64
}

/// (VmRSS in kB, open descriptors) of process `pid`.
fn proc_usage(pid: u32) -> (u64, u64) {
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as u64)
        .unwrap_or(0);
    (rss, fds)
}

// ---------------------------------------------------------------------------------------------
// The client: chunnel-kv's switchable client (a reconfigurable sharding select)

type Client = LiveClient;

/// A client on the server at `addr`, with the soak's timeouts and up to 16,384 requests in
/// flight.
async fn connect(addr: SocketAddr, a: &Args) -> Result<Client> {
    let mut cfg = ClientConfig::default();
    cfg.max_outstanding = 16_384;
    cfg.timeout = Duration::from_millis(a.timeout_ms.max(1));
    cfg.attempts = a.attempts.max(1);
    Ok(LiveClient::connect(addr, cfg).await?)
}

// ---------------------------------------------------------------------------------------------
// The soak

#[derive(Default)]
struct Counters {
    issued: AtomicU64,
    served: AtomicU64,
    /// GETs answered "no such key" (the store is in memory: a restart empties it).
    misses: AtomicU64,
    errors: AtomicU64,
    /// Errors of requests issued more than 15 s after the last restart.
    errors_away_from_restarts: AtomicU64,
    /// Requests that found no connection within `--recover-secs` (part of `errors`).
    unavailable: AtomicU64,
    lost: AtomicU64,
    /// Replies whose value was never written to the key (part of `served`).
    wrong: AtomicU64,
    /// Records written again after a reconnect (the store is in memory; not counted above).
    reloaded: AtomicU64,
    in_flight: AtomicU64,
    /// Switches of connections no longer current (their stack's count when retired).
    retired_switches: AtomicU64,
    switch_ticks: AtomicU64,
    switch_done: AtomicU64,
    switch_unchanged: AtomicU64,
    switch_failed: AtomicU64,
    switch_skipped: AtomicU64,
    max_switch_us: AtomicU64,
    restarts: AtomicU64,
    reconnects: AtomicU64,
    malformed: AtomicU64,
    /// Milliseconds since the start of the last kill.
    last_kill_ms: AtomicU64,
}

/// Hash of a value (FNV-1a), for the reply check.
fn value_hash(v: &[u8]) -> u64 {
    v.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// The last [`WRITTEN`] values written to each key (hashes): a GET's value, or a PUT's
/// previous value, must be one of them, else the reply is wrong (for example matched to
/// another request). Bounded, so that the check does not grow the client's memory.
#[derive(Default)]
struct Written(Mutex<HashMap<Vec<u8>, std::collections::VecDeque<u64>>>);

/// Values remembered per key.
const WRITTEN: usize = 32;

impl Written {
    fn add(&self, key: &[u8], value: &[u8]) {
        let mut map = self.0.lock().unwrap();
        let q = match map.get_mut(key) {
            Some(q) => q,
            // Its whole bound at once: the client's memory does not creep up as keys fill.
            None => map
                .entry(key.to_vec())
                .or_insert_with(|| std::collections::VecDeque::with_capacity(WRITTEN)),
        };
        if q.len() >= WRITTEN {
            q.pop_front();
        }
        q.push_back(value_hash(value));
    }

    fn valid(&self, key: &[u8], value: Option<&[u8]>) -> bool {
        value.is_none_or(|v| {
            self.0
                .lock()
                .unwrap()
                .get(key)
                .is_some_and(|set| set.contains(&value_hash(v)))
        })
    }
}

/// The current connection and its generation.
type Current = Option<(u64, Arc<Client>)>;

struct Soak {
    args: Args,
    addr: SocketAddr,
    start: Instant,
    c: Counters,
    current: watch::Sender<Current>,
    broken: mpsc::Sender<u64>,
    /// The server's shard sockets (for the malformed frames).
    shards: Mutex<Vec<SocketAddr>>,
    server_pid: AtomicU64,
    stop: watch::Sender<bool>,
    written: Written,
}

impl Soak {
    fn ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Switches counted by the stacks of every connection so far.
    fn switches(&self) -> u64 {
        let cur = self.current.borrow();
        self.c.retired_switches.load(Relaxed) + cur.as_ref().map_or(0, |(_, c)| c.switches())
    }

    /// The current connection, waiting for one up to `--recover-secs`.
    async fn client(&self) -> Option<(u64, Arc<Client>)> {
        let mut rx = self.current.subscribe();
        let wait = Duration::from_secs(self.args.recover_secs);
        match tokio::time::timeout(wait, rx.wait_for(Option::is_some)).await {
            Ok(Ok(c)) => c.clone(),
            _ => None,
        }
    }

    /// Replaces the current connection (if still generation `generation`) with none.
    fn retire(&self, generation: u64) -> bool {
        let mut retired = false;
        self.current.send_if_modified(|cur| {
            if let Some((g, c)) = cur
                && *g == generation
            {
                self.c.retired_switches.fetch_add(c.switches(), Relaxed);
                *cur = None;
                retired = true;
                return true;
            }
            false
        });
        retired
    }

    fn stopped(&self) -> bool {
        *self.stop.borrow()
    }
}

async fn soak(a: Args, csv: PathBuf) -> Result<Value> {
    let exe = std::env::current_exe()?;
    // Port 0: the kernel picks it when the server binds, and restarts reuse it (a port probed
    // free here could be taken before the server bound it).
    let addr: SocketAddr = ([127, 0, 0, 1], a.port).into();
    if let Some(dir) = csv.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir)?;
    }
    let log = csv.with_extension("server.log");
    let _ = std::fs::remove_file(&log);
    let mut server = Server::start(&exe, addr, a.shards, &log).await?;
    let addr = server.addr;
    eprintln!(
        "soak: server pid {} on {addr}, shards {:?}; log {}",
        server.pid(),
        server.shards,
        log.display()
    );

    // Load the records before the clock starts.
    let written = Written::default();
    for i in 0..a.records {
        written.add(&ycsb::key(i), &ycsb::value(i, a.value_size));
    }
    let first = connect(addr, &a).await?;
    let t = Instant::now();
    ycsb::load(&first, a.records, a.value_size, 64).await?;
    eprintln!(
        "soak: loaded {} records in {:.1} s; sharding starts on {:?}",
        a.records,
        t.elapsed().as_secs_f64(),
        first.side()
    );

    let (broken_tx, mut broken_rx) = mpsc::channel(64);
    let (current, _) = watch::channel(Some((0, Arc::new(first))));
    let (stop, _) = watch::channel(false);
    let s = Arc::new(Soak {
        addr,
        start: Instant::now(),
        c: Counters::default(),
        current,
        broken: broken_tx,
        shards: Mutex::new(server.shards.clone()),
        server_pid: AtomicU64::new(u64::from(server.pid())),
        stop,
        written,
        args: a.clone(),
    });
    s.c.last_kill_ms.store(u64::MAX, Relaxed);

    let mut tasks = tokio::task::JoinSet::new();

    // Reconnector: one at a time, for the current generation only.
    let recovery_ms: Arc<Mutex<Vec<u64>>> = Arc::default();
    tasks.spawn({
        let s = Arc::clone(&s);
        let recovery_ms = Arc::clone(&recovery_ms);
        async move {
            let mut generation = 0;
            while let Some(g) = broken_rx.recv().await {
                if g != generation || !s.retire(g) {
                    continue;
                }
                let t0 = Instant::now();
                let client = loop {
                    match tokio::time::timeout(Duration::from_secs(5), connect(s.addr, &s.args))
                        .await
                    {
                        Ok(Ok(c)) => break c,
                        _ if s.stopped() && t0.elapsed() > Duration::from_secs(30) => return,
                        _ => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                };
                generation += 1;
                s.c.reconnects.fetch_add(1, Relaxed);
                let ms = t0.elapsed().as_millis() as u64;
                recovery_ms.lock().unwrap().push(ms);
                eprintln!(
                    "soak: t={:.1}s reconnected (generation {generation}) in {ms} ms",
                    s.start.elapsed().as_secs_f64()
                );
                let client = Arc::new(client);
                s.current
                    .send_replace(Some((generation, Arc::clone(&client))));
                // A restarted server is empty: write the records again, beside the load.
                let s = Arc::clone(&s);
                tokio::spawn(async move {
                    let next = AtomicU64::new(0);
                    let worker = || async {
                        loop {
                            let i = next.fetch_add(1, Relaxed);
                            if i >= s.args.records {
                                return;
                            }
                            let (key, value) = (ycsb::key(i), ycsb::value(i, s.args.value_size));
                            s.written.add(&key, &value);
                            let op = Op::Put { key, value };
                            if client.call(op).await.is_err() {
                                return;
                            }
                            s.c.reloaded.fetch_add(1, Relaxed);
                        }
                    };
                    tokio::join!(worker(), worker(), worker(), worker());
                });
            }
        }
    });

    // Load generator: open-loop Poisson arrivals, one task per request.
    tasks.spawn({
        let s = Arc::clone(&s);
        async move {
            let mut ops = OpGen::new(
                Workload::B,
                KeyDist::zipfian(s.args.records),
                s.args.value_size,
                s.args.seed,
            );
            let mut rng = Rng::new(s.args.seed ^ 0x5eed);
            let mean = 1.0 / s.args.rate.max(1.0);
            let end = s.start + Duration::from_secs(s.args.duration);
            let mut next = Instant::now();
            while next < end {
                let now = Instant::now();
                while next <= now {
                    let op = ops.next_op();
                    let s = Arc::clone(&s);
                    s.c.issued.fetch_add(1, Relaxed);
                    s.c.in_flight.fetch_add(1, Relaxed);
                    tokio::spawn(async move {
                        request(&s, op).await;
                        s.c.in_flight.fetch_sub(1, Relaxed);
                    });
                    next += Duration::from_secs_f64(rng.exp(mean));
                }
                tokio::time::sleep_until(next.into()).await;
            }
        }
    });

    // Switcher: the current connection to the other branch every --switch-ms.
    tasks.spawn({
        let s = Arc::clone(&s);
        async move {
            let mut tick = tokio::time::interval(Duration::from_millis(s.args.switch_ms.max(1)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            while !s.stopped() {
                tick.tick().await;
                s.c.switch_ticks.fetch_add(1, Relaxed);
                let Some((_, c)) = s.current.borrow().clone() else {
                    s.c.switch_skipped.fetch_add(1, Relaxed);
                    continue;
                };
                let conn = &c;
                let before = conn.switches();
                let to = match conn.side() {
                    Side::Left => Side::Right,
                    Side::Right => Side::Left,
                };
                let t = Instant::now();
                let r = conn.reconfigure(to).await;
                let us = t.elapsed().as_micros() as u64;
                s.c.max_switch_us.fetch_max(us, Relaxed);
                match r {
                    // Checked on the stack: its count went up and it runs on the new side.
                    Ok(true) if conn.switches() > before && conn.side() == to => {
                        s.c.switch_done.fetch_add(1, Relaxed);
                    }
                    Ok(_) => {
                        s.c.switch_unchanged.fetch_add(1, Relaxed);
                    }
                    Err(e) => {
                        s.c.switch_failed.fetch_add(1, Relaxed);
                        eprintln!("soak: switch to {to:?} failed: {e}");
                    }
                }
            }
        }
    });

    // Malformed frames.
    tasks.spawn({
        let s = Arc::clone(&s);
        async move {
            if let Err(e) = malformed(&s).await {
                eprintln!("soak: malformed sender stopped: {e}");
            }
        }
    });

    // Sampler (this task) and restarter.
    let mut out = std::io::BufWriter::new(std::fs::File::create(&csv)?);
    writeln!(
        out,
        "t_s,served,errors,lost,switches,restarts,malformed,rss_kb,fds"
    )?;
    out.flush()?;
    let mut srv = Extremes::default();
    let mut cli = Extremes::default();
    let mut lifetimes: Vec<Value> = Vec::new();
    let mut life = Extremes::default();
    let sample = Duration::from_secs_f64(s.args.sample_secs.max(0.1));
    let restart = (s.args.restart_secs > 0.0).then(|| Duration::from_secs_f64(s.args.restart_secs));
    let end = s.start + Duration::from_secs(s.args.duration);
    let mut next_sample = s.start + sample;
    let mut next_restart = restart.map(|r| s.start + r);
    let self_pid = std::process::id();
    let write_row = |s: &Soak, out: &mut dyn Write, pid: u32| -> Result<(u64, u64)> {
        let (rss, fds) = proc_usage(pid);
        writeln!(
            out,
            "{:.1},{},{},{},{},{},{},{},{}",
            s.start.elapsed().as_secs_f64(),
            s.c.served.load(Relaxed),
            s.c.errors.load(Relaxed),
            s.c.lost.load(Relaxed),
            s.switches(),
            s.c.restarts.load(Relaxed),
            s.c.malformed.load(Relaxed),
            rss,
            fds
        )?;
        out.flush()?;
        Ok((rss, fds))
    };
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        let wake = next_restart
            .map_or(next_sample, |r| r.min(next_sample))
            .min(end);
        tokio::time::sleep_until(wake.into()).await;
        let now = Instant::now();
        if next_restart.is_some_and(|r| now >= r) {
            let pid = server.pid();
            s.c.last_kill_ms.store(s.ms(), Relaxed);
            server.kill();
            lifetimes.push(life.json(pid));
            life = Extremes::default();
            server = Server::start(&exe, addr, s.args.shards, &log).await?;
            *s.shards.lock().unwrap() = server.shards.clone();
            s.server_pid.store(u64::from(server.pid()), Relaxed);
            s.c.restarts.fetch_add(1, Relaxed);
            eprintln!(
                "soak: t={:.1}s killed server pid {pid}, restarted as pid {} in {} ms",
                s.start.elapsed().as_secs_f64(),
                server.pid(),
                s.ms() - s.c.last_kill_ms.load(Relaxed)
            );
            next_restart = restart.map(|r| now + r);
        }
        if Instant::now() >= next_sample && next_sample < end {
            let (rss, fds) = write_row(&s, &mut out, server.pid())?;
            srv.add(rss, fds);
            life.add(rss, fds);
            let (crss, cfds) = proc_usage(self_pid);
            cli.add(crss, cfds);
            next_sample += sample;
            if s.start.elapsed().as_secs() % 60 < s.args.sample_secs.ceil() as u64 {
                eprintln!(
                    "soak: t={:.0}s served {} errors {} lost {} switches {} restarts {} \
                     malformed {} server rss {rss} kB fds {fds}; client rss {crss} kB fds {cfds} \
                     heap {} kB tasks {}",
                    s.start.elapsed().as_secs_f64(),
                    s.c.served.load(Relaxed),
                    s.c.errors.load(Relaxed),
                    s.c.lost.load(Relaxed),
                    s.switches(),
                    s.c.restarts.load(Relaxed),
                    s.c.malformed.load(Relaxed),
                    heap_in_use() / 1024,
                    tokio::runtime::Handle::current()
                        .metrics()
                        .num_alive_tasks(),
                );
            }
        }
    }

    // Stop: no new requests; let those in flight end (each is bounded by --lost-after-secs).
    s.stop.send_replace(true);
    let drain = Instant::now();
    while s.c.in_flight.load(Relaxed) > 0
        && drain.elapsed() < Duration::from_secs(s.args.lost_after_secs + 10)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (rss, fds) = write_row(&s, &mut out, server.pid())?;
    srv.add(rss, fds);
    life.add(rss, fds);
    let (crss, cfds) = proc_usage(self_pid);
    cli.add(crss, cfds);
    lifetimes.push(life.json(server.pid()));
    tasks.abort_all();
    server.kill();

    let c = &s.c;
    let issued = c.issued.load(Relaxed);
    let served = c.served.load(Relaxed);
    let errors = c.errors.load(Relaxed);
    let lost = c.lost.load(Relaxed);
    let in_flight = c.in_flight.load(Relaxed);
    let wrong = c.wrong.load(Relaxed);
    let recovery = recovery_ms.lock().unwrap().clone();
    let summary = json!({
        "bench": "soak",
        "duration_s": s.args.duration,
        "elapsed_s": s.start.elapsed().as_secs_f64(),
        "rate": s.args.rate,
        "shards": s.args.shards,
        "records": s.args.records,
        "workload": "B",
        "keys": "scrambled zipfian",
        "issued": issued,
        "served": served,
        "misses": c.misses.load(Relaxed),
        "errors": errors,
        "errors_away_from_restarts": c.errors_away_from_restarts.load(Relaxed),
        "unavailable": c.unavailable.load(Relaxed),
        "lost": lost,
        "wrong_values": wrong,
        "reloaded_records": c.reloaded.load(Relaxed),
        "unaccounted": issued.saturating_sub(served + errors + lost),
        "in_flight_at_end": in_flight,
        "switches": s.switches(),
        "switch_ticks": c.switch_ticks.load(Relaxed),
        "switch_done_checked": c.switch_done.load(Relaxed),
        "switch_unchanged": c.switch_unchanged.load(Relaxed),
        "switch_failed": c.switch_failed.load(Relaxed),
        "switch_skipped_reconnecting": c.switch_skipped.load(Relaxed),
        "max_switch_ms": c.max_switch_us.load(Relaxed) as f64 / 1000.0,
        "restarts": c.restarts.load(Relaxed),
        "reconnects": c.reconnects.load(Relaxed),
        "recovery_ms": recovery,
        "max_recovery_ms": recovery.iter().copied().max().unwrap_or(0),
        "malformed": c.malformed.load(Relaxed),
        "server": srv.json(0),
        "server_lifetimes": lifetimes,
        "client_process": cli.json(self_pid),
        "csv": csv.display().to_string(),
        "server_log": log.display().to_string(),
        "ok": lost == 0 && wrong == 0 && in_flight == 0 && issued == served + errors,
    });
    Ok(summary)
}

/// One request: served, a typed error, or lost.
async fn request(s: &Soak, op: Op) {
    let is_get = matches!(op, Op::Get { .. });
    let key = op.key().to_vec();
    let check = !s.args.no_value_check;
    if check && let Op::Put { key, value } = &op {
        s.written.add(key, value);
    }
    let issued_ms = s.ms();
    let outcome = tokio::time::timeout(Duration::from_secs(s.args.lost_after_secs), async {
        let (generation, client) = s.client().await?;
        Some((generation, client.call(op).await))
    })
    .await;
    match outcome {
        Err(_) => {
            s.c.lost.fetch_add(1, Relaxed);
        }
        Ok(None) => {
            s.c.errors.fetch_add(1, Relaxed);
            s.c.unavailable.fetch_add(1, Relaxed);
        }
        Ok(Some((_, Ok(v)))) => {
            s.c.served.fetch_add(1, Relaxed);
            if is_get && v.is_none() {
                s.c.misses.fetch_add(1, Relaxed);
            }
            if check && !s.written.valid(&key, v.as_deref()) {
                s.c.wrong.fetch_add(1, Relaxed);
            }
        }
        Ok(Some((generation, Err(_)))) => {
            s.c.errors.fetch_add(1, Relaxed);
            let kill = s.c.last_kill_ms.load(Relaxed);
            if kill == u64::MAX || issued_ms > kill + 15_000 {
                s.c.errors_away_from_restarts.fetch_add(1, Relaxed);
            }
            let _ = s.broken.try_send(generation);
        }
    }
}

/// Sends malformed datagrams at the canonical address and the shard sockets.
async fn malformed(s: &Soak) -> Result<()> {
    if s.args.malformed_rate <= 0.0 {
        return Ok(());
    }
    let mut rng = Rng::new(s.args.seed ^ 0xbad);
    let gap = Duration::from_secs_f64(1.0 / s.args.malformed_rate);
    let mut socks = Vec::new();
    let mut renewed = Instant::now() - Duration::from_secs(3600);
    let mut next = Instant::now();
    let mut request = Vec::new();
    Bincode::encode(
        &Msg::Request {
            client: 7,
            id: 7,
            op: Op::Put {
                key: ycsb::key(1),
                value: vec![1; 64],
            },
        },
        &mut request,
    )?;
    while !s.stopped() {
        if renewed.elapsed() > Duration::from_secs(30) {
            socks.clear();
            for _ in 0..4 {
                socks.push(tokio::net::UdpSocket::bind("127.0.0.1:0").await?);
            }
            renewed = Instant::now();
        }
        let now = Instant::now();
        while next <= now {
            next += gap;
            let shards = s.shards.lock().unwrap().clone();
            let to_shard = !shards.is_empty() && rng.below(2) == 0;
            let to = if to_shard {
                shards[rng.below(shards.len() as u64) as usize]
            } else {
                s.addr
            };
            let mut frame = Vec::new();
            // `base` + up to `span` - 1 random bytes.
            let random = |rng: &mut Rng, frame: &mut Vec<u8>, base: u64, span: u64| {
                let n = base + rng.below(span);
                frame.extend((0..n).map(|_| rng.next_u64() as u8));
            };
            match rng.below(8) {
                // Random bytes.
                0 => random(&mut rng, &mut frame, 1, 256),
                // A data tag over garbage (the canonical listener) / garbage (a shard).
                1 => {
                    if !to_shard {
                        frame.push(0x00);
                    }
                    random(&mut rng, &mut frame, 1, 128);
                }
                // A request cut short.
                2 => {
                    if !to_shard {
                        frame.push(0x00);
                    }
                    let cut = rng.below(request.len() as u64) as usize;
                    frame.extend_from_slice(&request[..cut]);
                }
                // Garbage negotiation (hello, accept...) messages.
                3 => {
                    frame.push(0x01 + rng.below(4) as u8);
                    random(&mut rng, &mut frame, 0, 200);
                }
                // Garbage close.
                4 => {
                    frame.push(0x05);
                    random(&mut rng, &mut frame, 0, 40);
                }
                // Garbage reconfiguration control, and reserved tags.
                5 => {
                    frame.push(0x10 + rng.below(16) as u8);
                    random(&mut rng, &mut frame, 0, 64);
                }
                // Empty.
                6 => {}
                // Oversized.
                _ => random(&mut rng, &mut frame, 2000, 7000),
            }
            let sock = &socks[rng.below(socks.len() as u64) as usize];
            if sock.send_to(&frame, to).await.is_ok() {
                s.c.malformed.fetch_add(1, Relaxed);
            }
        }
        tokio::time::sleep_until(next.into()).await;
    }
    Ok(())
}

/// First, last and maximum of (RSS, descriptors) samples.
#[derive(Default)]
struct Extremes {
    first: Option<(u64, u64)>,
    last: (u64, u64),
    max: (u64, u64),
    samples: u64,
}

impl Extremes {
    fn add(&mut self, rss: u64, fds: u64) {
        self.first.get_or_insert((rss, fds));
        self.last = (rss, fds);
        self.max = (self.max.0.max(rss), self.max.1.max(fds));
        self.samples += 1;
    }

    fn json(&self, pid: u32) -> Value {
        let first = self.first.unwrap_or_default();
        let mut v = json!({
            "samples": self.samples,
            "rss_kb": {"start": first.0, "end": self.last.0, "max": self.max.0},
            "fds": {"start": first.1, "end": self.last.1, "max": self.max.1},
        });
        if pid != 0 {
            v["pid"] = json!(pid);
        }
        v
    }
}
