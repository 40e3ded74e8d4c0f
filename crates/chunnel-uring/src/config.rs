//! Settings of the io_uring UDP datapath ([`Config`]).

use std::time::Duration;

use chunnel::Error;

/// The most messages submitted with one `io_uring_enter`.
pub(crate) const MAX_BATCH: usize = 64;

/// Largest UDP payload over IPv4 (65,535 − 8 UDP − 20 IP header bytes).
pub const MAX_PAYLOAD: usize = 65_507;

/// Settings of the io_uring UDP datapath. The fields shared with `chunnel_net::udp::Config`
/// mean the same.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Largest message carried, in bytes. Larger sends fail with
    /// [`Error::MessageTooLarge`]; larger incoming datagrams are dropped and counted.
    pub max_payload: usize,
    /// Most messages submitted with one `io_uring_enter` (at most 64).
    pub batch: usize,
    /// Receive buffers lent to the kernel (rounded up to a power of two, at most 32768).
    /// Each holds one datagram of `max_payload` bytes (+ 44 bytes of header); memory is
    /// reserved for all of them but only touched where datagrams land.
    pub recv_buffers: usize,
    /// Datagrams buffered per connection (server side: per peer) before new ones are
    /// dropped.
    pub peer_queue: usize,
    /// New peers waiting for `accept` before datagrams from further new peers are dropped.
    pub backlog: usize,
    /// Most peers a listener keeps state for (accepted connections and new peers waiting
    /// for `accept`); default 16,384. At the cap, a datagram from a new address evicts the
    /// oldest peer still waiting for `accept`, or is dropped and counted
    /// ([`Listener::peer_cap_stats`](crate::udp::Listener::peer_cap_stats)); accepted connections are never evicted by new peers
    /// (the idle timeout ends those whose peer went away).
    pub max_peers: usize,
    /// A server-side connection that receives nothing for this long ends with
    /// [`Error::PeerClosed`]. `None` keeps it until dropped.
    pub idle_timeout: Option<Duration>,
    /// Report the datapath unavailable whatever the host supports (tests the fallback of a
    /// `Select`).
    pub forced_unavailable: bool,
    /// Whether the socket is used from one thread only, which lets its ring defer
    /// completion work to that thread (`IORING_SETUP_DEFER_TASKRUN`): a datagram's arrival
    /// then wakes the thread through an eventfd instead of interrupting its `epoll_wait`,
    /// which saves a system call and an interrupted wait per wake-up. The ring is bound to the
    /// first thread that uses it; use from another thread then fails with an error (and a
    /// connection dropped on another thread leaks its receive buffers).
    /// `None` (the default) decides when the socket is created: yes on a current-thread
    /// tokio runtime, no on a multi-thread one.
    pub single_thread: Option<bool>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_payload: MAX_PAYLOAD,
            batch: 32,
            recv_buffers: 64,
            peer_queue: 1024,
            backlog: 128,
            max_peers: 16_384,
            idle_timeout: Some(Duration::from_secs(60)),
            forced_unavailable: false,
            single_thread: None,
        }
    }
}

impl Config {
    /// Sets [`Config::max_payload`] (at least 1, at most [`MAX_PAYLOAD`]).
    pub fn with_max_payload_bytes(mut self, n: usize) -> Self {
        self.max_payload = n.clamp(1, MAX_PAYLOAD);
        self
    }

    /// Sets [`Config::batch`] (clamped to 1..=64).
    pub fn with_batch(mut self, n: usize) -> Self {
        self.batch = n.clamp(1, MAX_BATCH);
        self
    }

    /// Sets [`Config::recv_buffers`] (clamped to 1..=32768).
    pub fn with_recv_buffers(mut self, n: usize) -> Self {
        self.recv_buffers = n.clamp(1, 32768);
        self
    }

    /// Sets [`Config::max_peers`] (at least 1).
    pub fn with_max_peers(mut self, n: usize) -> Self {
        self.max_peers = n.max(1);
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

    /// Sets [`Config::single_thread`].
    pub fn with_single_thread(mut self, yes: Option<bool>) -> Self {
        self.single_thread = yes;
        self
    }

    /// Sets [`Config::forced_unavailable`].
    pub fn with_forced_unavailable(mut self, yes: bool) -> Self {
        self.forced_unavailable = yes;
        self
    }

    pub(crate) fn check(&self) -> Result<(), Error> {
        if self.forced_unavailable {
            return Err(crate::not_available(
                "forced unavailable by udp::Config::with_forced_unavailable",
            ));
        }
        crate::check_available()
    }
}
