//! The operating-system calls behind the datapath: mapping a `/dev/shm` file, futex wait and
//! wake on a word of it, and open-file-description locks that tell whether the peer still
//! holds its end. Together with `ring.rs` (atomics over the mapping) this is the crate's only
//! `unsafe` code.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// A shared, read-write mapping of a whole file. Unmapped on drop; the file (and with it the
/// locks taken through it) is closed after that.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: *mut u8,
    len: usize,
    file: File,
}

// SAFETY: the mapping is plain shared memory; every access to it goes through atomics or
// through the ring protocol, which gives each byte range a single writer at a time. The raw
// pointer is only an address and may be used from any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above: `&Mapping` hands out nothing but the address and the length.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the whole of `file` (`len` bytes) shared and read-write, with every page
    /// populated now (`MAP_POPULATE`): a first touch later would fault on the data path
    /// (measured: a fault every 57 messages of 64 B, p99 9 µs instead of <1 µs).
    pub(crate) fn new(file: File, len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty mapping"));
        }
        // SAFETY: a fresh mapping chosen by the kernel (no fixed address), of a file we hold
        // open; the result is checked for MAP_FAILED before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
            file,
        })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned; nothing borrows the mapping any
        // more (every user holds the `Mapping` itself, which is being dropped).
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Blocks until `word` is woken or no longer holds `expected`, or `timeout` passes.
/// Spurious returns are fine: callers re-check their condition.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT (shared, not FUTEX_PRIVATE: the peer is another process) reads the
    // aligned 4-byte word `word` points at, which lives as long as the borrow; `ts` outlives
    // the call. The kernel only compares and sleeps.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes every waiter blocked on `word` (in any process mapping it).
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key; no memory is accessed.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

fn flock_at(byte: i64, kind: i32) -> libc::flock {
    // SAFETY: `flock` is plain data; all-zero is a valid value, fields set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte;
    fl.l_len = 1;
    fl.l_pid = 0; // required by F_OFD_*
    fl
}

/// Takes an exclusive open-file-description lock on byte `byte` of `file`. The kernel drops
/// it when the description is closed — including when the process dies — which is how the
/// peer notices a crash (see [`lock_held`]).
pub(crate) fn lock_byte(file: &File, byte: i64) -> io::Result<()> {
    let fl = flock_at(byte, libc::F_WRLCK);
    // SAFETY: F_OFD_SETLK reads the `flock` we pass; the fd is open.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether some other open file description holds a lock on byte `byte` of `file`.
pub(crate) fn lock_held(file: &File, byte: i64) -> io::Result<bool> {
    let mut fl = flock_at(byte, libc::F_WRLCK);
    // SAFETY: F_OFD_GETLK reads and writes the `flock` we pass; the fd is open.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
}

/// Whether the directory `dir` is writable by this process.
pub(crate) fn writable(dir: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
}
