//! The one error type of this crate.

use std::time::Duration;

use chunnel::negotiate::{End, Mismatch};

use crate::wire::WireError;

/// What can go wrong while negotiating.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No option of one side is compatible with any option of the other. `found_by` says
    /// which end decided (the server decides; the client learns it from the reject).
    #[error("no compatible stack (found by the {found_by}): {}", summary(.mismatches))]
    Incompatible {
        /// The end that compared the offers.
        found_by: End,
        /// The first mismatch of each option pair tried (bounded), most preferred first.
        mismatches: Vec<Mismatch>,
    },
    /// The peer answered with a version this implementation does not speak, or refused ours.
    #[error("negotiation version mismatch: we speak {ours}, the peer {theirs}")]
    Version {
        /// Our version.
        ours: u8,
        /// The peer's version.
        theirs: u8,
    },
    /// The peer refused our message as malformed.
    #[error("the peer refused our hello as malformed: {message}")]
    Refused {
        /// The peer's explanation.
        message: String,
    },
    /// A client's hello could not be parsed (server side).
    #[error("a client's hello was malformed: {message}")]
    BadHello {
        /// What was wrong.
        message: String,
    },
    /// The peer never answered.
    #[error("no answer after {attempts} hellos over {waited:?}")]
    Timeout {
        /// Hellos sent.
        attempts: u32,
        /// Time spent.
        waited: Duration,
    },
    /// No hello arrived on an accepted base connection in time.
    #[error("no hello from the client within {0:?}")]
    NoHello(Duration),
    /// Our offers do not fit one message of the base connection.
    #[error("the hello is {len} bytes, more than the {max} bytes one message may carry")]
    OffersTooLarge {
        /// Encoded size.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// A hello larger than the server takes in one message (its datagram limit). On the
    /// client: the server's REJECT said so (`len` is our hello's size); on the server
    /// (`accept`): such a hello arrived and was refused (`len` as the transport reported it,
    /// 0 if unknown; `hellos_sent` 0).
    #[error(
        "the hello is {len} bytes, more than the {limit} bytes the server takes in one message"
    )]
    HelloTooLarge {
        /// The hello's size in bytes.
        len: usize,
        /// The largest message the server takes, in bytes.
        limit: usize,
        /// Hellos the client had sent when the refusal came (0 on the server).
        hellos_sent: u32,
    },
    /// Our stack has no option that can run on this host.
    #[error("this stack has no option available here: {0}")]
    NoOptions(#[source] chunnel::Error),
    /// The peer sent bytes we could not parse.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// A reconfiguration could not be proposed.
    #[error("cannot propose a switch: {0}")]
    Propose(#[from] crate::multilateral::ProposeError),
    /// An address to connect to or bind did not resolve: a string that is no address, or a
    /// name that resolved to none (the facade's [`connect`](crate::connect),
    /// [`bind`](crate::bind)).
    #[error("cannot resolve the address: {0}")]
    Address(#[source] std::io::Error),
    /// The base connection or a Chunnel failed.
    #[error(transparent)]
    Chunnel(#[from] chunnel::Error),
}

fn summary(m: &[Mismatch]) -> String {
    match m {
        [] => "no options to compare".to_owned(),
        [one] => one.to_string(),
        [first, rest @ ..] => format!(
            "{first}; and {} more option pair(s) that mismatch",
            rest.len()
        ),
    }
}
