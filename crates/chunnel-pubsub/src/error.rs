//! The crate's error type.

use std::time::Duration;

/// Errors of the pub/sub Chunnels.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The broker did not answer within the bounded wait (it is down, unreachable or stuck);
    /// `last` is the last error seen while retrying, if any.
    #[error("{broker} broker did not answer within {waited:?} during {op}: {last}")]
    Unavailable {
        /// Which broker (`kafka`, `nats`, `redis`).
        broker: &'static str,
        /// The operation that was attempted.
        op: &'static str,
        /// How long it was retried.
        waited: Duration,
        /// The last error seen (or "timed out").
        last: String,
    },
    /// The broker refused an operation with an error that retrying does not fix.
    #[error("{broker} broker refused {op}: {reason}")]
    Refused {
        /// Which broker.
        broker: &'static str,
        /// The operation.
        op: &'static str,
        /// The broker's or client's message.
        reason: String,
    },
    /// A configuration value is not usable (a topic or group name the broker does not accept,
    /// a member index out of range, a zero prefetch).
    #[error("invalid configuration: {what}")]
    Config {
        /// What is wrong.
        what: String,
    },
}

impl Error {
    /// Whether retrying the operation may succeed (the broker may come back).
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Unavailable { .. })
    }
}

impl From<Error> for chunnel::Error {
    fn from(e: Error) -> Self {
        chunnel::Error::Layer {
            layer: "chunnel-pubsub",
            source: Box::new(e),
        }
    }
}
