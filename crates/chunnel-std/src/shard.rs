//! Sharding and load balancing: Chunnels that decide *where* a message goes.
//!
//! A sharded service listens on one **canonical address** and owns `N` **shards**, each with
//! its own socket, its own thread and its own single-threaded runtime ([`ShardServer`]). A
//! message names its shard through a key ([`Keyed`]); the shard is
//! `fnv1a64(key) % N` ([`shard_of`]; FNV-1a, 64 bits, is stable across builds, platforms and
//! processes, which a client that evaluates it needs).
//!
//! Two ways to reach a shard, two branches of a `select`, so negotiation decides per client:
//!
//! * **Server-side sharding** ([`Canonical`] built by [`ShardServer::forward`]): the client
//!   talks only to the canonical address. The canonical connection hands each request to the
//!   right shard's thread through a bounded queue; the shard's reply comes back through a
//!   bounded queue of that connection and leaves from the canonical address. The client needs
//!   no sharding code at all (its branch is [`ViaCanonical`], a pass-through): the capability
//!   is **compositional** `shard = {server}`, one-sided (paper §5.2).
//! * **Client-side sharding ("client push")** ([`ClientShard`] at the client,
//!   [`ShardServer::advertise`] at the server): the client evaluates the function and sends
//!   straight to the shard's own socket; replies come from that socket. Both ends must agree,
//!   so the capability is **exact** (see the scheme below).
//!
//! Requests that reach the canonical address are forwarded in both branches, so a
//! client-push client that also sends there is still served.
//!
//! # The shard-set advertisement
//!
//! The server's client-push option carries the exact capability
//!
//! ```text
//! shard = { "client-push", "hash=fnv1a-64", "shard=0@<addr 0>", ..., "shard=<N-1>@<addr N-1>" }
//! ```
//!
//! with a custom compatibility [`Rule`](chunnel::negotiate::Rule) (the deciding end's rule
//! applies, and it never crosses the wire): a client capability matches if it is
//! `shard = {"client-push", "hash=fnv1a-64"}` — same mode, same hash function, any addresses.
//! A client's [`ClientShard`] carries exactly that. The server's stack, addresses included,
//! reaches the client in the ACCEPT (`chunnel_negotiate::Info::server_stack`);
//! [`ShardDirectory::learn`] finds and parses the capability there. Addresses are opaque
//! strings to this module (the [`Dial`] implementation parses them), indices must be `0..N`
//! each exactly once, `1 <= N <= `[`MAX_SHARDS`].
//!
//! **Why a directory:** the negotiation driver builds the client's stack (`connect_wrap`)
//! before it returns the [`Info`](https://docs.rs/chunnel-negotiate) with the server stack,
//! and a Chunnel's [`Negotiate::picked`] hook sees only the pick, not the server's
//! capabilities. So [`ClientShard`] shares a [`ShardDirectory`] with its creator, who calls
//! `directory.learn(&negotiated.info().server_stack)` once `connect` returns; the connection
//! dials the shards on its first `send` (which fails with [`Error::ShardSetUnknown`] before
//! that).
//!
//! The shard sockets speak the per-shard stack given to [`ShardServer::spawn`] and
//! [`ClientShard::new`] (typically the same serialization Chunnel as the canonical stack),
//! without negotiation: the client negotiated with the canonical address, and every shard of
//! one server runs the same stack (the paper's §5.3 rule for multi-endpoint Chunnels).
//!
//! # Load balancing
//!
//! [`Balance`] is a base Chunnel over a set of replica connections: messages go to replicas
//! round-robin (message by message) and replies from every replica are merged.
//!
//! # Bounds and failures
//!
//! Every queue is bounded ([`Config`]): a shard's request queue (a full queue makes the
//! canonical connection wait: back-pressure), each connection's reply queue (a reply that does
//! not fit is dropped and counted: the transports below are best effort), the merge queue of
//! client connections, and the number of peers a shard serves at once. A message that does not
//! decode is dropped and counted ([`ShardStats::malformed`]); nothing received from the
//! network can make a shard panic or stop.
//!
//! # Example
//!
//! ```
//! use chunnel::{stack, Chunnel, ChunnelExt, ConnectionExt, Listener as _};
//! use chunnel_net::udp;
//! use chunnel_std::serialize::Serialize;
//! use chunnel_std::shard::{Bind, ClientShard, Config, Dial, Keyed, ShardServer};
//!
//! #[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
//! struct Msg { key: String, n: u32 }
//! impl Keyed for Msg {
//!     fn shard_key(&self) -> &[u8] { self.key.as_bytes() }
//! }
//!
//! #[derive(Clone, Debug)]
//! struct Udp;
//! impl Bind for Udp {
//!     type Listener = udp::Listener;
//!     async fn bind(&self, addr: &str) -> Result<(udp::Listener, String), chunnel::Error> {
//!         let l = udp::Listener::bind(addr.parse().unwrap()).await?;
//!         let a = l.local_addr()?.to_string();
//!         Ok((l, a))
//!     }
//! }
//! impl Dial for Udp {
//!     type Conn = udp::Connection;
//!     async fn dial(&self, addr: &str) -> Result<udp::Connection, chunnel::Error> {
//!         let a = addr.parse().map_err(|_| chunnel::Error::Malformed { what: "address" })?;
//!         udp::Connect::new(a).connect_wrap(()).await
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel::Error> {
//! // Two shards; each answers with the message plus its index * 100.
//! let mut ser = Serialize::<Msg, _>::bincode();
//! let shards = ShardServer::spawn(Udp, &["127.0.0.1:0".into(), "127.0.0.1:0".into()], ser,
//!     |i| move |mut m: Msg| { m.n += 100 * i as u32; Some(m) }, Config::default())?;
//!
//! // Server-side sharding: the canonical listener forwards to the shards.
//! let listener = udp::Listener::bind("127.0.0.1:0".parse().unwrap()).await?;
//! let canonical = listener.local_addr()?;
//! let mut server = stack![shards.forward(), ser].serve(listener);
//! tokio::spawn(async move {
//!     while let Ok(c) = server.accept().await {
//!         tokio::spawn(async move { let _ = c.recv_one().await; }); // drives forwarding
//!     }
//! });
//! let via = ser.connect_wrap(udp::Connect::new(canonical).connect_wrap(()).await?).await?;
//! let m = Msg { key: "apple".into(), n: 1 };
//! via.send_one(m.clone()).await?;
//! let from_server = via.recv_one().await?;
//!
//! // Client push: the same answer, straight from the shard.
//! let push = ClientShard::new(Udp, ser);
//! push.directory().set(shards.addrs().to_vec())?;
//! let conn = stack![push, ser]
//!     .connect_wrap(udp::Connect::new(canonical).connect_wrap(()).await?).await?;
//! conn.send_one(m).await?;
//! assert_eq!(conn.recv_one().await?, from_server);
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::Poll;

use chunnel::{Capability, Chunnel, ChunnelConnection, ChunnelInfo, Listener, Negotiate};
use tokio::sync::{Notify, Semaphore, mpsc};

use crate::Error;

/// The capability kind of both sharding modes.
pub const CAPABILITY: &str = "shard";
/// Label of the client-push mode (exact capability).
pub const CLIENT_PUSH: &str = "client-push";
/// Label of the server-side mode (compositional capability).
pub const SERVER_SIDE: &str = "server";
/// Label naming the sharding function: [`fnv1a64`] of the key modulo the shard count.
pub const HASH_LABEL: &str = "hash=fnv1a-64";
/// Prefix of the labels that list shard addresses: `shard=<index>@<address>`.
pub const SHARD_LABEL_PREFIX: &str = "shard=";
/// The most shards one advertisement may list.
pub const MAX_SHARDS: usize = 4096;

/// Negotiation id of the server's canonical sharding Chunnel (both modes).
pub const CANONICAL_ID: &str = "chunnel-std/shard/canonical/1";
/// Negotiation id of the client-push Chunnel.
pub const CLIENT_ID: &str = "chunnel-std/shard/client-push/1";
/// Negotiation id of the client's pass-through branch (server-side sharding).
pub const VIA_ID: &str = "chunnel-std/shard/via-canonical/1";
/// Negotiation id of the load balancer.
pub const BALANCE_ID: &str = "chunnel-std/shard/balance/1";

/// A message that names its shard by a key.
pub trait Keyed {
    /// The bytes the sharding function hashes. Messages that are never routed by key (replies)
    /// may return an empty slice.
    fn shard_key(&self) -> &[u8];
}

/// 64-bit FNV-1a of `bytes` (offset basis `0xcbf29ce484222325`, prime `0x100000001b3`): the
/// documented, stable sharding hash.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The shard of `key` among `shards`: `fnv1a64(key) % shards` (0 when `shards` is 0).
pub fn shard_of(key: &[u8], shards: usize) -> usize {
    if shards == 0 {
        return 0;
    }
    (fnv1a64(key) % shards as u64) as usize
}

/// Bounds of the sharding machinery.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Requests queued per shard; a full queue makes forwarders wait.
    pub shard_queue: usize,
    /// Replies queued per connection; a reply that does not fit is dropped and counted.
    pub reply_queue: usize,
    /// Messages a client-side connection buffers between its sockets and `recv`.
    pub merge_queue: usize,
    /// Peers one shard socket serves at once; datagrams from further peers are ignored.
    pub max_peers: usize,
    /// Messages moved per `recv`/`send` call inside the machinery.
    pub batch: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            shard_queue: 1024,
            reply_queue: 1024,
            merge_queue: 1024,
            max_peers: 4096,
            batch: 32,
        }
    }
}

impl Config {
    /// Sets [`Config::shard_queue`].
    pub fn with_shard_queue(mut self, n: usize) -> Self {
        self.shard_queue = n.max(1);
        self
    }

    /// Sets [`Config::reply_queue`].
    pub fn with_reply_queue(mut self, n: usize) -> Self {
        self.reply_queue = n.max(1);
        self
    }

    /// Sets [`Config::max_peers`].
    pub fn with_max_peers(mut self, n: usize) -> Self {
        self.max_peers = n.max(1);
        self
    }
}

/// Opens a shard's server socket: implemented per datapath by the application (this crate
/// does not depend on one). Called on the shard's own thread, inside its runtime.
pub trait Bind: Clone + Send + 'static {
    /// The listener of one shard.
    type Listener: Listener + Send + 'static;

    /// Binds `addr`; returns the listener and the address clients should use (the bound
    /// address, e.g. with the port the system picked for port 0).
    fn bind(
        &self,
        addr: &str,
    ) -> impl Future<Output = Result<(Self::Listener, String), chunnel::Error>> + Send;
}

/// Opens a client's connection to one shard address (as advertised).
pub trait Dial: Clone + Send + Sync + 'static {
    /// The base connection to a shard.
    type Conn: ChunnelConnection + 'static;

    /// Connects to `addr`.
    fn dial(&self, addr: &str) -> impl Future<Output = Result<Self::Conn, chunnel::Error>> + Send;
}

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
struct Job<T> {
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
    /// Starts one shard per entry of `addrs` (bound with `bind`; port 0 is fine).
    ///
    /// Each shard runs `per_shard` (e.g. the serialization Chunnel) over every peer its
    /// socket accepts, and `make_handler(i)`'s closure on every request that reaches shard
    /// `i`, from its socket or from a canonical connection; the handler's `Some(reply)` goes
    /// back the way the request came. Returns once every shard is bound.
    pub fn spawn<B, S, H, M>(
        bind: B,
        addrs: &[String],
        per_shard: S,
        mut make_handler: M,
        cfg: Config,
    ) -> Result<Self, chunnel::Error>
    where
        B: Bind,
        <B::Listener as Listener>::Connection: 'static,
        S: Chunnel<<B::Listener as Listener>::Connection> + Clone + Send + Sync + 'static,
        S::Connection: ChunnelConnection<Data = T> + 'static,
        H: FnMut(T) -> Option<T> + Send + 'static,
        M: FnMut(usize) -> H,
    {
        if addrs.is_empty() || addrs.len() > MAX_SHARDS {
            return Err(Error::BadShardSet {
                what: format!("{} shards (1..={MAX_SHARDS} allowed)", addrs.len()),
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
        let mut jobs = Vec::with_capacity(addrs.len());
        let mut bound = Vec::with_capacity(addrs.len());
        for (i, addr) in addrs.iter().enumerate() {
            let (job_tx, job_rx) = mpsc::channel(cfg.shard_queue.max(1));
            let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
            let stop = Arc::new(Notify::new());
            let shard = Shard {
                bind: bind.clone(),
                addr: addr.clone(),
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
    /// (exact `shard` capability, see the [module docs](self)) and forwards whatever reaches
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
struct Shard<B, S, H, T> {
    bind: B,
    addr: String,
    per_shard: S,
    handler: H,
    jobs_tx: mpsc::Sender<Job<T>>,
    jobs_rx: mpsc::Receiver<Job<T>>,
    stats: Arc<ShardStats>,
    cfg: Config,
}

type Ready = std::sync::mpsc::SyncSender<Result<String, chunnel::Error>>;

impl<B, S, H, T> Shard<B, S, H, T>
where
    T: Keyed + Send + 'static,
    B: Bind,
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
            addr,
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
            let mut listener = match bind.bind(&addr).await {
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
            // its `accept` when the reader's place on the socket changes hands, and a wake-up
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
async fn forward<C, T>(
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

/// The server's canonical sharding Chunnel over a typed connection to one client (built by
/// [`ShardServer::advertise`] or [`ShardServer::forward`]; see the [module docs](self)).
pub struct Canonical<T> {
    jobs: Arc<[mpsc::Sender<Job<T>>]>,
    advertise: Option<Arc<[String]>>,
    stats: Arc<ShardStats>,
    cfg: Config,
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

/// The server's client-push rule: the client's `shard` capability must name client push and
/// our hash function; the addresses are ours alone.
fn client_push_rule(ours: &Capability, theirs: &Capability) -> bool {
    let has = |c: &Capability, l: &str| c.labels.iter().any(|x| x == l);
    has(theirs, CLIENT_PUSH) && has(theirs, HASH_LABEL) && has(ours, HASH_LABEL)
}

/// The client-push advertisement of a shard set (see the [module docs](self)).
pub fn advertisement(addrs: &[String]) -> Capability {
    let mut labels = vec![CLIENT_PUSH.to_owned(), HASH_LABEL.to_owned()];
    labels.extend(
        addrs
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{SHARD_LABEL_PREFIX}{i}@{a}")),
    );
    Capability::exact(CAPABILITY, labels).with_rule(client_push_rule)
}

/// Parses a client-push advertisement into the shard addresses, by index.
pub fn parse_advertisement(cap: &Capability) -> Result<Vec<String>, Error> {
    let bad = |what: String| Error::BadShardSet { what };
    if cap.kind != CAPABILITY || !cap.labels.iter().any(|l| l == CLIENT_PUSH) {
        return Err(bad("not a client-push shard capability".into()));
    }
    if !cap.labels.iter().any(|l| l == HASH_LABEL) {
        return Err(bad(format!(
            "no `{HASH_LABEL}` label: unknown hash function"
        )));
    }
    let mut slots: Vec<Option<String>> = Vec::new();
    for l in &cap.labels {
        let Some(rest) = l.strip_prefix(SHARD_LABEL_PREFIX) else {
            continue;
        };
        let (i, addr) = rest
            .split_once('@')
            .ok_or_else(|| bad(format!("label `{l}` lacks `@`")))?;
        let i: usize = i
            .parse()
            .map_err(|_| bad(format!("label `{l}`: bad index")))?;
        if i >= MAX_SHARDS {
            return Err(bad(format!("label `{l}`: index over {MAX_SHARDS}")));
        }
        if addr.is_empty() {
            return Err(bad(format!("label `{l}`: empty address")));
        }
        if slots.len() <= i {
            slots.resize(i + 1, None);
        }
        if slots[i].replace(addr.to_owned()).is_some() {
            return Err(bad(format!("shard {i} listed twice")));
        }
    }
    if slots.is_empty() {
        return Err(bad("no shard listed".into()));
    }
    slots
        .into_iter()
        .enumerate()
        .map(|(i, a)| a.ok_or_else(|| bad(format!("shard {i} missing"))))
        .collect()
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

/// Where a [`ClientShard`] learns the shard set: shared between the Chunnel (and every
/// connection it builds) and the application, which fills it once from the negotiated server
/// stack (see the [module docs](self) for why).
#[derive(Clone, Debug, Default)]
pub struct ShardDirectory {
    addrs: Arc<OnceLock<Arc<[String]>>>,
}

impl ShardDirectory {
    /// An empty directory.
    pub fn new() -> Self {
        ShardDirectory::default()
    }

    /// Finds the client-push advertisement in `server_stack` (the ACCEPT's server stack) and
    /// stores its addresses. Returns the shard count, or 0 if the server's stack has no
    /// advertisement (it picked server-side sharding: nothing to learn).
    pub fn learn(&self, server_stack: &[ChunnelInfo]) -> Result<usize, Error> {
        let cap = server_stack
            .iter()
            .flat_map(|c| &c.capabilities)
            .find(|c| c.kind == CAPABILITY && c.labels.iter().any(|l| l == CLIENT_PUSH));
        match cap {
            None => Ok(0),
            Some(cap) => {
                let addrs = parse_advertisement(cap)?;
                let n = addrs.len();
                self.set(addrs)?;
                Ok(n)
            }
        }
    }

    /// Stores the shard addresses (by index). A directory is filled once; setting the same
    /// set again is fine, another one is [`Error::BadShardSet`].
    pub fn set(&self, addrs: Vec<String>) -> Result<(), Error> {
        if addrs.is_empty() || addrs.len() > MAX_SHARDS {
            return Err(Error::BadShardSet {
                what: format!("{} shards (1..={MAX_SHARDS} allowed)", addrs.len()),
            });
        }
        let new: Arc<[String]> = Arc::from(addrs);
        let have = self.addrs.get_or_init(|| Arc::clone(&new));
        if **have == *new {
            Ok(())
        } else {
            Err(Error::BadShardSet {
                what: "this directory already holds another shard set".into(),
            })
        }
    }

    /// The shard addresses, once known.
    pub fn get(&self) -> Option<&[String]> {
        self.addrs.get().map(|a| &**a)
    }
}

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
const DIRECT: usize = 4;

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

/// The merge queue's receiver and an error to report after the messages before it.
type MergeRx<T> = (
    mpsc::Receiver<Result<T, chunnel::Error>>,
    Option<chunnel::Error>,
);

/// Merges several connections' receive sides through one bounded queue: a task per
/// connection (aborted on drop) moves messages into it.
struct Merge<T> {
    tx: mpsc::Sender<Result<T, chunnel::Error>>,
    rx: tokio::sync::Mutex<MergeRx<T>>,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    batch: usize,
}

impl<T> Drop for Merge<T> {
    fn drop(&mut self) {
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            t.abort();
        }
    }
}

impl<T: Send + 'static> Merge<T> {
    fn new(queue: usize, batch: usize) -> Self {
        let (tx, rx) = mpsc::channel(queue.max(1));
        Merge {
            tx,
            rx: tokio::sync::Mutex::new((rx, None)),
            tasks: Mutex::new(Vec::new()),
            batch: batch.clamp(1, 64),
        }
    }

    fn pump<C: ChunnelConnection<Data = T> + 'static>(&self, conn: Arc<C>) {
        let tx = self.tx.clone();
        let batch = self.batch;
        let task = tokio::spawn(async move {
            let mut slots: Vec<Option<T>> = (0..batch).map(|_| None).collect();
            loop {
                match conn.recv(&mut slots).await {
                    Ok(n) => {
                        for m in slots[..n].iter_mut().filter_map(Option::take) {
                            if tx.send(Ok(m)).await.is_err() {
                                return;
                            }
                        }
                    }
                    // A message that did not decode: reported, the connection goes on.
                    Err(e @ (chunnel::Error::Layer { .. } | chunnel::Error::Malformed { .. })) => {
                        if tx.send(Err(e)).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                }
            }
        });
        self.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(task.abort_handle());
    }

    async fn recv(&self, slots: &mut [Option<T>]) -> Result<usize, chunnel::Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let mut guard = self.rx.lock().await;
        let (rx, pending) = &mut *guard;
        if let Some(e) = pending.take() {
            return Err(e);
        }
        // Cancel safe: the only await is the first receive.
        let first = rx.recv().await.ok_or(chunnel::Error::Closed)??;
        slots[0] = Some(first);
        let mut n = 1;
        while n < slots.len() {
            match rx.try_recv() {
                Ok(Ok(m)) => {
                    slots[n] = Some(m);
                    n += 1;
                }
                Ok(Err(e)) => {
                    // Reported by the next call, after the good messages.
                    *pending = Some(e);
                    break;
                }
                Err(_) => break,
            }
        }
        Ok(n)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct KeyedMsg {
        key: String,
        shard: u32,
    }

    impl Keyed for KeyedMsg {
        fn shard_key(&self) -> &[u8] {
            self.key.as_bytes()
        }
    }

    #[derive(Clone, Debug)]
    struct TestUdp;

    impl Bind for TestUdp {
        type Listener = chunnel_net::udp::Listener;
        async fn bind(
            &self,
            addr: &str,
        ) -> Result<(chunnel_net::udp::Listener, String), chunnel::Error> {
            let l = chunnel_net::udp::Listener::bind(addr.parse().unwrap()).await?;
            let a = l.local_addr()?.to_string();
            Ok((l, a))
        }
    }

    impl Dial for TestUdp {
        type Conn = chunnel_net::udp::Connection;
        async fn dial(&self, addr: &str) -> Result<chunnel_net::udp::Connection, chunnel::Error> {
            chunnel_net::udp::Connect::new(addr.parse().unwrap())
                .connect_wrap(())
                .await
        }
    }

    /// Client push over more shards than `recv` reads itself (the rest through the merge
    /// queue), with one-slot and many-slot receives, and a receiver that started before the
    /// shards were dialled: every reply arrives once, from the right shard.
    type TestSer = crate::serialize::Serialize<KeyedMsg, crate::serialize::Bincode>;
    type TestPush = ClientShardConn<
        crate::serialize::SerializeConn<
            chunnel_net::udp::Connection,
            KeyedMsg,
            crate::serialize::Bincode,
        >,
        TestUdp,
        TestSer,
    >;

    /// `n` shards answering with their index, and a client-push connection to them. The
    /// canonical address is a socket nobody answers on (returned: keep it alive).
    async fn push_client(n: usize) -> (ShardServer<KeyedMsg>, std::net::UdpSocket, Arc<TestPush>) {
        let ser = crate::serialize::Serialize::<KeyedMsg, _>::bincode();
        let shards = ShardServer::spawn(
            TestUdp,
            &vec!["127.0.0.1:0".to_owned(); n],
            ser,
            |i| {
                move |mut m: KeyedMsg| {
                    m.shard = i as u32;
                    Some(m)
                }
            },
            Config::default(),
        )
        .unwrap();
        let canonical = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let push = ClientShard::new(TestUdp, ser);
        push.directory().set(shards.addrs().to_vec()).unwrap();
        let base = chunnel_net::udp::Connect::new(canonical.local_addr().unwrap())
            .connect_wrap(())
            .await
            .unwrap();
        let conn = Arc::new(chunnel::stack![push, ser].connect_wrap(base).await.unwrap());
        (shards, canonical, conn)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn recv_from_reads_one_source_each() {
        let n = DIRECT + 2;
        let (_shards, _canonical, conn) = push_client(n).await;
        let sources = conn.sources().await.unwrap();
        assert_eq!(sources, DIRECT + 1, "4 direct shards and the merge queue");
        let mut slots: Vec<Option<KeyedMsg>> = vec![None; 8];
        match conn.recv_from(sources, &mut slots).await {
            Err(chunnel::Error::Layer { source, .. }) => assert!(
                matches!(
                    source.downcast_ref::<Error>(),
                    Some(Error::NoSuchSource { index, sources: s }) if *index == sources && *s == sources
                ),
                "{source}"
            ),
            other => panic!("source {sources} of {sources}: {other:?}"),
        }
        let total = 30 * n;
        let msgs: Vec<KeyedMsg> = (0..total)
            .map(|i| KeyedMsg {
                key: format!("key-{i}"),
                shard: u32::MAX,
            })
            .collect();
        conn.send(msgs).await.unwrap();
        // One reader per source, as a multiplexing client runs them, until all are in.
        let seen = Arc::new(AtomicUsize::new(0));
        let readers: Vec<_> = (0..sources)
            .map(|s| {
                let (conn, seen) = (Arc::clone(&conn), Arc::clone(&seen));
                tokio::spawn(async move {
                    let mut slots: Vec<Option<KeyedMsg>> = vec![None; 8];
                    let mut mine = Vec::new();
                    while seen.load(Ordering::SeqCst) < total {
                        let r = tokio::time::timeout(
                            std::time::Duration::from_millis(50),
                            conn.recv_from(s, &mut slots),
                        )
                        .await;
                        if let Ok(k) = r {
                            let k = k.unwrap();
                            mine.extend(slots[..k].iter_mut().map(|m| m.take().unwrap()));
                            seen.fetch_add(k, Ordering::SeqCst);
                        }
                    }
                    (s, mine)
                })
            })
            .collect();
        let mut got = Vec::new();
        let mut per_source = vec![0usize; sources];
        for r in readers {
            let (s, ms) = tokio::time::timeout(std::time::Duration::from_secs(10), r)
                .await
                .expect("replies missing")
                .unwrap();
            for m in &ms {
                let shard = m.shard as usize;
                let expect = if shard < DIRECT { shard } else { DIRECT };
                assert_eq!(s, expect, "shard {shard}'s reply came through source {s}");
            }
            per_source[s] = ms.len();
            got.extend(ms);
        }
        assert_eq!(got.len(), total);
        assert!(per_source.iter().all(|&k| k > 0), "{per_source:?}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn client_push_receives_from_every_shard() {
        use chunnel::ConnectionExt;
        let n = DIRECT + 3;
        let (_shards, _canonical, conn) = push_client(n).await;
        let total = 40 * n;
        // Started before the first send: it waits on nothing but the canonical connection
        // until the shards are dialled.
        let early = tokio::spawn({
            let conn = Arc::clone(&conn);
            async move { conn.recv_one().await }
        });
        tokio::task::yield_now().await;
        let msgs: Vec<KeyedMsg> = (0..total)
            .map(|i| KeyedMsg {
                key: format!("key-{i}"),
                shard: u32::MAX,
            })
            .collect();
        for chunk in msgs.chunks(7) {
            conn.send(chunk.to_vec()).await.unwrap();
        }
        let mut got = vec![early.await.unwrap().unwrap()];
        let mut slots: Vec<Option<KeyedMsg>> = vec![None; 32];
        let mut one = true;
        while got.len() < total {
            let r = if one {
                conn.recv(&mut slots[..1])
            } else {
                conn.recv(&mut slots)
            };
            let k = tokio::time::timeout(std::time::Duration::from_secs(5), r)
                .await
                .expect("a reply is missing")
                .unwrap();
            assert!(k >= 1 && (!one || k == 1));
            got.extend(slots[..k].iter_mut().map(|s| s.take().unwrap()));
            one = !one;
        }
        assert_eq!(got.len(), total);
        got.sort_by(|a, b| a.key.cmp(&b.key));
        got.dedup_by(|a, b| a.key == b.key);
        assert_eq!(got.len(), total, "a reply was delivered twice");
        let mut used = vec![false; n];
        for m in &got {
            assert_eq!(m.shard as usize, shard_of(m.key.as_bytes(), n), "{m:?}");
            used[m.shard as usize] = true;
        }
        assert!(used.iter().all(|&u| u), "every shard answered some");
    }

    #[test]
    fn fnv1a_known_values() {
        // Reference values of 64-bit FNV-1a.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(shard_of(b"x", 0), 0);
        assert!((0..1000).all(|i| shard_of(format!("k{i}").as_bytes(), 7) < 7));
    }

    #[test]
    fn advertisement_round_trips_and_matches_client_push_only() {
        let addrs = vec!["127.0.0.1:1".to_owned(), "[::1]:2".to_owned()];
        let ad = advertisement(&addrs);
        assert_eq!(parse_advertisement(&ad).unwrap(), addrs);
        let client = Capability::exact(CAPABILITY, [CLIENT_PUSH, HASH_LABEL]);
        assert!(ad.compatible(&client));
        let other_hash = Capability::exact(CAPABILITY, [CLIENT_PUSH, "hash=crc32"]);
        assert!(!ad.compatible(&other_hash));
        let server_side = Capability::compositional(CAPABILITY, [SERVER_SIDE]);
        assert!(!server_side.compatible(&client));

        let dir = ShardDirectory::new();
        let info = [ChunnelInfo {
            id: CANONICAL_ID.into(),
            capabilities: vec![ad],
        }];
        assert_eq!(dir.learn(&info).unwrap(), 2);
        assert_eq!(dir.get().unwrap(), &addrs[..]);
        assert!(dir.set(vec!["x".into()]).is_err());
        assert_eq!(ShardDirectory::new().learn(&[]).unwrap(), 0);
    }

    #[test]
    fn bad_advertisements_are_typed_errors() {
        let cap =
            |labels: &[&str]| Capability::exact(CAPABILITY, labels.iter().map(|l| l.to_string()));
        for labels in [
            &[CLIENT_PUSH, HASH_LABEL][..],
            &[CLIENT_PUSH, "shard=0@a"],
            &[CLIENT_PUSH, HASH_LABEL, "shard=1@a"],
            &[CLIENT_PUSH, HASH_LABEL, "shard=0@a", "shard=0@b"],
            &[CLIENT_PUSH, HASH_LABEL, "shard=x@a"],
            &[CLIENT_PUSH, HASH_LABEL, "shard=0"],
            &[CLIENT_PUSH, HASH_LABEL, "shard=0@"],
            &[CLIENT_PUSH, HASH_LABEL, "shard=99999999@a"],
            &[SERVER_SIDE],
        ] {
            assert!(
                matches!(
                    parse_advertisement(&cap(labels)),
                    Err(Error::BadShardSet { .. })
                ),
                "{labels:?}"
            );
        }
    }
}
