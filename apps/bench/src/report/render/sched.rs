//! The determinism experiment's sections (`chunnel-bench sched`, two bulk loads): the claim,
//! the table and the plot of a 1 ms periodic flow's one-way latency under a bulk flow on the
//! same connection, per scheduling policy.

use std::fmt::Write as _;

use serde_json::Value;

use super::sections::{med, plot, ratio, reps, us, us_sp};
use super::{Section, spread};

/// The policies in the order of the table, with how the document names them.
const MODES: [(&str, &str); 4] = [
    ("alone", "alone (no bulk flow: the baseline)"),
    ("fifo", "FIFO"),
    ("priority", "strict priority"),
    ("time_aware", "time-aware shaper"),
];

pub(super) fn render(figure: &'static str, r: &Value, s: &mut Section) {
    let res = &r["results"];
    let over = &r["ratio_over_alone"];
    if !res.is_object() {
        return;
    }
    let c = &r["config"];
    let load = format!(
        "bulk bursts of {} × {} B every {} µs",
        c["bulk_burst"], r["bulk_size"], c["bulk_every_us"]
    );
    let p99 = |m: &str| spread(&over[m]["p99"]);
    let fifo = p99("fifo");
    let prio = p99("priority");
    let tas = p99("time_aware");
    let best = ["fifo", "priority", "time_aware"]
        .into_iter()
        .min_by(|a, b| med(p99(a)).total_cmp(&med(p99(b))))
        .unwrap_or("fifo");
    let best_name = MODES.iter().find(|m| m.0 == best).map_or(best, |m| m.1);
    s.part(
        "claim",
        format!(
            "With {load} ({} Mbit/s received under FIFO) on the same connection, **the \
             periodic flow's p99 over its p99 alone is {} with FIFO, {} with strict priority \
             and {} with the time-aware shaper** ({}); the lowest here: {best_name}. Time-aware \
             shaper: a {} µs window per 1 ms cycle for the periodic class, guard band {} µs per \
             bulk message, the message queued {} µs ahead of its window.",
            us(med(spread(&res["fifo"]["bulk_mbps"]))),
            ratio(fifo),
            ratio(prio),
            ratio(tas),
            reps(fifo),
            c["window_us"],
            c["guard_us"],
            c["lead_us"],
        ),
    );
    let what = if figure == "sched" {
        "1 ms flow p99 under bulk / alone: FIFO, priority, time-aware"
    } else {
        "the same under heavy bulk: FIFO, priority, time-aware"
    };
    let checks = &r["checks"];
    let ok = checks["priority_p99_below_fifo"]
        .as_bool()
        .zip(checks["time_aware_p99_below_fifo"].as_bool())
        .map(|(a, b)| a || b);
    s.headline(
        "sched",
        what,
        format!("{:.2} / {:.2} / {:.2}", med(fifo), med(prio), med(tas)),
        "a policy below FIFO",
        ok,
    );
    let alt = if figure == "sched" {
        "periodic flow one-way latency p50 and p99 per policy under bulk"
    } else {
        "periodic flow one-way latency p50 and p99 per policy under heavy bulk"
    };
    s.part("plot", plot(figure, alt));
    let mut t = String::from(
        "| policy | p50 µs | p99 µs | p99 of those on time, µs | max µs | p99 / alone | max / \
         alone | handed over late / sent | lost | bulk Mbit/s | driver CPU |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (m, label) in MODES {
        let v = &res[m];
        let (p99r, maxr) = if m == "alone" {
            ("1".to_string(), "1".to_string())
        } else {
            (ratio(p99(m)), ratio(spread(&over[m]["max"])))
        };
        let _ = writeln!(
            t,
            "| {label} | {} | {} | {} | {} | {p99r} | {maxr} | {} / {} | {} | {} | {} |",
            us_sp(spread(&v["one_way_p50_us"])),
            us_sp(spread(&v["one_way_p99_us"])),
            us_sp(spread(&v["one_way_p99_on_time_us"])),
            us_sp(spread(&v["one_way_max_us"])),
            v["periodic_handed_over_late"],
            v["periodic_sent"],
            v["periodic_lost"],
            if m == "alone" {
                "–".to_string()
            } else {
                us_sp(spread(&v["bulk_mbps"]))
            },
            spread(&v["driver_thread_cpu"])
                .map_or("–".into(), |c| format!("{:.0} %", c.med * 100.0)),
        );
    }
    s.part("table", t);
}
