//! The ordering experiment of `chunnel-bench pubsub` (paper §7.2, issue 23): service-side
//! ordering (one lane: one partition or stream, the broker orders) against receiver-side
//! ordering (`lanes` lanes, each receiver reorders by sequence number), with one receiver and
//! with four, through `chunnel_pubsub::order`.
//!
//! One publisher in a fixed mode; `r` receivers, each its own subscription reading that mode's
//! lanes only (`OrderedSubscribe::only`), each a task of the same current-thread runtime.
//!
//! * latency: one message in flight; from the start of its publish (acknowledged by the broker)
//!   until the last of the `r` receivers has it.
//! * throughput: `msgs * 10` messages in bursts of `burst` (as in the direct experiment), published back to back while
//!   the receivers take them; messages per second from the first publish until the last
//!   receiver has them all (every receiver gets every message).
//!
//! Reported per broker, mode and receiver count as medians over `reps`, with the paper's
//! comparison as ratios (per repetition, median [min–max]): receiver-side over service-side
//! latency and throughput, at 1 and at 4 receivers. The paper (§7.2) reports receiver-side
//! ordering with one receiver at 63 % lower median latency than service-side ordering on AWS
//! SQS: a p50 ratio of 0.37.

use std::time::Instant;

use anyhow::{Context, Result};
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection};
use chunnel_pubsub::order::{Mode, OrderConfig, OrderedPublish, OrderedSubscribe};
use chunnel_pubsub::{Broker, Config};
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::stats::{quantile, spread};

const WARMUP: usize = 50;
/// Receiver counts compared.
const RECEIVERS: [usize; 2] = [1, 4];

/// What one experiment needs from the command line.
pub(crate) struct Params {
    pub msgs: usize,
    pub reps: usize,
    pub size: usize,
    pub burst: usize,
    pub lanes: u32,
}

struct Run {
    p50: Vec<f64>,
    p99: Vec<f64>,
    tput: Vec<f64>,
}

impl Run {
    fn json(&self) -> Value {
        json!({
            "latency_p50_us": spread(&self.p50),
            "latency_p99_us": spread(&self.p99),
            "throughput_msgs_per_s": spread(&self.tput),
            "runs": {"p50_us": self.p50, "p99_us": self.p99, "throughput": self.tput},
        })
    }
}

/// Waits until every receiver has `target` messages.
async fn all_have(counts: &mut [watch::Receiver<u64>], target: u64) -> Result<()> {
    for c in counts {
        c.wait_for(|n| *n >= target)
            .await
            .context("a receiver stopped")?;
    }
    Ok(())
}

/// One measurement: (sorted latencies in µs, messages per second).
async fn once<B: Broker>(
    broker: &B,
    p: &Params,
    mode: Mode,
    receivers: usize,
    topic: &str,
) -> Result<(Vec<f64>, f64)> {
    let config = Config::default();
    let order = OrderConfig {
        lanes: p.lanes,
        ..OrderConfig::default()
    };
    let publisher = OrderedPublish::new(broker.clone(), topic, config.clone(), order.clone())
        .fixed(mode)
        .connect_wrap(())
        .await?;
    let mut counts = Vec::new();
    let mut tasks = tokio::task::JoinSet::new();
    for r in 0..receivers {
        let sub = OrderedSubscribe::new(
            broker.clone(),
            topic,
            format!("r{r}"),
            config.clone(),
            order.clone(),
        )
        .only(mode)
        .connect_wrap(())
        .await?;
        let (tx, rx) = watch::channel(0u64);
        counts.push(rx);
        tasks.spawn(async move {
            let mut slots = vec![None; 256];
            let mut n = 0u64;
            // On an error the task ends and drops `tx`: the measurement fails.
            while let Ok(got) = sub.recv(&mut slots).await {
                for s in &mut slots[..got] {
                    s.take();
                }
                n += got as u64;
                tx.send_replace(n);
            }
        });
    }
    let one = [Bytes::from(vec![7u8; p.size])];
    let mut lat = Vec::with_capacity(p.msgs);
    let mut sent = 0u64;
    for i in 0..WARMUP + p.msgs {
        let start = Instant::now();
        publisher.send(one.iter().cloned()).await?;
        sent += 1;
        all_have(&mut counts, sent).await?;
        if i >= WARMUP {
            lat.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    lat.sort_by(f64::total_cmp);
    let total = p.msgs * 10;
    let burst: Vec<Bytes> = (0..p.burst)
        .map(|i| Bytes::from(vec![i as u8; p.size]))
        .collect();
    let start = Instant::now();
    let mut published = 0;
    while published < total {
        let n = p.burst.min(total - published);
        publisher.send(burst[..n].iter().cloned()).await?;
        published += n;
    }
    sent += total as u64;
    all_have(&mut counts, sent).await?;
    let tput = total as f64 / start.elapsed().as_secs_f64();
    tasks.abort_all();
    Ok((lat, tput))
}

/// Every mode and receiver count, `reps` times (modes alternate within a repetition).
pub(crate) async fn experiment<B: Broker>(broker: B, p: &Params) -> Result<Value> {
    let mut runs: Vec<((Mode, usize), Run)> = Vec::new();
    for mode in [Mode::Service, Mode::Receiver] {
        for r in RECEIVERS {
            runs.push((
                (mode, r),
                Run {
                    p50: vec![],
                    p99: vec![],
                    tput: vec![],
                },
            ));
        }
    }
    for rep in 0..p.reps {
        let order: Vec<usize> = if rep % 2 == 0 {
            (0..runs.len()).collect()
        } else {
            (0..runs.len()).rev().collect()
        };
        for i in order {
            let ((mode, r), run) = &mut runs[i];
            let topic = format!(
                "bench-ord-{}-{r}-{}-{rep}",
                mode.label(),
                std::process::id()
            );
            let (lat, tput) = once(&broker, p, *mode, *r, &topic).await?;
            eprintln!(
                "ordering {} x{r}: p50 {:.0} µs, {:.0} msgs/s",
                mode.label(),
                quantile(&lat, 0.5),
                tput
            );
            run.p50.push(quantile(&lat, 0.5));
            run.p99.push(quantile(&lat, 0.99));
            run.tput.push(tput);
        }
    }
    let get = |mode: Mode, r: usize| {
        runs.iter()
            .find(|((m, n), _)| *m == mode && *n == r)
            .map(|(_, run)| run)
    };
    let mut modes = serde_json::Map::new();
    let mut ratios = serde_json::Map::new();
    for mode in [Mode::Service, Mode::Receiver] {
        let mut per = serde_json::Map::new();
        for r in RECEIVERS {
            if let Some(run) = get(mode, r) {
                per.insert(r.to_string(), run.json());
            }
        }
        modes.insert(mode.label().to_owned(), Value::Object(per));
    }
    for r in RECEIVERS {
        if let (Some(s), Some(rv)) = (get(Mode::Service, r), get(Mode::Receiver, r)) {
            // Per repetition (the two modes measured in the same one), median [min–max].
            let paired = |a: &[f64], b: &[f64]| -> Vec<f64> {
                a.iter().zip(b).map(|(x, y)| x / y).collect()
            };
            ratios.insert(
                r.to_string(),
                json!({
                    "latency_p50": spread(&paired(&rv.p50, &s.p50)),
                    "latency_p99": spread(&paired(&rv.p99, &s.p99)),
                    "throughput": spread(&paired(&rv.tput, &s.tput)),
                }),
            );
        }
    }
    Ok(json!({
        "lanes": p.lanes,
        "burst": p.burst,
        "modes": modes,
        "receiver_over_service": ratios,
    }))
}
