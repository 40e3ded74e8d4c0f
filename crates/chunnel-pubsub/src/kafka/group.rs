//! Kafka consumer groups that rebalance as members come and go (features `kafka` and `group`).
//!
//! rskafka has no consumer-group protocol, so the members of a Kafka group agree on who reads
//! which partition through a chunnel-rendezvous store (the embedded SQLite store, Redis or
//! etcd): the same leases, group record and two-phase-commit transitions the ordering groups
//! use ([`crate::order`]), driven here by a small sans-IO core ([`Core`]) instead of a
//! [`chunnel_rendezvous::Participant`] (the record committed at each epoch is a member list,
//! not a Chunnel stack).
//!
//! * The rendezvous group `kg.{group}.{topic}` holds, as its committed record, the sorted list
//!   of member names the partitions are assigned among at that epoch ([`encode_members`],
//!   docs/wire.md §18.3). The assignment is a pure function of that list ([`owner`]): the
//!   `i`-th name owns the partitions `p` with `p % n == i`.
//! * Every member holds a lease in the store. When the live members differ from the committed
//!   list, a member proposes the live list as the next epoch's. Every live member votes yes
//!   only once it holds no partition the proposed list takes from it: it stops fetching
//!   those, waits (at most [`GroupConfig::drain`]) until what it fetched from them was
//!   acknowledged, and commits their acknowledged positions to `chunnel-offsets` with a
//!   produce the broker acknowledged (a synchronous commit). The proposer commits the epoch
//!   once every live member said yes; only then do the members open the partitions they
//!   gain, from the committed positions. So no partition is fetched by two members at one
//!   epoch, and the new owner starts where the old one's acknowledgements ended.
//! * A member that dies (or stops renewing its lease) leaves the live list when its lease
//!   runs out; the transition then commits without it. A member fences itself first: it
//!   fetches and commits nothing once its last successful renewal is older than 3/4 of the
//!   lease, so it has stopped before the store lets anyone else take its partitions (the
//!   fence counts from when the renewal was sent, on the member's clock; it assumes the
//!   store's clock does not run faster). What it acknowledged in its last 200 ms (not
//!   committed yet) and what it fetched without acknowledging is fetched again by the new
//!   owner.
//! * At-most-once: [`Consumer::ack_confirmed`] commits at once and returns `Ok` only if the
//!   member's lease still certainly held when the broker acknowledged the commit, and fails
//!   for records of a partition the member gave up since it fetched them (the new owner hands
//!   those out), so a message handed out is never handed out by another member.
//! * Member names must be unique in the group: two live consumers under one name would both
//!   take that name's partitions.
//! * A member that stops reading keeps its partitions (no one else reads them) until it
//!   leaves or its lease runs out; it holds at most `prefetch` messages.
//! * [`KafkaGroupBroker::leave`] leaves cleanly: the member stops fetching, commits its
//!   acknowledged positions synchronously and leaves the store, so nothing it acknowledged is
//!   fetched again.
//!
//! This consumer fetches each partition by itself and hands out at most `max` records of a
//! response (it fetches the rest again), so it is simpler and slower than the static
//! [`KafkaConsumer`](super::KafkaConsumer).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use chunnel_rendezvous::{Ballot, JoinReply, Snapshot, Store, Transition};
use rskafka::client::partition::{Compression, OffsetAt, PartitionClient};
use rskafka::record::Record as KRecord;
use tokio::sync::{mpsc, oneshot};

use super::{
    FETCH_MAX_BYTES, KafkaBroker, KafkaProducer, OFFSETS_TOPIC, now, read_commits, split_value,
    unavailable,
};
use crate::broker::{Broker, Consumer, Incoming, Lane, Member};
use crate::{Error, Ordering};

/// The first bytes of an assignment record ([`encode_members`]).
pub const MAGIC: &[u8; 4] = b"ckg1";
/// The most members an assignment record holds.
pub const MAX_MEMBERS: usize = 1024;
/// The longest member name (the rendezvous stores' limit on member ids).
pub const MAX_NAME: usize = 128;
/// How long past a transition's deadline a member other than its proposer waits before it
/// aborts it (the proposer may have died).
pub const ORPHAN_GRACE_MS: u64 = 1_000;

/// The member that owns partition `p` among `members` (sorted names): the `i`-th owns the
/// partitions with `p % members.len() == i`. `None` without members.
pub fn owner(members: &[String], p: i32) -> Option<usize> {
    if members.is_empty() || p < 0 {
        return None;
    }
    Some(p as usize % members.len())
}

/// The partitions (of `partitions`) that `me` owns among `members`, ascending.
pub fn owned(members: &[String], me: &str, partitions: i32) -> BTreeSet<i32> {
    match members.iter().position(|m| m == me) {
        Some(i) => (0..partitions)
            .filter(|&p| owner(members, p) == Some(i))
            .collect(),
        None => BTreeSet::new(),
    }
}

fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= MAX_NAME && !n.chars().any(|c| c.is_control() || c == '/')
}

/// The assignment record of an epoch (docs/wire.md §18.3): [`MAGIC`], the member count (u16,
/// big-endian), then each name as a length byte and its UTF-8 bytes, sorted and distinct.
/// `members` must be sorted, distinct, valid names, at most [`MAX_MEMBERS`]
/// ([`decode_members`] refuses anything else); the store's member ids are.
pub fn encode_members(members: &[String]) -> Bytes {
    let mut out = Vec::with_capacity(6 + members.iter().map(|m| m.len() + 1).sum::<usize>());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(members.len().min(MAX_MEMBERS) as u16).to_be_bytes());
    for m in members.iter().take(MAX_MEMBERS) {
        out.push(m.len().min(MAX_NAME) as u8);
        out.extend_from_slice(&m.as_bytes()[..m.len().min(MAX_NAME)]);
    }
    Bytes::from(out)
}

/// Reads an assignment record ([`encode_members`]); [`Error::Corrupt`] for anything else
/// (another magic, a count over [`MAX_MEMBERS`], a name that is empty, too long, not UTF-8,
/// holds a control character or `/`, names not strictly ascending, bytes left over).
pub fn decode_members(bytes: &[u8]) -> Result<Vec<String>, Error> {
    let corrupt = |what: &'static str| Error::Corrupt {
        what: "kafka group assignment record",
        why: what,
    };
    let rest = bytes.strip_prefix(MAGIC).ok_or(corrupt("no magic"))?;
    let (count, mut rest) = rest.split_first_chunk::<2>().ok_or(corrupt("no count"))?;
    let count = u16::from_be_bytes(*count) as usize;
    if count > MAX_MEMBERS {
        return Err(corrupt("too many members"));
    }
    let mut out: Vec<String> = Vec::with_capacity(count);
    for _ in 0..count {
        let (&len, tail) = rest.split_first().ok_or(corrupt("truncated"))?;
        let len = len as usize;
        if tail.len() < len {
            return Err(corrupt("truncated"));
        }
        let name = std::str::from_utf8(&tail[..len]).map_err(|_| corrupt("not UTF-8"))?;
        if !valid_name(name) {
            return Err(corrupt("invalid name"));
        }
        if out.last().is_some_and(|l| l.as_str() >= name) {
            return Err(corrupt("names not strictly ascending"));
        }
        out.push(name.to_owned());
        rest = &tail[len..];
    }
    if !rest.is_empty() {
        return Err(corrupt("trailing bytes"));
    }
    Ok(out)
}

/// A pending transition to a new assignment, as [`Core`] sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    /// The transition's id.
    pub id: u64,
    /// Who proposed it (only the proposer commits it).
    pub proposer: String,
    /// The proposed member list.
    pub members: Vec<String>,
    /// When its proposer aborts it (Unix ms).
    pub deadline_ms: u64,
    /// The members that voted yes.
    pub yes: Vec<String>,
}

/// One read of the group's record, as [`Core`] sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupRecord {
    /// The committed epoch.
    pub epoch: u64,
    /// The member list the partitions are assigned among at `epoch`.
    pub members: Vec<String>,
    /// The live members (leases not expired), sorted.
    pub live: Vec<String>,
    /// The pending transition.
    pub pending: Option<Pending>,
}

impl GroupRecord {
    /// The record of a rendezvous snapshot; [`Error::Corrupt`] if an assignment does not
    /// decode.
    pub fn from_snapshot(s: &Snapshot) -> Result<GroupRecord, Error> {
        let members = match &s.committed {
            Some(c) => decode_members(&c.stack)?,
            None => Vec::new(),
        };
        let pending = match &s.transition {
            Some(t) => Some(Pending {
                id: t.id,
                proposer: t.proposer.clone(),
                members: decode_members(&t.stack)?,
                deadline_ms: t.deadline_ms,
                yes: s
                    .ballots
                    .iter()
                    .filter(|(_, b)| *b == Ballot::Yes)
                    .map(|(m, _)| m.clone())
                    .collect(),
            }),
            None => None,
        };
        let mut live: Vec<String> = s.members.iter().map(|m| m.id.clone()).collect();
        live.sort();
        live.dedup();
        Ok(GroupRecord {
            epoch: s.epoch(),
            members,
            live,
            pending,
        })
    }
}

/// What the driver of a [`Core`] must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// We are not a live member (our lease ran out): we hold nothing now; join again.
    Rejoin,
    /// Start fetching these partitions from their committed positions.
    Acquire(Vec<i32>),
    /// Stop fetching these partitions without committing (the group gave them away without
    /// our vote: our lease had run out).
    Stop(Vec<i32>),
    /// Stop fetching these partitions, let what was fetched from them be acknowledged (at
    /// most [`GroupConfig::drain`]), commit their acknowledged positions synchronously, then
    /// call [`Core::released`] (which votes yes on transition `id`).
    Release {
        /// The transition that takes them.
        id: u64,
        /// The partitions.
        partitions: Vec<i32>,
    },
    /// Vote yes on transition `id`.
    Vote(u64),
    /// Propose `members` as the assignment of the epoch after `from_epoch`.
    Propose {
        /// The committed epoch.
        from_epoch: u64,
        /// The live members.
        members: Vec<String>,
    },
    /// Commit (or abort) transition `id`.
    Finish {
        /// The transition.
        id: u64,
        /// Commit, else abort.
        commit: bool,
    },
}

/// One member's side of the rebalancing protocol, without I/O: records of the group and the
/// time go in, [`Action`]s come out.
///
/// Invariant: the partitions a member holds (fetches, or is releasing) are always a subset of
/// what it owns at its epoch, and, while a transition is pending that it voted yes on, of what
/// it owns under the proposed list as well; it gains partitions only when it reads a new
/// committed epoch. Since a transition commits only with every live member's yes, two live
/// members never hold one partition.
#[derive(Clone, Debug)]
pub struct Core {
    me: String,
    partitions: i32,
    epoch: u64,
    members: Vec<String>,
    /// Partitions we hold.
    held: BTreeSet<i32>,
    /// The transition we voted yes on.
    voted: Option<u64>,
    /// The transition we are releasing partitions for.
    releasing: Option<u64>,
    left: bool,
}

fn sorted(set: impl IntoIterator<Item = i32>) -> Vec<i32> {
    let mut v: Vec<i32> = set.into_iter().collect();
    v.sort_unstable();
    v
}

impl Core {
    /// The core of member `me` on a topic of `partitions` partitions, holding nothing.
    pub fn new(me: impl Into<String>, partitions: i32) -> Core {
        Core {
            me: me.into(),
            partitions,
            epoch: 0,
            members: Vec::new(),
            held: BTreeSet::new(),
            voted: None,
            releasing: None,
            left: false,
        }
    }

    /// The partitions held now.
    pub fn held(&self) -> &BTreeSet<i32> {
        &self.held
    }

    /// The epoch acted on.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    fn forget(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        if !self.held.is_empty() {
            out.push(Action::Stop(sorted(std::mem::take(&mut self.held))));
        }
        self.epoch = 0;
        self.members.clear();
        self.voted = None;
        self.releasing = None;
        out
    }

    /// Acts on a read of the group's record at `now_ms`.
    pub fn on_record(&mut self, rec: &GroupRecord, now_ms: u64) -> Vec<Action> {
        if self.left {
            return Vec::new();
        }
        if !rec.live.contains(&self.me) {
            let mut out = self.forget();
            out.push(Action::Rejoin);
            return out;
        }
        let mut out = Vec::new();
        if rec.epoch != self.epoch || rec.members != self.members {
            self.epoch = rec.epoch;
            self.members = rec.members.clone();
            self.voted = None;
            self.releasing = None;
            let want = owned(&self.members, &self.me, self.partitions);
            let stop: Vec<i32> = sorted(self.held.difference(&want).copied());
            if !stop.is_empty() {
                out.push(Action::Stop(stop));
            }
            let gain: Vec<i32> = sorted(want.difference(&self.held).copied());
            if !gain.is_empty() {
                out.push(Action::Acquire(gain));
            }
            self.held = want;
        }
        match &rec.pending {
            Some(t) => {
                if self.voted != Some(t.id) && self.releasing != Some(t.id) {
                    let keep = owned(&t.members, &self.me, self.partitions);
                    let lose: Vec<i32> = sorted(self.held.difference(&keep).copied());
                    if lose.is_empty() {
                        self.voted = Some(t.id);
                        out.push(Action::Vote(t.id));
                    } else {
                        for p in &lose {
                            self.held.remove(p);
                        }
                        self.releasing = Some(t.id);
                        out.push(Action::Release {
                            id: t.id,
                            partitions: lose,
                        });
                    }
                }
                let all_yes = rec.live.iter().all(|m| t.yes.contains(m));
                // A proposer that died cannot commit: any member may (the store commits once).
                if t.proposer == self.me || (all_yes && !rec.live.contains(&t.proposer)) {
                    if all_yes {
                        out.push(Action::Finish {
                            id: t.id,
                            commit: true,
                        });
                    } else if now_ms > t.deadline_ms {
                        out.push(Action::Finish {
                            id: t.id,
                            commit: false,
                        });
                    }
                } else if now_ms > t.deadline_ms.saturating_add(ORPHAN_GRACE_MS) {
                    out.push(Action::Finish {
                        id: t.id,
                        commit: false,
                    });
                }
            }
            None => {
                // A transition we released partitions for ended at the same epoch: it was
                // aborted, and what we own is ours again.
                self.voted = None;
                self.releasing = None;
                let want = owned(&self.members, &self.me, self.partitions);
                let gain: Vec<i32> = sorted(want.difference(&self.held).copied());
                if !gain.is_empty() {
                    out.push(Action::Acquire(gain));
                    self.held = want;
                }
                if rec.live != rec.members {
                    out.push(Action::Propose {
                        from_epoch: rec.epoch,
                        members: rec.live.clone(),
                    });
                }
            }
        }
        out
    }

    /// The partitions of [`Action::Release`] for `id` are committed and no longer fetched:
    /// vote yes.
    pub fn released(&mut self, id: u64) -> Vec<Action> {
        if self.releasing != Some(id) || self.left {
            return Vec::new();
        }
        self.releasing = None;
        self.voted = Some(id);
        vec![Action::Vote(id)]
    }

    /// Partitions of an [`Action::Acquire`] that could not be opened: not held (taken again on
    /// a later read while no transition is pending).
    pub fn not_acquired(&mut self, partitions: &[i32]) {
        for p in partitions {
            self.held.remove(p);
        }
    }

    /// We leave: every held partition is to be stopped and committed; the core acts no more.
    pub fn leave(&mut self) -> Vec<i32> {
        self.left = true;
        sorted(std::mem::take(&mut self.held))
    }
}

/// Timing of a dynamic Kafka group.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    /// A member that stops renewing leaves the group this long after its last renewal (and
    /// fences itself after 3/4 of it). Default 3 s.
    pub lease: Duration,
    /// How often a member renews its lease. Default 500 ms.
    pub renew_every: Duration,
    /// How often a member reads the group record (it also reads when the store notifies a
    /// change). Default 50 ms.
    pub poll: Duration,
    /// How long a proposer waits for every vote before it aborts. Default 5 s.
    pub transition_timeout: Duration,
    /// How long a member giving up partitions waits for what it fetched from them to be
    /// acknowledged before it commits (the rest is fetched again by the new owner). Default
    /// 1 s; keep it well under `transition_timeout`.
    pub drain: Duration,
}

impl Default for GroupConfig {
    fn default() -> Self {
        GroupConfig {
            lease: Duration::from_secs(3),
            renew_every: Duration::from_millis(500),
            poll: Duration::from_millis(50),
            transition_timeout: Duration::from_secs(5),
            drain: Duration::from_secs(1),
        }
    }
}

/// A Kafka cluster whose subscriber groups rebalance through a rendezvous store `St`: a
/// [`Broker`] whose consumers join the group `member.group` by `member.name` (`index` and
/// `count` are ignored). Publishing is [`KafkaBroker`]'s.
pub struct KafkaGroupBroker<St: Store> {
    kafka: KafkaBroker,
    store: Arc<St>,
    config: GroupConfig,
    local: Arc<Mutex<HashMap<String, Weak<Ctl>>>>,
}

impl<St: Store> Clone for KafkaGroupBroker<St> {
    fn clone(&self) -> Self {
        KafkaGroupBroker {
            kafka: self.kafka.clone(),
            store: self.store.clone(),
            config: self.config.clone(),
            local: self.local.clone(),
        }
    }
}

impl<St: Store> std::fmt::Debug for KafkaGroupBroker<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaGroupBroker")
            .field("kafka", &self.kafka)
            .field("store", &self.store.backend())
            .finish_non_exhaustive()
    }
}

fn rendezvous_group(group: &str, topic: &str) -> Result<String, Error> {
    let name = format!("kg.{group}.{topic}");
    chunnel_rendezvous::store::check_name("group name", &name)?;
    Ok(name)
}

fn local_key(group: &str, topic: &str, name: &str) -> String {
    format!("{group}\n{topic}\n{name}")
}

impl<St: Store> KafkaGroupBroker<St> {
    /// Subscriber groups on `kafka` that rebalance through `store`.
    pub fn new(kafka: KafkaBroker, store: Arc<St>, config: GroupConfig) -> Self {
        KafkaGroupBroker {
            kafka,
            store,
            config,
            local: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// The Kafka cluster.
    pub fn kafka(&self) -> &KafkaBroker {
        &self.kafka
    }

    fn live_ctl(&self, key: &str) -> Option<Arc<Ctl>> {
        let local = self.local.lock().unwrap_or_else(|e| e.into_inner());
        local.get(key).and_then(Weak::upgrade)
    }

    /// Makes `member`, a consumer on `topic` opened through this handle (or a clone), leave
    /// its group cleanly: it stops fetching, commits its acknowledged positions (a produce the
    /// broker acknowledged) and leaves the store, so its partitions go to the others from
    /// exactly there. Acknowledge first ([`crate::Subscriber::ack`]) what was handed out; the
    /// subscriber gets nothing more. `Ok` if it is not (or no longer) a member here.
    pub async fn leave(&self, topic: &str, member: &Member) -> Result<(), Error> {
        let Some(ctl) = self.live_ctl(&local_key(&member.group, topic, &member.name)) else {
            return Ok(());
        };
        let (reply, rx) = oneshot::channel();
        if ctl.cmd.send(Cmd::Leave(reply)).await.is_err() {
            return Ok(());
        }
        rx.await.unwrap_or(Ok(()))
    }

    /// The epoch and the partitions `member` (a consumer on `topic` opened through this handle)
    /// fetches from now; `None` if it is not a member here.
    pub fn holding(&self, topic: &str, member: &Member) -> Option<(u64, Vec<i32>)> {
        let ctl = self.live_ctl(&local_key(&member.group, topic, &member.name))?;
        let st = ctl.lock();
        Some((st.epoch, st.slots.keys().copied().collect()))
    }
}

impl<St: Store> Broker for KafkaGroupBroker<St> {
    const NAME: &'static str = super::NAME;
    type Producer = KafkaProducer;
    type Consumer = KafkaGroupConsumer;

    /// [`Consumer::ack_confirmed`] commits the positions and waits for the broker (and fails
    /// for records of partitions given up meanwhile, or once the lease may have run out).
    fn acks_before_return(&self) -> bool {
        true
    }

    fn ordering(&self) -> Ordering {
        self.kafka.ordering()
    }

    fn service_lane(&self, topic: &str) -> Result<Lane<Self>, Error> {
        let lane = self.kafka.service_lane(topic)?;
        Ok(Lane {
            broker: KafkaGroupBroker {
                kafka: lane.broker,
                ..self.clone()
            },
            topic: lane.topic,
        })
    }

    fn spread_lanes(&self, topic: &str, n: u32) -> Result<Vec<Lane<Self>>, Error> {
        Ok(self
            .kafka
            .spread_lanes(topic, n)?
            .into_iter()
            .map(|lane| Lane {
                broker: KafkaGroupBroker {
                    kafka: lane.broker,
                    ..self.clone()
                },
                topic: lane.topic,
            })
            .collect())
    }

    async fn producer(&self, topic: &str) -> Result<KafkaProducer, Error> {
        self.kafka.producer(topic).await
    }

    async fn consumer(
        &self,
        topic: &str,
        member: &Member,
        _prefetch: usize,
    ) -> Result<KafkaGroupConsumer, Error> {
        let cfg = &self.config;
        if cfg.renew_every.is_zero()
            || cfg.renew_every * 2 > cfg.lease
            || cfg.drain >= cfg.transition_timeout
            || cfg.poll.is_zero()
        {
            return Err(Error::Config {
                what: format!(
                    "kafka group timing {cfg:?}: renew at least twice a lease, drain within \
                     the transition timeout, poll above zero"
                ),
            });
        }
        let rgroup = rendezvous_group(&member.group, topic)?;
        chunnel_rendezvous::store::check_name("member id", &member.name)?;
        let kafka = &self.kafka;
        kafka.ensure_topic(topic, kafka.partitions).await?;
        kafka.ensure_topic(OFFSETS_TOPIC, 1).await?;
        let offsets = kafka.partition(OFFSETS_TOPIC, 0).await?;
        let (cmd, cmd_rx) = mpsc::channel(4);
        let ctl = Arc::new(Ctl {
            state: Mutex::new(Shared::default()),
            commit_lock: tokio::sync::Mutex::new(()),
            offsets,
            key_prefix: format!("{}/{topic}/", member.group),
            renewed_ms: AtomicU64::new(0),
            lease_ms: self.config.lease.as_millis() as u64,
            op_timeout: kafka.inner.op_timeout,
            acked: tokio::sync::Notify::new(),
            left: AtomicBool::new(false),
            cmd,
        });
        let mut driver = Driver {
            store: self.store.clone(),
            rgroup,
            me: member.name.clone(),
            kafka: kafka.clone(),
            topic: topic.to_owned(),
            config: self.config.clone(),
            ctl: ctl.clone(),
            core: Core::new(member.name.clone(), kafka.partitions),
        };
        driver.join().await?;
        let tasks = vec![
            tokio::spawn(renew(
                self.store.clone(),
                driver.rgroup.clone(),
                driver.me.clone(),
                self.config.clone(),
                Arc::downgrade(&ctl),
            )),
            tokio::spawn(committer(ctl.clone())),
            tokio::spawn(driver.run(cmd_rx)),
        ];
        {
            let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
            local.retain(|_, w| w.strong_count() > 0);
            local.insert(
                local_key(&member.group, topic, &member.name),
                Arc::downgrade(&ctl),
            );
        }
        Ok(KafkaGroupConsumer {
            ctl,
            tasks: Tasks(tasks),
        })
    }
}

/// Aborts the member's tasks when the consumer is dropped: it stops renewing its lease, so the
/// group reassigns its partitions once the lease runs out.
struct Tasks(Vec<tokio::task::JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

enum Cmd {
    Leave(oneshot::Sender<Result<(), Error>>),
}

/// One partition a member holds.
struct Slot {
    /// Distinguishes this holding from an earlier one of the same partition (tokens of an
    /// earlier one acknowledge nothing).
    generation: u64,
    client: Arc<PartitionClient>,
    /// Where the holding started.
    start: i64,
    /// The next offset to fetch.
    pos: i64,
    /// The next offset after the highest acknowledged one (-1: none).
    acked: i64,
    /// The position last committed by this member (-1: none).
    committed: i64,
    /// Being given up: fetched no more.
    draining: bool,
}

#[derive(Default)]
struct Shared {
    slots: BTreeMap<i32, Slot>,
    generation: u64,
    next: usize,
    epoch: u64,
}

/// What a member's consumer and its driver share.
struct Ctl {
    state: Mutex<Shared>,
    /// Held around every produce to the offsets topic, so commits of one member are stored in
    /// the order they were taken and none follows the release of its partition.
    commit_lock: tokio::sync::Mutex<()>,
    offsets: Arc<PartitionClient>,
    /// `group/topic/`, the offsets key without the partition.
    key_prefix: String,
    /// When the last successful lease renewal (or join) started (Unix ms).
    renewed_ms: AtomicU64,
    lease_ms: u64,
    op_timeout: Duration,
    /// Wakes the committer.
    acked: tokio::sync::Notify,
    /// Set when the member leaves: it renews its lease no more.
    left: AtomicBool,
    cmd: mpsc::Sender<Cmd>,
}

impl Ctl {
    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the acknowledgements of `tokens` (emptying it) and wakes the committer; a
    /// partition whose token belongs to a holding given up since (ignored), if any.
    fn ack(&self, tokens: &mut Vec<KafkaGroupToken>) -> Option<i32> {
        let mut stale = None;
        {
            let mut st = self.lock();
            for t in tokens.drain(..) {
                match st.slots.get_mut(&t.part) {
                    Some(s) if s.generation == t.generation => {
                        s.acked = s.acked.max(t.offset + 1);
                    }
                    _ => stale = Some(t.part),
                }
            }
        }
        self.acked.notify_one();
        stale
    }

    /// Whether our lease is certainly still valid (renewed within 3/4 of it).
    fn leased(&self) -> bool {
        let renewed = self.renewed_ms.load(AtomicOrdering::Acquire);
        chunnel_rendezvous::store::now_ms() < renewed.saturating_add(self.lease_ms * 3 / 4)
    }

    /// Commits the acknowledged positions of `only` (all held partitions if `None`); the
    /// caller holds `commit_lock`. Returns once the broker acknowledged the produce.
    async fn commit_locked(&self, only: Option<&[i32]>) -> Result<(), Error> {
        let todo: Vec<(i32, i64)> = {
            let st = self.lock();
            st.slots
                .iter()
                .filter(|(p, _)| only.is_none_or(|o| o.contains(p)))
                .filter(|(_, s)| s.acked > s.committed)
                .map(|(p, s)| (*p, s.acked))
                .collect()
        };
        if todo.is_empty() {
            return Ok(());
        }
        let records: Vec<KRecord> = todo
            .iter()
            .map(|(p, pos)| KRecord {
                key: Some(format!("{}{p}", self.key_prefix).into_bytes()),
                value: Some(pos.to_be_bytes().to_vec()),
                headers: BTreeMap::new(),
                timestamp: now(),
            })
            .collect();
        match tokio::time::timeout(
            self.op_timeout,
            self.offsets.produce(records, Compression::NoCompression),
        )
        .await
        {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(unavailable("commit", e)),
            Err(_) => {
                return Err(Error::Unavailable {
                    broker: super::NAME,
                    op: "commit",
                    waited: self.op_timeout,
                    last: "timed out".into(),
                });
            }
        }
        let mut st = self.lock();
        for (p, pos) in todo {
            if let Some(s) = st.slots.get_mut(&p) {
                s.committed = s.committed.max(pos);
            }
        }
        Ok(())
    }

    /// Stops fetching `parts`, waits (at most `drain`) until what was fetched from them is
    /// acknowledged, commits them synchronously and drops them.
    async fn release(&self, parts: &[i32], drain: Duration) -> Result<(), Error> {
        {
            let mut st = self.lock();
            for p in parts {
                if let Some(s) = st.slots.get_mut(p) {
                    s.draining = true;
                }
            }
        }
        let deadline = tokio::time::Instant::now() + drain;
        loop {
            let drained = {
                let st = self.lock();
                parts.iter().all(|p| {
                    st.slots
                        .get(p)
                        .is_none_or(|s| s.pos == s.start || s.acked >= s.pos)
                })
            };
            if drained || tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _order = self.commit_lock.lock().await;
        let r = self.commit_locked(Some(parts)).await;
        let mut st = self.lock();
        for p in parts {
            st.slots.remove(p);
        }
        r
    }
}

/// Commits acknowledged positions at most every [`super::COMMIT_EVERY`] while the member's
/// lease holds (until the consumer is dropped, which aborts it).
async fn committer(c: Arc<Ctl>) {
    loop {
        c.acked.notified().await;
        if c.leased() {
            let _order = c.commit_lock.lock().await;
            if let Err(e) = c.commit_locked(None).await {
                tracing::debug!(error = %e, "kafka group: offset commit failed; retrying");
                c.acked.notify_one();
            }
        }
        tokio::time::sleep(super::COMMIT_EVERY).await;
    }
}

/// Renews the member's lease every `renew_every`, recording when a successful renewal began.
async fn renew<St: Store>(
    store: Arc<St>,
    rgroup: String,
    me: String,
    config: GroupConfig,
    ctl: Weak<Ctl>,
) {
    loop {
        tokio::time::sleep(config.renew_every).await;
        let started = chunnel_rendezvous::store::now_ms();
        let r = tokio::time::timeout(config.lease, store.renew(&rgroup, &me, config.lease)).await;
        let Some(c) = ctl.upgrade() else { return };
        if c.left.load(AtomicOrdering::Acquire) {
            return;
        }
        match r {
            Ok(Ok(true)) => c.renewed_ms.fetch_max(started, AtomicOrdering::AcqRel),
            // Not a member any more (the driver rejoins), or the store did not answer.
            _ => 0,
        };
    }
}

/// Drives a member's [`Core`]: reads the group record, carries out the actions.
struct Driver<St: Store> {
    store: Arc<St>,
    rgroup: String,
    me: String,
    kafka: KafkaBroker,
    topic: String,
    config: GroupConfig,
    ctl: Arc<Ctl>,
    core: Core,
}

impl<St: Store> Driver<St> {
    fn op_timeout(&self) -> Duration {
        self.ctl.op_timeout
    }

    /// Joins the rendezvous group (creating it with an empty assignment).
    async fn join(&mut self) -> Result<(), Error> {
        let me = chunnel_rendezvous::Member {
            id: self.me.clone(),
            addr: "-".into(),
        };
        let empty = encode_members(&[]);
        let lease = self.config.lease;
        for _ in 0..64 {
            let started = chunnel_rendezvous::store::now_ms();
            let snap = self.bounded(self.store.snapshot(&self.rgroup)).await?;
            let reply = match &snap.committed {
                None => {
                    self.bounded(
                        self.store
                            .join(&self.rgroup, &me, Some(&empty), None, lease),
                    )
                    .await?
                }
                Some(c) => {
                    // Not a Kafka group's record (the name is taken by something else).
                    decode_members(&c.stack)?;
                    self.bounded(
                        self.store
                            .join(&self.rgroup, &me, None, Some(c.epoch), lease),
                    )
                    .await?
                }
            };
            if let JoinReply::Created(_) | JoinReply::Joined(_) = reply {
                self.ctl
                    .renewed_ms
                    .fetch_max(started, AtomicOrdering::AcqRel);
                return Ok(());
            }
        }
        Err(Error::Rendezvous(chunnel_rendezvous::Error::Contended {
            group: self.rgroup.clone(),
            attempts: 64,
        }))
    }

    async fn bounded<T>(
        &self,
        f: impl Future<Output = Result<T, chunnel_rendezvous::Error>>,
    ) -> Result<T, Error> {
        match tokio::time::timeout(self.op_timeout(), f).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(Error::Rendezvous(chunnel_rendezvous::Error::unavailable(
                self.store.backend(),
                "no answer",
            ))),
        }
    }

    async fn run(mut self, mut cmd: mpsc::Receiver<Cmd>) {
        let mut watch = self.store.watch(&self.rgroup);
        loop {
            match self.bounded(self.store.snapshot(&self.rgroup)).await {
                Ok(snap) => match GroupRecord::from_snapshot(&snap) {
                    Ok(rec) => {
                        let actions = self
                            .core
                            .on_record(&rec, chunnel_rendezvous::store::now_ms());
                        for a in actions {
                            self.execute(a).await;
                        }
                    }
                    Err(e) => tracing::warn!(group = %self.rgroup, error = %e, "kafka group"),
                },
                Err(e) => tracing::debug!(group = %self.rgroup, error = %e, "kafka group"),
            }
            tokio::select! {
                c = cmd.recv() => match c {
                    Some(Cmd::Leave(reply)) => {
                        let r = self.leave().await;
                        let _ = reply.send(r);
                        return;
                    }
                    None => return,
                },
                _ = tokio::time::sleep(self.config.poll) => {}
                _ = async {
                    match &mut watch {
                        Some(w) => { w.changed().await; }
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }

    async fn leave(&mut self) -> Result<(), Error> {
        self.ctl.left.store(true, AtomicOrdering::Release);
        let parts = self.core.leave();
        let r = self.ctl.release(&parts, Duration::ZERO).await;
        self.ctl.lock().slots.clear();
        self.bounded(self.store.leave(&self.rgroup, &self.me))
            .await?;
        r
    }

    async fn execute(&mut self, action: Action) {
        match action {
            Action::Rejoin => {
                tracing::info!(group = %self.rgroup, member = %self.me, "kafka group: rejoining");
                if let Err(e) = self.join().await {
                    tracing::warn!(group = %self.rgroup, error = %e, "kafka group: rejoin failed");
                }
            }
            Action::Stop(parts) => {
                let mut st = self.ctl.lock();
                for p in parts {
                    st.slots.remove(&p);
                }
            }
            Action::Acquire(parts) => {
                if let Err(e) = self.acquire(&parts).await {
                    tracing::warn!(group = %self.rgroup, error = %e, "kafka group: acquire failed");
                    self.core.not_acquired(&parts);
                }
            }
            Action::Release { id, partitions } => {
                match self.ctl.release(&partitions, self.config.drain).await {
                    Ok(()) => {
                        for a in self.core.released(id) {
                            Box::pin(self.execute(a)).await;
                        }
                    }
                    // No vote: the transition times out, and what we own we take back.
                    Err(e) => {
                        tracing::warn!(group = %self.rgroup, error = %e, "kafka group: release failed")
                    }
                }
            }
            Action::Vote(id) => {
                let r = self
                    .bounded(self.store.vote(&self.rgroup, id, &self.me, &Ballot::Yes))
                    .await;
                if let Err(e) = r {
                    tracing::debug!(group = %self.rgroup, error = %e, "kafka group: vote failed");
                }
            }
            Action::Propose {
                from_epoch,
                members,
            } => {
                let t = Transition {
                    id: chunnel::util::random_u64(),
                    from_epoch,
                    proposer: self.me.clone(),
                    stack: encode_members(&members),
                    deadline_ms: chunnel_rendezvous::store::now_ms()
                        + self.config.transition_timeout.as_millis() as u64,
                    ballot_box: None,
                };
                if let Err(e) = self.bounded(self.store.propose(&self.rgroup, &t)).await {
                    tracing::debug!(group = %self.rgroup, error = %e, "kafka group: propose failed");
                }
            }
            Action::Finish { id, commit } => {
                if let Err(e) = self
                    .bounded(self.store.finish(&self.rgroup, id, commit))
                    .await
                {
                    tracing::debug!(group = %self.rgroup, error = %e, "kafka group: finish failed");
                }
            }
        }
        let epoch = self.core.epoch();
        self.ctl.lock().epoch = epoch;
    }

    /// Opens `parts` at their committed positions (the earliest record if none).
    async fn acquire(&mut self, parts: &[i32]) -> Result<(), Error> {
        let committed = read_commits(&self.ctl.offsets).await?;
        let mut opened = Vec::with_capacity(parts.len());
        for &p in parts {
            let client = self.kafka.partition(&self.topic, p).await?;
            let pos = match committed.get(&format!("{}{p}", self.ctl.key_prefix)) {
                Some(&pos) => pos,
                None => client
                    .get_offset(OffsetAt::Earliest)
                    .await
                    .map_err(|e| unavailable("read offset", e))?,
            };
            opened.push((p, client, pos));
        }
        let mut st = self.ctl.lock();
        for (p, client, pos) in opened {
            st.generation += 1;
            let generation = st.generation;
            st.slots.insert(
                p,
                Slot {
                    generation,
                    client,
                    start: pos,
                    pos,
                    acked: -1,
                    committed: pos,
                    draining: false,
                },
            );
        }
        Ok(())
    }
}

/// One member of a Kafka group that rebalances (see the module docs).
pub struct KafkaGroupConsumer {
    ctl: Arc<Ctl>,
    #[allow(dead_code)]
    tasks: Tasks,
}

impl std::fmt::Debug for KafkaGroupConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaGroupConsumer").finish_non_exhaustive()
    }
}

/// Acknowledges one record of a [`KafkaGroupConsumer`]: its partition, the holding it was
/// fetched in, its offset.
#[derive(Clone, Copy, Debug)]
pub struct KafkaGroupToken {
    part: i32,
    generation: u64,
    offset: i64,
}

impl Consumer for KafkaGroupConsumer {
    type Token = KafkaGroupToken;

    async fn fetch(
        &mut self,
        max: usize,
        wait: Duration,
        out: &mut VecDeque<Incoming<KafkaGroupToken>>,
    ) -> Result<(), Error> {
        let picks: Vec<(i32, u64, Arc<PartitionClient>, i64)> = {
            let mut st = self.ctl.lock();
            let active: Vec<(i32, u64, Arc<PartitionClient>, i64)> = st
                .slots
                .iter()
                .filter(|(_, s)| !s.draining)
                .map(|(p, s)| (*p, s.generation, s.client.clone(), s.pos))
                .collect();
            let n = active.len();
            let first = st.next;
            st.next = st.next.wrapping_add(1);
            (0..n).map(|i| active[(first + i) % n].clone()).collect()
        };
        if picks.is_empty() || !self.ctl.leased() || max == 0 {
            tokio::time::sleep(wait).await;
            return Ok(());
        }
        let wait_ms = (wait.as_millis() as usize / picks.len()).clamp(1, i32::MAX as usize) as i32;
        for (p, generation, client, pos) in picks {
            let (records, _hwm) = client
                .fetch_records(pos, 1..FETCH_MAX_BYTES, wait_ms)
                .await
                .map_err(|e| unavailable("fetch", e))?;
            if !self.ctl.leased() {
                // Fenced while the fetch was out: the partitions may be another's by now.
                return Ok(());
            }
            let mut st = self.ctl.lock();
            // Given up (or taken again) while the fetch was out: its records are not ours.
            let Some(slot) = st
                .slots
                .get_mut(&p)
                .filter(|s| s.generation == generation && !s.draining && s.pos == pos)
            else {
                continue;
            };
            let mut got = 0;
            for r in records {
                if r.offset < slot.pos || got >= max {
                    continue;
                }
                slot.pos = r.offset + 1;
                got += 1;
                let value = r.record.value.map(Bytes::from).unwrap_or_default();
                let (id, payload) = split_value(value);
                out.push_back(Incoming {
                    id,
                    key: r.record.key.map(Bytes::from),
                    payload,
                    token: KafkaGroupToken {
                        part: p,
                        generation,
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

    async fn ack(&mut self, tokens: &mut Vec<KafkaGroupToken>) -> Result<(), Error> {
        self.ctl.ack(tokens);
        Ok(())
    }

    /// Acknowledges, then commits the positions at once and returns when the broker stored
    /// them, while this member's lease certainly holds (so no member has taken its
    /// partitions over). Fails ([`Error::Refused`]) if a record belongs to a partition this
    /// member gave up since it fetched it: its new owner gets it.
    async fn ack_confirmed(&mut self, tokens: &mut Vec<KafkaGroupToken>) -> Result<(), Error> {
        let stale = self.ctl.ack(tokens);
        if let Some(p) = stale {
            return Err(Error::Refused {
                broker: super::NAME,
                op: "commit",
                reason: format!("partition {p} went to another member since it was fetched"),
            });
        }
        let lease_lost = || Error::Unavailable {
            broker: super::NAME,
            op: "commit",
            waited: Duration::ZERO,
            last: "the group lease was not renewed in time".into(),
        };
        let _order = self.ctl.commit_lock.lock().await;
        if !self.ctl.leased() {
            return Err(lease_lost());
        }
        self.ctl.commit_locked(None).await?;
        if !self.ctl.leased() {
            return Err(lease_lost());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn the_record_round_trips_and_refuses_damage() {
        let m = names(&["a", "b", "m-7"]);
        let bytes = encode_members(&m);
        assert_eq!(decode_members(&bytes).unwrap(), m);
        assert_eq!(
            decode_members(&encode_members(&[])).unwrap(),
            Vec::<String>::new()
        );
        for cut in 0..bytes.len() {
            assert!(decode_members(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let unsorted = encode_members(&names(&["b", "a"]));
        assert!(decode_members(&unsorted).is_err());
        let mut trailing = bytes.to_vec();
        trailing.push(0);
        assert!(decode_members(&trailing).is_err());
        assert!(decode_members(&encode_members(&names(&["a/b"]))).is_err());
    }

    proptest! {
        #[test]
        fn decoding_any_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = decode_members(&bytes);
            let mut framed = MAGIC.to_vec();
            framed.extend_from_slice(&bytes);
            if let Ok(m) = decode_members(&framed) {
                prop_assert_eq!(&encode_members(&m)[..], &framed[..]);
            }
        }

        #[test]
        fn every_partition_has_exactly_one_owner(n in 1usize..20, partitions in 1i32..40) {
            let members: Vec<String> = (0..n).map(|i| format!("m{i:02}")).collect();
            let mut count = vec![0; partitions as usize];
            for m in &members {
                for p in owned(&members, m, partitions) {
                    count[p as usize] += 1;
                }
            }
            prop_assert!(count.iter().all(|&c| c == 1), "{count:?}");
            prop_assert!(owned(&members, "stranger", partitions).is_empty());
        }
    }

    /// A simulated store: the committed list and epoch, live members, one pending transition.
    #[derive(Default)]
    struct Sim {
        epoch: u64,
        members: Vec<String>,
        live: Vec<String>,
        pending: Option<Pending>,
        next_id: u64,
        now: u64,
    }

    impl Sim {
        fn record(&self) -> GroupRecord {
            GroupRecord {
                epoch: self.epoch,
                members: self.members.clone(),
                live: self.live.clone(),
                pending: self.pending.clone(),
            }
        }

        /// Applies one member's actions; releases complete at once.
        fn apply(&mut self, core: &mut Core, actions: Vec<Action>) {
            for a in actions {
                match a {
                    Action::Release { id, .. } => {
                        let more = core.released(id);
                        self.apply(core, more);
                    }
                    Action::Vote(id) => {
                        if let Some(t) = &mut self.pending
                            && t.id == id
                            && !t.yes.contains(&core.me)
                        {
                            t.yes.push(core.me.clone());
                        }
                    }
                    Action::Propose {
                        from_epoch,
                        members,
                    } => {
                        if self.pending.is_none() && from_epoch == self.epoch {
                            self.next_id += 1;
                            self.pending = Some(Pending {
                                id: self.next_id,
                                proposer: core.me.clone(),
                                members,
                                deadline_ms: self.now + 1_000,
                                yes: Vec::new(),
                            });
                        }
                    }
                    Action::Finish { id, commit } => {
                        let Some(t) = self.pending.clone() else {
                            continue;
                        };
                        if t.id != id {
                            continue;
                        }
                        if commit {
                            if !self.live.iter().all(|m| t.yes.contains(m)) {
                                continue;
                            }
                            self.epoch += 1;
                            self.members = t.members;
                        }
                        self.pending = None;
                    }
                    Action::Rejoin => {
                        if !self.live.contains(&core.me) {
                            self.live.push(core.me.clone());
                            self.live.sort();
                        }
                    }
                    Action::Acquire(_) | Action::Stop(_) => {}
                }
            }
        }
    }

    proptest! {
        /// Members join, leave, die and read the record in random order: no partition is ever
        /// held by two live members, and once things settle every partition is held.
        #[test]
        fn no_partition_is_held_twice_and_all_are_held_when_settled(
            steps in proptest::collection::vec((0u8..5, 0usize..6), 1..160),
            partitions in 1i32..9,
        ) {
            let mut sim = Sim { epoch: 1, ..Sim::default() };
            let mut cores: Vec<Option<Core>> = (0..6).map(|_| None).collect();
            for (op, who) in steps {
                let name = format!("m{who}");
                match op {
                    0 if cores[who].is_none() => {
                        cores[who] = Some(Core::new(name.clone(), partitions));
                        sim.live.push(name);
                        sim.live.sort();
                    }
                    // Leaves cleanly or dies: gone from the live list, holds nothing.
                    1 if cores[who].is_some() => {
                        cores[who] = None;
                        sim.live.retain(|m| *m != name);
                    }
                    _ => {
                        // Op 3: time passes (transitions may time out and abort).
                        if op == 3 {
                            sim.now += 700;
                        }
                        if let Some(c) = &mut cores[who] {
                            let rec = sim.record();
                            let actions = c.on_record(&rec, sim.now);
                            sim.apply(c, actions);
                        }
                    }
                }
                let mut seen = BTreeSet::new();
                for c in cores.iter().flatten() {
                    for p in c.held() {
                        prop_assert!(seen.insert(*p), "partition {p} held twice");
                    }
                }
            }
            // Settle: everyone reads until nothing changes (past any deadline).
            for _ in 0..40 {
                sim.now += 300;
                for c in cores.iter_mut().flatten() {
                    let rec = sim.record();
                    let actions = c.on_record(&rec, sim.now);
                    sim.apply(c, actions);
                }
            }
            let held: usize = cores.iter().flatten().map(|c| c.held().len()).sum();
            if cores.iter().any(Option::is_some) {
                prop_assert_eq!(held, partitions as usize);
                prop_assert_eq!(&sim.members, &sim.live);
            }
        }
    }

    #[test]
    fn a_member_that_loses_partitions_releases_before_voting() {
        let mut a = Core::new("a", 4);
        let rec = GroupRecord {
            epoch: 2,
            members: names(&["a"]),
            live: names(&["a", "b"]),
            pending: None,
        };
        let acts = a.on_record(&rec, 0);
        assert_eq!(acts[0], Action::Acquire(vec![0, 1, 2, 3]));
        assert!(matches!(acts[1], Action::Propose { from_epoch: 2, .. }));
        let rec = GroupRecord {
            pending: Some(Pending {
                id: 9,
                proposer: "b".into(),
                members: names(&["a", "b"]),
                deadline_ms: 10,
                yes: names(&["b"]),
            }),
            ..rec
        };
        let acts = a.on_record(&rec, 0);
        assert_eq!(
            acts,
            vec![Action::Release {
                id: 9,
                partitions: vec![1, 3]
            }]
        );
        // Reading again while releasing does not vote.
        assert!(a.on_record(&rec, 0).is_empty());
        assert_eq!(a.released(9), vec![Action::Vote(9)]);
        // Aborted: the partitions come back.
        let aborted = GroupRecord {
            pending: None,
            live: names(&["a"]),
            ..rec
        };
        assert_eq!(a.on_record(&aborted, 0), vec![Action::Acquire(vec![1, 3])]);
    }

    #[test]
    fn a_member_whose_lease_ran_out_stops_and_rejoins() {
        let mut a = Core::new("a", 2);
        let rec = GroupRecord {
            epoch: 1,
            members: names(&["a"]),
            live: names(&["a"]),
            pending: None,
        };
        a.on_record(&rec, 0);
        let gone = GroupRecord {
            live: Vec::new(),
            ..rec
        };
        assert_eq!(
            a.on_record(&gone, 0),
            vec![Action::Stop(vec![0, 1]), Action::Rejoin]
        );
        assert!(a.held().is_empty());
    }
}
