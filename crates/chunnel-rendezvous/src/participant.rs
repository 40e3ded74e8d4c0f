//! The async driver of [`crate::machine::Machine`]: joins a group through a [`Store`], keeps
//! the lease alive, reads the group record when the store notifies a change ([`Store::watch`])
//! and at least every [`Config::poll`] (every [`Config::poll_notified`] while notifications
//! work), votes, finishes transitions, and publishes what it sees as a [`View`].
//!
//! With [`Config::with_direct_ballots`], it also holds a UDP ballot socket: the transitions it
//! proposes name it (a [`BallotBox`]) and it counts the ballot datagrams that arrive there;
//! on transitions that name another member's box it sends its ballot there, resends it every
//! [`DirectBallots::resend`] until it sees the outcome, and writes it to the store after
//! [`DirectBallots::fallback`] (docs/wire.md §15.4).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use chunnel::negotiate::{ChunnelInfo, StackOption};
use tokio::sync::{mpsc, oneshot, watch};

use tokio::net::UdpSocket;

use crate::Error;
use crate::ballot::{BallotBox, DirectBallot, MAX_DATAGRAM};
use crate::machine::{Action, Machine, Policy, join_choice};
use crate::store::{Changes, JoinReply, Member, News, Snapshot, Store, Watch, now_ms};

/// Timing of a participant.
#[derive(Clone, Debug)]
pub struct Config {
    /// The lease on our membership: a participant that dies without leaving disappears from
    /// the group this long after its last renewal.
    pub lease: Duration,
    /// How often the lease is renewed (default a third of the lease).
    pub renew_every: Duration,
    /// How often the group record is read (membership changes, transitions) while the store
    /// does not notify changes (it has no notifications, its notification stream is down, or
    /// they cover only some writers, as SQLite's do while this process has no wake-up
    /// socket): the delay with which a participant
    /// notices a change then.
    pub poll: Duration,
    /// How often the group record is read while the store notifies every change
    /// ([`Watch::is_complete`]): a participant reads at once on a notification, and this
    /// slower poll is the fallback that covers a lost notification and what no write
    /// announces (a transition's deadline passing).
    pub poll_notified: Duration,
    /// How long a proposer waits for every vote before it aborts.
    pub transition_timeout: Duration,
    /// Attempts at the join compare-and-swap before [`Error::Contended`].
    pub join_attempts: u32,
    /// Bound on each store operation (a store that hangs counts as unavailable).
    pub op_timeout: Duration,
    /// Ballots as datagrams to the proposer (docs/wire.md §15.4); `None` (the default):
    /// every ballot goes through the store.
    pub direct_ballots: Option<DirectBallots>,
}

/// The ballot socket of a participant that sends and collects ballots directly
/// ([`Config::with_direct_ballots`]).
#[derive(Clone, Debug)]
pub struct DirectBallots {
    /// Where the ballot socket is bound (port 0: any).
    pub bind: SocketAddr,
    /// The address other members send ballots to; `None`: the bound address (which must then
    /// not be unspecified, e.g. `0.0.0.0`).
    pub advertise: Option<SocketAddr>,
    /// How often a member resends its ballot datagram until it sees the outcome.
    pub resend: Duration,
    /// How long a member waits for the outcome after its first datagram before it writes its
    /// ballot to the store as well (datagrams may all be lost; the store always decides).
    pub fallback: Duration,
    /// Testing aid: the number of this participant's first ballot datagrams that are not sent
    /// (as if lost).
    #[doc(hidden)]
    pub drop_first: u32,
}

impl Config {
    /// Sends and collects ballots as datagrams on a UDP socket bound at `bind` (docs/wire.md
    /// §15.4), with a resend interval of 10 ms and a store fallback after 250 ms. Members
    /// without it, and proposers without it, use the store only; a group may mix both.
    pub fn with_direct_ballots(mut self, bind: SocketAddr) -> Config {
        self.direct_ballots = Some(DirectBallots {
            bind,
            advertise: None,
            resend: Duration::from_millis(10),
            fallback: Duration::from_millis(250),
            drop_first: 0,
        });
        self
    }

    /// The address other members reach our ballot socket at (for a socket bound to an
    /// unspecified address, or behind a translation); needs [`Config::with_direct_ballots`].
    pub fn with_advertised_ballots(mut self, addr: SocketAddr) -> Config {
        if let Some(d) = &mut self.direct_ballots {
            d.advertise = Some(addr);
        }
        self
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            lease: Duration::from_secs(3),
            renew_every: Duration::from_secs(1),
            poll: Duration::from_millis(20),
            poll_notified: Duration::from_millis(500),
            transition_timeout: Duration::from_secs(3),
            join_attempts: 64,
            op_timeout: Duration::from_secs(3),
            direct_ballots: None,
        }
    }
}

/// What a participant knows about its group, republished whenever it changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    /// The epoch this participant sends at.
    pub epoch: u64,
    /// Our option (index into our offers) in use at `epoch`.
    pub option: usize,
    /// The committed stack.
    pub stack: Vec<ChunnelInfo>,
    /// Live members, sorted by id (as of the last successful read).
    pub members: Vec<Member>,
    /// A prepared next epoch and our option for it (we voted yes on a pending transition).
    pub prepared: Option<(u64, usize)>,
    /// Whether the last store operation succeeded.
    pub store_reachable: bool,
    /// Set when this participant is out of the group for good (incompatible switch, or left).
    pub closed: Option<String>,
}

enum Command {
    Propose {
        option: usize,
        reply: oneshot::Sender<Result<(), Error>>,
    },
    Leave {
        reply: oneshot::Sender<Result<(), Error>>,
    },
}

/// A member of a group: the result of [`Participant::join`].
///
/// Dropping it stops the background task without leaving (the lease then runs out, like a
/// crash); call [`Participant::leave`] to leave at once.
#[derive(Debug)]
pub struct Participant {
    view: watch::Receiver<View>,
    cmd: mpsc::Sender<Command>,
    task: tokio::task::JoinHandle<()>,
    created: bool,
    id: String,
}

impl Drop for Participant {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn bounded<T>(
    backend: &'static str,
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r,
        Err(_) => Err(Error::unavailable(
            backend,
            format!("no answer within {limit:?}"),
        )),
    }
}

fn random_id(_seed: &str) -> u64 {
    chunnel::util::random_u64()
}

/// The epoch a member at `epoch` re-creates a group the store lost at: above its own, and
/// above any another member can hold from before the loss, taken as the wall clock in
/// microseconds (a group commits far fewer transitions than microseconds pass between its
/// creation and its loss), so one epoch number never names two stacks. Correct as long as
/// the re-creating host's clock is not behind by more than the time since the group was last
/// created (docs/wire.md §15.2).
fn recreation_epoch(epoch: u64) -> u64 {
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2));
    now_us.max(epoch.saturating_add(1))
}

/// The join protocol: propose our first option by compare-and-swap, else join the committed
/// stack with our first compatible option. Returns (snapshot after joining, epoch, option,
/// created). A group it creates starts at `create_epoch`.
async fn join_once<St: Store>(
    store: &St,
    group: &str,
    me: &Member,
    offers: &[StackOption],
    propose: Option<usize>,
    create_epoch: u64,
    config: &Config,
) -> Result<(Snapshot, u64, usize, bool), Error> {
    let proposal = propose.map(|i| chunnel_negotiate::wire::encode_stack(&offers[i].chunnels));
    let mut expect = None;
    for _ in 0..config.join_attempts {
        let reply = bounded(
            store.backend(),
            config.op_timeout,
            store.join_creating_at(
                group,
                me,
                proposal.as_ref(),
                expect,
                create_epoch,
                config.lease,
            ),
        )
        .await?;
        let snap = match reply {
            JoinReply::Created(s) => {
                let epoch = s.epoch();
                return Ok((s, epoch, propose.unwrap_or(0), true));
            }
            JoinReply::Joined(s) => {
                let c = s
                    .committed
                    .as_ref()
                    .ok_or(Error::Corrupt("joined a group with no stack"))?;
                let stack = chunnel_negotiate::wire::decode_stack(&c.stack)?;
                let option = join_choice(&stack, offers).map_err(|_| {
                    Error::Busy("the group switched to another stack while we joined")
                })?;
                return Ok((s.clone(), c.epoch, option, false));
            }
            JoinReply::Current(s) => s,
        };
        let Some(c) = &snap.committed else {
            if proposal.is_none() {
                // The group vanished between reads and we have nothing to propose: retry
                // proposing our first option.
                return Box::pin(join_once(
                    store,
                    group,
                    me,
                    offers,
                    Some(0),
                    create_epoch,
                    config,
                ))
                .await;
            }
            continue;
        };
        let stack = chunnel_negotiate::wire::decode_stack(&c.stack)?;
        match join_choice(&stack, offers) {
            Ok(_) => expect = Some(c.epoch),
            Err(mismatches) => {
                let first = mismatches
                    .first()
                    .map_or_else(|| "none reported".to_owned(), |m| m.to_string());
                return Err(Error::Incompatible {
                    group: group.to_owned(),
                    epoch: c.epoch,
                    mismatches,
                    first,
                });
            }
        }
    }
    Err(Error::Contended {
        group: group.to_owned(),
        attempts: config.join_attempts,
    })
}

impl Participant {
    /// Joins `group` as `me` with `offers` (our stack options in preference order, e.g.
    /// `stack.offers()`): creates the group with our first option if it has no stack, else
    /// joins its committed stack with our first compatible option, else fails with
    /// [`Error::Incompatible`] (nothing is written to the group then).
    ///
    /// `policy` may refuse proposed transitions (beyond compatibility). Must be called inside a
    /// tokio runtime; the participant's task runs there.
    pub async fn join<St: Store>(
        store: Arc<St>,
        group: &str,
        me: Member,
        offers: Vec<StackOption>,
        policy: Option<Policy>,
        config: Config,
    ) -> Result<Participant, Error> {
        if offers.is_empty() {
            return Err(Error::NothingOffered);
        }
        crate::store::check_name("group name", group)?;
        crate::store::check_name("member id", &me.id)?;
        let ballots = match &config.direct_ballots {
            Some(d) => {
                let sock = UdpSocket::bind(d.bind).await?;
                let addr = d.advertise.unwrap_or(sock.local_addr()?);
                if addr.ip().is_unspecified() {
                    return Err(Error::Io(std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "a ballot socket bound to an unspecified address needs an advertised address",
                    )));
                }
                Some((Arc::new(sock), addr))
            }
            None => None,
        };
        let (snap, epoch, option, created) =
            join_once(&*store, group, &me, &offers, Some(0), 1, &config).await?;
        let view = View {
            epoch,
            option,
            stack: offers[option].chunnels.clone(),
            members: snap.members.clone(),
            prepared: None,
            store_reachable: true,
            closed: None,
        };
        let (view_tx, view_rx) = watch::channel(view);
        let (cmd_tx, cmd_rx) = mpsc::channel(8);
        let id = me.id.clone();
        let machine = Machine::new(me.id.clone(), offers, policy, epoch, option);
        let driver = Driver {
            store,
            group: group.to_owned(),
            me,
            config,
            machine,
            view: view_tx,
            pending: None,
            notified: false,
            ballots,
            out_vote: None,
            dropped: 0,
        };
        let task = tokio::spawn(driver.run(cmd_rx));
        Ok(Participant {
            view: view_rx,
            cmd: cmd_tx,
            task,
            created,
            id,
        })
    }

    /// Whether this participant created the group (its proposal won the compare-and-swap).
    pub fn created(&self) -> bool {
        self.created
    }

    /// Our member id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The current view.
    pub fn view(&self) -> View {
        self.view.borrow().clone()
    }

    /// A receiver told of every change (membership, epoch, reachability of the store).
    pub fn watch(&self) -> watch::Receiver<View> {
        self.view.clone()
    }

    /// Proposes switching the group to our option `option`; returns once the transition
    /// committed (every live member voted yes; everyone then switches) or fails with
    /// [`Error::Aborted`] (a refusal, or no vote before the timeout: the group stays on its
    /// stack) or [`Error::Busy`] (another transition is pending).
    pub async fn propose(&self, option: usize) -> Result<(), Error> {
        let (reply, rx) = oneshot::channel();
        self.cmd
            .send(Command::Propose { option, reply })
            .await
            .map_err(|_| Error::Closed)?;
        rx.await.map_err(|_| Error::Closed)?
    }

    /// Leaves the group at once (the store forgets us) and stops the background task.
    pub async fn leave(&self) -> Result<(), Error> {
        let (reply, rx) = oneshot::channel();
        self.cmd
            .send(Command::Leave { reply })
            .await
            .map_err(|_| Error::Closed)?;
        rx.await.map_err(|_| Error::Closed)?
    }
}

/// What one read of the record led a participant to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wrote {
    Nothing,
    /// A ballot (and no decision).
    Vote,
    /// A commit or an abort.
    Decision,
}

/// The next notification of `watch`; never, without one.
async fn changed(watch: &mut Option<Watch>) -> Changes {
    match watch {
        Some(w) => w.changed().await,
        None => std::future::pending().await,
    }
}

/// Our proposal in flight: its id, who to tell, and why we aborted it (if we did).
type Proposal = (u64, oneshot::Sender<Result<(), Error>>, Option<String>);

struct Driver<St: Store> {
    store: Arc<St>,
    group: String,
    me: Member,
    config: Config,
    machine: Machine,
    view: watch::Sender<View>,
    /// Our own proposal in flight: its id and who to tell.
    pending: Option<Proposal>,
    /// Whether the store's notifications covered every write when the current event began
    /// ([`Watch::is_complete`]).
    notified: bool,
    /// Our ballot socket and its advertised address ([`Config::direct_ballots`]).
    ballots: Option<(Arc<UdpSocket>, SocketAddr)>,
    /// Our ballot datagram in flight (resent until we see the outcome).
    out_vote: Option<OutVote>,
    /// Ballot datagrams not sent so far ([`DirectBallots::drop_first`]).
    dropped: u32,
}

/// A ballot sent as a datagram, until the transition's outcome is seen.
struct OutVote {
    /// The transition.
    id: u64,
    /// The proposer's ballot box.
    to: SocketAddr,
    /// The datagram.
    datagram: Vec<u8>,
    /// The ballot, for the store fallback.
    ballot: crate::store::Ballot,
    /// When to resend.
    next: tokio::time::Instant,
    /// When to write the ballot to the store too.
    fallback_at: tokio::time::Instant,
}

/// The next datagram on `sock`; never, without a socket.
async fn recv_ballot(sock: Option<&UdpSocket>, buf: &mut [u8]) -> std::io::Result<usize> {
    match sock {
        Some(s) => s.recv_from(buf).await.map(|(n, _)| n),
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`; never, without one.
async fn sleep_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl<St: Store> Driver<St> {
    fn backend(&self) -> &'static str {
        self.store.backend()
    }

    fn set_reachable(&self, ok: bool) {
        self.view.send_if_modified(|v| {
            let changed = v.store_reachable != ok;
            v.store_reachable = ok;
            changed
        });
    }

    /// The poll interval now: the slow one while `watch` notifies every change.
    fn poll_every(&self, watch: Option<&Watch>) -> Duration {
        match watch {
            Some(w) if w.is_complete() => self.config.poll_notified.max(self.config.poll),
            _ => self.config.poll,
        }
    }

    /// Whether notified `changes` call for reading the record now: anything but ballots, which
    /// only a proposer waiting for them acts on.
    fn wants(&self, changes: Changes) -> bool {
        changes.intersects(Changes::MEMBERS | Changes::TRANSITION)
            || (changes.intersects(Changes::BALLOTS) && self.pending.is_some())
    }

    async fn run(mut self, mut cmd: mpsc::Receiver<Command>) {
        let mut watch = self.store.watch(&self.group);
        // The first read is at once; then every `poll_every`, counted from when a read
        // started (a late read moves the next one later, it does not bunch them up).
        let mut next_poll = tokio::time::Instant::now();
        let mut renew = tokio::time::interval(self.config.renew_every);
        renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        renew.tick().await;
        // While our proposal is pending: the ballots' notifications, from a store whose main
        // watch leaves them out (`Store::watch_ballots`).
        let mut ballots: Option<Watch> = None;
        let sock = self.ballots.as_ref().map(|(s, _)| s.clone());
        let mut buf = vec![0u8; MAX_DATAGRAM + 1];
        loop {
            self.notified = watch.as_ref().is_some_and(Watch::is_complete);
            if self.pending.is_none() {
                ballots = None;
            }
            let resend_at = self.out_vote.as_ref().map(|o| o.next.min(o.fallback_at));
            tokio::select! {
                r = recv_ballot(sock.as_deref(), &mut buf) => {
                    if let Ok(n) = r
                        && self.on_datagram(&buf[..n]).await.is_err()
                    {
                        return;
                    }
                }
                () = sleep_opt(resend_at) => self.resend().await,
                c = cmd.recv() => match c {
                    Some(Command::Propose { option, reply }) => {
                        ballots = self.propose(option, reply).await;
                    }
                    Some(Command::Leave { reply }) => {
                        let r = bounded(self.backend(), self.config.op_timeout,
                            self.store.leave(&self.group, &self.me.id)).await;
                        self.view.send_modify(|v| v.closed = Some("left the group".into()));
                        let _ = reply.send(r);
                        return;
                    }
                    None => return,
                },
                _ = renew.tick() => {
                    match bounded(self.backend(), self.config.op_timeout,
                        self.store.renew(&self.group, &self.me.id, self.config.lease)).await {
                        Ok(true) => self.set_reachable(true),
                        Ok(false) => {
                            self.rejoin().await;
                        }
                        Err(e) => {
                            tracing::warn!(group = %self.group, error = %e, "lease renewal failed");
                            self.set_reachable(false);
                        }
                    }
                }
                () = tokio::time::sleep_until(next_poll) => {
                    next_poll = tokio::time::Instant::now() + self.poll_every(watch.as_ref());
                    if self.step().await.is_err() {
                        return;
                    }
                }
                changes = changed(&mut ballots) => {
                    let now = tokio::time::Instant::now();
                    if changes.is_empty() {
                        // The ballots' watch went down (or up): poll fast meanwhile.
                        next_poll = next_poll.min(now + self.config.poll);
                    } else if self.pending.is_some() && self.step().await.is_err() {
                        return;
                    }
                }
                changes = changed(&mut watch) => {
                    self.notified = watch.as_ref().is_some_and(Watch::is_complete);
                    let now = tokio::time::Instant::now();
                    let mut read = self.wants(changes);
                    // News (the change itself) spares the read it would call for, unless
                    // something else changed too, or the machine needs the whole record.
                    if let Some(news) = watch.as_mut().and_then(Watch::take_news) {
                        match self.on_news(&news).await {
                            Ok(true) => {}
                            Ok(false) => read = self.wants(changes.without(Changes::TRANSITION)),
                            Err(()) => return,
                        }
                    }
                    if read {
                        next_poll = now + self.poll_every(watch.as_ref());
                        if self.step().await.is_err() {
                            return;
                        }
                    } else {
                        // The watch's state changed: a stream that went down brings the next
                        // read forward to the fast poll.
                        next_poll = next_poll.min(now + self.poll_every(watch.as_ref()));
                    }
                }
            }
        }
    }

    /// Proposes a transition to our option `option`; the watch on its ballots, if the store
    /// has a separate one ([`Store::watch_ballots`]), opened before the proposal is written so
    /// no ballot goes unnotified.
    async fn propose(
        &mut self,
        option: usize,
        reply: oneshot::Sender<Result<(), Error>>,
    ) -> Option<Watch> {
        if self.pending.is_some() {
            let _ = reply.send(Err(Error::Busy("this participant's proposal is pending")));
            return None;
        }
        let id = random_id(&self.me.id);
        let deadline = now_ms() + self.config.transition_timeout.as_millis() as u64;
        let Some(mut t) = self.machine.proposal(id, option, deadline) else {
            let _ = reply.send(Err(Error::Busy("no such option")));
            return None;
        };
        t.ballot_box = self.ballots.as_ref().map(|&(_, addr)| BallotBox {
            addr,
            token: u128::from(chunnel::util::random_u64()) << 64
                | u128::from(chunnel::util::random_u64()),
        });
        let mut ballots = self.store.watch_ballots(&self.group);
        // With a ballot box, store ballots come only after the members' fallback delay: the
        // watch has that long to come up (meanwhile the fast poll covers them).
        if let Some(w) = ballots.as_mut().filter(|_| t.ballot_box.is_none()) {
            // Until it covers every write (else the fast poll covers the ballots).
            let _ = tokio::time::timeout(self.config.op_timeout, async {
                while !w.is_complete() {
                    w.changed().await;
                }
            })
            .await;
        }
        match bounded(
            self.backend(),
            self.config.op_timeout,
            self.store.propose(&self.group, &t),
        )
        .await
        {
            Ok(true) => {
                self.pending = Some((id, reply, None));
                let members = self.view.borrow().members.clone();
                match self.machine.proposed(&t, &members) {
                    // With a ballot box our own vote needs no read (and, alone, we decide).
                    Some(actions) => {
                        for action in actions {
                            if self.execute(action).await.is_err() {
                                break;
                            }
                        }
                    }
                    // Vote (and, alone, decide) at once rather than at the next poll.
                    None => {
                        let _ = self.step().await;
                    }
                }
            }
            Ok(false) => {
                let _ = reply.send(Err(Error::Busy(
                    "another transition is pending, or the group moved to another epoch",
                )));
            }
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        }
        ballots
    }

    /// Joins again; the group record the join returned, if it succeeded.
    async fn rejoin(&mut self) -> Option<Snapshot> {
        let offers = self.machine.offers().to_vec();
        match join_once(
            &*self.store,
            &self.group,
            &self.me,
            &offers,
            Some(self.machine.option()),
            recreation_epoch(self.machine.epoch()),
            &self.config,
        )
        .await
        {
            Ok((snap, epoch, option, created)) => {
                tracing::info!(group = %self.group, member = %self.me.id, epoch, created, "rejoined");
                // A group the store lost and someone re-created may hold another stack at
                // our epoch number: follow the stack, not only the number.
                if epoch != self.machine.epoch() || option != self.machine.option() {
                    self.machine.rejoined(epoch, option);
                    // The members with the epoch, in one update: the old list belongs to the
                    // old epoch (a re-created group starts with whoever re-joined so far).
                    self.view.send_modify(|v| {
                        v.epoch = epoch;
                        v.option = option;
                        v.stack = offers[option].chunnels.clone();
                        v.members = snap.members.clone();
                    });
                }
                self.set_reachable(true);
                Some(snap)
            }
            Err(e) => {
                tracing::warn!(group = %self.group, error = %e, "rejoin failed");
                self.set_reachable(false);
                None
            }
        }
    }

    /// Reads the group record and acts on it; reads again at once (at most twice more) after
    /// writing a decision, and after writing a vote unless notifications are complete (the
    /// vote's own notification then brings the read to the member it concerns, the
    /// proposer), so a proposer does not wait a poll for its own writes, and knows the epoch
    /// its commit installed before it handles its next command. `Err` ends the participant.
    async fn step(&mut self) -> Result<(), ()> {
        for _ in 0..3 {
            match self.step_once().await? {
                Wrote::Nothing => break,
                Wrote::Vote if self.notified => break,
                Wrote::Vote | Wrote::Decision => {}
            }
        }
        Ok(())
    }

    /// One read of the group record and the actions it implies; what it wrote.
    async fn step_once(&mut self) -> Result<Wrote, ()> {
        let mut snap = match bounded(
            self.backend(),
            self.config.op_timeout,
            self.store.snapshot(&self.group),
        )
        .await
        {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(group = %self.group, error = %e, "snapshot failed");
                self.set_reachable(false);
                return Ok(Wrote::Nothing);
            }
        };
        self.set_reachable(true);
        let mut wrote = Wrote::Nothing;
        for action in self.machine.on_snapshot(&snap, now_ms()) {
            match action {
                Action::Finish { .. } => wrote = Wrote::Decision,
                Action::Vote { direct, .. }
                    if wrote == Wrote::Nothing && (direct.is_none() || self.ballots.is_none()) =>
                {
                    wrote = Wrote::Vote
                }
                _ => {}
            }
            match action {
                Action::Rejoin => {
                    // The group as the join left it replaces this (older) read below.
                    if let Some(joined) = self.rejoin().await {
                        snap = joined;
                    }
                }
                action => self.execute(action).await?,
            }
        }
        // Our ballot datagram's transition is over (or was never seen by this read's store).
        if let Some(o) = &self.out_vote
            && snap.transition.as_ref().map(|t| t.id) != Some(o.id)
        {
            self.out_vote = None;
        }
        // Membership, and a prepared epoch that never came (aborted).
        let aborted = snap.transition.is_none();
        self.view.send_if_modified(|v| {
            let mut changed = false;
            if v.members != snap.members {
                v.members = snap.members.clone();
                changed = true;
            }
            if aborted && v.prepared.is_some() {
                v.prepared = None;
                changed = true;
            }
            changed
        });
        // Our proposal's fate: the recorded outcome if it is still ours; else, once our
        // transition is no longer pending, it was decided, and (only its proposer commits a
        // transition, and we answer our own successful finish at once) aborted by another
        // member. The outcome alone is not enough: another transition may finish before we
        // read it, and overwrite it.
        if let Some((id, _, _)) = &self.pending {
            let id = *id;
            if let Some(o) = snap.outcome
                && o.id == id
            {
                self.answer(id, o.committed);
            } else if snap.transition.as_ref().map(|t| t.id) != Some(id) {
                self.answer(id, false);
            }
        }
        Ok(wrote)
    }

    /// Carries out one action of the machine other than [`Action::Rejoin`] (which needs the
    /// read it came from). `Err` ends the participant.
    async fn execute(&mut self, action: Action) -> Result<(), ()> {
        match action {
            Action::Rejoin => {
                self.rejoin().await;
            }
            Action::Prepare { epoch, option } => {
                self.view
                    .send_modify(|v| v.prepared = Some((epoch, option)));
            }
            Action::Vote {
                id,
                ballot,
                direct,
                from_epoch,
            } => match (direct, &self.config.direct_ballots) {
                (Some(bb), Some(d)) if self.ballots.is_some() => {
                    let datagram = DirectBallot {
                        token: bb.token,
                        group: self.group.clone(),
                        id,
                        from_epoch,
                        member: self.me.id.clone(),
                        ballot: ballot.clone(),
                    }
                    .encode();
                    let now = tokio::time::Instant::now();
                    self.out_vote = Some(OutVote {
                        id,
                        to: bb.addr,
                        datagram,
                        ballot,
                        next: now + d.resend,
                        fallback_at: now + d.fallback,
                    });
                    self.send_out_vote().await;
                }
                _ => self.store_vote(id, &ballot).await,
            },
            Action::Finish {
                id,
                commit,
                reason,
                attested,
            } => {
                if let Some((pid, _, why)) = &mut self.pending
                    && *pid == id
                {
                    *why = Some(reason.clone());
                }
                match bounded(
                    self.backend(),
                    self.config.op_timeout,
                    self.store
                        .finish_attested(&self.group, id, commit, &attested),
                )
                .await
                {
                    // We ended our own proposal: we know its fate without reading it back
                    // (the outcome may be overwritten by another transition before then),
                    // and, for one we counted ourselves, the stack it installed.
                    Ok(true) => {
                        for action in self.machine.finished_own(id, commit) {
                            Box::pin(self.execute(action)).await?;
                        }
                        self.answer(id, commit);
                    }
                    // Not pending any more, or (a commit) someone live has not said yes:
                    // decide again on the next read.
                    Ok(false) => self.machine.finish_refused(id),
                    Err(e) => {
                        tracing::warn!(group = %self.group, error = %e, "finishing a transition failed");
                        // Decide again on the next snapshot that still shows it pending.
                        self.machine.finish_refused(id);
                    }
                }
            }
            Action::Switch { epoch, option } => {
                let stack = self.machine.offers()[option].chunnels.clone();
                self.view.send_modify(|v| {
                    v.epoch = epoch;
                    v.option = option;
                    v.stack = stack;
                    v.prepared = None;
                });
            }
            Action::Incompatible { epoch, mismatches } => {
                let why = format!(
                    "the group switched to a stack (epoch {epoch}) we cannot build: {}",
                    mismatches
                        .first()
                        .map_or_else(String::new, |m| m.to_string())
                );
                tracing::error!(group = %self.group, "{why}");
                let _ = self.store.leave(&self.group, &self.me.id).await;
                self.view.send_modify(|v| v.closed = Some(why));
                return Err(());
            }
        }
        Ok(())
    }

    /// Acts on a notification's `news` alone if the machine can ([`Machine::on_news`]);
    /// whether the record must still be read for it.
    async fn on_news(&mut self, news: &News) -> Result<bool, ()> {
        let Some(actions) = self.machine.on_news(news) else {
            return Ok(true);
        };
        for action in actions {
            self.execute(action).await?;
        }
        if let News::Finished { outcome, .. } = news {
            if self.out_vote.as_ref().is_some_and(|o| o.id == outcome.id) {
                self.out_vote = None;
            }
            if !outcome.committed {
                self.view.send_if_modified(|v| v.prepared.take().is_some());
            }
            self.answer(outcome.id, outcome.committed);
        }
        Ok(false)
    }

    /// Writes our ballot on `id` to the store.
    async fn store_vote(&mut self, id: u64, ballot: &crate::store::Ballot) {
        if let Err(e) = bounded(
            self.backend(),
            self.config.op_timeout,
            self.store.vote(&self.group, id, &self.me.id, ballot),
        )
        .await
        {
            tracing::warn!(group = %self.group, error = %e, "vote failed");
        }
    }

    /// Sends our ballot datagram (unless a test drops it).
    async fn send_out_vote(&mut self) {
        let (Some(o), Some((sock, _)), Some(d)) =
            (&self.out_vote, &self.ballots, &self.config.direct_ballots)
        else {
            return;
        };
        if self.dropped < d.drop_first {
            self.dropped += 1;
            return;
        }
        if let Err(e) = sock.send_to(&o.datagram, o.to).await {
            tracing::debug!(group = %self.group, error = %e, "sending a ballot failed");
        }
    }

    /// Our ballot datagram's timer: resend it, or, past the fallback delay, write the ballot
    /// to the store (and stop resending: the store path decides from then on).
    async fn resend(&mut self) {
        let Some(o) = &mut self.out_vote else {
            return;
        };
        let now = tokio::time::Instant::now();
        if now >= o.fallback_at {
            let (id, ballot) = (o.id, o.ballot.clone());
            self.out_vote = None;
            self.store_vote(id, &ballot).await;
            return;
        }
        let resend = self
            .config
            .direct_ballots
            .as_ref()
            .map_or(Duration::from_millis(10), |d| d.resend);
        o.next = now + resend;
        self.send_out_vote().await;
    }

    /// A datagram on our ballot socket: a ballot on our proposal counts (see
    /// [`Machine::on_ballot`]); anything else is dropped. `Err` ends the participant.
    async fn on_datagram(&mut self, bytes: &[u8]) -> Result<(), ()> {
        let b = match DirectBallot::decode(bytes) {
            Ok(b) if b.group == self.group => b,
            Ok(_) => return Ok(()),
            Err(e) => {
                tracing::debug!(group = %self.group, error = %e, "dropped a datagram");
                return Ok(());
            }
        };
        let actions = self.machine.on_ballot(&b);
        let decided = !actions.is_empty();
        for action in actions {
            self.execute(action).await?;
        }
        // A finish the store refused (a member we did not know joined) or that failed: read
        // and decide again. (One it applied has answered and switched us already.)
        if decided && self.pending.is_some() {
            self.step().await?;
        }
        Ok(())
    }

    /// Tells the caller of our pending proposal `id` (if it is still waiting) how it ended.
    fn answer(&mut self, id: u64, committed: bool) {
        if !matches!(&self.pending, Some((pid, _, _)) if *pid == id) {
            return;
        }
        let (id, reply, why) = self.pending.take().expect("checked");
        let r = if committed {
            Ok(())
        } else {
            Err(Error::Aborted {
                id,
                reason: why.unwrap_or_else(|| "aborted by another member".to_owned()),
            })
        };
        let _ = reply.send(r);
    }
}
