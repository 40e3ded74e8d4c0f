//! Per-socket counters (drops, evictions, how datagrams were delivered).

use std::sync::atomic::AtomicU64;

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
}
