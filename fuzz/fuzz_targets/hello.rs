//! Decodes a `HELLO` body (the bytes after the tag); whatever decodes must re-encode to the
//! same bytes and decode again to an equal message.
#![no_main]

use chunnel_negotiate::wire::{Hello, Tag};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let _ = Hello::peek_conn_id(body);
    let Ok(h) = Hello::decode(body) else { return };
    assert_eq!(Hello::peek_conn_id(body), Ok(h.conn_id));
    let enc = h.encode();
    assert_eq!(enc[0], Tag::Hello as u8);
    assert_eq!(&enc[1..], body, "the encoding is not canonical");
    assert_eq!(Hello::decode(&enc[1..]), Ok(h));
});
