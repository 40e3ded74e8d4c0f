//! Property tests of the reliability and ordering protocols (sans-IO, simulated time):
//! headers round trip, arbitrary bytes never panic a decoder or a machine, and under random
//! drop / duplicate / reorder schedules the machines deliver every message exactly once (and,
//! with `Reorder` on top, in order).

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use chunnel_std::ordered::{self, Reorder};
use chunnel_std::reliable::{self, Ack, Header, MAX_SACK, Machine};
use proptest::prelude::*;

fn header() -> impl Strategy<Value = Header> {
    let ack = (
        any::<u32>(),
        prop::collection::vec((1u32..1000, 1u32..1000), 0..=MAX_SACK),
    )
        .prop_map(|(cum, gaps)| {
            let cumulative = u64::from(cum);
            let mut ranges = Vec::new();
            let mut at = cumulative;
            for (gap, len) in gaps {
                let s = at + u64::from(gap);
                ranges.push((s, s + u64::from(len)));
                at = s + u64::from(len);
            }
            Ack { cumulative, ranges }
        });
    (prop::option::of(any::<u64>()), prop::option::of(ack))
        .prop_filter("data or ack", |(s, a)| s.is_some() || a.is_some())
        .prop_map(|(seq, ack)| Header { seq, ack })
}

/// A lossy, duplicating, reordering link in simulated time.
struct Link {
    rng: u64,
    drop: u32,
    dup: u32,
    reorder: u32,
    queue: Vec<(Instant, Bytes)>,
}

impl Link {
    fn roll(&mut self, percent: u32) -> bool {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % 100) < u64::from(percent)
    }
    fn push(&mut self, now: Instant, f: Bytes) {
        if self.roll(self.drop) {
            return;
        }
        let copies = if self.roll(self.dup) { 2 } else { 1 };
        for _ in 0..copies {
            let extra = if self.roll(self.reorder) { 7 } else { 0 };
            let latency = Duration::from_millis(1 + extra + self.rng % 3);
            self.queue.push((now + latency, f.clone()));
        }
    }
    fn due(&mut self, now: Instant) -> Vec<Bytes> {
        let (due, rest): (Vec<_>, Vec<_>) = self.queue.drain(..).partition(|(t, _)| *t <= now);
        self.queue = rest;
        due.into_iter().map(|(_, f)| f).collect()
    }
}

/// Sends `n` numbered messages from `a` to `b` (ordering on top if `ordered`) over two lossy
/// links; returns what `b`'s application received.
fn simulate(n: u32, seed: u64, drop: u32, dup: u32, reorder: u32, ordered: bool) -> Vec<u32> {
    // The property is exactly-once delivery, not the give-up policy: with up to 39 % loss each
    // way, ten timeouts in a row with no ack at all happen now and then (and the sender would
    // rightly give up), so the simulated sender never gives up.
    let cfg = reliable::Config::default()
        .with_window(32)
        .with_max_timeouts(u32::MAX);
    let (mut a, mut b) = (Machine::new(cfg.clone()), Machine::new(cfg));
    let mut oa = Reorder::new(ordered::Config::default());
    let mut ob = Reorder::new(ordered::Config::default());
    let link = |s| Link {
        rng: s | 1,
        drop,
        dup,
        reorder,
        queue: Vec::new(),
    };
    let (mut ab, mut ba) = (link(seed), link(seed.rotate_left(17)));
    let t0 = Instant::now();
    let mut now = t0;
    let mut next = 0u32;
    let mut got = Vec::new();
    for _ in 0..200_000 {
        while next < n && a.can_send() {
            let p = Bytes::copy_from_slice(&next.to_be_bytes());
            let p = if ordered { oa.send(&p) } else { p };
            a.send(p).expect("window has room");
            next += 1;
        }
        a.handle_timeout(now);
        b.handle_timeout(now);
        while let Some(f) = a.poll_transmit(now) {
            ab.push(now, f);
        }
        while let Some(f) = b.poll_transmit(now) {
            ba.push(now, f);
        }
        for f in ab.due(now) {
            b.handle_frame(f, now).expect("valid frame");
        }
        for f in ba.due(now) {
            a.handle_frame(f, now).expect("valid frame");
        }
        while let Some(m) = b.poll_deliver() {
            if ordered {
                ob.handle_frame(m, now).expect("valid ordered frame");
                while let Some(m) = ob.poll_deliver() {
                    got.push(u32::from_be_bytes(m[..].try_into().unwrap()));
                }
            } else {
                got.push(u32::from_be_bytes(m[..].try_into().unwrap()));
            }
        }
        if next == n && a.unacked() == 0 {
            break;
        }
        now += Duration::from_millis(1);
    }
    assert!(!a.failed(), "sender gave up");
    got
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn reliable_header_round_trips(h in header(), payload in prop::collection::vec(any::<u8>(), 0..64)) {
        let mut buf = BytesMut::new();
        h.encode(&mut buf);
        let hlen = buf.len();
        if h.seq.is_some() {
            buf.extend_from_slice(&payload);
        }
        let (back, len) = Header::decode(&buf).unwrap();
        prop_assert_eq!(&back, &h);
        prop_assert_eq!(len, hlen);
        let (back, rest) = reliable::decode_frame(buf.freeze()).unwrap();
        prop_assert_eq!(back, h.clone());
        prop_assert_eq!(&rest[..], if h.seq.is_some() { &payload[..] } else { &[][..] });
    }

    #[test]
    fn ordered_header_round_trips(seq in any::<u64>(), payload in prop::collection::vec(any::<u8>(), 0..64)) {
        let (s, p) = ordered::decode_frame(ordered::encode_frame(seq, &payload)).unwrap();
        prop_assert_eq!(s, seq);
        prop_assert_eq!(&p[..], &payload[..]);
    }

    #[test]
    fn random_bytes_never_panic(frames in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..200), 0..20)) {
        let mut m = Machine::new(reliable::Config::default());
        let mut o = Reorder::new(ordered::Config::default());
        let now = Instant::now();
        m.send(Bytes::from_static(b"x")).unwrap();
        let _ = m.poll_transmit(now);
        for f in frames {
            let f = Bytes::from(f);
            if let Ok((h, _)) = Header::decode(&f) {
                // Whatever decodes re-encodes to the same header bytes.
                let mut again = BytesMut::new();
                h.encode(&mut again);
                prop_assert_eq!(&f[..again.len()], &again[..]);
            }
            let _ = reliable::decode_frame(f.clone());
            let _ = ordered::decode_frame(f.clone());
            let _ = m.handle_frame(f.clone(), now);
            let _ = o.handle_frame(f, now);
            while m.poll_transmit(now).is_some() {}
            m.handle_timeout(now + Duration::from_secs(1));
        }
    }

    #[test]
    fn exactly_once_under_random_faults(
        seed in any::<u64>(), drop in 0u32..40, dup in 0u32..30, reorder in 0u32..40, n in 1u32..400,
    ) {
        let mut got = simulate(n, seed, drop, dup, reorder, false);
        got.sort_unstable();
        prop_assert_eq!(got, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn exactly_once_in_order_with_ordering_on_top(
        seed in any::<u64>(), drop in 0u32..40, dup in 0u32..30, reorder in 0u32..40, n in 1u32..400,
    ) {
        let got = simulate(n, seed, drop, dup, reorder, true);
        prop_assert_eq!(got, (0..n).collect::<Vec<_>>());
    }
}
