//! The client's side of the handshake: [`ClientHandshake`] sends a hello, retransmits it
//! with exponential backoff, and ends in an [`Outcome`] or an [`Error`].

use std::sync::Arc;
use std::time::Instant;

use bytes::{Buf, Bytes};
use chunnel::negotiate::End;
use chunnel::{ChunnelInfo, OfferTree, Pick, StackOption};

use crate::Error;
use crate::wire::{
    ACCEPT_CONN_ID, Accept, Hello, Reject, RejectReason, Tag, VERSION, WireError, split_accept_data,
};

use super::Timing;

/// A finished client handshake.
#[derive(Debug)]
pub struct Outcome {
    /// The server's accept.
    pub accept: Accept,
    /// The accept with its encoding, for a later handshake with the same server to
    /// recognise the same answer without decoding it ([`ClientHandshake::expect`]).
    pub known: KnownAccept,
    /// The Chunnels of the client option the accept names (`accept.client_pick`), top first.
    pub stack: Vec<ChunnelInfo>,
    /// Data messages (tag stripped) that arrived before the accept, in arrival order.
    pub early_replies: Vec<Bytes>,
    /// Hellos sent (1 unless some were lost).
    pub hellos_sent: u32,
    /// The accept was the one expected ([`ClientHandshake::expect`]), recognised by its
    /// bytes: `known` is that same [`KnownAccept`].
    pub recognised: bool,
}

/// A 0-RTT hello kept for the next connection with the same offers and pick: its bytes before
/// the early data (all but the `conn_id` the same for every such connection) and the offers
/// they encode. See [`ClientHandshake::template`].
#[derive(Debug)]
pub struct HelloTemplate {
    /// The [`chunnel::negotiate::offers_digest`] of the tree whose offers these are.
    pub digest: u64,
    /// The 0-RTT pick the hello names.
    pub pick: Pick,
    offers: Arc<OfferTree>,
    prefix: Bytes,
}

/// An accept as received (the body after the tag), with its decoding: a server that
/// remembers its decisions sends the same bytes to every hello with the same offers, but
/// for the `conn_id`.
#[derive(Clone, Debug)]
pub struct KnownAccept {
    body: Bytes,
    accept: Accept,
}

impl KnownAccept {
    /// The decoding of `body` if it equals this accept's encoding in every byte but the
    /// `conn_id`: then it decodes to this accept with that `conn_id`.
    fn recognise(&self, body: &[u8]) -> Option<Accept> {
        let (k, b) = (&self.body[..], body);
        if k.len() != b.len()
            || k.len() < ACCEPT_CONN_ID.end
            || k[..ACCEPT_CONN_ID.start] != b[..ACCEPT_CONN_ID.start]
            || k[ACCEPT_CONN_ID.end..] != b[ACCEPT_CONN_ID.end..]
        {
            return None;
        }
        let id = b[ACCEPT_CONN_ID].try_into().ok().map(u64::from_be_bytes)?;
        Some(Accept {
            conn_id: id,
            ..self.accept.clone()
        })
    }
}

/// The client side of one handshake.
#[derive(Debug)]
pub struct ClientHandshake {
    timing: Timing,
    conn_id: u64,
    offers: Arc<OfferTree>,
    /// The 0-RTT pick, and where the hello's early data starts.
    zero_rtt: Option<(Pick, usize)>,
    /// An earlier answer of the same server, recognised without decoding.
    expected: Option<KnownAccept>,
    /// The accept taken was the expected one.
    recognised: bool,
    /// The accept taken (with `result`), as a [`KnownAccept`].
    known: Option<KnownAccept>,
    hello: Bytes,
    started: Instant,
    sent: u32,
    next_send: Option<Instant>,
    /// In arrival order, but for an ACCEPT_DATA's reply, which goes first (a vector: it is
    /// handed over whole, and usually holds that one reply).
    early_replies: Vec<Bytes>,
    result: Option<Result<Outcome, Error>>,
    finished: bool,
}

impl ClientHandshake {
    /// Starts a handshake offering the options of `offers` (a stack's
    /// [`chunnel::Offers::offer_tree`]; a `Vec<StackOption>` converts); with `zero_rtt`, the
    /// pick already built and the early messages it produced travel in the hello.
    pub fn new(
        offers: impl Into<OfferTree>,
        zero_rtt: Option<(Pick, Vec<Bytes>)>,
        conn_id: u64,
        timing: Timing,
        now: Instant,
    ) -> Result<Self, Error> {
        let (zero_rtt, early) = match zero_rtt {
            Some((p, e)) => (Some(p), e),
            None => (None, Vec::new()),
        };
        let hello = Hello {
            version: VERSION,
            conn_id,
            offers: offers.into(),
            zero_rtt,
            early,
            dictated: false,
        };
        Self::from_hello(hello, timing, now)
    }

    fn from_hello(hello: Hello, timing: Timing, now: Instant) -> Result<Self, Error> {
        let (encoded, split) = hello.encode_split();
        // A tree past the decoder's limits (docs/wire.md §6.6) would only be refused.
        Hello::split(&encoded[1..]).map_err(Error::Wire)?;
        let zero_rtt = hello.zero_rtt.map(|p| (p, split));
        Self::from_encoded(
            encoded,
            hello.conn_id,
            Arc::new(hello.offers),
            zero_rtt,
            timing,
            now,
        )
    }

    /// Starts a 0-RTT handshake like [`ClientHandshake::new`] with the template's offers and
    /// pick, without encoding the offers: the hello is the template's bytes with this
    /// `conn_id` and `early` (byte for byte what `new` would send).
    pub fn from_template(
        template: &HelloTemplate,
        early: &[Bytes],
        conn_id: u64,
        timing: Timing,
        now: Instant,
    ) -> Result<Self, Error> {
        let encoded = Hello::encode_from_prefix(&template.prefix, conn_id, early);
        Self::from_encoded(
            encoded,
            conn_id,
            Arc::clone(&template.offers),
            Some((template.pick.clone(), template.prefix.len())),
            timing,
            now,
        )
    }

    /// This 0-RTT handshake's hello as a template for the next connection with the same
    /// offers (`digest`: their [`chunnel::negotiate::offers_digest`]); `None` if the hello is
    /// not 0-RTT.
    pub fn template(&self, digest: u64) -> Option<HelloTemplate> {
        let (pick, split) = self.zero_rtt.as_ref()?;
        Some(HelloTemplate {
            digest,
            pick: pick.clone(),
            offers: Arc::clone(&self.offers),
            prefix: self.hello.slice(..*split),
        })
    }

    fn from_encoded(
        encoded: Bytes,
        conn_id: u64,
        offers: Arc<OfferTree>,
        zero_rtt: Option<(Pick, usize)>,
        timing: Timing,
        now: Instant,
    ) -> Result<Self, Error> {
        if encoded.len() > timing.max_message {
            return Err(Error::OffersTooLarge {
                len: encoded.len(),
                max: timing.max_message,
            });
        }
        Ok(ClientHandshake {
            timing,
            conn_id,
            offers,
            zero_rtt,
            expected: None,
            recognised: false,
            known: None,
            hello: encoded,
            started: now,
            sent: 0,
            next_send: Some(now),
            early_replies: Vec::new(),
            result: None,
            finished: false,
        })
    }

    /// Starts a dictated handshake: the client offers the Chunnel implementations it can
    /// build (`implementations`, one entry each) and lets the server pick the stack.
    pub fn new_dictated(
        implementations: Vec<chunnel::ChunnelInfo>,
        conn_id: u64,
        timing: Timing,
        now: Instant,
    ) -> Result<Self, Error> {
        let hello = Hello {
            version: VERSION,
            conn_id,
            offers: OfferTree::Options(vec![StackOption {
                chunnels: implementations,
                pick: Pick::default(),
            }]),
            zero_rtt: None,
            early: Vec::new(),
            dictated: true,
        };
        Self::from_hello(hello, timing, now)
    }

    /// Recognises an accept equal to `known` (as its server sends again to a hello with the
    /// same offers, but for the `conn_id`) without decoding it. Any other accept is decoded
    /// as usual: the outcome is the same either way.
    pub fn expect(&mut self, known: KnownAccept) {
        self.expected = Some(known);
    }

    /// The accept in `body` (after the tag), if it is for this handshake; `body` is copied
    /// for [`Outcome::known`] unless it is the expected one.
    fn take_accept(&mut self, body: &[u8]) -> Option<Accept> {
        if let Some(a) = self.expected.as_ref().and_then(|k| k.recognise(body)) {
            if a.conn_id != self.conn_id {
                return None;
            }
            self.known = self.expected.take();
            self.recognised = true;
            return Some(a);
        }
        let a = Accept::decode(body)
            .ok()
            .filter(|a| a.conn_id == self.conn_id)?;
        self.known = Some(KnownAccept {
            body: Bytes::copy_from_slice(body),
            accept: a.clone(),
        });
        Some(a)
    }

    /// The hello, if one is due now (the first one, or a retransmission).
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Bytes> {
        self.poll_transmit_ref(now).cloned()
    }

    /// As [`ClientHandshake::poll_transmit`], lending the hello instead of sharing it (a
    /// driver that sends it at once needs no handle of its own).
    pub fn poll_transmit_ref(&mut self, now: Instant) -> Option<&Bytes> {
        if self.done() {
            return None;
        }
        match self.next_send {
            Some(t) if t <= now => {
                self.sent += 1;
                let shift = (self.sent - 1).min(16);
                self.next_send = Some(now + self.timing.initial_rto * (1u32 << shift));
                Some(&self.hello)
            }
            _ => None,
        }
    }

    /// When [`ClientHandshake::handle_timeout`] should next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.done() { None } else { self.next_send }
    }

    /// Advances time: past the last attempt's wait, the handshake fails.
    pub fn handle_timeout(&mut self, now: Instant) {
        if !self.done()
            && self.sent >= self.timing.attempts
            && self.next_send.is_some_and(|t| t <= now)
        {
            self.result = Some(Err(Error::Timeout {
                attempts: self.sent,
                waited: now - self.started,
            }));
        }
    }

    /// Feeds one message received on the base connection (tag included).
    pub fn handle_message(&mut self, mut msg: Bytes) {
        if self.finished {
            return;
        }
        let Some(&tag) = msg.first() else { return };
        if tag != Tag::Data as u8 && self.result.is_some() {
            return;
        }
        match Tag::from_u8(tag) {
            // The server answered an accepted 0-RTT hello with data that overtook the accept
            // or came in the same batch; keep it (bounded) for the application.
            Some(Tag::Data) if self.early_replies.len() < self.timing.max_early_replies => {
                msg.advance(1);
                self.early_replies.push(msg);
            }
            // Not ours (a stale answer to an earlier attempt, or garbage): ignored.
            Some(Tag::Accept) => {
                if let Some(a) = self.take_accept(&msg[1..]) {
                    self.on_accept(a);
                }
            }
            // The accept and the server's first reply in one message. The reply was sent
            // before any DATA that may have overtaken it, so it goes first.
            Some(Tag::AcceptData) => {
                if let Ok((body, at)) = split_accept_data(&msg)
                    && let Some(a) = self.take_accept(body)
                {
                    self.on_accept(a);
                    if self.early_replies.len() < self.timing.max_early_replies {
                        msg.advance(at);
                        self.early_replies.insert(0, msg);
                    }
                }
            }
            Some(Tag::Reject) => match Reject::decode(&msg[1..]) {
                Ok(r) if r.conn_id == self.conn_id || r.conn_id == 0 => self.on_reject(r),
                Err(WireError("unsupported protocol version")) => {
                    self.result = Some(Err(Error::Version {
                        ours: VERSION,
                        theirs: msg.get(1).copied().unwrap_or(0),
                    }))
                }
                _ => {}
            },
            _ => {}
        }
    }

    fn on_accept(&mut self, a: Accept) {
        let (Some(stack), Some(known)) = (self.offers.option(&a.client_pick), self.known.take())
        else {
            self.result = Some(Err(Error::Wire(WireError(
                "the accept names a pick we did not offer",
            ))));
            return;
        };
        self.result = Some(Ok(Outcome {
            accept: a,
            known,
            stack,
            early_replies: Vec::new(),
            hellos_sent: self.sent,
            recognised: self.recognised,
        }));
    }

    fn on_reject(&mut self, r: Reject) {
        self.result = Some(Err(match r.reason {
            RejectReason::Incompatible => Error::Incompatible {
                found_by: End::Server,
                mismatches: r.mismatches,
            },
            RejectReason::Version => Error::Version {
                ours: VERSION,
                theirs: r.version,
            },
            RejectReason::Malformed => Error::Refused { message: r.message },
            RejectReason::TooLarge => Error::HelloTooLarge {
                len: self.hello.len(),
                limit: r.too_large.map_or(0, |t| t.limit as usize),
                hellos_sent: self.sent,
            },
        }));
    }

    /// The outcome, once there is one (taken once).
    pub fn poll_outcome(&mut self) -> Option<Result<Outcome, Error>> {
        let mut r = self.result.take();
        if let Some(Ok(out)) = &mut r {
            out.early_replies = std::mem::take(&mut self.early_replies);
        }
        self.finished |= r.is_some();
        r
    }

    fn done(&self) -> bool {
        self.finished || self.result.is_some()
    }

    /// This handshake's connection id.
    pub fn conn_id(&self) -> u64 {
        self.conn_id
    }
}
