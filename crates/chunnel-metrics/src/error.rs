//! The crate's error.

/// What can go wrong setting up metrics export.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Another recorder is already the process's global one.
    #[error("a global metrics recorder is already installed")]
    RecorderInstalled,
    /// The scrape endpoint could not bind its address.
    #[error("binding the scrape endpoint on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}
