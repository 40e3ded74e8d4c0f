//! Decodes a `REJECT` body (the bytes after the tag); whatever decodes must re-encode to
//! the same bytes and decode again to an equal message.
#![no_main]

use chunnel_negotiate::wire::{Reject, Tag};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let Ok(r) = Reject::decode(body) else { return };
    let enc = r.encode();
    assert_eq!(enc[0], Tag::Reject as u8);
    assert_eq!(&enc[1..], body, "the encoding is not canonical");
    assert_eq!(Reject::decode(&enc[1..]), Ok(r));
});
