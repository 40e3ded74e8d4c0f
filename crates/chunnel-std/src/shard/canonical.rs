//! Server-side sharding: [`Canonical`], the canonical address's Chunnel that forwards each
//! request to its shard (and advertises the shard set for client push), and [`ViaCanonical`],
//! the client's pass-through branch.

use std::fmt;
use std::sync::Arc;

use chunnel::{Capability, Chunnel, ChunnelConnection, Negotiate};
use tokio::sync::mpsc;

use super::directory::advertisement;
use super::server::{Job, ShardStats, forward};
use super::*;

/// The server's canonical sharding Chunnel over a typed connection to one client (built by
/// [`ShardServer::advertise`] or [`ShardServer::forward`]; see the [module docs](super)).
pub struct Canonical<T> {
    pub(super) jobs: Arc<[mpsc::Sender<Job<T>>]>,
    pub(super) advertise: Option<Arc<[String]>>,
    pub(super) stats: Arc<ShardStats>,
    pub(super) cfg: Config,
}

impl<T> Clone for Canonical<T> {
    fn clone(&self) -> Self {
        Canonical {
            jobs: Arc::clone(&self.jobs),
            advertise: self.advertise.clone(),
            stats: Arc::clone(&self.stats),
            cfg: self.cfg,
        }
    }
}

impl<T> fmt::Debug for Canonical<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Canonical")
            .field("shards", &self.jobs.len())
            .field("advertise", &self.advertise)
            .finish_non_exhaustive()
    }
}

impl<T> Negotiate for Canonical<T> {
    fn id(&self) -> &'static str {
        CANONICAL_ID
    }

    fn capabilities(&self) -> Vec<Capability> {
        match &self.advertise {
            Some(addrs) => vec![advertisement(addrs)],
            None => vec![Capability::compositional(CAPABILITY, [SERVER_SIDE])],
        }
    }
}

impl<C, T> Chunnel<C> for Canonical<T>
where
    C: ChunnelConnection<Data = T>,
    T: Keyed + Send + 'static,
{
    type Connection = CanonicalConn<C, T>;

    async fn connect_wrap(&mut self, inner: C) -> Result<Self::Connection, chunnel::Error> {
        let (tx, rx) = mpsc::channel(self.cfg.reply_queue.max(1));
        Ok(CanonicalConn {
            inner,
            jobs: Arc::clone(&self.jobs),
            tx,
            rx: tokio::sync::Mutex::new(rx),
            stats: Arc::clone(&self.stats),
            batch: self.cfg.batch,
        })
    }
}

/// A canonical connection to one client (see [`Canonical`]).
///
/// `recv` **drives the forwarding** (requests to shards, replies back to the client) and
/// never yields a message: it returns only the error that ended the connection (the client
/// went away, a shard is gone). A server runs `recv` on every accepted connection until it
/// fails. `send` passes messages to the client unchanged. A `recv` cancelled while a shard's
/// queue is full may lose the request it was handing over (the transports are best effort).
pub struct CanonicalConn<C, T> {
    inner: C,
    jobs: Arc<[mpsc::Sender<Job<T>>]>,
    tx: mpsc::Sender<T>,
    rx: tokio::sync::Mutex<mpsc::Receiver<T>>,
    stats: Arc<ShardStats>,
    batch: usize,
}

impl<C: fmt::Debug, T> fmt::Debug for CanonicalConn<C, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CanonicalConn")
            .field("inner", &self.inner)
            .field("shards", &self.jobs.len())
            .finish_non_exhaustive()
    }
}

impl<C, T> ChunnelConnection for CanonicalConn<C, T>
where
    C: ChunnelConnection<Data = T>,
    T: Keyed + Send + 'static,
{
    type Data = T;

    async fn send<B>(&self, burst: B) -> Result<(), chunnel::Error>
    where
        B: IntoIterator<Item = T> + Send,
        B::IntoIter: Send,
    {
        self.inner.send(burst).await
    }

    async fn recv<'a>(&'a self, _slots: &'a mut [Option<T>]) -> Result<usize, chunnel::Error> {
        let mut rx = self.rx.lock().await;
        Err(forward(
            &self.inner,
            &self.jobs,
            &self.tx,
            &mut rx,
            &self.stats,
            self.batch,
        )
        .await)
    }
}

/// The client's server-side-sharding branch: a pass-through that offers no sharding
/// capability (the server's compositional `shard = {server}` matches it). Disable it with
/// [`ViaCanonical::enabled`] to force client push.
#[derive(Clone, Copy, Debug)]
pub struct ViaCanonical {
    enabled: bool,
}

impl Default for ViaCanonical {
    fn default() -> Self {
        ViaCanonical { enabled: true }
    }
}

impl ViaCanonical {
    /// An enabled pass-through.
    pub fn new() -> Self {
        ViaCanonical::default()
    }

    /// Enables or disables this branch (a disabled one is never offered).
    pub fn enabled(mut self, on: bool) -> Self {
        self.enabled = on;
        self
    }
}

impl Negotiate for ViaCanonical {
    fn id(&self) -> &'static str {
        VIA_ID
    }

    fn check_available(&self) -> Result<(), chunnel::Error> {
        if self.enabled {
            Ok(())
        } else {
            Err(chunnel::Error::NotAvailable {
                chunnel: VIA_ID,
                reason: "server-side sharding is disabled".into(),
            })
        }
    }
}

impl<C: ChunnelConnection + Send> Chunnel<C> for ViaCanonical {
    type Connection = C;

    async fn connect_wrap(&mut self, inner: C) -> Result<C, chunnel::Error> {
        Ok(inner)
    }
}
