//! Unit tests of the peer table, the peer queue and the reader role.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use bytes::Bytes;
use chunnel::ChunnelConnection;

use super::demux::{Peer, PeerMap, PeerQueue};
use super::reader::{ACCEPT_READER, CONN_READER, NO_READER};
use super::*;

struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counter() -> (Arc<Count>, Waker) {
    let c = Arc::new(Count(AtomicUsize::new(0)));
    (Arc::clone(&c), Waker::from(c))
}

/// The peer table finds each peer by its address through growth, replaces a peer of the
/// same address, and forgets what is removed.
#[test]
fn peer_map_finds_peers_by_their_own_address() {
    let addr = |i: u16| std::net::SocketAddr::from(([127, 0, 0, 1], i));
    let mut m = PeerMap::new();
    for i in 1..=3000 {
        m.insert(Arc::new(Peer::new(addr(i), PeerQueue::default())));
    }
    assert_eq!(m.len(), 3000);
    for i in 1..=3000 {
        assert_eq!(m.get(&addr(i)).map(|p| p.addr), Some(addr(i)));
    }
    assert!(!m.contains(&addr(3001)));
    let again = Arc::new(Peer::new(
        addr(7),
        PeerQueue::one(Bytes::from_static(b"x"), &Arc::default()),
    ));
    m.insert(Arc::clone(&again));
    assert_eq!(m.len(), 3000, "replaced, not added");
    assert!(Arc::ptr_eq(m.get(&addr(7)).expect("there"), &again));
    for i in (1..=3000).step_by(2) {
        assert_eq!(m.remove(&addr(i)).map(|p| p.addr), Some(addr(i)));
    }
    assert_eq!(m.remove(&addr(1)).map(|p| p.addr), None);
    assert_eq!(m.len(), 1500);
    assert_eq!(m.values().filter(|p| p.addr.port() % 2 == 0).count(), 1500);
}

/// A peer's queue keeps arrival order across its inline first slot and the rest, however
/// pushes and pops interleave.
#[test]
fn peer_queue_is_first_in_first_out() {
    let mut q = PeerQueue::default();
    let mut model = std::collections::VecDeque::new();
    let mut next = 0u32;
    // A fixed pattern of pushes (true) and pops (false).
    for (i, push) in [
        true, false, true, true, false, true, true, true, false, false,
    ]
    .iter()
    .cycle()
    .take(200)
    .enumerate()
    {
        if *push || i % 7 == 0 {
            let m = Bytes::from(next.to_be_bytes().to_vec());
            next += 1;
            q.push_back(m.clone());
            model.push_back(m);
        } else {
            assert_eq!(q.pop_front(), model.pop_front());
        }
        assert_eq!(q.len(), model.len());
        assert_eq!(q.is_empty(), model.is_empty());
    }
    while let Some(m) = model.pop_front() {
        assert_eq!(q.pop_front(), Some(m));
    }
    assert!(q.pop_front().is_none() && q.is_empty());
}

/// A task that still acts as the reader after the reader role changed hands does not
/// register in the socket's one receive-waker slot: the new reader's registration stays,
/// and a datagram wakes the new reader. (Without the check the stale task would overwrite
/// it, and the new reader would sleep through the datagram.)
#[tokio::test(flavor = "current_thread")]
async fn a_stale_reader_does_not_take_the_receive_waker_slot() {
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = sock.local_addr().unwrap();
    let l = Listener::new(sock, Config::with_max_payload(65_507));
    let sh = &l.shared;
    // Nothing to read yet: a read clears any readiness the runtime assumed.
    assert!(sh.pump().is_err());
    let (old, old_waker) = counter();
    let (new, new_waker) = counter();
    sh.reader.store(ACCEPT_READER, Ordering::SeqCst);
    let mut old_cx = Context::from_waker(&old_waker);
    assert!(sh.poll_socket(ACCEPT_READER, &mut old_cx).is_pending());
    // A connection takes the reader role and registers.
    sh.reader.store(CONN_READER, Ordering::SeqCst);
    let mut new_cx = Context::from_waker(&new_waker);
    assert!(sh.poll_socket(CONN_READER, &mut new_cx).is_pending());
    // The old reader polls again before it notices: told to look again, not registered.
    assert!(matches!(
        sh.poll_socket(ACCEPT_READER, &mut old_cx),
        Poll::Ready(Ok(()))
    ));
    let peer = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    peer.send_to(b"x", addr).unwrap();
    // Let the runtime see the datagram.
    for _ in 0..100 {
        if new.0.load(Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(
        new.0.load(Ordering::SeqCst),
        1,
        "the new reader was not woken"
    );
    assert_eq!(old.0.load(Ordering::SeqCst), 0);
    sh.reader.store(NO_READER, Ordering::SeqCst);
}

/// A listener with `n` accepted connections, each having read its first datagram, and
/// their clients.
async fn accepted(
    n: usize,
) -> (
    Listener<tokio::net::UdpSocket>,
    Vec<tokio::net::UdpSocket>,
    Vec<Arc<ServerConnection<tokio::net::UdpSocket>>>,
) {
    use chunnel::Listener as _;
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let to = sock.local_addr().unwrap();
    let mut l = Listener::new(sock, Config::with_max_payload(65_507));
    let (mut cs, mut ss) = (Vec::new(), Vec::new());
    for i in 0..n {
        let c = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        c.connect(to).await.unwrap();
        c.send(&[i as u8]).await.unwrap();
        let s = Arc::new(l.accept().await.unwrap());
        let mut sl = [None];
        assert_eq!(s.recv(&mut sl).await.unwrap(), 1);
        cs.push(c);
        ss.push(s);
    }
    assert_eq!(l.shared.reader.load(Ordering::SeqCst), NO_READER);
    (l, cs, ss)
}

/// A task receiving one datagram on `s`; its first byte.
fn receiving(s: Arc<ServerConnection<tokio::net::UdpSocket>>) -> tokio::task::JoinHandle<u8> {
    tokio::spawn(async move {
        let mut sl = [None];
        s.recv(&mut sl).await.unwrap();
        sl[0].take().unwrap()[0]
    })
}

const SETTLE: std::time::Duration = std::time::Duration::from_millis(100);
const WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Two receives on one connection both wait for the reader role: both are served (the
/// connection counts its waiting receives; a per-connection flag would leave the second
/// unlisted and asleep).
#[tokio::test]
async fn two_receives_of_one_connection_both_get_the_reader_role() {
    let (l, cs, ss) = accepted(2).await;
    let holder = receiving(ss[1].clone());
    tokio::time::sleep(SETTLE).await;
    assert_eq!(l.shared.reader.load(Ordering::SeqCst), CONN_READER);
    let (t1, t2) = (receiving(ss[0].clone()), receiving(ss[0].clone()));
    tokio::time::sleep(SETTLE).await;
    cs[1].send(b"x").await.unwrap();
    assert_eq!(holder.await.unwrap(), b'x');
    tokio::time::sleep(SETTLE).await;
    cs[0].send(b"1").await.unwrap();
    tokio::time::sleep(SETTLE).await;
    cs[0].send(b"2").await.unwrap();
    let both = async { (t1.await.unwrap(), t2.await.unwrap()) };
    let mut got = tokio::time::timeout(WAIT, both)
        .await
        .map(|(a, b)| [a, b])
        .expect("both receives of the connection get a datagram");
    got.sort_unstable();
    assert_eq!(got, [b'1', b'2']);
}

/// A receive offered the reader role and cancelled before it ran passes the offer on:
/// the next waiting connection gets the reader role (otherwise the offer would be lost, and
/// the socket left unread).
#[tokio::test]
async fn an_offer_to_a_cancelled_receive_goes_to_the_next_waiter() {
    let (l, cs, ss) = accepted(3).await;
    let holder = receiving(ss[1].clone());
    tokio::time::sleep(SETTLE).await;
    assert_eq!(l.shared.reader.load(Ordering::SeqCst), CONN_READER);
    let mut sl = [None];
    let mut first = Box::pin(ss[0].recv(&mut sl));
    // Polled once: listed first.
    let mut cx = Context::from_waker(Waker::noop());
    assert!(first.as_mut().poll(&mut cx).is_pending());
    let second = receiving(ss[2].clone()); // listed second
    tokio::time::sleep(SETTLE).await;
    assert_eq!(l.shared.vacancy_waiters.load(Ordering::SeqCst), 2);
    cs[1].send(b"x").await.unwrap();
    assert_eq!(holder.await.unwrap(), b'x');
    // The reader role was offered to the first, which is cancelled without running.
    drop(first);
    cs[2].send(b"y").await.unwrap();
    let got = tokio::time::timeout(WAIT, second).await;
    assert_eq!(
        got.expect("the second waiter reads its datagram").unwrap(),
        b'y'
    );
}

/// A connection waiting for the reader role is offered it through its own wake-up,
/// once; one that stopped waiting is skipped; the list of waiters stays bounded however
/// often connections start and stop waiting.
#[tokio::test]
async fn the_reader_role_is_offered_to_a_waiting_connection_through_its_own_wake_up() {
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let l = Listener::new(sock, Config::with_max_payload(65_507));
    let sh = &l.shared;
    let addr = |i: u16| std::net::SocketAddr::from(([127, 0, 0, 1], i));
    let (a, b) = (
        Arc::new(Peer::new(addr(1), PeerQueue::default())),
        Arc::new(Peer::new(addr(2), PeerQueue::default())),
    );
    for _ in 0..1000 {
        drop(sh.want_reader_role(&a));
    }
    assert_eq!(sh.vacancy_waiters.load(Ordering::SeqCst), 0);
    assert!(lock(&sh.vacancy).len() <= 17, "swept as it grows");
    let gone = sh.want_reader_role(&a);
    let waiting = sh.want_reader_role(&b);
    drop(gone); // `a` stops waiting: skipped
    assert_eq!(sh.vacancy_waiters.load(Ordering::SeqCst), 1);
    let woken = b.notify.notified();
    tokio::pin!(woken);
    woken.as_mut().enable();
    sh.offer_reader_role();
    assert_eq!(sh.vacancy_waiters.load(Ordering::SeqCst), 0);
    assert_eq!(b.wants_reader_role.load(Ordering::SeqCst), 0);
    tokio::time::timeout(std::time::Duration::from_secs(5), woken)
        .await
        .expect("the waiting connection is woken");
    // Offered already: stopping its wait does not count it off twice.
    drop(waiting);
    assert_eq!(sh.vacancy_waiters.load(Ordering::SeqCst), 0);
    sh.offer_reader_role(); // nobody waits: nothing
    assert_eq!(sh.vacancy_waiters.load(Ordering::SeqCst), 0);
}
