//! Decoding: a bounds-checked reader and the decoders of every message. Never panics on
//! bytes from a peer; each failure is a [`WireError`] naming what was being read.

use std::borrow::Cow;

use bytes::{Buf, Bytes};
use chunnel::negotiate::{ChunnelInfo, Match, Mismatch};
use chunnel::{Capability, OfferTree, Pick, StackOption};

use super::{
    ACCEPT_DATA_PREFIX, Accept, Close, Control, HELLO_DICTATED, HELLO_KNOWN_FLAGS, HELLO_ZERO_RTT,
    Hello, MAX_TREE_CHOICES, MAX_TREE_DEPTH, MAX_TREE_NODES, NODE_LEAF, NODE_OPTIONS, NODE_SELECT,
    NODE_SEQ, Prepare, Reject, RejectReason, Tag, TooLarge, Txn, VERSION, Vote, WireError, ZeroRtt,
};

/// A bounds-checked reader over one message.
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn need(&self, n: usize, what: &'static str) -> Result<(), WireError> {
        if self.buf.remaining() < n {
            Err(WireError(what))
        } else {
            Ok(())
        }
    }

    pub(super) fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        self.need(1, what)?;
        Ok(self.buf.get_u8())
    }

    pub(super) fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        self.need(2, what)?;
        Ok(self.buf.get_u16())
    }

    pub(super) fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        self.need(4, what)?;
        Ok(self.buf.get_u32())
    }

    pub(super) fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        self.need(8, what)?;
        Ok(self.buf.get_u64())
    }

    pub(super) fn bytes(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        self.need(n, what)?;
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    pub(super) fn str(&mut self, what: &'static str) -> Result<String, WireError> {
        let n = self.u16(what)? as usize;
        let b = self.bytes(n, what)?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| WireError("string is not UTF-8"))
    }

    /// A list count; each element takes at least `min_elem` bytes, so a count the rest of
    /// the message cannot hold is rejected before anything is allocated for it.
    pub(super) fn count(
        &mut self,
        min_elem: usize,
        what: &'static str,
    ) -> Result<usize, WireError> {
        let n = self.u16(what)? as usize;
        if n.saturating_mul(min_elem) > self.buf.remaining() {
            return Err(WireError(what));
        }
        Ok(n)
    }

    pub(super) fn matching(&mut self) -> Result<Match, WireError> {
        match self.u8("capability matching")? {
            0 => Ok(Match::Exact),
            1 => Ok(Match::Compositional),
            _ => Err(WireError("capability matching is neither 0 nor 1")),
        }
    }

    pub(super) fn skip_str(&mut self, what: &'static str) -> Result<(), WireError> {
        let n = self.u16(what)? as usize;
        self.bytes(n, what).map(drop)
    }

    /// Steps over what [`Reader::pick`] reads (the layout only).
    pub(super) fn skip_pick(&mut self) -> Result<(), WireError> {
        let n = self.count(1, "pick length")?;
        self.bytes(n, "pick branches").map(drop)
    }

    /// Steps over what [`Reader::chunnels`] reads (the layout only).
    pub(super) fn skip_chunnels(&mut self) -> Result<(), WireError> {
        let n = self.count(4, "chunnel count")?;
        for _ in 0..n {
            self.skip_chunnel()?;
        }
        Ok(())
    }

    /// An offer tree; `nodes` counts the nodes and choices read so far (see [`Budget`]).
    pub(super) fn tree(
        &mut self,
        depth: usize,
        nodes: &mut Budget,
    ) -> Result<OfferTree, WireError> {
        nodes.node()?;
        if depth >= MAX_TREE_DEPTH {
            return Err(WireError("offer tree is nested too deep"));
        }
        Ok(match self.u8("tree node kind")? {
            NODE_LEAF => OfferTree::Leaf(self.chunnel()?),
            NODE_SEQ => {
                let n = self.count(3, "layer count")?;
                let mut parts = Vec::with_capacity(n);
                for _ in 0..n {
                    parts.push(self.tree(depth + 1, nodes)?);
                }
                OfferTree::Seq(parts)
            }
            NODE_SELECT => {
                nodes.choice()?;
                let l = self.tree(depth + 1, nodes)?;
                let r = self.tree(depth + 1, nodes)?;
                OfferTree::Select(Box::new(l), Box::new(r))
            }
            NODE_OPTIONS => {
                nodes.choice()?;
                let n = self.count(4, "option count")?;
                let mut list = Vec::with_capacity(n);
                for _ in 0..n {
                    nodes.node()?;
                    let pick = self.pick()?;
                    let chunnels = self.chunnels()?;
                    list.push(StackOption { chunnels, pick });
                }
                OfferTree::Options(list)
            }
            _ => return Err(WireError("unknown tree node kind")),
        })
    }

    /// Steps over what [`Reader::tree`] reads (the layout and its limits).
    pub(super) fn skip_tree(&mut self, depth: usize, nodes: &mut Budget) -> Result<(), WireError> {
        nodes.node()?;
        if depth >= MAX_TREE_DEPTH {
            return Err(WireError("offer tree is nested too deep"));
        }
        match self.u8("tree node kind")? {
            NODE_LEAF => self.skip_chunnel(),
            NODE_SEQ => {
                let n = self.count(3, "layer count")?;
                for _ in 0..n {
                    self.skip_tree(depth + 1, nodes)?;
                }
                Ok(())
            }
            NODE_SELECT => {
                nodes.choice()?;
                self.skip_tree(depth + 1, nodes)?;
                self.skip_tree(depth + 1, nodes)
            }
            NODE_OPTIONS => {
                nodes.choice()?;
                let n = self.count(4, "option count")?;
                for _ in 0..n {
                    nodes.node()?;
                    self.skip_pick()?;
                    self.skip_chunnels()?;
                }
                Ok(())
            }
            _ => Err(WireError("unknown tree node kind")),
        }
    }

    /// One Chunnel: its id and capabilities.
    pub(super) fn chunnel(&mut self) -> Result<ChunnelInfo, WireError> {
        let id = self.str("chunnel id")?;
        let k = self.count(5, "capability count")?;
        let mut capabilities = Vec::with_capacity(k);
        for _ in 0..k {
            capabilities.push(self.capability()?);
        }
        Ok(ChunnelInfo {
            id: Cow::Owned(id),
            capabilities,
        })
    }

    pub(super) fn skip_chunnel(&mut self) -> Result<(), WireError> {
        self.skip_str("chunnel id")?;
        let k = self.count(5, "capability count")?;
        for _ in 0..k {
            self.skip_str("capability kind")?;
            self.u8("capability matching")?;
            let labels = self.count(2, "label count")?;
            for _ in 0..labels {
                self.skip_str("label")?;
            }
        }
        Ok(())
    }

    pub(super) fn pick(&mut self) -> Result<Pick, WireError> {
        let n = self.count(1, "pick length")?;
        let b = self.bytes(n, "pick branches")?;
        if b.iter().any(|&x| x > 1) {
            return Err(WireError("pick branch is neither 0 nor 1"));
        }
        Ok(Pick::from_slice(b))
    }

    pub(super) fn capability(&mut self) -> Result<Capability, WireError> {
        let kind = self.str("capability kind")?;
        let matching = self.matching()?;
        let n = self.count(2, "label count")?;
        let mut labels = Vec::with_capacity(n);
        for _ in 0..n {
            labels.push(Cow::Owned(self.str("label")?));
        }
        Ok(Capability {
            kind: Cow::Owned(kind),
            matching,
            labels,
            rule: None,
        })
    }

    pub(super) fn chunnels(&mut self) -> Result<Vec<ChunnelInfo>, WireError> {
        let n = self.count(4, "chunnel count")?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.chunnel()?);
        }
        Ok(out)
    }

    pub(super) fn mismatches(&mut self) -> Result<Vec<Mismatch>, WireError> {
        let n = self.count(9, "mismatch count")?;
        let mut mismatches = Vec::with_capacity(n);
        for _ in 0..n {
            let client_option = self.u16("client option")?;
            let server_option = self.u16("server option")?;
            let kind = self.str("mismatch kind")?;
            let matching = self.matching()?;
            let client = self.labels()?;
            let server = self.labels()?;
            mismatches.push(Mismatch {
                client_option,
                server_option,
                kind,
                matching,
                client,
                server,
            });
        }
        Ok(mismatches)
    }

    pub(super) fn labels(&mut self) -> Result<Option<Vec<String>>, WireError> {
        match self.u8("labels presence")? {
            0 => Ok(None),
            1 => {
                let n = self.count(2, "label count")?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.str("label")?);
                }
                Ok(Some(v))
            }
            _ => Err(WireError("labels presence is neither 0 nor 1")),
        }
    }

    pub(super) fn finish(&self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError("trailing bytes after the message"))
        }
    }
}

/// What a hello's offer tree may still hold while it is decoded.
#[derive(Default)]
pub(super) struct Budget {
    nodes: usize,
    choices: usize,
}

impl Budget {
    fn node(&mut self) -> Result<(), WireError> {
        self.nodes += 1;
        if self.nodes > MAX_TREE_NODES {
            return Err(WireError("offer tree has too many nodes"));
        }
        Ok(())
    }

    fn choice(&mut self) -> Result<(), WireError> {
        self.choices += 1;
        if self.choices > MAX_TREE_CHOICES {
            return Err(WireError("offer tree has too many choices"));
        }
        Ok(())
    }
}

/// Reads the version byte and checks it before anything else is parsed: a peer of another
/// version may lay out the rest differently.
pub(super) fn version(r: &mut Reader<'_>) -> Result<u8, WireError> {
    let v = r.u8("version")?;
    if v != VERSION {
        return Err(WireError("unsupported protocol version"));
    }
    Ok(v)
}

impl Hello {
    /// Decodes a hello body (the bytes after the tag).
    pub fn decode(body: &[u8]) -> Result<Hello, WireError> {
        let mut r = Reader { buf: body };
        let version = version(&mut r)?;
        let flags = r.u8("flags")?;
        if flags & !HELLO_KNOWN_FLAGS != 0 {
            return Err(WireError("unknown hello flags"));
        }
        let conn_id = r.u64("conn_id")?;
        let offers = r.tree(0, &mut Budget::default())?;
        let zero_rtt = if flags & HELLO_ZERO_RTT != 0 {
            Some(r.pick()?)
        } else {
            None
        };
        let early = Hello::decode_early(flags, r.buf)?;
        Ok(Hello {
            version,
            conn_id,
            offers,
            zero_rtt,
            early,
            dictated: flags & HELLO_DICTATED != 0,
        })
    }

    /// Splits a hello body (the bytes after the tag) into its flags, the part that decides
    /// the server's answer (offers and 0-RTT pick: everything after `conn_id` up to the early
    /// data), and the early-data part, without decoding (nothing is allocated). Two hellos
    /// with the same flags and decision part get the same answer from a server, whatever
    /// their `conn_id` and early data; a server can remember it (see
    /// [`crate::proto::Server::handle_hello`]). Only the layout is checked here: the parts are
    /// well-formed only if [`Hello::decode`] accepts the body.
    pub fn split(body: &[u8]) -> Result<(u8, &[u8], &[u8]), WireError> {
        let mut r = Reader { buf: body };
        version(&mut r)?;
        let flags = r.u8("flags")?;
        if flags & !HELLO_KNOWN_FLAGS != 0 {
            return Err(WireError("unknown hello flags"));
        }
        r.u64("conn_id")?;
        let start = body.len() - r.buf.len();
        r.skip_tree(0, &mut Budget::default())?;
        if flags & HELLO_ZERO_RTT != 0 {
            r.skip_pick()?;
        }
        let end = body.len() - r.buf.len();
        Ok((flags, &body[start..end], &body[end..]))
    }

    /// Decodes the early-data part of a hello body (see [`Hello::split`]): empty unless
    /// `flags` has the 0-RTT bit.
    pub fn decode_early(flags: u8, part: &[u8]) -> Result<Vec<Bytes>, WireError> {
        Self::decode_early_with(flags, part, Bytes::copy_from_slice)
    }

    /// As [`Hello::decode_early`]; each message is made by `make` from its bytes in `part`
    /// (a copy, or a slice of the buffer that holds `part`).
    pub(crate) fn decode_early_with(
        flags: u8,
        part: &[u8],
        make: impl Fn(&[u8]) -> Bytes,
    ) -> Result<Vec<Bytes>, WireError> {
        let mut r = Reader { buf: part };
        let mut early = Vec::new();
        if flags & HELLO_ZERO_RTT != 0 {
            let n = r.count(4, "early message count")?;
            early.reserve_exact(n);
            for _ in 0..n {
                let len = r.u32("early message length")? as usize;
                early.push(make(r.bytes(len, "early message")?));
            }
        }
        r.finish()?;
        Ok(early)
    }

    /// Reads only the `conn_id` of a hello body (to answer a retransmission cheaply).
    /// Works for any version byte.
    pub fn peek_conn_id(body: &[u8]) -> Result<u64, WireError> {
        let mut r = Reader { buf: body };
        r.u8("version")?;
        r.u8("flags")?;
        r.u64("conn_id")
    }
}

/// The session a message starts, for [`chunnel::Listener::recognise_sessions`]: a HELLO's
/// connection id (tag included in `m`); `None` for any other message.
pub fn hello_session(m: &[u8]) -> Option<u64> {
    match m.split_first() {
        Some((&t, body)) if t == Tag::Hello as u8 => Hello::peek_conn_id(body).ok(),
        _ => None,
    }
}

impl Accept {
    /// Decodes an accept body (the bytes after the tag).
    pub fn decode(body: &[u8]) -> Result<Accept, WireError> {
        let mut r = Reader { buf: body };
        let version = version(&mut r)?;
        let conn_id = r.u64("conn_id")?;
        let zero_rtt = match r.u8("zero_rtt")? {
            0 => ZeroRtt::NotOffered,
            1 => ZeroRtt::Accepted,
            2 => ZeroRtt::Rejected,
            _ => return Err(WireError("unknown zero_rtt value")),
        };
        let client_pick = r.pick()?;
        let server_pick = r.pick()?;
        let server_stack = r.chunnels()?;
        r.finish()?;
        Ok(Accept {
            version,
            conn_id,
            zero_rtt,
            client_pick,
            server_pick,
            server_stack: server_stack.into(),
        })
    }
}

impl Reject {
    /// Decodes a reject body (the bytes after the tag).
    pub fn decode(body: &[u8]) -> Result<Reject, WireError> {
        let mut r = Reader { buf: body };
        let version = version(&mut r)?;
        let conn_id = r.u64("conn_id")?;
        let reason = match r.u8("reason")? {
            1 => RejectReason::Incompatible,
            2 => RejectReason::Version,
            3 => RejectReason::Malformed,
            4 => RejectReason::TooLarge,
            _ => return Err(WireError("unknown reject reason")),
        };
        let mismatches = r.mismatches()?;
        let message = r.str("message")?;
        let too_large = if reason == RejectReason::TooLarge {
            Some(TooLarge {
                limit: r.u32("limit")?,
                len: r.u32("hello length")?,
            })
        } else {
            None
        };
        r.finish()?;
        Ok(Reject {
            version,
            conn_id,
            reason,
            mismatches,
            message,
            too_large,
        })
    }
}

/// Splits an `ACCEPT_DATA` message (tag included) into the `ACCEPT` body (after its own tag,
/// for [`Accept::decode`]) and the offset in `msg` where the reply's bytes start.
pub fn split_accept_data(msg: &[u8]) -> Result<(&[u8], usize), WireError> {
    let mut r = Reader { buf: msg };
    if r.u8("tag")? != Tag::AcceptData as u8 {
        return Err(WireError("not an accept with data"));
    }
    let len = usize::from(r.u16("accept length")?);
    let accept = r.bytes(len, "coalesced accept")?;
    match accept.split_first() {
        Some((&t, body)) if t == Tag::Accept as u8 => Ok((body, ACCEPT_DATA_PREFIX + len)),
        _ => Err(WireError("the coalesced message is not an accept")),
    }
}

/// Decodes one control message, tag included. `DATA` and unknown tags are errors here (the
/// connection layer handles `DATA` itself).
pub fn decode_control(msg: &[u8]) -> Result<Control, WireError> {
    let (&tag, body) = msg.split_first().ok_or(WireError("empty message"))?;
    match Tag::from_u8(tag) {
        Some(Tag::Hello) => Hello::decode(body).map(Control::Hello),
        Some(Tag::Accept) => Accept::decode(body).map(Control::Accept),
        Some(Tag::Reject) => Reject::decode(body).map(Control::Reject),
        Some(Tag::AcceptData) => {
            let (accept, data) = split_accept_data(msg)?;
            Ok(Control::AcceptData(
                Accept::decode(accept)?,
                Bytes::copy_from_slice(&msg[data..]),
            ))
        }
        Some(Tag::Prepare) => Prepare::decode(body).map(Control::Prepare),
        Some(Tag::Vote) => Vote::decode(body).map(Control::Vote),
        Some(Tag::Commit) => Txn::decode(body).map(Control::Commit),
        Some(Tag::Abort) => Txn::decode(body).map(Control::Abort),
        Some(Tag::Done) => Txn::decode(body).map(Control::Done),
        Some(Tag::Close) => Close::decode(body).map(Control::Close),
        Some(Tag::Data) => Err(WireError("a data message is not a control message")),
        None => Err(WireError("unknown message tag")),
    }
}
