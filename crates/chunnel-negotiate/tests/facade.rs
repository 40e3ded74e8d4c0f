//! The facade (`connect`, `bind`, `Connector`, `Server`) over real UDP sockets.

use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use bytes::Bytes;
use chunnel::negotiate::End;
use chunnel::{ConnectionExt, Identity, Noop, Select, select};
use chunnel_negotiate::proto::Timing;
use chunnel_negotiate::{
    Config, Conn, Connector, Error, NegotiatedConn, Server, ServerConn, ZeroRtt, bind, connect,
};
use chunnel_test::Xor;
use tokio::time::timeout;

/// Settings that give up within a fraction of a second.
fn short() -> Config {
    Config {
        timing: Timing {
            initial_rto: Duration::from_millis(20),
            attempts: 3,
            ..Timing::default()
        },
        ..Config::default()
    }
}

/// Serves `server` in a task: every connection echoes what it receives.
fn echo_all<S>(mut server: Server<S>)
where
    S: chunnel::Chunnel<chunnel_negotiate::Tagged<chunnel_net::udp::ServerConnection>>
        + Send
        + 'static,
    S::Connection: chunnel::ChunnelConnection<Data = Bytes> + 'static,
{
    tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            tokio::spawn(async move {
                while let Ok(m) = conn.recv_one().await {
                    if conn.send_one(m).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
}

/// The helper the facade's one bound makes possible: any negotiated connection of bytes.
async fn echo_once(conn: &impl NegotiatedConn<Data = Bytes>, m: &'static str) -> Result<()> {
    conn.send_one(Bytes::from_static(m.as_bytes())).await?;
    let back = timeout(Duration::from_secs(5), conn.recv_one()).await??;
    ensure!(back == m, "echoed {back:?}, sent {m:?}");
    Ok(())
}

#[tokio::test]
async fn connect_accept_echo() -> Result<()> {
    let mut server: Server<Identity> = bind("127.0.0.1:0", Identity).await?;
    let addr = server.local_addr();
    ensure!(addr.port() != 0);
    // The address as a SocketAddr, a string and a (host, port) pair. The server's listener
    // negotiates by itself: each connect completes before its accept is asked for.
    let a: Conn<Select<Noop, Identity>> = connect(addr, select(Noop, Identity)).await?;
    let pa: ServerConn<Identity> = server.accept().await?;
    ensure!(pa.conn_id() == NegotiatedConn::conn_id(&a));
    let b: Conn<Identity> = connect(addr.to_string(), Identity).await?;
    let pb = server.accept().await?;
    let c: Conn<Identity> = connect(("127.0.0.1", addr.port()), Identity).await?;
    let pc = server.accept().await?;
    for (conn, peer, m) in [(&b, &pb, "b"), (&c, &pc, "c")] {
        ensure!(NegotiatedConn::conn_id(conn) == peer.conn_id());
        conn.send_one(Bytes::from_static(m.as_bytes())).await?;
        let got = timeout(Duration::from_secs(5), peer.recv_one()).await??;
        ensure!(got == m, "{got:?}");
        peer.send_one(got).await?;
        ensure!(timeout(Duration::from_secs(5), conn.recv_one()).await?? == m);
    }
    // Noop is one-sided: the client keeps it although the server does not offer it.
    ensure!(a.info().client_pick.branches() == [0], "{:?}", a.info());
    echo_all_one(pa);
    echo_once(&a, "a").await?;
    // Closing through the trait tells the peer.
    NegotiatedConn::close(&a).await?;
    ensure!(a.send_one("after".into()).await.is_err());
    Ok(())
}

fn echo_all_one<C>(conn: chunnel_negotiate::Negotiated<C>)
where
    C: chunnel::ChunnelConnection<Data = Bytes> + 'static,
{
    tokio::spawn(async move {
        while let Ok(m) = conn.recv_one().await {
            if conn.send_one(m).await.is_err() {
                break;
            }
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_clients() -> Result<()> {
    let server = bind("127.0.0.1:0", select(Noop, Identity)).await?;
    let addr = server.local_addr();
    echo_all(server);
    let connector = std::sync::Arc::new(Connector::default());
    let clients: Vec<_> = (0..64)
        .map(|i| {
            let connector = connector.clone();
            tokio::spawn(async move {
                let conn = if i % 2 == 0 {
                    connector.connect(addr, select(Noop, Identity)).await?
                } else {
                    // Another stack type, the same helper.
                    let conn = connector.connect(addr, Identity).await?;
                    echo_once(&conn, "plain").await?;
                    return Ok::<_, anyhow::Error>(());
                };
                for _ in 0..4 {
                    echo_once(&conn, "hello").await?;
                }
                Ok(())
            })
        })
        .collect();
    for c in clients {
        timeout(Duration::from_secs(30), c).await???;
    }
    Ok(())
}

#[tokio::test]
async fn zero_rtt_through_a_connector() -> Result<()> {
    let server = bind("127.0.0.1:0", select(Noop, Identity)).await?;
    let addr = server.local_addr();
    echo_all(server);
    let connector = Connector::new(Config::default());
    let first = connector
        .connect_0rtt(addr, select(Noop, Identity), [Bytes::from_static(b"one")])
        .await?;
    ensure!(first.recv_one().await? == "one");
    // Remembered under the resolved address: the string form reaches the same entry.
    ensure!(connector.client().remembered(&addr.to_string()).is_some());
    let second = connector
        .connect_0rtt(
            addr.to_string(),
            select(Noop, Identity),
            [Bytes::from_static(b"two")],
        )
        .await?;
    ensure!(
        second.info().zero_rtt == ZeroRtt::Accepted,
        "{:?}",
        second.info()
    );
    ensure!(second.recv_one().await? == "two");
    Ok(())
}

#[tokio::test]
async fn an_incompatible_stack_is_a_clear_error_and_the_server_keeps_serving() -> Result<()> {
    let mut server = bind("127.0.0.1:0", select(Xor(1), Xor(2))).await?;
    let addr = server.local_addr();
    let err = connect(addr, Xor(7)).await.expect_err("no common xor key");
    let text = err.to_string();
    match &err {
        Error::Incompatible {
            found_by: End::Server,
            mismatches,
        } => ensure!(mismatches.len() == 2, "{mismatches:?}"),
        other => bail!("wrong error: {other}"),
    }
    ensure!(
        text.contains("no compatible stack") && text.contains("`xor` differs"),
        "{text}"
    );
    // The server reported the client's failure, and serves the next client.
    let reported = server.accept().await.expect_err("the failure is reported");
    ensure!(matches!(reported, Error::Incompatible { .. }), "{reported}");
    let (c, s) = tokio::try_join!(connect(addr, Xor(2)), async {
        loop {
            // A retransmitted hello of the refused client is refused again: skip those.
            match server.accept().await {
                Err(Error::Incompatible { .. }) => continue,
                other => break other,
            }
        }
    })?;
    echo_all_one(s);
    echo_once(&c, "still here").await
}

#[tokio::test]
async fn nothing_listening_fails_promptly() -> Result<()> {
    let connector = Connector::new(short());
    // A socket that takes datagrams and never answers: the hellos time out.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let t = Instant::now();
    let err = connector
        .connect(silent.local_addr()?, Identity)
        .await
        .expect_err("nobody answers");
    ensure!(matches!(err, Error::Timeout { attempts: 3, .. }), "{err:?}");
    ensure!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    ensure!(
        err.to_string().contains("no answer after 3 hellos"),
        "{err}"
    );

    // A port nobody holds: the host refuses (or, where it says nothing, the hellos time
    // out), within the same bound.
    let closed = std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?;
    let t = Instant::now();
    let err = connector
        .connect(closed, Identity)
        .await
        .expect_err("nothing listens");
    ensure!(
        matches!(
            err,
            Error::Chunnel(chunnel::Error::ConnectionRefused { .. }) | Error::Timeout { .. }
        ),
        "{err:?}"
    );
    ensure!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    eprintln!("a closed port, after {:?}: {err}", t.elapsed());
    // With the default settings it still ends by itself (refused at once on loopback).
    if matches!(err, Error::Chunnel(_)) {
        ensure!(err.to_string().contains(&closed.to_string()), "{err}");
        let err = timeout(Duration::from_secs(5), connect(closed, Identity))
            .await?
            .expect_err("nothing listens");
        ensure!(
            matches!(
                err,
                Error::Chunnel(chunnel::Error::ConnectionRefused { .. })
            ),
            "{err:?}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn an_address_that_does_not_parse_is_a_typed_error() -> Result<()> {
    for bad in ["not an address", "127.0.0.1", "127.0.0.1:99999"] {
        let t = Instant::now();
        let err = connect(bad, Identity).await.expect_err(bad);
        ensure!(matches!(err, Error::Address(_)), "{bad}: {err:?}");
        ensure!(
            err.to_string().contains("cannot resolve the address"),
            "{err}"
        );
        ensure!(
            t.elapsed() < Duration::from_secs(2),
            "{bad}: {:?}",
            t.elapsed()
        );
        let err = bind(bad, Identity).await.expect_err(bad);
        ensure!(matches!(err, Error::Address(_)), "{bad}: {err:?}");
    }
    Ok(())
}

#[tokio::test]
async fn binding_a_held_address_is_addr_in_use() -> Result<()> {
    let server = bind("127.0.0.1:0", Identity).await?;
    let err = bind(server.local_addr(), Identity)
        .await
        .expect_err("the port is held");
    ensure!(
        matches!(err, Error::Chunnel(chunnel::Error::AddrInUse { .. })),
        "{err:?}"
    );
    Ok(())
}
