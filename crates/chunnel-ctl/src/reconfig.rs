//! [`ReconfigSwitch`]: the [`Switch`] handle of a reconfigurable select's connection.

use std::fmt;
use std::sync::Arc;

use chunnel::{Handover, Mechanism, ReconfigConnection, Side};
use chunnel_negotiate::commit::{Coordinator, Outcome};

use crate::registry::{BoxFuture, Mode, Switch, Switched};

/// Switches a [`ReconfigConnection`]: unilaterally with
/// [`ReconfigConnection::reconfigure`], and by two-phase commit with the peer through a
/// `chunnel-negotiate` [`Coordinator`] if one is given
/// ([`with_coordinator`](Self::with_coordinator)).
pub struct ReconfigSwitch<L: chunnel::ChunnelConnection, R, M: Mechanism> {
    conn: ReconfigConnection<L, R, M>,
    names: [String; 2],
    coordinator: Option<Arc<Coordinator>>,
    unilateral: bool,
}

impl<L: chunnel::ChunnelConnection, R, M: Mechanism> fmt::Debug for ReconfigSwitch<L, R, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReconfigSwitch")
            .field("names", &self.names)
            .field("commit", &self.coordinator.is_some())
            .field("unilateral", &self.unilateral)
            .finish_non_exhaustive()
    }
}

impl<L, R, M> ReconfigSwitch<L, R, M>
where
    L: Handover + 'static,
    R: Handover<Data = L::Data> + 'static,
    L::Data: 'static,
    M: Mechanism,
{
    /// The handle of `conn` (a clone: they share the connection), whose left and right
    /// branches are called `left` and `right`. Unilateral switches only, until a
    /// coordinator is given.
    pub fn new(
        conn: ReconfigConnection<L, R, M>,
        left: impl Into<String>,
        right: impl Into<String>,
    ) -> Self {
        ReconfigSwitch {
            conn,
            names: [left.into(), right.into()],
            coordinator: None,
            unilateral: true,
        }
    }

    /// Switches by two-phase commit go through `coordinator`.
    pub fn with_coordinator(mut self, coordinator: Arc<Coordinator>) -> Self {
        self.coordinator = Some(coordinator);
        self
    }

    /// Whether this end may switch alone (default true). Set false when the branches are
    /// not wire compatible: a unilateral switch is then refused, and only `--commit` works.
    pub fn with_unilateral(mut self, allowed: bool) -> Self {
        self.unilateral = allowed;
        self
    }
}

fn side(i: usize) -> Side {
    if i == 0 { Side::Left } else { Side::Right }
}

impl<L, R, M> Switch for ReconfigSwitch<L, R, M>
where
    L: Handover + 'static,
    R: Handover<Data = L::Data> + 'static,
    L::Data: 'static,
    M: Mechanism,
    ReconfigConnection<L, R, M>: Send + Sync,
{
    fn branches(&self) -> Vec<String> {
        self.names.to_vec()
    }

    fn current(&self) -> usize {
        match self.conn.side() {
            Side::Left => 0,
            Side::Right => 1,
        }
    }

    fn epoch(&self) -> u64 {
        self.conn.switches()
    }

    fn commit_only(&self) -> bool {
        !self.unilateral
    }

    fn switch(&self, to: usize, mode: Mode) -> BoxFuture<'_, Result<Switched, String>> {
        Box::pin(async move {
            let to = side(to);
            match mode {
                Mode::Unilateral if !self.unilateral => Err(
                    "this connection's branches are not wire compatible: it switches only together with its peer (--commit)"
                        .into(),
                ),
                Mode::Unilateral => match self.conn.reconfigure(to).await {
                    Ok(changed) => Ok(Switched {
                        changed,
                        detail: if changed {
                            "switched unilaterally".into()
                        } else {
                            "already on that branch".into()
                        },
                    }),
                    Err(e) => Err(format!("switch failed, the connection stays: {e}")),
                },
                Mode::Commit => {
                    let Some(c) = &self.coordinator else {
                        return Err("this connection has no two-phase-commit coordinator: switch it without --commit".into());
                    };
                    match c.switch(to).await {
                        Ok(Outcome::Switched) => Ok(Switched {
                            changed: true,
                            detail: "switched by two-phase commit: the peer agreed and both ends switched".into(),
                        }),
                        Ok(Outcome::Unchanged) => Ok(Switched {
                            changed: false,
                            detail: "already on that branch".into(),
                        }),
                        Ok(Outcome::Contended(why)) => Err(format!(
                            "another switch was in progress ({why:?}); nothing changed, retry"
                        )),
                        Ok(Outcome::Aborted(why)) => {
                            Err(format!("the switch was aborted ({why:?}); nothing changed"))
                        }
                        Err(e) => Err(format!("switch failed: {e}")),
                    }
                }
            }
        })
    }
}
