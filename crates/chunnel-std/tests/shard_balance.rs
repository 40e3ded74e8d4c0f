//! The load balancer over real UDP: messages alternate between replicas, replies merge.

use chunnel::{Chunnel, ChunnelConnection, ConnectionExt, Listener as _};
use chunnel_net::udp;
use chunnel_std::shard::{Balance, BalanceConn};

/// A UDP echo replica that prefixes every reply with its tag.
async fn replica(tag: u8) -> std::net::SocketAddr {
    let mut l = udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok(c) = l.accept().await {
            tokio::spawn(async move {
                while let Ok(m) = c.recv_one().await {
                    let mut v = vec![tag];
                    v.extend_from_slice(&m);
                    let _ = c.send_one(v.into()).await;
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn round_robin_over_replicas_and_merged_replies() {
    let (a, b) = (replica(b'a').await, replica(b'b').await);
    let mut lb = Balance::new(vec![udp::Connect::new(a), udp::Connect::new(b)]);
    let conn = lb.connect_wrap(()).await.unwrap();
    assert_eq!(conn.replicas().len(), 2);
    conn.send((0..10u8).map(|i| bytes::Bytes::from(vec![i])))
        .await
        .unwrap();
    let mut got = Vec::new();
    while got.len() < 10 {
        let mut slots = vec![None; 16];
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), conn.recv(&mut slots))
            .await
            .expect("replies")
            .unwrap();
        got.extend(slots[..n].iter_mut().filter_map(Option::take));
    }
    got.sort();
    // Even messages went to the first replica, odd ones to the second.
    let want: Vec<Vec<u8>> = (0..10u8)
        .map(|i| vec![if i % 2 == 0 { b'a' } else { b'b' }, i])
        .collect();
    let mut want: Vec<bytes::Bytes> = want.into_iter().map(Into::into).collect();
    want.sort();
    assert_eq!(got, want);
}

#[tokio::test]
async fn no_replica_is_a_typed_error() {
    let r = BalanceConn::<udp::Connection>::new(Vec::new());
    let Err(chunnel::Error::Layer { source, .. }) = r else {
        panic!("{r:?}")
    };
    assert!(matches!(
        source.downcast_ref::<chunnel_std::Error>(),
        Some(chunnel_std::Error::BadShardSet { .. })
    ));
}
