//! The operator policy: priority overrides, forbidden implementations, scope preference and
//! the mapping of QoS hints to datapaths.

use std::collections::{HashMap, HashSet};
use std::fmt;

/// The function every datapath implements.
pub const FUNCTION: &str = "datapath";
/// Shared memory between co-located peers (chunnel-shm).
pub const SHM: &str = "shm";
/// AF_XDP (chunnel-xdp; a server datapath).
pub const AF_XDP: &str = "af-xdp";
/// io_uring UDP (chunnel-uring).
pub const IO_URING: &str = "io-uring";
/// Kernel UDP sockets (chunnel-net).
pub const KERNEL_UDP: &str = "kernel-udp";

/// Where an implementation runs (HotNets §4.2, `bertha::scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// Inside the application's process (a library: io_uring, a software fallback).
    Process,
    /// On the application's host but outside the process (shared memory with a co-located
    /// peer, a kernel module, an XDP program, a SmartNIC).
    Host,
    /// In the network (a programmable switch, a middlebox).
    Network,
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Scope::Process => "process",
            Scope::Host => "host",
            Scope::Network => "network",
        })
    }
}

/// Where an implementation must be present (HotNets §4.2, `endpoints::Both`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoints {
    /// Both ends of a connection must run it (shared memory, an encryption): its Chunnel
    /// carries an exact capability, so negotiation picks it only where the peer has it too.
    Both,
    /// One end suffices (io_uring or AF_XDP, which are wire-compatible with kernel UDP; a
    /// client-side shard map).
    One,
}

/// An application's statement of what a connection needs (INSANE thesis §6.3.2): the policy
/// maps it to an ordered list of datapaths ([`Policy::datapaths_for`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Hint {
    /// Lowest latency (INSANE: acceleration required, resource use no concern).
    LatencySensitive,
    /// Most messages per second in bursts (INSANE: acceleration required, batching).
    Throughput,
    /// Least CPU and memory (INSANE: no acceleration: kernel UDP).
    Frugal,
}

impl fmt::Display for Hint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Hint::LatencySensitive => "latency-sensitive",
            Hint::Throughput => "throughput",
            Hint::Frugal => "frugal",
        })
    }
}

/// How the registry ranks candidates. Set at run time with
/// [`crate::Registry::set_policy`]; read each time a select is built.
///
/// Ranking: candidates of a function are ordered by scope preference (if any, the scopes
/// listed first, in list order; unlisted scopes after), then by priority (the override if
/// one is set, else the registered one; higher first), then by registration order. A
/// forbidden implementation is skipped with [`crate::Skip::Forbidden`].
///
/// ```
/// use chunnel_discovery::{Hint, Policy, Scope};
/// let p = Policy::default()
///     .with_priority("io-uring", 5)
///     .forbid("af-xdp")
///     .prefer_scopes([Scope::Host, Scope::Process])
///     .with_hint(Hint::Frugal, ["kernel-udp"]);
/// assert!(p.is_forbidden("af-xdp"));
/// assert_eq!(p.priority_override("io-uring"), Some(5));
/// assert_eq!(p.datapaths_for(Hint::Frugal), ["kernel-udp"]);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    priorities: HashMap<String, i32>,
    forbidden: HashSet<String>,
    scopes: Vec<Scope>,
    hints: HashMap<Hint, Vec<String>>,
}

impl Default for Policy {
    /// No overrides, nothing forbidden, no scope preference, and the default hint mapping
    /// (see [`crate::qos`] for why):
    ///
    /// | hint | datapaths, most preferred first |
    /// |---|---|
    /// | latency-sensitive | `shm`, `af-xdp`, `io-uring`, `kernel-udp` |
    /// | throughput | `io-uring`, `af-xdp`, `kernel-udp` |
    /// | frugal | `kernel-udp` |
    fn default() -> Self {
        let list = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let hints = HashMap::from([
            (
                Hint::LatencySensitive,
                list(&[SHM, AF_XDP, IO_URING, KERNEL_UDP]),
            ),
            (Hint::Throughput, list(&[IO_URING, AF_XDP, KERNEL_UDP])),
            (Hint::Frugal, list(&[KERNEL_UDP])),
        ]);
        Policy {
            priorities: HashMap::new(),
            forbidden: HashSet::new(),
            scopes: Vec::new(),
            hints,
        }
    }
}

impl Policy {
    /// Overrides the priority of implementation `name`.
    pub fn with_priority(mut self, name: impl Into<String>, priority: i32) -> Self {
        self.priorities.insert(name.into(), priority);
        self
    }

    /// Forbids implementation `name`: it is never selected.
    pub fn forbid(mut self, name: impl Into<String>) -> Self {
        self.forbidden.insert(name.into());
        self
    }

    /// Lifts a [`Policy::forbid`].
    pub fn allow(mut self, name: &str) -> Self {
        self.forbidden.remove(name);
        self
    }

    /// Ranks candidates by scope first, in this order (empty: no scope preference).
    pub fn prefer_scopes(mut self, scopes: impl IntoIterator<Item = Scope>) -> Self {
        self.scopes = scopes.into_iter().collect();
        self
    }

    /// Maps `hint` to these datapaths, most preferred first.
    pub fn with_hint(
        mut self,
        hint: Hint,
        datapaths: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        self.hints
            .insert(hint, datapaths.into_iter().map(Into::into).collect());
        self
    }

    /// The priority override of `name`, if any.
    pub fn priority_override(&self, name: &str) -> Option<i32> {
        self.priorities.get(name).copied()
    }

    /// Whether `name` is forbidden.
    pub fn is_forbidden(&self, name: &str) -> bool {
        self.forbidden.contains(name)
    }

    /// The datapaths `hint` maps to, most preferred first (empty if the hint is unmapped).
    pub fn datapaths_for(&self, hint: Hint) -> &[String] {
        self.hints.get(&hint).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Where `scope` ranks: its index in the preference list, unlisted scopes after.
    pub(crate) fn scope_rank(&self, scope: Scope) -> usize {
        self.scopes
            .iter()
            .position(|s| *s == scope)
            .unwrap_or(self.scopes.len())
    }
}
