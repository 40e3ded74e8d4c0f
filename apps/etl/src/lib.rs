//! # chunnel-etl: the ETL pipeline of the Bertha paper (§7.2)
//!
//! Streaming log lines, extracted, transformed and loaded through four roles and a broker:
//!
//! ```text
//! producers ──(hop)──▶ ingest servers ──Publish──▶ broker topic ──Subscribe──▶ parsers ──(hop)──▶ consumer
//!   log lines    load-balanced,        Kafka / NATS JetStream /   consumer group:    parsed records,
//!   stamped      acknowledged after    Redis Streams              each message to    every id accounted
//!                the broker stored it  (chunnel-pubsub)           one parser         once, latency
//! ```
//!
//! * **Hops** ([`hop`]): producer → ingest and parser → consumer are negotiated Chunnel stacks
//!   over UDP, `Serialize<Msg, bincode> | select(LocalFastPath, Identity)`: negotiation picks
//!   shared memory (`chunnel-shm`) when both ends share this host's `/dev/shm`, else the
//!   connection stays on UDP, as between hosts ([`PipelineConfig::shm`] false forces that).
//!   A [`hop::HopSender`] balances batches round-robin over several servers, waits for each
//!   batch's acknowledgement, retransmits, and moves a batch to another server when its server
//!   dies or stays silent; it negotiates again with a server whose connection ended (a bounded
//!   backoff, [`hop::SenderConfig::reconnect_max`]), which takes its turn again once back.
//! * **Broker** hops are `chunnel_pubsub`'s [`Publish`](chunnel_pubsub::Publish) (ingest) and
//!   [`Subscribe`](chunnel_pubsub::Subscribe) (parsers, one consumer group; Kafka gives each
//!   parser its own partition).
//! * **Delivery**: an ingest server acknowledges a batch once the broker stored it; a parser's
//!   broker messages are acknowledged once the consumer acknowledged what the parser made of
//!   them; so every record a producer saw acknowledged reaches the consumer even if an ingest
//!   server or a parser dies (at least once). Copies (a batch resent to a second ingest server
//!   because the first died before answering) are dropped at the consumer by record id, which
//!   also checks that every sequence number of every producer arrived, as a parsed record or
//!   as one the parser counted malformed and skipped.
//! * **Latency**: each record carries its producer's stamp (Unix ns, its scheduled time); the
//!   consumer records stamp → arrival ([`Report`]).
//!
//! Broker backends are features (`kafka`, `nats`, `redis`), as in `chunnel-pubsub`.
//! [`pipeline::run`] runs the whole pipeline in one process, starting the broker itself
//! (chunnel-test's launchers) when no address is given; the binary `chunnel-etl` also starts
//! each role on its own (`ingest`, `parse`, `consume`, `produce`) and measures latency against
//! offered load (`bench`).
#![warn(missing_docs)]

pub mod bench;
pub mod hop;
pub mod pipeline;
pub mod record;
pub mod roles;

use std::time::Duration;

pub use chunnel_pubsub;
pub use pipeline::{PipelineConfig, Report, run, run_with};

/// The application's errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Binding or negotiating a hop failed.
    #[error("negotiation: {0}")]
    Negotiate(#[from] chunnel_negotiate::Error),
    /// Opening a publisher or subscriber failed.
    #[error("broker connection: {0}")]
    Broker(chunnel::Error),
    /// The broker client failed.
    #[error(transparent)]
    Pubsub(#[from] chunnel_pubsub::Error),
    /// None of the servers of a hop negotiated a connection.
    #[error("no server of the hop answered; last error: {last}")]
    NoServer {
        /// The last server's error.
        last: String,
    },
    /// No server acknowledged a batch within the sender's limit.
    #[error("no server acknowledged a batch within {waited:?}")]
    NotAcknowledged {
        /// How long it was tried.
        waited: Duration,
    },
    /// The component was stopped.
    #[error("stopped")]
    Stopped,
    /// A task of the pipeline panicked or was cancelled.
    #[error("task failed: {0}")]
    Task(String),
    /// The embedded broker did not start.
    #[error("could not start {broker}: {why}")]
    BrokerStart {
        /// Which broker.
        broker: &'static str,
        /// The launcher's message.
        why: String,
    },
    /// This binary was built without the broker's feature.
    #[error("built without the `{0}` feature (cargo build --features {0})")]
    NotBuilt(&'static str),
}

/// The brokers the pipeline runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BrokerKind {
    /// Kafka (rskafka; feature `kafka`).
    Kafka,
    /// NATS JetStream (async-nats; feature `nats`).
    Nats,
    /// Redis Streams (redis; feature `redis`).
    Redis,
}

impl BrokerKind {
    /// `kafka`, `nats`, `redis`.
    pub fn name(self) -> &'static str {
        match self {
            BrokerKind::Kafka => "kafka",
            BrokerKind::Nats => "nats",
            BrokerKind::Redis => "redis",
        }
    }
}

/// How long broker operations are retried before they fail.
pub const BROKER_OP_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to broker `$kind` at `$addr` (`host:port`; Redis: `redis://host:port/`; Kafka
/// topics with `$partitions` partitions), binds it to `$b` and evaluates `$body` (an
/// expression of type `Result<_, Error>`, may `.await`). A backend this build lacks is
/// [`Error::NotBuilt`].
#[macro_export]
macro_rules! with_broker {
    ($kind:expr, $addr:expr, $partitions:expr, |$b:ident| $body:expr) => {{
        #[allow(unused_variables)]
        let (addr, partitions): (&str, i32) = ($addr, $partitions);
        match $kind {
            $crate::BrokerKind::Kafka => {
                #[cfg(feature = "kafka")]
                {
                    match $crate::chunnel_pubsub::kafka::KafkaBroker::connect(
                        vec![addr.to_string()],
                        partitions,
                        $crate::BROKER_OP_TIMEOUT,
                    )
                    .await
                    {
                        Ok($b) => $body,
                        Err(e) => Err($crate::Error::Pubsub(e)),
                    }
                }
                #[cfg(not(feature = "kafka"))]
                {
                    Err($crate::Error::NotBuilt("kafka"))
                }
            }
            $crate::BrokerKind::Nats => {
                #[cfg(feature = "nats")]
                {
                    match $crate::chunnel_pubsub::nats::NatsBroker::connect(
                        addr,
                        $crate::BROKER_OP_TIMEOUT,
                    )
                    .await
                    {
                        Ok($b) => $body,
                        Err(e) => Err($crate::Error::Pubsub(e)),
                    }
                }
                #[cfg(not(feature = "nats"))]
                {
                    Err($crate::Error::NotBuilt("nats"))
                }
            }
            $crate::BrokerKind::Redis => {
                #[cfg(feature = "redis")]
                {
                    match $crate::chunnel_pubsub::redis::RedisBroker::new(addr) {
                        Ok($b) => $body,
                        Err(e) => Err($crate::Error::Pubsub(e)),
                    }
                }
                #[cfg(not(feature = "redis"))]
                {
                    Err($crate::Error::NotBuilt("redis"))
                }
            }
        }
    }};
}
