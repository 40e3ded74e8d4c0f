//! The reconfiguration protocol's messages and state machine: whatever decodes re-encodes
//! canonically, and a `Multilateral` fed any sequence of messages (in any state, as initiator
//! or follower) never panics and never switches without its own vote or its peer's yes.
#![no_main]

use std::time::{Duration, Instant};

use chunnel::negotiate::ChunnelInfo;
use chunnel::{Capability, Pick, StackOption};
use chunnel_negotiate::commit::{Event, Multilateral, Policy};
use chunnel_negotiate::wire::{decode_control, encode_control};
use libfuzzer_sys::fuzz_target;

fn option(pick: u8, label: &'static str) -> StackOption {
    StackOption {
        chunnels: vec![ChunnelInfo {
            id: "ser".into(),
            capabilities: vec![Capability::exact("serialize", [label])],
        }],
        pick: Pick::from_branches(vec![pick]),
    }
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks the scenario; the rest is split into messages at 0xff bytes.
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let offers = vec![option(0, "json"), option(1, "bincode")];
    let policy = Policy {
        may_initiate: mode & 1 == 0,
        peer_may_initiate: mode & 2 == 0,
        ..Policy::default()
    };
    let mut m = Multilateral::new(offers, policy);
    let t0 = Instant::now();
    let proposed = mode & 4 != 0 && m.propose(&Pick::from_branches(vec![1]), 42, t0).is_ok();
    let mut voted_yes = false;
    for (k, msg) in rest.split(|&b| b == 0xff).enumerate() {
        if let Ok(c) = decode_control(msg) {
            assert_eq!(
                &encode_control(&c)[..],
                msg,
                "the encoding is not canonical"
            );
        }
        m.handle_message(msg, t0);
        if mode & 8 != 0 {
            m.handle_timeout(t0 + Duration::from_millis(50 * k as u64));
        }
        while let Some(out) = m.poll_transmit() {
            // Our own yes votes, which allow a follower's switch.
            voted_yes |= out.first() == Some(&0x11) && out.get(10) == Some(&0);
        }
        while let Some(e) = m.poll_event() {
            if let Event::Switch { txn, .. } = e {
                assert!(
                    (proposed && txn == 42) || voted_yes,
                    "switched without a proposal of ours or a yes of ours"
                );
            }
        }
    }
});
