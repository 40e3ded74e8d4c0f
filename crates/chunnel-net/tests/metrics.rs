//! Feature `metrics`: a datagram listener's drops (oversized, peer queue full) and evictions
//! (peer cap) are exported through the `metrics` facade with the counts the listener keeps.

use std::time::Duration;

use chunnel::{ChunnelConnection, Listener};
use chunnel_net::udp::{self, Config};
use tokio::net::UdpSocket;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

fn value(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn drops_and_evictions_are_exported() -> Result<(), Box<dyn std::error::Error>> {
    let (rec, handle) = chunnel_metrics::prometheus::recorder();
    chunnel_metrics::metrics::set_global_recorder(rec).map_err(|_| "global recorder")?;

    // Peer queue full and oversized: queues of 2, payloads up to 100 bytes.
    let cfg = Config::default()
        .with_max_payload_bytes(100)
        .with_peer_queue(2);
    let mut l = udp::Listener::bind_with("127.0.0.1:0".parse()?, cfg).await?;
    let addr = l.local_addr()?;
    let a = UdpSocket::bind("127.0.0.1:0").await?;
    for i in 0..10u8 {
        a.send_to(&[i; 10], addr).await?;
    }
    // Give the kernel the datagrams before the listener reads its batch.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let conn = timeout(WAIT, l.accept()).await??;
    let mut slots = vec![None; 16];
    let mut delivered = 0;
    while let Ok(Ok(n)) = timeout(Duration::from_millis(200), conn.recv(&mut slots)).await {
        delivered += n as u64;
    }
    let b = UdpSocket::bind("127.0.0.1:0").await?;
    b.send_to(&[7; 300], addr).await?;
    // The oversized hello-less datagram starts a connection (its prefix kept for it).
    let _oversized = timeout(WAIT, l.accept()).await??;

    let (oversize, queue_full, _) = l.dropped();
    assert_eq!(oversize, 1);
    assert!(queue_full > 0, "ten datagrams into a queue of two");
    assert_eq!(
        delivered + queue_full,
        10,
        "each datagram delivered or dropped"
    );

    // Evictions: a cap of two peers, three new peers, none accepted yet.
    let cfg = Config::default().with_max_peers(2);
    let mut l2 = udp::Listener::bind_with("127.0.0.1:0".parse()?, cfg).await?;
    let addr2 = l2.local_addr()?;
    let mut peers = Vec::new();
    for _ in 0..3 {
        let s = UdpSocket::bind("127.0.0.1:0").await?;
        s.send_to(b"hi", addr2).await?;
        peers.push(s);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _c = timeout(WAIT, l2.accept()).await??;
    let (evicted, _) = l2.peer_cap_stats();
    assert!(evicted >= 1, "a third peer at a cap of two evicts one");

    let text = handle.render();
    eprintln!("{text}");
    let drops = "chunnel_datagram_dropped_total";
    assert_eq!(
        value(&text, &format!(r#"{drops}{{reason="oversize"}}"#)),
        oversize
    );
    assert_eq!(
        value(&text, &format!(r#"{drops}{{reason="queue_full"}}"#)),
        queue_full
    );
    assert_eq!(value(&text, "chunnel_datagram_evicted_total"), evicted);
    Ok(())
}
