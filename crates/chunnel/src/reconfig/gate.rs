//! The two unilateral mechanisms ([`Lock`], [`LockFree`]) and the waker list both use.
//!
//! A *gate* admits data-path calls (`enter` → ticket, `exit`) and lets a switcher `close` it,
//! wait until it is `drained` (no ticket outstanding) and `open` it again. While a ticket is
//! held the current implementation is not replaced; while the gate is closed and drained no
//! task touches it. The gate also carries the "carry-over queue is not empty" bit, so `recv`
//! learns it from the same access that admits it.

use std::fmt;
use std::task::Waker;

use super::sync::{AtomicBool, AtomicU64, Mutex, MutexGuard, Ordering};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A unilateral reconfiguration mechanism: how data-path calls are kept off an implementation
/// while it is replaced. Implemented by [`Lock`] and [`LockFree`]; chosen by the type
/// parameter of [`crate::Reconfigurable`] and [`crate::ReconfigConnection`].
///
/// The associated items are the mechanism's internals (hidden, not a stable API).
pub trait Mechanism: Send + Sync + 'static {
    /// A short name (`"lock"`, `"lock-free"`), for reports and benchmarks.
    const NAME: &'static str;

    #[doc(hidden)]
    type Gate: Send + Sync + Default + fmt::Debug;

    /// Admits a call: `Ok((ticket, carry))`, or `Err(wake_switcher)` while a switch is under
    /// way.
    #[doc(hidden)]
    fn enter(g: &Self::Gate) -> Result<(usize, bool), bool>;

    /// Ends a call; true if a switcher waits for the gate to drain.
    #[doc(hidden)]
    fn exit(g: &Self::Gate, ticket: usize) -> bool;

    /// Whether a switch is under way: true from the moment `close` made any call wait until
    /// `open` admits calls again everywhere (so a call refused by `enter` that waits for this to
    /// turn false never spins).
    #[doc(hidden)]
    fn is_switching(g: &Self::Gate) -> bool;

    /// Whether `close` has reached the holder of `ticket` (a call inside the implementation
    /// leaves it when this turns true; checked per ticket so that a call admitted just before
    /// `close` reached it does not spin between leaving and being admitted again).
    #[doc(hidden)]
    fn is_closed(g: &Self::Gate, ticket: usize) -> bool;

    #[doc(hidden)]
    fn close(g: &Self::Gate);

    #[doc(hidden)]
    fn drained(g: &Self::Gate) -> bool;

    #[doc(hidden)]
    fn open(g: &Self::Gate, carry: bool);

    #[doc(hidden)]
    fn clear_carry(g: &Self::Gate);

    #[doc(hidden)]
    fn set_carry(g: &Self::Gate);
}

/// The lock mechanism (paper §4.2): every `send`/`recv` holds a shared lock on the inner
/// connection for its whole duration; a switch takes it exclusively.
///
/// Cost per call: a mutex acquisition on entry and one on exit (a reader count under a
/// `std::sync::Mutex`; it is never held across an `.await`). Switch point: the moment the
/// switcher, holding the exclusive side, installs the new implementation and releases it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Lock;

#[doc(hidden)]
#[derive(Debug, Default)]
pub struct LockGate {
    st: Mutex<LockState>,
    switching: AtomicBool,
}

#[derive(Debug, Default)]
struct LockState {
    readers: usize,
    switching: bool,
    carry: bool,
}

impl Mechanism for Lock {
    const NAME: &'static str = "lock";
    type Gate = LockGate;

    fn enter(g: &LockGate) -> Result<(usize, bool), bool> {
        let mut st = lock(&g.st);
        if st.switching {
            return Err(false);
        }
        st.readers += 1;
        Ok((0, st.carry))
    }

    fn exit(g: &LockGate, _: usize) -> bool {
        let mut st = lock(&g.st);
        st.readers = st.readers.saturating_sub(1);
        st.switching && st.readers == 0
    }

    fn is_switching(g: &LockGate) -> bool {
        g.switching.load(Ordering::Acquire)
    }

    fn is_closed(g: &LockGate, _: usize) -> bool {
        Self::is_switching(g)
    }

    // `close` and `open` change the flag in the mutex and its atomic copy in one critical
    // section: a call that `enter` refused always finds `is_switching` true until `open`, and
    // one it admitted finds it false until the next `close` (otherwise a call could spin
    // between `enter` and `is_switching`; loom found the window).
    fn close(g: &LockGate) {
        let mut st = lock(&g.st);
        st.switching = true;
        g.switching.store(true, Ordering::Release);
    }

    fn drained(g: &LockGate) -> bool {
        lock(&g.st).readers == 0
    }

    fn open(g: &LockGate, carry: bool) {
        let mut st = lock(&g.st);
        st.switching = false;
        st.carry = carry;
        g.switching.store(false, Ordering::Release);
    }

    fn clear_carry(g: &LockGate) {
        lock(&g.st).carry = false;
    }

    fn set_carry(g: &LockGate) {
        lock(&g.st).carry = true;
    }
}

/// The lock-free mechanism: the paper's barrier (§6.2) as a striped epoch gate.
///
/// Each call makes one atomic read-modify-write when it starts and one when it ends, on a
/// counter that belongs to the calling thread's stripe (8 stripes, each on its own 128-byte
/// line): no lock, no store to a line that other threads write. The value read by the first
/// one carries the "switch under way" and "carry-over" flags, so admission costs nothing more.
///
/// A switch sets the flag on every stripe (after which every new call waits), wakes the calls
/// blocked in `recv` (they drop their pending receive, which is cancel safe, and wait), waits
/// until every stripe counts zero calls — the barrier resolves: this is the **switch point**,
/// after which no task touches the old implementation — then transfers state, installs the new
/// implementation and clears the flags, waking the waiting calls, which run on the new one.
///
/// Why not a bare atomic load per call: the switcher must know when calls that read "no
/// switch" have left the old implementation; without a write per call (or an operating-system
/// membarrier, which this dependency-free crate cannot issue) it cannot, and state transfer
/// would race with them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LockFree;

#[cfg(not(chunnel_loom))]
const STRIPES: usize = 8;
/// Two stripes under loom: threads 0 and 2 of a model share one, thread 1 has its own.
#[cfg(chunnel_loom)]
const STRIPES: usize = 2;
const SWITCH: u64 = 1 << 63;
const CARRY: u64 = 1 << 62;
const COUNT: u64 = CARRY - 1;

#[derive(Debug, Default)]
#[repr(align(128))]
struct Stripe(AtomicU64);

#[doc(hidden)]
#[derive(Debug, Default)]
pub struct StripedGate {
    stripes: [Stripe; STRIPES],
}

#[cfg(not(chunnel_loom))]
fn my_stripe() -> usize {
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    STRIPE.with(|s| *s)
}

/// Under loom the stripe follows the model's thread ids, so every execution is the same.
#[cfg(chunnel_loom)]
fn my_stripe() -> usize {
    super::sync::loom_thread_id() % STRIPES
}

impl Mechanism for LockFree {
    const NAME: &'static str = "lock-free";
    type Gate = StripedGate;

    #[inline]
    fn enter(g: &StripedGate) -> Result<(usize, bool), bool> {
        let i = my_stripe();
        // Acquire: pairs with the Release of `open`, so the installed implementation is seen.
        let prev = g.stripes[i].0.fetch_add(1, Ordering::Acquire);
        if prev & SWITCH != 0 {
            // Back out; the switcher may have counted us, so it must look again.
            g.stripes[i].0.fetch_sub(1, Ordering::Release);
            return Err(true);
        }
        Ok((i, prev & CARRY != 0))
    }

    #[inline]
    fn exit(g: &StripedGate, ticket: usize) -> bool {
        // Release: our use of the implementation happens before the switcher sees zero.
        #[cfg(chunnel_loom)]
        if super::sync::planted(super::sync::PlantedBug::RelaxedExit) {
            return g.stripes[ticket].0.fetch_sub(1, Ordering::Relaxed) & SWITCH != 0;
        }
        g.stripes[ticket].0.fetch_sub(1, Ordering::Release) & SWITCH != 0
    }

    /// Stripe 0 is flagged first by `close` and cleared last by `open`, so it shows the flag
    /// whenever any stripe does.
    fn is_switching(g: &StripedGate) -> bool {
        g.stripes[0].0.load(Ordering::Acquire) & SWITCH != 0
    }

    fn is_closed(g: &StripedGate, ticket: usize) -> bool {
        g.stripes[ticket].0.load(Ordering::Acquire) & SWITCH != 0
    }

    fn close(g: &StripedGate) {
        for s in &g.stripes {
            s.0.fetch_or(SWITCH, Ordering::AcqRel);
        }
    }

    fn drained(g: &StripedGate) -> bool {
        g.stripes
            .iter()
            .all(|s| s.0.load(Ordering::Acquire) & COUNT == 0)
    }

    fn open(g: &StripedGate, carry: bool) {
        let flag = if carry { CARRY } else { 0 };
        // Stripe 0 last: see `is_switching`.
        for s in g.stripes.iter().rev() {
            let _ = s.0.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some((v & COUNT) | flag)
            });
        }
    }

    fn clear_carry(g: &StripedGate) {
        for s in &g.stripes {
            s.0.fetch_and(!CARRY, Ordering::AcqRel);
        }
    }

    fn set_carry(g: &StripedGate) {
        for s in &g.stripes {
            s.0.fetch_or(CARRY, Ordering::AcqRel);
        }
    }
}

/// A list of wakers woken all at once (a switch starts or ends). Registration is per pending
/// poll of a blocked call, and skipped when the same waker is already registered.
#[derive(Debug, Default)]
pub(crate) struct Event {
    generation: AtomicU64,
    st: Mutex<EventState>,
}

#[derive(Debug, Default)]
struct EventState {
    generation: u64,
    next_id: u64,
    list: Vec<(u64, Waker)>,
}

/// One waiter's registration in an [`Event`]; deregisters on drop.
#[derive(Debug)]
pub(crate) struct Waiter<'a> {
    event: &'a Event,
    reg: Option<(u64, u64, Waker)>,
}

impl Event {
    pub(crate) fn waiter(&self) -> Waiter<'_> {
        Waiter {
            event: self,
            reg: None,
        }
    }

    pub(crate) fn notify_all(&self) {
        let list = {
            let mut st = lock(&self.st);
            st.generation += 1;
            self.generation.store(st.generation, Ordering::Release);
            std::mem::take(&mut st.list)
        };
        for (_, w) in list {
            w.wake();
        }
    }
}

impl Waiter<'_> {
    /// Makes sure `waker` is woken by the next `notify_all`.
    pub(crate) fn register(&mut self, waker: &Waker) {
        if let Some((_, generation, w)) = &self.reg
            && *generation == self.event.generation.load(Ordering::Acquire)
            && w.will_wake(waker)
        {
            return;
        }
        let mut st = lock(&self.event.st);
        let generation = st.generation;
        match &self.reg {
            Some((id, g, _)) if *g == generation => {
                let id = *id;
                if let Some(e) = st.list.iter_mut().find(|e| e.0 == id) {
                    e.1 = waker.clone();
                }
                self.reg = Some((id, generation, waker.clone()));
            }
            _ => {
                let id = st.next_id;
                st.next_id += 1;
                st.list.push((id, waker.clone()));
                self.reg = Some((id, generation, waker.clone()));
            }
        }
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if let Some((id, generation, _)) = self.reg.take()
            && generation == self.event.generation.load(Ordering::Acquire)
        {
            let mut st = lock(&self.event.st);
            if st.generation == generation
                && let Some(i) = st.list.iter().position(|e| e.0 == id)
            {
                st.list.swap_remove(i);
            }
        }
    }
}
