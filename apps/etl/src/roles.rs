//! The four roles: [`Ingest`] servers, [`Parser`]s, the [`Consumer`] and producers
//! ([`produce`]).

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection};
use chunnel_pubsub::{Broker, Config as PubsubConfig, Member, Publish, Subscribe};
use hdrhistogram::Histogram;
use tokio::task::JoinSet;

use crate::Error;
use crate::hop::{self, HopSender, SenderConfig, SenderStats, ServeCounters};
use crate::record::{Body, RawRecord, RecordId, log_line, parse, unix_ns};

// ---- ingest ------------------------------------------------------------------------------

/// An ingest server: takes producers' batches over the hop stack and publishes each record
/// to the broker topic (`chunnel_pubsub::Publish`), acknowledging a batch once the broker
/// stored all of it.
#[derive(Debug)]
pub struct Ingest {
    addr: SocketAddr,
    tasks: JoinSet<()>,
    counters: Arc<ServeCounters>,
    published: Arc<AtomicU64>,
}

impl Ingest {
    /// Connects a publisher to `topic` on `broker` and serves on `addr` (port 0: a free one).
    pub async fn start<B: Broker>(
        addr: SocketAddr,
        broker: B,
        topic: &str,
        pubsub: PubsubConfig,
        shm: bool,
    ) -> Result<Ingest, Error> {
        let publisher = Arc::new(
            Publish::new(broker, topic, pubsub)
                .connect_wrap(())
                .await
                .map_err(Error::Broker)?,
        );
        let published = Arc::new(AtomicU64::new(0));
        let count = Arc::clone(&published);
        let handler: hop::Handler = Arc::new(move |body| {
            let publisher = Arc::clone(&publisher);
            let count = Arc::clone(&count);
            Box::pin(async move {
                let Body::Raw(records) = body else {
                    return false;
                };
                let n = records.len() as u64;
                let burst: Vec<Bytes> = records.iter().map(RawRecord::encode).collect();
                match publisher.send(burst).await {
                    Ok(()) => {
                        count.fetch_add(n, Ordering::Relaxed);
                        true
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "publish failed; the producer retries");
                        false
                    }
                }
            })
        });
        let counters = Arc::new(ServeCounters::default());
        let (addr, tasks) = hop::serve(addr, shm, handler, Arc::clone(&counters)).await?;
        Ok(Ingest {
            addr,
            tasks,
            counters,
            published,
        })
    }

    /// The address producers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Records published so far.
    pub fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }

    /// Producer connections so far by datapath: `[shm, udp]`.
    pub fn conns(&self) -> [u64; 2] {
        let c = &self.counters.conns;
        [c[0].load(Ordering::Relaxed), c[1].load(Ordering::Relaxed)]
    }

    /// Stops at once, as a crash would: its connections and socket are dropped, batches it
    /// had not acknowledged are the producers' to resend.
    pub fn kill(&mut self) {
        self.tasks.abort_all();
    }
}

// ---- parser ------------------------------------------------------------------------------

/// What a parser did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParserStats {
    /// Records parsed and forwarded.
    pub parsed: u64,
    /// Records whose line did not parse (forwarded as ids only).
    pub malformed: u64,
    /// Broker messages that were no record at all (skipped; they carry no id).
    pub undecodable: u64,
    /// Its sender to the consumers.
    pub sender: SenderStats,
}

/// A parser: a member of the broker topic's consumer group (`chunnel_pubsub::Subscribe`),
/// parsing each record's line and forwarding the results to the consumers (balanced over
/// them, acknowledged). A broker message is acknowledged once a consumer acknowledged what
/// the parser made of it (at-least-once end to end).
#[derive(Debug)]
pub struct Parser {
    task: tokio::task::JoinHandle<Result<(), Error>>,
    stats: Arc<Mutex<ParserStats>>,
    paths: Vec<(SocketAddr, &'static str)>,
}

impl Parser {
    /// Joins `member`'s group on `topic` and forwards to `consumers`.
    pub async fn start<B: Broker>(
        broker: B,
        topic: &str,
        member: Member,
        pubsub: PubsubConfig,
        consumers: &[SocketAddr],
        sender: SenderConfig,
    ) -> Result<Parser, Error> {
        let sub = Subscribe::new(broker, topic, member, pubsub)
            .connect_wrap(())
            .await
            .map_err(Error::Broker)?;
        let out = HopSender::connect(consumers, sender).await?;
        let paths = out.paths();
        let stats = Arc::new(Mutex::new(ParserStats::default()));
        let st = Arc::clone(&stats);
        let task = tokio::spawn(async move {
            let mut slots = vec![None; 64];
            loop {
                // Acknowledges at the broker what the previous round forwarded.
                let n = match sub.recv(&mut slots).await {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::warn!(error = %e, "subscriber: retrying");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let (mut records, mut malformed, mut undecodable) = (Vec::new(), Vec::new(), 0);
                for payload in slots[..n].iter_mut().filter_map(Option::take) {
                    match RawRecord::decode(&payload) {
                        None => undecodable += 1,
                        Some(raw) => match parse(&raw) {
                            Ok(p) => records.push(p),
                            Err(_) => malformed.push(raw.id),
                        },
                    }
                }
                let (np, nm) = (records.len() as u64, malformed.len() as u64);
                if np + nm > 0 {
                    out.send(Body::Parsed { records, malformed }).await?;
                }
                let mut s = st.lock().unwrap();
                s.parsed += np;
                s.malformed += nm;
                s.undecodable += undecodable;
                s.sender = out.stats();
            }
        });
        Ok(Parser { task, stats, paths })
    }

    /// What it did so far.
    pub fn stats(&self) -> ParserStats {
        *self.stats.lock().unwrap()
    }

    /// The consumers it forwards to, and the datapath negotiated with each.
    pub fn paths(&self) -> &[(SocketAddr, &'static str)] {
        &self.paths
    }

    /// Stops it; `Err` if it had failed (a consumer unreachable past the sender's limit).
    pub async fn stop(self) -> Result<ParserStats, Error> {
        let stats = self.stats();
        if self.task.is_finished() {
            return match self.task.await {
                Ok(Err(e)) => Err(e),
                _ => Ok(stats),
            };
        }
        self.task.abort();
        Ok(stats)
    }
}

// ---- consumer ----------------------------------------------------------------------------

/// Which sequence numbers of one producer were seen: every one below `low`, and those in
/// `above`.
#[derive(Debug, Default)]
struct Seen {
    low: u64,
    above: BTreeSet<u64>,
}

impl Seen {
    /// Records `seq`; false if it was seen before.
    fn insert(&mut self, seq: u64) -> bool {
        if seq < self.low || !self.above.insert(seq) {
            return false;
        }
        while self.above.remove(&self.low) {
            self.low += 1;
        }
        true
    }

    fn contains(&self, seq: u64) -> bool {
        seq < self.low || self.above.contains(&seq)
    }
}

/// The consumer's tally.
#[derive(Debug)]
struct Tally {
    seen: HashMap<u32, Seen>,
    delivered: u64,
    malformed: u64,
    duplicates: u64,
    latency_us: Histogram<u64>,
    by_level: [u64; 4],
    first: Option<Instant>,
    last: Option<Instant>,
}

/// What the consumer saw.
#[derive(Clone, Debug)]
pub struct ConsumerReport {
    /// Parsed records taken in (each record id once).
    pub delivered: u64,
    /// Records the parsers reported malformed (each id once).
    pub malformed: u64,
    /// Copies of ids already accounted for (dropped: a batch a producer resent after an ingest
    /// server died, or a parser resent after a lost acknowledgement).
    pub duplicates: u64,
    /// Messages that did not decode or were not batches of parsed records.
    pub garbage: u64,
    /// End-to-end latency (producer's stamp → consumer), µs: p50, p99, max.
    pub latency_us: [u64; 3],
    /// Delivered records by level: DEBUG, INFO, WARN, ERROR (the summary statistic).
    pub by_level: [u64; 4],
    /// From the first record to the last.
    pub span: Duration,
    /// Parser connections by datapath: `[shm, udp]`.
    pub conns: [u64; 2],
}

/// The consumer: takes parsed records from the parsers over the hop stack, accounts for every
/// record id exactly once (dropping copies), keeps summary statistics and the end-to-end
/// latency from each record's producer stamp.
#[derive(Debug)]
pub struct Consumer {
    addr: SocketAddr,
    tally: Arc<Mutex<Tally>>,
    counters: Arc<ServeCounters>,
    _tasks: JoinSet<()>,
}

impl Consumer {
    /// Serves on `addr` (port 0: a free one).
    pub async fn start(addr: SocketAddr, shm: bool) -> Result<Consumer, Error> {
        let tally = Arc::new(Mutex::new(Tally {
            seen: HashMap::new(),
            delivered: 0,
            malformed: 0,
            duplicates: 0,
            latency_us: Histogram::new_with_bounds(1, 3_600_000_000, 3)
                .expect("valid histogram bounds"),
            by_level: [0; 4],
            first: None,
            last: None,
        }));
        let t = Arc::clone(&tally);
        let handler: hop::Handler = Arc::new(move |body| {
            let t = Arc::clone(&t);
            Box::pin(async move {
                let Body::Parsed { records, malformed } = body else {
                    return false;
                };
                let now = unix_ns();
                let at = Instant::now();
                let mut t = t.lock().unwrap();
                t.first.get_or_insert(at);
                t.last = Some(at);
                for r in records {
                    if t.seen.entry(r.id.producer).or_default().insert(r.id.seq) {
                        t.delivered += 1;
                        t.by_level[r.level as usize] += 1;
                        let us = now.saturating_sub(r.stamp_ns) / 1000;
                        t.latency_us.saturating_record(us.max(1));
                    } else {
                        t.duplicates += 1;
                    }
                }
                for id in malformed {
                    if t.seen.entry(id.producer).or_default().insert(id.seq) {
                        t.malformed += 1;
                    } else {
                        t.duplicates += 1;
                    }
                }
                true
            })
        });
        let counters = Arc::new(ServeCounters::default());
        let (addr, tasks) = hop::serve(addr, shm, handler, Arc::clone(&counters)).await?;
        Ok(Consumer {
            addr,
            tally,
            counters,
            _tasks: tasks,
        })
    }

    /// The address parsers forward to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Record ids accounted for so far (delivered or malformed).
    pub fn accounted(&self) -> u64 {
        let t = self.tally.lock().unwrap();
        t.delivered + t.malformed
    }

    /// Whether record `id` was accounted for.
    pub fn has(&self, id: RecordId) -> bool {
        let t = self.tally.lock().unwrap();
        t.seen.get(&id.producer).is_some_and(|s| s.contains(id.seq))
    }

    /// The ids of producer `p` below `sent[p]` not accounted for (at most `limit` listed), and
    /// how many accounted ids lie beyond what was sent (nobody sent those).
    pub fn missing(&self, sent: &[u64], limit: usize) -> (u64, Vec<RecordId>, u64) {
        let t = self.tally.lock().unwrap();
        let (mut n, mut list, mut extra) = (0, Vec::new(), 0);
        for (p, &count) in sent.iter().enumerate() {
            let empty = Seen::default();
            let s = t.seen.get(&(p as u32)).unwrap_or(&empty);
            for seq in 0..count {
                if !s.contains(seq) {
                    n += 1;
                    if list.len() < limit {
                        list.push(RecordId {
                            producer: p as u32,
                            seq,
                        });
                    }
                }
            }
            extra += s.above.range(count..).count() as u64 + s.low.saturating_sub(count);
        }
        for (&p, s) in &t.seen {
            if p as usize >= sent.len() {
                extra += s.low + s.above.len() as u64;
            }
        }
        (n, list, extra)
    }

    /// The tally so far.
    pub fn report(&self) -> ConsumerReport {
        let t = self.tally.lock().unwrap();
        let q = |x| {
            if t.latency_us.is_empty() {
                0
            } else {
                t.latency_us.value_at_quantile(x)
            }
        };
        ConsumerReport {
            delivered: t.delivered,
            malformed: t.malformed,
            duplicates: t.duplicates,
            garbage: self.counters.malformed.load(Ordering::Relaxed),
            latency_us: [q(0.5), q(0.99), t.latency_us.max()],
            by_level: t.by_level,
            span: match (t.first, t.last) {
                (Some(a), Some(b)) => b - a,
                _ => Duration::ZERO,
            },
            conns: [
                self.counters.conns[0].load(Ordering::Relaxed),
                self.counters.conns[1].load(Ordering::Relaxed),
            ],
        }
    }
}

// ---- producer ----------------------------------------------------------------------------

/// What one producer does.
#[derive(Clone, Debug)]
pub struct ProducerConfig {
    /// Its id (record ids are `(id, seq)`).
    pub id: u32,
    /// Records per second it offers.
    pub rate: f64,
    /// Records per batch: every `batch / rate` seconds a batch of fresh lines (the paper adds
    /// 16 records of about 150 bytes each interarrival time).
    pub batch: usize,
    /// How long it produces.
    pub duration: Duration,
    /// Every `n`-th record is a malformed line (0: none).
    pub malformed_every: u64,
}

/// What a producer did.
#[derive(Clone, Debug, Default)]
pub struct ProducerReport {
    /// Records made (sequence numbers `0..sent`).
    pub sent: u64,
    /// Records an ingest server acknowledged.
    pub acked: u64,
    /// Of them, malformed lines.
    pub malformed: u64,
    /// Its sender's counters.
    pub sender: SenderStats,
    /// Batches that no ingest server acknowledged in time (their records may be lost).
    pub failed: u64,
}

/// Acknowledged record ids of a producer, readable while it runs.
#[derive(Clone, Debug, Default)]
pub struct Acked(Arc<Mutex<Vec<RecordId>>>);

impl Acked {
    /// The ids acknowledged so far.
    pub fn snapshot(&self) -> Vec<RecordId> {
        self.0.lock().unwrap().clone()
    }
}

/// Runs one producer: makes batches of log lines at `cfg.rate` and sends each to the ingest
/// servers through `sender` (balanced, acknowledged, failing over), keeping at most the
/// sender's window of batches unacknowledged. Returns once every batch was acknowledged or
/// given up.
pub async fn produce(cfg: ProducerConfig, sender: HopSender, acked: Acked) -> ProducerReport {
    let batch = cfg.batch.max(1);
    let interval = Duration::from_secs_f64(batch as f64 / cfg.rate.max(1e-3));
    let batches = ((cfg.duration.as_secs_f64() / interval.as_secs_f64()).round() as u64).max(1);
    let start_ns = unix_ns();
    let start = tokio::time::Instant::now();
    let mut inflight = JoinSet::new();
    let mut report = ProducerReport::default();
    let mut seq = 0;
    for k in 0..batches {
        let at = start + interval.mul_f64(k as f64);
        tokio::time::sleep_until(at).await;
        // The line's time is its scheduled time: a producer that falls behind adds to latency.
        let stamp_ns = start_ns + (interval.as_nanos() as u64) * k;
        let mut records = Vec::with_capacity(batch);
        for _ in 0..batch {
            let id = RecordId {
                producer: cfg.id,
                seq,
            };
            let bad =
                cfg.malformed_every > 0 && seq % cfg.malformed_every == cfg.malformed_every - 1;
            report.malformed += u64::from(bad);
            records.push(RawRecord {
                id,
                stamp_ns,
                line: log_line(id, stamp_ns, bad),
            });
            seq += 1;
        }
        let ids: Vec<RecordId> = records.iter().map(|r| r.id).collect();
        // Bounded: at most the sender's window of batches waits for its acknowledgement.
        while inflight.len() >= sender.window() {
            if let Some(done) = inflight.join_next().await {
                tally(&mut report, done);
            }
        }
        let send = sender.send(Body::Raw(records));
        let acked = acked.clone();
        inflight.spawn(async move {
            let ok = send.await.is_ok();
            if ok {
                acked.0.lock().unwrap().extend_from_slice(&ids);
            }
            (ok, ids.len() as u64)
        });
        while let Some(done) = inflight.try_join_next() {
            tally(&mut report, done);
        }
    }
    while let Some(done) = inflight.join_next().await {
        tally(&mut report, done);
    }
    report.sent = seq;
    report.sender = sender.stats();
    report
}

fn tally(report: &mut ProducerReport, done: Result<(bool, u64), tokio::task::JoinError>) {
    match done {
        Ok((true, n)) => report.acked += n,
        _ => report.failed += 1,
    }
}

#[cfg(test)]
mod tests {
    use super::Seen;

    #[test]
    fn seen_counts_each_sequence_number_once_in_any_order() {
        let mut s = Seen::default();
        for seq in [3, 0, 2, 0, 1, 3, 7] {
            s.insert(seq);
        }
        assert_eq!(s.low, 4, "0..4 contiguous");
        assert!(s.contains(7) && !s.contains(4) && !s.contains(6));
        assert!(!s.insert(2), "a copy below the contiguous prefix");
        assert!(!s.insert(7), "a copy above it");
        assert!(
            s.insert(u64::MAX),
            "any value from the network is just another id"
        );
        assert!(s.insert(4) && s.insert(5) && s.insert(6));
        assert_eq!((s.low, s.above.len()), (8, 1));
    }
}
