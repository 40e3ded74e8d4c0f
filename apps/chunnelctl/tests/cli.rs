//! `chunnelctl` driven as a user would: against a running `chunnel-kv serve`, a running
//! `chunnel-kv load` (a client whose sharding mode is switched live) and a running
//! `chunnel-demo serve` (a pair switched by two-phase commit), with `--json` and in a real
//! terminal (tmux), and as another user (refused).
//!
//! The servers are the workspace's binaries: this test builds them (`cargo build -p
//! chunnel-kv -p chunnel-demo`, a no-op when they are fresh) into the target directory it
//! runs from.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
use common::{Proc, spawn_kv_server, wait_socket};

const CTL: &str = env!("CARGO_BIN_EXE_chunnelctl");
const WAIT: Duration = Duration::from_secs(30);

/// The directory of the workspace's binaries, with chunnel-kv and chunnel-demo built.
fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(CTL).parent().unwrap().to_owned();
        let target = dir.parent().unwrap();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args([
            "build",
            "--locked",
            "-p",
            "chunnel-kv",
            "-p",
            "chunnel-demo",
            "--target-dir",
        ])
        .arg(target)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let st = cmd.status().expect("running cargo build");
        assert!(st.success(), "building chunnel-kv and chunnel-demo failed");
        dir
    })
}

fn spawn(bin: &'static str, args: &[&str]) -> Proc {
    let child = Command::new(bin_dir().join(bin))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {bin}: {e}"));
    Proc(child, bin)
}

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("chunnelctl-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn ctl(args: &[&str]) -> Output {
    Command::new(CTL)
        .args(args)
        .output()
        .expect("running chunnelctl")
}

/// `chunnelctl --socket S --json ARGS`, which must succeed; its (last) JSON line.
fn json(sock: &Path, args: &[&str]) -> Value {
    let mut all = vec!["--socket", sock.to_str().unwrap(), "--json"];
    all.extend_from_slice(args);
    let out = ctl(&all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "chunnelctl {args:?} failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("chunnelctl {args:?} printed no JSON ({e}): {stdout}"))
}

fn entry<'a>(ls: &'a Value, name: &str) -> &'a Value {
    ls["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .unwrap_or_else(|| panic!("no entry {name:?} in {ls}"))
}

fn counter(e: &Value, layer: &str, name: &str) -> u64 {
    e["counters"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["layer"] == layer)
        .flat_map(|l| l["counters"].as_array().unwrap())
        .find(|c| c["name"] == name)
        .and_then(|c| c["value"].as_u64())
        .unwrap_or_else(|| panic!("no counter {layer}/{name} in {e}"))
}

/// Shows entry `id` until `until` holds for it.
/// `ls` once every entry named in `names` is listed (a process opens its endpoint before it
/// registers its entries).
fn ls_until(sock: &Path, names: &[&str]) -> Value {
    let t0 = Instant::now();
    loop {
        let ls = json(sock, &["ls"]);
        let listed = |n: &&str| {
            ls["entries"]
                .as_array()
                .is_some_and(|a| a.iter().any(|e| e["name"] == *n))
        };
        if names.iter().all(listed) {
            return ls;
        }
        assert!(
            t0.elapsed() < WAIT,
            "waited {WAIT:?} for entries {names:?}: {ls}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn show_until(sock: &Path, id: u64, what: &str, until: impl Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let e = json(sock, &["show", &id.to_string()])["entry"].clone();
        if until(&e) {
            return e;
        }
        assert!(t0.elapsed() < WAIT, "waited {WAIT:?} for {what}: {e}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The key-value store: a server and a switchable client, each a process with an endpoint.
struct Kv {
    dir: PathBuf,
    addr: String,
    _server: Proc,
    _load: Proc,
    server_sock: PathBuf,
    load_sock: PathBuf,
}

fn kv(tag: &str) -> Kv {
    let dir = tempdir(tag);
    let server_sock = dir.join("kv.ctl");
    let load_sock = dir.join("load.ctl");
    let (mut server, addr) = spawn_kv_server(
        bin_dir(),
        &["--shards", "2", "--control", server_sock.to_str().unwrap()],
    );
    wait_socket(&server_sock, &mut server);
    let mut load = spawn(
        "chunnel-kv",
        &[
            "load",
            "--addr",
            &addr,
            "--control",
            load_sock.to_str().unwrap(),
            "--rate",
            "400",
            "--writers",
            "4",
        ],
    );
    wait_socket(&load_sock, &mut load);
    Kv {
        dir,
        addr,
        _server: server,
        _load: load,
        server_sock,
        load_sock,
    }
}

impl Drop for Kv {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Requests issued, answered, failed, wrong, in flight; checks nothing was lost or
/// executed twice: no failures, no wrong answers, at most one request per writer in flight.
fn check_traffic(e: &Value) -> u64 {
    let c = |n| counter(e, "kv-client", n);
    let (requests, answered) = (c("requests"), c("answered"));
    assert_eq!(c("failed"), 0, "requests failed: {e}");
    assert_eq!(
        c("wrong"),
        0,
        "a PUT answered a value other than the one written before: {e}"
    );
    assert!(
        requests.saturating_sub(answered) <= 4,
        "more in flight than writers: {e}"
    );
    answered
}

#[test]
fn kv_list_show_switch_json() {
    let kv = kv("json");
    // The server: its canonical listener and shards.
    let ls = ls_until(
        &kv.server_sock,
        &[
            "kv canonical (client push or server-side)",
            "kv shard 0",
            "kv shard 1",
        ],
    );
    assert_eq!(ls["kind"], "ls");
    let canon = entry(&ls, "kv canonical (client push or server-side)");
    assert_eq!(canon["kind"], "listener");
    assert_eq!(canon["peer"], kv.addr.as_str());
    entry(&ls, "kv shard 0");
    entry(&ls, "kv shard 1");

    // The client: negotiated client push, switchable.
    let ls = ls_until(&kv.load_sock, &["kv client (switchable)"]);
    let c = entry(&ls, "kv client (switchable)");
    let id = c["id"].as_u64().unwrap();
    assert_eq!(c["branch"], "client-push");
    assert_eq!(c["epoch"], 0);
    assert_eq!(c["negotiation"]["role"], "client");
    assert_eq!(c["peer"], kv.addr.as_str());
    assert_eq!(
        c["branches"],
        serde_json::json!(["client-push", "server-side"])
    );
    let e = show_until(&kv.load_sock, id, "100 answers", |e| {
        check_traffic(e) >= 100
    });
    check_traffic(&e);

    // Switch there and back with traffic flowing; every request answered, correctly.
    for (to, epoch) in [("server-side", 1), ("client-push", 2)] {
        let before = check_traffic(&json(&kv.load_sock, &["show", &id.to_string()])["entry"]);
        let r = json(&kv.load_sock, &["switch", &id.to_string(), to]);
        let r0 = &r["results"][0];
        assert_eq!(r0["ok"], true, "{r}");
        assert_eq!(r0["changed"], true, "{r}");
        assert_eq!(r0["to"], to, "{r}");
        assert_eq!(r0["epoch"], epoch, "{r}");
        let e = show_until(&kv.load_sock, id, "200 more answers", |e| {
            check_traffic(e) >= before + 200
        });
        assert_eq!(e["branch"], to);
        assert_eq!(e["epoch"], epoch);
    }
    // --all reaches the one switchable entry; switching to where it is changes nothing.
    let r = json(&kv.load_sock, &["switch", "--all", "client-push"]);
    assert_eq!(r["results"].as_array().unwrap().len(), 1, "{r}");
    assert_eq!(r["results"][0]["changed"], false, "{r}");
    // The server saw the requests through both paths.
    let ls = json(&kv.server_sock, &["ls"]);
    let canon = entry(&ls, "kv canonical (client push or server-side)");
    assert!(counter(canon, "shards", "requests") >= 500, "{canon}");
    assert_eq!(counter(canon, "negotiation", "client-push"), 1, "{canon}");

    // Policy: the load's rate, validated.
    let p = json(&kv.load_sock, &["policy"]);
    assert_eq!(p["policies"][0]["name"], "rate");
    assert_eq!(p["policies"][0]["value"], "400");
    let p = json(&kv.load_sock, &["policy", "rate", "800"]);
    assert_eq!(p["policies"][0]["previous"], "400");
    let out = ctl(&[
        "--socket",
        kv.load_sock.to_str().unwrap(),
        "--json",
        "policy",
        "rate",
        "fast",
    ]);
    assert!(!out.status.success());
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "invalid-value", "{err}");

    // Watch: --count snapshots, one JSON line each.
    let out = ctl(&[
        "--socket",
        kv.load_sock.to_str().unwrap(),
        "--json",
        "watch",
        &id.to_string(),
        "--count",
        "3",
        "--interval",
        "100",
    ]);
    assert!(out.status.success());
    let frames: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(frames.len(), 3);
    for (k, f) in frames.iter().enumerate() {
        assert_eq!(f["kind"], "watch");
        assert_eq!(f["seq"], k as u64);
        check_traffic(&f["entries"][0]);
    }
    let a = |f: &Value| counter(&f["entries"][0], "kv-client", "answered");
    assert!(
        a(&frames[2]) > a(&frames[0]),
        "the counters move: {frames:?}"
    );

    // Errors: a missing entry, a bad branch, a listener (not switchable).
    let sock = kv.load_sock.to_str().unwrap();
    for (args, code) in [
        (vec!["show", "99"], "no-such-entry"),
        (
            vec!["switch", &*id.to_string(), "sideways"],
            "no-such-branch",
        ),
    ] {
        let mut all = vec!["--socket", sock, "--json"];
        all.extend(args.iter().copied());
        let out = ctl(&all);
        assert!(!out.status.success());
        let err: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(err["error"]["code"], code, "{err}");
    }
    let out = ctl(&[
        "--socket",
        kv.server_sock.to_str().unwrap(),
        "switch",
        "1",
        "server-side",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no switch handle"));
    // Finally, nothing lost or wrong over the whole run.
    check_traffic(&json(&kv.load_sock, &["show", &id.to_string()])["entry"]);
}

#[test]
fn demo_switch_by_two_phase_commit() {
    let dir = tempdir("demo");
    let sock = dir.join("demo.ctl");
    let mut demo = spawn(
        "chunnel-demo",
        &[
            "serve",
            "--control",
            sock.to_str().unwrap(),
            "--rate",
            "2000",
        ],
    );
    wait_socket(&sock, &mut demo);
    let ls = ls_until(&sock, &["demo client", "echo server"]);
    let client = entry(&ls, "demo client")["id"].as_u64().unwrap();
    let server = entry(&ls, "echo server")["id"].as_u64().unwrap();
    assert_eq!(entry(&ls, "demo client")["commit_only"], true);
    let traffic = |e: &Value| {
        let c = |n| counter(e, "traffic", n);
        assert_eq!(c("lost"), 0, "an echo was lost: {e}");
        assert_eq!(c("duplicated"), 0, "an echo came twice: {e}");
        c("echoed")
    };
    show_until(&sock, client, "echoes", |e| traffic(e) >= 200);

    // The checksum is an exact-match layer: this end alone may not switch.
    let out = ctl(&[
        "--socket",
        sock.to_str().unwrap(),
        "--json",
        "switch",
        &client.to_string(),
        "fnv1a",
    ]);
    assert!(!out.status.success());
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "switch-failed", "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--commit"),
        "{err}"
    );

    // By two-phase commit: both ends switch; traffic goes on, nothing lost or repeated.
    let switches = [(client, "fnv1a"), (server, "crc32"), (client, "fnv1a")];
    for (k, (who, to)) in switches.into_iter().enumerate() {
        let epoch = k as u64 + 1;
        let before = traffic(&json(&sock, &["show", &client.to_string()])["entry"]);
        let r = json(&sock, &["switch", &who.to_string(), to, "--commit"]);
        assert_eq!(r["results"][0]["ok"], true, "{r}");
        assert_eq!(r["results"][0]["changed"], true, "{r}");
        // Both ends show the new branch once the switch returns; the follower counts its
        // switch just after its marker leaves, so its epoch may take a moment.
        for id in [client, server] {
            show_until(&sock, id, "the epoch after the switch", |e| {
                e["epoch"] == epoch
            });
            let e = json(&sock, &["show", &id.to_string()])["entry"].clone();
            assert_eq!(e["branch"], to, "entry {id} after the switch: {e}");
        }
        show_until(&sock, client, "more echoes after the switch", |e| {
            traffic(e) >= before + 500
        });
    }
    drop(demo);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tmux server of this test's own (its own socket name), killed when dropped.
struct Tmux(String);

impl Tmux {
    fn new() -> Option<Tmux> {
        if Command::new("tmux").arg("-V").output().is_err() {
            return None;
        }
        Some(Tmux(format!("chunnelctl-test-{}", std::process::id())))
    }

    fn run(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .arg("-L")
            .arg(&self.0)
            .args(args)
            .env("TERM", "xterm-256color")
            .output()
            .expect("running tmux");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Captures `target`'s screen until `until` holds.
    fn capture_until(&self, target: &str, what: &str, until: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        loop {
            let screen = self.run(&["capture-pane", "-p", "-t", target]);
            if until(&screen) {
                return screen;
            }
            assert!(
                t0.elapsed() < WAIT,
                "waited {WAIT:?} for {what}; the screen:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-L")
            .arg(&self.0)
            .arg("kill-server")
            .output();
    }
}

/// The row of `screen` whose cells start with `first`, split at the header's columns.
fn columns<'a>(screen: &'a str, header: &str) -> (Vec<usize>, Vec<&'a str>) {
    let lines: Vec<&str> = screen.lines().collect();
    let h = lines
        .iter()
        .position(|l| l.starts_with(header))
        .unwrap_or_else(|| panic!("no header {header:?} on the screen:\n{screen}"));
    // Column starts: each header word after two spaces.
    let head = lines[h];
    let mut starts = vec![0];
    let b = head.as_bytes();
    for i in 2..b.len() {
        if b[i] != b' ' && b[i - 1] == b' ' && b[i - 2] == b' ' {
            starts.push(i);
        }
    }
    (
        starts,
        lines[h + 1..]
            .iter()
            .copied()
            .filter(|l| !l.trim().is_empty())
            .collect(),
    )
}

fn cell<'a>(row: &'a str, starts: &[usize], i: usize) -> &'a str {
    let end = starts
        .get(i + 1)
        .copied()
        .unwrap_or(row.len())
        .min(row.len());
    row.get(starts[i]..end).unwrap_or("").trim()
}

#[test]
fn in_a_terminal_ls_and_watch() {
    let Some(tmux) = Tmux::new() else {
        println!("skipped: tmux is not installed");
        return;
    };
    let kv = kv("tmux");
    let sock = kv.load_sock.to_str().unwrap();
    tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "ctl",
        "-x",
        "200",
        "-y",
        "50",
        &format!("{CTL} --socket {sock} ls; sleep 600"),
    ]);
    let screen = tmux.capture_until("ctl", "the ls table", |s| s.contains("kv client"));
    let (starts, rows) = columns(&screen, "ID  KIND");
    assert_eq!(
        starts.len(),
        8,
        "ID KIND NAME PEER BRANCH EPOCH STACK AGE:\n{screen}"
    );
    let row = rows.iter().find(|r| r.contains("kv client")).unwrap();
    assert_eq!(
        cell(row, &starts, 1),
        "connection",
        "aligned under KIND:\n{screen}"
    );
    assert_eq!(cell(row, &starts, 2), "kv client (switchable)", "{screen}");
    assert_eq!(cell(row, &starts, 3), kv.addr, "{screen}");
    assert_eq!(cell(row, &starts, 4), "client-push", "{screen}");
    let id = cell(row, &starts, 0).to_owned();

    // watch: live counters redrawn in place.
    tmux.run(&[
        "new-window",
        "-t",
        "ctl",
        "-n",
        "watch",
        &format!("{CTL} --socket {sock} watch --interval 200"),
    ]);
    let target = "ctl:watch";
    let answered = |screen: &str| -> Option<(String, String, u64)> {
        let (starts, rows) = columns(screen, "ID  NAME");
        let row = rows.iter().find(|r| cell(r, &starts, 5) == "answered")?;
        Some((
            cell(row, &starts, 2).to_owned(),
            cell(row, &starts, 3).to_owned(),
            cell(row, &starts, 6).parse().ok()?,
        ))
    };
    let first = tmux.capture_until(target, "the watch table", |s| s.contains("answered"));
    let (branch, epoch, a0) = answered(&first).unwrap();
    assert_eq!(
        (branch.as_str(), epoch.as_str()),
        ("client-push", "0"),
        "{first}"
    );
    // Refreshed in place: one snapshot on the screen, and its numbers move.
    let later = tmux.capture_until(target, "the counters to move", |s| {
        answered(s).is_some_and(|(_, _, a)| a > a0)
    });
    assert_eq!(
        later.matches("snapshot").count(),
        1,
        "redrawn in place:\n{later}"
    );
    let (starts, _) = columns(&later, "ID  NAME");
    assert_eq!(
        starts.len(),
        8,
        "ID NAME BRANCH EPOCH LAYER COUNTER VALUE PER SEC:\n{later}"
    );

    // A switch shows up live.
    let out = ctl(&["--socket", sock, "switch", &id, "server-side"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.starts_with("ID  RESULT"), "{table}");
    assert!(
        table.lines().nth(1).unwrap().contains("switched"),
        "{table}"
    );
    let after = tmux.capture_until(target, "the switch on screen", |s| {
        answered(s).is_some_and(|(b, e, _)| b == "server-side" && e == "1")
    });
    assert_eq!(after.matches("snapshot").count(), 1, "{after}");
    check_traffic(&json(&kv.load_sock, &["show", &id])["entry"]);
}

#[test]
fn clear_errors() {
    let dir = tempdir("errors");
    // No socket.
    let out = ctl(&["--socket", dir.join("none.ctl").to_str().unwrap(), "ls"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no control socket at"), "{err}");
    // No endpoint given at all.
    let out = Command::new(CTL)
        .arg("ls")
        .env_remove("CHUNNEL_CONTROL")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("CHUNNEL_CONTROL"));

    // An endpoint of another protocol version (a fake: answers every line with version 2).
    let path = dir.join("v2.ctl");
    let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let fake = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        let mut w = s.try_clone().unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        w.write_all(b"{\"v\":2,\"error\":{\"code\":\"version\",\"message\":\"speak 2\"}}\n")
            .unwrap();
    });
    // Through the environment variable this time.
    let out = Command::new(CTL)
        .args(["--json", "ls"])
        .env("CHUNNEL_CONTROL", &path)
        .output()
        .unwrap();
    fake.join().unwrap();
    assert!(!out.status.success());
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "version", "{err}");
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("version mismatch") && msg.contains("version 2"),
        "{msg}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Another user cannot use the control socket: the socket's mode (0600) keeps them out, and
/// when the mode is opened up, the endpoint's SO_PEERCRED check still refuses them.
#[test]
fn another_user_is_refused() {
    let uid = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m));
    if uid.ok() != Some(0) {
        println!("skipped: changing to another user needs root");
        return;
    }
    let as_nobody: Vec<&str> = if Command::new("setpriv").arg("--version").output().is_ok() {
        vec![
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ]
    } else if Command::new("runuser").arg("--version").output().is_ok() {
        vec!["runuser", "-u", "nobody", "--"]
    } else {
        println!("skipped: neither setpriv nor runuser is installed");
        return;
    };
    let dir = tempdir("perm");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    // A copy of chunnelctl that nobody may run wherever the target directory is.
    let ctl_copy = dir.join("chunnelctl");
    std::fs::copy(CTL, &ctl_copy).unwrap();
    std::fs::set_permissions(&ctl_copy, std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = dir.join("demo.ctl");
    let mut demo = spawn(
        "chunnel-demo",
        &[
            "serve",
            "--control",
            sock.to_str().unwrap(),
            "--rate",
            "100",
        ],
    );
    wait_socket(&sock, &mut demo);
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);

    let run_as_nobody = || {
        let out = Command::new(as_nobody[0])
            .args(&as_nobody[1..])
            .arg(&ctl_copy)
            .args(["--socket", sock.to_str().unwrap(), "--json", "ls"])
            .output()
            .unwrap();
        assert!(
            !out.status.success(),
            "nobody listed the entries: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let err: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{e}: {} {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        });
        assert_eq!(err["error"]["code"], "permission-denied", "{err}");
        err["error"]["message"].as_str().unwrap().to_owned()
    };
    let msg = run_as_nobody();
    assert!(msg.contains("permission denied"), "{msg}");
    // Open the mode up: the peer-credential check refuses nobody all the same.
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let msg = run_as_nobody();
    assert!(
        msg.contains("uid 65534 may not use this control endpoint"),
        "{msg}"
    );
    // The owner still gets in.
    json(&sock, &["ls"]);
    drop(demo);
    let _ = std::fs::remove_dir_all(&dir);
}
