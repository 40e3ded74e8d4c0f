//! The assignment record (docs/wire.md §18.3) and one member's side of the handover, without
//! I/O ([`Core`]).

use super::*;

/// The first bytes of an assignment record ([`encode_members`]).
pub const MAGIC: &[u8; 4] = b"ckg1";
/// The most members an assignment record holds.
pub const MAX_MEMBERS: usize = 1024;
/// The longest member name (the rendezvous stores' limit on member ids).
pub const MAX_NAME: usize = 128;
/// How long past a transition's deadline a member other than its proposer waits before it
/// aborts it (the proposer may have died).
pub const ORPHAN_GRACE_MS: u64 = 1_000;

/// The member that owns partition `p` among `members` (sorted names): the `i`-th owns the
/// partitions with `p % members.len() == i`. `None` without members.
pub fn owner(members: &[String], p: i32) -> Option<usize> {
    if members.is_empty() || p < 0 {
        return None;
    }
    Some(p as usize % members.len())
}

/// The partitions (of `partitions`) that `me` owns among `members`, ascending.
pub fn owned(members: &[String], me: &str, partitions: i32) -> BTreeSet<i32> {
    match members.iter().position(|m| m == me) {
        Some(i) => (0..partitions)
            .filter(|&p| owner(members, p) == Some(i))
            .collect(),
        None => BTreeSet::new(),
    }
}

fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= MAX_NAME && !n.chars().any(|c| c.is_control() || c == '/')
}

/// The assignment record of an epoch (docs/wire.md §18.3): [`MAGIC`], the member count (u16,
/// big-endian), then each name as a length byte and its UTF-8 bytes, sorted and distinct.
/// `members` must be sorted, distinct, valid names, at most [`MAX_MEMBERS`]
/// ([`decode_members`] refuses anything else); the store's member ids are.
pub fn encode_members(members: &[String]) -> Bytes {
    let mut out = Vec::with_capacity(6 + members.iter().map(|m| m.len() + 1).sum::<usize>());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(members.len().min(MAX_MEMBERS) as u16).to_be_bytes());
    for m in members.iter().take(MAX_MEMBERS) {
        out.push(m.len().min(MAX_NAME) as u8);
        out.extend_from_slice(&m.as_bytes()[..m.len().min(MAX_NAME)]);
    }
    Bytes::from(out)
}

/// Reads an assignment record ([`encode_members`]); [`Error::Corrupt`] for anything else
/// (another magic, a count over [`MAX_MEMBERS`], a name that is empty, too long, not UTF-8,
/// holds a control character or `/`, names not strictly ascending, bytes left over).
pub fn decode_members(bytes: &[u8]) -> Result<Vec<String>, Error> {
    let corrupt = |what: &'static str| Error::Corrupt {
        what: "kafka group assignment record",
        why: what,
    };
    let rest = bytes.strip_prefix(MAGIC).ok_or(corrupt("no magic"))?;
    let (count, mut rest) = rest.split_first_chunk::<2>().ok_or(corrupt("no count"))?;
    let count = u16::from_be_bytes(*count) as usize;
    if count > MAX_MEMBERS {
        return Err(corrupt("too many members"));
    }
    let mut out: Vec<String> = Vec::with_capacity(count);
    for _ in 0..count {
        let (&len, tail) = rest.split_first().ok_or(corrupt("truncated"))?;
        let len = len as usize;
        if tail.len() < len {
            return Err(corrupt("truncated"));
        }
        let name = std::str::from_utf8(&tail[..len]).map_err(|_| corrupt("not UTF-8"))?;
        if !valid_name(name) {
            return Err(corrupt("invalid name"));
        }
        if out.last().is_some_and(|l| l.as_str() >= name) {
            return Err(corrupt("names not strictly ascending"));
        }
        out.push(name.to_owned());
        rest = &tail[len..];
    }
    if !rest.is_empty() {
        return Err(corrupt("trailing bytes"));
    }
    Ok(out)
}

/// A pending transition to a new assignment, as [`Core`] sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    /// The transition's id.
    pub id: u64,
    /// Who proposed it (only the proposer commits it).
    pub proposer: String,
    /// The proposed member list; `None` if its record does not decode (another version's or
    /// a damaged write): no member votes on it, and any member aborts it.
    pub members: Option<Vec<String>>,
    /// When its proposer aborts it (Unix ms).
    pub deadline_ms: u64,
    /// The members that voted yes.
    pub yes: Vec<String>,
}

/// One read of the group's record, as [`Core`] sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupRecord {
    /// The committed epoch.
    pub epoch: u64,
    /// The member list the partitions are assigned among at `epoch`; `None` if its record
    /// does not decode: members keep what they hold, take nothing new, and propose a fresh
    /// list, whose commit replaces it.
    pub members: Option<Vec<String>>,
    /// The live members (leases not expired), sorted.
    pub live: Vec<String>,
    /// The pending transition.
    pub pending: Option<Pending>,
}

impl GroupRecord {
    /// The record of a rendezvous snapshot. An assignment that does not decode is read as
    /// `None` (see [`GroupRecord::members`] and [`Pending::members`]), so the group recovers
    /// from it instead of stalling; [`GroupRecord::damage`] says what was wrong.
    pub fn from_snapshot(s: &Snapshot) -> GroupRecord {
        let members = match &s.committed {
            Some(c) => decode_members(&c.stack).ok(),
            None => Some(Vec::new()),
        };
        let pending = s.transition.as_ref().map(|t| Pending {
            id: t.id,
            proposer: t.proposer.clone(),
            members: decode_members(&t.stack).ok(),
            deadline_ms: t.deadline_ms,
            yes: s
                .ballots
                .iter()
                .filter(|(_, b)| *b == Ballot::Yes)
                .map(|(m, _)| m.clone())
                .collect(),
        });
        let mut live: Vec<String> = s.members.iter().map(|m| m.id.clone()).collect();
        live.sort();
        live.dedup();
        GroupRecord {
            epoch: s.epoch(),
            members,
            live,
            pending,
        }
    }

    /// What in the record did not decode, for a log line; `None` if it all did.
    pub fn damage(&self) -> Option<&'static str> {
        if self.members.is_none() {
            Some("the committed assignment does not decode; proposing a fresh one")
        } else if self.pending.as_ref().is_some_and(|t| t.members.is_none()) {
            Some("the pending transition's assignment does not decode; aborting it")
        } else {
            None
        }
    }
}

/// The list a group proposes for `live` members: the first [`MAX_MEMBERS`] (sorted) names.
/// Members past it are live but own no partition until one of those leaves.
pub fn capped(live: &[String]) -> &[String] {
    &live[..live.len().min(MAX_MEMBERS)]
}

/// What the driver of a [`Core`] must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// We are not a live member (our lease ran out): we hold nothing now; join again.
    Rejoin,
    /// Start fetching these partitions from their committed positions.
    Acquire(Vec<i32>),
    /// Stop fetching these partitions without committing (the group gave them away without
    /// our vote: our lease had run out).
    Stop(Vec<i32>),
    /// Stop fetching these partitions, let what was fetched from them be acknowledged (at
    /// most [`GroupConfig::drain`]), commit their acknowledged positions synchronously, then
    /// call [`Core::released`] (which votes yes on transition `id`).
    Release {
        /// The transition that takes them.
        id: u64,
        /// The partitions.
        partitions: Vec<i32>,
    },
    /// Vote yes on transition `id`.
    Vote(u64),
    /// Propose `members` as the assignment of the epoch after `from_epoch`.
    Propose {
        /// The committed epoch.
        from_epoch: u64,
        /// The live members.
        members: Vec<String>,
    },
    /// Commit (or abort) transition `id`.
    Finish {
        /// The transition.
        id: u64,
        /// Commit, else abort.
        commit: bool,
    },
}

/// One member's side of the rebalancing protocol, without I/O: records of the group and the
/// time go in, [`Action`]s come out.
///
/// Invariant: the partitions a member holds (fetches, or is releasing) are always a subset of
/// what it owns at its epoch, and, while a transition is pending that it voted yes on, of what
/// it owns under the proposed list as well; it gains partitions only when it reads a new
/// committed epoch. Since a transition commits only with every live member's yes, two live
/// members never hold one partition.
#[derive(Clone, Debug)]
pub struct Core {
    pub(super) me: String,
    partitions: i32,
    epoch: u64,
    members: Vec<String>,
    /// Partitions we hold.
    held: BTreeSet<i32>,
    /// The transition we voted yes on.
    voted: Option<u64>,
    /// The transition we are releasing partitions for.
    releasing: Option<u64>,
    left: bool,
}

fn sorted(set: impl IntoIterator<Item = i32>) -> Vec<i32> {
    let mut v: Vec<i32> = set.into_iter().collect();
    v.sort_unstable();
    v
}

impl Core {
    /// The core of member `me` on a topic of `partitions` partitions, holding nothing.
    pub fn new(me: impl Into<String>, partitions: i32) -> Core {
        Core {
            me: me.into(),
            partitions,
            epoch: 0,
            members: Vec::new(),
            held: BTreeSet::new(),
            voted: None,
            releasing: None,
            left: false,
        }
    }

    /// The partitions held now.
    pub fn held(&self) -> &BTreeSet<i32> {
        &self.held
    }

    /// The epoch acted on.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    fn forget(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        if !self.held.is_empty() {
            out.push(Action::Stop(sorted(std::mem::take(&mut self.held))));
        }
        self.epoch = 0;
        self.members.clear();
        self.voted = None;
        self.releasing = None;
        out
    }

    /// Acts on a read of the group's record at `now_ms`.
    pub fn on_record(&mut self, rec: &GroupRecord, now_ms: u64) -> Vec<Action> {
        if self.left {
            return Vec::new();
        }
        if !rec.live.contains(&self.me) {
            let mut out = self.forget();
            out.push(Action::Rejoin);
            return out;
        }
        let mut out = Vec::new();
        if let Some(members) = &rec.members
            && (rec.epoch != self.epoch || *members != self.members)
        {
            self.epoch = rec.epoch;
            self.members = members.clone();
            self.voted = None;
            self.releasing = None;
            let want = owned(&self.members, &self.me, self.partitions);
            let stop: Vec<i32> = sorted(self.held.difference(&want).copied());
            if !stop.is_empty() {
                out.push(Action::Stop(stop));
            }
            let gain: Vec<i32> = sorted(want.difference(&self.held).copied());
            if !gain.is_empty() {
                out.push(Action::Acquire(gain));
            }
            self.held = want;
        }
        match rec.pending.as_ref().map(|t| (t, t.members.as_deref())) {
            // Nobody can vote on a list nobody can read: abort it, whoever proposed it.
            Some((t, None)) => out.push(Action::Finish {
                id: t.id,
                commit: false,
            }),
            Some((t, Some(proposed))) => {
                if self.voted == Some(t.id) && !t.yes.contains(&self.me) {
                    // Our yes is not in the record: the vote failed (or has not landed yet;
                    // a vote is idempotent), so it is sent again rather than left to the
                    // transition's deadline.
                    out.push(Action::Vote(t.id));
                } else if self.voted != Some(t.id) && self.releasing != Some(t.id) {
                    let keep = owned(proposed, &self.me, self.partitions);
                    let lose: Vec<i32> = sorted(self.held.difference(&keep).copied());
                    if lose.is_empty() {
                        self.voted = Some(t.id);
                        out.push(Action::Vote(t.id));
                    } else {
                        for p in &lose {
                            self.held.remove(p);
                        }
                        self.releasing = Some(t.id);
                        out.push(Action::Release {
                            id: t.id,
                            partitions: lose,
                        });
                    }
                }
                let all_yes = rec.live.iter().all(|m| t.yes.contains(m));
                // A proposer that died cannot commit: any member may (the store commits once).
                if t.proposer == self.me || (all_yes && !rec.live.contains(&t.proposer)) {
                    if all_yes {
                        out.push(Action::Finish {
                            id: t.id,
                            commit: true,
                        });
                    } else if now_ms > t.deadline_ms {
                        out.push(Action::Finish {
                            id: t.id,
                            commit: false,
                        });
                    }
                } else if now_ms > t.deadline_ms.saturating_add(ORPHAN_GRACE_MS) {
                    out.push(Action::Finish {
                        id: t.id,
                        commit: false,
                    });
                }
            }
            None => {
                // A transition we released partitions for ended at the same epoch: it was
                // aborted, and what we own is ours again.
                self.voted = None;
                self.releasing = None;
                // Under an unreadable committed list nothing new is taken: what the others
                // hold is unknown until a fresh list commits.
                if rec.members.is_some() {
                    let want = owned(&self.members, &self.me, self.partitions);
                    let gain: Vec<i32> = sorted(want.difference(&self.held).copied());
                    if !gain.is_empty() {
                        out.push(Action::Acquire(gain));
                        self.held = want;
                    }
                }
                let live = capped(&rec.live);
                if rec.members.as_deref() != Some(live) {
                    out.push(Action::Propose {
                        from_epoch: rec.epoch,
                        members: live.to_vec(),
                    });
                }
            }
        }
        out
    }

    /// The partitions of [`Action::Release`] for `id` are committed and no longer fetched:
    /// vote yes.
    pub fn released(&mut self, id: u64) -> Vec<Action> {
        if self.releasing != Some(id) || self.left {
            return Vec::new();
        }
        self.releasing = None;
        self.voted = Some(id);
        vec![Action::Vote(id)]
    }

    /// Partitions of an [`Action::Acquire`] that could not be opened: not held (taken again on
    /// a later read while no transition is pending).
    pub fn not_acquired(&mut self, partitions: &[i32]) {
        for p in partitions {
            self.held.remove(p);
        }
    }

    /// We leave: every held partition is to be stopped and committed; the core acts no more.
    pub fn leave(&mut self) -> Vec<i32> {
        self.left = true;
        sorted(std::mem::take(&mut self.held))
    }
}
