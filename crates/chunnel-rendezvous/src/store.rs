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

use std::future::Future;
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
        self.members.iter().all(|m| {
            self.ballots
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
    ) -> impl Future<Output = Result<bool, Error>> + Send;
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
