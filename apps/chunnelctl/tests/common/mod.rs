//! What the process-driving tests share: a child killed on drop, waiting for a control
//! socket, and a `chunnel-kv serve` on a kernel-picked port.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a child gets to come up.
pub const WAIT: Duration = Duration::from_secs(30);

/// A child process, killed when dropped.
pub struct Proc(pub Child, pub &'static str);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until something accepts on the socket at `p`.
pub fn wait_socket(p: &Path, proc: &mut Proc) {
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(p).is_err() {
        if let Ok(Some(st)) = proc.0.try_wait() {
            panic!("{} exited ({st}) before its control socket was up", proc.1);
        }
        assert!(t0.elapsed() < WAIT, "no control socket at {}", p.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts `chunnel-kv serve` on a port the kernel picks (`127.0.0.1:0`: a port probed free
/// and handed over could be taken by another socket in between) and returns it with the
/// address it printed ("serving on ADDR ..."). `bin_dir` holds the built binaries; the
/// server's stderr goes to the test's.
pub fn spawn_kv_server(bin_dir: &Path, args: &[&str]) -> (Proc, String) {
    let mut all = vec!["serve", "--addr", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let mut child = Command::new(bin_dir.join("chunnel-kv"))
        .args(&all)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("starting chunnel-kv: {e}"));
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("serving on ") {
                let _ = tx.send(
                    rest.split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_owned(),
                );
            }
        }
    });
    let proc = Proc(child, "chunnel-kv");
    let addr = rx
        .recv_timeout(WAIT)
        .expect("chunnel-kv serve printed no \"serving on\" line (see its stderr above)");
    (proc, addr)
}
