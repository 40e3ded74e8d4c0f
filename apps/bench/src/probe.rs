//! The deterministic loop measured under callgrind and by the allocation counter.
//!
//! A client connection with `layers` no-op Chunnels over kernel UDP sends a burst to a raw
//! reflector socket in the same thread, which returns it; the client receives the burst
//! through the same layers. Every message thus crosses each layer twice (down on `send`, up on
//! `recv`). Only `measured_loop` is counted (`--toggle-collect`), so runtime start-up is out;
//! the difference between two burst counts divided by the extra messages removes the rest of
//! the fixed cost.

use std::net::UdpSocket as StdUdp;

use anyhow::{Context, Result};
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Identity, Layered, Noop, stack};
use chunnel_metrics::Metered;
use chunnel_net::udp;
use serde_json::json;

#[derive(clap::Args)]
pub(crate) struct Args {
    /// No-op layers on the client (0, 1, 3 or 5).
    #[arg(long)]
    layers: usize,
    /// Bursts to send (after 50 warm-up bursts).
    #[arg(long, default_value_t = 1000)]
    bursts: usize,
    /// Messages per burst.
    #[arg(long, default_value_t = 32)]
    burst: usize,
    /// Message size in bytes.
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// A `Metered` layer instead of the no-op ones (with `--layers 0`): its handles with no
    /// recorder (`noop`) or in a Prometheus recorder (`prometheus`).
    #[arg(long)]
    metered: Option<String>,
}

pub(crate) fn run(a: Args) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(async {
        let reflector = StdUdp::bind("127.0.0.1:0")?;
        let addr = reflector.local_addr()?;
        let base = udp::Connect::new(addr);
        if let Some(mode) = &a.metered {
            anyhow::ensure!(a.layers == 0, "--metered goes with --layers 0");
            let m = Metered::new("probe").layer("udp");
            let m = match mode.as_str() {
                "noop" => m,
                "prometheus" => m.with_recorder(chunnel_metrics::prometheus::recorder().0),
                other => anyhow::bail!("--metered must be noop or prometheus, not {other}"),
            };
            return drive(stack![Layered(m), base], &reflector, &a).await;
        }
        match a.layers {
            0 => drive(stack![Identity, base], &reflector, &a).await,
            1 => drive(stack![Noop, base], &reflector, &a).await,
            3 => drive(stack![Noop, Noop, Noop, base], &reflector, &a).await,
            5 => drive(stack![Noop, Noop, Noop, Noop, Noop, base], &reflector, &a).await,
            n => anyhow::bail!("--layers must be 0, 1, 3 or 5, not {n}"),
        }
    })?;
    println!("{r}");
    Ok(())
}

async fn drive<S>(mut s: S, reflector: &StdUdp, a: &Args) -> Result<serde_json::Value>
where
    S: Chunnel<()>,
    S::Connection: ChunnelConnection<Data = Bytes>,
{
    let conn = s.connect_wrap(()).await.context("connect")?;
    let msg = Bytes::from(vec![7u8; a.size]);
    let mut slots = vec![None; a.burst];
    let mut buf = vec![0u8; 65_536];
    measured_loop(&conn, reflector, &msg, &mut slots, &mut buf, 50).await?;
    let before = crate::alloc::count();
    measured_loop(&conn, reflector, &msg, &mut slots, &mut buf, a.bursts).await?;
    let allocs = crate::alloc::count() - before;
    Ok(json!({
        "layers": a.layers,
        "messages": a.bursts * a.burst,
        "allocations": allocs,
    }))
}

/// Runs `exe args` under callgrind, counting only inside functions matching `toggle`, and
/// returns the instruction total (`Ir`).
pub(crate) fn callgrind_ir(exe: &std::path::Path, toggle: &str, args: &[String]) -> Result<u64> {
    use anyhow::{Context, bail};
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let out_file = std::env::temp_dir().join(format!(
        "chunnel-callgrind-{}-{}.out",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let st = std::process::Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--toggle-collect={toggle}"))
        .arg(format!("--callgrind-out-file={}", out_file.display()))
        .arg(exe)
        .args(args)
        .output()
        .context("running valgrind")?;
    if !st.status.success() {
        bail!(
            "callgrind run failed: {}",
            String::from_utf8_lossy(&st.stderr)
        );
    }
    let text = std::fs::read_to_string(&out_file).context("reading callgrind output")?;
    let _ = std::fs::remove_file(&out_file);
    text.lines()
        .find_map(|l| {
            l.strip_prefix("totals:")
                .or_else(|| l.strip_prefix("summary:"))
        })
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no totals line in callgrind output")
}

/// The loop the callgrind probes count (`--toggle-collect='*measured_loop*'`): a burst down
/// the client stack, reflected by a blocking socket in this thread, and received back up.
#[inline(never)]
pub(crate) async fn measured_loop<C: ChunnelConnection<Data = Bytes>>(
    conn: &C,
    reflector: &StdUdp,
    msg: &Bytes,
    slots: &mut [Option<Bytes>],
    buf: &mut [u8],
    bursts: usize,
) -> Result<()> {
    let burst = slots.len();
    for _ in 0..bursts {
        conn.send(std::iter::repeat_n(msg, burst).cloned()).await?;
        for _ in 0..burst {
            let (n, from) = reflector.recv_from(buf)?;
            reflector.send_to(&buf[..n], from)?;
        }
        let mut got = 0;
        while got < burst {
            let n = conn.recv(&mut slots[got..]).await?;
            got += n;
        }
        for s in slots.iter_mut() {
            *s = None;
        }
    }
    Ok(())
}
