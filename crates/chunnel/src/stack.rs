//! Stacks: the compile-time composition of Chunnels, built with [`stack!`](crate::stack!).

use crate::negotiate::{Offers, PickReader, StackOption};
use crate::{Chunnel, Error};

/// Two Chunnels composed: `Outer` runs on top of the connection `Inner` builds.
///
/// Built by the [`stack!`](crate::stack!) macro as a cons-list: `stack![a, b, c]` is
/// `Stack::new(a, Stack::new(b, c))`, with `a` nearest the application and `c` nearest the
/// wire. `connect_wrap` builds bottom-up (paper Figure 2): `c` first, then `b` over it, then
/// `a`. The compiler checks every boundary: `Outer` must be a `Chunnel` over exactly the
/// connection type `Inner` produces.
#[derive(Clone, Debug, Default)]
pub struct Stack<Outer, Inner> {
    /// The upper Chunnel.
    pub outer: Outer,
    /// The lower Chunnel (or stack).
    pub inner: Inner,
}

impl<Outer, Inner> Stack<Outer, Inner> {
    /// Composes `outer` on top of `inner`.
    pub fn new(outer: Outer, inner: Inner) -> Self {
        Stack { outer, inner }
    }
}

impl<I, Outer, Inner> Chunnel<I> for Stack<Outer, Inner>
where
    I: Send,
    Inner: Chunnel<I> + Send,
    Outer: Chunnel<Inner::Connection> + Send,
{
    type Connection = Outer::Connection;

    async fn connect_wrap(&mut self, inner: I) -> Result<Self::Connection, Error> {
        let conn = self.inner.connect_wrap(inner).await?;
        self.outer.connect_wrap(conn).await
    }
}

impl<Outer: Offers, Inner: Offers> Offers for Stack<Outer, Inner> {
    fn hash_offers(&self, h: &mut dyn std::hash::Hasher) {
        h.write_u8(crate::negotiate::DIGEST_STACK);
        self.outer.hash_offers(h);
        self.inner.hash_offers(h);
    }

    fn offer_tree(&self) -> crate::OfferTree {
        crate::OfferTree::seq(self.outer.offer_tree(), self.inner.offer_tree())
    }

    fn offers(&self) -> Vec<StackOption> {
        let lower = self.inner.offers();
        let mut out = Vec::new();
        for up in self.outer.offers() {
            for down in &lower {
                let mut chunnels = up.chunnels.clone();
                chunnels.extend(down.chunnels.iter().cloned());
                out.push(StackOption {
                    chunnels,
                    pick: crate::Pick::concat(&[up.pick.branches(), down.pick.branches()]),
                });
            }
        }
        out
    }

    fn available(&self) -> Result<(), Error> {
        self.outer.available()?;
        self.inner.available()
    }

    fn apply_pick(&mut self, pick: &mut PickReader<'_>) -> Result<(), Error> {
        self.outer.apply_pick(pick)?;
        self.inner.apply_pick(pick)
    }
}

/// Builds a [`Stack`] from Chunnels listed top (application) to bottom (wire).
///
/// ```
/// use chunnel::{stack, Noop, Stack};
/// let s: Stack<Noop, Stack<Noop, Noop>> = stack![Noop, Noop, Noop];
/// ```
#[macro_export]
macro_rules! stack {
    ($only:expr $(,)?) => { $only };
    ($head:expr, $($rest:expr),+ $(,)?) => {
        $crate::Stack::new($head, $crate::stack!($($rest),+))
    };
}
