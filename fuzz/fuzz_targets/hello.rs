//! Decodes a `HELLO` body (the bytes after the tag); whatever decodes must re-encode to the
//! same bytes and decode again to an equal message. `Hello::split` (what a server keys its
//! remembered accepts on) never panics, and on a body that decodes it agrees with the
//! decoder: its early-data part decodes to the hello's early data, and its decision part is
//! exactly the offers and 0-RTT pick.
#![no_main]

use chunnel_negotiate::wire::{Hello, Tag};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let _ = Hello::peek_conn_id(body);
    let split = Hello::split(body);
    if let Ok((flags, _, early)) = split {
        let _ = Hello::decode_early(flags, early);
    }
    let Ok(h) = Hello::decode(body) else { return };
    assert_eq!(Hello::peek_conn_id(body), Ok(h.conn_id));
    let enc = h.encode();
    assert_eq!(enc[0], Tag::Hello as u8);
    assert_eq!(&enc[1..], body, "the encoding is not canonical");
    assert_eq!(Hello::decode(&enc[1..]), Ok(h.clone()));
    let (flags, key, early) = split.expect("a hello that decodes splits");
    assert_eq!(Hello::decode_early(flags, early), Ok(h.early.clone()));
    // The decision part, re-encoded without conn_id and early data.
    let mut bare = h.clone();
    bare.conn_id = 0;
    bare.early.clear();
    let bare = bare.encode();
    let start = 1 + 2 + 8; // tag, version, flags, conn_id
    let end = bare.len() - if h.zero_rtt.is_some() { 2 } else { 0 }; // empty early count
    assert_eq!(&bare[start..end], key);
});
