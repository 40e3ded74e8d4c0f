//! Bind configs as `chunnel::Listen`, alone and in a select, over real loopback sockets: the
//! select binds the preferred branch, the fixed branch, and reports a failure that is not
//! about availability (an address in use) instead of serving elsewhere.

use std::time::Duration;

use bytes::Bytes;
use chunnel::{
    Chunnel, ChunnelConnection, ConnectionExt, Either, Error, Listen, Listener, Side, select,
};
use chunnel_net::{tcp, udp, uds};

const WAIT: Duration = Duration::from_secs(10);

fn abstract_name(tag: &str) -> uds::UnixAddr {
    uds::UnixAddr::Abstract(format!("chunnel-listen-{tag}-{}", std::process::id()).into_bytes())
}

/// Sends `ping` on `client`, accepts its connection on `l`, echoes `pong` back.
async fn ping<L, C>(l: &mut L, client: &C) -> L::Connection
where
    L: Listener,
    L::Connection: ChunnelConnection<Data = Bytes>,
    C: ChunnelConnection<Data = Bytes>,
{
    tokio::time::timeout(WAIT, async {
        client.send_one(Bytes::from_static(b"ping")).await.unwrap();
        let s = l.accept().await.unwrap();
        assert_eq!(s.recv_one().await.unwrap(), "ping");
        s.send_one(Bytes::from_static(b"pong")).await.unwrap();
        assert_eq!(client.recv_one().await.unwrap(), "pong");
        s
    })
    .await
    .expect("echo within the time limit")
}

#[tokio::test]
async fn a_select_of_datagram_binds_listens_on_the_preferred_or_fixed_branch() {
    let any = "127.0.0.1:0".parse().unwrap();

    let name = abstract_name("pref");
    let s = select(udp::Bind::new(any), uds::DatagramBind::new(name.clone()));
    let mut l = s.listen().await.unwrap();
    let Either::Left(udp_l) = &l else {
        panic!("bound {:?}, expected UDP", l.side())
    };
    let addr = udp_l.local_addr().unwrap();
    let client = udp::Connect::new(addr).connect_wrap(()).await.unwrap();
    let conn = ping(&mut l, &client).await;
    assert_eq!(conn.side(), Side::Left);
    // The preferred branch took the port, the other was never bound.
    assert!(
        uds::DatagramConnect::new(name)
            .connect_wrap(())
            .await
            .is_err()
    );

    let name = abstract_name("fixed");
    let s = select(udp::Bind::new(any), uds::DatagramBind::new(name.clone())).prefer(Side::Right);
    let mut l = s.listen().await.unwrap();
    assert_eq!(l.side(), Side::Right);
    let client = uds::DatagramConnect::new(name)
        .connect_wrap(())
        .await
        .unwrap();
    let conn = ping(&mut l, &client).await;
    assert_eq!(conn.side(), Side::Right);
}

#[tokio::test]
async fn a_select_of_stream_binds_listens_and_accepts() {
    let name = abstract_name("stream");
    let s = select(
        uds::StreamBind::new(name.clone()),
        tcp::Bind::new("127.0.0.1:0".parse().unwrap()),
    );
    let mut l = s.listen().await.unwrap();
    assert_eq!(l.side(), Side::Left);
    let client = uds::StreamConnect::new(name)
        .connect_wrap(())
        .await
        .unwrap();
    let conn = ping(&mut l, &client).await;
    assert_eq!(conn.side(), Side::Left);

    let mut l = tcp::Bind::new("127.0.0.1:0".parse().unwrap())
        .listen()
        .await
        .unwrap();
    let client = tcp::Connect::new(l.local_addr().unwrap())
        .connect_wrap(())
        .await
        .unwrap();
    ping(&mut l, &client).await;
}

#[tokio::test]
async fn an_address_in_use_is_reported_not_served_elsewhere() {
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let name = abstract_name("inuse");
    let s = select(udp::Bind::new(addr), uds::DatagramBind::new(name.clone()));
    match s.listen().await {
        Err(Error::AddrInUse { addr: a }) => assert_eq!(a, addr.to_string()),
        Err(e) => panic!("expected AddrInUse, got {e}"),
        Ok(l) => panic!("bound {:?} although the address is in use", l.side()),
    }
    // The fallback was not bound either.
    assert!(
        uds::DatagramConnect::new(name)
            .connect_wrap(())
            .await
            .is_err()
    );
}
