//! # chunnel-negotiate: peers agree on one stack when they connect
//!
//! A client offers every concrete stack its `select`s allow, in preference order, with each
//! Chunnel's capabilities; the server picks the first compatible pair by its own preference
//! (exact-match capabilities present and equal at both ends, compositional ones at either
//! end — paper §5.2) and answers with the pick; both build the picked stack with
//! `connect_wrap`. One request, one response: **1 RTT**. A client that remembers the pick
//! for a server builds it at once and sends its first messages inside the hello: **0 RTT**
//! (the server accepts them, or refuses and names another stack, and the client re-sends on
//! it; nothing is lost or delivered twice).
//!
//! ## A short tour
//!
//! * [`connect`] and [`bind`]: the short way in, negotiated connections over kernel UDP from
//!   an address and a stack ([`Connector`] adds a [`Config`] and 0-RTT; [`Server::accept`]
//!   yields the server's connections). [`Conn`] and [`ServerConn`] name their connections by
//!   the stack alone; [`NegotiatedConn`] is the one bound a helper generic over negotiated
//!   connections needs.
//! * [`wire`]: the wire messages, their encoders and decoders (`docs/wire.md` specifies them).
//! * [`proto`]: the protocol as sans-IO state machines ([`proto::Server`],
//!   [`proto::ClientHandshake`]); deterministic to test, no sockets or clocks inside.
//! * [`control`]: what an established connection does with each inbound message
//!   ([`control::classify`], a pure function).
//! * [`commit`]: multilateral reconfiguration, a two-phase commit whose machine
//!   ([`commit::Multilateral`]) is sans-IO and whose [`commit::Coordinator`] drives it.
//! * [`Client::connect`], [`Client::connect_0rtt`] and [`listen`]: thin tokio drivers over any
//!   base connection that implements [`chunnel::SendHeader`] (every `chunnel-net` datapath).
//! * [`Tagged`]: the connection the picked stack is built on; one tag byte per message, sent
//!   without copying the payload.
//!
//! ## Layers
//!
//! Modules import only from the layers below them (`scripts/module-cycles.py` checks that the
//! graph has no cycle):
//!
//! 1. [`wire`]: codecs (`wire/decode.rs` holds the decoders), no other module of the crate.
//! 2. Sans-IO cores, no sockets, tasks or clocks: `multilateral` (the two-phase-commit machine,
//!    re-exported by [`commit`]; it is given `now`), `error`, [`proto`] (handshakes; the
//!    client's in `proto/client.rs`), [`control`] (inbound classification).
//! 3. `plane`: the type-erased control plane of a connection ([`Tagged`] implements it, the
//!    coordinator uses it, so neither depends on the other) and the injected
//!    [`commit::Clock`].
//! 4. I/O: [`Tagged`] (moves bytes, applies [`control::classify`]), then the drivers
//!    (`driver.rs`: [`Config`], [`Negotiated`], [`Client`]; `driver/server.rs`: [`listen`]),
//!    then [`commit::Coordinator`] on top of them.
//! 5. The facade (`facade.rs`: [`connect`], [`bind`]), over the drivers and `chunnel-net`'s
//!    UDP.
//!
//! ## Example
//!
//! ```
//! use chunnel::{select, stack, ChunnelConnection, ConnectionExt, Noop, Identity, Chunnel};
//! use chunnel_negotiate::{listen, Client, Config};
//! use chunnel_net::udp;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> anyhow::Result<()> {
//! let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
//! let addr = listener.local_addr()?;
//! // The server offers only the plain stack; the client prefers Noop but can do without.
//! let mut server = listen(Identity, listener, Config::default());
//! tokio::spawn(async move {
//!     while let Ok(conn) = server.accept().await {
//!         tokio::spawn(async move {
//!             while let Ok(m) = conn.recv_one().await {
//!                 let _ = conn.send_one(m).await;
//!             }
//!         });
//!     }
//! });
//!
//! let client = Client::new(Config::default());
//! let base = udp::Connect::new(addr).connect_wrap(()).await?;
//! let conn = client.connect(&addr.to_string(), select(Noop, Identity), base).await?;
//! conn.send_one("hi".into()).await?;
//! assert_eq!(conn.recv_one().await?, "hi");
//! assert_eq!(conn.info().client_pick.branches(), &[0]); // Noop is one-sided: it fits
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

pub mod commit;
pub mod control;
mod driver;
mod error;
mod facade;
mod multilateral;
mod obs;
mod plane;
pub mod proto;
mod tagged;
mod ticker;
pub mod wire;

pub use crate::driver::{
    CROWDED_HELLO_WAIT, Client, Config, DynLayer, Info, Negotiated, NegotiatedListener, Registry,
    Serving, Transcript, concurrent_searches, listen, listen_with,
};
pub use crate::error::Error;
pub use crate::facade::{
    Conn, Connector, NegotiatedConn, Server, ServerConn, bind, bind_with, connect,
};
pub use crate::tagged::Tagged;
pub use crate::wire::ZeroRtt;

/// The repository README's examples, compiled and run as doctests of this crate (its
/// dev-dependencies cover every crate they use; `tests/readme.rs` checks none is skipped).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
