//! A whole message as a client receives it while negotiating, `ACCEPT_DATA` in particular:
//! whatever splits and decodes must re-encode to the same bytes, and a client handshake fed
//! the message never panics (and keeps at most the reply it carried). A handshake that
//! expects the accept it took (`ClientHandshake::expect`, recognised without decoding) ends
//! as a fresh one does on the same message and on a one-byte change of it.
#![no_main]

use std::time::Instant;

use bytes::Bytes;
use chunnel::{Pick, StackOption};
use chunnel_negotiate::proto::{ClientHandshake, KnownAccept, Outcome, Timing};
use chunnel_negotiate::wire::{Accept, Control, encode_control, split_accept_data};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|msg: &[u8]| {
    if let Ok((body, at)) = split_accept_data(msg)
        && let Ok(a) = Accept::decode(body)
    {
        let again = encode_control(&Control::AcceptData(a, Bytes::copy_from_slice(&msg[at..])));
        assert_eq!(&again[..], msg, "the encoding is not canonical");
    }
    let offers = || {
        vec![StackOption {
            chunnels: Vec::new(),
            pick: Pick::default(),
        }]
    };
    // The conn_id where an ACCEPT_DATA carries it, so the handshake can match.
    let conn_id = msg
        .get(5..13)
        .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")))
        .unwrap_or(1);
    let now = Instant::now();
    let run = |m: &[u8], known: Option<KnownAccept>| {
        let mut hs = ClientHandshake::new(offers(), None, conn_id, Timing::default(), now)
            .expect("one empty offer fits");
        if let Some(k) = known {
            hs.expect(k);
        }
        let _ = hs.poll_transmit(now);
        hs.handle_message(Bytes::copy_from_slice(m));
        hs.poll_outcome()
    };
    if let Some(Ok(out)) = run(msg, None) {
        assert!(out.early_replies.len() <= 1);
        let outcome = |r: Option<Result<Outcome, chunnel_negotiate::Error>>| {
            r.map(|r| {
                r.map(|o| (o.accept, o.stack, o.early_replies))
                    .map_err(|e| e.to_string())
            })
        };
        let mut changed = msg.to_vec();
        let i = usize::from(msg[msg.len() - 1]) % msg.len();
        changed[i] ^= 0x5a;
        for m in [msg, &changed[..]] {
            assert_eq!(
                outcome(run(m, Some(out.known.clone()))),
                outcome(run(m, None)),
                "an expected accept ends the handshake differently"
            );
        }
    }
});
