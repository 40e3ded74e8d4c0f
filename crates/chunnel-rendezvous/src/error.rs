//! The crate's one error type.

use chunnel::negotiate::Mismatch;

/// Everything that can go wrong in multi-party negotiation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store could not be reached or answered with an error. Members already in a group keep
    /// communicating; new joins fail until the store is back (retrying is the caller's policy).
    #[error("rendezvous store ({backend}) unavailable: {detail}")]
    Unavailable {
        /// The backend (`"sqlite"`, `"redis"`, `"etcd"`).
        backend: &'static str,
        /// What the store or the client library said.
        detail: String,
    },
    /// The group's committed stack is not compatible with any stack this participant offers.
    #[error(
        "group `{group}` uses a stack (epoch {epoch}) incompatible with every stack offered here; first mismatch: {first}"
    )]
    Incompatible {
        /// The group.
        group: String,
        /// The committed epoch.
        epoch: u64,
        /// The mismatch with each of our options, in our preference order ("server" = the
        /// group's committed stack, "client" = our option).
        mismatches: Vec<Mismatch>,
        /// The first mismatch, rendered (for the message).
        first: String,
    },
    /// The participant offers no stack at all (every branch unavailable on this host).
    #[error("no stack to offer: every option is unavailable on this host")]
    NothingOffered,
    /// The group's record changed under every one of our attempts to join.
    #[error("group `{group}` kept changing: gave up joining after {attempts} attempts")]
    Contended {
        /// The group.
        group: String,
        /// Attempts made.
        attempts: u32,
    },
    /// A group name or member id that the stores cannot hold.
    #[error("invalid {what} `{name}`: 1 to 128 bytes, no control characters, no `/`")]
    InvalidName {
        /// "group name" or "member id".
        what: &'static str,
        /// The offending name (cut at 140 characters).
        name: String,
    },
    /// The store holds bytes this version cannot read (written by something else).
    #[error("corrupt rendezvous record: {0}")]
    Corrupt(&'static str),
    /// A stored stack record failed to decode.
    #[error("undecodable stack record: {0}")]
    Record(#[from] chunnel_negotiate::wire::WireError),
    /// The proposed transition could not start: another is pending or the group moved on.
    #[error("transition not started: {0}")]
    Busy(&'static str),
    /// A transition was refused or timed out; the group stays on its stack.
    #[error("transition {id} aborted: {reason}")]
    Aborted {
        /// The transition's id.
        id: u64,
        /// Who refused and why, or "timeout".
        reason: String,
    },
    /// An etcd endpoint answered for another cluster than the one the store connected to
    /// (e.g. a stale cluster left on a reused address or data directory): nothing it says can
    /// be trusted for this group, so the store refuses to use its answer.
    #[error(
        "etcd endpoint {endpoint} answered for cluster {found:#018x}, not {expected:#018x} (the cluster this store connected to)"
    )]
    WrongCluster {
        /// The endpoint that answered.
        endpoint: String,
        /// The cluster id seen when the store connected.
        expected: u64,
        /// The cluster id in this answer's header.
        found: u64,
    },
    /// A datagram on a ballot socket that is not a ballot (docs/wire.md §15.4); it is ignored.
    #[error("invalid ballot datagram: {0}")]
    Ballot(BallotFault),
    /// This participant is no longer in the group (it left, or was closed).
    #[error("participant has left the group")]
    Closed,
    /// The local stack refused a pick, or a connection failed.
    #[error(transparent)]
    Chunnel(#[from] chunnel::Error),
    /// A socket error on the group's data plane.
    #[error("group data plane: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// Shorthand for [`Error::Unavailable`].
    pub fn unavailable(backend: &'static str, detail: impl std::fmt::Display) -> Error {
        Error::Unavailable {
            backend,
            detail: detail.to_string(),
        }
    }
}

/// What is wrong with a ballot datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BallotFault {
    /// It ends before a field it must hold.
    Truncated,
    /// It does not start with [`MAGIC`](crate::ballot::MAGIC).
    Magic,
    /// Its version is not [`VERSION`](crate::ballot::VERSION).
    Version(u8),
    /// The ballot tag is neither 0 (yes) nor 1 (no).
    Tag(u8),
    /// The group name or member id is not a valid name (1 to 128 bytes of UTF-8, no control
    /// characters, no `/`).
    Name,
    /// The reason is longer than [`MAX_REASON`](crate::ballot::MAX_REASON) or not UTF-8.
    Reason,
    /// Bytes follow the ballot.
    Trailing,
}

impl std::fmt::Display for BallotFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BallotFault::Truncated => f.write_str("truncated"),
            BallotFault::Magic => f.write_str("not a ballot (wrong magic)"),
            BallotFault::Version(v) => write!(f, "unknown version {v}"),
            BallotFault::Tag(t) => write!(f, "unknown ballot tag {t}"),
            BallotFault::Name => f.write_str("invalid group name or member id"),
            BallotFault::Reason => f.write_str("reason too long or not UTF-8"),
            BallotFault::Trailing => f.write_str("trailing bytes"),
        }
    }
}
