//! # chunnel-ctl: the control endpoint of a Chunnel process
//!
//! A process opts in to being seen and steered from outside (by `chunnelctl`, or anything
//! speaking the protocol) by binding an [`Endpoint`]: a Unix stream socket at a path from its
//! configuration or from the `CHUNNEL_CONTROL` environment variable ([`Endpoint::from_env`]),
//! never a network port. What it shows is what the application puts in a [`Registry`]:
//!
//! * **entries**: live connections and listeners ([`Entry`]), each with an id, a name, the
//!   peer, the picked stack and negotiation outcome ([`Negotiation`], from
//!   `chunnel-negotiate`'s `Info`), per-layer counters ([`Counters`], a plain trait the
//!   application implements) and an optional switch handle ([`Switch`];
//!   [`ReconfigSwitch`] for a reconfigurable select's connection, unilateral or by two-phase
//!   commit with the peer). [`Registry::register`] returns a [`Guard`]: the entry is listed
//!   until the guard (kept with the connection) is dropped;
//! * **policies**: named values with a validator ([`Registry::policy`]); the endpoint reads
//!   and sets them, the application reads them through its [`Policy`];
//! * an optional **autopilot** ([`autopilot::Autopilot`]): rules, themselves policies, that
//!   switch entries by the rate of one of their counters, with hysteresis; its decision log
//!   is served by the endpoint (the `autopilot` request).
//!
//! ```text
//!  chunnelctl ──JSON lines──> /run/user/1000/app.ctl ──> Endpoint ──> Registry <── the app
//!              (proto.rs)      (mode 0600, SO_PEERCRED)    (tasks)     entries, policies
//! ```
//!
//! ## Access
//!
//! The socket is created with mode 0600 in a directory that must belong to the process's
//! user ([`Error::Insecure`] otherwise); every accepted peer is checked with `SO_PEERCRED`:
//! only the same uid, or root, is served; anyone else gets a `permission-denied` answer and
//! is disconnected.
//!
//! ## Protocol
//!
//! One JSON object per line, versioned (`"v": 1`), one request -> one response; `watch`
//! streams snapshots. Requests are at most [`proto::MAX_REQUEST`] bytes; a malformed one gets
//! an error response and the session goes on. At most [`Config::max_clients`] sessions run at
//! once. The wire format is docs/wire.md §17 and [`proto`].
//!
//! ## Example
//!
//! ```
//! use chunnel_ctl::{Client, Config, Endpoint, Entry, LayerCounters, Registry};
//! use chunnel_ctl::proto::{Op, Reply};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel_ctl::Error> {
//! # let dir = std::env::temp_dir().join(format!("chunnel-ctl-doc-{}", std::process::id()));
//! # std::fs::create_dir_all(&dir).unwrap();
//! let registry = Registry::new("my-app");
//! let endpoint = Endpoint::bind(Config::new(dir.join("app.ctl")), registry.clone())?;
//! let _guard = registry.register(
//!     Entry::connection("to-server")
//!         .with_peer("127.0.0.1:7000")
//!         .with_stack(["serialize", "udp"])
//!         .with_counters(|| vec![LayerCounters::new("app", [("sent", 42)])]),
//! );
//! let mut client = Client::connect(endpoint.path()).await?;
//! let Reply::Ls { entries, .. } = client.request(&Op::Ls).await? else { unreachable!() };
//! assert_eq!(entries[0].name, "to-server");
//! assert_eq!(entries[0].counters[0].counters[0].value, 42);
//! # drop(endpoint); std::fs::remove_dir_all(&dir).unwrap();
//! # Ok(()) }
//! ```
//!
//! ## Cancel safety
//!
//! [`Client`]'s methods are not cancel safe (a cancelled call may leave half a line read or
//! written); drop the client after cancelling one.
#![warn(missing_docs, missing_debug_implementations, rust_2018_idioms)]

pub mod autopilot;
mod client;
mod endpoint;
mod error;
pub mod proto;
mod reconfig;
mod registry;

pub use client::Client;
pub use endpoint::{Config, ENV, Endpoint};
pub use error::Error;
pub use proto::{Counter, EntryView, LayerCounters, Negotiation};
pub use reconfig::ReconfigSwitch;
pub use registry::{BoxFuture, Counters, Entry, Guard, Mode, Policy, Registry, Switch, Switched};
