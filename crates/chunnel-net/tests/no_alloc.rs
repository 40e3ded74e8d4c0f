//! No heap allocation per message on the send/recv path of a no-op stack over kernel UDP.
//!
//! A counting global allocator wraps the system allocator. After a warm-up, a client with
//! five `Noop` layers sends bursts to a raw reflector socket and receives them back; the test
//! fails if any allocation happens in that steady state.

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Noop, stack};
use chunnel_net::udp;

#[global_allocator]
static A: chunnel_test::alloc::Counting = chunnel_test::alloc::Counting::new();

async fn bursts<C: ChunnelConnection<Data = Bytes>>(
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
        let mut got = 0;
        while got < slots.len() {
            got += conn.recv(&mut slots[got..]).await.unwrap();
        }
        slots.iter_mut().for_each(|s| *s = None);
    }
}

#[test]
fn five_noop_layers_over_udp_allocate_nothing_per_message() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let reflector = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
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
        bursts(&conn, &reflector, &msg, &mut slots, &mut buf, 50).await;
        let before = A.count();
        bursts(&conn, &reflector, &msg, &mut slots, &mut buf, 500).await;
        let allocs = A.count() - before;
        assert_eq!(allocs, 0, "{allocs} allocations for 16,000 messages");
    });
}
