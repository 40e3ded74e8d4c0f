//! Property tests of the version-1 wire format and the sans-IO protocol on untrusted input:
//! every message round-trips through its encoder and decoder, every truncation and every
//! extension of a valid encoding is refused, and no input — random bytes, mutated
//! encodings — makes a decoder, the server or the client handshake panic.
//!
//! Strings are at most 16 characters and lists at most 4 elements so a run stays fast in a
//! debug build. Strings are biased towards the empty string and lists towards short ones:
//! the smallest encodings are where length bounds go wrong.

use std::borrow::Cow;
use std::time::Instant;

use bytes::Bytes;
use chunnel::negotiate::{ChunnelInfo, Match, Mismatch, check_compatible, choose};
use chunnel::{Capability, OfferTree, Pick, StackOption};
use chunnel_negotiate::proto::{ClientHandshake, Decision, Server, Timing};
use chunnel_negotiate::wire::{
    ACCEPT_DATA_PREFIX, Accept, Close, Control, Hello, Prepare, Refusal, Reject, RejectReason, Tag,
    TooLarge, Txn, VERSION, Verdict, Vote, ZeroRtt, decode_control, decode_stack, encode_control,
    encode_stack, split_accept_data,
};
use proptest::collection::vec;
use proptest::prelude::*;

const CASES: u32 = 256;

// ---------------------------------------------------------------------------------------
// Strategies.

/// A string of at most 16 characters: often empty, often short ASCII, sometimes any
/// printable Unicode (multi-byte UTF-8).
fn small_string() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => Just(String::new()),
        4 => "[a-z0-9/._-]{1,16}",
        2 => "\\PC{1,16}",
    ]
}

fn matching() -> impl Strategy<Value = Match> {
    prop_oneof![Just(Match::Exact), Just(Match::Compositional)]
}

fn pick() -> impl Strategy<Value = Pick> {
    // Short picks are stored inline, long ones (over `Pick::INLINE`) shared: both encode.
    prop_oneof![vec(0u8..=1, 0..=4), vec(0u8..=1, 20..=30)].prop_map(Pick::from_branches)
}

fn capability() -> impl Strategy<Value = Capability> {
    (small_string(), matching(), vec(small_string(), 0..=4)).prop_map(|(kind, matching, labels)| {
        Capability {
            kind: Cow::Owned(kind),
            matching,
            labels: labels.into_iter().map(Cow::Owned).collect(),
            rule: None,
        }
    })
}

fn chunnel_info() -> impl Strategy<Value = ChunnelInfo> {
    (small_string(), vec(capability(), 0..=4)).prop_map(|(id, capabilities)| ChunnelInfo {
        id: Cow::Owned(id),
        capabilities,
    })
}

fn chunnels() -> impl Strategy<Value = Vec<ChunnelInfo>> {
    vec(chunnel_info(), 0..=4)
}

fn stack_option() -> impl Strategy<Value = StackOption> {
    (chunnels(), pick()).prop_map(|(chunnels, pick)| StackOption { chunnels, pick })
}

fn early_data() -> impl Strategy<Value = Vec<Bytes>> {
    vec(vec(any::<u8>(), 0..=32).prop_map(Bytes::from), 0..=4)
}

/// A hello with or without a 0-RTT pick (early data only with one: the encoder writes early
/// data only after a 0-RTT pick), dictated or not.
fn hello() -> impl Strategy<Value = Hello> {
    (
        any::<u64>(),
        vec(stack_option(), 0..=4),
        prop::option::of((pick(), early_data())),
        any::<bool>(),
    )
        .prop_map(|(conn_id, offers, zero_rtt, dictated)| {
            let (zero_rtt, early) = match zero_rtt {
                Some((p, e)) => (Some(p), e),
                None => (None, Vec::new()),
            };
            Hello {
                version: VERSION,
                conn_id,
                offers: if dictated {
                    OfferTree::Options(offers)
                } else {
                    tree_of(offers, conn_id)
                },
                zero_rtt,
                early,
                dictated,
            }
        })
}

/// Options as a tree of one of several shapes (chosen by `seed`): the list itself; a select
/// between its halves; a layer of the first option's Chunnels over the list; the list beside
/// an empty one.
fn tree_of(offers: Vec<StackOption>, seed: u64) -> OfferTree {
    match seed % 4 {
        0 => OfferTree::Options(offers),
        1 => {
            let mut a = offers;
            let b = a.split_off(a.len() / 2);
            OfferTree::Select(
                Box::new(OfferTree::Options(a)),
                Box::new(OfferTree::Options(b)),
            )
        }
        2 => {
            let top = offers
                .first()
                .map(|o| o.chunnels.iter().cloned().map(OfferTree::Leaf).collect())
                .unwrap_or_default();
            OfferTree::Seq(vec![OfferTree::Seq(top), OfferTree::Options(offers)])
        }
        _ => OfferTree::Select(
            Box::new(OfferTree::Options(Vec::new())),
            Box::new(OfferTree::Options(offers)),
        ),
    }
}

fn zero_rtt() -> impl Strategy<Value = ZeroRtt> {
    prop_oneof![
        Just(ZeroRtt::NotOffered),
        Just(ZeroRtt::Accepted),
        Just(ZeroRtt::Rejected),
    ]
}

fn accept() -> impl Strategy<Value = Accept> {
    (any::<u64>(), zero_rtt(), pick(), pick(), chunnels()).prop_map(
        |(conn_id, zero_rtt, client_pick, server_pick, server_stack)| Accept {
            version: VERSION,
            conn_id,
            zero_rtt,
            client_pick,
            server_pick,
            server_stack: server_stack.into(),
        },
    )
}

fn reason() -> impl Strategy<Value = RejectReason> {
    prop_oneof![
        Just(RejectReason::Incompatible),
        Just(RejectReason::Version),
        Just(RejectReason::Malformed),
        Just(RejectReason::TooLarge),
    ]
}

fn labels() -> impl Strategy<Value = Option<Vec<String>>> {
    prop::option::of(vec(small_string(), 0..=4))
}

fn mismatch() -> impl Strategy<Value = Mismatch> {
    (
        any::<u16>(),
        any::<u16>(),
        small_string(),
        matching(),
        labels(),
        labels(),
    )
        .prop_map(
            |(client_option, server_option, kind, matching, client, server)| Mismatch {
                client_option,
                server_option,
                kind,
                matching,
                client,
                server,
            },
        )
}

fn reject() -> impl Strategy<Value = Reject> {
    (
        any::<u64>(),
        reason(),
        vec(mismatch(), 0..=4),
        small_string(),
        any::<(u32, u32)>(),
    )
        .prop_map(
            |(conn_id, reason, mismatches, message, (limit, len))| Reject {
                version: VERSION,
                conn_id,
                reason,
                mismatches,
                message,
                // Carried for (and only for) reason TooLarge.
                too_large: (reason == RejectReason::TooLarge).then_some(TooLarge { limit, len }),
            },
        )
}

fn refusal() -> impl Strategy<Value = Refusal> {
    prop_oneof![
        Just(Refusal::NotAllowed),
        Just(Refusal::Incompatible),
        Just(Refusal::Busy),
    ]
}

fn vote() -> impl Strategy<Value = Vote> {
    let verdict = prop_oneof![
        (pick(), chunnels()).prop_map(|(pick, stack)| Verdict::Yes { pick, stack }),
        (refusal(), vec(mismatch(), 0..=3), small_string()).prop_map(
            |(reason, mismatches, message)| Verdict::No {
                reason,
                mismatches,
                message
            }
        ),
    ];
    (any::<u64>(), verdict).prop_map(|(txn, verdict)| Vote {
        version: VERSION,
        txn,
        verdict,
    })
}

fn txn() -> impl Strategy<Value = Txn> {
    any::<u64>().prop_map(|txn| Txn {
        version: VERSION,
        txn,
    })
}

fn control() -> impl Strategy<Value = Control> {
    prop_oneof![
        hello().prop_map(Control::Hello),
        accept().prop_map(Control::Accept),
        reject().prop_map(Control::Reject),
        (accept(), vec(any::<u8>(), 0..=64))
            .prop_map(|(a, d)| Control::AcceptData(a, Bytes::from(d))),
        (any::<u64>(), stack_option()).prop_map(|(txn, option)| Control::Prepare(Prepare {
            version: VERSION,
            txn,
            option
        })),
        vote().prop_map(Control::Vote),
        txn().prop_map(Control::Commit),
        txn().prop_map(Control::Abort),
        txn().prop_map(Control::Done),
        any::<u64>().prop_map(|conn_id| Control::Close(Close {
            version: VERSION,
            conn_id
        })),
    ]
}

/// Random bytes, and random bytes behind each tag and the right version byte (which gets a
/// decoder past its first checks).
fn noise() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        vec(any::<u8>(), 0..=256),
        (0u8..=5, vec(any::<u8>(), 0..=256)).prop_map(|(tag, rest)| {
            let mut v = vec![tag, VERSION];
            v.extend(rest);
            v
        }),
    ]
}

/// A valid encoding with one byte overwritten, one byte removed or one byte inserted.
fn mutated() -> impl Strategy<Value = Vec<u8>> {
    (control(), any::<prop::sample::Index>(), any::<u8>(), 0u8..3).prop_map(|(c, at, byte, how)| {
        let mut v = encode_control(&c).to_vec();
        let i = at.index(v.len());
        match how {
            0 => v[i] = byte,
            1 => {
                v.remove(i);
            }
            _ => v.insert(i, byte),
        }
        v
    })
}

// Capabilities drawn from a small pool, so that generated hellos are sometimes compatible
// with the test server and its accept path is exercised too.
const KINDS: [&str; 3] = ["serialize", "shard", "frame"];
const LABELS: [&str; 4] = ["json", "bincode", "a", "b"];
const IDS: [&str; 4] = ["a/1", "b/1", "c/1", "d/1"];

fn pooled_capability() -> impl Strategy<Value = Capability> {
    (
        prop::sample::select(&KINDS[..]),
        matching(),
        prop::sample::subsequence(&LABELS[..], 0..=2),
    )
        .prop_map(|(kind, matching, labels)| Capability {
            kind: Cow::Borrowed(kind),
            matching,
            labels: labels.into_iter().map(Cow::Borrowed).collect(),
            rule: None,
        })
}

fn pooled_hello() -> impl Strategy<Value = Hello> {
    let option = (
        vec(
            (
                prop::sample::select(&IDS[..]),
                vec(pooled_capability(), 0..=2),
            )
                .prop_map(|(id, capabilities)| ChunnelInfo {
                    id: Cow::Borrowed(id),
                    capabilities,
                }),
            0..=2,
        ),
        pick(),
    )
        .prop_map(|(chunnels, pick)| StackOption { chunnels, pick });
    (
        any::<u64>(),
        vec(option, 0..=4),
        prop::option::of((pick(), early_data())),
        any::<prop::sample::Index>(),
        any::<bool>(),
        prop::bool::weighted(0.25),
    )
        .prop_map(|(conn_id, mut offers, zero_rtt, which, reuse, dictated)| {
            if dictated && offers.len() > 1 && reuse {
                // Mostly the one offer a dictated hello must carry, with an empty pick.
                offers.truncate(1);
                offers[0].pick = Pick::default();
            }
            let (zero_rtt, early) = match zero_rtt {
                // Often name one of the offers, so the 0-RTT pick can be accepted.
                Some((_, e)) if reuse && !offers.is_empty() => {
                    (Some(offers[which.index(offers.len())].pick.clone()), e)
                }
                Some((p, e)) => (Some(p), e),
                None => (None, Vec::new()),
            };
            Hello {
                version: VERSION,
                conn_id,
                offers: if dictated {
                    OfferTree::Options(offers)
                } else {
                    tree_of(offers, conn_id)
                },
                zero_rtt,
                early,
                dictated,
            }
        })
}

// ---------------------------------------------------------------------------------------
// Fixtures.

fn chunnel(id: &'static str, capabilities: Vec<Capability>) -> ChunnelInfo {
    ChunnelInfo {
        id: Cow::Borrowed(id),
        capabilities,
    }
}

/// A server with exact and compositional capabilities over two options, and a plain one
/// last (which every non-dictated offer without exact capabilities fits).
fn server() -> Server {
    Server::new(vec![
        StackOption {
            chunnels: vec![
                chunnel("a/1", vec![Capability::exact("serialize", ["json"])]),
                chunnel("b/1", vec![Capability::compositional("shard", ["a", "b"])]),
            ],
            pick: Pick::from_branches(vec![0]),
        },
        StackOption {
            chunnels: vec![chunnel(
                "a/1",
                vec![Capability::exact("serialize", ["bincode"])],
            )],
            pick: Pick::from_branches(vec![1, 0]),
        },
        StackOption {
            chunnels: vec![chunnel("b/1", Vec::new())],
            pick: Pick::from_branches(vec![1, 1]),
        },
    ])
}

/// A server whose every option has a two-sided Chunnel (one with an exact capability), so a
/// dictated hello can be refused as well as accepted.
fn strict_server() -> Server {
    Server::new(vec![
        StackOption {
            chunnels: vec![
                chunnel("a/1", vec![Capability::exact("serialize", ["json"])]),
                chunnel("b/1", vec![Capability::compositional("shard", ["a", "b"])]),
            ],
            pick: Pick::from_branches(vec![0]),
        },
        StackOption {
            chunnels: vec![chunnel(
                "a/1",
                vec![Capability::exact("serialize", ["bincode"])],
            )],
            pick: Pick::from_branches(vec![1, 0]),
        },
        StackOption {
            chunnels: vec![
                chunnel("b/1", Vec::new()),
                chunnel("c/1", vec![Capability::exact("frame", ["a"])]),
            ],
            pick: Pick::from_branches(vec![1, 1]),
        },
    ])
}

fn client_offers() -> Vec<StackOption> {
    vec![
        StackOption {
            chunnels: vec![chunnel(
                "a/1",
                vec![Capability::exact("serialize", ["json"])],
            )],
            pick: Pick::from_branches(vec![0]),
        },
        StackOption {
            chunnels: Vec::new(),
            pick: Pick::from_branches(vec![1]),
        },
    ]
}

/// Checks everything a server decision on `msg` must satisfy; `Err` names what failed.
fn same_decision(got: &Decision, want: &Decision) -> Result<(), TestCaseError> {
    match (got, want) {
        (
            Decision::Accept {
                accept: a,
                early: e,
                response: r,
                coalesce: c,
            },
            Decision::Accept {
                accept: a2,
                early: e2,
                response: r2,
                coalesce: c2,
            },
        ) => {
            prop_assert_eq!(a, a2);
            prop_assert_eq!(e, e2);
            prop_assert_eq!(r, r2);
            prop_assert_eq!(c, c2);
        }
        (
            Decision::Reject {
                reject: a,
                response: r,
            },
            Decision::Reject {
                reject: a2,
                response: r2,
            },
        ) => {
            prop_assert_eq!(a, a2);
            prop_assert_eq!(r, r2);
        }
        _ => {
            return Err(TestCaseError::fail(format!(
                "remembered and fresh decisions differ in kind: {got:?} vs {want:?}"
            )));
        }
    }
    Ok(())
}

fn check_decision(server: &Server, msg: &[u8]) -> Result<(), TestCaseError> {
    let decision = server.handle_hello(msg);
    let response = match &decision {
        Decision::Accept { response, .. } | Decision::Reject { response, .. } => response,
    };
    prop_assert!(
        matches!(response.first(), Some(&0x02) | Some(&0x03)),
        "response tag {:?}",
        response.first()
    );
    // The cached response is the encoding of the decision's message, and decodes to it.
    let expected = match &decision {
        Decision::Accept { accept, .. } => Control::Accept(accept.clone()),
        Decision::Reject { reject, .. } => Control::Reject(reject.clone()),
    };
    prop_assert_eq!(&encode_control(&expected), response);
    prop_assert_eq!(decode_control(response), Ok(expected));

    let hello = match msg.split_first() {
        Some((&t, body)) if t == Tag::Hello as u8 => Hello::decode(body).ok(),
        _ => None,
    };
    let Some(hello) = hello else {
        // Not a hello: always a reject, never an accept.
        let Decision::Reject { reject, .. } = &decision else {
            return Err(TestCaseError::fail(
                "accepted something that is not a hello",
            ));
        };
        prop_assert!(matches!(
            reject.reason,
            RejectReason::Malformed | RejectReason::Version
        ));
        return Ok(());
    };
    if hello.dictated {
        return check_dictated(server, &hello, &decision);
    }
    let (server_offers, client_offers) = (server.tree().options(), hello.offers.options());
    match &decision {
        Decision::Accept { accept, early, .. } => {
            prop_assert_eq!(accept.conn_id, hello.conn_id);
            prop_assert!(
                client_offers.iter().any(|o| o.pick == accept.client_pick),
                "client_pick is not among the hello's offers"
            );
            let Some(s) = server_offers.iter().find(|s| s.pick == accept.server_pick) else {
                return Err(TestCaseError::fail("server_pick names no server option"));
            };
            prop_assert_eq!(&accept.server_stack[..], &s.chunnels[..]);
            // An offer with that pick is compatible with the server's option.
            prop_assert!(client_offers.iter().any(|o| o.pick == accept.client_pick
                && check_compatible(&s.chunnels, &o.chunnels, 0, 0).is_ok()));
            match (&hello.zero_rtt, accept.zero_rtt) {
                (None, z) => {
                    prop_assert_eq!(z, ZeroRtt::NotOffered);
                    prop_assert!(early.is_empty());
                }
                (Some(p), ZeroRtt::Accepted) => {
                    prop_assert_eq!(p, &accept.client_pick);
                    prop_assert_eq!(early, &hello.early);
                }
                (Some(_), ZeroRtt::Rejected) => prop_assert!(early.is_empty()),
                (Some(_), ZeroRtt::NotOffered) => {
                    return Err(TestCaseError::fail("0-RTT pick ignored"));
                }
            }
        }
        Decision::Reject { reject, .. } => {
            prop_assert_eq!(reject.reason, RejectReason::Incompatible);
            prop_assert_eq!(reject.conn_id, hello.conn_id);
            prop_assert!(choose(&server_offers, &client_offers, usize::MAX).is_err());
        }
    }
    Ok(())
}

/// A Chunnel is two-sided (it needs a peer implementation) if it has an exact capability.
fn two_sided(c: &ChunnelInfo) -> bool {
    c.capabilities.iter().any(|k| k.matching == Match::Exact)
}

/// The decision on a well-formed DICTATED hello (`docs/wire.md` §7.2): with other than one
/// offer a malformed-reject; otherwise an accept of the first server option whose two-sided
/// Chunnels all have their id among the offer's, with an empty client pick; or, if there is
/// none, an incompatible-reject with one mismatch per server option naming the first missing
/// implementation.
fn check_dictated(
    server: &Server,
    hello: &Hello,
    decision: &Decision,
) -> Result<(), TestCaseError> {
    let registry = match &hello.offers {
        OfferTree::Options(list) if list.len() == 1 => Some(&list[0].chunnels),
        _ => None,
    };
    let Some(registry) = registry else {
        let Decision::Reject { reject, .. } = decision else {
            return Err(TestCaseError::fail(
                "accepted a dictated hello without exactly one offer",
            ));
        };
        prop_assert_eq!(reject.reason, RejectReason::Malformed);
        prop_assert_eq!(reject.conn_id, hello.conn_id);
        prop_assert!(reject.mismatches.is_empty());
        return Ok(());
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
            prop_assert_eq!(accept.conn_id, hello.conn_id);
            prop_assert_eq!(&accept.client_pick, &Pick::default());
            prop_assert_eq!(&accept.server_pick, &server_offers[si].pick);
            prop_assert_eq!(&accept.server_stack[..], &server_offers[si].chunnels[..]);
            // No 0-RTT for a dictated hello: nothing early is delivered.
            prop_assert_eq!(accept.zero_rtt, ZeroRtt::NotOffered);
            prop_assert!(early.is_empty());
        }
        (Decision::Reject { reject, .. }, None) => {
            prop_assert_eq!(reject.reason, RejectReason::Incompatible);
            prop_assert_eq!(reject.conn_id, hello.conn_id);
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
            prop_assert_eq!(&reject.mismatches, &expected);
        }
        (Decision::Accept { accept, .. }, None) => {
            return Err(TestCaseError::fail(format!(
                "dictated hello accepted with server pick {:?}, which does not fit",
                accept.server_pick
            )));
        }
        (Decision::Reject { .. }, Some(si)) => {
            return Err(TestCaseError::fail(format!(
                "dictated hello refused although server option {si} fits"
            )));
        }
    }
    Ok(())
}

fn fresh_client() -> ClientHandshake {
    let mut c = ClientHandshake::new(client_offers(), None, 7, Timing::default(), Instant::now())
        .expect("the test offers fit one message");
    assert!(c.poll_transmit(Instant::now()).is_some());
    c
}

// ---------------------------------------------------------------------------------------
// Properties.

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn stack_record_round_trips(c in chunnels()) {
        let enc = encode_stack(&c);
        prop_assert_eq!(decode_stack(&enc), Ok(c));
        // Any proper prefix is an error, never a panic or a shorter stack.
        for cut in 0..enc.len() {
            prop_assert!(decode_stack(&enc[..cut]).is_err());
        }
    }

    #[test]
    fn stack_record_decoder_never_panics(b in vec(any::<u8>(), 0..256)) {
        if let Ok(c) = decode_stack(&b) {
            prop_assert_eq!(&encode_stack(&c)[..], &b[..], "not canonical");
        }
    }

    #[test]
    fn hello_round_trips(h in hello()) {
        let enc = h.encode();
        prop_assert_eq!(enc[0], Tag::Hello as u8);
        prop_assert_eq!(Hello::decode(&enc[1..]), Ok(h.clone()));
        prop_assert_eq!(Hello::peek_conn_id(&enc[1..]), Ok(h.conn_id));
    }

    #[test]
    fn accept_round_trips(a in accept()) {
        let enc = a.encode();
        prop_assert_eq!(enc[0], Tag::Accept as u8);
        prop_assert_eq!(Accept::decode(&enc[1..]), Ok(a));
    }

    #[test]
    fn reject_round_trips(r in reject()) {
        let enc = r.encode();
        prop_assert_eq!(enc[0], Tag::Reject as u8);
        prop_assert_eq!(Reject::decode(&enc[1..]), Ok(r));
    }

    /// A reject cut to `max` bytes (docs/wire.md §7.4.1) fits (unless `max` is below the
    /// smallest reject), decodes, keeps a prefix of the mismatches, and says it was cut;
    /// one that fits is unchanged.
    #[test]
    fn a_reject_cut_to_fit_decodes(
        r in reject(),
        long in "\\PC{0,300}",
        max in 0usize..1200,
    ) {
        let r = Reject { message: format!("{}{long}", r.message), ..r };
        let whole = r.encode();
        let cut = r.encode_within(max);
        let floor = if r.reason == RejectReason::TooLarge { 23 } else { 15 };
        prop_assert!(cut.len() <= max.max(floor), "{} bytes for {}", cut.len(), max);
        let d = Reject::decode(&cut[1..]).unwrap();
        if whole.len() <= max {
            prop_assert_eq!(&cut, &whole);
            prop_assert_eq!(d, r);
        } else {
            let kept = d.mismatches.len();
            prop_assert_eq!(&d.mismatches[..], &r.mismatches[..kept]);
            prop_assert_eq!((d.version, d.conn_id, d.reason, d.too_large), (r.version, r.conn_id, r.reason, r.too_large));
            let note = format!(" [cut to fit {max} bytes: {} of {} mismatches left out]", r.mismatches.len() - kept, r.mismatches.len());
            if d.message.ends_with(&note) {
                let text = &d.message[..d.message.len() - note.len()];
                prop_assert!(r.message.starts_with(text));
                // The text is cut only once no mismatch is left.
                prop_assert!(kept == 0 || text == r.message);
            } else {
                // Not even the note fits: a prefix of it.
                prop_assert!(kept == 0 && note.starts_with(&d.message), "{:?}", d.message);
            }
        }
    }

    /// A prefix of any bytes as an oversized message: a hello's tag gets a TooLarge reject
    /// (addressed to the conn_id if the prefix holds one, within the limit when the limit
    /// allows), anything else no answer; never a panic.
    #[test]
    fn an_oversized_prefix_is_answered_by_its_tag(
        bytes in prop_oneof![noise(), mutated()],
        len in any::<usize>(),
        limit in 0usize..100_000,
    ) {
        let server = Server::new(Vec::<StackOption>::new());
        let d = server.handle_oversized(&bytes, len, limit);
        if bytes.first() != Some(&(Tag::Hello as u8)) {
            prop_assert!(d.is_none());
        } else {
            let Some(Decision::Reject { reject, response }) = d else {
                return Err(TestCaseError::fail("no reject"));
            };
            prop_assert!(response.len() <= limit.max(23));
            prop_assert_eq!(Reject::decode(&response[1..]).map(|r| (r.reason, r.conn_id, r.too_large)),
                Ok((RejectReason::TooLarge, reject.conn_id, reject.too_large)));
            let id = Hello::peek_conn_id(&bytes[1..]).unwrap_or(0);
            prop_assert_eq!(reject.conn_id, id);
            prop_assert_eq!(reject.too_large.map(|t| t.limit as usize), Some(limit.min(u32::MAX as usize)));
        }
    }

    #[test]
    fn control_round_trips(c in control()) {
        prop_assert_eq!(decode_control(&encode_control(&c)), Ok(c));
    }

    #[test]
    fn every_truncation_is_refused(c in control()) {
        let enc = encode_control(&c);
        // An ACCEPT_DATA's reply is "the rest of the message": cutting into the reply leaves
        // a valid message with a shorter reply, cutting into the accept does not.
        let whole = match &c {
            Control::AcceptData(_, d) => enc.len() - d.len(),
            _ => enc.len(),
        };
        for len in 0..whole {
            prop_assert!(decode_control(&enc[..len]).is_err(), "prefix of {} bytes decoded", len);
        }
        for len in whole..enc.len() {
            let Control::AcceptData(a, d) = &c else { unreachable!() };
            let cut = Control::AcceptData(a.clone(), d.slice(..len - whole));
            prop_assert_eq!(decode_control(&enc[..len]), Ok(cut));
        }
        // The per-message decoders on every proper prefix of the body.
        let body = &enc[1..];
        for len in 0..body.len() {
            let b = &body[..len];
            let ok = match &c {
                Control::Hello(_) => Hello::decode(b).is_ok(),
                Control::Accept(_) => Accept::decode(b).is_ok(),
                Control::Reject(_) => Reject::decode(b).is_ok(),
                Control::AcceptData(..) => false,
                Control::Prepare(_) => Prepare::decode(b).is_ok(),
                Control::Vote(_) => Vote::decode(b).is_ok(),
                Control::Commit(_) | Control::Abort(_) | Control::Done(_) => Txn::decode(b).is_ok(),
                Control::Close(_) => Close::decode(b).is_ok(),
            };
            prop_assert!(!ok, "body prefix of {} bytes decoded", len);
        }
    }

    #[test]
    fn a_trailing_byte_is_refused(c in control(), extra in any::<u8>()) {
        let mut enc = encode_control(&c).to_vec();
        enc.push(extra);
        match c {
            // The extra byte is more reply.
            Control::AcceptData(a, d) => {
                let longer = Bytes::from([&d[..], &[extra]].concat());
                prop_assert_eq!(decode_control(&enc), Ok(Control::AcceptData(a, longer)));
            }
            _ => prop_assert!(decode_control(&enc).is_err()),
        }
    }

    #[test]
    fn accept_data_is_accept_then_reply(a in accept(), d in vec(any::<u8>(), 0..=64)) {
        let enc = encode_control(&Control::AcceptData(a.clone(), Bytes::from(d.clone())));
        prop_assert_eq!(enc[0], Tag::AcceptData as u8);
        let (body, at) = split_accept_data(&enc).unwrap();
        prop_assert_eq!(Accept::decode(body), Ok(a.clone()));
        prop_assert_eq!(&enc[at..], &d[..]);
        // The embedded accept is byte for byte the ACCEPT the server would send alone.
        prop_assert_eq!(&enc[ACCEPT_DATA_PREFIX..at], &a.encode()[..]);
    }

    #[test]
    fn decoders_never_panic_on_noise(bytes in noise()) {
        let _ = decode_control(&bytes);
        let _ = Hello::decode(&bytes);
        let _ = Hello::peek_conn_id(&bytes);
        let _ = Accept::decode(&bytes);
        let _ = Reject::decode(&bytes);
        let _ = Close::decode(&bytes);
        let _ = chunnel_negotiate::proto::close_ends(&bytes, 7);
        if let Some((_, body)) = bytes.split_first() {
            let _ = Hello::decode(body);
            let _ = Accept::decode(body);
            let _ = Reject::decode(body);
            let _ = Close::decode(body);
        }
    }

    #[test]
    fn only_a_close_for_this_connection_ends_it(bytes in prop_oneof![noise(), mutated()], id in any::<u64>()) {
        // The classification agrees with the decoder: a well-formed CLOSE with this id.
        let want = matches!(decode_control(&bytes), Ok(Control::Close(c)) if c.conn_id == id);
        prop_assert_eq!(chunnel_negotiate::proto::close_ends(&bytes, id), want);
        let close = chunnel_negotiate::proto::close_message(id);
        prop_assert!(chunnel_negotiate::proto::close_ends(&close, id));
        prop_assert!(!chunnel_negotiate::proto::close_ends(&close, id ^ 1));
    }

    #[test]
    fn decoders_never_panic_on_mutated_encodings(bytes in mutated()) {
        // Whatever decodes re-encodes to the very same bytes (the encoding is canonical).
        if let Ok(c) = decode_control(&bytes) {
            prop_assert_eq!(&encode_control(&c)[..], &bytes[..]);
        }
    }

    #[test]
    fn server_answers_noise_with_accept_or_reject(bytes in noise()) {
        check_decision(&server(), &bytes)?;
    }

    #[test]
    fn server_answers_mutated_hellos_consistently(bytes in mutated()) {
        check_decision(&server(), &bytes)?;
    }

    #[test]
    fn server_decides_consistently_on_valid_hellos(h in pooled_hello()) {
        check_decision(&server(), &h.encode())?;
        check_decision(&strict_server(), &h.encode())?;
    }

    /// A server that remembers accepts per offer list answers exactly as a fresh server does:
    /// the same hellos again under other connection ids (answered from memory), and then
    /// mutations of them (a corrupted early-data part must still be rejected).
    #[test]
    fn remembered_accepts_match_fresh_decisions(
        hellos in vec(pooled_hello(), 1..6),
        ids in vec(any::<u64>(), 2),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        for strict in [false, true] {
            let fresh = || if strict { strict_server() } else { server() };
            let warm = fresh();
            let mut asked = Vec::new();
            for h in &hellos {
                for &id in &ids {
                    let mut h = h.clone();
                    h.conn_id = id;
                    asked.push(h.encode().to_vec());
                }
            }
            // The server in a listener takes the hello as `Bytes` (early data as slices of
            // it): it must decide exactly as on a plain slice.
            let warm_bytes = fresh();
            for msg in &asked {
                same_decision(&warm.handle_hello(msg), &fresh().handle_hello(msg))?;
                let b = Bytes::from(msg.clone());
                same_decision(&warm_bytes.handle_hello_bytes(&b), &fresh().handle_hello(msg))?;
            }
            // Every byte position of every asked hello, overwritten: what the warm server
            // answers from memory or afresh must match the fresh server.
            for msg in &asked {
                let mut m = msg.clone();
                let i = at.index(m.len());
                m[i] = byte;
                same_decision(&warm.handle_hello(&m), &fresh().handle_hello(&m))?;
                let b = Bytes::from(m.clone());
                same_decision(&warm_bytes.handle_hello_bytes(&b), &fresh().handle_hello(&m))?;
                m.truncate(i);
                same_decision(&warm.handle_hello(&m), &fresh().handle_hello(&m))?;
            }
        }
    }

    /// A client that expects an earlier accept (recognised without decoding) ends its
    /// handshake exactly as a fresh client does: on that accept again under this handshake's
    /// connection id, on another id, on any other accept, and on every one-byte overwrite
    /// or truncation of them, alone or coalesced with a reply.
    #[test]
    fn expected_accepts_match_fresh_outcomes(
        first in accept(),
        other in accept(),
        pick in 0usize..2,
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        // The earlier accept, as a finished handshake keeps it.
        let offers = client_offers();
        let mut first = first;
        first.conn_id = 7;
        first.client_pick = offers[pick].pick.clone();
        let mut c = fresh_client();
        c.handle_message(first.encode());
        let known = match c.poll_outcome() {
            Some(Ok(o)) => o.known,
            other => return Err(TestCaseError::fail(format!("no outcome: {other:?}"))),
        };
        let mut again = first.clone();
        again.conn_id = 8;
        let mut stranger = first.clone();
        stranger.conn_id = 9;
        let mut candidates = Vec::new();
        for a in [again, stranger, other] {
            let plain = a.encode().to_vec();
            let (_, header) = a.encode_with_data_header();
            let mut coalesced = header.map(|h| h.to_vec()).unwrap_or_default();
            coalesced.extend_from_slice(&[Tag::Data as u8, 42]);
            for m in [plain, coalesced] {
                if m.is_empty() {
                    continue;
                }
                let i = at.index(m.len());
                let mut overwritten = m.clone();
                overwritten[i] = byte;
                candidates.push(m.clone());
                candidates.push(overwritten);
                candidates.push(m[..i].to_vec());
            }
        }
        for m in candidates {
            let run = |expect: bool| {
                let mut c = ClientHandshake::new(
                    client_offers(), None, 8, Timing::default(), Instant::now(),
                ).expect("the test offers fit one message");
                if expect {
                    c.expect(known.clone());
                }
                c.handle_message(Bytes::from(m.clone()));
                c.poll_outcome().map(|r| r.map(|o| (o.accept, o.stack, o.early_replies)))
                    .map(|r| r.map_err(|e| e.to_string()))
            };
            prop_assert_eq!(run(true), run(false), "message {:?}", m);
        }
    }

    /// A handshake started from an earlier 0-RTT handshake's template sends, byte for byte,
    /// the hello a fresh one with the same offers, pick, `conn_id` and early data sends, and
    /// ends the same way on the same accept (or on noise).
    #[test]
    fn hellos_from_templates_match_fresh_hellos(
        offers in vec(stack_option(), 1..=4),
        which in any::<prop::sample::Index>(),
        first_early in early_data(),
        early in early_data(),
        ids in (any::<u64>(), any::<u64>()),
        answer in accept(),
        noise in noise(),
    ) {
        let pick = offers[which.index(offers.len())].pick.clone();
        let now = Instant::now();
        let first = ClientHandshake::new(
            offers.clone(), Some((pick.clone(), first_early)), ids.0, Timing::default(), now,
        );
        // Offer lists too large for one message are refused either way.
        let Ok(first) = first else { return Ok(()) };
        let t = first.template(42).expect("a 0-RTT handshake has a template");
        prop_assert_eq!(t.digest, 42);
        prop_assert_eq!(&t.pick, &pick);
        let fresh = ClientHandshake::new(
            offers.clone(), Some((pick.clone(), early.clone())), ids.1, Timing::default(), now,
        );
        let reused = ClientHandshake::from_template(&t, &early, ids.1, Timing::default(), now);
        let (mut fresh, mut reused) = match (fresh, reused) {
            (Ok(f), Ok(r)) => (f, r),
            (Err(f), Err(r)) => {
                prop_assert_eq!(f.to_string(), r.to_string());
                return Ok(());
            }
            (f, r) => {
                return Err(TestCaseError::fail(format!(
                    "fresh {:?} vs template {:?}", f.map(|_| ()), r.map(|_| ())
                )));
            }
        };
        prop_assert_eq!(fresh.poll_transmit(now), reused.poll_transmit(now));
        let mut answer = answer;
        answer.conn_id = ids.1;
        answer.client_pick = pick;
        for m in [answer.encode(), Bytes::from(noise)] {
            fresh.handle_message(m.clone());
            reused.handle_message(m);
        }
        let end = |c: &mut ClientHandshake| {
            c.poll_outcome()
                .map(|r| r.map(|o| (o.accept, o.stack)).map_err(|e| e.to_string()))
        };
        prop_assert_eq!(end(&mut fresh), end(&mut reused));
    }

    #[test]
    fn client_never_panics_on_noise(bytes in noise()) {
        let mut c = fresh_client();
        c.handle_message(Bytes::from(bytes));
        if let Some(Ok(o)) = c.poll_outcome() {
            prop_assert!(client_offers().iter().any(|x| x.pick == o.accept.client_pick && x.chunnels == o.stack));
        }
    }

    #[test]
    fn dictated_client_never_panics_on_noise(bytes in noise()) {
        let mut c = ClientHandshake::new_dictated(
            vec![chunnel("a/1", Vec::new())],
            9,
            Timing::default(),
            Instant::now(),
        )
        .expect("the test offer fits one message");
        prop_assert!(c.poll_transmit(Instant::now()).is_some());
        c.handle_message(Bytes::from(bytes));
        if let Some(Ok(o)) = c.poll_outcome() {
            prop_assert_eq!(o.accept.client_pick, Pick::default());
        }
    }

    #[test]
    fn client_never_panics_on_mutated_messages(bytes in mutated()) {
        let mut c = fresh_client();
        c.handle_message(Bytes::from(bytes));
        if let Some(Ok(o)) = c.poll_outcome() {
            prop_assert!(client_offers().iter().any(|x| x.pick == o.accept.client_pick && x.chunnels == o.stack));
            prop_assert_eq!(o.accept.conn_id, c.conn_id());
        }
    }
}

// ---------------------------------------------------------------------------------------
// Fixed cases at the edges of the length bounds.

/// The smallest mismatch encodes to 9 bytes (two `u16` option indices, an empty kind, the
/// matching byte and two absent label lists). Rejects made only of such mismatches and an
/// empty message must round-trip (a count check that took 10 bytes per record refused three
/// or more of them).
#[test]
fn reject_of_minimal_mismatches_round_trips() {
    let minimal = Mismatch {
        client_option: 0,
        server_option: 0,
        kind: String::new(),
        matching: Match::Exact,
        client: None,
        server: None,
    };
    for n in 0..=8 {
        let r = Reject {
            version: VERSION,
            conn_id: 1,
            reason: RejectReason::Incompatible,
            mismatches: vec![minimal.clone(); n],
            message: String::new(),
            too_large: None,
        };
        let enc = r.encode();
        assert_eq!(enc.len(), 1 + 1 + 8 + 1 + 2 + 9 * n + 2);
        assert_eq!(Reject::decode(&enc[1..]), Ok(r), "{n} minimal mismatches");
    }
}

/// The smallest element of every other list, repeated, round-trips as well.
#[test]
fn minimal_list_elements_round_trip() {
    let cap = Capability::exact("", Vec::<&'static str>::new());
    let info = chunnel("", vec![cap; 8]);
    let option = StackOption {
        chunnels: vec![info.clone(); 8],
        pick: Pick::default(),
    };
    let h = Hello {
        version: VERSION,
        conn_id: 0,
        offers: OfferTree::Options(vec![option; 8]),
        zero_rtt: Some(Pick::default()),
        early: vec![Bytes::new(); 8],
        dictated: false,
    };
    assert_eq!(Hello::decode(&h.encode()[1..]), Ok(h));
    let a = Accept {
        version: VERSION,
        conn_id: 0,
        zero_rtt: ZeroRtt::NotOffered,
        client_pick: Pick::default(),
        server_pick: Pick::default(),
        server_stack: vec![info; 8].into(),
    };
    assert_eq!(Accept::decode(&a.encode()[1..]), Ok(a));
    let labels = Capability::compositional("k", vec![""; 8]);
    let h = Hello {
        version: VERSION,
        conn_id: 0,
        offers: OfferTree::Options(vec![StackOption {
            chunnels: vec![chunnel("", vec![labels])],
            pick: Pick::from_branches(vec![0; 8]),
        }]),
        zero_rtt: None,
        early: Vec::new(),
        dictated: false,
    };
    assert_eq!(Hello::decode(&h.encode()[1..]), Ok(h));
}

/// Found by the `hello` fuzz target: an empty layer at the deepest level a decoder takes (63
/// layers of one part above it) must re-encode to the same bytes; the encoder once cut it to
/// an empty option list, as it cuts a layer whose parts would lie too deep.
#[test]
fn the_deepest_empty_layer_round_trips() {
    for last in [
        &[0x01u8, 0, 0][..],
        &[0x03, 0, 0],
        &[0x00, 0, 1, b'x', 0, 0],
    ] {
        let mut body = vec![VERSION, 0];
        body.extend_from_slice(&7u64.to_be_bytes());
        for _ in 0..63 {
            body.extend_from_slice(&[0x01, 0, 1]);
        }
        body.extend_from_slice(last);
        let h = Hello::decode(&body).expect("63 levels and a leaf decode");
        assert_eq!(&h.encode()[1..], &body[..], "canonical re-encoding");
        // One level more is refused.
        let mut deeper = body[..10].to_vec();
        deeper.extend_from_slice(&[0x01, 0, 1]);
        deeper.extend_from_slice(&body[10..]);
        assert!(Hello::decode(&deeper).is_err());
    }
}

/// A refused offer list is remembered: the same offers again (another connection id, as a
/// retransmission or another client sends them) are refused from memory, addressed to the
/// new id, exactly as a fresh search refuses them; the search is not run again.
#[test]
fn refusals_are_remembered_and_addressed_to_each_hello() {
    let s = strict_server();
    let hello = |conn_id| {
        Hello {
            version: chunnel_negotiate::wire::VERSION,
            conn_id,
            offers: OfferTree::Options(vec![StackOption {
                chunnels: vec![chunnel(
                    "a/1",
                    vec![Capability::exact("serialize", ["xml"])],
                )],
                pick: Pick::from_branches(vec![0]),
            }]),
            zero_rtt: None,
            early: Vec::new(),
            dictated: false,
        }
        .encode()
    };
    assert!(
        s.answer_from_memory(&hello(1)).is_none(),
        "nothing remembered yet"
    );
    let first = s.handle_hello_bytes(&hello(1));
    assert!(matches!(&first, Decision::Reject { reject, .. } if reject.conn_id == 1));
    assert_eq!(s.remembered_refusals(), 1);
    let again = s.answer_from_memory(&hello(2)).expect("remembered");
    match (&again, &strict_server().handle_hello_bytes(&hello(2))) {
        (
            Decision::Reject { reject, response },
            Decision::Reject {
                reject: fresh,
                response: fresh_bytes,
            },
        ) => {
            assert_eq!(reject.conn_id, 2);
            assert_eq!(reject, fresh);
            assert_eq!(response, fresh_bytes);
        }
        other => panic!("{other:?}"),
    }
}
