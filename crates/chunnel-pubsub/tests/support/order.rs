//! The ordering switch (issue 23 item 2) against a real broker: publishers stream while
//! receivers join (the group switches to receiver-side ordering) and leave (back to
//! service-side); every receiver gets each publisher's messages exactly once and in order
//! across both switches.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection};
use chunnel_pubsub::order::{
    self, Mode, OrderConfig, OrderGroup, OrderedPublish, OrderedPublisher, OrderedSubscribe,
    OrderedSubscriber, Role,
};
use chunnel_pubsub::{Broker, Config};
use chunnel_rendezvous::SqliteStore;

use super::{Scratch, Server, unique};

const PUBLISHERS: usize = 3;

fn rdv_config() -> chunnel_rendezvous::Config {
    chunnel_rendezvous::Config {
        poll: Duration::from_millis(10),
        ..chunnel_rendezvous::Config::default()
    }
}

fn payload(p: usize, i: u64) -> Bytes {
    Bytes::from(format!("{p}-{i}"))
}

fn parse(m: &[u8]) -> (usize, u64) {
    let s = std::str::from_utf8(m).expect("utf-8 payload");
    let (p, i) = s.split_once('-').expect("p-i payload");
    (p.parse().unwrap(), i.parse().unwrap())
}

/// A receiver's log: per publisher, the indexes in arrival order; checked as it goes.
#[derive(Default, Debug)]
struct Log {
    next: HashMap<usize, u64>,
    total: u64,
    /// Transient errors (`Error::Unavailable`: the broker down) seen and retried.
    errors: u64,
}

impl Log {
    fn take(&mut self, who: &str, m: &[u8]) {
        let (p, i) = parse(m);
        let want = self.next.entry(p).or_insert(0);
        assert_eq!(
            i, *want,
            "{who}: publisher {p}'s message {i} arrived when {want} was due (lost, duplicated or \
             out of order)"
        );
        *want += 1;
        self.total += 1;
    }
}

struct Receiver {
    name: String,
    group: Arc<OrderGroup>,
    sub: Arc<OrderedSubscriber>,
    log: Arc<std::sync::Mutex<Log>>,
    task: tokio::task::JoinHandle<()>,
}

type Shared<T> = Arc<std::sync::Mutex<T>>;

/// An ordered subscriber named `name` and its receive loop (checking each message on arrival,
/// retrying while the broker is down).
async fn subscriber<B: Broker>(
    broker: &B,
    topic: &str,
    name: &str,
    cfg: &Config,
    order_cfg: &OrderConfig,
) -> (
    Arc<OrderedSubscriber>,
    Shared<Log>,
    tokio::task::JoinHandle<()>,
) {
    let sub = Arc::new(
        OrderedSubscribe::new(broker.clone(), topic, name, cfg.clone(), order_cfg.clone())
            .connect_wrap(())
            .await
            .expect("ordered subscriber"),
    );
    let log = Arc::new(std::sync::Mutex::new(Log::default()));
    let task = {
        let (sub, log, name) = (sub.clone(), log.clone(), name.to_owned());
        tokio::spawn(async move {
            let mut slots = vec![None; 32];
            loop {
                match sub.recv(&mut slots).await {
                    Ok(n) => {
                        let mut l = log.lock().unwrap();
                        for s in &mut slots[..n] {
                            l.take(&name, &s.take().unwrap());
                        }
                    }
                    Err(e) if super::scenarios::unavailable(&e) => {
                        // The broker is down: the lanes' pumps retry; so does the receiver.
                        log.lock().unwrap().errors += 1;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => panic!("{name}: recv failed: {e}"),
                }
            }
        })
    };
    (sub, log, task)
}

async fn receiver<B: Broker>(
    broker: &B,
    store: &Arc<SqliteStore>,
    topic: &str,
    name: &str,
    cfg: &Config,
    order_cfg: &OrderConfig,
) -> Receiver {
    let group = order::join(
        store.clone(),
        topic,
        Role::Receiver,
        name,
        order_cfg.lanes,
        Mode::Service,
        rdv_config(),
    )
    .await
    .expect("receiver joins the group");
    let (sub, log, task) = subscriber(broker, topic, name, cfg, order_cfg).await;
    Receiver {
        name: name.to_owned(),
        group,
        sub,
        log,
        task,
    }
}

/// Waits (bounded) until `ok()`.
async fn until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until every publisher uses `want` (publisher 0 follows the receivers:
/// `OrderGroup::follow`, so nothing here proposes).
async fn switch_to(groups: &[Arc<OrderGroup>], want: Mode) -> Duration {
    let t = Instant::now();
    let deadline = t + Duration::from_secs(20);
    while groups.iter().any(|g| g.mode() != want) {
        assert!(
            Instant::now() < deadline,
            "the group did not switch to {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    t.elapsed()
}

/// Three publishers stream bursts of 5 while: one receiver (service-side ordering); two more
/// join (receiver-side over `lanes` lanes); they leave (service-side again). Every receiver
/// checks each message as it arrives; at the end the one that stayed has every message of
/// every publisher exactly once, in order, and each publisher published in both modes.
pub async fn ordering_switch<B: Broker>(broker: B, scratch: &Scratch) {
    let topic = unique("ord");
    let store = Arc::new(SqliteStore::open(scratch.0.join("groups.sqlite")).unwrap());
    let cfg = super::scenarios::config(Duration::from_secs(20));
    let order_cfg = OrderConfig {
        lanes: 4,
        ..OrderConfig::default()
    };
    let mut groups = Vec::new();
    let mut publishers = Vec::new();
    for p in 0..PUBLISHERS {
        let g = order::join(
            store.clone(),
            &topic,
            Role::Publisher,
            &format!("p{p}"),
            order_cfg.lanes,
            Mode::Service,
            rdv_config(),
        )
        .await
        .expect("publisher joins the group");
        assert_eq!(g.mode(), Mode::Service);
        let conn = OrderedPublish::new(broker.clone(), &topic, cfg.clone(), order_cfg.clone())
            .group(g.clone())
            .connect_wrap(())
            .await
            .expect("ordered publisher");
        groups.push(g);
        publishers.push(Arc::new(conn));
    }
    let follower = groups[0].follow(order::by_receivers);
    let r1 = receiver(&broker, &store, &topic, "r1", &cfg, &order_cfg).await;

    let stop = Arc::new(AtomicBool::new(false));
    let mut streams = tokio::task::JoinSet::new();
    for (p, conn) in publishers.iter().enumerate() {
        let (conn, stop) = (conn.clone(), stop.clone());
        streams.spawn(async move {
            let mut i = 0u64;
            while !stop.load(AtomicOrdering::Relaxed) {
                conn.send((i..i + 5).map(|k| payload(p, k)))
                    .await
                    .expect("publish");
                i += 5;
                // As fast as the broker acknowledges: receivers fall behind, so their lanes
                // race (what makes receiver-side ordering reorder).
                tokio::task::yield_now().await;
            }
            (p, i)
        });
    }
    let total = |rx: &Receiver| rx.log.lock().unwrap().total;
    until("r1 to get 300 messages", Duration::from_secs(60), || {
        total(&r1) >= 300
    })
    .await;
    let sent_in = |mode: Mode| {
        let publishers = publishers.clone();
        async move {
            let mut n = 0;
            for p in &publishers {
                let s = p.stats().await;
                n += match mode {
                    Mode::Service => s.service,
                    Mode::Receiver => s.receiver,
                };
            }
            n
        }
    };

    // Two receivers join: several receivers -> receiver-side ordering.
    let joined = Instant::now();
    let r2 = receiver(&broker, &store, &topic, "r2", &cfg, &order_cfg).await;
    let r3 = receiver(&broker, &store, &topic, "r3", &cfg, &order_cfg).await;
    until(
        "publisher 0 to see 3 receivers",
        Duration::from_secs(10),
        || groups[0].receivers() == 3,
    )
    .await;
    switch_to(&groups, Mode::Receiver).await;
    let took = joined.elapsed();
    assert_eq!(groups[0].receivers(), 3);
    eprintln!(
        "2 receivers joined -> every publisher in receiver-side ordering {:.1} ms later (epoch {})",
        took.as_secs_f64() * 1e3,
        groups[0].epoch()
    );
    let base = sent_in(Mode::Receiver).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while sent_in(Mode::Receiver).await < base + 3000 {
        assert!(
            Instant::now() < deadline,
            "too few messages in receiver mode"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // They leave: one receiver -> service-side ordering again.
    let left = Instant::now();
    for r in [&r2, &r3] {
        r.group.leave().await.expect("leave");
    }
    until(
        "publisher 0 to see 1 receiver",
        Duration::from_secs(10),
        || groups[0].receivers() == 1,
    )
    .await;
    switch_to(&groups, Mode::Service).await;
    let took = left.elapsed();
    eprintln!(
        "2 receivers left -> every publisher in service-side ordering {:.1} ms later (epoch {})",
        took.as_secs_f64() * 1e3,
        groups[0].epoch()
    );
    let base = sent_in(Mode::Service).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while sent_in(Mode::Service).await < base + 600 {
        assert!(
            Instant::now() < deadline,
            "too few messages after switching back"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, AtomicOrdering::Relaxed);
    let mut sent = HashMap::new();
    while let Some(r) = streams.join_next().await {
        let (p, n) = r.expect("publisher task");
        sent.insert(p, n);
    }
    let all: u64 = sent.values().sum();

    for (p, conn) in publishers.iter().enumerate() {
        let s = conn.stats().await;
        eprintln!("publisher {p}: {s:?}");
        assert!(
            s.switches >= 2,
            "publisher {p} switched {} times",
            s.switches
        );
        assert!(s.service > 0 && s.receiver > 0, "publisher {p}: {s:?}");
        assert_eq!(s.service + s.receiver, sent[&p] + 5 * s.resent);
    }
    // The receiver that stayed gets everything (the checks ran as it arrived).
    until("r1 to get every message", Duration::from_secs(60), || {
        total(&r1) >= all
    })
    .await;
    // Anything more (a duplicate) would fail the log's check or show here.
    tokio::time::sleep(Duration::from_millis(500)).await;
    {
        let l = r1.log.lock().unwrap();
        assert_eq!(l.total, all, "r1 got more than was sent");
        for (p, n) in &sent {
            assert_eq!(l.next.get(p).copied().unwrap_or(0), *n, "r1: publisher {p}");
        }
    }
    let stats = r1.sub.stats();
    eprintln!("r1: {all} messages; {stats:?}");
    assert!(
        stats.reorder.reordered > 0,
        "nothing arrived out of order in receiver mode: the test would not see a reorder bug"
    );
    assert_eq!(stats.waiting, 0);
    assert_eq!(stats.malformed, 0);
    assert_eq!(
        r1.log.lock().unwrap().errors,
        0,
        "r1 saw errors with no fault"
    );
    // Those that left got, per publisher, a gap-free in-order prefix (checked on arrival).
    for r in [&r2, &r3] {
        let got = total(r);
        eprintln!(
            "{}: {got} messages in order before and after leaving",
            r.name
        );
        assert!(got > 0, "{} got nothing", r.name);
    }
    assert!(!follower.is_finished(), "the follower task ended");
    follower.abort();
    for r in [r1, r2, r3] {
        assert!(!r.task.is_finished(), "{}'s receive loop ended", r.name);
        r.task.abort();
    }
}

/// Sends cancelled at their first wait (a timeout of zero) alternate with sends that run to
/// the end: each cancelled burst is published again, whole, by the next send, and the receiver
/// gets every message exactly once, in order (the copies dropped as duplicates).
pub async fn cancelled_bursts_are_resent<B: Broker>(broker: B) {
    let topic = unique("resend");
    let cfg = super::scenarios::config(Duration::from_secs(20));
    let order_cfg = OrderConfig {
        lanes: 2,
        ..OrderConfig::default()
    };
    let sub = OrderedSubscribe::new(broker.clone(), &topic, "r", cfg.clone(), order_cfg.clone())
        .connect_wrap(())
        .await
        .expect("ordered subscriber");
    let publisher = OrderedPublish::new(broker.clone(), &topic, cfg, order_cfg)
        .fixed(Mode::Receiver)
        .connect_wrap(())
        .await
        .expect("ordered publisher");
    let mut next = 0u64;
    let mut cancelled = 0;
    // Most zero-timeout sends finish at their first poll; go on (bounded) until a few were
    // cancelled, so the test always tests something.
    for round in 0..400 {
        if round >= 20 && cancelled >= 3 {
            break;
        }
        let burst = (next..next + 5).map(|k| payload(0, k));
        next += 5;
        if tokio::time::timeout(Duration::ZERO, publisher.send(burst))
            .await
            .is_err()
        {
            cancelled += 1;
        }
        let burst = (next..next + 5).map(|k| payload(0, k));
        next += 5;
        publisher.send(burst).await.expect("publish");
    }
    let stats = publisher.stats().await;
    assert!(
        cancelled > 0,
        "no send was cancelled: the test tests nothing"
    );
    assert_eq!(stats.resent, cancelled, "{stats:?}");
    let mut log = Log::default();
    let mut slots = vec![None; 16];
    while log.total < next {
        let n = tokio::time::timeout(Duration::from_secs(20), sub.recv(&mut slots))
            .await
            .expect("the receiver stalled: a gap nobody fills")
            .expect("recv");
        for s in &mut slots[..n] {
            log.take("r", &s.take().unwrap());
        }
    }
    // Nothing more arrives (a duplicate would).
    let more = tokio::time::timeout(Duration::from_millis(500), sub.recv(&mut slots)).await;
    assert!(more.is_err(), "more messages than were sent");
    eprintln!(
        "{cancelled} cancelled bursts re-sent; receiver: {:?}",
        sub.stats()
    );
}

/// Kills the broker (SIGKILL), lets `during` run while it is down (bounded), keeps it down at
/// least `down` (longer than the publishers' `op_timeout`, so sends in flight fail), restarts it.
async fn outage<F: std::future::Future<Output = ()>>(
    server: &mut Server,
    down: Duration,
    restart_timeout: Duration,
    during: F,
) {
    let pid = server.pid();
    let killed = Instant::now();
    server.stop();
    eprintln!("killed {} (pid {pid:?})", server.name);
    during.await;
    let left = down.saturating_sub(killed.elapsed());
    tokio::time::sleep(left).await;
    tokio::task::block_in_place(|| server.restart(restart_timeout));
    eprintln!(
        "restarted {} (pid {:?}) after {:.1} s down",
        server.name,
        server.pid(),
        killed.elapsed().as_secs_f64()
    );
}

/// Issue 23 items 2 and 5 together: three publishers stream bursts of 5 to one receiver
/// (service-side ordering). The broker is SIGKILLed; while it is down two more receivers join
/// and the group switches to receiver-side ordering; it is restarted (down longer than the
/// publishers' `op_timeout`: sends fail, and their bursts are kept and published again, in the
/// new mode). Later it is killed again, the two leave while it is down (back to service-side),
/// and it is restarted. Every publisher sends on through the errors (never re-sending a burst
/// itself: a failed send has taken it); at the end the receiver that stayed has every message
/// of every publisher exactly once and in order (checked on arrival), and some sends did fail
/// and were re-published (so the test tests the outage).
pub async fn restart_during_switch<B: Broker>(
    broker: B,
    server: &mut Server,
    scratch: &Scratch,
    op_timeout: Duration,
    restart_timeout: Duration,
) {
    let topic = unique("ordrst");
    let store = Arc::new(SqliteStore::open(scratch.0.join("groups-restart.sqlite")).unwrap());
    let cfg = super::scenarios::config(op_timeout);
    let order_cfg = OrderConfig {
        lanes: 4,
        ..OrderConfig::default()
    };
    let down = op_timeout + Duration::from_millis(1500);
    let mut groups = Vec::new();
    let mut publishers = Vec::new();
    for p in 0..PUBLISHERS {
        let g = order::join(
            store.clone(),
            &topic,
            Role::Publisher,
            &format!("p{p}"),
            order_cfg.lanes,
            Mode::Service,
            rdv_config(),
        )
        .await
        .expect("publisher joins the group");
        let conn = OrderedPublish::new(broker.clone(), &topic, cfg.clone(), order_cfg.clone())
            .group(g.clone())
            .connect_wrap(())
            .await
            .expect("ordered publisher");
        groups.push(g);
        publishers.push(Arc::new(conn));
    }
    let follower = groups[0].follow(order::by_receivers);
    let r1 = receiver(&broker, &store, &topic, "r1", &cfg, &order_cfg).await;

    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut streams = tokio::task::JoinSet::new();
    for (p, conn) in publishers.iter().enumerate() {
        let (conn, stop, failed) = (conn.clone(), stop.clone(), failed.clone());
        streams.spawn(async move {
            let mut i = 0u64;
            while !stop.load(AtomicOrdering::Relaxed) {
                match conn.send((i..i + 5).map(|k| payload(p, k))).await {
                    // Taken either way: a failed burst is kept and published by a later send.
                    Ok(()) => {}
                    Err(e) if super::scenarios::unavailable(&e) => {
                        failed.fetch_add(1, AtomicOrdering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => panic!("publisher {p}: {e}"),
                }
                i += 5;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            // Flush what failed sends kept (an empty burst publishes only that).
            let deadline = Instant::now() + Duration::from_secs(60);
            while let Err(e) = conn.send(std::iter::empty()).await {
                assert!(
                    Instant::now() < deadline,
                    "publisher {p}: kept bursts not stored 60 s after the end: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (p, i)
        });
    }
    let total = |rx: &Receiver| rx.log.lock().unwrap().total;
    until("r1 to get 300 messages", Duration::from_secs(60), || {
        total(&r1) >= 300
    })
    .await;
    // r2 and r3 subscribe now (their subscriptions need the broker) and join the group while
    // it is down, so the switch happens inside the outage.
    let (sub2, log2, task2) = subscriber(&broker, &topic, "r2", &cfg, &order_cfg).await;
    let (sub3, log3, task3) = subscriber(&broker, &topic, "r3", &cfg, &order_cfg).await;
    let mut joined = Vec::new();
    outage(server, down, restart_timeout, async {
        for name in ["r2", "r3"] {
            joined.push(
                order::join(
                    store.clone(),
                    &topic,
                    Role::Receiver,
                    name,
                    order_cfg.lanes,
                    Mode::Service,
                    rdv_config(),
                )
                .await
                .expect("receiver joins the group"),
            );
        }
        let took = switch_to(&groups, Mode::Receiver).await;
        eprintln!(
            "switched to receiver-side ordering {:.1} ms after the joins, broker down",
            took.as_secs_f64() * 1e3
        );
    })
    .await;
    let receiver_msgs = |publishers: Vec<Arc<OrderedPublisher<B::Producer>>>| async move {
        let mut n = 0;
        for p in &publishers {
            n += p.stats().await.receiver;
        }
        n
    };
    let base = receiver_msgs(publishers.clone()).await;
    let deadline = Instant::now() + Duration::from_secs(90);
    while receiver_msgs(publishers.clone()).await < base + 1500 {
        assert!(
            Instant::now() < deadline,
            "too few messages in receiver mode after the restart"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Once more: down again, the two leave meanwhile (back to service-side ordering).
    outage(server, down, restart_timeout, async {
        for g in &joined {
            g.leave().await.expect("leave");
        }
        let took = switch_to(&groups, Mode::Service).await;
        eprintln!(
            "switched back to service-side ordering {:.1} ms after the leaves, broker down",
            took.as_secs_f64() * 1e3
        );
    })
    .await;
    let service_msgs = {
        let mut n = 0;
        for p in &publishers {
            n += p.stats().await.service;
        }
        n
    };
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let mut n = 0;
        for p in &publishers {
            n += p.stats().await.service;
        }
        if n >= service_msgs + 600 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "too few messages in service mode after the second restart"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, AtomicOrdering::Relaxed);
    let mut sent = HashMap::new();
    while let Some(r) = streams.join_next().await {
        let (p, n) = r.expect("publisher task");
        sent.insert(p, n);
    }
    let all: u64 = sent.values().sum();
    let failed = failed.load(AtomicOrdering::Relaxed);
    let mut resent = 0;
    for (p, conn) in publishers.iter().enumerate() {
        let s = conn.stats().await;
        eprintln!("publisher {p}: {s:?}");
        assert!(s.switches >= 2, "publisher {p}: {s:?}");
        assert!(s.service > 0 && s.receiver > 0, "publisher {p}: {s:?}");
        resent += s.resent;
    }
    assert!(
        failed > 0 && resent > 0,
        "no send failed ({failed}) or was re-published ({resent}): the outages tested nothing"
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    while total(&r1) < all {
        if Instant::now() >= deadline {
            let l = r1.log.lock().unwrap();
            panic!(
                "r1 stalled after the restarts: sent {sent:?}, next due {:?}; {:?}; r2 {:?}; r3 {:?}",
                l.next,
                r1.sub.stats(),
                log2.lock().unwrap().next,
                log3.lock().unwrap().next,
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Anything more (a duplicate) would fail the log's check or show here.
    tokio::time::sleep(Duration::from_millis(500)).await;
    {
        let l = r1.log.lock().unwrap();
        assert_eq!(l.total, all, "r1 got more than was sent");
        for (p, n) in &sent {
            assert_eq!(l.next.get(p).copied().unwrap_or(0), *n, "r1: publisher {p}");
        }
        eprintln!(
            "r1: {all} messages exactly once, in order; {failed} failed sends re-published in \
             {resent} publications; {} receive errors retried; {:?}",
            l.errors,
            r1.sub.stats()
        );
    }
    // r2 and r3 read every lane from the start: they too get everything, in order.
    for (name, log) in [("r2", &log2), ("r3", &log3)] {
        until(
            &format!("{name} to get every message"),
            Duration::from_secs(90),
            || log.lock().unwrap().total >= all,
        )
        .await;
        assert_eq!(
            log.lock().unwrap().total,
            all,
            "{name} got more than was sent"
        );
    }
    assert_eq!(r1.sub.stats().malformed, 0);
    drop((sub2, sub3));
    follower.abort();
    for t in [r1.task, task2, task3] {
        assert!(!t.is_finished(), "a receive loop ended");
        t.abort();
    }
}

/// A slow receiver across a switch (issue 23 item 5, "a slow consumer is bounded"): two
/// receivers subscribe, then do not read while a publisher sends 300 messages in service-side
/// ordering, switches its group to receiver-side, and sends 300 more over 4 lanes. When they
/// read, the old lane's backlog races the new lanes' messages, which all arrive early. The one
/// with a reorder buffer of 8 hands out an in-order, gap-free prefix and then fails with
/// `Error::ReorderOverflow`, and keeps failing (it never skips a message); it never held more
/// than 8 waiting. The one with room for 1,024 gets all 600 in order, and held more than 8 at
/// some point (so the small one's failure is the bound at work, not something else).
pub async fn slow_receiver_across_switch<B: Broker>(broker: B, scratch: &Scratch) {
    const CAP: usize = 8;
    let topic = unique("ordslow");
    let store = Arc::new(SqliteStore::open(scratch.0.join("groups-slow.sqlite")).unwrap());
    let cfg = super::scenarios::config(Duration::from_secs(10));
    let order_cfg = OrderConfig {
        lanes: 4,
        ..OrderConfig::default()
    };
    let small_cfg = OrderConfig {
        capacity: CAP,
        ..order_cfg.clone()
    };
    let big_cfg = OrderConfig {
        capacity: 1024,
        ..order_cfg.clone()
    };
    let small = OrderedSubscribe::new(broker.clone(), &topic, "small", cfg.clone(), small_cfg)
        .connect_wrap(())
        .await
        .expect("ordered subscriber");
    let big = OrderedSubscribe::new(broker.clone(), &topic, "big", cfg.clone(), big_cfg)
        .connect_wrap(())
        .await
        .expect("ordered subscriber");
    let g = order::join(
        store,
        &topic,
        Role::Publisher,
        "p0",
        order_cfg.lanes,
        Mode::Service,
        rdv_config(),
    )
    .await
    .expect("publisher joins the group");
    let publisher = OrderedPublish::new(broker.clone(), &topic, cfg, order_cfg)
        .group(g.clone())
        .connect_wrap(())
        .await
        .expect("ordered publisher");
    for b in 0..30 {
        publisher
            .send((b * 10..b * 10 + 10).map(|k| payload(0, k)))
            .await
            .expect("publish");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while g.mode() != Mode::Receiver {
        assert!(Instant::now() < deadline, "the group did not switch");
        if g.adapt(|_| Mode::Receiver).await.expect("adapt").is_none() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for b in 30..60 {
        publisher
            .send((b * 10..b * 10 + 10).map(|k| payload(0, k)))
            .await
            .expect("publish");
    }
    let s = publisher.stats().await;
    assert_eq!((s.service, s.receiver), (300, 300), "{s:?}");

    // The small one: an in-order prefix, then the overflow, for good.
    let mut log = Log::default();
    let mut slots = vec![None; 16];
    let overflow = loop {
        let r = tokio::time::timeout(Duration::from_secs(30), small.recv(&mut slots))
            .await
            .expect("the small receiver neither delivered nor failed within 30 s");
        match r {
            Ok(n) => {
                for s in &mut slots[..n] {
                    log.take("small", &s.take().unwrap());
                }
                assert!(
                    log.total < 600,
                    "the small receiver got everything: nothing overflowed"
                );
            }
            Err(e) => break e,
        }
    };
    let is_overflow = |e: &chunnel::Error| match e {
        chunnel::Error::Layer { source, .. } => matches!(
            source.downcast_ref::<chunnel_pubsub::Error>(),
            Some(chunnel_pubsub::Error::ReorderOverflow { capacity: CAP })
        ),
        _ => false,
    };
    assert!(is_overflow(&overflow), "{overflow}");
    let again = tokio::time::timeout(Duration::from_secs(10), small.recv(&mut slots))
        .await
        .expect("a failed receiver answers at once");
    assert!(
        matches!(&again, Err(e) if is_overflow(e)),
        "after the overflow: {again:?}"
    );
    let st = small.stats();
    assert!(
        st.reorder.max_waiting <= CAP && st.waiting <= CAP,
        "the small receiver held more than {CAP}: {st:?}"
    );
    assert!(st.reorder.overflows > 0, "{st:?}");

    // The big one: everything, in order.
    let mut log_big = Log::default();
    while log_big.total < 600 {
        let n = tokio::time::timeout(Duration::from_secs(30), big.recv(&mut slots))
            .await
            .expect("the big receiver stalled")
            .expect("recv");
        for s in &mut slots[..n] {
            log_big.take("big", &s.take().unwrap());
        }
    }
    let sb = big.stats();
    assert!(
        sb.reorder.max_waiting > CAP,
        "the big receiver never held more than {CAP} early messages: the switch did not race \
         ({sb:?})"
    );
    eprintln!(
        "slow receivers across the switch: capacity {CAP}: {} in order, then ReorderOverflow \
         ({st:?}); capacity 1024: all 600 ({sb:?})",
        log.total
    );
}

/// The bound on what failed sends keep (`OrderConfig::max_pending` 10): with the broker
/// killed, two sends of 5 fail and are kept (10); a third is refused with `Error::Backlog`
/// (not taken: its numbers are not used). After a restart the third is sent again, by the
/// application this time, and the receiver gets all 15 exactly once, in order.
pub async fn backlog_bound<B: Broker>(broker: B, server: &mut Server, restart_timeout: Duration) {
    let topic = unique("backlog");
    let cfg = super::scenarios::config(Duration::from_secs(1));
    let order_cfg = OrderConfig {
        lanes: 2,
        max_pending: 10,
        ..OrderConfig::default()
    };
    let sub = OrderedSubscribe::new(broker.clone(), &topic, "r", cfg.clone(), order_cfg.clone())
        .connect_wrap(())
        .await
        .expect("ordered subscriber");
    let publisher = OrderedPublish::new(broker.clone(), &topic, cfg, order_cfg)
        .fixed(Mode::Receiver)
        .connect_wrap(())
        .await
        .expect("ordered publisher");
    server.stop();
    let kind = |e: &chunnel::Error| match e {
        chunnel::Error::Layer { source, .. } => match source.downcast_ref() {
            Some(chunnel_pubsub::Error::Unavailable { .. }) => "unavailable",
            Some(chunnel_pubsub::Error::Backlog { pending: 10, .. }) => "backlog 10",
            _ => "other",
        },
        _ => "other",
    };
    for b in 0..2u64 {
        let e = publisher
            .send((b * 5..b * 5 + 5).map(|k| payload(0, k)))
            .await
            .expect_err("a send with the broker down");
        assert_eq!(kind(&e), "unavailable", "send {b}: {e}");
    }
    let third = || (10..15).map(|k| payload(0, k));
    let e = publisher
        .send(third())
        .await
        .expect_err("a third send past max_pending");
    assert_eq!(kind(&e), "backlog 10", "{e}");
    tokio::task::block_in_place(|| server.restart(restart_timeout));
    // Refused, so sent again; the kept 10 go first.
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = publisher.send(third()).await {
        assert!(
            Instant::now() < deadline,
            "sends still fail 30 s after the restart: {e}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut log = Log::default();
    let mut slots = vec![None; 16];
    while log.total < 15 {
        let r = tokio::time::timeout(Duration::from_secs(30), sub.recv(&mut slots))
            .await
            .expect("the receiver stalled");
        match r {
            Ok(n) => {
                for s in &mut slots[..n] {
                    log.take("r", &s.take().unwrap());
                }
            }
            Err(e) if super::scenarios::unavailable(&e) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("recv: {e}"),
        }
    }
    // Nothing more arrives (a copy of the refused burst would).
    let more = tokio::time::timeout(Duration::from_millis(500), sub.recv(&mut slots)).await;
    assert!(
        matches!(more, Err(_) | Ok(Err(_))),
        "more messages than were sent: {more:?}"
    );
    eprintln!(
        "backlog: {:?}; receiver {:?}",
        publisher.stats().await,
        sub.stats()
    );
}
