//! The interface every broker backend implements: open a producer on a topic, open a consumer
//! as a member of a group, fetch, acknowledge.

use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

use crate::{Error, MsgId, Ordering};

/// A message to publish.
#[derive(Clone, Debug)]
pub struct Outgoing {
    /// Its id (deduplication at subscribers; NATS also deduplicates on it).
    pub id: MsgId,
    /// Messages with equal keys keep their order where the broker orders per key.
    pub key: Option<Bytes>,
    /// The payload.
    pub payload: Bytes,
}

/// A message fetched from a broker, with what acknowledges it.
#[derive(Debug)]
pub struct Incoming<T> {
    /// The id it was published with; `None` if it carried none (published by another client).
    pub id: Option<MsgId>,
    /// Its key, if it had one.
    pub key: Option<Bytes>,
    /// The payload.
    pub payload: Bytes,
    /// Acknowledges it ([`Consumer::ack`]).
    pub token: T,
}

/// One member of a consumer group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The group's name: members of one group share the topic's messages, each message going
    /// to one of them.
    pub group: String,
    /// This member's name, unique in the group.
    pub name: String,
    /// This member's index among `count` (a static Kafka group assigns partitions `p` with
    /// `p % count == index`; NATS, Redis and a rebalancing Kafka group, `kafka::group`, share
    /// messages dynamically and ignore both).
    pub index: u32,
    /// How many members the group has (Kafka).
    pub count: u32,
}

impl Member {
    /// The only member of `group`.
    pub fn sole(group: impl Into<String>) -> Member {
        Member {
            group: group.into(),
            name: "m0".into(),
            index: 0,
            count: 1,
        }
    }

    /// Member `index` of `count` in `group`, named `m{index}`.
    pub fn nth(group: impl Into<String>, index: u32, count: u32) -> Member {
        Member {
            group: group.into(),
            name: format!("m{index}"),
            index,
            count,
        }
    }
}

/// A connection to one broker (cluster): a cheap handle, cloned into every Chunnel using it.
pub trait Broker: Clone + Send + Sync + 'static {
    /// `kafka`, `nats` or `redis`: the label of the `pubsub-broker` capability.
    const NAME: &'static str;
    /// Publishes to one topic.
    type Producer: Producer;
    /// Receives a topic's messages as a group member.
    type Consumer: Consumer;

    /// The order in which a group member receives what one publisher sent.
    fn ordering(&self) -> Ordering;

    /// Opens a producer on `topic` (creating the topic if needed).
    fn producer(&self, topic: &str) -> impl Future<Output = Result<Self::Producer, Error>> + Send;

    /// Joins `member.group` on `topic` (creating topic and group if needed). At most
    /// `prefetch` messages are fetched ahead of the application.
    fn consumer(
        &self,
        topic: &str,
        member: &Member,
        prefetch: usize,
    ) -> impl Future<Output = Result<Self::Consumer, Error>> + Send;

    /// Whether [`Consumer::ack_confirmed`] returns only once the broker has stored the
    /// acknowledgements, which [`crate::Delivery::AtMostOnce`] needs (acknowledge, then hand
    /// out: a member taking over must not get the message again). Default `true` (Kafka:
    /// `ack_confirmed` commits the positions and waits for the broker); a broker that answers
    /// `false` gets no at-most-once subscribers.
    fn acks_before_return(&self) -> bool {
        true
    }

    /// The lane of service-side ordering on `topic` ([`crate::order::Mode::Service`]): one
    /// place the broker keeps in order. Default: the topic `{topic}-s` on this broker (a
    /// NATS stream, a Redis stream); Kafka: `{topic}-s` with one partition.
    fn service_lane(&self, topic: &str) -> Result<Lane<Self>, Error> {
        Ok(Lane {
            broker: self.clone(),
            topic: format!("{topic}-s"),
        })
    }

    /// The lanes of receiver-side ordering on `topic` ([`crate::order::Mode::Receiver`]): `n`
    /// places the broker serves independently, with no order between them. Default: the
    /// topics `{topic}-r0` .. `{topic}-r{n-1}` (NATS streams, Redis streams); Kafka: one
    /// topic `{topic}-r` of `n` partitions.
    fn spread_lanes(&self, topic: &str, n: u32) -> Result<Vec<Lane<Self>>, Error> {
        Ok((0..n)
            .map(|i| Lane {
                broker: self.clone(),
                topic: format!("{topic}-r{i}"),
            })
            .collect())
    }
}

/// One lane of an ordered topic: a topic on a broker handle (see [`Broker::service_lane`]).
#[derive(Clone, Debug)]
pub struct Lane<B> {
    /// The broker handle (for Kafka, with the lane's partition count).
    pub broker: B,
    /// The lane's topic.
    pub topic: String,
}

/// Publishes to one topic.
pub trait Producer: Send + Sync + 'static {
    /// Publishes `batch`; returns once the broker has acknowledged (stored) every message of it.
    fn publish<'a>(
        &'a self,
        batch: &'a [Outgoing],
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a;
}

/// Receives a topic's messages as one member of a group.
pub trait Consumer: Send + 'static {
    /// Acknowledges one message.
    type Token: Send + 'static;

    /// Appends up to `max` messages to `out`, waiting at most about `wait` for the first (none
    /// may arrive). Writes to `out` only after the broker answered, so a cancelled fetch
    /// leaves `out` as it was (the broker redelivers what it had sent).
    fn fetch<'a>(
        &'a mut self,
        max: usize,
        wait: Duration,
        out: &'a mut VecDeque<Incoming<Self::Token>>,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a;

    /// Acknowledges every message of `tokens` and empties it (also on failure: what was not
    /// acknowledged is redelivered by the broker, and deduplicated by the subscriber).
    fn ack<'a>(
        &'a mut self,
        tokens: &'a mut Vec<Self::Token>,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a;

    /// As [`Consumer::ack`], but returns `Ok` only once the broker confirmed it stored every
    /// acknowledgement (what [`crate::Delivery::AtMostOnce`] waits for before it hands messages
    /// out). Default: [`Consumer::ack`], for brokers whose acknowledgement is a request the
    /// broker answers (Redis `XACK`); NATS asks JetStream for a reply to each; Kafka commits
    /// the positions to `chunnel-offsets` and waits for the broker's acknowledgement.
    fn ack_confirmed<'a>(
        &'a mut self,
        tokens: &'a mut Vec<Self::Token>,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a {
        self.ack(tokens)
    }
}

/// Topic and group names every broker accepts as they are: 1 to 200 ASCII letters, digits,
/// `-` and `_` (Kafka topics, NATS stream and consumer names, Redis keys).
pub(crate) fn check_name(what: &str, name: &str) -> Result<(), Error> {
    if name.is_empty()
        || name.len() > 200
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(Error::Config {
            what: format!("{what} {name:?}: use 1 to 200 ASCII letters, digits, '-' or '_'"),
        });
    }
    Ok(())
}
