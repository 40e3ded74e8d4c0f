//! The wire format (version 1): frame header, acknowledgement, and their codec.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::Error;

use super::LAYER;

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

pub(super) fn bad(what: &'static str) -> Error {
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
