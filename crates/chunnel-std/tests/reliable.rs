//! Reliability and ordering over real UDP loopback sockets, with the fault injector between
//! the socket and the layers (this kernel has no netem: loss is injected in user space).
//!
//! The bar: with 10% of datagrams dropped and 10% reordered in both directions of the
//! client, `Ordered` over `Reliable` delivers 100,000 messages exactly once and in order;
//! the same faults without the layers visibly lose and reorder messages, so the check can
//! fail.

use std::time::Duration;

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ChunnelExt, Listener, stack};
use chunnel_net::udp;
use chunnel_std::ordered::Ordered;
use chunnel_std::reliable::Reliable;
use chunnel_test::fault::{FaultInjector, Faults};

fn msg(i: u64) -> Bytes {
    Bytes::copy_from_slice(&i.to_be_bytes())
}

fn index(m: &Bytes) -> u64 {
    u64::from_be_bytes(m[..8].try_into().expect("8-byte message"))
}

/// `Ok` iff `got` is exactly `0..n`, in order, each once; otherwise what is wrong.
fn exactly_once_in_order(got: &[u64], n: u64) -> Result<(), String> {
    let mut seen = vec![false; n as usize];
    let (mut dups, mut out_of_order, mut alien) = (0, 0, 0);
    for (k, &i) in got.iter().enumerate() {
        if i >= n {
            alien += 1;
            continue;
        }
        if std::mem::replace(&mut seen[i as usize], true) {
            dups += 1;
        }
        if k > 0 && got[k - 1] >= i {
            out_of_order += 1;
        }
    }
    let missing = seen.iter().filter(|s| !**s).count();
    if (missing, dups, out_of_order, alien) == (0, 0, 0, 0) {
        Ok(())
    } else {
        Err(format!(
            "{} received of {n}: {missing} missing, {dups} duplicates, {out_of_order} out of \
             order, {alien} unknown",
            got.len()
        ))
    }
}

/// Receives until `n` messages arrived, then waits `quiet` for any extra one (which would be
/// a duplicate); before that, gives up when nothing arrives for `patience` or at `deadline`.
/// Returns the indices in arrival order.
async fn collect<C: ChunnelConnection<Data = Bytes>>(
    conn: &C,
    n: u64,
    quiet: Duration,
    patience: Duration,
    deadline: Duration,
) -> Vec<u64> {
    let end = tokio::time::Instant::now() + deadline;
    let mut got = Vec::with_capacity(n as usize);
    let mut slots = vec![None; 64];
    loop {
        let wait = if got.len() as u64 >= n {
            quiet
        } else {
            patience
        };
        let wait = wait.min(end.saturating_duration_since(tokio::time::Instant::now()));
        match tokio::time::timeout(wait, conn.recv(&mut slots)).await {
            Ok(Ok(k)) => got.extend(slots[..k].iter_mut().map(|s| index(&s.take().unwrap()))),
            Ok(Err(e)) => panic!("recv failed after {} messages: {e}", got.len()),
            Err(_) => return got,
        }
    }
}

fn lossy(seed: u64) -> FaultInjector {
    let f = Faults::none().with_drop(0.10).with_reorder(0.10, 3);
    FaultInjector::seeded(seed)
        .with_send(f)
        .with_recv(f)
        .without_log()
}

async fn bind() -> (udp::Listener, udp::Connect) {
    let l = udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    (l, udp::Connect::new(addr))
}

/// Sends `0..n` in bursts of 32 from a task; returns the task.
fn spawn_sender<C>(conn: std::sync::Arc<C>, n: u64) -> tokio::task::JoinHandle<()>
where
    C: ChunnelConnection<Data = Bytes> + 'static,
{
    tokio::spawn(async move {
        let mut i = 0;
        while i < n {
            let k = (n - i).min(32);
            conn.send((i..i + k).map(msg)).await.expect("send");
            i += k;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lossy_reordering_udp_delivers_100k_exactly_once_in_order() {
    const N: u64 = 100_000;
    let started = std::time::Instant::now();
    let (listener, base) = bind().await;
    let faults = lossy(0xC0FFEE);
    let mut server = stack![Ordered::default(), Reliable::default()].serve(listener);
    let mut client = stack![
        Ordered::default(),
        Reliable::default(),
        faults.clone(),
        base
    ];
    let conn = std::sync::Arc::new(client.connect_wrap(()).await.expect("connect"));
    let sender = spawn_sender(conn.clone(), N);
    let peer = tokio::time::timeout(Duration::from_secs(5), server.accept())
        .await
        .expect("accept in time")
        .expect("accept");
    let got = collect(
        &peer,
        N,
        Duration::from_millis(300),
        Duration::from_secs(60),
        Duration::from_secs(60),
    )
    .await;
    sender.await.expect("sender");
    let st = faults.stats.clone();
    let rs = conn.get_ref().stats();
    eprintln!(
        "100k: {:?}; injector: {} sent ({} dropped), {} received ({} dropped), {} reordered; \
         reliable: {:?}",
        started.elapsed(),
        st.sent(),
        st.dropped_sent(),
        st.received(),
        st.dropped_received(),
        st.reordered(),
        rs
    );
    exactly_once_in_order(&got, N).unwrap();
    // The faults really happened: about 10% of each direction dropped, and recovered.
    assert!(
        st.dropped_sent() > N / 20,
        "too few drops: {}",
        st.dropped_sent()
    );
    assert!(st.dropped_received() > 0 && st.reordered() > N / 20);
    assert!(rs.retransmitted >= st.dropped_sent() / 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_layers_the_same_faults_lose_and_reorder() {
    const N: u64 = 10_000;
    let (mut listener, base) = bind().await;
    let mut client = stack![lossy(0xC0FFEE), base];
    let conn = std::sync::Arc::new(client.connect_wrap(()).await.expect("connect"));
    let sender = spawn_sender(conn.clone(), N);
    let peer = listener.accept().await.expect("accept");
    let got = collect(
        &peer,
        N,
        Duration::from_millis(300),
        Duration::from_secs(1),
        Duration::from_secs(20),
    )
    .await;
    sender.await.expect("sender");
    let why = exactly_once_in_order(&got, N).expect_err("faults without reliability must show");
    eprintln!("without the layers: {why}");
    assert!(got.len() < (N as usize) * 95 / 100, "{why}");
    assert!(
        got.windows(2).any(|w| w[0] > w[1]),
        "nothing reordered: {why}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_and_delays_at_both_ends() {
    const N: u64 = 5_000;
    let (listener, base) = bind().await;
    let ms = Duration::from_millis(20);
    let client_faults = FaultInjector::seeded(11)
        .with_send(
            Faults::none()
                .with_drop(0.05)
                .with_duplicate(0.2)
                .with_delay(0.2, ms),
        )
        .with_recv(Faults::none().with_duplicate(0.2).with_delay(0.1, ms))
        .without_log();
    let server_faults = FaultInjector::seeded(12)
        .with_send(
            Faults::none()
                .with_duplicate(0.2)
                .with_delay(0.2, ms)
                .with_drop(0.05),
        )
        .with_recv(Faults::none().with_duplicate(0.1).with_reorder(0.1, 5))
        .without_log();
    let mut server = stack![
        Ordered::default(),
        Reliable::default(),
        server_faults.clone()
    ]
    .serve(listener);
    let mut client = stack![
        Ordered::default(),
        Reliable::default(),
        client_faults.clone(),
        base
    ];
    let conn = std::sync::Arc::new(client.connect_wrap(()).await.expect("connect"));
    let sender = spawn_sender(conn.clone(), N);
    let peer = server.accept().await.expect("accept");
    let got = collect(
        &peer,
        N,
        Duration::from_millis(300),
        Duration::from_secs(30),
        Duration::from_secs(30),
    )
    .await;
    sender.await.expect("sender");
    exactly_once_in_order(&got, N).unwrap();
    let (c, s) = (&client_faults.stats, &server_faults.stats);
    assert!(c.duplicated() > 0 && c.delayed() > 0 && s.duplicated() > 0 && s.delayed() > 0);
    let rs = conn.get_ref().stats();
    assert!(rs.retransmitted > 0, "{rs:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retransmits_when_the_application_only_sends() {
    const N: u64 = 2_000;
    let (listener, base) = bind().await;
    // Loss both ways: data and acks.
    let f = Faults::none().with_drop(0.2);
    let faults = FaultInjector::seeded(5)
        .with_send(f)
        .with_recv(f)
        .without_log();
    let mut server = Reliable::default().serve(listener);
    let mut client = stack![Reliable::default(), faults.clone(), base];
    // The server stays up (and keeps acknowledging retransmissions) until the client has
    // flushed: a last acknowledgement lost after the receiver had everything is repaired only
    // by a retransmission the server answers. (Dropped after the 300 ms of quiet, a loaded
    // machine's retransmission found the socket closed: `PeerClosed`.)
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let (got_tx, got_rx) = tokio::sync::oneshot::channel();
    let receiver = tokio::spawn(async move {
        let peer = server.accept().await.expect("accept");
        let got = collect(
            &peer,
            N,
            Duration::from_millis(300),
            Duration::from_secs(30),
            Duration::from_secs(30),
        )
        .await;
        let _ = got_tx.send(got);
        // Keeps receiving (the layer acknowledges as it delivers) until the client is done.
        let mut slots = vec![None; 64];
        let mut done = done_rx;
        loop {
            tokio::select! {
                _ = &mut done => return,
                r = peer.recv(&mut slots) => if r.is_err() { return },
            }
        }
    });
    let conn = client.connect_wrap(()).await.expect("connect");
    // Sends everything and never receives nor flushes; the last messages' losses can only
    // be repaired by the connection's own timer.
    for i in (0..N).step_by(50) {
        if let Err(e) = conn.send((i..i + 50).map(msg)).await {
            panic!(
                "send {i}: {e}: {:?} sent {} dropped {} recv {} dropped {}",
                conn.stats(),
                faults.stats.sent(),
                faults.stats.dropped_sent(),
                faults.stats.received(),
                faults.stats.dropped_received()
            );
        }
    }
    let mut got = got_rx.await.expect("receiver");
    got.sort_unstable();
    conn.flush().await.expect("everything acknowledged");
    let _ = done_tx.send(());
    receiver.await.expect("receiver");
    exactly_once_in_order(&got, N).unwrap();
    let rs = conn.stats();
    assert!(
        faults.stats.dropped_sent() > 0 && rs.timeouts > 0 && rs.retransmitted > 0,
        "{rs:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_alone_over_lossy_udp_skips_gaps_in_order() {
    const N: u64 = 2_000;
    let (listener, base) = bind().await;
    let faults = FaultInjector::seeded(9)
        .with_send(
            Faults::none()
                .with_drop(0.1)
                .with_reorder(0.2, 4)
                .with_duplicate(0.1),
        )
        .without_log();
    let mut server = Ordered::lossy(Duration::from_millis(50)).serve(listener);
    let mut client = stack![Ordered::default(), faults, base];
    let conn = client.connect_wrap(()).await.expect("connect");
    // Paced, so the socket buffers do not add loss of their own.
    let sender = tokio::spawn(async move {
        for i in (0..N).step_by(20) {
            conn.send((i..i + 20).map(msg)).await.expect("send");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    let peer = server.accept().await.expect("accept");
    let got = collect(
        &peer,
        N,
        Duration::from_millis(300),
        Duration::from_secs(1),
        Duration::from_secs(20),
    )
    .await;
    sender.await.expect("sender");
    assert!(
        got.windows(2).all(|w| w[0] < w[1]),
        "in order, at most once"
    );
    assert!(
        got.len() < N as usize && got.len() > N as usize / 2,
        "{} of {N}",
        got.len()
    );
    assert!(peer.stats().skipped > 0);
}
