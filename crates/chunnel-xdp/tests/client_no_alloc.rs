//! The AF_XDP client's data path allocates nothing per message: after a warm-up, 2,000 round
//! trips through an `AfXdpConnect` connection (send one message, receive its echo into the
//! same slots) make no allocation in the whole process. The echo in the other namespace is a
//! hand-written loop on `chunnel_xdp::raw` whose buffers are allocated before it starts, so
//! every allocation counted would be the client's.
//!
//! Needs root, `ip` and the XDP program (else it prints why and passes, unless
//! CHUNNEL_XDP_REQUIRE=1).

use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection};
use chunnel_xdp::{AfXdpConnect, Config, raw};

mod support;

use support::{SERVER, in_netns, netns, privileged, program_built};

#[global_allocator]
static A: chunnel_test::alloc::Counting = chunnel_test::alloc::Counting::new();

/// Echoes every datagram until `stop`, with buffers allocated up front.
fn raw_echo(ns: &str, ready: mpsc::SyncSender<()>, stop: Arc<AtomicBool>) -> Result<()> {
    chunnel_test::netns::enter(ns)?;
    let mut sock = raw::Socket::open(&Config::new("xb", SERVER.parse()?))?;
    let mut scratch: Vec<u8> = Vec::with_capacity(64 * sock.frame_size());
    let mut replies: Vec<(raw::Reply, std::ops::Range<usize>)> = Vec::with_capacity(64);
    ready.send(())?;
    let mut ip_id = 0u16;
    while !stop.load(Ordering::Relaxed) {
        scratch.clear();
        replies.clear();
        let n = sock.recv_batch(64, |f| {
            if let Some((r, range)) = raw::parse_reply(f) {
                let at = scratch.len();
                scratch.extend_from_slice(&f[range]);
                replies.push((r, at..scratch.len()));
            }
        });
        if sock.fill_needs_wakeup() {
            sock.kick_rx();
        }
        if n == 0 {
            let mut pfd = libc::pollfd {
                fd: sock.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut pfd, 1, 20) };
            continue;
        }
        let mut sent = 0;
        while sent < replies.len() {
            sock.send_batch(|buf| {
                let (r, range) = replies.get(sent)?;
                let len = raw::build_reply(buf, r, ip_id, &scratch[range.clone()])?;
                ip_id = ip_id.wrapping_add(1);
                sent += 1;
                Some(len)
            });
            sock.flush_tx();
        }
    }
    Ok(())
}

#[test]
fn round_trips_allocate_nothing() -> Result<()> {
    if !privileged() || !program_built() {
        return Ok(());
    }
    let ns = netns()?;
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    let server = {
        let (nsb, stop) = (ns.b.clone(), stop.clone());
        std::thread::spawn(move || raw_echo(&nsb, ready_tx, stop))
    };
    ready_rx.recv_timeout(Duration::from_secs(20))?;
    let r = in_netns(&ns.a, || async {
        let server: SocketAddrV4 = SERVER.parse()?;
        let conn = AfXdpConnect::new(Config::new("xa", "0.0.0.0:0".parse()?), server)
            .connect_wrap(())
            .await?;
        let msg = Bytes::from(vec![0x5a; 200]);
        let mut slots: Vec<Option<Bytes>> = vec![None; 4];
        let mut trip = async |i: usize| -> Result<()> {
            conn.send([msg.clone()]).await?;
            let n = tokio::time::timeout(Duration::from_secs(2), conn.recv(&mut slots))
                .await
                .map_err(|_| anyhow::anyhow!("no echo for round trip {i}"))??;
            ensure!(n == 1 && slots[0].take().as_ref() == Some(&msg), "bad echo");
            Ok(())
        };
        for i in 0..500 {
            trip(i).await?;
        }
        let before = A.count();
        let t = Instant::now();
        for i in 0..2000 {
            trip(i).await?;
        }
        let allocs = A.count() - before;
        eprintln!(
            "2000 round trips in {:?}: {allocs} allocations",
            t.elapsed()
        );
        ensure!(allocs == 0, "{allocs} allocations in 2000 round trips");
        Ok(())
    })
    .join()
    .expect("client thread panicked");
    stop.store(true, Ordering::Relaxed);
    server.join().expect("server thread panicked")?;
    r
}
