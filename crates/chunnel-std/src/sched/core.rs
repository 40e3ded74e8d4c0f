//! The scheduling core: per-class bounded queues and the policy that picks what to send next,
//! as a sans-IO state machine. Time is passed in (`now`); nothing here blocks, spawns or reads
//! a clock.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::Error;

/// Most traffic classes a scheduler has (as IEEE 802.1Q's eight traffic classes). Class 0 is
/// the most urgent.
pub const MAX_CLASSES: usize = 8;

/// A set of classes as a bit mask: bit `c` stands for class `c`.
pub type ClassMask = u8;

/// One entry of a gate control list: for `duration`, the gates of the classes in `open` are
/// open and every other gate is closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GateEntry {
    /// How long this entry lasts.
    pub duration: Duration,
    /// The classes allowed to start a transmission during this entry.
    pub open: ClassMask,
}

impl GateEntry {
    /// An entry of `duration` during which the classes listed in `open` may transmit
    /// (classes of 8 and above are ignored).
    pub fn new(duration: Duration, open: impl IntoIterator<Item = u8>) -> Self {
        let open = open
            .into_iter()
            .filter(|&c| usize::from(c) < MAX_CLASSES)
            .fold(0, |m, c| m | (1 << c));
        GateEntry { duration, open }
    }
}

/// A cyclic gate schedule in the style of IEEE 802.1Qbv: the entries repeat, back to back,
/// from `base` on (and, backwards, before it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GateSchedule {
    entries: Vec<GateEntry>,
    cycle_ns: u64,
    /// A message is started only if at least this long remains before its class's gate
    /// closes (the guard band); for a burst, the k-th message needs `k + 1` times this.
    guard: Duration,
}

impl GateSchedule {
    /// A schedule of `entries` without a guard band. Fails if the cycle (the sum of the
    /// durations) is zero or longer than 2^64 ns.
    pub fn new(entries: Vec<GateEntry>) -> Result<Self, Error> {
        let cycle: u128 = entries.iter().map(|e| e.duration.as_nanos()).sum();
        if cycle == 0 {
            return Err(Error::BadSchedule {
                what: "the gate schedule's cycle is empty (no entry has a duration)",
            });
        }
        let cycle_ns = u64::try_from(cycle).map_err(|_| Error::BadSchedule {
            what: "the gate schedule's cycle is longer than 2^64 ns",
        })?;
        Ok(GateSchedule {
            entries,
            cycle_ns,
            guard: Duration::ZERO,
        })
    }

    /// Sets the guard band: the time one message takes to send. A message is not started
    /// unless it can finish (by this estimate) before its class's gate closes.
    pub fn with_guard_band(mut self, guard: Duration) -> Self {
        self.guard = guard;
        self
    }

    /// The guard band.
    pub fn guard_band(&self) -> Duration {
        self.guard
    }

    /// The cycle's length.
    pub fn cycle(&self) -> Duration {
        Duration::from_nanos(self.cycle_ns)
    }

    /// The entries.
    pub fn entries(&self) -> &[GateEntry] {
        &self.entries
    }

    /// Offset of `t` in the cycle (ns since the start of the cycle `t` falls in).
    fn offset(&self, base: Instant, t: Instant) -> u64 {
        if t >= base {
            ((t - base).as_nanos() % u128::from(self.cycle_ns)) as u64
        } else {
            let back = ((base - t).as_nanos() % u128::from(self.cycle_ns)) as u64;
            (self.cycle_ns - back) % self.cycle_ns
        }
    }

    /// The entry holding cycle offset `off` and the offset at which that entry ends.
    fn entry_at(&self, off: u64) -> (usize, u64) {
        let mut end = 0u64;
        for (i, e) in self.entries.iter().enumerate() {
            end += e.duration.as_nanos() as u64;
            if off < end {
                return (i, end);
            }
        }
        // Unreachable for off < cycle; the last entry is a safe answer.
        (self.entries.len() - 1, self.cycle_ns)
    }

    /// Whether `class`'s gate is open at `t`, and if so for how long from `t` on (`None`:
    /// open for ever, every entry opens it).
    pub fn open_for(&self, base: Instant, t: Instant, class: u8) -> Option<Option<Duration>> {
        let bit = 1u8.checked_shl(u32::from(class)).unwrap_or(0);
        let off = self.offset(base, t);
        let (mut i, end) = self.entry_at(off);
        if self.entries[i].open & bit == 0 {
            return None;
        }
        let mut left = end - off;
        // Walk the entries that follow while they keep the gate open, at most one cycle.
        let mut walked = self.entries[i].duration.as_nanos() as u64;
        loop {
            i = (i + 1) % self.entries.len();
            if self.entries[i].open & bit == 0 {
                return Some(Some(Duration::from_nanos(left)));
            }
            let d = self.entries[i].duration.as_nanos() as u64;
            left += d;
            walked += d;
            if walked > self.cycle_ns {
                return Some(None);
            }
        }
    }

    /// Whether `n` messages of `class`, started back to back at `t`, all finish before the
    /// gate closes (by the guard band); with no guard band, whether the gate is open at `t`.
    fn fits(&self, base: Instant, t: Instant, class: u8, n: u32) -> bool {
        match self.open_for(base, t, class) {
            None => false,
            Some(None) => true,
            Some(Some(left)) => {
                self.guard.is_zero() || self.guard.checked_mul(n).is_some_and(|need| need <= left)
            }
        }
    }

    /// The earliest instant at or after `t` at which one message of `class` may start;
    /// `None` if its gate never opens long enough.
    pub fn next_start(&self, base: Instant, t: Instant, class: u8) -> Option<Instant> {
        if self.fits(base, t, class, 1) {
            return Some(t);
        }
        // Candidate starts are entry boundaries, over (a bit more than) one cycle.
        let off = self.offset(base, t);
        let (mut i, end) = self.entry_at(off);
        let mut at = t + Duration::from_nanos(end - off);
        for _ in 0..=self.entries.len() {
            i = (i + 1) % self.entries.len();
            if self.fits(base, at, class, 1) {
                return Some(at);
            }
            at += self.entries[i].duration;
        }
        None
    }
}

/// How the scheduler orders the queued messages.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Policy {
    /// One order for every class: the order of `enqueue` calls.
    Fifo,
    /// The lowest-numbered class with a queued message goes first; FIFO within a class.
    StrictPriority,
    /// A time-aware shaper: a class sends only while its gate is open; among the classes
    /// whose gates are open, strict priority.
    TimeAware(GateSchedule),
}

impl Policy {
    /// The policy's name, as reported in statistics and benchmark output.
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Fifo => "fifo",
            Policy::StrictPriority => "priority",
            Policy::TimeAware(_) => "time-aware",
        }
    }
}

/// What to do when a class's queue is full.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overflow {
    /// The sender waits for room (backpressure).
    #[default]
    Wait,
    /// The message is dropped and counted ([`Stats::dropped`]).
    Drop,
}

/// Counters of a [`Scheduler`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Messages accepted into a queue, per class.
    pub enqueued: [u64; MAX_CLASSES],
    /// Messages handed out to be sent, per class.
    pub sent: [u64; MAX_CLASSES],
    /// Messages dropped because their class's queue was full (with [`Overflow::Drop`]).
    pub dropped: [u64; MAX_CLASSES],
    /// Bursts handed out ([`Decision::send`] > 0).
    pub bursts: u64,
    /// Bursts of more than one message.
    pub batched_bursts: u64,
    /// The most messages ever queued at once, over all classes.
    pub max_queued: usize,
}

/// What [`Scheduler::next`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// How many messages were appended to the burst (send them now, in that order).
    pub send: usize,
    /// When to call `next` again if nothing is enqueued in between: `Some(now)` if more
    /// messages may go at once, a later instant if the queued messages wait for a gate,
    /// `None` if nothing is queued (or no gate will ever let the queued messages go).
    pub wake_at: Option<Instant>,
}

/// The packet scheduler's state: one bounded FIFO queue per class and a [`Policy`].
///
/// The driver calls [`Scheduler::enqueue`] for each message sent, and [`Scheduler::next`]
/// to learn what to send and when to ask again.
#[derive(Debug)]
pub struct Scheduler<T> {
    policy: Policy,
    base: Instant,
    capacity: usize,
    max_burst: usize,
    queues: Vec<VecDeque<(u64, T)>>,
    queued: usize,
    seq: u64,
    stats: Stats,
}

impl<T> Scheduler<T> {
    /// A scheduler with `classes` classes (1..=8, clamped), each queue holding at most
    /// `capacity` messages (at least 1), handing out bursts of at most `max_burst` messages
    /// (at least 1). A time-aware policy's cycles start at `base`.
    pub fn new(
        policy: Policy,
        classes: usize,
        capacity: usize,
        max_burst: usize,
        base: Instant,
    ) -> Self {
        let classes = classes.clamp(1, MAX_CLASSES);
        let capacity = capacity.max(1);
        Scheduler {
            policy,
            base,
            capacity,
            max_burst: max_burst.max(1),
            queues: (0..classes)
                .map(|_| VecDeque::with_capacity(capacity))
                .collect(),
            queued: 0,
            seq: 0,
            stats: Stats::default(),
        }
    }

    /// The class a message classified as `class` goes to: classes past the last one are the
    /// last (least urgent) one.
    pub fn clamp_class(&self, class: u8) -> usize {
        usize::from(class).min(self.queues.len() - 1)
    }

    /// Queues `msg` in `class` (see [`Scheduler::clamp_class`]); gives it back if that
    /// class's queue is full.
    pub fn enqueue(&mut self, class: u8, msg: T) -> Result<(), T> {
        let c = self.clamp_class(class);
        if self.queues[c].len() >= self.capacity {
            return Err(msg);
        }
        self.queues[c].push_back((self.seq, msg));
        self.seq += 1;
        self.queued += 1;
        self.stats.enqueued[c] += 1;
        self.stats.max_queued = self.stats.max_queued.max(self.queued);
        Ok(())
    }

    /// Counts a message of `class` dropped by the driver because its queue was full.
    pub fn count_drop(&mut self, class: u8) {
        let c = self.clamp_class(class);
        self.stats.dropped[c] += 1;
    }

    /// Whether `class`'s queue has room for one more message.
    pub fn has_room(&self, class: u8) -> bool {
        self.queues[self.clamp_class(class)].len() < self.capacity
    }

    /// Messages queued, over all classes.
    pub fn len(&self) -> usize {
        self.queued
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.queued == 0
    }

    /// Messages queued in `class`.
    pub fn queued(&self, class: u8) -> usize {
        self.queues[self.clamp_class(class)].len()
    }

    /// The instant the time-aware policy's cycles start from.
    pub fn base(&self) -> Instant {
        self.base
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The counters.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// The class whose head goes next at `now`, as the `k`-th message of the burst being
    /// built (the guard band counts the messages before it).
    fn pick(&self, now: Instant, k: u32) -> Option<usize> {
        match &self.policy {
            Policy::Fifo => self
                .queues
                .iter()
                .enumerate()
                .filter_map(|(c, q)| q.front().map(|(s, _)| (*s, c)))
                .min()
                .map(|(_, c)| c),
            Policy::StrictPriority => self.queues.iter().position(|q| !q.is_empty()),
            Policy::TimeAware(g) => self.queues.iter().enumerate().find_map(|(c, q)| {
                (!q.is_empty() && g.fits(self.base, now, c as u8, k + 1)).then_some(c)
            }),
        }
    }

    /// Appends to `burst` the messages to send now (at most the burst limit), in order, and
    /// says when to ask again. See [`Decision`].
    pub fn next(&mut self, now: Instant, burst: &mut impl Extend<T>) -> Decision {
        let mut n = 0;
        while n < self.max_burst {
            let Some(c) = self.pick(now, n as u32) else {
                break;
            };
            let Some((_, m)) = self.queues[c].pop_front() else {
                break;
            };
            self.queued -= 1;
            self.stats.sent[c] += 1;
            burst.extend(std::iter::once(m));
            n += 1;
        }
        if n > 0 {
            self.stats.bursts += 1;
            if n > 1 {
                self.stats.batched_bursts += 1;
            }
        }
        Decision {
            send: n,
            wake_at: self.wake_at(now),
        }
    }

    fn wake_at(&self, now: Instant) -> Option<Instant> {
        if self.queued == 0 {
            return None;
        }
        match &self.policy {
            Policy::Fifo | Policy::StrictPriority => Some(now),
            Policy::TimeAware(g) => self
                .queues
                .iter()
                .enumerate()
                .filter(|(_, q)| !q.is_empty())
                .filter_map(|(c, _)| g.next_start(self.base, now, c as u8))
                .min(),
        }
    }

    /// Takes every queued message, in FIFO order per class, most urgent class first.
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.queued = 0;
        self.queues
            .iter_mut()
            .flat_map(|q| q.drain(..).map(|(_, m)| m))
    }
}

#[cfg(test)]
mod tests;
