//! Standard on the wire: the TLS datapath against the real `openssl` binary (`s_client`
//! against the library's server, the library's client against `s_server`) and against a
//! client written with rustls and tokio-rustls only. The frames are the TCP datapath's:
//! a 4-byte big-endian length, then the message.
//!
//! The openssl tests skip, saying so, when no `openssl` binary is on the PATH
//! (`scripts/test-all.sh` installs it).

mod common;

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chunnel::{Chunnel, ConnectionExt, Listener as _};
use chunnel_secure::{ClientConfig, tls};
use common::*;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

fn frame(msg: &[u8]) -> Vec<u8> {
    let mut v = (msg.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(msg);
    v
}

fn openssl() -> bool {
    match std::process::Command::new("openssl")
        .arg("version")
        .output()
    {
        Ok(o) if o.status.success() => {
            eprintln!("using {}", String::from_utf8_lossy(&o.stdout).trim());
            true
        }
        _ => {
            eprintln!(
                "SKIPPED: no `openssl` binary on the PATH (apt-get install openssl; \
                 scripts/test-all.sh installs it)"
            );
            false
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test]
async fn openssl_s_client_against_library_server() {
    if !openssl() {
        return;
    }
    let pki = Pki::new();
    let dir = pki.write();
    let cfg = chunnel_secure::ServerConfig::builder(
        chunnel_secure::Identity::from_pem_files(dir.join("server.pem"), dir.join("server.key"))
            .unwrap(),
    )
    .build()
    .unwrap();
    let mut l = tls::Listener::bind("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    // Echo one message, then close (s_client exits when the server closes).
    let server = tokio::spawn(async move {
        let c = tokio::time::timeout(BOUND, l.accept())
            .await
            .unwrap()
            .unwrap();
        let m = tokio::time::timeout(BOUND, c.recv_one())
            .await
            .unwrap()
            .unwrap();
        c.send_one(m.clone()).await.unwrap();
        c.close().await.unwrap();
        (m, c.session().clone())
    });

    let mut child = Command::new("openssl")
        .args([
            "s_client",
            "-connect",
            &addr.to_string(),
            "-servername",
            "localhost",
        ])
        .arg("-CAfile")
        .arg(dir.join("ca.pem"))
        .args(["-verify_return_error", "-tls1_3", "-ign_eof", "-nocommands"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let payload = b"framed hello from openssl s_client";
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&frame(payload)).await.unwrap();
    stdin.flush().await.unwrap();
    let out = tokio::time::timeout(BOUND, child.wait_with_output())
        .await
        .expect("s_client finished in time")
        .unwrap();
    let stdout = out.stdout;
    let text = String::from_utf8_lossy(&stdout);
    eprintln!(
        "--- s_client stdout ---\n{text}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("TLSv1.3"), "s_client negotiated TLS 1.3");
    assert!(
        text.contains("Verify return code: 0 (ok)"),
        "s_client verified the chain"
    );
    assert!(
        find(&stdout, &frame(payload)),
        "the framed echo came back to s_client"
    );
    let (m, session) = server.await.unwrap();
    assert_eq!(&m[..], payload);
    assert_eq!(session.version, Some(rustls::ProtocolVersion::TLSv1_3));
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn library_client_against_openssl_s_server() {
    if !openssl() {
        return;
    }
    let pki = Pki::new();
    let dir = pki.write();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new("openssl")
        .args(["s_server", "-tls1_3", "-accept", &port.to_string()])
        .arg("-cert")
        .arg(dir.join("server.pem"))
        .arg("-key")
        .arg(dir.join("server.key"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut stdin = child.stdin.take().unwrap();
    // s_server prints ACCEPT once it listens.
    let mut seen = Vec::new();
    tokio::time::timeout(BOUND, async {
        let mut line = String::new();
        while stdout.read_line(&mut line).await.unwrap() > 0 {
            seen.push(line.clone());
            if line.starts_with("ACCEPT") {
                return;
            }
            line.clear();
        }
        panic!("s_server ended: {seen:?}");
    })
    .await
    .expect("s_server listening in time");

    let addr = format!("127.0.0.1:{port}").parse().unwrap();
    let cfg = ClientConfig::builder(pki.ca.roots(), "localhost")
        .build()
        .unwrap();
    let c = tokio::time::timeout(BOUND, tls::Connect::new(addr, cfg).connect_wrap(()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(c.session().version, Some(rustls::ProtocolVersion::TLSv1_3));

    // Library -> s_server: s_server prints what it receives.
    let to_server = b"framed hello to openssl s_server";
    c.send_one(bytes::Bytes::from_static(to_server))
        .await
        .unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(BOUND, async {
        let mut buf = [0u8; 4096];
        while !find(&got, &frame(to_server)) {
            let n = stdout.read(&mut buf).await.unwrap();
            assert!(n > 0, "s_server ended");
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("s_server printed the frame in time");
    let text = String::from_utf8_lossy(&got);
    eprintln!("--- s_server stdout ---\n{}{text}", seen.concat());

    // s_server -> library: what we type on s_server's stdin goes to the client.
    let from_server = b"framed reply typed into openssl s_server";
    stdin.write_all(&frame(from_server)).await.unwrap();
    stdin.flush().await.unwrap();
    let m = tokio::time::timeout(BOUND, c.recv_one())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&m[..], from_server);
    assert!(
        text.contains("TLS_AES") || text.contains("TLS_CHACHA20"),
        "a TLS 1.3 cipher suite: {text}"
    );
    let _ = child.kill().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn plain_rustls_client_against_library_server() {
    let pki = Pki::new();
    let (addr, _rx) = echo_server(server_cfg(&pki.server).alpn(["x/1"]).build().unwrap()).await;

    // Written with rustls and tokio-rustls only: no chunnel type.
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject;
    roots
        .add(rustls::pki_types::CertificateDer::from_pem_slice(pki.ca.pem.as_bytes()).unwrap())
        .unwrap();
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"x/1".to_vec()];
    let t0 = Instant::now();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut s = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
    assert_eq!(
        s.get_ref().1.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_3)
    );
    assert_eq!(s.get_ref().1.alpn_protocol(), Some(&b"x/1"[..]));
    for msg in [&b"one"[..], &[7u8; 40_000][..], b""] {
        s.write_all(&frame(msg)).await.unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await.unwrap();
        let mut back = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut back).await.unwrap();
        assert_eq!(back, msg);
    }
    assert!(t0.elapsed() < Duration::from_secs(10));
}
