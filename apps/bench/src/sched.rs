//! `chunnel-bench sched`: the determinism experiment (INSANE thesis §7.2.2 analog). A 1 ms
//! periodic flow (64 B, class 0) shares one connection with a bulk background flow (1200 B,
//! class 1, as fast as the connection takes it) over loopback UDP, through
//! `chunnel_std::sched::Sched` with each policy:
//!
//! The bulk flow sends `--bulk-burst` messages at once every `--bulk-every-us` (a period
//! prime to the periodic flow's, so bursts meet it at every phase), under what the loopback
//! receiver can take, so the latency measured is the sender's queueing and not the receiving
//! socket's backlog.
//!
//! * `alone`: the periodic flow with no bulk flow (FIFO): the baseline;
//! * `fifo`: one queue in arrival order;
//! * `priority`: strict priority, class 0 first;
//! * `time_aware`: a 1 ms cycle whose first `--window-us` are class 0's alone and the rest
//!   class 1's, with a guard band of `--guard-us` per bulk message, the cycles starting where
//!   the periodic flow's do.
//!
//! The one-way latency counts from the message's scheduled transmission time: for `alone`,
//! `fifo` and `priority` the producer hands it over `--phase-us` into a cycle and that is its
//! scheduled time; with the time-aware shaper, as in TSN, the producer queues it
//! `--lead-us` ahead and its scheduled time is its window's opening (the gate releases it),
//! so the time it waits for its gate is by design and not counted.
//!
//! The sender side is pinned to CPU 0: a thread with a current-thread tokio runtime runs the
//! connection's driver and the bulk producer (on tokio's millisecond timers), and the
//! periodic producer is a thread of its own that sleeps (nanosleep, 1 ns timer slack) until
//! `--phase-us` into each cycle, stamps its message and hands it to the connection (the
//! producers do not spin: on a shared machine a spinning thread uses up its share and is
//! then descheduled for milliseconds). With the time-aware shaper only, the driver waits
//! for a gate on its precise timer (a timerfd; tokio's timers are coarser than the windows)
//! and yields only for the last 20 µs before it (`Config::spin_below`). A raw `std::net::UdpSocket` receiver thread pinned to CPU 1 stamps
//! each periodic message's arrival: the one-way latency is the kernel's receive timestamp
//! (SO_TIMESTAMPNS: when the datagram reached the receiving socket, so the receiver thread's
//! own scheduling is not counted) minus the send stamp (one host, one clock). Figures per mode: p50/p99/max one-way latency, periodic
//! messages lost, bulk throughput received. Modes are interleaved, `--reps` repetitions,
//! median with min/max; the ratios divide each mode's p99 and max by the `alone` run of the
//! same repetition.

use std::net::UdpSocket;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, stack};
use chunnel_net::udp;
use chunnel_std::sched::{Config, GateEntry, GateSchedule, Policy, Sched};
use serde_json::{Value, json};

use crate::stats::{quantile, spread};

const SENDER_CPU: usize = 0;
const RECEIVER_CPU: usize = 1;
const PERIOD: Duration = Duration::from_millis(1);
const PERIODIC_SIZE: usize = 64;
const BULK_SIZE: usize = 1200;
/// With the time-aware shaper, how long before a gate the driver stops sleeping and yields.
const SPIN_MARGIN: Duration = Duration::from_micros(20);

#[derive(clap::Args, Clone)]
pub(crate) struct Args {
    /// Seconds per run (one periodic message per millisecond).
    #[arg(long, default_value_t = 2.0)]
    secs: f64,
    /// Repetitions of every mode (interleaved).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// The periodic class's window at the start of each 1 ms cycle (time-aware shaper).
    #[arg(long, default_value_t = 200)]
    window_us: u64,
    /// Guard band per bulk message (time-aware shaper): the bulk class starts no message it
    /// cannot finish, by this estimate, before its gate closes.
    #[arg(long, default_value_t = 4)]
    guard_us: u64,
    /// When the periodic producer sends, into each cycle (FIFO and priority).
    #[arg(long, default_value_t = 20)]
    phase_us: u64,
    /// With the time-aware shaper, how long before its window the periodic producer queues
    /// its message (the shaper releases it when the window opens).
    #[arg(long, default_value_t = 300)]
    lead_us: u64,
    /// Per-class queue capacity, messages.
    #[arg(long, default_value_t = 256)]
    capacity: usize,
    /// Most messages per burst handed to the socket.
    #[arg(long, default_value_t = 32)]
    max_burst: usize,
    /// Bulk messages sent at once, every `--bulk-every-us`.
    #[arg(long, default_value_t = 64)]
    bulk_burst: usize,
    /// How often the bulk flow sends a burst (0: back to back, as fast as the queue takes
    /// them; loopback then outpaces the receiver, which drops).
    #[arg(long, default_value_t = 1700)]
    bulk_every_us: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Alone,
    Fifo,
    Priority,
    TimeAware,
}

const MODES: [Mode; 4] = [Mode::Alone, Mode::Fifo, Mode::Priority, Mode::TimeAware];

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Alone => "alone",
            Mode::Fifo => "fifo",
            Mode::Priority => "priority",
            Mode::TimeAware => "time_aware",
        }
    }
}

/// One run's figures.
struct Run {
    p50_us: f64,
    p99_us: f64,
    /// p99 over the messages handed over in time.
    p99_on_time_us: f64,
    max_us: f64,
    sent: u64,
    lost: u64,
    missed: u64,
    /// Periodic messages the producer handed over more than a window after it meant to
    /// (with the shaper: after its window closed, so it waits a cycle).
    late: u64,
    /// CPU time of the thread running the connection's driver (and the bulk producer), as a
    /// fraction of the run's wall time.
    driver_cpu: f64,
    bulk_mbps: f64,
}

pub(crate) fn run(a: Args) -> Result<()> {
    let out = measure(&a)?;
    println!("{out}");
    Ok(())
}

fn measure(a: &Args) -> Result<Value> {
    if !(a.secs > 0.0 && a.secs <= 600.0) || a.reps == 0 {
        bail!("--secs must be in (0, 600] and --reps at least 1");
    }
    if a.window_us == 0 || a.window_us >= 1000 || a.phase_us >= 1000 || a.lead_us >= 900 {
        bail!("need 0 < --window-us < 1000, --phase-us < 1000 and --lead-us < 900");
    }
    let started = Instant::now();
    let mut figs: Vec<Vec<Run>> = MODES.iter().map(|_| Vec::new()).collect();
    for rep in 0..a.reps {
        for (i, &m) in MODES.iter().enumerate() {
            let r = one(a, m).with_context(|| format!("{} rep {rep}", m.name()))?;
            eprintln!(
                "rep {rep} {:>10}: one-way p50 {:>8.1} us  p99 {:>8.1} us (on time {:>8.1})  max {:>8.1} us  \
                 lost {}/{} (missed {}, late {})  bulk {:>7.1} Mbit/s  driver CPU {:.0} %",
                m.name(),
                r.p50_us,
                r.p99_us,
                r.p99_on_time_us,
                r.max_us,
                r.lost,
                r.sent,
                r.missed,
                r.late,
                r.bulk_mbps,
                r.driver_cpu * 100.0
            );
            figs[i].push(r);
        }
    }
    let col = |i: usize, f: fn(&Run) -> f64| -> Vec<f64> { figs[i].iter().map(f).collect() };
    let mut results = serde_json::Map::new();
    let mut ratios = serde_json::Map::new();
    for (i, m) in MODES.iter().enumerate() {
        results.insert(
            m.name().into(),
            json!({
                "one_way_p50_us": spread(&col(i, |r| r.p50_us)),
                "one_way_p99_us": spread(&col(i, |r| r.p99_us)),
                "one_way_p99_on_time_us": spread(&col(i, |r| r.p99_on_time_us)),
                "one_way_max_us": spread(&col(i, |r| r.max_us)),
                "periodic_sent": figs[i].iter().map(|r| r.sent).sum::<u64>(),
                "periodic_lost": figs[i].iter().map(|r| r.lost).sum::<u64>(),
                "periodic_missed_by_sender": figs[i].iter().map(|r| r.missed).sum::<u64>(),
                "periodic_handed_over_late": figs[i].iter().map(|r| r.late).sum::<u64>(),
                "bulk_mbps": spread(&col(i, |r| r.bulk_mbps)),
                "driver_thread_cpu": spread(&col(i, |r| r.driver_cpu)),
            }),
        );
        let over = |f: fn(&Run) -> f64| -> Vec<f64> {
            figs[i]
                .iter()
                .zip(&figs[0])
                .map(|(r, b)| f(r) / f(b))
                .collect()
        };
        ratios.insert(
            m.name().into(),
            json!({ "p99": spread(&over(|r| r.p99_us)), "max": spread(&over(|r| r.max_us)) }),
        );
    }
    let med = |i: usize, f: fn(&Run) -> f64| {
        let mut v = col(i, f);
        v.sort_by(f64::total_cmp);
        crate::stats::median(&v)
    };
    let (fifo, prio, tas) = (1, 2, 3);
    eprintln!(
        "median p99: alone {:.1} us, fifo {:.1} us, priority {:.1} us, time-aware {:.1} us",
        med(0, |r| r.p99_us),
        med(fifo, |r| r.p99_us),
        med(prio, |r| r.p99_us),
        med(tas, |r| r.p99_us)
    );
    Ok(json!({
        "bench": "sched",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "transport": "kernel UDP over loopback, one connection",
        "period_us": PERIOD.as_micros() as u64,
        "periodic_size": PERIODIC_SIZE,
        "bulk_size": BULK_SIZE,
        "secs_per_run": a.secs,
        "reps": a.reps,
        "cpus": { "sender": SENDER_CPU, "receiver": RECEIVER_CPU },
        "config": {
            "capacity": a.capacity, "max_burst": a.max_burst, "window_us": a.window_us,
            "guard_us": a.guard_us, "phase_us": a.phase_us, "lead_us": a.lead_us,
            "bulk_burst": a.bulk_burst, "bulk_every_us": a.bulk_every_us,
        },
        "wall_seconds": started.elapsed().as_secs_f64(),
        "results": results,
        "ratio_over_alone": ratios,
        "checks": {
            "priority_p99_below_fifo": med(prio, |r| r.p99_us) < med(fifo, |r| r.p99_us),
            "time_aware_p99_below_fifo": med(tas, |r| r.p99_us) < med(fifo, |r| r.p99_us),
        },
    }))
}

fn pin(cpu: usize) {
    if let Err(e) = crate::pin_to(cpu) {
        eprintln!("warning: {e}");
    }
}

/// What the receiver learned.
struct Received {
    latencies_ns: Vec<u64>,
    /// The same for the messages the producer handed over in time.
    on_time_ns: Vec<u64>,
    periodic: u64,
    bulk_bytes: u64,
    window: Duration,
}

/// One run of `mode`.
fn one(a: &Args, mode: Mode) -> Result<Run> {
    let sock = UdpSocket::bind("127.0.0.1:0")?;
    sock.set_read_timeout(Some(Duration::from_millis(20)))?;
    grow_receive_buffer(&sock, 8 << 20);
    let on: libc::c_int = 1;
    // SAFETY: a valid socket fd and a pointer to a c_int of the stated length.
    unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&sock),
            libc::SOL_SOCKET,
            libc::SO_TIMESTAMPNS,
            (&raw const on).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    let addr = sock.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let stop_rx = Arc::clone(&stop);
    let receiver = std::thread::spawn(move || -> Received {
        pin(RECEIVER_CPU);
        let mut buf = vec![0u8; 2048];
        let mut r = Received {
            latencies_ns: Vec::new(),
            on_time_ns: Vec::new(),
            periodic: 0,
            bulk_bytes: 0,
            window: Duration::ZERO,
        };
        let mut first_bulk: Option<Instant> = None;
        let mut last_bulk = Instant::now();
        loop {
            match recv_stamped(&sock, &mut buf) {
                Ok((n, kernel)) if n >= 14 && buf[0] == 0 => {
                    let arrived = kernel.unwrap_or_else(realtime_ns);
                    let stamp = u64::from_be_bytes(buf[5..13].try_into().unwrap_or([0; 8]));
                    r.latencies_ns.push(arrived.saturating_sub(stamp));
                    if buf[13] == 0 {
                        r.on_time_ns.push(arrived.saturating_sub(stamp));
                    }
                    r.periodic += 1;
                }
                Ok((n, _)) => {
                    let t = Instant::now();
                    first_bulk.get_or_insert(t);
                    last_bulk = t;
                    r.bulk_bytes += n as u64;
                }
                Err(_) if stop_rx.load(Ordering::Acquire) => break,
                Err(_) => {}
            }
        }
        if let Some(f) = first_bulk {
            r.window = last_bulk - f;
        }
        r
    });
    let count = (a.secs * 1000.0).round() as u64;
    let sent = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let sent_tx = Arc::clone(&sent);
    let args = a.clone();
    let sender = std::thread::spawn(move || -> Result<f64> {
        pin(SENDER_CPU);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let cpu0 = thread_cpu();
        let t0 = Instant::now();
        let r = rt.block_on(send_side(args, mode, addr, count, sent_tx));
        let cpu = thread_cpu().saturating_sub(cpu0);
        r.map(|()| cpu.as_secs_f64() / t0.elapsed().as_secs_f64())
    });
    let r = sender
        .join()
        .map_err(|_| anyhow::anyhow!("sender panicked"))?;
    std::thread::sleep(Duration::from_millis(50));
    stop.store(true, Ordering::Release);
    let got = receiver
        .join()
        .map_err(|_| anyhow::anyhow!("receiver panicked"))?;
    let driver_cpu = r?;
    let (sent, missed, late) = (
        sent[0].load(Ordering::Relaxed),
        sent[1].load(Ordering::Relaxed),
        sent[2].load(Ordering::Relaxed),
    );
    let mut us: Vec<f64> = got.latencies_ns.iter().map(|&n| n as f64 / 1e3).collect();
    us.sort_by(f64::total_cmp);
    if us.is_empty() {
        bail!("no periodic message arrived");
    }
    let secs = got.window.as_secs_f64();
    Ok(Run {
        p50_us: quantile(&us, 0.5),
        p99_us: quantile(&us, 0.99),
        p99_on_time_us: {
            let mut v: Vec<f64> = got.on_time_ns.iter().map(|&n| n as f64 / 1e3).collect();
            v.sort_by(f64::total_cmp);
            if v.is_empty() {
                f64::NAN
            } else {
                quantile(&v, 0.99)
            }
        },
        max_us: us.last().copied().unwrap_or(f64::NAN),
        sent,
        lost: sent.saturating_sub(got.periodic),
        missed,
        late,
        driver_cpu,
        bulk_mbps: if secs > 0.0 {
            got.bulk_bytes as f64 * 8.0 / secs / 1e6
        } else {
            0.0
        },
    })
}

async fn send_side(
    a: Args,
    mode: Mode,
    addr: std::net::SocketAddr,
    count: u64,
    sent: Arc<[AtomicU64; 3]>,
) -> Result<()> {
    let base = Instant::now() + Duration::from_millis(5);
    let window = Duration::from_micros(a.window_us);
    let policy = match mode {
        Mode::Alone | Mode::Fifo => Policy::Fifo,
        Mode::Priority => Policy::StrictPriority,
        Mode::TimeAware => Policy::TimeAware(
            GateSchedule::new(vec![
                GateEntry::new(window, [0]),
                GateEntry::new(PERIOD - window, [1]),
            ])?
            .with_guard_band(Duration::from_micros(a.guard_us)),
        ),
    };
    let mut cfg = Config::default()
        .with_policy(policy)
        .with_classes(2)
        .with_capacity(a.capacity)
        .with_max_burst(a.max_burst)
        .with_base(base);
    if mode == Mode::TimeAware {
        // tokio's timers are millisecond-grained, coarser than the windows: the driver sleeps
        // on its precise timer (timerfd) until `SPIN_MARGIN` before a gate, and yields for
        // that last margin only.
        cfg = cfg.with_precise_timer(true).with_spin_below(SPIN_MARGIN);
    }
    let classify = |m: &Bytes| m.first().copied().unwrap_or(1);
    let conn = Arc::new(
        stack![Sched::new(cfg, classify), udp::Connect::new(addr)]
            .connect_wrap(())
            .await?,
    );
    let done = Arc::new(AtomicBool::new(false));
    // The periodic producer: its own thread on the sender's CPU, sleeping precisely
    // (nanosleep with a 1 ns timer slack), handing each message to the connection's driver.
    let periodic = {
        let (conn, done, phase, lead) = (
            Arc::clone(&conn),
            Arc::clone(&done),
            Duration::from_micros(a.phase_us),
            Duration::from_micros(a.lead_us),
        );
        let window = Duration::from_micros(a.window_us);
        std::thread::spawn(move || -> Result<()> {
            pin(SENDER_CPU);
            // SAFETY: PR_SET_TIMERSLACK takes an integer argument and affects this thread.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1u64, 0u64, 0u64, 0u64) };
            let rt = tokio::runtime::Builder::new_current_thread().build()?;
            let mut buf = [0u8; PERIODIC_SIZE];
            let r = (|| {
                for k in 0..count {
                    // With the shaper the message is queued `lead` ahead and scheduled for
                    // its window's opening; otherwise sent and scheduled `phase` into a cycle.
                    let due = base + PERIOD * (k as u32 + 2);
                    let (target, scheduled) = if mode == Mode::TimeAware {
                        (due - lead, due)
                    } else {
                        (due + phase, due + phase)
                    };
                    let now = Instant::now();
                    if now > target + PERIOD {
                        // The producer was descheduled for this whole period.
                        sent[1].fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    if target > now {
                        std::thread::sleep(target - now);
                    }
                    buf[0] = 0;
                    buf[1..5].copy_from_slice(&(k as u32).to_be_bytes());
                    // The scheduled transmission time, on the realtime clock.
                    let (real, mono) = (realtime_ns(), Instant::now());
                    let late = mono > scheduled.max(target) + window;
                    if late {
                        sent[2].fetch_add(1, Ordering::Relaxed);
                    }
                    buf[13] = u8::from(late);
                    let stamp = if scheduled >= mono {
                        real + (scheduled - mono).as_nanos() as u64
                    } else {
                        real - (mono - scheduled).as_nanos() as u64
                    };
                    buf[5..13].copy_from_slice(&stamp.to_be_bytes());
                    rt.block_on(conn.send([Bytes::copy_from_slice(&buf)]))?;
                    sent[0].fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })();
            done.store(true, Ordering::Release);
            r
        })
    };
    // The bulk producer, on the driver's runtime (tokio timers: bursts at roughly the period).
    let mut m = vec![0x5au8; BULK_SIZE];
    m[0] = 1;
    let m = Bytes::from(m);
    let every = Duration::from_micros(a.bulk_every_us.max(1));
    let mut next = Instant::now();
    while !done.load(Ordering::Acquire) {
        if mode != Mode::Alone {
            conn.send(std::iter::repeat_n(m.clone(), a.bulk_burst))
                .await?;
        }
        if a.bulk_every_us == 0 && mode != Mode::Alone {
            tokio::task::yield_now().await;
        } else {
            next = (next + every).max(Instant::now());
            tokio::time::sleep_until(next.into()).await;
        }
    }
    periodic
        .join()
        .map_err(|_| anyhow::anyhow!("periodic producer panicked"))??;
    conn.flush().await;
    Ok(())
}

/// Asks for a receive buffer of `bytes` (SO_RCVBUFFORCE, past rmem_max, when privileged;
/// else SO_RCVBUF up to rmem_max), so a receiver descheduled for a moment does not drop.
fn grow_receive_buffer(sock: &UdpSocket, bytes: i32) {
    use std::os::fd::AsRawFd;
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
        // SAFETY: a valid socket fd and a pointer to an i32 of the stated length.
        let r = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&raw const bytes).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            )
        };
        if r == 0 {
            return;
        }
    }
}

/// CPU time this thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a pointer to a live timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Now, in ns since the Unix epoch (the clock of SO_TIMESTAMPNS).
fn realtime_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Receives one datagram into `buf`, with the kernel's arrival timestamp (SO_TIMESTAMPNS: when
/// the datagram reached the receiving socket, so the receiver thread's own scheduling delay
/// is not counted) if it gave one.
fn recv_stamped(sock: &UdpSocket, buf: &mut [u8]) -> std::io::Result<(usize, Option<u64>)> {
    use std::os::fd::AsRawFd;
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cmsg = [0u64; 16];
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cmsg) as _;
    // SAFETY: `msg` points at one live iovec over `buf` and at `cmsg`, both of the stated
    // lengths, for the duration of the call.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &raw mut msg, 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut stamp = None;
    // SAFETY: the CMSG macros walk the control buffer the kernel filled, within
    // msg_controllen; the timespec is read unaligned.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&raw const msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_TIMESTAMPNS {
                let ts: libc::timespec = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast());
                stamp = Some(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64);
            }
            c = libc::CMSG_NXTHDR(&raw const msg, c);
        }
    }
    Ok((n as usize, stamp))
}
