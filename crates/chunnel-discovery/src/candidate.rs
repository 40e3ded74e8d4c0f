//! A candidate implementation as the registry judged it, and why one was skipped.

use std::fmt;

use crate::policy::Scope;

/// Why a candidate was left out of a select.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Skip {
    /// The operator policy forbids it.
    Forbidden,
    /// A resource it needs is missing here.
    MissingResource {
        /// The resource.
        resource: String,
        /// Why it is missing.
        reason: String,
    },
    /// Its Chunnel's own availability check failed (`Offers::available`).
    Unavailable {
        /// The check's error.
        reason: String,
    },
    /// Not registered at all (a name a QoS hint maps to).
    NotRegistered,
    /// A base datapath ranked below the one this end uses (only one base is used).
    BaseNotUsed {
        /// The base datapath used instead.
        used: String,
    },
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Skip::Forbidden => f.write_str("forbidden by the operator policy"),
            Skip::MissingResource { resource, reason } => {
                write!(f, "missing resource {resource}: {reason}")
            }
            Skip::Unavailable { reason } => write!(f, "unavailable: {reason}"),
            Skip::NotRegistered => f.write_str("not registered"),
            Skip::BaseNotUsed { used } => write!(f, "this end runs on {used} instead"),
        }
    }
}

/// One candidate of a function, as the registry judged it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The implementation's name.
    pub name: String,
    /// Its priority after the policy's override.
    pub priority: i32,
    /// Its scope (`None` if not registered).
    pub scope: Option<Scope>,
    /// Its place in the select (0: most preferred), or why it was skipped.
    pub outcome: Result<usize, Skip>,
}

impl fmt::Display for Candidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.outcome {
            Ok(rank) => write!(f, "{} (selected, rank {rank})", self.name),
            Err(skip) => write!(f, "{} skipped: {skip}", self.name),
        }
    }
}
