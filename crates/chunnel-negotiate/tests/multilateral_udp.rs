//! Multilateral reconfiguration over real UDP (loopback), many switches in a row:
//!
//! * what [`Outcome::Switched`] guarantees: when it returns, the peer's `side()` already shows
//!   the new branch (both ends agree), whichever end proposed;
//! * one shape for contention: when both ends propose at once, every switch that does not
//!   complete reports [`Outcome::Contended`], and retrying it converges.
//!
//! Traffic is light (one echo per round), so loopback UDP does not drop the protocol's
//! messages; the two-phase commit itself assumes a base that delivers in order and without
//! loss.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use chunnel::{
    Capability, Chunnel, ChunnelConnection, ConnectionExt, Error as ChunnelError, Handoff,
    Handover, LockFree, Negotiate, Reconfigurable, Side, select,
};
use chunnel_negotiate::commit::{Contention, Coordinator, Outcome, Policy};
use chunnel_negotiate::{Client, Config, Negotiated, listen};
use chunnel_net::udp;
use chunnel_test::{Xor, XorConn};
use tokio::sync::mpsc;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

/// How long taking over state (`Handover::import`) takes at the end that follows a switch: a
/// stateful layer copying its buffers. It widens the time between the follower's switch
/// point (its `DONE`) and the end of its switch, where a `side()` recorded late is visible.
const IMPORT_TAKES: Duration = Duration::from_millis(3);

/// [`Xor`] (same id and capability, so it interoperates) whose state transfer takes
/// [`IMPORT_TAKES`] while `slow` is set (one flag per end: the test sets the follower's).
#[derive(Clone, Debug)]
struct SlowXor {
    key: u8,
    slow: Arc<AtomicBool>,
}

impl Negotiate for SlowXor {
    fn id(&self) -> &'static str {
        Xor(self.key).id()
    }
    fn capabilities(&self) -> Vec<Capability> {
        Xor(self.key).capabilities()
    }
}

impl<C: ChunnelConnection<Data = Bytes> + Send> Chunnel<C> for SlowXor {
    type Connection = Slow<XorConn<C>>;
    async fn connect_wrap(&mut self, inner: C) -> Result<Self::Connection, ChunnelError> {
        Ok(Slow {
            inner: Xor(self.key).connect_wrap(inner).await?,
            slow: self.slow.clone(),
        })
    }
}

#[derive(Debug)]
struct Slow<C> {
    inner: C,
    slow: Arc<AtomicBool>,
}

impl<C: ChunnelConnection<Data = Bytes>> ChunnelConnection for Slow<C> {
    type Data = Bytes;
    async fn send<B>(&self, burst: B) -> Result<(), ChunnelError>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        self.inner.send(burst).await
    }
    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, ChunnelError> {
        self.inner.recv(slots).await
    }
}

impl<C: Handover<Data = Bytes>> Handover for Slow<C> {
    fn export(&self, state: &mut Handoff<Bytes>) {
        self.inner.export(state)
    }
    fn import(&self, state: &mut Handoff<Bytes>) {
        if self.slow.load(Ordering::Relaxed) {
            // Synchronous on purpose: the switch runs it after its switch point.
            std::thread::sleep(IMPORT_TAKES);
        }
        self.inner.import(state)
    }
}

type Stack = Reconfigurable<SlowXor, SlowXor, LockFree>;

/// Keys 1 (left) and 2 (right); imports slow while `slow` is set.
fn stack(slow: &Arc<AtomicBool>) -> Stack {
    let layer = |key| SlowXor {
        key,
        slow: slow.clone(),
    };
    select(layer(1), layer(2)).reconfigurable::<LockFree>()
}

fn patient() -> Policy {
    Policy {
        vote_timeout: WAIT,
        ..Policy::default()
    }
}

type ClientConn =
    Negotiated<<Stack as Chunnel<chunnel_negotiate::Tagged<udp::Connection>>>::Connection>;
type ServerConn =
    Negotiated<<Stack as Chunnel<chunnel_negotiate::Tagged<udp::ServerConnection>>>::Connection>;

/// Both ends of one negotiated UDP connection, each with a coordinator and a task that keeps
/// receiving (the protocol runs in-band): the server echoes, the client's task hands the
/// echoes to `echoes`.
struct Pair {
    client: Arc<ClientConn>,
    client_coord: Arc<Coordinator>,
    server: Arc<ServerConn>,
    server_coord: Arc<Coordinator>,
    echoes: mpsc::Receiver<Bytes>,
    /// Whether the client's, and the server's, state transfer is slow.
    client_slow: Arc<AtomicBool>,
    server_slow: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Pair {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Pair {
    async fn new() -> Result<Pair> {
        let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
        let addr = listener.local_addr()?;
        let (client_slow, server_slow) = (Arc::default(), Arc::default());
        let mut accepting = listen(stack(&server_slow), listener, Config::default());
        let base = udp::Connect::new(addr).connect_wrap(()).await?;
        let client = Client::new(Config::default())
            .connect(&addr.to_string(), stack(&client_slow), base)
            .await?;
        let server = timeout(WAIT, accepting.accept()).await??;
        let client_coord = Arc::new(Coordinator::start(
            &client,
            &stack(&client_slow),
            patient(),
        )?);
        let server_coord = Arc::new(Coordinator::start(
            &server,
            &stack(&server_slow),
            patient(),
        )?);
        let (client, server) = (Arc::new(client), Arc::new(server));
        let echo = {
            let server = server.clone();
            tokio::spawn(async move {
                let _accepting = accepting;
                while let Ok(m) = server.recv_one().await {
                    if server.send_one(m).await.is_err() {
                        break;
                    }
                }
            })
        };
        let (tx, echoes) = mpsc::channel(64);
        let reader = {
            let client = client.clone();
            tokio::spawn(async move {
                while let Ok(m) = client.recv_one().await {
                    if tx.send(m).await.is_err() {
                        break;
                    }
                }
            })
        };
        Ok(Pair {
            client,
            client_coord,
            server,
            server_coord,
            echoes,
            client_slow,
            server_slow,
            tasks: vec![echo, reader],
        })
    }

    fn sides(&self) -> (Side, Side) {
        (self.client.get_ref().side(), self.server.get_ref().side())
    }

    /// One echo through both stacks: they agree (a message encoded by one key and decoded
    /// by the other comes back garbled).
    async fn echo(&mut self, round: usize) -> Result<()> {
        let m = Bytes::from(format!("round-{round}"));
        self.client.send_one(m.clone()).await?;
        let r = timeout(WAIT, self.echoes.recv())
            .await
            .with_context(|| format!("no echo of {m:?}"))?
            .context("the client's receiver ended")?;
        ensure!(r == m, "sent {m:?}, got back {r:?}");
        Ok(())
    }
}

fn other(s: Side) -> Side {
    match s {
        Side::Left => Side::Right,
        Side::Right => Side::Left,
    }
}

/// 200 switches, alternately proposed by the client and the server. After every
/// `Switched`, the peer's `side()` must already be the new branch, read at once, without
/// waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_switched_returns_the_peer_already_shows_the_new_side() -> Result<()> {
    const SWITCHES: usize = 200;
    let mut p = Pair::new().await?;
    let mut stale = Vec::new();
    for i in 0..SWITCHES {
        let to = other(p.client.get_ref().side());
        let by_client = i % 2 == 0;
        let (proposer, peer) = if by_client {
            ("client", &p.client_coord)
        } else {
            ("server", &p.server_coord)
        };
        // The follower's state transfer is the slow one.
        p.client_slow.store(!by_client, Ordering::Relaxed);
        p.server_slow.store(by_client, Ordering::Relaxed);
        let out = timeout(WAIT, peer.switch(to))
            .await
            .with_context(|| format!("switch {i} ({proposer}) did not end"))??;
        // Read both at once: the guarantee is about the moment `switch` returns.
        let (client, server) = p.sides();
        ensure!(out == Outcome::Switched, "switch {i} ({proposer}): {out:?}");
        let (own_side, peer_side) = if by_client {
            (client, server)
        } else {
            (server, client)
        };
        ensure!(
            own_side == to,
            "switch {i}: the proposer shows {own_side:?}"
        );
        if peer_side != to {
            stale.push((i, proposer));
        }
        p.echo(i).await?;
    }
    ensure!(
        stale.is_empty(),
        "after {} of {SWITCHES} switches the peer still showed the old side when `Switched` \
         returned; the first (switch, proposer): {:?}",
        stale.len(),
        &stale[..stale.len().min(8)]
    );
    Ok(())
}

/// A pause of 0–2 ms, different each time.
fn jitter() -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u8(0);
    Duration::from_micros(h.finish() % 2_000)
}

/// How one end's attempts at a switch ended: contended attempts (by kind), then the last.
#[derive(Debug, Default)]
struct Attempts {
    contended: Vec<Contention>,
    last: Option<Outcome>,
}

/// Proposes `to` until the switch is done (`Switched`, or `Unchanged` when the peer's switch
/// went there first), retrying on `Contended` and nothing else: any other outcome or error is
/// a failure.
async fn switch_retrying(coord: &Coordinator, to: Side) -> Result<Attempts> {
    let mut a = Attempts::default();
    for _ in 0..1_000 {
        match timeout(WAIT, coord.switch(to))
            .await
            .context("a switch did not end")?
        {
            Ok(Outcome::Contended(c)) => {
                a.contended.push(c);
                tokio::time::sleep(jitter()).await;
            }
            Ok(out @ (Outcome::Switched | Outcome::Unchanged)) => {
                a.last = Some(out);
                return Ok(a);
            }
            Ok(other) => bail!("not contention, not done: {other:?} (after {a:?})"),
            Err(e) => bail!("an error, not an outcome: {e} (after {a:?})"),
        }
    }
    bail!("1,000 contended attempts: {a:?}")
}

/// Both ends propose the same switch at the same moment, 200 rounds. Each end retries on
/// `Contended` only; every attempt that does not switch must be `Contended`, each round ends
/// with exactly one end `Switched` at first or after retries, both ends on the new side, and
/// an echo through both stacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_proposals_lose_with_one_outcome_and_retry() -> Result<()> {
    const ROUNDS: usize = 200;
    let mut p = Pair::new().await?;
    let (mut contended_rounds, mut kinds) = (0, std::collections::BTreeMap::new());
    for round in 0..ROUNDS {
        let to = other(p.client.get_ref().side());
        let barrier = tokio::sync::Barrier::new(2);
        let end = |coord: Arc<Coordinator>| {
            let barrier = &barrier;
            async move {
                barrier.wait().await;
                switch_retrying(&coord, to).await
            }
        };
        let (c, s) = tokio::join!(end(p.client_coord.clone()), end(p.server_coord.clone()));
        let (c, s) = (
            c.with_context(|| format!("round {round}, client"))?,
            s.with_context(|| format!("round {round}, server"))?,
        );
        // Switched at least once (a late end finds it done: Unchanged); at most twice (a
        // retry that starts before its end has recorded the switch it followed proposes
        // the same branch again, which is harmless).
        ensure!(
            [&c, &s].iter().any(|a| a.last == Some(Outcome::Switched)),
            "round {round}: nobody switched: {c:?} / {s:?}"
        );
        ensure!(
            p.sides() == (to, to),
            "round {round}: sides {:?}",
            p.sides()
        );
        if !c.contended.is_empty() || !s.contended.is_empty() {
            contended_rounds += 1;
        }
        for k in c.contended.iter().chain(&s.contended) {
            let name = match k {
                Contention::Local => "local",
                Contention::Peer { .. } => "peer",
                Contention::Superseded => "superseded",
            };
            *kinds.entry(name).or_insert(0usize) += 1;
        }
        p.echo(round).await?;
    }
    println!("{contended_rounds} of {ROUNDS} rounds contended; contended attempts: {kinds:?}");
    // Both ends start together, so most rounds collide; require enough that the loser's
    // side was exercised (the exact share depends on scheduling).
    ensure!(
        contended_rounds >= ROUNDS / 10,
        "only {contended_rounds} of {ROUNDS} rounds had contention"
    );
    Ok(())
}
