//! The scenarios every broker runs: the pipeline end to end, and with an ingest server killed.
#![allow(dead_code)]

use std::time::Duration;

use chunnel_etl::{BrokerKind, PipelineConfig, Report};

/// Four producers, two ingest servers, two parsers, one consumer; every 10th record malformed;
/// some garbage published straight to the topic.
pub fn config(rate: f64, secs: f64, shm: bool) -> PipelineConfig {
    PipelineConfig {
        producers: 4,
        ingests: 2,
        parsers: 2,
        rate,
        duration: Duration::from_secs_f64(secs),
        batch: 16,
        malformed_every: 10,
        shm,
        garbage: 7,
        drain: Duration::from_secs(60),
        ..PipelineConfig::default()
    }
}

/// Every record accounted for exactly once, malformed ones counted, garbage skipped, both
/// ingest servers and both parsers used.
pub fn check_complete(r: &Report, what: &str) {
    eprintln!("{what}: {}", serde_json::to_string(r).unwrap());
    assert!(r.sent > 0, "{what}: nothing sent");
    assert_eq!(r.failed_batches, 0, "{what}: batches given up");
    assert_eq!(r.acked, r.sent, "{what}: not every record acknowledged");
    assert_eq!(
        (r.missing, r.unexpected),
        (0, 0),
        "{what}: missing {:?}",
        r.missing_examples
    );
    assert_eq!(r.malformed, r.malformed_sent, "{what}: malformed lines");
    assert!(r.malformed > 0, "{what}: no malformed line was made");
    assert_eq!(r.delivered + r.malformed, r.sent, "{what}: accounted");
    assert_eq!(r.undecodable, 7, "{what}: garbage on the topic not counted");
    assert_eq!(r.parsed.len(), 2);
    assert!(
        r.parsed.iter().all(|&n| n > 0),
        "{what}: a parser got nothing: {:?}",
        r.parsed
    );
    assert!(r.p50_us > 0 && r.p99_us >= r.p50_us, "{what}: latency");
}

/// The plain run: both ingest servers publish; no copies without a fault.
pub async fn end_to_end(kind: BrokerKind, addr: &str, shm: bool) {
    let cfg = config(1000.0, 3.0, shm);
    let r = chunnel_etl::run(kind, Some(addr.to_owned()), &cfg)
        .await
        .expect("pipeline");
    check_complete(&r, &format!("{} end to end", kind.name()));
    assert!(r.published.iter().all(|&n| n > 0), "{:?}", r.published);
    let want = if shm { "shm" } else { "udp" };
    assert!(
        r.producer_paths
            .iter()
            .chain(&r.parser_paths)
            .all(|p| *p == want),
        "hops negotiated {:?} {:?}, expected {want}",
        r.producer_paths,
        r.parser_paths
    );
}

/// Ingest server 0 dies 1.5 s into a 4 s run: the producers carry on over the other one and
/// nothing acknowledged before the kill (or after) is lost.
pub async fn ingest_killed(kind: BrokerKind, addr: &str, shm: bool) {
    let mut cfg = config(1000.0, 4.0, shm);
    cfg.kill_ingest_after = Some(Duration::from_millis(1500));
    let r = chunnel_etl::run(kind, Some(addr.to_owned()), &cfg)
        .await
        .expect("pipeline");
    check_complete(&r, &format!("{} ingest killed", kind.name()));
    let before = r.acked_before_kill.unwrap();
    assert!(before > 0, "nothing was acknowledged before the kill");
    assert_eq!(r.acked_before_kill_lost, Some(0));
    // The survivor carried the rest: the killed one published about 1.5 s of half the load.
    let (dead, alive) = (r.published[0], r.published[1]);
    assert!(
        alive > dead && alive + dead >= r.sent,
        "published {:?} of {}",
        r.published,
        r.sent
    );
}
