//! `docs/evaluation.md` from the template and the figures' JSON: the template's `{{name.part}}`
//! lines are replaced by what [`sections`] generates from `figures/<name>.json`; every number
//! in a generated part comes from the JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::{Result, bail};
use serde_json::Value;

use super::soak::Soak;
use super::{Figure, Loaded};

mod overhead_metrics;
mod sched;
mod sections;

const TEMPLATE: &str = include_str!("evaluation.md.in");

/// A median with the smallest and largest of the repetitions it summarises.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spread {
    pub(crate) med: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
    pub(crate) runs: Option<u64>,
}

/// `{"median", "min", "max", "runs"}` as the benchmarks write it (see `stats::spread`).
pub(crate) fn spread(v: &Value) -> Option<Spread> {
    let med = v["median"].as_f64()?;
    Some(Spread {
        med,
        min: v["min"].as_f64().unwrap_or(med),
        max: v["max"].as_f64().unwrap_or(med),
        runs: v["runs"].as_u64(),
    })
}

/// One line of the summary table.
pub(crate) struct Headline {
    pub(crate) figure: &'static str,
    pub(crate) what: String,
    pub(crate) value: String,
    pub(crate) bar: String,
    pub(crate) met: Option<bool>,
}

/// What one figure contributes: named parts for the template and lines for the summary.
#[derive(Default)]
pub(crate) struct Section {
    pub(crate) parts: BTreeMap<&'static str, String>,
    pub(crate) headlines: Vec<Headline>,
}

impl Section {
    pub(crate) fn part(&mut self, name: &'static str, text: String) {
        self.parts.insert(name, text);
    }

    pub(crate) fn headline(
        &mut self,
        figure: &'static str,
        what: impl Into<String>,
        value: impl Into<String>,
        bar: impl Into<String>,
        met: Option<bool>,
    ) {
        self.headlines.push(Headline {
            figure,
            what: what.into(),
            value: value.into(),
            bar: bar.into(),
            met,
        });
    }
}

/// The whole document.
pub(crate) fn document(figures: &Loaded, soak: Option<&Soak>) -> Result<String> {
    let mut sections: Vec<(&'static Figure, Section)> = Vec::new();
    for f in super::FIGURES {
        let env = figures.iter().find(|(g, _)| g.name == f.name).map(|x| &x.1);
        let mut s = match env.filter(|e| e["result"].is_object()) {
            Some(e) => sections::render(f, e),
            None => Section::default(),
        };
        s.part("run", run_block(f, env));
        sections.push((f, s));
    }
    // The flood table and claim come from both flood runs.
    let get = |n: &str| sections.iter().find(|(f, _)| f.name == n).map(|x| &x.1);
    let (flood_table, flood_claim) = sections::flood_parts(get("flood"), get("flood_slow"));
    let mut parts: BTreeMap<String, String> = BTreeMap::new();
    let mut headlines = Vec::new();
    for (f, s) in sections {
        for (k, v) in s.parts {
            parts.insert(format!("{}.{k}", f.name), v);
        }
        headlines.extend(s.headlines);
    }
    parts.insert("flood.table".into(), flood_table);
    parts.insert("flood.claim".into(), flood_claim);
    parts.insert("machines".into(), machines(figures));
    parts.insert("summary".into(), summary(&headlines, figures));
    parts.insert("gaps".into(), gaps(&headlines));
    parts.insert("soak".into(), soak_section(soak));

    let mut out = String::new();
    let mut used = std::collections::BTreeSet::new();
    for line in TEMPLATE.lines() {
        let t = line.trim();
        if let Some(key) = t.strip_prefix("{{").and_then(|k| k.strip_suffix("}}")) {
            let key = key.trim();
            let known = parts.get(key).map(String::as_str);
            let known = match known {
                Some(k) => k,
                // A part the figure has no data for: nothing (the run block says why).
                None if is_figure_part(key) => "",
                None => bail!("the template names {{{{{key}}}}}, which nothing generates"),
            };
            used.insert(key.to_string());
            if known.is_empty() {
                // Drop the line and the blank line that would double up with the next one.
                if out.ends_with("\n\n") {
                    out.pop();
                }
                continue;
            }
            out.push_str(known.trim_end());
            out.push('\n');
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    for f in super::FIGURES {
        let key = format!("{}.run", f.name);
        if !used.contains(&key) {
            bail!("the template does not place {{{{{key}}}}}");
        }
    }
    // No run of blank lines from dropped parts.
    while out.contains("\n\n\n") {
        out = out.replace("\n\n\n", "\n\n");
    }
    Ok(out)
}

fn is_figure_part(key: &str) -> bool {
    key.split_once('.')
        .is_some_and(|(f, _)| super::FIGURES.iter().any(|g| g.name == f))
}

/// Where, when and how a figure was measured.
fn run_block(f: &Figure, env: Option<&Value>) -> String {
    let Some(e) = env else {
        return format!(
            "**Run.** Not measured yet: `{}` (after `{}`), or `chunnel-bench report --only {}`.",
            f.command(false),
            f.build(),
            f.name
        );
    };
    let mut s = String::new();
    if e["quick"].as_bool() == Some(true) {
        s.push_str(
            "*Short run (`--quick`): a smoke test of the tool, not a figure of record.*\n\n",
        );
    }
    let cmd = e["command"].as_str().unwrap_or("?");
    let build = e["build"].as_str().unwrap_or(f.build());
    let when = e["measured_on"].as_str().unwrap_or("an unrecorded date");
    match e["source"].as_str() {
        Some("seeded") => {
            let _ = write!(
                s,
                "**Run** (seeded). `{cmd}` (after `{build}`), measured {when}"
            );
            if let Some(load) = e["load_note"].as_str() {
                let _ = write!(s, ", {load}");
            }
            let _ = write!(
                s,
                "; {}. The numbers are transcribed from the hand-run report of the date given into \
                 `figures/{}.json`; `chunnel-bench report --only {}` replaces them with a run.",
                machine_line(&e["machine"]),
                f.name,
                f.name
            );
        }
        _ if e["result"].is_object() => {
            let _ = write!(s, "**Run.** `{cmd}` (after `{build}`), {when}");
            if let Some(w) = e["wall_seconds"].as_f64() {
                let _ = write!(s, ", {w:.0} s");
            }
            let m = &e["machine"];
            let _ = write!(s, "; {}", machine_line(m));
            if let Some(before) = m["load_before"].as_str() {
                let _ = write!(s, "; load average {before} before");
                if let Some(after) = e["load_after"].as_str() {
                    let _ = write!(s, ", {after} after");
                }
            }
            match m["taskset"].as_str() {
                Some(t) => {
                    let _ = write!(s, "; pinned by `{t}`");
                }
                None => s.push_str("; not pinned by `taskset` (the tool pins its own threads)"),
            }
            s.push('.');
        }
        _ => {
            let _ = write!(
                s,
                "**Run.** No measurement recorded: `{cmd}` (after `{build}`)."
            );
        }
    }
    if let Some(nr) = e.get("not_remeasured") {
        let kept = if e["result"].is_object() {
            " The figures above are from the run described here."
        } else {
            ""
        };
        let _ = write!(
            s,
            "\n\n*Not re-measured by the report of {}: {}.{kept}*",
            nr["on"].as_str().unwrap_or("?"),
            nr["why"].as_str().unwrap_or("?")
        );
    }
    s
}

fn machine_line(m: &Value) -> String {
    let mut parts = Vec::new();
    if let Some(d) = m["description"].as_str() {
        parts.push(d.to_string());
    } else {
        if let (Some(n), Some(cpu)) = (m["nproc"].as_u64(), m["cpu"].as_str()) {
            parts.push(format!("{n} × {cpu}"));
        }
        if let Some(k) = m["kernel"].as_str() {
            parts.push(format!("Linux {k}"));
        }
    }
    if parts.is_empty() {
        "machine not recorded".into()
    } else {
        parts.join(", ")
    }
}

/// The machines the figures were measured on.
fn machines(figures: &Loaded) -> String {
    let mut by: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for (f, e) in figures {
        if !e["result"].is_object() {
            continue;
        }
        let m = &e["machine"];
        let mut line = machine_line(m);
        if let Some(os) = m["os"].as_str() {
            line.push_str(&format!(", {os}"));
        }
        if let Some(r) = m["rustc"].as_str() {
            line.push_str(&format!(", {r}"));
        }
        by.entry(line).or_default().push(f.name);
    }
    if by.is_empty() {
        return "No figure has been measured yet.".into();
    }
    let mut s = String::from("| machine | figures |\n|---|---|\n");
    for (m, names) in by {
        let _ = writeln!(s, "| {m} | {} |", names.join(", "));
    }
    s.push_str(
        "\nAll on a Firecracker VM with 2 vCPUs shared with other builds; each figure's run \
         gives the load average while it ran.",
    );
    s
}

fn summary(headlines: &[Headline], figures: &Loaded) -> String {
    if headlines.is_empty() {
        return "No figure has been measured yet.".into();
    }
    let mut s = String::from(
        "Each claim with its bar; the sections below give the baseline, the spread, the command \
         and the machine.\n\n| figure | claim | measured | bar | met | measured on |\n\
         |---|---|---|---|---|---|\n",
    );
    for h in headlines {
        let on = figures
            .iter()
            .find(|(f, _)| f.name == h.figure)
            .map(|(_, e)| {
                let d = e["measured_on"].as_str().unwrap_or("?");
                let d = d.get(..10).unwrap_or(d);
                match (e["source"].as_str(), e["quick"].as_bool()) {
                    (Some("seeded"), _) => format!("{d} (seeded)"),
                    (_, Some(true)) => format!("{d} (quick run)"),
                    _ => d.to_string(),
                }
            })
            .unwrap_or_default();
        let met = match h.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "–",
        };
        let _ = writeln!(
            s,
            "| `{}` | {} | {} | {} | {met} | {on} |",
            h.figure, h.what, h.value, h.bar
        );
    }
    s
}

fn gaps(headlines: &[Headline]) -> String {
    let missed: Vec<&Headline> = headlines.iter().filter(|h| h.met == Some(false)).collect();
    if missed.is_empty() {
        return "Every bar in the summary is met by the figures above. Other gaps:".into();
    }
    let mut s = String::from("Bars the figures above do not meet:\n\n");
    for h in missed {
        let _ = writeln!(
            s,
            "* `{}`: {} is {} (bar {}).",
            h.figure, h.what, h.value, h.bar
        );
    }
    s.push_str("\nOther gaps:");
    s
}

fn soak_section(soak: Option<&Soak>) -> String {
    let Some(s) = soak.filter(|s| s.rows.len() >= 2) else {
        return String::new();
    };
    let (first, last) = (s.first(), s.last());
    let rates: Vec<f64> = s.served_per_s().iter().map(|x| x.1).collect();
    let mean = (last.served - first.served) / s.duration_s().max(f64::MIN_POSITIVE);
    let min_rate = rates.iter().copied().fold(f64::INFINITY, f64::min);
    let mut out = String::from(
        "## Soak: one hour of YCSB with live switches, restarts and malformed frames\n\n",
    );
    let _ = write!(
        out,
        "A long run's counters sampled over time (cumulative; `figures/soak.csv`, columns \
         `{}`). Over {}: {} requests served ({}/s on average, {}/s in the slowest interval), {} \
         errors, {} lost, {} malformed, {} switches, {} restarts; resident memory {} → {} KiB \
         (peak {}), open file descriptors {} → {} (peak {}).\n\n\
         ![soak: served/s, errors, RSS and file descriptors over time](figures/soak.png)\n",
        super::soak::HEADER.join(","),
        duration(s.duration_s()),
        thousands(last.served - first.served),
        thousands(mean),
        thousands(if min_rate.is_finite() { min_rate } else { 0.0 }),
        thousands(last.errors - first.errors),
        thousands(last.lost - first.lost),
        thousands(last.malformed - first.malformed),
        thousands(last.switches - first.switches),
        thousands(last.restarts - first.restarts),
        thousands(first.rss_kb),
        thousands(last.rss_kb),
        thousands(s.max(|r| r.rss_kb)),
        thousands(first.fds),
        thousands(last.fds),
        thousands(s.max(|r| r.fds)),
    );
    out
}

fn duration(secs: f64) -> String {
    if secs >= 3600.0 {
        format!("{:.1} h", secs / 3600.0)
    } else if secs >= 120.0 {
        format!("{:.0} min", secs / 60.0)
    } else {
        format!("{secs:.0} s")
    }
}

/// An integer with thousands separators: `12,345`.
pub(crate) fn thousands(x: f64) -> String {
    if !x.is_finite() {
        return "–".into();
    }
    let neg = x < 0.0;
    let digits = format!("{:.0}", x.abs());
    let mut s = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            s.push(',');
        }
        s.push(c);
    }
    if neg { format!("-{s}") } else { s }
}

#[cfg(test)]
mod tests {
    #[test]
    fn thousands() {
        assert_eq!(super::thousands(0.0), "0");
        assert_eq!(super::thousands(999.4), "999");
        assert_eq!(super::thousands(1000.0), "1,000");
        assert_eq!(super::thousands(1_234_567.0), "1,234,567");
        assert_eq!(super::thousands(-20_363.0), "-20,363");
    }
}
