//! Decodes a stack record (docs/wire.md §15.1, what a rendezvous store holds); whatever
//! decodes must re-encode to the same bytes.
#![no_main]

use chunnel_negotiate::wire::{decode_stack, encode_stack};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|record: &[u8]| {
    let Ok(stack) = decode_stack(record) else {
        return;
    };
    assert_eq!(
        &encode_stack(&stack)[..],
        record,
        "the encoding is not canonical"
    );
});
