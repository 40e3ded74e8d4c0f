//! Multi-party negotiation (paper §5.3): the participants of a group agree on one stack through a
//! rendezvous in a key-value store, instead of with a peer.
//!
//! * [`Store`] is the rendezvous trait: a handful of atomic operations on a group's record
//!   (the committed stack and its epoch, members under leases, one pending transition and its
//!   ballots). Three backends implement it: [`SqliteStore`] (the embedded default, no server,
//!   shared by the processes of one host), `RedisStore` (feature `redis`) and `EtcdStore`
//!   (feature `etcd`).
#![warn(missing_docs)]

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
pub use crate::participant::{Config, Participant, View};
pub use crate::plane::{EpochBase, Group};
#[cfg(feature = "redis")]
pub use crate::redis::RedisStore;
#[cfg(feature = "sqlite")]
pub use crate::sqlite::SqliteStore;
pub use crate::store::{
    Ballot, Committed, JoinReply, Member, Outcome, Snapshot, Store, Transition,
};
