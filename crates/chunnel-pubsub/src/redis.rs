//! Redis Streams through the redis crate (feature `redis`).
//!
//! A topic is a stream of that name; a message is an entry with the fields `i` (the 16-byte
//! message id), `d` (the payload) and, if keyed, `k`. A publisher sends a burst as one
//! pipeline of `XADD`s. A group is a stream consumer group (created from the stream's start);
//! its members read with `XREADGROUP` and share the messages dynamically ([`Ordering::None`]),
//! acknowledging with `XACK`. A member first re-reads its own pending entries (delivered to it
//! but never acknowledged: after a reconnection, a cancelled read, or a restart under the same
//! member name), then new ones. Durability is the server's: the tests run redis-server with an
//! append-only file.

/// The redis crate this backend uses (for direct use beside the Chunnels).
pub use ::redis as client;

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::streams::StreamReadReply;

use crate::broker::{Broker, Consumer, Incoming, Member, Outgoing, Producer};
use crate::{Error, MsgId, Ordering};

const NAME: &str = "redis";

fn unavailable(op: &'static str, e: redis::RedisError) -> Error {
    Error::Unavailable {
        broker: NAME,
        op,
        waited: Duration::ZERO,
        last: e.to_string(),
    }
}

/// A Redis server, shared by the Chunnels that use it. Every producer and consumer has its own
/// connection (a consumer's blocking read would hold up a shared one).
#[derive(Clone, Debug)]
pub struct RedisBroker {
    client: redis::Client,
    op_timeout: Duration,
}

impl RedisBroker {
    /// A broker at `url` (`redis://host:port/`), with a 10 s bound on every operation. Does
    /// not connect yet.
    pub fn new(url: &str) -> Result<RedisBroker, Error> {
        Ok(RedisBroker {
            client: redis::Client::open(url).map_err(|e| Error::Config {
                what: format!("redis url {url:?}: {e}"),
            })?,
            op_timeout: Duration::from_secs(10),
        })
    }

    /// Bounds every connection attempt and command by `op_timeout` (it must exceed the
    /// subscribers' [`crate::Config::poll`]).
    pub fn op_timeout(mut self, op_timeout: Duration) -> Self {
        self.op_timeout = op_timeout;
        self
    }

    /// A new reconnecting connection to the server.
    pub async fn connection(&self) -> Result<ConnectionManager, Error> {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.op_timeout))
            .set_response_timeout(Some(self.op_timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(200));
        ConnectionManager::new_with_config(self.client.clone(), config)
            .await
            .map_err(|e| unavailable("connect", e))
    }
}

impl Broker for RedisBroker {
    const NAME: &'static str = NAME;
    type Producer = RedisProducer;
    type Consumer = RedisConsumer;

    fn ordering(&self) -> Ordering {
        Ordering::None
    }

    async fn producer(&self, topic: &str) -> Result<RedisProducer, Error> {
        Ok(RedisProducer {
            conn: self.connection().await?,
            topic: topic.to_owned(),
        })
    }

    async fn consumer(
        &self,
        topic: &str,
        member: &Member,
        _prefetch: usize,
    ) -> Result<RedisConsumer, Error> {
        let mut conn = self.connection().await?;
        let created: Result<(), _> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(topic)
            .arg(&member.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await;
        match created {
            Ok(()) => {}
            Err(e) if e.code() == Some("BUSYGROUP") => {}
            Err(e) => return Err(unavailable("create group", e)),
        }
        Ok(RedisConsumer {
            conn,
            topic: topic.to_owned(),
            group: member.group.clone(),
            name: member.name.clone(),
            pending: true,
        })
    }
}

/// Publishes to one stream.
pub struct RedisProducer {
    conn: ConnectionManager,
    topic: String,
}

impl Producer for RedisProducer {
    async fn publish(&self, batch: &[Outgoing]) -> Result<(), Error> {
        let mut pipe = redis::pipe();
        for m in batch {
            let cmd = pipe
                .cmd("XADD")
                .arg(&self.topic)
                .arg("*")
                .arg("i")
                .arg(&m.id.to_bytes()[..])
                .arg("d")
                .arg(&m.payload[..]);
            if let Some(k) = &m.key {
                cmd.arg("k").arg(&k[..]);
            }
            cmd.ignore();
        }
        let mut conn = self.conn.clone();
        pipe.query_async::<()>(&mut conn)
            .await
            .map_err(|e| unavailable("publish", e))
    }
}

/// One member of a stream consumer group.
pub struct RedisConsumer {
    conn: ConnectionManager,
    topic: String,
    group: String,
    name: String,
    /// Re-read this member's pending entries before new ones.
    pending: bool,
}

/// Acknowledges one stream entry (its id).
#[derive(Debug)]
pub struct RedisToken(String);

fn bytes_of(v: Option<redis::Value>) -> Option<Bytes> {
    match v? {
        redis::Value::BulkString(b) => Some(Bytes::from(b)),
        _ => None,
    }
}

impl Consumer for RedisConsumer {
    type Token = RedisToken;

    async fn fetch(
        &mut self,
        max: usize,
        wait: Duration,
        out: &mut VecDeque<Incoming<RedisToken>>,
    ) -> Result<(), Error> {
        let reread = self.pending;
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.group)
            .arg(&self.name)
            .arg("COUNT")
            .arg(max);
        if !reread {
            cmd.arg("BLOCK").arg(wait.as_millis().max(1) as u64);
        }
        cmd.arg("STREAMS")
            .arg(&self.topic)
            .arg(if reread { "0" } else { ">" });
        // Until the answer is in `out`, a cancelled or failed read leaves entries pending.
        self.pending = true;
        let reply: Option<StreamReadReply> = cmd
            .query_async(&mut self.conn)
            .await
            .map_err(|e| unavailable("read", e))?;
        let entries = reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids);
        let mut got = 0;
        for mut e in entries {
            got += 1;
            let id = bytes_of(e.map.remove("i")).and_then(|b| MsgId::from_bytes(&b));
            let payload = bytes_of(e.map.remove("d"));
            let key = bytes_of(e.map.remove("k"));
            out.push_back(Incoming {
                // An entry trimmed from the stream while pending comes back without fields:
                // it is acknowledged and dropped (an empty id marks it).
                id: if payload.is_some() {
                    id
                } else {
                    Some(MsgId {
                        producer: 0,
                        seq: 0,
                    })
                },
                key,
                payload: payload.unwrap_or_default(),
                token: RedisToken(e.id),
            });
        }
        // After a re-read that found nothing pending, read new entries.
        self.pending = reread && got > 0;
        Ok(())
    }

    async fn ack(&mut self, tokens: &mut Vec<RedisToken>) -> Result<(), Error> {
        if tokens.is_empty() {
            return Ok(());
        }
        let mut cmd = redis::cmd("XACK");
        cmd.arg(&self.topic).arg(&self.group);
        for RedisToken(id) in tokens.drain(..) {
            cmd.arg(id);
        }
        let r = cmd.query_async::<()>(&mut self.conn).await;
        // Not acknowledged: the entries stay pending for this member; read them again.
        self.pending |= r.is_err();
        r.map_err(|e| unavailable("ack", e))
    }
}
