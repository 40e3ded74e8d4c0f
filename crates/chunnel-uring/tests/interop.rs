//! Wire compatibility with the kernel datapath (`chunnel_net::udp`) in both directions, plus
//! io_uring-specific edge cases: bursts larger than the socket buffer (ordering), oversize
//! datagrams from a raw peer, concurrent senders on one connection. Every wait is bounded.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ConnectionExt, Error, Listener as _};
use chunnel_test::recv_n;
use chunnel_uring::udp;

const WAIT: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {WAIT:?}"))
}

fn numbered(i: usize, len: usize) -> Bytes {
    let mut v = vec![(i % 251) as u8; len.max(4)];
    v[..4].copy_from_slice(&(i as u32).to_be_bytes());
    v.truncate(len.max(4));
    Bytes::from(v)
}

fn seq(m: &[u8]) -> u32 {
    u32::from_be_bytes(m[..4].try_into().unwrap())
}

/// A burst of varied sizes (empty and max included) both ways over `client` and `server`.
async fn exchange<C, S>(client: &C, server: &S)
where
    C: ChunnelConnection<Data = Bytes>,
    S: ChunnelConnection<Data = Bytes>,
{
    let burst: Vec<Bytes> = (0..40).map(|i| numbered(i, 10 + i * 37)).collect();
    within("client send", client.send(burst.clone()))
        .await
        .unwrap();
    let got = within("server recv", recv_n(server, burst.len()))
        .await
        .unwrap();
    assert_eq!(got, burst);
    for m in [Bytes::new(), numbered(9, udp::MAX_PAYLOAD)] {
        within("server send", server.send([m.clone()]))
            .await
            .unwrap();
        let got = within("client recv", client.recv_one()).await.unwrap();
        assert!(got == m, "a {}-byte message changed", m.len());
        within("client send", client.send([m.clone()]))
            .await
            .unwrap();
        let got = within("server recv", server.recv_one()).await.unwrap();
        assert!(got == m, "a {}-byte message changed", m.len());
    }
    within("server send", server.send(burst.clone()))
        .await
        .unwrap();
    let got = within("client recv", recv_n(client, burst.len()))
        .await
        .unwrap();
    assert_eq!(got, burst);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uring_client_kernel_server() {
    let mut l = chunnel_net::udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let client = udp::Connect::new(l.local_addr().unwrap())
        .connect_wrap(())
        .await
        .unwrap();
    within("hello", client.send_one(Bytes::from_static(b"hi")))
        .await
        .unwrap();
    let server = within("accept", l.accept()).await.unwrap();
    assert_eq!(within("recv", server.recv_one()).await.unwrap(), "hi");
    assert_eq!(server.peer_addr(), &client.local_addr().unwrap());
    exchange(&client, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_client_uring_server() {
    let mut l = udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let client = chunnel_net::udp::Connect::new(l.local_addr().unwrap())
        .connect_wrap(())
        .await
        .unwrap();
    within("hello", client.send_one(Bytes::from_static(b"hi")))
        .await
        .unwrap();
    let server = within("accept", l.accept()).await.unwrap();
    assert_eq!(within("recv", server.recv_one()).await.unwrap(), "hi");
    exchange(&client, &server).await;
}

#[tokio::test(flavor = "current_thread")]
async fn uring_both_ends_ipv6() {
    let Ok(mut l) = udp::Listener::bind("[::1]:0".parse().unwrap()).await else {
        eprintln!("no IPv6 loopback here; skipped");
        return;
    };
    let client = udp::Connect::new(l.local_addr().unwrap())
        .connect_wrap(())
        .await
        .unwrap();
    within("hello", client.send_one(Bytes::from_static(b"hi")))
        .await
        .unwrap();
    let server = within("accept", l.accept()).await.unwrap();
    assert_eq!(server.peer_addr(), &client.local_addr().unwrap());
    assert_eq!(within("recv", server.recv_one()).await.unwrap(), "hi");
    exchange(&client, &server).await;
}

/// One `send` of far more bytes than the socket buffer holds: the linked chain waits for
/// room instead of failing, and whatever arrives arrives in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_larger_than_socket_buffer_keeps_order() {
    let rx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    rx.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let client = udp::Connect::new(rx.local_addr().unwrap())
        .connect_wrap(())
        .await
        .unwrap();
    let n = 400;
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 65_536];
        let mut seen = Vec::new();
        while let Ok(k) = rx.recv(&mut buf) {
            assert_eq!(k, 16 * 1024);
            seen.push(seq(&buf));
        }
        seen
    });
    let burst: Vec<Bytes> = (0..n).map(|i| numbered(i, 16 * 1024)).collect();
    within("6.4 MB burst", client.send(burst)).await.unwrap();
    let seen = reader.join().unwrap();
    assert!(!seen.is_empty(), "nothing arrived");
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "datagrams of one burst arrived out of order"
    );
    eprintln!("{} of {n} datagrams arrived, in order", seen.len());
}

/// Datagrams over `max_payload` from a raw peer are dropped and counted; the next fits.
#[tokio::test(flavor = "current_thread")]
async fn oversize_incoming_is_dropped_and_counted() {
    let cfg = udp::Config::default().with_datagram(|d| d.with_max_payload_bytes(100));
    let mut l = udp::Listener::bind_with("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let raw = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    raw.send_to(&[1u8; 101], addr).unwrap();
    raw.send_to(&[2u8; 100], addr).unwrap();
    let server = within("accept", l.accept()).await.unwrap();
    let got = within("recv", server.recv_one()).await.unwrap();
    assert_eq!(&got[..], &[2u8; 100][..]);
    assert_eq!(l.dropped().0, 1);
    match server.send([Bytes::from(vec![0u8; 101])]).await {
        Err(Error::MessageTooLarge { len: 101, max: 100 }) => {}
        other => panic!("oversize send gave {other:?}"),
    }
}

/// Many tasks sending and receiving on one client connection at once (each keeps one
/// message in flight, so no queue overflows; a task may receive another task's echo).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_tasks_share_a_connection() {
    let l = chunnel_net::udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let mut c = udp::Connect::new(l.local_addr().unwrap());
    let echo = chunnel_test::spawn_echo(l);
    let conn = std::sync::Arc::new(c.connect_wrap(()).await.unwrap());
    let tasks = 8;
    let per = 200;
    let mut handles = Vec::new();
    for t in 0..tasks {
        let conn = conn.clone();
        handles.push(tokio::spawn(async move {
            let mut got = Vec::new();
            for i in 0..per {
                conn.send([numbered(t * 1000 + i, 64)]).await?;
                got.push(seq(&conn.recv_one().await?));
            }
            Ok::<_, Error>(got)
        }));
    }
    let mut seqs = Vec::new();
    for h in handles {
        seqs.extend(within("task", h).await.unwrap().unwrap());
    }
    seqs.sort_unstable();
    let want: Vec<u32> = (0..tasks)
        .flat_map(|t| (0..per).map(move |i| (t * 1000 + i) as u32))
        .collect();
    assert_eq!(seqs, want);
    echo.abort();
}

/// Cancelling a `send` future mid-burst neither corrupts the connection nor leaks slots.
#[tokio::test(flavor = "current_thread")]
async fn cancelled_sends_leave_the_connection_usable() {
    let rx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let client = udp::Connect::new(rx.local_addr().unwrap())
        .connect_wrap(())
        .await
        .unwrap();
    for _ in 0..50 {
        let burst: Vec<Bytes> = (0..64).map(|i| numbered(i, 30_000)).collect();
        // Poll once (submits a batch), then drop the future.
        let fut = client.send(burst);
        tokio::pin!(fut);
        let _ = futures_poll_once(fut.as_mut()).await;
    }
    // Drain whatever got through, then check the connection still sends.
    rx.set_nonblocking(true).unwrap();
    let mut buf = vec![0u8; 65_536];
    tokio::time::sleep(Duration::from_millis(50)).await;
    while rx.recv(&mut buf).is_ok() {}
    rx.set_nonblocking(false).unwrap();
    rx.set_read_timeout(Some(WAIT)).unwrap();
    within(
        "send after cancels",
        client.send([Bytes::from_static(b"ok")]),
    )
    .await
    .unwrap();
    let mut got = 0;
    loop {
        let k = rx.recv(&mut buf).unwrap();
        if &buf[..k] == b"ok" {
            break;
        }
        got += 1;
        assert!(got < 100_000);
    }
}

async fn futures_poll_once<F: Future + Unpin>(mut f: F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        })
    })
    .await
}

/// On a current-thread runtime the ring defers completion work to the thread that first uses
/// it (`Config::single_thread` defaults to yes there). Used from another thread afterwards, the
/// connection fails with an error that says so, instead of hanging; with `single_thread` off
/// the same move works.
#[test]
fn single_thread_ring_used_from_another_thread_errors_clearly() {
    let reflector = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    reflector.set_read_timeout(Some(WAIT)).unwrap();
    let addr = reflector.local_addr().unwrap();
    let rt = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    for single_thread in [None, Some(false)] {
        let cfg = udp::Config::default().with_single_thread(single_thread);
        let conn = rt().block_on(async {
            let c = udp::Connect::new(addr)
                .with_config(cfg)
                .connect_wrap(())
                .await
                .unwrap();
            within("first send", c.send([Bytes::from_static(b"one")]))
                .await
                .unwrap();
            c
        });
        let mut buf = [0u8; 16];
        let (n, _) = reflector.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"one");
        let second = std::thread::spawn(move || {
            rt().block_on(async {
                within("second send", conn.send([Bytes::from_static(b"two")])).await
            })
        })
        .join()
        .unwrap();
        match single_thread {
            None => {
                let e = second.expect_err("a single-thread ring used from another thread");
                assert!(
                    e.to_string().contains("bound to the thread"),
                    "unclear error: {e}"
                );
            }
            _ => {
                second.unwrap();
                let (n, _) = reflector.recv_from(&mut buf).unwrap();
                assert_eq!(&buf[..n], b"two");
            }
        }
    }
}

/// A chosen local address that another socket holds, or of the other IP family, is a typed
/// error (as with `chunnel_net::udp::Connect::with_local_addr`).
#[tokio::test]
async fn uring_client_bind_errors_are_typed() {
    let holder = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let taken = holder.local_addr().unwrap();
    let server: std::net::SocketAddr = "127.0.0.1:9".parse().unwrap();
    let r = udp::Connect::new(server)
        .with_local_addr(taken)
        .connect_wrap(())
        .await;
    assert!(matches!(&r, Err(Error::AddrInUse { .. })), "{r:?}");
    let v6: std::net::SocketAddr = "[::1]:0".parse().unwrap();
    let r = udp::Connect::new(server)
        .with_local_addr(v6)
        .connect_wrap(())
        .await;
    assert!(matches!(&r, Err(Error::AddrFamily { .. })), "{r:?}");
}
