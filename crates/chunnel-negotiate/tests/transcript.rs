//! `Negotiated::transcript`: both ends of a 1-RTT negotiation record the same HELLO and
//! ACCEPT, byte for byte, and they decode to what was decided.

use chunnel::{Chunnel, ConnectionExt, Identity, Noop, select};
use chunnel_negotiate::wire::{Accept, Hello, Tag};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_net::udp;

#[tokio::test]
async fn both_ends_record_the_same_hello_and_accept() {
    let l = udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    let mut server = listen(select(Noop, Identity), l, Config::default());
    let client = Client::new(Config::default());
    for _ in 0..3 {
        let base = udp::Connect::new(addr).connect_wrap(()).await.unwrap();
        let c = client
            .connect(&addr.to_string(), select(Identity, Noop), base)
            .await
            .unwrap();
        c.send_one("x".into()).await.unwrap();
        let s = server.accept().await.unwrap();
        assert_eq!(s.recv_one().await.unwrap(), "x");
        let (ct, st) = (c.transcript(), s.transcript());
        assert_eq!(ct, st);
        assert_eq!(ct.hello[0], Tag::Hello as u8);
        assert_eq!(ct.accept[0], Tag::Accept as u8);
        let hello = Hello::decode(&ct.hello[1..]).unwrap();
        let accept = Accept::decode(&ct.accept[1..]).unwrap();
        assert_eq!(hello.conn_id, c.conn_id());
        assert_eq!(accept.conn_id, c.conn_id());
        assert_eq!(accept.client_pick, c.info().client_pick);
        assert_eq!(accept.server_pick, s.info().server_pick);
    }
}
