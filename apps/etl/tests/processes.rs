//! The roles as processes: two `chunnel-etl ingest` and two `chunnel-etl parse` processes on a
//! real nats-server, producers and the consumer in this test; ingest process 0 is SIGKILLed
//! mid-run and the producers carry on over the other one without losing a record. In the
//! `restarted` tests it is started again on the same address: the producers negotiate with it
//! again and it gets records again.
#![cfg(feature = "nats")]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use chunnel_etl::hop::{HopSender, SenderConfig};
use chunnel_etl::roles::{Acked, Consumer, ProducerConfig, produce};
use chunnel_test::services::Scratch;

/// A child process, SIGKILLed and reaped on drop, and its stderr lines.
struct Proc(Child, mpsc::Receiver<String>);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// Sends SIGINT (by PID) and waits (at most 20 s) for a stderr line starting with `prefix`.
    fn interrupt_and_read(&mut self, prefix: &str) -> Result<String> {
        let status = Command::new("kill")
            .args(["-INT", &self.0.id().to_string()])
            .status()
            .context("running kill -INT")?;
        ensure!(status.success(), "kill -INT failed");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.1.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return Ok(line),
                Ok(_) => {}
                Err(_) => bail!("no {prefix:?} line within 20 s of SIGINT"),
            }
        }
    }
}

/// Starts `chunnel-etl args` and waits (at most 20 s) for a stderr line containing `ready`.
fn spawn(args: &[String], ready: &str) -> Result<Proc> {
    Ok(spawn_line(args, ready)?.0)
}

/// [`spawn`], also returning the `ready` line.
fn spawn_line(args: &[String], ready: &str) -> Result<(Proc, String)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_chunnel-etl"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawning chunnel-etl")?;
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::sync_channel(1024);
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("  [{}] {line}", std::process::id());
            // Never blocks: once the test stopped listening, lines are only drained.
            let _ = tx.try_send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(ready) => return Ok((Proc(child, rx), line)),
            Ok(_) => {}
            Err(_) => {
                let _ = Proc(child, rx);
                bail!("chunnel-etl {args:?} did not print {ready:?} within 20 s")
            }
        }
    }
}

/// The address in an ingest server's "ingest on ADDR -> ..." line.
fn ingest_addr(line: &str) -> Result<SocketAddr> {
    let rest = line
        .split("ingest on ")
        .nth(1)
        .context("no \"ingest on\" in the line")?;
    let addr = rest.split_whitespace().next().unwrap_or_default();
    addr.parse()
        .with_context(|| format!("ingest address {addr:?} in {line:?}"))
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// `restart`: ingest process 0 is started again on its address this long after the kill.
async fn scenario(shm: bool, restart: Option<Duration>) -> Result<()> {
    let scratch = Scratch::new("etl-procs");
    let (_nats, nats) = chunnel_test::brokers::nats(&scratch);
    let topic = format!("procs-{}-{shm}", std::process::id());
    let no_shm = if shm { "" } else { "--no-shm" };
    let consumer = Consumer::start("127.0.0.1:0".parse()?, shm).await?;
    let consumer_addr = consumer.addr().to_string();
    let mut ingests = Vec::new();
    let mut ingest_addrs = Vec::new();
    let mut ingest_args = Vec::new();
    let ingest = |listen: &str| {
        let mut args = strings(&["ingest", "--broker", "nats", "--broker-addr", &nats]);
        args.extend(strings(&["--topic", &topic, "--listen", listen]));
        args.extend(strings(&[no_shm]).into_iter().filter(|s| !s.is_empty()));
        args
    };
    for _ in 0..2 {
        // A kernel-picked port, read back from the server: a port probed free here could be
        // taken by another socket before the server bound it.
        let (proc, line) = spawn_line(&ingest("127.0.0.1:0"), "ingest on")?;
        let addr = ingest_addr(&line)?;
        ingests.push(proc);
        ingest_addrs.push(addr);
        // A restart listens on the address the first process had.
        ingest_args.push(ingest(&addr.to_string()));
    }
    let mut parsers = Vec::new();
    for i in 0..2 {
        let mut args = strings(&["parse", "--broker", "nats", "--broker-addr", &nats]);
        args.extend(strings(&[
            "--topic", &topic, "--group", "procs", "--count", "2",
        ]));
        args.extend(strings(&[
            "--index",
            &i.to_string(),
            "--consumers",
            &consumer_addr,
        ]));
        args.extend(strings(&[no_shm]).into_iter().filter(|s| !s.is_empty()));
        parsers.push(spawn(&args, "parser")?);
    }
    let mut producers = Vec::new();
    let mut acked = Vec::new();
    for id in 0..3 {
        let cfg = SenderConfig {
            shm,
            ..SenderConfig::default()
        };
        let sender = HopSender::connect(&ingest_addrs, cfg).await?;
        let want = if shm { "shm" } else { "udp" };
        ensure!(
            sender.paths().iter().all(|p| p.1 == want),
            "producer {id} negotiated {:?}, expected {want}",
            sender.paths()
        );
        let a = Acked::default();
        acked.push(a.clone());
        let pc = ProducerConfig {
            id,
            rate: 400.0,
            batch: 8,
            duration: Duration::from_secs(if restart.is_some() { 7 } else { 4 }),
            malformed_every: 20,
        };
        producers.push(tokio::spawn(produce(pc, sender, a)));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before: Vec<_> = acked.iter().flat_map(Acked::snapshot).collect();
    drop(ingests.remove(0)); // SIGKILL
    let mut restarted = None;
    if let Some(after) = restart {
        tokio::time::sleep(after).await;
        // The same address, a new process: the producers must find it again.
        restarted = Some(spawn(&ingest_args[0], "ingest on")?);
        eprintln!("ingest 0 restarted on {}", ingest_addrs[0]);
    }
    let mut sent = Vec::new();
    let mut failovers = 0;
    let mut reconnects = 0;
    for p in producers {
        let r = p.await?;
        ensure!(r.failed == 0, "producer gave up batches: {r:?}");
        ensure!(r.acked == r.sent, "not all acknowledged: {r:?}");
        failovers += r.sender.failovers;
        reconnects += r.sender.reconnects;
        if restart.is_some() {
            ensure!(
                r.sender.reconnects >= 1,
                "producer did not reconnect to the restarted ingest server: {r:?}"
            );
        }
        sent.push(r.sent);
    }
    if let Some(mut p) = restarted {
        // The restarted process publishes what it acknowledged; it says how much on SIGINT.
        let line = p.interrupt_and_read("published ")?;
        let published: u64 = line["published ".len()..].trim().parse()?;
        eprintln!("restarted ingest 0: {line}; reconnects {reconnects}");
        ensure!(
            published > 0,
            "the restarted ingest server got no records: the producers never came back to it"
        );
    }
    let total: u64 = sent.iter().sum();
    let deadline = Instant::now() + Duration::from_secs(60);
    while consumer.accounted() < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (missing, examples, extra) = consumer.missing(&sent, 10);
    let c = consumer.report();
    eprintln!(
        "shm {shm}: sent {total}, acknowledged before the kill {}, delivered {}, malformed {}, \
         duplicates {}, failovers {failovers}, p50 {} µs p99 {} µs",
        before.len(),
        c.delivered,
        c.malformed,
        c.duplicates,
        c.latency_us[0],
        c.latency_us[1]
    );
    ensure!(!before.is_empty(), "nothing acknowledged before the kill");
    let lost: Vec<_> = before.iter().filter(|&&id| !consumer.has(id)).collect();
    ensure!(
        lost.is_empty(),
        "acknowledged before the kill, lost: {:?}",
        &lost[..lost.len().min(5)]
    );
    ensure!(
        missing == 0 && extra == 0,
        "missing {missing} {examples:?}, unexpected {extra}"
    );
    ensure!(
        c.malformed == total / 20,
        "malformed {} of {total}",
        c.malformed
    );
    ensure!(c.delivered + c.malformed == total);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_ingest_sigkilled_shm() -> Result<()> {
    scenario(true, None).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_ingest_sigkilled_udp() -> Result<()> {
    scenario(false, None).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_ingest_restarted_shm() -> Result<()> {
    scenario(true, Some(Duration::from_millis(1500))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_ingest_restarted_udp() -> Result<()> {
    scenario(false, Some(Duration::from_millis(1500))).await
}
