//! A real server with traffic through metered stacks and the Prometheus exporter on a free
//! loopback port, scraped with curl (a real HTTP GET); the exposition text is parsed and its
//! counters checked against the traffic sent; `promtool check metrics` runs on the scrape when
//! promtool is installed (Debian: apt package `prometheus`).

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use chunnel::{
    Chunnel, ChunnelConnection, ChunnelExt, ConnectionExt, Layered, Listener, LockFree, Noop,
    Shared, Side, select, stack,
};
use chunnel_metrics::Metered;
use chunnel_metrics::prometheus::Exporter;
use chunnel_net::udp;

/// One sample of the exposition text: name, labels, value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the text exposition format (samples only; comments skipped).
fn parse_exposition(text: &str) -> Result<Vec<Sample>> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .with_context(|| format!("no value in {line:?}"))?;
        let value: f64 = value
            .parse()
            .with_context(|| format!("value in {line:?}"))?;
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest
                    .strip_suffix('}')
                    .with_context(|| format!("unterminated labels in {line:?}"))?;
                let mut labels = BTreeMap::new();
                // Our label values hold no commas or quotes; anything else is an error here.
                for pair in body.split(',').filter(|p| !p.is_empty()) {
                    let (k, v) = pair
                        .split_once('=')
                        .with_context(|| format!("label {pair:?}"))?;
                    let v = v
                        .strip_prefix('"')
                        .and_then(|v| v.strip_suffix('"'))
                        .with_context(|| format!("unquoted label value {pair:?}"))?;
                    labels.insert(k.to_string(), v.to_string());
                }
                (name.to_string(), labels)
            }
        };
        out.push(Sample {
            name,
            labels,
            value,
        });
    }
    Ok(out)
}

/// The sum of the samples named `name` whose labels include every pair of `want`.
fn total(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            want.iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum()
}

async fn curl(url: String, head: bool) -> Result<(String, String)> {
    tokio::task::spawn_blocking(move || {
        let mut c = Command::new("curl");
        c.args(["-sS", "--max-time", "5", "-o", "-", "-w", "\n%{http_code}"]);
        if head {
            c.arg("-I");
        }
        let out = c.arg(&url).output().context("running curl")?;
        ensure!(
            out.status.success(),
            "curl {url}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).context("scrape is not UTF-8")?;
        let (body, code) = text.rsplit_once('\n').context("no status code")?;
        Ok((body.to_string(), code.to_string()))
    })
    .await?
}

fn promtool_check(text: &str) -> Result<()> {
    let Ok(v) = Command::new("promtool").arg("--version").output() else {
        eprintln!(
            "SKIP promtool check: promtool not installed (Debian: apt-get install prometheus)"
        );
        return Ok(());
    };
    ensure!(v.status.success(), "promtool --version failed");
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .context("promtool stdin")?
        .write_all(text.as_bytes())?;
    // Bounded wait: promtool reads stdin and exits; a hang fails the test after 30 s.
    let start = std::time::Instant::now();
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if start.elapsed() > Duration::from_secs(30) {
            child.kill()?;
            bail!("promtool check metrics did not finish in 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output()?;
    eprintln!(
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success(),
        "promtool check metrics failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrape_counts_the_traffic() -> Result<()> {
    tokio::time::timeout(Duration::from_secs(60), scrape()).await?
}

async fn scrape() -> Result<()> {
    // The opt-in: nothing without the variable, a refusal for a bad one, the endpoint with one.
    // SAFETY: this test binary's only test; no other thread reads the environment now.
    unsafe { std::env::remove_var(chunnel_metrics::prometheus::ENV_ADDR) };
    assert!(Exporter::install_from_env().await?.is_none());
    unsafe { std::env::set_var(chunnel_metrics::prometheus::ENV_ADDR, "not-an-address") };
    assert!(matches!(
        Exporter::install_from_env().await,
        Err(chunnel_metrics::Error::BadAddress { .. })
    ));
    unsafe { std::env::set_var(chunnel_metrics::prometheus::ENV_ADDR, "127.0.0.1:0") };
    let exporter = Exporter::install_from_env()
        .await?
        .context("CHUNNEL_METRICS_ADDR set")?;
    let url = format!("http://{}/metrics", exporter.local_addr());

    // The server: an echo over a metered stack on real UDP.
    let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = listener.local_addr()?;
    let mut server = Layered(Metered::new("scrape-srv").layer("udp")).serve(listener);
    let echo = tokio::spawn(async move {
        let conn = server.accept().await?;
        let mut slots = vec![None; 16];
        loop {
            let n = conn.recv(&mut slots).await?;
            conn.send(slots[..n].iter_mut().filter_map(Option::take))
                .await?;
        }
        #[allow(unreachable_code)]
        Ok::<_, chunnel::Error>(())
    });

    // The client: one message at a time, sizes 1..=N, each echoed.
    const N: usize = 300;
    let mut client = stack![
        Layered(Metered::new("scrape-cli").layer("udp")),
        udp::Connect::new(addr)
    ];
    let conn = client.connect_wrap(()).await?;
    let mut bytes = 0u64;
    for size in 1..=N {
        let m = Bytes::from(vec![size as u8; size]);
        conn.send_one(m.clone()).await?;
        let got = tokio::time::timeout(Duration::from_secs(2), conn.recv_one()).await??;
        ensure!(got == m, "echo {size} came back different");
        bytes += size as u64;
    }

    // A reconfiguration recorded through chunnel_metrics::reconfigure.
    let sel = select(Noop, Noop).reconfigurable::<LockFree>();
    let handle = sel.handle();
    let mut rc = stack![sel, Shared, udp::Connect::new(addr)];
    let rconn = rc.connect_wrap(()).await?;
    let moved = chunnel_metrics::reconfigure(&handle, Side::Right, "scrape-reconfig").await?;
    assert_eq!(moved, 1);
    assert_eq!(rconn.side(), Side::Right);

    let (text, code) = curl(url.clone(), false).await?;
    assert_eq!(code, "200", "scrape status; body: {text}");
    eprintln!("scrape ({} bytes):\n{text}", text.len());
    let samples = parse_exposition(&text)?;

    let n = N as f64;
    let b = bytes as f64;
    let m = "chunnel_messages_total";
    let by = "chunnel_bytes_total";
    for (stack, dir) in [
        ("scrape-cli", "sent"),
        ("scrape-cli", "received"),
        ("scrape-srv", "sent"),
        ("scrape-srv", "received"),
    ] {
        let want = [("stack", stack), ("layer", "udp"), ("direction", dir)];
        assert_eq!(total(&samples, m, &want), n, "{m} {stack} {dir}");
        assert_eq!(total(&samples, by, &want), b, "{by} {stack} {dir}");
    }
    // Per connection: each side's series carry one `conn` label.
    let conns: std::collections::BTreeSet<_> = samples
        .iter()
        .filter(|s| s.name == m && s.labels["stack"] == "scrape-srv")
        .map(|s| s.labels["conn"].clone())
        .collect();
    assert_eq!(conns.len(), 1, "one server connection: {conns:?}");

    let rwant = [
        ("stack", "scrape-reconfig"),
        ("result", "ok"),
        ("to", "right"),
    ];
    assert_eq!(
        total(&samples, "chunnel_reconfig_switches_total", &rwant),
        1.0
    );
    let pause = [("stack", "scrape-reconfig")];
    assert_eq!(
        total(
            &samples,
            "chunnel_reconfig_switch_pause_seconds_count",
            &pause
        ),
        1.0
    );
    // A histogram: the +Inf bucket holds the one switch.
    let inf = [("stack", "scrape-reconfig"), ("le", "+Inf")];
    assert_eq!(
        total(
            &samples,
            "chunnel_reconfig_switch_pause_seconds_bucket",
            &inf
        ),
        1.0
    );

    // The snapshots count the same traffic.
    let snap = chunnel_metrics::snapshot();
    let cli = snap
        .iter()
        .find(|c| &*c.stack == "scrape-cli")
        .context("client snapshot")?;
    assert_eq!(
        (cli.sent_msgs, cli.sent_bytes, cli.recv_msgs, cli.recv_bytes),
        (N as u64, bytes, N as u64, bytes)
    );

    // Other paths and HEAD.
    let (_, code) = curl(format!("http://{}/nope", exporter.local_addr()), false).await?;
    assert_eq!(code, "404");
    let (head, code) = curl(url, true).await?;
    assert_eq!(code, "200");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");

    promtool_check(&text)?;
    echo.abort();
    Ok(())
}
