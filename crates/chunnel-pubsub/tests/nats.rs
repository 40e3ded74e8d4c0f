//! NATS JetStream against a real nats-server (started here on a free port, stopped by PID).
#![cfg(feature = "nats")]

mod support;

use std::time::Duration;

use chunnel_pubsub::nats::NatsBroker;
use support::{Scratch, scenarios};

async fn broker(addr: &str, op: Duration) -> NatsBroker {
    NatsBroker::connect(addr, op)
        .await
        .expect("connect to nats-server")
        .ack_wait(Duration::from_secs(2))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_concurrent_publishers() {
    let scratch = Scratch::new("ps-nats");
    let (_server, addr) = support::nats(&scratch);
    scenarios::concurrent_publishers(broker(&addr, Duration::from_secs(5)).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_group_split() {
    let scratch = Scratch::new("ps-nats");
    let (_server, addr) = support::nats(&scratch);
    scenarios::group_split(broker(&addr, Duration::from_secs(5)).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restart_mid_stream() {
    let scratch = Scratch::new("ps-nats");
    let (mut server, addr) = support::nats(&scratch);
    scenarios::restart_mid_stream(
        broker(&addr, Duration::from_secs(2)).await,
        &mut server,
        Duration::from_secs(10),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_dead_broker() {
    let scratch = Scratch::new("ps-nats");
    let (mut server, addr) = support::nats(&scratch);
    scenarios::dead_broker(broker(&addr, Duration::from_secs(1)).await, &mut server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_slow_consumer() {
    let scratch = Scratch::new("ps-nats");
    let (_server, addr) = support::nats(&scratch);
    scenarios::slow_consumer(broker(&addr, Duration::from_secs(5)).await).await;
}

#[cfg(feature = "group")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_ordering_switch() {
    let scratch = Scratch::new("ps-nats");
    let (_server, addr) = support::nats(&scratch);
    support::order::ordering_switch(broker(&addr, Duration::from_secs(5)).await, &scratch).await;
}

#[cfg(feature = "group")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_cancelled_bursts_are_resent() {
    let scratch = Scratch::new("ps-nats");
    let (_server, addr) = support::nats(&scratch);
    support::order::cancelled_bursts_are_resent(broker(&addr, Duration::from_secs(5)).await).await;
}

#[cfg(feature = "group")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restart_during_ordering_switch() {
    let scratch = Scratch::new("ps-nats");
    let (mut server, addr) = support::nats(&scratch);
    support::order::restart_during_switch(
        broker(&addr, Duration::from_secs(2)).await,
        &mut server,
        &scratch,
        Duration::from_secs(2),
        Duration::from_secs(10),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_at_most_once_takeover() {
    let scratch = Scratch::new("ps-nats");
    let (_server, addr) = support::nats(&scratch);
    // Past the 2 s ack_wait: anything unacknowledged is redelivered within it.
    scenarios::at_most_once_takeover(
        broker(&addr, Duration::from_secs(5)).await,
        Duration::from_secs(4),
    )
    .await;
}

#[cfg(feature = "group")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_slow_receiver_across_switch() {
    let scratch = Scratch::new("ps-nats");
    let (_server, addr) = support::nats(&scratch);
    support::order::slow_receiver_across_switch(
        broker(&addr, Duration::from_secs(5)).await,
        &scratch,
    )
    .await;
}

#[cfg(feature = "group")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_ordered_backlog_bound() {
    let scratch = Scratch::new("ps-nats");
    let (mut server, addr) = support::nats(&scratch);
    support::order::backlog_bound(
        broker(&addr, Duration::from_secs(1)).await,
        &mut server,
        Duration::from_secs(10),
    )
    .await;
}
