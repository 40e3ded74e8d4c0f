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
    /// An ordered subscriber had more messages waiting behind a gap than its reorder buffer
    /// holds ([`crate::order::OrderConfig::capacity`]): the lanes reorder more than the
    /// configuration allows. Nothing was skipped; the connection delivers no more.
    #[error(
        "ordered subscriber: more than {capacity} messages wait behind a gap (reorder buffer full)"
    )]
    ReorderOverflow {
        /// The buffer's capacity.
        capacity: usize,
    },
    /// An ordered publisher keeps more messages of failed sends than
    /// [`crate::order::OrderConfig::max_pending`] allows and could not publish them now: this
    /// burst was refused (not taken; send it again later). The kept ones stay kept.
    #[error(
        "ordered publisher: {pending} messages of failed sends still not stored, burst refused: {last}"
    )]
    Backlog {
        /// Messages kept.
        pending: usize,
        /// Why publishing the kept ones failed.
        last: String,
    },
    /// Bytes read from the broker or a rendezvous store do not decode (written by something
    /// else, or damaged): nothing was taken from them.
    #[error("undecodable {what}: {why}")]
    Corrupt {
        /// What was read.
        what: &'static str,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The rendezvous store of an ordering group or a rebalancing Kafka group failed (feature
    /// `group`).
    #[cfg(feature = "group")]
    #[error("rendezvous: {0}")]
    Rendezvous(#[from] chunnel_rendezvous::Error),
}

impl Error {
    /// Whether retrying the operation may succeed (the broker may come back).
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Unavailable { .. } | Error::Backlog { .. })
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
