//! End-to-end latency against offered load (`chunnel-etl bench`, `chunnel-bench etl`): the
//! whole pipeline at each offered rate, per broker, as JSON.

use std::time::Duration;

use serde_json::{Value, json};

use crate::pipeline::{PipelineConfig, Report, start_broker};
use crate::{BrokerKind, Error};

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Brokers, each started once (on free loopback ports) for all its rates.
    pub brokers: Vec<BrokerKind>,
    /// Offered loads, records per second (all producers together).
    pub rates: Vec<f64>,
    /// The pipeline at every point (its `rate` is replaced by each of `rates`).
    pub pipeline: PipelineConfig,
}

fn point(r: &Report) -> Value {
    json!({
        "offered_per_s": r.offered_per_s,
        "delivered_per_s": (r.delivered_per_s * 10.0).round() / 10.0,
        "p50_us": r.p50_us,
        "p99_us": r.p99_us,
        "max_us": r.max_us,
        "sent": r.sent,
        "delivered": r.delivered,
        "malformed": r.malformed,
        "duplicates": r.duplicates,
        "missing": r.missing,
        "complete": r.complete(),
    })
}

/// Runs every broker at every rate; a broker that cannot start or fails is reported as
/// `{"skipped": why}` and the others still run.
pub async fn sweep(cfg: &BenchConfig) -> Result<Value, Error> {
    let mut brokers = serde_json::Map::new();
    let mut paths = Vec::new();
    for &kind in &cfg.brokers {
        let started = tokio::task::spawn_blocking(move || start_broker(kind))
            .await
            .map_err(|e| Error::Task(e.to_string()))?;
        let broker = match started {
            Ok(b) => b,
            Err(e) => {
                eprintln!("etl bench: {} skipped: {e}", kind.name());
                brokers.insert(kind.name().into(), json!({ "skipped": e.to_string() }));
                continue;
            }
        };
        let mut points = Vec::new();
        let mut failed = None;
        for &rate in &cfg.rates {
            let pc = PipelineConfig {
                rate,
                ..cfg.pipeline.clone()
            };
            match crate::pipeline::run(kind, Some(broker.addr.clone()), &pc).await {
                Ok(r) => {
                    eprintln!(
                        "etl bench: {} offered {rate}/s: delivered {:.0}/s, p50 {} µs, p99 {} µs, \
                         {} of {} accounted",
                        kind.name(),
                        r.delivered_per_s,
                        r.p50_us,
                        r.p99_us,
                        r.delivered + r.malformed,
                        r.sent
                    );
                    if paths.is_empty() {
                        paths = r.producer_paths.clone();
                        paths.extend(r.parser_paths.iter().copied());
                    }
                    points.push(point(&r));
                }
                Err(e) => {
                    failed = Some(e.to_string());
                    break;
                }
            }
            // Let the broker settle between points.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let mut entry = json!({ "points": points });
        if let Some(why) = failed {
            entry["failed"] = json!(why);
        }
        brokers.insert(kind.name().into(), entry);
    }
    paths.sort_unstable();
    paths.dedup();
    let p = &cfg.pipeline;
    Ok(json!({
        "bench": "etl",
        "what": "chunnel-etl end to end: producer stamp -> consumer, per offered load and broker",
        "producers": p.producers,
        "ingests": p.ingests,
        "parsers": p.parsers,
        "batch": p.batch,
        "secs": p.duration.as_secs_f64(),
        "malformed_every": p.malformed_every,
        "hop_paths": paths,
        "rates": cfg.rates,
        "brokers": brokers,
    }))
}
