//! The in-band control plane of a negotiated connection, type erased: the seam between the
//! connection that reads the messages ([`crate::Tagged`]) and the reconfiguration coordinator
//! that acts on them ([`crate::commit::Coordinator`]). Both depend on this module, neither on
//! the other.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::multilateral::{Event, Multilateral, ProposeError};

/// The in-band control channel of a negotiated connection (its [`Tagged`](crate::Tagged) base), type
/// erased: what [`crate::commit::Coordinator`] needs to run a two-phase commit on it.
#[derive(Clone)]
pub(crate) struct Control(pub(crate) Arc<dyn ControlPlane>);

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Control")
    }
}

/// Where the two-phase-commit machine's time comes from: the coordinator's timer and the
/// receive path read it, the machine itself never does ([`crate::commit::Multilateral`]
/// takes `now` as an argument). Inject one with
/// [`Coordinator::start_with_clock`](crate::commit::Coordinator::start_with_clock).
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> Instant;
}

/// Tokio's clock, as a [`std::time::Instant`]: the wall clock, unless the runtime's time is
/// paused (`tokio::time::pause`), when it moves only as the paused runtime advances it. The
/// default of [`Coordinator::start`](crate::commit::Coordinator::start).
#[derive(Clone, Copy, Debug, Default)]
pub struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }
}

pub(crate) type SendFuture<'a> =
    Pin<Box<dyn Future<Output = Result<(), chunnel::Error>> + Send + 'a>>;

/// See [`Control`]. Off the data path: boxed futures are fine here.
pub(crate) trait ControlPlane: Send + Sync {
    /// Starts feeding reconfiguration messages to `machine`, at the times `clock` reads.
    fn enable(&self, machine: Multilateral, clock: Arc<dyn Clock>) -> Option<mpsc::Receiver<Work>>;
    fn machine(&self) -> Option<&Mutex<Multilateral>>;
    /// Proposes `pick` as transaction `txn` under the machine's lock; on success calls
    /// `proposed` (still under the lock, before any answer can be handled) and queues the
    /// prepare for the coordinator's task behind everything queued before. `None` if
    /// reconfiguration is not enabled.
    fn propose(
        &self,
        pick: &chunnel::Pick,
        txn: u64,
        proposed: &mut dyn FnMut(),
    ) -> Option<Result<(), ProposeError>>;
    fn send(&self, m: Bytes) -> SendFuture<'_>;
    /// The connection's id (see [`Negotiated::conn_id`](crate::Negotiated::conn_id)).
    fn conn_id(&self) -> u64;
    /// Closes the connection (see [`Negotiated::close`](crate::Negotiated::close)).
    fn close(&self) -> SendFuture<'_>;
    /// A client connection's best-effort CLOSE when it is dropped (see [`Negotiated`](crate::Negotiated)); no
    /// wait. Nothing on the server side or when the connection is already over.
    fn close_on_drop(self: Arc<Self>);
}

/// What the receive path and [`Coordinator::switch`](crate::commit::Coordinator::switch) hand the coordinator's task, in the
/// order the state machine produced it: the task sends every control message of this end, so
/// the peer receives them in that order.
#[derive(Debug)]
pub(crate) enum Work {
    /// An event of the state machine.
    Event(Event),
    /// A message to send (a vote, an abort).
    Send(Bytes),
    /// This end's proposal of `txn` (its prepare): a failure to send it ends the switch.
    Propose {
        /// The transaction.
        txn: u64,
        /// The prepare.
        msg: Bytes,
    },
}
