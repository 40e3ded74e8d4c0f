//! Feeds the input, as one received message (tag included), to `Server::handle_hello` (and to
//! `handle_hello_bytes`, which must decide the same) of two servers with exact and
//! compositional capabilities (one with a plain option last, one whose every option needs a
//! peer implementation), and checks each decision against `docs/wire.md`: the response is an
//! accept or a reject that decodes to the decision's message; for a well-formed hello, an
//! accept names one of the hello's offers and a compatible server option and treats the 0-RTT
//! pick and early data as specified, and a reject means no pair was compatible; a DICTATED
//! hello gets the first server option whose two-sided Chunnels the client can build (§7.2).
#![no_main]

use std::sync::LazyLock;

use chunnel::negotiate::{ChunnelInfo, Match, Mismatch, check_compatible, choose};
use chunnel::{Capability, OfferTree, Pick, StackOption};
use chunnel_negotiate::proto::{Decision, Server};
use chunnel_negotiate::wire::{Control, Hello, RejectReason, Tag, ZeroRtt, decode_control};
use libfuzzer_sys::fuzz_target;

fn info(id: &'static str, capabilities: Vec<Capability>) -> ChunnelInfo {
    ChunnelInfo {
        id: id.into(),
        capabilities,
    }
}

fn option(branches: &[u8], chunnels: Vec<ChunnelInfo>) -> StackOption {
    StackOption {
        chunnels,
        pick: Pick::from_branches(branches.to_vec()),
    }
}

static SERVERS: LazyLock<[Server; 2]> = LazyLock::new(|| {
    let json = option(
        &[0],
        vec![
            info("ser/json/1", vec![Capability::exact("serialize", ["json"])]),
            info(
                "shard/client/1",
                vec![Capability::compositional("shard", ["a", "b"])],
            ),
        ],
    );
    let bincode = option(
        &[1, 0],
        vec![info(
            "ser/bincode/1",
            vec![Capability::exact("serialize", ["bincode"])],
        )],
    );
    [
        Server::new(vec![
            json.clone(),
            bincode.clone(),
            option(&[1, 1], vec![info("chunnel/noop/1", Vec::new())]),
        ]),
        Server::new(vec![
            json,
            bincode,
            option(
                &[1, 1],
                vec![
                    info("chunnel/noop/1", Vec::new()),
                    info("frame/len/1", vec![Capability::exact("frame", ["u32"])]),
                ],
            ),
        ]),
    ]
});

fuzz_target!(|msg: &[u8]| {
    for server in SERVERS.iter() {
        check(server, msg);
        check_oversized(server, msg);
    }
    check_close(msg);
});

/// The answer to a datagram too large for the listener, of which only the first 32 bytes
/// were kept: a hello prefix gets a too-large REJECT that decodes and names the sizes;
/// anything else gets no answer.
fn check_oversized(server: &Server, msg: &[u8]) {
    let prefix = &msg[..msg.len().min(32)];
    let len = msg.len() + 512;
    match server.handle_oversized(prefix, len, 512) {
        None => assert!(prefix.first() != Some(&(Tag::Hello as u8))),
        Some(Decision::Reject { reject, response }) => {
            assert_eq!(reject.reason, RejectReason::TooLarge);
            assert_eq!(decode_control(&response), Ok(Control::Reject(reject)));
        }
        Some(Decision::Accept { .. }) => panic!("accepted an oversized hello"),
    }
}

/// A CLOSE ends a connection only if it is well formed and names that connection, and then
/// it is the exact bytes `close_message` makes.
fn check_close(msg: &[u8]) {
    for id in [0u64, 1, 0x0123_4567_89ab_cdef] {
        if chunnel_negotiate::proto::close_ends(msg, id) {
            assert_eq!(&chunnel_negotiate::proto::close_message(id)[..], msg);
        }
    }
}

fn check(server: &Server, msg: &[u8]) {
    let decision = server.handle_hello(msg);
    // A listener hands the hello over as `Bytes` (early data then sliced from it, not
    // copied): the decision must be the same.
    let from_bytes = server.handle_hello_bytes(&bytes::Bytes::copy_from_slice(msg));
    assert_eq!(format!("{decision:?}"), format!("{from_bytes:?}"));
    let (response, expected) = match &decision {
        Decision::Accept {
            accept, response, ..
        } => (response, Control::Accept(accept.clone())),
        Decision::Reject {
            reject, response, ..
        } => (response, Control::Reject(reject.clone())),
    };
    match &decision {
        Decision::Accept { .. } => assert_eq!(response.first(), Some(&0x02)),
        Decision::Reject { .. } => assert_eq!(response.first(), Some(&0x03)),
    }
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
    if hello.dictated {
        check_dictated(server, &hello, &decision);
        return;
    }
    // The fuzzer's trees are small (a hello is at most a few KB): their options are listed
    // here as the oracle's input; past a few thousand the check is skipped.
    if hello.offers.count() > 4096 {
        return;
    }
    let (server_offers, client_offers) = (server.tree().options(), hello.offers.options());
    match &decision {
        Decision::Accept { accept, early, .. } => {
            assert_eq!(accept.conn_id, hello.conn_id);
            assert!(
                client_offers.iter().any(|o| o.pick == accept.client_pick),
                "client_pick {:?} is not among the hello's offers",
                accept.client_pick
            );
            let s = server_offers
                .iter()
                .find(|s| s.pick == accept.server_pick)
                .expect("server_pick names a server option");
            assert_eq!(accept.server_stack[..], s.chunnels[..]);
            assert!(
                client_offers.iter().any(|o| o.pick == accept.client_pick
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
        Decision::Reject { reject, .. } => {
            assert_eq!(reject.reason, RejectReason::Incompatible);
            assert_eq!(reject.conn_id, hello.conn_id);
            // Refused: nothing compatible, or the search gave up (its limits).
            assert!(
                choose(&server_offers, &client_offers, usize::MAX).is_err()
                    || reject.message.contains("gave up")
            );
        }
    }
}

/// A Chunnel is two-sided (needs a peer implementation) if it has an exact capability.
fn two_sided(c: &ChunnelInfo) -> bool {
    c.capabilities.iter().any(|k| k.matching == Match::Exact)
}

fn check_dictated(server: &Server, hello: &Hello, decision: &Decision) {
    let registry = match &hello.offers {
        OfferTree::Options(list) if list.len() == 1 => Some(&list[0].chunnels),
        _ => None,
    };
    let Some(registry) = registry else {
        let Decision::Reject { reject, .. } = decision else {
            panic!("accepted a dictated hello without exactly one offer");
        };
        assert_eq!(reject.reason, RejectReason::Malformed);
        assert_eq!(reject.conn_id, hello.conn_id);
        assert!(reject.mismatches.is_empty());
        return;
    };
    let missing = |s: &StackOption| -> Option<String> {
        s.chunnels
            .iter()
            .find(|c| two_sided(c) && !registry.iter().any(|r| r.id == c.id))
            .map(|c| c.id.to_string())
    };
    let server_offers = server.tree().options();
    let first = server_offers.iter().position(|s| missing(s).is_none());
    match (decision, first) {
        (Decision::Accept { accept, early, .. }, Some(si)) => {
            assert_eq!(accept.conn_id, hello.conn_id);
            assert_eq!(accept.client_pick, Pick::default());
            assert_eq!(accept.server_pick, server_offers[si].pick);
            assert_eq!(accept.server_stack[..], server_offers[si].chunnels[..]);
            assert_eq!(accept.zero_rtt, ZeroRtt::NotOffered);
            assert!(early.is_empty());
        }
        (Decision::Reject { reject, .. }, None) => {
            assert_eq!(reject.reason, RejectReason::Incompatible);
            assert_eq!(reject.conn_id, hello.conn_id);
            let expected: Vec<Mismatch> = server_offers
                .iter()
                .enumerate()
                .take(16)
                .map(|(si, s)| {
                    let id = missing(s).unwrap_or_default();
                    Mismatch {
                        client_option: 0,
                        server_option: si as u16,
                        kind: format!("implementation of {id}"),
                        matching: Match::Exact,
                        client: None,
                        server: Some(vec![id]),
                    }
                })
                .collect();
            assert_eq!(reject.mismatches, expected);
        }
        (Decision::Accept { accept, .. }, None) => panic!(
            "dictated hello accepted with server pick {:?}, which does not fit",
            accept.server_pick
        ),
        (Decision::Reject { .. }, Some(si)) => {
            panic!("dictated hello refused although server option {si} fits")
        }
    }
}
