//! The autopilot: rules that watch the counters of registered entries and switch them
//! between branches, with hysteresis.
//!
//! A [`Rule`] says: for the entries of a name, compute the rate of one counter over a
//! window; above `up`, move them to one branch, below `down` (less than `up`) to another;
//! between the two, leave them; never switch one entry twice within `dwell`; after a failed
//! switch, wait `retry` before trying again. The decisions are made by a sans-IO
//! [`Machine`] per rule (samples with their times in, switch actions and decision records
//! out); [`Autopilot`] is its driver: a task that samples the [`Registry`]'s entries every
//! [`Config::interval`], switches through their [`crate::Switch`] handles, and logs every
//! decision (and every suppressed one: within the dwell time, already there, waiting to
//! retry) with its reason through `tracing` and into a bounded [`DecisionLog`] that the
//! endpoint serves (`chunnelctl autopilot`; the latest decision about an entry is in its
//! `show`).
//!
//! Switches run one at a time in the driver's task (each bounded by
//! [`Config::switch_timeout`]); sampling resumes when they end.
//!
//! Rules are policies: `autopilot` (`on` or `off`) and `autopilot.NAME` per rule (its text,
//! see [`Rule`]), so an operator changes thresholds or turns the autopilot off with
//! `chunnelctl policy`.
//!
//! ```
//! use std::time::Duration;
//! use chunnel_ctl::Registry;
//! use chunnel_ctl::autopilot::{Autopilot, Config};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel_ctl::Error> {
//! let registry = Registry::new("app");
//! let pilot = Autopilot::start(
//!     &registry,
//!     Config::default(),
//!     [("sharding", r#"entry="kv client" counter=kv-client/requests window=2s
//!         up=600 down=300 dwell=5s above=client-push below=server-side"#)],
//! )?;
//! assert_eq!(registry.set_policy("autopilot", "off")?, "on");
//! # drop(pilot); Ok(()) }
//! ```

mod machine;
mod rule;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

pub use machine::{Action, DecisionLog, MAX_SAMPLES, Machine, Observation};
pub use rule::Rule;

use crate::Error;
use crate::proto::{Decision, Reply, RuleView, Steered, Verdict};
use crate::registry::{Mode, Policy, Registry};

/// How the autopilot runs.
#[derive(Clone, Debug)]
pub struct Config {
    /// Between two samples of every entry (default 200 ms).
    pub interval: Duration,
    /// Decisions the log keeps (default 1024).
    pub log_capacity: usize,
    /// The longest wait for one switch (default 30 s); longer is a failed switch.
    pub switch_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            interval: Duration::from_millis(200),
            log_capacity: 1024,
            switch_timeout: Duration::from_secs(30),
        }
    }
}

fn valid_on(v: &str) -> Result<(), String> {
    match v {
        "on" | "off" => Ok(()),
        _ => Err(format!("{v:?} is neither on nor off")),
    }
}

#[derive(Debug)]
struct State {
    on: bool,
    log: DecisionLog,
    machines: Vec<Machine>,
}

/// What the endpoint reads (through the registry).
#[derive(Debug)]
pub(crate) struct Shared {
    state: Mutex<State>,
    /// Set when the [`Autopilot`] is dropped (a [`Log`] may keep the log readable).
    stopped: AtomicBool,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl crate::registry::Pilot for Shared {
    fn reply(&self, id: Option<u64>, since: Option<u64>) -> Reply {
        let s = lock(&self.state);
        Reply::Autopilot {
            running: !self.stopped.load(Ordering::Relaxed),
            enabled: s.on,
            rules: s
                .machines
                .iter()
                .map(|m| RuleView {
                    name: m.name().to_owned(),
                    spec: m.rule().to_string(),
                    enabled: m.rule().enabled,
                    entries: m.entries().collect(),
                })
                .collect(),
            decisions: s.log.since(since.unwrap_or(0), id),
            dropped: s.log.dropped(),
        }
    }

    fn steered(&self, id: u64) -> Option<Steered> {
        let s = lock(&self.state);
        s.machines.iter().find_map(|m| {
            let (rate, last) = m.status(id)?;
            Some(Steered {
                rule: m.name().to_owned(),
                rate,
                window_ms: m.rule().window_ms,
                last: last.cloned(),
            })
        })
    }
}

/// The running autopilot of a [`Registry`]: stops when dropped.
#[derive(Debug)]
pub struct Autopilot {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Autopilot {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::Relaxed);
        self.task.abort();
    }
}

impl Autopilot {
    /// Starts the autopilot of `registry` with `rules` (name, text) from a task of the
    /// current tokio runtime: registers the policies `autopilot` (`on`) and
    /// `autopilot.NAME` for each rule, and serves its log on the registry's endpoint. A
    /// rule whose text does not parse is [`Error::InvalidValue`].
    pub fn start<'a>(
        registry: &Registry,
        cfg: Config,
        rules: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Autopilot, Error> {
        let on = registry.policy(
            "autopilot",
            "the autopilot: on (it switches entries by its rules) or off",
            "on",
            valid_on,
        )?;
        let mut policies = Vec::new();
        let mut machines = Vec::new();
        for (name, text) in rules {
            let rule: Rule = text.parse().map_err(|reason| Error::InvalidValue {
                name: format!("autopilot.{name}"),
                reason,
            })?;
            let p = registry.policy(
                &format!("autopilot.{name}"),
                "an autopilot rule: entry=NAME counter=LAYER/COUNTER window=MS up=RATE down=RATE dwell=MS [retry=MS] above=BRANCH below=BRANCH [mode=unilateral|commit], or off",
                &rule.to_string(),
                |v| v.parse::<Rule>().map(|_| ()),
            )?;
            policies.push(p);
            machines.push(Machine::new(name, rule));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                on: true,
                log: DecisionLog::new(cfg.log_capacity),
                machines,
            }),
            stopped: AtomicBool::new(false),
        });
        registry.set_autopilot(&shared);
        let task = tokio::spawn(run(
            registry.clone(),
            Arc::clone(&shared),
            cfg,
            on,
            policies,
        ));
        Ok(Autopilot { shared, task })
    }

    /// The decisions after sequence number `since` (0: all the log holds).
    pub fn decisions(&self, since: u64) -> Vec<Decision> {
        lock(&self.shared.state).log.since(since, None)
    }

    /// A handle on the decision log (it outlives nothing: once the autopilot is dropped,
    /// it reads the decisions made until then).
    pub fn log(&self) -> Log {
        Log(Arc::clone(&self.shared))
    }
}

/// Reads an [`Autopilot`]'s decision log.
#[derive(Clone, Debug)]
pub struct Log(Arc<Shared>);

impl Log {
    /// The decisions after sequence number `since` (0: all the log holds).
    pub fn decisions(&self, since: u64) -> Vec<Decision> {
        lock(&self.0.state).log.since(since, None)
    }
}

/// Emits the log's records after `*traced` as tracing events.
fn trace(log: &DecisionLog, traced: &mut u64) {
    for d in log.since(*traced, None) {
        *traced = d.seq;
        let (rule, entry, rate) = (&d.rule, d.entry, d.rate);
        match d.verdict {
            Verdict::Failed => {
                tracing::warn!(rule, entry, rate, verdict = ?d.verdict, "autopilot: {}", d.reason)
            }
            Verdict::Switch | Verdict::Switched | Verdict::External | Verdict::Policy => {
                tracing::info!(rule, entry, rate, verdict = ?d.verdict, "autopilot: {}", d.reason)
            }
            _ => {
                tracing::debug!(rule, entry, rate, verdict = ?d.verdict, "autopilot: {}", d.reason)
            }
        }
    }
}

async fn run(registry: Registry, shared: Arc<Shared>, cfg: Config, on: Policy, rules: Vec<Policy>) {
    let start = Instant::now();
    let now_ms = || u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
    let mut tick = tokio::time::interval(cfg.interval.max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut traced = 0;
    loop {
        tick.tick().await;
        let now = now_ms();
        // Policies first: an operator's change applies to this round.
        {
            let mut s = lock(&shared.state);
            let s = &mut *s;
            s.on = on.get() == "on";
            for (m, p) in s.machines.iter_mut().zip(&rules) {
                m.set_on(now, s.on, &mut s.log);
                if let Ok(r) = p.get().parse::<Rule>() {
                    m.set_rule(now, r, &mut s.log);
                }
            }
        }
        let wanted: Vec<(String, String, String)> = lock(&shared.state)
            .machines
            .iter()
            .map(|m| {
                let r = m.rule();
                (r.entry.clone(), r.layer.clone(), r.counter.clone())
            })
            .collect();
        let mut actions = Vec::new();
        for (i, (name, layer, counter)) in wanted.iter().enumerate() {
            // Counters are read outside the autopilot's lock (they are the application's).
            let found = registry.steerable(name);
            let readings: Vec<_> = found
                .iter()
                .map(|(id, counters, sw)| {
                    let value = counters.as_ref().and_then(|c| {
                        c.counters()
                            .into_iter()
                            .filter(|l| &l.layer == layer)
                            .flat_map(|l| l.counters)
                            .find(|c| &c.name == counter)
                            .map(|c| c.value)
                    });
                    (*id, value, sw.branches(), sw.current(), sw.epoch())
                })
                .collect();
            let mut s = lock(&shared.state);
            let s = &mut *s;
            let m = &mut s.machines[i];
            let live: HashSet<u64> = found.iter().map(|(id, ..)| *id).collect();
            m.retain(|id| live.contains(&id));
            for (id, value, branches, current, epoch) in &readings {
                let obs = Observation {
                    entry: *id,
                    value: *value,
                    branches,
                    current: *current,
                    epoch: *epoch,
                };
                if let Some(a) = m.observe(now, obs, &mut s.log) {
                    let sw = found.iter().find(|f| f.0 == a.entry).map(|f| f.2.clone());
                    actions.push((i, a, sw, branches.clone()));
                }
            }
        }
        trace(&lock(&shared.state).log, &mut traced);
        for (i, a, sw, branches) in actions {
            let Some(sw) = sw else { continue };
            let mode = if a.commit {
                Mode::Commit
            } else {
                Mode::Unilateral
            };
            let outcome =
                match tokio::time::timeout(cfg.switch_timeout, sw.switch(a.to, mode)).await {
                    Ok(Ok(s)) => Ok(s.detail),
                    Ok(Err(why)) => Err(why),
                    Err(_) => Err(format!("no outcome within {:?}", cfg.switch_timeout)),
                };
            let epoch = sw.epoch();
            let mut s = lock(&shared.state);
            let s = &mut *s;
            s.machines[i].switched(now_ms(), a.entry, &branches, outcome, epoch, &mut s.log);
        }
        trace(&lock(&shared.state).log, &mut traced);
    }
}
