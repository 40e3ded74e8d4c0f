//! The pipeline against a real Kafka 4.1 (KRaft; jars from Maven Central through
//! scripts/kafka/fetch.sh, cached), started here on free ports and stopped by PID. One broker
//! serves every scenario (a JVM start costs seconds).
#![cfg(feature = "kafka")]

mod support;

use chunnel_etl::BrokerKind;
use chunnel_test::services::Scratch;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_pipeline() {
    let scratch = Scratch::new("etl-kafka");
    let (_server, addr) = chunnel_test::brokers::kafka(&scratch);
    eprintln!("kafka: end to end over shared memory");
    support::end_to_end(BrokerKind::Kafka, &addr, true).await;
    eprintln!("kafka: end to end over UDP");
    support::end_to_end(BrokerKind::Kafka, &addr, false).await;
    eprintln!("kafka: an ingest server killed");
    support::ingest_killed(BrokerKind::Kafka, &addr, true).await;
}
