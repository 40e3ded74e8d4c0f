//! Deterministic simulation of a whole negotiated connection over a faulty network: thousands
//! of seeds, each reproducible on its own (docs/testing.md, "Deterministic simulation").
//!
//! Per seed, on a current-thread runtime with a paused clock (virtual time, one thread, no
//! socket):
//!
//! * **the network**: an in-memory datagram link (`chunnel_test::sim::MemConn`) with a seeded
//!   `FaultInjector` at each end (drop, duplicate, reorder, delay on what the end sends; the
//!   probabilities and bounds are drawn from the seed, one seed in eight has none);
//! * **the base of the negotiation**: `Ordered` over `Reliable` (chunnel-std) over that link,
//!   so the negotiated connection sees what the two-phase commit assumes (in order, no loss)
//!   built by the crates' own layers out of a network that gives neither;
//! * **the negotiated stack**: a reconfigurable select of two `Xor` layers (an exact
//!   capability; ends that disagree garble each other's messages), the server's branches in
//!   an order drawn from the seed, so the pick is not always the first branch; a
//!   `Coordinator` at each end (in one seed in eight an end refuses its peer's proposals);
//! * **traffic**: the client pipelines numbered messages in bursts, the server echoes;
//! * **reconfiguration mid-stream**: up to three multilateral switches, each started by the
//!   client, the server or both at once, at a point of the stream drawn from the seed, with
//!   vote timeouts and resend periods drawn from the seed (short ones abort).
//!
//! Checked on every seed:
//!
//! * both ends agree on the pick (the same `Xor` key) after the handshake;
//! * every message is delivered exactly once and in order at the server, and every echo at
//!   the client (a message through the wrong key arrives garbled and fails the check);
//! * when a switch returns `Switched`, the peer's `side()` already shows the same key; every
//!   switch returns (`Switched`, `Aborted`, `Contended` or `Unchanged`, never an error or a
//!   hang);
//! * after the last echo and a quiet period, both ends are on the same key, nothing more
//!   arrives, and a final exchange goes through.
//!
//! `sim_control_over_lossy_links` runs the handshake and the two-phase commit with no
//! `Reliable` under them (see `control_scenario`).
//!
//! `CHUNNEL_SIM_SEED=<n>` reruns one seed, `CHUNNEL_SIM_SEEDS=<count>` (from
//! `CHUNNEL_SIM_FIRST`, default 0) runs more; `-- --nocapture` prints the totals.

// `tokio_unstable` is tokio's cfg for its unstable API (here: seeding its RNG).
#![allow(unexpected_cfgs)]

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, LockFree, Reconfigurable, Side, select, stack};
use chunnel_negotiate::commit::{Coordinator, Outcome, Policy};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_std::ordered::Ordered;
use chunnel_std::reliable::{self, Reliable};
use chunnel_test::Xor;
use chunnel_test::fault::{FaultInjector, FaultStats, Faults};
use chunnel_test::sim::{Base, BaseListener, Explorer, MemConn, SimRng, mem_net, within};
use tokio::sync::{mpsc, oneshot, watch};

/// Seeds per run of `sim_negotiated_connections` (CI).
const SEEDS: u64 = 1_500;

const RERUN: &str = "cargo test -p chunnel-negotiate --test sim_connection -- sim_negotiated_connections --nocapture";

type Stack = Reconfigurable<Xor, Xor, LockFree>;

fn stack(keys: [u8; 2]) -> Stack {
    select(Xor(keys[0]), Xor(keys[1])).reconfigurable::<LockFree>()
}

fn key(keys: [u8; 2], side: Side) -> u8 {
    match side {
        Side::Left => keys[0],
        Side::Right => keys[1],
    }
}

fn other(side: Side) -> Side {
    match side {
        Side::Left => Side::Right,
        Side::Right => Side::Left,
    }
}

fn msg(i: usize) -> Bytes {
    Bytes::from(format!("m{i}"))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Who {
    Client,
    Server,
    Both,
}

/// A bug planted in the scenario, to show the checks catch it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plant {
    None,
    /// The client switches its own stack at the first switch point, without the two-phase
    /// commit (so without the server's yes or switch).
    Unilateral,
}

/// Everything a seed decides.
#[derive(Debug)]
struct Params {
    client_faults: Faults,
    server_faults: Faults,
    fault_seeds: [u64; 2],
    rto: Duration,
    server_keys: [u8; 2],
    messages: usize,
    max_burst: usize,
    max_pause_ms: u64,
    /// (after this many messages were sent/received, who proposes)
    switches: Vec<(usize, Who)>,
    /// The client's and the server's policies (one end in eight refuses its peer's
    /// proposals).
    policies: [Policy; 2],
    tasks_seed: u64,
}

fn faults(r: &mut SimRng) -> Faults {
    if r.chance(0.125) {
        return Faults::none();
    }
    Faults::none()
        .with_drop(r.below(21) as f64 / 100.0)
        .with_duplicate(r.below(11) as f64 / 100.0)
        .with_reorder(r.below(21) as f64 / 100.0, r.range(1, 4) as usize)
        .with_reorder_timeout(Duration::from_millis(r.range(1, 20)))
        .with_delay(r.below(31) as f64 / 100.0, r.millis(30))
}

fn params(seed: u64) -> Params {
    let mut r = SimRng::new(seed);
    let (client_faults, server_faults) = if r.chance(0.125) {
        (Faults::none(), Faults::none())
    } else {
        (faults(&mut r), faults(&mut r))
    };
    let messages = r.range(20, 200) as usize;
    let n_switches = r.below(4) as usize;
    let mut switches: Vec<(usize, Who)> = (0..n_switches)
        .map(|_| {
            let at = r.below(messages as u64) as usize;
            let who = match r.below(5) {
                0 | 1 => Who::Client,
                2 | 3 => Who::Server,
                _ => Who::Both,
            };
            (at, who)
        })
        .collect();
    switches.sort_by_key(|s| s.0);
    let vote_timeout = [200, 1_000, 5_000, 30_000][r.below(4) as usize];
    let resend_after = [50, 200, 1_000][r.below(3) as usize];
    Params {
        client_faults,
        server_faults,
        fault_seeds: [r.fork(), r.fork()],
        rto: Duration::from_millis(r.range(20, 300)),
        server_keys: if r.chance(0.5) { [1, 2] } else { [2, 1] },
        messages,
        max_burst: r.range(1, 16) as usize,
        max_pause_ms: [0, 2, 20][r.below(3) as usize],
        switches,
        policies: [0, 1].map(|_| Policy {
            may_initiate: true,
            peer_may_initiate: !r.chance(0.125),
            vote_timeout: Duration::from_millis(vote_timeout),
            resend_after: Duration::from_millis(resend_after),
        }),
        tasks_seed: r.fork(),
    }
}

/// What one seed did.
#[derive(Clone, Debug, Default)]
struct Stats {
    messages: u64,
    switched: u64,
    aborted: u64,
    contended: u64,
    unchanged: u64,
    dropped: u64,
    duplicated: u64,
    reordered: u64,
    delayed: u64,
    virtual_ms: u64,
    /// A digest of everything observable about the run (outcomes in order, final keys,
    /// fault counters, virtual time): equal for two runs of one seed if they went the same.
    fingerprint: u64,
}

fn reliable_cfg(rto: Duration) -> reliable::Config {
    // Up to 20% loss each way: 40 timeouts in a row without an ack is then out of reach
    // (0.36^40), so "peer gone" never ends a healthy connection.
    reliable::Config::default()
        .with_rto(rto, Duration::from_millis(5), Duration::from_secs(1))
        .with_max_timeouts(40)
}

fn injector(seed: u64, f: Faults) -> FaultInjector {
    FaultInjector::seeded(seed).with_send(f).without_log()
}

/// The layers under the negotiation: exactly once, in order, over the faulty link.
fn ordered_base(faults: FaultInjector, rto: Duration) -> impl BaseChunnel {
    stack![Ordered::default(), Reliable::new(reliable_cfg(rto)), faults]
}

/// The same without `Ordered` (a planted bug: `Reliable` alone delivers in arrival order).
fn unordered_base(faults: FaultInjector, rto: Duration) -> impl BaseChunnel {
    stack![Reliable::new(reliable_cfg(rto)), faults]
}

trait BaseChunnel:
    Chunnel<MemConn, Connection: ChunnelConnection<Data = Bytes> + 'static>
    + Clone
    + Send
    + Sync
    + 'static
{
}
impl<T> BaseChunnel for T where
    T: Chunnel<MemConn, Connection: ChunnelConnection<Data = Bytes> + 'static>
        + Clone
        + Send
        + Sync
        + 'static
{
}

/// A current-thread runtime on a paused clock. Built with `--cfg tokio_unstable`, tokio's
/// own random choices (which branch of a `select!` is polled first) are seeded too.
fn runtime(seed: u64) -> tokio::runtime::Runtime {
    let mut b = tokio::runtime::Builder::new_current_thread();
    b.enable_time().start_paused(true);
    #[cfg(tokio_unstable)]
    b.rng_seed(tokio::runtime::RngSeed::from_bytes(&seed.to_le_bytes()));
    let _ = seed;
    b.build().expect("runtime")
}

fn run_seed<B: BaseChunnel>(
    seed: u64,
    plant: Plant,
    base: fn(FaultInjector, Duration) -> B,
) -> Result<Stats, String> {
    let rt = runtime(seed);
    let r = rt.block_on(async {
        within(
            Duration::from_secs(3_600),
            "the whole scenario",
            scenario(seed, plant, base),
        )
        .await?
    });
    drop(rt);
    r
}

async fn scenario<B: BaseChunnel>(
    seed: u64,
    plant: Plant,
    base: fn(FaultInjector, Duration) -> B,
) -> Result<Stats, String> {
    let p = params(seed);
    let t0 = tokio::time::Instant::now();
    let (fail_tx, mut fail_rx) = mpsc::channel::<String>(64);
    let work = run(&p, plant, base, fail_tx);
    let out = tokio::select! {
        biased;
        Some(e) = fail_rx.recv() => Err(e),
        r = work => r,
    };
    let mut stats = out?;
    // A failure reported while the run finished.
    if let Ok(e) = fail_rx.try_recv() {
        return Err(e);
    }
    stats.virtual_ms = t0.elapsed().as_millis() as u64;
    let mut h = DefaultHasher::new();
    (
        stats.messages,
        stats.switched,
        stats.aborted,
        stats.contended,
        stats.unchanged,
        stats.dropped,
        stats.duplicated,
        stats.reordered,
        stats.delayed,
        t0.elapsed().as_nanos(),
        stats.fingerprint,
    )
        .hash(&mut h);
    stats.fingerprint = h.finish();
    Ok(stats)
}

async fn run<B: BaseChunnel>(
    p: &Params,
    plant: Plant,
    base: fn(FaultInjector, Duration) -> B,
    fail: mpsc::Sender<String>,
) -> Result<Stats, String> {
    let client_keys = [1u8, 2];
    let (connect, listener) = mem_net();
    let client_faults = injector(p.fault_seeds[0], p.client_faults);
    let server_faults = injector(p.fault_seeds[1], p.server_faults);
    let (cstats, sstats): (Arc<FaultStats>, Arc<FaultStats>) =
        (client_faults.stats.clone(), server_faults.stats.clone());

    // The server.
    let srv_stack = stack(p.server_keys);
    let mut srv = listen(
        srv_stack.clone(),
        BaseListener::new(listener, base(server_faults, p.rto)),
        Config::default(),
    );
    let (srv_conn_tx, srv_conn_rx) = oneshot::channel();
    let (received_tx, received_rx) = watch::channel(0usize);
    let srv_fail = fail.clone();
    let policy = p.policies[1];
    let server_keys = p.server_keys;
    let srv_task = tokio::spawn(async move {
        let conn = match srv.accept().await {
            Ok(c) => Arc::new(c),
            Err(e) => {
                let _ = srv_fail.try_send(format!("server: accept failed: {e}"));
                return;
            }
        };
        let coord = match Coordinator::start(&conn, &srv_stack, policy) {
            Ok(c) => Arc::new(c),
            Err(e) => {
                let _ = srv_fail.try_send(format!("server: coordinator: {e}"));
                return;
            }
        };
        let _ = srv_conn_tx.send((conn.clone(), coord));
        let mut slots = vec![None; 16];
        let mut next = 0usize;
        loop {
            let n = match conn.recv(&mut slots).await {
                Ok(n) => n,
                Err(e) => {
                    let _ = srv_fail.try_send(format!("server: recv failed after {next}: {e}"));
                    return;
                }
            };
            let mut echo = Vec::with_capacity(n);
            for s in &mut slots[..n] {
                let m = s.take().expect("filled");
                if m != msg(next) {
                    let _ = srv_fail.try_send(format!(
                        "server: message {next} arrived as {m:?} (key {})",
                        key(server_keys, conn.get_ref().side())
                    ));
                    return;
                }
                next += 1;
                echo.push(m);
            }
            received_tx.send_replace(next);
            if let Err(e) = conn.send(echo).await {
                let _ = srv_fail.try_send(format!("server: echo failed after {next}: {e}"));
                return;
            }
        }
    });
    let _srv_guard = AbortOnDrop(srv_task);

    // The client.
    let cstack = stack(client_keys);
    let mut connect = connect;
    let mem = connect
        .connect_wrap(())
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut cb = base(client_faults, p.rto);
    let cbase = Base(
        cb.connect_wrap(mem)
            .await
            .map_err(|e| format!("client base: {e}"))?,
    );
    let conn = Arc::new(
        within(
            Duration::from_secs(120),
            "negotiation",
            Client::new(Config::default()).connect("srv", cstack.clone(), cbase),
        )
        .await?
        .map_err(|e| format!("negotiation failed: {e}"))?,
    );
    let coord = Arc::new(
        Coordinator::start(&conn, &cstack, p.policies[0])
            .map_err(|e| format!("coordinator: {e}"))?,
    );
    let (srv_conn, srv_coord) = within(Duration::from_secs(120), "server accept", srv_conn_rx)
        .await?
        .map_err(|_| "the server never accepted".to_owned())?;
    let ckey = || key(client_keys, conn.get_ref().side());
    let skey = || key(server_keys, srv_conn.get_ref().side());
    if ckey() != skey() {
        return Err(format!(
            "negotiation: the client picked key {}, the server key {}",
            ckey(),
            skey()
        ));
    }

    // The client's receiver: every echo once, in order; nothing after the last.
    let total = p.messages + TAIL;
    let (echoed_tx, mut echoed_rx) = watch::channel(0usize);
    let rconn = conn.clone();
    let rfail = fail.clone();
    let receiver = AbortOnDrop(tokio::spawn(async move {
        let mut slots = vec![None; 16];
        let mut next = 0usize;
        loop {
            let n = match rconn.recv(&mut slots).await {
                Ok(n) => n,
                Err(e) => {
                    let _ = rfail.try_send(format!("client: recv failed after {next} echoes: {e}"));
                    return;
                }
            };
            for s in &mut slots[..n] {
                let m = s.take().expect("filled");
                if next >= total {
                    let _ = rfail.try_send(format!("client: an echo after the last: {m:?}"));
                    return;
                }
                if m != msg(next) {
                    let _ = rfail.try_send(format!(
                        "client: echo {next} came back as {m:?} (key {})",
                        key(client_keys, rconn.get_ref().side())
                    ));
                    return;
                }
                next += 1;
            }
            echoed_tx.send_replace(next);
        }
    }));

    // Switchers: each waits for its point of the stream, then proposes the other branch.
    let (sent_tx, sent_rx) = watch::channel(0usize);
    let outcomes = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut switchers = Vec::new();
    let mut counts = Stats::default();
    let tally = Arc::new(Mutex::new(Stats::default()));
    let mut planted = plant == Plant::Unilateral;
    for (i, &(at, who)) in p.switches.iter().enumerate() {
        if planted {
            planted = false;
            let conn = conn.clone();
            let mut sent = sent_rx.clone();
            switchers.push(AbortOnDrop(tokio::spawn(async move {
                let _ = sent.wait_for(|&s| s >= at).await;
                let to = other(conn.get_ref().side());
                let _ = conn.get_ref().reconfigure(to).await;
            })));
            continue;
        }
        let ends: &[bool] = match who {
            Who::Client => &[true],
            Who::Server => &[false],
            Who::Both => &[true, false],
        };
        for &client_end in ends {
            let (c, sc) = (conn.clone(), srv_conn.clone());
            let coord = if client_end {
                coord.clone()
            } else {
                srv_coord.clone()
            };
            let mut progress = if client_end {
                sent_rx.clone()
            } else {
                received_rx.clone()
            };
            let (outcomes, tally, fail) = (outcomes.clone(), tally.clone(), fail.clone());
            switchers.push(AbortOnDrop(tokio::spawn(async move {
                let _ = progress.wait_for(|&s| s >= at).await;
                let mine = if client_end {
                    c.get_ref().side()
                } else {
                    sc.get_ref().side()
                };
                let to = other(mine);
                let out = coord.switch(to).await;
                let end = if client_end { "client" } else { "server" };
                outcomes.lock().unwrap().push(format!("{i}:{end}:{out:?}"));
                let mut t = tally.lock().unwrap();
                match out {
                    Ok(Outcome::Switched) => {
                        t.switched += 1;
                        let (ck, sk) = (
                            key(client_keys, c.get_ref().side()),
                            key(server_keys, sc.get_ref().side()),
                        );
                        if ck != sk {
                            let _ = fail.try_send(format!(
                                "switch {i} by the {end} returned Switched with the client on \
                                 key {ck} and the server on key {sk}"
                            ));
                        }
                    }
                    Ok(Outcome::Aborted(_)) => t.aborted += 1,
                    Ok(Outcome::Contended(_)) => t.contended += 1,
                    Ok(Outcome::Unchanged) => t.unchanged += 1,
                    Err(e) => {
                        let _ = fail.try_send(format!("switch {i} by the {end} failed: {e}"));
                    }
                }
            })));
        }
    }

    // The client's sender: the messages in bursts, with pauses.
    let mut r = SimRng::new(p.tasks_seed);
    let mut i = 0;
    while i < p.messages {
        let k = (r.range(1, p.max_burst as u64) as usize).min(p.messages - i);
        conn.send((i..i + k).map(msg))
            .await
            .map_err(|e| format!("client: send failed at {i}: {e}"))?;
        i += k;
        sent_tx.send_replace(i);
        let pause = r.millis(p.max_pause_ms);
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
    // Every switch ends (the application keeps receiving meanwhile).
    for s in switchers.iter_mut() {
        within(Duration::from_secs(600), "a switch", &mut s.0)
            .await?
            .map_err(|e| format!("a switcher panicked: {e}"))?;
    }
    // A tail after the switches, then every echo.
    conn.send((p.messages..total).map(msg))
        .await
        .map_err(|e| format!("client: send of the tail failed: {e}"))?;
    within(
        Duration::from_secs(600),
        "every echo",
        echoed_rx.wait_for(|&n| n >= total),
    )
    .await?
    .map_err(|_| "the client's receiver stopped".to_owned())?;
    // Quiet: late resends of the commit protocol settle; nothing more may arrive.
    tokio::time::sleep(Duration::from_secs(30)).await;
    if ckey() != skey() {
        return Err(format!(
            "after the run the client is on key {} and the server on key {}",
            ckey(),
            skey()
        ));
    }
    drop(receiver);

    counts.messages = total as u64;
    {
        let t = tally.lock().unwrap();
        counts.switched = t.switched;
        counts.aborted = t.aborted;
        counts.contended = t.contended;
        counts.unchanged = t.unchanged;
    }
    for s in [&cstats, &sstats] {
        counts.dropped += s.dropped_sent();
        counts.duplicated += s.duplicated();
        counts.reordered += s.reordered();
        counts.delayed += s.delayed();
    }
    let mut h = DefaultHasher::new();
    (outcomes.lock().unwrap().clone(), ckey(), skey()).hash(&mut h);
    counts.fingerprint = h.finish();
    Ok(counts)
}

/// Messages sent after every switch ended.
const TAIL: usize = 5;

struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[test]
fn sim_negotiated_connections() {
    let ex = Explorer::new("negotiated connection", RERUN);
    let seeds = ex.seeds(SEEDS);
    let report = ex
        .run(&seeds, |seed| run_seed(seed, Plant::None, ordered_base))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut t = Stats::default();
    for (_, s) in &report.results {
        t.messages += s.messages;
        t.switched += s.switched;
        t.aborted += s.aborted;
        t.contended += s.contended;
        t.unchanged += s.unchanged;
        t.dropped += s.dropped;
        t.duplicated += s.duplicated;
        t.reordered += s.reordered;
        t.delayed += s.delayed;
        t.virtual_ms += s.virtual_ms;
    }
    println!(
        "simulation `negotiated connection`: {} seeds ({}..={}) in {:.1} s of wall time, {:.0} s \
         of virtual time; {} messages echoed; switches: {} switched, {} aborted, {} contended, \
         {} unchanged; faults: {} dropped, {} duplicated, {} reordered, {} delayed",
        report.results.len(),
        seeds.first().copied().unwrap_or(0),
        seeds.last().copied().unwrap_or(0),
        report.elapsed.as_secs_f64(),
        t.virtual_ms as f64 / 1000.0,
        t.messages,
        t.switched,
        t.aborted,
        t.contended,
        t.unchanged,
        t.dropped,
        t.duplicated,
        t.reordered,
        t.delayed,
    );
    // (Not when one seed runs, or runs again and again.)
    if seeds.first() != seeds.last() {
        // The scenario space is exercised: each outcome and each fault happens somewhere.
        assert!(t.switched > 0 && t.aborted > 0 && t.contended > 0, "{t:?}");
        assert!(
            t.dropped > 0 && t.duplicated > 0 && t.reordered > 0 && t.delayed > 0,
            "{t:?}"
        );
    }
}

/// Two runs of a seed take the same path (the same outcomes in the same order, the same
/// fault counts, the same virtual time) when tokio's own random choices are seeded too, which
/// needs `--cfg tokio_unstable`:
///
/// ```sh
/// RUSTFLAGS="--cfg tokio_unstable" CARGO_TARGET_DIR=target/sim-replay cargo test \
///   -p chunnel-negotiate --test sim_connection -- --include-ignored sim_runs_replay_exactly
/// ```
///
/// The exception is a seed where two proposals met (an end saw `Contended`): the winner is
/// the larger transaction id, drawn from `chunnel::util::random_u64` (keyed per process), so
/// such seeds may go either way; their checks hold both ways.
#[test]
#[cfg_attr(
    not(tokio_unstable),
    ignore = "exact replay needs --cfg tokio_unstable (tokio seeds select! only there)"
)]
fn sim_runs_replay_exactly() {
    let seeds: Vec<u64> = (0..300).collect();
    let ex = Explorer::new(
        "replay",
        "RUSTFLAGS=\"--cfg tokio_unstable\" CARGO_TARGET_DIR=target/sim-replay cargo test \
         -p chunnel-negotiate --test sim_connection -- --include-ignored sim_runs_replay_exactly",
    );
    let r = ex
        .replay(
            &seeds,
            |seed| run_seed(seed, Plant::None, ordered_base),
            |x| x.fingerprint,
            |x| x.contended > 0,
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let (same, contended) = (r.same, r.skipped);
    assert!(
        r.differ.is_empty(),
        "seeds that took another path the second time: {:?}",
        r.differ
    );
    println!(
        "replay: {same} seeds replayed exactly; {contended} with contended proposals not compared"
    );
}

/// Planted bug: the client switches its own stack at the first switch point, without the
/// two-phase commit. The server goes on with the old key; the checks must catch it.
#[test]
fn planted_switch_without_the_peers_yes_is_caught() {
    let ex = Explorer::new(
        "planted: unilateral switch",
        "cargo test -p chunnel-negotiate --test sim_connection -- planted_switch_without",
    );
    let seeds: Vec<u64> = (0..200).collect();
    let e = ex
        .run(&seeds, |seed| {
            run_seed(seed, Plant::Unilateral, ordered_base)
        })
        .expect_err("the planted bug must be caught");
    println!("{e}");
    assert!(
        e.contains("arrived as") || e.contains("came back as") || e.contains("on key"),
        "{e}"
    );
}

/// Planted bug: `Reliable` without `Ordered` under the negotiation (exactly once, but in
/// arrival order). Seeds whose network reorders must catch it.
#[test]
fn planted_base_without_ordering_is_caught() {
    let ex = Explorer::new(
        "planted: no ordering",
        "cargo test -p chunnel-negotiate --test sim_connection -- planted_base_without",
    );
    let seeds: Vec<u64> = (0..200).collect();
    let e = ex
        .run(&seeds, |seed| run_seed(seed, Plant::None, unordered_base))
        .expect_err("the planted bug must be caught");
    println!("{e}");
    assert!(
        e.contains("arrived as") || e.contains("came back as"),
        "{e}"
    );
}

/// A connection that loses the first burst it is asked to send (a lost hello).
#[derive(Debug)]
struct LoseFirst {
    inner: MemConn,
    lost: std::sync::atomic::AtomicBool,
}

impl ChunnelConnection for LoseFirst {
    type Data = Bytes;

    async fn send<B>(&self, burst: B) -> Result<(), chunnel::Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        if !self.lost.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        self.inner.send(burst).await
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, chunnel::Error> {
        self.inner.recv(slots).await
    }
}

/// The client resends a lost hello after its retransmission timeout (100 ms) of *tokio's*
/// time, so on a paused clock the handshake takes 100 ms of virtual time, up to the ticker's
/// grain (10 ms) late. (Was a bug, found by the simulation: the ticker that fires handshake
/// deadlines compared them with the wall clock, so on a paused clock the resend waited for
/// 100 ms of wall time while virtual time ran on, a run-to-run difference in the seeds whose
/// handshake was slow on the wall clock. Fails on that code: before the resend, virtual time
/// passes the server's 10 s hello timeout and the handshake fails with `PeerClosed`.)
#[test]
fn bug_the_hello_was_resent_on_the_wall_clock() {
    let _one = chunnel_test::sim::exclusive();
    runtime(0).block_on(async {
        let (mut connect, listener) = mem_net();
        let s = stack([1, 2]);
        let mut srv = listen(s.clone(), listener, Config::default());
        let server = tokio::spawn(async move { srv.accept().await.map(|_| ()) });
        let base = Base(LoseFirst {
            inner: connect.connect_wrap(()).await.expect("link"),
            lost: Default::default(),
        });
        let t0 = tokio::time::Instant::now();
        let conn = within(
            Duration::from_secs(60),
            "the handshake",
            Client::new(Config::default()).connect("srv", s, base),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("negotiated");
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(100) && took <= Duration::from_millis(120),
            "the handshake with one lost hello took {took:?} of virtual time"
        );
        assert_eq!(conn.info().hellos_sent, 2);
        server.await.expect("server task").expect("accepted");
    });
}

// ---------------------------------------------------------------------------------------
// The handshake and the two-phase commit straight over the faulty link.

/// What one seed of `sim_control_over_lossy_links` did.
#[derive(Clone, Debug, Default)]
struct ControlStats {
    handshakes_given_up: u64,
    switched: u64,
    aborted: u64,
    contended: u64,
    unchanged: u64,
    hellos: u64,
}

/// The negotiation and multilateral reconfiguration with no `Reliable` under them: every
/// message of the handshake and of the two-phase commit crosses the faulty link itself. No
/// data (a message sent around a switch may be lost there, which the two-phase commit does not
/// promise to prevent); each end keeps receiving, since votes are handled on the receive
/// path. Checked: the handshake ends with both ends on the same key, or the client gives up
/// after its attempts (every hello or every answer lost: allowed); every switch returns, a
/// `Switched` one with the peer already on the same key; after 120 s of quiet both ends are
/// on the same key.
async fn control_scenario(seed: u64) -> Result<ControlStats, String> {
    let p = params(seed);
    let mut r = SimRng::new(p.tasks_seed);
    let mut st = ControlStats::default();
    let client_keys = [1u8, 2];
    let (mut connect, listener) = mem_net();
    let client_faults = injector(p.fault_seeds[0], p.client_faults);
    let server_faults = injector(p.fault_seeds[1], p.server_faults);
    let srv_stack = stack(p.server_keys);
    let mut srv = listen(
        srv_stack.clone(),
        BaseListener::new(listener, server_faults),
        Config::default(),
    );
    // The server takes its connection at once and keeps receiving on it: a retransmitted
    // hello is answered on the receive path, and the fault injector releases held messages
    // when its connection sends or receives.
    let (srv_conn_tx, srv_conn_rx) = oneshot::channel();
    let (fail_tx, mut fail_rx) = mpsc::channel::<String>(8);
    let srv_fail = fail_tx.clone();
    let _server = AbortOnDrop(tokio::spawn(async move {
        let c = match srv.accept().await {
            Ok(c) => Arc::new(c),
            Err(e) => {
                let _ = srv_fail.try_send(format!("server accept: {e}"));
                return;
            }
        };
        let _ = srv_conn_tx.send(c.clone());
        receive_nothing("server", &c, &srv_fail).await;
    }));
    let cstack = stack(client_keys);
    let mem = connect
        .connect_wrap(())
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut cf = client_faults;
    let cbase = Base(
        cf.connect_wrap(mem)
            .await
            .map_err(|e| format!("client base: {e}"))?,
    );
    let conn = match within(
        Duration::from_secs(120),
        "negotiation",
        Client::new(Config::default()).connect("srv", cstack.clone(), cbase),
    )
    .await?
    {
        Ok(c) => Arc::new(c),
        Err(chunnel_negotiate::Error::Timeout { .. }) => {
            st.handshakes_given_up = 1;
            return Ok(st);
        }
        Err(e) => return Err(format!("negotiation failed: {e}")),
    };
    st.hellos = u64::from(conn.info().hellos_sent);
    let srv_conn = within(Duration::from_secs(120), "server accept", srv_conn_rx)
        .await?
        .map_err(|_| "the server never accepted".to_owned())?;
    let (ckey, skey) = (
        || key(client_keys, conn.get_ref().side()),
        || key(p.server_keys, srv_conn.get_ref().side()),
    );
    if ckey() != skey() {
        return Err(format!(
            "negotiation: the client picked key {}, the server key {}",
            ckey(),
            skey()
        ));
    }
    let coords = [
        Arc::new(
            Coordinator::start(&conn, &cstack, p.policies[0])
                .map_err(|e| format!("coordinator: {e}"))?,
        ),
        Arc::new(
            Coordinator::start(&srv_conn, &srv_stack, p.policies[1])
                .map_err(|e| format!("coordinator: {e}"))?,
        ),
    ];
    // The client keeps receiving too (nothing is sent, so anything received is a failure).
    let (c, fail) = (conn.clone(), fail_tx.clone());
    let _reader = AbortOnDrop(tokio::spawn(async move {
        receive_nothing("client", &c, &fail).await;
    }));
    drop(fail_tx);
    let mut switches = Vec::new();
    for (i, &(_, who)) in p.switches.iter().enumerate() {
        tokio::time::sleep(r.millis(500)).await;
        let ends: &[usize] = match who {
            Who::Client => &[0],
            Who::Server => &[1],
            Who::Both => &[0, 1],
        };
        for &end in ends {
            let coord = coords[end].clone();
            let (c, sc) = (conn.clone(), srv_conn.clone());
            let server_keys = p.server_keys;
            switches.push(tokio::spawn(async move {
                let mine = if end == 0 {
                    c.get_ref().side()
                } else {
                    sc.get_ref().side()
                };
                let out = coord.switch(other(mine)).await;
                let (ck, sk) = (
                    key(client_keys, c.get_ref().side()),
                    key(server_keys, sc.get_ref().side()),
                );
                match out {
                    Ok(Outcome::Switched) if ck != sk => Err(format!(
                        "switch {i} by end {end} returned Switched with the client on key {ck} \
                         and the server on key {sk}"
                    )),
                    Ok(o) => Ok(o),
                    Err(e) => Err(format!("switch {i} by end {end} failed: {e}")),
                }
            }));
        }
    }
    let all = async {
        for t in switches {
            match within(Duration::from_secs(600), "a switch", t).await? {
                Ok(Ok(Outcome::Switched)) => st.switched += 1,
                Ok(Ok(Outcome::Aborted(_))) => st.aborted += 1,
                Ok(Ok(Outcome::Contended(_))) => st.contended += 1,
                Ok(Ok(Outcome::Unchanged)) => st.unchanged += 1,
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(format!("a switch panicked: {e}")),
            }
        }
        tokio::time::sleep(Duration::from_secs(120)).await;
        Ok(())
    };
    tokio::select! {
        biased;
        Some(e) = fail_rx.recv() => return Err(e),
        r = all => r?,
    }
    if let Ok(e) = fail_rx.try_recv() {
        return Err(e);
    }
    if ckey() != skey() {
        return Err(format!(
            "after the quiet period the client is on key {} and the server on key {}",
            ckey(),
            skey()
        ));
    }
    Ok(st)
}

/// Receives on `c` (which drives the control protocol) and reports anything that arrives.
async fn receive_nothing<C: ChunnelConnection<Data = Bytes>>(
    end: &str,
    c: &C,
    fail: &mpsc::Sender<String>,
) {
    let mut slots = vec![None; 8];
    let e = match c.recv(&mut slots).await {
        Ok(_) => format!("{end}: received data nobody sent"),
        Err(e) => format!("{end}: recv failed: {e}"),
    };
    let _ = fail.try_send(e);
}

const CONTROL_SEEDS: u64 = 3_000;

#[test]
fn sim_control_over_lossy_links() {
    let ex = Explorer::new(
        "negotiation and two-phase commit over lossy links",
        "cargo test -p chunnel-negotiate --test sim_connection -- sim_control_over_lossy_links --nocapture",
    );
    let seeds = ex.seeds(CONTROL_SEEDS);
    let report = ex
        .run(&seeds, |seed| {
            let rt = runtime(seed);
            let r = rt.block_on(async {
                within(
                    Duration::from_secs(3_600),
                    "the whole scenario",
                    control_scenario(seed),
                )
                .await?
            });
            drop(rt);
            r
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let mut t = ControlStats::default();
    for (_, s) in &report.results {
        t.handshakes_given_up += s.handshakes_given_up;
        t.switched += s.switched;
        t.aborted += s.aborted;
        t.contended += s.contended;
        t.unchanged += s.unchanged;
        t.hellos += s.hellos;
    }
    println!(
        "simulation `control over lossy links`: {} seeds ({}..={}) in {:.1} s of wall time; \
         {} handshakes given up, {} hellos sent by the others; switches: {} switched, {} \
         aborted, {} contended, {} unchanged",
        report.results.len(),
        seeds.first().copied().unwrap_or(0),
        seeds.last().copied().unwrap_or(0),
        report.elapsed.as_secs_f64(),
        t.handshakes_given_up,
        t.hellos,
        t.switched,
        t.aborted,
        t.contended,
        t.unchanged,
    );
    // (Not when one seed runs, or runs again and again.)
    if seeds.first() != seeds.last() {
        assert!(t.switched > 0 && t.aborted > 0 && t.contended > 0, "{t:?}");
        assert!(
            t.hellos > report.results.len() as u64,
            "no hello was ever resent: {t:?}"
        );
    }
}
