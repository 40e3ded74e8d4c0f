//! Kafka through rskafka (feature `kafka`).
//!
//! A topic has a fixed number of partitions ([`KafkaBroker::connect`]'s `partitions`; every
//! client of a topic must use the same). A keyed message goes to partition
//! `fnv1a(key) % partitions`, so equal keys keep their order ([`Ordering::PerKey`];
//! [`Ordering::Total`] with one partition); an unkeyed burst goes to one partition, chosen
//! round-robin per burst. The message id travels in front of the record's value (4 bytes
//! `chn1`, then the 16-byte id; a value without them is delivered whole, without an id): 20
//! bytes a record, fewer than a record header would take. The records of a burst share one
//! timestamp, the wall-clock time of the publish.
//!
//! Large bursts: the producer splits a burst into produce requests of at most
//! [`MAX_REQUEST_BYTES`] of records each ([`split_records`]), sent one after the other (a later
//! request once the earlier one is acknowledged, so a failure never leaves a later part
//! stored before an earlier one), so no request exceeds the broker's default
//! `message.max.bytes` (1 MiB). The workspace builds rskafka patched
//! (third_party/rskafka/CHUNNEL-PATCH.md) to write a request in one piece, with `TCP_NODELAY`
//! on its broker connections: the published 0.6 writes a request larger than its 8 KiB buffer
//! as two writes (a burst of a hundred 64-byte messages makes a 9.5 KB request), a second
//! `sendto` a request, and with Nagle's algorithm the second waits for the broker's delayed ACK
//! (about 40 ms a request).
//!
//! Fetching: a fetch response holds whole record batches (a producer's burst is one), so it
//! often brings more records than the subscriber has room for; the consumer keeps the rest
//! (at most one response, 4 MiB) and hands it out on the next fetches without asking the
//! broker again. A slow application on Kafka therefore holds up to `prefetch` messages plus
//! the rest of one response.
//! A member that owns several partitions fetches them one at a time (rskafka's fetch names one
//! partition), each fetch waiting at the broker for up to its share of [`crate::Config::poll`]:
//! a message on another partition waits until that fetch ends (up to `poll / n` with `n`
//! partitions), so latency-sensitive subscribers of multi-partition topics lower `poll`.
//!
//! rskafka has no consumer-group protocol. A group through [`KafkaBroker`] is static: member
//! `index` of `count` owns partitions `p` with `p % count == index`. A group through
//! `group::KafkaGroupBroker` (feature `group`) rebalances as members join, leave or die:
//! its members agree on the assignment through a chunnel-rendezvous store, and a member
//! giving up a partition commits its position before the new owner starts there (see
//! the `group` module). Either way acknowledged positions are committed to the topic
//! `chunnel-offsets` (key `group/topic/partition`, value the next offset): by a background
//! task, the latest ones at most every 200 ms, and at once by [`Consumer::ack_confirmed`],
//! which returns when the broker acknowledged the commit (so at-most-once works on Kafka). A
//! member starts at its group's last committed position, or at the earliest record, so a
//! member that restarts gets again what was acknowledged in its last 200 ms (its new dedup
//! window does not know those ids). A position the partition no longer has (records deleted
//! by retention or `DeleteRecords` under it) moves to the earliest record left, with a
//! warning, as Kafka's `auto.offset.reset=earliest`. rskafka takes records as `Vec<u8>`, so publishing copies
//! each payload once.
//!
//! Ordering lanes ([`crate::order`]): service-side ordering uses the topic `{t}-s` with one
//! partition, receiver-side the topic `{t}-r` with one partition per lane, both through
//! [`KafkaBroker::with_partitions`] on the same cluster connection.

#[cfg(feature = "group")]
pub mod group;

/// The rskafka crate this backend uses (for direct use beside the Chunnels).
pub use rskafka;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::time::Duration;

use bytes::{Buf, Bytes};
use rskafka::BackoffConfig;
use rskafka::client::error::{Error as KError, ProtocolError};
use rskafka::client::partition::{Compression, OffsetAt, PartitionClient, UnknownTopicHandling};
use rskafka::client::{Client, ClientBuilder};
use rskafka::record::Record;

use crate::broker::{Broker, Consumer, Incoming, Lane, Member, Outgoing, Producer};
use crate::{Error, MsgId, Ordering};

const NAME: &str = "kafka";
/// Marks a record value that starts with a message id.
const MAGIC: &[u8; 4] = b"chn1";
/// The magic and the 16-byte id in front of the payload.
const PREFIX: usize = 4 + 16;
/// How often acknowledged positions are committed (at most).
const COMMIT_EVERY: Duration = Duration::from_millis(200);
const OFFSETS_TOPIC: &str = "chunnel-offsets";
/// The offsets topic's configs ([`KafkaBroker::offsets_partition`]): compacted, in segments
/// of at most an hour (compaction leaves the open segment alone, and a member reads the whole
/// topic when it opens partitions, so an hour of commits is the most it reads uncompacted).
const OFFSETS_TOPIC_CONFIGS: &[(&str, &str)] =
    &[("cleanup.policy", "compact"), ("segment.ms", "3600000")];
const FETCH_MAX_BYTES: i32 = 4 << 20;

fn unavailable(op: &'static str, e: KError) -> Error {
    Error::Unavailable {
        broker: NAME,
        op,
        waited: Duration::ZERO,
        last: e.to_string(),
    }
}

/// Fetches the records of `client`'s partition from `pos`: the records and the position they
/// were read from. A position the partition no longer has (its records deleted by retention
/// or `DeleteRecords`) or does not have (the topic created again) is moved to the earliest
/// record the partition has, with a warning, as Kafka's `auto.offset.reset=earliest`: what
/// was deleted cannot be delivered, and what is there is not skipped.
async fn fetch_at(
    client: &PartitionClient,
    pos: i64,
    wait_ms: i32,
) -> Result<(Vec<rskafka::record::RecordAndOffset>, i64), Error> {
    match client.fetch_records(pos, 1..FETCH_MAX_BYTES, wait_ms).await {
        Ok((records, _hwm)) => Ok((records, pos)),
        Err(KError::ServerError {
            protocol_error: ProtocolError::OffsetOutOfRange,
            ..
        }) => {
            let earliest = client
                .get_offset(OffsetAt::Earliest)
                .await
                .map_err(|e| unavailable("fetch", e))?;
            tracing::warn!(
                topic = client.topic(),
                partition = client.partition(),
                from = pos,
                to = earliest,
                "kafka: position out of range (records deleted, or the topic created again); \
                 reading from the earliest record"
            );
            let (records, _hwm) = client
                .fetch_records(earliest, 1..FETCH_MAX_BYTES, wait_ms)
                .await
                .map_err(|e| unavailable("fetch", e))?;
            Ok((records, earliest))
        }
        Err(e) => Err(unavailable("fetch", e)),
    }
}

/// A Kafka cluster (one bootstrap list), shared by the Chunnels that use it.
#[derive(Clone)]
pub struct KafkaBroker {
    inner: Arc<Inner>,
    partitions: i32,
}

struct Inner {
    client: Client,
    op_timeout: Duration,
}

impl std::fmt::Debug for KafkaBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaBroker")
            .field("partitions", &self.partitions)
            .finish_non_exhaustive()
    }
}

impl KafkaBroker {
    /// Connects to the cluster through `bootstrap` (`host:port` each), for topics of
    /// `partitions` partitions. Every broker operation is retried at most `op_timeout`.
    pub async fn connect(
        bootstrap: Vec<String>,
        partitions: i32,
        op_timeout: Duration,
    ) -> Result<KafkaBroker, Error> {
        if partitions < 1 {
            return Err(Error::Config {
                what: format!("{partitions} partitions"),
            });
        }
        let backoff = BackoffConfig {
            init_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(500),
            base: 2.,
            deadline: Some(op_timeout),
        };
        let build = ClientBuilder::new(bootstrap)
            .client_id("chunnel-pubsub")
            .backoff_config(backoff)
            .build();
        let client = match tokio::time::timeout(op_timeout, build).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(unavailable("connect", e)),
            Err(_) => {
                return Err(Error::Unavailable {
                    broker: NAME,
                    op: "connect",
                    waited: op_timeout,
                    last: "timed out".into(),
                });
            }
        };
        Ok(KafkaBroker {
            inner: Arc::new(Inner { client, op_timeout }),
            partitions,
        })
    }

    /// The same cluster connection for topics of `partitions` partitions (the ordering lanes:
    /// one partition for service-side ordering, several for receiver-side).
    pub fn with_partitions(&self, partitions: i32) -> Result<KafkaBroker, Error> {
        if partitions < 1 {
            return Err(Error::Config {
                what: format!("{partitions} partitions"),
            });
        }
        Ok(KafkaBroker {
            inner: self.inner.clone(),
            partitions,
        })
    }

    /// The underlying rskafka client (the benchmark uses it directly as the baseline).
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// Creates `topic` with `partitions` partitions unless it exists.
    pub async fn ensure_topic(&self, topic: &str, partitions: i32) -> Result<(), Error> {
        self.ensure_topic_with(topic, partitions, &[]).await
    }

    /// Creates `topic` with `partitions` partitions and the topic-level `configs` unless it
    /// exists (an existing topic keeps its configs).
    async fn ensure_topic_with(
        &self,
        topic: &str,
        partitions: i32,
        configs: &[(&str, &str)],
    ) -> Result<(), Error> {
        let controller = self
            .inner
            .client
            .controller_client()
            .map_err(|e| unavailable("create topic", e))?;
        match controller
            .create_topic_with_configs(topic, partitions, 1, configs, 5_000)
            .await
        {
            Ok(()) => Ok(()),
            Err(KError::ServerError {
                protocol_error: ProtocolError::TopicAlreadyExists,
                ..
            }) => Ok(()),
            Err(e) => Err(unavailable("create topic", e)),
        }
    }

    /// The offsets topic's one partition, the topic created first if missing. It is compacted
    /// (`cleanup.policy=compact`, as Kafka's own `__consumer_offsets`): the newest position of
    /// every key is kept however old, where the broker's default time retention (7 days)
    /// would delete a quiet group's positions and send its next member back to the earliest
    /// record. A topic created by an older version keeps its configs.
    async fn offsets_partition(&self) -> Result<Arc<PartitionClient>, Error> {
        self.ensure_topic_with(OFFSETS_TOPIC, 1, OFFSETS_TOPIC_CONFIGS)
            .await?;
        self.partition(OFFSETS_TOPIC, 0).await
    }

    async fn partition(&self, topic: &str, p: i32) -> Result<Arc<PartitionClient>, Error> {
        self.inner
            .client
            .partition_client(topic, p, UnknownTopicHandling::Retry)
            .await
            .map(Arc::new)
            .map_err(|e| unavailable("open partition", e))
    }
}

/// The most record bytes (estimated by [`record_bytes`]) the producer puts in one produce
/// request: half the broker's default `message.max.bytes`, leaving room for the framing.
pub const MAX_REQUEST_BYTES: usize = 512 * 1024;

/// A record's size in a produce request, over-estimated: its key, value and headers, plus 16
/// bytes of framing (length, attributes, timestamp and offset deltas, the lengths).
pub fn record_bytes(r: &Record) -> usize {
    let key = r.key.as_ref().map_or(0, Vec::len);
    let value = r.value.as_ref().map_or(0, Vec::len);
    let headers: usize = r.headers.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
    key + value + headers + 16
}

/// Splits `records`, in order, into consecutive runs of at most `max` bytes each (by
/// [`record_bytes`]); a record larger than `max` makes a run of its own. No run is empty.
pub fn split_records(records: Vec<Record>, max: usize) -> Vec<Vec<Record>> {
    let mut out: Vec<Vec<Record>> = Vec::new();
    let mut bytes = 0;
    for r in records {
        let b = record_bytes(&r);
        match out.last_mut() {
            Some(run) if bytes + b <= max => {
                bytes += b;
                run.push(r);
            }
            _ => {
                bytes = b;
                out.push(vec![r]);
            }
        }
    }
    out
}

/// A message's [`record_bytes`] once it is a record ([`record`]: no headers).
fn outgoing_bytes(m: &Outgoing) -> usize {
    m.key.as_ref().map_or(0, Bytes::len) + PREFIX + m.payload.len() + 16
}

/// Produces `records` (of `bytes` by [`record_bytes`] together) to `part` in requests of at
/// most [`MAX_REQUEST_BYTES`], one after the other.
async fn produce(part: &PartitionClient, records: Vec<Record>, bytes: usize) -> Result<(), Error> {
    if bytes <= MAX_REQUEST_BYTES {
        // One request (the usual burst): the records as they are, not regrouped.
        part.produce(records, Compression::NoCompression)
            .await
            .map_err(|e| unavailable("produce", e))?;
        return Ok(());
    }
    for run in split_records(records, MAX_REQUEST_BYTES) {
        part.produce(run, Compression::NoCompression)
            .await
            .map_err(|e| unavailable("produce", e))?;
    }
    Ok(())
}

/// The wall-clock time of a record (read once per burst: its records share it).
fn now() -> rskafka::chrono::DateTime<rskafka::chrono::Utc> {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    rskafka::chrono::DateTime::from_timestamp_millis(ms).unwrap_or_default()
}

/// FNV-1a: a key's partition, the same in every process.
fn fnv1a(key: &[u8]) -> u64 {
    key.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn record(m: &Outgoing, timestamp: rskafka::chrono::DateTime<rskafka::chrono::Utc>) -> Record {
    let mut value = Vec::with_capacity(PREFIX + m.payload.len());
    value.extend_from_slice(MAGIC);
    value.extend_from_slice(&m.id.to_bytes());
    value.extend_from_slice(&m.payload);
    Record {
        key: m.key.as_ref().map(|k| k.to_vec()),
        value: Some(value),
        headers: BTreeMap::new(),
        timestamp,
    }
}

/// A record value's message id and payload: the id if the value starts with [`MAGIC`] (then
/// the payload follows it), else no id and the whole value.
fn split_value(mut value: Bytes) -> (Option<MsgId>, Bytes) {
    if value.len() >= PREFIX && value.starts_with(MAGIC) {
        let id = MsgId::from_bytes(&value[MAGIC.len()..PREFIX]);
        // Advanced in place: `slice` would make the buffer shared (an allocation a record).
        value.advance(PREFIX);
        (id, value)
    } else {
        (None, value)
    }
}

impl Broker for KafkaBroker {
    const NAME: &'static str = NAME;
    type Producer = KafkaProducer;
    type Consumer = KafkaConsumer;

    /// [`Consumer::ack_confirmed`] commits the positions and waits for the broker.
    fn acks_before_return(&self) -> bool {
        true
    }

    fn ordering(&self) -> Ordering {
        if self.partitions == 1 {
            Ordering::Total
        } else {
            Ordering::PerKey
        }
    }

    fn service_lane(&self, topic: &str) -> Result<Lane<Self>, Error> {
        Ok(Lane {
            broker: self.with_partitions(1)?,
            topic: format!("{topic}-s"),
        })
    }

    fn spread_lanes(&self, topic: &str, n: u32) -> Result<Vec<Lane<Self>>, Error> {
        let partitions = i32::try_from(n).map_err(|_| Error::Config {
            what: format!("{n} lanes"),
        })?;
        Ok(vec![Lane {
            broker: self.with_partitions(partitions)?,
            topic: format!("{topic}-r"),
        }])
    }

    async fn producer(&self, topic: &str) -> Result<KafkaProducer, Error> {
        self.ensure_topic(topic, self.partitions).await?;
        let mut parts = Vec::with_capacity(self.partitions as usize);
        for p in 0..self.partitions {
            parts.push(self.partition(topic, p).await?);
        }
        Ok(KafkaProducer {
            parts,
            next: AtomicUsize::new(0),
        })
    }

    async fn consumer(
        &self,
        topic: &str,
        member: &Member,
        _prefetch: usize,
    ) -> Result<KafkaConsumer, Error> {
        self.ensure_topic(topic, self.partitions).await?;
        let offsets = self.offsets_partition().await?;
        let key = |p: i32| format!("{}/{topic}/{p}", member.group);
        let committed = read_commits(&offsets).await?;
        let mut parts = Vec::new();
        let mut keys = Vec::new();
        for p in (0..self.partitions).filter(|p| *p as u32 % member.count == member.index) {
            let client = self.partition(topic, p).await?;
            let k = key(p);
            let pos = match committed.get(&k) {
                Some(&pos) => pos,
                None => client
                    .get_offset(OffsetAt::Earliest)
                    .await
                    .map_err(|e| unavailable("read offset", e))?,
            };
            keys.push(k);
            parts.push(Part { client, pos });
        }
        let (commit, rx) = tokio::sync::watch::channel(Vec::new());
        let commits = Arc::new(Commits {
            done: tokio::sync::Mutex::new(vec![-1; keys.len()]),
            offsets,
            keys,
            op_timeout: self.inner.op_timeout,
        });
        tokio::spawn(committer(commits.clone(), rx));
        Ok(KafkaConsumer {
            parts,
            next: 0,
            commit,
            acked: Vec::new(),
            stash: VecDeque::new(),
            commits,
        })
    }
}

/// Stores `positions` (offsets key, next offset) in the offsets topic; returns once the broker
/// acknowledged them, or fails within `op_timeout`. Nothing to store: `Ok` at once.
async fn produce_positions(
    offsets: &PartitionClient,
    op_timeout: Duration,
    positions: Vec<(Vec<u8>, i64)>,
) -> Result<(), Error> {
    if positions.is_empty() {
        return Ok(());
    }
    let timestamp = now();
    let records: Vec<Record> = positions
        .into_iter()
        .map(|(key, pos)| Record {
            key: Some(key),
            value: Some(pos.to_be_bytes().to_vec()),
            headers: BTreeMap::new(),
            timestamp,
        })
        .collect();
    match tokio::time::timeout(
        op_timeout,
        offsets.produce(records, Compression::NoCompression),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(unavailable("commit", e)),
        Err(_) => Err(Error::Unavailable {
            broker: NAME,
            op: "commit",
            waited: op_timeout,
            last: "timed out".into(),
        }),
    }
}

/// The highest committed position of every key in the offsets topic.
async fn read_commits(offsets: &PartitionClient) -> Result<HashMap<String, i64>, Error> {
    let end = offsets
        .get_offset(OffsetAt::Latest)
        .await
        .map_err(|e| unavailable("read offsets", e))?;
    let mut pos = offsets
        .get_offset(OffsetAt::Earliest)
        .await
        .map_err(|e| unavailable("read offsets", e))?;
    let mut out = HashMap::new();
    while pos < end {
        let (records, _) = offsets
            .fetch_records(pos, 1..FETCH_MAX_BYTES, 100)
            .await
            .map_err(|e| unavailable("read offsets", e))?;
        let Some(last) = records.last() else { break };
        pos = last.offset + 1;
        for r in records {
            let (Some(k), Some(v)) = (r.record.key, r.record.value) else {
                continue;
            };
            let (Ok(k), Ok(v)) = (String::from_utf8(k), <[u8; 8]>::try_from(v.as_slice())) else {
                continue;
            };
            // The highest position per key: a member's positions only move forward, and a
            // commit that reaches the broker late (sent by a member that has since lost the
            // partition) must not move it back.
            let v = i64::from_be_bytes(v);
            out.entry(k)
                .and_modify(|e: &mut i64| *e = (*e).max(v))
                .or_insert(v);
        }
    }
    Ok(out)
}

/// A static member's commits to the offsets topic: one per owned partition.
struct Commits {
    offsets: Arc<PartitionClient>,
    /// `group/topic/partition` per owned partition.
    keys: Vec<String>,
    /// The positions stored, per owned partition (-1: none). Held around every produce, so
    /// the background commits and the synchronous ones are stored in the order they were
    /// taken, and a position never goes back.
    done: tokio::sync::Mutex<Vec<i64>>,
    op_timeout: Duration,
}

impl Commits {
    /// Stores the positions of `latest` above the stored ones; returns once the broker
    /// acknowledged the produce.
    async fn commit(&self, latest: &[i64]) -> Result<(), Error> {
        let mut done = self.done.lock().await;
        let records: Vec<(Vec<u8>, i64)> = self
            .keys
            .iter()
            .zip(latest)
            .zip(done.iter())
            .filter(|((_, new), old)| *new > *old)
            .map(|((k, new), _)| (k.clone().into_bytes(), *new))
            .collect();
        produce_positions(&self.offsets, self.op_timeout, records).await?;
        for (d, new) in done.iter_mut().zip(latest) {
            *d = (*d).max(*new);
        }
        Ok(())
    }
}

/// Commits the latest positions (one per owned partition, -1 for none yet) until the consumer
/// is dropped; a failed commit is retried with whatever is latest then.
async fn committer(commits: Arc<Commits>, mut rx: tokio::sync::watch::Receiver<Vec<i64>>) {
    while rx.changed().await.is_ok() {
        let latest = rx.borrow_and_update().clone();
        if commits.commit(&latest).await.is_err() {
            tracing::debug!("kafka offset commit failed; retrying");
            rx.mark_changed();
        }
        // Positions acknowledged meanwhile are committed together, the latest only.
        tokio::time::sleep(COMMIT_EVERY).await;
    }
}

/// Publishes to one Kafka topic.
pub struct KafkaProducer {
    parts: Vec<Arc<PartitionClient>>,
    next: AtomicUsize,
}

impl Producer for KafkaProducer {
    async fn publish(&self, batch: &[Outgoing]) -> Result<(), Error> {
        let n = self.parts.len();
        let ts = now();
        if n == 1 || batch.iter().all(|m| m.key.is_none()) {
            let p = self.next.fetch_add(1, AtomicOrdering::Relaxed) % n;
            let bytes = batch.iter().map(outgoing_bytes).sum();
            let records = batch.iter().map(|m| record(m, ts)).collect();
            return produce(&self.parts[p], records, bytes).await;
        }
        let rr = self.next.fetch_add(1, AtomicOrdering::Relaxed) % n;
        let mut by_part: Vec<(Vec<Record>, usize)> = (0..n).map(|_| (Vec::new(), 0)).collect();
        for m in batch {
            let p = match &m.key {
                Some(k) => (fnv1a(k) % n as u64) as usize,
                None => rr,
            };
            by_part[p].0.push(record(m, ts));
            by_part[p].1 += outgoing_bytes(m);
        }
        for (p, (records, bytes)) in by_part.into_iter().enumerate() {
            if !records.is_empty() {
                produce(&self.parts[p], records, bytes).await?;
            }
        }
        Ok(())
    }
}

struct Part {
    client: Arc<PartitionClient>,
    /// The next offset to fetch.
    pos: i64,
}

/// One member of a (static) Kafka group.
pub struct KafkaConsumer {
    parts: Vec<Part>,
    next: usize,
    commit: tokio::sync::watch::Sender<Vec<i64>>,
    /// The next offset after the highest acknowledged one, per owned partition (-1: none).
    acked: Vec<i64>,
    /// Records of the last fetch response beyond what that fetch could hand out: the next
    /// fetches take them first (a response holds whole record batches, so it often brings
    /// more than `max`; fetching them again would cost a round trip and the transfer). At
    /// most one response's records (`FETCH_MAX_BYTES`).
    stash: VecDeque<Incoming<KafkaToken>>,
    /// Stores positions (the background task's and [`Consumer::ack_confirmed`]'s).
    commits: Arc<Commits>,
}

/// Acknowledges one Kafka record: its owned-partition index and offset.
#[derive(Clone, Copy, Debug)]
pub struct KafkaToken {
    part: u32,
    offset: i64,
}

impl Consumer for KafkaConsumer {
    type Token = KafkaToken;

    async fn fetch(
        &mut self,
        max: usize,
        wait: Duration,
        out: &mut VecDeque<Incoming<KafkaToken>>,
    ) -> Result<(), Error> {
        if !self.stash.is_empty() {
            let take = max.min(self.stash.len());
            out.extend(self.stash.drain(..take));
            return Ok(());
        }
        let n = self.parts.len();
        if n == 0 {
            // More members than partitions: this one owns none.
            tokio::time::sleep(wait).await;
            return Ok(());
        }
        let wait_ms = (wait.as_millis() as usize / n).clamp(1, i32::MAX as usize) as i32;
        for _ in 0..n {
            let i = self.next % n;
            self.next = self.next.wrapping_add(1);
            let part = &mut self.parts[i];
            let (records, from) = fetch_at(&part.client, part.pos, wait_ms).await?;
            part.pos = from;
            let mut got = 0;
            for r in records {
                if r.offset < part.pos {
                    continue;
                }
                part.pos = r.offset + 1;
                got += 1;
                let value = r.record.value.map(Bytes::from).unwrap_or_default();
                let (id, payload) = split_value(value);
                let to = if got <= max {
                    &mut *out
                } else {
                    &mut self.stash
                };
                to.push_back(Incoming {
                    id,
                    key: r.record.key.map(Bytes::from),
                    payload,
                    token: KafkaToken {
                        part: i as u32,
                        offset: r.offset,
                    },
                });
            }
            if got > 0 {
                return Ok(());
            }
        }
        Ok(())
    }

    async fn ack(&mut self, tokens: &mut Vec<KafkaToken>) -> Result<(), Error> {
        if self.acked.len() != self.parts.len() {
            self.acked = vec![-1; self.parts.len()];
        }
        for t in tokens.drain(..) {
            let a = &mut self.acked[t.part as usize];
            *a = (*a).max(t.offset + 1);
        }
        self.commit.send_replace(self.acked.clone());
        Ok(())
    }

    /// Acknowledges, then commits the positions at once and returns when the broker stored
    /// them: a member starting after that starts behind these messages.
    async fn ack_confirmed(&mut self, tokens: &mut Vec<KafkaToken>) -> Result<(), Error> {
        self.ack(tokens).await?;
        self.commits.commit(&self.acked).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(len: usize, tag: u8) -> Record {
        Record {
            key: None,
            value: Some(vec![tag; len]),
            headers: BTreeMap::new(),
            timestamp: now(),
        }
    }

    #[test]
    fn a_burst_is_split_in_order_under_the_limit() {
        // 100 Chunnel records of 64-byte payloads: 100 * (20 + 64 + 16) = 10_000 bytes, one
        // request; under a 7 KB limit, two.
        let records: Vec<Record> = (0..100).map(|i| rec(PREFIX + 64, i)).collect();
        assert_eq!(split_records(records.clone(), MAX_REQUEST_BYTES).len(), 1);
        let runs = split_records(records, 7 * 1024);
        assert_eq!(runs.len(), 2);
        let sizes: Vec<usize> = runs
            .iter()
            .map(|r| r.iter().map(record_bytes).sum())
            .collect();
        assert!(sizes.iter().all(|&s| s <= 7 * 1024), "{sizes:?}");
        let tags: Vec<u8> = runs
            .iter()
            .flatten()
            .map(|r| r.value.as_ref().map_or(0, |v| v[0]))
            .collect();
        assert_eq!(tags, (0..100).collect::<Vec<u8>>());
    }

    #[test]
    fn a_small_burst_stays_one_request_and_a_large_record_goes_alone() {
        let runs = split_records((0..10).map(|i| rec(64, i)).collect(), MAX_REQUEST_BYTES);
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].len(), 10);
        let runs = split_records(
            vec![rec(10, 0), rec(MAX_REQUEST_BYTES, 1), rec(10, 2)],
            MAX_REQUEST_BYTES,
        );
        let lens: Vec<usize> = runs.iter().map(Vec::len).collect();
        assert_eq!(lens, [1, 1, 1]);
        assert!(split_records(Vec::new(), MAX_REQUEST_BYTES).is_empty());
    }

    #[test]
    fn a_value_without_the_magic_has_no_id() {
        let (id, payload) = split_value(Bytes::from_static(b"plain"));
        assert!(id.is_none());
        assert_eq!(&payload[..], b"plain");
        let (id, payload) = split_value(Bytes::from_static(b"chn1short"));
        assert!(id.is_none());
        assert_eq!(&payload[..], b"chn1short");
    }

    #[test]
    fn a_record_value_gives_back_its_id_and_payload() {
        for payload in [&b""[..], b"p", &[7u8; 300]] {
            let m = Outgoing {
                id: MsgId {
                    producer: 0x0123_4567_89ab_cdef,
                    seq: 42,
                },
                key: None,
                payload: Bytes::copy_from_slice(payload),
            };
            let r = record(&m, now());
            assert_eq!(r.value.as_ref().map(Vec::len), Some(PREFIX + payload.len()));
            assert_eq!(outgoing_bytes(&m), record_bytes(&r));
            let keyed = Outgoing {
                key: Some(Bytes::from_static(b"key")),
                ..m.clone()
            };
            assert_eq!(outgoing_bytes(&keyed), record_bytes(&record(&keyed, now())));
            // As a fetch hands it over: a `Vec` turned into `Bytes`.
            let (id, got) = split_value(Bytes::from(r.value.unwrap_or_default()));
            assert_eq!(id, Some(m.id));
            assert_eq!(got, m.payload);
        }
    }
}
