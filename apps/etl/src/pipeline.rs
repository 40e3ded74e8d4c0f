//! The whole pipeline in one process: a broker (given, or started here), the consumer,
//! ingest servers, parsers and producers, run at an offered load and checked for every record.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection};
use chunnel_pubsub::{Broker, Config as PubsubConfig, Member, Publish};
use serde::Serialize;

use crate::hop::{HopSender, SenderConfig};
use crate::roles::{Acked, Consumer, Ingest, Parser, ProducerConfig, ProducerReport, produce};
use crate::{BrokerKind, Error};

/// The pipeline's shape and load.
#[derive(Clone, Debug)]
pub struct PipelineConfig {
    /// Producers (each offers `rate / producers`). Default 4.
    pub producers: usize,
    /// Ingest servers the producers balance over. Default 2.
    pub ingests: usize,
    /// Parsers in the consumer group (Kafka: one partition each). Default 2.
    pub parsers: usize,
    /// Records per second offered, all producers together. Default 2,000.
    pub rate: f64,
    /// How long the producers produce. Default 5 s.
    pub duration: Duration,
    /// Records per producer batch. Default 16.
    pub batch: usize,
    /// Every `n`-th record of each producer is malformed (0: none). Default 50.
    pub malformed_every: u64,
    /// Offer shared memory on the point-to-point hops (false: UDP, as between hosts).
    pub shm: bool,
    /// After the producers stop, how long the consumer may take to account for every record.
    /// Default 30 s.
    pub drain: Duration,
    /// Kill ingest server 0 this long after the producers start (the fault test).
    pub kill_ingest_after: Option<Duration>,
    /// Messages that are no record at all, published straight to the topic before the
    /// producers start (the parsers must count and skip them). Default 0.
    pub garbage: u64,
    /// The pub/sub Chunnels' settings.
    pub pubsub: PubsubConfig,
    /// The hops' senders' settings (its `shm` is overridden by [`PipelineConfig::shm`]).
    pub sender: SenderConfig,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            producers: 4,
            ingests: 2,
            parsers: 2,
            rate: 2000.0,
            duration: Duration::from_secs(5),
            batch: 16,
            malformed_every: 50,
            shm: true,
            drain: Duration::from_secs(30),
            kill_ingest_after: None,
            garbage: 0,
            pubsub: PubsubConfig {
                poll: Duration::from_millis(50),
                ..PubsubConfig::default()
            },
            sender: SenderConfig::default(),
        }
    }
}

/// What a run did; every count is of records.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// `kafka`, `nats` or `redis`.
    pub broker: &'static str,
    /// Offered, records per second.
    pub offered_per_s: f64,
    /// Made by the producers.
    pub sent: u64,
    /// Acknowledged by an ingest server (stored at the broker).
    pub acked: u64,
    /// Producer batches no ingest server acknowledged in time.
    pub failed_batches: u64,
    /// Parsed records the consumer took in, each id once.
    pub delivered: u64,
    /// Malformed lines made by the producers.
    pub malformed_sent: u64,
    /// Malformed lines the parsers counted and skipped (reported to the consumer), each id once.
    pub malformed: u64,
    /// Copies of already accounted ids the consumer dropped.
    pub duplicates: u64,
    /// Ids sent but neither delivered nor reported malformed.
    pub missing: u64,
    /// Some of them.
    pub missing_examples: Vec<String>,
    /// Ids accounted for that nobody sent.
    pub unexpected: u64,
    /// Delivered per second, first to last delivery.
    pub delivered_per_s: f64,
    /// End-to-end latency, producer stamp → consumer, µs.
    pub p50_us: u64,
    /// 99th percentile, µs.
    pub p99_us: u64,
    /// Largest, µs.
    pub max_us: u64,
    /// Delivered records by level: DEBUG, INFO, WARN, ERROR.
    pub by_level: [u64; 4],
    /// Datapaths negotiated producer → ingest (`shm` / `udp`, one per connection).
    pub producer_paths: Vec<&'static str>,
    /// Datapaths negotiated parser → consumer.
    pub parser_paths: Vec<&'static str>,
    /// Records each parser parsed (and forwarded).
    pub parsed: Vec<u64>,
    /// Broker messages the parsers skipped because they were no record.
    pub undecodable: u64,
    /// Records each ingest server published.
    pub published: Vec<u64>,
    /// Batches moved to another ingest server (all producers).
    pub failovers: u64,
    /// Batch retransmissions (all producers).
    pub retransmits: u64,
    /// With a kill: records acknowledged before the kill.
    pub acked_before_kill: Option<u64>,
    /// With a kill: of them, the ones the consumer never accounted for.
    pub acked_before_kill_lost: Option<u64>,
}

impl Report {
    /// Every sent record was accounted for exactly once and nothing else arrived.
    pub fn complete(&self) -> bool {
        self.missing == 0 && self.unexpected == 0 && self.failed_batches == 0
    }
}

/// Runs the pipeline on `broker` (see [`PipelineConfig`]).
pub async fn run_with<B: Broker>(broker: B, cfg: &PipelineConfig) -> Result<Report, Error> {
    let topic = unique("etl");
    let any: SocketAddr = ([127, 0, 0, 1], 0).into();
    let sender = SenderConfig {
        shm: cfg.shm,
        ..cfg.sender.clone()
    };
    let consumer = Consumer::start(any, cfg.shm).await?;
    let mut ingests = Vec::new();
    for _ in 0..cfg.ingests.max(1) {
        ingests
            .push(Ingest::start(any, broker.clone(), &topic, cfg.pubsub.clone(), cfg.shm).await?);
    }
    let parsers_n = cfg.parsers.max(1) as u32;
    let mut parsers = Vec::new();
    for i in 0..parsers_n {
        let member = Member::nth(format!("{topic}-parsers"), i, parsers_n);
        parsers.push(
            Parser::start(
                broker.clone(),
                &topic,
                member,
                cfg.pubsub.clone(),
                &[consumer.addr()],
                sender.clone(),
            )
            .await?,
        );
    }
    if cfg.garbage > 0 {
        let publisher = Publish::new(broker.clone(), &topic, cfg.pubsub.clone())
            .connect_wrap(())
            .await
            .map_err(Error::Broker)?;
        let junk = (0..cfg.garbage).map(|i| Bytes::from(vec![0xff; 1 + (i % 40) as usize]));
        publisher.send(junk).await.map_err(Error::Broker)?;
    }
    let ingest_addrs: Vec<SocketAddr> = ingests.iter().map(Ingest::addr).collect();
    let n = cfg.producers.max(1);
    let mut producer_paths = Vec::new();
    let mut tasks = Vec::new();
    let mut acked = Vec::new();
    for id in 0..n {
        let s = HopSender::connect(&ingest_addrs, sender.clone()).await?;
        producer_paths.extend(s.paths().into_iter().map(|(_, p)| p));
        let a = Acked::default();
        acked.push(a.clone());
        let pc = ProducerConfig {
            id: id as u32,
            rate: cfg.rate / n as f64,
            batch: cfg.batch,
            duration: cfg.duration,
            malformed_every: cfg.malformed_every,
        };
        tasks.push(tokio::spawn(produce(pc, s, a)));
    }
    let mut before_kill = None;
    if let Some(after) = cfg.kill_ingest_after {
        tokio::time::sleep(after).await;
        let snap: Vec<_> = acked.iter().flat_map(Acked::snapshot).collect();
        ingests[0].kill();
        tracing::info!(acked = snap.len(), "killed ingest server 0");
        before_kill = Some(snap);
    }
    let mut reports: Vec<ProducerReport> = Vec::new();
    for t in tasks {
        reports.push(t.await.map_err(|e| Error::Task(e.to_string()))?);
    }
    let sent: Vec<u64> = reports.iter().map(|r| r.sent).collect();
    let total: u64 = sent.iter().sum();
    let deadline = Instant::now() + cfg.drain;
    while consumer.accounted() < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Copies still on their way would show as duplicates; give them a moment.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let c = consumer.report();
    let (missing, examples, unexpected) = consumer.missing(&sent, 10);
    let parser_paths = parsers
        .iter()
        .flat_map(|p| p.paths().iter().map(|x| x.1))
        .collect();
    let mut parsed = Vec::new();
    let mut undecodable = 0;
    for p in parsers {
        let s = p.stop().await?;
        parsed.push(s.parsed);
        undecodable += s.undecodable;
    }
    let lost = before_kill
        .as_ref()
        .map(|ids| ids.iter().filter(|&&id| !consumer.has(id)).count() as u64);
    Ok(Report {
        broker: B::NAME,
        offered_per_s: cfg.rate,
        sent: total,
        acked: reports.iter().map(|r| r.acked).sum(),
        failed_batches: reports.iter().map(|r| r.failed).sum(),
        delivered: c.delivered,
        malformed_sent: reports.iter().map(|r| r.malformed).sum(),
        malformed: c.malformed,
        duplicates: c.duplicates,
        missing,
        missing_examples: examples
            .iter()
            .map(|id| format!("{}/{}", id.producer, id.seq))
            .collect(),
        unexpected,
        delivered_per_s: if c.span.is_zero() {
            0.0
        } else {
            c.delivered as f64 / c.span.as_secs_f64()
        },
        p50_us: c.latency_us[0],
        p99_us: c.latency_us[1],
        max_us: c.latency_us[2],
        by_level: c.by_level,
        producer_paths,
        parser_paths,
        parsed,
        undecodable,
        published: ingests.iter().map(Ingest::published).collect(),
        failovers: reports.iter().map(|r| r.sender.failovers).sum(),
        retransmits: reports.iter().map(|r| r.sender.retransmits).sum(),
        acked_before_kill: before_kill.as_ref().map(|v| v.len() as u64),
        acked_before_kill_lost: lost,
    })
}

/// A name unique to this process and call.
pub fn unique(what: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{what}-{}-{n}", std::process::id())
}

/// A broker this process started (stopped by PID when dropped) and its address.
#[derive(Debug)]
pub struct EmbeddedBroker {
    _server: chunnel_test::services::Server,
    _scratch: chunnel_test::services::Scratch,
    /// `host:port`, or `redis://host:port/` for Redis.
    pub addr: String,
}

/// Starts `kind` on free loopback ports (chunnel-test's launchers: nats-server with
/// JetStream, redis-server, Kafka 4.1 from `scripts/kafka/fetch.sh`'s jars). Blocks for the
/// broker's start (Kafka: several seconds).
pub fn start_broker(kind: BrokerKind) -> Result<EmbeddedBroker, Error> {
    let scratch = chunnel_test::services::Scratch::new(&format!("etl-{}", kind.name()));
    let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match kind {
        BrokerKind::Kafka => chunnel_test::brokers::kafka(&scratch),
        BrokerKind::Nats => chunnel_test::brokers::nats(&scratch),
        BrokerKind::Redis => chunnel_test::brokers::redis(&scratch),
    }));
    match started {
        Ok((server, addr)) => Ok(EmbeddedBroker {
            _server: server,
            _scratch: scratch,
            addr,
        }),
        Err(p) => Err(Error::BrokerStart {
            broker: kind.name(),
            why: p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "the launcher failed".into()),
        }),
    }
}

/// Runs the pipeline on `kind` at `addr` (started here if `None`).
pub async fn run(
    kind: BrokerKind,
    addr: Option<String>,
    cfg: &PipelineConfig,
) -> Result<Report, Error> {
    let (embedded, addr) = match addr {
        Some(a) => (None, a),
        None => {
            let b = tokio::task::spawn_blocking(move || start_broker(kind))
                .await
                .map_err(|e| Error::Task(e.to_string()))??;
            let a = b.addr.clone();
            (Some(b), a)
        }
    };
    let partitions = cfg.parsers.max(1) as i32;
    let report = crate::with_broker!(kind, &addr, partitions, |b| run_with(b, cfg).await);
    drop(embedded);
    report
}
