//! The crate's error.

/// What can go wrong setting up metrics export.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Another recorder is already the process's global one.
    #[error("a global metrics recorder is already installed")]
    RecorderInstalled,
    /// The address in the environment variable is not a socket address.
    #[error("{var}={value:?} is not a socket address (e.g. 127.0.0.1:9464)")]
    BadAddress {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// The scrape endpoint could not bind its address.
    #[error("binding the scrape endpoint on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}
