//! Negotiation metadata: what each Chunnel tells the negotiator about itself, and how a stack
//! of Chunnels and `Select`s flattens into the options a peer can pick from.
//!
//! The negotiation *protocol* lives elsewhere; this module holds the types it works on:
//!
//! * [`Negotiate`] is implemented by every leaf Chunnel: a stable id, its [`Capability`]s, an
//!   availability check and a hook told which branch was picked.
//! * [`Offers`] is implemented by leaves (through [`Negotiate`]), by [`crate::Stack`] and by
//!   [`crate::Select`]: it enumerates every concrete stack a tree of selects allows
//!   ([`StackOption`]), in preference order, and applies a [`Pick`] — the compact nonce naming
//!   the chosen branch of every select on the chosen path.

use std::borrow::Cow;

use crate::Error;

/// How a capability must be matched between peers (paper §5.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Match {
    /// Both ends must carry an equal capability (serialization formats, framing).
    Exact,
    /// One end carrying it suffices (client-side sharding, a local transform).
    Compositional,
}

/// One capability of a Chunnel: a typed, opaque set of labels with a matching rule.
///
/// `kind` names the capability type (`"serialize"`, `"shard"`...). Two capabilities are
/// compared only when their kinds are equal, with the rule of that kind (see
/// [`Capability::compatible`]). Chunnel authors define new kinds freely.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Capability {
    /// The capability type, e.g. `"serialize"`.
    pub kind: Cow<'static, str>,
    /// Exact-match or compositional.
    pub matching: Match,
    /// The labels; for an exact capability the sets must be equal, for a compositional one
    /// they must intersect (or the capability be present on one side only).
    pub labels: Vec<Cow<'static, str>>,
}

impl Capability {
    /// An exact-match capability of `kind` with the given labels.
    pub fn exact(
        kind: impl Into<Cow<'static, str>>,
        labels: impl IntoIterator<Item = impl Into<Cow<'static, str>>>,
    ) -> Self {
        Capability {
            kind: kind.into(),
            matching: Match::Exact,
            labels: labels.into_iter().map(Into::into).collect(),
        }
    }

    /// A compositional capability of `kind` with the given labels.
    pub fn compositional(
        kind: impl Into<Cow<'static, str>>,
        labels: impl IntoIterator<Item = impl Into<Cow<'static, str>>>,
    ) -> Self {
        Capability {
            kind: kind.into(),
            matching: Match::Compositional,
            labels: labels.into_iter().map(Into::into).collect(),
        }
    }

    /// The default compatibility rule between two capabilities of the same kind: equal label
    /// sets for [`Match::Exact`], a non-empty intersection for [`Match::Compositional`].
    pub fn compatible(&self, other: &Capability) -> bool {
        if self.kind != other.kind || self.matching != other.matching {
            return false;
        }
        match self.matching {
            // Label lists are compared as sets: order and repeats do not matter.
            Match::Exact => {
                self.labels.iter().all(|l| other.labels.contains(l))
                    && other.labels.iter().all(|l| self.labels.contains(l))
            }
            Match::Compositional => self.labels.iter().any(|l| other.labels.contains(l)),
        }
    }
}

/// What a leaf Chunnel tells the negotiator about itself.
///
/// Every Chunnel implements this; the defaults describe a Chunnel with no capabilities that is
/// always available and ignores the pick.
pub trait Negotiate {
    /// A stable, versioned identifier such as `"chunnel/noop/1"`.
    fn id(&self) -> &'static str;

    /// The capabilities the negotiator must match against the peer.
    fn capabilities(&self) -> Vec<Capability> {
        Vec::new()
    }

    /// Whether this Chunnel can work on this host right now (privileges, hardware, a
    /// co-located peer). A [`crate::Select`] skips a branch whose check fails.
    fn check_available(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Called once the stack containing this Chunnel was picked, with the nonce of the pick,
    /// before `connect_wrap`. Chunnels that tell other endpoints which stack a client uses
    /// (paper §5.1) keep the nonce here.
    fn picked(&mut self, _nonce: &Pick) {}
}

/// One Chunnel of a concrete stack, as offered to a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunnelInfo {
    /// The Chunnel's stable id.
    pub id: Cow<'static, str>,
    /// Its capabilities.
    pub capabilities: Vec<Capability>,
}

/// One concrete stack that a tree of selects allows: its Chunnels from the top (application
/// side) to the bottom (wire side), and the pick that selects it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackOption {
    /// The Chunnels, top first.
    pub chunnels: Vec<ChunnelInfo>,
    /// The branch decisions that lead to this option.
    pub pick: Pick,
}

/// A compact nonce naming one concrete stack: the branch taken (0 = preferred, 1 = fallback)
/// at every select met on the chosen path, in pre-order (outer before inner, top before
/// bottom).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Pick {
    branches: Vec<u8>,
}

impl Pick {
    /// A pick from explicit branch decisions.
    pub fn from_branches(branches: Vec<u8>) -> Self {
        Pick { branches }
    }

    /// The branch decisions, in pre-order.
    pub fn branches(&self) -> &[u8] {
        &self.branches
    }

    /// A cursor that consumes the decisions in order.
    pub fn reader(&self) -> PickReader<'_> {
        PickReader {
            rest: &self.branches,
            whole: self,
        }
    }
}

/// Consumes a [`Pick`]'s decisions while walking a stack; see [`Offers::apply_pick`].
#[derive(Debug)]
pub struct PickReader<'a> {
    rest: &'a [u8],
    whole: &'a Pick,
}

impl<'a> PickReader<'a> {
    /// The next select's decision.
    pub fn next_branch(&mut self) -> Result<u8, Error> {
        let (&b, rest) = self.rest.split_first().ok_or(Error::BadPick {
            what: "fewer branch decisions than selects on the path",
        })?;
        if b > 1 {
            return Err(Error::BadPick {
                what: "branch decision is neither 0 nor 1",
            });
        }
        self.rest = rest;
        Ok(b)
    }

    /// The whole pick (passed to [`Negotiate::picked`]).
    pub fn pick(&self) -> &'a Pick {
        self.whole
    }

    /// Fails if decisions are left over.
    pub fn finish(self) -> Result<(), Error> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(Error::BadPick {
                what: "more branch decisions than selects on the path",
            })
        }
    }
}

/// A tree of Chunnels that can describe its concrete options and be told which one to build.
///
/// Implemented for every [`Negotiate`] leaf, for [`crate::Stack`] and for [`crate::Select`].
pub trait Offers {
    /// Every concrete stack this tree allows and this host can run, most preferred first
    /// (select branches whose availability check fails are left out).
    fn offers(&self) -> Vec<StackOption>;

    /// Whether at least one concrete stack of this tree can work on this host.
    fn available(&self) -> Result<(), Error>;

    /// Fixes every select on the path named by `pick` (and tells leaves via
    /// [`Negotiate::picked`]). `connect_wrap` then builds exactly that stack.
    fn apply_pick(&mut self, pick: &mut PickReader<'_>) -> Result<(), Error>;

    /// Applies a whole pick. The pick is checked against [`Offers::offers`] first, so a pick
    /// that names no offered option changes nothing (no select is fixed, no leaf is told).
    fn apply(&mut self, pick: &Pick) -> Result<(), Error> {
        if !self.offers().iter().any(|o| &o.pick == pick) {
            return Err(Error::BadPick {
                what: "the pick names no option this stack offers",
            });
        }
        let mut r = pick.reader();
        self.apply_pick(&mut r)?;
        r.finish()
    }
}

impl<T: Negotiate> Offers for T {
    fn offers(&self) -> Vec<StackOption> {
        if self.check_available().is_err() {
            return Vec::new();
        }
        vec![StackOption {
            chunnels: vec![ChunnelInfo {
                id: Cow::Borrowed(self.id()),
                capabilities: self.capabilities(),
            }],
            pick: Pick::default(),
        }]
    }

    fn available(&self) -> Result<(), Error> {
        self.check_available()
    }

    fn apply_pick(&mut self, pick: &mut PickReader<'_>) -> Result<(), Error> {
        self.picked(pick.pick());
        Ok(())
    }
}
