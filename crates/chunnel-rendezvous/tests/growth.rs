//! Store growth (issue 19, item 2): 10,000 short-lived groups (9,000 whose only member left, and
//! 1,000 whose only member crashed) and 1,000 more crashed members (100 in each of 10 groups
//! that keep one live member). After lease + grace every backend must hold exactly what the
//! crate docs say a live group holds, for the 10 live groups only, counted in the store itself:
//! SQLite rows (`SELECT COUNT(*)`), Redis keys (`DBSIZE`, and `SCAN`), etcd keys (a range count
//! over the prefix) and leases.
//!
//! Leases are 2 s (etcd's shortest) and the grace period 2 s, so each backend's test takes
//! seconds; the work is spread over 64 concurrent tasks.

mod support;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel_rendezvous::{JoinReply, Member, Store};

const SHORT_GROUPS: usize = 10_000;
/// Every this-many-th short-lived group's member crashes instead of leaving.
const CRASH_EVERY: usize = 10;
const KEPT_GROUPS: usize = 10;
const CRASHED_PER_KEPT: usize = 100;
const LEASE: Duration = Duration::from_secs(2);
/// The survivors' lease: long enough that a loaded machine does not make them miss a renewal.
const SURVIVOR_LEASE: Duration = Duration::from_secs(10);
const GRACE: Duration = Duration::from_secs(2);
const TASKS: usize = 64;

fn member(id: &str) -> Member {
    Member {
        id: id.to_owned(),
        addr: "127.0.0.1:9".to_owned(),
    }
}

fn stack() -> Bytes {
    Bytes::from_static(b"stack-a")
}

/// Runs `op(i)` for every i in `0..n` on [`TASKS`] concurrent tasks.
async fn each<F, Fut>(n: usize, op: F)
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let (next, op) = (next.clone(), op.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return;
                }
                op(i).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Fills the store, keeps the 10 survivors renewing, and waits until `count` (what the store
/// holds, as a list of named numbers) equals `expected`; prints both and the timings.
async fn grow_and_shrink<S, C, CFut>(
    backend: &str,
    store: Arc<S>,
    count: C,
    expected: Vec<(&str, u64)>,
) where
    S: Store,
    C: Fn() -> CFut + Send + 'static,
    CFut: Future<Output = Vec<(&'static str, u64)>> + Send,
{
    let t0 = Instant::now();
    // The most the store held while it was being filled, sampled every 250 ms.
    let filling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let filling = filling.clone();
        async move {
            let mut peak: Vec<(&'static str, u64)> = Vec::new();
            while filling.load(Ordering::Relaxed) {
                let now = count().await;
                if peak.is_empty() {
                    peak = now;
                } else {
                    for (p, n) in peak.iter_mut().zip(now) {
                        p.1 = p.1.max(n.1);
                    }
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            (peak, count)
        }
    };
    let sampler = tokio::spawn(sampler);
    // The kept groups: a survivor, then 100 members that crash (never renew, never leave).
    each(KEPT_GROUPS, {
        let store = store.clone();
        move |g| {
            let store = store.clone();
            async move {
                let group = format!("kept-{g}");
                let created = store
                    .join(
                        &group,
                        &member("survivor"),
                        Some(&stack()),
                        None,
                        SURVIVOR_LEASE,
                    )
                    .await
                    .unwrap();
                assert!(matches!(created, JoinReply::Created(_)), "{created:?}");
            }
        }
    })
    .await;
    each(KEPT_GROUPS * CRASHED_PER_KEPT, {
        let store = store.clone();
        move |i| {
            let store = store.clone();
            async move {
                let group = format!("kept-{}", i % KEPT_GROUPS);
                let joined = store
                    .join(
                        &group,
                        &member(&format!("crashed-{i}")),
                        None,
                        Some(1),
                        LEASE,
                    )
                    .await
                    .unwrap();
                assert!(matches!(joined, JoinReply::Joined(_)), "{joined:?}");
            }
        }
    })
    .await;
    // The survivors renew every second until the end.
    let stop = Arc::new(AtomicBool::new(false));
    let renewing: Vec<_> = (0..KEPT_GROUPS)
        .map(|g| {
            let (store, stop) = (store.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let renewed = store
                        .renew(&format!("kept-{g}"), "survivor", SURVIVOR_LEASE)
                        .await
                        .unwrap();
                    assert!(renewed, "the survivor of kept-{g} lost its lease");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            })
        })
        .collect();
    // The short-lived groups: created, then left (or, one in ten, the member crashes).
    each(SHORT_GROUPS, {
        let store = store.clone();
        move |i| {
            let store = store.clone();
            async move {
                let group = format!("short-{i}");
                let created = store
                    .join(&group, &member("only"), Some(&stack()), None, LEASE)
                    .await
                    .unwrap();
                assert!(matches!(created, JoinReply::Created(_)), "{created:?}");
                if i % CRASH_EVERY != 0 {
                    store.leave(&group, "only").await.unwrap();
                }
            }
        }
    })
    .await;
    let filled = t0.elapsed();
    filling.store(false, Ordering::Relaxed);
    let (peak, count) = sampler.await.unwrap();
    let before = count().await;
    // Within the grace period a left group is still there, stack and all.
    let recent = store
        .snapshot(&format!("short-{}", SHORT_GROUPS - 1))
        .await
        .unwrap();
    assert_eq!(recent.committed.map(|c| c.stack), Some(stack()));
    eprintln!(
        "{backend}: filled in {filled:.1?}; the store held at most {peak:?} meanwhile, and \
         holds {before:?} now"
    );

    // After lease + grace: only the kept groups, each with its survivor.
    let t1 = Instant::now();
    let deadline = t1 + LEASE + GRACE + Duration::from_secs(30);
    let mut now = count().await;
    while now != expected {
        assert!(
            Instant::now() < deadline,
            "{backend}: {:.1?} after filling (lease {LEASE:?} + grace {GRACE:?}) the store holds \
             {now:?}, not {expected:?}",
            t1.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        now = count().await;
    }
    eprintln!(
        "{backend}: {:.1?} after filling the store holds {now:?}; {:.1?} in all",
        t1.elapsed(),
        t0.elapsed()
    );
    stop.store(true, Ordering::Relaxed);
    for r in renewing {
        r.await.unwrap();
    }
    for g in 0..KEPT_GROUPS {
        let s = store.snapshot(&format!("kept-{g}")).await.unwrap();
        assert_eq!(s.epoch(), 1);
        assert_eq!(s.members, vec![member("survivor")], "kept-{g}");
    }
    for i in [0, 1, SHORT_GROUPS - 1] {
        let s = store.snapshot(&format!("short-{i}")).await.unwrap();
        assert!(
            s.committed.is_none() && s.members.is_empty(),
            "short-{i}: {s:?}"
        );
    }
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_store_stays_bounded() {
    use chunnel_rendezvous::SqliteStore;
    let scratch = support::Scratch::new("sqlite-growth");
    let path = scratch.0.join("groups.sqlite");
    let store = SqliteStore::open(&path)
        .unwrap()
        .with_grace(GRACE)
        .with_sweep_every(Duration::from_millis(500));
    let count = move || {
        let path = path.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let db = rusqlite::Connection::open(path).unwrap();
                ["groups", "members", "transitions", "ballots"].map(|t| {
                    let n: i64 = db
                        .query_row(&format!("SELECT COUNT(*) FROM chunnel_{t}"), [], |r| {
                            r.get(0)
                        })
                        .unwrap();
                    (t, n as u64)
                })
            })
            .await
            .unwrap()
            .to_vec()
        }
    };
    let expected = vec![
        ("groups", KEPT_GROUPS as u64),
        ("members", KEPT_GROUPS as u64),
        ("transitions", 0),
        ("ballots", 0),
    ];
    grow_and_shrink("sqlite", Arc::new(store), count, expected).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_stays_bounded() {
    use chunnel_rendezvous::RedisStore;
    let scratch = support::Scratch::new("redis-growth");
    let (_server, url) = support::redis(&scratch);
    let store = RedisStore::connect(&url).await.unwrap().with_grace(GRACE);
    let client = redis::Client::open(url.as_str()).unwrap();
    let count = move || {
        let client = client.clone();
        async move {
            let mut c = client.get_multiplexed_async_connection().await.unwrap();
            let dbsize: u64 = redis::cmd("DBSIZE").query_async(&mut c).await.unwrap();
            // SCAN skips (and removes) expired keys: the keys a command can still see.
            let (mut cursor, mut scanned) = (0u64, 0u64);
            loop {
                let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(1000)
                    .query_async(&mut c)
                    .await
                    .unwrap();
                scanned += keys.len() as u64;
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
            vec![("dbsize", dbsize), ("scan", scanned)]
        }
    };
    // meta, members and addrs of each kept group.
    let keys = 3 * KEPT_GROUPS as u64;
    grow_and_shrink(
        "redis",
        Arc::new(store),
        count,
        vec![("dbsize", keys), ("scan", keys)],
    )
    .await;
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_store_stays_bounded() {
    use chunnel_rendezvous::EtcdStore;
    let scratch = support::Scratch::new("etcd-growth");
    let (_servers, endpoints) = support::etcd_cluster(&scratch, 1);
    let store = EtcdStore::connect(&endpoints)
        .await
        .unwrap()
        .with_grace(GRACE);
    // The cluster may still be electing its leader.
    let t0 = Instant::now();
    while store.snapshot("warm-up").await.is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "etcd never became ready"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let client = etcd_client::Client::connect(&endpoints, None)
        .await
        .unwrap();
    let count = move || {
        let mut client = client.clone();
        async move {
            let keys = client
                .get(
                    "chunnel/",
                    Some(
                        etcd_client::GetOptions::new()
                            .with_prefix()
                            .with_count_only(),
                    ),
                )
                .await
                .unwrap()
                .count() as u64;
            let leases = client.leases().await.unwrap().leases().len() as u64;
            vec![("keys", keys), ("leases", leases)]
        }
    };
    // Each kept group: meta and the survivor's key; the group's lease and the survivor's.
    let n = 2 * KEPT_GROUPS as u64;
    grow_and_shrink(
        "etcd",
        Arc::new(store),
        count,
        vec![("keys", n), ("leases", n)],
    )
    .await;
}
