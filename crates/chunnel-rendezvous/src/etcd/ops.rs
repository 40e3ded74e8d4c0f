//! The [`Store`](crate::store::Store) operations, each one etcd `Txn`: a compare-and-swap on
//! the keys it read, retried when the group changed in between.

use std::time::Duration;

use bytes::Bytes;
use etcd_client::{
    Compare, CompareOp, DeleteOptions, GetOptions, GetResponse, KeyValue, PutOptions, Txn, TxnOp,
    TxnOpResponse, TxnResponse,
};

use crate::Error;
use crate::store::{Ballot, JoinReply, Member, Outcome, Snapshot, Store, Transition, check_name};

use super::cluster::{Retry, backoff};
use super::lease::{Granted, ttl_secs};
use super::record::{Keys, Meta, READ_OPS, Record, decode_transition, encode_transition};
use super::{BACKEND, EtcdStore, MAX_TTL_SECS};

impl EtcdStore {
    /// Reads `keys` in one `Txn` (one revision).
    pub(super) async fn get_keys<const N: usize>(
        &self,
        keys: [&str; N],
    ) -> Result<[Option<KeyValue>; N], Error> {
        self.get_keys_with(keys, false).await
    }

    /// Reads `keys` in one `Txn` (one revision); if `local`, a serializable read (answered by
    /// the member asked, from what it has applied, without a round through the leader): for
    /// the read a compare-and-swap compares against, where a stale answer only fails the
    /// compare.
    pub(super) async fn get_keys_with<const N: usize>(
        &self,
        keys: [&str; N],
        local: bool,
    ) -> Result<[Option<KeyValue>; N], Error> {
        let options = || local.then(|| GetOptions::new().with_serializable());
        let ops: Vec<TxnOp> = keys.iter().map(|k| TxnOp::get(*k, options())).collect();
        let resp = self.txn(&Txn::new().and_then(ops), Retry::Always).await?;
        let gets = ranges(&resp, 0, N)?;
        let mut out = [const { None }; N];
        for (slot, get) in out.iter_mut().zip(gets) {
            *slot = get.kvs().first().cloned();
        }
        Ok(out)
    }

    /// Reads the whole group record in one `Txn`.
    async fn read(&self, k: &Keys) -> Result<Record, Error> {
        self.read_with(k, false).await
    }

    /// [`Self::read`], serializable if `local` (see [`Self::get_keys_with`]).
    async fn read_with(&self, k: &Keys, local: bool) -> Result<Record, Error> {
        let resp = self
            .txn(&Txn::new().and_then(k.read_ops_with(local)), Retry::Always)
            .await?;
        Record::decode(k, &ranges(&resp, 0, READ_OPS)?)
    }

    /// The compare-and-swap loop of [`Store::join`]; `granted` is the lease granted for the
    /// member (at most once, reused by every attempt).
    async fn join_attempts(
        &self,
        k: &Keys,
        member: &Member,
        // The stack to create the group with if it has none, and the epoch to create it at.
        propose: Option<(&Bytes, u64)>,
        expect_epoch: Option<u64>,
        ttl: i64,
        granted: &mut Granted,
    ) -> Result<JoinReply, Error> {
        let member_key = k.member(&member.id);
        // The group's record outlives every member by the grace period.
        let need = self
            .effective_ttl(ttl)
            .saturating_add(self.grace_secs)
            .min(MAX_TTL_SECS);
        for attempt in 0..Self::MAX_ATTEMPTS {
            backoff(attempt).await;
            let rec = self.read(k).await?;
            let create = match (&rec.snap.committed, propose) {
                (None, Some(proposal)) => Some(proposal),
                (Some(c), _) if Some(c.epoch) == expect_epoch => None,
                _ => return Ok(JoinReply::Current(rec.snap)),
            };
            if create.is_none() && !self.ensure_group_lease(k, rec.meta_lease, need).await? {
                continue;
            }
            let lease = match granted.member {
                Some(id) => id,
                None => *granted.member.insert(self.grant(ttl).await?),
            };
            let (member_rev, old_lease) = rec.member_key(&member.id);
            let mut ops = Vec::with_capacity(2 + READ_OPS);
            if let Some((stack, create_epoch)) = create {
                let group_lease = match granted.group {
                    Some(id) => id,
                    None => *granted.group.insert(self.grant(need).await?),
                };
                let meta = Meta {
                    epoch: create_epoch.max(1),
                    stack: stack.clone(),
                    outcome: None,
                };
                ops.push(TxnOp::put(
                    k.meta.as_str(),
                    meta.encode(),
                    Some(PutOptions::new().with_lease(group_lease)),
                ));
            }
            ops.push(TxnOp::put(
                member_key.as_str(),
                member.addr.as_str(),
                Some(PutOptions::new().with_lease(lease)),
            ));
            let writes = ops.len();
            ops.extend(k.read_ops());
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(k.meta.as_str(), CompareOp::Equal, rec.meta_rev),
                    Compare::mod_revision(member_key.as_str(), CompareOp::Equal, member_rev),
                ])
                .and_then(ops);
            let resp = self.txn(&txn, Retry::IfNotApplied).await?;
            if !resp.succeeded() {
                continue;
            }
            if old_lease != 0 && old_lease != lease {
                // The member re-joined: its key moved to the new lease.
                self.revoke_quietly(old_lease).await;
            }
            let after = Record::decode(k, &ranges(&resp, writes, READ_OPS)?)?;
            return Ok(if create.is_some() {
                JoinReply::Created(after.snap)
            } else {
                JoinReply::Joined(after.snap)
            });
        }
        Err(contended(k))
    }

    /// The loop of [`Store::renew`] for member `id`: keeps its lease alive (moving its key,
    /// and its ballot, to a fresh lease if it asks for another duration), then the group's.
    async fn renew_attempts(&self, k: &Keys, id: &str, ttl: i64) -> Result<bool, Error> {
        let (key, ballot_key) = (k.member(id), k.ballot(id));
        let key = key.as_str();
        let need = self
            .effective_ttl(ttl)
            .saturating_add(self.grace_secs)
            .min(MAX_TTL_SECS);
        for attempt in 0..Self::MAX_ATTEMPTS {
            backoff(attempt).await;
            let [Some(kv), meta, ballot] = self.get_keys([key, &k.meta, &ballot_key]).await? else {
                return Ok(false);
            };
            let lease = kv.lease();
            if lease == 0 {
                return Err(Error::Corrupt("a member key is not attached to a lease"));
            }
            match self.keep_alive(lease).await? {
                Some((granted, keys)) if keys.iter().any(|k| k == key.as_bytes()) => {
                    if granted == self.effective_ttl(ttl) {
                        // Renewed, and the key is still on that lease: now the group's.
                        self.renew_group(k, meta.as_ref(), need).await?;
                        return Ok(true);
                    }
                    // Another duration than the lease has: move the key (and the member's
                    // ballot) to a fresh lease, provided they did not change since we read
                    // them.
                    let fresh = self.grant(ttl).await?;
                    let on_fresh = || Some(PutOptions::new().with_lease(fresh));
                    let mut ops = vec![TxnOp::put(key, kv.value(), on_fresh())];
                    if let Some(b) = &ballot {
                        ops.push(TxnOp::put(ballot_key.as_str(), b.value(), on_fresh()));
                    }
                    let txn = Txn::new()
                        .when([
                            Compare::mod_revision(key, CompareOp::Equal, kv.mod_revision()),
                            Compare::mod_revision(
                                ballot_key.as_str(),
                                CompareOp::Equal,
                                mod_rev(&ballot),
                            ),
                        ])
                        .and_then(ops);
                    match self.txn(&txn, Retry::IfNotApplied).await {
                        Ok(r) if r.succeeded() => {
                            self.revoke_quietly(lease).await;
                            if let Some(m) = &meta {
                                // The group must outlive the new lease too.
                                self.ensure_group_lease(k, m.lease(), need).await?;
                            }
                            return Ok(true);
                        }
                        Ok(_) => self.revoke_quietly(fresh).await,
                        Err(e) => {
                            self.revoke_quietly(fresh).await;
                            return Err(e);
                        }
                    }
                }
                _ => {
                    // The lease is gone (the key is being deleted with it) or the key left it
                    // (deleted, or moved to another lease by a concurrent join): look again.
                    match self.get_keys([key]).await? {
                        [Some(now)] if now.lease() != lease => continue,
                        _ => return Ok(false),
                    }
                }
            }
        }
        Err(contended(k))
    }
}

impl Store for EtcdStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn join_creating_at(
        &self,
        group: &str,
        member: &Member,
        propose: Option<&Bytes>,
        expect_epoch: Option<u64>,
        create_epoch: u64,
        lease: Duration,
    ) -> Result<JoinReply, Error> {
        let k = Keys::new(group)?;
        check_name("member id", &member.id)?;
        let mut granted = Granted::default();
        let out = self
            .join_attempts(
                &k,
                member,
                propose.map(|p| (p, create_epoch)),
                expect_epoch,
                ttl_secs(lease),
                &mut granted,
            )
            .await;
        // Leases not attached to the keys (or maybe attached by a `Txn` whose answer was
        // lost: revoking them then removes the half-added member or group, matching the error).
        let unused = match &out {
            Ok(JoinReply::Created(_)) => [None, None],
            Ok(JoinReply::Joined(_)) => [None, granted.group],
            _ => [granted.member, granted.group],
        };
        for id in unused.into_iter().flatten() {
            self.revoke_quietly(id).await;
        }
        out
    }

    async fn renew(&self, group: &str, member_id: &str, lease: Duration) -> Result<bool, Error> {
        let k = Keys::new(group)?;
        check_name("member id", member_id)?;
        self.renew_attempts(&k, member_id, ttl_secs(lease)).await
    }

    async fn leave(&self, group: &str, member_id: &str) -> Result<(), Error> {
        let k = Keys::new(group)?;
        check_name("member id", member_id)?;
        let txn = Txn::new().and_then([
            TxnOp::delete(
                k.member(member_id),
                Some(DeleteOptions::new().with_prev_key()),
            ),
            TxnOp::delete(k.ballot(member_id), None),
        ]);
        // Deleting twice is harmless: repeated after any member failure.
        let resp = self.txn(&txn, Retry::Always).await?;
        // Revoke the member's lease too (it has no other key), so etcd forgets it now.
        for r in resp.op_responses() {
            if let TxnOpResponse::Delete(d) = r {
                for kv in d.prev_kvs().iter().filter(|kv| kv.lease() != 0) {
                    self.revoke_quietly(kv.lease()).await;
                }
            }
        }
        Ok(())
    }

    async fn snapshot(&self, group: &str) -> Result<Snapshot, Error> {
        let k = Keys::new(group)?;
        Ok(self.read(&k).await?.snap)
    }

    async fn propose(&self, group: &str, t: &Transition) -> Result<bool, Error> {
        let k = Keys::new(group)?;
        check_name("member id", &t.proposer)?;
        let record = encode_transition(t);
        // The first read is local (the proposer proposes from the epoch it read, so the
        // member its client talks to has it): a stale answer only fails the compare, and a
        // refusal is confirmed by a linearizable read.
        let mut local = true;
        let mut attempt = 0;
        while attempt < Self::MAX_ATTEMPTS {
            backoff(attempt).await;
            let [meta, pending] = self.get_keys_with([&k.meta, &k.transition], local).await?;
            let epoch = match &meta {
                Some(kv) => Meta::decode(kv.value())?.epoch,
                None => 0,
            };
            if pending.is_some() || t.from_epoch == 0 || epoch != t.from_epoch {
                if std::mem::take(&mut local) {
                    continue;
                }
                return Ok(false);
            }
            local = false;
            attempt += 1;
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(k.meta.as_str(), CompareOp::Equal, mod_rev(&meta)),
                    Compare::mod_revision(k.transition.as_str(), CompareOp::Equal, 0),
                ])
                .and_then([
                    TxnOp::put(
                        k.transition.as_str(),
                        record.clone(),
                        Some(
                            PutOptions::new().with_lease(meta.as_ref().map_or(0, KeyValue::lease)),
                        ),
                    ),
                    TxnOp::delete(k.ballots.as_str(), Some(DeleteOptions::new().with_prefix())),
                ]);
            if self.txn(&txn, Retry::IfNotApplied).await?.succeeded() {
                return Ok(true);
            }
        }
        Err(contended(&k))
    }

    async fn vote(
        &self,
        group: &str,
        id: u64,
        member_id: &str,
        ballot: &Ballot,
    ) -> Result<bool, Error> {
        let k = Keys::new(group)?;
        check_name("member id", member_id)?;
        let value = format!("{id:016x}:{}", ballot.encode());
        let member_key = k.member(member_id);
        // The first read is local (the participant votes on a proposal its watch on the same
        // member announced, so that member has it); an answer that it is not pending is
        // confirmed by a linearizable read before the vote is refused.
        let mut local = true;
        let mut attempt = 0;
        while attempt < Self::MAX_ATTEMPTS {
            backoff(attempt).await;
            let [pending, me] = self
                .get_keys_with([&k.transition, &member_key], local)
                .await?;
            let pending = pending
                .map(|p| decode_transition(p.value()).map(|t| (p, t.id)))
                .transpose()?;
            let Some((pending, _)) = pending.filter(|(_, tid)| *tid == id) else {
                if std::mem::take(&mut local) {
                    continue;
                }
                return Ok(false);
            };
            local = false;
            attempt += 1;
            // The ballot lives on the voter's lease (it goes with the voter), or, from a
            // non-member, on the group's.
            let lease = me.as_ref().map_or(pending.lease(), KeyValue::lease);
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(
                        k.transition.as_str(),
                        CompareOp::Equal,
                        pending.mod_revision(),
                    ),
                    Compare::mod_revision(member_key.as_str(), CompareOp::Equal, mod_rev(&me)),
                ])
                .and_then([TxnOp::put(
                    k.ballot(member_id),
                    value.as_str(),
                    Some(PutOptions::new().with_lease(lease)),
                )]);
            if self.txn(&txn, Retry::IfNotApplied).await?.succeeded() {
                return Ok(true);
            }
        }
        Err(contended(&k))
    }

    async fn finish_attested(
        &self,
        group: &str,
        id: u64,
        commit: bool,
        attested: &[String],
    ) -> Result<bool, Error> {
        let k = Keys::new(group)?;
        // The first read is local (the finisher decided on a read at least as recent, on the
        // same member); a refusal is confirmed by a linearizable read.
        let mut local = true;
        let mut attempt = 0;
        while attempt < Self::MAX_ATTEMPTS {
            backoff(attempt).await;
            // One read at one revision: the record, and the ballots of the members live then.
            let rec = self.read_with(&k, local).await?;
            let t = rec.snap.transition.clone().filter(|t| t.id == id);
            let Some(t) = t.filter(|_| !commit || rec.snap.all_live_yes_with(attested)) else {
                if std::mem::take(&mut local) {
                    continue;
                }
                return Ok(false);
            };
            local = false;
            attempt += 1;
            let mut ops = Vec::with_capacity(3);
            if let Some(c) = &rec.snap.committed {
                let (epoch, stack) = match commit && c.epoch == t.from_epoch {
                    true => (t.from_epoch + 1, t.stack),
                    false => (c.epoch, c.stack.clone()),
                };
                let meta = Meta {
                    epoch,
                    stack,
                    outcome: Some(Outcome {
                        id,
                        committed: commit,
                    }),
                };
                ops.push(TxnOp::put(
                    k.meta.as_str(),
                    meta.encode(),
                    Some(PutOptions::new().with_lease(rec.meta_lease)),
                ));
            }
            ops.push(TxnOp::delete(k.transition.as_str(), None));
            ops.push(TxnOp::delete(
                k.ballots.as_str(),
                Some(DeleteOptions::new().with_prefix()),
            ));
            let mut when = vec![
                Compare::mod_revision(k.meta.as_str(), CompareOp::Equal, rec.meta_rev),
                Compare::mod_revision(k.transition.as_str(), CompareOp::Equal, rec.transition_rev),
            ];
            // A commit needs every live member's yes at the moment it is written: no member
            // and no ballot may have changed since the read.
            if commit {
                for prefix in [k.members(), k.ballots.as_str()] {
                    when.push(
                        Compare::mod_revision(prefix, CompareOp::Less, rec.revision + 1)
                            .with_prefix(),
                    );
                }
            }
            let txn = Txn::new().when(when).and_then(ops);
            if self.txn(&txn, Retry::IfNotApplied).await?.succeeded() {
                return Ok(true);
            }
        }
        Err(contended(&k))
    }

    /// A watch on the group's keys but its ballots (see "Notifications" in the module docs).
    fn watch(&self, group: &str) -> Option<crate::store::Watch> {
        crate::store::check_name("group name", group).ok()?;
        Some(self.watch_group(group))
    }

    /// A watch on the group's ballots.
    fn watch_ballots(&self, group: &str) -> Option<crate::store::Watch> {
        crate::store::check_name("group name", group).ok()?;
        Some(self.watch_group_ballots(group))
    }
}

/// The range answers `resp.op_responses()[skip..skip + n]`.
fn ranges(resp: &TxnResponse, skip: usize, n: usize) -> Result<Vec<GetResponse>, Error> {
    let gets: Vec<GetResponse> = resp
        .op_responses()
        .into_iter()
        .skip(skip)
        .filter_map(|r| match r {
            TxnOpResponse::Get(g) => Some(g),
            _ => None,
        })
        .collect();
    if gets.len() != n {
        return Err(Error::unavailable(
            BACKEND,
            format!(
                "etcd answered a transaction with {} reads, not {n}",
                gets.len()
            ),
        ));
    }
    Ok(gets)
}

pub(super) fn mod_rev(kv: &Option<KeyValue>) -> i64 {
    kv.as_ref().map_or(0, KeyValue::mod_revision)
}

fn contended(k: &Keys) -> Error {
    Error::Contended {
        group: k.group.clone(),
        attempts: EtcdStore::MAX_ATTEMPTS,
    }
}
