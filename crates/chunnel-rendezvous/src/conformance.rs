//! The semantics every [`Store`] backend must have, as one test routine each backend's tests
//! call against a real store (`tests/sqlite.rs`, `tests/redis.rs`, `tests/etcd.rs`).
//!
//! Panics (it is test code) with a message naming the broken rule.

use std::time::Duration;

use bytes::Bytes;

use crate::store::{Ballot, JoinReply, Member, Store, Transition, now_ms};

fn member(id: &str) -> Member {
    Member {
        id: id.to_owned(),
        addr: format!("127.0.0.1:{}", 40000 + id.len()),
    }
}

/// Runs every rule against `store`, on groups whose names start with `prefix` (unique per run,
/// so a shared store can be reused).
pub async fn store_semantics<S: Store>(store: &S, prefix: &str) {
    let lease = Duration::from_secs(30);
    let g = format!("{prefix}-basic");
    let a = Bytes::from_static(b"stack-a");
    let b = Bytes::from_static(b"stack-b");

    // An empty group: nothing to read, joining without a proposal writes nothing.
    let s = store
        .snapshot(&g)
        .await
        .expect("snapshot of an empty group");
    assert!(s.committed.is_none() && s.members.is_empty(), "empty group");
    match store
        .join(&g, &member("m1"), None, Some(1), lease)
        .await
        .unwrap()
    {
        JoinReply::Current(s) => assert!(s.committed.is_none()),
        other => panic!("joining a group with no stack and no proposal wrote: {other:?}"),
    }

    // The first proposal creates the group at epoch 1.
    match store
        .join(&g, &member("m1"), Some(&a), None, lease)
        .await
        .unwrap()
    {
        JoinReply::Created(s) => {
            assert_eq!(s.epoch(), 1);
            assert_eq!(s.committed.as_ref().unwrap().stack, a);
            assert_eq!(s.members, vec![member("m1")]);
        }
        other => panic!("the first proposal did not create the group: {other:?}"),
    }
    // A second proposal sees the committed stack and writes nothing.
    match store
        .join(&g, &member("m2"), Some(&b), None, lease)
        .await
        .unwrap()
    {
        JoinReply::Current(s) => {
            assert_eq!(s.committed.as_ref().unwrap().stack, a, "stack replaced");
            assert!(!s.is_member("m2"), "a losing proposer was added");
        }
        other => panic!("a second proposal was not refused: {other:?}"),
    }
    // Joining at a wrong epoch writes nothing; at the right one adds the member.
    assert!(matches!(
        store
            .join(&g, &member("m2"), None, Some(7), lease)
            .await
            .unwrap(),
        JoinReply::Current(_)
    ));
    match store
        .join(&g, &member("m2"), None, Some(1), lease)
        .await
        .unwrap()
    {
        JoinReply::Joined(s) => assert_eq!(s.members, vec![member("m1"), member("m2")]),
        other => panic!("joining at the committed epoch failed: {other:?}"),
    }
    assert!(store.renew(&g, "m2", lease).await.unwrap());
    assert!(!store.renew(&g, "nobody", lease).await.unwrap());

    // Transitions: one pending at a time, only from the committed epoch.
    let t = Transition {
        id: 0xfeed_beef_0000_0001,
        from_epoch: 1,
        proposer: "m1".into(),
        stack: b.clone(),
        deadline_ms: now_ms() + 60_000,
        ballot_box: None,
    };
    assert!(
        !store
            .propose(
                &g,
                &Transition {
                    from_epoch: 2,
                    ..t.clone()
                }
            )
            .await
            .unwrap(),
        "a transition from a wrong epoch was recorded"
    );
    assert!(store.propose(&g, &t).await.unwrap(), "proposal refused");
    assert!(
        !store
            .propose(&g, &Transition { id: 2, ..t.clone() })
            .await
            .unwrap(),
        "a second pending transition was recorded"
    );
    assert!(store.vote(&g, t.id, "m1", &Ballot::Yes).await.unwrap());
    assert!(!store.vote(&g, 99, "m2", &Ballot::Yes).await.unwrap());
    assert!(
        store
            .vote(&g, t.id, "m2", &Ballot::No("not now".into()))
            .await
            .unwrap()
    );
    let s = store.snapshot(&g).await.unwrap();
    assert_eq!(s.transition.as_ref(), Some(&t));
    assert_eq!(
        s.ballots,
        vec![
            ("m1".to_owned(), Ballot::Yes),
            ("m2".to_owned(), Ballot::No("not now".into()))
        ]
    );
    // Abort: the stack stays, the outcome says so.
    assert!(store.finish(&g, t.id, false).await.unwrap());
    assert!(
        !store.finish(&g, t.id, true).await.unwrap(),
        "finished twice"
    );
    let s = store.snapshot(&g).await.unwrap();
    assert_eq!(s.epoch(), 1);
    assert_eq!(s.committed.as_ref().unwrap().stack, a);
    assert!(s.transition.is_none() && s.ballots.is_empty());
    assert_eq!(s.outcome.map(|o| (o.id, o.committed)), Some((t.id, false)));
    // Commit: epoch 2 with the new stack.
    let t2 = Transition { id: 3, ..t.clone() };
    assert!(store.propose(&g, &t2).await.unwrap());
    assert!(store.vote(&g, 3, "m2", &Ballot::Yes).await.unwrap());
    // Not every live member said yes (m1 has not voted): the commit is refused, nothing
    // written, the transition still pending.
    assert!(
        !store.finish(&g, 3, true).await.unwrap(),
        "committed without m1's yes"
    );
    let s = store.snapshot(&g).await.unwrap();
    assert_eq!((s.epoch(), s.transition.as_ref()), (1, Some(&t2)));
    assert!(store.vote(&g, 3, "m1", &Ballot::Yes).await.unwrap());
    // A member joining after the votes has had no say: refused again until it votes.
    store
        .join(&g, &member("m3"), None, Some(1), lease)
        .await
        .unwrap();
    assert!(
        !store.finish(&g, 3, true).await.unwrap(),
        "committed without the yes of m3, which joined after the votes"
    );
    assert!(store.vote(&g, 3, "m3", &Ballot::Yes).await.unwrap());
    assert!(store.finish(&g, 3, true).await.unwrap());
    let s = store.snapshot(&g).await.unwrap();
    assert_eq!(s.epoch(), 2);
    assert_eq!(s.committed.as_ref().unwrap().stack, b);
    assert_eq!(s.outcome.map(|o| (o.id, o.committed)), Some((3, true)));
    assert!(s.ballots.is_empty(), "ballots outlived their transition");
    // Direct ballots (docs/wire.md §15.4): the ballot box is stored with the transition, and a
    // commit counts the proposer's attested yes ballots, but never for a live member that is
    // neither attested nor voted yes in the store.
    let t4 = Transition {
        id: 4,
        from_epoch: 2,
        stack: a.clone(),
        ballot_box: Some(crate::ballot::BallotBox {
            addr: "[::1]:4000".parse().expect("an address"),
            token: u128::MAX - 5,
        }),
        ..t.clone()
    };
    assert!(store.propose(&g, &t4).await.unwrap());
    assert_eq!(
        store.snapshot(&g).await.unwrap().transition,
        Some(t4.clone())
    );
    assert!(store.vote(&g, 4, "m3", &Ballot::Yes).await.unwrap());
    let attested = |ids: &[&str]| ids.iter().map(|m| (*m).to_owned()).collect::<Vec<_>>();
    assert!(
        !store
            .finish_attested(&g, 4, true, &attested(&["m1"]))
            .await
            .unwrap(),
        "committed without the yes of m2 (neither attested nor stored)"
    );
    assert!(
        store
            .finish_attested(&g, 4, true, &attested(&["m1", "m2"]))
            .await
            .unwrap(),
        "m1 and m2 attested, m3 voted yes in the store: the commit was refused"
    );
    let s = store.snapshot(&g).await.unwrap();
    assert_eq!((s.epoch(), &s.committed.as_ref().unwrap().stack), (3, &a));
    assert!(s.transition.is_none());

    // A group created at a given epoch (re-created after the store lost it) starts there,
    // and only creation uses it.
    let g3 = format!("{prefix}-recreated");
    match store
        .join_creating_at(&g3, &member("m1"), Some(&a), None, 1 << 50, lease)
        .await
        .unwrap()
    {
        JoinReply::Created(s) => assert_eq!(s.epoch(), 1 << 50),
        other => panic!("not created: {other:?}"),
    }
    match store
        .join_creating_at(&g3, &member("m2"), Some(&b), Some(1 << 50), 7, lease)
        .await
        .unwrap()
    {
        JoinReply::Joined(s) => assert_eq!((s.epoch(), &s.committed.unwrap().stack), (1 << 50, &a)),
        other => panic!("not joined: {other:?}"),
    }

    // A lease longer than the store keeps (even `Duration::MAX`) is capped, never wrapped
    // into one long past: the member is live.
    store
        .join(&g, &member("forever"), None, Some(3), Duration::MAX)
        .await
        .unwrap();
    assert!(store.snapshot(&g).await.unwrap().is_member("forever"));
    assert!(store.renew(&g, "forever", Duration::MAX).await.unwrap());
    assert!(store.snapshot(&g).await.unwrap().is_member("forever"));
    store.leave(&g, "forever").await.unwrap();

    // Leaving removes the member at once; leaving twice is fine.
    store.leave(&g, "m2").await.unwrap();
    store.leave(&g, "m2").await.unwrap();
    store.leave(&g, "m3").await.unwrap();
    let s = store.snapshot(&g).await.unwrap();
    assert_eq!(s.members, vec![member("m1")]);

    // Names the stores cannot hold are refused.
    assert!(
        store
            .join(&g, &member("a/b"), None, Some(3), lease)
            .await
            .is_err()
    );

    // Leases: a member that stops renewing is gone after its lease.
    let g2 = format!("{prefix}-lease");
    store
        .join(&g2, &member("keeper"), Some(&a), None, lease)
        .await
        .unwrap();
    store
        .join(&g2, &member("short"), None, Some(1), Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(store.snapshot(&g2).await.unwrap().members.len(), 2);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = store.snapshot(&g2).await.unwrap();
        if !s.is_member("short") {
            assert!(s.is_member("keeper"));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a member whose 2 s lease ran out was still there after 10 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !store.renew(&g2, "short", lease).await.unwrap(),
        "an expired member renewed"
    );
}
