//! The XDP sharding offload across two network namespaces joined by a veth pair: kernel UDP
//! shard sockets in namespace b behind the offload, a kernel UDP client in namespace a that
//! sends hand-encoded chunnel-kv requests (bincode 2 standard varints) to the steering
//! address. Every request must reach the shard `fnv1a64(key) % N` picks, and every reply must
//! come back to the client's connected socket from the steering address.
//!
//! Needs root and `ip`; skips (passes) otherwise unless CHUNNEL_XDP_REQUIRE=1. Each test
//! creates its own uniquely named namespaces and removes them in a Drop guard.

use std::net::{SocketAddrV4, UdpSocket};
use std::time::Duration;

use anyhow::{Result, bail, ensure};
use chunnel::Negotiate;
use chunnel_test::netns::VethPair;
use chunnel_xdp::shard::{self, ShardOffload, ShardOffloadConfig, XdpShard};

/// Two namespaces joined by `sa` (10.81.0.1, in `a`) – `sb` (10.81.0.2, in `b`).
fn netns() -> Result<VethPair> {
    Ok(VethPair::new(
        "chxs",
        ("sa", "sb"),
        ("10.81.0.1/24", "10.81.0.2/24"),
    )?)
}

fn privileged() -> bool {
    let ok = chunnel_test::netns::can_create() && shard::embedded_shard_program_available();
    if !ok {
        assert!(
            std::env::var_os("CHUNNEL_XDP_REQUIRE").is_none(),
            "CHUNNEL_XDP_REQUIRE is set but not root / no `ip` / no XDP sharding program"
        );
        eprintln!("skipping: not root, no `ip`, or the XDP sharding program was not built");
    }
    ok
}

fn enter(ns: &str) -> Result<()> {
    Ok(chunnel_test::netns::enter(ns)?)
}

fn varint(out: &mut Vec<u8>, v: u64) {
    if v < 251 {
        out.push(v as u8);
    } else if v <= u64::from(u16::MAX) {
        out.push(251);
        out.extend_from_slice(&(v as u16).to_le_bytes());
    } else if v <= u64::from(u32::MAX) {
        out.push(252);
        out.extend_from_slice(&(v as u32).to_le_bytes());
    } else {
        out.push(253);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// `Msg::Request { client, id, op: Put { key, value } }` as bincode 2 `standard()` writes it.
fn request(client: u64, id: u64, key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut m = Vec::new();
    varint(&mut m, 0); // Request
    varint(&mut m, client);
    varint(&mut m, id);
    varint(&mut m, 1); // Put
    varint(&mut m, key.len() as u64);
    m.extend_from_slice(key);
    varint(&mut m, value.len() as u64);
    m.extend_from_slice(value);
    m
}

/// Extracts the key from a request built by [`request`] (test side).
fn key_of(mut m: &[u8]) -> Vec<u8> {
    fn take(m: &mut &[u8]) -> u64 {
        let t = m[0];
        let (v, n) = match t {
            0..=250 => (u64::from(t), 1),
            251 => (u64::from(u16::from_le_bytes([m[1], m[2]])), 3),
            252 => (
                u64::from(u32::from_le_bytes(m[1..5].try_into().unwrap())),
                5,
            ),
            _ => (u64::from_le_bytes(m[1..9].try_into().unwrap()), 9),
        };
        *m = &m[n..];
        v
    }
    for _ in 0..4 {
        take(&mut m);
    }
    let n = take(&mut m) as usize;
    m[..n].to_vec()
}

const SHARDS: usize = 4;
const STEER: &str = "10.81.0.2:7100";

#[test]
fn requests_reach_the_hashed_shard_and_replies_come_from_the_steering_port() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let ns = netns()?;
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
    let (stop_tx, stop_rx) = std::sync::mpsc::sync_channel::<()>(1);
    let nsb = ns.b.clone();
    let server = std::thread::spawn(
        move || -> Result<(Vec<u64>, shard::ShardCounters, Vec<u64>)> {
            enter(&nsb)?;
            let socks: Vec<UdpSocket> = (0..SHARDS)
                .map(|_| UdpSocket::bind("10.81.0.2:0"))
                .collect::<std::io::Result<_>>()?;
            let ports: Vec<u16> = socks
                .iter()
                .map(|s| s.local_addr().map(|a| a.port()))
                .collect::<std::io::Result<_>>()?;
            let steer: SocketAddrV4 = STEER.parse()?;
            let offload = ShardOffload::attach(ShardOffloadConfig::new("sb", steer, ports))?;
            eprintln!("offload attached, native XDP: {}", offload.native());
            // Each shard echoes the request with its index appended, and checks the hash.
            let mut handles = Vec::new();
            for (i, s) in socks.into_iter().enumerate() {
                s.set_read_timeout(Some(Duration::from_millis(100)))?;
                handles.push(std::thread::spawn(move || -> Result<u64> {
                    let mut buf = [0u8; 2048];
                    let mut served = 0;
                    let mut idle = 0;
                    loop {
                        match s.recv_from(&mut buf) {
                            Ok((n, peer)) => {
                                idle = 0;
                                let key = key_of(&buf[..n]);
                                ensure!(
                                    shard::shard_of(&key, SHARDS) == i,
                                    "shard {i} got key {key:?}"
                                );
                                let mut r = buf[..n].to_vec();
                                r.push(i as u8);
                                s.send_to(&r, peer)?;
                                served += 1;
                            }
                            Err(_) => {
                                idle += 1;
                                if idle > 50 {
                                    return Ok(served);
                                }
                            }
                        }
                    }
                }));
            }
            ready_tx.send(())?;
            let _ = stop_rx.recv_timeout(Duration::from_secs(60));
            let counters = offload.counters()?;
            let steered = offload.steered()?;
            drop(offload);
            let served = handles
                .into_iter()
                .map(|h| h.join().expect("shard thread panicked"))
                .collect::<Result<Vec<_>>>()?;
            Ok((served, counters, steered))
        },
    );
    if ready_rx.recv_timeout(Duration::from_secs(20)).is_err() {
        let r = server.join().expect("server thread panicked");
        bail!("server did not start: {:?}", r.err());
    }
    let nsa = ns.a.clone();
    let total = 400usize;
    let client = std::thread::spawn(move || -> Result<Vec<usize>> {
        enter(&nsa)?;
        let s = UdpSocket::bind("10.81.0.1:0")?;
        s.connect(STEER)?;
        s.set_read_timeout(Some(Duration::from_millis(500)))?;
        let mut per = vec![0usize; SHARDS];
        let mut buf = [0u8; 2048];
        for i in 0..total {
            let key = format!("user{}", i * 7919);
            let req = request(0xdead_beef_0123_4567, 1000 + i as u64, key.as_bytes(), b"v");
            let mut tries = 0;
            let n = loop {
                s.send(&req)?;
                match s.recv(&mut buf) {
                    Ok(n) => break n,
                    Err(_) if tries < 3 => tries += 1,
                    Err(e) => bail!("no reply to request {i}: {e}"),
                }
            };
            ensure!(
                n == req.len() + 1 && buf[..req.len()] == req[..],
                "reply {i} differs"
            );
            let shard = buf[req.len()] as usize;
            ensure!(
                shard == shard::shard_of(key.as_bytes(), SHARDS),
                "wrong shard"
            );
            per[shard] += 1;
        }
        Ok(per)
    });
    let per = client.join().expect("client thread panicked");
    let _ = stop_tx.send(());
    let (served, counters, steered) = server.join().expect("server thread panicked")?;
    let per = per?;
    eprintln!("replies per shard {per:?}, served {served:?}, steered {steered:?}, {counters:?}");
    ensure!(per.iter().all(|&n| n > 0), "a shard got nothing: {per:?}");
    ensure!(per.iter().sum::<usize>() == total);
    ensure!(
        steered.iter().sum::<u64>() == counters.steered && counters.steered >= total as u64,
        "steered {steered:?} vs {counters:?}"
    );
    ensure!(
        steered.iter().zip(&served).all(|(&st, &sv)| st == sv),
        "steered {steered:?} != served {served:?}"
    );
    ensure!(counters.egress_rewritten == served.iter().sum::<u64>());
    ensure!(counters.malformed == 0, "{counters:?}");
    Ok(())
}

#[test]
fn not_available_outside_privilege_or_on_a_missing_interface() {
    let r = ShardOffload::attach(ShardOffloadConfig::new(
        "no-such-if0",
        "10.81.0.2:7100".parse().unwrap(),
        vec![1, 2],
    ));
    match &r {
        Err(chunnel::Error::NotAvailable { chunnel, reason }) => {
            assert_eq!(*chunnel, shard::SHARD_ID);
            eprintln!("reason: {reason}");
        }
        r => panic!("{r:?}"),
    }
    let x = XdpShard::new((), r.map(std::sync::Arc::new), Vec::new());
    assert!(x.check_available().is_err());
}
