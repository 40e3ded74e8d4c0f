//! In-order delivery per connection.
//!
//! [`Ordered`] is a Chunnel over any byte connection (`Data = Bytes`). It numbers the
//! messages it sends and its receiver delivers them in that order, holding early arrivals in
//! a bounded reorder buffer and discarding duplicates and late arrivals. Over a base that
//! loses nothing (a reordering-but-lossless link, or [`crate::reliable::Reliable`]), that
//! gives **exactly once, in order**:
//!
//! ```
//! # use chunnel::stack;
//! # use chunnel_net::udp;
//! # use chunnel_std::{ordered::Ordered, reliable::Reliable};
//! # let addr: std::net::SocketAddr = "127.0.0.1:9".parse().unwrap();
//! let exactly_once_in_order = stack![Ordered::default(), Reliable::default(), udp::Connect::new(addr)];
//! # let _ = exactly_once_in_order;
//! ```
//!
//! # Many senders on one connection
//!
//! Tasks may send on one connection at once. Senders take turns (a fair queue): a burst is
//! numbered and handed to the inner connection before the next sender numbers its own, so
//! frames enter the inner connection in sequence order and the receiver's reordering is
//! bounded by the inner connection's own (over `Reliable`, its window of unacknowledged
//! messages, 256 by default, well under the default [`Config::capacity`] of 1,024). A sender
//! waiting for room in `Reliable`'s window holds the others back: that is the backpressure.
//! `send` is cancel safe: a burst cancelled part-way is sent again, whole, by the next
//! `send` before its own messages (the receiver discards the copies), so a cancelled send
//! never leaves a gap the receiver would wait for forever.
//!
//! # Over a lossless base (the default)
//!
//! With no [`Config::gap_timeout`] (the default), `Ordered` never skips a message: over a
//! base that loses nothing it delivers **exactly once, in order**. If more than
//! [`Config::capacity`] messages ever wait behind a gap, the base reorders more than the
//! configuration allows (e.g. `Reliable` with a window larger than the capacity): `recv`
//! delivers what is in order and then fails with [`crate::Error::ReorderOverflow`] instead of
//! dropping anything.
//!
//! # Reconfiguration
//!
//! An `OrderedConnection` can be a branch of a reconfigurable select. At the switch point it
//! hands its successor its messages already in order (delivered first by the select) and,
//! as [`OrderedState`], both sequence spaces, the messages waiting behind a gap and a
//! cancelled send's frames: an `Ordered` successor goes on where it stopped.
//!
//! # Over a lossy base
//!
//! A lost message would stall delivery forever, so with a gap timeout ([`Ordered::lossy`]) a
//! missing message (a *gap*) is skipped when either
//!
//! * the reorder buffer is full ([`Config::capacity`] messages waiting behind the gap), or
//! * the gap is older than [`Config::gap_timeout`].
//!
//! Delivery then resumes at the lowest buffered message; the skipped message is dropped if it
//! arrives later. So over a lossy base alone `Ordered::lossy` gives *in order, at most once,
//! with gaps* (counted in [`Stats::skipped`]).
//!
//! # Wire format (version 1)
//!
//! ```text
//! offset  size  field
//! 0       1     version = 0x01
//! 1       8     seq (u64, big endian), 0 for the first message of a connection
//! 9       ...   payload
//! ```
//!
//! [`decode_frame`] returns [`crate::Error::Header`] on malformed input and never panics.
//!
//! # Timers
//!
//! The protocol is a sans-IO machine, [`Reorder`]. Its only timer is the gap timeout, which
//! matters only to a receiver, so [`OrderedConnection`] needs no task: `recv` waits for the
//! inner connection or the gap deadline, whichever comes first. `recv` is cancel safe: once
//! it has taken messages from the inner connection it finishes without awaiting.
//!
//! # Example
//!
//! ```
//! use chunnel::{Chunnel, ChunnelConnection, ChunnelExt, ConnectionExt, Listener, stack};
//! use chunnel_net::udp;
//! use chunnel_std::{ordered::Ordered, reliable::Reliable};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel::Error> {
//! let listener = udp::Listener::bind("127.0.0.1:0".parse().unwrap()).await?;
//! let addr = listener.local_addr()?;
//! let mut server = stack![Ordered::default(), Reliable::default()].serve(listener);
//! let mut client = stack![Ordered::default(), Reliable::default(), udp::Connect::new(addr)];
//!
//! let conn = client.connect_wrap(()).await?;
//! conn.send((0..100u8).map(|i| vec![i].into())).await?;
//! let peer = server.accept().await?;
//! for i in 0..100u8 {
//!     assert_eq!(peer.recv_one().await?, vec![i]);
//! }
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use chunnel::{Capability, Chunnel, ChunnelConnection, Handoff, Handover, Negotiate};

use crate::Error;

const LAYER: &str = "chunnel-std/ordered";

/// The wire format version (the first byte of every frame).
pub const VERSION: u8 = 1;
/// Header length in bytes.
pub const HEADER: usize = 9;

/// Encodes one frame: the header for `seq`, then `payload`.
pub fn encode_frame(seq: u64, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER + payload.len());
    out.put_u8(VERSION);
    out.put_u64(seq);
    out.extend_from_slice(payload);
    out.freeze()
}

/// Splits a frame into its sequence number and payload.
pub fn decode_frame(mut frame: Bytes) -> Result<(u64, Bytes), Error> {
    if frame.len() < HEADER {
        return Err(Error::Header {
            layer: LAYER,
            what: "shorter than the header",
        });
    }
    if frame[0] != VERSION {
        return Err(Error::Header {
            layer: LAYER,
            what: "unknown version",
        });
    }
    frame.advance(1);
    let seq = frame.get_u64();
    Ok((seq, frame))
}

/// Settings of an ordered connection.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Most messages held behind a gap. One more skips the gap when a gap timeout is set,
    /// and fails the connection ([`crate::Error::ReorderOverflow`]) when none is.
    pub capacity: usize,
    /// Skip a gap this old (`None`: never skip, for a base that loses nothing).
    pub gap_timeout: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            capacity: 1024,
            gap_timeout: None,
        }
    }
}

impl Config {
    /// Sets [`Config::capacity`] (at least 1).
    pub fn with_capacity(mut self, n: usize) -> Self {
        self.capacity = n.max(1);
        self
    }
    /// Sets [`Config::gap_timeout`].
    pub fn with_gap_timeout(mut self, t: Option<Duration>) -> Self {
        self.gap_timeout = t;
        self
    }
}

/// Counters of a [`Reorder`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Messages delivered.
    pub delivered: u64,
    /// Messages that arrived early and waited in the buffer.
    pub buffered: u64,
    /// Duplicate or late messages discarded.
    pub discarded: u64,
    /// Sequence numbers skipped as lost.
    pub skipped: u64,
    /// Frames that did not decode (counted by the connection wrapper).
    pub malformed: u64,
}

/// The ordering protocol as a sans-IO state machine (both directions of one connection).
#[derive(Debug)]
pub struct Reorder {
    cfg: Config,
    next_send: u64,
    expected: u64,
    buf: BTreeMap<u64, Bytes>,
    ready: VecDeque<Bytes>,
    gap_since: Option<Instant>,
    /// Set when a lossless machine's buffer overflowed: nothing more is accepted.
    overflowed: bool,
    stats: Stats,
}

impl Reorder {
    /// A fresh machine.
    pub fn new(cfg: Config) -> Self {
        Reorder {
            cfg,
            next_send: 0,
            expected: 0,
            buf: BTreeMap::new(),
            ready: VecDeque::new(),
            gap_since: None,
            overflowed: false,
            stats: Stats::default(),
        }
    }

    /// Numbers one outgoing message and returns its frame.
    pub fn send(&mut self, payload: &[u8]) -> Bytes {
        let seq = self.next_send;
        self.next_send += 1;
        encode_frame(seq, payload)
    }

    /// Handles one frame from the peer.
    ///
    /// Returns [`Error::Header`] for a frame that does not decode (the machine is unchanged)
    /// and [`Error::ReorderOverflow`] when a machine without a gap timeout would have to hold
    /// more than [`Config::capacity`] messages behind a gap; from then on it takes no more
    /// frames (every later one gives the same error) and delivers only what was in order.
    pub fn handle_frame(&mut self, frame: Bytes, now: Instant) -> Result<(), Error> {
        let (seq, payload) = decode_frame(frame)?;
        if self.overflowed {
            return Err(self.overflow_error());
        }
        if seq < self.expected || self.buf.contains_key(&seq) {
            self.stats.discarded += 1;
            return Ok(());
        }
        if seq == self.expected {
            self.ready.push_back(payload);
            self.stats.delivered += 1;
            self.expected += 1;
            self.drain(now);
            return Ok(());
        }
        self.stats.buffered += 1;
        self.buf.insert(seq, payload);
        if self.gap_since.is_none() {
            self.gap_since = Some(now);
        }
        if self.buf.len() > self.cfg.capacity {
            if self.cfg.gap_timeout.is_none() {
                self.overflowed = true;
                return Err(self.overflow_error());
            }
            self.skip(now);
        }
        Ok(())
    }

    fn overflow_error(&self) -> Error {
        Error::ReorderOverflow {
            capacity: self.cfg.capacity,
            waiting_for: self.expected,
        }
    }

    /// True once a lossless machine's reorder buffer overflowed (see
    /// [`Reorder::handle_frame`]).
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// Moves the in-order prefix of the buffer to the ready queue.
    fn drain(&mut self, now: Instant) {
        while let Some(m) = self.buf.remove(&self.expected) {
            self.ready.push_back(m);
            self.stats.delivered += 1;
            self.expected += 1;
        }
        // A gap that remains is a new one.
        self.gap_since = (!self.buf.is_empty()).then_some(now);
    }

    /// Gives up on the current gap: delivery resumes at the lowest buffered message.
    fn skip(&mut self, now: Instant) {
        if let Some((&first, _)) = self.buf.first_key_value() {
            self.stats.skipped += first - self.expected;
            self.expected = first;
            self.drain(now);
        }
    }

    /// When [`Reorder::handle_timeout`] should be called (a gap timeout is pending).
    pub fn poll_timeout(&self) -> Option<Instant> {
        Some(self.gap_since? + self.cfg.gap_timeout?)
    }

    /// Skips the gap if its timeout expired.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.poll_timeout().is_some_and(|t| t <= now) {
            self.skip(now);
        }
    }

    /// The next message in order.
    pub fn poll_deliver(&mut self) -> Option<Bytes> {
        self.ready.pop_front()
    }

    /// The counters.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Counts a frame that did not decode (for wrappers that skip such frames).
    pub fn count_malformed(&mut self) {
        self.stats.malformed += 1;
    }
}

/// The ordering Chunnel; see the [module docs](self).
#[derive(Clone, Debug, Default)]
pub struct Ordered {
    cfg: Config,
}

impl Ordered {
    /// An ordering Chunnel with `cfg`.
    pub fn new(cfg: Config) -> Self {
        Ordered { cfg }
    }

    /// For a lossy base: gaps are skipped after `gap_timeout`.
    pub fn lossy(gap_timeout: Duration) -> Self {
        Ordered {
            cfg: Config {
                gap_timeout: Some(gap_timeout),
                ..Config::default()
            },
        }
    }

    /// Sets [`Config::capacity`] (at least 1).
    pub fn with_capacity(mut self, n: usize) -> Self {
        self.cfg.capacity = n.max(1);
        self
    }
}

impl Negotiate for Ordered {
    fn id(&self) -> &'static str {
        "chunnel-std/ordered/1"
    }

    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::exact("ordered", ["v1"])]
    }
}

impl<C: ChunnelConnection<Data = Bytes>> Chunnel<C> for Ordered {
    type Connection = OrderedConnection<C>;

    async fn connect_wrap(&mut self, inner: C) -> Result<Self::Connection, chunnel::Error> {
        Ok(OrderedConnection {
            inner,
            m: Mutex::new(Reorder::new(self.cfg.clone())),
            turn: tokio::sync::Mutex::new(Vec::new()),
        })
    }
}

/// A connection through [`Ordered`].
#[derive(Debug)]
pub struct OrderedConnection<C> {
    inner: C,
    m: Mutex<Reorder>,
    /// The senders' turn (a fair queue) and, under it, the frames of the burst being handed
    /// to the inner connection: empty between sends unless a send was cancelled part-way.
    turn: tokio::sync::Mutex<Vec<Bytes>>,
}

impl<C> OrderedConnection<C> {
    fn lock(&self) -> MutexGuard<'_, Reorder> {
        self.m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The protocol counters.
    pub fn stats(&self) -> Stats {
        self.lock().stats()
    }

    /// The connection below.
    pub fn get_ref(&self) -> &C {
        &self.inner
    }
}

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

impl<C: ChunnelConnection<Data = Bytes>> ChunnelConnection for OrderedConnection<C> {
    type Data = Bytes;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), chunnel::Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        // The burst is turned into an iterator at once (not kept as `B` in the future).
        let burst = burst.into_iter();
        async move {
            let mut frames = self.turn.lock().await;
            if !frames.is_empty() {
                // A send cancelled part-way: its frames may not all have reached the inner
                // connection. Send them again, first (the receiver discards copies).
                self.inner.send(frames.iter().cloned()).await?;
                frames.clear();
            }
            {
                // Numbered under the lock, in burst order, while holding the turn.
                let mut m = self.lock();
                frames.extend(burst.map(|p| m.send(&p)));
            }
            // On an error the frames stay, to be sent again before the next send's.
            self.inner.send(frames.iter().cloned()).await?;
            frames.clear();
            Ok(())
        }
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, chunnel::Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        loop {
            let deadline = {
                let mut m = self.lock();
                m.handle_timeout(now());
                let mut n = 0;
                while n < slots.len() {
                    let Some(p) = m.poll_deliver() else { break };
                    slots[n] = Some(p);
                    n += 1;
                }
                if n > 0 {
                    return Ok(n);
                }
                if m.overflowed() {
                    return Err(m.overflow_error().into());
                }
                m.poll_timeout()
            };
            let got = match deadline {
                Some(d) => tokio::select! {
                    r = self.inner.recv(slots) => Some(r?),
                    () = tokio::time::sleep_until(d.into()) => None,
                },
                None => Some(self.inner.recv(slots).await?),
            };
            // No await from here on: frames taken are processed at once.
            if let Some(n) = got {
                let now = now();
                let mut m = self.lock();
                for slot in &mut slots[..n] {
                    if let Some(f) = slot.take()
                        && let Err(Error::Header { .. }) = m.handle_frame(f, now)
                    {
                        m.count_malformed();
                    }
                }
            }
        }
    }
}

/// What an [`OrderedConnection`] hands to its successor at a switch: the whole ordering
/// state (both sequence spaces, the messages waiting behind a gap, the counters) and the
/// frames of a send that was cancelled part-way. Messages already in order go to
/// [`Handoff::buffered`], so any successor delivers them; the rest only an `Ordered`
/// successor can take.
#[derive(Debug)]
pub struct OrderedState {
    machine: Reorder,
    unsent: Vec<Bytes>,
}

impl<C: ChunnelConnection<Data = Bytes>> Handover for OrderedConnection<C> {
    fn export(&self, state: &mut Handoff<Bytes>) {
        let mut machine = std::mem::replace(&mut *self.lock(), Reorder::new(Config::default()));
        state.buffered.extend(machine.ready.drain(..));
        // No send runs at the switch point, so the turn is free.
        let unsent = self
            .turn
            .try_lock()
            .map(|mut f| std::mem::take(&mut *f))
            .unwrap_or_default();
        state.put(OrderedState { machine, unsent });
    }

    fn import(&self, state: &mut Handoff<Bytes>) {
        if let Some(OrderedState {
            mut machine,
            unsent,
        }) = state.take::<OrderedState>()
        {
            let mut m = self.lock();
            machine.cfg = m.cfg.clone();
            *m = machine;
            if let Ok(mut f) = self.turn.try_lock() {
                *f = unsent;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gap_timeout_a_full_buffer_fails_and_skips_nothing() {
        let mut tx = Reorder::new(Config::default());
        let frames: Vec<Bytes> = (0..4u8).map(|i| tx.send(&[i])).collect();
        let t0 = Instant::now();
        let mut rx = Reorder::new(Config::default().with_capacity(2));
        rx.handle_frame(frames[1].clone(), t0).unwrap();
        rx.handle_frame(frames[2].clone(), t0).unwrap();
        assert!(matches!(
            rx.handle_frame(frames[3].clone(), t0),
            Err(Error::ReorderOverflow {
                capacity: 2,
                waiting_for: 0
            })
        ));
        assert!(rx.overflowed());
        assert_eq!(rx.poll_deliver(), None, "nothing skipped");
        assert_eq!(rx.stats().skipped, 0);
        // Malformed frames are still told apart from the overflow.
        assert!(matches!(
            rx.handle_frame(Bytes::from_static(b"x"), t0),
            Err(Error::Header { .. })
        ));
    }

    #[test]
    fn reorders_discards_and_skips() {
        let mut tx = Reorder::new(Config::default());
        let frames: Vec<Bytes> = (0..5u8).map(|i| tx.send(&[i])).collect();
        let t0 = Instant::now();
        let mut rx = Reorder::new(Config {
            capacity: 2,
            gap_timeout: Some(Duration::from_millis(10)),
        });
        for i in [1, 1, 0, 0] {
            rx.handle_frame(frames[i].clone(), t0).unwrap();
        }
        let got: Vec<Bytes> = std::iter::from_fn(|| rx.poll_deliver()).collect();
        assert_eq!(got, [&[0u8][..], &[1]]);
        assert_eq!(rx.stats().discarded, 2);
        // 2 is lost: 3 and 4 wait until the gap times out.
        rx.handle_frame(frames[3].clone(), t0).unwrap();
        rx.handle_frame(frames[4].clone(), t0).unwrap();
        assert_eq!(rx.poll_deliver(), None);
        assert_eq!(rx.poll_timeout(), Some(t0 + Duration::from_millis(10)));
        rx.handle_timeout(t0 + Duration::from_millis(10));
        let got: Vec<Bytes> = std::iter::from_fn(|| rx.poll_deliver()).collect();
        assert_eq!(got, [&[3u8][..], &[4]]);
        assert_eq!(rx.stats().skipped, 1);
        rx.handle_frame(frames[2].clone(), t0).unwrap();
        assert_eq!(rx.poll_deliver(), None, "late message discarded");
    }
}
