//! `chunnel-bench etl`: the ETL application's end-to-end latency (producer stamp → consumer)
//! against offered load, per broker (Kafka, NATS JetStream), through the whole pipeline of
//! `chunnel-etl` (producers → two load-balanced ingest servers → broker → two parsers →
//! consumer; needs the feature `pubsub`). Each broker is started once on free loopback ports
//! and stopped by PID; each offered load is a fresh pipeline on a fresh topic. The same
//! measurement is `chunnel-etl bench`.

use std::time::Duration;

use anyhow::Result;
use chunnel_etl::BrokerKind;

#[derive(clap::Args, Clone, Debug)]
pub(crate) struct Args {
    /// Brokers, comma separated: kafka, nats, redis.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "kafka,nats")]
    brokers: Vec<BrokerKind>,
    /// Offered loads, records per second (all producers together).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "500,1000,2000,4000,8000,16000"
    )]
    rates: Vec<f64>,
    /// Seconds each offered load runs.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// Producers.
    #[arg(long, default_value_t = 4)]
    producers: usize,
    /// Records per producer batch (the paper: 16 records per interarrival time).
    #[arg(long, default_value_t = 16)]
    batch: usize,
}

pub(crate) fn run(a: Args) -> Result<()> {
    let cfg = chunnel_etl::bench::BenchConfig {
        brokers: a.brokers,
        rates: a.rates,
        pipeline: chunnel_etl::PipelineConfig {
            producers: a.producers,
            batch: a.batch,
            duration: Duration::from_secs_f64(a.secs),
            ..chunnel_etl::PipelineConfig::default()
        },
    };
    if !cfg!(feature = "pubsub") {
        anyhow::bail!("chunnel-bench was built without the feature `pubsub` (--features pubsub)");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let out = rt.block_on(chunnel_etl::bench::sweep(&cfg))?;
    println!("{out}");
    Ok(())
}
