//! Kafka 4.1 (KRaft) against a real broker: the jars come from Maven Central
//! (scripts/kafka/fetch.sh, cached); the broker is started here on free ports and stopped by
//! PID. One broker serves every scenario in turn (a JVM start costs seconds).
#![cfg(feature = "kafka")]

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection};
use chunnel_pubsub::kafka::KafkaBroker;
use chunnel_pubsub::kafka::rskafka::client::partition::UnknownTopicHandling;
use chunnel_pubsub::{Config, Delivery, Member, Publish, Subscribe};
use support::{Scratch, scenarios, unique};

async fn broker(addr: &str, partitions: i32, op: Duration) -> KafkaBroker {
    KafkaBroker::connect(vec![addr.to_owned()], partitions, op)
        .await
        .expect("connect to kafka")
}

/// Records deleted under a group's committed position (retention, `DeleteRecords`): the next
/// member reads on from the earliest record left instead of failing on every fetch.
async fn deleted_records_are_skipped(broker: KafkaBroker) {
    let topic = unique("deleted");
    let cfg = |delivery| Config {
        prefetch: 8,
        delivery,
        ..scenarios::config(Duration::from_secs(20))
    };
    let publisher = Publish::new(broker.clone(), &topic, cfg(Delivery::AtLeastOnce))
        .connect_wrap(())
        .await
        .expect("publisher");
    let payload = |i: usize| Bytes::from(format!("d{i:03}"));
    for b in 0..10 {
        publisher
            .send((0..10).map(|k| payload(b * 10 + k)))
            .await
            .expect("publish");
    }
    // A member reads about 20 at most once: its position is committed before it sees them.
    let member = Member::nth("del", 0, 1);
    let first = Subscribe::new(
        broker.clone(),
        &topic,
        member.clone(),
        cfg(Delivery::AtMostOnce),
    )
    .connect_wrap(())
    .await
    .expect("subscribe");
    let read = scenarios::Counts::default();
    let wait = Duration::from_secs(20);
    scenarios::collect(&first, &read, 20, wait, Duration::ZERO).await;
    let read = read.lock().unwrap().len();
    assert!((20..50).contains(&read), "the first member read {read}");
    drop(first);
    // Everything before offset 50 is deleted, under the committed position.
    let part = broker
        .client()
        .partition_client(&topic, 0, UnknownTopicHandling::Retry)
        .await
        .expect("partition client");
    part.delete_records(50, 10_000)
        .await
        .expect("delete records");
    let next = Subscribe::new(broker, &topic, member, cfg(Delivery::AtLeastOnce))
        .connect_wrap(())
        .await
        .expect("subscribe");
    let got = scenarios::Counts::default();
    scenarios::collect(&next, &got, 50, wait, Duration::ZERO).await;
    let got = got.lock().unwrap();
    let want: BTreeSet<Bytes> = (50..100).map(payload).collect();
    assert_eq!(
        got.keys().cloned().collect::<BTreeSet<_>>(),
        want,
        "after the deletion the group reads exactly what is left"
    );
    assert!(got.values().all(|n| *n == 1), "nothing twice: {got:?}");
    eprintln!("deleted records: first member read {read}, the next one the 50 left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_scenarios() {
    let scratch = Scratch::new("ps-kafka");
    let (mut server, addr) = support::kafka(&scratch);
    eprintln!("kafka: concurrent publishers");
    scenarios::concurrent_publishers(broker(&addr, 1, Duration::from_secs(30)).await).await;
    eprintln!("kafka: group split (2 partitions)");
    scenarios::group_split(broker(&addr, 2, Duration::from_secs(30)).await).await;
    #[cfg(feature = "group")]
    {
        eprintln!("kafka: ordering switch");
        support::order::ordering_switch(broker(&addr, 1, Duration::from_secs(30)).await, &scratch)
            .await;
    }
    #[cfg(feature = "group")]
    {
        eprintln!("kafka: slow receiver across an ordering switch");
        support::order::slow_receiver_across_switch(
            broker(&addr, 1, Duration::from_secs(30)).await,
            &scratch,
        )
        .await;
    }
    eprintln!("kafka: records deleted under a committed position");
    deleted_records_are_skipped(broker(&addr, 1, Duration::from_secs(30)).await).await;
    // The groups' positions outlive the broker's time retention: the offsets topic (created
    // by the first subscriber above) is compacted, as Kafka's own `__consumer_offsets`.
    let configs = chunnel_test::brokers::kafka_topic_configs(&addr, "chunnel-offsets");
    assert!(
        configs.contains("cleanup.policy=compact") && configs.contains("segment.ms=3600000"),
        "the offsets topic is not compacted in hour-long segments: {configs}"
    );
    eprintln!("kafka: slow consumer");
    scenarios::slow_consumer(broker(&addr, 1, Duration::from_secs(30)).await).await;
    eprintln!("kafka: restart mid-stream");
    scenarios::restart_mid_stream(
        broker(&addr, 1, Duration::from_secs(30)).await,
        &mut server,
        Duration::from_secs(60),
    )
    .await;
    eprintln!("kafka: at-most-once takeover (acknowledgements committed before the hand-out)");
    scenarios::at_most_once_takeover(
        broker(&addr, 1, Duration::from_secs(30)).await,
        Duration::from_secs(1),
    )
    .await;
    #[cfg(feature = "group")]
    {
        eprintln!("kafka: restart during an ordering switch");
        support::order::restart_during_switch(
            broker(&addr, 1, Duration::from_secs(5)).await,
            &mut server,
            &scratch,
            Duration::from_secs(5),
            Duration::from_secs(60),
        )
        .await;
    }
    eprintln!("kafka: dead broker");
    scenarios::dead_broker(broker(&addr, 1, Duration::from_secs(2)).await, &mut server).await;
}
