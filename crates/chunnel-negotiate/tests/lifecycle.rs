//! The end of a negotiated connection over real loopback UDP (docs/wire.md §7.6): a client's
//! `close()` ends the server's receive with `PeerClosed` after the data sent before it and
//! frees the peer's state on the listener at once; a dropped client does the same (best
//! effort); a CLOSE from another address or with another connection id is ignored.
//!
//! Waits that should finish are bounded by [`WAIT`] (a hang guard); the dropped client's
//! CLOSE must arrive well within [`SOON`], far below the listener's 60 s idle timeout.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use bytes::Bytes;
use chunnel::{Chunnel, ConnectionExt, Error as CErr, Identity};
use chunnel_negotiate::proto::close_message;
use chunnel_negotiate::{Client, Config, Negotiated, NegotiatedListener, Tagged, listen};
use chunnel_net::udp;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);
/// How long a dropped client's CLOSE may take to end the server's connection.
const SOON: Duration = Duration::from_secs(2);

type ServerConn = Negotiated<Tagged<udp::ServerConnection>>;
type ClientConn = Negotiated<Tagged<udp::Connection>>;

/// A negotiating server of the plain stack, and a handle on its listener's peer table.
async fn server() -> Result<(
    SocketAddr,
    NegotiatedListener<Tagged<udp::ServerConnection>>,
    udp::PeerCounter,
)> {
    let l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = l.local_addr()?;
    let peers = l.peer_counter();
    Ok((addr, listen(Identity, l, Config::default()), peers))
}

/// A client connected to `addr`, and the server's end of that connection.
async fn pair(
    addr: SocketAddr,
    server: &mut NegotiatedListener<Tagged<udp::ServerConnection>>,
) -> Result<(ClientConn, ServerConn)> {
    let base = udp::Connect::new(addr).connect_wrap(()).await?;
    let client = Client::new(Config::default())
        .connect(&addr.to_string(), Identity, base)
        .await?;
    let conn = timeout(WAIT, server.accept()).await.context("accept")??;
    ensure!(conn.conn_id() == client.conn_id(), "both ends share the id");
    Ok((client, conn))
}

async fn recv(c: &ServerConn) -> Result<Result<Bytes, CErr>> {
    timeout(WAIT, c.recv_one()).await.context("server recv")
}

#[tokio::test]
async fn a_closed_client_ends_the_servers_receive_and_its_peer_state_at_once() -> Result<()> {
    let (addr, mut server, peers) = server().await?;
    let (client, conn) = pair(addr, &mut server).await?;
    ensure!(peers.count() == 1, "one peer before: {}", peers.count());

    client.send_one("a".into()).await?;
    client.send_one("b".into()).await?;
    client.close().await?;
    // What was sent before the CLOSE arrives; then the receive ends.
    ensure!(recv(&conn).await?? == "a");
    ensure!(recv(&conn).await?? == "b");
    let end = recv(&conn).await?;
    ensure!(matches!(end, Err(CErr::PeerClosed)), "got {end:?}");
    // Freed at once: no idle timeout, no drop of the server's connection needed.
    ensure!(peers.count() == 0, "peers after close: {}", peers.count());
    ensure!(matches!(recv(&conn).await?, Err(CErr::PeerClosed)));
    ensure!(conn.send_one("late".into()).await.is_err());

    // The closed client's own later calls fail with Closed; a second close does nothing.
    ensure!(matches!(
        client.send_one("x".into()).await,
        Err(CErr::Closed)
    ));
    ensure!(matches!(client.recv_one().await, Err(CErr::Closed)));
    client.close().await?;
    Ok(())
}

#[tokio::test]
async fn a_dropped_client_ends_the_servers_connection_soon() -> Result<()> {
    let (addr, mut server, peers) = server().await?;
    let (client, conn) = pair(addr, &mut server).await?;
    client.send_one("last".into()).await?;
    ensure!(peers.count() == 1);
    drop(client);
    ensure!(recv(&conn).await?? == "last");
    let end = timeout(SOON, conn.recv_one())
        .await
        .context("the dropped client's CLOSE did not end the server's receive")?;
    ensure!(matches!(end, Err(CErr::PeerClosed)), "got {end:?}");
    ensure!(peers.count() == 0, "peers after drop: {}", peers.count());
    Ok(())
}

#[tokio::test]
async fn a_close_from_a_stranger_or_for_another_connection_is_ignored() -> Result<()> {
    let (addr, mut server, _peers) = server().await?;
    let (client, conn) = pair(addr, &mut server).await?;
    let id = client.conn_id();

    // The right id from another address: it reaches another (new) peer, not this one.
    let stranger = std::net::UdpSocket::bind("127.0.0.1:0")?;
    stranger.send_to(&close_message(id), addr)?;
    // From the client's own address, with another id; and a truncated CLOSE.
    let raw = client.get_ref().get_ref();
    raw.send_one(close_message(id ^ 1)).await?;
    raw.send_one(close_message(id).slice(..9)).await?;

    client.send_one("still here".into()).await?;
    ensure!(recv(&conn).await?? == "still here");
    ensure!(
        conn.get_ref().ignored() == 2,
        "ignored: {}",
        conn.get_ref().ignored()
    );
    conn.send_one("and answered".into()).await?;
    let back = timeout(WAIT, client.recv_one())
        .await
        .context("client recv")??;
    ensure!(back == "and answered");

    // The real CLOSE still ends it.
    client.close().await?;
    ensure!(matches!(recv(&conn).await?, Err(CErr::PeerClosed)));
    Ok(())
}

#[tokio::test]
async fn a_server_that_closes_ends_the_clients_receive() -> Result<()> {
    let (addr, mut server, peers) = server().await?;
    let (client, conn) = pair(addr, &mut server).await?;
    conn.send_one("bye".into()).await?;
    conn.close().await?;
    // The server's own state goes with its close.
    ensure!(peers.count() == 0);
    let r = timeout(WAIT, client.recv_one())
        .await
        .context("client recv")??;
    ensure!(r == "bye");
    let end = timeout(WAIT, client.recv_one())
        .await
        .context("client recv")?;
    ensure!(matches!(end, Err(CErr::PeerClosed)), "got {end:?}");
    ensure!(matches!(recv(&conn).await?, Err(CErr::Closed)));
    Ok(())
}

/// A client that starts again on the same local port while the server holds its old
/// connection and does not read it: the new hello (another connection id) reaches `accept`
/// as a new connection (the listener recognises sessions by the hello's id), and the old
/// connection ends. Before, the hello sat in the old connection's queue, unanswered, and the
/// client gave up after its last retransmission.
#[tokio::test]
async fn a_client_restarted_on_the_same_port_is_answered_while_the_old_connection_is_unread()
-> Result<()> {
    let (addr, mut server, _peers) = server().await?;
    let local = std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?;
    let connect = || async move {
        let base = udp::Connect::new(addr)
            .with_local_addr(local)
            .connect_wrap(())
            .await?;
        timeout(
            WAIT,
            Client::new(Config::default()).connect(&addr.to_string(), Identity, base),
        )
        .await
        .context("no answer to the hello")?
        .map_err(anyhow::Error::from)
    };
    let first = connect().await?;
    let old = timeout(WAIT, server.accept()).await.context("accept")??;
    first.send_one(Bytes::from_static(b"one")).await?;
    // The first client goes away (its CLOSE, if any, waits unread in the old queue).
    drop(first);

    let second = connect().await?;
    let new = timeout(WAIT, server.accept()).await.context("accept")??;
    ensure!(new.conn_id() == second.conn_id() && new.conn_id() != old.conn_id());
    second.send_one(Bytes::from_static(b"two")).await?;
    ensure!(recv(&new).await?? == "two");
    // The old connection gives what it had, then ends.
    let mut ended = false;
    for _ in 0..3 {
        if recv(&old).await?.is_err() {
            ended = true;
            break;
        }
    }
    ensure!(ended, "the old connection did not end");
    Ok(())
}
