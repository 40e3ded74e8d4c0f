//! Shared by the namespace tests: two fresh namespaces joined by a single-queue veth pair,
//! running a future inside one, whether this host can run them at all, and an echo server.
#![allow(dead_code)] // each test file uses its own part

use anyhow::Result;
use bytes::Bytes;
use chunnel::{ChunnelConnection, ConnectionExt};
use chunnel_test::netns::VethPair;

/// The server's address, in namespace `b`.
pub const SERVER: &str = "10.79.0.2:7000";

/// Two namespaces joined by `xa` (10.79.0.1, in `a`) – `xb` (10.79.0.2, in `b`).
pub fn netns() -> Result<VethPair> {
    Ok(VethPair::new(
        "chxdp",
        ("xa", "xb"),
        ("10.79.0.1/24", "10.79.0.2/24"),
    )?)
}

/// Whether this process can run the namespace tests; prints why not (and fails under
/// `CHUNNEL_XDP_REQUIRE`).
pub fn privileged() -> bool {
    if chunnel_test::netns::can_create() {
        return true;
    }
    let why = "not root, or `ip` (iproute2) is missing";
    assert!(
        std::env::var_os("CHUNNEL_XDP_REQUIRE").is_none(),
        "CHUNNEL_XDP_REQUIRE is set but {why}"
    );
    eprintln!("skipping: {why}");
    false
}

/// Whether the XDP program was built into the library; prints why not (and fails under
/// `CHUNNEL_XDP_REQUIRE`).
pub fn program_built() -> bool {
    if chunnel_xdp::embedded_program_available() {
        return true;
    }
    assert!(
        std::env::var_os("CHUNNEL_XDP_REQUIRE").is_none(),
        "CHUNNEL_XDP_REQUIRE is set but the XDP program was not built (is clang installed?)"
    );
    eprintln!("skipping: the XDP program was not built (is clang installed?)");
    false
}

/// Runs `f` on a new thread inside network namespace `ns`, on its own current-thread runtime.
pub fn in_netns<T, F, Fut>(ns: &str, f: F) -> std::thread::JoinHandle<Result<T>>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<T>>,
{
    let ns = ns.to_owned();
    std::thread::spawn(move || {
        chunnel_test::netns::enter(&ns)?;
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(f())
    })
}

/// Echoes every message on every accepted connection until `stop` fires.
pub async fn echo<L>(mut listener: L, stop: tokio::sync::oneshot::Receiver<()>) -> L
where
    L: chunnel::Listener,
    L::Connection: ConnectionExt<Data = Bytes> + 'static,
{
    let accept = async {
        loop {
            let Ok(conn) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut slots = vec![None; 64];
                while let Ok(n) = conn.recv(&mut slots).await {
                    let burst: Vec<Bytes> =
                        slots[..n].iter_mut().map(|s| s.take().unwrap()).collect();
                    if conn.send(burst).await.is_err() {
                        return;
                    }
                }
            });
        }
    };
    tokio::select! {
        _ = accept => {}
        _ = stop => {}
    }
    listener
}
