//! Exhaustive model check of the group transitions (docs/wire.md §15): 2–3 members, each the
//! real sans-IO [`Machine`] driven the way `Participant`'s driver drives it, over a model of
//! the store's atomic operations (the semantics of `SqliteStore`, `Store`'s docs and
//! `conformance::store_semantics`: one serializable transaction per operation).
//!
//! Interleaving is at the store operation: a member reads a snapshot, feeds it to its machine,
//! then performs the resulting operations (vote, finish, join attempts of a rejoin, leave) one
//! at a time, and other members may act between any two of them. The explorer may also make a
//! member propose, crash (its driver stops; its lease later runs out), restart (a fresh
//! `Participant::join`), lose its lease while alive (a partition from the store), move the
//! clock past a transition's deadline or its orphan grace, and (in one run) make the store
//! lose the group (a Redis without persistence restarting).
//!
//! `Machine` is not `Clone`: a state keeps each member's inputs and rebuilds the machine by
//! replaying them. Two states are the same when the store, the machines' state (`Debug`, plus
//! the transition each finished), the queued operations, the clock and the remaining budgets
//! agree.
//!
//! Properties:
//! * **agreement**: no two running members are at one epoch with different stacks, and each
//!   runs the stack the store committed for its epoch;
//! * **no switch without every live member's yes**: when a transition commits, every member
//!   live in the store has a yes ballot on it; only its proposer commits it;
//! * **progress when quiet**: from any state, with no more faults or proposals, the members'
//!   drivers running and the clock moving on, the group reaches a decided state (no pending
//!   transition; every running member a member at the committed epoch and stack; every
//!   proposal answered).
//!
//! `cargo test -p chunnel-rendezvous --test model_transitions -- --nocapture` prints the state
//! counts.

use std::borrow::Cow;
use std::collections::{HashSet, VecDeque};
use std::hash::{BuildHasher, Hash};
use std::sync::OnceLock;
use std::time::Instant;

use bytes::Bytes;
use chunnel::negotiate::{Capability, ChunnelInfo, Pick, StackOption};
use chunnel_rendezvous::machine::{Action, Machine, ORPHAN_GRACE_MS, join_choice};
use chunnel_rendezvous::{Ballot, Committed, Member, Outcome, Snapshot, Transition};

const DEADLINE_MS: u64 = 100;
const LABELS: [&str; 2] = ["none", "total"];

fn option(label: usize, branch: u8) -> StackOption {
    StackOption {
        chunnels: vec![ChunnelInfo {
            id: Cow::Borrowed("test/order/1"),
            capabilities: vec![Capability::exact("ordering", [LABELS[label]])],
        }],
        pick: Pick::from_branches(vec![branch]),
    }
}

fn stack_bytes(label: usize) -> Bytes {
    chunnel_negotiate::wire::encode_stack(&option(label, 0).chunnels)
}

fn label_of(stack: &[u8]) -> usize {
    (0..LABELS.len())
        .find(|&l| stack_bytes(l) == stack)
        .expect("a known stack")
}

fn name(m: usize) -> String {
    format!("m{m}")
}

/// The group record, as the store keeps it.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
struct Store {
    /// (epoch, stack label).
    committed: Option<(u64, usize)>,
    /// Live members (leases not run out).
    members: Vec<usize>,
    /// (id, from_epoch, proposer, stack label, deadline).
    transition: Option<(u64, u64, usize, usize, u64)>,
    /// (member, transition id, yes).
    ballots: Vec<(usize, u64, bool)>,
    outcome: Option<(u64, bool)>,
}

impl Store {
    fn snapshot(&self) -> Snapshot {
        let tid = self.transition.map(|t| t.0);
        Snapshot {
            committed: self.committed.map(|(epoch, l)| Committed {
                epoch,
                stack: stack_bytes(l),
            }),
            members: self
                .members
                .iter()
                .map(|&m| Member {
                    id: name(m),
                    addr: String::new(),
                })
                .collect(),
            transition: self
                .transition
                .map(|(id, from_epoch, p, l, deadline_ms)| Transition {
                    id,
                    from_epoch,
                    proposer: name(p),
                    stack: stack_bytes(l),
                    deadline_ms,
                    ballot_box: None,
                }),
            ballots: self
                .ballots
                .iter()
                .filter(|b| Some(b.1) == tid)
                .map(|&(m, _, yes)| {
                    (
                        name(m),
                        if yes {
                            Ballot::Yes
                        } else {
                            Ballot::No(format!("{}: no", name(m)))
                        },
                    )
                })
                .collect(),
            outcome: self
                .outcome
                .map(|(id, committed)| Outcome { id, committed }),
        }
    }

    fn add_member(&mut self, m: usize) {
        if !self.members.contains(&m) {
            self.members.push(m);
            self.members.sort_unstable();
        }
    }
}

/// A store operation a member's driver has still to perform (from its last read).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Op {
    Vote {
        id: u64,
        yes: bool,
    },
    Finish {
        id: u64,
        commit: bool,
    },
    Leave,
    /// One `Store::join` of `join_once`: proposing our option `propose`, expecting `expect`.
    /// `fresh`: a restarted participant (a new machine), else a rejoin of the running one.
    Join {
        propose: usize,
        expect: Option<u64>,
        fresh: bool,
    },
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Status {
    Running,
    Crashed,
    /// Left for good (the group moved to a stack it cannot build).
    Closed,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Mem {
    status: Status,
    /// The machine's `Debug` form (epoch, option, the ballot it cast) and the transition it
    /// finished (not in `Debug`).
    fp: String,
    finished: Option<u64>,
    epoch: u64,
    option: usize,
    ops: VecDeque<Op>,
    /// Our proposal waiting for its outcome.
    pending: Option<u64>,
    proposals_left: u8,
}

#[derive(Clone, Debug)]
enum MIn {
    Snap(Box<Snapshot>, u64),
    Rejoined(u64, usize),
    /// The store refused the member's finish of this transition (`Machine::finish_refused`).
    FinishRefused(u64),
}

#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
struct Budgets {
    crashes: u8,
    restarts: u8,
    expiries: u8,
    ticks: u8,
    losses: u8,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Key {
    store: Store,
    mems: Vec<Mem>,
    now: u64,
    budgets: Budgets,
    /// (epoch, stack label) of every stack the store ever committed.
    history: Vec<(u64, usize)>,
    /// A violation seen at a store operation.
    violation: Option<String>,
}

#[derive(Clone, Debug)]
struct State {
    key: Key,
    /// Per member: the machine's start (epoch, option) and its inputs since.
    logs: Vec<((u64, usize), Vec<MIn>)>,
    trace: Vec<String>,
    /// When recording (the differential test against `SqliteStore`): every store call and the
    /// model's snapshot after it.
    calls: Option<Vec<(Call, Snapshot)>>,
}

/// A store call, as the differential test replays it on a real store.
#[derive(Clone, Debug)]
enum Call {
    Join {
        m: usize,
        propose: usize,
        expect: Option<u64>,
    },
    Vote {
        m: usize,
        id: u64,
        yes: bool,
    },
    Finish {
        id: u64,
        commit: bool,
    },
    Leave {
        m: usize,
    },
    Propose(Transition),
}

/// A property over a state's hashed part.
type Property = fn(&Key) -> Result<(), String>;

#[derive(Clone)]
struct Config {
    name: &'static str,
    /// Each member's offers, as stack labels in preference order.
    offers: Vec<Vec<usize>>,
    proposals: Vec<u8>,
    budgets: Budgets,
    check_progress: bool,
    /// Check "no switch without every live member's yes" (else only agreement and progress).
    check_all_yes: bool,
    /// Progress includes every proposer learning its proposal's outcome (`Participant::propose`
    /// returns).
    check_answered: bool,
    /// A planted wrong property, or `None`.
    extra: Option<Property>,
    /// Planted bug: the proposer's finish commits without looking at the ballots.
    planted_commit_on_any: bool,
    /// The store's finish commits whatever the proposer decided on its last read, without
    /// checking the ballots of the members live when it writes (the stores before the
    /// conditional finish).
    unconditional_finish: bool,
    /// A member re-creating a group the store lost starts it at epoch 1 again (as the driver
    /// did before `recreation_epoch`).
    recreate_at_one: bool,
}

fn offers(cfg: &Config, m: usize) -> Vec<StackOption> {
    cfg.offers[m]
        .iter()
        .enumerate()
        .map(|(i, &l)| option(l, i as u8))
        .collect()
}

fn replay(cfg: &Config, m: usize, start: (u64, usize), log: &[MIn]) -> Machine {
    let mut mc = Machine::new(name(m), offers(cfg, m), None, start.0, start.1);
    for i in log {
        match i {
            MIn::Snap(s, now) => {
                mc.on_snapshot(s, *now);
            }
            MIn::Rejoined(e, o) => mc.rejoined(*e, *o),
            MIn::FinishRefused(id) => mc.finish_refused(*id),
        }
    }
    mc
}

fn sync(mem: &mut Mem, mc: &Machine) {
    mem.fp = format!("{mc:?}");
    mem.epoch = mc.epoch();
    mem.option = mc.option();
}

fn label(cfg: &Config, m: usize, option: usize) -> usize {
    cfg.offers[m][option]
}

/// The initial group: member 0 created it with its first option; every member joined.
fn init(cfg: &Config) -> State {
    let n = cfg.offers.len();
    let l0 = cfg.offers[0][0];
    let mut logs = Vec::new();
    let mut mems = Vec::new();
    for m in 0..n {
        let option = join_choice(&option(l0, 0).chunnels, &offers(cfg, m)).expect("compatible");
        let mc = Machine::new(name(m), offers(cfg, m), None, 1, option);
        let mut mem = Mem {
            status: Status::Running,
            fp: String::new(),
            finished: None,
            epoch: 1,
            option,
            ops: VecDeque::new(),
            pending: None,
            proposals_left: cfg.proposals[m],
        };
        sync(&mut mem, &mc);
        mems.push(mem);
        logs.push(((1, option), Vec::new()));
    }
    State {
        key: Key {
            store: Store {
                committed: Some((1, l0)),
                members: (0..n).collect(),
                ..Store::default()
            },
            mems,
            now: 0,
            budgets: cfg.budgets.clone(),
            history: vec![(1, l0)],
            violation: None,
        },
        logs,
        trace: Vec::new(),
        calls: None,
    }
}

/// Member `m` reads the group and feeds its machine (the driver's `step_once`).
fn poll(cfg: &Config, s: &mut State, m: usize) {
    let snap = s.key.store.snapshot();
    let now = s.key.now;
    let (start, log) = &s.logs[m];
    let mut mc = replay(cfg, m, *start, log);
    let actions = mc.on_snapshot(&snap, now);
    s.logs[m].1.push(MIn::Snap(Box::new(snap.clone()), now));
    let mem = &mut s.key.mems[m];
    for a in actions {
        match a {
            Action::Rejoin => mem.ops.push_back(Op::Join {
                propose: mc.option(),
                expect: None,
                fresh: false,
            }),
            Action::Prepare { .. } => {}
            Action::Vote { id, ballot, .. } => mem.ops.push_back(Op::Vote {
                id,
                yes: ballot == Ballot::Yes,
            }),
            Action::Finish { id, commit, .. } => {
                mem.finished = Some(id);
                mem.ops.push_back(Op::Finish { id, commit });
            }
            Action::Switch { .. } => {}
            Action::Incompatible { .. } => mem.ops.push_back(Op::Leave),
        }
    }
    sync(mem, &mc);
    // Our proposal's fate: the outcome if it is ours, else decided once our transition is no
    // longer pending (the driver answers its own successful finish at once, and only the
    // proposer commits, so anything else is an abort).
    if let Some(id) = mem.pending
        && (snap.outcome.is_some_and(|o| o.id == id)
            || snap.transition.as_ref().map(|t| t.id) != Some(id))
    {
        mem.pending = None;
    }
}

/// Member `m` performs its next queued store operation.
fn perform(cfg: &Config, s: &mut State, m: usize) {
    let op = s.key.mems[m].ops.pop_front().expect("an operation");
    let call = match &op {
        Op::Vote { id, yes } => Call::Vote {
            m,
            id: *id,
            yes: *yes,
        },
        Op::Finish { id, commit } => Call::Finish {
            id: *id,
            commit: *commit || cfg.planted_commit_on_any,
        },
        Op::Leave => Call::Leave { m },
        Op::Join {
            propose, expect, ..
        } => Call::Join {
            m,
            propose: label(cfg, m, *propose),
            expect: *expect,
        },
    };
    perform_op(cfg, s, m, op);
    let snap = s.calls.is_some().then(|| s.key.store.snapshot());
    if let (Some(calls), Some(snap)) = (&mut s.calls, snap) {
        calls.push((call, snap));
    }
}

fn perform_op(cfg: &Config, s: &mut State, m: usize, op: Op) {
    let k = &mut s.key;
    match op {
        Op::Vote { id, yes } => {
            if k.store.transition.map(|t| t.0) == Some(id) {
                k.store.ballots.retain(|b| b.0 != m);
                k.store.ballots.push((m, id, yes));
                k.store.ballots.sort_unstable();
            }
        }
        Op::Finish { id, commit } => {
            let Some(t) = k.store.transition.filter(|t| t.0 == id) else {
                return;
            };
            let commit = commit || cfg.planted_commit_on_any;
            let all_yes = k
                .store
                .members
                .iter()
                .all(|&live| k.store.ballots.contains(&(live, id, true)));
            if commit && !all_yes && !cfg.unconditional_finish {
                // Refused, nothing written: the proposer decides again on a later read.
                s.logs[m].1.push(MIn::FinishRefused(id));
                let mc = replay(cfg, m, s.logs[m].0, &s.logs[m].1);
                let mem = &mut s.key.mems[m];
                mem.finished = None;
                sync(mem, &mc);
                return;
            }
            if commit && k.store.committed.map(|c| c.0) == Some(t.1) {
                if t.2 != m && k.violation.is_none() {
                    k.violation = Some(format!("{} committed {}'s transition", name(m), name(t.2)));
                }
                for &live in &k.store.members {
                    let yes = k.store.ballots.contains(&(live, id, true));
                    if cfg.check_all_yes && !yes && k.violation.is_none() {
                        k.violation = Some(format!(
                            "transition {id} committed without the yes of live member {}",
                            name(live)
                        ));
                    }
                }
                k.store.committed = Some((t.1 + 1, t.3));
                k.history.push((t.1 + 1, t.3));
            }
            k.store.outcome = Some((id, commit));
            k.store.transition = None;
            // The driver answers its own proposal when its finish wrote.
            if k.mems[m].pending == Some(id) {
                k.mems[m].pending = None;
            }
            k.store.ballots.clear();
        }
        Op::Leave => {
            k.store.members.retain(|&x| x != m);
            k.store.ballots.retain(|b| b.0 != m);
            k.mems[m].status = Status::Closed;
            k.mems[m].ops.clear();
        }
        Op::Join {
            propose,
            expect,
            fresh,
        } => {
            let ours = offers(cfg, m);
            let joined = match k.store.committed {
                None => {
                    let l = label(cfg, m, propose);
                    // A rejoin re-creates the group above every epoch held before (the
                    // driver's `recreation_epoch`: the wall clock in microseconds, modelled as
                    // one above the highest epoch ever committed); a fresh join creates at 1.
                    let at = match fresh || cfg.recreate_at_one {
                        true => 1,
                        false => k.history.iter().map(|h| h.0).max().unwrap_or(0) + 1,
                    };
                    k.store.committed = Some((at, l));
                    k.history.push((at, l));
                    k.store.add_member(m);
                    Some((at, propose))
                }
                Some((epoch, l)) if Some(epoch) == expect => {
                    k.store.add_member(m);
                    // Joined: our first option compatible with the committed stack (an
                    // incompatible one fails the join: the member retries at its next read).
                    join_choice(&option(l, 0).chunnels, &ours)
                        .ok()
                        .map(|o| (epoch, o))
                }
                Some((epoch, l)) => {
                    // Current: try again at its epoch if we can build its stack.
                    if join_choice(&option(l, 0).chunnels, &ours).is_ok() {
                        k.mems[m].ops.push_front(Op::Join {
                            propose,
                            expect: Some(epoch),
                            fresh,
                        });
                    }
                    None
                }
            };
            if let Some((epoch, option)) = joined {
                if fresh {
                    s.logs[m] = ((epoch, option), Vec::new());
                    let mc = replay(cfg, m, (epoch, option), &[]);
                    let mem = &mut s.key.mems[m];
                    mem.finished = None;
                    sync(mem, &mc);
                } else if epoch != s.key.mems[m].epoch || option != s.key.mems[m].option {
                    // The driver's rejoin: a changed epoch or stack reaches the machine.
                    s.logs[m].1.push(MIn::Rejoined(epoch, option));
                    let mc = replay(cfg, m, s.logs[m].0, &s.logs[m].1);
                    sync(&mut s.key.mems[m], &mc);
                }
            }
        }
    }
}

fn next_tick(k: &Key) -> Option<u64> {
    let t = k.store.transition?;
    [t.4 + 1, t.4 + ORPHAN_GRACE_MS + 1]
        .into_iter()
        .find(|&x| x > k.now)
}

fn successors(cfg: &Config, s: &State) -> Vec<State> {
    let mut out = Vec::new();
    let k = &s.key;
    let go = |f: &dyn Fn(&mut State), label: String| {
        let mut n = s.clone();
        f(&mut n);
        n.trace.push(label);
        n
    };
    for m in 0..k.mems.len() {
        let mem = &k.mems[m];
        match mem.status {
            Status::Running => {
                if let Some(op) = mem.ops.front() {
                    out.push(go(&|n| perform(cfg, n, m), format!("{}: {op:?}", name(m))));
                } else {
                    out.push(go(
                        &|n| poll(cfg, n, m),
                        format!("{}: read the group at {}", name(m), k.now),
                    ));
                    if mem.pending.is_none() && mem.proposals_left > 0 {
                        out.push(go(&|n| propose(cfg, n, m), format!("{}: propose", name(m))));
                    }
                }
                if k.budgets.crashes > 0 {
                    out.push(go(
                        &|n| {
                            n.key.budgets.crashes -= 1;
                            let mem = &mut n.key.mems[m];
                            mem.status = Status::Crashed;
                            mem.ops.clear();
                            mem.pending = None;
                        },
                        format!("{}: CRASH", name(m)),
                    ));
                }
                if k.budgets.expiries > 0 && k.store.members.contains(&m) {
                    out.push(go(
                        &|n| {
                            n.key.budgets.expiries -= 1;
                            n.key.store.members.retain(|&x| x != m);
                        },
                        format!("{}: lease runs out while it runs", name(m)),
                    ));
                }
            }
            Status::Crashed => {
                if k.store.members.contains(&m) {
                    out.push(go(
                        &|n| n.key.store.members.retain(|&x| x != m),
                        format!("{}: lease of the crashed member runs out", name(m)),
                    ));
                }
                if k.budgets.restarts > 0 {
                    out.push(go(
                        &|n| {
                            n.key.budgets.restarts -= 1;
                            let mem = &mut n.key.mems[m];
                            mem.status = Status::Running;
                            mem.ops.push_back(Op::Join {
                                propose: 0,
                                expect: None,
                                fresh: true,
                            });
                        },
                        format!("{}: RESTART (Participant::join)", name(m)),
                    ));
                }
            }
            Status::Closed => {}
        }
    }
    if k.budgets.ticks > 0
        && let Some(t) = next_tick(k)
    {
        out.push(go(
            &|n| {
                n.key.budgets.ticks -= 1;
                n.key.now = t;
            },
            format!("clock to {t}"),
        ));
    }
    if k.budgets.losses > 0 && k.store.committed.is_some() {
        out.push(go(
            &|n| {
                n.key.budgets.losses -= 1;
                n.key.store = Store::default();
            },
            "STORE LOSES THE GROUP".into(),
        ));
    }
    out
}

/// The driver's `propose`: a transition to our other option, recorded if none is pending.
fn propose(cfg: &Config, s: &mut State, m: usize) {
    let (start, log) = &s.logs[m];
    let mc = replay(cfg, m, *start, log);
    let k = &mut s.key;
    let mem = &mut k.mems[m];
    mem.proposals_left -= 1;
    let id = 100 * (m as u64 + 1) + u64::from(mem.proposals_left);
    let option = (mem.option + 1) % cfg.offers[m].len();
    let t = mc
        .proposal(id, option, k.now + DEADLINE_MS)
        .expect("an option");
    let ok = k.store.transition.is_none()
        && k.store.committed.map(|c| c.0) == Some(t.from_epoch)
        && t.from_epoch != 0;
    if ok {
        k.store.transition = Some((id, t.from_epoch, m, label_of(&t.stack), t.deadline_ms));
        k.store.ballots.clear();
        mem.pending = Some(id);
    }
    let snap = s.calls.is_some().then(|| s.key.store.snapshot());
    if let (Some(calls), Some(snap)) = (&mut s.calls, snap) {
        calls.push((Call::Propose(t), snap));
    }
}

fn safety(cfg: &Config, k: &Key) -> Result<(), String> {
    if let Some(v) = &k.violation {
        return Err(v.clone());
    }
    let running: Vec<usize> = (0..k.mems.len())
        .filter(|&m| k.mems[m].status == Status::Running)
        .collect();
    for &a in &running {
        let (ea, la) = (k.mems[a].epoch, label(cfg, a, k.mems[a].option));
        if !k.history.contains(&(ea, la)) {
            return Err(format!(
                "{} runs {} at epoch {ea}, which the store never committed (history {:?})",
                name(a),
                LABELS[la],
                k.history
            ));
        }
        for &b in &running {
            let (eb, lb) = (k.mems[b].epoch, label(cfg, b, k.mems[b].option));
            if a < b && ea == eb && la != lb {
                return Err(format!(
                    "{} and {} are both at epoch {ea} with different stacks ({} vs {})",
                    name(a),
                    name(b),
                    LABELS[la],
                    LABELS[lb]
                ));
            }
        }
    }
    if let Some(extra) = cfg.extra {
        extra(k)?;
    }
    Ok(())
}

fn decided(cfg: &Config, k: &Key) -> Result<(), String> {
    if k.store.transition.is_some() {
        return Err("a transition is still pending".into());
    }
    let Some((epoch, l)) = k.store.committed else {
        return Err("the group is gone".into());
    };
    for (m, mem) in k.mems.iter().enumerate() {
        if mem.status != Status::Running {
            continue;
        }
        if !k.store.members.contains(&m) {
            return Err(format!("{} runs but is not a member", name(m)));
        }
        if mem.epoch != epoch || label(cfg, m, mem.option) != l {
            return Err(format!(
                "{} runs {} at epoch {}, the group {} at {epoch}",
                name(m),
                LABELS[label(cfg, m, mem.option)],
                mem.epoch,
                LABELS[l]
            ));
        }
        if let Some(id) = mem.pending
            && cfg.check_answered
        {
            return Err(format!("{}'s proposal {id} is never answered", name(m)));
        }
    }
    Ok(())
}

/// No more faults or proposals: crashed members' leases run out, every running member's
/// driver works (its queued operations, then a read), the clock moves when nothing else does.
/// `good` holds states already known to reach a decision this way (the walk is
/// deterministic, so it stops at one of them).
fn quiet(cfg: &Config, s: &State, good: &mut HashSet<u64>) -> Result<(), String> {
    let mut s = s.clone();
    let mut path = vec![hash(&s.key)];
    for m in 0..s.key.mems.len() {
        if s.key.mems[m].status == Status::Crashed {
            s.key.store.members.retain(|&x| x != m);
        }
    }
    for _ in 0..60 {
        let h = hash(&s.key);
        if good.contains(&h) {
            good.extend(path);
            return Ok(());
        }
        path.push(h);
        let before = s.key.clone();
        for m in 0..s.key.mems.len() {
            if s.key.mems[m].status != Status::Running {
                continue;
            }
            while !s.key.mems[m].ops.is_empty() {
                perform(cfg, &mut s, m);
            }
            if s.key.mems[m].status == Status::Running {
                poll(cfg, &mut s, m);
            }
        }
        safety(cfg, &s.key)?;
        if s.key == before {
            if decided(cfg, &s.key).is_ok() {
                good.extend(path);
                return Ok(());
            }
            match next_tick(&s.key) {
                Some(t) => s.key.now = t,
                None => return decided(cfg, &s.key),
            }
        }
    }
    decided(cfg, &s.key).map_err(|e| format!("no fixpoint in 60 rounds: {e}"))
}

fn hash(k: &Key) -> u64 {
    static H: OnceLock<std::hash::RandomState> = OnceLock::new();
    H.get_or_init(std::hash::RandomState::new).hash_one(k)
}

#[derive(Debug)]
struct Report {
    states: usize,
    depth: usize,
    commits: usize,
}

fn explore(cfg: &Config) -> Result<Report, String> {
    let started = Instant::now();
    let init = init(cfg);
    let mut seen = HashSet::from([hash(&init.key)]);
    let mut good = HashSet::new();
    let mut queue = VecDeque::from([init]);
    let mut r = Report {
        states: 1,
        depth: 0,
        commits: 0,
    };
    let mut transitions = 0usize;
    while let Some(s) = queue.pop_front() {
        r.depth = r.depth.max(s.trace.len());
        let check = safety(cfg, &s.key).and_then(|()| {
            if cfg.check_progress {
                quiet(cfg, &s, &mut good).map_err(|e| format!("no progress on a quiet group: {e}"))
            } else {
                Ok(())
            }
        });
        if let Err(why) = check {
            return Err(format!(
                "[{}] {why}\n  after:\n    {}",
                cfg.name,
                s.trace.join("\n    ")
            ));
        }
        if s.key.history.len() > 1 {
            r.commits += 1;
        }
        for n in successors(cfg, &s) {
            transitions += 1;
            if seen.insert(hash(&n.key)) {
                r.states += 1;
                queue.push_back(n);
            }
        }
    }
    println!(
        "model_transitions [{}]: {} states, {transitions} transitions, depth {}, {} states after a commit, {:.2?}",
        cfg.name,
        r.states,
        r.depth,
        r.commits,
        started.elapsed()
    );
    Ok(r)
}

fn base(name: &'static str, members: usize) -> Config {
    Config {
        name,
        offers: vec![vec![0, 1]; members],
        proposals: vec![0; members],
        budgets: Budgets::default(),
        check_progress: true,
        check_all_yes: true,
        check_answered: true,
        extra: None,
        planted_commit_on_any: false,
        unconditional_finish: false,
        recreate_at_one: false,
    }
}

fn proposers_and_deadlines() -> Config {
    // Three members, two of them propose (one of them twice); the clock may pass the
    // deadline and the orphan grace.
    let mut cfg = base("3 members, 2 proposers, deadlines", 3);
    cfg.proposals = vec![2, 1, 0];
    cfg.budgets.ticks = 2;
    cfg
}

fn one_refuses() -> Config {
    // The third member can only build `none`: every proposal to `total` is refused by it,
    // unless its lease runs out first (then the others may commit without it, and it leaves
    // when it reads a stack it cannot build).
    let mut cfg = base("3 members, one refuses, its lease may run out", 3);
    cfg.offers[2] = vec![0];
    cfg.proposals = vec![1, 1, 0];
    cfg.budgets.ticks = 2;
    cfg.budgets.expiries = 1;
    cfg
}

#[test]
fn a_member_that_refuses() {
    let mut cfg = one_refuses();
    // Agreement and progress only; the same exploration with every property is
    // `a_member_joining_during_a_transition_has_its_say`.
    cfg.check_all_yes = false;
    cfg.check_answered = false;
    let r = explore(&cfg).unwrap_or_else(|e| panic!("{e}"));
    assert!(r.commits > 0, "{r:?}");
}

#[test]
fn crashes_and_restarts_agreement() {
    // A member may crash (its lease then runs out) and restart; one may lose its lease while
    // it runs. Agreement and progress hold.
    let mut cfg = base("2 members, crash/restart, lease loss", 2);
    cfg.proposals = vec![1, 1];
    cfg.budgets = Budgets {
        crashes: 1,
        restarts: 1,
        expiries: 1,
        ticks: 2,
        losses: 0,
    };
    cfg.check_all_yes = false;
    cfg.check_answered = false;
    explore(&cfg).unwrap_or_else(|e| panic!("{e}"));
}

fn store_loses_the_group() -> Config {
    // A Redis without persistence restarts: the group's record is gone; members re-create it.
    let mut cfg = base("2 members, the store loses the group", 2);
    cfg.proposals = vec![1, 0];
    cfg.budgets.losses = 1;
    cfg.check_all_yes = false;
    cfg.check_answered = false;
    cfg
}

/// The store loses the group; a member re-creates it above every epoch held before
/// (`recreation_epoch`), so a member that lagged behind switches to it instead of running
/// another stack under the same epoch number.
#[test]
fn the_store_losing_the_group_splits_nobody() {
    explore(&store_loses_the_group()).unwrap_or_else(|e| panic!("{e}"));
}

/// The same with the group re-created at epoch 1, as before: caught (two members at epoch 1
/// with different stacks).
#[test]
fn a_group_re_created_at_epoch_one_is_caught() {
    let mut cfg = store_loses_the_group();
    cfg.recreate_at_one = true;
    let e = explore(&cfg).expect_err("re-creating at epoch 1 must be caught");
    assert!(e.contains("different stacks"), "{e}");
}

/// Concurrent proposers and deadlines, every property, every proposal answered. (Was a bug: the
/// driver learnt its proposal's fate only from the store's outcome, which records the last
/// finished transition, so another transition finishing before the proposer read it left the
/// proposer waiting forever. Now it answers its own successful finish at once, and concludes
/// "aborted" once its transition is no longer pending and the outcome is not its own: only the
/// proposer commits. This replaces `concurrent_proposers_and_deadlines`, the same exploration
/// without the check that every proposal is answered.)
#[test]
fn bug_a_proposer_can_wait_forever() {
    let r = explore(&proposers_and_deadlines()).unwrap_or_else(|e| panic!("{e}"));
    assert!(r.commits > 0, "{r:?}");
}

/// A member that joins (or rejoins after its lease ran out) between the proposer's decision
/// and its finish has its say: the store's finish commits only with every member live *then*
/// voting yes, and otherwise refuses, and the proposer decides again.
#[test]
fn a_member_joining_during_a_transition_has_its_say() {
    let r = explore(&one_refuses()).unwrap_or_else(|e| panic!("{e}"));
    assert!(r.commits > 0, "{r:?}");
}

/// The same exploration over stores whose finish commits what the proposer decided on its
/// last read (as all three did before the conditional finish): the checker finds the member
/// switched without its yes.
#[test]
fn an_unconditional_finish_is_caught() {
    let mut cfg = one_refuses();
    cfg.unconditional_finish = true;
    cfg.check_answered = false;
    let e = explore(&cfg).expect_err("the unconditional finish must be caught");
    assert!(e.contains("without the yes"), "{e}");
}

#[test]
fn planted_commit_on_a_no_is_caught() {
    // The proposer's finish commits even when it decided to abort (a refusal or the deadline).
    let mut cfg = base("planted: commit on abort", 3);
    cfg.offers[2] = vec![0];
    cfg.proposals = vec![1, 0, 0];
    cfg.planted_commit_on_any = true;
    // The stores refuse a commit without every live yes, which would hide the plant.
    cfg.unconditional_finish = true;
    cfg.check_progress = false;
    let e = explore(&cfg).expect_err("the planted bug must be caught");
    println!("{e}");
    assert!(e.contains("without the yes"), "{e}");
}

#[test]
fn planted_wrong_property_is_caught() {
    // "The group never leaves epoch 1" is false.
    let mut cfg = base("planted: epoch stays 1", 2);
    cfg.proposals = vec![1, 0];
    cfg.check_progress = false;
    cfg.extra = Some(|k| {
        if k.history.len() > 1 {
            Err("the group left epoch 1".into())
        } else {
            Ok(())
        }
    });
    let e = explore(&cfg).expect_err("the wrong property must fail");
    assert!(e.contains("left epoch 1"), "{e}");
}

/// The counterexample `an_unconditional_finish_is_caught` finds, replayed on the real
/// `SqliteStore` with the real machines: a member joins between the proposer's decision and
/// its finish. The finish is refused (the member has not voted), the member refuses the stack
/// it cannot build, and the proposer aborts: nobody is switched.
#[tokio::test]
async fn on_sqlite_a_member_joining_before_the_finish_has_its_say() {
    use chunnel_rendezvous::{SqliteStore, Store};
    use std::time::Duration;
    let dir = chunnel_test::services::Scratch::new("model-join-race");
    let store = SqliteStore::open(dir.0.join("groups.sqlite")).unwrap();
    let (g, lease) = ("g", Duration::from_secs(30));
    let member = |m: usize| Member {
        id: name(m),
        addr: String::new(),
    };
    let both = vec![option(0, 0), option(1, 1)];
    let only_none = vec![option(0, 0)];
    store
        .join(g, &member(0), Some(&stack_bytes(0)), None, lease)
        .await
        .unwrap();
    store
        .join(g, &member(1), None, Some(1), lease)
        .await
        .unwrap();
    let mut m0 = Machine::new(name(0), both.clone(), None, 1, 0);
    let mut m1 = Machine::new(name(1), both, None, 1, 0);
    // m1 proposes `total`; m2 (which can only build `none`) is away.
    let t = m1
        .proposal(7, 1, chunnel_rendezvous::store::now_ms() + 60_000)
        .unwrap();
    assert!(store.propose(g, &t).await.unwrap());
    for (m, mc) in [(0, &mut m0), (1, &mut m1)] {
        let s = store.snapshot(g).await.unwrap();
        for a in mc.on_snapshot(&s, chunnel_rendezvous::store::now_ms()) {
            if let Action::Vote { id, ballot, .. } = a {
                store.vote(g, id, &name(m), &ballot).await.unwrap();
            }
        }
    }
    // m1 reads: every live member voted yes; it decides to commit.
    let s = store.snapshot(g).await.unwrap();
    let decision = m1.on_snapshot(&s, chunnel_rendezvous::store::now_ms());
    assert!(
        decision.contains(&Action::Finish {
            id: 7,
            commit: true,
            reason: String::new(),
            attested: vec![],
        }),
        "{decision:?}"
    );
    // m2 joins before the finish lands (at the committed epoch, with its only option).
    store
        .join(g, &member(2), None, Some(1), lease)
        .await
        .unwrap();
    let mut m2 = Machine::new(name(2), only_none, None, 1, 0);
    assert!(
        !store.finish(g, 7, true).await.unwrap(),
        "transition 7 committed with live member m2, which never voted"
    );
    m1.finish_refused(7);
    let s = store.snapshot(g).await.unwrap();
    assert_eq!(
        (s.epoch(), s.transition.as_ref().map(|t| t.id)),
        (1, Some(7))
    );
    for a in m2.on_snapshot(&s, chunnel_rendezvous::store::now_ms()) {
        if let Action::Vote { id, ballot, .. } = a {
            assert!(matches!(ballot, Ballot::No(_)), "{ballot:?}");
            store.vote(g, id, &name(2), &ballot).await.unwrap();
        }
    }
    let s = store.snapshot(g).await.unwrap();
    let decision = m1.on_snapshot(&s, chunnel_rendezvous::store::now_ms());
    assert!(
        matches!(
            &decision[..],
            [Action::Finish {
                id: 7,
                commit: false,
                ..
            }]
        ),
        "{decision:?}"
    );
    assert!(store.finish(g, 7, false).await.unwrap());
    let s = store.snapshot(g).await.unwrap();
    assert_eq!(s.epoch(), 1, "nobody switched");
}

#[test]
fn three_members_crash_and_restart() {
    // Three members, two proposers; one member may crash (its lease runs out) and restart.
    let mut cfg = base("3 members, 2 proposers, crash/restart", 3);
    cfg.proposals = vec![1, 1, 0];
    cfg.budgets = Budgets {
        crashes: 1,
        restarts: 1,
        expiries: 0,
        ticks: 2,
        losses: 0,
    };
    cfg.check_all_yes = false;
    cfg.check_answered = false;
    explore(&cfg).unwrap_or_else(|e| panic!("{e}"));
}

/// The store model against the real `SqliteStore`: seeded random walks through the explorer's
/// steps (no crash, lease loss or store loss: those are not store calls), every store call replayed on
/// a fresh SQLite group, the snapshots compared after each.
#[tokio::test]
async fn the_store_model_matches_sqlite() {
    use chunnel_rendezvous::{SqliteStore, Store};
    use std::time::Duration;
    let dir = chunnel_test::services::Scratch::new("model-differential");
    let store = SqliteStore::open(dir.0.join("groups.sqlite")).unwrap();
    let lease = Duration::from_secs(60);
    let mut cfg = base("differential", 3);
    cfg.offers[2] = vec![0];
    cfg.proposals = vec![2, 2, 0];
    // Lease expiries are not store calls: no crash (whose lease runs out), no lease loss.
    cfg.budgets.ticks = 3;
    const WALKS: usize = 150;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut calls = 0;
    for walk in 0..WALKS {
        let g = format!("walk-{walk}");
        let mut s = init(&cfg);
        s.calls = Some(Vec::new());
        for _ in 0..60 {
            let next = successors(&cfg, &s);
            if next.is_empty() {
                break;
            }
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            s = next[(seed % next.len() as u64) as usize].clone();
        }
        // The initial group: m0 created it, the others joined.
        let member = |m: usize| Member {
            id: name(m),
            addr: String::new(),
        };
        store
            .join(
                &g,
                &member(0),
                Some(&stack_bytes(cfg.offers[0][0])),
                None,
                lease,
            )
            .await
            .unwrap();
        for m in 1..cfg.offers.len() {
            store
                .join(&g, &member(m), None, Some(1), lease)
                .await
                .unwrap();
        }
        for (i, (call, want)) in s.calls.take().unwrap().into_iter().enumerate() {
            match &call {
                Call::Join { m, propose, expect } => {
                    store
                        .join(
                            &g,
                            &member(*m),
                            Some(&stack_bytes(*propose)),
                            *expect,
                            lease,
                        )
                        .await
                        .unwrap();
                }
                Call::Vote { m, id, yes } => {
                    let b = if *yes {
                        Ballot::Yes
                    } else {
                        Ballot::No(format!("{}: no", name(*m)))
                    };
                    store.vote(&g, *id, &name(*m), &b).await.unwrap();
                }
                Call::Finish { id, commit } => {
                    store.finish(&g, *id, *commit).await.unwrap();
                }
                Call::Leave { m } => store.leave(&g, &name(*m)).await.unwrap(),
                Call::Propose(t) => {
                    store.propose(&g, t).await.unwrap();
                }
            }
            let got = store.snapshot(&g).await.unwrap();
            assert_eq!(
                got,
                want,
                "walk {walk}, call {i} ({call:?}) after:\n  {}",
                s.trace.join("\n  ")
            );
            calls += 1;
        }
    }
    println!("the store model matched SqliteStore on {calls} calls in {WALKS} walks");
    assert!(calls > 100, "{calls}");
}
