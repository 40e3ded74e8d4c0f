//! Kafka 4.1 (KRaft) against a real broker: the jars come from Maven Central
//! (scripts/kafka/fetch.sh, cached); the broker is started here on free ports and stopped by
//! PID. One broker serves every scenario in turn (a JVM start costs seconds).
#![cfg(feature = "kafka")]

mod support;

use std::time::Duration;

use chunnel_pubsub::kafka::KafkaBroker;
use support::{Scratch, scenarios};

async fn broker(addr: &str, partitions: i32, op: Duration) -> KafkaBroker {
    KafkaBroker::connect(vec![addr.to_owned()], partitions, op)
        .await
        .expect("connect to kafka")
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
