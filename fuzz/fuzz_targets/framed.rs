//! A byte stream of length-framed messages (chunnel-net's `framed`, under TCP, Unix streams
//! and TLS) from arbitrary bytes: `recv` returns messages no longer than the limit, and then
//! an error (an oversized length, or the end of the stream), never a panic.
#![no_main]

use chunnel::ChunnelConnection;
use chunnel_net::framed::{Config, Connection};
use libfuzzer_sys::fuzz_target;
use tokio::io::AsyncWriteExt;

const MAX: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let feed = async move {
            let _ = b.write_all(data).await;
            // Dropped: the stream ends.
        };
        let read = async move {
            let (rd, wr) = tokio::io::split(a);
            let c = Connection::new(
                rd,
                wr,
                &Config::default().with_max_payload_bytes(MAX),
                "fuzz".into(),
            );
            let mut slots = [None, None, None, None];
            let mut total = 0;
            while let Ok(n) = c.recv(&mut slots).await {
                assert!(n <= slots.len());
                for s in slots[..n].iter_mut() {
                    let m = s.take().expect("a received message");
                    assert!(m.len() <= MAX, "a message over the limit");
                    total += 4 + m.len();
                }
                assert!(total <= data.len(), "more bytes received than sent");
            }
        };
        tokio::join!(feed, read);
    });
});
