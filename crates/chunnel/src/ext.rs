//! Combinators on every Chunnel ([`ChunnelExt`]): serving a listener's connections through a
//! stack ([`Serve`]) and erasing a stack's type ([`crate::BoxChunnel`]).

use crate::chunnel::{Chunnel, Listener};
use crate::{ChunnelConnection, Error};

/// A listener that wraps every accepted connection in a stack: `accept` returns the finished
/// connection. Built by [`ChunnelExt::serve`].
#[derive(Debug)]
pub struct Serve<L, S> {
    listener: L,
    stack: S,
}

impl<L, S> Serve<L, S> {
    /// The underlying listener.
    pub fn get_ref(&self) -> &L {
        &self.listener
    }

    /// Splits into the listener and the stack.
    pub fn into_inner(self) -> (L, S) {
        (self.listener, self.stack)
    }
}

impl<L, S> Listener for Serve<L, S>
where
    L: Listener,
    S: Chunnel<L::Connection> + Send,
{
    type Connection = S::Connection;

    async fn accept(&mut self) -> Result<Self::Connection, Error> {
        let base = self.listener.accept().await?;
        self.stack.connect_wrap(base).await
    }
}

/// Combinators available on every Chunnel.
pub trait ChunnelExt<I>: Chunnel<I> + Sized {
    /// Applies this Chunnel (or stack) to each connection `listener` accepts.
    fn serve<L>(self, listener: L) -> Serve<L, Self>
    where
        L: Listener<Connection = I>,
    {
        Serve {
            listener,
            stack: self,
        }
    }

    /// Erases the connection type behind dynamic dispatch; see [`crate::BoxChunnel`].
    fn boxed(self) -> crate::boxed::BoxChunnel<I, <Self::Connection as ChunnelConnection>::Data>
    where
        Self: crate::negotiate::Offers + Send + 'static,
        I: Send + 'static,
        Self::Connection: 'static,
    {
        crate::boxed::BoxChunnel::new(self)
    }
}

impl<I, C: Chunnel<I> + Sized> ChunnelExt<I> for C {}
