//! Acknowledged delivery over a best-effort datagram connection.
//!
//! [`Reliable`] is a Chunnel over any byte connection (`Data = Bytes`) that may lose,
//! duplicate or reorder messages (UDP). Its connection delivers every message sent **exactly
//! once**, as long as the peer stays reachable; the delivery *order* may differ from the send
//! order (put [`crate::ordered::Ordered`] on top for in-order delivery).
//!
//! * Every message carries a sequence number. The receiver acknowledges with a cumulative
//!   ack (every sequence number below it arrived) plus up to [`MAX_SACK`] selective ranges
//!   above it. Acks ride on data frames going the other way, or go alone.
//! * The sender keeps at most [`Config::window`] unacknowledged messages; `send` waits while
//!   the window is full (backpressure: nothing is queued without bound).
//! * Retransmission: a message unacknowledged for one retransmission timeout (RTO) is sent
//!   again. The RTO follows RFC 6298 (SRTT/RTTVAR from RTT samples, `RTO = SRTT +
//!   max(G, 4·RTTVAR)`, clamped to [`Config::min_rto`]..[`Config::max_rto`], doubled on each
//!   expiry until a fresh sample arrives), with Karn's rule: retransmitted messages give no
//!   samples. A message with [`Config::dupthresh`] later messages selectively acked is
//!   retransmitted at once (fast retransmit), once.
//! * The receiver suppresses duplicates (a sequence number below the cumulative ack or
//!   already seen), remembers at most [`Config::recv_window`] sequence numbers above the
//!   cumulative ack, and buffers at most [`Config::recv_buffer`] messages the application has
//!   not received yet. A data message that does not fit is dropped *unacknowledged* and comes
//!   again later.
//! * After [`Config::max_timeouts`] consecutive timeouts with no ack at all from the peer, the
//!   connection fails with [`chunnel::Error::PeerClosed`].
//!
//! # Wire format (version 1)
//!
//! ```text
//! offset  size  field
//! 0       1     version = 0x01
//! 1       1     flags: 0x01 DATA, 0x02 ACK (at least one set; other bits must be zero)
//!               if DATA:
//! +0      8     seq (u64, big endian)
//!               if ACK:
//! +0      8     cumulative (u64 BE): every seq < cumulative was received
//! +8      1     n: number of selective ranges (0..=16)
//! +9      8·n   ranges: start (u32 BE), len (u32 BE): seqs cumulative+start ..
//!               cumulative+start+len were received; start >= 1, len >= 1, ascending, with a
//!               gap of at least one seq between ranges (so an ack has one encoding)
//! rest          payload (DATA frames); an ACK-only frame has no payload
//! ```
//!
//! Decoders ([`decode_frame`], [`Machine::handle_frame`]) return
//! [`crate::Error::Header`] on malformed input and never panic.
//!
//! # Timers and tasks
//!
//! The protocol is a sans-IO state machine, [`Machine`]: frames and time in; frames to send
//! ([`Machine::poll_transmit`]), the next timer deadline ([`Machine::poll_timeout`]) and
//! delivered messages ([`Machine::poll_deliver`]) out. [`ReliableConnection`] drives it with
//! **one background task per connection** (spawned on the current tokio runtime by
//! `connect_wrap`, aborted when the connection is dropped): the task is the only reader of
//! the inner connection; it feeds received frames to the machine, fires the retransmission
//! timer, and sends acks and retransmissions. So retransmission happens even when the
//! application only sends. `send` puts messages into the window and transmits them itself;
//! `recv` takes from the machine's delivery queue (cancel safe: it never awaits after taking
//! a message). Dropping the connection drops unacknowledged messages: call
//! [`ReliableConnection::flush`] first to wait until the peer has them.
//! The task starts reading at the connection's first `send`, `recv` or `flush`.
//!
//! # Reconfiguration
//!
//! A `ReliableConnection` can be a branch of a reconfigurable select (e.g. between two
//! window sizes). At the switch point it hands its successor everything
//! ([`ReliableState`]): messages received but not delivered yet, both sequence spaces, the
//! unacknowledged messages and the RTT estimate. A `Reliable` successor goes on where it
//! stopped, so each end can switch on its own without losing or duplicating a message. The
//! successor's driver starts only when it takes over, so it never reads frames its
//! predecessor should have.
//!
//! # Example
//!
//! ```
//! use chunnel::{Chunnel, ChunnelExt, ConnectionExt, Listener};
//! use chunnel_net::udp;
//! use chunnel_std::reliable::Reliable;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel::Error> {
//! let listener = udp::Listener::bind("127.0.0.1:0".parse().unwrap()).await?;
//! let addr = listener.local_addr()?;
//! let mut server = Reliable::default().serve(listener);
//! let mut client = chunnel::stack![Reliable::default(), udp::Connect::new(addr)];
//!
//! let conn = client.connect_wrap(()).await?;
//! conn.send_one("hello".into()).await?;
//! let peer = server.accept().await?;
//! assert_eq!(peer.recv_one().await?, "hello");
//! conn.flush().await?; // the server acknowledged everything
//! # Ok(()) }
//! ```

use std::collections::{BTreeSet, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use chunnel::{Capability, Chunnel, ChunnelConnection, Handoff, Handover, Negotiate};
use tokio::sync::Notify;

use crate::Error;

const LAYER: &str = "chunnel-std/reliable";

/// The wire format version this module speaks (the first byte of every frame).
pub const VERSION: u8 = 1;
/// Flag bit: the frame carries a data message.
pub const FLAG_DATA: u8 = 0x01;
/// Flag bit: the frame carries an acknowledgement.
pub const FLAG_ACK: u8 = 0x02;
/// Most selective-ack ranges in one frame.
pub const MAX_SACK: usize = 16;
/// The longest header: version, flags, seq, cumulative ack, range count, ranges.
pub const MAX_HEADER: usize = 2 + 8 + 8 + 1 + 8 * MAX_SACK;

/// Clock granularity `G` of RFC 6298 (tokio timers tick in milliseconds).
const GRANULARITY: Duration = Duration::from_millis(1);

fn bad(what: &'static str) -> Error {
    Error::Header { layer: LAYER, what }
}

/// An acknowledgement: everything below `cumulative`, plus the selective `ranges`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ack {
    /// Every sequence number below this one was received.
    pub cumulative: u64,
    /// Received ranges `start..end` above `cumulative` (absolute sequence numbers), ascending
    /// and separated by at least one missing number; `cumulative < start < end`.
    pub ranges: Vec<(u64, u64)>,
}

/// A frame header: a data sequence number, an ack, or both.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Header {
    /// The data message's sequence number (a DATA frame).
    pub seq: Option<u64>,
    /// The acknowledgement carried (an ACK frame, or piggybacked on DATA).
    pub ack: Option<Ack>,
}

impl Header {
    /// Appends the encoding of this header to `out`.
    ///
    /// Ranges that cannot be encoded (more than [`MAX_SACK`], offsets over `u32`, or not
    /// canonical: overlapping, adjacent, unordered, empty) are left out, so whatever this
    /// writes decodes.
    pub fn encode(&self, out: &mut BytesMut) {
        let flags = if self.seq.is_some() { FLAG_DATA } else { 0 }
            | if self.ack.is_some() { FLAG_ACK } else { 0 };
        out.put_u8(VERSION);
        out.put_u8(flags);
        if let Some(seq) = self.seq {
            out.put_u64(seq);
        }
        if let Some(ack) = &self.ack {
            out.put_u64(ack.cumulative);
            let mut ok = Vec::with_capacity(ack.ranges.len().min(MAX_SACK));
            let mut prev_end = ack.cumulative;
            for &(s, e) in &ack.ranges {
                if ok.len() == MAX_SACK {
                    break;
                }
                let fits = s > prev_end
                    && e > s
                    && u32::try_from(s - ack.cumulative).is_ok()
                    && u32::try_from(e - s).is_ok();
                if fits {
                    ok.push(((s - ack.cumulative) as u32, (e - s) as u32));
                    prev_end = e;
                }
            }
            out.put_u8(ok.len() as u8);
            for (s, l) in ok {
                out.put_u32(s);
                out.put_u32(l);
            }
        }
    }

    /// Decodes a header from the front of `frame`; returns it and its length in bytes.
    pub fn decode(frame: &[u8]) -> Result<(Header, usize), Error> {
        let mut b = frame;
        if b.remaining() < 2 {
            return Err(bad("shorter than version and flags"));
        }
        if b.get_u8() != VERSION {
            return Err(bad("unknown version"));
        }
        let flags = b.get_u8();
        if flags & !(FLAG_DATA | FLAG_ACK) != 0 {
            return Err(bad("unknown flag bits"));
        }
        if flags == 0 {
            return Err(bad("neither data nor ack"));
        }
        let mut h = Header::default();
        if flags & FLAG_DATA != 0 {
            if b.remaining() < 8 {
                return Err(bad("truncated sequence number"));
            }
            h.seq = Some(b.get_u64());
        }
        if flags & FLAG_ACK != 0 {
            if b.remaining() < 9 {
                return Err(bad("truncated ack"));
            }
            let cumulative = b.get_u64();
            let n = b.get_u8() as usize;
            if n > MAX_SACK {
                return Err(bad("too many selective ranges"));
            }
            if b.remaining() < 8 * n {
                return Err(bad("truncated selective ranges"));
            }
            let mut ranges = Vec::with_capacity(n);
            let mut prev_end = cumulative;
            for _ in 0..n {
                let start = u64::from(b.get_u32());
                let len = u64::from(b.get_u32());
                let s = cumulative
                    .checked_add(start)
                    .ok_or(bad("selective range overflows"))?;
                let e = s.checked_add(len).ok_or(bad("selective range overflows"))?;
                if len == 0 {
                    return Err(bad("empty selective range"));
                }
                if s <= prev_end {
                    return Err(bad("selective ranges not ascending and apart"));
                }
                ranges.push((s, e));
                prev_end = e;
            }
            h.ack = Some(Ack { cumulative, ranges });
            if h.seq.is_none() && b.has_remaining() {
                return Err(bad("bytes after an ack-only frame"));
            }
        }
        Ok((h, frame.len() - b.remaining()))
    }
}

/// Splits a frame into its header and payload.
pub fn decode_frame(mut frame: Bytes) -> Result<(Header, Bytes), Error> {
    let (h, len) = Header::decode(&frame)?;
    frame.advance(len);
    Ok((h, frame))
}

/// Settings of a reliable connection (both ends should use the same window sizes).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Most unacknowledged messages in flight; `send` waits while this many are.
    pub window: usize,
    /// Most sequence numbers above the cumulative ack the receiver remembers (at least the
    /// peer's `window`, or messages beyond are dropped and sent again).
    pub recv_window: usize,
    /// Most received messages waiting for the application's `recv`.
    pub recv_buffer: usize,
    /// RTO before the first RTT sample.
    pub initial_rto: Duration,
    /// Lower bound of the RTO.
    pub min_rto: Duration,
    /// Upper bound of the RTO (also of the backed-off RTO).
    pub max_rto: Duration,
    /// Consecutive timeouts without any ack before the peer counts as gone.
    pub max_timeouts: u32,
    /// Later messages selectively acked before a missing one is retransmitted at once.
    pub dupthresh: u64,
    /// Largest payload accepted by `send` (the inner connection must carry it plus
    /// [`MAX_HEADER`] bytes).
    pub max_payload: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            window: 256,
            recv_window: 4096,
            recv_buffer: 1024,
            initial_rto: Duration::from_millis(100),
            min_rto: Duration::from_millis(10),
            max_rto: Duration::from_secs(2),
            max_timeouts: 10,
            dupthresh: 3,
            max_payload: 65_507 - MAX_HEADER,
        }
    }
}

impl Config {
    /// Sets [`Config::window`] (at least 1).
    pub fn with_window(mut self, n: usize) -> Self {
        self.window = n.max(1);
        self
    }
    /// Sets [`Config::recv_window`] (at least 1).
    pub fn with_recv_window(mut self, n: usize) -> Self {
        self.recv_window = n.max(1);
        self
    }
    /// Sets [`Config::recv_buffer`] (at least 1).
    pub fn with_recv_buffer(mut self, n: usize) -> Self {
        self.recv_buffer = n.max(1);
        self
    }
    /// Sets the RTO bounds and initial value (`min <= initial <= max` after clamping).
    pub fn with_rto(mut self, initial: Duration, min: Duration, max: Duration) -> Self {
        self.min_rto = min;
        self.max_rto = max.max(min);
        self.initial_rto = initial.clamp(self.min_rto, self.max_rto);
        self
    }
    /// Sets [`Config::max_timeouts`] (at least 1).
    pub fn with_max_timeouts(mut self, n: u32) -> Self {
        self.max_timeouts = n.max(1);
        self
    }
    /// Sets [`Config::max_payload`].
    pub fn with_max_payload(mut self, n: usize) -> Self {
        self.max_payload = n;
        self
    }
}

/// The RFC 6298 retransmission timer state.
#[derive(Clone, Debug)]
struct Rtt {
    srtt: Option<Duration>,
    rttvar: Duration,
    base: Duration,
    backoff: u32,
    min: Duration,
    max: Duration,
}

impl Rtt {
    fn new(cfg: &Config) -> Self {
        Rtt {
            srtt: None,
            rttvar: Duration::ZERO,
            base: cfg.initial_rto,
            backoff: 0,
            min: cfg.min_rto,
            max: cfg.max_rto,
        }
    }

    fn sample(&mut self, r: Duration) {
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(r);
                self.rttvar = (self.rttvar * 3 + diff) / 4;
                self.srtt = Some((s * 7 + r) / 8);
            }
        }
        let srtt = self.srtt.unwrap_or(r);
        self.base = (srtt + (self.rttvar * 4).max(GRANULARITY)).clamp(self.min, self.max);
        self.backoff = 0;
    }

    fn rto(&self) -> Duration {
        self.base
            .checked_mul(1 << self.backoff.min(16))
            .unwrap_or(self.max)
            .clamp(self.min, self.max)
    }
}

/// A sent message waiting for its ack.
#[derive(Clone, Debug)]
struct Unacked {
    payload: Bytes,
    /// When it was last transmitted (`None`: not yet).
    sent: Option<Instant>,
    /// Transmitted more than once (Karn: no RTT sample from it).
    retransmitted: bool,
    /// In the retransmission queue.
    queued: bool,
    /// Fast-retransmitted already.
    fast: bool,
}

/// Counters of one [`Machine`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Data messages accepted from the application.
    pub sent: u64,
    /// Data frames transmitted again (timeouts and fast retransmits).
    pub retransmitted: u64,
    /// Fast retransmissions among them.
    pub fast_retransmits: u64,
    /// Retransmission timer expiries.
    pub timeouts: u64,
    /// Messages delivered to the receive queue.
    pub delivered: u64,
    /// Duplicate data frames suppressed.
    pub duplicates: u64,
    /// Data frames dropped because the receive buffer or window was full.
    pub overflow: u64,
    /// Frames that did not decode (counted by the connection wrapper).
    pub malformed: u64,
    /// The latest smoothed RTT, if any sample was taken.
    pub srtt: Option<Duration>,
    /// The current RTO.
    pub rto: Duration,
}

/// The reliability protocol as a sans-IO state machine (both directions of one connection).
///
/// Feed it application messages ([`Machine::send`]), frames from the network
/// ([`Machine::handle_frame`]) and timer expiries ([`Machine::handle_timeout`]); take frames
/// to transmit ([`Machine::poll_transmit`]), the next deadline ([`Machine::poll_timeout`])
/// and received messages ([`Machine::poll_deliver`]).
#[derive(Debug)]
pub struct Machine {
    cfg: Config,
    // Sender.
    snd_una: u64,
    next_seq: u64,
    next_unsent: u64,
    window: VecDeque<Option<Unacked>>,
    unacked: usize,
    rtx: VecDeque<u64>,
    rtt: Rtt,
    timer: Option<Instant>,
    timeouts_in_a_row: u32,
    last_backoff: Option<Instant>,
    failed: bool,
    // Receiver.
    rcv_cum: u64,
    above: BTreeSet<u64>,
    deliver: VecDeque<Bytes>,
    ack_pending: bool,
    heard: bool,
    stats: Stats,
}

impl Machine {
    /// A fresh machine (sequence numbers start at 0 in both directions).
    pub fn new(cfg: Config) -> Self {
        Machine {
            rtt: Rtt::new(&cfg),
            cfg,
            snd_una: 0,
            next_seq: 0,
            next_unsent: 0,
            window: VecDeque::new(),
            unacked: 0,
            rtx: VecDeque::new(),
            timer: None,
            timeouts_in_a_row: 0,
            last_backoff: None,
            failed: false,
            rcv_cum: 0,
            above: BTreeSet::new(),
            deliver: VecDeque::new(),
            ack_pending: false,
            heard: false,
            stats: Stats::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Whether the window has room for another message.
    pub fn can_send(&self) -> bool {
        self.window.len() < self.cfg.window
    }

    /// Messages sent and not yet acknowledged.
    pub fn unacked(&self) -> usize {
        self.unacked
    }

    /// Whether the peer went silent through [`Config::max_timeouts`] timeouts in a row.
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// The counters.
    pub fn stats(&self) -> Stats {
        Stats {
            srtt: self.rtt.srtt,
            rto: self.rtt.rto(),
            ..self.stats
        }
    }

    /// Counts a frame that did not decode (for wrappers that skip such frames).
    pub fn count_malformed(&mut self) {
        self.stats.malformed += 1;
    }

    /// Accepts one application message into the window and returns its sequence number;
    /// gives the message back if the window is full.
    pub fn send(&mut self, payload: Bytes) -> Result<u64, Bytes> {
        if !self.can_send() {
            return Err(payload);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.window.push_back(Some(Unacked {
            payload,
            sent: None,
            retransmitted: false,
            queued: false,
            fast: false,
        }));
        self.unacked += 1;
        self.stats.sent += 1;
        Ok(seq)
    }

    /// Handles one frame from the peer. A frame that does not decode, or acknowledges a
    /// message never sent, is an error and changes nothing.
    pub fn handle_frame(&mut self, frame: Bytes, now: Instant) -> Result<(), Error> {
        let (h, payload) = decode_frame(frame)?;
        if let Some(ack) = &h.ack {
            let top = ack.ranges.last().map_or(ack.cumulative, |r| r.1);
            if ack.cumulative > self.next_seq || top > self.next_seq {
                return Err(bad("ack for a message never sent"));
            }
        }
        if let Some(ack) = h.ack {
            self.on_ack(ack, now);
        }
        if let Some(seq) = h.seq {
            self.on_data(seq, payload);
        }
        Ok(())
    }

    fn on_ack(&mut self, ack: Ack, now: Instant) {
        self.timeouts_in_a_row = 0;
        let mut newest: Option<Instant> = None;
        let mut acked_any = false;
        let mut take = |slot: &mut Option<Unacked>, unacked: &mut usize| {
            if let Some(u) = slot.take() {
                *unacked -= 1;
                acked_any = true;
                if !u.retransmitted
                    && let Some(t) = u.sent
                {
                    newest = Some(newest.map_or(t, |n: Instant| n.max(t)));
                }
            }
        };
        while self.snd_una < ack.cumulative {
            if let Some(mut slot) = self.window.pop_front() {
                take(&mut slot, &mut self.unacked);
            }
            self.snd_una += 1;
        }
        self.next_unsent = self.next_unsent.max(self.snd_una);
        let mut high = None;
        for &(s, e) in &ack.ranges {
            for seq in s.max(self.snd_una)..e {
                if let Some(slot) = self.window.get_mut((seq - self.snd_una) as usize) {
                    take(slot, &mut self.unacked);
                }
            }
            high = Some(e - 1);
        }
        while matches!(self.window.front(), Some(None)) {
            self.window.pop_front();
            self.snd_una += 1;
        }
        self.next_unsent = self.next_unsent.max(self.snd_una);
        if let Some(t) = newest {
            self.rtt.sample(now.saturating_duration_since(t));
        }
        // Fast retransmit: `dupthresh` later messages arrived, this one did not.
        if let Some(high) = high
            && let Some(limit) = high.checked_sub(self.cfg.dupthresh.saturating_sub(1))
        {
            let mut seq = self.snd_una;
            while seq < limit && seq < self.next_unsent {
                if let Some(Some(u)) = self.window.get_mut((seq - self.snd_una) as usize)
                    && u.sent.is_some()
                    && !u.queued
                    && !u.fast
                {
                    u.fast = true;
                    u.queued = true;
                    u.retransmitted = true;
                    self.rtx.push_back(seq);
                    self.stats.fast_retransmits += 1;
                }
                seq += 1;
            }
        }
        if acked_any {
            self.rearm();
        }
    }

    fn on_data(&mut self, seq: u64, payload: Bytes) {
        self.heard = true;
        if seq < self.rcv_cum || self.above.contains(&seq) {
            self.stats.duplicates += 1;
            self.ack_pending = true;
            return;
        }
        let in_window = seq - self.rcv_cum < self.cfg.recv_window as u64;
        if !in_window || self.deliver.len() >= self.cfg.recv_buffer {
            // Not acknowledged: the sender will try again.
            self.stats.overflow += 1;
            self.ack_pending = true;
            return;
        }
        self.deliver.push_back(payload);
        self.stats.delivered += 1;
        self.ack_pending = true;
        if seq == self.rcv_cum {
            self.rcv_cum += 1;
            while self.above.remove(&self.rcv_cum) {
                self.rcv_cum += 1;
            }
        } else {
            self.above.insert(seq);
        }
    }

    /// The ack describing what this end received.
    fn current_ack(&self) -> Ack {
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for &s in &self.above {
            if let Some(r) = ranges.last_mut()
                && r.1 == s
            {
                r.1 += 1;
            } else if ranges.len() == MAX_SACK {
                break;
            } else {
                ranges.push((s, s + 1));
            }
        }
        Ack {
            cumulative: self.rcv_cum,
            ranges,
        }
    }

    /// The next frame to transmit, if any: retransmissions first, then new messages (each
    /// with an ack piggybacked once this end has received anything), then a standalone ack
    /// if one is due.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Bytes> {
        let mut seq = None;
        while let Some(s) = self.rtx.pop_front() {
            if s < self.snd_una {
                continue;
            }
            if let Some(Some(u)) = self.window.get_mut((s - self.snd_una) as usize) {
                u.queued = false;
                self.stats.retransmitted += 1;
                seq = Some(s);
                break;
            }
        }
        if seq.is_none() && self.next_unsent < self.next_seq {
            seq = Some(self.next_unsent);
            self.next_unsent += 1;
        }
        if let Some(s) = seq {
            let idx = (s - self.snd_una) as usize;
            let Some(Some(u)) = self.window.get_mut(idx) else {
                return self.poll_transmit(now);
            };
            u.sent = Some(now);
            let payload = u.payload.clone();
            let ack = self.heard.then(|| self.current_ack());
            self.ack_pending = false;
            let deadline = now + self.rtt.rto();
            self.timer = Some(self.timer.map_or(deadline, |t| t.min(deadline)));
            let h = Header { seq: Some(s), ack };
            let mut out = BytesMut::with_capacity(MAX_HEADER + payload.len());
            h.encode(&mut out);
            out.extend_from_slice(&payload);
            return Some(out.freeze());
        }
        if self.ack_pending {
            self.ack_pending = false;
            let mut out = BytesMut::with_capacity(MAX_HEADER);
            Header {
                seq: None,
                ack: Some(self.current_ack()),
            }
            .encode(&mut out);
            return Some(out.freeze());
        }
        None
    }

    /// When [`Machine::handle_timeout`] should be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timer
    }

    /// Fires the retransmission timer if it is due: every message unacknowledged for one
    /// RTO is queued again and the RTO doubles (up to [`Config::max_rto`]; at most once per
    /// RTO, as messages have deadlines of their own).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.timer.is_none_or(|t| now < t) {
            return;
        }
        let rto = self.rtt.rto();
        let mut any = false;
        for (i, slot) in self.window.iter_mut().enumerate() {
            if let Some(u) = slot
                && !u.queued
                && u.sent.is_some_and(|t| t + rto <= now)
            {
                u.queued = true;
                u.retransmitted = true;
                self.rtx.push_back(self.snd_una + i as u64);
                any = true;
            }
        }
        // Messages have their own deadlines, so several may expire within one RTO: back off
        // (and count a timeout) at most once per RTO.
        if any && self.last_backoff.is_none_or(|t| t + rto <= now) {
            self.last_backoff = Some(now);
            self.stats.timeouts += 1;
            self.rtt.backoff = self.rtt.backoff.saturating_add(1);
            self.timeouts_in_a_row += 1;
            if self.timeouts_in_a_row >= self.cfg.max_timeouts {
                self.failed = true;
            }
        }
        self.rearm();
    }

    /// Recomputes the timer: the earliest `sent + RTO` of a message in flight.
    fn rearm(&mut self) {
        let rto = self.rtt.rto();
        self.timer = self
            .window
            .iter()
            .flatten()
            .filter(|u| !u.queued)
            .filter_map(|u| u.sent)
            .min()
            .map(|t| t + rto);
    }

    /// The next received message, in arrival order.
    pub fn poll_deliver(&mut self) -> Option<Bytes> {
        self.deliver.pop_front()
    }

    /// Messages received and waiting for [`Machine::poll_deliver`].
    pub fn deliverable(&self) -> usize {
        self.deliver.len()
    }
}

/// The reliability Chunnel: wraps a best-effort byte connection; see the
/// [module docs](self).
#[derive(Clone, Debug, Default)]
pub struct Reliable {
    cfg: Config,
}

impl Reliable {
    /// A reliable Chunnel with `cfg`.
    pub fn new(cfg: Config) -> Self {
        Reliable { cfg }
    }
}

impl Negotiate for Reliable {
    fn id(&self) -> &'static str {
        "chunnel-std/reliable/1"
    }

    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::exact("reliable", ["v1"])]
    }
}

impl<C> Chunnel<C> for Reliable
where
    C: ChunnelConnection<Data = Bytes> + 'static,
{
    type Connection = ReliableConnection<C>;

    async fn connect_wrap(&mut self, inner: C) -> Result<Self::Connection, chunnel::Error> {
        Ok(ReliableConnection::new(inner, self.cfg.clone()))
    }
}

/// Why a connection stopped.
#[derive(Clone, Debug)]
enum Failure {
    PeerClosed,
    Closed,
    Other(String),
}

impl Failure {
    fn of(e: &chunnel::Error) -> Self {
        match e {
            chunnel::Error::PeerClosed => Failure::PeerClosed,
            chunnel::Error::Closed => Failure::Closed,
            e => Failure::Other(e.to_string()),
        }
    }

    fn error(&self) -> chunnel::Error {
        match self {
            Failure::PeerClosed => chunnel::Error::PeerClosed,
            Failure::Closed => chunnel::Error::Closed,
            Failure::Other(s) => chunnel::Error::Layer {
                layer: LAYER,
                source: s.clone().into(),
            },
        }
    }
}

#[derive(Debug)]
struct State {
    m: Machine,
    failure: Option<Failure>,
    /// The state went to a successor at a switch: the driver stops and takes nothing more.
    handed_over: bool,
}

#[derive(Debug)]
struct Shared<C> {
    inner: C,
    state: Mutex<State>,
    /// Messages arrived or the connection failed.
    delivered: Notify,
    /// Window space freed, everything acked, or the connection failed.
    space: Notify,
    /// The timer may have moved earlier (the driver re-reads it).
    timer: Notify,
    /// Set (and `start` notified) by the first send, receive, flush or import.
    started: AtomicBool,
    start: Notify,
}

impl<C> Shared<C> {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets the driver run (it waits for this, so that a connection built ahead of a switch
    /// reads nothing from the inner connection it shares with its predecessor).
    fn start(&self) {
        if !self.started.load(Ordering::Relaxed) && !self.started.swap(true, Ordering::AcqRel) {
            self.start.notify_one();
        }
    }

    fn fail(&self, f: Failure) {
        self.lock().failure.get_or_insert(f);
        self.delivered.notify_waiters();
        self.space.notify_waiters();
    }
}

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Waits until `check` gives a value, re-checking whenever `notify` wakes waiters. Checks
/// register first, so a wake-up between the check and the wait is not lost.
async fn wait_for<T>(notify: &Notify, mut check: impl FnMut() -> Option<T>) -> T {
    loop {
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if let Some(t) = check() {
            return t;
        }
        notified.await;
    }
}

/// A connection through [`Reliable`]: exactly-once delivery (in arrival order).
#[derive(Debug)]
pub struct ReliableConnection<C> {
    shared: Arc<Shared<C>>,
    driver: tokio::task::JoinHandle<()>,
}

impl<C> Drop for ReliableConnection<C> {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl<C: ChunnelConnection<Data = Bytes> + 'static> ReliableConnection<C> {
    /// Wraps `inner` and spawns the connection's driver task on the current tokio runtime.
    /// The driver starts reading the inner connection at the first `send`, `recv` or
    /// [`flush`](Self::flush) (or when the connection takes over a predecessor's state at a
    /// switch), so a connection built ahead of a switch reads nothing its predecessor should.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn new(inner: C, cfg: Config) -> Self {
        let shared = Arc::new(Shared {
            inner,
            state: Mutex::new(State {
                m: Machine::new(cfg),
                failure: None,
                handed_over: false,
            }),
            delivered: Notify::new(),
            space: Notify::new(),
            timer: Notify::new(),
            started: AtomicBool::new(false),
            start: Notify::new(),
        });
        let driver = tokio::spawn(drive(shared.clone()));
        ReliableConnection { shared, driver }
    }
}

impl<C> ReliableConnection<C> {
    /// Waits until the peer acknowledged every message sent so far.
    pub async fn flush(&self) -> Result<(), chunnel::Error> {
        self.shared.start();
        wait_for(&self.shared.space, || {
            let st = self.shared.lock();
            if let Some(f) = &st.failure {
                Some(Err(f.error()))
            } else if st.m.unacked() == 0 {
                Some(Ok(()))
            } else {
                None
            }
        })
        .await
    }

    /// The protocol counters.
    pub fn stats(&self) -> Stats {
        self.shared.lock().m.stats()
    }

    /// The connection below.
    pub fn get_ref(&self) -> &C {
        &self.shared.inner
    }
}

/// The per-connection task: reads frames, fires timers, sends acks and retransmissions.
async fn drive<C: ChunnelConnection<Data = Bytes>>(s: Arc<Shared<C>>) {
    if !s.started.load(Ordering::Acquire) {
        s.start.notified().await;
    }
    let mut slots: Vec<Option<Bytes>> = vec![None; 32];
    loop {
        let deadline = s.lock().m.poll_timeout();
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d.into()).await,
                None => std::future::pending().await,
            }
        };
        let got = tokio::select! {
            r = s.inner.recv(&mut slots) => Some(r),
            () = sleep => None,
            () = s.timer.notified() => None,
        };
        let now = now();
        let mut frames = Vec::new();
        let (deliverable, failed) = {
            let mut st = s.lock();
            if st.handed_over {
                // Frames taken after the switch point go unacknowledged: the peer sends
                // them again, to the successor.
                return;
            }
            match got {
                Some(Ok(n)) => {
                    for slot in &mut slots[..n] {
                        if let Some(f) = slot.take()
                            && st.m.handle_frame(f, now).is_err()
                        {
                            st.m.count_malformed();
                        }
                    }
                }
                Some(Err(e)) => {
                    drop(st);
                    s.fail(Failure::of(&e));
                    return;
                }
                None => {}
            }
            st.m.handle_timeout(now);
            while let Some(f) = st.m.poll_transmit(now) {
                frames.push(f);
            }
            (st.m.deliverable() > 0, st.m.failed())
        };
        if failed {
            s.fail(Failure::PeerClosed);
            return;
        }
        if deliverable {
            s.delivered.notify_waiters();
        }
        s.space.notify_waiters();
        if !frames.is_empty()
            && let Err(e) = s.inner.send(frames).await
        {
            s.fail(Failure::of(&e));
            return;
        }
    }
}

impl<C: ChunnelConnection<Data = Bytes>> ChunnelConnection for ReliableConnection<C> {
    type Data = Bytes;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), chunnel::Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        let s = &self.shared;
        s.start();
        async move {
            let mut msgs = burst.into_iter();
            let mut pending: Option<Bytes> = None;
            loop {
                let mut frames = Vec::new();
                let mut too_large = None;
                let full = {
                    let mut st = s.lock();
                    if let Some(f) = &st.failure {
                        return Err(f.error());
                    }
                    let now = now();
                    let mut full = false;
                    while let Some(m) = pending.take().or_else(|| msgs.next()) {
                        let max = st.m.config().max_payload;
                        if m.len() > max {
                            // Send what was accepted, then report.
                            too_large = Some(chunnel::Error::MessageTooLarge { len: m.len(), max });
                            break;
                        }
                        if let Err(m) = st.m.send(m) {
                            pending = Some(m);
                            full = true;
                            break;
                        }
                    }
                    while let Some(f) = st.m.poll_transmit(now) {
                        frames.push(f);
                    }
                    full
                };
                if !frames.is_empty() {
                    s.timer.notify_one();
                    s.inner.send(frames).await?;
                }
                if let Some(e) = too_large {
                    return Err(e);
                }
                if !full {
                    return Ok(());
                }
                wait_for(&s.space, || {
                    let st = s.lock();
                    (st.failure.is_some() || st.m.can_send()).then_some(())
                })
                .await;
            }
        }
    }

    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Bytes>],
    ) -> impl Future<Output = Result<usize, chunnel::Error>> + Send + 'a {
        let s = &self.shared;
        s.start();
        async move {
            if slots.is_empty() {
                return Ok(0);
            }
            wait_for(&s.delivered, || {
                let mut st = s.lock();
                let mut n = 0;
                while n < slots.len() {
                    let Some(m) = st.m.poll_deliver() else { break };
                    slots[n] = Some(m);
                    n += 1;
                }
                if n > 0 {
                    Some(Ok(n))
                } else {
                    st.failure.as_ref().map(|f| Err(f.error()))
                }
            })
            .await
        }
    }
}

/// What a [`ReliableConnection`] hands to its successor at a switch: the whole protocol
/// state (both sequence spaces, the unacknowledged messages, the RTT estimate, the counters).
/// Messages received but not yet delivered go to [`Handoff::buffered`], so any successor
/// delivers them; the rest only a `Reliable` successor can take, which then goes on where
/// this one stopped (same sequence numbers, so the peer needs no switch of its own and
/// nothing is lost or delivered twice). A successor of another kind gets no unacknowledged
/// messages: [`flush`](ReliableConnection::flush) before such a switch.
#[derive(Debug)]
pub struct ReliableState {
    machine: Machine,
}

impl<C: ChunnelConnection<Data = Bytes>> Handover for ReliableConnection<C> {
    fn export(&self, state: &mut Handoff<Bytes>) {
        let machine = {
            let mut st = self.shared.lock();
            st.handed_over = true;
            st.failure.get_or_insert(Failure::Closed);
            let cfg = st.m.cfg.clone();
            std::mem::replace(&mut st.m, Machine::new(cfg))
        };
        self.driver.abort();
        let mut machine = machine;
        state.buffered.extend(machine.deliver.drain(..));
        state.put(ReliableState { machine });
    }

    fn import(&self, state: &mut Handoff<Bytes>) {
        if let Some(ReliableState { mut machine }) = state.take::<ReliableState>() {
            let mut st = self.shared.lock();
            machine.cfg = st.m.cfg.clone();
            st.m = machine;
        }
        // Go on at once: retransmit, acknowledge, whether or not the application calls.
        self.shared.start();
        self.shared.timer.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rto_follows_rfc6298() {
        let cfg = Config::default();
        let mut r = Rtt::new(&cfg);
        assert_eq!(r.rto(), cfg.initial_rto);
        r.sample(Duration::from_millis(40));
        // SRTT = 40, RTTVAR = 20: RTO = 40 + 80.
        assert_eq!(r.rto(), Duration::from_millis(120));
        r.backoff = 2;
        assert_eq!(r.rto(), Duration::from_millis(480));
        r.backoff = 10;
        assert_eq!(r.rto(), cfg.max_rto);
        r.sample(Duration::from_millis(40));
        assert_eq!(r.backoff, 0);
    }

    #[test]
    fn karn_and_backoff() {
        let cfg = Config::default();
        let mut a = Machine::new(cfg.clone());
        let mut b = Machine::new(cfg);
        let t0 = Instant::now();
        a.send(Bytes::from_static(b"x")).unwrap();
        let f = a.poll_transmit(t0).unwrap();
        assert_eq!(a.poll_timeout(), Some(t0 + Duration::from_millis(100)));
        // Lost; the timer fires and the RTO doubles.
        drop(f);
        let t1 = t0 + Duration::from_millis(100);
        a.handle_timeout(t1);
        let f = a.poll_transmit(t1).unwrap();
        assert_eq!(a.stats().rto, Duration::from_millis(200));
        b.handle_frame(f, t1).unwrap();
        assert_eq!(b.poll_deliver().as_deref(), Some(&b"x"[..]));
        let ack = b.poll_transmit(t1).unwrap();
        a.handle_frame(ack, t1 + Duration::from_millis(5)).unwrap();
        // Karn: the retransmitted message gave no sample; the backoff stays.
        assert_eq!(a.stats().srtt, None);
        assert_eq!(a.unacked(), 0);
        assert_eq!(a.poll_timeout(), None);
    }
}
