//! The AF_XDP socket, written directly against the kernel ABI (`linux/if_xdp.h`): a UMEM, the
//! fill / completion / RX / TX rings mapped into this process, `bind` to one queue in copy
//! mode with `XDP_USE_NEED_WAKEUP`. This module and `bpf.rs` hold the crate's unsafe code.
//!
//! UMEM layout: `frames` chunks of `frame_size` bytes. The first half is lent to the kernel
//! through the fill ring for reception (every received chunk goes straight back to the fill
//! ring once its bytes were copied out); the second half is the TX pool, recycled from the
//! completion ring.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr;
use std::sync::atomic::{AtomicU32, Ordering};

/// Sizes of the socket.
#[derive(Clone, Copy, Debug)]
pub(crate) struct XskSizes {
    /// Chunks in the UMEM (a power of two, at least 4).
    pub(crate) frames: u32,
    /// Bytes per chunk (2048 or 4096).
    pub(crate) frame_size: u32,
}

struct Ring {
    map: *mut libc::c_void,
    map_len: usize,
    producer: *const AtomicU32,
    consumer: *const AtomicU32,
    flags: *const AtomicU32,
    desc: *mut u8,
    size: u32,
}

impl Ring {
    /// Maps one ring. `desc_size` is 16 (`xdp_desc`) or 8 (a UMEM address).
    fn map(
        fd: RawFd,
        off: &libc::xdp_ring_offset,
        size: u32,
        desc_size: usize,
        pgoff: u64,
    ) -> io::Result<Ring> {
        let map_len = off.desc as usize + size as usize * desc_size;
        // SAFETY: a fresh shared mapping of the socket's ring; the kernel validates the offset.
        let map = unsafe {
            libc::mmap(
                ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                pgoff as libc::off_t,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = map.cast::<u8>();
        // SAFETY: the offsets come from XDP_MMAP_OFFSETS and lie inside the mapping.
        unsafe {
            Ok(Ring {
                map,
                map_len,
                producer: base.add(off.producer as usize).cast(),
                consumer: base.add(off.consumer as usize).cast(),
                flags: base.add(off.flags as usize).cast(),
                desc: base.add(off.desc as usize),
                size,
            })
        }
    }

    fn producer(&self) -> &AtomicU32 {
        // SAFETY: points into our live mapping; the kernel accesses it atomically too.
        unsafe { &*self.producer }
    }

    fn consumer(&self) -> &AtomicU32 {
        // SAFETY: as above.
        unsafe { &*self.consumer }
    }

    fn needs_wakeup(&self) -> bool {
        // SAFETY: as above.
        unsafe { &*self.flags }.load(Ordering::Relaxed) & libc::XDP_RING_NEED_WAKEUP != 0
    }

    /// Pointer to the `i`-th entry (index taken modulo the size).
    fn entry<T>(&self, i: u32) -> *mut T {
        let idx = (i & (self.size - 1)) as usize;
        // SAFETY: idx < size, inside the mapped descriptor array.
        unsafe { self.desc.add(idx * std::mem::size_of::<T>()).cast() }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

/// One AF_XDP socket with its own UMEM.
pub(crate) struct Xsk {
    // Field order: rings are unmapped before the socket closes, the UMEM last.
    fill: Ring,
    comp: Ring,
    rx: Ring,
    tx: Ring,
    fd: OwnedFd,
    umem: *mut u8,
    umem_len: usize,
    frame_size: u32,
    /// TX chunks not in flight.
    free_tx: Vec<u64>,
    /// Kicks (sendto) issued.
    pub(crate) kicks: u64,
}

// SAFETY: the raw pointers point into mappings owned by this value; all access goes through
// `&mut self` (the caller serialises with a mutex).
unsafe impl Send for Xsk {}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn setsockopt<T>(fd: RawFd, opt: libc::c_int, val: &T) -> io::Result<()> {
    // SAFETY: `val` is a valid T for the duration of the call.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_XDP,
            opt,
            (val as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// Whether an AF_XDP socket can be created here at all (kernel support + privilege).
pub(crate) fn probe() -> io::Result<()> {
    // SAFETY: plain socket(2); the descriptor is closed by OwnedFd.
    let fd = cvt(unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: fd was just returned by socket(2).
    drop(unsafe { OwnedFd::from_raw_fd(fd) });
    Ok(())
}

impl Xsk {
    /// Creates the socket and binds it to (`ifindex`, `queue`) in copy mode with need-wakeup.
    pub(crate) fn new(ifindex: u32, queue: u32, sizes: XskSizes) -> io::Result<Xsk> {
        let XskSizes { frames, frame_size } = sizes;
        assert!(frames.is_power_of_two() && frames >= 4);
        assert!(frame_size.is_power_of_two() && frame_size >= 2048);
        let half = frames / 2;
        // SAFETY: plain socket(2).
        let fd =
            cvt(unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) })?;
        // SAFETY: fd was just returned by socket(2).
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let raw = fd.as_raw_fd();

        let umem_len = frames as usize * frame_size as usize;
        // SAFETY: a fresh anonymous private mapping, unmapped in Drop (or below on error).
        let umem = unsafe {
            libc::mmap(
                ptr::null_mut(),
                umem_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if umem == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let umem = umem.cast::<u8>();
        let guard = UmemGuard(umem, umem_len);

        let reg = libc::xdp_umem_reg {
            addr: umem as u64,
            len: umem_len as u64,
            chunk_size: frame_size,
            headroom: 0,
            flags: 0,
            tx_metadata_len: 0,
        };
        setsockopt(raw, libc::XDP_UMEM_REG, &reg)?;
        setsockopt(raw, libc::XDP_UMEM_FILL_RING, &half)?;
        setsockopt(raw, libc::XDP_UMEM_COMPLETION_RING, &half)?;
        setsockopt(raw, libc::XDP_RX_RING, &half)?;
        setsockopt(raw, libc::XDP_TX_RING, &half)?;

        // SAFETY: xdp_mmap_offsets is plain data; zeroed is a valid value.
        let mut off: libc::xdp_mmap_offsets = unsafe { std::mem::zeroed() };
        let mut optlen = std::mem::size_of::<libc::xdp_mmap_offsets>() as libc::socklen_t;
        // SAFETY: the kernel writes at most optlen bytes into `off`.
        cvt(unsafe {
            libc::getsockopt(
                raw,
                libc::SOL_XDP,
                libc::XDP_MMAP_OFFSETS,
                (&mut off as *mut libc::xdp_mmap_offsets).cast(),
                &mut optlen,
            )
        })?;
        if optlen as usize != std::mem::size_of::<libc::xdp_mmap_offsets>() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "kernel too old: XDP_MMAP_OFFSETS without ring flags",
            ));
        }
        let desc = std::mem::size_of::<libc::xdp_desc>();
        let fill = Ring::map(raw, &off.fr, half, 8, libc::XDP_UMEM_PGOFF_FILL_RING)?;
        let comp = Ring::map(raw, &off.cr, half, 8, libc::XDP_UMEM_PGOFF_COMPLETION_RING)?;
        let rx = Ring::map(raw, &off.rx, half, desc, libc::XDP_PGOFF_RX_RING as u64)?;
        let tx = Ring::map(raw, &off.tx, half, desc, libc::XDP_PGOFF_TX_RING as u64)?;

        // Lend the first half of the UMEM to the kernel for reception.
        let prod = fill.producer().load(Ordering::Relaxed);
        for i in 0..half {
            // SAFETY: fill ring entry inside the mapping.
            unsafe {
                fill.entry::<u64>(prod + i)
                    .write(u64::from(i) * u64::from(frame_size))
            };
        }
        fill.producer().store(prod + half, Ordering::Release);

        let sa = libc::sockaddr_xdp {
            sxdp_family: libc::AF_XDP as u16,
            sxdp_flags: libc::XDP_COPY | libc::XDP_USE_NEED_WAKEUP,
            sxdp_ifindex: ifindex,
            sxdp_queue_id: queue,
            sxdp_shared_umem_fd: 0,
        };
        // SAFETY: `sa` is a valid sockaddr_xdp.
        cvt(unsafe {
            libc::bind(
                raw,
                (&sa as *const libc::sockaddr_xdp).cast(),
                std::mem::size_of::<libc::sockaddr_xdp>() as libc::socklen_t,
            )
        })?;

        std::mem::forget(guard);
        let free_tx = (half..frames)
            .map(|i| u64::from(i) * u64::from(frame_size))
            .collect();
        Ok(Xsk {
            fill,
            comp,
            rx,
            tx,
            fd,
            umem,
            umem_len,
            frame_size,
            free_tx,
            kicks: 0,
        })
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Largest frame this socket carries.
    pub(crate) fn frame_size(&self) -> usize {
        self.frame_size as usize
    }

    /// Consumes up to `max` received frames, handing each to `f`, and returns their chunks to
    /// the fill ring (one producer update for the batch). Returns how many were consumed.
    pub(crate) fn recv_batch(&mut self, max: usize, mut f: impl FnMut(&[u8])) -> usize {
        let cons = self.rx.consumer().load(Ordering::Relaxed);
        let prod = self.rx.producer().load(Ordering::Acquire);
        let n = prod.wrapping_sub(cons).min(max as u32);
        if n == 0 {
            return 0;
        }
        let fprod = self.fill.producer().load(Ordering::Relaxed);
        for i in 0..n {
            // SAFETY: entries cons..prod were published by the kernel (acquire above).
            let d = unsafe { self.rx.entry::<libc::xdp_desc>(cons.wrapping_add(i)).read() };
            let start = d.addr as usize;
            let len = d.len as usize;
            if start.checked_add(len).is_some_and(|e| e <= self.umem_len) {
                // SAFETY: bounds checked against the UMEM; the kernel no longer writes this
                // chunk until we give it back through the fill ring below.
                let frame = unsafe { std::slice::from_raw_parts(self.umem.add(start), len) };
                f(frame);
            }
            let chunk = d.addr & !u64::from(self.frame_size - 1);
            // SAFETY: the fill ring has room: every RX chunk is either in it, in the RX ring
            // or in the kernel, and the ring holds all of them.
            unsafe { self.fill.entry::<u64>(fprod.wrapping_add(i)).write(chunk) };
        }
        self.rx
            .consumer()
            .store(cons.wrapping_add(n), Ordering::Release);
        self.fill
            .producer()
            .store(fprod.wrapping_add(n), Ordering::Release);
        n as usize
    }

    /// Whether the kernel asks to be woken (a `recvfrom`/`poll`) to refill from the fill ring.
    pub(crate) fn fill_needs_wakeup(&self) -> bool {
        self.fill.needs_wakeup()
    }

    /// Wakes the kernel's receive path (needed only when `fill_needs_wakeup`).
    pub(crate) fn kick_rx(&mut self) {
        // SAFETY: zero-length recvfrom on our socket, no buffer.
        unsafe {
            libc::recvfrom(
                self.fd(),
                ptr::null_mut(),
                0,
                libc::MSG_DONTWAIT,
                ptr::null_mut(),
                ptr::null_mut(),
            )
        };
    }

    fn reclaim(&mut self) {
        let cons = self.comp.consumer().load(Ordering::Relaxed);
        let prod = self.comp.producer().load(Ordering::Acquire);
        let n = prod.wrapping_sub(cons);
        for i in 0..n {
            // SAFETY: published by the kernel.
            let a = unsafe { self.comp.entry::<u64>(cons.wrapping_add(i)).read() };
            self.free_tx.push(a & !u64::from(self.frame_size - 1));
        }
        if n > 0 {
            self.comp.consumer().store(prod, Ordering::Release);
        }
    }

    /// Writes frames into free TX chunks with `build` (which returns the frame length, or
    /// `None` to stop), publishes them with one producer update and kicks the kernel.
    /// Returns how many frames were queued: fewer than asked when the TX ring or pool is
    /// full (the caller retries later).
    pub(crate) fn send_batch(
        &mut self,
        mut build: impl FnMut(&mut [u8]) -> Option<usize>,
    ) -> usize {
        self.reclaim();
        let prod = self.tx.producer().load(Ordering::Relaxed);
        let cons = self.tx.consumer().load(Ordering::Acquire);
        let room = self.tx.size - prod.wrapping_sub(cons);
        let mut n = 0u32;
        while n < room {
            let Some(&addr) = self.free_tx.last() else {
                break;
            };
            // SAFETY: a free TX chunk inside the UMEM, not owned by the kernel.
            let buf = unsafe {
                std::slice::from_raw_parts_mut(
                    self.umem.add(addr as usize),
                    self.frame_size as usize,
                )
            };
            let Some(len) = build(buf) else { break };
            self.free_tx.pop();
            let d = libc::xdp_desc {
                addr,
                len: len as u32,
                options: 0,
            };
            // SAFETY: entry inside the TX ring, not yet published.
            unsafe {
                self.tx
                    .entry::<libc::xdp_desc>(prod.wrapping_add(n))
                    .write(d)
            };
            n += 1;
        }
        if n > 0 {
            self.tx
                .producer()
                .store(prod.wrapping_add(n), Ordering::Release);
        }
        // Copy mode transmits only from a system call, need-wakeup flag or not.
        if n > 0 || self.tx.needs_wakeup() || self.tx_in_flight() > 0 {
            self.kick_tx();
        }
        n as usize
    }

    /// Kicks the kernel until it has taken every queued TX descriptor (copy mode transmits a
    /// bounded number of frames per system call), stopping when a kick makes no progress.
    pub(crate) fn flush_tx(&mut self) {
        let mut last = self.tx.consumer().load(Ordering::Acquire);
        while last != self.tx.producer().load(Ordering::Relaxed) {
            self.kick_tx();
            let now = self.tx.consumer().load(Ordering::Acquire);
            if now == last {
                break;
            }
            last = now;
        }
    }

    /// Whether TX descriptors wait in the ring for the kernel to take them (a kick that met a
    /// busy device leaves them there).
    pub(crate) fn tx_pending(&self) -> bool {
        self.tx.consumer().load(Ordering::Acquire) != self.tx.producer().load(Ordering::Relaxed)
    }

    /// TX chunks handed to the kernel and not completed yet.
    pub(crate) fn tx_in_flight(&self) -> usize {
        (self.umem_len / self.frame_size as usize / 2) - self.free_tx.len()
    }

    pub(crate) fn kick_tx(&mut self) {
        self.kicks += 1;
        // SAFETY: zero-length sendto on our socket.
        unsafe {
            libc::sendto(
                self.fd(),
                ptr::null(),
                0,
                libc::MSG_DONTWAIT,
                ptr::null(),
                0,
            )
        };
    }

    /// The socket's drop counters (`XDP_STATISTICS`): (rx_dropped, rx_ring_full,
    /// rx_fill_ring_empty).
    pub(crate) fn stats(&self) -> io::Result<(u64, u64, u64)> {
        // SAFETY: plain data.
        let mut s: libc::xdp_statistics = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::xdp_statistics>() as libc::socklen_t;
        // SAFETY: the kernel writes at most len bytes.
        cvt(unsafe {
            libc::getsockopt(
                self.fd(),
                libc::SOL_XDP,
                libc::XDP_STATISTICS,
                (&mut s as *mut libc::xdp_statistics).cast(),
                &mut len,
            )
        })?;
        Ok((s.rx_dropped, s.rx_ring_full, s.rx_fill_ring_empty_descs))
    }
}

impl Drop for Xsk {
    fn drop(&mut self) {
        // The rings and the socket are closed after this (field order). The kernel pins the
        // UMEM pages while the socket lives, so unmapping them first is safe.
        // SAFETY: unmaps the UMEM mapped in `new`.
        unsafe { libc::munmap(self.umem.cast(), self.umem_len) };
    }
}

struct UmemGuard(*mut u8, usize);

impl Drop for UmemGuard {
    fn drop(&mut self) {
        // SAFETY: unmaps the UMEM on an error path in `new`.
        unsafe { libc::munmap(self.0.cast(), self.1) };
    }
}
