//! Direct ballots (docs/wire.md §15.4) against a real store, generic over the backend.
//!
//! Where a scenario must show that ballots travelled as datagrams, the members' store
//! fallback is set far beyond the transition's deadline: a commit then needs their
//! datagrams. Where it must show the fallback, their datagrams are never sent.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use chunnel::negotiate::{Capability, ChunnelInfo, Pick, StackOption};
use chunnel_rendezvous::ballot::DirectBallot;
use chunnel_rendezvous::{Ballot, Config, Error, Member, Participant, Store};

use super::scenarios::unique;

/// Longer than any transition here: a member with it never falls back to the store in time.
const NEVER: Duration = Duration::from_secs(600);

fn option(label: &'static str, branch: u8) -> StackOption {
    StackOption {
        chunnels: vec![ChunnelInfo {
            id: "test/direct/1".into(),
            capabilities: vec![Capability::exact("mode", [label])],
        }],
        pick: Pick::from_branches(vec![branch]),
    }
}

fn offers() -> Vec<StackOption> {
    vec![option("one", 0), option("two", 1)]
}

/// A participant's timing; with a ballot socket if `fallback` is set (after which it writes its
/// ballot to the store), not sending its first `drop_first` datagrams.
fn config(fallback: Option<Duration>, drop_first: u32, timeout: Duration) -> Config {
    let c = Config {
        lease: Duration::from_secs(4),
        renew_every: Duration::from_secs(1),
        poll: Duration::from_millis(20),
        transition_timeout: timeout,
        ..Config::default()
    };
    match fallback {
        None => c,
        Some(fallback) => {
            let mut c = c.with_direct_ballots(SocketAddr::from(([127, 0, 0, 1], 0)));
            let d = c.direct_ballots.as_mut().expect("just set");
            d.fallback = fallback;
            d.drop_first = drop_first;
            c
        }
    }
}

async fn join<St: Store>(store: Arc<St>, group: &str, id: &str, config: Config) -> Participant {
    let me = Member {
        id: id.to_owned(),
        addr: "127.0.0.1:1".to_owned(),
    };
    Participant::join(store, group, me, offers(), None, config)
        .await
        .unwrap_or_else(|e| panic!("{id} could not join {group}: {e}"))
}

/// Waits (bounded) until `p` sees `n` members.
async fn sees(p: &Participant, n: usize) {
    let mut w = p.watch();
    tokio::time::timeout(Duration::from_secs(30), async {
        while w.borrow_and_update().members.len() != n {
            w.changed().await.unwrap();
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{} never saw {n} members: {:?}", p.id(), p.view()));
}

/// Waits (bounded) until every one of `ps` is at `epoch`.
async fn all_at(ps: &[Participant], epoch: u64) {
    for p in ps {
        let mut w = p.watch();
        tokio::time::timeout(Duration::from_secs(30), async {
            while w.borrow_and_update().epoch != epoch {
                w.changed().await.unwrap();
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{} never reached epoch {epoch}: {:?}", p.id(), p.view()));
    }
}

async fn leave_all(ps: Vec<Participant>) {
    for p in ps {
        p.leave().await.unwrap();
    }
}

/// Every direct-ballot scenario, each in a group of its own; `connect` gives each participant
/// its own store client.
pub async fn direct_ballots<St, F, Fut>(connect: F)
where
    St: Store,
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<St>>,
{
    commit_by_datagrams(&connect, 16).await;
    lost_datagrams_fall_back_to_the_store(&connect).await;
    forged_ballots_are_ignored(&connect).await;
    mixed_group(&connect).await;
    a_dead_member_aborts_at_the_deadline(&connect).await;
}

/// `n` members with ballot sockets and no store fallback in time: two commits in a row (two
/// tokens) go through on datagrams alone, and every member follows.
pub async fn commit_by_datagrams<St, F, Fut>(connect: &F, n: usize)
where
    St: Store,
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<St>>,
{
    let group = unique("direct-commit");
    let timeout = Duration::from_secs(20);
    let mut ps = Vec::new();
    for i in 0..n {
        ps.push(
            join(
                connect().await,
                &group,
                &format!("m{i:02}"),
                config(Some(NEVER), 0, timeout),
            )
            .await,
        );
    }
    sees(&ps[0], n).await;
    ps[0].propose(1).await.expect("a commit on direct ballots");
    all_at(&ps, 2).await;
    ps[0]
        .propose(0)
        .await
        .expect("a second commit (a new token)");
    all_at(&ps, 3).await;
    assert_eq!(ps[n - 1].view().option, 0);
    leave_all(ps).await;
}

/// Two members never send their datagrams (and fall back to the store after 100 ms), a third
/// sends them (and never falls back): the transition commits on both paths at once.
async fn lost_datagrams_fall_back_to_the_store<St, F, Fut>(connect: &F)
where
    St: Store,
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<St>>,
{
    let group = unique("direct-lost");
    let timeout = Duration::from_secs(20);
    let fast_fallback = Some(Duration::from_millis(100));
    let ps = vec![
        join(
            connect().await,
            &group,
            "p",
            config(Some(NEVER), 0, timeout),
        )
        .await,
        join(
            connect().await,
            &group,
            "lossy1",
            config(fast_fallback, u32::MAX, timeout),
        )
        .await,
        join(
            connect().await,
            &group,
            "lossy2",
            config(fast_fallback, u32::MAX, timeout),
        )
        .await,
        join(
            connect().await,
            &group,
            "sender",
            config(Some(NEVER), 0, timeout),
        )
        .await,
    ];
    sees(&ps[0], 4).await;
    ps[0].propose(1).await.expect("the store fallback commits");
    all_at(&ps, 2).await;
    leave_all(ps).await;
}

/// A member that never votes by itself; a datagram in its name with a wrong token does not
/// count (the transition times out), one with the transition's token does (it commits).
async fn forged_ballots_are_ignored<St, F, Fut>(connect: &F)
where
    St: Store,
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<St>>,
{
    let group = unique("direct-forged");
    let reader = connect().await;
    let p = Arc::new(
        join(
            connect().await,
            &group,
            "p",
            config(Some(NEVER), 0, Duration::from_secs(2)),
        )
        .await,
    );
    let mute = join(
        connect().await,
        &group,
        "mute",
        config(Some(NEVER), u32::MAX, Duration::from_secs(2)),
    )
    .await;
    sees(&p, 2).await;
    let forger = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    for (flip, commits) in [(1u128, false), (0, true)] {
        let proposer = p.clone();
        let to = if p.view().option == 0 { 1 } else { 0 };
        let outcome = tokio::spawn(async move { proposer.propose(to).await });
        // The pending transition, as the store holds it.
        let t = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Ok(s) = reader.snapshot(&group).await
                    && let Some(t) = s.transition
                {
                    return t;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the proposal reaches the store");
        let bb = t.ballot_box.expect("the proposer named its ballot box");
        let forged = DirectBallot {
            token: bb.token ^ flip,
            group: group.clone(),
            id: t.id,
            from_epoch: t.from_epoch,
            member: "mute".into(),
            ballot: Ballot::Yes,
        };
        forger.send_to(&forged.encode(), bb.addr).await.unwrap();
        match (outcome.await.unwrap(), commits) {
            (Ok(()), true) => {}
            (Err(Error::Aborted { reason, .. }), false) => {
                assert!(reason.contains("no vote from mute"), "{reason}")
            }
            (other, _) => panic!("token flipped by {flip}: {other:?}"),
        }
    }
    mute.leave().await.unwrap();
    p.leave().await.unwrap();
}

/// Half the members have ballot sockets (and no store fallback in time), half have none: a
/// proposal from either half commits.
async fn mixed_group<St, F, Fut>(connect: &F)
where
    St: Store,
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<St>>,
{
    let group = unique("direct-mixed");
    let timeout = Duration::from_secs(20);
    let mut ps = Vec::new();
    for i in 0..8 {
        let fallback = (i % 2 == 0).then_some(NEVER);
        ps.push(
            join(
                connect().await,
                &group,
                &format!("m{i}"),
                config(fallback, 0, timeout),
            )
            .await,
        );
    }
    sees(&ps[0], 8).await;
    sees(&ps[1], 8).await;
    // m0 has a ballot box: the even members' ballots can only arrive as datagrams.
    ps[0]
        .propose(1)
        .await
        .expect("a commit proposed with a ballot box");
    all_at(&ps, 2).await;
    // m1 has none: every member votes in the store.
    ps[1]
        .propose(0)
        .await
        .expect("a commit proposed without a ballot box");
    all_at(&ps, 3).await;
    leave_all(ps).await;
}

/// A member dies (its lease still runs) while a transition waits for its ballot: the
/// proposer aborts at the deadline, naming it, and the group stays on its stack.
async fn a_dead_member_aborts_at_the_deadline<St, F, Fut>(connect: &F)
where
    St: Store,
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<St>>,
{
    let group = unique("direct-dead");
    let timeout = Duration::from_secs(1);
    let p = join(
        connect().await,
        &group,
        "p",
        config(Some(NEVER), 0, timeout),
    )
    .await;
    let alive = join(
        connect().await,
        &group,
        "alive",
        config(Some(NEVER), 0, timeout),
    )
    .await;
    let dead = join(
        connect().await,
        &group,
        "dead",
        config(Some(NEVER), 0, timeout),
    )
    .await;
    sees(&p, 3).await;
    drop(dead);
    match p.propose(1).await {
        Err(Error::Aborted { reason, .. }) => {
            assert!(reason.ends_with("no vote from dead"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(p.view().epoch, 1);
    assert_eq!(alive.view().epoch, 1);
    alive.leave().await.unwrap();
    p.leave().await.unwrap();
}
