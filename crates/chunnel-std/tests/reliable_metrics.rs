//! Feature `metrics`: Reliable's retransmissions (by timeout and fast) are exported through
//! the `metrics` facade with the counts its connection keeps, over lossy UDP.

use std::time::Duration;

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ChunnelExt, Listener, stack};
use chunnel_net::udp;
use chunnel_std::reliable::Reliable;
use chunnel_test::fault::{FaultInjector, Faults};

fn value(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retransmissions_are_exported() -> Result<(), Box<dyn std::error::Error>> {
    let (rec, handle) = chunnel_metrics::prometheus::recorder();
    chunnel_metrics::metrics::set_global_recorder(rec).map_err(|_| "global recorder")?;

    const N: u64 = 500;
    let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let base = udp::Connect::new(listener.local_addr()?);
    // The client's data frames are lost one time in five: only retransmissions repair them.
    let faults = FaultInjector::seeded(3)
        .with_send(Faults::none().with_drop(0.2))
        .without_log();
    let mut server = Reliable::default().serve(listener);
    let mut client = stack![Reliable::default(), faults.clone(), base];
    let conn = client.connect_wrap(()).await?;
    let receiver = tokio::spawn(async move {
        let peer = server.accept().await?;
        let mut slots = vec![None; 64];
        let mut got = 0;
        while got < N {
            got += peer.recv(&mut slots).await? as u64;
        }
        // Keep acknowledging until the test ends.
        loop {
            peer.recv(&mut slots).await?;
        }
        #[allow(unreachable_code)]
        Ok::<_, chunnel::Error>(())
    });
    for i in (0..N).step_by(50) {
        conn.send((i..i + 50).map(|k| Bytes::from(k.to_be_bytes().to_vec())))
            .await?;
    }
    tokio::time::timeout(Duration::from_secs(30), conn.flush()).await??;
    let s = conn.stats();
    assert!(
        faults.stats.dropped_sent() > 0 && s.retransmitted > 0,
        "{s:?}"
    );

    // The connection's task exports on its next turn: bounded wait until it has.
    let series = |kind: &str| format!(r#"chunnel_reliable_retransmissions_total{{kind="{kind}"}}"#);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let text = handle.render();
        let (t, f) = (
            value(&text, &series("timeout")),
            value(&text, &series("fast")),
        );
        let s = conn.stats();
        if t + f == s.retransmitted {
            assert_eq!(f, s.fast_retransmits, "{text}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "exported {t} + {f}, connection counted {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    receiver.abort();
    Ok(())
}
