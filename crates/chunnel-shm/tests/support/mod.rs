//! Shared by the integration tests: the application (identical whether shared memory or UDP is
//! picked), the server, child processes and namespaces with guards that always clean up.

#![allow(dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ConnectionExt, Identity, Select, Side, select};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_net::udp;
use chunnel_shm::LocalFastPath;

/// Every wait in these tests is bounded by this.
pub const WAIT: Duration = Duration::from_secs(20);
/// Marks the lines a child prints for the parent.
pub const MARK: &str = "CHUNNEL-SHM";

pub fn client_stack() -> Select<LocalFastPath, Identity> {
    select(LocalFastPath::client(), Identity)
}

pub fn server_stack() -> Select<LocalFastPath, Identity> {
    select(LocalFastPath::server(), Identity)
}

pub fn side_name(s: Side) -> &'static str {
    match s {
        Side::Left => "shm",
        Side::Right => "udp",
    }
}

/// The application: connect, exchange single messages and a burst, check every echo. The
/// same code whichever branch negotiation picks. Returns the pick.
pub async fn app(addr: SocketAddr) -> Result<Side> {
    let base = udp::Connect::new(addr).connect_wrap(()).await?;
    let conn = Client::new(Config::default())
        .connect(&addr.to_string(), client_stack(), base)
        .await?;
    let side = conn.get_ref().side();
    let branch = conn.info().client_pick.branches().to_vec();
    anyhow::ensure!(
        branch == [if side == Side::Left { 0 } else { 1 }],
        "pick {branch:?} does not match the built side {side:?}"
    );
    for i in 0..200u32 {
        let m = Bytes::from(format!("message {i}"));
        conn.send_one(m.clone()).await?;
        let got = tokio::time::timeout(WAIT, conn.recv_one()).await??;
        anyhow::ensure!(got == m, "echo {i} differs");
    }
    let burst: Vec<Bytes> = (0..32u8)
        .map(|i| Bytes::from(vec![i; 1000 + i as usize]))
        .collect();
    conn.send(burst.clone()).await?;
    let mut got = Vec::new();
    while got.len() < burst.len() {
        let mut slots = vec![None; 8];
        let n = tokio::time::timeout(WAIT, conn.recv(&mut slots)).await??;
        got.extend(slots.into_iter().take(n).flatten());
    }
    anyhow::ensure!(got == burst, "burst echo differs");
    Ok(side)
}

/// Serves the echo application on `listener`; reports each connection's pick on `picks`.
pub fn serve(listener: udp::Listener, picks: tokio::sync::mpsc::Sender<Side>) {
    let mut server = listen(server_stack(), listener, Config::default());
    tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            let _ = picks.try_send(conn.get_ref().side());
            tokio::spawn(async move {
                let mut slots = vec![None; 16];
                while let Ok(n) = conn.recv(&mut slots).await {
                    let msgs: Vec<Bytes> = slots[..n].iter_mut().filter_map(Option::take).collect();
                    if conn.send(msgs).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Skips (returning true) unless root and the tools are there.
pub fn skip_without_root(tools: &[&str]) -> bool {
    if !is_root() {
        eprintln!("skipped: needs root (namespaces)");
        return true;
    }
    for t in tools {
        let ok = Command::new(t)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !ok {
            eprintln!("skipped: `{t}` is missing");
            return true;
        }
    }
    false
}

/// A short unique tag for namespace names.
pub fn tag() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{}{:x}", std::process::id(), nanos & 0xffff)
}

pub fn run(cmd: &[&str]) -> Result<()> {
    let out = Command::new(cmd[0])
        .args(&cmd[1..])
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Network namespaces deleted on drop (their veth ends go with them).
pub struct Netns(pub Vec<String>);

impl Netns {
    pub fn add(&mut self, name: &str) -> Result<()> {
        run(&["ip", "netns", "add", name])?;
        self.0.push(name.to_owned());
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = Command::new("ip")
                .args(["netns", "del", n])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// A child process whose marked stdout lines arrive on a channel; killed on drop.
pub struct ChildProc {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    pub name: &'static str,
}

impl ChildProc {
    /// Re-runs this test binary's `child_entry` test as `role`, under `prefix` (e.g.
    /// `ip netns exec ns`).
    pub fn spawn(name: &'static str, prefix: &[&str], env: &[(&str, String)]) -> Result<Self> {
        let exe = std::env::current_exe()?;
        let mut argv: Vec<String> = prefix.iter().map(|s| s.to_string()).collect();
        argv.push(exe.display().to_string());
        argv.extend(
            ["child_entry", "--exact", "--nocapture", "--test-threads=1"].map(String::from),
        );
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().with_context(|| format!("spawning {argv:?}"))?;
        let out = child.stdout.take().context("child stdout")?;
        let (tx, lines) = mpsc::sync_channel(64);
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                // libtest may have printed `test child_entry ... ` on the same line.
                if let Some(i) = l.find(MARK)
                    && tx.send(l[i + MARK.len()..].trim().to_owned()).is_err()
                {
                    return;
                }
            }
        });
        Ok(ChildProc { child, lines, name })
    }

    /// The next marked line, waiting at most [`WAIT`].
    pub fn line(&self) -> Result<String> {
        self.lines
            .recv_timeout(WAIT)
            .with_context(|| format!("{}: no report within {WAIT:?}", self.name))
    }

    /// Waits (bounded) for the child to exit successfully.
    pub fn success(&mut self) -> Result<()> {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            if let Some(st) = self.child.try_wait()? {
                anyhow::ensure!(st.success(), "{} exited with {st}", self.name);
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                bail!("{} did not exit within {WAIT:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The child side, selected by `CHUNNEL_SHM_CHILD`:
/// * `server`: bind `CHUNNEL_SHM_BIND`, report `READY <addr>`, then `PICKED <side>` per
///   connection, serve until killed;
/// * `client`: run [`app`] against `CHUNNEL_SHM_ADDR`, report `PICKED <side>`;
/// * `client-hang`: negotiate, report `PICKED <side>`, then hang until killed.
pub fn child_main() -> Result<()> {
    let Ok(role) = std::env::var("CHUNNEL_SHM_CHILD") else {
        return Ok(());
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match role.as_str() {
            "server" => {
                let bind: SocketAddr = std::env::var("CHUNNEL_SHM_BIND")?.parse()?;
                let listener = udp::Listener::bind(bind).await?;
                println!("{MARK} READY {}", listener.local_addr()?);
                let (tx, mut rx) = tokio::sync::mpsc::channel(64);
                serve(listener, tx);
                while let Some(side) = rx.recv().await {
                    println!("{MARK} PICKED {}", side_name(side));
                }
                Ok(())
            }
            "client" => {
                let addr: SocketAddr = std::env::var("CHUNNEL_SHM_ADDR")?.parse()?;
                let side = tokio::time::timeout(WAIT, app(addr)).await??;
                println!("{MARK} PICKED {}", side_name(side));
                Ok(())
            }
            "client-hang" => {
                let addr: SocketAddr = std::env::var("CHUNNEL_SHM_ADDR")?.parse()?;
                let base = udp::Connect::new(addr).connect_wrap(()).await?;
                let conn = Client::new(Config::default())
                    .connect(&addr.to_string(), client_stack(), base)
                    .await?;
                conn.send_one(Bytes::from_static(b"hello")).await?;
                let _ = conn.recv_one().await?;
                println!("{MARK} PICKED {}", side_name(conn.get_ref().side()));
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok(())
            }
            "client-lend-hang" => {
                // Sends 10 messages from lent buffers (message i: 1000 bytes of i), then
                // hangs until killed.
                use chunnel::{Either, Emit, LendBuffer};
                let addr: SocketAddr = std::env::var("CHUNNEL_SHM_ADDR")?.parse()?;
                let base = udp::Connect::new(addr).connect_wrap(()).await?;
                let conn = Client::new(Config::default())
                    .connect(&addr.to_string(), client_stack(), base)
                    .await?;
                let Either::Left(shm) = conn.get_ref() else {
                    bail!("shared memory was not picked");
                };
                let mut bufs = Vec::new();
                for i in 0..10u8 {
                    let mut b = shm.lend(1000).context("lend")?;
                    b.as_mut().fill(i);
                    bufs.push(b);
                }
                shm.emit(bufs).await?;
                println!("{MARK} SENT");
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok(())
            }
            other => bail!("unknown child role {other}"),
        }
    })
}
