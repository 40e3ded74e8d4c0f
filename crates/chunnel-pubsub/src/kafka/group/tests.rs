use super::*;
use proptest::prelude::*;

fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn the_record_round_trips_and_refuses_damage() {
    let m = names(&["a", "b", "m-7"]);
    let bytes = encode_members(&m);
    assert_eq!(decode_members(&bytes).unwrap(), m);
    assert_eq!(
        decode_members(&encode_members(&[])).unwrap(),
        Vec::<String>::new()
    );
    for cut in 0..bytes.len() {
        assert!(decode_members(&bytes[..cut]).is_err(), "cut at {cut}");
    }
    let unsorted = encode_members(&names(&["b", "a"]));
    assert!(decode_members(&unsorted).is_err());
    let mut trailing = bytes.to_vec();
    trailing.push(0);
    assert!(decode_members(&trailing).is_err());
    assert!(decode_members(&encode_members(&names(&["a/b"]))).is_err());
}

proptest! {
    #[test]
    fn decoding_any_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = decode_members(&bytes);
        let mut framed = MAGIC.to_vec();
        framed.extend_from_slice(&bytes);
        if let Ok(m) = decode_members(&framed) {
            prop_assert_eq!(&encode_members(&m)[..], &framed[..]);
        }
    }

    #[test]
    fn every_partition_has_exactly_one_owner(n in 1usize..20, partitions in 1i32..40) {
        let members: Vec<String> = (0..n).map(|i| format!("m{i:02}")).collect();
        let mut count = vec![0; partitions as usize];
        for m in &members {
            for p in owned(&members, m, partitions) {
                count[p as usize] += 1;
            }
        }
        prop_assert!(count.iter().all(|&c| c == 1), "{count:?}");
        prop_assert!(owned(&members, "stranger", partitions).is_empty());
    }
}

/// A simulated store: the committed list and epoch, live members, one pending transition.
#[derive(Default)]
struct Sim {
    epoch: u64,
    /// `None`: a committed record that does not decode.
    members: Option<Vec<String>>,
    live: Vec<String>,
    pending: Option<Pending>,
    next_id: u64,
    now: u64,
}

impl Sim {
    fn record(&self) -> GroupRecord {
        GroupRecord {
            epoch: self.epoch,
            members: self.members.clone(),
            live: self.live.clone(),
            pending: self.pending.clone(),
        }
    }

    /// Applies one member's actions; releases complete at once.
    fn apply(&mut self, core: &mut Core, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Release { id, .. } => {
                    let more = core.released(id);
                    self.apply(core, more);
                }
                Action::Vote(id) => {
                    if let Some(t) = &mut self.pending
                        && t.id == id
                        && !t.yes.contains(&core.me)
                    {
                        t.yes.push(core.me.clone());
                    }
                }
                Action::Propose {
                    from_epoch,
                    members,
                } => {
                    if self.pending.is_none() && from_epoch == self.epoch {
                        self.next_id += 1;
                        self.pending = Some(Pending {
                            id: self.next_id,
                            proposer: core.me.clone(),
                            members: Some(members),
                            deadline_ms: self.now + 1_000,
                            yes: Vec::new(),
                        });
                    }
                }
                Action::Finish { id, commit } => {
                    let Some(t) = self.pending.clone() else {
                        continue;
                    };
                    if t.id != id {
                        continue;
                    }
                    if commit {
                        if !self.live.iter().all(|m| t.yes.contains(m)) {
                            continue;
                        }
                        self.epoch += 1;
                        self.members = t.members;
                    }
                    self.pending = None;
                }
                Action::Rejoin => {
                    if !self.live.contains(&core.me) {
                        self.live.push(core.me.clone());
                        self.live.sort();
                    }
                }
                Action::Acquire(_) | Action::Stop(_) => {}
            }
        }
    }
}

proptest! {
    /// Members join, leave, die and read the record in random order, and a rogue writer
    /// (another version, a damaged store) puts assignments nobody can decode into it, as a
    /// transition or as a committed epoch: no partition is ever held by two live members,
    /// and once things settle every partition is held and the list is readable again.
    #[test]
    fn no_partition_is_held_twice_and_all_are_held_when_settled(
        steps in proptest::collection::vec((0u8..7, 0usize..6), 1..160),
        partitions in 1i32..9,
    ) {
        let mut sim = Sim { epoch: 1, members: Some(Vec::new()), ..Sim::default() };
        let mut cores: Vec<Option<Core>> = (0..6).map(|_| None).collect();
        for (op, who) in steps {
            let name = format!("m{who}");
            match op {
                0 if cores[who].is_none() => {
                    cores[who] = Some(Core::new(name.clone(), partitions));
                    sim.live.push(name);
                    sim.live.sort();
                }
                // Leaves cleanly or dies: gone from the live list, holds nothing.
                1 if cores[who].is_some() => {
                    cores[who] = None;
                    sim.live.retain(|m| *m != name);
                }
                // The rogue writer: an undecodable transition, or (rarer) an undecodable
                // committed epoch in place of a pending transition.
                5 if sim.pending.is_none() => {
                    sim.next_id += 1;
                    sim.pending = Some(Pending {
                        id: sim.next_id,
                        proposer: "rogue".into(),
                        members: None,
                        deadline_ms: sim.now + 1_000,
                        yes: Vec::new(),
                    });
                }
                6 if who == 0 && sim.pending.is_some() => {
                    sim.pending = None;
                    sim.epoch += 1;
                    sim.members = None;
                }
                _ => {
                    // Op 3: time passes (transitions may time out and abort).
                    if op == 3 {
                        sim.now += 700;
                    }
                    if let Some(c) = &mut cores[who] {
                        let rec = sim.record();
                        let actions = c.on_record(&rec, sim.now);
                        sim.apply(c, actions);
                    }
                }
            }
            let mut seen = BTreeSet::new();
            for c in cores.iter().flatten() {
                for p in c.held() {
                    prop_assert!(seen.insert(*p), "partition {p} held twice");
                }
            }
        }
        // Settle: everyone reads until nothing changes (past any deadline).
        for _ in 0..40 {
            sim.now += 300;
            for c in cores.iter_mut().flatten() {
                let rec = sim.record();
                let actions = c.on_record(&rec, sim.now);
                sim.apply(c, actions);
            }
        }
        let held: usize = cores.iter().flatten().map(|c| c.held().len()).sum();
        if cores.iter().any(Option::is_some) {
            prop_assert_eq!(held, partitions as usize);
            prop_assert_eq!(sim.members.as_ref(), Some(&sim.live));
        }
    }
}

#[test]
fn a_member_that_loses_partitions_releases_before_voting() {
    let mut a = Core::new("a", 4);
    let rec = GroupRecord {
        epoch: 2,
        members: Some(names(&["a"])),
        live: names(&["a", "b"]),
        pending: None,
    };
    let acts = a.on_record(&rec, 0);
    assert_eq!(acts[0], Action::Acquire(vec![0, 1, 2, 3]));
    assert!(matches!(acts[1], Action::Propose { from_epoch: 2, .. }));
    let rec = GroupRecord {
        pending: Some(Pending {
            id: 9,
            proposer: "b".into(),
            members: Some(names(&["a", "b"])),
            deadline_ms: 10,
            yes: names(&["b"]),
        }),
        ..rec
    };
    let acts = a.on_record(&rec, 0);
    assert_eq!(
        acts,
        vec![Action::Release {
            id: 9,
            partitions: vec![1, 3]
        }]
    );
    // Reading again while releasing does not vote.
    assert!(a.on_record(&rec, 0).is_empty());
    assert_eq!(a.released(9), vec![Action::Vote(9)]);
    // Aborted: the partitions come back.
    let aborted = GroupRecord {
        pending: None,
        live: names(&["a"]),
        ..rec
    };
    assert_eq!(a.on_record(&aborted, 0), vec![Action::Acquire(vec![1, 3])]);
}

#[test]
fn a_member_whose_lease_ran_out_stops_and_rejoins() {
    let mut a = Core::new("a", 2);
    let rec = GroupRecord {
        epoch: 1,
        members: Some(names(&["a"])),
        live: names(&["a"]),
        pending: None,
    };
    a.on_record(&rec, 0);
    let gone = GroupRecord {
        live: Vec::new(),
        ..rec
    };
    assert_eq!(
        a.on_record(&gone, 0),
        vec![Action::Stop(vec![0, 1]), Action::Rejoin]
    );
    assert!(a.held().is_empty());
}

#[test]
fn a_vote_missing_from_the_record_is_sent_again() {
    let mut b = Core::new("b", 2);
    let rec = GroupRecord {
        epoch: 1,
        members: Some(names(&["a"])),
        live: names(&["a", "b"]),
        pending: Some(Pending {
            id: 4,
            proposer: "a".into(),
            members: Some(names(&["a", "b"])),
            deadline_ms: 10_000,
            yes: names(&["a"]),
        }),
    };
    // b holds nothing, so it votes at once.
    assert_eq!(b.on_record(&rec, 0), vec![Action::Vote(4)]);
    // The vote failed: the next read still lacks b's yes, so b votes again.
    assert_eq!(b.on_record(&rec, 1), vec![Action::Vote(4)]);
    // Once the record shows it, nothing more.
    let mut seen = rec.clone();
    if let Some(t) = seen.pending.as_mut() {
        t.yes.push("b".into());
    }
    assert_eq!(b.on_record(&seen, 2), Vec::new());
}

#[test]
fn an_undecodable_transition_is_aborted_by_any_member() {
    let mut b = Core::new("b", 2);
    let rec = GroupRecord {
        epoch: 1,
        members: Some(names(&["a", "b"])),
        live: names(&["a", "b"]),
        pending: None,
    };
    assert_eq!(b.on_record(&rec, 0), vec![Action::Acquire(vec![1])]);
    let bad = GroupRecord {
        pending: Some(Pending {
            id: 7,
            proposer: "a".into(),
            members: None,
            deadline_ms: 10_000,
            yes: Vec::new(),
        }),
        ..rec
    };
    assert!(bad.damage().is_some());
    // No vote, no release: an abort, long before the deadline, by a member that did not
    // propose it.
    assert_eq!(
        b.on_record(&bad, 0),
        vec![Action::Finish {
            id: 7,
            commit: false
        }]
    );
    assert_eq!(b.held(), &BTreeSet::from([1]));
}

#[test]
fn an_undecodable_epoch_keeps_what_is_held_and_proposes_a_fresh_list() {
    let mut a = Core::new("a", 4);
    let rec = GroupRecord {
        epoch: 1,
        members: Some(names(&["a", "b"])),
        live: names(&["a", "b"]),
        pending: None,
    };
    assert_eq!(a.on_record(&rec, 0), vec![Action::Acquire(vec![0, 2])]);
    let bad = GroupRecord {
        epoch: 2,
        members: None,
        live: names(&["a", "b", "c"]),
        pending: None,
    };
    assert!(bad.damage().is_some());
    assert_eq!(
        a.on_record(&bad, 0),
        vec![Action::Propose {
            from_epoch: 2,
            members: names(&["a", "b", "c"])
        }]
    );
    assert_eq!(a.held(), &BTreeSet::from([0, 2]));
    assert_eq!(a.epoch(), 1, "an unreadable epoch is not acted on");
}

#[test]
fn past_the_member_cap_the_list_is_proposed_once() {
    let live: Vec<String> = (0..MAX_MEMBERS + 5).map(|i| format!("m{i:05}")).collect();
    let first = live[0].clone();
    let mut a = Core::new(first, 8);
    let rec = GroupRecord {
        epoch: 1,
        members: Some(Vec::new()),
        live: live.clone(),
        pending: None,
    };
    let acts = a.on_record(&rec, 0);
    let Some(Action::Propose { members, .. }) = acts.last() else {
        panic!("no proposal: {acts:?}");
    };
    assert_eq!(members.len(), MAX_MEMBERS);
    assert_eq!(
        decode_members(&encode_members(members)).unwrap(),
        *members,
        "the capped list fits its record"
    );
    // Committed: nothing more to propose although five live members are not in it.
    let settled = GroupRecord {
        epoch: 2,
        members: Some(members.clone()),
        live,
        pending: None,
    };
    let acts = a.on_record(&settled, 0);
    assert!(
        !acts.iter().any(|x| matches!(x, Action::Propose { .. })),
        "{acts:?}"
    );
}
