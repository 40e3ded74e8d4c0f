//! The buffer pool: heap blocks the kernel reads and writes, and the provided-buffer ring a
//! multishot receive draws from and the reaper hands buffers back to.

use std::alloc::{self, Layout};
use std::io;
use std::mem;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

/// A heap block with a chosen alignment, freed on drop (unless leaked).
pub(super) struct Block {
    pub(super) ptr: NonNull<u8>,
    layout: Layout,
}

impl Block {
    fn new(size: usize, align: usize, zeroed: bool) -> io::Result<Self> {
        let layout = Layout::from_size_align(size.max(1), align)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe {
            if zeroed {
                alloc::alloc_zeroed(layout)
            } else {
                alloc::alloc(layout)
            }
        };
        let ptr = NonNull::new(raw).ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        Ok(Block { ptr, layout })
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: allocated in `Block::new` with this layout and not freed since.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// One entry of a provided-buffer ring (`struct io_uring_buf`). The `resv` field of entry 0
/// doubles as the ring's tail (`struct io_uring_buf_ring`).
#[repr(C)]
struct RawBuf {
    addr: u64,
    len: u32,
    bid: u16,
    resv: u16,
}

/// The receive buffers: `count` buffers of `len` bytes in one never-zeroed arena, lent to the
/// kernel through a registered buffer ring.
pub(super) struct BufPool {
    pub(super) ring: Block,
    arena: Arc<Arena>,
    count: u16,
    len: usize,
    tail: u16,
}

impl BufPool {
    pub(super) fn new(count: u16, len: usize) -> io::Result<Self> {
        debug_assert!(count.is_power_of_two());
        // The ring must be page aligned; it is zeroed so the tail starts at 0.
        let ring = Block::new(usize::from(count) * mem::size_of::<RawBuf>(), 4096, true)?;
        // Never zeroed: the kernel writes a buffer before we read it, and only the bytes it
        // reports writing are read. Pages are only touched where datagrams land.
        let arena = Arc::new(Arena {
            block: Block::new(usize::from(count) * len, 64, false)?,
            len,
            count,
            returned: Mutex::new(Vec::with_capacity(usize::from(count))),
            lent: AtomicUsize::new(0),
        });
        let mut pool = BufPool {
            ring,
            arena,
            count,
            len,
            tail: 0,
        };
        for bid in 0..count {
            pool.give(bid);
        }
        pool.publish();
        Ok(pool)
    }

    fn buf_ptr(&self, bid: u16) -> *mut u8 {
        // SAFETY: bid < count, so the offset stays inside the arena.
        unsafe {
            self.arena
                .block
                .ptr
                .as_ptr()
                .add(usize::from(bid) * self.len)
        }
    }

    /// Buffers lent to the application now, of `count`.
    pub(super) fn lent(&self) -> (usize, usize) {
        (self.arena.lent(), usize::from(self.count))
    }

    /// Lends buffer `bid` to the application: bytes `off..off + len` of it, which the kernel
    /// wrote. It comes back through [`BufPool::take_back`] once the payload is dropped.
    pub(super) fn lend(&self, bid: u16, off: usize, len: usize) -> UringPayload {
        self.arena.lent.fetch_add(1, Ordering::Relaxed);
        UringPayload(Repr::Lent {
            arena: Arc::clone(&self.arena),
            bid,
            off: off as u32,
            len: len as u32,
        })
    }

    /// Queues every buffer the application gave back for the kernel (publish afterwards).
    pub(super) fn take_back(&mut self) {
        let arena = Arc::clone(&self.arena);
        let mut r = super::lock(&arena.returned);
        for &bid in r.iter() {
            self.give(bid);
        }
        r.clear();
    }

    /// The first `n` bytes of buffer `bid`, which the kernel reported writing.
    ///
    /// # Safety
    ///
    /// The kernel must have written at least `n` bytes into buffer `bid` (a completion said
    /// so), and the buffer must not have been given back to the kernel since.
    pub(super) unsafe fn filled(&self, bid: u16, n: usize) -> &[u8] {
        let n = n.min(self.len);
        // SAFETY: in bounds (n <= len, bid < count); initialised per the caller's contract;
        // the kernel does not write the buffer while we hold it.
        unsafe { std::slice::from_raw_parts(self.buf_ptr(bid), n) }
    }

    /// Queues buffer `bid` for the kernel (visible after [`BufPool::publish`]).
    pub(super) fn give(&mut self, bid: u16) {
        if bid >= self.count {
            return;
        }
        let mask = self.count - 1;
        let addr = self.buf_ptr(bid) as u64;
        let len = self.len as u32;
        // SAFETY: the slot index is masked into the ring; the kernel only reads entries
        // between its head and the published tail, and this one is past the tail. Fields are
        // written one by one so the tail (entry 0's `resv`) is never written here.
        unsafe {
            let e = self
                .ring
                .ptr
                .as_ptr()
                .cast::<RawBuf>()
                .add(usize::from(self.tail & mask));
            ptr::addr_of_mut!((*e).addr).write(addr);
            ptr::addr_of_mut!((*e).len).write(len);
            ptr::addr_of_mut!((*e).bid).write(bid);
        }
        self.tail = self.tail.wrapping_add(1);
    }

    /// Makes the buffers given so far visible to the kernel.
    pub(super) fn publish(&self) {
        // SAFETY: the tail is the `resv` field of entry 0 of the page-aligned ring, which
        // lives as long as `self`; the kernel reads it with acquire semantics.
        let tail = unsafe {
            AtomicU16::from_ptr(ptr::addr_of_mut!(
                (*self.ring.ptr.as_ptr().cast::<RawBuf>()).resv
            ))
        };
        tail.store(self.tail, Ordering::Release);
    }
}

/// The receive buffers' memory, shared by the pool and the payloads lent out of it, so a
/// payload held after its connection is gone still points at live memory.
pub(super) struct Arena {
    block: Block,
    len: usize,
    count: u16,
    /// Buffers the application gave back (payloads dropped), for the next reap to hand to
    /// the kernel. Capacity `count`, allocated once.
    returned: Mutex<Vec<u16>>,
    /// Buffers lent to the application now.
    lent: AtomicUsize,
}

// SAFETY: the block is plain memory; who may touch which buffer is decided by the buffer ring
// protocol (the kernel, the reaper under the driver's lock, or the one payload holding it),
// not by the thread.
unsafe impl Send for Arena {}
// SAFETY: as above; shared access only reads buffers held by payloads, and the return queue
// is behind a mutex.
unsafe impl Sync for Arena {}

impl Arena {
    /// Buffers lent to the application now.
    pub(super) fn lent(&self) -> usize {
        self.lent.load(Ordering::Relaxed)
    }

    fn give_back(&self, bid: u16) {
        let mut r = super::lock(&self.returned);
        // Never past the capacity: each buffer is lent at most once at a time.
        if r.len() < r.capacity() {
            r.push(bid);
        }
        drop(r);
        self.lent.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A received datagram: its provided buffer lent to the application (handed back to the
/// kernel's buffer ring once dropped, at the next reap) or a copy (when most buffers were
/// lent already, or for the copying `recv`). Reads as the datagram's bytes through
/// `AsRef<[u8]>`, so layers generic over `chunnel::Payload` work on it unchanged.
pub struct UringPayload(Repr);

enum Repr {
    Lent {
        arena: Arc<Arena>,
        bid: u16,
        off: u32,
        len: u32,
    },
    Copied(Bytes),
}

impl UringPayload {
    pub(super) fn copied(b: Bytes) -> Self {
        UringPayload(Repr::Copied(b))
    }

    /// Whether this is the kernel's receive buffer lent (false: a copy).
    pub fn is_lent(&self) -> bool {
        matches!(self.0, Repr::Lent { .. })
    }

    /// The bytes as `Bytes`: free for a copy, a copy (an allocation) for a lent buffer.
    pub(crate) fn into_bytes(self) -> Bytes {
        match &self.0 {
            Repr::Copied(b) => b.clone(),
            Repr::Lent { .. } => Bytes::copy_from_slice(self.as_ref()),
        }
    }
}

impl AsRef<[u8]> for UringPayload {
    fn as_ref(&self) -> &[u8] {
        match &self.0 {
            Repr::Lent {
                arena,
                bid,
                off,
                len,
            } => {
                let (off, len) = (*off as usize, *len as usize);
                assert!(
                    *bid < arena.count && off + len <= arena.len,
                    "lent range inside its buffer"
                );
                // SAFETY: in bounds of buffer `bid` (checked) inside the arena, which the Arc
                // keeps alive. The kernel wrote these bytes (a completion said so) and does
                // not write the buffer again until it is given back, which happens only when
                // this payload is dropped.
                unsafe {
                    std::slice::from_raw_parts(
                        arena
                            .block
                            .ptr
                            .as_ptr()
                            .add(usize::from(*bid) * arena.len + off),
                        len,
                    )
                }
            }
            Repr::Copied(b) => b,
        }
    }
}

impl std::ops::Deref for UringPayload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_ref()
    }
}

impl chunnel::Payload for UringPayload {}

impl std::fmt::Debug for UringPayload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringPayload")
            .field("lent", &self.is_lent())
            .field("len", &self.as_ref().len())
            .finish()
    }
}

impl Drop for UringPayload {
    fn drop(&mut self) {
        if let Repr::Lent { arena, bid, .. } = &self.0 {
            arena.give_back(*bid);
        }
    }
}

/// Send buffers a client connection lends (`LendBuffer::lend`): `count` blocks of `len`
/// bytes in one arena, allocated on the first `lend`.
pub(crate) struct SendPool {
    block: Block,
    len: usize,
    free: Mutex<Vec<u16>>,
}

// SAFETY: as for `Arena`: each block is written by the one `UringBuf` holding it, then read
// by the kernel while its send is in flight; the free list is behind a mutex.
unsafe impl Send for SendPool {}
// SAFETY: as above.
unsafe impl Sync for SendPool {}

impl SendPool {
    pub(crate) fn new(count: u16, len: usize) -> io::Result<Arc<Self>> {
        // Zeroed once (pages are touched only where buffers are used): a lent buffer is
        // always initialised memory, handed out as `&mut [u8]` without zeroing per lend.
        let block = Block::new(usize::from(count) * len, 64, true)?;
        Ok(Arc::new(SendPool {
            block,
            len,
            free: Mutex::new((0..count).rev().collect()),
        }))
    }

    /// A free block as a buffer of `len` bytes (holding whatever it held last). `None` when
    /// none is free or `len` is over the block size.
    pub(crate) fn lend(self: &Arc<Self>, len: usize) -> Option<UringBuf> {
        if len > self.len {
            return None;
        }
        let idx = super::lock(&self.free).pop()?;
        Some(UringBuf {
            pool: Arc::clone(self),
            idx,
            len: len as u32,
        })
    }
}

/// A send buffer lent by an io_uring client connection: a block of its send pool. Fill it
/// through `AsMut<[u8]>` and send it with `Emit::emit`: the kernel reads the datagram
/// straight from it (no copy in the datapath; UDP itself still copies into the socket
/// buffer, as for any send without `SEND_ZC`). Back in the pool when its send completed, or
/// when dropped unsent.
pub struct UringBuf {
    pool: Arc<SendPool>,
    idx: u16,
    len: u32,
}

impl UringBuf {
    fn ptr_mut(&mut self) -> *mut u8 {
        // SAFETY: idx < count (it came from the free list), so the offset is inside the block.
        unsafe {
            self.pool
                .block
                .ptr
                .as_ptr()
                .add(usize::from(self.idx) * self.pool.len)
        }
    }

    pub(super) fn ptr(&self) -> *const u8 {
        // SAFETY: as in `ptr_mut`.
        unsafe {
            self.pool
                .block
                .ptr
                .as_ptr()
                .add(usize::from(self.idx) * self.pool.len)
        }
    }

    /// The buffer's length (what was asked of `lend`).
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl AsMut<[u8]> for UringBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        let len = self.len();
        // SAFETY: the block is this buffer's alone until it is dropped (no send is in flight
        // while the application holds it: `emit` takes it by value); `len` fits the block,
        // which was zeroed when allocated.
        unsafe { std::slice::from_raw_parts_mut(self.ptr_mut(), len) }
    }
}

impl AsRef<[u8]> for UringBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: as in `as_mut`, shared.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len()) }
    }
}

impl std::fmt::Debug for UringBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringBuf").field("len", &self.len).finish()
    }
}

impl Drop for UringBuf {
    fn drop(&mut self) {
        super::lock(&self.pool.free).push(self.idx);
    }
}

impl std::fmt::Debug for SendPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendPool").field("len", &self.len).finish()
    }
}
