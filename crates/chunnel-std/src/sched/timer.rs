//! The driver's precise timer: a Linux timerfd on `CLOCK_MONOTONIC` (the clock of
//! [`std::time::Instant`]), armed with absolute deadlines and registered with tokio's reactor
//! ([`tokio::io::unix::AsyncFd`]), so a wait wakes the driver within the kernel's hrtimer
//! precision (microseconds) rather than tokio's millisecond timer wheel, without spinning.
//! One per connection; a wait allocates nothing (one `timerfd_settime`, and one `read` when
//! it fires).

use std::io;
use std::time::Instant;

#[cfg(target_os = "linux")]
pub(super) struct PreciseTimer {
    fd: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
}

#[cfg(target_os = "linux")]
impl PreciseTimer {
    /// A timer, or `None` if the kernel refuses a timerfd or tokio cannot register it.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime, or on a runtime without IO enabled (as any tokio IO type).
    pub(super) fn new() -> Option<Self> {
        use rustix::time::{TimerfdClockId, TimerfdFlags, timerfd_create};
        let fd = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )
        .ok()?;
        // Deprecated because a generic `T: AsRawFd` might close or swap its descriptor
        // (tokio#8587); an `OwnedFd` keeps the same open descriptor until it is dropped, which
        // is what the unsafe replacement's contract asks, so this use is sound (and this crate
        // forbids `unsafe`).
        #[allow(deprecated)]
        let fd = tokio::io::unix::AsyncFd::with_interest(fd, tokio::io::Interest::READABLE).ok()?;
        Some(PreciseTimer { fd })
    }

    /// Waits until `at` (arming the timer replaces any earlier deadline). Cancel safe.
    pub(super) async fn sleep_until(&self, at: Instant) -> io::Result<()> {
        use rustix::time::{
            ClockId, Itimerspec, TimerfdTimerFlags, Timespec, clock_gettime, timerfd_settime,
        };
        // `Instant` is CLOCK_MONOTONIC on Linux, but does not expose its timespec: the
        // deadline is now on that clock plus what is left until `at`.
        let mono = clock_gettime(ClockId::Monotonic);
        let left = at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        let left = Timespec::try_from(left).map_err(|_| io::ErrorKind::InvalidInput)?;
        let value = mono.checked_add(left).ok_or(io::ErrorKind::InvalidInput)?;
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        timerfd_settime(
            self.fd.get_ref(),
            TimerfdTimerFlags::ABSTIME,
            &Itimerspec {
                it_interval: zero,
                it_value: value,
            },
        )?;
        loop {
            let mut ready = self.fd.readable().await?;
            let mut expirations = [0u8; 8];
            // An expiration left unread from an earlier deadline was reset by the
            // `timerfd_settime` above: the read then finds nothing, and `try_io` clears the
            // stale readiness.
            match ready.try_io(|fd| Ok(rustix::io::read(fd.get_ref(), &mut expirations)?)) {
                Ok(r) => return r.map(|_| ()),
                Err(_would_block) => {}
            }
        }
    }
}

/// Elsewhere: no precise timer (the driver uses tokio's timers).
#[cfg(not(target_os = "linux"))]
pub(super) struct PreciseTimer;

#[cfg(not(target_os = "linux"))]
impl PreciseTimer {
    pub(super) fn new() -> Option<Self> {
        None
    }

    pub(super) async fn sleep_until(&self, _at: Instant) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }
}
