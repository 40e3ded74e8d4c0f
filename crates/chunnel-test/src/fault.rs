//! A fault-injecting Chunnel for tests.
//!
//! [`FaultInjector`] sits between a datapath and the layers above it (it is a byte Chunnel:
//! `Chunnel<C>` for any [`SendHeader`] connection) and misbehaves like a bad network:
//!
//! * **Deterministic drops**: every n-th message sent and/or received
//!   ([`FaultInjector::drop_every_send`], [`FaultInjector::drop_every_recv`]). The counters are
//!   shared by every connection the injector makes.
//! * **Seeded random faults**, configured per direction by a [`Faults`]
//!   ([`FaultInjector::send`], [`FaultInjector::recv`]): drop with probability `drop`,
//!   duplicate with probability `duplicate`, reorder with probability `reorder` (the message
//!   is held back and released right after the next `reorder_after` messages of its direction
//!   have passed, or after `reorder_timeout` if fewer come), and delay with probability `delay`
//!   (held for a uniformly random time in `0..=max_delay`, measured with tokio time). Each
//!   connection and direction draws from its own splitmix64 stream seeded from
//!   [`FaultInjector::seed`], the connection's index (the order in which the injector built
//!   its connections) and the direction, so a given seed makes the same decisions for the same
//!   sequence of messages. (Timing on a real socket is not deterministic, so *which* message
//!   is the k-th may vary from run to run; the decisions per position do not.)
//! * **A log** of every message that crosses it (its bytes, direction and whether it was
//!   dropped), so tests can count datagrams on the wire. Turn it off with
//!   [`FaultInjector::no_log`] for long runs: it keeps every message.
//!
//! Held (reordered or delayed) messages are bounded: at most [`FaultInjector::max_held`] per
//! connection and direction; once that many are held, further messages pass through
//! unharmed by reordering and delay (drops and duplicates still apply).
//!
//! Who releases held messages: on the receiving direction, a pending `recv` wakes at the
//! earliest deadline. On the sending direction, held messages are sent by the next `send`
//! after they are due, or by a pending `recv` on the same connection (which also wakes for
//! them). A connection that only ever sends and then goes quiet keeps its last held messages
//! — on an unreliable network that is loss, which the layers under test must survive anyway.
//! A send-direction release that happens inside `recv` is lost if that `recv` is cancelled
//! mid-send (again: loss); received messages are never lost by cancellation.
//!
//! This kernel has no netem (see PLATFORM.md), so loss is injected in user space.
//!
//! ```
//! use chunnel_test::fault::{FaultInjector, Faults};
//! use std::time::Duration;
//!
//! // 10% loss and 10% reordering (by 3 messages) on what this end sends, 5% duplicates and
//! // 20% of messages delayed by up to 10 ms on what it receives; reproducible with seed 7.
//! let faults = FaultInjector::seeded(7)
//!     .with_send(Faults::none().with_drop(0.1).with_reorder(0.1, 3))
//!     .with_recv(Faults::none().with_duplicate(0.05).with_delay(0.2, Duration::from_millis(10)))
//!     .without_log();
//! # let _ = faults;
//! ```

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use chunnel::{Chunnel, ChunnelConnection, Error, Negotiate, SendHeader};
use tokio::time::Instant;

/// Counters and a log shared between a [`FaultInjector`] and the connections it made.
#[derive(Debug, Default)]
pub struct FaultStats {
    sent: AtomicU64,
    received: AtomicU64,
    dropped_sent: AtomicU64,
    dropped_received: AtomicU64,
    duplicated: AtomicU64,
    reordered: AtomicU64,
    delayed: AtomicU64,
    connections: AtomicU64,
    log: Mutex<Vec<Seen>>,
}

/// One message that crossed the injector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    /// `true` if sent by this end, `false` if received.
    pub outgoing: bool,
    /// Its first byte (header included), if any.
    pub first: Option<u8>,
    /// Its length in bytes (header included).
    pub len: usize,
    /// Whether the injector dropped it.
    pub dropped: bool,
    /// The whole message (header included).
    pub bytes: Bytes,
}

impl FaultStats {
    /// Messages offered for sending (dropped ones included, injected duplicates not).
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
    /// Messages received from below (dropped ones included, injected duplicates not).
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }
    /// Sent messages dropped.
    pub fn dropped_sent(&self) -> u64 {
        self.dropped_sent.load(Ordering::Relaxed)
    }
    /// Received messages dropped.
    pub fn dropped_received(&self) -> u64 {
        self.dropped_received.load(Ordering::Relaxed)
    }
    /// Extra copies injected (both directions).
    pub fn duplicated(&self) -> u64 {
        self.duplicated.load(Ordering::Relaxed)
    }
    /// Messages held back for reordering (both directions).
    pub fn reordered(&self) -> u64 {
        self.reordered.load(Ordering::Relaxed)
    }
    /// Messages delayed (both directions).
    pub fn delayed(&self) -> u64 {
        self.delayed.load(Ordering::Relaxed)
    }
    /// Every message seen, in order (empty if the injector was built without a log).
    pub fn log(&self) -> Vec<Seen> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    fn record(&self, outgoing: bool, bytes: Bytes, dropped: bool) {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Seen {
                outgoing,
                first: bytes.first().copied(),
                len: bytes.len(),
                dropped,
                bytes,
            });
    }
}

/// Random faults for one direction. Probabilities are in `0.0..=1.0` (values outside are
/// clamped by the comparison: `<= 0` never, `>= 1` always).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Faults {
    /// Probability that a message is dropped.
    pub drop: f64,
    /// Probability that a (not dropped) message is sent/delivered twice.
    pub duplicate: f64,
    /// Probability that a message is held back until `reorder_after` later messages passed.
    pub reorder: f64,
    /// How many later messages overtake a reordered one (at least 1).
    pub reorder_after: usize,
    /// A reordered message is released after this long even if fewer messages came.
    pub reorder_timeout: Duration,
    /// Probability that a message is delayed.
    pub delay: f64,
    /// The longest delay (each delay is uniform in `0..=max_delay`).
    pub max_delay: Duration,
}

impl Default for Faults {
    fn default() -> Self {
        Faults::none()
    }
}

impl Faults {
    /// No random faults.
    pub const fn none() -> Self {
        Faults {
            drop: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            reorder_after: 1,
            reorder_timeout: Duration::from_millis(5),
            delay: 0.0,
            max_delay: Duration::ZERO,
        }
    }
    /// Sets [`Faults::drop`].
    pub fn with_drop(mut self, p: f64) -> Self {
        self.drop = p;
        self
    }
    /// Sets [`Faults::duplicate`].
    pub fn with_duplicate(mut self, p: f64) -> Self {
        self.duplicate = p;
        self
    }
    /// Sets [`Faults::reorder`] and [`Faults::reorder_after`].
    pub fn with_reorder(mut self, p: f64, after: usize) -> Self {
        self.reorder = p;
        self.reorder_after = after.max(1);
        self
    }
    /// Sets [`Faults::reorder_timeout`].
    pub fn with_reorder_timeout(mut self, t: Duration) -> Self {
        self.reorder_timeout = t;
        self
    }
    /// Sets [`Faults::delay`] and [`Faults::max_delay`].
    pub fn with_delay(mut self, p: f64, max: Duration) -> Self {
        self.delay = p;
        self.max_delay = max;
        self
    }
    fn is_none(&self) -> bool {
        self.drop <= 0.0 && self.duplicate <= 0.0 && self.reorder <= 0.0 && self.delay <= 0.0
    }
}

/// Drops every `drop_every_send`-th message sent and every `drop_every_recv`-th received
/// (0 = never), applies seeded random [`Faults`] per direction, and logs. See the
/// [module docs](self).
#[derive(Clone, Debug)]
pub struct FaultInjector {
    /// Drop every n-th sent message (0: none).
    pub drop_every_send: u64,
    /// Drop every n-th received message (0: none).
    pub drop_every_recv: u64,
    /// Random faults on what this end sends.
    pub send: Faults,
    /// Random faults on what this end receives.
    pub recv: Faults,
    /// Seed of the random faults.
    pub seed: u64,
    /// Most messages held back (reordered or delayed) per connection and direction.
    pub max_held: usize,
    /// Do not keep the log of messages (counters still count).
    pub no_log: bool,
    /// Shared counters and log.
    pub stats: Arc<FaultStats>,
}

impl Default for FaultInjector {
    fn default() -> Self {
        FaultInjector {
            drop_every_send: 0,
            drop_every_recv: 0,
            send: Faults::none(),
            recv: Faults::none(),
            seed: 0,
            max_held: 1024,
            no_log: false,
            stats: Arc::default(),
        }
    }
}

impl FaultInjector {
    /// An injector dropping every `n`-th message in both directions.
    pub fn drop_every(n: u64) -> Self {
        FaultInjector {
            drop_every_send: n,
            drop_every_recv: n,
            ..FaultInjector::default()
        }
    }

    /// An injector that only counts and logs.
    pub fn counting() -> Self {
        FaultInjector::default()
    }

    /// An injector with no faults yet whose random faults use `seed`.
    pub fn seeded(seed: u64) -> Self {
        FaultInjector {
            seed,
            ..FaultInjector::default()
        }
    }

    /// Sets the random faults on sent messages.
    pub fn with_send(mut self, f: Faults) -> Self {
        self.send = f;
        self
    }

    /// Sets the random faults on received messages.
    pub fn with_recv(mut self, f: Faults) -> Self {
        self.recv = f;
        self
    }

    /// Sets [`FaultInjector::max_held`].
    pub fn with_max_held(mut self, n: usize) -> Self {
        self.max_held = n;
        self
    }

    /// Keeps no log (for long runs).
    pub fn without_log(mut self) -> Self {
        self.no_log = true;
        self
    }
}

impl Negotiate for FaultInjector {
    fn id(&self) -> &'static str {
        "chunnel-test/fault/1"
    }
}

impl<C: SendHeader> Chunnel<C> for FaultInjector {
    type Connection = Faulty<C>;

    async fn connect_wrap(&mut self, inner: C) -> Result<Faulty<C>, Error> {
        let k = self.stats.connections.fetch_add(1, Ordering::Relaxed);
        let base = self.seed ^ k.wrapping_mul(0xA076_1D64_78BD_642F);
        Ok(Faulty {
            inner,
            tx: Mutex::new(Direction::new(base ^ 0x5EED_0000_0000_0001)),
            rx: Mutex::new(Direction::new(base ^ 0x5EED_0000_0000_0002)),
            cfg: self.clone(),
        })
    }
}

/// A connection through a [`FaultInjector`].
#[derive(Debug)]
pub struct Faulty<C> {
    inner: C,
    cfg: FaultInjector,
    tx: Mutex<Direction>,
    rx: Mutex<Direction>,
}

fn hit(counter: &AtomicU64, every: u64) -> bool {
    let k = counter.fetch_add(1, Ordering::Relaxed) + 1;
    every != 0 && k.is_multiple_of(every)
}

/// A held message: released once `after` more messages passed (reordering) or at `due`.
#[derive(Debug)]
struct Held {
    msg: Bytes,
    /// Messages still to overtake it; `None` for a delayed message.
    after: Option<usize>,
    due: Instant,
}

/// One direction's random state: its PRNG and its held messages.
#[derive(Debug)]
struct Direction {
    rng: u64,
    held: VecDeque<Held>,
    /// Receive direction: messages ready to hand to the caller.
    ready: VecDeque<Bytes>,
}

impl Direction {
    fn new(seed: u64) -> Self {
        Direction {
            rng: seed,
            held: VecDeque::new(),
            ready: VecDeque::new(),
        }
    }

    /// splitmix64: a tiny, well-mixed generator; deterministic for a seed.
    fn next_u64(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform float in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn chance(&mut self, p: f64) -> bool {
        // Always draw, so the stream position does not depend on the probabilities.
        let u = self.unit();
        u < p
    }

    /// Applies the random faults to one message that was not dropped deterministically;
    /// what passes now is pushed to `out`. Returns whether it was dropped.
    fn apply(
        &mut self,
        f: &Faults,
        max_held: usize,
        stats: &FaultStats,
        now: Instant,
        msg: Bytes,
        out: &mut Vec<Bytes>,
    ) -> bool {
        if f.is_none() {
            self.pass(msg, out);
            return false;
        }
        if self.chance(f.drop) {
            return true;
        }
        let copies = if self.chance(f.duplicate) {
            stats.duplicated.fetch_add(1, Ordering::Relaxed);
            2
        } else {
            1
        };
        for _ in 0..copies {
            let reorder = self.chance(f.reorder);
            let delay = self.chance(f.delay);
            let span = f.max_delay.as_nanos().min(u64::MAX as u128) as u64;
            let wait = Duration::from_nanos(self.next_u64() % span.saturating_add(1));
            if self.held.len() < max_held && reorder {
                stats.reordered.fetch_add(1, Ordering::Relaxed);
                self.held.push_back(Held {
                    msg: msg.clone(),
                    after: Some(f.reorder_after.max(1)),
                    due: now + f.reorder_timeout,
                });
            } else if self.held.len() < max_held && delay {
                stats.delayed.fetch_add(1, Ordering::Relaxed);
                self.held.push_back(Held {
                    msg: msg.clone(),
                    after: None,
                    due: now + wait,
                });
            } else {
                self.pass(msg.clone(), out);
            }
        }
        false
    }

    /// `msg` passes: it goes out, then every reordered message it was the last to overtake.
    fn pass(&mut self, msg: Bytes, out: &mut Vec<Bytes>) {
        out.push(msg);
        if self.held.is_empty() {
            return;
        }
        let mut i = 0;
        while i < self.held.len() {
            let h = &mut self.held[i];
            if let Some(a) = h.after.as_mut() {
                *a -= 1;
                if *a == 0 {
                    let h = self.held.remove(i).expect("index in range");
                    out.push(h.msg);
                    continue;
                }
            }
            i += 1;
        }
    }

    /// Moves every held message due at `now` to `out`.
    fn release_due(&mut self, now: Instant, out: &mut Vec<Bytes>) {
        if self.held.iter().any(|h| h.due <= now) {
            let mut keep = VecDeque::with_capacity(self.held.len());
            for h in self.held.drain(..) {
                if h.due <= now {
                    out.push(h.msg);
                } else {
                    keep.push_back(h);
                }
            }
            self.held = keep;
        }
    }

    fn next_due(&self) -> Option<Instant> {
        self.held.iter().map(|h| h.due).min()
    }
}

fn lock(m: &Mutex<Direction>) -> MutexGuard<'_, Direction> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<C: SendHeader> Faulty<C> {
    /// Applies the send-direction faults to `burst` (each message behind `header`). Returns
    /// the messages to send now behind the header, and whole messages (header included)
    /// released now: held ones that fell due, and ones the random faults let through (those
    /// are built whole because they may be held).
    fn filter_out(
        &self,
        header: &[u8],
        burst: impl IntoIterator<Item = Bytes>,
    ) -> (Vec<Bytes>, Vec<Bytes>) {
        let st = &self.cfg.stats;
        let mut keep = Vec::new();
        let mut released = Vec::new();
        let now = Instant::now();
        let mut tx = lock(&self.tx);
        tx.release_due(now, &mut released);
        let random = !self.cfg.send.is_none() || !tx.held.is_empty();
        for m in burst {
            let whole = || {
                let mut w = BytesMut::with_capacity(header.len() + m.len());
                w.extend_from_slice(header);
                w.extend_from_slice(&m);
                w.freeze()
            };
            let mut drop = hit(&st.sent, self.cfg.drop_every_send);
            if !drop {
                if random {
                    drop = tx.apply(
                        &self.cfg.send,
                        self.cfg.max_held,
                        st,
                        now,
                        whole(),
                        &mut released,
                    );
                } else {
                    keep.push(m.clone());
                }
            }
            if !self.cfg.no_log {
                st.record(true, whole(), drop);
            }
            if drop {
                st.dropped_sent.fetch_add(1, Ordering::Relaxed);
            }
        }
        (keep, released)
    }

    async fn send_parts(
        &self,
        header: &[u8],
        keep: Vec<Bytes>,
        released: Vec<Bytes>,
    ) -> Result<(), Error> {
        if !keep.is_empty() || released.is_empty() {
            self.inner.send_with_header(header, keep).await?;
        }
        if !released.is_empty() {
            self.inner.send(released).await?;
        }
        Ok(())
    }
}

fn fill(ready: &mut VecDeque<Bytes>, slots: &mut [Option<Bytes>]) -> usize {
    let n = ready.len().min(slots.len());
    for (s, m) in slots.iter_mut().zip(ready.drain(..n)) {
        *s = Some(m);
    }
    n
}

impl<C: SendHeader> ChunnelConnection for Faulty<C> {
    type Data = Bytes;

    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        let (keep, released) = self.filter_out(&[], burst);
        self.send_parts(&[], keep, released).await
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let st = &self.cfg.stats;
        loop {
            // Send-direction messages that fell due while nobody sent.
            let mut due_out = Vec::new();
            let tx_due = {
                let mut tx = lock(&self.tx);
                tx.release_due(Instant::now(), &mut due_out);
                tx.next_due()
            };
            if !due_out.is_empty() {
                self.inner.send(due_out).await?;
            }
            // From here on nothing awaits once messages were taken (cancel safety).
            let rx_due = {
                let mut rx = lock(&self.rx);
                let mut out = Vec::new();
                rx.release_due(Instant::now(), &mut out);
                rx.ready.extend(out);
                if !rx.ready.is_empty() {
                    return Ok(fill(&mut rx.ready, slots));
                }
                rx.next_due()
            };
            let deadline = match (tx_due, rx_due) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let n = match deadline {
                Some(d) => tokio::select! {
                    r = self.inner.recv(slots) => r?,
                    () = tokio::time::sleep_until(d) => continue,
                },
                None => self.inner.recv(slots).await?,
            };
            let now = Instant::now();
            let mut rx = lock(&self.rx);
            let random = !self.cfg.recv.is_none() || !rx.held.is_empty();
            let mut out = Vec::new();
            for s in slots[..n].iter_mut() {
                let Some(m) = s.take() else { continue };
                let mut drop = hit(&st.received, self.cfg.drop_every_recv);
                if !drop {
                    if random {
                        drop = rx.apply(
                            &self.cfg.recv,
                            self.cfg.max_held,
                            st,
                            now,
                            m.clone(),
                            &mut out,
                        );
                    } else {
                        out.push(m.clone());
                    }
                }
                if !self.cfg.no_log {
                    st.record(false, m, drop);
                }
                if drop {
                    st.dropped_received.fetch_add(1, Ordering::Relaxed);
                }
            }
            rx.ready.extend(out);
            if !rx.ready.is_empty() {
                return Ok(fill(&mut rx.ready, slots));
            }
            if n == 0 {
                return Ok(0);
            }
        }
    }
}

impl<C: chunnel::PeerHandoff> chunnel::PeerHandoff for Faulty<C> {
    fn hand_off(&self, first: Bytes) -> bool {
        self.inner.hand_off(first)
    }

    fn release(&self) {
        self.inner.release()
    }

    fn take_oversized(&self) -> Option<chunnel::Oversized> {
        self.inner.take_oversized()
    }

    fn mark_silent(&self, silent: bool) {
        self.inner.mark_silent(silent)
    }

    fn crowded(&self) -> bool {
        self.inner.crowded()
    }
}

impl<C: SendHeader> SendHeader for Faulty<C> {
    fn send_with_header<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        let (keep, released) = self.filter_out(header, burst);
        self.send_parts(header, keep, released)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(seed: u64, f: &Faults, n: usize) -> (Vec<Bytes>, usize) {
        let mut d = Direction::new(seed);
        let stats = FaultStats::default();
        let now = Instant::now();
        let mut out = Vec::new();
        let mut dropped = 0;
        for i in 0..n {
            let m = Bytes::from((i as u32).to_be_bytes().to_vec());
            dropped += usize::from(d.apply(f, 16, &stats, now, m, &mut out));
        }
        d.release_due(now + Duration::from_secs(3600), &mut out);
        (out, dropped)
    }

    #[test]
    fn seeded_faults_are_deterministic_and_bounded() {
        let f = Faults::none()
            .with_drop(0.1)
            .with_duplicate(0.1)
            .with_reorder(0.1, 3)
            .with_delay(0.1, Duration::from_millis(10));
        let a = run(42, &f, 10_000);
        assert_eq!(a, run(42, &f, 10_000), "same seed, same decisions");
        assert_ne!(a.0, run(43, &f, 10_000).0, "another seed, other decisions");
        let (out, dropped) = a;
        // About 10% dropped, about 10% of the rest duplicated.
        assert!((800..1200).contains(&dropped), "dropped {dropped}");
        assert_eq!(out.len() - (10_000 - dropped), {
            let mut seen = std::collections::HashMap::new();
            for m in &out {
                *seen.entry(m.clone()).or_insert(0usize) += 1;
            }
            seen.values().map(|c| c - 1).sum::<usize>()
        });
        assert!(out.windows(2).any(|w| w[0] > w[1]), "nothing reordered");
    }

    #[test]
    fn held_messages_are_capped() {
        let f = Faults::none().with_delay(1.0, Duration::from_secs(10));
        let mut d = Direction::new(1);
        let stats = FaultStats::default();
        let mut out = Vec::new();
        for _ in 0..100 {
            d.apply(&f, 8, &stats, Instant::now(), Bytes::new(), &mut out);
        }
        assert_eq!(d.held.len(), 8);
        assert_eq!(out.len(), 92);
    }

    #[test]
    fn reordered_message_overtaken_by_k() {
        let f = Faults::none().with_reorder(1.0, 2);
        let mut d = Direction::new(1);
        let stats = FaultStats::default();
        let mut out = Vec::new();
        let now = Instant::now();
        d.apply(&f, 8, &stats, now, Bytes::from_static(b"a"), &mut out);
        d.pass(Bytes::from_static(b"b"), &mut out);
        d.pass(Bytes::from_static(b"c"), &mut out);
        assert_eq!(out, [&b"b"[..], b"c", b"a"]);
    }
}
