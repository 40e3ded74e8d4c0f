//! The Redis backend against a real redis-server: the store semantics every backend must have,
//! a race of many first proposers, and the store dying and coming back.
#![cfg(feature = "redis")]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel_rendezvous::{Error, JoinReply, Member, RedisStore, Store};

const LEASE: Duration = Duration::from_secs(30);

fn member(i: usize) -> Member {
    Member {
        id: format!("m{i}"),
        addr: format!("127.0.0.1:{}", 41000 + i),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_semantics() {
    let scratch = support::Scratch::new("redis-conf");
    let (_server, url) = support::redis(&scratch);
    let store = RedisStore::connect(&url).await.unwrap();
    assert_eq!(store.backend(), "redis");
    chunnel_rendezvous::conformance::store_semantics(&store, "conf").await;
    // Braces and `%` in group names are escaped in the keys' hash tag.
    chunnel_rendezvous::conformance::store_semantics(&store, "{odd}%7B").await;
}

/// 64 participants, each with its own connection, race to create one group: exactly one wins,
/// every other sees the winner's stack and then joins at its epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_racing_first_proposers() {
    const N: usize = 64;
    let scratch = support::Scratch::new("redis-race");
    let (_server, url) = support::redis(&scratch);
    let group = "race";
    // Binary stacks: every byte value must survive the round trip.
    let stack = |i: usize| Bytes::from(vec![0, 0xff, i as u8, b'\n', 0x80, b'"', 0]);
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let mut tasks = Vec::new();
    for i in 0..N {
        let (url, barrier) = (url.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let store = RedisStore::connect(&url).await.unwrap();
            barrier.wait().await;
            let first = store
                .join(group, &member(i), Some(&stack(i)), None, LEASE)
                .await
                .unwrap();
            (i, store, first)
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    let winners: Vec<usize> = results
        .iter()
        .filter(|(_, _, r)| matches!(r, JoinReply::Created(_)))
        .map(|(i, _, _)| *i)
        .collect();
    assert_eq!(winners.len(), 1, "winners: {winners:?}");
    let winner = winners[0];
    for (i, _, r) in &results {
        match r {
            JoinReply::Created(s) => {
                assert_eq!(s.epoch(), 1);
                assert_eq!(s.committed.as_ref().unwrap().stack, stack(winner));
                assert_eq!(s.members, vec![member(winner)]);
            }
            JoinReply::Current(s) => {
                assert_eq!(s.epoch(), 1, "member {i}");
                assert_eq!(s.committed.as_ref().unwrap().stack, stack(winner));
                assert!(!s.is_member(&member(*i).id), "loser {i} was added");
            }
            JoinReply::Joined(_) => panic!("member {i} joined without expecting an epoch"),
        }
    }
    let mut tasks = Vec::new();
    for (i, store, _) in results {
        tasks.push(tokio::spawn(async move {
            store
                .join(group, &member(i), None, Some(1), LEASE)
                .await
                .unwrap()
        }));
    }
    for t in tasks {
        assert!(matches!(t.await.unwrap(), JoinReply::Joined(_)));
    }
    let store = RedisStore::connect(&url).await.unwrap();
    let s = store.snapshot(group).await.unwrap();
    assert_eq!(s.epoch(), 1);
    assert_eq!(s.committed.unwrap().stack, stack(winner));
    let mut expected: Vec<Member> = (0..N).map(member).collect();
    expected.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(s.members, expected);
}

/// A dead store fails operations quickly with `Unavailable`; once it is back, the same
/// `RedisStore` works again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_down_and_back() {
    let scratch = support::Scratch::new("redis-down");
    let (mut server, url) = support::redis(&scratch);
    let store = RedisStore::connect(&url).await.unwrap();
    let stack = Bytes::from_static(b"stack-a");
    assert!(matches!(
        store
            .join("g", &member(1), Some(&stack), None, LEASE)
            .await
            .unwrap(),
        JoinReply::Created(_)
    ));

    server.stop();
    let bound = Duration::from_secs(8);
    for round in 0..2 {
        let r = tokio::time::timeout(bound, store.join("g", &member(2), None, Some(1), LEASE))
            .await
            .unwrap_or_else(|_| panic!("join on a dead store hung past {bound:?} (round {round})"));
        assert!(
            matches!(
                r,
                Err(Error::Unavailable {
                    backend: "redis",
                    ..
                })
            ),
            "join on a dead store: {r:?}"
        );
        let r = tokio::time::timeout(bound, store.snapshot("g"))
            .await
            .unwrap_or_else(|_| panic!("snapshot of a dead store hung past {bound:?}"));
        assert!(
            matches!(
                r,
                Err(Error::Unavailable {
                    backend: "redis",
                    ..
                })
            ),
            "snapshot of a dead store: {r:?}"
        );
    }
    // Connecting to a dead store fails too, and quickly.
    let r = tokio::time::timeout(bound, RedisStore::connect(&url))
        .await
        .expect("connecting to a dead store hung");
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");

    // Back (the server fsyncs its append-only file on every write, so the group survived the
    // SIGKILL): the same store value works again.
    server.restart(Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(10);
    let reply = loop {
        match tokio::time::timeout(bound, store.join("g", &member(2), None, Some(1), LEASE)).await {
            Ok(Ok(reply)) => break reply,
            Ok(Err(Error::Unavailable { .. })) | Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("join after the store came back: {other:?}"),
        }
    };
    match reply {
        JoinReply::Joined(s) => assert_eq!(s.members, vec![member(1), member(2)]),
        other => panic!("the restarted store lost the group: {other:?}"),
    }
    let clone = store.clone();
    assert!(
        clone
            .join("g", &member(3), None, Some(1), LEASE)
            .await
            .is_ok()
    );
    assert_eq!(store.snapshot("g").await.unwrap().members.len(), 3);
}

/// A store that accepts connections but never answers (stopped with SIGSTOP) fails operations
/// with `Unavailable` after the store's timeout instead of hanging; once it runs again, the
/// same `RedisStore` works again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_hung_times_out() {
    let scratch = support::Scratch::new("redis-hung");
    let (server, url) = support::redis(&scratch);
    let pid = server.pid().expect("redis-server runs").to_string();
    let signal = |sig: &str| {
        let status = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {sig} {pid}: {status}");
    };
    let store = RedisStore::connect(&url).await.unwrap();
    let stack = Bytes::from_static(b"stack-a");
    store
        .join("g", &member(1), Some(&stack), None, LEASE)
        .await
        .unwrap();

    signal("-STOP");
    let bound = RedisStore::TIMEOUT * 3;
    // The first call waits on the open connection, the second on a new one.
    for round in 0..2 {
        let started = Instant::now();
        let r = tokio::time::timeout(bound, store.snapshot("g"))
            .await
            .unwrap_or_else(|_| panic!("snapshot of a hung store hung past {bound:?} ({round})"));
        assert!(
            matches!(
                r,
                Err(Error::Unavailable {
                    backend: "redis",
                    ..
                })
            ),
            "snapshot of a hung store: {r:?}"
        );
        assert!(started.elapsed() >= RedisStore::TIMEOUT / 2, "{r:?}");
    }
    // Many operations at once on clones of the store wait for one connection attempt, not
    // for one after another.
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { tokio::time::timeout(bound, store.snapshot("g")).await })
        })
        .collect();
    for t in tasks {
        let r = t
            .await
            .unwrap()
            .expect("a concurrent snapshot of a hung store hung");
        assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    }

    signal("-CONT");
    let deadline = Instant::now() + Duration::from_secs(10);
    let snap = loop {
        match tokio::time::timeout(bound, store.snapshot("g")).await {
            Ok(Ok(snap)) => break snap,
            Ok(Err(Error::Unavailable { .. })) | Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("snapshot after the store resumed: {other:?}"),
        }
    };
    assert_eq!(snap.members, vec![member(1)]);
    assert_eq!(snap.committed.unwrap().stack, stack);
}

// ---------------------------------------------------------------------------------------
// The group scenarios (the bar) against a real redis-server.

async fn group_store(url: &str) -> Arc<RedisStore> {
    Arc::new(RedisStore::connect(url).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_groups() {
    let scratch = support::Scratch::new("redis-groups");
    let (_server, url) = support::redis(&scratch);
    // Every participant has its own connection.
    support::scenarios::race_64(|| group_store(&url)).await;
    support::scenarios::incompatible_late_joiner(group_store(&url).await).await;
    support::scenarios::killed_member_expires(group_store(&url).await).await;
    support::scenarios::transitions(group_store(&url).await).await;
}

/// Ballots as datagrams to the proposer, the store fallback, forged ballots, mixed groups and
/// a dead voter (tests/support/direct.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_direct_ballots() {
    let scratch = support::Scratch::new("redis-direct");
    let (_server, url) = support::redis(&scratch);
    support::direct::direct_ballots(|| group_store(&url)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_group_survives_a_store_outage() {
    let scratch = support::Scratch::new("redis-outage");
    let (server, url) = support::redis(&scratch);
    let server = std::sync::Mutex::new(server);
    support::scenarios::store_outage(
        group_store(&url).await,
        || async { RedisStore::connect(&url).await.map(Arc::new) },
        || server.lock().unwrap().stop(),
        || server.lock().unwrap().restart(Duration::from_secs(10)),
    )
    .await;
}

/// The group's data gone from Redis (FLUSHALL, as a restart without persistence does): the
/// members re-create it above every epoch they held and agree on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_group_recreated_after_the_store_loses_it() {
    let scratch = support::Scratch::new("redis-lost");
    let (_server, url) = support::redis(&scratch);
    let flush = || async {
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
    };
    support::scenarios::store_loses_the_group(group_store(&url).await, flush).await;
}

/// A participant in another process, SIGKILLed, vanishes after its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_process_expires() {
    let scratch = support::Scratch::new("redis-killed");
    let (_server, url) = support::redis(&scratch);
    support::scenarios::killed_process(group_store(&url).await, "redis_child_member", &url).await;
}

/// Run only as the child of `redis_killed_process_expires`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child half of redis_killed_process_expires"]
async fn redis_child_member() {
    let Ok(spec) = std::env::var(support::scenarios::CHILD_ENV) else {
        return;
    };
    let (url, group) = spec.split_once('\n').unwrap();
    support::scenarios::child(group_store(url).await, group).await;
}

// ---------------------------------------------------------------------------------------
// Notifications: a PUBLISH from every script that changes a group, a subscription per member.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_switches_by_notification() {
    let scratch = support::Scratch::new("redis-notified");
    let (_server, url) = support::redis(&scratch);
    support::scenarios::switches_by_notification(|| group_store(&url), 16).await;
}

/// Runs `redis-cli -p <port> args…` against the test's server; its reply.
fn cli(url: &str, args: &[&str]) -> String {
    let port = url
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .expect("a port in the url");
    let out = std::process::Command::new("redis-cli")
        .args(["-p", port])
        .args(args)
        .output()
        .expect("run redis-cli (installed with redis-server: scripts/test-all.sh)");
    assert!(out.status.success(), "redis-cli {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// How many connections are subscribed to `group`'s channel.
fn subscribers(url: &str, group: &str) -> usize {
    let reply = cli(
        url,
        &["PUBSUB", "NUMSUB", &format!("chunnel:{{{group}}}:changed")],
    );
    reply
        .lines()
        .nth(1)
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("PUBSUB NUMSUB answered {reply:?}"))
}

/// Waits (bounded) until `group`'s channel has `n` subscribers.
async fn until_subscribers(url: &str, group: &str, n: usize, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let now = subscribers(url, group);
        if now == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{now} subscribers to {group}'s channel after {limit:?}, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// With notifications broken (every subscriber killed and subscribing refused by an ACL), the
/// members notice at once, poll at the fast interval (100 ms; 30 s while notified) and the
/// group still switches, well before the slow poll; once subscribing is allowed again, every
/// member subscribes again on its own (bounded backoff).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_switches_by_polling_while_notifications_are_broken() {
    const N: usize = 4;
    let scratch = support::Scratch::new("redis-unnotified");
    let (_server, url) = support::redis(&scratch);
    let group = support::scenarios::unique("unnotified");
    let config = support::scenarios::polling(Duration::from_millis(100), Duration::from_secs(30));
    let groups = support::scenarios::members(
        || group_store(&url),
        &group,
        N,
        &config,
        Duration::from_secs(3),
    )
    .await;
    until_subscribers(&url, &group, N, Duration::from_secs(5)).await;
    // Notified: fast although polls are 30 s apart while subscribed.
    support::scenarios::switch_within(&groups, Duration::from_secs(2)).await;

    assert_eq!(
        cli(&url, &["ACL", "SETUSER", "default", "-subscribe"]),
        "OK"
    );
    let killed: usize = cli(&url, &["CLIENT", "KILL", "TYPE", "pubsub"])
        .parse()
        .expect("CLIENT KILL answers a count");
    assert_eq!(killed, N, "one subscriber per member");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(subscribers(&url, &group), 0, "a member subscribed again");
    for round in 0..2 {
        let took = support::scenarios::switch_within(&groups, Duration::from_secs(3)).await;
        eprintln!("round {round}: committed by polling in {took:?}");
    }
    assert_eq!(subscribers(&url, &group), 0);

    assert_eq!(
        cli(&url, &["ACL", "SETUSER", "default", "+subscribe"]),
        "OK"
    );
    until_subscribers(&url, &group, N, Duration::from_secs(5)).await;
    support::scenarios::switch_within(&groups, Duration::from_secs(2)).await;
    for g in groups {
        g.leave().await.unwrap();
    }
}
