//! Ping-pong over loopback for profiling: `pingpong [uring|kernel|uc-ks|kc-us] [round trips]`
//! (`uc-ks`: io_uring client, kernel server; `kc-us` the other way round). Client and
//! server run on their own threads (current-thread runtimes), pinned to CPUs 0 and 1 when the
//! machine has two. Prints the p50 round trip.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ConnectionExt, Listener};

fn pin(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn serve<L>(mut l: L)
where
    L: Listener,
    L::Connection: ChunnelConnection<Data = Bytes>,
{
    let c = l.accept().await.unwrap();
    let mut slots = vec![None; 32];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(2), c.recv(&mut slots)).await {
        if c.send(slots[..n].iter_mut().filter_map(Option::take))
            .await
            .is_err()
        {
            break;
        }
    }
}

async fn ping<C: ChunnelConnection<Data = Bytes>>(c: &C, n: usize) -> f64 {
    let msg = Bytes::from(vec![1u8; 64]);
    let mut rtts = Vec::with_capacity(n);
    for i in 0..n + 500 {
        let t = Instant::now();
        c.send_one(msg.clone()).await.unwrap();
        c.recv_one().await.unwrap();
        if i >= 500 {
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    rtts.sort_by(f64::total_cmp);
    rtts[rtts.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let kind = args.next().unwrap_or_else(|| "uring".into());
    let n: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let (tx, rx) = std::sync::mpsc::sync_channel::<SocketAddr>(1);
    let k = kind.clone();
    let server = std::thread::spawn(move || {
        pin(1);
        rt().block_on(async move {
            let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
            if k == "uring" || k == "kc-us" {
                let l = chunnel_uring::udp::Listener::bind(any).await.unwrap();
                tx.send(l.local_addr().unwrap()).unwrap();
                serve(l).await
            } else {
                let l = chunnel_net::udp::Listener::bind(any).await.unwrap();
                tx.send(l.local_addr().unwrap()).unwrap();
                serve(l).await
            }
        })
    });
    let addr = rx.recv().unwrap();
    pin(0);
    let p50 = rt().block_on(async move {
        if kind == "uring" || kind == "uc-ks" {
            let c = chunnel_uring::udp::Connect::new(addr)
                .connect_wrap(())
                .await
                .unwrap();
            ping(&c, n).await
        } else {
            let c = chunnel_net::udp::Connect::new(addr)
                .connect_wrap(())
                .await
                .unwrap();
            ping(&c, n).await
        }
    });
    println!("p50 {p50:.1} us");
    server.join().unwrap();
}
