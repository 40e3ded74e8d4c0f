//! The data negotiation works on: capabilities and how they match, the Chunnels and options
//! of a stack as offered, picks, and the choice between two lists of options.

use std::borrow::Cow;
use std::sync::Arc;

use crate::Error;

/// How a capability must be matched between peers (paper §5.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Match {
    /// Both ends must carry an equal capability (serialization formats, framing).
    Exact,
    /// One end carrying it suffices (client-side sharding, a local transform).
    Compositional,
}

/// A compatibility rule for a custom capability type: `ours` is the local capability (the one
/// that carries the rule), `theirs` the peer's of the same kind. It must depend on the two
/// capabilities only (no clock, no global state): a negotiating server remembers its answer
/// to an offer list and gives it again to the next client offering the same list.
pub type Rule = fn(ours: &Capability, theirs: &Capability) -> bool;

/// One capability of a Chunnel: a typed, opaque set of labels with a matching rule.
///
/// `kind` names the capability type (`"serialize"`, `"shard"`...). Two capabilities are
/// compared only when their kinds are equal, with the rule of that kind (see
/// [`Capability::compatible`]). Chunnel authors define new kinds freely, and may give a kind
/// its own compatibility rule with [`Capability::with_rule`] (version ranges, minimum sizes).
///
/// The rule is local behaviour, not data: it never crosses the wire, and equality and hashing
/// look at `kind`, `matching` and `labels` only. The endpoint that decides (the server in
/// point-to-point negotiation) applies its own capability's rule.
#[derive(Clone, Debug)]
pub struct Capability {
    /// The capability type, e.g. `"serialize"`.
    pub kind: Cow<'static, str>,
    /// Exact-match or compositional.
    pub matching: Match,
    /// The labels; for an exact capability the sets must be equal, for a compositional one
    /// they must intersect (or the capability be present on one side only).
    pub labels: Vec<Cow<'static, str>>,
    /// A custom compatibility rule replacing the default set comparison.
    pub rule: Option<Rule>,
}

impl PartialEq for Capability {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && self.matching == other.matching && self.labels == other.labels
    }
}

impl Eq for Capability {}

impl std::hash::Hash for Capability {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.kind.hash(state);
        self.matching.hash(state);
        self.labels.hash(state);
    }
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
            rule: None,
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
            rule: None,
        }
    }

    /// Gives this capability a custom compatibility rule (see [`Rule`]).
    pub fn with_rule(mut self, rule: Rule) -> Self {
        self.rule = Some(rule);
        self
    }

    /// Whether `self` (local) accepts `other` (the peer's). Kinds and matching modes must be
    /// equal; then the custom [`Rule`] decides if `self` has one, else the default: equal
    /// label sets for [`Match::Exact`], a non-empty intersection for [`Match::Compositional`].
    pub fn compatible(&self, other: &Capability) -> bool {
        if self.kind != other.kind || self.matching != other.matching {
            return false;
        }
        if let Some(rule) = self.rule {
            return rule(self, other);
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

/// Which end of a negotiation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum End {
    /// The endpoint that offers (connects).
    Client,
    /// The endpoint that picks (listens).
    Server,
}

impl std::fmt::Display for End {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            End::Client => "client",
            End::Server => "server",
        })
    }
}

/// Why one client option and one server option are not compatible: the first capability
/// that failed to match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Index of the client's option (its preference order).
    pub client_option: u16,
    /// Index of the server's option.
    pub server_option: u16,
    /// The capability kind that failed.
    pub kind: String,
    /// Its matching mode (as the side that has it declares it).
    pub matching: Match,
    /// The client's labels for this kind, `None` if the client's option lacks the kind.
    pub client: Option<Vec<String>>,
    /// The server's labels for this kind, `None` if the server's option lacks the kind.
    pub server: Option<Vec<String>>,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = match self.matching {
            Match::Exact => "exact",
            Match::Compositional => "compositional",
        };
        write!(f, "{how} capability `{}` ", self.kind)?;
        match (&self.client, &self.server) {
            (Some(c), None) => write!(
                f,
                "{{{}}} at the client is missing at the server",
                c.join(",")
            ),
            (None, Some(s)) => write!(
                f,
                "{{{}}} at the server is missing at the client",
                s.join(",")
            ),
            (Some(c), Some(s)) => write!(
                f,
                "differs: {{{}}} at the client, {{{}}} at the server",
                c.join(","),
                s.join(",")
            ),
            (None, None) => f.write_str("is missing at both ends"),
        }?;
        write!(
            f,
            " (client option {}, server option {})",
            self.client_option, self.server_option
        )
    }
}

fn labels(c: &Capability) -> Vec<String> {
    c.labels.iter().map(|l| l.to_string()).collect()
}

fn first_of<'c>(list: &[&'c Capability], kind: &str) -> Option<&'c Capability> {
    list.iter().copied().find(|c| c.kind == kind)
}

/// Checks one server option against one client option with the paper's rules (§5.2): an
/// exact-match capability must be present at both ends and compatible; a compositional one
/// may be present at either end, and must be compatible where both carry it. The server's
/// capabilities are `ours` and their custom [`Rule`]s apply.
pub fn check_compatible(
    server: &[ChunnelInfo],
    client: &[ChunnelInfo],
    server_option: u16,
    client_option: u16,
) -> Result<(), Mismatch> {
    let ours: Vec<&Capability> = server.iter().flat_map(|c| &c.capabilities).collect();
    let theirs: Vec<&Capability> = client.iter().flat_map(|c| &c.capabilities).collect();
    let mismatch = |cap: &Capability, client_has: Option<Vec<String>>, server_has| Mismatch {
        client_option,
        server_option,
        kind: cap.kind.to_string(),
        matching: cap.matching,
        client: client_has,
        server: server_has,
    };
    // `compatible` is false across kinds, so "any compatible" only looks at the same kind.
    for o in &ours {
        match first_of(&theirs, &o.kind) {
            None if o.matching == Match::Exact => {
                return Err(mismatch(o, None, Some(labels(o))));
            }
            Some(t) if !theirs.iter().any(|t| o.compatible(t)) => {
                return Err(mismatch(o, Some(labels(t)), Some(labels(o))));
            }
            _ => {}
        }
    }
    for t in &theirs {
        match first_of(&ours, &t.kind) {
            None if t.matching == Match::Exact => {
                return Err(mismatch(t, Some(labels(t)), None));
            }
            // Judged by the local (server) capability, whose rule applies.
            Some(o) if !ours.iter().any(|o| o.compatible(t)) => {
                return Err(mismatch(t, Some(labels(t)), Some(labels(o))));
            }
            _ => {}
        }
    }
    Ok(())
}

/// The outcome of [`choose`]: which server option serves which client option.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    /// Index into the server's options.
    pub server_option: usize,
    /// Index into the client's options.
    pub client_option: usize,
}

/// The server's decision: the first server option (server preference order) that is
/// compatible with some client option, taking the client's most preferred such option. On
/// failure, the first mismatch of every pair tried, bounded to `max_reported`.
pub fn choose(
    server: &[StackOption],
    client: &[StackOption],
    max_reported: usize,
) -> Result<Choice, Vec<Mismatch>> {
    let mut why = Vec::new();
    for (si, s) in server.iter().enumerate() {
        for (ci, c) in client.iter().enumerate() {
            match check_compatible(&s.chunnels, &c.chunnels, idx(si), idx(ci)) {
                Ok(()) => {
                    return Ok(Choice {
                        server_option: si,
                        client_option: ci,
                    });
                }
                Err(m) if why.len() < max_reported => why.push(m),
                Err(_) => {}
            }
        }
    }
    Err(why)
}

fn idx(i: usize) -> u16 {
    u16::try_from(i).unwrap_or(u16::MAX)
}

/// One Chunnel of a concrete stack, as offered to a peer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ChunnelInfo {
    /// The Chunnel's stable id.
    pub id: Cow<'static, str>,
    /// Its capabilities.
    pub capabilities: Vec<Capability>,
}

/// One concrete stack that a tree of selects allows: its Chunnels from the top (application
/// side) to the bottom (wire side), and the pick that selects it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StackOption {
    /// The Chunnels, top first.
    pub chunnels: Vec<ChunnelInfo>,
    /// The branch decisions that lead to this option.
    pub pick: Pick,
}

/// A compact nonce naming one concrete stack: the branch taken (0 = preferred, 1 = fallback)
/// at every select met on the chosen path, in pre-order (outer before inner, top before
/// bottom).
///
/// Up to [`Pick::INLINE`] decisions are stored inline, so building, cloning and comparing
/// a pick does not allocate (a connection's handshake makes and copies several); a longer
/// one is shared behind an `Arc`.
#[derive(Clone)]
pub struct Pick {
    repr: PickRepr,
}

#[derive(Clone)]
enum PickRepr {
    Inline { len: u8, b: [u8; Pick::INLINE] },
    Shared(Arc<[u8]>),
}

impl Pick {
    /// How many decisions a pick holds without allocating.
    pub const INLINE: usize = 22;

    /// A pick from explicit branch decisions.
    pub fn from_branches(branches: Vec<u8>) -> Self {
        Self::from_slice(&branches)
    }

    /// A pick from explicit branch decisions, copied.
    pub fn from_slice(branches: &[u8]) -> Self {
        Self::concat(&[branches])
    }

    /// The decisions of `parts`, one after the other.
    pub(crate) fn concat(parts: &[&[u8]]) -> Self {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len <= Self::INLINE {
            let mut b = [0u8; Self::INLINE];
            let mut at = 0;
            for p in parts {
                b[at..at + p.len()].copy_from_slice(p);
                at += p.len();
            }
            // `len <= INLINE < 256`.
            Pick {
                repr: PickRepr::Inline { len: len as u8, b },
            }
        } else {
            Pick {
                repr: PickRepr::Shared(parts.concat().into()),
            }
        }
    }

    /// The branch decisions, in pre-order.
    pub fn branches(&self) -> &[u8] {
        match &self.repr {
            PickRepr::Inline { len, b } => &b[..usize::from(*len)],
            PickRepr::Shared(v) => v,
        }
    }

    /// A cursor that consumes the decisions in order.
    pub fn reader(&self) -> PickReader<'_> {
        PickReader {
            rest: self.branches(),
        }
    }
}

impl Default for Pick {
    fn default() -> Self {
        Self::from_slice(&[])
    }
}

impl PartialEq for Pick {
    fn eq(&self, other: &Self) -> bool {
        self.branches() == other.branches()
    }
}

impl Eq for Pick {}

impl std::hash::Hash for Pick {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.branches().hash(state);
    }
}

impl std::fmt::Debug for Pick {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pick")
            .field("branches", &self.branches())
            .finish()
    }
}

/// Consumes a [`Pick`]'s decisions while walking a stack; see [`Offers::apply_pick`](crate::Offers::apply_pick).
#[derive(Debug)]
pub struct PickReader<'a> {
    rest: &'a [u8],
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
