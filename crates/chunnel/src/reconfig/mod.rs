//! Unilateral runtime reconfiguration (paper §4 and §6.2): a [`Select`] whose connections can
//! be switched to the other branch while tasks keep sending and receiving on them.
//!
//! * [`Select::reconfigurable`] turns a select into a [`Reconfigurable`] Chunnel;
//!   [`Reconfigurable::handle`] gives the [`ReconfigHandle`] that reaches every live
//!   connection it (or any clone of it) built.
//! * Its connection is a [`ReconfigConnection`]: the current branch's connection behind a gate
//!   of the chosen [`Mechanism`] — [`Lock`] or [`LockFree`].
//! * [`Handover`] / [`Handoff`]: state transfer from the old implementation to the new one.
//!
//! # The switch
//!
//! `handle.reconfigure(to)` first *prepares* every connection: it builds the new branch with
//! the branch's `connect_wrap` over a clone of the connection's inner connection (so the inner
//! connection must be `Clone`, e.g. an `Arc`; put [`Shared`] below the select). If any build
//! fails, nothing changes and [`crate::Error::SwitchFailed`] is returned. Then it *commits*
//! each connection in turn:
//!
//! 1. close the send gate: new sends wait; sends in flight run to completion (a send is not
//!    cancel safe) while receivers keep reading — a send may wait for the peer to read, and
//!    the peer for this end to read; then close the receive gate: calls blocked in `recv` on
//!    the old implementation are woken, drop their pending receive (cancel safe by contract:
//!    nothing is lost, messages stay below) and wait too;
//! 2. wait until no call is inside the old implementation — the **switch point**;
//! 3. `old.export(&mut handoff)`, `new.import(&mut handoff)`; the messages the old one had
//!    buffered are appended to the connection's carry-over queue;
//! 4. install the new implementation, open the gate, wake the waiting calls, drop the old one.
//!
//! Waiting calls then run on the new implementation; `recv` delivers the carry-over queue
//! before anything the new implementation receives, so a lossless ordered stack stays
//! lossless and ordered across a switch (per receiving task). Preparing and committing are
//! separate steps ([`ReconfigHandle::prepare`], [`PreparedSwitch::commit`]) so a multilateral
//! protocol can agree with peers in between (or abort by dropping the prepared switch).
//!
//! Switching is unilateral: the two branches must be wire compatible (or the peers must be
//! switched together by a multilateral protocol).

mod cell;
mod gate;
mod handover;
mod sync;

use std::fmt;
use std::future::{Future, poll_fn};
use std::marker::PhantomData;
use std::pin::{Pin, pin};
use std::sync::{Arc, Weak};
use std::task::Poll;

use self::cell::{Core, SPLIT_NONE, SPLIT_RETIRED, SPLIT_RETIRING, SPLIT_WAITING, Ticket};
use self::gate::lock;
pub use self::gate::{Lock, LockFree, Mechanism};
pub use self::handover::{Handoff, Handover};
use self::sync::{Mutex, Ordering};
#[cfg(chunnel_loom)]
#[doc(hidden)]
pub use self::sync::{PlantedBug, plant_bug};
use crate::negotiate::{Offers, PickReader, StackOption};
use crate::{Chunnel, ChunnelConnection, Either, Error, Select, Side};

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

// ---------------------------------------------------------------------------------------------
// The Chunnel

/// A [`Select`] whose connections can be switched between its branches at run time; built by
/// [`Select::reconfigurable`]. `M` is the mechanism: [`LockFree`] (default) or [`Lock`].
///
/// It negotiates exactly like the select it wraps ([`Offers`]). A connection starts on the
/// branch the select would build — or, once the handle has switched, on the handle's branch.
/// Clones share one handle: a switch reaches the connections of every clone.
///
/// ```
/// use chunnel::{select, Chunnel, ConnectionExt, LockFree, Noop, Shared, Side, stack};
/// # use chunnel::{ChunnelConnection, Error, Handover};
/// # #[derive(Default)]
/// # struct Echo(std::sync::Mutex<Vec<u32>>);
/// # impl ChunnelConnection for Echo {
/// #     type Data = u32;
/// #     async fn send<B>(&self, burst: B) -> Result<(), Error>
/// #     where B: IntoIterator<Item = u32> + Send, B::IntoIter: Send {
/// #         self.0.lock().unwrap().extend(burst); Ok(())
/// #     }
/// #     async fn recv<'a>(&'a self, slots: &'a mut [Option<u32>]) -> Result<usize, Error> {
/// #         let mut q = self.0.lock().unwrap();
/// #         let n = q.len().min(slots.len());
/// #         for (s, m) in slots.iter_mut().zip(q.drain(..n)) { *s = Some(m); }
/// #         Ok(n)
/// #     }
/// # }
/// # impl Handover for Echo {
/// #     fn export(&self, _: &mut chunnel::Handoff<u32>) {}
/// #     fn import(&self, _: &mut chunnel::Handoff<u32>) {}
/// # }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Error> {
/// // Two wire-compatible implementations of one layer (here: two `Noop`s).
/// let sel = select(Noop, Noop).reconfigurable::<LockFree>();
/// let handle = sel.handle();
/// // `Shared` puts the base connection in an `Arc` so both branches can be built over it.
/// let conn = stack![sel, Shared].connect_wrap(Echo::default()).await?;
/// assert_eq!(conn.side(), Side::Left);
///
/// assert_eq!(handle.reconfigure(Side::Right).await?, 1); // one live connection switched
/// assert_eq!(conn.side(), Side::Right);
/// conn.send_one(7).await?;
/// assert_eq!(conn.recv_one().await?, 7);
/// # Ok(()) }
/// ```
pub struct Reconfigurable<A, B, M = LockFree> {
    select: Select<A, B>,
    registry: Arc<Registry>,
    _mechanism: PhantomData<fn() -> M>,
}

impl<A: Clone, B: Clone, M> Clone for Reconfigurable<A, B, M> {
    fn clone(&self) -> Self {
        Reconfigurable {
            select: self.select.clone(),
            registry: self.registry.clone(),
            _mechanism: PhantomData,
        }
    }
}

impl<A: fmt::Debug, B: fmt::Debug, M: Mechanism> fmt::Debug for Reconfigurable<A, B, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reconfigurable")
            .field("select", &self.select)
            .field("mechanism", &M::NAME)
            .finish_non_exhaustive()
    }
}

impl<A, B> Select<A, B> {
    /// Makes this select reconfigurable at run time with mechanism `M` ([`LockFree`] or
    /// [`Lock`]); see [`Reconfigurable`].
    pub fn reconfigurable<M: Mechanism>(self) -> Reconfigurable<A, B, M> {
        Reconfigurable {
            select: self,
            registry: Arc::default(),
            _mechanism: PhantomData,
        }
    }
}

impl<A, B, M> Reconfigurable<A, B, M> {
    /// The handle that switches every connection built by this Chunnel and its clones.
    pub fn handle(&self) -> ReconfigHandle {
        ReconfigHandle {
            registry: self.registry.clone(),
        }
    }

    /// The wrapped select.
    pub fn get_ref(&self) -> &Select<A, B> {
        &self.select
    }

    /// The wrapped select, mutably (to fix a branch with [`Select::prefer`]-like changes).
    pub fn get_mut(&mut self) -> &mut Select<A, B> {
        &mut self.select
    }
}

impl<I, A, B, M> Chunnel<I> for Reconfigurable<A, B, M>
where
    I: Clone + Send + Sync + 'static,
    A: Chunnel<I> + Offers + Clone + Send + Sync + 'static,
    B: Chunnel<I> + Offers + Clone + Send + Sync + 'static,
    A::Connection: Handover + 'static,
    B::Connection: Handover<Data = <A::Connection as ChunnelConnection>::Data> + 'static,
    <A::Connection as ChunnelConnection>::Data: 'static,
    M: Mechanism,
{
    type Connection = ReconfigConnection<A::Connection, B::Connection, M>;

    async fn connect_wrap(&mut self, inner: I) -> Result<Self::Connection, Error> {
        let side = match self.registry.target() {
            Some(s) => s,
            None => self.select.resolve()?,
        };
        let builder = Box::new(Builder {
            left: self.select.left.clone(),
            right: self.select.right.clone(),
            inner: inner.clone(),
        });
        let conn = match side {
            Side::Left => Either::Left(self.select.left.connect_wrap(inner).await?),
            Side::Right => Either::Right(self.select.right.connect_wrap(inner).await?),
        };
        let core = Arc::new(Core::<_, _, M>::new(conn, builder));
        let dynamic: Arc<dyn Switch> = core.clone();
        // A switch committed while we were building did not see this connection: follow it.
        if let Some(target) = self.registry.register(&dynamic)
            && target != side
        {
            core.switch_to(target).await?;
        }
        Ok(ReconfigConnection { core })
    }
}

impl<A: Offers, B: Offers, M> Offers for Reconfigurable<A, B, M> {
    fn hash_offers(&self, h: &mut dyn std::hash::Hasher) {
        self.select.hash_offers(h);
    }

    fn offer_tree(&self) -> crate::OfferTree {
        self.select.offer_tree()
    }

    fn offers(&self) -> Vec<StackOption> {
        self.select.offers()
    }

    fn available(&self) -> Result<(), Error> {
        self.select.available()
    }

    fn apply_pick(&mut self, pick: &mut PickReader<'_>) -> Result<(), Error> {
        self.select.apply_pick(pick)
    }
}

/// A layer that puts the connection below it in an [`Arc`], so that it can be shared (by the
/// two branches of a [`Reconfigurable`] select, which need a `Clone` inner connection). Like
/// [`crate::Identity`] it is no layer for negotiation.
#[derive(Clone, Copy, Debug, Default)]
pub struct Shared;

impl<C: ChunnelConnection + Send> Chunnel<C> for Shared {
    type Connection = Arc<C>;

    async fn connect_wrap(&mut self, inner: C) -> Result<Arc<C>, Error> {
        Ok(Arc::new(inner))
    }
}

impl Offers for Shared {
    fn hash_offers(&self, h: &mut dyn std::hash::Hasher) {
        crate::Identity.hash_offers(h);
    }

    fn offer_tree(&self) -> crate::OfferTree {
        crate::OfferTree::empty()
    }

    fn offers(&self) -> Vec<StackOption> {
        crate::Identity.offers()
    }

    fn available(&self) -> Result<(), Error> {
        Ok(())
    }

    fn apply_pick(&mut self, _: &mut PickReader<'_>) -> Result<(), Error> {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Building a branch again

trait Build<L, R>: Send + Sync {
    fn build(&self, side: Side) -> BoxFuture<'static, Result<Either<L, R>, Error>>;
}

struct Builder<A, B, I> {
    left: A,
    right: B,
    inner: I,
}

impl<A, B, I> Build<A::Connection, B::Connection> for Builder<A, B, I>
where
    I: Clone + Send + Sync + 'static,
    A: Chunnel<I> + Clone + Send + Sync + 'static,
    B: Chunnel<I> + Clone + Send + Sync + 'static,
{
    fn build(
        &self,
        side: Side,
    ) -> BoxFuture<'static, Result<Either<A::Connection, B::Connection>, Error>> {
        let inner = self.inner.clone();
        match side {
            Side::Left => {
                let mut a = self.left.clone();
                Box::pin(async move { a.connect_wrap(inner).await.map(Either::Left) })
            }
            Side::Right => {
                let mut b = self.right.clone();
                Box::pin(async move { b.connect_wrap(inner).await.map(Either::Right) })
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The connection

/// The connection of a [`Reconfigurable`] select: the current branch's connection (`L` or
/// `R`) behind a gate of mechanism `M`.
///
/// Nameable so benchmarks can compare it with a plain stack, e.g.
/// `ReconfigConnection<NoopConnection<C>, NoopConnection<C>, LockFree>`. `send` and `recv` are
/// monomorphised, allocate nothing and box nothing; their fixed cost is the mechanism's (see
/// [`Lock`], [`LockFree`]), plus, for a `recv` that has to wait, one registration in the
/// connection's waker list so that a switch can wake it.
pub struct ReconfigConnection<L: ChunnelConnection, R, M: Mechanism = LockFree> {
    core: Arc<Core<L, R, M>>,
}

/// Clones share the connection (one implementation, one gate).
impl<L: ChunnelConnection, R, M: Mechanism> Clone for ReconfigConnection<L, R, M> {
    fn clone(&self) -> Self {
        ReconfigConnection {
            core: Arc::clone(&self.core),
        }
    }
}

impl<L: ChunnelConnection, R, M: Mechanism> fmt::Debug for ReconfigConnection<L, R, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReconfigConnection")
            .field("side", &self.core.side())
            .field("mechanism", &M::NAME)
            .field("switches", &self.core.switches.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<L, R, M> ReconfigConnection<L, R, M>
where
    L: Handover + 'static,
    R: Handover<Data = L::Data> + 'static,
    L::Data: 'static,
    M: Mechanism,
{
    /// The branch this connection currently runs on: the one its sends go to. It changes at
    /// this end's switch point; in a multilateral switch that is before the marker leaves
    /// ([`switch_with_marker`](Self::switch_with_marker)), so once the peer has read the
    /// marker this end shows the new branch.
    pub fn side(&self) -> Side {
        self.core.side()
    }

    /// How many switches this connection has completed.
    pub fn switches(&self) -> u64 {
        self.core.switches.load(Ordering::Relaxed)
    }

    /// Switches this connection alone to branch `to`; `Ok(false)` if it already runs on it.
    /// On [`Error::SwitchFailed`] (the new branch could not be built) it stays where it was.
    pub async fn reconfigure(&self, to: Side) -> Result<bool, Error> {
        self.core.switch_to(to).await
    }

    /// One end's half of a **multilateral** switch to branch `to` (used by a two-phase
    /// commit such as `chunnel-negotiate`'s): sends move to the new implementation at once,
    /// and `marker` runs at the switch point — after the last send of the old implementation
    /// and before the first of the new one — to tell the peer where its receive side must
    /// change. Receivers keep reading the old implementation until the peer's switch point
    /// comes out of it as [`Error::EndOfEpoch`] (or already did), then move to the new one,
    /// so each direction changes stack exactly at its marker.
    ///
    /// [`side`](Self::side) shows `to` from the switch point on, already while `marker`
    /// runs: a peer that has read the marker (or anything sent after it) never finds this end
    /// on the old branch.
    ///
    /// Switching to the branch the connection already runs on still builds a fresh
    /// implementation of it and moves to it at the markers (the peer's marker ends what the
    /// old one receives). On an error building the new branch or sending the marker, nothing
    /// changes (`side` shows the old branch again).
    pub async fn switch_with_marker<F, Fut>(&self, to: Side, marker: F) -> Result<(), Error>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(), Error>>,
    {
        let new = self.core.build(to).await?;
        self.core.switch_split(new, marker).await
    }
}

impl<L, R, M> ChunnelConnection for ReconfigConnection<L, R, M>
where
    L: Handover,
    R: Handover<Data = L::Data>,
    M: Mechanism,
{
    type Data = L::Data;

    async fn send<Bu>(&self, burst: Bu) -> Result<(), Error>
    where
        Bu: IntoIterator<Item = Self::Data> + Send,
        Bu::IntoIter: Send,
    {
        let core = &*self.core;
        let (ticket, _) = core.enter(&core.tx).await;
        // A send is not cancel safe, so it is never interrupted: a switch waits for it.
        core.sender(&ticket).send(burst).await
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Self::Data>]) -> Result<usize, Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let core = &*self.core;
        loop {
            let (ticket, carry) = core.enter(&core.rx).await;
            if carry {
                let n = core.take_carry(slots);
                if n > 0 {
                    return Ok(n);
                }
            }
            // Multilateral switches only (one load otherwise): the peer switched and this
            // end has not yet, so wait for this end's switch.
            let split = core.split.load(Ordering::Acquire);
            if split == SPLIT_WAITING || split == SPLIT_RETIRING {
                drop(ticket);
                core.wait_until(|| {
                    matches!(
                        core.split.load(Ordering::Acquire),
                        SPLIT_NONE | SPLIT_RETIRED
                    )
                })
                .await;
                continue;
            }
            let res = {
                let current = core.receiver(&ticket);
                let mut fut = pin!(current.recv(&mut *slots));
                let mut waiter = core.event.waiter();
                // Race the receive against the start of a switch.
                poll_fn(|cx| {
                    if let Poll::Ready(r) = fut.as_mut().poll(cx) {
                        return Poll::Ready(Some(r));
                    }
                    if M::is_closed(&core.rx, ticket.t) {
                        return Poll::Ready(None);
                    }
                    waiter.register(cx.waker());
                    #[cfg(chunnel_loom)]
                    if sync::planted(sync::PlantedBug::NoRecheck) {
                        return Poll::Pending;
                    }
                    if M::is_closed(&core.rx, ticket.t) {
                        return Poll::Ready(None);
                    }
                    Poll::Pending
                })
                .await
            };
            // The old receive future is gone; leaving the gate lets the switch proceed.
            drop(ticket);
            match res {
                Some(Err(Error::EndOfEpoch)) => core.end_of_epoch(split).await?,
                Some(r) => return r,
                None => {}
            }
        }
    }
}

impl<L, R, M> Handover for ReconfigConnection<L, R, M>
where
    L: Handover,
    R: Handover<Data = L::Data>,
    M: Mechanism,
{
    /// A nested reconfigurable connection hands over its carry-over queue and its current
    /// implementation's state. Only called when no task uses it.
    fn export(&self, state: &mut Handoff<Self::Data>) {
        let core = &*self.core;
        state.buffered.extend(lock(&core.carry).drain(..));
        if let Ok((t, _)) = M::enter(&core.rx) {
            let ticket = Ticket {
                core,
                gate: &core.rx,
                t,
            };
            core.receiver(&ticket).export(state);
        }
    }

    fn import(&self, state: &mut Handoff<Self::Data>) {
        let core = &*self.core;
        if let Ok((t, _)) = M::enter(&core.tx) {
            let ticket = Ticket {
                core,
                gate: &core.tx,
                t,
            };
            core.sender(&ticket).import(state);
        }
        if !state.buffered.is_empty() {
            lock(&core.carry).extend(state.buffered.drain(..));
            M::set_carry(&core.rx);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The handle and its registry

/// A connection as the handle sees it (type erased; off the data path).
trait Switch: Send + Sync {
    fn side(&self) -> Side;
    fn prepare(self: Arc<Self>, to: Side) -> BoxFuture<'static, Result<Box<dyn Prepared>, Error>>;
    fn switch(self: Arc<Self>, to: Side) -> BoxFuture<'static, Result<bool, Error>>;
}

trait Prepared: Send {
    /// The connection's address, to recognise it.
    fn target(&self) -> usize;
    fn commit(self: Box<Self>) -> BoxFuture<'static, bool>;
}

struct PreparedOne<L: ChunnelConnection, R, M: Mechanism> {
    core: Arc<Core<L, R, M>>,
    new: Option<Either<L, R>>,
}

impl<L, R, M> Switch for Core<L, R, M>
where
    L: Handover + 'static,
    R: Handover<Data = L::Data> + 'static,
    L::Data: 'static,
    M: Mechanism,
{
    fn side(&self) -> Side {
        Core::side(self)
    }

    fn prepare(self: Arc<Self>, to: Side) -> BoxFuture<'static, Result<Box<dyn Prepared>, Error>> {
        Box::pin(async move {
            let new = if self.side() == to {
                None
            } else {
                Some(self.build(to).await?)
            };
            Ok(Box::new(PreparedOne { core: self, new }) as Box<dyn Prepared>)
        })
    }

    fn switch(self: Arc<Self>, to: Side) -> BoxFuture<'static, Result<bool, Error>> {
        Box::pin(async move { self.switch_to(to).await })
    }
}

impl<L, R, M> Prepared for PreparedOne<L, R, M>
where
    L: Handover + 'static,
    R: Handover<Data = L::Data> + 'static,
    L::Data: 'static,
    M: Mechanism,
{
    fn target(&self) -> usize {
        Arc::as_ptr(&self.core).cast::<()>() as usize
    }

    fn commit(self: Box<Self>) -> BoxFuture<'static, bool> {
        Box::pin(async move {
            match self.new {
                Some(new) => self.core.commit(new).await,
                None => false,
            }
        })
    }
}

#[derive(Default)]
struct Registry {
    st: Mutex<RegistryState>,
}

#[derive(Default)]
struct RegistryState {
    conns: Vec<Weak<dyn Switch>>,
    target: Option<Side>,
}

impl Registry {
    fn target(&self) -> Option<Side> {
        lock(&self.st).target
    }

    /// Adds a connection; returns the branch the handle last switched to.
    fn register(&self, conn: &Arc<dyn Switch>) -> Option<Side> {
        let mut st = lock(&self.st);
        st.conns.retain(|w| w.strong_count() > 0);
        st.conns.push(Arc::downgrade(conn));
        st.target
    }

    fn live(&self) -> Vec<Arc<dyn Switch>> {
        let mut st = lock(&self.st);
        st.conns.retain(|w| w.strong_count() > 0);
        st.conns.iter().filter_map(Weak::upgrade).collect()
    }
}

/// Switches every live connection built by one [`Reconfigurable`] select (and its clones)
/// between the select's branches. Cheap to clone; holds connections only weakly.
///
/// See [`Reconfigurable`] for an example.
#[derive(Clone)]
pub struct ReconfigHandle {
    registry: Arc<Registry>,
}

impl fmt::Debug for ReconfigHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReconfigHandle")
            .field("connections", &self.connections())
            .field("target", &self.target())
            .finish()
    }
}

impl ReconfigHandle {
    /// Switches every live connection to branch `to` ([`Self::prepare`], then
    /// [`PreparedSwitch::commit`]) and returns how many connections changed branch.
    ///
    /// If the new branch cannot be built for some connection, no connection changes and the
    /// error is [`Error::SwitchFailed`]. Connections built after this call start on `to`.
    pub async fn reconfigure(&self, to: Side) -> Result<usize, Error> {
        Ok(self.prepare(to).await?.commit().await)
    }

    /// Builds branch `to` for every live connection that is not on it yet, without switching
    /// anything. All or nothing: on the first failure the builds are dropped and
    /// [`Error::SwitchFailed`] counts the failures.
    pub async fn prepare(&self, to: Side) -> Result<PreparedSwitch, Error> {
        let conns = self.registry.live();
        let of = conns.len();
        let mut parts = Vec::with_capacity(of);
        let mut first = None;
        let mut failed = 0;
        for c in conns {
            match c.prepare(to).await {
                Ok(p) => parts.push(p),
                Err(e) => {
                    failed += 1;
                    let e = match e {
                        Error::SwitchFailed { source, .. } => *source,
                        e => e,
                    };
                    first.get_or_insert(e);
                }
            }
        }
        match first {
            Some(source) => Err(Error::SwitchFailed {
                to,
                failed,
                of,
                source: Box::new(source),
            }),
            None => Ok(PreparedSwitch {
                to,
                parts,
                registry: self.registry.clone(),
            }),
        }
    }

    /// How many connections built by the select are alive.
    pub fn connections(&self) -> usize {
        self.registry.live().len()
    }

    /// The branch of the last committed switch (new connections start there), if any.
    pub fn target(&self) -> Option<Side> {
        self.registry.target()
    }
}

/// New branches built by [`ReconfigHandle::prepare`], not installed yet. [`Self::commit`]
/// installs them; dropping (or [`Self::abort`]) discards them and nothing changes.
pub struct PreparedSwitch {
    to: Side,
    parts: Vec<Box<dyn Prepared>>,
    registry: Arc<Registry>,
}

impl fmt::Debug for PreparedSwitch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedSwitch")
            .field("to", &self.to)
            .field("connections", &self.parts.len())
            .finish()
    }
}

impl PreparedSwitch {
    /// The branch being switched to.
    pub fn to(&self) -> Side {
        self.to
    }

    /// Switches each prepared connection (one after the other) and returns how many changed
    /// branch. Connections built meanwhile are switched too (best effort: one whose new
    /// branch fails to build stays where it is).
    pub async fn commit(self) -> usize {
        let (late, covered): (Vec<_>, Vec<_>) = {
            let mut st = lock(&self.registry.st);
            st.target = Some(self.to);
            st.conns.retain(|w| w.strong_count() > 0);
            let covered: Vec<usize> = self.parts.iter().map(|p| p.target()).collect();
            (st.conns.iter().filter_map(Weak::upgrade).collect(), covered)
        };
        let mut n = 0;
        for p in self.parts {
            n += usize::from(p.commit().await);
        }
        for c in late {
            let ptr = Arc::as_ptr(&c).cast::<()>() as usize;
            if !covered.contains(&ptr)
                && c.side() != self.to
                && matches!(c.switch(self.to).await, Ok(true))
            {
                n += 1;
            }
        }
        n
    }

    /// Discards the prepared branches; no connection changes.
    pub fn abort(self) {}
}
