//! Message ids (carried in a header or field of every published message) and the bounded
//! window a subscriber deduplicates with.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

/// A message's id: the publisher that sent it and its sequence number at that publisher.
/// Carried as 16 bytes (both big-endian) in a header (Kafka, NATS) or a field (Redis).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MsgId {
    /// Random per publisher connection.
    pub producer: u64,
    /// 0, 1, 2... per publisher connection.
    pub seq: u64,
}

impl MsgId {
    /// The 16-byte wire form.
    pub fn to_bytes(self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.producer.to_be_bytes());
        b[8..].copy_from_slice(&self.seq.to_be_bytes());
        b
    }

    /// Parses the wire form; `None` unless `b` is exactly 16 bytes.
    pub fn from_bytes(b: &[u8]) -> Option<MsgId> {
        let b: &[u8; 16] = b.try_into().ok()?;
        let (p, s) = b.split_at(8);
        Some(MsgId {
            producer: u64::from_be_bytes(p.try_into().ok()?),
            seq: u64::from_be_bytes(s.try_into().ok()?),
        })
    }

    /// The 32-hex-digit text form (NATS `Nats-Msg-Id`, which JetStream also deduplicates on).
    pub fn to_hex(self) -> String {
        // By hand rather than `format!` (once per published message).
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(32);
        for v in [self.producer, self.seq] {
            for i in (0..16).rev() {
                s.push(DIGITS[((v >> (4 * i)) & 0xf) as usize] as char);
            }
        }
        s
    }

    /// Parses the text form.
    pub fn from_hex(s: &str) -> Option<MsgId> {
        if s.len() != 32 || !s.is_ascii() {
            return None;
        }
        Some(MsgId {
            producer: u64::from_str_radix(&s[..16], 16).ok()?,
            seq: u64::from_str_radix(&s[16..], 16).ok()?,
        })
    }
}

/// Hands out the ids of one publisher connection.
#[derive(Debug)]
pub(crate) struct IdSource {
    producer: u64,
    next: AtomicU64,
}

impl IdSource {
    pub(crate) fn new() -> Self {
        IdSource {
            producer: random_u64(),
            next: AtomicU64::new(0),
        }
    }

    /// Reserves `n` consecutive ids; returns the first.
    pub(crate) fn reserve(&self, n: u64) -> MsgId {
        MsgId {
            producer: self.producer,
            seq: self.next.fetch_add(n, Ordering::Relaxed),
        }
    }
}

/// A process-unique, run-unique random value: the clock, the process id and a counter mixed
/// through SipHash with std's random keys.
pub(crate) fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static N: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(N.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.finish()
}

/// The ids of the last `capacity` messages delivered: a message whose id is in the window is
/// a duplicate (a redelivery after a broker restart or a publisher's retry). Memory is bounded
/// by `capacity`; a duplicate arriving after more than `capacity` newer messages is not caught.
///
/// The window is kept as runs of consecutive sequence numbers of one producer, in delivery
/// order: a publisher's messages arrive mostly in order, so the usual insert extends the newest
/// run (and, once the window is full, retires the first id of the oldest) without hashing.
/// While ids that broke runs (publishers interleaved, several partitions) are in the window,
/// a lookup also costs a hash of the producer and a B-tree search. At most `capacity` runs.
#[derive(Debug)]
pub(crate) struct DedupWindow {
    /// The newest run (the one that grows); not in `closed`.
    open: Option<Run>,
    /// The older runs, oldest first, each also in `closed`. No id is in two runs.
    older: VecDeque<Run>,
    /// The older runs per producer: its last sequence number → its first.
    closed: HashMap<u64, BTreeMap<u64, u64>>,
    /// Ids in the window (at most `capacity`).
    len: usize,
    capacity: usize,
}

/// The sequence numbers `first..=last` of one producer.
#[derive(Clone, Copy, Debug)]
struct Run {
    producer: u64,
    first: u64,
    last: u64,
}

impl DedupWindow {
    pub(crate) fn new(capacity: usize) -> Self {
        DedupWindow {
            open: None,
            older: VecDeque::new(),
            closed: HashMap::new(),
            len: 0,
            capacity,
        }
    }

    fn contains(&self, id: MsgId) -> bool {
        if let Some(o) = &self.open
            && o.producer == id.producer
            && o.first <= id.seq
            && id.seq <= o.last
        {
            return true;
        }
        !self.older.is_empty()
            && self
                .closed
                .get(&id.producer)
                .and_then(|runs| runs.range(id.seq..).next())
                .is_some_and(|(_, &first)| first <= id.seq)
    }

    /// Records `id`; returns whether it is new (not in the window).
    pub(crate) fn insert(&mut self, id: MsgId) -> bool {
        if self.capacity == 0 {
            return true;
        }
        if self.contains(id) {
            return false;
        }
        let fresh = Run {
            producer: id.producer,
            first: id.seq,
            last: id.seq,
        };
        match &mut self.open {
            Some(o) if o.producer == id.producer && o.last.checked_add(1) == Some(id.seq) => {
                o.last = id.seq;
            }
            open => {
                if let Some(o) = open.replace(fresh) {
                    self.closed
                        .entry(o.producer)
                        .or_default()
                        .insert(o.last, o.first);
                    self.older.push_back(o);
                }
            }
        }
        self.len += 1;
        if self.len > self.capacity {
            self.forget_oldest();
        }
        true
    }

    /// Drops the oldest id (the first of the oldest run).
    fn forget_oldest(&mut self) {
        if let Some(f) = self.older.front_mut() {
            let emptied = f.first == f.last;
            if let Some(runs) = self.closed.get_mut(&f.producer) {
                if emptied {
                    runs.remove(&f.last);
                    if runs.is_empty() {
                        self.closed.remove(&f.producer);
                    }
                } else if let Some(first) = runs.get_mut(&f.last) {
                    *first += 1;
                }
            }
            if emptied {
                self.older.pop_front();
            } else {
                f.first += 1;
            }
        } else if let Some(o) = &mut self.open {
            if o.first == o.last {
                self.open = None;
            } else {
                o.first += 1;
            }
        } else {
            return;
        }
        self.len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_round_trips() {
        let id = MsgId {
            producer: 0xdead_beef_0123_4567,
            seq: 42,
        };
        assert_eq!(MsgId::from_bytes(&id.to_bytes()), Some(id));
        assert_eq!(MsgId::from_hex(&id.to_hex()), Some(id));
        assert_eq!(id.to_hex(), "deadbeef01234567000000000000002a");
        assert_eq!(MsgId::from_bytes(&[1, 2, 3]), None);
        assert_eq!(MsgId::from_hex("zz"), None);
        assert_eq!(MsgId::from_hex(&"é".repeat(16)), None);
    }

    #[test]
    fn window_forgets_oldest() {
        let mut w = DedupWindow::new(2);
        let id = |seq| MsgId { producer: 1, seq };
        assert!(w.insert(id(1)));
        assert!(!w.insert(id(1)));
        assert!(w.insert(id(2)));
        assert!(w.insert(id(3)));
        assert!(w.insert(id(1)), "1 fell out of a window of 2");
        assert!(!w.insert(id(3)));
    }

    /// The window as a set and a queue of single ids: what [`DedupWindow`] must answer.
    struct Model {
        seen: std::collections::HashSet<MsgId>,
        order: VecDeque<MsgId>,
        capacity: usize,
    }

    impl Model {
        fn insert(&mut self, id: MsgId) -> bool {
            if self.capacity == 0 {
                return true;
            }
            if !self.seen.insert(id) {
                return false;
            }
            if self.order.len() == self.capacity
                && let Some(old) = self.order.pop_front()
            {
                self.seen.remove(&old);
            }
            self.order.push_back(id);
            true
        }
    }

    proptest::proptest! {
        /// Runs, interleaved producers, gaps, repeats and sequence numbers at `u64::MAX`: the
        /// window answers as the set of the last `capacity` ids, and holds at most that many.
        #[test]
        fn window_matches_the_set_of_the_last_ids(
            capacity in 0usize..12,
            ops in proptest::collection::vec((0u64..3, 0u64..24, 0u8..4), 0..300),
        ) {
            // Kind 0: a sequence number from the low end, 1: from the top (up to `u64::MAX`),
            // else the producer's next one (runs), which wraps past `u64::MAX` to 0.
            let mut next = [0u64; 3];
            let mut w = DedupWindow::new(capacity);
            let mut m = Model {
                seen: Default::default(),
                order: VecDeque::new(),
                capacity,
            };
            for (producer, seq, kind) in ops {
                let seq = match kind {
                    0 => seq,
                    1 => u64::MAX - seq,
                    _ => next[producer as usize],
                };
                next[producer as usize] = seq.wrapping_add(1);
                let id = MsgId { producer, seq };
                proptest::prop_assert_eq!(w.insert(id), m.insert(id), "{:?}", id);
                proptest::prop_assert!(w.len <= capacity);
                let held: u64 = w.older.iter().chain(&w.open).map(|r| r.last - r.first + 1).sum();
                proptest::prop_assert_eq!(held, w.len as u64);
                let indexed: usize = w.closed.values().map(BTreeMap::len).sum();
                proptest::prop_assert_eq!(indexed, w.older.len());
            }
        }
    }
}
