//! The group scenarios every backend must pass (the bar), generic over the store.
//!
//! Stacks are selects of `Xor` layers (an exact capability `xor = {key}`): members using
//! different stacks garble each other's messages, so every received message is checked.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel::{Select, select};
use chunnel_rendezvous::{Config, Error, Group, Store};
use chunnel_test::Xor;

pub type Stack = Select<Xor, Xor>;

pub fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A group name unique to this test run.
pub fn unique(what: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{what}-{}-{n}", std::process::id())
}

pub fn fast() -> Config {
    Config {
        lease: Duration::from_secs(2),
        renew_every: Duration::from_millis(500),
        poll: Duration::from_millis(10),
        transition_timeout: Duration::from_secs(3),
        ..Config::default()
    }
}

/// Waits (bounded) until `f` holds for the group's view.
pub async fn until(
    g: &Group<Stack>,
    what: &str,
    limit: Duration,
    f: impl Fn(&chunnel_rendezvous::View) -> bool,
) {
    let mut w = g.participant().watch();
    let deadline = Instant::now() + limit;
    loop {
        if f(&w.borrow_and_update()) {
            return;
        }
        assert!(
            tokio::time::timeout_at(deadline.into(), w.changed())
                .await
                .is_ok(),
            "timed out after {limit:?} waiting for: {what} (view: {:?})",
            *w.borrow()
        );
    }
}

async fn join<St: Store>(
    store: Arc<St>,
    group: &str,
    id: &str,
    stack: Stack,
) -> Result<Group<Stack>, Error> {
    Group::join(store, group, id, any_port(), stack, None, fast()).await
}

/// `from` sends `msg`; every one of `to` receives exactly it (decoded with the same stack).
pub async fn exchange(from: &Group<Stack>, to: &[&Group<Stack>], msg: &str) {
    from.send([Bytes::copy_from_slice(msg.as_bytes())])
        .await
        .unwrap();
    for g in to {
        let got = tokio::time::timeout(Duration::from_secs(5), g.recv())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{} got nothing (its view {:?}, counters {:?}; the sender's view {:?})",
                    g.participant().id(),
                    g.participant().view(),
                    g.counters(),
                    from.participant().view()
                )
            })
            .unwrap();
        assert_eq!(
            got,
            msg.as_bytes(),
            "{} decoded garbage",
            g.participant().id()
        );
    }
}

/// 64 participants race to create an empty group, half preferring `xor=1` and half `xor=2`:
/// exactly one proposal wins, and all 64 use its stack.
pub async fn race_64<St, F, Fut>(connect: F)
where
    St: Store,
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<St>>,
{
    let group = unique("race");
    let mut joins = tokio::task::JoinSet::new();
    for i in 0..64 {
        let store = connect().await;
        let group = group.clone();
        let stack = if i % 2 == 0 {
            select(Xor(1), Xor(2))
        } else {
            select(Xor(2), Xor(1))
        };
        // 64 members polling every 10 ms would put 6,400 reads/s on the store, which a loaded
        // 2-core CI machine cannot always serve before leases run out; this scenario is about
        // the join race, so poll gently and lease generously.
        let config = Config {
            poll: Duration::from_millis(100),
            lease: Duration::from_secs(15),
            renew_every: Duration::from_secs(3),
            ..fast()
        };
        joins.spawn(async move {
            Group::join(
                store,
                &group,
                &format!("m{i:02}"),
                any_port(),
                stack,
                None,
                config,
            )
            .await
        });
    }
    let mut groups = Vec::new();
    while let Some(r) = joins.join_next().await {
        groups.push(r.unwrap().expect("join failed"));
    }
    let created = groups.iter().filter(|g| g.participant().created()).count();
    assert_eq!(created, 1, "exactly one participant creates the group");
    let stacks: std::collections::HashSet<_> = groups
        .iter()
        .map(|g| format!("{:?}", g.participant().view().stack))
        .collect();
    assert_eq!(
        stacks.len(),
        1,
        "everyone uses the committed stack: {stacks:?}"
    );
    assert!(groups.iter().all(|g| g.participant().view().epoch == 1));
    // Everyone sees all 64, and a message reaches the other 63 intact.
    for g in &groups {
        until(g, "64 members", Duration::from_secs(20), |v| {
            v.members.len() == 64
        })
        .await;
    }
    let (first, rest) = groups.split_first().unwrap();
    let rest: Vec<&Group<Stack>> = rest.iter().collect();
    exchange(first, &rest, "hello, 63 of you").await;
    for g in groups {
        g.leave().await.unwrap();
    }
}

/// A late joiner whose only stack is incompatible gets the error; the group keeps working.
pub async fn incompatible_late_joiner<St: Store>(store: Arc<St>) {
    let group = unique("late");
    let a = join(store.clone(), &group, "a", select(Xor(1), Xor(2)))
        .await
        .unwrap();
    let b = join(store.clone(), &group, "b", select(Xor(1), Xor(2)))
        .await
        .unwrap();
    until(&a, "2 members", Duration::from_secs(5), |v| {
        v.members.len() == 2
    })
    .await;
    let err = join(store.clone(), &group, "c", select(Xor(3), Xor(4)))
        .await
        .expect_err("an incompatible joiner got in");
    match &err {
        Error::Incompatible { mismatches, .. } => {
            assert_eq!(
                mismatches.len(),
                2,
                "one mismatch per option: {mismatches:?}"
            );
            assert_eq!(mismatches[0].kind, "xor");
        }
        other => panic!("expected Incompatible, got {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("xor") && msg.contains(&group),
        "unclear error: {msg}"
    );
    exchange(&a, &[&b], "still here").await;
    exchange(&b, &[&a], "me too").await;
    assert_eq!(
        a.participant().view().members.len(),
        2,
        "the refused joiner was added"
    );
}

/// A participant that dies without leaving disappears from the others' count after its lease,
/// and they are told.
pub async fn killed_member_expires<St: Store>(store: Arc<St>) {
    let group = unique("lease");
    let a = join(store.clone(), &group, "a", select(Xor(1), Xor(2)))
        .await
        .unwrap();
    let b = join(store.clone(), &group, "b", select(Xor(1), Xor(2)))
        .await
        .unwrap();
    until(&a, "2 members", Duration::from_secs(5), |v| {
        v.members.len() == 2
    })
    .await;
    let killed_at = Instant::now();
    drop(b); // no leave: its renewals just stop, like a crash
    until(
        &a,
        "the dead member to expire",
        Duration::from_secs(10),
        |v| v.members.len() == 1,
    )
    .await;
    let took = killed_at.elapsed();
    assert!(
        took >= Duration::from_millis(1000),
        "gone after {took:?}: before its 2 s lease could have run out"
    );
}

/// A transition refused by one participant leaves everyone on the old stack; one everybody
/// accepts switches everyone, losing and duplicating nothing sent around the switch.
pub async fn transitions<St: Store>(store: Arc<St>) {
    let group = unique("switch");
    let refuse: chunnel_rendezvous::Policy = Arc::new(|stack| {
        if stack.iter().any(|c| {
            c.capabilities
                .iter()
                .any(|k| k.labels.iter().any(|l| l == "2"))
        }) {
            Err("xor=2 is not allowed here".into())
        } else {
            Ok(())
        }
    });
    let a = join(store.clone(), &group, "a", select(Xor(1), Xor(2)))
        .await
        .unwrap();
    let b = join(store.clone(), &group, "b", select(Xor(1), Xor(2)))
        .await
        .unwrap();
    let c = Group::join(
        store.clone(),
        &group,
        "c",
        any_port(),
        select(Xor(1), Xor(2)),
        Some(refuse),
        fast(),
    )
    .await
    .unwrap();
    for g in [&a, &b, &c] {
        until(g, "3 members", Duration::from_secs(5), |v| {
            v.members.len() == 3
        })
        .await;
    }
    match a.propose(1).await {
        Err(Error::Aborted { reason, .. }) => assert!(reason.contains("c: xor=2"), "{reason}"),
        other => panic!("a refused transition: {other:?}"),
    }
    for g in [&a, &b, &c] {
        let v = g.participant().view();
        assert_eq!(
            (v.epoch, v.option),
            (1, 0),
            "{} moved",
            g.participant().id()
        );
    }
    exchange(&a, &[&b, &c], "after the refusal").await;
    c.leave().await.unwrap();
    until(&a, "c gone", Duration::from_secs(5), |v| {
        v.members.len() == 2
    })
    .await;

    // Now a switch under traffic: a streams numbered messages while b proposes, and goes on
    // until 500 messages went out on the new stack; then an end marker.
    let a = Arc::new(a);
    let sender = {
        let a = a.clone();
        tokio::spawn(async move {
            let (mut i, mut on_new) = (0u32, 0);
            let mut epochs = std::collections::BTreeSet::new();
            while on_new < 500 {
                assert!(i < 200_000, "the switch never reached the sender");
                let epoch = a.participant().view().epoch;
                epochs.insert(epoch);
                on_new += u32::from(epoch == 2);
                a.send([Bytes::copy_from_slice(format!("m{i:06}").as_bytes())])
                    .await
                    .unwrap();
                i += 1;
                if i % 50 == 0 {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            a.send([Bytes::from_static(b"end")]).await.unwrap();
            (i, epochs)
        })
    };
    let proposer = async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        b.propose(1).await
    };
    let receiver = async {
        let mut got = Vec::new();
        loop {
            let m = tokio::time::timeout(Duration::from_secs(5), b.recv())
                .await
                .unwrap_or_else(|_| panic!("stalled after {} messages", got.len()))
                .unwrap();
            let m = String::from_utf8(m.to_vec()).expect("garbled message");
            if m == "end" {
                break got;
            }
            got.push(m);
        }
    };
    let (r, got) = tokio::join!(proposer, receiver);
    r.expect("the transition everyone accepts did not commit");
    let (n, epochs) = sender.await.unwrap();
    assert_eq!(
        epochs.into_iter().collect::<Vec<_>>(),
        vec![1, 2],
        "the stream did not span the switch"
    );
    let want: Vec<String> = (0..n).map(|i| format!("m{i:06}")).collect();
    assert_eq!(
        got.len(),
        want.len(),
        "messages lost or duplicated around the switch"
    );
    assert!(
        got == want,
        "messages reordered or altered around the switch"
    );
    for g in [&*a, &b] {
        until(g, "epoch 2", Duration::from_secs(5), |v| {
            v.epoch == 2 && v.option == 1
        })
        .await;
    }
    exchange(&a, &[&b], "on the new stack").await;
    assert_eq!(
        b.counters()
            .stale
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

/// With the store down, joined members keep talking and new joins fail with a clear error;
/// once it is back, new joins succeed.
pub async fn store_outage<St, K, R, Fut>(
    store: Arc<St>,
    connect_fresh: impl Fn() -> Fut,
    kill: K,
    restart: R,
) where
    St: Store,
    Fut: Future<Output = Result<Arc<St>, Error>>,
    K: FnOnce(),
    R: FnOnce(),
{
    let group = unique("outage");
    let a = join(store.clone(), &group, "a", select(Xor(1), Xor(2)))
        .await
        .unwrap();
    let b = join(store.clone(), &group, "b", select(Xor(1), Xor(2)))
        .await
        .unwrap();
    until(&a, "2 members", Duration::from_secs(5), |v| {
        v.members.len() == 2
    })
    .await;
    kill();
    until(
        &a,
        "the store to be seen down",
        Duration::from_secs(10),
        |v| !v.store_reachable,
    )
    .await;
    for i in 0..20 {
        exchange(&a, &[&b], &format!("during the outage {i}")).await;
        exchange(&b, &[&a], &format!("reply {i}")).await;
    }
    let t = Instant::now();
    // A newcomer: connecting to the store, or joining through it, fails with a clear error.
    let newcomer = async {
        let store = connect_fresh().await?;
        join(store, &group, "c", select(Xor(1), Xor(2))).await
    };
    let err = tokio::time::timeout(Duration::from_secs(15), newcomer)
        .await
        .expect("a join against a dead store hung")
        .expect_err("joined through a dead store");
    assert!(
        matches!(err, Error::Unavailable { .. }),
        "unclear error: {err}"
    );
    eprintln!(
        "join with the store down failed after {:?}: {err}",
        t.elapsed()
    );
    restart();
    let deadline = Instant::now() + Duration::from_secs(20);
    let c = loop {
        match join(store.clone(), &group, "c", select(Xor(1), Xor(2))).await {
            Ok(c) => break c,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "joins still fail after the restart: {e}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    for g in [&a, &b, &c] {
        until(
            g,
            "3 members after the restart",
            Duration::from_secs(10),
            |v| v.members.len() == 3,
        )
        .await;
    }
    exchange(&c, &[&a, &b], "joined after the restart").await;
}

/// The environment variable that turns a test binary run into the child of
/// [`killed_process`]: `<backend-specific connect spec>\n<group>`.
pub const CHILD_ENV: &str = "CHUNNEL_RDV_CHILD";

/// The marker the child prints once it has exchanged messages with the parent.
const CHILD_READY: &str = "CHUNNEL-RDV-CHILD-READY";

/// A participant in another process, SIGKILLed: this test binary re-runs itself on
/// `child_test` (an ignored test calling [`child`]) with `spec` telling it how to reach the
/// store. The child joins the parent's group, they exchange messages, the parent kills it with
/// SIGKILL (no leave, no clean-up), and the child disappears from the parent's count once its
/// lease runs out (2 s), not before 1 s.
pub async fn killed_process<St: Store>(store: Arc<St>, child_test: &str, spec: &str) {
    use tokio::io::AsyncBufReadExt;

    let group = unique("killed");
    let parent = join(store, &group, "parent", select(Xor(1), Xor(2)))
        .await
        .unwrap();
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", child_test, "--ignored", "--nocapture"])
        .env(CHILD_ENV, format!("{spec}\n{group}"))
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    until(
        &parent,
        "the child process to join",
        Duration::from_secs(20),
        |v| v.members.len() == 2,
    )
    .await;
    let got = tokio::time::timeout(Duration::from_secs(10), parent.recv())
        .await
        .expect("nothing from the child process")
        .unwrap();
    assert_eq!(got, "from the child process");
    parent
        .send([Bytes::from_static(b"from the parent")])
        .await
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if l.contains(CHILD_READY) {
                return;
            }
        }
        panic!("the child exited before it was ready");
    })
    .await
    .expect("the child never got the parent's message");
    let killed_at = Instant::now();
    child.kill().await.unwrap(); // SIGKILL
    until(
        &parent,
        "the killed child's lease to run out",
        Duration::from_secs(10),
        |v| v.members.len() == 1,
    )
    .await;
    let took = killed_at.elapsed();
    assert!(
        took >= Duration::from_millis(1000),
        "gone after {took:?}: before its 2 s lease could have run out"
    );
}

/// The child half of [`killed_process`]: joins `group` (preferring the stack the parent did
/// not pick), exchanges messages, says it is ready and waits to be killed.
pub async fn child<St: Store>(store: Arc<St>, group: &str) {
    let me = join(store, group, "child", select(Xor(2), Xor(1)))
        .await
        .unwrap();
    // Our preference (xor=2) lost: the group's committed stack is the parent's.
    assert_eq!(me.participant().view().option, 1);
    until(&me, "the parent", Duration::from_secs(10), |v| {
        v.members.len() == 2
    })
    .await;
    me.send([Bytes::from_static(b"from the child process")])
        .await
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), me.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, "from the parent");
    println!("{CHILD_READY}");
    std::future::pending::<()>().await;
}

/// The store loses the group (`lose`: a Redis without persistence restarting, here its data
/// flushed) after a switch to epoch 2: the members re-create it at an epoch above any they
/// held (never at 1 again, where a member that lagged could still run the old stack), end on
/// one epoch and one stack, and exchange messages both ways.
pub async fn store_loses_the_group<St, L, Fut>(store: Arc<St>, lose: L)
where
    St: Store,
    L: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    let group = unique("lost");
    let a = join(store.clone(), &group, "a", select(Xor(1), Xor(2)))
        .await
        .unwrap();
    let b = join(store.clone(), &group, "b", select(Xor(1), Xor(2)))
        .await
        .unwrap();
    for g in [&a, &b] {
        until(g, "2 members", Duration::from_secs(5), |v| {
            v.members.len() == 2
        })
        .await;
    }
    a.propose(1).await.unwrap();
    for g in [&a, &b] {
        until(g, "epoch 2", Duration::from_secs(5), |v| v.epoch == 2).await;
    }
    exchange(&a, &[&b], "before the loss").await;
    lose().await;
    for g in [&a, &b] {
        until(
            g,
            "a re-created group above epoch 2 with both members",
            Duration::from_secs(15),
            |v| v.epoch > 2 && v.members.len() == 2,
        )
        .await;
    }
    let (va, vb) = (a.participant().view(), b.participant().view());
    assert_eq!(
        (va.epoch, va.option),
        (vb.epoch, vb.option),
        "split after the loss"
    );
    exchange(&a, &[&b], "after the loss").await;
    exchange(&b, &[&a], "and back").await;
}

/// A configuration that reads the record only every `poll` without notifications and every
/// `poll_notified` with them (long intervals show whether notifications carry a change).
pub fn polling(poll: Duration, poll_notified: Duration) -> Config {
    Config {
        lease: Duration::from_secs(3),
        renew_every: Duration::from_secs(1),
        poll,
        poll_notified,
        transition_timeout: Duration::from_secs(10),
        ..Config::default()
    }
}

/// `n` members of a new group, each with its own store from `connect`, joined one after the
/// other; returns once every member sees all `n` (within `limit`).
pub async fn members<St, F, Fut>(
    connect: F,
    group: &str,
    n: usize,
    config: &Config,
    limit: Duration,
) -> Vec<Group<Stack>>
where
    St: Store,
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<St>>,
{
    let mut groups = Vec::new();
    for i in 0..n {
        let stack = select(Xor(1), Xor(2));
        let g = Group::join(
            connect().await,
            group,
            &format!("m{i:02}"),
            any_port(),
            stack,
            None,
            config.clone(),
        )
        .await
        .unwrap_or_else(|e| panic!("member {i} could not join: {e}"));
        groups.push(g);
    }
    for g in &groups {
        until(g, &format!("{n} members seen"), limit, |v| {
            v.members.len() == n
        })
        .await;
    }
    groups
}

/// The first member proposes a switch to its other option; every member must be at the new
/// epoch within `limit` of the proposal. Returns how long the proposal took to commit.
pub async fn switch_within(groups: &[Group<Stack>], limit: Duration) -> Duration {
    let proposer = &groups[0];
    let view = proposer.participant().view();
    let to = 1 - view.option;
    let target = view.epoch + 1;
    let started = Instant::now();
    tokio::time::timeout(limit, proposer.propose(to))
        .await
        .unwrap_or_else(|_| panic!("the proposal did not commit within {limit:?}"))
        .unwrap_or_else(|e| panic!("the proposal failed: {e}"));
    let committed = started.elapsed();
    for g in groups {
        let left = limit.saturating_sub(started.elapsed());
        until(g, &format!("epoch {target}"), left, |v| v.epoch == target).await;
    }
    committed
}

/// With both poll intervals far longer than the test (30 s), members notice joins and switch
/// through three transitions, each seen by every member within 2 s: only notifications can
/// carry that (without them, a member reads the record once when it starts and then after
/// 30 s). `connect` gives each member its own store (a process of its own would).
pub async fn switches_by_notification<St, F, Fut>(connect: F, n: usize)
where
    St: Store,
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<St>>,
{
    let slow = Duration::from_secs(30);
    let config = polling(slow, slow);
    let started = Instant::now();
    let groups = members(
        connect,
        &unique("notified"),
        n,
        &config,
        Duration::from_secs(3),
    )
    .await;
    for round in 0..3 {
        let took = switch_within(&groups, Duration::from_secs(2)).await;
        eprintln!("round {round}: {n} members committed in {took:?}");
    }
    assert!(
        started.elapsed() < slow,
        "the test ran past the poll interval, so polling may have carried it"
    );
    for g in groups {
        g.leave().await.unwrap();
    }
}
