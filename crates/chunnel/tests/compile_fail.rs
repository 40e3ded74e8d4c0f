//! The compiler rejects a stack whose layers do not line up, and accepts one that does.
//!
//! The expected errors live in `tests/ui/*.stderr`; regenerate them with
//! `TRYBUILD=overwrite cargo test -p chunnel --test compile_fail` after a compiler upgrade and
//! check that each still names the mismatched boundary.

#[test]
fn mistyped_stacks_do_not_compile() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail_*.rs");
    t.pass("tests/ui/pass_*.rs");
}
