//! No heap allocation per message on a negotiated connection: after the handshake, messages
//! cross the `Tagged` layer (tag sent as a second iovec, stripped with `Bytes::advance`) and
//! a `Noop` stack on both ends, client and negotiating server, without allocating.
//!
//! A counting global allocator wraps the system allocator; the test fails if the steady
//! state (bursts echoed through the real `listen` server over loopback UDP) allocates.

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Noop, select, stack};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_net::udp;

#[global_allocator]
static A: chunnel_test::alloc::Counting = chunnel_test::alloc::Counting::new();

const BURST: usize = 16;

async fn echo_bursts<C: ChunnelConnection<Data = Bytes>>(
    conn: &C,
    msg: &Bytes,
    slots: &mut [Option<Bytes>],
    n: usize,
) {
    for _ in 0..n {
        conn.send(std::iter::repeat_n(msg, BURST).cloned())
            .await
            .unwrap();
        let mut got = 0;
        while got < BURST {
            got += conn.recv(&mut slots[got..BURST]).await.unwrap();
        }
        slots.iter_mut().for_each(|s| *s = None);
    }
}

#[tokio::test(flavor = "current_thread")]
async fn negotiated_data_path_does_not_allocate_per_message() {
    let cfg = udp::Config::default().with_idle_timeout(None);
    let l = udp::Listener::bind_with("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    let mut server = listen(stack![Noop, select(Noop, Noop)], l, Config::default());
    tokio::spawn(async move {
        let conn = server.accept().await.unwrap();
        let mut slots: [Option<Bytes>; BURST] = Default::default();
        loop {
            let Ok(n) = conn.recv(&mut slots).await else {
                return;
            };
            if conn
                .send(slots[..n].iter_mut().filter_map(Option::take))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    let client = Client::new(Config::default());
    let base = udp::Connect::new(addr).connect_wrap(()).await.unwrap();
    let conn = client
        .connect("s", stack![Noop, select(Noop, Noop)], base)
        .await
        .unwrap();
    let msg = Bytes::from(vec![7u8; 64]);
    let mut slots: [Option<Bytes>; BURST] = Default::default();
    // Warm up: receive buffers reach their steady size, the runtime its queues.
    echo_bursts(&conn, &msg, &mut slots, 300).await;
    let before = A.count();
    echo_bursts(&conn, &msg, &mut slots, 500).await;
    let allocs = A.count() - before;
    assert_eq!(
        allocs,
        0,
        "{allocs} allocations for {} messages echoed through a negotiated stack",
        500 * BURST
    );
}
