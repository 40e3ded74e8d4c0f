//! `chunnel-bench pubsub`: publish→deliver latency and throughput through the pub/sub
//! Chunnels (`chunnel-pubsub`) against the same broker's client crate used directly, per
//! broker (Redis Streams, NATS JetStream, Kafka), in the same run (needs the feature
//! `pubsub`).
//!
//! The benchmark starts each broker itself on free loopback ports (as the tests do) and stops
//! it by PID. Both variants run in one current-thread runtime, the publisher and the
//! subscriber as two futures of one task, and do the same broker work per message: the
//! publisher waits for the broker's acknowledgement of every burst; the subscriber reads as a
//! group member and acknowledges what it read (Redis `XACK`, a JetStream ack; Kafka has no
//! groups in rskafka: the direct client fetches by offset, the Chunnel also commits its
//! position in the background).
//!
//! * latency: one message in flight, `msgs` timed messages after a warm-up; the time from the
//!   start of the publish (which waits for the broker's acknowledgement) to the subscriber's
//!   receive returning the message, the two done one after the other by one task.
//! * throughput: `msgs * 10` messages (or `--throughput-msgs`) of `size` bytes published in
//!   bursts of `burst` while the subscriber receives them; messages per second from the first
//!   send to the last receipt.
//!
//! The main baseline (`direct`, described in the JSON's `direct_is`) does what a user of the
//! client crate who wants the Chunnel's guarantees does: Redis and NATS messages carry a
//! 16-byte id (a Redis field; a JetStream `Nats-Msg-Id` of 32 hex digits, which JetStream
//! deduplicates on, as the Chunnel's); Kafka records carry a 16-byte id in front of the value
//! (the Chunnel's carry the 4-byte marker and the 16-byte id there) and the burst's wall-clock
//! time as their timestamp (as the Chunnel's; Kafka's own producers stamp records with the time,
//! and time-based retention goes by it), one produce request per burst. Extra baselines of the
//! same run, under `baselines`, with their own ratios: NATS `no_id` (publishes without the
//! header: less broker work than the Chunnel) and Kafka `no_id` (plain values with timestamp 0:
//! smaller records than the Chunnel's).
//!
//! Every broker first runs one unrecorded repetition of every variant (a warm-up), then
//! `reps` recorded ones. Variants alternate within each repetition; figures are medians over `reps` with the
//! Chunnel/direct ratios (latency ≤ 1.1 and throughput ≥ 0.9 are the bars of issue 23).
//!
//! `--experiments` selects `direct` (the above, JSON key `brokers`) and `ordering`
//! (`pubsub_order.rs`: service- against receiver-side ordering with 1 and 4 receivers, JSON key
//! `ordering`, per broker the figures of each mode and receiver count and their
//! receiver-side / service-side ratios); both by default.

use anyhow::Result;
use serde_json::Value;

#[derive(clap::Args, Clone)]
pub(crate) struct Args {
    /// Timed messages per latency measurement (throughput sends ten times as many).
    #[arg(long, default_value_t = 2000)]
    msgs: usize,
    /// Recorded repetitions (each runs every variant), after one unrecorded warm-up.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// Messages per published burst in the throughput runs (both experiments).
    #[arg(long, default_value_t = 100)]
    burst: usize,
    /// Brokers to measure, comma separated: redis, nats, kafka.
    #[arg(long, default_value = "redis,nats,kafka")]
    brokers: String,
    /// Experiments, comma separated: `direct` (the Chunnel against the client crate) and
    /// `ordering` (service- against receiver-side ordering, 1 and 4 receivers).
    #[arg(long, default_value = "direct,ordering")]
    experiments: String,
    /// Lanes of receiver-side ordering in the ordering experiment.
    #[arg(long, default_value_t = 4)]
    lanes: u32,
    /// Messages per throughput measurement (0: ten times `--msgs`).
    #[arg(long, default_value_t = 0)]
    throughput_msgs: usize,
    /// Variants of the `direct` experiment to run, comma separated: `chunnel`, `direct` (the
    /// main baseline) and `extra` (the extra baselines). A variant left out has no figures
    /// (its ratios are null); for profiling one variant's client alone.
    #[arg(long, default_value = "chunnel,direct,extra")]
    variants: String,
    /// Leave the client and the broker unpinned (by default the client runs on CPU 0 and every
    /// thread of the broker on CPU 1: where the scheduler puts them otherwise changes from one
    /// repetition to the next, and a cross-core wake-up costs tens of microseconds here, so
    /// latency would be bimodal).
    #[arg(long)]
    no_pin: bool,
}

#[cfg(feature = "pubsub")]
impl Args {
    fn runs(&self, variant: &str) -> bool {
        self.variants.split(',').any(|v| v.trim() == variant)
    }
}

pub(crate) fn run(a: Args) -> Result<()> {
    let out = measure(&a)?;
    println!("{out}");
    Ok(())
}

#[cfg(not(feature = "pubsub"))]
fn measure(_: &Args) -> Result<Value> {
    anyhow::bail!("chunnel-bench was built without the feature `pubsub` (--features pubsub)")
}

#[cfg(feature = "pubsub")]
fn measure(a: &Args) -> Result<Value> {
    imp::measure(a)
}

#[cfg(feature = "pubsub")]
#[path = "pubsub_order.rs"]
mod order;

#[cfg(feature = "pubsub")]
mod imp {
    use std::time::{Duration, Instant};

    use anyhow::{Context, Result, bail};
    use bytes::Bytes;
    use chunnel::{Chunnel, ChunnelConnection};
    use chunnel_pubsub::{Broker, Config, Member, Publish, Publisher, Subscribe, Subscriber};
    use chunnel_test::services::Scratch;
    use serde_json::{Value, json};

    use super::Args;
    use crate::stats::{median, quantile, spread};

    const WARMUP: usize = 100;

    /// One side of a measured pair: publish a burst (acknowledged), receive some.
    trait Pair {
        async fn publish(&mut self, burst: &[Bytes]) -> Result<()>;
        /// Receives at least one message; returns how many.
        async fn receive(&mut self) -> Result<usize>;
    }

    struct Lib<B: Broker> {
        publisher: Publisher<B::Producer>,
        subscriber: Subscriber<B::Consumer>,
        slots: Vec<Option<Bytes>>,
    }

    async fn lib<B: Broker>(broker: B, topic: &str) -> Result<Lib<B>> {
        let config = Config::default();
        let publisher = Publish::new(broker.clone(), topic, config.clone())
            .connect_wrap(())
            .await?;
        let subscriber = Subscribe::new(broker, topic, Member::sole("bench"), config)
            .connect_wrap(())
            .await?;
        Ok(Lib {
            publisher,
            subscriber,
            slots: vec![None; 256],
        })
    }

    impl<B: Broker> Pair for Lib<B> {
        async fn publish(&mut self, burst: &[Bytes]) -> Result<()> {
            Ok(self.publisher.send(burst.iter().cloned()).await?)
        }
        async fn receive(&mut self) -> Result<usize> {
            let n = self.subscriber.recv(&mut self.slots).await?;
            for s in &mut self.slots[..n] {
                s.take();
            }
            Ok(n)
        }
    }

    fn payloads(n: usize, size: usize) -> Vec<Bytes> {
        (0..n).map(|i| Bytes::from(vec![i as u8; size])).collect()
    }

    /// Latencies in µs, sorted: publish one message (acknowledged by the broker), then
    /// receive it.
    async fn latency(p: &mut impl Pair, msgs: usize, size: usize) -> Result<Vec<f64>> {
        let one = payloads(1, size);
        let mut out = Vec::with_capacity(msgs);
        for i in 0..WARMUP + msgs {
            let start = Instant::now();
            p.publish(&one).await?;
            let mut got = 0;
            while got == 0 {
                got = p.receive().await?;
            }
            if i >= WARMUP {
                out.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        out.sort_by(f64::total_cmp);
        Ok(out)
    }

    /// Messages per second.
    async fn throughput(p: &mut impl Pair, total: usize, a: &Args) -> Result<f64> {
        let burst = payloads(a.burst, a.size);
        let start = Instant::now();
        let mut got = 0;
        let mut sent = 0;
        while got < total {
            if sent < total && sent < got + 4 * a.burst {
                p.publish(&burst).await?;
                sent += a.burst;
            } else {
                got += p.receive().await?;
            }
        }
        Ok(total as f64 / start.elapsed().as_secs_f64())
    }

    /// Drops the first repetition of every variant: a warm-up (the brokers, the Kafka JVM
    /// above all, get faster over the first seconds, which would penalise whichever variant
    /// runs first).
    fn discard_warmup<const N: usize>(figures: [&mut Figures; N]) {
        for f in figures {
            for v in [&mut f.p50, &mut f.p99, &mut f.tput] {
                if !v.is_empty() {
                    v.remove(0);
                }
            }
        }
    }

    struct Figures {
        p50: Vec<f64>,
        p99: Vec<f64>,
        tput: Vec<f64>,
    }

    impl Figures {
        fn new() -> Self {
            Figures {
                p50: vec![],
                p99: vec![],
                tput: vec![],
            }
        }
        fn add(&mut self, lat: &[f64], tput: f64) {
            self.p50.push(quantile(lat, 0.5));
            self.p99.push(quantile(lat, 0.99));
            self.tput.push(tput);
        }
        fn med(xs: &[f64]) -> f64 {
            let mut v = xs.to_vec();
            v.sort_by(f64::total_cmp);
            median(&v)
        }
        fn json(&self) -> Value {
            json!({
                "latency_p50_us": spread(&self.p50),
                "latency_p99_us": spread(&self.p99),
                "throughput_msgs_per_s": spread(&self.tput),
                "runs": {"p50_us": self.p50, "p99_us": self.p99, "throughput": self.tput},
            })
        }
    }

    /// Measures `p` unless `variant` is left out of `--variants`.
    async fn run_pair(variant: &str, p: &mut impl Pair, a: &Args, f: &mut Figures) -> Result<()> {
        if !a.runs(variant) {
            return Ok(());
        }
        let lat = latency(p, a.msgs, a.size).await?;
        let total = match a.throughput_msgs {
            0 => a.msgs * 10,
            n => n,
        };
        let t = throughput(p, total, a).await?;
        f.add(&lat, t);
        Ok(())
    }

    /// Per repetition, `a[i] / b[i]` (the two measured in the same repetition).
    pub(super) fn paired(a: &[f64], b: &[f64]) -> Vec<f64> {
        a.iter().zip(b).map(|(x, y)| x / y).collect()
    }

    /// The Chunnel/direct ratios (per repetition, then median [min–max]), with the bars judged
    /// on the medians.
    fn ratios(lib: &Figures, direct: &Figures) -> serde_json::Map<String, Value> {
        let l50 = paired(&lib.p50, &direct.p50);
        let t = paired(&lib.tput, &direct.tput);
        let v = json!({
            "ratio_latency_p50": spread(&l50),
            "ratio_latency_p99": spread(&paired(&lib.p99, &direct.p99)),
            "ratio_throughput": spread(&t),
            "latency_within_1_1x": Figures::med(&l50) <= 1.1,
            "throughput_at_least_0_9x": Figures::med(&t) >= 0.9,
        });
        match v {
            Value::Object(m) => m,
            _ => serde_json::Map::new(),
        }
    }

    /// The Chunnel against the main baseline (`direct`, described by `what`), and against any
    /// extra baselines of the same run (`baselines`: name, description, figures).
    fn compare(
        lib: &Figures,
        what: &str,
        direct: &Figures,
        extra: &[(&str, &str, &Figures)],
    ) -> Value {
        let mut out = ratios(lib, direct);
        out.insert("chunnel".into(), lib.json());
        out.insert("direct".into(), direct.json());
        out.insert("direct_is".into(), what.into());
        let mut baselines = serde_json::Map::new();
        for (name, what, f) in extra {
            let mut b = ratios(lib, f);
            b.insert("direct".into(), f.json());
            b.insert("direct_is".into(), (*what).into());
            baselines.insert((*name).to_owned(), Value::Object(b));
        }
        out.insert("baselines".into(), Value::Object(baselines));
        Value::Object(out)
    }

    const REDIS_DIRECT: &str = "the redis crate: a pipelined XADD per burst with an id field \
        (16 bytes) like the Chunnel's, XREADGROUP and XACK";
    const NATS_DIRECT: &str = "async-nats: JetStream publishes with a Nats-Msg-Id header of 32 \
        hex digits like the Chunnel's (JetStream deduplicates on it), a pull consumer, an ack \
        per message";
    const NATS_NO_ID: &str = "async-nats as `direct` but publishing without a Nats-Msg-Id \
        header (no deduplication by JetStream)";
    const KAFKA_DIRECT: &str = "rskafka: one produce request per burst, each record's value a \
        16-byte id then the payload, stamped with the burst's wall-clock time; fetch by offset";
    const KAFKA_NO_ID: &str = "rskafka as `direct` but plain values (no id) with timestamp 0 (a \
        smaller record, and a timestamp no producer keeping data would write: time-based \
        retention drops such a segment once it rolls)";

    fn topic(what: &str, rep: usize) -> String {
        format!("bench-{what}-{}-{rep}", std::process::id())
    }

    mod redis_direct {
        use super::*;
        use chunnel_pubsub::redis::RedisBroker;
        use chunnel_pubsub::redis::client as redis;
        use redis::aio::ConnectionManager;
        use redis::streams::StreamReadReply;

        pub(super) struct Direct {
            publisher: ConnectionManager,
            subscriber: ConnectionManager,
            topic: String,
        }

        pub(super) async fn direct(broker: &RedisBroker, topic: &str) -> Result<Direct> {
            let mut subscriber = broker.connection().await?;
            redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(topic)
                .arg("bench")
                .arg("0")
                .arg("MKSTREAM")
                .query_async::<()>(&mut subscriber)
                .await?;
            Ok(Direct {
                publisher: broker.connection().await?,
                subscriber,
                topic: topic.to_owned(),
            })
        }

        impl Pair for Direct {
            async fn publish(&mut self, burst: &[Bytes]) -> Result<()> {
                let mut pipe = redis::pipe();
                for (i, b) in burst.iter().enumerate() {
                    pipe.cmd("XADD")
                        .arg(&self.topic)
                        .arg("*")
                        .arg("i")
                        .arg(&(i as u128).to_be_bytes()[..])
                        .arg("d")
                        .arg(&b[..])
                        .ignore();
                }
                pipe.query_async::<()>(&mut self.publisher).await?;
                Ok(())
            }
            async fn receive(&mut self) -> Result<usize> {
                let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
                    .arg("GROUP")
                    .arg("bench")
                    .arg("c")
                    .arg("COUNT")
                    .arg(256)
                    .arg("BLOCK")
                    .arg(100)
                    .arg("STREAMS")
                    .arg(&self.topic)
                    .arg(">")
                    .query_async(&mut self.subscriber)
                    .await?;
                let ids: Vec<String> = reply
                    .into_iter()
                    .flat_map(|r| r.keys)
                    .flat_map(|k| k.ids)
                    .map(|e| e.id)
                    .collect();
                if !ids.is_empty() {
                    redis::cmd("XACK")
                        .arg(&self.topic)
                        .arg("bench")
                        .arg(&ids)
                        .query_async::<()>(&mut self.subscriber)
                        .await?;
                }
                Ok(ids.len())
            }
        }
    }

    mod nats_direct {
        use super::*;
        use async_nats::jetstream::consumer;
        use chunnel_pubsub::nats::NatsBroker;
        use chunnel_pubsub::nats::async_nats;
        use futures::StreamExt;

        pub(super) struct Direct {
            js: async_nats::jetstream::Context,
            messages: consumer::pull::Stream,
            subject: async_nats::Subject,
            /// Publish with a `Nats-Msg-Id` header (the next id), as the Chunnel does.
            ids: Option<u128>,
        }

        /// The client crate used directly; `with_ids`: every message carries a `Nats-Msg-Id`
        /// of 32 hex digits (a counter), so JetStream deduplicates on it as it does for the
        /// Chunnel's ids.
        pub(super) async fn direct(
            broker: &NatsBroker,
            topic: &str,
            with_ids: bool,
        ) -> Result<Direct> {
            let stream = broker.ensure_stream(topic).await?;
            let consumer: consumer::PullConsumer = stream
                .get_or_create_consumer(
                    "bench",
                    consumer::pull::Config {
                        durable_name: Some("bench".into()),
                        ack_policy: consumer::AckPolicy::Explicit,
                        max_ack_pending: 1024,
                        ..Default::default()
                    },
                )
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let messages = consumer
                .stream()
                .max_messages_per_batch(256)
                .messages()
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            Ok(Direct {
                js: broker.jetstream().clone(),
                messages,
                subject: async_nats::Subject::from(topic),
                ids: with_ids.then_some(0),
            })
        }

        impl Pair for Direct {
            async fn publish(&mut self, burst: &[Bytes]) -> Result<()> {
                let mut acks = Vec::with_capacity(burst.len());
                for b in burst {
                    let ack = match &mut self.ids {
                        Some(next) => {
                            let p = async_nats::jetstream::context::Publish::build()
                                .payload(b.clone())
                                .message_id(format!("{next:032x}"));
                            *next += 1;
                            self.js.send_publish(self.subject.clone(), p).await
                        }
                        None => self.js.publish(self.subject.clone(), b.clone()).await,
                    };
                    acks.push(ack.map_err(|e| anyhow::anyhow!("{e}"))?);
                }
                for a in acks {
                    a.await.map_err(|e| anyhow::anyhow!("{e}"))?;
                }
                Ok(())
            }
            async fn receive(&mut self) -> Result<usize> {
                let m = self
                    .messages
                    .next()
                    .await
                    .context("pull stream ended")?
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                m.ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
                Ok(1)
            }
        }
    }

    mod kafka_direct {
        use super::*;
        use chunnel_pubsub::kafka::{KafkaBroker, rskafka};
        use rskafka::client::partition::{
            Compression, OffsetAt, PartitionClient, UnknownTopicHandling,
        };
        use rskafka::record::Record;

        pub(super) struct Direct {
            part: PartitionClient,
            pos: i64,
            /// Put a 16-byte id (the next one) in front of every value and stamp the records
            /// with the time, as the Chunnel does; `None`: plain values, timestamp 0.
            ids: Option<u128>,
        }

        /// The client crate used directly; `with_ids`: every record carries a 16-byte id (a
        /// counter) in front of its value and the burst's wall-clock time as its timestamp.
        pub(super) async fn direct(
            broker: &KafkaBroker,
            topic: &str,
            with_ids: bool,
        ) -> Result<Direct> {
            broker.ensure_topic(topic, 1).await?;
            let part = broker
                .client()
                .partition_client(topic, 0, UnknownTopicHandling::Retry)
                .await?;
            let pos = part.get_offset(OffsetAt::Latest).await?;
            Ok(Direct {
                part,
                pos,
                ids: with_ids.then_some(0),
            })
        }

        impl Pair for Direct {
            async fn publish(&mut self, burst: &[Bytes]) -> Result<()> {
                let records: Vec<Record> = match &mut self.ids {
                    Some(next) => {
                        let ms = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| d.as_millis() as i64);
                        let timestamp = rskafka::chrono::DateTime::from_timestamp_millis(ms)
                            .unwrap_or_default();
                        burst
                            .iter()
                            .map(|b| {
                                let mut value = Vec::with_capacity(16 + b.len());
                                value.extend_from_slice(&next.to_be_bytes());
                                value.extend_from_slice(b);
                                *next += 1;
                                Record {
                                    key: None,
                                    value: Some(value),
                                    headers: Default::default(),
                                    timestamp,
                                }
                            })
                            .collect()
                    }
                    None => burst
                        .iter()
                        .map(|b| Record {
                            key: None,
                            value: Some(b.to_vec()),
                            headers: Default::default(),
                            timestamp: rskafka::chrono::DateTime::from_timestamp_millis(0)
                                .unwrap_or_default(),
                        })
                        .collect(),
                };
                self.part
                    .produce(records, Compression::NoCompression)
                    .await?;
                Ok(())
            }
            async fn receive(&mut self) -> Result<usize> {
                loop {
                    let (records, _) = self.part.fetch_records(self.pos, 1..4 << 20, 100).await?;
                    let n = records.iter().filter(|r| r.offset >= self.pos).count();
                    if let Some(last) = records.last() {
                        self.pos = self.pos.max(last.offset + 1);
                    }
                    if n > 0 {
                        return Ok(n);
                    }
                }
            }
        }
    }

    /// Pins every thread of the broker to CPU 1 (the client runs on CPU 0), unless `--no-pin`.
    /// Threads the broker starts later inherit the mask of the thread that starts them.
    fn pin_broker(a: &Args, server: &chunnel_test::services::Server) -> Result<()> {
        if a.no_pin {
            return Ok(());
        }
        let pid = server
            .pid()
            .ok_or_else(|| anyhow::anyhow!("{} is not running", server.name))?;
        let out = std::process::Command::new("taskset")
            .args(["-a", "-p", "-c", "1", &pid.to_string()])
            .output()
            .map_err(|e| anyhow::anyhow!("taskset (util-linux) to pin {}: {e}", server.name))?;
        anyhow::ensure!(
            out.status.success(),
            "taskset -a -p -c 1 {pid} ({}): {}",
            server.name,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    pub(super) fn measure(a: &Args) -> Result<Value> {
        if !a.no_pin {
            crate::pin_to(0)?;
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let wants = |e: &str| a.experiments.split(',').any(|x| x.trim() == e);
        let (direct, ordering) = (wants("direct"), wants("ordering"));
        if !direct && !ordering {
            bail!("no experiment: --experiments takes direct, ordering");
        }
        let params = super::order::Params {
            msgs: a.msgs,
            reps: a.reps,
            size: a.size,
            burst: a.burst,
            lanes: a.lanes,
        };
        let mut out = serde_json::Map::new();
        let mut orders = serde_json::Map::new();
        for b in a
            .brokers
            .split(',')
            .map(str::trim)
            .filter(|b| !b.is_empty())
        {
            let scratch = Scratch::new(&format!("bench-{b}"));
            let (d, o) = match b {
                "redis" => {
                    let (_server, url) = chunnel_test::brokers::redis(&scratch);
                    pin_broker(a, &_server)?;
                    rt.block_on(async {
                        let broker = chunnel_pubsub::redis::RedisBroker::new(&url)?;
                        let d = if direct {
                            let (mut l, mut d) = (Figures::new(), Figures::new());
                            for rep in 0..=a.reps {
                                let mut lp = lib(broker.clone(), &topic("lib", rep)).await?;
                                let mut dp =
                                    redis_direct::direct(&broker, &topic("direct", rep)).await?;
                                both(rep, &mut lp, &mut dp, a, &mut l, &mut d).await?;
                            }
                            discard_warmup([&mut l, &mut d]);
                            Some(compare(&l, REDIS_DIRECT, &d, &[]))
                        } else {
                            None
                        };
                        let o = if ordering {
                            Some(super::order::experiment(broker, &params).await?)
                        } else {
                            None
                        };
                        anyhow::Ok((d, o))
                    })?
                }
                "nats" => {
                    let (_server, addr) = chunnel_test::brokers::nats(&scratch);
                    pin_broker(a, &_server)?;
                    rt.block_on(async {
                        let broker = chunnel_pubsub::nats::NatsBroker::connect(
                            &addr,
                            Duration::from_secs(10),
                        )
                        .await?;
                        let d = if direct {
                            let (mut l, mut d, mut x) =
                                (Figures::new(), Figures::new(), Figures::new());
                            for rep in 0..=a.reps {
                                let mut lp = lib(broker.clone(), &topic("lib", rep)).await?;
                                let mut dp =
                                    nats_direct::direct(&broker, &topic("direct", rep), true)
                                        .await?;
                                let mut xp =
                                    nats_direct::direct(&broker, &topic("noid", rep), false)
                                        .await?;
                                if rep.is_multiple_of(2) {
                                    both(rep, &mut lp, &mut dp, a, &mut l, &mut d).await?;
                                    run_pair("extra", &mut xp, a, &mut x).await?;
                                } else {
                                    run_pair("extra", &mut xp, a, &mut x).await?;
                                    both(rep, &mut lp, &mut dp, a, &mut l, &mut d).await?;
                                }
                            }
                            discard_warmup([&mut l, &mut d, &mut x]);
                            Some(compare(&l, NATS_DIRECT, &d, &[("no_id", NATS_NO_ID, &x)]))
                        } else {
                            None
                        };
                        let o = if ordering {
                            Some(super::order::experiment(broker, &params).await?)
                        } else {
                            None
                        };
                        anyhow::Ok((d, o))
                    })?
                }
                "kafka" => {
                    let (_server, addr) = chunnel_test::brokers::kafka(&scratch);
                    pin_broker(a, &_server)?;
                    rt.block_on(async {
                        let broker = chunnel_pubsub::kafka::KafkaBroker::connect(
                            vec![addr],
                            1,
                            Duration::from_secs(30),
                        )
                        .await?;
                        let d = if direct {
                            let (mut l, mut d, mut x) =
                                (Figures::new(), Figures::new(), Figures::new());
                            for rep in 0..=a.reps {
                                let mut lp = lib(broker.clone(), &topic("lib", rep)).await?;
                                let mut dp =
                                    kafka_direct::direct(&broker, &topic("direct", rep), true)
                                        .await?;
                                let mut xp =
                                    kafka_direct::direct(&broker, &topic("noid", rep), false)
                                        .await?;
                                if rep.is_multiple_of(2) {
                                    both(rep, &mut lp, &mut dp, a, &mut l, &mut d).await?;
                                    run_pair("extra", &mut xp, a, &mut x).await?;
                                } else {
                                    run_pair("extra", &mut xp, a, &mut x).await?;
                                    both(rep, &mut lp, &mut dp, a, &mut l, &mut d).await?;
                                }
                            }
                            discard_warmup([&mut l, &mut d, &mut x]);
                            Some(compare(&l, KAFKA_DIRECT, &d, &[("no_id", KAFKA_NO_ID, &x)]))
                        } else {
                            None
                        };
                        let o = if ordering {
                            Some(super::order::experiment(broker, &params).await?)
                        } else {
                            None
                        };
                        anyhow::Ok((d, o))
                    })?
                }
                other => bail!("unknown broker {other:?} (redis, nats, kafka)"),
            };
            if let Some(d) = d {
                out.insert(b.to_owned(), d);
            }
            if let Some(o) = o {
                orders.insert(b.to_owned(), o);
            }
        }
        Ok(json!({
            "bench": "pubsub",
            "msgs": a.msgs,
            "reps": a.reps,
            "size": a.size,
            "burst": a.burst,
            "brokers": out,
            "ordering": orders,
        }))
    }

    /// Both variants once, alternating which goes first.
    async fn both(
        rep: usize,
        lp: &mut impl Pair,
        dp: &mut impl Pair,
        a: &Args,
        l: &mut Figures,
        d: &mut Figures,
    ) -> Result<()> {
        if rep.is_multiple_of(2) {
            run_pair("chunnel", lp, a, l).await?;
            run_pair("direct", dp, a, d).await?;
        } else {
            run_pair("direct", dp, a, d).await?;
            run_pair("chunnel", lp, a, l).await?;
        }
        Ok(())
    }
}
