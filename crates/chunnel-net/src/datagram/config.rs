//! Settings shared by the datagram datapaths: [`Config`] and its defaults.

use std::time::Duration;

use crate::sys::MAX_BATCH;

/// Settings shared by the datagram datapaths.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Largest message carried, in bytes. Larger sends fail with
    /// [`Error::MessageTooLarge`](chunnel::Error::MessageTooLarge); larger incoming datagrams are
    /// dropped and counted. A listener does not drop them silently: it keeps the datagram's first
    /// bytes and its length for the peer's connection ([`chunnel::PeerHandoff::take_oversized`]; a
    /// datagram from a new peer starts a connection that `accept` hands out), so negotiation can
    /// refuse a hello too large for this limit.
    pub max_payload: usize,
    /// Most datagrams moved per system call (at most 64).
    pub batch: usize,
    /// Datagrams buffered per server-side connection before new ones are dropped.
    pub peer_queue: usize,
    /// New peers waiting for `accept` before datagrams from further new peers are dropped.
    pub backlog: usize,
    /// A server-side connection that receives nothing for this long ends: its state on the listener
    /// is freed and its next `recv` returns [`Error::PeerClosed`](chunnel::Error::PeerClosed),
    /// whether or not one was pending (messages received but not yet read count as activity). One
    /// task per listener checks, so a connection carries no timer. `None` keeps it until dropped.
    pub idle_timeout: Option<Duration>,
    /// Most peers a listener keeps state for (accepted connections and new peers waiting for
    /// `accept`); default 16,384. At the cap, a datagram from a new address evicts the oldest peer
    /// still waiting for `accept` (never handed out), else the accepted connection marked silent
    /// longest ago ([`chunnel::PeerHandoff::mark_silent`]: the layer above saw nothing valid from
    /// it yet), or is dropped and counted
    /// ([`Listener::peer_cap_stats`](super::Listener::peer_cap_stats)) if there is neither: other
    /// accepted connections are never evicted by new peers. While more than half the cap is in use,
    /// new peers that waited for `accept` longer than [`SILENT_GRACE`] are evicted first.
    pub max_peers: usize,
    /// Bytes of datagrams buffered per server-side connection (besides the count,
    /// [`Config::peer_queue`]) before new ones are dropped and counted as a full queue;
    /// default 1 MiB.
    pub peer_queue_bytes: usize,
    /// Bytes of datagrams buffered by a listener for all its peers together (connections not
    /// reading, new peers waiting for `accept`) before new ones are dropped and counted as
    /// a full queue; default 64 MiB. With [`Config::max_peers`] it bounds what a flood of
    /// peers that send and never read can make a listener hold.
    pub queued_bytes: usize,
}

/// How long a new peer may wait for `accept` while the listener's peer table is more than
/// half full ([`Config::max_peers`]) before a datagram from another new peer evicts it.
pub const SILENT_GRACE: Duration = Duration::from_secs(1);

impl Config {
    pub(crate) fn with_max_payload(max_payload: usize) -> Self {
        Config {
            max_payload,
            batch: 32,
            peer_queue: 1024,
            backlog: 128,
            idle_timeout: Some(Duration::from_secs(60)),
            max_peers: 16_384,
            peer_queue_bytes: 1 << 20,
            queued_bytes: 64 << 20,
        }
    }

    /// Sets [`Config::peer_queue_bytes`] (at least 1).
    pub fn with_peer_queue_bytes(mut self, n: usize) -> Self {
        self.peer_queue_bytes = n.max(1);
        self
    }

    /// Sets [`Config::queued_bytes`] (at least 1).
    pub fn with_queued_bytes(mut self, n: usize) -> Self {
        self.queued_bytes = n.max(1);
        self
    }

    /// Sets [`Config::max_peers`] (at least 1).
    pub fn with_max_peers(mut self, n: usize) -> Self {
        self.max_peers = n.max(1);
        self
    }

    /// Sets [`Config::max_payload`].
    pub fn with_max_payload_bytes(mut self, n: usize) -> Self {
        self.max_payload = n.max(1);
        self
    }

    /// Sets [`Config::batch`] (clamped to 1..=64).
    pub fn with_batch(mut self, n: usize) -> Self {
        self.batch = n.clamp(1, MAX_BATCH);
        self
    }

    /// Sets [`Config::peer_queue`].
    pub fn with_peer_queue(mut self, n: usize) -> Self {
        self.peer_queue = n.max(1);
        self
    }

    /// Sets [`Config::backlog`].
    pub fn with_backlog(mut self, n: usize) -> Self {
        self.backlog = n.max(1);
        self
    }

    /// Sets [`Config::idle_timeout`].
    pub fn with_idle_timeout(mut self, t: Option<Duration>) -> Self {
        self.idle_timeout = t;
        self
    }

    /// Memory one socket's receive scratch uses: `batch * (max_payload + 1)` bytes.
    pub fn scratch_bytes(&self) -> usize {
        self.batch * (self.max_payload + 1)
    }
}
