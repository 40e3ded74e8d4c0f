//! The shared region: a header page, then two single-producer single-consumer byte rings
//! (client → server, server → client).
//!
//! ```text
//! offset 0      header: magic, version, ring size, max message, token
//!        64     client state (u32)        128  server state (u32)
//!        1024   ring 0 control: head (+0), tail (+128), sleeping (+256), bell (+384)
//!        1536   ring 1 control (same layout); each word on its own cache line
//!        4096   ring 0 data (ring_bytes)
//!        4096 + ring_bytes   ring 1 data
//! ```
//!
//! A ring holds records `[len: u32][reserved: u32][payload, padded to 8 bytes]` at 8-byte
//! aligned offsets; `len = u32::MAX` pads to the end of the ring (a record never wraps).
//! `head` and `tail` are byte counts that only grow (positions are taken modulo the ring
//! size). The producer writes records, then publishes `head` (Release); the consumer reads
//! `head` (Acquire), copies records out and publishes `tail` (Release). Each side keeps its own
//! position privately and never trusts the peer's copy: every value read from the region is
//! bounds-checked, so a buggy or hostile peer yields `Error::Malformed`, never a panic or an
//! out-of-bounds access.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};
use chunnel::Error;

use crate::sys::{Mapping, futex_wake};

/// Size of the header page.
pub(crate) const HEADER: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"CHNLSHM1");
const VERSION: u32 = 1;
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_RING_BYTES: usize = 16;
const OFF_MAX_MSG: usize = 24;
const OFF_TOKEN: usize = 32;
const OFF_STATE: [usize; 2] = [64, 128];
const OFF_CTL: [usize; 2] = [1024, 1536];
const CTL_HEAD: usize = 0;
const CTL_TAIL: usize = 128;
const CTL_SLEEPING: usize = 256;
const CTL_BELL: usize = 384;
/// Bytes before each record's payload.
pub(crate) const RECORD_HEADER: usize = 8;
const PAD: u32 = u32::MAX;
/// Smallest and largest ring sizes accepted.
pub(crate) const MIN_RING: usize = 4096;
pub(crate) const MAX_RING: usize = 1 << 30;
/// Fresh receive blocks are this large (or the message size if larger); received messages
/// are slices of a block, and a block is reused once the application dropped them all.
const BLOCK: usize = 64 * 1024;

/// A side's state word: set when it has mapped the region, and when it closed its end.
pub(crate) const ATTACHED: u32 = 1;
pub(crate) const CLOSED: u32 = 2;

/// The mapped region with its validated geometry.
#[derive(Debug)]
pub(crate) struct Region {
    map: Mapping,
    ring_bytes: usize,
    max_msg: usize,
}

/// Total file size for two rings of `ring_bytes`.
pub(crate) fn file_len(ring_bytes: usize) -> usize {
    HEADER + 2 * ring_bytes
}

fn round8(n: usize) -> usize {
    n.div_ceil(8) * 8
}

impl Region {
    fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.map.len(),
            "u64 word in range"
        );
        // SAFETY: the mapping is page-aligned and `off` is 8-aligned and in bounds (checked
        // above), so the word is valid and aligned for `AtomicU64` (same layout as `u64`) for
        // as long as `self` (which owns the mapping) is borrowed. Every process touches these
        // words only atomically.
        unsafe { &*(self.map.ptr().add(off) as *const AtomicU64) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off + 4 <= self.map.len(),
            "u32 word in range"
        );
        // SAFETY: as in `u64_at`, for a 4-aligned, in-bounds `AtomicU32`.
        unsafe { &*(self.map.ptr().add(off) as *const AtomicU32) }
    }

    /// Client: lays out a fresh (zero-filled) region.
    pub(crate) fn init(map: Mapping, ring_bytes: usize, max_msg: usize, token: u64) -> Self {
        debug_assert_eq!(map.len(), file_len(ring_bytes));
        let r = Region {
            map,
            ring_bytes,
            max_msg,
        };
        r.u32_at(OFF_VERSION).store(VERSION, Ordering::Relaxed);
        r.u64_at(OFF_RING_BYTES)
            .store(ring_bytes as u64, Ordering::Relaxed);
        r.u64_at(OFF_MAX_MSG)
            .store(max_msg as u64, Ordering::Relaxed);
        r.u64_at(OFF_TOKEN).store(token, Ordering::Relaxed);
        // Published last: a reader that sees the magic sees the rest.
        r.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);
        r
    }

    /// Server: checks a region the client laid out against the token it sent and the file's
    /// real size. Never panics on any content.
    pub(crate) fn attach(map: Mapping, token: u64) -> Result<Self, &'static str> {
        if map.len() < HEADER {
            return Err("the region is smaller than its header");
        }
        let r = Region {
            map,
            ring_bytes: 0,
            max_msg: 0,
        };
        if r.u64_at(OFF_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err("bad magic");
        }
        if r.u32_at(OFF_VERSION).load(Ordering::Relaxed) != VERSION {
            return Err("unsupported version");
        }
        if r.u64_at(OFF_TOKEN).load(Ordering::Relaxed) != token {
            return Err("token mismatch (not the region the client offered)");
        }
        let ring = r.u64_at(OFF_RING_BYTES).load(Ordering::Relaxed);
        let max = r.u64_at(OFF_MAX_MSG).load(Ordering::Relaxed);
        let ring = usize::try_from(ring).map_err(|_| "ring size out of range")?;
        let max = usize::try_from(max).map_err(|_| "max message out of range")?;
        if !(MIN_RING..=MAX_RING).contains(&ring) || !ring.is_power_of_two() {
            return Err("ring size out of range");
        }
        if max == 0 || max > ring / 4 || max > u32::MAX as usize - 8 {
            return Err("max message out of range");
        }
        if r.map.len() != file_len(ring) {
            return Err("file size does not match the ring size");
        }
        Ok(Region {
            ring_bytes: ring,
            max_msg: max,
            ..r
        })
    }

    pub(crate) fn max_msg(&self) -> usize {
        self.max_msg
    }

    pub(crate) fn mapping(&self) -> &Mapping {
        &self.map
    }

    /// State word of side `side` (0 client, 1 server).
    pub(crate) fn state(&self, side: usize) -> &AtomicU32 {
        self.u32_at(OFF_STATE[side])
    }

    pub(crate) fn head(&self, ring: usize) -> &AtomicU64 {
        self.u64_at(OFF_CTL[ring] + CTL_HEAD)
    }

    pub(crate) fn tail(&self, ring: usize) -> &AtomicU64 {
        self.u64_at(OFF_CTL[ring] + CTL_TAIL)
    }

    /// Set by the consumer of `ring` when it is about to block: the producer must then ring.
    pub(crate) fn sleeping(&self, ring: usize) -> &AtomicU32 {
        self.u32_at(OFF_CTL[ring] + CTL_SLEEPING)
    }

    /// The futex word the consumer of `ring` blocks on.
    pub(crate) fn bell(&self, ring: usize) -> &AtomicU32 {
        self.u32_at(OFF_CTL[ring] + CTL_BELL)
    }

    /// Whether `ring` (probably) holds unread records; a hint for waiting, never trusted.
    pub(crate) fn has_data(&self, ring: usize) -> bool {
        self.head(ring).load(Ordering::Acquire) != self.tail(ring).load(Ordering::Relaxed)
    }

    /// Wakes the consumer of `ring` if it said it sleeps.
    pub(crate) fn ring_bell(&self, ring: usize) {
        // Pairs with the consumer's fence between setting `sleeping` and re-checking `head`:
        // either it sees our records or we see its flag.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleeping(ring).load(Ordering::Relaxed) != 0 {
            self.wake(ring);
        }
    }

    /// Wakes the consumer of `ring` unconditionally.
    pub(crate) fn wake(&self, ring: usize) {
        self.bell(ring).fetch_add(1, Ordering::Release);
        futex_wake(self.bell(ring));
    }

    fn data_off(&self, ring: usize) -> usize {
        HEADER + ring * self.ring_bytes
    }
}

/// The producing end of one ring (kept privately by its side).
#[derive(Debug)]
pub(crate) struct Producer {
    ring: usize,
    head: u64,
    tail: u64,
}

impl Producer {
    pub(crate) fn new(ring: usize) -> Self {
        Producer {
            ring,
            head: 0,
            tail: 0,
        }
    }

    /// Appends one record made of `parts` (concatenated). `Ok(false)` when the ring has no
    /// room for it now. The caller checked the size against the maximum. Nothing is visible
    /// to the consumer before [`Producer::publish`].
    pub(crate) fn push(&mut self, r: &Region, parts: [&[u8]; 2]) -> Result<bool, Error> {
        let len = parts[0].len() + parts[1].len();
        debug_assert!(len <= r.max_msg);
        let cap = r.ring_bytes as u64;
        let rec = (RECORD_HEADER + round8(len)) as u64;
        let off = self.head % cap;
        let contiguous = cap - off;
        let need = if rec <= contiguous {
            rec
        } else {
            contiguous + rec
        };
        if need > cap - (self.head - self.tail) {
            let tail = r.tail(self.ring).load(Ordering::Acquire);
            if tail > self.head || self.head - tail > cap || tail < self.tail {
                return Err(Error::Malformed {
                    what: "shared-memory ring tail out of range",
                });
            }
            self.tail = tail;
            if need > cap - (self.head - self.tail) {
                return Ok(false);
            }
        }
        let base = r.data_off(self.ring);
        let mut off = off as usize;
        if rec > contiguous {
            r.u32_at(base + off).store(PAD, Ordering::Relaxed);
            self.head += contiguous;
            off = 0;
        }
        r.u32_at(base + off).store(len as u32, Ordering::Relaxed);
        let mut at = base + off + RECORD_HEADER;
        for p in parts {
            debug_assert!(at + p.len() <= r.map.len());
            // SAFETY: `at .. at + p.len()` lies inside this ring's data (the record fits
            // before the ring's end, checked above) and inside the mapping. The consumer does
            // not read it before we publish `head`, and we own this range until then (it is
            // past the consumer's tail). `p` is local memory, so the ranges do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(p.as_ptr(), r.map.ptr().add(at), p.len());
            }
            at += p.len();
        }
        self.head += rec;
        Ok(true)
    }

    /// Makes every pushed record visible and wakes a sleeping consumer.
    pub(crate) fn publish(&self, r: &Region) {
        r.head(self.ring).store(self.head, Ordering::Release);
        r.ring_bell(self.ring);
    }
}

/// The consuming end of one ring.
#[derive(Debug)]
pub(crate) struct Consumer {
    ring: usize,
    tail: u64,
    block: BytesMut,
}

impl Consumer {
    pub(crate) fn new(ring: usize) -> Self {
        Consumer {
            ring,
            tail: 0,
            block: BytesMut::new(),
        }
    }

    /// Copies up to `slots.len()` records out into `slots` and releases their space.
    /// Returns how many were read. This copy (shared memory → the `Bytes` handed to the
    /// application) is the receive side's one copy; it also means the peer can no longer
    /// change a message once it was validated and delivered.
    pub(crate) fn pop(&mut self, r: &Region, slots: &mut [Option<Bytes>]) -> Result<usize, Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let cap = r.ring_bytes as u64;
        let head = r.head(self.ring).load(Ordering::Acquire);
        if head < self.tail || head - self.tail > cap {
            return Err(Error::Malformed {
                what: "shared-memory ring head out of range",
            });
        }
        let base = r.data_off(self.ring);
        let mut n = 0;
        let start = self.tail;
        while self.tail < head && n < slots.len() {
            let off = (self.tail % cap) as usize;
            let len = r.u32_at(base + off).load(Ordering::Relaxed);
            if len == PAD {
                if off == 0 {
                    return Err(Error::Malformed {
                        what: "shared-memory padding record at the ring start",
                    });
                }
                self.tail += cap - off as u64;
                if self.tail > head {
                    return Err(Error::Malformed {
                        what: "shared-memory padding past the ring head",
                    });
                }
                continue;
            }
            let len = len as usize;
            let rec = RECORD_HEADER + round8(len);
            if len > r.max_msg || rec as u64 > cap - off as u64 || self.tail + rec as u64 > head {
                return Err(Error::Malformed {
                    what: "shared-memory record length out of range",
                });
            }
            if self.block.capacity() - self.block.len() < len {
                // Reclaims the old block in place when every message cut from it is gone.
                self.block.reserve(len.max(BLOCK));
            }
            let dst = self.block.spare_capacity_mut();
            // SAFETY: the source range lies inside this ring's data (bounds checked above)
            // and was published by the producer (`head`, Acquire); the destination is spare
            // capacity of at least `len` bytes (reserved above). A misbehaving peer writing
            // the source range concurrently can only change the copied bytes, not their
            // bounds.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    r.map.ptr().add(base + off + RECORD_HEADER),
                    dst.as_mut_ptr().cast::<u8>(),
                    len,
                );
                self.block.set_len(self.block.len() + len);
            }
            slots[n] = Some(self.block.split().freeze());
            n += 1;
            self.tail += rec as u64;
        }
        if self.tail != start {
            r.tail(self.ring).store(self.tail, Ordering::Release);
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
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
            let _ = p.push(&r, [&[], &[1u8; 100]]);
        }
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
}
