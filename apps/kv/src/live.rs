//! A store client whose sharding mode can be switched while it runs: the client stack of
//! [`KvClient`](crate::KvClient) with its select made reconfigurable,
//! `select(ClientShard, ViaCanonical).reconfigurable::<LockFree>()` over
//! `Shared | Serialize<Msg, bincode>` (`chunnel-bench soak` runs on it). The server serves
//! both modes at once, so a switch is unilateral. [`LiveClient::register`] puts it on a
//! control endpoint with its switch handle, and [`load`] drives checked traffic through it:
//! `chunnel-kv load --control PATH`, then `chunnelctl switch ID server-side`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use chunnel::{
    ChunnelConnection, ConnectionExt, LockFree, Reconfigurable, Shared, Side, Stack, select,
};
use chunnel_ctl::{Entry, Guard, LayerCounters, Negotiation, Policy, ReconfigSwitch, Registry};
use chunnel_std::shard::{ClientShard, ViaCanonical};
use tokio::sync::{Semaphore, oneshot};

use crate::{ClientConfig, KvError, Msg, Op, Pending, Ser, Udp};

type Sel = Reconfigurable<ClientShard<Udp, Ser>, ViaCanonical, LockFree>;
type LiveStack = Stack<Sel, Stack<Shared, Ser>>;
type Conn = chunnel_negotiate::Conn<LiveStack>;

/// Counters of a [`LiveClient`] and its [`load`].
#[derive(Debug, Default)]
pub struct LiveStats {
    /// Requests issued.
    pub requests: AtomicU64,
    /// Requests answered.
    pub answered: AtomicU64,
    /// Requests that failed (no reply after every retry, or the connection ended).
    pub failed: AtomicU64,
    /// Sends after the first of a request (its reply was late or lost).
    pub retries: AtomicU64,
    /// Replies for no waiting request (a retried request's second reply, or one after its
    /// caller gave up).
    pub late_replies: AtomicU64,
    /// Answers [`load`] found wrong: a PUT whose previous value was not the one this client
    /// wrote last (a lost, repeated or reordered write).
    pub wrong: AtomicU64,
}

/// A store client on a reconfigurable sharding select.
#[derive(Debug)]
pub struct LiveClient {
    conn: Arc<Conn>,
    addr: SocketAddr,
    negotiation: Negotiation,
    client: u64,
    next: AtomicU64,
    pending: Arc<Pending>,
    slots: Semaphore,
    cfg: ClientConfig,
    stats: Arc<LiveStats>,
    /// The receive task ended (the connection failed): calls fail at once.
    dead: Arc<AtomicBool>,
    rx: tokio::task::JoinHandle<()>,
}

impl Drop for LiveClient {
    fn drop(&mut self) {
        self.rx.abort();
    }
}

impl LiveClient {
    /// Negotiates with the server at `addr` (it must offer client push: the client learns
    /// the shard set for whenever it runs on that branch).
    pub async fn connect(addr: SocketAddr, cfg: ClientConfig) -> Result<Self, KvError> {
        let push = ClientShard::new(Udp, Ser::default());
        let dir = push.directory();
        let sel: Sel = select(push, ViaCanonical::new()).reconfigurable::<LockFree>();
        let stack: LiveStack = chunnel::stack![sel, Shared, Ser::default()];
        let conn = chunnel_negotiate::Connector::new(cfg.negotiate)
            .connect(addr, stack.clone())
            .await?;
        if dir.learn(&conn.info().server_stack)? == 0 {
            return Err(chunnel_std::Error::BadShardSet {
                what: "the server advertised no shards (started with --no-client-push?)".into(),
            }
            .into());
        }
        let negotiation = Negotiation::client(conn.info(), &stack);
        let conn = Arc::new(conn);
        let pending: Arc<Pending> = Arc::default();
        let stats = Arc::new(LiveStats::default());
        let dead = Arc::new(AtomicBool::new(false));
        let rx = tokio::spawn(receive(
            Arc::clone(&conn),
            Arc::clone(&pending),
            Arc::clone(&stats),
            Arc::clone(&dead),
        ));
        Ok(LiveClient {
            conn,
            addr,
            negotiation,
            client: chunnel::util::random_u64(),
            next: AtomicU64::new(1),
            pending,
            slots: Semaphore::new(cfg.max_outstanding.max(1)),
            cfg,
            stats,
            dead,
            rx,
        })
    }

    /// The sharding mode the client runs on: `Left` = client push, `Right` = server-side.
    pub fn side(&self) -> Side {
        self.conn.get_ref().side()
    }

    /// Switches of the sharding select so far.
    pub fn switches(&self) -> u64 {
        self.conn.get_ref().switches()
    }

    /// Switches the sharding mode (`Left` = client push, `Right` = server-side) without
    /// losing a request; `Ok(false)` if it already runs on `to`.
    pub async fn reconfigure(&self, to: Side) -> Result<bool, KvError> {
        Ok(self.conn.get_ref().reconfigure(to).await?)
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<LiveStats> {
        &self.stats
    }

    /// Registers the connection in `registry`: peer, negotiation, its counters, and its
    /// switch handle (branches `client-push` and `server-side`, unilateral).
    pub fn register(&self, registry: &Registry, name: &str) -> Guard {
        let stats = Arc::clone(&self.stats);
        registry.register(
            Entry::connection(name)
                .with_peer(self.addr)
                .with_negotiation(self.negotiation.clone())
                .with_counters(move || {
                    let c = |a: &AtomicU64| a.load(Relaxed);
                    vec![LayerCounters::new(
                        "kv-client",
                        [
                            ("requests", c(&stats.requests)),
                            ("answered", c(&stats.answered)),
                            ("failed", c(&stats.failed)),
                            ("retries", c(&stats.retries)),
                            ("late-replies", c(&stats.late_replies)),
                            ("wrong", c(&stats.wrong)),
                        ],
                    )]
                })
                .with_switch(ReconfigSwitch::new(
                    self.conn.get_ref().clone(),
                    "client-push",
                    "server-side",
                )),
        )
    }

    /// Sends `op` (retrying like [`KvClient::call`](crate::KvClient::call)) and waits for
    /// its reply.
    ///
    /// Fails at once with [`KvError::Closed`] once the connection failed (its receive task
    /// ended).
    pub async fn call(&self, op: Op) -> Result<Option<Vec<u8>>, KvError> {
        if self.dead.load(Relaxed) {
            return Err(KvError::Closed);
        }
        let _slot = self.slots.acquire().await.map_err(|_| KvError::Closed)?;
        let id = self.next.fetch_add(1, Relaxed);
        let (tx, mut rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, tx);
        let _waiting = crate::Entry {
            pending: &self.pending,
            id,
        };
        self.stats.requests.fetch_add(1, Relaxed);
        let mut wait = self.cfg.timeout;
        let attempts = self.cfg.attempts.max(1);
        for attempt in 0..attempts {
            if attempt > 0 {
                self.stats.retries.fetch_add(1, Relaxed);
            }
            let req = Msg::Request {
                client: self.client,
                id,
                op: op.clone(),
            };
            if let Err(e) = self.conn.send_one(req).await {
                self.stats.failed.fetch_add(1, Relaxed);
                return Err(e.into());
            }
            match tokio::time::timeout(wait, &mut rx).await {
                Ok(Ok(v)) => {
                    self.stats.answered.fetch_add(1, Relaxed);
                    return Ok(v);
                }
                Ok(Err(_)) => break,
                Err(_) => wait = (wait * 2).min(Duration::from_secs(1)),
            }
        }
        self.stats.failed.fetch_add(1, Relaxed);
        Err(KvError::Timeout { attempts })
    }
}

impl crate::ycsb::Target for LiveClient {
    fn call(&self, op: Op) -> impl Future<Output = Result<Option<Vec<u8>>, KvError>> {
        LiveClient::call(self, op)
    }
}

async fn receive(
    conn: Arc<Conn>,
    pending: Arc<Pending>,
    stats: Arc<LiveStats>,
    dead: Arc<AtomicBool>,
) {
    let mut slots: Vec<Option<Msg>> = vec![None; 32];
    loop {
        match conn.recv(&mut slots).await {
            Ok(n) => {
                let mut p = pending.lock().unwrap_or_else(|e| e.into_inner());
                for m in slots[..n].iter_mut().filter_map(Option::take) {
                    if let Msg::Response { id, value } = m {
                        match p.remove(&id) {
                            Some(tx) => {
                                let _ = tx.send(value);
                            }
                            None => {
                                stats.late_replies.fetch_add(1, Relaxed);
                            }
                        }
                    }
                }
            }
            // A reply that did not decode: dropped (its request will be retried).
            Err(chunnel::Error::Layer { .. } | chunnel::Error::Malformed { .. }) => {}
            Err(_) => break,
        }
    }
    dead.store(true, Relaxed);
    // Wakes every waiter with `Closed`.
    pending.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// Checked traffic until `stop` resolves: `writers` tasks, each writing its own key
/// (`{prefix}-{w}`) with the values 1, 2, 3...; each PUT must answer the value written
/// before it (none for the first), else [`LiveStats::wrong`] counts it. The total rate is
/// `rate`'s value in requests per second, read again before every request (so an operator
/// can change it with `chunnelctl policy rate N`).
pub async fn load(
    client: Arc<LiveClient>,
    writers: usize,
    rate: Policy,
    stop: impl std::future::Future<Output = ()>,
) {
    let prefix = format!("live-{:x}", chunnel::util::random_u64());
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..writers.max(1) {
        let (client, rate, key) = (
            Arc::clone(&client),
            rate.clone(),
            format!("{prefix}-{w}").into_bytes(),
        );
        let writers = writers.max(1) as f64;
        tasks.spawn(async move {
            let mut last: Option<Vec<u8>> = None;
            let mut next = tokio::time::Instant::now();
            for n in 1u64.. {
                let per_sec = rate.get().parse::<f64>().unwrap_or(100.0).max(1.0);
                let value = n.to_string().into_bytes();
                match client
                    .call(Op::Put {
                        key: key.clone(),
                        value: value.clone(),
                    })
                    .await
                {
                    Ok(prev) if prev == last => last = Some(value),
                    Ok(_) => {
                        client.stats.wrong.fetch_add(1, Relaxed);
                        last = Some(value);
                    }
                    // Unknown whether it was applied: read what is there.
                    Err(_) => {
                        if let Ok(v) = client.call(Op::Get { key: key.clone() }).await {
                            last = v;
                        }
                    }
                }
                // Paced by deadline, not by sleeping after each call: the call's own time
                // does not slow the rate (a writer behind schedule does not burst to catch
                // up, though).
                next = (next + Duration::from_secs_f64(writers / per_sec))
                    .max(tokio::time::Instant::now());
                tokio::time::sleep_until(next).await;
            }
        });
    }
    stop.await;
    tasks.abort_all();
}

/// The name [`LiveClient::register`] is given by `chunnel-kv load`, which the autopilot's
/// rule names.
pub const ENTRY: &str = "kv client (switchable)";

/// The autopilot rule of `chunnel-kv load --autopilot`: server-side sharding while the
/// request rate is low, client push (no forwarding hop) once it is above 400 requests/s
/// over 2 s, back below 200/s; at most one switch per 5 s.
pub const AUTOPILOT_RULE: &str = r#"entry="kv client (switchable)" counter=kv-client/requests window=2s up=400 down=200 dwell=5s above=client-push below=server-side"#;

/// A load ramp: `RATE:SECONDS` steps, comma separated (`100:10,800:20,100:20`): the `rate`
/// policy is set to each rate in turn for its seconds, and stays at the last one.
#[derive(Clone, Debug, PartialEq)]
pub struct Ramp(pub Vec<(u32, Duration)>);

/// Parses a [`Ramp`].
pub fn parse_ramp(s: &str) -> Result<Ramp, String> {
    s.split(',')
        .map(|step| {
            let (r, secs) = step
                .split_once(':')
                .ok_or_else(|| format!("{step:?} is not RATE:SECONDS"))?;
            valid_rate(r)?;
            let secs: f64 = secs
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s >= 0.0 && *s <= 86_400.0)
                .ok_or_else(|| format!("{secs:?} is not a number of seconds"))?;
            Ok((r.parse().unwrap_or(1), Duration::from_secs_f64(secs)))
        })
        .collect::<Result<_, String>>()
        .map(Ramp)
}

/// Runs a ramp on the `rate` policy of `registry` (see [`parse_ramp`]).
pub async fn ramp(registry: chunnel_ctl::Registry, steps: Ramp) {
    for (rate, secs) in steps.0 {
        let _ = registry.set_policy("rate", &rate.to_string());
        tokio::time::sleep(secs).await;
    }
}

/// Validates a `rate` policy value: requests per second, 1 to 100 000.
pub fn valid_rate(v: &str) -> Result<(), String> {
    match v.parse::<u32>() {
        Ok(1..=100_000) => Ok(()),
        _ => Err(format!(
            "{v:?} is not a rate in requests per second (1 to 100000)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ramps() {
        let r = parse_ramp("100:10,800:2.5,1:0").unwrap();
        assert_eq!(
            r.0,
            [
                (100, Duration::from_secs(10)),
                (800, Duration::from_millis(2500)),
                (1, Duration::ZERO)
            ]
        );
        for bad in ["100", "0:1", "100:x", "100:-1", "100:1,", "fast:1"] {
            assert!(parse_ramp(bad).is_err(), "{bad}");
        }
    }
}
