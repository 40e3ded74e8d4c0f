//! Per-socket counters (drops, evictions, how datagrams were delivered). With feature
//! `metrics`, drops and evictions are also counted through the `metrics` facade
//! (`chunnel_datagram_dropped_total{reason}`, `chunnel_datagram_evicted_total`; handles
//! registered once per socket, with the recorder installed when the socket is made).

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one socket.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) dropped_oversize: AtomicU64,
    pub(crate) dropped_queue_full: AtomicU64,
    pub(crate) dropped_backlog_full: AtomicU64,
    /// Datagrams from new peers dropped at [`Config::max_peers`](super::Config::max_peers) (no
    /// evictable peer).
    pub(crate) dropped_peer_cap: AtomicU64,
    /// Peers evicted to make room: new ones `accept` had not taken (at the cap, or past the
    /// grace under pressure) and, at the cap, accepted ones still marked silent.
    pub(crate) evicted: AtomicU64,
    /// Datagrams a connection read for itself, straight into its slots.
    pub(crate) direct: AtomicU64,
    /// Datagrams sorted into a peer queue (read by another task, or while older ones wait).
    pub(crate) queued: AtomicU64,
    /// Known addresses that started another session ([`chunnel::Listener::recognise_sessions`]).
    pub(crate) new_sessions: AtomicU64,
    #[cfg(feature = "metrics")]
    exported: Exported,
}

/// The `metrics` handles of one socket's drops and evictions.
#[cfg(feature = "metrics")]
#[derive(Debug)]
struct Exported {
    oversize: chunnel_metrics::metrics::Counter,
    queue_full: chunnel_metrics::metrics::Counter,
    backlog_full: chunnel_metrics::metrics::Counter,
    peer_cap: chunnel_metrics::metrics::Counter,
    evicted: chunnel_metrics::metrics::Counter,
}

#[cfg(feature = "metrics")]
impl Default for Exported {
    fn default() -> Self {
        use chunnel_metrics::{metrics::counter, names};
        names::describe();
        let drop = |reason: &'static str| counter!(names::DATAGRAM_DROPS, "reason" => reason);
        Exported {
            oversize: drop("oversize"),
            queue_full: drop("queue_full"),
            backlog_full: drop("backlog_full"),
            peer_cap: drop("peer_cap"),
            evicted: counter!(names::DATAGRAM_EVICTIONS),
        }
    }
}

impl Stats {
    /// A datagram larger than the receive buffer was dropped.
    pub(crate) fn drop_oversize(&self) {
        self.dropped_oversize.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        self.exported.oversize.increment(1);
    }

    /// A datagram for a peer whose queue was full was dropped.
    pub(crate) fn drop_queue_full(&self) {
        self.dropped_queue_full.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        self.exported.queue_full.increment(1);
    }

    /// A new peer's datagram was dropped: the backlog was full or the listener closed.
    pub(crate) fn drop_backlog_full(&self) {
        self.dropped_backlog_full.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        self.exported.backlog_full.increment(1);
    }

    /// A new peer's datagram was dropped at the peer cap.
    pub(crate) fn drop_peer_cap(&self) {
        self.dropped_peer_cap.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        self.exported.peer_cap.increment(1);
    }

    /// A peer was evicted to make room.
    pub(crate) fn count_eviction(&self) {
        self.evicted.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        self.exported.evicted.increment(1);
    }
}
