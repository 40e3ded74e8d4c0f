//! # chunnel: composable, negotiable, reconfigurable network stacks
//!
//! A **Chunnel** is one communication function — a datapath (a UDP socket), a transform
//! (serialization, TLS) or routing (sharding). Chunnels compose into **stacks** checked by the
//! compiler, a **select** offers alternatives in one layer, and peers **negotiate** which
//! concrete stack to use. This crate is the core: the traits, stacks, selects and the
//! negotiation metadata. Datapaths live in `chunnel-net`.
//!
//! ```text
//!   application  ── Data = T ──────────────────────────────┐
//!   ┌──────────────────────────────┐                       │  stack![ser, select(a, b), udp]
//!   │ ser     : Chunnel<C2>        │  C3: Data = T          │
//!   ├──────────────┬───────────────┤                       │  connect_wrap is called
//!   │ a            │ b   (select)  │  C2 = Either<A, B>     │  bottom-up: udp first,
//!   ├──────────────┴───────────────┤                       │  then the select, then ser
//!   │ udp     : Chunnel<()>        │  C1: Data = Bytes      │
//!   └──────────────────────────────┘                       │
//!   wire ─────────────────────────────────────────────────-┘
//! ```
//!
//! ## A short tour
//!
//! * [`ChunnelConnection`]: batched async `send(burst)` / `recv(&mut slots) -> n` of a typed
//!   [`ChunnelConnection::Data`].
//! * [`Chunnel<I>`]: `connect_wrap(inner: I) -> Connection`. Base datapaths implement
//!   `Chunnel<()>`; their bind configs implement [`Listen`], whose `listen` returns the
//!   server side of the datapath, a [`Listener`].
//! * [`stack!`] builds a [`Stack`]; [`select`] builds a [`Select`] whose connection (or, for
//!   a select of bind configs, listener) is an [`Either`]. [`Identity`] is no layer;
//!   [`Noop`] is a layer that does nothing but is real.
//! * [`Negotiate`] (per Chunnel: id, [`Capability`]s, availability) and [`Offers`]
//!   (per tree: the flattened [`StackOption`]s and applying a [`Pick`]).
//! * [`Select::reconfigurable`] makes a select switchable at run time: its
//!   [`ReconfigHandle`] moves live connections to the other branch (mechanism [`Lock`] or
//!   [`LockFree`]), handing state over through [`Handover`].
//! * [`ChunnelExt::boxed`] erases a stack's type behind [`BoxChunnel`]/[`BoxConnection`].
//! * [`Payload`], [`LendBuffer`], [`Emit`], [`LendRecv`] and [`LendStats`]: how datapaths lend
//!   their own buffers.
//!
//! ## Example
//!
//! ```
//! use chunnel::{select, stack, Chunnel, ConnectionExt, Identity, Noop, Offers};
//! # use chunnel::{ChunnelConnection, Error};
//! # use std::future::Future;
//! # struct Echo;
//! # struct EchoConn(std::sync::Mutex<Vec<u32>>);
//! # impl chunnel::Negotiate for Echo { fn id(&self) -> &'static str { "doc/echo/1" } }
//! # impl Chunnel<()> for Echo {
//! #     type Connection = EchoConn;
//! #     async fn connect_wrap(&mut self, _: ()) -> Result<EchoConn, Error> {
//! #         Ok(EchoConn(Default::default()))
//! #     }
//! # }
//! # impl ChunnelConnection for EchoConn {
//! #     type Data = u32;
//! #     async fn send<B>(&self, burst: B) -> Result<(), Error>
//! #     where B: IntoIterator<Item = u32> + Send, B::IntoIter: Send {
//! #         self.0.lock().unwrap().extend(burst); Ok(())
//! #     }
//! #     async fn recv<'a>(&'a self, slots: &'a mut [Option<u32>]) -> Result<usize, Error> {
//! #         let mut q = self.0.lock().unwrap();
//! #         let n = q.len().min(slots.len());
//! #         for (s, m) in slots.iter_mut().zip(q.drain(..n)) { *s = Some(m); }
//! #         Ok(n)
//! #     }
//! # }
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Error> {
//! // `Echo` is a base datapath (a `Chunnel<()>`) carrying `u32`s.
//! let mut stack = stack![Noop, select(Noop, Identity), Echo];
//! assert_eq!(stack.offers().len(), 2); // two concrete stacks to negotiate between
//! let conn = stack.connect_wrap(()).await?;
//! conn.send([1, 2, 3]).await?;
//! let mut slots = [None, None, None];
//! let n = conn.recv(&mut slots).await?;
//! assert_eq!(&slots[..n], &[Some(1), Some(2), Some(3)]);
//! # Ok(()) }
//! ```
//!
//! ## Cancel safety
//!
//! `recv` is cancel safe in every connection of this crate and must be in every datapath;
//! see [`ChunnelConnection`].
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

mod boxed;
mod chunnel;
mod connection;
mod error;
mod ext;
mod layer;
pub mod negotiate;
mod noop;
mod side;
pub use crate::negotiate::offer_tree;
mod payload;
mod reconfig;
mod select;
mod stack;
pub mod util;

pub use crate::boxed::{BoxChunnel, BoxConnection};
pub use crate::chunnel::{Chunnel, Listen, Listener};
pub use crate::connection::{ChunnelConnection, ConnectionExt, Oversized, PeerHandoff, SendHeader};
pub use crate::error::{BoxError, Error};
pub use crate::ext::{ChunnelExt, Serve};
pub use crate::layer::{Layer, LayerConnection, LayerState, Layered, OnSend};
pub use crate::negotiate::{
    Capability, ChunnelInfo, End, Match, Mismatch, Negotiate, Offers, Pick, StackOption,
};
pub use crate::noop::{Identity, Noop, NoopConnection};
pub use crate::offer_tree::OfferTree;
pub use crate::payload::{Emit, LendBuffer, LendRecv, LendStats, Payload};
pub use crate::reconfig::{
    Handoff, Handover, Lock, LockFree, Mechanism, PreparedSwitch, ReconfigConnection,
    ReconfigHandle, Reconfigurable, Shared,
};
#[cfg(chunnel_loom)]
#[doc(hidden)]
pub use crate::reconfig::{PlantedBug, plant_bug};
pub use crate::select::{Either, EitherFuture, Select, Side, select};
pub use crate::stack::Stack;
