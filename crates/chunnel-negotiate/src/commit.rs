//! Multilateral reconfiguration: the peers of a connection agree to switch to another stack
//! by a two-phase commit carried in-band (paper §6.2), as a sans-IO state machine.
//!
//! ```text
//! initiator                                   follower
//!   propose(option)
//!   PREPARE(txn, option)           -->        decide: policy, then the first own option
//!                                             compatible with `option` (same rule as
//!                                             negotiation)
//!                                  <--        VOTE(txn, yes: pick | no: reason)
//!   yes: switch; COMMIT(txn) is
//!        the first message of the
//!        new stack                 -->        switch; DONE(txn) is its first message
//!                                  <--        DONE(txn)
//!   no, or no vote in time:
//!        ABORT(txn)                -->        stay
//! ```
//!
//! Guarantees, on a base connection that delivers in order and without loss (Unix datagram
//! or stream sockets, TCP, or any base under a reliability Chunnel):
//!
//! * **No switch without agreement.** The initiator switches only on the follower's yes for
//!   the current transaction; the follower switches only on a commit of a transaction it voted
//!   yes on. A commit for anything else is ignored, so a faulty peer cannot force a switch.
//! * **A defined switch point per direction.** `COMMIT` is the last message the initiator
//!   sends on the old stack and marks where its messages change stack; `DONE` does the same
//!   for the follower. The driver switches its receive side exactly at the marker, so no
//!   message is decoded by the wrong stack, lost or delivered twice.
//! * **`Switched` means both ends show it.** Each end records its new branch (the
//!   connection's `side()`) at its switch point, before its marker leaves: the initiator
//!   before `COMMIT`, the follower before `DONE`. So when [`Coordinator::switch`] returns
//!   [`Outcome::Switched`] (on the follower's `DONE`), the peer's `side()` already shows the
//!   new branch, and so does this end's.
//! * **Refusal or silence leaves the old stack.** A no vote, or no vote before the deadline
//!   (the initiator then sends `ABORT`), ends the transaction with nothing switched. A follower
//!   that voted yes waits for the initiator's decision (it keeps the old stack meanwhile):
//!   deciding alone could switch one side only.
//! * **Concurrent proposals.** If both ends propose at once, the larger `txn` wins; the other
//!   proposer aborts its own (reported as [`Contention::Superseded`]) and votes on the winner's.
//! * **Each transaction acted on once; repeats until answered.** Each end remembers its last
//!   finished transactions and how they ended: a late or repeated `PREPARE`, `COMMIT` or vote
//!   of one of them gets the recorded answer (the same refusal; `DONE` again; `ABORT` again),
//!   never a second vote or switch. A follower that voted yes resends its vote, and an
//!   initiator that committed resends `COMMIT`, every [`Policy::resend_after`] until the
//!   answer arrives, so a lost decision or `DONE` does not stall the ends (on a base that may
//!   lose, duplicate or reorder these messages the exchange stays safe and makes progress;
//!   the switch points still need the in-order lossless base for the data around them).
//!
//! ## Contention: one outcome, retry
//!
//! A switch that could not run because another switch was in progress — this end was already
//! in one (its own or its peer's), the peer was (its vote said busy), or both ends proposed at
//! once and the peer's proposal won — ends in one shape: [`Outcome::Contended`] from
//! [`Coordinator::switch`] ([`Event::Contended`] from the machine). Nothing was switched by
//! that call; retry it. The [`Contention`] it carries says which case it was, for logs; the
//! retry decision does not need it. A retry converges: once the other switch is over, it
//! proposes again, or returns [`Outcome::Unchanged`] if the other switch already went where
//! this one asked. When both ends may propose, pause a short random time before retrying, so
//! that the two do not keep colliding.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use chunnel::{Handover, Mechanism, Offers, ReconfigConnection, Side, StackOption};
use tokio::sync::{Notify, mpsc, oneshot};

use crate::driver::Negotiated;
use crate::multilateral::txn_msg;
pub use crate::plane::{Clock, TokioClock};
use crate::plane::{Control as ControlPlaneHandle, Work};
use crate::wire::{Refusal, Tag};
use crate::{Error, wire::WireError};

pub use crate::multilateral::{AbortReason, Contention, Event, Multilateral, Policy, ProposeError};

/// How a switch proposed with [`Coordinator::switch`] ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Both ends switched. When [`Coordinator::switch`] returns this, the connection's
    /// `side()` shows the new branch at both ends (each end records it before its switch
    /// point's marker leaves, and this outcome waits for the peer's), this end sends on the
    /// new stack, and the peer's messages arrive on it from its switch point on.
    Switched,
    /// The connection already ran on that branch; nothing was sent.
    Unchanged,
    /// Another switch was in progress — at this end, at the peer, or both ends proposed at
    /// once and the peer's proposal won — so this one did not run: **retry** (see the
    /// [module docs](self#contention-one-outcome-retry)). The [`Contention`] says which; the
    /// decision to retry does not depend on it.
    Contended(Contention),
    /// Nothing switched, and retrying will not change that by itself (the peer refused by
    /// policy or incompatibility, did not answer in time, or the initiator aborted); the
    /// connection goes on with the old stack.
    Aborted(AbortReason),
}

impl Outcome {
    /// The outcome as a metric label.
    fn label(&self) -> &'static str {
        match self {
            Outcome::Switched => "switched",
            Outcome::Unchanged => "unchanged",
            Outcome::Contended(_) => "contended",
            Outcome::Aborted(_) => "aborted",
        }
    }
}

/// Runs multilateral reconfiguration on one negotiated connection whose stack is a
/// reconfigurable select ([`chunnel::Select::reconfigurable`]) over the negotiated base.
/// Start one at each end (the end that does not propose follows its peer's switches); an end
/// without a coordinator ignores the protocol, so its peer's proposals time out.
///
/// The protocol runs in-band: control messages are handled when the connection's receive
/// path reads them, so each end must keep receiving (as any application reading its
/// connection does) for a switch to complete. The base must deliver in order without loss
/// (see the [module docs](self)).
pub struct Coordinator {
    shared: Arc<CoordShared>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator").finish_non_exhaustive()
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct CoordShared {
    control: ControlPlaneHandle,
    offers: Vec<StackOption>,
    waiters: Mutex<HashMap<u64, oneshot::Sender<Result<Outcome, Error>>>>,
    /// The driver re-reads the machine's timer.
    kick: Notify,
    refusals: Mutex<Vec<(Refusal, String)>>,
    /// The machine's time.
    clock: Arc<dyn Clock>,
    /// The branch the connection runs on now.
    side: Box<dyn Fn() -> Side + Send + Sync>,
}

use chunnel::util::lock;

impl Coordinator {
    /// Starts the protocol on `conn`; `stack` is the reconfigurable select it was built from
    /// (its options are what this end can switch between). Must run within a tokio runtime.
    /// The machine's timers run on tokio's clock ([`TokioClock`]), so a runtime whose time is
    /// paused drives them.
    pub fn start<L, R, M, S>(
        conn: &Negotiated<ReconfigConnection<L, R, M>>,
        stack: &S,
        policy: Policy,
    ) -> Result<Coordinator, Error>
    where
        L: Handover + 'static,
        R: Handover<Data = L::Data> + 'static,
        L::Data: 'static,
        M: Mechanism,
        S: Offers,
    {
        Self::start_with_clock(conn, stack, policy, Arc::new(TokioClock))
    }

    /// As [`Coordinator::start`], with the machine's time read from `clock`. The task still
    /// waits on tokio's timer, for the time `clock` says is left until the machine's next
    /// timeout, and then gives the machine `clock`'s time.
    pub fn start_with_clock<L, R, M, S>(
        conn: &Negotiated<ReconfigConnection<L, R, M>>,
        stack: &S,
        policy: Policy,
        clock: Arc<dyn Clock>,
    ) -> Result<Coordinator, Error>
    where
        L: Handover + 'static,
        R: Handover<Data = L::Data> + 'static,
        L::Data: 'static,
        M: Mechanism,
        S: Offers,
    {
        let offers = stack.offers();
        let control = conn.control().clone();
        let events = control
            .0
            .enable(
                Multilateral::new(offers.clone(), policy),
                Arc::clone(&clock),
            )
            .ok_or(Error::Wire(WireError(
                "multilateral reconfiguration is already running on this connection",
            )))?;
        let shared = Arc::new(CoordShared {
            control,
            offers,
            waiters: Mutex::new(HashMap::new()),
            kick: Notify::new(),
            refusals: Mutex::new(Vec::new()),
            clock,
            side: Box::new({
                let conn = conn.get_ref().clone();
                move || conn.side()
            }),
        });
        let task = tokio::spawn(drive(Arc::clone(&shared), conn.get_ref().clone(), events));
        Ok(Coordinator { shared, task })
    }

    /// Proposes to switch both ends to branch `to` of the select and waits for the outcome:
    /// [`Outcome::Switched`] once both ends have switched (this end switched on the peer's
    /// yes, and the peer's switch point has arrived), [`Outcome::Contended`] if another
    /// switch was in progress (retry), [`Outcome::Aborted`] if the peer refused or did not
    /// answer in time, [`Outcome::Unchanged`] if the connection already runs on `to`. Errors
    /// are for what no retry fixes: this end may not propose, `to` is not an option, the
    /// connection failed.
    ///
    /// On `Switched`, both ends agree: the peer recorded its new branch before it sent the
    /// switch point this waited for, so its `side()` (`ReconfigConnection::side`) already
    /// returns `to`, as this end's does. There is nothing further to wait for.
    pub async fn switch(&self, to: Side) -> Result<Outcome, Error> {
        crate::obs::switch(to, Outcome::label, self.switch_inner(to)).await
    }

    async fn switch_inner(&self, to: Side) -> Result<Outcome, Error> {
        let sh = &*self.shared;
        if (sh.side)() == to {
            return Ok(Outcome::Unchanged);
        }
        let bit = match to {
            Side::Left => 0,
            Side::Right => 1,
        };
        let pick = sh
            .offers
            .iter()
            .find(|o| o.pick.branches().first() == Some(&bit))
            .map(|o| o.pick.clone())
            .ok_or(Error::NoOptions(chunnel::Error::BadPick {
                what: "no option of the select on that branch",
            }))?;
        let txn = new_txn();
        let (tx, rx) = oneshot::channel();
        let mut tx = Some(tx);
        // The prepare goes to the coordinator's task behind the control messages queued
        // before it (sent from here, it could overtake an abort of an earlier proposal and
        // reach the peer after that transaction ended: the peer would vote on a proposal
        // nobody waits for, and wait for its decision forever).
        let proposed = sh.control.0.propose(&pick, txn, &mut || {
            if let Some(tx) = tx.take() {
                lock(&sh.waiters).insert(txn, tx);
            }
        });
        match proposed {
            None => {
                return Err(Error::Wire(WireError(
                    "multilateral reconfiguration is not enabled",
                )));
            }
            Some(Ok(())) => {}
            Some(Err(ProposeError::Busy)) => return Ok(Outcome::Contended(Contention::Local)),
            Some(Err(e)) => return Err(Error::Propose(e)),
        }
        sh.kick.notify_one();
        rx.await
            .map_err(|_| Error::Chunnel(chunnel::Error::Closed))?
    }

    /// The peer's proposals this end refused, with the reason sent back (oldest first).
    pub fn refusals(&self) -> Vec<(Refusal, String)> {
        lock(&self.shared.refusals).clone()
    }
}

fn new_txn() -> u64 {
    chunnel::util::random_u64()
}

/// The coordinator's task: acts on the machine's events and timer.
async fn drive<L, R, M>(
    sh: Arc<CoordShared>,
    conn: ReconfigConnection<L, R, M>,
    mut events: mpsc::Receiver<Work>,
) where
    L: Handover + 'static,
    R: Handover<Data = L::Data> + 'static,
    L::Data: 'static,
    M: Mechanism,
{
    let Some(machine) = sh.control.0.machine() else {
        return;
    };
    loop {
        let deadline = lock(machine).poll_timeout();
        let timer = async {
            match deadline {
                Some(d) => tokio::time::sleep(d.saturating_duration_since(sh.clock.now())).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            w = events.recv() => match w {
                Some(Work::Event(e)) => on_event(&sh, &conn, e).await,
                Some(Work::Send(m)) => {
                    let _ = sh.control.0.send(m).await;
                }
                Some(Work::Propose { txn, msg }) => {
                    if let Err(e) = sh.control.0.send(msg).await {
                        finish(&sh, txn, Err(Error::Chunnel(e)));
                    }
                }
                None => return,
            },
            () = timer => {
                let (out, evs): (Vec<Bytes>, Vec<Event>) = {
                    let mut m = lock(machine);
                    m.handle_timeout(sh.clock.now());
                    (
                        std::iter::from_fn(|| m.poll_transmit()).collect(),
                        std::iter::from_fn(|| m.poll_event()).collect(),
                    )
                };
                for msg in out {
                    let _ = sh.control.0.send(msg).await;
                }
                for e in evs {
                    on_event(&sh, &conn, e).await;
                }
            }
            () = sh.kick.notified() => {}
        }
    }
}

fn finish(sh: &CoordShared, txn: u64, r: Result<Outcome, Error>) {
    if let Some(w) = lock(&sh.waiters).remove(&txn) {
        let _ = w.send(r);
    }
}

async fn on_event<L, R, M>(sh: &CoordShared, conn: &ReconfigConnection<L, R, M>, e: Event)
where
    L: Handover + 'static,
    R: Handover<Data = L::Data> + 'static,
    L::Data: 'static,
    M: Mechanism,
{
    crate::obs::commit_event(&e);
    match e {
        Event::Switch { txn, pick, marker } => {
            let to = if pick.branches().first() == Some(&1) {
                Side::Right
            } else {
                Side::Left
            };
            let control = &sh.control;
            // Only observed (features `metrics`, `tracing`): off, no lock is taken for it.
            #[cfg(any(feature = "metrics", feature = "tracing"))]
            let initiator = lock(&sh.waiters).contains_key(&txn);
            #[cfg(not(any(feature = "metrics", feature = "tracing")))]
            let initiator = false;
            let r = crate::obs::switch_point(
                initiator,
                txn,
                conn.switch_with_marker(to, || control.0.send(marker)),
            )
            .await;
            match r {
                // The proposer learns the outcome when the peer's switch point arrives.
                Ok(()) => {}
                Err(e) => {
                    // Nothing switched here. An initiator tells its peer (which waits for
                    // the decision); a follower's peer has switched already, so the
                    // connection cannot continue.
                    if lock(&sh.waiters).contains_key(&txn) {
                        let abort = txn_msg(Tag::Abort, txn);
                        let _ = sh.control.0.send(abort).await;
                    }
                    finish(sh, txn, Err(Error::Chunnel(e)));
                }
            }
        }
        Event::Aborted { txn, reason } => finish(sh, txn, Ok(Outcome::Aborted(reason))),
        Event::Contended { txn, contention } => finish(sh, txn, Ok(Outcome::Contended(contention))),
        Event::Refused {
            reason, message, ..
        } => lock(&sh.refusals).push((reason, message)),
        // The proposer's transaction is complete; a follower has no waiter.
        Event::PeerSwitched { txn } => finish(sh, txn, Ok(Outcome::Switched)),
    }
}
