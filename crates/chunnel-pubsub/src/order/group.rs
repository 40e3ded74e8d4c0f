//! An ordering group (feature `group`): publishers and receivers of one ordered topic agree on
//! the [`Mode`] through a chunnel-rendezvous store, and switch it as receivers come and go.

use std::sync::Arc;

use chunnel::{Offers, select};
use chunnel_rendezvous::{Config, Participant, Store, View};
use tokio::sync::watch;

use super::{Mode, OrderOffer};
use crate::Error;

/// What a member of an ordering group does (its member id is the name with a prefix:
/// `pub-` or `sub-`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Publishes (takes the mode from the group).
    Publisher,
    /// Receives (counted by the policy).
    Receiver,
}

impl Role {
    fn prefix(self) -> &'static str {
        match self {
            Role::Publisher => "pub-",
            Role::Receiver => "sub-",
        }
    }
}

/// The default policy (paper §7.2, issue 23): with one receiver (or none) the broker orders
/// (one lane, nothing to reorder); with several, receiver-side ordering over many lanes.
pub fn by_receivers(receivers: usize) -> Mode {
    if receivers <= 1 {
        Mode::Service
    } else {
        Mode::Receiver
    }
}

/// One member of an ordering group (see [`join`]).
#[derive(Debug)]
pub struct OrderGroup {
    participant: Participant,
    view: watch::Receiver<View>,
    modes: [Mode; 2],
}

/// Joins the ordering group `group` in `store` as `role` named `name`, offering both modes
/// over `lanes` lanes with `prefer` first: a new group starts in `prefer`; an existing one in
/// whatever it committed (members with another lane count are refused:
/// [`chunnel_rendezvous::Error::Incompatible`]).
pub async fn join<St: Store>(
    store: Arc<St>,
    group: &str,
    role: Role,
    name: &str,
    lanes: u32,
    prefer: Mode,
    config: Config,
) -> Result<Arc<OrderGroup>, Error> {
    let modes = [prefer, prefer.other()];
    let offers = select(
        OrderOffer {
            mode: modes[0],
            lanes,
        },
        OrderOffer {
            mode: modes[1],
            lanes,
        },
    )
    .offers();
    let me = chunnel_rendezvous::Member {
        id: format!("{}{name}", role.prefix()),
        addr: "-".into(),
    };
    let participant = Participant::join(store, group, me, offers, None, config).await?;
    let view = participant.watch();
    Ok(Arc::new(OrderGroup {
        participant,
        view,
        modes,
    }))
}

impl OrderGroup {
    /// The mode this member uses now.
    pub fn mode(&self) -> Mode {
        self.modes[self.view.borrow().option.min(1)]
    }

    /// The epoch this member is at.
    pub fn epoch(&self) -> u64 {
        self.view.borrow().epoch
    }

    /// Receivers in the group (as of this member's last read of the store).
    pub fn receivers(&self) -> usize {
        let prefix = Role::Receiver.prefix();
        self.view
            .borrow()
            .members
            .iter()
            .filter(|m| m.id.starts_with(prefix))
            .count()
    }

    /// The rendezvous participant (its view, its watch).
    pub fn participant(&self) -> &Participant {
        &self.participant
    }

    /// Proposes the mode `policy` wants for the number of receivers, if the group is in the
    /// other: returns the mode switched to once every member voted and it committed, `None`
    /// when no switch was needed or another member's transition was in the way
    /// (call again later).
    pub async fn adapt(&self, policy: impl Fn(usize) -> Mode) -> Result<Option<Mode>, Error> {
        let want = policy(self.receivers());
        if want == self.mode() {
            return Ok(None);
        }
        let option = usize::from(self.modes[1] == want);
        match self.participant.propose(option).await {
            Ok(()) => Ok(Some(want)),
            Err(chunnel_rendezvous::Error::Busy(_) | chunnel_rendezvous::Error::Aborted { .. }) => {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Runs [`OrderGroup::adapt`] with `policy` whenever this member's view of the group
    /// changes (a receiver joins or leaves, a switch commits), and again every 50 ms while the
    /// policy wants another mode than the group's (a proposal that lost to another's): the
    /// group follows its receivers with no call from the application. The task ends when the
    /// group is dropped, or when aborted through the handle.
    pub fn follow(self: &Arc<Self>, policy: fn(usize) -> Mode) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        let mut changes = self.participant.watch();
        tokio::spawn(async move {
            loop {
                let Some(g) = weak.upgrade() else { return };
                if let Err(e) = g.adapt(policy).await {
                    tracing::debug!(error = %e, "ordering group: proposal failed");
                }
                let settled = policy(g.receivers()) == g.mode();
                drop(g);
                if settled {
                    if changes.changed().await.is_err() {
                        return;
                    }
                } else {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        })
    }

    /// Leaves the group at once.
    pub async fn leave(&self) -> Result<(), Error> {
        Ok(self.participant.leave().await?)
    }
}
