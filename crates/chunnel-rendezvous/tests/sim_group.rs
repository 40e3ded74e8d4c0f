//! Deterministic simulation of a group (multi-party rendezvous) over a faulty store: thousands
//! of seeds, each reproducible on its own (docs/testing.md, "Deterministic simulation").
//!
//! Per seed, on a current-thread runtime with a paused clock:
//!
//! * **the store**: an in-memory [`Store`] (`MemStore` below; it passes the crate's
//!   `conformance::store_semantics`, like every backend) whose leases run on tokio's clock, so
//!   they expire in virtual time; a seeded fault layer in front of it delays operations,
//!   fails some before they apply and loses the answer of others after they applied, and
//!   has outages (every operation fails for a while);
//! * **the members**: 2 to 4 real [`Participant`]s, each offering the same two stacks (an
//!   exact `ordering` capability, `none` or `total`) in an order drawn from the seed, some
//!   with a policy that refuses one of them;
//! * **events** at times drawn from the seed: proposals by any member (several at once),
//!   crashes (the participant is dropped: its lease runs out), restarts under the same id,
//!   leaves, store outages. Then the faults stop and the group is left alone.
//!
//! Checked on every seed:
//!
//! * **agreement**: every view any member published at epoch `e` names the stack the store
//!   committed for `e` (so no two members are on different stacks for one epoch), and no
//!   epoch is committed twice;
//! * **no switch without a yes**: when a transition commits, every member live at that
//!   moment has a yes ballot on it (checked by a monitor in `MemStore::finish`, apart from the
//!   stores' rule that refuses such a commit, which the planted bugs skip);
//! * **progress when the store is quiet**: every proposal returns, and after the quiet
//!   period no transition is pending and every live member is at the committed epoch with its
//!   stack.
//!
//! The participant reads the wall clock for transition deadlines (`store::now_ms`); the fault
//! layer keeps the deadline's meaning in virtual time: the deadline a snapshot shows is far
//! in the future until the deadline passed in virtual time, then a millisecond in the past
//! until the orphan grace passed too, then 0 (see `Deadlines`).
//!
//! `CHUNNEL_SIM_SEED=<n>` reruns one seed, `CHUNNEL_SIM_SEEDS=<count>` (from
//! `CHUNNEL_SIM_FIRST`, default 0) runs more; `-- --nocapture` prints the totals.

// `tokio_unstable` is tokio's cfg for its unstable API (here: seeding its RNG).
#![allow(unexpected_cfgs)]

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use chunnel::negotiate::{Capability, ChunnelInfo, Pick, StackOption};
use chunnel_rendezvous::machine::ORPHAN_GRACE_MS;
use chunnel_rendezvous::store::{
    Ballot, Committed, JoinReply, Member, Outcome, Snapshot, Store, Transition, now_ms,
};
use chunnel_rendezvous::{Config, Error, Participant, Policy};
use chunnel_test::sim::{Explorer, SimRng, within};
use tokio::time::Instant;

/// Seeds per run of `sim_groups` (CI).
const SEEDS: u64 = 600;

const RERUN: &str = "cargo test -p chunnel-rendezvous --test sim_group -- sim_groups --nocapture";

const GROUP: &str = "g";
const BACKEND: &str = "sim";

// ---------------------------------------------------------------------------------------
// The in-memory store.

#[derive(Debug)]
struct Live {
    member: Member,
    expires: Instant,
}

#[derive(Debug)]
struct Pending {
    t: Transition,
    /// The deadline in virtual time (`Deadlines`).
    deadline: Instant,
}

#[derive(Debug, Default)]
struct GroupRecord {
    committed: Option<Committed>,
    members: BTreeMap<String, Live>,
    pending: Option<Pending>,
    ballots: BTreeMap<String, Ballot>,
    outcome: Option<Outcome>,
}

/// How the committed transitions are checked, and the planted bug.
#[derive(Clone, Copy, Debug, Default)]
struct Checks {
    /// Planted bug: `finish` commits even when told to abort.
    plant_commit_on_abort: bool,
    /// Planted bug (the stores before the late-joiner fix): a commit does not check that
    /// every member live at the finish voted yes.
    plant_no_live_yes_check: bool,
    /// Rewrite transition deadlines into virtual time (off for the conformance run).
    deadlines_in_virtual_time: bool,
}

/// An in-memory store with leases on tokio's clock; it records every committed epoch and
/// checks each commit (`Checks`).
#[derive(Debug, Default)]
struct MemStore {
    groups: Mutex<BTreeMap<String, GroupRecord>>,
    /// Every committed (group, epoch) and its stack.
    history: Mutex<BTreeMap<(String, u64), Bytes>>,
    violations: Mutex<Vec<String>>,
    checks: Checks,
    /// Commits refused for want of a live member's yes, and commits, aborts.
    refused: Mutex<u64>,
    commits: Mutex<u64>,
    aborts: Mutex<u64>,
}

impl MemStore {
    fn new(checks: Checks) -> Self {
        MemStore {
            checks,
            ..MemStore::default()
        }
    }

    fn record(&self, group: &str, c: &Committed) {
        let mut h = self.history.lock().unwrap();
        if let Some(old) = h.insert((group.to_owned(), c.epoch), c.stack.clone())
            && old != c.stack
        {
            self.violations.lock().unwrap().push(format!(
                "epoch {} of {group} committed twice, to different stacks",
                c.epoch
            ));
        }
    }

    fn with<T>(&self, group: &str, f: impl FnOnce(&mut GroupRecord, Instant) -> T) -> T {
        let now = Instant::now();
        let mut gs = self.groups.lock().unwrap();
        let g = gs.entry(group.to_owned()).or_default();
        // Leases run out: the member and its ballot are gone.
        let gone: Vec<String> = g
            .members
            .iter()
            .filter(|(_, l)| l.expires <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            g.members.remove(&id);
            g.ballots.remove(&id);
        }
        f(g, now)
    }

    fn snapshot_of(&self, g: &GroupRecord, now: Instant) -> Snapshot {
        Snapshot {
            committed: g.committed.clone(),
            members: g.members.values().map(|l| l.member.clone()).collect(),
            transition: g.pending.as_ref().map(|p| {
                let mut t = p.t.clone();
                if self.checks.deadlines_in_virtual_time {
                    t.deadline_ms = Deadlines::shown(p.deadline, now);
                }
                t
            }),
            ballots: g
                .ballots
                .iter()
                .map(|(id, b)| (id.clone(), b.clone()))
                .collect(),
            outcome: g.outcome,
        }
    }
}

/// When a lease taken at `now` runs out: capped at ten years (never wrapped), as the stores
/// cap theirs.
fn expiry(now: Instant, lease: Duration) -> Instant {
    let cap = Duration::from_secs(10 * 365 * 86_400);
    now.checked_add(lease.min(cap)).unwrap_or(now + cap)
}

/// Transition deadlines: the participant sets and compares them on the wall clock
/// (`now_ms`), which hardly moves while virtual time runs. The store keeps each deadline in
/// virtual time and shows a snapshot reader a wall-clock value that compares the same way
/// the virtual one would: far ahead before it, just behind now between it and the orphan
/// grace, 0 after both. (A reader that takes more than the grace, 1 s of wall time, between
/// the snapshot and its comparison would see the second case as the third.)
struct Deadlines;

impl Deadlines {
    fn virtual_of(deadline_ms: u64, now: Instant) -> Instant {
        now + Duration::from_millis(deadline_ms.saturating_sub(now_ms()))
    }

    fn shown(deadline: Instant, now: Instant) -> u64 {
        if now <= deadline {
            u64::MAX / 4
        } else if now <= deadline + Duration::from_millis(ORPHAN_GRACE_MS) {
            now_ms().saturating_sub(1)
        } else {
            0
        }
    }
}

impl Store for MemStore {
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
        chunnel_rendezvous::store::check_name("group name", group)?;
        chunnel_rendezvous::store::check_name("member id", &member.id)?;
        let (reply, created) = self.with(group, |g, now| {
            let add = |g: &mut GroupRecord| {
                g.members.insert(
                    member.id.clone(),
                    Live {
                        member: member.clone(),
                        expires: expiry(now, lease),
                    },
                );
            };
            match (&g.committed, propose) {
                (None, Some(stack)) => {
                    g.committed = Some(Committed {
                        epoch: create_epoch.max(1),
                        stack: stack.clone(),
                    });
                    add(g);
                    (
                        JoinReply::Created(self.snapshot_of(g, now)),
                        g.committed.clone(),
                    )
                }
                (Some(c), _) if expect_epoch == Some(c.epoch) => {
                    add(g);
                    (JoinReply::Joined(self.snapshot_of(g, now)), None)
                }
                _ => (JoinReply::Current(self.snapshot_of(g, now)), None),
            }
        });
        if let Some(c) = created {
            self.record(group, &c);
        }
        Ok(reply)
    }

    async fn renew(&self, group: &str, member_id: &str, lease: Duration) -> Result<bool, Error> {
        Ok(
            self.with(group, |g, now| match g.members.get_mut(member_id) {
                Some(l) => {
                    l.expires = expiry(now, lease);
                    true
                }
                None => false,
            }),
        )
    }

    async fn leave(&self, group: &str, member_id: &str) -> Result<(), Error> {
        self.with(group, |g, _| {
            g.members.remove(member_id);
            g.ballots.remove(member_id);
        });
        Ok(())
    }

    async fn snapshot(&self, group: &str) -> Result<Snapshot, Error> {
        Ok(self.with(group, |g, now| self.snapshot_of(g, now)))
    }

    async fn propose(&self, group: &str, t: &Transition) -> Result<bool, Error> {
        Ok(self.with(group, |g, now| {
            if g.committed.as_ref().map(|c| c.epoch) != Some(t.from_epoch) || g.pending.is_some() {
                return false;
            }
            g.pending = Some(Pending {
                t: t.clone(),
                deadline: Deadlines::virtual_of(t.deadline_ms, now),
            });
            g.ballots.clear();
            true
        }))
    }

    async fn vote(
        &self,
        group: &str,
        id: u64,
        member_id: &str,
        ballot: &Ballot,
    ) -> Result<bool, Error> {
        Ok(self.with(group, |g, _| {
            if g.pending.as_ref().map(|p| p.t.id) != Some(id) {
                return false;
            }
            g.ballots.insert(member_id.to_owned(), ballot.clone());
            true
        }))
    }

    // The simulation has no ballot sockets: `attested` is always empty, and the property
    // below holds every commit to the store's ballots alone.
    async fn finish_attested(
        &self,
        group: &str,
        id: u64,
        commit: bool,
        attested: &[String],
    ) -> Result<bool, Error> {
        let committed = self.with(group, |g, _| {
            let planted = !commit && self.checks.plant_commit_on_abort;
            let commit = commit || planted;
            // The stores' rule: a commit needs the yes of every member live now (one that
            // joined after the proposer's last read has had no say yet); nothing is written
            // otherwise.
            if commit
                && !planted
                && !self.checks.plant_no_live_yes_check
                && !g
                    .members
                    .keys()
                    .all(|m| attested.contains(m) || g.ballots.get(m) == Some(&Ballot::Yes))
            {
                *self.refused.lock().unwrap() += 1;
                return None;
            }
            if g.pending.as_ref().map(|p| p.t.id) != Some(id) {
                return None;
            }
            let p = g.pending.take().expect("checked");
            let mut out = Some(None);
            if commit {
                // The property, checked apart from the rule above (which the plants skip).
                for mid in g.members.keys() {
                    if g.ballots.get(mid) == Some(&Ballot::Yes) {
                        continue;
                    }
                    self.violations.lock().unwrap().push(format!(
                        "transition {id:x} (epoch {} -> {}) committed without the yes of live \
                         member {mid} (its ballot: {:?})",
                        p.t.from_epoch,
                        p.t.from_epoch + 1,
                        g.ballots.get(mid)
                    ));
                }
                let c = Committed {
                    epoch: p.t.from_epoch + 1,
                    stack: p.t.stack.clone(),
                };
                g.committed = Some(c.clone());
                out = Some(Some(c));
                *self.commits.lock().unwrap() += 1;
            } else {
                *self.aborts.lock().unwrap() += 1;
            }
            g.ballots.clear();
            g.outcome = Some(Outcome {
                id,
                committed: commit,
            });
            out
        });
        match committed {
            None => Ok(false),
            Some(c) => {
                if let Some(c) = c {
                    self.record(group, &c);
                }
                Ok(true)
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The fault layer.

#[derive(Clone, Copy, Debug)]
struct StoreFaults {
    /// Longest delay before an operation and before its answer.
    max_delay_ms: u64,
    /// An operation fails without applying.
    fail_before: f64,
    /// An operation applies, but its answer is lost (the caller sees an error).
    fail_after: f64,
}

#[derive(Debug)]
struct FaultState {
    rng: SimRng,
    on: bool,
    outage_until: Option<Instant>,
    injected: u64,
    /// The next this many `finish` operations fail before applying (faults on or off).
    fail_finishes: u32,
}

/// [`MemStore`] behind seeded faults.
#[derive(Debug)]
struct SimStore {
    inner: Arc<MemStore>,
    faults: StoreFaults,
    st: Mutex<FaultState>,
}

impl SimStore {
    fn stop_faults(&self) {
        let mut st = self.st.lock().unwrap();
        st.on = false;
        st.outage_until = None;
    }

    fn outage(&self, d: Duration) {
        let mut st = self.st.lock().unwrap();
        if st.on {
            st.outage_until = Some(Instant::now() + d);
        }
    }

    async fn op<T>(&self, f: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        let (before, fail_before, fail_after, after) = {
            let mut st = self.st.lock().unwrap();
            if !st.on {
                (Duration::ZERO, false, false, Duration::ZERO)
            } else {
                let d1 = st.rng.millis(self.faults.max_delay_ms);
                let d2 = st.rng.millis(self.faults.max_delay_ms);
                let b = st.rng.chance(self.faults.fail_before);
                let a = st.rng.chance(self.faults.fail_after);
                let out = st.outage_until.is_some_and(|u| Instant::now() < u);
                st.injected += u64::from(b || a || out);
                (d1, b || out, a, d2)
            }
        };
        if !before.is_zero() {
            tokio::time::sleep(before).await;
        }
        if fail_before {
            return Err(Error::unavailable(
                BACKEND,
                "injected: failed before applying",
            ));
        }
        let r = f.await;
        if !after.is_zero() {
            tokio::time::sleep(after).await;
        }
        if fail_after {
            return Err(Error::unavailable(BACKEND, "injected: the answer was lost"));
        }
        r
    }
}

impl Store for SimStore {
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
        self.op(self.inner.join_creating_at(
            group,
            member,
            propose,
            expect_epoch,
            create_epoch,
            lease,
        ))
        .await
    }
    async fn renew(&self, group: &str, member_id: &str, lease: Duration) -> Result<bool, Error> {
        self.op(self.inner.renew(group, member_id, lease)).await
    }
    async fn leave(&self, group: &str, member_id: &str) -> Result<(), Error> {
        self.op(self.inner.leave(group, member_id)).await
    }
    async fn snapshot(&self, group: &str) -> Result<Snapshot, Error> {
        self.op(self.inner.snapshot(group)).await
    }
    async fn propose(&self, group: &str, t: &Transition) -> Result<bool, Error> {
        self.op(self.inner.propose(group, t)).await
    }
    async fn vote(
        &self,
        group: &str,
        id: u64,
        member_id: &str,
        ballot: &Ballot,
    ) -> Result<bool, Error> {
        self.op(self.inner.vote(group, id, member_id, ballot)).await
    }
    async fn finish_attested(
        &self,
        group: &str,
        id: u64,
        commit: bool,
        attested: &[String],
    ) -> Result<bool, Error> {
        {
            let mut st = self.st.lock().unwrap();
            if st.fail_finishes > 0 {
                st.fail_finishes -= 1;
                return Err(Error::unavailable(BACKEND, "injected: finish failed"));
            }
        }
        self.op(self.inner.finish_attested(group, id, commit, attested))
            .await
    }
}

// ---------------------------------------------------------------------------------------
// The scenario.

const LABELS: [&str; 2] = ["none", "total"];

fn option(label: usize, branch: u8) -> StackOption {
    StackOption {
        chunnels: vec![ChunnelInfo {
            id: "test/order/1".into(),
            capabilities: vec![Capability::exact("ordering", [LABELS[label]])],
        }],
        pick: Pick::from_slice(&[branch]),
    }
}

fn stack_bytes(label: usize) -> Bytes {
    chunnel_negotiate::wire::encode_stack(&option(label, 0).chunnels)
}

#[derive(Clone, Copy, Debug)]
enum Event {
    /// Member proposes the stack `LABELS[label]`.
    Propose(usize, usize),
    Crash(usize),
    Restart(usize),
    Leave(usize),
    Outage(Duration),
}

#[derive(Debug)]
struct Params {
    members: usize,
    /// Each member's preference: its offers are `LABELS[order[0]]`, `LABELS[order[1]]`.
    order: Vec<[usize; 2]>,
    /// A member's policy refuses this label.
    refuses: Vec<Option<usize>>,
    events: Vec<(Duration, Event)>,
    faults: StoreFaults,
    fault_seed: u64,
    config: Config,
}

fn params(seed: u64) -> Params {
    let mut r = SimRng::new(seed);
    let members = r.range(2, 4) as usize;
    let order = (0..members)
        .map(|_| if r.chance(0.5) { [0, 1] } else { [1, 0] })
        .collect();
    let refuses = (0..members)
        .map(|_| r.chance(0.15).then(|| r.below(2) as usize))
        .collect();
    let horizon = 20_000;
    let n = r.range(1, 10);
    let mut events: Vec<(Duration, Event)> = (0..n)
        .map(|_| {
            let at = Duration::from_millis(r.below(horizon));
            let m = r.below(members as u64) as usize;
            let e = match r.below(10) {
                0..=4 => Event::Propose(m, r.below(2) as usize),
                5 => Event::Crash(m),
                6 | 7 => Event::Restart(m),
                8 => Event::Leave(m),
                _ => Event::Outage(r.millis(4_000)),
            };
            (at, e)
        })
        .collect();
    events.sort_by_key(|e| e.0);
    let faults = if r.chance(0.125) {
        StoreFaults {
            max_delay_ms: 0,
            fail_before: 0.0,
            fail_after: 0.0,
        }
    } else {
        StoreFaults {
            max_delay_ms: [0, 5, 50, 300][r.below(4) as usize],
            fail_before: r.below(11) as f64 / 100.0,
            fail_after: r.below(11) as f64 / 100.0,
        }
    };
    let config = Config {
        lease: Duration::from_millis(r.range(1_500, 4_000)),
        renew_every: Duration::from_millis(500),
        poll: Duration::from_millis([20, 50, 100, 200][r.below(4) as usize]),
        // The simulated store has no notifications: only `poll` is used.
        poll_notified: Duration::from_millis(500),
        transition_timeout: Duration::from_millis([300, 1_000, 3_000][r.below(3) as usize]),
        join_attempts: 64,
        op_timeout: Duration::from_millis(500),
        direct_ballots: None,
    };
    Params {
        members,
        order,
        refuses,
        events,
        faults,
        fault_seed: r.fork(),
        config,
    }
}

#[derive(Clone, Debug, Default)]
struct Stats {
    members: u64,
    proposals: u64,
    proposals_ok: u64,
    commits: u64,
    aborts: u64,
    crashes: u64,
    restarts: u64,
    leaves: u64,
    outages: u64,
    store_faults: u64,
    views: u64,
    refused: u64,
    max_epoch: u64,
    virtual_ms: u64,
    fingerprint: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Live,
    Crashed,
    Left,
}

/// One recorded view: (member, epoch, its stack encoded, closed).
type Seen = (usize, u64, Bytes, bool);

/// A current-thread runtime on a paused clock. Built with `--cfg tokio_unstable`, tokio's
/// own random choices (which branch of a `select!` is polled first) are seeded too.
fn runtime(seed: u64) -> tokio::runtime::Runtime {
    let mut b = tokio::runtime::Builder::new_current_thread();
    b.enable_time().start_paused(true);
    #[cfg(tokio_unstable)]
    b.rng_seed(tokio::runtime::RngSeed::from_bytes(&seed.to_le_bytes()));
    let _ = seed;
    b.build().expect("runtime")
}

fn run_seed(seed: u64, checks: Checks) -> Result<Stats, String> {
    let rt = runtime(seed);
    let r = rt.block_on(async {
        within(
            Duration::from_secs(3_600),
            "the whole scenario",
            scenario(seed, checks),
        )
        .await?
    });
    drop(rt);
    r
}

struct Members {
    p: Params,
    store: Arc<SimStore>,
    parts: Vec<Option<Arc<Participant>>>,
    /// Each member's proposals in flight (aborted when it crashes).
    proposing: Vec<Vec<tokio::task::AbortHandle>>,
    status: Vec<Status>,
    seen: Arc<Mutex<Vec<Seen>>>,
    watchers: Vec<tokio::task::JoinHandle<()>>,
}

impl Members {
    fn offers(&self, m: usize) -> Vec<StackOption> {
        let o = self.p.order[m];
        vec![option(o[0], 0), option(o[1], 1)]
    }

    /// Joins (retrying through store faults) and starts recording the member's views.
    async fn join(&mut self, m: usize) -> Result<(), String> {
        let policy: Option<Policy> = self.p.refuses[m].map(|label| {
            let refused = option(label, 0).chunnels;
            Arc::new(move |s: &[ChunnelInfo]| {
                if s == refused.as_slice() {
                    Err(format!("m{m} does not take {}", LABELS[label]))
                } else {
                    Ok(())
                }
            }) as Policy
        });
        let me = Member {
            id: format!("m{m}"),
            addr: format!("10.0.0.{m}:4000"),
        };
        let mut last = None;
        for _ in 0..50 {
            match Participant::join(
                self.store.clone(),
                GROUP,
                me.clone(),
                self.offers(m),
                policy.clone(),
                self.p.config.clone(),
            )
            .await
            {
                Ok(p) => {
                    let mut rx = p.watch();
                    let seen = self.seen.clone();
                    self.watchers.push(tokio::spawn(async move {
                        loop {
                            let v = rx.borrow_and_update().clone();
                            let bytes = chunnel_negotiate::wire::encode_stack(&v.stack);
                            seen.lock()
                                .unwrap()
                                .push((m, v.epoch, bytes, v.closed.is_some()));
                            if rx.changed().await.is_err() {
                                return;
                            }
                        }
                    }));
                    self.parts[m] = Some(Arc::new(p));
                    self.status[m] = Status::Live;
                    return Ok(());
                }
                Err(e @ (Error::Unavailable { .. } | Error::Contended { .. } | Error::Busy(_))) => {
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(format!("m{m} could not join: {e}")),
            }
        }
        Err(format!("m{m} could not join in 50 attempts: {last:?}"))
    }
}

async fn scenario(seed: u64, checks: Checks) -> Result<Stats, String> {
    let p = params(seed);
    let t0 = Instant::now();
    let mem = Arc::new(MemStore::new(checks));
    let store = Arc::new(SimStore {
        inner: mem.clone(),
        faults: p.faults,
        st: Mutex::new(FaultState {
            rng: SimRng::new(p.fault_seed),
            on: true,
            outage_until: None,
            injected: 0,
            fail_finishes: 0,
        }),
    });
    let n = p.members;
    let events = p.events.clone();
    let config = p.config.clone();
    let mut g = Members {
        p,
        store: store.clone(),
        parts: (0..n).map(|_| None).collect(),
        proposing: vec![Vec::new(); n],
        status: vec![Status::Crashed; n],
        seen: Arc::default(),
        watchers: Vec::new(),
    };
    let mut stats = Stats {
        members: n as u64,
        ..Stats::default()
    };
    for m in 0..n {
        g.join(m).await?;
    }
    // Each proposal and leave must return. A command waits for the participant's current
    // step, which may be a rejoin (up to `join_attempts` store operations, each bounded by
    // `op_timeout`), so the bound is generous: what it catches is a wait that never ends.
    let bound = config.transition_timeout
        + Duration::from_millis(ORPHAN_GRACE_MS)
        + config.op_timeout * (config.join_attempts + 16)
        + config.poll * 8;
    let mut proposals = Vec::new();
    let results: Arc<Mutex<Vec<String>>> = Arc::default();
    for (at, e) in events {
        tokio::time::sleep_until(t0 + at).await;
        match e {
            Event::Propose(m, label) => {
                let Some(part) = g.parts[m].clone() else {
                    continue;
                };
                let option = g.p.order[m].iter().position(|&l| l == label).unwrap_or(0);
                stats.proposals += 1;
                let results = results.clone();
                let t = tokio::spawn(async move {
                    let r = within(bound, "a proposal", part.propose(option)).await;
                    // (Without the transition's id, which is random: see docs/testing.md.)
                    let s = match &r {
                        Ok(Ok(())) => "ok".to_owned(),
                        Ok(Err(Error::Aborted { reason, .. })) => format!("aborted: {reason}"),
                        Ok(Err(e)) => format!("{e}"),
                        Err(e) => e.clone(),
                    };
                    results.lock().unwrap().push(format!("m{m}:{label}:{s}"));
                    r.map(|_| ())
                });
                g.proposing[m].push(t.abort_handle());
                proposals.push(t);
            }
            Event::Crash(m) => {
                if g.status[m] == Status::Live {
                    // Its proposals go with it (they hold the participant).
                    for t in g.proposing[m].drain(..) {
                        t.abort();
                    }
                    g.parts[m] = None;
                    g.status[m] = Status::Crashed;
                    stats.crashes += 1;
                }
            }
            Event::Restart(m) => {
                if g.status[m] == Status::Crashed {
                    g.join(m).await?;
                    stats.restarts += 1;
                }
            }
            Event::Leave(m) => {
                if g.status[m] == Status::Live
                    && let Some(part) = g.parts[m].take()
                {
                    let _ = within(bound, "a leave", part.leave()).await?;
                    g.status[m] = Status::Left;
                    stats.leaves += 1;
                }
            }
            Event::Outage(d) => {
                store.outage(d);
                stats.outages += 1;
            }
        }
    }
    // Quiet: no more faults; every proposal returns, leases of the crashed run out,
    // orphaned transitions are aborted.
    store.stop_faults();
    let context = |g: &Members, results: &Mutex<Vec<String>>| {
        let snap = mem.with(GROUP, |gr, now| mem.snapshot_of(gr, now));
        format!(
            "\n  events: {:?}\n  proposals: {:?}\n  status: {:?}\n  store: {snap:?}",
            g.p.events,
            results.lock().unwrap(),
            g.status
        )
    };
    for t in proposals {
        match within(bound * 2, "a proposal's task", t).await? {
            Ok(r) => r.map_err(|e| format!("{e}{}", context(&g, &results)))?,
            Err(e) if e.is_cancelled() => {}
            Err(e) => return Err(format!("a proposal's task panicked: {e}")),
        }
    }
    // Long enough for a crashed member's lease to run out, then for an orphaned transition's
    // deadline and grace to pass, and for every member to read the result.
    let quiet = config.lease
        + config.transition_timeout
        + Duration::from_millis(ORPHAN_GRACE_MS)
        + config.poll * 10
        + Duration::from_secs(2);
    tokio::time::sleep(quiet).await;

    let v = mem.violations.lock().unwrap().clone();
    if let Some(first) = v.first() {
        return Err(format!("{first} ({} violations)", v.len()));
    }
    // Agreement: every view names the stack committed for its epoch.
    let history = mem.history.lock().unwrap().clone();
    let seen = g.seen.lock().unwrap().clone();
    for (m, epoch, stack, closed) in &seen {
        if *closed {
            continue;
        }
        match history.get(&(GROUP.to_owned(), *epoch)) {
            Some(s) if s == stack => {}
            Some(s) => {
                return Err(format!(
                    "m{m} was at epoch {epoch} with stack {:?}, the store committed {:?}",
                    label_of(stack),
                    label_of(s)
                ));
            }
            None => return Err(format!("m{m} was at epoch {epoch}, never committed")),
        }
    }
    // Progress: nothing pending, every live member at the committed epoch.
    let snap = mem
        .snapshot(GROUP)
        .await
        .map_err(|e| format!("snapshot: {e}"))?;
    let committed = snap.committed.clone().ok_or("the group has no stack")?;
    // (A group whose members all crashed or left has nobody to end it.)
    let anyone = (0..n).any(|m| g.status[m] == Status::Live);
    if let Some(t) = &snap.transition
        && anyone
    {
        return Err(format!(
            "a transition is still pending after the quiet period: {t:?}{}",
            context(&g, &results)
        ));
    }
    for m in 0..n {
        if g.status[m] != Status::Live {
            continue;
        }
        let Some(part) = &g.parts[m] else { continue };
        let view = part.view();
        if view.closed.is_some() {
            continue;
        }
        let bytes = chunnel_negotiate::wire::encode_stack(&view.stack);
        if view.epoch != committed.epoch || bytes != committed.stack {
            return Err(format!(
                "after the quiet period m{m} is at epoch {} on {:?}; the group at epoch {} on {:?}",
                view.epoch,
                label_of(&bytes),
                committed.epoch,
                label_of(&committed.stack)
            ));
        }
        if !snap.is_member(&format!("m{m}")) {
            return Err(format!("after the quiet period m{m} is not a member"));
        }
    }
    for w in &g.watchers {
        w.abort();
    }
    stats.proposals_ok = results
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.ends_with(":ok"))
        .count() as u64;
    stats.commits = *mem.commits.lock().unwrap();
    stats.aborts = *mem.aborts.lock().unwrap();
    stats.refused = *mem.refused.lock().unwrap();
    stats.store_faults = store.st.lock().unwrap().injected;
    stats.views = seen.len() as u64;
    stats.max_epoch = committed.epoch;
    stats.virtual_ms = t0.elapsed().as_millis() as u64;
    let mut h = DefaultHasher::new();
    (
        seen,
        results.lock().unwrap().clone(),
        committed.epoch,
        stats.store_faults,
        t0.elapsed().as_nanos(),
    )
        .hash(&mut h);
    stats.fingerprint = h.finish();
    Ok(stats)
}

fn label_of(stack: &Bytes) -> &'static str {
    (0..2)
        .find(|&l| stack_bytes(l) == *stack)
        .map_or("?", |l| LABELS[l])
}

#[test]
fn sim_groups() {
    let ex = Explorer::new("group", RERUN);
    let seeds = ex.seeds(SEEDS);
    let checks = Checks {
        plant_commit_on_abort: false,
        plant_no_live_yes_check: false,
        deadlines_in_virtual_time: true,
    };
    let report = ex
        .run(&seeds, |seed| run_seed(seed, checks))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut t = Stats::default();
    for (_, s) in &report.results {
        t.members += s.members;
        t.proposals += s.proposals;
        t.proposals_ok += s.proposals_ok;
        t.commits += s.commits;
        t.aborts += s.aborts;
        t.crashes += s.crashes;
        t.restarts += s.restarts;
        t.leaves += s.leaves;
        t.outages += s.outages;
        t.store_faults += s.store_faults;
        t.views += s.views;
        t.refused += s.refused;
        t.max_epoch = t.max_epoch.max(s.max_epoch);
        t.virtual_ms += s.virtual_ms;
    }
    println!(
        "simulation `group`: {} seeds ({}..={}) in {:.1} s of wall time, {:.0} s of virtual \
         time; {} members, {} proposals ({} committed by their proposer), {} commits, {} \
         aborts, highest epoch {}; {} crashes, {} restarts, {} leaves, {} outages, {} store \
         operations failed; {} views checked; {} commits refused for want of a live member's yes",
        report.results.len(),
        seeds.first().copied().unwrap_or(0),
        seeds.last().copied().unwrap_or(0),
        report.elapsed.as_secs_f64(),
        t.virtual_ms as f64 / 1000.0,
        t.members,
        t.proposals,
        t.proposals_ok,
        t.commits,
        t.aborts,
        t.max_epoch,
        t.crashes,
        t.restarts,
        t.leaves,
        t.outages,
        t.store_faults,
        t.views,
        t.refused,
    );
    // (Not when one seed runs, or runs again and again.)
    if seeds.first() != seeds.last() {
        assert!(
            t.commits > 0 && t.aborts > 0 && t.crashes > 0 && t.restarts > 0,
            "{t:?}"
        );
        assert!(t.leaves > 0 && t.outages > 0 && t.store_faults > 0, "{t:?}");
    }
}

#[test]
fn mem_store_has_the_store_semantics() {
    let _one = chunnel_test::sim::exclusive();
    let rt = runtime(0);
    rt.block_on(chunnel_rendezvous::conformance::store_semantics(
        &MemStore::new(Checks::default()),
        "conf",
    ));
}

/// Planted bug: the store's `finish` commits even when told to abort (a refusal, a
/// deadline). The check at each commit must catch it.
#[test]
fn planted_commit_on_abort_is_caught() {
    let ex = Explorer::new(
        "planted: commit on abort",
        "cargo test -p chunnel-rendezvous --test sim_group -- planted_commit_on_abort",
    );
    let seeds: Vec<u64> = (0..200).collect();
    let e = ex
        .run(&seeds, |seed| {
            run_seed(
                seed,
                Checks {
                    plant_commit_on_abort: true,
                    plant_no_live_yes_check: false,
                    deadlines_in_virtual_time: true,
                },
            )
        })
        .expect_err("the planted bug must be caught");
    println!("{e}");
    assert!(e.contains("without the yes"), "{e}");
}

/// Planted bug: the stores before the late-joiner fix (a commit checked the ballots only in
/// the proposer's last snapshot, so a member that joined between that read and the finish
/// was switched without its yes; model_transitions.rs keeps that counterexample). Rare here:
/// it needs a join at the wrong moment, about one seed in a thousand, and the right
/// interleaving (see docs/testing.md), so this runs until it is caught, up to 20,000 seeds.
#[test]
#[ignore = "long: about a minute or more in debug"]
fn planted_finish_without_the_live_yes_check_is_caught() {
    let ex = Explorer::new(
        "planted: no live-yes check at the finish",
        "cargo test -p chunnel-rendezvous --test sim_group -- --ignored planted_finish_without",
    );
    let seeds: Vec<u64> = (0..20_000).collect();
    let e = ex
        .run(&seeds, |seed| {
            run_seed(
                seed,
                Checks {
                    plant_commit_on_abort: false,
                    plant_no_live_yes_check: true,
                    deadlines_in_virtual_time: true,
                },
            )
        })
        .expect_err("the planted bug must be caught");
    println!("{e}");
    assert!(e.contains("without the yes"), "{e}");
}

/// A member alone in its group proposes; the store fails its finish once (before applying).
/// (Was a bug, found by `sim_groups`: the member remembered the transition as finished and
/// never finished it again, so it stayed pending for good: no later transition could start and
/// the proposal never returned. Now a failed finish is decided again on the next snapshot.)
#[test]
fn bug_a_failed_finish_left_the_transition_pending() {
    let _one = chunnel_test::sim::exclusive();
    let rt = runtime(0);
    rt.block_on(async {
        let mem = Arc::new(MemStore::new(Checks {
            deadlines_in_virtual_time: true,
            ..Checks::default()
        }));
        let store = Arc::new(SimStore {
            inner: mem.clone(),
            faults: StoreFaults {
                max_delay_ms: 0,
                fail_before: 0.0,
                fail_after: 0.0,
            },
            st: Mutex::new(FaultState {
                rng: SimRng::new(0),
                on: false,
                outage_until: None,
                injected: 0,
                fail_finishes: 1,
            }),
        });
        let me = Member {
            id: "m0".into(),
            addr: "10.0.0.0:4000".into(),
        };
        let p = Participant::join(
            store,
            GROUP,
            me,
            vec![option(0, 0), option(1, 1)],
            None,
            Config::default(),
        )
        .await
        .expect("join");
        within(Duration::from_secs(60), "the proposal", p.propose(1))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .expect("a lone member's proposal commits");
        let snap = mem.snapshot(GROUP).await.unwrap();
        assert_eq!(snap.epoch(), 2);
        assert!(snap.transition.is_none(), "{snap:?}");
    });
}

/// Two runs of a seed take the same path (the same views in the same order, the same
/// proposal results, store faults and virtual time) when tokio's own random choices are
/// seeded too, which needs `--cfg tokio_unstable`:
///
/// ```sh
/// RUSTFLAGS="--cfg tokio_unstable" CARGO_TARGET_DIR=target/sim-replay cargo test \
///   -p chunnel-rendezvous --test sim_group -- --include-ignored sim_group_runs_replay_exactly
/// ```
#[test]
#[cfg_attr(
    not(tokio_unstable),
    ignore = "exact replay needs --cfg tokio_unstable (tokio seeds select! only there)"
)]
fn sim_group_runs_replay_exactly() {
    let seeds: Vec<u64> = (0..200).collect();
    let ex = Explorer::new(
        "group replay",
        "RUSTFLAGS=\"--cfg tokio_unstable\" CARGO_TARGET_DIR=target/sim-replay cargo test \
         -p chunnel-rendezvous --test sim_group -- --include-ignored sim_group_runs_replay_exactly",
    );
    let checks = Checks {
        plant_commit_on_abort: false,
        plant_no_live_yes_check: false,
        deadlines_in_virtual_time: true,
    };
    let r = ex
        .replay(
            &seeds,
            |seed| run_seed(seed, checks),
            |x| x.fingerprint,
            |_| false,
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let differ: Vec<u64> = r.differ.iter().map(|d| d.0).collect();
    println!(
        "group replay: {} of {} seeds took another path",
        differ.len(),
        seeds.len()
    );
    assert!(
        differ.is_empty(),
        "seeds that took another path: {differ:?}"
    );
}
