//! Settings of the io_uring UDP datapath ([`Config`]): the datagram settings every datapath
//! shares ([`chunnel_net::datagram::Config`]) and the ring's own knobs.

use std::ops::Deref;

use chunnel::Error;

/// The most messages submitted with one `io_uring_enter`.
pub(crate) const MAX_BATCH: usize = 64;

/// Largest UDP payload over IPv4 (65,535 − 8 UDP − 20 IP header bytes).
pub use chunnel_net::udp::MAX_PAYLOAD;

/// Settings of the io_uring UDP datapath: [`Config::datagram`], the settings every datagram
/// datapath shares (read through `Deref`: `cfg.max_payload`), and the ring's own knobs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Message size, batch, queues, backlog, peer cap, idle timeout: as for kernel UDP
    /// (`chunnel_net::udp::Config`, whose defaults these are). `batch` is also the most
    /// messages submitted with one `io_uring_enter`.
    pub datagram: chunnel_net::datagram::Config,
    /// Receive buffers lent to the kernel (rounded up to a power of two, at most 32768).
    /// Each holds one datagram of `max_payload` bytes (+ 44 bytes of header); memory is
    /// reserved for all of them but only touched where datagrams land.
    pub recv_buffers: usize,
    /// Send buffers a client connection lends (`chunnel::LendBuffer`), each of
    /// `max_payload` bytes, allocated (zeroed, pages touched only when used) on the first
    /// `lend`. Default 64.
    pub send_buffers: usize,
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
            datagram: chunnel_net::udp::Config::default(),
            recv_buffers: 64,
            send_buffers: 64,
            forced_unavailable: false,
            single_thread: None,
        }
    }
}

impl Deref for Config {
    type Target = chunnel_net::datagram::Config;
    fn deref(&self) -> &Self::Target {
        &self.datagram
    }
}

impl Config {
    /// Changes [`Config::datagram`] with `f`, e.g.
    /// `Config::default().with_datagram(|d| d.with_max_peers(4))`. `max_payload` stays at most
    /// [`MAX_PAYLOAD`].
    pub fn with_datagram(
        mut self,
        f: impl FnOnce(chunnel_net::datagram::Config) -> chunnel_net::datagram::Config,
    ) -> Self {
        self.datagram = f(self.datagram);
        self.datagram.max_payload = self.datagram.max_payload.min(MAX_PAYLOAD);
        self
    }

    /// Sets [`Config::recv_buffers`] (clamped to 1..=32768).
    pub fn with_recv_buffers(mut self, n: usize) -> Self {
        self.recv_buffers = n.clamp(1, 32768);
        self
    }

    /// Sets [`Config::send_buffers`] (clamped to 1..=32768).
    pub fn with_send_buffers(mut self, n: usize) -> Self {
        self.send_buffers = n.clamp(1, 32768);
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
