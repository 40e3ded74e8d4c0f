use super::*;
use proptest::prelude::*;

const CLASSES: usize = 3;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A schedule of 10 ms: class 0 alone for 2 ms, classes 1 and 2 for 5 ms, class 2 alone for
/// 3 ms.
fn schedule(guard: Duration) -> GateSchedule {
    GateSchedule::new(vec![
        GateEntry::new(ms(2), [0]),
        GateEntry::new(ms(5), [1, 2]),
        GateEntry::new(ms(3), [2]),
    ])
    .unwrap()
    .with_guard_band(guard)
}

#[derive(Clone, Debug)]
enum Op {
    Enqueue(u8),
    /// Advance the clock by this many µs, then call `next`.
    Step(u64),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            3 => (0u8..4).prop_map(Op::Enqueue),
            2 => (0u64..1500).prop_map(Op::Step),
        ],
        0..300,
    )
}

fn policy(p: u8, guard_us: u64) -> Policy {
    match p % 3 {
        0 => Policy::Fifo,
        1 => Policy::StrictPriority,
        _ => Policy::TimeAware(schedule(Duration::from_micros(guard_us))),
    }
}

/// Runs `ops` and checks every invariant after each decision; returns the messages sent, as
/// (class, id, sent at).
fn run(policy: Policy, cap: usize, burst: usize, ops: &[Op]) -> Vec<(usize, u64, Instant)> {
    let t0 = Instant::now();
    let mut s = Scheduler::new(policy.clone(), CLASSES, cap, burst, t0);
    let mut now = t0;
    let mut id = 0u64;
    // The model: what is queued per class, in order, and the global enqueue order.
    let mut model: Vec<VecDeque<u64>> = vec![VecDeque::new(); CLASSES];
    let mut global: VecDeque<u64> = VecDeque::new();
    let mut sent = Vec::new();
    let mut out: Vec<(usize, u64)> = Vec::new();
    for op in ops {
        match *op {
            Op::Enqueue(c) => {
                let cc = s.clamp_class(c);
                let full = model[cc].len() >= cap;
                let r = s.enqueue(c, (cc, id));
                assert_eq!(r.is_err(), full, "a full queue refuses, others accept");
                if !full {
                    model[cc].push_back(id);
                    global.push_back(id);
                }
                id += 1;
            }
            Op::Step(us) => {
                now += Duration::from_micros(us);
                out.clear();
                let d = s.next(now, &mut out);
                assert_eq!(d.send, out.len());
                assert!(d.send <= burst);
                for (k, &(c, m)) in out.iter().enumerate() {
                    // FIFO within a class.
                    assert_eq!(model[c].pop_front(), Some(m), "class {c} out of order");
                    match &policy {
                        Policy::Fifo => {
                            assert_eq!(global.pop_front(), Some(m), "FIFO across classes")
                        }
                        Policy::StrictPriority => {
                            global.retain(|&g| g != m);
                            for (higher, q) in model.iter().enumerate().take(c) {
                                assert!(q.is_empty(), "class {c} sent while {higher} queued");
                            }
                        }
                        Policy::TimeAware(g) => {
                            global.retain(|&g| g != m);
                            assert!(
                                g.fits(t0, now, c as u8, k as u32 + 1),
                                "class {c} sent outside its window (or guard band) at {:?}",
                                now - t0
                            );
                            // Among the open classes, strict priority.
                            for (higher, q) in model.iter().enumerate().take(c) {
                                assert!(
                                    q.is_empty() || !g.fits(t0, now, higher as u8, k as u32 + 1),
                                    "class {c} sent while open class {higher} queued"
                                );
                            }
                        }
                    }
                    sent.push((c, m, now));
                }
                let queued: usize = model.iter().map(VecDeque::len).sum();
                assert_eq!(s.len(), queued);
                match d.wake_at {
                    None => assert!(
                        queued == 0 || matches!(policy, Policy::TimeAware(_)),
                        "messages queued but no wake-up"
                    ),
                    Some(w) => assert!(w >= now && queued > 0),
                }
                // Work-conserving: FIFO and priority send while anything is queued, up to the
                // burst limit.
                if !matches!(policy, Policy::TimeAware(_)) && d.send < burst {
                    assert_eq!(queued, 0);
                }
            }
        }
    }
    sent
}

proptest! {
    #[test]
    fn policies_keep_their_invariants(
        p in 0u8..3,
        guard_us in prop_oneof![Just(0u64), 1u64..400],
        cap in 1usize..8,
        burst in 1usize..6,
        ops in ops(),
    ) {
        run(policy(p, guard_us), cap, burst, &ops);
    }

    /// A driver that follows `wake_at` sends every queued message of a class whose window fits
    /// its guard band, within two cycles.
    #[test]
    fn shaper_following_wake_at_sends_everything(
        enq in prop::collection::vec(0u8..3, 1..40),
        start_us in 0u64..10_000,
        guard_us in prop_oneof![Just(0u64), 1u64..400],
    ) {
        let t0 = Instant::now();
        let mut s = Scheduler::new(
            Policy::TimeAware(schedule(Duration::from_micros(guard_us))), CLASSES, 64, 4, t0);
        for (i, &c) in enq.iter().enumerate() {
            s.enqueue(c, (c, i)).unwrap();
        }
        let mut now = t0 + Duration::from_micros(start_us);
        let mut out = Vec::new();
        let mut steps = 0;
        loop {
            let d = s.next(now, &mut out);
            let Some(w) = d.wake_at else { break };
            prop_assert!(w >= now);
            now = w;
            steps += 1;
            prop_assert!(steps < 1000);
        }
        prop_assert_eq!(out.len(), enq.len());
        prop_assert!(now - (t0 + Duration::from_micros(start_us)) <= ms(20));
    }
}

#[test]
fn gate_arithmetic() {
    let t0 = Instant::now();
    let g = schedule(Duration::ZERO);
    assert_eq!(g.cycle(), ms(10));
    assert_eq!(g.open_for(t0, t0, 0), Some(Some(ms(2))));
    assert_eq!(g.open_for(t0, t0, 1), None);
    assert_eq!(g.open_for(t0, t0 + ms(3), 2), Some(Some(ms(7))));
    assert_eq!(g.next_start(t0, t0, 1), Some(t0 + ms(2)));
    assert_eq!(g.next_start(t0, t0 + ms(8), 1), Some(t0 + ms(12)));
    // Before the base, the cycles go on backwards.
    let late = t0 + ms(100);
    assert_eq!(g.open_for(late, t0 + ms(1), 0), Some(Some(ms(1))));
    // A class that is always open.
    let all = GateSchedule::new(vec![GateEntry::new(ms(1), [0, 1])]).unwrap();
    assert_eq!(all.open_for(t0, t0, 1), Some(None));
    // A class never open.
    assert_eq!(all.next_start(t0, t0, 2), None);
    // A guard band longer than a window: that class never starts.
    let g = schedule(ms(3));
    assert_eq!(g.next_start(t0, t0, 0), None);
    assert_eq!(g.next_start(t0, t0, 1), Some(t0 + ms(2)));
    assert_eq!(g.next_start(t0, t0 + ms(5), 1), Some(t0 + ms(12)));
    assert!(GateSchedule::new(vec![]).is_err());
    assert!(GateSchedule::new(vec![GateEntry::new(Duration::ZERO, [0])]).is_err());
}

#[test]
fn strict_priority_overtakes_and_batches() {
    let t0 = Instant::now();
    let mut s = Scheduler::new(Policy::StrictPriority, 2, 16, 8, t0);
    for i in 0..5 {
        s.enqueue(1, i).unwrap();
    }
    s.enqueue(0, 100).unwrap();
    s.enqueue(7, 5).unwrap(); // clamped to the last class
    let mut out = Vec::new();
    let d = s.next(t0, &mut out);
    assert_eq!(out, [100, 0, 1, 2, 3, 4, 5]);
    assert_eq!(
        d,
        Decision {
            send: 7,
            wake_at: None
        }
    );
    assert_eq!(s.stats().batched_bursts, 1);
    assert_eq!(s.stats().sent[1], 6);
}
