//! The shard side: [`ShardServer`] runs `N` shards, each a thread with its own runtime,
//! socket and request queue, serving its own socket and the requests forwarded to it.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use chunnel::{Chunnel, ChunnelConnection, Listen, Listener};
use tokio::sync::{Notify, Semaphore, mpsc};

use crate::Error;

use super::canonical::Canonical;
use super::*;

/// Counters of a [`ShardServer`] (all shards and canonical connections together).
#[derive(Debug, Default)]
pub struct ShardStats {
    /// Requests handed to a shard (from its socket or from the canonical address).
    pub requests: AtomicU64,
    /// Received messages that did not decode (dropped).
    pub malformed: AtomicU64,
    /// Replies dropped because the connection's reply queue was full or gone.
    pub replies_dropped: AtomicU64,
    /// Peers a shard socket refused because [`Config::max_peers`] were being served.
    pub peers_refused: AtomicU64,
}

/// One request on its way to a shard, with the queue its reply goes to.
pub(super) struct Job<T> {
    msg: T,
    reply: mpsc::Sender<T>,
}

/// The shards of a server: `N` threads, each with its own runtime, socket and request queue,
/// running a handler on every request. Dropping it stops the threads (and waits for them).
pub struct ShardServer<T> {
    addrs: Arc<[String]>,
    jobs: Arc<[mpsc::Sender<Job<T>>]>,
    stats: Arc<ShardStats>,
    cfg: Config,
    stop: Vec<Arc<Notify>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl<T> fmt::Debug for ShardServer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardServer")
            .field("addrs", &self.addrs)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<T> Drop for ShardServer<T> {
    fn drop(&mut self) {
        for s in &self.stop {
            s.notify_one();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl<T: Keyed + Send + 'static> ShardServer<T> {
    /// Starts one shard per bind config of `shards` (the datapath's [`Listen`]; port 0 is
    /// fine), each bound on its shard's thread, inside the shard's runtime. `advertised`
    /// names a bound listener's address as clients dial it ([`Dial`]): the shard's entry in
    /// [`ShardServer::addrs`] and in the advertisement (say, the bound `ip:port`).
    ///
    /// Each shard runs `per_shard` (e.g. the serialization Chunnel) over every peer its
    /// socket accepts, and `make_handler(i)`'s closure on every request that reaches shard
    /// `i`, from its socket or from a canonical connection; the handler's `Some(reply)` goes
    /// back the way the request came. Returns once every shard is bound.
    pub fn spawn<B, A, S, H, M>(
        shards: Vec<B>,
        advertised: A,
        per_shard: S,
        mut make_handler: M,
        cfg: Config,
    ) -> Result<Self, chunnel::Error>
    where
        B: Listen + Send + 'static,
        B::Listener: 'static,
        A: Fn(&B::Listener) -> Result<String, chunnel::Error> + Clone + Send + 'static,
        <B::Listener as Listener>::Connection: 'static,
        S: Chunnel<<B::Listener as Listener>::Connection> + Clone + Send + Sync + 'static,
        S::Connection: ChunnelConnection<Data = T> + 'static,
        H: FnMut(T) -> Option<T> + Send + 'static,
        M: FnMut(usize) -> H,
    {
        if shards.is_empty() || shards.len() > MAX_SHARDS {
            return Err(Error::BadShardSet {
                what: format!("{} shards (1..={MAX_SHARDS} allowed)", shards.len()),
            }
            .into());
        }
        let stats = Arc::new(ShardStats::default());
        let mut server = ShardServer {
            addrs: Arc::from(Vec::new()),
            jobs: Arc::from(Vec::new()),
            stats: Arc::clone(&stats),
            cfg,
            stop: Vec::new(),
            threads: Vec::new(),
        };
        let mut jobs = Vec::with_capacity(shards.len());
        let mut bound = Vec::with_capacity(shards.len());
        for (i, bind) in shards.into_iter().enumerate() {
            let (job_tx, job_rx) = mpsc::channel(cfg.shard_queue.max(1));
            let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
            let stop = Arc::new(Notify::new());
            let shard = Shard {
                bind,
                advertised: advertised.clone(),
                per_shard: per_shard.clone(),
                handler: make_handler(i),
                jobs_tx: job_tx.clone(),
                jobs_rx: job_rx,
                stats: Arc::clone(&stats),
                cfg,
            };
            let thread_stop = Arc::clone(&stop);
            let t = std::thread::Builder::new()
                .name(format!("shard-{i}"))
                .spawn(move || shard.run(ready_tx, thread_stop))
                .map_err(|e| chunnel::Error::Io {
                    op: "spawn shard thread",
                    source: e,
                })?;
            server.stop.push(stop);
            server.threads.push(t);
            // The shard reports its bound address (or why it could not bind).
            match ready_rx.recv() {
                Ok(Ok(a)) => bound.push(a),
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(Error::ShardGone { shard: i }.into()),
            }
            jobs.push(job_tx);
        }
        server.addrs = Arc::from(bound);
        server.jobs = Arc::from(jobs);
        Ok(server)
    }
}

impl<T> ShardServer<T> {
    /// The shards' addresses, by index (what [`ShardServer::advertise`] announces).
    pub fn addrs(&self) -> &[String] {
        &self.addrs
    }

    /// The counters.
    pub fn stats(&self) -> &ShardStats {
        &self.stats
    }

    /// The canonical Chunnel of the **client-push** option: it advertises the shard set
    /// (exact `shard` capability, see the [module docs](super)) and forwards whatever reaches
    /// the canonical address.
    pub fn advertise(&self) -> Canonical<T> {
        Canonical {
            jobs: Arc::clone(&self.jobs),
            advertise: Some(Arc::clone(&self.addrs)),
            stats: Arc::clone(&self.stats),
            cfg: self.cfg,
        }
    }

    /// The canonical Chunnel of the **server-side** option (compositional
    /// `shard = {server}`): forwards every request to its shard.
    pub fn forward(&self) -> Canonical<T> {
        Canonical {
            jobs: Arc::clone(&self.jobs),
            advertise: None,
            stats: Arc::clone(&self.stats),
            cfg: self.cfg,
        }
    }
}

/// One shard's thread state.
pub(super) struct Shard<B, A, S, H, T> {
    bind: B,
    advertised: A,
    per_shard: S,
    handler: H,
    jobs_tx: mpsc::Sender<Job<T>>,
    jobs_rx: mpsc::Receiver<Job<T>>,
    stats: Arc<ShardStats>,
    cfg: Config,
}

pub(super) type Ready = std::sync::mpsc::SyncSender<Result<String, chunnel::Error>>;

impl<B, A, S, H, T> Shard<B, A, S, H, T>
where
    T: Keyed + Send + 'static,
    B: Listen,
    B::Listener: 'static,
    A: Fn(&B::Listener) -> Result<String, chunnel::Error>,
    <B::Listener as Listener>::Connection: 'static,
    S: Chunnel<<B::Listener as Listener>::Connection> + Clone + Send + Sync + 'static,
    S::Connection: ChunnelConnection<Data = T> + 'static,
    H: FnMut(T) -> Option<T> + Send + 'static,
{
    fn run(self, ready: Ready, stop: Arc<Notify>) {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                let _ = ready.send(Err(chunnel::Error::Io {
                    op: "build shard runtime",
                    source: e,
                }));
                return;
            }
        };
        let Shard {
            bind,
            advertised,
            per_shard,
            handler,
            jobs_tx,
            mut jobs_rx,
            stats,
            cfg,
        } = self;
        // Shared by the forwarded jobs and by this shard's own clients, which run it inline
        // (all on this thread: the lock is never contended).
        let handler = Arc::new(std::sync::Mutex::new(handler));
        rt.block_on(async move {
            let bound = bind
                .listen()
                .await
                .and_then(|l| advertised(&l).map(|a| (l, a)));
            let mut listener = match bound {
                Ok((l, a)) => {
                    let _ = ready.send(Ok(a));
                    l
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            let exec = async {
                while let Some(Job { msg, reply }) = jobs_rx.recv().await {
                    stats.requests.fetch_add(1, Ordering::Relaxed);
                    let r = (handler.lock().unwrap_or_else(|e| e.into_inner()))(msg);
                    if let Some(r) = r
                        && reply.try_send(r).is_err()
                    {
                        stats.replies_dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            };
            // A task of its own rather than a branch of the `select!` below: a listener wakes
            // its `accept` when the reader role on the socket changes hands, and a wake-up
            // of the `block_on` future costs this thread an extra poll of every branch and an
            // extra trip to the I/O driver, where a task's is one poll.
            let accept = tokio::spawn({
                let handler = Arc::clone(&handler);
                let stats = Arc::clone(&stats);
                async move {
                    let peers = Arc::new(Semaphore::new(cfg.max_peers.max(1)));
                    // Jobs come only from canonical connections on other threads; the sender is
                    // kept so the queue stays open while the shard runs.
                    let _jobs_tx = jobs_tx;
                    loop {
                        let base = match listener.accept().await {
                            Ok(b) => b,
                            Err(e) if e.is_closed() => return,
                            // One peer's failure; the socket keeps serving.
                            Err(_) => continue,
                        };
                        let Ok(permit) = Arc::clone(&peers).try_acquire_owned() else {
                            stats.peers_refused.fetch_add(1, Ordering::Relaxed);
                            continue; // dropping `base` forgets the peer
                        };
                        let mut stack = per_shard.clone();
                        let (handler, stats) = (Arc::clone(&handler), Arc::clone(&stats));
                        tokio::spawn(async move {
                            let _permit = permit;
                            if let Ok(conn) = stack.connect_wrap(base).await {
                                let _ = serve_local(&conn, &handler, &stats, cfg.batch).await;
                            }
                        });
                    }
                }
            });
            let abort = accept.abort_handle();
            tokio::select! {
                () = exec => {}
                _ = accept => {}
                () = stop.notified() => {}
            }
            abort.abort();
        });
    }
}

/// A client pushing straight to this shard: each batch of requests is handled inline, on the
/// connection's task, and the replies go back in one send (no queue, no task hop). Returns
/// only when `conn` fails; messages that do not decode are counted and skipped.
async fn serve_local<C, T, H>(
    conn: &C,
    handler: &std::sync::Mutex<H>,
    stats: &ShardStats,
    batch: usize,
) -> chunnel::Error
where
    C: ChunnelConnection<Data = T>,
    T: Send,
    H: FnMut(T) -> Option<T>,
{
    let batch = batch.clamp(1, 64);
    let mut slots: Vec<Option<T>> = (0..batch).map(|_| None).collect();
    let mut out: Vec<T> = Vec::with_capacity(batch);
    loop {
        match conn.recv(&mut slots).await {
            Ok(n) => {
                {
                    let mut h = handler.lock().unwrap_or_else(|e| e.into_inner());
                    for m in slots[..n].iter_mut().filter_map(Option::take) {
                        stats.requests.fetch_add(1, Ordering::Relaxed);
                        out.extend(h(m));
                    }
                }
                if out.is_empty() {
                    continue;
                }
                match conn.send(out.drain(..)).await {
                    Ok(()) => {}
                    Err(e) if e.is_closed() => return e,
                    // E.g. a reply too large for the datapath: dropped.
                    Err(_) => {
                        stats.replies_dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            // A message that did not decode: dropped, the connection goes on.
            Err(chunnel::Error::Layer { .. } | chunnel::Error::Malformed { .. }) => {
                stats.malformed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => return e,
        }
    }
}

/// Receives requests on `conn` and hands each to its shard (by key, among `shards`); sends
/// the replies that arrive on `rx` back on `conn`. Returns only when `conn` fails or a shard
/// is gone; messages that do not decode are counted and skipped.
pub(super) async fn forward<C, T>(
    conn: &C,
    shards: &[mpsc::Sender<Job<T>>],
    tx: &mpsc::Sender<T>,
    rx: &mut mpsc::Receiver<T>,
    stats: &ShardStats,
    batch: usize,
) -> chunnel::Error
where
    C: ChunnelConnection<Data = T>,
    T: Keyed + Send,
{
    let batch = batch.clamp(1, 64);
    let mut slots: Vec<Option<T>> = (0..batch).map(|_| None).collect();
    let mut out: Vec<T> = Vec::with_capacity(batch);
    loop {
        tokio::select! {
            r = conn.recv(&mut slots) => match r {
                Ok(n) => {
                    for m in slots[..n].iter_mut().filter_map(Option::take) {
                        let i = shard_of(m.shard_key(), shards.len());
                        let Some(q) = shards.get(i) else {
                            return Error::ShardGone { shard: i }.into();
                        };
                        if q.send(Job { msg: m, reply: tx.clone() }).await.is_err() {
                            return Error::ShardGone { shard: i }.into();
                        }
                    }
                }
                // A message that did not decode: dropped, the connection goes on.
                Err(chunnel::Error::Layer { .. } | chunnel::Error::Malformed { .. }) => {
                    stats.malformed.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => return e,
            },
            Some(r) = rx.recv() => {
                out.push(r);
                while out.len() < batch {
                    match rx.try_recv() {
                        Ok(r) => out.push(r),
                        Err(_) => break,
                    }
                }
                match conn.send(out.drain(..)).await {
                    Ok(()) => {}
                    Err(e) if e.is_closed() => return e,
                    // E.g. a reply too large for the datapath: dropped.
                    Err(_) => {
                        stats.replies_dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }
}
