//! `docs/evaluation.md` is generated: `chunnel-bench report --from-json` regenerates it, byte
//! for byte, from `docs/figures/*.json` (and `docs/figures/soak.csv`) and the template in
//! `apps/bench/src/report/evaluation.md.in`. Edit the template or re-run the figures, then
//! `chunnel-bench report --from-json` to bring the document back in line.

use std::path::{Path, PathBuf};
use std::process::Command;

const DOCS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs");

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("chunnel-report-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("figures")).unwrap();
    d
}

/// Copies the inputs of the generator (the figures' JSON and the soak series) into `out`.
fn copy_inputs(out: &Path) {
    let figures = Path::new(DOCS).join("figures");
    for e in std::fs::read_dir(&figures).unwrap() {
        let p = e.unwrap().path();
        let ext = p.extension().and_then(|x| x.to_str());
        if matches!(ext, Some("json") | Some("csv")) {
            std::fs::copy(&p, out.join("figures").join(p.file_name().unwrap())).unwrap();
        }
    }
}

fn report(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_chunnel-bench"))
        .arg("report")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn committed_evaluation_is_what_the_json_generates() {
    let out = scratch("regen");
    copy_inputs(&out);
    let o = report(&["--from-json", "--no-plots", "--out", out.to_str().unwrap()]);
    assert!(
        o.status.success(),
        "report --from-json failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let generated = std::fs::read_to_string(out.join("evaluation.md")).unwrap();
    let committed = std::fs::read_to_string(Path::new(DOCS).join("evaluation.md")).unwrap();
    if generated != committed {
        let line = generated
            .lines()
            .zip(committed.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| generated.lines().count().min(committed.lines().count()));
        panic!(
            "docs/evaluation.md is not what `chunnel-bench report --from-json` generates; first \
             difference at line {}:\n  generated: {:?}\n  committed: {:?}\nregenerate with \
             `cargo run --release -p chunnel-bench -- report --from-json`",
            line + 1,
            generated.lines().nth(line).unwrap_or(""),
            committed.lines().nth(line).unwrap_or("")
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn check_mode_accepts_the_committed_document() {
    let o = report(&["--from-json", "--check", "--out", DOCS]);
    assert!(
        o.status.success(),
        "report --from-json --check: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn check_mode_refuses_an_edited_document() {
    let out = scratch("edited");
    copy_inputs(&out);
    let committed = std::fs::read_to_string(Path::new(DOCS).join("evaluation.md")).unwrap();
    std::fs::write(
        out.join("evaluation.md"),
        committed.replacen("# Evaluation", "# Evaluation (edited by hand)", 1),
    )
    .unwrap();
    let o = report(&["--from-json", "--check", "--out", out.to_str().unwrap()]);
    assert!(
        !o.status.success(),
        "--check accepted a hand-edited document"
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("is not what"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn from_json_runs_nothing_and_needs_no_json() {
    // An empty figures folder still renders: every section says it has no measurement.
    let out = scratch("empty");
    let o = report(&["--from-json", "--no-plots", "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let doc = std::fs::read_to_string(out.join("evaluation.md")).unwrap();
    assert!(
        doc.contains("Not measured yet: `taskset -c 0 ./target/release/chunnel-bench overhead`")
    );
    assert!(
        !doc.contains("{{"),
        "a placeholder was left in the document"
    );
    let _ = std::fs::remove_dir_all(&out);
}
