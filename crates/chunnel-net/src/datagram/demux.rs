//! The listener's demultiplexer: per-peer state and queues, the peer table and its hash, the
//! accept backlog and the silent list, and admission and eviction at the peer cap.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::Notify;

use super::config::{Config, SILENT_GRACE};
use super::datapath::DatagramIo;
use super::idle::nanos;
use super::listener::Shared;
use super::lock;

/// The hash of the peer map, looked up for every datagram a listener receives.
///
/// `SipHash` (std's default) costs more than the rest of demultiplexing a datagram. This is
/// a keyed folded multiply (the construction of `foldhash`/`ahash`'s fallback): each word
/// is mixed as `fold(acc ^ word, key)`, where `fold` multiplies to 128 bits and XORs the
/// halves. Trade-off: peers choose their source ports (and, off-path, addresses), so an
/// unkeyed fast hash (FxHash) would let one client flood a bucket; here the 64-bit key is
/// random per listener and never leaves the process, so collisions cannot be precomputed.
/// It is not a cryptographic PRF (an attacker able to measure lookup timing over many
/// probes may learn about the key), which is the same minimal-DoS-resistance level as
/// `foldhash`; the per-peer queues and the backlog stay bounded either way.
#[derive(Clone, Debug)]
struct PeerHash {
    key: u64,
}

impl PeerHash {
    fn new() -> Self {
        use std::hash::BuildHasher;
        // std's per-process random keys, advanced per `RandomState`.
        let key = std::hash::RandomState::new().hash_one(0x5eed_u64) | 1;
        PeerHash { key }
    }
}

impl std::hash::BuildHasher for PeerHash {
    type Hasher = PeerHasher;
    fn build_hasher(&self) -> PeerHasher {
        PeerHasher {
            acc: self.key,
            key: self.key,
        }
    }
}

struct PeerHasher {
    acc: u64,
    key: u64,
}

impl PeerHasher {
    #[inline]
    fn mix(&mut self, word: u64) {
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        let p = u128::from(self.acc ^ word) * u128::from(self.key ^ K);
        self.acc = (p as u64) ^ ((p >> 64) as u64);
    }
}

impl std::hash::Hasher for PeerHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.mix(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            // The length keeps "a" and "a\0" apart.
            self.mix(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }
    fn write_u8(&mut self, n: u8) {
        self.mix(u64::from(n));
    }
    fn write_u16(&mut self, n: u16) {
        self.mix(u64::from(n));
    }
    fn write_u32(&mut self, n: u32) {
        self.mix(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.mix(n);
    }
    fn write_u128(&mut self, n: u128) {
        self.mix(n as u64);
        self.mix((n >> 64) as u64);
    }
    fn write_usize(&mut self, n: usize) {
        self.mix(n as u64);
    }
    fn finish(&self) -> u64 {
        self.acc
    }
}

/// Per-peer state on a listener.
#[derive(Debug)]
pub(super) struct Peer<A> {
    /// The peer's address (the key it has in the map, kept here too so that its connection
    /// and its idle-sweep entry need no copy of their own).
    pub(super) addr: A,
    pub(super) queue: Mutex<PeerQueue>,
    pub(super) notify: Notify,
    pub(super) closed: AtomicBool,
    /// Closed by the idle sweep: the next `recv` reports
    /// [`Error::PeerClosed`](chunnel::Error::PeerClosed) (once).
    pub(super) idled: AtomicBool,
    /// When a message was last handed to the connection, in [`Shared::nanos_now`] units.
    pub(super) last_rx: AtomicU64,
    /// Marked by the layer above as not having sent anything valid yet
    /// ([`chunnel::PeerHandoff::mark_silent`]): at the cap, a new peer may evict it.
    pub(super) silent: AtomicBool,
    /// Listed in [`Demux::silent`] (changed under the demux lock only), so that marking a
    /// connection again does not list it twice.
    pub(super) silent_listed: AtomicBool,
    /// How many receives of this connection wait for the reader role (listed once in
    /// [`Shared::vacancy`] while any do); reset by the reader that offers it the reader role.
    pub(super) wants_reader_role: AtomicU32,
    /// The session its datagrams started ([`chunnel::Listener::recognise_sessions`]); 0:
    /// none yet. Changed under the demux lock only.
    pub(super) session: AtomicU64,
}

/// A peer's received messages, oldest first: the first inline (a connection usually
/// starts with one message, which then needs no allocation), the others behind it, in a
/// queue allocated the first time there are two (a peer that never has two holds no empty
/// queue: every peer of a listener lives as long as its connection).
#[derive(Debug, Default)]
pub(super) struct PeerQueue {
    /// `None` only when the queue is empty.
    first: Option<Bytes>,
    // Boxed on purpose: 8 bytes in every peer instead of an empty deque's 32.
    #[allow(clippy::box_collection)]
    rest: Option<Box<VecDeque<Bytes>>>,
    /// The latest datagram too large for `max_payload`, by its first bytes (boxed: 8 bytes
    /// in every peer, most of which never see one).
    pub(super) oversized: Option<Box<chunnel::Oversized>>,
    /// Bytes of the datagrams queued here.
    bytes: usize,
    /// The listener's count of bytes queued for all its peers ([`Config::queued_bytes`]),
    /// which this queue's bytes are part of until they leave it (or it is dropped).
    total: Option<Arc<AtomicUsize>>,
}

impl Drop for PeerQueue {
    fn drop(&mut self) {
        if let Some(t) = &self.total {
            t.fetch_sub(self.bytes, Ordering::Relaxed);
        }
    }
}

impl PeerQueue {
    /// An empty queue whose bytes count towards `total`.
    pub(super) fn counted(total: &Arc<AtomicUsize>) -> Self {
        PeerQueue {
            first: None,
            rest: None,
            oversized: None,
            bytes: 0,
            total: Some(Arc::clone(total)),
        }
    }

    pub(super) fn one(m: Bytes, total: &Arc<AtomicUsize>) -> Self {
        let mut q = PeerQueue::counted(total);
        q.push_back(m);
        q
    }

    /// Whether `m` fits: under [`Config::peer_queue`] datagrams and
    /// [`Config::peer_queue_bytes`] here, and [`Config::queued_bytes`] in all.
    pub(super) fn has_room(&self, m: &Bytes, cfg: &Config) -> bool {
        self.len() < cfg.peer_queue
            && self.bytes + m.len() <= cfg.peer_queue_bytes
            && self
                .total
                .as_ref()
                .is_none_or(|t| t.load(Ordering::Relaxed) + m.len() <= cfg.queued_bytes)
    }

    pub(super) fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.rest.as_ref().map_or(0, |r| r.len())
    }

    pub(super) fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    pub(super) fn push_back(&mut self, m: Bytes) {
        self.bytes += m.len();
        if let Some(t) = &self.total {
            t.fetch_add(m.len(), Ordering::Relaxed);
        }
        if self.first.is_none() {
            self.first = Some(m);
        } else {
            self.rest.get_or_insert_default().push_back(m);
        }
    }

    pub(super) fn pop_front(&mut self) -> Option<Bytes> {
        let m = self.first.take()?;
        self.first = self.rest.as_mut().and_then(|r| r.pop_front());
        self.bytes -= m.len();
        if let Some(t) = &self.total {
            t.fetch_sub(m.len(), Ordering::Relaxed);
        }
        Some(m)
    }
}

impl<A> Peer<A> {
    pub(super) fn new(addr: A, queue: PeerQueue) -> Self {
        Peer {
            addr,
            queue: Mutex::new(queue),
            notify: Notify::new(),
            closed: AtomicBool::new(false),
            idled: AtomicBool::new(false),
            silent: AtomicBool::new(false),
            silent_listed: AtomicBool::new(false),
            last_rx: AtomicU64::new(0),
            wants_reader_role: AtomicU32::new(0),
            session: AtomicU64::new(0),
        }
    }
}

/// The listener's peers by address: a table of the peers themselves (each knows its
/// address), hashed by [`PeerHash`]: 8 bytes a slot, with no copy of the address beside
/// each (a map from address to peer would take 40).
pub(super) struct PeerMap<A> {
    table: hashbrown::HashTable<Arc<Peer<A>>>,
    hash: PeerHash,
}

impl<A> std::fmt::Debug for PeerMap<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerMap")
            .field("peers", &self.table.len())
            .finish_non_exhaustive()
    }
}

impl<A: Eq + std::hash::Hash> PeerMap<A> {
    pub(super) fn new() -> Self {
        PeerMap {
            table: hashbrown::HashTable::new(),
            hash: PeerHash::new(),
        }
    }

    fn hash_of(&self, addr: &A) -> u64 {
        use std::hash::BuildHasher;
        self.hash.hash_one(addr)
    }

    pub(super) fn get(&self, addr: &A) -> Option<&Arc<Peer<A>>> {
        self.table.find(self.hash_of(addr), |p| p.addr == *addr)
    }

    pub(super) fn contains(&self, addr: &A) -> bool {
        self.get(addr).is_some()
    }

    /// Adds `peer` under its address, in place of any peer there.
    pub(super) fn insert(&mut self, peer: Arc<Peer<A>>) {
        use std::hash::BuildHasher;
        let h = self.hash_of(&peer.addr);
        let hash = &self.hash;
        match self
            .table
            .entry(h, |p| p.addr == peer.addr, |p| hash.hash_one(&p.addr))
        {
            hashbrown::hash_table::Entry::Occupied(mut e) => *e.get_mut() = peer,
            hashbrown::hash_table::Entry::Vacant(e) => {
                e.insert(peer);
            }
        }
    }

    pub(super) fn remove(&mut self, addr: &A) -> Option<Arc<Peer<A>>> {
        let h = self.hash_of(addr);
        self.table
            .find_entry(h, |p| p.addr == *addr)
            .ok()
            .map(|e| e.remove().0)
    }

    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Arc<Peer<A>>> {
        self.table.iter()
    }
}

#[derive(Debug)]
pub(super) struct Demux<A> {
    pub(super) peers: PeerMap<A>,
    pub(super) backlog: VecDeque<Arc<Peer<A>>>,
    /// Accepted connections marked silent, oldest mark first (entries of connections gone,
    /// closed or no longer silent are skipped when met; pruned at twice the peer cap).
    pub(super) silent: VecDeque<std::sync::Weak<Peer<A>>>,
}

impl<A: Eq + std::hash::Hash> Demux<A> {
    /// Closes `peer` and removes it from the map if it is still `addr`'s peer (a new
    /// connection of the same address may have replaced it). Nothing if already closed.
    pub(super) fn leave(&mut self, peer: &Arc<Peer<A>>) {
        if !peer.closed.swap(true, Ordering::AcqRel)
            && self
                .peers
                .get(&peer.addr)
                .is_some_and(|p| Arc::ptr_eq(p, peer))
        {
            self.peers.remove(&peer.addr);
        }
    }
}

/// Recognises a datagram that starts a session ([`chunnel::Listener::recognise_sessions`]).
pub(super) type SessionOf = fn(&[u8]) -> Option<u64>;

impl<S: DatagramIo> Shared<S> {
    /// Whether a datagram from a new address may start a peer (demux lock held), making
    /// room first: while the table is more than half full, peers that waited for `accept`
    /// longer than [`SILENT_GRACE`] are evicted; at [`Config::max_peers`], the oldest peer
    /// still waiting for `accept` is, or the datagram is dropped and counted. Accepted
    /// connections are never evicted here.
    pub(super) fn admit_new(&self, d: &mut Demux<S::Addr>) -> bool {
        if !self.listener_open.load(Ordering::Acquire) {
            self.stats.drop_backlog_full();
            return false;
        }
        let cap = self.cfg.max_peers;
        if d.peers.len() > cap / 2 {
            let now = self.nanos_now();
            let grace = nanos(SILENT_GRACE);
            while let Some(p) = d.backlog.front() {
                if p.last_rx.load(Ordering::Relaxed).saturating_add(grace) > now {
                    break;
                }
                self.evict_front(d);
            }
        }
        if d.peers.len() >= cap && !self.evict_front(d) {
            self.stats.drop_peer_cap();
            return false;
        }
        if d.backlog.len() >= self.cfg.backlog {
            self.stats.drop_backlog_full();
            return false;
        }
        true
    }

    /// Evicts the oldest peer waiting for `accept`, or else the accepted connection marked silent
    /// longest (its next `recv` reports [`Error::PeerClosed`](chunnel::Error::PeerClosed)), demux
    /// lock held; whether there was one.
    fn evict_front(&self, d: &mut Demux<S::Addr>) -> bool {
        if let Some(p) = d.backlog.pop_front() {
            d.leave(&p);
        } else {
            let p = loop {
                let Some(w) = d.silent.pop_front() else {
                    return false;
                };
                if let Some(p) = w.upgrade() {
                    p.silent_listed.store(false, Ordering::Relaxed);
                    if p.silent.load(Ordering::Acquire) && !p.closed.load(Ordering::Acquire) {
                        break p;
                    }
                }
            };
            p.idled.store(true, Ordering::Release);
            d.leave(&p);
            p.notify.notify_waiters();
        }
        self.stats.count_eviction();
        true
    }

    /// Whether `m`, queued for the known peer `p`, starts another session than `p`'s
    /// ([`chunnel::Listener::recognise_sessions`]); a peer without one yet takes `m`'s.
    /// Demux lock held.
    pub(super) fn starts_another_session(&self, p: &Peer<S::Addr>, m: &[u8]) -> bool {
        let Some(id) = self.session_of.get().and_then(|f| f(m)) else {
            return false;
        };
        match p.session.load(Ordering::Relaxed) {
            0 => {
                p.session.store(id, Ordering::Relaxed);
                false
            }
            s => s != id,
        }
    }

    /// A new peer's state, stamped with its arrival (the grace under pressure counts from
    /// it; `accept` restamps it for the idle sweep).
    pub(super) fn new_peer(&self, addr: S::Addr, q: PeerQueue) -> Arc<Peer<S::Addr>> {
        let p = Peer::new(addr, q);
        p.last_rx.store(self.nanos_now(), Ordering::Relaxed);
        Arc::new(p)
    }

    /// A datagram larger than `max_payload` from `addr`: its first bytes and length are kept
    /// (the latest one per peer) for the peer's connection to take
    /// ([`chunnel::PeerHandoff::take_oversized`]); from a new peer it starts a connection,
    /// as any datagram does, so `accept` hands it out and the layer above can answer.
    pub(super) fn note_oversized(
        &self,
        addr: Option<S::Addr>,
        prefix: &[u8],
        len: usize,
        notify: bool,
    ) {
        let Some(addr) = addr else {
            return; // unnamed sender: no way to answer it
        };
        let ev = Box::new(chunnel::Oversized {
            prefix: Bytes::copy_from_slice(prefix),
            len,
            limit: self.cfg.max_payload,
        });
        let mut d = lock(&self.demux);
        if let Some(p) = d.peers.get(&addr) {
            lock(&p.queue).oversized = Some(ev);
            return;
        }
        if !self.admit_new(&mut d) {
            return;
        }
        let mut q = PeerQueue::counted(&self.queued_bytes);
        q.oversized = Some(ev);
        let p = self.new_peer(addr, q);
        d.peers.insert(p.clone());
        d.backlog.push_back(p);
        drop(d);
        if notify {
            self.accept_notify.notify_one();
        }
        self.set_fresh(true);
    }
}
