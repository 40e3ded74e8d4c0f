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
    Accept, Close, Control, Hello, Reject, RejectReason, Tag, TooLarge, VERSION, WireError,
    ZeroRtt, decode_control,
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
            too_large: None,
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

    // Too large: the reject example's hello, 1,040 bytes long in this example, reaches a
    // server whose datagram limit is 512 bytes: the listener keeps its first 32 bytes.
    let prefix = hello_reject().encode().slice(..32);
    let Some(Decision::Reject {
        reject: too_large,
        response: too_large_bytes,
    }) = lone.handle_oversized(&prefix, 1040, 512)
    else {
        panic!("a hello's prefix is refused");
    };
    assert_eq!(
        (too_large.reason, too_large.conn_id, too_large.too_large),
        (
            RejectReason::TooLarge,
            REJECT_ID,
            Some(TooLarge {
                limit: 512,
                len: 1040
            })
        )
    );

    vec![
        ("hello-1rtt", hello.encode()),
        ("accept-1rtt", accept_1rtt),
        ("reject-incompatible", reject_bytes),
        ("reject-too-large", too_large_bytes),
        ("hello-0rtt", hello0.encode()),
        ("accept-0rtt", accept_0rtt),
        ("accept-data-0rtt", accept_data),
        ("data", Bytes::from(data)),
        // The client of the 1-RTT example ends its connection.
        (
            "close",
            chunnel_negotiate::proto::close_message(HELLO_1RTT_ID),
        ),
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
    assert_eq!(h1.len(), 88);
    assert_eq!(h0[11..88], h1[11..88]);
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
        control("reject-too-large"),
        Control::Reject(r) if r.reason == RejectReason::TooLarge && r.too_large.is_some_and(|t| t.limit == 512)
    ));
    assert!(matches!(
        control("accept-data-0rtt"),
        Control::AcceptData(a, d) if a.zero_rtt == ZeroRtt::Accepted && d == EARLY
    ));
    assert_eq!(
        control("close"),
        Control::Close(Close {
            version: VERSION,
            conn_id: HELLO_1RTT_ID
        })
    );
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

    // A count the remaining bytes cannot hold is refused before anything is read: here a
    // SEQ node says 0xffff layers (3 bytes each at least), then an OPTIONS node 0xffff
    // options (4 bytes each at least), with 8 bytes left.
    let mut big = hello[..11].to_vec();
    big.extend_from_slice(&[0x01, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(decode_control(&big), Err(WireError("layer count")));
    big[11] = 0x03;
    assert_eq!(decode_control(&big), Err(WireError("option count")));

    // Unknown flags.
    let mut flags = hello.to_vec();
    flags[2] = 0x04;
    assert_eq!(
        decode_control(&flags),
        Err(WireError("unknown hello flags"))
    );

    // A pick branch other than 0 and 1 (the 0-RTT hello's pick is [1] at offsets 88–90).
    let mut branch = hello_0rtt().encode().to_vec();
    assert_eq!(&branch[88..91], &[0, 1, 1]);
    branch[90] = 2;
    assert_eq!(
        decode_control(&branch),
        Err(WireError("pick branch is neither 0 nor 1"))
    );

    // The first capability's matching byte (offset 41: after the SELECT and LEAF kinds, the
    // id, the capability count and the kind).
    let mut matching = hello.to_vec();
    assert_eq!(&matching[11..13], &[0x02, 0x00]);
    assert_eq!(matching[41], 0);
    matching[41] = 2;
    assert_eq!(
        decode_control(&matching),
        Err(WireError("capability matching is neither 0 nor 1"))
    );

    // Invalid UTF-8 in a string (the first byte of the first Chunnel's id).
    let mut utf8 = hello.to_vec();
    assert_eq!(utf8[15], b's');
    utf8[15] = 0xff;
    assert_eq!(decode_control(&utf8), Err(WireError("string is not UTF-8")));

    // A tree node kind other than 0–3.
    for kind in [0x04, 0x80, 0xff] {
        let mut node = hello.to_vec();
        node[11] = kind;
        assert_eq!(
            decode_control(&node),
            Err(WireError("unknown tree node kind"))
        );
    }

    // Unknown and reserved tags, and the empty message.
    assert!(
        decode_control(&[0x04, 1]).is_err(),
        "a truncated ACCEPT_DATA"
    );
    for t in [0x06, 0x0f, 0x15, 0x1f, 0xff] {
        assert_eq!(
            decode_control(&[t, 1]),
            Err(WireError("unknown message tag"))
        );
    }
    assert_eq!(decode_control(&[]), Err(WireError("empty message")));

    // Unknown enumeration values in answers (bodies after the tag: version 2 first).
    let mut accept = Accept::decode(&[2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
    assert!(accept.is_ok());
    accept = Accept::decode(&[2, 0, 0, 0, 0, 0, 0, 0, 1, 3, 0, 0, 0, 0, 0, 0]);
    assert_eq!(accept, Err(WireError("unknown zero_rtt value")));
    assert_eq!(
        Reject::decode(&[2, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0]),
        Err(WireError("unknown reject reason"))
    );
    // Reason 4 (too large) must carry its limit and length after the message.
    assert_eq!(
        Reject::decode(&[2, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0]),
        Err(WireError("limit"))
    );
    assert_eq!(
        Reject::decode(&[
            2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0
        ]),
        Err(WireError("labels presence is neither 0 nor 1"))
    );
}

/// A hello (1-RTT, conn_id 1) carrying `tree` as its offers, encoded by hand after the
/// fixed prefix: the encoder is not asked to make what the decoder must refuse.
fn hello_with_tree_bytes(tree: &[u8]) -> Vec<u8> {
    let mut b = vec![0x01, VERSION, 0x00, 0, 0, 0, 0, 0, 0, 0, 1];
    b.extend_from_slice(tree);
    b
}

/// A LEAF node with an empty id and no capabilities: the smallest node (5 bytes).
const EMPTY_LEAF: [u8; 5] = [0x00, 0, 0, 0, 0];

#[test]
fn offer_tree_limits() {
    use chunnel_negotiate::wire::{MAX_TREE_CHOICES, MAX_TREE_DEPTH, MAX_TREE_NODES};
    assert_eq!(
        (MAX_TREE_NODES, MAX_TREE_CHOICES, MAX_TREE_DEPTH),
        (4096, 512, 64)
    );
    let too_many = Err(WireError("offer tree has too many nodes"));
    let too_many_choices = Err(WireError("offer tree has too many choices"));
    let too_deep = Err(WireError("offer tree is nested too deep"));

    // Nodes: a SEQ of n leaves is 1 + n nodes.
    let seq = |n: usize| {
        let mut t = vec![0x01];
        t.extend_from_slice(&(n as u16).to_be_bytes());
        for _ in 0..n {
            t.extend_from_slice(&EMPTY_LEAF);
        }
        hello_with_tree_bytes(&t)
    };
    match decode_control(&seq(MAX_TREE_NODES - 1)) {
        Ok(Control::Hello(h)) => assert_eq!(h.offers.nodes(), MAX_TREE_NODES),
        r => panic!("4,096 nodes decode: {r:?}"),
    }
    assert_eq!(decode_control(&seq(MAX_TREE_NODES)), too_many);

    // Each listed option of an OPTIONS node counts as a node.
    let options = |n: usize| {
        let mut t = vec![0x03];
        t.extend_from_slice(&(n as u16).to_be_bytes());
        for _ in 0..n {
            t.extend_from_slice(&[0, 0, 0, 0]); // empty pick, no Chunnels
        }
        hello_with_tree_bytes(&t)
    };
    assert!(decode_control(&options(MAX_TREE_NODES - 1)).is_ok());
    assert_eq!(decode_control(&options(MAX_TREE_NODES)), too_many);

    // The limits hold for the server too: a malformed reject, conn_id echoed.
    let server = Server::new(server_tree().offer_tree());
    let (reject, _) = expect_reject(server.handle_hello(&seq(MAX_TREE_NODES)));
    assert_eq!(
        (reject.reason, reject.conn_id, reject.message.as_str()),
        (
            RejectReason::Malformed,
            1,
            "malformed negotiation message: offer tree has too many nodes"
        )
    );

    // Choices: SELECT and OPTIONS nodes, at most 512. A SEQ of n selects of two leaves.
    let choices = |n: usize, kind: u8| {
        let mut t = vec![0x01];
        t.extend_from_slice(&(n as u16).to_be_bytes());
        for _ in 0..n {
            match kind {
                0x02 => {
                    t.push(0x02);
                    t.extend_from_slice(&EMPTY_LEAF);
                    t.extend_from_slice(&EMPTY_LEAF);
                }
                _ => t.extend_from_slice(&[0x03, 0, 0]), // OPTIONS with no option
            }
        }
        hello_with_tree_bytes(&t)
    };
    for kind in [0x02, 0x03] {
        assert!(decode_control(&choices(MAX_TREE_CHOICES, kind)).is_ok());
        assert_eq!(
            decode_control(&choices(MAX_TREE_CHOICES + 1, kind)),
            too_many_choices
        );
    }
    // The example client's select, 513 times: within the node limit (1,540 nodes) and the
    // message limit (39,515 bytes), refused for its choices.
    let hello = Hello {
        offers: stacked_selects(MAX_TREE_CHOICES + 1),
        ..hello_1rtt()
    };
    assert_eq!(hello.offers.nodes(), 1 + 3 * 513);
    assert_eq!(hello.encode().len(), 39_515);
    let (reject, _) = expect_reject(server.handle_hello(&hello.encode()));
    assert_eq!(
        reject.message,
        "malformed negotiation message: offer tree has too many choices"
    );

    // Depth: the root is at depth 0; a node at depth 64 (65 levels) is refused.
    let nested = |levels: usize| {
        let mut t = Vec::new();
        for _ in 0..levels - 1 {
            t.extend_from_slice(&[0x01, 0x00, 0x01]); // SEQ of one part
        }
        t.extend_from_slice(&EMPTY_LEAF);
        hello_with_tree_bytes(&t)
    };
    assert!(decode_control(&nested(MAX_TREE_DEPTH)).is_ok());
    assert_eq!(decode_control(&nested(MAX_TREE_DEPTH + 1)), too_deep);
    let (reject, _) = expect_reject(server.handle_hello(&nested(MAX_TREE_DEPTH + 1)));
    assert_eq!(reject.reason, RejectReason::Malformed);

    // SELECT nests too: 64 selects in a chain put their last leaves at depth 64.
    let selects = |n: usize| {
        let mut t = Vec::new();
        for _ in 0..n {
            t.push(0x02);
            t.extend_from_slice(&EMPTY_LEAF); // the left branch: a leaf
        }
        t.extend_from_slice(&EMPTY_LEAF); // the last right branch
        hello_with_tree_bytes(&t)
    };
    assert!(decode_control(&selects(MAX_TREE_DEPTH - 1)).is_ok());
    assert_eq!(decode_control(&selects(MAX_TREE_DEPTH)), too_deep);

    // An unknown node kind, nested.
    let mut t = vec![0x02];
    t.extend_from_slice(&EMPTY_LEAF);
    t.extend_from_slice(&[0x04, 0, 0]);
    assert_eq!(
        decode_control(&hello_with_tree_bytes(&t)),
        Err(WireError("unknown tree node kind"))
    );
    // A truncated node: a SELECT with one branch.
    let mut t = vec![0x02];
    t.extend_from_slice(&EMPTY_LEAF);
    assert!(decode_control(&hello_with_tree_bytes(&t)).is_err());
}

/// `k` copies of the example client's select, stacked: `stack![select(Bincode, Json), ...]`.
fn stacked_selects(k: usize) -> OfferTree {
    OfferTree::Seq(vec![client_tree().offer_tree(); k])
}

#[test]
fn hellos_grow_linearly_with_the_stack() {
    // A stack's tree is what `stack!` builds: a SEQ of its layers.
    let two = stack![client_tree(), client_tree()].offer_tree();
    assert_eq!(two, stacked_selects(2));
    for k in [1usize, 16, 64, 512] {
        let tree = stacked_selects(k);
        assert_eq!(tree.nodes(), 1 + 3 * k);
        // 2^k options (the count saturates at u128::MAX).
        let options = if k < 128 { 1u128 << k } else { u128::MAX };
        assert_eq!(tree.count(), options);
        let hello = Hello {
            offers: tree,
            ..hello_1rtt()
        };
        let bytes = hello.encode();
        // 11 bytes of prefix, 3 of SEQ header, 77 per select: SELECT (1), LEAF (1) +
        // ser/bincode/1 (40), LEAF (1) + ser/json/1 (34).
        assert_eq!(bytes.len(), 14 + 77 * k, "{k} selects");
        assert_eq!(decode_control(&bytes), Ok(Control::Hello(hello)));
    }
    // The doc's figures: 16 and 64 selects, and 512 (the choice limit: the largest hello of
    // this shape).
    assert_eq!(14 + 77 * 512, 39_438);
    assert_eq!(
        Hello {
            offers: stacked_selects(16),
            ..hello_1rtt()
        }
        .encode()
        .len(),
        1_246
    );
    assert_eq!(
        Hello {
            offers: stacked_selects(64),
            ..hello_1rtt()
        }
        .encode()
        .len(),
        4_942
    );

    // The server decides on 64 selects (2^64 client options) at once: a server whose stack
    // is 64 Json layers takes the fallback of every select.
    let json = OfferTree::Seq(vec![Json.offer_tree(); 64]);
    let server = Server::new(json);
    let hello = Hello {
        offers: stacked_selects(64),
        ..hello_1rtt()
    };
    let (accept, _, _, _) = expect_accept(server.handle_hello(&hello.encode()));
    assert_eq!(accept.client_pick, pick(&[1; 64]));
}

#[test]
fn a_search_past_the_step_limit_is_refused_as_incompatible() {
    use chunnel::offer_tree::Limits;
    assert_eq!(Limits::default().steps, 200_000);
    assert_eq!(Limits::default().max_reported, 16);
    let server =
        Server::new(server_tree().offer_tree()).with_limits(Limits::default().with_steps(1));
    let (reject, _) = expect_reject(server.handle_hello(&hello_1rtt().encode()));
    assert_eq!(
        (
            reject.version,
            reject.conn_id,
            reject.reason,
            reject.mismatches.len()
        ),
        (VERSION, HELLO_1RTT_ID, RejectReason::Incompatible, 0)
    );
    let m = &reject.message;
    assert!(
        m.starts_with("the server gave up its search for a compatible stack after ")
            && m.ends_with(
                " steps (at its step or work limit): offer fewer or more distinct options"
            ),
        "{m}"
    );
    // The same hello with the default limits is accepted (§12.2).
    let server = Server::new(server_tree().offer_tree());
    expect_accept(server.handle_hello(&hello_1rtt().encode()));
}

#[test]
fn a_dictated_hello_carries_one_listed_option() {
    let server = Server::new(server_tree().offer_tree());
    let registry = |offers: OfferTree| Hello {
        offers,
        dictated: true,
        ..hello_1rtt()
    };
    let json = StackOption {
        chunnels: vec![info("ser/json/1", Capability::exact("serialize", ["json"]))],
        pick: Pick::default(),
    };
    let (accept, si, _, _) =
        expect_accept(server.handle_hello(&registry(vec![json.clone()].into()).encode()));
    assert_eq!((accept.client_pick, si), (Pick::default(), 0));
    // Not an OPTIONS node with exactly one option: malformed.
    for offers in [
        client_tree().offer_tree(),
        Json.offer_tree(),
        OfferTree::Options(vec![json.clone(), json]),
    ] {
        let (reject, _) = expect_reject(server.handle_hello(&registry(offers).encode()));
        assert_eq!(reject.reason, RejectReason::Malformed);
    }
}

// ---------------------------------------------------------------------------------------
// The prose: versioning and the server's decisions.

#[test]
fn server_answers_other_versions_with_a_version_reject() {
    assert_eq!(VERSION, 2);
    let server = Server::new(server_tree().offer_tree());
    for v in [1u8, 0, 3, 0xff] {
        let mut other = hello_1rtt().encode().to_vec();
        other[1] = v;
        // Whatever follows the conn_id: the server does not read it (a version-1 hello
        // carries a flat list of offers there, which is no offer tree).
        other.truncate(11);
        other.push(0xee);
        let (reject, response) = expect_reject(server.handle_hello(&other));
        assert_eq!(
            reject,
            Reject {
                version: VERSION,
                conn_id: HELLO_1RTT_ID,
                reason: RejectReason::Version,
                mismatches: Vec::new(),
                message: format!("server speaks version 2, hello has {v}"),
                too_large: None,
            }
        );
        assert_eq!(response, reject.encode());
        assert_eq!(response[1], 2, "the version reject is encoded in version 2");
    }

    // Too short to hold a conn_id: 0.
    let (reject, _) = expect_reject(server.handle_hello(&[0x01, 0x01, 0x00]));
    assert_eq!((reject.reason, reject.conn_id), (RejectReason::Version, 0));

    // A client handed a reject of another version (what a version-1 server answers a
    // version-2 hello) ends its handshake with a version error, whatever the reject says.
    let t0 = Instant::now();
    let mut hs =
        ClientHandshake::new(client_tree().offer_tree(), None, 5, Timing::default(), t0).unwrap();
    assert!(hs.poll_transmit(t0).is_some());
    let v1 = Reject {
        version: 1,
        conn_id: 5,
        reason: RejectReason::Version,
        mismatches: Vec::new(),
        message: "server speaks version 1, hello has 2".into(),
        too_large: None,
    }
    .encode();
    assert_eq!(&v1[..2], &[0x03, 0x01]);
    hs.handle_message(v1);
    assert!(matches!(
        hs.poll_outcome(),
        Some(Err(chunnel_negotiate::Error::Version {
            ours: 2,
            theirs: 1
        }))
    ));
    // An accept of another version is ignored.
    let mut hs =
        ClientHandshake::new(client_tree().offer_tree(), None, 5, Timing::default(), t0).unwrap();
    assert!(hs.poll_transmit(t0).is_some());
    let ours = Hello {
        conn_id: 5,
        ..hello_1rtt()
    };
    let mut accept = expect_accept(server.handle_hello(&ours.encode()))
        .3
        .to_vec();
    accept[1] = 1;
    hs.handle_message(Bytes::from(accept));
    assert!(hs.poll_outcome().is_none());

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
