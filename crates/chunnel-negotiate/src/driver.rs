//! Thin async drivers around [`crate::proto`]: [`Client::connect`], [`Client::connect_0rtt`]
//! and [`listen`].

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use chunnel::negotiate::ChunnelInfo;
use chunnel::{Chunnel, ChunnelConnection, OfferTree, Offers, PeerHandoff, Pick, SendHeader};
use tokio::time::Instant;

use crate::Error;
use crate::plane::Control;
use crate::proto::{ClientHandshake, HelloTemplate, KnownAccept, Outcome, Timing};
use crate::tagged::Tagged;
use crate::ticker::Ticker;
use crate::wire::{Tag, ZeroRtt};

mod server;

pub use server::{
    CROWDED_HELLO_WAIT, NegotiatedListener, Serving, concurrent_searches, listen, listen_with,
};

/// Negotiation settings shared by clients and servers.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Retransmission and size limits of the client's hello.
    pub timing: Timing,
    /// How long a server waits for the hello on a new base connection. While the base
    /// listener is crowded ([`chunnel::PeerHandoff::crowded`]: a datagram listener over half
    /// its `max_peers`), a connection still without a hello is given up after
    /// [`CROWDED_HELLO_WAIT`] instead, so silent peers do not hold the room.
    pub hello_timeout: Duration,
    /// Negotiated connections (or per-client errors) a server queues for `accept`.
    pub backlog: usize,
    /// Remembered picks (0-RTT) per client.
    pub cache_entries: usize,
    /// Server: how long an accepted 0-RTT answer may wait for the application's first reply
    /// so both go in one message (`ACCEPT_DATA`, docs/wire.md §7.5). It goes out alone
    /// earlier if the application waits to receive first, and at most 1 ms later than this
    /// otherwise (held accepts are released by one timer, in 1 ms steps). Zero sends every
    /// accept at once.
    pub accept_hold: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            timing: Timing::default(),
            hello_timeout: Duration::from_secs(10),
            backlog: 128,
            cache_entries: 4096,
            accept_hold: Duration::from_millis(2),
        }
    }
}

/// What negotiation decided for one connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Info {
    /// The pick applied to the client's stack.
    pub client_pick: Pick,
    /// The pick applied to the server's stack.
    pub server_pick: Pick,
    /// The server's chosen stack, top first.
    pub server_stack: Arc<[ChunnelInfo]>,
    /// What happened to a 0-RTT attempt.
    pub zero_rtt: ZeroRtt,
    /// Hellos the client sent (more than 1 means some were lost); 0 on the server.
    pub hellos_sent: u32,
}

/// A negotiated connection: the picked stack's connection plus what was decided.
///
/// [`Negotiated::close`] ends it and tells the peer (a CLOSE, docs/wire.md §7.6). Dropping a
/// client's connection without closing it sends the CLOSE on a best-effort basis: one
/// datagram, sent at once if the socket takes it without waiting, otherwise from a task
/// spawned on the current tokio runtime (none if the drop happens outside a runtime); it is
/// never retransmitted, so a lost CLOSE leaves the server to find the connection idle.
/// Dropping a server's connection frees its state on the listener and tells the client
/// nothing.
#[derive(Debug)]
pub struct Negotiated<C> {
    conn: C,
    /// Shared with the other connections that got the same decision (see [`InfoCache`]).
    info: Arc<Info>,
    control: Control,
    /// The messages that decided this connection (see [`Negotiated::transcript`]).
    transcript: Transcript,
    /// Dropped after `conn` (fields drop in order): the CLOSE leaves once the stack is gone.
    on_drop: CloseOnDrop,
}

/// What happened to 0-RTT on a negotiated connection (for the observation hooks).
pub(crate) fn zero_rtt_of<C>(n: &Negotiated<C>) -> crate::wire::ZeroRtt {
    n.info.zero_rtt
}

/// The two messages that decided a 1-RTT negotiated connection, exactly as this end sent or
/// received them (tag byte included), for binding them to a secure channel (docs/wire.md
/// §16). Both are empty where the driver does not record them: a 0-RTT or dictated
/// connection's, and a server's answer held for its first reply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Transcript {
    /// The HELLO: as the client sent it, as the server received it.
    pub hello: Bytes,
    /// The ACCEPT: as the server sent it, as the client received it.
    pub accept: Bytes,
}

/// Sends the connection's best-effort CLOSE when the [`Negotiated`] holding it is dropped
/// (unless [`Negotiated::into_parts`] took the connection out).
#[derive(Debug)]
struct CloseOnDrop(Option<Control>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.0.close_on_drop();
        }
    }
}

fn control<C: SendHeader + PeerHandoff + 'static>(t: &Tagged<C>) -> Control {
    Control(t.control_plane())
}

impl<C> Negotiated<C> {
    fn new(conn: C, info: Arc<Info>, control: Control) -> Self {
        Negotiated {
            conn,
            info,
            on_drop: CloseOnDrop(Some(control.clone())),
            control,
            transcript: Transcript::default(),
        }
    }

    fn with_transcript(mut self, transcript: Transcript) -> Self {
        self.transcript = transcript;
        self
    }

    /// The HELLO and ACCEPT that decided this connection, as this end sent or received them
    /// (see [`Transcript`]).
    pub fn transcript(&self) -> &Transcript {
        &self.transcript
    }

    pub(crate) fn control(&self) -> &Control {
        &self.control
    }

    /// Ends the connection and tells the peer: sends one CLOSE (docs/wire.md §7.6) carrying
    /// the connection's id, unless the peer ended the connection first, and releases the base
    /// connection (on a server, the listener frees this peer's state at once). The peer's
    /// receive then ends with [`chunnel::Error::PeerClosed`] after what was sent before.
    /// Later calls on this connection fail with [`chunnel::Error::Closed`]; closing again does
    /// nothing. The CLOSE is sent once and not acknowledged: if it is lost, the peer finds out
    /// as it would without it (a server by its idle timeout).
    pub async fn close(&self) -> Result<(), Error> {
        self.control.0.close().await.map_err(Error::Chunnel)
    }

    /// The connection's id: the one the client's hello carried and the server's accept
    /// echoed (docs/wire.md §8.1). A CLOSE must carry it.
    pub fn conn_id(&self) -> u64 {
        self.control.0.conn_id()
    }

    /// What negotiation decided.
    pub fn info(&self) -> &Info {
        &self.info
    }

    /// The stack's connection.
    pub fn get_ref(&self) -> &C {
        &self.conn
    }

    /// Splits into the stack's connection and the decision.
    /// The connection taken out is no longer closed when dropped (see [`Negotiated`]).
    pub fn into_parts(self) -> (C, Info) {
        let Negotiated {
            conn,
            info,
            mut on_drop,
            ..
        } = self;
        on_drop.0 = None;
        (conn, Arc::unwrap_or_clone(info))
    }
}

impl<C: ChunnelConnection> ChunnelConnection for Negotiated<C> {
    type Data = C::Data;

    #[inline]
    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), chunnel::Error>> + Send
    where
        B: IntoIterator<Item = Self::Data> + Send,
        B::IntoIter: Send,
    {
        self.conn.send(burst)
    }

    #[inline]
    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Self::Data>],
    ) -> impl Future<Output = Result<usize, chunnel::Error>> + Send + 'a {
        self.conn.recv(slots)
    }
}

/// The hasher of the client's cache: 64-bit FNV-1a. Its keys are the application's own names
/// for its servers, not bytes a peer chooses, so a keyed hash buys nothing there (std's
/// SipHash costs ~250 instructions per connect).
struct NameHasher(u64);

impl Default for NameHasher {
    fn default() -> Self {
        NameHasher(0xcbf2_9ce4_8422_2325)
    }
}

impl std::hash::Hasher for NameHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Applies a pick already known to name one of `stack`'s offers (the handshake checked it
/// against the offers it sent, or the server chose it from its own): unlike
/// [`Offers::apply`], this does not list the offers again to check it.
fn apply_known<S: Offers>(stack: &mut S, pick: &Pick) -> Result<(), Error> {
    let mut r = pick.reader();
    stack.apply_pick(&mut r)?;
    r.finish()?;
    Ok(())
}

/// Polls `fut` once with the caller's context.
async fn poll_once<F: Future + Unpin>(mut fut: F) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut fut).poll(cx))).await
}

/// A fresh connection id: a counter under a keyed hash whose random key is drawn once per
/// process (so ids are distinct and not guessable from earlier ones, without a clock read
/// or a new key per connection).
fn new_conn_id() -> u64 {
    // 0 means "unknown" in a reject.
    chunnel::util::random_u64().max(1)
}

/// How finely the listener's held accepts are released (see [`Config::accept_hold`]).
const HOLD_GRAIN: Duration = Duration::from_millis(1);

/// `t` rounded up to the next multiple of `grain` since a fixed point of this process.
fn coarse_by(t: Instant, grain: Duration) -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    let grain = grain.as_nanos().max(1);
    let since = t.saturating_duration_since(epoch).as_nanos();
    let up = since.div_ceil(grain) * grain;
    epoch + Duration::from_nanos(u64::try_from(up).unwrap_or(u64::MAX))
}

/// Runs a client handshake over `base` to its outcome. `started` is the time the handshake
/// was made with. With `record`, the hello sent and the accept the outcome is made of are
/// kept there.
async fn drive<C: SendHeader>(
    base: &C,
    hs: &mut ClientHandshake,
    ticker: &Arc<Ticker>,
    started: Instant,
    mut record: Option<&mut Transcript>,
) -> Result<Outcome, Error> {
    // Accepts for this connection id, as received (a few, without allocating: the outcome
    // names the one taken).
    let mut accepts: [Option<Bytes>; 4] = Default::default();
    // Two: the accept and, for 0-RTT, the first reply (more only means more receive memory).
    let mut slots: [Option<Bytes>; 2] = Default::default();
    // The clock is read again only after a wait: until then no time worth a retransmission
    // has passed (a clock read per step would be most of a step's cost).
    let mut now = Some(started);
    loop {
        if let Some(r) = hs.poll_outcome() {
            if let (Ok(out), Some(t)) = (&r, record) {
                t.accept = accepts
                    .into_iter()
                    .flatten()
                    .find(|m| crate::wire::Accept::decode(&m[1..]).as_ref() == Ok(&out.accept))
                    .unwrap_or_default();
            }
            return r;
        }
        let t = *now.get_or_insert_with(Instant::now);
        if let Some(m) = hs.poll_transmit_ref(t.into_std()) {
            if let Some(t) = record.as_deref_mut()
                && t.hello.is_empty()
            {
                t.hello = m.clone();
            }
            // At once if the socket takes it (no handle to share the hello, no future).
            match base.try_send_with_header(&[], m) {
                Some(r) => r?,
                None => {
                    let m = m.clone();
                    base.send_with_header(&[], [m]).await?;
                    now = None;
                }
            }
            continue;
        }
        let Some(deadline) = hs.poll_timeout() else {
            now = None;
            continue;
        };
        tokio::select! {
            // An answer that is there wins over a timer that also ran out.
            biased;
            r = base.recv(&mut slots) => {
                let n = r?;
                for s in slots[..n].iter_mut() {
                    if let Some(m) = s.take() {
                        if record.is_some()
                            && m.first() == Some(&(Tag::Accept as u8))
                            && m.get(2..10) == Some(&hs.conn_id().to_be_bytes()[..])
                            && let Some(free) = accepts.iter_mut().find(|a| a.is_none())
                        {
                            *free = Some(m.clone());
                        }
                        hs.handle_message(m);
                    }
                }
            }
            () = ticker.wait(deadline) => {
                hs.handle_timeout(Instant::now().into_std());
            }
        }
        now = None;
    }
}

/// The client side: negotiates stacks and remembers, per server, the last pick for 0-RTT.
#[derive(Debug, Default)]
pub struct Client {
    cfg: Config,
    infos: InfoCache,
    cache: Mutex<HashMap<String, Remembered, BuildHasherDefault<NameHasher>>>,
    ticker: Arc<Ticker>,
}

/// What a client remembers of a server.
#[derive(Debug)]
struct Remembered {
    /// The last pick of the client's stack.
    pick: Pick,
    /// The server's last accept, recognised without decoding when it comes again.
    known: KnownAccept,
    /// The last 0-RTT hello, reused while the stack's offers and the pick are unchanged.
    hello: Option<Arc<HelloTemplate>>,
}

/// What a client recalls of a server for a connection.
struct Recalled {
    pick: Pick,
    known: KnownAccept,
    hello: Option<Arc<HelloTemplate>>,
}

impl Client {
    /// A client with `cfg`.
    pub fn new(cfg: Config) -> Self {
        Client {
            cfg,
            infos: InfoCache::default(),
            cache: Mutex::new(HashMap::default()),
            ticker: Arc::default(),
        }
    }

    /// The pick remembered for `server`, if any.
    pub fn remembered(&self, server: &str) -> Option<Pick> {
        self.recall(server).map(|r| r.pick)
    }

    fn recall(&self, server: &str) -> Option<Recalled> {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(server)
            .map(|r| Recalled {
                pick: r.pick.clone(),
                known: r.known.clone(),
                hello: r.hello.clone(),
            })
    }

    /// Forgets every remembered pick.
    pub fn forget_all(&self) {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Remembers `server`'s answer; `hello`, a 0-RTT hello template, replaces the one kept
    /// (a template for another pick is dropped, one for the same pick kept otherwise).
    fn remember(
        &self,
        server: &str,
        pick: &Pick,
        known: KnownAccept,
        hello: Option<Arc<HelloTemplate>>,
    ) {
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = c.get_mut(server) {
            // The usual reconnect: no key to allocate.
            r.pick = pick.clone();
            r.known = known;
            if hello.is_some() || r.hello.as_ref().is_some_and(|t| t.pick != *pick) {
                r.hello = hello;
            }
            return;
        }
        if c.len() >= self.cfg.cache_entries.max(1) && !c.contains_key(server) {
            // Bounded: evict an arbitrary entry.
            if let Some(k) = c.keys().next().cloned() {
                c.remove(&k);
            }
        }
        c.insert(
            server.to_owned(),
            Remembered {
                pick: pick.clone(),
                known,
                hello,
            },
        );
    }

    /// 1-RTT: offers `stack`'s options over `base` (connected to the server named `server`,
    /// the key under which the pick is remembered), waits for the pick, builds that stack.
    ///
    /// The returned future is `Send` (spawnable) whenever the stack is.
    pub fn connect<'a, S, C>(
        &'a self,
        server: &'a str,
        stack: S,
        base: C,
    ) -> impl Future<Output = Result<Negotiated<S::Connection>, Error>> + Send + 'a
    where
        C: SendHeader + PeerHandoff + 'static,
        S: Chunnel<Tagged<C>> + Offers + Send + 'a,
    {
        crate::obs::negotiation(
            crate::obs::Side::Client,
            "1rtt",
            zero_rtt_of::<S::Connection>,
            self.connect_inner(server, stack, base),
        )
    }

    async fn connect_inner<S, C>(
        &self,
        server: &str,
        mut stack: S,
        base: C,
    ) -> Result<Negotiated<S::Connection>, Error>
    where
        C: SendHeader + PeerHandoff + 'static,
        S: Chunnel<Tagged<C>> + Offers + Send,
    {
        let offers = stack.offer_tree();
        if offers.count() == 0 {
            return Err(Error::NoOptions(stack.available().err().unwrap_or(
                chunnel::Error::BadPick {
                    what: "the stack offers no option",
                },
            )));
        }
        let started = Instant::now();
        let mut hs = ClientHandshake::new(
            offers,
            None,
            new_conn_id(),
            self.cfg.timing,
            started.into_std(),
        )?;
        if let Some(r) = self.recall(server) {
            hs.expect(r.known);
        }
        let mut transcript = Transcript::default();
        let out = drive(&base, &mut hs, &self.ticker, started, Some(&mut transcript)).await?;
        apply_known(&mut stack, &out.accept.client_pick)?;
        let tagged = Tagged::client(base, out.accept.conn_id);
        tagged.push_pending(out.early_replies);
        let control = control(&tagged);
        let conn = stack.connect_wrap(tagged).await?;
        self.remember(server, &out.accept.client_pick, out.known, None);
        Ok(
            Negotiated::new(conn, self.infos.get(out.accept, out.hellos_sent), control)
                .with_transcript(transcript),
        )
    }

    /// 0-RTT: if a pick for `server` is remembered, builds that stack at once, sends `early`
    /// through it inside the hello (the first flight), and returns when the server answers:
    /// either it accepted (the early messages were delivered once) or it picked another
    /// stack (nothing was delivered; they are re-sent on the new stack). Without a remembered
    /// pick this is [`Client::connect`] followed by sending `early`.
    pub fn connect_0rtt<'a, S, C, I>(
        &'a self,
        server: &'a str,
        stack: S,
        base: C,
        early: I,
    ) -> impl Future<Output = Result<Negotiated<S::Connection>, Error>> + Send + 'a
    where
        C: SendHeader + PeerHandoff + 'static,
        S: Chunnel<Tagged<C>> + Offers + Clone + Send + 'a,
        I: IntoIterator<Item = <S::Connection as ChunnelConnection>::Data>,
        <S::Connection as ChunnelConnection>::Data: Clone,
    {
        let early: Vec<_> = early.into_iter().collect();
        crate::obs::negotiation(
            crate::obs::Side::Client,
            "0rtt",
            zero_rtt_of::<S::Connection>,
            self.connect_0rtt_inner(server, stack, base, early),
        )
    }

    async fn connect_0rtt_inner<S, C>(
        &self,
        server: &str,
        stack: S,
        base: C,
        early: Vec<<S::Connection as ChunnelConnection>::Data>,
    ) -> Result<Negotiated<S::Connection>, Error>
    where
        C: SendHeader + PeerHandoff + 'static,
        S: Chunnel<Tagged<C>> + Offers + Clone + Send,
        <S::Connection as ChunnelConnection>::Data: Clone,
    {
        // A reconnect with unchanged offers reuses the last hello (no offer list is built);
        // otherwise the offers are made and the remembered pick checked against them.
        let digest = chunnel::negotiate::offers_digest(&stack);
        let recalled = self.recall(server);
        let template = recalled.as_ref().and_then(|r| {
            r.hello
                .clone()
                .filter(|t| t.digest == digest && t.pick == r.pick)
        });
        let offers = match template {
            Some(_) => None,
            None => Some(stack.offer_tree()),
        };
        let mut first = stack.clone();
        let Some(Recalled { pick, known, .. }) = recalled.filter(|r| {
            offers.as_ref().is_none_or(|o| o.option(&r.pick).is_some())
                && apply_known(&mut first, &r.pick).is_ok()
        }) else {
            // Boxed, as the rejected case below: inline, this 1-RTT handshake doubled the
            // size of every 0-RTT connect's future (which is moved as it is returned and
            // awaited).
            return Box::pin(async move {
                let conn = self.connect_inner(server, stack, base).await?;
                conn.send(early).await?;
                Ok(conn)
            })
            .await;
        };
        let conn_id = new_conn_id();
        let tagged = Tagged::client(base, conn_id);
        tagged.start_capture();
        let conn = first.connect_wrap(tagged.clone()).await?;
        // Kept for a rejection (sent again on the stack the server picks): a lone message is
        // copied without a vector of its own.
        let sent = match &early[..] {
            [one] => conn.send([one.clone()]).await,
            _ => conn.send(early.clone()).await,
        };
        let captured = tagged.take_capture();
        sent?;
        let started = Instant::now();
        let now = started.into_std();
        let mut hs = match (&template, offers) {
            (Some(t), _) => {
                ClientHandshake::from_template(t, &captured, conn_id, self.cfg.timing, now)?
            }
            (None, offers) => ClientHandshake::new(
                offers.unwrap_or_else(OfferTree::empty),
                Some((pick.clone(), captured)),
                conn_id,
                self.cfg.timing,
                now,
            )?,
        };
        hs.expect(known);
        let out = drive(tagged.get_ref(), &mut hs, &self.ticker, started, None).await?;
        tagged.push_pending(out.early_replies);
        // Nothing to remember when the server answered as last time to the same hello.
        if !(template.is_some() && out.recognised && out.accept.client_pick == pick) {
            let t = hs
                .template(digest)
                .filter(|t| t.pick == out.accept.client_pick)
                .map(Arc::new);
            self.remember(server, &out.accept.client_pick, out.known, t);
        }
        let hellos = out.hellos_sent;
        match out.accept.zero_rtt {
            // An accept must name the stack we built and sent the early data with.
            ZeroRtt::Accepted if out.accept.client_pick != pick => Err(Error::Wire(
                crate::wire::WireError("0-RTT accepted for a pick other than the one we sent"),
            )),
            ZeroRtt::Accepted => Ok(Negotiated::new(
                conn,
                self.infos.get(out.accept, hellos),
                control(&tagged),
            )),
            _ => {
                // Rejected: the server discarded the early data. Build the stack it picked
                // and send the messages again, once.
                drop(conn);
                let mut again = stack;
                apply_known(&mut again, &out.accept.client_pick)?;
                let control = control(&tagged);
                let conn = Box::pin(async move {
                    let conn = again.connect_wrap(tagged).await?;
                    conn.send(early).await?;
                    Ok::<_, Error>(conn)
                })
                .await?;
                Ok(Negotiated::new(
                    conn,
                    self.infos.get(out.accept, hellos),
                    control,
                ))
            }
        }
    }
}

/// The last decision's [`Info`], shared by the connections that get the same one (most of a
/// server's connections, a client's reconnects): a negotiated connection, which an
/// application's task holds for its whole life, keeps a pointer instead of the record.
#[derive(Debug, Default)]
struct InfoCache(Mutex<Option<Arc<Info>>>);

impl InfoCache {
    fn get(&self, a: crate::wire::Accept, hellos_sent: u32) -> Arc<Info> {
        let mut last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = last.as_ref()
            && i.hellos_sent == hellos_sent
            && i.zero_rtt == a.zero_rtt
            && i.client_pick == a.client_pick
            && i.server_pick == a.server_pick
            && (Arc::ptr_eq(&i.server_stack, &a.server_stack) || i.server_stack == a.server_stack)
        {
            return Arc::clone(i);
        }
        let i = Arc::new(info(a, hellos_sent));
        *last = Some(Arc::clone(&i));
        i
    }
}

fn info(a: crate::wire::Accept, hellos_sent: u32) -> Info {
    Info {
        client_pick: a.client_pick,
        server_pick: a.server_pick,
        server_stack: a.server_stack,
        zero_rtt: a.zero_rtt,
        hellos_sent,
    }
}

/// A byte-to-byte layer built at run time from the server's description of it.
pub type DynLayer = chunnel::BoxChunnel<chunnel::BoxConnection<Bytes>, Bytes>;

type Factory = Box<dyn Fn(&ChunnelInfo) -> Result<DynLayer, chunnel::Error> + Send + Sync>;

/// The Chunnel implementations a client can build when the server dictates the stack (the
/// HotNets paper's Listing 5: "the client specifies no Chunnels"). Each entry maps a Chunnel
/// id to a factory that builds the client's end from the server's [`ChunnelInfo`] (its
/// capabilities carry the configuration, e.g. the serialization format or shard set).
#[derive(Default)]
pub struct Registry {
    entries: Vec<(&'static str, Factory)>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|(id, _)| id))
            .finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Registry::default()
    }

    /// Registers a factory for the Chunnel with `id`.
    pub fn register<F>(mut self, id: &'static str, factory: F) -> Self
    where
        F: Fn(&ChunnelInfo) -> Result<DynLayer, chunnel::Error> + Send + Sync + 'static,
    {
        self.entries.push((id, Box::new(factory)));
        self
    }

    fn offer(&self) -> Vec<ChunnelInfo> {
        self.entries
            .iter()
            .map(|(id, _)| ChunnelInfo {
                id: std::borrow::Cow::Borrowed(id),
                capabilities: Vec::new(),
            })
            .collect()
    }

    fn build(&self, info: &ChunnelInfo) -> Result<DynLayer, Error> {
        let (_, f) = self
            .entries
            .iter()
            .find(|(id, _)| *id == info.id)
            .ok_or(Error::Wire(crate::wire::WireError(
                "the server picked a Chunnel we did not register",
            )))?;
        Ok(f(info)?)
    }
}

impl Client {
    /// Connects with no stack of its own: the server picks, among its options, the first
    /// whose two-sided Chunnels (those with an exact-match capability) are all in `registry`,
    /// and the client builds those, top to bottom as the server lists them. One-sided
    /// Chunnels of the server's stack run at the server only. The connection is type-erased
    /// (one boxed future per call per layer), as a stack chosen at run time must be.
    pub fn connect_dictated<'a, C>(
        &'a self,
        registry: &'a Registry,
        base: C,
    ) -> impl Future<Output = Result<Negotiated<chunnel::BoxConnection<Bytes>>, Error>> + Send + 'a
    where
        C: SendHeader + PeerHandoff + 'static,
    {
        self.connect_dictated_inner(registry, base)
    }

    async fn connect_dictated_inner<C>(
        &self,
        registry: &Registry,
        base: C,
    ) -> Result<Negotiated<chunnel::BoxConnection<Bytes>>, Error>
    where
        C: SendHeader + PeerHandoff + 'static,
    {
        let started = Instant::now();
        let mut hs = ClientHandshake::new_dictated(
            registry.offer(),
            new_conn_id(),
            self.cfg.timing,
            started.into_std(),
        )?;
        let out = drive(&base, &mut hs, &self.ticker, started, None).await?;
        let tagged = Tagged::client(base, out.accept.conn_id);
        tagged.push_pending(out.early_replies);
        let control = control(&tagged);
        let mut conn = chunnel::BoxConnection::new(tagged);
        for info in out
            .accept
            .server_stack
            .iter()
            .rev()
            .filter(|c| crate::proto::two_sided(c))
        {
            conn = registry.build(info)?.connect_wrap(conn).await?;
        }
        Ok(Negotiated::new(
            conn,
            self.infos.get(out.accept, out.hellos_sent),
            control,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Accept;

    fn accept(client: &[u8], conn_id: u64, zero_rtt: ZeroRtt) -> Accept {
        Accept {
            version: crate::wire::VERSION,
            conn_id,
            zero_rtt,
            client_pick: Pick::from_slice(client),
            server_pick: Pick::from_slice(&[0]),
            server_stack: Arc::from(Vec::new()),
        }
    }

    #[test]
    fn connections_with_the_same_decision_share_its_info() {
        let c = InfoCache::default();
        let a = c.get(accept(&[0], 1, ZeroRtt::Accepted), 0);
        // Another connection id, the same decision: shared.
        let b = c.get(accept(&[0], 2, ZeroRtt::Accepted), 0);
        assert!(Arc::ptr_eq(&a, &b));
        // Any field that differs makes a record of its own, with that field.
        let other = c.get(accept(&[1], 3, ZeroRtt::Accepted), 0);
        assert_eq!(other.client_pick, Pick::from_slice(&[1]));
        let rejected = c.get(accept(&[1], 4, ZeroRtt::Rejected), 0);
        assert_eq!(rejected.zero_rtt, ZeroRtt::Rejected);
        let resent = c.get(accept(&[1], 5, ZeroRtt::Rejected), 2);
        assert_eq!(resent.hellos_sent, 2);
        assert!(!Arc::ptr_eq(&other, &rejected) && !Arc::ptr_eq(&rejected, &resent));
        assert_eq!(*a, info(accept(&[0], 9, ZeroRtt::Accepted), 0));
    }
}
