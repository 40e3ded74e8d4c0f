//! A whole message as a client receives it while negotiating, `ACCEPT_DATA` in particular:
//! whatever splits and decodes must re-encode to the same bytes, and a client handshake fed
//! the message never panics (and keeps at most the reply it carried).
#![no_main]

use std::time::Instant;

use bytes::Bytes;
use chunnel::{Pick, StackOption};
use chunnel_negotiate::proto::{ClientHandshake, Timing};
use chunnel_negotiate::wire::{Accept, Control, encode_control, split_accept_data};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|msg: &[u8]| {
    if let Ok((body, at)) = split_accept_data(msg)
        && let Ok(a) = Accept::decode(body)
    {
        let again = encode_control(&Control::AcceptData(a, Bytes::copy_from_slice(&msg[at..])));
        assert_eq!(&again[..], msg, "the encoding is not canonical");
    }
    let offers = vec![StackOption {
        chunnels: Vec::new(),
        pick: Pick::default(),
    }];
    // The conn_id where an ACCEPT_DATA carries it, so the handshake can match.
    let conn_id = msg
        .get(5..13)
        .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")))
        .unwrap_or(1);
    let now = Instant::now();
    let Ok(mut hs) = ClientHandshake::new(offers, None, conn_id, Timing::default(), now) else {
        return;
    };
    let _ = hs.poll_transmit(now);
    hs.handle_message(Bytes::copy_from_slice(msg));
    if let Some(Ok(out)) = hs.poll_outcome() {
        assert!(out.early_replies.len() <= 1);
    }
});
