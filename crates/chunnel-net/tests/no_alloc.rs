//! No heap allocation per message on the send/recv path of a no-op stack over kernel UDP.
//!
//! A counting global allocator wraps the system allocator. After a warm-up, a client with
//! five `Noop` layers sends bursts to a raw reflector socket and receives them back; the test
//! fails if any allocation happens in that steady state.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Noop, stack};
use chunnel_net::udp;

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: defers to `System`, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

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
        let before = ALLOCS.load(Ordering::Relaxed);
        bursts(&conn, &reflector, &msg, &mut slots, &mut buf, 500).await;
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        assert_eq!(allocs, 0, "{allocs} allocations for 16,000 messages");
    });
}
