//! [`Tagged`]: the connection a negotiated stack is built on. It puts the `DATA` tag in
//! front of every message (without copying it, through [`SendHeader`]), strips it on
//! receive, and applies what [`crate::control::classify`] decides for the control messages
//! that can still arrive after the handshake (a retransmitted hello is answered with the
//! cached accept; a duplicate accept is ignored; a CLOSE with this connection's id ends it,
//! docs/wire.md §7.6).
//!
//! A server connection may *hold* its accept (an accepted 0-RTT answer): the first message
//! the application sends then carries it (`ACCEPT_DATA`, one datagram instead of two), and
//! it is sent alone as soon as the application waits to receive instead, or when the
//! listener's hold time runs out ([`crate::Config::accept_hold`]).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use bytes::{Buf, Bytes};
use chunnel::{ChunnelConnection, EitherFuture, Error, PeerHandoff, SendHeader};

use tokio::sync::mpsc;

use crate::control::{Inbound, Role, SideState, classify};
use crate::multilateral::{Event, Multilateral, ProposeError};
use crate::plane::{Clock, ControlPlane, SendFuture, Work};
use crate::wire::Tag;

const DATA: &[u8] = &[Tag::Data as u8];

/// `Shared::mode` bits: anything set sends through the slow path.
const CAPTURING: u8 = 1;
const ACCEPT_HELD: u8 = 2;
/// The connection is over (`Shared::ended` says how): sends fail.
const ENDED: u8 = 4;

/// `Shared::ended`: open.
const OPEN: u8 = 0;
/// `Shared::ended`: the peer ended it (a CLOSE, or a new client took its address over).
const PEER_ENDED: u8 = 1;
/// `Shared::ended`: this side closed it.
const CLOSED: u8 = 2;

/// The base connection of a negotiated stack; cheap to clone (shared).
///
/// Each clone is a *view* of the one connection. Views differ only at a multilateral
/// reconfiguration's switch point ([`crate::commit`]): the view that receives the peer's
/// marker ends there ([`chunnel::Error::EndOfEpoch`]) and later views (the new stack's, built
/// over a fresh clone) receive what follows.
#[derive(Debug)]
pub struct Tagged<C> {
    shared: Arc<Shared<C>>,
    view: u64,
}

impl<C> Clone for Tagged<C> {
    fn clone(&self) -> Self {
        Tagged {
            shared: Arc::clone(&self.shared),
            view: self.shared.views.fetch_add(1, Ordering::Relaxed),
        }
    }
}

#[derive(Debug)]
struct Shared<C> {
    inner: C,
    /// Server side: the answer to the hello, re-sent to retransmissions.
    answer: Option<Answer>,
    reply_due: AtomicBool,
    /// [`CAPTURING`] | [`ACCEPT_HELD`] | [`ENDED`]: one load on the send path covers all.
    mode: AtomicU8,
    /// The largest message the base carries (an `ACCEPT_DATA` must fit).
    max_message: usize,
    /// There are messages to deliver in `pending` or `raw` (never set while capturing).
    has_pending: AtomicBool,
    /// Data to deliver first (tag stripped). While capturing (a client before its
    /// handshake, which delivers nothing yet), the messages captured instead; `has_pending`
    /// stays false meanwhile.
    pending: Mutex<VecDeque<Bytes>>,
    ignored: AtomicU64,
    /// The connection's id (the client's hello's): a CLOSE must carry it.
    conn_id: u64,
    /// [`OPEN`], [`PEER_ENDED`] (a CLOSE with this `conn_id` arrived, or, server side, a new
    /// client took over this peer address) or [`CLOSED`] (this side closed it).
    ended: AtomicU8,
    /// The next view id.
    views: AtomicU64,
    /// Views up to this id have ended at a peer's switch point (0: none).
    ended_upto: AtomicU64,
    /// Multilateral reconfiguration, once enabled ([`crate::commit::Coordinator`]). Boxed:
    /// the state machine is a few hundred bytes that most connections never use.
    ctl: OnceLock<Box<Ctl>>,
    /// Server side: accepted, but no data from the client yet. The base is marked silent
    /// meanwhile ([`PeerHandoff::mark_silent`]): a listener at its peer cap may end this
    /// connection for a new peer, as it may a peer that never sent a hello.
    awaiting_data: AtomicBool,
}

/// The reconfiguration state machine of one connection and where its events go.
#[derive(Debug)]
pub(crate) struct Ctl {
    pub(crate) machine: Mutex<Multilateral>,
    pub(crate) events: mpsc::Sender<Work>,
    /// The time the machine is given (the coordinator's clock).
    clock: Arc<dyn Clock>,
    /// Messages received after a peer's switch point, tag included, for the next view to
    /// handle as if they had just arrived (there is a switch point only with reconfiguration
    /// enabled).
    raw: Mutex<VecDeque<Bytes>>,
}

/// A server connection's answer to its hello: the encoded accept, or (`accept_at` > 0) an
/// `ACCEPT_DATA` header that ends with it, held back to go out with the first reply (one
/// buffer for both: the accept is its tail). Kept in the connection itself when short (as it
/// nearly always is): no allocation lives as long as the connection for it. It is sent as a
/// header (before an empty message when alone).
#[derive(Debug)]
struct Answer {
    accept_at: usize,
    stored: Stored,
}

/// The bytes of an [`Answer`].
#[derive(Debug)]
enum Stored {
    Inline { len: u8, b: [u8; Stored::INLINE] },
    Heap(Bytes),
}

impl Stored {
    const INLINE: usize = 62;
}

impl Answer {
    fn new(bytes: Bytes, accept_at: usize) -> Self {
        let stored = match u8::try_from(bytes.len()) {
            Ok(len) if bytes.len() <= Stored::INLINE => {
                let mut b = [0; Stored::INLINE];
                b[..bytes.len()].copy_from_slice(&bytes);
                Stored::Inline { len, b }
            }
            _ => Stored::Heap(bytes),
        };
        Answer { accept_at, stored }
    }

    /// All of it (the `ACCEPT_DATA` header when held).
    fn bytes(&self) -> &[u8] {
        match &self.stored {
            Stored::Inline { len, b } => &b[..usize::from(*len)],
            Stored::Heap(b) => b,
        }
    }

    /// The accept alone.
    fn accept(&self) -> &[u8] {
        self.bytes().get(self.accept_at..).unwrap_or_default()
    }
}

use chunnel::util::lock;

impl<C> Tagged<C> {
    fn with(inner: C, conn_id: u64, answer: Option<Answer>, max_message: usize) -> Self {
        let held = answer.as_ref().is_some_and(|a| a.accept_at > 0);
        let mode = if held { ACCEPT_HELD } else { 0 };
        Tagged {
            shared: Arc::new(Shared {
                inner,
                answer,
                reply_due: AtomicBool::new(false),
                mode: AtomicU8::new(mode),
                max_message,
                has_pending: AtomicBool::new(false),
                pending: Mutex::new(VecDeque::new()),
                ignored: AtomicU64::new(0),
                conn_id,
                ended: AtomicU8::new(OPEN),
                views: AtomicU64::new(2),
                ended_upto: AtomicU64::new(0),
                ctl: OnceLock::new(),
                awaiting_data: AtomicBool::new(false),
            }),
            view: 1,
        }
    }

    /// A client's tagged connection; `conn_id` is its hello's.
    pub(crate) fn client(inner: C, conn_id: u64) -> Self {
        Self::with(inner, conn_id, None, 0)
    }

    /// A server's tagged connection that answers hellos with `conn_id` by `response`;
    /// `max_message` bounds a coalesced accept and reply.
    pub(crate) fn server(inner: C, conn_id: u64, response: Bytes, max_message: usize) -> Self {
        let answer = Answer::new(response, 0);
        Self::with(inner, conn_id, Some(answer), max_message)
    }

    /// As [`Tagged::server`], holding the accept back to send it with the first reply:
    /// `header` is its `ACCEPT_DATA` form, which ends with the accept (docs/wire.md §7.5).
    /// See the module docs for when it goes out alone.
    pub(crate) fn server_holding(
        inner: C,
        conn_id: u64,
        header: Bytes,
        max_message: usize,
    ) -> Self {
        debug_assert_eq!(header.first(), Some(&(Tag::AcceptData as u8)));
        let answer = Answer::new(header, crate::wire::ACCEPT_DATA_PREFIX);
        Self::with(inner, conn_id, Some(answer), max_message)
    }

    /// A handle that does not keep the connection alive.
    pub(crate) fn downgrade(&self) -> WeakTagged<C> {
        WeakTagged(Arc::downgrade(&self.shared))
    }

    /// The base connection.
    pub fn get_ref(&self) -> &C {
        &self.shared.inner
    }

    /// Messages dropped because they were not data for this connection (stale control
    /// messages, unknown tags, empty messages).
    pub fn ignored(&self) -> u64 {
        self.shared.ignored.load(Ordering::Relaxed)
    }

    /// Queues messages (tag already stripped) to be received before anything else.
    pub(crate) fn push_pending(&self, msgs: Vec<Bytes>) {
        let mut q = lock(&self.shared.pending);
        if q.is_empty() {
            // Takes the vector's buffer over (no allocation, no copy).
            *q = VecDeque::from(msgs);
        } else {
            q.extend(msgs);
        }
        let q = &*q;
        self.shared.has_pending.store(
            !q.is_empty() || self.shared.raw().is_some_and(|r| !r.is_empty()),
            Ordering::Release,
        );
    }

    /// While capturing, `send` collects messages instead of sending them (0-RTT: they ride
    /// in the hello).
    pub(crate) fn start_capture(&self) {
        self.shared.mode.fetch_or(CAPTURING, Ordering::AcqRel);
    }

    /// Stops capturing and returns what was captured.
    pub(crate) fn take_capture(&self) -> Vec<Bytes> {
        // Under the queue's lock, as `capture` looks at the bit: a send racing with this either
        // was captured before, or sees the capture over and goes out.
        let mut q = lock(&self.shared.pending);
        self.shared.mode.fetch_and(!CAPTURING, Ordering::AcqRel);
        // Pushed to the back of an empty queue: contiguous, taken without a copy.
        Vec::from(std::mem::take(&mut *q))
    }
}

/// What [`Shared::send_slow`] did with a burst.
enum SlowSend<F> {
    /// Kept for the hello (0-RTT capture).
    Captured,
    /// Sent already (the held accept and its reply, in one datagram).
    Sent(Result<(), Error>),
    /// To be sent by this (boxed) future.
    Later(Pin<Box<F>>),
}

impl<F: Future<Output = Result<(), Error>>> SlowSend<F> {
    async fn finish(self) -> Result<(), Error> {
        match self {
            SlowSend::Captured => Ok(()),
            SlowSend::Sent(r) => r,
            SlowSend::Later(f) => f.await,
        }
    }
}

/// A [`Tagged`] that may be gone: lets the listener release a held accept on time.
#[derive(Debug)]
pub(crate) struct WeakTagged<C>(Weak<Shared<C>>);

impl<C: SendHeader> WeakTagged<C> {
    /// Whether the connection is alive and still holds its accept (most accepts left with
    /// the first reply long before their time was up: those need no send future).
    pub(crate) fn may_hold(&self) -> bool {
        self.0
            .upgrade()
            .is_some_and(|sh| sh.mode.load(Ordering::Acquire) & ACCEPT_HELD != 0)
    }

    /// Sends the held accept alone, if the connection is alive and still holds it.
    pub(crate) async fn release_accept(&self) {
        if let Some(sh) = self.0.upgrade() {
            // Best effort, like every datagram: a lost accept is answered again when the
            // client retransmits its hello.
            let _ = sh.release_accept().await;
        }
    }
}

impl<C> Shared<C> {
    /// The error every call of an ended connection fails with: [`Error::Closed`] once this
    /// side closed it, [`Error::PeerClosed`] once the peer did; `None` while it is open.
    fn ended_error(&self) -> Option<Error> {
        match self.ended.load(Ordering::Acquire) {
            OPEN => None,
            PEER_ENDED => Some(Error::PeerClosed),
            _ => Some(Error::Closed),
        }
    }

    /// Marks the connection ended by the peer (unless it is already over). True if this
    /// call ended it.
    fn end_by_peer(&self) -> bool {
        let ended = self
            .ended
            .compare_exchange(OPEN, PEER_ENDED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        self.mode.fetch_or(ENDED, Ordering::AcqRel);
        ended
    }

    /// Marks the connection closed by this side. True if it was open until now (the peer
    /// has not ended it): then the peer is to be told.
    fn end_here(&self) -> bool {
        let was = self.ended.swap(CLOSED, Ordering::AcqRel);
        self.mode.fetch_or(ENDED, Ordering::AcqRel);
        was == OPEN
    }

    /// The held accept's `ACCEPT_DATA` header, taken from its hold (once).
    fn take_held(&self) -> Option<&[u8]> {
        if self.mode.load(Ordering::Acquire) & ACCEPT_HELD == 0
            || self.mode.fetch_and(!ACCEPT_HELD, Ordering::AcqRel) & ACCEPT_HELD == 0
        {
            return None;
        }
        self.answer.as_ref().map(Answer::bytes)
    }

    /// The messages after a peer's switch point, if reconfiguration is enabled.
    fn raw(&self) -> Option<MutexGuard<'_, VecDeque<Bytes>>> {
        self.ctl.get().map(|c| lock(&c.raw))
    }
}

impl<C: SendHeader> Shared<C> {
    /// Sends the held accept alone (it is still `answer`), if there is one.
    async fn release_accept(&self) -> Result<(), Error> {
        match (self.take_held(), &self.answer) {
            (Some(_), Some(a)) => {
                self.inner
                    .send_with_header(a.accept(), [Bytes::new()])
                    .await
            }
            _ => Ok(()),
        }
    }

    /// Keeps a burst sent while capturing (0-RTT early data, which goes in the hello):
    /// `header` (of tagging layers above) is copied in front of each message. Returns
    /// `None`, giving the burst back, when not capturing.
    fn capture<B: IntoIterator<Item = Bytes>>(&self, header: &[u8], burst: B) -> Option<B> {
        if self.mode.load(Ordering::Acquire) & CAPTURING == 0 {
            return Some(burst);
        }
        let mut q = lock(&self.pending);
        // Looked at again under the lock `take_capture` ends the capture under: a burst is
        // never queued after the capture was taken (it would be delivered as received).
        if self.mode.load(Ordering::Acquire) & CAPTURING == 0 {
            return Some(burst);
        }
        if header.is_empty() {
            q.extend(burst);
        } else {
            // Rare (a tagging layer's 0-RTT data): header and payload copied once.
            q.extend(
                burst
                    .into_iter()
                    .map(|m| Bytes::from([header, &m[..]].concat())),
            );
        }
        None
    }

    /// The send path when `mode` is not 0: capture (0-RTT early data), or carry the held
    /// accept in front of the first message. `header` goes after the DATA tag (tagging
    /// layers above). Taken at most once per connection while an accept is held, so the
    /// future is boxed (here, so that the caller's future holds only the pointer): inline,
    /// it made every send's future larger, which every task that sends carries for its
    /// whole life.
    ///
    /// The usual case, the held accept and one reply that fit one datagram, is sent at once
    /// when the base connection can ([`SendHeader::try_send_with_header`]): no future at all.
    fn send_slow<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> SlowSend<impl Future<Output = Result<(), Error>> + Send + 'a>
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        if let Some(e) = self.ended_error() {
            return SlowSend::Sent(Err(e));
        }
        let Some(burst) = self.capture(header, burst) else {
            return SlowSend::Captured;
        };
        let mut it = burst.into_iter();
        let held = self.take_held();
        let first = it.next();
        let mut second = None;
        if let (Some(h), Some(m)) = (&held, &first)
            && header.is_empty()
            && h.len() + m.len() <= self.max_message
        {
            second = it.next();
            if second.is_none()
                && let Some(r) = self.inner.try_send_with_header(h, m)
            {
                return SlowSend::Sent(r);
            }
        }
        let rest = first.into_iter().chain(second).chain(it);
        SlowSend::Later(Box::pin(self.send_held(header, held, rest)))
    }

    /// Sends `held` (the accept taken from its hold, if it was) in front of the first
    /// message of `burst`, and the rest as DATA.
    async fn send_held<I>(&self, header: &[u8], held: Option<&[u8]>, burst: I) -> Result<(), Error>
    where
        I: Iterator<Item = Bytes> + Send,
    {
        let mut it = burst.peekable();
        if let Some(held) = held {
            match it.next() {
                Some(first) if held.len() + header.len() + first.len() <= self.max_message => {
                    // Once per connection: the accept, any layer header, the reply.
                    if header.is_empty() {
                        self.inner.send_with_header(held, [first]).await?;
                    } else {
                        let h = [held, header].concat();
                        self.inner.send_with_header(&h, [first]).await?;
                    }
                }
                // Rare (a reply too long to carry the accept): boxed, to keep this future
                // small.
                first => Box::pin(self.send_accept_then(header, first)).await?,
            }
        }
        if it.peek().is_some() {
            // Boxed too: a burst after the held accept's reply is rare.
            Box::pin(send_data(&self.inner, header, it)).await?;
        }
        Ok(())
    }

    /// Sends the accept alone, then `first` (if any) as DATA.
    async fn send_accept_then(&self, header: &[u8], first: Option<Bytes>) -> Result<(), Error> {
        if let Some(a) = &self.answer {
            self.inner
                .send_with_header(a.accept(), [Bytes::new()])
                .await?;
        }
        if let Some(m) = first {
            send_data(&self.inner, header, [m]).await?;
        }
        Ok(())
    }
}

/// Sends `burst` as DATA with `header` after the tag. Only the headers are copied, into a
/// stack buffer when short (no allocation), never the payload.
async fn send_data<C, B>(inner: &C, header: &[u8], burst: B) -> Result<(), Error>
where
    C: SendHeader,
    B: IntoIterator<Item = Bytes> + Send,
    B::IntoIter: Send,
{
    let mut short = [0u8; 32];
    let long;
    let h: &[u8] = if header.len() < short.len() {
        short[..1].copy_from_slice(DATA);
        short[1..=header.len()].copy_from_slice(header);
        &short[..=header.len()]
    } else {
        long = [DATA, header].concat();
        &long
    };
    inner.send_with_header(h, burst).await
}

impl<C: SendHeader + PeerHandoff> ChunnelConnection for Tagged<C> {
    type Data = Bytes;

    #[inline]
    // Not an `async fn`: it would keep its arguments twice in the future.
    #[allow(clippy::manual_async_fn)]
    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        async move {
            let sh = &*self.shared;
            if sh.mode.load(Ordering::Acquire) != 0 {
                // As in `send_with_header`.
                return sh.send_slow(&[], burst).finish().await;
            }
            sh.inner.send_with_header(DATA, burst).await
        }
    }

    // Not an `async fn`: it would keep its arguments twice in the future.
    #[allow(clippy::manual_async_fn)]
    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Bytes>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        async move {
            if slots.is_empty() {
                return Ok(0);
            }
            loop {
                if let Some(e) = self.shared.ended_error() {
                    return Err(e);
                }
                if self.view <= self.shared.ended_upto.load(Ordering::Acquire) {
                    return Err(Error::EndOfEpoch);
                }
                // Answer a retransmitted hello here, before taking any data, so cancelling this
                // future never loses a received message. The sends of this function are rare and
                // boxed: inline, each made every receive's future (which a serving task carries
                // for its whole life) the size of a send's larger.
                if self.shared.reply_due.swap(false, Ordering::AcqRel)
                    && let Some(a) = &self.shared.answer
                {
                    Box::pin(
                        self.shared
                            .inner
                            .send_with_header(a.accept(), [Bytes::new()]),
                    )
                    .await?;
                }
                let mut from_raw = 0;
                if self.shared.has_pending.load(Ordering::Acquire) {
                    let mut q = lock(&self.shared.pending);
                    let mut raw = self.shared.raw();
                    let mut n = 0;
                    for s in slots.iter_mut() {
                        match q.pop_front() {
                            Some(m) => {
                                *s = Some(m);
                                n += 1;
                            }
                            None => break,
                        }
                    }
                    if n == 0
                        && let Some(raw) = raw.as_mut()
                    {
                        // Left over from a switch point: handled below like fresh arrivals.
                        for s in slots.iter_mut() {
                            match raw.pop_front() {
                                Some(m) => {
                                    *s = Some(m);
                                    from_raw += 1;
                                }
                                None => break,
                            }
                        }
                    }
                    if n > 0 && q.is_empty() {
                        // Early data and replies are delivered once, at the start: their
                        // buffer is not kept for the connection's whole life.
                        *q = VecDeque::new();
                    }
                    self.shared.has_pending.store(
                        !q.is_empty() || raw.is_some_and(|r| !r.is_empty()),
                        Ordering::Release,
                    );
                    if n > 0 {
                        return Ok(n);
                    }
                }
                let n = if from_raw > 0 {
                    from_raw
                } else {
                    // The application waits for the peer instead of replying: the held accept
                    // goes out alone now.
                    if self.shared.mode.load(Ordering::Acquire) & ACCEPT_HELD != 0 {
                        Box::pin(self.shared.release_accept()).await?;
                    }
                    self.shared.inner.recv(slots).await?
                };
                // What `classify` needs, once per batch.
                let side = SideState {
                    role: if self.shared.answer.is_some() {
                        Role::Server
                    } else {
                        Role::Client
                    },
                    conn_id: self.shared.conn_id,
                    reconfig: self.shared.ctl.get().is_some(),
                };
                let mut kept = 0;
                let mut cut = false;
                let mut closed = false;
                for i in 0..n.min(slots.len()) {
                    if closed {
                        // After the peer's CLOSE: nothing more is delivered.
                        slots[i] = None;
                        continue;
                    }
                    if cut {
                        // After the peer's switch point: for the next view, in order.
                        // (`cut` is set only with reconfiguration enabled.)
                        if let Some(m) = slots[i].take()
                            && let Some(mut raw) = self.shared.raw()
                        {
                            raw.push_back(m);
                            self.shared.has_pending.store(true, Ordering::Release);
                        }
                        continue;
                    }
                    let Some(mut m) = slots[i].take() else {
                        continue;
                    };
                    match classify(&m, &side) {
                        Inbound::Data(at) => {
                            m.advance(at);
                            slots[kept] = Some(m);
                            kept += 1;
                        }
                        Inbound::AnswerHello => {
                            self.shared.reply_due.store(true, Ordering::Release);
                        }
                        // This connection ends (after the data already taken), unless the
                        // base has no listener to hand the hello to.
                        Inbound::NewClient => {
                            if self.shared.inner.hand_off(m) {
                                self.shared.end_by_peer();
                            } else {
                                self.shared.ignored.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        // The base is released at once (a listener frees this peer's state
                        // now).
                        Inbound::Close => {
                            if self.shared.end_by_peer() {
                                self.shared.inner.release();
                            }
                            closed = true;
                        }
                        Inbound::Control => {
                            if let Some(ctl) = self.shared.ctl.get()
                                && self.shared.control(ctl, &m)
                            {
                                // The peer's switch point: this view ends after the
                                // messages before it.
                                cut = true;
                            }
                        }
                        Inbound::Ignore(_) => {
                            self.shared.ignored.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                // No await from here on: messages are taken, and a cancelled receive must not
                // lose them.
                if cut {
                    self.shared
                        .ended_upto
                        .fetch_max(self.view, Ordering::AcqRel);
                    if kept == 0 {
                        return Err(Error::EndOfEpoch);
                    }
                }
                if kept > 0 {
                    if self.shared.awaiting_data.load(Ordering::Relaxed)
                        && self.shared.awaiting_data.swap(false, Ordering::Relaxed)
                    {
                        self.shared.inner.mark_silent(false);
                    }
                    return Ok(kept);
                }
                if closed {
                    return Err(self.shared.ended_error().unwrap_or(Error::PeerClosed));
                }
            }
        }
    }
}

impl<C: SendHeader + PeerHandoff + 'static> Tagged<C> {
    /// Server side, for a connection accepted without early data: until the client's first
    /// data message arrives, the base stays marked silent, so a listener at its peer cap may
    /// end it to admit a new peer (a flood of hellos that never go on to send data cannot
    /// hold every place; docs/wire.md §13).
    pub(crate) fn await_first_data(&self) {
        self.shared.awaiting_data.store(true, Ordering::Relaxed);
        self.shared.inner.mark_silent(true);
    }

    /// The connection's in-band control channel, type erased (shares the connection; no
    /// allocation).
    pub(crate) fn control_plane(&self) -> Arc<dyn ControlPlane> {
        self.shared.clone()
    }
}

impl<C: SendHeader + PeerHandoff + 'static> ControlPlane for Shared<C> {
    fn enable(&self, machine: Multilateral, clock: Arc<dyn Clock>) -> Option<mpsc::Receiver<Work>> {
        // Bounded: a transaction makes a handful of work items; only a peer flooding control
        // messages fills it, and then loses the answers to its own flood.
        let (tx, rx) = mpsc::channel(256);
        self.ctl
            .set(Box::new(Ctl {
                machine: Mutex::new(machine),
                events: tx,
                clock,
                raw: Mutex::new(VecDeque::new()),
            }))
            .ok()
            .map(|()| rx)
    }

    fn machine(&self) -> Option<&Mutex<Multilateral>> {
        self.ctl.get().map(|c| &c.machine)
    }

    fn propose(
        &self,
        pick: &chunnel::Pick,
        txn: u64,
        proposed: &mut dyn FnMut(),
    ) -> Option<Result<(), ProposeError>> {
        let ctl = self.ctl.get()?;
        let mut machine = lock(&ctl.machine);
        let r = machine.propose(pick, txn, ctl.clock.now());
        if r.is_ok() {
            proposed();
            // Full only under a peer's flood of control messages; the machine resends the
            // prepare on its timer.
            while let Some(msg) = machine.poll_transmit() {
                let _ = ctl.events.try_send(Work::Propose { txn, msg });
            }
        }
        Some(r)
    }

    fn send(&self, m: Bytes) -> SendFuture<'_> {
        Box::pin(self.inner.send_with_header(&[], [m]))
    }

    fn conn_id(&self) -> u64 {
        self.conn_id
    }

    fn close(&self) -> SendFuture<'_> {
        Box::pin(async move {
            let r = if self.end_here() {
                let m = crate::proto::close_message(self.conn_id);
                self.inner.send_with_header(&[], [m]).await
            } else {
                Ok(())
            };
            self.inner.release();
            r
        })
    }

    fn close_on_drop(self: Arc<Self>) {
        // Client side only: a server's dropped connection leaves the listener by itself.
        if self.answer.is_some() || !self.end_here() {
            return;
        }
        let m = crate::proto::close_message(self.conn_id);
        // Best effort: one datagram, now if the socket takes it, else from a task of the
        // current runtime (if there is one); never retransmitted.
        if self.inner.try_send_with_header(&[], &m).is_some() {
            self.inner.release();
        } else if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = self.inner.send_with_header(&[], [m]).await;
                self.inner.release();
            });
        }
    }
}

impl<C> Shared<C> {
    /// Feeds one reconfiguration message to the state machine and hands its answers and
    /// events to the coordinator's task (the receive path must not wait to send them: it
    /// holds messages a cancelled receive would lose). True if the message was the peer's
    /// switch point.
    fn control(&self, ctl: &Ctl, m: &[u8]) -> bool {
        let mut machine = lock(&ctl.machine);
        machine.handle_message(m, ctl.clock.now());
        // The receiver lives as long as the coordinator; without it nobody acts anyway.
        while let Some(t) = machine.poll_transmit() {
            let _ = ctl.events.try_send(Work::Send(t));
        }
        let mut marker = false;
        while let Some(e) = machine.poll_event() {
            marker |= matches!(e, Event::PeerSwitched { .. });
            let _ = ctl.events.try_send(Work::Event(e));
        }
        marker
    }
}

impl<C: SendHeader + PeerHandoff> SendHeader for Tagged<C> {
    // Layers above may tag too; their header goes after ours.
    fn send_with_header<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        // The way is chosen as the future is made (unlike `send`, which chooses at its first
        // poll): `mode` is set before any clone exists and only clears later, and the slow way
        // looks at everything again when polled.
        let sh = &*self.shared;
        if sh.mode.load(Ordering::Acquire) == 0 {
            EitherFuture::Left(send_data(&sh.inner, header, burst))
        } else {
            // A held accept (boxed, see `send_slow`), or capture (no future).
            EitherFuture::Right(async move { sh.send_slow(header, burst).finish().await })
        }
    }
}

/// Nothing to hand over: every view shares the one base and its queues, which outlive a
/// switch of the stack above them.
impl<C: SendHeader + PeerHandoff> chunnel::Handover for Tagged<C> {
    fn export(&self, _: &mut chunnel::Handoff<Self::Data>) {}
    fn import(&self, _: &mut chunnel::Handoff<Self::Data>) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_keep_their_bytes_inline_or_not() {
        for len in [5, Stored::INLINE, Stored::INLINE + 1, 300] {
            let all: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let a = Answer::new(Bytes::from(all.clone()), 3);
            assert_eq!(a.bytes(), &all[..], "{len} bytes");
            assert_eq!(a.accept(), &all[3..], "{len} bytes");
            assert_eq!(
                matches!(a.stored, Stored::Inline { .. }),
                len <= Stored::INLINE,
                "{len} bytes"
            );
        }
        // An answer shorter than its prefix has no accept, rather than a panic.
        assert_eq!(Answer::new(Bytes::from_static(b"ab"), 3).accept(), b"");
    }
}
