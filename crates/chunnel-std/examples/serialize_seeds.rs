//! Writes the seed inputs of the `serialize` fuzz target: encodings of sample values of its
//! message type in both formats.
//!
//! ```text
//! cargo run -p chunnel-std --example serialize_seeds [DIR]   # default: fuzz/seeds/serialize
//! ```
//!
//! The types below must stay identical to those of `fuzz/fuzz_targets/serialize.rs`.

use std::path::PathBuf;

use chunnel_std::serialize::{Bincode, Format, Json};

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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/serialize")
        });
    std::fs::create_dir_all(&dir)?;
    let shipped = Order {
        id: 4_000_012,
        customer: "Ünïcode \"customer\"".into(),
        items: vec![
            Item {
                sku: "sku-1".into(),
                qty: 3,
                price: 9.99,
                tags: vec!["gift".into()],
            },
            Item {
                sku: "sku-2".into(),
                qty: 0,
                price: -0.5,
                tags: vec![],
            },
        ],
        status: Status::Shipped {
            carrier: "post".into(),
            tracking: vec![0, 1, 254, 255],
        },
        note: Some("leave at the door".into()),
    };
    let cancelled = Order {
        id: 7,
        customer: String::new(),
        items: vec![],
        status: Status::Cancelled(Reason::OutOfStock {
            missing: vec!["sku-9".into()],
        }),
        note: None,
    };
    let seeds = [
        ("bincode-shipped", Bincode::to_bytes(&shipped)?),
        ("json-shipped", Json::to_bytes(&shipped)?),
        ("bincode-cancelled", Bincode::to_bytes(&cancelled)?),
    ];
    for (name, bytes) in seeds {
        let path = dir.join(name);
        std::fs::write(&path, &bytes)?;
        println!("{} ({} bytes)", path.display(), bytes.len());
    }
    Ok(())
}
