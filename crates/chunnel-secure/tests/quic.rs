//! The QUIC datapath on real loopback UDP with rcgen-made certificates: echo in both modes,
//! concurrent senders, certificate failures with their typed errors, mutual TLS, a peer that
//! stops reading, many clients, migration, and interop with plain quinn code both ways.
#![cfg(feature = "quic")]

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ConnectionExt, Listener as _, Negotiate};
use chunnel_secure::quic::{self, Mode};
use chunnel_secure::{ClientConfig, DetectedBy, Error, ServerConfig};
use common::*;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::sync::mpsc;

const LOOPBACK: &str = "127.0.0.1:0";

type SeenQuic = Result<quic::Session, Error>;

/// A QUIC listener on loopback in `mode` that echoes every message of every client and
/// reports each handshake's outcome.
fn quic_echo_server(cfg: ServerConfig, mode: Mode) -> (SocketAddr, mpsc::Receiver<SeenQuic>) {
    let mut l = quic::Listener::bind(LOOPBACK.parse().unwrap(), cfg, mode).unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            match l.accept_client().await {
                Ok(Ok(c)) => {
                    let _ = tx.send(Ok(c.session().clone())).await;
                    tokio::spawn(async move {
                        let mut slots = vec![None; 16];
                        while let Ok(n) = c.recv(&mut slots).await {
                            let burst: Vec<_> =
                                slots[..n].iter_mut().filter_map(Option::take).collect();
                            if c.send(burst).await.is_err() {
                                break;
                            }
                        }
                    });
                }
                Ok(Err(e)) => {
                    let _ = tx.send(Err(e)).await;
                }
                Err(_) => return,
            }
        }
    });
    (addr, rx)
}

async fn next_quic(rx: &mut mpsc::Receiver<SeenQuic>) -> SeenQuic {
    tokio::time::timeout(BOUND, rx.recv())
        .await
        .expect("server reported nothing in time")
        .expect("server gone")
}

fn client_cfg(pki: &Pki) -> ClientConfig {
    ClientConfig::builder(pki.ca.roots(), "localhost")
        .build()
        .unwrap()
}

async fn connect(addr: SocketAddr, cfg: ClientConfig, mode: Mode) -> quic::Connection {
    tokio::time::timeout(BOUND, quic::Connect::new(addr, cfg, mode).connect_wrap(()))
        .await
        .expect("connect in time")
        .unwrap()
}

/// The typed error of a failed connection attempt: at `connect_wrap`, or (a server refusing
/// the client's certificate after the client's handshake) on the first echo.
async fn refused(addr: SocketAddr, cfg: ClientConfig, mode: Mode) -> Error {
    let r = tokio::time::timeout(BOUND, quic::Connect::new(addr, cfg, mode).connect_wrap(()))
        .await
        .expect("connect bounded");
    let e = match r {
        Err(e) => e,
        Ok(c) => {
            let r = tokio::time::timeout(BOUND, async {
                c.send_one("hello".into()).await?;
                c.recv_one().await
            })
            .await
            .expect("refusal in time");
            r.expect_err("the server must refuse this client")
        }
    };
    match Error::find(&e) {
        Some(t) => clone_shape(t),
        None => panic!("expected a typed chunnel-secure error, got {e:?}"),
    }
}

/// The variant and `by` of an error, owned (Error is not Clone).
fn clone_shape(e: &Error) -> Error {
    match e {
        Error::UnknownCa { peer, by } => Error::UnknownCa {
            peer: peer.clone(),
            by: *by,
        },
        Error::WrongName { peer, by, detail } => Error::WrongName {
            peer: peer.clone(),
            by: *by,
            detail: detail.clone(),
        },
        Error::MissingClientCertificate { peer, by } => Error::MissingClientCertificate {
            peer: peer.clone(),
            by: *by,
        },
        Error::CertificateExpired { peer, by, detail } => Error::CertificateExpired {
            peer: peer.clone(),
            by: *by,
            detail: detail.clone(),
        },
        other => Error::Config {
            what: format!("unexpected: {other:?}"),
        },
    }
}

#[tokio::test]
async fn echo_stream_mode() {
    let pki = Pki::new();
    let (addr, mut rx) = quic_echo_server(
        server_cfg(&pki.server).alpn(["chunnel/1"]).build().unwrap(),
        Mode::Stream,
    );
    let cfg = ClientConfig::builder(pki.ca.roots(), "localhost")
        .alpn(["chunnel/1"])
        .build()
        .unwrap();
    let mut connect = quic::Connect::new(addr, cfg, Mode::Stream);
    assert_eq!(connect.id(), "chunnel/quic-stream/1");
    assert_eq!(connect.capabilities(), Mode::Stream.capabilities());
    assert!(
        connect
            .capabilities()
            .contains(&chunnel_secure::tls::capability())
    );

    let c = connect.connect_wrap(()).await.unwrap();
    assert_eq!(c.mode(), Mode::Stream);
    assert_eq!(c.session().alpn.as_deref(), Some(&b"chunnel/1"[..]));
    assert_eq!(c.session().peer_certificates.len(), 1);
    let server_side = next_quic(&mut rx).await.unwrap();
    assert_eq!(server_side.server_name.as_deref(), Some("localhost"));
    assert!(server_side.peer_certificates.is_empty());

    // Empty, small, around a QUIC packet, and 1 MiB messages, in one burst.
    let sizes = [0usize, 1, 1200, 1500, 64 * 1024, 1024 * 1024];
    let msgs: Vec<Bytes> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| Bytes::from(vec![i as u8; n]))
        .collect();
    c.send(msgs.clone()).await.unwrap();
    for m in &msgs {
        let got = tokio::time::timeout(BOUND, c.recv_one())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&got, m);
    }
    c.close().await.unwrap();
    assert!(c.send_one("late".into()).await.is_err());
}

#[tokio::test]
async fn echo_datagram_mode_and_too_large() {
    let pki = Pki::new();
    let (addr, mut rx) = quic_echo_server(server_cfg(&pki.server).build().unwrap(), Mode::Datagram);
    let mut connect = quic::Connect::new(addr, client_cfg(&pki), Mode::Datagram);
    assert_eq!(connect.id(), "chunnel/quic-dgram/1");
    assert_ne!(
        Mode::Datagram.capabilities(),
        Mode::Stream.capabilities(),
        "the two modes must never pair in negotiation"
    );
    let c = connect.connect_wrap(()).await.unwrap();
    next_quic(&mut rx).await.unwrap();
    let max = c.max_datagram_size().expect("datagrams on");
    assert!(max >= 1000, "max datagram {max}");

    for m in [Bytes::from_static(b"ping"), Bytes::from(vec![7u8; max])] {
        c.send_one(m.clone()).await.unwrap();
        let got = tokio::time::timeout(BOUND, c.recv_one())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, m);
    }
    // Far above any path MTU (path MTU discovery may raise the maximum while we run).
    let big = 64 * 1024;
    match c.send_one(Bytes::from(vec![0u8; big])).await {
        Err(chunnel::Error::MessageTooLarge { len, max: m }) => {
            assert_eq!(len, big);
            assert!(m >= max && m < big, "reported maximum {m}");
        }
        other => panic!("expected MessageTooLarge, got {other:?}"),
    }
    // The connection still works after the refusal.
    echo(&c, "after").await;
    c.close().await.unwrap();
}

/// Eight tasks share one connection; each sends numbered messages. Every message arrives
/// once; in stream mode, each sender's in order.
async fn concurrent_senders(mode: Mode) {
    const SENDERS: u32 = 8;
    const EACH: u32 = 200;
    let pki = Pki::new();
    let mut l = quic::Listener::bind(
        LOOPBACK.parse().unwrap(),
        server_cfg(&pki.server).build().unwrap(),
        mode,
    )
    .unwrap();
    let addr = l.local_addr().unwrap();
    let (c, s) = tokio::join!(connect(addr, client_cfg(&pki), mode), l.accept());
    let (c, s) = (Arc::new(c), s.unwrap());

    let mut tasks = Vec::new();
    for sender in 0..SENDERS {
        let c = Arc::clone(&c);
        tasks.push(tokio::spawn(async move {
            for seq in 0..EACH {
                let m = format!("{sender}:{seq}");
                c.send_one(Bytes::from(m)).await.unwrap();
            }
        }));
    }
    let mut seen: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut slots = vec![None; 32];
    let total = (SENDERS * EACH) as usize;
    let mut got = 0;
    while got < total {
        let n = tokio::time::timeout(BOUND, s.recv(&mut slots))
            .await
            .unwrap_or_else(|_| panic!("{mode:?}: only {got} of {total} arrived"))
            .unwrap();
        for m in slots[..n].iter_mut().filter_map(Option::take) {
            let text = std::str::from_utf8(&m).unwrap();
            let (a, b) = text.split_once(':').unwrap();
            seen.entry(a.parse().unwrap())
                .or_default()
                .push(b.parse().unwrap());
            got += 1;
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(seen.len(), SENDERS as usize);
    for (sender, mut seqs) in seen {
        if mode == Mode::Stream {
            assert_eq!(seqs, (0..EACH).collect::<Vec<_>>(), "sender {sender} order");
        }
        seqs.sort_unstable();
        seqs.dedup();
        assert_eq!(
            seqs.len(),
            EACH as usize,
            "sender {sender}: each exactly once"
        );
    }
    c.close().await.unwrap();
}

#[tokio::test]
async fn eight_concurrent_senders_stream() {
    concurrent_senders(Mode::Stream).await;
}

#[tokio::test]
async fn eight_concurrent_senders_datagram() {
    concurrent_senders(Mode::Datagram).await;
}

#[tokio::test]
async fn wrong_ca_and_wrong_name_are_typed_and_the_listener_keeps_serving() {
    let pki = Pki::new();
    for mode in [Mode::Stream, Mode::Datagram] {
        // A server whose certificate is from a CA the client does not trust.
        let (addr, mut rx) = quic_echo_server(server_cfg(&pki.other_server).build().unwrap(), mode);
        match refused(addr, client_cfg(&pki), mode).await {
            Error::UnknownCa { by, .. } => assert_eq!(by, DetectedBy::Local),
            other => panic!("{mode:?}: expected UnknownCa, got {other:?}"),
        }
        match next_quic(&mut rx).await {
            Err(Error::UnknownCa { by, .. }) => assert_eq!(by, DetectedBy::Peer),
            other => panic!("{mode:?}: server saw {other:?}"),
        }

        // A server whose certificate is for another name.
        let (addr, mut rx) = quic_echo_server(server_cfg(&pki.wrong_name).build().unwrap(), mode);
        match refused(addr, client_cfg(&pki), mode).await {
            Error::WrongName { by, .. } => assert_eq!(by, DetectedBy::Local),
            other => panic!("{mode:?}: expected WrongName, got {other:?}"),
        }
        assert!(next_quic(&mut rx).await.is_err());
        // The same listener serves a client expecting the right name.
        let ok = ClientConfig::builder(pki.ca.roots(), "not-localhost.example")
            .build()
            .unwrap();
        let c = connect(addr, ok, mode).await;
        echo(&c, "still serving").await;
        assert!(next_quic(&mut rx).await.is_ok());
    }
}

#[tokio::test]
async fn expired_server_certificate() {
    let pki = Pki::new();
    let (addr, _rx) = quic_echo_server(server_cfg(&pki.expired).build().unwrap(), Mode::Stream);
    match refused(addr, client_cfg(&pki), Mode::Stream).await {
        Error::CertificateExpired { by, .. } => assert_eq!(by, DetectedBy::Local),
        other => panic!("expected CertificateExpired, got {other:?}"),
    }
}

#[tokio::test]
async fn mutual_tls_accepted_and_refused() {
    let pki = Pki::new();
    let server = server_cfg(&pki.server)
        .client_auth(pki.ca.roots())
        .build()
        .unwrap();
    let (addr, mut rx) = quic_echo_server(server, Mode::Stream);

    // Accepted: a client certificate from the trusted CA.
    let cfg = ClientConfig::builder(pki.ca.roots(), "localhost")
        .client_identity(pki.client.identity())
        .build()
        .unwrap();
    let c = connect(addr, cfg, Mode::Stream).await;
    echo(&c, "mtls").await;
    let s = next_quic(&mut rx).await.unwrap();
    assert_eq!(
        s.peer_certificates.len(),
        1,
        "server sees the client certificate"
    );

    // Refused: no client certificate.
    match refused(addr, client_cfg(&pki), Mode::Stream).await {
        Error::MissingClientCertificate { by, .. } => assert_eq!(by, DetectedBy::Peer),
        other => panic!("expected MissingClientCertificate, got {other:?}"),
    }
    match next_quic(&mut rx).await {
        Err(Error::MissingClientCertificate { by, .. }) => assert_eq!(by, DetectedBy::Local),
        other => panic!("server saw {other:?}"),
    }

    // Refused: a client certificate from an untrusted CA.
    let cfg = ClientConfig::builder(pki.ca.roots(), "localhost")
        .client_identity(pki.other_client.identity())
        .build()
        .unwrap();
    match refused(addr, cfg, Mode::Stream).await {
        Error::UnknownCa { by, .. } => assert_eq!(by, DetectedBy::Peer),
        other => panic!("expected UnknownCa, got {other:?}"),
    }
    match next_quic(&mut rx).await {
        Err(Error::UnknownCa { by, .. }) => assert_eq!(by, DetectedBy::Local),
        other => panic!("server saw {other:?}"),
    }

    // And the listener still serves a good client.
    let cfg = ClientConfig::builder(pki.ca.roots(), "localhost")
        .client_identity(pki.client.identity())
        .build()
        .unwrap();
    let c = connect(addr, cfg, Mode::Stream).await;
    echo(&c, "still serving").await;
}

/// A server that accepts the connection but never reads: flow control stops the sender
/// (its `send` blocks) long before it has pushed a bounded amount; nothing grows without
/// bound.
#[tokio::test]
async fn a_peer_that_stops_reading_blocks_the_sender() {
    let pki = Pki::new();
    let mut l = quic::Listener::bind(
        LOOPBACK.parse().unwrap(),
        server_cfg(&pki.server).build().unwrap(),
        Mode::Stream,
    )
    .unwrap();
    let addr = l.local_addr().unwrap();
    let (c, s) = tokio::join!(connect(addr, client_cfg(&pki), Mode::Stream), l.accept());
    let _s = s.unwrap(); // held open, never read

    const CHUNK: usize = 64 * 1024;
    const LIMIT: usize = 64 * 1024 * 1024;
    let msg = Bytes::from(vec![1u8; CHUNK]);
    let mut sent = 0usize;
    let blocked = loop {
        match tokio::time::timeout(Duration::from_secs(1), c.send_one(msg.clone())).await {
            Ok(r) => {
                r.unwrap();
                sent += CHUNK;
                assert!(sent < LIMIT, "sent {sent} bytes to a peer that never reads");
            }
            Err(_) => break sent,
        }
    };
    eprintln!("send blocked after {blocked} bytes");
    // quinn's default stream receive window is 1.25 MB: the sender stops about there.
    assert!(
        blocked < 4 * 1024 * 1024,
        "blocked only after {blocked} bytes"
    );
}

#[tokio::test]
async fn many_clients_one_listener() {
    const CLIENTS: usize = 32;
    let pki = Pki::new();
    let (addr, mut rx) = quic_echo_server(server_cfg(&pki.server).build().unwrap(), Mode::Stream);
    let cfg = client_cfg(&pki);
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let cfg = cfg.clone();
        tasks.push(tokio::spawn(async move {
            let c = connect(addr, cfg, Mode::Stream).await;
            let m = Bytes::from(format!("client {i}"));
            c.send_one(m.clone()).await.unwrap();
            let got = tokio::time::timeout(BOUND, c.recv_one())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(got, m);
            c.close().await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for _ in 0..CLIENTS {
        next_quic(&mut rx).await.unwrap();
    }
}

#[tokio::test]
async fn client_migrates_to_a_new_socket() {
    let pki = Pki::new();
    let (addr, _rx) = quic_echo_server(server_cfg(&pki.server).build().unwrap(), Mode::Stream);
    let mut connect = quic::Connect::new(addr, client_cfg(&pki), Mode::Stream);
    let c = connect.connect_wrap(()).await.unwrap();
    echo(&c, "before").await;
    let ep = connect.endpoint().unwrap();
    let old = ep.local_addr().unwrap();
    ep.rebind(std::net::UdpSocket::bind(LOOPBACK).unwrap())
        .unwrap();
    assert_ne!(ep.local_addr().unwrap(), old);
    echo(&c, "after migration").await;
}

#[tokio::test]
async fn garbage_datagrams_do_not_stop_the_listener() {
    let pki = Pki::new();
    let (addr, mut rx) = quic_echo_server(server_cfg(&pki.server).build().unwrap(), Mode::Stream);
    let junk = tokio::net::UdpSocket::bind(LOOPBACK).await.unwrap();
    for n in [0usize, 1, 20, 1200, 1500] {
        let bytes: Vec<u8> = (0..n).map(|i| (i * 31 + 7) as u8).collect();
        junk.send_to(&bytes, addr).await.unwrap();
    }
    let c = connect(addr, client_cfg(&pki), Mode::Stream).await;
    echo(&c, "still serving").await;
    next_quic(&mut rx).await.unwrap();
}

// ---- interop with plain quinn ----

fn plain_roots(pki: &Pki) -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(pki.ca.pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    roots
}

fn plain_client_endpoint(pki: &Pki) -> quinn::Endpoint {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(plain_roots(pki))
        .with_no_client_auth();
    let mut ep = quinn::Endpoint::client(LOOPBACK.parse().unwrap()).unwrap();
    ep.set_default_client_config(quinn::ClientConfig::new(Arc::new(
        QuicClientConfig::try_from(tls).unwrap(),
    )));
    ep
}

fn plain_server_endpoint(pki: &Pki, datagrams: bool) -> quinn::Endpoint {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = CertificateDer::pem_slice_iter(pki.server.cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(pki.server.key.as_bytes()).unwrap();
    let tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    let mut cfg =
        quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(tls).unwrap()));
    if !datagrams {
        let mut t = quinn::TransportConfig::default();
        t.datagram_receive_buffer_size(None);
        cfg.transport_config(Arc::new(t));
    }
    quinn::Endpoint::server(cfg, LOOPBACK.parse().unwrap()).unwrap()
}

fn frame(m: &[u8]) -> Vec<u8> {
    let mut v = (m.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(m);
    v
}

async fn read_frame(r: &mut quinn::RecvStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await.unwrap();
    let mut m = vec![0u8; u32::from_be_bytes(len) as usize];
    r.read_exact(&mut m).await.unwrap();
    m
}

#[tokio::test]
async fn plain_quinn_client_against_listener() {
    let pki = Pki::new();
    let ep = plain_client_endpoint(&pki);

    // Stream mode: one bidirectional stream, length-framed messages.
    let (addr, _rx) = quic_echo_server(server_cfg(&pki.server).build().unwrap(), Mode::Stream);
    let conn = ep.connect(addr, "localhost").unwrap().await.unwrap();
    let (mut s, mut r) = conn.open_bi().await.unwrap();
    for m in [&b"hello"[..], &[], &[9u8; 5000]] {
        s.write_all(&frame(m)).await.unwrap();
        assert_eq!(read_frame(&mut r).await, m);
    }
    s.finish().unwrap();
    conn.close(0u8.into(), b"");

    // Datagram mode: one message per DATAGRAM frame.
    let (addr, _rx) = quic_echo_server(server_cfg(&pki.server).build().unwrap(), Mode::Datagram);
    let conn = ep.connect(addr, "localhost").unwrap().await.unwrap();
    conn.send_datagram(Bytes::from_static(b"dgram")).unwrap();
    let back = tokio::time::timeout(BOUND, conn.read_datagram())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back, "dgram");
    conn.close(0u8.into(), b"");
}

#[tokio::test]
async fn connect_against_plain_quinn_server() {
    let pki = Pki::new();

    // Stream mode: the plain server accepts the stream and echoes frames.
    let ep = plain_server_endpoint(&pki, true);
    let addr = ep.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let conn = ep.accept().await.unwrap().await.unwrap();
        let (mut s, mut r) = conn.accept_bi().await.unwrap();
        for _ in 0..2 {
            let m = read_frame(&mut r).await;
            s.write_all(&frame(&m)).await.unwrap();
        }
        // The client finishes its stream after its messages.
        assert!(r.read_to_end(16).await.unwrap().is_empty());
        s.finish().unwrap();
        let _ = s.stopped().await;
    });
    let c = connect(addr, client_cfg(&pki), Mode::Stream).await;
    echo(&c, "one").await;
    echo(&c, "two").await;
    c.close().await.unwrap();
    assert!(matches!(
        c.recv_one().await,
        Err(chunnel::Error::PeerClosed)
    ));
    server.await.unwrap();

    // Datagram mode.
    let ep = plain_server_endpoint(&pki, true);
    let addr = ep.local_addr().unwrap();
    tokio::spawn(async move {
        let conn = ep.accept().await.unwrap().await.unwrap();
        while let Ok(d) = conn.read_datagram().await {
            let _ = conn.send_datagram(d);
        }
    });
    let c = connect(addr, client_cfg(&pki), Mode::Datagram).await;
    echo(&c, "dgram").await;
    c.close().await.unwrap();
}

#[tokio::test]
async fn datagram_mode_refuses_a_peer_without_datagrams() {
    let pki = Pki::new();
    let ep = plain_server_endpoint(&pki, false);
    let addr = ep.local_addr().unwrap();
    tokio::spawn(async move {
        if let Some(i) = ep.accept().await {
            let _ = i.await;
        }
        ep.wait_idle().await;
    });
    let e = tokio::time::timeout(
        BOUND,
        quic::Connect::new(addr, client_cfg(&pki), Mode::Datagram).connect_wrap(()),
    )
    .await
    .unwrap()
    .expect_err("the peer has no datagrams");
    match Error::find(&e) {
        Some(Error::DatagramsUnsupported { by, .. }) => assert_eq!(*by, DetectedBy::Peer),
        other => panic!("expected DatagramsUnsupported, got {other:?} ({e:?})"),
    }
}

#[tokio::test]
async fn client_handshake_times_out_against_a_silent_peer() {
    let pki = Pki::new();
    // A UDP socket that never answers.
    let silent = tokio::net::UdpSocket::bind(LOOPBACK).await.unwrap();
    let cfg = ClientConfig::builder(pki.ca.roots(), "localhost")
        .handshake_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let started = std::time::Instant::now();
    let e = quic::Connect::new(silent.local_addr().unwrap(), cfg, Mode::Stream)
        .connect_wrap(())
        .await
        .expect_err("nobody answers");
    assert!(started.elapsed() < BOUND);
    assert!(
        matches!(Error::find(&e), Some(Error::HandshakeTimeout { .. })),
        "{e:?}"
    );
}

/// A client that sends its first flight and then stalls: the listener's handshake for it
/// times out with a typed error, and a good client is served meanwhile.
#[tokio::test]
async fn a_client_stalled_mid_handshake_times_out_at_the_listener() {
    let pki = Pki::new();
    let mut l = quic::Listener::bind(
        LOOPBACK.parse().unwrap(),
        server_cfg(&pki.server)
            .handshake_timeout(Duration::from_millis(500))
            .build()
            .unwrap(),
        Mode::Stream,
    )
    .unwrap();
    let addr = l.local_addr().unwrap();

    // Capture a real client Initial on a socket of ours, then replay it to the listener
    // from a socket that never says anything else.
    let trap = tokio::net::UdpSocket::bind(LOOPBACK).await.unwrap();
    let ep = plain_client_endpoint(&pki);
    let _attempt = ep.connect(trap.local_addr().unwrap(), "localhost").unwrap();
    let mut initial = vec![0u8; 2048];
    let (n, _) = tokio::time::timeout(BOUND, trap.recv_from(&mut initial))
        .await
        .unwrap()
        .unwrap();
    trap.send_to(&initial[..n], addr).await.unwrap();

    let good = tokio::spawn({
        let cfg = client_cfg(&pki);
        async move {
            let c = connect(addr, cfg, Mode::Stream).await;
            c.send_one("hi".into()).await.unwrap();
            c
        }
    });
    let mut served = false;
    let mut timed_out = false;
    while !(served && timed_out) {
        match tokio::time::timeout(BOUND, l.accept_client())
            .await
            .expect("listener reports in time")
            .unwrap()
        {
            Ok(c) => {
                assert_eq!(c.recv_one().await.unwrap(), "hi");
                served = true;
            }
            Err(Error::HandshakeTimeout { .. }) => timed_out = true,
            Err(other) => panic!("unexpected failure {other:?}"),
        }
    }
    assert_eq!(l.failed_handshakes(), 1);
    good.await.unwrap();
}

/// The bind configs as `chunnel::Listen`: a select of QUIC and TLS listens on QUIC (the
/// preferred branch) or, fixed to it, on TLS; a real client of the bound datapath is echoed.
#[tokio::test]
async fn a_select_of_quic_and_tls_binds_listens_on_one() {
    use chunnel::{Either, Listen, Side, select};
    use chunnel_secure::tls;
    let pki = Pki::new();
    let any: SocketAddr = LOOPBACK.parse().unwrap();
    let scfg = server_cfg(&pki.server).build().unwrap();
    for side in [None, Some(Side::Right)] {
        let mut s = select(
            quic::Bind::new(any, scfg.clone(), Mode::Stream),
            tls::Bind::new(any, scfg.clone()),
        );
        assert_eq!(s.left.id(), "chunnel/quic-stream/1");
        assert_eq!(s.right.id(), tls::ID);
        if let Some(side) = side {
            s = s.prefer(side);
        }
        let mut l = s.listen().await.unwrap();
        let bound = l.side();
        assert_eq!(bound, side.unwrap_or(Side::Left));
        let addr = match &l {
            Either::Left(q) => q.local_addr().unwrap(),
            Either::Right(t) => t.local_addr().unwrap(),
        };
        // The handshake needs the server to accept meanwhile.
        let (client, server) = tokio::time::timeout(BOUND, async {
            let client = async {
                match bound {
                    Side::Left => quic::Connect::new(addr, client_cfg(&pki), Mode::Stream)
                        .connect_wrap(())
                        .await
                        .map(Either::Left),
                    Side::Right => tls::Connect::new(addr, client_cfg(&pki))
                        .connect_wrap(())
                        .await
                        .map(Either::Right),
                }
            };
            tokio::join!(client, l.accept())
        })
        .await
        .expect("handshake in time");
        let (client, server) = (client.unwrap(), server.unwrap());
        assert_eq!(server.side(), bound);
        tokio::time::timeout(BOUND, async {
            client.send_one("ping".into()).await.unwrap();
            assert_eq!(server.recv_one().await.unwrap(), "ping");
            server.send_one("pong".into()).await.unwrap();
            assert_eq!(client.recv_one().await.unwrap(), "pong");
        })
        .await
        .expect("echo in time");
    }
}
