//! NATS JetStream through async-nats (feature `nats`).
//!
//! A topic is a JetStream stream of that name, file-backed, whose one subject is the topic's
//! name. A publisher waits for JetStream's acknowledgement of every message; the message id
//! travels in `Nats-Msg-Id`, which JetStream also deduplicates on (within its duplicate
//! window), so a retried publish is stored once. A group is a durable pull consumer named after
//! it, with explicit acknowledgement: its members share the messages dynamically (each message
//! to one member), so a member gets them in no promised order ([`Ordering::None`]); a message
//! not acknowledged within [`NatsBroker::ack_wait`] is redelivered. Keys are not carried.

/// The async-nats crate this backend uses (for direct use beside the Chunnels).
pub use async_nats;

use std::collections::VecDeque;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use bytes::Bytes;
use futures::{FutureExt, StreamExt};

use crate::broker::{Broker, Consumer, Incoming, Member, Outgoing, Producer};
use crate::{Error, MsgId, Ordering};

const NAME: &str = "nats";

fn unavailable(op: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Unavailable {
        broker: NAME,
        op,
        waited: Duration::ZERO,
        last: e.to_string(),
    }
}

/// A NATS server (with JetStream), shared by the Chunnels that use it.
#[derive(Clone, Debug)]
pub struct NatsBroker {
    client: async_nats::Client,
    js: jetstream::Context,
    ack_wait: Duration,
}

impl NatsBroker {
    /// Connects to the server at `addr` (`host:port`). Requests (publish acknowledgements,
    /// stream and consumer management) time out after `op_timeout`; a lost connection is
    /// re-established in the background, retrying every 50 ms to 500 ms.
    pub async fn connect(addr: &str, op_timeout: Duration) -> Result<NatsBroker, Error> {
        let options = async_nats::ConnectOptions::new()
            .connection_timeout(op_timeout)
            .request_timeout(Some(op_timeout))
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis((50 * attempts as u64).min(500))
            });
        let client = tokio::time::timeout(op_timeout, options.connect(addr))
            .await
            .map_err(|_| unavailable("connect", "timed out"))?
            .map_err(|e| unavailable("connect", e))?;
        let mut js = jetstream::new(client.clone());
        js.set_timeout(op_timeout);
        Ok(NatsBroker {
            client,
            js,
            ack_wait: Duration::from_secs(5),
        })
    }

    /// How long a delivered message may stay unacknowledged before JetStream redelivers it
    /// (consumers created from now on). Default 5 s.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// The JetStream context (the benchmark uses it directly as the baseline).
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// Creates the topic's stream unless it exists.
    pub async fn ensure_stream(&self, topic: &str) -> Result<stream::Stream, Error> {
        self.js
            .get_or_create_stream(stream::Config {
                name: topic.to_owned(),
                subjects: vec![topic.to_owned()],
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(|e| unavailable("create stream", e))
    }
}

impl Broker for NatsBroker {
    const NAME: &'static str = NAME;
    type Producer = NatsProducer;
    type Consumer = NatsConsumer;

    fn ordering(&self) -> Ordering {
        Ordering::None
    }

    async fn producer(&self, topic: &str) -> Result<NatsProducer, Error> {
        self.ensure_stream(topic).await?;
        Ok(NatsProducer {
            js: self.js.clone(),
            subject: async_nats::Subject::from(topic),
        })
    }

    async fn consumer(
        &self,
        topic: &str,
        member: &Member,
        prefetch: usize,
    ) -> Result<NatsConsumer, Error> {
        let stream = self.ensure_stream(topic).await?;
        let consumer: consumer::PullConsumer = stream
            .get_or_create_consumer(
                &member.group,
                consumer::pull::Config {
                    durable_name: Some(member.group.clone()),
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait: self.ack_wait,
                    max_ack_pending: (prefetch * 4) as i64,
                    deliver_policy: consumer::DeliverPolicy::All,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| unavailable("create consumer", e))?;
        Ok(NatsConsumer {
            consumer,
            messages: None,
            client: self.client.clone(),
            batch: prefetch,
        })
    }
}

/// Publishes to one JetStream stream.
#[derive(Debug)]
pub struct NatsProducer {
    js: jetstream::Context,
    subject: async_nats::Subject,
}

impl Producer for NatsProducer {
    async fn publish(&self, batch: &[Outgoing]) -> Result<(), Error> {
        // Send the whole burst, then wait for the acknowledgements: one round trip per burst.
        let mut acks = Vec::with_capacity(batch.len());
        for m in batch {
            let p = jetstream::context::Publish::build()
                .payload(m.payload.clone())
                .message_id(m.id.to_hex());
            acks.push(
                self.js
                    .send_publish(self.subject.clone(), p)
                    .await
                    .map_err(|e| unavailable("publish", e))?,
            );
        }
        for ack in acks {
            ack.await.map_err(|e| unavailable("publish", e))?;
        }
        Ok(())
    }
}

/// One member of a JetStream durable pull consumer.
pub struct NatsConsumer {
    consumer: consumer::PullConsumer,
    messages: Option<consumer::pull::Stream>,
    client: async_nats::Client,
    batch: usize,
}

/// Acknowledges one JetStream message (its reply subject).
#[derive(Debug)]
pub struct NatsToken(Option<async_nats::Subject>);

fn incoming(m: jetstream::Message) -> Incoming<NatsToken> {
    let m = m.message;
    let id = m
        .headers
        .as_ref()
        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
        .and_then(|v| MsgId::from_hex(v.as_str()));
    Incoming {
        id,
        key: None,
        payload: m.payload,
        token: NatsToken(m.reply),
    }
}

impl Consumer for NatsConsumer {
    type Token = NatsToken;

    async fn fetch(
        &mut self,
        max: usize,
        wait: Duration,
        out: &mut VecDeque<Incoming<NatsToken>>,
    ) -> Result<(), Error> {
        // A pull waits quietly through a disconnection; report it instead (the subscriber
        // retries for its op_timeout, then fails).
        if self.client.connection_state() != async_nats::connection::State::Connected {
            self.messages = None;
            tokio::time::sleep(wait.min(Duration::from_millis(50))).await;
            return Err(unavailable("pull", "not connected"));
        }
        if self.messages.is_none() {
            let s = self
                .consumer
                .stream()
                .max_messages_per_batch(self.batch)
                // No idle heartbeat: with one, async-nats arms a fresh boxed timer for every
                // message it yields (a fifth of the client's time per message in the
                // benchmark). A lost connection is caught by the state check above before
                // every fetch, and async-nats re-sends the pull request on reconnection; a
                // pull request the server forgot expires after 5 s and is renewed.
                .expires(Duration::from_secs(5))
                .messages()
                .await
                .map_err(|e| unavailable("pull", e))?;
            self.messages = Some(s);
        }
        let Some(messages) = self.messages.as_mut() else {
            return Ok(());
        };
        // A message already there is taken without arming a timer.
        let first = match messages.next().now_or_never() {
            Some(m) => m,
            None => match tokio::time::timeout(wait, messages.next()).await {
                Err(_) => return Ok(()),
                Ok(m) => m,
            },
        };
        let mut next = first;
        let mut got = 0;
        loop {
            match next {
                Some(Ok(m)) => {
                    out.push_back(incoming(m));
                    got += 1;
                }
                Some(Err(e)) => {
                    self.messages = None;
                    return if got > 0 {
                        Ok(())
                    } else {
                        Err(unavailable("pull", e))
                    };
                }
                None => {
                    self.messages = None;
                    return Ok(());
                }
            }
            if got == max {
                return Ok(());
            }
            match messages.next().now_or_never() {
                Some(m) => next = m,
                None => return Ok(()),
            }
        }
    }

    /// JetStream answers an acknowledgement sent as a request (its "ack ack") once it
    /// recorded it; the requests of one call are in flight together.
    async fn ack_confirmed(&mut self, tokens: &mut Vec<NatsToken>) -> Result<(), Error> {
        let client = &self.client;
        let mut pending: futures::stream::FuturesUnordered<_> = tokens
            .drain(..)
            .filter_map(|NatsToken(reply)| reply)
            .map(|reply| client.request(reply, Bytes::from_static(b"+ACK")))
            .collect();
        let mut result = Ok(());
        while let Some(r) = futures::StreamExt::next(&mut pending).await {
            if let Err(e) = r
                && result.is_ok()
            {
                result = Err(unavailable("ack", e));
            }
        }
        result
    }

    async fn ack(&mut self, tokens: &mut Vec<NatsToken>) -> Result<(), Error> {
        let mut result = Ok(());
        for NatsToken(reply) in tokens.drain(..) {
            if let Some(reply) = reply
                && result.is_ok()
            {
                result = self
                    .client
                    .publish(reply, Bytes::from_static(b"+ACK"))
                    .await
                    .map_err(|e| unavailable("ack", e));
            }
        }
        result
    }
}
