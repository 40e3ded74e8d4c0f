//! Test support: real store servers (`chunnel_test::services`) and the group scenarios.
#![allow(dead_code, unused_imports)]

pub mod direct;
pub mod scenarios;

pub use chunnel_test::services::*;
