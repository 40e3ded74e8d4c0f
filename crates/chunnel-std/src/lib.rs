//! # chunnel-std: the standard Chunnels
//!
//! * [`serialize`]: typed messages over byte connections, in two formats with different
//!   trade-offs (compact `bincode`, self-describing JSON); exact-match capabilities, so
//!   negotiation never pairs two formats.
//! * [`reliable`] and [`ordered`]: acknowledgement and retransmission with an adaptive
//!   timeout and a bounded window, and in-order delivery, over a best-effort datagram base;
//!   usable apart or together. The protocol logic is sans-IO.
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
pub mod serialize;
pub mod shard;

pub use crate::error::Error;
