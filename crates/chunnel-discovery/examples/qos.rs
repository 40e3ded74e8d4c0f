//! A latency-sensitive client and server on one host: the registry's plan offers shared
//! memory, then kernel UDP; negotiation picks shared memory. Then the operator forbids
//! shared memory at run time: the next plan falls back, warns and says why.
//! `cargo run -p chunnel-discovery --features shm --example qos`
use bytes::Bytes;
use chunnel::{ConnectionExt, End};
use chunnel_discovery::datapaths::{Datapaths, FUNCTION};
use chunnel_discovery::{Hint, Policy, Registry};
use chunnel_negotiate::{Tagged, bind, connect};
use chunnel_net::udp;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // The operator maps the hint to what this deployment runs (the facade is kernel UDP).
    let policy = Policy::default().with_hint(Hint::LatencySensitive, ["shm", "kernel-udp"]);

    let server_reg = Registry::<Tagged<udp::ServerConnection>, Bytes>::new();
    server_reg.set_policy(policy.clone());
    Datapaths::new(End::Server).register(&server_reg)?;
    let plan = server_reg.for_hint(FUNCTION, Hint::LatencySensitive)?;
    let mut server = bind("127.0.0.1:0", plan.into_selection()).await?;
    let addr = server.local_addr();
    tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            tokio::spawn(async move {
                while let Ok(m) = conn.recv_one().await {
                    let _ = conn.send_one(m).await;
                }
            });
        }
    });

    let client_reg = Registry::<Tagged<udp::Connection>, Bytes>::new();
    client_reg.set_policy(policy.clone());
    Datapaths::new(End::Client).register(&client_reg)?;
    let plan = client_reg.for_hint(FUNCTION, Hint::LatencySensitive)?;
    assert_eq!(plan.report().selected, ["shm", "kernel-udp"]);
    let conn = connect(addr, plan.selection().clone()).await?;
    conn.send_one("hello".into()).await?;
    assert_eq!(conn.recv_one().await?, "hello");
    let (picked, _) = plan.negotiated(conn.info().client_pick.branches());
    println!("negotiated: {picked:?}"); // Some("shm"): both ends share this host's /dev/shm

    // At run time the operator forbids shared memory: the next plan falls back, warns (a
    // `tracing::warn!`) and reports what was missing and why.
    client_reg.set_policy(policy.forbid("shm"));
    let plan = client_reg.for_hint(FUNCTION, Hint::LatencySensitive)?;
    assert_eq!(plan.report().selected, ["kernel-udp"]);
    println!("fell back from: {}", plan.report().fallbacks[0]); // shm (forbidden by ...)
    let conn = connect(addr, plan.into_selection()).await?;
    conn.send_one("again".into()).await?;
    assert_eq!(conn.recv_one().await?, "again");
    Ok(())
}
