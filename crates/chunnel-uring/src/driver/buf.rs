//! The buffer pool: heap blocks the kernel reads and writes, and the provided-buffer ring a
//! multishot receive draws from and the reaper hands buffers back to.

use std::alloc::{self, Layout};
use std::io;
use std::mem;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU16, Ordering};

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
    arena: Block,
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
        let arena = Block::new(usize::from(count) * len, 64, false)?;
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
        unsafe { self.arena.ptr.as_ptr().add(usize::from(bid) * self.len) }
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
