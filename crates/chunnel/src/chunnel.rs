//! The Chunnel trait: build a connection from an inner one.

use std::future::Future;

use crate::{ChunnelConnection, Error};

/// A communication function that turns an inner connection `I` into a new connection.
///
/// This is the paper's `ChunnelTransformer<R>` (Listing 2) and tower's `Layer`. Base datapaths
/// (sockets) implement `Chunnel<()>`: they build a connection from nothing. Every other Chunnel
/// is generic over the inner connection and states, through its bounds, which `Data` it needs
/// below it; a stack whose types do not line up fails to compile.
///
/// `connect_wrap` is also where a layer does its connection set-up (handshakes, state).
///
/// ```
/// use chunnel::{Chunnel, ChunnelConnection, Error};
/// # use std::future::Future;
///
/// /// Counts the messages it sends (a toy transform).
/// #[derive(Clone, Default)]
/// struct Count;
///
/// struct CountConn<C> { inner: C, sent: std::sync::atomic::AtomicU64 }
///
/// impl<C: ChunnelConnection> Chunnel<C> for Count {
///     type Connection = CountConn<C>;
///     async fn connect_wrap(&mut self, inner: C) -> Result<Self::Connection, Error> {
///         Ok(CountConn { inner, sent: Default::default() })
///     }
/// }
///
/// impl<C: ChunnelConnection> ChunnelConnection for CountConn<C> {
///     type Data = C::Data;
///     fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
///     where B: IntoIterator<Item = C::Data> + Send, B::IntoIter: Send {
///         let sent = &self.sent;
///         self.inner.send(burst.into_iter().inspect(move |_| {
///             sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
///         }))
///     }
///     fn recv<'a>(&'a self, slots: &'a mut [Option<C::Data>])
///         -> impl Future<Output = Result<usize, Error>> + Send + 'a {
///         self.inner.recv(slots)
///     }
/// }
/// ```
pub trait Chunnel<I> {
    /// The connection this Chunnel produces over `I`.
    type Connection: ChunnelConnection;

    /// Wraps `inner` with this Chunnel's functionality.
    fn connect_wrap(
        &mut self,
        inner: I,
    ) -> impl Future<Output = Result<Self::Connection, Error>> + Send;
}

/// The server side of a datapath's configuration: what `Chunnel<()>` is to a client, binding
/// instead of connecting.
///
/// A datapath's bind config (an address and its options) implements this; `listen` binds it
/// and returns the [`Listener`] that hands out the base connection of each new peer. A
/// [`Select`](crate::Select) of two bind configs listens on the first available branch, in
/// preference order, like `Chunnel<()>`'s select connects: a preferred branch that reports
/// [`Error::NotAvailable`] (at its availability check or when it binds) leaves the fallback
/// bound, and the listener is an [`Either`](crate::Either) of the two.
///
/// ```
/// use chunnel::{select, Error, Listen, Listener, Negotiate, Side};
///
/// /// A bind config that is unavailable on this host.
/// struct Fast;
/// impl Negotiate for Fast {
///     fn id(&self) -> &'static str { "doc/fast/1" }
///     fn check_available(&self) -> Result<(), Error> {
///         Err(Error::NotAvailable { chunnel: "doc/fast/1", reason: "no hardware".into() })
///     }
/// }
/// # struct Never;
/// # impl Listener for Never {
/// #     type Connection = chunnel::BoxConnection<u8>;
/// #     async fn accept(&mut self) -> Result<Self::Connection, Error> { Err(Error::Closed) }
/// # }
/// impl Listen for Fast {
///     type Listener = Never;
///     async fn listen(&self) -> Result<Never, Error> { Ok(Never) }
/// }
///
/// /// A bind config that always binds.
/// struct Plain;
/// impl Negotiate for Plain {
///     fn id(&self) -> &'static str { "doc/plain/1" }
/// }
/// impl Listen for Plain {
///     type Listener = Never;
///     async fn listen(&self) -> Result<Never, Error> { Ok(Never) }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Error> {
/// let listener = select(Fast, Plain).listen().await?;
/// assert_eq!(listener.side(), Side::Right); // the fallback was bound
/// # Ok(()) }
/// ```
pub trait Listen {
    /// The listener a successful `listen` returns.
    type Listener: Listener;

    /// Binds this configuration and starts listening.
    fn listen(&self) -> impl Future<Output = Result<Self::Listener, Error>> + Send;
}

/// A source of incoming base connections: the server side of a datapath.
///
/// A listener plays the role a `Chunnel<()>`'s connection plays on the client: it produces
/// the connection at the bottom of a stack. [`Listen::listen`] makes one from a bind config;
/// [`Serve`](crate::Serve) applies the rest of a stack to every accepted connection.
pub trait Listener: Send {
    /// The base connection handed out for each new peer.
    type Connection: ChunnelConnection;

    /// Waits for the next peer.
    ///
    /// The datapath listeners are cancel safe: a peer that arrives while the future is dropped
    /// is handed out by the next call. [`Serve`](crate::Serve) is not once a base connection was accepted and
    /// its stack is being built (dropping then drops that connection).
    fn accept(&mut self) -> impl Future<Output = Result<Self::Connection, Error>> + Send;

    /// The caller's promise that `accept` is called in a loop from now on, by a task that
    /// does little else between calls than hand each connection on, until the listener is
    /// dropped. A listener may then keep waiting for the network between calls: the
    /// datagram listeners of `chunnel-net` keep the reader role (being the task that reads
    /// the socket for every connection), so a new peer's first datagram wakes the accepting
    /// task directly (otherwise a waiting connection would read it and wake that task).
    /// Breaking the promise delays connections waiting to receive until the next `accept`
    /// call or the drop. Default: nothing.
    fn accepting_in_loop(&mut self) {}

    /// Tells the listener how to recognise a message that starts a session: `session_of`
    /// returns the session's id for such a message (negotiation: a HELLO's connection id)
    /// and `None` for any other. A datagram listener then treats a datagram from a known
    /// address that starts *another* session than the one that address started as a new
    /// peer: the old connection ends (its `recv` reports [`Error::PeerClosed`] after what it
    /// had queued) and `accept` hands out a new one, whether or not anybody reads the old one
    /// (a client that restarts on the same local port is answered). Must be cheap: it sees
    /// every datagram queued for a known peer. Default: nothing.
    fn recognise_sessions(&mut self, _session_of: fn(&[u8]) -> Option<u64>) {}
}
