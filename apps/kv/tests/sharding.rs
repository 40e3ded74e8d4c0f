//! The store over real UDP loopback: client push and server-side sharding give the same
//! answers as an in-memory model, both modes at once against one server ("mixed"), and
//! malformed datagrams do not hurt the server.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use chunnel_kv::{ClientConfig, KvClient, KvServer, Offer, Op, ServerConfig, Sharding};

/// A deterministic workload: `n` operations on `keys` keys (xorshift64, fixed seed).
fn workload(seed: u64, n: usize, keys: u64, prefix: &str) -> Vec<Op> {
    let mut x = seed.max(1);
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|i| {
            let r = next();
            let key = format!("{prefix}key-{}", r % keys).into_bytes();
            match (r >> 32) % 10 {
                0..=3 => Op::Get { key },
                4..=7 => Op::Put {
                    key,
                    value: format!("v{i}-{}", r >> 40).into_bytes(),
                },
                _ => Op::Delete { key },
            }
        })
        .collect()
}

/// Runs `ops` one after the other; checks every answer against a model; returns the answers.
async fn run_checked(client: &KvClient, ops: &[Op]) -> Vec<Option<Vec<u8>>> {
    let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    let mut answers = Vec::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate() {
        let want = match op.clone() {
            Op::Get { key } => model.get(&key).cloned(),
            Op::Put { key, value } => model.insert(key, value),
            Op::Delete { key } => model.remove(&key),
        };
        let got = client.call(op.clone()).await.expect("request failed");
        assert_eq!(got, want, "operation {i}: {op:?}");
        answers.push(got);
    }
    answers
}

fn localhost() -> std::net::SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A client of `server` offering `offer`.
async fn client(server: &KvServer, offer: Offer) -> KvClient {
    KvClient::connect(server.addr(), ClientConfig::default().with_offer(offer))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_push_and_server_side_give_the_same_answers() {
    let ops = workload(0x5eed, 3000, 300, "");
    let mut results = Vec::new();
    for offer in [Offer::ClientPush, Offer::ServerSide] {
        let server = KvServer::start(localhost(), ServerConfig::new(4))
            .await
            .unwrap();
        let client = KvClient::connect(server.addr(), ClientConfig::default().with_offer(offer))
            .await
            .unwrap();
        let want = match offer {
            Offer::ClientPush => Sharding::ClientPush,
            _ => Sharding::ServerSide,
        };
        assert_eq!(client.sharding(), want);
        results.push(run_checked(&client, &ops).await);
        // Every shard did some of the work.
        assert!(server.shard_stats().requests.load(Ordering::Relaxed) >= ops.len() as u64);
    }
    assert_eq!(results[0], results[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_clients_share_one_server() {
    let server = KvServer::start(localhost(), ServerConfig::new(3))
        .await
        .unwrap();
    let push = client(&server, Offer::ClientPush).await;
    let via = client(&server, Offer::ServerSide).await;
    // Offering both, a client gets the server's preference: client push.
    let both = KvClient::connect(server.addr(), ClientConfig::default())
        .await
        .unwrap();
    assert_eq!(push.sharding(), Sharding::ClientPush);
    assert_eq!(via.sharding(), Sharding::ServerSide);
    assert_eq!(both.sharding(), Sharding::ClientPush);
    // The server counts a connection when its accept loop takes it: shortly after the
    // client's handshake finished.
    let counts = || {
        let c = server.counts();
        (
            c.client_push.load(Ordering::Relaxed),
            c.server_side.load(Ordering::Relaxed),
        )
    };
    for _ in 0..200 {
        if counts() == (2, 1) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(counts(), (2, 1), "(client push, server-side) connections");

    // Disjoint keys, concurrently: each agrees with its own model.
    let a = workload(1, 1500, 200, "a/");
    let b = workload(2, 1500, 200, "b/");
    tokio::join!(run_checked(&push, &a), run_checked(&via, &b));

    // One store: what one mode writes, the other reads.
    assert_eq!(push.put(b"shared", b"1").await.unwrap(), None);
    assert_eq!(
        via.get(b"shared").await.unwrap().as_deref(),
        Some(&b"1"[..])
    );
    assert_eq!(
        via.put(b"shared", b"2").await.unwrap().as_deref(),
        Some(&b"1"[..])
    );
    assert_eq!(
        push.delete(b"shared").await.unwrap().as_deref(),
        Some(&b"2"[..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_client_push_serves_everyone_through_the_canonical_address() {
    let cfg = ServerConfig::new(2).with_client_push(false);
    let server = KvServer::start(localhost(), cfg).await.unwrap();
    let both = KvClient::connect(server.addr(), ClientConfig::default())
        .await
        .unwrap();
    assert_eq!(both.sharding(), Sharding::ServerSide);
    assert_eq!(both.put(b"k", b"v").await.unwrap(), None);
    // A client that insists on client push is refused.
    let push = KvClient::connect(
        server.addr(),
        ClientConfig::default().with_offer(Offer::ClientPush),
    )
    .await;
    assert!(
        matches!(push, Err(chunnel_kv::KvError::Negotiate(_))),
        "{push:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_outstanding_requests_from_one_client() {
    let server = KvServer::start(localhost(), ServerConfig::new(4))
        .await
        .unwrap();
    for offer in [Offer::ClientPush, Offer::ServerSide] {
        let client = Arc::new(
            KvClient::connect(server.addr(), ClientConfig::default().with_offer(offer))
                .await
                .unwrap(),
        );
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..300u32 {
            let c = Arc::clone(&client);
            let key = format!("{offer:?}/{i}");
            tasks.spawn(async move {
                assert_eq!(c.put(key.as_bytes(), &i.to_le_bytes()).await.unwrap(), None);
                assert_eq!(
                    c.get(key.as_bytes()).await.unwrap(),
                    Some(i.to_le_bytes().to_vec())
                );
            });
        }
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_datagrams_are_dropped_and_the_server_keeps_serving() {
    let server = KvServer::start(localhost(), ServerConfig::new(2))
        .await
        .unwrap();
    let push = client(&server, Offer::ClientPush).await;
    let via = client(&server, Offer::ServerSide).await;
    assert_eq!(push.put(b"x", b"1").await.unwrap(), None);

    let junk: [&[u8]; 6] = [
        b"",
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff",
        b"\x00",
        b"\x00\x00\xfc\xff\xff\xff\xff\xff\xff\xff\xff", // huge claimed length
        b"\x01garbage hello",
        &[0x41; 2000],
    ];
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let mut targets: Vec<String> = server.shard_addrs().to_vec();
    targets.push(server.addr().to_string());
    for t in &targets {
        for j in junk {
            sock.send_to(j, t.as_str()).await.unwrap();
        }
    }
    // A well-formed reply sent to a shard as if it were a request: ignored, no answer.
    use chunnel_std::serialize::Format as _;
    let reply = chunnel_kv::Msg::Response { id: 7, value: None };
    let bytes = chunnel_std::serialize::Bincode::to_bytes(&reply).unwrap();
    sock.send_to(&bytes, server.shard_addrs()[0].as_str())
        .await
        .unwrap();
    // The shards run on their own threads: wait (bounded) for them to count it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while server.shard_stats().malformed.load(Ordering::Relaxed) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "junk to the shards was counted"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }

    // Everyone is still served, both ways.
    assert_eq!(push.get(b"x").await.unwrap().as_deref(), Some(&b"1"[..]));
    assert_eq!(
        via.put(b"x", b"2").await.unwrap().as_deref(),
        Some(&b"1"[..])
    );
    let late = KvClient::connect(server.addr(), ClientConfig::default())
        .await
        .unwrap();
    assert_eq!(late.get(b"x").await.unwrap().as_deref(), Some(&b"2"[..]));
}
