//! The receive side's consumer: where reaped datagrams go ([`Rx`]), the client's bounded
//! queue ([`ClientRx`]) and the socket's counters.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

use super::buf::UringPayload;

/// Counters of one socket.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) dropped_oversize: AtomicU64,
    pub(crate) dropped_queue_full: AtomicU64,
    /// Datagrams handed out in their receive buffer / copied out of it.
    pub(crate) rx_lent: AtomicU64,
    pub(crate) rx_copied: AtomicU64,
    /// Datagrams sent from a lent send buffer / from application `Bytes`.
    pub(crate) tx_lent: AtomicU64,
    pub(crate) tx_copied: AtomicU64,
}

impl Stats {
    pub(crate) fn lend_stats(&self) -> chunnel::LendStats {
        chunnel::LendStats {
            rx_lent: self.rx_lent.load(Ordering::Relaxed),
            rx_copied: self.rx_copied.load(Ordering::Relaxed),
            tx_lent: self.tx_lent.load(Ordering::Relaxed),
            tx_copied: self.tx_copied.load(Ordering::Relaxed),
        }
    }
}

/// Where reaped datagrams go: the client's queue, or the batch a listener sorts next.
pub(crate) trait Rx: Send {
    /// Address bytes to receive with every datagram (0 for a connected client).
    const NAME_LEN: u32;
    fn deliver(&mut self, from: Option<SocketAddr>, msg: Bytes, stats: &Stats);
    /// Whether received datagrams may be lent (handed over in their receive buffer).
    fn lends(&self) -> bool {
        false
    }
    /// A lent datagram (only when [`Rx::lends`]).
    fn deliver_lent(&mut self, from: Option<SocketAddr>, msg: UringPayload, stats: &Stats) {
        self.deliver(from, msg.into_bytes(), stats);
    }
    /// A datagram over `max_payload` (`len` bytes, `prefix` its first ones): dropped and
    /// counted.
    fn oversize(&mut self, _from: Option<SocketAddr>, _prefix: &[u8], _len: usize, stats: &Stats) {
        stats.dropped_oversize.fetch_add(1, Ordering::Relaxed);
    }
    fn error(&mut self, e: io::Error);
}

/// What one reap found.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Reaped {
    pub(crate) delivered: usize,
    pub(crate) sends_done: bool,
}

/// The client's receive side: one bounded queue.
#[derive(Debug)]
pub(crate) struct ClientRx {
    pub(crate) queue: VecDeque<UringPayload>,
    pub(crate) error: Option<io::Error>,
    cap: usize,
    /// Set by the first `recv_lent`: datagrams are lent from then on.
    pub(crate) lend: bool,
}

impl ClientRx {
    pub(crate) fn new(cap: usize) -> Self {
        ClientRx {
            queue: VecDeque::new(),
            error: None,
            cap,
            lend: false,
        }
    }

    /// Into `Bytes` (a lent datagram is copied: only when `recv` and `recv_lent` are mixed).
    pub(crate) fn drain(&mut self, slots: &mut [Option<Bytes>]) -> usize {
        let n = self.queue.len().min(slots.len());
        for (s, m) in slots.iter_mut().zip(self.queue.drain(..n)) {
            *s = Some(m.into_bytes());
        }
        n
    }

    pub(crate) fn drain_lent(&mut self, slots: &mut [Option<UringPayload>]) -> usize {
        let n = self.queue.len().min(slots.len());
        for (s, m) in slots.iter_mut().zip(self.queue.drain(..n)) {
            *s = Some(m);
        }
        n
    }

    fn push(&mut self, msg: UringPayload, stats: &Stats) {
        if self.queue.len() >= self.cap {
            stats.dropped_queue_full.fetch_add(1, Ordering::Relaxed);
        } else {
            self.queue.push_back(msg);
        }
    }
}

impl Rx for ClientRx {
    const NAME_LEN: u32 = 0;
    fn deliver(&mut self, _from: Option<SocketAddr>, msg: Bytes, stats: &Stats) {
        self.push(UringPayload::copied(msg), stats);
    }
    fn lends(&self) -> bool {
        self.lend
    }
    fn deliver_lent(&mut self, _from: Option<SocketAddr>, msg: UringPayload, stats: &Stats) {
        self.push(msg, stats);
    }
    fn error(&mut self, e: io::Error) {
        self.error = Some(e);
    }
}
