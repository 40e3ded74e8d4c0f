//! Load balancing: [`Balance`], a base Chunnel that sends round-robin over replica
//! connections and merges their replies.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use chunnel::{Chunnel, ChunnelConnection, Negotiate};

use crate::Error;

use super::merge::Merge;
use super::*;

/// A load balancer over replicas, as a base Chunnel: `connect_wrap(())` connects every
/// replica Chunnel and gives a [`BalanceConn`] over them.
#[derive(Clone, Debug)]
pub struct Balance<B> {
    replicas: Vec<B>,
    cfg: Config,
}

impl<B> Balance<B> {
    /// Balances over the connections `replicas` build (at least one).
    pub fn new(replicas: Vec<B>) -> Self {
        Balance {
            replicas,
            cfg: Config::default(),
        }
    }
}

impl<B> Negotiate for Balance<B> {
    fn id(&self) -> &'static str {
        BALANCE_ID
    }
}

impl<B> Chunnel<()> for Balance<B>
where
    B: Chunnel<()> + Send,
    B::Connection: 'static,
    <B::Connection as ChunnelConnection>::Data: Send + 'static,
{
    type Connection = BalanceConn<B::Connection>;

    async fn connect_wrap(&mut self, (): ()) -> Result<Self::Connection, chunnel::Error> {
        let mut conns = Vec::with_capacity(self.replicas.len());
        for r in &mut self.replicas {
            conns.push(r.connect_wrap(()).await?);
        }
        BalanceConn::with_config(conns, self.cfg)
    }
}

/// Round-robin over replica connections: message `i` of the connection's life goes to
/// replica `i % n` (a burst is split accordingly, each replica's part sent as one burst);
/// `recv` merges every replica's messages (bounded, cancel safe).
pub struct BalanceConn<C: ChunnelConnection> {
    replicas: Vec<Arc<C>>,
    next: AtomicUsize,
    merge: Merge<C::Data>,
}

impl<C: ChunnelConnection> fmt::Debug for BalanceConn<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BalanceConn")
            .field("replicas", &self.replicas.len())
            .finish_non_exhaustive()
    }
}

impl<C> BalanceConn<C>
where
    C: ChunnelConnection + 'static,
    C::Data: Send + 'static,
{
    /// Balances over `replicas` (must be non-empty). Needs a tokio runtime.
    pub fn new(replicas: Vec<C>) -> Result<Self, chunnel::Error> {
        Self::with_config(replicas, Config::default())
    }

    fn with_config(replicas: Vec<C>, cfg: Config) -> Result<Self, chunnel::Error> {
        if replicas.is_empty() {
            return Err(Error::BadShardSet {
                what: "no replica to balance over".into(),
            }
            .into());
        }
        let merge = Merge::new(cfg.merge_queue, cfg.batch);
        let replicas: Vec<Arc<C>> = replicas.into_iter().map(Arc::new).collect();
        for r in &replicas {
            merge.pump(Arc::clone(r));
        }
        Ok(BalanceConn {
            replicas,
            next: AtomicUsize::new(0),
            merge,
        })
    }

    /// The replica connections.
    pub fn replicas(&self) -> &[Arc<C>] {
        &self.replicas
    }
}

impl<C> ChunnelConnection for BalanceConn<C>
where
    C: ChunnelConnection + 'static,
    C::Data: Send + 'static,
{
    type Data = C::Data;

    async fn send<B>(&self, burst: B) -> Result<(), chunnel::Error>
    where
        B: IntoIterator<Item = C::Data> + Send,
        B::IntoIter: Send,
    {
        let n = self.replicas.len();
        let mut groups: Vec<Vec<C::Data>> = (0..n).map(|_| Vec::new()).collect();
        for m in burst {
            groups[self.next.fetch_add(1, Ordering::Relaxed) % n].push(m);
        }
        for (c, g) in self.replicas.iter().zip(groups) {
            if !g.is_empty() {
                c.send(g).await?;
            }
        }
        Ok(())
    }

    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<C::Data>],
    ) -> impl Future<Output = Result<usize, chunnel::Error>> + Send + 'a {
        self.merge.recv(slots)
    }
}
