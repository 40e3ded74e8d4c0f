//! Multilateral reconfiguration over real Unix stream sockets (lossless and ordered): both
//! peers switch an exact-match layer together by two-phase commit, under traffic, without
//! losing, duplicating or garbling a message; a refusing peer, a silent peer and an end that
//! may not start switches all leave the connection working on the old stack.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use bytes::Bytes;
use chunnel::{
    Chunnel, ChunnelConnection, ConnectionExt, LockFree, Offers, Reconfigurable, Side, select,
};
use chunnel_negotiate::commit::{AbortReason, Coordinator, Outcome, Policy, ProposeError};
use chunnel_negotiate::wire::Refusal;
use chunnel_negotiate::{Client, Config, Error, listen};
use chunnel_net::uds;
use chunnel_test::Xor;
use tokio::sync::mpsc;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

type Stack = Reconfigurable<Xor, Xor, LockFree>;

fn stack(left: u8, right: u8) -> Stack {
    select(Xor(left), Xor(right)).reconfigurable::<LockFree>()
}

fn unique(kind: &str) -> uds::UnixAddr {
    static N: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "chunnel-ml-{kind}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    uds::UnixAddr::Abstract(name.into_bytes())
}

/// Policies with short timers so that the failure cases end quickly.
fn quick(may_initiate: bool, peer_may_initiate: bool) -> Policy {
    Policy {
        may_initiate,
        peer_may_initiate,
        vote_timeout: Duration::from_millis(300),
        resend_after: Duration::from_millis(100),
    }
}

/// What the echo server reports for each connection once it ends: the sides it ran on.
struct Server {
    addr: uds::UnixAddr,
    sides: mpsc::Receiver<Side>,
}

/// An echo server on a reconfigurable select `stack`; with `policy`, each connection gets a
/// coordinator (it follows or refuses its client's switches), without one it ignores them.
async fn echo_server(stack: Stack, policy: Option<Policy>) -> Result<Server> {
    let addr = unique("srv");
    let l = uds::StreamListener::bind(addr.clone()).await?;
    let mut server = listen(stack.clone(), l, Config::default());
    let (tx, sides) = mpsc::channel(16);
    tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            let coord = policy.map(|p| Coordinator::start(&conn, &stack, p).expect("start"));
            let tx = tx.clone();
            tokio::spawn(async move {
                let _coord = coord;
                while let Ok(m) = conn.recv_one().await {
                    if m == "bye" {
                        break;
                    }
                    if conn.send_one(m).await.is_err() {
                        break;
                    }
                }
                let _ = tx.send(conn.get_ref().side()).await;
            });
        }
    });
    Ok(Server { addr, sides })
}

async fn client_conn(
    server: &Server,
    stack: &Stack,
) -> Result<chunnel_negotiate::Negotiated<<Stack as Chunnel<Tagged>>::Connection>> {
    let base = uds::StreamConnect::new(server.addr.clone())
        .connect_wrap(())
        .await?;
    let client = Client::new(Config::default());
    Ok(client.connect("srv", stack.clone(), base).await?)
}

type Tagged = chunnel_negotiate::Tagged<uds::StreamConnection>;

/// Sends `n` numbered messages from `from` and checks each echo (content and order).
async fn exchange<C>(conn: &C, from: u64, n: u64) -> Result<()>
where
    C: ChunnelConnection<Data = Bytes>,
{
    for i in from..from + n {
        let m = Bytes::from(format!("msg-{i}"));
        conn.send_one(m.clone()).await?;
        let r = timeout(WAIT, conn.recv_one())
            .await
            .with_context(|| format!("no echo of {m:?}"))??;
        ensure!(r == m, "sent {m:?}, got back {r:?}");
    }
    Ok(())
}

/// Control messages queue behind the data in flight; under a pipelined load the vote can take
/// a while to come out of the receive path (a slow debug build on a busy machine).
fn patient() -> Policy {
    Policy {
        vote_timeout: WAIT,
        ..Policy::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_peers_switch_together_under_traffic() -> Result<()> {
    let mut server = echo_server(stack(1, 2), Some(patient())).await?;
    let s = stack(1, 2);
    let conn = std::sync::Arc::new(client_conn(&server, &s).await?);
    let coord = Coordinator::start(&conn, &s, patient())?;
    assert_eq!(conn.get_ref().side(), Side::Left);

    // A pipelined sender and a receiver that checks every echo: content (a message decoded
    // by the wrong stack comes back garbled), order and count. Traffic flows until the
    // switches are done: the protocol runs in-band, so both ends must keep receiving.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let total = std::sync::Arc::new(AtomicU64::new(u64::MAX));
    let (rx_conn, rx_total) = (conn.clone(), total.clone());
    let receiver = tokio::spawn(async move {
        let mut i = 0;
        while i < rx_total.load(Ordering::Acquire) {
            let r = timeout(WAIT, rx_conn.recv_one())
                .await
                .with_context(|| format!("echo {i} never came"))??;
            ensure!(r == format!("msg-{i}"), "echo {i} came back as {r:?}");
            i += 1;
        }
        anyhow::Ok(i)
    });
    let (tx_conn, tx_stop) = (conn.clone(), stop.clone());
    let sender = tokio::spawn(async move {
        let mut i = 0u64;
        while !tx_stop.load(Ordering::Acquire) || i < 1000 {
            tx_conn.send_one(Bytes::from(format!("msg-{i}"))).await?;
            i += 1;
            if i.is_multiple_of(64) {
                tokio::task::yield_now().await;
            }
        }
        anyhow::Ok(i)
    });
    // Switch to the right branch and back while the traffic flows.
    let mut switched = 0;
    for to in [Side::Right, Side::Left, Side::Right] {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let out = timeout(WAIT, coord.switch(to))
            .await
            .with_context(|| format!("switch to {to:?} did not end"))??;
        assert_eq!(out, Outcome::Switched, "switch to {to:?}");
        switched += 1;
        assert_eq!(conn.get_ref().side(), to);
    }
    stop.store(true, Ordering::Release);
    let mut sent = sender.await??;
    // One more message, so that a receiver already waiting past the last echo gets it.
    conn.send_one(Bytes::from(format!("msg-{sent}"))).await?;
    sent += 1;
    total.store(sent, Ordering::Release);
    let received = timeout(WAIT, receiver).await???;
    assert_eq!(received, sent, "every echo, once, in order");
    let n = sent;
    assert_eq!(switched, 3);
    // Still working, on the right branch at both ends.
    exchange(&*conn, n, 10).await?;
    conn.send_one(Bytes::from("bye")).await?;
    assert_eq!(timeout(WAIT, server.sides.recv()).await?, Some(Side::Right));
    Ok(())
}

#[tokio::test]
async fn a_refusing_peer_leaves_the_old_stack() -> Result<()> {
    // The server does not accept switches started by its clients.
    let mut server = echo_server(stack(1, 2), Some(quick(true, false))).await?;
    let s = stack(1, 2);
    let conn = client_conn(&server, &s).await?;
    let coord = Coordinator::start(&conn, &s, quick(true, true))?;
    let echo = async {
        // Receive while the switch is proposed: the vote arrives in-band.
        exchange(&conn, 0, 20).await
    };
    let (out, e) = tokio::join!(coord.switch(Side::Right), echo);
    e?;
    match out? {
        Outcome::Aborted(AbortReason::Refused {
            reason: Refusal::NotAllowed,
            message,
        }) => assert!(message.contains("does not accept"), "{message}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(conn.get_ref().side(), Side::Left);
    exchange(&conn, 20, 20).await?;
    conn.send_one(Bytes::from("bye")).await?;
    assert_eq!(timeout(WAIT, server.sides.recv()).await?, Some(Side::Left));

    // Incompatible: the server's other branch has another key.
    let mut server = echo_server(stack(1, 3), Some(quick(true, true))).await?;
    let conn = client_conn(&server, &s).await?;
    let coord = Coordinator::start(&conn, &s, quick(true, true))?;
    let (out, e) = tokio::join!(coord.switch(Side::Right), exchange(&conn, 0, 20));
    e?;
    assert!(
        matches!(
            out?,
            Outcome::Aborted(AbortReason::Refused {
                reason: Refusal::Incompatible,
                ..
            })
        ),
        "an incompatible switch is refused"
    );
    exchange(&conn, 20, 5).await?;
    conn.send_one(Bytes::from("bye")).await?;
    assert_eq!(timeout(WAIT, server.sides.recv()).await?, Some(Side::Left));
    Ok(())
}

#[tokio::test]
async fn a_silent_peer_times_out_and_the_old_stack_goes_on() -> Result<()> {
    // The server runs no coordinator: it ignores the proposal.
    let mut server = echo_server(stack(1, 2), None).await?;
    let s = stack(1, 2);
    let conn = client_conn(&server, &s).await?;
    let coord = Coordinator::start(&conn, &s, quick(true, true))?;
    let (out, e) = tokio::join!(coord.switch(Side::Right), async {
        // Keep receiving (and checking) while the proposal waits for a vote.
        for round in 0..8 {
            exchange(&conn, round * 5, 5).await?;
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        anyhow::Ok(())
    });
    e?;
    assert_eq!(out?, Outcome::Aborted(AbortReason::Timeout));
    assert_eq!(conn.get_ref().side(), Side::Left);
    exchange(&conn, 100, 10).await?;
    conn.send_one(Bytes::from("bye")).await?;
    assert_eq!(timeout(WAIT, server.sides.recv()).await?, Some(Side::Left));
    Ok(())
}

#[tokio::test]
async fn an_end_not_allowed_to_switch_cannot_and_its_peer_still_can() -> Result<()> {
    let mut server = echo_server(stack(1, 2), Some(Policy::default())).await?;
    let s = stack(1, 2);
    let conn = client_conn(&server, &s).await?;
    // This client may not start switches.
    let coord = Coordinator::start(&conn, &s, quick(false, true))?;
    match coord.switch(Side::Right).await {
        Err(Error::Propose(ProposeError::NotAllowed)) => {}
        other => panic!("expected NotAllowed, got {other:?}"),
    }
    assert_eq!(conn.get_ref().side(), Side::Left);
    exchange(&conn, 0, 5).await?;
    conn.send_one(Bytes::from("bye")).await?;
    assert_eq!(timeout(WAIT, server.sides.recv()).await?, Some(Side::Left));
    // Starting a second coordinator on one connection is refused.
    let conn = client_conn(&server, &s).await?;
    let _first = Coordinator::start(&conn, &s, Policy::default())?;
    assert!(Coordinator::start(&conn, &s, Policy::default()).is_err());
    let _ = s.offers();
    Ok(())
}

#[tokio::test]
async fn a_voter_whose_compatible_option_is_its_current_one_still_follows() -> Result<()> {
    // The client's two branches are the same layer; the server's right branch has another
    // key. The client proposes its right branch: the server's right option does not fit, its
    // left one (the one it runs) does, so it votes for that and re-builds it at the markers.
    let mut server = echo_server(stack(1, 2), Some(patient())).await?;
    let s = stack(1, 1);
    let conn = client_conn(&server, &s).await?;
    let coord = Coordinator::start(&conn, &s, patient())?;
    let (out, e) = tokio::join!(timeout(WAIT, coord.switch(Side::Right)), async {
        for round in 0..10 {
            exchange(&conn, round * 10, 10).await?;
        }
        anyhow::Ok(())
    });
    e?;
    assert_eq!(
        out.context("the switch did not complete")??,
        Outcome::Switched
    );
    assert_eq!(conn.get_ref().side(), Side::Right);
    exchange(&conn, 1000, 20).await?;
    conn.send_one(Bytes::from("bye")).await?;
    assert_eq!(timeout(WAIT, server.sides.recv()).await?, Some(Side::Left));
    Ok(())
}
