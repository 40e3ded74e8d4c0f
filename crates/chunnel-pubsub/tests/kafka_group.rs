//! Kafka groups that rebalance ([`chunnel_pubsub::kafka::group`]) against a real Kafka 4.1
//! broker (started here, as in `tests/kafka.rs`) and an embedded SQLite rendezvous store:
//! members join mid-stream, leave cleanly, are dropped without leaving (lease expiry), join
//! eight at once, stop reading, meet records they cannot decode, and are cut off from the
//! store, while several publishers keep publishing.
#![cfg(all(feature = "kafka", feature = "group"))]

mod support;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection};
use chunnel_pubsub::kafka::KafkaBroker;
use chunnel_pubsub::kafka::group::{GroupConfig, KafkaGroupBroker, KafkaGroupConsumer};
use chunnel_pubsub::{Member, Publish, Subscribe, Subscriber};
use chunnel_rendezvous::{
    Ballot, JoinReply, Member as RdvMember, Snapshot, SqliteStore, Store, Transition,
};
use support::{Scratch, scenarios, unique};

type Broker = KafkaGroupBroker<Cuttable>;
type Sub = Subscriber<KafkaGroupConsumer>;

/// The SQLite store, which a test can make unreachable for the members that use this handle
/// (a member cut off from the store while the Kafka broker still answers it).
struct Cuttable {
    inner: Arc<SqliteStore>,
    cut: AtomicBool,
}

impl Cuttable {
    fn check(&self) -> Result<(), chunnel_rendezvous::Error> {
        if self.cut.load(Ordering::Acquire) {
            return Err(chunnel_rendezvous::Error::unavailable("sqlite", "cut off"));
        }
        Ok(())
    }
}

impl Store for Cuttable {
    fn backend(&self) -> &'static str {
        "sqlite"
    }
    async fn join_creating_at(
        &self,
        group: &str,
        member: &RdvMember,
        propose: Option<&Bytes>,
        expect_epoch: Option<u64>,
        create_epoch: u64,
        lease: Duration,
    ) -> Result<JoinReply, chunnel_rendezvous::Error> {
        self.check()?;
        self.inner
            .join_creating_at(group, member, propose, expect_epoch, create_epoch, lease)
            .await
    }
    async fn renew(
        &self,
        group: &str,
        member_id: &str,
        lease: Duration,
    ) -> Result<bool, chunnel_rendezvous::Error> {
        self.check()?;
        self.inner.renew(group, member_id, lease).await
    }
    async fn leave(&self, group: &str, member_id: &str) -> Result<(), chunnel_rendezvous::Error> {
        self.check()?;
        self.inner.leave(group, member_id).await
    }
    async fn snapshot(&self, group: &str) -> Result<Snapshot, chunnel_rendezvous::Error> {
        self.check()?;
        self.inner.snapshot(group).await
    }
    async fn propose(
        &self,
        group: &str,
        t: &Transition,
    ) -> Result<bool, chunnel_rendezvous::Error> {
        self.check()?;
        self.inner.propose(group, t).await
    }
    async fn vote(
        &self,
        group: &str,
        id: u64,
        member_id: &str,
        ballot: &Ballot,
    ) -> Result<bool, chunnel_rendezvous::Error> {
        self.check()?;
        self.inner.vote(group, id, member_id, ballot).await
    }
    async fn finish_attested(
        &self,
        group: &str,
        id: u64,
        commit: bool,
        attested: &[String],
    ) -> Result<bool, chunnel_rendezvous::Error> {
        self.check()?;
        self.inner
            .finish_attested(group, id, commit, attested)
            .await
    }
}
/// A keyed message's partition is `fnv1a(key) % partitions` (docs/wire.md §18.3), written out
/// here as the wire document states it.
fn fnv1a(key: &[u8]) -> u64 {
    key.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// How often each payload was handed to an application, across the group.
type Counts = Arc<Mutex<HashMap<Bytes, usize>>>;

fn group_config() -> GroupConfig {
    GroupConfig {
        lease: Duration::from_secs(2),
        renew_every: Duration::from_millis(300),
        poll: Duration::from_millis(20),
        transition_timeout: Duration::from_secs(5),
        drain: Duration::from_secs(1),
    }
}

async fn until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn member(name: &str) -> Member {
    Member {
        group: "g".into(),
        name: name.into(),
        index: 0,
        count: 1,
    }
}

/// A member and the task reading from it into `counts` (and into its own list).
struct Reader {
    member: Member,
    sub: Arc<Sub>,
    stop: Arc<AtomicBool>,
    got: Arc<Mutex<Vec<Bytes>>>,
    task: tokio::task::JoinHandle<()>,
}

async fn join(broker: &Broker, topic: &str, name: &str, counts: &Counts) -> Reader {
    let m = member(name);
    let sub = Subscribe::new(
        broker.clone(),
        topic,
        m.clone(),
        scenarios::config(Duration::from_secs(20)),
    )
    .connect_wrap(())
    .await
    .expect("subscribe");
    let sub = Arc::new(sub);
    let stop = Arc::new(AtomicBool::new(false));
    let got = Arc::new(Mutex::new(Vec::new()));
    let task = {
        let (sub, stop, got, counts) = (sub.clone(), stop.clone(), got.clone(), counts.clone());
        tokio::spawn(async move {
            let mut slots = vec![None; 16];
            while !stop.load(Ordering::Acquire) {
                match tokio::time::timeout(Duration::from_millis(200), sub.recv(&mut slots)).await {
                    Ok(Ok(n)) => {
                        let mut c = counts.lock().unwrap();
                        let mut g = got.lock().unwrap();
                        for s in &mut slots[..n] {
                            let p = s.take().unwrap();
                            *c.entry(p.clone()).or_default() += 1;
                            g.push(p);
                        }
                    }
                    Ok(Err(e)) => {
                        eprintln!("recv: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(_) => {}
                }
            }
        })
    };
    Reader {
        member: m,
        sub,
        stop,
        got,
        task,
    }
}

impl Reader {
    /// Stops reading (the subscriber stays a member).
    async fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        (&mut self.task).await.unwrap();
    }

    fn got(&self) -> HashSet<Bytes> {
        self.got.lock().unwrap().iter().cloned().collect()
    }
}

/// Publishers of keyed payloads `p{i}-{j}` in bursts of 10 every 20 ms until stopped; how many
/// each published.
struct Publishers {
    stop: Arc<AtomicBool>,
    sent: Vec<Arc<AtomicUsize>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

async fn publishers(broker: &Broker, topic: &str, n: usize) -> Publishers {
    let stop = Arc::new(AtomicBool::new(false));
    let mut sent = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..n {
        let count = Arc::new(AtomicUsize::new(0));
        sent.push(count.clone());
        let publisher = Publish::new(
            broker.clone(),
            topic,
            scenarios::config(Duration::from_secs(20)),
        )
        .keyed_by(|p| Some(p.clone()))
        .connect_wrap(())
        .await
        .expect("publisher");
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut j = 0;
            while !stop.load(Ordering::Acquire) {
                publisher
                    .send((j..j + 10).map(|k| Bytes::from(format!("p{i}-{k}"))))
                    .await
                    .expect("publish");
                j += 10;
                count.store(j, Ordering::Release);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    Publishers { stop, sent, tasks }
}

impl Publishers {
    /// Stops publishing; every payload published.
    async fn finish(self) -> Vec<Bytes> {
        self.stop.store(true, Ordering::Release);
        for t in self.tasks {
            t.await.unwrap();
        }
        self.sent
            .iter()
            .enumerate()
            .flat_map(|(i, n)| {
                (0..n.load(Ordering::Acquire)).map(move |k| Bytes::from(format!("p{i}-{k}")))
            })
            .collect()
    }
}

/// Samples the partitions every member of `members` fetches from, every 2 ms, until stopped:
/// counts the samples in which one partition was held by two members.
struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(usize, usize)>,
}

fn sampler(broker: &Broker, topic: &str, members: Vec<Member>) -> Sampler {
    let stop = Arc::new(AtomicBool::new(false));
    let task = {
        let (broker, topic, stop) = (broker.clone(), topic.to_owned(), stop.clone());
        tokio::spawn(async move {
            let (mut samples, mut overlaps) = (0, 0);
            while !stop.load(Ordering::Acquire) {
                let mut seen = BTreeSet::new();
                for m in &members {
                    if let Some((_, parts)) = broker.holding(&topic, m) {
                        for p in parts {
                            if !seen.insert(p) {
                                overlaps += 1;
                                eprintln!("partition {p} held twice: {m:?}");
                            }
                        }
                    }
                }
                samples += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            (samples, overlaps)
        })
    };
    Sampler { stop, task }
}

impl Sampler {
    async fn finish(self) -> (usize, usize) {
        self.stop.store(true, Ordering::Release);
        self.task.await.unwrap()
    }
}

fn holding(broker: &Broker, topic: &str, r: &Reader) -> Vec<i32> {
    broker
        .holding(topic, &r.member)
        .map(|(_, p)| p)
        .unwrap_or_default()
}

/// Waits (at most 20 s) until each of `readers` holds `n` partitions.
async fn until_each_holds(broker: &Broker, topic: &str, readers: &[&Reader], n: usize) {
    let names: Vec<&str> = readers.iter().map(|r| r.member.name.as_str()).collect();
    until(
        &format!("{names:?} to hold {n} partitions each"),
        Duration::from_secs(20),
        || readers.iter().all(|r| holding(broker, topic, r).len() == n),
    )
    .await;
}

/// Every published payload arrived; any payload handed out twice is one of `may_repeat`.
fn check(counts: &Counts, sent: &[Bytes], may_repeat: &HashSet<Bytes>, what: &str) -> usize {
    let c = counts.lock().unwrap();
    let missing: Vec<&Bytes> = sent.iter().filter(|p| !c.contains_key(*p)).collect();
    assert!(
        missing.is_empty(),
        "{what}: {} of {} never arrived, e.g. {:?}",
        missing.len(),
        sent.len(),
        &missing[..missing.len().min(5)]
    );
    assert_eq!(c.len(), sent.len(), "{what}: payloads nobody sent arrived");
    let repeated: Vec<(&Bytes, &usize)> = c.iter().filter(|(_, n)| **n > 1).collect();
    for (p, n) in &repeated {
        assert!(
            may_repeat.contains(*p),
            "{what}: {p:?} handed out {n} times, and no member that died had it"
        );
    }
    repeated.len()
}

async fn wait_all(counts: &Counts, sent: &[Bytes], what: &str) {
    let want: HashSet<&Bytes> = sent.iter().collect();
    until(what, Duration::from_secs(60), || {
        let c = counts.lock().unwrap();
        want.iter().all(|p| c.contains_key(*p))
    })
    .await;
    // Anything more (a duplicate) would show up now.
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// (a) One member, then a second and a third join mid-stream, the second leaves cleanly and the
/// third is dropped without leaving: each time the six partitions are reassigned, nothing is
/// lost, no partition is held by two members, and only what the dropped member had is handed
/// out twice.
async fn join_leave_die(broker: Broker) {
    let topic = unique("kg-jld");
    let counts = Counts::default();
    let mut a = join(&broker, &topic, "a", &counts).await;
    until("a holds every partition", Duration::from_secs(20), || {
        holding(&broker, &topic, &a).len() == 6
    })
    .await;
    let sampler = sampler(&broker, &topic, vec![member("a"), member("b"), member("c")]);
    let pubs = publishers(&broker, &topic, 3).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut b = join(&broker, &topic, "b", &counts).await;
    until_each_holds(&broker, &topic, &[&a, &b], 3).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut c = join(&broker, &topic, "c", &counts).await;
    until_each_holds(&broker, &topic, &[&a, &b, &c], 2).await;
    until("b and c got messages", Duration::from_secs(20), || {
        !b.got().is_empty() && !c.got().is_empty()
    })
    .await;

    // b leaves cleanly: everything it handed out acknowledged and committed.
    b.stop().await;
    b.sub.ack().await.expect("ack");
    broker.leave(&topic, &b.member).await.expect("leave");
    until_each_holds(&broker, &topic, &[&a, &c], 3).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Nothing handed out twice so far: every handover was clean.
    let clean = counts.lock().unwrap().values().filter(|n| **n > 1).count();
    assert_eq!(clean, 0, "duplicates across clean handovers");

    // c is dropped without leaving: its partitions go to a once its lease ran out.
    c.stop().await;
    let c_got = c.got();
    let Reader { sub, .. } = c;
    drop(sub);
    let dropped = Instant::now();
    until(
        "a holds every partition again",
        Duration::from_secs(20),
        || holding(&broker, &topic, &a).len() == 6,
    )
    .await;
    let took = dropped.elapsed();
    // The lease is 2 s, renewed every 300 ms: it runs out about 1.7 s or more after the drop
    // (less if a renewal ran late on a loaded machine, hence the 1 s bound); a takeover that
    // ignored the lease would come within a poll (20 ms) of the drop.
    assert!(
        took >= Duration::from_millis(1_000),
        "c's partitions were taken after {took:?}, before its lease could run out"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;

    let sent = pubs.finish().await;
    wait_all(&counts, &sent, "join/leave/die").await;
    a.stop().await;
    let (samples, overlaps) = sampler.finish().await;
    assert_eq!(overlaps, 0, "a partition held by two members");
    let repeated = check(&counts, &sent, &c_got, "join/leave/die");
    eprintln!(
        "join/leave/die: {} messages, {repeated} handed out twice (all had by the dropped \
         member, which handed out {}), {samples} ownership samples",
        sent.len(),
        c_got.len()
    );
}

/// (b) Eight members join at once over eight partitions while three publishers publish: each
/// ends up with one partition, nothing is lost or handed out twice.
async fn eight_at_once(broker: Broker) {
    let topic = unique("kg-eight");
    let counts = Counts::default();
    let names: Vec<String> = (0..8).map(|i| format!("m{i}")).collect();
    let pubs = publishers(&broker, &topic, 3).await;
    let sampler = sampler(&broker, &topic, names.iter().map(|n| member(n)).collect());
    // All eight join at once.
    let handles: Vec<_> = names
        .iter()
        .map(|n| {
            let (broker, topic, n, counts) =
                (broker.clone(), topic.clone(), n.clone(), counts.clone());
            tokio::spawn(async move { join(&broker, &topic, &n, &counts).await })
        })
        .collect();
    let mut readers = Vec::new();
    for h in handles {
        readers.push(h.await.unwrap());
    }
    until(
        "every member holds one partition",
        Duration::from_secs(30),
        || {
            readers
                .iter()
                .all(|r| holding(&broker, &topic, r).len() == 1)
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let sent = pubs.finish().await;
    wait_all(&counts, &sent, "eight at once").await;
    for r in &mut readers {
        r.stop().await;
        assert!(!r.got().is_empty(), "{} got nothing", r.member.name);
    }
    let (_, overlaps) = sampler.finish().await;
    assert_eq!(overlaps, 0, "a partition held by two members");
    let repeated = check(&counts, &sent, &HashSet::new(), "eight at once");
    assert_eq!(repeated, 0);
}

/// (c) A member that stops reading keeps its partitions (the other member never gets their
/// messages) while its lease holds, and holds at most `prefetch` messages; once it is dropped,
/// the other member takes them over and gets everything.
async fn stalled_member_keeps_its_partitions(broker: Broker) {
    let topic = unique("kg-stall");
    let counts = Counts::default();
    let mut a = join(&broker, &topic, "a", &counts).await;
    let b = join(&broker, &topic, "b", &counts).await;
    until_each_holds(&broker, &topic, &[&a, &b], 3).await;
    let a_parts = holding(&broker, &topic, &a);
    let pubs = publishers(&broker, &topic, 2).await;
    until("a got some", Duration::from_secs(20), || {
        a.got().len() >= 10
    })
    .await;
    a.stop().await;
    // Three leases long, a reads nothing; its partitions stay its own.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        holding(&broker, &topic, &a),
        a_parts,
        "a kept its partitions"
    );
    let stats = a.sub.stats().await;
    assert!(
        stats.buffered <= 64 && stats.unacked <= 64,
        "a stalled member holds at most prefetch: {stats:?}"
    );
    let sent = pubs.finish().await;
    // The messages on a's partitions that a did not hand out before it stopped: none may
    // have reached b (a keyed message goes to partition fnv1a(key) % 6, docs/wire.md §18.3).
    let a_got = a.got();
    let on_a: Vec<&Bytes> = sent
        .iter()
        .filter(|p| a_parts.contains(&((fnv1a(p) % 6) as i32)) && !a_got.contains(*p))
        .collect();
    assert!(!on_a.is_empty(), "nothing was published to a's partitions");
    let leaked = {
        let c = counts.lock().unwrap();
        on_a.iter().filter(|p| c.contains_key(**p)).count()
    };
    assert_eq!(
        leaked, 0,
        "b got {leaked} of the stalled member's messages while a still held its partitions"
    );
    let Reader { sub, .. } = a;
    drop(sub);
    wait_all(&counts, &sent, "stalled member").await;
    assert_eq!(holding(&broker, &topic, &b).len(), 6);
    check(&counts, &sent, &a_got, "stalled member");
}

/// (d) A member cut off from the store (it cannot renew its lease) while it keeps reading from
/// Kafka: once its lease is past the fence (3/4 of it) it hands out nothing more, and the
/// other member takes its partitions when the lease has run out and gets everything.
async fn member_cut_off_from_the_store_stops(
    broker: Broker,
    zombie_broker: Broker,
    cut: &Cuttable,
) {
    let topic = unique("kg-cut");
    let counts = Counts::default();
    let a = join(&broker, &topic, "a", &counts).await;
    let z = join(&zombie_broker, &topic, "z", &counts).await;
    until(
        "a and z split the partitions",
        Duration::from_secs(20),
        || {
            holding(&broker, &topic, &a).len() == 3
                && holding(&zombie_broker, &topic, &z).len() == 3
        },
    )
    .await;
    let pubs = publishers(&broker, &topic, 2).await;
    until("z got some", Duration::from_secs(20), || {
        z.got().len() >= 10
    })
    .await;
    cut.cut.store(true, Ordering::Release);
    // Past the fence (1.5 s of the 2 s lease; its last renewal was at most 300 ms before).
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    let fenced = z.got().len();
    until("a holds every partition", Duration::from_secs(20), || {
        holding(&broker, &topic, &a).len() == 6
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let sent = pubs.finish().await;
    wait_all(&counts, &sent, "member cut off").await;
    assert_eq!(
        z.got().len(),
        fenced,
        "the member cut off from the store handed out messages after its fence"
    );
    let z_got = z.got();
    check(&counts, &sent, &z_got, "member cut off");
    drop(z);
    drop(a);
}

/// Waits (at most `limit`) for the group record of `rgroup` to satisfy `ok`.
async fn until_record(
    store: &SqliteStore,
    rgroup: &str,
    what: &str,
    limit: Duration,
    ok: impl Fn(&Snapshot) -> bool,
) {
    let deadline = Instant::now() + limit;
    loop {
        let s = store.snapshot(rgroup).await.expect("snapshot");
        if ok(&s) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// (e) A rogue writer (another version, a damaged store) puts assignments no member can
/// decode into the group's record, first as a transition whose deadline is a minute away,
/// then as a committed epoch: the members abort the first at once and replace the second
/// with a fresh list, a third member joining in between still gets its share, and nothing is
/// lost or handed out twice.
async fn damaged_records_do_not_stall_the_group(broker: Broker, store: &SqliteStore) {
    let topic = unique("kg-rogue");
    let rgroup = format!("kg.g.{topic}");
    let junk = Bytes::from_static(b"not an assignment");
    let counts = Counts::default();
    let a = join(&broker, &topic, "a", &counts).await;
    let b = join(&broker, &topic, "b", &counts).await;
    until_each_holds(&broker, &topic, &[&a, &b], 3).await;
    let sampler = sampler(&broker, &topic, vec![member("a"), member("b"), member("c")]);
    let pubs = publishers(&broker, &topic, 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    // An undecodable proposal, its deadline a minute away: aborted long before.
    let snap = store.snapshot(&rgroup).await.expect("snapshot");
    let rogue = Transition {
        id: 0xbad,
        from_epoch: snap.epoch(),
        proposer: "rogue".into(),
        stack: junk.clone(),
        deadline_ms: chunnel_rendezvous::store::now_ms() + 60_000,
        ballot_box: None,
    };
    assert!(store.propose(&rgroup, &rogue).await.expect("propose"));
    until_record(
        store,
        &rgroup,
        "the members to abort the undecodable proposal",
        Duration::from_secs(10),
        |s| s.transition.as_ref().is_none_or(|t| t.id != rogue.id),
    )
    .await;
    let c = join(&broker, &topic, "c", &counts).await;
    until_each_holds(&broker, &topic, &[&a, &b, &c], 2).await;

    // An undecodable epoch, committed by the rogue on everyone's behalf (retried: the members
    // abort its proposals as soon as they see them).
    let mut committed = None;
    for i in 0..500u64 {
        let s = store.snapshot(&rgroup).await.expect("snapshot");
        if s.transition.is_none() {
            let t = Transition {
                id: 0xbad0 + i,
                from_epoch: s.epoch(),
                stack: junk.clone(),
                ..rogue.clone()
            };
            let live: Vec<String> = s.members.iter().map(|m| m.id.clone()).collect();
            if store.propose(&rgroup, &t).await.expect("propose")
                && store
                    .finish_attested(&rgroup, t.id, true, &live)
                    .await
                    .expect("finish")
            {
                committed = Some(s.epoch() + 1);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let bad_epoch = committed.expect("the rogue never got an undecodable epoch committed");
    until_record(
        store,
        &rgroup,
        "a readable list to replace the undecodable epoch",
        Duration::from_secs(20),
        |s| s.epoch() > bad_epoch && s.committed.as_ref().is_some_and(|c| c.stack != junk),
    )
    .await;
    until_each_holds(&broker, &topic, &[&a, &b, &c], 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sent = pubs.finish().await;
    wait_all(&counts, &sent, "damaged records").await;
    let (_, overlaps) = sampler.finish().await;
    assert_eq!(overlaps, 0, "a partition held by two members");
    let repeated = check(&counts, &sent, &HashSet::new(), "damaged records");
    assert_eq!(repeated, 0);
    eprintln!(
        "damaged records: {} messages, the undecodable epoch {bad_epoch} replaced",
        sent.len()
    );
    for mut r in [a, b, c] {
        r.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_group_rebalances() {
    let scratch = Scratch::new("ps-kgroup");
    let (_server, addr) = support::kafka(&scratch);
    let kafka = KafkaBroker::connect(vec![addr], 6, Duration::from_secs(30))
        .await
        .expect("connect to kafka");
    let sqlite = Arc::new(SqliteStore::open(scratch.0.join("groups.sqlite")).expect("sqlite"));
    let store = Arc::new(Cuttable {
        inner: sqlite.clone(),
        cut: AtomicBool::new(false),
    });
    let broker = KafkaGroupBroker::new(kafka.clone(), store.clone(), group_config());
    eprintln!("kafka group: join, leave, die");
    join_leave_die(broker.clone()).await;
    eprintln!("kafka group: eight members at once");
    let eight = KafkaGroupBroker::new(
        kafka.with_partitions(8).unwrap(),
        store.clone(),
        group_config(),
    );
    eight_at_once(eight).await;
    eprintln!("kafka group: a member that stops reading");
    stalled_member_keeps_its_partitions(broker.clone()).await;
    eprintln!("kafka group: at-most-once takeover");
    scenarios::at_most_once_takeover(broker.clone(), Duration::from_secs(1)).await;
    eprintln!("kafka group: at-most-once takeover by another member (through a transition)");
    scenarios::at_most_once_takeover_by(broker.clone(), Duration::from_secs(1), Some("m1")).await;
    eprintln!("kafka group: undecodable records from a rogue writer");
    damaged_records_do_not_stall_the_group(broker.clone(), &sqlite).await;
    eprintln!("kafka group: a member cut off from the store");
    let zombie_store = Arc::new(Cuttable {
        inner: sqlite,
        cut: AtomicBool::new(false),
    });
    let zombie = KafkaGroupBroker::new(kafka, zombie_store.clone(), group_config());
    member_cut_off_from_the_store_stops(broker, zombie, &zombie_store).await;
}
