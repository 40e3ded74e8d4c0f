//! The store on a control endpoint (`chunnel-ctl`, driven by `chunnelctl`): what a server
//! registers ([`KvServer::start_with_control`](crate::KvServer::start_with_control)) and what
//! a [`LiveClient`](crate::live::LiveClient) registers.
//!
//! * the canonical listener: its address, its offered stack, the accepted connections by
//!   sharding mode and the shards' request, malformed and drop counters;
//! * one entry per shard: its socket address, requests handled and keys stored;
//! * one entry per negotiated client connection: the negotiation outcome (which sharding
//!   mode), listed while the connection is served.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use chunnel::Offers;
use chunnel_ctl::{Entry, Guard, LayerCounters, Negotiation, Registry};
use chunnel_std::shard::ShardServer;

use crate::{Msg, ServerCounts};

/// One shard's counters, on a cache line of its own (each is written by its shard's thread).
#[derive(Debug, Default)]
#[repr(align(64))]
struct ShardCount {
    requests: AtomicU64,
    keys: AtomicU64,
}

/// Per-shard counters, written by the shards' handlers (only when a registry was given).
#[derive(Clone, Debug)]
pub(crate) struct ShardCounts(Arc<[ShardCount]>);

impl ShardCounts {
    pub(crate) fn new(shards: usize) -> Self {
        ShardCounts((0..shards).map(|_| ShardCount::default()).collect())
    }

    /// Shard `i` handled a request and now stores `keys` keys.
    pub(crate) fn record(&self, i: usize, keys: usize) {
        if let Some(c) = self.0.get(i) {
            c.requests.fetch_add(1, Ordering::Relaxed);
            c.keys.store(keys as u64, Ordering::Relaxed);
        }
    }
}

/// Registers the canonical listener and the shards.
pub(crate) fn register_server<S: Offers>(
    r: &Registry,
    addr: SocketAddr,
    stack: &S,
    shards: &ShardServer<Msg>,
    counts: &Arc<ServerCounts>,
    shard_counts: &ShardCounts,
    client_push: bool,
) -> Vec<Guard> {
    let layers: Vec<String> = stack
        .offers()
        .first()
        .map(|o| o.chunnels.iter().map(|c| c.id.to_string()).collect())
        .unwrap_or_default();
    let stats = {
        let counts = Arc::clone(counts);
        let sc = shard_counts.clone();
        move || {
            let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
            vec![
                LayerCounters::new(
                    "negotiation",
                    [
                        ("client-push", c(&counts.client_push)),
                        ("server-side", c(&counts.server_side)),
                        ("failed", c(&counts.failed)),
                    ],
                ),
                LayerCounters::new(
                    "shards",
                    [
                        ("requests", sc.0.iter().map(|s| c(&s.requests)).sum()),
                        ("keys", sc.0.iter().map(|s| c(&s.keys)).sum()),
                    ],
                ),
            ]
        }
    };
    let mut guards = vec![
        r.register(
            Entry::listener(if client_push {
                "kv canonical (client push or server-side)"
            } else {
                "kv canonical (server-side only)"
            })
            .with_peer(addr)
            .with_stack(layers)
            .with_counters(stats),
        ),
    ];
    for (i, a) in shards.addrs().iter().enumerate() {
        let sc = shard_counts.clone();
        guards.push(
            r.register(
                Entry::listener(format!("kv shard {i}"))
                    .with_peer(a)
                    .with_stack(["serialize", "udp"])
                    .with_counters(move || {
                        let s = &sc.0[i];
                        vec![LayerCounters::new(
                            "shard",
                            [
                                ("requests", s.requests.load(Ordering::Relaxed)),
                                ("keys", s.keys.load(Ordering::Relaxed)),
                            ],
                        )]
                    }),
            ),
        );
    }
    guards
}

/// Registers one negotiated client connection of the server.
pub(crate) fn register_conn(r: &Registry, info: &chunnel_negotiate::Info, pushed: bool) -> Guard {
    let mode = if pushed { "client push" } else { "server-side" };
    r.register(
        Entry::connection(format!("kv client ({mode})"))
            .with_negotiation(Negotiation::server(info)),
    )
}
