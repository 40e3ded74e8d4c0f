//! The registry: implementations of named functions, ranked by the operator policy, built
//! into a select.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use chunnel::{BoxChunnel, Match, Offers};

use crate::Error;
use crate::candidate::Skip;
use crate::policy::{Endpoints, Policy, Scope};
use crate::resource::Resource;

type Factory<I, D> = Arc<dyn Fn() -> BoxChunnel<I, D> + Send + Sync>;
type SetupHook = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;
type TeardownHook = Arc<dyn Fn() + Send + Sync>;

/// Where a datapath implementation sits (see [`crate::qos`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// A layer over the negotiated connection (shared memory; any non-datapath Chunnel).
    Layer,
    /// The socket the connection is negotiated over (io_uring, AF_XDP, kernel UDP): chosen by
    /// this end alone before negotiating; in a select, its Chunnel is a pass-through leaf
    /// that names it.
    Base,
}

/// One registered implementation of a function: how to build its Chunnel, and what the
/// registry needs to decide whether and where to use it (HotNets §4.2).
///
/// ```
/// use chunnel::{BoxConnection, ChunnelExt, Noop};
/// use chunnel_discovery::{Endpoints, Implementation, Resource, Scope};
/// let imp = Implementation::<BoxConnection<u8>, u8>::new("noop", "reliable", || Noop.boxed())
///     .with_priority(10)
///     .with_scope(Scope::Process)
///     .with_endpoints(Endpoints::One)
///     .requires(Resource::custom("nothing", || Ok(())))
///     .on_setup(|| Ok(()))
///     .on_teardown(|| {});
/// assert_eq!(imp.name(), "noop");
/// ```
pub struct Implementation<I, D> {
    name: String,
    function: String,
    priority: i32,
    scope: Scope,
    endpoints: Endpoints,
    placement: Placement,
    resources: Vec<Resource>,
    factory: Factory<I, D>,
    setup: Option<SetupHook>,
    teardown: Option<TeardownHook>,
    pub(crate) life: Arc<Lifecycle>,
}

impl<I, D> fmt::Debug for Implementation<I, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Implementation")
            .field("name", &self.name)
            .field("function", &self.function)
            .field("priority", &self.priority)
            .field("scope", &self.scope)
            .field("endpoints", &self.endpoints)
            .field("placement", &self.placement)
            .field("resources", &self.resources)
            .finish_non_exhaustive()
    }
}

impl<I, D> Implementation<I, D> {
    /// Implementation `name` (unique in a registry) of `function`, whose Chunnel `factory`
    /// builds: called once per select built and per copy of it (a server copies its stack
    /// for every connection). Defaults: priority 0, scope process, one end, a layer, no
    /// resources, no hooks.
    pub fn new(
        name: impl Into<String>,
        function: impl Into<String>,
        factory: impl Fn() -> BoxChunnel<I, D> + Send + Sync + 'static,
    ) -> Self {
        Implementation {
            name: name.into(),
            function: function.into(),
            priority: 0,
            scope: Scope::Process,
            endpoints: Endpoints::One,
            placement: Placement::Layer,
            resources: Vec::new(),
            factory: Arc::new(factory),
            setup: None,
            teardown: None,
            life: Arc::new(Lifecycle::default()),
        }
    }

    /// Sets the priority (higher is preferred; the policy may override it).
    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    /// Sets the scope.
    pub fn with_scope(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }

    /// Sets the endpoint constraint. What enforces "both ends" is the Chunnel's exact
    /// capability, matched by negotiation; [`Registry::register`] refuses a both-ends
    /// implementation whose Chunnel offers none.
    pub fn with_endpoints(mut self, endpoints: Endpoints) -> Self {
        self.endpoints = endpoints;
        self
    }

    /// Sets the placement (see [`Placement`]).
    pub fn with_placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// Adds a resource this implementation needs, checked when a select is built and again
    /// when its Chunnel is offered or built.
    pub fn requires(mut self, resource: Resource) -> Self {
        self.resources.push(resource);
        self
    }

    /// The set-up hook: run when a connection is built on this implementation and no other
    /// connection of it is live (the first use, or the first after a tear-down). An `Err`
    /// fails that connection ([`Error::Setup`] inside `chunnel::Error::Layer`). It runs
    /// inside `connect_wrap`, on the task building the connection: keep it short, or hand
    /// long work (an orchestrator's API) to a thread. The hooks of one implementation run
    /// under its lock, one at a time: a set-up never overlaps a tear-down.
    pub fn on_setup(
        mut self,
        hook: impl Fn() -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.setup = Some(Arc::new(hook));
        self
    }

    /// The tear-down hook: run when the last live connection of this implementation is
    /// dropped (and when building the connection fails after a set-up ran).
    pub fn on_teardown(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.teardown = Some(Arc::new(hook));
        self
    }

    /// The implementation's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The function it implements.
    pub fn function(&self) -> &str {
        &self.function
    }

    /// Its registered priority.
    pub fn priority(&self) -> i32 {
        self.priority
    }

    /// Its scope.
    pub fn scope(&self) -> Scope {
        self.scope
    }

    /// Its endpoint constraint.
    pub fn endpoints(&self) -> Endpoints {
        self.endpoints
    }

    /// Its placement.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// Its resources.
    pub fn resources(&self) -> &[Resource] {
        &self.resources
    }

    /// Builds its Chunnel.
    pub(crate) fn build(&self) -> BoxChunnel<I, D> {
        (self.factory)()
    }

    /// The first missing resource: `(resource, why)`.
    pub(crate) fn missing_resource(&self) -> Option<(String, String)> {
        self.resources
            .iter()
            .find_map(|r| r.check().err().map(|why| (r.to_string(), why)))
    }

    /// Counts a new connection, running the set-up hook if it is the only live one.
    pub(crate) fn acquire(self: &Arc<Self>) -> Result<LiveGuard, Error> {
        let mut live = self.life.live.lock().unwrap_or_else(|p| p.into_inner());
        if *live == 0
            && let Some(setup) = &self.setup
        {
            setup().map_err(|reason| Error::Setup {
                name: self.name.clone(),
                reason,
            })?;
            self.life.setups.fetch_add(1, Ordering::Relaxed);
        }
        *live += 1;
        Ok(LiveGuard {
            life: Arc::clone(&self.life),
            teardown: self.teardown.clone(),
        })
    }
}

/// How many connections of an implementation are live, and how often its hooks ran.
#[derive(Debug, Default)]
pub(crate) struct Lifecycle {
    live: Mutex<usize>,
    setups: AtomicU64,
    teardowns: AtomicU64,
}

/// A snapshot of an implementation's use ([`Registry::usage`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// Live connections built on it.
    pub live: usize,
    /// Times its set-up hook ran successfully.
    pub setups: u64,
    /// Times its tear-down hook ran.
    pub teardowns: u64,
}

/// Held by every live connection of an implementation; the last one dropped runs the
/// tear-down hook.
pub(crate) struct LiveGuard {
    life: Arc<Lifecycle>,
    teardown: Option<TeardownHook>,
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        let mut live = self.life.live.lock().unwrap_or_else(|p| p.into_inner());
        *live -= 1;
        if *live == 0
            && let Some(t) = &self.teardown
        {
            t();
            self.life.teardowns.fetch_add(1, Ordering::Relaxed);
        }
    }
}

struct State<I, D> {
    entries: Vec<Arc<Implementation<I, D>>>,
    policy: Policy,
}

/// The discovery registry of one kind of Chunnel (taking `I`, carrying `D`): a handle,
/// cheap to clone and shared by every clone, so an operator can change the policy while the
/// application builds selects from it.
///
/// ```
/// use chunnel::{BoxConnection, ChunnelExt, Noop, Offers};
/// use chunnel_discovery::{Implementation, Policy, Registry};
/// # fn main() -> Result<(), chunnel_discovery::Error> {
/// let reg = Registry::<BoxConnection<u8>, u8>::new();
/// reg.register(Implementation::new("a", "reliable", || Noop.boxed()).with_priority(1))?;
/// reg.register(Implementation::new("b", "reliable", || Noop.boxed()).with_priority(2))?;
/// assert_eq!(reg.select("reliable")?.names(), ["b", "a"]);
/// reg.set_policy(Policy::default().forbid("b"));
/// let sel = reg.select("reliable")?;
/// assert_eq!(sel.names(), ["a"]);
/// assert_eq!(sel.candidates()[0].to_string(), "b skipped: forbidden by the operator policy");
/// # Ok(()) }
/// ```
pub struct Registry<I, D> {
    state: Arc<RwLock<State<I, D>>>,
}

impl<I, D> Clone for Registry<I, D> {
    fn clone(&self) -> Self {
        Registry {
            state: Arc::clone(&self.state),
        }
    }
}

impl<I, D> fmt::Debug for Registry<I, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.read();
        f.debug_struct("Registry")
            .field("entries", &st.entries)
            .field("policy", &st.policy)
            .finish()
    }
}

impl<I, D> Default for Registry<I, D> {
    fn default() -> Self {
        Registry {
            state: Arc::new(RwLock::new(State {
                entries: Vec::new(),
                policy: Policy::default(),
            })),
        }
    }
}

impl<I, D> Registry<I, D> {
    /// An empty registry with the default policy.
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State<I, D>> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State<I, D>> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers an implementation; its name must be new. An implementation declared for
    /// [`Endpoints::Both`] must say so to negotiation: where its Chunnel is available, its
    /// options must carry an exact capability (which the peer must match), else
    /// [`Error::NotBothEnds`].
    pub fn register(&self, imp: Implementation<I, D>) -> Result<(), Error> {
        if imp.endpoints == Endpoints::Both {
            let c = imp.build();
            let exact = c.offers().iter().any(|o| {
                o.chunnels
                    .iter()
                    .any(|ch| ch.capabilities.iter().any(|k| k.matching == Match::Exact))
            });
            if c.available().is_ok() && !exact {
                return Err(Error::NotBothEnds { name: imp.name });
            }
        }
        let mut st = self.write();
        if st.entries.iter().any(|e| e.name == imp.name) {
            return Err(Error::Duplicate { name: imp.name });
        }
        st.entries.push(Arc::new(imp));
        Ok(())
    }

    /// Removes implementation `name` from future selects (live connections keep it, and its
    /// tear-down hook still runs when the last one drops). Whether it was registered.
    pub fn unregister(&self, name: &str) -> bool {
        let mut st = self.write();
        let before = st.entries.len();
        st.entries.retain(|e| e.name != name);
        st.entries.len() != before
    }

    /// Replaces the policy; selects built from now on follow it (built ones keep theirs).
    pub fn set_policy(&self, policy: Policy) {
        self.write().policy = policy;
    }

    /// The current policy.
    pub fn policy(&self) -> Policy {
        self.read().policy.clone()
    }

    /// How implementation `name` is used (`None` if not registered).
    pub fn usage(&self, name: &str) -> Option<Usage> {
        let st = self.read();
        let e = st.entries.iter().find(|e| e.name == name)?;
        Some(Usage {
            live: *e.life.live.lock().unwrap_or_else(|p| p.into_inner()),
            setups: e.life.setups.load(Ordering::Relaxed),
            teardowns: e.life.teardowns.load(Ordering::Relaxed),
        })
    }

    /// The implementation named `name` and the current policy.
    pub(crate) fn entry(&self, name: &str) -> (Option<Arc<Implementation<I, D>>>, Policy) {
        let st = self.read();
        let e = st.entries.iter().find(|e| e.name == name).cloned();
        (e, st.policy.clone())
    }

    /// The implementations of `function` in policy order, and the policy.
    pub(crate) fn ranked(&self, function: &str) -> (Vec<Arc<Implementation<I, D>>>, Policy) {
        let st = self.read();
        let policy = st.policy.clone();
        let mut v: Vec<(usize, Arc<Implementation<I, D>>)> = st
            .entries
            .iter()
            .filter(|e| e.function == function)
            .cloned()
            .enumerate()
            .collect();
        v.sort_by_key(|(i, e)| {
            (
                policy.scope_rank(e.scope),
                std::cmp::Reverse(effective_priority(&policy, e)),
                *i,
            )
        });
        (v.into_iter().map(|(_, e)| e).collect(), policy)
    }
}

pub(crate) fn effective_priority<I, D>(policy: &Policy, e: &Implementation<I, D>) -> i32 {
    policy.priority_override(&e.name).unwrap_or(e.priority)
}

/// Judges one implementation: `Ok` with its built Chunnel, or why it is skipped.
pub(crate) fn judge<I, D>(
    policy: &Policy,
    e: &Implementation<I, D>,
) -> Result<BoxChunnel<I, D>, Skip> {
    if policy.is_forbidden(&e.name) {
        return Err(Skip::Forbidden);
    }
    if let Some((resource, reason)) = e.missing_resource() {
        return Err(Skip::MissingResource { resource, reason });
    }
    let c = e.build();
    match c.available() {
        Ok(()) => Ok(c),
        Err(err) => Err(Skip::Unavailable {
            reason: err.to_string(),
        }),
    }
}
