//! The idle sweep: one task per listener ends accepted connections that received nothing
//! for [`Config::idle_timeout`](super::Config::idle_timeout).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::datapath::DatagramIo;
use super::demux::Peer;
use super::listener::Shared;
use super::lock;

/// The accepted connections of a listener with an idle timeout, by when each is next
/// checked (the earliest on top). One task per listener sweeps it; a connection has no
/// timer of its own (a timer per connection would cost an allocation and a timer-wheel
/// insertion per connection, and a timer to poll in every wait of its receives).
pub(super) struct IdleSweep<A> {
    pub(super) due: std::collections::BinaryHeap<IdleEntry<A>>,
    pub(super) task: Option<tokio::task::JoinHandle<()>>,
}

impl<A> std::fmt::Debug for IdleSweep<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleSweep")
            .field("connections", &self.due.len())
            .finish_non_exhaustive()
    }
}

pub(super) struct IdleEntry<A> {
    /// When to look again, in [`Shared::nanos_now`] units.
    at: u64,
    peer: std::sync::Weak<Peer<A>>,
}

impl<A> PartialEq for IdleEntry<A> {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl<A> Eq for IdleEntry<A> {}

impl<A> PartialOrd for IdleEntry<A> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<A> Ord for IdleEntry<A> {
    /// Reversed: `BinaryHeap` keeps the greatest on top, the sweep wants the earliest.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.at.cmp(&self.at)
    }
}

impl<S: DatagramIo> Shared<S> {
    /// Now, as nanoseconds since [`Shared::epoch`].
    pub(super) fn nanos_now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The instant `nanos` after [`Shared::epoch`].
    fn instant_of(&self, nanos: u64) -> Instant {
        self.epoch + Duration::from_nanos(nanos)
    }

    /// Puts a newly accepted connection under the idle sweep (started on first use; it
    /// ends when nothing is left to watch, or with the listener and its connections).
    pub(super) fn watch_idle(self: &Arc<Self>, peer: &Arc<Peer<S::Addr>>, timeout: Duration) {
        let now = self.nanos_now();
        peer.last_rx.store(now, Ordering::Relaxed);
        let mut g = lock(&self.idle);
        g.due.push(IdleEntry {
            at: now.saturating_add(nanos(timeout)),
            peer: Arc::downgrade(peer),
        });
        if g.task.as_ref().is_none_or(|t| t.is_finished()) {
            g.task = Some(tokio::spawn(sweep_idle(Arc::downgrade(self), timeout)));
        }
    }

    /// Ends the connections idle for `timeout` as of `now`; those that are not are looked
    /// at again when they could be. Looks at no more than [`SWEEP_BATCH`] connections.
    /// Returns when to sweep next (`None`: nothing to watch; `now` itself: more are due).
    fn sweep_idle_once(&self, timeout: Duration, now: u64) -> Option<u64> {
        let timeout = nanos(timeout);
        for _ in 0..SWEEP_BATCH {
            let e = {
                let mut g = lock(&self.idle);
                match g.due.peek() {
                    Some(e) if e.at <= now => g.due.pop()?,
                    Some(e) => return Some(e.at),
                    None => {
                        g.task = None;
                        return None;
                    }
                }
            };
            let Some(peer) = e.peer.upgrade() else {
                continue; // the connection was dropped
            };
            let quiet_until = peer.last_rx.load(Ordering::Relaxed).saturating_add(timeout);
            let mut d = lock(&self.demux);
            // Looked at under the demux lock, which `close` takes too: a connection the
            // application closed meanwhile is not reported as idle.
            if peer.closed.load(Ordering::Acquire) {
                continue;
            }
            // Messages waiting to be read count as activity (the application is behind,
            // the peer is not silent). The queue is filled under the demux lock, so one
            // found empty here stays so until the connection has left the map.
            let at = if quiet_until > now {
                Some(quiet_until)
            } else if !lock(&peer.queue).is_empty() {
                Some(now.saturating_add(timeout))
            } else {
                None
            };
            if let Some(at) = at {
                drop(d);
                lock(&self.idle).due.push(IdleEntry { at, ..e });
                continue;
            }
            peer.idled.store(true, Ordering::Release);
            d.leave(&peer);
            drop(d);
            peer.notify.notify_waiters();
        }
        Some(now)
    }
}

/// Connections the idle sweep looks at before it lets other tasks run.
const SWEEP_BATCH: usize = 256;

/// A duration in [`Shared::nanos_now`] units.
pub(super) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The idle sweep of one listener: sleeps until the earliest connection could be idle.
async fn sweep_idle<S: DatagramIo>(shared: std::sync::Weak<Shared<S>>, timeout: Duration) {
    loop {
        let Some(sh) = shared.upgrade() else {
            return; // the listener and all its connections are gone
        };
        let now = sh.nanos_now();
        let Some(next) = sh.sweep_idle_once(timeout, now) else {
            return;
        };
        let at = sh.instant_of(next);
        drop(sh);
        if next <= now {
            // More are due: let other tasks run between batches.
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep_until(at).await;
        }
    }
}
