//! Pub/sub Chunnels over real message brokers: Kafka (feature `kafka`, through rskafka), NATS
//! JetStream (feature `nats`, through async-nats) and Redis Streams (feature `redis`).
//!
//! One interface over the three ([`Broker`]): publish to a topic, optionally keyed; subscribe
//! as a member of a consumer group; acknowledge. It is exposed as two base Chunnels (they build
//! on `()`, as the socket datapaths do):
//!
//! * [`Publish`] → [`Publisher`]: `Data = Bytes`, every message published to the Chunnel's
//!   topic (keyed by [`Publish::keyed_by`] or [`Publisher::send_keyed`]). `send` returns once
//!   the broker stored the burst.
//! * [`Subscribe`] → [`Subscriber`]: `Data = Bytes`, the payloads of the topic's messages this
//!   group member gets.
//!
//! `Data` is the bare payload on a fixed topic so that everything that stacks on a byte
//! connection stacks here too (serialization turns it into typed messages, for example); the
//! topic, group and member are the Chunnel's configuration, as an address is a socket's.
//!
//! # Negotiation
//!
//! Both Chunnels implement [`chunnel::Negotiate`] with the id `chunnel/pubsub/1` and three
//! exact capabilities, so negotiation and the rendezvous match publishers and subscribers that
//! agree on them: `pubsub-broker` (`kafka`, `nats`, `redis`), `pubsub-ordering` (what
//! [`Ordering`] a group member gets: Kafka orders per key, totally with one partition; NATS and
//! Redis share a group's messages dynamically, [`Ordering::None`]) and `pubsub-delivery`
//! ([`Delivery`]).
//!
//! # Ordering as a negotiated choice
//!
//! [`order`] orders each publisher's messages either at the broker (service-side: one lane,
//! one partition or stream) or at each receiver (receiver-side: sequence numbers over several
//! lanes, reordered by a bounded sans-IO core). A group of publishers and receivers picks
//! between the two through chunnel-rendezvous (feature `group`, on by default) and switches
//! live as receivers join and leave, with no message lost, duplicated or out of order across
//! the switch.
//!
//! # Delivery
//!
//! Every published message carries an id ([`MsgId`]: publisher, sequence number) in a header
//! (Kafka, NATS: JetStream also deduplicates on it) or a field (Redis). A publisher whose
//! broker does not answer retries with the same ids, at most [`Config::op_timeout`], then
//! fails with [`Error::Unavailable`]; a subscriber drops a message whose id it delivered among
//! the last [`Config::dedup_window`]. With [`Delivery::AtLeastOnce`] a message is acknowledged
//! once the application came back for more after it, so a broker killed and restarted loses
//! no acknowledged message, and the subscriber hands each one to the application once.
//! Deduplication is per subscriber connection. With [`Delivery::AtMostOnce`] messages are
//! acknowledged before the application gets them, so a member taking over from a failed one
//! never gets again what the failed one handed out (it may lose what the failed one had in
//! hand); on Kafka this waits for a commit of the positions the broker acknowledged.
//!
//! # Kafka groups
//!
//! A `kafka::KafkaBroker` group is static (member `index` of `count` owns a fixed share of
//! the partitions); a `kafka::group::KafkaGroupBroker` group rebalances as members join,
//! leave or die, agreeing on the assignment through a chunnel-rendezvous store (features
//! `kafka` and `group`).
//!
//! # Backpressure
//!
//! A subscriber fetches only when its buffer is empty and at most [`Config::prefetch`]
//! messages at a time: a slow application leaves the rest at the broker.
//!
//! # Example
//!
//! Publish and subscribe through Redis Streams (feature `redis`; the hidden lines start a
//! redis-server on a free port, as the tests do):
//!
//! ```
//! # #[cfg(feature = "redis")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel::Error> {
//! # let scratch = chunnel_test::services::Scratch::new("pubsub-doc");
//! # let (_server, url) = chunnel_test::brokers::redis(&scratch);
//! use bytes::Bytes;
//! use chunnel::{Chunnel, ChunnelConnection, ConnectionExt};
//! use chunnel_pubsub::{Config, Member, Publish, Subscribe, redis::RedisBroker};
//!
//! let broker = RedisBroker::new(&url)?; // redis://127.0.0.1:<port>/
//! let config = Config::default();
//! let publisher = Publish::new(broker.clone(), "orders", config.clone())
//!     .connect_wrap(())
//!     .await?;
//! let subscriber = Subscribe::new(broker, "orders", Member::sole("billing"), config)
//!     .connect_wrap(())
//!     .await?;
//! publisher
//!     .send([Bytes::from_static(b"one"), Bytes::from_static(b"two")])
//!     .await?;
//! assert_eq!(subscriber.recv_one().await?, "one");
//! assert_eq!(subscriber.recv_one().await?, "two");
//! subscriber.ack().await?;
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "redis"))]
//! # fn main() {}
//! ```
#![warn(missing_docs)]

mod broker;
mod conn;
mod error;
mod id;

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
pub mod order;
#[cfg(feature = "redis")]
pub mod redis;

pub use broker::{Broker, Consumer, Incoming, Lane, Member, Outgoing, Producer};
pub use conn::{Config, Publish, Publisher, SubStats, Subscribe, Subscriber};
pub use error::Error;
pub use id::MsgId;

/// The negotiation id of the pub/sub Chunnels.
pub const ID: &str = "chunnel/pubsub/1";

/// What a pub/sub Chunnel offers in negotiation, without a broker connection: [`Publish`] and
/// [`Subscribe`] describe themselves through it, and a party that only states requirements
/// (a rendezvous member, documentation) can build one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offer {
    /// `kafka`, `nats` or `redis` ([`Broker::NAME`]).
    pub broker: &'static str,
    /// The order a group member gets.
    pub ordering: Ordering,
    /// How acknowledgements are done.
    pub delivery: Delivery,
}

impl chunnel::Negotiate for Offer {
    fn id(&self) -> &'static str {
        ID
    }
    fn capabilities(&self) -> Vec<chunnel::Capability> {
        vec![
            chunnel::Capability::exact("pubsub-broker", [self.broker]),
            chunnel::Capability::exact("pubsub-ordering", [self.ordering.label()]),
            chunnel::Capability::exact("pubsub-delivery", [self.delivery.label()]),
        ]
    }
}

/// The order in which a group member receives the messages of one publisher.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ordering {
    /// No promise.
    None,
    /// Messages with equal keys arrive in publication order.
    PerKey,
    /// All messages arrive in publication order.
    Total,
}

impl Ordering {
    /// The label of the `pubsub-ordering` capability: `none`, `per-key`, `total`.
    pub fn label(self) -> &'static str {
        match self {
            Ordering::None => "none",
            Ordering::PerKey => "per-key",
            Ordering::Total => "total",
        }
    }
}

/// How often a message reaches a subscriber's application.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Delivery {
    /// Acknowledged before the application sees it: lost if the application fails after.
    AtMostOnce,
    /// Acknowledged after the application is done with it: redelivered (and deduplicated by
    /// id within the window) if anything fails before.
    AtLeastOnce,
}

impl Delivery {
    /// The label of the `pubsub-delivery` capability: `at-most-once`, `at-least-once`.
    pub fn label(self) -> &'static str {
        match self {
            Delivery::AtMostOnce => "at-most-once",
            Delivery::AtLeastOnce => "at-least-once",
        }
    }
}

#[cfg(test)]
mod tests {
    use chunnel::Negotiate;

    use super::*;

    fn compatible(a: &Offer, b: &Offer) -> bool {
        let (a, b) = (a.capabilities(), b.capabilities());
        a.len() == b.len() && a.iter().all(|c| b.iter().any(|d| c.compatible(d)))
    }

    #[test]
    fn offers_match_on_broker_ordering_and_delivery() {
        let kafka = Offer {
            broker: "kafka",
            ordering: Ordering::PerKey,
            delivery: Delivery::AtLeastOnce,
        };
        assert!(compatible(&kafka, &kafka));
        assert!(!compatible(
            &kafka,
            &Offer {
                broker: "nats",
                ..kafka
            }
        ));
        assert!(!compatible(
            &kafka,
            &Offer {
                ordering: Ordering::Total,
                ..kafka
            }
        ));
        assert!(!compatible(
            &kafka,
            &Offer {
                delivery: Delivery::AtMostOnce,
                ..kafka
            }
        ));
        assert_eq!(kafka.id(), ID);
    }
}
