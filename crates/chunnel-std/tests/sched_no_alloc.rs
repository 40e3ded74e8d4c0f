//! No heap allocation per message on the send path of the packet scheduler over kernel UDP.
//!
//! A counting global allocator wraps the system allocator. After a warm-up, a client sends
//! bursts of two classes through `Sched` (strict priority and the time-aware shaper, with gates
//! always open and with gates that close, so the driver waits on its precise timer) to a raw
//! reflector socket, waits for the driver to hand them to the socket (`flush`), and receives
//! them back; the test fails if any allocation happens in that steady state.

use std::time::Duration;

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, stack};
use chunnel_net::udp;
use chunnel_std::sched::{Config, GateEntry, GateSchedule, Policy, Sched};

#[global_allocator]
static A: chunnel_test::alloc::Counting = chunnel_test::alloc::Counting::new();

#[test]
fn scheduled_sends_allocate_nothing_per_message() {
    let always_open = GateSchedule::new(vec![
        GateEntry::new(Duration::from_micros(500), [0, 1]),
        GateEntry::new(Duration::from_micros(500), [0, 1]),
    ])
    .unwrap();
    // Gates that close: the driver waits for them on its precise timer.
    let alternating = GateSchedule::new(vec![
        GateEntry::new(Duration::from_micros(300), [0]),
        GateEntry::new(Duration::from_micros(300), [1]),
    ])
    .unwrap();
    for policy in [
        Policy::StrictPriority,
        Policy::TimeAware(always_open),
        Policy::TimeAware(alternating),
    ] {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let reflector = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let cfg = Config::default().with_policy(policy).with_classes(2);
            let classify = |m: &Bytes| m[0];
            let mut s = stack![
                Sched::new(cfg, classify),
                udp::Connect::new(reflector.local_addr().unwrap())
            ];
            let conn = s.connect_wrap(()).await.unwrap();
            let msgs = [Bytes::from(vec![0u8; 100]), Bytes::from(vec![1u8; 100])];
            let mut slots = vec![None; 32];
            let mut buf = vec![0u8; 2048];
            let mut round = async |n: usize| {
                for _ in 0..n {
                    conn.send((0..slots.len()).map(|i| msgs[i % 2].clone()))
                        .await
                        .unwrap();
                    conn.flush().await;
                    for _ in 0..slots.len() {
                        let (k, from) = reflector.recv_from(&mut buf).unwrap();
                        reflector.send_to(&buf[..k], from).unwrap();
                    }
                    let mut got = 0;
                    while got < slots.len() {
                        got += conn.recv(&mut slots[got..]).await.unwrap();
                    }
                    slots.iter_mut().for_each(|s| *s = None);
                }
            };
            round(50).await;
            // The driver yields while it spins the last microseconds before a gate; a
            // runtime's first yield grows tokio's deferred-waker list once (to four wakers,
            // kept). Whether a gate fell within the spin window during the warm-up depends on
            // timing, so the test makes that one allocation here, outside the measurement.
            tokio::task::yield_now().await;
            let before = A.count();
            round(300).await;
            let allocs = A.count() - before;
            assert_eq!(allocs, 0, "{allocs} allocations for 9,600 messages");
        });
    }
}
