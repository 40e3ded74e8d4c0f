//! Peers in other processes: different network namespaces of this host (shared memory is
//! picked), a private /dev/shm in another mount namespace (UDP is picked, same application
//! code), and a peer killed mid-connection (detected). Namespace tests need root and skip
//! otherwise; every namespace is removed by a guard, even on failure.

mod support;

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use chunnel::{ConnectionExt, Error, Side};
use chunnel_negotiate::{Config, listen};
use chunnel_net::udp;
use support::{ChildProc, Netns, WAIT, run, serve, server_stack, skip_without_root, tag};

/// Not a test of its own: the entry point of the child processes the tests below start
/// (a no-op when run normally).
#[test]
fn child_entry() -> Result<()> {
    support::child_main()
}

#[test]
fn different_netns_pick_shm() -> Result<()> {
    if skip_without_root(&["ip"]) {
        return Ok(());
    }
    let t = tag();
    let (a, b) = (format!("chshm-a{t}"), format!("chshm-b{t}"));
    let mut ns = Netns(Vec::new());
    ns.add(&a)?;
    ns.add(&b)?;
    let (va, vb) = (format!("vsa{t}"), format!("vsb{t}"));
    run(&[
        "ip", "link", "add", &va, "netns", &a, "type", "veth", "peer", "name", &vb, "netns", &b,
    ])?;
    run(&["ip", "-n", &a, "addr", "add", "10.77.0.1/24", "dev", &va])?;
    run(&["ip", "-n", &b, "addr", "add", "10.77.0.2/24", "dev", &vb])?;
    for (n, v) in [(&a, &va), (&b, &vb)] {
        run(&["ip", "-n", n, "link", "set", v, "up"])?;
        run(&["ip", "-n", n, "link", "set", "lo", "up"])?;
    }

    let server = ChildProc::spawn(
        "server",
        &["ip", "netns", "exec", &a],
        &[
            ("CHUNNEL_SHM_CHILD", "server".into()),
            ("CHUNNEL_SHM_BIND", "10.77.0.1:0".into()),
        ],
    )?;
    let ready = server.line()?;
    let addr = ready
        .strip_prefix("READY ")
        .context("server ready line")?
        .to_owned();
    let mut client = ChildProc::spawn(
        "client",
        &["ip", "netns", "exec", &b],
        &[
            ("CHUNNEL_SHM_CHILD", "client".into()),
            ("CHUNNEL_SHM_ADDR", addr),
        ],
    )?;
    assert_eq!(
        client.line()?,
        "PICKED shm",
        "client pick across network namespaces"
    );
    client.success()?;
    assert_eq!(
        server.line()?,
        "PICKED shm",
        "server pick across network namespaces"
    );
    Ok(())
}

#[test]
fn private_dev_shm_picks_udp() -> Result<()> {
    if skip_without_root(&["unshare"]) {
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
        let addr = listener.local_addr()?;
        let (tx, mut picks) = tokio::sync::mpsc::channel(64);
        serve(listener, tx);
        // The client gets its own mount namespace with a fresh tmpfs on /dev/shm: it cannot
        // reach the server's shared memory (standing in for another host).
        let mut client = ChildProc::spawn(
            "client (private /dev/shm)",
            &[
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                "mount -t tmpfs tmpfs /dev/shm && exec \"$@\"",
                "sh",
            ],
            &[
                ("CHUNNEL_SHM_CHILD", "client".into()),
                ("CHUNNEL_SHM_ADDR", addr.to_string()),
            ],
        )?;
        let line = tokio::task::spawn_blocking(move || {
            let l = client.line();
            (l, client.success())
        })
        .await?;
        assert_eq!(line.0?, "PICKED udp", "client pick with a private /dev/shm");
        line.1?;
        let server_side = tokio::time::timeout(WAIT, picks.recv()).await?;
        assert_eq!(server_side, Some(Side::Right), "server pick");
        Ok(())
    })
}

/// A client process killed with SIGKILL (no chance to close) is noticed by the server.
#[test]
fn killed_peer_is_detected() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
        let addr = listener.local_addr()?;
        let mut server = listen(server_stack(), listener, Config::default());
        let client = ChildProc::spawn(
            "client (killed)",
            &[],
            &[
                ("CHUNNEL_SHM_CHILD", "client-hang".into()),
                ("CHUNNEL_SHM_ADDR", addr.to_string()),
            ],
        )?;
        let conn = tokio::time::timeout(WAIT, server.accept()).await??;
        assert_eq!(conn.get_ref().side(), Side::Left);
        assert_eq!(conn.recv_one().await?, "hello");
        conn.send_one("hi".into()).await?;
        let (line, client) = tokio::task::spawn_blocking(move || (client.line(), client)).await?;
        assert_eq!(line?, "PICKED shm");
        let mut client = client;
        let killed = Instant::now();
        client.child.kill()?;
        client.child.wait()?;
        let end = tokio::time::timeout(WAIT, conn.recv_one()).await?;
        assert!(matches!(end, Err(Error::PeerClosed)), "got {end:?}");
        let took = killed.elapsed();
        assert!(took < Duration::from_secs(2), "detection took {took:?}");
        eprintln!("killed peer detected after {took:?}");
        Ok(())
    })
}
