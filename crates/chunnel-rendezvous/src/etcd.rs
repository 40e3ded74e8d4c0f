//! The etcd v3 backend: a group record in a handful of keys, every operation one etcd `Txn`.
//!
//! # Key layout
//!
//! For a group `g` (names and member ids contain no `/`, see [`check_name`], so the prefixes
//! below never overlap between groups):
//!
//! | key                        | value                                                   |
//! |----------------------------|---------------------------------------------------------|
//! | `chunnel/<g>/meta`         | committed epoch, stack and last outcome (binary, below); on the **group lease** |
//! | `chunnel/<g>/transition`   | the pending transition (binary, below); on the group lease |
//! | `chunnel/<g>/members/<id>` | the member's address (UTF-8), attached to its **member lease** |
//! | `chunnel/<g>/ballots/<id>` | `<transition id, 16 hex digits>:<Ballot::encode>`; on the voter's member lease |
//!
//! `meta` is `[1] ++ epoch (u64 BE) ++ outcome tag (0 none, 1 aborted, 2 committed) ++
//! outcome id (u64 BE) ++ stack`; `transition` is `[1] ++ id ++ from_epoch ++ deadline_ms
//! (u64 BE each) ++ proposer length (u16 BE) ++ proposer ++ stack`. The leading byte is a
//! format version; anything unreadable is [`Error::Corrupt`].
//!
//! # Leases
//!
//! Every member key is attached to an etcd lease of its own, granted with the requested lease
//! rounded up to whole seconds (etcd leases have a one-second granularity, and etcd may raise a
//! very short TTL to its minimum, about 2 s with default election settings). When the lease
//! runs out, etcd deletes the key, so a snapshot never needs to filter expired members.
//! [`Store::renew`] sends a keep-alive on the lease the member key is attached to (read from the
//! key itself, so it works from any process, not only the one that joined); if the caller asks
//! for a different duration than the lease was granted with, the key is moved to a fresh lease
//! instead. [`Store::leave`] deletes the key and revokes its lease.
//!
//! The group's record (`meta`, and `transition` while one is pending) is attached to a **group
//! lease** granted for the member lease plus the grace period ([`EtcdStore::with_grace`],
//! default [`EtcdStore::DEFAULT_GRACE`]), each rounded up to whole seconds. Every `renew`
//! also sends a keep-alive on it, and `join` makes sure it is at least that long (moving the
//! record to a longer lease, by compare-and-swap, when a member asks for a longer lease than
//! the group's creator did). So the record outlives every member by at least the grace
//! period, and when nobody has joined or renewed for lease + grace etcd deletes it with its
//! lease. A ballot is attached to its voter's member lease, so it goes with the voter.
//!
//! # Growth
//!
//! Nothing in the store outlives its use: a group none of whose members joined or renewed for
//! lease + grace (each rounded up to whole seconds) holds no key and no lease; etcd deletes
//! them itself, no client needs to be alive. A live group holds `meta`, one key per live
//! member (and, for a member that crashed, until its lease runs out), and, while a
//! transition is pending, `transition` and one ballot per voter; leases: one per member key
//! and one for the group. (etcd revokes expired leases at a bounded rate, 1,000 a second in
//! 3.4, so a mass expiry takes that long to show; and its history of old revisions is
//! compacted by its own settings, not by this store.)
//!
//! # Atomicity
//!
//! etcd has no server-side scripts, so every operation that reads and then writes is an
//! optimistic compare-and-swap: it reads the keys its decision depends on in one `Txn` (one
//! revision), decides, and writes in a second `Txn` whose compares require the `mod_revision`
//! of each key it read to be unchanged (0 for a key that was absent, which etcd compares as 0).
//! If another client wrote one of them in between, the compare fails, nothing is written, and
//! the operation starts over (at most [`EtcdStore::MAX_ATTEMPTS`] times, with a small random
//! pause, then [`Error::Contended`]). So each operation takes effect at its writing `Txn` as if
//! it had run alone: two racing proposers can never both create a group, and a transition can
//! never be finished twice. Operations that only write (`leave`) are one unconditional `Txn`;
//! [`Store::snapshot`] is one `Txn` of four range reads, so it sees a single revision.
//! `join` also reads the group back inside its writing `Txn` (range operations after the puts
//! see them), so the snapshot it returns is the state right after its own write.
//!
//! Per operation (R = read, W = written, C = compared in the writing `Txn`):
//!
//! * `join`: R the whole group; W `meta` (when creating) and `members/<id>`; C `meta` and
//!   `members/<id>` (the latter so the lease it replaces, revoked afterwards, is the one read);
//! * `propose`: R `meta`, `transition`; W `transition`, deletes `ballots/*`; C both;
//! * `vote`: R `transition`; W `ballots/<id>`; C `transition` (a vote racing with `finish`
//!   either lands before it, and is deleted with the other ballots, or fails its compare);
//! * `finish`: R `meta`, `transition`; W `meta`, deletes `transition` and `ballots/*`; C both;
//! * `renew`, when moving a member to a new lease: C `members/<id>`.
//!
//! Leases are not part of `Txn`s: `join` grants the member's lease (and, when it creates the
//! group, the group lease) before its writing `Txn` (and revokes them if the keys were not
//! written with them), and `renew` re-checks that the key is still attached to the lease it
//! kept alive.
//!
//! # Failures
//!
//! The store keeps one connection per endpoint and sends every request to one member, the
//! *pinned* one, until that member fails a request (cannot be connected to, has no leader,
//! times out, drops the connection); then the next endpoint is pinned. A request the failing
//! member certainly did not apply (the connection could not be made, or etcd refused it for
//! want of a leader), and any read, is sent again at once to the next member; a write that may
//! have been applied is never repeated by the store: its error is returned (the caller cannot
//! know whether it took effect, as with any remote store). So the store keeps working while a
//! minority of the members is down or cut off. (The client library's own balancing over all
//! endpoints keeps sending a share of the requests to a dead member, and each of them fails.)
//!
//! Every request has a connect timeout and a request timeout ([`EtcdStore::CONNECT_TIMEOUT`],
//! [`EtcdStore::REQUEST_TIMEOUT`]) and a bound of 5 s in all, retries included, so a dead
//! cluster gives [`Error::Unavailable`] instead of hanging.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, GetResponse, KeyValue,
    LeaseGrantResponse, LeaseRevokeResponse, LeaseTimeToLiveOptions, LeaseTimeToLiveResponse,
    PutOptions, ResponseHeader, StatusResponse, Txn, TxnOp, TxnOpResponse, TxnResponse,
};

use crate::Error;
use crate::store::{
    Ballot, Committed, JoinReply, Member, Outcome, Snapshot, Store, Transition, check_name,
};

const BACKEND: &str = "etcd";

/// The longest lease etcd grants (its `MaxLeaseTTL`, in seconds).
const MAX_TTL_SECS: i64 = 9_000_000_000;

/// A rendezvous store in an etcd v3 cluster (feature `etcd`; tested with etcd 3.4).
///
/// A group `g` lives under the keys `chunnel/<g>/meta` (committed epoch and stack, last
/// outcome), `chunnel/<g>/transition`, `chunnel/<g>/members/<id>` (the member's address, under
/// an etcd lease of its own) and `chunnel/<g>/ballots/<id>`. Every operation takes effect in
/// one etcd `Txn`: a compare-and-swap on the keys it read, retried when the group changed
/// between its read and its write.
///
/// Cheap to clone (clones share the connections).
///
/// `no_run`: the store talks to an etcd cluster (`tests/etcd.rs` starts one and runs the
/// same).
///
/// ```no_run
/// # async fn f() -> Result<(), chunnel_rendezvous::Error> {
/// let endpoints = vec!["http://10.0.0.1:2379".to_owned(), "http://10.0.0.2:2379".to_owned()];
/// let store = chunnel_rendezvous::EtcdStore::connect(&endpoints)
///     .await?
///     .with_grace(std::time::Duration::from_secs(10));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct EtcdStore {
    /// One client per endpoint, in the order of `endpoints`.
    clients: Arc<[Client]>,
    endpoints: Arc<[String]>,
    /// The index of the member requests go to, until it fails.
    pinned: Arc<AtomicUsize>,
    /// The smallest TTL etcd has granted so far when asked for less (its minimum lease TTL),
    /// 0 until seen: `renew` compares a lease's TTL with what a fresh grant would give.
    min_ttl: Arc<AtomicI64>,
    /// The id of the cluster the endpoints belong to, from the first answer (0 until one);
    /// every later answer must carry the same one.
    cluster: Arc<AtomicU64>,
    /// How long a group outlives its members, in whole seconds (see [`EtcdStore::with_grace`]).
    grace_secs: i64,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.endpoints)
            .field("pinned", &self.pinned.load(Ordering::Relaxed))
            .field("cluster", &self.cluster_id())
            .field("grace_secs", &self.grace_secs)
            .finish()
    }
}

impl EtcdStore {
    /// How long establishing a connection to one member may take.
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
    /// How long one request may take once sent.
    pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
    /// How many times an operation retries its compare-and-swap when the group changed under
    /// it, before failing with [`Error::Contended`].
    pub const MAX_ATTEMPTS: u32 = 64;

    /// An upper bound on any one request, all its routings included, whatever the client
    /// library does (it may wait for a connection, then for the answer).
    const DEADLINE: Duration = Duration::from_secs(5);

    /// How long a group record outlives its last member by default (see
    /// [`EtcdStore::with_grace`]).
    pub const DEFAULT_GRACE: Duration = Duration::from_secs(60);

    /// Creates a client for the cluster at `endpoints` (`http://host:port`; several members
    /// for fault tolerance), and asks every endpoint which cluster it belongs to (all at once,
    /// within [`Self::CONNECT_TIMEOUT`]).
    ///
    /// Fails with [`Error::WrongCluster`] if two endpoints answer for different clusters. An
    /// endpoint that does not answer is skipped (the cluster id is then learnt from the first
    /// answer of any later request); an unreachable cluster shows as [`Error::Unavailable`]
    /// from the first operation. From then on, an answer from another cluster (an endpoint
    /// now served by a different etcd, e.g. a stale one on a reused address) fails its request
    /// with [`Error::WrongCluster`] instead of being believed.
    pub async fn connect(endpoints: &[String]) -> Result<EtcdStore, Error> {
        if endpoints.is_empty() {
            return Err(Error::unavailable(BACKEND, "no endpoints given"));
        }
        // A member cut off from the others answers "no leader" at once instead of letting the
        // request wait for an election.
        let options = ConnectOptions::new()
            .with_connect_timeout(Self::CONNECT_TIMEOUT)
            .with_timeout(Self::REQUEST_TIMEOUT)
            .with_require_leader(true);
        let mut clients = Vec::with_capacity(endpoints.len());
        for e in endpoints {
            let connect = Client::connect([e], Some(options.clone()));
            match tokio::time::timeout(Self::DEADLINE, connect).await {
                Ok(Ok(c)) => clients.push(c),
                Ok(Err(err)) => return Err(Error::unavailable(BACKEND, format!("{e}: {err}"))),
                Err(_) => return Err(Error::unavailable(BACKEND, format!("{e}: timed out"))),
            }
        }
        // Spread the stores of many processes over the members.
        let first = random() as usize % endpoints.len();
        let store = EtcdStore {
            clients: clients.into(),
            endpoints: endpoints.into(),
            pinned: Arc::new(AtomicUsize::new(first)),
            min_ttl: Arc::new(AtomicI64::new(0)),
            cluster: Arc::new(AtomicU64::new(0)),
            grace_secs: ttl_secs(Self::DEFAULT_GRACE),
        };
        store.learn_cluster().await?;
        Ok(store)
    }

    /// Keeps a group record (its committed stack, epoch and pending transition) for `grace`
    /// after its last member is gone (rounded up to whole seconds), instead of
    /// [`Self::DEFAULT_GRACE`]: see "Growth" in the module docs.
    pub fn with_grace(mut self, grace: Duration) -> EtcdStore {
        self.grace_secs = ttl_secs(grace);
        self
    }

    /// The id of the cluster this store talks to, once an endpoint has answered.
    pub fn cluster_id(&self) -> Option<u64> {
        Some(self.cluster.load(Ordering::Relaxed)).filter(|&id| id != 0)
    }

    /// Asks every endpoint for its status at once (bounded by [`Self::CONNECT_TIMEOUT`]) and
    /// records the cluster id they answer with; two different ids are an error.
    async fn learn_cluster(&self) -> Result<(), Error> {
        let mut probes = tokio::task::JoinSet::new();
        for (i, c) in self.clients.iter().enumerate() {
            let mut c = c.clone();
            probes.spawn(async move {
                let answer = tokio::time::timeout(Self::CONNECT_TIMEOUT, c.status()).await;
                (
                    i,
                    answer
                        .ok()
                        .and_then(Result::ok)
                        .and_then(|s| s.cluster_id()),
                )
            });
        }
        let mut seen: Vec<(usize, u64)> = Vec::new();
        while let Some(probe) = probes.join_next().await {
            if let Ok((i, Some(id))) = probe {
                seen.push((i, id));
            }
        }
        seen.sort_unstable();
        for (i, id) in seen {
            self.check_cluster(i, Some(id))?;
        }
        Ok(())
    }

    /// Checks the cluster id of an answer from endpoint `i` against the one known (learning it
    /// from the first answer).
    fn check_cluster(&self, i: usize, found: Option<u64>) -> Result<(), Error> {
        let Some(found) = found.filter(|&id| id != 0) else {
            return Ok(());
        };
        let expected =
            match self
                .cluster
                .compare_exchange(0, found, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Ok(()),
                Err(known) => known,
            };
        if expected == found {
            return Ok(());
        }
        self.unpin(i);
        Err(Error::WrongCluster {
            endpoint: self.endpoints[i].clone(),
            expected,
            found,
        })
    }

    /// The endpoints this store was created with.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Runs the request `make` builds on the pinned member, within [`Self::DEADLINE`] in all.
    ///
    /// If the member fails it (cannot be connected to, has no leader, times out, drops the
    /// connection), the next member is pinned; and if the request was certainly not applied
    /// (never sent, or refused for want of a leader), or `retry` is [`Retry::Always`], it is
    /// sent again there, visiting each member at most twice. A request that may have been
    /// applied and is not [`Retry::Always`] is never repeated: its error is returned.
    async fn call<T, F, Fut>(&self, retry: Retry, make: F) -> Result<T, Error>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
        T: Headed,
    {
        let deadline = tokio::time::Instant::now() + Self::DEADLINE;
        let n = self.clients.len();
        let mut tries = 0;
        loop {
            tries += 1;
            let i = self.pinned.load(Ordering::Relaxed) % n;
            let err = match tokio::time::timeout_at(deadline, make(self.clients[i].clone())).await {
                Ok(Ok(v)) => {
                    self.check_cluster(i, v.cluster_id())?;
                    return Ok(v);
                }
                Ok(Err(e)) => e,
                Err(_) => {
                    self.unpin(i);
                    return Err(Error::unavailable(
                        BACKEND,
                        format!(
                            "{}: no answer within {:?}",
                            self.endpoints[i],
                            Self::DEADLINE
                        ),
                    ));
                }
            };
            let fault = fault(&err);
            let detail = format!("{}: {err}", self.endpoints[i]);
            if fault == Fault::None {
                return Err(Error::unavailable(BACKEND, detail));
            }
            self.unpin(i);
            if tries >= 2 * n || (fault == Fault::MaybeApplied && retry == Retry::IfNotApplied) {
                return Err(Error::unavailable(BACKEND, detail));
            }
            tracing::debug!(error = %detail, "etcd member failed a request, trying the next one");
        }
    }

    /// Moves requests off member `i` (unless another request already did).
    fn unpin(&self, i: usize) {
        let next = (i + 1) % self.clients.len();
        let _ = self
            .pinned
            .compare_exchange(i, next, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Runs one `Txn` (see [`Self::call`] for `retry`).
    async fn txn(&self, txn: &Txn, retry: Retry) -> Result<TxnResponse, Error> {
        self.call(retry, |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
    }

    /// Reads `keys` in one `Txn` (one revision).
    async fn get_keys<const N: usize>(
        &self,
        keys: [&str; N],
    ) -> Result<[Option<KeyValue>; N], Error> {
        let ops: Vec<TxnOp> = keys.iter().map(|k| TxnOp::get(*k, None)).collect();
        let resp = self.txn(&Txn::new().and_then(ops), Retry::Always).await?;
        let gets = ranges(&resp, 0, N)?;
        let mut out = [const { None }; N];
        for (slot, get) in out.iter_mut().zip(gets) {
            *slot = get.kvs().first().cloned();
        }
        Ok(out)
    }

    /// Reads the whole group record in one `Txn`.
    async fn read(&self, k: &Keys) -> Result<Record, Error> {
        let resp = self
            .txn(&Txn::new().and_then(k.read_ops()), Retry::Always)
            .await?;
        Record::decode(k, &ranges(&resp, 0, READ_OPS)?)
    }

    /// Grants a lease of `ttl` seconds (repeated after any failure: a lease granted twice
    /// only lives out its TTL unused).
    async fn grant(&self, ttl: i64) -> Result<i64, Error> {
        let resp = self
            .call(Retry::Always, |mut c| async move {
                c.lease_grant(ttl, None).await
            })
            .await?;
        if resp.ttl() > ttl {
            // etcd raised it to its minimum TTL.
            self.min_ttl.fetch_max(resp.ttl(), Ordering::Relaxed);
        }
        Ok(resp.id())
    }

    /// The TTL a lease granted for `ttl` seconds gets.
    fn effective_ttl(&self, ttl: i64) -> i64 {
        ttl.max(self.min_ttl.load(Ordering::Relaxed))
    }

    /// Revokes a lease whose keys are gone or that no key uses; failures only cost the lease
    /// living out its TTL, so they are logged, not returned.
    async fn revoke_quietly(&self, id: i64) {
        let res = self
            .call(
                Retry::Always,
                |mut c| async move { c.lease_revoke(id).await },
            )
            .await;
        if let Err(e) = res {
            tracing::debug!(lease = id, error = %e, "could not revoke an unused etcd lease");
        }
    }

    /// Sends one keep-alive for lease `id`, then reads the lease back: `None` if etcd does not
    /// know it (expired or revoked), else its granted TTL and the keys attached to it.
    async fn keep_alive(&self, id: i64) -> Result<Option<(i64, Vec<Vec<u8>>)>, Error> {
        if !self.keep_alive_once(id).await? {
            return Ok(None);
        }
        // The keep-alive answer (with the TTL) is consumed by the library: ask again.
        let resp = self
            .call(Retry::Always, |mut c| async move {
                let keys = LeaseTimeToLiveOptions::new().with_keys();
                c.lease_time_to_live(id, Some(keys)).await
            })
            .await?;
        Ok((resp.ttl() > 0).then(|| (resp.granted_ttl(), resp.keys().to_vec())))
    }

    /// Sends one keep-alive for lease `id`: `false` if etcd does not know it (expired or
    /// revoked).
    async fn keep_alive_once(&self, id: i64) -> Result<bool, Error> {
        // Renewing twice is harmless: repeated after any failure.
        self.call(Retry::Always, |c| async move {
            let mut lease = c.lease_client();
            // The library sends the first keep-alive and reads its answer itself; it fails
            // with `LeaseKeepAliveError` (and nothing else) when etcd answers with TTL 0,
            // i.e. does not know the lease. The stream closes when dropped.
            match lease.keep_alive(id).await {
                Ok(_) => Ok(true),
                Err(etcd_client::Error::LeaseKeepAliveError(_)) => Ok(false),
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// Makes sure the group's record (`meta` and `transition`) lives on a lease of at least
    /// `need` seconds, `lease` being the one `meta` was read with (0: none): keeps it alive
    /// if it is long enough, else moves both keys to a fresh lease of `need` seconds (a
    /// compare-and-swap on both) and revokes the old one, which then holds no key.
    ///
    /// `Ok(true)`: kept alive, nothing written. `Ok(false)`: the record moved (by us or by a
    /// concurrent operation) or is gone: a caller comparing `meta`'s revision must read again.
    async fn ensure_group_lease(&self, k: &Keys, lease: i64, need: i64) -> Result<bool, Error> {
        if lease != 0
            && let Some((granted, _)) = self.keep_alive(lease).await?
            && granted >= self.effective_ttl(need)
        {
            return Ok(true);
        }
        let fresh = self.grant(need).await?;
        let [meta, transition] = self.get_keys([&k.meta, &k.transition]).await?;
        let Some(meta) = meta.filter(|m| m.lease() == lease) else {
            // Gone, or moved by someone else meanwhile.
            self.revoke_quietly(fresh).await;
            return Ok(false);
        };
        let on_fresh = || Some(PutOptions::new().with_lease(fresh));
        let mut ops = vec![TxnOp::put(k.meta.as_str(), meta.value(), on_fresh())];
        if let Some(t) = &transition {
            ops.push(TxnOp::put(k.transition.as_str(), t.value(), on_fresh()));
        }
        let txn = Txn::new()
            .when([
                Compare::mod_revision(k.meta.as_str(), CompareOp::Equal, meta.mod_revision()),
                Compare::mod_revision(
                    k.transition.as_str(),
                    CompareOp::Equal,
                    mod_rev(&transition),
                ),
            ])
            .and_then(ops);
        match self.txn(&txn, Retry::IfNotApplied).await {
            Ok(r) if r.succeeded() => {
                if lease != 0 {
                    self.revoke_quietly(lease).await;
                }
            }
            Ok(_) => self.revoke_quietly(fresh).await,
            Err(e) => {
                self.revoke_quietly(fresh).await;
                return Err(e);
            }
        }
        Ok(false)
    }

    /// The compare-and-swap loop of [`Store::join`]; `granted` is the lease granted for the
    /// member (at most once, reused by every attempt).
    async fn join_attempts(
        &self,
        k: &Keys,
        member: &Member,
        propose: Option<&Bytes>,
        expect_epoch: Option<u64>,
        ttl: i64,
        granted: &mut Granted,
    ) -> Result<JoinReply, Error> {
        let member_key = k.member(&member.id);
        // The group's record outlives every member by the grace period.
        let need = self.effective_ttl(ttl).saturating_add(self.grace_secs);
        for attempt in 0..Self::MAX_ATTEMPTS {
            backoff(attempt).await;
            let rec = self.read(k).await?;
            let create = match (&rec.snap.committed, propose) {
                (None, Some(stack)) => Some(stack),
                (Some(c), _) if Some(c.epoch) == expect_epoch => None,
                _ => return Ok(JoinReply::Current(rec.snap)),
            };
            if create.is_none() && !self.ensure_group_lease(k, rec.meta_lease, need).await? {
                continue;
            }
            let lease = match granted.member {
                Some(id) => id,
                None => *granted.member.insert(self.grant(ttl).await?),
            };
            let (member_rev, old_lease) = rec.member_key(&member.id);
            let mut ops = Vec::with_capacity(2 + READ_OPS);
            if let Some(stack) = create {
                let group_lease = match granted.group {
                    Some(id) => id,
                    None => *granted.group.insert(self.grant(need).await?),
                };
                let meta = Meta {
                    epoch: 1,
                    stack: stack.clone(),
                    outcome: None,
                };
                ops.push(TxnOp::put(
                    k.meta.as_str(),
                    meta.encode(),
                    Some(PutOptions::new().with_lease(group_lease)),
                ));
            }
            ops.push(TxnOp::put(
                member_key.as_str(),
                member.addr.as_str(),
                Some(PutOptions::new().with_lease(lease)),
            ));
            let writes = ops.len();
            ops.extend(k.read_ops());
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(k.meta.as_str(), CompareOp::Equal, rec.meta_rev),
                    Compare::mod_revision(member_key.as_str(), CompareOp::Equal, member_rev),
                ])
                .and_then(ops);
            let resp = self.txn(&txn, Retry::IfNotApplied).await?;
            if !resp.succeeded() {
                continue;
            }
            if old_lease != 0 && old_lease != lease {
                // The member re-joined: its key moved to the new lease.
                self.revoke_quietly(old_lease).await;
            }
            let after = Record::decode(k, &ranges(&resp, writes, READ_OPS)?)?;
            return Ok(if create.is_some() {
                JoinReply::Created(after.snap)
            } else {
                JoinReply::Joined(after.snap)
            });
        }
        Err(contended(k))
    }

    /// The loop of [`Store::renew`] for member `id`: keeps its lease alive (moving its key,
    /// and its ballot, to a fresh lease if it asks for another duration), then the group's.
    async fn renew_attempts(&self, k: &Keys, id: &str, ttl: i64) -> Result<bool, Error> {
        let (key, ballot_key) = (k.member(id), k.ballot(id));
        let key = key.as_str();
        let need = self.effective_ttl(ttl).saturating_add(self.grace_secs);
        for attempt in 0..Self::MAX_ATTEMPTS {
            backoff(attempt).await;
            let [Some(kv), meta, ballot] = self.get_keys([key, &k.meta, &ballot_key]).await? else {
                return Ok(false);
            };
            let lease = kv.lease();
            if lease == 0 {
                return Err(Error::Corrupt("a member key is not attached to a lease"));
            }
            match self.keep_alive(lease).await? {
                Some((granted, keys)) if keys.iter().any(|k| k == key.as_bytes()) => {
                    if granted == self.effective_ttl(ttl) {
                        // Renewed, and the key is still on that lease: now the group's.
                        self.renew_group(k, meta.as_ref(), need).await?;
                        return Ok(true);
                    }
                    // Another duration than the lease has: move the key (and the member's
                    // ballot) to a fresh lease, provided they did not change since we read
                    // them.
                    let fresh = self.grant(ttl).await?;
                    let on_fresh = || Some(PutOptions::new().with_lease(fresh));
                    let mut ops = vec![TxnOp::put(key, kv.value(), on_fresh())];
                    if let Some(b) = &ballot {
                        ops.push(TxnOp::put(ballot_key.as_str(), b.value(), on_fresh()));
                    }
                    let txn = Txn::new()
                        .when([
                            Compare::mod_revision(key, CompareOp::Equal, kv.mod_revision()),
                            Compare::mod_revision(
                                ballot_key.as_str(),
                                CompareOp::Equal,
                                mod_rev(&ballot),
                            ),
                        ])
                        .and_then(ops);
                    match self.txn(&txn, Retry::IfNotApplied).await {
                        Ok(r) if r.succeeded() => {
                            self.revoke_quietly(lease).await;
                            if let Some(m) = &meta {
                                // The group must outlive the new lease too.
                                self.ensure_group_lease(k, m.lease(), need).await?;
                            }
                            return Ok(true);
                        }
                        Ok(_) => self.revoke_quietly(fresh).await,
                        Err(e) => {
                            self.revoke_quietly(fresh).await;
                            return Err(e);
                        }
                    }
                }
                _ => {
                    // The lease is gone (the key is being deleted with it) or the key left it
                    // (deleted, or moved to another lease by a concurrent join): look again.
                    match self.get_keys([key]).await? {
                        [Some(now)] if now.lease() != lease => continue,
                        _ => return Ok(false),
                    }
                }
            }
        }
        Err(contended(k))
    }

    /// Keeps the group's record alive after one of its members renewed (`meta` as read; a
    /// record on no lease, or on an unknown one, is moved to a fresh lease of `need` seconds).
    async fn renew_group(&self, k: &Keys, meta: Option<&KeyValue>, need: i64) -> Result<(), Error> {
        let Some(meta) = meta else {
            return Ok(());
        };
        if meta.lease() != 0 && self.keep_alive_once(meta.lease()).await? {
            return Ok(());
        }
        self.ensure_group_lease(k, meta.lease(), need)
            .await
            .map(drop)
    }
}

impl Store for EtcdStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn join(
        &self,
        group: &str,
        member: &Member,
        propose: Option<&Bytes>,
        expect_epoch: Option<u64>,
        lease: Duration,
    ) -> Result<JoinReply, Error> {
        let k = Keys::new(group)?;
        check_name("member id", &member.id)?;
        let mut granted = Granted::default();
        let out = self
            .join_attempts(
                &k,
                member,
                propose,
                expect_epoch,
                ttl_secs(lease),
                &mut granted,
            )
            .await;
        // Leases not attached to the keys (or maybe attached by a `Txn` whose answer was
        // lost: revoking them then removes the half-added member or group, matching the error).
        let unused = match &out {
            Ok(JoinReply::Created(_)) => [None, None],
            Ok(JoinReply::Joined(_)) => [None, granted.group],
            _ => [granted.member, granted.group],
        };
        for id in unused.into_iter().flatten() {
            self.revoke_quietly(id).await;
        }
        out
    }

    async fn renew(&self, group: &str, member_id: &str, lease: Duration) -> Result<bool, Error> {
        let k = Keys::new(group)?;
        check_name("member id", member_id)?;
        self.renew_attempts(&k, member_id, ttl_secs(lease)).await
    }

    async fn leave(&self, group: &str, member_id: &str) -> Result<(), Error> {
        let k = Keys::new(group)?;
        check_name("member id", member_id)?;
        let txn = Txn::new().and_then([
            TxnOp::delete(
                k.member(member_id),
                Some(DeleteOptions::new().with_prev_key()),
            ),
            TxnOp::delete(k.ballot(member_id), None),
        ]);
        // Deleting twice is harmless: repeated after any member failure.
        let resp = self.txn(&txn, Retry::Always).await?;
        // Revoke the member's lease too (it has no other key), so etcd forgets it now.
        for r in resp.op_responses() {
            if let TxnOpResponse::Delete(d) = r {
                for kv in d.prev_kvs().iter().filter(|kv| kv.lease() != 0) {
                    self.revoke_quietly(kv.lease()).await;
                }
            }
        }
        Ok(())
    }

    async fn snapshot(&self, group: &str) -> Result<Snapshot, Error> {
        let k = Keys::new(group)?;
        Ok(self.read(&k).await?.snap)
    }

    async fn propose(&self, group: &str, t: &Transition) -> Result<bool, Error> {
        let k = Keys::new(group)?;
        check_name("member id", &t.proposer)?;
        let record = encode_transition(t);
        for attempt in 0..Self::MAX_ATTEMPTS {
            backoff(attempt).await;
            let [meta, pending] = self.get_keys([&k.meta, &k.transition]).await?;
            if pending.is_some() {
                return Ok(false);
            }
            let epoch = match &meta {
                Some(kv) => Meta::decode(kv.value())?.epoch,
                None => 0,
            };
            if t.from_epoch == 0 || epoch != t.from_epoch {
                return Ok(false);
            }
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(k.meta.as_str(), CompareOp::Equal, mod_rev(&meta)),
                    Compare::mod_revision(k.transition.as_str(), CompareOp::Equal, 0),
                ])
                .and_then([
                    TxnOp::put(
                        k.transition.as_str(),
                        record.clone(),
                        Some(
                            PutOptions::new().with_lease(meta.as_ref().map_or(0, KeyValue::lease)),
                        ),
                    ),
                    TxnOp::delete(k.ballots.as_str(), Some(DeleteOptions::new().with_prefix())),
                ]);
            if self.txn(&txn, Retry::IfNotApplied).await?.succeeded() {
                return Ok(true);
            }
        }
        Err(contended(&k))
    }

    async fn vote(
        &self,
        group: &str,
        id: u64,
        member_id: &str,
        ballot: &Ballot,
    ) -> Result<bool, Error> {
        let k = Keys::new(group)?;
        check_name("member id", member_id)?;
        let value = format!("{id:016x}:{}", ballot.encode());
        let member_key = k.member(member_id);
        for attempt in 0..Self::MAX_ATTEMPTS {
            backoff(attempt).await;
            let [pending, me] = self.get_keys([&k.transition, &member_key]).await?;
            let Some(pending) = pending else {
                return Ok(false);
            };
            if decode_transition(pending.value())?.id != id {
                return Ok(false);
            }
            // The ballot lives on the voter's lease (it goes with the voter), or, from a
            // non-member, on the group's.
            let lease = me.as_ref().map_or(pending.lease(), KeyValue::lease);
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(
                        k.transition.as_str(),
                        CompareOp::Equal,
                        pending.mod_revision(),
                    ),
                    Compare::mod_revision(member_key.as_str(), CompareOp::Equal, mod_rev(&me)),
                ])
                .and_then([TxnOp::put(
                    k.ballot(member_id),
                    value.as_str(),
                    Some(PutOptions::new().with_lease(lease)),
                )]);
            if self.txn(&txn, Retry::IfNotApplied).await?.succeeded() {
                return Ok(true);
            }
        }
        Err(contended(&k))
    }

    async fn finish(&self, group: &str, id: u64, commit: bool) -> Result<bool, Error> {
        let k = Keys::new(group)?;
        for attempt in 0..Self::MAX_ATTEMPTS {
            backoff(attempt).await;
            let [meta_kv, pending] = self.get_keys([&k.meta, &k.transition]).await?;
            let Some(pending) = pending else {
                return Ok(false);
            };
            let t = decode_transition(pending.value())?;
            if t.id != id {
                return Ok(false);
            }
            let mut ops = Vec::with_capacity(3);
            if let Some(kv) = &meta_kv {
                let mut meta = Meta::decode(kv.value())?;
                if commit && meta.epoch == t.from_epoch {
                    meta.epoch = t.from_epoch + 1;
                    meta.stack = t.stack;
                }
                meta.outcome = Some(Outcome {
                    id,
                    committed: commit,
                });
                ops.push(TxnOp::put(
                    k.meta.as_str(),
                    meta.encode(),
                    Some(PutOptions::new().with_lease(kv.lease())),
                ));
            }
            ops.push(TxnOp::delete(k.transition.as_str(), None));
            ops.push(TxnOp::delete(
                k.ballots.as_str(),
                Some(DeleteOptions::new().with_prefix()),
            ));
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(k.meta.as_str(), CompareOp::Equal, mod_rev(&meta_kv)),
                    Compare::mod_revision(
                        k.transition.as_str(),
                        CompareOp::Equal,
                        pending.mod_revision(),
                    ),
                ])
                .and_then(ops);
            if self.txn(&txn, Retry::IfNotApplied).await?.succeeded() {
                return Ok(true);
            }
        }
        Err(contended(&k))
    }
}

/// The leases [`EtcdStore::join_attempts`] granted (at most one each, reused by every attempt).
#[derive(Default)]
struct Granted {
    /// For the member key.
    member: Option<i64>,
    /// For the group's record, when creating it.
    group: Option<i64>,
}

/// The keys of one group.
struct Keys {
    group: String,
    meta: String,
    transition: String,
    /// Prefix of the member keys (ends with `/`).
    members: String,
    /// Prefix of the ballot keys (ends with `/`).
    ballots: String,
}

/// How many range operations [`Keys::read_ops`] makes.
const READ_OPS: usize = 4;

impl Keys {
    fn new(group: &str) -> Result<Keys, Error> {
        check_name("group name", group)?;
        Ok(Keys {
            group: group.to_owned(),
            meta: format!("chunnel/{group}/meta"),
            transition: format!("chunnel/{group}/transition"),
            members: format!("chunnel/{group}/members/"),
            ballots: format!("chunnel/{group}/ballots/"),
        })
    }

    fn member(&self, id: &str) -> String {
        format!("{}{id}", self.members)
    }

    fn ballot(&self, id: &str) -> String {
        format!("{}{id}", self.ballots)
    }

    /// The range reads of the whole record, in the order [`Record::decode`] expects.
    fn read_ops(&self) -> [TxnOp; READ_OPS] {
        let prefix = || Some(GetOptions::new().with_prefix());
        [
            TxnOp::get(self.meta.as_str(), None),
            TxnOp::get(self.transition.as_str(), None),
            TxnOp::get(self.members.as_str(), prefix()),
            TxnOp::get(self.ballots.as_str(), prefix()),
        ]
    }
}

/// A group record as read, with the revisions the compare-and-swaps compare against.
struct Record {
    snap: Snapshot,
    /// `mod_revision` of the meta key, 0 if absent.
    meta_rev: i64,
    /// The lease the meta key is attached to (the group's lease), 0 if none.
    meta_lease: i64,
    /// (member id, `mod_revision`, lease) of each member key.
    member_keys: Vec<(String, i64, i64)>,
}

impl Record {
    /// Decodes the answers to [`Keys::read_ops`].
    fn decode(k: &Keys, gets: &[GetResponse]) -> Result<Record, Error> {
        let [meta, transition, members, ballots] = gets else {
            return Err(Error::unavailable(
                BACKEND,
                "etcd answered a read with a wrong shape",
            ));
        };
        let mut snap = Snapshot::default();
        let meta_kv = meta.kvs().first();
        if let Some(kv) = meta_kv {
            let m = Meta::decode(kv.value())?;
            snap.committed = Some(Committed {
                epoch: m.epoch,
                stack: m.stack,
            });
            snap.outcome = m.outcome;
        }
        if let Some(kv) = transition.kvs().first() {
            snap.transition = Some(decode_transition(kv.value())?);
        }
        let mut member_keys = Vec::with_capacity(members.kvs().len());
        for kv in members.kvs() {
            let id = suffix(
                kv.key(),
                &k.members,
                "a member key is not a valid member id",
            )?;
            let addr = std::str::from_utf8(kv.value())
                .map_err(|_| Error::Corrupt("a member address is not UTF-8"))?;
            snap.members.push(Member {
                id: id.clone(),
                addr: addr.to_owned(),
            });
            member_keys.push((id, kv.mod_revision(), kv.lease()));
        }
        snap.members.sort_by(|a, b| a.id.cmp(&b.id));
        if let Some(t) = &snap.transition {
            for kv in ballots.kvs() {
                let id = suffix(
                    kv.key(),
                    &k.ballots,
                    "a ballot key is not a valid member id",
                )?;
                let (tid, ballot) = decode_ballot(kv.value())?;
                // Ballots are deleted with their transition; one on another id is stale.
                if tid == t.id {
                    snap.ballots.push((id, ballot));
                }
            }
            snap.ballots.sort_by(|a, b| a.0.cmp(&b.0));
        }
        Ok(Record {
            snap,
            meta_rev: meta_kv.map_or(0, KeyValue::mod_revision),
            meta_lease: meta_kv.map_or(0, KeyValue::lease),
            member_keys,
        })
    }

    /// (`mod_revision`, lease) of `id`'s member key, (0, 0) if absent.
    fn member_key(&self, id: &str) -> (i64, i64) {
        self.member_keys
            .iter()
            .find(|(m, _, _)| m == id)
            .map_or((0, 0), |&(_, rev, lease)| (rev, lease))
    }
}

/// The committed stack and last outcome, as stored under `chunnel/<g>/meta`.
struct Meta {
    epoch: u64,
    stack: Bytes,
    outcome: Option<Outcome>,
}

/// Format version of the binary records.
const RECORD_V1: u8 = 1;

impl Meta {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(18 + self.stack.len());
        out.push(RECORD_V1);
        out.extend_from_slice(&self.epoch.to_be_bytes());
        let (tag, id) = match self.outcome {
            None => (0, 0),
            Some(o) => (if o.committed { 2 } else { 1 }, o.id),
        };
        out.push(tag);
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(&self.stack);
        out
    }

    fn decode(b: &[u8]) -> Result<Meta, Error> {
        let mut r = Reader::new(
            b,
            "a group's meta record is truncated or of an unknown format",
        );
        r.version()?;
        let epoch = r.u64()?;
        let tag = r.u8()?;
        let id = r.u64()?;
        let outcome = match tag {
            0 => None,
            1 | 2 => Some(Outcome {
                id,
                committed: tag == 2,
            }),
            _ => return Err(Error::Corrupt("a group's outcome tag is not 0, 1 or 2")),
        };
        Ok(Meta {
            epoch,
            stack: Bytes::copy_from_slice(r.rest()),
            outcome,
        })
    }
}

/// The stored form of a pending transition (the proposer is at most 128 bytes, checked).
fn encode_transition(t: &Transition) -> Vec<u8> {
    let mut out = Vec::with_capacity(27 + t.proposer.len() + t.stack.len());
    out.push(RECORD_V1);
    out.extend_from_slice(&t.id.to_be_bytes());
    out.extend_from_slice(&t.from_epoch.to_be_bytes());
    out.extend_from_slice(&t.deadline_ms.to_be_bytes());
    out.extend_from_slice(&(t.proposer.len() as u16).to_be_bytes());
    out.extend_from_slice(t.proposer.as_bytes());
    out.extend_from_slice(&t.stack);
    out
}

fn decode_transition(b: &[u8]) -> Result<Transition, Error> {
    let mut r = Reader::new(
        b,
        "a transition record is truncated or of an unknown format",
    );
    r.version()?;
    let id = r.u64()?;
    let from_epoch = r.u64()?;
    let deadline_ms = r.u64()?;
    let len = u16::from_be_bytes([r.u8()?, r.u8()?]);
    let proposer = std::str::from_utf8(r.take(usize::from(len))?)
        .map_err(|_| Error::Corrupt("a transition's proposer is not UTF-8"))?
        .to_owned();
    Ok(Transition {
        id,
        from_epoch,
        proposer,
        stack: Bytes::copy_from_slice(r.rest()),
        deadline_ms,
    })
}

/// Reads `<16 hex digits>:<ballot>`.
fn decode_ballot(b: &[u8]) -> Result<(u64, Ballot), Error> {
    const BAD: Error = Error::Corrupt("a ballot is not `<transition id>:<ballot>`");
    let s = std::str::from_utf8(b).map_err(|_| BAD)?;
    let (tid, ballot) = s.split_once(':').ok_or(BAD)?;
    let tid = u64::from_str_radix(tid, 16).map_err(|_| BAD)?;
    Ok((tid, Ballot::decode(ballot)?))
}

/// A bounds-checked reader of a stored record.
struct Reader<'a> {
    rest: &'a [u8],
    corrupt: &'static str,
}

impl<'a> Reader<'a> {
    fn new(b: &'a [u8], corrupt: &'static str) -> Reader<'a> {
        Reader { rest: b, corrupt }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        if self.rest.len() < n {
            return Err(Error::Corrupt(self.corrupt));
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }

    fn u64(&mut self) -> Result<u64, Error> {
        let mut b = [0; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(b))
    }

    fn version(&mut self) -> Result<(), Error> {
        match self.u8()? {
            RECORD_V1 => Ok(()),
            _ => Err(Error::Corrupt(self.corrupt)),
        }
    }

    fn rest(self) -> &'a [u8] {
        self.rest
    }
}

/// The id at the end of `key` (after `prefix`), if it is a valid name.
fn suffix(key: &[u8], prefix: &str, corrupt: &'static str) -> Result<String, Error> {
    let id = key
        .strip_prefix(prefix.as_bytes())
        .and_then(|id| std::str::from_utf8(id).ok())
        .ok_or(Error::Corrupt(corrupt))?;
    check_name("member id", id).map_err(|_| Error::Corrupt(corrupt))?;
    Ok(id.to_owned())
}

/// The range answers `resp.op_responses()[skip..skip + n]`.
fn ranges(resp: &TxnResponse, skip: usize, n: usize) -> Result<Vec<GetResponse>, Error> {
    let gets: Vec<GetResponse> = resp
        .op_responses()
        .into_iter()
        .skip(skip)
        .filter_map(|r| match r {
            TxnOpResponse::Get(g) => Some(g),
            _ => None,
        })
        .collect();
    if gets.len() != n {
        return Err(Error::unavailable(
            BACKEND,
            format!(
                "etcd answered a transaction with {} reads, not {n}",
                gets.len()
            ),
        ));
    }
    Ok(gets)
}

fn mod_rev(kv: &Option<KeyValue>) -> i64 {
    kv.as_ref().map_or(0, KeyValue::mod_revision)
}

/// `lease` in whole seconds, rounded up, within what etcd grants.
fn ttl_secs(lease: Duration) -> i64 {
    let secs = lease.as_millis().div_ceil(1000);
    i64::try_from(secs).map_or(MAX_TTL_SECS, |s| s.clamp(1, MAX_TTL_SECS))
}

fn contended(k: &Keys) -> Error {
    Error::Contended {
        group: k.group.clone(),
        attempts: EtcdStore::MAX_ATTEMPTS,
    }
}

/// Before attempt `attempt` (> 0) of a compare-and-swap: a random pause of up to
/// `2 * attempt` ms (at most 50), so racing clients spread out.
async fn backoff(attempt: u32) {
    if attempt == 0 {
        return;
    }
    let cap = u64::from(attempt).saturating_mul(2).min(50);
    tokio::time::sleep(Duration::from_millis(random() % (cap + 1))).await;
}

/// An answer that names the cluster it came from (in its response header).
trait Headed {
    /// The cluster id in the header, if the answer has one.
    fn cluster_id(&self) -> Option<u64>;
}

fn header_cluster(h: Option<&ResponseHeader>) -> Option<u64> {
    h.map(ResponseHeader::cluster_id)
}

impl Headed for TxnResponse {
    fn cluster_id(&self) -> Option<u64> {
        header_cluster(self.header())
    }
}

impl Headed for LeaseGrantResponse {
    fn cluster_id(&self) -> Option<u64> {
        header_cluster(self.header())
    }
}

impl Headed for LeaseRevokeResponse {
    fn cluster_id(&self) -> Option<u64> {
        header_cluster(self.header())
    }
}

impl Headed for LeaseTimeToLiveResponse {
    fn cluster_id(&self) -> Option<u64> {
        header_cluster(self.header())
    }
}

impl Headed for StatusResponse {
    fn cluster_id(&self) -> Option<u64> {
        header_cluster(self.header())
    }
}

/// The keep-alive answers are read by the client library (the lease's time-to-live, read
/// next, carries the header that is checked).
impl Headed for bool {
    fn cluster_id(&self) -> Option<u64> {
        None
    }
}

/// How [`EtcdStore::call`] may repeat a request after a member failed it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// Only if it was certainly not applied.
    IfNotApplied,
    /// Always (reads, and requests whose repetition is harmless).
    Always,
}

/// What an error says about the member that returned it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Nothing: etcd answered the request with an error (e.g. an unknown lease).
    None,
    /// The member failed, and the request was certainly not applied.
    NotApplied,
    /// The member failed, and the request may have been applied.
    MaybeApplied,
}

/// Classifies an error of the client library.
fn fault(e: &etcd_client::Error) -> Fault {
    // gRPC status codes (`tonic::Code` as i32).
    const CANCELLED: i32 = 1;
    const UNKNOWN: i32 = 2;
    const DEADLINE_EXCEEDED: i32 = 4;
    const UNAVAILABLE: i32 = 14;
    let source: &(dyn std::error::Error + 'static) = match e {
        etcd_client::Error::GRpcStatus(s) => {
            // etcd's own answer when the member has no leader (`rpctypes.ErrNoLeader`):
            // refused before it was proposed.
            if s.message() == "etcdserver: no leader" {
                return Fault::NotApplied;
            }
            let code = i32::from(s.code());
            if ![CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, UNAVAILABLE].contains(&code) {
                return Fault::None;
            }
            s
        }
        etcd_client::Error::TransportError(t) => t,
        etcd_client::Error::IoError(io) => io,
        _ => return Fault::None,
    };
    if failed_to_connect(source) {
        Fault::NotApplied
    } else {
        Fault::MaybeApplied
    }
}

/// Whether the error chain says the connection to the member could not be made, so the
/// request never left: the connection was refused, or the TCP connect failed otherwise
/// (hyper's connector reports every such failure as `tcp connect error`).
fn failed_to_connect(mut err: &(dyn std::error::Error + 'static)) -> bool {
    loop {
        let refused = err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused);
        if refused || err.to_string() == "tcp connect error" {
            return true;
        }
        match err.source() {
            Some(next) => err = next,
            None => return false,
        }
    }
}

/// A random number (for jitter and spreading; not for anything secret).
fn random() -> u64 {
    std::collections::hash_map::RandomState::new().hash_one(0u8)
}
