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
}

impl From<Error> for chunnel::Error {
    fn from(e: Error) -> Self {
        let layer = match &e {
            Error::Encode { .. } | Error::Decode { .. } => "chunnel-std/serialize",
            Error::Header { layer, .. } => layer,
        };
        chunnel::Error::Layer {
            layer,
            source: Box::new(e),
        }
    }
}
