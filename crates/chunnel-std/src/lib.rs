//! # chunnel-std: the standard Chunnels
//!
//! * [`serialize`]: typed messages over byte connections, in two formats with different
//!   trade-offs (compact `bincode`, self-describing JSON); exact-match capabilities, so
//!   negotiation never pairs two formats.
//! * [`reliable`] and [`ordered`]: acknowledgement and retransmission with an adaptive
//!   timeout and a bounded window, and in-order delivery, over a best-effort datagram base;
//!   usable apart or together. The protocol logic is sans-IO.
//! * [`sched`]: a packet scheduler on the send path (FIFO, strict priority between classes,
//!   a time-aware shaper in the style of IEEE 802.1Qbv), batching what is queued into bursts.
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

mod error;
pub mod ordered;
pub mod reliable;
pub mod sched;
pub mod serialize;
pub mod shard;

pub use crate::error::Error;
