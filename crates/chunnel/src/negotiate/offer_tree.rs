//! The structure of a stack's options, and the search for the preferred compatible pair of
//! options that never enumerates their product.
//!
//! A stack of `k` two-way selects allows `2^k` concrete stacks. [`Offers::offers`] lists them
//! all; an [`OfferTree`] describes them in space linear in the stack: its layers
//! ([`OfferTree::Seq`]), its selects ([`OfferTree::Select`]) and its Chunnels
//! ([`OfferTree::Leaf`]). The options a tree allows, and their preference order, are exactly
//! those of the flattened list ([`OfferTree::options`]): the order is lexicographic in the
//! branch decisions met in pre-order (0, the preferred branch, first).
//!
//! [`choose_tree`] finds what [`crate::negotiate::choose`] finds on the flattened lists — the
//! first server option (server preference) compatible with some client option, and the
//! client's most preferred such option — by a depth-first search in preference order that
//! prunes every partial choice no completion can make compatible. The pruning is sound (a
//! pruned branch holds no compatible pair: checked against the flattened oracle by a property
//! test), and it is exact once a choice is complete, so the first complete pair the search
//! reaches is the answer. When capabilities of different selects are independent (the common
//! case: each select chooses among implementations of one function), every wrong branch is
//! pruned at once and the search visits a number of nodes linear in the trees. Adversarial
//! trees can still need exponential work: the search stops after
//! [`Limits::steps`] steps with [`NoChoice::TooComplex`].
//!
//! [`Offers::offers`]: crate::Offers::offers

use std::collections::HashMap;

use crate::negotiate::types::{Capability, ChunnelInfo, Match, Mismatch, Pick, StackOption};

/// The options of a tree of Chunnels, described in space linear in the tree.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum OfferTree {
    /// One Chunnel: one option with just this Chunnel, no branch decision.
    Leaf(ChunnelInfo),
    /// Layers from the top (application) down: the product of the parts' options, the upper
    /// part's decisions first. `Seq(vec![])` is no layer at all (one empty option).
    Seq(Vec<OfferTree>),
    /// A select: the left (preferred) tree's options, each after a decision `0`, then the
    /// right tree's, each after a decision `1`.
    Select(Box<OfferTree>, Box<OfferTree>),
    /// An explicit list of options, each with the decisions that name it (what a tree that
    /// cannot describe its structure offers; an unavailable Chunnel is `Options(vec![])`).
    Options(Vec<StackOption>),
}

/// An explicit list of options, most preferred first.
impl From<Vec<StackOption>> for OfferTree {
    fn from(options: Vec<StackOption>) -> Self {
        OfferTree::Options(options)
    }
}

impl OfferTree {
    /// No layer: one empty option.
    pub fn empty() -> Self {
        OfferTree::Seq(Vec::new())
    }

    /// `upper` on top of `lower`, flattening nested sequences.
    pub fn seq(upper: OfferTree, lower: OfferTree) -> Self {
        let mut parts = Vec::new();
        for t in [upper, lower] {
            match t {
                OfferTree::Seq(p) => parts.extend(p),
                t => parts.push(t),
            }
        }
        if parts.len() == 1 {
            parts.pop().unwrap_or_else(OfferTree::empty)
        } else {
            OfferTree::Seq(parts)
        }
    }

    /// How many options the tree allows (saturating at `u128::MAX`).
    pub fn count(&self) -> u128 {
        match self {
            OfferTree::Leaf(_) => 1,
            OfferTree::Seq(p) => p.iter().fold(1u128, |n, t| n.saturating_mul(t.count())),
            OfferTree::Select(a, b) => a.count().saturating_add(b.count()),
            OfferTree::Options(o) => o.len() as u128,
        }
    }

    /// Every option, most preferred first: what [`crate::Offers::offers`] gives. Exponential
    /// in the number of selects; for small trees and tests.
    pub fn options(&self) -> Vec<StackOption> {
        self.first_options(usize::MAX)
    }

    /// The first `n` options, most preferred first, without making the others.
    pub fn first_options(&self, n: usize) -> Vec<StackOption> {
        let mut out = Vec::new();
        if n > 0 {
            let mut st = Walk::default();
            let mut work = vec![self];
            enumerate(&mut work, &mut st, &mut |st| {
                out.push(StackOption {
                    chunnels: st.chunnels.iter().map(|c| (*c).clone()).collect(),
                    pick: Pick::from_slice(&st.pick),
                });
                out.len() >= n
            });
        }
        out
    }

    /// The Chunnels of the option that `pick` names, top first; `None` if it names none.
    /// Where several options carry the same decisions (explicit lists may), the first.
    pub fn option(&self, pick: &Pick) -> Option<Vec<ChunnelInfo>> {
        let mut out = Vec::new();
        resolve(&mut vec![self], pick.branches(), &mut out).then_some(out)
    }

    /// The number of nodes (leaves, sequences, selects and listed options).
    pub fn nodes(&self) -> usize {
        match self {
            OfferTree::Leaf(_) => 1,
            OfferTree::Seq(p) => 1 + p.iter().map(OfferTree::nodes).sum::<usize>(),
            OfferTree::Select(a, b) => 1 + a.nodes() + b.nodes(),
            OfferTree::Options(o) => 1 + o.len(),
        }
    }
}

/// Follows `rest` through the trees in `work` (processed from the end), appending the
/// Chunnels met to `out`; true if the decisions name an option and are used up exactly.
/// Explicit lists are tried in order, backtracking, so lists whose picks prefix one another
/// resolve too. Recurses only at choices (see [`expand`]).
fn resolve(work: &mut Vec<&OfferTree>, rest: &[u8], out: &mut Vec<ChunnelInfo>) -> bool {
    let o = out.len();
    let mut log = Vec::new();
    let mut leaves = Vec::new();
    expand(work, &mut leaves, &mut log);
    out.extend(leaves.iter().map(|c| (*c).clone()));
    let found = match work.pop() {
        None => rest.is_empty(),
        Some(node) => {
            let found = match node {
                OfferTree::Select(a, b) => match rest.split_first() {
                    Some((0, r)) => with(work, a, |work| resolve(work, r, out)),
                    Some((1, r)) => with(work, b, |work| resolve(work, r, out)),
                    _ => false,
                },
                OfferTree::Options(list) => list.iter().any(|opt| {
                    let p = opt.pick.branches();
                    if !rest.starts_with(p) {
                        return false;
                    }
                    let o = out.len();
                    out.extend(opt.chunnels.iter().cloned());
                    let found = resolve(work, &rest[p.len()..], out);
                    if !found {
                        out.truncate(o);
                    }
                    found
                }),
                // `expand` left a choice (or nothing) on top.
                OfferTree::Leaf(_) | OfferTree::Seq(_) => false,
            };
            work.push(node);
            found
        }
    };
    undo(work, &mut log);
    if !found {
        out.truncate(o);
    }
    found
}

/// Takes leaves and layers off the top of `work` until a choice (or nothing) is on top: the
/// leaves' Chunnels go to `leaves`, and `log` records what [`undo`] needs to put `work` back.
/// The walks recurse only at choices, so their depth is the number of choices on a path,
/// not the number of nodes.
fn expand<'t>(
    work: &mut Vec<&'t OfferTree>,
    leaves: &mut Vec<&'t ChunnelInfo>,
    log: &mut Vec<(&'t OfferTree, usize)>,
) {
    while let Some(&n) = work.last() {
        match n {
            OfferTree::Leaf(c) => {
                work.pop();
                leaves.push(c);
                log.push((n, 0));
            }
            OfferTree::Seq(parts) => {
                work.pop();
                work.extend(parts.iter().rev());
                log.push((n, parts.len()));
            }
            OfferTree::Select(..) | OfferTree::Options(_) => break,
        }
    }
}

/// Puts back what [`expand`] took off `work`.
fn undo<'t>(work: &mut Vec<&'t OfferTree>, log: &mut Vec<(&'t OfferTree, usize)>) {
    while let Some((n, children)) = log.pop() {
        work.truncate(work.len() - children);
        work.push(n);
    }
}

/// Runs `f` with `t` pushed on `work`, then takes it off again.
fn with<'t, R>(
    work: &mut Vec<&'t OfferTree>,
    t: &'t OfferTree,
    f: impl FnOnce(&mut Vec<&'t OfferTree>) -> R,
) -> R {
    let w = work.len();
    work.push(t);
    let r = f(work);
    work.truncate(w);
    r
}

/// One side's partial choice during a walk.
#[derive(Default)]
struct Walk<'t> {
    chunnels: Vec<&'t ChunnelInfo>,
    caps: Vec<&'t Capability>,
    pick: Vec<u8>,
}

impl<'t> Walk<'t> {
    fn mark(&self) -> (usize, usize, usize) {
        (self.chunnels.len(), self.caps.len(), self.pick.len())
    }

    fn reset(&mut self, m: (usize, usize, usize)) {
        self.chunnels.truncate(m.0);
        self.caps.truncate(m.1);
        self.pick.truncate(m.2);
    }

    fn add(&mut self, c: &'t ChunnelInfo) {
        self.chunnels.push(c);
        self.caps.extend(c.capabilities.iter());
    }
}

/// Visits every option in preference order (no pruning) until `visit` returns true; returns
/// whether it did.
fn enumerate<'t>(
    work: &mut Vec<&'t OfferTree>,
    st: &mut Walk<'t>,
    visit: &mut dyn FnMut(&Walk<'t>) -> bool,
) -> bool {
    let m = st.mark();
    let mut log = Vec::new();
    let mut leaves = Vec::new();
    expand(work, &mut leaves, &mut log);
    leaves.into_iter().for_each(|c| st.add(c));
    let stop = match work.pop() {
        None => visit(st),
        Some(node) => {
            let inner = st.mark();
            let stop = match node {
                OfferTree::Select(a, b) => [(0u8, a), (1, b)].into_iter().any(|(d, t)| {
                    st.pick.push(d);
                    let stop = with(work, t, |work| enumerate(work, st, visit));
                    st.reset(inner);
                    stop
                }),
                OfferTree::Options(list) => list.iter().any(|o| {
                    st.pick.extend_from_slice(o.pick.branches());
                    o.chunnels.iter().for_each(|c| st.add(c));
                    let stop = enumerate(work, st, visit);
                    st.reset(inner);
                    stop
                }),
                OfferTree::Leaf(_) | OfferTree::Seq(_) => false,
            };
            work.push(node);
            stop
        }
    };
    undo(work, &mut log);
    st.reset(m);
    stop
}

/// Every capability that some option of the trees in `work` carries (with repeats).
fn possible<'t>(work: &[&'t OfferTree], out: &mut Vec<&'t Capability>) {
    fn walk<'t>(t: &'t OfferTree, out: &mut Vec<&'t Capability>) {
        match t {
            OfferTree::Leaf(c) => out.extend(c.capabilities.iter()),
            OfferTree::Seq(p) => p.iter().for_each(|t| walk(t, out)),
            OfferTree::Select(a, b) => {
                walk(a, out);
                walk(b, out);
            }
            OfferTree::Options(list) => list
                .iter()
                .for_each(|o| o.chunnels.iter().for_each(|c| out.extend(&c.capabilities))),
        }
    }
    for t in work {
        walk(t, out);
    }
}

/// The capabilities every option of `t` carries (by equality); `None` if `t` has no option.
fn certain(t: &OfferTree) -> Option<Vec<&Capability>> {
    match t {
        OfferTree::Leaf(c) => Some(c.capabilities.iter().collect()),
        OfferTree::Seq(p) => {
            let mut out = Vec::new();
            for t in p {
                out.extend(certain(t)?);
            }
            Some(out)
        }
        OfferTree::Select(a, b) => match (certain(a), certain(b)) {
            (Some(x), Some(y)) => Some(x.into_iter().filter(|c| y.contains(c)).collect()),
            (x, None) => x,
            (None, y) => y,
        },
        OfferTree::Options(list) => {
            let mut it = list.iter().map(|o| {
                o.chunnels
                    .iter()
                    .flat_map(|c| &c.capabilities)
                    .collect::<Vec<_>>()
            });
            let first = it.next()?;
            Some(it.fold(first, |acc, caps| {
                acc.into_iter().filter(|c| caps.contains(c)).collect()
            }))
        }
    }
}

/// Capabilities grouped by kind (`compatible` is false across kinds, so every check looks
/// at one kind's group only).
struct Kinds<'c>(HashMap<&'c str, Vec<&'c Capability>>);

impl<'c> Kinds<'c> {
    fn of(list: &[&'c Capability]) -> Self {
        let mut m: HashMap<&'c str, Vec<&'c Capability>> = HashMap::new();
        for c in list {
            m.entry(c.kind.as_ref()).or_default().push(c);
        }
        Kinds(m)
    }

    fn get(&self, kind: &str) -> &[&'c Capability] {
        self.0.get(kind).map_or(&[], Vec::as_slice)
    }
}

/// One side's capabilities at a point of the search: present in every completion (`def`)
/// and in some (`any`, a superset), grouped by kind.
struct Caps<'a, 'c> {
    def: &'a [&'c Capability],
    def_kinds: Kinds<'c>,
    any: Kinds<'c>,
}

impl<'a, 'c> Caps<'a, 'c> {
    fn new(def: &'a [&'c Capability], any: &[&'c Capability]) -> Self {
        Caps {
            def,
            def_kinds: Kinds::of(def),
            any: Kinds::of(any),
        }
    }
}

/// Whether no completion can be compatible: `ours` are the server's capabilities (their
/// rules apply), `theirs` the client's. Exact (as [`crate::negotiate::check_compatible`])
/// when each side's `def` and `any` are equal. Adds the comparisons made to `work`.
fn dead(ours: &Caps<'_, '_>, theirs: &Caps<'_, '_>, work: &mut u64) -> bool {
    for o in ours.def {
        let same = theirs.any.get(&o.kind);
        *work += 1 + same.len() as u64;
        if (o.matching == Match::Exact || !theirs.def_kinds.get(&o.kind).is_empty())
            && !same.iter().any(|t| o.compatible(t))
        {
            return true;
        }
    }
    for t in theirs.def {
        let same = ours.any.get(&t.kind);
        *work += 1 + same.len() as u64;
        if (t.matching == Match::Exact || !ours.def_kinds.get(&t.kind).is_empty())
            && !same.iter().any(|o| o.compatible(t))
        {
            return true;
        }
    }
    false
}

/// Bounds on a [`choose_tree`] search.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Most search steps (a step: one choice of either tree taken into a partial choice).
    pub steps: u64,
    /// Most work: capabilities compared and collected, over the whole search. It bounds the
    /// time of one decision whatever the trees.
    pub work: u64,
    /// Most mismatches reported when nothing is compatible.
    pub max_reported: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            steps: 200_000,
            work: 5_000_000,
            max_reported: 16,
        }
    }
}

impl Limits {
    /// Sets [`Limits::steps`].
    pub fn with_steps(mut self, steps: u64) -> Self {
        self.steps = steps;
        self
    }

    /// Sets [`Limits::work`].
    pub fn with_work(mut self, work: u64) -> Self {
        self.work = work;
        self
    }

    /// Sets [`Limits::max_reported`].
    pub fn with_max_reported(mut self, n: usize) -> Self {
        self.max_reported = n;
        self
    }
}

/// What [`choose_tree`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeChoice {
    /// The server option's decisions.
    pub server_pick: Pick,
    /// The server option's Chunnels, top first.
    pub server_stack: Vec<ChunnelInfo>,
    /// The client option's decisions.
    pub client_pick: Pick,
    /// The client option's Chunnels, top first.
    pub client_stack: Vec<ChunnelInfo>,
    /// Search steps taken.
    pub steps: u64,
}

/// Why [`choose_tree`] found nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoChoice {
    /// No pair of options is compatible. The mismatches are those of the first pairs in
    /// preference order (server option major), at most [`Limits::max_reported`]: the same
    /// list [`crate::negotiate::choose`] reports on the flattened options.
    Incompatible(Vec<Mismatch>),
    /// The search reached [`Limits::steps`] or [`Limits::work`] without an answer.
    TooComplex {
        /// The steps taken.
        steps: u64,
    },
}

struct Search {
    steps: u64,
    work: u64,
    limits: Limits,
}

impl Search {
    fn step(&mut self) -> Result<(), NoChoice> {
        self.steps += 1;
        self.check()
    }

    fn check(&self) -> Result<(), NoChoice> {
        if self.steps > self.limits.steps || self.work > self.limits.work {
            Err(NoChoice::TooComplex { steps: self.steps })
        } else {
            Ok(())
        }
    }
}

/// Which side a depth-first search is choosing for, and what it knows of the other.
struct Ctx<'a, 't> {
    /// Choosing the server's option (else the client's).
    server: bool,
    /// The other side's capabilities.
    other: Caps<'a, 't>,
}

/// What a search calls on each complete option that survived the pruning.
type Complete<'f, 't, R> = dyn FnMut(&Walk<'t>, &mut Search) -> Result<Option<R>, NoChoice> + 'f;

/// Depth-first search of one side's options in preference order, pruning partial choices
/// that cannot be compatible; `complete` is called on each surviving complete option and
/// ends the search with `Some`. Recurses only at choices (see [`expand`]).
fn search<'t, R>(
    work: &mut Vec<&'t OfferTree>,
    st: &mut Walk<'t>,
    ctx: &Ctx<'_, 't>,
    s: &mut Search,
    complete: &mut Complete<'_, 't, R>,
) -> Result<Option<R>, NoChoice> {
    s.step()?;
    let m = st.mark();
    let mut log = Vec::new();
    let mut leaves = Vec::new();
    expand(work, &mut leaves, &mut log);
    leaves.into_iter().for_each(|c| st.add(c));
    let r = search_choice(work, st, ctx, s, complete);
    undo(work, &mut log);
    st.reset(m);
    r
}

/// [`search`] once the leaves and layers on top of `work` are taken: prune, then finish or
/// try the choice on top.
fn search_choice<'t, R>(
    work: &mut Vec<&'t OfferTree>,
    st: &mut Walk<'t>,
    ctx: &Ctx<'_, 't>,
    s: &mut Search,
    complete: &mut Complete<'_, 't, R>,
) -> Result<Option<R>, NoChoice> {
    // Prune: this side's definite capabilities against what the other side may have, and
    // the other's definite ones against what this side may still get.
    let mut any = st.caps.clone();
    possible(work, &mut any);
    s.work += any.len() as u64;
    let ours = Caps::new(&st.caps, &any);
    let is_dead = if ctx.server {
        dead(&ours, &ctx.other, &mut s.work)
    } else {
        dead(&ctx.other, &ours, &mut s.work)
    };
    s.check()?;
    if is_dead {
        return Ok(None);
    }
    let Some(node) = work.pop() else {
        return complete(st, s);
    };
    let inner = st.mark();
    let mut r = Ok(None);
    match node {
        OfferTree::Select(a, b) => {
            for (d, t) in [(0u8, a), (1, b)] {
                st.pick.push(d);
                r = with(work, t, |work| search(work, st, ctx, s, complete));
                st.reset(inner);
                if !matches!(r, Ok(None)) {
                    break;
                }
            }
        }
        OfferTree::Options(list) => {
            for o in list {
                st.pick.extend_from_slice(o.pick.branches());
                o.chunnels.iter().for_each(|c| st.add(c));
                r = search(work, st, ctx, s, complete);
                st.reset(inner);
                if !matches!(r, Ok(None)) {
                    break;
                }
            }
        }
        OfferTree::Leaf(_) | OfferTree::Seq(_) => {}
    }
    work.push(node);
    r
}

/// The server's decision on two trees: the first server option (server preference order)
/// compatible with some client option, with the client's most preferred such option; the
/// same answer as [`crate::negotiate::choose`] on the flattened options, found without
/// enumerating them (see the [module docs](self)).
pub fn choose_tree(
    server: &OfferTree,
    client: &OfferTree,
    limits: Limits,
) -> Result<TreeChoice, NoChoice> {
    let mut s = Search {
        steps: 0,
        work: 0,
        limits,
    };
    let mut client_any = Vec::new();
    possible(&[client], &mut client_any);
    let client_def = certain(client).unwrap_or_default();
    let found = if client.count() == 0 || server.count() == 0 {
        None
    } else {
        let ctx = Ctx {
            server: true,
            other: Caps::new(&client_def, &client_any),
        };
        search(
            &mut vec![server],
            &mut Walk::default(),
            &ctx,
            &mut s,
            &mut |srv, s| {
                // A complete server option: the client's options against it, exactly.
                let ctx = Ctx {
                    server: false,
                    other: Caps::new(&srv.caps, &srv.caps),
                };
                let found = search(
                    &mut vec![client],
                    &mut Walk::default(),
                    &ctx,
                    s,
                    &mut |cli, _| {
                        Ok(Some((
                            Pick::from_slice(&cli.pick),
                            cli.chunnels
                                .iter()
                                .map(|c| (*c).clone())
                                .collect::<Vec<_>>(),
                        )))
                    },
                )?;
                Ok(found.map(|(client_pick, client_stack)| TreeChoice {
                    server_pick: Pick::from_slice(&srv.pick),
                    server_stack: srv.chunnels.iter().map(|c| (*c).clone()).collect(),
                    client_pick,
                    client_stack,
                    steps: 0,
                }))
            },
        )?
    };
    match found {
        Some(mut c) => {
            c.steps = s.steps;
            Ok(c)
        }
        None => Err(NoChoice::Incompatible(first_mismatches(
            server,
            client,
            limits.max_reported,
        ))),
    }
}

/// The first mismatch of each of the first `max` pairs of options, server option major.
fn first_mismatches(server: &OfferTree, client: &OfferTree, max: usize) -> Vec<Mismatch> {
    let (srv, cli) = (server.first_options(max), client.first_options(max));
    let mut out = Vec::new();
    for (si, s) in srv.iter().enumerate() {
        for (ci, c) in cli.iter().enumerate() {
            if out.len() >= max {
                return out;
            }
            let idx = |i: usize| u16::try_from(i).unwrap_or(u16::MAX);
            if let Err(m) = crate::negotiate::types::check_compatible(
                &s.chunnels,
                &c.chunnels,
                idx(si),
                idx(ci),
            ) {
                out.push(m);
            }
        }
    }
    out
}
