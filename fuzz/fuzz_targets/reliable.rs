//! The reliability and ordering decoders and machines: whatever decodes re-encodes to the
//! same header bytes, and a `Machine` / `Reorder` fed any frames (in any order, at any times)
//! never panics, never delivers one sequence number twice, and never reports more unacked
//! messages than it sent.
#![no_main]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use chunnel_std::ordered::{self, Reorder};
use chunnel_std::reliable::{self, Header, Machine};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // First byte: how many messages this end sends first (0..=15) and whether timers fire.
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let cfg = reliable::Config::default()
        .with_window(8)
        .with_recv_window(64)
        .with_recv_buffer(16);
    let mut m = Machine::new(cfg);
    let mut o = Reorder::new(
        ordered::Config::default()
            .with_capacity(8)
            .with_gap_timeout(Some(Duration::from_millis(5))),
    );
    let t0 = Instant::now();
    let sends = usize::from(mode & 0x0f);
    for i in 0..sends {
        if m.send(Bytes::from(vec![i as u8])).is_err() {
            break;
        }
    }
    let mut delivered_seqs = HashSet::new();
    // Messages are separated by 0xff bytes.
    for (k, frame) in rest.split(|&b| b == 0xff).enumerate() {
        let now = t0 + Duration::from_millis(3 * k as u64);
        if let Ok((h, len)) = Header::decode(frame) {
            let mut again = BytesMut::new();
            h.encode(&mut again);
            assert_eq!(
                &frame[..len],
                &again[..],
                "the header encoding is not canonical"
            );
            // A data frame newly delivered must carry a sequence number not delivered before.
            let before = m.stats().delivered;
            if m.handle_frame(Bytes::copy_from_slice(frame), now).is_ok()
                && m.stats().delivered > before
            {
                let seq = h.seq.expect("only data frames deliver");
                assert!(
                    delivered_seqs.insert(seq),
                    "sequence number {seq} delivered twice"
                );
            }
        } else {
            assert!(m.handle_frame(Bytes::copy_from_slice(frame), now).is_err());
        }
        let _ = ordered::decode_frame(Bytes::copy_from_slice(frame));
        let _ = o.handle_frame(Bytes::copy_from_slice(frame), now);
        if mode & 0x10 != 0 {
            m.handle_timeout(now);
            o.handle_timeout(now);
        }
        while m.poll_transmit(now).is_some() {}
        while m.poll_deliver().is_some() {}
        while o.poll_deliver().is_some() {}
        assert!(m.unacked() <= sends);
    }
});
