//! Metrics and traces for chunnel stacks.
//!
//! ```text
//!  application
//!      │
//!  Layered(Metered::new("kv").layer("udp"))   counts messages and bytes per direction
//!      │                                      -> snapshot()     (in-process, atomics)
//!  udp::Connect / a listener's connection     -> `metrics` facade -> a recorder, e.g.
//!      │                                         prometheus::Exporter (HTTP scrape)
//!  kernel socket
//! ```
//!
//! A short tour:
//! * [`Metered`] is a [`chunnel::Layer`]: put `Layered(Metered::new(stack))` anywhere in a stack,
//!   on either end. Each connection registers its counters once when it is built
//!   (`chunnel_messages_total`, `chunnel_bytes_total`, labels `stack`, `layer`, `direction`,
//!   `conn`), then counts each message with relaxed atomics, without allocating. Negotiation
//!   does not see it: it offers nothing.
//! * [`snapshot()`] reads the counters of every live metered connection in the process, with
//!   or without a recorder (for a control endpoint, a test, a log line).
//! * [`reconfigure`] switches a reconfigurable select like
//!   [`ReconfigHandle::reconfigure`](chunnel::ReconfigHandle::reconfigure) and records the
//!   switch, its pause and a `tracing` span per phase.
//! * [`names`] lists the metric names, including those the other crates record under their
//!   own `metrics` features (negotiation outcomes and handshake time in chunnel-negotiate,
//!   retransmissions in chunnel-std, drops and evictions in chunnel-net).
//! * `prometheus` (module, feature `prometheus`): a Prometheus recorder and a scrape endpoint on an
//!   address you choose (`Exporter::install(addr)`, or `Exporter::install_from_env()` reading
//!   `CHUNNEL_METRICS_ADDR`); nothing listens unless you start it.
//!
//! Without a recorder installed the `metrics` handles do nothing and the snapshots still
//! count. `chunnel-bench overhead` measures the layer without and with a recorder.
//!
//! ## Feature flags
//! * `prometheus` (off): the module `prometheus` (`Exporter`, `recorder`).
//!
//! ## Example
//!
//! ```
//! use chunnel::{stack, Chunnel, ChunnelExt, ConnectionExt, Layered, Listener};
//! use chunnel_metrics::Metered;
//! use chunnel_net::udp;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
//! let addr = listener.local_addr()?;
//! let mut server = Layered(Metered::new("doc-echo").layer("udp")).serve(listener);
//!
//! let mut client = stack![Layered(Metered::new("doc-client").layer("udp")), udp::Connect::new(addr)];
//! let conn = client.connect_wrap(()).await?;
//! conn.send_one(bytes::Bytes::from_static(b"ping")).await?;
//! let srv = server.accept().await?;
//! let m = srv.recv_one().await?;
//! srv.send_one(m).await?;
//! assert_eq!(&conn.recv_one().await?[..], b"ping");
//!
//! let snap = chunnel_metrics::snapshot();
//! let client = snap.iter().find(|c| &*c.stack == "doc-client").unwrap();
//! assert_eq!((client.sent_msgs, client.sent_bytes, client.recv_msgs), (1, 4, 1));
//! # Ok(()) }
//! ```
//!
//! ## Cancel safety
//!
//! A [`Metered`] connection is the core's `LayerConnection`: its `recv` is cancel safe when
//! the connection below is, and a received batch is counted once it is returned.
//! [`reconfigure`] has the cancel safety of `ReconfigHandle::reconfigure`.
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

mod error;
mod metered;
pub mod names;
#[cfg(feature = "prometheus")]
pub mod prometheus;
mod snapshot;
mod switch;

/// The `metrics` facade this crate records through (the crates with a `metrics` feature record
/// through this re-export, so the workspace has one version).
pub use metrics;

pub use crate::error::Error;
pub use crate::metered::{Measure, Metered, MeteredState};
pub use crate::snapshot::{ConnSnapshot, ConnStats, snapshot};
pub use crate::switch::reconfigure;
