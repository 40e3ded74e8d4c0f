//! No heap allocation per message through a `Metered` layer over kernel UDP, with its handles
//! behind no recorder and behind a Prometheus recorder; and the counts are exact.
//!
//! A counting global allocator wraps the system allocator. After a warm-up, a metered client
//! sends bursts to a raw reflector socket and receives them back; the test fails if any
//! allocation happens in that steady state.

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Layered, stack};
use chunnel_metrics::Metered;
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

/// Allocations in the steady state, and the connection's counters after it.
async fn steady_state(m: Metered) -> (u64, chunnel_metrics::ConnSnapshot) {
    let reflector = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut s = stack![
        Layered(m),
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
    (allocs, conn.state().stats().read())
}

#[test]
fn a_metered_layer_allocates_nothing_per_message() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (prom, handle) = chunnel_metrics::prometheus::recorder();
        for (name, m) in [
            ("no recorder", Metered::new("no-alloc-none")),
            (
                "prometheus",
                Metered::new("no-alloc-prom").with_recorder(prom.clone()),
            ),
        ] {
            let (allocs, s) = steady_state(m).await;
            assert_eq!(
                allocs, 0,
                "{name}: {allocs} allocations for 16,000 messages"
            );
            let n = 550 * 32;
            assert_eq!(
                (s.sent_msgs, s.sent_bytes, s.recv_msgs, s.recv_bytes),
                (n, n * 100, n, n * 100),
                "{name}"
            );
        }
        // The recorder saw the same counts as the snapshot.
        let text = handle.render();
        let sent = text
            .lines()
            .find(|l| {
                l.starts_with(r#"chunnel_messages_total{stack="no-alloc-prom""#)
                    && l.contains(r#"direction="sent""#)
            })
            .and_then(|l| l.rsplit_once(' ')?.1.parse::<u64>().ok());
        assert_eq!(sent, Some(550 * 32), "{text}");
    });
}
