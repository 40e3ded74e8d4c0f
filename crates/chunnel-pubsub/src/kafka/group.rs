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
//!   fence counts from when the renewal was sent, on the member's monotonic clock, so a
//!   wall-clock step does not move it; it assumes the store's clock does not run faster
//!   than the member's). What it acknowledged in its last 200 ms (not
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
use rskafka::client::partition::{OffsetAt, PartitionClient};
use tokio::sync::{mpsc, oneshot};

use super::{
    KafkaBroker, KafkaProducer, fetch_at, produce_positions, read_commits, split_value, unavailable,
};
use crate::broker::{Broker, Consumer, Incoming, Lane, Member};
use crate::{Error, Ordering};

mod assign;
mod member;

pub use assign::*;
use member::*;

/// Timing of a dynamic Kafka group.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    /// A member that stops renewing leaves the group this long after its last renewal (and
    /// fences itself after 3/4 of it). Default 3 s.
    pub lease: Duration,
    /// How often a member renews its lease: at most a quarter of `lease` (so one failed
    /// renewal does not reach the fence). Default 500 ms.
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
            || cfg.renew_every * 4 > cfg.lease
            || cfg.drain >= cfg.transition_timeout
            || cfg.poll.is_zero()
        {
            return Err(Error::Config {
                what: format!(
                    "kafka group timing {cfg:?}: renew at least four times a lease (two renewals \
                     before the fence at 3/4 of it), drain within the transition timeout, poll \
                     above zero"
                ),
            });
        }
        let rgroup = rendezvous_group(&member.group, topic)?;
        chunnel_rendezvous::store::check_name("member id", &member.name)?;
        let kafka = &self.kafka;
        kafka.ensure_topic(topic, kafka.partitions).await?;
        let offsets = kafka.offsets_partition().await?;
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
            let (records, from) = fetch_at(&client, pos, wait_ms).await?;
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
            // Reset past deleted records (`fetch_at`): read on from there.
            slot.pos = from;
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
        // The commit lock first: a release holds it from its commit until its slots are gone,
        // so a token checked under it is either of a slot still held (and committed below) or
        // stale (refused), never of a partition whose release commit has already passed it.
        let _order = self.ctl.commit_lock.lock().await;
        let stale = self.ctl.ack(tokens);
        if let Some(p) = stale {
            return Err(Error::Refused {
                broker: super::NAME,
                op: "commit",
                reason: format!("partition {p} went to another member since it was fetched"),
            });
        }
        self.ctl.commit_locked(None).await?;
        if !self.ctl.leased() {
            return Err(lease_lost());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
