//! `select(uring::Connect, udp::Connect)` falls back to kernel UDP when io_uring is not
//! available, forced per Chunnel (`Config::with_forced_unavailable`) or per process (the
//! `CHUNNEL_URING_DISABLE` environment variable, checked in a child process).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunnel::{Chunnel, ConnectionExt, Error, Listener as _, Negotiate, Offers, Side, select};
use chunnel_uring::udp;

const WAIT: Duration = Duration::from_secs(10);

async fn echo_once<C: chunnel::ChunnelConnection<Data = Bytes>>(
    conn: &C,
    l: &mut chunnel_net::udp::Listener,
) {
    tokio::time::timeout(WAIT, async {
        conn.send_one(Bytes::from_static(b"ping")).await.unwrap();
        let s = l.accept().await.unwrap();
        assert_eq!(s.recv_one().await.unwrap(), "ping");
        s.send_one(Bytes::from_static(b"pong")).await.unwrap();
        assert_eq!(conn.recv_one().await.unwrap(), "pong");
    })
    .await
    .expect("echo within the time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn select_prefers_uring_when_available() {
    if let Err(e) = chunnel_uring::check_available() {
        eprintln!("io_uring unavailable here ({e}); preference not testable");
        return;
    }
    let mut l = chunnel_net::udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    let mut s = select(
        udp::Connect::new(addr),
        chunnel_net::udp::Connect::new(addr),
    );
    let ids: Vec<_> = s
        .offers()
        .iter()
        .map(|o| o.chunnels[0].id.to_string())
        .collect();
    assert_eq!(ids, ["chunnel/uring-udp/1", "chunnel/udp/1"]);
    let conn = s.connect_wrap(()).await.unwrap();
    assert_eq!(conn.side(), Side::Left);
    echo_once(&conn, &mut l).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn select_falls_back_when_forced_unavailable() {
    let mut l = chunnel_net::udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    let off = udp::Config::default().with_forced_unavailable(true);
    let uring = udp::Connect::new(addr).with_config(off.clone());
    match uring.check_available() {
        Err(Error::NotAvailable { chunnel, reason }) => {
            assert_eq!(chunnel, "chunnel/uring-udp/1");
            assert!(reason.contains("forced"), "{reason}");
        }
        other => panic!("forced unavailability gave {other:?}"),
    }
    let mut s = select(uring, chunnel_net::udp::Connect::new(addr));
    // Negotiation would only offer the kernel datapath.
    let ids: Vec<_> = s
        .offers()
        .iter()
        .map(|o| o.chunnels[0].id.to_string())
        .collect();
    assert_eq!(ids, ["chunnel/udp/1"]);
    let conn = s.connect_wrap(()).await.unwrap();
    assert_eq!(conn.side(), Side::Right);
    echo_once(&conn, &mut l).await;

    // Used directly, the unavailable datapath refuses clearly instead of failing later.
    match udp::Connect::new(addr)
        .with_config(off.clone())
        .connect_wrap(())
        .await
    {
        Err(Error::NotAvailable { .. }) => {}
        other => panic!("connect_wrap gave {:?}", other.map(|_| ())),
    }
    match udp::Listener::bind_with("127.0.0.1:0".parse().unwrap(), off).await {
        Err(Error::NotAvailable { .. }) => {}
        other => panic!("bind gave {:?}", other.map(|_| ())),
    }
}

const CHILD: &str = "CHUNNEL_URING_FALLBACK_CHILD";

/// Runs only inside the child process started by `env_var_disables_in_a_process`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn env_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    match chunnel_uring::check_available() {
        Err(Error::NotAvailable { reason, .. }) => {
            assert!(reason.contains(chunnel_uring::DISABLE_ENV), "{reason}")
        }
        other => panic!("with {} set: {other:?}", chunnel_uring::DISABLE_ENV),
    }
    let mut l = chunnel_net::udp::Listener::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    let mut s = select(
        udp::Connect::new(addr),
        chunnel_net::udp::Connect::new(addr),
    );
    let conn = s.connect_wrap(()).await.unwrap();
    assert_eq!(conn.side(), Side::Right);
    echo_once(&conn, &mut l).await;
    println!("ENV-CHILD-FELL-BACK");
}

#[test]
fn env_var_disables_in_a_process() {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args(["--exact", "env_child", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env(chunnel_uring::DISABLE_ENV, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("child test did not finish within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        status.success() && stdout.contains("ENV-CHILD-FELL-BACK"),
        "child failed: {status}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The server side: `select(uring::Bind, udp::Bind)` listens on io_uring where it runs and on
/// kernel UDP where it is unavailable (forced here), and a kernel UDP client is echoed by
/// whichever was bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_select_falls_back_to_kernel_udp() {
    use chunnel::{Either, Listen};
    let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    let off = udp::Config::default().with_forced_unavailable(true);
    for (uring, want) in [
        (
            udp::Bind::new(any),
            if chunnel_uring::check_available().is_ok() {
                Side::Left
            } else {
                Side::Right
            },
        ),
        (udp::Bind::new(any).with_config(off.clone()), Side::Right),
    ] {
        let s = select(uring, chunnel_net::udp::Bind::new(any));
        let mut l = tokio::time::timeout(WAIT, s.listen())
            .await
            .expect("listen within the time limit")
            .unwrap();
        assert_eq!(l.side(), want);
        let addr = match &l {
            Either::Left(l) => l.local_addr().unwrap(),
            Either::Right(l) => l.local_addr().unwrap(),
        };
        let conn = chunnel_net::udp::Connect::new(addr)
            .connect_wrap(())
            .await
            .unwrap();
        tokio::time::timeout(WAIT, async {
            conn.send_one(Bytes::from_static(b"ping")).await.unwrap();
            let s = l.accept().await.unwrap();
            assert_eq!(s.side(), want);
            assert_eq!(s.recv_one().await.unwrap(), "ping");
            s.send_one(Bytes::from_static(b"pong")).await.unwrap();
            assert_eq!(conn.recv_one().await.unwrap(), "pong");
        })
        .await
        .expect("echo within the time limit");
    }
}
