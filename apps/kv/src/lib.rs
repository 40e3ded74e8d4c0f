//! # chunnel-kv: a sharded key-value store on Chunnels
//!
//! The store of the Bertha paper's §7.3 (and the HotNets paper's Listings 4–5): a server with
//! `N` shards, each a thread with its own UDP socket and its own `HashMap`; clients reach a
//! shard either **through the server** (server-side sharding: the canonical address forwards
//! each request) or **directly** (client push: the client hashes the key and sends to the
//! shard's socket). Which one is negotiated per client (`chunnel-negotiate`) from a `select`
//! of the two branches, so one server serves both kinds at once ("mixed").
//!
//! ```text
//! client stack:  select(ClientShard, ViaCanonical) | Serialize<Msg, bincode> | Tagged<UDP>
//! server stack:  select(advertise, forward)        | Serialize<Msg, bincode> | Tagged<UDP>
//! shard sockets: Serialize<Msg, bincode> | UDP  (no negotiation: same stack on every shard)
//! ```
//!
//! The server prefers client push; a client that offers it learns the shard addresses from
//! the ACCEPT (the `shard` capability of the server's stack, see `chunnel_std::shard`).
//!
//! ## Messages
//!
//! [`Msg`] (bincode): a [`Msg::Request`] carries the client's id, a request id and an [`Op`];
//! a [`Msg::Response`] carries the request id and the value: for GET the current value, for
//! PUT the previous one, for DELETE the removed one.
//!
//! ## Reliability
//!
//! UDP on loopback rarely drops, but it may (full socket buffers, full bounded queues). The
//! client retries: a request that sees no reply within [`ClientConfig::timeout`] is sent again
//! with the same request id, the timeout doubling each time, up to
//! [`ClientConfig::attempts`] sends. A shard remembers the replies to the last
//! [`REPLAY_CACHE`] requests it executed, by (client id, request id), and answers a retry from
//! there without executing it again, so a retried PUT or DELETE is applied once and returns
//! what the first execution returned. The guarantee ends where the cache does: a retry that
//! arrives after 4096 later requests to the same shard is executed again. (The `Reliable`
//! Chunnel is not used: a client-push client would need it on every shard socket, and request
//! retries cover both paths alike.)
//!
//! ## Concurrency
//!
//! [`KvClient`]'s methods take `&self`: any number of tasks may issue requests at once (up to
//! [`ClientConfig::max_outstanding`] in flight; more wait). Replies are matched to requests by
//! id by one receive task.
//!
//! ## Example
//!
//! ```
//! use chunnel_kv::{ClientConfig, KvClient, KvServer, ServerConfig, Sharding};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel_kv::KvError> {
//! let server = KvServer::start("127.0.0.1:0".parse().unwrap(), ServerConfig::new(4)).await?;
//! let client = KvClient::connect(server.addr(), ClientConfig::default()).await?;
//! assert_eq!(client.sharding(), Sharding::ClientPush); // the server's preference
//! assert_eq!(client.put(b"k", b"v").await?, None);
//! assert_eq!(client.get(b"k").await?.as_deref(), Some(&b"v"[..]));
//! assert_eq!(client.delete(b"k").await?.as_deref(), Some(&b"v"[..]));
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, rust_2018_idioms)]

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chunnel::{Chunnel, ChunnelConnection, ConnectionExt, Either, Select, Stack, select};
use chunnel_net::udp;
use chunnel_std::serialize::{Bincode, Serialize};
use chunnel_std::shard::{self, ClientShard, Keyed, ShardServer, ViaCanonical};
use serde::{Deserialize, Serialize as SerdeSerialize};
use tokio::sync::{Semaphore, oneshot};

pub mod control;
pub mod live;
pub mod ycsb;

/// Replies each shard remembers for retried requests.
pub const REPLAY_CACHE: usize = 4096;

/// An operation on one key.
#[derive(Clone, Debug, PartialEq, Eq, SerdeSerialize, Deserialize)]
pub enum Op {
    /// Reads the value.
    Get {
        /// The key.
        #[serde(with = "bytes")]
        key: Vec<u8>,
    },
    /// Writes the value; answers the previous one.
    Put {
        /// The key.
        #[serde(with = "bytes")]
        key: Vec<u8>,
        /// The new value.
        #[serde(with = "bytes")]
        value: Vec<u8>,
    },
    /// Removes the key; answers the removed value.
    Delete {
        /// The key.
        #[serde(with = "bytes")]
        key: Vec<u8>,
    },
}

impl Op {
    /// The key the operation is on.
    pub fn key(&self) -> &[u8] {
        match self {
            Op::Get { key } | Op::Put { key, .. } | Op::Delete { key } => key,
        }
    }
}

/// Every message of the store, both directions.
#[derive(Clone, Debug, PartialEq, Eq, SerdeSerialize, Deserialize)]
pub enum Msg {
    /// A request.
    Request {
        /// The client's random id (scopes `id` in the shards' replay caches).
        client: u64,
        /// The request id, unique per client; the reply carries it.
        id: u64,
        /// What to do.
        op: Op,
    },
    /// The reply to request `id`.
    Response {
        /// The request id.
        id: u64,
        /// GET: the value; PUT: the previous value; DELETE: the removed value.
        #[serde(with = "opt_bytes")]
        value: Option<Vec<u8>>,
    },
}

/// Byte strings as serde *bytes* (as the `serde_bytes` crate does): one length and one copy,
/// where serde's default for `Vec<u8>` is a sequence visited byte by byte. In bincode both are
/// the same bytes on the wire (a varint length, then the bytes), so only the cost changes.
mod bytes {
    use std::fmt;

    use serde::de::{SeqAccess, Visitor};
    use serde::{Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        // `bytes`, not `byte_buf`: a format that can lend the bytes (bincode from a slice)
        // then copies them once, where a buffer of its own is zeroed and then filled.
        d.deserialize_bytes(ByteBuf)
    }

    pub(crate) struct ByteBuf;

    impl<'de> Visitor<'de> for ByteBuf {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a byte string")
        }

        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }

        // Self-describing formats without a bytes type (JSON) give a sequence.
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
            while let Some(b) = seq.next_element()? {
                v.push(b);
            }
            Ok(v)
        }
    }
}

/// `Option<Vec<u8>>` with the value as serde bytes (see [`bytes`]).
mod opt_bytes {
    use std::fmt;

    use serde::de::Visitor;
    use serde::{Deserializer, Serializer};

    struct Bytes<'a>(&'a [u8]);

    impl serde::Serialize for Bytes<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(self.0)
        }
    }

    pub(crate) fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_some(&Bytes(v)),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Vec<u8>>, D::Error> {
        d.deserialize_option(OptByteBuf)
    }

    struct OptByteBuf;

    impl<'de> Visitor<'de> for OptByteBuf {
        type Value = Option<Vec<u8>>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an optional byte string")
        }

        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_bytes(super::bytes::ByteBuf).map(Some)
        }
    }
}

impl Keyed for Msg {
    fn shard_key(&self) -> &[u8] {
        match self {
            Msg::Request { op, .. } => op.key(),
            Msg::Response { .. } => &[],
        }
    }
}

/// The serialization Chunnel of the store.
pub type Ser = Serialize<Msg, Bincode>;

/// One shard's state: the map and the replay cache.
#[derive(Debug, Default)]
pub struct Store {
    map: HashMap<Vec<u8>, Vec<u8>>,
    replies: HashMap<(u64, u64), Option<Vec<u8>>>,
    order: VecDeque<(u64, u64)>,
}

impl Store {
    /// An empty shard.
    pub fn new() -> Self {
        Store::default()
    }

    /// Applies `op` to the map.
    pub fn apply(&mut self, op: Op) -> Option<Vec<u8>> {
        match op {
            Op::Get { key } => self.map.get(&key).cloned(),
            Op::Put { key, value } => self.map.insert(key, value),
            Op::Delete { key } => self.map.remove(&key),
        }
    }

    /// Handles one message: a request gets its response (from the replay cache if it is a
    /// retry); anything else gets none.
    pub fn handle(&mut self, msg: Msg) -> Option<Msg> {
        let Msg::Request { client, id, op } = msg else {
            return None;
        };
        if let Some(v) = self.replies.get(&(client, id)) {
            return Some(Msg::Response {
                id,
                value: v.clone(),
            });
        }
        let value = self.apply(op);
        if self.order.len() >= REPLAY_CACHE
            && let Some(old) = self.order.pop_front()
        {
            self.replies.remove(&old);
        }
        self.order.push_back((client, id));
        self.replies.insert((client, id), value.clone());
        Some(Msg::Response { id, value })
    }

    /// Keys stored.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the shard is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// UDP for shard connections (client push); the shard sockets are [`udp::Bind`]s, advertised
/// by [`shard_addr`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Udp;

/// The address clients dial for a bound shard socket: its `ip:port` (what
/// [`ShardServer::spawn`] advertises).
pub fn shard_addr(l: &udp::Listener) -> Result<String, chunnel::Error> {
    Ok(l.local_addr()?.to_string())
}

fn parse_addr(addr: &str) -> Result<SocketAddr, chunnel::Error> {
    addr.parse().map_err(|_| chunnel::Error::Malformed {
        what: "shard address is not ip:port",
    })
}

impl shard::Dial for Udp {
    type Conn = udp::Connection;

    async fn dial(&self, addr: &str) -> Result<udp::Connection, chunnel::Error> {
        udp::Connect::new(parse_addr(addr)?).connect_wrap(()).await
    }
}

/// Errors of the store's client and server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// Negotiation with the server failed.
    #[error("negotiation: {0}")]
    Negotiate(#[from] chunnel_negotiate::Error),
    /// The connection failed.
    #[error(transparent)]
    Chunnel(#[from] chunnel::Error),
    /// The sharding layer refused (e.g. a bad shard-set advertisement).
    #[error(transparent)]
    Shard(#[from] chunnel_std::Error),
    /// No reply after every attempt.
    #[error("no reply after {attempts} attempts")]
    Timeout {
        /// Requests sent.
        attempts: u32,
    },
    /// The client's connection ended.
    #[error("the connection ended")]
    Closed,
}

/// How the client reaches the shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharding {
    /// Client push: straight to the shard's socket.
    ClientPush,
    /// Server-side: through the canonical address.
    ServerSide,
}

/// What a client offers in negotiation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// Both branches; the server's preference decides.
    Both,
    /// Only client push.
    ClientPush,
    /// Only server-side sharding.
    ServerSide,
}

/// Server settings.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct ServerConfig {
    /// Number of shards (threads, sockets).
    pub shards: usize,
    /// Whether to offer client push (else only server-side sharding).
    pub client_push: bool,
    /// Queue bounds of the sharding machinery.
    pub shard: shard::Config,
    /// Negotiation settings.
    pub negotiate: chunnel_negotiate::Config,
}

impl ServerConfig {
    /// `shards` shards, client push offered, default bounds.
    pub fn new(shards: usize) -> Self {
        ServerConfig {
            shards,
            client_push: true,
            shard: shard::Config::default(),
            negotiate: chunnel_negotiate::Config::default(),
        }
    }

    /// Sets [`ServerConfig::client_push`].
    pub fn with_client_push(mut self, on: bool) -> Self {
        self.client_push = on;
        self
    }
}

/// Connections a server accepted, by sharding mode.
#[derive(Debug, Default)]
pub struct ServerCounts {
    /// Clients that negotiated client push.
    pub client_push: AtomicU64,
    /// Clients that negotiated server-side sharding.
    pub server_side: AtomicU64,
    /// Per-client negotiation failures.
    pub failed: AtomicU64,
}

/// A running store: `N` shard threads plus a negotiating canonical listener (a task on the
/// caller's runtime). Dropping it stops both.
#[derive(Debug)]
pub struct KvServer {
    addr: SocketAddr,
    shards: ShardServer<Msg>,
    counts: Arc<ServerCounts>,
    task: tokio::task::JoinHandle<()>,
    /// Control entries of the listener and the shards (none without a registry).
    _control: Vec<chunnel_ctl::Guard>,
}

impl Drop for KvServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl KvServer {
    /// Binds the canonical address `addr` and one shard socket per shard on the same IP
    /// (ports picked by the system); serves until dropped. Must run in a tokio runtime.
    pub async fn start(addr: SocketAddr, cfg: ServerConfig) -> Result<Self, KvError> {
        KvServer::start_inner(addr, cfg, None).await
    }

    /// As [`KvServer::start`], and registers the canonical listener, each shard (with its
    /// request and key counts) and each negotiated client connection in `registry`, the
    /// registry of a control endpoint (`chunnel-ctl`; see [`control`]).
    pub async fn start_with_control(
        addr: SocketAddr,
        cfg: ServerConfig,
        registry: chunnel_ctl::Registry,
    ) -> Result<Self, KvError> {
        KvServer::start_inner(addr, cfg, Some(registry)).await
    }

    async fn start_inner(
        addr: SocketAddr,
        cfg: ServerConfig,
        registry: Option<chunnel_ctl::Registry>,
    ) -> Result<Self, KvError> {
        // The canonical address first: the shards' kernel-picked ports cannot then take it.
        let listener = udp::Listener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let shard_binds = vec![udp::Bind::new(SocketAddr::new(addr.ip(), 0)); cfg.shards];
        let shard_counts = registry
            .as_ref()
            .map(|_| control::ShardCounts::new(cfg.shards));
        let shards = ShardServer::spawn(
            shard_binds,
            shard_addr,
            Ser::default(),
            |i| {
                let mut store = Store::new();
                let counts = shard_counts.clone();
                move |m| {
                    let reply = store.handle(m);
                    if let Some(c) = &counts {
                        c.record(i, store.len());
                    }
                    reply
                }
            },
            cfg.shard,
        )?;
        // Preference: client push (when offered), else server-side. Both branches have the
        // same type, so "no client push" is the forwarder twice.
        let first = if cfg.client_push {
            shards.advertise()
        } else {
            shards.forward()
        };
        let stack = chunnel::stack![select(first, shards.forward()), Ser::default()];
        let counts = Arc::new(ServerCounts::default());
        let control = match (&registry, &shard_counts) {
            (Some(r), Some(sc)) => {
                control::register_server(r, addr, &stack, &shards, &counts, sc, cfg.client_push)
            }
            _ => Vec::new(),
        };
        let mut nl = chunnel_negotiate::listen(stack, listener, cfg.negotiate);
        let task = tokio::spawn({
            let counts = Arc::clone(&counts);
            let client_push = cfg.client_push;
            let registry = registry.clone();
            async move {
                // Dropped with the task: aborts every connection's forwarding.
                let mut conns = tokio::task::JoinSet::new();
                loop {
                    while conns.try_join_next().is_some() {}
                    match nl.accept().await {
                        Ok(conn) => {
                            let pushed = client_push
                                && conn.info().server_pick.branches().first() == Some(&0);
                            let c = if pushed {
                                &counts.client_push
                            } else {
                                &counts.server_side
                            };
                            c.fetch_add(1, Ordering::Relaxed);
                            let guard = registry
                                .as_ref()
                                .map(|r| control::register_conn(r, conn.info(), pushed));
                            conns.spawn(async move {
                                let _guard = guard;
                                // Drives the forwarding until the client goes away.
                                let mut slot = [None];
                                let _ = conn.recv(&mut slot).await;
                            });
                        }
                        Err(chunnel_negotiate::Error::Chunnel(e)) if e.is_closed() => return,
                        Err(_) => {
                            counts.failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        });
        Ok(KvServer {
            addr,
            shards,
            counts,
            task,
            _control: control,
        })
    }

    /// The canonical address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The shard sockets' addresses, by index.
    pub fn shard_addrs(&self) -> &[String] {
        self.shards.addrs()
    }

    /// Request and drop counters of the shards.
    pub fn shard_stats(&self) -> &shard::ShardStats {
        self.shards.stats()
    }

    /// Accepted connections by mode.
    pub fn counts(&self) -> &ServerCounts {
        &self.counts
    }
}

/// Client settings.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct ClientConfig {
    /// Which branches to offer.
    pub offer: Offer,
    /// Requests in flight at once; further calls wait.
    pub max_outstanding: usize,
    /// Wait for a reply before the first retry (doubles per retry, at most 1 s).
    pub timeout: Duration,
    /// Sends of one request before [`KvError::Timeout`].
    pub attempts: u32,
    /// Run the task that receives replies on the current [`tokio::task::LocalSet`]
    /// (`spawn_local`) instead of the runtime (`tokio::spawn`). For callers that issue their
    /// requests from tasks of a `LocalSet`: a reply then wakes its caller without leaving the
    /// set. [`KvClient::connect`] must then be called inside that `LocalSet`.
    pub local_receiver: bool,
    /// Negotiation settings.
    pub negotiate: chunnel_negotiate::Config,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            offer: Offer::Both,
            max_outstanding: 1024,
            timeout: Duration::from_millis(100),
            attempts: 8,
            local_receiver: false,
            negotiate: chunnel_negotiate::Config::default(),
        }
    }
}

impl ClientConfig {
    /// Sets [`ClientConfig::offer`].
    pub fn with_offer(mut self, offer: Offer) -> Self {
        self.offer = offer;
        self
    }

    /// Sets [`ClientConfig::local_receiver`].
    pub fn with_local_receiver(mut self, on: bool) -> Self {
        self.local_receiver = on;
        self
    }
}

type ClientStack = Stack<Select<ClientShard<Udp, Ser>, ViaCanonical>, Ser>;
/// `Negotiated<Either<ClientShardConn<..>, SerializeConn<Tagged<udp::Connection>, ..>>>`.
type Conn = chunnel_negotiate::Conn<ClientStack>;
/// Requests awaiting their reply, by request id (shared with the live client).
pub(crate) type Pending = Mutex<HashMap<u64, oneshot::Sender<Option<Vec<u8>>>>>;

/// A store client. Methods take `&self`; share it (e.g. in an `Arc`) to issue requests from
/// many tasks at once.
#[derive(Debug)]
pub struct KvClient {
    conn: Arc<Conn>,
    sharding: Sharding,
    client: u64,
    next: AtomicU64,
    pending: Arc<Pending>,
    slots: Semaphore,
    cfg: ClientConfig,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for KvClient {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn random_id() -> u64 {
    chunnel::util::random_u64()
}

/// Removes a request's entry however its call ends.
pub(crate) struct Entry<'a> {
    pub(crate) pending: &'a Pending,
    pub(crate) id: u64,
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}

impl KvClient {
    /// Negotiates with the server at `addr` and, for client push, learns its shard set.
    pub async fn connect(addr: SocketAddr, cfg: ClientConfig) -> Result<Self, KvError> {
        let push = ClientShard::new(Udp, Ser::default()).enabled(cfg.offer != Offer::ServerSide);
        let dir = push.directory();
        let via = ViaCanonical::new().enabled(cfg.offer != Offer::ClientPush);
        let stack: ClientStack = chunnel::stack![select(push, via), Ser::default()];
        let negotiator = chunnel_negotiate::Connector::new(cfg.negotiate);
        let conn = negotiator.connect(addr, stack).await?;
        let sharding = match conn.get_ref() {
            Either::Left(_) => {
                if dir.learn(&conn.info().server_stack)? == 0 {
                    return Err(chunnel_std::Error::BadShardSet {
                        what: "client push picked but the server advertised no shards".into(),
                    }
                    .into());
                }
                Sharding::ClientPush
            }
            Either::Right(_) => Sharding::ServerSide,
        };
        let conn = Arc::new(conn);
        let pending: Arc<Pending> = Arc::default();
        // Client push: one receiving task per source (shard socket), as a hand-written
        // multiplexing client would have, so a reply wakes and polls only its own socket.
        let sources = match conn.get_ref() {
            Either::Left(push) => push.sources().await?,
            Either::Right(_) => 1,
        };
        let tasks = (0..sources)
            .map(|source| {
                let rx = receive(Arc::clone(&conn), Arc::clone(&pending), source);
                if cfg.local_receiver {
                    tokio::task::spawn_local(rx)
                } else {
                    tokio::spawn(rx)
                }
            })
            .collect();
        Ok(KvClient {
            conn,
            sharding,
            client: random_id(),
            next: AtomicU64::new(1),
            pending,
            slots: Semaphore::new(cfg.max_outstanding.max(1)),
            cfg,
            tasks,
        })
    }

    /// The mode negotiation picked.
    pub fn sharding(&self) -> Sharding {
        self.sharding
    }

    /// The value of `key`.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.call(Op::Get { key: key.to_vec() }).await
    }

    /// Sets `key` to `value`; returns the previous value.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.call(Op::Put {
            key: key.to_vec(),
            value: value.to_vec(),
        })
        .await
    }

    /// Removes `key`; returns the removed value.
    pub async fn delete(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.call(Op::Delete { key: key.to_vec() }).await
    }

    /// Sends `op` (retrying, see the [crate docs](crate)) and waits for its reply.
    pub async fn call(&self, op: Op) -> Result<Option<Vec<u8>>, KvError> {
        let _slot = self.slots.acquire().await.map_err(|_| KvError::Closed)?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, mut rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, tx);
        let _entry = Entry {
            pending: &self.pending,
            id,
        };
        let mut wait = self.cfg.timeout;
        let attempts = self.cfg.attempts.max(1);
        for _ in 0..attempts {
            let req = Msg::Request {
                client: self.client,
                id,
                op: op.clone(),
            };
            self.conn.send_one(req).await?;
            match tokio::time::timeout(wait, &mut rx).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(_)) => return Err(KvError::Closed),
                Err(_) => wait = (wait * 2).min(Duration::from_secs(1)),
            }
        }
        Err(KvError::Timeout { attempts })
    }
}

/// Matches replies to waiting requests until the connection ends: those of one receive
/// `source` of a client-push connection (see `ClientShardConn::sources`), or all of a
/// server-side one.
async fn receive(conn: Arc<Conn>, pending: Arc<Pending>, source: usize) {
    let mut slots: Vec<Option<Msg>> = vec![None; 32];
    loop {
        let got = match conn.get_ref() {
            Either::Left(push) => push.recv_from(source, &mut slots).await,
            Either::Right(_) => conn.recv(&mut slots).await,
        };
        match got {
            Ok(n) => {
                let mut p = pending.lock().unwrap_or_else(|e| e.into_inner());
                for m in slots[..n].iter_mut().filter_map(Option::take) {
                    if let Msg::Response { id, value } = m
                        && let Some(tx) = p.remove(&id)
                    {
                        let _ = tx.send(value);
                    }
                }
            }
            // A reply that did not decode: dropped (its request will be retried).
            Err(chunnel::Error::Layer { .. } | chunnel::Error::Malformed { .. }) => {}
            Err(_) => break,
        }
    }
    // Wakes every waiter with `Closed`.
    pending.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

#[cfg(test)]
mod tests {
    use chunnel_std::serialize::{Bincode, Format, Json};

    use super::*;

    /// `Msg` as it was declared before its byte strings became serde bytes.
    #[derive(SerdeSerialize, Deserialize, Debug, PartialEq)]
    enum PlainOp {
        Get { key: Vec<u8> },
        Put { key: Vec<u8>, value: Vec<u8> },
        Delete { key: Vec<u8> },
    }

    #[derive(SerdeSerialize, Deserialize, Debug, PartialEq)]
    enum PlainMsg {
        Request { client: u64, id: u64, op: PlainOp },
        Response { id: u64, value: Option<Vec<u8>> },
    }

    #[test]
    fn byte_strings_keep_the_wire_format() {
        let v = vec![7u8; 300];
        let pairs = [
            (
                Msg::Request {
                    client: 9,
                    id: 1 << 40,
                    op: Op::Put {
                        key: b"user1".to_vec(),
                        value: v.clone(),
                    },
                },
                PlainMsg::Request {
                    client: 9,
                    id: 1 << 40,
                    op: PlainOp::Put {
                        key: b"user1".to_vec(),
                        value: v.clone(),
                    },
                },
            ),
            (
                Msg::Request {
                    client: 1,
                    id: 2,
                    op: Op::Get { key: Vec::new() },
                },
                PlainMsg::Request {
                    client: 1,
                    id: 2,
                    op: PlainOp::Get { key: Vec::new() },
                },
            ),
            (
                Msg::Request {
                    client: 1,
                    id: 3,
                    op: Op::Delete { key: b"k".to_vec() },
                },
                PlainMsg::Request {
                    client: 1,
                    id: 3,
                    op: PlainOp::Delete { key: b"k".to_vec() },
                },
            ),
            (
                Msg::Response {
                    id: 5,
                    value: Some(v.clone()),
                },
                PlainMsg::Response {
                    id: 5,
                    value: Some(v),
                },
            ),
            (
                Msg::Response { id: 6, value: None },
                PlainMsg::Response { id: 6, value: None },
            ),
        ];
        for (m, p) in pairs {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            Bincode::encode(&m, &mut a).unwrap();
            Bincode::encode(&p, &mut b).unwrap();
            assert_eq!(a, b, "{m:?}");
            assert_eq!(Bincode::decode::<Msg>(&b).unwrap(), m);
            assert_eq!(Bincode::decode::<PlainMsg>(&a).unwrap(), p);
            // JSON (a sequence of numbers) reads back too.
            let mut j = Vec::new();
            Json::encode(&p, &mut j).unwrap();
            assert_eq!(Json::decode::<Msg>(&j).unwrap(), m);
            let mut j = Vec::new();
            Json::encode(&m, &mut j).unwrap();
            assert_eq!(Json::decode::<Msg>(&j).unwrap(), m);
        }
        // Truncated byte strings fail to decode, they do not panic.
        let mut a = Vec::new();
        Bincode::encode(
            &Msg::Response {
                id: 1,
                value: Some(vec![1; 50]),
            },
            &mut a,
        )
        .unwrap();
        for n in 0..a.len() {
            assert!(Bincode::decode::<Msg>(&a[..n]).is_err());
        }
    }
}
