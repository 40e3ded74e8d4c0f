//! The reconfiguration part of the tour: a live connection switches its checksum Chunnel
//! (an exact-match layer: both ends must switch together) from CRC-32 to FNV-1a and back
//! while messages flow, by a two-phase commit carried in-band; the demo prints the pause the
//! switch caused and checks that no message was lost, duplicated or garbled. Then a server
//! that does not accept switches from its clients refuses one, and the connection goes on.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use bytes::Bytes;
use chunnel::{
    Chunnel, ChunnelConnection, ConnectionExt, Handover, LockFree, Reconfigurable, Side, select,
};
use chunnel_negotiate::commit::{Coordinator, Outcome, Policy};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_net::uds;
use tokio::time::timeout;

use crate::negotiation::{Algo, Checksum, ChecksumConn};

/// The checksum keeps no state a replacement would need.
impl<C: ChunnelConnection<Data = Bytes>> Handover for ChecksumConn<C> {
    fn export(&self, _: &mut chunnel::Handoff<Self::Data>) {}
    fn import(&self, _: &mut chunnel::Handoff<Self::Data>) {}
}

pub(crate) type Stack = Reconfigurable<Checksum, Checksum, LockFree>;

pub(crate) fn stack() -> Stack {
    select(Checksum(Algo::Crc32), Checksum(Algo::Fnv1a)).reconfigurable::<LockFree>()
}

const WAIT: Duration = Duration::from_secs(10);
/// Offered load: `PER_TICK` messages every millisecond.
const PER_TICK: u64 = 10;

fn addr(tag: &str) -> uds::UnixAddr {
    uds::UnixAddr::Abstract(format!("chunnel-demo-{tag}-{}", std::process::id()).into_bytes())
}

/// An echo server whose connections follow (or, with `accept: false`, refuse) their
/// clients' switches.
async fn server(tag: &str, accept: bool) -> Result<uds::UnixAddr> {
    let a = addr(tag);
    let l = uds::StreamListener::bind(a.clone()).await?;
    let s = stack();
    let mut server = listen(s.clone(), l, Config::default());
    let policy = Policy {
        peer_may_initiate: accept,
        ..Policy::default()
    };
    tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            let Ok(coord) = Coordinator::start(&conn, &s, policy) else {
                continue;
            };
            tokio::spawn(async move {
                let _coord = coord;
                while let Ok(m) = conn.recv_one().await {
                    if conn.send_one(m).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    Ok(a)
}

fn algo(side: Side) -> &'static str {
    match side {
        Side::Left => "crc32",
        Side::Right => "fnv1a",
    }
}

pub async fn tour() -> Result<()> {
    println!();
    println!("== Reconfiguration: switch a live connection's checksum with the peer agreeing ==");
    let a = server("reconfig", true).await?;
    let s = stack();
    let base = uds::StreamConnect::new(a).connect_wrap(()).await?;
    let client = Client::new(Config::default());
    let conn = Arc::new(client.connect("reconfig", s.clone(), base).await?);
    let coord = Coordinator::start(&conn, &s, Policy::default())?;
    println!(
        "connected over a Unix stream socket; both ends on {}",
        algo(conn.get_ref().side())
    );

    // Traffic: PER_TICK numbered messages every millisecond; a receiver checks every echo
    // and records when it arrived.
    let stop = Arc::new(AtomicBool::new(false));
    let total = Arc::new(AtomicU64::new(u64::MAX));
    let t0 = Instant::now();
    let receiver = {
        let (conn, total) = (conn.clone(), total.clone());
        tokio::spawn(async move {
            let mut arrivals = Vec::new();
            let mut i = 0u64;
            while i < total.load(Ordering::Acquire) {
                let m = timeout(WAIT, conn.recv_one())
                    .await
                    .with_context(|| format!("echo {i} never came"))??;
                ensure!(
                    m == format!("m{i}"),
                    "echo {i} came back as {m:?}: lost, reordered or garbled"
                );
                arrivals.push(t0.elapsed());
                i += 1;
            }
            anyhow::Ok(arrivals)
        })
    };
    let sender = {
        let (conn, stop) = (conn.clone(), stop.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            let mut i = 0u64;
            while !stop.load(Ordering::Acquire) {
                tick.tick().await;
                let burst: Vec<Bytes> = (i..i + PER_TICK)
                    .map(|k| Bytes::from(format!("m{k}")))
                    .collect();
                conn.send(burst).await?;
                i += PER_TICK;
            }
            anyhow::Ok(i)
        })
    };

    let mut switches = Vec::new();
    for to in [Side::Right, Side::Left] {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let at = t0.elapsed();
        let out = timeout(WAIT, coord.switch(to)).await??;
        ensure!(out == Outcome::Switched, "switch to {to:?}: {out:?}");
        println!(
            "switched to {} at {:.0} ms: the server voted yes, both ends switched ({} us to agree and switch)",
            algo(to),
            at.as_secs_f64() * 1e3,
            (t0.elapsed() - at).as_micros()
        );
        switches.push(at);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Release);
    let mut sent = sender.await??;
    // One more, so a receiver already waiting past the last echo gets it.
    conn.send_one(Bytes::from(format!("m{sent}"))).await?;
    sent += 1;
    total.store(sent, Ordering::Release);
    let arrivals = timeout(WAIT, receiver).await???;

    // The pause: the longest time without a delivery around each switch, against the same
    // measure over a window of the same length with no switch (the ticks are 1 ms apart).
    let longest_gap = |from: Duration, to: Duration| {
        arrivals
            .windows(2)
            .filter(|w| w[0] >= from && w[1] <= to)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default()
    };
    let around = Duration::from_millis(50);
    let quiet = longest_gap(Duration::from_millis(150), Duration::from_millis(250));
    for (k, at) in switches.iter().enumerate() {
        println!(
            "switch {}: longest gap between deliveries within 50 ms of it: {} us (in 100 ms without a switch: {} us)",
            k + 1,
            longest_gap(at.saturating_sub(around), *at + around).as_micros(),
            quiet.as_micros()
        );
    }
    println!(
        "{sent} messages sent at {} per second, {} echoed back: none lost, duplicated, reordered or garbled",
        PER_TICK * 1000,
        arrivals.len()
    );
    ensure!(arrivals.len() as u64 == sent);

    // A server that does not take switches from its clients.
    let a = server("reconfig-refuse", false).await?;
    let base = uds::StreamConnect::new(a).connect_wrap(()).await?;
    let conn = client.connect("reconfig-refuse", s.clone(), base).await?;
    let coord = Coordinator::start(&conn, &s, Policy::default())?;
    // The vote comes back in-band: the application keeps receiving while it waits.
    let out = {
        let switch = coord.switch(Side::Right);
        tokio::pin!(switch);
        loop {
            tokio::select! {
                out = &mut switch => break out?,
                r = conn.recv_one() => { r?; }
            }
        }
    };
    conn.send_one(Bytes::from("still here")).await?;
    let echo = timeout(WAIT, conn.recv_one()).await??;
    println!(
        "a server that refuses client switches answers {out:?}; the connection stays on {} and echoes {echo:?}",
        algo(conn.get_ref().side()),
    );
    Ok(())
}
