//! One coarse timer for all of a client's handshakes.
//!
//! A handshake waits for an answer with a retransmission deadline (100 ms by default). With a
//! tokio timer per handshake, each registration earlier than every timer the runtime already
//! has wakes the runtime's driver (a system call) and costs a few thousand instructions to arm
//! and cancel, on every connection set-up, although the deadline almost never passes. Instead,
//! handshakes register their deadline here (a slot in a list, freed when the wait ends) and one
//! task per [`Ticker`], running only while some deadline is registered, wakes every [`GRAIN`]
//! and wakes the handshakes whose deadline has passed. Retransmissions therefore go out up to
//! one grain late, which the protocol allows (docs/wire.md §8.4: the wait is a minimum).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// Now on tokio's clock (the wall clock unless a test paused it), the clock the handshake's
/// deadlines are computed on: a paused runtime then drives the retransmissions too.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// How often the ticker wakes while deadlines are registered.
pub(crate) const GRAIN: Duration = Duration::from_millis(10);

/// Deadlines of a client's handshakes and the task that serves them.
#[derive(Debug, Default)]
pub(crate) struct Ticker {
    st: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Slots of waiting handshakes (`None`: free). Unordered: the ticker looks at every
    /// registered deadline once per grain, and registering or leaving is a slot write.
    slots: Vec<Option<(Instant, Waker, u64)>>,
    /// Stamps registrations (never reset, also when the slots are): a handle names (slot,
    /// stamp), so a deadline whose slot was freed and given to another finds it is not its
    /// own.
    next_stamp: u64,
    /// Free slots.
    free: Vec<usize>,
    /// Registered deadlines.
    waiting: usize,
    running: bool,
}

impl State {
    fn register(&mut self, deadline: Instant, waker: &Waker) -> (usize, u64) {
        self.waiting += 1;
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        self.slots[i] = Some((deadline, waker.clone(), stamp));
        (i, stamp)
    }

    /// The waker of handle `(i, stamp)`'s slot, if the slot is still its own.
    fn own(&mut self, (i, stamp): (usize, u64)) -> Option<&mut Waker> {
        match self.slots.get_mut(i)? {
            Some((_, w, s)) if *s == stamp => Some(w),
            _ => None,
        }
    }

    fn free_slot(&mut self, i: usize) {
        self.waiting -= 1;
        self.free.push(i);
    }

    fn leave(&mut self, h: (usize, u64)) {
        if self.own(h).is_some() {
            self.slots[h.0] = None;
            self.free_slot(h.0);
        }
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Ticker {
    /// Completes at `deadline` (or up to one grain later). Must be polled within a tokio
    /// runtime.
    pub(crate) fn wait(self: &Arc<Self>, deadline: Instant) -> Deadline {
        Deadline {
            ticker: Arc::clone(self),
            deadline,
            id: None,
        }
    }

    async fn run(self: Arc<Self>) {
        let mut tick = tokio::time::interval(GRAIN);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = now();
            let mut st = lock(&self.st);
            for i in 0..st.slots.len() {
                if st.slots[i].as_ref().is_some_and(|(d, _, _)| *d <= now)
                    && let Some((_, waker, _)) = st.slots[i].take()
                {
                    st.free_slot(i);
                    waker.wake();
                }
            }
            if st.waiting == 0 {
                st.running = false;
                // Nothing registered: the slots go too (a burst of handshakes leaves no
                // memory behind). Stamps go on: a handle still held never names a later
                // registration.
                st.slots = Vec::new();
                st.free = Vec::new();
                return;
            }
        }
    }
}

/// See [`Ticker::wait`].
#[derive(Debug)]
pub(crate) struct Deadline {
    ticker: Arc<Ticker>,
    deadline: Instant,
    /// The registered slot and its generation.
    id: Option<(usize, u64)>,
}

impl Future for Deadline {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        if now() >= this.deadline {
            if let Some(id) = this.id.take() {
                lock(&this.ticker.st).leave(id);
            }
            return Poll::Ready(());
        }
        let mut st = lock(&this.ticker.st);
        let id = match this.id.take() {
            // Still registered: the waker is refreshed in place.
            Some(h) if st.own(h).is_some() => {
                if let Some(w) = st.own(h)
                    && !w.will_wake(cx.waker())
                {
                    w.clone_from(cx.waker());
                }
                h
            }
            // New, or a slot the ticker freed when it woke this deadline (its clock ran a
            // little ahead of ours): registered again.
            _ => st.register(this.deadline, cx.waker()),
        };
        let start = !st.running;
        st.running = true;
        drop(st);
        self.id = Some(id);
        if start {
            tokio::spawn(Arc::clone(&self.ticker).run());
        }
        Poll::Pending
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            lock(&self.ticker.st).leave(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn wakes_after_the_deadline_and_forgets_dropped_waits() {
        let t = Arc::new(Ticker::default());
        let start = Instant::now();
        // A dropped wait leaves nothing behind.
        {
            let w = t.wait(start + Duration::from_secs(5));
            let mut w = Box::pin(w);
            assert!(futures_poll(&mut w).is_pending());
        }
        assert_eq!(lock(&t.st).waiting, 0);
        // A deadline already passed completes at once.
        let d = Instant::now() + Duration::from_millis(1);
        std::thread::sleep(Duration::from_millis(2));
        t.wait(d).await;
        assert!(Instant::now() >= d);
    }

    /// A handle whose slot was freed (its deadline woken) and given to another deadline no
    /// longer reaches it: the other deadline's waker stays.
    #[test]
    fn a_freed_slot_given_to_another_is_not_the_old_handles() {
        let mut st = State::default();
        let now = Instant::now();
        let h1 = st.register(now, Waker::noop());
        // The ticker wakes and frees it.
        st.slots[h1.0] = None;
        st.free_slot(h1.0);
        let h2 = st.register(now + Duration::from_secs(1), Waker::noop());
        assert_eq!(h1.0, h2.0, "the slot is reused");
        assert!(st.own(h1).is_none());
        assert!(st.own(h2).is_some());
        st.leave(h1);
        assert_eq!(
            st.waiting, 1,
            "leaving with a stale handle freed another's slot"
        );
        st.leave(h2);
        assert_eq!(st.waiting, 0);
        // The ticker drops its slots when nothing waits; a later registration in slot 0 is
        // still not the old handles'.
        st.slots = Vec::new();
        st.free = Vec::new();
        let h3 = st.register(now, Waker::noop());
        assert_eq!(h3.0, h1.0);
        assert!(st.own(h1).is_none() && st.own(h2).is_none());
        st.leave(h1);
        assert_eq!(
            st.waiting, 1,
            "a handle from before the reset freed a new slot"
        );
    }

    fn futures_poll<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
        let waker = Waker::noop();
        let mut cx = Context::from_waker(waker);
        Pin::new(f).poll(&mut cx)
    }

    #[tokio::test]
    async fn a_future_deadline_is_reached_through_the_ticker() {
        let t = Arc::new(Ticker::default());
        let d = Instant::now() + Duration::from_millis(25);
        t.wait(d).await;
        assert!(Instant::now() >= d);
        // The task stops once nothing waits.
        tokio::time::sleep(GRAIN * 3).await;
        assert!(!lock(&t.st).running);
    }
}
