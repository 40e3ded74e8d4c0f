//! The negotiation wire format, version 2. `docs/wire.md` is the normative description;
//! this module is its implementation.
//!
//! Every datagram (or stream frame) on a negotiated connection starts with a one-byte
//! [`Tag`]. `DATA` messages carry the picked stack's bytes unchanged after the tag; the
//! control messages ([`Hello`], [`Accept`], [`Reject`], [`Close`], those of
//! reconfiguration) follow the layouts below. All integers are big-endian; strings are a
//! `u16` byte length and UTF-8; lists are a `u16` count and their elements. Decoders return [`WireError`] on any input they cannot parse
//! and never panic.

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use chunnel::negotiate::{ChunnelInfo, Match, Mismatch};
use chunnel::{Capability, OfferTree, Pick, StackOption};

mod decode;

use decode::{Reader, version};
pub use decode::{decode_control, hello_session, split_accept_data};

/// The protocol version this implementation speaks.
pub const VERSION: u8 = 2;

/// Most nodes in a hello's offer tree (a decoder refuses more). With [`MAX_TREE_CHOICES`] it
/// bounds the decoder's and the search's work.
pub const MAX_TREE_NODES: usize = 4096;

/// Deepest nesting of a hello's offer tree (selects within selects within layers).
pub const MAX_TREE_DEPTH: usize = 64;

/// The version of a stack record (docs/wire.md §15.1): its layout has not changed since the
/// first wire version, so records kept in a group's store stay readable.
pub const STACK_RECORD_VERSION: u8 = 1;

/// Most choices (selects and explicit option lists) in a hello's offer tree. The server's
/// search recurses once per choice on a path; 512 of them fit a 2 MiB thread stack with room
/// to spare, in a debug build too.
pub const MAX_TREE_CHOICES: usize = 512;

const NODE_LEAF: u8 = 0;
const NODE_SEQ: u8 = 1;
const NODE_SELECT: u8 = 2;
const NODE_OPTIONS: u8 = 3;

/// The first byte of every message on a negotiated connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Tag {
    /// Application data of the picked stack.
    Data = 0x00,
    /// Client offer (optionally with a 0-RTT pick and early data).
    Hello = 0x01,
    /// Server pick.
    Accept = 0x02,
    /// Server refusal.
    Reject = 0x03,
    /// An accept and the server's first reply in one message (see [`split_accept_data`]).
    AcceptData = 0x04,
    /// Either end ends an established connection (see [`Close`]).
    Close = 0x05,
    /// Reconfiguration, phase 1: a proposed new stack (see [`Prepare`]).
    Prepare = 0x10,
    /// Reconfiguration: the peer's answer to a prepare (see [`Vote`]).
    Vote = 0x11,
    /// Reconfiguration, phase 2: switch. Also the initiator's switch point: everything it
    /// sends after this message uses the new stack.
    Commit = 0x12,
    /// Reconfiguration, phase 2: do not switch.
    Abort = 0x13,
    /// Reconfiguration: the follower switched. Its switch point, as `Commit` is the
    /// initiator's.
    Done = 0x14,
}

impl Tag {
    /// Parses a tag byte. `0x00..=0x05` are data, negotiation and close; `0x10..=0x14` are
    /// reconfiguration control; the rest of `0x10..=0x1f` stays reserved for it.
    pub fn from_u8(b: u8) -> Option<Tag> {
        match b {
            0x00 => Some(Tag::Data),
            0x01 => Some(Tag::Hello),
            0x02 => Some(Tag::Accept),
            0x03 => Some(Tag::Reject),
            0x04 => Some(Tag::AcceptData),
            0x05 => Some(Tag::Close),
            0x10 => Some(Tag::Prepare),
            0x11 => Some(Tag::Vote),
            0x12 => Some(Tag::Commit),
            0x13 => Some(Tag::Abort),
            0x14 => Some(Tag::Done),
            _ => None,
        }
    }
}

/// A decoding failure: what was being read when the input ran out or broke a rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed negotiation message: {0}")]
pub struct WireError(pub &'static str);

/// `HELLO` flags.
const HELLO_ZERO_RTT: u8 = 0b0000_0001;
const HELLO_DICTATED: u8 = 0b0000_0010;
const HELLO_KNOWN_FLAGS: u8 = HELLO_ZERO_RTT | HELLO_DICTATED;

/// The client's offer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version of the sender.
    pub version: u8,
    /// A random identifier of this connection attempt; responses echo it.
    pub conn_id: u64,
    /// The client's options: its stack's select structure (linear in the stack), whose
    /// options in preference order are those of the flattened list.
    pub offers: OfferTree,
    /// 0-RTT: the pick (of the client's tree) the client already built and sent data with.
    pub zero_rtt: Option<Pick>,
    /// 0-RTT: the picked stack's first messages (its bottom layer's bytes).
    pub early: Vec<Bytes>,
    /// The client specifies no stack of its own: its single offer lists the Chunnel
    /// implementations it can build, and the server dictates the stack (HotNets paper,
    /// Listing 5).
    pub dictated: bool,
}

/// What the server did with a 0-RTT pick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ZeroRtt {
    /// The hello carried no 0-RTT pick.
    NotOffered = 0,
    /// The 0-RTT pick was accepted; the early data was delivered.
    Accepted = 1,
    /// The 0-RTT pick was refused; the early data was discarded and the client must re-send
    /// it on the stack this accept names.
    Rejected = 2,
}

/// The server's pick.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Accept {
    /// Protocol version of the sender.
    pub version: u8,
    /// The hello's `conn_id`.
    pub conn_id: u64,
    /// The fate of the hello's 0-RTT pick.
    pub zero_rtt: ZeroRtt,
    /// The picked option of the client's tree (one of the hello's offers).
    pub client_pick: Pick,
    /// The picked option of the server's tree.
    pub server_pick: Pick,
    /// The server's chosen stack, top first: what other endpoints can be told (paper §5.1).
    pub server_stack: Arc<[ChunnelInfo]>,
}

/// Why the server refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum RejectReason {
    /// No server option is compatible with any client option.
    Incompatible = 1,
    /// The server does not speak the hello's version.
    Version = 2,
    /// The server could not parse the hello.
    Malformed = 3,
    /// The hello was larger than the server takes in one message: the server read only its
    /// first bytes (see [`TooLarge`]).
    TooLarge = 4,
}

/// What a [`RejectReason::TooLarge`] reject says about the sizes (docs/wire.md §7.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TooLarge {
    /// The largest message the server takes, in bytes.
    pub limit: u32,
    /// The hello's size as the server's transport reported it (0: unknown).
    pub len: u32,
}

/// The server's refusal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reject {
    /// Protocol version of the sender.
    pub version: u8,
    /// The hello's `conn_id` (0 if it could not be read).
    pub conn_id: u64,
    /// Why.
    pub reason: RejectReason,
    /// For `Incompatible`: the first mismatch of each option pair tried (bounded).
    pub mismatches: Vec<Mismatch>,
    /// A human-readable summary.
    pub message: String,
    /// For `TooLarge` (and only then: the encoder writes it for that reason, zeros if
    /// `None`; the decoder reads it for that reason): the server's limit and the size seen.
    pub too_large: Option<TooLarge>,
}

/// A decoded control message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Control {
    /// See [`Hello`].
    Hello(Hello),
    /// See [`Accept`].
    Accept(Accept),
    /// See [`Reject`].
    Reject(Reject),
    /// An accept coalesced with the server's first reply (the bytes that would follow a
    /// `DATA` tag).
    AcceptData(Accept, Bytes),
    /// See [`Prepare`].
    Prepare(Prepare),
    /// See [`Vote`].
    Vote(Vote),
    /// Switch (see [`Tag::Commit`]).
    Commit(Txn),
    /// Do not switch.
    Abort(Txn),
    /// The follower switched (see [`Tag::Done`]).
    Done(Txn),
    /// See [`Close`].
    Close(Close),
}

/// One end ends an established connection (docs/wire.md §7.6): the receiver ends the
/// connection whose `conn_id` this is, after what arrived before it, and frees its state.
/// Sent once, never answered nor retransmitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Close {
    /// Protocol version of the sender.
    pub version: u8,
    /// The connection's `conn_id` (the client's hello's, which the accept echoed).
    pub conn_id: u64,
}

/// Reconfiguration, phase 1: the initiator proposes to switch the connection to `option`
/// (one of its own stack's options, with its pick) in transaction `txn`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepare {
    /// Protocol version of the sender.
    pub version: u8,
    /// A random transaction id; the answers echo it.
    pub txn: u64,
    /// The initiator's new stack: its Chunnels and capabilities, and its pick.
    pub option: StackOption,
}

/// Why a peer votes no.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Refusal {
    /// This peer does not let the other end start a switch.
    NotAllowed = 1,
    /// No option of this peer is compatible with the proposed stack.
    Incompatible = 2,
    /// This peer is in another switch (its own proposal wins).
    Busy = 3,
}

/// A peer's answer to a [`Prepare`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Ready to switch to its option `pick` (stack `stack`, top first) on commit.
    Yes {
        /// The pick of the voter's own tree it will switch to.
        pick: Pick,
        /// The voter's new stack, top first (informative).
        stack: Vec<ChunnelInfo>,
    },
    /// Refused.
    No {
        /// Why.
        reason: Refusal,
        /// For `Incompatible`: what did not match (bounded).
        mismatches: Vec<Mismatch>,
        /// A human-readable summary.
        message: String,
    },
}

/// Reconfiguration: the answer to a [`Prepare`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vote {
    /// Protocol version of the sender.
    pub version: u8,
    /// The prepare's `txn`.
    pub txn: u64,
    /// Yes (with the voter's pick) or no (with the reason).
    pub verdict: Verdict,
}

/// The body of `COMMIT`, `ABORT` and `DONE`: the transaction they decide or confirm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Txn {
    /// Protocol version of the sender.
    pub version: u8,
    /// The transaction.
    pub txn: u64,
}

// ---------------------------------------------------------------------------------------
// Encoding.

fn put_str(b: &mut BytesMut, s: &str) {
    let bytes = s.as_bytes();
    // Strings are bounded by construction (ids, capability kinds, labels); longer ones are
    // cut at a character boundary so the encoder never produces a frame it cannot describe.
    let mut end = bytes.len().min(u16::MAX as usize);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    b.put_u16(end as u16);
    b.put_slice(&bytes[..end]);
}

fn put_count(b: &mut BytesMut, n: usize) -> usize {
    let n = n.min(u16::MAX as usize);
    b.put_u16(n as u16);
    n
}

fn put_pick(b: &mut BytesMut, p: &Pick) {
    let n = put_count(b, p.branches().len());
    b.put_slice(&p.branches()[..n]);
}

fn put_capability(b: &mut BytesMut, c: &Capability) {
    put_str(b, &c.kind);
    b.put_u8(match c.matching {
        Match::Exact => 0,
        Match::Compositional => 1,
    });
    let n = put_count(b, c.labels.len());
    for l in &c.labels[..n] {
        put_str(b, l);
    }
}

fn put_chunnels(b: &mut BytesMut, list: &[ChunnelInfo]) {
    let n = put_count(b, list.len());
    for c in &list[..n] {
        put_chunnel(b, c);
    }
}

fn put_chunnel(b: &mut BytesMut, c: &ChunnelInfo) {
    put_str(b, &c.id);
    let k = put_count(b, c.capabilities.len());
    for cap in &c.capabilities[..k] {
        put_capability(b, cap);
    }
}

/// An offer tree, pre-order (docs/wire.md §6.6). Lists longer than a `u16` count are cut;
/// a layer or select whose parts would lie [`MAX_TREE_DEPTH`] deep is cut to an empty list
/// of options, so the encoder never makes what the decoder refuses for depth (and a tree the
/// decoder took re-encodes to the same bytes).
fn put_tree(b: &mut BytesMut, t: &OfferTree, depth: usize) {
    let has_children = match t {
        OfferTree::Seq(parts) => !parts.is_empty(),
        OfferTree::Select(..) => true,
        OfferTree::Leaf(_) | OfferTree::Options(_) => false,
    };
    if depth + 1 >= MAX_TREE_DEPTH && has_children {
        b.put_u8(NODE_OPTIONS);
        b.put_u16(0);
        return;
    }
    match t {
        OfferTree::Leaf(c) => {
            b.put_u8(NODE_LEAF);
            put_chunnel(b, c);
        }
        OfferTree::Seq(parts) => {
            b.put_u8(NODE_SEQ);
            let n = put_count(b, parts.len());
            for p in &parts[..n] {
                put_tree(b, p, depth + 1);
            }
        }
        OfferTree::Select(l, r) => {
            b.put_u8(NODE_SELECT);
            put_tree(b, l, depth + 1);
            put_tree(b, r, depth + 1);
        }
        OfferTree::Options(list) => {
            b.put_u8(NODE_OPTIONS);
            let n = put_count(b, list.len());
            for o in &list[..n] {
                put_pick(b, &o.pick);
                put_chunnels(b, &o.chunnels);
            }
        }
    }
}

fn put_mismatches(b: &mut BytesMut, list: &[Mismatch]) {
    let n = put_count(b, list.len());
    for m in &list[..n] {
        put_mismatch(b, m);
    }
}

fn put_mismatch(b: &mut BytesMut, m: &Mismatch) {
    b.put_u16(m.client_option);
    b.put_u16(m.server_option);
    put_str(b, &m.kind);
    b.put_u8(match m.matching {
        Match::Exact => 0,
        Match::Compositional => 1,
    });
    put_labels(b, &m.client);
    put_labels(b, &m.server);
}

fn put_labels(b: &mut BytesMut, labels: &Option<Vec<String>>) {
    match labels {
        None => b.put_u8(0),
        Some(l) => {
            b.put_u8(1);
            let n = put_count(b, l.len());
            for s in &l[..n] {
                put_str(b, s);
            }
        }
    }
}

/// Where a hello's `conn_id` lies (tag, version and flags come first).
pub(crate) const HELLO_CONN_ID: std::ops::Range<usize> = 3..11;

impl Hello {
    /// Encodes the message, tag included.
    pub fn encode(&self) -> Bytes {
        self.encode_split().0
    }

    /// Encodes the message, and says where its early data starts (the early message count;
    /// the end when the hello is not 0-RTT): the bytes before it are the same for every
    /// connection with these offers and 0-RTT pick but for the `conn_id`
    /// ([`HELLO_CONN_ID`]); [`Hello::encode_from_prefix`] builds a hello from them.
    pub(crate) fn encode_split(&self) -> (Bytes, usize) {
        let mut b = BytesMut::with_capacity(256);
        b.put_u8(Tag::Hello as u8);
        b.put_u8(self.version);
        let mut flags = 0;
        if self.zero_rtt.is_some() {
            flags |= HELLO_ZERO_RTT;
        }
        if self.dictated {
            flags |= HELLO_DICTATED;
        }
        b.put_u8(flags);
        b.put_u64(self.conn_id);
        put_tree(&mut b, &self.offers, 0);
        let mut split = b.len();
        if let Some(p) = &self.zero_rtt {
            put_pick(&mut b, p);
            split = b.len();
            put_early(&mut b, &self.early);
        }
        (b.freeze(), split)
    }

    /// A 0-RTT hello from the part of an earlier one before its early data
    /// ([`Hello::encode_split`]), for connection `conn_id` with `early`: the same bytes
    /// [`Hello::encode`] makes of that hello with this `conn_id` and early data.
    pub(crate) fn encode_from_prefix(prefix: &[u8], conn_id: u64, early: &[Bytes]) -> Bytes {
        let len = prefix.len() + 2 + early.iter().map(|m| 4 + m.len()).sum::<usize>();
        let mut b = BytesMut::with_capacity(len);
        b.put_slice(prefix);
        if let Some(id) = b.get_mut(HELLO_CONN_ID) {
            id.copy_from_slice(&conn_id.to_be_bytes());
        }
        put_early(&mut b, early);
        b.freeze()
    }
}

/// A 0-RTT hello's early messages: a count, then each length-prefixed.
fn put_early(b: &mut BytesMut, early: &[Bytes]) {
    let n = put_count(b, early.len());
    for m in &early[..n] {
        b.put_u32(m.len() as u32);
        b.put_slice(m);
    }
}

/// Bytes in front of the `ACCEPT` inside an `ACCEPT_DATA` message: the tag and the
/// accept's `u16` length.
pub const ACCEPT_DATA_PREFIX: usize = 3;

/// Where an `ACCEPT` body's `conn_id` lies (the bytes after the tag: version, then
/// `conn_id`). A server rewrites it in a remembered answer; a client recognises a repeated
/// answer by every other byte.
pub(crate) const ACCEPT_CONN_ID: std::ops::Range<usize> = 1..9;

impl Accept {
    /// Encodes the message, tag included.
    pub fn encode(&self) -> Bytes {
        self.encode_with_data_header().0
    }

    /// Encodes the message once for both ways of sending it: `.0` is the `ACCEPT` alone;
    /// `.1` is the header of an `ACCEPT_DATA` message (to be followed by the first reply's
    /// bytes), or `None` when the accept is too long to coalesce. Both share one buffer.
    pub fn encode_with_data_header(&self) -> (Bytes, Option<Bytes>) {
        let mut b = BytesMut::with_capacity(128);
        b.put_slice(&[Tag::AcceptData as u8, 0, 0]);
        self.encode_into(&mut b);
        let len = b.len() - ACCEPT_DATA_PREFIX;
        let coalescable = u16::try_from(len).ok();
        if let Some(l) = coalescable {
            b[1..ACCEPT_DATA_PREFIX].copy_from_slice(&l.to_be_bytes());
        }
        let all = b.freeze();
        let accept = all.slice(ACCEPT_DATA_PREFIX..);
        (accept, coalescable.map(|_| all))
    }

    fn encode_into(&self, b: &mut BytesMut) {
        b.put_u8(Tag::Accept as u8);
        b.put_u8(self.version);
        b.put_u64(self.conn_id);
        b.put_u8(self.zero_rtt as u8);
        put_pick(b, &self.client_pick);
        put_pick(b, &self.server_pick);
        put_chunnels(b, &self.server_stack);
    }
}

impl Prepare {
    /// Encodes the message, tag included.
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(128);
        b.put_u8(Tag::Prepare as u8);
        b.put_u8(self.version);
        b.put_u64(self.txn);
        put_pick(&mut b, &self.option.pick);
        put_chunnels(&mut b, &self.option.chunnels);
        b.freeze()
    }

    /// Decodes a prepare body (the bytes after the tag).
    pub fn decode(body: &[u8]) -> Result<Prepare, WireError> {
        let mut r = Reader { buf: body };
        let version = version(&mut r)?;
        let txn = r.u64("txn")?;
        let pick = r.pick()?;
        let chunnels = r.chunnels()?;
        r.finish()?;
        Ok(Prepare {
            version,
            txn,
            option: StackOption { chunnels, pick },
        })
    }
}

impl Vote {
    /// Encodes the message, tag included.
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(64);
        b.put_u8(Tag::Vote as u8);
        b.put_u8(self.version);
        b.put_u64(self.txn);
        match &self.verdict {
            Verdict::Yes { pick, stack } => {
                b.put_u8(0);
                put_pick(&mut b, pick);
                put_chunnels(&mut b, stack);
            }
            Verdict::No {
                reason,
                mismatches,
                message,
            } => {
                b.put_u8(*reason as u8);
                put_mismatches(&mut b, mismatches);
                put_str(&mut b, message);
            }
        }
        b.freeze()
    }

    /// Decodes a vote body (the bytes after the tag).
    pub fn decode(body: &[u8]) -> Result<Vote, WireError> {
        let mut r = Reader { buf: body };
        let version = version(&mut r)?;
        let txn = r.u64("txn")?;
        let verdict = match r.u8("verdict")? {
            0 => Verdict::Yes {
                pick: r.pick()?,
                stack: r.chunnels()?,
            },
            v @ 1..=3 => Verdict::No {
                reason: match v {
                    1 => Refusal::NotAllowed,
                    2 => Refusal::Incompatible,
                    _ => Refusal::Busy,
                },
                mismatches: r.mismatches()?,
                message: r.str("message")?,
            },
            _ => return Err(WireError("unknown verdict")),
        };
        r.finish()?;
        Ok(Vote {
            version,
            txn,
            verdict,
        })
    }
}

impl Txn {
    /// Encodes the message with `tag` (`Commit`, `Abort` or `Done`).
    pub fn encode(&self, tag: Tag) -> Bytes {
        let mut b = BytesMut::with_capacity(10);
        b.put_u8(tag as u8);
        b.put_u8(self.version);
        b.put_u64(self.txn);
        b.freeze()
    }

    /// Decodes the body of a `COMMIT`, `ABORT` or `DONE` (the bytes after the tag).
    pub fn decode(body: &[u8]) -> Result<Txn, WireError> {
        let mut r = Reader { buf: body };
        let version = version(&mut r)?;
        let txn = r.u64("txn")?;
        r.finish()?;
        Ok(Txn { version, txn })
    }
}

impl Close {
    /// Encodes the message, tag included (10 bytes).
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(10);
        b.put_u8(Tag::Close as u8);
        b.put_u8(self.version);
        b.put_u64(self.conn_id);
        b.freeze()
    }

    /// Decodes a close body (the bytes after the tag).
    pub fn decode(body: &[u8]) -> Result<Close, WireError> {
        let mut r = Reader { buf: body };
        let version = version(&mut r)?;
        let conn_id = r.u64("conn_id")?;
        r.finish()?;
        Ok(Close { version, conn_id })
    }
}

/// The largest message one UDP datagram carries (over IPv4): what a REJECT is cut to by
/// default ([`Reject::encode`]).
pub const MAX_DATAGRAM: usize = 65_507;

/// The bytes of a REJECT besides its mismatches, message text and `TooLarge` sizes: tag,
/// version, `conn_id`, reason, mismatch count, message length.
const REJECT_FIXED: usize = 1 + 1 + 8 + 1 + 2 + 2;

/// The longest prefix of `s` of at most `n` bytes that ends at a character boundary.
fn prefix_at_char(s: &str, n: usize) -> &str {
    let mut end = n.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Reject {
    /// Encodes the message, tag included, cut to fit one UDP datagram ([`MAX_DATAGRAM`]; see
    /// [`Reject::encode_within`]).
    pub fn encode(&self) -> Bytes {
        self.encode_within(MAX_DATAGRAM)
    }

    /// Encodes the message, tag included, in at most `max` bytes (docs/wire.md §7.4.1): if
    /// the whole reject is longer, mismatches are left out from the end, and
    /// ` [cut to fit MAX bytes: K of N mismatches left out]` is appended to the message,
    /// until it fits; if it does not fit with no mismatch either, the message text is cut
    /// (at a character boundary) in front of that note. A `max` below the smallest reject
    /// (15 bytes; 23 for `TooLarge`) gets that smallest one.
    pub fn encode_within(&self, max: usize) -> Bytes {
        let whole = self.encode_parts(&self.mismatches, &self.message);
        if whole.len() <= max {
            return whole;
        }
        let trailer = if self.reason == RejectReason::TooLarge {
            8
        } else {
            0
        };
        let total = self.mismatches.len().min(u16::MAX as usize);
        let sizes: Vec<usize> = self.mismatches[..total]
            .iter()
            .map(|m| {
                let mut b = BytesMut::new();
                put_mismatch(&mut b, m);
                b.len()
            })
            .collect();
        let note = |kept: usize| {
            format!(
                " [cut to fit {max} bytes: {} of {total} mismatches left out]",
                total - kept
            )
        };
        let mut used: usize = REJECT_FIXED + trailer + sizes.iter().sum::<usize>();
        for kept in (1..=total).rev() {
            used -= sizes[kept - 1];
            let kept = kept - 1;
            let text = format!("{}{}", self.message, note(kept));
            if text.len() <= u16::MAX as usize && used + text.len() <= max {
                return self.encode_parts(&self.mismatches[..kept], &text);
            }
        }
        // No mismatch left: the text is cut in front of the note.
        let note = note(0);
        let room = max
            .saturating_sub(REJECT_FIXED + trailer)
            .min(u16::MAX as usize);
        let text = if note.len() <= room {
            format!("{}{note}", prefix_at_char(&self.message, room - note.len()))
        } else {
            prefix_at_char(&note, room).to_owned()
        };
        self.encode_parts(&[], &text)
    }

    fn encode_parts(&self, mismatches: &[Mismatch], message: &str) -> Bytes {
        let mut b = BytesMut::with_capacity(128);
        b.put_u8(Tag::Reject as u8);
        b.put_u8(self.version);
        b.put_u64(self.conn_id);
        b.put_u8(self.reason as u8);
        put_mismatches(&mut b, mismatches);
        put_str(&mut b, message);
        if self.reason == RejectReason::TooLarge {
            let t = self.too_large.unwrap_or(TooLarge { limit: 0, len: 0 });
            b.put_u32(t.limit);
            b.put_u32(t.len);
        }
        b.freeze()
    }
}

/// Encodes a control message, tag included. An [`Control::AcceptData`] whose accept is too
/// long to coalesce (over 65,535 bytes) encodes as the ACCEPT alone, without the data: a
/// sender must then send the data separately (docs/wire.md §7.5).
pub fn encode_control(c: &Control) -> Bytes {
    match c {
        Control::Hello(h) => h.encode(),
        Control::Accept(a) => a.encode(),
        Control::Reject(r) => r.encode(),
        Control::AcceptData(a, data) => match a.encode_with_data_header() {
            (_, Some(h)) => Bytes::from([&h[..], &data[..]].concat()),
            // Too long to coalesce: the best this function can do is the accept alone.
            (accept, None) => accept,
        },
        Control::Prepare(p) => p.encode(),
        Control::Vote(v) => v.encode(),
        Control::Commit(t) => t.encode(Tag::Commit),
        Control::Abort(t) => t.encode(Tag::Abort),
        Control::Done(t) => t.encode(Tag::Done),
        Control::Close(c) => c.encode(),
    }
}

// ---------------------------------------------------------------------------------------
// Stack records (docs/wire.md §15): one concrete stack, as a rendezvous store keeps it.

/// Encodes one concrete stack (its Chunnels, top first) as a self-contained record: the
/// version byte, then the Chunnel list exactly as in a HELLO option. Multi-party negotiation
/// stores this in a key-value store (docs/wire.md §15).
pub fn encode_stack(chunnels: &[ChunnelInfo]) -> Bytes {
    let mut b = BytesMut::with_capacity(64);
    b.put_u8(STACK_RECORD_VERSION);
    put_chunnels(&mut b, chunnels);
    b.freeze()
}

/// Decodes a record written by [`encode_stack`]. Never panics; trailing bytes are an error.
pub fn decode_stack(record: &[u8]) -> Result<Vec<ChunnelInfo>, WireError> {
    let mut r = Reader { buf: record };
    if r.u8("version")? != STACK_RECORD_VERSION {
        return Err(WireError("unsupported stack record version"));
    }
    let list = r.chunnels()?;
    r.finish()?;
    Ok(list)
}
