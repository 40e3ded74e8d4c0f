//! `chunnel-bench rendezvous`: what multi-party negotiation costs (issue 5, item 7), per
//! rendezvous backend, as the group grows.
//!
//! For every backend and every group size N (`--sizes`, default 1, 4, 16, 64):
//!
//! * **join**: N-1 members are in the group; a newcomer joins (the compare-and-swap that finds
//!   the committed stack, the compatibility check, the join at its epoch) and leaves again,
//!   `--reps` times. Latency from the call to `Participant::join` to its return.
//! * **commit**: the N members are in the group; one proposes a transition to its other
//!   option and waits until it committed (every member read the proposal, voted, the proposer
//!   counted all N yes votes and committed), `--reps` times, alternating between two stacks.
//!   Every participant has a ballot socket on loopback (`Config::with_direct_ballots`): votes
//!   travel as datagrams to the proposer, and the store holds only the proposal and the
//!   decision; `--no-direct-ballots` sends every vote through the store instead.
//! * **store alone** (`store_propose`, `store_finish`): with the N members in the group, a
//!   store client that is not a member proposes a transition (naming a ballot box nobody
//!   reads) and aborts it, `--reps` times: the two store writes a direct-ballot commit cannot
//!   do without, under the load of N members handling the notifications (direct ballots
//!   only: without ballot sockets the members would add their votes to the store).
//!
//! Every participant has its own store client (its own SQLite connection, Redis connection or
//! etcd client), as separate processes would. It reads the group record when the store
//! notifies a change (`Store::watch`: an etcd watch, a Redis subscription, SQLite's wake-up of
//! every process on the host), and otherwise every `--poll-ms` (while the store's
//! notifications are not working) or every `--poll-notified-ms` (while they are). With notifications, commit latency is a few store
//! round trips (the proposal, the proposer's reads, the commit, and, without direct ballots,
//! N votes): voters vote on the
//! proposal the notification carries and follow the commit it carries, without reading
//! (Redis and etcd; SQLite's notifications carry no data); without, a few poll intervals.
//!
//! The servers are started here, on free loopback ports, and stopped after their backend's
//! measurements: redis-server (append-only file fsynced on every write) and etcd (one member,
//! and a three-member cluster, `etcd3`), each backend in a fresh temporary directory of its own
//! (an etcd member started on the data directory of an earlier cluster would rejoin that
//! cluster instead of the new one). Redis and etcd need the `stores` feature
//! (`cargo build --release -p chunnel-bench --features stores`; etcd's client needs `protoc`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use chunnel::negotiate::{Capability, ChunnelInfo, Pick, StackOption};
use chunnel_rendezvous::{Config, Member, Participant, SqliteStore, Store};
use chunnel_test::services::Scratch;
use serde_json::{Value, json};

use crate::stats::quantile;

/// Options of `chunnel-bench rendezvous`.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Group sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    sizes: Vec<usize>,
    /// Backends: sqlite, redis, etcd, etcd3 (a three-member etcd cluster).
    #[arg(long, value_delimiter = ',', default_value = "sqlite,redis,etcd,etcd3")]
    backends: Vec<String>,
    /// Joins and commits measured per backend and size.
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// How often every participant reads the group record without notifications, in ms.
    #[arg(long, default_value_t = 10)]
    poll_ms: u64,
    /// How often every participant reads the group record while the store notifies every
    /// change, in ms (the fallback for a lost notification).
    #[arg(long, default_value_t = 500)]
    poll_notified_ms: u64,
    /// Every ballot through the store: no participant gets a ballot socket
    /// (`Config::with_direct_ballots`, the default here).
    #[arg(long)]
    no_direct_ballots: bool,
}

fn option(label: &'static str, branch: u8) -> StackOption {
    StackOption {
        chunnels: vec![ChunnelInfo {
            id: "bench/ordering/1".into(),
            capabilities: vec![Capability::exact("ordering", [label])],
        }],
        pick: Pick::from_branches(vec![branch]),
    }
}

fn offers() -> Vec<StackOption> {
    vec![option("receiver", 0), option("service", 1)]
}

fn config(a: &Args) -> Config {
    let c = Config {
        poll: Duration::from_millis(a.poll_ms),
        poll_notified: Duration::from_millis(a.poll_notified_ms),
        lease: Duration::from_secs(10),
        renew_every: Duration::from_secs(3),
        transition_timeout: Duration::from_secs(10),
        ..Config::default()
    };
    if a.no_direct_ballots {
        c
    } else {
        c.with_direct_ballots(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
    }
}

fn summary(mut ms: Vec<f64>) -> Value {
    ms.sort_by(f64::total_cmp);
    json!({
        "p50_ms": quantile(&ms, 0.5),
        "p90_ms": quantile(&ms, 0.9),
        "max_ms": ms.last(),
        "n": ms.len(),
    })
}

async fn member<St: Store>(
    store: Arc<St>,
    group: &str,
    id: String,
    a: &Args,
) -> Result<Participant> {
    let me = Member {
        addr: format!("127.0.0.1:{}", 1 + id.len()),
        id,
    };
    Ok(Participant::join(store, group, me, offers(), None, config(a)).await?)
}

/// One backend: every size, join and commit latencies.
async fn measure<St, F, Fut>(name: &str, connect: F, a: &Args) -> Result<Value>
where
    St: Store,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Arc<St>>>,
{
    let mut out = serde_json::Map::new();
    for &n in &a.sizes {
        let group = format!("bench-{n}-{}", std::process::id());
        let mut residents = Vec::new();
        for i in 0..n.saturating_sub(1) {
            residents.push(member(connect().await?, &group, format!("r{i:03}"), a).await?);
        }
        let mut joins = Vec::new();
        for rep in 0..a.reps {
            let store = connect().await?;
            let t = Instant::now();
            let p = member(store, &group, format!("newcomer{rep}"), a).await?;
            joins.push(t.elapsed().as_secs_f64() * 1e3);
            p.leave().await?;
        }
        // The proposer is the N-th member.
        let proposer = member(connect().await?, &group, "proposer".into(), a).await?;
        let mut w = proposer.watch();
        tokio::time::timeout(Duration::from_secs(30), async {
            while w.borrow_and_update().members.len() != n {
                w.changed().await?;
            }
            anyhow::Ok(())
        })
        .await
        .with_context(|| {
            let ids: Vec<String> = proposer
                .view()
                .members
                .iter()
                .map(|m| m.id.clone())
                .collect();
            format!("{name}: waiting for {n} members, the proposer sees {ids:?}")
        })??;
        let mut commits = Vec::new();
        for rep in 0..a.reps {
            let to = if proposer.view().option == 0 { 1 } else { 0 };
            let t = Instant::now();
            proposer
                .propose(to)
                .await
                .with_context(|| format!("{name}: transition {rep} with {n} members"))?;
            commits.push(t.elapsed().as_secs_f64() * 1e3);
        }
        // The store's part of a commit: a client that is not a member proposes (naming a
        // ballot box nobody reads, so the members' ballots add no store write) and aborts,
        // while the N members are in the group and handle the proposal's notification.
        let (mut proposes, mut finishes) = (Vec::new(), Vec::new());
        let raw = connect().await?;
        let sink = std::net::UdpSocket::bind("127.0.0.1:0")?;
        // Without ballot sockets the members would vote in the store: not the floor.
        let floor_reps = if a.no_direct_ballots { 0 } else { a.reps };
        for rep in 0..floor_reps {
            let t = chunnel_rendezvous::Transition {
                id: 0x00f1_0000_0000 + rep as u64,
                from_epoch: proposer.view().epoch,
                proposer: "floor".into(),
                stack: chunnel_negotiate::wire::encode_stack(&offers()[0].chunnels),
                deadline_ms: chunnel_rendezvous::store::now_ms() + 60_000,
                ballot_box: Some(chunnel_rendezvous::ballot::BallotBox {
                    addr: sink.local_addr()?,
                    token: 1,
                }),
            };
            let t0 = Instant::now();
            if !raw.propose(&group, &t).await? {
                bail!("{name}: the store-floor proposal {rep} with {n} members was refused");
            }
            let t1 = Instant::now();
            raw.finish(&group, t.id, false).await?;
            proposes.push((t1 - t0).as_secs_f64() * 1e3);
            finishes.push(t1.elapsed().as_secs_f64() * 1e3);
            // Let the members see the outcome before the next round.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        proposer.leave().await?;
        for r in residents {
            r.leave().await?;
        }
        let (j, c) = (summary(joins), summary(commits));
        let (sp, sf) = (summary(proposes), summary(finishes));
        let p = |v: &Value, q: &str| v[q].as_f64().unwrap_or(f64::NAN);
        let floor = if floor_reps > 0 {
            format!(
                " (store alone: propose p50 {:.2}, finish p50 {:.2} ms)",
                p(&sp, "p50_ms"),
                p(&sf, "p50_ms")
            )
        } else {
            String::new()
        };
        eprintln!(
            "{name:>6} N={n:>2}: join p50 {:.2} ms, commit p50 {:.2} p90 {:.2} ms{floor}",
            p(&j, "p50_ms"),
            p(&c, "p50_ms"),
            p(&c, "p90_ms"),
        );
        let mut row = json!({ "join": j, "commit": c });
        if floor_reps > 0 {
            row["store_propose"] = sp;
            row["store_finish"] = sf;
        }
        out.insert(n.to_string(), row);
    }
    Ok(Value::Object(out))
}

pub(crate) fn run(a: Args) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run_async(a))
}

async fn run_async(a: Args) -> Result<()> {
    let mut backends = serde_json::Map::new();
    for b in &a.backends {
        // A directory per backend, removed after it: no server state is ever reused.
        let scratch = Scratch::new(&format!("bench-rendezvous-{b}"));
        let v = match b.as_str() {
            "sqlite" => {
                let path = scratch.0.join("groups.sqlite");
                measure(
                    "sqlite",
                    || async { Ok(Arc::new(SqliteStore::open(&path)?)) },
                    &a,
                )
                .await?
            }
            #[cfg(feature = "redis")]
            "redis" => {
                let (_server, url) = chunnel_test::services::redis(&scratch);
                measure(
                    "redis",
                    || async {
                        Ok(Arc::new(
                            chunnel_rendezvous::RedisStore::connect(&url).await?,
                        ))
                    },
                    &a,
                )
                .await?
            }
            #[cfg(feature = "etcd")]
            "etcd" | "etcd3" => {
                let n = if b == "etcd" { 1 } else { 3 };
                let (_servers, endpoints) = chunnel_test::services::etcd_cluster(&scratch, n);
                measure(
                    b,
                    || async {
                        Ok(Arc::new(
                            chunnel_rendezvous::EtcdStore::connect(&endpoints).await?,
                        ))
                    },
                    &a,
                )
                .await?
            }
            b if ["redis", "etcd", "etcd3"].contains(&b) => {
                bail!(
                    "backend {b} needs the `stores` feature: cargo build --release -p chunnel-bench --features stores"
                )
            }
            other => bail!("unknown backend {other:?} (sqlite, redis, etcd, etcd3)"),
        };
        backends.insert(b.clone(), v);
    }
    let out = json!({
        "bench": "rendezvous",
        "poll_ms": a.poll_ms,
        "poll_notified_ms": a.poll_notified_ms,
        "direct_ballots": !a.no_direct_ballots,
        "reps": a.reps,
        "sizes": a.sizes,
        "backends": backends,
    });
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}
