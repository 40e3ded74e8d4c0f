//! Decodes a `REJECT` body (the bytes after the tag); whatever decodes must re-encode to
//! the same bytes and decode again to an equal message. Cut to fit a smaller limit
//! (`encode_within`, docs/wire.md §7.4.1), it still decodes, to the same reason and conn_id,
//! and fits the limit whenever the fixed fields alone do.
#![no_main]

use chunnel_negotiate::wire::{Reject, Tag};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let Ok(r) = Reject::decode(body) else { return };
    let enc = r.encode();
    assert_eq!(enc[0], Tag::Reject as u8);
    assert_eq!(&enc[1..], body, "the encoding is not canonical");
    assert_eq!(Reject::decode(&enc[1..]), Ok(r.clone()));
    for max in [64usize, 200, enc.len().saturating_sub(1), enc.len()] {
        let cut = r.encode_within(max);
        let back = Reject::decode(&cut[1..]).expect("a cut reject decodes");
        assert_eq!((back.reason, back.conn_id), (r.reason, r.conn_id));
        assert!(back.mismatches.len() <= r.mismatches.len());
        if cut.len() > max {
            // Only when the reject without mismatches and message does not fit either.
            assert!(
                back.mismatches.is_empty(),
                "{} > {max} with mismatches left",
                cut.len()
            );
        }
    }
});
