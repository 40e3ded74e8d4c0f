//! A group's record in etcd: its keys, and the binary codec of `meta`, `transition` and
//! ballots (see the key layout in the module docs).

use bytes::Bytes;
use etcd_client::{GetOptions, GetResponse, KeyValue, TxnOp};

use crate::Error;
use crate::ballot::BallotBox;
use crate::store::{Ballot, Committed, Member, Outcome, Snapshot, Transition, check_name};

use super::BACKEND;

/// The keys of one group.
pub(super) struct Keys {
    pub(super) group: String,
    pub(super) meta: String,
    pub(super) transition: String,
    /// Prefix of the member keys (ends with `/`).
    members: String,
    /// Prefix of the ballot keys (ends with `/`).
    pub(super) ballots: String,
}

/// How many range operations [`Keys::read_ops`] makes.
pub(super) const READ_OPS: usize = 4;

impl Keys {
    pub(super) fn new(group: &str) -> Result<Keys, Error> {
        check_name("group name", group)?;
        Ok(Keys {
            group: group.to_owned(),
            meta: format!("chunnel/{group}/meta"),
            transition: format!("chunnel/{group}/transition"),
            members: format!("chunnel/{group}/members/"),
            ballots: format!("chunnel/{group}/ballots/"),
        })
    }

    /// The prefix of the member keys.
    pub(super) fn members(&self) -> &str {
        &self.members
    }

    pub(super) fn member(&self, id: &str) -> String {
        format!("{}{id}", self.members)
    }

    pub(super) fn ballot(&self, id: &str) -> String {
        format!("{}{id}", self.ballots)
    }

    /// The range reads of the whole record, in the order [`Record::decode`] expects.
    pub(super) fn read_ops(&self) -> [TxnOp; READ_OPS] {
        self.read_ops_with(false)
    }

    /// [`Keys::read_ops`], serializable if `local` (see `EtcdStore::get_keys_with`).
    pub(super) fn read_ops_with(&self, local: bool) -> [TxnOp; READ_OPS] {
        let options = || {
            let o = GetOptions::new();
            if local { o.with_serializable() } else { o }
        };
        let prefix = || Some(options().with_prefix());
        [
            TxnOp::get(self.meta.as_str(), Some(options())),
            TxnOp::get(self.transition.as_str(), Some(options())),
            TxnOp::get(self.members.as_str(), prefix()),
            TxnOp::get(self.ballots.as_str(), prefix()),
        ]
    }
}

/// A group record as read, with the revisions the compare-and-swaps compare against.
pub(super) struct Record {
    pub(super) snap: Snapshot,
    /// `mod_revision` of the meta key, 0 if absent.
    pub(super) meta_rev: i64,
    /// `mod_revision` of the pending transition's key, 0 if none.
    pub(super) transition_rev: i64,
    /// The lease the meta key is attached to (the group's lease), 0 if none.
    pub(super) meta_lease: i64,
    /// (member id, `mod_revision`, lease) of each member key.
    member_keys: Vec<(String, i64, i64)>,
    /// The store revision the read saw.
    pub(super) revision: i64,
}

impl Record {
    /// Decodes the answers to [`Keys::read_ops`].
    pub(super) fn decode(k: &Keys, gets: &[GetResponse]) -> Result<Record, Error> {
        let [meta, transition, members, ballots] = gets else {
            return Err(Error::unavailable(
                BACKEND,
                "etcd answered a read with a wrong shape",
            ));
        };
        let mut snap = Snapshot::default();
        let meta_kv = meta.kvs().first();
        if let Some(kv) = meta_kv {
            let m = Meta::decode(kv.value())?;
            snap.committed = Some(Committed {
                epoch: m.epoch,
                stack: m.stack,
            });
            snap.outcome = m.outcome;
        }
        if let Some(kv) = transition.kvs().first() {
            snap.transition = Some(decode_transition(kv.value())?);
        }
        let mut member_keys = Vec::with_capacity(members.kvs().len());
        for kv in members.kvs() {
            let id = suffix(
                kv.key(),
                &k.members,
                "a member key is not a valid member id",
            )?;
            let addr = std::str::from_utf8(kv.value())
                .map_err(|_| Error::Corrupt("a member address is not UTF-8"))?;
            snap.members.push(Member {
                id: id.clone(),
                addr: addr.to_owned(),
            });
            member_keys.push((id, kv.mod_revision(), kv.lease()));
        }
        snap.members.sort_by(|a, b| a.id.cmp(&b.id));
        if let Some(t) = &snap.transition {
            for kv in ballots.kvs() {
                let id = suffix(
                    kv.key(),
                    &k.ballots,
                    "a ballot key is not a valid member id",
                )?;
                let (tid, ballot) = decode_ballot(kv.value())?;
                // Ballots are deleted with their transition; one on another id is stale.
                if tid == t.id {
                    snap.ballots.push((id, ballot));
                }
            }
            snap.ballots.sort_by(|a, b| a.0.cmp(&b.0));
        }
        Ok(Record {
            snap,
            meta_rev: meta_kv.map_or(0, KeyValue::mod_revision),
            transition_rev: transition.kvs().first().map_or(0, KeyValue::mod_revision),
            meta_lease: meta_kv.map_or(0, KeyValue::lease),
            member_keys,
            revision: meta.header().map_or(0, |h| h.revision()),
        })
    }

    /// (`mod_revision`, lease) of `id`'s member key, (0, 0) if absent.
    pub(super) fn member_key(&self, id: &str) -> (i64, i64) {
        self.member_keys
            .iter()
            .find(|(m, _, _)| m == id)
            .map_or((0, 0), |&(_, rev, lease)| (rev, lease))
    }
}

/// The committed stack and last outcome, as stored under `chunnel/<g>/meta`.
pub(super) struct Meta {
    pub(super) epoch: u64,
    pub(super) stack: Bytes,
    pub(super) outcome: Option<Outcome>,
}

/// Format version of the binary records.
const RECORD_V1: u8 = 1;
/// Format version of a transition record with a ballot box (docs/wire.md §15.4); one without
/// is written as version 1.
const RECORD_V2: u8 = 2;

impl Meta {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(18 + self.stack.len());
        out.push(RECORD_V1);
        out.extend_from_slice(&self.epoch.to_be_bytes());
        let (tag, id) = match self.outcome {
            None => (0, 0),
            Some(o) => (if o.committed { 2 } else { 1 }, o.id),
        };
        out.push(tag);
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(&self.stack);
        out
    }

    pub(super) fn decode(b: &[u8]) -> Result<Meta, Error> {
        let mut r = Reader::new(
            b,
            "a group's meta record is truncated or of an unknown format",
        );
        r.version()?;
        let epoch = r.u64()?;
        let tag = r.u8()?;
        let id = r.u64()?;
        let outcome = match tag {
            0 => None,
            1 | 2 => Some(Outcome {
                id,
                committed: tag == 2,
            }),
            _ => return Err(Error::Corrupt("a group's outcome tag is not 0, 1 or 2")),
        };
        Ok(Meta {
            epoch,
            stack: Bytes::copy_from_slice(r.rest()),
            outcome,
        })
    }
}

/// The stored form of a pending transition (the proposer is at most 128 bytes, checked).
/// A ballot box makes it version 2, with the box's stored form
/// ([`crate::ballot::BallotBox::encode`], length-prefixed) after the proposer.
pub(super) fn encode_transition(t: &Transition) -> Vec<u8> {
    let bb = t.ballot_box.map(|b| b.encode());
    let mut out = Vec::with_capacity(
        29 + t.proposer.len() + t.stack.len() + bb.as_ref().map_or(0, String::len),
    );
    out.push(if bb.is_some() { RECORD_V2 } else { RECORD_V1 });
    out.extend_from_slice(&t.id.to_be_bytes());
    out.extend_from_slice(&t.from_epoch.to_be_bytes());
    out.extend_from_slice(&t.deadline_ms.to_be_bytes());
    out.extend_from_slice(&(t.proposer.len() as u16).to_be_bytes());
    out.extend_from_slice(t.proposer.as_bytes());
    if let Some(bb) = &bb {
        out.extend_from_slice(&(bb.len() as u16).to_be_bytes());
        out.extend_from_slice(bb.as_bytes());
    }
    out.extend_from_slice(&t.stack);
    out
}

pub(super) fn decode_transition(b: &[u8]) -> Result<Transition, Error> {
    let mut r = Reader::new(
        b,
        "a transition record is truncated or of an unknown format",
    );
    let version = r.u8()?;
    if version != RECORD_V1 && version != RECORD_V2 {
        return Err(Error::Corrupt(r.corrupt));
    }
    let id = r.u64()?;
    let from_epoch = r.u64()?;
    let deadline_ms = r.u64()?;
    let len = u16::from_be_bytes([r.u8()?, r.u8()?]);
    let proposer = std::str::from_utf8(r.take(usize::from(len))?)
        .map_err(|_| Error::Corrupt("a transition's proposer is not UTF-8"))?
        .to_owned();
    let ballot_box = if version == RECORD_V2 {
        let len = u16::from_be_bytes([r.u8()?, r.u8()?]);
        let bb = std::str::from_utf8(r.take(usize::from(len))?)
            .map_err(|_| Error::Corrupt("a transition's ballot box is not UTF-8"))?;
        Some(BallotBox::decode(bb)?)
    } else {
        None
    };
    Ok(Transition {
        id,
        from_epoch,
        proposer,
        stack: Bytes::copy_from_slice(r.rest()),
        deadline_ms,
        ballot_box,
    })
}

/// Reads `<16 hex digits>:<ballot>`.
fn decode_ballot(b: &[u8]) -> Result<(u64, Ballot), Error> {
    const BAD: Error = Error::Corrupt("a ballot is not `<transition id>:<ballot>`");
    let s = std::str::from_utf8(b).map_err(|_| BAD)?;
    let (tid, ballot) = s.split_once(':').ok_or(BAD)?;
    let tid = u64::from_str_radix(tid, 16).map_err(|_| BAD)?;
    Ok((tid, Ballot::decode(ballot)?))
}

/// A bounds-checked reader of a stored record.
struct Reader<'a> {
    rest: &'a [u8],
    corrupt: &'static str,
}

impl<'a> Reader<'a> {
    fn new(b: &'a [u8], corrupt: &'static str) -> Reader<'a> {
        Reader { rest: b, corrupt }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        if self.rest.len() < n {
            return Err(Error::Corrupt(self.corrupt));
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }

    fn u64(&mut self) -> Result<u64, Error> {
        let mut b = [0; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(b))
    }

    fn version(&mut self) -> Result<(), Error> {
        match self.u8()? {
            RECORD_V1 => Ok(()),
            _ => Err(Error::Corrupt(self.corrupt)),
        }
    }

    fn rest(self) -> &'a [u8] {
        self.rest
    }
}

/// The id at the end of `key` (after `prefix`), if it is a valid name.
fn suffix(key: &[u8], prefix: &str, corrupt: &'static str) -> Result<String, Error> {
    let id = key
        .strip_prefix(prefix.as_bytes())
        .and_then(|id| std::str::from_utf8(id).ok())
        .ok_or(Error::Corrupt(corrupt))?;
    check_name("member id", id).map_err(|_| Error::Corrupt(corrupt))?;
    Ok(id.to_owned())
}
