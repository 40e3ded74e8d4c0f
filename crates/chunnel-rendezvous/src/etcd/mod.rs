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
//! (u64 BE each) ++ proposer length (u16 BE) ++ proposer ++ stack`, or, for a transition
//! with a ballot box (docs/wire.md §15.4), `[2] ++` the same fields with the box's stored form
//! (length u16 BE ++ text) between the proposer and the stack. The leading byte is a format
//! version; anything unreadable is [`Error::Corrupt`].
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
//! transition is pending, `transition` and one ballot per member that voted in the store;
//! leases: one per member key
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
//! * `propose`: R `meta`, `transition` (serializably first, linearizably before refusing);
//!   W `transition`, deletes `ballots/*`; C both;
//! * `vote`: R `transition` (serializably first: the member it asks answers from what it
//!   applied, without a round through the leader; linearizably after a failed compare, and
//!   before refusing because the transition is not pending); W `ballots/<id>`; C
//!   `transition` (a vote racing with `finish` either lands before it, and is deleted with
//!   the other ballots, or fails its compare);
//! * `finish`: R the whole group (serializably first, linearizably after a failed compare
//!   and before refusing); W `meta`, deletes `transition` and `ballots/*`; C `meta`,
//!   `transition` and, for a commit, that no key under `members/` or `ballots/` changed
//!   since the read (each member then live has a yes ballot or is attested by the proposer);
//! * `renew`, when moving a member to a new lease: C `members/<id>`.
//!
//! Leases are not part of `Txn`s: `join` grants the member's lease (and, when it creates the
//! group, the group lease) before its writing `Txn` (and revokes them if the keys were not
//! written with them), and `renew` re-checks that the key is still attached to the lease it
//! kept alive.
//!
//! # Notifications
//!
//! [`Store::watch`] opens an etcd watch on the group's keys from `chunnel/<g>/members/` to the
//! end of the prefix `chunnel/<g>/` (every key of the record but the ballots, so a member is
//! not woken by every other member's vote), on the store's pinned member, and wakes the
//! participant with the kinds of keys each response's events touched: `members/*` (a join, a
//! leave, a lease that ran out: etcd deletes the key itself, so expiries are notified too)
//! and `meta` or
//! `transition` (a transition proposed or finished). Events carry the keys' values, so a put
//! of `transition` also brings the proposal and a put of `meta` with an outcome the finished
//! transition and the committed stack ([`crate::News`]): voters vote and members switch
//! without reading. [`Store::watch_ballots`] watches `chunnel/<g>/ballots/` alone: a proposer
//! opens it before writing its proposal and holds it while the proposal is pending. Lease
//! keep-alives write no key, so renewals wake nobody. The watch starts at the current revision, not at the revision of
//! the participant's last read: once etcd confirms it was created, the watch notifies
//! everything once, and the participant reads the record again, which covers every write
//! before the watch's start; the watch covers every write after it.
//!
//! A watch breaks when its member fails (an error, the stream closed, a cancellation, e.g.
//! when the member lost its leader, since requests ask for one), when its member does not
//! answer a progress request within [`EtcdStore::WATCH_PROGRESS`] (a member that hangs
//! without closing the connection), or when an answer comes from another cluster. It is then
//! opened again on the next member, after a backoff of 50 ms doubling up to
//! [`EtcdStore::WATCH_BACKOFF`]; meanwhile it is not complete ([`crate::Watch::is_complete`])
//! and participants poll at their fast interval. Responses are not queued by the watch: each
//! only merges bits into what the participant takes next.
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
//!
//! [`check_name`]: crate::store::check_name
//! [`Error::Corrupt`]: crate::Error::Corrupt
//! [`Error::Contended`]: crate::Error::Contended
//! [`Error::Unavailable`]: crate::Error::Unavailable
//! [`Store::renew`]: crate::store::Store::renew
//! [`Store::leave`]: crate::store::Store::leave
//! [`Store::snapshot`]: crate::store::Store::snapshot
//! [`Store::watch`]: crate::store::Store::watch

mod cluster;
mod lease;
mod ops;
mod record;
mod watch;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};

use etcd_client::Client;

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
