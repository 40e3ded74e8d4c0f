//! The one error type of the core crate, shared by every connection.

use std::io;

/// A type-erased error, used where a layer's own error type must cross the stack boundary.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors from building or using a Chunnel connection.
///
/// Every connection in a stack reports errors as this type so that layers compose without
/// conversion boilerplate. Variants carry structured fields; match on them rather than on the
/// `Display` text, which is not stable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The local address is already bound by another socket.
    #[error("address {addr} is already in use")]
    AddrInUse {
        /// The address that was requested.
        addr: String,
    },
    /// A local address to bind and the remote address to reach are of different IP families
    /// (one IPv4, the other IPv6): a socket of one family cannot reach the other.
    #[error("local address {local} and remote address {remote} are of different IP families")]
    AddrFamily {
        /// The local address that was requested.
        local: String,
        /// The remote address.
        remote: String,
    },
    /// Nothing listens at the remote address (or the peer actively refused).
    #[error("connection to {addr} was refused")]
    ConnectionRefused {
        /// The remote address.
        addr: String,
    },
    /// A message is larger than this connection can carry.
    #[error("message of {len} bytes exceeds the maximum of {max} bytes")]
    MessageTooLarge {
        /// Length of the offending message.
        len: usize,
        /// The largest message this connection carries.
        max: usize,
    },
    /// The peer closed the connection (or disappeared); no more messages will arrive.
    #[error("the peer closed the connection")]
    PeerClosed,
    /// This side closed the connection, or the listener/socket behind it is gone.
    #[error("the connection is closed")]
    Closed,
    /// Bytes from the network did not parse; `what` names the rule that was broken.
    #[error("malformed input: {what}")]
    Malformed {
        /// Which part of the frame was wrong.
        what: &'static str,
    },
    /// A Chunnel cannot be used here (missing privilege, hardware, co-located peer...).
    /// `Select` falls back to its other branch when it sees this from a branch's availability
    /// check.
    #[error("chunnel {chunnel} is not available here: {reason}")]
    NotAvailable {
        /// The stable id of the Chunnel.
        chunnel: &'static str,
        /// Why it cannot be used.
        reason: String,
    },
    /// Negotiation data did not name a branch that exists in this stack.
    #[error("the negotiated pick does not fit this stack: {what}")]
    BadPick {
        /// What did not fit.
        what: &'static str,
    },
    /// No branch of a `Select` could be used; both reasons are kept.
    #[error("no branch of the select is available (left: {left}; right: {right})")]
    NoBranch {
        /// Why the preferred branch was not usable.
        left: Box<Error>,
        /// Why the fallback branch was not usable.
        right: Box<Error>,
    },
    /// A runtime reconfiguration could not build the new branch for `failed` of the `of`
    /// connections it was to switch; no connection was switched (each stays on its branch).
    #[error("switching {failed} of {of} connections to the {to:?} branch failed: {source}")]
    SwitchFailed {
        /// The branch that was requested.
        to: crate::side::Side,
        /// How many connections could not build it.
        failed: usize,
        /// How many connections were to be switched.
        of: usize,
        /// The first build error.
        #[source]
        source: Box<Error>,
    },
    /// The peer switched stacks at this point of the message stream (a multilateral
    /// reconfiguration marker): this implementation receives nothing more. A reconfigurable
    /// connection handles it by moving its receivers to the new implementation; an
    /// application sees it only if it receives below such a connection.
    #[error("the peer switched stacks here; this implementation receives nothing more")]
    EndOfEpoch,
    /// An operating-system error during `op` that has no more specific variant.
    #[error("i/o error during {op}: {source}")]
    Io {
        /// What the library was doing.
        op: &'static str,
        /// The operating-system error.
        #[source]
        source: io::Error,
    },
    /// An error specific to one layer, type-erased at the stack boundary.
    #[error("{layer}: {source}")]
    Layer {
        /// The stable id of the layer that failed.
        layer: &'static str,
        /// The layer's own error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Wraps an operating-system error, mapping well-known kinds to their own variants.
    ///
    /// `addr` is the address involved, used for [`Error::AddrInUse`] and
    /// [`Error::ConnectionRefused`].
    pub fn from_io(op: &'static str, addr: impl std::fmt::Display, source: io::Error) -> Self {
        match source.kind() {
            io::ErrorKind::AddrInUse => Error::AddrInUse {
                addr: addr.to_string(),
            },
            io::ErrorKind::ConnectionRefused => Error::ConnectionRefused {
                addr: addr.to_string(),
            },
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::NotConnected => Error::PeerClosed,
            _ => Error::Io { op, source },
        }
    }

    /// True when the connection cannot carry any more messages (either side closed it).
    pub fn is_closed(&self) -> bool {
        matches!(self, Error::PeerClosed | Error::Closed)
    }
}
