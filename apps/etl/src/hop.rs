//! The point-to-point hops (producer → ingest servers, parser → consumers): a negotiated stack
//! over UDP, a sender that balances batches over several servers with acknowledgements,
//! retransmission and failover, and the server side that acknowledges what it handled.
//!
//! ```text
//! stack (both ends):  Serialize<Msg, bincode> | select(LocalFastPath, Identity) | Tagged<UDP>
//! ```
//!
//! Negotiation picks shared memory when both ends share this host's `/dev/shm`, else the
//! datagrams stay on the kernel UDP socket the stack was negotiated over.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chunnel::{ConnectionExt, Identity, Select, Side, Stack, select, stack};
use chunnel_negotiate::{Config as NegotiateConfig, Connector};
use chunnel_shm::{LocalFastPath, Role};
use chunnel_std::serialize::{Bincode, Serialize};
use tokio::sync::{Semaphore, oneshot, watch};
use tokio::task::JoinSet;

use crate::Error;
use crate::record::{Body, Msg};

/// The stack of both ends of a hop, top first.
pub type HopStack = Stack<Serialize<Msg, Bincode>, Select<LocalFastPath, Identity>>;
/// A client's negotiated connection.
pub type ClientConn = chunnel_negotiate::Conn<HopStack>;
/// A server's negotiated connection.
pub type ServerConn = chunnel_negotiate::ServerConn<HopStack>;
/// A negotiated server.
pub type HopServer = chunnel_negotiate::Server<HopStack>;

/// The hop's stack for one end. With `shm` false the shared-memory branch is not offered (its
/// directory does not exist), so negotiation keeps the connection on UDP as it does between
/// hosts.
pub fn hop_stack(role: Role, shm: bool) -> HopStack {
    let mut cfg = chunnel_shm::Config::default();
    if !shm {
        cfg.dir = "/nonexistent/chunnel-etl-no-shm".into();
    }
    stack![
        Serialize::bincode(),
        select(LocalFastPath::new(role, cfg), Identity)
    ]
}

/// Which datapath negotiation picked: `"shm"` or `"udp"`.
pub fn path_of<A, C>(either: &chunnel::Either<A, C>) -> &'static str {
    match either.side() {
        Side::Left => "shm",
        Side::Right => "udp",
    }
}

/// Whether a receive error leaves the connection usable: a message that did not decode (the
/// serialization layer) or a malformed frame is counted and skipped.
pub(crate) fn skippable(e: &chunnel::Error) -> bool {
    matches!(
        e,
        chunnel::Error::Layer { .. } | chunnel::Error::Malformed { .. }
    )
}

/// Settings of a [`HopSender`].
#[derive(Clone, Debug)]
pub struct SenderConfig {
    /// Batches sent and not yet acknowledged, at most (then `send` waits). Default 64.
    pub window: usize,
    /// First wait for an acknowledgement; doubles with each retransmission. Default 200 ms.
    pub ack_timeout: Duration,
    /// Sends of a batch to one server before it is suspected and the batch goes to another.
    /// Default 3.
    pub attempts: u32,
    /// How long a batch is tried in all before `send` fails. Default 30 s.
    pub give_up: Duration,
    /// Offer shared memory. Default true.
    pub shm: bool,
    /// A server whose connection ended (or that did not answer at first) is negotiated with
    /// again, first after 100 ms, then after twice the previous wait up to this. Default 2 s.
    pub reconnect_max: Duration,
}

impl Default for SenderConfig {
    fn default() -> Self {
        SenderConfig {
            window: 64,
            ack_timeout: Duration::from_millis(200),
            attempts: 3,
            give_up: Duration::from_secs(30),
            shm: true,
            reconnect_max: Duration::from_secs(2),
        }
    }
}

/// What a [`HopSender`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SenderStats {
    /// Batches acknowledged.
    pub acked: u64,
    /// Sends of a batch after its first.
    pub retransmits: u64,
    /// Batches moved to another server after their server failed or stayed silent.
    pub failovers: u64,
    /// Messages received that did not decode, or were not acknowledgements.
    pub malformed: u64,
    /// Connections negotiated again with a server whose connection had ended (or that did not
    /// answer at first).
    pub reconnects: u64,
}

/// A negotiated connection to a server and the datapath negotiation picked.
#[derive(Clone)]
struct Link {
    conn: Arc<ClientConn>,
    path: &'static str,
}

struct Target {
    addr: SocketAddr,
    /// `None` until negotiated (a server that did not answer at first).
    link: Mutex<Option<Link>>,
    /// False once its connection failed or it let a batch go unacknowledged.
    alive: AtomicBool,
    /// True while it has no connection (it ended: the peer closed it or died; or it was never
    /// made): waits for its acknowledgements end at once.
    gone: watch::Sender<bool>,
    /// Batches it acknowledged.
    acked: AtomicU64,
}

impl Target {
    fn link(&self) -> Option<Link> {
        self.link.lock().unwrap().clone()
    }
}

type Pending = Mutex<HashMap<u64, oneshot::Sender<()>>>;

struct Inner {
    targets: Vec<Target>,
    connector: Connector,
    next: AtomicUsize,
    next_batch: AtomicU64,
    pending: Pending,
    window: Semaphore,
    cfg: SenderConfig,
    acked: AtomicU64,
    retransmits: AtomicU64,
    failovers: AtomicU64,
    malformed: AtomicU64,
    reconnects: AtomicU64,
}

/// Sends batches to a set of servers (ingest servers, consumers): each batch to the next live
/// server in turn (round-robin load balancing), retransmitted until that server acknowledges
/// it, and moved to another server when its server fails or stays silent ([`SenderConfig`]).
/// `send` returns once the batch was acknowledged, so a caller that keeps its records until
/// then loses none when a server dies; a batch may then reach two servers (the consumers drop
/// the copies by record id). A server whose connection ended is negotiated with again, with a
/// bounded backoff ([`SenderConfig::reconnect_max`]), and takes its turn again once it is back
/// (a server restarted on the same address gets batches again).
pub struct HopSender {
    inner: Arc<Inner>,
    tasks: JoinSet<()>,
}

impl std::fmt::Debug for HopSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HopSender")
            .field("targets", &self.paths())
            .finish_non_exhaustive()
    }
}

impl HopSender {
    /// Negotiates a connection to every server of `addrs`; fails if none answers. Those that
    /// do not answer are tried again in the background, as servers whose connection ended.
    pub async fn connect(addrs: &[SocketAddr], cfg: SenderConfig) -> Result<HopSender, Error> {
        let mut ncfg = NegotiateConfig::default();
        ncfg.timing.attempts = 5;
        let connector = Connector::new(ncfg);
        let mut targets = Vec::new();
        let mut last = None;
        for &addr in addrs {
            let link = match negotiate(&connector, addr, cfg.shm).await {
                Ok(link) => Some(link),
                Err(e) => {
                    tracing::warn!(%addr, error = %e, "server did not negotiate");
                    last = Some(format!("{addr}: {e}"));
                    None
                }
            };
            targets.push(Target {
                addr,
                alive: AtomicBool::new(link.is_some()),
                gone: watch::Sender::new(link.is_none()),
                link: Mutex::new(link),
                acked: AtomicU64::new(0),
            });
        }
        if targets.iter().all(|t| t.link().is_none()) {
            return Err(Error::NoServer {
                last: last.unwrap_or_else(|| "no address given".into()),
            });
        }
        let inner = Arc::new(Inner {
            targets,
            connector,
            next: AtomicUsize::new(0),
            next_batch: AtomicU64::new(0),
            pending: Mutex::new(HashMap::new()),
            window: Semaphore::new(cfg.window.max(1)),
            cfg,
            acked: AtomicU64::new(0),
            retransmits: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
        });
        let mut tasks = JoinSet::new();
        for i in 0..inner.targets.len() {
            tasks.spawn(receive_acks(Arc::clone(&inner), i));
        }
        Ok(HopSender { inner, tasks })
    }

    /// Each connected server and the datapath negotiation picked for it (servers without a
    /// connection now are left out).
    pub fn paths(&self) -> Vec<(SocketAddr, &'static str)> {
        self.inner
            .targets
            .iter()
            .filter_map(|t| t.link().map(|l| (t.addr, l.path)))
            .collect()
    }

    /// Batches each server (in the order given to [`HopSender::connect`]) acknowledged so far.
    pub fn acked_by(&self) -> Vec<(SocketAddr, u64)> {
        self.inner
            .targets
            .iter()
            .map(|t| (t.addr, t.acked.load(Ordering::Relaxed)))
            .collect()
    }

    /// Batches that may await their acknowledgement at once ([`SenderConfig::window`]).
    pub fn window(&self) -> usize {
        self.inner.cfg.window.max(1)
    }

    /// What it did so far.
    pub fn stats(&self) -> SenderStats {
        let i = &self.inner;
        SenderStats {
            acked: i.acked.load(Ordering::Relaxed),
            retransmits: i.retransmits.load(Ordering::Relaxed),
            failovers: i.failovers.load(Ordering::Relaxed),
            malformed: i.malformed.load(Ordering::Relaxed),
            reconnects: i.reconnects.load(Ordering::Relaxed),
        }
    }

    /// Sends `body` and waits until a server acknowledged it (at most
    /// [`SenderConfig::give_up`]). At most [`SenderConfig::window`] sends are under way at once;
    /// more wait for room.
    pub fn send(&self, body: Body) -> impl Future<Output = Result<(), Error>> + Send + 'static {
        let inner = Arc::clone(&self.inner);
        async move { inner.deliver(body).await }
    }
}

impl Drop for HopSender {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

impl Inner {
    /// The next live server in turn; any server if none is live (a suspected one may be back).
    fn pick(&self) -> usize {
        let n = self.targets.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| self.targets[i].alive.load(Ordering::Relaxed))
            .unwrap_or(start % n)
    }

    async fn deliver(&self, body: Body) -> Result<(), Error> {
        let _permit = self.window.acquire().await.map_err(|_| Error::Stopped)?;
        let batch = self.next_batch.fetch_add(1, Ordering::Relaxed);
        let (tx, mut rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(batch, tx);
        let msg = Msg::Data { batch, body };
        let started = Instant::now();
        let result = 'outer: loop {
            if started.elapsed() > self.cfg.give_up {
                break Err(Error::NotAcknowledged {
                    waited: started.elapsed(),
                });
            }
            let i = self.pick();
            let t = &self.targets[i];
            let mut wait = self.cfg.ack_timeout;
            let mut gone = t.gone.subscribe();
            let link = t.link();
            for attempt in 0..self.cfg.attempts.max(1) {
                let Some(link) = link.as_ref().filter(|_| !*gone.borrow()) else {
                    break;
                };
                if attempt > 0 {
                    self.retransmits.fetch_add(1, Ordering::Relaxed);
                }
                if let Err(e) = link.conn.send_one(msg.clone()).await {
                    tracing::debug!(addr = %t.addr, error = %e, "send failed");
                    break;
                }
                tokio::select! {
                    r = tokio::time::timeout(wait, &mut rx) => match r {
                        Ok(_) => break 'outer Ok(()),
                        Err(_) => wait = wait.saturating_mul(2),
                    },
                    // Its connection ended: the batch goes elsewhere now.
                    _ = gone.wait_for(|g| *g) => break,
                }
            }
            // Failed or silent: suspect it and try the batch elsewhere.
            t.alive.store(false, Ordering::Relaxed);
            self.failovers.fetch_add(1, Ordering::Relaxed);
            if self
                .targets
                .iter()
                .all(|t| !t.alive.load(Ordering::Relaxed))
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        self.pending.lock().unwrap().remove(&batch);
        if result.is_ok() {
            self.acked.fetch_add(1, Ordering::Relaxed);
        }
        result
    }
}

/// Negotiates the hop's stack with the server at `addr`.
async fn negotiate(connector: &Connector, addr: SocketAddr, shm: bool) -> Result<Link, Error> {
    let conn = connector
        .connect(addr, hop_stack(Role::Client, shm))
        .await?;
    let path = path_of(conn.get_ref().get_ref());
    Ok(Link {
        conn: Arc::new(conn),
        path,
    })
}

/// Reads server `i`'s acknowledgements; when its connection ends (or there is none yet),
/// negotiates with it again, after 100 ms, then twice the previous wait up to
/// [`SenderConfig::reconnect_max`], until it answers; then it takes its turn again.
async fn receive_acks(inner: Arc<Inner>, i: usize) {
    let t = &inner.targets[i];
    loop {
        if let Some(link) = t.link() {
            read_acks(&inner, t, &link.conn).await;
            tracing::debug!(addr = %t.addr, "server connection ended");
            t.alive.store(false, Ordering::Relaxed);
            t.gone.send_replace(true);
            *t.link.lock().unwrap() = None;
        }
        let mut pause = Duration::from_millis(100);
        let link = loop {
            tokio::time::sleep(pause).await;
            // Bounded: a negotiation that hangs counts as a failed attempt.
            let attempt = tokio::time::timeout(
                inner.cfg.reconnect_max.max(Duration::from_secs(1)),
                negotiate(&inner.connector, t.addr, inner.cfg.shm),
            )
            .await;
            match attempt {
                Ok(Ok(link)) => break link,
                Ok(Err(e)) => tracing::debug!(addr = %t.addr, error = %e, "reconnect failed"),
                Err(_) => tracing::debug!(addr = %t.addr, "reconnect timed out"),
            }
            pause = (pause * 2).min(inner.cfg.reconnect_max.max(Duration::from_millis(100)));
        };
        tracing::debug!(addr = %t.addr, path = link.path, "server back");
        *t.link.lock().unwrap() = Some(link);
        inner.reconnects.fetch_add(1, Ordering::Relaxed);
        t.gone.send_replace(false);
        t.alive.store(true, Ordering::Relaxed);
    }
}

/// Hands `conn`'s acknowledgements to their batches until it fails.
async fn read_acks(inner: &Inner, t: &Target, conn: &ClientConn) {
    loop {
        match conn.recv_one().await {
            Ok(Msg::Ack { batch }) => {
                // A server that answers is alive again.
                t.alive.store(!*t.gone.borrow(), Ordering::Relaxed);
                if let Some(tx) = inner.pending.lock().unwrap().remove(&batch) {
                    t.acked.fetch_add(1, Ordering::Relaxed);
                    let _ = tx.send(());
                }
            }
            Ok(Msg::Data { .. }) => {
                inner.malformed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) if skippable(&e) => {
                inner.malformed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::debug!(addr = %t.addr, error = %e, "server connection failed");
                return;
            }
        }
    }
}

/// What a server does with one batch: `true` acknowledges it.
pub type Handler = Arc<dyn Fn(Body) -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync>;

/// Counters of a [`serve`]d server.
#[derive(Debug, Default)]
pub struct ServeCounters {
    /// Connections negotiated, by datapath: `[shm, udp]`.
    pub conns: [AtomicU64; 2],
    /// Messages that did not decode, or were acknowledgements.
    pub malformed: AtomicU64,
}

/// Binds `addr` with the hop's server stack and serves it: each batch goes to `handler`, in
/// order per connection, and is acknowledged if the handler says so. Runs until the returned
/// set of tasks is dropped or aborted.
pub async fn serve(
    addr: SocketAddr,
    shm: bool,
    handler: Handler,
    counters: Arc<ServeCounters>,
) -> Result<(SocketAddr, JoinSet<()>), Error> {
    let mut server = chunnel_negotiate::bind(addr, hop_stack(Role::Server, shm)).await?;
    let local = server.local_addr();
    let mut tasks = JoinSet::new();
    tasks.spawn(async move {
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                accepted = server.accept() => match accepted {
                    Ok(conn) => {
                        let path = usize::from(path_of(conn.get_ref().get_ref()) == "udp");
                        counters.conns[path].fetch_add(1, Ordering::Relaxed);
                        conns.spawn(serve_conn(conn, Arc::clone(&handler), Arc::clone(&counters)));
                    }
                    Err(e) => tracing::debug!(error = %e, "a client failed to negotiate"),
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
    });
    Ok((local, tasks))
}

async fn serve_conn(conn: ServerConn, handler: Handler, counters: Arc<ServeCounters>) {
    loop {
        match conn.recv_one().await {
            Ok(Msg::Data { batch, body }) => {
                if handler(body).await && conn.send_one(Msg::Ack { batch }).await.is_err() {
                    return;
                }
            }
            Ok(Msg::Ack { .. }) => {
                counters.malformed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) if skippable(&e) => {
                counters.malformed.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => return,
        }
    }
}
