//! The crate's error.

use std::path::PathBuf;

use crate::proto::Code;

/// Errors of the endpoint, the registry and the client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No socket at the path.
    #[error("no control socket at {}: is the process running with a control endpoint?", path.display())]
    NoSocket {
        /// The path.
        path: PathBuf,
    },
    /// The socket exists but nothing listens on it.
    #[error("nothing listens on {} (a stale socket of a process that ended?)", path.display())]
    NotListening {
        /// The path.
        path: PathBuf,
    },
    /// The socket (or its directory) may not be opened by this user.
    #[error("permission denied: {}: the control socket belongs to another user", path.display())]
    PermissionDenied {
        /// The path.
        path: PathBuf,
    },
    /// The endpoint refused this client (its uid, or it serves its maximum of clients).
    #[error("the endpoint refused: {message}")]
    Refused {
        /// [`Code::PermissionDenied`] or [`Code::Busy`].
        code: Code,
        /// Why.
        message: String,
    },
    /// The endpoint speaks another protocol version.
    #[error(
        "endpoint version mismatch: the endpoint speaks control protocol version {theirs}, this client speaks {ours}"
    )]
    Version {
        /// This crate's version.
        ours: u32,
        /// The endpoint's.
        theirs: u32,
    },
    /// The endpoint answered with an error.
    #[error("{message}")]
    Remote {
        /// The kind.
        code: Code,
        /// The endpoint's message.
        message: String,
    },
    /// The endpoint's answer could not be read.
    #[error("bad answer from the endpoint: {0}")]
    Protocol(String),
    /// The endpoint closed the connection.
    #[error("the endpoint closed the connection")]
    Closed,
    /// The socket path is not safe to bind.
    #[error("refusing to bind {}: {reason}", path.display())]
    Insecure {
        /// The path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Another process serves the path.
    #[error("{} is in use by a running endpoint", path.display())]
    InUse {
        /// The path.
        path: PathBuf,
    },
    /// A policy of that name is registered already.
    #[error("policy {name:?} is registered already")]
    DuplicatePolicy {
        /// The name.
        name: String,
    },
    /// No policy of that name.
    #[error("no policy {name:?}")]
    NoSuchPolicy {
        /// The name.
        name: String,
    },
    /// The validator refused a policy value.
    #[error("invalid value for policy {name:?}: {reason}")]
    InvalidValue {
        /// The policy.
        name: String,
        /// The validator's reason.
        reason: String,
    },
    /// Another I/O error.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}
