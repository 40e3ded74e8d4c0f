//! State transfer: what a connection hands to the connection that replaces it.

use std::any::Any;
use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

use crate::{BoxConnection, ChunnelConnection, Either, NoopConnection};

/// The state a connection hands to its replacement at a switch point: messages it received
/// but did not deliver yet, and a type-keyed bag of Chunnel-specific state (sequence numbers,
/// known peers...).
///
/// State transfer happens once per switch, off the data path, so the bag boxes its entries.
/// A Chunnel defines its own state type (`struct SeqState { next: u64 }`), `put`s it in
/// [`Handover::export`] and `take`s it in [`Handover::import`]; entries nobody takes are
/// dropped. A layer that replaces its inner layers too can carry their `Handoff` (of their own
/// `Data` type) as one entry of its bag.
///
/// ```
/// use chunnel::Handoff;
/// #[derive(Debug, PartialEq)]
/// struct NextSeq(u64);
/// let mut h: Handoff<u32> = Handoff::new();
/// h.put(NextSeq(7));
/// h.buffered.push_back(1);
/// assert_eq!(h.take::<NextSeq>(), Some(NextSeq(7)));
/// assert_eq!(h.take::<NextSeq>(), None);
/// ```
pub struct Handoff<D> {
    /// Received but undelivered messages, oldest first. The reconfigurable connection delivers
    /// them from its `recv` before anything the new implementation receives.
    pub buffered: VecDeque<D>,
    bag: Vec<Box<dyn Any + Send>>,
}

impl<D> Default for Handoff<D> {
    fn default() -> Self {
        Handoff {
            buffered: VecDeque::new(),
            bag: Vec::new(),
        }
    }
}

impl<D> fmt::Debug for Handoff<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handoff")
            .field("buffered", &self.buffered.len())
            .field("entries", &self.bag.len())
            .finish()
    }
}

impl<D> Handoff<D> {
    /// An empty hand-off.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores `value`, replacing (and returning) an entry of the same type.
    pub fn put<T: Any + Send>(&mut self, value: T) -> Option<T> {
        let old = self.take::<T>();
        self.bag.push(Box::new(value));
        old
    }

    /// Removes and returns the entry of type `T`, if any.
    pub fn take<T: Any + Send>(&mut self) -> Option<T> {
        let i = self.bag.iter().position(|b| b.is::<T>())?;
        self.bag.swap_remove(i).downcast::<T>().ok().map(|b| *b)
    }

    /// Whether an entry of type `T` is present.
    pub fn contains<T: Any + Send>(&self) -> bool {
        self.bag.iter().any(|b| b.is::<T>())
    }

    /// True when there is neither a buffered message nor a state entry.
    pub fn is_empty(&self) -> bool {
        self.buffered.is_empty() && self.bag.is_empty()
    }
}

/// A connection that can hand its state to a replacement (paper §4.1, step ②).
///
/// Required of both branches of a [`crate::Reconfigurable`] select. Both methods are
/// required: a connection states what it hands over, and a stateless one says so with empty
/// bodies, so no branch loses buffered messages at a switch by default. A connection type
/// without an implementation cannot be a branch (the select does not compile).
///
/// `export` is called exactly once, at the switch point, when no task is inside any method of
/// this connection and none ever will be again; it must move out everything a successor
/// needs, in particular messages it already took from the layer below but did not deliver
/// (into [`Handoff::buffered`]), or they are lost. A connection with a background task stops
/// it here. `import` is called on the new connection before any task uses it. Neither may
/// block; neither sees bytes from the network.
///
/// ```
/// use chunnel::{ChunnelConnection, Error, Handoff, Handover};
///
/// /// Delivers nothing, buffers nothing.
/// struct Sink;
///
/// impl ChunnelConnection for Sink {
///     type Data = u32;
///     async fn send<B>(&self, _burst: B) -> Result<(), Error>
///     where
///         B: IntoIterator<Item = u32> + Send,
///         B::IntoIter: Send,
///     {
///         Ok(())
///     }
///     async fn recv<'a>(&'a self, _slots: &'a mut [Option<u32>]) -> Result<usize, Error> {
///         std::future::pending().await
///     }
/// }
///
/// /// Stateless: nothing is buffered between calls.
/// impl Handover for Sink {
///     fn export(&self, _: &mut Handoff<u32>) {}
///     fn import(&self, _: &mut Handoff<u32>) {}
/// }
/// ```
pub trait Handover: ChunnelConnection {
    /// Moves this connection's state into `state`.
    fn export(&self, state: &mut Handoff<Self::Data>);

    /// Takes over the state a predecessor exported. Unknown entries are to be ignored.
    fn import(&self, state: &mut Handoff<Self::Data>);
}

impl<C: Handover + ?Sized> Handover for Arc<C> {
    fn export(&self, state: &mut Handoff<Self::Data>) {
        (**self).export(state)
    }

    fn import(&self, state: &mut Handoff<Self::Data>) {
        (**self).import(state)
    }
}

impl<C: Handover> Handover for NoopConnection<C> {
    fn export(&self, state: &mut Handoff<Self::Data>) {
        self.get_ref().export(state)
    }

    fn import(&self, state: &mut Handoff<Self::Data>) {
        self.get_ref().import(state)
    }
}

/// A boxed connection carries no transferable state (its type is erased).
impl<D: Send + 'static> Handover for BoxConnection<D> {
    fn export(&self, _: &mut Handoff<D>) {}
    fn import(&self, _: &mut Handoff<D>) {}
}

impl<L, R> Handover for Either<L, R>
where
    L: Handover,
    R: Handover<Data = L::Data>,
{
    fn export(&self, state: &mut Handoff<Self::Data>) {
        match self {
            Either::Left(c) => c.export(state),
            Either::Right(c) => c.export(state),
        }
    }

    fn import(&self, state: &mut Handoff<Self::Data>) {
        match self {
            Either::Left(c) => c.import(state),
            Either::Right(c) => c.import(state),
        }
    }
}
