//! The Chunnels and their connections: [`Publish`] → [`Publisher`], [`Subscribe`] →
//! [`Subscriber`], generic over the [`Broker`].

use std::collections::VecDeque;
use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel::{Capability, Chunnel, ChunnelConnection, Negotiate};

use crate::broker::{Broker, Consumer, Incoming, Member, Outgoing, Producer, check_name};
use crate::id::{DedupWindow, IdSource};
use crate::{Delivery, Error, Offer, Ordering};

/// Settings shared by publishers and subscribers.
#[derive(Clone, Debug)]
pub struct Config {
    /// How long an operation is retried while the broker does not answer before it fails with
    /// [`Error::Unavailable`]. Default 10 s.
    pub op_timeout: Duration,
    /// Subscribers: at most this many messages are fetched ahead of the application (and at
    /// most this many delivered ones wait for their acknowledgement). Default 256.
    pub prefetch: usize,
    /// Subscribers: how long one fetch waits at the broker for a first message. Default 100 ms.
    pub poll: Duration,
    /// Subscribers: how many recent message ids are kept to drop redeliveries (0: none).
    /// Default 65,536.
    pub dedup_window: usize,
    /// Subscribers: when messages are acknowledged. Default [`Delivery::AtLeastOnce`].
    pub delivery: Delivery,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            op_timeout: Duration::from_secs(10),
            prefetch: 256,
            poll: Duration::from_millis(100),
            dedup_window: 1 << 16,
            delivery: Delivery::AtLeastOnce,
        }
    }
}

fn capabilities(broker: &'static str, ordering: Ordering, delivery: Delivery) -> Vec<Capability> {
    Offer {
        broker,
        ordering,
        delivery,
    }
    .capabilities()
}

/// Runs `op` until it succeeds, fails with a non-transient error, or `limit` has passed since
/// the first attempt (then [`Error::Unavailable`] with the last error).
async fn retry<T, F, Fut>(
    broker: &'static str,
    what: &'static str,
    limit: Duration,
    mut op: F,
) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let start = Instant::now();
    let deadline = start + limit;
    let mut pause = Duration::from_millis(20);
    loop {
        let last = match tokio::time::timeout_at(deadline.into(), op()).await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) if !e.is_transient() => return Err(e),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_owned(),
        };
        let now = Instant::now();
        if now + pause >= deadline {
            return Err(Error::Unavailable {
                broker,
                op: what,
                waited: now - start,
                last,
            });
        }
        tracing::debug!(broker, what, %last, "retrying");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// Publishes to a fixed topic: `connect_wrap(())` gives a [`Publisher`] whose `Data` is the
/// payload (`Bytes`), so serialization and other byte layers stack on top of it.
#[derive(Clone, Debug)]
pub struct Publish<B> {
    broker: B,
    topic: String,
    key_of: Option<fn(&Bytes) -> Option<Bytes>>,
    config: Config,
}

impl<B: Broker> Publish<B> {
    /// Publishes to `topic` on `broker`, unkeyed.
    pub fn new(broker: B, topic: impl Into<String>, config: Config) -> Self {
        Publish {
            broker,
            topic: topic.into(),
            key_of: None,
            config,
        }
    }

    /// Keys every message with `key_of(payload)` (per-key order where the broker keeps it).
    pub fn keyed_by(mut self, key_of: fn(&Bytes) -> Option<Bytes>) -> Self {
        self.key_of = Some(key_of);
        self
    }
}

impl<B: Broker> Negotiate for Publish<B> {
    fn id(&self) -> &'static str {
        crate::ID
    }
    fn capabilities(&self) -> Vec<Capability> {
        capabilities(B::NAME, self.broker.ordering(), self.config.delivery)
    }
}

impl<B: Broker> Chunnel<()> for Publish<B> {
    type Connection = Publisher<B::Producer>;

    async fn connect_wrap(&mut self, _: ()) -> Result<Self::Connection, chunnel::Error> {
        check_name("topic", &self.topic)?;
        let broker = self.broker.clone();
        let topic = self.topic.clone();
        let producer = retry(B::NAME, "open producer", self.config.op_timeout, || {
            broker.producer(&topic)
        })
        .await?;
        Ok(Publisher {
            producer,
            broker: B::NAME,
            ids: IdSource::new(),
            key_of: self.key_of,
            op_timeout: self.config.op_timeout,
        })
    }
}

/// A publisher connection on one topic. `send` returns once the broker stored every message of
/// the burst (retrying, with the same message ids, while the broker does not answer, at most
/// [`Config::op_timeout`]); `recv` never yields (it fails with [`chunnel::Error::Closed`]).
#[derive(Debug)]
pub struct Publisher<P> {
    producer: P,
    broker: &'static str,
    ids: IdSource,
    key_of: Option<fn(&Bytes) -> Option<Bytes>>,
    op_timeout: Duration,
}

impl<P: Producer> Publisher<P> {
    /// Publishes `payloads` under `key` (equal keys keep their order where the broker orders
    /// per key).
    pub async fn send_keyed<I>(&self, key: Bytes, payloads: I) -> Result<(), Error>
    where
        I: IntoIterator<Item = Bytes>,
    {
        let batch = self.batch(payloads.into_iter(), |_| Some(key.clone()));
        self.publish(&batch).await
    }

    fn batch(
        &self,
        payloads: impl Iterator<Item = Bytes>,
        key_of: impl Fn(&Bytes) -> Option<Bytes>,
    ) -> Vec<Outgoing> {
        let mut batch: Vec<Outgoing> = payloads
            .map(|payload| Outgoing {
                id: crate::MsgId {
                    producer: 0,
                    seq: 0,
                },
                key: key_of(&payload),
                payload,
            })
            .collect();
        let first = self.ids.reserve(batch.len() as u64);
        for (i, m) in batch.iter_mut().enumerate() {
            m.id = crate::MsgId {
                producer: first.producer,
                seq: first.seq + i as u64,
            };
        }
        batch
    }

    async fn publish(&self, batch: &[Outgoing]) -> Result<(), Error> {
        if batch.is_empty() {
            return Ok(());
        }
        retry(self.broker, "publish", self.op_timeout, || {
            self.producer.publish(batch)
        })
        .await
    }
}

impl<P: Producer> ChunnelConnection for Publisher<P> {
    type Data = Bytes;

    async fn send<I>(&self, burst: I) -> Result<(), chunnel::Error>
    where
        I: IntoIterator<Item = Bytes> + Send,
        I::IntoIter: Send,
    {
        let key_of = self.key_of;
        let batch = self.batch(burst.into_iter(), |p| key_of.and_then(|f| f(p)));
        Ok(self.publish(&batch).await?)
    }

    async fn recv<'a>(&'a self, _slots: &'a mut [Option<Bytes>]) -> Result<usize, chunnel::Error> {
        Err(chunnel::Error::Closed)
    }
}

/// Subscribes to a fixed topic as a member of a consumer group: `connect_wrap(())` gives a
/// [`Subscriber`] whose `Data` is the payload (`Bytes`).
#[derive(Clone, Debug)]
pub struct Subscribe<B> {
    broker: B,
    topic: String,
    member: Member,
    config: Config,
}

impl<B: Broker> Subscribe<B> {
    /// Subscribes to `topic` on `broker` as `member`.
    pub fn new(broker: B, topic: impl Into<String>, member: Member, config: Config) -> Self {
        Subscribe {
            broker,
            topic: topic.into(),
            member,
            config,
        }
    }
}

impl<B: Broker> Negotiate for Subscribe<B> {
    fn id(&self) -> &'static str {
        crate::ID
    }
    fn capabilities(&self) -> Vec<Capability> {
        capabilities(B::NAME, self.broker.ordering(), self.config.delivery)
    }
}

impl<B: Broker> Chunnel<()> for Subscribe<B> {
    type Connection = Subscriber<B::Consumer>;

    async fn connect_wrap(&mut self, _: ()) -> Result<Self::Connection, chunnel::Error> {
        check_name("topic", &self.topic)?;
        check_name("group", &self.member.group)?;
        check_name("member", &self.member.name)?;
        if self.member.count == 0 || self.member.index >= self.member.count {
            return Err(Error::Config {
                what: format!(
                    "member index {} of {} members",
                    self.member.index, self.member.count
                ),
            }
            .into());
        }
        if self.config.prefetch == 0 {
            return Err(Error::Config {
                what: "prefetch 0".into(),
            }
            .into());
        }
        if self.config.delivery == Delivery::AtMostOnce && !self.broker.acks_before_return() {
            return Err(Error::Config {
                what: format!(
                    "at-most-once delivery on {}: its acknowledgements are committed later, \
                     so a member taking over could get a handed-out message again",
                    B::NAME
                ),
            }
            .into());
        }
        let (broker, topic, member) = (&self.broker, &self.topic, &self.member);
        let prefetch = self.config.prefetch;
        let consumer = retry(B::NAME, "join group", self.config.op_timeout, || {
            broker.consumer(topic, member, prefetch)
        })
        .await?;
        Ok(Subscriber {
            state: tokio::sync::Mutex::new(SubState {
                consumer,
                buffer: VecDeque::with_capacity(self.config.prefetch),
                delivered: Vec::with_capacity(self.config.prefetch),
                dedup: DedupWindow::new(self.config.dedup_window),
                duplicates: 0,
            }),
            broker: B::NAME,
            config: self.config.clone(),
        })
    }
}

struct SubState<C: Consumer> {
    consumer: C,
    buffer: VecDeque<Incoming<C::Token>>,
    /// Delivered to the application (or duplicates), not yet acknowledged.
    delivered: Vec<C::Token>,
    dedup: DedupWindow,
    duplicates: u64,
}

/// What a subscriber holds at one moment (see [`Subscriber::stats`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubStats {
    /// Fetched, not yet handed to the application (at most [`Config::prefetch`]).
    pub buffered: usize,
    /// Handed to the application (or dropped as duplicates), not yet acknowledged.
    pub unacked: usize,
    /// Redeliveries dropped so far.
    pub duplicates: u64,
}

/// A subscriber connection: one member of a consumer group on one topic.
///
/// `recv` hands out payloads in the order the broker delivers them, dropping any whose id it
/// delivered among the last [`Config::dedup_window`] messages. Acknowledgement depends on
/// [`Config::delivery`]: with [`Delivery::AtLeastOnce`] a `recv` first acknowledges what the
/// previous `recv` returned (the application asking for more means it is done with those;
/// [`Subscriber::ack`] acknowledges at once), so a message is redelivered unless the
/// application came back for more after it; with [`Delivery::AtMostOnce`] messages are
/// acknowledged before they are returned. `send` fails with [`chunnel::Error::Closed`].
///
/// At-most-once holds across members: a member that fails (or is dropped) after a `recv`
/// returned leaves nothing of it for the member taking over (`tests/support/scenarios.rs`,
/// `at_most_once_takeover`, on Redis, NATS and Kafka): messages are handed out only once the
/// broker confirmed their acknowledgements ([`Consumer::ack_confirmed`]; on NATS, JetStream's
/// reply to each acknowledgement; on Kafka, a commit of the positions the broker
/// acknowledged). The test drops the member inside one process; a process killed between the
/// confirmation and the hand-out is not tested. It is refused on a broker whose
/// acknowledgements are committed later ([`Broker::acks_before_return`] `false`; none of the
/// three).
///
/// Backpressure: messages are fetched only when the buffer is empty, at most
/// [`Config::prefetch`] at a time, so a slow application holds at most that many in memory and
/// the broker keeps the rest (Kafka: plus the rest of one fetch response; see the `kafka`
/// module). `recv` is cancel safe with [`Delivery::AtLeastOnce`]: a message
/// fetched by a cancelled `recv` is redelivered by the broker. With [`Delivery::AtMostOnce`] a
/// `recv` cancelled while it acknowledges loses the messages it took (they may be acknowledged
/// already); it never hands them out later.
pub struct Subscriber<C: Consumer> {
    state: tokio::sync::Mutex<SubState<C>>,
    broker: &'static str,
    config: Config,
}

impl<C: Consumer> std::fmt::Debug for Subscriber<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("broker", &self.broker)
            .finish_non_exhaustive()
    }
}

impl<C: Consumer> Subscriber<C> {
    /// Acknowledges everything `recv` returned so far.
    pub async fn ack(&self) -> Result<(), Error> {
        let mut st = self.state.lock().await;
        let SubState {
            consumer,
            delivered,
            ..
        } = &mut *st;
        self.ack_tokens(consumer, delivered).await
    }

    /// What the subscriber holds now.
    pub async fn stats(&self) -> SubStats {
        let st = self.state.lock().await;
        SubStats {
            buffered: st.buffer.len(),
            unacked: st.delivered.len(),
            duplicates: st.duplicates,
        }
    }

    async fn ack_tokens(&self, consumer: &mut C, tokens: &mut Vec<C::Token>) -> Result<(), Error> {
        if tokens.is_empty() {
            return Ok(());
        }
        let ack = async {
            if self.config.delivery == Delivery::AtMostOnce {
                consumer.ack_confirmed(tokens).await
            } else {
                consumer.ack(tokens).await
            }
        };
        match tokio::time::timeout(self.config.op_timeout, ack).await {
            Ok(r) => r,
            Err(_) => {
                tokens.clear();
                Err(Error::Unavailable {
                    broker: self.broker,
                    op: "ack",
                    waited: self.config.op_timeout,
                    last: "timed out".into(),
                })
            }
        }
    }

    async fn recv_inner(&self, slots: &mut [Option<Bytes>]) -> Result<usize, Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let mut st = self.state.lock().await;
        let SubState {
            consumer,
            buffer,
            delivered,
            dedup,
            duplicates,
        } = &mut *st;
        if let Err(e) = self.ack_tokens(consumer, delivered).await {
            // Not acknowledged: the broker redelivers, and the window drops the copies.
            tracing::debug!(broker = self.broker, error = %e, "acknowledgement failed");
        }
        let at_most_once = self.config.delivery == Delivery::AtMostOnce;
        let mut failing_since: Option<Instant> = None;
        loop {
            let mut n = 0;
            while n < slots.len() {
                let Some(m) = buffer.pop_front() else { break };
                let fresh = m.id.is_none_or(|id| dedup.insert(id));
                delivered.push(m.token);
                if fresh {
                    slots[n] = Some(m.payload);
                    n += 1;
                } else {
                    *duplicates += 1;
                }
            }
            if at_most_once && !delivered.is_empty() {
                // Acknowledged before the application sees them; a failure here would redeliver
                // them, so the messages are withheld until the broker confirmed.
                if let Err(e) = self.ack_tokens(consumer, delivered).await {
                    for s in &mut slots[..n] {
                        *s = None;
                    }
                    return Err(e);
                }
            }
            if n > 0 {
                return Ok(n);
            }
            if !delivered.is_empty() {
                // Only duplicates came: acknowledge them before fetching again, or a broker that
                // redelivers unacknowledged messages first (Redis re-reads a member's pending
                // entries) would hand the same ones back for ever.
                if let Err(e) = self.ack_tokens(consumer, delivered).await {
                    tracing::debug!(broker = self.broker, error = %e, "acknowledgement failed");
                }
            }
            let room = self.config.prefetch - buffer.len();
            let waited = tokio::time::timeout(
                self.config.op_timeout + self.config.poll,
                consumer.fetch(room, self.config.poll, buffer),
            )
            .await;
            let err = match waited {
                Ok(Ok(())) => {
                    failing_since = None;
                    continue;
                }
                Ok(Err(e)) if !e.is_transient() => return Err(e),
                Ok(Err(e)) => e.to_string(),
                Err(_) => "timed out".to_owned(),
            };
            let since = *failing_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= self.config.op_timeout {
                return Err(Error::Unavailable {
                    broker: self.broker,
                    op: "fetch",
                    waited: since.elapsed(),
                    last: err,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl<C: Consumer> ChunnelConnection for Subscriber<C> {
    type Data = Bytes;

    async fn send<I>(&self, _burst: I) -> Result<(), chunnel::Error>
    where
        I: IntoIterator<Item = Bytes> + Send,
        I::IntoIter: Send,
    {
        Err(chunnel::Error::Closed)
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, chunnel::Error> {
        Ok(self.recv_inner(slots).await?)
    }
}
