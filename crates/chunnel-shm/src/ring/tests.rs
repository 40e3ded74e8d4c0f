//! Unit tests of the ring: round trips, a full ring, garbage, lending, attach checks.

use super::*;

fn region(ring: usize, max: usize) -> Region {
    let dir = std::env::temp_dir();
    let path = dir.join(format!(
        "chunnel-shm-unit-{}-{}",
        std::process::id(),
        rand()
    ));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .unwrap();
    f.set_len(file_len(ring) as u64).unwrap();
    let _ = std::fs::remove_file(&path);
    Region::init(Mapping::new(f, file_len(ring)).unwrap(), ring, max, 7)
}

fn rand() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    h.finish()
}

#[test]
fn round_trip_with_wrap() {
    let r = region(4096, 1024);
    let mut p = Producer::new(0);
    let mut c = Consumer::new(0);
    let mut slots = vec![None; 8];
    for i in 0..2000usize {
        let len = (i * 37) % 1000;
        let msg: Vec<u8> = (0..len).map(|j| (i + j) as u8).collect();
        assert!(p.push(&r, [b"h", &msg]).unwrap());
        p.publish(&r);
        assert_eq!(c.pop(&r, &mut slots).unwrap(), 1);
        let got = slots[0].take().unwrap();
        assert_eq!(got[0], b'h');
        assert_eq!(&got[1..], &msg[..]);
    }
}

#[test]
fn full_ring_refuses() {
    let r = region(4096, 1024);
    let mut p = Producer::new(1);
    let mut pushed = 0;
    while p.push(&r, [&[], &[0u8; 1000]]).unwrap() {
        pushed += 1;
    }
    assert_eq!(pushed, 4);
    p.publish(&r);
    let mut c = Consumer::new(1);
    let mut slots = vec![None; 2];
    assert_eq!(c.pop(&r, &mut slots).unwrap(), 2);
    assert!(p.push(&r, [&[], &[0u8; 1000]]).unwrap());
}

/// Garbage in the ring or its control words gives errors, never a panic.
#[test]
fn garbage_never_panics() {
    let r = region(4096, 1024);
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut slots = vec![None; 4];
    for _ in 0..20_000 {
        let w = (next() % 512) as usize * 8;
        r.u64_at(HEADER + w).store(next(), Ordering::Relaxed);
        r.head(0).store(next() % 8192, Ordering::Relaxed);
        let mut c = Consumer::new(0);
        // Our own positions are private (the peer cannot touch them): always 8-aligned.
        c.tail = next() % 8192 / 8 * 8;
        let _ = c.pop(&r, &mut slots);
        let mut p = Producer::new(0);
        p.head = next() % 8192 / 8 * 8;
        p.tail = p.head.saturating_sub(next() % 4096);
        r.tail(0).store(next() % 8192, Ordering::Relaxed);
        r.u64_at(OFF_HOLES[0] + (next() % 128) as usize * 8)
            .store(next() % 16384, Ordering::Relaxed);
        let _ = p.push(&r, [&[], &[1u8; 100]]);
    }
}

fn pop_one(c: &mut Consumer, r: &Region, lend: bool) -> Option<Popped> {
    let mut got = None;
    c.pop_with(r, 1, lend, |p| got = Some(p)).unwrap();
    got
}

fn bytes_of(r: &Region, p: &Popped) -> Vec<u8> {
    match p {
        Popped::Lent(s) => r.span(s).to_vec(),
        Popped::Copied(b) => b.to_vec(),
    }
}

fn span_of(p: Popped) -> Span {
    match p {
        Popped::Lent(s) => s,
        Popped::Copied(_) => panic!("expected a lent record"),
    }
}

/// A held record keeps its bytes while the producer goes round the ring many times (it
/// steps over the hole); past half the ring held, the consumer copies; release in any
/// order empties the hole table.
#[test]
fn held_records_survive_laps_and_release_in_any_order() {
    let r = region(4096, 1024);
    let mut p = Producer::new(0);
    let mut c = Consumer::new(0);
    // Also at offset 0.
    assert!(p.push(&r, [&[], &[1; 8]]).unwrap());
    p.publish(&r);
    let first = span_of(pop_one(&mut c, &r, true).unwrap());
    assert!(p.push(&r, [&[], &[0xa1; 500]]).unwrap());
    p.publish(&r);
    let held = span_of(pop_one(&mut c, &r, true).unwrap());
    for i in 0..200usize {
        let len = 100 + (i * 37) % 700;
        let msg: Vec<u8> = (0..len).map(|j| (i + j) as u8).collect();
        assert!(p.push(&r, [&[], &msg]).unwrap(), "stalled at {i}");
        p.publish(&r);
        let got = pop_one(&mut c, &r, i % 2 == 0).unwrap();
        assert_eq!(bytes_of(&r, &got), msg);
        if let Popped::Lent(s) = got {
            c.release(&r, s);
        }
    }
    assert!(c.tail > 20 * 4096, "the producer went round the ring");
    assert_eq!(r.span(&held), &[0xa1; 500][..], "held record overwritten");
    assert_eq!(r.span(&first), &[1; 8][..], "held record overwritten");
    // Hold more until past half the ring: copies.
    let mut spans = vec![held, first];
    let mut copied = 0;
    for _ in 0..6 {
        assert!(p.push(&r, [&[], &[7; 500]]).unwrap());
        p.publish(&r);
        match pop_one(&mut c, &r, true).unwrap() {
            Popped::Lent(s) => spans.push(s),
            Popped::Copied(b) => {
                assert_eq!(&b[..], &[7; 500][..]);
                copied += 1;
            }
        }
    }
    assert!(
        copied >= 2 && spans.len() <= 5,
        "{copied} copied, {} held",
        spans.len()
    );
    assert_eq!(c.held(), spans.len());
    spans.reverse();
    for s in spans {
        c.release(&r, s);
    }
    assert_eq!(c.held(), 0);
    assert_eq!(r.hole_hint(0).load(Ordering::Relaxed), NO_HOLE);
}

/// A reservation holds back what is pushed after it; dropped unsent it becomes a skip
/// record the consumer steps over; emitted, its bytes are the message.
#[test]
fn reservations_publish_in_order_and_skip() {
    let r = region(4096, 1024);
    let mut p = Producer::new(0);
    let mut c = Consumer::new(0);
    let mut a = p.reserve(&r, 10).unwrap().unwrap();
    r.span_mut(&mut a).copy_from_slice(b"0123456789");
    let b = p.reserve(&r, 100).unwrap().unwrap();
    assert!(p.push(&r, [b"x", b"yz"]).unwrap());
    p.publish(&r);
    assert!(
        pop_one(&mut c, &r, false).is_none(),
        "nothing visible before a is emitted"
    );
    p.finish(&r, a, true);
    p.publish(&r);
    assert_eq!(
        bytes_of(&r, &pop_one(&mut c, &r, true).unwrap()),
        b"0123456789"
    );
    assert!(pop_one(&mut c, &r, false).is_none(), "b holds back xyz");
    p.finish(&r, b, false);
    p.publish(&r);
    assert_eq!(bytes_of(&r, &pop_one(&mut c, &r, false).unwrap()), b"xyz");
    assert!(pop_one(&mut c, &r, false).is_none());
    // The window bounds reservations.
    let mut spans = Vec::new();
    while let Some(s) = p.reserve(&r, 0).unwrap() {
        spans.push(s);
    }
    assert!(spans.len() <= LEND_WINDOW);
}

#[test]
fn attach_validates() {
    let r = region(4096, 1024);
    let map = Mapping::new(r.map.file().try_clone().unwrap(), file_len(4096)).unwrap();
    assert!(Region::attach(map, 7).is_ok());
    let map = Mapping::new(r.map.file().try_clone().unwrap(), file_len(4096)).unwrap();
    assert_eq!(
        Region::attach(map, 8).unwrap_err(),
        "token mismatch (not the region the client offered)"
    );
    r.u64_at(OFF_MAX_MSG).store(1 << 40, Ordering::Relaxed);
    let map = Mapping::new(r.map.file().try_clone().unwrap(), file_len(4096)).unwrap();
    assert!(Region::attach(map, 7).is_err());
}
