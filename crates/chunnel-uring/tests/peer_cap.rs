//! The io_uring listener's peer table is capped (`Config::max_peers`): past the cap, a new
//! source evicts the oldest peer nobody accepted yet; accepted connections stay.

use std::time::Duration;

use chunnel::{ConnectionExt, Listener as _};
use chunnel_uring::udp;
use tokio::net::UdpSocket;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_sources_past_the_cap_evict_the_oldest_peers_nobody_accepted() {
    chunnel_uring::check_available().expect("io_uring is available on this machine");
    let cfg = udp::Config::default().with_datagram(|d| d.with_max_peers(4));
    let mut l = udp::Listener::bind_with("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();

    let first = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    first.send_to(b"a", addr).await.unwrap();
    let accepted = l.accept().await.unwrap();
    assert_eq!(accepted.recv_one().await.unwrap(), "a");

    // Ten new sources, one datagram each, none accepted yet.
    let mut sources = Vec::new();
    for i in 0..10u8 {
        let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        s.send_to(&[i], addr).await.unwrap();
        sources.push(s);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The cap holds the accepted connection and the three newest sources.
    let mut got = Vec::new();
    while let Ok(Ok(c)) = tokio::time::timeout(Duration::from_millis(300), l.accept()).await {
        got.push(c.recv_one().await.unwrap()[0]);
    }
    assert_eq!(got, [7, 8, 9], "the newest sources were kept");
    assert_eq!(l.peer_cap_stats(), (7, 0));
    assert!(l.peer_count() <= 4);
    // The accepted connection was never evicted.
    first.send_to(b"b", addr).await.unwrap();
    assert_eq!(accepted.recv_one().await.unwrap(), "b");
}
