//! Writes the seed corpus of the fuzz targets in `fuzz/`: a few valid encodings of each
//! negotiation message.
//!
//! ```text
//! cargo run -p chunnel-negotiate --example wire_seeds -- fuzz/seeds
//! ```
//!
//! writes `<dir>/hello/*`, `<dir>/accept/*` and `<dir>/reject/*` (message bodies: the bytes
//! after the tag, which is what those targets decode) and `<dir>/server/*` (whole hellos, tag
//! included, as `Server::handle_hello` takes them) and `<dir>/accept_data/*` (whole
//! `ACCEPT_DATA` messages, as a client receives them) and `<dir>/commit/*` (reconfiguration
//! scenarios, see `commits`) and `<dir>/stack_record/*` (stack records, docs/wire.md §15.1).
//! The output is deterministic, so
//! re-running it leaves an up-to-date corpus unchanged.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use bytes::Bytes;
use chunnel::negotiate::{ChunnelInfo, Match, Mismatch};
use chunnel::{Capability, OfferTree, Pick, StackOption};
use chunnel_negotiate::wire::{
    Accept, Control, Hello, Prepare, Refusal, Reject, RejectReason, Tag, Txn, VERSION, Verdict,
    Vote, ZeroRtt, encode_control, encode_stack,
};

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

/// Client offers resembling a real `select(serialize json | bincode) + shard` tree.
fn offers() -> Vec<StackOption> {
    vec![
        option(
            &[0],
            vec![
                info("ser/json/1", vec![Capability::exact("serialize", ["json"])]),
                info(
                    "shard/client/1",
                    vec![Capability::compositional("shard", ["a", "b"])],
                ),
            ],
        ),
        option(
            &[1, 0],
            vec![info(
                "ser/bincode/1",
                vec![Capability::exact("serialize", ["bincode"])],
            )],
        ),
        option(&[1, 1], vec![info("chunnel/noop/1", Vec::new())]),
    ]
}

fn hellos() -> Vec<(&'static str, Hello)> {
    let plain = Hello {
        version: VERSION,
        conn_id: 0x0123_4567_89ab_cdef,
        offers: offers().into(),
        zero_rtt: None,
        early: Vec::new(),
        dictated: false,
    };
    let zero_rtt = Hello {
        zero_rtt: Some(Pick::from_branches(vec![1, 0])),
        early: vec![Bytes::from_static(b"hello"), Bytes::from_static(b"")],
        ..plain.clone()
    };
    let incompatible = Hello {
        conn_id: 42,
        offers: OfferTree::Leaf(info(
            "ser/cbor/1",
            vec![Capability::exact("serialize", ["cbor"])],
        )),
        ..plain.clone()
    };
    let empty = Hello {
        conn_id: 0,
        offers: OfferTree::Options(Vec::new()),
        ..plain.clone()
    };
    // A client without a stack of its own: one offer listing the implementations it has.
    let dictated = Hello {
        conn_id: 9,
        offers: OfferTree::Options(vec![option(
            &[],
            vec![
                info("ser/json/1", Vec::new()),
                info("chunnel/noop/1", Vec::new()),
            ],
        )]),
        dictated: true,
        ..plain.clone()
    };
    vec![
        ("plain", plain),
        ("zero-rtt", zero_rtt),
        ("incompatible", incompatible),
        ("empty", empty),
        ("dictated", dictated),
    ]
}

fn accepts() -> Vec<(&'static str, Accept)> {
    let o = offers();
    let base = Accept {
        version: VERSION,
        conn_id: 0x0123_4567_89ab_cdef,
        zero_rtt: ZeroRtt::NotOffered,
        client_pick: o[0].pick.clone(),
        server_pick: Pick::from_branches(vec![0]),
        server_stack: o[0].chunnels.clone().into(),
    };
    vec![
        ("not-offered", base.clone()),
        (
            "accepted",
            Accept {
                zero_rtt: ZeroRtt::Accepted,
                client_pick: o[1].pick.clone(),
                server_stack: o[1].chunnels.clone().into(),
                ..base.clone()
            },
        ),
        (
            "rejected",
            Accept {
                zero_rtt: ZeroRtt::Rejected,
                server_pick: Pick::default(),
                server_stack: Vec::new().into(),
                ..base
            },
        ),
    ]
}

fn rejects() -> Vec<(&'static str, Reject)> {
    let incompatible = Reject {
        version: VERSION,
        conn_id: 42,
        reason: RejectReason::Incompatible,
        mismatches: vec![
            Mismatch {
                client_option: 0,
                server_option: 0,
                kind: "serialize".into(),
                matching: Match::Exact,
                client: Some(vec!["cbor".into()]),
                server: Some(vec!["json".into()]),
            },
            Mismatch {
                client_option: 0,
                server_option: 1,
                kind: "shard".into(),
                matching: Match::Compositional,
                client: None,
                server: Some(vec!["a".into(), "b".into()]),
            },
        ],
        message: "no compatible stack".into(),
        too_large: None,
    };
    let version = Reject {
        conn_id: 7,
        reason: RejectReason::Version,
        mismatches: Vec::new(),
        message: "server speaks version 1, hello has 2".into(),
        ..incompatible.clone()
    };
    let malformed = Reject {
        conn_id: 0,
        reason: RejectReason::Malformed,
        mismatches: Vec::new(),
        message: String::new(),
        ..incompatible.clone()
    };
    let too_large = Reject {
        conn_id: 9,
        reason: RejectReason::TooLarge,
        mismatches: Vec::new(),
        message:
            "hello of 1040 bytes is larger than the 512 bytes this server takes in one message"
                .into(),
        too_large: Some(chunnel_negotiate::wire::TooLarge {
            limit: 512,
            len: 1040,
        }),
        ..incompatible.clone()
    };
    vec![
        ("incompatible", incompatible),
        ("version", version),
        ("malformed", malformed),
        ("too_large", too_large),
    ]
}

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) -> Result<()> {
    let d = dir.join(target);
    fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    let f = d.join(name);
    fs::write(&f, bytes).with_context(|| format!("writing {}", f.display()))?;
    println!("{} ({} bytes)", f.display(), bytes.len());
    Ok(())
}

/// Inputs of the `commit` target: a scenario byte (bit 0: may not initiate, bit 1: refuses
/// the peer, bit 2: proposes txn 42 first, bit 3: time passes), then messages separated by
/// `0xff` (the ids here contain no `0xff` byte).
fn commits() -> Vec<(&'static str, Vec<u8>)> {
    let bincode = StackOption {
        chunnels: vec![info(
            "ser",
            vec![Capability::exact("serialize", ["bincode"])],
        )],
        pick: Pick::from_branches(vec![1]),
    };
    let txn = |t| Txn {
        version: VERSION,
        txn: t,
    };
    let prepare = Prepare {
        version: VERSION,
        txn: 7,
        option: bincode.clone(),
    }
    .encode();
    let yes = Vote {
        version: VERSION,
        txn: 42,
        verdict: Verdict::Yes {
            pick: Pick::from_branches(vec![1]),
            stack: bincode.chunnels.clone(),
        },
    }
    .encode();
    let no = Vote {
        version: VERSION,
        txn: 42,
        verdict: Verdict::No {
            reason: Refusal::NotAllowed,
            mismatches: Vec::new(),
            message: "no".into(),
        },
    }
    .encode();
    let join = |mode: u8, msgs: &[&[u8]]| {
        let mut v = vec![mode];
        for (i, m) in msgs.iter().enumerate() {
            if i > 0 {
                v.push(0xff);
            }
            v.extend_from_slice(m);
        }
        v
    };
    vec![
        (
            "follower-commits",
            join(0, &[&prepare, &txn(7).encode(Tag::Commit)]),
        ),
        (
            "follower-aborted",
            join(0, &[&prepare, &txn(7).encode(Tag::Abort)]),
        ),
        (
            "initiator-switches",
            join(4, &[&yes, &txn(42).encode(Tag::Done)]),
        ),
        ("initiator-refused", join(4, &[&no])),
        ("initiator-times-out", join(12, &[&prepare, &prepare])),
    ]
}

fn main() -> Result<()> {
    let dir: PathBuf = std::env::args_os()
        .nth(1)
        .context("usage: wire_seeds <output directory>")?
        .into();
    for (name, h) in hellos() {
        let enc = h.encode();
        write(&dir, "hello", name, &enc[1..])?;
        write(&dir, "server", name, &enc)?;
    }
    for (name, a) in accepts() {
        write(&dir, "accept", name, &a.encode()[1..])?;
        // Whole ACCEPT_DATA messages (tag included): the accept and a short reply.
        let coalesced = encode_control(&Control::AcceptData(a, Bytes::from_static(b"reply")));
        write(&dir, "accept_data", name, &coalesced)?;
    }
    for (name, r) in rejects() {
        write(&dir, "reject", name, &r.encode()[1..])?;
    }
    for (name, bytes) in commits() {
        write(&dir, "commit", name, &bytes)?;
    }
    // Stack records (what a rendezvous store holds): each offered option, and an empty stack.
    for (i, o) in offers().iter().enumerate() {
        write(
            &dir,
            "stack_record",
            &format!("option{i}"),
            &encode_stack(&o.chunnels),
        )?;
    }
    write(&dir, "stack_record", "empty", &encode_stack(&[]))?;
    Ok(())
}
