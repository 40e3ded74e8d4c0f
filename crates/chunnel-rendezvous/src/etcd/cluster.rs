//! Talking to the cluster: connecting to the endpoints, pinning one and failing over to
//! another, checking that every answer comes from the same cluster, retries with backoff.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::{
    Client, ConnectOptions, LeaseGrantResponse, LeaseRevokeResponse, LeaseTimeToLiveResponse,
    ResponseHeader, StatusResponse, Txn, TxnResponse,
};

use crate::Error;

use super::lease::ttl_secs;
use super::{BACKEND, EtcdStore};

impl EtcdStore {
    /// How long establishing a connection to one member may take.
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

    /// How long one request may take once sent.
    pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

    /// How many times an operation retries its compare-and-swap when the group changed under
    /// it, before failing with [`Error::Contended`].
    pub const MAX_ATTEMPTS: u32 = 64;

    /// An upper bound on any one request, all its routings included, whatever the client
    /// library does (it may wait for a connection, then for the answer).
    const DEADLINE: Duration = Duration::from_secs(5);

    /// How long a group record outlives its last member by default (see
    /// [`EtcdStore::with_grace`]).
    pub const DEFAULT_GRACE: Duration = Duration::from_secs(60);

    /// Creates a client for the cluster at `endpoints` (`http://host:port`; several members
    /// for fault tolerance), and asks every endpoint which cluster it belongs to (all at once,
    /// within [`Self::CONNECT_TIMEOUT`]).
    ///
    /// Fails with [`Error::WrongCluster`] if two endpoints answer for different clusters. An
    /// endpoint that does not answer is skipped (the cluster id is then learnt from the first
    /// answer of any later request); an unreachable cluster shows as [`Error::Unavailable`]
    /// from the first operation. From then on, an answer from another cluster (an endpoint
    /// now served by a different etcd, e.g. a stale one on a reused address) fails its request
    /// with [`Error::WrongCluster`] instead of being believed.
    pub async fn connect(endpoints: &[String]) -> Result<EtcdStore, Error> {
        if endpoints.is_empty() {
            return Err(Error::unavailable(BACKEND, "no endpoints given"));
        }
        // A member cut off from the others answers "no leader" at once instead of letting the
        // request wait for an election.
        let options = ConnectOptions::new()
            .with_connect_timeout(Self::CONNECT_TIMEOUT)
            .with_timeout(Self::REQUEST_TIMEOUT)
            .with_require_leader(true);
        let mut clients = Vec::with_capacity(endpoints.len());
        for e in endpoints {
            let connect = Client::connect([e], Some(options.clone()));
            match tokio::time::timeout(Self::DEADLINE, connect).await {
                Ok(Ok(c)) => clients.push(c),
                Ok(Err(err)) => return Err(Error::unavailable(BACKEND, format!("{e}: {err}"))),
                Err(_) => return Err(Error::unavailable(BACKEND, format!("{e}: timed out"))),
            }
        }
        // Spread the stores of many processes over the members.
        let first = random() as usize % endpoints.len();
        let store = EtcdStore {
            clients: clients.into(),
            endpoints: endpoints.into(),
            pinned: Arc::new(AtomicUsize::new(first)),
            min_ttl: Arc::new(AtomicI64::new(0)),
            cluster: Arc::new(AtomicU64::new(0)),
            grace_secs: ttl_secs(Self::DEFAULT_GRACE),
        };
        store.learn_cluster().await?;
        Ok(store)
    }

    /// Keeps a group record (its committed stack, epoch and pending transition) for `grace`
    /// after its last member is gone (rounded up to whole seconds), instead of
    /// [`Self::DEFAULT_GRACE`]: see "Growth" in the module docs.
    pub fn with_grace(mut self, grace: Duration) -> EtcdStore {
        self.grace_secs = ttl_secs(grace);
        self
    }

    /// The id of the cluster this store talks to, once an endpoint has answered.
    pub fn cluster_id(&self) -> Option<u64> {
        Some(self.cluster.load(Ordering::Relaxed)).filter(|&id| id != 0)
    }

    /// Asks every endpoint for its status at once (bounded by [`Self::CONNECT_TIMEOUT`]) and
    /// records the cluster id they answer with; two different ids are an error.
    async fn learn_cluster(&self) -> Result<(), Error> {
        let mut probes = tokio::task::JoinSet::new();
        for (i, c) in self.clients.iter().enumerate() {
            let mut c = c.clone();
            probes.spawn(async move {
                let answer = tokio::time::timeout(Self::CONNECT_TIMEOUT, c.status()).await;
                (
                    i,
                    answer
                        .ok()
                        .and_then(Result::ok)
                        .and_then(|s| s.cluster_id()),
                )
            });
        }
        let mut seen: Vec<(usize, u64)> = Vec::new();
        while let Some(probe) = probes.join_next().await {
            if let Ok((i, Some(id))) = probe {
                seen.push((i, id));
            }
        }
        seen.sort_unstable();
        for (i, id) in seen {
            self.check_cluster(i, Some(id))?;
        }
        Ok(())
    }

    /// Checks the cluster id of an answer from endpoint `i` against the one known (learning it
    /// from the first answer).
    pub(super) fn check_cluster(&self, i: usize, found: Option<u64>) -> Result<(), Error> {
        let Some(found) = found.filter(|&id| id != 0) else {
            return Ok(());
        };
        let expected =
            match self
                .cluster
                .compare_exchange(0, found, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Ok(()),
                Err(known) => known,
            };
        if expected == found {
            return Ok(());
        }
        self.unpin(i);
        Err(Error::WrongCluster {
            endpoint: self.endpoints[i].clone(),
            expected,
            found,
        })
    }

    /// The endpoints this store was created with.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Runs the request `make` builds on the pinned member, within [`Self::DEADLINE`] in all.
    ///
    /// If the member fails it (cannot be connected to, has no leader, times out, drops the
    /// connection), the next member is pinned; and if the request was certainly not applied
    /// (never sent, or refused for want of a leader), or `retry` is [`Retry::Always`], it is
    /// sent again there, visiting each member at most twice. A request that may have been
    /// applied and is not [`Retry::Always`] is never repeated: its error is returned.
    pub(super) async fn call<T, F, Fut>(&self, retry: Retry, make: F) -> Result<T, Error>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
        T: Headed,
    {
        let deadline = tokio::time::Instant::now() + Self::DEADLINE;
        let n = self.clients.len();
        let mut tries = 0;
        loop {
            tries += 1;
            let i = self.pinned.load(Ordering::Relaxed) % n;
            let err = match tokio::time::timeout_at(deadline, make(self.clients[i].clone())).await {
                Ok(Ok(v)) => {
                    self.check_cluster(i, v.cluster_id())?;
                    return Ok(v);
                }
                Ok(Err(e)) => e,
                Err(_) => {
                    self.unpin(i);
                    return Err(Error::unavailable(
                        BACKEND,
                        format!(
                            "{}: no answer within {:?}",
                            self.endpoints[i],
                            Self::DEADLINE
                        ),
                    ));
                }
            };
            let fault = fault(&err);
            let detail = format!("{}: {err}", self.endpoints[i]);
            if fault == Fault::None {
                return Err(Error::unavailable(BACKEND, detail));
            }
            self.unpin(i);
            if tries >= 2 * n || (fault == Fault::MaybeApplied && retry == Retry::IfNotApplied) {
                return Err(Error::unavailable(BACKEND, detail));
            }
            tracing::debug!(error = %detail, "etcd member failed a request, trying the next one");
        }
    }

    /// Moves requests off member `i` (unless another request already did).
    fn unpin(&self, i: usize) {
        let next = (i + 1) % self.clients.len();
        let _ = self
            .pinned
            .compare_exchange(i, next, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Runs one `Txn` (see [`Self::call`] for `retry`).
    pub(super) async fn txn(&self, txn: &Txn, retry: Retry) -> Result<TxnResponse, Error> {
        self.call(retry, |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
    }
}

/// Before attempt `attempt` (> 0) of a compare-and-swap: a random pause of up to
/// `2 * attempt` ms (at most 50), so racing clients spread out.
pub(super) async fn backoff(attempt: u32) {
    if attempt == 0 {
        return;
    }
    let cap = u64::from(attempt).saturating_mul(2).min(50);
    tokio::time::sleep(Duration::from_millis(random() % (cap + 1))).await;
}

/// An answer that names the cluster it came from (in its response header).
pub(super) trait Headed {
    /// The cluster id in the header, if the answer has one.
    fn cluster_id(&self) -> Option<u64>;
}

fn header_cluster(h: Option<&ResponseHeader>) -> Option<u64> {
    h.map(ResponseHeader::cluster_id)
}

impl Headed for TxnResponse {
    fn cluster_id(&self) -> Option<u64> {
        header_cluster(self.header())
    }
}

impl Headed for LeaseGrantResponse {
    fn cluster_id(&self) -> Option<u64> {
        header_cluster(self.header())
    }
}

impl Headed for LeaseRevokeResponse {
    fn cluster_id(&self) -> Option<u64> {
        header_cluster(self.header())
    }
}

impl Headed for LeaseTimeToLiveResponse {
    fn cluster_id(&self) -> Option<u64> {
        header_cluster(self.header())
    }
}

impl Headed for StatusResponse {
    fn cluster_id(&self) -> Option<u64> {
        header_cluster(self.header())
    }
}

/// The keep-alive answers are read by the client library (the lease's time-to-live, read
/// next, carries the header that is checked).
impl Headed for bool {
    fn cluster_id(&self) -> Option<u64> {
        None
    }
}

/// How [`EtcdStore::call`] may repeat a request after a member failed it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Retry {
    /// Only if it was certainly not applied.
    IfNotApplied,
    /// Always (reads, and requests whose repetition is harmless).
    Always,
}

/// What an error says about the member that returned it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Nothing: etcd answered the request with an error (e.g. an unknown lease).
    None,
    /// The member failed, and the request was certainly not applied.
    NotApplied,
    /// The member failed, and the request may have been applied.
    MaybeApplied,
}

/// Classifies an error of the client library.
fn fault(e: &etcd_client::Error) -> Fault {
    // gRPC status codes (`tonic::Code` as i32).
    const CANCELLED: i32 = 1;
    const UNKNOWN: i32 = 2;
    const DEADLINE_EXCEEDED: i32 = 4;
    const UNAVAILABLE: i32 = 14;
    let source: &(dyn std::error::Error + 'static) = match e {
        etcd_client::Error::GRpcStatus(s) => {
            // etcd's own answer when the member has no leader (`rpctypes.ErrNoLeader`):
            // refused before it was proposed.
            if s.message() == "etcdserver: no leader" {
                return Fault::NotApplied;
            }
            let code = i32::from(s.code());
            if ![CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, UNAVAILABLE].contains(&code) {
                return Fault::None;
            }
            s
        }
        etcd_client::Error::TransportError(t) => t,
        etcd_client::Error::IoError(io) => io,
        _ => return Fault::None,
    };
    if failed_to_connect(source) {
        Fault::NotApplied
    } else {
        Fault::MaybeApplied
    }
}

/// Whether the error chain says the connection to the member could not be made, so the
/// request never left: the connection was refused, or the TCP connect failed otherwise
/// (hyper's connector reports every such failure as `tcp connect error`).
fn failed_to_connect(mut err: &(dyn std::error::Error + 'static)) -> bool {
    loop {
        let refused = err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused);
        if refused || err.to_string() == "tcp connect error" {
            return true;
        }
        match err.source() {
            Some(next) => err = next,
            None => return false,
        }
    }
}

/// A random number (for jitter and spreading; not for anything secret).
pub(super) fn random() -> u64 {
    std::collections::hash_map::RandomState::new().hash_one(0u8)
}
