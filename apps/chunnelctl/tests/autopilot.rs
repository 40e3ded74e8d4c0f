//! The autopilot, driven as an operator would: a running `chunnel-kv serve` and a running
//! `chunnel-kv load` whose autopilot rule switches its sharding mode by its request rate. A
//! load ramp set through `chunnelctl policy rate` (low -> high -> low) must make the client
//! move to server-side sharding, to client push and back, with every request answered and
//! correct throughout, and `chunnelctl --json autopilot` must show each switch and why.
//!
//! The servers are the workspace's binaries: this test builds chunnel-kv (a no-op when it is
//! fresh) into the target directory it runs from.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
use common::{Proc, spawn_kv_server, wait_socket};

const CTL: &str = env!("CARGO_BIN_EXE_chunnelctl");
const WAIT: Duration = Duration::from_secs(40);
/// Rates: `LOW` is under the rule's `down`, `HIGH` over its `up`.
const LOW: &str = "40";
const HIGH: &str = "500";
const RULE: &str = r#"entry="kv client (switchable)" counter=kv-client/requests window=1s up=250 down=120 dwell=2s above=client-push below=server-side"#;

fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(CTL).parent().unwrap().to_owned();
        let target = dir.parent().unwrap();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--locked", "-p", "chunnel-kv", "--target-dir"])
            .arg(target)
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        assert!(cmd.status().expect("cargo build").success());
        dir
    })
}

fn spawn(args: &[&str]) -> Proc {
    let child = Command::new(bin_dir().join("chunnel-kv"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting chunnel-kv");
    Proc(child, "chunnel-kv")
}

fn ctl(sock: &Path, args: &[&str]) -> Output {
    Command::new(CTL)
        .arg("--socket")
        .arg(sock)
        .args(args)
        .output()
        .expect("running chunnelctl")
}

/// `chunnelctl --json ARGS`, which must succeed.
fn json(sock: &Path, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = ctl(sock, &all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "chunnelctl {args:?} failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("chunnelctl {args:?} printed no JSON ({e}): {stdout}"))
}

fn counter(e: &Value, name: &str) -> u64 {
    e["counters"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["layer"] == "kv-client")
        .flat_map(|l| l["counters"].as_array().unwrap())
        .find(|c| c["name"] == name)
        .and_then(|c| c["value"].as_u64())
        .unwrap_or_else(|| panic!("no counter kv-client/{name} in {e}"))
}

/// Answers so far; asserts none failed, none was wrong, at most one per writer in flight.
fn check_traffic(e: &Value) -> u64 {
    let c = |n| counter(e, n);
    assert_eq!(c("failed"), 0, "requests failed: {e}");
    assert_eq!(
        c("wrong"),
        0,
        "a PUT answered another value than the one before: {e}"
    );
    assert!(c("requests").saturating_sub(c("answered")) <= 4, "{e}");
    c("answered")
}

fn show(sock: &Path) -> Value {
    json(sock, &["show", "1"])["entry"].clone()
}

/// Shows the client until it runs on `branch` at `epoch`, checking the traffic all along.
fn until_on(sock: &Path, branch: &str, epoch: u64) -> Value {
    let t0 = Instant::now();
    loop {
        let e = show(sock);
        check_traffic(&e);
        if e["branch"] == branch && e["epoch"] == epoch {
            return e;
        }
        assert!(
            e["epoch"].as_u64().unwrap() <= epoch,
            "switched more often than the ramp asks: {e}\n{}",
            json(sock, &["autopilot"])
        );
        assert!(
            t0.elapsed() < WAIT,
            "waited {WAIT:?} for {branch} at epoch {epoch}: {e}\n{}",
            json(sock, &["autopilot"])
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Keeps the load at the current rate for `d`, checking the traffic; the client must stay
/// on `branch` at `epoch` (no flapping). Returns the answers counted at the end.
fn holds(sock: &Path, branch: &str, epoch: u64, d: Duration) -> u64 {
    let t0 = Instant::now();
    loop {
        let e = show(sock);
        let answered = check_traffic(&e);
        assert_eq!(
            (e["branch"].as_str(), e["epoch"].as_u64()),
            (Some(branch), Some(epoch)),
            "{e}"
        );
        if t0.elapsed() >= d {
            return answered;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn switched(log: &Value) -> Vec<&Value> {
    log["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["verdict"] == "switched")
        .collect()
}

#[test]
fn a_load_ramp_switches_sharding_there_and_back() {
    let dir = std::env::temp_dir().join(format!("chunnelctl-autopilot-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (server_sock, sock) = (dir.join("kv.ctl"), dir.join("load.ctl"));
    let (mut server, addr) = spawn_kv_server(
        bin_dir(),
        &["--shards", "2", "--control", server_sock.to_str().unwrap()],
    );
    wait_socket(&server_sock, &mut server);
    // A process without an autopilot says so.
    let none = json(&server_sock, &["autopilot"]);
    assert_eq!(none["running"], false, "{none}");
    let mut load = spawn(&[
        "load",
        "--addr",
        &addr,
        "--control",
        sock.to_str().unwrap(),
        "--rate",
        LOW,
        "--writers",
        "4",
        "--autopilot-rule",
        RULE,
        "--autopilot-interval",
        "100",
    ]);
    wait_socket(&sock, &mut load);
    let sock = sock.as_path();
    let e = show(sock);
    assert_eq!(e["name"], "kv client (switchable)");
    assert_eq!(e["autopilot"]["rule"], "sharding", "{e}");

    // Low load: negotiation picked client push; the autopilot moves it to server-side.
    until_on(sock, "server-side", 1);
    let a0 = holds(sock, "server-side", 1, Duration::from_secs(3));
    // High load: to client push.
    json(sock, &["policy", "rate", HIGH]);
    until_on(sock, "client-push", 2);
    let a1 = holds(sock, "client-push", 2, Duration::from_secs(3));
    assert!(a1 > a0 + 500, "the high phase ran: {a0} -> {a1}");
    // Low again: back to server-side.
    json(sock, &["policy", "rate", LOW]);
    let e = until_on(sock, "server-side", 3);
    let a2 = holds(sock, "server-side", 3, Duration::from_secs(2));
    assert!(a2 > a1, "{a1} -> {a2}");

    // The decision log: each switch, the rate that caused it, the threshold and the window.
    let log = json(sock, &["autopilot"]);
    assert_eq!(log["kind"], "autopilot");
    assert_eq!(
        (log["running"].as_bool(), log["enabled"].as_bool()),
        (Some(true), Some(true))
    );
    assert_eq!(log["rules"][0]["name"], "sharding");
    assert_eq!(log["rules"][0]["entries"], serde_json::json!([1]));
    let sw = switched(&log);
    let moves: Vec<(&str, &str)> = sw
        .iter()
        .map(|d| (d["from"].as_str().unwrap(), d["to"].as_str().unwrap()))
        .collect();
    assert_eq!(
        moves,
        [
            ("client-push", "server-side"),
            ("server-side", "client-push"),
            ("client-push", "server-side")
        ],
        "{log}"
    );
    for d in &sw {
        let rate = d["rate"].as_f64().unwrap();
        assert_eq!(
            (d["up"].as_f64(), d["down"].as_f64()),
            (Some(250.0), Some(120.0))
        );
        assert_eq!(d["window_ms"], 1000);
        assert_eq!(d["entry"], 1);
        let reason = d["reason"].as_str().unwrap();
        if d["to"] == "client-push" {
            assert!(rate > 250.0, "{d}");
        } else {
            assert!(rate < 120.0, "{d}");
        }
        // Each switch was decided (verdict `switch`) with its reason just before.
        let seq = d["seq"].as_u64().unwrap();
        let decided = log["decisions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["seq"] == seq - 1)
            .unwrap();
        assert_eq!(decided["verdict"], "switch", "{decided}");
        let why = decided["reason"].as_str().unwrap();
        let cmp = if d["to"] == "client-push" {
            "> up 250"
        } else {
            "< down 120"
        };
        assert!(why.contains(cmp) && why.contains("over 1000 ms"), "{why}");
        assert!(reason.contains("switched"), "{reason}");
    }
    // `show` carries the latest decision; --entry and --since filter the log.
    assert_eq!(e["autopilot"]["last"]["seq"], sw[2]["seq"], "{e}");
    let since = sw[1]["seq"].as_u64().unwrap().to_string();
    let later = json(sock, &["autopilot", "--entry", "1", "--since", &since]);
    assert_eq!(switched(&later).len(), 1, "{later}");
    // The human table.
    let out = ctl(sock, &["autopilot"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && table.contains("autopilot on"),
        "{table}"
    );
    assert_eq!(
        table.lines().filter(|l| l.contains(" switched ")).count(),
        3,
        "{table}"
    );

    // Off by policy: high load no longer moves it; on again, it does.
    json(sock, &["policy", "autopilot", "off"]);
    json(sock, &["policy", "rate", HIGH]);
    holds(sock, "server-side", 3, Duration::from_secs(4));
    let log = json(sock, &["autopilot"]);
    assert_eq!(log["enabled"], false, "{log}");
    let last = log["decisions"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["verdict"], "policy", "{log}");
    json(sock, &["policy", "autopilot", "on"]);
    until_on(sock, "client-push", 4);
    // A rule the validator refuses (down above up) leaves the rule as it was.
    let out = ctl(
        sock,
        &[
            "--json",
            "policy",
            "autopilot.sharding",
            &RULE.replace("down=120", "down=300"),
        ],
    );
    assert!(!out.status.success());
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "invalid-value", "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("must be below up")
    );
    // A valid change applies at once: with `down` raised above the load, back down.
    let lower = RULE
        .replace("up=250", "up=2000")
        .replace("down=120", "down=1000");
    json(sock, &["policy", "autopilot.sharding", &lower]);
    until_on(sock, "server-side", 5);
    let log = json(sock, &["autopilot"]);
    let d = switched(&log).last().copied().unwrap().clone();
    assert_eq!(d["down"].as_f64(), Some(1000.0), "{d}");
    check_traffic(&show(sock));
    drop(load);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
