//! QoS hints (INSANE thesis §6.3.2): an application says what a connection needs
//! ([`Hint`]); the operator policy maps the hint to datapaths, most preferred first
//! ([`Policy::datapaths_for`](crate::Policy::datapaths_for)); [`Registry::for_hint`] keeps
//! those available at this end, in that order, as a select the peers negotiate.
//!
//! ## The default mapping, and why
//!
//! INSANE maps three stream options to datapaths: no acceleration → kernel UDP, always;
//! acceleration → RDMA first (fastest at little CPU), then DPDK if resource use is no
//! concern, else XDP (slower, but no cores spinning); and when no acceleration technology
//! is available it "falls back to the standard kernel-based network stack and warns the
//! user". Our datapaths are shared memory, AF_XDP, io_uring and kernel UDP (no RDMA or
//! DPDK), so:
//!
//! * **latency-sensitive** (acceleration, resource use no concern): `shm` first — between
//!   co-located peers nothing beats memory (chunnel-shm's receivers spin before parking, the
//!   INSANE trade of CPU for latency); then `af-xdp` (kernel bypass, INSANE's accelerated
//!   choice off the host); then `io-uring` (fewer system calls than sockets); then
//!   `kernel-udp`.
//! * **throughput** (acceleration for bursts): `io-uring` first — one `io_uring_enter` per
//!   burst and a registered buffer ring, the best batched path that needs no privilege;
//!   then `af-xdp` (batches of frames, but copy mode and root); then `kernel-udp`
//!   (`sendmmsg`/`recvmmsg` batches). Shared memory is left out: its rings copy each message
//!   and a spinning receiver costs a core per connection, the cost INSANE's resource option
//!   guards against for bulk streams.
//! * **frugal** (no acceleration, resource use a concern): `kernel-udp` only, as INSANE.
//!
//! ## Fallback
//!
//! A datapath the hint prefers that cannot be used here (not registered, forbidden,
//! missing a resource, unavailable) is passed over; if anything was passed over before a
//! datapath that is used, [`Registry::for_hint`] logs one `tracing::warn!` naming each and
//! why, and returns the same in [`QosReport::fallbacks`]. Negotiation can fall back further
//! (the peer lacks shared memory): [`QosPlan::negotiated`] tells, and warns, after the
//! handshake.

use std::fmt;
use std::sync::Arc;

use crate::Error;
use crate::candidate::{Candidate, Skip};
use crate::policy::Hint;
use crate::registry::{Placement, Registry, effective_priority, judge};
use crate::selection::Selection;

/// A preferred datapath that was passed over, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Missing {
    /// The datapath.
    pub name: String,
    /// Why it was passed over.
    pub why: Skip,
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name, self.why)
    }
}

/// What [`Registry::for_hint`] decided, for the application to read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QosReport {
    /// The hint.
    pub hint: Hint,
    /// The datapaths the policy maps it to, most preferred first.
    pub wanted: Vec<String>,
    /// Those in the select, in order.
    pub selected: Vec<String>,
    /// The base datapath this end runs on (the first available base in `wanted`).
    pub base: Option<String>,
    /// Wanted datapaths passed over before one that is used: what the fallback warning
    /// named. Empty when the hint got what it preferred.
    pub fallbacks: Vec<Missing>,
}

impl QosReport {
    /// Whether the plan fell back from what the hint preferred.
    pub fn fell_back(&self) -> bool {
        !self.fallbacks.is_empty()
    }
}

/// A select built for a hint, and its report.
#[derive(Debug)]
pub struct QosPlan<I, D> {
    selection: Selection<I, D>,
    report: Arc<QosReport>,
}

impl<I, D> QosPlan<I, D> {
    /// The select to negotiate (put it in the stack).
    pub fn selection(&self) -> &Selection<I, D> {
        &self.selection
    }

    /// The select, taken out.
    pub fn into_selection(self) -> Selection<I, D> {
        self.selection
    }

    /// The report.
    pub fn report(&self) -> &QosReport {
        &self.report
    }

    /// The base datapath this end must run on (`None` if the hint names no base datapath
    /// available here).
    pub fn base(&self) -> Option<&str> {
        self.report.base.as_deref()
    }

    /// After negotiation: which datapath was picked (from the pick's decisions, as
    /// [`Selection::picked`]) and, if it is not the first of the select (the peer lacked
    /// it), the datapaths passed over, each logged in a `tracing::warn!`.
    pub fn negotiated(&self, decisions: &[u8]) -> (Option<String>, Vec<Missing>) {
        let picked = self.selection.picked(decisions).map(str::to_string);
        let mut passed = Vec::new();
        if let Some(p) = &picked {
            for name in self.report.selected.iter().take_while(|s| *s != p) {
                passed.push(Missing {
                    name: name.clone(),
                    why: Skip::Unavailable {
                        reason: "the peer cannot run it (negotiation passed it over)".into(),
                    },
                });
            }
            if !passed.is_empty() {
                let list: Vec<String> = passed.iter().map(|m| m.name.clone()).collect();
                tracing::warn!(
                    hint = %self.report.hint,
                    picked = %p,
                    missing = %list.join(", "),
                    "QoS hint {}: negotiation picked {p}; the peer cannot run {}",
                    self.report.hint,
                    list.join(", ")
                );
            }
        }
        (picked, passed)
    }
}

impl<I: Send + 'static, D: Send + 'static> Registry<I, D> {
    /// The datapaths (implementations of `function`) the policy maps `hint` to, that are
    /// usable here, as one select in the hint's order; see the [module docs](crate::qos).
    ///
    /// Of the [`Placement::Base`] datapaths, only the first usable one is kept (this end
    /// runs on one socket); [`QosPlan::base`] names it. Fails with
    /// [`Error::NoImplementation`] if none is usable.
    pub fn for_hint(&self, function: &str, hint: Hint) -> Result<QosPlan<I, D>, Error> {
        self.plan(function, hint, true)
    }

    /// [`Registry::for_hint`], logging nothing when `warn` is false.
    pub(crate) fn plan(
        &self,
        function: &str,
        hint: Hint,
        warn: bool,
    ) -> Result<QosPlan<I, D>, Error> {
        let policy = self.policy();
        let wanted: Vec<String> = policy.datapaths_for(hint).to_vec();
        let mut members = Vec::new();
        let mut candidates = Vec::new();
        let mut missing: Vec<Missing> = Vec::new();
        let mut fallbacks = Vec::new();
        let mut base: Option<String> = None;
        for name in &wanted {
            let (entry, _) = self.entry(name);
            let entry = entry.filter(|e| e.function() == function);
            let (outcome, priority, scope) = match entry {
                None => (Err(Skip::NotRegistered), 0, None),
                Some(e) => {
                    let outcome = if let (Placement::Base, Some(used)) = (e.placement(), &base) {
                        Err(Skip::BaseNotUsed { used: used.clone() })
                    } else {
                        match judge(&policy, &e) {
                            Ok(c) => {
                                if e.placement() == Placement::Base {
                                    base = Some(name.clone());
                                }
                                members.push((Arc::clone(&e), c));
                                Ok(members.len() - 1)
                            }
                            Err(skip) => Err(skip),
                        }
                    };
                    (outcome, effective_priority(&policy, &e), Some(e.scope()))
                }
            };
            match &outcome {
                // Everything missing so far ranked above a datapath that is used.
                Ok(_) => fallbacks.append(&mut missing),
                Err(Skip::BaseNotUsed { .. }) => {}
                Err(why) => missing.push(Missing {
                    name: name.clone(),
                    why: why.clone(),
                }),
            }
            candidates.push(Candidate {
                name: name.clone(),
                priority,
                scope,
                outcome,
            });
        }
        let selection = Selection::new(function.to_string(), members, candidates)?;
        let report = QosReport {
            hint,
            wanted,
            selected: selection.names().iter().map(|s| s.to_string()).collect(),
            base,
            fallbacks,
        };
        if warn && report.fell_back() {
            let list: Vec<String> = report.fallbacks.iter().map(|m| m.to_string()).collect();
            tracing::warn!(
                hint = %hint,
                using = %report.selected.join(", "),
                missing = %list.join("; "),
                "QoS hint {hint}: falling back to {}; missing: {}",
                report.selected.join(", "),
                list.join("; ")
            );
        }
        Ok(QosPlan {
            selection,
            report: Arc::new(report),
        })
    }
}
