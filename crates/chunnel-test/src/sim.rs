//! Deterministic simulation support: an in-memory datagram network, an adapter that lets any
//! byte connection be the base of a negotiated connection, a seeded generator for scenario
//! choices, and the seed explorer (many seeds, each reproducible on its own, a failing one
//! printed with the command that reruns just it).
//!
//! The scenarios themselves live in the tests that use this module
//! (`crates/chunnel-negotiate/tests/sim_connection.rs`, `crates/chunnel-rendezvous/tests/
//! sim_group.rs`); docs/testing.md ("Deterministic simulation") says what they prove.
//!
//! A run of one seed is meant to be on a current-thread tokio runtime whose clock is paused
//! (`Builder::new_current_thread().enable_time().start_paused(true)`, which needs tokio's
//! `test-util` feature, so the test crate builds the runtime, not this module): one thread,
//! no socket, no wall clock, and time moves only when every task waits for a timer. The
//! network below is channels, so nothing in it depends on the machine.
//!
//! ```
//! use chunnel_test::sim::{Explorer, SimRng};
//!
//! let seeds = Explorer::new("doc", "cargo test --doc").seeds(10);
//! let report = Explorer::new("doc", "cargo test --doc")
//!     .run(&seeds, |seed| {
//!         let mut rng = SimRng::new(seed);
//!         let x = rng.below(10);
//!         if x < 10 { Ok(x) } else { Err(format!("{x} out of range")) }
//!     })
//!     .unwrap();
//! assert_eq!(report.results.len(), seeds.len());
//! ```

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use chunnel::{Chunnel, ChunnelConnection, Error, Listener, PeerHandoff, SendHeader};
use tokio::sync::mpsc;

/// The environment variable that runs one seed only (`CHUNNEL_SIM_SEED=1234`).
pub const SEED_VAR: &str = "CHUNNEL_SIM_SEED";
/// The environment variable that sets how many seeds to run (`CHUNNEL_SIM_SEEDS=20000`),
/// starting at [`FIRST_VAR`] (default 0).
pub const SEEDS_VAR: &str = "CHUNNEL_SIM_SEEDS";
/// The first seed of a run (`CHUNNEL_SIM_FIRST=1000000`).
pub const FIRST_VAR: &str = "CHUNNEL_SIM_FIRST";
/// How many times [`SEED_VAR`]'s seed runs (`CHUNNEL_SIM_REPEAT=20`, default 1): a seed fixes
/// the scenario, not every interleaving (see docs/testing.md), so a rerun repeats it.
pub const REPEAT_VAR: &str = "CHUNNEL_SIM_REPEAT";
/// The repeat count the printed rerun command asks for.
pub const RERUN_REPEAT: u64 = 200;

/// splitmix64: the scenario's choices, a function of the seed only.
#[derive(Clone, Debug)]
pub struct SimRng(u64);

impl SimRng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        SimRng(seed ^ 0x51AB_5EED_0000_0000)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 if `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `true` with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Uniform in `0..=max` milliseconds.
    pub fn millis(&mut self, max: u64) -> Duration {
        Duration::from_millis(self.below(max + 1))
    }

    /// A seed for a sub-stream (another component's generator).
    pub fn fork(&mut self) -> u64 {
        self.next_u64()
    }
}

/// Runs simulations one at a time in this process: the explorer holds it for a whole run,
/// and a test that builds its own paused runtime should too.
///
/// Some state is shared by every runtime of a process, and a paused clock runs ahead while
/// its tasks wait on another runtime: chunnel-negotiate's limit on concurrent offer searches
/// is a process-wide semaphore, so a simulated server waiting for a permit that another test
/// thread's simulation holds would see virtual seconds pass (a handshake then gave up after
/// 12.7 s of virtual time in well under a millisecond of wall time).
pub fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The results of a run of many seeds.
#[derive(Debug)]
pub struct Report<T> {
    /// Each seed and what its run returned, in the order run.
    pub results: Vec<(u64, T)>,
    /// Wall-clock time of the whole run.
    pub elapsed: Duration,
}

/// Runs a simulation over many seeds; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct Explorer {
    name: String,
    rerun: String,
    wall_limit: Duration,
}

impl Explorer {
    /// An explorer for the scenario `name`; `rerun` is the command that runs its test (the
    /// failure message prefixes it with `CHUNNEL_SIM_SEED=<seed>`).
    pub fn new(name: impl Into<String>, rerun: impl Into<String>) -> Self {
        Explorer {
            name: name.into(),
            rerun: rerun.into(),
            wall_limit: Duration::from_secs(120),
        }
    }

    /// The longest one seed may take on the wall clock before the process is aborted with
    /// the seed printed (a seed whose virtual time stops moving would otherwise hang):
    /// default 120 s.
    pub fn with_wall_limit(mut self, limit: Duration) -> Self {
        self.wall_limit = limit;
        self
    }

    /// The seeds to run: the one in `CHUNNEL_SIM_SEED` if set (`CHUNNEL_SIM_REPEAT` times,
    /// default once); else `CHUNNEL_SIM_SEEDS` (default `default_count`) seeds from
    /// `CHUNNEL_SIM_FIRST` (default 0).
    pub fn seeds(&self, default_count: u64) -> Vec<u64> {
        let var = |k: &str| {
            std::env::var(k).ok().map(|v| {
                v.trim()
                    .parse::<u64>()
                    .unwrap_or_else(|_| panic!("{k}={v:?} is not a number"))
            })
        };
        if let Some(s) = var(SEED_VAR) {
            return vec![s; var(REPEAT_VAR).unwrap_or(1).max(1) as usize];
        }
        let first = var(FIRST_VAR).unwrap_or(0);
        let n = var(SEEDS_VAR).unwrap_or(default_count);
        (first..first.saturating_add(n)).collect()
    }

    /// The command that reruns `seed` alone ([`RERUN_REPEAT`] times).
    pub fn rerun_command(&self, seed: u64) -> String {
        format!(
            "{SEED_VAR}={seed} {REPEAT_VAR}={RERUN_REPEAT} {}",
            self.rerun
        )
    }

    /// Runs `run` for each seed in order and stops at the first that fails (returns `Err`
    /// or panics): the error names the seed and the command that reruns it. A seed that
    /// runs past the wall limit aborts the process after printing the same.
    pub fn run<T>(
        &self,
        seeds: &[u64],
        mut run: impl FnMut(u64) -> Result<T, String>,
    ) -> Result<Report<T>, String> {
        let _one = exclusive();
        let started = Instant::now();
        let watchdog = Watchdog::start(self.clone());
        let mut results = Vec::with_capacity(seeds.len());
        for &seed in seeds {
            watchdog.enter(seed);
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| run(seed)));
            let r = match r {
                Ok(r) => r,
                Err(p) => Err(format!("panicked: {}", panic_message(&*p))),
            };
            match r {
                Ok(t) => results.push((seed, t)),
                Err(e) => {
                    return Err(format!(
                        "simulation `{}`: seed {seed} failed after {} passing seeds: {e}\n\
                         rerun just this seed with:\n    {}",
                        self.name,
                        results.len(),
                        self.rerun_command(seed)
                    ));
                }
            }
        }
        Ok(Report {
            results,
            elapsed: started.elapsed(),
        })
    }
}

/// What [`Explorer::replay`] found.
#[derive(Debug, Default)]
pub struct Replay {
    /// Seeds whose two runs took the same path.
    pub same: usize,
    /// Seeds left out of the comparison (the caller's `skip`).
    pub skipped: usize,
    /// Seeds whose runs differed, with both runs' results.
    pub differ: Vec<(u64, String)>,
}

impl Explorer {
    /// The replay check: runs every seed twice (each a [`Explorer::run`]) and compares the
    /// two runs of each seed by `path`, leaving out the seeds `skip` names in either run.
    pub fn replay<T: std::fmt::Debug, P: PartialEq>(
        &self,
        seeds: &[u64],
        mut run: impl FnMut(u64) -> Result<T, String>,
        path: impl Fn(&T) -> P,
        skip: impl Fn(&T) -> bool,
    ) -> Result<Replay, String> {
        let a = self.run(seeds, &mut run)?;
        let b = self.run(seeds, &mut run)?;
        let mut out = Replay::default();
        for ((seed, x), (_, y)) in a.results.iter().zip(&b.results) {
            if skip(x) || skip(y) {
                out.skipped += 1;
            } else if path(x) == path(y) {
                out.same += 1;
            } else {
                out.differ.push((*seed, format!("{x:?}\n{y:?}")));
            }
        }
        Ok(out)
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_owned()
    }
}

/// Aborts the process if one seed runs longer than the wall limit.
struct Watchdog {
    shared: Arc<WatchShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct WatchShared {
    /// The seed running and since when (a counter of entries, so a new seed restarts it).
    seed: AtomicU64,
    entries: AtomicU64,
    stop: AtomicBool,
}

impl Watchdog {
    fn start(ex: Explorer) -> Self {
        let shared = Arc::new(WatchShared {
            seed: AtomicU64::new(0),
            entries: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let sh = shared.clone();
        let thread = std::thread::spawn(move || {
            let tick = Duration::from_millis(100);
            let (mut seen, mut since) = (0, Instant::now());
            while !sh.stop.load(Ordering::Acquire) {
                std::thread::sleep(tick);
                let e = sh.entries.load(Ordering::Acquire);
                if e != seen {
                    (seen, since) = (e, Instant::now());
                } else if e != 0 && since.elapsed() > ex.wall_limit {
                    let seed = sh.seed.load(Ordering::Acquire);
                    eprintln!(
                        "simulation `{}`: seed {seed} still running after {:?} of wall time \
                         (virtual time stopped moving?); aborting.\nrerun just this seed with:\n    {}",
                        ex.name,
                        ex.wall_limit,
                        ex.rerun_command(seed)
                    );
                    std::process::abort();
                }
            }
        });
        Watchdog {
            shared,
            thread: Some(thread),
        }
    }

    fn enter(&self, seed: u64) {
        self.shared.seed.store(seed, Ordering::Release);
        self.shared.entries.fetch_add(1, Ordering::AcqRel);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A bounded wait in virtual time: `what` did not happen within `limit` is an `Err`.
pub async fn within<T>(
    limit: Duration,
    what: &str,
    f: impl Future<Output = T>,
) -> Result<T, String> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| format!("{what}: not done within {limit:?} (virtual time)"))
}

// ---------------------------------------------------------------------------------------
// The in-memory network.

/// How many messages wait in one direction of a [`MemConn`] before more are dropped.
pub const MEM_QUEUE: usize = 4096;

/// One end of an in-memory datagram link: whatever the other end sends arrives here, in
/// order, without loss while the receiver keeps up (a message that finds [`MEM_QUEUE`]
/// waiting is dropped, as a datagram socket's full buffer drops); put a
/// [`crate::FaultInjector`] on top for faults. Implements
/// [`SendHeader`] and [`PeerHandoff`] (no listener-level hand-off), so it can be the base
/// of a negotiated connection as it is.
#[derive(Debug)]
pub struct MemConn {
    tx: mpsc::Sender<Bytes>,
    rx: tokio::sync::Mutex<mpsc::Receiver<Bytes>>,
}

/// Two connected ends.
pub fn mem_pair() -> (MemConn, MemConn) {
    let (atx, brx) = mpsc::channel(MEM_QUEUE);
    let (btx, arx) = mpsc::channel(MEM_QUEUE);
    (
        MemConn {
            tx: atx,
            rx: tokio::sync::Mutex::new(arx),
        },
        MemConn {
            tx: btx,
            rx: tokio::sync::Mutex::new(brx),
        },
    )
}

impl ChunnelConnection for MemConn {
    type Data = Bytes;

    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        for m in burst {
            match self.tx.try_send(m) {
                Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => {}
                Err(mpsc::error::TrySendError::Closed(_)) => return Err(Error::PeerClosed),
            }
        }
        Ok(())
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let mut rx = self.rx.lock().await;
        let first = rx.recv().await.ok_or(Error::PeerClosed)?;
        slots[0] = Some(first);
        let mut n = 1;
        while n < slots.len() {
            match rx.try_recv() {
                Ok(m) => {
                    slots[n] = Some(m);
                    n += 1;
                }
                Err(_) => break,
            }
        }
        Ok(n)
    }
}

impl SendHeader for MemConn {
    fn send_with_header<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        let whole: Vec<Bytes> = burst.into_iter().map(|m| with_header(header, &m)).collect();
        self.send(whole)
    }
}

impl PeerHandoff for MemConn {
    fn hand_off(&self, _first: Bytes) -> bool {
        false
    }
}

fn with_header(header: &[u8], m: &Bytes) -> Bytes {
    if header.is_empty() {
        return m.clone();
    }
    let mut w = BytesMut::with_capacity(header.len() + m.len());
    w.extend_from_slice(header);
    w.extend_from_slice(m);
    w.freeze()
}

/// The client side of an in-memory network with one server: each `connect_wrap` makes a
/// link and hands its other end to the [`MemListener`].
#[derive(Clone, Debug)]
pub struct MemConnect {
    to: mpsc::Sender<MemConn>,
}

/// The server side of an in-memory network: yields the server end of each new link.
#[derive(Debug)]
pub struct MemListener {
    from: mpsc::Receiver<MemConn>,
}

/// A network with one server (at most 64 links waiting to be accepted; more are refused).
pub fn mem_net() -> (MemConnect, MemListener) {
    let (to, from) = mpsc::channel(64);
    (MemConnect { to }, MemListener { from })
}

impl chunnel::Negotiate for MemConnect {
    fn id(&self) -> &'static str {
        "chunnel-test/mem/1"
    }
}

impl Chunnel<()> for MemConnect {
    type Connection = MemConn;

    async fn connect_wrap(&mut self, _: ()) -> Result<MemConn, Error> {
        let (a, b) = mem_pair();
        self.to
            .try_send(b)
            .map_err(|_| Error::ConnectionRefused { addr: "mem".into() })?;
        Ok(a)
    }
}

impl Listener for MemListener {
    type Connection = MemConn;

    async fn accept(&mut self) -> Result<MemConn, Error> {
        self.from.recv().await.ok_or(Error::Closed)
    }
}

/// Lets any byte connection be the base of a negotiated connection: [`SendHeader`] by
/// copying the header in front of each message, [`PeerHandoff`] with nothing to hand off.
/// (A stack of `Ordered` over `Reliable` over a [`crate::FaultInjector`] over a [`MemConn`]
/// is such a connection: exactly once, in order, over a faulty link.)
#[derive(Debug)]
pub struct Base<C>(pub C);

impl<C: ChunnelConnection<Data = Bytes>> ChunnelConnection for Base<C> {
    type Data = Bytes;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        self.0.send(burst)
    }

    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Bytes>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        self.0.recv(slots)
    }
}

impl<C: ChunnelConnection<Data = Bytes>> SendHeader for Base<C> {
    fn send_with_header<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        let whole: Vec<Bytes> = burst.into_iter().map(|m| with_header(header, &m)).collect();
        self.0.send(whole)
    }
}

impl<C> PeerHandoff for Base<C> {
    fn hand_off(&self, _first: Bytes) -> bool {
        false
    }
}

/// A listener that builds `chunnel` over every connection `inner` accepts and hands out
/// the result as a [`Base`] (the server side of a negotiated connection over a stack of
/// layers below the negotiation).
#[derive(Debug)]
pub struct BaseListener<L, Ch> {
    inner: L,
    chunnel: Ch,
}

impl<L, Ch> BaseListener<L, Ch> {
    /// Wraps `inner`.
    pub fn new(inner: L, chunnel: Ch) -> Self {
        BaseListener { inner, chunnel }
    }
}

impl<L, Ch> Listener for BaseListener<L, Ch>
where
    L: Listener,
    L::Connection: Send,
    Ch: Chunnel<L::Connection> + Clone + Send + Sync,
    Ch::Connection: ChunnelConnection<Data = Bytes>,
{
    type Connection = Base<Ch::Connection>;

    async fn accept(&mut self) -> Result<Self::Connection, Error> {
        let c = self.inner.accept().await?;
        let mut ch = self.chunnel.clone();
        Ok(Base(ch.connect_wrap(c).await?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chunnel::ConnectionExt;

    #[test]
    fn rng_is_a_function_of_the_seed() {
        let a: Vec<u64> = (0..8).map(|_| SimRng::new(7).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut r = SimRng::new(7);
        let b: Vec<u64> = (0..8).map(|_| r.next_u64()).collect();
        assert_ne!(b[0], b[1]);
        let mut r = SimRng::new(8);
        assert_ne!(r.next_u64(), b[0]);
    }

    #[test]
    fn explorer_names_the_failing_seed() {
        let ex = Explorer::new("t", "cargo test x");
        let e = ex
            .run(&[1, 2, 3, 4], |s| {
                if s == 3 { Err("boom".into()) } else { Ok(s) }
            })
            .unwrap_err();
        assert!(
            e.contains("seed 3 failed after 2 passing seeds: boom"),
            "{e}"
        );
        assert!(
            e.contains("CHUNNEL_SIM_SEED=3 CHUNNEL_SIM_REPEAT=200 cargo test x"),
            "{e}"
        );
        let e = ex
            .run(&[5], |_| -> Result<(), String> { panic!("kaboom") })
            .unwrap_err();
        assert!(e.contains("seed 5") && e.contains("kaboom"), "{e}");
    }

    #[tokio::test]
    async fn mem_links_carry_messages_in_order() {
        let (mut c, mut l) = mem_net();
        let a = c.connect_wrap(()).await.unwrap();
        let b = l.accept().await.unwrap();
        a.send_with_header(b"h", [Bytes::from("1"), Bytes::from("2")])
            .await
            .unwrap();
        assert_eq!(b.recv_one().await.unwrap(), "h1");
        assert_eq!(b.recv_one().await.unwrap(), "h2");
        b.send_one(Bytes::from("x")).await.unwrap();
        assert_eq!(a.recv_one().await.unwrap(), "x");
        drop(b);
        assert!(matches!(a.recv_one().await, Err(Error::PeerClosed)));
    }
}
