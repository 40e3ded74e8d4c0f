//! A global allocator that counts allocations, for the tests that show a data path makes none.
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: chunnel_test::alloc::Counting = chunnel_test::alloc::Counting::new();
//!
//! let before = ALLOC.count();
//! // ... the steady state under test ...
//! assert_eq!(ALLOC.count() - before, 0);
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

/// Counts every allocation and reallocation, then defers to the system allocator.
#[derive(Debug)]
pub struct Counting {
    allocs: AtomicU64,
}

impl Counting {
    /// A counter at zero.
    pub const fn new() -> Self {
        Counting {
            allocs: AtomicU64::new(0),
        }
    }

    /// Allocations and reallocations so far, in every thread.
    pub fn count(&self) -> u64 {
        self.allocs.load(Ordering::Relaxed)
    }
}

impl Default for Counting {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: defers every call to `System`, only adding a counter.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.allocs.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        self.allocs.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
