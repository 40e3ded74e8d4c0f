//! Message ids (carried in a header or field of every published message) and the bounded
//! window a subscriber deduplicates with.

use std::collections::{HashSet, VecDeque};
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
#[derive(Debug)]
pub(crate) struct DedupWindow {
    seen: HashSet<MsgId>,
    order: VecDeque<MsgId>,
    capacity: usize,
}

impl DedupWindow {
    pub(crate) fn new(capacity: usize) -> Self {
        DedupWindow {
            seen: HashSet::with_capacity(capacity.min(1 << 16)),
            order: VecDeque::with_capacity(capacity.min(1 << 16)),
            capacity,
        }
    }

    /// Records `id`; returns whether it is new (not in the window).
    pub(crate) fn insert(&mut self, id: MsgId) -> bool {
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
}
