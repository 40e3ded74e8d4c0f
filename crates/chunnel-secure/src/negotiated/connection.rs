//! [`Connection`]: a negotiated connection over the datapath the server picked.
//!
//! On the server, the BOUND that agrees to a BIND or REBIND (docs/wire.md §16) is not sent on
//! its own: it waits in the connection and goes out in the same write as the application's
//! first reply, so a request/response exchange costs no extra packet. It never waits long:
//! a `recv` that would block sends it first (the client waits for it before it sends more),
//! and the server sends it [`BOUND_DELAY`] after handing the connection to `accept` if the
//! application has done neither by then.

use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use chunnel::ChunnelConnection;

use crate::{quic, tls};

use super::Transport;

/// The longest a server holds an agreeing BOUND back for the application's first reply.
pub const BOUND_DELAY: Duration = Duration::from_millis(1);

/// The datapath under a negotiated [`Connection`].
#[derive(Debug)]
pub enum Link {
    /// QUIC (stream mode).
    Quic(quic::Connection),
    /// TLS 1.3 over TCP.
    Tls(tls::Connection),
    /// Plaintext TCP.
    Plain(chunnel_net::tcp::Connection),
}

impl Link {
    /// The transport of this datapath.
    pub fn transport(&self) -> Transport {
        match self {
            Link::Quic(_) => Transport::Quic,
            Link::Tls(_) => Transport::Tls,
            Link::Plain(_) => Transport::Plain,
        }
    }
}

impl ChunnelConnection for Link {
    type Data = Bytes;

    #[allow(clippy::manual_async_fn)]
    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), chunnel::Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        async move {
            match self {
                Link::Quic(c) => c.send(burst).await,
                Link::Tls(c) => c.send(burst).await,
                Link::Plain(c) => c.send(burst).await,
            }
        }
    }

    #[allow(clippy::manual_async_fn)]
    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Bytes>],
    ) -> impl Future<Output = Result<usize, chunnel::Error>> + Send + 'a {
        async move {
            match self {
                Link::Quic(c) => c.recv(slots).await,
                Link::Tls(c) => c.recv(slots).await,
                Link::Plain(c) => c.recv(slots).await,
            }
        }
    }
}

#[derive(Debug)]
struct Shared {
    link: Link,
    /// Set while `bound` may hold a message that must precede everything else this end
    /// sends; cleared once it is on the wire.
    pending: AtomicBool,
    bound: tokio::sync::Mutex<Option<Bytes>>,
}

impl Shared {
    /// Sends the held BOUND (if still held) ahead of `burst`; `Ok(None)` if it had gone
    /// already, with `burst` handed back untouched.
    async fn send_behind_bound<B>(&self, burst: B) -> Result<Option<B>, chunnel::Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        // Held across the write, so that no other send overtakes the BOUND.
        let mut slot = self.bound.lock().await;
        let Some(bound) = slot.take() else {
            self.pending.store(false, Ordering::Release);
            return Ok(Some(burst));
        };
        let r = self.link.send(std::iter::once(bound).chain(burst)).await;
        self.pending.store(false, Ordering::Release);
        r.map(|()| None)
    }

    async fn flush(&self) -> Result<(), chunnel::Error> {
        self.send_behind_bound(std::iter::empty()).await.map(drop)
    }
}

/// A negotiated connection: the datapath the server picked.
#[derive(Debug)]
pub struct Connection {
    shared: Arc<Shared>,
}

impl Connection {
    pub(super) fn new(link: Link) -> Self {
        Connection {
            shared: Arc::new(Shared {
                link,
                pending: AtomicBool::new(false),
                bound: tokio::sync::Mutex::new(None),
            }),
        }
    }

    /// Holds `bound` back until the first send, a `recv` that would block, or
    /// [`Connection::flush_bound`]. Called before anyone else can use the connection.
    pub(super) fn hold_bound(&self, bound: Bytes) {
        if let Ok(mut slot) = self.shared.bound.try_lock() {
            *slot = Some(bound);
            self.shared.pending.store(true, Ordering::Release);
        }
    }

    /// A handle that sends a held BOUND later without keeping the connection alive.
    pub(super) fn bound_flusher(&self) -> BoundFlusher {
        BoundFlusher(Arc::downgrade(&self.shared))
    }

    /// The transport this connection runs on.
    pub fn transport(&self) -> Transport {
        self.shared.link.transport()
    }

    /// The datapath (its peer address, session details, the quinn connection).
    pub fn link(&self) -> &Link {
        &self.shared.link
    }

    fn holds_bound(&self) -> bool {
        self.shared.pending.load(Ordering::Acquire)
    }
}

/// Sends a connection's held BOUND if the application has not caused it to go yet.
pub(super) struct BoundFlusher(Weak<Shared>);

impl BoundFlusher {
    pub(super) async fn flush(self) {
        if let Some(s) = self.0.upgrade()
            && s.pending.load(Ordering::Acquire)
        {
            // A failure here is the connection's: the application sees it on its next call.
            let _ = s.flush().await;
        }
    }
}

impl ChunnelConnection for Connection {
    type Data = Bytes;

    #[allow(clippy::manual_async_fn)]
    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), chunnel::Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        async move {
            if self.holds_bound() {
                match self.shared.send_behind_bound(burst).await? {
                    None => return Ok(()),
                    Some(burst) => return self.shared.link.send(burst).await,
                }
            }
            self.shared.link.send(burst).await
        }
    }

    #[allow(clippy::manual_async_fn)]
    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Bytes>],
    ) -> impl Future<Output = Result<usize, chunnel::Error>> + Send + 'a {
        async move {
            if !self.holds_bound() {
                return self.shared.link.recv(slots).await;
            }
            // What already arrived (the messages behind the BIND) is returned without
            // sending the BOUND: the reply will carry it. A receive that would wait sends it
            // first, as the peer may be waiting for it.
            let mut received = pin!(self.shared.link.recv(slots));
            let first = std::future::poll_fn(|cx| Poll::Ready(received.as_mut().poll(cx))).await;
            if let Poll::Ready(r) = first {
                return r;
            }
            self.shared.flush().await?;
            received.await
        }
    }
}
