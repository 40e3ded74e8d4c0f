//! A packet scheduler on the send path of any connection (INSANE thesis §6.3.3).
//!
//! [`Sched`] is a Chunnel over any connection: what it sends goes through per-class bounded
//! queues and a [`Policy`] decides what leaves next:
//!
//! * [`Policy::Fifo`]: one order for all, the order messages were sent in;
//! * [`Policy::StrictPriority`]: the most urgent class (the lowest number) with a queued
//!   message goes first, so a priority message overtakes queued bulk;
//! * [`Policy::TimeAware`]: a time-aware shaper in the style of IEEE 802.1Qbv. A
//!   [`GateSchedule`] is a cyclic list of [`GateEntry`]s `(duration, open classes)`; a class
//!   starts a transmission only while its gate is open, and with a guard band
//!   ([`GateSchedule::with_guard_band`], the time one message takes to send) a message is not
//!   started unless it can finish before its gate closes. Among the open classes, strict
//!   priority. The cycles start at [`Config::base`] (when the connection is made, by default),
//!   so an application that knows the base can produce its messages just as their window
//!   opens.
//!
//! Received messages pass through untouched: the scheduler is a local, send-side transform
//! and puts nothing on the wire, so only the sending end needs it. Its capability is
//! compositional (`sched`, label `local`): negotiation accepts it whether the peer has it or
//! not.
//!
//! # Classes
//!
//! A message's class (0 to 7, 0 the most urgent) is given by a classifier function passed at
//! construction, `Fn(&Data) -> u8`, rather than by wrapping the data in `(class, data)`: the
//! layer then keeps its inner connection's `Data` and composes anywhere in a stack (a
//! serializer above it, a datapath below it) without the layers above knowing about classes;
//! the classifier looks at what the application already marks (a header byte, a message
//! kind). Classes past [`Config::classes`]` - 1` fall into the last (least urgent) class.
//!
//! # Queues and batching
//!
//! Each class has a queue of at most [`Config::capacity`] messages. When a class's queue is
//! full, [`Overflow::Wait`] (the default) makes `send` wait for room (backpressure: a stalled
//! peer stalls the senders, memory stays bounded) and [`Overflow::Drop`] drops the message
//! and counts it ([`Stats::dropped`]). Whenever more than one message may leave, the
//! scheduler hands the inner connection up to [`Config::max_burst`] of them as one burst
//! (one `sendmmsg` on UDP): batching is opportunistic, a lone message is never held back to
//! wait for company.
//!
//! # The driver
//!
//! The policy is the sans-IO [`Scheduler`] (`enqueue`, `next(now) -> Decision { send,
//! wake_at }`), tested deterministically with an injected clock. The connection runs it
//! with one tokio task (spawned by `connect_wrap`, so a runtime must be running) that owns the
//! send side of the inner connection: it asks the scheduler for a burst, sends it, and sleeps
//! until the decision's `wake_at` or until a new message is queued. tokio's timers have
//! millisecond resolution, coarser than a gate schedule's windows: with the time-aware policy
//! and [`Config::precise_timer`] (the default) the driver sleeps on a timer of its own
//! instead, a Linux timerfd armed with the absolute deadline and registered with tokio's
//! reactor (one per connection, created when the connection is made; where it cannot be
//! created, the driver uses tokio's timers). The timer is set [`Config::spin_below`] (20 µs
//! by default) ahead of the deadline and the driver yields in a loop for that last margin, so
//! a gate is met to within microseconds while the driver sleeps through the rest of the wait
//! (with the precise timer off, a large `spin_below` trades a busy core for precision
//! instead). On a tokio clock that is paused or was advanced (`tokio::time::pause`), the
//! driver neither spins nor uses its timer: it sleeps on tokio's clock.
//!
//! `send` returns once its messages are queued (not sent). If the inner connection fails
//! (other than [`chunnel::Error::MessageTooLarge`], which loses the rest of that burst and is
//! counted in [`SchedConnection::failed_bursts`]), the driver stops and later sends fail with
//! that error. `send` is cancel safe in the sense of [`ChunnelConnection`]: the messages
//! queued before the cancellation are sent, the rest of the burst is not. When the
//! connection is dropped, the driver keeps sending what is queued, by the policy, for at most
//! [`Config::linger`], then ends.
//!
//! ```
//! use std::time::Duration;
//! use bytes::Bytes;
//! use chunnel::{Chunnel, ChunnelConnection, ConnectionExt, stack};
//! use chunnel_net::udp;
//! use chunnel_std::sched::{Config, GateEntry, GateSchedule, Policy, Sched};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let peer = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
//! // Class 0 alone for 100 µs of every millisecond, class 1 for the rest.
//! let gates = GateSchedule::new(vec![
//!     GateEntry::new(Duration::from_micros(100), [0]),
//!     GateEntry::new(Duration::from_micros(900), [1]),
//! ])?
//! .with_guard_band(Duration::from_micros(20));
//! let classify = |m: &Bytes| m.first().copied().unwrap_or(1);
//! let mut stack = stack![
//!     Sched::new(Config::default().with_policy(Policy::TimeAware(gates)), classify),
//!     udp::Connect::new(peer.local_addr()?)
//! ];
//! let conn = stack.connect_wrap(()).await?;
//! conn.send([Bytes::from_static(b"\x01bulk"), Bytes::from_static(b"\x00urgent")]).await?;
//! let mut buf = [0u8; 64];
//! let n = peer.recv(&mut buf).await?;
//! assert!(buf[..n] == b"\x00urgent"[..] || buf[..n] == b"\x01bulk"[..]);
//! # Ok(()) }
//! ```

mod core;
mod timer;

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use chunnel::{Capability, Chunnel, ChunnelConnection, Negotiate};
use tokio::sync::Notify;

pub use self::core::{
    ClassMask, Decision, GateEntry, GateSchedule, MAX_CLASSES, Overflow, Policy, Scheduler, Stats,
};

/// Settings of a scheduled connection.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// The scheduling policy.
    pub policy: Policy,
    /// How many classes (1..=8).
    pub classes: usize,
    /// Most messages queued per class.
    pub capacity: usize,
    /// Most messages handed to the inner connection in one burst.
    pub max_burst: usize,
    /// What a send does when its class's queue is full.
    pub overflow: Overflow,
    /// Where the time-aware policy's cycles start (`None`: when the connection is made).
    pub base: Option<Instant>,
    /// How long a dropped connection's driver keeps sending what is queued.
    pub linger: Duration,
    /// The spin margin: the driver waits for the last `spin_below` before a gate opening
    /// (or the linger deadline) by yielding in a loop instead of a timer, which wakes it that
    /// much early (20 µs by default; zero: always a timer). Not on a paused tokio clock.
    pub spin_below: Duration,
    /// With the time-aware policy, the driver sleeps on a precise timer of its own (a Linux
    /// timerfd, microsecond wake-ups) instead of tokio's millisecond timers (on by default;
    /// without effect where timerfd is unavailable). Needs a runtime with IO enabled.
    pub precise_timer: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            policy: Policy::Fifo,
            classes: MAX_CLASSES,
            capacity: 256,
            max_burst: 32,
            overflow: Overflow::Wait,
            base: None,
            linger: Duration::from_secs(1),
            spin_below: Duration::from_micros(20),
            precise_timer: true,
        }
    }
}

impl Config {
    /// Sets [`Config::policy`].
    pub fn with_policy(mut self, p: Policy) -> Self {
        self.policy = p;
        self
    }
    /// Sets [`Config::classes`] (clamped to 1..=8).
    pub fn with_classes(mut self, n: usize) -> Self {
        self.classes = n.clamp(1, MAX_CLASSES);
        self
    }
    /// Sets [`Config::capacity`] (at least 1).
    pub fn with_capacity(mut self, n: usize) -> Self {
        self.capacity = n.max(1);
        self
    }
    /// Sets [`Config::max_burst`] (at least 1).
    pub fn with_max_burst(mut self, n: usize) -> Self {
        self.max_burst = n.max(1);
        self
    }
    /// Sets [`Config::overflow`].
    pub fn with_overflow(mut self, o: Overflow) -> Self {
        self.overflow = o;
        self
    }
    /// Sets [`Config::base`].
    pub fn with_base(mut self, base: Instant) -> Self {
        self.base = Some(base);
        self
    }
    /// Sets [`Config::linger`].
    pub fn with_linger(mut self, d: Duration) -> Self {
        self.linger = d;
        self
    }
    /// Sets [`Config::spin_below`].
    pub fn with_spin_below(mut self, d: Duration) -> Self {
        self.spin_below = d;
        self
    }
    /// Sets [`Config::precise_timer`].
    pub fn with_precise_timer(mut self, on: bool) -> Self {
        self.precise_timer = on;
        self
    }
}

/// The packet scheduler Chunnel; see the [module docs](self). `F` is the classifier.
#[derive(Clone, Debug)]
pub struct Sched<F> {
    cfg: Config,
    classify: F,
}

impl<F> Sched<F> {
    /// A scheduler with `cfg` that puts each message in class `classify(&msg)`.
    pub fn new(cfg: Config, classify: F) -> Self {
        Sched { cfg, classify }
    }
}

impl<F> Negotiate for Sched<F> {
    fn id(&self) -> &'static str {
        "chunnel-std/sched/1"
    }

    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::compositional("sched", ["local"])]
    }
}

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Whether tokio's clock, read as `tokio_now` just before, is the real one: not paused or
/// advanced (`tokio::time::pause`, test-util), where it runs apart from [`Instant::now`].
/// Spinning on a paused clock would never end, and the precise timer runs on real time.
fn clock_is_real(tokio_now: Instant) -> bool {
    const APART: Duration = Duration::from_millis(1);
    let real = Instant::now();
    real.saturating_duration_since(tokio_now) < APART
        && tokio_now.saturating_duration_since(real) < APART
}

impl<C, F> Chunnel<C> for Sched<F>
where
    C: ChunnelConnection + 'static,
    C::Data: 'static,
    F: Fn(&C::Data) -> u8 + Clone + Send + Sync + 'static,
{
    type Connection = SchedConnection<C, F>;

    async fn connect_wrap(&mut self, inner: C) -> Result<Self::Connection, chunnel::Error> {
        let cfg = self.cfg.clone();
        let base = cfg.base.unwrap_or_else(now);
        let shared = Arc::new(Shared {
            sched: Mutex::new(Scheduler::new(
                cfg.policy.clone(),
                cfg.classes,
                cfg.capacity,
                cfg.max_burst,
                base,
            )),
            work: Notify::new(),
            room: Notify::new(),
            closing: AtomicBool::new(false),
            sending: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            error: Mutex::new(None),
            failed_bursts: AtomicU64::new(0),
        });
        let inner = Arc::new(inner);
        let timer = if cfg.precise_timer && matches!(cfg.policy, Policy::TimeAware(_)) {
            timer::PreciseTimer::new()
        } else {
            None
        };
        let precise_timer = timer.is_some();
        tokio::spawn(drive(
            Arc::clone(&inner),
            Arc::clone(&shared),
            Waits {
                max_burst: cfg.max_burst,
                linger: cfg.linger,
                spin_below: cfg.spin_below,
                timer,
            },
        ));
        Ok(SchedConnection {
            inner,
            shared,
            precise_timer,
            classify: self.classify.clone(),
            overflow: cfg.overflow,
        })
    }
}

struct Shared<T> {
    sched: Mutex<Scheduler<T>>,
    /// Wakes the driver: something was queued, or the connection was dropped.
    work: Notify,
    /// Wakes senders waiting for room (and `flush`): the driver took messages or stopped.
    room: Notify,
    closing: AtomicBool,
    /// The driver is handing a burst to the inner connection.
    sending: AtomicBool,
    /// The driver ended (after a failure of the inner connection).
    stopped: AtomicBool,
    /// The inner connection's error that stopped the driver, until a sender reports it.
    error: Mutex<Option<chunnel::Error>>,
    failed_bursts: AtomicU64,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, Scheduler<T>> {
        self.sched.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The error a send reports once the driver has stopped.
    fn stopped_error(&self) -> chunnel::Error {
        self.error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or(chunnel::Error::Closed)
    }
}

/// The driver's settings.
struct Waits {
    max_burst: usize,
    linger: Duration,
    spin_below: Duration,
    timer: Option<timer::PreciseTimer>,
}

/// The driver task: asks the scheduler for bursts and sends them on the inner connection.
async fn drive<C: ChunnelConnection>(inner: Arc<C>, shared: Arc<Shared<C::Data>>, waits: Waits) {
    let Waits {
        max_burst,
        linger,
        spin_below,
        mut timer,
    } = waits;
    let mut burst: Vec<C::Data> = Vec::with_capacity(max_burst);
    let mut deadline: Option<Instant> = None;
    loop {
        let work = shared.work.notified();
        let mut work = pin!(work);
        work.as_mut().enable();
        let now = now();
        if shared.closing.load(Ordering::Acquire) {
            deadline.get_or_insert(now + linger);
        }
        // Marked before the queue is emptied, so `flush` never sees an empty queue while a
        // burst is on its way to the inner connection.
        shared.sending.store(true, Ordering::Release);
        let d = shared.lock().next(now, &mut burst);
        if burst.is_empty() {
            shared.sending.store(false, Ordering::Release);
            // A `flush` that saw the mark with an empty queue checks again.
            shared.room.notify_waiters();
        } else {
            shared.room.notify_waiters();
            let send = inner.send(burst.drain(..));
            let r = match deadline {
                Some(dl) => tokio::time::timeout_at(dl.into(), send)
                    .await
                    .unwrap_or(Ok(())),
                None => send.await,
            };
            burst.clear();
            shared.sending.store(false, Ordering::Release);
            shared.room.notify_waiters();
            match r {
                Ok(()) => {}
                Err(chunnel::Error::MessageTooLarge { .. }) => {
                    shared.failed_bursts.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    *shared.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    break;
                }
            }
            if deadline.is_some_and(|dl| self::now() >= dl) {
                break;
            }
            continue;
        }
        if let Some(dl) = deadline
            && (d.wake_at.is_none() || now >= dl)
        {
            break;
        }
        let wake = match (d.wake_at, deadline) {
            (Some(w), Some(dl)) => Some(w.min(dl)),
            (w, dl) => w.or(dl),
        };
        let Some(w) = wake else {
            work.await;
            continue;
        };
        let real = clock_is_real(now);
        if !real {
            // A paused or advanced tokio clock: only its timers move it.
            tokio::select! {
                () = tokio::time::sleep_until(w.into()) => {}
                () = &mut work => {}
            }
            continue;
        }
        if w.saturating_duration_since(now) < spin_below {
            tokio::task::yield_now().await;
            continue;
        }
        // Wake `spin_below` early, and spin the rest.
        let early = w.checked_sub(spin_below).unwrap_or(w);
        match &timer {
            Some(t) => {
                let failed = tokio::select! {
                    r = t.sleep_until(early) => r.is_err(),
                    // Never first on a real clock (tokio's timers do not fire early); there in
                    // case the clock is paused after all.
                    () = tokio::time::sleep_until(w.into()) => false,
                    () = &mut work => false,
                };
                if failed {
                    timer = None;
                }
            }
            None => {
                tokio::select! {
                    () = tokio::time::sleep_until(early.into()) => {}
                    () = &mut work => {}
                }
            }
        }
    }
    shared.stopped.store(true, Ordering::Release);
    shared.room.notify_waiters();
}

/// A connection through [`Sched`]: sends go through the scheduler, receives pass through.
pub struct SchedConnection<C: ChunnelConnection, F> {
    inner: Arc<C>,
    shared: Arc<Shared<C::Data>>,
    precise_timer: bool,
    classify: F,
    overflow: Overflow,
}

impl<C: ChunnelConnection, F> std::fmt::Debug for SchedConnection<C, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedConnection")
            .field("queued", &self.queued())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl<C: ChunnelConnection, F> SchedConnection<C, F> {
    /// The scheduler's counters.
    pub fn stats(&self) -> Stats {
        self.shared.lock().stats()
    }

    /// Messages queued now, over all classes.
    pub fn queued(&self) -> usize {
        self.shared.lock().len()
    }

    /// Where the time-aware policy's cycles start.
    pub fn schedule_base(&self) -> Instant {
        self.shared.lock().base()
    }

    /// Bursts the inner connection refused with [`chunnel::Error::MessageTooLarge`] (the
    /// rest of each such burst was not sent).
    pub fn failed_bursts(&self) -> u64 {
        self.shared.failed_bursts.load(Ordering::Relaxed)
    }

    /// Whether the driver has its precise timer (see [`Config::precise_timer`]).
    pub fn precise_timer(&self) -> bool {
        self.precise_timer
    }

    /// The connection below.
    pub fn get_ref(&self) -> &C {
        &self.inner
    }

    /// Waits until everything queued was handed to the inner connection (or the driver
    /// stopped).
    pub async fn flush(&self) {
        loop {
            let room = self.shared.room.notified();
            let mut room = pin!(room);
            room.as_mut().enable();
            if self.shared.stopped.load(Ordering::Acquire)
                || (self.shared.lock().is_empty() && !self.shared.sending.load(Ordering::Acquire))
            {
                return;
            }
            room.await;
        }
    }
}

impl<C: ChunnelConnection, F> Drop for SchedConnection<C, F> {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        self.shared.work.notify_one();
    }
}

impl<C, F> ChunnelConnection for SchedConnection<C, F>
where
    C: ChunnelConnection,
    F: Fn(&C::Data) -> u8 + Send + Sync,
{
    type Data = C::Data;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), chunnel::Error>> + Send
    where
        B: IntoIterator<Item = C::Data> + Send,
        B::IntoIter: Send,
    {
        let burst = burst.into_iter();
        async move {
            let shared = &*self.shared;
            for msg in burst {
                let class = (self.classify)(&msg);
                let mut msg = msg;
                loop {
                    if shared.stopped.load(Ordering::Acquire) {
                        return Err(shared.stopped_error());
                    }
                    match shared.lock().enqueue(class, msg) {
                        Ok(()) => break,
                        Err(m) => msg = m,
                    }
                    if self.overflow == Overflow::Drop {
                        shared.lock().count_drop(class);
                        break;
                    }
                    // Full: let the driver drain, and wait for room.
                    let room = shared.room.notified();
                    let mut room = pin!(room);
                    room.as_mut().enable();
                    if shared.lock().has_room(class) || shared.stopped.load(Ordering::Acquire) {
                        continue;
                    }
                    shared.work.notify_one();
                    room.await;
                }
            }
            shared.work.notify_one();
            Ok(())
        }
    }

    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<C::Data>],
    ) -> impl Future<Output = Result<usize, chunnel::Error>> + Send + 'a {
        self.inner.recv(slots)
    }
}
