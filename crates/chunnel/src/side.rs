//! Which branch of a two-way choice: used by [`crate::Select`], [`crate::Either`] and the
//! errors of a switch between branches.

/// Which branch of a [`crate::Select`] to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The preferred branch (`left`).
    Left,
    /// The fallback branch (`right`).
    Right,
}
