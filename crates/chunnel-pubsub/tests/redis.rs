//! Redis Streams against a real redis-server (started here on a free port, stopped by PID).
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use chunnel_pubsub::redis::RedisBroker;
use support::{Scratch, scenarios};

fn broker(url: &str, op: Duration) -> RedisBroker {
    RedisBroker::new(url).unwrap().op_timeout(op)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_concurrent_publishers() {
    let scratch = Scratch::new("ps-redis");
    let (_server, url) = support::redis(&scratch);
    scenarios::concurrent_publishers(broker(&url, Duration::from_secs(5))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_group_split() {
    let scratch = Scratch::new("ps-redis");
    let (_server, url) = support::redis(&scratch);
    scenarios::group_split(broker(&url, Duration::from_secs(5))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_mid_stream() {
    let scratch = Scratch::new("ps-redis");
    let (mut server, url) = support::redis(&scratch);
    scenarios::restart_mid_stream(
        broker(&url, Duration::from_secs(2)),
        &mut server,
        Duration::from_secs(10),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_dead_broker() {
    let scratch = Scratch::new("ps-redis");
    let (mut server, url) = support::redis(&scratch);
    scenarios::dead_broker(broker(&url, Duration::from_secs(1)), &mut server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_slow_consumer() {
    let scratch = Scratch::new("ps-redis");
    let (_server, url) = support::redis(&scratch);
    scenarios::slow_consumer(broker(&url, Duration::from_secs(5))).await;
}

#[cfg(feature = "group")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_ordering_switch() {
    let scratch = Scratch::new("ps-redis");
    let (_server, url) = support::redis(&scratch);
    support::order::ordering_switch(broker(&url, Duration::from_secs(5)), &scratch).await;
}

#[cfg(feature = "group")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cancelled_bursts_are_resent() {
    let scratch = Scratch::new("ps-redis");
    let (_server, url) = support::redis(&scratch);
    support::order::cancelled_bursts_are_resent(broker(&url, Duration::from_secs(5))).await;
}

#[cfg(feature = "group")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_during_ordering_switch() {
    let scratch = Scratch::new("ps-redis");
    let (mut server, url) = support::redis(&scratch);
    support::order::restart_during_switch(
        broker(&url, Duration::from_secs(2)),
        &mut server,
        &scratch,
        Duration::from_secs(2),
        Duration::from_secs(10),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_at_most_once_takeover() {
    let scratch = Scratch::new("ps-redis");
    let (_server, url) = support::redis(&scratch);
    scenarios::at_most_once_takeover(broker(&url, Duration::from_secs(5)), Duration::from_secs(1))
        .await;
}

#[cfg(feature = "group")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_slow_receiver_across_switch() {
    let scratch = Scratch::new("ps-redis");
    let (_server, url) = support::redis(&scratch);
    support::order::slow_receiver_across_switch(broker(&url, Duration::from_secs(5)), &scratch)
        .await;
}

#[cfg(feature = "group")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_ordered_backlog_bound() {
    let scratch = Scratch::new("ps-redis");
    let (mut server, url) = support::redis(&scratch);
    support::order::backlog_bound(
        broker(&url, Duration::from_secs(1)),
        &mut server,
        Duration::from_secs(10),
    )
    .await;
}
