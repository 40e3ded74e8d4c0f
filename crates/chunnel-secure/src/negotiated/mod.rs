//! QUIC, TLS over TCP or plaintext, negotiated — and bound so that an on-path attacker
//! cannot downgrade the choice.
//!
//! A [`Server`] listens for negotiation on one UDP address (chunnel-negotiate's HELLO and
//! ACCEPT) and runs one endpoint per transport it offers: QUIC ([`crate::quic`], stream
//! mode), TLS 1.3 over TCP ([`crate::tls`]) and plaintext length-framed TCP
//! (`chunnel_net::tcp`). It offers them in its preference order; each option's capability
//! `endpoint` carries the endpoint's address (as the sharding advertisement carries shard
//! addresses), so the ACCEPT tells the client where the picked datapath listens. A
//! [`Client`] offers any subset of the three in its own order, negotiates, and connects to
//! the picked endpoint; both ends return a [`Connection`] (an enum over the three datapaths,
//! `ChunnelConnection<Data = Bytes>`). The server's preference decides; a client with no
//! option in common gets chunnel-negotiate's `Incompatible` error (inside
//! [`Error::Negotiation`]).
//!
//! ## Downgrade protection (docs/wire.md §16)
//!
//! The HELLO and ACCEPT cross the network unprotected, so an on-path attacker could strip
//! the secure offers from the hello or change the pick in the accept. Before either end hands
//! a connection to its application, they compare the negotiation **transcript** (the HELLO
//! and ACCEPT exactly as each end sent or received them, [`chunnel_negotiate::Transcript`])
//! on the picked datapath: the client's first message (BIND) carries the connection id and
//! its transcript hash, the server's answer (BOUND) its own view of both messages.
//!
//! * On a secure pick (QUIC, TLS) the exchange runs inside the authenticated channel: an
//!   attacker can neither read nor change it.
//! * On a plaintext pick, a client that offered a secure option requires the server's
//!   answer to be signed with the server's certificate key (the same identity as its TLS
//!   and QUIC endpoints): the BOUND carries the certificate chain, checked against the
//!   client's trust roots and server name, and a signature over the server's transcript
//!   hash. A server that offers plaintext to such clients therefore needs an identity.
//!
//! Any difference fails the connection at both ends with [`Error::Downgrade`], which names
//! what differs ([`Tampered`]); a missing or bad signature is [`Tampered::Unverified`].
//! Neither end hands the connection to its application before the check has passed. On
//! plaintext no application byte is sent before it either; on a secure pick
//! [`Client::connect_with`] sends the application's first messages right behind the BIND,
//! encrypted to the authenticated server, which delivers them only once the BIND checks out
//! (saving the BIND's round trip). [`Policy::SecureOnly`]
//! refuses plaintext outright ([`Error::PlaintextRefused`]): it is never offered, and an
//! accept that names it is refused before any connection is made.
//!
//! ## Reconnects without a negotiation round trip (docs/wire.md §16.5)
//!
//! A [`Client`] remembers, per negotiation address (at most [`REMEMBERED_SERVERS`] by
//! default, [`ClientBuilder::remember`]), the last secure pick it verified: transport,
//! endpoint and hello. The next connect sends no HELLO: it goes straight to that endpoint,
//! authenticated by the certificate as before, and sends a REBIND carrying the remembered
//! hello (with the first messages of [`Client::connect_with`] behind it). The server decides
//! that hello afresh and agrees only if it would pick this very transport now; otherwise it
//! drops what followed and tells the client to negotiate afresh, which it does, re-sending
//! its first messages. Plaintext picks are never remembered.
//!
//! ```
//! use chunnel::ConnectionExt;
//! use chunnel_secure::negotiated::{Client, Server, Transport};
//! use chunnel_secure::{Identity, TrustRoots};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cert = rcgen::generate_simple_self_signed(["localhost".to_string()])?;
//! let identity = Identity::from_pem(cert.cert.pem().as_bytes(), cert.signing_key.serialize_pem().as_bytes())?;
//! let roots = TrustRoots::from_pem(cert.cert.pem().as_bytes())?;
//!
//! // The server prefers TLS over QUIC; the client QUIC over TLS: the server decides.
//! let mut server = Server::builder([Transport::Tls, Transport::Quic])
//!     .identity(identity)
//!     .bind("127.0.0.1:0".parse()?)
//!     .await?;
//! let client = Client::builder([Transport::Quic, Transport::Tls])
//!     .trust(roots, "localhost")
//!     .build()?;
//! let addr = server.local_addr();
//! let (c, s) = tokio::join!(client.connect(addr), server.accept());
//! let (c, s) = (c?, s??);
//! assert_eq!(c.transport(), Transport::Tls);
//! c.send_one("hi".into()).await?;
//! assert_eq!(s.recv_one().await?, "hi");
//! # Ok(()) }
//! ```
//!
//! [`Error::Negotiation`]: crate::Error::Negotiation
//! [`Error::Downgrade`]: crate::Error::Downgrade
//! [`Error::PlaintextRefused`]: crate::Error::PlaintextRefused

mod bind;
mod client;
mod connection;
mod option;
mod server;

pub use bind::{Tampered, fuzz_decode};
pub use client::{Client, ClientBuilder, Policy, REMEMBERED_SERVERS};
pub use connection::{BOUND_DELAY, Connection, Link};
pub use option::{CAPABILITY, Choice, Option3};
pub use server::{BIND_TIMEOUT, Server, ServerBuilder};

/// One of the three datapaths a negotiated connection can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// QUIC v1, one reliable ordered stream ([`crate::quic::Mode::Stream`]).
    Quic,
    /// TLS 1.3 over TCP ([`crate::tls`]).
    Tls,
    /// Plaintext length-framed TCP (`chunnel_net::tcp`): no encryption.
    Plain,
}

impl Transport {
    /// The negotiation id of this transport's option.
    pub fn id(self) -> &'static str {
        match self {
            Transport::Quic => "chunnel/endpoint-quic/1",
            Transport::Tls => "chunnel/endpoint-tls/1",
            Transport::Plain => "chunnel/endpoint-plain/1",
        }
    }

    /// The first label of the option's `endpoint` capability.
    pub fn label(self) -> &'static str {
        match self {
            Transport::Quic => "quic",
            Transport::Tls => "tls",
            Transport::Plain => "plain",
        }
    }

    /// Whether the datapath encrypts and authenticates the server.
    pub fn is_secure(self) -> bool {
        !matches!(self, Transport::Plain)
    }

    /// The transport whose option id is `id`.
    pub fn from_id(id: &str) -> Option<Transport> {
        [Transport::Quic, Transport::Tls, Transport::Plain]
            .into_iter()
            .find(|t| t.id() == id)
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}
