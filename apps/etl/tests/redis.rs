//! The pipeline against a real redis-server (append-only file, fsynced), started here on a
//! free port and stopped by PID.
#![cfg(feature = "redis")]

mod support;

use chunnel_etl::BrokerKind;
use chunnel_test::services::Scratch;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_pipeline() {
    let scratch = Scratch::new("etl-redis");
    let (_server, url) = chunnel_test::brokers::redis(&scratch);
    support::end_to_end(BrokerKind::Redis, &url, true).await;
    support::ingest_killed(BrokerKind::Redis, &url, false).await;
}
