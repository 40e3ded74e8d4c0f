//! The TLS datapath on real loopback sockets with rcgen-made certificates: echo, resumption,
//! mutual TLS, and every handshake failure with its typed error, each followed by a good
//! client the server still serves.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ConnectionExt, Negotiate};
use chunnel_secure::{ClientConfig, DetectedBy, Error, tls};
use common::*;
use tokio::io::AsyncWriteExt;

fn client(roots: chunnel_secure::TrustRoots, name: &str) -> chunnel_secure::ClientConfigBuilder {
    ClientConfig::builder(roots, name)
}

/// Connects and expects a typed handshake error.
async fn connect_err(addr: std::net::SocketAddr, cfg: ClientConfig) -> Error {
    let r = tokio::time::timeout(BOUND, tls::Connect::new(addr, cfg).connect_wrap(()))
        .await
        .expect("client handshake bounded");
    let e = r.expect_err("handshake must fail");
    match e {
        chunnel::Error::Layer { layer, source } => {
            assert_eq!(layer, tls::ID);
            *source
                .downcast::<Error>()
                .expect("typed chunnel-secure error")
        }
        other => panic!("expected a typed TLS error, got {other:?}"),
    }
}

/// A good client still gets an echo from the server at `addr`.
async fn good_client_served(
    pki: &Pki,
    addr: std::net::SocketAddr,
    rx: &mut tokio::sync::mpsc::Receiver<Seen>,
) {
    let cfg = client(pki.ca.roots(), "localhost")
        .client_identity(pki.client.identity())
        .build()
        .unwrap();
    let c = tls::Connect::new(addr, cfg).connect_wrap(()).await.unwrap();
    echo(&c, "still serving").await;
    assert!(next(rx).await.is_ok());
}

#[tokio::test]
async fn echo_many_sizes_and_resumption() {
    let pki = Pki::new();
    let (addr, mut rx) =
        echo_server(server_cfg(&pki.server).alpn(["chunnel/1"]).build().unwrap()).await;
    let cfg = client(pki.ca.roots(), "localhost")
        .alpn(["chunnel/1"])
        .build()
        .unwrap();
    let mut connect = tls::Connect::new(addr, cfg);
    assert_eq!(connect.id(), "chunnel/tls/1");
    assert_eq!(connect.capabilities(), vec![tls::capability()]);

    let c = connect.connect_wrap(()).await.unwrap();
    let s = c.session();
    assert_eq!(s.version, Some(rustls::ProtocolVersion::TLSv1_3));
    assert_eq!(s.alpn.as_deref(), Some(&b"chunnel/1"[..]));
    assert!(!s.resumed);
    assert_eq!(s.peer_certificates.len(), 1);
    let server_side = next(&mut rx).await.unwrap();
    assert_eq!(server_side.version, Some(rustls::ProtocolVersion::TLSv1_3));
    assert!(server_side.peer_certificates.is_empty());

    // Sizes around TLS's 16 KiB record and a 1 MiB message, sent as one burst.
    let sizes = [
        0usize,
        1,
        100,
        16 * 1024 - 1,
        16 * 1024,
        16 * 1024 + 5,
        1 << 20,
    ];
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
    for _ in 0..200 {
        echo(&c, "ping").await;
    }
    c.close().await.unwrap();

    // A second connection from a clone of the same Connect resumes the session.
    tokio::time::sleep(Duration::from_millis(50)).await; // the tickets arrive after the handshake
    let c2 = connect.clone().connect_wrap(()).await.unwrap();
    assert!(c2.session().resumed, "second connection must resume");
    echo(&c2, "resumed").await;
    assert!(next(&mut rx).await.unwrap().resumed);
}

#[tokio::test]
async fn mutual_tls_accepted() {
    let pki = Pki::new();
    let (addr, mut rx) = echo_server(
        server_cfg(&pki.server)
            .client_auth(pki.ca.roots())
            .build()
            .unwrap(),
    )
    .await;
    let cfg = client(pki.ca.roots(), "localhost")
        .client_identity(pki.client.identity())
        .build()
        .unwrap();
    let c = tls::Connect::new(addr, cfg).connect_wrap(()).await.unwrap();
    echo(&c, "mutual").await;
    let seen = next(&mut rx).await.unwrap();
    assert_eq!(
        seen.peer_certificates.len(),
        1,
        "server sees the client's certificate"
    );
}

/// The client learns a TLS 1.3 refusal of its certificate on its first recv.
async fn refused_after_handshake(addr: std::net::SocketAddr, cfg: ClientConfig) -> Error {
    let r = tokio::time::timeout(BOUND, async {
        let c = tls::Connect::new(addr, cfg).connect_wrap(()).await?;
        c.send_one("hello".into()).await?;
        c.recv_one().await
    })
    .await
    .expect("refusal within the bound");
    let e = r.expect_err("refused");
    match Error::find(&e) {
        Some(t) => clone_shape(t),
        None => panic!("no typed error in {e:?}"),
    }
}

/// Errors are not Clone; tests only need the variant and `by`.
fn clone_shape(e: &Error) -> Error {
    match e {
        Error::MissingClientCertificate { peer, by } => Error::MissingClientCertificate {
            peer: peer.clone(),
            by: *by,
        },
        Error::UnknownCa { peer, by } => Error::UnknownCa {
            peer: peer.clone(),
            by: *by,
        },
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn mutual_tls_refuses_missing_and_untrusted_client_certificates() {
    let pki = Pki::new();
    let (addr, mut rx) = echo_server(
        server_cfg(&pki.server)
            .client_auth(pki.ca.roots())
            .build()
            .unwrap(),
    )
    .await;

    // No client certificate.
    let t0 = Instant::now();
    let e =
        refused_after_handshake(addr, client(pki.ca.roots(), "localhost").build().unwrap()).await;
    assert!(
        matches!(
            e,
            Error::MissingClientCertificate {
                by: DetectedBy::Peer,
                ..
            }
        ),
        "{e:?}"
    );
    let e = next(&mut rx).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::MissingClientCertificate {
                by: DetectedBy::Local,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));

    // A certificate from a CA the server does not trust.
    let cfg = client(pki.ca.roots(), "localhost")
        .client_identity(pki.other_client.identity())
        .build()
        .unwrap();
    let e = refused_after_handshake(addr, cfg).await;
    assert!(
        matches!(
            e,
            Error::UnknownCa {
                by: DetectedBy::Peer,
                ..
            }
        ),
        "{e:?}"
    );
    let e = next(&mut rx).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::UnknownCa {
                by: DetectedBy::Local,
                ..
            }
        ),
        "{e:?}"
    );

    good_client_served(&pki, addr, &mut rx).await;
}

#[tokio::test]
async fn expired_server_certificate() {
    let pki = Pki::new();
    let (addr, mut rx) = echo_server(server_cfg(&pki.expired).build().unwrap()).await;
    let e = connect_err(addr, client(pki.ca.roots(), "localhost").build().unwrap()).await;
    assert!(
        matches!(
            e,
            Error::CertificateExpired {
                by: DetectedBy::Local,
                ..
            }
        ),
        "{e:?}"
    );
    let e = next(&mut rx).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::CertificateExpired {
                by: DetectedBy::Peer,
                ..
            }
        ),
        "{e:?}"
    );
}

#[tokio::test]
async fn wrong_name_and_unknown_ca() {
    let pki = Pki::new();
    let (addr, mut rx) = echo_server(server_cfg(&pki.wrong_name).build().unwrap()).await;
    let e = connect_err(addr, client(pki.ca.roots(), "localhost").build().unwrap()).await;
    assert!(
        matches!(
            e,
            Error::WrongName {
                by: DetectedBy::Local,
                ..
            }
        ),
        "{e:?}"
    );
    let e = next(&mut rx).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::BadCertificate {
                by: DetectedBy::Peer,
                ..
            }
        ),
        "{e:?}"
    );

    // The client trusts only the other CA.
    let e = connect_err(
        addr,
        client(pki.other_ca.roots(), "not-localhost.example")
            .build()
            .unwrap(),
    )
    .await;
    assert!(
        matches!(
            e,
            Error::UnknownCa {
                by: DetectedBy::Local,
                ..
            }
        ),
        "{e:?}"
    );
    let e = next(&mut rx).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::UnknownCa {
                by: DetectedBy::Peer,
                ..
            }
        ),
        "{e:?}"
    );

    // The same server keeps serving a client that asks for its real name.
    let cfg = client(pki.ca.roots(), "not-localhost.example")
        .build()
        .unwrap();
    let c = tls::Connect::new(addr, cfg).connect_wrap(()).await.unwrap();
    echo(&c, "right name").await;
    assert!(next(&mut rx).await.is_ok());
}

#[tokio::test]
async fn garbage_instead_of_a_handshake() {
    let pki = Pki::new();
    let cfg = server_cfg(&pki.server)
        .client_auth(pki.ca.roots())
        .build()
        .unwrap();
    let (addr, mut rx) = echo_server(cfg).await;
    for garbage in [
        &b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"[..],
        &[0xff; 64][..],
        // A handshake record header announcing a huge ClientHello.
        &[0x16, 0x03, 0x01, 0xff, 0xff, 0x01, 0xff, 0xff, 0xff][..],
    ] {
        let t0 = Instant::now();
        let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
        raw.write_all(garbage).await.unwrap();
        let e = next(&mut rx).await.unwrap_err();
        assert!(
            matches!(e, Error::NotTls { .. }),
            "garbage {garbage:?}: {e:?}"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "typed error at once, not a timeout"
        );
        eprintln!("garbage {:?}... -> {e}", &garbage[..garbage.len().min(8)]);
    }
    good_client_served(&pki, addr, &mut rx).await;
}

/// The first bytes of a real ClientHello.
fn client_hello(pki: &Pki) -> Vec<u8> {
    let cfg = client(pki.ca.roots(), "localhost").build().unwrap();
    let mut conn =
        rustls::ClientConnection::new(cfg.rustls().clone(), "localhost".try_into().unwrap())
            .unwrap();
    let mut out = Vec::new();
    conn.write_tls(&mut out).unwrap();
    out
}

#[tokio::test]
async fn stalled_clients_time_out_without_blocking_others() {
    let pki = Pki::new();
    let timeout = Duration::from_secs(1);
    let cfg = server_cfg(&pki.server)
        .client_auth(pki.ca.roots())
        .handshake_timeout(timeout)
        .build()
        .unwrap();
    let (addr, mut rx) = echo_server(cfg).await;

    // One silent client, one that sends half a ClientHello.
    let t0 = Instant::now();
    let _silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let hello = client_hello(&pki);
    assert!(hello.len() > 100);
    let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
    half.write_all(&hello[..hello.len() / 2]).await.unwrap();

    // A good client is served while both stall.
    good_client_served(&pki, addr, &mut rx).await;
    assert!(
        t0.elapsed() < timeout,
        "the good client did not wait for the stalled ones"
    );

    for _ in 0..2 {
        let e = next(&mut rx).await.unwrap_err();
        assert!(
            matches!(e, Error::HandshakeTimeout { after, .. } if after == timeout),
            "{e:?}"
        );
    }
    let took = t0.elapsed();
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(3),
        "{took:?}"
    );
    good_client_served(&pki, addr, &mut rx).await;
}

#[tokio::test]
async fn client_side_timeout_and_plaintext_server() {
    let pki = Pki::new();
    // A TCP server that accepts and says nothing.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let _keep = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let t0 = Instant::now();
    let cfg = client(pki.ca.roots(), "localhost")
        .handshake_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let e = connect_err(silent_addr, cfg).await;
    assert!(matches!(e, Error::HandshakeTimeout { .. }), "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(3));

    // A plaintext server answering with text.
    let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plain_addr = plain.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = plain.accept().await {
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        }
    });
    let e = connect_err(
        plain_addr,
        client(pki.ca.roots(), "localhost").build().unwrap(),
    )
    .await;
    assert!(matches!(e, Error::NotTls { .. }), "{e:?}");
}

#[tokio::test]
async fn pem_files_and_config_errors() {
    let pki = Pki::new();
    let dir = pki.write();
    let id =
        chunnel_secure::Identity::from_pem_files(dir.join("server.pem"), dir.join("server.key"))
            .unwrap();
    let roots = chunnel_secure::TrustRoots::from_pem_file(dir.join("ca.pem")).unwrap();
    let (addr, _rx) = echo_server(chunnel_secure::ServerConfig::builder(id).build().unwrap()).await;
    let c = tls::Connect::new(
        addr,
        ClientConfig::builder(roots, "localhost").build().unwrap(),
    )
    .connect_wrap(())
    .await
    .unwrap();
    echo(&c, "from files").await;

    assert!(matches!(
        chunnel_secure::TrustRoots::from_pem(b"not pem"),
        Err(Error::Config { .. })
    ));
    assert!(matches!(
        chunnel_secure::Identity::from_pem_files(dir.join("missing.pem"), dir.join("server.key")),
        Err(Error::Config { .. })
    ));
    // A key that does not match the certificate.
    let wrong =
        chunnel_secure::Identity::from_pem(pki.server.cert.as_bytes(), pki.client.key.as_bytes())
            .unwrap();
    assert!(matches!(
        chunnel_secure::ServerConfig::builder(wrong).build(),
        Err(Error::Config { .. })
    ));
    let _ = std::fs::remove_dir_all(dir);
}
