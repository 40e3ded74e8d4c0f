//! XDP sharding (chunnel_xdp::shard) as a third, negotiated sharding mode of the store, across
//! two network namespaces joined by a veth pair: the server (namespace b) offers
//! `select(XdpShard, select(client push, server-side))`; an unchanged `KvClient` (namespace a)
//! runs the same seeded YCSB sequence (load, then workload A, zipfian) against
//!
//! 1. a server with the XDP offload attached: negotiation picks the XDP option, the client
//!    sends every request to the steering address and the XDP program steers each to its
//!    shard by `fnv1a64(key) % N`;
//! 2. a server whose offload is not available (the XDP option reports NotAvailable):
//!    negotiation falls back to client push;
//! 3. the XDP server again, with a client that offers only server-side sharding;
//!
//! and every answer must be the same. The program's per-shard counters prove the steering:
//! every shard got some, and they sum to the requests the program saw.
//!
//! Needs root and `ip`; skips (passes) otherwise unless CHUNNEL_XDP_REQUIRE=1. The namespaces
//! are removed by a Drop guard.

use std::net::{SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use chunnel::select;
use chunnel_kv::ycsb::{self, KeyDist, OpGen, Workload};
use chunnel_kv::{ClientConfig, KvClient, Msg, Offer, Ser, Sharding, Store};
use chunnel_net::udp;
use chunnel_std::shard::{self, ShardServer};
use chunnel_test::netns::VethPair;
use chunnel_xdp::shard::{
    OFFLOAD_LABEL, ShardCounters, ShardOffload, ShardOffloadConfig, XdpShard,
};

type R<T> = Result<T, String>;

/// The answers of one run, in order.
type Answers = Vec<Option<Vec<u8>>>;

/// Two namespaces joined by `ka` (10.82.0.1, in `a`) – `kb` (10.82.0.2, in `b`).
fn netns() -> R<VethPair> {
    VethPair::new("chkvx", ("ka", "kb"), ("10.82.0.1/24", "10.82.0.2/24"))
        .map_err(|e| e.to_string())
}

fn privileged() -> bool {
    let ok =
        chunnel_test::netns::can_create() && chunnel_xdp::shard::embedded_shard_program_available();
    if !ok {
        assert!(
            std::env::var_os("CHUNNEL_XDP_REQUIRE").is_none(),
            "CHUNNEL_XDP_REQUIRE is set but not root / no `ip` / no XDP sharding program"
        );
        eprintln!("skipping: not root, no `ip`, or the XDP sharding program was not built");
    }
    ok
}

/// Runs `f` on a new thread in namespace `ns` with its own current-thread runtime; threads
/// it starts (the shard threads) inherit the namespace.
fn in_netns<T, F, Fut>(ns: &str, f: F) -> std::thread::JoinHandle<R<T>>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = R<T>>,
{
    let ns = ns.to_owned();
    std::thread::spawn(move || {
        chunnel_test::netns::enter(&ns).map_err(|e| e.to_string())?;
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?
            .block_on(f())
    })
}

const SHARDS: usize = 4;
const CANONICAL: &str = "10.82.0.2:7200";
const STEER: &str = "10.82.0.2:7201";

/// What one server run saw.
#[derive(Debug)]
struct ServerReport {
    /// The pick of every accepted client (`server_pick.branches()`).
    picks: Vec<Vec<u8>>,
    counters: Option<ShardCounters>,
    steered: Option<Vec<u64>>,
    requests: u64,
}

/// A store server in the current namespace offering XDP sharding (attached if `xdp`),
/// client push and server-side sharding; serves until `stop`.
async fn server(
    xdp: bool,
    ready: std::sync::mpsc::SyncSender<()>,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> R<ServerReport> {
    let e = |e: chunnel::Error| e.to_string();
    let shards: ShardServer<Msg> = ShardServer::spawn(
        vec![udp::Bind::new("10.82.0.2:0".parse().map_err(|_| "shard address")?); SHARDS],
        chunnel_kv::shard_addr,
        Ser::default(),
        |_| {
            let mut store = Store::new();
            move |m| store.handle(m)
        },
        shard::Config::default(),
    )
    .map_err(e)?;
    let ports: Vec<u16> = shards
        .addrs()
        .iter()
        .map(|a| a.parse::<SocketAddr>().map(|a| a.port()))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let steer: SocketAddrV4 = STEER.parse().map_err(|_| "steer address")?;
    let offload = if xdp {
        ShardOffload::attach(ShardOffloadConfig::new("kb", steer, ports)).map(Arc::new)
    } else {
        Err(chunnel::Error::NotAvailable {
            chunnel: chunnel_xdp::shard::SHARD_ID,
            reason: "offload disabled by the test".into(),
        })
    };
    if xdp && let Err(err) = &offload {
        return Err(format!("offload did not attach: {err}"));
    }
    let handle = offload.as_ref().ok().cloned();
    let mut cap = shard::advertisement(&[steer.to_string()]);
    cap.labels.push(OFFLOAD_LABEL.into());
    let option = XdpShard::new(shards.forward(), offload, vec![cap]);
    let stack = chunnel::stack![
        select(option, select(shards.advertise(), shards.forward())),
        Ser::default()
    ];
    let listener = udp::Listener::bind(CANONICAL.parse().map_err(|_| "canonical")?)
        .await
        .map_err(e)?;
    let mut nl = chunnel_negotiate::listen(stack, listener, chunnel_negotiate::Config::default());
    ready.send(()).map_err(|e| e.to_string())?;
    let mut picks = Vec::new();
    let mut conns = tokio::task::JoinSet::new();
    let accept = async {
        while let Ok(conn) = nl.accept().await {
            picks.push(conn.info().server_pick.branches().to_vec());
            conns.spawn(async move {
                let mut slot = [None];
                let _ = chunnel::ChunnelConnection::recv(&conn, &mut slot).await;
            });
        }
    };
    tokio::select! {
        () = accept => {}
        _ = stop => {}
    }
    let counters = handle
        .as_ref()
        .map(|o| o.counters())
        .transpose()
        .map_err(e)?;
    let steered = handle
        .as_ref()
        .map(|o| o.steered())
        .transpose()
        .map_err(e)?;
    let requests = shards
        .stats()
        .requests
        .load(std::sync::atomic::Ordering::Relaxed);
    Ok(ServerReport {
        picks,
        counters,
        steered,
        requests,
    })
}

/// The seeded YCSB sequence (as tests/ycsb.rs): load `records`, then 2000 workload-A ops.
async fn client(offer: Offer) -> R<(Sharding, Answers)> {
    let c = KvClient::connect(
        CANONICAL.parse().map_err(|_| "canonical")?,
        ClientConfig::default().with_offer(offer),
    )
    .await
    .map_err(|e| e.to_string())?;
    let records = 300;
    ycsb::load(&c, records, 16, 8)
        .await
        .map_err(|e| e.to_string())?;
    let mut ops = OpGen::new(Workload::A, KeyDist::zipfian(records), 16, 42);
    let mut got = Vec::with_capacity(2000);
    for _ in 0..2000 {
        got.push(c.call(ops.next_op()).await.map_err(|e| e.to_string())?);
    }
    Ok((c.sharding(), got))
}

fn run(ns: &VethPair, xdp: bool, offer: Offer) -> R<(ServerReport, Sharding, Answers)> {
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let s = in_netns(&ns.b, move || server(xdp, ready_tx, stop_rx));
    if ready_rx.recv_timeout(Duration::from_secs(20)).is_err() {
        let r = s.join().map_err(|_| "server panicked")?;
        return Err(format!("server did not start: {:?}", r.err()));
    }
    let c = in_netns(&ns.a, move || client(offer)).join();
    let _ = stop_tx.send(());
    let report = s.join().map_err(|_| "server panicked")??;
    let (sharding, answers) = c.map_err(|_| "client panicked")??;
    Ok((report, sharding, answers))
}

#[test]
fn xdp_sharding_answers_like_client_push_and_server_side() {
    if !privileged() {
        return;
    }
    let ns = netns().unwrap();

    // 1. XDP sharding: negotiation picks the XDP option (branch 0).
    let (xdp, sharding, xdp_answers) = run(&ns, true, Offer::Both).unwrap();
    eprintln!("xdp run: {xdp:?}");
    assert_eq!(xdp.picks, vec![vec![0u8]], "the XDP option was not picked");
    assert_eq!(
        sharding,
        Sharding::ClientPush,
        "XDP looks like client push to one address"
    );
    let counters = xdp.counters.unwrap();
    let steered = xdp.steered.clone().unwrap();
    assert!(
        steered.iter().all(|&n| n > 0),
        "every shard gets some: {steered:?}"
    );
    assert_eq!(steered.iter().sum::<u64>(), counters.steered);
    assert_eq!(counters.malformed, 0);
    // Every request the shards executed (retries included) came through the program.
    assert_eq!(counters.steered, xdp.requests, "{counters:?} vs {xdp:?}");
    assert!(counters.steered >= 2300, "load + run: {counters:?}");
    assert_eq!(counters.egress_rewritten, counters.steered);

    // 2. Offload not available: negotiation falls back to client push (branch 1, 0).
    let (push, sharding, push_answers) = run(&ns, false, Offer::Both).unwrap();
    eprintln!("client-push run: {push:?}");
    assert_eq!(push.picks, vec![vec![1u8, 0]]);
    assert_eq!(sharding, Sharding::ClientPush);

    // 3. Server-side sharding, with the offload attached but not offered by the client.
    let (fwd, sharding, fwd_answers) = run(&ns, true, Offer::ServerSide).unwrap();
    eprintln!("server-side run: {fwd:?}");
    assert_eq!(fwd.picks, vec![vec![1u8, 1]]);
    assert_eq!(sharding, Sharding::ServerSide);
    assert_eq!(
        fwd.counters.unwrap().steered,
        0,
        "nothing went to the steering port"
    );

    assert_eq!(xdp_answers.len(), 2000);
    assert!(xdp_answers.iter().filter(|a| a.is_some()).count() > 1500);
    assert!(
        xdp_answers == push_answers,
        "XDP and client push answered differently"
    );
    assert!(
        xdp_answers == fwd_answers,
        "XDP and server-side answered differently"
    );
}
