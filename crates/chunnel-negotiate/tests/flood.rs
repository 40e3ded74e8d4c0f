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
