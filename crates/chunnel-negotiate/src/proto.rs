//! The negotiation protocol as sans-IO state machines: bytes and time in, bytes to send,
//! timers and outcomes out. The async drivers ([`crate::Client`], [`crate::listen`]) only move
//! bytes.
//!
//! * [`Server`] is stateless per hello: [`Server::handle_hello`] maps one hello to one
//!   response (accept or reject). The response is cached by the connection so a
//!   retransmitted hello gets the same answer and its early data is not delivered twice.
//! * [`ClientHandshake`] sends a hello, retransmits it with exponential backoff, and ends in
//!   an [`Outcome`] or an [`Error`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use chunnel::negotiate::End;
use chunnel::offer_tree::{Limits, NoChoice, choose_tree};
use chunnel::{ChunnelInfo, OfferTree, Pick, StackOption};

use crate::Error;
use crate::wire::{
    ACCEPT_CONN_ID, ACCEPT_DATA_PREFIX, Accept, Hello, Reject, RejectReason, Tag, TooLarge,
    VERSION, ZeroRtt,
};

mod client;

pub use client::{ClientHandshake, HelloTemplate, KnownAccept, Outcome};

/// Retransmission and size limits of a handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    /// Wait before the first retransmission; doubles after each.
    pub initial_rto: Duration,
    /// Hellos sent before giving up.
    pub attempts: u32,
    /// The largest hello the base connection carries in one message.
    pub max_message: usize,
    /// How many data messages that arrive before the accept are kept (the rest dropped).
    pub max_early_replies: usize,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            initial_rto: Duration::from_millis(100),
            attempts: 7,
            max_message: 65_507,
            max_early_replies: 1024,
        }
    }
}

/// The server's answer to one hello.
#[derive(Debug)]
pub enum Decision {
    /// Build the server stack `accept.server_pick` names (its Chunnels:
    /// `accept.server_stack`) and send `response`. If `accept.zero_rtt` is
    /// [`ZeroRtt::Accepted`], deliver `early` first.
    Accept {
        /// The accept message.
        accept: Accept,
        /// Early data to deliver (empty unless the 0-RTT pick was accepted).
        early: Vec<Bytes>,
        /// The encoded accept, to send and to re-send to a retransmitted hello.
        response: Bytes,
        /// The same accept as the header of an `ACCEPT_DATA` message, when it is short
        /// enough: a server may hold an accepted 0-RTT answer back and send it in one message
        /// with its first reply (docs/wire.md §7.5).
        coalesce: Option<Bytes>,
    },
    /// Send `response`; the client is refused.
    Reject {
        /// The reject message.
        reject: Reject,
        /// The encoded reject.
        response: Bytes,
    },
}

/// The server side: its options (as a tree, searched without enumerating them), the search's
/// limits, and the accepts it remembers per offer list.
#[derive(Debug)]
pub struct Server {
    tree: OfferTree,
    limits: Limits,
    /// Most recently used first. A short list searched in order, not a hash map: it holds
    /// at most [`REMEMBERED_ACCEPTS`] entries, a server usually sees one or two offer lists,
    /// and hashing a key of ~100 bytes costs more than comparing it with the first entry.
    remembered: Mutex<Vec<(Box<[u8]>, Remembered)>>,
    /// Refused offer lists (flags, decision part, the reject), most recently used first, at
    /// most [`REMEMBERED_REJECTS`] of them and [`REMEMBERED_REJECT_BYTES`] of keys: a
    /// client's retransmitted hello, or another client with the same offers, is refused
    /// again without searching again (the search may take milliseconds at its limits).
    refused: Mutex<Vec<Refused>>,
    /// Hellos refused as too large ([`Server::handle_oversized`]).
    too_large: std::sync::atomic::AtomicU64,
}

/// Distinct offer lists whose accept a [`Server`] remembers; when full, it forgets them all
/// (bounded whatever clients send).
pub const REMEMBERED_ACCEPTS: usize = 64;

/// Distinct refused offer lists a [`Server`] remembers; when full (or when their keys reach
/// [`REMEMBERED_REJECT_BYTES`]), it forgets them all.
pub const REMEMBERED_REJECTS: usize = 64;

/// Bytes of refused offer lists (decision parts of hellos) a [`Server`] keeps at most.
pub const REMEMBERED_REJECT_BYTES: usize = 1 << 20;

/// Server options a dictated hello (one that names implementations, not a stack) is
/// matched against, in preference order.
pub const DICTATED_OPTIONS: usize = 4096;

/// Hellos whose decision part (offers and 0-RTT pick) is longer are decided afresh each time.
pub const REMEMBERED_KEY_MAX: usize = 1024;

/// A refused offer list: the hello's flags, its decision part, the reject.
type Refused = (u8, Box<[u8]>, Reject);

/// What [`Server::quick`] found.
enum Quick {
    /// The answer, without a search.
    Answered(Decision),
    /// A hello of this version that must be decided.
    Search,
}

/// An accept decided once for an offer list (the key: [`Hello::split`]'s decision part).
#[derive(Debug)]
struct Remembered {
    flags: u8,
    server_pick: Pick,
    server_stack: Arc<[ChunnelInfo]>,
    zero_rtt: ZeroRtt,
    client_pick: Pick,
    /// The encoded answer to the hello that was decided (its `conn_id` is overwritten for
    /// each recall): the `ACCEPT_DATA` header when `coalescable`, else the `ACCEPT` alone.
    template: Bytes,
    coalescable: bool,
}

/// A copy of `template` with `part` written at `at`; `None` if it does not fit. One
/// allocation that its slices share: a short answer sits in the reference count's own block
/// (a `BytesMut` frozen and then sliced allocated twice).
fn patched(template: &[u8], at: usize, part: &[u8]) -> Option<Bytes> {
    let end = at
        .checked_add(part.len())
        .filter(|&e| e <= template.len())?;
    if template.len() <= ShortAnswer::MAX {
        let mut a = ShortAnswer {
            len: template.len() as u8,
            b: [0; ShortAnswer::MAX],
        };
        a.b[..template.len()].copy_from_slice(template);
        a.b[at..end].copy_from_slice(part);
        return Some(Bytes::from_owner(a));
    }
    let mut b = BytesMut::from(template);
    b[at..end].copy_from_slice(part);
    Some(b.freeze())
}

/// An encoded answer short enough to be kept inline (see [`patched`]).
struct ShortAnswer {
    len: u8,
    b: [u8; ShortAnswer::MAX],
}

impl ShortAnswer {
    const MAX: usize = 64;
}

impl AsRef<[u8]> for ShortAnswer {
    fn as_ref(&self) -> &[u8] {
        &self.b[..usize::from(self.len)]
    }
}

impl Clone for Server {
    /// Same options and limits; nothing remembered yet.
    fn clone(&self) -> Self {
        Server::new(self.tree.clone()).with_limits(self.limits)
    }
}

impl Server {
    /// A server choosing among the options of `tree` (its own stack's
    /// [`chunnel::Offers::offer_tree`]; a `Vec<StackOption>` of explicit options, most
    /// preferred first, converts into one).
    pub fn new(tree: impl Into<OfferTree>) -> Self {
        Server {
            tree: tree.into(),
            limits: Limits::default(),
            remembered: Mutex::new(Vec::new()),
            refused: Mutex::new(Vec::new()),
            too_large: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Hellos refused so far because they were larger than the base connection takes
    /// ([`Server::handle_oversized`]).
    pub fn hellos_too_large(&self) -> u64 {
        self.too_large.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets the search's limits (steps before a hello is refused as too complex, mismatches
    /// reported in a reject).
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// The server's options, as a tree.
    pub fn tree(&self) -> &OfferTree {
        &self.tree
    }

    /// Decides on one message that should be a hello (tag included).
    ///
    /// The answer depends only on the hello's flags, offers and 0-RTT pick (and on this
    /// server's options), not on its `conn_id` or early data: an accept is remembered per
    /// offer list (at most [`REMEMBERED_ACCEPTS`] of them, keys up to
    /// [`REMEMBERED_KEY_MAX`] bytes), and a hello with the same offers again is answered
    /// without decoding or matching them. Compatibility rules of custom capabilities must
    /// therefore be pure functions of the two capabilities (as [`chunnel::negotiate::Rule`]
    /// says).
    pub fn handle_hello(&self, msg: &[u8]) -> Decision {
        self.handle(msg, &Bytes::copy_from_slice)
    }

    /// As [`Server::handle_hello`]; an accepted hello's early data comes as slices of `msg`
    /// (no copy) when its offers are remembered.
    pub fn handle_hello_bytes(&self, msg: &Bytes) -> Decision {
        self.handle(msg, &|part| msg.slice_ref(part))
    }

    /// Decides on a message too large for the base connection, of which only `prefix` (its
    /// first bytes), its length `len` (0 if unknown) and the connection's `limit` are known:
    /// if it is a hello (its tag says so), a [`RejectReason::TooLarge`] reject addressed to
    /// the `conn_id` at offsets 3-10 (0 if the prefix is shorter), saying both sizes
    /// (docs/wire.md §9.4); `None` for anything else, which stays dropped.
    pub fn handle_oversized(&self, prefix: &[u8], len: usize, limit: usize) -> Option<Decision> {
        let body = match prefix.split_first() {
            Some((&t, body)) if t == Tag::Hello as u8 => body,
            _ => return None,
        };
        let conn_id = Hello::peek_conn_id(body).unwrap_or(0);
        let size = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let reject = Reject {
            version: VERSION,
            conn_id,
            reason: RejectReason::TooLarge,
            mismatches: Vec::new(),
            message: too_large_message(len, limit),
            too_large: Some(TooLarge {
                limit: size(limit),
                len: size(len),
            }),
        };
        let response = reject.encode_within(limit);
        self.too_large
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(Decision::Reject { reject, response })
    }

    /// The answer to a hello that needs no search: one remembered for its offer list (an
    /// accept or a refusal), or a refusal of a message that is not a hello of this version.
    /// `None`: the hello must be decided ([`Server::handle_hello_bytes`], which may search
    /// for milliseconds up to the [`Limits`]); a listener can do that away from its accept
    /// loop. Answers exactly as [`Server::handle_hello_bytes`] would.
    pub fn answer_from_memory(&self, msg: &Bytes) -> Option<Decision> {
        match self.quick(msg, &|part| msg.slice_ref(part)) {
            Quick::Answered(d) => Some(d),
            Quick::Search => None,
        }
    }

    fn quick(&self, msg: &[u8], early_bytes: &dyn Fn(&[u8]) -> Bytes) -> Quick {
        let body = match msg.split_first() {
            Some((&t, body)) if t == Tag::Hello as u8 => body,
            _ => {
                return Quick::Answered(reject(
                    0,
                    RejectReason::Malformed,
                    Vec::new(),
                    "not a hello".into(),
                ));
            }
        };
        let conn_id = Hello::peek_conn_id(body).unwrap_or(0);
        if let Some(&v) = body.first()
            && v != VERSION
        {
            return Quick::Answered(reject(
                conn_id,
                RejectReason::Version,
                Vec::new(),
                format!("server speaks version {VERSION}, hello has {v}"),
            ));
        }
        if let Ok((flags, key, early)) = Hello::split(body) {
            if key.len() <= REMEMBERED_KEY_MAX
                && let Some(d) = self.recall(flags, key, early, conn_id, early_bytes)
            {
                return Quick::Answered(d);
            }
            if let Some(d) = self.recall_refusal(flags, key, early, conn_id) {
                return Quick::Answered(d);
            }
        }
        Quick::Search
    }

    fn handle(&self, msg: &[u8], early_bytes: &dyn Fn(&[u8]) -> Bytes) -> Decision {
        if let Quick::Answered(d) = self.quick(msg, early_bytes) {
            return d;
        }
        // `quick` found a hello of this version.
        let body = &msg[1..];
        let conn_id = Hello::peek_conn_id(body).unwrap_or(0);
        let hello = match Hello::decode(body) {
            Ok(h) => h,
            Err(e) => return reject(conn_id, RejectReason::Malformed, Vec::new(), e.to_string()),
        };
        let decision = self.decide(hello);
        match (Hello::split(body).ok(), &decision) {
            (Some((flags, key, _)), Decision::Accept { .. }) if key.len() <= REMEMBERED_KEY_MAX => {
                self.remember(flags, key, &decision)
            }
            (Some((flags, key, _)), Decision::Reject { reject, .. }) => {
                self.remember_refusal(flags, key, reject)
            }
            _ => {}
        }
        decision
    }

    /// The remembered reject of this offer list, addressed to `conn_id`; `None` if there is
    /// none, or if the early data does not decode (the full path then rejects the hello as
    /// malformed, as a fresh server would).
    fn recall_refusal(
        &self,
        flags: u8,
        key: &[u8],
        early: &[u8],
        conn_id: u64,
    ) -> Option<Decision> {
        Hello::decode_early_with(flags, early, |_: &[u8]| Bytes::new()).ok()?;
        let mut list = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        let i = list
            .iter()
            .position(|(f, k, _)| *f == flags && **k == *key)?;
        list[..=i].rotate_right(1);
        let reject = Reject {
            conn_id,
            ..list[0].2.clone()
        };
        drop(list);
        let response = reject.encode();
        Some(Decision::Reject { reject, response })
    }

    fn remember_refusal(&self, flags: u8, key: &[u8], reject: &Reject) {
        let mut list = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        let held: usize = list.iter().map(|(_, k, _)| k.len()).sum();
        if list.len() >= REMEMBERED_REJECTS || held + key.len() > REMEMBERED_REJECT_BYTES {
            list.clear();
        }
        if key.len() <= REMEMBERED_REJECT_BYTES {
            list.insert(0, (flags, key.into(), reject.clone()));
        }
    }

    /// Offer lists refused and remembered now (see [`REMEMBERED_REJECTS`]).
    pub fn remembered_refusals(&self) -> usize {
        self.refused.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The remembered accept for this offer list, for connection `conn_id`; `None` if there
    /// is none (or the early data does not decode: the full path then rejects the hello).
    fn recall(
        &self,
        flags: u8,
        key: &[u8],
        early: &[u8],
        conn_id: u64,
        early_bytes: &dyn Fn(&[u8]) -> Bytes,
    ) -> Option<Decision> {
        let (server_pick, server_stack, zero_rtt, client_pick, template, coalescable) = {
            let mut list = self.remembered.lock().unwrap_or_else(|e| e.into_inner());
            let i = list.iter().position(|(k, _)| **k == *key)?;
            // Most recently used first: a busy offer list is found at once.
            list[..=i].rotate_right(1);
            let r = Some(&list[0].1).filter(|r| r.flags == flags)?;
            (
                r.server_pick.clone(),
                Arc::clone(&r.server_stack),
                r.zero_rtt,
                r.client_pick.clone(),
                r.template.clone(),
                r.coalescable,
            )
        };
        let early = Hello::decode_early_with(flags, early, early_bytes).ok()?;
        let early = if zero_rtt == ZeroRtt::Accepted {
            early
        } else {
            Vec::new()
        };
        // The template with this connection's id, in the accept's body: after its tag (and
        // the `ACCEPT_DATA` prefix).
        let body = if coalescable { ACCEPT_DATA_PREFIX } else { 0 } + 1;
        let all = patched(
            &template,
            body + ACCEPT_CONN_ID.start,
            &conn_id.to_be_bytes(),
        )?;
        let (response, coalesce) = if coalescable {
            (all.slice(ACCEPT_DATA_PREFIX..), Some(all))
        } else {
            (all, None)
        };
        let accept = Accept {
            version: VERSION,
            conn_id,
            zero_rtt,
            client_pick,
            server_pick,
            server_stack,
        };
        Some(Decision::Accept {
            accept,
            early,
            response,
            coalesce,
        })
    }

    fn remember(&self, flags: u8, key: &[u8], decision: &Decision) {
        let Decision::Accept {
            accept,
            response,
            coalesce,
            ..
        } = decision
        else {
            return;
        };
        // This answer is the template: `recall` overwrites its `conn_id`.
        let r = Remembered {
            flags,
            server_pick: accept.server_pick.clone(),
            server_stack: Arc::clone(&accept.server_stack),
            zero_rtt: accept.zero_rtt,
            client_pick: accept.client_pick.clone(),
            coalescable: coalesce.is_some(),
            template: coalesce.clone().unwrap_or_else(|| response.clone()),
        };
        let mut list = self.remembered.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = list.iter_mut().find(|(k, _)| **k == *key) {
            e.1 = r;
            return;
        }
        if list.len() >= REMEMBERED_ACCEPTS {
            list.clear();
        }
        list.insert(0, (key.into(), r));
    }

    fn decide(&self, hello: Hello) -> Decision {
        if hello.dictated {
            return self.dictate(hello);
        }
        // 0-RTT: keep the client's remembered stack if it is one of its offers and some
        // server option is compatible with it.
        if let Some(p) = &hello.zero_rtt
            && let Some(chunnels) = hello.offers.option(p)
        {
            let only = OfferTree::Options(vec![StackOption {
                chunnels,
                pick: p.clone(),
            }]);
            if let Ok(c) = choose_tree(&self.tree, &only, self.limits) {
                return self.accept(&hello, c.server_pick, c.server_stack, c.client_pick, {
                    ZeroRtt::Accepted
                });
            }
        }
        let refused = |mismatches: Vec<chunnel::Mismatch>, message: String| {
            reject(
                hello.conn_id,
                RejectReason::Incompatible,
                mismatches,
                message,
            )
        };
        match choose_tree(&self.tree, &hello.offers, self.limits) {
            Ok(c) => {
                let z = if hello.zero_rtt.is_some() {
                    ZeroRtt::Rejected
                } else {
                    ZeroRtt::NotOffered
                };
                self.accept(&hello, c.server_pick, c.server_stack, c.client_pick, z)
            }
            Err(NoChoice::Incompatible(mismatches)) => {
                let message = Error::Incompatible {
                    found_by: End::Server,
                    mismatches: mismatches.clone(),
                }
                .to_string();
                refused(mismatches, message)
            }
            Err(NoChoice::TooComplex { steps }) => refused(
                Vec::new(),
                format!(
                    "the server gave up its search for a compatible stack after {steps} steps \
                     (at its step or work limit): offer fewer or more distinct options"
                ),
            ),
        }
    }

    /// A client without a stack of its own: pick the first server option whose two-sided
    /// Chunnels (those with an exact-match capability: they need a peer) the client can
    /// build; one-sided Chunnels run at the server only.
    fn dictate(&self, hello: Hello) -> Decision {
        let registry = match &hello.offers {
            OfferTree::Options(list) if list.len() == 1 => list.first(),
            _ => None,
        };
        let Some(registry) = registry else {
            return reject(
                hello.conn_id,
                RejectReason::Malformed,
                Vec::new(),
                "a dictated hello carries exactly one offer: the client's implementations".into(),
            );
        };
        let mut why = Vec::new();
        // The server's options in preference order, as many as a dictated client is given.
        for (si, s) in self.tree.first_options(DICTATED_OPTIONS).iter().enumerate() {
            let missing = s
                .chunnels
                .iter()
                .find(|c| two_sided(c) && !registry.chunnels.iter().any(|r| r.id == c.id));
            match missing {
                None => {
                    return self.accept(
                        &hello,
                        s.pick.clone(),
                        s.chunnels.clone(),
                        Pick::default(),
                        ZeroRtt::NotOffered,
                    );
                }
                Some(c) if why.len() < self.limits.max_reported => why.push(chunnel::Mismatch {
                    client_option: 0,
                    server_option: si as u16,
                    kind: format!("implementation of {}", c.id),
                    matching: chunnel::Match::Exact,
                    client: None,
                    server: Some(vec![c.id.to_string()]),
                }),
                Some(_) => {}
            }
        }
        let message = Error::Incompatible {
            found_by: End::Server,
            mismatches: why.clone(),
        }
        .to_string();
        reject(hello.conn_id, RejectReason::Incompatible, why, message)
    }

    fn accept(
        &self,
        hello: &Hello,
        server_pick: Pick,
        server_stack: Vec<ChunnelInfo>,
        client_pick: Pick,
        zero_rtt: ZeroRtt,
    ) -> Decision {
        let accept = Accept {
            version: VERSION,
            conn_id: hello.conn_id,
            zero_rtt,
            client_pick,
            server_pick,
            server_stack: server_stack.into(),
        };
        let (response, coalesce) = accept.encode_with_data_header();
        let early = if zero_rtt == ZeroRtt::Accepted {
            hello.early.clone()
        } else {
            Vec::new()
        };
        Decision::Accept {
            accept,
            early,
            response,
            coalesce,
        }
    }
}

/// The CLOSE an established connection with `conn_id` sends to end itself (docs/wire.md
/// §7.6).
pub fn close_message(conn_id: u64) -> Bytes {
    crate::wire::Close {
        version: VERSION,
        conn_id,
    }
    .encode()
}

/// Whether `msg` (tag included), received on an established connection with `conn_id`, ends
/// it (docs/wire.md §9.3, §9.5): a well-formed CLOSE of this version carrying that
/// `conn_id`. Anything else with the CLOSE tag (malformed, another version, another
/// `conn_id`: a stale or forged CLOSE) is ignored, and the connection goes on. Never panics.
pub fn close_ends(msg: &[u8], conn_id: u64) -> bool {
    matches!(
        msg.split_first(),
        Some((&t, body)) if t == crate::wire::Tag::Close as u8
            && crate::wire::Close::decode(body).is_ok_and(|c| c.conn_id == conn_id)
    )
}

/// Whether a Chunnel needs a peer implementation (it has an exact-match capability).
pub fn two_sided(c: &chunnel::ChunnelInfo) -> bool {
    c.capabilities
        .iter()
        .any(|k| k.matching == chunnel::Match::Exact)
}

/// The message text of a [`RejectReason::TooLarge`] reject (docs/wire.md §7.4).
fn too_large_message(len: usize, limit: usize) -> String {
    if len == 0 {
        format!("hello larger than the {limit} bytes this server takes in one message")
    } else {
        format!(
            "hello of {len} bytes is larger than the {limit} bytes this server takes in one message"
        )
    }
}

fn reject(
    conn_id: u64,
    reason: RejectReason,
    mismatches: Vec<chunnel::Mismatch>,
    message: String,
) -> Decision {
    let reject = Reject {
        version: VERSION,
        conn_id,
        reason,
        mismatches,
        message,
        too_large: None,
    };
    let response = reject.encode();
    Decision::Reject { reject, response }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use chunnel::{Capability, ChunnelInfo};

    use super::*;

    #[test]
    fn only_a_well_formed_close_with_the_connections_id_ends_it() {
        let m = close_message(42);
        assert_eq!(&m[..], &[0x05, VERSION, 0, 0, 0, 0, 0, 0, 0, 42]);
        assert!(close_ends(&m, 42));
        // Another connection's, another version, truncated, longer, another tag, empty.
        assert!(!close_ends(&m, 43));
        let mut v = m.to_vec();
        v[1] = 1;
        assert!(!close_ends(&v, 42));
        for n in 0..m.len() {
            assert!(!close_ends(&m[..n], 42), "prefix of {n} bytes");
        }
        let mut long = m.to_vec();
        long.push(0);
        assert!(!close_ends(&long, 42));
        let mut other = m.to_vec();
        other[0] = Tag::Data as u8;
        assert!(!close_ends(&other, 42));
    }

    #[test]
    fn patched_answers_are_copies_with_the_part_written() {
        for len in [12, ShortAnswer::MAX, ShortAnswer::MAX + 1, 300] {
            let template: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let a = patched(&template, 3, &[0xAA, 0xBB]).expect("fits");
            let mut want = template.clone();
            want[3..5].copy_from_slice(&[0xAA, 0xBB]);
            assert_eq!(&a[..], &want[..], "template of {len} bytes");
            // Slices see the same bytes (and outlive the whole).
            let tail = a.slice(2..);
            drop(a);
            assert_eq!(&tail[..], &want[2..]);
            // A part that does not fit is refused, not cut.
            assert_eq!(patched(&template, len - 1, &[1, 2]), None);
            assert_eq!(patched(&template, usize::MAX, &[1]), None);
        }
    }

    fn option(id: &'static str, label: &'static str, branch: u8) -> StackOption {
        StackOption {
            chunnels: vec![ChunnelInfo {
                id: Cow::Borrowed(id),
                capabilities: vec![Capability::exact("serialize", [label])],
            }],
            pick: Pick::from_slice(&[branch]),
        }
    }

    fn hello(conn_id: u64, offers: Vec<StackOption>, early: &[u8]) -> Vec<u8> {
        let zero_rtt = offers.first().map(|o| o.pick.clone());
        Hello {
            version: VERSION,
            conn_id,
            offers: offers.into(),
            zero_rtt,
            early: vec![Bytes::copy_from_slice(early)],
            dictated: false,
        }
        .encode()
        .to_vec()
    }

    fn remembered(s: &Server) -> usize {
        s.remembered.lock().unwrap().len()
    }

    #[test]
    fn an_accept_is_remembered_per_offer_list_and_answers_other_connections() {
        let s = Server::new(vec![option("a/1", "json", 0)]);
        let offers = vec![option("a/1", "json", 0)];
        let Decision::Accept { accept, .. } = s.handle_hello(&hello(7, offers.clone(), b"x"))
        else {
            panic!("not accepted");
        };
        assert_eq!((accept.conn_id, remembered(&s)), (7, 1));
        // Same offers, another connection and other early data: answered from memory.
        let Decision::Accept {
            accept,
            early,
            response,
            coalesce,
            ..
        } = s.handle_hello(&hello(9, offers.clone(), b"yz"))
        else {
            panic!("not accepted");
        };
        assert_eq!(accept.conn_id, 9);
        assert_eq!(accept.zero_rtt, ZeroRtt::Accepted);
        assert_eq!(early, vec![Bytes::from_static(b"yz")]);
        assert_eq!(
            response,
            accept.encode(),
            "response carries the new conn_id"
        );
        assert_eq!(coalesce, accept.encode_with_data_header().1);
        assert_eq!(remembered(&s), 1);
        // Another offer list is another entry.
        let _ = s.handle_hello(&hello(9, vec![option("a/1", "json", 1)], b""));
        assert_eq!(remembered(&s), 2);
    }

    #[test]
    fn remembered_accepts_are_bounded() {
        let s = Server::new(vec![option("a/1", "json", 0)]);
        for i in 0..(REMEMBERED_ACCEPTS as u8 + 10) {
            // Distinct offer lists: a second, incompatible offer with its own label.
            let label: &'static str = Box::leak(format!("l{i}").into_boxed_str());
            let offers = vec![option("a/1", "json", 0), option("b/1", label, 1)];
            assert!(matches!(
                s.handle_hello(&hello(u64::from(i), offers, b"")),
                Decision::Accept { .. }
            ));
            assert!(remembered(&s) <= REMEMBERED_ACCEPTS);
        }
    }
}
