//! Ordering as a negotiated choice (paper §7.2): the broker orders (service-side) or each
//! receiver does (receiver-side), switched live by a group through a rendezvous store.
//!
//! # The two modes
//!
//! An ordered topic has *lanes*: topics on the broker ([`Broker::service_lane`],
//! [`Broker::spread_lanes`]).
//!
//! | mode | Kafka | NATS JetStream | Redis Streams |
//! |------|-------|----------------|---------------|
//! | [`Mode::Service`]: one lane, the broker keeps it in order | topic `{t}-s`, 1 partition | stream `{t}-s` (one subject), read by one pull consumer per receiver | stream `{t}-s` |
//! | [`Mode::Receiver`]: `lanes` independent lanes, reordered by each receiver | topic `{t}-r`, `lanes` partitions (a burst per partition, round-robin) | streams `{t}-r0`..: one subject each (a burst per stream, round-robin) | streams `{t}-r0`..  (a burst per stream, round-robin) |
//!
//! Every ordered message carries a 20-byte header in front of its payload (`docs/wire.md`
//! §18): the magic `cho1`, the publisher (a random 64-bit id per connection) and its
//! sequence number, 0, 1, 2... **continuing across modes**. Each receiver is its own
//! subscription (it gets every message) and reads **every lane of both modes**; its
//! [`Reorder`] core hands each publisher's messages to the application in sequence order,
//! exactly once (duplicates from redeliveries and retries dropped), holding early arrivals in a
//! bounded buffer ([`OrderConfig::capacity`]; past it, [`Error::ReorderOverflow`], never a
//! skipped message). In service mode everything arrives in order (the buffer stays empty); in
//! receiver mode the lanes interleave and the buffer absorbs it.
//!
//! # The switch
//!
//! A group ([`join`], feature `group`) of publishers and receivers agrees on the mode through
//! chunnel-rendezvous: the options are a select of two [`OrderOffer`]s (id
//! `chunnel/pubsub-order/1`, exact capabilities `pubsub-ordering` {`service`, `receiver`} and
//! `pubsub-lanes` {n}, so members with different lane counts are incompatible), switched by
//! the rendezvous' two-phase commit ([`OrderGroup::adapt`] proposes what a policy wants for
//! the number of receivers; [`by_receivers`]: service-side ordering for one receiver,
//! receiver-side for several). A publisher takes the mode at each burst: a burst goes whole to
//! one lane of the mode current when it starts. Because sequence numbers continue across
//! modes and receivers read both modes' lanes, a receiver merges the old mode's last messages
//! with the new mode's first ones in order, however late the old ones come: no barrier is
//! needed, no publisher waits for a drain, and members may switch at different moments.
//!
//! A publisher's burst that failed or was cancelled is kept and published again, with the
//! same sequence numbers, in front of its next burst (the receivers drop the copies), so a
//! failure never leaves a gap the receivers would wait for forever. The application does not
//! send it again: a failed `send` has taken its burst (except with [`Error::Backlog`], when
//! more than [`OrderConfig::max_pending`] messages would be kept).
//!
//! # Example
//!
//! A publisher fixed in receiver-side ordering over two Redis streams, and a receiver (feature
//! `redis`; the hidden lines start a redis-server on a free port). The tests
//! (`tests/support/order.rs`) run a whole group switching on all three brokers.
//!
//! ```
//! # #[cfg(feature = "redis")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel::Error> {
//! # let scratch = chunnel_test::services::Scratch::new("order-doc");
//! # let (_server, url) = chunnel_test::brokers::redis(&scratch);
//! use bytes::Bytes;
//! use chunnel::{Chunnel, ChunnelConnection, ConnectionExt};
//! use chunnel_pubsub::order::{Mode, OrderConfig, OrderedPublish, OrderedSubscribe};
//! use chunnel_pubsub::{Config, redis::RedisBroker};
//!
//! let broker = RedisBroker::new(&url)?;
//! let order = OrderConfig { lanes: 2, ..OrderConfig::default() };
//! let receiver = OrderedSubscribe::new(broker.clone(), "log", "r1", Config::default(), order.clone())
//!     .connect_wrap(())
//!     .await?;
//! let publisher = OrderedPublish::new(broker, "log", Config::default(), order)
//!     .fixed(Mode::Receiver)
//!     .connect_wrap(())
//!     .await?;
//! for i in 0..10u8 {
//!     publisher.send([Bytes::from(vec![i])]).await?; // bursts alternate between the lanes
//! }
//! for i in 0..10u8 {
//!     assert_eq!(receiver.recv_one().await?, Bytes::from(vec![i]));
//! }
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "redis"))]
//! # fn main() {}
//! ```
//!
//! # Limits
//!
//! * A receiver connection reads every lane from its start (a fresh consumer group per
//!   connection), so it gets every message the lanes hold, from each publisher's first. The
//!   pump tasks acknowledge a message once it is in the connection's bounded queue: a receiver
//!   that crashes loses nothing at the broker for its successor, which starts over anyway.
//! * Ordering is per publisher connection; there is no order between publishers.
//! * The reorder buffer must cover the skew between lanes. Lanes are read at about the same
//!   pace (one pump per lane into one queue), so in a steady stream few messages wait; but a
//!   receiver far behind at a switch (a backlog on the old mode's lanes while the new mode's
//!   fill) can see as many early messages as that backlog. Past [`OrderConfig::capacity`] the
//!   connection fails with [`Error::ReorderOverflow`]: it never skips a message, and never
//!   holds more than the bound (`tests/support/order.rs`, `slow_receiver_across_switch`: a
//!   receiver that did not read across a switch overflows a buffer of 8; with 1,024 it gets
//!   everything). Its pumps then wait on the full queue: the broker keeps the rest.
//! * A publisher whose broker stays down past `op_timeout` returns the error; its next send
//!   first re-publishes the failed burst (at most [`OrderConfig::max_pending`] messages are
//!   kept). A broker killed and restarted during a switch loses none of them
//!   (`tests/support/order.rs`, `restart_during_switch`).
// The group items (`join`, `OrderGroup`, `by_receivers`) exist with the `group` feature only;
// without it these docs name them without a link target.
#![cfg_attr(not(feature = "group"), allow(rustdoc::broken_intra_doc_links))]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::time::Duration;

use bytes::Bytes;
use chunnel::{Capability, Chunnel, ChunnelConnection, Negotiate};
use tokio::sync::mpsc;

use crate::broker::{Broker, Consumer, Lane, Member, Producer};
use crate::conn::{Config, Publish, Publisher, Subscribe, Subscriber};
use crate::{Error, id::random_u64};

#[cfg(feature = "group")]
mod group;
pub mod reorder;

#[cfg(feature = "group")]
pub use group::{OrderGroup, Role, by_receivers, join};
pub use reorder::{Pushed, Reorder, ReorderStats};

/// The negotiation id of the ordering choice.
pub const ID: &str = "chunnel/pubsub-order/1";

/// Where an ordered topic's messages are put in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// One lane: the broker orders (one partition, one stream).
    Service,
    /// Several lanes: each receiver reorders by sequence number.
    Receiver,
}

impl Mode {
    /// The label of the `pubsub-ordering` capability: `service` or `receiver`.
    pub fn label(self) -> &'static str {
        match self {
            Mode::Service => "service",
            Mode::Receiver => "receiver",
        }
    }

    /// The other mode.
    pub fn other(self) -> Mode {
        match self {
            Mode::Service => Mode::Receiver,
            Mode::Receiver => Mode::Service,
        }
    }
}

/// One ordering mode as a negotiation option: id [`ID`], exact capabilities `pubsub-ordering`
/// ([`Mode::label`]) and `pubsub-lanes` (the lane count). A group's stack options are
/// `select(OrderOffer { mode: a, .. }, OrderOffer { mode: b, .. })`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OrderOffer {
    /// The mode.
    pub mode: Mode,
    /// Lanes of receiver-side ordering (every member must use the same).
    pub lanes: u32,
}

impl Negotiate for OrderOffer {
    fn id(&self) -> &'static str {
        ID
    }
    fn capabilities(&self) -> Vec<Capability> {
        vec![
            Capability::exact("pubsub-ordering", [self.mode.label()]),
            Capability::exact("pubsub-lanes", [self.lanes.to_string()]),
        ]
    }
}

/// Settings of ordered publishers and receivers.
#[derive(Clone, Debug)]
pub struct OrderConfig {
    /// Lanes of receiver-side ordering. Default 4.
    pub lanes: u32,
    /// Receivers: at most this many messages wait behind gaps. Default 4,096.
    pub capacity: usize,
    /// Receivers: at most this many publisher connections are told apart (16 bytes each).
    /// Default 65,536.
    pub max_publishers: usize,
    /// Publishers: at most this many messages of failed or cancelled sends are kept to be
    /// published again, plus one burst (a burst that would go past it while the kept ones
    /// still fail is refused: [`Error::Backlog`]). Default 4,096.
    pub max_pending: usize,
}

impl Default for OrderConfig {
    fn default() -> Self {
        OrderConfig {
            lanes: 4,
            capacity: 4096,
            max_publishers: 1 << 16,
            max_pending: 4096,
        }
    }
}

/// Where a publisher takes its mode from.
#[derive(Clone, Debug)]
enum ModeSource {
    Fixed(Mode),
    #[cfg(feature = "group")]
    Group(Arc<OrderGroup>),
}

impl ModeSource {
    fn current(&self) -> Mode {
        match self {
            ModeSource::Fixed(m) => *m,
            #[cfg(feature = "group")]
            ModeSource::Group(g) => g.mode(),
        }
    }
}

fn lanes_of<B: Broker>(
    broker: &B,
    topic: &str,
    lanes: u32,
    modes: &[Mode],
) -> Result<Vec<(Mode, Lane<B>)>, Error> {
    if lanes == 0 {
        return Err(Error::Config {
            what: "0 lanes".into(),
        });
    }
    let mut out = Vec::new();
    for m in modes {
        match m {
            Mode::Service => out.push((*m, broker.service_lane(topic)?)),
            Mode::Receiver => out.extend(
                broker
                    .spread_lanes(topic, lanes)?
                    .into_iter()
                    .map(|l| (*m, l)),
            ),
        }
    }
    Ok(out)
}

/// Publishes ordered messages to a topic's lanes: `connect_wrap(())` gives an
/// [`OrderedPublisher`] (`Data = Bytes`).
#[derive(Clone, Debug)]
pub struct OrderedPublish<B> {
    broker: B,
    topic: String,
    config: Config,
    order: OrderConfig,
    mode: ModeSource,
}

impl<B: Broker> OrderedPublish<B> {
    /// Publishes to `topic`'s lanes, in service mode until told otherwise.
    pub fn new(broker: B, topic: impl Into<String>, config: Config, order: OrderConfig) -> Self {
        OrderedPublish {
            broker,
            topic: topic.into(),
            config,
            order,
            mode: ModeSource::Fixed(Mode::Service),
        }
    }

    /// Always in `mode`.
    pub fn fixed(mut self, mode: Mode) -> Self {
        self.mode = ModeSource::Fixed(mode);
        self
    }

    /// In the mode `group` has agreed on, switching when it switches.
    #[cfg(feature = "group")]
    pub fn group(mut self, group: Arc<OrderGroup>) -> Self {
        self.mode = ModeSource::Group(group);
        self
    }
}

impl<B: Broker> Chunnel<()> for OrderedPublish<B> {
    type Connection = OrderedPublisher<B::Producer>;

    async fn connect_wrap(&mut self, _: ()) -> Result<Self::Connection, chunnel::Error> {
        let lanes = lanes_of(
            &self.broker,
            &self.topic,
            self.order.lanes,
            &[Mode::Service, Mode::Receiver],
        )?;
        let mut service = None;
        let mut spread = Vec::new();
        for (mode, lane) in lanes {
            let p = Publish::new(lane.broker, lane.topic, self.config.clone())
                .connect_wrap(())
                .await?;
            match mode {
                Mode::Service => service = Some(p),
                Mode::Receiver => spread.push(p),
            }
        }
        let service = service.ok_or(Error::Config {
            what: "no service lane".into(),
        })?;
        Ok(OrderedPublisher {
            service,
            spread,
            mode: self.mode.clone(),
            id: random_u64(),
            max_pending: self.order.max_pending,
            state: tokio::sync::Mutex::new(PubState::default()),
        })
    }
}

/// What an [`OrderedPublisher`] did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PubStats {
    /// Messages published in service mode.
    pub service: u64,
    /// Messages published in receiver mode.
    pub receiver: u64,
    /// Bursts whose mode differed from the previous burst's.
    pub switches: u64,
    /// Publications of kept messages (of sends that failed or were cancelled) again.
    pub resent: u64,
}

#[derive(Debug, Default)]
struct PubState {
    next: u64,
    /// Messages (framed, in sequence order) of sends that failed or were cancelled, not known
    /// to be stored: published again, in front of the next burst. At most `max_pending`.
    pending: Vec<Bytes>,
    rr: usize,
    last: Option<Mode>,
    stats: PubStats,
}

/// An ordered publisher: numbers its messages and publishes each burst to one lane of the
/// current mode (round-robin over the lanes in receiver mode). Bursts are published one at a
/// time (concurrent senders queue); `send` returns once the broker stored the burst.
///
/// A `send` that fails (the broker stayed down past [`Config::op_timeout`]) or is cancelled
/// has still *taken* its burst: the messages keep their sequence numbers and are published
/// again, in front of the next burst, by the next `send` (an empty burst only does that), in
/// the mode current then. The application must not send them again (the receivers would get
/// them twice, under new numbers). The one exception is [`Error::Backlog`]: more than
/// [`OrderConfig::max_pending`] messages would be kept, so the burst was refused, not taken.
#[derive(Debug)]
pub struct OrderedPublisher<P> {
    service: Publisher<P>,
    spread: Vec<Publisher<P>>,
    mode: ModeSource,
    id: u64,
    max_pending: usize,
    state: tokio::sync::Mutex<PubState>,
}

impl<P: Producer> OrderedPublisher<P> {
    /// What it did so far.
    pub async fn stats(&self) -> PubStats {
        self.state.lock().await.stats
    }

    /// Its publisher id (in every message's header).
    pub fn id(&self) -> u64 {
        self.id
    }

    async fn publish_on(
        &self,
        st: &mut PubState,
        mode: Mode,
        burst: Vec<Bytes>,
    ) -> Result<(), chunnel::Error> {
        let n = burst.len() as u64;
        let lane = match mode {
            Mode::Service => &self.service,
            Mode::Receiver => {
                let l = &self.spread[st.rr % self.spread.len()];
                st.rr = st.rr.wrapping_add(1);
                l
            }
        };
        lane.send(burst).await?;
        match mode {
            Mode::Service => st.stats.service += n,
            Mode::Receiver => st.stats.receiver += n,
        }
        Ok(())
    }
}

impl<P: Producer> ChunnelConnection for OrderedPublisher<P> {
    type Data = Bytes;

    async fn send<I>(&self, burst: I) -> Result<(), chunnel::Error>
    where
        I: IntoIterator<Item = Bytes> + Send,
        I::IntoIter: Send,
    {
        let mut st = self.state.lock().await;
        let mode = self.mode.current();
        if st.last.is_some_and(|m| m != mode) {
            st.stats.switches += 1;
        }
        st.last = Some(mode);
        let burst = burst.into_iter();
        let room = self.max_pending.saturating_sub(st.pending.len());
        if !st.pending.is_empty() && burst.size_hint().0 > room {
            // Too much kept already: publish it alone first; if that fails, refuse the burst.
            let again = st.pending.clone();
            if let Err(e) = self.publish_on(&mut st, mode, again).await {
                return Err(Error::Backlog {
                    pending: st.pending.len(),
                    last: e.to_string(),
                }
                .into());
            }
            st.pending.clear();
            st.stats.resent += 1;
        }
        let resending = !st.pending.is_empty();
        let mut framed = std::mem::take(&mut st.pending);
        for m in burst {
            framed.push(reorder::encode(self.id, st.next, &m));
            st.next += 1;
        }
        if framed.is_empty() {
            return Ok(());
        }
        // Kept (with their numbers) until the broker stored them, also if this is cancelled.
        st.pending = framed.clone();
        self.publish_on(&mut st, mode, framed).await?;
        st.pending.clear();
        if resending {
            st.stats.resent += 1;
        }
        Ok(())
    }

    async fn recv<'a>(&'a self, _slots: &'a mut [Option<Bytes>]) -> Result<usize, chunnel::Error> {
        Err(chunnel::Error::Closed)
    }
}

/// Receives an ordered topic: `connect_wrap(())` gives an [`OrderedSubscriber`]
/// (`Data = Bytes`, each publisher's payloads in order, exactly once).
#[derive(Clone, Debug)]
pub struct OrderedSubscribe<B> {
    broker: B,
    topic: String,
    name: String,
    config: Config,
    order: OrderConfig,
    modes: Vec<Mode>,
}

impl<B: Broker> OrderedSubscribe<B> {
    /// Receives `topic` as the receiver `name` (1 to 180 letters, digits, `-`, `_`), reading
    /// the lanes of both modes.
    pub fn new(
        broker: B,
        topic: impl Into<String>,
        name: impl Into<String>,
        config: Config,
        order: OrderConfig,
    ) -> Self {
        OrderedSubscribe {
            broker,
            topic: topic.into(),
            name: name.into(),
            config,
            order,
            modes: vec![Mode::Service, Mode::Receiver],
        }
    }

    /// Reads only the lanes of `mode` (for publishers fixed in that mode: no idle lanes).
    pub fn only(mut self, mode: Mode) -> Self {
        self.modes = vec![mode];
        self
    }
}

type Item = Result<(u64, u64, Bytes), chunnel::Error>;

impl<B: Broker> Chunnel<()> for OrderedSubscribe<B> {
    type Connection = OrderedSubscriber;

    async fn connect_wrap(&mut self, _: ()) -> Result<Self::Connection, chunnel::Error> {
        if self.name.len() > 180 {
            return Err(Error::Config {
                what: format!("receiver name of {} bytes", self.name.len()),
            }
            .into());
        }
        let lanes = lanes_of(&self.broker, &self.topic, self.order.lanes, &self.modes)?;
        // A fresh group per connection: it reads every lane from its start.
        let group = format!("{}-{:016x}", self.name, random_u64());
        let (tx, rx) = mpsc::channel(self.config.prefetch.max(1));
        let malformed = Arc::new(AtomicU64::new(0));
        let mut pumps = tokio::task::JoinSet::new();
        for (_, lane) in lanes {
            let sub = Subscribe::new(
                lane.broker,
                lane.topic,
                Member::sole(group.clone()),
                self.config.clone(),
            )
            .connect_wrap(())
            .await?;
            pumps.spawn(pump(
                sub,
                tx.clone(),
                malformed.clone(),
                self.config.prefetch,
            ));
        }
        Ok(OrderedSubscriber {
            core: tokio::sync::Mutex::new(SubCore {
                rx,
                reorder: Reorder::new(self.order.capacity, self.order.max_publishers),
                failed: false,
            }),
            _pumps: std::sync::Mutex::new(pumps),
            seen: std::sync::Mutex::new((ReorderStats::default(), 0)),
            malformed,
            capacity: self.order.capacity,
        })
    }
}

/// Moves one lane's messages into the connection's queue until the connection is dropped.
async fn pump<C: Consumer>(
    sub: Subscriber<C>,
    tx: mpsc::Sender<Item>,
    malformed: Arc<AtomicU64>,
    prefetch: usize,
) {
    let mut slots = vec![None; prefetch.clamp(1, 256)];
    loop {
        let got = tokio::select! {
            _ = tx.closed() => return,
            r = sub.recv(&mut slots) => r,
        };
        match got {
            Ok(n) => {
                for s in &mut slots[..n] {
                    let Some(m) = s.take() else { continue };
                    match reorder::decode(&m) {
                        Some(d) => {
                            if tx.send(Ok(d)).await.is_err() {
                                return;
                            }
                        }
                        None => {
                            malformed.fetch_add(1, AtomicOrdering::Relaxed);
                        }
                    }
                }
            }
            Err(e) => {
                if tx.send(Err(e)).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

struct SubCore {
    rx: mpsc::Receiver<Item>,
    reorder: Reorder,
    failed: bool,
}

/// What an [`OrderedSubscriber`] saw so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OrderStats {
    /// The reorder core's counters.
    pub reorder: ReorderStats,
    /// Messages waiting behind gaps now.
    pub waiting: usize,
    /// Messages without a valid ordering header, dropped.
    pub malformed: u64,
}

/// An ordered receiver: every lane's messages, each publisher's in sequence order, exactly
/// once. `recv` is cancel safe (a message taken from the queue is kept in the core);
/// `send` fails with [`chunnel::Error::Closed`].
pub struct OrderedSubscriber {
    core: tokio::sync::Mutex<SubCore>,
    _pumps: std::sync::Mutex<tokio::task::JoinSet<()>>,
    /// The core's counters and waiting count as of the last `recv` (read without waiting for
    /// a `recv` in progress).
    seen: std::sync::Mutex<(ReorderStats, usize)>,
    malformed: Arc<AtomicU64>,
    capacity: usize,
}

impl std::fmt::Debug for OrderedSubscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrderedSubscriber")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl OrderedSubscriber {
    /// What it saw, as of its last `recv` (does not wait for one in progress).
    pub fn stats(&self) -> OrderStats {
        let (reorder, waiting) = *self.seen.lock().unwrap_or_else(|e| e.into_inner());
        OrderStats {
            reorder,
            waiting,
            malformed: self.malformed.load(AtomicOrdering::Relaxed),
        }
    }

    fn take(core: &mut SubCore, item: Item) -> Result<(), chunnel::Error> {
        let (publisher, seq, payload) = item?;
        if core.reorder.push(publisher, seq, payload) == Pushed::Overflow {
            core.failed = true;
        }
        Ok(())
    }
}

impl ChunnelConnection for OrderedSubscriber {
    type Data = Bytes;

    async fn send<I>(&self, _burst: I) -> Result<(), chunnel::Error>
    where
        I: IntoIterator<Item = Bytes> + Send,
        I::IntoIter: Send,
    {
        Err(chunnel::Error::Closed)
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, chunnel::Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let mut core = self.core.lock().await;
        loop {
            let mut n = 0;
            while n < slots.len() {
                let Some(m) = core.reorder.pop() else { break };
                slots[n] = Some(m);
                n += 1;
            }
            if n > 0 {
                return Ok(n);
            }
            if core.failed {
                return Err(Error::ReorderOverflow {
                    capacity: self.capacity,
                }
                .into());
            }
            let item = core.rx.recv().await.ok_or(chunnel::Error::Closed)?;
            let taken = Self::take(&mut core, item).and_then(|()| {
                while core.reorder.ready() < slots.len() && !core.failed {
                    match core.rx.try_recv() {
                        Ok(item) => Self::take(&mut core, item)?,
                        Err(_) => break,
                    }
                }
                Ok(())
            });
            *self.seen.lock().unwrap_or_else(|e| e.into_inner()) =
                (core.reorder.stats(), core.reorder.waiting());
            taken?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compatible(a: &OrderOffer, b: &OrderOffer) -> bool {
        let (a, b) = (a.capabilities(), b.capabilities());
        a.len() == b.len() && a.iter().all(|c| b.iter().any(|d| c.compatible(d)))
    }

    #[test]
    fn offers_match_on_mode_and_lanes() {
        let s4 = OrderOffer {
            mode: Mode::Service,
            lanes: 4,
        };
        let r4 = OrderOffer {
            mode: Mode::Receiver,
            lanes: 4,
        };
        assert!(compatible(&s4, &s4) && compatible(&r4, &r4));
        assert!(!compatible(&s4, &r4));
        assert!(!compatible(&r4, &OrderOffer { lanes: 2, ..r4 }));
        assert_eq!(s4.id(), ID);
        assert_eq!(Mode::Service.other(), Mode::Receiver);
    }
}
