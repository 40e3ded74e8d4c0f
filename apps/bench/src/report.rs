//! `chunnel-bench report`: runs every figure of `docs/evaluation.md`, keeps each one's JSON
//! under `docs/figures/`, draws the plots and regenerates `docs/evaluation.md` from a template
//! (`report/evaluation.md.in`) and that JSON.
//!
//! * Each figure is a subcommand of this binary run as a child process with the arguments the
//!   document gives (under `taskset` when the document pins it), so a figure is measured
//!   exactly as a reader would re-measure it. Its last stdout line (the JSON) is stored in
//!   `<out>/figures/<name>.json` inside an envelope that records the command, the machine and
//!   the time of the run.
//! * A figure whose needs are missing (root, the `stores` feature, a server binary) is
//!   skipped: its previous JSON is kept and the report says why it was not re-measured.
//! * `--from-json` runs nothing and regenerates the document (and the plots) from the JSON
//!   alone; the output depends on nothing else, so `--check` can tell whether the committed
//!   document is the generated one.
//! * Plots are drawn with `plotters` when the binary is built with the `report` feature; without
//!   it the Markdown is regenerated and the existing PNGs are left alone.

mod figures;
mod machine;
#[cfg(feature = "report")]
mod plot;
mod render;
mod soak;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

pub(crate) use figures::{FIGURES, Figure};

/// Options of `chunnel-bench report`.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Only these figures (comma-separated names, as in `docs/figures/<name>.json`); the
    /// document is still regenerated whole, from the JSON of the others.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Short runs of every figure (a smoke test of the tool, not figures to publish): the JSON
    /// records `"quick": true` and the document says so.
    #[arg(long)]
    quick: bool,
    /// Run nothing: regenerate the document and plots from the JSON already under
    /// `<out>/figures/`.
    #[arg(long)]
    from_json: bool,
    /// With `--from-json`: write nothing, fail if `<out>/evaluation.md` differs from what the
    /// JSON generates.
    #[arg(long, requires = "from_json")]
    check: bool,
    /// Directory of `evaluation.md`; figures go to its `figures/` folder.
    #[arg(long, default_value = "docs")]
    out: PathBuf,
    /// Forward every line the benchmarks print on stderr (otherwise a progress line every
    /// 15 s, and the last lines of a figure that fails).
    #[arg(long)]
    verbose: bool,
    /// Regenerate the document only; leave the PNGs as they are.
    #[arg(long)]
    no_plots: bool,
    /// List the figures, their commands and needs, and exit.
    #[arg(long)]
    list: bool,
}

pub(crate) fn run(a: Args) -> Result<()> {
    for name in &a.only {
        ensure!(
            FIGURES.iter().any(|f| f.name == name),
            "no figure {name:?}; figures: {}",
            FIGURES
                .iter()
                .map(|f| f.name)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if a.list {
        for f in FIGURES {
            println!(
                "{:<16} {}   (~{} s{})",
                f.name,
                f.command(false),
                f.expected_secs,
                f.needs_text()
            );
        }
        return Ok(());
    }
    let dir = a.out.join("figures");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let selected: Vec<&Figure> = FIGURES
        .iter()
        .filter(|f| a.only.is_empty() || a.only.iter().any(|n| n == f.name))
        .collect();

    if !a.from_json {
        let total: u64 = selected.iter().map(|f| f.expected(a.quick).as_secs()).sum();
        progress(&format!(
            "{} figure(s), about {} min in all{}",
            selected.len(),
            total.div_ceil(60),
            if a.quick { " (quick runs)" } else { "" }
        ));
        let started = Instant::now();
        for (i, f) in selected.iter().enumerate() {
            let path = dir.join(format!("{}.json", f.name));
            let tag = format!("[{}/{}] {}", i + 1, selected.len(), f.name);
            if let Some(why) = f.missing_need() {
                progress(&format!("{tag}: skipped ({why}); its last JSON is kept"));
                record_skip(&path, f, &why)?;
                continue;
            }
            match measure(f, a.quick, a.verbose, &tag) {
                Ok(envelope) => write_json(&path, &envelope)?,
                Err(e) => {
                    let why = format!("the run failed: {e:#}");
                    progress(&format!("{tag}: {why}; its last JSON is kept"));
                    record_skip(&path, f, &why)?;
                }
            }
        }
        progress(&format!(
            "all runs done in {:.0} s",
            started.elapsed().as_secs_f64()
        ));
    }

    let figures = load_all(&dir)?;
    let soak = soak::load(&dir.join("soak.csv"))?;
    let doc = render::document(&figures, soak.as_ref())?;
    let doc_path = a.out.join("evaluation.md");
    if a.check {
        let committed = std::fs::read_to_string(&doc_path)
            .with_context(|| format!("reading {}", doc_path.display()))?;
        if committed != doc {
            bail!(
                "{} is not what `chunnel-bench report --from-json` generates from {}; \
                 regenerate it with `chunnel-bench report --from-json --out {}`",
                doc_path.display(),
                dir.display(),
                a.out.display()
            );
        }
        progress(&format!("{} is up to date", doc_path.display()));
        return Ok(());
    }
    std::fs::write(&doc_path, &doc).with_context(|| format!("writing {}", doc_path.display()))?;
    progress(&format!("wrote {}", doc_path.display()));
    if !a.no_plots {
        draw(&dir, &figures, soak.as_ref())?;
    }
    Ok(())
}

#[cfg(feature = "report")]
fn draw(dir: &Path, figures: &Loaded, soak: Option<&soak::Soak>) -> Result<()> {
    for written in plot::all(dir, figures, soak)? {
        progress(&format!("drew {}", written.display()));
    }
    Ok(())
}

#[cfg(not(feature = "report"))]
fn draw(_dir: &Path, _figures: &Loaded, _soak: Option<&soak::Soak>) -> Result<()> {
    progress(
        "plots not drawn (build with `--features report` for them); the PNGs already there are kept",
    );
    Ok(())
}

/// One line of progress on stderr.
pub(crate) fn progress(line: &str) {
    eprintln!("[report] {line}");
}

/// Every figure's envelope by name, in the order of [`FIGURES`]; figures without JSON absent.
pub(crate) type Loaded = Vec<(&'static Figure, Value)>;

fn load_all(dir: &Path) -> Result<Loaded> {
    let mut out = Vec::new();
    for f in FIGURES {
        let path = dir.join(format!("{}.json", f.name));
        if !path.exists() {
            continue;
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let v: Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        out.push((f, v));
    }
    Ok(out)
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(v)?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Keeps the figure's last JSON and notes in it why this run did not re-measure it.
fn record_skip(path: &Path, f: &Figure, why: &str) -> Result<()> {
    let mut v = if path.exists() {
        serde_json::from_str(&std::fs::read_to_string(path)?)
            .with_context(|| format!("parsing {}", path.display()))?
    } else {
        json!({ "figure": f.name, "command": f.command(false) })
    };
    v["not_remeasured"] = json!({ "on": machine::utc_now(), "why": why });
    write_json(path, &v)
}

/// Runs one figure's command as a child of this executable and wraps its JSON line.
fn measure(f: &Figure, quick: bool, verbose: bool, tag: &str) -> Result<Value> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let args = f.args(quick);
    let mut cmd = match f.taskset {
        Some(cpus) => {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(cpus).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let machine = machine::describe(f.taskset);
    let expected = f.expected(quick);
    progress(&format!(
        "{tag}: {} (about {} s)",
        f.command(quick),
        expected.as_secs()
    ));
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", f.command(quick)))?;

    // stderr: forwarded (verbose) or kept as the last lines for an error message.
    let stderr = child.stderr.take().expect("piped");
    // Drained every 200 ms below and until the reader ends, so the bound is only a cushion.
    let (tx, rx) = mpsc::sync_channel::<String>(4096);
    let verbose_tag = f.name;
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if verbose {
                eprintln!("  {verbose_tag} | {line}");
            }
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut stdout = child.stdout.take().expect("piped");
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });

    // Four times the expected time, and at least two minutes, before giving up.
    let limit = (expected * 4).max(Duration::from_secs(120));
    let mut tail: Vec<String> = Vec::new();
    let mut last_note = Instant::now();
    let status = loop {
        while let Ok(line) = rx.try_recv() {
            tail.push(line);
            if tail.len() > 20 {
                tail.remove(0);
            }
        }
        if let Some(status) = child.try_wait()? {
            break status;
        }
        let elapsed = started.elapsed();
        if elapsed > limit {
            // The child is ours (its id from spawn).
            let _ = child.kill();
            let _ = child.wait();
            bail!("no result after {} s (limit)", limit.as_secs());
        }
        if !verbose && last_note.elapsed() >= Duration::from_secs(15) {
            last_note = Instant::now();
            progress(&format!(
                "{tag}: {:.0} s of about {} s{}",
                elapsed.as_secs_f64(),
                expected.as_secs(),
                tail.last()
                    .map(|l| format!(" | {}", shorten(l, 90)))
                    .unwrap_or_default()
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let wall = started.elapsed().as_secs_f64();
    while !reader.is_finished() {
        tail.extend(rx.try_iter());
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = reader.join();
    tail.extend(rx.try_iter());
    let out = out_reader.join().unwrap_or_default();
    let last = out.lines().rev().find(|l| !l.trim().is_empty());
    let parsed = last.and_then(|l| serde_json::from_str::<Value>(l).ok());
    let Some(result) = parsed.filter(|_| status.success()) else {
        let keep = tail.len().saturating_sub(8);
        bail!(
            "{status}; last lines on stderr:\n    {}",
            tail[keep..].join("\n    ")
        );
    };
    progress(&format!("{tag}: done in {wall:.0} s"));
    Ok(json!({
        "figure": f.name,
        "source": "measured",
        "measured_on": machine::utc_now(),
        "quick": quick,
        "build": f.build(),
        "command": f.command(quick),
        "wall_seconds": (wall * 10.0).round() / 10.0,
        "machine": machine,
        "load_after": machine::loadavg(),
        "result": result,
    }))
}

fn shorten(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n).collect();
        t.push('…');
        t
    }
}
