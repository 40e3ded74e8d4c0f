//! # chunnel-discovery: which implementation, chosen at run time
//!
//! The Bertha discovery service (HotNets paper §4.2) and INSANE's QoS hints (thesis
//! §6.3.2) for chunnel stacks.
//!
//! * A [`Registry`] holds [`Implementation`]s of named functions (`"reliable"`,
//!   `"datapath"`, `"secure"`...), each with a priority, a [`Scope`], an [`Endpoints`]
//!   constraint, the [`Resource`]s it needs, a Chunnel factory and set-up / tear-down hooks.
//! * An operator [`Policy`] ranks them (priority overrides, forbidden implementations, scope
//!   preference) and maps [`Hint`]s to datapaths; it can be replaced at run time
//!   ([`Registry::set_policy`]).
//! * [`Registry::select`] builds the usable implementations of a function, in policy order,
//!   into one Chunnel, a [`Selection`]: nested `select`s of their `BoxChunnel`s, so it
//!   negotiates like any select. [`Selection::candidates`] says why each skipped candidate
//!   was skipped ([`Skip`]: forbidden, a missing resource, unavailable).
//! * [`Registry::for_hint`] does the same for a [`Hint`], in the order the policy maps it
//!   to, and warns (`tracing::warn!`) and reports ([`QosReport`]) what it fell back from.
//!   [`datapaths`] registers this workspace's datapaths; see [`qos`] for the mapping.
//!
//! ```text
//!  Registry ── Policy (ranks, forbids, maps hints)
//!     │ select("reliable")                       offer_tree():
//!     ▼                                          Select(fast's tree,
//!  Selection = select(fast, select(mid, slow))     Select(mid's tree, slow's tree))
//!     │  each leaf: BoxChunnel + resources re-checked + hooks (set-up on first use,
//!     ▼              tear-down when its last connection drops)
//!  negotiated with the peer like any select: the first option both ends can run wins
//! ```
//!
//! ## Example
//!
//! ```
//! use chunnel::{BoxConnection, ChunnelExt, Noop, Offers, OfferTree};
//! use chunnel_discovery::{Implementation, Policy, Registry, Resource, Scope};
//! # fn main() -> Result<(), chunnel_discovery::Error> {
//! let reg = Registry::<BoxConnection<u8>, u8>::new();
//! reg.register(Implementation::new("sw", "reliable", || Noop.boxed()))?;
//! reg.register(
//!     Implementation::new("offload", "reliable", || Noop.boxed())
//!         .with_priority(10)
//!         .with_scope(Scope::Host)
//!         .requires(Resource::custom("a SmartNIC", || Err("none found".into()))),
//! )?;
//! let sel = reg.select("reliable")?;
//! assert_eq!(sel.names(), ["sw"]); // the offload misses its resource
//! assert_eq!(
//!     sel.candidates()[0].to_string(),
//!     "offload skipped: missing resource a SmartNIC: none found"
//! );
//! // An operator can forbid or re-rank at run time; the next select follows.
//! reg.set_policy(Policy::default().with_priority("sw", -1));
//! assert!(matches!(reg.select("reliable")?.offer_tree(), OfferTree::Leaf(_)));
//! # Ok(()) }
//! ```
//!
//! The policy is a plain value: a control endpoint (chunnel-ctl's policy values) could
//! carry it as JSON and call [`Registry::set_policy`]; this crate does not do that itself.
//!
//! ## Feature flags
//!
//! * `shm`: registers chunnel-shm's `LocalFastPath` as the `shm` datapath.
//! * `uring`: the `io-uring` datapath's availability is chunnel-uring's probe (and its
//!   config's forced unavailability); without it, `io-uring` is reported missing.
//!
//! ## Cancel safety
//!
//! A [`Selection`]'s connection is the picked implementation's, boxed: as cancel safe as
//! it is. Building a connection runs a set-up hook synchronously; a cancelled build after
//! the hook drops its live count (running the tear-down hook if it was the only one).
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

mod candidate;
pub mod datapaths;
mod error;
mod policy;
pub mod qos;
mod registry;
mod resource;
mod selection;

pub use crate::candidate::{Candidate, Skip};
pub use crate::error::Error;
pub use crate::policy::{Endpoints, Hint, Policy, Scope};
pub use crate::qos::{Missing, QosPlan, QosReport};
pub use crate::registry::{Implementation, Placement, Registry, Usage};
pub use crate::resource::Resource;
pub use crate::selection::Selection;
