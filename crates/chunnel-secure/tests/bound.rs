//! The server's agreeing BOUND (docs/wire.md §16.4–16.5) is held back to ride with the
//! application's first reply, and never held long: on real loopback sockets, for every
//! transport, on first contact (BIND) and on a reconnect (REBIND).
#![cfg(feature = "quic")]

mod common;

use std::time::Duration;

use bytes::Bytes;
use std::sync::atomic::{AtomicBool, Ordering};

use chunnel::ConnectionExt;
use chunnel_secure::negotiated::{Client, Connection, Policy, Server, Transport};
use common::{BOUND, Pki};

use Transport::{Plain, Quic, Tls};

async fn server(pki: &Pki, t: Transport, delay: Option<Duration>) -> Server {
    let mut b = Server::builder([t]).identity(pki.server.identity());
    if let Some(d) = delay {
        b = b.bound_delay(d);
    }
    b.bind("127.0.0.1:0".parse().unwrap()).await.unwrap()
}

fn client(pki: &Pki) -> Client {
    Client::builder([Quic, Tls, Plain])
        .trust(pki.ca.roots(), "localhost")
        .policy(Policy::AllowPlaintext)
        .build()
        .unwrap()
}

async fn accept(s: &mut Server) -> Connection {
    tokio::time::timeout(BOUND, s.accept())
        .await
        .expect("no connection within the bound")
        .unwrap()
        .unwrap()
}

/// Polls `f` once: its output if it is ready without waiting.
async fn ready_now<F: std::future::Future>(f: F) -> Option<F::Output> {
    use std::task::Poll;
    let mut f = std::pin::pin!(f);
    std::future::poll_fn(|cx| {
        Poll::Ready(match f.as_mut().poll(cx) {
            Poll::Ready(v) => Some(v),
            Poll::Pending => None,
        })
    })
    .await
}

/// With the BOUND held for as long as it takes, on a secure pick the client's connect (its
/// first message behind the BIND or REBIND) finishes only when the server's application
/// replies, and the reply is then already there: it came in the same write as the BOUND.
/// Twice per transport, so the second secure connect is a REBIND. On plaintext the client
/// sends only after the BOUND, so the server's first receive sends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bound_rides_with_the_first_reply() {
    let pki = Pki::new();
    for t in [Quic, Tls, Plain] {
        let mut s = server(&pki, t, Some(Duration::from_secs(3600))).await;
        let addr = s.local_addr();
        let c = client(&pki);
        for round in 0..2 {
            let connected = AtomicBool::new(false);
            let connect = async {
                let r = c.connect_with(addr, [Bytes::from_static(b"ping")]).await;
                connected.store(true, Ordering::SeqCst);
                r
            };
            let serve = async {
                let conn = accept(&mut s).await;
                assert_eq!(conn.recv_one().await.unwrap(), "ping");
                // Were the BOUND sent on its own, the client would be in by now.
                // (On plaintext the client sends only after a checked BOUND, so the server's
                // receive has sent it.)
                tokio::time::sleep(Duration::from_millis(20)).await;
                assert!(
                    !t.is_secure() || !connected.load(Ordering::SeqCst),
                    "{t} round {round}: the client got in before the reply"
                );
                conn.send_one(Bytes::from_static(b"pong")).await.unwrap();
                conn
            };
            let (cc, _sc) = tokio::join!(connect, serve);
            let cc = cc.unwrap();
            assert_eq!(cc.transport(), t);
            let reply = match t.is_secure() {
                true => ready_now(cc.recv_one()).await,
                false => Some(cc.recv_one().await),
            };
            assert!(
                matches!(&reply, Some(Ok(m)) if m == "pong"),
                "{t} round {round}: the reply did not arrive with the BOUND: {reply:?}"
            );
        }
        if t.is_secure() {
            assert_eq!(c.remembered(), 1, "{t}: the second connect was no REBIND");
        }
    }
}

/// An application that takes a connection and neither sends nor receives still lets the
/// client in: the BOUND goes alone after the server's bound delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_only_holds_the_connection_lets_the_client_in() {
    let pki = Pki::new();
    for t in [Quic, Tls, Plain] {
        let mut s = server(&pki, t, None).await;
        let addr = s.local_addr();
        let c = client(&pki);
        for _ in 0..2 {
            let (cc, _held) =
                tokio::join!(tokio::time::timeout(BOUND, c.connect(addr)), accept(&mut s));
            let cc = cc.expect("connect waits for a BOUND never sent").unwrap();
            assert_eq!(cc.transport(), t);
        }
    }
}

/// An application that only receives: its first `recv` that would wait sends the BOUND, the
/// client's connect returns and everything the client then sends arrives, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_only_receives_gets_everything() {
    let pki = Pki::new();
    for t in [Quic, Tls, Plain] {
        let mut s = server(&pki, t, Some(Duration::from_secs(3600))).await;
        let addr = s.local_addr();
        let c = client(&pki);
        let n = 200u32;
        let send = async {
            let cc = c
                .connect_with(addr, [Bytes::from(0u32.to_be_bytes().to_vec())])
                .await
                .unwrap();
            for i in 1..n {
                cc.send_one(Bytes::from(i.to_be_bytes().to_vec()))
                    .await
                    .unwrap();
            }
            cc
        };
        let receive = async {
            let conn = accept(&mut s).await;
            for i in 0..n {
                let m = tokio::time::timeout(BOUND, conn.recv_one())
                    .await
                    .expect("a message never came")
                    .unwrap();
                assert_eq!(&m[..], &i.to_be_bytes()[..], "{t}");
            }
            conn
        };
        let (_cc, _sc) = tokio::join!(send, receive);
    }
}

/// Many tasks sending on a fresh server connection at once: the BOUND still goes first
/// (the client would reject anything else as a malformed BOUND), and every message arrives,
/// each sender's in its order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_sends_keep_the_bound_first() {
    let pki = Pki::new();
    const SENDERS: u8 = 8;
    const EACH: u8 = 50;
    for t in [Quic, Tls, Plain] {
        let mut s = server(&pki, t, Some(Duration::from_secs(3600))).await;
        let addr = s.local_addr();
        let c = client(&pki);
        let serve = async {
            let conn = std::sync::Arc::new(accept(&mut s).await);
            let tasks: Vec<_> = (0..SENDERS)
                .map(|k| {
                    let conn = std::sync::Arc::clone(&conn);
                    tokio::spawn(async move {
                        for i in 0..EACH {
                            conn.send_one(Bytes::from(vec![k, i])).await.unwrap();
                        }
                    })
                })
                .collect();
            for task in tasks {
                task.await.unwrap();
            }
            conn
        };
        let (cc, _sc) = tokio::join!(c.connect(addr), serve);
        let cc = cc.unwrap();
        let mut next = [0u8; SENDERS as usize];
        for _ in 0..u32::from(SENDERS) * u32::from(EACH) {
            let m = tokio::time::timeout(BOUND, cc.recv_one())
                .await
                .expect("a message never came")
                .unwrap();
            let (k, i) = (usize::from(m[0]), m[1]);
            assert_eq!(i, next[k], "{t}: sender {k} out of order");
            next[k] += 1;
        }
        assert!(next.iter().all(|&n| n == EACH), "{t}: {next:?}");
    }
}
