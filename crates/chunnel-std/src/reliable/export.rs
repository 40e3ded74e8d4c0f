//! Feature `metrics`: the connection task exports its machine's retransmission counts
//! (`chunnel_reliable_retransmissions_total{kind}`, kind `timeout` or `fast`) as they grow.
//! Handles are registered once per connection; each turn of the task adds what changed.

use chunnel_metrics::metrics::{Counter, counter};
use chunnel_metrics::names;

use super::machine::Stats;

/// A connection's handles and the totals already exported.
pub(super) struct Exported {
    timeout: Counter,
    fast: Counter,
    seen_retransmitted: u64,
    seen_fast: u64,
}

impl Exported {
    pub(super) fn new() -> Self {
        names::describe();
        Exported {
            timeout: counter!(names::RETRANSMISSIONS, "kind" => "timeout"),
            fast: counter!(names::RETRANSMISSIONS, "kind" => "fast"),
            seen_retransmitted: 0,
            seen_fast: 0,
        }
    }

    /// Adds the retransmissions counted in `s` since the last call.
    pub(super) fn update(&mut self, s: &Stats) {
        let fast = s.fast_retransmits.saturating_sub(self.seen_fast);
        let all = s.retransmitted.saturating_sub(self.seen_retransmitted);
        if all > 0 {
            self.fast.increment(fast);
            self.timeout.increment(all.saturating_sub(fast));
            self.seen_fast = s.fast_retransmits;
            self.seen_retransmitted = s.retransmitted;
        }
    }
}
