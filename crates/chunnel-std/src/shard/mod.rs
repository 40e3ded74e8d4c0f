//! Sharding and load balancing: Chunnels that decide *where* a message goes.
//!
//! A sharded service listens on one **canonical address** and owns `N` **shards**, each with
//! its own socket, its own thread and its own single-threaded runtime ([`ShardServer`]). A
//! message names its shard through a key ([`Keyed`]); the shard is
//! `fnv1a64(key) % N` ([`shard_of`]; FNV-1a, 64 bits, is stable across builds, platforms and
//! processes, which a client that evaluates it needs).
//!
//! Two ways to reach a shard, two branches of a `select`, so negotiation decides per client:
//!
//! * **Server-side sharding** ([`Canonical`] built by [`ShardServer::forward`]): the client
//!   talks only to the canonical address. The canonical connection hands each request to the
//!   right shard's thread through a bounded queue; the shard's reply comes back through a
//!   bounded queue of that connection and leaves from the canonical address. The client needs
//!   no sharding code at all (its branch is [`ViaCanonical`], a pass-through): the capability
//!   is **compositional** `shard = {server}`, one-sided (paper §5.2).
//! * **Client-side sharding ("client push")** ([`ClientShard`] at the client,
//!   [`ShardServer::advertise`] at the server): the client evaluates the function and sends
//!   straight to the shard's own socket; replies come from that socket. Both ends must agree,
//!   so the capability is **exact** (see the scheme below).
//!
//! Requests that reach the canonical address are forwarded in both branches, so a
//! client-push client that also sends there is still served.
//!
//! # The shard-set advertisement
//!
//! The server's client-push option carries the exact capability
//!
//! ```text
//! shard = { "client-push", "hash=fnv1a-64", "shard=0@<addr 0>", ..., "shard=<N-1>@<addr N-1>" }
//! ```
//!
//! with a custom compatibility [`Rule`](chunnel::negotiate::Rule) (the deciding end's rule
//! applies, and it never crosses the wire): a client capability matches if it is
//! `shard = {"client-push", "hash=fnv1a-64"}` — same mode, same hash function, any addresses.
//! A client's [`ClientShard`] carries exactly that. The server's stack, addresses included,
//! reaches the client in the ACCEPT (`chunnel_negotiate::Info::server_stack`);
//! [`ShardDirectory::learn`] finds and parses the capability there. Addresses are opaque
//! strings to this module (the [`Dial`] implementation parses them), indices must be `0..N`
//! each exactly once, `1 <= N <= `[`MAX_SHARDS`].
//!
//! **Why a directory:** the negotiation driver builds the client's stack (`connect_wrap`) before it
//! returns the [`Info`](https://docs.rs/chunnel-negotiate) with the server stack, and a
//! Chunnel is told only which branch of each select was picked, not the server's
//! capabilities. So [`ClientShard`] shares a [`ShardDirectory`] with its creator, who calls
//! `directory.learn(&negotiated.info().server_stack)` once `connect` returns; the connection dials
//! the shards on its first `send` (which fails with
//! [`Error::ShardSetUnknown`](crate::Error::ShardSetUnknown) before that).
//!
//! The shard sockets speak the per-shard stack given to [`ShardServer::spawn`] and
//! [`ClientShard::new`] (typically the same serialization Chunnel as the canonical stack),
//! without negotiation: the client negotiated with the canonical address, and every shard of
//! one server runs the same stack (the paper's §5.3 rule for multi-endpoint Chunnels).
//!
//! # Load balancing
//!
//! [`Balance`] is a base Chunnel over a set of replica connections: messages go to replicas
//! round-robin (message by message) and replies from every replica are merged.
//!
//! # Bounds and failures
//!
//! Every queue is bounded ([`Config`]): a shard's request queue (a full queue makes the
//! canonical connection wait: back-pressure), each connection's reply queue (a reply that does
//! not fit is dropped and counted: the transports below are best effort), the merge queue of
//! client connections, and the number of peers a shard serves at once. A message that does not
//! decode is dropped and counted ([`ShardStats::malformed`]); nothing received from the
//! network can make a shard panic or stop.
//!
//! # Example
//!
//! ```
//! use chunnel::{stack, Chunnel, ChunnelExt, ConnectionExt, Listener as _};
//! use chunnel_net::udp;
//! use chunnel_std::serialize::Serialize;
//! use chunnel_std::shard::{ClientShard, Config, Dial, Keyed, ShardServer};
//!
//! #[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
//! struct Msg { key: String, n: u32 }
//! impl Keyed for Msg {
//!     fn shard_key(&self) -> &[u8] { self.key.as_bytes() }
//! }
//!
//! #[derive(Clone, Debug)]
//! struct Udp;
//! impl Dial for Udp {
//!     type Conn = udp::Connection;
//!     async fn dial(&self, addr: &str) -> Result<udp::Connection, chunnel::Error> {
//!         let a = addr.parse().map_err(|_| chunnel::Error::Malformed { what: "address" })?;
//!         udp::Connect::new(a).connect_wrap(()).await
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel::Error> {
//! // Two shards; each answers with the message plus its index * 100.
//! let mut ser = Serialize::<Msg, _>::bincode();
//! let any = "127.0.0.1:0".parse().unwrap();
//! let shards = ShardServer::spawn(
//!     vec![udp::Bind::new(any), udp::Bind::new(any)],
//!     |l: &udp::Listener| Ok(l.local_addr()?.to_string()), // what clients dial
//!     ser,
//!     |i| move |mut m: Msg| { m.n += 100 * i as u32; Some(m) },
//!     Config::default(),
//! )?;
//!
//! // Server-side sharding: the canonical listener forwards to the shards.
//! let listener = udp::Listener::bind("127.0.0.1:0".parse().unwrap()).await?;
//! let canonical = listener.local_addr()?;
//! let mut server = stack![shards.forward(), ser].serve(listener);
//! tokio::spawn(async move {
//!     while let Ok(c) = server.accept().await {
//!         tokio::spawn(async move { let _ = c.recv_one().await; }); // drives forwarding
//!     }
//! });
//! let via = ser.connect_wrap(udp::Connect::new(canonical).connect_wrap(()).await?).await?;
//! let m = Msg { key: "apple".into(), n: 1 };
//! via.send_one(m.clone()).await?;
//! let from_server = via.recv_one().await?;
//!
//! // Client push: the same answer, straight from the shard.
//! let push = ClientShard::new(Udp, ser);
//! push.directory().set(shards.addrs().to_vec())?;
//! let conn = stack![push, ser]
//!     .connect_wrap(udp::Connect::new(canonical).connect_wrap(()).await?).await?;
//! conn.send_one(m).await?;
//! assert_eq!(conn.recv_one().await?, from_server);
//! # Ok(()) }
//! ```

mod balance;
mod canonical;
mod client;
mod config;
mod directory;
mod merge;
mod server;
#[cfg(test)]
mod tests;

use std::future::Future;

use chunnel::ChunnelConnection;

pub use balance::{Balance, BalanceConn};
pub use canonical::{Canonical, CanonicalConn, ViaCanonical};
pub use client::{ClientShard, ClientShardConn};
pub use config::Config;
pub use directory::{ShardDirectory, advertisement, parse_advertisement};
pub use server::{ShardServer, ShardStats};

/// The capability kind of both sharding modes.
pub const CAPABILITY: &str = "shard";
/// Label of the client-push mode (exact capability).
pub const CLIENT_PUSH: &str = "client-push";
/// Label of the server-side mode (compositional capability).
pub const SERVER_SIDE: &str = "server";
/// Label naming the sharding function: [`fnv1a64`] of the key modulo the shard count.
pub const HASH_LABEL: &str = "hash=fnv1a-64";
/// Prefix of the labels that list shard addresses: `shard=<index>@<address>`.
pub const SHARD_LABEL_PREFIX: &str = "shard=";
/// The most shards one advertisement may list.
pub const MAX_SHARDS: usize = 4096;

/// Negotiation id of the server's canonical sharding Chunnel (both modes).
pub const CANONICAL_ID: &str = "chunnel-std/shard/canonical/1";
/// Negotiation id of the client-push Chunnel.
pub const CLIENT_ID: &str = "chunnel-std/shard/client-push/1";
/// Negotiation id of the client's pass-through branch (server-side sharding).
pub const VIA_ID: &str = "chunnel-std/shard/via-canonical/1";
/// Negotiation id of the load balancer.
pub const BALANCE_ID: &str = "chunnel-std/shard/balance/1";

/// A message that names its shard by a key.
pub trait Keyed {
    /// The bytes the sharding function hashes. Messages that are never routed by key (replies)
    /// may return an empty slice.
    fn shard_key(&self) -> &[u8];
}

/// 64-bit FNV-1a of `bytes` (offset basis `0xcbf29ce484222325`, prime `0x100000001b3`): the
/// documented, stable sharding hash.
pub use chunnel::util::fnv1a64;

/// The shard of `key` among `shards`: `fnv1a64(key) % shards` (0 when `shards` is 0).
pub fn shard_of(key: &[u8], shards: usize) -> usize {
    if shards == 0 {
        return 0;
    }
    (fnv1a64(key) % shards as u64) as usize
}

/// Opens a client's connection to one shard address (as advertised).
pub trait Dial: Clone + Send + Sync + 'static {
    /// The base connection to a shard.
    type Conn: ChunnelConnection + 'static;

    /// Connects to `addr`.
    fn dial(&self, addr: &str) -> impl Future<Output = Result<Self::Conn, chunnel::Error>> + Send;
}
