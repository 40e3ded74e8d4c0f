//! Features `metrics` and `tracing`: negotiations (accepted, rejected, 0-RTT) and a
//! multilateral switch over real UDP are counted and timed through the `metrics` facade (read
//! back from a Prometheus recorder's exposition text) and traced in `tracing` spans (read by a
//! minimal subscriber).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use bytes::Bytes;
use chunnel::{Chunnel, ConnectionExt, LockFree, Side, select};
use chunnel_metrics::prometheus::recorder;
use chunnel_negotiate::commit::{Coordinator, Outcome, Policy};
use chunnel_negotiate::{Client, Config, Error, listen};
use chunnel_net::udp;
use chunnel_test::Xor;
use tokio::time::timeout;
use tracing::span;

const WAIT: Duration = Duration::from_secs(10);

/// Records the name of every span created.
struct Spans {
    names: Mutex<Vec<&'static str>>,
    next: AtomicU64,
}

impl tracing::Subscriber for &'static Spans {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, a: &span::Attributes<'_>) -> span::Id {
        self.names
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(a.metadata().name());
        span::Id::from_u64(self.next.fetch_add(1, Ordering::Relaxed) + 1)
    }
    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, _: &span::Id) {}
    fn exit(&self, _: &span::Id) {}
}

/// The value of the exposition line whose series is exactly `series`, or 0 if absent.
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// A retransmission timer longer than any round trip on a loaded machine (2 s): no hello is
/// sent twice, so every count below is exact (a server answers each copy of a hello).
fn patient() -> Config {
    let mut c = Config::default();
    c.timing.initial_rto = Duration::from_secs(2);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negotiations_and_switches_are_counted_timed_and_traced() -> Result<()> {
    let (rec, handle) = recorder();
    chunnel_metrics::metrics::set_global_recorder(rec)
        .ok()
        .context("global recorder")?;
    let spans: &'static Spans = Box::leak(Box::new(Spans {
        names: Mutex::new(Vec::new()),
        next: AtomicU64::new(0),
    }));
    tracing::subscriber::set_global_default(spans).context("global subscriber")?;

    // A server offering Xor(1) or Xor(2); every result of accept goes to `results`.
    let l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = l.local_addr()?;
    let mut server = listen(select(Xor(1), Xor(2)), l, patient());
    let (tx, mut results) = tokio::sync::mpsc::channel(16);
    let serving = tokio::spawn(async move {
        loop {
            let r = server.accept().await;
            let ok = r.is_ok();
            if let Ok(conn) = r {
                tokio::spawn(async move {
                    while let Ok(m) = conn.recv_one().await {
                        let _ = conn.send_one(m).await;
                    }
                });
            }
            if tx.send(ok).await.is_err() {
                return;
            }
        }
    });
    let base = || async { udp::Connect::new(addr).connect_wrap(()).await };
    let client = Client::new(patient());

    // 1-RTT, accepted (twice: the second is remembered as "svc" for 0-RTT).
    let c = client.connect("a", Xor(2), base().await?).await?;
    c.send_one(Bytes::from("x")).await?;
    timeout(WAIT, c.recv_one()).await??;
    let svc = select(Xor(5), Xor(2));
    client.connect("svc", svc.clone(), base().await?).await?;
    // 1-RTT, rejected: no common stack.
    let e = client
        .connect("b", Xor(9), base().await?)
        .await
        .unwrap_err();
    ensure!(matches!(e, Error::Incompatible { .. }), "{e}");
    // 0-RTT, accepted.
    let c = client
        .connect_0rtt("svc", svc, base().await?, [Bytes::from("early")])
        .await?;
    assert_eq!(timeout(WAIT, c.recv_one()).await??, "early");
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(
            timeout(WAIT, results.recv())
                .await?
                .context("server ended")?,
        );
    }
    assert_eq!(seen.iter().filter(|ok| **ok).count(), 3, "{seen:?}");

    // A multilateral switch on a negotiated connection.
    let stack = || select(Xor(1), Xor(2)).reconfigurable::<LockFree>();
    let l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let maddr = l.local_addr()?;
    let mut accepting = listen(stack(), l, Config::default());
    let mbase = udp::Connect::new(maddr).connect_wrap(()).await?;
    let mc = Client::new(Config::default())
        .connect(&maddr.to_string(), stack(), mbase)
        .await?;
    let ms = timeout(WAIT, accepting.accept()).await??;
    let policy = Policy {
        vote_timeout: WAIT,
        ..Policy::default()
    };
    let cc = Coordinator::start(&mc, &stack(), policy)?;
    let _sc = Coordinator::start(&ms, &stack(), policy)?;
    let (mc, ms) = (Arc::new(mc), Arc::new(ms));
    // Both ends keep receiving (the protocol runs in-band).
    let echo = {
        let ms = ms.clone();
        tokio::spawn(async move {
            while let Ok(m) = ms.recv_one().await {
                let _ = ms.send_one(m).await;
            }
        })
    };
    let reader = {
        let mc = mc.clone();
        tokio::spawn(async move { while mc.recv_one().await.is_ok() {} })
    };
    assert_eq!(
        timeout(WAIT, cc.switch(Side::Right)).await??,
        Outcome::Switched
    );
    assert_eq!(
        timeout(WAIT, cc.switch(Side::Right)).await??,
        Outcome::Unchanged
    );

    // The follower records its switch point once its marker (the DONE the initiator's
    // outcome waits for) has left: shortly after the outcome. Bounded wait for it.
    let sp = "chunnel_multilateral_switch_point_seconds_count";
    let follower = format!(r#"{sp}{{role="follower"}}"#);
    let deadline = tokio::time::Instant::now() + WAIT;
    while value(&handle.render(), &follower) == 0.0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let text = handle.render();
    eprintln!("{text}");
    let n = |s: &str| value(&text, s);
    let neg = "chunnel_negotiations_total";
    assert_eq!(
        n(&format!(
            r#"{neg}{{side="client",mode="1rtt",result="accepted",zero_rtt="not_offered"}}"#
        )),
        3.0 // "a", "svc" and the multilateral pair's client
    );
    assert_eq!(
        n(&format!(
            r#"{neg}{{side="client",mode="1rtt",result="rejected",zero_rtt="none"}}"#
        )),
        1.0
    );
    assert_eq!(
        n(&format!(
            r#"{neg}{{side="client",mode="0rtt",result="accepted",zero_rtt="accepted"}}"#
        )),
        1.0
    );
    assert_eq!(
        n(&format!(
            r#"{neg}{{side="server",mode="hello",result="accepted",zero_rtt="not_offered"}}"#
        )),
        3.0
    );
    assert_eq!(
        n(&format!(
            r#"{neg}{{side="server",mode="hello",result="accepted",zero_rtt="accepted"}}"#
        )),
        1.0
    );
    assert_eq!(
        n(&format!(
            r#"{neg}{{side="server",mode="hello",result="rejected",zero_rtt="none"}}"#
        )),
        1.0
    );
    let hs = "chunnel_negotiation_handshake_seconds_count";
    assert_eq!(
        n(&format!(
            r#"{hs}{{side="client",mode="1rtt",result="accepted"}}"#
        )),
        3.0
    );
    assert_eq!(
        n(
            r#"chunnel_negotiation_handshake_seconds_bucket{side="client",mode="0rtt",result="accepted",le="+Inf"}"#
        ),
        1.0
    );
    let sw = "chunnel_multilateral_switches_total";
    assert_eq!(n(&format!(r#"{sw}{{outcome="switched"}}"#)), 1.0);
    assert_eq!(n(&format!(r#"{sw}{{outcome="unchanged"}}"#)), 1.0);
    assert_eq!(n(&format!(r#"{sp}{{role="initiator"}}"#)), 1.0);
    assert_eq!(n(&follower), 1.0);

    let names = spans
        .names
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let count = |name: &str| names.iter().filter(|n| **n == name).count();
    assert_eq!(count("chunnel.connect"), 5, "{names:?}");
    assert_eq!(count("chunnel.handshake"), 5, "{names:?}");
    assert_eq!(count("chunnel.switch"), 2, "{names:?}");
    assert_eq!(count("chunnel.switch_point"), 2, "{names:?}");

    echo.abort();
    reader.abort();
    serving.abort();
    Ok(())
}
