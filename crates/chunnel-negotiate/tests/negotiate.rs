//! Negotiation over real loopback sockets: select fallback on either side, exact vs
//! compositional matching, custom capability types, incompatible pairs, 0-RTT accepted and
//! rejected, 100 concurrent clients, a lossy base, and datagrams counted on the wire.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use chunnel::negotiate::End;
use chunnel::{
    Capability, Chunnel, ChunnelConnection, ConnectionExt, Error as CErr, Identity, Match,
    Negotiate, select,
};
use chunnel_negotiate::proto::Timing;
use chunnel_negotiate::wire::{Hello, Tag, VERSION, ZeroRtt};
use chunnel_negotiate::{Client, Config, DynLayer, Error, Negotiated, Registry, listen};
use chunnel_net::{tcp, udp};
use chunnel_test::{FaultInjector, Xor, xor};
use tokio::sync::mpsc;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// Test Chunnels.

// `Xor` (chunnel-test): XORs every byte with a key, an "encoding" both ends must agree on
// (exact capability). A mismatch would garble the echo, so a test that picks wrongly fails.

/// A one-sided layer with a compositional capability (a local meter): present at one end
/// is enough.
#[derive(Clone, Debug)]
struct Meter(&'static str);

impl Negotiate for Meter {
    fn id(&self) -> &'static str {
        "test/meter/1"
    }
    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::compositional("meter", [self.0])]
    }
}

impl<C: ChunnelConnection + Send> Chunnel<C> for Meter {
    type Connection = C;
    async fn connect_wrap(&mut self, inner: C) -> Result<C, CErr> {
        Ok(inner)
    }
}

/// A custom capability type: a protocol version range "lo-hi"; compatible when the ranges
/// overlap (the default rule would demand equal label sets).
#[derive(Clone, Debug)]
struct Versioned(u32, u32);

fn range(c: &Capability) -> Option<(u32, u32)> {
    let (lo, hi) = c.labels.first()?.split_once('-')?;
    Some((lo.parse().ok()?, hi.parse().ok()?))
}

fn overlap(ours: &Capability, theirs: &Capability) -> bool {
    match (range(ours), range(theirs)) {
        (Some((a, b)), Some((c, d))) => a <= d && c <= b,
        _ => false,
    }
}

impl Negotiate for Versioned {
    fn id(&self) -> &'static str {
        "test/versioned/1"
    }
    fn capabilities(&self) -> Vec<Capability> {
        vec![
            Capability::exact("version-range", [format!("{}-{}", self.0, self.1)])
                .with_rule(overlap),
        ]
    }
}

impl<C: ChunnelConnection + Send> Chunnel<C> for Versioned {
    type Connection = C;
    async fn connect_wrap(&mut self, inner: C) -> Result<C, CErr> {
        Ok(inner)
    }
}

// ---------------------------------------------------------------------------------------
// Harness.

fn fast() -> Config {
    Config {
        timing: Timing {
            initial_rto: Duration::from_millis(30),
            attempts: 8,
            ..Timing::default()
        },
        hello_timeout: Duration::from_secs(5),
        ..Config::default()
    }
}

/// What the echo server saw: the pick of each accepted connection, or its error.
type Seen = mpsc::Receiver<Result<Vec<u8>, String>>;

/// Runs an echo server with `stack` on a fresh loopback UDP port. Every message received is
/// also reported on `msgs`.
async fn echo_server<S>(stack: S) -> Result<(SocketAddr, Seen, mpsc::Receiver<Bytes>)>
where
    S: Chunnel<chunnel_negotiate::Tagged<udp::ServerConnection>>
        + chunnel::Offers
        + Clone
        + Send
        + Sync
        + 'static,
    S::Connection: ChunnelConnection<Data = Bytes> + 'static,
{
    let l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = l.local_addr()?;
    let mut server = listen(stack, l, fast());
    let (seen_tx, seen) = mpsc::channel(1024);
    let (msg_tx, msgs) = mpsc::channel(100_000);
    tokio::spawn(async move {
        loop {
            let r = server.accept().await;
            let fatal = matches!(&r, Err(Error::Chunnel(e)) if e.is_closed());
            let report = match &r {
                Ok(c) => Ok(c.info().server_pick.branches().to_vec()),
                Err(e) => Err(e.to_string()),
            };
            let _ = seen_tx.send(report).await;
            if fatal {
                return;
            }
            if let Ok(conn) = r {
                let msg_tx = msg_tx.clone();
                tokio::spawn(async move {
                    while let Ok(m) = conn.recv_one().await {
                        let _ = msg_tx.send(m.clone()).await;
                        if conn.send_one(m).await.is_err() {
                            break;
                        }
                    }
                });
            }
        }
    });
    Ok((addr, seen, msgs))
}

async fn base(addr: SocketAddr) -> Result<udp::Connection> {
    Ok(udp::Connect::new(addr).connect_wrap(()).await?)
}

async fn echo<C: ChunnelConnection<Data = Bytes>>(c: &C, m: &'static str) -> Result<()> {
    c.send_one(Bytes::from(m)).await?;
    let r = timeout(WAIT, c.recv_one())
        .await
        .context("echo timed out")??;
    ensure!(r == m, "echo garbled: sent {m:?}, got {r:?}");
    Ok(())
}

async fn next_seen(seen: &mut Seen) -> Result<Result<Vec<u8>, String>> {
    timeout(WAIT, seen.recv())
        .await
        .context("server reported nothing")?
        .context("server gone")
}

// ---------------------------------------------------------------------------------------
// Tests.

#[tokio::test]
async fn client_select_falls_back_to_what_the_server_has() -> Result<()> {
    let (addr, mut seen, _) = echo_server(Xor(2)).await?;
    let client = Client::new(fast());
    let c = client
        .connect("s", select(Xor(1), Xor(2)), base(addr).await?)
        .await?;
    assert_eq!(
        c.info().client_pick.branches(),
        &[1],
        "client must fall back to Xor(2)"
    );
    echo(&c, "hello").await?;
    assert_eq!(next_seen(&mut seen).await?, Ok(vec![]));
    Ok(())
}

#[tokio::test]
async fn server_select_falls_back_to_what_the_client_has() -> Result<()> {
    let (addr, mut seen, _) = echo_server(select(Xor(3), Xor(2))).await?;
    let client = Client::new(fast());
    let c = client.connect("s", Xor(2), base(addr).await?).await?;
    assert_eq!(c.info().server_pick.branches(), &[1]);
    echo(&c, "hello").await?;
    assert_eq!(next_seen(&mut seen).await?, Ok(vec![1]));
    Ok(())
}

#[tokio::test]
async fn server_preference_wins_where_the_client_allows_both() -> Result<()> {
    let (addr, _seen, _) = echo_server(select(Xor(2), Xor(1))).await?;
    let client = Client::new(fast());
    let c = client
        .connect("s", select(Xor(1), Xor(2)), base(addr).await?)
        .await?;
    assert_eq!(
        c.info().client_pick.branches(),
        &[1],
        "server prefers Xor(2)"
    );
    assert_eq!(c.info().server_pick.branches(), &[0]);
    echo(&c, "pref").await
}

#[tokio::test]
async fn compositional_capability_may_be_one_sided_exact_may_not() -> Result<()> {
    // Compositional at the client only: fine.
    let (addr, _seen, _) = echo_server(Identity).await?;
    let client = Client::new(fast());
    let c = client.connect("s", Meter("v1"), base(addr).await?).await?;
    echo(&c, "meter").await?;

    // Exact at the client only: refused, naming the capability and where it is missing.
    let err = client
        .connect("s", Xor(9), base(addr).await?)
        .await
        .expect_err("exact capability missing at the server must fail");
    let text = err.to_string();
    assert!(
        matches!(
            err,
            Error::Incompatible {
                found_by: End::Server,
                ..
            }
        ),
        "{text}"
    );
    assert!(
        text.contains("`xor`") && text.contains("missing at the server"),
        "{text}"
    );

    // Compositional on both ends with disjoint labels: refused.
    let (addr2, _seen2, _) = echo_server(Meter("v2")).await?;
    let err = client
        .connect("s2", Meter("v1"), base(addr2).await?)
        .await
        .expect_err("disjoint compositional labels must fail");
    assert!(err.to_string().contains("`meter` differs"), "{err}");
    Ok(())
}

#[tokio::test]
async fn custom_capability_type_uses_its_own_rule() -> Result<()> {
    let (addr, _seen, _) = echo_server(Versioned(2, 5)).await?;
    let client = Client::new(fast());
    // Overlapping ranges: compatible although the labels differ.
    let c = client
        .connect("s", Versioned(1, 3), base(addr).await?)
        .await?;
    echo(&c, "v").await?;
    // Disjoint ranges: refused.
    let err = client
        .connect("s", Versioned(0, 1), base(addr).await?)
        .await
        .expect_err("disjoint version ranges");
    assert!(err.to_string().contains("version-range"), "{err}");
    // The same labels under the default rule would have needed equality: check the rule
    // really is what decided.
    let a = Capability::exact("version-range", ["2-5"]);
    assert!(!a.compatible(&Capability::exact("version-range", ["1-3"])));
    assert_eq!(a.matching, Match::Exact);
    Ok(())
}

#[tokio::test]
async fn incompatible_pair_errors_on_both_sides_and_server_keeps_serving() -> Result<()> {
    let (addr, mut seen, _) = echo_server(select(Xor(1), Xor(2))).await?;
    let client = Client::new(fast());
    let err = client
        .connect("s", Xor(7), base(addr).await?)
        .await
        .expect_err("no common xor key");
    match &err {
        Error::Incompatible { mismatches, .. } => {
            assert_eq!(mismatches.len(), 2, "one per server option: {mismatches:?}");
            assert_eq!(mismatches[0].kind, "xor");
            assert_eq!(mismatches[0].client.as_deref(), Some(&["7".to_owned()][..]));
            assert_eq!(mismatches[0].server.as_deref(), Some(&["1".to_owned()][..]));
        }
        other => bail!("wrong error: {other}"),
    }
    assert!(
        err.to_string()
            .contains("{7} at the client, {1} at the server"),
        "{err}"
    );
    let server_side = next_seen(&mut seen)
        .await?
        .expect_err("server must report the failure");
    assert!(server_side.contains("`xor` differs"), "{server_side}");

    // The server still serves a compatible client.
    let c = client.connect("s", Xor(2), base(addr).await?).await?;
    echo(&c, "still here").await?;
    // A retransmitted hello of the refused client (the reject may be slower than the
    // retransmission timer under load) is refused again: skip those reports.
    loop {
        match next_seen(&mut seen).await? {
            Err(e) if e.contains("`xor` differs") => continue,
            other => {
                assert_eq!(other, Ok(vec![1]));
                break;
            }
        }
    }
    Ok(())
}

/// Reads messages until `want` arrived, then checks nothing else arrives for a while.
async fn expect_exactly(msgs: &mut mpsc::Receiver<Bytes>, want: &[&str]) -> Result<()> {
    let mut got = Vec::new();
    while got.len() < want.len() {
        let m = timeout(WAIT, msgs.recv())
            .await
            .context("message missing")?;
        got.push(m.context("server gone")?);
    }
    if let Ok(Some(extra)) = timeout(Duration::from_millis(300), msgs.recv()).await {
        bail!("duplicate or unexpected message {extra:?} after {got:?}");
    }
    let got: Vec<_> = got
        .iter()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    ensure!(got == want, "got {got:?}, want {want:?}");
    Ok(())
}

#[tokio::test]
async fn zero_rtt_accepted_delivers_early_data_once() -> Result<()> {
    let (addr, _seen, mut msgs) = echo_server(select(Xor(1), Xor(2))).await?;
    let client = Client::new(fast());
    let c = client
        .connect("svc", select(Xor(5), Xor(2)), base(addr).await?)
        .await?;
    echo(&c, "first").await?;
    expect_exactly(&mut msgs, &["first"]).await?;
    drop(c);
    assert_eq!(
        client.remembered("svc").map(|p| p.branches().to_vec()),
        Some(vec![1])
    );

    let c = client
        .connect_0rtt(
            "svc",
            select(Xor(5), Xor(2)),
            base(addr).await?,
            [Bytes::from("early-1"), Bytes::from("early-2")],
        )
        .await?;
    assert_eq!(c.info().zero_rtt, ZeroRtt::Accepted);
    expect_exactly(&mut msgs, &["early-1", "early-2"]).await?;
    for want in ["early-1", "early-2"] {
        let r = timeout(WAIT, c.recv_one()).await??;
        assert_eq!(r, want);
    }
    echo(&c, "after").await
}

#[tokio::test]
async fn zero_rtt_rejected_repicks_and_resends_exactly_once() -> Result<()> {
    let client = Client::new(fast());
    // Learn a pick (Xor(1), branch 0) from a first server...
    let (addr1, _s1, _m1) = echo_server(Xor(1)).await?;
    let c = client
        .connect("svc", select(Xor(1), Xor(2)), base(addr1).await?)
        .await?;
    echo(&c, "x").await?;
    assert_eq!(
        client.remembered("svc").map(|p| p.branches().to_vec()),
        Some(vec![0])
    );
    // ...then the service is redeployed with only Xor(2).
    let (addr2, _s2, mut msgs) = echo_server(Xor(2)).await?;
    let c = client
        .connect_0rtt(
            "svc",
            select(Xor(1), Xor(2)),
            base(addr2).await?,
            [Bytes::from("e1"), Bytes::from("e2"), Bytes::from("e3")],
        )
        .await?;
    assert_eq!(c.info().zero_rtt, ZeroRtt::Rejected);
    assert_eq!(c.info().client_pick.branches(), &[1]);
    // Delivered once, decoded correctly (so on the new stack), none lost or duplicated.
    expect_exactly(&mut msgs, &["e1", "e2", "e3"]).await?;
    for want in ["e1", "e2", "e3"] {
        assert_eq!(timeout(WAIT, c.recv_one()).await??, want);
    }
    assert_eq!(
        client.remembered("svc").map(|p| p.branches().to_vec()),
        Some(vec![1])
    );
    Ok(())
}

/// A client reuses its last 0-RTT hello while its stack offers the same options, and makes a
/// new one when they change: here the remembered pick (branch 1) now names another Chunnel
/// (`Xor(3)`, which the server lacks). A stale hello would have the server accept 0-RTT for
/// the old `Xor(2)` and the early data, sent through `Xor(3)`, arrive garbled.
#[tokio::test]
async fn zero_rtt_hello_is_made_afresh_when_the_offers_change() -> Result<()> {
    let (addr, _seen, mut msgs) = echo_server(select(Xor(1), Xor(2))).await?;
    let client = Client::new(fast());
    let c = client
        .connect("svc", select(Xor(5), Xor(2)), base(addr).await?)
        .await?;
    echo(&c, "learn").await?;
    expect_exactly(&mut msgs, &["learn"]).await?;
    // Two reconnects with the same stack: the second sends the first one's hello again.
    for early in ["same-1", "same-2"] {
        let c = client
            .connect_0rtt(
                "svc",
                select(Xor(5), Xor(2)),
                base(addr).await?,
                [Bytes::from(early)],
            )
            .await?;
        assert_eq!(c.info().zero_rtt, ZeroRtt::Accepted);
        assert_eq!(timeout(WAIT, c.recv_one()).await??, early);
        expect_exactly(&mut msgs, &[early]).await?;
    }
    // Same pick, other offers.
    let c = client
        .connect_0rtt(
            "svc",
            select(Xor(1), Xor(3)),
            base(addr).await?,
            [Bytes::from("changed")],
        )
        .await?;
    assert_eq!(c.info().zero_rtt, ZeroRtt::Rejected);
    assert_eq!(c.info().client_pick.branches(), &[0]);
    expect_exactly(&mut msgs, &["changed"]).await?;
    assert_eq!(timeout(WAIT, c.recv_one()).await??, "changed");
    echo(&c, "after").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_concurrent_clients_get_their_own_stacks() -> Result<()> {
    let (addr, mut seen, _) = echo_server(select(Xor(1), Xor(2))).await?;
    let client = Arc::new(Client::new(fast()));
    let mut tasks = Vec::new();
    for i in 0..100u8 {
        let client = Arc::clone(&client);
        tasks.push(tokio::spawn(async move {
            let key = 1 + i % 2;
            let c: Negotiated<_> = client
                .connect(&format!("s{i}"), Xor(key), base(addr).await?)
                .await?;
            ensure!(
                c.info().server_pick.branches() == [key - 1],
                "client {i} with key {key} got server pick {:?}",
                c.info().server_pick
            );
            echo(&c, "concurrent").await?;
            Ok::<_, anyhow::Error>(key)
        }));
    }
    let mut per_key = [0usize; 3];
    for t in tasks {
        per_key[usize::from(t.await??)] += 1;
    }
    assert_eq!(per_key, [0, 50, 50]);
    let mut server_picks = [0usize; 2];
    for _ in 0..100 {
        let pick = next_seen(&mut seen).await?.map_err(anyhow::Error::msg)?;
        server_picks[usize::from(pick[0])] += 1;
    }
    assert_eq!(server_picks, [50, 50]);
    Ok(())
}

#[tokio::test]
async fn negotiation_completes_over_a_base_that_drops_every_third_datagram() -> Result<()> {
    let (addr, _seen, _) = echo_server(select(Xor(1), Xor(2))).await?;
    let client = Client::new(fast());
    let faults = FaultInjector::drop_every(3);
    let stats = Arc::clone(&faults.stats);
    let mut retransmitted = 0;
    let dropped_accepts = || {
        stats
            .log()
            .iter()
            .filter(|s| !s.outgoing && s.dropped && s.first == Some(Tag::Accept as u8))
            .count()
    };
    // The drop pattern meets hellos and accepts at different phases depending on how many
    // data retries each connection needed: connect until both kinds were lost (bounded).
    let mut conns = 0;
    while conns < 8 || retransmitted == 0 || dropped_accepts() == 0 {
        ensure!(
            conns < 60,
            "60 connections without losing both a hello and an accept"
        );
        let i = conns;
        conns += 1;
        let b = faults.clone().connect_wrap(base(addr).await?).await?;
        let c = client
            .connect(&format!("s{i}"), select(Xor(3), Xor(2)), b)
            .await?;
        assert_eq!(c.info().client_pick.branches(), &[1]);
        if c.info().hellos_sent > 1 {
            retransmitted += 1;
        }
        // Data is best effort on this base: retry until the echoes get through. 1 to 3
        // echoes per connection, so the drop phase shifts between connections.
        let mut echoed = 0;
        for _ in 0..30 {
            if echoed > i % 3 {
                break;
            }
            c.send_one(Bytes::from_static(b"ping")).await?;
            if let Ok(r) = timeout(Duration::from_millis(200), c.recv_one()).await {
                assert_eq!(r?, "ping");
                echoed += 1;
            }
        }
        ensure!(echoed > i % 3, "connection {i} did not echo");
    }
    // Every 3rd datagram really was dropped, in both directions.
    ensure!(stats.dropped_sent() >= stats.sent() / 3 && stats.dropped_received() > 0);
    Ok(())
}

#[tokio::test]
async fn one_rtt_is_one_datagram_each_way_and_zero_rtt_sends_data_in_the_first_flight() -> Result<()>
{
    let (addr, _seen, _) = echo_server(select(Xor(1), Xor(2))).await?;
    let client = Client::new(fast());

    let tap = FaultInjector::counting();
    let c = client
        .connect(
            "svc",
            select(Xor(1), Xor(2)),
            tap.clone().connect_wrap(base(addr).await?).await?,
        )
        .await?;
    let log = tap.stats.log();
    let firsts: Vec<_> = log.iter().map(|s| (s.outgoing, s.first)).collect();
    assert_eq!(
        firsts,
        [
            (true, Some(Tag::Hello as u8)),
            (false, Some(Tag::Accept as u8))
        ],
        "1-RTT: one hello out, one accept in"
    );
    echo(&c, "data").await?;
    drop(c);

    let tap = FaultInjector::counting();
    let c = client
        .connect_0rtt(
            "svc",
            select(Xor(1), Xor(2)),
            tap.clone().connect_wrap(base(addr).await?).await?,
            [Bytes::from("in-the-hello")],
        )
        .await?;
    assert_eq!(timeout(WAIT, c.recv_one()).await??, "in-the-hello");
    let log = tap.stats.log();
    let out: Vec<_> = log.iter().filter(|s| s.outgoing).collect();
    assert_eq!(
        out.len(),
        1,
        "0-RTT: the only datagram sent is the hello: {log:?}"
    );
    assert_eq!(out[0].first, Some(Tag::Hello as u8));
    let hello = Hello::decode(&out[0].bytes[1..])?;
    assert!(hello.zero_rtt.is_some());
    assert_eq!(hello.early.len(), 1, "the data rides in the first flight");
    assert_eq!(hello.early[0], xor(&Bytes::from("in-the-hello"), 1));
    let incoming: Vec<_> = log
        .iter()
        .filter(|s| !s.outgoing)
        .map(|s| s.first)
        .collect();
    assert_eq!(
        incoming,
        [Some(Tag::AcceptData as u8)],
        "0-RTT: the accept and the echo come back in one datagram"
    );
    Ok(())
}

/// A server whose application takes each connection and does `what` with it; the accepted
/// connections are kept alive until the test ends.
async fn holding_server(what: &'static str) -> Result<SocketAddr> {
    let l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = l.local_addr()?;
    let mut server = listen(select(Xor(1), Xor(2)), l, fast());
    tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Ok(conn) = server.accept().await {
            match what {
                // Reads the early data, then waits for more without replying.
                "recv" => {
                    tokio::spawn(async move { while conn.recv_one().await.is_ok() {} });
                }
                // Never touches it.
                _ => kept.push(conn),
            }
        }
    });
    Ok(addr)
}

#[tokio::test]
async fn a_held_accept_goes_out_alone_when_the_server_does_not_reply() -> Result<()> {
    for what in ["recv", "idle"] {
        let addr = holding_server(what).await?;
        let client = Client::new(fast());
        // Learn the pick, then reconnect with 0-RTT.
        drop(
            client
                .connect("svc", select(Xor(1), Xor(2)), base(addr).await?)
                .await?,
        );
        let tap = FaultInjector::counting();
        let c = timeout(
            WAIT,
            client.connect_0rtt(
                "svc",
                select(Xor(1), Xor(2)),
                tap.clone().connect_wrap(base(addr).await?).await?,
                [Bytes::from("no reply")],
            ),
        )
        .await??;
        assert_eq!(c.info().zero_rtt, ZeroRtt::Accepted, "{what}");
        let incoming: Vec<_> = tap
            .stats
            .log()
            .iter()
            .filter(|s| !s.outgoing)
            .map(|s| s.first)
            .collect();
        assert_eq!(
            incoming.first(),
            Some(&Some(Tag::Accept as u8)),
            "{what}: the accept alone, with no reply to carry it"
        );
    }
    Ok(())
}

#[tokio::test]
async fn accept_hold_zero_sends_the_accept_at_once() -> Result<()> {
    let l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = l.local_addr()?;
    let cfg = Config {
        accept_hold: Duration::ZERO,
        ..fast()
    };
    let mut server = listen(select(Xor(1), Xor(2)), l, cfg);
    tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            tokio::spawn(async move {
                while let Ok(m) = conn.recv_one().await {
                    if conn.send_one(m).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    let client = Client::new(fast());
    drop(
        client
            .connect("svc", select(Xor(1), Xor(2)), base(addr).await?)
            .await?,
    );
    let tap = FaultInjector::counting();
    let c = client
        .connect_0rtt(
            "svc",
            select(Xor(1), Xor(2)),
            tap.clone().connect_wrap(base(addr).await?).await?,
            [Bytes::from("e")],
        )
        .await?;
    assert_eq!(timeout(WAIT, c.recv_one()).await??, "e");
    let incoming: Vec<_> = tap
        .stats
        .log()
        .iter()
        .filter(|s| !s.outgoing)
        .map(|s| s.first)
        .collect();
    assert_eq!(incoming, [Some(Tag::Accept as u8), Some(Tag::Data as u8)]);
    Ok(())
}

#[tokio::test]
async fn malformed_hello_gets_a_reject_and_the_server_keeps_serving() -> Result<()> {
    let (addr, mut seen, _) = echo_server(Xor(1)).await?;
    let raw = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
    raw.send_to(&[Tag::Hello as u8, VERSION, 0, 0xde, 0xad], addr)
        .await?;
    let mut buf = [0u8; 2048];
    let (n, _) = timeout(WAIT, raw.recv_from(&mut buf)).await??;
    assert_eq!(buf[0], Tag::Reject as u8, "got {:?}", &buf[..n]);
    let rep = next_seen(&mut seen)
        .await?
        .expect_err("server reports the bad hello");
    assert!(rep.contains("malformed"), "{rep}");
    let client = Client::new(fast());
    let c = client.connect("s", Xor(1), base(addr).await?).await?;
    echo(&c, "fine").await
}

/// The listener completes most handshakes in their first poll (the hello came with the
/// datagram that made the connection) and reuses the box of each such handshake for the next
/// one; a handshake that must wait for its hello moves to a task of its own, box and all.
/// Mixed, all complete.
#[tokio::test]
async fn a_handshake_waiting_for_its_hello_and_quick_ones_around_it_all_complete() -> Result<()> {
    let (addr, mut seen, _) = echo_server(Xor(1)).await?;
    let client = Client::new(fast());
    for m in ["quick-1", "quick-2", "quick-3"] {
        let c = client.connect("s", Xor(1), base(addr).await?).await?;
        echo(&c, m).await?;
    }
    // A first datagram that is not a hello: this connection's handshake waits for one.
    let slow = base(addr).await?;
    slow.send_one(Bytes::from_static(&[0xff, 1, 2])).await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    for m in ["quick-4", "quick-5", "quick-6"] {
        let c = client.connect("s", Xor(1), base(addr).await?).await?;
        echo(&c, m).await?;
    }
    let c = client.connect("s", Xor(1), slow).await?;
    echo(&c, "slow").await?;
    for _ in 0..7 {
        next_seen(&mut seen).await?.map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

/// `listen_with` hands every result to its callback, with no queue or accept loop of the
/// application's: connections completed in the accept loop, one completed in its own task
/// (its first datagram was not a hello), and one client's error; serving goes on after it,
/// and stops when the handle is dropped.
#[tokio::test]
async fn listen_with_hands_every_result_to_its_callback() -> Result<()> {
    let l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = l.local_addr()?;
    let (tx, mut results) = mpsc::channel(64);
    let serving = chunnel_negotiate::listen_with(Xor(1), l, fast(), move |r| {
        let _ = tx.try_send(r.as_ref().map(|_| ()).map_err(|e| e.to_string()));
        if let Ok(conn) = r {
            tokio::spawn(async move {
                while let Ok(m) = conn.recv_one().await {
                    if conn.send_one(m).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    let mut next = async || {
        timeout(WAIT, results.recv())
            .await
            .context("no result handed on")?
            .context("callback gone")
    };
    let client = Client::new(fast());
    let c = client.connect("s", Xor(1), base(addr).await?).await?;
    echo(&c, "quick").await?;
    next().await?.map_err(anyhow::Error::msg)?;

    let err = client
        .connect("s", Xor(7), base(addr).await?)
        .await
        .expect_err("no common xor key");
    assert!(matches!(err, Error::Incompatible { .. }), "{err}");
    let server_side = next().await?.expect_err("the server's side of the failure");
    assert!(server_side.contains("`xor` differs"), "{server_side}");

    let slow = base(addr).await?;
    slow.send_one(Bytes::from_static(&[0xff, 1, 2])).await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let c = client.connect("s", Xor(1), slow).await?;
    echo(&c, "slow").await?;
    // A retransmitted hello of the refused client may be refused again first.
    loop {
        match next().await? {
            Ok(()) => break,
            Err(e) if e.contains("`xor` differs") => continue,
            Err(e) => bail!("unexpected failure: {e}"),
        }
    }

    drop(serving);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut cfg = fast();
    cfg.timing.initial_rto = Duration::from_millis(10);
    cfg.timing.attempts = 3;
    let gone = Client::new(cfg)
        .connect("t", Xor(1), base(addr).await?)
        .await;
    assert!(gone.is_err(), "nobody serves once the handle is dropped");
    Ok(())
}

#[tokio::test]
async fn silent_server_times_out_with_a_clear_error() -> Result<()> {
    // A socket that never answers.
    let silent = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
    let addr = silent.local_addr()?;
    let mut cfg = fast();
    cfg.timing.initial_rto = Duration::from_millis(10);
    cfg.timing.attempts = 3;
    let client = Client::new(cfg);
    let err = client
        .connect("s", Xor(1), base(addr).await?)
        .await
        .expect_err("nobody answers");
    assert!(matches!(err, Error::Timeout { attempts: 3, .. }), "{err}");
    Ok(())
}

#[tokio::test]
async fn negotiates_over_tcp_too() -> Result<()> {
    let l = tcp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = l.local_addr()?;
    let mut server = listen(select(Xor(4), Xor(2)), l, fast());
    let served = Arc::new(AtomicUsize::new(0));
    let s2 = Arc::clone(&served);
    tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            s2.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                while let Ok(m) = conn.recv_one().await {
                    let _ = conn.send_one(m).await;
                }
            });
        }
    });
    let client = Client::new(fast());
    let b = tcp::Connect::new(addr).connect_wrap(()).await?;
    let c = client.connect("t", select(Xor(2), Xor(4)), b).await?;
    assert_eq!(
        c.info().client_pick.branches(),
        &[1],
        "server prefers Xor(4)"
    );
    echo(&c, "over tcp").await?;
    assert_eq!(served.load(Ordering::SeqCst), 1);
    Ok(())
}

#[tokio::test]
async fn a_new_client_on_a_reused_address_is_handed_to_the_listener_at_once() -> Result<()> {
    use chunnel::negotiate::Offers;
    use chunnel_negotiate::wire::{Accept, VERSION};
    let (addr, mut seen, _) = echo_server(Xor(1)).await?;
    // One socket plays two clients in turn, as a reused ephemeral port would.
    let raw = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
    raw.connect(addr).await?;
    let hello = |conn_id| {
        Hello {
            version: VERSION,
            conn_id,
            offers: Xor(1).offer_tree(),
            zero_rtt: None,
            early: Vec::new(),
            dictated: false,
        }
        .encode()
    };
    let mut buf = [0u8; 2048];
    for conn_id in [11u64, 22, 33] {
        raw.send(&hello(conn_id)).await?;
        // Answered within one echo-loop wake-up, not after the server's idle timeout.
        let n = timeout(Duration::from_secs(2), raw.recv(&mut buf))
            .await
            .with_context(|| format!("hello {conn_id} on a reused address went unanswered"))??;
        assert_eq!(buf[0], Tag::Accept as u8);
        assert_eq!(Accept::decode(&buf[1..n])?.conn_id, conn_id);
        assert_eq!(next_seen(&mut seen).await?, Ok(vec![]));
    }
    Ok(())
}

/// Builds the client's end of `Xor` from the server's description (its key is the label).
fn xor_factory(info: &chunnel::ChunnelInfo) -> Result<DynLayer, CErr> {
    let key = info
        .capabilities
        .iter()
        .find(|c| c.kind == "xor")
        .and_then(|c| c.labels.first())
        .and_then(|l| l.parse::<u8>().ok())
        .ok_or(CErr::Malformed {
            what: "xor capability without a key",
        })?;
    Ok(DynLayer::new(Xor(key)))
}

#[tokio::test]
async fn a_client_without_chunnels_builds_what_the_server_dictates() -> Result<()> {
    // The server prefers Xor(3) and runs a one-sided Meter the client never builds.
    let (addr, mut seen, mut msgs) =
        echo_server(chunnel::stack![Meter("m"), select(Xor(3), Xor(2))]).await?;
    let client = Arc::new(Client::new(fast()));
    let registry = Arc::new(Registry::new().register("test/xor/1", xor_factory));
    // Spawned: the connect future is Send.
    let (cl, reg) = (Arc::clone(&client), Arc::clone(&registry));
    let c = tokio::spawn(
        async move { anyhow::Ok(cl.connect_dictated(&reg, base(addr).await?).await?) },
    )
    .await??;
    assert_eq!(c.info().server_pick.branches(), &[0]);
    let ids: Vec<_> = c
        .info()
        .server_stack
        .iter()
        .map(|c| c.id.to_string())
        .collect();
    assert_eq!(ids, ["test/meter/1", "test/xor/1"]);
    // The echo decodes only if the client built Xor with the server's key.
    echo(&c, "dictated").await?;
    expect_exactly(&mut msgs, &["dictated"]).await?;
    assert_eq!(next_seen(&mut seen).await?, Ok(vec![0]));

    // A client that cannot build the two-sided Chunnel is refused with the reason.
    let err = client
        .connect_dictated(&Registry::new(), base(addr).await?)
        .await
        .expect_err("no implementation of xor");
    assert!(
        err.to_string().contains("implementation of test/xor/1"),
        "{err}"
    );
    Ok(())
}
