//! Feeds the input, as one received message (tag included), to `Server::handle_hello` of a
//! server with exact and compositional capabilities, and checks the decision: the response
//! is an accept or a reject that decodes to the decision's message; an accept names one of
//! the hello's offers and a compatible server option, and treats the 0-RTT pick and early
//! data as specified; a reject of a well-formed hello means no pair was compatible.
#![no_main]

use std::sync::LazyLock;

use chunnel::negotiate::{ChunnelInfo, check_compatible, choose};
use chunnel::{Capability, Pick, StackOption};
use chunnel_negotiate::proto::{Decision, Server};
use chunnel_negotiate::wire::{Control, Hello, RejectReason, Tag, ZeroRtt, decode_control};
use libfuzzer_sys::fuzz_target;

fn info(id: &'static str, capabilities: Vec<Capability>) -> ChunnelInfo {
    ChunnelInfo {
        id: id.into(),
        capabilities,
    }
}

static SERVER: LazyLock<Server> = LazyLock::new(|| {
    Server::new(vec![
        StackOption {
            chunnels: vec![
                info("ser/json/1", vec![Capability::exact("serialize", ["json"])]),
                info(
                    "shard/client/1",
                    vec![Capability::compositional("shard", ["a", "b"])],
                ),
            ],
            pick: Pick::from_branches(vec![0]),
        },
        StackOption {
            chunnels: vec![info(
                "ser/bincode/1",
                vec![Capability::exact("serialize", ["bincode"])],
            )],
            pick: Pick::from_branches(vec![1, 0]),
        },
        StackOption {
            chunnels: vec![info("chunnel/noop/1", Vec::new())],
            pick: Pick::from_branches(vec![1, 1]),
        },
    ])
});

fuzz_target!(|msg: &[u8]| {
    let server = &*SERVER;
    let decision = server.handle_hello(msg);
    let (response, expected) = match &decision {
        Decision::Accept {
            accept, response, ..
        } => (response, Control::Accept(accept.clone())),
        Decision::Reject {
            reject, response, ..
        } => (response, Control::Reject(reject.clone())),
    };
    assert!(
        matches!(response.first(), Some(&0x02) | Some(&0x03)),
        "response tag {:?}",
        response.first()
    );
    assert_eq!(decode_control(response), Ok(expected));

    let hello = match msg.split_first() {
        Some((&t, body)) if t == Tag::Hello as u8 => Hello::decode(body).ok(),
        _ => None,
    };
    let Some(hello) = hello else {
        match &decision {
            Decision::Reject { reject, .. } => assert!(
                matches!(
                    reject.reason,
                    RejectReason::Malformed | RejectReason::Version
                ),
                "a malformed hello rejected as {:?}",
                reject.reason
            ),
            Decision::Accept { .. } => panic!("accepted a message that is not a valid hello"),
        }
        return;
    };
    match &decision {
        Decision::Accept {
            accept,
            server_option,
            early,
            response,
        } => {
            assert_eq!(response[0], 0x02);
            assert_eq!(accept.conn_id, hello.conn_id);
            assert!(
                hello.offers.iter().any(|o| o.pick == accept.client_pick),
                "client_pick {:?} is not among the hello's offers",
                accept.client_pick
            );
            let s = &server.offers()[*server_option];
            assert_eq!(accept.server_pick, s.pick);
            assert_eq!(accept.server_stack, s.chunnels);
            assert!(
                hello.offers.iter().any(|o| o.pick == accept.client_pick
                    && check_compatible(&s.chunnels, &o.chunnels, 0, 0).is_ok()),
                "the accepted pair is not compatible"
            );
            match (&hello.zero_rtt, accept.zero_rtt) {
                (None, z) => {
                    assert_eq!(z, ZeroRtt::NotOffered);
                    assert!(early.is_empty());
                }
                (Some(p), ZeroRtt::Accepted) => {
                    assert_eq!(*p, accept.client_pick);
                    assert_eq!(*early, hello.early);
                }
                (Some(_), ZeroRtt::Rejected) => assert!(early.is_empty()),
                (Some(_), ZeroRtt::NotOffered) => panic!("the 0-RTT pick was ignored"),
            }
        }
        Decision::Reject { reject, response } => {
            assert_eq!(response[0], 0x03);
            assert_eq!(reject.reason, RejectReason::Incompatible);
            assert_eq!(reject.conn_id, hello.conn_id);
            assert!(choose(server.offers(), &hello.offers, usize::MAX).is_err());
        }
    }
});
