//! In-order delivery per connection.
//!
//! [`Ordered`] is a Chunnel over any byte connection (`Data = Bytes`). It numbers the
//! messages it sends and its receiver delivers them in that order, holding early arrivals in
//! a bounded reorder buffer and discarding duplicates and late arrivals. Over a base that
//! loses nothing (a reordering-but-lossless link, or [`crate::reliable::Reliable`]), that
//! gives **exactly once, in order**:
//!
//! ```text
//! stack![Ordered::default(), Reliable::default(), udp::Connect::new(addr)]
//! ```
//!
//! # Over a lossy base
//!
//! A lost message would stall delivery forever, so a missing message (a *gap*) is skipped
//! when either
//!
//! * the reorder buffer is full ([`Config::capacity`] messages waiting behind the gap), or
//! * the gap is older than [`Config::gap_timeout`], if one is set ([`Ordered::lossy`]).
//!
//! Delivery then resumes at the lowest buffered message; the skipped message is dropped if it
//! arrives later. So over a lossy base alone `Ordered` gives *in order, at most once, with
//! gaps* (counted in [`Stats::skipped`]). The default has no gap timeout (made for a lossless
//! base); over `Reliable` keep [`Config::capacity`] at least `Reliable`'s window so the
//! buffer never fills.
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
use chunnel::{Capability, Chunnel, ChunnelConnection, Negotiate};

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
    /// Most messages held behind a gap; one more skips the gap.
    pub capacity: usize,
    /// Skip a gap this old (`None`: wait for it, for a base that loses nothing).
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
    pub fn handle_frame(&mut self, frame: Bytes, now: Instant) -> Result<(), Error> {
        let (seq, payload) = decode_frame(frame)?;
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
            self.skip(now);
        }
        Ok(())
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
        })
    }
}

/// A connection through [`Ordered`].
#[derive(Debug)]
pub struct OrderedConnection<C> {
    inner: C,
    m: Mutex<Reorder>,
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
        // Numbered under the lock, in burst order.
        let frames: Vec<Bytes> = {
            let mut m = self.lock();
            burst.into_iter().map(|p| m.send(&p)).collect()
        };
        self.inner.send(frames)
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
                        && m.handle_frame(f, now).is_err()
                    {
                        m.count_malformed();
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
