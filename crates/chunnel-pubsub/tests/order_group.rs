//! The ordering group on an embedded SQLite rendezvous store, without a broker: members with
//! another lane count are refused, and a member following the group switches it as receivers
//! join and leave.
#![cfg(feature = "group")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use chunnel_pubsub::Error;
use chunnel_pubsub::order::{self, Mode, Role};
use chunnel_rendezvous::SqliteStore;
use chunnel_test::services::Scratch;

fn config() -> chunnel_rendezvous::Config {
    chunnel_rendezvous::Config {
        poll: Duration::from_millis(10),
        ..chunnel_rendezvous::Config::default()
    }
}

async fn until(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_lane_count_is_refused() {
    let scratch = Scratch::new("order-group");
    let store = Arc::new(SqliteStore::open(scratch.0.join("g.sqlite")).unwrap());
    let p = order::join(
        store.clone(),
        "t",
        Role::Publisher,
        "p",
        4,
        Mode::Service,
        config(),
    )
    .await
    .unwrap();
    // Preferring the other mode is fine: it joins the committed one.
    let r = order::join(
        store.clone(),
        "t",
        Role::Receiver,
        "r",
        4,
        Mode::Receiver,
        config(),
    )
    .await
    .unwrap();
    assert_eq!(r.mode(), Mode::Service);
    let odd = order::join(
        store,
        "t",
        Role::Receiver,
        "odd",
        2,
        Mode::Service,
        config(),
    )
    .await;
    match odd {
        Err(Error::Rendezvous(chunnel_rendezvous::Error::Incompatible { .. })) => {}
        other => panic!("a member with 2 lanes joined a 4-lane group: {other:?}"),
    }
    r.leave().await.unwrap();
    p.leave().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_switches_as_receivers_come_and_go() {
    let scratch = Scratch::new("order-group");
    let store = Arc::new(SqliteStore::open(scratch.0.join("g.sqlite")).unwrap());
    let join = |role, name: &'static str| {
        order::join(store.clone(), "t", role, name, 4, Mode::Service, config())
    };
    let p = join(Role::Publisher, "p").await.unwrap();
    let other = join(Role::Publisher, "q").await.unwrap();
    let follower = p.follow(order::by_receivers);
    let r1 = join(Role::Receiver, "r1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(p.mode(), Mode::Service, "one receiver: service-side");
    let r2 = join(Role::Receiver, "r2").await.unwrap();
    until("receiver-side at every member", || {
        [&p, &other, &r1, &r2]
            .iter()
            .all(|g| g.mode() == Mode::Receiver)
    })
    .await;
    let epoch = p.epoch();
    r2.leave().await.unwrap();
    until("service-side again", || {
        [&p, &other, &r1].iter().all(|g| g.mode() == Mode::Service)
    })
    .await;
    assert!(p.epoch() > epoch);
    assert!(!follower.is_finished());
    // Dropping the group ends the follower.
    drop(p);
    tokio::time::timeout(Duration::from_secs(5), follower)
        .await
        .expect("the follower outlived its group")
        .unwrap();
}
