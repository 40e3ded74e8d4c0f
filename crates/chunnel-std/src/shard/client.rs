//! Client push: [`ClientShard`] and its connection, which send each message straight to its
//! shard's socket and merge the replies.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::Poll;

use chunnel::{Capability, Chunnel, ChunnelConnection, Negotiate};
use tokio::sync::Notify;

use crate::Error;

use super::directory::ShardDirectory;
use super::merge::Merge;
use super::*;

/// The client-push sharding Chunnel (client side): over a typed connection to the canonical
/// address, a connection that sends each message straight to its shard's socket.
///
/// `dial` opens a base connection to a shard address, `per_shard` is the stack applied to it
/// (the same one the server's shards run). The Chunnel is available unless disabled with
/// [`ClientShard::enabled`]: a select then offers only its other branch.
#[derive(Clone)]
pub struct ClientShard<D, S> {
    dial: D,
    per_shard: S,
    dir: ShardDirectory,
    enabled: bool,
    cfg: Config,
}

impl<D, S> fmt::Debug for ClientShard<D, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientShard")
            .field("dir", &self.dir)
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

impl<D, S> ClientShard<D, S> {
    /// Client push with its own, empty [`ShardDirectory`].
    pub fn new(dial: D, per_shard: S) -> Self {
        ClientShard {
            dial,
            per_shard,
            dir: ShardDirectory::new(),
            enabled: true,
            cfg: Config::default(),
        }
    }

    /// The directory its connections read the shard set from.
    pub fn directory(&self) -> ShardDirectory {
        self.dir.clone()
    }

    /// Enables or disables this branch (a disabled one is never offered).
    pub fn enabled(mut self, on: bool) -> Self {
        self.enabled = on;
        self
    }

    /// Uses `cfg` instead of the default.
    pub fn with_config(mut self, cfg: Config) -> Self {
        self.cfg = cfg;
        self
    }
}

impl<D, S> Negotiate for ClientShard<D, S> {
    fn id(&self) -> &'static str {
        CLIENT_ID
    }

    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::exact(CAPABILITY, [CLIENT_PUSH, HASH_LABEL])]
    }

    fn check_available(&self) -> Result<(), chunnel::Error> {
        if self.enabled {
            Ok(())
        } else {
            Err(chunnel::Error::NotAvailable {
                chunnel: CLIENT_ID,
                reason: "client-push sharding is disabled".into(),
            })
        }
    }
}

impl<C, D, S, T> Chunnel<C> for ClientShard<D, S>
where
    C: ChunnelConnection<Data = T> + 'static,
    T: Keyed + Send + 'static,
    D: Dial,
    S: Chunnel<D::Conn> + Clone + Send + Sync + 'static,
    S::Connection: ChunnelConnection<Data = T> + 'static,
{
    type Connection = ClientShardConn<C, D, S>;

    async fn connect_wrap(&mut self, inner: C) -> Result<Self::Connection, chunnel::Error> {
        let inner = Arc::new(inner);
        let merge = Merge::new(self.cfg.merge_queue, self.cfg.batch);
        // Whatever the canonical address sends is delivered too.
        merge.pump(Arc::clone(&inner));
        Ok(ClientShardConn {
            inner,
            dial: self.dial.clone(),
            per_shard: self.per_shard.clone(),
            dir: self.dir.clone(),
            shards: tokio::sync::OnceCell::new(),
            dialled: Notify::new(),
            announced: AtomicBool::new(false),
            turn: AtomicUsize::new(0),
            merge,
        })
    }
}

/// Shard connections a [`ClientShardConn`]'s `recv` reads itself; replies of further shards
/// (and whatever the canonical address sends) come through the merge queue.
pub(super) const DIRECT: usize = 4;

/// A client-push connection (see [`ClientShard`]). Shards are dialled on the first `send`;
/// `recv` is cancel safe and delivers the replies of every shard and anything from the
/// canonical address. It reads the first `DIRECT` (4) shard connections itself, each with a
/// share of the caller's slots, so a reply reaches the caller with no task in between; a task
/// per further shard, and one for the canonical connection, moves their messages into one
/// bounded queue that `recv` reads as well.
pub struct ClientShardConn<C: ChunnelConnection, D: Dial, S: Chunnel<D::Conn>> {
    inner: Arc<C>,
    dial: D,
    per_shard: S,
    dir: ShardDirectory,
    shards: tokio::sync::OnceCell<Vec<Arc<S::Connection>>>,
    /// Wakes receivers that started before the shards were dialled.
    dialled: Notify,
    /// Whether `dialled` was notified.
    announced: AtomicBool,
    /// Which source a `recv` polls first (rotates, so no shard starves another).
    turn: AtomicUsize,
    merge: Merge<C::Data>,
}

impl<C, D, S> fmt::Debug for ClientShardConn<C, D, S>
where
    C: ChunnelConnection,
    D: Dial,
    S: Chunnel<D::Conn>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientShardConn")
            .field("dir", &self.dir)
            .field("dialled", &self.shards.initialized())
            .finish_non_exhaustive()
    }
}

impl<C, D, S, T> ClientShardConn<C, D, S>
where
    C: ChunnelConnection<Data = T> + 'static,
    T: Keyed + Send + 'static,
    D: Dial,
    S: Chunnel<D::Conn> + Clone + Send + Sync + 'static,
    S::Connection: ChunnelConnection<Data = T> + 'static,
{
    /// The connection to the canonical address.
    pub fn canonical(&self) -> &C {
        &self.inner
    }

    /// The shard connections, dialled on first use.
    async fn shards(&self) -> Result<&[Arc<S::Connection>], chunnel::Error> {
        // Every send and receive asks: once dialled and announced, no initialising future.
        if let Some(v) = self.shards.get()
            && self.announced.load(Ordering::Acquire)
        {
            return Ok(v);
        }
        // Boxed: dialling is a large future that runs once per connection. Inline, it made
        // every send's and receive's future that large, and futures are moved (copied) when
        // they are created.
        Box::pin(self.dial_shards()).await
    }

    /// Dials the shard connections (once) and announces them.
    async fn dial_shards(&self) -> Result<&[Arc<S::Connection>], chunnel::Error> {
        let v = self
            .shards
            .get_or_try_init(|| async {
                let addrs = self.dir.get().ok_or(Error::ShardSetUnknown)?;
                let mut v = Vec::with_capacity(addrs.len());
                for (i, a) in addrs.iter().enumerate() {
                    let base = self.dial.dial(a).await?;
                    let mut stack = self.per_shard.clone();
                    let c = Arc::new(stack.connect_wrap(base).await?);
                    if i >= DIRECT {
                        self.merge.pump(Arc::clone(&c));
                    }
                    v.push(c);
                }
                Ok::<_, chunnel::Error>(v)
            })
            .await?;
        if !self.announced.load(Ordering::Acquire) && !self.announced.swap(true, Ordering::AcqRel) {
            self.dialled.notify_waiters();
        }
        Ok(v)
    }

    /// Dials the shards if that has not happened yet, and returns how many sources
    /// [`ClientShardConn::recv_from`] reads: the first 4 shard connections, then the merge
    /// queue (replies of further shards and whatever the canonical address sends).
    pub async fn sources(&self) -> Result<usize, chunnel::Error> {
        Ok(self.shards().await?.len().min(DIRECT) + 1)
    }

    /// Receives from one source only (see [`ClientShardConn::sources`]): a caller that
    /// runs one receiving task per source (a client multiplexing many requests) then wakes
    /// and polls only the source that has data, where [`ChunnelConnection::recv`] polls
    /// every source on every call. Messages go to whichever call reads them, so a source
    /// read here and by `recv` at once splits its messages between the two. Cancel safe.
    pub async fn recv_from(
        &self,
        source: usize,
        slots: &mut [Option<T>],
    ) -> Result<usize, chunnel::Error> {
        let shards = self.shards().await?;
        let direct = shards.len().min(DIRECT);
        match source {
            s if s < direct => shards[s].recv(slots).await,
            s if s == direct => self.merge.recv(slots).await,
            s => Err(Error::NoSuchSource {
                index: s,
                sources: direct + 1,
            }
            .into()),
        }
    }

    /// Polls every source at once — the `direct` shard connections and the merge queue —
    /// each into its own part of `buf` (at least one slot per source); the first that yields
    /// wins and its messages are moved to the front. `None`: the shards were dialled while
    /// none was read directly; start over.
    async fn poll_sources(
        &self,
        direct: &[Arc<S::Connection>],
        buf: &mut [Option<T>],
        dialled: Pin<&mut tokio::sync::futures::Notified<'_>>,
    ) -> Option<Result<usize, chunnel::Error>> {
        let mut dialled = dialled;
        // One part per direct shard, the rest (at least as large) for the merge queue.
        let part = buf.len() / (direct.len() + 1);
        debug_assert!(part >= 1);
        let merged_len = buf.len() - part * direct.len();
        let first = self.turn.fetch_add(1, Ordering::Relaxed);
        let won = {
            let (merged, rest) = buf.split_at_mut(merged_len);
            let mut parts = rest.chunks_mut(part.max(1));
            let mut next = |i: usize| {
                let p = parts.next();
                direct.get(i).zip(p).map(|(c, p)| c.recv(p))
            };
            let f0 = next(0);
            let f1 = next(1);
            let f2 = next(2);
            let f3 = next(3);
            let fm = self.merge.recv(merged);
            tokio::pin!(f0, f1, f2, f3, fm);
            std::future::poll_fn(|cx| {
                for k in 0..=DIRECT {
                    let src = (first + k) % (DIRECT + 1);
                    let r = match src {
                        0 => f0.as_mut().as_pin_mut().map(|f| f.poll(cx)),
                        1 => f1.as_mut().as_pin_mut().map(|f| f.poll(cx)),
                        2 => f2.as_mut().as_pin_mut().map(|f| f.poll(cx)),
                        3 => f3.as_mut().as_pin_mut().map(|f| f.poll(cx)),
                        _ => Some(fm.as_mut().poll(cx)),
                    };
                    if let Some(Poll::Ready(r)) = r {
                        return Poll::Ready(Some((src, r)));
                    }
                }
                if direct.is_empty() && dialled.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(None);
                }
                Poll::Pending
            })
            .await
        };
        let (src, r) = won?;
        let n = match r {
            Ok(n) => n,
            Err(e) => return Some(Err(e)),
        };
        let at = if src < DIRECT {
            merged_len + src * part
        } else {
            0
        };
        for j in 0..n {
            buf.swap(j, at + j);
        }
        Some(Ok(n))
    }
}

impl<C, D, S, T> ChunnelConnection for ClientShardConn<C, D, S>
where
    C: ChunnelConnection<Data = T> + 'static,
    T: Keyed + Send + 'static,
    D: Dial,
    S: Chunnel<D::Conn> + Clone + Send + Sync + 'static,
    S::Connection: ChunnelConnection<Data = T> + 'static,
{
    type Data = T;

    async fn send<B>(&self, burst: B) -> Result<(), chunnel::Error>
    where
        B: IntoIterator<Item = T> + Send,
        B::IntoIter: Send,
    {
        let shards = self.shards().await?;
        let n = shards.len();
        let mut it = burst.into_iter();
        let Some(first) = it.next() else {
            return Ok(());
        };
        let Some(second) = it.next() else {
            // The usual request: one message, one shard, no grouping (no allocation).
            return shards[shard_of(first.shard_key(), n)].send([first]).await;
        };
        let mut groups: Vec<Vec<T>> = (0..n).map(|_| Vec::new()).collect();
        for m in [first, second].into_iter().chain(it) {
            groups[shard_of(m.shard_key(), n)].push(m);
        }
        for (c, g) in shards.iter().zip(groups) {
            if !g.is_empty() {
                c.send(g).await?;
            }
        }
        Ok(())
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<T>]) -> Result<usize, chunnel::Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        loop {
            let dialled = self.dialled.notified();
            tokio::pin!(dialled);
            dialled.as_mut().enable();
            let direct: &[Arc<S::Connection>] = match self.shards.get() {
                Some(v) => &v[..v.len().min(DIRECT)],
                None => &[],
            };
            let sources = direct.len() + 1;
            let r = if slots.len() >= sources {
                self.poll_sources(direct, slots, dialled.as_mut()).await
            } else {
                // Fewer slots than sources: one slot each in a buffer of our own; the source
                // that yields fills one, which fits.
                let mut own: [Option<T>; DIRECT + 1] = std::array::from_fn(|_| None);
                let r = self
                    .poll_sources(direct, &mut own[..sources], dialled.as_mut())
                    .await;
                if let Some(Ok(n)) = r {
                    debug_assert!(n <= slots.len());
                    for (s, m) in slots.iter_mut().zip(own[..n].iter_mut()) {
                        *s = m.take();
                    }
                }
                r
            };
            if let Some(r) = r {
                return r;
            }
        }
    }
}

/// At a switch away from client push (a [`chunnel::Reconfigurable`] select of [`ClientShard`]
/// and [`ViaCanonical`]): stops the tasks that pump the canonical connection (and shards past
/// the fourth) into the merge queue and hands over the replies already queued there. Replies
/// still in the shard sockets go with them (the transports are best effort; a client that
/// retries, as chunnel-kv's does, asks again). Nothing to import: a new connection starts
/// with no shard dialled.
impl<C, D, S, T> chunnel::Handover for ClientShardConn<C, D, S>
where
    C: ChunnelConnection<Data = T> + 'static,
    T: Keyed + Send + 'static,
    D: Dial,
    S: Chunnel<D::Conn> + Clone + Send + Sync + 'static,
    S::Connection: ChunnelConnection<Data = T> + 'static,
{
    fn export(&self, state: &mut chunnel::Handoff<T>) {
        self.merge.stop_into(&mut state.buffered);
    }

    fn import(&self, _: &mut chunnel::Handoff<T>) {}
}
