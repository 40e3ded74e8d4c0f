//! `chunnel-etl`: the ETL pipeline's roles, one by one or all in one process.
//!
//! ```text
//! chunnel-etl run --broker nats --rate 2000 --secs 5     # everything, broker started here
//! chunnel-etl consume --listen 127.0.0.1:7100
//! chunnel-etl ingest  --listen 127.0.0.1:7001 --broker nats --broker-addr 127.0.0.1:4222 --topic logs
//! chunnel-etl parse   --broker nats --broker-addr 127.0.0.1:4222 --topic logs --index 0 --count 2 --consumers 127.0.0.1:7100
//! chunnel-etl produce --ingest 127.0.0.1:7001,127.0.0.1:7002 --id 0 --rate 500 --secs 10
//! chunnel-etl bench   --brokers kafka,nats --rates 500,2000,8000 --out etl.json
//! ```
// Built without any broker feature, the broker roles only report `Error::NotBuilt`.
#![cfg_attr(
    not(any(feature = "kafka", feature = "nats", feature = "redis")),
    allow(unused_variables, unused_imports, dead_code)
)]

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use chunnel_etl::bench::{BenchConfig, sweep};
use chunnel_etl::hop::{HopSender, SenderConfig};
use chunnel_etl::pipeline::PipelineConfig;
use chunnel_etl::roles::{Acked, Consumer, Ingest, Parser, ProducerConfig, produce};
use chunnel_etl::{BrokerKind, Error, with_broker};
use chunnel_pubsub::{Config as PubsubConfig, Member};
use clap::{Parser as ClapParser, Subcommand};

#[derive(ClapParser, Debug)]
#[command(
    name = "chunnel-etl",
    about = "The ETL pipeline of the Bertha paper's §7.2 on Chunnels"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Debug, Clone)]
struct Shape {
    /// Producers.
    #[arg(long, default_value_t = 4)]
    producers: usize,
    /// Ingest servers.
    #[arg(long, default_value_t = 2)]
    ingests: usize,
    /// Parsers (one consumer group; Kafka: a partition each).
    #[arg(long, default_value_t = 2)]
    parsers: usize,
    /// Seconds the producers produce.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// Records per producer batch.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Every n-th record is a malformed line (0: none).
    #[arg(long, default_value_t = 50)]
    malformed_every: u64,
    /// Keep the point-to-point hops on UDP (do not offer shared memory).
    #[arg(long)]
    no_shm: bool,
}

impl Shape {
    fn config(&self, rate: f64) -> PipelineConfig {
        PipelineConfig {
            producers: self.producers,
            ingests: self.ingests,
            parsers: self.parsers,
            rate,
            duration: Duration::from_secs_f64(self.secs),
            batch: self.batch,
            malformed_every: self.malformed_every,
            shm: !self.no_shm,
            ..PipelineConfig::default()
        }
    }
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The whole pipeline in this process; starts the broker itself unless --broker-addr.
    Run {
        /// Which broker.
        #[arg(long, value_enum, default_value = "nats")]
        broker: BrokerKind,
        /// A running broker (`host:port`; Redis `redis://host:port/`).
        #[arg(long)]
        broker_addr: Option<String>,
        /// Records per second offered (all producers).
        #[arg(long, default_value_t = 2000.0)]
        rate: f64,
        #[command(flatten)]
        shape: Shape,
        /// Kill ingest server 0 this many seconds after the start.
        #[arg(long)]
        kill_ingest_after: Option<f64>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// An ingest server: producers' batches -> broker topic.
    Ingest {
        /// Address to serve on.
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long, value_enum)]
        broker: BrokerKind,
        #[arg(long)]
        broker_addr: String,
        /// Topic (Kafka: its partition count must equal the parsers').
        #[arg(long, default_value = "etl-logs")]
        topic: String,
        /// Kafka: partitions of the topic.
        #[arg(long, default_value_t = 2)]
        partitions: i32,
        #[arg(long)]
        no_shm: bool,
    },
    /// A parser: one member of the topic's consumer group -> consumers.
    Parse {
        #[arg(long, value_enum)]
        broker: BrokerKind,
        #[arg(long)]
        broker_addr: String,
        #[arg(long, default_value = "etl-logs")]
        topic: String,
        /// The consumer group.
        #[arg(long, default_value = "parsers")]
        group: String,
        /// This parser's index in the group.
        #[arg(long, default_value_t = 0)]
        index: u32,
        /// Parsers in the group (Kafka: partitions of the topic).
        #[arg(long, default_value_t = 2)]
        count: u32,
        /// Consumers to forward to (comma-separated; balanced).
        #[arg(long, value_delimiter = ',', required = true)]
        consumers: Vec<SocketAddr>,
        #[arg(long)]
        no_shm: bool,
    },
    /// The consumer: prints what it accounted for every second.
    Consume {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        no_shm: bool,
    },
    /// A producer: log lines -> ingest servers (balanced).
    Produce {
        /// Ingest servers (comma-separated).
        #[arg(long, value_delimiter = ',', required = true)]
        ingest: Vec<SocketAddr>,
        /// Producer id (unique among producers).
        #[arg(long, default_value_t = 0)]
        id: u32,
        #[arg(long, default_value_t = 500.0)]
        rate: f64,
        #[arg(long, default_value_t = 10.0)]
        secs: f64,
        #[arg(long, default_value_t = 16)]
        batch: usize,
        #[arg(long, default_value_t = 50)]
        malformed_every: u64,
        #[arg(long)]
        no_shm: bool,
    },
    /// Latency against offered load per broker; JSON to stdout (and --out).
    Bench {
        #[arg(long, value_enum, value_delimiter = ',', default_value = "kafka,nats")]
        brokers: Vec<BrokerKind>,
        /// Offered loads, records per second.
        #[arg(long, value_delimiter = ',', default_value = "500,1000,2000,4000,8000")]
        rates: Vec<f64>,
        #[command(flatten)]
        shape: Shape,
        /// Also write the JSON here.
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
}

fn pubsub() -> PubsubConfig {
    PipelineConfig::default().pubsub
}

async fn ctrl_c() {
    let _ = tokio::signal::ctrl_c().await;
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run {
            broker,
            broker_addr,
            rate,
            shape,
            kill_ingest_after,
            json,
        } => {
            let mut cfg = shape.config(rate);
            cfg.kill_ingest_after = kill_ingest_after.map(Duration::from_secs_f64);
            if broker_addr.is_none() {
                eprintln!("starting {} on a free loopback port…", broker.name());
            }
            let r = chunnel_etl::run(broker, broker_addr, &cfg).await?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "{}: offered {:.0}/s for {:.1} s: sent {}, acknowledged by ingest {}, \
                     delivered {} + malformed (counted, skipped) {} = {}, missing {}, \
                     duplicates dropped {}",
                    r.broker,
                    r.offered_per_s,
                    shape.secs,
                    r.sent,
                    r.acked,
                    r.delivered,
                    r.malformed,
                    r.delivered + r.malformed,
                    r.missing,
                    r.duplicates
                );
                println!(
                    "end-to-end latency: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; delivered \
                     {:.0}/s",
                    r.p50_us as f64 / 1e3,
                    r.p99_us as f64 / 1e3,
                    r.max_us as f64 / 1e3,
                    r.delivered_per_s
                );
                println!(
                    "hops: producer->ingest {:?}, parser->consumer {:?}; published per ingest \
                     server {:?}; failovers {}, retransmits {}",
                    r.producer_paths, r.parser_paths, r.published, r.failovers, r.retransmits
                );
                println!(
                    "every sequence number exactly once: {}",
                    if r.complete() { "yes" } else { "NO" }
                );
            }
            anyhow::ensure!(r.complete(), "records missing: {:?}", r.missing_examples);
        }
        Cmd::Ingest {
            listen,
            broker,
            broker_addr,
            topic,
            partitions,
            no_shm,
        } => {
            let r: Result<(), Error> = with_broker!(broker, &broker_addr, partitions, |b| {
                let ingest = Ingest::start(listen, b, &topic, pubsub(), !no_shm).await?;
                eprintln!(
                    "ingest on {} -> {} topic {topic}",
                    ingest.addr(),
                    broker.name()
                );
                ctrl_c().await;
                eprintln!("published {}", ingest.published());
                Ok(())
            });
            r?;
        }
        Cmd::Parse {
            broker,
            broker_addr,
            topic,
            group,
            index,
            count,
            consumers,
            no_shm,
        } => {
            let sender = SenderConfig {
                shm: !no_shm,
                ..SenderConfig::default()
            };
            let r: Result<(), Error> = with_broker!(broker, &broker_addr, count as i32, |b| {
                let member = Member::nth(group.clone(), index, count);
                let p = Parser::start(b, &topic, member, pubsub(), &consumers, sender).await?;
                eprintln!("parser {index}/{count} -> {:?}", p.paths());
                ctrl_c().await;
                eprintln!("{:?}", p.stop().await?);
                Ok(())
            });
            r?;
        }
        Cmd::Consume { listen, no_shm } => {
            let c = Consumer::start(listen, !no_shm).await?;
            eprintln!("consumer on {}", c.addr());
            loop {
                tokio::select! {
                    _ = ctrl_c() => break,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {
                        let r = c.report();
                        println!(
                            "delivered {} malformed {} duplicates {} p50 {} µs p99 {} µs by level {:?}",
                            r.delivered, r.malformed, r.duplicates, r.latency_us[0],
                            r.latency_us[1], r.by_level
                        );
                    }
                }
            }
        }
        Cmd::Produce {
            ingest,
            id,
            rate,
            secs,
            batch,
            malformed_every,
            no_shm,
        } => {
            let sender = HopSender::connect(
                &ingest,
                SenderConfig {
                    shm: !no_shm,
                    ..SenderConfig::default()
                },
            )
            .await
            .context("connecting to the ingest servers")?;
            eprintln!("producer {id} -> {:?}", sender.paths());
            let cfg = ProducerConfig {
                id,
                rate,
                batch,
                duration: Duration::from_secs_f64(secs),
                malformed_every,
            };
            let r = produce(cfg, sender, Acked::default()).await;
            println!("{r:?}");
        }
        Cmd::Bench {
            brokers,
            rates,
            shape,
            out,
        } => {
            let cfg = BenchConfig {
                brokers,
                rates,
                pipeline: shape.config(0.0),
            };
            let v = sweep(&cfg).await?;
            let s = serde_json::to_string(&v)?;
            if let Some(path) = out {
                std::fs::write(&path, format!("{s}\n"))
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            println!("{s}");
        }
    }
    Ok(())
}
