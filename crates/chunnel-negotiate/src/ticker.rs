//! One coarse timer for all of a client's handshakes.
//!
//! A handshake waits for an answer with a retransmission deadline (100 ms by default). With a
//! tokio timer per handshake, each registration earlier than every timer the runtime already
//! has wakes the runtime's driver (a system call) and costs a few thousand instructions to arm
//! and cancel, on every connection set-up, although the deadline almost never passes. Instead,
//! handshakes register their deadline here (a map insert, removed when the wait ends) and one
//! task per [`Ticker`], running only while some deadline is registered, wakes every [`GRAIN`]
//! and wakes the handshakes whose deadline has passed. Retransmissions therefore go out up to
//! one grain late, which the protocol allows (docs/wire.md §8.4: the wait is a minimum).

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// How often the ticker wakes while deadlines are registered.
pub(crate) const GRAIN: Duration = Duration::from_millis(10);

/// Deadlines of a client's handshakes and the task that serves them.
#[derive(Debug, Default)]
pub(crate) struct Ticker {
    st: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    waiting: BTreeMap<(Instant, u64), Waker>,
    next_id: u64,
    running: bool,
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
            let now = Instant::now();
            let mut st = lock(&self.st);
            while let Some(entry) = st.waiting.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                entry.remove().wake();
            }
            if st.waiting.is_empty() {
                st.running = false;
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
    id: Option<u64>,
}

impl Future for Deadline {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.deadline {
            if let Some(id) = self.id.take() {
                lock(&self.ticker.st).waiting.remove(&(self.deadline, id));
            }
            return Poll::Ready(());
        }
        let deadline = self.deadline;
        let mut st = lock(&self.ticker.st);
        let id = match self.id {
            Some(id) => id,
            None => {
                let id = st.next_id;
                st.next_id += 1;
                id
            }
        };
        st.waiting.insert((deadline, id), cx.waker().clone());
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
            lock(&self.ticker.st).waiting.remove(&(self.deadline, id));
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
        assert!(lock(&t.st).waiting.is_empty());
        // A deadline already passed completes at once.
        let d = Instant::now() + Duration::from_millis(1);
        std::thread::sleep(Duration::from_millis(2));
        t.wait(d).await;
        assert!(Instant::now() >= d);
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
