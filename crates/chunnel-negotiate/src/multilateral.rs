//! The two-phase-commit machine of multilateral reconfiguration, sans-IO: bytes and time in
//! ([`Multilateral::handle_message`], [`Multilateral::handle_timeout`], each given `now`);
//! messages to send, a timer and [`Event`]s out ([`Multilateral::poll_transmit`],
//! [`Multilateral::poll_timeout`], [`Multilateral::poll_event`]). No clock, socket or task
//! inside: the protocol and its guarantees are described in [`crate::commit`], whose
//! [`Coordinator`](crate::commit::Coordinator) drives this machine on a connection.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel::negotiate::check_compatible;
use chunnel::{Pick, StackOption};

use crate::wire::{Control, Prepare, Refusal, Tag, Txn, VERSION, Verdict, Vote, decode_control};

/// Who may start a switch, and how long a proposal waits for the vote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// This end may propose switches.
    pub may_initiate: bool,
    /// This end votes on the peer's proposals; if false it refuses them all
    /// ([`Refusal::NotAllowed`]).
    pub peer_may_initiate: bool,
    /// How long the initiator waits for the vote before it aborts. The vote travels in-band:
    /// it waits behind the data already queued at both ends.
    pub vote_timeout: Duration,
    /// The prepare is sent again after this long without a vote; likewise a follower that
    /// voted yes sends its vote again after this long without a decision (the initiator
    /// answers a vote on a transaction it aborted with its `ABORT` again), and an initiator
    /// that committed sends `COMMIT` again after this long without `DONE` (a follower that
    /// already switched on it answers with `DONE` again, and does not switch twice). For bases
    /// that may lose messages; harmless on lossless ones: repeats get the same answer, and
    /// answers to repeats are ignored.
    pub resend_after: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            may_initiate: true,
            peer_may_initiate: true,
            vote_timeout: Duration::from_secs(2),
            resend_after: Duration::from_millis(100),
        }
    }
}

/// Why a transaction ended without a switch, other than contention (that is
/// [`Contention`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AbortReason {
    /// The peer voted no: policy ([`Refusal::NotAllowed`]) or no compatible option
    /// ([`Refusal::Incompatible`]). A peer busy with another switch ([`Refusal::Busy`]) is
    /// [`Contention::Peer`] instead.
    Refused {
        /// Its reason.
        reason: Refusal,
        /// Its message.
        message: String,
    },
    /// No vote before [`Policy::vote_timeout`].
    Timeout,
    /// The initiator aborted (follower side).
    PeerAborted,
}

/// Which switch was in the way of one that ended [contended](crate::commit::Outcome::Contended). Every case
/// means the same to the caller: nothing was switched by this proposal; retry it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Contention {
    /// This end was already in a switch (its own, or one of its peer's that it follows) when
    /// the proposal was made: nothing was sent.
    Local,
    /// The peer was in another switch and refused the proposal (its vote:
    /// [`Refusal::Busy`]).
    Peer {
        /// The peer's explanation.
        message: String,
    },
    /// Both ends proposed at once and the peer's proposal won (the larger transaction id):
    /// this end aborted its own and follows the peer's.
    Superseded,
}

/// What the driver must do or know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Switch this end's stack to `pick` now. At the switch point, after the last message of
    /// the old stack and before the first of the new one, send `marker` (the initiator's
    /// `COMMIT`, the follower's `DONE`).
    Switch {
        /// The transaction.
        txn: u64,
        /// The pick of this end's tree to switch to.
        pick: Pick,
        /// The message that marks this end's switch point.
        marker: Bytes,
    },
    /// The peer's switch point arrived: messages received after this one come from its new
    /// stack. (The follower gets this with its [`Event::Switch`]: the commit is both.)
    PeerSwitched {
        /// The transaction.
        txn: u64,
    },
    /// The transaction ended with nothing switched.
    Aborted {
        /// The transaction.
        txn: u64,
        /// Why.
        reason: AbortReason,
    },
    /// This end's transaction ended with nothing switched because another switch was in
    /// progress (see [`Contention`]): retry.
    Contended {
        /// The transaction.
        txn: u64,
        /// Which switch was in the way.
        contention: Contention,
    },
    /// This end refused the peer's proposal (for the operator's log).
    Refused {
        /// The peer's transaction.
        txn: u64,
        /// Why.
        reason: Refusal,
        /// The explanation sent to the peer.
        message: String,
    },
}

/// Why [`Multilateral::propose`] did not start a transaction.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProposeError {
    /// The policy does not let this end start switches.
    #[error("this end is not allowed to start a switch")]
    NotAllowed,
    /// Another transaction is in progress. ([`Coordinator::switch`](crate::commit::Coordinator::switch) reports this as
    /// [`Outcome::Contended`](crate::commit::Outcome::Contended) with [`Contention::Local`], never as an error.)
    #[error("another switch is in progress")]
    Busy,
    /// The option is not one of this end's own options.
    #[error("the proposed stack is not one of this end's options")]
    NotAnOption,
}

#[derive(Debug)]
enum State {
    Idle,
    /// Initiator: PREPARE sent, waiting for the vote.
    Preparing {
        txn: u64,
        pick: Pick,
        prepare: Bytes,
        resend_at: Instant,
        deadline: Instant,
    },
    /// Initiator: switched and sent COMMIT; waiting for the follower's DONE (COMMIT is sent
    /// again at `resend_at`).
    Committed {
        txn: u64,
        resend_at: Instant,
    },
    /// Follower: voted yes, waiting for the decision (the vote is sent again at `resend_at`).
    Voted {
        txn: u64,
        pick: Pick,
        vote: Bytes,
        resend_at: Instant,
    },
}

/// How a transaction this end took part in ended (kept for the last [`HISTORY`] of them, so
/// that a late or repeated message of a finished transaction is never acted on twice).
#[derive(Debug)]
enum Finished {
    /// This end refused the peer's proposal with this vote (a repeated prepare gets it again).
    Refused(Bytes),
    /// This end followed the peer's proposal: voted yes, then switched (`true`: a repeated
    /// COMMIT gets DONE again) or got ABORT (`false`).
    Followed { switched: bool },
    /// This end proposed it: switched and got DONE (`true`), or ended it without a switch
    /// (`false`: a yes vote on it gets ABORT again).
    Proposed { committed: bool },
}

/// How many finished transactions an end remembers. Transaction ids are random, so an old one
/// is never reused; a message of a transaction older than this many is not recognised.
const HISTORY: usize = 8;

/// One end of a connection's reconfiguration protocol. Bytes and time in; messages to send,
/// a timer and [`Event`]s out.
#[derive(Debug)]
pub struct Multilateral {
    offers: Vec<StackOption>,
    policy: Policy,
    state: State,
    /// The last transactions this end finished (refused, followed or proposed), newest last:
    /// a repeated or late message of one of them is answered from here, never acted on.
    finished: VecDeque<(u64, Finished)>,
    transmit: VecDeque<Bytes>,
    events: VecDeque<Event>,
}

impl Multilateral {
    /// One end whose stack can switch among `offers` (its own options, as negotiation lists
    /// them), following `policy`.
    pub fn new(offers: Vec<StackOption>, policy: Policy) -> Self {
        Multilateral {
            offers,
            policy,
            state: State::Idle,
            finished: VecDeque::new(),
            transmit: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    fn finish(&mut self, txn: u64, how: Finished) {
        if self.finished.len() == HISTORY {
            self.finished.pop_front();
        }
        self.finished.push_back((txn, how));
    }

    fn finished(&self, txn: u64) -> Option<&Finished> {
        self.finished
            .iter()
            .rev()
            .find(|(t, _)| *t == txn)
            .map(|(_, f)| f)
    }

    /// Whether no transaction is in progress.
    pub fn is_idle(&self) -> bool {
        matches!(self.state, State::Idle)
    }

    /// Proposes to switch both ends, this end to its option whose pick is `pick`. `txn` must
    /// be unpredictable (it also breaks ties between concurrent proposals).
    pub fn propose(&mut self, pick: &Pick, txn: u64, now: Instant) -> Result<(), ProposeError> {
        if !self.policy.may_initiate {
            return Err(ProposeError::NotAllowed);
        }
        if !self.is_idle() {
            return Err(ProposeError::Busy);
        }
        let option = self
            .offers
            .iter()
            .find(|o| &o.pick == pick)
            .ok_or(ProposeError::NotAnOption)?
            .clone();
        let prepare = Prepare {
            version: VERSION,
            txn,
            option,
        }
        .encode();
        self.transmit.push_back(prepare.clone());
        self.state = State::Preparing {
            txn,
            pick: pick.clone(),
            prepare,
            resend_at: now + self.policy.resend_after,
            deadline: now + self.policy.vote_timeout,
        };
        Ok(())
    }

    /// Handles one received reconfiguration message (tag included). Anything that does not
    /// decode, or does not belong to the current transaction, is ignored.
    pub fn handle_message(&mut self, msg: &[u8], now: Instant) {
        let Ok(c) = decode_control(msg) else { return };
        match c {
            Control::Prepare(p) => self.on_prepare(p, now),
            Control::Vote(v) => self.on_vote(v, now),
            Control::Commit(t) => self.on_commit(t),
            Control::Abort(t) => {
                if matches!(self.state, State::Voted { txn, .. } if txn == t.txn) {
                    self.state = State::Idle;
                    self.finish(t.txn, Finished::Followed { switched: false });
                    self.events.push_back(Event::Aborted {
                        txn: t.txn,
                        reason: AbortReason::PeerAborted,
                    });
                }
            }
            Control::Done(t) => {
                if matches!(self.state, State::Committed { txn, .. } if txn == t.txn) {
                    self.state = State::Idle;
                    self.finish(t.txn, Finished::Proposed { committed: true });
                    self.events.push_back(Event::PeerSwitched { txn: t.txn });
                }
            }
            // Negotiation messages are not ours.
            _ => {}
        }
    }

    fn on_prepare(&mut self, p: Prepare, now: Instant) {
        // A repeated prepare of a finished transaction (our vote was lost or is on its way, or
        // the network reordered or duplicated it): a refusal gets the same answer; a
        // transaction this end followed to its end is over, and is not voted on again.
        match self.finished(p.txn) {
            Some(Finished::Refused(vote)) => {
                self.transmit.push_back(vote.clone());
                return;
            }
            Some(_) => return,
            None => {}
        }
        if let State::Voted { txn, vote, .. } = &self.state
            && *txn == p.txn
        {
            self.transmit.push_back(vote.clone());
            return;
        }
        let refuse = |reason, mismatches, message: String| Vote {
            version: VERSION,
            txn: p.txn,
            verdict: Verdict::No {
                reason,
                mismatches,
                message,
            },
        };
        let vote = match &self.state {
            _ if !self.policy.peer_may_initiate => refuse(
                Refusal::NotAllowed,
                Vec::new(),
                "this end does not accept switches started by its peer".into(),
            ),
            // Concurrent proposals: the larger txn wins.
            State::Preparing { txn, .. } if *txn > p.txn => refuse(
                Refusal::Busy,
                Vec::new(),
                "a concurrent switch of this end takes precedence".into(),
            ),
            State::Preparing { txn, .. } => {
                let txn = *txn;
                self.events.push_back(Event::Contended {
                    txn,
                    contention: Contention::Superseded,
                });
                self.transmit.push_back(txn_msg(Tag::Abort, txn));
                self.state = State::Idle;
                self.finish(txn, Finished::Proposed { committed: false });
                self.decide(&p)
            }
            State::Idle => self.decide(&p),
            State::Committed { .. } | State::Voted { .. } => refuse(
                Refusal::Busy,
                Vec::new(),
                "another switch is in progress".into(),
            ),
        };
        let bytes = vote.encode();
        match vote.verdict {
            Verdict::Yes { pick, .. } => {
                self.state = State::Voted {
                    txn: p.txn,
                    pick,
                    vote: bytes.clone(),
                    resend_at: now + self.policy.resend_after,
                };
            }
            Verdict::No {
                reason, message, ..
            } => {
                self.events.push_back(Event::Refused {
                    txn: p.txn,
                    reason,
                    message,
                });
                self.finish(p.txn, Finished::Refused(bytes.clone()));
            }
        }
        self.transmit.push_back(bytes);
    }

    /// The own option with the proposal's pick if it is compatible with the proposal (peers
    /// with the same select tree switch to the same branch), else the first compatible one
    /// in this end's preference order, by the negotiation rule (this end in the server's
    /// place).
    fn decide(&self, p: &Prepare) -> Vote {
        let mut mismatches = Vec::new();
        let same = self.offers.iter().position(|o| o.pick == p.option.pick);
        let order = same
            .into_iter()
            .chain((0..self.offers.len()).filter(|i| Some(*i) != same));
        for si in order {
            let mine = &self.offers[si];
            match check_compatible(&mine.chunnels, &p.option.chunnels, si as u16, 0) {
                Ok(()) => {
                    return Vote {
                        version: VERSION,
                        txn: p.txn,
                        verdict: Verdict::Yes {
                            pick: mine.pick.clone(),
                            stack: mine.chunnels.clone(),
                        },
                    };
                }
                Err(m) if mismatches.len() < 16 => mismatches.push(m),
                Err(_) => {}
            }
        }
        let message = match mismatches.first() {
            Some(m) => format!("no option of this end is compatible with the proposal: {m}"),
            None => "this end has no options to switch to".into(),
        };
        Vote {
            version: VERSION,
            txn: p.txn,
            verdict: Verdict::No {
                reason: Refusal::Incompatible,
                mismatches,
                message,
            },
        }
    }

    fn on_vote(&mut self, v: Vote, now: Instant) {
        let State::Preparing { txn, pick, .. } = &self.state else {
            // A yes on a transaction this end proposed and ended without a switch (the
            // follower's repeat: the ABORT was lost or is on its way): the decision again.
            if matches!(v.verdict, Verdict::Yes { .. })
                && matches!(
                    self.finished(v.txn),
                    Some(Finished::Proposed { committed: false })
                )
            {
                self.transmit.push_back(txn_msg(Tag::Abort, v.txn));
            }
            return;
        };
        if *txn != v.txn {
            return;
        }
        let (txn, pick) = (*txn, pick.clone());
        match v.verdict {
            Verdict::Yes { .. } => {
                self.state = State::Committed {
                    txn,
                    resend_at: now + self.policy.resend_after,
                };
                self.events.push_back(Event::Switch {
                    txn,
                    pick,
                    marker: txn_msg(Tag::Commit, txn),
                });
            }
            Verdict::No {
                reason: Refusal::Busy,
                message,
                ..
            } => {
                self.state = State::Idle;
                self.finish(txn, Finished::Proposed { committed: false });
                self.events.push_back(Event::Contended {
                    txn,
                    contention: Contention::Peer { message },
                });
            }
            Verdict::No {
                reason, message, ..
            } => {
                self.state = State::Idle;
                self.finish(txn, Finished::Proposed { committed: false });
                self.events.push_back(Event::Aborted {
                    txn,
                    reason: AbortReason::Refused { reason, message },
                });
            }
        }
    }

    fn on_commit(&mut self, t: Txn) {
        let State::Voted { txn, pick, .. } = &self.state else {
            // A repeated COMMIT of a transaction this end switched on (its DONE was lost or
            // is on its way): DONE again, outside any switch point; no second switch.
            if matches!(
                self.finished(t.txn),
                Some(Finished::Followed { switched: true })
            ) {
                self.transmit.push_back(txn_msg(Tag::Done, t.txn));
            }
            return;
        };
        if *txn != t.txn {
            return;
        }
        let (txn, pick) = (*txn, pick.clone());
        self.state = State::Idle;
        self.finish(txn, Finished::Followed { switched: true });
        self.events.push_back(Event::PeerSwitched { txn });
        self.events.push_back(Event::Switch {
            txn,
            pick,
            marker: txn_msg(Tag::Done, txn),
        });
    }

    /// When [`Multilateral::handle_timeout`] should be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            State::Preparing {
                resend_at,
                deadline,
                ..
            } => Some((*resend_at).min(*deadline)),
            State::Committed { resend_at, .. } | State::Voted { resend_at, .. } => Some(*resend_at),
            State::Idle => None,
        }
    }

    /// Time passed: resend the prepare, or give up on the vote; resend the vote (follower
    /// waiting for the decision) or the COMMIT (initiator waiting for DONE).
    pub fn handle_timeout(&mut self, now: Instant) {
        let resend_after = self.policy.resend_after;
        match &mut self.state {
            State::Preparing { txn, deadline, .. } if now >= *deadline => {
                let txn = *txn;
                self.transmit.push_back(txn_msg(Tag::Abort, txn));
                self.state = State::Idle;
                self.finish(txn, Finished::Proposed { committed: false });
                self.events.push_back(Event::Aborted {
                    txn,
                    reason: AbortReason::Timeout,
                });
            }
            State::Preparing {
                prepare, resend_at, ..
            } if now >= *resend_at => {
                self.transmit.push_back(prepare.clone());
                *resend_at = now + resend_after;
            }
            State::Voted {
                vote, resend_at, ..
            } if now >= *resend_at => {
                self.transmit.push_back(vote.clone());
                *resend_at = now + resend_after;
            }
            State::Committed { txn, resend_at } if now >= *resend_at => {
                self.transmit.push_back(txn_msg(Tag::Commit, *txn));
                *resend_at = now + resend_after;
            }
            _ => {}
        }
    }

    /// The next message to send (tag included), in order.
    pub fn poll_transmit(&mut self) -> Option<Bytes> {
        self.transmit.pop_front()
    }

    /// The next event, in order.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }
}

/// A `COMMIT`, `ABORT` or `DONE` message for `txn`.
pub(crate) fn txn_msg(tag: Tag, txn: u64) -> Bytes {
    Txn {
        version: VERSION,
        txn,
    }
    .encode(tag)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chunnel::negotiate::ChunnelInfo;
    use chunnel::{Capability, StackOption};

    fn option(pick: u8, format: &'static str) -> StackOption {
        StackOption {
            chunnels: vec![ChunnelInfo {
                id: format.into(),
                capabilities: vec![Capability::exact("serialize", [format])],
            }],
            pick: Pick::from_slice(&[pick]),
        }
    }

    fn both() -> Vec<StackOption> {
        vec![option(0, "json"), option(1, "bincode")]
    }

    /// Moves every queued message from `from` to `to`; returns how many.
    fn deliver(from: &mut Multilateral, to: &mut Multilateral, now: Instant) -> usize {
        let mut n = 0;
        while let Some(m) = from.poll_transmit() {
            to.handle_message(&m, now);
            n += 1;
        }
        n
    }

    fn events(m: &mut Multilateral) -> Vec<Event> {
        std::iter::from_fn(|| m.poll_event()).collect()
    }

    #[test]
    fn both_switch_with_markers_in_order() {
        let now = Instant::now();
        let (mut a, mut b) = (
            Multilateral::new(both(), Policy::default()),
            Multilateral::new(both(), Policy::default()),
        );
        a.propose(&Pick::from_branches(vec![1]), 7, now).unwrap();
        assert_eq!(deliver(&mut a, &mut b, now), 1);
        assert!(
            events(&mut b).is_empty(),
            "the follower waits for the decision"
        );
        assert_eq!(deliver(&mut b, &mut a, now), 1);
        let ev = events(&mut a);
        let [
            Event::Switch {
                txn: 7,
                pick,
                marker,
            },
        ] = &ev[..]
        else {
            panic!("{ev:?}")
        };
        assert_eq!(pick.branches(), &[1]);
        assert_eq!(marker[0], Tag::Commit as u8);
        // The driver sends the marker at its switch point.
        b.handle_message(marker, now);
        let ev = events(&mut b);
        assert!(
            matches!(&ev[..], [Event::PeerSwitched { txn: 7 }, Event::Switch { txn: 7, pick, marker }]
            if pick.branches() == [1] && marker[0] == Tag::Done as u8)
        );
        let Event::Switch { marker, .. } = &ev[1] else {
            unreachable!()
        };
        a.handle_message(marker, now);
        assert_eq!(events(&mut a), [Event::PeerSwitched { txn: 7 }]);
        assert!(a.is_idle() && b.is_idle());
    }

    #[test]
    fn refusal_and_policy_leave_both_idle() {
        let now = Instant::now();
        // Incompatible: the follower has only json.
        let mut a = Multilateral::new(both(), Policy::default());
        let mut b = Multilateral::new(vec![option(0, "json")], Policy::default());
        a.propose(&Pick::from_branches(vec![1]), 1, now).unwrap();
        deliver(&mut a, &mut b, now);
        deliver(&mut b, &mut a, now);
        assert!(
            matches!(&events(&mut a)[..], [Event::Aborted { txn: 1, reason: AbortReason::Refused { reason: Refusal::Incompatible, message } }]
            if message.contains("serialize"))
        );
        assert!(matches!(
            &events(&mut b)[..],
            [Event::Refused {
                reason: Refusal::Incompatible,
                ..
            }]
        ));

        // Not allowed: the follower does not take switches from its peer.
        let mut b = Multilateral::new(
            both(),
            Policy {
                peer_may_initiate: false,
                ..Policy::default()
            },
        );
        a.propose(&Pick::from_branches(vec![1]), 2, now).unwrap();
        deliver(&mut a, &mut b, now);
        deliver(&mut b, &mut a, now);
        assert!(matches!(
            &events(&mut a)[..],
            [Event::Aborted {
                reason: AbortReason::Refused {
                    reason: Refusal::NotAllowed,
                    ..
                },
                ..
            }]
        ));
        // And an end that may not initiate cannot propose.
        assert_eq!(
            b.propose(&Pick::from_branches(vec![0]), 3, now),
            Ok(()),
            "b may initiate"
        );
        let mut c = Multilateral::new(
            both(),
            Policy {
                may_initiate: false,
                ..Policy::default()
            },
        );
        assert_eq!(
            c.propose(&Pick::from_branches(vec![0]), 4, now),
            Err(ProposeError::NotAllowed)
        );
    }

    #[test]
    fn silence_times_out_and_aborts() {
        let t0 = Instant::now();
        let p = Policy::default();
        let mut a = Multilateral::new(both(), p);
        a.propose(&Pick::from_branches(vec![1]), 9, t0).unwrap();
        assert_eq!(a.poll_transmit().map(|m| m[0]), Some(Tag::Prepare as u8));
        let t1 = a.poll_timeout().unwrap();
        assert_eq!(t1, t0 + p.resend_after);
        a.handle_timeout(t1);
        assert_eq!(
            a.poll_transmit().map(|m| m[0]),
            Some(Tag::Prepare as u8),
            "resent"
        );
        a.handle_timeout(t0 + p.vote_timeout);
        assert_eq!(a.poll_transmit().map(|m| m[0]), Some(Tag::Abort as u8));
        assert_eq!(
            events(&mut a),
            [Event::Aborted {
                txn: 9,
                reason: AbortReason::Timeout
            }]
        );
        assert!(a.is_idle() && a.poll_timeout().is_none());
    }

    #[test]
    fn a_commit_without_a_yes_vote_switches_nothing() {
        let now = Instant::now();
        let mut b = Multilateral::new(both(), Policy::default());
        let commit = txn_msg(Tag::Commit, 5);
        b.handle_message(&commit, now);
        assert!(events(&mut b).is_empty());
        // Voted yes on txn 6; a commit for txn 5 still does nothing.
        let prepare = Prepare {
            version: VERSION,
            txn: 6,
            option: option(1, "bincode"),
        }
        .encode();
        b.handle_message(&prepare, now);
        b.handle_message(&commit, now);
        assert!(events(&mut b).is_empty());
        // An abort of txn 6 ends it; a late commit of 6 then does nothing.
        b.handle_message(&txn_msg(Tag::Abort, 6), now);
        assert!(matches!(
            &events(&mut b)[..],
            [Event::Aborted {
                txn: 6,
                reason: AbortReason::PeerAborted
            }]
        ));
        b.handle_message(&txn_msg(Tag::Commit, 6), now);
        assert!(events(&mut b).is_empty());
    }

    #[test]
    fn concurrent_proposals_the_larger_txn_wins() {
        let now = Instant::now();
        let (mut a, mut b) = (
            Multilateral::new(both(), Policy::default()),
            Multilateral::new(both(), Policy::default()),
        );
        a.propose(&Pick::from_branches(vec![1]), 100, now).unwrap();
        b.propose(&Pick::from_branches(vec![1]), 200, now).unwrap();
        let (pa, pb) = (a.poll_transmit().unwrap(), b.poll_transmit().unwrap());
        a.handle_message(&pb, now); // a loses: aborts its own, votes yes on 200
        b.handle_message(&pa, now); // b wins: votes no (busy) on 100
        assert!(matches!(
            &events(&mut a)[..],
            [Event::Contended {
                txn: 100,
                contention: Contention::Superseded
            }]
        ));
        deliver(&mut a, &mut b, now); // ABORT(100) and VOTE(200, yes)
        deliver(&mut b, &mut a, now); // VOTE(100, busy): a ignores it (txn 100 is over)
        let ev = events(&mut b);
        assert!(
            ev.iter()
                .any(|e| matches!(e, Event::Switch { txn: 200, .. })),
            "{ev:?}"
        );
        assert!(events(&mut a).is_empty());
    }

    #[test]
    fn a_busy_peer_or_end_is_contention() {
        let now = Instant::now();
        let (mut a, mut b) = (
            Multilateral::new(both(), Policy::default()),
            Multilateral::new(both(), Policy::default()),
        );
        // b follows another transaction (voted yes on 6) when a's proposal arrives.
        let prepare = Prepare {
            version: VERSION,
            txn: 6,
            option: option(1, "bincode"),
        }
        .encode();
        b.handle_message(&prepare, now);
        assert_eq!(b.poll_transmit().map(|m| m[0]), Some(Tag::Vote as u8));
        assert_eq!(
            b.propose(&Pick::from_branches(vec![0]), 8, now),
            Err(ProposeError::Busy),
            "an end in a switch cannot start another"
        );
        a.propose(&Pick::from_branches(vec![1]), 7, now).unwrap();
        deliver(&mut a, &mut b, now);
        deliver(&mut b, &mut a, now);
        let ev = events(&mut a);
        assert!(
            matches!(&ev[..], [Event::Contended { txn: 7, contention: Contention::Peer { message } }]
            if message.contains("in progress")),
            "{ev:?}"
        );
        assert!(a.is_idle());
    }

    #[test]
    fn the_voter_prefers_the_proposed_pick_then_its_own_order() {
        let now = Instant::now();
        // Both options fit a "json" proposal: the one with the proposal's pick wins.
        let mut b = Multilateral::new(
            vec![option(0, "json"), option(1, "json")],
            Policy::default(),
        );
        let prepare = |txn, pick| {
            Prepare {
                version: VERSION,
                txn,
                option: option(pick, "json"),
            }
            .encode()
        };
        b.handle_message(&prepare(1, 1), now);
        let v = Vote::decode(&b.poll_transmit().unwrap()[1..]).unwrap();
        assert!(matches!(v.verdict, Verdict::Yes { pick, .. } if pick.branches() == [1]));
        // The proposal's pick does not fit here: the first option that does.
        let mut b = Multilateral::new(both(), Policy::default());
        b.handle_message(
            &Prepare {
                version: VERSION,
                txn: 2,
                option: option(1, "json"),
            }
            .encode(),
            now,
        );
        let v = Vote::decode(&b.poll_transmit().unwrap()[1..]).unwrap();
        assert!(matches!(v.verdict, Verdict::Yes { pick, .. } if pick.branches() == [0]));
    }

    #[test]
    fn lost_decisions_are_recovered_by_resends_and_never_acted_on_twice() {
        let t0 = Instant::now();
        let p = Policy::default();
        let (mut a, mut b) = (Multilateral::new(both(), p), Multilateral::new(both(), p));
        // A lost ABORT: b resends its vote, a (idle, txn 1 over) answers with ABORT again.
        a.propose(&Pick::from_branches(vec![1]), 1, t0).unwrap();
        deliver(&mut a, &mut b, t0);
        let vote = b.poll_transmit().unwrap();
        a.handle_timeout(t0 + p.vote_timeout);
        assert_eq!(a.poll_transmit().map(|m| m[0]), Some(Tag::Abort as u8));
        events(&mut a);
        let t1 = b.poll_timeout().expect("the follower resends its vote");
        b.handle_timeout(t1);
        assert_eq!(b.poll_transmit().unwrap(), vote);
        a.handle_message(&vote, t1);
        deliver(&mut a, &mut b, t1);
        assert!(b.is_idle() && a.is_idle());
        assert!(matches!(
            &events(&mut b)[..],
            [Event::Aborted { txn: 1, .. }]
        ));

        // A lost DONE: a resends COMMIT, b answers with DONE again without switching again.
        a.propose(&Pick::from_branches(vec![1]), 2, t0).unwrap();
        deliver(&mut a, &mut b, t0);
        deliver(&mut b, &mut a, t0);
        let [Event::Switch { marker: commit, .. }] = &events(&mut a)[..] else {
            panic!()
        };
        b.handle_message(commit, t0);
        assert_eq!(events(&mut b).len(), 2, "PeerSwitched and Switch");
        let t1 = a.poll_timeout().expect("the initiator resends COMMIT");
        a.handle_timeout(t1);
        let again = a.poll_transmit().unwrap();
        assert_eq!(&again, commit);
        b.handle_message(&again, t1);
        assert!(events(&mut b).is_empty(), "no second switch");
        deliver(&mut b, &mut a, t1);
        assert_eq!(events(&mut a), [Event::PeerSwitched { txn: 2 }]);
        // A late PREPARE of txn 2 is not voted on again.
        b.handle_message(
            &Prepare {
                version: VERSION,
                txn: 2,
                option: option(1, "bincode"),
            }
            .encode(),
            t1,
        );
        assert!(b.is_idle() && b.poll_transmit().is_none());
    }

    #[test]
    fn a_repeated_prepare_gets_the_same_vote() {
        let now = Instant::now();
        let mut b = Multilateral::new(both(), Policy::default());
        let prepare = Prepare {
            version: VERSION,
            txn: 11,
            option: option(0, "json"),
        }
        .encode();
        b.handle_message(&prepare, now);
        let v1 = b.poll_transmit().unwrap();
        b.handle_message(&prepare, now);
        assert_eq!(b.poll_transmit().unwrap(), v1);
    }
}
