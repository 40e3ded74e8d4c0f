//! Settings of a reliable connection: [`Config`].

use std::time::Duration;

use super::wire::MAX_HEADER;

/// Settings of a reliable connection (both ends should use the same window sizes).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Most unacknowledged messages in flight; `send` waits while this many are.
    pub window: usize,
    /// Most sequence numbers above the cumulative ack the receiver remembers (at least the
    /// peer's `window`, or messages beyond are dropped and sent again).
    pub recv_window: usize,
    /// Most received messages waiting for the application's `recv`.
    pub recv_buffer: usize,
    /// RTO before the first RTT sample.
    pub initial_rto: Duration,
    /// Lower bound of the RTO.
    pub min_rto: Duration,
    /// Upper bound of the RTO (also of the backed-off RTO).
    pub max_rto: Duration,
    /// Consecutive timeouts without any ack before the peer counts as gone.
    pub max_timeouts: u32,
    /// Later messages selectively acked before a missing one is retransmitted at once.
    pub dupthresh: u64,
    /// Largest payload accepted by `send` (the inner connection must carry it plus
    /// [`MAX_HEADER`] bytes).
    pub max_payload: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            window: 256,
            recv_window: 4096,
            recv_buffer: 1024,
            initial_rto: Duration::from_millis(100),
            min_rto: Duration::from_millis(10),
            max_rto: Duration::from_secs(2),
            max_timeouts: 10,
            dupthresh: 3,
            max_payload: 65_507 - MAX_HEADER,
        }
    }
}

impl Config {
    /// Sets [`Config::window`] (at least 1).
    pub fn with_window(mut self, n: usize) -> Self {
        self.window = n.max(1);
        self
    }
    /// Sets [`Config::recv_window`] (at least 1).
    pub fn with_recv_window(mut self, n: usize) -> Self {
        self.recv_window = n.max(1);
        self
    }
    /// Sets [`Config::recv_buffer`] (at least 1).
    pub fn with_recv_buffer(mut self, n: usize) -> Self {
        self.recv_buffer = n.max(1);
        self
    }
    /// Sets the RTO bounds and initial value (`min <= initial <= max` after clamping).
    pub fn with_rto(mut self, initial: Duration, min: Duration, max: Duration) -> Self {
        self.min_rto = min;
        self.max_rto = max.max(min);
        self.initial_rto = initial.clamp(self.min_rto, self.max_rto);
        self
    }
    /// Sets [`Config::max_timeouts`] (at least 1).
    pub fn with_max_timeouts(mut self, n: u32) -> Self {
        self.max_timeouts = n.max(1);
        self
    }
    /// Sets [`Config::max_payload`].
    pub fn with_max_payload(mut self, n: usize) -> Self {
        self.max_payload = n;
        self
    }
}
