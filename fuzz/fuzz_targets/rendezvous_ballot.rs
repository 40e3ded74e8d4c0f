//! A ballot datagram of multi-party negotiation (chunnel-rendezvous, docs/wire.md §15.4) from
//! arbitrary bytes: `DirectBallot::decode` returns a ballot or a typed error, never a panic; what
//! decodes re-encodes canonically; and a proposer's machine fed it never panics and never
//! decides on a ballot without its transition's token.
#![no_main]

use chunnel::negotiate::{Capability, ChunnelInfo, Pick, StackOption};
use chunnel_rendezvous::ballot::{BallotBox, DirectBallot, MAX_DATAGRAM};
use chunnel_rendezvous::machine::{Action, Machine};
use chunnel_rendezvous::{Error, Member};
use libfuzzer_sys::fuzz_target;

const TOKEN: u128 = 0x5eed;

fn option(label: &'static str, branch: u8) -> StackOption {
    StackOption {
        chunnels: vec![ChunnelInfo {
            id: "fuzz/mode/1".into(),
            capabilities: vec![Capability::exact("mode", [label])],
        }],
        pick: Pick::from_branches(vec![branch]),
    }
}

fuzz_target!(|data: &[u8]| {
    let ballot = match DirectBallot::decode(data) {
        Ok(b) => b,
        Err(Error::Ballot(_)) => return,
        Err(e) => panic!("not a typed ballot error: {e}"),
    };
    assert!(data.len() <= MAX_DATAGRAM);
    assert_eq!(ballot.encode(), data, "the encoding is not canonical");
    // A proposer `p` of transition 1 from epoch 1 with members p and b, its own yes counted.
    let mut m = Machine::new("p".into(), vec![option("one", 0), option("two", 1)], None, 1, 0);
    let mut t = m.proposal(1, 1, u64::MAX).expect("option 1 exists");
    t.ballot_box = Some(BallotBox {
        addr: "127.0.0.1:9".parse().expect("an address"),
        token: TOKEN,
    });
    let members: Vec<Member> = ["b", "p"]
        .iter()
        .map(|id| Member {
            id: (*id).into(),
            addr: String::new(),
        })
        .collect();
    m.proposed(&t, &members);
    let snap = chunnel_rendezvous::Snapshot {
        committed: Some(chunnel_rendezvous::Committed {
            epoch: 1,
            stack: chunnel_negotiate::wire::encode_stack(&option("one", 0).chunnels),
        }),
        members,
        transition: Some(t),
        ..Default::default()
    };
    m.on_snapshot(&snap, 0);
    let decided = m.on_ballot(&ballot);
    let counts = ballot.token == TOKEN && ballot.id == 1 && ballot.from_epoch == 1 && ballot.member == "b";
    assert_eq!(!decided.is_empty(), counts, "{ballot:?} decided {decided:?}");
    if let [Action::Finish { commit: true, attested, .. }] = &decided[..] {
        assert_eq!(attested, &["b".to_owned(), "p".to_owned()]);
    }
});
