//! Tests of the shard function, the advertisement, both sharding modes and the balancer.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use chunnel::{Capability, Chunnel, ChunnelInfo};

use super::client::DIRECT;
use super::*;
use crate::Error;

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct KeyedMsg {
    key: String,
    shard: u32,
}

impl Keyed for KeyedMsg {
    fn shard_key(&self) -> &[u8] {
        self.key.as_bytes()
    }
}

#[derive(Clone, Debug)]
struct TestUdp;

/// What clients dial for a bound shard socket: its `ip:port`.
fn dialled(l: &chunnel_net::udp::Listener) -> Result<String, chunnel::Error> {
    Ok(l.local_addr()?.to_string())
}

impl Dial for TestUdp {
    type Conn = chunnel_net::udp::Connection;
    async fn dial(&self, addr: &str) -> Result<chunnel_net::udp::Connection, chunnel::Error> {
        chunnel_net::udp::Connect::new(addr.parse().unwrap())
            .connect_wrap(())
            .await
    }
}

/// Client push over more shards than `recv` reads itself (the rest through the merge
/// queue), with one-slot and many-slot receives, and a receiver that started before the
/// shards were dialled: every reply arrives once, from the right shard.
type TestSer = crate::serialize::Serialize<KeyedMsg, crate::serialize::Bincode>;
type TestPush = ClientShardConn<
    crate::serialize::SerializeConn<
        chunnel_net::udp::Connection,
        KeyedMsg,
        crate::serialize::Bincode,
    >,
    TestUdp,
    TestSer,
>;

/// `n` shards answering with their index, and a client-push connection to them. The
/// canonical address is a socket nobody answers on (returned: keep it alive).
async fn push_client(n: usize) -> (ShardServer<KeyedMsg>, std::net::UdpSocket, Arc<TestPush>) {
    let ser = crate::serialize::Serialize::<KeyedMsg, _>::bincode();
    let any = "127.0.0.1:0".parse().unwrap();
    let shards = ShardServer::spawn(
        vec![chunnel_net::udp::Bind::new(any); n],
        dialled,
        ser,
        |i| {
            move |mut m: KeyedMsg| {
                m.shard = i as u32;
                Some(m)
            }
        },
        Config::default(),
    )
    .unwrap();
    let canonical = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let push = ClientShard::new(TestUdp, ser);
    push.directory().set(shards.addrs().to_vec()).unwrap();
    let base = chunnel_net::udp::Connect::new(canonical.local_addr().unwrap())
        .connect_wrap(())
        .await
        .unwrap();
    let conn = Arc::new(chunnel::stack![push, ser].connect_wrap(base).await.unwrap());
    (shards, canonical, conn)
}

#[tokio::test(flavor = "current_thread")]
async fn recv_from_reads_one_source_each() {
    let n = DIRECT + 2;
    let (_shards, _canonical, conn) = push_client(n).await;
    let sources = conn.sources().await.unwrap();
    assert_eq!(sources, DIRECT + 1, "4 direct shards and the merge queue");
    let mut slots: Vec<Option<KeyedMsg>> = vec![None; 8];
    match conn.recv_from(sources, &mut slots).await {
        Err(chunnel::Error::Layer { source, .. }) => assert!(
            matches!(
                source.downcast_ref::<Error>(),
                Some(Error::NoSuchSource { index, sources: s }) if *index == sources && *s == sources
            ),
            "{source}"
        ),
        other => panic!("source {sources} of {sources}: {other:?}"),
    }
    let total = 30 * n;
    let msgs: Vec<KeyedMsg> = (0..total)
        .map(|i| KeyedMsg {
            key: format!("key-{i}"),
            shard: u32::MAX,
        })
        .collect();
    conn.send(msgs).await.unwrap();
    // One reader per source, as a multiplexing client runs them, until all are in.
    let seen = Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = (0..sources)
        .map(|s| {
            let (conn, seen) = (Arc::clone(&conn), Arc::clone(&seen));
            tokio::spawn(async move {
                let mut slots: Vec<Option<KeyedMsg>> = vec![None; 8];
                let mut mine = Vec::new();
                while seen.load(Ordering::SeqCst) < total {
                    let r = tokio::time::timeout(
                        std::time::Duration::from_millis(50),
                        conn.recv_from(s, &mut slots),
                    )
                    .await;
                    if let Ok(k) = r {
                        let k = k.unwrap();
                        mine.extend(slots[..k].iter_mut().map(|m| m.take().unwrap()));
                        seen.fetch_add(k, Ordering::SeqCst);
                    }
                }
                (s, mine)
            })
        })
        .collect();
    let mut got = Vec::new();
    let mut per_source = vec![0usize; sources];
    for r in readers {
        let (s, ms) = tokio::time::timeout(std::time::Duration::from_secs(10), r)
            .await
            .expect("replies missing")
            .unwrap();
        for m in &ms {
            let shard = m.shard as usize;
            let expect = if shard < DIRECT { shard } else { DIRECT };
            assert_eq!(s, expect, "shard {shard}'s reply came through source {s}");
        }
        per_source[s] = ms.len();
        got.extend(ms);
    }
    assert_eq!(got.len(), total);
    assert!(per_source.iter().all(|&k| k > 0), "{per_source:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn client_push_receives_from_every_shard() {
    use chunnel::ConnectionExt;
    let n = DIRECT + 3;
    let (_shards, _canonical, conn) = push_client(n).await;
    let total = 40 * n;
    // Started before the first send: it waits on nothing but the canonical connection
    // until the shards are dialled.
    let early = tokio::spawn({
        let conn = Arc::clone(&conn);
        async move { conn.recv_one().await }
    });
    tokio::task::yield_now().await;
    let msgs: Vec<KeyedMsg> = (0..total)
        .map(|i| KeyedMsg {
            key: format!("key-{i}"),
            shard: u32::MAX,
        })
        .collect();
    for chunk in msgs.chunks(7) {
        conn.send(chunk.to_vec()).await.unwrap();
    }
    let mut got = vec![early.await.unwrap().unwrap()];
    let mut slots: Vec<Option<KeyedMsg>> = vec![None; 32];
    let mut one = true;
    while got.len() < total {
        let r = if one {
            conn.recv(&mut slots[..1])
        } else {
            conn.recv(&mut slots)
        };
        let k = tokio::time::timeout(std::time::Duration::from_secs(5), r)
            .await
            .expect("a reply is missing")
            .unwrap();
        assert!(k >= 1 && (!one || k == 1));
        got.extend(slots[..k].iter_mut().map(|s| s.take().unwrap()));
        one = !one;
    }
    assert_eq!(got.len(), total);
    got.sort_by(|a, b| a.key.cmp(&b.key));
    got.dedup_by(|a, b| a.key == b.key);
    assert_eq!(got.len(), total, "a reply was delivered twice");
    let mut used = vec![false; n];
    for m in &got {
        assert_eq!(m.shard as usize, shard_of(m.key.as_bytes(), n), "{m:?}");
        used[m.shard as usize] = true;
    }
    assert!(used.iter().all(|&u| u), "every shard answered some");
}

#[test]
fn fnv1a_known_values() {
    // Reference values of 64-bit FNV-1a.
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    assert_eq!(shard_of(b"x", 0), 0);
    assert!((0..1000).all(|i| shard_of(format!("k{i}").as_bytes(), 7) < 7));
}

#[test]
fn advertisement_round_trips_and_matches_client_push_only() {
    let addrs = vec!["127.0.0.1:1".to_owned(), "[::1]:2".to_owned()];
    let ad = advertisement(&addrs);
    assert_eq!(parse_advertisement(&ad).unwrap(), addrs);
    let client = Capability::exact(CAPABILITY, [CLIENT_PUSH, HASH_LABEL]);
    assert!(ad.compatible(&client));
    let other_hash = Capability::exact(CAPABILITY, [CLIENT_PUSH, "hash=crc32"]);
    assert!(!ad.compatible(&other_hash));
    let server_side = Capability::compositional(CAPABILITY, [SERVER_SIDE]);
    assert!(!server_side.compatible(&client));

    let dir = ShardDirectory::new();
    let info = [ChunnelInfo {
        id: CANONICAL_ID.into(),
        capabilities: vec![ad],
    }];
    assert_eq!(dir.learn(&info).unwrap(), 2);
    assert_eq!(dir.get().unwrap(), &addrs[..]);
    assert!(dir.set(vec!["x".into()]).is_err());
    assert_eq!(ShardDirectory::new().learn(&[]).unwrap(), 0);
}

#[test]
fn bad_advertisements_are_typed_errors() {
    let cap = |labels: &[&str]| Capability::exact(CAPABILITY, labels.iter().map(|l| l.to_string()));
    for labels in [
        &[CLIENT_PUSH, HASH_LABEL][..],
        &[CLIENT_PUSH, "shard=0@a"],
        &[CLIENT_PUSH, HASH_LABEL, "shard=1@a"],
        &[CLIENT_PUSH, HASH_LABEL, "shard=0@a", "shard=0@b"],
        &[CLIENT_PUSH, HASH_LABEL, "shard=x@a"],
        &[CLIENT_PUSH, HASH_LABEL, "shard=0"],
        &[CLIENT_PUSH, HASH_LABEL, "shard=0@"],
        &[CLIENT_PUSH, HASH_LABEL, "shard=99999999@a"],
        &[SERVER_SIDE],
    ] {
        assert!(
            matches!(
                parse_advertisement(&cap(labels)),
                Err(Error::BadShardSet { .. })
            ),
            "{labels:?}"
        );
    }
}

/// At a switch away from client push (a reconfigurable select), the replies already in the
/// merge queue (shards past the fourth) are handed over, once each.
#[tokio::test(flavor = "current_thread")]
async fn handover_exports_the_merged_replies() {
    use chunnel::Handover;
    let n = DIRECT + 2;
    let (_shards, _canonical, conn) = push_client(n).await;
    let msgs: Vec<KeyedMsg> = (0..500)
        .map(|i| KeyedMsg {
            key: format!("key-{i}"),
            shard: u32::MAX,
        })
        .filter(|m| shard_of(m.key.as_bytes(), n) >= DIRECT)
        .take(20)
        .collect();
    assert_eq!(msgs.len(), 20);
    conn.send(msgs.clone()).await.unwrap();
    // The pumps move the replies into the merge queue; nobody reads it.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let mut h = chunnel::Handoff::new();
    conn.export(&mut h);
    assert!(h.buffered.iter().all(|m| m.shard as usize >= DIRECT));
    let mut got: Vec<String> = h.buffered.iter().map(|m| m.key.clone()).collect();
    let mut want: Vec<String> = msgs.iter().map(|m| m.key.clone()).collect();
    got.sort();
    want.sort();
    assert_eq!(got, want);
}
