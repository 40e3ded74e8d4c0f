//! The sans-IO reliability machine ([`Machine`]): sequence numbers, acks, the RFC 6298
//! retransmission timer, the send and receive windows; frames and the clock passed in.

use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use crate::Error;

use super::config::Config;
use super::wire::{Ack, Header, MAX_HEADER, MAX_SACK, bad, decode_frame};

/// Clock granularity `G` of RFC 6298 (tokio timers tick in milliseconds).
const GRANULARITY: Duration = Duration::from_millis(1);

/// The RFC 6298 retransmission timer state.
#[derive(Clone, Debug)]
pub(super) struct Rtt {
    srtt: Option<Duration>,
    rttvar: Duration,
    base: Duration,
    pub(super) backoff: u32,
    min: Duration,
    max: Duration,
}

impl Rtt {
    pub(super) fn new(cfg: &Config) -> Self {
        Rtt {
            srtt: None,
            rttvar: Duration::ZERO,
            base: cfg.initial_rto,
            backoff: 0,
            min: cfg.min_rto,
            max: cfg.max_rto,
        }
    }

    pub(super) fn sample(&mut self, r: Duration) {
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

    pub(super) fn rto(&self) -> Duration {
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
    pub(super) cfg: Config,
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
    pub(super) deliver: VecDeque<Bytes>,
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
