//! The overhead section's metrics part: `Metered` stacks (no recorder; a Prometheus recorder)
//! against the 0-layer stack of the same repetition (`result.metrics` of `chunnel-bench
//! overhead`). Nothing when the JSON has no metrics rows (an older run).

use std::fmt::Write as _;

use serde_json::Value;

use super::Section;
use super::sections::{met, ratio};
use super::spread;

pub(super) fn render(r: &Value, s: &mut Section) {
    let m = &r["metrics"];
    let Some(rows) = m["rows"].as_array() else {
        return;
    };
    let mut t = String::from(
        "| transport | size | p50 metered / off | throughput metered / off | p50 metered+prometheus / off \
         | throughput metered+prometheus / off |\n|---|---|---|---|---|---|\n",
    );
    for x in rows {
        let _ = writeln!(
            t,
            "| {} | {} B | {} | {} | {} | {} |",
            x["transport"].as_str().unwrap_or("?"),
            x["size"],
            ratio(spread(&x["metered_p50_ratio_to_off"])),
            ratio(spread(&x["metered_throughput_ratio_to_off"])),
            ratio(spread(&x["metered_prometheus_p50_ratio_to_off"])),
            ratio(spread(&x["metered_prometheus_throughput_ratio_to_off"])),
        );
    }
    let udp64 = rows
        .iter()
        .find(|x| x["transport"] == "udp" && x["size"] == 64);
    let p50 = udp64.and_then(|x| spread(&x["metered_prometheus_p50_ratio_to_off"]));
    let tput = udp64.and_then(|x| spread(&x["metered_prometheus_throughput_ratio_to_off"]));
    let ok = match (p50, tput) {
        (Some(p), Some(q)) => Some(p.med <= 1.05 && q.med >= 0.95),
        _ => None,
    };
    let cg = &r["callgrind"]["metered_minus_zero_per_msg"];
    let instr = match (cg["noop"].as_f64(), cg["prometheus"].as_f64()) {
        (Some(a), Some(b)) => format!(
            " Under callgrind a `Metered` layer adds {a:.1} instructions per message traversal \
             with no recorder and {b:.1} with the Prometheus recorder (UDP, 64 B, bursts of 32)."
        ),
        _ => String::new(),
    };
    let allocs = m["allocations_per_msg_metered_prometheus"]
        .as_f64()
        .map_or(String::new(), |a| {
            format!(" Heap allocations per message through the metered stack: **{a}**.")
        });
    let _ = write!(
        t,
        "\n**Metrics on (a `Metered` layer on both ends counting into a Prometheus recorder) / \
         off (the 0-layer stack, no `Metered` layer), UDP 64 B: p50 {}, throughput {}** (bar: \
         p50 ≤ 1.05, throughput ≥ 0.95 — {}). Off is the stack without the layer: with the \
         crates' `metrics` features off their code is unchanged, so off is the 0-layer row \
         above.{instr}{allocs} The recorder counted {} messages in the run.",
        ratio(p50),
        ratio(tput),
        met(ok),
        m["prometheus_messages_counted"]
    );
    s.part("metrics", t);
    s.headline(
        "overhead",
        "metrics on (Metered + Prometheus) / off, p50 (UDP, 64 B)",
        ratio(p50),
        "≤ 1.05",
        ok,
    );
}
