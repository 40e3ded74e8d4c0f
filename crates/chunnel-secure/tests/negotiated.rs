//! Negotiating between QUIC, TLS over TCP and plaintext (issue 21 item 3) and the transcript
//! binding that stops an on-path attacker from downgrading the pick (item 4), on real
//! loopback sockets with rcgen-made certificates.
//!
//! The attacker is a UDP relay between the client and the server's negotiation socket that
//! rewrites the hello's offers, the accept's pick, or both; when it sends the client to
//! plaintext it points it at a TCP relay of its own. Every byte both relays carry is kept,
//! and the application's marker must never appear in them.
#![cfg(feature = "quic")]

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use chunnel::negotiate::{Capability, ChunnelInfo};
use chunnel::{ChunnelConnection, ConnectionExt};
use chunnel_negotiate::wire::{Accept, Hello, Tag};
use chunnel_secure::Error;
use chunnel_secure::negotiated::{Client, Policy, Server, Tampered, Transport};
use common::{BOUND, Pki};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::mpsc;

use Transport::{Plain, Quic, Tls};

const MARKER: &[u8] = b"APP-SECRET-MARKER-7f3a";

/// A running server: its negotiation address, its endpoints, the client failures it saw.
struct Running {
    addr: SocketAddr,
    endpoints: Vec<(Transport, SocketAddr)>,
    errors: mpsc::Receiver<Error>,
    served: Arc<Mutex<Vec<Transport>>>,
}

impl Running {
    fn endpoint(&self, t: Transport) -> Option<SocketAddr> {
        self.endpoints
            .iter()
            .find(|(e, _)| *e == t)
            .map(|(_, a)| *a)
    }
}

/// Starts a server offering `order` that echoes every message.
async fn serve(order: &[Transport], identity: Option<chunnel_secure::Identity>) -> Running {
    let mut b = Server::builder(order.iter().copied());
    if let Some(id) = identity {
        b = b.identity(id);
    }
    serve_with(b).await
}

/// Starts the server `b` builds, echoing every message.
async fn serve_with(b: chunnel_secure::negotiated::ServerBuilder) -> Running {
    let mut server = b.bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = server.local_addr();
    let endpoints = [Quic, Tls, Plain]
        .into_iter()
        .filter_map(|t| server.endpoint(t).map(|a| (t, a)))
        .collect();
    let (tx, errors) = mpsc::channel(1024);
    let served = Arc::new(Mutex::new(Vec::new()));
    let s = Arc::clone(&served);
    tokio::spawn(async move {
        while let Ok(r) = server.accept().await {
            match r {
                Ok(conn) => {
                    s.lock().unwrap().push(conn.transport());
                    tokio::spawn(async move {
                        while let Ok(m) = conn.recv_one().await {
                            if conn.send_one(m).await.is_err() {
                                break;
                            }
                        }
                    });
                }
                Err(e) => {
                    let _ = tx.try_send(e);
                }
            }
        }
    });
    Running {
        addr,
        endpoints,
        errors,
        served,
    }
}

fn client(pki: &Pki, offers: &[Transport], policy: Policy) -> Client {
    Client::builder(offers.iter().copied())
        .trust(pki.ca.roots(), "localhost")
        .policy(policy)
        .build()
        .unwrap()
}

async fn echo(c: &chunnel_secure::negotiated::Connection, m: &'static str) {
    c.send_one(Bytes::from_static(m.as_bytes())).await.unwrap();
    let got = tokio::time::timeout(BOUND, c.recv_one())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, m);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pick_follows_the_server_preference() {
    let pki = Pki::new();
    let perms: [[Transport; 3]; 6] = [
        [Quic, Tls, Plain],
        [Quic, Plain, Tls],
        [Tls, Quic, Plain],
        [Tls, Plain, Quic],
        [Plain, Quic, Tls],
        [Plain, Tls, Quic],
    ];
    for server_order in [[Quic, Tls, Plain], [Tls, Plain, Quic], [Plain, Quic, Tls]] {
        let s = serve(&server_order, Some(pki.server.identity())).await;
        for offers in &perms {
            let c = client(&pki, offers, Policy::AllowPlaintext);
            let conn = c.connect(s.addr).await.unwrap();
            assert_eq!(
                conn.transport(),
                server_order[0],
                "server {server_order:?}, client {offers:?}"
            );
            echo(&conn, "hello").await;
        }
        // Subsets: the server's first choice among those the client offers.
        for offers in [[Plain, Tls].as_slice(), &[Quic], &[Tls, Quic], &[Plain]] {
            let want = server_order.iter().find(|t| offers.contains(t)).unwrap();
            let c = if offers == [Plain] {
                // A plaintext-only client needs no trust roots.
                Client::builder([Plain]).build().unwrap()
            } else {
                client(&pki, offers, Policy::AllowPlaintext)
            };
            let conn = c.connect(s.addr).await.unwrap();
            assert_eq!(
                conn.transport(),
                *want,
                "server {server_order:?}, client {offers:?}"
            );
            echo(&conn, "subset").await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incompatible_client_gets_a_clear_error() {
    let pki = Pki::new();
    let mut s = serve(&[Tls], Some(pki.server.identity())).await;
    let c = client(&pki, &[Quic], Policy::AllowPlaintext);
    let e = c.connect(s.addr).await.unwrap_err();
    match &e {
        Error::Negotiation {
            source: chunnel_negotiate::Error::Incompatible { mismatches, .. },
            ..
        } => {
            assert!(!mismatches.is_empty());
            assert_eq!(mismatches[0].kind, "endpoint");
        }
        other => panic!("expected Incompatible, got {other:?}"),
    }
    let text = e.to_string();
    assert!(
        text.contains("endpoint") && text.contains("quic") && text.contains("tls"),
        "{text}"
    );
    // The server reports it too, and keeps serving.
    let se = tokio::time::timeout(BOUND, s.errors.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(se, Error::Negotiation { .. }), "{se:?}");
    let ok = client(&pki, &[Quic, Tls], Policy::AllowPlaintext);
    assert_eq!(ok.connect(s.addr).await.unwrap().transport(), Tls);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chosen_plaintext_pick_is_signed_and_secure_only_refuses_it() {
    let pki = Pki::new();
    // The server prefers plaintext: a client offering TLS too accepts it, since the
    // server's key signed the transcript.
    let s = serve(&[Plain, Tls], Some(pki.server.identity())).await;
    let c = client(&pki, &[Tls, Plain], Policy::AllowPlaintext);
    let conn = c.connect(s.addr).await.unwrap();
    assert_eq!(conn.transport(), Plain);
    echo(&conn, "clear by choice").await;
    // Secure only: plaintext is not even offered; TLS is picked.
    let so = client(&pki, &[Plain, Tls], Policy::SecureOnly);
    assert_eq!(so.offers(), &[Tls]);
    assert_eq!(so.connect(s.addr).await.unwrap().transport(), Tls);
    // Against a plaintext-only server, a secure-only client finds nothing in common.
    let p = serve(&[Plain], Some(pki.server.identity())).await;
    let e = so.connect(p.addr).await.unwrap_err();
    assert!(matches!(e, Error::Negotiation { .. }), "{e:?}");

    // A plaintext-only server without an identity cannot prove its pick to a client that
    // offered a secure option; a plaintext-only client is served.
    let anon = serve(&[Plain], None).await;
    let e = c.connect(anon.addr).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Downgrade {
                tampered: Tampered::Unverified,
                ..
            }
        ),
        "{e:?}"
    );
    let plain_only = Client::builder([Plain]).build().unwrap();
    echo(&plain_only.connect(anon.addr).await.unwrap(), "plain").await;
    // A server whose certificate the client does not trust cannot sign for plaintext.
    let untrusted = serve(&[Plain], Some(pki.other_server.identity())).await;
    let e = c.connect(untrusted.addr).await.unwrap_err();
    assert!(
        matches!(e, Error::Downgrade { tampered: Tampered::Unverified, ref detail, .. } if detail.contains("certificate")),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_clients_at_once() {
    let pki = Pki::new();
    let s = serve(&[Quic, Tls, Plain], Some(pki.server.identity())).await;
    let offers: [&[Transport]; 4] = [&[Quic, Tls, Plain], &[Tls, Plain], &[Plain, Tls], &[Tls]];
    let mut tasks = Vec::new();
    for i in 0..32 {
        let c = client(&pki, offers[i % 4], Policy::AllowPlaintext);
        let addr = s.addr;
        tasks.push(tokio::spawn(async move {
            let conn = c.connect(addr).await.unwrap();
            echo(&conn, "many").await;
            conn.transport()
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let want = if i % 4 == 0 { Quic } else { Tls };
        assert_eq!(tokio::time::timeout(BOUND, t).await.unwrap().unwrap(), want);
    }
    assert_eq!(s.served.lock().unwrap().len(), 32);
}

// ---------------------------------------------------------------------------------------
// The attacker.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Attack {
    /// Strip every secure offer from the hello.
    StripHello,
    /// Change the accept's pick to plaintext (at the attacker's TCP relay).
    AcceptToPlain,
    /// Change the accept's pick from QUIC to TLS (a weaker secure option).
    AcceptToTls,
    /// Both: strip the hello and make the accept consistent for the client.
    Both,
}

/// Everything the relays carried, both ways.
type Captured = Arc<Mutex<Vec<u8>>>;
/// The hello the client sent and the accept the attacker gave it.
type Views = Arc<Mutex<(Vec<u8>, Vec<u8>)>>;

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// A TCP relay to `to`; returns its address.
async fn tcp_relay(to: SocketAddr, cap: Captured, forge: Option<Views>) -> SocketAddr {
    tcp_relay_on(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        to,
        cap,
        forge,
    )
}

/// A TCP relay from `l` to `to`; returns its address.
fn tcp_relay_on(l: TcpListener, to: SocketAddr, cap: Captured, forge: Option<Views>) -> SocketAddr {
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((a, _)) = l.accept().await {
            let Ok(b) = TcpStream::connect(to).await else {
                continue;
            };
            let (ar, aw) = a.into_split();
            let (br, bw) = b.into_split();
            tokio::spawn(pump(ar, bw, Arc::clone(&cap), None));
            tokio::spawn(pump(br, aw, Arc::clone(&cap), forge.clone()));
        }
    });
    addr
}

async fn pump(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    cap: Captured,
    forge: Option<Views>,
) {
    if let Some(views) = forge {
        // The server's first message is its BOUND: replace its account of the negotiation
        // with the client's (status "agreed"), keeping the server's chain and signature.
        let mut len = [0u8; 4];
        if r.read_exact(&mut len).await.is_err() {
            return;
        }
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        if r.read_exact(&mut body).await.is_err() {
            return;
        }
        cap.lock().unwrap().extend_from_slice(&len);
        cap.lock().unwrap().extend_from_slice(&body);
        let (hello, accept) = views.lock().unwrap().clone();
        let mut at = 2;
        for _ in 0..2 {
            let n = u32::from_be_bytes(body[at..at + 4].try_into().unwrap()) as usize;
            at += 4 + n;
        }
        let rest = body[at..].to_vec(); // scheme, chain, signature
        let mut forged = vec![0xb2, 0];
        for part in [&hello, &accept] {
            forged.extend_from_slice(&(part.len() as u32).to_be_bytes());
            forged.extend_from_slice(part);
        }
        forged.extend_from_slice(&rest);
        let mut out = (forged.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(&forged);
        if w.write_all(&out).await.is_err() {
            return;
        }
    }
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        cap.lock().unwrap().extend_from_slice(&buf[..n]);
        if w.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = w.shutdown().await;
}

/// The pick of `transport` in `client`'s offer tree.
fn pick_of(client: &Client, transport: Transport) -> chunnel::Pick {
    client
        .offer_tree()
        .options()
        .into_iter()
        .find(|o| o.chunnels[0].id == transport.id())
        .unwrap()
        .pick
}

fn endpoint_info(t: Transport, addr: SocketAddr) -> ChunnelInfo {
    ChunnelInfo {
        id: t.id().into(),
        capabilities: vec![Capability::exact(
            "endpoint",
            [t.label().to_string(), format!("addr={addr}")],
        )],
    }
}

/// The attacker's UDP relay in front of the server's negotiation socket. Returns the address
/// clients must use.
async fn udp_attacker(
    server: SocketAddr,
    attack: Attack,
    victim: &Client,
    to_plain: SocketAddr,
    to_tls: SocketAddr,
    cap: Captured,
    views: Views,
) -> SocketAddr {
    let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let addr = front.local_addr().unwrap();
    let back = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
    back.connect(server).await.unwrap();
    let stripped = Client::builder([Plain]).build().unwrap().offer_tree();
    let plain_pick = pick_of(victim, Plain);
    let tls_pick = pick_of(victim, Tls);
    let peer: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
    {
        let (front, back, cap, peer) = (front.clone(), back.clone(), cap.clone(), peer.clone());
        let views = Arc::clone(&views);
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while let Ok((n, from)) = front.recv_from(&mut buf).await {
                *peer.lock().unwrap() = Some(from);
                let mut m = buf[..n].to_vec();
                cap.lock().unwrap().extend_from_slice(&m);
                if m[0] == Tag::Hello as u8 {
                    views.lock().unwrap().0 = m.clone();
                }
                if m[0] == Tag::Hello as u8 && matches!(attack, Attack::StripHello | Attack::Both) {
                    let mut h = Hello::decode(&m[1..]).unwrap();
                    h.offers = stripped.clone();
                    m = h.encode().to_vec();
                }
                let _ = back.send(&m).await;
            }
        });
    }
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok(n) = back.recv(&mut buf).await {
            let mut m = buf[..n].to_vec();
            cap.lock().unwrap().extend_from_slice(&m);
            if m[0] == Tag::Accept as u8 {
                let mut a = Accept::decode(&m[1..]).unwrap();
                match attack {
                    Attack::StripHello => {}
                    Attack::AcceptToPlain | Attack::Both => {
                        a.client_pick = plain_pick.clone();
                        a.server_stack = Arc::from(vec![endpoint_info(Plain, to_plain)]);
                    }
                    Attack::AcceptToTls => {
                        a.client_pick = tls_pick.clone();
                        a.server_stack = Arc::from(vec![endpoint_info(Tls, to_tls)]);
                    }
                }
                m = a.encode().to_vec();
                views.lock().unwrap().1 = m.clone();
            }
            let to = *peer.lock().unwrap();
            if let Some(to) = to {
                let _ = front.send_to(&m, to).await;
            }
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_on_path_attacker_cannot_downgrade() {
    let pki = Pki::new();
    // Each attack against `connect` (the application sends once it has the connection) and
    // against `connect_with` (the first message handed over with the connect: behind the
    // BIND on a secure pick, after the checked BOUND on plaintext).
    for (attack, early) in [
        Attack::StripHello,
        Attack::AcceptToPlain,
        Attack::AcceptToTls,
        Attack::Both,
    ]
    .into_iter()
    .flat_map(|a| [(a, false), (a, true)])
    {
        let mut s = serve(&[Quic, Tls, Plain], Some(pki.server.identity())).await;
        let cap: Captured = Arc::default();
        let plain_relay = tcp_relay(s.endpoint(Plain).unwrap(), Arc::clone(&cap), None).await;
        let victim = client(&pki, &[Quic, Tls, Plain], Policy::AllowPlaintext);
        let front = udp_attacker(
            s.addr,
            attack,
            &victim,
            plain_relay,
            s.endpoint(Tls).unwrap(),
            Arc::clone(&cap),
            Views::default(),
        )
        .await;
        let r = if early {
            victim
                .connect_with(front, [Bytes::from_static(MARKER)])
                .await
        } else {
            victim.connect(front).await
        };
        // The application sends its secret only on a connection it was given.
        if let Ok(c) = &r {
            let _ = c.send_one(Bytes::from_static(MARKER)).await;
        }
        let e = r.expect_err(&format!("{attack:?} (early {early}) was not detected"));
        let want = match attack {
            Attack::StripHello => Tampered::Hello,
            Attack::AcceptToPlain | Attack::AcceptToTls => Tampered::Accept,
            Attack::Both => Tampered::HelloAndAccept,
        };
        match &e {
            Error::Downgrade {
                tampered, detail, ..
            } => {
                assert_eq!(*tampered, want, "{attack:?}: {e}");
                assert!(!detail.is_empty());
            }
            other => panic!("{attack:?}: expected Downgrade, got {other:?}"),
        }
        // The server refused the connection too.
        let se = tokio::time::timeout(BOUND, s.errors.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(
            matches!(se, Error::Downgrade { .. }),
            "{attack:?}: server saw {se:?}"
        );
        assert!(
            s.served.lock().unwrap().is_empty(),
            "{attack:?}: server served"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let seen = cap.lock().unwrap().clone();
        assert!(!seen.is_empty());
        assert!(
            !contains(&seen, MARKER),
            "{attack:?}: the marker crossed the relay"
        );
        assert_eq!(
            victim.remembered(),
            0,
            "{attack:?}: a refused pick was remembered"
        );
        println!("{attack:?} (early {early}): {e}");
    }
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

/// On a secure pick `connect_with` sends the first message in the same write as the BIND,
/// without waiting for the BOUND: when the server hands the connection to its application
/// (after reading and checking the BIND, and answering it), that message has already arrived
/// with the BIND and is read without waiting. The client returns only after the BOUND, and the
/// echo then follows. On plaintext the message follows the checked BOUND and is echoed too.
#[tokio::test(flavor = "current_thread")]
async fn on_a_secure_pick_the_first_message_rides_with_the_bind() {
    let pki = Pki::new();
    for t in [Quic, Tls, Plain] {
        let mut server = Server::builder([t])
            .identity(pki.server.identity())
            .bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = server.local_addr();
        let c = client(&pki, &[Quic, Tls, Plain], Policy::AllowPlaintext);
        let connect = c.connect_with(
            addr,
            [Bytes::from_static(b"first"), Bytes::from_static(b"second")],
        );
        let serve = async {
            let conn = tokio::time::timeout(BOUND, server.accept())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            // Read without waiting, as soon as the server's application has the connection.
            let early = ready_now(conn.recv_one()).await;
            let with_bind = early.is_some();
            let first = match early {
                Some(m) => m.unwrap(),
                None => conn.recv_one().await.unwrap(),
            };
            let second = conn.recv_one().await.unwrap();
            assert_eq!((&first[..], &second[..]), (&b"first"[..], &b"second"[..]));
            conn.send(vec![first, second]).await.unwrap();
            (conn, with_bind)
        };
        let (cc, (sc, with_bind)) = tokio::join!(connect, serve);
        let cc = cc.unwrap();
        assert_eq!((cc.transport(), sc.transport()), (t, t));
        if t.is_secure() {
            assert!(
                with_bind,
                "{t}: the first message did not come with the BIND"
            );
        }
        for want in ["first", "second"] {
            let got = tokio::time::timeout(BOUND, cc.recv_one())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(got, want, "{t}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secure_only_refuses_a_plaintext_accept_outright() {
    let pki = Pki::new();
    let s = serve(&[Quic, Tls, Plain], Some(pki.server.identity())).await;
    let cap: Captured = Arc::default();
    let plain_relay = tcp_relay(s.endpoint(Plain).unwrap(), Arc::clone(&cap), None).await;
    let victim = client(&pki, &[Quic, Tls], Policy::SecureOnly);
    // The victim never offered plaintext, so the attacker has no plaintext pick of its tree
    // to name; it names the TLS pick with a plaintext server stack.
    let offers_plain = client(&pki, &[Tls, Plain], Policy::AllowPlaintext);
    let front = udp_attacker(
        s.addr,
        Attack::AcceptToPlain,
        &offers_plain,
        plain_relay,
        s.endpoint(Tls).unwrap(),
        Arc::clone(&cap),
        Views::default(),
    )
    .await;
    let e = victim.connect(front).await.unwrap_err();
    assert!(matches!(e, Error::PlaintextRefused { .. }), "{e:?}");
    let seen = cap.lock().unwrap().clone();
    assert!(!contains(&seen, MARKER));
}

/// The attacker changes the pick to plaintext and, on its TCP relay, rewrites the server's
/// BOUND to agree with what the client saw: the server's signature no longer verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_plaintext_bound_does_not_verify() {
    let pki = Pki::new();
    let mut s = serve(&[Quic, Tls, Plain], Some(pki.server.identity())).await;
    let cap: Captured = Arc::default();
    let views = Views::default();
    let plain_relay = tcp_relay(
        s.endpoint(Plain).unwrap(),
        Arc::clone(&cap),
        Some(Arc::clone(&views)),
    )
    .await;
    let victim = client(&pki, &[Quic, Tls, Plain], Policy::AllowPlaintext);
    let front = udp_attacker(
        s.addr,
        Attack::AcceptToPlain,
        &victim,
        plain_relay,
        s.endpoint(Tls).unwrap(),
        Arc::clone(&cap),
        Arc::clone(&views),
    )
    .await;
    let r = victim.connect(front).await;
    if let Ok(c) = &r {
        let _ = c.send_one(Bytes::from_static(MARKER)).await;
    }
    let e = r.expect_err("a forged BOUND was accepted");
    assert!(
        matches!(e, Error::Downgrade { tampered: Tampered::Unverified, ref detail, .. } if detail.contains("signature")),
        "{e:?}"
    );
    let se = tokio::time::timeout(BOUND, s.errors.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(se, Error::Downgrade { .. }), "{se:?}");
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(!contains(&cap.lock().unwrap(), MARKER));
}

/// A UDP relay in front of a negotiation socket (or a QUIC endpoint) that counts the
/// client's datagrams and keeps every byte it carries in `cap`; its server can be switched.
/// Returns the address clients use, the count and the switch.
async fn counting_relay(
    server: SocketAddr,
    cap: Captured,
) -> (
    SocketAddr,
    Arc<std::sync::atomic::AtomicUsize>,
    Arc<Mutex<SocketAddr>>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let addr = front.local_addr().unwrap();
    let back = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let count = Arc::new(AtomicUsize::new(0));
    let to = Arc::new(Mutex::new(server));
    let peer: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
    {
        let (front, back, count, to, peer, cap) = (
            front.clone(),
            back.clone(),
            count.clone(),
            to.clone(),
            peer.clone(),
            cap.clone(),
        );
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while let Ok((n, from)) = front.recv_from(&mut buf).await {
                count.fetch_add(1, Ordering::SeqCst);
                cap.lock().unwrap().extend_from_slice(&buf[..n]);
                *peer.lock().unwrap() = Some(from);
                let dst = *to.lock().unwrap();
                let _ = back.send_to(&buf[..n], dst).await;
            }
        });
    }
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok((n, _)) = back.recv_from(&mut buf).await {
            cap.lock().unwrap().extend_from_slice(&buf[..n]);
            let p = *peer.lock().unwrap();
            if let Some(p) = p {
                let _ = front.send_to(&buf[..n], p).await;
            }
        }
    });
    (addr, count, to)
}

fn sent(c: &std::sync::atomic::AtomicUsize) -> usize {
    c.load(std::sync::atomic::Ordering::SeqCst)
}

/// Issue 21 item 5 / docs/wire.md §16.5: a reconnect to a server whose secure pick the
/// client verified goes straight to the remembered endpoint — not one negotiation datagram —
/// with the first message behind the REBIND inside the secure channel; plaintext is never
/// remembered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_uses_the_remembered_secure_pick() {
    let pki = Pki::new();
    for order in [[Quic, Tls, Plain], [Tls, Quic, Plain]] {
        let s = serve(&order, Some(pki.server.identity())).await;
        let (front, count, _) = counting_relay(s.addr, Arc::default()).await;
        let c = client(&pki, &[Quic, Tls, Plain], Policy::AllowPlaintext);
        let first = c
            .connect_with(front, [Bytes::from_static(b"one")])
            .await
            .unwrap();
        assert_eq!(first.transport(), order[0]);
        assert_eq!(first.recv_one().await.unwrap(), "one");
        let negotiated = sent(&count);
        assert!(negotiated > 0);
        assert_eq!(c.remembered(), 1);
        for i in 0..3 {
            let again = c
                .connect_with(front, [Bytes::from_static(b"two")])
                .await
                .unwrap();
            assert_eq!(again.transport(), order[0], "reconnect {i}");
            let got = tokio::time::timeout(BOUND, again.recv_one())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(got, "two");
            echo(&again, "three").await;
        }
        assert_eq!(
            sent(&count),
            negotiated,
            "{order:?}: a reconnect sent negotiation datagrams"
        );
        assert_eq!(s.served.lock().unwrap().len(), 4);
        // Turned off: every connect negotiates.
        let off = Client::builder([Quic, Tls])
            .trust(pki.ca.roots(), "localhost")
            .remember(0)
            .build()
            .unwrap();
        let before = sent(&count);
        off.connect(front).await.unwrap();
        let mid = sent(&count);
        off.connect(front).await.unwrap();
        assert!(mid > before && sent(&count) > mid);
        assert_eq!(off.remembered(), 0);
    }
    // A (signed) plaintext pick is never remembered: the next connect negotiates again.
    let s = serve(&[Plain], Some(pki.server.identity())).await;
    let (front, count, _) = counting_relay(s.addr, Arc::default()).await;
    let c = client(&pki, &[Quic, Tls, Plain], Policy::AllowPlaintext);
    let p = c.connect(front).await.unwrap();
    assert_eq!(p.transport(), Plain);
    assert_eq!(c.remembered(), 0);
    let once = sent(&count);
    c.connect(front).await.unwrap();
    assert!(sent(&count) > once);
}

/// docs/wire.md §16.5: a server restarted with another preference (same endpoints) answers
/// the REBIND with "negotiate afresh"; the client does, lands on the new pick, and the first
/// message is delivered exactly once, on the new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_preference_forces_a_fresh_negotiation() {
    let pki = Pki::new();
    let mut old = Server::builder([Tls, Quic])
        .identity(pki.server.identity())
        .bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let tls_at = old.endpoint(Tls).unwrap();
    let (front, count, switch) = counting_relay(old.local_addr(), Arc::default()).await;
    let c = client(&pki, &[Quic, Tls], Policy::AllowPlaintext);
    let (conn, accepted) = tokio::join!(c.connect(front), old.accept());
    let conn = conn.unwrap();
    assert_eq!(conn.transport(), Tls);
    assert_eq!(c.remembered(), 1);
    drop((conn, accepted, old));
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;

    // The new server prefers QUIC, and its TLS endpoint is where the old one was.
    let mut server = Server::builder([Quic, Tls])
        .identity(pki.server.identity())
        .endpoint(Tls, tls_at)
        .bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    assert_eq!(server.endpoint(Tls), Some(tls_at));
    *switch.lock().unwrap() = server.local_addr();
    let before = sent(&count);
    let (conn, accepted) =
        tokio::join!(c.connect_with(front, [Bytes::from_static(MARKER)]), async {
            // The refused REBIND is no failure: the next accept is the fresh QUIC connection.
            tokio::time::timeout(BOUND, server.accept()).await
        });
    let conn = conn.unwrap();
    assert_eq!(conn.transport(), Quic);
    assert!(sent(&count) > before, "no fresh negotiation");
    let s = accepted.unwrap().unwrap().unwrap();
    assert_eq!(s.transport(), Quic);
    assert_eq!(s.recv_one().await.unwrap(), MARKER);
    // Nothing else reached the application: the TLS attempt's copy was dropped.
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(200), server.accept())
            .await
            .is_err()
    );
    assert!(
        ready_now(s.recv_one()).await.is_none(),
        "the first message was delivered twice"
    );
    // The new pick is remembered in its place.
    assert_eq!(c.remembered(), 1);
    let before = sent(&count);
    let (again, _) = tokio::join!(c.connect(front), server.accept());
    assert_eq!(again.unwrap().transport(), Quic);
    assert_eq!(sent(&count), before);
}

/// Issue 21 item 5, by byte capture: no application byte travels in the clear, neither on
/// first contact (BIND) nor on a reconnect (REBIND). The server advertises its endpoint at a
/// relay that keeps every byte it carries (a UDP relay for QUIC, a TCP relay for TLS), the
/// negotiation datagrams go through another; the client connects three times (the last two
/// are REBINDs to the remembered endpoint, i.e. the relay) with the marker behind the BIND
/// or REBIND, which is echoed each time and never appears in what the relays carried. The
/// same relays on a plaintext pick do see it, so the capture can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_application_byte_in_the_clear_on_first_contact_or_reconnect() {
    let pki = Pki::new();
    for t in [Quic, Tls, Plain] {
        let cap: Captured = Arc::default();
        let tcp_front = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let unset: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let (udp_front, _, udp_to) = counting_relay(unset, Arc::clone(&cap)).await;
        let front_of = |t| match t {
            Quic => udp_front,
            _ => tcp_front.local_addr().unwrap(),
        };
        let s = serve_with(
            Server::builder([t])
                .identity(pki.server.identity())
                .advertise(t, front_of(t)),
        )
        .await;
        let endpoint = s.endpoint(t).unwrap();
        match t {
            Quic => *udp_to.lock().unwrap() = endpoint,
            _ => {
                tcp_relay_on(tcp_front, endpoint, Arc::clone(&cap), None);
            }
        }
        let (front, _, _) = counting_relay(s.addr, Arc::clone(&cap)).await;
        let c = client(&pki, &[Quic, Tls, Plain], Policy::AllowPlaintext);
        for round in 0..3 {
            let conn =
                tokio::time::timeout(BOUND, c.connect_with(front, [Bytes::from_static(MARKER)]))
                    .await
                    .unwrap()
                    .unwrap();
            assert_eq!(conn.transport(), t);
            let got = tokio::time::timeout(BOUND, conn.recv_one())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(got, MARKER, "{t} round {round}");
        }
        assert_eq!(c.remembered(), usize::from(t.is_secure()), "{t}");
        assert_eq!(s.served.lock().unwrap().len(), 3, "{t}");
        let captured = cap.lock().unwrap();
        assert!(captured.len() > 1000, "{t}: the relays carried nothing");
        assert_eq!(
            contains(&captured, MARKER),
            !t.is_secure(),
            "{t}: the marker in the clear: {}",
            contains(&captured, MARKER)
        );
    }
}
