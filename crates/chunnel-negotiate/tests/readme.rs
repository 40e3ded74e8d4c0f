//! The examples in the README and in the crate docs are doctests against published crates.
//!
//! The README's Rust blocks run as doctests of this crate (`ReadmeDoctests` in `src/lib.rs`,
//! which `cargo test --workspace` runs): they fail there if they stop compiling or running.
//! This test makes sure they cannot be skipped quietly: every README block is a shell or text
//! block or a plain `rust` block (no `ignore`, `no_run` or `compile_fail`), the include is in
//! place, and neither the README nor the crate docs of the published crates below use
//! `chunnel-test` (`publish = false`) or `ignore` an example.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every fenced block of a Markdown text: (line of the opening fence, info string, body).
fn blocks(md: &str) -> Vec<(usize, String, String)> {
    let mut out = Vec::new();
    let mut open: Option<(usize, String, String)> = None;
    for (i, line) in md.lines().enumerate() {
        let t = line.trim_start();
        if let Some(info) = t.strip_prefix("```") {
            match open.take() {
                None => open = Some((i + 1, info.trim().to_owned(), String::new())),
                Some(b) => out.push(b),
            }
        } else if let Some((_, _, body)) = &mut open {
            body.push_str(line);
            body.push('\n');
        }
    }
    assert!(open.is_none(), "an unclosed code block");
    out
}

#[test]
fn every_readme_example_is_a_doctest_that_runs() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let rust: Vec<_> = blocks(&readme)
        .into_iter()
        .filter(|(line, info, body)| match info.as_str() {
            "sh" | "text" => false,
            "rust" => {
                assert!(
                    !body.contains("chunnel_test"),
                    "README.md:{line}: uses chunnel-test, which is not published"
                );
                true
            }
            other => panic!(
                "README.md:{line}: a ```{other} block; Rust examples are plain ```rust blocks \
                 (compiled and run as doctests), anything else ```sh or ```text"
            ),
        })
        .collect();
    assert!(
        rust.len() >= 4,
        "the README's Rust examples: {}",
        rust.len()
    );
    // The first example is the facade's: at most 16 lines (fences included), no layer below it.
    let (line, _, first) = &rust[0];
    assert!(
        first.lines().count() + 2 <= 16,
        "README.md:{line}: the first example has {} lines, more than 16",
        first.lines().count() + 2
    );
    assert!(
        first.contains("chunnel_negotiate::{bind, connect")
            && !["udp::", "Client", "listen", "Tagged"]
                .iter()
                .any(|w| first.contains(w)),
        "README.md:{line}: the first example should use only the facade (bind, connect)"
    );
    let lib = std::fs::read_to_string(root().join("crates/chunnel-negotiate/src/lib.rs")).unwrap();
    assert!(
        lib.contains(r#"#[doc = include_str!("../../../README.md")]"#),
        "src/lib.rs no longer includes the README as doctests"
    );
}

/// Doc comments (`//!`, `///`) of every `.rs` file under `dir`, with their positions.
fn doc_lines(dir: &Path, out: &mut Vec<(PathBuf, usize, String)>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            doc_lines(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let text = std::fs::read_to_string(&p).unwrap();
            for (i, line) in text.lines().enumerate() {
                let t = line.trim_start();
                if let Some(doc) = t.strip_prefix("//!").or_else(|| t.strip_prefix("///")) {
                    out.push((p.clone(), i + 1, doc.trim().to_owned()));
                }
            }
        }
    }
}

#[test]
fn crate_doc_examples_use_published_crates_and_are_not_ignored() {
    // Every published library crate.
    let crates = [
        "chunnel",
        "chunnel-net",
        "chunnel-negotiate",
        "chunnel-rendezvous",
        "chunnel-secure",
        "chunnel-shm",
        "chunnel-std",
        "chunnel-uring",
        "chunnel-xdp",
    ];
    let mut bad = Vec::new();
    for c in crates {
        let mut lines = Vec::new();
        doc_lines(&root().join("crates").join(c).join("src"), &mut lines);
        for (path, line, doc) in lines {
            let ignored = doc
                .strip_prefix("```")
                .is_some_and(|info| info.split(',').any(|w| w.trim() == "ignore"));
            if ignored || doc.contains("chunnel_test::") || doc.contains("use chunnel_test") {
                bad.push(format!("{}:{line}: {doc}", path.display()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "doc examples that are ignored or use chunnel-test (not published):\n{}",
        bad.join("\n")
    );
}
