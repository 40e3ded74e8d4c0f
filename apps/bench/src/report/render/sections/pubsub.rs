//! `chunnel-bench pubsub` (`pubsub.rs`, `pubsub_order.rs`): per broker, the Chunnel against
//! the client crate used directly (issue 23's bars), and the ordering experiment with the
//! paper's comparison (§7.2).

use std::fmt::Write as _;

use serde_json::Value;

use super::{Section, met, plot, rate, ratio, reps, spread, us_sp};

/// The brokers in the order of the document, with their names in prose.
const BROKERS: [(&str, &str); 3] = [("redis", "Redis"), ("nats", "NATS"), ("kafka", "Kafka")];

/// The paper's figure (§7.2): with one receiver, receiver-side ordering on AWS SQS gave a
/// median latency 63 % below service-side ordering.
const PAPER_P50_RATIO: f64 = 0.37;

fn name(key: &str) -> &str {
    BROKERS.iter().find(|b| b.0 == key).map_or(key, |b| b.1)
}

pub(super) fn pubsub(r: &Value, s: &mut Section) {
    let Some(brokers) = r["brokers"].as_object() else {
        return;
    };
    let present: Vec<(&str, &Value)> = BROKERS
        .iter()
        .filter_map(|(k, _)| brokers.get(*k).map(|v| (*k, v)))
        .collect();
    // The claim: the main baseline of every broker.
    let mut parts = Vec::new();
    for (k, b) in &present {
        let l = spread(&b["ratio_latency_p50"]);
        let t = spread(&b["ratio_throughput"]);
        parts.push(format!(
            "{}: p50 {}× (bar ≤ 1.1 — {}), throughput {}× (bar ≥ 0.9 — {})",
            name(k),
            ratio(l),
            met(l.map(|x| x.med <= 1.1)),
            ratio(t),
            met(t.map(|x| x.med >= 0.9))
        ));
        s.headline(
            "pubsub",
            format!("{}: Chunnel p50 publish→deliver / client crate's", name(k)),
            ratio(l),
            "≤ 1.1",
            l.map(|x| x.med <= 1.1),
        );
        s.headline(
            "pubsub",
            format!("{}: Chunnel throughput / client crate's", name(k)),
            ratio(t),
            "≥ 0.9",
            t.map(|x| x.med >= 0.9),
        );
        for (bname, x) in b["baselines"].as_object().into_iter().flatten() {
            let l = spread(&x["ratio_latency_p50"]);
            let t = spread(&x["ratio_throughput"]);
            s.headline(
                "pubsub",
                format!(
                    "{}: Chunnel p50 / client crate's, extra baseline `{bname}`",
                    name(k)
                ),
                ratio(l),
                "≤ 1.1",
                l.map(|x| x.med <= 1.1),
            );
            s.headline(
                "pubsub",
                format!(
                    "{}: Chunnel throughput / client crate's, extra baseline `{bname}`",
                    name(k)
                ),
                ratio(t),
                "≥ 0.9",
                t.map(|x| x.med >= 0.9),
            );
        }
    }
    if !parts.is_empty() {
        let first = present
            .first()
            .and_then(|(_, b)| spread(&b["ratio_latency_p50"]));
        s.part(
            "claim",
            format!(
                "**Through the Chunnel against the broker's client crate used directly, same \
                 run** ({}, {} B messages, bursts of {}): {}.",
                reps(first),
                r["size"],
                r["burst"],
                parts.join("; ")
            ),
        );
        s.part(
            "plot",
            plot(
                "pubsub",
                "Chunnel / client crate p50 latency and throughput per broker and baseline",
            ),
        );
    }
    let mut t = String::from(
        "| broker | variant | p50 µs | p99 µs | msgs/s | p50 ratio | p99 ratio | throughput \
         ratio |\n|---|---|---:|---:|---:|---:|---:|---:|\n",
    );
    let fig = |t: &mut String, broker: &str, label: &str, f: &Value, x: Option<&Value>| {
        let tp = spread(&f["throughput_msgs_per_s"]);
        let (l50, l99, tr) = match x {
            Some(x) => (
                ratio(spread(&x["ratio_latency_p50"])),
                ratio(spread(&x["ratio_latency_p99"])),
                ratio(spread(&x["ratio_throughput"])),
            ),
            None => (String::new(), String::new(), String::new()),
        };
        let _ = writeln!(
            t,
            "| {broker} | {label} | {} | {} | {} | {l50} | {l99} | {tr} |",
            us_sp(spread(&f["latency_p50_us"])),
            us_sp(spread(&f["latency_p99_us"])),
            rate_sp(tp),
        );
    };
    let mut what = String::new();
    for (k, b) in &present {
        fig(&mut t, name(k), "Chunnel", &b["chunnel"], None);
        fig(&mut t, name(k), "direct", &b["direct"], Some(b));
        let _ = writeln!(
            what,
            "* {} direct: {}.",
            name(k),
            b["direct_is"].as_str().unwrap_or("?")
        );
        for (bname, x) in b["baselines"].as_object().into_iter().flatten() {
            fig(
                &mut t,
                name(k),
                &format!("extra baseline `{bname}`"),
                &x["direct"],
                Some(x),
            );
            let _ = writeln!(
                what,
                "* {} extra baseline `{bname}`: {}.",
                name(k),
                x["direct_is"].as_str().unwrap_or("?")
            );
        }
    }
    t.push_str(
        "\nRatios are Chunnel / baseline per repetition (both measured in the same one), median \
         [min–max]; the other figures are median [min–max] over the repetitions. The baselines:\n\n",
    );
    t.push_str(&what);
    s.part("table", t);
    ordering(r, s);
}

fn rate_sp(sp: Option<super::Spread>) -> String {
    match sp {
        Some(x) if x.min != x.max => {
            format!("{} [{}–{}]", rate(x.med), rate(x.min), rate(x.max))
        }
        Some(x) => rate(x.med),
        None => "–".into(),
    }
}

fn ordering(r: &Value, s: &mut Section) {
    let Some(o) = r["ordering"].as_object() else {
        return;
    };
    let present: Vec<(&str, &Value)> = BROKERS
        .iter()
        .filter_map(|(k, _)| o.get(*k).map(|v| (*k, v)))
        .collect();
    if present.is_empty() {
        return;
    }
    let mut t = String::from(
        "| broker | ordering | receivers | p50 µs | p99 µs | msgs/s (each receiver gets all) |\n\
         |---|---|---:|---:|---:|---:|\n",
    );
    for (k, b) in &present {
        for mode in ["service", "receiver"] {
            for n in ["1", "4"] {
                let x = &b["modes"][mode][n];
                if x.is_null() {
                    continue;
                }
                let _ = writeln!(
                    t,
                    "| {} | {mode}-side{} | {n} | {} | {} | {} |",
                    name(k),
                    if mode == "receiver" {
                        format!(" ({} lanes)", b["lanes"])
                    } else {
                        String::new()
                    },
                    us_sp(spread(&x["latency_p50_us"])),
                    us_sp(spread(&x["latency_p99_us"])),
                    rate_sp(spread(&x["throughput_msgs_per_s"])),
                );
            }
        }
    }
    let _ = write!(
        t,
        "\nReceiver-side / service-side, per repetition, median [min–max] (the paper: {PAPER_P50_RATIO} \
         for p50 with one receiver, AWS SQS):\n\n\
         | broker | receivers | p50 | p99 | throughput |\n|---|---:|---:|---:|---:|\n"
    );
    let mut one = Vec::new();
    for (k, b) in &present {
        for n in ["1", "4"] {
            let x = &b["receiver_over_service"][n];
            if x.is_null() {
                continue;
            }
            let p50 = spread(&x["latency_p50"]);
            if n == "1" {
                one.push(format!("{} {}", name(k), ratio(p50)));
            }
            let _ = writeln!(
                t,
                "| {} | {n} | {} | {} | {} |",
                name(k),
                ratio(p50),
                ratio(spread(&x["latency_p99"])),
                ratio(spread(&x["throughput"])),
            );
        }
    }
    s.part("ordering", t);
    // Per broker: the paper's size (within 10 % of 0.37 or below), its direction only (below
    // 1), or neither.
    let (mut size, mut direction, mut neither) = (Vec::new(), Vec::new(), Vec::new());
    for (k, b) in &present {
        match spread(&b["receiver_over_service"]["1"]["latency_p50"]).map(|x| x.med) {
            Some(x) if x <= PAPER_P50_RATIO * 1.1 => size.push(name(k)),
            Some(x) if x < 1.0 => direction.push(name(k)),
            Some(_) => neither.push(name(k)),
            None => {}
        }
    }
    let list = |v: &[&str]| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(", ")
        }
    };
    let agree = format!(
        "the paper's size (0.37 or below) on {}; its direction only (receiver-side faster, by \
         less) on {}; neither (receiver-side no faster) on {}",
        list(&size),
        list(&direction),
        list(&neither)
    );
    s.part(
        "ordering_claim",
        format!(
            "**The paper's comparison, receiver-side over service-side ordering p50 with one \
             receiver: {}** ({}). Ours has {agree}.",
            one.join(", "),
            reps(
                present
                    .first()
                    .and_then(|(_, b)| spread(&b["receiver_over_service"]["1"]["latency_p50"]))
            ),
        ),
    );
    s.headline(
        "pubsub",
        "Receiver- / service-side ordering p50, one receiver (paper §7.2: 0.37 on AWS SQS)",
        one.join(", "),
        "reported, no bar",
        None,
    );
}
