//! The scenarios every broker runs (issue 23 items 1, 5, 6), generic over the broker.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection};
use chunnel_pubsub::{Broker, Config, Delivery, Error, Member, Publish, Subscribe, Subscriber};

use super::{Server, unique};

/// Fast settings for tests: short polls, a small prefetch, `op_timeout` as given.
pub fn config(op_timeout: Duration) -> Config {
    Config {
        op_timeout,
        prefetch: 64,
        poll: Duration::from_millis(50),
        ..Config::default()
    }
}

/// How often each payload was received.
pub type Counts = Arc<Mutex<HashMap<Bytes, usize>>>;

/// Receives into `counts` until it holds `want` distinct payloads or `limit` passes;
/// transient errors (a broker restarting) are retried.
pub async fn collect<C: chunnel_pubsub::Consumer>(
    sub: &Subscriber<C>,
    counts: &Counts,
    want: usize,
    limit: Duration,
    per_message: Duration,
) {
    let deadline = Instant::now() + limit;
    let mut slots = vec![None; 16];
    while counts.lock().unwrap().len() < want && Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_millis(500), sub.recv(&mut slots)).await {
            Err(_) => continue,
            Ok(Err(e)) => {
                eprintln!("recv: {e} (retrying)");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(Ok(n)) => {
                {
                    let mut c = counts.lock().unwrap();
                    for s in &mut slots[..n] {
                        *c.entry(s.take().unwrap()).or_default() += 1;
                    }
                }
                if !per_message.is_zero() {
                    tokio::time::sleep(per_message * n as u32).await;
                }
            }
        }
    }
}

fn payload(publisher: usize, i: usize) -> Bytes {
    Bytes::from(format!("p{publisher}-{i}"))
}

fn check_exactly_once(counts: &Counts, expect: impl Iterator<Item = Bytes>, what: &str) {
    let c = counts.lock().unwrap();
    let mut missing = Vec::new();
    let mut n = 0;
    for p in expect {
        n += 1;
        match c.get(&p) {
            None => missing.push(p),
            Some(1) => {}
            Some(k) => panic!("{what}: {p:?} delivered {k} times"),
        }
    }
    assert!(
        missing.is_empty(),
        "{what}: {} of {n} messages never arrived, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    assert_eq!(c.len(), n, "{what}: messages nobody sent arrived");
}

/// Four publishers at once, 250 messages each in bursts of 5; one subscriber gets all 1,000
/// exactly once.
pub async fn concurrent_publishers<B: Broker>(broker: B) {
    let topic = unique("conc");
    let cfg = config(Duration::from_secs(20));
    let sub = Subscribe::new(broker.clone(), &topic, Member::sole("g"), cfg.clone())
        .connect_wrap(())
        .await
        .expect("subscribe");
    let mut tasks = tokio::task::JoinSet::new();
    for p in 0..4 {
        let mut chunnel = Publish::new(broker.clone(), &topic, cfg.clone());
        tasks.spawn(async move {
            let publisher = chunnel.connect_wrap(()).await.expect("publisher");
            for b in 0..50 {
                publisher
                    .send((0..5).map(|k| payload(p, b * 5 + k)))
                    .await
                    .expect("publish");
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let counts = Counts::default();
    collect(&sub, &counts, 1000, Duration::from_secs(30), Duration::ZERO).await;
    // Anything more (a duplicate) would show up now.
    collect(
        &sub,
        &counts,
        1001,
        Duration::from_millis(300),
        Duration::ZERO,
    )
    .await;
    check_exactly_once(
        &counts,
        (0..4).flat_map(|p| (0..250).map(move |i| payload(p, i))),
        "concurrent publishers",
    );
}

/// Two members of one group split a keyed stream of 400 messages: each gets some, together
/// all, none twice.
pub async fn group_split<B: Broker>(broker: B) {
    let topic = unique("split");
    let cfg = Config {
        prefetch: 8,
        ..config(Duration::from_secs(20))
    };
    let mut subs = Vec::new();
    for i in 0..2 {
        subs.push(Arc::new(
            Subscribe::new(
                broker.clone(),
                &topic,
                Member::nth("grp", i, 2),
                cfg.clone(),
            )
            .connect_wrap(())
            .await
            .expect("subscribe"),
        ));
    }
    let publisher = Publish::new(broker.clone(), &topic, cfg.clone())
        .keyed_by(|p| Some(p.slice(p.len() - 1..)))
        .connect_wrap(())
        .await
        .expect("publisher");
    for b in 0..40 {
        publisher
            .send((0..10).map(|k| payload(0, b * 10 + k)))
            .await
            .expect("publish");
    }
    let all = Counts::default();
    let mut tasks = tokio::task::JoinSet::new();
    for sub in &subs {
        let (sub, all) = (sub.clone(), all.clone());
        tasks.spawn(async move {
            let mine = Counts::default();
            let deadline = Instant::now() + Duration::from_secs(30);
            while all.lock().unwrap().len() < 400 && Instant::now() < deadline {
                let before = mine.lock().unwrap().len();
                collect(
                    &sub,
                    &mine,
                    before + 1,
                    Duration::from_millis(200),
                    Duration::from_millis(2),
                )
                .await;
                let mut a = all.lock().unwrap();
                for (p, n) in mine.lock().unwrap().iter() {
                    a.insert(p.clone(), *n);
                }
            }
            let guard = mine.lock().unwrap();
            guard.clone()
        });
    }
    let mut shares = Vec::new();
    while let Some(r) = tasks.join_next().await {
        shares.push(r.unwrap());
    }
    for (i, s) in shares.iter().enumerate() {
        assert!(
            !s.is_empty(),
            "member {i} got nothing: the group did not split"
        );
        assert!(
            s.values().all(|n| *n == 1),
            "member {i} got a message twice"
        );
    }
    let overlap = shares[0]
        .keys()
        .filter(|k| shares[1].contains_key(*k))
        .count();
    assert_eq!(overlap, 0, "{overlap} messages went to both members");
    check_exactly_once(&all, (0..400).map(|i| payload(0, i)), "group split");
    eprintln!("group split: {} / {}", shares[0].len(), shares[1].len());
}

/// The broker is SIGKILLed and restarted while a publisher sends 1,500 messages and a
/// subscriber receives them: every message the publisher got acknowledged arrives, each once.
pub async fn restart_mid_stream<B: Broker>(
    broker: B,
    server: &mut Server,
    restart_timeout: Duration,
) {
    let topic = unique("restart");
    let cfg = config(Duration::from_secs(60));
    let sub = Arc::new(
        Subscribe::new(broker.clone(), &topic, Member::sole("g"), cfg.clone())
            .connect_wrap(())
            .await
            .expect("subscribe"),
    );
    let publisher = Publish::new(broker.clone(), &topic, cfg.clone())
        .connect_wrap(())
        .await
        .expect("publisher");
    let counts = Counts::default();
    let receiver = {
        let (sub, counts) = (sub.clone(), counts.clone());
        tokio::spawn(async move {
            collect(
                &sub,
                &counts,
                1500,
                Duration::from_secs(120),
                Duration::ZERO,
            )
            .await;
        })
    };
    let sending = tokio::spawn(async move {
        for b in 0..150 {
            publisher
                .send((0..10).map(|k| payload(0, b * 10 + k)))
                .await
                .expect("publish failed although the broker came back within op_timeout");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while counts.lock().unwrap().len() < 300 {
        assert!(
            Instant::now() < deadline,
            "fewer than 300 messages in 30 s before the kill"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let pid = server.pid();
    server.stop();
    eprintln!(
        "killed {} (pid {pid:?}) after {} messages",
        server.name,
        counts.lock().unwrap().len()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::task::block_in_place(|| server.restart(restart_timeout));
    eprintln!("restarted {} (pid {:?})", server.name, server.pid());
    tokio::time::timeout(Duration::from_secs(90), sending)
        .await
        .expect("publisher did not finish within 90 s of the restart")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(120), receiver)
        .await
        .expect("subscriber did not finish")
        .unwrap();
    collect(
        &sub,
        &counts,
        1501,
        Duration::from_millis(500),
        Duration::ZERO,
    )
    .await;
    check_exactly_once(
        &counts,
        (0..1500).map(|i| payload(0, i)),
        "restart mid-stream",
    );
    eprintln!(
        "restart: duplicates dropped by the subscriber: {}",
        sub.stats().await.duplicates
    );
}

/// Whether `e` is this crate's `Error::Unavailable` (the broker did not answer in time).
pub fn unavailable(e: &chunnel::Error) -> bool {
    match e {
        chunnel::Error::Layer { source, .. } => {
            matches!(
                source.downcast_ref::<Error>(),
                Some(Error::Unavailable { .. })
            )
        }
        _ => false,
    }
}

/// With the broker dead, publishing, receiving and opening a connection each fail with
/// `Error::Unavailable` within a bounded wait.
pub async fn dead_broker<B: Broker>(broker: B, server: &mut Server) {
    let topic = unique("dead");
    let op = Duration::from_secs(2);
    let bound = op * 2 + Duration::from_secs(3);
    let cfg = config(op);
    let sub = Subscribe::new(broker.clone(), &topic, Member::sole("g"), cfg.clone())
        .connect_wrap(())
        .await
        .expect("subscribe");
    let publisher = Publish::new(broker.clone(), &topic, cfg.clone())
        .connect_wrap(())
        .await
        .expect("publisher");
    publisher
        .send([Bytes::from_static(b"before")])
        .await
        .expect("publish");
    server.stop();
    let t = Instant::now();
    let e = tokio::time::timeout(bound * 2, publisher.send([Bytes::from_static(b"after")]))
        .await
        .expect("publish to a dead broker hung")
        .expect_err("publish to a dead broker succeeded");
    assert!(unavailable(&e), "publish: not Unavailable: {e}");
    assert!(
        t.elapsed() < bound,
        "publish took {:?} to fail (bound {bound:?})",
        t.elapsed()
    );
    eprintln!("publish failed after {:?}: {e}", t.elapsed());

    let t = Instant::now();
    let mut slots = vec![None; 4];
    let mut first = true;
    let e = loop {
        // The message sent before the kill may still come out of the subscriber's buffer.
        match tokio::time::timeout(bound * 2, sub.recv(&mut slots)).await {
            Err(_) => panic!("recv from a dead broker hung"),
            Ok(Ok(_)) if first => first = false,
            Ok(Ok(n)) => panic!("recv from a dead broker returned {n} messages"),
            Ok(Err(e)) => break e,
        }
    };
    assert!(unavailable(&e), "recv: not Unavailable: {e}");
    assert!(
        t.elapsed() < bound,
        "recv took {:?} to fail (bound {bound:?})",
        t.elapsed()
    );
    eprintln!("recv failed after {:?}: {e}", t.elapsed());

    let t = Instant::now();
    let e = tokio::time::timeout(
        bound * 2,
        Publish::new(broker.clone(), unique("dead2"), cfg).connect_wrap(()),
    )
    .await
    .expect("connecting to a dead broker hung")
    .err()
    .expect("connected to a dead broker");
    assert!(unavailable(&e), "connect: not Unavailable: {e}");
    assert!(
        t.elapsed() < bound,
        "connect took {:?} to fail (bound {bound:?})",
        t.elapsed()
    );
}

/// A subscriber whose application takes one message every 5 ms while 2,000 wait at the broker
/// holds at most `prefetch` fetched and `prefetch` unacknowledged messages at any time.
pub async fn slow_consumer<B: Broker>(broker: B) {
    let topic = unique("slow");
    let cfg = Config {
        prefetch: 8,
        ..config(Duration::from_secs(20))
    };
    let publisher = Publish::new(broker.clone(), &topic, cfg.clone())
        .connect_wrap(())
        .await
        .expect("publisher");
    for b in 0..20 {
        publisher
            .send((0..100).map(|k| payload(0, b * 100 + k)))
            .await
            .expect("publish");
    }
    let sub = Subscribe::new(broker.clone(), &topic, Member::sole("g"), cfg.clone())
        .connect_wrap(())
        .await
        .expect("subscribe");
    let mut slot = [None];
    let mut max_buffered = 0;
    for i in 0..100 {
        let n = tokio::time::timeout(Duration::from_secs(10), sub.recv(&mut slot))
            .await
            .expect("recv hung")
            .expect("recv");
        assert_eq!(n, 1);
        let got = slot[0].take().unwrap();
        if broker.ordering() == chunnel_pubsub::Ordering::Total {
            assert_eq!(got, payload(0, i), "out of order from one publisher");
        }
        let s = sub.stats().await;
        assert!(
            s.buffered <= 8 && s.unacked <= 8,
            "subscriber holds {s:?} with prefetch 8"
        );
        max_buffered = max_buffered.max(s.buffered);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(max_buffered > 0, "the subscriber never prefetched");
}

/// Receives from `sub` into `got` (every payload, asserting none comes twice) until `done(got)`
/// or `limit` passes (then fails with `what`); transient errors are retried.
async fn receive_until<C: chunnel_pubsub::Consumer>(
    sub: &Subscriber<C>,
    got: &mut std::collections::HashSet<Bytes>,
    limit: Duration,
    what: &str,
    mut done: impl FnMut(&std::collections::HashSet<Bytes>) -> bool,
) {
    let deadline = Instant::now() + limit;
    let mut slots = vec![None; 16];
    while !done(got) {
        assert!(Instant::now() < deadline, "timed out: {what}");
        match tokio::time::timeout(Duration::from_millis(500), sub.recv(&mut slots)).await {
            Err(_) => {}
            Ok(Err(e)) => {
                eprintln!("recv: {e} (retrying)");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(Ok(n)) => {
                for s in &mut slots[..n] {
                    let m = s.take().unwrap();
                    assert!(got.insert(m.clone()), "{what}: {m:?} delivered twice");
                }
            }
        }
    }
}

/// At-most-once across a takeover: 600 messages wait at the broker; member
/// `m0` of a group with `Delivery::AtMostOnce` hands 200 or more to its application; a `recv`
/// is cut off at its first wait; one more batch is handed out that the application never
/// records (it crashes with it in hand: the member is dropped at once). A new connection takes over
/// under the same member name and receives for `settle` after the rest arrived (past the
/// broker's redelivery delay). No message reaches the applications twice: above all, nothing
/// of the batch in hand comes again (it was acknowledged before it was handed out; with
/// at-least-once it would). What is lost is at most what the cut-off `recv` had taken (one
/// batch of 16), and nothing else.
pub async fn at_most_once_takeover<B: Broker>(broker: B, settle: Duration) {
    at_most_once_takeover_by(broker, settle, None).await;
}

/// [`at_most_once_takeover`], the new member under another name (`Some`): on a group that
/// assigns partitions by member (Kafka's rebalancing groups) it takes over only through the
/// group's transition, once the crashed member's lease has run out.
pub async fn at_most_once_takeover_by<B: Broker>(
    broker: B,
    settle: Duration,
    second_name: Option<&str>,
) {
    use std::collections::HashSet;
    const N: usize = 600;
    const SLOTS: usize = 16;
    let topic = unique("amo");
    let cfg = Config {
        delivery: Delivery::AtMostOnce,
        ..config(Duration::from_secs(10))
    };
    let member = Member::sole("g");
    let first = Subscribe::new(broker.clone(), &topic, member.clone(), cfg.clone())
        .connect_wrap(())
        .await
        .expect("subscribe");
    let publisher = Publish::new(broker.clone(), &topic, cfg.clone())
        .connect_wrap(())
        .await
        .expect("publisher");
    for b in 0..N / 10 {
        publisher
            .send((0..10).map(|k| payload(0, b * 10 + k)))
            .await
            .expect("publish");
    }
    let mut recorded = HashSet::new();
    receive_until(
        &first,
        &mut recorded,
        Duration::from_secs(60),
        "the first member's 200 messages",
        |got| got.len() >= 200,
    )
    .await;
    let mut slots = vec![None; SLOTS];
    // A recv cut off at its first wait (it may have taken and acknowledged a batch).
    let _ = tokio::time::timeout(Duration::ZERO, first.recv(&mut slots)).await;
    let n = tokio::time::timeout(Duration::from_secs(30), first.recv(&mut slots))
        .await
        .expect("the batch the application crashes with")
        .expect("recv");
    assert!(n > 0);
    let in_hand: HashSet<Bytes> = slots[..n].iter_mut().map(|s| s.take().unwrap()).collect();
    assert!(
        in_hand.is_disjoint(&recorded),
        "the first member delivered a message twice"
    );
    // The application crashes with that batch in hand: the member is gone.
    let first_stats = first.stats().await;
    drop(first);

    let second_member = match second_name {
        Some(name) => Member {
            name: name.to_owned(),
            ..member
        },
        None => member,
    };
    let second = Subscribe::new(broker.clone(), &topic, second_member, cfg.clone())
        .connect_wrap(())
        .await
        .expect("the new member subscribes");
    let mut took_over = HashSet::new();
    let before = recorded.len() + in_hand.len();
    receive_until(
        &second,
        &mut took_over,
        Duration::from_secs(60),
        "the new member's share (all but at most one cut-off batch)",
        |got| before + got.len() >= N - SLOTS,
    )
    .await;
    // Whatever the broker still redelivers comes within `settle`; nothing of it may be a copy.
    let settle_until = Instant::now() + settle;
    receive_until(
        &second,
        &mut took_over,
        settle + Duration::from_secs(5),
        "the settle period",
        |_| Instant::now() >= settle_until,
    )
    .await;
    let again: Vec<_> = took_over.intersection(&in_hand).collect();
    assert!(
        again.is_empty(),
        "at-most-once broken: {} message(s) of the batch the crashed application had in hand \
         came again, e.g. {:?}",
        again.len(),
        again.first()
    );
    let again = took_over.intersection(&recorded).count();
    assert_eq!(
        again, 0,
        "at-most-once broken: {again} messages reached both applications"
    );
    let all: HashSet<Bytes> = (0..N).map(|i| payload(0, i)).collect();
    let delivered: HashSet<Bytes> = recorded
        .iter()
        .chain(&in_hand)
        .chain(&took_over)
        .cloned()
        .collect();
    assert!(delivered.is_subset(&all), "messages nobody sent arrived");
    let lost = N - delivered.len();
    assert!(
        lost <= SLOTS,
        "{lost} messages lost: more than the one recv that was cut off could have taken"
    );
    eprintln!(
        "at-most-once takeover: {} recorded, {} lost in the crashed application's hand, {} \
         taken over, {lost} lost in the cut-off recv; first member at the end {first_stats:?}",
        recorded.len(),
        in_hand.len(),
        took_over.len()
    );
}
