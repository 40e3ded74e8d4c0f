//! Decodes BIND and BOUND, the transcript binding's messages (docs/wire.md §16), from
//! arbitrary bytes: never a panic, and whatever decodes re-encodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|m: &[u8]| {
    chunnel_secure::negotiated::fuzz_decode(m);
});
