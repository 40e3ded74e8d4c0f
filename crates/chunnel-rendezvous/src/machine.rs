//! The participant's protocol logic as a sans-IO state machine: snapshots of the group record
//! and the time go in, the store operations and local switches to perform come out. The async
//! driver ([`crate::Participant`]) only reads the store, feeds the machine and carries out its
//! actions, so the logic is tested deterministically (`tests` below) without a store.
//!
//! The protocol (docs/wire.md §15):
//!
//! * **Join**: propose our first option with a compare-and-swap; if a stack is already
//!   committed, pick our first option compatible with it (the rules of point-to-point
//!   negotiation, the committed stack in the server's role) and join at its epoch, or fail with
//!   the mismatches. See [`join_choice`].
//! * **Transition** (a two-phase commit through the store): a proposer records a transition
//!   from the committed epoch; every member votes (yes = it can build the proposed stack, its
//!   policy allows it, and it has prepared it); the proposer commits once every *live* member
//!   voted yes, and aborts on the first no or at the deadline. Anyone aborts a transition whose
//!   deadline passed long ago (the proposer died).
//! * **Direct ballots** (docs/wire.md §15.4): a transition may name the proposer's ballot box;
//!   members then send their ballot there (the `direct` box of [`Action::Vote`]) and the
//!   proposer counts them ([`Machine::on_ballot`]) together with the ballots in the store:
//!   only those of live members it knows, with the transition's token, once per member. It
//!   commits when every live member said yes either way, attesting the yes ballots it
//!   received directly (the `attested` members of [`Action::Finish`]).
//! * **Switch**: a member that reads a higher committed epoch switches to it. Senders tag every
//!   message with their epoch, and receivers keep the previous epoch's stack for a while, so
//!   messages sent around the switch are decoded by the stack that encoded them.

use chunnel::negotiate::{ChunnelInfo, Mismatch, Pick, StackOption, choose};

use std::collections::BTreeMap;

use crate::ballot::{BallotBox, DirectBallot};
use crate::store::{Ballot, Committed, Member, News, Snapshot, Transition};

/// How long past a transition's deadline a member other than the proposer waits before it
/// aborts the transition itself.
pub const ORPHAN_GRACE_MS: u64 = 1_000;

/// A member's local decision on a proposed stack, beyond compatibility: `Err(reason)` refuses.
pub type Policy = std::sync::Arc<dyn Fn(&[ChunnelInfo]) -> Result<(), String> + Send + Sync>;

/// Which of our options fits a committed stack.
///
/// `Ok(i)`: our option `i` (preference order) is compatible. `Err`: the mismatch of each of our
/// options (the committed stack plays the server).
pub fn join_choice(
    committed: &[ChunnelInfo],
    ours: &[StackOption],
) -> Result<usize, Vec<Mismatch>> {
    let theirs = [StackOption {
        chunnels: committed.to_vec(),
        pick: Pick::default(),
    }];
    choose(&theirs, ours, ours.len().max(1)).map(|c| c.client_option)
}

/// What the driver must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// We are not a member any more (our lease ran out, e.g. while the store was down): join
    /// again at the committed epoch (or re-create the group with our current stack if the
    /// store lost it).
    Rejoin,
    /// Build the stack of our option `option` for epoch `epoch`, so messages of that epoch can
    /// be decoded (done before voting yes).
    Prepare {
        /// The epoch the stack is for.
        epoch: u64,
        /// Index into our offers.
        option: usize,
    },
    /// Record our ballot on transition `id`.
    Vote {
        /// The transition.
        id: u64,
        /// Our ballot.
        ballot: Ballot,
        /// The proposer's ballot box: send the ballot there as a datagram if we can (and write
        /// it to the store if the outcome does not come); `None`: write it to the store.
        direct: Option<BallotBox>,
        /// The epoch the transition starts from (for the datagram).
        from_epoch: u64,
    },
    /// End transition `id` (commit or abort).
    Finish {
        /// The transition.
        id: u64,
        /// Commit (else abort).
        commit: bool,
        /// Why it was aborted (empty on commit).
        reason: String,
        /// The live members whose yes we received directly (for
        /// [`Store::finish_attested`](crate::Store::finish_attested)).
        attested: Vec<String>,
    },
    /// The group committed epoch `epoch`: send with our option `option` from now on.
    Switch {
        /// The new epoch.
        epoch: u64,
        /// Index into our offers.
        option: usize,
    },
    /// The group moved to a stack we cannot build (we missed its transition): leave.
    Incompatible {
        /// The epoch.
        epoch: u64,
        /// Why, per option of ours.
        mismatches: Vec<Mismatch>,
    },
}

/// One participant's protocol state.
pub struct Machine {
    me: String,
    offers: Vec<StackOption>,
    policy: Option<Policy>,
    epoch: u64,
    option: usize,
    /// The transition we voted on and how, so we vote once.
    voted: Option<(u64, bool)>,
    /// Transitions we finished (the store may not show it yet): never finish twice.
    finished: Option<u64>,
    /// The ballots on our own pending transition that has a ballot box.
    tally: Option<Tally>,
}

/// A decision: commit, why not (empty on commit), the members whose yes came directly.
type Decision = (bool, String, Vec<String>);

/// The ballots a proposer counts on its transition with a ballot box.
#[derive(Debug)]
struct Tally {
    id: u64,
    from_epoch: u64,
    token: u128,
    /// The proposed stack (what our own successful commit installs).
    stack: bytes::Bytes,
    /// The live members as of our last read: only their ballots count.
    members: Vec<String>,
    /// Each member's ballot (the first one received counts), and whether it came directly
    /// (else we read it in the store).
    votes: BTreeMap<String, (Ballot, bool)>,
}

impl Tally {
    /// Commit (with the attested members), abort (with the reason), or wait.
    fn decide(&self) -> Option<Decision> {
        let live = |m: &String| self.members.contains(m);
        if let Some(why) = self.votes.iter().find_map(|(m, (b, _))| match b {
            Ballot::No(why) if live(m) => Some(why.clone()),
            _ => None,
        }) {
            return Some((false, format!("refused by {why}"), Vec::new()));
        }
        let all_yes = self
            .members
            .iter()
            .all(|m| matches!(self.votes.get(m), Some((Ballot::Yes, _))));
        all_yes.then(|| {
            let attested = self
                .votes
                .iter()
                .filter(|(m, (b, direct))| *direct && *b == Ballot::Yes && live(m))
                .map(|(m, _)| m.clone())
                .collect();
            (true, String::new(), attested)
        })
    }
}

impl std::fmt::Debug for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Machine")
            .field("me", &self.me)
            .field("epoch", &self.epoch)
            .field("option", &self.option)
            .field("voted", &self.voted)
            .finish_non_exhaustive()
    }
}

impl Machine {
    /// A member that joined at `epoch` using our option `option`.
    pub fn new(
        me: String,
        offers: Vec<StackOption>,
        policy: Option<Policy>,
        epoch: u64,
        option: usize,
    ) -> Machine {
        Machine {
            me,
            offers,
            policy,
            epoch,
            option,
            voted: None,
            finished: None,
            tally: None,
        }
    }

    /// The epoch we send at.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Our option in use.
    pub fn option(&self) -> usize {
        self.option
    }

    /// Our offers.
    pub fn offers(&self) -> &[StackOption] {
        &self.offers
    }

    /// A transition we propose from the current epoch to our option `option`.
    pub fn proposal(&self, id: u64, option: usize, deadline_ms: u64) -> Option<Transition> {
        let o = self.offers.get(option)?;
        Some(Transition {
            id,
            from_epoch: self.epoch,
            proposer: self.me.clone(),
            stack: chunnel_negotiate::wire::encode_stack(&o.chunnels),
            deadline_ms,
            ballot_box: None,
        })
    }

    /// The store recorded our proposal `t`; `members` are the live members as we last read
    /// them. With a ballot box, we count direct ballots on it from now on
    /// ([`Machine::on_ballot`]), and our own ballot at once, without a read: what to do then
    /// (prepare; finish if we are the only member, or refuse our own proposal). `None`
    /// without a ballot box: read the record to vote, as on any transition.
    pub fn proposed(&mut self, t: &Transition, members: &[Member]) -> Option<Vec<Action>> {
        self.tally = t
            .ballot_box
            .filter(|_| t.proposer == self.me && t.from_epoch == self.epoch)
            .map(|b| Tally {
                id: t.id,
                from_epoch: t.from_epoch,
                token: b.token,
                stack: t.stack.clone(),
                members: members.iter().map(|m| m.id.clone()).collect(),
                votes: BTreeMap::new(),
            });
        self.tally.as_ref()?;
        let mut out = Vec::new();
        self.cast(t, &mut out);
        self.decide_tally(&mut out);
        Some(out)
    }

    /// Pushes the tally's decision, if it has one and we have not finished.
    fn decide_tally(&mut self, out: &mut Vec<Action>) {
        let Some(tally) = &self.tally else {
            return;
        };
        if self.finished == Some(tally.id) {
            return;
        }
        if let Some((commit, reason, attested)) = tally.decide() {
            self.finished = Some(tally.id);
            out.push(Action::Finish {
                id: tally.id,
                commit,
                reason,
                attested,
            });
        }
    }

    /// The store applied our finish of our own transition `id` (counted in a tally): its
    /// commit installed the proposed stack at the next epoch, so we follow it without reading
    /// the record (pushes [`Action::Switch`], or [`Action::Incompatible`] for a stack we
    /// cannot build, which our own proposal never is).
    pub fn finished_own(&mut self, id: u64, commit: bool) -> Vec<Action> {
        let mut out = Vec::new();
        if let Some(tally) = self.tally.as_ref().filter(|t| t.id == id && commit) {
            let committed = Committed {
                epoch: tally.from_epoch + 1,
                stack: tally.stack.clone(),
            };
            self.follow(&committed, &mut out);
        }
        out
    }

    /// Feeds a ballot datagram received on our ballot box; returns the decision it brings, if
    /// any. Ignored: a ballot for another transition or with another token, from a member not
    /// live as of our last read, a member's second ballot, and any ballot once we decided.
    pub fn on_ballot(&mut self, b: &DirectBallot) -> Vec<Action> {
        let Some(tally) = &mut self.tally else {
            return Vec::new();
        };
        if b.id != tally.id
            || b.token != tally.token
            || b.from_epoch != tally.from_epoch
            || self.finished == Some(tally.id)
            || !tally.members.contains(&b.member)
            || tally.votes.contains_key(&b.member)
        {
            return Vec::new();
        }
        tally
            .votes
            .insert(b.member.clone(), (b.ballot.clone(), true));
        let mut out = Vec::new();
        self.decide_tally(&mut out);
        out
    }

    /// Our ballot on `t`: prepare, and vote (in our own tally if `t` is our proposal with a
    /// ballot box; else [`Action::Vote`]).
    fn cast(&mut self, t: &Transition, out: &mut Vec<Action>) {
        let (ballot, option) = self.judge(t);
        if let Some(option) = option {
            out.push(Action::Prepare {
                epoch: t.from_epoch + 1,
                option,
            });
        }
        self.voted = Some((t.id, ballot == Ballot::Yes));
        match &mut self.tally {
            Some(tally) if tally.id == t.id => {
                tally.votes.insert(self.me.clone(), (ballot, true));
            }
            _ => out.push(Action::Vote {
                id: t.id,
                ballot,
                direct: t.ballot_box,
                from_epoch: t.from_epoch,
            }),
        }
    }

    /// Whether we count the ballots on `id` ourselves (our proposal, with a ballot box).
    fn tallies(&self, id: u64) -> bool {
        self.tally.as_ref().is_some_and(|t| t.id == id)
    }

    /// The store did not commit transition `id` (its [`Store::finish`](crate::Store::finish)
    /// answered `false`): a live member had no yes ballot when the finish landed, e.g. one that
    /// joined after our last read. Decide it again on a later snapshot, with that member's
    /// ballot (or the deadline). Likewise when the finish failed (the store was unavailable or
    /// did not answer in time): a later snapshot that still shows `id` pending decides again
    /// (`finish` applies only while `id` is pending, so a finish that did apply, its answer
    /// lost, makes the retry a no-op); otherwise a transition whose every finish failed stayed
    /// pending for good, no later one could start, and its proposer waited forever.
    pub fn finish_refused(&mut self, id: u64) {
        if self.finished == Some(id) {
            self.finished = None;
        }
    }

    /// Re-synchronises after a rejoin at `epoch` with `option`.
    pub fn rejoined(&mut self, epoch: u64, option: usize) {
        self.epoch = epoch;
        self.option = option;
    }

    fn judge(&self, t: &Transition) -> (Ballot, Option<usize>) {
        let stack = match chunnel_negotiate::wire::decode_stack(&t.stack) {
            Ok(s) => s,
            Err(e) => return (Ballot::No(format!("undecodable stack: {e}")), None),
        };
        let option = match join_choice(&stack, &self.offers) {
            Ok(i) => i,
            Err(m) => {
                let why = m
                    .first()
                    .map_or_else(|| "no options".to_owned(), |m| m.to_string());
                return (
                    Ballot::No(format!("{}: incompatible: {why}", self.me)),
                    None,
                );
            }
        };
        if let Some(p) = &self.policy
            && let Err(why) = p(&stack)
        {
            return (Ballot::No(format!("{}: {why}", self.me)), None);
        }
        (Ballot::Yes, Some(option))
    }

    /// Switches to `committed` if it is a later epoch than ours (pushing
    /// [`Action::Switch`]), or pushes [`Action::Incompatible`] and returns `false` if we cannot
    /// build its stack.
    fn follow(&mut self, committed: &Committed, out: &mut Vec<Action>) -> bool {
        if committed.epoch <= self.epoch {
            return true;
        }
        match chunnel_negotiate::wire::decode_stack(&committed.stack)
            .map_err(|e| e.to_string())
            .and_then(|s| join_choice(&s, &self.offers).map_err(|m| format!("{m:?}")))
        {
            Ok(option) => {
                self.epoch = committed.epoch;
                self.option = option;
                out.push(Action::Switch {
                    epoch: self.epoch,
                    option,
                });
                true
            }
            Err(_) => {
                let mismatches = chunnel_negotiate::wire::decode_stack(&committed.stack)
                    .ok()
                    .and_then(|s| join_choice(&s, &self.offers).err())
                    .unwrap_or_default();
                out.push(Action::Incompatible {
                    epoch: committed.epoch,
                    mismatches,
                });
                false
            }
        }
    }

    /// Feeds a store's [`News`]: a change as the write that made it applied it. `Some` is
    /// what to do, in order, acting on the news alone (what [`Machine::on_snapshot`] would do
    /// with a read just after that write, less what only a full read can decide); `None`
    /// means the news is not enough (a transition from an epoch we have not seen committed):
    /// read the record.
    ///
    /// * A proposed transition from our epoch that we have not voted on: prepare and vote,
    ///   as on a snapshot showing it (membership is not checked: a ballot from a non-member
    ///   counts for nothing, and the lease renewal finds a lost membership).
    /// * A finished transition: follow the committed stack, as on a snapshot.
    ///
    /// Deciding (finishing) always takes a read, of every member and ballot.
    pub fn on_news(&mut self, news: &News) -> Option<Vec<Action>> {
        let mut out = Vec::new();
        match news {
            News::Proposed(t) => {
                if t.from_epoch != self.epoch {
                    return None;
                }
                if self.finished == Some(t.id) || self.voted.map(|(id, _)| id) == Some(t.id) {
                    return Some(out);
                }
                self.cast(t, &mut out);
            }
            News::Finished { committed, .. } => {
                self.follow(committed, &mut out);
            }
        }
        Some(out)
    }

    /// Feeds one snapshot read at `now_ms`; returns what to do, in order.
    pub fn on_snapshot(&mut self, snap: &Snapshot, now_ms: u64) -> Vec<Action> {
        let mut out = Vec::new();
        let Some(committed) = &snap.committed else {
            // The store lost the group (e.g. a Redis without persistence restarted).
            out.push(Action::Rejoin);
            return out;
        };
        if !self.follow(committed, &mut out) {
            return out;
        }
        if !snap.is_member(&self.me) {
            out.push(Action::Rejoin);
            return out;
        }
        let Some(t) = &snap.transition else {
            return out;
        };
        if t.from_epoch != self.epoch || self.finished == Some(t.id) {
            return out;
        }
        if self.voted.map(|(id, _)| id) != Some(t.id) {
            self.cast(t, &mut out);
            if !self.tallies(t.id) {
                // Our own ballot is not in this snapshot yet: decide on the next one.
                return out;
            }
        }
        let decided = match &mut self.tally {
            Some(tally) if tally.id == t.id => {
                // The members as read now, and their ballots in the store (a direct one,
                // received first, stays).
                tally.members = snap.members.iter().map(|m| m.id.clone()).collect();
                for (m, b) in &snap.ballots {
                    tally
                        .votes
                        .entry(m.clone())
                        .or_insert_with(|| (b.clone(), false));
                }
                tally.decide()
            }
            _ => {
                let live_no = snap.ballots.iter().find_map(|(m, b)| match b {
                    Ballot::No(why) if snap.is_member(m) => Some(why.clone()),
                    _ => None,
                });
                if let Some(why) = live_no {
                    Some((false, format!("refused by {why}"), Vec::new()))
                } else if snap.all_live_yes() {
                    Some((true, String::new(), Vec::new()))
                } else {
                    None
                }
            }
        };
        let finish = if t.proposer == self.me {
            if let Some(decided) = decided {
                Some(decided)
            } else if now_ms > t.deadline_ms {
                let voted = |id: &str| {
                    snap.ballots.iter().any(|(m, _)| m == id)
                        || self
                            .tally
                            .as_ref()
                            .is_some_and(|tl| tl.id == t.id && tl.votes.contains_key(id))
                };
                let silent: Vec<&str> = snap
                    .members
                    .iter()
                    .filter(|m| !voted(&m.id))
                    .map(|m| m.id.as_str())
                    .collect();
                Some((
                    false,
                    format!("timeout: no vote from {}", silent.join(", ")),
                    Vec::new(),
                ))
            } else {
                None
            }
        } else if now_ms > t.deadline_ms.saturating_add(ORPHAN_GRACE_MS) {
            Some((
                false,
                "timeout: the proposer did not finish".to_owned(),
                Vec::new(),
            ))
        } else {
            None
        };
        if let Some((commit, reason, attested)) = finish {
            self.finished = Some(t.id);
            out.push(Action::Finish {
                id: t.id,
                commit,
                reason,
                attested,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use bytes::Bytes;
    use chunnel::negotiate::Capability;

    use super::*;
    use crate::store::{Committed, Member, Outcome};

    fn option(label: &'static str, branch: u8) -> StackOption {
        StackOption {
            chunnels: vec![ChunnelInfo {
                id: Cow::Borrowed("test/order/1"),
                capabilities: vec![Capability::exact("ordering", [label])],
            }],
            pick: Pick::from_branches(vec![branch]),
        }
    }

    fn offers() -> Vec<StackOption> {
        vec![option("none", 0), option("total", 1)]
    }

    fn snap(epoch: u64, stack: &StackOption, members: &[&str]) -> Snapshot {
        Snapshot {
            committed: Some(Committed {
                epoch,
                stack: chunnel_negotiate::wire::encode_stack(&stack.chunnels),
            }),
            members: members
                .iter()
                .map(|m| Member {
                    id: (*m).into(),
                    addr: String::new(),
                })
                .collect(),
            ..Snapshot::default()
        }
    }

    #[test]
    fn join_choice_picks_our_first_compatible_option() {
        assert_eq!(join_choice(&option("total", 0).chunnels, &offers()), Ok(1));
        let err = join_choice(&option("causal", 0).chunnels, &offers()).unwrap_err();
        assert_eq!(err.len(), 2, "one mismatch per option of ours");
    }

    #[test]
    fn proposer_commits_when_every_live_member_voted_yes() {
        let mut a = Machine::new("a".into(), offers(), None, 1, 0);
        let t = a.proposal(7, 1, 10_000).unwrap();
        let mut s = snap(1, &option("none", 0), &["a", "b"]);
        s.transition = Some(t.clone());
        let acts = a.on_snapshot(&s, 0);
        assert_eq!(
            acts,
            vec![
                Action::Prepare {
                    epoch: 2,
                    option: 1
                },
                Action::Vote {
                    id: 7,
                    ballot: Ballot::Yes,
                    direct: None,
                    from_epoch: 1,
                }
            ]
        );
        s.ballots = vec![("a".into(), Ballot::Yes)];
        assert!(a.on_snapshot(&s, 1).is_empty(), "b has not voted");
        // A dead member's ballot does not count, nor does its silence.
        s.ballots.push(("b".into(), Ballot::Yes));
        s.ballots.push(("zombie".into(), Ballot::No("x".into())));
        assert_eq!(
            a.on_snapshot(&s, 2),
            vec![Action::Finish {
                id: 7,
                commit: true,
                reason: String::new(),
                attested: vec![],
            }]
        );
        assert!(a.on_snapshot(&s, 3).is_empty(), "finished twice");
        // The committed epoch arrives: switch to the proposed option.
        let s2 = snap(2, &option("total", 0), &["a", "b"]);
        assert_eq!(
            a.on_snapshot(&s2, 4),
            vec![Action::Switch {
                epoch: 2,
                option: 1
            }]
        );
    }

    #[test]
    fn news_votes_and_switches_without_a_read_and_asks_for_one_when_short() {
        let mut a = Machine::new("a".into(), offers(), None, 1, 0);
        let mut b = Machine::new("b".into(), offers(), None, 1, 0);
        let t = a.proposal(9, 1, 10_000).unwrap();
        let proposed = News::Proposed(t.clone());
        assert_eq!(
            b.on_news(&proposed),
            Some(vec![
                Action::Prepare {
                    epoch: 2,
                    option: 1
                },
                Action::Vote {
                    id: 9,
                    ballot: Ballot::Yes,
                    direct: None,
                    from_epoch: 1,
                }
            ])
        );
        // Once only, whether the proposal comes again as news or in a read.
        assert_eq!(b.on_news(&proposed), Some(vec![]));
        let mut s = snap(1, &option("none", 0), &["a", "b"]);
        s.transition = Some(t);
        assert!(b.on_snapshot(&s, 0).is_empty());
        // A proposal from an epoch we have not seen committed needs the record.
        let mut later = a.proposal(10, 1, 10_000).unwrap();
        later.from_epoch = 2;
        assert_eq!(a.on_news(&News::Proposed(later)), None);
        // A commit is followed from its news; an older one changes nothing.
        let finished = |epoch| News::Finished {
            outcome: Outcome {
                id: 9,
                committed: true,
            },
            committed: Committed {
                epoch,
                stack: chunnel_negotiate::wire::encode_stack(&option("total", 0).chunnels),
            },
        };
        assert_eq!(
            b.on_news(&finished(2)),
            Some(vec![Action::Switch {
                epoch: 2,
                option: 1
            }])
        );
        assert_eq!(b.on_news(&finished(2)), Some(vec![]));
        assert_eq!(b.epoch(), 2);
        // A committed stack we cannot build: leave, as on a read.
        let mut c = Machine::new("c".into(), vec![option("none", 0)], None, 1, 0);
        assert!(matches!(
            c.on_news(&finished(2)).as_deref(),
            Some([Action::Incompatible { epoch: 2, .. }])
        ));
    }

    #[test]
    fn a_refusal_or_the_deadline_aborts() {
        let mut a = Machine::new("a".into(), offers(), None, 1, 0);
        let t = a.proposal(9, 1, 100).unwrap();
        let mut s = snap(1, &option("none", 0), &["a", "b", "c"]);
        s.transition = Some(t);
        a.on_snapshot(&s, 0);
        s.ballots = vec![
            ("a".into(), Ballot::Yes),
            ("b".into(), Ballot::No("b: policy".into())),
        ];
        match &a.on_snapshot(&s, 1)[..] {
            [
                Action::Finish {
                    commit: false,
                    reason,
                    ..
                },
            ] => assert!(reason.contains("b: policy")),
            other => panic!("{other:?}"),
        }
        let mut a = Machine::new("a".into(), offers(), None, 1, 0);
        s.transition = Some(a.proposal(10, 1, 100).unwrap());
        a.on_snapshot(&s, 0);
        s.ballots = vec![("a".into(), Ballot::Yes)];
        assert!(a.on_snapshot(&s, 50).is_empty());
        match &a.on_snapshot(&s, 101)[..] {
            [
                Action::Finish {
                    commit: false,
                    reason,
                    ..
                },
            ] => {
                assert!(reason.contains("b, c"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn voters_judge_compatibility_and_policy() {
        let refuse: Policy = std::sync::Arc::new(|_| Err("not while busy".to_owned()));
        let mut b = Machine::new("b".into(), offers(), Some(refuse), 1, 0);
        let mut s = snap(1, &option("none", 0), &["a", "b", "c", "d"]);
        s.transition = Some(Transition {
            id: 3,
            from_epoch: 1,
            proposer: "a".into(),
            stack: chunnel_negotiate::wire::encode_stack(&option("total", 0).chunnels),
            deadline_ms: 100,
            ballot_box: None,
        });
        match &b.on_snapshot(&s, 0)[..] {
            [
                Action::Vote {
                    ballot: Ballot::No(why),
                    ..
                },
            ] => assert!(why.contains("busy")),
            other => panic!("{other:?}"),
        }
        let mut c = Machine::new("c".into(), vec![option("none", 0)], None, 1, 0);
        match &c.on_snapshot(&s, 0)[..] {
            [
                Action::Vote {
                    ballot: Ballot::No(why),
                    ..
                },
            ] => assert!(why.contains("incompatible")),
            other => panic!("{other:?}"),
        }
        // Garbage in the store is a refusal, not a panic.
        s.transition.as_mut().unwrap().stack = Bytes::from_static(b"\x01\xff");
        let mut d = Machine::new("d".into(), offers(), None, 1, 0);
        assert!(matches!(
            &d.on_snapshot(&s, 0)[..],
            [Action::Vote {
                ballot: Ballot::No(_),
                ..
            }]
        ));
        // A non-proposer aborts an orphaned transition only after the grace period.
        let mut e = Machine::new("e".into(), offers(), None, 1, 0);
        s.members.push(Member {
            id: "e".into(),
            addr: String::new(),
        });
        e.on_snapshot(&s, 0);
        assert!(e.on_snapshot(&s, 100 + ORPHAN_GRACE_MS).is_empty());
        assert!(matches!(
            &e.on_snapshot(&s, 101 + ORPHAN_GRACE_MS)[..],
            [Action::Finish { commit: false, .. }]
        ));
    }

    /// A proposer `a` with a ballot box, its transition 7 pending in `s` (members `members`),
    /// its own vote cast on the first read.
    fn direct_setup(members: &[&str]) -> (Machine, Snapshot, Transition) {
        let mut a = Machine::new("a".into(), offers(), None, 1, 0);
        let mut t = a.proposal(7, 1, 10_000).unwrap();
        t.ballot_box = Some(BallotBox {
            addr: "127.0.0.1:9".parse().unwrap(),
            token: 0xfeed,
        });
        let mut s = snap(1, &option("none", 0), members);
        // Our own ballot goes into the tally at once: no read, no store write, and (others
        // silent) no decision.
        assert_eq!(
            a.proposed(&t, &s.members),
            Some(vec![Action::Prepare {
                epoch: 2,
                option: 1
            }])
        );
        s.transition = Some(t.clone());
        assert!(a.on_snapshot(&s, 0).is_empty());
        (a, s, t)
    }

    fn direct(t: &Transition, member: &str, ballot: Ballot) -> DirectBallot {
        DirectBallot {
            token: t.ballot_box.unwrap().token,
            group: "g".into(),
            id: t.id,
            from_epoch: t.from_epoch,
            member: member.into(),
            ballot,
        }
    }

    fn commit(attested: &[&str]) -> Vec<Action> {
        vec![Action::Finish {
            id: 7,
            commit: true,
            reason: String::new(),
            attested: attested.iter().map(|m| (*m).to_owned()).collect(),
        }]
    }

    #[test]
    fn direct_ballots_count_once_per_live_member_with_the_token() {
        let (mut a, _, t) = direct_setup(&["a", "b", "c"]);
        // Wrong token, another transition, another epoch, an unknown member: ignored.
        let forged = DirectBallot {
            token: 0xbad,
            ..direct(&t, "b", Ballot::Yes)
        };
        assert!(a.on_ballot(&forged).is_empty());
        let stale = DirectBallot {
            id: 6,
            ..direct(&t, "c", Ballot::Yes)
        };
        assert!(a.on_ballot(&stale).is_empty());
        let old_epoch = DirectBallot {
            from_epoch: 0,
            ..direct(&t, "c", Ballot::Yes)
        };
        assert!(a.on_ballot(&old_epoch).is_empty());
        assert!(
            a.on_ballot(&direct(&t, "zed", Ballot::No("x".into())))
                .is_empty()
        );
        // b's yes counts once: its later no (a duplicate from b) changes nothing.
        assert!(a.on_ballot(&direct(&t, "b", Ballot::Yes)).is_empty());
        assert!(
            a.on_ballot(&direct(&t, "b", Ballot::No("late".into())))
                .is_empty()
        );
        // c's yes completes the live members: commit, attesting the direct yes ballots.
        assert_eq!(
            a.on_ballot(&direct(&t, "c", Ballot::Yes)),
            commit(&["a", "b", "c"])
        );
        // Decided: nothing more, whatever arrives.
        assert!(a.on_ballot(&direct(&t, "c", Ballot::Yes)).is_empty());
    }

    #[test]
    fn a_direct_no_aborts_and_a_refused_finish_decides_again() {
        let (mut a, mut s, t) = direct_setup(&["a", "b", "c"]);
        match &a.on_ballot(&direct(&t, "c", Ballot::No("c: policy".into())))[..] {
            [
                Action::Finish {
                    commit: false,
                    reason,
                    attested,
                    ..
                },
            ] => {
                assert!(reason.contains("c: policy"), "{reason}");
                assert!(attested.is_empty());
            }
            other => panic!("{other:?}"),
        }
        // A finish the store refused is decided again on the next read (c's no stands).
        a.finish_refused(7);
        assert!(matches!(
            &a.on_snapshot(&s, 1)[..],
            [Action::Finish { commit: false, .. }]
        ));
        // Without any ballot from b, the deadline aborts and names the silent member only.
        let (mut a, _, _) = direct_setup(&["a", "b", "c"]);
        a.on_ballot(&direct(&t, "c", Ballot::Yes));
        s.transition.as_mut().unwrap().deadline_ms = 100;
        match &a.on_snapshot(&s, 101)[..] {
            [
                Action::Finish {
                    commit: false,
                    reason,
                    ..
                },
            ] => assert!(reason.ends_with("no vote from b"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn direct_and_store_ballots_mix_and_only_live_members_count() {
        // b votes in the store (no ballot socket), c directly; d leaves before voting.
        let (mut a, mut s, t) = direct_setup(&["a", "b", "c", "d"]);
        assert!(a.on_ballot(&direct(&t, "c", Ballot::Yes)).is_empty());
        s.ballots = vec![("b".into(), Ballot::Yes)];
        assert!(a.on_snapshot(&s, 1).is_empty(), "d is live and silent");
        s.members.retain(|m| m.id != "d");
        // b's yes is in the store: only a and c are attested.
        assert_eq!(a.on_snapshot(&s, 2), commit(&["a", "c"]));

        // A member we did not know at the proposal: its ballot is ignored until a read shows
        // it live; then it counts.
        let (mut a, mut s, t) = direct_setup(&["a", "b"]);
        assert!(a.on_ballot(&direct(&t, "late", Ballot::Yes)).is_empty());
        s.members.push(Member {
            id: "late".into(),
            addr: String::new(),
        });
        s.members.sort_by(|x, y| x.id.cmp(&y.id));
        assert!(a.on_snapshot(&s, 1).is_empty());
        assert!(a.on_ballot(&direct(&t, "b", Ballot::Yes)).is_empty());
        assert_eq!(
            a.on_ballot(&direct(&t, "late", Ballot::Yes)),
            commit(&["a", "b", "late"])
        );
    }

    #[test]
    fn members_vote_to_the_ballot_box_and_a_proposal_without_one_counts_nothing() {
        let (_, s, t) = direct_setup(&["a", "b"]);
        let mut b = Machine::new("b".into(), offers(), None, 1, 0);
        assert_eq!(
            b.on_snapshot(&s, 0),
            vec![
                Action::Prepare {
                    epoch: 2,
                    option: 1
                },
                Action::Vote {
                    id: 7,
                    ballot: Ballot::Yes,
                    direct: t.ballot_box,
                    from_epoch: 1,
                }
            ]
        );
        // Without a ballot box, `proposed` starts no tally: datagrams count for nothing.
        let mut a = Machine::new("a".into(), offers(), None, 1, 0);
        let plain = a.proposal(7, 1, 10_000).unwrap();
        assert_eq!(a.proposed(&plain, &s.members), None);
        assert!(a.on_ballot(&direct(&t, "b", Ballot::Yes)).is_empty());
    }

    #[test]
    fn a_lone_proposer_decides_at_once_and_follows_its_own_commit() {
        let mut a = Machine::new("a".into(), offers(), None, 1, 0);
        let mut t = a.proposal(7, 1, 10_000).unwrap();
        t.ballot_box = Some(BallotBox {
            addr: "127.0.0.1:9".parse().unwrap(),
            token: 1,
        });
        let members = snap(1, &option("none", 0), &["a"]).members;
        let mut want = vec![Action::Prepare {
            epoch: 2,
            option: 1,
        }];
        want.extend(commit(&["a"]));
        assert_eq!(a.proposed(&t, &members), Some(want));
        // An abort, or another transition, installs nothing.
        assert!(a.finished_own(7, false).is_empty());
        assert!(a.finished_own(8, true).is_empty());
        assert_eq!(
            a.finished_own(7, true),
            vec![Action::Switch {
                epoch: 2,
                option: 1
            }]
        );
        assert_eq!(a.epoch(), 2);
    }

    #[test]
    fn a_lost_lease_or_a_lost_group_means_rejoin() {
        let mut a = Machine::new("a".into(), offers(), None, 1, 0);
        assert_eq!(
            a.on_snapshot(&snap(1, &option("none", 0), &["b"]), 0),
            vec![Action::Rejoin]
        );
        assert_eq!(a.on_snapshot(&Snapshot::default(), 0), vec![Action::Rejoin]);
        let bad = snap(2, &option("causal", 0), &["a"]);
        assert!(matches!(
            &a.on_snapshot(&bad, 0)[..],
            [Action::Incompatible { epoch: 2, .. }]
        ));
    }
}
