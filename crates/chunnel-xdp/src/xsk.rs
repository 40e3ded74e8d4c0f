//! The AF_XDP socket, written directly against the kernel ABI (`linux/if_xdp.h`): a UMEM, the
//! fill / completion / RX / TX rings mapped into this process, `bind` to one queue in copy
//! mode with `XDP_USE_NEED_WAKEUP`. This module and `bpf.rs` hold the crate's unsafe code.
//!
//! UMEM layout: `frames` chunks of `frame_size` bytes. The first half is lent to the kernel
//! through the fill ring for reception (every received chunk goes straight back to the fill
//! ring once its bytes were copied out, or, when lent to the application as an [`RxFrame`],
//! once that is dropped); the second half is the TX pool, recycled from the completion ring
//! (a chunk lent as a [`TxFrame`] leaves the pool until it is sent and completed, or dropped).
//!
//! The UMEM mapping is an [`Umem`] shared (`Arc`) by the socket and every lent frame, so a
//! frame the application holds stays mapped after the socket is gone. A lent frame dropped
//! (on any thread) goes on the UMEM's return queue (a mutex-protected vector allocated once,
//! with room for every chunk); the socket moves returned chunks to the fill ring or the TX
//! pool at its next receive or send.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use chunnel::util::lock;

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

/// The UMEM mapping, shared by the socket and the frames it lends; unmapped when the last
/// of them is gone.
pub(crate) struct Umem {
    ptr: *mut u8,
    len: usize,
    /// Receive chunks lent and not yet back in the fill ring.
    rx_out: AtomicUsize,
    /// Receive chunks dropped by the application, for the fill ring.
    rx_back: Mutex<Vec<u64>>,
    /// Transmit chunks lent and not yet back in the TX pool (dropped unsent) or the TX ring.
    tx_out: AtomicUsize,
    /// Transmit chunks dropped unsent, for the TX pool.
    tx_back: Mutex<Vec<u64>>,
}

// SAFETY: `ptr` is a private mapping owned by this value. The bytes of one chunk are accessed
// only by the single owner of that chunk at a time (the socket under its mutex, the kernel, or
// one lent frame), so sharing the pointer between threads does not race.
unsafe impl Send for Umem {}
// SAFETY: as above; the return queues are behind mutexes and the counters atomic.
unsafe impl Sync for Umem {}

impl Umem {
    /// Receive chunks lent to the application and not yet back in the fill ring.
    pub(crate) fn rx_out(&self) -> usize {
        self.rx_out.load(Ordering::Acquire)
    }

    fn back(&self, q: &Mutex<Vec<u64>>, chunk: u64) {
        // Never grows: the vector was allocated with room for every chunk of its half, and a
        // chunk is in it at most once.
        lock(q).push(chunk);
    }
}

impl Drop for Umem {
    fn drop(&mut self) {
        // SAFETY: unmaps the UMEM mapped in `Xsk::new`; the socket (whose kernel side pins the
        // pages) and every lent frame are gone, as they hold this value.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A received frame lent to the application: views `len` bytes at `start` in the UMEM (the
/// UDP payload) and gives its chunk back to the fill ring (through the return queue) on drop.
pub(crate) struct RxFrame {
    umem: Arc<Umem>,
    chunk: u64,
    start: usize,
    len: usize,
}

impl AsRef<[u8]> for RxFrame {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the range was bounds-checked against the UMEM when the frame was lent; the
        // chunk is this value's alone (the kernel gets it back only after this drops), and the
        // mapping lives as long as `umem`.
        unsafe { std::slice::from_raw_parts(self.umem.ptr.add(self.start), self.len) }
    }
}

impl Drop for RxFrame {
    fn drop(&mut self) {
        self.umem.back(&self.umem.rx_back, self.chunk);
    }
}

impl std::fmt::Debug for RxFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RxFrame")
            .field("chunk", &self.chunk)
            .field("len", &self.len)
            .finish()
    }
}

/// Hands a received frame to the application instead of the fill ring (see
/// [`Xsk::recv_lent`]).
pub(crate) struct Lender<'a> {
    umem: &'a Arc<Umem>,
    chunk: u64,
    addr: usize,
    len: usize,
    kept: &'a mut bool,
}

impl Lender<'_> {
    /// Lends `range` (inside the frame) to the application; the chunk stays out of the fill
    /// ring until the returned frame drops.
    pub(crate) fn lend(self, range: std::ops::Range<usize>) -> RxFrame {
        debug_assert!(range.end <= self.len);
        let end = range.end.min(self.len);
        let start = range.start.min(end);
        *self.kept = true;
        self.umem.rx_out.fetch_add(1, Ordering::AcqRel);
        RxFrame {
            umem: self.umem.clone(),
            chunk: self.chunk,
            start: self.addr + start,
            len: end - start,
        }
    }
}

/// A free transmit chunk lent to the application: `len` payload bytes after room for the
/// headers. Sent with [`Xsk::post_tx`]; dropped unsent, it goes back to the TX pool.
pub(crate) struct TxFrame {
    umem: Option<Arc<Umem>>,
    chunk: u64,
    len: usize,
}

impl TxFrame {
    fn umem(&self) -> &Umem {
        self.umem
            .as_deref()
            .expect("a TxFrame has its UMEM until sent")
    }

    /// The whole frame: headers (to be written) then the payload.
    pub(crate) fn frame_mut(&mut self) -> &mut [u8] {
        let n = crate::frame::HEADERS + self.len;
        // SAFETY: `lend_tx` checked HEADERS + len against the chunk size; the chunk is this
        // value's alone (out of the TX pool, not on the TX ring), and the mapping lives as long
        // as `umem`.
        unsafe { std::slice::from_raw_parts_mut(self.umem().ptr.add(self.chunk as usize), n) }
    }

    /// The payload's length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether this frame's chunk belongs to `umem`.
    pub(crate) fn is_of(&self, umem: &Arc<Umem>) -> bool {
        self.umem.as_ref().is_some_and(|u| Arc::ptr_eq(u, umem))
    }
}

impl AsMut<[u8]> for TxFrame {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.frame_mut()[crate::frame::HEADERS..]
    }
}

impl Drop for TxFrame {
    fn drop(&mut self) {
        if let Some(u) = &self.umem {
            u.back(&u.tx_back, self.chunk);
        }
    }
}

impl std::fmt::Debug for TxFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxFrame")
            .field("chunk", &self.chunk)
            .field("len", &self.len)
            .finish()
    }
}

/// One AF_XDP socket with its own UMEM.
pub(crate) struct Xsk {
    // Field order: rings are unmapped before the socket closes, the UMEM last (and only once
    // no lent frame holds it).
    fill: Ring,
    comp: Ring,
    rx: Ring,
    tx: Ring,
    fd: OwnedFd,
    shared: Arc<Umem>,
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
        let shared = Arc::new(Umem {
            ptr: umem,
            len: umem_len,
            rx_out: AtomicUsize::new(0),
            rx_back: Mutex::new(Vec::with_capacity(half as usize)),
            tx_out: AtomicUsize::new(0),
            tx_back: Mutex::new(Vec::with_capacity(half as usize)),
        });
        Ok(Xsk {
            fill,
            comp,
            rx,
            tx,
            fd,
            shared,
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
        self.recv_lent(max, |frame, _| f(frame))
    }

    /// As [`Xsk::recv_batch`], but `f` may lend a frame to the application with its
    /// [`Lender`]: that chunk stays out of the fill ring until the lent frame drops. Chunks
    /// dropped since the last call go back to the fill ring first.
    pub(crate) fn recv_lent(&mut self, max: usize, mut f: impl FnMut(&[u8], Lender<'_>)) -> usize {
        self.refill();
        let cons = self.rx.consumer().load(Ordering::Relaxed);
        let prod = self.rx.producer().load(Ordering::Acquire);
        let n = prod.wrapping_sub(cons).min(max as u32);
        if n == 0 {
            return 0;
        }
        let fprod = self.fill.producer().load(Ordering::Relaxed);
        let mut back = 0u32;
        for i in 0..n {
            // SAFETY: entries cons..prod were published by the kernel (acquire above).
            let d = unsafe { self.rx.entry::<libc::xdp_desc>(cons.wrapping_add(i)).read() };
            let start = d.addr as usize;
            let len = d.len as usize;
            let chunk = d.addr & !u64::from(self.frame_size - 1);
            let mut kept = false;
            if start.checked_add(len).is_some_and(|e| e <= self.umem_len) {
                // SAFETY: bounds checked against the UMEM; the kernel no longer writes this
                // chunk until we give it back through the fill ring below (or, lent, once the
                // lent frame dropped).
                let frame = unsafe { std::slice::from_raw_parts(self.umem.add(start), len) };
                let lender = Lender {
                    umem: &self.shared,
                    chunk,
                    addr: start,
                    len,
                    kept: &mut kept,
                };
                f(frame, lender);
            }
            if !kept {
                // SAFETY: the fill ring has room: every RX chunk is either in it, in the RX
                // ring, in the kernel or lent, and the ring holds all of them.
                unsafe {
                    self.fill
                        .entry::<u64>(fprod.wrapping_add(back))
                        .write(chunk)
                };
                back += 1;
            }
        }
        self.rx
            .consumer()
            .store(cons.wrapping_add(n), Ordering::Release);
        if back > 0 {
            self.fill
                .producer()
                .store(fprod.wrapping_add(back), Ordering::Release);
        }
        n as usize
    }

    /// Moves the receive chunks lent frames gave back to the fill ring; returns how many.
    pub(crate) fn refill(&mut self) -> usize {
        if self.shared.rx_out.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut q = lock(&self.shared.rx_back);
        let n = q.len() as u32;
        if n == 0 {
            return 0;
        }
        let fprod = self.fill.producer().load(Ordering::Relaxed);
        for (i, &chunk) in q.iter().enumerate() {
            // SAFETY: the fill ring has room for every RX chunk (see `recv_lent`).
            unsafe {
                self.fill
                    .entry::<u64>(fprod.wrapping_add(i as u32))
                    .write(chunk)
            };
        }
        q.clear();
        drop(q);
        self.fill
            .producer()
            .store(fprod.wrapping_add(n), Ordering::Release);
        self.shared.rx_out.fetch_sub(n as usize, Ordering::AcqRel);
        n as usize
    }

    /// The UMEM, shared with the frames this socket lends.
    pub(crate) fn umem(&self) -> &Arc<Umem> {
        &self.shared
    }

    /// A free TX chunk for a payload of `len` bytes (headers written around it when it is
    /// sent), or `None` when `len` does not fit a chunk, when half the TX pool is lent already
    /// (the other half stays for the copying send, which would otherwise wait for the
    /// application to emit or drop), or when the pool is empty.
    pub(crate) fn lend_tx(&mut self, len: usize) -> Option<TxFrame> {
        if crate::frame::HEADERS + len > self.frame_size as usize {
            return None;
        }
        self.reclaim();
        let pool = self.umem_len / self.frame_size as usize / 2;
        if self.shared.tx_out.load(Ordering::Acquire) >= pool / 2 {
            return None;
        }
        let chunk = self.free_tx.pop()?;
        self.shared.tx_out.fetch_add(1, Ordering::AcqRel);
        Some(TxFrame {
            umem: Some(self.shared.clone()),
            chunk,
            len,
        })
    }

    /// Puts lent TX frames on the TX ring: `next` gives the next one (its headers written,
    /// `frame_len` bytes in all); it is called only while the ring has room. One producer
    /// update, then a kick. Returns how many were queued.
    pub(crate) fn post_tx(&mut self, mut next: impl FnMut() -> Option<(TxFrame, usize)>) -> usize {
        self.reclaim();
        let prod = self.tx.producer().load(Ordering::Relaxed);
        let cons = self.tx.consumer().load(Ordering::Acquire);
        let room = self.tx.size - prod.wrapping_sub(cons);
        let mut n = 0u32;
        while n < room {
            let Some((mut f, frame_len)) = next() else {
                break;
            };
            debug_assert!(f.is_of(&self.shared) && frame_len <= self.frame_size as usize);
            f.umem = None; // sent: no longer returned on drop
            self.shared.tx_out.fetch_sub(1, Ordering::AcqRel);
            let d = libc::xdp_desc {
                addr: f.chunk,
                len: frame_len.min(self.frame_size as usize) as u32,
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
        if n > 0 || self.tx.needs_wakeup() || self.tx_in_flight() > 0 {
            self.kick_tx();
        }
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
        if self.shared.tx_out.load(Ordering::Acquire) > 0 {
            let mut q = lock(&self.shared.tx_back);
            let n = q.len();
            self.free_tx.extend(q.drain(..));
            drop(q);
            if n > 0 {
                self.shared.tx_out.fetch_sub(n, Ordering::AcqRel);
            }
        }
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
        if self.refill() > 0 && self.fill_needs_wakeup() {
            self.kick_rx();
        }
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
        (self.umem_len / self.frame_size as usize / 2)
            .saturating_sub(self.free_tx.len() + self.shared.tx_out.load(Ordering::Acquire))
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

struct UmemGuard(*mut u8, usize);

impl Drop for UmemGuard {
    fn drop(&mut self) {
        // SAFETY: unmaps the UMEM on an error path in `new`.
        unsafe { libc::munmap(self.0.cast(), self.1) };
    }
}
