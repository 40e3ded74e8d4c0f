//! Two trivial Chunnels: [`Identity`] (no layer at all) and [`Noop`] (a real layer that passes
//! every message through, touching it).

use std::future::Future;
use std::hint::black_box;

use crate::negotiate::{Negotiate, Offers, PickReader, StackOption};
use crate::{Chunnel, ChunnelConnection, Error};

/// The identity Chunnel: returns the inner connection unchanged. `stack![Identity, x]` builds
/// exactly what `x` builds.
#[derive(Clone, Copy, Debug, Default)]
pub struct Identity;

impl<C: ChunnelConnection + Send> Chunnel<C> for Identity {
    type Connection = C;

    async fn connect_wrap(&mut self, inner: C) -> Result<C, Error> {
        Ok(inner)
    }
}

/// The identity is no layer: it contributes nothing to negotiation.
impl Offers for Identity {
    fn hash_offers(&self, h: &mut dyn std::hash::Hasher) {
        h.write_u8(crate::negotiate::DIGEST_NO_LAYER);
    }

    fn offer_tree(&self) -> crate::OfferTree {
        crate::OfferTree::empty()
    }

    fn offers(&self) -> Vec<StackOption> {
        vec![StackOption {
            chunnels: Vec::new(),
            pick: crate::Pick::default(),
        }]
    }

    fn available(&self) -> Result<(), Error> {
        Ok(())
    }

    fn apply_pick(&mut self, _: &mut PickReader<'_>) -> Result<(), Error> {
        Ok(())
    }
}

/// A pass-through layer that really is a layer: it wraps the inner connection in its own type
/// and passes every message through [`std::hint::black_box`], so the compiler cannot remove it.
/// It measures what composition costs (`chunnel-bench overhead`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Noop;

/// The connection a [`Noop`] produces.
#[derive(Debug)]
pub struct NoopConnection<C> {
    inner: C,
}

impl<C> NoopConnection<C> {
    /// The wrapped connection.
    pub fn get_ref(&self) -> &C {
        &self.inner
    }
}

impl<C: ChunnelConnection + Send> Chunnel<C> for Noop {
    type Connection = NoopConnection<C>;

    async fn connect_wrap(&mut self, inner: C) -> Result<Self::Connection, Error> {
        Ok(NoopConnection { inner })
    }
}

impl Negotiate for Noop {
    fn id(&self) -> &'static str {
        "chunnel/noop/1"
    }
}

impl<C: ChunnelConnection> ChunnelConnection for NoopConnection<C> {
    type Data = C::Data;

    #[inline]
    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = Self::Data> + Send,
        B::IntoIter: Send,
    {
        // `black_box(&m)` makes the compiler assume this layer reads every message, without
        // moving the message itself through an opaque call.
        self.inner.send(burst.into_iter().inspect(|m| {
            black_box(m);
        }))
    }

    #[inline]
    // Not an `async fn`: it would keep its arguments twice in the future.
    #[allow(clippy::manual_async_fn)]
    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Self::Data>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        async move {
            let n = self.inner.recv(slots).await?;
            for s in slots.get(..n).unwrap_or(slots) {
                black_box(s);
            }
            Ok(n)
        }
    }
}
