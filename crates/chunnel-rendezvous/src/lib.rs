//! Multi-party negotiation (paper §5.3): the participants of a group agree on one stack through a
//! rendezvous in a key-value store, instead of with a peer.
//!
//! # Tour
//!
//! * [`Store`] is the rendezvous trait: a handful of atomic operations on a group's record
//!   (the committed stack and its epoch, members under leases, one pending transition and its
//!   ballots). Three backends implement it: [`SqliteStore`] (the embedded default: no server,
//!   shared by the processes of one host), `RedisStore` (feature `redis`: one Lua script per
//!   operation) and `EtcdStore` (feature `etcd`: transactions with compares, a lease per
//!   member). [`conformance::store_semantics`] is what every backend must do.
//! * [`machine::Machine`] is the protocol as a sans-IO state machine (snapshots and time in,
//!   store operations and switches out); [`Participant`] drives it: join by compare-and-swap
//!   (our first option, or our first option compatible with the committed stack, or
//!   [`Error::Incompatible`]), renew the lease, read the group when the store notifies a change
//!   ([`Store::watch`]: an etcd watch, a Redis subscription, SQLite's wake-up within the
//!   host) and by polling as the fallback ([`Config::poll`] without complete notifications,
//!   [`Config::poll_notified`] with them), vote on transitions (compatibility and a
//!   [`Policy`]), commit or abort the ones it proposed, and publish a [`View`] (members,
//!   epoch, store reachability) on every change.
//! * [`ballot`]: direct ballots ([`Config::with_direct_ballots`]). A participant with a UDP
//!   ballot socket names it and a fresh token in the transitions it proposes; members with one
//!   send their ballot there as a datagram (resent until they see the outcome, written to the
//!   store after a fallback delay), members without one vote in the store, and the proposer
//!   commits with [`Store::finish_attested`] once every live member's yes is counted either
//!   way. The store then holds the proposal and the decision, not a write per member.
//! * [`Group`] adds a data plane: a UDP fan-out to every live member, each epoch's stack built
//!   on its own [`EpochBase`], so messages sent around a switch are decoded by the stack that
//!   encoded them. Members keep talking while the store is down.
//!
//! The protocol and the bytes are specified in `docs/wire.md` §15.
//!
//! # What a store holds
//!
//! Members hold leases ([`Config::lease`]); a group's record outlives its last member by a
//! grace period, set per store (`with_grace`, default 60 s on every backend). Once no member
//! of a group has joined or renewed for lease + grace, the group holds nothing in the store,
//! and joining it again creates it afresh (epoch 1). What is left is removed by the store
//! itself where it can, so no client has to survive:
//!
//! | backend | a live group holds | removed by |
//! |---------|--------------------|------------|
//! | [`SqliteStore`] | 1 `chunnel_groups` row, 1 `chunnel_members` row per live member; while a transition is pending, 1 `chunnel_transitions` row and 1 `chunnel_ballots` row per member that voted in the store | the next write to the group (expired members, and the group once it is gone), and a background sweep of the whole file, in batches of [`SqliteStore::SWEEP_BATCH`], that any store handle starts at most every `sweep_every` (default 10 s) when it is used |
//! | `RedisStore` | 3 keys (`meta`, `members`, `addrs`); 5 while a transition is pending (`transition`, `ballots`) | Redis: every write sets the group's keys to expire at the last lease expiry + grace |
//! | `EtcdStore` | `meta`, 1 key per live member; while a transition is pending, `transition` and 1 ballot per member that voted in the store. Leases: 1 per member, 1 for the group | etcd: member keys and ballots are on the member's lease, the group's record on a group lease of lease + grace kept alive by every renewal |
//!
//! A member that stopped renewing is out of every snapshot once its lease ran out; its entry
//! goes with its etcd lease, with the next script on its group in Redis (a live member's
//! renewal is one) and with the next write or sweep in SQLite. So after lease + grace (and, for
//! SQLite, one sweep) a store holds exactly the live groups' entries above; nothing grows with
//! groups or members that are gone. Each backend's module docs give the details
//! (`tests/growth.rs` checks it with 10,000 groups and 2,000 crashed members).
//!
//! # Example
//!
//! Two members of one group, in one process for the example (normally each is its own process
//! or host), agree through an SQLite file. The stack is a `select` between two variants of a
//! small byte layer defined here, whose capability (`xor = {key}`) only matches the same key,
//! so the group must agree on one; the first member's preference becomes the group's stack and
//! a proposal switches every member to the other.
//!
//! ```
//! use std::sync::Arc;
//! use bytes::Bytes;
//! use chunnel::{select, Capability, Chunnel, ChunnelConnection, Handover, Negotiate};
//! use chunnel_rendezvous::{Config, Group, SqliteStore};
//!
//! /// XORs every byte with its key (capability `xor = {key}`, exact match).
//! #[derive(Clone, Copy, Debug)]
//! struct Xor(u8);
//!
//! impl Negotiate for Xor {
//!     fn id(&self) -> &'static str {
//!         "example/xor/1"
//!     }
//!     fn capabilities(&self) -> Vec<Capability> {
//!         vec![Capability::exact("xor", [self.0.to_string()])]
//!     }
//! }
//!
//! impl<C: ChunnelConnection<Data = Bytes> + Send> Chunnel<C> for Xor {
//!     type Connection = XorConn<C>;
//!     async fn connect_wrap(&mut self, inner: C) -> Result<XorConn<C>, chunnel::Error> {
//!         Ok(XorConn(inner, self.0))
//!     }
//! }
//!
//! struct XorConn<C>(C, u8);
//!
//! impl<C: ChunnelConnection<Data = Bytes>> ChunnelConnection for XorConn<C> {
//!     type Data = Bytes;
//!     async fn send<B>(&self, burst: B) -> Result<(), chunnel::Error>
//!     where
//!         B: IntoIterator<Item = Bytes> + Send,
//!         B::IntoIter: Send,
//!     {
//!         let key = self.1;
//!         let burst: Vec<Bytes> =
//!             burst.into_iter().map(|m| m.iter().map(|b| b ^ key).collect()).collect();
//!         self.0.send(burst).await
//!     }
//!     async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, chunnel::Error> {
//!         let n = self.0.recv(slots).await?;
//!         for m in slots[..n].iter_mut().flatten() {
//!             *m = m.iter().map(|b| b ^ self.1).collect();
//!         }
//!         Ok(n)
//!     }
//! }
//!
//! /// Nothing to hand over on a switch: the key is the whole state.
//! impl<C: ChunnelConnection<Data = Bytes>> Handover for XorConn<C> {
//!     fn export(&self, _: &mut chunnel::Handoff<Bytes>) {}
//!     fn import(&self, _: &mut chunnel::Handoff<Bytes>) {}
//! }
//!
//! # fn main() -> Result<(), chunnel_rendezvous::Error> {
//! # let dir = std::env::temp_dir().join(format!("chunnel-rdv-doc-{}", std::process::id()));
//! # std::fs::create_dir_all(&dir)?;
//! # let path = dir.join("groups.sqlite");
//! tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
//!     let store = Arc::new(SqliteStore::open(&path)?); // or RedisStore, EtcdStore
//!     let any_port = "127.0.0.1:0".parse().unwrap();
//!     // The first member prefers xor=1 and accepts xor=2: its preference becomes the stack.
//!     let a = Group::join(store.clone(), "orders", "a", any_port,
//!                         select(Xor(1), Xor(2)), None, Config::default()).await?;
//!     // The second prefers xor=2 but takes xor=1, the committed stack, which it can build.
//!     let b = Group::join(store, "orders", "b", any_port,
//!                         select(Xor(2), Xor(1)), None, Config::default()).await?;
//!     assert_eq!(b.participant().view().option, 1);
//!     // Wait until `a` has read that `b` joined (at once: the store wakes it).
//!     let mut view = a.participant().watch();
//!     while view.borrow_and_update().members.len() < 2 {
//!         view.changed().await.map_err(|_| chunnel_rendezvous::Error::Closed)?;
//!     }
//!     a.send([Bytes::from_static(b"to every other member")]).await?;
//!     assert_eq!(&b.recv().await?[..], b"to every other member");
//!     // Switch the whole group to a's second option (xor=2); every live member must vote yes.
//!     a.propose(1).await?;
//!     println!("{} members at epoch {}", a.participant().view().members.len(),
//!              a.participant().view().epoch);
//!     a.leave().await?;
//!     b.leave().await
//! })
//! # .and_then(|()| Ok(std::fs::remove_dir_all(&dir)?))
//! # }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod ballot;
#[doc(hidden)]
pub mod conformance;
mod error;
#[cfg(feature = "etcd")]
mod etcd;
pub mod machine;
mod participant;
pub mod plane;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "sqlite")]
mod sqlite;
pub mod store;

pub use crate::error::Error;
#[cfg(feature = "etcd")]
pub use crate::etcd::EtcdStore;
pub use crate::machine::Policy;
pub use crate::participant::{Config, DirectBallots, Participant, View};
pub use crate::plane::{EpochBase, Group};
#[cfg(feature = "redis")]
pub use crate::redis::RedisStore;
#[cfg(feature = "sqlite")]
pub use crate::sqlite::SqliteStore;
#[cfg(feature = "sqlite")]
pub use crate::sqlite::wake as sqlite_wake;
pub use crate::store::{
    Ballot, Changes, Committed, JoinReply, Member, News, Notifier, Outcome, Snapshot, Store,
    Transition, Watch,
};
