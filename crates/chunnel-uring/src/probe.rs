//! The availability probe: can this process set up a ring, register a provided-buffer ring
//! and receive a datagram through a multishot `RecvMsg`?

use std::io;
use std::net::UdpSocket;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::driver::{ClientRx, Inner, Stats};
use crate::udp::Config;

/// Runs the probe; the error is a human-readable reason.
pub(crate) fn run() -> Result<(), String> {
    let sock = match UdpSocket::bind("127.0.0.1:0") {
        Ok(s) => s,
        // No loopback here: the opcode-level checks below still tell whether io_uring works.
        Err(_) => return setup_only(),
    };
    let local = sock.local_addr().map_err(|e| e.to_string())?;
    sock.connect(local).map_err(|e| e.to_string())?;
    sock.set_nonblocking(true).map_err(|e| e.to_string())?;
    let cfg = Config::default()
        .with_datagram(|d| d.with_max_payload_bytes(64).with_batch(1))
        .with_recv_buffers(1);
    let mut inner = Inner::new(sock.as_raw_fd(), &cfg, ClientRx::new(4), false).map_err(explain)?;
    sock.send(b"chunnel-uring-probe")
        .map_err(|e| e.to_string())?;
    let stats = Stats::default();
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        inner
            .wait_completion(Duration::from_millis(50))
            .map_err(explain)?;
        inner.reap(&stats).map_err(explain)?;
        if let Some(e) = inner.rx.error.take() {
            return Err(format!("multishot RecvMsg failed: {}", explain(e)));
        }
        if let Some(m) = inner.rx.queue.pop_front() {
            return if &m[..] == b"chunnel-uring-probe" {
                Ok(())
            } else {
                Err("multishot RecvMsg returned wrong data".into())
            };
        }
        if Instant::now() > deadline {
            return Err("no completion for a loopback datagram within 1 s".into());
        }
    }
}

fn setup_only() -> Result<(), String> {
    io_uring::IoUring::new(4).map(drop).map_err(explain)
}

/// Turns a set-up error into a reason a person can act on.
fn explain(e: io::Error) -> String {
    let hint = match e.raw_os_error() {
        Some(libc::ENOSYS) => "; the kernel has no io_uring, or a seccomp filter hides it",
        Some(libc::EPERM) => {
            "; io_uring is disabled (sysctl kernel.io_uring_disabled) or blocked by seccomp"
        }
        Some(libc::EINVAL) => {
            "; the kernel lacks a needed feature (buffer rings need 5.19, multishot RecvMsg 6.0)"
        }
        Some(libc::ENOMEM) => "; locked-memory limit too low (RLIMIT_MEMLOCK) or out of memory",
        _ => "",
    };
    format!("io_uring: {e}{hint}")
}
