//! Deterministic tests of the decision machine: samples at chosen times, no clock.

use super::*;
use crate::proto::Verdict;

const RULE: &str = "entry=e counter=l/requests window=1000 up=300 down=150 dwell=3000 retry=2000 above=push below=side";

/// A simulated entry: a counter growing at a chosen rate, its branch and epoch, sampled
/// every 100 ms.
struct Sim {
    m: Machine,
    log: DecisionLog,
    now: u64,
    value: f64,
    branches: Vec<String>,
    current: usize,
    epoch: u64,
    /// What the next switch answers.
    fail: Option<String>,
    switches: Vec<(u64, usize)>,
}

impl Sim {
    fn new(rule: &str) -> Sim {
        Sim {
            m: Machine::new("r", rule.parse().unwrap()),
            log: DecisionLog::new(64),
            now: 0,
            value: 0.0,
            branches: vec!["push".into(), "side".into()],
            current: 0,
            epoch: 0,
            fail: None,
            switches: Vec::new(),
        }
    }

    /// Runs `ms` at `rate` per second; the driver's loop, with switches that complete at once.
    fn run(&mut self, rate: f64, ms: u64) {
        for _ in 0..ms / 100 {
            self.now += 100;
            self.value += rate / 10.0;
            let obs = Observation {
                entry: 7,
                value: Some(self.value as u64),
                branches: &self.branches,
                current: self.current,
                epoch: self.epoch,
            };
            if let Some(a) = self.m.observe(self.now, obs, &mut self.log) {
                assert_eq!(a.entry, 7);
                let outcome = match self.fail.clone() {
                    Some(why) => Err(why),
                    None => {
                        self.current = a.to;
                        self.epoch += 1;
                        self.switches.push((self.now, a.to));
                        Ok("switched unilaterally".to_owned())
                    }
                };
                self.m.switched(
                    self.now,
                    7,
                    &self.branches,
                    outcome,
                    self.epoch,
                    &mut self.log,
                );
            }
        }
    }

    fn verdicts(&self) -> Vec<Verdict> {
        self.log.since(0, None).iter().map(|d| d.verdict).collect()
    }

    fn branch(&self) -> &str {
        &self.branches[self.current]
    }
}

#[test]
fn ramp_up_and_down_switches_there_and_back_with_reasons() {
    let mut s = Sim::new(RULE);
    // Warm-up: no decision before the window is covered, even at a high rate.
    s.run(1000.0, 900);
    assert!(
        s.log.since(0, None).is_empty(),
        "{:?}",
        s.log.since(0, None)
    );
    s.run(1000.0, 1000);
    // Already on push (the high branch): logged once, not once per sample.
    assert_eq!(s.verdicts(), [Verdict::AlreadyThere]);
    // Load falls: once the window's rate is under `down`, to side.
    s.run(50.0, 3000);
    assert_eq!(s.branch(), "side");
    assert_eq!(s.switches.len(), 1);
    let d = s.log.since(0, None);
    let sw = d.iter().find(|d| d.verdict == Verdict::Switch).unwrap();
    assert_eq!((sw.from.as_str(), sw.to.as_str()), ("push", "side"));
    assert!(sw.rate.unwrap() < 150.0, "{sw:?}");
    assert!(sw.reason.contains("< down 150"), "{}", sw.reason);
    assert!(sw.reason.contains("over 1000 ms"), "{}", sw.reason);
    let done = d.iter().find(|d| d.verdict == Verdict::Switched).unwrap();
    assert!(done.reason.contains("epoch 1"), "{}", done.reason);
    // The window smooths: the switch came only after enough low samples (the rate over
    // the window fell under 150 once ~85% of the window was at the low rate).
    let fell_at = 1900;
    assert!(s.switches[0].0 >= fell_at + 800, "{:?}", s.switches);
    // Up again.
    s.run(600.0, 4000);
    assert_eq!(s.branch(), "push");
    assert_eq!(s.switches.len(), 2);
    let (status_rate, last) = s.m.status(7).unwrap();
    assert!((status_rate.unwrap() - 600.0).abs() < 1.0);
    assert_eq!(last.unwrap().verdict, Verdict::Switched);
}

#[test]
fn oscillating_near_a_threshold_does_not_flap() {
    let mut s = Sim::new(RULE);
    s.run(400.0, 2000);
    assert_eq!(s.branch(), "push");
    // Around `up` (300) and never under `down` (150): a rate between the two moves nothing.
    for k in 0..40 {
        s.run(if k % 2 == 0 { 250.0 } else { 350.0 }, 500);
    }
    assert!(s.switches.is_empty(), "{:?}", s.switches);
    // Around `down` once on side: one switch down, then none back up under `up`.
    s.run(100.0, 2000);
    assert_eq!(s.switches.len(), 1);
    for k in 0..40 {
        s.run(if k % 2 == 0 { 120.0 } else { 280.0 }, 500);
    }
    assert_eq!(s.switches.len(), 1, "{:?}", s.switches);
    assert_eq!(s.branch(), "side");
}

#[test]
fn a_blip_shorter_than_the_window_does_not_switch() {
    let mut s = Sim::new(RULE);
    s.run(100.0, 2000);
    assert_eq!(s.branch(), "side");
    s.run(100.0, 4000);
    // 200 ms at 1000/s: the window's rate is (800*0.1 + 200*1) = 280 < 300.
    s.run(1000.0, 200);
    s.run(100.0, 2000);
    assert_eq!(s.switches.len(), 1, "{:?}", s.switches);
}

#[test]
fn dwell_holds_a_due_switch_back() {
    let rule = RULE.replace("dwell=3000", "dwell=5000");
    let mut s = Sim::new(&rule);
    s.run(50.0, 1500);
    assert_eq!(s.switches.len(), 1);
    let first = s.switches[0].0;
    // Load rises at once: the switch is due within ~1 s, held until 5 s after the first.
    s.run(1000.0, 8000);
    assert_eq!(s.switches.len(), 2);
    assert_eq!(s.switches[1].0, first + 5000, "{:?}", s.switches);
    let held: Vec<_> = s
        .log
        .since(0, None)
        .into_iter()
        .filter(|d| d.verdict == Verdict::WithinDwell)
        .collect();
    assert_eq!(held.len(), 1, "a held switch is logged once: {held:?}");
    assert!(
        held[0].reason.contains("dwell 5000 ms"),
        "{}",
        held[0].reason
    );
    assert_eq!(held[0].to, "push");
}

#[test]
fn a_failed_switch_is_logged_and_retried_later() {
    let mut s = Sim::new(RULE);
    s.fail = Some("the peer did not answer".into());
    s.run(50.0, 1500);
    assert_eq!(
        s.branch(),
        "push",
        "a failed switch leaves the entry where it was"
    );
    let failed: Vec<_> = s
        .log
        .since(0, None)
        .into_iter()
        .filter(|d| d.verdict == Verdict::Failed)
        .collect();
    assert_eq!(failed.len(), 1);
    assert!(
        failed[0].reason.contains("the peer did not answer"),
        "{}",
        failed[0].reason
    );
    assert!(failed[0].reason.contains("next attempt in 2000 ms"));
    let failed_at = failed[0].at_ms;
    // Still failing: the next attempt comes `retry` later, not at every sample.
    s.run(50.0, 2000);
    let attempts: Vec<u64> = s
        .log
        .since(0, None)
        .iter()
        .filter(|d| d.verdict == Verdict::Switch)
        .map(|d| d.at_ms)
        .collect();
    assert_eq!(attempts, [failed_at, failed_at + 2000]);
    // It works again: the next attempt switches.
    s.fail = None;
    s.run(50.0, 2100);
    assert_eq!(s.branch(), "side");
    assert_eq!(s.switches, [(failed_at + 4000, 1)]);
}

#[test]
fn off_by_policy_stops_switching_and_on_resumes() {
    let mut s = Sim::new(RULE);
    s.m.set_on(0, false, &mut s.log);
    s.run(50.0, 5000);
    assert!(s.switches.is_empty());
    let d = s.log.since(0, None);
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!((d[0].verdict, d[0].entry), (Verdict::Policy, None));
    assert!(d[0].reason.contains("turned off"));
    // The rate is still measured while off: on again, it acts at the next sample.
    assert!(s.m.status(7).unwrap().0.unwrap() < 150.0);
    s.m.set_on(s.now, true, &mut s.log);
    s.run(50.0, 100);
    assert_eq!(s.switches.len(), 1);
    // A rule turned off by its own policy value, too.
    s.m.set_rule(s.now, "off".parse().unwrap(), &mut s.log);
    s.run(1000.0, 5000);
    assert_eq!(s.switches.len(), 1);
    let last = s.log.since(0, None).pop().unwrap();
    assert_eq!(last.verdict, Verdict::Policy);
    assert!(last.reason.contains("to `off`"), "{}", last.reason);
}

#[test]
fn changed_thresholds_apply_at_once() {
    let mut s = Sim::new(RULE);
    s.run(200.0, 3000);
    assert!(s.switches.is_empty(), "200/s is between down and up");
    s.m.set_rule(
        s.now,
        RULE.replace("down=150", "down=250").parse().unwrap(),
        &mut s.log,
    );
    s.run(200.0, 100);
    assert_eq!(s.switches.len(), 1);
    let sw = s
        .log
        .since(0, None)
        .into_iter()
        .find(|d| d.verdict == Verdict::Switch);
    assert_eq!(sw.unwrap().down, 250.0);
}

#[test]
fn an_operators_switch_restarts_the_dwell_time() {
    let mut s = Sim::new(RULE);
    s.run(200.0, 2000);
    // The operator moves it to side by hand.
    s.current = 1;
    s.epoch = 1;
    s.run(1000.0, 2000);
    assert!(
        s.switches.is_empty(),
        "within dwell of the operator's switch"
    );
    let v = s.verdicts();
    assert_eq!(v[0], Verdict::External);
    assert!(v.contains(&Verdict::WithinDwell), "{v:?}");
    s.run(1000.0, 1100);
    assert_eq!(s.switches.len(), 1);
}

#[test]
fn a_missing_branch_or_counter_is_logged_once() {
    let mut s = Sim::new(&RULE.replace("above=push", "above=warp"));
    s.run(1000.0, 3000);
    let d = s.log.since(0, None);
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0].verdict, Verdict::Mismatch);
    assert!(d[0].reason.contains("no such branch"));
    let mut log = DecisionLog::new(8);
    let mut m = Machine::new("r", RULE.parse().unwrap());
    let b = ["push".to_owned(), "side".to_owned()];
    for now in [100, 200, 300] {
        let obs = Observation {
            entry: 1,
            value: None,
            branches: &b,
            current: 0,
            epoch: 0,
        };
        assert_eq!(m.observe(now, obs, &mut log), None);
    }
    assert_eq!(log.since(0, None).len(), 1);
}

#[test]
fn the_log_is_bounded_and_numbered() {
    let mut s = Sim::new(&RULE.replace("dwell=3000", "dwell=0"));
    s.log = DecisionLog::new(4);
    for _ in 0..10 {
        s.run(1000.0, 2000);
        s.run(10.0, 2000);
    }
    let d = s.log.since(0, None);
    assert_eq!(d.len(), 4);
    assert!(s.switches.len() >= 19, "{}", s.switches.len());
    assert_eq!(s.log.dropped(), s.log.last_seq() - 4);
    assert!(d.windows(2).all(|w| w[1].seq == w[0].seq + 1));
    assert_eq!(s.log.since(d[2].seq, None).len(), 1);
}

#[test]
fn a_counter_reset_restarts_the_window() {
    let mut s = Sim::new(RULE);
    s.run(1000.0, 2000);
    s.value = 0.0;
    s.run(10.0, 500);
    assert_eq!(
        s.m.status(7).unwrap().0,
        None,
        "the window is not covered again yet"
    );
    assert!(s.switches.is_empty());
}
