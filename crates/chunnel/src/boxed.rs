//! Dynamic dispatch for stacks: [`BoxChunnel`] and [`BoxConnection`].
//!
//! A stack's type names every layer; when an application must choose its stack at run time
//! from configuration, or store different stacks in one collection, box it with
//! [`ChunnelExt::boxed`](crate::ChunnelExt::boxed). The price is one heap-allocated future per
//! `send`/`recv` call and a virtual call per layer boundary that was boxed; the statically
//! typed stack has neither.

use std::future::Future;
use std::pin::Pin;

use crate::negotiate::{Offers, PickReader, StackOption};
use crate::{Chunnel, ChunnelConnection, Error};

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

trait DynConnection<D>: Send + Sync {
    fn send_dyn<'a>(
        &'a self,
        burst: &'a mut (dyn Iterator<Item = D> + Send),
    ) -> BoxFuture<'a, Result<(), Error>>;
    fn recv_dyn<'a>(&'a self, slots: &'a mut [Option<D>]) -> BoxFuture<'a, Result<usize, Error>>;
}

impl<C: ChunnelConnection> DynConnection<C::Data> for C {
    fn send_dyn<'a>(
        &'a self,
        burst: &'a mut (dyn Iterator<Item = C::Data> + Send),
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.send(burst))
    }

    fn recv_dyn<'a>(
        &'a self,
        slots: &'a mut [Option<C::Data>],
    ) -> BoxFuture<'a, Result<usize, Error>> {
        Box::pin(self.recv(slots))
    }
}

/// A connection behind dynamic dispatch, carrying `D`.
pub struct BoxConnection<D> {
    inner: Box<dyn DynConnection<D>>,
}

impl<D> std::fmt::Debug for BoxConnection<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoxConnection").finish_non_exhaustive()
    }
}

impl<D: Send + 'static> BoxConnection<D> {
    /// Boxes any connection carrying `D`.
    pub fn new<C: ChunnelConnection<Data = D> + 'static>(conn: C) -> Self {
        BoxConnection {
            inner: Box::new(conn),
        }
    }
}

impl<D: Send + 'static> ChunnelConnection for BoxConnection<D> {
    type Data = D;

    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = D> + Send,
        B::IntoIter: Send,
    {
        let mut it = burst.into_iter();
        self.inner.send_dyn(&mut it).await
    }

    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<D>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        self.inner.recv_dyn(slots)
    }
}

trait DynChunnel<I, D>: Send {
    fn connect_wrap_dyn(&mut self, inner: I) -> BoxFuture<'_, Result<BoxConnection<D>, Error>>;
    fn offers_dyn(&self) -> Vec<StackOption>;
    fn offer_tree_dyn(&self) -> crate::OfferTree;
    fn available_dyn(&self) -> Result<(), Error>;
    fn apply_pick_dyn(&mut self, pick: &mut PickReader<'_>) -> Result<(), Error>;
}

impl<I, C> DynChunnel<I, <C::Connection as ChunnelConnection>::Data> for C
where
    I: Send + 'static,
    C: Chunnel<I> + Offers + Send,
    C::Connection: 'static,
{
    fn connect_wrap_dyn(
        &mut self,
        inner: I,
    ) -> BoxFuture<'_, Result<BoxConnection<<C::Connection as ChunnelConnection>::Data>, Error>>
    {
        Box::pin(async move { Ok(BoxConnection::new(self.connect_wrap(inner).await?)) })
    }

    fn offers_dyn(&self) -> Vec<StackOption> {
        self.offers()
    }

    fn offer_tree_dyn(&self) -> crate::OfferTree {
        self.offer_tree()
    }

    fn available_dyn(&self) -> Result<(), Error> {
        self.available()
    }

    fn apply_pick_dyn(&mut self, pick: &mut PickReader<'_>) -> Result<(), Error> {
        self.apply_pick(pick)
    }
}

/// A Chunnel (usually a whole stack) behind dynamic dispatch: it takes `I` and produces a
/// [`BoxConnection<D>`]. It still negotiates like the stack it wraps.
///
/// ```
/// use chunnel::{stack, BoxChunnel, BoxConnection, ChunnelExt, Identity, Noop};
/// # fn pick_from_config() -> bool { true }
/// // Two different stack types in one variable.
/// let s: BoxChunnel<BoxConnection<u32>, u32> = if pick_from_config() {
///     stack![Noop, Noop].boxed()
/// } else {
///     Identity.boxed()
/// };
/// ```
pub struct BoxChunnel<I, D> {
    inner: Box<dyn DynChunnel<I, D>>,
}

impl<I, D> std::fmt::Debug for BoxChunnel<I, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoxChunnel").finish_non_exhaustive()
    }
}

impl<I: Send + 'static, D: Send + 'static> BoxChunnel<I, D> {
    /// Boxes a Chunnel producing connections that carry `D`.
    pub fn new<C>(chunnel: C) -> Self
    where
        C: Chunnel<I> + Offers + Send + 'static,
        C::Connection: ChunnelConnection<Data = D> + 'static,
    {
        BoxChunnel {
            inner: Box::new(chunnel),
        }
    }
}

impl<I: Send + 'static, D: Send + 'static> Chunnel<I> for BoxChunnel<I, D> {
    type Connection = BoxConnection<D>;

    fn connect_wrap(
        &mut self,
        inner: I,
    ) -> impl Future<Output = Result<Self::Connection, Error>> + Send {
        self.inner.connect_wrap_dyn(inner)
    }
}

impl<I, D> Offers for BoxChunnel<I, D> {
    fn offers(&self) -> Vec<StackOption> {
        self.inner.offers_dyn()
    }

    fn offer_tree(&self) -> crate::OfferTree {
        self.inner.offer_tree_dyn()
    }

    fn available(&self) -> Result<(), Error> {
        self.inner.available_dyn()
    }

    fn apply_pick(&mut self, pick: &mut PickReader<'_>) -> Result<(), Error> {
        self.inner.apply_pick_dyn(pick)
    }
}
