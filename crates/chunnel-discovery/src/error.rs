//! The crate's one error type.

use crate::candidate::Candidate;

/// Errors of the discovery registry.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An implementation with this name is already registered.
    #[error("an implementation named `{name}` is already registered")]
    Duplicate {
        /// The name registered twice.
        name: String,
    },
    /// No registered implementation of `function` can be used here: none is registered, or
    /// every candidate was skipped (each with its reason in `candidates`).
    #[error("no usable implementation of `{function}`{}", skipped_list(.candidates))]
    NoImplementation {
        /// The function asked for.
        function: String,
        /// Every candidate and why it was skipped.
        candidates: Vec<Candidate>,
    },
    /// An implementation declared for both ends offers no exact capability, so negotiation
    /// could pick it with a peer that does not run it.
    #[error(
        "implementation `{name}` is declared for both ends but its Chunnel offers no exact capability"
    )]
    NotBothEnds {
        /// The implementation.
        name: String,
    },
    /// An implementation's set-up hook failed; the connection was not built.
    #[error("set-up of implementation `{name}` failed: {reason}")]
    Setup {
        /// The implementation.
        name: String,
        /// What the hook reported.
        reason: String,
    },
}

fn skipped_list(c: &[Candidate]) -> String {
    if c.is_empty() {
        return " (none registered)".into();
    }
    let parts: Vec<String> = c.iter().map(|c| c.to_string()).collect();
    format!(": {}", parts.join("; "))
}

impl From<Error> for chunnel::Error {
    /// A registry error where a Chunnel error is expected (a set-up hook failing inside
    /// `connect_wrap`): [`chunnel::Error::Layer`] with the id `chunnel/discovery`.
    fn from(e: Error) -> Self {
        chunnel::Error::Layer {
            layer: "chunnel/discovery",
            source: Box::new(e),
        }
    }
}
