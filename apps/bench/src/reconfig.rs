//! `chunnel-bench reconfig`: what runtime reconfiguration costs (issue 4, item 6): the fast
//! path of both unilateral mechanisms, and the pause of unilateral and multilateral switches.
//!
//! Every client below talks to an echo server (`Noop` over a `uds::DatagramListener`) through
//! a Unix datagram connection, a lossless base on loopback. Client, server and switcher share
//! one current-thread runtime pinned to one core (as in `overhead`).
//!
//! 1. **Fast-path cost**, never switching. The client stack is
//!    * `plain`: `stack![Noop, uds::DatagramConnect]` (no select),
//!    * `lock-free`: `stack![select(Noop, Noop).reconfigurable::<LockFree>(), Shared, base]`,
//!    * `lock`: the same with `Lock`.
//!
//!    Throughput: bursts of `--burst` messages of `--size` bytes in flight for `--millis`,
//!    messages/s; the three connections are set up side by side and take turns in slices of
//!    `--slice-ms` (order rotated every slice), so drifts of a shared machine hit all alike;
//!    each is
//!    reported as a ratio to `plain` of the same repetition, median and min/max over `--reps`.
//!    Then (unless `--no-callgrind`) the hidden `--probe` mode runs under callgrind: a
//!    deterministic loop over UDP (as `overhead`'s probe; a Unix datagram socket queues only
//!    10 datagrams, too few for a burst reflected in the same thread) against a blocking
//!    reflector socket in the same thread, counted only inside `measured_loop`, at two
//!    burst counts so fixed costs cancel; and natively, for heap allocations per message. The
//!    gate is entered once per `send` or `recv` call, so its cost per message is its cost per
//!    call divided by the burst (32). By hand:
//!
//!    ```text
//!    valgrind --tool=callgrind --toggle-collect='*measured_loop*' \
//!        target/release/chunnel-bench reconfig --probe lock-free --probe-bursts 1000
//!    ```
//!
//! 2. **Switch pause**: a sender task offers sequence-numbered messages at `--rate` messages/s
//!    (open loop: message `i` is due at `i / rate` and sent as soon as it is due, in a burst
//!    with any others that are), a receiver task records every delivery, and a switcher task
//!    flips the branch through the `ReconfigHandle` after every `--switch-every` messages
//!    sent. Round trips are measured from the moment a message is handed to `send` (so a send
//!    held at a closed gate counts); how late the sender was against the schedule is reported
//!    apart (`sender_lag_us`: a preempted process, not the switch). Messages are classed by
//!    the switch nearest them: *during* (its send..delivery interval overlaps the
//!    `reconfigure` call), *before* / *after* (sent within `--window-us` before the call
//!    started / after it ended), *steady* (the rest). The pause of a switch is the longest gap
//!    between consecutive deliveries that overlaps the call (at 20k msg/s the steady gap is
//!    50 us, reported beside it). Loss,
//!    duplicates and reordering are counted from the sequence numbers.
//!
//! 3. **Multilateral switch pause**: the same measurement on a negotiated connection over a
//!    Unix stream socket whose client proposes every switch by two-phase commit
//!    (`chunnel_negotiate::commit::Coordinator`) and whose server votes and follows.

use std::net::UdpSocket as StdUdp;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use bytes::{BufMut, Bytes, BytesMut};
use chunnel::{
    Chunnel, ChunnelConnection, ChunnelExt, ConnectionExt, Listener, Lock, LockFree, Mechanism,
    Noop, Shared, Side, select, stack,
};
use chunnel_net::{udp, uds};
use serde_json::{Value, json};

use crate::stats::{median, quantile, spread};

#[derive(clap::Args, Clone)]
pub(crate) struct Args {
    /// Repetitions of the throughput measurement (variants interleaved).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Milliseconds of throughput measurement per variant per repetition.
    #[arg(long, default_value_t = 300)]
    millis: u64,
    /// The throughput variants take turns in slices of this many milliseconds.
    #[arg(long, default_value_t = 10)]
    slice_ms: u64,
    /// Messages in flight in the throughput run.
    #[arg(long, default_value_t = 32)]
    burst: usize,
    /// Message size in bytes (at least 8: the switch test puts a sequence number in front).
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// Offered load of the switch-pause test, messages/s.
    #[arg(long, default_value_t = 20_000.0)]
    rate: f64,
    /// Switch branches after every this many messages sent.
    #[arg(long, default_value_t = 2000)]
    switch_every: u64,
    /// Messages per switch-pause run (one run per mechanism per repetition).
    #[arg(long, default_value_t = 60_000)]
    messages: u64,
    /// Repetitions of the switch-pause test.
    #[arg(long, default_value_t = 3)]
    pause_reps: usize,
    /// Width of the before/after windows around a switch, microseconds.
    #[arg(long, default_value_t = 2000)]
    window_us: u64,
    /// CPU to pin to; negative to leave unpinned.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    cpu: i64,
    /// Skip the callgrind and allocation probes.
    #[arg(long)]
    no_callgrind: bool,
    /// Internal: run the deterministic probe loop for this variant (plain, lock-free, lock),
    /// print one JSON line and exit. For callgrind / the allocation counter.
    #[arg(long, hide = true)]
    probe: Option<String>,
    /// Bursts of the probe loop (after 50 warm-up bursts).
    #[arg(long, hide = true, default_value_t = 1000)]
    probe_bursts: usize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    Plain,
    LockFree,
    Lock,
}

const VARIANTS: [Variant; 3] = [Variant::Plain, Variant::LockFree, Variant::Lock];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Plain => "plain",
            Variant::LockFree => LockFree::NAME,
            Variant::Lock => Lock::NAME,
        }
    }

    fn parse(s: &str) -> Result<Variant> {
        VARIANTS
            .into_iter()
            .find(|v| v.name() == s)
            .with_context(|| format!("no variant {s:?} (plain, lock-free, lock)"))
    }
}

pub(crate) fn run(a: Args) -> Result<()> {
    ensure!(a.size >= 8, "--size must be at least 8");
    ensure!(
        a.burst >= 1 && a.rate > 0.0 && a.switch_every >= 1,
        "bad arguments"
    );
    if a.cpu >= 0 {
        crate::pin_to(a.cpu as usize)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    if let Some(v) = &a.probe {
        let v = Variant::parse(v)?;
        let out = rt.block_on(probe(v, &a))?;
        println!("{out}");
        return Ok(());
    }
    let started = Instant::now();

    // 1. Fast path.
    let mut tput: Vec<Vec<f64>> = VARIANTS.iter().map(|_| Vec::new()).collect();
    for rep in 0..a.reps {
        let x = rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(60), throughput_rep(rep, &a)).await
            })
            .context("throughput measurement stalled")??;
        for (i, v) in VARIANTS.iter().enumerate() {
            eprintln!("rep {rep} {:>9}: {:>9.0} msg/s", v.name(), x[i]);
            tput[i].push(x[i]);
        }
    }
    let mut fast = serde_json::Map::new();
    let mut ratio_median = [f64::NAN; 3];
    for (i, v) in VARIANTS.iter().enumerate() {
        let ratio: Vec<f64> = tput[i].iter().zip(&tput[0]).map(|(x, r)| x / r).collect();
        let mut sorted = ratio.clone();
        sorted.sort_by(f64::total_cmp);
        ratio_median[i] = median(&sorted);
        fast.insert(
            v.name().into(),
            json!({
                "msgs_per_s": spread(&tput[i]),
                "throughput_ratio_to_plain": spread(&ratio),
                "ratios_per_rep": ratio,
            }),
        );
    }
    let (callgrind, allocs) = if a.no_callgrind {
        (Value::Null, Value::Null)
    } else {
        (callgrind()?, allocations()?)
    };

    // 2. Switch pause.
    let mut runs: [Vec<PauseRun>; 2] = [Vec::new(), Vec::new()];
    for rep in 0..a.pause_reps {
        for k in 0..2 {
            let i = (rep + k) % 2;
            let r = rt
                .block_on(async {
                    let limit = Duration::from_secs_f64(a.messages as f64 / a.rate + 30.0);
                    tokio::time::timeout(limit, async {
                        if i == 0 {
                            pause_run::<LockFree>(&a).await
                        } else {
                            pause_run::<Lock>(&a).await
                        }
                    })
                    .await
                })
                .context("switch-pause run stalled")??;
            let name = [LockFree::NAME, Lock::NAME][i];
            let mut p = r.pauses.clone();
            p.sort_by(f64::total_cmp);
            eprintln!(
                "rep {rep} switch pause {name:>9}: {} switches, pause p50 {:.1} us p99 {:.1} us \
                 max {:.1} us, lost {}",
                r.switches.len(),
                quantile(&p, 0.5),
                quantile(&p, 0.99),
                p.last().copied().unwrap_or(f64::NAN),
                r.lost
            );
            runs[i].push(r);
        }
    }
    let lf = summarize_pause(&runs[0], &a);
    let lk = summarize_pause(&runs[1], &a);
    let mut multi_runs = Vec::new();
    for rep in 0..a.pause_reps {
        let r = rt
            .block_on(async {
                let limit = Duration::from_secs_f64(a.messages as f64 / a.rate + 30.0);
                tokio::time::timeout(limit, pause_run_multilateral(&a)).await
            })
            .context("multilateral switch-pause run stalled")??;
        let mut p = r.pauses.clone();
        p.sort_by(f64::total_cmp);
        eprintln!(
            "rep {rep} switch pause multilateral: {} switches, pause p50 {:.1} us p99 {:.1} us \
             max {:.1} us, lost {}",
            r.switches.len(),
            quantile(&p, 0.5),
            quantile(&p, 0.99),
            p.last().copied().unwrap_or(f64::NAN),
            r.lost
        );
        multi_runs.push(r);
    }
    let ml = summarize_pause(&multi_runs, &a);
    let wall = started.elapsed();

    let instr_delta = |name: &str| callgrind["gate_cost_per_traversal"][name].as_f64();
    let pause_p99 = |v: &Value| v["pause_us"]["p99"].as_f64().unwrap_or(f64::NAN);
    let lossless = |v: &Value| {
        v["loss"]["lost"] == 0 && v["loss"]["duplicates"] == 0 && v["switches"].as_u64() > Some(0)
    };
    eprintln!(
        "\nthroughput / plain (median of {}): lock-free {:.4}, lock {:.4}",
        a.reps, ratio_median[1], ratio_median[2]
    );
    if let (Some(f), Some(l)) = (instr_delta("lock-free"), instr_delta("lock")) {
        eprintln!(
            "callgrind: gate cost per send or recv vs plain: lock-free {f:.1}, lock {l:.1} \
             instructions"
        );
    }
    eprintln!(
        "switch pause p99: lock-free {:.1} us, lock {:.1} us",
        pause_p99(&lf),
        pause_p99(&lk)
    );

    let out = json!({
        "bench": "reconfig",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "base": "unix datagram (uds::DatagramConnect -> uds::DatagramListener), loopback",
        "cpu": a.cpu,
        "size": a.size,
        "wall_seconds": wall.as_secs_f64(),
        "fast_path": {
            "what": "echo throughput, bursts in flight, never switching; ratios per repetition \
                     against plain = stack![Noop, base]",
            "reps": a.reps,
            "millis": a.millis,
            "slice_ms": a.slice_ms,
            "burst": a.burst,
            "variants": fast,
            "callgrind": callgrind,
            "allocations_per_msg": allocs,
        },
        "switch_pause": {
            "rate_msgs_per_s": a.rate,
            "switch_every": a.switch_every,
            "messages_per_run": a.messages,
            "runs_per_mechanism": a.pause_reps,
            "window_us": a.window_us,
            "lock-free": lf,
            "lock": lk,
        },
        "multilateral": {
            "what": "the same open-loop echo on a negotiated Unix stream connection; each switch \
                     is a two-phase commit proposed by the client (lock-free mechanism at both \
                     ends); switch_call_us is the proposal until the peer's switch point arrived",
            "base": "unix stream (uds::StreamConnect -> listen(uds::StreamListener)), loopback",
            "pause": ml,
        },
        "checks": {
            "lock_free_throughput_ratio": ratio_median[1],
            "lock_throughput_ratio": ratio_median[2],
            "lock_free_within_2pct_of_plain": ratio_median[1] >= 0.98,
            "lock_free_gate_instr_per_traversal": instr_delta("lock-free"),
            "lock_gate_instr_per_traversal": instr_delta("lock"),
            "lock_free_pause_p99_us": pause_p99(&lf),
            "lock_pause_p99_us": pause_p99(&lk),
            "pause_p99_under_1ms": pause_p99(&lf) < 1000.0 && pause_p99(&lk) < 1000.0,
            "multilateral_pause_p99_us": pause_p99(&ml),
            "zero_loss": lossless(&lf) && lossless(&lk),
            "multilateral_zero_loss": lossless(&ml),
        },
    });
    println!("{out}");
    Ok(())
}

fn sock_path(tag: &str) -> PathBuf {
    use std::sync::atomic::AtomicU64;
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "chunnel-bench-reconfig-{tag}-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A message: `seq` big-endian, then padding up to `size` bytes.
fn numbered(seq: u64, size: usize) -> Bytes {
    let mut b = BytesMut::with_capacity(size);
    b.put_u64(seq);
    b.put_bytes(0xab, size - 8);
    b.freeze()
}

fn seq_of(m: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(m.get(..8)?.try_into().ok()?))
}

// ---------------------------------------------------------------------------------------------
// 1. Fast path

/// One repetition: the three client stacks, each with its own echo server, measured in turn
/// in slices of `--slice-ms` (order rotated every slice) until each had `--millis`, so slow
/// drifts of the machine hit every variant alike.
async fn throughput_rep(rep: usize, a: &Args) -> Result<[f64; 3]> {
    let mut conns = Vec::new();
    let mut listeners = Vec::new();
    for _ in VARIANTS {
        let path = sock_path("tput");
        listeners.push(Noop.serve(uds::DatagramListener::bind(path.clone()).await?));
        conns.push(uds::DatagramConnect::new(path));
    }
    let (l2, l1, l0) = (
        listeners.pop().context("listener")?,
        listeners.pop().context("listener")?,
        listeners.pop().context("listener")?,
    );
    let (b0, b1, b2) = (conns[0].clone(), conns[1].clone(), conns[2].clone());
    let (plain, e0) = connect_echo(stack![Noop, b0], l0, a.burst, a.size).await?;
    let sel = select(Noop, Noop).reconfigurable::<LockFree>();
    let (free, e1) = connect_echo(stack![sel, Shared, b1], l1, a.burst, a.size).await?;
    let sel = select(Noop, Noop).reconfigurable::<Lock>();
    let (lock, e2) = connect_echo(stack![sel, Shared, b2], l2, a.burst, a.size).await?;

    let msg = numbered(0, a.size);
    let mut slots = vec![None; a.burst];
    let slice = Duration::from_millis(a.slice_ms.max(1));
    let mut done = [0u64; 3];
    let mut secs = [0f64; 3];
    // Warm-up: one slice each.
    bursts_for(&plain, &msg, &mut slots, slice).await?;
    bursts_for(&free, &msg, &mut slots, slice).await?;
    bursts_for(&lock, &msg, &mut slots, slice).await?;
    let slices = (a.millis / a.slice_ms.max(1)).max(1) as usize;
    for s in 0..slices {
        for k in 0..VARIANTS.len() {
            let i = (rep + s + k) % VARIANTS.len();
            let (n, t) = match i {
                0 => bursts_for(&plain, &msg, &mut slots, slice).await?,
                1 => bursts_for(&free, &msg, &mut slots, slice).await?,
                _ => bursts_for(&lock, &msg, &mut slots, slice).await?,
            };
            done[i] += n;
            secs[i] += t;
        }
    }
    for e in [e0, e1, e2] {
        e.abort();
    }
    Ok([0, 1, 2].map(|i| done[i] as f64 / secs[i]))
}

/// Connects, starts the echo task for the server side and returns both.
async fn connect_echo<C, L>(
    mut client: C,
    mut listener: L,
    burst: usize,
    size: usize,
) -> Result<(C::Connection, tokio::task::JoinHandle<()>)>
where
    C: Chunnel<()>,
    C::Connection: ChunnelConnection<Data = Bytes>,
    L: Listener + 'static,
    L::Connection: ChunnelConnection<Data = Bytes> + 'static,
{
    let conn = client.connect_wrap(()).await?;
    // The first message makes the server accept; its echo is the handshake's end.
    conn.send_one(numbered(u64::MAX, size)).await?;
    let server = listener.accept().await?;
    let echo = tokio::spawn(async move {
        let _listener = listener;
        let mut slots = vec![None; burst.max(32)];
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
    conn.recv_one().await?;
    Ok((conn, echo))
}

/// Echoes bursts for `dur`; returns the messages echoed and the seconds taken.
async fn bursts_for<C: ChunnelConnection<Data = Bytes>>(
    conn: &C,
    msg: &Bytes,
    slots: &mut [Option<Bytes>],
    dur: Duration,
) -> Result<(u64, f64)> {
    let burst = slots.len();
    let start = Instant::now();
    let deadline = start + dur;
    let mut done = 0u64;
    while Instant::now() < deadline {
        conn.send(std::iter::repeat_n(msg, burst).cloned()).await?;
        recv_exact(conn, slots).await?;
        done += burst as u64;
    }
    Ok((done, start.elapsed().as_secs_f64()))
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

// ---------------------------------------------------------------------------------------------
// The probe (callgrind, allocations)

async fn probe(v: Variant, a: &Args) -> Result<Value> {
    // UDP, not Unix datagrams: a Unix datagram socket queues at most `max_dgram_qlen` (10)
    // datagrams, so a burst of 32 to a reflector in the same thread would block forever.
    let reflector = StdUdp::bind("127.0.0.1:0").context("binding the reflector")?;
    let base = udp::Connect::new(reflector.local_addr()?);
    let r = match v {
        Variant::Plain => drive(stack![Noop, base], &reflector, a).await,
        Variant::LockFree => {
            let sel = select(Noop, Noop).reconfigurable::<LockFree>();
            drive(stack![sel, Shared, base], &reflector, a).await
        }
        Variant::Lock => {
            let sel = select(Noop, Noop).reconfigurable::<Lock>();
            drive(stack![sel, Shared, base], &reflector, a).await
        }
    };
    let (messages, allocations) = r?;
    Ok(json!({
        "variant": v.name(),
        "messages": messages,
        "allocations": allocations,
    }))
}

async fn drive<S>(mut s: S, reflector: &StdUdp, a: &Args) -> Result<(u64, u64)>
where
    S: Chunnel<()>,
    S::Connection: ChunnelConnection<Data = Bytes>,
{
    let conn = s.connect_wrap(()).await.context("connect")?;
    let msg = numbered(0, a.size);
    let mut slots = vec![None; a.burst];
    let mut buf = vec![0u8; 65_536];
    crate::probe::measured_loop(&conn, reflector, &msg, &mut slots, &mut buf, 50).await?;
    let before = crate::alloc::count();
    crate::probe::measured_loop(&conn, reflector, &msg, &mut slots, &mut buf, a.probe_bursts)
        .await?;
    let allocs = crate::alloc::count() - before;
    Ok(((a.probe_bursts * a.burst) as u64, allocs))
}

fn self_exe() -> Result<PathBuf> {
    std::env::current_exe().context("locating chunnel-bench")
}

/// Heap allocations per message round trip, per variant (counted natively).
fn allocations() -> Result<Value> {
    let mut m = serde_json::Map::new();
    for v in VARIANTS {
        let out = Command::new(self_exe()?)
            .args(["reconfig", "--probe", v.name(), "--probe-bursts", "2000"])
            .output()
            .context("running the allocation probe")?;
        if !out.status.success() {
            bail!("probe failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let r: Value = serde_json::from_slice(&out.stdout).context("probe output")?;
        let per = r["allocations"].as_f64().unwrap_or(f64::NAN)
            / r["messages"].as_f64().unwrap_or(f64::NAN);
        m.insert(v.name().into(), json!(per));
    }
    Ok(Value::Object(m))
}

/// Instructions per message round trip under callgrind, per variant.
fn callgrind() -> Result<Value> {
    if Command::new("valgrind").arg("--version").output().is_err() {
        eprintln!("valgrind not found: skipping instruction counts");
        return Ok(json!({ "skipped": "valgrind not installed" }));
    }
    let exe = self_exe()?;
    let (b1, b2) = (200usize, 1200usize);
    let mut per_msg = serde_json::Map::new();
    let mut counts = Vec::new();
    for v in VARIANTS {
        let i1 = callgrind_run(&exe, v, b1)?;
        let i2 = callgrind_run(&exe, v, b2)?;
        let x = (i2 as f64 - i1 as f64) / ((b2 - b1) * 32) as f64;
        eprintln!(
            "callgrind: {:>9}: {x:.1} instructions per message round trip",
            v.name()
        );
        per_msg.insert(v.name().into(), json!(x));
        counts.push(x);
    }
    // Each message crosses the client's gate twice (send, recv).
    let gate = |i: usize| (counts[i] - counts[0]) / 2.0;
    Ok(json!({
        "workload": "udp (as overhead's probe), 64 B, bursts of 32, reflected by a blocking \
                     socket in the same thread; user-space instructions only",
        "instr_per_msg_round_trip": per_msg,
        "gate_cost_per_traversal": { "lock-free": gate(1), "lock": gate(2) },
        "gate_cost_per_call": { "lock-free": gate(1) * 32.0, "lock": gate(2) * 32.0 },
        "method": format!(
            "(Ir({b2} bursts) - Ir({b1} bursts)) / (1000 bursts x 32), measured_loop \
             only; gate cost per traversal = (variant - plain) / 2 (a message goes down on send, up \
             on recv); per call = that x 32 (one call per burst)"
        ),
    }))
}

fn callgrind_run(exe: &Path, v: Variant, bursts: usize) -> Result<u64> {
    let args = [
        "reconfig",
        "--probe",
        v.name(),
        "--probe-bursts",
        &bursts.to_string(),
    ]
    .map(String::from);
    crate::probe::callgrind_ir(exe, "*measured_loop*", &args)
}

// ---------------------------------------------------------------------------------------------
// 2. Switch pause

struct PauseRun {
    /// (seq, time), in delivery order; microseconds since the start.
    deliveries: Vec<(u64, f64)>,
    /// When each message was handed to `send` (its due time is `seq / rate`).
    sent_at: Vec<f64>,
    /// (start, end) of every `reconfigure` call, microseconds since the start.
    switches: Vec<(f64, f64)>,
    pauses: Vec<f64>,
    sent: u64,
    lost: u64,
    duplicates: u64,
    reordered: u64,
}

async fn pause_run<M: Mechanism>(a: &Args) -> Result<PauseRun> {
    let path = sock_path("pause");
    let server = Noop.serve(uds::DatagramListener::bind(path.clone()).await?);
    let sel = select(Noop, Noop).reconfigurable::<M>();
    let handle = sel.handle();
    let client = stack![sel, Shared, uds::DatagramConnect::new(path)];
    let (conn, echo) = connect_echo(client, server, 32, a.size).await?;
    let r = measure_pause(
        Arc::new(conn),
        move |to| {
            let handle = handle.clone();
            async move {
                match handle.reconfigure(to).await? {
                    1 => Ok(()),
                    k => bail!("a switch changed {k} connections, not 1"),
                }
            }
        },
        a,
    )
    .await;
    echo.abort();
    r
}

/// The multilateral switch: a negotiated connection over a Unix stream socket (the two-phase
/// commit needs a base that delivers in order without loss), `select(Noop, Noop)` made
/// reconfigurable at both ends, and a `Coordinator` at each; the client proposes every switch
/// and the server votes and follows, in-band.
async fn pause_run_multilateral(a: &Args) -> Result<PauseRun> {
    use chunnel_negotiate::commit::{Coordinator, Outcome, Policy};
    use chunnel_negotiate::{Client, Config, listen};
    let addr = uds::UnixAddr::Abstract(
        sock_path("multilateral")
            .to_string_lossy()
            .into_owned()
            .into_bytes(),
    );
    let stack = || select(Noop, Noop).reconfigurable::<LockFree>();
    let mut server = listen(
        stack(),
        uds::StreamListener::bind(addr.clone()).await?,
        Config::default(),
    );
    let echo = tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            let Ok(coord) = Coordinator::start(&conn, &stack(), Policy::default()) else {
                continue;
            };
            tokio::spawn(async move {
                let _coord = coord;
                let mut slots = vec![None; 32];
                while let Ok(k) = conn.recv(&mut slots).await {
                    if conn
                        .send(slots[..k].iter_mut().flatten().map(|m| m.clone()))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            });
        }
    });
    let base = uds::StreamConnect::new(addr).connect_wrap(()).await?;
    let conn = Client::new(Config::default())
        .connect("bench", stack(), base)
        .await?;
    let coord = Arc::new(Coordinator::start(&conn, &stack(), Policy::default())?);
    let r = measure_pause(
        Arc::new(conn),
        move |to| {
            let coord = coord.clone();
            async move {
                match coord.switch(to).await? {
                    Outcome::Switched => Ok(()),
                    other => bail!("the multilateral switch to {to:?} ended {other:?}"),
                }
            }
        },
        a,
    )
    .await;
    echo.abort();
    r
}

/// Runs the open-loop echo on `conn` while `switch` flips the branch every
/// `--switch-every` messages; collects deliveries, switch windows and loss.
async fn measure_pause<C, F, Fut>(conn: Arc<C>, mut switch: F, a: &Args) -> Result<PauseRun>
where
    C: ChunnelConnection<Data = Bytes> + 'static,
    F: FnMut(Side) -> Fut + Send + 'static,
    Fut: Future<Output = Result<()>> + Send,
{
    let n = a.messages;
    let interval_us = 1e6 / a.rate;
    let t0 = Instant::now();
    let us = move || t0.elapsed().as_secs_f64() * 1e6;
    let deliveries = Arc::new(Mutex::new(Vec::with_capacity(n as usize)));
    let (switch_tx, mut switch_rx) = tokio::sync::mpsc::channel::<()>(4);

    let receiver = {
        let conn = conn.clone();
        let deliveries = deliveries.clone();
        tokio::spawn(async move {
            let mut slots = vec![None; 32];
            while let Ok(k) = conn.recv(&mut slots).await {
                let t = us();
                let mut d = deliveries.lock().unwrap_or_else(|e| e.into_inner());
                for s in &mut slots[..k] {
                    if let Some(seq) = s.take().as_deref().and_then(seq_of) {
                        d.push((seq, t));
                    }
                }
            }
        })
    };
    let switcher = tokio::spawn(async move {
        let mut windows = Vec::new();
        let mut to = Side::Right;
        while switch_rx.recv().await.is_some() {
            let start = us();
            switch(to).await?;
            windows.push((start, us()));
            to = match to {
                Side::Left => Side::Right,
                Side::Right => Side::Left,
            };
        }
        anyhow::Ok(windows)
    });
    let sender = {
        let conn = conn.clone();
        let (size, every) = (a.size, a.switch_every);
        tokio::spawn(async move {
            let mut sent_at = vec![0f64; n as usize];
            let mut next = 0u64;
            while next < n {
                let due = ((us() / interval_us) as u64 + 1).min(n);
                if due <= next {
                    // Open loop at a fixed rate: spin (yielding, so the other tasks and the
                    // I/O driver run) until the next message is due.
                    tokio::task::yield_now().await;
                    continue;
                }
                let k = (due - next).min(32);
                let t = us();
                sent_at[next as usize..(next + k) as usize].fill(t);
                conn.send((next..next + k).map(|s| numbered(s, size)))
                    .await?;
                let before = next;
                next += k;
                if next / every > before / every && next < n {
                    // Never blocks the sender; requests are `--switch-every` messages
                    // apart, so at most one is ever pending.
                    let _ = switch_tx.try_send(());
                }
            }
            drop(switch_tx);
            anyhow::Ok(sent_at)
        })
    };
    let sent_at = sender.await??;
    let switches = switcher.await??;
    // Wait for the last echoes (a loss shows as a count that stops short).
    let mut last = (0usize, Instant::now());
    loop {
        let got = deliveries.lock().unwrap_or_else(|e| e.into_inner()).len();
        if got as u64 >= n || last.1.elapsed() > Duration::from_millis(500) {
            break;
        }
        if got != last.0 {
            last = (got, Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    receiver.abort();
    let deliveries = std::mem::take(&mut *deliveries.lock().unwrap_or_else(|e| e.into_inner()));

    let mut seen = vec![false; n as usize];
    let (mut duplicates, mut reordered, mut max_seen) = (0u64, 0u64, None::<u64>);
    for &(s, _) in &deliveries {
        match seen.get_mut(s as usize) {
            Some(b) if *b => duplicates += 1,
            Some(b) => *b = true,
            None => bail!("unexpected sequence number {s}"),
        }
        if max_seen.is_some_and(|m| s < m) {
            reordered += 1;
        }
        max_seen = max_seen.max(Some(s));
    }
    let lost = seen.iter().filter(|b| !**b).count() as u64;
    let times: Vec<f64> = deliveries.iter().map(|d| d.1).collect();
    let pauses = switches
        .iter()
        .map(|&(s, e)| {
            // Gaps between consecutive deliveries that overlap the switch [s, e].
            times
                .windows(2)
                .filter(|w| w[1] >= s && w[0] <= e)
                .map(|w| w[1] - w[0])
                .fold(0.0, f64::max)
        })
        .collect();
    Ok(PauseRun {
        deliveries,
        sent_at,
        switches,
        pauses,
        sent: n,
        lost,
        duplicates,
        reordered,
    })
}

fn quantiles(mut xs: Vec<f64>) -> Value {
    xs.sort_by(f64::total_cmp);
    json!({
        "p50": quantile(&xs, 0.5),
        "p99": quantile(&xs, 0.99),
        "max": xs.last(),
        "count": xs.len(),
    })
}

fn summarize_pause(runs: &[PauseRun], a: &Args) -> Value {
    let interval_us = 1e6 / a.rate;
    let w = a.window_us as f64;
    // steady, before, during, after
    let mut classes: [Vec<f64>; 4] = Default::default();
    let (mut pauses, mut durations, mut steady_gaps) = (vec![], vec![], vec![]);
    let mut pause_p99_per_run = vec![];
    let (mut sent, mut received, mut lost, mut dups, mut reordered, mut switches) =
        (0, 0, 0, 0, 0, 0);
    let mut rates = vec![];
    let mut lag = vec![];
    for r in runs {
        for &(seq, t) in &r.deliveries {
            let sent = r.sent_at[seq as usize];
            lag.push(sent - seq as f64 * interval_us);
            // The switches nearest this message: the last one that ended before it was sent
            // and the next one (switches are far apart compared with `w`).
            let i = r.switches.partition_point(|sw| sw.1 < sent);
            let class = [i.checked_sub(1), Some(i)]
                .into_iter()
                .flatten()
                .filter_map(|j| r.switches.get(j))
                .find_map(|&(s, e)| {
                    if sent <= e && t >= s {
                        Some(2)
                    } else if sent < s && sent >= s - w {
                        Some(1)
                    } else if sent > e && sent <= e + w {
                        Some(3)
                    } else {
                        None
                    }
                })
                .unwrap_or(0);
            classes[class].push(t - sent);
        }
        let times: Vec<f64> = r.deliveries.iter().map(|d| d.1).collect();
        for g in times.windows(2) {
            let near = r
                .switches
                .iter()
                .any(|&(s, e)| g[1] >= s - w && g[0] <= e + w);
            if !near {
                steady_gaps.push(g[1] - g[0]);
            }
        }
        durations.extend(r.switches.iter().map(|(s, e)| e - s));
        pauses.extend(&r.pauses);
        let mut p = r.pauses.clone();
        p.sort_by(f64::total_cmp);
        pause_p99_per_run.push(quantile(&p, 0.99));
        sent += r.sent;
        received += r.deliveries.len() as u64;
        lost += r.lost;
        dups += r.duplicates;
        reordered += r.reordered;
        switches += r.switches.len() as u64;
        if let (Some(first), Some(last)) = (r.deliveries.first(), r.deliveries.last())
            && last.1 > first.1
        {
            rates.push((r.deliveries.len() - 1) as f64 / (last.1 - first.1) * 1e6);
        }
    }
    let [steady, before, during, after] = classes;
    json!({
        "switches": switches,
        "rtt_us": {
            "steady": quantiles(steady),
            "before": quantiles(before),
            "during": quantiles(during),
            "after": quantiles(after),
        },
        "pause_us": quantiles(pauses),
        "pause_p99_us_per_run": spread(&pause_p99_per_run),
        "steady_gap_us": quantiles(steady_gaps),
        "switch_call_us": quantiles(durations),
        "sender_lag_us": quantiles(lag),
        "delivered_msgs_per_s": spread(&rates),
        "loss": {
            "sent": sent,
            "received": received,
            "lost": lost,
            "duplicates": dups,
            "reordered": reordered,
        },
    })
}
