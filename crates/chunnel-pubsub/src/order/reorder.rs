//! The sans-IO core of ordered delivery: the sequence header every ordered message carries in
//! front of its payload, and [`Reorder`], which turns messages arriving in any order (from
//! several lanes, duplicated by redeliveries and retries) into each publisher's messages in
//! sequence order, exactly once, holding early arrivals in a bounded buffer.

use std::collections::{BTreeMap, HashMap, VecDeque};

use bytes::{BufMut, Bytes, BytesMut};

/// Marks an ordered message (`docs/wire.md` §18).
pub const MAGIC: &[u8; 4] = b"cho1";
/// The header's length: magic, publisher (8 bytes), sequence number (8 bytes).
pub const HEADER: usize = 4 + 8 + 8;

/// Prepends the sequence header to `payload`.
pub fn encode(publisher: u64, seq: u64, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(HEADER + payload.len());
    b.put_slice(MAGIC);
    b.put_u64(publisher);
    b.put_u64(seq);
    b.put_slice(payload);
    b.freeze()
}

/// Splits an ordered message into (publisher, seq, payload); `None` if it is shorter than the
/// header or does not start with [`MAGIC`] (never panics, whatever the bytes).
pub fn decode(m: &Bytes) -> Option<(u64, u64, Bytes)> {
    if m.len() < HEADER || &m[..4] != MAGIC {
        return None;
    }
    let publisher = u64::from_be_bytes(m[4..12].try_into().ok()?);
    let seq = u64::from_be_bytes(m[12..20].try_into().ok()?);
    Some((publisher, seq, m.slice(HEADER..)))
}

/// What [`Reorder::push`] did with a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pushed {
    /// It was the next of its publisher: it and `n - 1` buffered successors are ready.
    Ready(usize),
    /// It arrived early and waits in the buffer for the messages before it.
    Waiting,
    /// Already delivered or already waiting: dropped.
    Duplicate,
    /// Early, but the buffer is full (or a new publisher would exceed the table): not kept.
    /// Over brokers that lose nothing this means the lanes reorder more than the capacity
    /// allows; the caller reports it rather than skip a message.
    Overflow,
}

/// Counters of a [`Reorder`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReorderStats {
    /// Messages made ready, in order.
    pub delivered: u64,
    /// Messages that arrived before one of their predecessors (waited in the buffer).
    pub reordered: u64,
    /// Duplicates dropped.
    pub duplicates: u64,
    /// Messages refused because the buffer was full.
    pub overflows: u64,
    /// The most messages ever waiting at once.
    pub max_waiting: usize,
}

/// Per publisher, delivers sequence numbers 0, 1, 2... in order, exactly once.
///
/// Memory is bounded: at most `capacity` messages wait behind gaps, at most `max_publishers`
/// publishers are tracked (16 bytes each, kept for the connection's life so that a late
/// duplicate of a finished publisher is still recognised), and the ready queue holds only what
/// the last push made ready (the driver drains it before pushing more).
#[derive(Debug)]
pub struct Reorder {
    capacity: usize,
    max_publishers: usize,
    next: HashMap<u64, u64>,
    early: HashMap<u64, BTreeMap<u64, Bytes>>,
    waiting: usize,
    ready: VecDeque<Bytes>,
    stats: ReorderStats,
}

impl Reorder {
    /// A core holding at most `capacity` early messages and `max_publishers` publishers.
    pub fn new(capacity: usize, max_publishers: usize) -> Self {
        Reorder {
            capacity,
            max_publishers,
            next: HashMap::new(),
            early: HashMap::new(),
            waiting: 0,
            ready: VecDeque::new(),
            stats: ReorderStats::default(),
        }
    }

    /// Takes one message: `seq` of `publisher` with its payload.
    pub fn push(&mut self, publisher: u64, seq: u64, payload: Bytes) -> Pushed {
        let next = match self.next.get(&publisher) {
            Some(n) => *n,
            None if self.next.len() >= self.max_publishers => {
                self.stats.overflows += 1;
                return Pushed::Overflow;
            }
            None => 0,
        };
        if seq < next {
            self.stats.duplicates += 1;
            return Pushed::Duplicate;
        }
        if seq > next {
            let early = self.early.entry(publisher).or_default();
            if early.contains_key(&seq) {
                self.stats.duplicates += 1;
                return Pushed::Duplicate;
            }
            if self.waiting >= self.capacity {
                if early.is_empty() {
                    self.early.remove(&publisher);
                }
                self.stats.overflows += 1;
                return Pushed::Overflow;
            }
            early.insert(seq, payload);
            self.next.entry(publisher).or_insert(0);
            self.waiting += 1;
            self.stats.reordered += 1;
            self.stats.max_waiting = self.stats.max_waiting.max(self.waiting);
            return Pushed::Waiting;
        }
        self.ready.push_back(payload);
        let mut n = 1;
        let mut want = seq + 1;
        if let Some(early) = self.early.get_mut(&publisher) {
            while let Some(p) = early.remove(&want) {
                self.ready.push_back(p);
                n += 1;
                want += 1;
            }
            if early.is_empty() {
                self.early.remove(&publisher);
            }
        }
        self.waiting -= n - 1;
        self.next.insert(publisher, want);
        self.stats.delivered += n as u64;
        Pushed::Ready(n)
    }

    /// The next message in order, if one is ready.
    pub fn pop(&mut self) -> Option<Bytes> {
        self.ready.pop_front()
    }

    /// Messages ready to be popped.
    pub fn ready(&self) -> usize {
        self.ready.len()
    }

    /// Messages waiting behind gaps.
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// The next sequence number expected from `publisher` (0 if never seen).
    pub fn next_of(&self, publisher: u64) -> u64 {
        self.next.get(&publisher).copied().unwrap_or(0)
    }

    /// The counters.
    pub fn stats(&self) -> ReorderStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn msg(p: u64, s: u64) -> Bytes {
        Bytes::from(format!("{p}:{s}"))
    }

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let m = encode(7, 42, b"hello");
        assert_eq!(m.len(), HEADER + 5);
        assert_eq!(decode(&m), Some((7, 42, Bytes::from_static(b"hello"))));
        assert_eq!(decode(&Bytes::from_static(b"cho1short")), None);
        let mut bad = m.to_vec();
        bad[0] = b'x';
        assert_eq!(decode(&Bytes::from(bad)), None);
        assert_eq!(decode(&encode(1, 2, b"")).map(|d| d.2.len()), Some(0));
    }

    #[test]
    fn delivers_in_order_and_drops_duplicates() {
        let mut r = Reorder::new(8, 8);
        assert_eq!(r.push(1, 1, msg(1, 1)), Pushed::Waiting);
        assert_eq!(r.push(1, 1, msg(1, 1)), Pushed::Duplicate);
        assert_eq!(r.push(2, 0, msg(2, 0)), Pushed::Ready(1));
        assert_eq!(r.push(1, 0, msg(1, 0)), Pushed::Ready(2));
        assert_eq!(r.push(1, 0, msg(1, 0)), Pushed::Duplicate);
        let got: Vec<_> = std::iter::from_fn(|| r.pop()).collect();
        assert_eq!(got, vec![msg(2, 0), msg(1, 0), msg(1, 1)]);
        assert_eq!(r.waiting(), 0);
        assert_eq!(r.stats().duplicates, 2);
    }

    #[test]
    fn full_buffer_refuses_early_messages_but_takes_the_next() {
        let mut r = Reorder::new(2, 8);
        assert_eq!(r.push(1, 2, msg(1, 2)), Pushed::Waiting);
        assert_eq!(r.push(1, 3, msg(1, 3)), Pushed::Waiting);
        assert_eq!(r.push(1, 4, msg(1, 4)), Pushed::Overflow);
        assert_eq!(r.push(9, 5, msg(9, 5)), Pushed::Overflow);
        assert_eq!(r.push(1, 0, msg(1, 0)), Pushed::Ready(1));
        assert_eq!(r.push(1, 1, msg(1, 1)), Pushed::Ready(3));
        assert_eq!(r.waiting(), 0);
        let mut small = Reorder::new(2, 1);
        assert_eq!(small.push(1, 0, msg(1, 0)), Pushed::Ready(1));
        assert_eq!(small.push(2, 0, msg(2, 0)), Pushed::Overflow);
    }

    /// A publisher's messages, each on a random lane; lanes keep each publisher's order
    /// (a burst goes to one lane, in order) but are read in a random interleaving, with
    /// redeliveries.
    fn arrivals() -> impl Strategy<Value = (Vec<(u64, u64)>, u64)> {
        (1u64..4, 1u64..60, 1usize..5, any::<u64>()).prop_map(|(pubs, per, lanes, seed)| {
            let mut rng = seed | 1;
            let mut next = || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let mut queues: Vec<VecDeque<(u64, u64)>> = vec![VecDeque::new(); lanes];
            for p in 0..pubs {
                let mut s = 0;
                while s < per {
                    let burst = 1 + next() % 5;
                    let lane = (next() % lanes as u64) as usize;
                    for k in s..(s + burst).min(per) {
                        queues[lane].push_back((p, k));
                        if next() % 7 == 0 {
                            queues[lane].push_back((p, k)); // a redelivery
                        }
                    }
                    s += burst;
                }
            }
            let mut out = Vec::new();
            while queues.iter().any(|q| !q.is_empty()) {
                let lane = (next() % lanes as u64) as usize;
                if let Some(m) = queues[lane].pop_front() {
                    out.push(m);
                }
            }
            (out, per)
        })
    }

    proptest! {
        /// With room for every early message, every publisher's messages come out exactly
        /// once, in sequence order, whatever the interleaving and duplicates.
        #[test]
        fn exactly_once_in_order((arrivals, per) in arrivals()) {
            let mut r = Reorder::new(usize::MAX, 16);
            let mut out: HashMap<u64, Vec<u64>> = HashMap::new();
            for (p, s) in &arrivals {
                let pushed = r.push(*p, *s, msg(*p, *s));
                prop_assert_ne!(pushed, Pushed::Overflow);
                while let Some(m) = r.pop() {
                    let text = String::from_utf8(m.to_vec()).unwrap();
                    let (mp, ms) = text.split_once(':').unwrap();
                    out.entry(mp.parse().unwrap()).or_default().push(ms.parse().unwrap());
                }
            }
            for seqs in out.values() {
                prop_assert_eq!(seqs, &(0..per).collect::<Vec<_>>());
            }
            prop_assert_eq!(r.waiting(), 0);
            prop_assert!(r.stats().max_waiting <= arrivals.len());
        }

        /// With a small buffer, nothing is ever delivered out of order or twice, the buffer
        /// never holds more than its capacity, and a message is lost only where an overflow
        /// was reported.
        #[test]
        fn bounded_buffer_never_misorders((arrivals, _per) in arrivals(), cap in 0usize..6) {
            let mut r = Reorder::new(cap, 16);
            let mut last: HashMap<u64, u64> = HashMap::new();
            for (p, s) in &arrivals {
                r.push(*p, *s, msg(*p, *s));
                prop_assert!(r.waiting() <= cap);
                while let Some(m) = r.pop() {
                    let text = String::from_utf8(m.to_vec()).unwrap();
                    let (mp, ms) = text.split_once(':').unwrap();
                    let (mp, ms): (u64, u64) = (mp.parse().unwrap(), ms.parse().unwrap());
                    let want = last.get(&mp).map_or(0, |l| l + 1);
                    prop_assert_eq!(ms, want, "publisher {} out of order", mp);
                    last.insert(mp, ms);
                }
            }
            if r.stats().overflows == 0 {
                prop_assert_eq!(r.waiting(), 0);
            }
        }

        /// Any bytes: decode never panics, and what it accepts re-encodes to the same bytes.
        #[test]
        fn decode_any_bytes(
            magic in any::<bool>(),
            b in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            // Half the inputs start with the magic, so the length checks are reached.
            let m = if magic {
                Bytes::from([&MAGIC[..], &b].concat())
            } else {
                Bytes::from(b)
            };
            if let Some((p, s, payload)) = decode(&m) {
                prop_assert_eq!(encode(p, s, &payload), m);
            }
        }
    }
}
