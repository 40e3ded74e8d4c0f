//! `Ordered` over `Reliable` with many tasks sending on one connection, over real UDP
//! loopback sockets, default capacities.
//!
//! The bar: 8 concurrent senders, at least 5 million messages across the runs (set
//! `CHUNNEL_CONCURRENT_MESSAGES`; `scripts/test-all.sh` runs this file in release with
//! 5,000,000 over 5 runs), 0 lost, 0 duplicated, each sender's messages in its send order.
//! The default count of a debug `cargo test` is smaller so the suite stays quick.
//!
//! Each message carries its sender and that sender's index; the receiver checks every
//! sender's indices arrive as exactly `0..n`, in order. `Ordered` must never skip a gap over
//! a lossless base: a gap it skips is a lost message.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use chunnel::{Chunnel, ChunnelConnection, ChunnelExt, Listener, stack};
use chunnel_net::udp;
use chunnel_std::ordered::Ordered;
use chunnel_std::reliable::Reliable;
use chunnel_test::fault::{FaultInjector, Faults};

const SENDERS: usize = 8;

fn msg(sender: usize, i: u64) -> Bytes {
    let mut b = BytesMut::with_capacity(16);
    b.put_u64(sender as u64);
    b.put_u64(i);
    b.freeze()
}

/// Per-sender bookkeeping at the receiver.
#[derive(Default)]
struct Check {
    next: [u64; SENDERS],
    out_of_order: u64,
    duplicates: u64,
    alien: u64,
    received: u64,
}

impl Check {
    fn see(&mut self, m: &[u8]) {
        self.received += 1;
        if m.len() != 16 {
            self.alien += 1;
            return;
        }
        let s = u64::from_be_bytes(m[..8].try_into().unwrap()) as usize;
        let i = u64::from_be_bytes(m[8..].try_into().unwrap());
        let Some(next) = self.next.get_mut(s) else {
            self.alien += 1;
            return;
        };
        if i == *next {
            *next += 1;
        } else if i < *next {
            self.duplicates += 1;
        } else {
            // A message of this sender was skipped (lost) or overtaken.
            self.out_of_order += 1;
            *next = i + 1;
        }
    }

    fn verdict(&self, per_sender: u64) -> Result<(), String> {
        let total = per_sender * SENDERS as u64;
        let lost = total.saturating_sub(self.received - self.duplicates - self.alien);
        if (lost, self.out_of_order, self.duplicates, self.alien) == (0, 0, 0, 0) {
            Ok(())
        } else {
            Err(format!(
                "{} received of {total}: {lost} lost, {} gaps or reorderings, {} duplicates, \
                 {} unknown; next expected per sender {:?}",
                self.received, self.out_of_order, self.duplicates, self.alien, self.next
            ))
        }
    }
}

/// One run: `SENDERS` tasks share one client connection, each sends `per_sender` messages in
/// bursts of `burst`; the server receives until all arrived (or nothing comes for 10 s).
async fn run(per_sender: u64, burst: u64, faults: Option<FaultInjector>) -> (Check, Duration) {
    let listener = udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mut server = stack![Ordered::default(), Reliable::default()].serve(listener);
    let started = Instant::now();
    // The client connection lives until everything arrived: dropping it would drop the
    // messages it has not had acknowledged yet.
    let (senders, _client): (_, Arc<dyn std::any::Any + Send + Sync>) = match faults {
        None => {
            let mut client = stack![
                Ordered::default(),
                Reliable::default(),
                udp::Connect::new(addr)
            ];
            let conn = Arc::new(client.connect_wrap(()).await.expect("connect"));
            (spawn_senders(conn.clone(), per_sender, burst), conn)
        }
        Some(f) => {
            let mut client = stack![
                Ordered::default(),
                Reliable::default(),
                f,
                udp::Connect::new(addr)
            ];
            let conn = Arc::new(client.connect_wrap(()).await.expect("connect"));
            (spawn_senders(conn.clone(), per_sender, burst), conn)
        }
    };
    let peer = tokio::time::timeout(Duration::from_secs(5), server.accept())
        .await
        .expect("accept in time")
        .expect("accept");
    let total = per_sender * SENDERS as u64;
    let mut check = Check::default();
    let mut slots = vec![None; 64];
    while check.received < total {
        match tokio::time::timeout(Duration::from_secs(10), peer.recv(&mut slots)).await {
            Ok(Ok(k)) => {
                for s in &mut slots[..k] {
                    check.see(&s.take().expect("filled slot"));
                }
            }
            Ok(Err(e)) => panic!("recv failed after {} messages: {e}", check.received),
            Err(_) => break,
        }
    }
    // Anything more would be a duplicate.
    if let Ok(Ok(k)) = tokio::time::timeout(Duration::from_millis(200), peer.recv(&mut slots)).await
    {
        for s in &mut slots[..k] {
            check.see(&s.take().expect("filled slot"));
        }
    }
    let elapsed = started.elapsed();
    for s in senders {
        s.await.expect("sender");
    }
    (check, elapsed)
}

fn spawn_senders<C>(conn: Arc<C>, per_sender: u64, burst: u64) -> Vec<tokio::task::JoinHandle<()>>
where
    C: ChunnelConnection<Data = Bytes> + 'static,
{
    (0..SENDERS)
        .map(|s| {
            let conn = conn.clone();
            tokio::spawn(async move {
                let mut i = 0;
                while i < per_sender {
                    let k = (per_sender - i).min(burst);
                    conn.send((i..i + k).map(|j| msg(s, j)))
                        .await
                        .expect("send");
                    i += k;
                }
            })
        })
        .collect()
}

fn total_messages() -> u64 {
    std::env::var("CHUNNEL_CONCURRENT_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if cfg!(debug_assertions) {
            400_000
        } else {
            2_000_000
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_senders_lose_nothing_and_keep_each_senders_order() {
    let total = total_messages();
    let runs: u64 = if total >= 1_000_000 { 5 } else { 2 };
    let per_sender = total / runs / SENDERS as u64;
    let mut sent = 0;
    for run_no in 0..runs {
        // Bursts of 1 (many small sends interleaving) and of 32 (the usual batch).
        let burst = if run_no % 2 == 0 { 32 } else { 1 };
        let (check, elapsed) = run(per_sender, burst, None).await;
        eprintln!(
            "run {run_no}: {} senders x {per_sender} (bursts of {burst}): {} received in {:?}",
            SENDERS, check.received, elapsed
        );
        check.verdict(per_sender).unwrap();
        sent += per_sender * SENDERS as u64;
    }
    eprintln!("{sent} messages over {runs} runs: 0 lost, 0 duplicated, every sender in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_senders_over_a_lossy_reordering_link() {
    // 5% of datagrams dropped and 5% reordered in both directions of the client.
    let f = Faults::none().with_drop(0.05).with_reorder(0.05, 3);
    let faults = FaultInjector::seeded(0x5EED)
        .with_send(f)
        .with_recv(f)
        .without_log();
    let per_sender = if cfg!(debug_assertions) {
        5_000
    } else {
        25_000
    };
    let (check, elapsed) = run(per_sender, 16, Some(faults.clone())).await;
    eprintln!(
        "lossy: {} received in {:?}; injector dropped {} sent, {} received",
        check.received,
        elapsed,
        faults.stats.dropped_sent(),
        faults.stats.dropped_received()
    );
    check.verdict(per_sender).unwrap();
    assert!(
        faults.stats.dropped_sent() > 0,
        "the faults really happened"
    );
}
