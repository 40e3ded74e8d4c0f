//! The datapath under stack negotiation (chunnel-negotiate): its connections carry the
//! negotiation's tagged messages (`SendHeader`, `PeerHandoff`), with either end on io_uring
//! and the other on kernel UDP.

use std::time::Duration;

use bytes::Bytes;
use chunnel::{Chunnel, ConnectionExt, select};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_test::Xor;
use chunnel_uring::udp;

const WAIT: Duration = Duration::from_secs(10);

fn cfg() -> Config {
    Config {
        hello_timeout: Duration::from_secs(5),
        ..Config::default()
    }
}

async fn echo<C: chunnel::ChunnelConnection<Data = Bytes>>(c: &C) {
    for m in ["one", "two", ""] {
        c.send_one(Bytes::from(m)).await.unwrap();
        let r = tokio::time::timeout(WAIT, c.recv_one())
            .await
            .expect("echo within the time limit")
            .unwrap();
        assert_eq!(r, m);
    }
}

fn spawn_server<C>(mut server: chunnel_negotiate::NegotiatedListener<C>)
where
    C: chunnel::ChunnelConnection<Data = Bytes> + 'static,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_client_negotiates_with_uring_server() {
    let l = udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    spawn_server(listen(select(Xor(3), Xor(2)), l, cfg()));
    let base = chunnel_net::udp::Connect::new(addr)
        .connect_wrap(())
        .await
        .unwrap();
    let c = tokio::time::timeout(WAIT, Client::new(cfg()).connect("s", Xor(2), base))
        .await
        .expect("negotiation within the time limit")
        .unwrap();
    assert_eq!(c.info().server_pick.branches(), &[1]);
    echo(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uring_client_negotiates_with_kernel_server() {
    let l = chunnel_net::udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    spawn_server(listen(Xor(2), l, cfg()));
    let base = udp::Connect::new(addr).connect_wrap(()).await.unwrap();
    let c = tokio::time::timeout(
        WAIT,
        Client::new(cfg()).connect("s", select(Xor(1), Xor(2)), base),
    )
    .await
    .expect("negotiation within the time limit")
    .unwrap();
    assert_eq!(c.info().client_pick.branches(), &[1]);
    echo(&c).await;
}
