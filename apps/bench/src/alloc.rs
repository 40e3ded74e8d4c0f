//! A global allocator that counts allocations, to show the data path makes none.
//!
//! Counting starts with the first [`count`] call: before that an allocation costs one
//! relaxed load more than the system allocator's, not an atomic increment, so the commands
//! that do not count (every figure but the allocation probes) measure the plain allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static COUNTING: AtomicBool = AtomicBool::new(false);

/// Counts every allocation and reallocation (once counting started), then defers to the
/// system allocator.
pub(crate) struct Counting;

fn counted() {
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: defers every call to `System`, only adding a counter.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        counted();
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        counted();
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Allocations counted so far; the first call starts counting (and returns 0).
pub(crate) fn count() -> u64 {
    COUNTING.store(true, Ordering::SeqCst);
    ALLOCS.load(Ordering::SeqCst)
}

#[cfg(test)]
mod tests {
    #[test]
    fn counts_allocations_once_started() {
        let before = super::count();
        let v = std::hint::black_box(vec![1u8; 10]);
        assert!(super::count() > before, "an allocation went uncounted");
        drop(v);
    }
}
