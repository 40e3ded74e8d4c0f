//! The packet scheduler over real sockets: priority overtakes queued bulk (and FIFO does not),
//! the shaper's gates hold at a raw receiver, and a peer that stops reading bounds memory.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Error};
use chunnel_net::{tcp, udp};
use chunnel_std::sched::{Config, GateEntry, GateSchedule, Overflow, Policy, Sched};
use tokio::net::UdpSocket;
use tokio::sync::watch;

/// A connection whose sends wait until the valve is opened (a stalled link).
struct Valve<C> {
    inner: C,
    open: watch::Receiver<bool>,
}

impl<C: ChunnelConnection> ChunnelConnection for Valve<C> {
    type Data = C::Data;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = C::Data> + Send,
        B::IntoIter: Send,
    {
        let mut open = self.open.clone();
        let burst = burst.into_iter();
        async move {
            open.wait_for(|o| *o).await.map_err(|_| Error::Closed)?;
            self.inner.send(burst).await
        }
    }

    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<C::Data>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        self.inner.recv(slots)
    }
}

/// Message: [class, sender, seq (u16 BE)].
fn msg(class: u8, sender: u8, seq: u16) -> Bytes {
    let s = seq.to_be_bytes();
    Bytes::copy_from_slice(&[class, sender, s[0], s[1]])
}

fn class_of(m: &Bytes) -> u8 {
    m.first().copied().unwrap_or(1)
}

/// Receives `n` datagrams, with their arrival instants.
async fn receive(sock: &UdpSocket, n: usize) -> Result<Vec<(Vec<u8>, Instant)>> {
    let mut got = Vec::with_capacity(n);
    let mut buf = [0u8; 2048];
    while got.len() < n {
        let len = tokio::time::timeout(Duration::from_secs(10), sock.recv(&mut buf))
            .await
            .with_context(|| format!("only {} of {n} datagrams arrived", got.len()))??;
        got.push((buf[..len].to_vec(), Instant::now()));
    }
    Ok(got)
}

const BULK_SENDERS: u8 = 4;
const BULK_EACH: u16 = 30;
const PRIO_SENDERS: u8 = 4;
const PRIO_EACH: u16 = 5;

/// Bulk (class 1) from several tasks is queued behind a stalled link, then priority messages
/// (class 0) from several tasks; the link opens. Returns the arrival order and how many bulk
/// messages the driver had already taken when the link opened.
async fn stalled_then_open(policy: Policy) -> Result<(Vec<Vec<u8>>, u64)> {
    let rx = UdpSocket::bind("127.0.0.1:0").await?;
    let base = udp::Connect::new(rx.local_addr()?).connect_wrap(()).await?;
    let (open_tx, open_rx) = watch::channel(false);
    let valve = Valve {
        inner: base,
        open: open_rx,
    };
    let cfg = Config::default()
        .with_policy(policy)
        .with_classes(2)
        .with_capacity(512)
        .with_max_burst(8);
    let conn = Arc::new(Sched::new(cfg, class_of).connect_wrap(valve).await?);
    let total_bulk = usize::from(BULK_SENDERS) * usize::from(BULK_EACH);
    let total_prio = usize::from(PRIO_SENDERS) * usize::from(PRIO_EACH);
    let mut tasks = Vec::new();
    for s in 0..BULK_SENDERS {
        let c = Arc::clone(&conn);
        tasks.push(tokio::spawn(async move {
            for i in 0..BULK_EACH {
                c.send([msg(1, s, i)]).await?;
            }
            Ok::<_, Error>(())
        }));
    }
    for t in tasks.drain(..) {
        t.await??;
    }
    for s in 0..PRIO_SENDERS {
        let c = Arc::clone(&conn);
        tasks.push(tokio::spawn(async move {
            c.send((0..PRIO_EACH).map(|i| msg(0, s, i))).await
        }));
    }
    for t in tasks.drain(..) {
        t.await??;
    }
    // Everything is queued, or taken by the driver (blocked in the valve).
    let taken = conn.stats().sent[1];
    ensure!(conn.queued() + taken as usize == total_bulk + total_prio);
    let recv = tokio::spawn(async move { receive(&rx, total_bulk + total_prio).await });
    open_tx.send(true)?;
    let got = recv.await??;
    Ok((got.into_iter().map(|(m, _)| m).collect(), taken))
}

/// Messages of each (class, sender) arrive in the order that sender sent them.
fn check_fifo_per_sender(got: &[Vec<u8>]) -> Result<()> {
    let mut last = std::collections::HashMap::new();
    for m in got {
        let seq = u16::from_be_bytes([m[2], m[3]]);
        if let Some(prev) = last.insert((m[0], m[1]), seq) {
            ensure!(
                seq == prev + 1,
                "sender {:?} out of order: {prev} then {seq}",
                m
            );
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_overtakes_queued_bulk_over_udp() -> Result<()> {
    let (got, taken) = stalled_then_open(Policy::StrictPriority).await?;
    check_fifo_per_sender(&got)?;
    let taken = taken as usize;
    ensure!(taken <= 8, "the driver holds at most one burst: {taken}");
    let prio = usize::from(PRIO_SENDERS) * usize::from(PRIO_EACH);
    // The burst already in the link goes first; then every priority message; then bulk.
    ensure!(got[..taken].iter().all(|m| m[0] == 1));
    ensure!(
        got[taken..taken + prio].iter().all(|m| m[0] == 0),
        "priority did not overtake: {:?}",
        got.iter().map(|m| m[0]).collect::<Vec<_>>()
    );
    ensure!(got[taken + prio..].iter().all(|m| m[0] == 1));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_keeps_priority_behind_queued_bulk_over_udp() -> Result<()> {
    let (got, _) = stalled_then_open(Policy::Fifo).await?;
    check_fifo_per_sender(&got)?;
    let bulk = usize::from(BULK_SENDERS) * usize::from(BULK_EACH);
    ensure!(
        got[..bulk].iter().all(|m| m[0] == 1),
        "FIFO let a later message overtake"
    );
    Ok(())
}

const WINDOW: Duration = Duration::from_millis(100);
const GUARD: Duration = Duration::from_millis(30);

/// Sleeps until the next instant `offset` into a cycle (cycles start at `base`).
async fn until_offset(base: Instant, cycle: Duration, offset: Duration) -> Instant {
    let now = Instant::now();
    let into = (now - base).as_nanos() % cycle.as_nanos();
    let cycle_start = now - Duration::from_nanos(into as u64);
    let mut at = cycle_start + offset;
    if at < now {
        at += cycle;
    }
    tokio::time::sleep_until(at.into()).await;
    at
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shaper_respects_the_gates_at_a_raw_receiver() -> Result<()> {
    // Class 0 for 100 ms, then class 1 for 100 ms; a 30 ms guard band.
    let gates = GateSchedule::new(vec![
        GateEntry::new(WINDOW, [0]),
        GateEntry::new(WINDOW, [1]),
    ])?
    .with_guard_band(GUARD);
    let cycle = gates.cycle();
    let rx = UdpSocket::bind("127.0.0.1:0").await?;
    let base = Instant::now();
    let cfg = Config::default()
        .with_policy(Policy::TimeAware(gates.clone()))
        .with_classes(2)
        .with_base(base);
    let mut stack = chunnel::stack![
        Sched::new(cfg, class_of),
        udp::Connect::new(rx.local_addr()?)
    ];
    let conn = stack.connect_wrap(()).await?;
    // The receiver reads as datagrams arrive (12 of them: 3 rounds of 4).
    let receiver = tokio::spawn(async move { receive(&rx, 12).await });
    let mut sent: Vec<(Bytes, Instant)> = Vec::new();
    let mut seq = 0u16;
    // Rounds: in class 0's window (class 1 must wait), in class 1's window (class 0 must
    // wait), and in class 1's guard band (class 1 must wait a whole cycle).
    for offset in [10, 110, 180] {
        until_offset(base, cycle, Duration::from_millis(offset)).await;
        let round: Vec<Bytes> = (0..4)
            .map(|i| {
                seq += 1;
                msg(i % 2, 0, seq)
            })
            .collect();
        let before = Instant::now();
        conn.send(round.clone()).await?;
        sent.extend(round.into_iter().map(|m| (m, before)));
    }
    let got = receiver.await??;
    ensure!(got.len() == sent.len());
    for (m, arrived) in &got {
        let (_, enqueued) = sent
            .iter()
            .find(|(s, _)| s[..] == m[..])
            .context("unknown datagram")?;
        let earliest = gates
            .next_start(base, *enqueued, m[0])
            .context("a class that never opens")?;
        ensure!(
            *arrived >= earliest,
            "class {} arrived {:?} before its gate let it start",
            m[0],
            earliest - *arrived
        );
        // Where in the cycle it arrived: inside its window, or late by less than a generous
        // tolerance (scheduling delays), never early.
        let off = Duration::from_nanos(((*arrived - base).as_nanos() % cycle.as_nanos()) as u64);
        let window_start = if m[0] == 0 { Duration::ZERO } else { WINDOW };
        let tolerance = Duration::from_millis(60);
        let late = off
            .checked_sub(window_start)
            .unwrap_or(off + cycle - window_start);
        ensure!(
            late < WINDOW + tolerance,
            "class {} arrived {off:?} into the cycle, {late:?} after its window opened",
            m[0]
        );
    }
    // The round in class 1's guard band: its class 1 messages waited for the next window.
    let round3: Vec<&(Vec<u8>, Instant)> = got
        .iter()
        .filter(|(m, _)| u16::from_be_bytes([m[2], m[3]]) > 8 && m[0] == 1)
        .collect();
    ensure!(round3.len() == 2);
    Ok(())
}

/// A TCP peer that accepts and never reads.
async fn deaf_peer() -> Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let h = tokio::spawn(async move {
        if let Ok((s, _)) = l.accept().await {
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(s);
        }
    });
    Ok((addr, h))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_reading_bounds_the_queues() -> Result<()> {
    const CAP: usize = 8;
    let payload = Bytes::from(vec![1u8; 64 * 1024]);
    // Backpressure: the sender stops once the socket buffers and the queue are full.
    let (addr, peer) = deaf_peer().await?;
    let cfg = Config::default()
        .with_policy(Policy::StrictPriority)
        .with_classes(2)
        .with_capacity(CAP);
    let conn = Arc::new(
        chunnel::stack![Sched::new(cfg.clone(), class_of), tcp::Connect::new(addr)]
            .connect_wrap(())
            .await?,
    );
    let c = Arc::clone(&conn);
    let p = payload.clone();
    let sender = tokio::spawn(async move {
        loop {
            if c.send([p.clone()]).await.is_err() {
                return;
            }
        }
    });
    let mut last = u64::MAX;
    let mut stable = 0;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        ensure!(
            conn.queued() <= CAP,
            "queue over its bound: {}",
            conn.queued()
        );
        let now = conn.stats().enqueued[1];
        stable = if now == last { stable + 1 } else { 0 };
        last = now;
        if stable >= 4 {
            break;
        }
    }
    ensure!(stable >= 4, "the sender never stalled");
    ensure!(!sender.is_finished());
    ensure!(
        conn.queued() == CAP,
        "a stalled sender waits on a full queue"
    );
    sender.abort();
    peer.abort();

    // Drop on overflow: sends return at once, the excess is counted.
    let (addr, peer) = deaf_peer().await?;
    let conn = chunnel::stack![
        Sched::new(cfg.with_overflow(Overflow::Drop), class_of),
        tcp::Connect::new(addr)
    ]
    .connect_wrap(())
    .await?;
    tokio::time::timeout(Duration::from_secs(20), async {
        while conn.stats().dropped[1] < 100 {
            conn.send([payload.clone(), payload.clone()]).await?;
            ensure!(conn.queued() <= CAP);
            tokio::task::yield_now().await;
        }
        Ok(())
    })
    .await
    .context("sends with Overflow::Drop blocked")??;
    peer.abort();
    Ok(())
}
