//! Leases: granting, keeping alive and revoking them, and the group lease that keeps a
//! group's record alive for lease + grace.

use std::sync::atomic::Ordering;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, KeyValue, LeaseTimeToLiveOptions, PutOptions, Txn, TxnOp};

use crate::Error;

use super::cluster::Retry;
use super::ops::mod_rev;
use super::record::Keys;
use super::{EtcdStore, MAX_TTL_SECS};

impl EtcdStore {
    /// Grants a lease of `ttl` seconds (repeated after any failure: a lease granted twice
    /// only lives out its TTL unused).
    pub(super) async fn grant(&self, ttl: i64) -> Result<i64, Error> {
        let resp = self
            .call(Retry::Always, |mut c| async move {
                c.lease_grant(ttl, None).await
            })
            .await?;
        if resp.ttl() > ttl {
            // etcd raised it to its minimum TTL.
            self.min_ttl.fetch_max(resp.ttl(), Ordering::Relaxed);
        }
        Ok(resp.id())
    }

    /// The TTL a lease granted for `ttl` seconds gets.
    pub(super) fn effective_ttl(&self, ttl: i64) -> i64 {
        ttl.max(self.min_ttl.load(Ordering::Relaxed))
    }

    /// Revokes a lease whose keys are gone or that no key uses; failures only cost the lease
    /// living out its TTL, so they are logged, not returned.
    pub(super) async fn revoke_quietly(&self, id: i64) {
        let res = self
            .call(
                Retry::Always,
                |mut c| async move { c.lease_revoke(id).await },
            )
            .await;
        if let Err(e) = res {
            tracing::debug!(lease = id, error = %e, "could not revoke an unused etcd lease");
        }
    }

    /// Sends one keep-alive for lease `id`, then reads the lease back: `None` if etcd does not
    /// know it (expired or revoked), else its granted TTL and the keys attached to it.
    pub(super) async fn keep_alive(&self, id: i64) -> Result<Option<(i64, Vec<Vec<u8>>)>, Error> {
        if !self.keep_alive_once(id).await? {
            return Ok(None);
        }
        // The keep-alive answer (with the TTL) is consumed by the library: ask again.
        let resp = self
            .call(Retry::Always, |mut c| async move {
                let keys = LeaseTimeToLiveOptions::new().with_keys();
                c.lease_time_to_live(id, Some(keys)).await
            })
            .await?;
        Ok((resp.ttl() > 0).then(|| (resp.granted_ttl(), resp.keys().to_vec())))
    }

    /// Sends one keep-alive for lease `id`: `false` if etcd does not know it (expired or
    /// revoked).
    async fn keep_alive_once(&self, id: i64) -> Result<bool, Error> {
        // Renewing twice is harmless: repeated after any failure.
        self.call(Retry::Always, |c| async move {
            let mut lease = c.lease_client();
            // The library sends the first keep-alive and reads its answer itself; it fails
            // with `LeaseKeepAliveError` (and nothing else) when etcd answers with TTL 0,
            // i.e. does not know the lease. The stream closes when dropped.
            match lease.keep_alive(id).await {
                Ok(_) => Ok(true),
                Err(etcd_client::Error::LeaseKeepAliveError(_)) => Ok(false),
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// Makes sure the group's record (`meta` and `transition`) lives on a lease of at least
    /// `need` seconds, `lease` being the one `meta` was read with (0: none): keeps it alive
    /// if it is long enough, else moves both keys to a fresh lease of `need` seconds (a
    /// compare-and-swap on both) and revokes the old one, which then holds no key.
    ///
    /// `Ok(true)`: kept alive, nothing written. `Ok(false)`: the record moved (by us or by a
    /// concurrent operation) or is gone: a caller comparing `meta`'s revision must read again.
    pub(super) async fn ensure_group_lease(
        &self,
        k: &Keys,
        lease: i64,
        need: i64,
    ) -> Result<bool, Error> {
        if lease != 0
            && let Some((granted, _)) = self.keep_alive(lease).await?
            && granted >= self.effective_ttl(need)
        {
            return Ok(true);
        }
        let fresh = self.grant(need).await?;
        let [meta, transition] = self.get_keys([&k.meta, &k.transition]).await?;
        let Some(meta) = meta.filter(|m| m.lease() == lease) else {
            // Gone, or moved by someone else meanwhile.
            self.revoke_quietly(fresh).await;
            return Ok(false);
        };
        let on_fresh = || Some(PutOptions::new().with_lease(fresh));
        let mut ops = vec![TxnOp::put(k.meta.as_str(), meta.value(), on_fresh())];
        if let Some(t) = &transition {
            ops.push(TxnOp::put(k.transition.as_str(), t.value(), on_fresh()));
        }
        let txn = Txn::new()
            .when([
                Compare::mod_revision(k.meta.as_str(), CompareOp::Equal, meta.mod_revision()),
                Compare::mod_revision(
                    k.transition.as_str(),
                    CompareOp::Equal,
                    mod_rev(&transition),
                ),
            ])
            .and_then(ops);
        match self.txn(&txn, Retry::IfNotApplied).await {
            Ok(r) if r.succeeded() => {
                if lease != 0 {
                    self.revoke_quietly(lease).await;
                }
            }
            Ok(_) => self.revoke_quietly(fresh).await,
            Err(e) => {
                self.revoke_quietly(fresh).await;
                return Err(e);
            }
        }
        Ok(false)
    }

    /// Keeps the group's record alive after one of its members renewed (`meta` as read; a
    /// record on no lease, or on an unknown one, is moved to a fresh lease of `need` seconds).
    pub(super) async fn renew_group(
        &self,
        k: &Keys,
        meta: Option<&KeyValue>,
        need: i64,
    ) -> Result<(), Error> {
        let Some(meta) = meta else {
            return Ok(());
        };
        if meta.lease() != 0 && self.keep_alive_once(meta.lease()).await? {
            return Ok(());
        }
        self.ensure_group_lease(k, meta.lease(), need)
            .await
            .map(drop)
    }
}

/// The leases [`EtcdStore::join_attempts`] granted (at most one each, reused by every attempt).
#[derive(Default)]
pub(super) struct Granted {
    /// For the member key.
    pub(super) member: Option<i64>,
    /// For the group's record, when creating it.
    pub(super) group: Option<i64>,
}

/// `lease` in whole seconds, rounded up, within what etcd grants.
pub(super) fn ttl_secs(lease: Duration) -> i64 {
    let secs = lease.as_millis().div_ceil(1000);
    i64::try_from(secs).map_or(MAX_TTL_SECS, |s| s.clamp(1, MAX_TTL_SECS))
}
