//! Runtime reconfiguration over the kernel datapaths: a reconfigurable select whose branches
//! are two datapaths (UDP → Unix datagram, TCP → Unix stream), switched once with no traffic
//! in flight, then used; and a select of two no-op layers over one shared Unix datagram
//! connection, switched on the client and on the server.
//!
//! Each echo server answers with a one-byte mark of its datapath in front of the message, so a
//! reply shows which datapath carried it. Waits are bounded only to turn a hang into a
//! failure; no test asserts how long anything takes.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use chunnel::{
    Chunnel, ChunnelConnection, ChunnelExt, ConnectionExt, Listener, Lock, LockFree, Noop, Shared,
    Side, select, stack,
};
use chunnel_net::{tcp, udp, uds};

const WAIT: Duration = Duration::from_secs(10);

async fn within<F: Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(WAIT, f).await {
        Ok(t) => t,
        Err(_) => panic!("{what} did not finish within {WAIT:?}"),
    }
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn sock_path(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "chunnel-reconfig-{tag}-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Echoes every message of every accepted connection, prefixed with `mark`.
fn spawn_marked_echo<L>(mut listener: L, mark: u8) -> tokio::task::JoinHandle<()>
where
    L: Listener + 'static,
    L::Connection: ChunnelConnection<Data = Bytes> + 'static,
{
    tokio::spawn(async move {
        while let Ok(conn) = listener.accept().await {
            tokio::spawn(async move {
                while let Ok(m) = conn.recv_one().await {
                    let mut b = BytesMut::with_capacity(m.len() + 1);
                    b.put_u8(mark);
                    b.put_slice(&m);
                    if conn.send_one(b.freeze()).await.is_err() {
                        return;
                    }
                }
            });
        }
    })
}

/// Sends `msg` and returns the reply.
async fn echo<C: ChunnelConnection<Data = Bytes>>(conn: &C, msg: &'static [u8]) -> Bytes {
    within("echo", async {
        conn.send_one(Bytes::from_static(msg)).await.unwrap();
        conn.recv_one().await.unwrap()
    })
    .await
}

#[tokio::test]
async fn switch_udp_to_unix_datagram() {
    let udp_l = udp::Listener::bind(loopback()).await.unwrap();
    let udp_addr = udp_l.local_addr().unwrap();
    let path = sock_path("dgram");
    let uds_l = uds::DatagramListener::bind(path.clone()).await.unwrap();
    let servers = [
        spawn_marked_echo(udp_l, b'U'),
        spawn_marked_echo(uds_l, b'D'),
    ];

    let mut sel = select(udp::Connect::new(udp_addr), uds::DatagramConnect::new(path))
        .reconfigurable::<LockFree>();
    let handle = sel.handle();
    let conn = sel.connect_wrap(()).await.unwrap();
    assert_eq!(conn.side(), Side::Left);
    assert_eq!(&echo(&conn, b"one").await[..], b"Uone");

    assert_eq!(
        within("switch", handle.reconfigure(Side::Right))
            .await
            .unwrap(),
        1
    );
    assert_eq!(conn.side(), Side::Right);
    assert_eq!(conn.switches(), 1);
    assert_eq!(&echo(&conn, b"two").await[..], b"Dtwo");
    for s in servers {
        s.abort();
    }
}

#[tokio::test]
async fn switch_tcp_to_unix_stream() {
    let tcp_l = tcp::Listener::bind(loopback()).await.unwrap();
    let tcp_addr = tcp_l.local_addr().unwrap();
    let path = sock_path("stream");
    let uds_l = uds::StreamListener::bind(path.clone()).await.unwrap();
    let servers = [
        spawn_marked_echo(tcp_l, b'T'),
        spawn_marked_echo(uds_l, b'S'),
    ];

    let mut sel =
        select(tcp::Connect::new(tcp_addr), uds::StreamConnect::new(path)).reconfigurable::<Lock>();
    let handle = sel.handle();
    let conn = sel.connect_wrap(()).await.unwrap();
    assert_eq!(&echo(&conn, b"one").await[..], b"Tone");

    assert_eq!(
        within("switch", handle.reconfigure(Side::Right))
            .await
            .unwrap(),
        1
    );
    assert_eq!(conn.side(), Side::Right);
    assert_eq!(&echo(&conn, b"two").await[..], b"Stwo");
    // And back: the left branch is built again (a new TCP connection).
    assert_eq!(
        within("switch back", handle.reconfigure(Side::Left))
            .await
            .unwrap(),
        1
    );
    assert_eq!(&echo(&conn, b"three").await[..], b"Tthree");
    for s in servers {
        s.abort();
    }
}

/// Two wire-compatible layers over one shared datagram connection, on both ends: the client
/// (`Connection`) and the server (`ServerConnection`) are each switched once.
#[tokio::test]
async fn switch_noop_layers_over_shared_unix_datagram() {
    let path = sock_path("shared");
    let l = uds::DatagramListener::bind(path.clone()).await.unwrap();
    let srv_sel = select(Noop, Noop).reconfigurable::<Lock>();
    let srv_handle = srv_sel.handle();
    let mut server = stack![srv_sel, Shared].serve(l);

    let cli_sel = select(Noop, Noop).reconfigurable::<LockFree>();
    let cli_handle = cli_sel.handle();
    let mut client = stack![cli_sel, Shared, uds::DatagramConnect::new(path)];
    let conn = client.connect_wrap(()).await.unwrap();
    conn.send_one(Bytes::from_static(b"hello")).await.unwrap();
    let srv = within("accept", server.accept()).await.unwrap();
    assert_eq!(&within("recv", srv.recv_one()).await.unwrap()[..], b"hello");

    assert_eq!(
        within("client switch", cli_handle.reconfigure(Side::Right))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        within("server switch", srv_handle.reconfigure(Side::Right))
            .await
            .unwrap(),
        1
    );
    assert_eq!((conn.side(), srv.side()), (Side::Right, Side::Right));

    conn.send_one(Bytes::from_static(b"after")).await.unwrap();
    assert_eq!(&within("recv", srv.recv_one()).await.unwrap()[..], b"after");
    srv.send_one(Bytes::from_static(b"reply")).await.unwrap();
    assert_eq!(
        &within("recv", conn.recv_one()).await.unwrap()[..],
        b"reply"
    );
}
