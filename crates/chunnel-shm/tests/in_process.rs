//! Two tasks of one process negotiate over UDP and pick shared memory.

mod support;

use std::time::Duration;

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ConnectionExt, Error, Side};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_net::udp;
use support::{WAIT, app, client_stack, serve, server_stack};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_process_picks_shm_and_echoes() -> anyhow::Result<()> {
    let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = listener.local_addr()?;
    let (tx, mut picks) = tokio::sync::mpsc::channel(64);
    serve(listener, tx);
    let side = tokio::time::timeout(WAIT, app(addr)).await??;
    assert_eq!(side, Side::Left, "the client must pick shared memory");
    let server_side = tokio::time::timeout(WAIT, picks.recv()).await?;
    assert_eq!(
        server_side,
        Some(Side::Left),
        "the server must pick shared memory"
    );
    // Set-up unlinked the region: nothing of ours is left in /dev/shm. The other tests of
    // this binary run at the same time, and a region of theirs is there from its creation
    // until their server attaches, so the listing must become empty, not be empty at once.
    let prefix = format!("chunnel-shm-{}-", std::process::id());
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let left: Vec<_> = std::fs::read_dir("/dev/shm")?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "files left in /dev/shm: {left:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Dropping one end ends the other with `PeerClosed` after the messages already sent;
/// oversized messages are refused; a parked receiver is woken by a later send.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_oversize_and_parked_wake() -> anyhow::Result<()> {
    let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = listener.local_addr()?;
    let mut server = listen(server_stack(), listener, Config::default());
    let base = udp::Connect::new(addr).connect_wrap(()).await?;
    let client = Client::new(Config::default());
    let key = addr.to_string();
    let (conn, srv) = tokio::time::timeout(WAIT, async {
        tokio::join!(client.connect(&key, client_stack(), base), server.accept())
    })
    .await?;
    let (conn, srv) = (conn?, srv?);
    assert_eq!(conn.get_ref().side(), Side::Left);
    assert_eq!(srv.get_ref().side(), Side::Left);

    let too_big = Bytes::from(vec![0u8; 64 * 1024 + 1]);
    match conn.send_one(too_big).await {
        Err(Error::MessageTooLarge { len, max }) => {
            assert_eq!((len, max), (64 * 1024 + 1, 64 * 1024));
        }
        other => panic!("expected MessageTooLarge, got {other:?}"),
    }

    // The server parks (longer than the spin), then a send wakes it.
    let waiter = tokio::spawn(async move {
        let m = srv.recv_one().await;
        (srv, m)
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    conn.send_one(Bytes::from_static(b"wake")).await?;
    let (srv, m) = tokio::time::timeout(WAIT, waiter).await??;
    assert_eq!(m?, "wake");

    conn.send([Bytes::from_static(b"a"), Bytes::from_static(b"b")])
        .await?;
    drop(conn);
    assert_eq!(srv.recv_one().await?, "a");
    assert_eq!(srv.recv_one().await?, "b");
    let end = tokio::time::timeout(WAIT, srv.recv_one()).await?;
    assert!(matches!(end, Err(Error::PeerClosed)), "got {end:?}");
    assert!(matches!(
        srv.send_one(Bytes::from_static(b"x")).await,
        Err(Error::PeerClosed)
    ));
    Ok(())
}

/// A full ring makes the sender wait until the receiver drains it; nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backpressure_loses_nothing() -> anyhow::Result<()> {
    let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = listener.local_addr()?;
    let mut server = listen(server_stack(), listener, Config::default());
    let base = udp::Connect::new(addr).connect_wrap(()).await?;
    let client = Client::new(Config::default());
    let key = addr.to_string();
    let (conn, srv) = tokio::join!(client.connect(&key, client_stack(), base), server.accept());
    let (conn, srv) = (conn?, srv?);
    const N: u32 = 20_000; // ~160 MiB through a 256 KiB ring
    let sender = tokio::spawn(async move {
        for i in 0..N {
            let mut v = vec![0u8; 8000];
            v[..4].copy_from_slice(&i.to_le_bytes());
            conn.send_one(Bytes::from(v)).await?;
        }
        Ok::<_, Error>(conn)
    });
    let mut next = 0u32;
    let mut slots = vec![None; 32];
    while next < N {
        let n = tokio::time::timeout(WAIT, srv.recv(&mut slots)).await??;
        for m in slots[..n].iter_mut().filter_map(Option::take) {
            assert_eq!(m.len(), 8000);
            assert_eq!(u32::from_le_bytes(m[..4].try_into()?), next);
            next += 1;
        }
    }
    let _conn = tokio::time::timeout(WAIT, sender).await???;
    Ok(())
}
