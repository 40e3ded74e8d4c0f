//! Decodes arbitrary bytes as a message of the serialization Chunnel in both formats
//! (bincode, JSON): decoding must never panic, and whatever decodes must re-encode to bytes
//! that decode again and re-encode identically (the encoding is a fixed point after one
//! round). Seeds: `cargo run -p chunnel-std --example serialize_seeds` (same types as here).
#![no_main]

use chunnel_std::serialize::{Bincode, Format, Json};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Order {
    id: u64,
    customer: String,
    items: Vec<Item>,
    status: Status,
    note: Option<String>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Item {
    sku: String,
    qty: u32,
    price: f64,
    tags: Vec<String>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum Status {
    Pending,
    Shipped { carrier: String, tracking: Vec<u8> },
    Cancelled(Reason),
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum Reason {
    Customer,
    OutOfStock { missing: Vec<String> },
}

fn check<F: Format>(data: &[u8]) {
    let Ok(v) = F::decode::<Order>(data) else {
        return;
    };
    let once = F::to_bytes(&v).expect("a decoded value encodes");
    let w: Order = F::decode(&once).expect("an encoding decodes");
    let twice = F::to_bytes(&w).expect("a decoded value encodes");
    assert_eq!(once, twice, "{} encoding is not stable", F::NAME);
}

fuzz_target!(|data: &[u8]| {
    check::<Bincode>(data);
    check::<Json>(data);
});
