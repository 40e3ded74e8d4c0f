//! Test support: the brokers, started on free loopback ports and stopped by PID (a Drop guard,
//! so also when a test panics), and the scenarios every broker runs.
#![allow(dead_code, unused_imports)]

#[cfg(feature = "group")]
pub mod order;
pub mod scenarios;

pub use chunnel_test::brokers::{kafka, nats, redis};
pub use chunnel_test::services::{Scratch, Server};

/// A topic or group name unique to this run.
pub fn unique(what: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{what}-{}-{n}", std::process::id())
}
