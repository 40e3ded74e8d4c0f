//! The Redis backend: a group record in a few Redis keys, every operation one Lua script.
//!
//! Redis runs a script to completion before it serves any other command, so each [`Store`]
//! operation (sent as `EVALSHA`, loaded again after a `NOSCRIPT` reply when the server has
//! restarted) is one serializable transaction.
//!
//! # Key layout
//!
//! The keys of group `g` all share the hash tag `{g}`, so on a cluster they would live on one
//! slot (a script may only touch keys of one slot). Braces and `%` in the group name are
//! escaped in the tag (`%7B`, `%7D`, `%25`) so the tag is always exactly the (escaped) name;
//! other names appear verbatim.
//!
//! | key                      | type       | contents                                              |
//! |--------------------------|------------|-------------------------------------------------------|
//! | `chunnel:{g}:meta`       | hash       | `epoch`, `stack` (binary), `outcome_id`, `outcome_committed` (`1`/`0`) |
//! | `chunnel:{g}:members`    | sorted set | member id, scored by its lease expiry (Unix ms)       |
//! | `chunnel:{g}:addrs`      | hash       | member id → address                                   |
//! | `chunnel:{g}:transition` | hash       | `id`, `from_epoch`, `next_epoch`, `proposer`, `stack` (binary), `deadline_ms`, and `ballot_box` if the proposer collects direct ballots |
//! | `chunnel:{g}:ballots`    | hash       | member id → [`Ballot::encode`]                        |
//!
//! and the pub/sub channel `chunnel:{g}:changed` (below).
//!
//! Every u64 (ids, epochs, deadlines) is stored as a decimal string and only ever compared as a
//! string inside the scripts, never converted to a Lua number (a double, exact only up to
//! 2^53); the one increment (`epoch + 1` when a transition commits) is computed here when the
//! transition is proposed and stored as `next_epoch`. Stacks travel as script arguments and
//! come back as bulk strings, byte for byte.
//!
//! Leases use the Redis server's clock (`TIME` inside the script), which all participants
//! share: every script first removes the members whose lease expiry is at or before now
//! (`ZREMRANGEBYSCORE`, and their addresses). Lease expiries are scores (doubles), exact for
//! the millisecond timestamps involved; leases are capped at [`RedisStore::MAX_LEASE`].
//!
//! # Growth
//!
//! Every script that writes ends by setting the expiry (`PEXPIREAT`, server clock) of all five
//! keys of its group to the latest lease expiry among the members (or now, if none is left)
//! plus the grace period ([`RedisStore::with_grace`], default [`RedisStore::DEFAULT_GRACE`]).
//! Renewals push it forward, so a live group never expires; a group nobody joined, renewed
//! or wrote for lease + grace expires as a whole, by Redis itself (no client needs to be
//! alive; Redis's active expiry cycle reclaims expired keys within seconds, and no command
//! ever sees one). So the server holds, for each group with a member joined or renewed within
//! lease + grace: `meta`, `members` and `addrs` (3 keys, one entry per member in the two
//! member keys), plus `transition` and `ballots` while a transition is pending (5 keys at
//! most); and nothing for any other group. A member that stopped renewing stays in its
//! group's `members` and `addrs` until the next script on that group (every renewal of a
//! live member is one) or until the whole group expires; no snapshot ever shows it.
//!
//! # Notifications
//!
//! Every script that changes what a snapshot shows ends with a `PUBLISH` on the group's
//! channel `chunnel:{g}:changed`, inside the script, so the message is sent exactly when the
//! change is applied. The message names what changed, one letter per kind: `m` (members: a
//! join, a leave, or members whose lease ran out, removed by any script), `t` (a transition
//! proposed or finished, the committed stack), `b` (a ballot that may decide the transition:
//! a no, or the one that brings the ballots up to the number of live members; a yes before
//! that publishes nothing, since only the proposer acts on ballots and it could not decide
//! yet). The kinds may be followed by `\n` and news, the change itself, so a participant
//! need not read the record: the proposing script appends
//! `P\n<id>\n<from epoch>\n<deadline ms>\n<proposer>\n<stack>` (or, for a transition with a
//! ballot box, `Q\n<id>\n<from epoch>\n<deadline ms>\n<ballot box>\n<proposer>\n<stack>`),
//! the finishing one
//! `F\n<id>\n<1|0>\n<epoch>\n<stack>` (the committed stack after it); numbers in decimal,
//! the stack's bytes to the end. A renewal that removes nobody and a snapshot publish
//! nothing. [`Store::watch`] subscribes to the channel on a connection
//! of its own and wakes the participant on every message.
//!
//! Why a `PUBLISH` from the scripts and not keyspace notifications: keyspace notifications
//! need `CONFIG SET notify-keyspace-events`, which managed Redis services often refuse, and
//! they would fire on every renewal (each one rewrites the lease scores and the keys'
//! expiry), waking every member about once a second for nothing; a `PUBLISH` works on any
//! Redis that runs the scripts, and says what kind of change it was, so members ignore
//! ballots they do not collect.
//!
//! Redis pub/sub is fire-and-forget: a message published while the subscriber is
//! disconnected is lost. So the subscription reconnects after a failure with a bounded
//! backoff ([`RedisStore::WATCH_BACKOFF`], from 50 ms doubling up to it), and a watch counts
//! as complete ([`crate::Watch::is_complete`]) only while subscribed: meanwhile participants
//! poll at their fast interval, and when the subscription is back they read the record once
//! (what they missed). The subscriber pings the server every
//! [`RedisStore::WATCH_PING`] and counts a ping unanswered within [`RedisStore::TIMEOUT`]
//! as a broken connection, so a silently dead one is noticed. Messages are not queued by the
//! watch: each one only sets a bit per kind, merged until the participant takes them (the
//! `redis` crate's subscriber queues what the socket delivered until this task, which does
//! nothing else, reads it; Redis itself disconnects a subscriber that falls behind by its
//! `client-output-buffer-limit pubsub`, which is then a broken connection as above).
//!
//! # Connections
//!
//! A [`RedisStore`] holds one multiplexed connection, shared by its clones. Connecting and
//! every reply are bounded by [`RedisStore::TIMEOUT`]; an I/O error or a timeout drops the
//! connection, and the next operation connects afresh, so a store that was down (or restarted)
//! is used again as soon as it is back. Until then operations fail with
//! [`Error::Unavailable`]; callers waiting for the same connection attempt share its failure
//! rather than each timing out in turn. As with any remote store, an operation that timed out
//! may still have been applied. (This is what the `redis` crate's `ConnectionManager` does,
//! without its backoff loop, which would make a dead store answer late, and without its crate
//! feature `connection-manager` and the dependencies that brings.)

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ::redis::aio::MultiplexedConnection;
use ::redis::{AsyncConnectionConfig, Client, Msg, RedisError, Script, Value};
use bytes::Bytes;

use crate::Error;
use crate::ballot::BallotBox;
use crate::store::{
    Ballot, Changes, Committed, JoinReply, Member, News, Notifier, Outcome, Snapshot, Store,
    Transition, Watch, check_name,
};

const BACKEND: &str = "redis";

/// Runs first in every script: binds the keys, defines `publish(kinds)` (a message on the
/// group's channel `chunnel:{g}:changed`, named after `meta` without its last component),
/// reads the server clock into `now` (Unix ms) and removes the members whose lease ran out
/// (with their addresses; publishing `m` if there were any), and defines `read()`, which
/// returns the whole record as
/// `{HGETALL meta, ZRANGE members, HGETALL addrs, HGETALL transition, HGETALL ballots}`.
const PRELUDE: &str = r"
local meta, members, addrs, transition, ballots = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local channel = string.sub(meta, 1, #meta - 4) .. 'changed'
local function publish(kinds)
  redis.call('PUBLISH', channel, kinds)
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local dead = redis.call('ZRANGEBYSCORE', members, '-inf', now)
if #dead > 0 then
  redis.call('ZREMRANGEBYSCORE', members, '-inf', now)
  for _, id in ipairs(dead) do
    redis.call('HDEL', addrs, id)
  end
  publish('m')
end
local grace = tonumber(ARGV[#ARGV])
-- After a write: every key of the group expires `grace` after the last member's lease (or
-- after now, if no member is left), so a group nobody renews vanishes on its own.
local function touch()
  local last = redis.call('ZRANGE', members, -1, -1, 'WITHSCORES')
  local until_ms = now
  if #last == 2 and tonumber(last[2]) > now then
    until_ms = tonumber(last[2])
  end
  local at = string.format('%d', until_ms + grace)
  for _, key in ipairs({meta, members, addrs, transition, ballots}) do
    redis.call('PEXPIREAT', key, at)
  end
end
local function read()
  return {
    redis.call('HGETALL', meta),
    redis.call('ZRANGE', members, 0, -1),
    redis.call('HGETALL', addrs),
    redis.call('HGETALL', transition),
    redis.call('HGETALL', ballots),
  }
end
";

/// ARGV: member id, address, lease ms, `1` if proposing, proposed stack, `1` if an epoch is
/// expected, expected epoch, epoch of a created group. Returns
/// `{'created' | 'joined' | 'current', read()}`; publishes `mt` (created) or `m` (joined).
const JOIN: &str = r"
local id, addr, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])
local epoch = redis.call('HGET', meta, 'epoch')
local reply
if not epoch and ARGV[4] == '1' then
  redis.call('HSET', meta, 'epoch', ARGV[8], 'stack', ARGV[5])
  reply = 'created'
elseif epoch and ARGV[6] == '1' and epoch == ARGV[7] then
  reply = 'joined'
else
  return {'current', read()}
end
redis.call('ZADD', members, now + lease, id)
redis.call('HSET', addrs, id, addr)
touch()
if reply == 'created' then
  publish('mt')
else
  publish('m')
end
return {reply, read()}
";

/// ARGV: member id, lease ms. Returns 1 if the member was live (and is renewed), else 0.
const RENEW: &str = r"
if not redis.call('ZSCORE', members, ARGV[1]) then
  return 0
end
redis.call('ZADD', members, 'XX', now + tonumber(ARGV[2]), ARGV[1])
touch()
return 1
";

/// ARGV: member id. Removes the member, its address and its ballot; publishes `m`.
const LEAVE: &str = r"
redis.call('ZREM', members, ARGV[1])
redis.call('HDEL', addrs, ARGV[1])
redis.call('HDEL', ballots, ARGV[1])
touch()
publish('m')
return 1
";

/// No ARGV. Returns `read()`.
const SNAPSHOT: &str = r"
return read()
";

/// ARGV: id, from epoch, next epoch, proposer, stack, deadline ms, ballot box (stored form, or
/// empty for none). Returns 1 if recorded (and publishes `t`), 0 if the group is not at
/// `from_epoch` or a transition is pending.
const PROPOSE: &str = r"
local epoch = redis.call('HGET', meta, 'epoch')
if not epoch or epoch ~= ARGV[2] or redis.call('EXISTS', transition) == 1 then
  return 0
end
redis.call('DEL', ballots)
redis.call('HSET', transition, 'id', ARGV[1], 'from_epoch', ARGV[2], 'next_epoch', ARGV[3],
  'proposer', ARGV[4], 'stack', ARGV[5], 'deadline_ms', ARGV[6])
touch()
if ARGV[7] == '' then
  publish('t\nP\n' .. ARGV[1] .. '\n' .. ARGV[2] .. '\n' .. ARGV[6] .. '\n' .. ARGV[4] .. '\n' .. ARGV[5])
else
  redis.call('HSET', transition, 'ballot_box', ARGV[7])
  publish('t\nQ\n' .. ARGV[1] .. '\n' .. ARGV[2] .. '\n' .. ARGV[6] .. '\n' .. ARGV[7] .. '\n' .. ARGV[4] .. '\n' .. ARGV[5])
end
return 1
";

/// ARGV: transition id, member id, encoded ballot. Returns 1 if recorded, 0 if `id` is not
/// pending. Publishes `b` only for a ballot that may decide the transition: a no, or one that
/// brings the ballots up to the number of live members (only the proposer acts on ballots,
/// and it needs a read only then).
const VOTE: &str = r"
if redis.call('HGET', transition, 'id') ~= ARGV[1] then
  return 0
end
redis.call('HSET', ballots, ARGV[2], ARGV[3])
touch()
if ARGV[3] ~= 'y' or redis.call('HLEN', ballots) >= redis.call('ZCARD', members) then
  publish('b')
end
return 1
";

/// ARGV: transition id, `1` to commit (else `0`), then the member ids whose yes the proposer
/// attests (received directly). Returns 1 if finished (and publishes `t`), 0 if `id` is not
/// pending or (commit) a live member has neither a yes ballot nor an attested yes, -1 (nothing
/// written) if the pending transition lacks its next epoch or stack.
const FINISH: &str = r"
local t = redis.call('HMGET', transition, 'id', 'from_epoch', 'next_epoch', 'stack')
if t[1] ~= ARGV[1] then
  return 0
end
if not t[2] or not t[3] or not t[4] then
  return -1
end
if ARGV[2] == '1' then
  local attested = {}
  for i = 3, #ARGV do
    attested[ARGV[i]] = true
  end
  for _, m in ipairs(redis.call('ZRANGE', members, 0, -1)) do
    if not attested[m] and redis.call('HGET', ballots, m) ~= 'y' then
      return 0
    end
  end
end
if ARGV[2] == '1' and redis.call('HGET', meta, 'epoch') == t[2] then
  redis.call('HSET', meta, 'epoch', t[3], 'stack', t[4])
end
redis.call('HSET', meta, 'outcome_id', ARGV[1], 'outcome_committed', ARGV[2])
redis.call('DEL', transition, ballots)
touch()
local after = redis.call('HMGET', meta, 'epoch', 'stack')
if after[1] and after[2] then
  publish('t\nF\n' .. ARGV[1] .. '\n' .. ARGV[2] .. '\n' .. after[1] .. '\n' .. after[2])
else
  publish('t')
end
return 1
";

/// The operations' scripts (each is `PRELUDE` followed by the operation).
struct Scripts {
    join: Script,
    renew: Script,
    leave: Script,
    snapshot: Script,
    propose: Script,
    vote: Script,
    finish: Script,
}

impl Scripts {
    fn new() -> Scripts {
        let s = |body: &str| Script::new(&format!("{PRELUDE}{body}"));
        Scripts {
            join: s(JOIN),
            renew: s(RENEW),
            leave: s(LEAVE),
            snapshot: s(SNAPSHOT),
            propose: s(PROPOSE),
            vote: s(VOTE),
            finish: s(FINISH),
        }
    }
}

struct Inner {
    client: Client,
    config: AsyncConnectionConfig,
    scripts: Scripts,
    conn: tokio::sync::Mutex<Slot>,
}

/// The connection shared by a store's clones.
#[derive(Default)]
struct Slot {
    /// The current connection and its generation (to drop only the connection that failed).
    conn: Option<(u64, MultiplexedConnection)>,
    /// When and how the last attempt to connect failed: callers that were waiting for that
    /// attempt share its error instead of each trying (and timing out) in turn.
    failed: Option<(Instant, String)>,
    generations: u64,
}

/// A rendezvous store in a Redis server (feature `redis`).
///
/// Every operation is one Lua script, so it is atomic. Group `g` lives in the keys
/// `chunnel:{g}:meta` (epoch, stack, outcome), `chunnel:{g}:members` (ids scored by lease
/// expiry), `chunnel:{g}:addrs`, `chunnel:{g}:transition` and `chunnel:{g}:ballots`; u64s are
/// stored as decimal strings. Leases run on the server's clock.
///
/// Clones share one connection. Connecting and each reply are bounded by
/// [`RedisStore::TIMEOUT`]; after a failure the next operation reconnects, so the same value
/// works again once the server is back.
///
/// `no_run`: connecting needs a redis-server (`tests/redis.rs` starts one and runs the same).
///
/// ```no_run
/// # async fn f() -> Result<(), chunnel_rendezvous::Error> {
/// let store = chunnel_rendezvous::RedisStore::connect("redis://127.0.0.1:6379/")
///     .await?
///     .with_grace(std::time::Duration::from_secs(10));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
    /// How long a group's keys outlive its last member, in ms (decimal; the scripts' last
    /// argument).
    grace_ms: String,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The address only: the connection info may hold a password.
        f.debug_struct("RedisStore")
            .field(
                "addr",
                &self.inner.client.get_connection_info().addr().to_string(),
            )
            .finish()
    }
}

fn unavailable(e: impl std::fmt::Display) -> Error {
    Error::unavailable(BACKEND, e)
}

impl RedisStore {
    /// How long connecting, and then each reply, may take before the operation fails with
    /// [`Error::Unavailable`].
    pub const TIMEOUT: Duration = Duration::from_secs(2);

    /// The longest lease stored (about 31 years); longer ones are cut to it.
    pub const MAX_LEASE: Duration = Duration::from_millis(1_000_000_000_000);

    /// How long a group's keys outlive its last member by default (see
    /// [`RedisStore::with_grace`]).
    pub const DEFAULT_GRACE: Duration = Duration::from_secs(60);

    /// The longest pause between two attempts to subscribe to a group's channel again
    /// (the pauses start at 50 ms and double up to this).
    pub const WATCH_BACKOFF: Duration = Duration::from_secs(2);

    /// How often a watch's subscriber pings the server to find a dead connection.
    pub const WATCH_PING: Duration = Duration::from_secs(5);

    /// Keeps a group's keys for `grace` after its last member's lease ran out (or after it
    /// left), instead of [`Self::DEFAULT_GRACE`] (at most [`Self::MAX_LEASE`]): see "Growth"
    /// in the module docs.
    pub fn with_grace(mut self, grace: Duration) -> RedisStore {
        self.grace_ms = lease_ms(grace);
        self
    }

    /// Connects to the server at `url` (`redis://[:password@]host:port/[db]`, see the `redis`
    /// crate) and checks that it answers.
    pub async fn connect(url: &str) -> Result<RedisStore, Error> {
        let client = Client::open(url).map_err(|e| unavailable(format!("bad url: {e}")))?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Self::TIMEOUT))
            .set_response_timeout(Some(Self::TIMEOUT));
        let store = RedisStore {
            inner: Arc::new(Inner {
                client,
                config,
                scripts: Scripts::new(),
                conn: tokio::sync::Mutex::new(Slot::default()),
            }),
            grace_ms: lease_ms(Self::DEFAULT_GRACE),
        };
        store.connection().await?;
        Ok(store)
    }

    /// The current connection, connecting first if there is none.
    async fn connection(&self) -> Result<(u64, MultiplexedConnection), Error> {
        let asked = Instant::now();
        let mut slot = self.inner.conn.lock().await;
        if let Some((generation, conn)) = &slot.conn {
            return Ok((*generation, conn.clone()));
        }
        if let Some((at, error)) = &slot.failed
            && *at >= asked
        {
            return Err(unavailable(error));
        }
        match self
            .inner
            .client
            .get_multiplexed_async_connection_with_config(&self.inner.config)
            .await
        {
            Ok(conn) => {
                slot.generations += 1;
                slot.conn = Some((slot.generations, conn.clone()));
                slot.failed = None;
                Ok((slot.generations, conn))
            }
            Err(e) => {
                let e = e.to_string();
                slot.failed = Some((Instant::now(), e.clone()));
                Err(unavailable(e))
            }
        }
    }

    /// Forgets connection `generation` after it failed (unless it was already replaced).
    async fn drop_connection(&self, generation: u64) {
        let mut slot = self.inner.conn.lock().await;
        if slot.conn.as_ref().is_some_and(|(g, _)| *g == generation) {
            slot.conn = None;
        }
    }

    /// Runs `script` on `group`'s keys with `args`.
    async fn run(&self, script: &Script, group: &str, args: &[&[u8]]) -> Result<Value, Error> {
        let (generation, mut conn) = self.connection().await?;
        let mut call = script.prepare_invoke();
        for key in keys(group) {
            call.key(key);
        }
        for arg in args {
            call.arg(*arg);
        }
        call.arg(self.grace_ms.as_bytes());
        match call.invoke_async::<Value>(&mut conn).await {
            Ok(v) => Ok(v),
            Err(e) => {
                if broken(&e) {
                    tracing::debug!(error = %e, "redis connection failed; reconnecting next time");
                    self.drop_connection(generation).await;
                }
                Err(unavailable(e))
            }
        }
    }

    /// Runs a script that answers 1 (done) or 0 (nothing written).
    async fn run_flag(&self, script: &Script, group: &str, args: &[&[u8]]) -> Result<bool, Error> {
        match self.run(script, group, args).await? {
            Value::Int(1) => Ok(true),
            Value::Int(0) => Ok(false),
            _ => Err(Error::Corrupt("unexpected reply from a redis script")),
        }
    }
}

/// Whether the connection that gave `e` must be replaced.
fn broken(e: &RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_unrecoverable_error()
}

/// The channel group `group`'s scripts publish on (what `PRELUDE` derives from `meta`).
fn channel(group: &str) -> String {
    format!("chunnel:{{{}}}:changed", tag(group))
}

/// What a message on a group's channel says changed: a letter per kind; anything else (an
/// empty or unknown message) counts as everything. The kinds may be followed by `\n` and
/// [`News`] (see "Notifications" in the module docs); news that does not parse is ignored
/// (the kinds alone make the participant read the record).
fn message(payload: &[u8]) -> (Changes, Option<News>) {
    match payload.iter().position(|&b| b == b'\n') {
        Some(at) => (changes(&payload[..at]), news(&payload[at + 1..])),
        None => (changes(payload), None),
    }
}

/// Parses the news part of a channel message: `P\n<id>\n<from epoch>\n<deadline ms>\n
/// <proposer>\n<stack>` or `F\n<id>\n<1|0>\n<epoch>\n<stack>` (the stack is the rest, any
/// bytes).
fn news(data: &[u8]) -> Option<News> {
    let with_box = data.starts_with(b"Q\n");
    let mut parts = data.splitn(if with_box { 7 } else { 6 }, |&b| b == b'\n');
    let what = parts.next()?;
    let num = |p: Option<&[u8]>| number(p?, "").ok();
    match what {
        b"P" | b"Q" => {
            let (id, from_epoch, deadline_ms) =
                (num(parts.next())?, num(parts.next())?, num(parts.next())?);
            let ballot_box = if with_box {
                let bb = std::str::from_utf8(parts.next()?).ok()?;
                Some(BallotBox::decode(bb).ok()?)
            } else {
                None
            };
            let proposer = String::from_utf8(parts.next()?.to_vec()).ok()?;
            let stack = Bytes::copy_from_slice(parts.next()?);
            Some(News::Proposed(Transition {
                id,
                from_epoch,
                proposer,
                stack,
                deadline_ms,
                ballot_box,
            }))
        }
        b"F" => {
            let id = num(parts.next())?;
            let committed = match parts.next()? {
                b"1" => true,
                b"0" => false,
                _ => return None,
            };
            let epoch = num(parts.next())?;
            // The stack is the rest: it may hold `\n`s.
            let rest: Vec<&[u8]> = parts.collect();
            let stack = Bytes::from(rest.join(&b'\n'));
            if rest.is_empty() {
                return None;
            }
            Some(News::Finished {
                outcome: Outcome { id, committed },
                committed: Committed { epoch, stack },
            })
        }
        _ => None,
    }
}

fn changes(payload: &[u8]) -> Changes {
    let mut out = Changes::NONE;
    for b in payload {
        out |= match b {
            b'm' => Changes::MEMBERS,
            b't' => Changes::TRANSITION,
            b'b' => Changes::BALLOTS,
            _ => return Changes::ALL,
        };
    }
    if out.is_empty() { Changes::ALL } else { out }
}

/// The next message of a subscription; `None` once its connection is gone.
async fn next_message(stream: &mut ::redis::aio::PubSubStream) -> Option<Msg> {
    std::future::poll_fn(|cx| futures_core::Stream::poll_next(Pin::new(&mut *stream), cx)).await
}

/// Feeds a watch from the group's channel: subscribes (on a connection of its own), notifies
/// every message, pings the server every [`RedisStore::WATCH_PING`]; after a failure it
/// subscribes again with a bounded backoff. Complete only while subscribed. Ends when the
/// watch is dropped (which also aborts it).
async fn feed_watch(client: Client, channel: String, notifier: Notifier) {
    const FIRST_BACKOFF: Duration = Duration::from_millis(50);
    let mut backoff = FIRST_BACKOFF;
    while !notifier.is_closed() {
        let subscribed = tokio::time::timeout(RedisStore::TIMEOUT, async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, RedisError>(pubsub)
        })
        .await;
        match subscribed {
            Ok(Ok(pubsub)) => {
                backoff = FIRST_BACKOFF;
                let (mut sink, mut stream) = pubsub.split();
                notifier.set_complete(true);
                let mut ping = tokio::time::interval(RedisStore::WATCH_PING);
                ping.tick().await;
                let why = loop {
                    tokio::select! {
                        msg = next_message(&mut stream) => match msg {
                            Some(m) => match message(m.get_payload_bytes()) {
                                (kinds, Some(news)) => notifier.notify_news(kinds, news),
                                (kinds, None) => notifier.notify(kinds),
                            },
                            None => break "the connection closed".to_owned(),
                        },
                        _ = ping.tick() => {
                            let pong = tokio::time::timeout(RedisStore::TIMEOUT, sink.ping::<Value>());
                            match pong.await {
                                Ok(Ok(_)) => {}
                                Ok(Err(e)) => break format!("ping failed: {e}"),
                                Err(_) => break "no answer to a ping".to_owned(),
                            }
                        }
                    }
                };
                notifier.set_complete(false);
                tracing::debug!(%channel, %why, "redis notifications down; subscribing again");
            }
            Ok(Err(e)) => {
                tracing::debug!(%channel, error = %e, "subscribing to redis notifications failed");
            }
            Err(_) => {
                tracing::debug!(%channel, "subscribing to redis notifications timed out");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RedisStore::WATCH_BACKOFF);
    }
}

/// Escapes the group name for the hash tag: no braces in it, injective.
fn tag(group: &str) -> String {
    let mut out = String::with_capacity(group.len());
    for c in group.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
    out
}

/// The group's keys, in the order the scripts bind them.
fn keys(group: &str) -> [String; 5] {
    let t = tag(group);
    ["meta", "members", "addrs", "transition", "ballots"].map(|k| format!("chunnel:{{{t}}}:{k}"))
}

fn lease_ms(lease: Duration) -> String {
    lease.min(RedisStore::MAX_LEASE).as_millis().to_string()
}

fn flag(b: bool) -> &'static [u8] {
    if b { b"1" } else { b"0" }
}

// --- Reading replies: anything unexpected is `Error::Corrupt`, never a panic. ---

fn array(v: Value) -> Result<Vec<Value>, Error> {
    match v {
        Value::Array(items) | Value::Set(items) => Ok(items),
        Value::Nil => Ok(Vec::new()),
        _ => Err(Error::Corrupt(
            "a redis script returned a non-array where one was due",
        )),
    }
}

fn blob(v: Value) -> Result<Vec<u8>, Error> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.into_bytes()),
        _ => Err(Error::Corrupt(
            "a redis script returned a non-string where one was due",
        )),
    }
}

fn text(v: Value, what: &'static str) -> Result<String, Error> {
    String::from_utf8(blob(v)?).map_err(|_| Error::Corrupt(what))
}

/// A flat `HGETALL` reply (field, value, field, value, …) as a map.
fn hash(v: Value) -> Result<HashMap<Vec<u8>, Vec<u8>>, Error> {
    let items = match v {
        // RESP3 would answer a map.
        Value::Map(pairs) => {
            return pairs
                .into_iter()
                .map(|(k, v)| Ok((blob(k)?, blob(v)?)))
                .collect();
        }
        v => array(v)?,
    };
    if items.len() % 2 != 0 {
        return Err(Error::Corrupt("a redis hash reply has an odd length"));
    }
    let mut map = HashMap::with_capacity(items.len() / 2);
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        map.insert(blob(k)?, blob(v)?);
    }
    Ok(map)
}

fn field(
    map: &mut HashMap<Vec<u8>, Vec<u8>>,
    name: &str,
    what: &'static str,
) -> Result<Vec<u8>, Error> {
    map.remove(name.as_bytes()).ok_or(Error::Corrupt(what))
}

fn number(bytes: &[u8], what: &'static str) -> Result<u64, Error> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(Error::Corrupt(what))
}

/// Parses the reply of `read()` in the scripts.
fn parse_snapshot(v: Value) -> Result<Snapshot, Error> {
    let mut parts = array(v)?.into_iter();
    let (Some(meta), Some(ids), Some(addrs), Some(transition), Some(ballots), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return Err(Error::Corrupt("a redis snapshot reply has the wrong shape"));
    };
    let mut snap = Snapshot::default();

    let mut meta = hash(meta)?;
    if !meta.is_empty() {
        let epoch = field(&mut meta, "epoch", "a redis group record has no epoch")?;
        let stack = field(&mut meta, "stack", "a redis group record has no stack")?;
        snap.committed = Some(Committed {
            epoch: number(&epoch, "a redis group epoch is not a u64")?,
            stack: Bytes::from(stack),
        });
        if let (Some(id), Some(committed)) = (
            meta.remove(&b"outcome_id"[..]),
            meta.remove(&b"outcome_committed"[..]),
        ) {
            snap.outcome = Some(Outcome {
                id: number(&id, "a redis outcome id is not a u64")?,
                committed: match &committed[..] {
                    b"1" => true,
                    b"0" => false,
                    _ => return Err(Error::Corrupt("a redis outcome is neither 1 nor 0")),
                },
            });
        }
    }

    let mut addrs = hash(addrs)?;
    for id in array(ids)? {
        let id = text(id, "a redis member id is not UTF-8")?;
        let addr = addrs
            .remove(id.as_bytes())
            .ok_or(Error::Corrupt("a redis member has no address"))?;
        let addr = String::from_utf8(addr)
            .map_err(|_| Error::Corrupt("a redis member address is not UTF-8"))?;
        snap.members.push(Member { id, addr });
    }
    snap.members.sort_by(|a, b| a.id.cmp(&b.id));

    let mut t = hash(transition)?;
    if !t.is_empty() {
        let proposer = field(&mut t, "proposer", "a redis transition has no proposer")?;
        snap.transition = Some(Transition {
            id: number(
                &field(&mut t, "id", "a redis transition has no id")?,
                "a redis transition id is not a u64",
            )?,
            from_epoch: number(
                &field(&mut t, "from_epoch", "a redis transition has no from_epoch")?,
                "a redis transition epoch is not a u64",
            )?,
            proposer: String::from_utf8(proposer)
                .map_err(|_| Error::Corrupt("a redis transition proposer is not UTF-8"))?,
            stack: Bytes::from(field(&mut t, "stack", "a redis transition has no stack")?),
            deadline_ms: number(
                &field(&mut t, "deadline_ms", "a redis transition has no deadline")?,
                "a redis transition deadline is not a u64",
            )?,
            ballot_box: t
                .remove(&b"ballot_box"[..])
                .map(|b| {
                    std::str::from_utf8(&b)
                        .map_err(|_| Error::Corrupt("a redis ballot box is not UTF-8"))
                        .and_then(BallotBox::decode)
                })
                .transpose()?,
        });
    }

    for (member, ballot) in hash(ballots)? {
        let member = String::from_utf8(member)
            .map_err(|_| Error::Corrupt("a redis ballot's member id is not UTF-8"))?;
        let ballot = std::str::from_utf8(&ballot)
            .map_err(|_| Error::Corrupt("a redis ballot is not UTF-8"))?;
        snap.ballots.push((member, Ballot::decode(ballot)?));
    }
    snap.ballots.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(snap)
}

impl Store for RedisStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn join_creating_at(
        &self,
        group: &str,
        member: &Member,
        propose: Option<&Bytes>,
        expect_epoch: Option<u64>,
        create_epoch: u64,
        lease: Duration,
    ) -> Result<JoinReply, Error> {
        check_name("group name", group)?;
        check_name("member id", &member.id)?;
        let lease = lease_ms(lease);
        let expect = expect_epoch.map(|e| e.to_string()).unwrap_or_default();
        let create = create_epoch.max(1).to_string();
        let args: [&[u8]; 8] = [
            member.id.as_bytes(),
            member.addr.as_bytes(),
            lease.as_bytes(),
            flag(propose.is_some()),
            propose.map_or(&b""[..], |s| &s[..]),
            flag(expect_epoch.is_some()),
            expect.as_bytes(),
            create.as_bytes(),
        ];
        let reply = self.run(&self.inner.scripts.join, group, &args).await?;
        let mut parts = array(reply)?.into_iter();
        let (Some(what), Some(snap), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(Error::Corrupt("a redis join reply has the wrong shape"));
        };
        let snap = parse_snapshot(snap)?;
        match &blob(what)?[..] {
            b"created" => Ok(JoinReply::Created(snap)),
            b"joined" => Ok(JoinReply::Joined(snap)),
            b"current" => Ok(JoinReply::Current(snap)),
            _ => Err(Error::Corrupt("a redis join reply has an unknown outcome")),
        }
    }

    async fn renew(&self, group: &str, member_id: &str, lease: Duration) -> Result<bool, Error> {
        check_name("group name", group)?;
        check_name("member id", member_id)?;
        let lease = lease_ms(lease);
        self.run_flag(
            &self.inner.scripts.renew,
            group,
            &[member_id.as_bytes(), lease.as_bytes()],
        )
        .await
    }

    async fn leave(&self, group: &str, member_id: &str) -> Result<(), Error> {
        check_name("group name", group)?;
        check_name("member id", member_id)?;
        self.run_flag(&self.inner.scripts.leave, group, &[member_id.as_bytes()])
            .await
            .map(drop)
    }

    async fn snapshot(&self, group: &str) -> Result<Snapshot, Error> {
        check_name("group name", group)?;
        parse_snapshot(self.run(&self.inner.scripts.snapshot, group, &[]).await?)
    }

    async fn propose(&self, group: &str, t: &Transition) -> Result<bool, Error> {
        check_name("group name", group)?;
        check_name("member id", &t.proposer)?;
        // The epoch a commit installs, computed here so the script never does arithmetic on a
        // u64. No group reaches u64::MAX epochs; one claiming to cannot move on.
        let Some(next_epoch) = t.from_epoch.checked_add(1) else {
            return Ok(false);
        };
        let (id, from, next, deadline) = (
            t.id.to_string(),
            t.from_epoch.to_string(),
            next_epoch.to_string(),
            t.deadline_ms.to_string(),
        );
        let ballot_box = t.ballot_box.map(|b| b.encode()).unwrap_or_default();
        self.run_flag(
            &self.inner.scripts.propose,
            group,
            &[
                id.as_bytes(),
                from.as_bytes(),
                next.as_bytes(),
                t.proposer.as_bytes(),
                &t.stack[..],
                deadline.as_bytes(),
                ballot_box.as_bytes(),
            ],
        )
        .await
    }

    async fn vote(
        &self,
        group: &str,
        id: u64,
        member_id: &str,
        ballot: &Ballot,
    ) -> Result<bool, Error> {
        check_name("group name", group)?;
        check_name("member id", member_id)?;
        let (id, ballot) = (id.to_string(), ballot.encode());
        self.run_flag(
            &self.inner.scripts.vote,
            group,
            &[id.as_bytes(), member_id.as_bytes(), ballot.as_bytes()],
        )
        .await
    }

    async fn finish_attested(
        &self,
        group: &str,
        id: u64,
        commit: bool,
        attested: &[String],
    ) -> Result<bool, Error> {
        check_name("group name", group)?;
        let id = id.to_string();
        let mut args: Vec<&[u8]> = vec![id.as_bytes(), flag(commit)];
        args.extend(attested.iter().map(String::as_bytes));
        match self.run(&self.inner.scripts.finish, group, &args).await? {
            Value::Int(1) => Ok(true),
            Value::Int(0) => Ok(false),
            Value::Int(-1) => Err(Error::Corrupt(
                "a redis transition lacks its from_epoch, next_epoch or stack",
            )),
            _ => Err(Error::Corrupt("unexpected reply from a redis script")),
        }
    }

    /// Subscribes to the group's channel (see "Notifications" in the module docs).
    fn watch(&self, group: &str) -> Option<Watch> {
        let (watch, notifier) = Watch::new();
        let task = tokio::spawn(feed_watch(
            self.inner.client.clone(),
            channel(group),
            notifier,
        ));
        Some(watch.with_task(task))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_messages_name_kinds_and_unknown_ones_mean_all() {
        assert_eq!(channel("a}b"), "chunnel:{a%7Db}:changed");
        // What PRELUDE derives from the meta key.
        let meta = &keys("a}b")[0];
        assert_eq!(
            format!("{}changed", &meta[..meta.len() - 4]),
            channel("a}b")
        );
        assert_eq!(changes(b"m"), Changes::MEMBERS);
        assert_eq!(changes(b"mt"), Changes::MEMBERS | Changes::TRANSITION);
        assert_eq!(changes(b"b"), Changes::BALLOTS);
        assert_eq!(changes(b""), Changes::ALL);
        assert_eq!(changes(b"m\xff"), Changes::ALL);
    }

    #[test]
    fn messages_carry_news_and_bad_news_is_dropped() {
        let (kinds, news) = message(b"t\nP\n7\n3\n99\nthe proposer\nst\nack");
        assert_eq!(kinds, Changes::TRANSITION);
        assert_eq!(
            news,
            Some(News::Proposed(Transition {
                id: 7,
                from_epoch: 3,
                proposer: "the proposer".into(),
                stack: Bytes::from_static(b"st\nack"),
                deadline_ms: 99,
                ballot_box: None,
            }))
        );
        let (kinds, news) = message(b"t\nF\n7\n1\n4\n\n\xff");
        assert_eq!(kinds, Changes::TRANSITION);
        assert_eq!(
            news,
            Some(News::Finished {
                outcome: Outcome {
                    id: 7,
                    committed: true
                },
                committed: Committed {
                    epoch: 4,
                    stack: Bytes::from_static(b"\n\xff"),
                },
            })
        );
        for bad in [
            &b"t\nP\n7\n3\n99\nno stack"[..],
            b"t\nF\n7\n2\n4\nx",
            b"t\nF\n-1\n1\n4\nx",
            b"t\nF\n7\n1\n4",
            b"t\nQ\n",
            b"t\n",
        ] {
            assert_eq!(message(bad), (Changes::TRANSITION, None), "{bad:?}");
        }
        assert_eq!(
            message(b"mt"),
            (Changes::MEMBERS | Changes::TRANSITION, None)
        );
    }

    #[test]
    fn keys_share_one_escaped_tag() {
        assert_eq!(keys("g")[0], "chunnel:{g}:meta");
        assert_eq!(keys("a}b{c%")[4], "chunnel:{a%7Db%7Bc%25}:ballots");
        assert_ne!(tag("%7B"), tag("{"));
    }

    #[test]
    fn unexpected_replies_are_corrupt_not_panics() {
        assert!(matches!(
            parse_snapshot(Value::Int(3)),
            Err(Error::Corrupt(_))
        ));
        let meta = Value::Array(vec![
            Value::BulkString(b"epoch".to_vec()),
            Value::BulkString(b"1.5".to_vec()),
            Value::BulkString(b"stack".to_vec()),
            Value::BulkString(vec![0, 255]),
        ]);
        let empty = || Value::Array(Vec::new());
        let reply = Value::Array(vec![meta, empty(), empty(), empty(), empty()]);
        assert!(matches!(parse_snapshot(reply), Err(Error::Corrupt(_))));
        let odd = Value::Array(vec![Value::BulkString(b"epoch".to_vec())]);
        let reply = Value::Array(vec![odd, empty(), empty(), empty(), empty()]);
        assert!(matches!(parse_snapshot(reply), Err(Error::Corrupt(_))));
    }
}
