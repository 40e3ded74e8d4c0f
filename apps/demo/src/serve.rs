//! `chunnel-demo serve --control PATH`: the reconfiguration part of the tour left running for
//! an operator. An echo server and a client in this process, over a Unix stream socket,
//! negotiate `select(crc32, fnv1a).reconfigurable()` (the checksum is an exact-match layer:
//! both ends must switch together) and run a two-phase-commit coordinator each. The client
//! sends numbered messages at the `rate` policy's pace and checks every echo: counters
//! `sent`, `echoed`, `lost`, `duplicated` (by sequence number). Both connections are on the
//! control endpoint with their switch handles, so
//! `chunnelctl switch ID fnv1a --commit` switches the live stack of both ends, and
//! `chunnelctl watch` shows the traffic go on.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ConnectionExt};
use chunnel_ctl::{Endpoint, Entry, LayerCounters, Negotiation, ReconfigSwitch, Registry};
use chunnel_negotiate::commit::{Coordinator, Policy};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_net::uds;

use crate::reconfiguration::stack;

#[derive(Default)]
struct Traffic {
    sent: AtomicU64,
    echoed: AtomicU64,
    lost: AtomicU64,
    duplicated: AtomicU64,
}

/// Runs until interrupted (SIGINT).
pub async fn serve(control: Option<PathBuf>, rate: u32) -> Result<()> {
    let registry = Registry::new("chunnel-demo serve");
    let cfg = match control {
        Some(p) => chunnel_ctl::Config::new(p),
        None => chunnel_ctl::Config::from_env()
            .context("serve needs a control endpoint: --control PATH or $CHUNNEL_CONTROL")?,
    };
    let endpoint =
        Endpoint::bind(cfg, registry.clone()).context("starting the control endpoint")?;
    let rate = registry.policy(
        "rate",
        "messages per second the client sends",
        &rate.to_string(),
        |v| match v.parse::<u32>() {
            Ok(1..=100_000) => Ok(()),
            _ => Err(format!(
                "{v:?} is not a rate in messages per second (1 to 100000)"
            )),
        },
    )?;

    // The echo server: its connections follow the client's switches.
    let name = format!("chunnel-demo-serve-{}", std::process::id());
    let addr = uds::UnixAddr::Abstract(name.clone().into_bytes());
    let l = uds::StreamListener::bind(addr.clone()).await?;
    let s = stack();
    let mut server = listen(s.clone(), l, Config::default());
    let server_registry = registry.clone();
    tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            let Ok(coord) = Coordinator::start(&conn, &s, Policy::default()) else {
                continue;
            };
            let guard = server_registry.register(
                Entry::connection("echo server")
                    .with_peer("demo client (unix stream)")
                    .with_negotiation(Negotiation::server(conn.info()))
                    .with_switch(
                        ReconfigSwitch::new(conn.get_ref().clone(), "crc32", "fnv1a")
                            .with_coordinator(Arc::new(coord))
                            .with_unilateral(false),
                    ),
            );
            tokio::spawn(async move {
                let _guard = guard;
                while let Ok(m) = conn.recv_one().await {
                    if conn.send_one(m).await.is_err() {
                        break;
                    }
                }
            });
        }
    });

    // The client.
    let s = stack();
    let base = uds::StreamConnect::new(addr).connect_wrap(()).await?;
    let conn = Arc::new(
        Client::new(Config::default())
            .connect(&name, s.clone(), base)
            .await?,
    );
    let coord = Arc::new(Coordinator::start(&conn, &s, Policy::default())?);
    let traffic = Arc::new(Traffic::default());
    let t = Arc::clone(&traffic);
    let _guard = registry.register(
        Entry::connection("demo client")
            .with_peer(format!("@{name}"))
            .with_negotiation(Negotiation::client(conn.info(), &s))
            .with_counters(move || {
                vec![LayerCounters::new(
                    "traffic",
                    [
                        ("sent", t.sent.load(Relaxed)),
                        ("echoed", t.echoed.load(Relaxed)),
                        ("lost", t.lost.load(Relaxed)),
                        ("duplicated", t.duplicated.load(Relaxed)),
                    ],
                )]
            })
            .with_switch(
                ReconfigSwitch::new(conn.get_ref().clone(), "crc32", "fnv1a")
                    .with_coordinator(coord)
                    .with_unilateral(false),
            ),
    );

    // The receiver: every echo must be the next number.
    let receiver = {
        let (conn, t) = (Arc::clone(&conn), Arc::clone(&traffic));
        tokio::spawn(async move {
            let mut next = 0u64;
            loop {
                let m = conn.recv_one().await?;
                let n: u64 = std::str::from_utf8(&m)
                    .ok()
                    .and_then(|s| s.strip_prefix('m'))
                    .and_then(|s| s.parse().ok())
                    .with_context(|| format!("a garbled echo: {m:?}"))?;
                if n < next {
                    t.duplicated.fetch_add(1, Relaxed);
                    continue;
                }
                t.lost.fetch_add(n - next, Relaxed);
                t.echoed.fetch_add(1, Relaxed);
                next = n + 1;
            }
            #[allow(unreachable_code)]
            anyhow::Ok(())
        })
    };
    // The sender: every 10 ms, rate / 100 messages (at least one).
    let sender = {
        let (conn, t) = (Arc::clone(&conn), Arc::clone(&traffic));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            let mut i = 0u64;
            loop {
                tick.tick().await;
                let per_tick = (rate.get().parse::<u64>().unwrap_or(1000) / 100).max(1);
                let burst: Vec<Bytes> = (i..i + per_tick)
                    .map(|k| Bytes::from(format!("m{k}")))
                    .collect();
                conn.send(burst).await?;
                i += per_tick;
                t.sent.store(i, Relaxed);
            }
            #[allow(unreachable_code)]
            anyhow::Ok(())
        })
    };
    println!(
        "serving: an echo server and a client over a Unix stream socket, stack select(crc32, fnv1a); control endpoint at {}",
        endpoint.path().display()
    );
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        r = receiver => r??,
        r = sender => r??,
    }
    Ok(())
}
