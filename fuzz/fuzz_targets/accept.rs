//! Decodes an `ACCEPT` body (the bytes after the tag); whatever decodes must re-encode to
//! the same bytes and decode again to an equal message.
#![no_main]

use chunnel_negotiate::wire::{Accept, Tag};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let Ok(a) = Accept::decode(body) else { return };
    let enc = a.encode();
    assert_eq!(enc[0], Tag::Accept as u8);
    assert_eq!(&enc[1..], body, "the encoding is not canonical");
    assert_eq!(Accept::decode(&enc[1..]), Ok(a));
});
