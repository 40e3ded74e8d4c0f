//! The two-phase-commit coordinator reads its time from an injected clock (tokio's by
//! default), so a runtime whose time is paused drives its timeouts: a proposal to a silent
//! peer aborts after exactly the vote timeout of virtual time, and no wall-clock wait.

use std::time::Duration;

use anyhow::Result;
use bytes::Bytes;
use chunnel::{Chunnel, ConnectionExt, LockFree, Reconfigurable, Side, select};
use chunnel_negotiate::commit::{AbortReason, Coordinator, Outcome, Policy};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_net::uds;
use chunnel_test::Xor;

type Stack = Reconfigurable<Xor, Xor, LockFree>;

fn stack() -> Stack {
    select(Xor(1), Xor(2)).reconfigurable::<LockFree>()
}

#[tokio::test]
async fn a_silent_peers_vote_timeout_runs_on_the_paused_clock() -> Result<()> {
    // An echo server without a coordinator: it ignores the proposal.
    let addr = uds::UnixAddr::Abstract(format!("chunnel-paused-{}", std::process::id()).into());
    let l = uds::StreamListener::bind(addr.clone()).await?;
    let mut server = listen(stack(), l, Config::default());
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
    let s = stack();
    let base = uds::StreamConnect::new(addr).connect_wrap(()).await?;
    let conn = Client::new(Config::default())
        .connect("srv", s.clone(), base)
        .await?;

    // From here on, time moves only when every task waits for a timer.
    tokio::time::pause();
    let vote_timeout = Duration::from_secs(3600);
    let policy = Policy {
        vote_timeout,
        resend_after: Duration::from_secs(60),
        ..Policy::default()
    };
    let coord = Coordinator::start(&conn, &s, policy)?;
    let (t0, wall) = (tokio::time::Instant::now(), std::time::Instant::now());
    let out = coord.switch(Side::Right).await?;
    let waited = t0.elapsed();
    assert_eq!(out, Outcome::Aborted(AbortReason::Timeout));
    // The abort came at the deadline (the timer wheel rounds up to a millisecond), not before
    // and not a resend period late.
    assert!(
        waited >= vote_timeout && waited < vote_timeout + Duration::from_millis(5),
        "aborted after {waited:?} of virtual time"
    );
    // An hour of virtual time, not of the wall clock.
    assert!(
        wall.elapsed() < Duration::from_secs(60),
        "{:?}",
        wall.elapsed()
    );
    assert_eq!(conn.get_ref().side(), Side::Left);

    // The old stack goes on.
    tokio::time::resume();
    conn.send_one(Bytes::from("still here")).await?;
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(10), conn.recv_one()).await??,
        "still here"
    );
    Ok(())
}
