//! The shared region: a header page, then two single-producer single-consumer byte rings
//! (client → server, server → client).
//!
//! ```text
//! offset 0      header: magic, version, ring size, max message, token
//!        64     client state (u32)        128  server state (u32)
//!        1024   ring 0 control: head (+0), tail (+128), sleeping (+256), bell (+384)
//!        1536   ring 1 control (same layout); each word on its own cache line
//!        2048   ring 0 hole table: oldest hole start (+0), 56 x [start u64][end u64] (+64)
//!        3072   ring 1 hole table (same layout)
//!        4096   ring 0 data (ring_bytes)
//!        4096 + ring_bytes   ring 1 data
//! ```
//!
//! A ring holds records `[len: u32][skip: u32][payload, padded to 8 bytes]` at 8-byte
//! aligned offsets; `len = u32::MAX` pads to the end of the ring (a record never wraps);
//! `len = u32::MAX - 1` is a record carrying no message whose payload area is `skip` bytes (a
//! lent send buffer dropped unsent; `skip` is a multiple of 8). `head` and `tail` are byte
//! counts that only grow (positions are taken modulo the ring size). The producer writes
//! records, then publishes `head` (Release); the consumer reads `head` (Acquire), reads
//! records and publishes `tail` (Release) once it no longer needs their bytes. Each side keeps
//! its own positions privately and never trusts the peer's copy: every value read from the
//! region is bounds-checked, so a buggy or hostile peer yields `Error::Malformed`, never a
//! panic or an out-of-bounds access.
//!
//! **Lending.** Receive: a record lent to the application stays where it is; the consumer
//! moves `tail` past it at once (it is read) and enters it in its ring's *hole table* in the
//! header page (up to [`RX_HOLES`] entries `[start, end)`, plus the oldest start as a hint).
//! The producer never writes a hole's bytes on later laps: before writing a record it checks
//! (one load of the hint when nothing is held long) whether a hole's image in this lap
//! overlaps the record plus one header, and if so writes a skip record up to the hole's end
//! and goes on after it. It keeps one header of the ring free, so it can always write that
//! skip record (a hole is a record's payload, so the skip record's header may take the lent
//! record's own header, already parsed). A payload's drop clears its entry: release happens
//! in any order, and other traffic keeps flowing around held records. The consumer lends no
//! more than [`RX_HOLES`] records or half the ring at once: past that it copies, so the
//! producer always has room. A hole entry is
//! written start then end and read end, start, end again, so a torn read is ignored; the
//! producer only trusts holes wholly behind the `tail` it read, one lap long at most.
//! Send: the producer reserves a record (header written, payload area handed to the
//! application) and publishes `head` only up to the first reservation not yet emitted; a
//! reservation dropped unsent becomes a skip record. At most [`LEND_WINDOW`] reservations
//! are out at once.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};
use chunnel::Error;

use crate::sys::{Mapping, futex_wake};

/// Size of the header page.
pub(crate) const HEADER: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"CHNLSHM1");
/// 2: skip records (lent send buffers dropped unsent).
const VERSION: u32 = 2;
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_RING_BYTES: usize = 16;
const OFF_MAX_MSG: usize = 24;
const OFF_TOKEN: usize = 32;
const OFF_STATE: [usize; 2] = [64, 128];
const OFF_CTL: [usize; 2] = [1024, 1536];
/// Each ring's hole table (written by its consumer): the oldest hole's start (+0), then
/// [`RX_HOLES`] entries `[start: u64][end: u64]` from +64 (`end = 0`: free).
const OFF_HOLES: [usize; 2] = [2048, 3072];
const HOLE_FIRST: usize = 64;
/// Received records lent out at once per connection (entries of the hole table).
pub(crate) const RX_HOLES: usize = 56;
/// The hole hint when there is none.
const NO_HOLE: u64 = u64::MAX;
const CTL_HEAD: usize = 0;
const CTL_TAIL: usize = 128;
const CTL_SLEEPING: usize = 256;
const CTL_BELL: usize = 384;
/// Bytes before each record's payload.
pub(crate) const RECORD_HEADER: usize = 8;
const PAD: u32 = u32::MAX;
const SKIP: u32 = u32::MAX - 1;
/// Lent records (receive) and reservations (send) out at once, per ring end.
pub(crate) const LEND_WINDOW: usize = 256;
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
        for ring in 0..2 {
            r.hole_hint(ring).store(NO_HOLE, Ordering::Relaxed);
        }
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

    /// The oldest live hole's start in `ring` ([`NO_HOLE`]: none); a hint, never trusted.
    pub(crate) fn hole_hint(&self, ring: usize) -> &AtomicU64 {
        self.u64_at(OFF_HOLES[ring])
    }

    fn hole_words(&self, ring: usize, i: usize) -> (&AtomicU64, &AtomicU64) {
        let at = OFF_HOLES[ring] + HOLE_FIRST + i * 16;
        (self.u64_at(at), self.u64_at(at + 8))
    }

    /// Hole `i` of `ring` as `(start, end)`, or `None` when free or changing while read.
    /// Unvalidated: the caller checks it against its own positions.
    pub(crate) fn hole(&self, ring: usize, i: usize) -> Option<(u64, u64)> {
        let (a, b) = self.hole_words(ring, i);
        let end = b.load(Ordering::Acquire);
        if end == 0 {
            return None;
        }
        let start = a.load(Ordering::Acquire);
        (b.load(Ordering::Acquire) == end).then_some((start, end))
    }

    /// Consumer: records hole `i` (`end > 0`), or frees it (`None`).
    fn set_hole(&self, ring: usize, i: usize, h: Option<(u64, u64)>) {
        let (a, b) = self.hole_words(ring, i);
        match h {
            Some((start, end)) => {
                // `end` is stored last: a reader that sees it sees `start` (and a reader
                // that sees the new `start` sees the free `end` before it, so a torn read
                // is caught by its second look at `end`).
                b.store(0, Ordering::Release);
                a.store(start, Ordering::Release);
                b.store(end, Ordering::Release);
            }
            None => b.store(0, Ordering::Release),
        }
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

/// A range of a ring's data lent out: a received record's payload (read only) or a reserved
/// send record's payload area (written by its one holder). Made only here, never cloned, so
/// whoever holds it is the only user of its bytes until it is given back.
#[derive(Debug)]
pub(crate) struct Span {
    off: usize,
    len: usize,
    seq: u64,
}

impl Span {
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Region {
    /// The bytes of a lent span.
    pub(crate) fn span(&self, s: &Span) -> &[u8] {
        assert!(s.off + s.len <= self.map.len(), "span in range");
        // SAFETY: `s` lies inside the mapping (checked) and inside one ring's data (made by
        // the consumer or producer after their bounds checks). It is a published record the
        // producer does not write again until `tail` passes it, which happens only once the
        // span's holder gave it back; or a reservation that only its holder writes. The
        // mapping outlives the borrow of `self`.
        unsafe { std::slice::from_raw_parts(self.map.ptr().add(s.off), s.len) }
    }

    /// The bytes of a lent send reservation, writable by its holder.
    pub(crate) fn span_mut<'a>(&'a self, s: &'a mut Span) -> &'a mut [u8] {
        assert!(s.off + s.len <= self.map.len(), "span in range");
        // SAFETY: as in `span`; a reservation is written only through its one `Span` (not
        // `Clone`), borrowed mutably here, and the consumer reads it only after it was
        // emitted (published), when no `&mut` to it is left.
        unsafe { std::slice::from_raw_parts_mut(self.map.ptr().add(s.off), s.len) }
    }
}

/// One entry of a lending window: the ring position up to which space is freed once this
/// entry (and every earlier one) is done.
#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    start: u64,
    done: bool,
}

/// A bounded window of lent ranges in ring order (sequence numbers `front..back`).
#[derive(Debug)]
struct Window {
    e: Box<[Entry]>,
    front: u64,
    back: u64,
}

impl Window {
    fn new() -> Self {
        Window {
            e: vec![Entry::default(); LEND_WINDOW].into_boxed_slice(),
            front: 0,
            back: 0,
        }
    }

    fn len(&self) -> usize {
        (self.back - self.front) as usize
    }

    fn full(&self) -> bool {
        self.len() == self.e.len()
    }

    fn at(&mut self, seq: u64) -> &mut Entry {
        let n = self.e.len() as u64;
        &mut self.e[(seq % n) as usize]
    }

    fn push(&mut self, start: u64) -> u64 {
        let seq = self.back;
        *self.at(seq) = Entry { start, done: false };
        self.back += 1;
        seq
    }

    /// Marks `seq` done; false when it is not outstanding (never happens: spans are unique).
    fn mark(&mut self, seq: u64) -> bool {
        if seq < self.front || seq >= self.back {
            return false;
        }
        self.at(seq).done = true;
        true
    }

    /// Drops the done prefix; returns the last dropped entry.
    fn advance(&mut self) -> Option<Entry> {
        let mut last = None;
        while self.front < self.back {
            let e = *self.at(self.front);
            if !e.done {
                break;
            }
            last = Some(e);
            self.front += 1;
        }
        last
    }
}

/// The producing end of one ring (kept privately by its side).
#[derive(Debug)]
pub(crate) struct Producer {
    ring: usize,
    head: u64,
    tail: u64,
    /// The hole hint read with `tail`: only holes behind that tail can be in the way until
    /// `tail` is read again (a later hole lies at least a lap past what we may write).
    hint: u64,
    /// Send reservations not yet emitted or dropped.
    resv: Window,
}

impl Producer {
    pub(crate) fn new(ring: usize) -> Self {
        Producer {
            ring,
            head: 0,
            tail: 0,
            hint: NO_HOLE,
            resv: Window::new(),
        }
    }

    /// Claims room for a record of `len` payload bytes and writes its header; returns the
    /// mapping offset of its payload and the record's start position. `None` when the ring
    /// has no room for it now.
    fn claim(&mut self, r: &Region, len: usize) -> Result<Option<(usize, u64)>, Error> {
        debug_assert!(len <= r.max_msg);
        let cap = r.ring_bytes as u64;
        let rec = (RECORD_HEADER + round8(len)) as u64;
        let base = r.data_off(self.ring);
        loop {
            let off = self.head % cap;
            let contiguous = cap - off;
            if rec > contiguous {
                // Pad to the ring's end (a hole's bytes start 8 bytes after a record start, so
                // the ring's end is never inside one).
                if !self.room(r, contiguous)? {
                    return Ok(None);
                }
                r.u32_at(base + off as usize).store(PAD, Ordering::Relaxed);
                self.head += contiguous;
                continue;
            }
            // A lent payload of an earlier lap in the way (with room for the next header, so
            // the producer never stands inside a hole): step over it with a skip record,
            // whose header may take the lent record's own (already parsed) header.
            if let Some(end) = self.hole_in(r, self.head + rec + RECORD_HEADER as u64)? {
                let skip = end - self.head;
                if skip > contiguous || skip < RECORD_HEADER as u64 {
                    return Err(Error::Malformed {
                        what: "shared-memory hole table out of range",
                    });
                }
                if !self.room(r, skip)? {
                    return Ok(None);
                }
                r.u32_at(base + off as usize + 4)
                    .store((skip - RECORD_HEADER as u64) as u32, Ordering::Relaxed);
                r.u32_at(base + off as usize).store(SKIP, Ordering::Relaxed);
                self.head = end;
                continue;
            }
            if !self.room(r, rec)? {
                return Ok(None);
            }
            let off = off as usize;
            r.u32_at(base + off).store(len as u32, Ordering::Relaxed);
            let start = self.head;
            self.head += rec;
            return Ok(Some((base + off + RECORD_HEADER, start)));
        }
    }

    /// Whether `n` more bytes fit, keeping one record header free (so the producer never
    /// stands at the very start of a hole: it can always write a skip record there).
    fn room(&mut self, r: &Region, n: u64) -> Result<bool, Error> {
        let cap = r.ring_bytes as u64;
        let limit = cap - RECORD_HEADER as u64;
        if self.head - self.tail + n <= limit {
            return Ok(true);
        }
        let tail = r.tail(self.ring).load(Ordering::Acquire);
        if tail > self.head || self.head - tail > cap || tail < self.tail {
            return Err(Error::Malformed {
                what: "shared-memory ring tail out of range",
            });
        }
        self.tail = tail;
        // After `tail` (Acquire): the consumer stores the hint before publishing a tail past
        // a new hole, so this is at most as old as that.
        self.hint = r.hole_hint(self.ring).load(Ordering::Acquire);
        Ok(self.head - self.tail + n <= limit)
    }

    /// The end (in this lap) of the first hole whose image in this lap overlaps
    /// `head..until`. Holes are the payloads of records the consumer lent and has not
    /// released; their bytes must not be written until then.
    fn hole_in(&self, r: &Region, until: u64) -> Result<Option<u64>, Error> {
        let cap = r.ring_bytes as u64;
        let oldest = self.hint;
        // Images of a hole lie at least one lap after it.
        if oldest == NO_HOLE || oldest.saturating_add(cap) >= until {
            return Ok(None);
        }
        let mut first: Option<(u64, u64)> = None;
        for i in 0..RX_HOLES {
            let Some((hs, he)) = r.hole(self.ring, i) else {
                continue;
            };
            // Only holes the consumer released the space around (behind our tail) matter;
            // anything else is stale or garbage and cannot be in the way.
            if he <= hs
                || he - hs > cap / 2
                || he > self.tail
                || (hs % cap) == 0
                || !hs.is_multiple_of(8)
                || !he.is_multiple_of(8)
            {
                continue;
            }
            if (he - 1) / cap != hs / cap {
                continue;
            }
            // Its first image ending after head.
            let k = if self.head >= he {
                (self.head - he) / cap + 1
            } else {
                continue;
            };
            let (a, b) = (hs + k * cap, he + k * cap);
            if a < until && b > self.head && first.is_none_or(|(fa, _)| a < fa) {
                first = Some((a, b));
            }
        }
        Ok(first.map(|(_, b)| b))
    }

    /// Appends one record made of `parts` (concatenated). `Ok(false)` when the ring has no
    /// room for it now. The caller checked the size against the maximum. Nothing is visible
    /// to the consumer before [`Producer::publish`].
    pub(crate) fn push(&mut self, r: &Region, parts: [&[u8]; 2]) -> Result<bool, Error> {
        let len = parts[0].len() + parts[1].len();
        let Some((mut at, _)) = self.claim(r, len)? else {
            return Ok(false);
        };
        for p in parts {
            debug_assert!(at + p.len() <= r.map.len());
            // SAFETY: `at .. at + p.len()` lies inside this ring's data (the record fits
            // before the ring's end, checked by `claim`) and inside the mapping. The consumer
            // does not read it before we publish `head`, and we own this range until then (it
            // is past the consumer's tail). `p` is local memory, so the ranges do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(p.as_ptr(), r.map.ptr().add(at), p.len());
            }
            at += p.len();
        }
        Ok(true)
    }

    /// Reserves a record of `len` payload bytes for the application to fill (a lent send
    /// buffer). `None` when the ring has no room now or [`LEND_WINDOW`] reservations are out.
    pub(crate) fn reserve(&mut self, r: &Region, len: usize) -> Result<Option<Span>, Error> {
        if self.resv.full() {
            return Ok(None);
        }
        let Some((off, start)) = self.claim(r, len)? else {
            return Ok(None);
        };
        let seq = self.resv.push(start);
        Ok(Some(Span { off, len, seq }))
    }

    /// Ends reservation `span`: emitted (its bytes are the message) or, when `!emit`, turned
    /// into a skip record. Publish afterwards.
    pub(crate) fn finish(&mut self, r: &Region, span: Span, emit: bool) {
        if !emit {
            let Span { off, len, .. } = span;
            let hdr = off - RECORD_HEADER;
            r.u32_at(hdr + 4)
                .store(round8(len) as u32, Ordering::Relaxed);
            r.u32_at(hdr).store(SKIP, Ordering::Relaxed);
        }
        if self.resv.mark(span.seq) {
            self.resv.advance();
        }
    }

    /// Makes every pushed record visible, up to the first reservation not yet finished, and
    /// wakes a sleeping consumer.
    pub(crate) fn publish(&mut self, r: &Region) {
        let visible = if self.resv.len() > 0 {
            let front = self.resv.front;
            self.resv.at(front).start
        } else {
            self.head
        };
        r.head(self.ring).store(visible, Ordering::Release);
        r.ring_bell(self.ring);
    }
}

/// A record the consumer read: lent (it stays in the ring until [`Consumer::release`]) or
/// copied out.
#[derive(Debug)]
pub(crate) enum Popped {
    Lent(Span),
    Copied(Bytes),
}

/// The consuming end of one ring.
#[derive(Debug)]
pub(crate) struct Consumer {
    ring: usize,
    /// Read position; also what `tail` says (lent records are holes, not unread).
    tail: u64,
    block: BytesMut,
    /// Our copy of the hole table (the shared one is only ever written from here).
    holes: [Option<(u64, u64)>; RX_HOLES],
    live: usize,
    held_bytes: u64,
}

impl Consumer {
    pub(crate) fn new(ring: usize) -> Self {
        Consumer {
            ring,
            tail: 0,
            block: BytesMut::new(),
            holes: [None; RX_HOLES],
            live: 0,
            held_bytes: 0,
        }
    }

    /// Copies up to `slots.len()` records out into `slots` and releases their space.
    /// Returns how many were read. This copy (shared memory → the `Bytes` handed to the
    /// application) is the copying receive's one copy; it also means the peer can no longer
    /// change a message once it was validated and delivered.
    pub(crate) fn pop(&mut self, r: &Region, slots: &mut [Option<Bytes>]) -> Result<usize, Error> {
        let max = slots.len();
        let mut it = slots.iter_mut();
        self.pop_with(r, max, false, |p| {
            if let (Some(s), Popped::Copied(b)) = (it.next(), p) {
                *s = Some(b);
            }
        })
    }

    /// Reads up to `max` records, handing each to `out`: lent when `lend` and the hole table
    /// and the ring allow (see the module docs), else copied. Returns how many were read.
    pub(crate) fn pop_with(
        &mut self,
        r: &Region,
        max: usize,
        lend: bool,
        mut out: impl FnMut(Popped),
    ) -> Result<usize, Error> {
        if max == 0 {
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
        let mut lent_any = false;
        while self.tail < head && n < max {
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
            if len == SKIP {
                let skip = r.u32_at(base + off + 4).load(Ordering::Relaxed) as u64;
                let rec = RECORD_HEADER as u64 + skip;
                if !skip.is_multiple_of(8) || rec > cap - off as u64 || self.tail + rec > head {
                    return Err(Error::Malformed {
                        what: "shared-memory skip record out of range",
                    });
                }
                self.tail += rec;
                continue;
            }
            let len = len as usize;
            let rec = (RECORD_HEADER + round8(len)) as u64;
            if len > r.max_msg || rec > cap - off as u64 || self.tail + rec > head {
                return Err(Error::Malformed {
                    what: "shared-memory record length out of range",
                });
            }
            let at = base + off + RECORD_HEADER;
            if lend
                && self.live < RX_HOLES
                && self.held_bytes + rec <= cap / 2
                && let Some(i) = self.holes.iter().position(Option::is_none)
            {
                // The payload only: the header (already parsed) may be overwritten.
                let h = (self.tail + RECORD_HEADER as u64, self.tail + rec);
                self.holes[i] = Some(h);
                self.live += 1;
                self.held_bytes += rec;
                r.set_hole(self.ring, i, Some(h));
                lent_any = true;
                self.tail += rec;
                out(Popped::Lent(Span {
                    off: at,
                    len,
                    seq: i as u64,
                }));
                n += 1;
                continue;
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
                    r.map.ptr().add(at),
                    dst.as_mut_ptr().cast::<u8>(),
                    len,
                );
                self.block.set_len(self.block.len() + len);
            }
            out(Popped::Copied(self.block.split().freeze()));
            n += 1;
            self.tail += rec;
        }
        if lent_any {
            // Before `tail`: a producer that sees the new tail sees the holes behind it.
            self.publish_hint(r);
        }
        if self.tail != start {
            r.tail(self.ring).store(self.tail, Ordering::Release);
        }
        Ok(n)
    }

    fn publish_hint(&self, r: &Region) {
        let oldest = self.holes.iter().flatten().map(|h| h.0).min();
        r.hole_hint(self.ring)
            .store(oldest.unwrap_or(NO_HOLE), Ordering::Release);
    }

    /// Gives a lent record back: the producer may write its bytes again.
    pub(crate) fn release(&mut self, r: &Region, span: Span) {
        let i = span.seq as usize;
        if let Some(Some((s, e))) = self.holes.get(i).copied() {
            self.holes[i] = None;
            self.live -= 1;
            self.held_bytes -= e - s + RECORD_HEADER as u64;
            r.set_hole(self.ring, i, None);
            self.publish_hint(r);
        }
    }

    /// Lent records not yet given back.
    pub(crate) fn held(&self) -> usize {
        self.live
    }
}

#[cfg(test)]
mod tests;
