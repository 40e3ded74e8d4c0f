//! The rendezvous trait: the few atomic operations on a group's record that multi-party
//! negotiation needs, implemented by every backend.
//!
//! A group's record in the store holds:
//!
//! * the **committed stack**: an epoch (1 for the first stack, +1 per transition) and the
//!   stack record (bytes from [`chunnel_negotiate::wire::encode_stack`], opaque to the store);
//! * the **members**: an id and a data-plane address each, every one under a lease that the
//!   member renews; a member whose lease ran out is gone from every later snapshot;
//! * at most one **pending transition** (a proposed next stack) and the members' ballots on it;
//! * the **outcome** of the last finished transition.
//!
//! Every operation is one serializable transaction in the store (an SQLite `IMMEDIATE`
//! transaction, one Redis Lua script, one etcd `Txn`), so racing participants can never both
//! install a stack or both finish a transition.
//!
//! A store may also tell its participants when a group's record changed ([`Store::watch`]):
//! a [`Watch`] wakes them so they read the record at once instead of at their next poll.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;

use bytes::Bytes;

use crate::Error;

/// One participant of a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Unique within the group (at most 128 bytes).
    pub id: String,
    /// Where the member receives group messages (e.g. `"127.0.0.1:4000"`); opaque to the store.
    pub addr: String,
}

/// The stack a group uses now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Committed {
    /// 1 for the stack the group was created with, +1 per committed transition.
    pub epoch: u64,
    /// The stack record (`chunnel_negotiate::wire::encode_stack`).
    pub stack: Bytes,
}

/// A proposed switch to another stack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    /// Chosen by the proposer (random); names the transition in votes and in `finish`.
    pub id: u64,
    /// The epoch the group must be at for the transition to apply.
    pub from_epoch: u64,
    /// The proposing member's id.
    pub proposer: String,
    /// The proposed stack record.
    pub stack: Bytes,
    /// Unix time in milliseconds after which any participant may abort it (the proposer may
    /// have died).
    pub deadline_ms: u64,
    /// Where the proposer collects ballots sent directly (docs/wire.md §15.4); `None`: members
    /// vote in the store only.
    pub ballot_box: Option<BallotBox>,
}

/// A member's answer to a proposed transition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ballot {
    /// The member can build the proposed stack and has prepared it.
    Yes,
    /// The member refuses, with the reason (at most 256 bytes).
    No(String),
}

impl Ballot {
    /// The form stored in the backends: `"y"`, or `"n:"` followed by the reason.
    pub fn encode(&self) -> String {
        match self {
            Ballot::Yes => "y".to_owned(),
            Ballot::No(why) => format!("n:{why}"),
        }
    }

    /// Reads the stored form back; anything else is an error.
    pub fn decode(s: &str) -> Result<Ballot, Error> {
        match s {
            "y" => Ok(Ballot::Yes),
            _ => match s.strip_prefix("n:") {
                Some(why) => Ok(Ballot::No(why.to_owned())),
                None => Err(Error::Corrupt("a ballot is neither `y` nor `n:<reason>`")),
            },
        }
    }
}

/// How the last finished transition ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The transition's id.
    pub id: u64,
    /// Whether it committed (else it was aborted).
    pub committed: bool,
}

/// A consistent view of a group's record (read in one transaction).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// The stack in use, or `None` for a group nobody has created.
    pub committed: Option<Committed>,
    /// The live members (leases not expired), sorted by id.
    pub members: Vec<Member>,
    /// The pending transition, if any.
    pub transition: Option<Transition>,
    /// Ballots on the pending transition: (member id, ballot), sorted by member id.
    pub ballots: Vec<(String, Ballot)>,
    /// The last finished transition.
    pub outcome: Option<Outcome>,
}

impl Snapshot {
    /// The committed epoch, 0 for a group with no stack.
    pub fn epoch(&self) -> u64 {
        self.committed.as_ref().map_or(0, |c| c.epoch)
    }

    /// Whether `id` is a live member.
    pub fn is_member(&self, id: &str) -> bool {
        self.members.iter().any(|m| m.id == id)
    }

    /// Whether every live member has a yes ballot on the pending transition (what a commit
    /// needs, checked again by [`Store::finish`] when it writes).
    pub fn all_live_yes(&self) -> bool {
        self.all_live_yes_with(&[])
    }

    /// [`Snapshot::all_live_yes`], counting the members in `attested` (whose yes the proposer
    /// received directly, docs/wire.md §15.4) as yes ballots too.
    pub fn all_live_yes_with(&self, attested: &[String]) -> bool {
        self.members.iter().all(|m| {
            attested.contains(&m.id)
                || self
                    .ballots
                    .iter()
                    .any(|(id, b)| id == &m.id && *b == Ballot::Yes)
        })
    }
}

/// What [`Store::join`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JoinReply {
    /// The group had no stack: the proposal was committed at epoch 1 and the member added.
    Created(Snapshot),
    /// The group was at the expected epoch: the member was added (or its lease renewed).
    Joined(Snapshot),
    /// Nothing was written: the group already has a stack (and the caller proposed one), or is
    /// at another epoch than expected, or has no stack and the caller proposed none. The
    /// snapshot says what is there.
    Current(Snapshot),
}

/// A key-value store that keeps group records: the rendezvous of multi-party negotiation
/// (paper §5.3).
///
/// Every method is one serializable transaction. Group names and member ids are at most 128
/// bytes of UTF-8; implementations reject longer ones with [`Error::InvalidName`]. A store that
/// cannot be reached fails with [`Error::Unavailable`] (never hangs past its own timeout).
pub trait Store: Send + Sync + 'static {
    /// The backend's name for messages and figures (`"sqlite"`, `"redis"`, `"etcd"`).
    fn backend(&self) -> &'static str;

    /// The compare-and-swap that creates or joins a group, atomically:
    ///
    /// * no committed stack and `propose` is `Some`: commit it at epoch 1, add `member`
    ///   under a lease of `lease` → [`JoinReply::Created`];
    /// * the committed epoch equals `expect_epoch`: add `member` (or renew its lease) →
    ///   [`JoinReply::Joined`];
    /// * otherwise write nothing → [`JoinReply::Current`].
    fn join(
        &self,
        group: &str,
        member: &Member,
        propose: Option<&Bytes>,
        expect_epoch: Option<u64>,
        lease: Duration,
    ) -> impl Future<Output = Result<JoinReply, Error>> + Send {
        self.join_creating_at(group, member, propose, expect_epoch, 1, lease)
    }

    /// [`Store::join`], but a group it creates starts at epoch `create_epoch` (at least 1)
    /// instead of 1. A member re-creating a group the store lost uses an epoch number no
    /// member can still hold from before, so that one number never names two stacks
    /// (docs/wire.md §15.2).
    fn join_creating_at(
        &self,
        group: &str,
        member: &Member,
        propose: Option<&Bytes>,
        expect_epoch: Option<u64>,
        create_epoch: u64,
        lease: Duration,
    ) -> impl Future<Output = Result<JoinReply, Error>> + Send;

    /// Extends `member_id`'s lease to `lease` from now. `Ok(false)` if it is not a live member
    /// (its lease ran out or it left): it has to join again.
    fn renew(
        &self,
        group: &str,
        member_id: &str,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// Removes `member_id` (and its ballot) at once. Leaving twice is not an error.
    fn leave(&self, group: &str, member_id: &str)
    -> impl Future<Output = Result<(), Error>> + Send;

    /// Reads the whole group record in one transaction.
    fn snapshot(&self, group: &str) -> impl Future<Output = Result<Snapshot, Error>> + Send;

    /// Records `t` as the pending transition if the committed epoch is `t.from_epoch` and no
    /// transition is pending; `Ok(false)` (nothing written) otherwise.
    fn propose(
        &self,
        group: &str,
        t: &Transition,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// Records `member_id`'s ballot on the pending transition `id` (replacing an earlier one).
    /// `Ok(false)` if `id` is not the pending transition.
    fn vote(
        &self,
        group: &str,
        id: u64,
        member_id: &str,
        ballot: &Ballot,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// Ends the pending transition `id`: when `commit`, the proposed stack becomes the
    /// committed one at `from_epoch + 1`; either way the transition and its ballots are removed
    /// and the outcome recorded. `Ok(false)` (nothing written) if `id` is not pending, or if
    /// `commit` and a live member has no yes ballot on it *now* (one that joined after the
    /// proposer's last read has had no say yet): the check and the write are one atomic
    /// operation, so no member is switched without its yes (docs/wire.md §15).
    fn finish(
        &self,
        group: &str,
        id: u64,
        commit: bool,
    ) -> impl Future<Output = Result<bool, Error>> + Send {
        self.finish_attested(group, id, commit, &[])
    }

    /// [`Store::finish`] by a proposer that received yes ballots directly (docs/wire.md
    /// §15.4): a commit needs every member live at the write to have a yes ballot in the
    /// store or to be in `attested`. A member that joined after the proposer's last read is in
    /// neither, so the commit is refused as with [`Store::finish`].
    fn finish_attested(
        &self,
        group: &str,
        id: u64,
        commit: bool,
        attested: &[String],
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// Change notifications for `group`, if the backend has them: the [`Watch`] wakes when
    /// the group's record changes. `None` (the default) means none: participants find changes
    /// by reading the record every [`crate::Config::poll`]. Called inside a tokio runtime (a
    /// backend may spawn the task that feeds the watch).
    fn watch(&self, group: &str) -> Option<Watch> {
        let _ = group;
        None
    }

    /// Notifications of ballots on `group`, for a backend whose [`Store::watch`] leaves them
    /// out (so the members that do not collect ballots are not woken by each one): a
    /// proposer holds this watch while its proposal is pending. `None` (the default): the
    /// main watch, if any, notifies ballots too.
    fn watch_ballots(&self, group: &str) -> Option<Watch> {
        let _ = group;
        None
    }
}

/// What changed in a group's record, as a store's notifications tell it: a set of kinds,
/// merged when several notifications arrive before they are taken.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Changes(u8);

impl Changes {
    /// Nothing (a [`Watch`] woke because its state changed, not the record).
    pub const NONE: Changes = Changes(0);
    /// A member joined or left (or its lease ran out).
    pub const MEMBERS: Changes = Changes(1);
    /// A transition was proposed or finished, or the committed stack changed.
    pub const TRANSITION: Changes = Changes(2);
    /// A ballot was cast (only a transition's proposer acts on ballots).
    pub const BALLOTS: Changes = Changes(4);
    /// Anything may have changed (e.g. notifications were missed while a stream was down).
    pub const ALL: Changes = Changes(7);

    /// Whether every kind in `other` is in `self`.
    pub fn contains(self, other: Changes) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether `self` and `other` share a kind.
    pub fn intersects(self, other: Changes) -> bool {
        self.0 & other.0 != 0
    }

    /// `self` without the kinds in `other`.
    pub fn without(self, other: Changes) -> Changes {
        Changes(self.0 & !other.0)
    }

    /// Whether no kind is set.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl std::ops::BitOr for Changes {
    type Output = Changes;
    fn bitor(self, rhs: Changes) -> Changes {
        Changes(self.0 | rhs.0)
    }
}

impl std::ops::BitOrAssign for Changes {
    fn bitor_assign(&mut self, rhs: Changes) {
        self.0 |= rhs.0;
    }
}

/// What a notification may carry besides its kinds: the change itself, exactly as the write
/// that it announces applied it, so a participant can act without reading the record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum News {
    /// A transition was proposed (it is the pending one as of that write).
    Proposed(Transition),
    /// A transition ended; `committed` is the group's stack after it.
    Finished {
        /// How it ended.
        outcome: Outcome,
        /// The committed stack after it (the new one, if it committed).
        committed: Committed,
    },
}

/// State shared by a [`Watch`] and its [`Notifier`].
#[derive(Debug, Default)]
struct WatchShared {
    /// The kinds notified and not yet taken (coalesced: a bit per kind, never a queue).
    pending: AtomicU8,
    /// The latest [`News`] notified and not yet taken (a later one replaces it: at most one is
    /// held, and a watcher that finds it insufficient reads the record).
    news: std::sync::Mutex<Option<News>>,
    /// Whether every write to the group is being notified now.
    complete: AtomicBool,
    /// Woken by every notification and state change (holds at most one permit).
    wake: tokio::sync::Notify,
}

/// Change notifications for one group, from [`Store::watch`].
///
/// Notifications are coalesced: whatever arrives before [`Watch::changed`] is called again is
/// merged into one [`Changes`], so a burst of writes costs the watcher one wake-up and no
/// memory grows with it. A notification may still be lost (a stream that breaks between a
/// write and its delivery), so a watcher keeps reading the record at a slower interval too.
/// Dropping the `Watch` stops the backend's notification task, if it has one.
#[derive(Debug)]
pub struct Watch {
    shared: Arc<WatchShared>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

/// The sending side of a [`Watch`], held by a backend.
#[derive(Clone, Debug)]
pub struct Notifier {
    shared: Arc<WatchShared>,
}

impl Watch {
    /// A watch and the notifier that feeds it. The watch starts incomplete (see
    /// [`Watch::is_complete`]) until the backend says otherwise.
    pub fn new() -> (Watch, Notifier) {
        let shared = Arc::new(WatchShared::default());
        (
            Watch {
                shared: shared.clone(),
                task: None,
            },
            Notifier { shared },
        )
    }

    /// Ties the backend task that feeds this watch to it: dropping the watch aborts the task.
    pub fn with_task(mut self, task: tokio::task::JoinHandle<()>) -> Watch {
        self.task = Some(task);
        self
    }

    /// Waits for a notification (or a change of [`Watch::is_complete`]) and returns every kind
    /// notified since the last call; [`Changes::NONE`] when only the state changed.
    pub async fn changed(&mut self) -> Changes {
        let taken = self.shared.pending.swap(0, Ordering::AcqRel);
        if taken != 0 {
            return Changes(taken);
        }
        self.shared.wake.notified().await;
        Changes(self.shared.pending.swap(0, Ordering::AcqRel))
    }

    /// Takes the latest [`News`] notified since the last call, if any. Only the latest is
    /// kept: a watcher that took news older than the kinds [`Watch::changed`] returned, or
    /// none, reads the record.
    pub fn take_news(&mut self) -> Option<News> {
        self.shared
            .news
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// Whether every write to the group is being notified now (the stream is up and covers
    /// every writer). While it is not, a watcher must poll at its normal rate.
    pub fn is_complete(&self) -> bool {
        self.shared.complete.load(Ordering::Acquire)
    }
}

impl Notifier {
    /// Records `changes` and wakes the watcher.
    pub fn notify(&self, changes: Changes) {
        self.shared.pending.fetch_or(changes.0, Ordering::AcqRel);
        self.shared.wake.notify_one();
    }

    /// Records `changes` that `news` describes (the latest news replaces an earlier one not
    /// yet taken) and wakes the watcher.
    pub fn notify_news(&self, changes: Changes, news: News) {
        *self
            .shared
            .news
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(news);
        self.notify(changes);
    }

    /// Says whether every write is notified from now on, and wakes the watcher if that
    /// changed. Becoming complete also notifies [`Changes::ALL`]: writes made while the
    /// stream was down were not notified, so the watcher must read the record once.
    pub fn set_complete(&self, complete: bool) {
        let was = self.shared.complete.swap(complete, Ordering::AcqRel);
        if was != complete {
            if complete {
                self.shared
                    .pending
                    .fetch_or(Changes::ALL.0, Ordering::AcqRel);
            }
            self.shared.wake.notify_one();
        }
    }

    /// Whether the [`Watch`] is gone (the backend can stop feeding it).
    pub fn is_closed(&self) -> bool {
        Arc::strong_count(&self.shared) == 1
    }
}

/// Checks a group name or member id: 1 to 128 bytes, no control characters and no `/` (etcd
/// keys and Redis keys are built from them).
pub fn check_name(what: &'static str, s: &str) -> Result<(), Error> {
    if s.is_empty() || s.len() > 128 || s.chars().any(|c| c.is_control() || c == '/') {
        return Err(Error::InvalidName {
            what,
            name: s.chars().take(140).collect(),
        });
    }
    Ok(())
}

/// Milliseconds since the Unix epoch on this host's clock.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Where a proposer collects direct ballots (docs/wire.md §15.4, [`crate::ballot`]), and the
/// token they must carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BallotBox {
    /// The proposer's ballot socket, as members reach it.
    pub addr: SocketAddr,
    /// Fresh per transition: a ballot without it is ignored.
    pub token: u128,
}

impl BallotBox {
    /// The stored form: the token as 32 lowercase hex digits, `@`, the address
    /// (`SocketAddr`'s display form, e.g. `127.0.0.1:4000` or `[::1]:4000`).
    pub fn encode(&self) -> String {
        format!("{:032x}@{}", self.token, self.addr)
    }

    /// Reads the stored form back.
    pub fn decode(s: &str) -> Result<BallotBox, Error> {
        const BAD: Error = Error::Corrupt("a ballot box is not `<32 hex digits>@<address>`");
        let (token, addr) = s.split_once('@').ok_or(BAD)?;
        if token.len() != 32 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(BAD);
        }
        Ok(BallotBox {
            token: u128::from_str_radix(token, 16).map_err(|_| BAD)?,
            addr: addr.parse().map_err(|_| BAD)?,
        })
    }
}
