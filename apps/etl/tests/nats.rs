//! The pipeline against a real nats-server with JetStream, started here on a free port and
//! stopped by PID.
#![cfg(feature = "nats")]

mod support;

use chunnel_etl::BrokerKind;
use chunnel_test::services::Scratch;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_end_to_end() {
    let scratch = Scratch::new("etl-nats");
    let (_server, addr) = chunnel_test::brokers::nats(&scratch);
    support::end_to_end(BrokerKind::Nats, &addr, true).await;
    support::end_to_end(BrokerKind::Nats, &addr, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_ingest_killed_shm() {
    let scratch = Scratch::new("etl-nats");
    let (_server, addr) = chunnel_test::brokers::nats(&scratch);
    support::ingest_killed(BrokerKind::Nats, &addr, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_ingest_killed_udp() {
    let scratch = Scratch::new("etl-nats");
    let (_server, addr) = chunnel_test::brokers::nats(&scratch);
    support::ingest_killed(BrokerKind::Nats, &addr, false).await;
}
