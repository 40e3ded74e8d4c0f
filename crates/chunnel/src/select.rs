//! `Select`: a choice between two Chunnels (or stacks, or bind configs) in one layer, and
//! `Either`, the connection (or listener) it produces.

use crate::negotiate::{Offers, Pick, PickReader, StackOption};
use crate::{Chunnel, ChunnelConnection, Error, Listen, Listener};

pub use crate::side::Side;

/// A choice between `left` (preferred) and `right` in one layer of a stack.
///
/// Without a pick, `connect_wrap` builds the first branch whose [`Offers::available`] check
/// passes, in preference order; negotiation (or the application) can fix the branch with
/// [`Offers::apply`] or [`Select::prefer`]. The connection is an [`Either`], which dispatches
/// each call with one branch on the enum's tag.
///
/// ```
/// use chunnel::{select, Noop, Select, Side};
/// let s: Select<Noop, Noop> = select(Noop, Noop);
/// assert_eq!(s.choice(), None);
/// ```
#[derive(Clone, Debug, Default)]
pub struct Select<A, B> {
    /// The preferred branch.
    pub left: A,
    /// The fallback branch.
    pub right: B,
    choice: Option<Side>,
}

/// A [`Select`] preferring `left` over `right`.
pub fn select<A, B>(left: A, right: B) -> Select<A, B> {
    Select {
        left,
        right,
        choice: None,
    }
}

impl<A, B> Select<A, B> {
    /// The branch fixed by a pick, if any.
    pub fn choice(&self) -> Option<Side> {
        self.choice
    }

    /// Fixes the branch to build, overriding the availability-based default.
    pub fn prefer(mut self, side: Side) -> Self {
        self.choice = Some(side);
        self
    }
}

impl<A: Offers, B: Offers> Select<A, B> {
    /// The branch `connect_wrap` will build: the fixed choice (if it is available), else the
    /// first available one. Any error from a branch's availability check counts as
    /// unavailable.
    pub fn resolve(&self) -> Result<Side, Error> {
        match self.choice {
            Some(Side::Left) => return self.left.available().map(|()| Side::Left),
            Some(Side::Right) => return self.right.available().map(|()| Side::Right),
            None => {}
        }
        match self.left.available() {
            Ok(()) => Ok(Side::Left),
            Err(left) => match self.right.available() {
                Ok(()) => Ok(Side::Right),
                Err(right) => Err(Error::NoBranch {
                    left: Box::new(left),
                    right: Box::new(right),
                }),
            },
        }
    }
}

impl<I, A, B> Chunnel<I> for Select<A, B>
where
    I: Send,
    A: Chunnel<I> + Offers + Send,
    B: Chunnel<I> + Offers + Send,
    B::Connection: ChunnelConnection<Data = <A::Connection as ChunnelConnection>::Data>,
{
    type Connection = Either<A::Connection, B::Connection>;

    async fn connect_wrap(&mut self, inner: I) -> Result<Self::Connection, Error> {
        match self.resolve()? {
            Side::Left => Ok(Either::Left(self.left.connect_wrap(inner).await?)),
            Side::Right => Ok(Either::Right(self.right.connect_wrap(inner).await?)),
        }
    }
}

impl<A, B> Listen for Select<A, B>
where
    A: Listen + Offers + Sync,
    B: Listen + Offers + Sync,
    <B::Listener as Listener>::Connection: ChunnelConnection<
        Data = <<A::Listener as Listener>::Connection as ChunnelConnection>::Data,
    >,
{
    type Listener = Either<A::Listener, B::Listener>;

    /// Listens on the branch [`Select::resolve`] names. When no branch was fixed and the
    /// preferred branch passed its availability check but fails to bind with
    /// [`Error::NotAvailable`] (a program the kernel refuses to attach, say), listens on the
    /// fallback branch instead, or fails with [`Error::NoBranch`] holding both reasons if the
    /// fallback is unavailable too. Any other error of the bound branch is returned as is.
    async fn listen(&self) -> Result<Self::Listener, Error> {
        match self.resolve()? {
            Side::Left => match self.left.listen().await {
                Ok(l) => Ok(Either::Left(l)),
                Err(e @ Error::NotAvailable { .. }) if self.choice.is_none() => {
                    match self.right.available() {
                        Ok(()) => Ok(Either::Right(self.right.listen().await?)),
                        Err(right) => Err(Error::NoBranch {
                            left: Box::new(e),
                            right: Box::new(right),
                        }),
                    }
                }
                Err(e) => Err(e),
            },
            Side::Right => Ok(Either::Right(self.right.listen().await?)),
        }
    }
}

impl<A: Offers, B: Offers> Offers for Select<A, B> {
    fn hash_offers(&self, h: &mut dyn std::hash::Hasher) {
        h.write_u8(crate::negotiate::DIGEST_SELECT);
        self.left.hash_offers(h);
        self.right.hash_offers(h);
    }

    fn offer_tree(&self) -> crate::OfferTree {
        crate::OfferTree::Select(
            Box::new(self.left.offer_tree()),
            Box::new(self.right.offer_tree()),
        )
    }

    fn offers(&self) -> Vec<StackOption> {
        let tag = |side: u8, o: StackOption| StackOption {
            chunnels: o.chunnels,
            pick: Pick::concat(&[&[side], o.pick.branches()]),
        };
        let (left, right) = (self.left.offers(), self.right.offers());
        let mut out = Vec::with_capacity(left.len() + right.len());
        out.extend(left.into_iter().map(|o| tag(0, o)));
        out.extend(right.into_iter().map(|o| tag(1, o)));
        out
    }

    fn available(&self) -> Result<(), Error> {
        self.resolve().map(|_| ())
    }

    fn apply_pick(&mut self, pick: &mut PickReader<'_>) -> Result<(), Error> {
        if pick.next_branch()? == 0 {
            self.choice = Some(Side::Left);
            self.left.apply_pick(pick)
        } else {
            self.choice = Some(Side::Right);
            self.right.apply_pick(pick)
        }
    }
}

/// What a [`Select`] builds: one of two connections carrying the same `Data` (its
/// `connect_wrap`), or one of two listeners whose connections do (its [`Listen::listen`]),
/// which accepts `Either` connections.
#[derive(Debug)]
pub enum Either<L, R> {
    /// Built from the preferred branch.
    Left(L),
    /// Built from the fallback branch.
    Right(R),
}

impl<L, R> Either<L, R> {
    /// Which branch this connection (or listener) came from.
    pub fn side(&self) -> Side {
        match self {
            Either::Left(_) => Side::Left,
            Either::Right(_) => Side::Right,
        }
    }
}

impl<L, R> ChunnelConnection for Either<L, R>
where
    L: ChunnelConnection,
    R: ChunnelConnection<Data = L::Data>,
{
    type Data = L::Data;

    // The branch's own future, under a tag: nothing of the call is kept twice (an `async`
    // body would keep its arguments besides the branch's future).
    fn send<Bu>(&self, burst: Bu) -> impl Future<Output = Result<(), Error>> + Send
    where
        Bu: IntoIterator<Item = Self::Data> + Send,
        Bu::IntoIter: Send,
    {
        match self {
            Either::Left(c) => EitherFuture::Left(c.send(burst)),
            Either::Right(c) => EitherFuture::Right(c.send(burst)),
        }
    }

    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Self::Data>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        match self {
            Either::Left(c) => EitherFuture::Left(c.recv(slots)),
            Either::Right(c) => EitherFuture::Right(c.recv(slots)),
        }
    }
}

impl<L, R> Listener for Either<L, R>
where
    L: Listener,
    R: Listener,
    R::Connection: ChunnelConnection<Data = <L::Connection as ChunnelConnection>::Data>,
{
    type Connection = Either<L::Connection, R::Connection>;

    async fn accept(&mut self) -> Result<Self::Connection, Error> {
        match self {
            Either::Left(l) => l.accept().await.map(Either::Left),
            Either::Right(r) => r.accept().await.map(Either::Right),
        }
    }

    fn accepting_in_loop(&mut self) {
        match self {
            Either::Left(l) => l.accepting_in_loop(),
            Either::Right(r) => r.accepting_in_loop(),
        }
    }

    fn recognise_sessions(&mut self, session_of: fn(&[u8]) -> Option<u64>) {
        match self {
            Either::Left(l) => l.recognise_sessions(session_of),
            Either::Right(r) => r.recognise_sessions(session_of),
        }
    }
}

/// One of two futures with the same output, chosen when it is made: the future of a call
/// that goes one of two ways, as small as the larger of the two (plus a tag).
///
/// ```
/// use chunnel::EitherFuture;
/// let f: EitherFuture<_, std::future::Ready<u8>> = EitherFuture::Left(async { 7u8 });
/// # let _ = f;
/// ```
#[derive(Debug)]
pub enum EitherFuture<L, R> {
    /// The first way.
    Left(L),
    /// The second way.
    Right(R),
}

impl<L, R> Future for EitherFuture<L, R>
where
    L: Future,
    R: Future<Output = L::Output>,
{
    type Output = L::Output;

    #[inline]
    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        // SAFETY: structural pinning of the variant's future: it is never moved out of a
        // pinned `EitherFuture` (no method takes it out, and there is no `Drop` impl or
        // unconditional `Unpin` impl that could), so pinning the whole pins the part.
        unsafe {
            match self.get_unchecked_mut() {
                EitherFuture::Left(f) => std::pin::Pin::new_unchecked(f).poll(cx),
                EitherFuture::Right(f) => std::pin::Pin::new_unchecked(f).poll(cx),
            }
        }
    }
}
