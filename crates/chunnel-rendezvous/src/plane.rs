//! A group's data plane: a fan-out over UDP to every live member, where each epoch's stack is
//! built on its own [`EpochBase`].
//!
//! Every datagram starts with the group-data header (docs/wire.md §15.3): tag `0x20`, then the
//! sender's epoch as a big-endian `u64`. A receiver hands each datagram to the stack of its
//! epoch: the previous epoch's stack stays alive for [`Group::RETIRE_AFTER`] after a switch and
//! the next epoch's is accepted as soon as a transition is pending, so messages sent around a
//! switch are decoded by the stack that encoded them: none is lost, none is decoded twice.
//! Members that joined keep talking while the store is down (the member list is the last one
//! read).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use chunnel::negotiate::Offers;
use chunnel::{Chunnel, ChunnelConnection};
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch};

use crate::Error;
use crate::participant::{Config, Participant, View};
use crate::store::{Member, Store};

/// Tag byte of a group data datagram.
pub const TAG_GROUP_DATA: u8 = 0x20;
/// Header length: tag + epoch.
pub const HEADER_LEN: usize = 9;
/// Messages queued per epoch before the receiver drops (and counts) more.
pub const QUEUE: usize = 1024;

/// Splits a group datagram into (epoch, payload); `None` for anything else.
pub fn parse_header(d: &[u8]) -> Option<(u64, &[u8])> {
    if d.len() < HEADER_LEN || d[0] != TAG_GROUP_DATA {
        return None;
    }
    let epoch = u64::from_be_bytes(d[1..HEADER_LEN].try_into().ok()?);
    Some((epoch, &d[HEADER_LEN..]))
}

/// Counters of the data plane.
#[derive(Debug, Default)]
pub struct Counters {
    /// Datagrams that were not group data (wrong tag, too short).
    pub malformed: AtomicU64,
    /// Datagrams of an epoch already retired, or too far ahead.
    pub stale: AtomicU64,
    /// Datagrams dropped because the epoch's queue was full.
    pub overflow: AtomicU64,
}

struct Shared {
    socket: UdpSocket,
    /// Where sends go, and the member list it was computed from.
    peers: RwLock<(Arc<[SocketAddr]>, Vec<Member>)>,
    queues: Mutex<Queues>,
    counters: Counters,
}

struct Queues {
    /// Epochs below this are retired.
    floor: u64,
    /// Highest epoch a datagram may carry (current or prepared).
    ceiling: u64,
    senders: BTreeMap<u64, mpsc::Sender<Bytes>>,
    receivers: BTreeMap<u64, mpsc::Receiver<Bytes>>,
}

impl Queues {
    fn sender(&mut self, epoch: u64) -> Option<&mpsc::Sender<Bytes>> {
        if epoch < self.floor || epoch > self.ceiling {
            return None;
        }
        Some(self.senders.entry(epoch).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(QUEUE);
            self.receivers.insert(epoch, rx);
            tx
        }))
    }
}

/// The base connection of one epoch's stack: `send` fans out to every other live member with
/// this epoch's header; `recv` yields the payloads of datagrams of this epoch.
pub struct EpochBase {
    shared: Arc<Shared>,
    epoch: u64,
    rx: tokio::sync::Mutex<mpsc::Receiver<Bytes>>,
}

impl std::fmt::Debug for EpochBase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpochBase")
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

impl ChunnelConnection for EpochBase {
    type Data = Bytes;

    async fn send<B>(&self, burst: B) -> Result<(), chunnel::Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        // One member list per burst (a reference count, not a copy).
        let peers = self
            .shared
            .peers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .clone();
        let mut buf = BytesMut::new();
        for msg in burst {
            buf.clear();
            buf.extend_from_slice(&[TAG_GROUP_DATA]);
            buf.extend_from_slice(&self.epoch.to_be_bytes());
            buf.extend_from_slice(&msg);
            for &p in peers.iter() {
                // A member that went away refuses datagrams; the others still get theirs.
                if let Err(e) = self.shared.socket.send_to(&buf, p).await {
                    tracing::debug!(peer = %p, error = %e, "group send failed");
                }
            }
        }
        Ok(())
    }

    async fn recv(&self, slots: &mut [Option<Bytes>]) -> Result<usize, chunnel::Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let mut rx = self.rx.lock().await;
        let Some(first) = rx.recv().await else {
            return Err(chunnel::Error::Closed);
        };
        slots[0] = Some(first);
        let mut n = 1;
        while n < slots.len() {
            match rx.try_recv() {
                Ok(m) => {
                    slots[n] = Some(m);
                    n += 1;
                }
                Err(_) => break,
            }
        }
        Ok(n)
    }
}

/// Each live epoch's connection, and when it retires (set once a newer epoch is current).
type Epochs<C> = BTreeMap<u64, (Arc<C>, Option<Instant>)>;

/// A group connection: join a group through a [`Store`], then send to and receive from every
/// member with the stack the group agreed on, across transitions.
pub struct Group<S>
where
    S: Chunnel<EpochBase>,
{
    participant: Participant,
    shared: Arc<Shared>,
    template: S,
    conns: tokio::sync::Mutex<Epochs<S::Connection>>,
    view: watch::Receiver<View>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    local: SocketAddr,
}

impl<S: Chunnel<EpochBase>> Drop for Group<S> {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl<S: Chunnel<EpochBase>> std::fmt::Debug for Group<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("participant", &self.participant)
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl<S> Group<S>
where
    S: Chunnel<EpochBase> + Offers + Clone + Send + Sync + 'static,
    S::Connection: ChunnelConnection<Data = Bytes> + Send + Sync + 'static,
{
    /// How long the previous epoch's stack keeps decoding after a switch.
    pub const RETIRE_AFTER: Duration = Duration::from_secs(2);

    /// Binds a UDP socket on `bind`, joins `group` as `id` through `store` with `stack`'s
    /// options (see [`Participant::join`]), and starts receiving.
    pub async fn join<St: Store>(
        store: Arc<St>,
        group: &str,
        id: &str,
        bind: SocketAddr,
        stack: S,
        policy: Option<crate::machine::Policy>,
        config: Config,
    ) -> Result<Group<S>, Error> {
        let socket = UdpSocket::bind(bind).await?;
        let local = socket.local_addr()?;
        let me = Member {
            id: id.to_owned(),
            addr: local.to_string(),
        };
        let participant =
            Participant::join(store, group, me, stack.offers(), policy, config).await?;
        let view = participant.watch();
        let epoch = view.borrow().epoch;
        let shared = Arc::new(Shared {
            socket,
            peers: RwLock::new((Arc::from([]), Vec::new())),
            queues: Mutex::new(Queues {
                floor: epoch,
                ceiling: epoch,
                senders: BTreeMap::new(),
                receivers: BTreeMap::new(),
            }),
            counters: Counters::default(),
        });
        set_peers(&shared, &view, local);
        let demux = tokio::spawn(demux(shared.clone(), view.clone(), local));
        let follow = tokio::spawn(follow(shared.clone(), view.clone(), local));
        let g = Group {
            participant,
            shared,
            template: stack,
            conns: tokio::sync::Mutex::new(BTreeMap::new()),
            view,
            tasks: vec![demux, follow],
            local,
        };
        g.conn(epoch).await?;
        Ok(g)
    }

    /// The participant (membership, view, transitions).
    pub fn participant(&self) -> &Participant {
        &self.participant
    }

    /// Proposes switching the group to our option `option` (see [`Participant::propose`]).
    pub async fn propose(&self, option: usize) -> Result<(), Error> {
        self.participant.propose(option).await
    }

    /// The data-plane address other members send to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Data-plane counters (malformed, stale and dropped datagrams).
    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// Leaves the group at once (the store forgets us; other members stop sending to us
    /// after their next read of the group).
    pub async fn leave(self) -> Result<(), Error> {
        self.participant.leave().await
    }

    /// The connection of `epoch`, built on first use with our option for it.
    async fn conn(&self, epoch: u64) -> Result<Arc<S::Connection>, Error> {
        let mut conns = self.conns.lock().await;
        if let Some((c, _)) = conns.get(&epoch) {
            return Ok(c.clone());
        }
        let v = self.view.borrow().clone();
        let option = if v.epoch == epoch {
            v.option
        } else if let Some((e, o)) = v.prepared
            && e == epoch
        {
            o
        } else {
            return Err(Error::Busy("no stack known for this epoch"));
        };
        let rx = {
            let mut q = self.shared.queues.lock().unwrap_or_else(|p| p.into_inner());
            q.sender(epoch);
            q.receivers.remove(&epoch)
        };
        let Some(rx) = rx else {
            return Err(Error::Busy("epoch already retired"));
        };
        let mut s = self.template.clone();
        let pick = s
            .offers()
            .get(option)
            .map(|o| o.pick.clone())
            .ok_or(Error::Busy("no such option"))?;
        s.apply(&pick)?;
        let base = EpochBase {
            shared: self.shared.clone(),
            epoch,
            rx: tokio::sync::Mutex::new(rx),
        };
        let c = Arc::new(s.connect_wrap(base).await?);
        conns.insert(epoch, (c.clone(), None));
        Ok(c)
    }

    /// The live epochs, oldest first, after retiring those past their time.
    async fn live(&self) -> Vec<(u64, Arc<S::Connection>)> {
        let v = self.view.borrow().clone();
        for e in [Some(v.epoch), v.prepared.map(|p| p.0)]
            .into_iter()
            .flatten()
        {
            let _ = self.conn(e).await;
        }
        let mut conns = self.conns.lock().await;
        let now = Instant::now();
        for (e, (_, retired)) in conns.iter_mut() {
            if *e < v.epoch && retired.is_none() {
                *retired = Some(now + Self::RETIRE_AFTER);
            }
        }
        conns.retain(|e, (_, r)| *e >= v.epoch || r.is_none_or(|deadline| now < deadline));
        let floor = conns.keys().next().copied().unwrap_or(v.epoch);
        {
            let mut q = self.shared.queues.lock().unwrap_or_else(|p| p.into_inner());
            q.floor = floor;
            q.senders.retain(|e, _| *e >= floor);
            q.receivers.retain(|e, _| *e >= floor);
        }
        conns.iter().map(|(e, (c, _))| (*e, c.clone())).collect()
    }

    /// Sends each message to every other live member, with the current epoch's stack.
    pub async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        // The member list as of now: the task that follows the view may not have run yet
        // (a member that just joined would miss this send).
        refresh_peers(&self.shared, &self.view, self.local);
        let epoch = self.view.borrow().epoch;
        let c = self.conn(epoch).await?;
        c.send(burst).await?;
        Ok(())
    }

    /// Receives the next message from any member, decoded by the stack of the epoch it was
    /// sent at (older epochs first, so a sender's messages stay in order across a switch).
    pub async fn recv(&self) -> Result<Bytes, Error> {
        let mut changed = self.view.clone();
        loop {
            if let Some(why) = &changed.borrow_and_update().closed {
                return Err(Error::Aborted {
                    id: 0,
                    reason: why.clone(),
                });
            }
            let live = self.live().await;
            let mut it = live.into_iter().map(|(_, c)| c);
            let (a, b, c) = (it.next(), it.next(), it.next());
            let retire_tick = tokio::time::sleep(Duration::from_millis(250));
            tokio::select! {
                biased;
                r = one(a.as_deref()) => return r,
                r = one(b.as_deref()) => return r,
                r = one(c.as_deref()) => return r,
                _ = changed.changed() => {}
                _ = retire_tick => {}
            }
        }
    }
}

async fn one<C: ChunnelConnection<Data = Bytes>>(c: Option<&C>) -> Result<Bytes, Error> {
    let Some(c) = c else {
        return std::future::pending().await;
    };
    let mut slot = [None];
    loop {
        if c.recv(&mut slot).await? > 0
            && let Some(m) = slot[0].take()
        {
            return Ok(m);
        }
    }
}

/// Recomputes where sends go if the member list changed since the last time.
///
/// Several tasks refresh (senders, the task following the view, the receiver): the view is
/// read again under the write lock, so the last writer writes the newest member list and
/// none puts back an older one.
fn refresh_peers(shared: &Shared, view: &watch::Receiver<View>, local: SocketAddr) {
    if shared.peers.read().unwrap_or_else(|p| p.into_inner()).1 == view.borrow().members {
        return;
    }
    let mut peers = shared.peers.write().unwrap_or_else(|p| p.into_inner());
    let v = view.borrow();
    if peers.1 == v.members {
        return;
    }
    let to: Arc<[SocketAddr]> = v
        .members
        .iter()
        .filter_map(|m| m.addr.parse().ok())
        .filter(|a| *a != local)
        .collect();
    *peers = (to, v.members.clone());
}

fn set_peers(shared: &Shared, view: &watch::Receiver<View>, local: SocketAddr) {
    refresh_peers(shared, view, local);
    let epoch = view.borrow().epoch;
    let mut q = shared.queues.lock().unwrap_or_else(|p| p.into_inner());
    // The next epoch is always accepted: a member that votes yes prepares it before its vote
    // is stored, so nothing sent at the next epoch can arrive before we can queue it. Never
    // lowered: an older view read late must not shut out a newer epoch.
    q.ceiling = q.ceiling.max(epoch + 1);
}

async fn follow(shared: Arc<Shared>, mut view: watch::Receiver<View>, local: SocketAddr) {
    while view.changed().await.is_ok() {
        view.borrow_and_update();
        set_peers(&shared, &view, local);
    }
}

async fn demux(shared: Arc<Shared>, view: watch::Receiver<View>, local: SocketAddr) {
    let mut buf = vec![0u8; 65_536];
    loop {
        let n = match shared.socket.recv_from(&mut buf).await {
            Ok((n, _)) => n,
            Err(e) => {
                // ICMP errors from a member that went away surface here on Linux; keep going.
                tracing::debug!(error = %e, "group recv error");
                continue;
            }
        };
        let Some((epoch, payload)) = parse_header(&buf[..n]) else {
            shared.counters.malformed.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let queue = |epoch| {
            let mut q = shared.queues.lock().unwrap_or_else(|p| p.into_inner());
            (q.sender(epoch).cloned(), epoch > q.ceiling)
        };
        let tx = match queue(epoch) {
            // Ahead of what we accept: the view may have moved (a rejoin to a re-created group
            // jumps epochs) before the task that follows it ran; look at it now.
            (None, true) => {
                set_peers(&shared, &view, local);
                queue(epoch).0
            }
            (tx, _) => tx,
        };
        match tx {
            None => {
                shared.counters.stale.fetch_add(1, Ordering::Relaxed);
            }
            Some(tx) => {
                if tx.try_send(Bytes::copy_from_slice(payload)).is_err() {
                    shared.counters.overflow.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn header_round_trips(epoch in any::<u64>(), payload in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut d = vec![TAG_GROUP_DATA];
            d.extend_from_slice(&epoch.to_be_bytes());
            d.extend_from_slice(&payload);
            prop_assert_eq!(parse_header(&d), Some((epoch, &payload[..])));
        }

        #[test]
        fn header_parser_never_panics(d in proptest::collection::vec(any::<u8>(), 0..32)) {
            match parse_header(&d) {
                Some((_, p)) => prop_assert!(d.len() >= HEADER_LEN && d[0] == TAG_GROUP_DATA && p.len() == d.len() - HEADER_LEN),
                None => prop_assert!(d.len() < HEADER_LEN || d[0] != TAG_GROUP_DATA),
            }
        }
    }
}
