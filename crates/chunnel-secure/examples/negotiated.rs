//! QUIC, TLS over TCP or plaintext, negotiated (issue 21 item 3): three servers with
//! different preferences, one client offering all three, and an incompatible client.
//!
//! `cargo run -p chunnel-secure --example negotiated`

use chunnel::ConnectionExt;
use chunnel_secure::negotiated::{Client, Server, Transport};
use chunnel_secure::{Identity, TrustRoots};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cert = rcgen::generate_simple_self_signed(["localhost".to_string()])?;
    let (cert_pem, key_pem) = (cert.cert.pem(), cert.signing_key.serialize_pem());
    let identity = Identity::from_pem(cert_pem.as_bytes(), key_pem.as_bytes())?;
    let roots = TrustRoots::from_pem(cert_pem.as_bytes())?;

    use Transport::{Plain, Quic, Tls};
    let client = Client::builder([Quic, Tls, Plain])
        .trust(roots.clone(), "localhost")
        .build()?;
    println!("client offers {:?}", client.offers());
    for order in [[Quic, Tls, Plain], [Tls, Quic, Plain], [Plain, Tls, Quic]] {
        let mut server = Server::builder(order)
            .identity(identity.clone())
            .bind("127.0.0.1:0".parse()?)
            .await?;
        let addr = server.local_addr();
        tokio::spawn(async move {
            while let Ok(Ok(conn)) = server.accept().await {
                tokio::spawn(async move {
                    while let Ok(m) = conn.recv_one().await {
                        let _ = conn.send_one(m).await;
                    }
                });
            }
        });
        let conn = client.connect(addr).await?;
        conn.send_one("ping".into()).await?;
        let echo = conn.recv_one().await?;
        println!(
            "server prefers {order:?} -> picked {} (echo {:?})",
            conn.transport(),
            std::str::from_utf8(&echo)?
        );
    }

    // A client that only speaks QUIC, against a server that only offers TLS.
    let server = Server::builder([Tls])
        .identity(identity)
        .bind("127.0.0.1:0".parse()?)
        .await?;
    let quic_only = Client::builder([Quic]).trust(roots, "localhost").build()?;
    match quic_only.connect(server.local_addr()).await {
        Ok(_) => println!("unexpected: the incompatible client connected"),
        Err(e) => println!("quic-only client vs tls-only server -> error: {e}"),
    }
    Ok(())
}
