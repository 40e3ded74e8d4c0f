//! Network namespaces for tests that need root: two fresh namespaces joined by a single-queue
//! veth pair, addressed only inside them, and deleted (with the pair) when the guard drops.

use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Runs `ip <args>`; an error carries `ip`'s stderr.
pub fn ip(args: &[&str]) -> std::io::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| std::io::Error::other(format!("running ip: {e}")))?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Whether this process is root and has `ip`: what the namespace tests need.
pub fn can_create() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root && Command::new("ip").arg("-V").output().is_ok()
}

/// Moves the calling thread into the network namespace `ns` (created by `ip netns add`).
/// Threads it starts afterwards inherit it.
pub fn enter(ns: &str) -> std::io::Result<()> {
    let path = format!("/run/netns/{ns}");
    let file = std::fs::File::open(&path)
        .map_err(|e| std::io::Error::other(format!("open {path}: {e}")))?;
    // SAFETY: setns changes only this thread's namespace; the descriptor is a namespace file
    // kept open for the duration of the call.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::other(format!(
            "setns {path}: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// Two namespaces `a` and `b` joined by a veth pair (`dev_a` in `a`, `dev_b` in `b`, one queue
/// each, as AF_XDP on veth needs), with an address on each end and `lo` up. Dropping it deletes
/// both namespaces, and the pair with them.
#[derive(Debug)]
pub struct VethPair {
    /// The first namespace's name.
    pub a: String,
    /// The second namespace's name.
    pub b: String,
}

impl VethPair {
    /// Creates the pair; names are `<prefix><pid>x<n>a` / `…b`, unique per process and call.
    /// `addrs` are CIDR addresses (e.g. `("10.79.0.1/24", "10.79.0.2/24")`).
    pub fn new(
        prefix: &str,
        (dev_a, dev_b): (&str, &str),
        (addr_a, addr_b): (&str, &str),
    ) -> std::io::Result<VethPair> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let base = format!(
            "{prefix}{}x{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let pair = VethPair {
            a: format!("{base}a"),
            b: format!("{base}b"),
        };
        // From here on, a failure drops `pair`, which deletes whatever was created.
        ip(&["netns", "add", &pair.a])?;
        ip(&["netns", "add", &pair.b])?;
        ip(&[
            "link",
            "add",
            dev_a,
            "netns",
            &pair.a,
            "numtxqueues",
            "1",
            "numrxqueues",
            "1",
            "type",
            "veth",
            "peer",
            "name",
            dev_b,
            "netns",
            &pair.b,
            "numtxqueues",
            "1",
            "numrxqueues",
            "1",
        ])?;
        ip(&["-n", &pair.a, "addr", "add", addr_a, "dev", dev_a])?;
        ip(&["-n", &pair.b, "addr", "add", addr_b, "dev", dev_b])?;
        for (n, dev) in [(&pair.a, dev_a), (&pair.b, dev_b)] {
            ip(&["-n", n, "link", "set", "lo", "up"])?;
            ip(&["-n", n, "link", "set", dev, "up"])?;
        }
        Ok(pair)
    }
}

impl Drop for VethPair {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}
