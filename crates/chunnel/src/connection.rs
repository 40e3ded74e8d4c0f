//! The connection trait: batched, asynchronous `send` and `recv` of a typed `Data`.

use std::future::Future;

use crate::Error;

/// A connection produced by a Chunnel: it sends and receives messages of type [`Self::Data`]
/// in batches.
///
/// This is the paper's `ChunnelDatapath` (Listing 2). Both methods take `&self` so that many
/// tasks may send and receive on one connection at once; implementations synchronise internally.
///
/// # Batching
///
/// `send` takes a whole burst; `recv` fills caller-provided slots and returns how many it
/// filled. Datapaths turn a burst into as few system calls as they can (UDP uses
/// `sendmmsg`/`recvmmsg`), and layers above pass bursts through without collecting them.
///
/// # Zero-cost composition
///
/// The methods return `impl Future`, so a stack of layers compiles to one nested state machine:
/// no boxed future and no allocation per message. Use [`crate::BoxConnection`] only where
/// dynamic dispatch is wanted.
///
/// # Cancel safety
///
/// `recv` must be cancel safe: if its future is dropped before completing, no message is lost
/// (messages already read from the network stay buffered in the connection). `send` must not
/// corrupt the connection when cancelled; a burst whose future was dropped may have been sent
/// in part. Each implementation documents anything stronger.
pub trait ChunnelConnection: Send + Sync {
    /// The type of the messages this connection carries.
    type Data: Send;

    /// Sends every message of `burst`, in order.
    ///
    /// Fails with [`Error::MessageTooLarge`] (nothing of the burst from that message on is
    /// sent) if a message does not fit, or with [`Error::PeerClosed`]/[`Error::Closed`] once
    /// the connection is gone.
    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = Self::Data> + Send,
        B::IntoIter: Send;

    /// Waits for at least one message, then writes up to `slots.len()` messages into
    /// `slots[0..n]` and returns `n` (`n >= 1` unless `slots` is empty).
    ///
    /// Slots past `n` are left as they were.
    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Self::Data>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a;
}

/// Convenience methods for single messages. Implemented for every [`ChunnelConnection`].
pub trait ConnectionExt: ChunnelConnection {
    /// Sends one message.
    fn send_one(&self, msg: Self::Data) -> impl Future<Output = Result<(), Error>> + Send {
        self.send(std::iter::once(msg))
    }

    /// Receives one message.
    fn recv_one(&self) -> impl Future<Output = Result<Self::Data, Error>> + Send {
        async move {
            let mut slot = [None];
            loop {
                let n = self.recv(&mut slot).await?;
                if n > 0
                    && let Some(m) = slot[0].take()
                {
                    return Ok(m);
                }
            }
        }
    }
}

impl<C: ChunnelConnection + ?Sized> ConnectionExt for C {}

impl<C: ChunnelConnection + ?Sized> ChunnelConnection for std::sync::Arc<C> {
    type Data = C::Data;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = Self::Data> + Send,
        B::IntoIter: Send,
    {
        (**self).send(burst)
    }

    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Self::Data>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        (**self).recv(slots)
    }
}

/// A byte connection that can put a short header in front of every message of a burst
/// without copying the messages: a second `iovec` per datagram on datagram sockets, the
/// frame's first bytes on stream sockets.
///
/// Layers that tag messages (negotiation, reconfiguration control) use this so that tagging
/// costs no allocation and no copy of the payload. The header counts against the datapath's
/// maximum message size.
pub trait SendHeader: ChunnelConnection<Data = bytes::Bytes> {
    /// Sends every message of `burst` with `header` in front of it.
    fn send_with_header<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a
    where
        B: IntoIterator<Item = bytes::Bytes> + Send + 'a,
        B::IntoIter: Send;

    /// Sends `msg` with `header` in front of it if that can be done without waiting;
    /// `None` if it cannot (the connection would have to wait, or sends only through
    /// `send_with_header`): the caller then sends with `send_with_header`. Lets a layer with
    /// a one-off send (a held handshake answer in front of the first reply) do it without
    /// building a future for it. The default is `None`.
    fn try_send_with_header(
        &self,
        _header: &[u8],
        _msg: &bytes::Bytes,
    ) -> Option<Result<(), Error>> {
        None
    }
}

impl<C: SendHeader + ?Sized> SendHeader for std::sync::Arc<C> {
    fn send_with_header<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a
    where
        B: IntoIterator<Item = bytes::Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        (**self).send_with_header(header, burst)
    }

    fn try_send_with_header(&self, header: &[u8], msg: &bytes::Bytes) -> Option<Result<(), Error>> {
        (**self).try_send_with_header(header, msg)
    }
}

/// A server-side connection demultiplexed from a shared listener socket by peer address
/// (UDP, Unix datagrams), where one address can be reused by a new, unrelated client (a
/// reused ephemeral port) while the old connection's state still lives.
///
/// A layer that can tell the new client apart (negotiation sees a new connection id) calls
/// [`PeerHandoff::hand_off`]: this connection ends and `first` is presented to the listener
/// as the first message of a new connection, so the new client is not starved until an idle
/// timeout frees the address. Connections that own their transport (TCP, Unix streams)
/// never need this and return `false`.
pub trait PeerHandoff {
    /// Ends this connection and hands `first` to the listener as a new connection's first
    /// message. Returns whether that happened.
    fn hand_off(&self, first: bytes::Bytes) -> bool;

    /// The oldest message that has already arrived for this connection, taken without
    /// waiting; `None` if there is none, or if the connection cannot tell (the default).
    /// A listener's connection usually starts with its first message queued: negotiation
    /// reads the hello this way, without setting up a receive. A wrapper that acts on what
    /// is received (a fault injector, say) keeps the default, so every message goes through
    /// its `recv`.
    fn take_queued(&self) -> Option<bytes::Bytes> {
        None
    }

    /// Ends this connection at once, because a layer above learned that it is over (its
    /// peer said so, or this side closed it): later calls fail with [`Error::Closed`], and
    /// state a listener keeps for this peer is freed now, not at an idle timeout (a datagram
    /// the peer sends afterwards starts a new connection). The default does nothing: the
    /// connection is freed when it is dropped.
    fn release(&self) {}

    /// The latest message that arrived for this connection but was larger than it takes,
    /// taken without waiting; `None` if there was none since the last call, or if the
    /// connection cannot tell (the default). A datagram listener that reports these keeps
    /// only the datagram's first bytes ([`Oversized::prefix`]), so a layer above can still
    /// answer it (negotiation refuses a too-large hello by its first 11 bytes) instead of
    /// the peer's message vanishing without a word.
    fn take_oversized(&self) -> Option<Oversized> {
        None
    }

    /// Marks this connection as not having received anything valid yet (`true`: a layer
    /// above is still waiting for its first valid message) or as past that (`false`). A
    /// datagram listener at its peer cap may end a connection so marked (its next `recv`
    /// reports [`Error::PeerClosed`]) to admit a new peer. The default does nothing.
    fn mark_silent(&self, _silent: bool) {}

    /// Whether the listener holding this connection is short of room for new peers (a
    /// datagram listener over half its peer cap): a layer still waiting for this
    /// connection's first valid message should give up soon rather than hold the room for
    /// its full timeout. `false` (the default) when the connection cannot tell.
    fn crowded(&self) -> bool {
        false
    }
}

/// A message too large for the connection that received it: what is kept of it (see
/// [`PeerHandoff::take_oversized`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Oversized {
    /// The message's first bytes (at most [`Oversized::PREFIX`]).
    pub prefix: bytes::Bytes,
    /// The message's whole length in bytes, as the transport reported it (more than
    /// `limit`).
    pub len: usize,
    /// The largest message the connection takes.
    pub limit: usize,
}

impl Oversized {
    /// Most bytes of an oversized message kept.
    pub const PREFIX: usize = 32;
}

impl<C: PeerHandoff + ?Sized> PeerHandoff for std::sync::Arc<C> {
    fn hand_off(&self, first: bytes::Bytes) -> bool {
        (**self).hand_off(first)
    }

    fn take_queued(&self) -> Option<bytes::Bytes> {
        (**self).take_queued()
    }

    fn release(&self) {
        (**self).release()
    }

    fn take_oversized(&self) -> Option<Oversized> {
        (**self).take_oversized()
    }

    fn mark_silent(&self, silent: bool) {
        (**self).mark_silent(silent)
    }

    fn crowded(&self) -> bool {
        (**self).crowded()
    }
}
