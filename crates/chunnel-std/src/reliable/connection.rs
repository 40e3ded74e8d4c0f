//! The async shell: [`ReliableConnection`], a task per connection driving the [`Machine`]
//! (timers, retransmission, acks) over the inner connection, and its state handover.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use bytes::Bytes;
use chunnel::{ChunnelConnection, Handoff, Handover};
use tokio::sync::Notify;

use super::LAYER;
use super::config::Config;
use super::machine::{Machine, Stats};

/// Why a connection stopped.
#[derive(Clone, Debug)]
enum Failure {
    PeerClosed,
    Closed,
    Other(String),
}

impl Failure {
    fn of(e: &chunnel::Error) -> Self {
        match e {
            chunnel::Error::PeerClosed => Failure::PeerClosed,
            chunnel::Error::Closed => Failure::Closed,
            e => Failure::Other(e.to_string()),
        }
    }

    fn error(&self) -> chunnel::Error {
        match self {
            Failure::PeerClosed => chunnel::Error::PeerClosed,
            Failure::Closed => chunnel::Error::Closed,
            Failure::Other(s) => chunnel::Error::Layer {
                layer: LAYER,
                source: s.clone().into(),
            },
        }
    }
}

#[derive(Debug)]
struct State {
    m: Machine,
    failure: Option<Failure>,
    /// The state went to a successor at a switch: the driver stops and takes nothing more.
    handed_over: bool,
}

#[derive(Debug)]
struct Shared<C> {
    inner: C,
    state: Mutex<State>,
    /// Messages arrived or the connection failed.
    delivered: Notify,
    /// Window space freed, everything acked, or the connection failed.
    space: Notify,
    /// The timer may have moved earlier (the driver re-reads it).
    timer: Notify,
    /// Set (and `start` notified) by the first send, receive, flush or import.
    started: AtomicBool,
    start: Notify,
}

impl<C> Shared<C> {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets the driver run (it waits for this, so that a connection built ahead of a switch
    /// reads nothing from the inner connection it shares with its predecessor).
    fn start(&self) {
        if !self.started.load(Ordering::Relaxed) && !self.started.swap(true, Ordering::AcqRel) {
            self.start.notify_one();
        }
    }

    fn fail(&self, f: Failure) {
        self.lock().failure.get_or_insert(f);
        self.delivered.notify_waiters();
        self.space.notify_waiters();
    }
}

pub(super) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Waits until `check` gives a value, re-checking whenever `notify` wakes waiters. Checks
/// register first, so a wake-up between the check and the wait is not lost.
async fn wait_for<T>(notify: &Notify, mut check: impl FnMut() -> Option<T>) -> T {
    loop {
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if let Some(t) = check() {
            return t;
        }
        notified.await;
    }
}

/// A connection through [`Reliable`](super::Reliable): exactly-once delivery (in arrival order).
#[derive(Debug)]
pub struct ReliableConnection<C> {
    shared: Arc<Shared<C>>,
    driver: tokio::task::JoinHandle<()>,
}

impl<C> Drop for ReliableConnection<C> {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl<C: ChunnelConnection<Data = Bytes> + 'static> ReliableConnection<C> {
    /// Wraps `inner` and spawns the connection's driver task on the current tokio runtime.
    /// The driver starts reading the inner connection at the first `send`, `recv` or
    /// [`flush`](Self::flush) (or when the connection takes over a predecessor's state at a
    /// switch), so a connection built ahead of a switch reads nothing its predecessor should.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn new(inner: C, cfg: Config) -> Self {
        let shared = Arc::new(Shared {
            inner,
            state: Mutex::new(State {
                m: Machine::new(cfg),
                failure: None,
                handed_over: false,
            }),
            delivered: Notify::new(),
            space: Notify::new(),
            timer: Notify::new(),
            started: AtomicBool::new(false),
            start: Notify::new(),
        });
        let driver = tokio::spawn(drive(shared.clone()));
        ReliableConnection { shared, driver }
    }
}

impl<C> ReliableConnection<C> {
    /// Waits until the peer acknowledged every message sent so far.
    pub async fn flush(&self) -> Result<(), chunnel::Error> {
        self.shared.start();
        wait_for(&self.shared.space, || {
            let st = self.shared.lock();
            if let Some(f) = &st.failure {
                Some(Err(f.error()))
            } else if st.m.unacked() == 0 {
                Some(Ok(()))
            } else {
                None
            }
        })
        .await
    }

    /// The protocol counters.
    pub fn stats(&self) -> Stats {
        self.shared.lock().m.stats()
    }

    /// The connection below.
    pub fn get_ref(&self) -> &C {
        &self.shared.inner
    }
}

/// The per-connection task: reads frames, fires timers, sends acks and retransmissions.
async fn drive<C: ChunnelConnection<Data = Bytes>>(s: Arc<Shared<C>>) {
    if !s.started.load(Ordering::Acquire) {
        s.start.notified().await;
    }
    let mut slots: Vec<Option<Bytes>> = vec![None; 32];
    #[cfg(feature = "metrics")]
    let mut exported = super::export::Exported::new();
    loop {
        let deadline = s.lock().m.poll_timeout();
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d.into()).await,
                None => std::future::pending().await,
            }
        };
        let got = tokio::select! {
            r = s.inner.recv(&mut slots) => Some(r),
            () = sleep => None,
            () = s.timer.notified() => None,
        };
        let now = now();
        let mut frames = Vec::new();
        let (deliverable, failed) = {
            let mut st = s.lock();
            if st.handed_over {
                // Frames taken after the switch point go unacknowledged: the peer sends
                // them again, to the successor.
                return;
            }
            match got {
                Some(Ok(n)) => {
                    for slot in &mut slots[..n] {
                        if let Some(f) = slot.take()
                            && st.m.handle_frame(f, now).is_err()
                        {
                            st.m.count_malformed();
                        }
                    }
                }
                Some(Err(e)) => {
                    drop(st);
                    s.fail(Failure::of(&e));
                    return;
                }
                None => {}
            }
            st.m.handle_timeout(now);
            while let Some(f) = st.m.poll_transmit(now) {
                frames.push(f);
            }
            #[cfg(feature = "metrics")]
            exported.update(&st.m.stats());
            (st.m.deliverable() > 0, st.m.failed())
        };
        if failed {
            s.fail(Failure::PeerClosed);
            return;
        }
        if deliverable {
            s.delivered.notify_waiters();
        }
        s.space.notify_waiters();
        if !frames.is_empty()
            && let Err(e) = s.inner.send(frames).await
        {
            s.fail(Failure::of(&e));
            return;
        }
    }
}

impl<C: ChunnelConnection<Data = Bytes>> ChunnelConnection for ReliableConnection<C> {
    type Data = Bytes;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), chunnel::Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        let s = &self.shared;
        s.start();
        async move {
            let mut msgs = burst.into_iter();
            let mut pending: Option<Bytes> = None;
            loop {
                let mut frames = Vec::new();
                let mut too_large = None;
                let full = {
                    let mut st = s.lock();
                    if let Some(f) = &st.failure {
                        return Err(f.error());
                    }
                    let now = now();
                    let mut full = false;
                    while let Some(m) = pending.take().or_else(|| msgs.next()) {
                        let max = st.m.config().max_payload;
                        if m.len() > max {
                            // Send what was accepted, then report.
                            too_large = Some(chunnel::Error::MessageTooLarge { len: m.len(), max });
                            break;
                        }
                        if let Err(m) = st.m.send(m) {
                            pending = Some(m);
                            full = true;
                            break;
                        }
                    }
                    while let Some(f) = st.m.poll_transmit(now) {
                        frames.push(f);
                    }
                    full
                };
                if !frames.is_empty() {
                    s.timer.notify_one();
                    s.inner.send(frames).await?;
                }
                if let Some(e) = too_large {
                    return Err(e);
                }
                if !full {
                    return Ok(());
                }
                wait_for(&s.space, || {
                    let st = s.lock();
                    (st.failure.is_some() || st.m.can_send()).then_some(())
                })
                .await;
            }
        }
    }

    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Bytes>],
    ) -> impl Future<Output = Result<usize, chunnel::Error>> + Send + 'a {
        let s = &self.shared;
        s.start();
        async move {
            if slots.is_empty() {
                return Ok(0);
            }
            wait_for(&s.delivered, || {
                let mut st = s.lock();
                let mut n = 0;
                while n < slots.len() {
                    let Some(m) = st.m.poll_deliver() else { break };
                    slots[n] = Some(m);
                    n += 1;
                }
                if n > 0 {
                    Some(Ok(n))
                } else {
                    st.failure.as_ref().map(|f| Err(f.error()))
                }
            })
            .await
        }
    }
}

/// What a [`ReliableConnection`] hands to its successor at a switch: the whole protocol
/// state (both sequence spaces, the unacknowledged messages, the RTT estimate, the counters).
/// Messages received but not yet delivered go to [`Handoff::buffered`], so any successor
/// delivers them; the rest only a `Reliable` successor can take, which then goes on where
/// this one stopped (same sequence numbers, so the peer needs no switch of its own and
/// nothing is lost or delivered twice). A successor of another kind gets no unacknowledged
/// messages: [`flush`](ReliableConnection::flush) before such a switch.
#[derive(Debug)]
pub struct ReliableState {
    machine: Machine,
}

impl<C: ChunnelConnection<Data = Bytes>> Handover for ReliableConnection<C> {
    fn export(&self, state: &mut Handoff<Bytes>) {
        let machine = {
            let mut st = self.shared.lock();
            st.handed_over = true;
            st.failure.get_or_insert(Failure::Closed);
            let cfg = st.m.cfg.clone();
            std::mem::replace(&mut st.m, Machine::new(cfg))
        };
        self.driver.abort();
        let mut machine = machine;
        state.buffered.extend(machine.deliver.drain(..));
        state.put(ReliableState { machine });
    }

    fn import(&self, state: &mut Handoff<Bytes>) {
        if let Some(ReliableState { mut machine }) = state.take::<ReliableState>() {
            let mut st = self.shared.lock();
            machine.cfg = st.m.cfg.clone();
            st.m = machine;
        }
        // Go on at once: retransmit, acknowledge, whether or not the application calls.
        self.shared.start();
        self.shared.timer.notify_one();
    }
}
