//! Runtime reconfiguration: state transfer, failed switches, idle switches, blocked receivers
//! moved to the new implementation, and the stress test (8 senders, 8 receivers, 1,000
//! switches over TCP) for both mechanisms.
//!
//! The Chunnel under test is `Seq<LAYOUT>`: it stamps every message with a u64 sequence number
//! in a 9-byte header, `[1, seq big-endian]` (layout 1) or `[2, seq little-endian]` (layout 2).
//! Both implementations decode both layouts (they are wire compatible, as unilateral switching
//! requires) but encode their own, so the wire shows which one sent. Its receive side reads up
//! to 8 messages per call from below and buffers what the caller has no slot for; its state
//! (next sequence number, buffered messages) moves through `Handover`.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use chunnel::{
    Chunnel, ChunnelConnection, ConnectionExt, Error, Handoff, Handover, Listener as _, Lock,
    LockFree, Mechanism, Negotiate, Offers, Shared, Side, select, stack,
};
use tokio::sync::Notify;

// ---------------------------------------------------------------------------------------------
// An in-memory, lossless duplex pair of byte connections.

#[derive(Debug, Default)]
struct Chan {
    q: Mutex<VecDeque<Bytes>>,
    ready: Notify,
}

#[derive(Debug)]
struct MemEnd {
    tx: Arc<Chan>,
    rx: Arc<Chan>,
}

fn mem_pair() -> (MemEnd, MemEnd) {
    let (a, b) = (Arc::new(Chan::default()), Arc::new(Chan::default()));
    (
        MemEnd {
            tx: a.clone(),
            rx: b.clone(),
        },
        MemEnd { tx: b, rx: a },
    )
}

impl ChunnelConnection for MemEnd {
    type Data = Bytes;

    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        self.tx.q.lock().unwrap().extend(burst);
        self.tx.ready.notify_waiters();
        Ok(())
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, Error> {
        loop {
            let notified = self.rx.ready.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            {
                let mut q = self.rx.q.lock().unwrap();
                let n = q.len().min(slots.len());
                if n > 0 {
                    for (s, m) in slots.iter_mut().zip(q.drain(..n)) {
                        *s = Some(m);
                    }
                    return Ok(n);
                }
            }
            notified.await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The sequence-numbering Chunnel.

/// A message with the sequence number it was stamped with (ignored when sending).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stamped {
    seq: u64,
    body: Bytes,
}

fn msg(body: &'static str) -> Stamped {
    Stamped {
        seq: 0,
        body: Bytes::from_static(body.as_bytes()),
    }
}

/// What the Seq connections did, shared by every connection of one test.
#[derive(Debug, Default)]
struct Stats {
    /// Buffered messages found at export (delivered through the carry-over queue, or dropped
    /// by a lossy export).
    carried: AtomicU64,
    exports: AtomicU64,
    /// Messages decoded by the layout-1 / layout-2 implementation.
    decoded_by: [AtomicU64; 3],
}

#[derive(Clone, Debug, Default)]
struct Seq<const LAYOUT: u8> {
    stats: Arc<Stats>,
    /// Drop buffered messages on export (a deliberately broken implementation).
    lossy: bool,
    /// Make `connect_wrap` fail.
    fail: Arc<AtomicBool>,
}

impl<const LAYOUT: u8> Seq<LAYOUT> {
    fn new(stats: &Arc<Stats>) -> Self {
        Seq {
            stats: stats.clone(),
            ..Default::default()
        }
    }
}

impl<const LAYOUT: u8> Negotiate for Seq<LAYOUT> {
    fn id(&self) -> &'static str {
        if LAYOUT == 1 {
            "test/seq-be/1"
        } else {
            "test/seq-le/1"
        }
    }
}

#[derive(Debug)]
struct SeqConn<C, const LAYOUT: u8> {
    inner: C,
    next: AtomicU64,
    rx: Mutex<VecDeque<Stamped>>,
    reader: tokio::sync::Mutex<()>,
    stats: Arc<Stats>,
    lossy: bool,
}

#[derive(Debug)]
struct NextSeq(u64);

impl<C, const LAYOUT: u8> Chunnel<C> for Seq<LAYOUT>
where
    C: ChunnelConnection<Data = Bytes> + Send,
{
    type Connection = SeqConn<C, LAYOUT>;

    async fn connect_wrap(&mut self, inner: C) -> Result<Self::Connection, Error> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(Error::NotAvailable {
                chunnel: self.id(),
                reason: "told to fail".into(),
            });
        }
        Ok(SeqConn {
            inner,
            next: AtomicU64::new(0),
            rx: Mutex::new(VecDeque::new()),
            reader: tokio::sync::Mutex::new(()),
            stats: self.stats.clone(),
            lossy: self.lossy,
        })
    }
}

fn encode(layout: u8, seq: u64, body: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(9 + body.len());
    b.put_u8(layout);
    if layout == 1 {
        b.put_u64(seq);
    } else {
        b.put_u64_le(seq);
    }
    b.put_slice(body);
    b.freeze()
}

fn decode(mut b: Bytes) -> Result<(u8, Stamped), Error> {
    if b.len() < 9 {
        return Err(Error::Malformed {
            what: "seq header shorter than 9 bytes",
        });
    }
    let layout = b.get_u8();
    let seq = match layout {
        1 => b.get_u64(),
        2 => b.get_u64_le(),
        _ => {
            return Err(Error::Malformed {
                what: "unknown seq header layout",
            });
        }
    };
    Ok((layout, Stamped { seq, body: b }))
}

impl<C: ChunnelConnection<Data = Bytes>, const LAYOUT: u8> SeqConn<C, LAYOUT> {
    fn pop(&self, slots: &mut [Option<Stamped>]) -> usize {
        let mut q = self.rx.lock().unwrap();
        let n = q.len().min(slots.len());
        for (s, m) in slots.iter_mut().zip(q.drain(..n)) {
            *s = Some(m);
        }
        n
    }
}

impl<C: ChunnelConnection<Data = Bytes>, const LAYOUT: u8> ChunnelConnection
    for SeqConn<C, LAYOUT>
{
    type Data = Stamped;

    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Stamped> + Send,
        B::IntoIter: Send,
    {
        let next = &self.next;
        self.inner
            .send(
                burst
                    .into_iter()
                    .map(|m| encode(LAYOUT, next.fetch_add(1, Ordering::SeqCst), &m.body)),
            )
            .await
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Stamped>]) -> Result<usize, Error> {
        loop {
            let n = self.pop(slots);
            if n > 0 || slots.is_empty() {
                return Ok(n);
            }
            // One reader at a time, so batches enter the buffer in arrival order.
            let _reader = self.reader.lock().await;
            let n = self.pop(slots);
            if n > 0 {
                return Ok(n);
            }
            let mut batch: [Option<Bytes>; 8] = Default::default();
            let got = self.inner.recv(&mut batch).await?;
            let mut q = self.rx.lock().unwrap();
            for b in batch.iter_mut().take(got) {
                if let Some(b) = b.take() {
                    let (_, m) = decode(b)?;
                    self.stats.decoded_by[usize::from(LAYOUT)].fetch_add(1, Ordering::SeqCst);
                    q.push_back(m);
                }
            }
        }
    }
}

impl<C: ChunnelConnection<Data = Bytes>, const LAYOUT: u8> Handover for SeqConn<C, LAYOUT> {
    fn export(&self, state: &mut Handoff<Stamped>) {
        state.put(NextSeq(self.next.load(Ordering::SeqCst)));
        let mut q = self.rx.lock().unwrap();
        self.stats.exports.fetch_add(1, Ordering::SeqCst);
        self.stats
            .carried
            .fetch_add(q.len() as u64, Ordering::SeqCst);
        if self.lossy {
            q.clear();
        } else {
            state.buffered.extend(q.drain(..));
        }
    }

    fn import(&self, state: &mut Handoff<Stamped>) {
        if let Some(NextSeq(n)) = state.take() {
            self.next.store(n, Ordering::SeqCst);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Unit tests over the in-memory pair.

/// Raw messages received by a plain byte end, decoded: (layout, seq, body).
async fn raw_recv(end: &MemEnd, n: usize) -> Vec<(u8, u64, Bytes)> {
    let mut out = Vec::new();
    while out.len() < n {
        let (layout, m) = decode(end.recv_one().await.unwrap()).unwrap();
        out.push((layout, m.seq, m.body));
    }
    out
}

async fn state_transfer<M: Mechanism>() {
    let stats = Arc::new(Stats::default());
    let sel = select(Seq::<1>::new(&stats), Seq::<2>::new(&stats)).reconfigurable::<M>();
    let handle = sel.handle();
    let (a, peer) = mem_pair();
    let conn = stack![sel, Shared].connect_wrap(a).await.unwrap();
    assert_eq!(conn.side(), Side::Left);

    // Sending on layout 1 stamps 0, 1, 2.
    conn.send([msg("a"), msg("b"), msg("c")]).await.unwrap();
    let got = raw_recv(&peer, 3).await;
    assert_eq!(
        got.iter().map(|g| (g.0, g.1)).collect::<Vec<_>>(),
        [(1, 0), (1, 1), (1, 2)]
    );

    // Five arrive; a 1-slot recv takes one, the implementation buffers four.
    peer.send((0..5u64).map(|i| encode(1, 100 + i, format!("m{i}").as_bytes())))
        .await
        .unwrap();
    let first = conn.recv_one().await.unwrap();
    assert_eq!((first.seq, &first.body[..]), (100, &b"m0"[..]));

    assert_eq!(handle.reconfigure(Side::Right).await.unwrap(), 1);
    assert_eq!(conn.side(), Side::Right);
    assert_eq!(conn.switches(), 1);
    assert_eq!(stats.carried.load(Ordering::SeqCst), 4);

    // The new implementation continues the sequence, in its own layout.
    conn.send([msg("d"), msg("e")]).await.unwrap();
    let got = raw_recv(&peer, 2).await;
    assert_eq!(
        got.iter().map(|g| (g.0, g.1)).collect::<Vec<_>>(),
        [(2, 3), (2, 4)]
    );

    // Buffered messages come out first, then what the new implementation receives.
    peer.send([encode(2, 105, b"m5"), encode(1, 106, b"m6")])
        .await
        .unwrap();
    let mut bodies = Vec::new();
    for _ in 0..6 {
        let m = conn.recv_one().await.unwrap();
        bodies.push(String::from_utf8(m.body.to_vec()).unwrap());
    }
    assert_eq!(bodies, ["m1", "m2", "m3", "m4", "m5", "m6"]);
    assert_eq!(stats.decoded_by[1].load(Ordering::SeqCst), 5);
    assert_eq!(stats.decoded_by[2].load(Ordering::SeqCst), 2);

    // Back again: the sequence still continues.
    assert!(conn.reconfigure(Side::Left).await.unwrap());
    assert!(!conn.reconfigure(Side::Left).await.unwrap());
    conn.send([msg("f")]).await.unwrap();
    assert_eq!(raw_recv(&peer, 1).await[0].1, 5);
}

#[tokio::test]
async fn state_transfer_lock() {
    state_transfer::<Lock>().await;
}

#[tokio::test]
async fn state_transfer_lock_free() {
    state_transfer::<LockFree>().await;
}

async fn failed_switch_stays<M: Mechanism>() {
    let stats = Arc::new(Stats::default());
    let right = Seq::<2>::new(&stats);
    let fail = right.fail.clone();
    let sel = select(Seq::<1>::new(&stats), right).reconfigurable::<M>();
    let handle = sel.handle();
    let mut stack = stack![sel, Shared];
    let (a, b) = mem_pair();
    let client = stack.connect_wrap(a).await.unwrap();
    let server = stack.connect_wrap(b).await.unwrap();
    assert_eq!(handle.connections(), 2);

    fail.store(true, Ordering::SeqCst);
    match handle.reconfigure(Side::Right).await {
        Err(Error::SwitchFailed {
            to: Side::Right,
            failed: 2,
            of: 2,
            source,
        }) => assert!(matches!(*source, Error::NotAvailable { .. }), "{source}"),
        other => panic!("expected SwitchFailed, got {other:?}"),
    }
    assert!(matches!(
        client.reconfigure(Side::Right).await,
        Err(Error::SwitchFailed {
            failed: 1,
            of: 1,
            ..
        })
    ));
    assert_eq!((client.side(), server.side()), (Side::Left, Side::Left));
    assert_eq!(handle.target(), None);
    // Still works, on the old branch.
    client.send([msg("x")]).await.unwrap();
    assert_eq!(&server.recv_one().await.unwrap().body[..], b"x");
    assert_eq!(stats.decoded_by[1].load(Ordering::SeqCst), 1);

    // Once the branch can be built, the same switch goes through.
    fail.store(false, Ordering::SeqCst);
    assert_eq!(handle.reconfigure(Side::Right).await.unwrap(), 2);
    assert_eq!((client.side(), server.side()), (Side::Right, Side::Right));
    client.send([msg("y")]).await.unwrap();
    assert_eq!(&server.recv_one().await.unwrap().body[..], b"y");
    assert_eq!(stats.decoded_by[2].load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn failed_switch_stays_on_old_branch_lock() {
    failed_switch_stays::<Lock>().await;
}

#[tokio::test]
async fn failed_switch_stays_on_old_branch_lock_free() {
    failed_switch_stays::<LockFree>().await;
}

async fn idle_switches_then_traffic<M: Mechanism>() {
    let stats = Arc::new(Stats::default());
    let sel = select(Seq::<1>::new(&stats), Seq::<2>::new(&stats)).reconfigurable::<M>();
    let handle = sel.handle();
    let mut stack = stack![sel.clone(), Shared];
    let (a, b) = mem_pair();
    let client = Arc::new(stack.connect_wrap(a).await.unwrap());
    let server = Arc::new(stack.connect_wrap(b).await.unwrap());

    // No traffic at all: switch back and forth.
    for i in 0..10 {
        let to = if i % 2 == 0 { Side::Right } else { Side::Left };
        assert_eq!(handle.reconfigure(to).await.unwrap(), 2);
    }
    assert_eq!(client.switches(), 10);
    client.send([msg("after idle")]).await.unwrap();
    assert_eq!(&server.recv_one().await.unwrap().body[..], b"after idle");

    // A receiver blocked in the old implementation is moved to the new one.
    let blocked = {
        let server = server.clone();
        tokio::spawn(async move { server.recv_one().await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!blocked.is_finished());
    assert_eq!(handle.reconfigure(Side::Right).await.unwrap(), 2);
    let before = stats.decoded_by[2].load(Ordering::SeqCst);
    client.send([msg("to the moved receiver")]).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), blocked)
        .await
        .expect("the blocked receiver was not moved")
        .unwrap()
        .unwrap();
    assert_eq!(&got.body[..], b"to the moved receiver");
    assert_eq!(stats.decoded_by[2].load(Ordering::SeqCst), before + 1);

    // Connections built after a switch start on the handle's branch; dead ones are pruned.
    assert_eq!(handle.target(), Some(Side::Right));
    let (c, _d) = mem_pair();
    let late = stack.connect_wrap(c).await.unwrap();
    assert_eq!(late.side(), Side::Right);
    assert_eq!(handle.connections(), 3);
    drop(late);
    assert_eq!(handle.connections(), 2);

    // A prepared switch that is dropped changes nothing; committed, it switches.
    let p = handle.prepare(Side::Left).await.unwrap();
    drop(p);
    assert_eq!(client.side(), Side::Right);
    let p = handle.prepare(Side::Left).await.unwrap();
    assert_eq!(p.commit().await, 2);
    assert_eq!((client.side(), server.side()), (Side::Left, Side::Left));
}

#[tokio::test]
async fn idle_switches_then_traffic_lock() {
    idle_switches_then_traffic::<Lock>().await;
}

#[tokio::test]
async fn idle_switches_then_traffic_lock_free() {
    idle_switches_then_traffic::<LockFree>().await;
}

#[test]
fn negotiates_like_the_select() {
    let stats = Arc::new(Stats::default());
    let mut sel = select(Seq::<1>::new(&stats), Seq::<2>::new(&stats)).reconfigurable::<Lock>();
    let offers = sel.offers();
    assert_eq!(offers.len(), 2);
    assert_eq!(offers[1].chunnels[0].id, "test/seq-le/1");
    sel.apply(&offers[1].pick).unwrap();
    assert_eq!(sel.get_ref().choice(), Some(Side::Right));
}

#[tokio::test]
async fn malformed_bytes_are_an_error_not_a_panic() {
    let stats = Arc::new(Stats::default());
    let sel = select(Seq::<1>::new(&stats), Seq::<2>::new(&stats)).reconfigurable::<LockFree>();
    let (a, peer) = mem_pair();
    let conn = stack![sel, Shared].connect_wrap(a).await.unwrap();
    peer.send([Bytes::from_static(b"short")]).await.unwrap();
    assert!(matches!(
        conn.recv_one().await,
        Err(Error::Malformed { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// The stress test: 8 senders and 8 receivers of sequence-numbered messages over TCP while
// another task switches both connections 1,000 times.

const SENDERS: usize = 8;
const RECEIVERS: usize = 8;

#[derive(Debug)]
struct Outcome {
    sent: usize,
    received: usize,
    missing: usize,
    duplicates: usize,
    /// (receiver, sender) pairs where the sender's numbers did not increase.
    order_violations: usize,
    /// Connection-level sequence numbers stamped twice (lost next-seq transfer).
    duplicate_seqs: usize,
    switched: usize,
    /// Messages received before the last switch completed (the switches overlapped traffic).
    received_at_last_switch: usize,
    carried: u64,
    elapsed: Duration,
}

async fn stress<M: Mechanism>(lossy: bool, min_per_sender: u32, switches: usize) -> Outcome {
    let start = Instant::now();
    let stats = Arc::new(Stats::default());
    let mut left = Seq::<1>::new(&stats);
    let mut right = Seq::<2>::new(&stats);
    left.lossy = lossy;
    right.lossy = lossy;
    let sel = select(left, right).reconfigurable::<M>();
    let handle = sel.handle();
    let mut stack = stack![sel, Shared];

    let mut listener = chunnel_net::tcp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let base_client = chunnel_net::tcp::Connect::new(addr)
        .connect_wrap(())
        .await
        .unwrap();
    let base_server = listener.accept().await.unwrap();
    let client = Arc::new(stack.connect_wrap(base_client).await.unwrap());
    let server = Arc::new(stack.connect_wrap(base_server).await.unwrap());

    let received = Arc::new(AtomicUsize::new(0));
    let switching_done = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);

    let mut receivers = Vec::new();
    for r in 0..RECEIVERS {
        let server = server.clone();
        let received = received.clone();
        let mut stop = stop_rx.clone();
        receivers.push(tokio::spawn(async move {
            let mut log: Vec<(u8, u32, u64)> = Vec::new();
            let mut slots: Vec<Option<Stamped>> = vec![None; 1 + r % 4];
            loop {
                tokio::select! {
                    res = server.recv(&mut slots) => {
                        let n = res.unwrap();
                        for s in slots.iter_mut().take(n) {
                            let m = s.take().unwrap();
                            let mut body = m.body.clone();
                            log.push((body.get_u8(), body.get_u32(), m.seq));
                        }
                        received.fetch_add(n, Ordering::SeqCst);
                    }
                    _ = stop.changed() => break,
                }
            }
            log
        }));
    }

    let mut senders = Vec::new();
    for s in 0..SENDERS {
        let client = client.clone();
        let switching_done = switching_done.clone();
        senders.push(tokio::spawn(async move {
            let mut n: u32 = 0;
            let mut burst_len = 1 + s % 4;
            while n < min_per_sender || !switching_done.load(Ordering::SeqCst) {
                let burst: Vec<Stamped> = (n..n + burst_len as u32)
                    .map(|i| {
                        let mut b = BytesMut::with_capacity(5);
                        b.put_u8(s as u8);
                        b.put_u32(i);
                        Stamped {
                            seq: 0,
                            body: b.freeze(),
                        }
                    })
                    .collect();
                client.send(burst).await.unwrap();
                n += burst_len as u32;
                burst_len = 1 + (burst_len % 4);
                if n % 64 < 4 {
                    tokio::task::yield_now().await;
                }
            }
            n as usize
        }));
    }

    let switcher = {
        let handle = handle.clone();
        let received = received.clone();
        let switching_done = switching_done.clone();
        tokio::spawn(async move {
            let mut switched = 0;
            for i in 0..switches {
                let to = if i % 2 == 0 { Side::Right } else { Side::Left };
                switched += handle.reconfigure(to).await.unwrap();
                tokio::task::yield_now().await;
            }
            let at_last = received.load(Ordering::SeqCst);
            switching_done.store(true, Ordering::SeqCst);
            (switched, at_last)
        })
    };

    let (switched, received_at_last_switch) = switcher.await.unwrap();
    let mut sent_per_sender = Vec::new();
    for s in senders {
        sent_per_sender.push(s.await.unwrap());
    }
    let sent: usize = sent_per_sender.iter().sum();

    // Wait for everything, or until nothing has arrived for a second (a lost message).
    let mut last = (received.load(Ordering::SeqCst), Instant::now());
    loop {
        let now = received.load(Ordering::SeqCst);
        if now >= sent {
            break;
        }
        if now != last.0 {
            last = (now, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop_tx.send(true).unwrap();
    let mut logs = Vec::new();
    for r in receivers {
        logs.push(r.await.unwrap());
    }

    // Verify: exactly once, per-sender order within each receiver, unique stamps.
    let mut seen: Vec<Vec<u32>> = sent_per_sender.iter().map(|&n| vec![0; n]).collect();
    let mut order_violations = 0;
    let mut seqs = HashSet::new();
    let mut duplicate_seqs = 0;
    let mut total = 0;
    for log in &logs {
        let mut last_of: [Option<u32>; SENDERS] = [None; SENDERS];
        for &(s, n, seq) in log {
            total += 1;
            let (s, ni) = (usize::from(s), n as usize);
            assert!(
                s < SENDERS && ni < seen[s].len(),
                "message never sent: {s}/{n}"
            );
            seen[s][ni] += 1;
            if last_of[s].is_some_and(|prev| prev >= n) {
                order_violations += 1;
            }
            last_of[s] = Some(n);
            if !seqs.insert(seq) {
                duplicate_seqs += 1;
            }
        }
    }
    let flat = seen.iter().flatten();
    Outcome {
        sent,
        received: total,
        missing: flat.clone().filter(|&&c| c == 0).count(),
        duplicates: flat.map(|&c| c.saturating_sub(1) as usize).sum(),
        order_violations,
        duplicate_seqs,
        switched,
        received_at_last_switch,
        carried: stats.carried.load(Ordering::SeqCst),
        elapsed: start.elapsed(),
    }
}

fn assert_clean(o: &Outcome, switches: usize) {
    eprintln!("{o:?}");
    assert!(o.elapsed < Duration::from_secs(60), "took {:?}", o.elapsed);
    assert_eq!(
        o.switched,
        2 * switches,
        "both connections switch every time"
    );
    assert_eq!(o.missing, 0, "lost messages");
    assert_eq!(o.duplicates, 0, "duplicated messages");
    assert_eq!(o.received, o.sent);
    assert_eq!(o.order_violations, 0, "per-sender order broken");
    assert_eq!(o.duplicate_seqs, 0, "next-seq not transferred");
    assert!(o.carried > 0, "no switch found buffered messages to carry");
    assert!(
        o.received_at_last_switch > 0 && o.received_at_last_switch < o.received,
        "switches did not overlap traffic"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_lock() {
    let o = stress::<Lock>(false, 2_000, 1_000).await;
    assert_clean(&o, 1_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_lock_free() {
    let o = stress::<LockFree>(false, 2_000, 1_000).await;
    assert_clean(&o, 1_000);
}

/// The check can fail: an implementation that drops its buffered messages at export is caught,
/// message for message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_catches_a_lossy_handover() {
    let o = stress::<LockFree>(true, 500, 200).await;
    eprintln!("{o:?}");
    assert!(o.carried > 0, "no buffered message at any switch");
    assert_eq!(o.missing as u64, o.carried);
    assert_eq!(o.duplicates, 0);
}
