//! The receive side's consumer: where reaped datagrams go ([`Rx`]), the client's bounded
//! queue ([`ClientRx`]) and the socket's counters.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

/// Counters of one socket.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) dropped_oversize: AtomicU64,
    pub(crate) dropped_queue_full: AtomicU64,
}

/// Where reaped datagrams go: the client's queue, or the batch a listener sorts next.
pub(crate) trait Rx: Send {
    /// Address bytes to receive with every datagram (0 for a connected client).
    const NAME_LEN: u32;
    fn deliver(&mut self, from: Option<SocketAddr>, msg: Bytes, stats: &Stats);
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
    pub(crate) queue: VecDeque<Bytes>,
    pub(crate) error: Option<io::Error>,
    cap: usize,
}

impl ClientRx {
    pub(crate) fn new(cap: usize) -> Self {
        ClientRx {
            queue: VecDeque::new(),
            error: None,
            cap,
        }
    }

    pub(crate) fn drain(&mut self, slots: &mut [Option<Bytes>]) -> usize {
        let n = self.queue.len().min(slots.len());
        for (s, m) in slots.iter_mut().zip(self.queue.drain(..n)) {
            *s = Some(m);
        }
        n
    }
}

impl Rx for ClientRx {
    const NAME_LEN: u32 = 0;
    fn deliver(&mut self, _from: Option<SocketAddr>, msg: Bytes, stats: &Stats) {
        if self.queue.len() >= self.cap {
            stats.dropped_queue_full.fetch_add(1, Ordering::Relaxed);
        } else {
            self.queue.push_back(msg);
        }
    }
    fn error(&mut self, e: io::Error) {
        self.error = Some(e);
    }
}
