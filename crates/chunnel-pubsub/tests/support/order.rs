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
    self, Mode, OrderConfig, OrderGroup, OrderedPublish, OrderedSubscribe, OrderedSubscriber, Role,
};
use chunnel_pubsub::{Broker, Config};
use chunnel_rendezvous::SqliteStore;

use super::{Scratch, unique};

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
                    Err(e) => panic!("{name}: recv failed: {e}"),
                }
            }
        })
    };
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
