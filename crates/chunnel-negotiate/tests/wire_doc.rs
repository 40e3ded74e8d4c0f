//! Keeps `docs/wire.md` honest.
//!
//! Every hex dump in the document is marked `<!-- example: NAME -->` and followed by a
//! ```` ```text ```` block of space-separated hex bytes (wrapped over any number of lines). Each
//! must be, byte for byte, the encoding this crate produces for the message the example
//! describes; the answers (`ACCEPT`, `REJECT`) are produced by the real server from the example
//! hellos, so the document shows what a peer actually receives. The other tests check the
//! behaviour the document states in prose: decoding limits, versioning, retransmission, the
//! server's choice, and the handling of a retransmitted 0-RTT hello by a real listener.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel::negotiate::{Match, Mismatch, choose};
use chunnel::{
    Capability, Chunnel, ChunnelConnection, ChunnelInfo, ConnectionExt, Error, Identity, Negotiate,
    OfferTree, Offers, Pick, Select, Side, Stack, StackOption, select, stack,
};
use chunnel_negotiate::proto::{ClientHandshake, Decision, Server, Timing};
use chunnel_negotiate::wire::{
    Accept, Control, Hello, Reject, RejectReason, Tag, VERSION, WireError, ZeroRtt, decode_control,
};
use chunnel_negotiate::{Config, listen};
use chunnel_net::udp;

const DOC_PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/wire.md");

// ---------------------------------------------------------------------------------------
// The example Chunnels: pass-through layers that only describe themselves to negotiation.

macro_rules! leaf {
    ($name:ident, $id:literal, $cap:expr) => {
        #[derive(Clone, Copy, Debug, Default)]
        struct $name;

        impl Negotiate for $name {
            fn id(&self) -> &'static str {
                $id
            }

            fn capabilities(&self) -> Vec<Capability> {
                vec![$cap]
            }
        }

        impl<C: ChunnelConnection + Send> Chunnel<C> for $name {
            type Connection = C;

            async fn connect_wrap(&mut self, inner: C) -> Result<C, Error> {
                Ok(inner)
            }
        }
    };
}

leaf!(
    Bincode,
    "ser/bincode/1",
    Capability::exact("serialize", ["bincode"])
);
leaf!(Json, "ser/json/1", Capability::exact("serialize", ["json"]));
leaf!(
    RateLimit,
    "ratelimit/1",
    Capability::compositional("ratelimit", ["server"])
);

/// The client of the examples: `select(Bincode, Json)`.
fn client_tree() -> Select<Bincode, Json> {
    select(Bincode, Json)
}

/// The server of the examples: `stack![select(RateLimit, Identity), Json]`.
fn server_tree() -> Stack<Select<RateLimit, Identity>, Json> {
    stack![select(RateLimit, Identity), Json]
}

const HELLO_1RTT_ID: u64 = 0x0123_4567_89ab_cdef;
const REJECT_ID: u64 = 0x1122_3344_5566_7788;
const HELLO_0RTT_ID: u64 = 0xfedc_ba98_7654_3210;
const EARLY: &[u8] = br#"{"k":1}"#;

fn info(id: &'static str, cap: Capability) -> ChunnelInfo {
    ChunnelInfo {
        id: id.into(),
        capabilities: vec![cap],
    }
}

fn pick(b: &[u8]) -> Pick {
    Pick::from_branches(b.to_vec())
}

fn hello_1rtt() -> Hello {
    Hello {
        version: VERSION,
        conn_id: HELLO_1RTT_ID,
        offers: client_tree().offer_tree(),
        zero_rtt: None,
        early: Vec::new(),
        dictated: false,
    }
}

fn hello_reject() -> Hello {
    Hello {
        version: VERSION,
        conn_id: REJECT_ID,
        offers: Bincode.offer_tree(),
        zero_rtt: None,
        early: Vec::new(),
        dictated: false,
    }
}

fn hello_0rtt() -> Hello {
    Hello {
        version: VERSION,
        conn_id: HELLO_0RTT_ID,
        offers: client_tree().offer_tree(),
        zero_rtt: Some(pick(&[1])),
        early: vec![Bytes::from_static(EARLY)],
        dictated: false,
    }
}

/// The server's answer to `hello`, decided from its encoding as a peer would send it.
fn answer(server: &Server, hello: &Hello) -> Decision {
    server.handle_hello(&hello.encode())
}

/// The accept, the index of the server option it picked, the early data and the response.
/// The index is the pick's one decision: the servers of these tests are one select (or a
/// single Chunnel).
fn expect_accept(d: Decision) -> (Accept, usize, Vec<Bytes>, Bytes) {
    match d {
        Decision::Accept {
            accept,
            early,
            response,
            ..
        } => {
            let si = accept
                .server_pick
                .branches()
                .first()
                .map_or(0, |&b| b.into());
            (accept, si, early, response)
        }
        Decision::Reject { reject, .. } => panic!("expected an accept, got {reject:?}"),
    }
}

fn expect_reject(d: Decision) -> (Reject, Bytes) {
    match d {
        Decision::Reject { reject, response } => (reject, response),
        Decision::Accept { accept, .. } => panic!("expected a reject, got {accept:?}"),
    }
}

/// Every example of the document, by marker name, with the bytes it must show.
fn examples() -> Vec<(&'static str, Bytes)> {
    // The trees flatten as the document says.
    assert_eq!(
        client_tree().offers(),
        vec![
            StackOption {
                chunnels: vec![info(
                    "ser/bincode/1",
                    Capability::exact("serialize", ["bincode"])
                )],
                pick: pick(&[0]),
            },
            StackOption {
                chunnels: vec![info("ser/json/1", Capability::exact("serialize", ["json"]))],
                pick: pick(&[1]),
            },
        ]
    );
    let ratelimit = info(
        "ratelimit/1",
        Capability::compositional("ratelimit", ["server"]),
    );
    let json = info("ser/json/1", Capability::exact("serialize", ["json"]));
    assert_eq!(
        server_tree().offers(),
        vec![
            StackOption {
                chunnels: vec![ratelimit.clone(), json.clone()],
                pick: pick(&[0]),
            },
            StackOption {
                chunnels: vec![json.clone()],
                pick: pick(&[1]),
            },
        ]
    );
    let server = Server::new(server_tree().offer_tree());

    // 1-RTT: server option 0 against client option 0 fails on `serialize`, against client
    // option 1 it fits (`ratelimit` is compositional: the server alone may carry it).
    let hello = hello_1rtt();
    let (accept, si, early, accept_1rtt) = expect_accept(answer(&server, &hello));
    assert_eq!(si, 0);
    assert!(early.is_empty());
    assert_eq!(
        accept,
        Accept {
            version: VERSION,
            conn_id: HELLO_1RTT_ID,
            zero_rtt: ZeroRtt::NotOffered,
            client_pick: pick(&[1]),
            server_pick: pick(&[0]),
            server_stack: vec![ratelimit.clone(), json.clone()].into(),
        }
    );

    // Reject: the client offers only Bincode, the server only RateLimit.
    let lone = Server::new(RateLimit.offer_tree());
    let (reject, reject_bytes) = expect_reject(answer(&lone, &hello_reject()));
    assert_eq!(
        reject,
        Reject {
            version: VERSION,
            conn_id: REJECT_ID,
            reason: RejectReason::Incompatible,
            mismatches: vec![Mismatch {
                client_option: 0,
                server_option: 0,
                kind: "serialize".into(),
                matching: Match::Exact,
                client: Some(vec!["bincode".into()]),
                server: None,
            }],
            message: "no compatible stack (found by the server): exact capability `serialize` \
                      {bincode} at the client is missing at the server \
                      (client option 0, server option 0)"
                .into(),
        }
    );

    // 0-RTT: the remembered pick [1] is offered and server option 0 fits it.
    let hello0 = hello_0rtt();
    let (accept0, si0, early0, accept_0rtt) = expect_accept(answer(&server, &hello0));
    assert_eq!(si0, 0);
    assert_eq!(early0, vec![Bytes::from_static(EARLY)]);
    assert_eq!(
        accept0,
        Accept {
            version: VERSION,
            conn_id: HELLO_0RTT_ID,
            zero_rtt: ZeroRtt::Accepted,
            client_pick: pick(&[1]),
            server_pick: pick(&[0]),
            server_stack: vec![ratelimit, json].into(),
        }
    );

    let mut data = vec![Tag::Data as u8];
    data.extend_from_slice(EARLY);

    // The same answer held for the first reply (an echo of the early message): ACCEPT_DATA.
    let Decision::Accept {
        coalesce: Some(header),
        ..
    } = answer(&server, &hello0)
    else {
        panic!("an accept of 90 bytes can be coalesced");
    };
    assert_eq!(header[3..], accept_0rtt[..]);
    let accept_data = Bytes::from([&header[..], EARLY].concat());

    vec![
        ("hello-1rtt", hello.encode()),
        ("accept-1rtt", accept_1rtt),
        ("reject-incompatible", reject_bytes),
        ("hello-0rtt", hello0.encode()),
        ("accept-0rtt", accept_0rtt),
        ("accept-data-0rtt", accept_data),
        ("data", Bytes::from(data)),
    ]
}

// ---------------------------------------------------------------------------------------
// Reading the document.

fn read_doc() -> String {
    std::fs::read_to_string(DOC_PATH).unwrap_or_else(|e| panic!("reading {DOC_PATH}: {e}"))
}

/// One example of the document: its hex block and the rows of the table annotating it.
struct DocExample {
    bytes: Vec<u8>,
    rows: Vec<Row>,
}

/// One annotation row: `| offset | `hex` | field | value |`. A long field may be shown with an
/// ellipsis (`…`) between its first and last bytes; the row spans up to the next row's offset.
struct Row {
    line: usize,
    offset: usize,
    head: Vec<u8>,
    tail: Option<Vec<u8>>,
}

fn hex_tokens(s: &str, line: usize) -> Vec<u8> {
    s.split_whitespace()
        .map(|tok| {
            assert!(
                tok.len() == 2,
                "wire.md line {line}: `{tok}` is not one hex byte"
            );
            u8::from_str_radix(tok, 16)
                .unwrap_or_else(|_| panic!("wire.md line {line}: `{tok}` is not one hex byte"))
        })
        .collect()
}

/// Parses `| 12 | `00 01 … 6f` | ...`; `None` for any other line.
fn parse_row(l: &str, line: usize) -> Option<Row> {
    let mut cells = l.trim().strip_prefix('|')?.split('|').map(str::trim);
    let offset = cells.next()?.parse().ok()?;
    let hex = cells.next()?.strip_prefix('`')?.strip_suffix('`')?;
    let (head, tail) = match hex.split_once('…') {
        Some((h, t)) => (hex_tokens(h, line), Some(hex_tokens(t, line))),
        None => (hex_tokens(hex, line), None),
    };
    Some(Row {
        line,
        offset,
        head,
        tail,
    })
}

/// The examples of the document, by marker name: the ```text block after each
/// `<!-- example: NAME -->` marker, and the rows of the first table after it (before the next
/// marker or heading).
fn doc_examples(doc: &str) -> BTreeMap<String, DocExample> {
    let lines: Vec<&str> = doc.lines().collect();
    let mut out = BTreeMap::new();
    let mut i = 0;
    while i < lines.len() {
        let marker = lines[i]
            .trim()
            .strip_prefix("<!-- example:")
            .and_then(|r| r.strip_suffix("-->"));
        i += 1;
        let Some(name) = marker else { continue };
        let name = name.trim().to_owned();
        while i < lines.len() && lines[i].trim().is_empty() {
            i += 1;
        }
        assert_eq!(
            lines.get(i).map(|l| l.trim()),
            Some("```text"),
            "wire.md line {}: example `{name}` must be followed by a ```text block",
            i + 1
        );
        i += 1;
        let mut bytes = Vec::new();
        loop {
            let l = lines
                .get(i)
                .unwrap_or_else(|| panic!("wire.md: the block of example `{name}` is not closed"));
            i += 1;
            if l.trim() == "```" {
                break;
            }
            bytes.extend(hex_tokens(l, i));
        }
        let mut rows = Vec::new();
        let mut j = i;
        while j < lines.len() {
            let l = lines[j].trim();
            if l.starts_with("<!-- example:") || l.starts_with('#') {
                break;
            }
            if let Some(r) = parse_row(l, j + 1) {
                rows.push(r);
            } else if !rows.is_empty() && !l.starts_with('|') {
                break;
            }
            j += 1;
        }
        assert!(
            out.insert(name.clone(), DocExample { bytes, rows })
                .is_none(),
            "wire.md: example `{name}` appears twice"
        );
    }
    out
}

/// Checks an example's annotation rows against its bytes; returns what is wrong.
fn check_rows(name: &str, ex: &DocExample) -> Vec<String> {
    let mut wrong = Vec::new();
    if ex.rows.is_empty() {
        return vec![format!("example `{name}` has no annotation table")];
    }
    if ex.rows[0].offset != 0 {
        wrong.push(format!(
            "example `{name}`: the first row is not at offset 0"
        ));
    }
    for (k, r) in ex.rows.iter().enumerate() {
        let end = ex.rows.get(k + 1).map_or(ex.bytes.len(), |n| n.offset);
        let Some(span) = ex.bytes.get(r.offset..end) else {
            wrong.push(format!(
                "wire.md line {}: offsets {}..{end} are out of order or past the message",
                r.line, r.offset
            ));
            continue;
        };
        let ok = match &r.tail {
            None => span == &r.head[..],
            Some(tail) => {
                span.len() > r.head.len() + tail.len()
                    && span.starts_with(&r.head)
                    && span.ends_with(tail)
            }
        };
        if !ok {
            wrong.push(format!(
                "wire.md line {}: offsets {}..{end} of `{name}` hold `{}`",
                r.line,
                r.offset,
                hex_block(span).replace('\n', " ")
            ));
        }
    }
    wrong
}

/// The bytes as the document shows them: 16 a line.
fn hex_block(b: &[u8]) -> String {
    b.chunks(16)
        .map(|c| {
            c.iter()
                .map(|x| format!("{x:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn doc_examples_are_the_real_encodings() {
    let doc = read_doc();
    let found = doc_examples(&doc);
    let expected = examples();
    let mut wrong = Vec::new();
    for (name, bytes) in &expected {
        match found.get(*name) {
            Some(ex) if ex.bytes[..] == bytes[..] => wrong.extend(check_rows(name, ex)),
            Some(_) => wrong.push(format!(
                "example `{name}` differs; the encoder produces ({} bytes):\n```text\n{}\n```",
                bytes.len(),
                hex_block(bytes)
            )),
            None => wrong.push(format!(
                "example `{name}` is missing; add\n<!-- example: {name} -->\n```text\n{}\n```",
                hex_block(bytes)
            )),
        }
    }
    for name in found.keys() {
        if !expected.iter().any(|(n, _)| n == name) {
            wrong.push(format!("example `{name}` is not checked by this test"));
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/wire.md is stale:\n\n{}",
        wrong.join("\n\n")
    );
}

/// The 0-RTT examples abbreviate what they share with the 1-RTT ones.
#[test]
fn zero_rtt_examples_share_their_middle_with_the_1rtt_ones() {
    let ex = examples();
    let get = |n: &str| ex.iter().find(|(k, _)| *k == n).unwrap().1.clone();
    let (h1, h0) = (get("hello-1rtt"), get("hello-0rtt"));
    assert_eq!(h1.len(), 97);
    assert_eq!(h0[11..97], h1[11..97]);
    let (a1, a0) = (get("accept-1rtt"), get("accept-0rtt"));
    assert_eq!(a1.len(), 90);
    assert_eq!(a0[11..], a1[11..]);
}

#[test]
fn doc_examples_decode_back() {
    let doc = read_doc();
    let found = doc_examples(&doc);
    let control = |name: &str| {
        decode_control(&found[name].bytes).unwrap_or_else(|e| panic!("example `{name}`: {e}"))
    };
    assert_eq!(control("hello-1rtt"), Control::Hello(hello_1rtt()));
    assert_eq!(control("hello-0rtt"), Control::Hello(hello_0rtt()));
    assert!(matches!(control("accept-1rtt"), Control::Accept(a) if a.conn_id == HELLO_1RTT_ID));
    assert!(
        matches!(control("accept-0rtt"), Control::Accept(a) if a.zero_rtt == ZeroRtt::Accepted)
    );
    assert!(matches!(control("reject-incompatible"), Control::Reject(r) if r.conn_id == REJECT_ID));
    assert!(matches!(
        control("accept-data-0rtt"),
        Control::AcceptData(a, d) if a.zero_rtt == ZeroRtt::Accepted && d == EARLY
    ));
    assert_eq!(
        decode_control(&found["data"].bytes),
        Err(WireError("a data message is not a control message"))
    );
}

// ---------------------------------------------------------------------------------------
// The prose: decoding rules.

#[test]
fn decoders_are_strict() {
    let hello = hello_1rtt().encode();

    // Trailing bytes.
    let mut long = hello.to_vec();
    long.push(0);
    assert_eq!(
        decode_control(&long),
        Err(WireError("trailing bytes after the message"))
    );

    // Every proper prefix is an error (truncation anywhere).
    for n in 0..hello.len() {
        assert!(decode_control(&hello[..n]).is_err(), "prefix of {n} bytes");
    }

    // A count the remaining bytes cannot hold is refused before anything is read: here the
    // offer count says 0xffff options (4 bytes each at least) with 8 bytes left.
    let mut big = hello[..11].to_vec();
    big.extend_from_slice(&[0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(decode_control(&big), Err(WireError("offer count")));

    // Unknown flags.
    let mut flags = hello.to_vec();
    flags[2] = 0x04;
    assert_eq!(
        decode_control(&flags),
        Err(WireError("unknown hello flags"))
    );

    // A pick branch other than 0 and 1 (the first offer's pick is [0] at offset 15).
    let mut branch = hello.to_vec();
    assert_eq!(&branch[13..16], &[0, 1, 0]);
    branch[15] = 2;
    assert_eq!(
        decode_control(&branch),
        Err(WireError("pick branch is neither 0 nor 1"))
    );

    // The first capability's matching byte (offset 46: after the pick, the chunnel count,
    // the id, the capability count and the kind).
    let mut matching = hello.to_vec();
    assert_eq!(matching[46], 0);
    matching[46] = 2;
    assert_eq!(
        decode_control(&matching),
        Err(WireError("capability matching is neither 0 nor 1"))
    );

    // Invalid UTF-8 in a string.
    let mut utf8 = hello.to_vec();
    utf8[20] = 0xff;
    assert_eq!(decode_control(&utf8), Err(WireError("string is not UTF-8")));

    // Unknown and reserved tags, and the empty message.
    assert!(
        decode_control(&[0x04, 1]).is_err(),
        "a truncated ACCEPT_DATA"
    );
    for t in [0x05, 0x15, 0x1f, 0xff] {
        assert_eq!(
            decode_control(&[t, 1]),
            Err(WireError("unknown message tag"))
        );
    }
    assert_eq!(decode_control(&[]), Err(WireError("empty message")));

    // Unknown enumeration values in answers.
    let mut accept = Accept::decode(&[1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
    assert!(accept.is_ok());
    accept = Accept::decode(&[1, 0, 0, 0, 0, 0, 0, 0, 1, 3, 0, 0, 0, 0, 0, 0]);
    assert_eq!(accept, Err(WireError("unknown zero_rtt value")));
    assert_eq!(
        Reject::decode(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0]),
        Err(WireError("unknown reject reason"))
    );
    assert_eq!(
        Reject::decode(&[
            1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0
        ]),
        Err(WireError("labels presence is neither 0 nor 1"))
    );
}

// ---------------------------------------------------------------------------------------
// The prose: versioning and the server's decisions.

#[test]
fn server_answers_other_versions_with_a_version_reject() {
    let server = Server::new(server_tree().offer_tree());
    let mut v2 = hello_1rtt().encode().to_vec();
    v2[1] = 2;
    // Whatever follows the conn_id: a v1 server does not read it.
    v2.truncate(11);
    v2.push(0xee);
    let (reject, response) = expect_reject(server.handle_hello(&v2));
    assert_eq!(
        reject,
        Reject {
            version: VERSION,
            conn_id: HELLO_1RTT_ID,
            reason: RejectReason::Version,
            mismatches: Vec::new(),
            message: "server speaks version 1, hello has 2".into(),
        }
    );
    assert_eq!(response, reject.encode());

    // Too short to hold a conn_id: 0.
    let (reject, _) = expect_reject(server.handle_hello(&[0x01, 0x02, 0x00]));
    assert_eq!((reject.reason, reject.conn_id), (RejectReason::Version, 0));

    // Unknown flags: malformed, with the conn_id echoed.
    let mut flags = hello_1rtt().encode().to_vec();
    flags[2] = 0x80;
    let (reject, _) = expect_reject(server.handle_hello(&flags));
    assert_eq!(
        (reject.reason, reject.conn_id, reject.message.as_str()),
        (
            RejectReason::Malformed,
            HELLO_1RTT_ID,
            "malformed negotiation message: unknown hello flags"
        )
    );
}

#[test]
fn server_preference_comes_first() {
    // Both sides can run both stacks; the server prefers json, the client bincode.
    let server: Vec<StackOption> = select(Json, Bincode).offers();
    let client: Vec<StackOption> = select(Bincode, Json).offers();
    let c = choose(&server, &client, 16).expect("compatible");
    assert_eq!((c.server_option, c.client_option), (0, 1));

    // A remembered (0-RTT) pick overrides the server's preference when it is compatible.
    let srv = Server::new(server);
    let hello = Hello {
        version: VERSION,
        conn_id: 7,
        offers: select(Bincode, Json).offer_tree(),
        zero_rtt: Some(pick(&[0])),
        early: Vec::new(),
        dictated: false,
    };
    let (accept, si, _, _) = expect_accept(srv.handle_hello(&hello.encode()));
    assert_eq!(
        (accept.zero_rtt, accept.client_pick, si),
        (ZeroRtt::Accepted, pick(&[0]), 1)
    );

    // A 0-RTT pick that names none of the offers is refused; the regular choice follows.
    let hello = Hello {
        zero_rtt: Some(pick(&[1, 1])),
        ..hello
    };
    let (accept, si, early, _) = expect_accept(srv.handle_hello(&hello.encode()));
    assert_eq!(
        (accept.zero_rtt, accept.client_pick, si, early.len()),
        (ZeroRtt::Rejected, pick(&[1]), 0, 0)
    );

    // The answer is a function of the hello: a retransmission gets the same bytes.
    let a = expect_accept(srv.handle_hello(&hello.encode())).3;
    let b = expect_accept(srv.handle_hello(&hello.encode())).3;
    assert_eq!(a, b);
}

/// The pick table and the walk of §11, on `stack![select(A, select(B, C)), select(D, E)]`.
#[test]
fn picks_are_pre_order_paths() {
    let tree = stack![
        select(Bincode, select(Json, RateLimit)),
        select(Bincode, Json)
    ];
    let got: Vec<(Vec<String>, Vec<u8>)> = tree
        .offers()
        .into_iter()
        .map(|o| {
            let ids = o.chunnels.iter().map(|c| c.id.to_string()).collect();
            (ids, o.pick.branches().to_vec())
        })
        .collect();
    let (a, b, c, d, e) = (
        "ser/bincode/1",
        "ser/json/1",
        "ratelimit/1",
        "ser/bincode/1",
        "ser/json/1",
    );
    let want = [
        ([a, d], &[0, 0][..]),
        ([a, e], &[0, 1]),
        ([b, d], &[1, 0, 0]),
        ([b, e], &[1, 0, 1]),
        ([c, d], &[1, 1, 0]),
        ([c, e], &[1, 1, 1]),
    ];
    let want: Vec<(Vec<String>, Vec<u8>)> = want
        .iter()
        .map(|(ids, p)| (ids.iter().map(|s| s.to_string()).collect(), p.to_vec()))
        .collect();
    assert_eq!(got, want);

    // Mapping `1 0 1` back: the top select takes its right branch, whose select takes its
    // left (B); the bottom select takes its right (E).
    let mut t = tree.clone();
    t.apply(&pick(&[1, 0, 1])).unwrap();
    assert_eq!(t.outer.choice(), Some(Side::Right));
    assert_eq!(t.outer.right.choice(), Some(Side::Left));
    assert_eq!(t.inner.choice(), Some(Side::Right));
    // Too few, too many, or a branch other than 0 and 1: refused.
    for bad in [&[1, 0][..], &[1, 0, 1, 0], &[2, 0]] {
        assert!(tree.clone().apply(&pick(bad)).is_err(), "{bad:?}");
    }
}

#[test]
fn empty_offer_list_is_incompatible() {
    let server = Server::new(server_tree().offer_tree());
    let hello = Hello {
        offers: OfferTree::Options(Vec::new()),
        ..hello_1rtt()
    };
    let (reject, _) = expect_reject(server.handle_hello(&hello.encode()));
    assert_eq!(reject.reason, RejectReason::Incompatible);
    assert!(reject.mismatches.is_empty());
}

// ---------------------------------------------------------------------------------------
// The prose: the client.

#[test]
fn retransmission_schedule() {
    let t0 = Instant::now();
    let hello = hello_1rtt();
    let mut hs = ClientHandshake::new(
        hello.offers.clone(),
        None,
        hello.conn_id,
        Timing::default(),
        t0,
    )
    .expect("hello fits");
    let mut now = t0;
    let mut sent = Vec::new();
    let outcome = loop {
        while let Some(m) = hs.poll_transmit(now) {
            assert_eq!(m, hello.encode(), "every attempt sends the same bytes");
            sent.push((now - t0).as_millis());
        }
        if let Some(r) = hs.poll_outcome() {
            break r;
        }
        now = hs.poll_timeout().expect("a timer while waiting");
        hs.handle_timeout(now);
    };
    assert_eq!(sent, [0, 100, 300, 700, 1500, 3100, 6300]);
    assert!(matches!(
        outcome,
        Err(chunnel_negotiate::Error::Timeout { attempts: 7, waited })
            if waited == Duration::from_millis(12_700)
    ));
}

#[test]
fn client_ignores_stale_answers() {
    let t0 = Instant::now();
    let hello = hello_1rtt();
    let mut hs =
        ClientHandshake::new(hello.offers.clone(), None, 5, Timing::default(), t0).unwrap();
    assert!(hs.poll_transmit(t0).is_some());
    let server = Server::new(server_tree().offer_tree());

    // An answer to another conn_id, an unknown tag, a hello: ignored.
    let (_, _, _, stale) = expect_accept(server.handle_hello(&hello.encode()));
    hs.handle_message(stale);
    hs.handle_message(Bytes::from_static(&[0x10, 1, 2]));
    hs.handle_message(hello.encode());
    // Data before the accept is kept, tag stripped.
    hs.handle_message(Bytes::from_static(b"\x00early"));
    assert!(hs.poll_outcome().is_none());

    let ours = Hello {
        conn_id: 5,
        ..hello.clone()
    };
    let (_, _, _, accept) = expect_accept(server.handle_hello(&ours.encode()));
    hs.handle_message(accept);
    let out = hs.poll_outcome().expect("done").expect("accepted");
    assert_eq!(out.accept.client_pick, pick(&[1]));
    assert_eq!(Some(out.stack), hello.offers.option(&pick(&[1])));
    assert_eq!(out.early_replies, vec![Bytes::from_static(b"early")]);

    // A reject with conn_id 0 (the server could not read ours) ends a handshake.
    let mut hs =
        ClientHandshake::new(hello.offers.clone(), None, 5, Timing::default(), t0).unwrap();
    assert!(hs.poll_transmit(t0).is_some());
    let (_, malformed) = expect_reject(server.handle_hello(&[0x01]));
    hs.handle_message(malformed);
    assert!(matches!(
        hs.poll_outcome(),
        Some(Err(chunnel_negotiate::Error::Refused { .. }))
    ));
}

// ---------------------------------------------------------------------------------------
// The prose: a retransmitted 0-RTT hello, by a peer that speaks only bytes.

async fn recv_raw<C: ChunnelConnection<Data = Bytes>>(c: &C) -> Bytes {
    tokio::time::timeout(Duration::from_secs(5), c.recv_one())
        .await
        .expect("an answer within 5 s")
        .expect("recv")
}

#[tokio::test]
async fn retransmitted_hello_gets_the_cached_accept_and_no_second_delivery() {
    let listener = udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let mut server = listen(server_tree(), listener, Config::default());
    let echo = tokio::spawn(async move {
        let conn = server.accept().await.expect("negotiated");
        assert_eq!(conn.info().zero_rtt, ZeroRtt::Accepted);
        while let Ok(m) = conn.recv_one().await {
            if conn.send_one(m).await.is_err() {
                break;
            }
        }
    });

    let raw = udp::Connect::new(addr).connect_wrap(()).await.unwrap();
    let hello = hello_0rtt().encode();
    let accept = expect_accept(Server::new(server_tree().offer_tree()).handle_hello(&hello)).3;
    // The server holds the accept for its first reply: one ACCEPT_DATA (§7.5, §8.3).
    let accept_data = Bytes::from(
        [
            &[Tag::AcceptData as u8][..],
            &(accept.len() as u16).to_be_bytes(),
            &accept,
            EARLY,
        ]
        .concat(),
    );

    raw.send_one(hello.clone()).await.unwrap();
    assert_eq!(recv_raw(&raw).await, accept_data);

    // The same hello again: the identical accept, and the early message is not delivered
    // (echoed) a second time: the next data echoed is the next message sent.
    raw.send_one(hello).await.unwrap();
    assert_eq!(recv_raw(&raw).await, accept);
    raw.send_one(Bytes::from_static(b"\x00next")).await.unwrap();
    assert_eq!(recv_raw(&raw).await, Bytes::from_static(b"\x00next"));
    echo.abort();
}
