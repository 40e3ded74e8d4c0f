//! What a connection, its waiter thread and the payloads and buffers it lent share.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::ring::{CLOSED, Consumer, Producer, Region};
use crate::{Role, WaitPolicy};

/// State shared by a connection, its waiter thread and the payloads and buffers it lent.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) region: Region,
    /// The send ring's end (each ring end is behind a short lock held only while copying or
    /// reserving; lent buffers and payloads take it to give their space back).
    pub(crate) tx: Mutex<Producer>,
    /// The receive ring's end.
    pub(crate) rx: Mutex<Consumer>,
    pub(crate) rx_lent: AtomicU64,
    pub(crate) rx_copied: AtomicU64,
    pub(crate) tx_lent: AtomicU64,
    pub(crate) tx_copied: AtomicU64,
    pub(crate) role: Role,
    pub(crate) wait: WaitPolicy,
    /// Receivers parked on an empty ring.
    pub(crate) notify: tokio::sync::Notify,
    /// A receiver asked the waiter thread to watch the ring.
    pub(crate) armed: AtomicBool,
    /// The connection was dropped: the waiter thread ends.
    pub(crate) shutdown: AtomicBool,
}

impl Shared {
    pub(crate) fn rx_ring(&self) -> usize {
        match self.role {
            Role::Client => 1,
            Role::Server => 0,
        }
    }

    pub(crate) fn tx_ring(&self) -> usize {
        1 - self.rx_ring()
    }

    pub(crate) fn me(&self) -> usize {
        match self.role {
            Role::Client => 0,
            Role::Server => 1,
        }
    }

    pub(crate) fn peer(&self) -> usize {
        1 - self.me()
    }

    /// The peer closed its end on purpose (a cheap load, checked on every empty poll).
    pub(crate) fn peer_closed(&self) -> bool {
        self.region.state(self.peer()).load(Ordering::Acquire) == CLOSED
    }

    /// The peer closed or its process died (its lock on the region was released): a system
    /// call, so checked only every [`WaitPolicy::liveness`].
    pub(crate) fn peer_gone(&self) -> bool {
        self.peer_closed()
            || !crate::sys::lock_held(self.region.mapping().file(), self.peer() as i64)
                .unwrap_or(false)
    }

    /// The waiter thread: blocks on the receive ring's futex while a receiver is parked,
    /// wakes receivers when records arrive, the peer goes away or the connection is dropped.
    pub(crate) fn watch(self: Arc<Self>) {
        let ring = self.rx_ring();
        loop {
            if self.shutdown.load(Ordering::Acquire) {
                return;
            }
            if !self.armed.load(Ordering::Acquire) {
                std::thread::park_timeout(Duration::from_secs(1));
                continue;
            }
            let seen = self.region.bell(ring).load(Ordering::Acquire);
            if self.region.has_data(ring)
                || self.shutdown.load(Ordering::Acquire)
                || self.peer_gone()
            {
                self.armed.store(false, Ordering::Release);
                self.notify.notify_waiters();
                continue;
            }
            crate::sys::futex_wait(self.region.bell(ring), seen, self.wait.liveness);
        }
    }
}
