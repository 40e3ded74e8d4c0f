//! Decodes an SQLite wake-up datagram (docs/wire.md §15.2, what a process on the host sends
//! another's socket in `<file>.wake/`): never panics, and whatever decodes re-encodes to the
//! same bytes.
#![no_main]

use chunnel_rendezvous::sqlite_wake::{MAX_DATAGRAM, decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|datagram: &[u8]| {
    let Ok(w) = decode(datagram) else {
        return;
    };
    assert!(datagram.len() <= MAX_DATAGRAM, "accepted an oversized datagram");
    assert_eq!(
        encode(w.changes, w.group).as_deref(),
        Some(datagram),
        "the encoding is not canonical"
    );
});
