//! What [`crate::Registry::select`] builds: a chain of nested selects over boxed Chunnels,
//! each leaf wrapped so that its resources are re-checked and its hooks run.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use chunnel::negotiate::PickReader;
use chunnel::{
    BoxChunnel, BoxConnection, Chunnel, ChunnelConnection, ChunnelExt, OfferTree, Offers,
    StackOption, select,
};

use crate::Error;
use crate::candidate::{Candidate, Skip};
use crate::registry::{Implementation, LiveGuard, Placement, Registry, effective_priority, judge};

/// An implementation and its built Chunnel.
pub(crate) type Member<I, D> = (Arc<Implementation<I, D>>, BoxChunnel<I, D>);

/// The usable implementations of one function as one Chunnel, in policy order; built by
/// [`crate::Registry::select`].
///
/// Its negotiation metadata is the chain `select(first, select(second, ... last))` of the
/// implementations' own: [`Offers::offer_tree`] is
/// `Select(first's tree, Select(second's tree, ...))`, so a peer's negotiation sees each
/// implementation's id and capabilities, in policy order, and picks the first that both
/// ends can run. Without a pick, `connect_wrap` builds the first whose availability check
/// passes (like any select).
///
/// `Clone` builds a fresh copy of the same implementations in the same order (a server
/// copies its stack for each connection; later policy changes do not reorder a copy, so its
/// options stay those the server announced). The connection is a [`BoxConnection`]: a
/// call on the implementation ranked `k` (0 first) goes through at most `k + 3` boxed
/// futures (one per select level above it, the leaf's wrapper, the implementation's own
/// `BoxChunnel`), the price of a set known only at run time; typed stacks pay none.
pub struct Selection<I, D> {
    function: String,
    members: Vec<Arc<Implementation<I, D>>>,
    candidates: Vec<Candidate>,
    /// Behind a mutex only to be `Sync` (a server shares its stack between tasks):
    /// `connect_wrap` and `apply_pick` reach it through `get_mut`, without locking.
    tree: Mutex<BoxChunnel<I, D>>,
}

impl<I, D> fmt::Debug for Selection<I, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Selection")
            .field("function", &self.function)
            .field("members", &self.names())
            .finish_non_exhaustive()
    }
}

impl<I: Send + 'static, D: Send + 'static> Selection<I, D> {
    pub(crate) fn new(
        function: String,
        members: Vec<Member<I, D>>,
        candidates: Vec<Candidate>,
    ) -> Result<Self, Error> {
        let names: Vec<_> = members.iter().map(|(e, _)| Arc::clone(e)).collect();
        let tree = chain(members).ok_or_else(|| Error::NoImplementation {
            function: function.clone(),
            candidates: candidates.clone(),
        })?;
        Ok(Selection {
            function,
            members: names,
            candidates,
            tree: Mutex::new(tree),
        })
    }
}

/// `select(first, select(second, ... last))`, each leaf hooked; `None` if there is none.
fn chain<I: Send + 'static, D: Send + 'static>(
    members: Vec<Member<I, D>>,
) -> Option<BoxChunnel<I, D>> {
    let mut leaves = members
        .into_iter()
        .rev()
        .map(|(imp, inner)| Hooked { inner, imp }.boxed());
    let mut acc = leaves.next()?;
    for leaf in leaves {
        acc = select(leaf, acc).boxed();
    }
    Some(acc)
}

impl<I, D> Selection<I, D> {
    /// The function these implement.
    pub fn function(&self) -> &str {
        &self.function
    }

    /// The implementations in the select, in policy order.
    pub fn names(&self) -> Vec<&str> {
        self.members.iter().map(|m| m.name()).collect()
    }

    /// Every candidate of the function, in policy order, with its rank in the select or why
    /// it was skipped.
    pub fn candidates(&self) -> &[Candidate] {
        &self.candidates
    }

    /// The implementation a negotiated pick names, given the pick's decisions from this
    /// select on (for a stack whose top layer is this selection, the whole pick:
    /// `info.client_pick.branches()` on the client, `server_pick` on the server).
    ///
    /// The chain's decisions are `1` for each implementation passed over, then `0` for the
    /// picked one (none after the last).
    pub fn picked(&self, decisions: &[u8]) -> Option<&str> {
        let n = self.members.len();
        for (i, m) in self.members.iter().enumerate().take(n.saturating_sub(1)) {
            match decisions.get(i)? {
                0 => return Some(m.name()),
                1 => continue,
                _ => return None,
            }
        }
        self.members.last().map(|m| m.name())
    }
}

impl<I: Send + 'static, D: Send + 'static> Clone for Selection<I, D> {
    fn clone(&self) -> Self {
        let members = self
            .members
            .iter()
            .map(|m| (Arc::clone(m), m.build()))
            .collect();
        Selection::new(self.function.clone(), members, self.candidates.clone())
            .expect("a selection has at least one member")
    }
}

impl<I: Send + 'static, D: Send + 'static> Chunnel<I> for Selection<I, D> {
    type Connection = BoxConnection<D>;

    fn connect_wrap(
        &mut self,
        inner: I,
    ) -> impl Future<Output = Result<Self::Connection, chunnel::Error>> + Send {
        self.tree_mut().connect_wrap(inner)
    }
}

impl<I, D> Selection<I, D> {
    fn tree(&self) -> MutexGuard<'_, BoxChunnel<I, D>> {
        self.tree.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn tree_mut(&mut self) -> &mut BoxChunnel<I, D> {
        self.tree.get_mut().unwrap_or_else(|p| p.into_inner())
    }
}

impl<I, D> Offers for Selection<I, D> {
    fn offers(&self) -> Vec<StackOption> {
        self.tree().offers()
    }

    fn offer_tree(&self) -> OfferTree {
        self.tree().offer_tree()
    }

    fn available(&self) -> Result<(), chunnel::Error> {
        self.tree().available()
    }

    fn apply_pick(&mut self, pick: &mut PickReader<'_>) -> Result<(), chunnel::Error> {
        self.tree_mut().apply_pick(pick)
    }
}

/// One implementation's Chunnel in a selection: its resources are re-checked whenever it is
/// offered or built, and every connection it builds holds the implementation's live count.
struct Hooked<I, D> {
    inner: BoxChunnel<I, D>,
    imp: Arc<Implementation<I, D>>,
}

impl<I, D> Hooked<I, D> {
    fn imp(&self) -> &Implementation<I, D> {
        &self.imp
    }

    fn resources(&self) -> Result<(), chunnel::Error> {
        match self.imp().missing_resource() {
            None => Ok(()),
            Some((resource, reason)) => Err(chunnel::Error::NotAvailable {
                chunnel: "chunnel/discovery",
                reason: format!(
                    "implementation `{}` misses {resource}: {reason}",
                    self.imp().name()
                ),
            }),
        }
    }
}

impl<I: Send + 'static, D: Send + 'static> Chunnel<I> for Hooked<I, D> {
    type Connection = Tracked<D>;

    async fn connect_wrap(&mut self, inner: I) -> Result<Tracked<D>, chunnel::Error> {
        self.resources()?;
        let imp = &self.imp;
        let guard = imp.acquire()?;
        let conn = self.inner.connect_wrap(inner).await?;
        Ok(Tracked {
            conn,
            _guard: guard,
        })
    }
}

impl<I, D> Offers for Hooked<I, D> {
    fn offers(&self) -> Vec<StackOption> {
        if self.resources().is_err() {
            return Vec::new();
        }
        self.inner.offers()
    }

    fn offer_tree(&self) -> OfferTree {
        if self.resources().is_err() {
            return OfferTree::Options(Vec::new());
        }
        self.inner.offer_tree()
    }

    fn available(&self) -> Result<(), chunnel::Error> {
        self.resources()?;
        self.inner.available()
    }

    fn apply_pick(&mut self, pick: &mut PickReader<'_>) -> Result<(), chunnel::Error> {
        self.inner.apply_pick(pick)
    }
}

/// A connection of a registered implementation; dropping the last one of an implementation
/// runs its tear-down hook.
struct Tracked<D> {
    conn: BoxConnection<D>,
    _guard: LiveGuard,
}

impl<D: Send + 'static> ChunnelConnection for Tracked<D> {
    type Data = D;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), chunnel::Error>> + Send
    where
        B: IntoIterator<Item = D> + Send,
        B::IntoIter: Send,
    {
        self.conn.send(burst)
    }

    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<D>],
    ) -> impl Future<Output = Result<usize, chunnel::Error>> + Send + 'a {
        self.conn.recv(slots)
    }
}

impl<I: Send + 'static, D: Send + 'static> Registry<I, D> {
    /// The registered, usable implementations of `function` as one Chunnel, in policy order:
    /// a chain of nested `select`s of their boxed Chunnels, so it negotiates like any select.
    /// Each candidate is judged now (policy, resources, the Chunnel's own availability
    /// check); [`Selection::candidates`] says why each skipped one was. Of the
    /// [`Placement::Base`] implementations only the first usable one is kept (an end runs on
    /// one socket; the others are [`Skip::BaseNotUsed`]). Fails with
    /// [`Error::NoImplementation`] if none is usable.
    pub fn select(&self, function: &str) -> Result<Selection<I, D>, Error> {
        let (ranked, policy) = self.ranked(function);
        let mut members = Vec::new();
        let mut candidates = Vec::new();
        let mut base: Option<String> = None;
        for e in ranked {
            let outcome = match (e.placement(), &base) {
                (Placement::Base, Some(used)) => Err(Skip::BaseNotUsed { used: used.clone() }),
                _ => match judge(&policy, &e) {
                    Ok(c) => {
                        if e.placement() == Placement::Base {
                            base = Some(e.name().to_string());
                        }
                        members.push((Arc::clone(&e), c));
                        Ok(members.len() - 1)
                    }
                    Err(skip) => Err(skip),
                },
            };
            candidates.push(Candidate {
                name: e.name().to_string(),
                priority: effective_priority(&policy, &e),
                scope: Some(e.scope()),
                outcome,
            });
        }
        Selection::new(function.to_string(), members, candidates)
    }
}
