//! Decodes a rebalancing Kafka group's assignment record (docs/wire.md §18.3, what a
//! rendezvous store holds): never panics; whatever decodes is at most 1024 valid names, sorted,
//! and re-encodes to the same bytes.
#![no_main]

use chunnel_pubsub::kafka::group::{MAX_MEMBERS, decode_members, encode_members};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|record: &[u8]| {
    let Ok(members) = decode_members(record) else {
        return;
    };
    assert!(members.len() <= MAX_MEMBERS);
    assert!(members.windows(2).all(|w| w[0] < w[1]), "not sorted");
    assert_eq!(
        &encode_members(&members)[..],
        record,
        "the encoding is not canonical"
    );
});
