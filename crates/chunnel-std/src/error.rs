//! The crate's error type.

/// Errors of the standard Chunnels.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A message could not be encoded in the connection's format.
    #[error("cannot encode a message as {format}: {message}")]
    Encode {
        /// The format.
        format: &'static str,
        /// What went wrong.
        message: String,
    },
    /// A received message could not be decoded in the connection's format.
    #[error("cannot decode a message as {format}: {message}")]
    Decode {
        /// The format.
        format: &'static str,
        /// What went wrong.
        message: String,
    },
    /// A reliability or ordering header was malformed.
    #[error("malformed {layer} header: {what}")]
    Header {
        /// The layer.
        layer: &'static str,
        /// What was wrong.
        what: &'static str,
    },
    /// A client-push sharding connection was used before it learned the server's shard set
    /// (see `shard::ShardDirectory::learn`).
    #[error("the shard set is not known yet: learn it from the negotiated server stack")]
    ShardSetUnknown,
    /// A shard-set advertisement (the `shard` capability's labels) did not parse, or names
    /// a hash function this build does not implement.
    #[error("bad shard-set advertisement: {what}")]
    BadShardSet {
        /// What was wrong.
        what: String,
    },
    /// `ClientShardConn::recv_from` was given a source it does not have.
    #[error("no receive source {index} (this connection has {sources})")]
    NoSuchSource {
        /// The source asked for.
        index: usize,
        /// How many there are.
        sources: usize,
    },
    /// A shard of this process no longer takes requests (its thread ended).
    #[error("shard {shard} is gone")]
    ShardGone {
        /// The shard's index.
        shard: usize,
    },
    /// A packet scheduler's gate schedule cannot work (see `sched::GateSchedule::new`).
    #[error("bad gate schedule: {what}")]
    BadSchedule {
        /// What was wrong.
        what: &'static str,
    },
    /// An ordered connection without a gap timeout had more than its capacity of messages
    /// waiting behind a missing one: the base reorders more than the configuration allows
    /// (e.g. `Reliable`'s window is larger than `Ordered`'s capacity). Nothing was dropped;
    /// the connection delivers what was in order and takes nothing more.
    #[error(
        "reorder buffer overflow: more than {capacity} messages wait behind message \
         {waiting_for}; raise ordered::Config::capacity to at least the base's reordering \
         window (Reliable's window)"
    )]
    ReorderOverflow {
        /// The configured capacity.
        capacity: usize,
        /// The sequence number delivery is waiting for.
        waiting_for: u64,
    },
}

impl From<Error> for chunnel::Error {
    fn from(e: Error) -> Self {
        let layer = match &e {
            Error::Encode { .. } | Error::Decode { .. } => "chunnel-std/serialize",
            Error::Header { layer, .. } => layer,
            Error::ReorderOverflow { .. } => "chunnel-std/ordered",
            Error::BadSchedule { .. } => "chunnel-std/sched",
            Error::ShardSetUnknown
            | Error::BadShardSet { .. }
            | Error::ShardGone { .. }
            | Error::NoSuchSource { .. } => "chunnel-std/shard",
        };
        chunnel::Error::Layer {
            layer,
            source: Box::new(e),
        }
    }
}
