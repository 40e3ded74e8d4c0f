//! The autopilot's decisions, sans IO: counter samples with their times in, switch actions
//! and decision records out. No clock, no task, no registry: [`super::Autopilot`] drives it.

use std::collections::{BTreeMap, VecDeque};

use super::Rule;
use crate::proto::{Decision, Verdict};

/// The most samples kept per entry. Only the oldest sample of the window and the newest
/// count for the rate, so when the cap is reached the second oldest is dropped.
pub const MAX_SAMPLES: usize = 4096;

/// One reading of one entry the rule steers.
#[derive(Clone, Copy, Debug)]
pub struct Observation<'a> {
    /// The entry's id.
    pub entry: u64,
    /// The rule's counter (None: the entry has no such counter).
    pub value: Option<u64>,
    /// The entry's branches.
    pub branches: &'a [String],
    /// The index of the branch it runs on.
    pub current: usize,
    /// Its switch count (an unexpected change is a switch by someone else).
    pub epoch: u64,
}

/// What the driver should do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Action {
    /// The entry.
    pub entry: u64,
    /// The branch index to switch it to.
    pub to: usize,
    /// By two-phase commit with the peer.
    pub commit: bool,
}

/// The bounded decision log: the latest `capacity` decisions, numbered.
#[derive(Debug)]
pub struct DecisionLog {
    capacity: usize,
    next: u64,
    ring: VecDeque<Decision>,
}

impl DecisionLog {
    /// A log keeping the latest `capacity` (at least 1) decisions.
    pub fn new(capacity: usize) -> Self {
        DecisionLog {
            capacity: capacity.max(1),
            next: 1,
            ring: VecDeque::new(),
        }
    }

    /// Appends `d`, numbering it; the oldest record goes if the log is full.
    pub fn push(&mut self, mut d: Decision) -> Decision {
        d.seq = self.next;
        self.next += 1;
        if self.ring.len() == self.capacity {
            self.ring.pop_front();
        }
        self.ring.push_back(d.clone());
        d
    }

    /// Records with a sequence number above `since`, about `entry` if given, oldest first.
    pub fn since(&self, since: u64, entry: Option<u64>) -> Vec<Decision> {
        self.ring
            .iter()
            .filter(|d| d.seq > since && (entry.is_none() || d.entry == entry))
            .cloned()
            .collect()
    }

    /// Records no longer held.
    pub fn dropped(&self) -> u64 {
        self.next - 1 - self.ring.len() as u64
    }

    /// The sequence number of the latest record (0: none yet).
    pub fn last_seq(&self) -> u64 {
        self.next - 1
    }
}

#[derive(Debug, Default)]
struct Track {
    samples: VecDeque<(u64, u64)>,
    epoch: u64,
    last_switch: Option<u64>,
    /// (from, to, rate) of a switch under way.
    in_flight: Option<(usize, usize, f64)>,
    retry_at: Option<u64>,
    /// The latest suppressed verdict and its target: the same one is not logged again.
    quiet: Option<(Verdict, String)>,
    rate: Option<f64>,
    latest: Option<Decision>,
}

/// One rule's decisions for every entry it steers.
#[derive(Debug)]
pub struct Machine {
    name: String,
    rule: Rule,
    on: bool,
    entries: BTreeMap<u64, Track>,
}

impl Machine {
    /// The machine of rule `name`; it acts while `rule` is enabled and the autopilot is on
    /// ([`Machine::set_on`], initially on).
    pub fn new(name: impl Into<String>, rule: Rule) -> Self {
        Machine {
            name: name.into(),
            rule,
            on: true,
            entries: BTreeMap::new(),
        }
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The rule.
    pub fn rule(&self) -> &Rule {
        &self.rule
    }

    /// The entries it tracks.
    pub fn entries(&self) -> impl Iterator<Item = u64> + '_ {
        self.entries.keys().copied()
    }

    /// An entry's rate over the window (None until the window is covered) and the latest
    /// decision about it.
    pub fn status(&self, entry: u64) -> Option<(Option<f64>, Option<&Decision>)> {
        self.entries
            .get(&entry)
            .map(|t| (t.rate, t.latest.as_ref()))
    }

    fn record(
        &mut self,
        log: &mut DecisionLog,
        now: u64,
        entry: Option<u64>,
        verdict: Verdict,
        (from, to, rate): (&str, &str, Option<f64>),
        reason: String,
    ) {
        let d = log.push(Decision {
            seq: 0,
            at_ms: now,
            rule: self.name.clone(),
            entry,
            verdict,
            from: from.into(),
            to: to.into(),
            rate,
            up: self.rule.up,
            down: self.rule.down,
            window_ms: self.rule.window_ms,
            dwell_ms: self.rule.dwell_ms,
            reason,
        });
        if let Some(t) = entry.and_then(|e| self.entries.get_mut(&e)) {
            t.latest = Some(d);
        }
    }

    /// Records a suppressed verdict unless it repeats the entry's previous one.
    #[allow(clippy::too_many_arguments)]
    fn quiet(
        &mut self,
        log: &mut DecisionLog,
        now: u64,
        entry: u64,
        verdict: Verdict,
        what: (&str, &str, Option<f64>),
        reason: impl FnOnce() -> String,
    ) {
        let key = (verdict, what.1.to_owned());
        let t = self.entries.get_mut(&entry).expect("tracked");
        if t.quiet.as_ref() == Some(&key) {
            return;
        }
        t.quiet = Some(key);
        self.record(log, now, Some(entry), verdict, what, reason());
    }

    /// Turns the whole autopilot on or off (the `autopilot` policy); logged when it changes.
    pub fn set_on(&mut self, now: u64, on: bool, log: &mut DecisionLog) {
        if on == self.on {
            return;
        }
        self.on = on;
        for t in self.entries.values_mut() {
            t.quiet = None;
        }
        let reason = if on {
            "the autopilot was turned on"
        } else {
            "the autopilot was turned off: no switches until it is on again"
        };
        self.record(
            log,
            now,
            None,
            Verdict::Policy,
            ("", "", None),
            reason.into(),
        );
    }

    /// Replaces the rule (its policy was set); logged.
    pub fn set_rule(&mut self, now: u64, rule: Rule, log: &mut DecisionLog) {
        if rule == self.rule {
            return;
        }
        let counter_changed = (rule.layer.as_str(), rule.counter.as_str())
            != (self.rule.layer.as_str(), self.rule.counter.as_str());
        let reason = format!("rule changed from `{}` to `{}`", self.rule, rule);
        self.rule = rule;
        for t in self.entries.values_mut() {
            t.quiet = None;
            t.retry_at = None;
            if counter_changed {
                t.samples.clear();
                t.rate = None;
            }
        }
        self.record(log, now, None, Verdict::Policy, ("", "", None), reason);
    }

    /// Forgets the entries `live` does not hold (they went away).
    pub fn retain(&mut self, live: impl Fn(u64) -> bool) {
        self.entries.retain(|id, _| live(*id));
    }

    /// Takes one sample of an entry at `now` (milliseconds on any monotonic clock); a switch
    /// to make, if one is due. Every decision, and every suppressed one that differs from
    /// the entry's previous, goes to `log`.
    pub fn observe(
        &mut self,
        now: u64,
        obs: Observation<'_>,
        log: &mut DecisionLog,
    ) -> Option<Action> {
        let (id, rule) = (obs.entry, self.rule.clone());
        let cur = obs.branches.get(obs.current).cloned().unwrap_or_default();
        let t = self.entries.entry(id).or_insert_with(|| Track {
            epoch: obs.epoch,
            ..Track::default()
        });
        let Some(v) = obs.value else {
            t.rate = None;
            let why = || format!("entry {id} has no counter {}/{}", rule.layer, rule.counter);
            self.quiet(log, now, id, Verdict::Mismatch, (&cur, "", None), why);
            return None;
        };
        // A counter that went back was reset: the window starts again.
        if t.samples.back().is_some_and(|&(_, last)| v < last) {
            t.samples.clear();
        }
        if t.samples.len() >= MAX_SAMPLES {
            t.samples.remove(1);
        }
        t.samples.push_back((now, v));
        let edge = now.saturating_sub(rule.window_ms);
        while t.samples.len() > 2 && t.samples[1].0 <= edge {
            t.samples.pop_front();
        }
        let (t0, v0) = t.samples[0];
        t.rate = (now >= t0 + rule.window_ms && now > t0)
            .then(|| (v - v0) as f64 * 1000.0 / (now - t0) as f64);
        let rate = t.rate;

        if t.in_flight.is_none() && obs.epoch != t.epoch {
            let was = t.epoch;
            t.epoch = obs.epoch;
            t.last_switch = Some(now);
            t.quiet = None;
            let reason = format!(
                "entry {id} switched without the autopilot (epoch {was} -> {}), now on {cur}: no switch for the next {} ms (dwell)",
                obs.epoch, rule.dwell_ms
            );
            self.record(
                log,
                now,
                Some(id),
                Verdict::External,
                ("", &cur, rate),
                reason,
            );
        }
        let t = self.entries.get_mut(&id).expect("tracked");
        if !self.on || !rule.enabled || t.in_flight.is_some() {
            return None;
        }
        let rate = rate?;
        let window = rule.window_ms;
        let (want, why) = if rate > rule.up {
            (
                &rule.above,
                format!("rate {rate:.1}/s over {window} ms > up {}", rule.up),
            )
        } else if rate < rule.down {
            (
                &rule.below,
                format!("rate {rate:.1}/s over {window} ms < down {}", rule.down),
            )
        } else {
            return None;
        };
        let what = (cur.as_str(), want.as_str(), Some(rate));
        let Some(to) = obs.branches.iter().position(|b| b == want) else {
            let why = || {
                format!(
                    "{why}: would switch to {want}, but entry {id} has no such branch (its branches: {})",
                    obs.branches.join(", ")
                )
            };
            self.quiet(log, now, id, Verdict::Mismatch, what, why);
            return None;
        };
        if to == obs.current {
            let why = || format!("{why}: already on {want}");
            self.quiet(log, now, id, Verdict::AlreadyThere, what, why);
            return None;
        }
        if let Some(at) = t.last_switch
            && now < at + rule.dwell_ms
        {
            let why = || {
                format!(
                    "{why}: {want} is due, but the last switch was {} ms ago (dwell {} ms)",
                    now - at,
                    rule.dwell_ms
                )
            };
            self.quiet(log, now, id, Verdict::WithinDwell, what, why);
            return None;
        }
        if let Some(at) = t.retry_at
            && now < at
        {
            let why = || format!("{why}: {want} is due, retrying in {} ms", at - now);
            self.quiet(log, now, id, Verdict::RetryWait, what, why);
            return None;
        }
        t.in_flight = Some((obs.current, to, rate));
        t.quiet = None;
        let reason = format!("{why}: switching {cur} -> {want}");
        self.record(log, now, Some(id), Verdict::Switch, what, reason);
        Some(Action {
            entry: id,
            to,
            commit: rule.commit,
        })
    }

    /// The outcome of an [`Action`]: `Ok(detail)` or `Err(why)`, and the entry's epoch
    /// after it.
    pub fn switched(
        &mut self,
        now: u64,
        entry: u64,
        branches: &[String],
        outcome: Result<String, String>,
        epoch: u64,
        log: &mut DecisionLog,
    ) {
        let retry = self.rule.retry_ms;
        let Some(t) = self.entries.get_mut(&entry) else {
            return;
        };
        let Some((from, to, rate)) = t.in_flight.take() else {
            return;
        };
        t.epoch = epoch;
        let name = |i: usize| branches.get(i).cloned().unwrap_or_default();
        let (from, to) = (name(from), name(to));
        let what = (from.as_str(), to.as_str(), Some(rate));
        match outcome {
            Ok(detail) => {
                t.last_switch = Some(now);
                t.retry_at = None;
                t.quiet = Some((Verdict::AlreadyThere, to.clone()));
                let reason = format!("switched {from} -> {to} ({detail}), epoch {epoch}");
                self.record(log, now, Some(entry), Verdict::Switched, what, reason);
            }
            Err(why) => {
                t.retry_at = Some(now + retry);
                t.quiet = Some((Verdict::RetryWait, to.clone()));
                let reason = format!(
                    "switch {from} -> {to} failed: {why}; stays on {from}, next attempt in {retry} ms if still due"
                );
                self.record(log, now, Some(entry), Verdict::Failed, what, reason);
            }
        }
    }
}
