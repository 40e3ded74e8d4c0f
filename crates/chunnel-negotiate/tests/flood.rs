//! Negotiating clients during a flood of new source addresses (issue 20, item 4), over real
//! loopback UDP: the server's listener has a small peer cap (`max_peers`); the flood's peers
//! send nothing valid, so the server marks them silent (a new peer evicts them at the cap)
//! and gives them up early while crowded (`CROWDED_HELLO_WAIT`); the peer table never exceeds the cap and every well-behaved
//! client started during the flood connects (its hello retransmissions cover the drops).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use chunnel::{Capability, Chunnel, ChunnelConnection, Error as CErr, Negotiate};
use chunnel_negotiate::{Client, Config, Error, listen};
use chunnel_net::udp;
use chunnel_test::flood::{PER_SOURCE, from_distinct_sources};

const CAP: usize = 256;
const CLIENTS: usize = 40;

/// A pass-through layer with one capability.
#[derive(Clone, Debug)]
struct Meter;

impl Negotiate for Meter {
    fn id(&self) -> &'static str {
        "test/meter/1"
    }
    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::compositional("meter", ["m"])]
    }
}

impl<C: ChunnelConnection + Send> Chunnel<C> for Meter {
    type Connection = C;
    async fn connect_wrap(&mut self, inner: C) -> Result<C, CErr> {
        Ok(inner)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negotiated_clients_connect_during_a_flood_and_peers_stay_under_the_cap() -> Result<()> {
    let cfg = udp::Config::default().with_max_peers(CAP);
    let l = udp::Listener::bind_with("127.0.0.1:0".parse()?, cfg).await?;
    let addr = l.local_addr()?;
    let counter = l.peer_counter();
    let mut server = listen(Meter, l, Config::default());

    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut peak = 0;
            while !stop.load(Ordering::Relaxed) {
                peak = peak.max(counter.count());
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            peak
        })
    };
    let (served, no_hello) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let acceptor = {
        let (served, no_hello) = (served.clone(), no_hello.clone());
        tokio::spawn(async move {
            let mut conns = Vec::new();
            loop {
                match server.accept().await {
                    Ok(c) => {
                        served.fetch_add(1, Ordering::Relaxed);
                        conns.push(c);
                    }
                    // Given up while crowded, or evicted for a new peer at the cap.
                    Err(Error::NoHello(_) | Error::Chunnel(CErr::PeerClosed)) => {
                        no_hello.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => panic!("server: {e}"),
                }
            }
        })
    };

    let t0 = Instant::now();
    let flooding = tokio::spawn(from_distinct_sources(addr));
    // Well-behaved clients, started while the flood runs.
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        tokio::time::sleep(Duration::from_millis(80)).await;
        clients.push(tokio::spawn(async move {
            let start = Instant::now();
            let base = udp::Connect::new(addr).connect_wrap(()).await?;
            let conn = Client::new(Config::default())
                .connect(&addr.to_string(), Meter, base)
                .await?;
            Ok::<_, anyhow::Error>((start.elapsed(), conn.info().hellos_sent))
        }));
    }
    let sources = flooding.await?;
    let flood_time = t0.elapsed();
    let mut times = Vec::new();
    let mut hellos = 0;
    for c in clients {
        let (t, h) = c.await??;
        times.push(t);
        hellos += h;
    }
    stop.store(true, Ordering::Relaxed);
    let peak = sampler.await?;
    acceptor.abort();
    times.sort();
    eprintln!(
        "{sources} flood sources ({} datagrams) in {flood_time:?}; peak peers {peak} (cap \
         {CAP}); {} of {CLIENTS} clients connected, {} served, {hellos} hellos sent, connect \
         median {:?} max {:?}; {} silent peers given up; total {:?}",
        sources * PER_SOURCE,
        times.len(),
        served.load(Ordering::Relaxed),
        times[times.len() / 2],
        times[times.len() - 1],
        no_hello.load(Ordering::Relaxed),
        t0.elapsed()
    );
    ensure!(peak <= CAP, "peak peers {peak} > cap {CAP}");
    ensure!(times.len() == CLIENTS);
    Ok(())
}

/// Peers a flood makes with *valid* hellos: each is accepted (1-RTT) and then never sends
/// data. Until a connection's first data message it stays marked silent, so at the cap a new
/// peer evicts the oldest of them, and every well-behaved client (connect + one echo) gets
/// in. Before accepted connections were marked, the flood's first `CAP` peers held every
/// place until their idle timeout and the clients got no answer at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_peers_that_never_send_data_make_room() -> Result<()> {
    use chunnel::{ConnectionExt, Offers};
    use chunnel_negotiate::wire::{Hello, VERSION};

    const FLOOD: usize = 4 * CAP;
    const GOOD: usize = 20;
    let cfg = udp::Config::default().with_max_peers(CAP);
    let l = udp::Listener::bind_with("127.0.0.1:0".parse()?, cfg).await?;
    let addr = l.local_addr()?;
    let counter = l.peer_counter();
    // A server that keeps every connection it accepted and echoes on it, as applications do.
    let evicted = Arc::new(AtomicUsize::new(0));
    let _serving = chunnel_negotiate::listen_with(Meter, l, Config::default(), {
        let evicted = evicted.clone();
        move |r| {
            if let Ok(conn) = r {
                let evicted = evicted.clone();
                tokio::spawn(async move {
                    loop {
                        match conn.recv_one().await {
                            Ok(m) => {
                                if conn.send_one(m).await.is_err() {
                                    return;
                                }
                            }
                            Err(CErr::PeerClosed) => {
                                evicted.fetch_add(1, Ordering::Relaxed);
                                return;
                            }
                            Err(_) => return,
                        }
                    }
                });
            }
        }
    });
    let hello = |conn_id: u64| {
        Hello {
            version: VERSION,
            conn_id,
            offers: Meter.offer_tree(),
            zero_rtt: None,
            early: Vec::new(),
            dictated: false,
        }
        .encode()
    };
    // The flood: one valid hello from each of `FLOOD` distinct sources; each is answered.
    let mut answered = 0;
    for i in 0..FLOOD {
        let src = format!("127.0.0.{}:0", 2 + i % 8);
        let s = tokio::net::UdpSocket::bind(&src).await?;
        s.send_to(&hello(i as u64 + 1), addr).await?;
        let mut buf = [0u8; 2048];
        if let Ok(Ok((n, _))) =
            tokio::time::timeout(Duration::from_secs(2), s.recv_from(&mut buf)).await
        {
            answered += usize::from(n > 0 && buf[0] == 0x02);
        }
    }
    // Every place is taken by a peer that was accepted and never sent data.
    ensure!(
        counter.count() <= CAP,
        "{} peers > cap {CAP}",
        counter.count()
    );
    let mut ok = 0;
    for _ in 0..GOOD {
        let base = udp::Connect::new(addr).connect_wrap(()).await?;
        let conn = tokio::time::timeout(
            Duration::from_secs(20),
            Client::new(Config::default()).connect(&addr.to_string(), Meter, base),
        )
        .await??;
        conn.send_one("ping".into()).await?;
        ensure!(conn.recv_one().await? == "ping");
        ok += 1;
    }
    eprintln!(
        "{answered} of {FLOOD} flood hellos accepted; {ok} of {GOOD} clients connected and \
         echoed; {} flood connections evicted; peers now {} (cap {CAP})",
        evicted.load(Ordering::Relaxed),
        counter.count()
    );
    ensure!(
        answered == FLOOD,
        "only {answered} of {FLOOD} flood hellos were accepted"
    );
    ensure!(evicted.load(Ordering::Relaxed) >= FLOOD - CAP);
    Ok(())
}

use chunnel_test::kinds;

/// A hello whose decision takes long (12 selects against 12, compatible only after a long
/// search; each hello carries a 0-RTT pick the server has not seen, so nothing remembered
/// answers it) delays no other client: it is decided away from the accept loop. Checked by
/// order, not by time: clients that start after the slow hello was sent all finish before its
/// answer arrives. When the accept loop decided every hello itself, they waited behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_decision_delays_no_other_client() -> Result<()> {
    use chunnel::{ConnectionExt, Offers, Pick};
    use chunnel_negotiate::wire::{Hello, VERSION};

    const GOOD: usize = 8;
    let l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = l.local_addr()?;
    let _serving = chunnel_negotiate::listen_with(kinds!(0), l, Config::default(), |r| {
        if let Ok(conn) = r {
            tokio::spawn(async move {
                while let Ok(m) = conn.recv_one().await {
                    if conn.send_one(m).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    let good = move || async move {
        let base = udp::Connect::new(addr).connect_wrap(()).await?;
        let conn = Client::new(Config::default())
            .connect(&addr.to_string(), kinds!(0), base)
            .await?;
        conn.send_one("ping".into()).await?;
        ensure!(conn.recv_one().await? == "ping");
        Ok::<_, anyhow::Error>(())
    };
    // The server has decided (and remembers) the well-behaved clients' offers.
    good().await?;

    let order = Arc::new(AtomicUsize::new(0));
    for round in 0..3u8 {
        let slow = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
        let hello = Hello {
            version: VERSION,
            conn_id: 1000 + u64::from(round),
            offers: kinds!(1).offer_tree(),
            // A pick of no option (more branches than 12 selects), another each round: searched
            // afresh every time.
            zero_rtt: Some(Pick::from_slice(&vec![0; 13 + usize::from(round)])),
            early: Vec::new(),
            dictated: false,
        }
        .encode();
        slow.send_to(&hello, addr).await?;
        let slow_answer = {
            let order = order.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let (n, _) = slow.recv_from(&mut buf).await?;
                let at = order.fetch_add(1, Ordering::SeqCst);
                Ok::<_, anyhow::Error>((at, buf[..n].first().copied()))
            })
        };
        let mut clients = Vec::new();
        for _ in 0..GOOD {
            let order = order.clone();
            clients.push(tokio::spawn(async move {
                good().await?;
                Ok::<_, anyhow::Error>(order.fetch_add(1, Ordering::SeqCst))
            }));
        }
        let mut last_good = 0;
        for c in clients {
            last_good = last_good.max(c.await??);
        }
        let (slow_at, tag) = tokio::time::timeout(Duration::from_secs(30), slow_answer).await???;
        eprintln!(
            "round {round}: slow answer (tag {tag:?}) came {slow_at}th, the last client {last_good}th"
        );
        ensure!(
            tag == Some(0x02),
            "the slow hello was not accepted: tag {tag:?}"
        );
        ensure!(
            slow_at > last_good,
            "a client that started after the slow hello finished after its answer"
        );
        order.store(0, Ordering::SeqCst);
    }
    Ok(())
}
