//! The autopilot's driver on tokio's paused clock: a fake entry whose counter grows at a
//! rate the test sets and whose switch handle fails when told to; the decisions are read
//! from the autopilot's log and from the entry's view, as the endpoint serves them.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chunnel_ctl::autopilot::{Autopilot, Config};
use chunnel_ctl::proto::{Op, Reply, Verdict};
use chunnel_ctl::{
    BoxFuture, Client, Endpoint, Entry, LayerCounters, Mode, Registry, Switch, Switched,
};
use tokio::time::Instant;

/// A counter growing at `rate` per second of tokio's clock.
#[derive(Clone)]
struct Load(Arc<Mutex<(Instant, f64, f64)>>);

impl Load {
    fn new() -> Self {
        Load(Arc::new(Mutex::new((Instant::now(), 0.0, 0.0))))
    }
    fn read(&self) -> u64 {
        let mut g = self.0.lock().unwrap();
        let now = Instant::now();
        g.1 += g.2 * (now - g.0).as_secs_f64();
        g.0 = now;
        g.1 as u64
    }
    fn set(&self, rate: f64) {
        self.read();
        self.0.lock().unwrap().2 = rate;
    }
}

#[derive(Default)]
struct Fake {
    current: AtomicUsize,
    epoch: AtomicU64,
    fail: AtomicBool,
    hang: AtomicBool,
    calls: AtomicU64,
}

struct Handle(Arc<Fake>);

impl Switch for Handle {
    fn branches(&self) -> Vec<String> {
        vec!["fast".into(), "slow".into()]
    }
    fn current(&self) -> usize {
        self.0.current.load(Ordering::SeqCst)
    }
    fn epoch(&self) -> u64 {
        self.0.epoch.load(Ordering::SeqCst)
    }
    fn switch(&self, to: usize, mode: Mode) -> BoxFuture<'_, Result<Switched, String>> {
        Box::pin(async move {
            assert_eq!(mode, Mode::Unilateral);
            self.0.calls.fetch_add(1, Ordering::SeqCst);
            if self.0.hang.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            if self.0.fail.load(Ordering::SeqCst) {
                return Err("the peer is away".into());
            }
            self.0.current.store(to, Ordering::SeqCst);
            self.0.epoch.fetch_add(1, Ordering::SeqCst);
            Ok(Switched {
                changed: true,
                detail: "switched".into(),
            })
        })
    }
}

const RULE: &str =
    "entry=conn counter=app/msgs window=1s up=100 down=50 dwell=2s retry=3s above=fast below=slow";

fn setup() -> (Registry, Load, Arc<Fake>, chunnel_ctl::Guard) {
    let registry = Registry::new("t");
    let load = Load::new();
    let fake = Arc::new(Fake::default());
    let l = load.clone();
    let guard = registry.register(
        Entry::connection("conn")
            .with_counters(move || vec![LayerCounters::new("app", [("msgs", l.read())])])
            .with_switch(Handle(Arc::clone(&fake))),
    );
    (registry, load, fake, guard)
}

fn cfg() -> Config {
    Config {
        interval: Duration::from_millis(100),
        log_capacity: 64,
        switch_timeout: Duration::from_secs(5),
    }
}

fn verdicts(p: &Autopilot) -> Vec<Verdict> {
    p.decisions(0).iter().map(|d| d.verdict).collect()
}

#[tokio::test(start_paused = true)]
async fn a_failed_switch_is_logged_and_retried() {
    let (registry, load, fake, _g) = setup();
    let pilot = Autopilot::start(&registry, cfg(), [("r", RULE)]).unwrap();
    load.set(10.0);
    fake.fail.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1550)).await;
    assert_eq!(fake.calls.load(Ordering::SeqCst), 1);
    assert_eq!(verdicts(&pilot), [Verdict::Switch, Verdict::Failed]);
    let failed = &pilot.decisions(0)[1];
    assert!(
        failed.reason.contains("the peer is away"),
        "{}",
        failed.reason
    );
    // The next attempt comes after `retry` (3 s), not at every sample.
    // The first attempt was at 1 s (once the window was covered): the next one is due at 4 s.
    tokio::time::sleep(Duration::from_millis(2350)).await;
    assert_eq!(fake.calls.load(Ordering::SeqCst), 1);
    fake.fail.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(fake.calls.load(Ordering::SeqCst), 2);
    assert_eq!(fake.current.load(Ordering::SeqCst), 1);
    assert_eq!(
        verdicts(&pilot),
        [
            Verdict::Switch,
            Verdict::Failed,
            Verdict::Switch,
            Verdict::Switched
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_switch_without_outcome_times_out_as_a_failure() {
    let (registry, load, fake, _g) = setup();
    let pilot = Autopilot::start(&registry, cfg(), [("r", RULE)]).unwrap();
    load.set(10.0);
    fake.hang.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(7)).await;
    let d = pilot.decisions(0);
    assert_eq!(d[1].verdict, Verdict::Failed, "{d:?}");
    assert!(
        d[1].reason.contains("no outcome within 5s"),
        "{}",
        d[1].reason
    );
}

#[tokio::test(start_paused = true)]
async fn policies_turn_it_off_and_change_the_rule() {
    let (registry, load, fake, _g) = setup();
    let pilot = Autopilot::start(&registry, cfg(), [("r", RULE)]).unwrap();
    assert!(registry.set_policy("autopilot", "sometimes").is_err());
    assert!(registry.set_policy("autopilot.r", "up=1").is_err());
    registry.set_policy("autopilot", "off").unwrap();
    load.set(10.0);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(fake.calls.load(Ordering::SeqCst), 0);
    assert_eq!(verdicts(&pilot), [Verdict::Policy]);
    registry.set_policy("autopilot", "on").unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        fake.current.load(Ordering::SeqCst),
        1,
        "{:?}",
        pilot.decisions(0)
    );
    // Thresholds changed at run time: 10/s is now above `up`.
    registry
        .set_policy(
            "autopilot.r",
            &RULE.replace("up=100 down=50", "up=5 down=2"),
        )
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        fake.current.load(Ordering::SeqCst),
        0,
        "{:?}",
        pilot.decisions(0)
    );
    let last = pilot.decisions(0).pop().unwrap();
    assert_eq!((last.verdict, last.up), (Verdict::Switched, 5.0));
}

/// Through the endpoint, on the real clock: the `autopilot` request and the entry's view.
#[tokio::test]
async fn served_by_the_endpoint() {
    let dir = std::env::temp_dir().join(format!("chunnel-ctl-autopilot-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (registry, load, fake, g) = setup();
    let endpoint = Endpoint::bind(
        chunnel_ctl::Config::new(dir.join("a.ctl")),
        registry.clone(),
    )
    .unwrap();
    let mut c = Client::connect(endpoint.path()).await.unwrap();
    let Reply::Autopilot { running, .. } = c
        .request(&Op::Autopilot {
            id: None,
            since: None,
        })
        .await
        .unwrap()
    else {
        panic!()
    };
    assert!(!running);
    let pilot = Autopilot::start(&registry, cfg(), [("r", RULE)]).unwrap();
    load.set(10.0);
    let t0 = std::time::Instant::now();
    while fake.current.load(Ordering::SeqCst) != 1 {
        assert!(t0.elapsed() < Duration::from_secs(20));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let Reply::Autopilot {
        running,
        enabled,
        rules,
        decisions,
        dropped,
    } = c
        .request(&Op::Autopilot {
            id: Some(g.id()),
            since: None,
        })
        .await
        .unwrap()
    else {
        panic!()
    };
    assert!(running && enabled);
    assert_eq!(dropped, 0);
    assert_eq!(rules[0].entries, [g.id()]);
    assert_eq!(
        rules[0]
            .spec
            .parse::<chunnel_ctl::autopilot::Rule>()
            .unwrap(),
        RULE.parse().unwrap()
    );
    let v: Vec<_> = decisions.iter().map(|d| d.verdict).collect();
    assert_eq!(v, [Verdict::Switch, Verdict::Switched]);
    let Reply::Show { entry } = c.request(&Op::Show { id: g.id() }).await.unwrap() else {
        panic!()
    };
    let a = entry.autopilot.unwrap();
    assert_eq!(a.rule, "r");
    assert_eq!(a.last.unwrap().seq, decisions[1].seq);
    assert!(a.rate.unwrap() < 50.0);
    // Dropped, the autopilot no longer runs (its log stays readable through a Log).
    let log = pilot.log();
    drop(pilot);
    let Reply::Autopilot { running, .. } = c
        .request(&Op::Autopilot {
            id: None,
            since: None,
        })
        .await
        .unwrap()
    else {
        panic!()
    };
    assert!(!running);
    assert_eq!(log.decisions(0).len(), 2);
    // Another entry's decisions are not this one's.
    let Reply::Autopilot { decisions, .. } = c
        .request(&Op::Autopilot {
            id: Some(g.id() + 100),
            since: None,
        })
        .await
        .unwrap()
    else {
        panic!()
    };
    assert!(decisions.is_empty());
    drop(endpoint);
    let _ = std::fs::remove_dir_all(&dir);
}
