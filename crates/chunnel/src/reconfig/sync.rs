//! The synchronisation primitives of the reconfiguration cell: `std`'s in every normal build,
//! [loom](https://docs.rs/loom)'s when built with `RUSTFLAGS="--cfg chunnel_loom"`, so that the model
//! checks in `tests/loom_reconfig.rs` explore every interleaving of the cell's own atomics,
//! mutexes and slot accesses (see docs/testing.md, "Model checking").
//!
//! [`Slot`] is the `UnsafeCell` that holds an implementation. Its accessors return guards
//! ([`SlotRef`], [`SlotMut`]) rather than references: under loom a guard is an access that
//! loom tracks for as long as it lives (across `.await`s too), so a write that overlaps a read
//! in any interleaving is reported; in a normal build the guards are plain references.
//!
//! `Arc`/`Weak` stay `std`'s (loom's `Arc` cannot be unsized to `Arc<dyn Switch>`, and has no
//! `Weak`): they only hold the cell, they are not part of the switch protocol.

use std::ops::{Deref, DerefMut};

#[cfg(chunnel_loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
#[cfg(chunnel_loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};
#[cfg(not(chunnel_loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
#[cfg(not(chunnel_loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};

/// An `UnsafeCell` whose accesses loom checks under `cfg(chunnel_loom)`.
#[derive(Debug)]
pub(crate) struct Slot<T> {
    #[cfg(not(chunnel_loom))]
    cell: std::cell::UnsafeCell<T>,
    #[cfg(chunnel_loom)]
    cell: loom::cell::UnsafeCell<T>,
}

impl<T> Slot<T> {
    pub(crate) fn new(value: T) -> Self {
        Slot {
            #[cfg(not(chunnel_loom))]
            cell: std::cell::UnsafeCell::new(value),
            #[cfg(chunnel_loom)]
            cell: loom::cell::UnsafeCell::new(value),
        }
    }

    /// A shared access for as long as the guard lives.
    ///
    /// # Safety
    ///
    /// No [`SlotMut`] of this slot may exist while the guard lives.
    pub(crate) unsafe fn get(&self) -> SlotRef<'_, T> {
        #[cfg(not(chunnel_loom))]
        // SAFETY: the caller excludes writers for the guard's lifetime.
        let r = SlotRef(unsafe { &*self.cell.get() });
        #[cfg(chunnel_loom)]
        let r = SlotRef(self.cell.get(), std::marker::PhantomData);
        r
    }

    /// An exclusive access for as long as the guard lives.
    ///
    /// # Safety
    ///
    /// No other guard of this slot may exist while the guard lives.
    pub(crate) unsafe fn get_mut(&self) -> SlotMut<'_, T> {
        #[cfg(not(chunnel_loom))]
        // SAFETY: the caller excludes every other access for the guard's lifetime.
        let r = SlotMut(unsafe { &mut *self.cell.get() });
        #[cfg(chunnel_loom)]
        let r = SlotMut(self.cell.get_mut(), std::marker::PhantomData);
        r
    }
}

/// A shared access to a [`Slot`].
#[cfg(not(chunnel_loom))]
pub(crate) struct SlotRef<'a, T>(&'a T);

/// A shared access to a [`Slot`] (tracked by loom while it lives).
#[cfg(chunnel_loom)]
pub(crate) struct SlotRef<'a, T>(loom::cell::ConstPtr<T>, std::marker::PhantomData<&'a T>);

// SAFETY: the guard stands for a `&'a T` (loom's pointer type is only `!Send` by being a raw
// pointer); it is `Send` and `Sync` exactly when `&T` is.
#[cfg(chunnel_loom)]
unsafe impl<T: Sync> Send for SlotRef<'_, T> {}
// SAFETY: as above.
#[cfg(chunnel_loom)]
unsafe impl<T: Sync> Sync for SlotRef<'_, T> {}

impl<T> Deref for SlotRef<'_, T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        #[cfg(not(chunnel_loom))]
        let r = self.0;
        #[cfg(chunnel_loom)]
        // SAFETY: `Slot::get`'s contract; loom checks it.
        let r = unsafe { self.0.deref() };
        r
    }
}

/// An exclusive access to a [`Slot`].
#[cfg(not(chunnel_loom))]
pub(crate) struct SlotMut<'a, T>(&'a mut T);

/// An exclusive access to a [`Slot`] (tracked by loom while it lives).
#[cfg(chunnel_loom)]
pub(crate) struct SlotMut<'a, T>(loom::cell::MutPtr<T>, std::marker::PhantomData<&'a mut T>);

impl<T> Deref for SlotMut<'_, T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        #[cfg(not(chunnel_loom))]
        let r = &*self.0;
        #[cfg(chunnel_loom)]
        // SAFETY: `Slot::get_mut`'s contract; loom checks it.
        let r = unsafe { &*self.0.deref() };
        r
    }
}

impl<T> DerefMut for SlotMut<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        #[cfg(not(chunnel_loom))]
        let r = &mut *self.0;
        #[cfg(chunnel_loom)]
        // SAFETY: `Slot::get_mut`'s contract; loom checks it.
        let r = unsafe { self.0.deref() };
        r
    }
}

/// The calling loom thread's id in the execution: 0 for the model's main thread, then 1, 2, …
/// in spawn order, the same in every execution (the lock-free gate's stripe of a thread).
#[cfg(chunnel_loom)]
pub(crate) fn loom_thread_id() -> usize {
    let id = format!("{:?}", loom::thread::current().id());
    id.trim_start_matches("ThreadId(")
        .trim_end_matches(')')
        .parse()
        .expect("loom's ThreadId prints as ThreadId(n)")
}

/// Bugs planted on purpose under `cfg(chunnel_loom)`, so a model check can show that it fails on them
/// (`tests/loom_reconfig.rs`, the `planted_*` tests). Set per OS thread: loom runs a model's
/// threads on the thread that called `loom::model`, and other tests are not affected.
#[cfg(chunnel_loom)]
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlantedBug {
    /// The code as shipped.
    None,
    /// The lock-free gate's `exit` uses `Relaxed` instead of `Release`: a call's last use of
    /// the implementation no longer happens before the switcher sees the gate drained.
    RelaxedExit,
    /// A blocked `recv` registers its waker without looking at the gate again afterwards: a
    /// switch that starts in between is missed (a lost wake-up).
    NoRecheck,
}

#[cfg(chunnel_loom)]
std::thread_local! {
    static PLANTED: std::cell::Cell<PlantedBug> = const { std::cell::Cell::new(PlantedBug::None) };
}

/// Plants `bug` for the model checks run on this thread from now on.
#[cfg(chunnel_loom)]
#[doc(hidden)]
pub fn plant_bug(bug: PlantedBug) {
    PLANTED.with(|p| p.set(bug));
}

/// Whether `bug` is planted (always false outside loom builds).
#[cfg(chunnel_loom)]
pub(crate) fn planted(bug: PlantedBug) -> bool {
    PLANTED.with(|p| p.get() == bug)
}
