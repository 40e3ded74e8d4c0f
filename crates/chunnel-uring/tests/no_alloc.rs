//! No heap allocation per message on the steady-state send/recv paths of the io_uring
//! datapath: a client (five `Noop` layers) against a raw reflector, and a listener's server
//! connection against a raw client.
//!
//! A counting global allocator wraps the system allocator; after a warm-up, the tests fail if
//! any allocation happens.

use std::sync::Mutex;

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Listener as _, Noop, stack};
use chunnel_uring::udp;

/// The two tests measure one at a time (the counter is process-wide).
static SERIAL: Mutex<()> = Mutex::new(());

#[global_allocator]
static A: chunnel_test::alloc::Counting = chunnel_test::alloc::Counting::new();

async fn recv_all<C: ChunnelConnection<Data = Bytes>>(conn: &C, slots: &mut [Option<Bytes>]) {
    let mut got = 0;
    while got < slots.len() {
        got += conn.recv(&mut slots[got..]).await.unwrap();
    }
    slots.iter_mut().for_each(|s| *s = None);
}

async fn client_bursts<C: ChunnelConnection<Data = Bytes>>(
    conn: &C,
    reflector: &std::net::UdpSocket,
    msg: &Bytes,
    slots: &mut [Option<Bytes>],
    buf: &mut [u8],
    n: usize,
) {
    for _ in 0..n {
        conn.send(std::iter::repeat_n(msg, slots.len()).cloned())
            .await
            .unwrap();
        for _ in 0..slots.len() {
            let (k, from) = reflector.recv_from(buf).unwrap();
            reflector.send_to(&buf[..k], from).unwrap();
        }
        recv_all(conn, slots).await;
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn client_with_five_noop_layers_allocates_nothing_per_message() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    runtime().block_on(async {
        let reflector = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        reflector
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut s = stack![
            Noop,
            Noop,
            Noop,
            Noop,
            Noop,
            udp::Connect::new(reflector.local_addr().unwrap())
        ];
        let conn = s.connect_wrap(()).await.unwrap();
        // 100 bytes: block boundaries (64 KiB) fall inside batches, as with most sizes.
        let msg = Bytes::from(vec![1u8; 100]);
        let mut slots = vec![None; 32];
        let mut buf = vec![0u8; 2048];
        client_bursts(&conn, &reflector, &msg, &mut slots, &mut buf, 50).await;
        let before = A.count();
        client_bursts(&conn, &reflector, &msg, &mut slots, &mut buf, 500).await;
        let allocs = A.count() - before;
        assert_eq!(allocs, 0, "{allocs} allocations for 16,000 messages");
    });
}

async fn server_bursts(
    server: &udp::ServerConnection,
    client: &std::net::UdpSocket,
    msg: &[u8],
    slots: &mut [Option<Bytes>],
    buf: &mut [u8],
    n: usize,
) {
    for _ in 0..n {
        for _ in 0..slots.len() {
            client.send(msg).unwrap();
        }
        let mut got = 0;
        while got < slots.len() {
            got += server.recv(&mut slots[got..]).await.unwrap();
        }
        server
            .send(slots.iter_mut().filter_map(Option::take))
            .await
            .unwrap();
        for _ in 0..slots.len() {
            client.recv(buf).unwrap();
        }
    }
}

#[test]
fn server_connection_allocates_nothing_per_message() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    runtime().block_on(async {
        let mut l = udp::Listener::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let client = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        client.connect(l.local_addr().unwrap()).unwrap();
        client
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        client.send(b"hello").unwrap();
        let server = l.accept().await.unwrap();
        let mut one = [None];
        server.recv(&mut one).await.unwrap();
        let msg = vec![2u8; 100];
        let mut slots = vec![None; 32];
        let mut buf = vec![0u8; 2048];
        server_bursts(&server, &client, &msg, &mut slots, &mut buf, 50).await;
        let before = A.count();
        server_bursts(&server, &client, &msg, &mut slots, &mut buf, 500).await;
        let allocs = A.count() - before;
        assert_eq!(allocs, 0, "{allocs} allocations for 16,000 messages");
    });
}
