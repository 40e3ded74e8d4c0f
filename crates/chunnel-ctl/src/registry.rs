//! What the application shows the endpoint: entries (connections and listeners) and
//! policies.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use chunnel::Offers;
use chunnel_negotiate::Info;
use tokio::sync::watch;

use crate::Error;
use crate::proto::{EntryView, Kind, LayerCounters, Negotiation, PolicyView, Reply, Steered};

/// A boxed future, for the object-safe [`Switch`] trait (the control path is not the data
/// path: one allocation per switch is fine).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Counters an entry reports, per layer. The application implements it for whatever holds
/// its counters (a closure returning them will do); the endpoint calls it for every `show`,
/// `ls` and `watch` snapshot, never on the data path.
pub trait Counters: Send + Sync + 'static {
    /// The current values.
    fn counters(&self) -> Vec<LayerCounters>;
}

impl<F: Fn() -> Vec<LayerCounters> + Send + Sync + 'static> Counters for F {
    fn counters(&self) -> Vec<LayerCounters> {
        self()
    }
}

/// How a switch is carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// This end alone (the branches must be wire compatible).
    Unilateral,
    /// By two-phase commit with the peer.
    Commit,
}

/// What a switch did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Switched {
    /// Whether the stack changed (false: it already ran on the branch).
    pub changed: bool,
    /// Details for the operator.
    pub detail: String,
}

/// A switch handle: moves a live connection between the branches of a reconfigurable select.
/// [`crate::ReconfigSwitch`] implements it for [`chunnel::ReconfigConnection`]s.
pub trait Switch: Send + Sync + 'static {
    /// The branches' names, in the select's order.
    fn branches(&self) -> Vec<String>;

    /// The index of the branch the connection runs on.
    fn current(&self) -> usize;

    /// Switches completed (the reconfiguration epoch).
    fn epoch(&self) -> u64;

    /// Whether only [`Mode::Commit`] switches are possible (the branches are not wire
    /// compatible, so this end cannot switch alone).
    fn commit_only(&self) -> bool {
        false
    }

    /// Switches to branch `to` (an index into [`Switch::branches`]). An error says why the
    /// connection stays where it was.
    fn switch(&self, to: usize, mode: Mode) -> BoxFuture<'_, Result<Switched, String>>;
}

/// What the application registers: one connection or listener.
pub struct Entry {
    kind: Kind,
    name: String,
    peer: Option<String>,
    stack: Vec<String>,
    negotiation: Option<Negotiation>,
    counters: Option<Arc<dyn Counters>>,
    switch: Option<Arc<dyn Switch>>,
}

impl fmt::Debug for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Entry")
            .field("kind", &self.kind)
            .field("name", &self.name)
            .field("peer", &self.peer)
            .field("stack", &self.stack)
            .field("switchable", &self.switch.is_some())
            .finish_non_exhaustive()
    }
}

impl Entry {
    /// A connection named `name`.
    pub fn connection(name: impl Into<String>) -> Self {
        Entry::new(Kind::Connection, name.into())
    }

    /// A listener named `name`.
    pub fn listener(name: impl Into<String>) -> Self {
        Entry::new(Kind::Listener, name.into())
    }

    fn new(kind: Kind, name: String) -> Self {
        Entry {
            kind,
            name,
            peer: None,
            stack: Vec::new(),
            negotiation: None,
            counters: None,
            switch: None,
        }
    }

    /// The peer's address (a listener: its bound address).
    pub fn with_peer(mut self, peer: impl fmt::Display) -> Self {
        self.peer = Some(peer.to_string());
        self
    }

    /// The picked stack, top layer first.
    pub fn with_stack<S: Into<String>>(mut self, layers: impl IntoIterator<Item = S>) -> Self {
        self.stack = layers.into_iter().map(Into::into).collect();
        self
    }

    /// What negotiation decided (see [`Negotiation::client`], [`Negotiation::server`]). Also
    /// sets the stack, if none was set, to this end's picked stack.
    pub fn with_negotiation(mut self, n: Negotiation) -> Self {
        if self.stack.is_empty() {
            self.stack = if n.role == "client" {
                n.client_stack.clone()
            } else {
                n.server_stack.clone()
            };
        }
        self.negotiation = Some(n);
        self
    }

    /// The entry's counters.
    pub fn with_counters(mut self, c: impl Counters) -> Self {
        self.counters = Some(Arc::new(c));
        self
    }

    /// The entry's switch handle.
    pub fn with_switch(mut self, s: impl Switch) -> Self {
        self.switch = Some(Arc::new(s));
        self
    }
}

impl Negotiation {
    /// A client's negotiation outcome: `info` from its negotiated connection, `stack` the
    /// stack it offered (its picked Chunnels are read from it).
    pub fn client<S: Offers + ?Sized>(info: &Info, stack: &S) -> Self {
        let client_stack = stack
            .offer_tree()
            .option(&info.client_pick)
            .map(|cs| cs.iter().map(|c| c.id.to_string()).collect())
            .unwrap_or_default();
        Negotiation {
            role: "client".into(),
            client_stack,
            ..Negotiation::server(info)
        }
    }

    /// A server's negotiation outcome (the client's stack is not known to the server).
    pub fn server(info: &Info) -> Self {
        Negotiation {
            role: "server".into(),
            client_pick: info.client_pick.branches().to_vec(),
            server_pick: info.server_pick.branches().to_vec(),
            client_stack: Vec::new(),
            server_stack: info.server_stack.iter().map(|c| c.id.to_string()).collect(),
            zero_rtt: format!("{:?}", info.zero_rtt),
            hellos_sent: info.hellos_sent,
        }
    }
}

struct Slot {
    entry: Entry,
    since: Instant,
}

/// What the registry and the endpoint ask of the running autopilot (the autopilot module
/// implements it; the registry does not import that module).
pub(crate) trait Pilot: Send + Sync + 'static {
    /// What the autopilot makes of entry `id`.
    fn steered(&self, id: u64) -> Option<Steered>;
    /// The answer to an `autopilot` request.
    fn reply(&self, id: Option<u64>, since: Option<u64>) -> Reply;
}

/// What the autopilot reads of a switchable entry: its id, counters and switch handle.
pub(crate) type Steerable = (u64, Option<Arc<dyn Counters>>, Arc<dyn Switch>);

type Validator = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

struct PolicySlot {
    description: String,
    validator: Validator,
    value: watch::Sender<String>,
}

struct Inner {
    name: String,
    next: AtomicU64,
    entries: Mutex<BTreeMap<u64, Arc<Slot>>>,
    policies: Mutex<BTreeMap<String, Arc<PolicySlot>>>,
    autopilot: Mutex<Option<Weak<dyn Pilot>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The entries and policies of one process, filled by the application and read (and
/// switched, and set) by the [`crate::Endpoint`]. Clones share one registry.
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("name", &self.inner.name)
            .field("entries", &lock(&self.inner.entries).len())
            .field("policies", &lock(&self.inner.policies).len())
            .finish()
    }
}

impl Registry {
    /// An empty registry of the process named `name` (shown by `chunnelctl`).
    pub fn new(name: impl Into<String>) -> Self {
        Registry {
            inner: Arc::new(Inner {
                name: name.into(),
                next: AtomicU64::new(1),
                entries: Mutex::default(),
                policies: Mutex::default(),
                autopilot: Mutex::new(None),
            }),
        }
    }

    /// The process name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Registers `entry`; it is listed until the returned guard is dropped (keep the guard
    /// with the connection).
    pub fn register(&self, entry: Entry) -> Guard {
        let id = self.inner.next.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot {
            entry,
            since: Instant::now(),
        });
        lock(&self.inner.entries).insert(id, slot);
        Guard {
            id,
            registry: Arc::downgrade(&self.inner),
        }
    }

    /// Entries registered now.
    pub fn len(&self) -> usize {
        lock(&self.inner.entries).len()
    }

    /// Whether no entry is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Registers the policy `name` with its `initial` value and a `validator` that every
    /// value set through the endpoint must pass. The returned [`Policy`] reads it (and is
    /// told of changes).
    pub fn policy<V>(
        &self,
        name: &str,
        description: &str,
        initial: &str,
        validator: V,
    ) -> Result<Policy, Error>
    where
        V: Fn(&str) -> Result<(), String> + Send + Sync + 'static,
    {
        validator(initial).map_err(|reason| Error::InvalidValue {
            name: name.into(),
            reason,
        })?;
        let mut policies = lock(&self.inner.policies);
        if policies.contains_key(name) {
            return Err(Error::DuplicatePolicy { name: name.into() });
        }
        let slot = Arc::new(PolicySlot {
            description: description.into(),
            validator: Box::new(validator),
            value: watch::Sender::new(initial.into()),
        });
        policies.insert(name.into(), Arc::clone(&slot));
        Ok(Policy {
            name: name.into(),
            slot,
        })
    }

    /// Installs the autopilot whose log the endpoint serves (the latest one started).
    pub(crate) fn set_autopilot(&self, a: &Arc<impl Pilot>) {
        let a: Arc<dyn Pilot> = Arc::clone(a) as _;
        *lock(&self.inner.autopilot) = Some(Arc::downgrade(&a));
    }

    /// The running autopilot, if any.
    pub(crate) fn autopilot(&self) -> Option<Arc<dyn Pilot>> {
        lock(&self.inner.autopilot).as_ref()?.upgrade()
    }

    /// Switchable entries named `name`: id, counters, switch handle.
    pub(crate) fn steerable(&self, name: &str) -> Vec<Steerable> {
        lock(&self.inner.entries)
            .iter()
            .filter(|(_, s)| s.entry.name == name)
            .filter_map(|(id, s)| {
                let sw = s.entry.switch.clone()?;
                Some((*id, s.entry.counters.clone(), sw))
            })
            .collect()
    }

    pub(crate) fn views(&self, only: Option<u64>) -> Vec<EntryView> {
        let slots: Vec<(u64, Arc<Slot>)> = {
            let entries = lock(&self.inner.entries);
            match only {
                Some(id) => entries
                    .get(&id)
                    .map(|s| (id, Arc::clone(s)))
                    .into_iter()
                    .collect(),
                None => entries.iter().map(|(k, s)| (*k, Arc::clone(s))).collect(),
            }
        };
        let pilot = self.autopilot();
        slots
            .into_iter()
            .map(|(id, s)| {
                let mut v = view(id, &s);
                v.autopilot = pilot.as_ref().and_then(|p| p.steered(id));
                v
            })
            .collect()
    }

    pub(crate) fn switches(&self, only: Option<u64>) -> Vec<(u64, Option<Arc<dyn Switch>>)> {
        let entries = lock(&self.inner.entries);
        let all = entries.iter().map(|(id, s)| (*id, s.entry.switch.clone()));
        match only {
            Some(id) => all.filter(|(i, _)| *i == id).collect(),
            None => all.filter(|(_, s)| s.is_some()).collect(),
        }
    }

    pub(crate) fn policy_views(&self, only: Option<&str>) -> Option<Vec<PolicyView>> {
        let policies = lock(&self.inner.policies);
        let view = |(name, s): (&String, &Arc<PolicySlot>)| PolicyView {
            name: name.clone(),
            value: s.value.borrow().clone(),
            description: s.description.clone(),
            previous: None,
        };
        match only {
            Some(name) => Some(vec![view(policies.get_key_value(name)?)]),
            None => Some(policies.iter().map(view).collect()),
        }
    }

    /// Sets policy `name` to `value` if its validator agrees; the previous value.
    pub fn set_policy(&self, name: &str, value: &str) -> Result<String, Error> {
        let slot = lock(&self.inner.policies)
            .get(name)
            .cloned()
            .ok_or_else(|| Error::NoSuchPolicy { name: name.into() })?;
        (slot.validator)(value).map_err(|reason| Error::InvalidValue {
            name: name.into(),
            reason,
        })?;
        Ok(slot.value.send_replace(value.into()))
    }
}

fn view(id: u64, s: &Slot) -> EntryView {
    let e = &s.entry;
    let (epoch, branch, branches, commit_only) = match &e.switch {
        Some(sw) => {
            let branches = sw.branches();
            let branch = branches.get(sw.current()).cloned();
            (sw.epoch(), branch, branches, sw.commit_only())
        }
        None => (0, None, Vec::new(), false),
    };
    EntryView {
        id,
        kind: e.kind,
        name: e.name.clone(),
        peer: e.peer.clone(),
        stack: e.stack.clone(),
        negotiation: e.negotiation.clone(),
        epoch,
        branch,
        branches,
        commit_only,
        counters: e
            .counters
            .as_ref()
            .map(|c| c.counters())
            .unwrap_or_default(),
        age_ms: u64::try_from(s.since.elapsed().as_millis()).unwrap_or(u64::MAX),
        autopilot: None,
    }
}

/// Keeps an entry registered; dropping it removes the entry.
#[derive(Debug)]
pub struct Guard {
    id: u64,
    registry: Weak<Inner>,
}

impl Guard {
    /// The entry's id (what `chunnelctl show` takes).
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(r) = self.registry.upgrade() {
            // Dropped outside the lock: the entry's handles may own connections.
            let slot = lock(&r.entries).remove(&self.id);
            drop(slot);
        }
    }
}

/// A registered policy value, as the application reads it.
#[derive(Clone)]
pub struct Policy {
    name: String,
    slot: Arc<PolicySlot>,
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("name", &self.name)
            .field("value", &*self.slot.value.borrow())
            .finish()
    }
}

impl Policy {
    /// The current value.
    pub fn get(&self) -> String {
        self.slot.value.borrow().clone()
    }

    /// A receiver told of every change.
    pub fn subscribe(&self) -> watch::Receiver<String> {
        self.slot.value.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_removes_the_entry() {
        let r = Registry::new("t");
        let a = r.register(Entry::connection("a").with_stack(["x", "y"]));
        let b = r.register(
            Entry::listener("b").with_counters(|| vec![LayerCounters::new("l", [("n", 3)])]),
        );
        assert_ne!(a.id(), b.id());
        let v = r.views(None);
        assert_eq!(v.len(), 2);
        assert_eq!(v[1].counters[0].counters[0].value, 3);
        drop(a);
        assert_eq!(r.views(None).len(), 1);
        assert!(r.views(Some(b.id())).len() == 1);
        drop(b);
        assert!(r.is_empty());
    }

    #[test]
    fn policy_validates() {
        let r = Registry::new("t");
        let p = r
            .policy("rate", "requests/s", "100", |v| {
                v.parse::<u32>().map(|_| ()).map_err(|e| e.to_string())
            })
            .unwrap();
        assert!(matches!(
            r.policy("rate", "", "1", |_| Ok(())),
            Err(Error::DuplicatePolicy { .. })
        ));
        assert!(matches!(
            r.set_policy("rate", "fast"),
            Err(Error::InvalidValue { .. })
        ));
        assert_eq!(p.get(), "100");
        assert_eq!(r.set_policy("rate", "7").unwrap(), "100");
        assert_eq!(p.get(), "7");
        assert!(matches!(
            r.set_policy("nope", "1"),
            Err(Error::NoSuchPolicy { .. })
        ));
    }
}
