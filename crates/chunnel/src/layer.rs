//! Layers: Chunnels whose per-connection state is kept apart from the connection below, so a
//! [`Select`] of layers keeps one inner connection instead of one per branch.
//!
//! A `Select<A, B>` of Chunnels builds `Either<A::Connection, B::Connection>`, and both
//! connections contain the inner connection's type: a stack of k such selects has a type
//! whose *tree* has 2^k leaves. rustc stores types as a DAG, but the legacy symbol mangling
//! (the default on stable) and debug-info type names spell every type out as a tree, so symbol
//! names, and with them compile time and memory, double with every select
//! (`scripts/compile-cost.sh`; ARCHITECTURE.md, "Compile cost of selects").
//!
//! A [`Layer`] is a Chunnel written as a state ([`LayerState`]) plus what it does to each
//! message on the way down and to each received batch on the way up; [`Layered`] makes it a
//! Chunnel. A select of layers is a layer whose state is `Either<A::State, B::State>`, so
//! `stack![Layered(select(a, b)), Layered(select(c, d)), udp]` builds
//! `LayerConnection<Either<Sa, Sb>, LayerConnection<Either<Sc, Sd>, udp::Connection>>`: the
//! inner connection appears once, the type grows linearly in the number of selects, and each
//! call goes through one inner future (the branch is chosen per message by the state's tag:
//! no boxing, no allocation).
//!
//! ```
//! use chunnel::{select, Error, Layer, LayerState, Layered, Negotiate};
//! use bytes::Bytes;
//!
//! /// Appends one byte to every message; checks and strips it on receive.
//! #[derive(Clone, Copy, Debug)]
//! struct Mark(u8);
//!
//! impl Negotiate for Mark {
//!     fn id(&self) -> &'static str { "example/mark/1" }
//! }
//! impl Layer for Mark {
//!     type State = Mark;
//!     fn state(&mut self) -> Result<Mark, Error> { Ok(*self) }
//! }
//! impl LayerState for Mark {
//!     type Data = Bytes;
//!     fn on_send(&self, m: Bytes) -> Bytes {
//!         let mut v = m.to_vec();
//!         v.push(self.0);
//!         v.into()
//!     }
//!     fn on_recv(&self, batch: &mut [Option<Bytes>]) -> Result<usize, Error> {
//!         for m in batch.iter_mut().flatten() {
//!             if m.last() != Some(&self.0) {
//!                 return Err(Error::Malformed { what: "mark" });
//!             }
//!             m.truncate(m.len() - 1);
//!         }
//!         Ok(batch.len())
//!     }
//! }
//!
//! // A Chunnel over any `Bytes` connection; a select of two marks is one layer.
//! let _one = Layered(Mark(1));
//! let _either = Layered(select(Mark(1), Mark(2)));
//! ```

use std::future::Future;

use crate::negotiate::{Offers, PickReader, StackOption};
use crate::select::{Either, Select, Side};
use crate::{Chunnel, ChunnelConnection, Error, OfferTree};

/// A Chunnel written as per-connection state plus message transforms (see the module docs).
///
/// Implement it (with [`LayerState`]) for a layer that changes messages one by one on the way
/// down and checks, changes or drops received messages on the way up, and that needs nothing
/// from the connection below but its `send` and `recv`. Use it in a stack through
/// [`Layered`]; a [`Select`] of layers is a layer.
pub trait Layer: Offers + Send {
    /// What one connection of this layer keeps.
    type State: LayerState;

    /// Makes the state of a new connection (called by `connect_wrap`).
    fn state(&mut self) -> Result<Self::State, Error>;
}

/// The per-connection state of a [`Layer`]: what it does to the messages passing through.
pub trait LayerState: Send + Sync {
    /// The messages above and below the layer.
    type Data: Send;

    /// Transforms one message on its way down.
    fn on_send(&self, m: Self::Data) -> Self::Data;

    /// Checks and transforms a batch the connection below received (every slot holds a
    /// message): keeps the messages to deliver at the front and returns how many there are.
    /// Returning 0 receives again; an error is returned from `recv`.
    fn on_recv(&self, batch: &mut [Option<Self::Data>]) -> Result<usize, Error>;
}

impl<L, R> LayerState for Either<L, R>
where
    L: LayerState,
    R: LayerState<Data = L::Data>,
{
    type Data = L::Data;

    #[inline]
    fn on_send(&self, m: Self::Data) -> Self::Data {
        match self {
            Either::Left(s) => s.on_send(m),
            Either::Right(s) => s.on_send(m),
        }
    }

    #[inline]
    fn on_recv(&self, batch: &mut [Option<Self::Data>]) -> Result<usize, Error> {
        match self {
            Either::Left(s) => s.on_recv(batch),
            Either::Right(s) => s.on_recv(batch),
        }
    }
}

/// A select of two layers is a layer: its state is the picked branch's, under a tag.
impl<A, B> Layer for Select<A, B>
where
    A: Layer,
    B: Layer,
    B::State: LayerState<Data = <A::State as LayerState>::Data>,
{
    type State = Either<A::State, B::State>;

    fn state(&mut self) -> Result<Self::State, Error> {
        Ok(match self.resolve()? {
            Side::Left => Either::Left(self.left.state()?),
            Side::Right => Either::Right(self.right.state()?),
        })
    }
}

/// A [`Layer`] (or a select of layers) used as a Chunnel: over an inner connection `C` it
/// builds a [`LayerConnection`] holding the layer's state next to `C`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Layered<L>(pub L);

impl<L, C> Chunnel<C> for Layered<L>
where
    L: Layer,
    C: ChunnelConnection<Data = <L::State as LayerState>::Data> + Send,
{
    type Connection = LayerConnection<L::State, C>;

    async fn connect_wrap(&mut self, inner: C) -> Result<Self::Connection, Error> {
        Ok(LayerConnection {
            state: self.0.state()?,
            inner,
        })
    }
}

impl<L: Offers> Offers for Layered<L> {
    fn hash_offers(&self, h: &mut dyn std::hash::Hasher) {
        self.0.hash_offers(h)
    }

    fn offer_tree(&self) -> OfferTree {
        self.0.offer_tree()
    }

    fn offers(&self) -> Vec<StackOption> {
        self.0.offers()
    }

    fn available(&self) -> Result<(), Error> {
        self.0.available()
    }

    fn apply_pick(&mut self, pick: &mut PickReader<'_>) -> Result<(), Error> {
        self.0.apply_pick(pick)
    }
}

/// The connection of a [`Layered`]: a layer's state and the one connection below it.
#[derive(Debug)]
pub struct LayerConnection<S, C> {
    state: S,
    inner: C,
}

impl<S, C> LayerConnection<S, C> {
    /// The layer's state (for a select of layers, an [`Either`] telling the branch).
    pub fn state(&self) -> &S {
        &self.state
    }

    /// The connection below.
    pub fn get_ref(&self) -> &C {
        &self.inner
    }
}

/// A burst on its way down through a layer: each message passes through the state's
/// `on_send`. A named type (not a closure, whose type would repeat the burst's type).
#[derive(Debug)]
pub struct OnSend<'a, I, S> {
    burst: I,
    state: &'a S,
}

impl<I, S> Iterator for OnSend<'_, I, S>
where
    S: LayerState,
    I: Iterator<Item = S::Data>,
{
    type Item = S::Data;

    #[inline]
    fn next(&mut self) -> Option<S::Data> {
        self.burst.next().map(|m| self.state.on_send(m))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.burst.size_hint()
    }
}

impl<S, C> ChunnelConnection for LayerConnection<S, C>
where
    S: LayerState,
    C: ChunnelConnection<Data = S::Data>,
{
    type Data = S::Data;

    #[inline]
    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = Self::Data> + Send,
        B::IntoIter: Send,
    {
        // One future of the connection below, whichever branch the state is.
        self.inner.send(OnSend {
            burst: burst.into_iter(),
            state: &self.state,
        })
    }

    #[inline]
    // Not an `async fn`: it would keep its arguments twice in the future.
    #[allow(clippy::manual_async_fn)]
    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Self::Data>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        async move {
            loop {
                // Cancel safe: nothing is awaited after the inner recv returned.
                let n = self.inner.recv(slots).await?;
                if n == 0 {
                    return Ok(0);
                }
                let n = n.min(slots.len());
                let kept = self.state.on_recv(&mut slots[..n])?;
                if kept > 0 {
                    return Ok(kept);
                }
            }
        }
    }
}
